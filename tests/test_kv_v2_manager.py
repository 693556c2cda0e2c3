"""KVCacheManagerV2 with real tensors: life cycle, windows, prefix reuse and salts, host tier, eviction."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_backends import LayerKV, build_layout
from cache_backends.hashing import chain_hashes
from cache_backends.interface import ManagerOptions
from cache_backends.kv_events import KvEventBuffer
from cache_backends.pools import BlockPools
from cache_backends.request import Request
from cache_backends.stats import HostStats, ManagerStats
from cache_backends.v2 import CacheState, KVCacheManagerV2
from cache_backends.v2.manager import _copy_pages
from cache_backends.v2.room import fit_spans
from tests.kv_v2_support import (
    FULL,
    admit,
    blocks_add_up,
    check_kv,
    compute,
    full_sliding_layers,
    make_manager,
    next_token,
    own_groups,
    prefill,
    split_sliding_layers,
    write_kv,
)


def lengths(manager: KVCacheManagerV2, request: Request) -> tuple[int, int, int]:
    c = manager.cache(request)
    return c.committed, c.history, c.capacity


def held(table: list[int]) -> list[int]:
    return [b for b in table if b >= 0]


# --- life cycle ------------------------------------------------------------------------------------


def test_life_cycle_keeps_committed_le_history_le_capacity():
    m = make_manager(full_sliding_layers(), 16)
    r = Request("a", list(range(10)), 4)
    cache = m.create(r)
    assert cache.state is CacheState.SUSPENDED and not cache.admitted
    assert (m.stats().active, m.stats().suspended) == (0, 1)
    with pytest.raises(ValueError, match="suspended; resume"):
        m.block_table(r, "full")

    assert m.resume(r) and cache.is_active and lengths(m, r) == (0, 0, 0)
    assert m.allocate(r, 6)
    assert lengths(m, r) == (0, 6, 6) and len(m.block_table(r, "full")) == 2
    write_kv(m, r, 0, 6)
    m.commit(r, 4)
    assert lengths(m, r) == (4, 6, 6) and r.num_computed_tokens == 4
    with pytest.raises(ValueError, match="cannot commit 3 tokens; 2 are scheduled"):
        m.commit(r, 3)

    assert m.resize(r, 12) and lengths(m, r) == (4, 6, 12) and len(m.block_table(r, "full")) == 3
    with pytest.raises(ValueError, match="below history"):
        m.resize(r, 5)
    assert m.resize(r, 6) and len(m.block_table(r, "full")) == 2
    m.commit(r, 2)
    check_kv(m, r)

    assert m.suspend(r)
    assert cache.state is CacheState.SUSPENDED
    stats = m.stats()
    assert all(g.used == 0 for g in stats.groups.values())
    assert stats.host["full"].used == 2 and stats.suspends == 1

    assert m.resume(r) and lengths(m, r) == (6, 6, 6)
    check_kv(m, r)
    assert m.stats().resumes == 1
    m.check_invariants()

    m.free(r)
    stats = m.stats()
    assert not m.has_cache(r)
    assert all(g.used == 0 for g in stats.groups.values()) and blocks_add_up(stats, shared=True)
    assert all(h.used == 0 for h in stats.host.values())
    m.check_invariants()


def test_suspend_drops_tokens_scheduled_but_not_committed():
    m = make_manager(FULL, 8)
    r = Request("a", list(range(10)), 0)
    admit(m, r)
    compute(m, r, 5)
    assert m.allocate(r, 5) and lengths(m, r) == (5, 10, 10)
    assert m.suspend(r)
    assert m.stats().host["full"].used == 2  # the 5 committed tokens' blocks only
    assert m.resume(r) and lengths(m, r) == (5, 5, 5)
    check_kv(m, r)


def test_check_running_refuses_a_request_without_an_active_cache_through_every_life_cycle_step():
    """The scheduler's guard follows each cache's state: created, admitted, suspended, resumed, cancelled, freed
    (its fast path reads a set kept where the state changes; ``check_invariants`` compares the two)."""
    m = make_manager(FULL, 8)
    a, b, c = (Request(name, list(range(10)), 0) for name in "abc")
    admit(m, a)
    admit(m, b)
    m.check_running([a, b])
    m.check_running(r for r in (a, b))  # any iterable
    with pytest.raises(ValueError, match="request c is in running but has no active KV cache"):
        m.check_running([a, c])  # never admitted
    m.create(c)
    with pytest.raises(ValueError, match="request c "):
        m.check_running([a, b, c])  # created, not admitted yet
    assert m.resume(c)
    m.check_running([a, b, c])
    compute(m, a, 5)
    assert m.suspend(a)
    with pytest.raises(ValueError, match="request a "):
        m.check_running(r for r in (b, a))
    m.check_invariants()
    assert m.resume(a)
    m.check_running([a, b, c])
    m.cancel_admission(c)
    with pytest.raises(ValueError, match="request c "):
        m.check_running([a, b, c])
    m.free(b)
    with pytest.raises(ValueError, match="request b "):
        m.check_running([a, b])
    m.check_running([a])
    m.check_invariants()


def test_bad_inputs_get_one_clear_error():
    layout_v1 = build_layout(FULL, "v1", 4, "float32")
    with pytest.raises(ValueError, match="'v2' layout"):
        KVCacheManagerV2(BlockPools(layout_v1, {"uniform": 4}, "cpu"), ManagerOptions(max_seq_len=64))
    with pytest.raises(ValueError, match="max_util_for_resume"):
        make_manager(FULL, 4, max_util_for_resume=0.0)
    m = make_manager(FULL, 4, max_seq_len=16)
    r = Request("a", [1, 2, 3], 5)
    admit(m, r)
    with pytest.raises(ValueError, match="already has a KV cache"):
        m.create(r)
    with pytest.raises(ValueError, match="already active"):
        m.resume(r)
    with pytest.raises(ValueError, match="no layer group 'sliding'; groups: full"):
        m.block_table(r, "sliding")
    with pytest.raises(ValueError, match="cannot schedule 4 tokens from 0; it has 3"):
        m.allocate(r, 4)
    with pytest.raises(ValueError, match="exceed max_seq_len=16"):
        m.create(Request("long", list(range(17)), 0))
    with pytest.raises(ValueError, match="no KV cache in this manager"):
        m.commit(Request("stranger", [1], 0), 1)


def test_close_releases_pools_and_host_tier_and_is_idempotent():
    m = make_manager(FULL, 4)
    assert m.host is not None and m.host.nbytes > 0
    r = Request("a", [1, 2, 3], 0)
    prefill(m, r)
    m.close()
    m.close()
    assert m.closed and m.pools.released and m.host.nbytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        m.stats()
    with pytest.raises(RuntimeError, match="closed"):
        m.create(Request("b", [1], 0))


def test_check_invariants_reports_a_broken_reference_count():
    m = make_manager(FULL, 4)
    r = Request("a", list(range(6)), 0)
    prefill(m, r)
    m.check_invariants()
    m._pool["full"].ref[m.block_table(r, "full")[0]] += 1
    with pytest.raises(AssertionError, match="ref 2 but 1 owners"):
        m.check_invariants()


# --- suspend / resume byte-exact ---------------------------------------------------------------------


def _fill_random(m: KVCacheManagerV2, r: Request) -> None:
    """Random bits in every page ``r`` holds."""
    for g in m.groups:
        for b in held(m.block_table(r, g.name)):
            page = m.pools.tensors[g.name][:, b]
            page.copy_(torch.randn(page.shape, dtype=torch.float32).to(page.dtype))


def _snapshot(m: KVCacheManagerV2, r: Request) -> dict[str, list[torch.Tensor | None]]:
    """A copy of every page of ``r`` (None where a window released it)."""
    return {
        g.name: [None if b < 0 else m.pools.tensors[g.name][:, b].clone() for b in m.block_table(r, g.name)]
        for g in m.groups
    }


def _assert_pages_equal(m: KVCacheManagerV2, r: Request, saved: dict[str, list[torch.Tensor | None]]) -> None:
    for g in m.groups:
        table = m.block_table(r, g.name)
        assert [b < 0 for b in table] == [p is None for p in saved[g.name]], g.name
        for j, (b, page) in enumerate(zip(table, saved[g.name], strict=True)):
            if page is not None:
                got = m.pools.tensors[g.name][:, b]
                assert torch.equal(got.view(torch.int16), page.view(torch.int16)), f"{g.name} block {j} differs"


def test_suspend_then_resume_restores_every_page_byte_exact_after_the_device_was_reused():
    m = make_manager(full_sliding_layers(window=10), 12, dtype="bfloat16")
    r = Request("a", list(range(1, 23)), 0)  # 22 tokens: 5 full blocks + a partial one
    admit(m, r)
    assert m.allocate(r, 22)
    _fill_random(m, r)
    m.commit(r, 22)
    saved = _snapshot(m, r)
    assert sum(b < 0 for b in m.block_table(r, "sliding_w10.0")) == 3  # the window released blocks 0..2
    assert m.suspend(r)
    stored = m.host.bytes_stored  # the partial last block only: the cached ones wait on the device (write-back)

    hog = Request("hog", [500 + i for i in range(48)], 0)  # needs every block: evicts r's cached pages
    admit(m, hog)
    assert m.allocate(hog, 48)
    assert m.host.bytes_stored > stored  # each of r's cached pages went to its host slot as it was evicted
    for t in m.pools.tensors.values():
        t.copy_(torch.randn(t.shape).to(t.dtype))
    m.free(hog)
    assert m.stats().evictions > 0

    assert m.resume(r)
    _assert_pages_equal(m, r, saved)
    m.check_invariants()


def test_resume_takes_back_untouched_cached_blocks_without_copying_them():
    m = make_manager(full_sliding_layers(window=64), 16, dtype="bfloat16")
    r = Request("a", list(range(1, 15)), 0)  # 3 full blocks (cached prefix blocks) + a private tail
    admit(m, r)
    assert m.allocate(r, 14)
    _fill_random(m, r)
    m.commit(r, 14)
    saved = _snapshot(m, r)
    before = m.block_table(r, "full")
    assert m.suspend(r)
    # only the private tail crosses the host link; the cached blocks are copied only if evicted (write-back)
    tails = sum(g.bytes_per_block for g in m.pools.groups.values())
    assert m.host.bytes_stored == tails
    assert m.resume(r)
    after = m.block_table(r, "full")
    assert after[:3] == before[:3]  # still cached and never evicted: taken back in place
    assert m.host.bytes_loaded == tails
    _assert_pages_equal(m, r, saved)
    m.check_invariants()


# --- sliding windows -------------------------------------------------------------------------------


def test_sliding_group_releases_blocks_that_left_the_window():
    m = make_manager(full_sliding_layers(window=8), 16, enable_block_reuse=False)
    r = Request("a", list(range(20)), 40)
    prefill(m, r)
    # next query is position 20: it sees keys 13..20, so blocks 0..2 (tokens 0..11) are out
    assert m.block_table(r, "sliding_w8.0")[:3] == [-1, -1, -1]
    assert len(held(m.block_table(r, "sliding_w8.1"))) == 2
    assert len(held(m.block_table(r, "full"))) == 5
    groups = m.stats().groups
    assert groups["sliding_w8.0"].used == 2 and groups["sliding_w8.0"].free == 48 - 5 - 2 * 2  # the arena's free
    check_kv(m, r)
    group = m.pools.groups["sliding_w8.0"]
    for _ in range(30):  # decode: the window never holds more than its bound
        r.output_token_ids.append(3)
        compute(m, r, 1)
        assert len(held(m.block_table(r, "sliding_w8.0"))) <= group.max_blocks_per_sequence
    check_kv(m, r)
    assert len(held(m.block_table(r, "full"))) == 13


@pytest.mark.parametrize("scratch", [False, True, None])
def test_swa_scratch_reuse_keeps_released_window_blocks_reusable(scratch):
    """Out-of-window blocks stay in the prefix cache unless enable_swa_scratch_reuse is false (None: the default)."""
    options = {} if scratch is None else {"enable_swa_scratch_reuse": scratch}
    m = make_manager(full_sliding_layers(window=8), 32, **options)
    scratch = scratch is not False
    prompt = list(range(1, 25))
    a = Request("a", prompt, 0)
    prefill(m, a)
    sliding = m.stats().groups["sliding_w8.0"]
    # blocks 0..3 left the window; as full prefix blocks they stay cached only with scratch reuse
    assert sliding.evictable == (4 if scratch else 0)
    assert sliding.free == 96 - 6 - 2 * (2 + (4 if scratch else 0))  # the arena's: full holds 6, each sliding 2
    m.free(a)

    b = Request("b", [*prompt[:20], 77, 78, 79, 80], 0)
    admit(m, b)
    # Rule: a prefix of m tokens is reusable only if the sliding group still holds every block the
    # window at m covers; without scratch reuse those blocks were freed as a ran past them.
    assert b.num_computed_tokens == (20 if scratch else 0)
    if scratch:
        check_kv(m, b)


# --- prefix reuse ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [FULL, full_sliding_layers(window=64), split_sliding_layers(window=6)],
                         ids=["full", "shared arena", "split windows"])
def test_a_request_that_skips_reading_caches_its_blocks_and_an_equal_cached_block_keeps_its_place(layers):
    m = make_manager(layers, 32, enable_partial_reuse=True)
    prompt = list(range(1, 18))  # four full blocks and a token
    first = Request("first", prompt, 2, salt="t")
    prefill(m, first)  # still running (lazily keyed: its blocks are hung when a lookup reaches them)
    scored = Request("scored", list(prompt), 2, salt="t", skip_prefix_read=True)
    assert m.claims_nothing(scored)  # what the scheduler asks before building anything
    admit(m, scored)
    assert scored.num_computed_tokens == 0 and m.cache(scored).reused_tokens == 0
    compute(m, scored, 9)  # in two chunks: the path through the cached run is split and rejoined
    m.check_invariants()
    compute(m, scored, 8)
    check_kv(m, scored)
    m.check_invariants()
    name = layers[0].kind  # the full group: every block of the prompt still held
    assert set(held(m.block_table(scored, name))).isdisjoint(m.block_table(first, name))
    plain = Request("plain", list(prompt), 0, salt="t")
    admit(m, plain)
    assert plain.num_reused_tokens == 16 and m.block_table(plain, name)[:4] == m.block_table(first, name)[:4]
    check_kv(m, plain)
    for r in (first, plain, scored):
        m.free(r)
        m.check_invariants()
    # scored first, into an empty cache of its salt: a later plain request hits what it computed
    lone = Request("lone", [40, *prompt[1:]], 0, salt="t", skip_prefix_read=True)
    prefill(m, lone)
    blocks = m.block_table(lone, name)[:4]
    m.free(lone)
    later = Request("later", list(lone.prompt_token_ids), 0, salt="t")
    admit(m, later)
    assert later.num_reused_tokens == 16 and m.block_table(later, name)[:4] == blocks
    check_kv(m, later)
    m.check_invariants()
    assert m.stats().reuse_query_tokens == 3 * 17  # first, plain, later: the skipping requests asked nothing


@pytest.mark.parametrize(("layers", "events"), [(FULL, False), (FULL, True), (full_sliding_layers(window=64), False),
                                               (full_sliding_layers(window=64), True)],
                         ids=["full", "full, kv events", "shared arena", "shared arena, kv events"])
def test_a_recomputed_copy_takes_the_place_of_an_evicted_cached_block(layers, events):
    # Two requests with one prompt computed side by side (as a preempted one recomputes a prefix the tree holds):
    # the second's copies cannot be hung where the first's blocks are. Once the first's blocks are evicted, the
    # prefix must stay reachable through the second's live copies: a later request hits them.
    m = make_manager(layers, 32)
    buffer = KvEventBuffer(10_000)
    if events:
        m.enable_kv_events(buffer)
    prompt = list(range(1, 18))  # four full blocks and a token
    first = Request("first", prompt, 0, salt="t")
    second = Request("second", list(prompt), 0, salt="t")
    admit(m, first)
    admit(m, second)
    compute(m, first, 17)
    compute(m, second, 17)
    name = layers[0].kind  # the full group
    copies = m.block_table(second, name)[:4]
    assert set(copies).isdisjoint(m.block_table(first, name))
    m.free(first)  # its blocks stay cached, nobody holding them
    m.check_invariants()
    filler = Request("filler", [90 + i % 7 for i in range(4 * 27)], 0, salt="t")  # every free and cached block
    prefill(m, filler)
    m.check_invariants()
    m.free(filler)
    later = Request("later", list(prompt), 0, salt="t")
    admit(m, later)
    assert later.num_reused_tokens == 16 and m.block_table(later, name)[:4] == copies
    check_kv(m, later)
    m.check_invariants()
    if events:  # each prefix key: stored by the first, removed with its block, stored again with the copy
        got = [e for e in buffer.drain()["events"] if e.get("layer_group") == name]
        for key in (k.hex() for k in chain_hashes(prompt[:16], 4, "t")):
            assert [e["type"] for e in got if key in e["block_hashes"]] == [
                "kv_block_stored", "kv_block_removed", "kv_block_stored"]


def test_salts_isolate_reuse():
    m = make_manager(full_sliding_layers(window=64), 32)
    prompt = list(range(1, 18))
    a = Request("a", prompt, 0, salt="tenant-a")
    prefill(m, a)
    m.free(a)
    others = []
    for rid, salt in (("b", "tenant-b"), ("c", None)):
        r = Request(rid, prompt, 0, salt=salt)
        admit(m, r)
        assert r.num_computed_tokens == 0 and r.num_reused_tokens == 0
        compute(m, r, r.num_tokens)
        check_kv(m, r)
        others.append(r)
    d = Request("d", prompt, 0, salt="tenant-a")
    admit(m, d)
    assert d.num_computed_tokens == 16 and d.num_reused_tokens == 16
    check_kv(m, d)
    d_blocks = set(held(m.block_table(d, "full")))
    for r in others:
        assert not d_blocks & set(held(m.block_table(r, "full")))
    assert m.stats().reuse_hit_tokens == 16


@pytest.mark.parametrize("partial", [False, True])
def test_reuse_never_covers_the_whole_prompt(partial):
    m = make_manager(FULL, 16, enable_partial_reuse=partial)
    prompt = list(range(1, 9))  # exactly two full blocks
    a = Request("a", prompt, 0)
    prefill(m, a)
    m.free(a)
    b = Request("b", list(prompt), 3)
    admit(m, b)
    assert b.num_computed_tokens == (7 if partial else 4)  # the last prompt token is always computed
    check_kv(m, b)
    compute(m, b, 1)
    check_kv(m, b)


def test_partial_reuse_copies_the_matching_block_and_never_writes_the_original():
    m = make_manager(full_sliding_layers(window=64), 16)
    a = Request("a", list(range(1, 13)), 4)  # three full blocks, still running
    prefill(m, a)
    b = Request("b", [*a.prompt_token_ids[:6], 90, 91, 92], 0)
    admit(m, b)
    assert b.num_computed_tokens == 6  # block 0 shared, 2 tokens of block 1 copied
    a_full, b_full = m.block_table(a, "full"), m.block_table(b, "full")
    assert b_full[0] == a_full[0] and b_full[1] != a_full[1]
    check_kv(m, b)
    compute(m, b, 3)  # writes tokens 6..8 into b's copy of block 1
    check_kv(m, a)
    check_kv(m, b)
    assert m.stats().reuse_partial_hits == 1
    m.check_invariants()


def test_compressed_groups_reuse_whole_blocks_of_their_span_only():
    from models import load_hf_config, resolve_checkpoint, spec_class_for

    cfg = load_hf_config(resolve_checkpoint("tiny-deepseek-v4"))
    layers = spec_class_for(cfg.architectures[0])(cfg).kv_layers()
    m = make_manager(layers, 64, T=8, enable_swa_scratch_reuse=True)
    stats = m.stats().reuse
    assert stats.unit_tokens == 128 and stats.partial is False  # hca blocks span 128 tokens
    prompt = [(7 * i) % 101 for i in range(300)]
    a = Request("a", prompt, 0)
    prefill(m, a)
    check_kv(m, a)
    m.free(a)
    b = Request("b", [*prompt, 5], 0)
    admit(m, b)
    assert b.num_computed_tokens == 256  # 2 whole hca blocks; not 296 (T-aligned) nor 300
    check_kv(m, b)
    compute(m, b, b.num_tokens - 256)
    check_kv(m, b)
    m.check_invariants()


def test_cancel_admission_undoes_the_claim():
    m = make_manager(FULL, 8)
    a = Request("a", list(range(1, 10)), 0)
    prefill(m, a)
    m.free(a)
    b = Request("b", list(range(1, 10)), 0)
    admit(m, b)
    assert b.num_computed_tokens == 8 and m.stats().reuse_hit_tokens == 8
    c = Request("c", [*range(1, 7), 60, 61], 0)
    admit(m, c)
    assert c.num_computed_tokens == 6 and m.stats().reuse_partial_hits == 1
    m.cancel_admission(c)
    m.cancel_admission(b)
    assert not m.has_cache(b) and b.num_computed_tokens == 0 and b.num_reused_tokens == 0
    assert m.stats().reuse_hit_tokens == 0 and m.stats().reuse_partial_hits == 0
    assert m.stats().groups["full"].used == 0
    admit(m, b)
    compute(m, b, 1)
    with pytest.raises(ValueError, match="just-admitted"):
        m.cancel_admission(b)


# --- eviction ----------------------------------------------------------------------------------------


def test_eviction_takes_lowest_priority_first_and_the_tail_of_a_prefix_before_its_head():
    m = make_manager(FULL, 12, enable_partial_reuse=False)
    low = Request("low", list(range(100, 113)), 0, priority=0)  # 3 full blocks + a private tail
    high = Request("high", list(range(200, 213)), 0, priority=5)
    prefill(m, high)
    prefill(m, low)
    m.free(high)
    m.free(low)  # released last, so the most recently used: LRU alone would evict high first
    assert (m.stats().groups["full"].free, m.stats().groups["full"].evictable) == (6, 6)

    new = Request("new", list(range(300, 332)), 0)
    prefill(m, new)  # 8 blocks: the 6 free ones, then 2 evicted
    assert m.stats().groups["full"].evictions == 2

    probe_low = Request("probe-low", low.prompt_token_ids, 0)
    probe_high = Request("probe-high", high.prompt_token_ids, 0)
    admit(m, probe_low)
    admit(m, probe_high)
    assert probe_low.num_computed_tokens == 4  # low's blocks 2 and 1 went, its head survived
    assert probe_high.num_computed_tokens == 12
    check_kv(m, probe_low)
    check_kv(m, probe_high)


def test_eviction_within_a_priority_is_least_recently_released_first():
    m = make_manager(FULL, 8, enable_partial_reuse=False)
    first = Request("first", list(range(100, 109)), 0)  # 2 full blocks + tail
    second = Request("second", list(range(200, 209)), 0)
    prefill(m, first)
    prefill(m, second)
    m.free(first)
    m.free(second)
    fresh = Request("fresh", list(range(300, 318)), 0)  # 5 blocks: 4 free + 1 evicted
    prefill(m, fresh)
    probes = [Request(f"probe-{r.req_id}", r.prompt_token_ids, 0) for r in (first, second)]
    for p in probes:
        admit(m, p)
    assert [p.num_computed_tokens for p in probes] == [4, 8]


# --- resume gate and host tier ---------------------------------------------------------------------


def test_resume_is_refused_above_max_util_for_resume_unless_nothing_else_runs():
    m = make_manager(FULL, 10, max_util_for_resume=0.5, enable_block_reuse=False)
    a = Request("a", list(range(24)), 0)  # 6 blocks
    prefill(m, a)
    assert m.suspend(a)
    b = Request("b", list(range(4)), 0)  # 1 block
    prefill(m, b)
    reason = m.resume_refusal(a)
    assert reason and "7/10 blocks of group full, above max_util_for_resume=0.5" in reason
    assert m.resume(a) is False and m.cache(a).state is CacheState.SUSPENDED
    m.free(b)
    assert m.resume_refusal(a) is None  # idle device: waiting could never help
    assert m.resume(a)
    check_kv(m, a)


def _restore_needs_by_page(m: KVCacheManagerV2, cache) -> dict[str, tuple[int, int, int]]:
    """A suspended cache's per-group needs as a pass over every host page computes them (the reference), per group of
    the manager's own (with the cuts tied, a logical group: its blocks take a page of each cut, so every cut's pass
    must find the same needs)."""
    next_len = cache.committed + (1 if cache.request.num_tokens > cache.committed else 0)
    needs = {}
    for g, cuts in own_groups(m):
        pool = m._pool[g.name]
        per_cut = set()
        for cut in cuts:  # the host tier holds a slot per page: per cut
            new, reclaim_cached = 0, 0
            for j, slot in enumerate(cache.host[cut]):
                if slot < 0:
                    continue
                b = m._reclaimable(cache, g.name, j)
                if b is None:
                    new += 1
                elif pool.ref[b] == 0:
                    reclaim_cached += 1
            per_cut.add((new, reclaim_cached, max(0, -(-next_len // g.tokens_per_block) - len(cache.host[cut]))))
        (needs[g.name],) = per_cut
    return needs


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["shared", "split"]), st.integers(2, 40), st.integers(0, 12), st.integers(0, 40),
       st.lists(st.integers(1, 40), max_size=6), st.integers(-1, 12))
def test_a_suspended_caches_needs_checked_at_once_are_what_a_pass_over_every_page_finds(
        arena, length, extra, shared, others, stale):
    # A suspended request whose cached pages other requests share (held: not counted as taking back a cached
    # block), whose windows let early pages go, and whose cached pages later prompts evict (written back: their
    # marks dropped) in any number; ``stale`` >= 0 makes one remaining mark outdated as a page handed out again or
    # dropped from the tree without its write-back would be.
    m = make_manager(full_sliding_layers(8) if arena == "shared" else split_sliding_layers(8), 16)
    a = Request("a", [1 + i % 7 for i in range(length)] + [50 + i for i in range(extra)], 4)
    prefill(m, a)
    if shared:
        b = Request("b", a.prompt_token_ids[:shared] or [1], 2)
        m.create(b)
        if m.resume(b) and m.allocate(b, b.num_tokens - b.num_computed_tokens):
            m.commit(b, b.num_tokens - b.num_computed_tokens)
        else:
            m.cancel_admission(b)
    if not m.suspend(a):
        return
    cache = m.cache(a)
    for k, n in enumerate(others):  # fresh prompts evict cached pages, the suspended request's among them
        c = Request(f"c{k}", [100 + 41 * k + i for i in range(n)], 0)
        m.create(c)
        if m.resume(c) and m.allocate(c, n):
            m.commit(c, n)
            m.free(c)
        else:
            m.cancel_admission(c)
    marks = [(name, j) for name, got in cache.reclaim.items() for j in got]
    if stale >= 0 and marks:  # handed out again (its generation moved on), or dropped from the tree
        name, j = marks[stale % len(marks)]
        b, gen = cache.reclaim[name][j]
        if stale % 2:
            cache.reclaim[name][j] = (b, gen + 1)
        else:
            m._pool[name].node[b] = None
    assert m._restore_needs(cache) == _restore_needs_by_page(m, cache)


def test_resume_is_refused_without_room():
    m = make_manager(FULL, 6, enable_block_reuse=False)
    a = Request("a", list(range(16)), 0)
    prefill(m, a)
    assert m.suspend(a)
    b = Request("b", list(range(12)), 0)
    prefill(m, b)
    assert "needs 4 blocks of group full; 3 are free or evictable" in m.resume_refusal(a)
    assert not m.resume(a)


def test_host_cache_size_zero_means_no_tier_and_suspend_declines():
    m = make_manager(FULL, 4, host_cache_size=0)
    assert m.host is None and m.stats().host is None
    r = Request("a", list(range(6)), 0)
    prefill(m, r)
    assert m.suspend(r) is False
    assert m.cache(r).is_active
    check_kv(m, r)


def test_host_cache_size_in_bytes_is_split_like_the_pools():
    # full: 1 layer x 4 elems x 4 B x 4 tokens = 64 B/block; sliding: 2 layers x 8 elems -> 256 B/block
    m = make_manager(split_sliding_layers(), 16, host_cache_size=320 + 1000)
    host = m.stats().host
    # one slot each, then the 1,000 B rest in proportion to the device pools (1,024 B : 4,096 B)
    assert host == {"full": HostStats(total=1 + 200 // 64, used=0),
                    "sliding_w8": HostStats(total=1 + 800 // 256, used=0)}
    assert m.host.nbytes <= 1320
    with pytest.raises(ValueError, match="host_cache_size=100 bytes cannot hold one block of every layer group"):
        make_manager(split_sliding_layers(), 16, host_cache_size=100)


def test_host_cache_size_of_a_shared_arena_is_pages_every_group_can_use():
    # three groups of one layer: 64 B pages; the host tier is one set of pages, counted once
    m = make_manager(full_sliding_layers(), 16, host_cache_size=192 + 1000)
    names = ("full", "sliding_w8.0", "sliding_w8.1")
    assert m.stats().host == {name: HostStats(total=1192 // 64, used=0) for name in names}
    assert m.host.nbytes == 1192 // 64 * 64
    with pytest.raises(ValueError, match="host_cache_size=100 bytes cannot hold one block of every layer group"):
        make_manager(full_sliding_layers(), 16, host_cache_size=100)


def test_auto_host_tier_mirrors_the_device_pools():
    m = make_manager(full_sliding_layers(), 16, host_cache_size=None)
    assert {name: h.total for name, h in m.stats().host.items()} == m.pools.num_blocks
    assert m.host.nbytes == m.pools.nbytes


def test_suspend_declines_when_the_host_tier_is_full():
    m = make_manager(FULL, 8, host_cache_size=3 * 64)  # 3 host slots
    a, b = Request("a", list(range(8)), 0), Request("b", list(range(100, 108)), 0)
    prefill(m, a)
    prefill(m, b)
    assert m.suspend(a)
    assert m.suspend(b) is False and m.cache(b).is_active
    check_kv(m, b)


# --- sizing helpers and stats -----------------------------------------------------------------------


def test_never_fits_follows_a_request_that_grows_between_asks():
    """The scheduler asks about the head of its queue every step; the answer must follow the request's length and
    worst case as a driver changes them (more tokens, a larger max_new_tokens), asked back to back."""
    m = make_manager(FULL, 4)  # 16 tokens
    r = Request("r", [1, 2, 3, 4], 4)
    assert m.never_fits(r) is None
    r.max_new_tokens = 40
    assert m.never_fits(r) == ("request r needs 11 blocks of group full for 44 tokens (prompt + max_new_tokens); "
                               "the pool has 4")
    r.max_new_tokens = 4
    assert m.never_fits(r) is None
    r.output_token_ids.extend([7] * 13)  # fed past its worst case: 17 tokens
    assert m.never_fits(r) == "request r needs 5 blocks of group full for 17 tokens; the pool has 4"


def test_fit_tokens_and_never_fits():
    m = make_manager(FULL, 4)
    too_big = Request("big", list(range(17)), 0)
    assert m.never_fits(too_big) == "request big needs 5 blocks of group full for 17 tokens; the pool has 4"
    a = Request("a", list(range(8)), 0)
    prefill(m, a)
    b = Request("b", list(range(100, 112)), 0)
    admit(m, b)
    assert m.never_fits(b) is None
    assert m.fit_tokens(b, 12) == 8  # two blocks left
    assert m.allocate(b, 9) is False and lengths(m, b) == (0, 0, 0)  # all or nothing


@settings(max_examples=80, deadline=None)
@given(layout=st.sampled_from(["full", "split sliding", "shared", "compressed"]), blocks=st.integers(3, 12),
       others=st.lists(st.integers(1, 30), max_size=4), prompt=st.integers(1, 40), want=st.integers(1, 60))
def test_fit_tokens_is_the_most_tokens_allocate_takes(layout, blocks, others, prompt, want):
    layers = {"full": FULL, "split sliding": split_sliding_layers(6), "shared": full_sliding_layers(6),
              "compressed": [LayerKV(0, "full", 4), LayerKV(1, "csa", 2, window=6, compressed_elems=2,
                                                            compress_rate=8)]}[layout]
    m = make_manager(layers, blocks, max_seq_len=64)
    for i, n in enumerate(others):  # other requests hold some of the blocks
        r = Request(f"o{i}", [100 + i, *range(n)], 0)
        m.create(r)
        m.resume(r)
        if m.fit_tokens(r, r.num_tokens) == r.num_tokens:
            assert m.allocate(r, r.num_tokens)
            m.commit(r, r.num_tokens)
    r = Request("r", list(range(prompt)), 0)
    m.create(r)
    m.resume(r)
    got = m.fit_tokens(r, want)
    cap = min(want, r.num_tokens - r.num_computed_tokens)
    assert 0 <= got <= cap
    assert m.allocate(r, got)  # that many fit
    if got < cap:  # and one more does not (all or nothing: nothing changes)
        cache = m.cache(r)
        before = (cache.committed, cache.history, cache.capacity)
        assert not m.allocate(r, got + 1)
        assert (cache.committed, cache.history, cache.capacity) == before
    m.check_invariants()


def test_stats_add_up():
    m = make_manager(full_sliding_layers(), 16)
    r = Request("a", list(range(14)), 0)
    prefill(m, r)
    stats = m.stats()
    assert stats.kind == "v2" and 0 < stats.usage < 1
    assert all(g.total == 48 for g in stats.groups.values()) and blocks_add_up(stats, shared=True)
    assert stats.groups["full"].used == 4 and stats.groups["sliding_w8.1"].used == 3  # block 0 left
    assert stats.reuse.enabled and stats.reuse.radix_nodes == 0  # keyed lazily: no other prompt starts like it
    m.key_pending()
    assert m.stats().reuse.radix_nodes == 3
    assert {"suspends", "resumes", "preemptions", "reuse_hit_tokens"} <= set(attrs.fields_dict(ManagerStats))


def test_reuse_is_off_with_a_reason_when_group_blocks_do_not_align_with_token_blocks():
    layers = [LayerKV(0, "full", 4), LayerKV(1, "csa", 4, window=8, compressed_elems=2, compress_rate=3)]
    m = make_manager(layers, 16, T=4)  # csa: one entry per block, so its blocks span 3 tokens
    reuse = m.stats().reuse
    assert reuse.enabled is False and "not all multiples of tokens_per_block=4" in reuse.disabled_reason
    a = Request("a", list(range(1, 14)), 0)
    prefill(m, a)
    m.free(a)
    b = Request("b", list(range(1, 14)), 0)
    admit(m, b)
    assert b.num_computed_tokens == 0
    compute(m, b, 13)
    check_kv(m, b)
    assert make_manager(FULL, 4, enable_block_reuse=False).stats().reuse.disabled_reason == (
        "enable_block_reuse is false")


@settings(max_examples=300, deadline=None)
@given(spans=st.lists(st.tuples(st.sampled_from([1, 2, 4, 8, 16, 64, 128]), st.integers(1, 6)), min_size=1,
                      max_size=3, unique_by=lambda s: s[0]),
       available=st.integers(0, 5_000), want=st.integers(0, 20_000))
def test_fit_spans_is_the_most_tokens_whose_blocks_fit(spans, available, want):
    """A new request's first chunk in a shared arena: the answer is the largest token count whose blocks (every
    group's, rounded up per block span) fit the arena, never more than asked (a brute-force count agrees)."""
    def need(n: int) -> int:
        return sum(count * -(-n // tpb) for tpb, count in spans)

    got = fit_spans(want, available, spans)
    assert 0 <= got <= want and need(got) <= available
    assert got == want or need(got + 1) > available


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("window", [None, 8])
def test_a_follow_up_turn_reuses_its_historys_partial_last_block(lazy, window):
    # a finished turn of 10 tokens (two full blocks of 4 and 2 tokens of a third): the next turn, its history and
    # a new message, resumes at token 10, not at the last whole block (8); the copied block reads as the original
    layers = FULL if window is None else full_sliding_layers(window=window)
    m = make_manager(layers, 16)
    m._lazy = lazy and m._lazy  # False: every full block keyed as it fills
    a = Request("a", list(range(1, 11)), 0)
    prefill(m, a)
    m.free(a)
    m.check_invariants()
    b = Request("b", [*range(1, 11), 70, 71, 72], 0)
    admit(m, b)
    assert b.num_computed_tokens == 10 and b.num_reused_tokens == 10
    assert m.stats().reuse_partial_hits == 1
    check_kv(m, b)
    compute(m, b, 3)
    check_kv(m, b)
    m.check_invariants()
    m.free(b)
    c = Request("c", [*range(1, 11), 70, 71, 72, 99], 0)  # the second turn's history: its own partial block
    admit(m, c)
    assert c.num_computed_tokens == 13
    check_kv(m, c)
    m.check_invariants()


# --- a partial hit's page copy on a shared arena ---------------------------------------------------


@st.composite
def _copy_lists(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """Distinct destination blocks and as many source blocks, none a destination: evenly stepped (either way, as
    consecutive ids usually are), stepped unevenly, or one or none."""
    n = draw(st.integers(0, 6))

    def blocks(lo: int) -> list[int]:
        if draw(st.booleans()) and n:
            step = draw(st.sampled_from([1, 2, 3, -1, -2]))
            start = lo + (0 if step > 0 else (n - 1) * -step)
            return [start + i * step for i in range(n)]
        return draw(st.lists(st.integers(lo, lo + 14), min_size=n, max_size=n, unique=True))

    src = blocks(0)
    dst = blocks(16) if draw(st.booleans()) else draw(st.permutations(blocks(16)))
    return dst, src


@given(_copy_lists(), st.sampled_from([torch.float32, torch.float8_e4m3fn]))
@settings(max_examples=300, deadline=None)
def test_copying_pages_by_block_lists_writes_each_destination_its_source_page(lists, dtype):
    dst, src = lists
    pages = torch.randint(0, 256, (2, 32, 3, 4), dtype=torch.uint8).view(dtype)  # float8: no CPU index_copy kernel
    want = pages.view(torch.uint8).clone()
    if dst:
        want[:, dst] = want[:, src]
    _copy_pages(pages, dst, src)
    assert torch.equal(pages.view(torch.uint8), want)


def test_copying_pages_takes_one_slice_copy_where_both_lists_step_evenly():
    pages = torch.arange(2 * 32 * 2, dtype=torch.float32).view(2, 32, 2)
    want = pages.clone()
    seen = []

    class Watch(torch.Tensor):
        def copy_(self, *args, **kwargs):
            seen.append("copied")
            return super().copy_(*args, **kwargs)

        def index_copy_(self, *args, **kwargs):
            seen.append("scattered")
            return super().index_copy_(*args, **kwargs)

        def index_select(self, *args, **kwargs):
            seen.append("gathered")
            return super().index_select(*args, **kwargs)

    watched = pages.as_subclass(Watch)
    # one copy of a slice where both lists step evenly; in host memory, otherwise, page by page (no temporary)
    for dst, src, calls in (([20, 18, 16], [7, 6, 5], 1),  # both descending: read backwards, both step evenly
                            ([21, 22, 23], [3, 5, 7], 1),
                            ([16, 18, 20], [7, 6, 5], 3),  # one ascending, one descending
                            ([16, 17, 19], [3, 4, 5], 3),
                            ([16, 17, 19], [5, 3, 4], 3)):
        want[:, dst] = want[:, src]
        _copy_pages(watched, dst, src)
        assert seen == ["copied"] * calls and torch.equal(pages, want), (dst, src)
        seen.clear()


def test_copying_unbacked_pages_runs_no_torch_op_yet_refuses_lists_a_device_copy_would():
    # a simulation's pools (meta) hold no bytes: a partial hit's copy moves nothing, so it runs no torch op (meta's
    # gather and scatter were a tenth of a tiny-gemma3 multi-turn run's V2 KV time); a page id outside the pool, which
    # meta's gather never saw (a meta index has no values), and lists of unequal length still fail as on a device
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    pages = torch.empty((2, 32, 3, 4), device="meta")
    with Record():
        for dst, src in (([20, 5, 17], [3, 30, 9]), ([21, 22, 23], [3, 5, 7]), ([31], [0]), ([], [])):
            _copy_pages(pages, dst, src)
    assert ops == []
    for dst, src, error in (([20, 5], [3, 32], IndexError), ([32], [3], IndexError),
                            ([20, 40, 17], [3, 5, 7], IndexError), ([20, 5], [3], ValueError)):
        with pytest.raises(error):
            _copy_pages(pages, dst, src)


@pytest.mark.parametrize("layers", [full_sliding_layers(window=8), split_sliding_layers(window=8), FULL])
def test_a_decode_s_reservation_is_schedule_tokens_of_one_token_up_to_max_seq_len_and_a_full_pool(layers):
    # schedule_decode reserves a decode's one token without reading the request's length; it must answer and leave
    # every table, the room, capacity and history as schedule_tokens(request, 1) does: within the pools, where a
    # block boundary finds none free (the search's answer), and at max_seq_len (nothing reserved)
    def run(decode: bool):
        m = make_manager(layers, 7, T=4, max_seq_len=22)
        a, b = Request("a", list(range(1, 7)), 40), Request("b", list(range(50, 53)), 40)
        prefill(m, a)
        prefill(m, b)
        seen = []
        for _ in range(24):
            for r in (a, b):
                if not m.has_cache(r):
                    continue
                r.output_token_ids.append(next_token(r))  # the token the last forward sampled: one pending
                got = m.schedule_decode(r) if decode else m.schedule_tokens(r, 1)
                cache = m.cache(r)
                seen.append((r.req_id, got, {n: list(t) for n, t in cache.tables.items()}, cache.room, cache.capacity,
                             cache.history))
                if got:
                    write_kv(m, r, r.num_computed_tokens, 1)
                    m.commit(r, 1)
                else:
                    m.free(r)  # no room or max_seq_len: it stops here
            m.check_invariants()
        return seen

    got, want = run(True), run(False)
    assert got == want
    assert any(n == 0 for _, n, *_ in want) and sum(n for _, n, *_ in want) > 20


@pytest.mark.parametrize("layers", [full_sliding_layers(window=8), split_sliding_layers(window=8), FULL])
def test_the_step_s_decodes_reserved_in_one_call_are_schedule_decode_of_each_until_the_first_that_does_not_fit(layers):
    # schedule_decodes (the scheduler's one call for a step's decodes) must answer how many of the first requests got
    # their slot and leave every table, room, capacity and history as schedule_decode of each in order does, stopping at
    # the first answer of 0 (that request, and every later one, untouched): at block boundaries, with the pools full
    # and at max_seq_len
    def run(batch: bool):
        m = make_manager(layers, 9, T=4, max_seq_len=22)
        rs = [Request(c, list(range(10 * i + 1, 10 * i + 4 + i)), 40) for i, c in enumerate("abc")]
        for r in rs:
            prefill(m, r)
        seen = []
        for _ in range(24):
            live = [r for r in rs if m.has_cache(r)]
            for r in live:
                r.output_token_ids.append(next_token(r))  # the token the last forward sampled: one pending
            if batch:
                k = m.schedule_decodes(live)
            else:
                k = 0
                while k < len(live) and m.schedule_decode(live[k]):
                    k += 1
            seen.append((k, [(r.req_id, {n: list(t) for n, t in m.cache(r).tables.items()}, m.cache(r).room,
                              m.cache(r).capacity, m.cache(r).history) for r in live]))
            for r in live[:k]:
                write_kv(m, r, r.num_computed_tokens, 1)
                m.commit(r, 1)
            for r in live[k:k + 1]:  # the one that did not fit stops here; the later ones decode again next round
                m.free(r)
            for r in live[k + 1:]:
                r.output_token_ids.pop()
            m.check_invariants()
        return seen

    got, want = run(True), run(False)
    assert got == want
    assert any(0 < k < len(live) for k, live in want) and sum(k for k, _ in want) > 20


@pytest.mark.parametrize("memo", [None, {}])
def test_a_lookup_after_the_request_grew_reads_its_new_tokens(memo):
    """A waiting request looked up, then run (its answer grown) and sent back to wait is looked up over its whole
    sequence: the token ids a lookup keeps packed on the request are packed again where the sequence outgrew them,
    and a block that differs from the cached run's stops the hit there (in a cache-aware pass's memo too)."""
    m = make_manager(FULL, 32)
    cached = Request("cached", [*range(1, 18)], 1)
    prefill(m, cached)  # 16 tokens in 4 whole blocks of 4
    m.free(cached)
    same, other = Request("same", [1, 2, 3, 4, 5], 8), Request("other", [1, 2, 3, 4, 5], 8)
    assert [m.cached_prefix(r, memo)[0] for r in (same, other)] == [4, 4]  # a block before the last token
    same.output_token_ids += [6, 7, 8, 9, 10, 11, 12, 13]  # as the driver appends a running request's tokens
    other.output_token_ids += [6, 7, 8, 99, 10, 11, 12, 13]
    memo = None if memo is None else {}  # a new pass
    assert [m.cached_prefix(r, memo)[0] for r in (same, other)] == [12, 8]
    probe = m.probe_hit(same)
    assert probe is not None and probe.tokens == 12


def test_a_request_keeps_its_packed_tokens_only_while_it_waits():
    """The token ids a lookup packs stay on a waiting request (looked up every step it waits), not on a running one
    nor a finished one: 8 bytes a token of every running request's sequence held for its whole run otherwise."""
    m = make_manager(FULL, 32)
    cached = Request("cached", [*range(1, 18)], 1)
    prefill(m, cached)
    m.free(cached)
    r = Request("r", [*range(1, 14)], 4)
    assert m.cached_prefix_tokens(r) == 12
    assert len(r.packed_ids) >= 8 * 12  # kept for its next lookups
    admit(m, r)
    assert r.packed_ids == b"" and r.num_computed_tokens == 12
    waiting = Request("w", [*range(1, 14)], 4)
    assert m.cached_prefix_tokens(waiting) == 12 and waiting.packed_ids
    m.free(waiting)  # finished before it was admitted (an abort)
    assert waiting.packed_ids == b""
