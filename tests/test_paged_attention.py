"""Paged attention in plain torch: a step's writes, gathers and masks against dense causal attention."""

from __future__ import annotations

import functools
import gc
import math
import random
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_backends.layout import LayerKV, build_layout
from cache_backends.paged_attention import PagedBatch, SeqChunk, mla_paged_attention, paged_attention
from cache_backends.pools import BlockPools
from tests.paged_support import ToyAllocator

KV_HEADS, HEADS, HEAD_DIM = 2, 4, 8
ENTRY = 2 * KV_HEADS * HEAD_DIM


def make_pools(window: int | None, manager: str = "v2", tokens_per_block: int = 4, blocks: int = 96,
               dtype: str = "float32") -> BlockPools:
    # 96 blocks: the property test's worst case, 4 sequences of 23 tokens at 1 token per block, never windowed
    layers = [LayerKV(0, "full", ENTRY), LayerKV(1, "sliding", ENTRY, window=window) if window else
              LayerKV(1, "full", ENTRY)]
    layout = build_layout(layers, manager, tokens_per_block, dtype)
    pools = BlockPools(layout, {g.name: blocks for g in layout.groups}, "cpu")
    for t in pools.tensors.values():
        t.fill_(float("nan"))  # unwritten slots must never reach a result
    return pools


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (optionally windowed) attention of one whole sequence: q (L, H, d), k/v (L, Hkv, d) → (L, H, d)."""
    L = q.shape[0]
    i = torch.arange(L)
    mask = i[None, :] <= i[:, None]
    if window:
        mask &= i[None, :] > i[:, None] - window
    rep = HEADS // KV_HEADS
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(rep, 0),
                                         v.transpose(0, 1).repeat_interleave(rep, 0), attn_mask=mask,
                                         scale=HEAD_DIM**-0.5)
    return out.transpose(0, 1)


def _take(seqs: list[dict], step: list[tuple[int, SeqChunk]], name: str, layer: int | None = None) -> torch.Tensor:
    """The step's slices of ``seq[name]`` (of its ``layer`` first, for a per-layer tensor), packed."""
    return torch.cat([(seqs[b][name] if layer is None else seqs[b][name][layer])[c.start_pos:c.end_pos]
                      for b, c in step])


def drive(pools: BlockPools, seqs: list[dict], lengths: list[int], chunk: int, arrivals: list[int], seed: int,
          flex: object, attend_layer: Callable[..., torch.Tensor], release_windows: bool = False) -> None:
    """Feed every sequence's chunks (toy pages, shuffled) through layers 0 and 1 step by step, into ``seq["out"]``.

    ``attend_layer(batch, layer, take)`` returns the step's packed output of a layer; ``take(name)`` packs the
    step's slice of each active sequence's ``seq[name]`` (indexed by position; ``take(name, layer)`` first picks
    that layer of a per-layer tensor).
    """
    alloc = ToyAllocator(pools)
    rng = random.Random(seed)
    for free in alloc.free.values():
        rng.shuffle(free)  # physical blocks in no particular order
    step = 0
    while any(s["done"] < L for s, L in zip(seqs, lengths, strict=True)):
        active = [b for b, L in enumerate(lengths) if arrivals[b] <= step and seqs[b]["done"] < L]
        step += 1
        if not active:
            continue
        chunks = []
        for b in active:
            s, n = seqs[b], min(chunk, lengths[b] - seqs[b]["done"])
            alloc.cover(s["tables"], s["done"] + n)
            chunks.append(SeqChunk([0] * n, s["done"], {g: list(t) for g, t in s["tables"].items()}))
        batch = PagedBatch.build(chunks, pools, flex=flex)
        take = functools.partial(_take, seqs, list(zip(active, chunks, strict=True)))
        for layer in (0, 1):
            out = attend_layer(batch, layer, take)
            row = 0
            for b, c in zip(active, chunks, strict=True):
                n = len(c.token_ids)
                seqs[b]["out"].setdefault(layer, []).append(out[row:row + n])
                row += n
        for b, c in zip(active, chunks, strict=True):
            seqs[b]["done"] = c.end_pos
            if release_windows:
                alloc.drop_out_of_window(seqs[b]["tables"], c.end_pos)


