"""Stage 6 through the API: ``load`` builds the routed manager, ``plan`` reports the same numbers allocating nothing."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import pipeline
from cache_backends.request import Request
from pipeline import KvBuildError
from pipeline.errors import KvRuntimeError
from tests.kv_v1_support import drive

CPU4K = {"device": "cpu", "kv_cache_config": {"max_tokens": 4096}}


def test_load_builds_v1_with_the_planned_pools_and_reports_it(track_pools):
    with pipeline.load("tiny-llama", log=False, **CPU4K) as result:
        m, s = result.kv_manager, result.scheduler
        assert (type(m).__name__, type(s).__name__) == ("KVCacheManager", "GuaranteedNoEvictScheduler")
        assert m.pools.device.type == "cpu" and m.pools.dtype is torch.float32
        assert m.pools.num_blocks == {"uniform": 128} and m.pools.nbytes == 128 * 32 * 1024
        assert result.kv.capacity_tokens == 4096 and result.kv.max_concurrency == 0  # max_seq_len is 8192
        events = [e["event"] for e in result.audit.events]
        assert events[-1] == "pipeline_finished"
        assert events.index("kv_budget_computed") < events.index("kv_manager_built")
        (budget,) = result.audit.of("kv_budget_computed")
        assert budget["stage"] == "build_kv_manager"
        assert {k: budget[k] for k in ("manager", "device", "max_tokens", "budget_bytes", "limited_by",
                                       "bytes_per_token", "free_bytes", "weights_bytes", "max_gpu_total_bytes",
                                       "free_gpu_memory_fraction", "tokens_cap_bytes")} == {
            "manager": "v1", "device": "cpu", "max_tokens": 4096, "budget_bytes": 4096 * 1024,
            "limited_by": "max_tokens", "bytes_per_token": 1024.0, "free_bytes": None, "weights_bytes": 0,
            "max_gpu_total_bytes": 0, "free_gpu_memory_fraction": 0.9, "tokens_cap_bytes": 4096 * 1024}
        (built,) = result.audit.of("kv_manager_built")
        assert built["groups"]["uniform"]["blocks"] == 128 and built["groups"]["uniform"]["bytes"] == 4096 * 1024
        assert (built["device"], built["dtype"], built["capacity_tokens"], built["max_concurrency"]) == (
            "cpu", "float32", 4096, 0)
        assert result.audit.verify() == []
    assert [p.released for p in track_pools] == [True]
    assert m.closed


def test_plan_reports_exactly_what_load_allocates_and_allocates_nothing(track_pools):
    for model, kw in [("tiny-llama", CPU4K), ("tiny-gemma3", {"device": "cpu", "max_seq_len": 1024,
                      "kv_cache_config": {"use_kv_cache_manager_v2": False, "max_gpu_total_bytes": 3_000_000}})]:
        planned = pipeline.plan(model, log=False, **kw)
        assert planned.kv_manager is None and not track_pools
        assert planned.audit.of("kv_budget_computed")[0]["stage"] == "plan_kv"
        assert planned.audit.events[-1]["event"] == "pipeline_finished"
        with pipeline.load(model, log=False, **kw) as loaded:
            assert loaded.kv.to_dict() == planned.kv.to_dict()
            doc = planned.kv.to_dict()
            assert loaded.kv_manager.pools.num_blocks == {g["name"]: g["blocks"] for g in doc["layer_groups"]}
            assert loaded.kv_manager.pools.nbytes == doc["total_bytes"] <= doc["budget_bytes"]
        track_pools.clear()


def test_plan_json_fields_for_the_kv_plan():
    doc = pipeline.plan("tiny-gemma3", log=False, device="cpu", max_seq_len=2048,
                        kv_cache_config={"use_kv_cache_manager_v2": True, "max_tokens": 8192}).kv.to_dict()
    groups = {g["name"]: g for g in doc["layer_groups"]}
    assert set(groups["full"]) >= {"name", "kind", "layers", "window", "compress_rate", "bytes_per_block", "blocks"}
    # 8192 tokens in every group (TensorRT-LLM's max_tokens per window size): 256 blocks for each of the six
    # groups, in one arena every group counts whole
    arena = 6 * (8192 // 32)
    assert {g["blocks"] for g in groups.values()} == {arena} and doc["memory"]["arena_blocks"] == arena
    per_seq = 2048 // 32 + 5 * 17  # a 2,048-token sequence: 64 full blocks, a 17-block window in each sliding group
    assert doc["max_concurrency"] == arena // per_seq == 10
    assert doc["memory"]["shared"] and "10 sequence(s) of 2,048 tokens fit jointly" in doc["memory"]["text"]
    # the tokens served at once, as V1 counts them: ten 2,048-token sequences, then the 46 pages left hold one of
    # 224 tokens (7 blocks in each of the six groups)
    assert doc["capacity_tokens"] == 10 * 2048 + 224
    # the groups view one arena: no group has bytes of its own, the arena's are counted once
    assert all(g["shared"] and g["bytes"] is None for g in groups.values())
    assert doc["total_bytes"] == arena * groups["full"]["bytes_per_block"]
    assert doc["bytes_per_token"] == 256.0 and doc["budget_bytes"] == doc["budget"]["budget_bytes"]


def test_cpu_without_a_bound_plans_with_nulls_but_load_says_what_to_set(track_pools):
    planned = pipeline.plan("tiny-llama", log=False, device="cpu")
    doc = planned.kv.to_dict()
    assert doc["budget_bytes"] is None and doc["capacity_tokens"] is None
    assert doc["layer_groups"][0]["blocks"] is None and doc["layer_groups"][0]["bytes_per_block"] == 32768
    with pytest.raises(KvBuildError) as err:
        pipeline.load("tiny-llama", log=False, device="cpu")
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("no KV cache budget: cpu has no free-memory rule") and "kv_cache_config.max_tokens" in msg
    assert "kv_cache_config.max_gpu_total_bytes" in msg
    assert not track_pools


def test_a_budget_too_small_for_one_block_fails_in_one_line_and_allocates_nothing(log, track_pools):
    kw = {"device": "cpu", "kv_cache_config": {"max_gpu_total_bytes": 1000}}
    with pytest.raises(KvBuildError) as err:
        pipeline.load("tiny-llama", **kw)
    assert str(err.value) == (
        "KV budget 1000 B (max_gpu_total_bytes caps it at 1000 B) cannot hold one block per layer group: at least "
        "32768 B needed (bytes per block: uniform 32768); raise kv_cache_config.max_gpu_total_bytes or lower "
        "kv_cache_config.tokens_per_block")
    assert not track_pools
    assert log.has("kv_budget_computed", budget_bytes=1000, limited_by="max_gpu_total_bytes")
    assert log.has("stage_failed", stage="build_kv_manager", error="KvBuildError")
    planned = pipeline.plan("tiny-llama", log=False, **kw)  # plan still shows the geometry and the problem
    assert planned.kv.capacity_tokens is None and "cannot hold one block" in planned.kv.problem


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_explicit_cuda_without_a_gpu_is_a_build_error_but_plan_reports_geometry():
    with pytest.raises(KvBuildError, match=r"^device=cuda: no CUDA device is available on this machine; set device"):
        pipeline.load("tiny-llama", log=False, device="cuda", kv_cache_config={"max_tokens": 64})
    planned = pipeline.plan("tiny-llama", log=False, device="cuda", kv_cache_config={"max_tokens": 64})
    assert planned.kv.device == "cuda" and planned.kv.budget.free_bytes is None
    assert planned.kv.capacity_tokens == 64  # the cap bounds it even without a measurement


def test_an_allocation_failure_is_a_runtime_error_and_leaks_nothing(monkeypatch):
    def empty(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 MiB")

    monkeypatch.setattr("cache_backends.pools.torch.empty", empty)
    with pytest.raises(KvRuntimeError, match=r"^allocating 4194304 B of KV pools on cpu failed: CUDA out of memory"):
        pipeline.load("tiny-llama", log=False, **CPU4K)
    assert KvRuntimeError.exit_code == 1


def test_a_failure_after_allocation_releases_the_pools(monkeypatch, track_pools):
    def boom(self, *args, **kwargs):
        raise ValueError("manager refused")

    monkeypatch.setattr("cache_backends.v1.manager.KVCacheManager.__init__", boom)
    with pytest.raises(KvBuildError, match="build_kv_manager: ValueError: manager refused"):
        pipeline.load("tiny-llama", log=False, **CPU4K)
    assert len(track_pools) == 1 and track_pools[0].released


def test_a_later_stage_failing_releases_manager_and_pools(track_pools):
    seen = {}

    class Explode:
        name = "explode"

        def run(self, ctx, emit):
            seen["manager"] = ctx.kv_manager
            raise RuntimeError("later stage failed")

    with pytest.raises(RuntimeError, match="later stage failed"):
        pipeline.load("tiny-llama", log=False, stages=[*pipeline.load_stages(), Explode()], **CPU4K)
    assert seen["manager"].closed and track_pools[0].released


def test_weights_already_loaded_are_reported_in_the_budget():
    class FakeWeights:
        name = "fake_weights"

        def run(self, ctx, emit):
            ctx.hf_model = torch.nn.Linear(4, 4)  # 16 + 4 float32 = 80 bytes

    resolved = pipeline.resolve_stages()
    stages = [*resolved, FakeWeights(), *pipeline.load_stages()[len(resolved):]]
    with pipeline.load("tiny-llama", log=False, stages=stages, **CPU4K) as result:
        assert result.audit.of("kv_budget_computed")[0]["weights_bytes"] == 80


def test_the_built_manager_serves_requests_end_to_end():
    with pipeline.load("tiny-qwen3", log=False, device="cpu", max_num_tokens=64,
                       kv_cache_config={"max_tokens": 256, "tokens_per_block": 16}) as result:
        m = result.kv_manager
        reqs = [Request(f"r{i}", list(range(30)), 20) for i in range(6)]  # 50 tokens = 4 blocks each; 16 blocks
        trace = drive(result.scheduler, m, reqs)
        assert trace.stalled is None and len(trace.finished) == 6 and trace.max_running <= 4
        assert m.stats().reuse_hit_tokens > 0 and m.stats().groups["uniform"].used == 0


def test_v2_is_built_through_the_agreed_construction_contract():
    v2 = pytest.importorskip("cache_backends.v2")
    kv = {"max_tokens": 65536, "pool_arena": False}  # split pools ("auto" builds a slab arena at this budget)
    with pipeline.load("tiny-deepseek-v4", log=False, device="cpu", kv_cache_config=kv) as result:
        assert isinstance(result.kv_manager, v2.KVCacheManagerV2)
        assert isinstance(result.scheduler, v2.KVCacheV2Scheduler)
        pools = result.kv_manager.pools
        assert set(pools.tensors) == {g.name for g in result.kv.layout.groups} == {"sliding_w128", "hca_c128",
                                                                                     "csa_c4"}
        assert result.kv.capacity_tokens == 65536 and result.kv.max_concurrency == 1
        assert pools.num_blocks == {"sliding_w128": 66, "hca_c128": 512, "csa_c4": 512}


def test_the_build_stage_hands_v2_its_pools_options_and_limits(monkeypatch, track_pools):
    """The V2 side of the construction contract, checked with stand-ins until cache_backends.v2 exists."""
    fake = types.ModuleType("cache_backends.v2")

    class KVCacheManagerV2:
        def __init__(self, pools, options):
            self.pools, self.options, self.closed = pools, options, False

        def close(self):
            self.closed = True
            self.pools.release()

    class KVCacheV2Scheduler:
        def __init__(self, manager, max_batch_size, max_num_tokens, *, scheduling_policy):
            self.args = (manager, max_batch_size, max_num_tokens, scheduling_policy)

    fake.KVCacheManagerV2, fake.KVCacheV2Scheduler = KVCacheManagerV2, KVCacheV2Scheduler
    monkeypatch.setitem(sys.modules, "cache_backends.v2", fake)
    with pipeline.load("tiny-deepseek-v4", log=False, device="cpu", max_batch_size=8, max_num_tokens=512,
                       kv_cache_config={"max_tokens": 65536, "host_cache_size": 0, "pool_arena": False}) as result:
        m, s = result.kv_manager, result.scheduler
        assert s.args == (m, 8, 512, "fcfs")
        assert m.pools.num_blocks == {"sliding_w128": 66, "hca_c128": 512, "csa_c4": 512}
        assert (m.options.max_seq_len, m.options.host_cache_size, m.options.enable_swa_scratch_reuse) == (
            65536, 0, True)
        built = result.audit.of("kv_manager_built")[0]
        assert built["kv_manager"] == "KVCacheManagerV2" and set(built["groups"]) == set(m.pools.num_blocks)
        assert built["capacity_tokens"] == 65536 and built["max_concurrency"] == 1
    assert m.closed and track_pools[0].released


def test_v2_missing_is_a_clear_build_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cache_backends.v2", None)
    with pytest.raises(KvBuildError, match=r"^KVCacheManagerV2 is not available in this installation"):
        pipeline.load("tiny-deepseek-v4", log=False, device="cpu", kv_cache_config={"max_tokens": 1024})


# --- CUDA ----------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_budget_follows_free_memory_and_close_gives_it_back():
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    with pipeline.load("tiny-llama", log=False, device="cuda",
                       kv_cache_config={"free_gpu_memory_fraction": 0.01}) as result:
        (budget,) = result.audit.of("kv_budget_computed")
        assert budget["limited_by"] == "free_gpu_memory_fraction" and budget["free_bytes"] > 0
        assert budget["budget_bytes"] == int(budget["free_bytes"] * 0.01)
        pools = result.kv_manager.pools
        assert all(t.is_cuda for t in pools.tensors.values())
        assert torch.cuda.memory_allocated() - before >= pools.nbytes
    assert torch.cuda.memory_allocated() == before


@pytest.mark.cuda
def test_cuda_data_written_through_a_block_table_reads_back():
    with pipeline.load("tiny-llama", log=False, device="cuda", kv_cache_config={"max_tokens": 1024}) as result:
        m = result.kv_manager
        r = Request("a", list(range(40)), 0)
        m.admit(r, m.find_prefix(r))
        assert m.allocate_slots(r, 40)
        table = torch.tensor(m.block_table(r, "uniform"), device="cuda")
        T = m.tokens_per_block
        pos = torch.arange(40, device="cuda")
        slots = table[pos // T] * T + pos % T
        data = torch.randn(40, m.layout.groups[0].entry_elems, device="cuda", dtype=m.pools.dtype)
        m.pools.layer_slots("uniform", 1)[slots] = data
        m.commit(r, 40)
        assert torch.equal(m.pools.layer_slots("uniform", 1)[slots], data)


def test_plan_capacity_is_max_tokens_when_max_seq_len_is_not_a_multiple_of_the_block():
    kv = pipeline.plan("tiny-llama", log=False, device="cpu", max_seq_len=100,
                       kv_cache_config={"max_tokens": 4096}).kv
    assert kv.pools.num_blocks == {"uniform": 128} and kv.capacity_tokens == 4096
    assert kv.pools.total_bytes == kv.budget_bytes == 128 * 32 * 1024
