"""BlockTableStore: tensor rows kept across steps equal the managers' lists, and a decode step writes little."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_backends.block_tables import BlockTableStore

WIDTH = 12


def padded(lists: list[list[int]]) -> torch.Tensor:
    return torch.tensor([t + [-1] * (WIDTH - len(t)) for t in lists], dtype=torch.long)


# one step of a request's table: append blocks, release the first k (a window), or move to new blocks (resume)
change = st.one_of(
    st.tuples(st.just("append"), st.integers(0, 2)),
    st.tuples(st.just("release"), st.integers(1, 3)),
    st.tuples(st.just("move"), st.integers(0, 4)),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(change, min_size=1, max_size=10), min_size=1, max_size=4))
def test_store_rows_equal_the_lists_after_any_history(histories):
    store = BlockTableStore(["g"], WIDTH, rows=1)  # starts too small: rows must grow
    tables: list[list[int]] = [[] for _ in histories]
    counter = iter(range(10_000))
    for step in range(max(len(h) for h in histories)):
        for i, history in enumerate(histories):
            if step >= len(history):
                continue
            kind, n = history[step]
            t = tables[i]
            if kind == "append":
                t.extend(next(counter) for _ in range(min(n, WIDTH - len(t))))
            elif kind == "release":
                t[:min(n, len(t))] = [-1] * min(n, len(t))
            else:
                tables[i] = [next(counter) for _ in range(min(n, WIDTH))]
            store.update(f"r{i}", "g", tables[i])
        rows = [store.row(f"r{i}") for i in range(len(histories))]
        got = store.tables(rows)["g"]  # as wide as the longest list these rows held, at least 1
        assert got.shape[1] >= max(1, *(len(t) for t in tables))
        assert torch.equal(got, padded(tables)[:, : got.shape[1]])


def test_a_decode_step_writes_only_the_new_block():
    store = BlockTableStore(["full", "sliding"], WIDTH)
    store.update("a", "full", [3, 4, 5])
    store.update("a", "sliding", [7, 8, 9])
    before = store.writes
    store.update("a", "full", [3, 4, 5])  # a decode step inside the last block: nothing changes
    store.update("a", "sliding", [-1, 8, 9, 10])  # a new block, and the window released the first
    assert store.writes - before == 2
    assert store.tables([store.row("a")])["sliding"][0].tolist() == [-1, 8, 9, 10]


def test_dropped_rows_are_reused_clean():
    store = BlockTableStore(["g"], WIDTH, rows=2)
    store.update("a", "g", [1, 2, 3])
    row = store.row("a")
    store.drop("a")
    store.update("b", "g", [9])
    assert store.row("b") == row
    store.update("c", "g", [5, 6, 7])  # a step as wide as a's table was
    assert store.tables([row, store.row("c")])["g"][0].tolist() == [9, -1, -1]  # nothing of "a" is left
    assert len(store) == 2


def test_a_table_wider_than_the_store_is_refused():
    store = BlockTableStore(["g"], 2)
    with pytest.raises(ValueError, match=r"request a: block table of group 'g' has 3 blocks; the store holds 2"):
        store.update("a", "g", [1, 2, 3])
