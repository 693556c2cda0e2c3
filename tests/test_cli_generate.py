"""``kvload generate``: streamed output, the throughput line, --json, the audit log, one-line errors."""

from __future__ import annotations

import json

import pytest

import pipeline
from kvload.explain import verify_log
from pipeline.audit import AuditLog
from tests.cli_support import kvload, read_events, run_cli
from tests.conftest import needs_smollm2

TINY = ("generate", "tiny-llama", "--device", "cpu")


def api_tokens(prompts: list[list[int]], n: int, sampling: dict | None = None, **kv) -> list[list[int]]:
    """What the Python API generates for the preset (same seeded random weights); ``sampling``: more settings."""
    with pipeline.load("tiny-llama", load_weights=True, device="cpu", kv_cache_config={"max_tokens": 512, **kv},
                       log=False) as result:
        return [o.token_ids for o in result.generate(prompts, max_new_tokens=n, ignore_eos=True, **(sampling or {}))]


def test_one_prompt_streams_token_ids_then_the_throughput_line(capsys):
    r = run_cli(capsys, *TINY, "--prompt-ids", "1,2,3,4", "--max_new_tokens", "5", "--ignore_eos")
    assert r.code == 0, r.err
    tokens, stats = r.out.rstrip("\n").split("\n")
    assert [int(t) for t in tokens.split()] == api_tokens([[1, 2, 3, 4]], 5)[0]
    assert stats.startswith("-- 1 prompt: 4 prompt tokens (0 reused), 5 generated in ")
    assert "5 steps" in stats and "generated tokens/s" in stats


def test_several_prompts_print_each_reply_with_its_index(capsys):
    r = run_cli(capsys, *TINY, "--prompt-ids", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
                "--prompt-ids", "7,8", "--max_new_tokens", "3", "--ignore_eos", "--use_kv_cache_manager_v2", "true",
                "--max_num_tokens", "8")
    assert r.code == 0, r.err
    lines = r.out.rstrip("\n").split("\n")
    expected = api_tokens([list(range(1, 21)), [7, 8]], 3, use_kv_cache_manager_v2=True)
    assert sorted(lines[:2]) == [f"[{i}] " + " ".join(map(str, ids)) for i, ids in enumerate(expected)]
    assert lines[2].startswith("-- 2 prompts: 22 prompt tokens (0 reused), 6 generated in ")


def test_cpu_without_a_budget_gets_generates_default_and_the_audit_log_says_why(capsys, tmp_path):
    audit = tmp_path / "gen.jsonl"
    r = run_cli(capsys, *TINY, "--prompt-ids", "5,6,7", "--max_new_tokens", "4", "--audit-log", audit)
    assert r.code == 0, r.err
    events = read_events(audit)
    budget = next(e for e in events if e["event"] == "kv_budget_computed")
    assert budget["max_tokens"] == 1 * (4 + 1024) and budget["limited_by"] == "max_tokens"
    assert "kv_cache_config.default_max_tokens=1028 applies" in budget["reason"]
    names = [e["event"] for e in events]
    assert names[names.index("pipeline_finished") + 1:] == [
        "generation_started", "request_admitted", "request_finished", "generation_finished"]
    log = AuditLog.from_jsonl(audit)
    assert verify_log(log)["ok"]
    assert log.final_args()["kv_cache_config"]["max_tokens"] is None  # the user's args are untouched
    # the default budget is an argument like any other: recorded, and replayed by --verify
    assert log.final_args()["kv_cache_config"]["default_max_tokens"] == 1028
    check = run_cli(capsys, "audit", audit, "--verify")
    assert check.code == 0, check.out + check.err


