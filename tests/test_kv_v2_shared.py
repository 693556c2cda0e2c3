"""V2 memory shared between layer groups: one arena, one free list, global eviction, joint room checks.

Issue 10 item 2: with a pool per group split once for ``max_seq_len`` sequences, many short requests on a
sliding-window model filled the window pool while the full-attention pool stayed mostly empty. These
tests pin what sharing promises a user: short requests reach V1's concurrency at the same bytes, a long
request uses the pages short ones freed, eviction takes the least recently used cached page whatever
its group, the plan says how the memory is held, and layouts that cannot share say why.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeline
from cache_backends import LayerKV, build_layout
from cache_backends.layout import cut_families
from cache_backends.pools import BlockPools
from cache_backends.request import Request
from cache_backends.v2 import KVCacheManagerV2
from cache_backends.v2.shared_pool import SharedPool, interleave
from engine.simulator import simulate
from engine.workloads import make_workload
from tests.kv_v2_support import (
    admit,
    arena_owner,
    blocks_add_up,
    check_kv,
    compute,
    cuts_of,
    make_manager,
    next_token,
    own_groups,
    prefill,
    split_sliding_layers,
    tied,
    write_kv,
)

CPU = {"device": "cpu", "log": False, "progress": False}


def held(table: list[int]) -> list[int]:
    return [b for b in table if b >= 0]


def gemma_like(window: int = 8) -> list[LayerKV]:
    """Five sliding layers and one full layer with equal entries, as tiny-gemma3: six 1-layer groups."""
    return [LayerKV(i, "sliding", 4, window=window) for i in range(5)] + [LayerKV(5, "full", 4)]


def test_every_group_views_one_arena_tensor_counted_once():
    layout = build_layout(gemma_like(), "v2", 4, "float32")
    pools = BlockPools(layout, {g.name: 30 for g in layout.groups}, "cpu")
    arena = pools.tensors["full"]
    assert all(t is arena for t in pools.tensors.values()) and tuple(arena.shape) == (1, 30, 4, 4)
    assert pools.nbytes == 30 * layout.page_bytes == layout.pool_bytes(pools.num_blocks)
    assert pools.layer_slots("sliding_w8.3", 0).data_ptr() == pools.layer_slots("full", 0).data_ptr()
    pools.release()


def test_many_short_requests_reach_v1_concurrency_at_the_same_budget():
    """tiny-gemma3, 72-token requests at 24 V1 blocks: the old split sized the five window pools for one
    8,192-token sequence (17 blocks each: 5 requests at once, 519 steps against V1's 391); the shared arena
    gives every group whatever pages are free."""
    workload = make_workload("no-reuse", 48, 0, prompt_len=8, answer_len=64)
    v1_block = 6 * 32 * 256  # 6 layers x 32 tokens x 256 B
    report = simulate("tiny-gemma3", workload, compare=True, kv_cache_config={"max_gpu_total_bytes": 24 * v1_block},
                      **CPU)
    v1, v2 = (report.results[n].metrics for n in ("KVCacheManager", "KVCacheManagerV2"))
    assert v1.finished == v2.finished == 48
    assert v2.max_concurrency >= v1.max_concurrency == 8
    assert v2.steps <= v1.steps


def test_a_long_request_uses_the_pages_short_ones_freed():
    m = make_manager(gemma_like(window=8), {name: 60 for name in _names()}, enable_block_reuse=False)
    shorts = [Request(f"s{i}", [100 * i + t for t in range(8)], 0) for i in range(5)]
    sliding_pages = set()
    for r in shorts:  # 5 x (2 full + 5 x 2 sliding) = 60 pages: the arena is full of mostly sliding pages
        prefill(m, r)
        for name in _names()[:5]:
            sliding_pages |= set(held(m.block_table(r, name)))
    assert m.stats().groups["full"].free == 0
    for r in shorts:
        m.free(r)
    long = Request("long", list(range(1, 141)), 0)  # 140 tokens: 35 full blocks, more than the 10 shorts held
    admit(m, long)
    for _ in range(0, 140, 4):
        compute(m, long, 4)
    check_kv(m, long)
    full = set(held(m.block_table(long, "full")))
    assert len(full) == 35 and full & sliding_pages  # the full layer now holds pages sliding layers held
    m.check_invariants()


def test_eviction_is_global_a_cached_full_page_serves_a_sliding_group():
    m = make_manager(gemma_like(window=8), {name: 24 for name in _names()})
    a = Request("a", list(range(1, 17)), 0)  # 16 tokens: 4 full blocks + 5 x 4 sliding, all keyed
    prefill(m, a)
    a_full = set(held(m.block_table(a, "full")))
    m.free(a)  # a's pages stay cached: 4 full + 5 x 2 in-window sliding + 5 x 2 out-of-window
    stats = m.stats()
    assert stats.groups["full"].evictable == 4 and blocks_add_up(stats, shared=True)
    b = Request("b", list(range(500, 516)), 0)  # another prefix: needs every page, so every cached one goes
    admit(m, b)
    for _ in range(4):  # chunks of one block: each takes a page per group, oldest cached first; a's full
        compute(m, b, 4)  # pages (released last) come in the fourth chunk, partly to sliding groups
    b_sliding = {blk for name in _names()[:5] for blk in held(m.block_table(b, name))}
    assert a_full & b_sliding, "a cached full-attention page was evicted to give a sliding group a page"
    stats = m.stats()
    assert stats.groups["full"].evictions == 4 and stats.evictions == 24
    check_kv(m, b)
    m.check_invariants()


class _Run:
    """A radix run as the pools read it: a leaf unless given children."""

    def __init__(self, name: str = "run", children: dict | None = None) -> None:
        self.name, self.children = name, children or {}

    def __repr__(self) -> str:
        return self.name

    def __eq__(self, other: object) -> bool:  # two arenas built alike compare equal, run by run
        return isinstance(other, _Run) and (other.name, other.children) == (self.name, self.children)

    def __hash__(self) -> int:
        return hash(self.name)


def test_shared_pool_evicts_least_recently_released_first_whatever_the_group():
    pool = SharedPool(["full", "sliding"], 3)
    detached: list[tuple[str, list[object]]] = []
    nodes = [_Run() for _ in range(3)]
    record = _recorder(detached, pool)
    old = pool.take(0, 2, record)  # full takes 2, sliding 1
    new = pool.take(1, 1, record)
    for b, node in zip([*old, *new], nodes, strict=True):
        pool.node[b] = node  # type: ignore[assignment]
    pool.release(0, old, 0, True, record)  # full's pages cached first (least recently)
    pool.release(1, new, 0, True, record)
    assert (pool.cached, pool.used, pool.available) == ([2, 1], [0, 0], 3)
    got = pool.take(1, 1, record)  # sliding needs a page: full's oldest goes
    assert got == [old[0]] and detached == [("full", [old[0]], [nodes[0]])] and pool.node[old[0]] is None
    assert pool.group_of[old[0]] == 1 and pool.evicted == [1, 0] and pool.cached == [1, 1]


def test_room_is_checked_jointly_for_the_groups_of_the_arena():
    m = make_manager(gemma_like(window=64), {name: 11 for name in _names(64)})
    r = Request("r", list(range(1, 9)), 0)
    admit(m, r)
    # 8 tokens need 2 blocks in each of 6 groups = 12 pages; each group alone would fit its 2 in 11
    assert m.fit_tokens(r, 8) == 4 and m.allocate(r, 8) is False
    # a need of one cut of the sliding family alone: the page arena takes its 6 pages; a tie of the cuts takes whole
    # rows only (a logical block holds a page of each of the 5 cuts), so 6 blocks of one cut are 6 rows, 30 pages. By
    # design: the manager itself asks every cut of a family alike (per_group), so no decision of its depends on it
    need = 6 + 6 * (5 if tied(m) else 1)
    assert m.shortfall({"full": 6, "sliding_w64.0": 6}) == f"{need} blocks of the arena shared by 6 groups needed, " \
                                                           "11 free or evictable"
    too_long = Request("x", list(range(1, 9)), 0)
    assert "needs 12 blocks of the arena shared by 6 groups for 8 tokens; the pool has 11" in m.never_fits(too_long)
    assert m.allocate(r, 4) and m.stats().groups["full"].used == 1
    m.check_invariants()


def test_plan_reports_the_arena_and_the_joint_sequence_count():
    kv = pipeline.plan("tiny-gemma3", log=False, device="cpu", max_seq_len=1024,
                       kv_cache_config={"use_kv_cache_manager_v2": True, "max_tokens": 4096}).kv
    doc = kv.to_dict()
    arena = doc["memory"]["arena_blocks"]
    assert doc["memory"]["shared"] and doc["memory"]["unshared_reason"] is None
    assert [g["blocks"] for g in doc["layer_groups"]] == [arena] * 6  # what each group could hold alone
    per_sequence = 1024 // 32 + 5 * 17  # the full layer's blocks + five windows of 17
    assert doc["max_concurrency"] == arena // per_sequence
    assert doc["total_bytes"] == arena * doc["memory"]["page_bytes"]
    text = "\n".join(kv.render())
    assert f"memory: one arena shared by 6 groups, {arena:,} pages" in text
    assert f"{arena // per_sequence} sequence(s) of 1,024 tokens fit jointly" in text


def test_a_layout_whose_pages_differ_keeps_the_split_and_says_why():
    kv = pipeline.plan("tiny-deepseek-v4", log=False, device="cpu",
                       kv_cache_config={"max_tokens": 65536, "pool_arena": False}).kv  # not the slab arena
    memory = kv.to_dict()["memory"]
    assert memory["shared"] is False and memory["arena_blocks"] is None
    assert memory["unshared_reason"].startswith("compressed groups have other page sizes")
    assert "memory: split between groups (compressed groups have other page sizes" in "\n".join(kv.render())
    blocks = {g["name"]: g["blocks"] for g in kv.to_dict()["layer_groups"]}
    assert len(set(blocks.values())) > 1  # each group's own pool
    # the windows are sized for the sequences where they cost what growth does, and the plan says which length
    groups = {g["name"]: g for g in kv.to_dict()["layer_groups"]}
    window = 2 * groups["sliding_w128"]["bytes_per_block"]  # a 128-token window spans 2 blocks of 128
    growth = sum(g["bytes_per_block"] / g["tokens_per_block"] for g in groups.values() if g["window"] is None)
    assert memory["split_length"] == -(-window // growth) == 1986
    assert blocks["sliding_w128"] == 2 * -(-65536 // 1986)  # windows for the 1,986-token sequences of 65,536
    assert "windows sized for sequences of 1,986 tokens, where they cost what growth does, not 65,536" in memory["text"]


def test_manager_stats_say_the_memory_is_shared():
    m = make_manager(gemma_like(), 10)
    assert m.stats().memory.startswith("memory: one arena shared by 6 groups, 60 pages")
    assert make_manager([LayerKV(0, "full", 4)], 10).stats().memory is None


def _names(window: int = 8) -> list[str]:
    return [g.name for g in build_layout(gemma_like(window), "v2", 4, "float32").groups]


def _release_group_by_group(pool: SharedPool, tables: list[list[int]], priority: int) -> None:
    """What one ``release_tables`` of a finish must do, by ``release`` group by group (each table tail first), except
    that the groups' cached blocks are queued position by position, so what eviction leaves of the request is a
    whole prefix."""
    queued: list[tuple[list[int], list[int]]] = []
    pool.evictable.add_split = lambda blocks, owner, _p: queued.append(  # type: ignore[method-assign]
        ([x for x in blocks if not owner[x].children], [x for x in blocks if owner[x].children]))
    try:
        for g, table in enumerate(tables):
            pool.release(g, reversed(table), priority, True, lambda n, x: None)
    finally:
        del pool.evictable.add_split
    for kind, shared in ((0, False), (1, True)):
        lists = [q[kind] for q in queued]
        pool.evictable.add_many([lst[k] for k in range(max(map(len, lists), default=0)) for lst in lists
                                 if k < len(lst)], priority, shared)


def _pool_state(pool: SharedPool) -> tuple:
    return (list(pool._free), pool.evictable.blocks(), list(pool.ref), list(pool.gen), list(pool.group_of),
            list(pool.node), list(pool.used), list(pool.cached), list(pool.evicted))


def _filled(seed: int) -> tuple[SharedPool, list[list[int]]]:
    """An arena of 4 groups with some blocks used, some cached (keyed, evictable, mixed priorities), some free."""
    import random

    rng = random.Random(seed)
    pool = SharedPool(["s.0", "s.1", "s.2", "full"], 40)
    keep = lambda g, blocks: None  # noqa: E731
    tables = [pool.take(g, rng.randint(8, 10), keep) for g in range(4)]  # the arena nearly full
    for g, table in enumerate(tables):
        for b in table:
            if rng.random() < 0.7:
                # some runs have children (a shared prefix: queued after the leaves of its priority)
                pool.node[b] = _Run(f"node{b}", {"child": 1} if rng.random() < 0.4 else None)  # type: ignore[assignment]
        pool.release(g, table[: len(table) // 2][::-1], rng.randint(0, 2), True, keep)
        del table[: len(table) // 2]
    return pool, tables


def _detached(seen: list) -> dict[str, list[tuple[int, object]]]:
    """Recorded detaches as each group's (block, run) pairs in the order they went."""
    out: dict[str, list[tuple[int, object]]] = {}
    for group, blocks, nodes in seen:
        out.setdefault(group, []).extend(zip(blocks, nodes, strict=True))
    return out


def _recorder(seen: list, pool: SharedPool) -> Callable[[str, list], None]:
    """A detach callback that records (group, blocks, their radix nodes) and clears the nodes, as the manager's."""

    def detach(group: str, blocks: list) -> None:
        seen.append((group, list(blocks), [pool.node[b] for b in blocks]))
        for b in blocks:
            pool.node[b] = None

    return detach


def test_batched_arena_calls_do_exactly_what_the_per_group_calls_do():
    # take_each / release_tables / release_slices / incref_many hand out and take back the same blocks in the
    # same order, with the same detaches, as take / release / decref / incref called group by group
    for seed in range(20):
        for counts in ([2, 2, 2, 2], [4, 4, 4, 4], [0, 5, 0, 9], [1, 1, 1, 12]):  # most evict from several groups
            a, tables_a = _filled(seed)
            b, tables_b = _filled(seed)
            if sum(counts) > a.available:
                continue
            seen_a: list = []
            seen_b: list = []
            record_a, record_b = _recorder(seen_a, a), _recorder(seen_b, b)
            got_a = [a.take(g, k, record_a) if k else [] for g, k in enumerate(counts)]
            got_b = b.take_each(range(4), counts, record_b)
            # the same blocks detached from the same runs, per group (take_each detaches once per group, in
            # eviction order; radix detaching is confluent, so only what is detached matters)
            assert got_a == got_b and _detached(seen_a) == _detached(seen_b) and _pool_state(a) == _pool_state(b)
            for j in range(2):  # a window of every group slides past 2 blocks, released position by position
                for g, table in enumerate(tables_a):
                    a.release(g, (table[j],), 1, True, lambda n, x: None)
                    table[j] = -1
            b.release_slices(list(enumerate(tables_b)), 0, 2, 1)
            assert tables_a == tables_b and _pool_state(a) == _pool_state(b)
            cached = a.evictable.blocks()[:6]
            for bl in cached:  # a hit claims cached blocks of their groups
                a.incref(a.group_of[bl], bl)
            for g in range(4):
                b.incref_many(g, [bl for bl in cached if b.group_of[bl] == g])
            assert _pool_state(a) == _pool_state(b)
            _release_group_by_group(a, [t + got for t, got in zip(tables_a, got_a, strict=True)], 2)
            b.release_tables([(g, t + got) for g, (t, got) in enumerate(zip(tables_b, got_b, strict=True))], 2)
            assert _pool_state(a) == _pool_state(b)


def _twin_arenas(pages: int, groups: list[tuple[int, int]]) -> tuple[SharedPool, SharedPool]:
    """Two equal arenas of ``pages`` pages where group g queued ``groups[g] = (cached, priority)`` cached blocks."""
    names = [f"g{g}" for g in range(len(groups))]
    arenas = []
    for _ in range(2):
        pool = SharedPool(names, pages)
        for g, (cached, priority) in enumerate(groups):
            table = pool.take(g, cached, lambda n, x: None)
            for b in table:
                pool.node[b] = _Run(f"run{b}")  # type: ignore[assignment]
            pool.release(g, table[::-1], priority, True, lambda n, x: None)
        arenas.append(pool)
    return arenas[0], arenas[1]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 14), st.integers(0, 14), st.integers(0, 2)), min_size=1, max_size=5))
