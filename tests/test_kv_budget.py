"""The KV memory budget: which rule sets it, caps, CPU without a bound, and a budget too small for one block."""

from __future__ import annotations

import pytest

import pipeline
from cache_backends import LayerKV, build_layout
from cache_backends.budget import BudgetError, compute_budget, host_available_bytes, is_cuda, plan_pools

LAYOUT = build_layout([LayerKV(i, "full", 64) for i in range(4)], "v1", 16, "float32")  # 16 KiB per block
BPB = 4 * 64 * 4 * 16
BPT = BPB // 16


def budget(**kw):
    base = {"device": "cuda", "max_seq_len": 1024, "free_gpu_memory_fraction": 0.5}
    return compute_budget(LAYOUT, **{**base, **kw})


def test_cuda_budget_is_free_memory_times_the_fraction():
    b = budget(free_bytes=10_000_000, weights_bytes=123)
    assert (b.budget_bytes, b.limited_by) == (5_000_000, "free_gpu_memory_fraction")
    assert b.weights_bytes == 123 and b.free_bytes == 10_000_000  # recorded, already out of free_bytes
    assert b.bytes_per_token == BPT and b.min_bytes == BPB


@pytest.mark.parametrize(
    ("caps", "want", "rule"),
    [
        ({"max_gpu_total_bytes": 1_000_000}, 1_000_000, "max_gpu_total_bytes"),
        ({"max_tokens": 1000}, 63 * BPB, "max_tokens"),  # ceil(1000 / 16) = 63 blocks
        ({"max_tokens": 1000, "max_gpu_total_bytes": 500_000}, 500_000, "max_gpu_total_bytes"),
        ({"max_tokens": 10**9}, 5_000_000, "free_gpu_memory_fraction"),
        ({"max_gpu_total_bytes": 0}, 5_000_000, "free_gpu_memory_fraction"),  # 0 = no cap
    ],
)
def test_the_smallest_rule_wins(caps, want, rule):
    b = budget(free_bytes=10_000_000, **caps)
    assert (b.budget_bytes, b.limited_by) == (want, rule)


def test_cpu_has_no_free_memory_rule_so_only_a_cap_bounds_it():
    b = budget(device="cpu", free_bytes=10**12)
    assert b.budget_bytes is None and b.limited_by is None
    assert b.unbounded_reason == "cpu has no free-memory rule to size it from"
    assert budget(device="cpu", max_tokens=64).budget_bytes == 4 * BPB
    assert budget(device="cpu", max_gpu_total_bytes=BPB * 3).budget_bytes == BPB * 3


def test_cuda_without_a_measurement_is_unbounded_with_the_reason():
    b = budget(device="cuda:1", free_bytes=None)
    assert b.budget_bytes is None and "cannot be measured" in b.unbounded_reason


def test_a_budget_below_one_block_per_group_is_refused_with_the_numbers():
    with pytest.raises(BudgetError, match=rf"budget of {BPB - 1} bytes .* at least {BPB} bytes .*uniform {BPB}"):
        plan_pools(LAYOUT, BPB - 1, 1024)
    pools = plan_pools(LAYOUT, BPB * 10 + 5, 64)
    assert pools.num_blocks == {"uniform": 10} and pools.total_bytes == 10 * BPB
    assert pools.capacity_tokens == 160 and pools.max_concurrency == 2  # 64 tokens = 4 blocks each


def test_device_names_and_host_memory():
    assert is_cuda("cuda") and is_cuda("cuda:3") and not is_cuda("cpu")
    available = host_available_bytes()
    assert available is None or available > 0


def test_max_tokens_buys_max_tokens_rounded_up_to_a_block_whatever_max_seq_len_is():
    # Review fix: max_seq_len=100 with T=32 used to round every sequence up (41 × 4 blocks = 5,216 tokens).
    layout = build_layout([LayerKV(i, "full", 2 * 8 * 128) for i in range(32)], "v1", 32, "bfloat16")
    for seq_len in (100, 4000, 4096, 10_000):
        b = compute_budget(layout, device="cpu", max_seq_len=seq_len, free_gpu_memory_fraction=0.9, max_tokens=4096)
        pools = plan_pools(layout, b.budget_bytes, seq_len, max_tokens=4096)
        assert pools.num_blocks == {"uniform": 128} and pools.capacity_tokens == 4096
        assert b.budget_bytes == b.tokens_cap_bytes == 128 * layout.groups[0].bytes_per_block
    b = compute_budget(layout, device="cpu", max_seq_len=100, free_gpu_memory_fraction=0.9, max_tokens=4000)
    assert b.budget_bytes == 125 * layout.groups[0].bytes_per_block  # ceil(4000 / 32)


