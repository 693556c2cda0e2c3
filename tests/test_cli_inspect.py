"""`kvload explain`, `kvload audit [--verify]` and `kvload models`, run in-process."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvload.explain import field_chain, verify_log
from models import ModelSpec, register_model, unregister_model
from pipeline.audit import AuditLog
from tests.cli_support import read_events, run_cli, write_events

V2 = "kv_cache_config.use_kv_cache_manager_v2"


def plan_log(capsys, tmp_path: Path, *argv: str, name: str = "a.jsonl") -> Path:
    path = tmp_path / name
    r = run_cli(capsys, "plan", *argv, "--audit-log", path)
    assert r.code == 0, r.err
    return path


def steps(chain: dict[str, Any]) -> list[tuple]:
    return [(s["event"], s["stage"], s["source"], s["old"], s["new"]) for s in chain["chain"]]


# --- explain ---------------------------------------------------------------------------------


def test_explain_deepseek_v4_chain_auto_to_true_although_the_model_default_came_first(capsys, tmp_path):
    log = plan_log(capsys, tmp_path, "tiny-deepseek-v4")
    r = run_cli(capsys, "explain", log, "use_kv_cache_manager_v2", "--json")
    assert r.code == 0, r.err
    chain = r.json()[V2]
    assert chain["final"] is True
    assert steps(chain) == [
        ("framework_default", None, "default", None, "auto"),
        ("auto_captured", "snapshot_user_fields", "default", "auto", "auto"),
        ("model_default_applied", "apply_model_defaults", "model_default", "auto", True),
        ("auto_resolved", "resolve_auto", "model_default", True, True),
        ("executor_routed", "route_executor", "route", True, "KVCacheManagerV2 + KVCacheV2Scheduler"),
    ]
    assert "DeepseekV4Spec" in chain["chain"][2]["reason"] and "DeepseekV4Spec" in chain["chain"][3]["reason"]
    text = run_cli(capsys, "explain", log, V2).out
    assert text.splitlines()[0] == f"{V2} = true"
    rows = [line.split() for line in text.splitlines()[2:]]
    assert [row[0] for row in rows] == ["(framework)", "snapshot_user_fields", "apply_model_defaults",
                                        "resolve_auto", "route_executor"]
    assert '"auto" → true' in text.splitlines()[4] and '"auto" → true' in text.splitlines()[5]


def test_explain_shows_file_then_cli_with_the_conflict(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("kv_cache_config:\n  tokens_per_block: 16\n")
    log = plan_log(capsys, tmp_path, "tiny-deepseek-v4", "--config", cfg, "--tokens_per_block", "64")
    chain = field_chain(AuditLog.from_jsonl(log), "kv_cache_config.tokens_per_block")
    assert steps(chain) == [
        ("framework_default", None, "default", None, 32),
        ("args_parsed", "parse_args", "config_file", 32, 16),
        ("args_parsed", "parse_args", "cli", 16, 64),
        ("model_default_skipped", "apply_model_defaults", "cli", 64, 64),
    ]
    assert "overrides 16 from config_file" in chain["chain"][2]["reason"]
    assert "DeepseekV4Spec proposed 128" in chain["chain"][3]["reason"]
    assert chain["final"] == 64


def test_explain_explicit_auto_from_the_command_line(capsys, tmp_path):
    log = plan_log(capsys, tmp_path, "tiny-deepseek-v4", "--use_kv_cache_manager_v2", "auto")
    chain = field_chain(AuditLog.from_jsonl(log), V2)
    assert [s["event"] for s in chain["chain"]] == [
        "framework_default", "args_parsed", "auto_captured", "model_default_skipped", "auto_resolved",
        "executor_routed"]
    assert "explicitly, via cli" in chain["chain"][2]["reason"]
    assert "explicit" in chain["chain"][4]["reason"]


def test_explain_route_fallback_and_ignored_settings(capsys, tmp_path, spec_with_defaults):
    ckpt = spec_with_defaults({"kv_cache_config": {"use_kv_cache_manager_v2": True}}, arch="FallbackForCausalLM")
    log = plan_log(capsys, tmp_path, ckpt, "--max_beam_width", "2", "--host_cache_size", "1GiB")
    audit = AuditLog.from_jsonl(log)
    chain = field_chain(audit, V2)
    assert [s["event"] for s in chain["chain"]][-2:] == ["route_fallback", "executor_routed"]
    assert chain["final"] is False and "beam" in chain["chain"][-2]["reason"]
    host = field_chain(audit, "kv_cache_config.host_cache_size")
    assert host["chain"][-1]["event"] == "setting_ignored" and "V1 has no host tier" in host["chain"][-1]["reason"]


def test_explain_every_changed_field_by_default_and_names_in_any_spelling(capsys, tmp_path):
    log = plan_log(capsys, tmp_path, "tiny-llama", "--kv_cache_fraction", "0.5")
    all_fields = run_cli(capsys, "explain", log, "--json").json()
    assert set(all_fields) == set(AuditLog.from_jsonl(log).changed_fields())
    assert "kv_cache_config.free_gpu_memory_fraction" in all_fields
    for name in ("kv_cache_config.free_gpu_memory_fraction", "free_gpu_memory_fraction", "kv_cache_fraction",
                 "kv-cache-fraction"):
        r = run_cli(capsys, "explain", log, name, "--json")
        assert r.code == 0, (name, r.err)
        assert list(r.json()) == ["kv_cache_config.free_gpu_memory_fraction"]
    untouched = run_cli(capsys, "explain", log, "max_batch_size", "--json").json()["max_batch_size"]
    assert untouched["final"] == 2048 and [s["event"] for s in untouched["chain"]] == ["framework_default"]



@pytest.mark.parametrize(("name", "nearest"), [
    ("gpu_memory_utilization", "kv_cache_config.free_gpu_memory_fraction (or kv_cache_config.max_gpu_total_bytes)"),
    ("gpu-memory-utilization", "kv_cache_config.free_gpu_memory_fraction (or kv_cache_config.max_gpu_total_bytes)"),
    ("swap_space", "kv_cache_config.host_cache_size"),
    ("num_gpu_blocks_override", "kv_cache_config.max_tokens"),
])
def test_explain_of_a_vllm_name_kvload_means_otherwise_names_the_nearest_fields(capsys, tmp_path, name, nearest):
    """max_model_len is explained as max_seq_len; gpu_memory_utilization, which kvload refuses as another meaning,
    got the list of all 38 fields: it now names the fields to explain instead, in one line, exit 2."""
    log = plan_log(capsys, tmp_path, "tiny-llama")
    r = run_cli(capsys, "explain", log, name)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith(f"error: explain: {name} is not an LlmArgs field: vLLM's ")
    assert f": {nearest}" in r.err and r.err.endswith("; explain kvload's field instead\n")
    assert "fields: model" not in r.err


# --- audit -----------------------------------------------------------------------------------


def test_explain_without_arguments_asks_for_the_log_only(capsys):
    """FIELD is optional (default: every changed field); the usage error said it was required too."""
    r = run_cli(capsys, "explain")
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err == "error: the following arguments are required: AUDIT.jsonl\n"


def test_audit_summary_names_model_route_autos_defaults_and_warnings(capsys, tmp_path):
    log = plan_log(capsys, tmp_path, "tiny-deepseek-v4", "--use_kv_cache_manager_v2", "auto",
                   "--tokens_per_block", "64")
    r = run_cli(capsys, "audit", log, "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["model"]["spec"] == "DeepseekV4Spec" and doc["route"]["kv_manager"] == "KVCacheManagerV2"
    autos = {a["field"]: a for a in doc["auto_resolutions"]}
    assert set(autos) == {"device", "dtype", "kv_cache_config.dtype", V2, "attention_backend", "linear_backend",
                          "generation_config", "kv_cache_config.pool_arena"}
    assert autos[V2]["new"] is True and autos[V2]["explicit"] is True and autos[V2]["captured_from"] == "cli"
    assert doc["model_defaults"]["applied"] == []  # the user's two settings win over both model defaults
    assert {d["field"] for d in doc["model_defaults"]["skipped"]} == {V2, "kv_cache_config.tokens_per_block"}
    assert doc["user_fields"]["kv_cache_config.tokens_per_block"] == {"value": 64, "source": "cli"}
    assert doc["outcome"]["finished"] is True and "verify" not in doc
    text = run_cli(capsys, "audit", log).out
    for needle in ("DeepseekV4Spec", "KVCacheManagerV2 + KVCacheV2Scheduler", "skipped",
                   '"auto" (explicit via cli) → true', "warnings:\n  (none)"):
        assert needle in text


def test_audit_summary_says_which_rank_wrote_a_tensor_parallel_log_and_the_heads_each_holds(capsys, tmp_path):
    # a TP run's log records rank_joined; the summary said nothing of the ranks (one process: no line)
    log = plan_log(capsys, tmp_path, "tiny-llama", "--tp_size", "4")
    r = run_cli(capsys, "audit", log)
    assert r.code == 0, r.err
    assert ("ranks   tensor parallel 4, 1 of 4 query heads and 1 of 2 KV heads per rank (each replicated on 2 ranks); "
            "planned in one process: rank 0's view") in r.out.splitlines()
    doc = run_cli(capsys, "audit", log, "--json").json()
    assert (doc["rank"]["rank"], doc["rank"]["tensor_parallel_size"], doc["rank"]["heads"]["mode"]) == (0, 4,
                                                                                                          "replicate")
    one = plan_log(capsys, tmp_path, "tiny-llama", name="one.jsonl")
    assert "ranks   " not in run_cli(capsys, "audit", one).out


def test_audit_lists_warnings(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_batch_size: 4\n")
    log = plan_log(capsys, tmp_path, "tiny-llama", "--config", cfg, "--max_batch_size", "8",
                   "--host_cache_size", "1GiB")
    doc = run_cli(capsys, "audit", log, "--json").json()
    assert [w["event"] for w in doc["warnings"]] == ["source_conflict", "setting_ignored"]
    assert doc["warnings"][0]["message"] == "max_batch_size: cli 8 beats config_file 4"


def test_audit_lists_a_warning_that_came_many_times_once_with_its_count(capsys, tmp_path):
    import kvload

    log = tmp_path / "a.jsonl"  # a long run warns per call (or per request): the same line, again and again
    with kvload.LLM("tiny-llama", device="cpu", log=False, audit_log=log, kv_cache_config={"max_tokens": 256}) as llm:
        for _ in range(3):
            llm.generate([[1, 2, 3]], kvload.SamplingParams(max_tokens=2, min_p=0.1))
    doc = run_cli(capsys, "audit", log, "--json").json()
    ignored = [w for w in doc["warnings"] if w["event"] == "setting_ignored"]
    assert [(w["message"], w["count"]) for w in ignored] == [
        ("generate.min_p: temperature is 0 (greedy): nothing is sampled", 3)]
    assert all(w["count"] == 1 for w in doc["warnings"] if w["event"] != "setting_ignored")
    text = run_cli(capsys, "audit", log).out
    assert text.count("generate.min_p") == 1 and "nothing is sampled  (x3)" in text


def test_audit_verify_passes_and_reports(capsys, tmp_path):
    log = plan_log(capsys, tmp_path, "tiny-gemma3")
    r = run_cli(capsys, "audit", log, "--verify")
    assert r.code == 0 and r.err == ""
    assert "verify  ok: replaying" in r.out
    doc = run_cli(capsys, "audit", log, "--verify", "--json").json()
    assert doc["verify"]["ok"] is True and doc["verify"]["problems"] == []


# audit --verify passes on every log kvload writes ...

PLANS = [
    ("tiny-llama",), ("tiny-mistral",), ("tiny-qwen3",), ("tiny-gemma3",), ("tiny-deepseek-v3",),
    ("tiny-deepseek-v4",),
    ("tiny-llama", "--use_kv_cache_manager_v2", "true"),
    ("tiny-gemma3", "--use-kv-cache-manager-v2", "false", "--max_beam_width", "4"),
    ("tiny-deepseek-v4", "--use_kv_cache_manager_v2", "auto", "--tokens_per_block", "16"),
    ("tiny-deepseek-v3", "--dtype", "bf16", "--kv_cache_dtype", "fp8", "--max_seq_len", "128"),
    ("tiny-qwen3", "--disable_kv_cache_reuse", "--host_cache_size", "0", "--device", "cpu"),
]


@pytest.mark.parametrize("argv", PLANS, ids=" ".join)
def test_verify_passes_on_logs_kvload_writes(capsys, tmp_path, argv):
    log = plan_log(capsys, tmp_path, *argv)
    assert verify_log(AuditLog.from_jsonl(log))["ok"]
    assert run_cli(capsys, "audit", log, "--verify").code == 0


FLAG_VALUES = {
    "--use_kv_cache_manager_v2": st.sampled_from(["auto", "true", "false", "TRUE"]),
    "--tokens_per_block": st.sampled_from(["1", "16", "64", "0"]),
    "--max_beam_width": st.sampled_from(["1", "2"]),
    "--max_batch_size": st.sampled_from(["1", "64"]),
    "--kv_cache_dtype": st.sampled_from(["auto", "fp16", "float32"]),
    "--host_cache_size": st.sampled_from(["0", "1GiB"]),
    "--kv_cache_fraction": st.sampled_from(["0.5", "1", "1.5"]),
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=st.sampled_from(["tiny-llama", "tiny-gemma3", "tiny-deepseek-v4"]),
       flags=st.dictionaries(st.sampled_from(sorted(FLAG_VALUES)), st.none(), max_size=4).flatmap(
           lambda keys: st.fixed_dictionaries({k: FLAG_VALUES[k] for k in keys})),
       disable_reuse=st.booleans())
def test_every_log_verifies_and_a_failed_plan_writes_nothing(capsys, tmp_path_factory, model, flags, disable_reuse):
    tmp = tmp_path_factory.mktemp("prop")
    log = tmp / "a.jsonl"
    argv = ["plan", model, "--audit-log", log, *[w for kv in flags.items() for w in kv]]
    if disable_reuse:
        argv.append("--disable_kv_cache_reuse")
    r = run_cli(capsys, *argv)
    if r.code == 0:
        assert verify_log(AuditLog.from_jsonl(log))["ok"]
    else:
        assert r.code == 2 and r.one_error_line and r.out == ""
        assert list(tmp.iterdir()) == []  # no audit file, no temporary left behind


# ... and fails on a tampered one.


def _tamper_value(records):
    for r in records:
        if r["event"] == "model_default_applied" and r["field"] == "kv_cache_config.tokens_per_block":
            r["new"] = 64
    return records


def _tamper_final(records):
    records[-1]["args"]["kv_cache_config"]["use_kv_cache_manager_v2"] = False
    return records


def _drop_value_event(records):
    return [r for r in records if not (r["event"] == "model_default_applied"
                                       and r["field"] == "kv_cache_config.tokens_per_block")]


def _drop_stage_event(records):
    i = next(i for i, r in enumerate(records) if r["event"] == "stage_started" and r["stage"] == "resolve_auto")
    return records[:i] + records[i + 1:]


def _swap_two(records):
    records[3], records[4] = records[4], records[3]
    return records


def _tamper_route(records):
    records[-1]["route"]["kv_manager"] = "KVCacheManager"
    return records


def _drop_finish(records):
    return records[:-1]


TAMPERS = {
    "value event edited": (_tamper_value, "kv_cache_config.tokens_per_block"),
    "final args edited": (_tamper_final, V2),
    "value event removed": (_drop_value_event, "tokens_per_block"),
    "stage event removed": (_drop_stage_event, "seq"),
    "events reordered": (_swap_two, "reordered"),
    "route edited": (_tamper_route, "route.kv_manager"),
    "closing record removed": (_drop_finish, "no pipeline_finished"),
}


@pytest.mark.parametrize("name", TAMPERS)
def test_verify_fails_on_a_tampered_log(capsys, tmp_path, name):
    tamper, culprit = TAMPERS[name]
    log = plan_log(capsys, tmp_path, "tiny-deepseek-v4")
    records = read_events(log)
    write_events(log, [records[0], *tamper(copy.deepcopy(records[1:]))])
    check = verify_log(AuditLog.from_jsonl(log))
    assert not check["ok"] and any(culprit in p for p in check["problems"]), check["problems"]
    r = run_cli(capsys, "audit", log, "--verify")
    assert r.code == 1 and r.one_error_line and "does not verify" in r.err and culprit in r.err + r.out
    assert "verify  FAILED" in r.out
    assert run_cli(capsys, "audit", log).code == 0  # without --verify it is only a summary


# --- models ----------------------------------------------------------------------------------


def test_models_lists_specs_defaults_and_presets(capsys):
    r = run_cli(capsys, "models", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    rows = {row["architecture"]: row for row in doc["architectures"]}
    assert rows["DeepseekV4ForCausalLM"]["spec"] == "DeepseekV4Spec"
    assert rows["DeepseekV4ForCausalLM"]["model_defaults"] == {
        V2: True, "kv_cache_config.tokens_per_block": 128}
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM", "DeepseekV3ForCausalLM"):
        assert rows[arch]["model_defaults"] == {} and rows[arch]["error"] is None
    assert {p["name"] for p in doc["presets"]} >= {"tiny-llama", "tiny-deepseek-v4"}
    assert doc["fallback_spec"] == "GenericDecoderSpec"
    text = run_cli(capsys, "models").out
    assert "DeepseekV4Spec" in text and f"{V2} = true" in text and "tiny-gemma3" in text


def test_models_survives_a_broken_user_spec(capsys):
    @register_model("BrokenForCausalLM")
    class BrokenSpec(ModelSpec):
        def get_model_defaults(self, args):
            return {"kv_cache_config": {"tokens_per_block": self.hf_config.block}}

    @register_model("InvalidForCausalLM")
    class InvalidSpec(ModelSpec):
        def get_model_defaults(self, args):
            return {"kv_cache_config": {"tokens_per_blok": 4}}

    try:
        r = run_cli(capsys, "models", "--json")
        text = run_cli(capsys, "models").out
    finally:
        unregister_model("BrokenForCausalLM", "InvalidForCausalLM")
    assert r.code == 0, r.err
    rows = {row["architecture"]: row for row in r.json()["architectures"]}
    assert rows["BrokenForCausalLM"]["model_defaults"] is None
    assert "BrokenSpec.get_model_defaults raised AttributeError" in rows["BrokenForCausalLM"]["error"]
    assert "did you mean 'kv_cache_config.tokens_per_block'" in rows["InvalidForCausalLM"]["error"]
    assert rows["DeepseekV4ForCausalLM"]["error"] is None
    assert "error: BrokenSpec.get_model_defaults raised AttributeError" in text


# --- failures that are not the user's input ----------------------------------------------------


def test_unexpected_failure_is_one_line_exit_1_and_debug_shows_the_traceback(capsys, tmp_path, monkeypatch):
    log = plan_log(capsys, tmp_path, "tiny-llama")

    def boom(*_a, **_k):
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setattr("kvload.explain.summarize", boom)
    r = run_cli(capsys, "audit", log)
    assert r.code == 1 and r.one_error_line and r.out == ""
    assert r.err == "error: RuntimeError: disk on fire (run with --debug for the traceback)\n"
    debug = run_cli(capsys, "audit", log, "--debug")
    assert debug.code == 1 and debug.err.startswith("Traceback") and 'raise RuntimeError("disk on fire' in debug.err
    assert debug.err.splitlines()[-1] == "error: RuntimeError: disk on fire"
