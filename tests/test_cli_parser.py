"""The plan/run flags: the tri-state in every spelling, absent vs explicit auto, every flag → its field."""

from __future__ import annotations

import json

import pytest

from kvload.cli.commands import build_parser
from kvload.cli.flags import FLAGS, cli_overrides
from pipeline.paths import flatten, get_in
from tests.cli_support import read_events, run_cli

V2 = "kv_cache_config.use_kv_cache_manager_v2"


def overrides(*argv: str) -> dict:
    return cli_overrides(build_parser().parse_args(["plan", "tiny-llama", *argv]))


@pytest.mark.parametrize(
    ("word", "value"),
    [("auto", "auto"), ("AUTO", "auto"), ("Auto", "auto"), ("true", True), ("True", True), ("TRUE", True),
     ("false", False), ("False", False), ("FALSE", False)],
)
@pytest.mark.parametrize("spelling", ["--use_kv_cache_manager_v2", "--use-kv-cache-manager-v2"])
def test_tri_state_every_spelling(word, value, spelling):
    for argv in ([spelling, word], [f"{spelling}={word}"]):
        got = overrides(*argv)["kv_cache_config"]["use_kv_cache_manager_v2"]
        assert got == value and type(got) is type(value)  # True, never the string "true"


def test_absent_flags_are_absent_not_defaults():
    assert overrides() == {}
    assert overrides("--max_batch_size", "4") == {"max_batch_size": 4}


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-deepseek-v4"])
def test_absent_and_explicit_auto_differ_only_in_the_audit_log(capsys, tmp_path, preset):
    absent, explicit = tmp_path / "absent.jsonl", tmp_path / "explicit.jsonl"
    a = run_cli(capsys, "plan", preset, "--json", "--audit-log", absent)
    e = run_cli(capsys, "plan", preset, "--json", "--audit-log", explicit, "--use_kv_cache_manager_v2", "auto")
    assert a.code == e.code == 0, (a.err, e.err)
    assert a.json()["args"] == e.json()["args"] and a.json()["route"] == e.json()["route"]

    def v2_events(path):
        return [r for r in read_events(path) if r.get("field") == V2]

    captured_a = next(r for r in v2_events(absent) if r["event"] == "auto_captured")
    captured_e = next(r for r in v2_events(explicit) if r["event"] == "auto_captured")
    assert (captured_a["explicit"], captured_a["source"]) == (False, "default")
    assert (captured_e["explicit"], captured_e["source"]) == (True, "cli")
    assert not any(r["event"] == "args_parsed" for r in v2_events(absent))
    parsed = [r for r in v2_events(explicit) if r["event"] == "args_parsed"]
    assert [(r["source"], r["old"], r["new"]) for r in parsed] == [("cli", "auto", "auto")]
    snap = next(r for r in read_events(explicit) if r["event"] == "user_fields_snapshotted")
    assert snap["fields"][V2] == {"value": "auto", "source": "cli"}
    if preset == "tiny-deepseek-v4":  # explicit auto lets the model decide, through resolve_auto
        events = {r["event"] for r in v2_events(explicit)}
        assert "model_default_skipped" in events and "model_default_applied" not in events
        assert {r["event"] for r in v2_events(absent)} >= {"model_default_applied"}


#: One sample per flag: the text typed, and the value the field must then hold.
SAMPLES = {
    "--use_kv_cache_manager_v2": (["true"], True),
    "--kv_cache_free_gpu_memory_fraction": (["0.5"], 0.5),
    "--max_tokens": (["4096"], 4096),
    "--max_gpu_total_bytes": (["1GiB"], 1 << 30),
    "--tokens_per_block": (["64"], 64),
    "--disable_kv_cache_reuse": ([], False),
    "--enable_prefix_caching": ([], True),
    "--host_cache_size": (["512MiB"], 512 << 20),
    "--event_buffer_max_size": (["1000"], 1000),
    "--pool_arena": (["true"], True),
    "--max_page_padding": (["0.1"], 0.1),
    "--kv_cache_dtype": (["bf16"], "bfloat16"),
    "--attention_backend": (["flex"], "flex"),
    "--linear_backend": (["torch"], "torch"),
    "--max_draft_len": (["4"], 4),
    "--max_matching_ngram_size": (["3"], 3),
    "--speculation_max_batch_size": (["2"], 2),
    "--dtype": (["fp16"], "float16"),
    "--device": (["cpu"], "cpu"),
    "--max_batch_size": (["8"], 8),
    "--max_seq_len": (["512"], 512),
    "--max_num_tokens": (["256"], 256),
    "--max_beam_width": (["2"], 2),
    "--scheduling_policy": (["priority"], "priority"),
    "--tp_size": (["2"], 2),
    "--generation_config": (["vllm"], "vllm"),
    # a JSON object: each of its keys lands in its own leaf (override_generation_config.top_k)
    "--override_generation_config": (['{"top_k": 5}'], {"top_k": 5}),
}


