"""The block pool: free-list order (LRU, tail first), reference counts, the prefix cache and its invariants."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cache_backends.block_pool import BlockPool, FreeBlockQueue, KVBlock, NoFreeBlocksError
from cache_backends.hashing import block_hash


def key(n: int) -> bytes:
    return block_hash(None, [n], None)


def test_free_queue_pops_in_order_and_removes_from_the_middle():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 4, 2]
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[3])
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[0])


def test_allocate_hands_out_most_recently_freed_empty_blocks_first_and_refuses_beyond_free():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2] and all(b.ref_cnt == 1 for b in a)
    pool.free([a[1]])
    pool.free([a[0]])
    assert [b.block_id for b in pool.allocate(3)] == [0, 1, 3]  # empty blocks join the head (LIFO)
    with pytest.raises(NoFreeBlocksError, match="asked for 1 blocks, 0 free of 4"):
        pool.allocate(1)


def test_a_finished_sequence_is_freed_tail_first_so_its_tail_is_evicted_first():
    pool = BlockPool(3)
    seq = pool.allocate(3)
    for i, b in enumerate(seq):
        assert pool.cache(b, key(i))
    pool.free(reversed(seq))
    assert (pool.num_evictable, pool.num_empty, pool.num_used) == (3, 0, 0)
    (victim,) = pool.allocate(1)
    assert victim is seq[2] and victim.block_hash is None
    assert pool.lookup(key(2)) is None and pool.lookup(key(0)) is seq[0]
    assert pool.evictions == 1


def test_touch_revives_an_evictable_block_and_shares_a_used_one():
    pool = BlockPool(4)
    b = pool.allocate(1)[0]
    pool.cache(b, key(7))
    pool.touch([b])  # a second owner while in use
    assert b.ref_cnt == 2
    pool.free([b])
    pool.free([b])
    assert pool.num_evictable == 1 and pool.num_free == 4
    hit = pool.lookup(key(7))
    pool.touch([hit])
    assert hit is b and b.ref_cnt == 1 and pool.num_evictable == 0 and pool.num_free == 3
    pool.check_invariants()


def test_one_block_per_key_and_double_free_is_an_error():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache(a, key(1)) is True
    assert pool.cache(b, key(1)) is False and b.block_hash is None
    assert pool.cache(a, key(1)) is True  # idempotent
    with pytest.raises(ValueError, match="another key"):
        pool.cache(a, key(2))
    pool.free([b])
    with pytest.raises(ValueError, match="freed more often than it was owned"):
        pool.free([b])
    with pytest.raises(ValueError, match="only a block in use"):
        pool.cache(b, key(3))


def test_run_moves_keep_queue_order_and_a_bad_free_leaves_the_pool_consistent():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    taken = q.popleft_many(3)
    assert [b.block_id for b in taken] == [0, 1, 2] and [b.block_id for b in q] == [3, 4] and len(q) == 2
    q.extend([taken[2], taken[0]])
    assert [b.block_id for b in q] == [3, 4, 2, 0] and len(q) == 4
    with pytest.raises(NoFreeBlocksError):
        q.popleft_many(5)
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.free([b])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([a, b, c])  # a is released before the error; c is untouched
    assert (a.ref_cnt, c.ref_cnt) == (0, 1) and pool.num_free == 3
    pool.check_invariants()


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / cache / touch / free sequences against a model of who owns what."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(8)
        self.owners: list[list[KVBlock]] = []  # each owner holds a list of blocks (one reference each)
        self.next_key = 0

    @rule(n=st.integers(1, 4))
    def allocate(self, n):
        if n > self.pool.num_free:
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            return
        self.owners.append(self.pool.allocate(n))

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def cache_some(self, data):
        owner = data.draw(st.sampled_from(self.owners))
        for b in owner:
            if b.block_hash is None:
                self.pool.cache(b, key(self.next_key))
                self.next_key += 1

    @precondition(lambda self: self.pool.cached)
    @rule(data=st.data())
    def share_cached(self, data):
        k = data.draw(st.sampled_from(sorted(self.pool.cached)))
        block = self.pool.lookup(k)
        self.pool.touch([block])
        self.owners.append([block])

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def free_owner(self, data):
        owner = self.owners.pop(data.draw(st.integers(0, len(self.owners) - 1)))
        self.pool.free(reversed(owner))

    @invariant()
    def reference_counts_equal_owners(self):
        self.pool.check_invariants()
        counts: dict[int, int] = {}
        for owner in self.owners:
            for b in owner:
                counts[b.block_id] = counts.get(b.block_id, 0) + 1
        assert {b.block_id: b.ref_cnt for b in self.pool.blocks if b.ref_cnt} == counts

    def teardown(self):
        for owner in self.owners:
            self.pool.free(reversed(owner))
        assert self.pool.num_free == self.pool.num_blocks and self.pool.num_used == 0
        self.pool.check_invariants()


TestPoolMachine = PoolMachine.TestCase
