"""KV geometry: bytes per token and per sequence, checked against kv-geometry.md computed here from the configs.

The expected numbers are worked out in this file from the config fields with the formulas of
``docs/kv-geometry.md`` (not by calling the code under test), for every preset and for real
published configs vendored in ``tests/data/configs/`` (see SOURCES.md there).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import pipeline
from cache_backends import LayerKV, build_layout
from models import presets

CONFIGS = Path(__file__).parent / "data" / "configs"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
V4_COMPRESSED = {"compressed_sparse_attention", "heavily_compressed_attention"}


def _text(cfg):
    return getattr(cfg, "text_config", None) or cfg


def expected_bytes_per_token(cfg, b: int) -> tuple[float, float]:
    """(V1, V2) bytes per token by kv-geometry.md, from a transformers config object."""
    c = _text(cfg)
    n = c.num_hidden_layers
    if getattr(c, "kv_lora_rank", None):  # MLA: one latent + rope part, no separate V; head_dim is not the width
        e = (c.kv_lora_rank + c.qk_rope_head_dim) * b
        return n * e, n * e
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    types = getattr(c, "layer_types", None)
    if types and V4_COMPRESSED & set(types):  # DeepSeek V4: raw window K=V, compressed entries per c tokens
        raw = kv_heads * head_dim * b
        v2 = 0.0
        for t in types:
            if t == "compressed_sparse_attention":
                v2 += (head_dim + c.index_head_dim) * b / c.compress_rates[t]
            elif t == "heavily_compressed_attention":
                v2 += head_dim * b / c.compress_rates[t]
        return n * raw, v2
    e = 2 * kv_heads * head_dim * b
    if types:
        sliding = sum(t == "sliding_attention" for t in types)
    elif getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True) is not False:
        sliding = n  # Mistral style: every layer slides
    else:
        sliding = 0
    return n * e, (n - sliding) * e


def plan_kv(model: str, v2: bool, dtype: str = "bfloat16"):
    result = pipeline.plan(model, log=False, device="cpu",
                           kv_cache_config={"use_kv_cache_manager_v2": v2, "dtype": dtype})
    return result


# --- presets ---------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", presets())
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bytes_per_token_of_every_preset_matches_the_formulas(preset, dtype):
    v2_only = preset == "tiny-deepseek-v4"
    for v2 in ([True] if v2_only else [False, True]):
        result = plan_kv(preset, v2, dtype)
        want_v1, want_v2 = expected_bytes_per_token(result.context.hf_config, DTYPE_BYTES[dtype])
        assert result.kv.manager == ("v2" if v2 else "v1")
        assert result.kv.bytes_per_token == pytest.approx(want_v2 if v2 else want_v1)
        assert result.kv.to_dict()["bytes_per_token"] == pytest.approx(want_v2 if v2 else want_v1)
    if v2_only:  # V1 cannot route V4, but its uniform layout still follows the V1 rule (raw entries)
        spec = result.context.spec
        v1 = build_layout(spec.kv_layers(), "v1", 128, dtype)
        assert v1.bytes_per_token == want_v1


def test_gemma3_v1_and_v2_differ_by_exactly_the_sliding_layers():
    v1, v2 = plan_kv("tiny-gemma3", False), plan_kv("tiny-gemma3", True)
    cfg = v1.context.hf_config
    sliding = sum(t == "sliding_attention" for t in cfg.layer_types)
    per_layer = 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    assert sliding == 5
    assert v1.kv.bytes_per_token - v2.kv.bytes_per_token == sliding * per_layer
    groups = {g["name"]: g for g in v2.kv.to_dict()["layer_groups"]}
    # equal pages: 5 sliding + 1 full layer -> gcd 1 -> five 1-layer sliding groups and the full one, one arena
    assert [g["layers"] for name, g in groups.items() if name.startswith("sliding_w512.")] == [[0], [1], [2], [3], [4]]
    assert all(g["window"] == 512 for name, g in groups.items() if name != "full")
    assert groups["full"]["layers"] == [5] and len(groups) == 6
    assert len({g["blocks"] for g in groups.values()}) == 1  # every group counts the whole arena
    memory = v2.kv.to_dict()["memory"]
    assert memory["shared"] and memory["arena_blocks"] == groups["full"]["blocks"]
    assert [g["name"] for g in v1.kv.to_dict()["layer_groups"]] == ["uniform"]


def test_deepseek_v4_groups_windows_together_and_compressed_layers_by_rate():
    result = plan_kv("tiny-deepseek-v4", True)
    groups = {g["name"]: g for g in result.kv.to_dict()["layer_groups"]}
    assert set(groups) == {"sliding_w128", "hca_c128", "csa_c4"}
    # every V4 layer keeps a raw window of the same width: one life cycle, one pool
    assert groups["sliding_w128"]["layers"] == [0, 1, 2, 3, 4, 5]
    assert groups["hca_c128"]["layers"] == [0, 1, 3] and groups["hca_c128"]["compress_rate"] == 128
    assert groups["csa_c4"]["layers"] == [2, 4] and groups["csa_c4"]["compress_rate"] == 4
    # T = 128 (model default): a csa block holds 128 / 4 = 32 entries of head_dim + index_head_dim
    cfg = result.context.hf_config
    assert groups["csa_c4"]["bytes_per_block"] == 2 * (128 // 4) * (cfg.head_dim + cfg.index_head_dim) * 2
    assert groups["hca_c128"]["bytes_per_block"] == 3 * 1 * cfg.head_dim * 2


# --- real published configs ------------------------------------------------------------------

#: name -> (architecture, V1 B/token, V2 B/token, {window: sliding layers}) in bfloat16, by hand from the files.
REAL = {
    "llama-3.1-8b-instruct": ("LlamaForCausalLM", 131_072, 131_072, {}),  # 32 × 2·8·128·2
    "qwen3-8b": ("Qwen3ForCausalLM", 147_456, 147_456, {}),  # 36 × 2·8·128·2
    "qwen2.5-7b-instruct": ("Qwen2ForCausalLM", 57_344, 57_344, {}),  # use_sliding_window false; 28 × 2·4·128·2
    "gemma-3-27b-it": ("Gemma3ForConditionalGeneration", 507_904, 81_920, {1024: 52}),  # 62 × 8192; 10 full
    "gemma-2-9b-it": ("Gemma2ForCausalLM", 344_064, 172_032, {4096: 21}),  # 42 × 2·8·256·2; 21 full
    "gpt-oss-20b": ("GptOssForCausalLM", 49_152, 24_576, {128: 12}),  # 24 × 2·8·64·2; 12 full
    "gpt-oss-120b": ("GptOssForCausalLM", 73_728, 36_864, {128: 18}),
    "deepseek-v2-lite": ("DeepseekV2ForCausalLM", 31_104, 31_104, {}),  # 27 × (512 + 64) × 2
    "deepseek-r1-0528": ("DeepseekV3ForCausalLM", 70_272, 70_272, {}),  # 61 × (512 + 64) × 2
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_published_configs_through_autoconfig(name):
    arch, want_v1, want_v2, windows = REAL[name]
    path = CONFIGS / name
    assert json.loads((path / "config.json").read_text())["architectures"] == [arch]
    v1 = plan_kv(str(path), False)
    v2 = plan_kv(str(path), True)
    assert v1.model.architecture == arch
    assert v1.kv.bytes_per_token == want_v1
    assert v2.kv.bytes_per_token == want_v2
    # the hand-written table agrees with the formulas applied to what AutoConfig loaded
    assert expected_bytes_per_token(v1.context.hf_config, 2) == (want_v1, want_v2)
    sliding = {}
    for g in v2.kv.layout.groups:
        if g.window is not None:
            sliding[g.window] = sliding.get(g.window, 0) + len(g.layers)
    assert sliding == windows
    # nothing is allocated by plan and the CPU has no budget rule: geometry only
    assert v1.kv.budget_bytes is None and v1.kv.capacity_tokens is None and v1.kv_manager is None


def test_unregistered_architectures_use_the_generic_spec_with_their_own_geometry():
    result = plan_kv(str(CONFIGS / "gpt-oss-20b"), True)
    assert result.model.spec == "GenericDecoderSpec"
    assert result.audit.of("model_spec_fallback")
    head_dim = result.context.hf_config.head_dim
    assert head_dim == 64 != result.context.hf_config.hidden_size // result.context.hf_config.num_attention_heads


# --- per-sequence bytes, windows, block rounding ------------------------------------------------


@given(length=st.integers(0, 5000), T=st.sampled_from([1, 16, 32, 100, 128]))
def test_bytes_for_sequence_is_exact_with_block_rounding_and_windows(length, T):
    W, e = 512, 2 * 2 * 16  # elements per entry
    layers = [LayerKV(i, "sliding", e, window=W) for i in range(5)] + [LayerKV(5, "full", e)]
    b = 2
    v1 = build_layout(layers, "v1", T, "bfloat16")
    v2 = build_layout(layers, "v2", T, "bfloat16")
    blocks = math.ceil(length / T)
    window_blocks = min(blocks, math.ceil((W - 1) / T) + 1)
    assert v1.bytes_for_sequence(length) == blocks * T * 6 * e * b
    assert v2.bytes_for_sequence(length) == blocks * T * e * b + window_blocks * T * 5 * e * b


def test_compressed_group_bytes_for_sequence_counts_one_entry_per_rate():
    layers = [LayerKV(0, "hca", 8, window=16, compressed_elems=4, compress_rate=8)]
    layout = build_layout(layers, "v2", 32, "float32")
    comp = next(g for g in layout.groups if g.kind == "compressed")
    assert (comp.entries_per_block, comp.tokens_per_block) == (4, 32)
    # 100 tokens -> 13 compressed entries -> 4 blocks of 4 entries; the window keeps ceil(15/32)+1 = 2 blocks
    assert layout.bytes_for_sequence(100) == 4 * 4 * 4 * 4 + 2 * 32 * 8 * 4
    assert layout.bytes_per_token == 4 * 4 / 8


# --- splitting a budget across groups ---------------------------------------------------------


def _gemma_like(T=16):
    """Gemma-like but with a wider full layer: other page shapes, so the pools are split (the fallback)."""
    layers = [LayerKV(i, "sliding", 64, window=64) for i in range(5)] + [LayerKV(5, "full", 128)]
    layout = build_layout(layers, "v2", T, "float32")
    assert not layout.shared and "pages differ in shape" in layout.unshared_reason
    return layout


def _gemma_shared(T=16):
    """Gemma-like with equal entries: six 1-layer groups sharing one arena."""
    layers = [LayerKV(i, "sliding", 64, window=64) for i in range(5)] + [LayerKV(5, "full", 64)]
    layout = build_layout(layers, "v2", T, "float32")
    assert layout.shared and [g.name for g in layout.groups][-1] == "full" and len(layout.groups) == 6
    return layout


# (sliding, full) layer counts -> each group's layers, in order, at kv_cache_config.max_page_padding 0.10: gcd where
# no padded page size saves groups within the bound (tiny-gemma3's 5 + 1, GPT-OSS's 12 + 12, 4 + 6), else the padded
# size with the fewest groups (Gemma 3 27B's 52 + 10: pages of 11 layers, the last sliding cut of 8; Gemma 3 1B's
# 22 + 4: pages of 4, the last of 2)
CUTS = {(5, 1): [1] * 6, (12, 12): [12, 12], (4, 6): [2] * 5, (52, 10): [11, 11, 11, 11, 8, 10],
        (22, 4): [4, 4, 4, 4, 4, 2, 4], (29, 5): [5, 5, 5, 5, 5, 4, 5]}
#: the same counts at the default max_page_padding 0: pages of gcd(layer counts) layers, none padded
GCD_CUTS = {(5, 1): [1] * 6, (12, 12): [12, 12], (4, 6): [2] * 5, (52, 10): [2] * 31, (22, 4): [2] * 13,
            (29, 5): [1] * 34}


def _sliding_full(sliding: int, full: int) -> list[LayerKV]:
    return [LayerKV(i, "sliding", 8, window=16) for i in range(sliding)] + [
        LayerKV(sliding + i, "full", 8) for i in range(full)]


@pytest.mark.parametrize(("cuts", "padding"), [(CUTS, 0.10), (GCD_CUTS, 0.0)])
@pytest.mark.parametrize("counts", sorted(CUTS))
def test_equal_pages_cut_groups_into_equal_pages_in_layer_order(counts, cuts, padding):
    sliding, full = counts
    layers = _sliding_full(sliding, full)
    layout = build_layout(layers, "v2", 4, "float32", padding)
    size = max(cuts[counts])
    assert layout.shared and [len(g.layers) for g in layout.groups] == cuts[counts]
    assert {g.page_layers for g in layout.groups} == {size} == {layout.page_layers}
    assert [g.padding for g in layout.groups] == [size - n for n in cuts[counts]]
    assert {g.bytes_per_block for g in layout.groups} == {size * 8 * 4 * 4}  # a whole page, padded or not
    assert [i for g in layout.groups for i in g.layers] == list(range(sliding + full))  # every layer once, in order
    if size == sliding:  # not cut: the name stays
        assert layout.groups[0].name == "sliding_w16"
    else:
        assert layout.groups[0].name == "sliding_w16.0" and layout.groups[1].name == "sliding_w16.1"
    assert layout.bytes_per_token == build_layout(layers, "v1", 4, "float32").bytes_per_token * full / (sliding + full)


def test_max_page_padding_0_is_the_default_and_pads_nothing():
    """The default layout is the gcd cut exactly: the setting is opt-in (a padded page holds fewer sequences)."""
    layers = _sliding_full(52, 10)
    default = build_layout(layers, "v2", 4, "float32")
    assert default == build_layout(layers, "v2", 4, "float32", 0.0)
    assert len(default.groups) == 31 and default.padding_dict(64) is None and default.padding_unused is None
    assert len(build_layout(layers, "v2", 4, "float32", 0.10).groups) == 6


@pytest.mark.parametrize("bad", [-0.01, 0.5, 0.9])
def test_build_layout_refuses_a_page_padding_outside_its_range(bad):
    with pytest.raises(ValueError, match=r"max_page_padding must be in \[0, 0.5\)"):
        build_layout(_sliding_full(52, 10), "v2", 4, "float32", bad)


#: every reference config's V2 groups at the default max_page_padding: (groups, layers of each), none padded; the
#: cut is gcd(layer counts), as before the setting existed (Gemma 3 27B: 31 groups of 2)
REFERENCE_GROUPS = {
    "gemma-3-27b-it": (31, 2), "gemma-2-9b-it": (2, 21), "gpt-oss-20b": (2, 12), "gpt-oss-120b": (2, 18),
    "llama-3.1-8b-instruct": (1, 32), "qwen2.5-7b-instruct": (1, 28), "qwen3-8b": (1, 36),
    "deepseek-v2-lite": (1, 27), "deepseek-r1-0528": (1, 61),
}


@pytest.mark.parametrize("name", sorted(REFERENCE_GROUPS))
def test_reference_configs_keep_their_gcd_groups_by_default(name):
    assert sorted(REFERENCE_GROUPS) == sorted(p.name for p in CONFIGS.iterdir() if p.is_dir())  # every one listed
    result = plan_kv(str(CONFIGS / name), True)
    layout = result.kv.layout
    count, size = REFERENCE_GROUPS[name]
    assert [len(g.layers) for g in layout.groups] == [size] * count
    assert not any(g.padding for g in layout.groups) and layout.padding_dict() is None
    assert result.kv.to_dict()["memory"]["padding"] is None
    assert not result.audit.of("setting_ignored")


@given(budget=st.integers(0, 5_000_000), seq_len=st.integers(1, 4096), tokens=st.integers(1, 100_000))
def test_a_shared_arena_takes_the_whole_budget_and_counts_sequences_jointly(budget, seq_len, tokens):
    layout = _gemma_shared()
    page = layout.page_bytes
    if budget >= layout.min_bytes():
        blocks = layout.split_budget(budget, seq_len)
        pages = blocks["full"]
        assert set(blocks.values()) == {pages} and pages * page <= budget < (pages + 1) * page
        assert layout.pool_bytes(blocks) == pages * page
        per_seq = sum(layout.blocks_for_sequence(seq_len).values())
        fits = layout.max_sequences(blocks, seq_len)
        assert fits * per_seq <= pages < (fits + 1) * per_seq
        held = layout.capacity_tokens(blocks)  # the longest single sequence the pages hold
        one = [sum(g.blocks_for(n) for g in layout.groups) for n in (held, held + 1)]
        assert one[0] <= pages < one[1]
        # what plan reports: the max_seq_len sequences that fit jointly, plus the longest shorter one after them
        served = layout.capacity_tokens(blocks, seq_len)
        assert fits * seq_len <= served < (fits + 1) * seq_len
        rest = served - fits * seq_len
        left = pages - fits * per_seq
        assert sum(g.blocks_for(rest) for g in layout.groups) <= left
        assert rest == seq_len - 1 or sum(g.blocks_for(rest + 1) for g in layout.groups) > left
    need = layout.blocks_for_tokens(tokens, seq_len)
    assert layout.pool_bytes(need) == layout.bytes_for_tokens(tokens, seq_len)
    if seq_len % layout.tokens_per_block == 0:  # else the full group rounds the tokens, not each sequence, up
        assert layout.max_sequences(need, seq_len) >= tokens // seq_len


def _v4_like(T=16):
    """DeepSeek V4's shape: every layer a raw window, some with compressed entries per 4 or 128 tokens."""
    layers = [LayerKV(i, "v4_sliding", 64, window=128, compressed_elems=96 if i % 2 else 64,
                      compress_rate=4 if i % 2 else 128) for i in range(6)]
    layout = build_layout(layers, "v2", T, "float32")
    assert not layout.shared and {g.kind for g in layout.groups} == {"sliding", "compressed"}
    return layout