def test_generates_pool_default_is_recorded_as_derived_not_as_the_users(capsys, tmp_path):
    # the default generate derives from its flags is not a user setting: no user field, no source "cli"
    audit = tmp_path / "gen.jsonl"
    r = run_cli(capsys, *TINY, "--prompt-ids", "5,6,7", "--max_new_tokens", "4", "--audit-log", audit)
    assert r.code == 0, r.err
    events = read_events(audit)
    (snapshot,) = [e for e in events if e["event"] == "user_fields_snapshotted"]
    assert "kv_cache_config.default_max_tokens" not in snapshot["fields"]
    assert not [e for e in events if e["event"] == "args_parsed" and "default_max_tokens" in e["field"]]
    (derived,) = [e for e in events if e["event"] == "field_derived" and e["field"].endswith("default_max_tokens")]
    assert derived["source"] == "generate" and derived["new"] == 1028 and "--max_new_tokens" in derived["reason"]
    explained = run_cli(capsys, "explain", audit, "default_max_tokens")
    assert explained.code == 0 and "generate" in explained.out and "command line" not in explained.out
    summary = run_cli(capsys, "audit", audit)  # the summary lists it apart from what the user set
    assert summary.code == 0 and "default_max_tokens" not in summary.out.split("\n")[2]
    derived = summary.out.split("derived (null fields filled in, not by the user):")[1]
    assert "kv_cache_config.default_max_tokens  1028   generate" in derived


def test_a_config_files_default_max_tokens_wins_over_generates_own(capsys, tmp_path):
    config = tmp_path / "kv.yaml"
    config.write_text("kv_cache_config:\n  default_max_tokens: 5000\n")
    audit = tmp_path / "gen.jsonl"
    r = run_cli(capsys, *TINY, "--prompt-ids", "5,6,7", "--max_new_tokens", "4", "--config", config,
                "--audit-log", audit)
    assert r.code == 0, r.err
    events = read_events(audit)
    assert not [e for e in events if e["event"] in ("source_conflict", "field_derived")
                and "default_max_tokens" in e["field"]]
    (snapshot,) = [e for e in events if e["event"] == "user_fields_snapshotted"]
    assert snapshot["fields"]["kv_cache_config.default_max_tokens"] == {"value": 5000, "source": "config_file"}
    (budget,) = [e for e in events if e["event"] == "kv_budget_computed"]
    assert budget["max_tokens"] == 5000


@pytest.mark.parametrize("where", ["flag", "config"])
def test_a_huge_max_new_tokens_sizes_the_pools_for_max_seq_len_as_the_api_runs_it(capsys, tmp_path, where):
    # every sample stops at max_seq_len, so the pools never need more than n sequences of it per prompt
    audit = tmp_path / "gen.jsonl"
    seq = ["--max_seq_len", "32"]
    if where == "config":
        config = tmp_path / "seq.yaml"
        config.write_text("max_seq_len: 32\n")
        seq = ["--config", str(config)]
    r = run_cli(capsys, *TINY, "--prompt-ids", "1,2", "--prompt-ids", "3,4,5", "--n", "2", "--temperature", "1",
                "--max_new_tokens", "1000000000", *seq, "--ignore_eos", "--json", "--audit-log", audit)
    assert r.code == 0, r.err
    samples = [c for o in r.json()["outputs"] for c in o["outputs"]]
    assert [(c["finish_reason"], len(c["token_ids"])) for c in samples] == [("length", 30)] * 2 + [("length", 29)] * 2
    (derived,) = [e for e in read_events(audit) if e["event"] == "field_derived"
                  and e["field"].endswith("default_max_tokens")]
    assert derived["new"] == 2 * 2 * 32 and "n x max_seq_len" in derived["reason"]


def test_the_config_file_is_read_once_so_the_pools_and_the_run_agree(capsys, tmp_path, monkeypatch):
    """generate read --config for its pool size (max_seq_len), then parse_args read it again: a file saved in
    between (an editor, a generator script) sized the pools for one max_seq_len and ran with another. The file is
    rewritten right after its first read here; the run must use what that read saw, everywhere, and read it once."""
    import pipeline.textfile

    config = tmp_path / "seq.yaml"
    config.write_text("max_seq_len: 32\n")
    reads = []
    read_opened = pipeline.textfile.read_opened

    def read_then_change(path, fd, limit):
        data = read_opened(path, fd, limit)
        if path == config:
            reads.append(data)
            config.write_text("max_seq_len: 64\n")
        return data

    monkeypatch.setattr(pipeline.textfile, "read_opened", read_then_change)
    audit = tmp_path / "gen.jsonl"
    r = run_cli(capsys, *TINY, "--prompt-ids", "1,2", "--n", "2", "--temperature", "1", "--max_new_tokens",
                "1000000000", "--config", config, "--ignore_eos", "--json", "--audit-log", audit)
    assert r.code == 0, r.err
    assert reads == [b"max_seq_len: 32\n"]
    events = read_events(audit)
    (parsed,) = [e for e in events if e["event"] == "args_parsed" and e["field"] == "max_seq_len"]
    (derived,) = [e for e in events if e["event"] == "field_derived" and e["field"].endswith("default_max_tokens")]
    assert (parsed["new"], derived["new"]) == (32, 2 * 32)
    assert [len(c["token_ids"]) for o in r.json()["outputs"] for c in o["outputs"]] == [30, 30]