def test_a_take_of_every_group_in_one_call_counts_each_groups_evictions_as_a_take_per_group(groups):
    # Per group: (cached blocks queued, in group order, so a group's run of evictions can be long or short; blocks
    # asked; priority of its cached ones). A take evicting a few groups' many blocks counts them per group at C
    # speed, one evicting a block or two of many groups block by block: both must leave every group's cached and
    # evicted counts (and everything else) as takes group by group with a detach per group do.
    a, b = _twin_arenas(48, [(cached, priority) for cached, _, priority in groups])
    counts = [k for _, k, _ in groups]
    if sum(counts) > a.available:
        counts = [min(k, a.available // len(counts)) for k in counts]
    seen_a: list = []
    seen_b: list = []
    record_a = _recorder(seen_a, a)

    def mixed(blocks: list[int], of: list[int]) -> None:
        for block, g in zip(blocks, of, strict=True):
            seen_b.append((b.names[g], [block], [b.node[block]]))
            b.node[block] = None

    got_a = [a.take(g, k, record_a) if k else [] for g, k in enumerate(counts)]
    got_b = b.take_each(range(len(counts)), counts, lambda n, x: None, mixed)
    assert got_a == got_b and _detached(seen_a) == _detached(seen_b) and _pool_state(a) == _pool_state(b)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 10**6), max_size=12), max_size=8))
def test_a_finish_queues_the_groups_blocks_position_by_position(lists):
    # what release_tables queues: each group's blocks (tail first) taken one position at a time, in group order
    expect = [lst[k] for k in range(max(map(len, lists), default=0)) for lst in lists if k < len(lst)]
    assert interleave(lists) == expect


_SHAPES = ("leaves", "shared", "uncached", "any")