def run_steps(pools: BlockPools, lengths: list[int], chunk: int, arrivals: list[int], seed: int,
              release_windows: bool = True, flex: object = None) -> list[dict]:
    """Feed random q/k/v for every sequence through paged attention in chunks; return paged and dense outputs."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [{"q": torch.randn(L, HEADS, HEAD_DIM, generator=gen),
             "k": torch.randn(L, KV_HEADS, HEAD_DIM, generator=gen),
             "v": torch.randn(L, KV_HEADS, HEAD_DIM, generator=gen), "done": 0, "tables": {}, "out": {}}
            for L in lengths]
    drive(pools, seqs, lengths, chunk, arrivals, seed, flex,
          lambda batch, layer, take: paged_attention(batch, layer, take("q"), take("k"), take("v"), HEAD_DIM**-0.5),
          release_windows)
    return seqs


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 23), min_size=1, max_size=4),
    chunk=st.integers(1, 9),
    window=st.one_of(st.none(), st.integers(1, 11)),
    tokens_per_block=st.sampled_from([1, 3, 4, 8]),
    manager=st.sampled_from(["v1", "v2"]),
    stagger=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_equals_dense_causal_attention(lengths, chunk, window, tokens_per_block, manager, stagger,
                                                       seed):
    # V2 may put both groups in one arena (one toy free list): twice the one-group worst case
    pools = make_pools(window, manager, tokens_per_block, blocks=192)
    arrivals = list(range(len(lengths))) if stagger else [0] * len(lengths)
    seqs = run_steps(pools, lengths, chunk, arrivals, seed)
    for s in seqs:
        for layer, w in ((0, None), (1, window)):
            got = torch.cat(s["out"][layer])
            torch.testing.assert_close(got, dense_reference(s["q"], s["k"], s["v"], w), rtol=1e-5, atol=1e-5)


def test_v2_sliding_group_releases_blocks_and_attention_still_matches():
    pools = make_pools(window=5, tokens_per_block=2)
    seqs = run_steps(pools, [19, 12], chunk=3, arrivals=[0, 0], seed=1)
    sliding = next(g for g in pools.groups.values() if g.window)
    # 19 tokens, window 5: the blocks before position 19 - 5 + 1 = 15 went back to the free list
    assert seqs[0]["tables"][sliding.name][:7] == [-1] * 7
    for s in seqs:
        torch.testing.assert_close(torch.cat(s["out"][1]), dense_reference(s["q"], s["k"], s["v"], 5))


def test_writes_land_where_the_pool_contract_says():
    pools = make_pools(window=None, tokens_per_block=4)
    table = {g: [5, 2] for g in pools.groups}
    k = torch.randn(6, KV_HEADS, HEAD_DIM)
    v = torch.randn(6, KV_HEADS, HEAD_DIM)
    batch = PagedBatch.build([SeqChunk(range(6), 1, table)], pools)  # positions 1..6
    paged_attention(batch, 0, torch.randn(6, HEADS, HEAD_DIM), k, v, 1.0)
    (group, pos), = pools.layer_index[0]
    slots = pools.layer_slots(group, pos)
    for i, p in enumerate(range(1, 7)):
        entry = slots[table[group][p // 4] * 4 + p % 4].view(2, KV_HEADS, HEAD_DIM)
        assert torch.equal(entry[0], k[i]) and torch.equal(entry[1], v[i])


def test_packed_inputs_positions_and_last_token_index():
    pools = make_pools(window=None)
    tables = {g: [0, 1, 2] for g in pools.groups}
    other = {g: [3, 4, 5] for g in pools.groups}
    batch = PagedBatch.build([SeqChunk([11, 12, 13], 0, tables), SeqChunk([21], 9, other)], pools)
    assert batch.input_ids.tolist() == [[11, 12, 13, 21]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 9]]
    assert batch.last_token_index.tolist() == [2, 3]
    assert batch.mask(0).shape == (2, 1, 3, 10)  # 2 sequences, 3 padded queries, 10 keys for the decode at 9


def test_kv_dtype_may_differ_from_the_model_dtype():
    pools = make_pools(window=3, dtype="bfloat16")
    seqs = run_steps(pools, [9, 4], chunk=4, arrivals=[0, 1], seed=3)
    for s in seqs:
        ref = dense_reference(s["q"], s["k"].bfloat16().float(), s["v"].bfloat16().float(), 3)
        torch.testing.assert_close(torch.cat(s["out"][1]), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_a_float8_pool_stores_what_a_float8_cast_makes_and_attention_reads_it_back(dtype):
    # torch's CPU index_copy has no float8 kernel: the pools are written through byte views of the same bits
    pools = make_pools(window=3, dtype=dtype)
    assert all(t.dtype == getattr(torch, dtype) for t in pools.tensors.values())
    seqs = run_steps(pools, [9, 4], chunk=4, arrivals=[0, 1], seed=3)
    fp8 = getattr(torch, dtype)
    for s in seqs:
        k, v = s["k"].to(fp8).float(), s["v"].to(fp8).float()
        for layer, window in ((0, None), (1, 3)):
            torch.testing.assert_close(torch.cat(s["out"][layer]), dense_reference(s["q"], k, v, window),
                                       rtol=1e-5, atol=1e-5)


def test_a_released_block_inside_the_window_is_a_clear_error():
    pools = make_pools(window=6, tokens_per_block=2)
    sliding = next(g.name for g in pools.groups.values() if g.window)
    tables = {g: [0, 1, 2, 3, 4] for g in pools.groups}
    tables[sliding] = [-1, -1, 2, 3, 4]  # positions 0..3 released; a query at 9 needs 4..9: fine
    batch = PagedBatch.build([SeqChunk([1], 9, tables)], pools)
    batch.gather(1)
    tables[sliding] = [-1, -1, -1, 3, 4]  # position 4 (block 2) released while the window still needs it
    batch = PagedBatch.build([SeqChunk([1], 9, tables)], pools)
    with pytest.raises(ValueError, match=rf"sequence 0: group '{sliding}' has no block for position 4, which "
                                         r"attention needs \(logical block 2 is -1"):
        batch.gather(1)


def test_block_tables_must_cover_the_new_tokens():
    pools = make_pools(window=None, tokens_per_block=4)
    (group,) = pools.groups
    with pytest.raises(ValueError, match=rf"sequence 1: block table of group '{group}' has 1 blocks of 4 tokens; "
                                         r"position 5 needs 2"):
        PagedBatch.build([SeqChunk([1], 0, {group: [0]}), SeqChunk([1, 2], 4, {group: [1]})], pools)
    with pytest.raises(ValueError, match=rf"sequence 0: no block table for group '{group}'"):
        PagedBatch.build([SeqChunk([1], 0, {})], pools)
    with pytest.raises(ValueError, match="has no block for position 0, which a new token needs"):
        PagedBatch.build([SeqChunk([1], 0, {group: [-1]})], pools)


def test_compressed_layers_are_refused_with_the_reason():
    layers = [LayerKV(0, "csa", 64, window=8, compressed_elems=48, compress_rate=4)]
    layout = build_layout(layers, "v2", 8, "float32")
    pools = BlockPools(layout, {g.name: 4 for g in layout.groups}, "cpu")
    batch = PagedBatch([SeqChunk([1], 0, {g: [0] for g in pools.groups})], pools)
    with pytest.raises(ValueError, match="layer 0 is a 'csa' layer; paged attention serves full, sliding, mla"):
        batch.route(0)


def test_entries_must_match_the_layout_width():
    pools = make_pools(window=None)
    batch = PagedBatch.build([SeqChunk([1, 2], 0, {g: [0] for g in pools.groups})], pools)
    with pytest.raises(ValueError, match=rf"layer 0: entries of shape \(2, 8\), expected \(2, {ENTRY}\)"):
        batch.write(0, torch.zeros(2, 8))


def test_softcap_caps_scores_before_the_mask():
    pools = make_pools(window=None)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, h, HEAD_DIM, generator=gen) * 4 for h in (HEADS, KV_HEADS, KV_HEADS))
    batch = PagedBatch.build([SeqChunk(range(5), 0, {g: [0, 1] for g in pools.groups})], pools)
    got = paged_attention(batch, 0, q, k, v, HEAD_DIM**-0.5, softcap=2.0)
    rep = HEADS // KV_HEADS
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, 1)) * HEAD_DIM**-0.5
    scores = torch.tanh(scores / 2.0) * 2.0
    scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf)
    ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.repeat_interleave(rep, 1))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_decode_steps_whose_sequences_see_equal_key_counts_skip_the_mask():
    pools = make_pools(window=4, tokens_per_block=2)
    # lengths 9 and 14, decoded one token at a time: past the window both gather exactly 4 keys
    seqs = run_steps(pools, [9, 14], chunk=1, arrivals=[0, 0], seed=5)
    tables = {g: list(range(8)) for g in pools.groups}
    batch = PagedBatch.build([SeqChunk([1], 8, tables), SeqChunk([1], 13, {g: list(range(8, 15))
                                                                           for g in pools.groups})], pools)
    assert batch.mask(1) is None  # sliding layer: 4 keys each
    assert batch.mask(0) is not None  # full layer: 9 and 14 keys, so padding needs a mask
    for s in seqs:
        torch.testing.assert_close(torch.cat(s["out"][1]), dense_reference(s["q"], s["k"], s["v"], 4))
        torch.testing.assert_close(torch.cat(s["out"][0]), dense_reference(s["q"], s["k"], s["v"], None))


def test_v1_uniform_pool_serves_layers_narrower_than_its_entry():
    """V1 sizes its one pool for the widest layer; a narrower layer uses the front of each entry."""
    narrow = 2 * 1 * HEAD_DIM  # one KV head
    layout = build_layout([LayerKV(0, "full", ENTRY), LayerKV(1, "full", narrow)], "v1", 4, "float32")
    pools = BlockPools(layout, {"uniform": 8}, "cpu")
    pools.tensors["uniform"].fill_(float("nan"))
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(7, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(7, 1, HEAD_DIM, generator=gen) for _ in range(2))
    out = []
    for start, n in ((0, 4), (4, 3)):
        batch = PagedBatch.build([SeqChunk([0] * n, start, {"uniform": [6, 1]})], pools)
        out.append(paged_attention(batch, 1, q[start:start + n], k[start:start + n], v[start:start + n],
                                   HEAD_DIM**-0.5))
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).expand(HEADS, -1, -1),
                                         v.transpose(0, 1).expand(HEADS, -1, -1), attn_mask=mask,
                                         scale=HEAD_DIM**-0.5).transpose(0, 1)
    torch.testing.assert_close(torch.cat(out), ref)


# --- the compiled path against the reference -----------------------------------------------------
# One pool shape (4-token blocks, 96 blocks, the two layers above) and steps of at most 36 tokens:
# two compiled shapes (buckets 8 and 36) serve every example.
FLEX_MAX_TOKENS = 36


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 23), min_size=1, max_size=4),
    chunk=st.integers(1, 9),
    window=st.one_of(st.none(), st.integers(1, 11)),
    manager=st.sampled_from(["v1", "v2"]),
    stagger=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_compiled_paged_attention_equals_the_reference(lengths, chunk, window, manager, stagger, seed):
    """Random block tables (shuffled free lists), windows releasing blocks to -1, ragged prefill chunks and decodes."""
    from cache_backends.flex_paged import FlexPagedAttention

    arrivals = list(range(len(lengths))) if stagger else [0] * len(lengths)
    ref = run_steps(make_pools(window, manager), lengths, chunk, arrivals, seed)
    pools = make_pools(window, manager)
    flex = FlexPagedAttention(pools, FLEX_MAX_TOKENS)
    for t in pools.tensors.values():
        t.fill_(1e4)  # finite garbage in unwritten slots: only the mask keeps it out of the result
    got = run_steps(pools, lengths, chunk, arrivals, seed, flex=flex)
    assert flex.calls > 0
    for s_ref, s_got in zip(ref, got, strict=True):
        for layer in (0, 1):
            torch.testing.assert_close(torch.cat(s_got["out"][layer]), torch.cat(s_ref["out"][layer]), rtol=1e-5,
                                       atol=1e-5)


# --- MLA (DeepSeek V3's latent pools) on the compiled path, absorbed, against the expanded reference --------------
MLA_HEADS, NOPE, ROPE, RANK, DV = 4, 8, 4, 16, 8
MLA_SCALE = (NOPE + ROPE) ** -0.5
# steps of at most 8 tokens (4 sequences, chunks of up to 2): one bucket, so one compiled shape per manager
MLA_MAX_TOKENS = 8


def mla_pools(manager: str) -> BlockPools:
    layers = [LayerKV(i, "mla", RANK + ROPE) for i in (0, 1)]
    layout = build_layout(layers, manager, 4, "float32")
    pools = BlockPools(layout, {g.name: 48 for g in layout.groups}, "cpu")
    for t in pools.tensors.values():
        t.fill_(float("nan"))
    return pools


def run_mla_steps(pools: BlockPools, lengths: list[int], chunk: int, arrivals: list[int], seed: int,
                  flex: object = None, absorbed: bool | None = None) -> tuple[list[dict], torch.Tensor]:
    """Random queries, latents and ``kv_b_proj`` halves through both MLA layers in chunks; outputs per sequence."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(2, MLA_HEADS, NOPE + DV, RANK, generator=gen) / RANK**0.5  # kv_b_proj per layer and head
    seqs = [{"q_nope": torch.randn(2, L, MLA_HEADS, NOPE, generator=gen),
             "q_pe": torch.randn(2, L, MLA_HEADS, ROPE, generator=gen),
             "latent": torch.randn(2, L, RANK, generator=gen), "rope": torch.randn(2, L, ROPE, generator=gen),
             "done": 0, "tables": {}, "out": {}} for L in lengths]

    def attend_layer(batch: PagedBatch, layer: int, take: Callable[..., torch.Tensor]) -> torch.Tensor:
        return mla_paged_attention(batch, layer, take("q_nope", layer), take("q_pe", layer), take("latent", layer),
                                   take("rope", layer), w[layer], MLA_SCALE, absorbed=absorbed)

    drive(pools, seqs, lengths, chunk, arrivals, seed, flex, attend_layer)
    return seqs, w