def test_logprobs_print_under_each_reply_without_json(capsys):
    flags = ("--prompt-ids", "9,9,9", "--max_new_tokens", "3", "--ignore_eos", "--max_tokens", "256", "--logprobs", "2")
    doc = run_cli(capsys, *TINY, *flags, "--json")
    assert doc.code == 0, doc.err
    (sample,) = doc.json()["outputs"][0]["outputs"]
    r = run_cli(capsys, *TINY, *flags)
    assert r.code == 0, r.err
    reply, header, *rows, stats = r.out.rstrip("\n").split("\n")
    assert [int(t) for t in reply.split()] == sample["token_ids"] and stats.startswith("-- 1 prompt")
    assert header == "logprobs: token logprob | top alternatives" and len(rows) == 3
    for row, token, entry in zip(rows, sample["token_ids"], sample["logprobs"], strict=True):
        top = sorted(((int(t), lp) for t, lp in entry.items() if int(t) != token), key=lambda x: -x[1])
        assert row == f"  {token} {entry[str(token)]:.3f} | " + ", ".join(f"{t} {lp:.3f}" for t, lp in top)


def test_logprobs_show_each_token_as_quoted_text_with_a_tokenizer(capsys):
    from types import SimpleNamespace

    from kvload.cli.token_printer import _TokenPrinter
    from tests.llm_support import word_tokenizer

    printer = _TokenPrinter(word_tokenizer(16), several=True, labelled_samples=True, logprobs=True)
    printer(SimpleNamespace(index=0, sample=1, token_ids=[5], text=" w5", logprobs=[{5: -0.25, 7: -1.5}],
                            finish_reason="length"))
    assert capsys.readouterr().out.split("\n")[:3] == [
        "[0.1]  w5", "logprobs [0.1]: token logprob | top alternatives", '  "w5" -0.250 | "w7" -1.500']