def _finishing_arena(spec: list[tuple[str, int, int, int, bool, bool]]) -> tuple[SharedPool, list[list[int]]]:
    """An arena whose groups each hold a table shaped by ``spec``: per group (shape, blocks, cached head, released
    window, a hole in the table, a block held twice); ``shape`` says which runs hold the cached head."""
    pool = SharedPool([f"g{g}" for g in range(len(spec))], 64)
    keep = lambda g, blocks: None  # noqa: E731
    tables = []
    for g, (shape, n, head, window, hole, twice) in enumerate(spec):
        table = pool.take(g, n, keep)
        runs = [_Run(f"leaf{g}"), _Run(f"leaf{g}b"), _Run(f"prefix{g}", {"child": 1})]
        for i, b in enumerate(table[:head]):
            if shape != "uncached":
                pool.node[b] = {"leaves": runs[i % 2], "shared": runs[2]}.get(shape, runs[i % 3])  # type: ignore
        if shape == "any" and n > head + 1:  # a cached block after an uncached one: not the usual finish
            pool.node[table[-1]] = runs[0]  # type: ignore[assignment]
        if twice and table:
            pool.incref(g, table[n // 2])
        window = min(window, n)
        pool.release(g, table[:window], 1, True, keep)  # a sliding window left behind: -1 up to its mark
        table[:window] = [-1] * window
        if hole and n > window + 2:
            pool.release(g, (table[window + 1],), 1, True, keep)
            table[window + 1] = -1
        tables.append(table)
    return pool, tables


#: specs for _finishing_arena: per group (shape, blocks, cached head, released window, a hole, a block held twice)
_FINISHING = st.lists(st.tuples(st.sampled_from(_SHAPES), st.integers(0, 12), st.integers(0, 12), st.integers(0, 4),
                                st.booleans(), st.booleans()), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(_FINISHING)
def test_a_finish_and_a_hit_leave_the_arena_as_block_by_block_calls_would(spec):
    # a finish releases every group's table in one release_tables, and a hit takes the usual case (every block the
    # group's and cached) in bulk, checked at C speed: whatever a table's shape (released windows, holes, blocks held
    # twice, runs with and without children, cached blocks after uncached ones), the arena must end as release /
    # incref block by block leave it (blocks, order of the free list and the eviction queue, counts)
    a, tables_a = _finishing_arena(spec)
    b, tables_b = _finishing_arena(spec)
    assert _pool_state(a) == _pool_state(b)
    _release_group_by_group(a, tables_a, 2)
    b.release_tables(list(enumerate(tables_b)), 2)
    assert _pool_state(a) == _pool_state(b)
    c, tables_c = _finishing_arena(spec)
    c.release_tables(list(enumerate(tables_c)), 2)
    others = [bl for bl in c.evictable.blocks() if c.group_of[bl] != 0]
    if others:  # cached blocks of other groups are refused, as incref refuses them
        with pytest.raises(RuntimeError):
            c.incref_many(0, others)
    for g in range(len(spec)):  # a hit claims each group's cached blocks (and those a running request holds too)
        claimed = sorted(bl for bl in a.evictable.blocks() if a.group_of[bl] == g)
        if spec[g][5]:  # the block held twice is held still: a prefix another request is running on
            claimed += [bl for bl in range(64) if a.group_of[bl] == g and a.ref[bl]]
        for bl in claimed:
            a.incref(g, bl)
        b.incref_many(g, claimed)
        assert _pool_state(a) == _pool_state(b)
    if any(a.used):  # a block not cached or not the group's is refused, as incref refuses it
        g = next(g for g, u in enumerate(a.used) if u)
        held = [bl for bl in range(64) if a.group_of[bl] == g]
        free = a._free[-1:]
        with pytest.raises(RuntimeError):
            b.incref_many(g, held + free)


@settings(max_examples=100, deadline=None)
@given(_FINISHING)
def test_a_finish_that_skips_the_released_window_ends_as_one_that_reads_it(spec):
    # the manager tells release_tables where each table's window-released run of -1 ends (cache.released), so a
    # finish skips it: the arena must end exactly as a finish that reads every entry
    a, tables_a = _finishing_arena(spec)
    b, tables_b = _finishing_arena(spec)
    a.release_tables(list(enumerate(tables_a)), 2)
    b.release_tables(list(enumerate(tables_b)), 2, [min(window, n) for _, n, _, window, _, _ in spec])
    assert _pool_state(a) == _pool_state(b)


def _queue_state(pool: SharedPool) -> tuple:
    """What eviction will do next beyond the order: each page's priority, the queue's size, shared count and clock (a
    stale shared page is demoted by the clock)."""
    q = pool.evictable
    return list(pool.priority), len(q), q.num_shared, q._clock


#: finishes as a keyed turn leaves them (cached leaves, the last block perhaps not cached), with a few that are not
_KEYED_FINISH = st.lists(st.tuples(st.sampled_from(("leaves", "leaves", "leaves", "shared", "any")), st.integers(0, 12),
                                   st.integers(0, 12), st.integers(0, 4), st.booleans(), st.booleans()),
                         min_size=1, max_size=6)


def _usual(table: list[int], lo: int, pool: SharedPool) -> bool:
    """Whether a finishing table is a keyed finish's usual one: 3 or more blocks from ``lo`` (where the finish is told
    its released window ends), every one there and held by this table alone, all cached in runs without children but
    perhaps the last."""
    blocks = table[lo:]
    if len(blocks) < 3 or min(blocks) < 0 or any(pool.ref[b] != 1 for b in blocks):
        return False
    cached = [pool.node[b] is not None for b in blocks]
    return all(cached[:-1]) and not any(pool.node[b].children for b in blocks if pool.node[b] is not None)


@settings(max_examples=150, deadline=None)
@given(_KEYED_FINISH, st.booleans())
def test_a_keyed_finish_let_go_as_it_is_queued_and_its_next_turn_s_claim_leave_every_page_as_page_by_page_calls(
        spec, windows):
    # a keyed turn's finish on a shared arena: each usual table (its blocks held by it alone, cached leaves but
    # perhaps the last) is let go in the loop that queues it, any other table in the release loop; the arena must
    # end as release / incref page by page leave it: every page's counters, owner, group and priority, the free list,
    # the queue's order, size, shared count and clock. Then the next turn claims each group's cached pages (one
    # release queued them: one bucket) in the same pass that takes them out of the queue.
    a, tables_a = _finishing_arena(spec)
    b, tables_b = _finishing_arena(spec)
    released: list[list[int]] = []
    add_released = b.evictable.add_released

    def spy(blocks, priority, ref):
        released.append(list(blocks))
        return add_released(blocks, priority, ref)

    b.evictable.add_released = spy  # type: ignore[method-assign]
    starts = [min(window, n) for _, n, _, window, _, _ in spec] if windows else None
    usual = [_usual(t, starts[g] if starts else 0, b) for g, t in enumerate(tables_b)]
    _release_group_by_group(a, tables_a, 2)
    b.release_tables(list(enumerate(tables_b)), 2, starts)
    assert _pool_state(a) == _pool_state(b) and _queue_state(a) == _queue_state(b)
    # the usual tables went through the queue's loop (their cached pages, position by position with the others')
    assert bool(released) == any(u and any(b.node[x] is not None for x in t if x >= 0)
                                 for u, t in zip(usual, tables_b, strict=True))
    if not released:
        return
    pieces = [[x for x in a.evictable.blocks() if a.group_of[x] == g] for g in range(len(spec))]
    claims: list[int] = []
    claim_many = b.evictable.claim_many

    def claim_spy(blocks, ref):
        claims.append(len(blocks))
        return claim_many(blocks, ref)

    b.evictable.claim_many = claim_spy  # type: ignore[method-assign]
    for g, piece in enumerate(pieces):
        for x in piece:
            a.incref(g, x)
    b.incref_groups(list(range(len(spec))), pieces)
    assert _pool_state(a) == _pool_state(b) and _queue_state(a) == _queue_state(b)
    total = sum(map(len, pieces))
    assert claims == ([total] if total > 1 else [])  # every group's pages in one claim


#: finishes of several groups, most of them usual (so that every table is, often), perhaps a table listed twice
_RARE = st.sampled_from((False, False, False, False, True))
_MANY_TABLES = st.lists(
    st.tuples(st.sampled_from(("leaves", "leaves", "leaves", "leaves", "shared", "any", "uncached")), st.integers(0, 8),
              st.sampled_from((0, 0, 0, 1, 1, 3)), st.integers(0, 4), _RARE, _RARE).map(
        lambda t: (t[0], t[1], max(0, t[1] - t[2]), *t[3:])),  # the cached head: all the table, or all but its tail
    min_size=2, max_size=6)


@settings(max_examples=300, deadline=None)
@given(_MANY_TABLES, st.booleans(), st.sampled_from((None, None, 0, 1, 5)))
def test_a_finish_checked_over_all_its_tables_at_once_ends_as_one_checked_table_by_table(spec, windows, twice):
    # release_tables checks every table's blocks at once where each is a keyed finish's usual table (a multi-turn
    # finish on Gemma 3 27B: 31 of them); whatever the tables (holes, windows, blocks held twice, shared runs, an
    # uncached block before cached ones, a table listed twice: the caller's error), the arena, the queue and the
    # error raised must be what the table-by-table path leaves
    a, tables_a = _finishing_arena(spec)
    b, tables_b = _finishing_arena(spec)
    a._release_lean = lambda *args: False  # type: ignore[method-assign]
    starts = [min(window, n) for _, n, _, window, _, _ in spec] if windows else None
    outcomes = []
    for pool, tables in ((a, tables_a), (b, tables_b)):
        pairs = list(enumerate(tables))
        lo = starts
        if twice is not None:
            k = twice % len(pairs)
            pairs.append(pairs[k])
            lo = None if starts is None else [*starts, starts[k]]
        try:
            pool.release_tables(pairs, 2, lo)
            outcomes.append(None)
        except RuntimeError as e:
            outcomes.append(str(e))
    assert outcomes[0] == outcomes[1]
    assert _pool_state(a) == _pool_state(b) and _queue_state(a) == _queue_state(b)


def test_a_finish_of_usual_tables_is_checked_once_and_queued_as_table_by_table():
    # every table usual (cached leaves; some with an uncached last block): the joint checks take them all, and the
    # arena ends as release group by group leaves it; a block listed in two tables is refused as it was
    spec = [("leaves", 6, 6, 0, False, False), ("leaves", 5, 4, 0, False, False), ("leaves", 7, 6, 2, False, False)]
    a, tables_a = _finishing_arena(spec)
    b, tables_b = _finishing_arena(spec)
    taken = []
    lean = b._release_lean
    b._release_lean = lambda *args: taken.append(lean(*args)) or taken[-1]  # type: ignore[method-assign]
    _release_group_by_group(a, tables_a, 2)
    b.release_tables(list(enumerate(tables_b)), 2, [0, 0, 2])
    assert taken == [True] and _pool_state(a) == _pool_state(b) and _queue_state(a) == _queue_state(b)
    for lists in ([1, 1], [0, 1, 1], [1, 2, 1]):  # a table whose last block is uncached listed twice
        c, tables_c = _finishing_arena(spec)
        d, tables_d = _finishing_arena(spec)
        d._release_lean = lambda *args: False  # type: ignore[method-assign]
        for pool, tables in ((c, tables_c), (d, tables_d)):
            with pytest.raises(RuntimeError, match="released more often than held"):
                pool.release_tables([(g, tables[g]) for g in lists], 2)
        assert _pool_state(c) == _pool_state(d) and _queue_state(c) == _queue_state(d)


def test_the_group_tuple_memo_answers_each_shape_exactly_and_stays_bounded():
    # the tuples the batch checks compare group_of to are memoized: each must be its groups repeated by its lengths,
    # whatever was asked before, and the memo must not grow past its limit (a long table is not kept at all)
    from cache_backends.v2 import shared_pool

    shapes = [([0, 1, 2], [3, 1, 0]), ([2, 1, 0], [3, 1, 0]), ([0, 1], [1, 3, 0][:2]), ([5], [7]),
              ([0, 1], [shared_pool._ALONG_LIMIT, 2])] * 3
    shapes += [([g], [shared_pool._ALONG_LIMIT // 5]) for g in range(8)]
    for groups, lens in shapes:
        expect = tuple(g for g, k in zip(groups, lens, strict=True) for _ in range(k))
        assert shared_pool._groups_along(groups, lens) == expect
        # along the tables interleaved (a finish's queue order): position by position, while each table reaches it
        mixed = tuple(g for p in range(max(lens)) for g, k in zip(groups, lens, strict=True) if p < k)
        assert shared_pool._groups_along(groups, lens, True) == mixed
        assert shared_pool._along_size[0] == sum(map(len, shared_pool._along.values())) <= shared_pool._ALONG_LIMIT


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(-1, 50), max_size=9), min_size=1, max_size=7), st.data())
def test_tables_interleaved_from_their_ends_are_their_reversed_tails_interleaved(tables, data):
    # a finish queues each table's blocks past its window mark, tail first, position by position: read straight from
    # the tables, they must be what reversing each tail, then interleaving, gives (ragged lengths, empty tails)
    from cache_backends.v2 import shared_pool

    lens = [data.draw(st.integers(0, len(t))) for t in tables]
    want = interleave([t[len(t) - k:][::-1] for t, k in zip(tables, lens, strict=True)])
    assert shared_pool._interleave_tails(tables, lens) == want


def test_a_claim_of_a_page_not_queued_sets_every_reference_and_takes_out_the_ones_before_it():
    # claim_many is a loop of reference stores then remove_many, in one pass: on a page that is not queued it raises
    # KeyError as remove_many does, with every reference set and the pages before it out of the queue (a page taken
    # out earlier: its stale key is the bucket's, the one-pass path; a page never queued: the other path)
    for claim in ([1, 2, 3], [1, 7, 3]):
        a, b = SharedPool(["g"], 12), SharedPool(["g"], 12)
        for pool in (a, b):
            pool.evictable.add_many([1, 2, 3, 4], 0)
            pool.evictable.add_many([5], 0, True)
            pool.evictable.remove(2)
        for x in claim:
            a.ref[x] = 1
        with pytest.raises(KeyError):
            a.evictable.remove_many(claim)
        with pytest.raises(KeyError):
            b.evictable.claim_many(claim, b.ref)
        assert b.ref == a.ref and b.evictable.blocks() == a.evictable.blocks() == [3, 4, 5]
        assert (len(b.evictable), b.evictable.num_shared) == (len(a.evictable), a.evictable.num_shared) == (3, 1)
    q = SharedPool(["g"], 12)
    q.evictable.add_many([1, 2, 3], 0)
    q.evictable.claim_many([3, 1, 2], q.ref)
    assert q.ref[1:4] == [1, 1, 1] and not len(q.evictable) and not q.evictable.blocks()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 2)), min_size=1, max_size=6), st.integers(0, 8),
       st.randoms(use_true_random=False))