def mla_dense(s: dict, w: torch.Tensor, layer: int) -> torch.Tensor:
    """One whole sequence's MLA as DeepSeek writes it: latents expanded per head, causal SDPA. ``(L, H, d_v)``."""
    latent, rope = s["latent"][layer], s["rope"][layer]
    L = latent.shape[0]
    kv = torch.einsum("lr,hdr->hld", latent, w[layer])
    k = torch.cat((kv[..., :NOPE], rope.expand(MLA_HEADS, L, ROPE)), dim=-1)
    v = kv[..., NOPE:]
    q = torch.cat((s["q_nope"][layer], s["q_pe"][layer]), dim=-1).transpose(0, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=MLA_SCALE).transpose(0, 1)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 19), min_size=1, max_size=4),
    chunk=st.integers(1, 2),
    manager=st.sampled_from(["v1", "v2"]),
    stagger=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_compiled_mla_in_absorbed_form_equals_the_expanded_reference(lengths, chunk, manager, stagger, seed):
    """Shuffled block tables, ragged lengths, prefill chunks beside decodes; garbage in unwritten slots."""
    from cache_backends.flex_paged import FlexPagedAttention

    arrivals = list(range(len(lengths))) if stagger else [0] * len(lengths)
    ref, w = run_mla_steps(mla_pools(manager), lengths, chunk, arrivals, seed)
    pools = mla_pools(manager)
    flex = FlexPagedAttention(pools, MLA_MAX_TOKENS)
    for t in pools.tensors.values():
        t.fill_(1e4)  # finite garbage in unwritten slots: only the mask keeps it out of the result
    got, _ = run_mla_steps(pools, lengths, chunk, arrivals, seed, flex=flex)
    assert flex.calls > 0 and flex.failed is None
    for s_ref, s_got in zip(ref, got, strict=True):
        for layer in (0, 1):
            dense = mla_dense(s_ref, w, layer)
            torch.testing.assert_close(torch.cat(s_ref["out"][layer]), dense, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(torch.cat(s_got["out"][layer]), dense, rtol=1e-5, atol=1e-5)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 19), min_size=1, max_size=4),
    chunk=st.integers(1, 5),
    manager=st.sampled_from(["v1", "v2"]),
    stagger=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gathered_mla_absorbed_and_expanded_both_equal_the_dense_reference(lengths, chunk, manager, stagger, seed):
    """gather + SDPA in either form, every step forced: padded chunks beside decodes, garbage in unwritten slots."""
    from cache_backends.paged_attention import MLA_CALLS

    arrivals = list(range(len(lengths))) if stagger else [0] * len(lengths)
    outs = {}
    for absorbed in (True, False):
        pools = mla_pools(manager)
        for t in pools.tensors.values():
            t.fill_(1e4)  # finite garbage in unwritten slots: only the mask keeps it out of the result
        before = dict(MLA_CALLS)
        outs[absorbed], w = run_mla_steps(pools, lengths, chunk, arrivals, seed, absorbed=absorbed)
        ran = {k: MLA_CALLS[k] - before[k] for k in MLA_CALLS}
        assert ran["absorbed" if absorbed else "expanded"] > 0 and ran["expanded" if absorbed else "absorbed"] == 0
    for s_abs, s_exp in zip(outs[True], outs[False], strict=True):
        for layer in (0, 1):
            dense = mla_dense(s_exp, w, layer)
            torch.testing.assert_close(torch.cat(s_exp["out"][layer]), dense, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(torch.cat(s_abs["out"][layer]), dense, rtol=1e-5, atol=1e-5)


def test_the_compiled_path_refuses_a_needed_block_that_was_released():
    from cache_backends.flex_paged import FlexPagedAttention

    pools = make_pools(None)
    flex = FlexPagedAttention(pools, 8)
    tables = {g: [3, -1, 5] for g in pools.groups}  # position 4..7 live in logical block 1, released
    batch = PagedBatch.build([SeqChunk([1], 10, tables)], pools, flex=flex)
    q = torch.zeros(1, HEADS, HEAD_DIM)
    kv = torch.zeros(1, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match=r"sequence 0: group '.*' has no block for position 4\.\., which attention "
                                         r"needs \(logical block 1 is -1"):
        paged_attention(batch, 0, q, kv, kv, 1.0)


def test_unequal_chunks_attend_without_padding_and_match_the_padded_call(monkeypatch):
    # one long prefill from position 0, a short chunk after a prefix, and two decode rows: padding the
    # queries to 12 and the keys to 12 would be ~3x the scores needed, so each chunk attends on its own
    pools = make_pools(window=5, tokens_per_block=4)
    gen = torch.Generator().manual_seed(3)
    tables = [{g: [4 * b + i for i in range(4)] for g in pools.groups} for b in range(4)]
    chunks = [SeqChunk([1] * 12, 0, tables[0]), SeqChunk([1], 9, tables[1]), SeqChunk([1], 10, tables[2]),
              SeqChunk([1] * 2, 3, tables[3])]
    for t in pools.tensors.values():  # every slot a chunk's prefix may read holds a real entry
        t.normal_(generator=gen)
    q = torch.randn(16, HEADS, HEAD_DIM, generator=gen)
    k, v = torch.randn(16, KV_HEADS, HEAD_DIM, generator=gen), torch.randn(16, KV_HEADS, HEAD_DIM, generator=gen)
    for softcap in (None, 2.0):
        for layer in (0, 1):
            split = PagedBatch.build(chunks, pools)
            parts = split.split_plan(layer)
            assert parts is not None
            # the decode rows (sequences 1 and 2) attend in one call; the long chunk as a causal triangle
            assert [(p[1], p[3]) for p in parts] == [(12, 1), (2, 2), (2, 1)]
            assert parts[0][4] is (layer == 0)  # the sliding layer's window is not a plain triangle
            got = paged_attention(split, layer, q, k, v, HEAD_DIM**-0.5, softcap=softcap)
            with monkeypatch.context() as m:
                m.setattr(PagedBatch, "split_plan", lambda self, layer: None)
                padded = paged_attention(PagedBatch.build(chunks, pools), layer, q, k, v, HEAD_DIM**-0.5,
                                         softcap=softcap)
            torch.testing.assert_close(got, padded, rtol=1e-5, atol=1e-5)


def test_a_step_that_pads_little_attends_in_one_padded_call():
    pools = make_pools(window=None)
    tables = [{g: [2 * b, 2 * b + 1] for g in pools.groups} for b in range(2)]
    batch = PagedBatch.build([SeqChunk([1] * 4, 0, tables[0]), SeqChunk([1] * 3, 1, tables[1])], pools)
    assert batch.split_plan(0) is None  # 2 x 4 x 4 padded scores against 16 + 12 needed


def test_releasing_the_pools_frees_the_views_attention_kept():
    # the attention keeps per-layer views of the pools across steps; release must not leave them holding the memory
    pools = make_pools(None)
    batch = PagedBatch.build([SeqChunk([1, 2, 3], 0, {g: [0] for g in pools.groups})], pools)
    k = torch.randn(3, KV_HEADS, HEAD_DIM)
    paged_attention(batch, 0, torch.randn(3, HEADS, HEAD_DIM), k, k, HEAD_DIM**-0.5)
    assert pools.views, "the step kept no views: this test no longer exercises what release must drop"
    tensors = [weakref.ref(t) for t in pools.tensors.values()]
    del batch
    pools.release()
    gc.collect()
    assert all(ref() is None for ref in tensors)
