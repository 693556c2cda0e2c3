"""``kv_cache_config.pool_arena``: DeepSeek V4's groups of unequal pages drawing on one slab arena.

The setting (validation, "auto" and its audit record, ``setting_ignored`` elsewhere, the refusals), the arena's
invariants over random traffic, its joint room checks (never an allocation that fails after a check passed), the
floor (a slab per group in use), and what stats and the plan report.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_backends import build_layout
from cache_backends.budget import BudgetError, plan_arena, slabs_for_sequence
from cache_backends.interface import ManagerOptions
from cache_backends.pools import BlockPools
from cache_backends.request import Request
from cache_backends.v2 import KVCacheManagerV2, KVCacheV2Scheduler
from cache_backends.v2.slab_pool import SlabArena, SlabPool
from engine.driver import Driver

ARENA = "kv_cache_config.pool_arena"
SLAB = 98_304  # tiny-deepseek-v4's largest page: a sliding_w128 block (float32, 32-token blocks)
CPU = {"device": "cpu", "log": False, "progress": False}


def v4_layout(T: int = 128):
    from models import load_hf_config, resolve_checkpoint, spec_class_for

    cfg = load_hf_config(resolve_checkpoint("tiny-deepseek-v4"))
    return build_layout(spec_class_for(cfg.architectures[0])(cfg).kv_layers(), "v2", T, "float32")


def arena_manager(slabs: int, max_seq_len: int = 4096, **options: Any) -> KVCacheManagerV2:
    """A V2 manager over a slab arena of ``slabs`` slabs (meta pools: nothing allocated, as a simulation's)."""
    layout = v4_layout()
    plan = plan_arena(layout, slabs * SLAB, max_seq_len)
    pools = BlockPools(layout, plan.num_blocks, "meta", slabs=plan.slabs)
    return KVCacheManagerV2(pools, ManagerOptions(max_seq_len=max_seq_len, host_cache_size=0, **options))


def sim(budget: int | None = None, workload: str = "mixed", max_seq_len: int | None = None, **kv: Any):
    """Simulate tiny-deepseek-v4 on ``workload``; (result metrics, events)."""
    from engine.simulator import simulate

    events: list[dict[str, Any]] = []
    if budget is not None:
        kv["max_gpu_total_bytes"] = budget
    more = {} if max_seq_len is None else {"max_seq_len": max_seq_len}
    report = simulate("tiny-deepseek-v4", workload, kv_cache_config=kv, subscribers=[events.append], **more, **CPU)
    (result,) = report.results.values()
    return result, events


def planned(**overrides: Any) -> list[dict[str, Any]]:
    """The events of planning tiny-deepseek-v4 as a simulation does (pools that allocate nothing)."""
    from pipeline.context import LoadRequest
    from pipeline.run import execute
    from stages import plan_stages

    events: list[dict[str, Any]] = []
    execute(LoadRequest(model="tiny-deepseek-v4", overrides={"device": "cpu", **overrides}, pools_unbacked=True),
            plan_stages(), subscribers=[events.append], log=False)
    return events


# --- the setting -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["yes", 1, None, "arena"])
def test_a_bad_pool_arena_is_one_line_naming_the_field_and_what_is_accepted(value):
    import pipeline
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        pipeline.plan("tiny-deepseek-v4", log=False, kv_cache_config={"pool_arena": value})
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{ARENA}: expected true, false or \"auto\", got ")


def test_auto_is_the_arena_when_one_max_seq_len_sequence_fits_in_slabs_and_the_audit_says_why():
    layout = v4_layout()
    need = slabs_for_sequence(layout, 4096)  # max_seq_len 4096: 7 (2 window slabs, 4 csa_c4, 1 hca_c128)
    built, roomy = sim(need * SLAB, max_seq_len=4096)
    tight = planned(max_seq_len=4096, kv_cache_config={"max_gpu_total_bytes": (need - 1) * SLAB})
    (yes,) = [e for e in roomy if e["event"] == "auto_resolved" and e["field"] == ARENA]
    (no,) = [e for e in tight if e["event"] == "auto_resolved" and e["field"] == ARENA]
    assert (yes["original"], yes["old"], yes["new"], yes["source"]) == ("auto", "auto", True, "auto")
    assert f"holds {need:,} slabs" in yes["reason"] and f"takes {need:,}" in yes["reason"]
    assert (no["new"], no["source"]) == (False, "auto") and f"holds {need - 1:,} slabs" in no["reason"]
    assert (built.arena_slabs, built.layer_groups) == (need, None) and built.to_dict()["arena_slabs"] == need


