"""The eviction queue of a tie of an arena's cuts (``cache_backends.v2.tied_pool.RowQueue``): one entry
per row of a family's cuts, weighing its pages, must evict the rows a page queue evicts when a take's rows leave whole
(``SharedPool._row_rest``), and count the pages it counts, so a tie keeps the page arena's decisions."""

from __future__ import annotations

import copy
import gc
import sys
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeline
from cache_backends import LayerKV, build_layout
from cache_backends.layout import tied_groups
from cache_backends.v2.group_pool import EvictionQueue
from cache_backends.v2.shared_pool import SharedPool
from cache_backends.v2.tied_pool import RowQueue, TiedArena

#: rows 0..11: even rows of a family of 3 cuts (a sliding group cut in three), odd rows of 1 (an uncut full group)
ROWS = 12
K = [3 if r % 2 == 0 else 1 for r in range(ROWS)]
FIRST = [sum(K[:r]) for r in range(ROWS)]  # row r's pages: FIRST[r] .. FIRST[r] + K[r] - 1
PAGES = sum(K)
ROW_OF = [r for r in range(ROWS) for _ in range(K[r])]


def _pages(rows: list[int]) -> list[int]:
    return [FIRST[r] + i for r in rows for i in range(K[r])]


def _pair() -> tuple[EvictionQueue, RowQueue]:
    pages = EvictionQueue([0] * PAGES)
    rows = RowQueue([0] * ROWS, list(K), PAGES, max(K))  # (the heaviest row: pop_pages pops entries at once)
    pages._stale = rows._stale = PAGES // 2  # (stale demotions within a short run: both at the same threshold)
    return pages, rows


def _as_rows(buckets: list[tuple[int, list[tuple[int, int]]]]) -> list[tuple[int, list[int]]]:
    """A page queue's buckets as rows: each run of one row's pages one entry."""
    out = []
    for key, got in buckets:
        rows: list[int] = []
        for b, _ in got:
            if not rows or rows[-1] != ROW_OF[b]:
                rows.append(ROW_OF[b])
        out.append((key, rows))
    return out


def _same(pages: EvictionQueue, rows: RowQueue) -> None:
    assert len(pages) == len(rows)
    assert pages.num_shared == rows.num_shared
    assert pages._clock == rows._clock
    assert _as_rows(pages.buckets()) == [(key, [b for b, _ in got]) for key, got in rows.buckets()]


_op = st.tuples(st.sampled_from(["queue", "hit", "claim", "weigh", "pop", "requeue", "refresh", "peek"]),
                st.lists(st.integers(0, ROWS - 1), max_size=5, unique=True), st.integers(0, 2), st.booleans(),
                st.integers(1, PAGES))