def test_a_page_for_every_group_is_what_take_each_with_every_count_one_hands_out(groups, free_left, rng):
    # Per group: (cached blocks it queued, their priority); free_left: pages still free. A decode's block boundary
    # takes one page per group (take_one_each): the same pages, in the same groups' order, the same evictions
    # passed to detach_mixed in the same order with the same groups, and every counter as take_each leaves them.
    a, b = _twin_arenas(sum(c for c, _ in groups) + free_left, groups)
    order = list(range(len(groups)))
    rng.shuffle(order)  # the groups in any order (the manager's is the layout's)
    if len(order) > a.available:
        with pytest.raises(IndexError, match="free or evictable"):
            b.take_one_each(order, lambda blocks, of: None)
        return
    seen_a: list = []
    seen_b: list = []

    def mixed(seen: list, pool: SharedPool) -> Callable[[list[int], list[int]], None]:
        def detach(blocks: list[int], of: list[int]) -> None:
            seen.append((list(blocks), list(of), [pool.node[x] for x in blocks]))
            for x in blocks:
                pool.node[x] = None
        return detach

    got_a = a.take_each(order, [1] * len(order), lambda n, x: None, mixed(seen_a, a))
    got_b = b.take_one_each(order, mixed(seen_b, b))
    assert [[x] for x in got_b] == got_a and seen_a == seen_b and _pool_state(a) == _pool_state(b)


def _slide_state(m) -> list:
    """What a step leaves observable on a shared arena: every page's counters, owner (pending prefix of which request,
    or a keyed run by its start and length) and position, the queue's order, each cache's tables, window marks and
    pending prefix."""
    arena = m._arena

    caches = []
    for request, cache in sorted(m._caches.items(), key=lambda item: item[0].req_id):
        pending = cache.pending
        caches.append((request.req_id, {k: list(v) for k, v in cache.tables.items()}, dict(cache.released),
                       cache.committed, cache.slide_at,
                       None if pending is None else (list(pending.held),
                                                     {k: list(v) for k, v in pending.blocks.items()})))
    return [list(arena._free), arena.evictable.blocks(), list(arena.ref), list(arena.gen), list(arena.group_of),
            [arena_owner(arena, b) for b in range(arena.num_blocks)], list(arena.used), list(arena.cached),
            list(arena.evicted), caches, m.stats()]


def _slide_run(requests: list[tuple[str, list[int], int]], fast: bool) -> tuple[list, int, int]:
    """Requests (id, prompt, new tokens) through a Gemma-3-like arena, three at a time, a token per decode step
    (reserved by ``schedule_tokens``, as the scheduler does); the state after every step, and how many slides and
    block boundaries took the one-pass paths (``fast`` false: none, the per-group calls instead)."""
    m = make_manager(gemma_like(window=8), 14)  # 84 pages: finished requests' cached pages are evicted
    arena = m._arena
    one_pass, one_each = m._slide_parked, arena.take_one_each
    took = [0, 0]

    def slide(*args: object) -> bool:
        done = one_pass(*args) if fast else False
        took[0] += done
        return done

    def take(groups: list[int], detach_mixed: Callable[[list[int], list[int]], None]) -> list[int]:
        took[1] += fast
        if fast:
            return one_each(groups, detach_mixed)
        return [piece for (piece,) in arena.take_each(groups, [1] * len(groups), m._detach, detach_mixed)]

    m._slide_parked = slide  # type: ignore[method-assign]
    arena.take_one_each = take  # type: ignore[method-assign]
    queue = [Request(rid, prompt, new) for rid, prompt, new in requests]
    # each request's KV checked as it ends (the loop after the run this replaced saw none: every request had ended)
    states = _decode_all(m, queue, 3, lambda r: check_kv(m, r))
    return states, took[0], took[1]


def _decode_all(m: KVCacheManagerV2, queue: list[Request], at_once: int, ending: Callable[[Request], None]) -> list:
    """Prefill ``at_once`` of ``queue`` at a time and decode each a token per step (reserved by ``schedule_tokens``,
    as the scheduler does) until it has its new tokens, then ``ending(r)`` and free it; the state after every step."""
    running: list[Request] = []
    states = []
    while queue or running:
        while queue and len(running) < at_once:
            r = queue.pop(0)
            prefill(m, r)
            running.append(r)
        for r in list(running):
            if len(r.output_token_ids) >= r.max_new_tokens:
                ending(r)
                m.free(r)
                running.remove(r)
                continue
            _decode_one(m, r)
        m.check_invariants()
        states.append(_slide_state(m))
    return states


def _decode_one(m: KVCacheManagerV2, r: Request) -> None:
    """One decode step of ``r``: a token reserved by ``schedule_tokens`` (as the scheduler does), its KV written and
    committed."""
    r.output_token_ids.append(next_token(r))
    assert m.schedule_tokens(r, 1) == 1
    write_kv(m, r, r.num_computed_tokens, 1)
    m.commit(r, 1)


@pytest.mark.parametrize("requests", [
    # distinct first tokens: every cache lazily keyed, each decode slides one position of the five sliding groups
    [(f"r{i}", [60 * i + 1 + t for t in range(5 + 3 * i)], 12 + 2 * i) for i in range(7)],
    # a shared prompt: later requests hit it, so slides meet pages other tables hold (the per-step path) beside
    # pending ones
    [(f"s{i}", [7, 8, 9, 10, 11, 12, 13, 14] + [100 * i + t for t in range(1, 2 + i)], 8) for i in range(5)]
    + [(f"u{i}", [300 + 40 * i + t for t in range(6)], 10) for i in range(3)],
])
def test_a_decode_slide_and_block_boundary_in_one_pass_leave_the_arena_as_the_per_group_calls_do(requests):
    fast, slides, takes = _slide_run(requests, fast=True)
    slow, none, none_taken = _slide_run(requests, fast=False)
    assert slides and takes and none == none_taken == 0  # the one-pass paths ran, the reference run's never
    assert len(fast) == len(slow)
    for step, (got, want) in enumerate(zip(fast, slow, strict=True)):
        assert got == want, f"step {step}"