def test_auto_is_the_arena_for_real_pools_on_a_cpu_too_and_says_why():
    import pipeline

    result = pipeline.plan("tiny-deepseek-v4", device="cpu", kv_cache_config={"max_tokens": 65536})
    (event,) = [e for e in result.audit.of("auto_resolved") if e["field"] == ARENA]
    assert event["new"] is True and "so any request fits" in event["reason"]
    # it says where the arena can lose and what to set there, not only where it won
    assert "up to 1.97x" in event["reason"] and "set pool_arena to false there" in event["reason"]
    assert result.args.kv_cache_config.pool_arena is True and result.kv.arena_slabs


def test_an_explicit_arena_on_real_pools_allocates_one_tensor_within_the_budget(track_pools):
    import pipeline

    kw = {"device": "cpu", "kv_cache_config": {"max_tokens": 65536, "pool_arena": True}}
    result = pipeline.load("tiny-deepseek-v4", log=False, **kw)
    try:
        assert result.kv.problem is None
        (pools,) = track_pools
        storage = pools.arena.untyped_storage()
        assert {t.untyped_storage().data_ptr() for t in pools.tensors.values()} == {storage.data_ptr()}
        assert storage.nbytes() == result.kv.arena_slabs * SLAB <= result.kv.budget.budget_bytes
    finally:
        result.close()
    assert pools.released