def test_json_prints_outputs_and_stats(capsys):
    r = run_cli(capsys, *TINY, "--prompt-ids", "9,9,9", "--max_new_tokens", "2", "--ignore_eos", "--max_tokens",
                "256", "--json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert set(doc) == {"model", "route", "outputs", "stats"}
    (out,) = doc["outputs"]  # one RequestOutput per prompt, its samples in "outputs"
    (sample,) = out["outputs"]
    assert out["prompt_token_ids"] == [9, 9, 9] and len(sample["token_ids"]) == 2
    assert sample["finish_reason"] == "length" and sample["text"] is None and sample["logprobs"] is None
    assert out["computed_prompt_tokens"] == 3 and out["reused_prompt_tokens"] == 0
    assert set(out["timings"]) == {"first_token_s", "total_s"}
    assert doc["stats"]["generated_tokens"] == 2 and doc["stats"]["tokens_per_s"] > 0
    assert doc["route"]["kv_manager"] == "KVCacheManager"


def test_v2_under_pressure_reports_suspends_in_the_throughput_line(capsys):
    # one prompt three times: the second and third wait for the first's prefill and share its 3 whole blocks, so
    # each holds 6 blocks of its own: 21 of the pool's 20 at the end (3 admitted, 2 fit)
    ids = ["--prompt-ids", ",".join(map(str, range(10, 40)))] * 3
    r = run_cli(capsys, *TINY, *ids, "--max_new_tokens", "40", "--ignore_eos", "--use_kv_cache_manager_v2", "true",
                "--tokens_per_block", "8", "--max_tokens", "160", "--max_seq_len", "80")
    assert r.code == 0, r.err
    assert "suspended" in r.out.rstrip("\n").split("\n")[-1]


def test_n_samples_print_each_as_i_dot_j_and_share_the_prompt(capsys):
    ids = ",".join(map(str, range(10, 30)))  # 20 tokens, computed once: the later samples fork the first's KV
    r = run_cli(capsys, *TINY, "--prompt-ids", ids, "--n", "3", "--temperature", "1.5", "--seed", "2",
                "--max_new_tokens", "4", "--ignore_eos", "--tokens_per_block", "4", "--max_tokens", "512")
    assert r.code == 0, r.err
    lines = r.out.rstrip("\n").split("\n")
    assert sorted(line.split(" ")[0] for line in lines[:3]) == ["[0.0]", "[0.1]", "[0.2]"]
    assert lines[3].startswith("-- 1 prompt (3 samples): 60 prompt tokens (40 reused), 12 generated in ")


def test_json_carries_logprobs_stop_token_ids_and_top_k(capsys):
    ref = api_tokens([[9, 9, 9]], 6)[0]
    stop = ref[3]
    r = run_cli(capsys, *TINY, "--prompt-ids", "9,9,9", "--max_new_tokens", "6", "--ignore_eos", "--max_tokens", "256",
                "--stop_token_ids", str(stop), "--logprobs", "2", "--top_k", "1", "--temperature", "0.9", "--json")
    assert r.code == 0, r.err
    (sample,) = r.json()["outputs"][0]["outputs"]
    assert sample["token_ids"] == ref[:ref.index(stop) + 1]  # top_k 1 samples the greedy tokens
    assert (sample["finish_reason"], sample["stop_reason"]) == ("stop", stop)
    assert all(str(t) in entry and len(entry) >= 2 for t, entry in zip(sample["token_ids"], sample["logprobs"],
                                                                        strict=True))


def test_penalty_flags_give_the_python_apis_tokens_and_the_audit_records_them(capsys, tmp_path):
    settings = {"repetition_penalty": 1.6, "presence_penalty": 0.5, "frequency_penalty": 0.2, "min_tokens": 2}
    want = api_tokens([[9, 9, 9]], 8, settings)[0]
    assert want != api_tokens([[9, 9, 9]], 8)[0]  # they change what greedy picks
    audit = tmp_path / "g.jsonl"
    r = run_cli(capsys, *TINY, "--prompt-ids", "9,9,9", "--max_new_tokens", "8", "--ignore_eos", "--max_tokens", "256",
                "--json", "--audit-log", audit, *[f"--{k}={v}" for k, v in settings.items()])
    assert r.code == 0, r.err
    assert r.json()["outputs"][0]["outputs"][0]["token_ids"] == want
    started = next(e for e in read_events(audit) if e["event"] == "generation_started")
    assert {k: started[k] for k in settings} == settings


@pytest.mark.parametrize(("args", "message"), [
    ((), "error: --prompt: give at least one --prompt TEXT"),
    (("--prompt", "hello"), "error: --prompt: tiny-llama has no tokenizer (presets have random weights and none), so "
                            "a text prompt cannot be tokenized; give token ids with --prompt-ids"),
    (("--prompt-ids", "1,x"), "error: --prompt-ids: expected token ids such as 1,2,3 (the digits 0-9), got '1,x'"),
    (("--prompt-ids", "1,,3"), "error: --prompt-ids: expected token ids such as 1,2,3 (the digits 0-9), got '1,,3'"),
    (("--prompt-ids", "1", "--chat"), "error: --chat: wraps each --prompt TEXT in the chat template, and --prompt-ids "
                                      "gives token ids, which it cannot wrap"),
    (("--prompt-ids", "1", "--max_new_tokens", "0"), "error: --max_new_tokens: expected an integer >= 1, got '0'"),
    (("--prompt-ids", "1", "--temperature", "-1"), "error: --temperature: expected a number >= 0, got '-1'"),
    (("--prompt-ids", "1", "--top-p", "1.5"), r"error: --top-p: expected a number in (0, 1], got '1.5'"),
    (("--prompt-ids", "1", "--top_k", "-3"), "error: --top_k: expected an integer >= 1, or 0 / -1 for all tokens"),
    (("--prompt-ids", "1", "--n", "0"), "error: --n: expected an integer in [1, 128], got '0'"),
    (("--prompt-ids", "1", "--n", "10000000", "--temperature", "1"),
     "error: --n: expected an integer in [1, 128], got '10000000'"),
    (("--prompt", "ok\udced\udca0\udc80"),  # the bytes ED A0 80 on a command line (not UTF-8), as Python gets them
     "error: generate: prompt 0: not valid Unicode text (a lone surrogate at character 2; text must be UTF-8)"),
    (("--prompt-ids", "1", "--stop", "x"), "error: generate: stop: stop strings are matched on the text, but "
                                           "tiny-llama has no tokenizer"),
    (("--prompt-ids", "1", "--stop_token_ids", "1,a"), "error: --stop_token_ids: expected token ids"),
    (("--prompt-ids", "1", "--logprobs", "21"), "error: --logprobs: expected an integer in [0, 20], got '21'"),
    (("--prompt-ids", "1", *["--stop", "x"] * 17), "error: generate: stop: expected at most 16 strings, got a list "
                                                  "of 17"),
    (("--prompt-ids", "1", "--stop_token_ids", ",".join(["2"] * 4097)),
     "error: generate: stop_token_ids: expected at most 4,096 token ids, got a list of 4,097"),
    (("--prompt-ids", "1", "--repetition_penalty", "0"), "error: --repetition_penalty: expected a number in [0.01, "
                                                          "100]"),
    (("--prompt-ids", "1", "--repetition_penalty", "1e39"), "error: --repetition_penalty: expected a number in "),
    (("--prompt-ids", "1", "--presence-penalty", "-3"), "error: --presence-penalty: expected a number in [-2, 2]"),
    (("--prompt-ids", "1", "--frequency_penalty", "nan"), "error: --frequency_penalty: expected a finite number"),
    (("--prompt-ids", "1", "--min_p", "1.5"), "error: --min_p: expected a number in [0, 1], got '1.5'"),
    (("--prompt-ids", "1", "--min_tokens", "9", "--max_new_tokens", "8"),
     "error: --min_tokens: expected at most --max_new_tokens (8), got 9"),
    # without --max_new_tokens generate's own default bounds it: named so, with the flag that raises it (it said
    # "at most --max_new_tokens (64)", a flag the user never gave)
    (("--prompt-ids", "1", "--min_tokens", "100"),
     "error: --min_tokens: expected at most 64, generate's own default (neither --max_new_tokens nor the model's "
     "max_new_tokens gives one), got 100; give --max_new_tokens of at least 100 to raise it"),
    (("--prompt-ids", "1", "--max_tokens", "32", "--max_new_tokens", "64"),
     "error: generate: prompt 0: 1 prompt tokens + max_new_tokens 64 need 3 blocks"),
])
def test_bad_input_is_one_line_exit_2_and_no_audit_file(capsys, tmp_path, args, message):
    audit = tmp_path / "a.jsonl"
    r = run_cli(capsys, *TINY, *args, "--audit-log", audit)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith(message)
    assert not audit.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [("--prompt", "hello"), ("--prompt-ids", "1", "--prompt", "hi"),
                                  ("--prompt-ids", "1", "--chat")])
