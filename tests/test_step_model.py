"""The simulator's modeled time: each step's batch priced by a roofline of bytes read and FLOPs computed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_backends.layout import LayerKV
from engine.simulator import simulate
from engine.step_model import HARDWARE, Hardware, ModelCost, StepModel, count_weights

CONFIGS = Path(__file__).parent / "data" / "configs"
CPU = {"device": "cpu", "log": False, "progress": False}
HW = Hardware("test", 1e12, 1e14, 1e9)


def _cost(**kw) -> ModelCost:
    base = {"dense_bytes": 1_000_000, "expert_bytes": 0, "dense_params": 400_000, "expert_params": 0,
            "num_experts": 0, "experts_per_token": 0, "lm_head_flops": 2 * 1000 * 64, "attn_width": 64}
    return ModelCost(**{**base, **kw})


def _brute(cost: ModelCost, layers: list[LayerKV], kv_bytes: int, chunks: list[tuple[int, int, bool]]) -> float:
    """The roofline counted query by query and layer by layer, as the module docstring states it."""
    tokens = sum(n for _, n, _ in chunks)
    weights = cost.dense_bytes
    if cost.expert_bytes:
        weights += cost.expert_bytes * (1 - (1 - cost.experts_per_token / cost.num_experts) ** tokens)
    flops = 2 * tokens * cost.dense_params + cost.lm_head_flops * sum(s for _, _, s in chunks)
    if cost.expert_params:
        flops += 2 * tokens * cost.expert_params * cost.experts_per_token / cost.num_experts
    read = 0
    for layer in layers:
        for start, n, _ in chunks:
            end = start + n
            read += layer.entry_elems * kv_bytes * (end if layer.window is None else min(end, layer.window))
            for q in range(start, end):
                seen = q + 1 if layer.window is None else min(q + 1, layer.window)
                flops += 4 * cost.attn_width * seen
    return max((weights + read) / HW.bytes_per_s, flops / HW.flops_per_s)


layer_kinds = st.lists(st.tuples(st.sampled_from([None, 1, 5, 16, 64]), st.integers(1, 64)), min_size=1, max_size=6)
chunk_lists = st.lists(st.tuples(st.integers(0, 300), st.integers(1, 120), st.booleans()), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(kinds=layer_kinds, chunks=chunk_lists, moe=st.booleans())
def test_step_time_is_the_roofline_counted_query_by_query(kinds, chunks, moe):
    """Windows, chunks that start inside, cross or pass a window, and routed experts: the summed form equals the
    per-query, per-layer count."""
    layers = [LayerKV(i, "full" if w is None else "sliding", elems, w) for i, (w, elems) in enumerate(kinds)]
    cost = _cost(expert_bytes=8_000_000, expert_params=4_000_000, num_experts=8, experts_per_token=2) if moe \
        else _cost()
    got = StepModel(cost, tuple(layers), 2, HW).step_seconds(chunks)
    assert got == pytest.approx(_brute(cost, layers, 2, chunks), rel=1e-9)


def test_a_decode_reads_and_a_long_prefill_computes():
    """One decode token costs the weights and its KV read at bandwidth; an 8,192-token prefill costs its FLOPs at
    peak: the two regimes a step can be in (Llama 3.1 8B's published config, bfloat16, on an H200)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(CONFIGS / "llama-3.1-8b-instruct")
    layers = [LayerKV(i, "full", 2 * 8 * 128) for i in range(32)]
    model = StepModel.build(cfg, layers, "bfloat16", "bfloat16", "h200")
    hw, cost = HARDWARE["h200"], model.cost
    decode = model.step_seconds([(1000, 1, True)])
    assert decode == pytest.approx((cost.dense_bytes + 32 * 4096 * 1001) / hw.bytes_per_s)
    prefill = model.step_seconds([(0, 8192, True)])
    flops = 2 * 8192 * cost.dense_params + cost.lm_head_flops + 4 * 32 * 4096 * 8192 * 8193 / 2
    assert prefill == pytest.approx(flops / hw.flops_per_s)
    assert prefill > 20 * decode  # what "steps" cannot see: these are one step each


def test_weights_counted_from_published_configs():
    """Llama 3.1 8B: 8.03 B parameters, the untied input embedding a gather (not read), the LM head read and priced
    per sampled token; GPT-OSS 20B: 32 routed experts, 4 per token, most of its weights."""
    from transformers import AutoConfig

    llama = count_weights(AutoConfig.from_pretrained(CONFIGS / "llama-3.1-8b-instruct"), 2)
    embed = head = 128256 * 4096
    total = 8_030_261_248
    assert llama.dense_bytes == 2 * (total - embed)
    assert llama.dense_params == total - embed - head
    assert llama.lm_head_flops == 2 * head and llama.num_experts == 0 and llama.attn_width == 32 * 128
    oss = count_weights(AutoConfig.from_pretrained(CONFIGS / "gpt-oss-20b"), 2)
    assert (oss.num_experts, oss.experts_per_token) == (32, 4)
    assert oss.expert_params > 0.9 * (oss.expert_params + oss.dense_params)


def test_modeled_time_shows_what_prefix_reuse_saves():
    """Long shared prompts reused from the cache compute fewer tokens: the same steps, less modeled time (Llama 3.1
    8B's published config, pools unbacked); slower hardware, more. A tiny preset's prefill is free at any size a
    workload has (its weights' read bounds every step), so a real config it is."""
    model = str(CONFIGS / "llama-3.1-8b-instruct")
    shared = {"requests": 8, "params": {"group_size": 4, "prefix_len": 2048, "question_len": 8, "answer_len": 4}}
    on = simulate(model, "shared-prefix", **shared, **CPU)
    off = simulate(model, "shared-prefix", **shared, kv_cache_config={"enable_block_reuse": False}, **CPU)
    slow = simulate(model, "shared-prefix", **shared, hardware="a100", **CPU)
    (m_on,), (m_off,), (m_slow,) = ([r.metrics for r in rep.results.values()] for rep in (on, off, slow))
    assert m_on.computed_tokens < m_off.computed_tokens
    assert 0 < m_on.modeled_seconds < 0.8 * m_off.modeled_seconds
    assert m_slow.modeled_seconds > m_on.modeled_seconds
    assert on.settings["hardware"] == "H200" and slow.settings["hardware"] == "A100-80GB"


def test_cli_reports_modeled_time_and_refuses_unknown_hardware():
    """``--json`` carries each manager's modeled_seconds; an accelerator kvload does not know is exit 2, one line."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "kvload", "simulate", "tiny-llama", "--workload", "no-reuse", "--requests", "6"]
    done = subprocess.run([*cmd, "--json", "--hardware", "h100"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["settings"]["hardware"] == "H100"
    (result,) = doc["results"].values()
    assert result["modeled_seconds"] > 0 and math.isfinite(result["modeled_seconds"])
    bad = subprocess.run([*cmd, "--hardware", "tpu"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2
    assert "--hardware" in bad.stderr and "h200" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) <= 2  # argparse's usage line, then the one error line


def test_suspends_and_resumes_cost_their_copies_over_the_host_link():
    """V2 moving requests to its host tier and back is not free: the pages cross the host link both ways, and the
    modeled time adds exactly those bytes at the link's bandwidth (the same schedule priced with an infinitely fast
    link is the rest)."""
    from cache_backends.v2 import KVCacheV2Scheduler
    from engine.simulator import replay
    from engine.workloads import make_workload
    from kvload.api import load

    workload = make_workload("long-context", 4, 0, prompt_len=40, answer_len=200)
    link = Hardware("test", 1e12, 1e14, 1e9)
    runs = []
    for hw in (link, attrs.evolve(link, host_bytes_per_s=math.inf)):
        with load("tiny-llama", device="cpu", max_seq_len=256,
                  kv_cache_config={"use_kv_cache_manager_v2": True, "max_tokens": 2 * 256}) as result:
            manager = result.kv_manager  # greedy admission over-admits: suspends are certain
            greedy = KVCacheV2Scheduler(manager, result.args.max_batch_size, result.args.max_num_tokens,
                                        init_ratio=0.0)
            model = StepModel(count_weights(result.context.hf_config, 4), tuple(result.kv.layout.layers), 4, hw)
            m = replay(manager, greedy, workload, step_model=model)
            runs.append((m, manager.host.bytes_stored, manager.host.bytes_loaded))
    (slow, stored, loaded), (free, _, _) = runs
    assert slow.suspends >= 1 and slow.suspends == free.suspends and slow.steps == free.steps
    assert stored > 0 and loaded == stored  # every page suspended came back
    assert slow.modeled_seconds == pytest.approx(free.modeled_seconds + (stored + loaded) / 1e9, rel=1e-5)