def test_every_flag_has_a_sample():
    assert set(SAMPLES) == {f.name for f in FLAGS}


@pytest.mark.parametrize("dashed", [False, True], ids=["underscore", "dashed"])
@pytest.mark.parametrize("flag", FLAGS, ids=lambda f: f.name)
def test_every_flag_lands_in_its_field_with_source_cli(capsys, tmp_path, flag, dashed):
    words, want = SAMPLES[flag.name]
    name = "--" + flag.name[2:].replace("_", "-") if dashed else flag.name
    log = tmp_path / "a.jsonl"
    r = run_cli(capsys, "plan", "tiny-llama", name, *words, "--json", "--audit-log", log)
    assert r.code == 0, r.err
    doc = r.json()
    leaves = flatten({flag.path: want})
    for path, value in leaves.items():
        assert get_in(doc["args"], path) == value
        first = doc["provenance"][path][0]
        assert (first["event"], first["source"], first["new"]) == ("args_parsed", "cli", value)
    parsed = [e for e in read_events(log) if e["event"] == "args_parsed"]
    # exactly the model and this flag came from the command line, nothing else
    assert {e["field"]: e["source"] for e in parsed} == {"model": "cli", **dict.fromkeys(leaves, "cli")}


def test_cli_beats_config_file_with_a_source_conflict(capsys, tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max_batch_size: 4\nkv_cache_config:\n  tokens_per_block: 16\n  enable_block_reuse: true\n")
    log = tmp_path / "a.jsonl"
    r = run_cli(capsys, "plan", "tiny-llama", "--config", cfg, "--tokens_per_block", "64",
                "--disable-kv-cache-reuse", "--json", "--audit-log", log)
    assert r.code == 0, r.err
    args = flatten(r.json()["args"])
    assert args["max_batch_size"] == 4 and args["kv_cache_config.tokens_per_block"] == 64
    assert args["kv_cache_config.enable_block_reuse"] is False
    conflicts = {e["field"]: e for e in read_events(log) if e["event"] == "source_conflict"}
    assert set(conflicts) == {"kv_cache_config.tokens_per_block", "kv_cache_config.enable_block_reuse"}
    c = conflicts["kv_cache_config.tokens_per_block"]
    assert (c["kept"], c["kept_source"], c["overridden"], c["overridden_source"]) == (64, "cli", 16, "config_file")
    assert "source_conflict" in r.err  # the warning is logged on stderr; stdout stays one JSON document
    chain = r.json()["provenance"]["kv_cache_config.tokens_per_block"]
    assert [(s["source"], s["new"]) for s in chain] == [("config_file", 16), ("cli", 64)]


@pytest.mark.parametrize(("argv", "typed", "meant"), [
    (("plan", "tiny-llama", "--max_tok", "5"), "--max_tok", "--max_tokens"),
    (("plan", "tiny-llama", "--host_", "0"), "--host_", None),  # a prefix of --host_cache_size
    (("generate", "tiny-llama", "--prompt-ids", "1", "--max_new", "3"), "--max_new", "--max_new_tokens"),
])
def test_an_abbreviated_flag_is_refused_not_expanded(capsys, argv, typed, meant):
    """YAML and Python refuse a key that is only a prefix of a field; so does the command line (argparse expanded
    it silently, so `--host_ 0` set host_cache_size)."""
    r = run_cli(capsys, *argv)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith(f"error: unrecognized arguments: {typed}"), r.err
    if meant:
        assert f"did you mean {meant}?" in r.err


@pytest.mark.parametrize(("argv", "named"), [
    (("plan", "tiny-llama", "--max_tokens", "1", "--max_tokens", "2"), "--max_tokens"),
    (("plan", "tiny-llama", "--max_tokens", "64", "--max-tokens=64"), "--max_tokens"),  # an alias, the same value
    (("plan", "tiny-llama", "--kv_cache_fraction", "0.5", "--kv_cache_free_gpu_memory_fraction", "0.6"),
     "--kv_cache_fraction"),
    (("generate", "tiny-llama", "--prompt-ids", "1", "--seed", "1", "--seed", "2"), "--seed"),
    (("simulate", "tiny-llama", "--workload", "no-reuse", "--progress", "--no-progress"), "--progress"),
])
def test_a_flag_given_twice_is_refused_naming_both_spellings(capsys, argv, named):
    """argparse kept the last value and dropped the first without a word; YAML refuses a key given twice too."""
    r = run_cli(capsys, *argv)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith(f"error: {named}: given more than once"), r.err


@pytest.mark.parametrize(("argv", "line"), [
    (("plan", "-tiny-llama"),
     "unrecognized arguments: -tiny-llama; did you mean the model tiny-llama? (MODEL takes no leading dash)"),
    (("serve", "--smollm2-135m"),  # serve's own MODEL check (MODEL may come after --api-key) says it the same way
     "unrecognized arguments: --smollm2-135m; did you mean the model smollm2-135m? (MODEL takes no leading dash)"),
    (("plan", "-frob"), "unrecognized arguments: -frob (and the following arguments are required: MODEL)"),
    (("plan", "--max-tokns", "5"),  # 5 was taken for MODEL: argparse's own line, with its suggestion
     "unrecognized arguments: --max-tokns; did you mean --max-tokens?"),
    (("--frob",), "unrecognized arguments: --frob (and the following arguments are required: COMMAND)"),
], ids=["dashed-preset", "serve-dashed-packaged", "unknown-and-no-model", "unknown-with-model", "no-command"])
def test_an_unknown_option_is_named_even_when_model_is_missing(capsys, argv, line):
    """argparse checks required arguments first: ``plan -tiny-llama`` said "the following arguments are required:
    MODEL", never naming the option it did not know, which was where MODEL had gone (a stray dash)."""
    r = run_cli(capsys, *argv)
    assert (r.code, r.err) == (2, f"error: {line}\n")


@pytest.mark.parametrize(("flag", "value"), [("--json", "true"), ("--disable-kv-cache-reuse", "1"), ("--force", "")])
def test_a_switch_given_a_value_says_it_takes_none(capsys, flag, value):
    """argparse's line was "--json: ignored explicit argument 'true'", which says neither what is wrong nor what is
    accepted (and the value was not ignored: the run stopped)."""
    r = run_cli(capsys, "plan", "tiny-llama", f"{flag}={value}")
    assert r.code == 2 and r.one_error_line
    assert r.err == f"error: {flag}: a switch, it takes no value (got {value!r}); give {flag} alone\n"


def test_repeatable_flags_and_switches_still_repeat(capsys):
    r = run_cli(capsys, "generate", "tiny-llama", "--prompt-ids", "1,2", "--prompt-ids", "3", "--stop_token_ids", "5",
                "--max_new_tokens", "2", "--ignore_eos", "--ignore_eos", "--json", "--json")
    assert r.code == 0, r.err
    assert len(r.json()["outputs"]) == 2


def test_log_format_json_keeps_stdout_a_json_document(capsys):
    r = run_cli(capsys, "plan", "tiny-llama", "--json", "--log-format", "json", "--log-level", "info")
    assert r.code == 0
    assert r.json()["route"]["kv_manager"] == "KVCacheManager"
    events = [json.loads(line) for line in r.err.splitlines()]
    assert [e["event"] for e in events][:2] == ["stage_started", "args_parsed"]
    assert any(e["event"] == "auto_resolved" and e["field"] == V2 for e in events)


@pytest.mark.parametrize("given, shows_info", [("verbose", True), ("trace", True), ("INFO", True),
                                               ("internal_error", False), ("critical", False)])
def test_trtllm_serves_and_uvicorns_log_levels_act_as_the_nearest(capsys, given, shows_info):
    """trtllm-serve's ``--log_level verbose`` (and trace, internal_error; uvicorn's critical) was argparse's "invalid
    choice" (exit 2): each is now kvload's nearest level, any case."""
    r = run_cli(capsys, "plan", "tiny-llama", "--log_level", given)
    assert r.code == 0, r.err
    assert ("stage_started" in r.err) is shows_info
    bad = run_cli(capsys, "plan", "tiny-llama", "--log_level", "loud")
    assert bad.code == 2 and "--log_level: invalid choice: 'loud'" in bad.err


def test_default_log_level_shows_warnings_only_on_success(capsys):
    ok = run_cli(capsys, "plan", "tiny-llama", "--host_cache_size", "1GiB")
    assert ok.code == 0 and "setting_ignored" in ok.err and "host_cache_size" in ok.err
    assert "stage_started" not in ok.err