@settings(max_examples=300, deadline=None)
@given(st.lists(_op, max_size=40))
def test_a_row_queue_evicts_the_rows_a_page_queue_evicts_and_counts_its_pages(ops):
    pages, rows = _pair()
    queued: set[int] = set()
    for what, picked, priority, shared, n in ops:
        if what == "queue":
            fresh = [r for r in picked if r not in queued]
            pages.add_many(_pages(fresh), priority, shared)
            rows.add_many(fresh, priority, shared)
            queued.update(fresh)
        elif what in ("hit", "claim"):
            taken = [r for r in picked if r in queued]
            if what == "hit":
                pages.remove_many(_pages(taken))
                rows.remove_many(taken)
            else:
                ref_p, ref_r = [0] * PAGES, [0] * ROWS
                pages.claim_many(_pages(taken), ref_p)
                rows.claim_many(taken, ref_r)
                assert [ROW_OF[b] for b in range(PAGES) if ref_p[b]] == _pages_rows(ref_r)
            queued.difference_update(taken)
        elif what == "weigh":  # one logical group's rows out, each of its weight (a hit's claim, a refused copy)
            w = 3 if shared else 1
            taken = [r for r in picked if r in queued and K[r] == w]
            pages.remove_many(_pages(taken))
            rows.remove_weighing(taken, w)
            queued.difference_update(taken)
        elif what == "pop":
            if not len(pages):
                continue
            n = min(n, len(pages))
            popped = pages.pop_many(n)
            touched = list(dict.fromkeys(ROW_OF[b] for b in popped))
            rest = [b for b in _pages(touched) if b not in popped]
            pages.remove_many(rest)  # the rest of every row the pop touched leaves with it
            assert rows.pop_pages(n) == touched
            queued.difference_update(touched)
        elif what == "peek":
            # a probe's look at what a copy's take would evict once its claim's rows are out of the queue
            # (KVCacheManagerV2.probe_hit): the rows that taking them out, then popping, pops; the queue untouched
            skip = set(picked)
            before = (rows.buckets(), len(rows), rows.num_shared, rows._clock)
            seen = rows.peek_pages(n, skip)
            assert (rows.buckets(), len(rows), rows.num_shared, rows._clock) == before
            trial = copy.deepcopy(rows)
            trial.remove_many([r for r in picked if r in queued])
            assert seen == (trial.pop_pages(min(n, len(trial))) if len(trial) else [])
            continue
        elif what == "refresh":  # a finish requeues its window's last rows: each row one segment at one clock
            mine = [r for r in picked if r in queued]
            pages.refresh(_pages(mine), [K[r] for r in mine])
            rows.refresh(mine)
        else:
            mine = [r for r in picked if r in queued]
            leaves, held = mine[: len(mine) // 2], mine[len(mine) // 2:]
            pages.requeue(_pages(leaves), _pages(held), priority)
            rows.requeue(leaves, held, priority)
        _same(pages, rows)


@pytest.mark.parametrize("claim", [False, True])
@pytest.mark.parametrize("taken, error, out", [([0, 3, 2], KeyError, [0]), ([2, 0, 0], KeyError, [2, 0]),
                                               ([0, 4], None, [0, 4]), ([-1, 0], KeyError, []),
                                               ([2, ROWS + 5, 0], IndexError, [2])])
def test_a_row_queue_s_hit_that_stops_at_an_error_counts_the_pages_of_the_rows_it_took_out(taken, error, out, claim):
    # A hit's take (remove_many, claim_many) stops at the first row not queued (a repeat, an id outside the queue): the
    # rows before it are out and the length and shared count lose their pages, as the page queue's take of their pages
    # does; a take without error loses every row's pages (counted from the tags read before it, in C passes)
    pages, rows = _pair()
    for queue, ids, priority, shared in ((pages, _pages([0, 1]), 0, False), (rows, [0, 1], 0, False),
                                         (pages, _pages([2, 4]), 1, True), (rows, [2, 4], 1, True)):
        queue.add_many(ids, priority, shared)
    sides = [(rows, taken, ROWS)]
    if error is not IndexError:  # (an id past the queue has no pages to take on the page queue's side)
        sides.append((pages, [p for r in taken for p in (_pages([r]) if r >= 0 else [-1])], PAGES))
    for queue, ids, n in sides:
        if error is None:
            (queue.claim_many(ids, [0] * n) if claim else queue.remove_many(ids))
        else:
            with pytest.raises(error):
                (queue.claim_many(ids, [0] * n) if claim else queue.remove_many(ids))
    if error is not IndexError:
        _same(pages, rows)
    assert len(rows) == 10 - sum(K[r] for r in out) and rows.num_shared == 6 - sum(K[r] for r in out if r in (2, 4))


@pytest.mark.parametrize("taken, error", [([0, 4], None), ([4, 2, 0], None), ([2, 6, 0], KeyError), ([2, 2], KeyError)])
def test_a_row_queue_takes_out_one_group_s_rows_by_their_weight_as_the_page_queue_does(taken, error):
    # remove_weighing (a hit's claim of one logical group, a refused copy): the rows of one weight out, the length and
    # the shared count losing their pages from the queue's own counts of rows (no pass over their weights), up to the
    # first row not queued where the take stops
    pages, rows = _pair()
    for queue, ids, priority, shared in ((pages, _pages([0, 1]), 0, False), (rows, [0, 1], 0, False),
                                         (pages, _pages([2, 4]), 1, True), (rows, [2, 4], 1, True)):
        queue.add_many(ids, priority, shared)
    for take in (lambda: pages.remove_many(_pages(taken)), lambda: rows.remove_weighing(taken, 3)):
        if error is None:
            take()
        else:
            with pytest.raises(error):
                take()
    _same(pages, rows)


@pytest.mark.parametrize("between", [[], [5], [5, 7]])
def test_a_row_queue_requeues_a_refused_history_again_as_the_page_queue_does(between):
    # a head refused step after step requeues the same history (leaves, a shared prefix): from the second time each
    # list is the whole of one segment, moved to its bucket's young end (counted in pages), with rows queued between
    # the refusals or not; the stale threshold is low, so a requeue's queueing demotes too
    pages, rows = _pair()
    for queue, ids in ((pages, _pages), (rows, list)):
        queue.add_many(ids([3, 1]), 0)
        queue.add_many(ids([0, 2, 9]), 0, True)
        queue.add_many(ids([6, 4, 8]), 1, True)
    _same(pages, rows)
    for step in range(4):
        for queue, ids in ((pages, _pages), (rows, list)):
            queue.requeue(ids([1, 0]), ids([4, 6]), 1)
            if between:  # queued after one refusal, taken out (a hit) after the next
                queue.add_many(ids(between), 1) if step % 2 == 0 else queue.remove_many(ids(between))
        _same(pages, rows)


@pytest.mark.parametrize("n", range(1, 13))
def test_a_row_queue_pops_as_many_rows_at_once_as_it_pops_one_at_a_time(n):
    # pop_pages pops at once the rows that go whatever they weigh (knowing the heaviest): the same rows, length and
    # shared pages as one at a time, also where one pop takes leaves and a shared prefix's rows of other weights
    _, rows = _pair()
    rows.add_many([1, 3], 0)  # a page each
    rows.add_many([0, 2], 0, True)  # three each, shared
    one = copy.deepcopy(rows)
    one._heaviest = None  # (not known: a row at a time)
    assert rows.pop_pages(min(n, len(rows))) == one.pop_pages(min(n, len(one)))
    assert (len(rows), rows.num_shared, rows.buckets()) == (len(one), one.num_shared, one.buckets())


def _pages_rows(ref: list[int]) -> list[int]:
    return [r for r in range(ROWS) if ref[r] for _ in range(K[r])]


def test_a_row_queue_pops_whole_rows_and_says_when_the_pages_are_not_there():
    _, rows = _pair()
    rows.add_many([0, 1, 2], 0)  # 3 + 1 + 3 pages
    assert len(rows) == 7
    assert rows.pop_pages(1) == [0]  # one page asked: the first row, all three of its pages
    assert len(rows) == 4
    assert rows.pop_pages(2) == [1, 2]
    with pytest.raises(IndexError):
        rows.pop_pages(1)
    with pytest.raises(TypeError):
        rows.pop_many(1)


def test_a_row_queue_s_released_rows_count_their_pages_once_when_listed_twice_or_queued_already():
    """A release that lists a row twice, or one queued already (the caller's error ``EvictionQueue.add_released``
    survives), queues each row once and counts its pages once, as the page queue counts its pages."""
    pages, rows = _pair()
    assert rows.add_released([0, 1, 0], 0, [1] * ROWS) == pages.add_released(_pages([0, 1, 0]), 0, [1] * PAGES) - 2
    assert len(rows) == len(pages) == 4
    rows.add_released([2, 1], 0, [1] * ROWS)  # row 1 is queued already: only row 2's 3 pages are new
    pages.add_released(_pages([2, 1]), 0, [1] * PAGES)
    assert len(rows) == len(pages) == 7
    assert rows.pop_pages(7) == [0, 1, 2]


def test_a_row_queue_s_refresh_moves_its_clock_by_the_row_s_pages_as_the_page_queue_s_does():
    pages, rows = _pair()
    pages.add_many(_pages([0, 1, 2]), 0, True)
    rows.add_many([0, 1, 2], 0, True)
    pages.refresh(_pages([2, 0]), [3, 3])
    rows.refresh([2, 0])
    _same(pages, rows)
    assert len({seg[4] for bucket in pages._by_key.values() for seg in bucket if seg[0]}) == 3  # a clock a row


def _opcodes(fn: Callable[[], object]) -> int:
    """The Python opcodes ``fn()`` runs (every frame it enters): a deterministic measure of its work."""
    count = [0]

    def local(frame, event, arg):
        if event == "opcode":
            count[0] += 1
        return local

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        return local

    # no collection inside: one would count the opcodes of Python gc callbacks too (hypothesis installs one once a
    # @given test ran in the process: +38 opcodes, 2 calls of it, failed the equality below now and then)
    collecting = gc.isenabled()
    gc.disable()
    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(old)
        if collecting:
            gc.enable()
    return count[0]


def test_a_row_queue_s_calls_cost_no_more_with_many_shared_rows_queued_and_none_stale():
    """A release or claim while shared prefixes' rows wait in the queue (a multi-turn workload's finished histories)
    costs what it costs with a few: the stale demotion looks only at each shared bucket's oldest entries, as the page
    queue's does. (It walked every shared entry twice a call: ~200 us with 1,000 rows queued; BENCHMARKS.md "rev58".)"""

    def cost(shared_rows: int) -> int:
        n = 4 * shared_rows
        queue = RowQueue([0] * n, [3] * n, n)
        for b in range(shared_rows):
            queue.add_many([b], 0, True)
        b = shared_rows
        return _opcodes(lambda: (queue.add_many([b], 0), queue.remove_many([b]), queue.add_many([b], 1, True)))

    assert cost(400) == cost(10)


def test_an_opcode_count_leaves_out_what_a_collection_inside_it_runs():
    """The opcode counts above compare the work of two calls exactly: a collection landing in one of them ran the
    Python gc callback hypothesis installs (once a @given test ran in the process) under the trace, 38 opcodes more,
    and the comparison failed now and then with the whole file run."""

    def cost() -> int:  # a queue of shared rows, a row queued and taken out again
        queue = RowQueue([0] * 40, [3] * 40, 40)
        queue.add_many(list(range(10)), 0, True)
        return _opcodes(lambda: (queue.add_many([20], 0), queue.remove_many([20])))

    quiet = cost()
    calls: list[str] = []
    threshold = gc.get_threshold()
    gc.callbacks.append(lambda phase, info: calls.append(phase))
    gc.set_threshold(1)  # a collection at (nearly) every allocation: some land inside the counted call
    try:
        assert cost() == quiet
    finally:
        gc.callbacks.pop()
        gc.set_threshold(*threshold)


class _Run:
    """A radix run as the arenas read it: its blocks per group from position ``start``, children if shared."""

    def __init__(self, name: str, shared: bool) -> None:
        self.name, self.start, self.blocks = name, 0, {}
        self.children = {"child": 1} if shared else {}


def _tie_twins(pages: int) -> tuple[SharedPool, TiedArena]:
    """A page arena of a 3-cut family (``a.0`` .. ``a.2``) and an uncut group ``b``, and its tie (``a`` k=3, ``b``)."""
    return (SharedPool(["a.0", "a.1", "a.2", "b"], pages, [0, 0, 0, 3]), TiedArena(["a", "b"], [3, 1], pages))


def _detacher(pool: SharedPool | TiedArena) -> Callable[[str, list[int]], None]:
    def detach(name: str, blocks: list[int]) -> None:  # as the manager's: the run forgets the evicted blocks
        for b in blocks:
            run = pool.node[b]
            run.blocks[name][pool.pos[b]] = -1  # type: ignore[union-attr]
            pool.node[b] = None
    return detach


def _mixed(pool: SharedPool | TiedArena) -> Callable[[list[int], list[int]], None]:
    """A ``detach_mixed`` callback: each evicted block detached as its group's."""
    detach = _detacher(pool)
    return lambda blocks, groups: [detach(pool.names[g], [b]) for b, g in zip(blocks, groups, strict=True)]


def _rows_of(pool: SharedPool | TiedArena, fam: Callable[[int], str]) -> list[tuple[int, list[tuple[str, int, str]]]]:
    """The queue's buckets as rows (run, position, family), each row once where its pages lie together."""
    out = []
    for key, got in pool.evictable.buckets():
        rows: list[tuple[str, int, str]] = []
        for b, _ in got:
            row = (pool.node[b].name, pool.pos[b], fam(pool.group_of[b]))  # type: ignore[union-attr]
            if not rows or rows[-1] != row:
                rows.append(row)
        out.append((key, rows))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_a_tied_arena_takes_evicts_and_counts_as_the_page_arena_of_its_cuts(seed):
    """Requests take rows of both families, slide a window of the cut family, are keyed (shared or not), finish, and
    come back as hits while the arena is full: after every step the tie and the page arena hold the same rows in the
    same queue order and count the same free and evictable pages, shared pages, clock, and per family the same used,
    cached and evicted blocks."""
    import random

    rng = random.Random(seed)
    page, tied = _tie_twins(30)
    fam_page = lambda g: "a" if g < 3 else "b"  # noqa: E731
    fam_tied = lambda g: "ab"[g]  # noqa: E731
    # name -> (page tables, tied tables, their runs once keyed: a window slide keys the request's rows first)
    active: dict[str, tuple[list[list[int]], list[list[int]], _Run | None, _Run | None]] = {}
    done: dict[str, tuple[_Run, _Run]] = {}  # finished, keyed: its runs

    def key(name: str, tables_p: list[list[int]], tables_t: list[list[int]]) -> tuple[_Run, _Run]:
        shared = rng.random() < 0.3
        run_p, run_t = _Run(name, shared), _Run(name, shared)
        for pool, run, tables, names in ((page, run_p, tables_p, page.names), (tied, run_t, tables_t, tied.names)):
            for g, table in enumerate(tables):
                run.blocks[names[g]] = list(table)
                for i, b in enumerate(table):
                    if b >= 0:
                        pool.node[b], pool.pos[b] = run, i
        return run_p, run_t

    for step in range(60):
        what = rng.random()
        if what < 0.4 and len(active) < 4:
            n_a, n_b = rng.randint(1, 3), rng.randint(0, 3)
            if 3 * n_a + n_b > page.available:
                continue
            name = f"r{seed}.{step}"
            if n_a == n_b == 1:  # a decode's block boundary: a block for every group, detached in one call
                mixed_p, mixed_t = _mixed(page), _mixed(tied)
                got_p = [[b] for b in page.take_one_each(range(4), mixed_p)]
                got_t = [[b] for b in tied.take_one_each(range(2), mixed_t)]
            elif rng.random() < 0.5:
                got_p = page.take_each(range(4), [n_a] * 3 + [n_b], _detacher(page))
                got_t = tied.take_each(range(2), [n_a, n_b], _detacher(tied))
            else:  # the evicted blocks detached in one call with their groups
                got_p = page.take_each(range(4), [n_a] * 3 + [n_b], _detacher(page), _mixed(page))
                got_t = tied.take_each(range(2), [n_a, n_b], _detacher(tied), _mixed(tied))
            active[name] = (got_p, got_t, None, None)
        elif what < 0.48 and done:  # a partial hit: a finished run's first row held, copied to a new request, let go
            name = rng.choice(sorted(done))
            run_p, run_t = done[name]
            srcs_p = [run_p.blocks[n][0] if run_p.blocks[n] else -1 for n in page.names]
            srcs_t = [run_t.blocks[n][0] if run_t.blocks[n] else -1 for n in tied.names]
            assert (min(srcs_p) >= 0) == (min(srcs_t) >= 0)
            if min(srcs_p) < 0 or len(active) >= 4:
                continue
            page.incref_each(range(4), srcs_p)
            tied.incref_each(range(2), srcs_t)
            assert page.available == tied.available
            if page.available >= 4:  # the manager's room check: a page a cut (Σ k of the tie's groups)
                got_p = [[b] for b in page.take_one_each(range(4), _mixed(page))]
                got_t = [[b] for b in tied.take_one_each(range(2), _mixed(tied))]
                active[f"p{seed}.{step}"] = (got_p, got_t, None, None)
            page.decref_each(range(4), srcs_p, [page.priority[b] for b in srcs_p])
            tied.decref_each(range(2), srcs_t, [tied.priority[b] for b in srcs_t])
        elif what < 0.52 and done:  # a finished turn's stale tail row goes free (held blocks stay)
            name = rng.choice(sorted(done))
            run_p, run_t = done[name]
            j = len(run_t.blocks["a"]) - 1
            page.drop_each(range(4), [run_p.blocks[n][j] if j < len(run_p.blocks[n]) else -1 for n in page.names],
                           _mixed(page))
            tied.drop_each(range(2), [run_t.blocks[n][j] if j < len(run_t.blocks[n]) else -1 for n in tied.names],
                           _mixed(tied))
        elif what < 0.62 and active:  # family a's window slides past its first live positions (keyed now)
            name = rng.choice(sorted(active))
            got_p, got_t, run_p, run_t = active[name]
            if run_p is None:
                run_p, run_t = key(name, got_p, got_t)
                active[name] = (got_p, got_t, run_p, run_t)
            lo = next((j for j, b in enumerate(got_t[0]) if b >= 0), len(got_t[0]))
            hi = min(len(got_t[0]), lo + rng.randint(1, 2))
            priority = rng.randint(0, 1)
            page.release_slices(list(enumerate(got_p[:3])), lo, hi, priority)
            tied.release_slices([(0, got_t[0])], lo, hi, priority)
        elif what < 0.8 and active:
            name = rng.choice(sorted(active))
            got_p, got_t, run_p, run_t = active.pop(name)
            if run_p is None:
                run_p, run_t = key(name, got_p, got_t)
            priority = rng.randint(0, 1)
            page.release_tables(list(enumerate(got_p)), priority)
            tied.release_tables(list(enumerate(got_t)), priority)
            done[name] = (run_p, run_t)  # type: ignore[assignment]
        elif done:
            name = rng.choice(sorted(done))
            run_p, run_t = done[name]
            whole_p = all(b >= 0 for table in run_p.blocks.values() for b in table)
            whole_t = all(b >= 0 for table in run_t.blocks.values() for b in table)
            assert whole_p == whole_t
            if not whole_p:
                continue
            del done[name]  # a hit claims the whole history back
            got_p = [list(run_p.blocks[n]) for n in page.names]
            got_t = [list(run_t.blocks[n]) for n in tied.names]
            if rng.random() < 0.5:
                for g, table in enumerate(got_p):
                    page.incref_many(g, table)
                for g, table in enumerate(got_t):
                    tied.incref_many(g, table)
            else:  # every group's claim in one call
                page.incref_groups(range(4), got_p)
                tied.incref_groups(range(2), got_t)
            for pool, tables in ((page, got_p), (tied, got_t)):
                for table in tables:
                    for b in table:
                        pool.node[b] = None
            active[name] = (got_p, got_t, None, None)
        assert page.available == tied.available
        assert page.evictable.num_shared == tied.evictable.num_shared
        assert page.evictable._clock == tied.evictable._clock
        for g in range(4):
            f = 0 if g < 3 else 1
            assert (page.used[g], page.cached[g], page.evicted[g]) == (tied.used[f], tied.cached[f], tied.evicted[f])
        assert _rows_of(page, fam_page) == _rows_of(tied, fam_tied)
        assert tied.check() == []


def test_a_tied_arena_s_check_finds_a_page_in_two_blocks_and_a_block_short_of_pages():
    tied = TiedArena(["a", "b"], [3, 1], 12)
    (a1, a2), (b1,) = tied.take_each(range(2), [2, 1], lambda n, x: None)
    assert tied.check() == []
    tied.pages[a2] = (tied.pages[a2][0], tied.pages[a2][1], tied.pages[a1][0])  # a page of a1 in a2 as well
    assert any("owned by blocks" in p for p in tied.check())
    tied.pages[b1] = ()  # b1 lost its page
    assert any(f"block {b1} of b owns pages []" in p for p in tied.check())


def test_a_tied_arena_s_release_queues_or_frees_whole_logical_blocks_and_reset_empties_it():
    tied = TiedArena(["a", "b"], [3, 1], 12)
    (a1, a2), (b1,) = tied.take_each(range(2), [2, 1], lambda n, x: None)
    run = _Run("r", False)
    tied.node[a1] = run
    seen: list = []
    tied.release(0, [a1, a2], 0, True, lambda n, x: seen.append((n, list(x))))
    assert len(tied.evictable) == 3 and tied.available == 12 - 1  # a1's 3 pages queued, a2's free, b1 held
    tied.release(1, [b1], 0, False, lambda n, x: seen.append((n, list(x))))
    assert seen == [] and tied.available == 12
    tied.reset()
    assert len(tied.evictable) == 0 and tied.available == 12 and tied.node[a1] is None and tied.check() == []


def test_a_tied_release_that_meets_a_block_released_too_often_leaves_the_blocks_before_it_queued_or_freed():
    """A release that raises on a block released more often than held (a bookkeeping bug upstream) still queues or
    frees the blocks let go before it, as ``SharedPool.release`` does: no page is left neither free nor queued."""
    tied = TiedArena(["a", "b"], [3, 1], 12)
    (a1, a2), _ = tied.take_each(range(2), [2, 1], lambda n, x: None)
    tied.node[a1] = _Run("r", False)
    with pytest.raises(RuntimeError, match="released more often than held"):
        tied.release(0, [a1, a2, a1], 0, True, lambda n, x: None)
    assert tied.check() == [] and len(tied.evictable) == 3 and tied.available == 12 - 1
    assert tied.used == [0, 1] and tied.cached == [1, 0]


def test_a_refreshed_row_of_a_page_queue_is_demoted_whole_when_it_goes_stale():
    """A finish refreshes a shared row of three pages; once stale it is demoted. Refreshed page by page (a clock a
    page), the demotion took the row's first page and left the other two (the row in two buckets, where a tie's queue
    holds it as one entry); refreshed as a row, it moves whole, as the tie's."""
    pages, rows = _pair()
    pages._stale = rows._stale = 4
    pages.add_many(_pages([0]), 0, True)
    rows.add_many([0], 0, True)
    pages.refresh(_pages([0]), [3])
    rows.refresh([0])
    for r in (1, 3):  # a page at a time: the stale limit passes the row's clock one page at a time
        pages.add_many(_pages([r]), 0)
        rows.add_many([r], 0)
        _same(pages, rows)
    assert rows.num_shared == pages.num_shared == 0  # demoted: the row whole among the leaves


def test_a_tied_group_s_view_counts_logical_blocks_of_k_pages_and_has_no_page_free_list():
    """A logical group's view (what the manager's per-group code reads) counts blocks of its ``k`` pages: the arena's
    12 pages are 4 blocks of the 3-cut family and 12 of the uncut group; it has no ``_free`` list, so an inlined
    ``len(pool._free) + len(pool.evictable)`` (blocks of one page) fails loudly instead of counting pages as blocks."""
    tied = TiedArena(["a", "b"], [3, 1], 12)
    a, b = tied.shares
    assert (a.available, a.num_free, a.num_blocks, b.available, b.num_blocks) == (4, 4, 4, 12, 12)
    (a1,) = a.allocate_many(1, lambda n, x: None)
    b1 = b.allocate(lambda n, x: None)
    assert (a.available, b.available, a.num_used, b.num_used) == (2, 8, 1, 1)  # 8 pages left: 2 blocks of a
    assert (tied.num_used, tied.num_blocks) == (4, 12)  # as a pool set: pages (a's block holds 3)
    assert a.holds(a1) and not b.holds(a1) and b.holds(b1)
    tied.node[a1] = _Run("r", False)
    a.decref(a1, 0, True, lambda n, x: None)
    assert (a.num_evictable, a.num_used, a.available, len(a.evictable)) == (1, 0, 3, 3)  # queued: its 3 pages
    assert not hasattr(a, "_free")
    assert len(a.free_ids()) == 12 - 2 and tied.check() == []


def test_tied_groups_show_one_group_per_family_of_cuts_with_every_cut_s_layers():
    """tiny-gemma3's shape (5 sliding layers cut into five 1-layer groups, 1 full) and one of 4 sliding + 6 full
    layers (pages of 2: 2 sliding cuts, 3 full cuts): the tie shows a group per family, named as before the cut,
    holding its cuts' layers and page bytes, with the cuts' indexes in the layout's order."""
    layers = [LayerKV(i, "sliding", 4, window=8) for i in range(5)] + [LayerKV(5, "full", 4)]
    cut = build_layout(layers, "v2", 4, "float32").groups
    logical, cuts = tied_groups(cut)
    assert [(g.name, g.layers) for g in logical] == [("sliding_w8", (0, 1, 2, 3, 4)), ("full", (5,))]
    assert cuts == [(0, 1, 2, 3, 4), (5,)]
    assert logical[0].bytes_per_block == 5 * cut[0].bytes_per_block and logical[1] == cut[5]
    assert (logical[0].window, logical[0].tokens_per_block) == (8, 4)
    mixed = [LayerKV(i, "sliding", 4, window=8) for i in range(4)] + [LayerKV(4 + i, "full", 4) for i in range(6)]
    cut = build_layout(mixed, "v2", 4, "float32").groups
    logical, cuts = tied_groups(cut)
    assert [(g.name, g.layers, g.window) for g in logical] == [("sliding_w8", (0, 1, 2, 3), 8),
                                                               ("full", (4, 5, 6, 7, 8, 9), None)]
    assert cuts == [(0, 1), (2, 3, 4)]
    plan = pipeline.plan("tests/data/configs/gemma-3-27b-it", log=False, device="cpu",
                         kv_cache_config={"use_kv_cache_manager_v2": True})
    logical, cuts = tied_groups(plan.kv.layout.groups)  # 31 cuts of 2 layers: the manager would see 2 groups
    assert [(g.name, len(g.layers), len(c)) for g, c in zip(logical, cuts, strict=True)] == [
        ("sliding_w1024", 52, 26), ("full", 10, 5)]


def test_a_tied_block_table_reads_as_one_page_table_per_cut_with_released_positions_kept():
    """The tables attention reads: cut ``i``'s table is page ``i`` of every logical block, ``-1`` where the window
    released a position; no page in two cuts' tables."""
    tied = TiedArena(["a", "b"], [3, 1], 12)
    (a1, a2, a3), (b1,) = tied.take_each(range(2), [3, 1], lambda n, x: None)
    table = [a1, a2, a3]
    tied.release_slices([(0, table)], 0, 1, 0)  # a window slide: position 0 let go, -1 in the logical table
    cuts = tied.cut_tables(0, table)
    assert cuts == [[-1, tied.pages[a2][i], tied.pages[a3][i]] for i in range(3)]
    assert len({p for t in cuts for p in t if p >= 0}) == 6
    assert tied.cut_tables(1, [b1]) == [[tied.pages[b1][0]]] and tied.cut_tables(0, []) == [[], [], []]


def test_cut_tables_follow_the_logical_table_in_place_and_notice_a_reused_id():
    """Read step after step, the cut tables stay the same list objects and always equal a fresh expansion: a decode
    appends a block, a slide sets -1, a finish empties the table, and a logical id handed out again at the same
    position (other pages: its ``gen`` moved) is re-read, not taken for the old block."""
    from cache_backends.v2.tied_pool import CutTables

    tied = TiedArena(["a", "b"], [3, 1], 12)
    reader = CutTables(tied, 0)
    table = tied.take_each((0,), (2,), lambda n, x: None)[0]
    first = reader.read(table)
    lists = list(first)
    assert first == tied.cut_tables(0, table)
    table += tied.take_each((0,), (1,), lambda n, x: None)[0]  # a decode's new block
    assert reader.read(table) == tied.cut_tables(0, table)
    assert all(a is b for a, b in zip(reader.tables, lists, strict=True))
    tied.release_slices([(0, table)], 0, 1, 0)  # a window slide
    assert reader.read(table) == tied.cut_tables(0, table) and reader.read(table)[0][0] == -1
    tied.release_tables([(0, table)], 0)  # finished: every block free (none cached)
    table.clear()
    assert reader.read(table) == [[], [], []]
    again = tied.take_each((0,), (1,), lambda n, x: None)[0]  # ids come back; which pages they own is another matter
    table += [-1, *again]
    assert reader.read(table) == tied.cut_tables(0, table)
    tied.pages[table[1]] = tuple(reversed(tied.pages[table[1]]))  # (what a stale read would miss: pages moved)
    tied.gen[table[1]] += 1
    assert reader.read(table) == tied.cut_tables(0, table)
    assert all(a is b for a, b in zip(reader.tables, lists, strict=True))


#: what a tie may change in a simulation's V2 result: the measured times (evictions are counted per cut, as the
#: page arena counts them: ``stats()`` speaks the cuts)
_NOT_DECISIONS = {"kv_seconds", "wall_seconds", "step_time_us_mean", "step_time_us_median",
                  "step_time_us_p99"}


@pytest.mark.parametrize(("workload", "share"), [("multi-turn", 0.25), ("mixed", 0.25), ("shared-prefix", 0.5)])
def test_the_tie_decides_as_the_cuts_do(monkeypatch, workload, share):
    """tiny-gemma3 (five 1-layer sliding cuts and a full group) with the cuts tied (``TIE_CUTS``: the
    manager sees 2 groups) admits, hits, evicts and schedules exactly as the page arena of the 6 cuts, on a tight
    budget (no host tier: the twin test below covers it); only the times differ (evictions too are counted per cut)."""
    from engine.simulator import simulate

    def run(tie: str, budget: int | None) -> dict:
        monkeypatch.setattr("cache_backends.v2.manager.TIE_CUTS", tie == "1")
        config = {"use_kv_cache_manager_v2": True, "host_cache_size": 0}
        if budget is not None:
            config["max_gpu_total_bytes"] = budget
        return simulate("tiny-gemma3", workload, requests=48, kv_cache_config=config, log=False,
                        progress=False).to_dict()

    budget = int(run("0", None)["budget_bytes"] * share)
    cuts, tied = (run(tie, budget)["results"]["KVCacheManagerV2"] for tie in ("0", "1"))
    assert tied["evictions"] > 0  # pressure: rows were evicted
    assert {k: v for k, v in cuts.items() if k not in _NOT_DECISIONS} == \
        {k: v for k, v in tied.items() if k not in _NOT_DECISIONS}


def _twin_managers(monkeypatch) -> tuple:
    """The same three-group shared arena (``full``, ``sliding_w8.0``, ``sliding_w8.1``: one family of two cuts)
    managed by the page arena of the cuts and by their tie, 2-token blocks, a tight arena of 18 pages."""
    from tests.kv_v2_support import full_sliding_layers, make_manager

    out = []
    for tie in ("0", "1"):
        monkeypatch.setattr("cache_backends.v2.manager.TIE_CUTS", tie == "1")
        out.append(make_manager(full_sliding_layers(window=4), 6, T=2, host_cache_size=0))
    return tuple(out)


def test_the_tied_manager_s_public_groups_stats_and_tables_speak_the_cuts_as_the_page_arena_s_do(monkeypatch):
    """With the cuts tied, a user still sees the cuts: ``groups``, ``stats().groups`` (per cut: the arena's pages,
    each cut's used, cached and evicted blocks), ``available_blocks``, ``growth_bound``, ``growth_blocks`` and
    ``shortfall`` by cut name answer as the page arena's, and ``block_table(request, cut)`` is the cut's page table
    (the one ``block_tables`` hands the executor), its KV reading back after a window slide, a hit and evictions."""
    from cache_backends.request import Request
    from tests.kv_v2_support import check_kv, prefill

    cuts, tied = _twin_managers(monkeypatch)
    assert tied._tied_cuts == [["full"], ["sliding_w4.0", "sliding_w4.1"]]  # the tie is on (2 logical groups)
    assert [g.name for g in tied.groups] == [g.name for g in cuts.groups] == ["full", "sliding_w4.0", "sliding_w4.1"]
    done = []
    for i, prompt in enumerate([list(range(1, 8)), [*range(1, 8), 9, 9], [5] * 7, list(range(1, 6))]):
        for m in (cuts, tied):
            r = Request(f"r{i}", prompt, max_new_tokens=4)
            prefill(m, r)
            check_kv(m, r)  # through block_table per cut: the tie's pages hold each cut's KV
            m.check_invariants()
            names = [g.name for g in m.groups]
            assert m.block_tables(r) == [m.block_table(r, name) for name in names]
            assert m.growth_blocks(r, 1.0).keys() == set(names)
            done.append((m, r))
        (_, a), (_, b) = done[-2:]
        assert cuts.growth_blocks(a, 1.0) == tied.growth_blocks(b, 1.0)
        assert cuts.stats().groups == tied.stats().groups
        assert cuts.available_blocks() == tied.available_blocks()
        assert cuts.growth_bound() == tied.growth_bound()
        for n in range(6):  # a family's cuts need the same blocks (per_group asks so): the same answer
            for need in ({"full": n}, {"sliding_w4.0": n, "sliding_w4.1": n}, {"full": n, "sliding_w4.0": n,
                                                                                 "sliding_w4.1": n}):
                assert (cuts.shortfall(need) is None) == (tied.shortfall(need) is None), need
            # one cut alone: a tie can only take its whole row, so it answers for the row
            assert tied.shortfall({"sliding_w4.1": n}) == tied.shortfall({"sliding_w4.0": n, "sliding_w4.1": n})
        for m, r in done[-2:]:
            m.free(r)
    assert tied.stats().evictions == cuts.stats().evictions > 0  # the tight arena evicted, counted per cut alike
    with pytest.raises(ValueError, match="no layer group 'sliding_w4'"):
        prefill(tied, r := Request("x", [1, 2], max_new_tokens=1))
        tied.block_table(r, "sliding_w4")  # the logical name is the manager's own


def test_a_row_queue_demotes_stale_shared_rows_at_the_threshold_set_when_it_is_built(monkeypatch):
    """``STALE_POOLS`` is read when a queue is built, as ``EvictionQueue`` reads it, so a setting (the shared-prefix
    tests' monkeypatch) reaches the tie's queue too: a module-level import of it would freeze the default."""
    from cache_backends.v2 import group_pool

    monkeypatch.setattr(group_pool, "STALE_POOLS", 3)
    assert RowQueue([0] * 4, [1] * 4, 10)._stale == 30 == EvictionQueue([0] * 10)._stale


def test_a_tied_suspend_writes_every_cut_s_page_back_when_evicted_and_a_resume_reads_them_back(monkeypatch):
    """The host tier with the cuts tied: a suspended request's uncached pages are copied at once and its cached ones
    when an eviction takes them (write-back, every cut's page); after other requests evicted its rows, a resume
    reads every cut's KV back, with the page arena's slots, copies, stats and evictions."""
    from cache_backends.request import Request
    from tests.kv_v2_support import check_kv, full_sliding_layers, make_manager, prefill

    twins = []
    for tie in ("0", "1"):
        monkeypatch.setattr("cache_backends.v2.manager.TIE_CUTS", tie == "1")
        twins.append(make_manager(full_sliding_layers(window=4), 8, T=2, host_cache_size=10**6))
    cuts, tied = twins
    assert tied._tied_cuts is not None
    for m in (cuts, tied):
        a = Request("a", list(range(1, 10)), max_new_tokens=4)
        prefill(m, a)
        assert m.suspend(a)
        m.check_invariants()
        assert sum(map(len, m.cache(a).reclaim.values())) > 0  # cached pages left on the device, marked
        for i in range(4):  # others fill the arena: a's cached pages are evicted, so written back first
            o = Request(f"o{i}", [50 + 10 * i + t for t in range(9)], max_new_tokens=4)
            prefill(m, o)
            m.check_invariants()
            m.free(o)
        assert sum(map(len, m.cache(a).reclaim.values())) == 0  # every one evicted: written back
        assert m.resume(a)
        check_kv(m, a)  # every cut's entries, through block_table per cut
        m.check_invariants()
    (a_cuts, a_tied) = (m.cache(next(r for r in m._caches)) for m in (cuts, tied))
    assert a_cuts.committed == a_tied.committed == 9
    assert cuts.stats().groups == tied.stats().groups and cuts.stats().evictions == tied.stats().evictions > 0
    assert cuts.host.bytes_stored == tied.host.bytes_stored > 0 and cuts.host.bytes_loaded == tied.host.bytes_loaded


@pytest.mark.parametrize("events", [False, True])
def test_a_tied_manager_let_go_of_frees_its_pools_at_once(events):
    """A tied manager (KV events on or off) holds no reference cycle: dropping the last reference frees its pool
    tensors at once, not at the garbage collector's next pass (on a GPU, that memory would stay taken meanwhile)."""
    import gc
    import weakref

    from cache_backends.kv_events import KvEventBuffer
    from tests.kv_v2_support import full_sliding_layers, make_manager

    gc.collect()
    gc.disable()
    try:
        m = make_manager(full_sliding_layers(window=4), 6, T=2, host_cache_size=0)
        assert m._tied_cuts is not None  # the cuts are tied
        if events:
            m.enable_kv_events(KvEventBuffer(1 << 10))
        tensors = [weakref.ref(t) for t in m.pools.tensors.values()]
        manager = weakref.ref(m)
        del m
        assert manager() is None
        assert all(t() is None for t in tensors)
    finally:
        gc.enable()


def _take_each_block_by_block(arena: TiedArena, groups, counts, detach, detach_mixed=None) -> list[list[int]]:
    """``TiedArena.take_each`` as it was before it cut a group's ids and pages off in one slice: a pop per block."""
    from operator import mul

    if len(groups) != len(counts):
        raise ValueError(f"{len(counts)} counts for {len(groups)} groups")
    arena._make_room(sum(map(mul, map(arena.k.__getitem__, groups), counts)), detach, detach_mixed)
    out: list[list[int]] = []
    free_pages, free_ids = arena._free, arena._free_ids
    for g, c in zip(groups, counts, strict=True):
        k = arena.k[g]
        piece = []
        for _ in range(c):
            b = free_ids.pop()
            got = tuple(free_pages[len(free_pages) - k:][::-1])
            del free_pages[len(free_pages) - k:]
            arena.pages[b] = got
            arena.weight[b] = k
            arena.gen[b] += 1
            arena.ref[b] = 1
            arena.group_of[b] = g
            piece.append(b)
        arena.used[g] += c
        out.append(piece)
    return out


_take = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 4)), min_size=1, max_size=4)  # (group, count) pairs
_tied_op = st.one_of(st.tuples(st.just("take"), _take, st.booleans()),
                     st.tuples(st.just("release"), st.integers(0, 7), st.booleans(), st.integers(0, 1)))