def test_prompts_the_model_cannot_take_are_refused_before_anything_loads(capsys, monkeypatch, args):
    """A text prompt for a preset (no tokenizer) and --chat with token ids were refused by the executor, after the
    weights had loaded (5.6 s here, minutes for a large model); both are known before the weights load."""
    import stages.load_weights

    def loads(*_args, **_kw):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(stages.load_weights, "load_weights", loads)
    r = run_cli(capsys, *TINY, *args)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith("error: --chat: " if "--chat" in args else "error: --prompt: tiny-llama has no tokenizer")


@pytest.mark.parametrize(("args", "message"), [
    (("--prompt-ids", "1,2,99999"), "prompt 0 (--prompt-ids): token id 99999"),
    (("--prompt-ids", "1", "--prompt-ids", "3,512"), "prompt 1 (--prompt-ids): token id 512"),
    (("--prompt-ids", "1", "--stop_token_ids", "5,600"), "--stop_token_ids: token id 600"),
])
def test_token_ids_outside_the_vocabulary_are_refused_before_the_weights_load(capsys, monkeypatch, args, message):
    """An id past the model's vocab_size was refused by the executor after the weights had loaded (14 s here for
    tiny-llama, minutes for a large model); the model's config states the vocabulary size before that."""
    import stages.load_weights

    def loads(*_args, **_kw):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(stages.load_weights, "load_weights", loads)
    r = run_cli(capsys, *TINY, *args)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err == (f"error: generate: {message} is outside the vocabulary (0..511: vocab_size 512 in tiny-llama's "
                     "config)\n")


