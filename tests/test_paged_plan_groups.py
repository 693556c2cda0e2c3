"""A step's plan for the groups a shared arena cuts from one life cycle: each group's slots are its own table's.

The plan computes every cut group's write and gather slots in one operation over their stacked
tables (``PagedBatch`` with ``block_tables.StepTables``); here each group's slots are checked
against the definition — ``table[b][pos // T] * entries_per_block + pos % T`` over the group's own
list — for both ways a step gets its tables (the executor's store, the chunks' lists), and a
released block a step needs is reported under the group that released it.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_backends.block_tables import BlockTableStore
from cache_backends.layout import LayerKV, build_layout
from cache_backends.paged_attention import PagedBatch, SeqChunk
from cache_backends.pools import BlockPools

ENTRY = 8
WIDTH = 16  # blocks per table in the store


def cut_pools(n_sliding: int, n_full: int, window: int, tokens_per_block: int) -> BlockPools:
    """V2 pools of equal pages: one arena, the layers cut into gcd(n_sliding, n_full)-layer groups."""
    layers = [LayerKV(i, "sliding", ENTRY, window=window) for i in range(n_sliding)]
    layers += [LayerKV(n_sliding + i, "full", ENTRY) for i in range(n_full)]
    layout = build_layout(layers, "v2", tokens_per_block, "float32")
    assert layout.shared
    return BlockPools(layout, dict.fromkeys((g.name for g in layout.groups), 4096), "cpu")


def expected_gather(table: list[int], start: int, end: int, window: int | None, T: int, E: int,
                    max_k: int) -> list[int]:
    """The slots of the keys a sequence's queries see, padded with its first key (the module's contract)."""
    lo = max(0, start - window + 1) if window else 0
    slots = [table[p // T] * E + p % T for p in range(lo, end)]
    return slots + [slots[0]] * (max_k - len(slots))


@st.composite
def steps(draw: st.DrawFn) -> dict:
    T = draw(st.sampled_from([1, 2, 4]))
    n_full = draw(st.integers(1, 2))
    n_sliding = n_full * draw(st.integers(1, 5))  # up to 5 cut sliding groups per full one
    window = draw(st.integers(1, 12))
    seqs = draw(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 6)), min_size=1, max_size=4))  # (start, new)
    return {"T": T, "n_sliding": n_sliding, "n_full": n_full, "window": window, "seqs": seqs,
            "seed": draw(st.integers(0, 2**16))}


def tables_for(pools: BlockPools, seqs: list[tuple[int, int]], seed: int) -> list[dict[str, list[int]]]:
    """Distinct random blocks per group and sequence; a window's blocks wholly before it released (-1)."""
    rng = random.Random(seed)
    free = rng.sample(range(4096), 4096)
    out = []
    for start, new in seqs:
        end = start + new
        tables = {}
        for name, g in pools.groups.items():
            n = -(-end // g.tokens_per_block)
            t = [free.pop() for _ in range(n)]
            if g.window:  # blocks before the first key any of this step's queries sees
                first = max(0, start - g.window + 1) // g.tokens_per_block
                t[:first] = [-1] * first
            tables[name] = t
        out.append(tables)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps())
def test_every_cut_groups_slots_are_its_own_tables(step):
    T, seqs = step["T"], step["seqs"]
    pools = cut_pools(step["n_sliding"], step["n_full"], step["window"], T)
    lists = tables_for(pools, seqs, step["seed"])
    names = list(pools.groups)
    store = BlockTableStore(names, max(WIDTH, max(len(t) for s in lists for t in s.values())))
    rows = [store.update_all(f"r{b}", [s[g] for g in names]) for b, s in enumerate(lists)]
    from_store = PagedBatch.build([SeqChunk([7] * new, start, {}) for start, new in seqs], pools, store.tables(rows))
    from_lists = PagedBatch.build([SeqChunk([7] * new, start, s) for (start, new), s in zip(seqs, lists, strict=True)],
                                  pools)
    for batch in (from_store, from_lists):
        for name, g in pools.groups.items():
            E = g.entries_per_block
            want = [s[name][p // T] * E + p % T for (start, new), s in zip(seqs, lists, strict=True)
                    for p in range(start, start + new)]
            assert batch.write_slots(name).tolist() == want, name
        for layer in range(len(pools.layout.layers)):
            (name, _), = pools.layer_index[layer]
            g = pools.groups[name]
            window = pools.layout.layers[layer].window
            shape = batch.gather(layer).shape  # the gather runs over the planned slots
            plan = batch._gather(layer)
            want = [expected_gather(s[name], start, start + new, window, T, g.entries_per_block, plan.max_k)
                    for (start, new), s in zip(seqs, lists, strict=True)]
            assert plan.slots.tolist() == want, (name, layer)
            assert shape == (len(seqs), plan.max_k, ENTRY)


def test_a_needed_block_released_in_one_cut_group_names_that_group():
    pools = cut_pools(5, 1, window=4, tokens_per_block=2)
    names = list(pools.groups)
    lists = tables_for(pools, [(9, 1), (5, 1)], seed=3)
    victim = names[3]  # sliding_w4.3: the fourth of five cut groups
    lists[1][victim][2] = -1  # sequence 1 at position 5 sees 2..5: block 2 (positions 4, 5) is needed
    store = BlockTableStore(names, WIDTH)
    rows = [store.update_all(f"r{b}", [s[g] for g in names]) for b, s in enumerate(lists)]
    with pytest.raises(ValueError, match=rf"sequence 1: group '{victim}' has no block for position 5, which a new "
                                         r"token needs \(logical block 2 is -1"):
        PagedBatch.build([SeqChunk([1], 9, {}), SeqChunk([1], 5, {})], pools, store.tables(rows))
    lists[1][victim][2] = 4000  # the new token's block is back; the window's first block goes missing
    lists[1][victim][1] = -1
    rows = [store.update_all(f"r{b}", [s[g] for g in names]) for b, s in enumerate(lists)]
    batch = PagedBatch.build([SeqChunk([1], 9, {}), SeqChunk([1], 5, {})], pools, store.tables(rows))
    layer = pools.groups[victim].layers[0]
    with pytest.raises(ValueError, match=rf"sequence 1: group '{victim}' has no block for position 2, which "
                                         r"attention needs \(logical block 1 is -1"):
        batch.gather(layer)


def test_store_rows_follow_every_groups_lists():
    store = BlockTableStore(["a", "b"], 6)
    store.update_all("r", [[1, 2], [3]])
    before = store.writes
    store.update_all("r", [[1, 2], [3]])  # a decode step inside the last blocks: nothing written
    assert store.writes == before
    store.update_all("r", [[-1, 2, 5], [3, 4]])  # a window released a block, both grew
    step = store.tables([store.row("r")])
    assert step["a"].tolist() == [[-1, 2, 5]]
    assert step["b"].tolist() == [[3, 4, -1]]
    assert torch.equal(torch.from_numpy(step.stack(["b", "a"])), torch.stack([step["b"], step["a"]]))
    with pytest.raises(ValueError, match="request r: 1 block tables for 2 groups"):
        store.update_all("r", [[1]])