def test_a_slab_one_group_gave_back_holds_the_next_groups_own_entries_in_every_layer():
    """Real (CPU) pools of a slab arena, numbered as the slab pools hand blocks out: a compressed group writes every
    layer of a slab's blocks, then frees them (the slab goes back to the arena); the window group takes that slab and
    writes its own. Each reads back what it wrote, in every layer, through the views the attention indexes
    (``layer_slots`` at ``block * block_slots + offset``) and the block views forks copy (``tensors[g][:, b]``), and
    block ``b`` of a group lies at byte ``b * page`` of the one tensor, so the slab the window took is the memory the
    compressed group gave back."""
    import torch

    layout = v4_layout()
    plan = plan_arena(layout, 3 * SLAB, 4096)
    pools = BlockPools(layout, plan.num_blocks, "cpu", slabs=plan.slabs)
    arena = SlabArena(plan.slabs, pools.slab_bytes)
    own = {g.name: SlabPool(g.name, arena, g.bytes_per_block) for g in layout.groups}
    window = next(g for g in layout.groups if g.compress_rate is None)
    small = max((g for g in layout.groups if g.compress_rate), key=lambda g: own[g.name].per)
    gen = torch.Generator().manual_seed(0)

    def detach(name: str, blocks: list[int]) -> None:
        pass

    def write(g: Any, blocks: list[int]) -> dict[tuple[int, int], torch.Tensor]:
        wrote = {}
        for i in range(len(g.layers)):
            view = pools.layer_slots(g.name, i)
            for b in blocks:
                data = torch.randn((g.entries_per_block, g.entry_elems), generator=gen)
                view[b * pools.block_slots[g.name] + torch.arange(g.entries_per_block)] = data
                wrote[i, b] = data
        return wrote

    def reads_back(g: Any, wrote: dict[tuple[int, int], torch.Tensor]) -> bool:
        view = {i: pools.layer_slots(g.name, i) for i in range(len(g.layers))}
        step = pools.block_slots[g.name]
        return all(torch.equal(view[i][b * step:b * step + g.entries_per_block], data)
                   and torch.equal(pools.tensors[g.name][i, b], data) for (i, b), data in wrote.items())

    assert pools.nbytes == pools.arena.untyped_storage().nbytes() == 3 * SLAB
    compressed = own[small.name].allocate_many(own[small.name].per, detach)  # one whole slab
    (slab,) = {b // own[small.name].per for b in compressed}
    held = own[window.name].allocate_many(1, detach)  # another slab
    mine, theirs = write(small, compressed), write(window, held)
    assert reads_back(small, mine) and reads_back(window, theirs)
    own[small.name].release(compressed, 0, False, detach)
    assert slab in arena.free
    (taken,) = own[window.name].allocate_many(1, detach)
    assert taken == slab  # one window block a slab: the slab the compressed group gave back
    base = pools.arena.data_ptr()
    for g, b in ((window, taken), (small, compressed[0])):
        assert pools.tensors[g.name][0, b].data_ptr() - base == b * g.bytes_per_block
    theirs |= write(window, [taken])
    assert reads_back(window, theirs) and not reads_back(small, mine)  # the same memory, now the window's


def test_an_arena_with_a_host_tier_is_refused_and_auto_keeps_the_split():
    from engine.simulator import simulate
    from pipeline import KvBuildError

    with pytest.raises(KvBuildError, match=r"pool_arena=true runs without a host tier, and "
                                           r"kv_cache_config.host_cache_size=1000000 asks for one"):
        simulate("tiny-deepseek-v4", "mixed", kv_cache_config={"pool_arena": True, "host_cache_size": 1_000_000},
                 **CPU)
    _, events = sim(host_cache_size=1_000_000)
    (event,) = [e for e in events if e["event"] == "auto_resolved" and e["field"] == ARENA]
    assert event["new"] is False and "host_cache_size=1000000" in event["reason"]


@pytest.mark.parametrize("value", [True, False])
def test_an_explicit_pool_arena_on_a_model_of_equal_pages_is_a_setting_ignored_warning(value):
    import pipeline

    result = pipeline.plan("tiny-gemma3", log=False, device="cpu",
                           kv_cache_config={"max_tokens": 4096, "pool_arena": value, "use_kv_cache_manager_v2": True})
    (ignored,) = [e for e in result.audit.of("setting_ignored") if e["field"] == ARENA]
    assert ignored["value"] is value and "already share one arena of equal pages" in ignored["reason"]
    quiet = pipeline.plan("tiny-gemma3", log=False, device="cpu", kv_cache_config={"max_tokens": 4096})
    assert not [e for e in quiet.audit.of("setting_ignored") if e["field"] == ARENA]  # "auto": nothing to say


@pytest.mark.parametrize(("model", "v2"), [("tiny-llama", "auto"), ("tiny-gemma3", "auto"), ("tiny-gemma3", True),
                                         ("tiny-deepseek-v3", "auto")])
def test_an_explicit_pool_arena_auto_says_nothing_where_unset_says_nothing(model, v2):
    # "auto" written out warned "setting_ignored pool_arena=false" (the resolved value, which the user never wrote)
    # wherever the layout has nothing to choose: an explicit "auto" is the field left unset
    import pipeline

    kv = {"max_tokens": 4096, "use_kv_cache_manager_v2": v2}
    unset = pipeline.plan(model, log=False, device="cpu", kv_cache_config=kv)
    auto = pipeline.plan(model, log=False, device="cpu", kv_cache_config={**kv, "pool_arena": "auto"})
    assert auto.audit.of("setting_ignored") == unset.audit.of("setting_ignored") == []
    assert auto.args == unset.args


# --- the arena through the simulator ------------------------------------------------------------------------------


def test_the_arena_runs_the_mixed_workload_in_fewer_steps_than_the_split_at_the_same_budget():
    split, _ = sim(pool_arena=False)
    arena, _ = sim(pool_arena=True)
    assert arena.metrics.finished == split.metrics.finished
    # 1,324 steps against 1,882 (BENCHMARKS.md): the groups lend each other memory
    assert arena.metrics.steps < split.metrics.steps
    assert arena.pool_bytes == arena.arena_slabs * SLAB <= split.budget_bytes


def test_below_a_slab_per_group_the_plan_refuses_and_a_request_above_the_arena_never_fits():
    layout = v4_layout()
    with pytest.raises(BudgetError, match="a slab arena needs one per layer group"):
        plan_arena(layout, (len(layout.groups) - 1) * SLAB + SLAB - 1, 4096)
    m = arena_manager(len(layout.groups), max_seq_len=4096)
    short = Request("short", list(range(40)), 8)
    long = Request("long", list(range(3000)), 8)
    assert m.never_fits(short) is None
    why = m.never_fits(long)
    assert why is not None and why.startswith("request long needs ") and f"the arena has {len(layout.groups)}" in why


@settings(max_examples=25, deadline=None)
@given(slabs=st.integers(3, 60), most=st.integers(0, 3000))
def test_the_arena_plan_counts_the_longest_sequence_and_how_many_fit_as_a_linear_scan_does(slabs, most):
    """``capacity_tokens``: the longest sequence up to ``max_seq_len`` whose slabs fit alone; ``max_concurrency``: the
    most sequences of ``max_seq_len`` tokens whose blocks, packed into whole slabs per group, fit together."""
    layout = v4_layout()  # three groups: three slabs at the least
    plan = plan_arena(layout, slabs * SLAB, most)
    longest = max((n for n in range(1, most + 1) if slabs_for_sequence(layout, n) <= slabs), default=0)
    per = [(g.blocks_for(max(most, 1)), SLAB // g.bytes_per_block) for g in layout.groups]
    together = next(n for n in itertools.count(1) if sum(-(-(n * b) // k) for b, k in per) > slabs) - 1
    assert (plan.capacity_tokens, plan.max_concurrency) == (longest, together)


def test_stats_and_the_plan_report_slabs_not_fixed_group_sizes():
    m = arena_manager(12)
    r = Request("a", list(range(300)), 4)
    m.create(r)
    m.resume(r)
    assert m.schedule_tokens(r, 300) == 300
    s = m.stats()
    assert s.arena["slabs"] == 12 and s.arena["free_slabs"] == 12 - sum(g.slabs for g in s.groups.values())
    for name, g in s.groups.items():
        assert g.total == g.slabs * m._pool[name].per and g.free + g.evictable + g.used == g.total
    assert "slab arena of 12 slabs" in s.memory and 0 < s.usage <= 1
    m.check_invariants()

    from pipeline.context import LoadRequest
    from pipeline.run import execute
    from stages import plan_stages

    overrides = {"device": "cpu", "max_seq_len": 4096,
                 "kv_cache_config": {"max_gpu_total_bytes": 100 * SLAB, "pool_arena": True}}
    plan = execute(LoadRequest(model="tiny-deepseek-v4", overrides=overrides, pools_unbacked=True), plan_stages(),
                   log=False).kv
    text = "\n".join(plan.render())
    assert plan.problem is None and plan.arena_slabs == 100
    assert "one slab arena of 100 slabs" in text and "no group's share is fixed" in text
    assert all(g["blocks"] is None for g in plan.to_dict()["layer_groups"])


# --- invariants and joint checks over random traffic ------------------------------------------------------------


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slabs=st.integers(4, 40),
       reqs=st.lists(st.tuples(st.integers(1, 900), st.integers(1, 300), st.integers(0, 3), st.integers(0, 2)),
                     min_size=1, max_size=14),
       policy=st.sampled_from(["fcfs", "priority"]))
def test_arena_invariants_hold_every_step_and_no_allocation_fails_after_a_passing_check(slabs, reqs, policy):
    m = arena_manager(slabs, max_seq_len=1200)
    scheduler = KVCacheV2Scheduler(m, 8, 256, scheduling_policy=policy)
    prefixes = [[(7 * i) % 97 for i in range(400)], [(11 * i) % 89 for i in range(300)], []]
    requests = []
    for i, (n, new, shared, prio) in enumerate(reqs):
        prompt = (prefixes[shared % 3] + [i * 1000 + j for j in range(n)])[:1100]
        requests.append(Request(f"r{i}", prompt, new, priority=prio))
    driver = Driver(m, scheduler)
    steps = []

    def compute(out):
        return {c.request.req_id: 1 for c in out.scheduled
                if c.request.num_computed_tokens + c.num_tokens == c.request.num_tokens}

    def stepped(clock, stats):
        m.check_invariants()  # every slab free or owned once, free + used + cached == each group's slabs' blocks
        assert m.usage() == m.stats().usage
        steps.append(clock)
        assert len(steps) < 20_000

    from engine.driver import StalledError

    try:
        driver.run(requests, compute, on_step=stepped)  # a check that over-promised raises (RuntimeError/IndexError)
    except StalledError:  # only a request the arena can never hold (never_fits) may stop the run
        assert any(m.never_fits(r) for r in requests)


@settings(max_examples=200, deadline=None)
@given(pages=st.sampled_from([(1, 8, 256), (1, 2), (4, 1, 16)]), slabs=st.integers(1, 12), data=st.data())
def test_a_passing_joint_check_always_allocates(pages, slabs, data):
    # random states of free, used and cached blocks (let go by release or decref); then any need the check passes is
    # allocated in full
    arena = SlabArena(slabs, 1024)
    pools = [SlabPool(f"g{i}", arena, 1024 // p) for i, p in enumerate(pages)]
    detached: list[int] = []

    def detach(name: str, blocks: list[int]) -> None:
        pool = next(p for p in pools if p.name == name)
        for b in blocks:
            pool.node[b] = None
        detached.extend(blocks)

    held: list[list[int]] = [[] for _ in pools]
    for _ in range(data.draw(st.integers(0, 30))):
        i = data.draw(st.integers(0, len(pools) - 1))
        pool = pools[i]
        if held[i] and data.draw(st.booleans()):
            b = held[i].pop(data.draw(st.integers(0, len(held[i]) - 1)))
            keep = data.draw(st.booleans())
            if keep:
                pool.node[b] = SimpleNamespace(children=())  # attached: cached on release
            if data.draw(st.booleans()):
                pool.release([b], 0, keep, detach)
            else:  # decref: the same steps for one block
                pool.decref(b, 0, keep, detach)
        else:
            n = data.draw(st.integers(1, 40))
            need = [0] * len(pools)
            need[i] = n
            if arena.short(need) is None:
                held[i] += pool.allocate_many(n, detach)
        assert not arena.check()
    need = [data.draw(st.integers(0, 3 * slabs * p)) for p in pages]
    if arena.short(need) is None:
        arena.acquire(need, detach)
        for pool, n in zip(pools, need, strict=True):
            got = pool.allocate_many(n, detach)
            assert len(set(got)) == n and all(arena.owner[b // pool.per] == pool.index for b in got)
    assert not arena.check()


def test_a_check_for_a_hits_claim_counts_no_slab_its_cached_blocks_lie_in_as_reclaimable():
    # group g1 (4 blocks a slab): slab 0 holds 4 cached blocks (reclaimable), slab 1 one used block and 3 free ones;
    # g0 (1 block a slab) uses the other two slabs. A hit's claim takes one cached block into use (extra -1): it can
    # only be in slab 0, which then holds a used block, so no slab is left for g0
    arena = SlabArena(4, 1024)
    g0, g1 = SlabPool("g0", arena, 1024), SlabPool("g1", arena, 256)
    detach = lambda name, blocks: [g1.node.__setitem__(b, None) for b in blocks]  # noqa: E731
    cached = g1.allocate_many(4, detach)
    for b in cached:
        g1.node[b] = SimpleNamespace(children=())
    g1.release(cached, 0, True, detach)
    g1.allocate_many(1, detach)
    g0.allocate_many(2, detach)
    assert not arena.free and g1.empty == {0} and not arena.check()
    assert arena.short([1, 0], extra=[0, -1]) == 0  # the claim leaves g0 short
    assert arena.short([1, 0]) is None  # without it, g1's slab 0 is reclaimed
    arena.acquire([1, 0], detach)
    assert g0.allocate_many(1, detach) == [0] and arena.counters["evicted_by_reclaim"] == 4 and not arena.check()


def test_a_request_alone_in_a_slab_arena_reaches_the_worst_case_never_fits_let_in():
    # DeepSeek V4-like groups of unequal pages (full: a slab a block; sliding_w6: 2 blocks a slab; csa_c8: 4) on 9
    # slabs. "b" alone needs 6 + 2 + 1 = 9 slabs at its worst case (12 tokens), so never_fits admits it. Greedy
    # admission runs "a" beside it; b is preempted, re-admitted holding its cached window blocks (in slabs beside a's
    # cached ones), and its window's next block is the least recently used cached one, in a third slab. Alone, b's 3
    # window blocks pinned 3 sliding slabs where 2 hold them, and its next full block found no slab: the scheduler
    # reported that it cannot grow although it runs alone (a StalledError, which fails the server's requests in
    # flight). Found by a seeded driven sweep with aborts and forks (bughunt54: about 1 in 300 runs on slab arenas).
    # The scheduler now packs the used blocks first (KVCacheManagerV2.compact_slabs): b's window blocks move into 2
    # slabs, KV and all (drive checks every running request's KV and the invariants each step), and b completes.
    from tests.kv_v2_support import drive, slab_manager

    m = slab_manager(9)
    s = KVCacheV2Scheduler(m, max_batch_size=4, max_num_tokens=16, init_ratio=0.0)
    a, b = Request("a", [1], 4, arrival=0), Request("b", [2] * 4, 8, arrival=1)
    assert m.never_fits(a) is None and m.never_fits(b) is None
    assert m._slabs.slabs_for([g.blocks_for(12) for g in m.groups]) == m._slabs.num_slabs == 9  # b fits exactly
    res = drive(m, s, [a, b])
    sliding = m._slabs.pools[1]
    pinned = [sliding.used_in[x] for x in sliding.slabs()]
    assert res.stalled is None, f"{res.stalled}; {sliding.name}'s blocks in use per slab: {pinned}"
    assert sorted(r.req_id for r in res.finished) == ["a", "b"]
    assert m._slabs.counters["blocks_moved"] == 1  # the one window block that pinned a third slab


def _fragmented(device: str = "cpu"):
    """A slab arena where ``b``'s window blocks sit one a slab: ``a`` and ``b`` (same layout as above, 16 slabs)
    computed their prompts chunk by chunk side by side (best fit puts their blocks in the same slabs), then ``a``
    finished (its blocks cached): (manager, a, b)."""
    from tests.kv_v2_support import admit, compute, slab_manager

    m = slab_manager(16, device)
    a, b = Request("a", [1, 3] * 6, 8), Request("b", [2, 4] * 6, 8)
    admit(m, a)
    admit(m, b)
    for _ in range(3):
        compute(m, a, 2)
        compute(m, b, 2)
    m.free(a)
    return m, a, b


def test_compaction_packs_a_group_s_used_blocks_into_the_fewest_slabs_with_their_kv_and_references():
    from tests.kv_v2_support import admit, check_kv, compute

    m, _, b = _fragmented()
    sliding = m._slabs.pools[1]
    assert [sliding.used_in[x] for x in sliding.slabs()] == [1, 1, 1]  # 3 window blocks of b, one a slab
    before = list(m.cache(b).tables[sliding.name])
    free_slabs = len(m._slabs.free)
    assert m.compact_slabs() == 1
    m.check_invariants()  # tables, runs, reference counts, used_in / empty / free_in all agree
    used = sorted((sliding.used_in[x] for x in sliding.slabs()), reverse=True)
    assert used[:2] == [2, 1] and not any(used[2:])  # in ceil(3 / 2) slabs; the third holds only cached blocks
    after = m.cache(b).tables[sliding.name]
    (moved,) = [y for x, y in zip(before, after, strict=True) if x != y]  # one block of b's table changed
    run = sliding.node[moved]
    assert run is not None and run.blocks[sliding.name][sliding.pos[moved] - run.start] == moved  # b's keyed block
    assert len(m._slabs.free) == free_slabs  # (the left slab keeps a's cached blocks: reclaimable, not free)
    check_kv(m, b)  # the moved block's pages were copied with it
    assert m.compact_slabs() == 0  # packed: nothing more to move
    compute(m, b, 2)
    check_kv(m, b)
    m.free(b)
    # a later request with b's prompt hits its cached prefix, the moved block included, and reads b's KV there
    c = Request("c", [2, 4] * 6, 4)
    admit(m, c)
    assert c.num_reused_tokens == 8 and moved in m.cache(c).tables[sliding.name]
    check_kv(m, c)
    compute(m, c, 4)
    check_kv(m, c)
    m.check_invariants()


def test_compaction_without_a_slab_arena_or_on_meta_pools():
    # a split layout has no slabs: nothing to pack; a simulation's meta pools move blocks without data
    from tests.kv_v2_support import make_manager, split_sliding_layers

    assert make_manager(split_sliding_layers(8), 16).compact_slabs() == 0
    m, _, _ = _fragmented("meta")
    assert m.compact_slabs() == 1
    m.check_invariants()


def test_deepseek_v4_snapshots_follow_a_moved_block():
    from models.deepseek_v4_paged import V4Snapshot, V4Snapshots

    snaps = V4Snapshots(2)
    snap = V4Snapshot(4, b"d", {})
    snaps.put(7, 3, snap)
    snaps.put(9, 1, V4Snapshot(6, b"e", {}))  # kept at a generation the block no longer has: not moved along
    gens = {7: 3, 2: 5, 9: 2, 4: 1}
    snaps.move([(7, 2), (9, 4)], gens.__getitem__)
    assert snaps.get(2, 5, 4, lambda: b"d") is snap
    assert snaps.get(7, 3, 4, lambda: b"d") is None and 4 not in snaps.by_block and len(snaps) == 1


def test_plan_compare_counts_the_sequences_an_arena_s_slabs_hold_not_a_split_s():
    import pipeline
    from cache_backends.budget import arena_sequences
    from engine.capacity import compare_capacity

    comparison = compare_capacity(pipeline.plan("tiny-deepseek-v4", log=False, device="cpu", max_seq_len=4096))
    v2 = comparison.v2
    assert v2.plan.arena  # "auto" at the compared budget (16 sequences of max_seq_len): the arena
    assert [v2.max_concurrency(n) for n in comparison.lengths] == [
        arena_sequences(v2.plan.layout, v2.plan.arena_slabs, n) for n in comparison.lengths]
    assert "a slab arena: its slabs filled with them" in comparison.render()[-1]
