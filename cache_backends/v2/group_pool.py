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
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from operator import itemgetter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cache_backends.v2.radix import RadixNode


#: A queued shared-prefix block that no hit took back while this many pools' worth of blocks were queued after it is
#: stale: it is moved to the front of its priority's leaves. Why: shared blocks are evicted after every leaf and held
#: back from admission (``SHARED_HOLD``), so a system prompt nobody uses any more kept that room from every later
#: request (mixed traffic followed by unique prompts: V2 took 1.9x the steps on tiny-mistral at half the budget). Eight
#: keeps every hit of ``mixed`` (four pools lost some on the tight cells: tiny-mistral 30.4% -> 29.0%).
STALE_POOLS = 8

#: A bucket's key orders sharedness above priority: priorities are integers of at most 64 bits (the API bounds them
#: to 2**63 - 1 in size), shifted to be non-negative below the shared bit.
_SHARED_BIT = 64


def _key_of(priority: int, shared: bool) -> int:
    """The bucket of blocks queued at ``priority`` (shared or not): lower keys are evicted first."""
    return (shared << _SHARED_BIT) + priority + (1 << 63)


class EvictionQueue:
    """Reusable blocks with no owner, in eviction order: every leaf before any shared prefix; within each, lowest
    priority first; then least recently released.

    A **shared prefix** is a radix run that other prompts branch from (the run has children when its block is let go):
    a system prompt, a few-shot preamble. Its blocks are what later prompts hit, while a leaf's — one prompt's own
    question, one answer — are hit again only by that conversation's next turn. Plain LRU evicts a system prompt
    released a moment before a burst of unrelated prompts; SGLang's radix cache never evicts a node that has
    children while a leaf is left. This is that rule at the granularity of a release: a block is queued shared or
    not by the shape of its run when the last holder lets go (a hit takes it out of the queue, so the next release
    sees the run's shape then). Why it matters most for V2: a sliding-window group lets a system prompt's blocks go
    when a long request moves past them, long before the full-attention groups let go of theirs, and without this
    the window blocks every hit needs were evicted first (tiny-gemma3 on ``kvload simulate --workload mixed``).

    Why sharedness outranks priority: a block's priority is its last releaser's, and a system prompt serves requests
    of every priority, so the batch request that happened to let go of it last says nothing about who hits it next.
    Ranked by priority first, an urgent request's own question outlived the system prompts every later request
    needed (``mixed`` with a quarter urgent under ``scheduling_policy=priority``: V2 reused 29.1% of prompt tokens
    against V1's 36.2% on tiny-mistral; leaves first, 36.4%). Priority still orders the leaves (an urgent
    conversation's history outlives a batch one's) and the shared prefixes among themselves.

    A shared block no hit takes back while ``STALE_POOLS`` pools' worth of blocks are queued after it is demoted to
    the front of its priority's leaves: a system prompt nobody uses any more does not outlive every leaf for good.

    Add, remove and ``pop`` are O(1) apart from a heap over the distinct (shared, priority) keys present
    (O(log p)); ``add_many`` / ``pop_many`` do the same for a run of blocks in one call; a demotion is O(1) a block.
    """

    def __init__(self, priority: list[int]) -> None:
        self._by_key: dict[int, OrderedDict[int, None]] = {}
        self._prio = priority  # priority[b]: what a queued block was queued with (the pool's list, shared)
        self._key = [0] * len(priority)  # the bucket a queued block is in: _key_of(priority, shared)
        self._heap: list[int] = []  # distinct keys; an entry whose bucket emptied is dropped lazily
        self._in_heap: set[int] = set()
        self._len = 0
        self.num_shared = 0  # queued blocks of shared prefixes (admission may hold them: KVCacheManagerV2.held_back)
        self._clock = 0  # blocks queued so far; a bucket maps each block to the clock it was queued at
        self._stale = STALE_POOLS * len(priority)  # a shared block queued this many blocks ago is demoted

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: int) -> bool:
        bucket = self._by_key.get(self._key[block]) if 0 <= block < len(self._key) else None
        return bucket is not None and block in bucket

    def _bucket(self, key: int) -> OrderedDict[int, None]:
        bucket = self._by_key.get(key)
        if bucket is None:
            bucket = self._by_key[key] = OrderedDict()
            if key not in self._in_heap:
                heapq.heappush(self._heap, key)
                self._in_heap.add(key)
        return bucket

    def _adopt(self, key: int, bucket: OrderedDict[int, None]) -> None:
        """Make ``bucket`` (blocks stored into it as :meth:`add_many` stores them) the queue's bucket for ``key``,
        which has none."""
        self._by_key[key] = bucket
        if key not in self._in_heap:
            heapq.heappush(self._heap, key)
            self._in_heap.add(key)

    def add(self, block: int, priority: int, shared: bool = False) -> None:
        """Queue ``block`` as the most recently released of its priority (and sharedness)."""
        self.add_many((block,), priority, shared)

    def add_many(self, blocks: Sequence[int], priority: int, shared: bool = False) -> None:
        """Queue ``blocks`` (none of them queued) in order, as the most recently released of their priority;
        ``shared``: they belong to a shared prefix, evicted after every leaf."""
        key = (shared << _SHARED_BIT) + priority + (1 << 63)  # _key_of, inlined: a call per release and slide
        bucket = self._by_key.get(key)
        if bucket is None:
            bucket = self._bucket(key)
        prio, keys, clock = self._prio, self._key, self._clock
        for b in blocks:
            bucket[b] = clock
            prio[b] = priority
            keys[b] = key
        self._clock = clock + len(blocks)
        self._len += len(blocks)
        if shared:
            self.num_shared += len(blocks)
        if self.num_shared:
            self._demote_stale()

    def add_released(self, blocks: Sequence[int], priority: int, ref: list[int]) -> int:
        """:meth:`add_many` of leaves' ``blocks``, each one's reference count ``ref[b]`` set to 0 in the same pass: a
        keyed finish's blocks let go and queued in one loop (``SharedPool.release_tables``), not two. How many were
        queued anew: fewer than ``len(blocks)`` when one was listed twice or was queued already (the caller's error)."""
        key = priority + (1 << 63)  # _key_of(priority, False), inlined
        bucket = self._by_key.get(key)
        if bucket is None:
            bucket = self._bucket(key)
        prio, keys, clock, before = self._prio, self._key, self._clock, len(bucket)
        for b in blocks:  # this loop runs for every block a keyed finish queues: kept lean
            bucket[b] = clock
            prio[b] = priority
            keys[b] = key
            ref[b] = 0
        self._clock = clock + len(blocks)
        added = len(bucket) - before  # a repeated block overwrote its entry: counted once, as it is queued
        self._len += added
        if self.num_shared:
            self._demote_stale()
        return added

    def _demote_stale(self) -> None:
        """Move shared blocks queued ``_stale`` blocks ago or earlier to the front of their priority's leaves (each
        shared bucket is in queue order, so only its oldest blocks are looked at)."""
        limit = self._clock - self._stale
        for key in [k for k in self._by_key if k >> _SHARED_BIT]:  # a snapshot: buckets are made and dropped below
            bucket = self._by_key[key]
            stale = list(itertools.takewhile(lambda item: item[1] < limit, bucket.items()))
            if not stale:
                continue
            leaf_key = key - (1 << _SHARED_BIT)
            leaves = self._bucket(leaf_key)
            for b, at in reversed(stale):  # the oldest ends up first
                del bucket[b]
                leaves[b] = at
                leaves.move_to_end(b, last=False)
                self._key[b] = leaf_key
            self.num_shared -= len(stale)
            if not bucket:
                del self._by_key[key]

    def add_split(self, blocks: Sequence[int], owner: Sequence[RadixNode | None], priority: int) -> None:
        """:meth:`add_many` for blocks whose run is ``owner[b]``: those of a run with children queued as shared."""
        leaves: list[int] = []
        shared: list[int] = []
        for b in blocks:
            (shared if owner[b].children else leaves).append(b)  # type: ignore[union-attr]
        if leaves:
            self.add_many(leaves, priority)
        if shared:
            self.add_many(shared, priority, True)

    def remove(self, block: int) -> None:
        """Take ``block`` out of the queue (it is being reused); ``KeyError`` if it is not queued."""
        if not 0 <= block < len(self._key):
            raise KeyError(block)
        self.remove_many((block,))

    def remove_many(self, blocks: Sequence[int]) -> None:
        """Take each of ``blocks`` (ids of the pool) out of the queue, in one pass: a prefix hit takes back every cached
        block it claims, blocks x groups of them on a shared arena. ``KeyError`` on the first one not queued (the ones
        before it are out)."""
        by_key, keys, bit = self._by_key, self._key, _SHARED_BIT
        n = len(blocks)
        if n > 1:  # the usual hit: blocks one release queued together, so all in one bucket (checked at C speed)
            at = itemgetter(*blocks)(keys)
            key = at[0]
            bucket = by_key.get(key)
            if bucket is not None and at.count(key) == n:
                try:
                    for b in blocks:
                        del bucket[b]
                except KeyError:  # a block never queued or taken out: as the loop below, the ones before it are out
                    if not bucket:
                        del by_key[key]
                    self._len = sum(map(len, by_key.values()))
                    self.num_shared = sum(len(bucket) for key, bucket in by_key.items() if key >> bit)
                    raise KeyError(b) from None
                if not bucket:
                    del by_key[key]
                self._len -= n
                self.num_shared -= (key >> bit) * n
                return
        shared = 0
        try:
            for b in blocks:  # this loop runs for every block a hit takes back: kept lean
                key = keys[b]
                bucket = by_key[key]  # a block never queued, or taken out, is not in its (stale) key's bucket
                del bucket[b]
                if not bucket:
                    del by_key[key]
                shared += key >> bit
        except KeyError:  # the ones before it are out: count what is left
            self._len = sum(map(len, by_key.values()))
            self.num_shared = sum(len(bucket) for key, bucket in by_key.items() if key >> bit)
            raise KeyError(b) from None
        self._len -= len(blocks)
        self.num_shared -= shared

    def claim_many(self, blocks: Sequence[int], ref: list[int]) -> None:
        """Each of ``blocks`` (queued, held by nobody) gets ``ref[b] = 1`` and leaves the queue: the stores of a loop
        over ``blocks`` then :meth:`remove_many`, in one pass when every block is in one bucket (a prefix hit on a
        finished turn's history, queued by one release); ``KeyError`` as :meth:`remove_many` (every ``ref`` set)."""
        n = len(blocks)
        if n > 1:
            keys = self._key
            at = itemgetter(*blocks)(keys)
            key = at[0]
            bucket = self._by_key.get(key)
            if bucket is not None and at.count(key) == n:
                try:
                    for b in blocks:  # this loop runs for every block a hit claims: kept lean
                        del bucket[b]
                        ref[b] = 1
                except KeyError:  # as remove_many: the ones before it are out, and every reference is set
                    for b in blocks:
                        ref[b] = 1
                    by_key = self._by_key
                    if not bucket:
                        del by_key[key]
                    self._len = sum(map(len, by_key.values()))
                    self.num_shared = sum(len(bk) for k, bk in by_key.items() if k >> _SHARED_BIT)
                    raise
                if not bucket:
                    del self._by_key[key]
                self._len -= n
                self.num_shared -= (key >> _SHARED_BIT) * n
                return
        for b in blocks:
            ref[b] = 1
        self.remove_many(blocks)

    def count_shared(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` (queued) are queued as shared prefixes' blocks (:attr:`num_shared` counts them)."""
        return sum(map((1 << _SHARED_BIT).__le__, map(self._key.__getitem__, blocks)))

    def requeue(self, leaves: list[int], shared: list[int], priority: int) -> None:
        """Take ``leaves`` and ``shared`` (queued blocks) out, then queue ``leaves`` and then ``shared`` (as a shared
        prefix's) as the most recently released of ``priority``: exactly :meth:`remove_many` of both, then
        :meth:`add_many` of each — what claiming cached blocks and letting go of them at once does (a refused
        admission: ``KVCacheManagerV2.refuse_hit``).

        Why a method: the waiting head of a queue under pressure is refused step after step with the same cached
        history, mostly already in the bucket it goes back to; then each list is moved to its bucket's young end at C
        speed (Gemma 3 27B: a history's blocks in 31 groups, every step) instead of a Python loop per block."""
        leaf_key, shared_key = _key_of(priority, False), _key_of(priority, True)
        keys = list(map(self._key.__getitem__, leaves + shared))
        n_leaves, n_shared = len(leaves), len(shared)
        by_key = self._by_key
        if (keys[:n_leaves].count(leaf_key) != n_leaves or keys[n_leaves:].count(shared_key) != n_shared
                or (leaves and leaf_key not in by_key) or (shared and shared_key not in by_key)):
            self.remove_many(leaves + shared)  # (raises KeyError, as remove_many does, on a block not queued)
            if leaves:
                self.add_many(leaves, priority)
            if shared:
                self.add_many(shared, priority, True)
            return
        # every block is in the bucket it goes back to, so its priority and key stay as they are; the shared ones are
        # out of the queue while the leaves go back (the leaves' add_many demotes stale shared blocks without them)
        if shared:
            bucket = by_key[shared_key]
            deque(map(bucket.__delitem__, shared), maxlen=0)
            if not bucket:
                del by_key[shared_key]
            self._len -= n_shared
            self.num_shared -= n_shared
        if leaves:
            bucket = by_key[leaf_key]
            deque(map(bucket.move_to_end, leaves), maxlen=0)
            clock = self._clock
            bucket.update(zip(leaves, repeat(clock)))  # (existing keys: the place move_to_end gave them is kept)
            self._clock = clock + n_leaves
            if self.num_shared:
                self._demote_stale()
        if shared:
            clock = self._clock
            self._bucket(shared_key).update(zip(shared, repeat(clock)))  # as add_many: one clock for the call
            self._clock = clock + n_shared
            self._len += n_shared
            self.num_shared += n_shared
            self._demote_stale()

    def refresh(self, blocks: Iterable[int]) -> None:
        """Move each of ``blocks`` that is queued to the young end of its bucket, as if released now: its priority and
        sharedness kept; one not queued is skipped. A finish on a sliding window requeues this way the blocks its
        window let go that a hit on its history still needs (``KVCacheManagerV2._refresh_window_head``)."""
        by_key, keys, clock = self._by_key, self._key, self._clock
        blocks = list(blocks)
        if len(set(map(keys.__getitem__, blocks))) == 1:  # one bucket (a finish's window blocks): at C speed
            bucket = by_key.get(keys[blocks[0]])
            if bucket is not None:
                queued = list(filter(bucket.__contains__, blocks))
                deque(map(bucket.move_to_end, queued), maxlen=0)
                bucket.update(zip(queued, itertools.count(clock)))  # (existing keys: the place move_to_end gave them)
                self._clock = clock + len(queued)
            return
        for b in blocks:
            bucket = by_key.get(keys[b])
            if bucket is not None and b in bucket:
                del bucket[b]
                bucket[b] = clock
                clock += 1
        self._clock = clock

    def pop(self) -> int:
        """The next block to evict; ``IndexError`` when empty."""
        return self.pop_many(1)[0]

    def pop_many(self, n: int) -> list[int]:
        """The next ``n`` blocks to evict, in order (``n`` × :meth:`pop`); ``IndexError`` if fewer are queued."""
        if n > self._len:
            raise IndexError("no evictable block" if not self._len else f"{n} blocks asked, {self._len} evictable")
        out: list[int] = []
        heap, by_key = self._heap, self._by_key
        while len(out) < n:
            key = heap[0]
            bucket = by_key.get(key)
            if bucket is None:
                heapq.heappop(heap)
                self._in_heap.discard(key)
                continue
            need = n - len(out)
            if need >= len(bucket):  # the whole bucket goes, oldest first
                out += bucket
                self.num_shared -= (key >> _SHARED_BIT) * len(bucket)
                del by_key[key]
            else:
                popitem = bucket.popitem
                for _ in range(need):
                    out.append(popitem(last=False)[0])
                self.num_shared -= (key >> _SHARED_BIT) * need
        self._len -= n
        return out

    def blocks(self) -> list[int]:
        """Every queued block, in eviction order (for checks and tests)."""
        return [b for k in sorted(self._by_key) for b in self._by_key[k]]


#: ``detach(group, blocks)``: the manager unhooks a group's evicted or dropped blocks (in eviction order) from their
#: radix runs (``node[b]`` at position ``pos[b]``) and clears ``node[b]``; the pool's other bookkeeping is its own.
Detach = Callable[[str, "list[int]"], None]


class GroupPool:
    """Free list, reference counts, radix attachment and eviction queue of one group's blocks."""

    def __init__(self, name: str, num_blocks: int) -> None:
        self.name = name
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.gen = [0] * num_blocks
        self.node: list[RadixNode | None] = [None] * num_blocks  # radix run holding the block, if any
        self.pos = [0] * num_blocks  # an attached block's position in the prefix (meaningless when node[b] is None)
        self.priority = [0] * num_blocks  # eviction priority, set when the last owner lets go
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out low ids first
        self.evictable = EvictionQueue(self.priority)
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

    def allocate(self, detach: Detach) -> int:
        """Hand out one block with ``ref == 1``: a free one, else evict the next cached one.

        ``detach`` unhooks an evicted block from its radix node. Raises ``IndexError`` when nothing is
        available (callers check :attr:`available` first).
        """
        return self.allocate_many(1, detach)[0]

    def allocate_many(self, n: int, detach: Detach) -> list[int]:
        """``n`` × :meth:`allocate` in one call (same blocks, same order); ``IndexError`` if fewer are available.

        Free blocks first (as :meth:`allocate` pops them), then evictions; nothing changes on error.
        """
        if n > len(self._free) + len(self.evictable):
            raise IndexError(f"group {self.name}: {n} blocks asked, {self.available} free or evictable")
        free = self._free
        k = min(n, len(free))
        out = free[len(free) - k:][::-1]  # what k pops would return, in that order
        del free[len(free) - k:]
        if n > k:  # evict the rest in one pass; their nodes are unhooked together
            evicted = self.evictable.pop_many(n - k)
            detach(self.name, evicted)
            self.evictions += n - k
            out += evicted
        gen, ref = self.gen, self.ref
        for b in out:
            gen[b] = gen[b] + 1  # (not +=: two opcodes fewer, ~20% less CPU on Python 3.11)
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

    def incref_many(self, blocks: Sequence[int]) -> None:
        """:meth:`incref` for each of ``blocks`` (a prefix hit's distinct blocks), in one pass: the cached ones
        leave the eviction queue in one :meth:`EvictionQueue.remove_many`."""
        ref = self.ref
        cached: list[int] = []
        for b in blocks:
            r = ref[b]
            if not r:
                cached.append(b)
            ref[b] = r + 1
        try:
            self.evictable.remove_many(cached)
        except KeyError as e:
            raise RuntimeError(f"group {self.name}: block {e.args[0]} is free, it cannot be shared") from None
        self.num_used += len(cached)

    def decref(self, b: int, priority: int, keep_cached: bool, detach: Detach) -> None:
        """One holder lets go of ``b``; at zero an attached block is cached (or dropped), others go free."""
        if self.ref[b] <= 0:
            raise RuntimeError(f"group {self.name}: block {b} released more often than held")
        self.ref[b] -= 1
        if self.ref[b]:
            return
        self.num_used -= 1
        node = self.node[b]
        if node is not None and keep_cached:
            self.evictable.add(b, priority, bool(node.children))
            return
        if node is not None:
            detach(self.name, [b])
        self._free.append(b)

    def release(self, blocks: Iterable[int], priority: int, keep_cached: bool, detach: Detach) -> None:
        """:meth:`decref` each block of ``blocks`` in order (ids below 0 are skipped), in one pass.

        Blocks that reach zero are queued for eviction (attached, ``keep_cached``) in that order with
        ``priority``, or go to the free list in that order (attached ones are detached first).
        """
        if keep_cached:
            self._release_cached(blocks, priority)
            return
        ref, owner, free = self.ref, self.node, self._free
        cached: list[int] = []
        dropped: list[int] = []
        released = 0
        try:
            for b in blocks:
                if b < 0:
                    continue
                if ref[b] <= 0:
                    raise RuntimeError(f"group {self.name}: block {b} released more often than held")
                ref[b] = ref[b] - 1
                if ref[b]:
                    continue
                released += 1
                node = owner[b]
                if node is None:
                    free.append(b)
                elif keep_cached:
                    cached.append(b)  # add_many records its priority
                else:
                    dropped.append(b)
                    free.append(b)
        finally:  # what was released before an error stays consistent
            self.num_used -= released
            if cached:
                self.evictable.add_split(cached, owner, priority)
            if dropped:
                detach(self.name, dropped)

    def _release_cached(self, blocks: Iterable[int], priority: int) -> None:
        """:meth:`release` with ``keep_cached``: the leaves (blocks of runs without children) queued in the release's
        own loop, as :meth:`EvictionQueue.add_split` then :meth:`EvictionQueue.add_many` would queue them after it
        (the same buckets, order, clocks and stale demotions; the shared ones queued after the leaves, as before).

        Why: every finish and every cancelled admission lets go of a history this way; three Python passes over its
        blocks (release, split, queue) are one (tiny-llama ``multi-turn`` at a quarter of the budget: a refused
        turn's history claimed and let go again step after step)."""
        ref, owner, free = self.ref, self.node, self._free
        queue = self.evictable
        key = priority + (1 << 63)  # _key_of(priority, False): the leaves' bucket
        bucket = queue._by_key.get(key)
        fresh = bucket is None
        if fresh:  # made here, added to the queue below only if a leaf goes into it (as add_many's _bucket)
            bucket = OrderedDict()
        prio, keys, clock = queue._prio, queue._key, queue._clock  # add_many: one clock for the call's blocks
        queued, freed = len(bucket), len(free)
        shared: list[int] = []
        try:
            for b in blocks:  # this loop runs for every block a finish or a cancelled admission lets go: kept lean
                if b < 0:
                    continue
                r = ref[b]
                if r <= 0:
                    raise RuntimeError(f"group {self.name}: block {b} released more often than held")
                if r > 1:
                    ref[b] = r - 1
                    continue
                ref[b] = 0
                node = owner[b]
                if node is None:
                    free.append(b)
                elif node.children:
                    shared.append(b)
                else:
                    bucket[b] = clock
                    prio[b] = priority
                    keys[b] = key
        finally:  # what was released before an error stays consistent
            leaves = len(bucket) - queued
            self.num_used -= leaves + len(shared) + len(free) - freed
            if leaves:
                if fresh:
                    queue._adopt(key, bucket)
                queue._clock = clock + leaves
                queue._len += leaves
                if queue.num_shared:
                    queue._demote_stale()
            if shared:
                queue.add_many(shared, priority, True)

    def reset(self) -> None:
        """Drop every cached block to the free list (the manager empties the radix tree); none may be in use."""
        if self.num_used:
            raise RuntimeError(f"group {self.name}: {self.num_used} blocks are in use; the cache cannot be reset")
        self.node[:] = [None] * self.num_blocks  # in place: the manager keeps references to these lists
        self._free[:] = range(self.num_blocks - 1, -1, -1)
        self.evictable = EvictionQueue(self.priority)

    def free_ids(self) -> list[int]:
        """The free list's blocks (for checks and tests)."""
        return list(self._free)