@pytest.mark.parametrize("make", [_gemma_like, _v4_like])
@given(budget=st.integers(0, 5_000_000), seq_len=st.integers(1, 4096), length=st.integers(1, 4096))
@example(budget=5_000_000, seq_len=4096, length=200)  # many short sequences in a budget of two long ones
def test_split_pools_run_any_one_length_at_least_half_as_many_as_the_best_split_for_it(make, budget, seq_len,
                                                                                        length):
    layout = make()
    if budget < layout.min_bytes():
        return
    blocks = layout.split_budget(budget, seq_len)
    assert sum(blocks[g.name] * g.bytes_per_block for g in layout.groups) <= budget
    # at least one whole sequence of the length the growing pool holds fits in the window pool too
    sliding = next(g for g in layout.groups if g.window)
    held = layout.capacity_tokens(blocks)
    assert blocks[sliding.name] >= sliding.blocks_for(min(held, seq_len))
    one = layout.bytes_for_sequence(seq_len)
    if budget >= one:  # the longest request the budget can hold alone still fits
        assert layout.sequence_shortfall(seq_len, blocks) is None
    # sequences of any one length up to max_seq_len: at least half as many run at once as the best split for that
    # length would run in the budget left beside that longest one (a split for max_seq_len ran 3% on V4); lengths in
    # whole blocks of every group, since a block holds a few tokens as dearly as a full one
    step = max(g.tokens_per_block for g in layout.groups)
    length = min(length, seq_len) // step * step
    if not length:
        return
    spare = budget - one if budget >= one else budget
    assert layout.max_sequences(blocks, length) >= spare // layout.bytes_for_sequence(length) // 2


