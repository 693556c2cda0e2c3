"""The KV memory budget: which rule sets it, caps, CPU without a bound, and a budget too small for one block."""

from __future__ import annotations

import pytest

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