def test_a_decode_block_boundary_sets_the_room_every_group_s_table_holds():
    """A decode's block boundary on an arena of one block span (a page for every group, then the room set from one
    table, not a minimum over the spans) leaves ``room`` exactly the token slots every table holds: what
    ``schedule_tokens`` and ``resize`` set it to, so a token past it takes the next pages and one short of it none."""
    m = make_manager(gemma_like(window=8), 14)
    assert len(m._spans) == 1
    r = Request("r", list(range(1, 7)), 14)
    prefill(m, r)
    cache = m.cache(r)
    boundaries = 0
    for _ in range(14):
        held = len(m._arena._free)
        r.output_token_ids.append(next_token(r))
        assert m.schedule_tokens(r, 1) == 1
        boundaries += len(m._arena._free) < held
        assert cache.room == min(len(table) * m.T for table in cache.tables.values())
        assert {len(table) for table in cache.tables.values()} == {cache.room // m.T}
        assert cache.room - m.T < cache.capacity <= cache.room  # the block a token lands in is the last one
        write_kv(m, r, r.num_computed_tokens, 1)
        m.commit(r, 1)
        m.check_invariants()
    assert boundaries >= 3
    check_kv(m, r)


def _finish_run(requests: list[tuple[str, list[int], int, int, int]], fast: bool, window: int, at_once: int,
                scratch_reuse: bool = True) -> tuple[list, int]:
    """Requests (id, prompt, new tokens, priority, draft tokens reserved when it ends: an abort mid-step) through a
    Gemma-3-like arena, ``at_once`` at a time, a token per decode step; the state after every step, and how many
    finishes took the one-pass path (``fast`` false: none, :meth:`_park` and :meth:`_release_blocks` instead)."""
    m = make_manager(gemma_like(window=window), 13 * at_once, enable_swa_scratch_reuse=scratch_reuse)
    one_pass = m._finish_parked
    took = [0]

    def finish(cache: object) -> bool:
        done = one_pass(cache) if fast else False
        took[0] += done
        return done

    m._finish_parked = finish  # type: ignore[method-assign]
    queue = [Request(rid, prompt, new, priority=priority) for rid, prompt, new, priority, _ in requests]
    ahead = {rid: k for rid, _, _, _, k in requests}

    def reserve_ahead(r: Request) -> None:
        if ahead[r.req_id]:  # blocks past the full ones: the tail a finish frees
            r.draft_token_ids = [3] * ahead[r.req_id]
            assert m.schedule_tokens(r, ahead[r.req_id]) == ahead[r.req_id]

    return _decode_all(m, queue, at_once, reserve_ahead), took[0]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 24), st.integers(1, 16), st.booleans(), st.integers(-1, 1),
                          st.integers(0, 9)), min_size=1, max_size=8),
       st.sampled_from([4, 8, 12]), st.integers(1, 3), st.booleans())
def test_a_finish_in_one_pass_leaves_the_arena_as_parking_then_releasing_does(spec, window, at_once, scratch_reuse):
    # prompts of 1-24 tokens (some shorter than a block: nothing to park), a shared opening for some (those hit it,
    # so their caches are keyed, not pending: the per-group path), 1-16 new tokens, mixed priorities (queue buckets);
    # 0-9 draft tokens reserved at the end (blocks past the full ones); pages enough for ``at_once`` requests of 49
    # tokens, so finished requests' cached pages are evicted and reused
    requests = [(f"r{k}", ([7, 8, 9, 10, 11] if shared else []) + [1000 * k + t + 1 for t in range(length)], new,
                 priority, ahead) for k, (length, new, shared, priority, ahead) in enumerate(spec)]
    fast, _ = _finish_run(requests, True, window, at_once, scratch_reuse)
    slow, none = _finish_run(requests, False, window, at_once, scratch_reuse)
    assert none == 0
    assert len(fast) == len(slow)
    for step, (got, want) in enumerate(zip(fast, slow, strict=True)):
        assert got == want, f"step {step}"


def test_the_usual_finishes_of_lazily_keyed_caches_take_the_one_pass_path():
    requests = [(f"r{k}", [1000 * k + t + 1 for t in range(10 + k)], 6 + k, k % 2, 2 * k) for k in range(6)]
    fast, took = _finish_run(requests, True, 8, 2)
    assert took == 6  # every request pending (distinct first tokens), each with full blocks: none fell back
    assert fast == _finish_run(requests, False, 8, 2)[0]


@pytest.mark.parametrize("arena", [True, False], ids=["one-arena", "pools-per-group"])
@pytest.mark.parametrize("keyed", [False, True], ids=["lazily-keyed", "keyed"])
def test_a_finished_window_keeps_what_its_next_turns_hit_reads_ahead_of_younger_window_leavings(keyed, arena):
    """A conversation's turn ends with 15 tokens committed: its next turn's hit is the whole blocks, 12 tokens, and
    the window at 12 reads from token 5, block 1, which the window let go at the last commit (15 reads from 8).
    Another request's window lets go of its block 0 after that, which no hit reads. When the pool then has to evict
    (the turn's block 0 and that one, or z's too) the younger, useless leavings must go and the history's block 1
    stay: else the history's every hit is gone (a shorter one reads block 0, older still)."""
    if arena:  # pages: what the requests below hold, and 2 free when the turn has finished
        pages = 56 if keyed else 50
        m = make_manager(gemma_like(window=8), {name: pages for name in _names()}, enable_partial_reuse=False)
        sliding, c_len = _names()[0], 16 if keyed else 12
    else:  # the window group's pool: what the requests below hold, 1 free when the turn has finished unless keyed
        m = make_manager(split_sliding_layers(window=8), {"full": 40, "sliding_w8": 8}, enable_partial_reuse=False)
        sliding, c_len = "sliding_w8", 12
    if keyed:  # a cached block starting with the turn's first token: the turn is keyed as it goes, not lazily
        z = Request("z", [1, 900, 901, 902], 0)
        prefill(m, z)
        m.free(z)
    a = Request("a", list(range(1, 15)), 4)
    prefill(m, a)  # 14 tokens: the window (from 7) lets go of block 0
    assert (m.cache(a).pending is None) == keyed
    a.output_token_ids.append(next_token(a))
    compute(m, a, 1)  # 15: the window (from 8) lets go of block 1, which a hit at 12 reads
    b = Request("b", list(range(100, 114)), 4)
    prefill(m, b)  # b's window lets go of its block 0: younger than a's block 1, and no hit reads it
    m.free(a)
    history = a.all_token_ids
    c = Request("c", list(range(200, 200 + c_len)), 0)
    prefill(m, c)  # takes the free pages and evicts the oldest cached ones: z's, a's block 0 and b's block 0
    assert m.stats().groups[sliding].free == 0
    turn = Request("a2", [*history, 40, 41, 42, 43], 0)
    admit(m, turn)
    assert turn.num_computed_tokens == 12, "the history's hit lost the window block it reads"
    m.free(b)
    m.free(c)
    compute(m, turn, turn.num_tokens - turn.num_computed_tokens)
    check_kv(m, turn)
    m.check_invariants()


def _turns_run(convs: list[tuple[list[int], list[list[int]], int]], fast: bool, pages: int,
               window: int) -> tuple[list, dict[str, int]]:
    """Conversations (opening, each later turn's new user tokens, new tokens a turn) through a Gemma-3-like arena,
    every conversation's turns one after another (a turn's prompt: its previous turn's tokens and the new ones), a
    token per decode step; the state after every step, and how often each one-pass method of the arena ran (``fast``
    false: the per-group calls main made instead: ``incref`` / ``release`` / ``incref_many`` group by group)."""
    m = make_manager(gemma_like(window=window), pages)
    arena = m._arena
    took = {"incref_each": 0, "decref_each": 0, "drop_each": 0, "incref_groups": 0, "tail": 0}
    one = {name: getattr(arena, name) for name in ("incref_each", "decref_each", "drop_each", "incref_groups")}

    def per_group_incref_each(groups, blocks):
        for g, b in zip(groups, blocks, strict=True):
            arena.incref(g, b)

    def per_group_decref_each(groups, blocks, priorities):
        for g, b, p in zip(groups, blocks, priorities, strict=True):
            arena.release(g, (b,), p, True, m._detach)

    def per_group_drop_each(groups, blocks, detach_mixed):
        for g, b in zip(groups, blocks, strict=True):
            if b >= 0:
                arena.incref(g, b)
                arena.release(g, (b,), 0, False, m._detach)

    def per_group_incref_groups(groups, pieces):
        for g, piece in zip(groups, pieces, strict=True):
            arena.incref_many(g, piece)

    slow = {"incref_each": per_group_incref_each, "decref_each": per_group_decref_each,
            "drop_each": per_group_drop_each, "incref_groups": per_group_incref_groups}
    for name in one:
        def call(*args, name=name):
            took[name] += 1
            return (one if fast else slow)[name](*args)
        setattr(arena, name, call)
    tail_to_keep = m._tail_fn

    def checked_tail(manager, cache):  # the arena's check at C speed answers as the per-group loop does
        got = tail_to_keep(manager, cache)
        assert got == KVCacheManagerV2._tail_to_keep(manager, cache)
        took["tail"] += bool(got)
        return got

    m._tail_fn = checked_tail
    nexts = [[] for _ in convs]  # per conversation: its next turn's prompt, once the previous turn ended
    for c, (opening, _, _) in enumerate(convs):
        nexts[c] = [list(opening)]
    turn = [0] * len(convs)
    running: dict[int, Request] = {}
    states = []
    while any(nexts) or running:
        for c in range(len(convs)):
            if c not in running and nexts[c] and len(running) < 2:
                r = Request(f"c{c}t{turn[c]}", nexts[c].pop(), convs[c][2])
                prefill(m, r)
                running[c] = r
        for c, r in list(running.items()):
            if len(r.output_token_ids) >= r.max_new_tokens:
                m.free(r)
                del running[c]
                more = convs[c][1]
                if turn[c] < len(more):
                    nexts[c].append(r.all_token_ids + more[turn[c]])
                    turn[c] += 1
                continue
            _decode_one(m, r)
        m.check_invariants()
        states.append(_slide_state(m))
    return states, took


@pytest.mark.parametrize("pages", [14, 40], ids=["evicting", "roomy"])
@pytest.mark.parametrize("window", [4, 8])
def test_a_turn_s_claims_and_tails_in_one_pass_over_the_groups_leave_the_arena_as_the_per_group_calls_do(pages,
                                                                                                        window):
    # three conversations, two opening alike (their first turns share a prompt a partial block in: hits on blocks
    # another table holds, partial matches between conversations); later turns hit their history's whole blocks,
    # copy its partial last block (the tail) and leave the tail behind as their run grows
    convs = [([5, 6, 7, 8, 9, 10, 11], [[21, 22], [23, 24, 25, 26, 27], [28]], 3),
             ([5, 6, 7, 8, 9, 12], [[31, 32, 33], [34]], 2),
             ([40 + t for t in range(10)], [[41, 42, 43, 44, 45, 46], [47, 48], [49, 50, 51]], 5)]
    fast, took = _turns_run(convs, True, pages, window)
    slow, _ = _turns_run(convs, False, pages, window)
    assert all(took.values()), took  # each one-pass method ran, and tails were kept
    assert len(fast) == len(slow)
    for step, (got, want) in enumerate(zip(fast, slow, strict=True)):
        assert got == want, f"step {step}"


