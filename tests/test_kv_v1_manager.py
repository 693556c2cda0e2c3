"""V1 ``KVCacheManager``: block tables, full-block prefix reuse, LRU eviction, real tensors, invariants."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from cache_backends import LayerKV, build_layout
from cache_backends.interface import KVCacheManagerProtocol, ManagerOptions, PrefixCacheInUseError
from cache_backends.pools import BlockPools
from cache_backends.request import Request
from cache_backends.v1 import KVCacheManager
from tests.kv_v1_support import HEAD_DIM, KV_HEADS, LAYERS, T, make_manager, run_prefill


def test_is_a_kv_cache_manager_and_refuses_a_v2_layout():
    m = make_manager()
    assert isinstance(m, KVCacheManager)
    for name in ("layout", "pools", "options", "block_table", "commit", "free", "stats", "close"):
        assert hasattr(m, name), name
    assert KVCacheManagerProtocol  # the protocol this implements
    layers = [LayerKV(0, "sliding", 8, window=8), LayerKV(1, "full", 8)]
    pools = BlockPools(build_layout(layers, "v2", 4, "float32"), {"sliding_w8": 2, "full": 2}, "cpu")
    with pytest.raises(ValueError, match=r"one uniform layer group.*sliding_w8 \(sliding\), full \(full\)"):
        KVCacheManager(pools, ManagerOptions(max_seq_len=16))


def test_block_table_grows_by_blocks_and_commit_advances_computed_tokens():
    m = make_manager(8)
    r = Request("a", list(range(10)), 3)
    m.admit(r)
    assert m.allocate_slots(r, 10)
    assert len(m.block_table(r, "uniform")) == 3  # ceil(10 / 4)
    m.commit(r, 10)
    assert r.num_computed_tokens == 10
    r.output_token_ids += [50, 51, 52]
    assert m.allocate_slots(r, 2)  # 12 tokens: still 3 blocks
    assert len(m.block_table(r, "uniform")) == 3
    assert m.blocks_to_completion(r) == 4 - 3  # worst case 13 tokens -> 4 blocks
    with pytest.raises(ValueError, match="beyond its allocated slots"):
        m.commit(r, 3)  # the 13th token has no slot yet
    with pytest.raises(ValueError, match=r"cannot commit 4 tokens \(10 computed of 13\)"):
        m.commit(r, 4)
    m.commit(r, 2)
    assert r.num_computed_tokens == 12
    with pytest.raises(KeyError, match="no group 'full'"):
        m.block_table(r, "full")


def test_allocate_slots_refuses_without_changing_anything():
    m = make_manager(2)
    r = Request("a", list(range(12)), 0)
    m.admit(r)
    assert not m.can_allocate(r, 12)
    assert m.allocate_slots(r, 12) is False
    assert m.block_table(r, "uniform") == [] and m.pool.num_free == 2


def test_a_shared_prefix_is_reused_in_whole_blocks_and_counted():
    m = make_manager()
    a = Request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0)
    run_prefill(m, a)
    b = Request("b", [1, 2, 3, 4, 5, 6, 7, 8, 99, 98, 97], 0)
    hit = m.find_prefix(b)
    assert hit.num_tokens == 8
    assert m.blocks_needed(b, hit) == 3 - 2  # worst 11 tokens = 3 blocks, 2 shared and in use
    run_prefill(m, b)
    assert (b.num_reused_tokens, b.num_computed_tokens) == (8, 11)
    assert m.block_table(b, "uniform")[:2] == m.block_table(a, "uniform")[:2]
    assert m.block_table(b, "uniform")[2] != m.block_table(a, "uniform")[2]
    assert m.stats().reuse_hit_tokens == 8 and m.stats().reuse_query_tokens == 21


def test_reuse_never_covers_the_whole_prompt_and_a_fully_cached_prompt_stays_consistent():
    m = make_manager()
    prompt = list(range(100, 112))  # exactly 3 blocks
    a = Request("a", prompt, 0)
    run_prefill(m, a)
    m.free(a)
    b = Request("b", list(prompt), 2)
    run_prefill(m, b)
    assert b.num_reused_tokens == 8  # the last block is recomputed so the prompt's last token has logits
    table = m.block_table(b, "uniform")
    assert len(table) == 3 and len(set(table)) == 3
    # the recomputed last block duplicates a cached one: the cache keeps the first, nothing is owned twice
    m.pool.check_invariants()
    assert sum(blk.ref_cnt for blk in m.pool.blocks) == 3
    c = Request("c", list(prompt), 0)
    assert m.find_prefix(c).num_tokens == 8


def test_a_request_that_skips_reading_caches_its_blocks_and_an_equal_cached_block_keeps_its_place():
    m = make_manager()
    prompt = list(range(100, 111))  # two full blocks and three tokens
    scored = Request("s", prompt, 2, salt="t", skip_prefix_read=True)
    run_prefill(m, scored)
    assert scored.num_reused_tokens == 0
    plain = Request("p", list(prompt), 0, salt="t")
    hit = m.find_prefix(plain)
    assert [b.block_id for b in hit.blocks] == m.block_table(scored, "uniform")[:2]  # published under its salt
    # the same prompt scored again while the first one runs: nothing is read, the map keeps the cached blocks
    again = Request("s2", list(prompt), 0, salt="t", skip_prefix_read=True)
    assert m.find_prefix(again).num_tokens == 0 and m.blocks_needed(again, m.find_prefix(again)) == 3
    run_prefill(m, again)
    assert set(m.block_table(again, "uniform")).isdisjoint(m.block_table(scored, "uniform"))
    m.pool.check_invariants()
    assert m.find_prefix(plain).blocks == hit.blocks
    assert m.stats().reuse_query_tokens == 0  # requests that read nothing asked the cache nothing
    evictable = m.pool.num_evictable
    m.free(again)  # its copies hold no key: they go back empty, ahead of every cached block
    m.pool.check_invariants()
    assert m.pool.num_evictable == evictable and all(b.block_hash is None for b in list(m.pool.free_queue)[:3])
    m.free(scored)
    assert m.find_prefix(plain).blocks == hit.blocks  # still cached, now evictable


def test_different_salts_never_share_blocks():
    m = make_manager()
    run_prefill(m, Request("a", list(range(9)), 0, salt="tenant-a"))
    assert m.find_prefix(Request("b", list(range(9)), 0, salt="tenant-b")).num_tokens == 0
    assert m.find_prefix(Request("c", list(range(9)), 0)).num_tokens == 0
    assert m.find_prefix(Request("d", list(range(9)), 0, salt="tenant-a")).num_tokens == 8


def test_freed_blocks_stay_cached_and_the_tail_is_evicted_first():
    m = make_manager(4)
    a = Request("a", list(range(16)), 0)  # 4 full blocks, all cached
    run_prefill(m, a)
    m.free(a)
    assert m.stats().groups["uniform"].evictable == 4
    other = Request("x", [7, 7, 7, 7], 0)  # needs one block: evicts a's tail block
    run_prefill(m, other)
    assert m.stats().evictions == 1
    again = Request("a2", [*range(16), 0], 0)
    assert m.find_prefix(again).num_tokens == 12  # the first three blocks survived


def test_a_stale_prefix_hit_is_refused():
    m = make_manager(2)
    a = Request("a", list(range(5)), 0)
    run_prefill(m, a)
    m.free(a)
    b = Request("b", list(range(5)), 0)
    hit = m.find_prefix(b)
    assert hit.num_tokens == 4
    squatter = Request("s", list(range(50, 58)), 0)
    m.admit(squatter)
    assert m.allocate_slots(squatter, 8)  # takes both free blocks, evicting the hit
    with pytest.raises(ValueError, match="stale prefix hit"):
        m.admit(b, hit)


def test_without_block_reuse_nothing_is_hashed_or_reused():
    m = make_manager(reuse=False)
    a = Request("a", list(range(9)), 0)
    run_prefill(m, a)
    m.free(a)
    assert m.pool.cached == {} and m.stats().groups["uniform"].evictable == 0
    assert m.find_prefix(Request("b", list(range(9)), 0)).num_tokens == 0


def test_close_frees_everything_and_releases_the_pools():
    m = make_manager()
    r = Request("a", list(range(6)), 0)
    run_prefill(m, r)
    m.close()
    assert m.pools.released and m.pool.num_used == 0
    m.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        m.admit(Request("b", [1], 0))


# --- real tensors --------------------------------------------------------------------------


def kv_for(token: int, layer: int) -> torch.Tensor:
    """A distinct (2, kv_heads, head_dim) K/V entry per token and layer."""
    base = torch.arange(2 * KV_HEADS * HEAD_DIM, dtype=torch.float32)
    return (base + 1000 * token + 100_000 * layer).view(2, KV_HEADS, HEAD_DIM)


def write(m: KVCacheManager, r: Request, start: int, stop: int) -> None:
    table = m.block_table(r, "uniform")
    for layer in range(LAYERS):
        slots = m.pools.layer_slots("uniform", layer)
        for p in range(start, stop):
            slots[table[p // T] * T + p % T] = kv_for(r.all_token_ids[p], layer).flatten()


def read(m: KVCacheManager, r: Request, layer: int) -> torch.Tensor:
    table = torch.tensor(m.block_table(r, "uniform"))
    positions = torch.arange(r.num_computed_tokens)
    slots = table[positions // T] * T + positions % T
    return m.pools.layer_slots("uniform", layer)[slots].view(-1, 2, KV_HEADS, HEAD_DIM)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_data_written_through_a_block_table_reads_back_identically(dtype):
    m = make_manager(12, dtype=dtype)
    a = Request("a", [5, 6, 7, 8, 9, 10, 11, 12, 13], 3)
    m.admit(a)
    assert m.allocate_slots(a, 9)
    write(m, a, 0, 9)
    m.commit(a, 9)
    for tok in (40, 41):  # two decode steps
        a.output_token_ids.append(tok)
        assert m.allocate_slots(a, 1)
        write(m, a, a.num_computed_tokens, a.num_computed_tokens + 1)
        m.commit(a, 1)
    # a second request reuses a's first two blocks and writes only its own tokens
    b = Request("b", [5, 6, 7, 8, 9, 10, 11, 12, 77, 78], 0)
    m.admit(b, m.find_prefix(b))
    assert b.num_reused_tokens == 8
    assert m.allocate_slots(b, 2)
    write(m, b, 8, 10)
    m.commit(b, 2)
    for r in (a, b):
        for layer in range(LAYERS):
            want = torch.stack([kv_for(t, layer) for t in r.all_token_ids[: r.num_computed_tokens]])
            assert torch.equal(read(m, r, layer), want.to(m.pools.dtype))


# --- the stateful property -----------------------------------------------------------------


class V1Machine(RuleBasedStateMachine):
    """Random admit / allocate / commit / append / share-prefix / free sequences keep the invariants."""

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.m = make_manager(12)
        self.live: list[Request] = []
        self.count = 0

    @rule(target=requests, prefix=st.sampled_from([[1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=6), salt=st.sampled_from([None, "s"]),
          max_new=st.integers(0, 5), skip=st.booleans())
    def admit(self, prefix, tail, salt, max_new, skip):
        self.count += 1
        r = Request(f"r{self.count}", prefix + tail, max_new, salt=salt, skip_prefix_read=skip)
        hit = self.m.find_prefix(r)
        assert hit.num_tokens < r.num_prompt_tokens and hit.num_tokens % T == 0
        assert not (skip and hit.num_tokens)  # it reads nothing, yet its blocks are cached below as anyone's
        self.m.admit(r, hit)
        self.live.append(r)
        return r

    @rule(r=requests, n=st.integers(1, 6))
    def compute(self, r, n):
        if r not in self.live:
            return
        n = min(n, r.num_tokens - r.num_computed_tokens)
        if n == 0:
            return
        could = self.m.can_allocate(r, n)
        assert self.m.allocate_slots(r, n) is could
        if could:
            self.m.commit(r, n)

    @rule(r=requests)
    def append_token(self, r):
        if r in self.live and r.num_computed_tokens == r.num_tokens and len(r.output_token_ids) < r.max_new_tokens:
            r.output_token_ids.append(len(r.output_token_ids) % 3)

    @rule(r=consumes(requests))
    def free(self, r):
        if r in self.live:
            self.live.remove(r)
        self.m.free(r)

    @rule()
    def reset_prefix_cache(self):
        if self.live:
            with pytest.raises(PrefixCacheInUseError):
                self.m.reset_prefix_cache()
            return
        self.m.reset_prefix_cache()
        assert self.m.pool.num_evictable == 0 and not self.m.pool.cached
        assert self.m.find_prefix(Request("probe", [1, 2, 3, 4, 5, 6, 7, 8, 0], 0)).num_tokens == 0

    @invariant()
    def invariants(self):
        pool = self.m.pool
        pool.check_invariants()
        owners: dict[int, int] = {}
        content: dict[int, tuple] = {}
        for r in self.live:
            table = self.m.block_table(r, "uniform")
            assert len(table) == len(set(table)), "a block twice in one table"
            assert len(table) * T >= r.num_computed_tokens
            for i, bid in enumerate(table):
                owners[bid] = owners.get(bid, 0) + 1
                if (i + 1) * T <= r.num_computed_tokens:  # a full computed block: shared only with equal content
                    tokens = (r.salt, tuple(r.all_token_ids[: (i + 1) * T]))
                    assert content.setdefault(bid, tokens) == tokens, "a block shared by different prefixes"
        assert {b.block_id: b.ref_cnt for b in pool.blocks if b.ref_cnt} == owners
        keyed = [b.block_hash is not None for b in pool.free_queue]
        assert keyed == sorted(keyed), "an empty block queued behind a cached one would evict the cached one first"
        s = self.m.stats().groups["uniform"]
        assert s.free + s.evictable + s.used == s.total == 12

    def teardown(self):
        for r in self.live:
            self.m.free(r)
        assert self.m.pool.num_used == 0 and self.m.pool.num_free == 12
        self.m.pool.check_invariants()
        self.m.close()


V1Machine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestV1Machine = V1Machine.TestCase