def test_split_pools_give_growing_groups_their_tokens_and_window_groups_one_window_per_sequence():
    # pools that cannot lend each other pages (DeepSeek V4): max_tokens window slots would sit idle
    layers = [LayerKV(i, "sliding", 64, window=64) for i in range(5)] + [LayerKV(5, "full", 128)]
    layout = build_layout(layers, "v2", 16, "float32")  # other page shapes: pools split between the groups
    sliding = next(g for g in layout.groups if g.window)
    blocks = layout.blocks_for_tokens(4096, 100)  # 41 sequences of at most 100 tokens
    assert blocks == {"full": 256, sliding.name: 41 * sliding.blocks_for(100)}
    pools = plan_pools(layout, layout.bytes_for_tokens(4096, 100), 100, max_tokens=4096)
    assert pools.num_blocks == blocks and pools.capacity_tokens == 4096 and pools.max_concurrency == 256 // 7
    assert layout.blocks_for_tokens(50, 100) == {"full": 4, sliding.name: sliding.blocks_for(50)}  # one short sequence


def test_a_one_group_sliding_layout_gets_max_tokens_slots_as_v1_does():
    layout = build_layout([LayerKV(i, "sliding", 64, window=64) for i in range(4)], "v2", 16, "float32")
    v1 = build_layout([LayerKV(i, "full", 64) for i in range(4)], "v1", 16, "float32")
    assert layout.blocks_for_tokens(4096, 8192) == {layout.groups[0].name: 256}  # not one 8192-token window
    assert layout.bytes_for_tokens(4096, 8192) == v1.bytes_for_tokens(4096, 8192)
    pools = plan_pools(layout, layout.bytes_for_tokens(4096, 8192), 8192, max_tokens=4096)
    assert pools.max_concurrency == 256 // layout.groups[0].blocks_for(8192)  # 51 windows of 5 blocks
    assert pools.capacity_tokens == 51 * 8192 + 16  # served at once; the block left over holds 16 more tokens


def test_max_tokens_gives_a_shared_arena_the_blocks_the_groups_would_take_apart():
    layers = [LayerKV(i, "sliding", 64, window=64) for i in range(5)] + [LayerKV(5, "full", 64)]
    layout = build_layout(layers, "v2", 16, "float32")  # equal pages: six 1-layer groups, one arena
    pages = 6 * 256  # every group's 4096 tokens
    pools = plan_pools(layout, layout.bytes_for_tokens(4096, 100), 100, max_tokens=4096)
    assert set(pools.num_blocks.values()) == {pages}  # every group can take any of them
    assert pools.total_bytes == pages * layout.page_bytes == layout.bytes_for_tokens(4096, 100)
    window = layout.groups[0].blocks_for(100)  # 5 blocks: the window of a 100-token sequence
    assert pools.max_concurrency == pages // (7 + 5 * window)  # sequences of 100 tokens, jointly


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral", "tiny-qwen3", "tiny-gemma3", "tiny-deepseek-v3"])
@pytest.mark.parametrize("max_tokens", [1024, 4096, 65536])
def test_one_max_tokens_buys_v2_no_fewer_bytes_tokens_or_sequences_than_v1(preset, max_tokens):
    # "auto" may route either manager: the same --max_tokens must not shrink the KV memory when it picks V2
    # (a sliding-window model once got 9 blocks on V2 where V1 got 128)
    plans = {v2: pipeline.plan(preset, log=False, kv_cache_config={"max_tokens": max_tokens,
                                                                   "use_kv_cache_manager_v2": v2}).kv
             for v2 in (False, True)}
    v1, v2 = plans[False], plans[True]
    assert v2.budget_bytes == v1.budget_bytes  # the same bytes: every layer holds max_tokens tokens in both
    assert v2.capacity_tokens >= v1.capacity_tokens >= max_tokens
    assert v2.max_concurrency >= v1.max_concurrency
