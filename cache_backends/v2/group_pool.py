"""Block bookkeeping of one V2 layer group: free list, reference counts, reusable (cached) blocks.

Every physical block id ``b`` in ``[0, num_blocks)`` is in exactly one state:

* **free** — on the free list; ``ref[b] == 0`` and no radix node holds it; its bytes mean nothing.
* **used** — ``ref[b] >= 1``: that many live caches have ``b`` in their block table.
* **evictable** (cached) — ``ref[b] == 0`` but a radix node holds it for prefix reuse; it sits in
  the :class:`EvictionQueue` and is reclaimed (evicted) when the free list runs dry.

So ``free + used + evictable == num_blocks`` always. A block held by a radix node ("attached") is
full and committed, hence immutable: nobody writes it again until it is evicted. Only attached
blocks are ever shared (``ref > 1`` implies attached). ``gen[b]`` counts how often ``b`` was handed
out, so a holder of ``(b, gen)`` can tell whether the bytes it remembers are still there.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cache_backends.v2.radix import RadixNode


class EvictionQueue:
    """Reusable blocks with no owner, in eviction order: lowest priority first, then least recently released.

    Add, remove and ``pop`` are O(1) apart from a heap over the distinct priorities present (O(log p)).
    """

    def __init__(self) -> None:
        self._by_prio: dict[int, OrderedDict[int, None]] = {}
        self._prio_of: dict[int, int] = {}
        self._heap: list[int] = []  # distinct priorities; an entry whose bucket emptied is dropped lazily
        self._in_heap: set[int] = set()

    def __len__(self) -> int:
        return len(self._prio_of)

    def __contains__(self, block: int) -> bool:
        return block in self._prio_of

    def add(self, block: int, priority: int) -> None:
        """Queue ``block`` as the most recently released of its priority."""
        bucket = self._by_prio.get(priority)
        if bucket is None:
            bucket = self._by_prio[priority] = OrderedDict()
            if priority not in self._in_heap:
                heapq.heappush(self._heap, priority)
                self._in_heap.add(priority)
        bucket[block] = None
        self._prio_of[block] = priority

    def remove(self, block: int) -> None:
        """Take ``block`` out of the queue (it is being reused)."""
        priority = self._prio_of.pop(block)
        bucket = self._by_prio[priority]
        del bucket[block]
        if not bucket:
            del self._by_prio[priority]

    def pop(self) -> int:
        """The next block to evict; ``IndexError`` when empty."""
        while self._heap:
            priority = self._heap[0]
            bucket = self._by_prio.get(priority)
            if bucket is None:
                heapq.heappop(self._heap)
                self._in_heap.discard(priority)
                continue
            block, _ = bucket.popitem(last=False)
            del self._prio_of[block]
            if not bucket:
                del self._by_prio[priority]
            return block
        raise IndexError("no evictable block")

    def blocks(self) -> list[int]:
        """Every queued block, in eviction order (for checks and tests)."""
        return [b for p in sorted(self._by_prio) for b in self._by_prio[p]]


class GroupPool:
    """Free list, reference counts, radix attachment and eviction queue of one group's blocks."""

    def __init__(self, name: str, num_blocks: int) -> None:
        self.name = name
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.gen = [0] * num_blocks
        self.node: list[RadixNode | None] = [None] * num_blocks  # radix node holding the block, if any
        self.priority = [0] * num_blocks  # eviction priority, set when the last owner lets go
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out low ids first
        self.evictable = EvictionQueue()
        self.num_used = 0
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Cached blocks nobody owns (reclaimable)."""
        return len(self.evictable)

    @property
    def available(self) -> int:
        """Blocks an allocation can get: free plus evictable."""
        return len(self._free) + len(self.evictable)

    def allocate(self, detach) -> int:
        """Hand out one block with ``ref == 1``: a free one, else evict the next cached one.

        ``detach(node, group, block)`` unhooks an evicted block from its radix node. Raises
        ``IndexError`` when nothing is available (callers check :attr:`available` first).
        """
        if self._free:
            b = self._free.pop()
        else:
            b = self.evictable.pop()
            detach(self.node[b], self.name, b)
            self.node[b] = None
            self.evictions += 1
        self.gen[b] += 1
        self.ref[b] = 1
        self.num_used += 1
        return b

    def allocate_many(self, n: int, detach) -> list[int]:
        """``n`` × :meth:`allocate` in one call (same blocks, same order); ``IndexError`` if fewer are available.

        Free blocks first (as :meth:`allocate` pops them), then evictions; nothing changes on error.
        """
        if n > self.available:
            raise IndexError(f"group {self.name}: {n} blocks asked, {self.available} free or evictable")
        free = self._free
        k = min(n, len(free))
        out = free[len(free) - k:][::-1]  # what k pops would return, in that order
        del free[len(free) - k:]
        for _ in range(n - k):
            b = self.evictable.pop()
            detach(self.node[b], self.name, b)
            self.node[b] = None
            out.append(b)
        self.evictions += n - k
        gen, ref = self.gen, self.ref
        for b in out:
            gen[b] += 1
            ref[b] = 1
        self.num_used += n
        return out

    def incref(self, b: int) -> None:
        """One more cache holds ``b`` (a reused or reclaimed cached block)."""
        if self.ref[b] == 0:
            if b not in self.evictable:
                raise RuntimeError(f"group {self.name}: block {b} is free, it cannot be shared")
            self.evictable.remove(b)
            self.num_used += 1
        self.ref[b] += 1

    def decref(self, b: int, priority: int, keep_cached: bool, detach) -> None:
        """One holder lets go of ``b``; at zero an attached block is cached (or dropped), others go free."""
        if self.ref[b] <= 0:
            raise RuntimeError(f"group {self.name}: block {b} released more often than held")
        self.ref[b] -= 1
        if self.ref[b]:
            return
        self.num_used -= 1
        if self.node[b] is not None and keep_cached:
            self.priority[b] = priority
            self.evictable.add(b, priority)
            return
        if self.node[b] is not None:
            detach(self.node[b], self.name, b)
            self.node[b] = None
        self._free.append(b)

    def free_ids(self) -> list[int]:
        """The free list's blocks (for checks and tests)."""
        return list(self._free)