@pytest.mark.parametrize("one_pass", [False, True])
def test_a_hits_claim_interrupted_on_a_shared_arena_leaves_no_claim_behind(one_pass):
    """A stop signal (KeyboardInterrupt) inside a prefix hit's claim, on a shared arena, after some groups' blocks
    were gathered (the per-group loop) or all of them (the one pass, just before they are claimed): the request is
    freed as ``LLM.generate`` frees it on its way out, and the same manager serves the next hit with every invariant
    holding. The gathered claims were kept on the manager and made again by the next hit (a "block is not one of its
    used or cached blocks" error, then "ref 1 but 0 owners"); a table could also name a block not yet claimed."""
    m = make_manager(gemma_like(window=8), 14)
    if not one_pass:  # the per-group loop (a shared arena of one-block spans takes the one pass)
        m._unit_spans = False
    prompt = list(range(1, 21))
    first = Request("a", prompt, 2)
    prefill(m, first)
    m.free(first)
    owner, attr = (m._arena, "incref_groups") if one_pass else (m._tree, "path_blocks")
    real, calls = getattr(owner, attr), [0]

    def interrupted(*args: object) -> list[int]:
        calls[0] += 1
        # the loop: at the third group's path (with the cuts tied, as they are by default: the second of two)
        if calls[0] == (1 if one_pass else min(3, len(m._names))):
            raise KeyboardInterrupt
        return real(*args)

    setattr(owner, attr, interrupted)
    second = Request("b", [*prompt, 99], 2)
    with pytest.raises(KeyboardInterrupt):
        admit(m, second)
    setattr(owner, attr, real)
    m.free(second)
    m.check_invariants()
    third = Request("c", [*prompt, 98], 2)
    prefill(m, third)
    m.check_invariants()
    assert third.num_reused_tokens >= 16  # the cached prompt's whole blocks still hit
    m.free(third)
    m.check_invariants()


@pytest.mark.parametrize("tables", ["a block twice in one table", "one table given twice"])
def test_a_keyed_finish_releasing_a_block_more_often_than_held_raises_naming_it(tables):
    """The one-pass release checks references at C speed, which a repeated block passes (each copy sees 1): it queued
    the block twice and left ``used`` below 0, to fail later as an IndexError far from the cause. The loop said which
    block was released more often than held, and so does the one pass."""
    pool = SharedPool(["g0"], 16)
    taken = pool.take(0, 4, lambda g, b: None)
    run = _Run("leaf")
    for b in taken:
        pool.node[b] = run
    twice = tables == "a block twice in one table"
    given = [(0, [*taken, taken[1]])] if twice else [(0, list(taken)), (0, list(taken))]
    with pytest.raises(RuntimeError, match=r"^group g0: block \d+ released more often than held$"):
        pool.release_tables(given, 1)


def _hits_on_paths(one_pass: bool) -> tuple[KVCacheManagerV2, list[Request], list[int]]:
    """Hits on a shared arena of one-block spans whose claimed paths are one run from the root or several (a prompt
    split by a shorter one), with sliding windows that start past position 0: claimed in one pass over the groups
    (``one_pass``) or by the per-group loop. Returns the manager, the hits (still running) and the path lengths (in
    runs) each claimed."""
    m = make_manager(gemma_like(window=8), 40)
    if not one_pass:
        m._unit_spans = False
    runs: list[int] = []
    claim = m._claim_arena_path

    def counted(cache, last, tokens):  # type: ignore[no-untyped-def]
        node, k = last, 1
        while node.parent is not None and node.parent.parent is not None:
            node, k = node.parent, k + 1
        runs.append(k)
        claim(cache, last, tokens)

    m._claim_arena_path = counted  # type: ignore[method-assign]
    prompt = list(range(1, 26))  # 6 full blocks and a token
    for rid, tokens in (("a", prompt), ("b", [*prompt[:12], 70, 71, 72, 73, 74])):  # b splits a's run after 3 blocks
        first = Request(rid, tokens, 0)
        prefill(m, first)
        m.free(first)
    hits = [Request("c", [*prompt, 90, 91], 0),  # a's 6 blocks across two runs, windows past position 0
            Request("d", [*prompt[:12], 80], 0),  # 3 blocks of the first run alone
            Request("e", [*prompt[:8], 81, 82], 0)]  # 2 of them (a split), two hits on one run
    for r in hits:
        admit(m, r)
        m.check_invariants()
    return m, hits, runs


def test_a_hits_claim_in_one_pass_over_the_groups_is_the_per_group_loops():
    """A shared arena of one-block spans claims a hit's blocks of every group in one pass (``_claim_arena_path``):
    the same tables (a window's released positions as -1), the same reference counts, eviction queue and tree as
    the per-group loop, on paths of one run and of several."""
    fast, hits, runs = _hits_on_paths(True)
    slow, again, loop_runs = _hits_on_paths(False)
    assert sorted(runs) == [1, 1, 1, 2] and loop_runs == []  # (b hits a too) both path shapes took the one pass
    for r, s in zip(hits, again, strict=True):
        assert r.num_computed_tokens == s.num_computed_tokens > 0
        a, b = fast.cache(r), slow.cache(s)
        assert a.tables == b.tables and a.released == b.released
        assert a.last.start == b.last.start and a.last.users == b.last.users
    assert any(-1 in fast.cache(hits[0]).tables[name] for name in fast._names)  # a window started past 0
    assert fast._arena.ref == slow._arena.ref and fast._arena.used == slow._arena.used
    assert fast._arena.cached == slow._arena.cached
    assert fast._arena.evictable.blocks() == slow._arena.evictable.blocks()
    assert fast._tree.num_nodes == slow._tree.num_nodes


def _grow_own_run(bulk: bool) -> tuple[KVCacheManagerV2, Request]:
    """A second turn hits its history's 2 blocks (their run is its own leaf), then commits 3 more blocks at once
    (a prefill chunk) and a decode's block: keyed through the all-groups path or (``bulk`` False) group by group."""
    m = make_manager(gemma_like(window=64), 24)
    first = Request("t1", list(range(1, 10)), 0)  # 2 full blocks and a token
    prefill(m, first)
    m.free(first)
    turn = Request("t2", list(range(1, 9)) + list(range(20, 33)), 0)  # the 2 blocks, then 13 tokens
    admit(m, turn)
    assert turn.num_computed_tokens == 8 and m.cache(turn).last.users == 1 and not m.cache(turn).last.children
    if not bulk:
        saved, m._one_owner = m._one_owner, None
    compute(m, turn, 13)  # 3 blocks' positions at once, and a token
    turn.output_token_ids.extend([40, 41, 42])
    compute(m, turn, 3)  # a decode fills the 6th block
    if not bulk:
        m._one_owner = saved
    return m, turn


def test_a_run_grown_by_several_blocks_is_keyed_for_all_groups_at_once_as_group_by_group():
    bulk, turn = _grow_own_run(True)
    alone, again = _grow_own_run(False)
    for m in (bulk, alone):
        m.check_invariants()
    run, other = bulk.cache(turn).last, alone.cache(again).last
    assert len(run.held) == len(other.held) and run.start + len(run.held) == 6  # every full block hung in place
    groups = own_groups(bulk)  # the run hangs the manager's own blocks (tied: a logical block, a page of every cut)
    assert run.held == other.held == [len(groups)] * len(run.held)
    assert run.tokens == other.tokens and run.blocks == other.blocks
    assert bulk._tree.num_nodes == alone._tree.num_nodes
    for g, cuts in groups:
        table = bulk.cache(turn).tables[g.name]
        assert table == alone.cache(again).tables[g.name]
        assert [(bulk._arena.node[b] is run, bulk._arena.pos[b]) for b in table[2:6]] \
            == [(True, p) for p in range(2, 6)]
        for cut in cuts:  # the pages attention reads
            assert bulk.block_table(turn, cut) == alone.block_table(again, cut)
    # the next turn finds all six blocks
    m = bulk
    m.free(turn)
    follow = Request("t3", [*turn.all_token_ids, 7, 7], 0)
    admit(m, follow)
    assert follow.num_computed_tokens >= 24


def _turn_after_history(opening: list[int]) -> tuple[KVCacheManagerV2, Request]:
    """A Gemma-3-like arena holding a finished first turn of 18 tokens (4 blocks and a partial block kept for the
    next turn's copy), and a request starting with ``opening`` (not yet admitted)."""
    m = make_manager(gemma_like(window=8), 40, enable_partial_reuse=True)
    history = list(range(1, 19))
    prefill(m, h := Request("t0", history, 0))
    m.free(h)
    return m, Request("t1", opening, 4)