@pytest.mark.parametrize(("args", "message"), [
    (("--max_seq_len", "1", "--prompt-ids", "1,2,3"),
     "error: --max_seq_len: 1 leaves no room to generate after prompt 0 (--prompt-ids) (3 tokens; "),
    (("--max_seq_len", "3", "--prompt-ids", "1,2", "--prompt-ids", "1,2,3"),
     "error: --max_seq_len: 3 leaves no room to generate after prompt 1 (--prompt-ids) (3 tokens; "),
    (("--max_seq_len", "1", "--prompt", "hi"),
     "error: --max_seq_len: 1 leaves no room to generate after --prompt (at least one token; "),
])
def test_a_max_seq_len_that_leaves_a_prompt_no_room_is_refused_before_the_weights_load(capsys, monkeypatch, args,
                                                                                        message):
    """``--max_seq_len 1`` (or one no longer than a --prompt-ids prompt) was refused by the executor after the weights
    had loaded (13-16 s for tiny-llama); the prompt's length and max_seq_len are both known before that."""
    import stages.load_weights

    def loads(*_args, **_kw):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(stages.load_weights, "load_weights", loads)
    r = run_cli(capsys, *TINY, "--max_new_tokens", "1", *args)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith(message), r.err
    assert "expected at least" in r.err


def test_a_real_process_streams_and_writes_the_audit(tmp_path):
    audit = tmp_path / "g.jsonl"
    r = kvload(*TINY, "--prompt-ids", "3,4,5", "--max_new_tokens", "3", "--temperature", "0.7", "--seed", "11",
               "--audit-log", audit)
    assert r.code == 0, r.err
    assert len(r.out.split("\n")[0].split()) <= 3
    started = next(e for e in read_events(audit) if e["event"] == "generation_started")
    assert (started["temperature"], started["seed"], started["stage"]) == (0.7, 11, "generate")


