"""The eviction queue of a tie of an arena's cuts (``cache_backends.v2.tied_pool.RowQueue``, a prototype): one entry
per row of a family's cuts, weighing its pages, must evict the rows a page queue evicts when a take's rows leave whole
(``SharedPool._row_rest``), and count the pages it counts, so a tie keeps the page arena's decisions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_backends.v2.group_pool import EvictionQueue
from cache_backends.v2.tied_pool import RowQueue

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
    rows = RowQueue([0] * ROWS, list(K), PAGES)
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


_op = st.tuples(st.sampled_from(["queue", "hit", "claim", "pop", "requeue"]),
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
        else:
            mine = [r for r in picked if r in queued]
            leaves, held = mine[: len(mine) // 2], mine[len(mine) // 2:]
            pages.requeue(_pages(leaves), _pages(held), priority)
            rows.requeue(leaves, held, priority)
        _same(pages, rows)


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


def test_a_row_queue_s_refresh_moves_its_clock_by_the_row_s_pages_as_the_page_queue_s_does():
    pages, rows = _pair()
    pages.add_many(_pages([0, 1, 2]), 0, True)
    rows.add_many([0, 1, 2], 0, True)
    pages.refresh(_pages([2, 0]))
    rows.refresh([2, 0])
    _same(pages, rows)