def _counted(m: KVCacheManagerV2, names: tuple[str, ...]) -> dict[str, int]:
    """How often each of the manager's methods ``names`` runs from now on."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(m, name)

        def call(*args, name=name, real=real):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return real(*args)

        setattr(m, name, call)
    return calls


@pytest.mark.parametrize("opening", [[*range(1, 19), 50, 51], [1, 2, 99, 98, 97]],
                         ids=["follow-up turn: 4 blocks and the tail's copy", "a block's first tokens only"])
def test_a_probe_that_builds_a_copying_hit_looks_it_up_once_and_ends_as_probe_then_build(opening):
    """On a shared arena a hit that copies a partial block from the root (a block's first tokens) is not probed: with
    ``build`` the probe builds it in the same call from its own lookup (the match, the split path, the partial
    source), which create + resume after the probe made again. A follow-up turn's copy of its history's tail is
    probed (the cuts tied), and admitted from the probe with that lookup. Either way the same cache, pages, queue and
    tree as probe then create + resume, the lookup made once."""
    a, r = _turn_after_history(opening)
    b, again = _turn_after_history(opening)
    names = ("_match", "_partial_source")
    once, twice = _counted(a, names), _counted(b, names)
    probe = a.probe_hit(r, build=True)
    if len(opening) > 5:  # the history's tail copied: probed, nothing built until admitted
        assert probe is not None and probe.partial is not None and not a.has_cache(r)
        a.admit_hit(probe, r)
    else:
        assert probe is None and a.has_cache(r)
    assert (b.probe_hit(again) is None) == (len(opening) <= 5) and not b.has_cache(again)
    admit(b, again)
    assert once == {"_match": 1, "_partial_source": 1} and twice == {"_match": 2, "_partial_source": 2}
    ours, theirs = a.cache(r), b.cache(again)
    assert ours.partial_hit and theirs.partial_hit
    assert r.num_computed_tokens == again.num_computed_tokens == (18 if len(opening) > 5 else 2)
    assert (ours.tables, ours.released, ours.keyed, ours.key_at, _last_of(ours)) == \
        (theirs.tables, theirs.released, theirs.keyed, theirs.key_at, _last_of(theirs))
    assert _arena_state(a) == _arena_state(b) and a.counters == b.counters
    assert a._tree.num_nodes == b._tree.num_nodes and a._tree.latent == b._tree.latent
    for m, req in ((a, r), (b, again)):
        m.check_invariants()
        check_kv(m, req)  # the copied partial block's pages hold the history's tokens


def _last_of(cache) -> tuple[int, int] | None:  # type: ignore[no-untyped-def]
    return None if cache.last is None else (cache.last.start, len(cache.last.held))


def _arena_state(m: KVCacheManagerV2) -> tuple:
    """:func:`_pool_state` of the manager's arena, each block's owner as its kind, start and length (two managers'
    runs compared)."""
    def run(node: object) -> tuple | None:
        return None if node is None else (type(node).__name__, node.start, len(node.held))  # type: ignore[attr-defined]

    state = _pool_state(m._arena)
    return (*state[:5], [run(node) for node in state[5]], *state[6:], list(m._arena.pos))


@pytest.mark.parametrize("layers", [[LayerKV(0, "full", 4)], [LayerKV(0, "full", 2), LayerKV(1, "full", 4)]],
                         ids=["one group", "a pool per group"])
def test_a_probe_with_build_that_finds_no_block_for_the_copy_still_builds_the_hit(layers):
    """Pools of their own (no arena): a follow-up turn whose history's partial last block would be copied, where no
    block is left for the copy once the claim is out of the queue, is not probed (only building answers). With
    ``build`` that None must come with the cache built, as documented and as the scheduler reads it: the turn's 4
    whole blocks claimed (the copy skipped), the lookup made once. It came back without a cache, the lookup made
    again by the caller's create + resume."""
    def turn_after_history() -> tuple[KVCacheManagerV2, Request]:
        m = make_manager(layers, 5, enable_partial_reuse=True)  # the history's 4 blocks and its tail: every block
        prefill(m, h := Request("t0", list(range(1, 19)), 0))
        m.free(h)
        return m, Request("t1", [*range(1, 19), 50, 51], 4)

    a, r = turn_after_history()
    b, again = turn_after_history()
    assert a._arena is None
    lookups = _counted(a, ("_match", "_partial_source"))
    assert a.probe_hit(r, build=True) is None
    assert a.has_cache(r) and a.cache(r).is_active
    assert lookups == {"_match": 1, "_partial_source": 1}
    assert b.probe_hit(again) is None
    admit(b, again)
    assert r.num_computed_tokens == again.num_computed_tokens == 16 and not a.cache(r).partial_hit
    assert a.cache(r).tables == b.cache(again).tables and a.counters == b.counters
    assert a._tree.num_nodes == b._tree.num_nodes
    a.check_invariants()
    check_kv(a, r)


def test_a_probe_answered_none_leaves_nothing_a_later_build_reuses_after_the_tree_changed():
    """A probe that builds nothing (the copying hit above: with the cuts tied, its copy probed) keeps nothing of its
    lookup: a build after the tree changed looks it up again. Here a sibling turn, finished between the probe and the
    build, caches the turn's fifth block whole where the probe found 4 blocks and the history's tail to copy (2
    tokens): the build claims 5 blocks (as a manager that never probed), not the stale 4 and a copy."""
    opening = [*range(1, 19), 50, 51, 52]
    probed, r = _turn_after_history(opening)
    fresh, again = _turn_after_history(opening)
    probe = probed.probe_hit(r)
    assert not probed.has_cache(r) and (probe is None or (probe.tokens, probe.partial is not None) == (18, True))
    for m in (probed, fresh):
        prefill(m, sibling := Request("t0b", [*range(1, 19), 50, 51, 60, 61, 62], 0))
        m.free(sibling)
        m.check_invariants()
    admit(probed, r)
    admit(fresh, again)
    assert r.num_computed_tokens == again.num_computed_tokens == 20  # the stale lookup: 16 + 2
    assert not probed.cache(r).partial_hit
    assert probed.cache(r).tables == fresh.cache(again).tables
    probed.check_invariants()
    check_kv(probed, r)


@pytest.mark.parametrize("pages", [14, 40], ids=["evicting", "roomy"])
@pytest.mark.parametrize("window", [4, 8])
@pytest.mark.parametrize("unit", [None, 8], ids=["unit T", "unit 2T"])
def test_a_keyed_finish_requeues_its_window_s_last_leavings_a_set_at_once_as_group_by_group(pages, window, unit,
                                                                                           monkeypatch):
    """At a keyed cache's finish on a shared arena, the blocks its window let go that the next turn's hit reads are
    requeued as the youngest (``_refresh_window_head``): looked up once for the window set and read for all its groups
    in one pass, in the per-group loop's order (positions tail first, each position's groups together). Every step's
    arena and queue must be the loop's, and the one pass must have requeued blocks of keyed finishes. (A reuse unit of
    two token blocks, as a group spanning two would make it, has a finish requeue two positions of each group.)"""
    import tests.test_kv_v2_shared as here

    convs = [([5, 6, 7, 8, 9, 10, 11], [[21, 22], [23, 24, 25, 26, 27], [28]], 3),
             ([5, 6, 7, 8, 9, 12], [[31, 32, 33], [34]], 2),
             ([40 + t for t in range(10)], [[41, 42, 43, 44, 45, 46], [47, 48], [49, 50, 51]], 5)]
    made = here.make_manager
    requeued = [0]

    def one_pass(*args, **kwargs):  # type: ignore[no-untyped-def]
        m = made(*args, **kwargs)
        assert m._arena_refresh is not None
        m.reuse_unit = unit or m.reuse_unit
        refresh = m._refresh_window_head

        def counted(cache, pending):  # type: ignore[no-untyped-def]
            before = m._arena.evictable._clock
            refresh(cache, pending)
            requeued[0] += pending is None and m._arena.evictable._clock != before
        m._refresh_window_head = counted  # type: ignore[method-assign]
        return m

    def per_group(*args, **kwargs):  # type: ignore[no-untyped-def]
        m = made(*args, **kwargs)
        m._arena_refresh = None  # the loop over the sliding groups
        m.reuse_unit = unit or m.reuse_unit
        return m

    monkeypatch.setattr(here, "make_manager", one_pass)
    fast, _ = _turns_run(convs, True, pages, window)
    monkeypatch.setattr(here, "make_manager", per_group)
    slow, _ = _turns_run(convs, True, pages, window)
    assert requeued[0] > 0
    assert len(fast) == len(slow)
    for step, (got, want) in enumerate(zip(fast, slow, strict=True)):
        assert got == want, f"step {step}"


# --- padded pages: fewer groups than gcd's cut, the last sliding cut leaving part of its page unused ----------------


#: kv_cache_config.max_page_padding these tests opt into (the default, 0, cuts gcd pages, none padded)
PADDING = 0.10


def padded_layers(window: int = 8) -> list[LayerKV]:
    """Nine sliding layers and two full ones with equal entries: pages of 2 layers (gcd 1 would give 11 groups), the
    last sliding group ``sliding_w{window}.4`` holding layer 9 alone in slot 0 of each of its pages."""
    kinds = ["sliding"] * 4 + ["full"] + ["sliding"] * 5 + ["full"]
    return [LayerKV(i, k, 4, window=window if k == "sliding" else None) for i, k in enumerate(kinds)]


def test_a_padded_groups_layers_view_the_first_slots_of_the_arenas_pages():
    layout = build_layout(padded_layers(), "v2", 4, "float32", PADDING)
    assert [(g.name, len(g.layers), g.padding) for g in layout.groups] == [
        *[(f"sliding_w8.{i}", 2, 0) for i in range(4)], ("sliding_w8.4", 1, 1), ("full", 2, 0)]
    pools = BlockPools(layout, {g.name: 10 for g in layout.groups}, "cpu")
    arena = pools.tensors["full"]
    assert tuple(arena.shape) == (2, 10, 4, 4) and pools.tensors["sliding_w8.4"] is arena  # whole pages
    assert pools.nbytes == 10 * layout.page_bytes == 10 * 2 * 4 * 4 * 4
    for layer in range(11):  # each layer is one slot of whatever page its group holds, never a padded slot
        [(group, pos)] = pools.layer_index[layer]
        assert pos < len(pools.groups[group].layers)
        for block in (0, 7):
            assert pools.layer_slots(group, pos)[block * 4].data_ptr() == arena[pos, block, 0].data_ptr()
    assert pools.layer_index[9] == [("sliding_w8.4", 0)]
    pools.release()


def test_plan_says_what_a_padded_arena_leaves_unused():
    layout = build_layout(padded_layers(), "v2", 4, "float32", PADDING)
    # short sequences: every group holds alike, 1 unused slot of 12; past the window only the full group grows
    assert layout.padding_share() == pytest.approx(1 / 12)
    # 64 tokens: 5 windows of 3 pages + 16 full pages of 2 slots; the padded group's 3 pages leave one slot each
    assert layout.padding_share(64) == pytest.approx(3 / (2 * (5 * 3 + 16)))
    padding = layout.padding_dict(64)
    assert padding == {"page_layers": 2, "unused_slots": {"sliding_w8.4": 1}, "worst_share": pytest.approx(1 / 12),
                       "share_at_max_seq_len": pytest.approx(layout.padding_share(64))}
    text = layout.memory_text({g.name: 100 for g in layout.groups}, 64)
    assert "pages of 2 layers, unused layer slots a page: sliding_w8.4 1 (at most 8.3% of the bytes" in text
    # the per-layer growth (kv-geometry.md) leaves the padding out, as block rounding; the bytes held count it
    assert layout.bytes_per_token == 2 * 4 * 4
    assert layout.bytes_for_sequence(64) == (5 * 3 + 16) * layout.page_bytes
    assert build_layout(padded_layers(), "v2", 4, "float32").padding_dict(64) is None  # the default pads nothing
    unpadded = build_layout(gemma_like(), "v2", 4, "float32", PADDING)
    assert unpadded.padding_dict(64) is None
    assert "unused" not in unpadded.memory_text({g.name: 60 for g in unpadded.groups}, 64)


#: a padded group last (``padded_layers``), and one first: 1 sliding layer beside 20 full ones, pages of 2 layers (11
#: groups, not gcd's 21), the sliding group (the arena's first) half unused
PADDED = {"last": padded_layers(), "first": [LayerKV(0, "sliding", 4, window=8), *(LayerKV(i, "full", 4)
                                                                                  for i in range(1, 21))]}


@pytest.mark.parametrize("suspend", [False, True])
@pytest.mark.parametrize("padded", sorted(PADDED))
def test_a_padded_layout_keeps_every_layers_entries_through_hits_slides_and_suspends(padded, suspend):
    """Requests sharing a prefix on the padded arena (without reuse where one is suspended to the host tier, its freed
    pages overwritten, and resumed), decoding past the window: every live entry of every layer reads back its own
    value (a layer reading another group's page, or another slot of its own page, reads another layer's value or an
    unwritten NaN)."""
    m = make_manager(PADDED[padded], 30, enable_block_reuse=not suspend, max_page_padding=PADDING)
    padded_group = next(g for g in m.groups if g.padding)
    assert padded_group.name == ("sliding_w8" if padded == "first" else "sliding_w8.4")
    arena = m.pools.tensors[padded_group.name]
    arena.fill_(float("nan"))  # every slot unwritten
    prefix = list(range(1, 22))
    reqs = [Request(f"r{i}", prefix + [100 + i] * (3 + i), 0) for i in range(3)]
    for r in reqs:
        prefill(m, r)
        check_kv(m, r)
    assert (reqs[2].num_cached_tokens >= 16) != suspend  # a hit on the shared prefix's blocks
    for _ in range(6):  # decodes past the window: sliding blocks go, a boundary takes new pages
        for r in reqs:
            r.output_token_ids.append(next_token(r))
            compute(m, r, 1)
    if suspend:  # the host tier's slots are whole pages too
        pages = sorted({b for g in m.groups for b in held(m.block_table(reqs[0], g.name))})
        assert m.suspend(reqs[0])
        arena[:, pages] = float("nan")
        assert m.resume(reqs[0])
    for r in reqs:
        check_kv(m, r)
    assert any(held(m.block_table(r, padded_group.name)) for r in reqs)
    m.check_invariants()


def _cached_rows(m: KVCacheManagerV2) -> dict[tuple[int, int], set[str]]:
    """Every cached radix position of a shared arena -> the sliding cuts holding a page there (with the cuts tied, a
    cached logical block's cuts whose page it holds: a tie evicts and caches whole rows by construction)."""
    arena = m._arena
    assert arena is not None
    rows: dict[tuple[int, int], set[str]] = {}
    for b in range(len(arena.group_of)):
        g, node = arena.group_of[b], arena.node[b]
        if node is not None and g >= 0 and arena.names[g].startswith("sliding"):
            cuts = cuts_of(m, arena.names[g])
            pages = arena.pages[b] if tied(m) else (b,)  # type: ignore[union-attr]
            rows.setdefault((id(node), arena.pos[b]), set()).update(c for c, p in zip(cuts, pages, strict=True)
                                                                     if p >= 0)
    return rows


def test_cut_families_tie_the_cuts_of_one_group_and_nothing_else():
    layout = build_layout(gemma_like(), "v2", 4, "float32")
    assert [g.name for g in layout.groups] == [*(f"sliding_w8.{i}" for i in range(5)), "full"]
    assert cut_families(layout.groups) == [0, 0, 0, 0, 0, 5]
    mixed = [LayerKV(i, "sliding", 4, window=8) for i in range(4)] + [LayerKV(4 + i, "full", 4) for i in range(6)]
    layout = build_layout(mixed, "v2", 4, "float32")  # 4 sliding + 6 full layers: pages of 2 layers
    assert [g.name for g in layout.groups] == ["sliding_w8.0", "sliding_w8.1", "full.0", "full.1", "full.2"]
    assert cut_families(layout.groups) == [0, 0, 2, 2, 2]


def test_an_eviction_takes_every_cut_s_page_of_a_position_so_no_useless_part_of_a_prefix_stays_cached():
    """The five sliding cuts of tiny-gemma3's window group hold a position together and a hit needs all five; a take
    of six pages (a block for each group) used to evict five pages of one position and one of the next, leaving that
    position's other four cached where no hit could use them. Now the rest of a position goes with it, to the free
    list, and every cached position is whole."""
    m = make_manager(gemma_like(window=8), {name: 24 for name in _names()})
    a = Request("a", list(range(1, 17)), 0)  # 16 tokens: 4 full + 5 x 4 sliding pages, all keyed, all cached
    prefill(m, a)
    m.free(a)
    assert {len(cuts) for cuts in _cached_rows(m).values()} == {5}
    b = Request("b", list(range(500, 516)), 0)  # another prefix: every take evicts
    admit(m, b)
    for _ in range(4):
        compute(m, b, 4)
        rows = _cached_rows(m)
        assert all(len(cuts) == 5 for cuts in rows.values()), {k[1]: sorted(v) for k, v in rows.items()}
        m.check_invariants()
    check_kv(m, b)
    m.free(b)
    c = Request("c", [*range(500, 516), 7], 0)  # b's prefix: every page of it still cached, whole
    admit(m, c)
    assert c.num_computed_tokens == 16
    check_kv(m, c)
    m.check_invariants()


def test_a_suspended_request_s_pages_evicted_as_whole_rows_are_written_back_and_read_back_after_resume():
    """The rest of a row an eviction frees goes through the same detach as the evicted pages: a suspended request's
    cached pages (kept on the device, a host slot reserved) are written back before another group's data lands on
    them, so every layer's KV reads back right after the resume."""
    m = make_manager(gemma_like(window=8), {name: 24 for name in _names()}, host_cache_size=1 << 20)
    a = Request("a", list(range(1, 17)), 0)
    prefill(m, a)
    assert m.suspend(a)
    b = Request("b", list(range(500, 516)), 0)  # another prefix: takes a's pages, rows split by six-page takes
    admit(m, b)
    for _ in range(4):
        compute(m, b, 4)
        assert all(len(cuts) == 5 for cuts in _cached_rows(m).values())
        m.check_invariants()
    check_kv(m, b)
    m.free(b)
    assert m.resume(a)
    check_kv(m, a)
    m.check_invariants()


def test_a_window_slide_of_two_positions_is_queued_row_by_row_so_a_take_evicts_only_the_row_it_needs():
    """A prefill that moves the window past two positions at once lets go of both positions' pages of the five
    sliding cuts. Queued cut by cut ((0, cut 0), (1, cut 0), (0, cut 1), ...), a take of five pages touched both rows
    and, as rows leave whole, freed both (ten pages for five); queued position by position, it evicts position 0's row
    alone and position 1's stays cached, whole."""
    m = make_manager(gemma_like(window=8), {name: 25 for name in _names()})
    a = Request("a", list(range(1, 17)), 0)  # 16 tokens: the window (8) leaves positions 0 and 1 at once
    prefill(m, a)
    assert sorted(p for _, p in _cached_rows(m)) == [0, 1]
    assert m.stats().groups["full"].free == 1  # (the arena's free pages)
    b = Request("b", list(range(500, 504)), 0)  # a block for each of the six groups: one page free, five evicted
    admit(m, b)
    compute(m, b, 4)
    assert {name: g.evictions for name, g in m.stats().groups.items()} == {**dict.fromkeys(_names()[:5], 1), "full": 0}
    rows = _cached_rows(m)
    assert [p for _, p in rows] == [1] and all(len(cuts) == 5 for cuts in rows.values())
    check_kv(m, a)
    check_kv(m, b)
    m.check_invariants()


def test_a_held_source_row_goes_back_to_the_queue_as_one_segment_per_row():
    """A partial hit holds the source's block of every group at one position and lets go of them after its copy
    (``SharedPool.decref_each``). A cut family's blocks there are one row: queued in one call, at one clock, so a stale
    demotion moves the row whole (a tie of the cuts queues it as one entry); the uncut group's block is a row alone."""
    arena = SharedPool(["s.0", "s.1", "s.2", "full"], 12, [0, 0, 0, 3])
    keep = lambda n, x: None  # noqa: E731
    older = arena.take(3, 1, keep)  # a shared block queued before: the one-call path for all-leaves is not taken
    arena.node[older[0]] = _Run("older", {"child": 1})  # type: ignore[assignment]
    arena.release(3, older, 0, True, keep)
    src = [piece[0] for piece in arena.take_each(range(4), [1, 1, 1, 1], keep)]
    run = _Run("src", {"child": 1})
    for b in src:
        arena.node[b], arena.pos[b] = run, 0  # type: ignore[call-overload]
    arena.decref_each(range(4), src, [0, 0, 0, 0])
    (_, got), = arena.evictable.buckets()
    clocks = dict(got)
    assert clocks[src[0]] == clocks[src[1]] == clocks[src[2]] != clocks[src[3]]
    assert arena.evictable._clock == 5  # (the clock still counts every block)