@settings(max_examples=300, deadline=None)
@given(st.lists(_tied_op, max_size=30))
def test_a_tied_take_hands_out_the_ids_and_pages_that_a_pop_per_block_did(ops):
    """``take_each`` cuts a group's ids and pages off the free lists in one slice each (a prompt's take is hundreds of
    blocks): the same ids in the same order, each with the same pages in the same order, as a pop per block handed
    out, counts of 0 and groups of different pages included, and right after the take evicted cached blocks (whose
    ids and pages went back to the free lists' ends) — the page tables attention reads depend on it."""
    k, num_pages = [3, 1, 2], 24
    sliced, popped = TiedArena(["a", "b", "c"], k, num_pages), TiedArena(["a", "b", "c"], k, num_pages)
    held: list[list[tuple[int, list[int]]]] = []  # per request: its (group, blocks), the same in both arenas
    logs: tuple[list, list] = ([], [])

    def detacher(arena: TiedArena, log: list) -> Callable[[str, list[int]], None]:
        def detach(name: str, blocks: list[int]) -> None:
            log.append((name, list(blocks)))
            for b in blocks:
                arena.node[b] = None
        return detach

    def one_call(arena: TiedArena, detach: Callable) -> Callable[[list[int], list[int]], None]:
        def detach_mixed(blocks: list[int], groups: list[int]) -> None:  # the evicted blocks with their groups
            for b, g in zip(blocks, groups, strict=True):
                detach(arena.names[g], [b])
        return detach_mixed

    for op in ops:
        if op[0] == "take":
            _, pairs, mixed = op
            groups, counts = [g for g, _ in pairs], [c for _, c in pairs]
            if sum(k[g] * c for g, c in pairs) > sliced.available:  # refused before anything is evicted
                for arena, log in ((sliced, logs[0]), (popped, logs[1])):
                    with pytest.raises(IndexError):
                        arena.take_each(groups, counts, detacher(arena, log))
                continue
            got = []
            for arena, log, take in ((sliced, logs[0], TiedArena.take_each),
                                     (popped, logs[1], _take_each_block_by_block)):
                detach = detacher(arena, log)
                got.append(take(arena, groups, counts, detach, one_call(arena, detach) if mixed else None))
            assert got[0] == got[1]
            assert [len(p) for p in got[0]] == counts
            held.append(list(zip(groups, got[0], strict=True)))
        elif held:
            _, i, keep, priority = op
            tables = held.pop(i % len(held))
            for arena in (sliced, popped):
                for _, table in tables:
                    for b in table:
                        arena.node[b] = _Run("r", False) if keep else None  # cached (queued) or freed on release
                arena.release_tables(tables, priority)
        assert sliced._free == popped._free and sliced._free_ids == popped._free_ids
        assert (sliced.pages, sliced.gen, sliced.ref, sliced.weight, sliced.group_of) == \
            (popped.pages, popped.gen, popped.ref, popped.weight, popped.group_of)
        assert (sliced.used, sliced.cached, sliced.evicted) == (popped.used, popped.cached, popped.evicted)
        assert logs[0] == logs[1]
        assert sliced.check() == []


