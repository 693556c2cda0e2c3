"""The CLI end to end through real processes: plan → audit log → explain → audit --verify, models, run."""

from __future__ import annotations

import json

import pytest

import pipeline
import stages
from tests.cli_support import kvload, read_events, write_events

V2 = "kv_cache_config.use_kv_cache_manager_v2"


def test_deepseek_v4_walkthrough(tmp_path):
    log = tmp_path / "v4.jsonl"
    plan = kvload("plan", "tiny-deepseek-v4", "--audit-log", log)
    assert plan.code == 0, plan.err
    assert "KVCacheManagerV2 + KVCacheV2Scheduler" in plan.out and log.is_file()

    explain = kvload("explain", log, "use_kv_cache_manager_v2")
    assert explain.code == 0, explain.err
    lines = explain.out.splitlines()
    assert lines[0] == f"{V2} = true"
    body = "\n".join(lines[2:])
    # default "auto" → model default true → auto_resolved "auto" → true → route, in this order
    order = ['(framework)           default        "auto"',
             'apply_model_defaults  model_default  "auto" → true',
             'resolve_auto          model_default  "auto" → true',
             "route_executor        route          true → KVCacheManagerV2 + KVCacheV2Scheduler"]
    positions = [body.find(step) for step in order]
    assert -1 not in positions and positions == sorted(positions), explain.out

    audit = kvload("audit", log, "--verify")
    assert audit.code == 0 and audit.err == "", audit.err
    assert "verify  ok" in audit.out and "DeepseekV4Spec" in audit.out


def test_checkpoint_directory_with_config_file_and_flags(tmp_path, checkpoint_dir):
    ckpt = checkpoint_dir("MyLlamaForCausalLM")  # unregistered: the generic spec, with a warning
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max_batch_size: 4\nkv_cache_config:\n  tokens_per_block: 16\n")
    log = tmp_path / "ckpt.jsonl"
    r = kvload("plan", ckpt, "--config", cfg, "--tokens-per-block", "8", "--use_kv_cache_manager_v2", "true",
               "--json", "--audit-log", log)
    assert r.code == 0, r.err
    doc = json.loads(r.out)  # stdout is exactly one JSON document; the warning went to stderr
    assert set(doc) == {"model", "args", "provenance", "route", "sampling_defaults", "kv"}
    assert doc["model"]["kind"] == "directory" and doc["model"]["spec"] == "GenericDecoderSpec"
    assert doc["args"]["max_batch_size"] == 4 and doc["args"]["kv_cache_config"]["tokens_per_block"] == 8
    assert doc["route"]["kv_manager"] == "KVCacheManagerV2"
    assert "model_spec_fallback" in r.err and "source_conflict" in r.err

    chains = json.loads(kvload("explain", log, "tokens_per_block", "max_batch_size", "--json").out)
    assert [s["source"] for s in chains["kv_cache_config.tokens_per_block"]["chain"]] == [
        "default", "config_file", "cli"]
    assert [s["source"] for s in chains["max_batch_size"]["chain"]] == ["default", "config_file"]

    summary = kvload("audit", log, "--verify", "--json")
    assert summary.code == 0, summary.err
    doc = json.loads(summary.out)
    assert doc["verify"]["ok"] is True
    assert {w["event"] for w in doc["warnings"]} == {"model_spec_fallback", "source_conflict"}


def test_tampered_log_fails_verify_with_exit_1(tmp_path):
    log = tmp_path / "a.jsonl"
    pipeline.plan("tiny-llama", audit_log=log, log=False)
    records = read_events(log)
    for r in records:
        if r["event"] == "auto_resolved" and r["field"] == V2:
            r["new"] = True  # claim "auto" resolved to true
    write_events(log, records)
    r = kvload("audit", log, "--verify")
    assert r.code == 1
    assert r.err.count("\n") == 1 and r.err.startswith(f"error: {log}: does not verify: {V2}")
    assert "verify  FAILED" in r.out


def test_models_and_help_stay_light():
    models = kvload("models", python_flags=("-X", "importtime"))
    assert models.code == 0
    assert "DeepseekV4ForCausalLM" in models.out and "DeepseekV4Spec" in models.out
    imported = {line.rsplit("|", 1)[-1].strip() for line in models.err.splitlines() if "|" in line}
    assert "kvload.catalog" in imported  # the measurement saw our modules
    assert not {m for m in imported if m.split(".")[0] in ("torch", "transformers")}

    doc = json.loads(kvload("models", "--json").out)
    assert any(r["architecture"] == "Gemma3ForCausalLM" for r in doc["architectures"])

    top = kvload("--help")
    assert top.code == 0
    for word in ("plan", "explain", "audit", "models", "examples:", "exit status"):
        assert word in top.out
    sub = kvload("explain", "--help")
    assert sub.code == 0 and "framework default" in sub.out and "FIELD" in sub.out


# --- run: turns on once build_kv_manager is merged --------------------------------------------

needs_run = pytest.mark.skipif(not hasattr(stages, "BuildKvManager"),
                               reason="the run subcommand arrives with stages.BuildKvManager")


@needs_run
@pytest.mark.parametrize(("model", "manager"), [("tiny-llama", "KVCacheManager"),
                                                ("tiny-deepseek-v4", "KVCacheManagerV2")])
def test_run_then_explain_and_verify(tmp_path, model, manager):
    log = tmp_path / "run.jsonl"
    r = kvload("run", model, "--max_tokens", "4096", "--json", "--audit-log", log)
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert doc["route"]["kv_manager"] == manager and doc["kv"]
    assert kvload("audit", log, "--verify").code == 0
    chain = json.loads(kvload("explain", log, V2, "--json").out)[V2]["chain"]
    assert chain[-1]["event"] == "executor_routed" and manager in chain[-1]["new"]
    assert "kv_manager_built" in {e["event"] for e in read_events(log)}


@needs_run
def test_run_on_a_checkpoint_directory_prints_the_table(checkpoint_dir):
    r = kvload("run", checkpoint_dir(), "--max_tokens", "4096")
    assert r.code == 0, r.err
    assert "KVCacheManager + GuaranteedNoEvictScheduler" in r.out


@needs_run
def test_failed_run_writes_nothing(tmp_path):
    log = tmp_path / "run.jsonl"
    r = kvload("run", "tiny-deepseek-v4", "--max_tokens", "4096", "--use_kv_cache_manager_v2", "false",
               "--audit-log", log)
    assert r.code == 2 and r.out == "" and r.err.count("\n") == 1 and "use_kv_cache_manager_v2" in r.err
    assert list(tmp_path.iterdir()) == []


@needs_run
def test_run_without_a_budget_on_cpu_says_which_flags(tmp_path):
    log = tmp_path / "run.jsonl"
    r = kvload("run", "tiny-llama", "--device", "cpu", "--audit-log", log)
    assert r.code == 2 and r.out == "" and r.err.count("\n") == 1, r.err
    assert "max_tokens" in r.err or "max_gpu_total_bytes" in r.err
    assert list(tmp_path.iterdir()) == []
