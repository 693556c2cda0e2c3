"""`kvload run` and the KV section of `kvload plan --json`, through a subprocess."""

from __future__ import annotations

import json

import pytest

from tests.cli_support import kvload_process as kvload


def test_run_builds_v1_and_prints_the_plan_and_what_was_allocated(tmp_path):
    audit = tmp_path / "run.jsonl"
    r = kvload("run", "tiny-llama", "--device", "cpu", "--max_tokens", "4096", "--audit-log", str(audit))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "route  KVCacheManager + GuaranteedNoEvictScheduler" in out
    assert "kv cache  KVCacheManager (v1) on cpu, float32, 32 tokens/block" in out
    assert "budget  4,194,304 B (set by kv_cache_config.max_tokens)" in out
    assert "capacity  4,096 tokens" in out
    allocated = out[out.index("allocated  KVCacheManager + GuaranteedNoEvictScheduler on cpu"):]
    assert "uniform  4×128×32×64" in allocated and "total 4,194,304 B" in allocated
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert records[-1]["event"] == "pipeline_finished"
    assert [r["event"] for r in records].count("kv_manager_built") == 1


def test_run_json_adds_the_allocation_to_the_plan_document():
    r = kvload("run", "tiny-gemma3", "--device", "cpu", "--max_seq_len", "1024", "--max_tokens", "2048", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"model", "args", "provenance", "route", "sampling_defaults", "kv", "allocated"}
    kv, allocated = doc["kv"], doc["allocated"]
    (group,) = kv["layer_groups"]
    assert group["name"] == "uniform" and group["blocks"] == 2048 // 32
    assert allocated["pools"]["uniform"]["blocks"] == group["blocks"]
    assert allocated["total_bytes"] == kv["total_bytes"] == group["blocks"] * group["bytes_per_block"]
    assert allocated["stats"]["groups"]["uniform"]["free"] == group["blocks"]


def test_plan_json_reports_kv_geometry_with_null_budget_on_cpu():
    r = kvload("plan", "tiny-gemma3", "--device", "cpu", "--use_kv_cache_manager_v2", "true", "--json")
    assert r.returncode == 0, r.stderr
    kv = json.loads(r.stdout)["kv"]
    assert kv["budget_bytes"] is None and kv["capacity_tokens"] is None
    assert kv["bytes_per_token"] == 256.0
    # equal pages: the five sliding layers become five 1-layer groups sharing one arena with the full one
    assert [(g["name"], g["kind"], g["layers"], g["window"], g["blocks"]) for g in kv["layer_groups"]] == [
        *[(f"sliding_w512.{i}", "sliding", [i], 512, None) for i in range(5)], ("full", "full", [5], None, None)]
    assert kv["memory"]["shared"] and kv["memory"]["arena_blocks"] is None  # no budget, no pages yet


@pytest.mark.parametrize(
    ("args", "first_line"),
    [
        (["--device", "cpu"], "error: no KV cache budget: cpu has no free-memory rule to size it from; "
                              "set kv_cache_config.max_tokens or kv_cache_config.max_gpu_total_bytes"),
        (["--device", "cpu", "--max_gpu_total_bytes", "1KB"], "error: KV budget 1000 B (max_gpu_total_bytes caps"),
    ],
)
def test_run_without_a_usable_budget_fails_in_one_line_with_exit_2(args, first_line):
    r = kvload("run", "tiny-llama", *args)
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.startswith(first_line) and r.stderr.count("\n") == 1