def _queue_view(q: RowQueue) -> tuple:
    """What a row queue decides from: its buckets with each entry's clock, its clock, length and shared pages, and
    the queued entries' priorities."""
    return q.buckets(), q._clock, len(q), q.num_shared, [q._prio[b] for b in q.blocks()]


@pytest.mark.parametrize("seed", range(60))
def test_a_row_queue_moves_runs_queued_whole_as_taking_them_out_and_queueing_each_again(seed):
    """``RowQueue.requeue_runs`` (a refused tied copy's history and source, every step a turn waits:
    ``PrefixLookup._refuse_copy_moved``) must leave the queue as taking every run's entries out and then queueing
    each run again in order with ``add_many`` (its priority, shared or not) does: the same buckets, clocks, pages,
    shared pages and priorities, stale shared entries demoted between as there; and where a run is not one whole
    segment of its bucket, answer False and change nothing (the caller then takes the slow path)."""
    import random

    rng = random.Random(seed)
    q = RowQueue([0] * ROWS, list(K), PAGES, max(K))
    q._stale = rng.choice([PAGES // 2, PAGES, 4 * PAGES])  # (stale demotions within a short run, or none)
    rows = list(range(ROWS))
    rng.shuffle(rows)
    segments: list[tuple[list[int], int, bool]] = []
    while rows:  # the queue: segments of one call each, at a few priorities, some shared
        n = rng.randint(1, 3)
        seg, rows = rows[:n], rows[n:]
        priority, shared = rng.randint(0, 2), rng.random() < .4
        q.add_many(seg, priority, shared)
        segments.append((seg, priority, shared))
    for _ in range(rng.randint(0, 3)):  # the clock moved on (a demotion may have made a shared segment a leaf one)
        q.refresh([])
        q.add_many([], 0)
    picked = rng.sample(segments, rng.randint(1, min(3, len(segments))))
    runs = [(list(blocks), p, s) for blocks, p, s in picked]
    if rng.random() < .3:  # a run that is not a whole segment: part of one, or two blocks of two segments
        blocks, p, s = runs[0]
        other = next((seg[0] for seg, _, _ in segments if seg != blocks), None)
        runs[0] = (blocks[:-1] if len(blocks) > 1 or other is None else [blocks[0], other], p, s)
    whole = all(q._whole_segment(blocks, (s << 64) + p + (1 << 63)) for blocks, p, s in runs)
    twin = copy.deepcopy(q)
    before = _queue_view(q)
    moved = q.requeue_runs(runs)
    assert moved == whole
    if not moved:
        assert _queue_view(q) == before
        return
    twin.remove_many([b for blocks, _, _ in runs for b in blocks])
    for blocks, p, s in runs:
        twin.add_many(blocks, p, s)
    assert _queue_view(q) == _queue_view(twin)
    # and it goes on as the twin: pops take the same entries in the same order
    assert q.pop_pages(len(q)) == twin.pop_pages(len(twin))


def test_a_row_queue_s_stale_look_ahead_counts_a_requeued_shared_entry_once():
    """``RowQueue.stale_pages`` (a probed tied copy's estimate of the shared pages its source's queueing demotes:
    ``PrefixLookup.probe_hit``) must answer what queueing that many pages then demotes, also after a refusal moved a
    shared segment that was not its bucket's youngest (``requeue``: the old segment, dead, hands its tag on to the
    moved one; its entries must not be counted a second time)."""
    weight = [1] * 8
    q = RowQueue([0] * 8, weight, 4, 1)
    q._stale = 100
    q.add_many([0, 1], 0, True)
    q.add_many([2, 3], 0, True)
    q.add_many([4], 0, True)
    q.requeue([], [2, 3], 0)  # a refused hit on [2, 3]: moved to the young end, past [4]
    assert q.num_shared == 5
    for n in range(1, 120):  # the pages the next queue call queues
        twin = copy.deepcopy(q)
        twin._weight[7] = n
        twin.add_many([7], 0)
        assert q.stale_pages(n, set()) == 5 - twin.num_shared, n