def test_chat_with_a_checkpoints_template_that_never_ends_exits_2_with_one_line(tiny_checkpoints, tmp_path):
    """``generate --chat`` with a checkpoint whose own chat_template.jinja nests two 100,000-item ranges (Jinja's
    sandbox bounds each range, not their product) ran its 10**10 steps: it looped for ever (the helper's 180 s
    timeout). It is stopped at the template step bound: exit 2, one line naming the template, no audit file."""
    from tests.llm_support import with_tokenizer

    ckpt = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "ckpt", 512)
    (ckpt / "chat_template.jinja").write_text("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}"
                                              "{% endfor %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    out = tmp_path / "out"
    out.mkdir()
    r = kvload("generate", ckpt, "--chat", "--prompt", "w5 w6", "--audit-log", out / "a.jsonl")
    assert r.code == 2 and r.one_error_line, r.err[-2000:]
    assert r.err == ("error: generate: prompt 0 (--prompt): the model's chat template ran more than 1,000,000 steps "
                     "without finishing (a loop inside a loop?); it was stopped\n")
    assert r.out == "" and list(out.iterdir()) == []


def test_help_explains_the_output_and_the_cpu_budget(capsys):
    r = run_cli(capsys, "generate", "--help")
    assert r.code == 0
    assert "--prompt TEXT" in r.out and "--prompt-ids IDS" in r.out and "--chat" in r.out
    assert "prompts x (n x max_new_tokens + 1024) tokens" in r.out


def test_greedy_n_samples_are_identical_and_the_audit_says_n_did_nothing(capsys, tmp_path):
    audit = tmp_path / "n.jsonl"
    r = run_cli(capsys, *TINY, "--prompt-ids", "9,9,9", "--n", "2", "--max_new_tokens", "3", "--ignore_eos",
                "--max_tokens", "256", "--json", "--audit-log", audit)
    assert r.code == 0, r.err
    a, b = r.json()["outputs"][0]["outputs"]
    assert a["token_ids"] == b["token_ids"]
    ignored = [e for e in read_events(audit) if e["event"] == "setting_ignored" and e["field"] == "generate.n"]
    assert ignored and "identical" in ignored[0]["reason"]


def test_a_huge_max_new_tokens_is_capped_by_the_checkpoints_max_seq_len_too(capsys, tmp_path):
    # no --max_seq_len: the checkpoint's (8192 for tiny-llama) is known only once resolved, and still caps the pools
    audit = tmp_path / "gen.jsonl"
    every_token = ",".join(str(i) for i in range(512))  # tiny-llama's vocabulary: the first token ends each sample
    r = run_cli(capsys, *TINY, "--prompt-ids", "1,2", "--prompt-ids", "3,4,5", "--max_new_tokens", "1000000000",
                "--stop_token_ids", every_token, "--json", "--audit-log", audit)
    assert r.code == 0, r.err
    assert [len(o["outputs"][0]["token_ids"]) for o in r.json()["outputs"]] == [1, 1]
    (budget,) = [e for e in read_events(audit) if e["event"] == "kv_budget_computed"]
    assert "capped at 2 sequence(s) of max_seq_len=8192" in budget["reason"]


@pytest.fixture(scope="module")
def text_checkpoint(tiny_checkpoints, tmp_path_factory):
    """tiny-llama's weights saved with a byte-level tokenizer: a checkpoint that takes --prompt TEXT."""
    from tests.text_support import bytelevel_checkpoint

    return bytelevel_checkpoint(tiny_checkpoints("llama"), tmp_path_factory.mktemp("textgen") / "ckpt")


def test_a_text_prompt_that_leaves_no_room_is_counted_by_the_tokenizer_and_refused_before_the_weights_load(
        capsys, monkeypatch, text_checkpoint):
    """``--prompt TEXT --max_seq_len N`` whose tokens leave no room was refused by the executor after the weights had
    loaded (~12 s for SmolLM2); the tokenizer alone (a fraction of a second) counts them first, and the line names
    the flag and the count, as for --prompt-ids."""
    import stages.load_weights
    from models.weights import load_tokenizer

    def loads(*_args, **_kw):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(stages.load_weights, "load_weights", loads)
    text = "Hello world, the sky is blue."
    count = len(load_tokenizer(text_checkpoint)(text)["input_ids"])
    r = run_cli(capsys, "generate", str(text_checkpoint), "--max_tokens", "256", "--max_new_tokens", "1",
                "--max_seq_len", str(count), "--prompt", "hi", "--prompt", text)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith(f"error: --max_seq_len: {count} leaves no room to generate after prompt 1 (--prompt) "
                            f"({count} tokens; "), r.err


def test_a_text_prompt_that_fits_generates_from_the_tokenizer_loaded_once(capsys, monkeypatch, text_checkpoint):
    import models.weights

    loaded = []
    real = models.weights.load_tokenizer
    monkeypatch.setattr(models.weights, "load_tokenizer", lambda path: loaded.append(path) or real(path))
    import stages.load_weights

    monkeypatch.setattr(stages.load_weights, "load_tokenizer", models.weights.load_tokenizer, raising=False)
    r = run_cli(capsys, "generate", str(text_checkpoint), "--max_tokens", "256", "--max_new_tokens", "2",
                "--max_seq_len", "64", "--prompt", "Hello world", "--ignore_eos")
    assert r.code == 0, r.err
    assert len(loaded) == 1


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_checkpoint(tiny_checkpoints, tmp_path_factory):
    """tiny-llama's weights with a byte-level tokenizer and a chat template: a checkpoint that takes --chat."""
    from tests.text_support import bytelevel_checkpoint

    return bytelevel_checkpoint(tiny_checkpoints("llama"), tmp_path_factory.mktemp("chatgen") / "ckpt", CHAT_TEMPLATE)


def _no_weights(monkeypatch):
    import stages.load_weights

    def loads(*_args, **_kw):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(stages.load_weights, "load_weights", loads)


def test_a_chat_prompt_that_leaves_no_room_is_counted_through_the_template_and_refused_before_the_weights_load(
        capsys, monkeypatch, chat_checkpoint):
    """``--chat`` prompts were not counted before the weights load (their template ran in the executor): one that left
    no room under --max_seq_len was refused after them. Now its templated tokens are counted first."""
    from models.weights import load_tokenizer

    tok = load_tokenizer(chat_checkpoint)
    text = "Hello world"
    count = len(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"])
    assert count > len(tok(text)["input_ids"])  # the template's tokens are counted too
    _no_weights(monkeypatch)
    r = run_cli(capsys, "generate", str(chat_checkpoint), "--chat", "--max_tokens", "256", "--max_new_tokens", "1",
                "--max_seq_len", str(count), "--prompt", text)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith(f"error: --max_seq_len: {count} leaves no room to generate after prompt 0 (--prompt) "
                            f"({count} tokens; "), r.err


def test_chat_on_a_tokenizer_without_a_template_is_refused_before_the_weights_load(capsys, monkeypatch,
                                                                                    text_checkpoint):
    _no_weights(monkeypatch)
    r = run_cli(capsys, "generate", str(text_checkpoint), "--chat", "--max_tokens", "256", "--prompt", "Hello")
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err == (f"error: --chat: chat needs a chat template, and the tokenizer of {text_checkpoint} has "
                     "none; leave out --chat to send each --prompt as it is\n"), r.err


def test_a_chat_prompt_that_fits_is_counted_as_the_executor_templates_it(capsys, chat_checkpoint):
    """The count before the weights and the executor's agree: a --max_seq_len one past the templated prompt runs."""
    from models.weights import load_tokenizer

    count = len(load_tokenizer(chat_checkpoint).apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"])
    r = run_cli(capsys, "generate", str(chat_checkpoint), "--chat", "--max_tokens", "256", "--max_new_tokens", "1",
                "--max_seq_len", str(count + 1), "--prompt", "Hello", "--ignore_eos", "--json")
    assert r.code == 0, r.err
    (output,) = json.loads(r.out)["outputs"]
    assert len(output["prompt_token_ids"]) == count


@needs_smollm2
def test_a_prompt_too_long_for_a_gguf_not_yet_converted_is_refused_before_its_conversion(capsys, monkeypatch,
                                                                                         tmp_path):
    """A GGUF's tokenizer was on disk only once its conversion (half a minute for SmolLM2's 98 MB, the weights
    dequantized) had written it, so a prompt past --max_seq_len was refused after that. Its tokenizer is now read
    from the file itself first: the refusal comes before the conversion, and none is left half done."""
    monkeypatch.setenv("KVLOAD_CACHE", str(tmp_path / "cache"))
    _no_weights(monkeypatch)
    r = run_cli(capsys, "generate", "smollm2-135m", "--max_tokens", "256", "--max_seq_len", "4",
                "--prompt", "hello there how are you doing today my friend")
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith("error: --max_seq_len: 4 leaves no room to generate after prompt 0 (--prompt) (9 tokens; "
                            "a sequence never grows past max_seq_len); expected at least 10"), r.err
    from models import gguf_cache

    cache = tmp_path / "cache"  # at most kvload's bookkeeping (the file's content key): no conversion, not a part
    assert not cache.exists() or [p.name for p in cache.iterdir()] == [gguf_cache.STATE]
