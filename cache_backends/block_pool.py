"""A pool of fixed-size KV blocks: O(1) free list, reference counts, and a hash → block prefix cache.

Shaped after vLLM v1's ``block_pool.py``. One :class:`BlockPool` manages the ids ``0 .. num_blocks-1``
of one device pool (one layer group); it never touches tensors.

A block is in exactly one of three states:

* **used**: ``ref_cnt > 0``; owned by one or more requests; not in the free queue.
* **evictable**: ``ref_cnt == 0`` and ``block_hash`` set; in the free queue *and* in the hash
  map, so a later request with the same prefix can take it back (:meth:`touch`) until it is
  popped for new data, which evicts it.
* **empty**: ``ref_cnt == 0``, no hash; in the free queue.

Invariants (checked by :meth:`check_invariants`, relied on by every method):

1. ``block in free queue  ⇔  block.ref_cnt == 0``; the queue holds each block at most once.
2. ``cached[h] is b  ⇒  b.block_hash == h``; a block with a hash is in the map under that hash
   (one block per hash: a second block computed with the same content stays unhashed).
3. ``num_evictable`` == free blocks with a hash (the queue counts them: ``FreeBlockQueue.num_keyed``);
   ``num_empty + num_evictable + num_used == num_blocks``.
4. The free queue holds the empty blocks first, then the evictable ones ordered by release time:
   :meth:`allocate` pops the head, so it hands out a block that holds nothing before it evicts a
   cached prefix, and among cached blocks the least recently freed goes first. :meth:`free` puts a
   block without a key at the head and a keyed one at the tail. Callers free a sequence's blocks
   tail first, so the tail of a finished sequence is evicted before its prefix (a prefix is shared
   more often).

Every operation is O(1) per block: the queue is a doubly linked list threaded through the blocks
(with sentinels), so a cached free block hit by a new request leaves the middle of the queue in O(1).
:meth:`BlockPool.allocate` and :meth:`BlockPool.free` move whole runs (``FreeBlockQueue.take`` /
``release``: each block is touched once, its reference count and its links in the same pass, and the
run is relinked once per call), which keeps them within about 3x of a bare ``deque`` of ids
(``bench/bench_block_pool.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator


class NoFreeBlocksError(RuntimeError):
    """More blocks were asked for than the pool has free."""


class KVBlock:
    """One block id with its reference count, prefix-cache key and free-queue links."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        key = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={key})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels: O(1) pop from the head, append, remove."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        self.num_keyed = 0  # queued blocks that hold a prefix key (the pool's evictable blocks)
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> KVBlock:
        """Take the least recently freed block."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise NoFreeBlocksError("the free queue is empty")
        self.remove(block)
        return block

    def popleft_many(self, n: int) -> list[KVBlock]:
        """Take the ``n`` least recently freed blocks, in queue order (``n`` <= ``len(self)``)."""
        if n > self._len:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self._len} in the free queue")
        out = []
        node = self._head.next_free
        for _ in range(n):  # unlink a run: only its two ends are relinked
            block = node
            node = block.next_free
            block.prev_free = block.next_free = None
            if block.block_hash is not None:
                self.num_keyed -= 1
            out.append(block)
        self._head.next_free = node
        node.prev_free = self._head
        self._len -= n
        return out

    def take(self, n: int) -> list[KVBlock]:
        """:meth:`popleft_many` for an allocation: each block also gets its first owner (``ref_cnt = 1``), same pass."""
        if n > self._len:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self._len} in the free queue")
        out = []
        keyed = 0
        node = self._head.next_free
        for _ in range(n):
            block = node
            node = block.next_free
            block.prev_free = block.next_free = None
            block.ref_cnt = 1
            if block.block_hash is not None:
                keyed += 1
            out.append(block)
        self._head.next_free = node
        node.prev_free = self._head
        self._len -= n
        self.num_keyed -= keyed
        return out

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one owner from each block, in order; an unowned keyed block joins the tail (in that order), an
        unowned block without a key the head (handed out before any cached block is evicted).

        One pass: the reference count and the links of each block together. ``ValueError`` for a block
        with no owner; the blocks released before it are queued, so the queue stays consistent.
        """
        head, tail = self._head, self._tail
        last = tail.prev_free
        assert last is not None
        joined = keyed = 0
        try:
            for block in blocks:
                left = block.ref_cnt - 1
                if left < 0:
                    raise ValueError(f"{block!r} freed more often than it was owned")
                block.ref_cnt = left
                if not left:  # unowned now, so not in the queue yet (invariant 1)
                    joined += 1
                    if block.block_hash is not None:
                        keyed += 1
                    elif last is not head:  # empty: to the head, ahead of every cached block
                        first = head.next_free
                        head.next_free = block
                        block.prev_free = head
                        block.next_free = first
                        first.prev_free = block  # a queued block: the queue is not empty (last is not head)
                        continue
                    last.next_free = block  # keyed (or the queue's first block): to the tail
                    block.prev_free = last
                    last = block
        finally:
            last.next_free = tail
            tail.prev_free = last
            self._len += joined
            self.num_keyed += keyed

    def extend(self, blocks: list[KVBlock]) -> None:
        """Append blocks at the tail in order; each must be out of the queue (the caller's invariant)."""
        tail = self._tail
        last = tail.prev_free
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
            if block.block_hash is not None:
                self.num_keyed += 1
        last.next_free = tail
        tail.prev_free = last
        self._len += len(blocks)

    def append(self, block: KVBlock) -> None:
        """Put a block at the tail (most recently freed)."""
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block!r} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1
        if block.block_hash is not None:
            self.num_keyed += 1

    def remove(self, block: KVBlock) -> None:
        """Unlink a block from wherever it is in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1
        if block.block_hash is not None:
            self.num_keyed -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free


class BlockPool:
    """Block ids of one pool: allocate, share (touch), free, and cache full blocks by hash."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.evictions = 0  # cached blocks whose content was dropped to make room
        self.on_evict: Callable[[list[bytes]], None] | None = None  # KV events: the keys an allocation evicted

    # --- counts -----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that :meth:`allocate` can hand out now (empty + evictable)."""
        return len(self.free_queue)

    @property
    def num_evictable(self) -> int:
        """Free blocks that still hold a reusable prefix (cached, reclaimable by :meth:`touch`)."""
        return self.free_queue.num_keyed

    @property
    def num_empty(self) -> int:
        """Free blocks that hold nothing reusable."""
        return len(self.free_queue) - self.num_evictable

    @property
    def num_used(self) -> int:
        """Blocks with at least one owner."""
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (evictable blocks count as free)."""
        return self.num_used / self.num_blocks

    # --- operations -------------------------------------------------------------------------

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` free blocks (least recently freed first, evicting cached content), each with one owner."""
        if n > len(self.free_queue):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self.free_queue)} free of {self.num_blocks}")
        queue = self.free_queue
        keyed = queue.num_keyed
        out = queue.take(n)
        evicted = keyed - queue.num_keyed
        if evicted:  # some taken blocks held a prefix: their content is dropped now
            gone: list[bytes] | None = [] if self.on_evict is not None else None
            for block in out:
                if block.block_hash is not None:
                    if gone is not None:
                        gone.append(block.block_hash)
                    self._uncache(block)
            self.evictions += evicted
            if gone:
                self.on_evict(gone)  # type: ignore[misc]
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one owner to each block (prefix-cache hits); an evictable block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one owner from each block, in the order given; a block nobody owns joins the free tail."""
        self.free_queue.release(blocks)  # blocks released before an error still join: the invariants hold

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        """The cached block holding this prefix key, used or evictable, or None."""
        return self.cached.get(block_hash)

    def cache(self, block: KVBlock, block_hash: bytes) -> bool:
        """Register a used, full block under its prefix key; False when another block already holds the key."""
        if block.ref_cnt <= 0:
            raise ValueError(f"{block!r}: only a block in use can be cached")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"{block!r} is already cached under another key")
            return True
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def reset(self) -> None:
        """Forget every cached prefix and queue every block as empty; only when no block has an owner."""
        if len(self.free_queue) != self.num_blocks:
            raise RuntimeError(f"{self.num_used} blocks are in use; the prefix cache cannot be reset")
        for block in self.blocks:
            block.block_hash = None
            block.prev_free = block.next_free = None
        self.cached.clear()
        self.free_queue = FreeBlockQueue(self.blocks)

    def _uncache(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None

    def check_invariants(self) -> None:
        """Assert the invariants of the module docstring (O(num_blocks); for tests and debugging)."""
        in_queue = [b.block_id for b in self.free_queue]
        assert len(in_queue) == len(self.free_queue) == len(set(in_queue)), "free queue length or duplicates"
        queued = set(in_queue)
        for b in self.blocks:
            assert (b.block_id in queued) == (b.ref_cnt == 0), f"{b!r}: in queue iff unowned"
            assert b.ref_cnt >= 0, f"{b!r}: negative reference count"
            if b.block_hash is not None:
                assert self.cached.get(b.block_hash) is b, f"{b!r}: hashed but not in the map"
        for h, b in self.cached.items():
            assert b.block_hash == h, f"{b!r}: mapped under a key it does not carry"
        evictable = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is not None)
        assert evictable == self.num_evictable, "evictable count"
        assert self.num_empty + self.num_evictable + self.num_used == self.num_blocks
