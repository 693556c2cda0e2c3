"""reset_prefix_cache on both managers and on a loaded result; V1 hands out empty blocks before it evicts."""

from __future__ import annotations

import pytest

from cache_backends.block_pool import BlockPool
from cache_backends.interface import PrefixCacheInUseError
from cache_backends.request import Request
from tests.kv_v1_support import make_manager as make_v1
from tests.kv_v1_support import run_prefill
from tests.kv_v2_support import admit, full_sliding_layers, prefill
from tests.kv_v2_support import make_manager as make_v2

# --- V1 eviction order -------------------------------------------------------------------------------


def test_block_pool_hands_out_an_empty_block_before_evicting_a_cached_one():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"key-a")
    pool.free([a])  # cached, evictable
    pool.free([b])  # freed later, but holds nothing
    assert [blk.block_id for blk in pool.allocate(1)] == [b.block_id]
    assert pool.lookup(b"key-a") is a and pool.evictions == 0
    pool.free([c])
    assert [blk.block_id for blk in pool.allocate(1)] == [c.block_id]
    assert pool.allocate(1) == [a] and pool.evictions == 1  # only now, with nothing empty left
    pool.check_invariants()


def test_v1_keeps_a_cached_prefix_while_an_empty_block_is_free():
    m = make_v1(num_blocks=6)
    a = Request("a", list(range(1, 10)), 1)  # 9 tokens: two full blocks cached, a third partial
    run_prefill(m, a)
    m.free(a)
    b = Request("b", [50, 51, 52], 1)  # one partial block, never keyed
    run_prefill(m, b)
    m.free(b)
    c = Request("c", list(range(100, 114)), 1)  # four blocks: exactly the empty ones (LRU order would evict one)
    run_prefill(m, c)
    assert m.pool.evictions == 0
    again = Request("a2", list(range(1, 10)), 1)
    assert m.find_prefix(again).num_tokens == 8  # a's two full blocks survived
    m.pool.check_invariants()


# --- reset -------------------------------------------------------------------------------------------


def test_v1_reset_is_refused_while_a_request_holds_blocks_then_forgets_every_prefix():
    m = make_v1(num_blocks=8)
    a = Request("a", list(range(1, 10)), 1)
    run_prefill(m, a)
    with pytest.raises(PrefixCacheInUseError, match=r"1 request\(s\) still hold a KV cache \(a\)"):
        m.reset_prefix_cache()
    assert m.find_prefix(Request("x", list(range(1, 10)), 1)).num_tokens == 8  # refusal changed nothing
    m.free(a)
    m.reset_prefix_cache()
    stats = m.stats().groups["uniform"]
    assert (stats.free, stats.evictable, stats.used) == (8, 0, 0)
    assert m.find_prefix(Request("y", list(range(1, 10)), 1)).num_tokens == 0
    m.pool.check_invariants()
    run_prefill(m, Request("z", list(range(1, 30)), 1))  # the pool still works
    m.pool.check_invariants()


def test_v2_reset_is_refused_while_any_cache_exists_then_every_block_is_free():
    m = make_v2(full_sliding_layers(window=8), 16)
    prompt = list(range(1, 25))
    a = Request("a", prompt, 2)
    prefill(m, a)
    assert m.suspend(a)
    with pytest.raises(PrefixCacheInUseError, match=r"still hold a KV cache \(a\)"):
        m.reset_prefix_cache()  # a suspended request still has a path through the tree
    m.free(a)
    assert m.stats().reuse.radix_nodes > 0
    m.reset_prefix_cache()
    s = m.stats()
    assert s.reuse.radix_nodes == 0
    for name, g in s.groups.items():  # a shared arena (three groups): all 48 pages free
        assert (g.free, g.evictable, g.used) == (48, 0, 0), name
    m.check_invariants()
    b = Request("b", prompt, 2)
    admit(m, b)
    assert b.num_computed_tokens == 0  # no hit after the reset
    m.check_invariants()


def test_loaded_result_resets_its_managers_prefix_cache():
    from kvload.api import load

    with load("tiny-llama", device="cpu", kv_cache_config={"max_tokens": 256}) as result:
        m = result.kv_manager
        a = Request("a", list(range(1, 40)), 1)
        run_prefill(m, a)
        with pytest.raises(PrefixCacheInUseError):
            result.reset_prefix_cache()
        m.free(a)
        assert m.pool.num_evictable > 0
        result.reset_prefix_cache()
        assert m.pool.num_evictable == 0 and m.pool.num_free == m.num_blocks