def test_split_pools_size_windows_for_the_length_where_they_cost_what_growth_does():
    layout = _gemma_like()  # 5 sliding layers (window 64: 5 blocks of 16 tokens) and one full layer
    windows = 5 * layout.groups[0].bytes_per_block
    assert layout.split_length(4096) == math.ceil(windows / layout.bytes_per_token) == 200
    assert layout.split_length(150) == 150  # never longer than max_seq_len
    assert _gemma_shared().split_length(4096) == 4096  # a shared arena is not split
    # a budget of three 4,096-token sequences, split for 200-token ones: half to windows, and the full pool still
    # holds one 4,096-token sequence. Split for 4,096 (the rule before) it ran 3 sequences of 200 tokens at once;
    # now as many as the best split for 200 tokens runs
    budget = 3 * layout.bytes_for_sequence(4096)
    blocks = layout.split_budget(budget, 4096)
    assert layout.max_sequences(blocks, 4096) == 1 and layout.max_sequences(blocks, 200) == 31
    assert layout.max_sequences(layout.split_budget(budget, 200), 200) == budget // layout.bytes_for_sequence(200) == 31
    # a budget just over one 4,096-token sequence: split for 200 tokens, the full pool would hold half of it; it
    # gets that sequence's blocks and the windows what is left, whole
    budget = layout.bytes_for_sequence(4096) + 10 * 5 * layout.groups[0].bytes_per_block
    blocks = layout.split_budget(budget, 4096)
    assert layout.sequence_shortfall(4096, blocks) is None and blocks == {"sliding_w64": 11 * 5, "full": 4096 // 16}
    # the pools max_tokens buys: every token in the growing pool, windows for the 200-token sequences those make
    need = layout.blocks_for_tokens(4096, 4096)
    assert need == {"sliding_w64": 5 * math.ceil(4096 / 200), "full": 4096 // 16}
    assert layout.pool_bytes(need) == layout.bytes_for_tokens(4096, 4096)


def test_bytes_for_tokens_then_split_gives_back_at_least_those_tokens():
    layout = _gemma_like()
    for tokens, seq_len in [(4096, 1024), (1000, 4096), (65536, 65536), (17, 16)]:
        blocks = layout.split_budget(layout.bytes_for_tokens(tokens, seq_len), seq_len)
        assert tokens <= layout.capacity_tokens(blocks)
        assert layout.max_sequences(blocks, seq_len) >= tokens // seq_len


def test_a_one_group_layout_spends_the_budget_in_whole_blocks():
    layout = build_layout([LayerKV(i, "full", 64) for i in range(4)], "v1", 16, "float32")
    bpb = layout.groups[0].bytes_per_block
    for budget in (bpb, 10 * bpb + 1, 12_345_678):
        assert layout.split_budget(budget, 1000) == {"uniform": budget // bpb}
