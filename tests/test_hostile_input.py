"""Hostile input and faults (issue 11): every bad value gets one line naming it, nothing hangs,
nothing is left behind.

Classes, each with generated cases where the class is large:

* bounds before work: config.json sizes (mutator), YAML alias bombs and nesting (generator),
  simulate --requests / --workload-arg (Hypothesis); the worst run under memory and CPU limits;
* numbers at the edges: every numeric flag and YAML field (Hypothesis), sampling at tiny
  temperature / top_p (Hypothesis over logits);
* the line names the culprit: generate's pool-size errors;
* silent acceptance: --config "", duplicated keys (generator), setting_ignored;
* audit files as input: a record mutator over a real log, consistent forgeries, the hash chain;
* files: FIFOs, devices, read-only directories, existing files, umask;
* faults: SIGINT and SIGTERM sent to real kvload processes, a failing simulate.

Most cases run in-process (``run_cli``); subprocesses only where a real process matters (signals,
resource limits, a real stderr).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvload.explain import verify_log
from pipeline.audit import AuditLog
from pipeline.audit_chain import HEAD, KEY_ENV, PREV, Chain
from pipeline.errors import AuditError, ConfigError
from tests.cli_support import ENV, REPO, read_events, run_cli, write_events
from tests.conftest import llama_config, write_config
from tests.hostile_support import (
    assert_refused,
    config_mutations,
    deep_yaml,
    exit_signal_name,
    interrupt,
    limited_kvload,
    signal_again_script,
    signals_as_a_terminal_gives_them,
    start_kvload,
    wait_for_temporary,
    yaml_bomb,
)

FAST = settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None, max_examples=60,
                derandomize=True)


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """An empty folder for outputs: after a refused run it must still be empty."""
    folder = tmp_path / "out"
    folder.mkdir()
    return folder


def _plan(capsys, *argv, audit: Path | None = None):
    extra = ["--audit-log", str(audit)] if audit is not None else []
    return run_cli(capsys, "plan", *argv, *extra)


# --- bounds before work: config.json -------------------------------------------------------------

BASE = llama_config(num_hidden_layers=4, head_dim=8)
MUTATIONS = list(config_mutations(BASE))


def test_the_config_mutator_is_big_enough():
    assert len(MUTATIONS) >= 150


def test_every_config_json_mutation_is_refused_naming_file_and_field(capsys, tmp_path, out):
    """The mutator's cases (~170): wrong types, zero, negative, past int64, implausibly large, wrong shapes."""
    for case, config, field in MUTATIONS:
        ckpt = write_config(tmp_path / "ckpt", config)
        r = _plan(capsys, ckpt, audit=out / "a.jsonl")
        try:
            assert_refused(r, f"{ckpt}/config.json", f"{field}:", folder=out)
        except AssertionError as exc:
            raise AssertionError(f"case {case}: {exc}") from None


@pytest.mark.parametrize(("field", "value"), [("v_head_dim", -1), ("qk_nope_head_dim", -1), ("q_lora_rank", -3),
                                            ("v_head_dim", "16")])
def test_mla_head_sizes_are_checked_before_transformers_builds_them(capsys, tmp_path, out, field, value):
    """DeepSeek's MLA sizes: a negative one failed the load as "Trying to create tensor with negative dimension -4:
    [64, -4]", naming no field (the mutator covers them too, from INT_FIELDS)."""
    ckpt = write_config(tmp_path / "ckpt", {**BASE, field: value})
    assert_refused(_plan(capsys, ckpt, audit=out / "a.jsonl"), f"{ckpt}/config.json: {field}: expected an integer in",
                   folder=out)


@pytest.mark.parametrize(("name", "text", "needle"), [
    ("nesting", '{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ("nesting-64", '{"model_type": "llama", "x": ' + "[" * 64 + "]" * 64 + "}", "nested deeper than 32"),
    ("duplicate-key", json.dumps(BASE)[:-1] + ', "num_hidden_layers": 2}', "'num_hidden_layers' appears twice"),
    ("5000-digits", '{"model_type": "llama", "num_hidden_layers": ' + "9" * 5000 + "}",
     "num_hidden_layers: an integer of 5,000 digits; accepted: a number of at most 4,300 digits"),
    # Python's json reads these; standard JSON has none, and a NaN epsilon gave NaN logits with exit 0
    ("nan", json.dumps({**BASE, "rms_norm_eps": float("nan")}),
     "config.json: rms_norm_eps: NaN is not standard JSON; accepted: a finite number"),
    ("infinity-nested", json.dumps({**BASE, "rope_scaling": {"rope_type": "linear", "factor": float("inf")}}),
     "config.json: rope_scaling.factor: Infinity is not standard JSON"),
    ("minus-infinity-in-list", json.dumps({**BASE, "x": [1, float("-inf")]}), "config.json: x[1]: -Infinity is not"),
    ("not-utf8", b'{"model_type": "\xff"}', "config.json: not UTF-8 (byte 0xff at offset 16); JSON files are UTF-8"),
])
def test_config_json_shapes_that_crash_parsers_are_refused(capsys, tmp_path, out, name, text, needle):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    if isinstance(text, bytes):
        (ckpt / "config.json").write_bytes(text)
    else:
        (ckpt / "config.json").write_text(text)
    assert_refused(_plan(capsys, ckpt, audit=out / "a.jsonl"), "config.json", needle, folder=out)


@pytest.mark.parametrize(("kind", "needle"), [
    ("directory", "config.json: is a directory, expected a JSON file"),
    ("fifo", "config.json: not a regular file (a FIFO or device?), expected a JSON file"),
    ("loop", "config.json: cannot read (Too many levels of symbolic links)"),
    ("dangling", "config.json: is a symbolic link to nothing"),
])
def test_a_config_json_that_is_no_file_is_named_not_missing(capsys, tmp_path, out, kind, needle):
    # it was "directory has no config.json or .gguf file", with the culprit right there
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    file = ckpt / "config.json"
    {"directory": file.mkdir, "fifo": lambda: os.mkfifo(file), "loop": lambda: file.symlink_to("config.json"),
     "dangling": lambda: file.symlink_to("nowhere.json")}[kind]()
    assert_refused(_plan(capsys, ckpt, audit=out / "a.jsonl"), f"{ckpt}/{needle}", folder=out)


@pytest.mark.parametrize(("text", "needle"), [
    # transformers skipped a malformed file with a log line kvload hides: generation stopped elsewhere, exit 0
    ('{"eos_token_id": 498,}', "generation_config.json: malformed JSON at line 1 column 22"),
    ("[498]", "generation_config.json: expected a JSON object, got list"),
    # and dropped an eos_token_id of the wrong type (engine.sampling keeps only integers)
    ('{"eos_token_id": "x"}', "generation_config.json: eos_token_id: expected an integer token id, a list "
                              "of them, or null; got 'x'"),
    ('{"eos_token_id": [2, true]}', "generation_config.json: eos_token_id:"),
    ('{"eos_token_id": 2.0}', "generation_config.json: eos_token_id:"),
    ('{"eos_token_id": 2, "eos_token_id": 3}', "generation_config.json: key 'eos_token_id' appears twice"),
    # an id outside the vocabulary (BASE's vocab_size is 128) was taken: EOS never came, or banned a real token
    ('{"eos_token_id": -1}', "generation_config.json: eos_token_id: token id -1 is not in the vocabulary; accepted: "
                             "an integer in [0, 127] (vocab_size 128), a list of them, or null"),
    ('{"eos_token_id": [2, 128]}', "generation_config.json: eos_token_id: token id 128 is not in the vocabulary"),
    ('{"temperature": NaN}', "generation_config.json: temperature: NaN is not standard JSON"),
])
def test_a_bad_generation_config_json_is_refused_naming_it(capsys, tmp_path, out, text, needle):
    ckpt = write_config(tmp_path / "ckpt", BASE)
    (ckpt / "generation_config.json").write_text(text)
    assert_refused(_plan(capsys, ckpt, audit=out / "a.jsonl"), f"{ckpt}/{needle}", folder=out)


@pytest.mark.parametrize("field", ["dtype", "torch_dtype"])
def test_a_dtype_torch_does_not_have_is_named_with_what_is_accepted(capsys, tmp_path, out, field):
    # was "transformers cannot load model_type 'llama': module 'torch' has no attribute 'float128'"
    ckpt = write_config(tmp_path / "ckpt", {**BASE, field: "float128"})
    assert_refused(_plan(capsys, ckpt, audit=out / "a.jsonl"),
                   f"{ckpt}/config.json: {field}: 'float128' is not a torch dtype; accepted: ", "bfloat16", folder=out)


@pytest.mark.parametrize("text", ['{"eos_token_id": 2}', '{"eos_token_id": [2, 3]}', '{"eos_token_id": null}', "{}"])
def test_a_good_generation_config_json_plans(capsys, tmp_path, text):
    ckpt = write_config(tmp_path / "ckpt", BASE)
    (ckpt / "generation_config.json").write_text(text)
    r = _plan(capsys, ckpt)
    assert r.code == 0, r.err



def test_a_usable_config_still_plans(capsys, tmp_path):
    r = _plan(capsys, write_config(tmp_path / "ok", BASE))
    assert r.code == 0, r.err


HEADS_4_KV_3 = "num_attention_heads (4) is not a multiple of num_key_value_heads (3)"


@pytest.mark.parametrize("command", [("plan",), ("run", "--max_tokens", "256"),
                                     ("generate", "--prompt-ids", "1,2,3", "--max_new_tokens", "2")])
def test_query_heads_that_kv_heads_do_not_divide_are_refused_before_anything_loads(
        capsys, tmp_path, out, monkeypatch, track_pools, command):
    """4 query heads over 3 KV heads: each KV head must serve the same number of query heads. This planned,
    built its pools and failed only inside generate's attention (exit 1, naming neither file nor field)."""
    import stages.load_weights

    loads: list[object] = []
    monkeypatch.setattr(stages.load_weights, "load_weights", lambda *a, **k: loads.append(a))
    ckpt = write_config(tmp_path / "ckpt", {**BASE, "num_key_value_heads": 3})
    (ckpt / "model.safetensors").write_bytes(b"never read")  # generate would fail on these if it got to them
    r = run_cli(capsys, command[0], ckpt, *command[1:], "--device", "cpu", "--audit-log", out / "a.jsonl")
    assert_refused(r, f"{ckpt}/config.json: {HEADS_4_KV_3}", folder=out)
    assert loads == [] and track_pools == []


def test_kv_heads_in_text_config_are_checked_and_mla_heads_are_not(capsys, tmp_path, out):
    """A multimodal wrapper's decoder is checked under its own prefix; an MLA config caches one latent that
    every head expands, so its num_key_value_heads groups nothing (DeepSeek V2/V3 give it equal to the heads)."""
    wrapped = {**BASE, "text_config": {**BASE, "num_key_value_heads": 3}}
    r = _plan(capsys, write_config(tmp_path / "wrapped", wrapped), audit=out / "a.jsonl")
    assert_refused(r, "text_config.num_attention_heads (4) is not a multiple of text_config.num_key_value_heads (3)",
                   folder=out)
    mla = json.loads((Path(__file__).parent / "data" / "configs" / "deepseek-v2-lite" / "config.json").read_text())
    r = _plan(capsys, write_config(tmp_path / "mla", {**mla, "num_key_value_heads": 3}))
    assert r.code == 0, r.err


def test_kv_heads_transformers_fills_in_are_checked_too(capsys, tmp_path, out):
    """A config.json without num_key_value_heads gets the config class's default: 8 for Mistral, which 4 query
    heads cannot share. Refused at plan time, naming the file, rather than planning 8 heads' pools."""
    config = {**BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    del config["num_key_value_heads"]
    ckpt = write_config(tmp_path / "ckpt", config)
    r = _plan(capsys, ckpt, audit=out / "a.jsonl")
    assert_refused(r, f"{ckpt}/config.json", "num_attention_heads (4) is not a multiple of num_key_value_heads (8)",
                   "fills in what the file leaves out", folder=out)


# --- bounds before work: YAML ---------------------------------------------------------------------

BOMBS = [(fan, depth, kind, at) for fan in (3, 9, 30) for depth in (4, 8, 12) for kind in ("list", "dict")
         for at in ("kv_cache_config", "max_batch_size")]


def test_yaml_alias_bombs_are_refused_before_they_are_walked(capsys, tmp_path, out):
    """36 generated bombs, from 81 to 10^17 expanded nodes; the 24 past 10,000 refused by size, none walked or
    printed; the small ones refused for their content."""
    cfg = tmp_path / "bomb.yaml"
    refused = 0
    for fan, depth, kind, at in BOMBS:
        cfg.write_text(yaml_bomb(fan, depth, kind, at))
        r = _plan(capsys, "tiny-llama", "--config", cfg, audit=out / "a.jsonl")
        if fan**depth > 10_000:
            assert_refused(r, "bomb.yaml", "expands to more than 10,000 values", folder=out)
            refused += 1
        else:  # a small one is an ordinary bad config: refused for its content, still one line
            assert_refused(r, "bomb.yaml", folder=out)
    assert refused == sum(1 for fan, depth, _, _ in BOMBS if fan**depth > 10_000) == 24


@pytest.mark.parametrize("depth", [40, 5000])
@pytest.mark.parametrize("kind", ["list", "dict"])
def test_deeply_nested_yaml_is_refused(capsys, tmp_path, out, depth, kind):
    cfg = tmp_path / "deep.yaml"
    cfg.write_text(deep_yaml(depth, kind))
    assert_refused(_plan(capsys, "tiny-llama", "--config", cfg, audit=out / "a.jsonl"), "deep.yaml", "nested",
                   folder=out)


# --- bounds before work: simulate sizes -----------------------------------------------------------

SIZES = {"shared-prefix": ["prefix_len", "question_len", "answer_len"],
         "multi-turn": ["turns", "first_len", "user_len", "answer_len"],
         "long-context": ["prompt_len", "answer_len"], "no-reuse": ["prompt_len", "answer_len"]}


@FAST
@given(workload=st.sampled_from(sorted(SIZES)), data=st.data())
def test_simulate_sizes_are_bounded_before_the_workload_is_built(capsys, workload, data):
    """Hypothesis: --requests and one --workload-arg, at least one of them far too large."""
    key = data.draw(st.sampled_from(SIZES[workload]))
    big = st.integers(min_value=10**6 + 1, max_value=2**63 - 1)
    too_many = st.tuples(big, st.integers(1, 64))
    # multi-turn builds the requests asked for: a huge `turns` alone is no large workload (they are its first
    # turns), nor is a huge user_len / answer_len under fewer requests than the 4 turns that read them
    least = 4 if workload == "multi-turn" else 1
    requests, value = data.draw(too_many if key == "turns" else st.one_of(
        too_many, st.tuples(st.integers(least, 10**6), st.integers(10**8, 2**63 - 1))))
    r = run_cli(capsys, "simulate", "tiny-llama", "--workload", workload, "--requests", requests,
                "--workload-arg", f"{key}={value}")
    assert_refused(r, f"workload {workload}", "--requests")


# --- the worst of each class under memory and CPU limits (real processes) ----------------------------

def _limited_cases(tmp: Path) -> dict[str, tuple[list[str], list[str]]]:
    write_config(tmp / "billion", {**BASE, "num_hidden_layers": 10**9})
    (tmp / "list-bomb.yaml").write_text(yaml_bomb(9, 12, "list"))
    (tmp / "dict-bomb.yaml").write_text(yaml_bomb(9, 12, "dict"))
    with open(tmp / "sparse.yaml", "wb") as f:  # 8 GiB of zeros that take no disk: read whole, they took memory
        f.truncate(8 * 1024**3)
    header = {"event": "audit_header", "kvload_version": "0.1.0", "schema_version": 1}
    (tmp / "deep.jsonl").write_text(json.dumps(header) + '\n{"event": "stage_started", "x": '
                                    + "[" * 100_000 + "]" * 100_000 + "}\n")
    return {
        "config.json num_hidden_layers 1e9": (["plan", tmp / "billion"], ["num_hidden_layers", "16,384"]),
        "YAML list bomb": (["plan", "tiny-llama", "--config", tmp / "list-bomb.yaml"], ["list-bomb.yaml"]),
        "YAML dict bomb": (["plan", "tiny-llama", "--config", tmp / "dict-bomb.yaml"], ["dict-bomb.yaml"]),
        "YAML 8 GiB file": (["plan", "tiny-llama", "--config", tmp / "sparse.yaml"], ["sparse.yaml", "bytes"]),
        "simulate --requests 1e9": (["simulate", "tiny-llama", "--workload", "no-reuse", "--requests", 10**9],
                                    ["--requests"]),
        "simulate prompt_len 1e12": (["simulate", "tiny-llama", "--workload", "long-context", "--workload-arg",
                                      f"prompt_len={10**12}"], ["--workload-arg"]),
        # two requests, but a million system prompts of 512 tokens drawn before any request was
        "simulate mixed prefixes 1e6": (["simulate", "tiny-llama", "--workload", "mixed", "--requests", 2,
                                         "--workload-arg", f"prefixes={10**6}"], ["prefixes=1,000,000", "token ids"]),
        "audit 100000-deep": (["audit", tmp / "deep.jsonl", "--verify"], ["deep.jsonl", "line 2"]),
        "--max_gpu_total_bytes 1e400": (["plan", "tiny-llama", "--max_gpu_total_bytes", "1e400"],
                                        ["--max_gpu_total_bytes", "'1e400'"]),
    }


@pytest.mark.parametrize("case", [
    "config.json num_hidden_layers 1e9", "YAML list bomb", "YAML dict bomb", "YAML 8 GiB file",
    "simulate --requests 1e9",
    "simulate prompt_len 1e12", "simulate mixed prefixes 1e6", "audit 100000-deep", "--max_gpu_total_bytes 1e400"])
def test_hostile_input_ends_within_memory_and_cpu_limits(tmp_path, case):
    """A real process under RLIMIT_AS 1.5 GiB and RLIMIT_CPU 40 s: refused with exit 2, not killed by a limit."""
    argv, needles = _limited_cases(tmp_path)[case]
    out = tmp_path / "out"
    out.mkdir()
    if argv[0] == "plan":
        argv = [*argv, "--audit-log", out / "a.jsonl"]
    r = limited_kvload(*argv)
    assert r.code == 2, f"exit {exit_signal_name(r.code)}: {r.err[-1500:]}"
    assert_refused(r, *needles, folder=out)


# --- numbers at the edges --------------------------------------------------------------------------

INT_FLAGS = ["--max_tokens", "--tokens_per_block", "--max_batch_size", "--max_seq_len", "--max_num_tokens",
             "--max_beam_width"]
SIZE_FLAGS = ["--max_gpu_total_bytes", "--host_cache_size"]

too_big = st.one_of(st.integers(min_value=2**63, max_value=10**60).map(str),
                    st.integers(min_value=2**63, max_value=10**60).map(hex))  # 0x... is a YAML 1.2 integer
huge_digits = st.integers(min_value=41, max_value=6000).map(lambda n: "9" * n)
not_finite = st.sampled_from(["1e400", "-1e400", "inf", "-inf", "nan", "NaN", "Infinity"])
non_positive = st.integers(min_value=-(2**70), max_value=0).map(str)
words = st.sampled_from(["", "four", "1e3", "0b10", "0x1g", "0x_10", "0o8", "1.5", "2**64",
                        "1_0_0_0_0_0_0_0_0_0_0_0_0_0_0_0_0_0_0_0_0"])



def _in_script(zero: int) -> st.SearchStrategy[str]:
    return st.integers(min_value=1, max_value=10**6).map(lambda n: "".join(chr(zero + int(d)) for d in str(n)))


#: A number in another script's digits (Arabic-Indic, fullwidth, Devanagari): int() and float() read them, a YAML
#: config reads a string, so a flag took '٣٣٣٣' as 3333 where the same value in the config file was refused
other_digits = st.one_of(_in_script(0x660), _in_script(0xFF10), _in_script(0x966))


@FAST
@given(flag=st.sampled_from(INT_FLAGS),
       text=st.one_of(too_big, huge_digits, not_finite, non_positive, words, other_digits))
def test_integer_flags_at_the_edges(capsys, flag, text):
    r = _plan(capsys, "tiny-llama", f"{flag}={text}")
    assert_refused(r, flag)


@FAST
@given(flag=st.sampled_from(SIZE_FLAGS),
       text=st.one_of(too_big, huge_digits, not_finite, other_digits, other_digits.map(lambda t: t + "GiB"),
                      st.sampled_from(["-1", "1.5", "8XB", "-8GiB", "1e30GiB"])))
def test_byte_count_flags_at_the_edges(capsys, flag, text):
    assert_refused(_plan(capsys, "tiny-llama", f"{flag}={text}"), flag)


@FAST
@given(text=st.one_of(not_finite, st.sampled_from(["0", "-0.5", "1.0000001", "1e-400", "2", "０.５", "٠.٥"]),
                      huge_digits))
def test_kv_cache_fraction_at_the_edges(capsys, text):
    assert_refused(_plan(capsys, "tiny-llama", f"--kv_cache_fraction={text}"), "--kv_cache_fraction")


GENERATE_EDGES = {
    "--temperature": st.one_of(not_finite, st.sampled_from(["-1", "-1e-300", "hot"])),
    "--top_p": st.one_of(not_finite, st.sampled_from(["0", "1e-400", "-1", "1.5"])),
    "--seed": st.one_of(too_big, huge_digits, st.integers(max_value=-2).map(str)),  # -1: vLLM's "no seed"
    "--max_new_tokens": st.one_of(too_big, huge_digits, non_positive, other_digits),
    "--prompt-ids": st.one_of(other_digits, huge_digits, st.sampled_from(["1,²", "①", "1,2,³", "¹²"])),
}


@FAST
@given(data=st.data())
def test_generate_sampling_flags_at_the_edges(capsys, data):
    flag = data.draw(st.sampled_from(sorted(GENERATE_EDGES)))
    text = data.draw(GENERATE_EDGES[flag])
    r = run_cli(capsys, "generate", "tiny-llama", "--prompt-ids", "1,2,3", f"{flag}={text}")
    assert_refused(r, flag)


@pytest.mark.parametrize(("flag", "field"), [("--max_draft_len", "max_draft_len"),
                                              ("--max_matching_ngram_size", "max_matching_ngram_size"),
                                              ("--max_tokens", "kv_cache_config.max_tokens")])
def test_a_value_past_int64_gets_the_same_verdict_as_a_flag_and_in_the_config_file(capsys, tmp_path, flag, field):
    """--max_draft_len 99999999999999999999999 was "expected an integer of at most 2**63 - 1" where the same value in
    a config file (and --max_draft_len 65) was "expected an integer from 0 to 64": one field, two verdicts."""
    text = "99999999999999999999999"
    *parents, leaf = field.split(".")
    cfg = tmp_path / "n.yaml"
    cfg.write_text(f"{leaf}: {text}\n" if not parents else f"{parents[0]}:\n  {leaf}: {text}\n")
    from_file = _plan(capsys, "tiny-llama", "--config", cfg)
    from_flag = _plan(capsys, "tiny-llama", flag, text)
    assert from_file.code == from_flag.code == 2 and from_flag.one_error_line, from_flag.err
    assert from_file.err.split(f"{field}: ", 1)[1] == from_flag.err.split(f"{flag}: ", 1)[1], (from_file.err,
                                                                                                from_flag.err)


LONG = "k" * 100_000


@pytest.mark.parametrize(("argv", "start"), [
    (["plan", LONG], "error: model 'kkkk"),
    (["plan", "tiny-llama", "--use_kv_cache_manager_v2", LONG], "error: --use_kv_cache_manager_v2: expected"),
    (["plan", "tiny-llama", "--attention_backend", LONG], "error: --attention_backend: invalid choice"),
    (["plan", "tiny-llama", "--generation_config", LONG], "error: --generation_config"),
    (["plan", "tiny-llama", f"--{LONG}"], "error: unrecognized arguments: --kkkk"),
    (["simulate", "tiny-llama", "--workload", "no-reuse", "--workload-arg", f"{LONG}=1"], "error: workload no-reuse"),
    ([LONG], "error: COMMAND"),
])
def test_a_100000_character_value_is_quoted_cut_not_whole(capsys, argv, start):
    """A flag value, model name or command of 100,000 characters came back whole in the one error line (100 KB)."""
    r = run_cli(capsys, *argv)
    assert r.code == 2 and r.one_error_line and r.out == "", r.err[:300]
    assert r.err.startswith(start) and len(r.err) < 1000 and "characters cut)" in r.err, r.err[:1200]


@pytest.mark.parametrize(("flag", "accepted"), [("--n", "an integer in [1, 128]"),
                                                ("--logprobs", "an integer in [0, 20]")])
def test_a_huge_value_for_a_flag_with_a_small_range_is_told_that_range(capsys, flag, accepted):
    """--n 99999999999999999999999 was "expected an integer of at most 2**63 - 1" where --n 200 was "expected an
    integer in [1, 128]": one flag, two different ranges, the first not what it accepts."""
    for text in ("99999999999999999999999", "200"):
        r = run_cli(capsys, "generate", "tiny-llama", "--prompt-ids", "1,2,3", flag, text)
        assert r.err == f"error: {flag}: expected {accepted}, got '{text}'\n", r.err
        assert (r.code, r.out) == (2, "")


@FAST
@given(flag=st.sampled_from(["--requests", "--seed"]), text=st.one_of(too_big, huge_digits, non_positive))
def test_simulate_numbers_at_the_edges(capsys, flag, text):
    if flag == "--seed" and text == "0":
        text = "-1"  # 0 is a good seed
    r = run_cli(capsys, "simulate", "tiny-llama", "--workload", "no-reuse", f"{flag}={text}")
    assert_refused(r, flag)


YAML_NUMBERS = ["9" * 5000, str(2**64), "-1", "1e400", ".inf", ".nan", "0x7fffffffffffffffff", "4.5"]


@pytest.mark.parametrize("field", ["max_batch_size", "kv_cache_config.max_tokens", "kv_cache_config.tokens_per_block",
                                   "kv_cache_config.max_gpu_total_bytes", "max_seq_len"])
def test_yaml_numbers_at_the_edges(capsys, tmp_path, out, field):
    cfg = tmp_path / "n.yaml"
    for text in YAML_NUMBERS:
        *parents, leaf = field.split(".")
        body = f"{leaf}: {text}\n" if not parents else f"{parents[0]}:\n  {leaf}: {text}\n"
        cfg.write_text(body)
        r = _plan(capsys, "tiny-llama", "--config", cfg, audit=out / "a.jsonl")
        needle = "5000 digits" if len(text) > 40 else leaf
        try:
            assert_refused(r, "n.yaml", needle, folder=out)
        except AssertionError as exc:
            raise AssertionError(f"{field}: {text[:20]}: {exc}") from None


@pytest.mark.parametrize(("text", "value"), [
    # YAML 1.2 core schema, not PyYAML's YAML 1.1: a leading zero is decimal, base 60 is no number
    ("064", 64), ("-064", -64), ("00", 0), ("0o100", 64), ("0x40", 64), ("1_000", 1000),
    ("1:30", "1:30"), ("2:00:00", "2:00:00"), ("0b1000000", "0b1000000"), ("1_", "1_"),
    ("1:30.5", "1:30.5"), ("1e-3", 0.001), ("1e3", 1000.0), ("1_0.5", 10.5), (".5", 0.5), ("-.inf", float("-inf")),
    ("yes", "yes"), ("True", True), ('!!int "064"', 64),
    # 1.1's timestamps and "=" are strings in 1.2's core schema (a date was a datetime.date, "=" had no constructor)
    ("2024-01-01", "2024-01-01"), ("2001-12-14t21:59:43.10-05:00", "2001-12-14t21:59:43.10-05:00"), ("=", "="),
])
def test_yaml_numbers_read_as_yaml_1_2(text, value):
    import yaml

    from pipeline.sources import StrictLoader

    assert yaml.load(f"x: {text}\n", Loader=StrictLoader) == {"x": value}


def test_a_folder_named_like_a_date_is_the_same_folder_in_the_config_file_as_on_the_flag(capsys, tmp_path,
                                                                                         monkeypatch):
    """`generation_config: 2024-01-01` was YAML 1.1's datetime.date, refused ("got datetime.date(2024, 1, 1)") where
    `--generation_config 2024-01-01` took the folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "2024-01-01").mkdir()
    (tmp_path / "2024-01-01" / "generation_config.json").write_text('{"temperature": 0.25}')
    (tmp_path / "c.yaml").write_text("generation_config: 2024-01-01\n")
    results = [_plan(capsys, "tiny-llama", *flags, "--json") for flags in
               (["--config", "c.yaml"], ["--generation_config", "2024-01-01"])]
    for r in results:
        assert r.code == 0, r.err
    file, flag = (json.loads(r.out)["sampling_defaults"]["defaults"] for r in results)
    assert file == flag == {"temperature": 0.25}


@pytest.mark.parametrize(("field", "text"), [
    ("kv_cache_config.tokens_per_block", "064"), ("max_batch_size", "1:30"), ("max_num_tokens", "2:00:00"),
    ("kv_cache_config.free_gpu_memory_fraction", "1:30.5"),
    # an underscore not between two digits: a string to YAML and to Python's int(); the flags read them as 10, their
    # underscores all dropped before int() saw them
    ("max_batch_size", "_10"), ("max_batch_size", "1__0"), ("kv_cache_config.tokens_per_block", "10_"),
])
def test_a_yaml_number_gets_the_flags_verdict(capsys, tmp_path, out, field, text):
    """One verdict per value: 064 was octal 52 in a --config file and 64 as a flag; 1:30 was 90 (base 60) in a
    file and refused as a flag."""
    *parents, leaf = field.split(".")
    cfg = tmp_path / "n.yaml"
    cfg.write_text(f"{leaf}: {text}\n" if not parents else f"{parents[0]}:\n  {leaf}: {text}\n")
    flag = f"--{leaf}" if leaf != "free_gpu_memory_fraction" else "--kv_cache_free_gpu_memory_fraction"
    from_file = _plan(capsys, "tiny-llama", "--config", cfg, "--json")
    from_flag = _plan(capsys, "tiny-llama", flag, text, "--json")
    if text == "064":
        assert from_file.code == from_flag.code == 0, (from_file.err, from_flag.err)
        assert from_file.json()["args"]["kv_cache_config"]["tokens_per_block"] == 64
        assert from_flag.json()["args"]["kv_cache_config"]["tokens_per_block"] == 64
    else:
        assert_refused(from_file, "n.yaml", f"{field}: expected", f"got {text!r}", folder=out)
        assert_refused(from_flag, flag, repr(text))


@pytest.mark.parametrize(("field", "flag", "text", "value"), [
    ("max_batch_size", "--max_batch_size", "0x40", 64), ("max_seq_len", "--max-model-len", "0o100", 64),
    ("kv_cache_config.tokens_per_block", "--tokens_per_block", "+0x10", 16),
    ("kv_cache_config.max_gpu_total_bytes", "--max_gpu_total_bytes", "0x400000", 4 * 2**20),
    ("kv_cache_config.free_gpu_memory_fraction", "--kv_cache_fraction", "0o1", 1.0),
])
def test_a_yaml_octal_or_hex_number_means_the_same_as_a_flag(capsys, tmp_path, field, flag, text, value):
    """YAML 1.2's 0o/0x integers: max_batch_size: 0x40 was 64 in a --config file, --max_batch_size 0x40 was refused
    ("expected an integer"); one value, one verdict."""
    *parents, leaf = field.split(".")
    cfg = tmp_path / "n.yaml"
    cfg.write_text(f"{leaf}: {text}\n" if not parents else f"{parents[0]}:\n  {leaf}: {text}\n")
    budget = [] if leaf == "max_gpu_total_bytes" else ["--max_tokens", "4096"]
    from_file = _plan(capsys, "tiny-llama", "--config", cfg, "--json", *budget)
    from_flag = _plan(capsys, "tiny-llama", f"{flag}={text}", "--json", *budget)
    assert from_file.code == from_flag.code == 0, (from_file.err, from_flag.err)
    for r in (from_file, from_flag):
        args = r.json()["args"]
        assert (args[parents[0]] if parents else args)[leaf] == value


@pytest.mark.parametrize(("flag", "text", "says"), [
    ("--override_generation_config", '{"top_k": ' + "9" * 5000 + "}", "...: an integer of more than 4,300 digits"),
    ("--override_generation_config", '{"a":' * 100_000 + "1" + "}" * 100_000, "...: nested too deeply"),
    ("--override_generation_config", '{"temperature": NaN}', "'{\"temperature\": NaN}': NaN is not standard JSON"),
    ("--override_generation_config", "temperature=0.5", "'temperature=0.5': not JSON (Expecting value at column 1)"),
    ("--override_generation_config", "[1]", "'[1]': that is an array, not an object"),
    ("--hf-overrides", '"x"', "error: --hf-overrides: expected a JSON object, got '\"x\"': that is a string, not an "
                              "object"),
    # the example was the sampling one for every JSON flag
    ("--speculative-config", "ngram", "error: --speculative-config: expected a JSON object such as '{\"method\": "
                                      "\"ngram\", \"num_speculative_tokens\": 4}', got 'ngram': not JSON"),
])
def test_a_json_flag_that_is_no_object_says_why(capsys, out, flag, text, says):
    """'{"top_k": <5,000 digits>}' and 100,000 nested objects were "expected a JSON object, got '{...'", which they
    are: the reason was dropped."""
    assert_refused(_plan(capsys, "tiny-llama", flag, text, audit=out / "a.jsonl"), f"error: {flag}: ", says,
                   folder=out)


@settings(deadline=None, max_examples=100, derandomize=True)
@given(logits=st.lists(st.integers(-50, 50), min_size=2, max_size=64, unique=True),
       temperature=st.floats(min_value=5e-324, max_value=1e-30), top_p=st.floats(min_value=5e-324, max_value=1.0))
def test_tiny_temperature_samples_the_argmax_and_top_p_always_keeps_it(logits, temperature, top_p):
    """Hypothesis over logits: 1e-300-like temperatures act as greedy (no float32 overflow to NaN), and a top_p
    that rounds to 0 in float32 (1e-50) still keeps the most likely token."""
    import torch

    from engine.sampling import sample_token

    t = torch.tensor(logits, dtype=torch.float32)  # distinct by >= 1: one argmax, whatever the rounding
    gen = torch.Generator().manual_seed(0)
    assert sample_token(t, temperature, top_p, gen) == int(t.argmax())
    assert sample_token(t, 1.0, min(top_p, 1e-50), gen) == int(t.argmax())
    assert 0 <= sample_token(t, 1e300, 1.0, gen) < len(logits)


def test_generate_at_a_1e_300_temperature_and_1e_50_top_p_equals_greedy(capsys):
    base = ["generate", "tiny-llama", "--prompt-ids", "1,2,3", "--max_new_tokens", "4", "--max_tokens", "512"]
    greedy = run_cli(capsys, *base)
    tiny = run_cli(capsys, *base, "--temperature", "1e-300", "--top_p", "1e-50", "--seed", str(2**63 - 1))
    assert greedy.code == 0 and tiny.code == 0, tiny.err
    assert tiny.out.splitlines()[0] == greedy.out.splitlines()[0]


# --- the line names the culprit --------------------------------------------------------------------

def test_huge_tokens_per_block_is_named_not_max_tokens(capsys, out):
    r = run_cli(capsys, "generate", "tiny-llama", "--prompt-ids", "1,2,3", "--tokens_per_block", "99999999999",
                "--audit-log", out / "a.jsonl")
    assert_refused(r, "tokens_per_block", folder=out)
    assert "max_tokens" not in r.err


@pytest.mark.parametrize(("flags", "field"), [
    (["--max_tokens", str(2**63 - 1)], "lower kv_cache_config.max_tokens"),
    (["--max_seq_len", str(2**63 - 1)], "lower max_seq_len"),  # the default budget: 16 such sequences
])
def test_a_compare_budget_past_int64_names_what_set_it_not_max_gpu_total_bytes(capsys, out, flags, field):
    """--compare hands both managers the routed budget as max_gpu_total_bytes: past 2**63 - 1 the line was
    "--max_gpu_total_bytes: expected an integer >= 0 and at most 2**63 - 1", a flag nobody typed."""
    r = run_cli(capsys, "plan", "tiny-llama", "--compare", *flags, "--audit-log", out / "a.jsonl")
    assert_refused(r, "--compare plans both managers at one budget in bytes", field, folder=out)
    assert "max_gpu_total_bytes" not in r.err


def test_huge_max_new_tokens_is_capped_by_max_seq_len_not_refused(capsys, out):
    """generate sizes its CPU default pools from --max_new_tokens, capped at what max_seq_len lets a sample hold (the
    checkpoint's here): a huge value runs as the Python API runs it, and no internal field surfaces in an error."""
    every_token = ",".join(str(i) for i in range(512))  # tiny-llama's vocabulary: the first token ends the sample
    for huge in ("99999999999999", str(2**63 - 1)):
        r = run_cli(capsys, "generate", "tiny-llama", "--prompt-ids", "1,2,3", "--max_new_tokens", huge,
                    "--stop_token_ids", every_token, "--audit-log", out / f"a{len(huge)}.jsonl")
        assert r.code == 0, r.err
        assert "default_max_tokens" not in r.err and "kv_cache_config.max_tokens" not in r.err


def test_max_new_tokens_at_2_63_with_a_budget_is_named_by_the_request_check(capsys, out):
    """With --max_tokens the pools are the user's; max_new_tokens (cut to max_seq_len) that cannot fit them is
    refused naming max_new_tokens, not the pool default it would have derived."""
    r = run_cli(capsys, "generate", "tiny-llama", "--prompt-ids", "1,2,3", "--max_new_tokens", str(2**63 - 1),
                "--max_tokens", "1024", "--audit-log", out / "a.jsonl")
    assert "default_max_tokens" not in r.err, r.err
    assert_refused(r, "max_new_tokens", folder=out)


def test_default_max_tokens_at_2_63_is_capped_by_max_seq_len_not_refused(capsys, out, monkeypatch):
    """serve sizes its CPU pools for 8 sequences, at most 8 x max_seq_len, whatever gave the default length (as
    generate's --max_new_tokens): 2**63 - 1 starts the server, and no internal field surfaces."""
    from kvload.serve import server

    seen = {}

    def build_state(result, **kwargs):  # stop the command once the pools are built
        seen["budget"] = [e["max_tokens"] for e in result.audit.of("kv_budget_computed")]
        raise SystemExit(0)

    monkeypatch.setattr(server, "build_state", build_state)
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", "--device", "cpu", "--max_seq_len", "256",
                "--default-max-tokens", str(2**63 - 1), "--audit-log", out / "a.jsonl")
    assert seen == {"budget": [8 * 256]}, r.err
    assert "default_max_tokens" not in r.err and "Traceback" not in r.err


# --- silent acceptance -----------------------------------------------------------------------------

def test_an_empty_config_path_is_an_error(capsys, out):
    assert_refused(_plan(capsys, "tiny-llama", "--config", "", audit=out / "a.jsonl"), "--config", "empty path",
                   folder=out)


@pytest.mark.parametrize(("text", "where"), [("max_batch_size:\t4\n", "line 1 column 16"),
                                           ("kv_cache_config:\n\tmax_tokens: 4096\n", "line 2 column 1")],
                         ids=["after-colon", "indent"])
def test_a_tab_in_yaml_says_to_use_spaces(capsys, tmp_path, out, text, where):
    """PyYAML's words alone ("found character '\\t' that cannot start any token") left the fix to guess; a tab after
    "key:" is even valid YAML 1.2, which PyYAML does not read."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    assert_refused(_plan(capsys, "tiny-llama", "--config", cfg, audit=out / "a.jsonl"),
                   f"c.yaml: {where}: malformed YAML: found character '\\t' that cannot start any token; use spaces "
                   "there, not a tab", folder=out)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None, max_examples=40,
          derandomize=True)
@given(key=st.sampled_from(["max_batch_size", "kv_cache_config", "tokens_per_block", "max_tokens", "dtype"]),
       same=st.booleans(), gap=st.integers(0, 3))
def test_a_key_given_twice_in_yaml_is_an_error(capsys, tmp_path_factory, key, same, gap):
    """Generated: top-level and nested duplicates, equal or different values, other keys in between."""
    values = {"max_batch_size": ("4", "8"), "tokens_per_block": ("16", "64"), "max_tokens": ("64", "128"),
              "dtype": ("float32", "float16"), "kv_cache_config": ("{max_tokens: 64}", "{tokens_per_block: 16}")}
    first, second = values[key]
    filler = ["enable_block_reuse: true", "enable_partial_reuse: true", "max_util_for_resume: 0.9"][:gap]
    if key in ("tokens_per_block", "max_tokens"):
        lines = ["kv_cache_config:", f"  {key}: {first}", *(f"  {f}" for f in filler),
                 f"  {key}: {first if same else second}"]
    else:
        lines = [f"{key}: {first}", *["max_num_tokens: 1000", "max_seq_len: 512", "device: cpu"][:gap],
                 f"{key}: {first if same else second}"]
    cfg = tmp_path_factory.mktemp("dup") / "dup.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    r = _plan(capsys, "tiny-llama", "--config", cfg)
    assert_refused(r, "dup.yaml", f"'{key}' appears twice", f"line {len(lines)}")


def test_settings_that_do_nothing_say_so(capsys, out):
    log = out / "a.jsonl"
    r = _plan(capsys, "tiny-llama", "--kv_cache_fraction", "0.5", "--max_beam_width", "2", audit=log)
    assert r.code == 0, r.err
    ignored = {e["field"]: e for e in read_events(log) if e["event"] == "setting_ignored"}
    assert "kv_cache_config.free_gpu_memory_fraction" in ignored and "max_beam_width" in ignored
    assert "setting_ignored" in r.err  # the held warnings are released on success


def test_a_max_seq_len_past_the_checkpoints_positions_says_so_once(capsys, out):
    """Accepted with no word before; now one warning on stderr at the default level, and in the audit log."""
    log = out / "a.jsonl"
    r = _plan(capsys, "tiny-llama", "--max_seq_len", "16384", audit=log)
    assert r.code == 0, r.err
    [event] = [e for e in read_events(log) if e["event"] == "max_seq_len_beyond_positions"]
    assert (event["max_seq_len"], event["max_position_embeddings"], event["source"]) == (16384, 8192, "cli")
    assert "lower max_seq_len (--max_seq_len) to 8192" in event["reason"]
    [line] = [line for line in r.err.splitlines() if "max_seq_len_beyond_positions" in line]
    assert "warning" in line and "max_position_embeddings=8192" in line
    assert verify_log(AuditLog.from_jsonl(log))["ok"]
    chain = run_cli(capsys, "explain", log, "max_seq_len")  # the field's chain shows the warning as a kept step
    assert chain.code == 0 and "resolve_auto" in chain.out and "16384 (kept)" in chain.out


def test_v2_settings_with_nothing_to_act_on_say_so(capsys, tmp_path, out):
    cfg = tmp_path / "v2.yaml"
    cfg.write_text("kv_cache_config:\n  use_kv_cache_manager_v2: true\n  host_cache_size: 0\n"
                   "  max_util_for_resume: 0.5\n  enable_swa_scratch_reuse: true\n")
    log = out / "a.jsonl"
    r = _plan(capsys, "tiny-llama", "--config", cfg, "--max_tokens", "4096", audit=log)  # no sliding layers
    assert r.code == 0, r.err
    ignored = {e["field"]: e["reason"] for e in read_events(log) if e["event"] == "setting_ignored"}
    assert "host tier" in ignored["kv_cache_config.max_util_for_resume"]
    assert "no sliding-window layers" in ignored["kv_cache_config.enable_swa_scratch_reuse"]


@pytest.mark.parametrize(("flags", "says"), [
    (("--tokens_per_block", "1024", "--max_tokens", "256"), "max_tokens (256) rounds up to whole blocks of 1024"),
    (("--tokens_per_block", "16384", "--max_tokens", "65536"), "tokens_per_block (16384) is above max_seq_len (8192)"),
])
def test_blocks_that_blow_past_the_cap_or_the_longest_sequence_say_so(capsys, out, flags, says):
    # --max_tokens is met in whole blocks: a block far larger than the cap, or than any sequence, is warned about
    log = out / "a.jsonl"
    r = _plan(capsys, "tiny-llama", *flags, audit=log)
    assert r.code == 0, r.err
    (warned,) = [e for e in read_events(log) if e["event"] == "kv_blocks_oversized"]
    assert says in warned["reason"] and "--tokens_per_block" in warned["advice"]
    assert "kv_blocks_oversized" in r.err
    quiet = out / "b.jsonl"  # rounding up by less than the cap itself is what whole blocks mean: nothing said
    assert _plan(capsys, "tiny-llama", "--tokens_per_block", "64", "--max_tokens", "40", audit=quiet).code == 0
    assert not [e for e in read_events(quiet) if e["event"] == "kv_blocks_oversized"]


def test_blocks_past_generates_own_pool_default_name_that_default_not_max_tokens(capsys, out):
    log = out / "a.jsonl"  # generate sizes the pools at 1 x (2 + 1024) tokens: one 4,096-token block is ~4x that
    r = run_cli(capsys, "generate", "tiny-llama", "--prompt-ids", "1,2,3", "--max_new_tokens", "2",
                "--tokens_per_block", "4096", "--audit-log", log)
    assert r.code == 0, r.err
    (warned,) = [e for e in read_events(log) if e["event"] == "kv_blocks_oversized"]
    assert warned["reason"].startswith("kv_cache_config.default_max_tokens (1026) rounds up")


def test_window_scratch_reuse_without_prefix_reuse_says_it_does_nothing(capsys, tmp_path, out):
    # out-of-window blocks are kept for prefix hits; with block reuse off nothing can ever hit them
    cfg = tmp_path / "swa.yaml"
    cfg.write_text("kv_cache_config:\n  enable_swa_scratch_reuse: true\n")
    log = out / "a.jsonl"
    r = _plan(capsys, "tiny-mistral", "--use_kv_cache_manager_v2", "true", "--disable_kv_cache_reuse", "--config",
              cfg, "--max_tokens", "4096", audit=log)
    assert r.code == 0, r.err
    ignored = {e["field"]: e["reason"] for e in read_events(log) if e["event"] == "setting_ignored"}
    assert "enable_block_reuse=false" in ignored["kv_cache_config.enable_swa_scratch_reuse"]
    log2 = out / "b.jsonl"  # with reuse on, the setting acts: nothing said
    r = _plan(capsys, "tiny-mistral", "--use_kv_cache_manager_v2", "true", "--config", cfg, "--max_tokens", "4096",
              audit=log2)
    assert r.code == 0, r.err
    assert not [e for e in read_events(log2) if e["event"] == "setting_ignored"
                and e["field"] == "kv_cache_config.enable_swa_scratch_reuse"]


def test_sampling_settings_under_greedy_say_they_do_nothing(capsys, out):
    log = out / "g.jsonl"
    r = run_cli(capsys, "generate", "tiny-llama", "--prompt-ids", "1,2,3", "--max_new_tokens", "2", "--max_tokens",
                "512", "--seed", "7", "--top_p", "0.5", "--audit-log", log)
    assert r.code == 0, r.err
    ignored = {e["field"]: e["reason"] for e in read_events(log) if e["event"] == "setting_ignored"}
    assert set(ignored) == {"generate.seed", "generate.top_p"} and "greedy" in ignored["generate.seed"]
    assert verify_log(AuditLog.from_jsonl(log))["ok"]


# --- audit files as input --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_log(tmp_path_factory) -> Path:
    import pipeline

    path = tmp_path_factory.mktemp("real") / "real.jsonl"
    pipeline.plan("tiny-deepseek-v4", audit_log=path, log=False)
    return path


REPLACEMENTS = [5, "x", {}, None, True]


def test_every_record_mutation_is_caught(real_log, tmp_path):
    """The record mutator: each field of each record (and each key one level inside an object field) deleted or
    replaced by a wrong value (~1,200 cases).
    Each one is either refused on reading (AuditError naming the file and the line) or fails --verify;
    none passes, none crashes."""
    from kvload.explain import explain, render_explain, render_summary, summarize

    records = read_events(real_log)
    path = tmp_path / "m.jsonl"
    cases = refused = 0

    def places(record):  # (container, key) for every field, and every key one level inside an object field
        for key in [k for k in record if k not in (PREV, HEAD)]:
            yield record, key
            if isinstance(record[key], dict):
                for sub in list(record[key])[:6]:
                    yield record[key], sub

    for i in range(1, len(records)):
        for n_place in range(len(list(places(records[i])))):
            for value in [..., *REPLACEMENTS]:
                mutated = copy.deepcopy(records)
                holder, key = list(places(mutated[i]))[n_place]
                if value is not ... and holder[key] == value:
                    continue
                if value is ...:
                    del holder[key]
                else:
                    holder[key] = value
                write_events(path, mutated)
                cases += 1
                try:
                    log = AuditLog.from_jsonl(path)
                except AuditError as exc:
                    assert str(exc).startswith(f"{path}: line {i + 1}: "), (key, value, str(exc))
                    refused += 1
                    continue
                check = verify_log(log)
                assert not check["ok"], (i, key, value)
                # what was not refused is still readable by every report, without a crash
                render_summary(summarize(log, str(path)), check)
                render_explain(explain(log))
    assert cases >= 1100 and refused >= cases // 2, (cases, refused)


@pytest.mark.parametrize(("name", "edit", "needle"), [
    ("schema_version true", lambda r: r[0].update(schema_version=True), "schema_version true"),
    ("schema_version '1'", lambda r: r[0].update(schema_version="1"), "schema_version '1'"),
    # printed by `kvload audit` as it was: a list as Python's repr, 100,000 characters as one line
    ("kvload_version 5", lambda r: r[0].update(kvload_version=5), "kvload_version 5: expected the version string"),
    ("kvload_version long", lambda r: r[0].update(kvload_version="9" * 100_000), "at most 64 characters"),
    ("args: 5", lambda r: r[-1].update(args=5), "'args' must be an object"),
    ("field into a string", lambda r: next(e for e in r if e["event"] == "args_parsed").update(field="model.x"),
     "not an LlmArgs field"),
    ("no kv_manager", lambda r: next(e for e in r if e["event"] == "executor_routed").pop("kv_manager"),
     "executor_routed without 'kv_manager'"),
    ("list for a dict", lambda r: next(e for e in r if e["event"] == "user_fields_snapshotted").update(fields=[1]),
     "'fields' must be an object"),
    ("unknown event", lambda r: r[3].update(event="made_up"), "unknown event 'made_up'"),
    # two logs joined (cat a.jsonl b.jsonl): "unknown event 'audit_header' (not in this kvload's audit schema)"
    ("second header", lambda r: r.extend(copy.deepcopy(r)),
     "a second audit_header (the first is line 1): an audit file holds one run's log; were two logs joined"),
])
def test_malformed_records_name_the_file_and_line(capsys, real_log, tmp_path, name, edit, needle):
    records = read_events(real_log)
    edit(records)
    path = tmp_path / "bad.jsonl"
    write_events(path, records)
    r = run_cli(capsys, "audit", path, "--verify")
    assert_refused(r, str(path), "line ", needle)


@pytest.mark.parametrize("command", [["audit", "--verify"], ["explain", "max_seq_len"]])
def test_an_audit_log_with_a_byte_that_is_not_utf8_names_its_line(capsys, real_log, tmp_path, command):
    """A byte flipped on a disk, or a log re-saved in Latin-1 (``Ã©`` for é): "cannot read audit file
    (UnicodeDecodeError)" named neither the line nor what an audit log holds."""
    raw = real_log.read_bytes().split(b"\n")
    raw[3] = raw[3].replace(b'"', b'"\xe9', 1)
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b"\n".join(raw))
    r = run_cli(capsys, command[0], path, *command[1:])
    assert r.err == f"error: {path}: line 4: not UTF-8 (byte 0xe9); an audit log is JSON Lines in UTF-8\n"
    assert (r.code, r.out) == (2, "")


@pytest.mark.parametrize("command", [["audit", "--verify"], ["explain", "max_seq_len"]])
def test_an_audit_line_past_the_line_limit_is_refused_naming_it_before_the_rest_is_read(capsys, real_log, tmp_path,
                                                                                        command):
    """A 400 MB line (under the 512 MB file cap) was read whole, decoded and split: 1.6 GB of memory to refuse it as
    "unknown event". Lines are read at most ``MAX_AUDIT_LINE_BYTES`` at a time; one of exactly that many bytes, its
    newline included, is still read as a record."""
    from pipeline.audit import MAX_AUDIT_LINE_BYTES

    raw = real_log.read_bytes().split(b"\n")
    record = json.loads(raw[3])

    def padded(size: int) -> bytes:  # raw[3] with a "pad" field making its line (newline included) size bytes
        line = json.dumps({**record, "pad": ""}, separators=(",", ":")).encode()
        return line[:-2] + b"x" * (size - len(line) - 1) + line[-2:] + b"\n"

    for size in (MAX_AUDIT_LINE_BYTES, MAX_AUDIT_LINE_BYTES + 1):
        path = tmp_path / f"long{size}.jsonl"
        line = padded(size)
        assert len(line) == size
        path.write_bytes(b"\n".join([*raw[:3], line[:-1], *raw[4:]]))
        r = run_cli(capsys, command[0], path, *command[1:])
        if size == MAX_AUDIT_LINE_BYTES:  # read as a record (the chain then breaks at the edit; explain reads it)
            assert "longer than" not in r.err, r.err
            continue
        assert (r.code, r.out) == (2, ""), r.err
        assert r.err == (f"error: {path}: line 4: longer than {MAX_AUDIT_LINE_BYTES:,} bytes, the longest line an "
                         "audit log is read with (kvload's records are a few KB)\n")


@pytest.mark.parametrize("command", [["audit"], ["audit", "--verify"], ["explain"]])
def test_control_characters_in_an_audit_files_text_stay_escaped_on_one_line(capsys, real_log, tmp_path, command):
    """An audit file is input anyone may have written: its free text (a reason, the header's version) reached the
    terminal as it was, so an escape sequence cleared the screen or recoloured it and a newline forged a table row."""
    clean = read_events(real_log)
    path = tmp_path / "clean.jsonl"
    write_events(path, clean)
    expected = run_cli(capsys, *command[:1], path, *command[1:]).out.count("\n")
    records = copy.deepcopy(clean)
    records[0]["kvload_version"] = "0.1\x1b[2J\nforged"
    for record in records:
        if record["event"] == "auto_resolved":
            record["reason"] = "why\x1b]0;title\x07\nverify  ok: forged\r"
    path = tmp_path / "escapes.jsonl"
    write_events(path, records)
    r = run_cli(capsys, *command[:1], path, *command[1:])
    assert not any((ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) < 0xA0 for c in r.out), r.out
    assert r.out.count("\n") == expected
    assert "why\\x1b]0;title\\x07\\nverify  ok: forged\\r" in r.out


def _rechain(records: list[dict], key: bytes | None = None) -> list[dict]:
    """What a forger does after editing: recompute every link (possible without a key, impossible with one)."""
    chain = Chain(key)
    out = []
    header = {k: v for k, v in records[0].items() if k not in (PREV, HEAD)}
    header["chain"] = chain.kind
    chain.link(header)
    out.append(header)
    for record in records[1:]:
        r = {k: v for k, v in record.items() if k not in (PREV, HEAD)}
        r[PREV] = chain.head
        chain.link(r)
        out.append(r)
    out[-1][HEAD] = chain.head
    return out


def _forge_v2_true(records: list[dict]) -> list[dict]:
    """Claim a tiny-llama plan resolved use_kv_cache_manager_v2 to true and routed V2, consistently everywhere."""
    v2 = "kv_cache_config.use_kv_cache_manager_v2"
    for r in records:
        if r["event"] == "auto_resolved" and r["field"] == v2:
            r["new"] = True
        if r["event"] == "executor_routed":
            r.update(kv_manager="KVCacheManagerV2", scheduler="KVCacheV2Scheduler", use_kv_cache_manager_v2=True)
        if r["event"] == "pipeline_finished":
            r["args"]["kv_cache_config"]["use_kv_cache_manager_v2"] = True
            r["route"].update(kv_manager="KVCacheManagerV2", scheduler="KVCacheV2Scheduler",
                              use_kv_cache_manager_v2=True)
    return records


def test_an_edited_args_parsed_contradicting_the_snapshot_fails_even_rechained(capsys, tmp_path):
    import pipeline

    log = tmp_path / "a.jsonl"
    pipeline.plan("tiny-llama", max_batch_size=8, audit_log=log, log=False)
    records = read_events(log)
    for r in records:
        if r["event"] == "args_parsed" and r["field"] == "max_batch_size":
            r["new"] = 16
        if r["event"] == "pipeline_finished":
            r["args"]["max_batch_size"] = 16
    write_events(log, _rechain(records))
    check = verify_log(AuditLog.from_jsonl(log))
    assert not check["ok"] and any("user_fields_snapshotted" in p for p in check["problems"]), check["problems"]


def test_a_consistent_forgery_passes_sha256_but_not_the_hmac_key(capsys, tmp_path, monkeypatch):
    """The limit of an unkeyed chain, and what the key adds: a forgery that edits a value event and the final
    args consistently and recomputes the chain verifies without a key; with KVLOAD_AUDIT_KEY it cannot."""
    import pipeline

    plain = tmp_path / "plain.jsonl"
    pipeline.plan("tiny-llama", audit_log=plain, log=False)
    forged = _rechain(_forge_v2_true(read_events(plain)))
    write_events(plain, forged)
    check = verify_log(AuditLog.from_jsonl(plain))
    assert check["ok"], check["problems"]  # sha256 alone cannot tell: said so in the guarantee
    assert "anyone can recompute" in check["chain"]["guarantee"]

    monkeypatch.setenv(KEY_ENV, "the operator's secret")
    signed = tmp_path / "signed.jsonl"
    pipeline.plan("tiny-llama", audit_log=signed, log=False)
    ok = run_cli(capsys, "audit", signed, "--verify")
    assert ok.code == 0 and "hmac-sha256 chain verified with KVLOAD_AUDIT_KEY" in ok.out
    for forger_key in (None, b"a guess"):
        write_events(signed, _rechain(_forge_v2_true(read_events(signed)), forger_key))
        r = run_cli(capsys, "audit", signed, "--verify")
        assert r.code == 1 and "does not verify" in r.err and "chain" in r.out, (forger_key, r.out)


def test_an_audit_key_that_is_not_utf8_signs_and_verifies_as_its_bytes(capsys, tmp_path, monkeypatch):
    """``KVLOAD_AUDIT_KEY`` of random bytes: every command that wrote or verified an audit exited 1 with "error:
    UnicodeEncodeError: 'utf-8' codec can't encode characters ...: surrogates not allowed", naming no variable. The
    key is the bytes the environment holds; the log it signs verifies with those bytes only."""
    monkeypatch.setenv(KEY_ENV, os.fsdecode(b"\xff\xfe the operator's random key"))
    log = tmp_path / "a.jsonl"
    assert _plan(capsys, "tiny-llama", audit=log).code == 0
    ok = run_cli(capsys, "audit", log, "--verify")
    assert ok.code == 0 and "hmac-sha256 chain verified with KVLOAD_AUDIT_KEY" in ok.out, ok.err
    monkeypatch.setenv(KEY_ENV, os.fsdecode(b"\xff\xfd the operator's random key"))
    r = run_cli(capsys, "audit", log, "--verify")
    assert r.code == 1 and "does not verify" in r.err and "chain" in r.out


def test_old_logs_without_a_chain_read_and_say_no_chain(capsys, real_log, tmp_path, monkeypatch):
    old = tmp_path / "old.jsonl"
    records = [{k: v for k, v in r.items() if k not in (PREV, HEAD, "chain")} for r in read_events(real_log)]
    write_events(old, records)
    r = run_cli(capsys, "audit", old, "--verify")
    assert r.code == 0, r.err
    assert "chain   no chain: this log predates hash chaining" in r.out
    monkeypatch.setenv(KEY_ENV, "k")  # a key means "prove the origin": an unchained log cannot
    r = run_cli(capsys, "audit", old, "--verify")
    assert r.code == 1 and "no hash chain" in r.out


@pytest.mark.parametrize(("name", "edit", "needle"), [
    ("record removed", lambda r: r.pop(5), "chain broken"),
    ("cut short", lambda r: r.pop(), "not sealed"),
    ("appended after the seal", lambda r: r.append({**r[-1], "seq": 999}), "sealed before the end"),
    ("reordered", lambda r: r.insert(6, r.pop(7)), "chain broken"),
    ("value edited", lambda r: r[9].update(stage="x"), "chain broken"),
])
def test_the_chain_catches_what_the_replay_cannot(real_log, tmp_path, name, edit, needle):
    records = read_events(real_log)
    edit(records)
    path = tmp_path / "t.jsonl"
    write_events(path, records)
    check = verify_log(AuditLog.from_jsonl(path))
    assert not check["ok"] and any(needle in p for p in check["problems"]), check["problems"]


def test_explain_and_audit_of_a_log_whose_chain_is_broken_say_so_on_stderr(capsys, real_log, tmp_path):
    """An edited log was explained without a word: `kvload explain` of one whose kv_cache_config.max_tokens `new` was
    changed showed the recorded final value over a chain that ends at another. The output is still the file's, but
    one warning line on stderr names the break (exit 0; `audit --verify` is still the check that exits 1)."""
    clean = [run_cli(capsys, "explain", real_log), run_cli(capsys, "audit", real_log)]
    assert [(r.code, r.err) for r in clean] == [(0, ""), (0, "")]
    records = read_events(real_log)
    records[9].update(stage="x")
    path = tmp_path / "t.jsonl"
    write_events(path, records)
    for argv in (["explain", path], ["explain", path, "--json"], ["audit", path], ["audit", path, "--json"]):
        r = run_cli(capsys, *argv)
        assert r.code == 0 and r.out, argv
        assert r.err == (f"warning: {path}: its hash chain is broken (line 11: chain broken ('prev' does not match "
                         "the record before): a record was edited, removed, inserted or reordered): what follows is "
                         f"what the file says, not necessarily what kvload recorded; kvload audit {path} --verify "
                         "lists every problem\n"), argv
    r = run_cli(capsys, "audit", path, "--verify")
    assert r.code == 1 and "warning" not in r.err  # the error line says it


# --- files -----------------------------------------------------------------------------------------

def test_audit_log_at_a_fifo_or_device_is_refused_and_left_alone(capsys, tmp_path):
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    for target in (fifo, Path("/dev/null")):
        r = _plan(capsys, "tiny-llama", audit=target)
        assert_refused(r, "--audit-log", str(target), "not a regular file")
        assert not stat.S_ISREG(os.stat(target).st_mode)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    # reading one would block forever: refused as an audit file and as a config file
    assert_refused(run_cli(capsys, "audit", fifo), str(fifo), "not a regular file")
    assert_refused(_plan(capsys, "tiny-llama", "--config", fifo), str(fifo), "not a regular file")
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "nowhere")
    assert_refused(_plan(capsys, "tiny-llama", audit=dangling), "--audit-log", "symbolic link to nothing")


def _deny_search(monkeypatch, folder: Path) -> None:
    """What a directory the user cannot search (mode 700, another owner) does to Path.stat under it; the suite
    runs as root, which searches anything. Path.exists/is_file on Python 3.11 let this PermissionError out."""
    import errno

    real_stat = Path.stat

    def stat(self, *args, **kwargs):
        if folder in self.parents:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", stat)


def test_a_config_file_in_a_folder_the_user_cannot_search_says_permission_denied(capsys, tmp_path, out, monkeypatch):
    # was "error: parse_args: PermissionError: [Errno 13] ..."
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "c.yaml").write_text("max_batch_size: 4\n")
    _deny_search(monkeypatch, locked)
    r = _plan(capsys, "tiny-llama", "--config", locked / "c.yaml", audit=out / "a.jsonl")
    assert_refused(r, f"config file {locked / 'c.yaml'}: cannot read (permission denied)", folder=out)


def test_a_checkpoint_in_a_folder_the_user_cannot_search_says_permission_denied(capsys, tmp_path, out, monkeypatch):
    # was "error: apply_model_defaults: PermissionError: [Errno 13] ..."
    locked = tmp_path / "locked"
    ckpt = write_config(locked / "ckpt", BASE)
    _deny_search(monkeypatch, locked)
    r = _plan(capsys, ckpt, audit=out / "a.jsonl")
    assert_refused(r, f"model '{ckpt}': cannot read (permission denied)", folder=out)


@pytest.mark.parametrize(("kind", "needle"), [
    ("loop", "cannot read (Too many levels of symbolic links)"),  # was "cannot read (OSError)"
    ("latin1", "not UTF-8 (byte 0xe9 at offset 7); a YAML config is UTF-8 text"),  # was "(UnicodeDecodeError)"
    ("dangling", "is a symbolic link to nothing"),
])
def test_a_config_file_that_cannot_be_read_says_why(capsys, tmp_path, out, kind, needle):
    cfg = tmp_path / "c.yaml"
    if kind == "loop":
        cfg.symlink_to("c.yaml")
    elif kind == "dangling":
        cfg.symlink_to("nowhere.yaml")
    else:
        cfg.write_bytes(b"dtype: \xe9\n")
    r = _plan(capsys, "tiny-llama", "--config", cfg, audit=out / "a.jsonl")
    assert_refused(r, f"config file {cfg}: {needle}", folder=out)


@pytest.mark.skipif(not os.path.exists("/dev/null") or sys.platform == "win32", reason="needs /dev/null and symlinks")
def test_a_config_file_swapped_for_a_device_after_its_check_is_refused_not_read(tmp_path, monkeypatch):
    """The file was checked by one stat and read by its path again: one replaced in between by a link to a device was
    read unchecked (/dev/null as an empty config, silently; /dev/zero without end; a FIFO waited for a writer forever).
    Now it is opened once and checked and read through that descriptor."""
    import pipeline

    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_batch_size: 7\n")
    real_stat = Path.stat

    def stat_then_swap(self, *args, **kwargs):
        st = real_stat(self, *args, **kwargs)
        if self == cfg and not os.path.islink(cfg):  # the check saw the file; a link to a device takes its place
            os.unlink(cfg)
            os.symlink("/dev/null", cfg)
        return st

    monkeypatch.setattr(Path, "stat", stat_then_swap)
    with pytest.raises(ConfigError, match=rf"^config file {cfg}: not a regular file \(a FIFO or device\?\); give a "
                                          r"YAML file$"):
        pipeline.plan("tiny-llama", config_file=cfg, log=False)


_SWAP_TO_FIFO = """
import os, sys
from pathlib import Path
from kvload.cli.entry import main
target, real_stat, real_os_stat = Path(sys.argv[2]), Path.stat, os.stat
def swap():  # once the path was looked at, a FIFO takes the file's place (as another process could do)
    if not os.path.exists(str(target) + ".swapped"):
        os.unlink(target)
        os.mkfifo(target)
        open(str(target) + ".swapped", "w").close()
def path_stat(self, *args, **kwargs):
    st = real_stat(self, *args, **kwargs)
    if self == target:
        swap()
    return st
def os_stat(path, *args, **kwargs):
    st = real_os_stat(path, *args, **kwargs)
    if os.fspath(path) == str(target):
        swap()
    return st
Path.stat, os.stat = path_stat, os_stat
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("command", ["audit", "explain"])
def test_an_audit_file_swapped_for_a_fifo_after_its_check_does_not_hang_the_reader(capsys, tmp_path, command):
    """``audit``/``explain`` checked the path (a regular file?) and then opened it again by path: a FIFO swapped in
    between made the open wait for a writer forever. Now the file is opened first (without waiting) and the opened
    descriptor is checked and read: the reader ends, reading the log it opened or refusing the FIFO in one line."""
    log = tmp_path / "a.jsonl"
    assert _plan(capsys, "tiny-llama", audit=log).code == 0
    try:
        r = subprocess.run([sys.executable, "-c", _SWAP_TO_FIFO, command, str(log)], capture_output=True, text=True,
                           env={**ENV, "PYTHONPATH": str(REPO)}, cwd=tmp_path, timeout=60)
    except subprocess.TimeoutExpired:  # subprocess.run killed it
        pytest.fail(f"kvload {command} hung opening a FIFO swapped in for the audit file")
    if r.returncode == 0:
        assert "Traceback" not in r.stderr
    else:
        assert (r.returncode, r.stderr) == (2, f"error: {log}: not a regular file (a FIFO or device?), expected an "
                                               "audit .jsonl file\n")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("command", ["audit", "explain"])
def test_a_fifo_given_as_the_audit_file_is_refused_in_one_line_by_a_real_process(tmp_path, command):
    fifo = tmp_path / "a.jsonl"
    os.mkfifo(fifo)
    r = subprocess.run([sys.executable, "-m", "kvload", command, str(fifo)], capture_output=True, text=True,
                       env={**ENV, "PYTHONPATH": str(REPO)}, cwd=tmp_path, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (
        2, "", f"error: {fifo}: not a regular file (a FIFO or device?), expected an audit .jsonl file\n")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_checkpoint_json_file_swapped_for_a_fifo_after_its_check_does_not_hang_the_read(tmp_path):
    """A checkpoint's JSON files (config.json, generation_config.json, tokenizer_config.json) were checked by one
    stat and read by path again: a FIFO swapped in between blocked the read for ever. Now each is opened first
    (without waiting) and checked and read through that descriptor."""
    config = write_config(tmp_path / "ckpt", BASE) / "config.json"
    script = _SWAP_TO_FIFO.replace("from kvload.cli.entry import main",
                                   "from models.checkpoint import read_json_object")
    script = script.replace("sys.exit(main(sys.argv[1:]))",
                            "try:\n    print(sorted(read_json_object(target, 'a model config'))[:2])\n"
                            "except Exception as exc:\n    print(exc)")
    try:
        r = subprocess.run([sys.executable, "-c", script, "-", str(config)], capture_output=True, text=True,
                           env={**ENV, "PYTHONPATH": str(REPO)}, cwd=tmp_path, timeout=60)
    except subprocess.TimeoutExpired:  # subprocess.run killed it
        pytest.fail("reading config.json hung on a FIFO swapped in after its check")
    assert r.stdout in (f"{sorted(BASE)[:2]}\n",
                        f"{config}: not a regular file (a FIFO or device?), expected a JSON file\n"), r.stderr[-2000:]


def test_an_existing_audit_log_is_kept_unless_force(capsys, tmp_path):
    log = tmp_path / "a.jsonl"
    log.write_text("precious\n")
    assert_refused(_plan(capsys, "tiny-llama", audit=log), "--audit-log", "exists", "--force")
    assert log.read_text() == "precious\n" and [p.name for p in tmp_path.iterdir()] == ["a.jsonl"]
    r = _plan(capsys, "tiny-llama", "--force", audit=log)
    assert r.code == 0 and verify_log(AuditLog.from_jsonl(log))["ok"]


def test_two_outputs_on_one_file_are_refused_before_any_work(capsys, tmp_path, out):
    """``--chart X --audit-log X``: the chart was drawn, then the audit refused as "appeared while the run was going":
    exit 2 with the result on stdout and the chart left behind."""
    same = out / "same.png"
    r = run_cli(capsys, "plan", "tiny-llama", "--compare", "--chart", same, "--audit_log", same)
    assert_refused(r, f"--chart {same}: is also the --audit_log file; give each output a file of its own", folder=out)


def test_an_audit_log_on_the_config_file_it_reads_is_refused_even_with_force(capsys, tmp_path):
    """With ``--force`` the audit log replaced the ``--config`` file the run had read (a hard link too)."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max_batch_size: 4\n")
    (tmp_path / "link.yaml").hardlink_to(cfg)
    for log in (cfg, tmp_path / "link.yaml"):
        r = _plan(capsys, "tiny-llama", "--extra_llm_api_options", cfg, "--force", audit=log)
        assert_refused(r, f"--audit-log {log}: is the --extra_llm_api_options file this command reads")
    assert cfg.read_text() == "max_batch_size: 4\n"


def test_serve_refuses_its_audit_log_and_kv_events_file_on_one_file(tmp_path):
    """Both streams went into the one file (refused before the server starts, so checked here without one)."""
    from kvload.cli.commands import build_parser
    from kvload.cli.files import check_distinct_files
    from pipeline.errors import ConfigError

    same = str(tmp_path / "e.jsonl")
    argv = ["serve", "tiny-llama", "--audit-log", same, "--kv-events-file", same, "--event_buffer_max_size", "8"]
    with pytest.raises(ConfigError, match=f"^--kv-events-file {same}: is also the --audit-log file"):
        check_distinct_files(build_parser().parse_args(argv), argv)


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_audit_log_follows_the_umask(capsys, tmp_path, umask, mode):
    log = tmp_path / "a.jsonl"
    old = os.umask(umask)
    try:
        assert _plan(capsys, "tiny-llama", audit=log).code == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(log).st_mode) == mode


def test_an_unwritable_directory_names_the_flag_not_a_temporary(capsys, tmp_path, monkeypatch):
    """Root writes anywhere, so the refusal at creation is forced here; the next test uses a real read-only dir."""
    import pipeline.audit

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(pipeline.audit.os, "open", refuse)
    r = _plan(capsys, "tiny-llama", audit=tmp_path / "a.jsonl")
    assert_refused(r, "--audit-log", "Permission denied")
    assert ".tmp" not in r.err


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses directory permissions")
def test_a_read_only_directory_is_refused_before_any_work(capsys, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert_refused(_plan(capsys, "tiny-llama", audit=ro / "a.jsonl"), "--audit-log", "not writable")
    finally:
        ro.chmod(0o755)


# --- faults: real signals to real processes ------------------------------------------------------------

#: each signal a command is stopped by, its exit status (128 + its number) and how the one line names it
STOPS = [(signal.SIGTERM, 143, "terminated (SIGTERM)"), (signal.SIGINT, 130, "interrupted"),
         (signal.SIGHUP, 129, "hung up (SIGHUP)")]


@pytest.mark.parametrize(("signum", "code", "line"), STOPS)
def test_a_signal_during_run_leaves_nothing(tmp_path, signum, code, line):
    out = tmp_path / "out"
    out.mkdir()
    proc = start_kvload("run", "tiny-llama", "--max_tokens", "4096", "--audit-log", out / "a.jsonl", cwd=tmp_path)
    assert wait_for_temporary(proc, out), "the run never started writing its audit log"
    r = interrupt(proc, signum)
    assert_refused(r, f"{line}; the --audit-log file was not written", folder=out, code=code)


def _start_generate(script: str, tmp_path: Path, out: Path, **env: str) -> subprocess.Popen[str]:
    """``kvload generate`` of a 4,000-token reply run by ``python -c script`` (code that patches the process, then runs
    kvload's main), its audit log and temporaries in ``out``, ``env`` added to its environment."""
    return subprocess.Popen([sys.executable, "-c", script, "generate", "tiny-llama", "--prompt-ids", "1,2,3",
                             "--max_new_tokens", "4000", "--max_tokens", "65536", "--audit-log", out / "a.jsonl"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                                               "TMPDIR": str(out), **env},
                            preexec_fn=signals_as_a_terminal_gives_them)


@pytest.mark.parametrize("where", ["cleanup", "exit"])
@pytest.mark.parametrize(("first", "again"), [(STOPS[1], "SIGINT"), (STOPS[1], "SIGTERM"), (STOPS[0], "SIGINT")])
def test_a_stop_signal_again_while_the_first_one_is_cleaned_up_changes_nothing(tmp_path, first, again, where):
    """Ctrl-C pressed twice, a kill after a Ctrl-C, or torchrun passing a terminal's Ctrl-C on: the second signal was
    raised into the first one's cleanup or into the exit, and the user saw a traceback ("Exception ignored in ...
    KeyboardInterrupt", from torch's finalizers) or a process killed by SIGTERM (-15) instead of the first one's line
    and status. The stop under way is repeated: one line, the first signal's status, nothing left."""
    signum, code, line = first
    out = tmp_path / "out"
    out.mkdir()
    # the repeat sent from inside the audit's discard (the cleanup the first one started) or from an exit callback
    proc = _start_generate(signal_again_script("kvload.cli.entry:_close_audit"), tmp_path, out, AGAIN=again,
                           WHERE=where)
    try:
        assert proc.stdout.read(1)  # a token printed: generating
        r = interrupt(proc, signum)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert r.code == code, r.err[-2000:]
    assert [x for x in r.err.splitlines() if x.strip()] == \
        [f"error: {line}; the --audit-log file was not written"], r.err[-2000:]
    assert sorted(p.name for p in out.iterdir()) in ([], ["torchinductor_root"])


#: ``kvload generate`` whose exit hangs once its command ended on a stop (an exit callback that takes a minute: the
#: process group's end, a call on another thread waited for); ``REPEAT_S`` 0: every later stop signal is past the window
_HUNG_EXIT = """
import atexit, sys, time
from pipeline import signals
signals.REPEAT_S = 0.0
def hang():
    print("exiting", file=sys.stderr, flush=True)
    time.sleep(60)
atexit.register(hang)
from kvload.__main__ import main
sys.exit(main())
"""


@pytest.mark.parametrize("again", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_past_the_repeat_window_still_ends_a_hung_exit(tmp_path, again):
    """A Ctrl-C, then the exit hangs: a kill (or Ctrl-C) more than ``REPEAT_S`` after the first one must end the
    process, as it did before a repeated stop was ignored (a later one acts as before: the teardown's words). It was
    ignored for the whole exit, and only SIGKILL ended it. Ended by the signal's default action, nothing printed."""
    out = tmp_path / "out"
    out.mkdir()
    proc = _start_generate(_HUNG_EXIT, tmp_path, out)
    try:
        assert proc.stdout.read(1)  # a token printed: generating
        proc.send_signal(signal.SIGINT)
        err = []
        while not err or err[-1] != "exiting\n":  # the command returned: the exit callback hangs
            line = proc.stderr.readline()
            assert line, "".join(err)
            err.append(line)
        proc.send_signal(again)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=40)  # within the minute the callback sleeps
        err.append(proc.stderr.read() if proc.poll() is not None else "(still running)")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -again, "".join(err)
    assert [x for x in "".join(err).splitlines() if x.strip()] == \
        ["error: interrupted; the --audit-log file was not written", "exiting"], "".join(err)


#: ``kvload run`` sending itself SIGTERM inside torch's import of numpy (torch's C start-up clears whatever that import
#: raises), then SIGINT at a later import
_STOP_IN_NUMPY_IMPORT = """
import os, signal, sys, time
class Sender:
    sent = set()
    def find_spec(self, fullname, path=None, target=None):
        sig = {"numpy._core._add_newdocs": signal.SIGTERM, "tqdm": signal.SIGINT}.get(fullname)
        if sig is not None and fullname not in Sender.sent:
            Sender.sent.add(fullname)
            os.kill(os.getpid(), sig)
            time.sleep(0.05)  # its handler runs here: raised into this import
        return None
sys.meta_path.insert(0, Sender())
from kvload.__main__ import main
sys.exit(main())
"""


def test_a_stop_signal_after_one_lost_in_torchs_start_up_still_stops_the_run(tmp_path):
    """A SIGTERM landing in torch's import of numpy is cleared there (torch goes on without numpy), so the stop
    never reaches kvload; a Ctrl-C right after it was then taken as that stop's repeat and dropped too, and the run
    finished: exit 0, its audit published, after two stop signals. The second one stops it now."""
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, "-c", _STOP_IN_NUMPY_IMPORT, "run", "tiny-llama", "--max_tokens", "4096",
                        "--audit-log", out / "a.jsonl"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       stdin=subprocess.DEVNULL, env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                                                      "TMPDIR": str(out)},
                       preexec_fn=signals_as_a_terminal_gives_them)
    lines = [x for x in r.stderr.splitlines() if x.strip() and "kv_budget_short" not in x]
    # 143: the SIGTERM lost in torch was sent again (or not lost: numpy imported elsewhere first); 130: the SIGINT
    # came first
    assert (r.returncode, lines) in ((130, ["error: interrupted; the --audit-log file was not written"]),
                                     (143, ["error: terminated (SIGTERM); the --audit-log file was not written"])), \
        (r.returncode, r.stderr[-2000:])
    assert sorted(p.name for p in out.iterdir()) in ([], ["torchinductor_root"])


#: a kvload process's ``sitecustomize``: inside torch's import of numpy (where torch's C start-up clears whatever the
#: import raises) it notes its pid in $HOLD_MARKS and sleeps until a stop signal raises into the sleep. The rank named
#: by $HOLD_KILL_RANK instead SIGKILLs itself once another rank holds there (torchrun then sends that one its SIGTERM).
#: $HOLD_NO_RESEND: kvload's watcher looks too late to send the lost stop again (the failure it causes comes first)
_HOLD_IN_NUMPY_IMPORT = """import os, signal, sys, time
if os.environ.get("HOLD_NO_RESEND"):
    import pipeline.signals
    pipeline.signals._WATCH_S = 3600.0
class Hold:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy._core._add_newdocs" and "kvload" in sys.argv[0]:  # not torchrun's own import
            sys.meta_path.remove(self)
            marks = os.environ["HOLD_MARKS"]
            if os.environ.get("RANK") == os.environ["HOLD_KILL_RANK"]:
                while not os.listdir(marks):
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
            open(os.path.join(marks, str(os.getpid())), "w").close()
            # short sleeps, not one: a stop whose C-level handler ran outside this sleep (taken by the stop-watcher
            # thread, or landing between the last check of pending handlers and the sleep's start) interrupts no
            # sleep, and its Python handler waited for the whole sleep's end (the process "hung" past the test's
            # 120 s with nothing printed); it runs in the main thread at the next of these
            for _ in range(3000):
                time.sleep(0.1)
        return None
sys.meta_path.insert(0, Hold())
"""


@pytest.mark.parametrize(("launch", "signum", "code", "line"), [
    ("one process", *STOPS[0]), ("one process", *STOPS[1]), ("one process, not sent again", *STOPS[0]),
    ("one process, not sent again, --debug", *STOPS[0]),
    pytest.param("kvload's launcher", *STOPS[0], marks=pytest.mark.slow),
    pytest.param("torchrun", *STOPS[0], marks=pytest.mark.slow)])
def test_a_stop_signal_lost_in_torchs_start_up_still_stops_the_command(tmp_path, launch, signum, code, line):
    """A stop signal landing in torch's import of numpy is cleared there (torch goes on without numpy): the command ran
    on and failed on the half-imported numpy (``load_weights: ModuleNotFoundError``, ``agree_ranks: ImportError``,
    exit 1 or 2), and a rank under torchrun, which sends one SIGTERM to the ranks left once one died, waited for the
    dead one until torchrun's SIGKILL 30 s later. The stop is sent again: the one line and 128 + its number (and a
    failure the lost stop caused before that is reported as the stop; ``--debug`` shows that failure's traceback
    first, which the stop's line hid)."""
    from tests.tp_support import free_port

    marks, hook = tmp_path / "marks", tmp_path / "hook"
    marks.mkdir()
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_HOLD_IN_NUMPY_IMPORT)
    argv = ["-m", "kvload", "generate", "tiny-llama", "--prompt-ids", "1,2,3", "--max_new_tokens", "2",
            "--max_tokens", "1024"]
    holding = 1
    debug = launch.endswith("--debug")
    if debug:
        argv = [*argv, "--debug"]
    if launch == "kvload's launcher":
        argv, holding = [*argv, "--tensor-parallel-size", "2"], 2
    elif launch == "torchrun":  # rank 1 dies once rank 0 holds: torchrun's one SIGTERM to rank 0 is the stop
        argv = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                str(free_port()), *argv, "--tp_size", "2"]
    proc = subprocess.Popen([sys.executable, *argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True,
                            preexec_fn=signals_as_a_terminal_gives_them,
                            env={**ENV, "PYTHONPATH": f"{hook}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1",
                                 "TRANSFORMERS_VERBOSITY": "error", "HOLD_MARKS": str(marks),
                                 "HOLD_KILL_RANK": "1" if launch == "torchrun" else "-",
                                 "HOLD_NO_RESEND": "1" if "not sent again" in launch else ""})
    try:
        if launch != "torchrun":
            deadline = time.monotonic() + 120
            while len(list(marks.iterdir())) < holding and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)  # until every process holds in the import
            proc.send_signal(signum)
        err = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            from tests.tp_support import kill_launch

            kill_launch(proc)
    assert len(list(marks.iterdir())) == holding, err[-3000:]  # the stop landed where torch drops it
    if debug:  # the failure's traceback, then the stop's one line and status
        tail = err[err.rindex("Traceback (most recent call last):"):]
        assert "Error" in tail.splitlines()[-2] and tail.endswith(f"\nerror: {line}\n"), err[-3000:]
        assert proc.returncode == code, err[-3000:]
        return
    assert "ImportError" not in err and "ModuleNotFoundError" not in err, err[-3000:]  # the numpy torch left half-done
    if launch == "torchrun":  # rank 0 ended on the stop, with its line, not by torchrun's SIGKILL
        assert f"error: {line}\n" in err and "exitcode  : 143 " in err, err[-3000:]
    else:
        assert (proc.returncode, err) == (code, f"error: {line}\n"), err[-3000:]


#: ``kvload generate`` whose command, at its end (``where``: before its ``--audit-log`` is published, or as ``_main``
#: returns), notes its pid in $HOLD_MARKS and sleeps until a stop signal raises into the sleep; that stop's exception is
#: dropped there, as code that drops every error drops it (torch's start-up does so in its import of numpy), and the
#: command returns at once, long before kvload's watcher's second look would have sent the stop again
_DROP_AT_THE_END = """import os, sys, time
import kvload.cli.entry as entry
def hold():
    try:  # the mark in the try too: a signal right after it is dropped as one in the sleep is
        open(os.path.join(os.environ["HOLD_MARKS"], str(os.getpid())), "w").close()
        for _ in range(3000):  # short sleeps (see _HOLD_IN_NUMPY_IMPORT)
            time.sleep(0.1)
    except BaseException:  # dropped unseen
        return
def wrap(name, before):
    inner = getattr(entry, name)
    def held(*args, **kwargs):
        if before and kwargs.get("ok"):
            hold()
        result = inner(*args, **kwargs)
        if not before:
            hold()
        return result
    setattr(entry, name, held)
wrap(*{"publish": ("_close_audit", True), "return": ("_main", False)}[os.environ["HOLD_WHERE"]])
from kvload.__main__ import main
sys.exit(main())
"""


@pytest.mark.parametrize("where", ["publish", "return"])
@pytest.mark.parametrize(("signum", "code", "line"), STOPS)
def test_a_stop_dropped_as_the_command_returns_still_stops_it(tmp_path, where, signum, code, line):
    """A stop signal whose exception was dropped unseen is sent again by kvload's watcher, but only while the command
    runs: one dropped in the last moments before the command returns was lost, and ``kill`` got exit 0 with nothing
    said, as if never stopped (its audit log published). Now it ends as a stop taken a moment earlier does: its one
    line and 128 + its number; dropped before the audit is published, the audit is discarded (and the line says so);
    dropped after it, the audit published stays and the line does not claim otherwise."""
    marks, out = tmp_path / "marks", tmp_path / "out"
    marks.mkdir()
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _DROP_AT_THE_END, "generate", "tiny-llama", "--prompt-ids", "1,2,3",
                             "--max_new_tokens", "2", "--max_tokens", "1024", "--audit-log", out / "a.jsonl"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, start_new_session=True, preexec_fn=signals_as_a_terminal_gives_them,
                            env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TMPDIR": str(out),
                                 "TRANSFORMERS_VERBOSITY": "error", "HOLD_MARKS": str(marks), "HOLD_WHERE": where})
    try:
        deadline = time.monotonic() + 240
        while not list(marks.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # until the command holds at its end
        proc.send_signal(signum)
        err = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(list(marks.iterdir())) == 1, err[-3000:]  # the stop landed where it is dropped
    left = sorted(p.name for p in out.iterdir() if p.name != "torchinductor_root")
    if where == "publish":
        assert (proc.returncode, err, left) == (code, f"error: {line}; the --audit-log file was not written\n", []), \
            err[-3000:]
    else:  # (the warnings came out with the command's success, before the stop: not checked)
        lines = [x for x in err.splitlines() if "[warning" not in x]
        assert (proc.returncode, lines, left) == (code, [f"error: {line}"], ["a.jsonl"]), err[-3000:]


def _read_terminal(master: int, until: Any, timeout: float = 240.0) -> bytes:
    """What a process wrote to the terminal ``master`` until ``until(seen)`` or the terminal closed (bounded)."""
    import select

    seen = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not until(seen):
        if not select.select([master], [], [], 0.5)[0]:
            continue
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every descriptor of the terminal's other side is closed
            break
        if not chunk:
            break
        seen += chunk
    return seen


@pytest.mark.parametrize(("signum", "code", "line"), STOPS[:2])
def test_a_signal_mid_reply_on_a_terminal_puts_the_error_on_its_own_line(tmp_path, signum, code, line):
    """A reply streams to the terminal token by token, with no newline until it ends: a SIGTERM or Ctrl-C mid-reply
    printed ``129 263 129 error: terminated (SIGTERM)``, the one line glued to the last token. The process leaves no
    child, no temporary and no audit file behind."""
    import pty
    import re

    out = tmp_path / "out"
    out.mkdir()
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "kvload", "generate", "tiny-llama", "--prompt-ids", "1,2,3",
                                 "--max_new_tokens", "4000", "--max_tokens", "65536", "--audit-log", out / "a.jsonl"],
                                stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=tmp_path,
                                env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TMPDIR": str(out)},
                                preexec_fn=signals_as_a_terminal_gives_them)
        os.close(slave)
        slave = -1
        try:
            before = _read_terminal(master, lambda seen: re.search(rb"(\d+ ){20}", seen) is not None)
            assert re.search(rb"(\d+ ){20}", before), before[-2000:]  # mid-reply: tokens printed, no newline yet
            children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True,
                                      text=True).stdout.split()
            proc.send_signal(signum)
            after = _read_terminal(master, lambda seen: False)
            assert proc.wait(timeout=60) == code
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        os.close(master)
        if slave != -1:
            os.close(slave)
    text = (before + after).decode().replace("\r\n", "\n")
    reply, _, tail = text.rpartition("error: ")
    assert reply.endswith(" \n"), text[-300:]  # the reply's last token, then its line ended
    assert tail == f"{line}; the --audit-log file was not written\n" and "Traceback" not in text, text[-2000:]
    assert children == [] and sorted(p.name for p in out.iterdir()) in ([], ["torchinductor_root"])


@pytest.mark.parametrize(("signum", "code", "line"), STOPS)
@pytest.mark.parametrize("module", ["structlog", "engine.workloads"])
def test_a_signal_in_start_up_gets_the_one_line_and_its_status(tmp_path, signum, code, line, module):
    """main armed SIGTERM, then imported the logging set-up (structlog) before _main's try: a SIGTERM there printed
    a traceback and exited 1, a SIGINT a traceback. Delivered deterministically when the CLI first imports
    ``module`` (logging set-up; building the parser), it gets the one line and 128 + its number."""
    script = ("import os, signal, sys\n"
              "class Hook:\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              f"        if name == {module!r}:\n"
              "            sys.meta_path.remove(self)\n"
              "            print('sent', file=sys.stderr)\n"
              f"            os.kill(os.getpid(), {int(signum)})\n"
              "sys.meta_path.insert(0, Hook())\n"
              "from kvload.cli.entry import main\n"
              "sys.exit(main(['generate', 'tiny-llama', '--prompt-ids', '1,2,3', '--max_new_tokens', '2']))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                       preexec_fn=signals_as_a_terminal_gives_them)
    assert r.stderr.startswith("sent\n"), r.stderr[-2000:]  # the signal came in start-up, not at some other time
    # no --audit-log, so nothing to say was not written (the line said "nothing was written" whatever was printed)
    assert r.stderr == f"sent\nerror: {line}\n" and r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert r.stdout == ""


#: sends SIGINT when the module named by $SIGNAL_ON_IMPORT is first looked up: imported by site at interpreter start,
#: so it is in place before the entry point's first line (a hook in ``python -c`` could not reach ``-m``'s imports)
SITECUSTOMIZE = """import os, signal, sys
class Hook:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["SIGNAL_ON_IMPORT"]:
            sys.meta_path.remove(self)
            print("sent", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGINT)
sys.meta_path.insert(0, Hook())
"""


def _console_script() -> str:
    """What pip writes as the ``kvload`` script for pyproject's entry point (``module:function``), as ``-c`` code."""
    import tomllib

    module, function = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["kvload"].split(":")
    return f"import sys\nfrom {module} import {function}\nsys.exit({function}())\n"


@pytest.mark.parametrize("launch", ["python -m kvload", "kvload script"])
@pytest.mark.parametrize("module", ["kvload.cli", "pipeline.config", "pipeline.signals"])
def test_a_ctrl_c_while_the_cli_is_imported_gets_the_one_line_and_130(tmp_path, launch, module):
    """A Ctrl-C before ``kvload.cli`` had loaded (the console script's ``from kvload.cli.entry import main``, ``-m``'s
    ``__main__``, main's own first import) printed a Python traceback. Sent while the import is provably under way
    (the import system is looking ``module`` up), it now gets ``error: interrupted`` and exit 130."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    start = ["-m", "kvload"] if launch == "python -m kvload" else ["-c", _console_script()]
    r = subprocess.run([sys.executable, *start, "plan", "tiny-llama"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env={**ENV, "PYTHONPATH": f"{hook}{os.pathsep}{REPO}", "SIGNAL_ON_IMPORT": module},
                       preexec_fn=signals_as_a_terminal_gives_them)
    assert r.stderr.startswith("sent\n"), r.stderr[-2000:]  # the signal came during the import, not at some other time
    assert (r.returncode, r.stderr) == (130, "sent\nerror: interrupted\n"), r.stderr[-2000:]
    assert r.stdout == ""


@pytest.mark.parametrize(("launch", "module"), [("kvload", "kvload.cli.plan"), ("kvload", "pipeline.runner"),
                                               ("kvload.cli", "pipeline.runner")])
def test_a_ctrl_c_inside_code_built_from_a_string_still_exits_130(tmp_path, launch, module):
    """A Ctrl-C raised inside an ``exec`` of a string (dataclasses and namedtuple build their methods so, at import:
    a serve interrupted while loading landed there often) was answered with the one line, but CPython had marked it
    unhandled and ``python -m`` ended the process by SIGINT: the parent saw -2, not the exit status 130. Sent from
    such an ``exec`` while ``module`` is looked up (in start-up; in the command)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE.replace(
        "os.kill(os.getpid(), signal.SIGINT)", 'exec("os.kill(os.getpid(), signal.SIGINT)\\nfor _ in range(3): pass")'))
    r = subprocess.run([sys.executable, "-m", launch, "plan", "tiny-llama"], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path,
                       env={**ENV, "PYTHONPATH": f"{hook}{os.pathsep}{REPO}", "SIGNAL_ON_IMPORT": module},
                       preexec_fn=signals_as_a_terminal_gives_them)
    assert (r.returncode, r.stderr, r.stdout) == (130, "sent\nerror: interrupted\n", ""), r.stderr[-2000:]


def test_a_reader_that_closes_the_pipe_early_gets_exit_141_and_no_audit(tmp_path):
    """``kvload generate ... | head -c 10``: the BrokenPipeError was answered with exit 0 after the run had already
    discarded its audit as failed, so an exit 0 came without the audit file it promises. The output was not all
    delivered: exit 141 (128 + SIGPIPE, as the shell reports for such a writer), one line, nothing left."""
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "kvload", "generate", "tiny-llama", "--prompt-ids", "1,2,3",
                             "--max_new_tokens", "1000", "--ignore_eos", "--audit-log", out / "a.jsonl"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=signals_as_a_terminal_gives_them, cwd=tmp_path,
                            env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout.read(10)  # the tokens have started to stream
        proc.stdout.close()  # as head does once it has its 10 bytes
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 141, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert err == ("error: the output was closed before it was all written (broken pipe); the --audit-log file was "
                   "not written\n"), err[-2000:]
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("unbuffered", [False, True], ids=["block-buffered", "PYTHONUNBUFFERED"])
def test_a_reader_gone_before_the_output_is_written_gets_exit_141_and_no_audit(tmp_path, unbuffered):
    """``kvload plan ... --audit-log a.jsonl | true``: the reader left before reading. Block-buffered (Python's
    default for a pipe), plan's table waited in the buffer until interpreter exit, after the audit file had been
    published for a success: exit 120 and two lines of "Exception ignored ... BrokenPipeError". The output was not
    delivered: exit 141, the one line, nothing left, however stdout is buffered."""
    out = tmp_path / "out"
    out.mkdir()
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before kvload starts: every write to the pipe fails, deterministically
    env = {k: v for k, v in ENV.items() if k != "PYTHONUNBUFFERED"}
    try:
        r = subprocess.run([sys.executable, "-m", "kvload", "plan", "tiny-llama", "--audit-log", out / "a.jsonl"],
                           stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=tmp_path, timeout=120,
                           env={**env, "PYTHONPATH": str(REPO), **({"PYTHONUNBUFFERED": "1"} if unbuffered else {})})
    finally:
        os.close(write_end)
    assert (r.returncode, r.stderr) == (141, "error: the output was closed before it was all written (broken pipe); "
                                             "the --audit-log file was not written\n")
    assert list(out.iterdir()) == []


def _stdout_closed() -> None:  # runs in the child before exec: `kvload ... >&-`
    os.close(1)


@pytest.mark.parametrize(("stdout", "argv", "line"), [
    ("full", ["plan", "tiny-llama"],
     "error: stdout: cannot write the result (No space left on device); the --audit-log file was not written"),
    ("closed", ["generate", "tiny-llama", "--prompt-ids", "1,2", "--max_new_tokens", "2"],
     "error: stdout is closed, so the result cannot be written (redirect it to a file or /dev/null instead of closing "
     "it); the --audit-log file was not written"),
], ids=["plan-full-disk", "generate-closed"])
def test_a_result_stdout_cannot_take_is_one_line_naming_stdout(tmp_path, stdout, argv, line):
    """``kvload plan ... > /dev/full`` (a full disk) said ``OSError: [Errno 28] No space left on device``, naming no
    output; with stdout closed (``>&-``) it was ``AttributeError: 'NoneType' object has no attribute 'write'``. The
    result was not delivered: exit 1, one line naming stdout, and the --audit-log is not published."""
    if stdout == "full" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    out = tmp_path / "out"
    out.mkdir()
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open("/dev/full", "w")) if stdout == "full" else None
        r = subprocess.run([sys.executable, "-m", "kvload", *argv, "--audit-log", out / "a.jsonl"], stdout=sink,
                           stderr=subprocess.PIPE, text=True, cwd=tmp_path, timeout=120,
                           env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                           preexec_fn=_stdout_closed if stdout == "closed" else None)
    assert (r.returncode, r.stderr) == (1, line + "\n"), r.stderr[-2000:]
    assert list(out.iterdir()) == []


@pytest.mark.parametrize(("stdout", "argv", "line"), [
    ("full", ["--help"], "error: stdout: cannot write the help (No space left on device)"),
    ("full", ["plan", "--help"], "error: stdout: cannot write the help (No space left on device)"),
    ("full", ["--version"], "error: stdout: cannot write the version (No space left on device)"),
    ("closed", ["--help"], "error: stdout is closed, so the help cannot be written (redirect it to a file or "
                           "/dev/null instead of closing it)"),
], ids=["help-full", "plan-help-full", "version-full", "help-closed"])
def test_help_or_version_stdout_cannot_take_is_one_line_naming_stdout(tmp_path, stdout, argv, line):
    """argparse drops a failed write of the help or the version and exits 0: ``kvload --help > /dev/full`` was a
    success that printed nothing. As for a result: one line naming stdout, exit 1."""
    if stdout == "full" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open("/dev/full", "w")) if stdout == "full" else None
        r = subprocess.run([sys.executable, "-m", "kvload", *argv], stdout=sink, stderr=subprocess.PIPE, text=True,
                           cwd=tmp_path, timeout=120, env={**ENV, "PYTHONPATH": str(REPO)},
                           preexec_fn=_stdout_closed if stdout == "closed" else None)
    assert (r.returncode, r.stderr) == (1, line + "\n"), r.stderr[-2000:]


def _stderr_closed() -> None:  # runs in the child before exec: `kvload ... 2>&-`
    os.close(2)


@pytest.mark.parametrize("stderr", ["full", "closed"])
def test_warnings_stderr_cannot_take_do_not_fail_a_run_that_succeeded(tmp_path, stderr):
    """A run that succeeded (result on stdout, --audit-log published) exited 1 when its held warnings could not be
    written at the end (``2>/dev/full``, ``2>&-``), with no line to say why; streamed (``--debug``) it exited 0. The
    warnings are lost, not the run."""
    if stderr == "full" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    log = tmp_path / "a.jsonl"
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open("/dev/full", "w")) if stderr == "full" else None
        # V1 has no host tier: a setting_ignored warning is held until the run's outcome is known
        r = subprocess.run([sys.executable, "-m", "kvload", "plan", "tiny-llama", "--host_cache_size", "1GiB",
                            "--audit-log", log], stdout=subprocess.PIPE, stderr=sink, text=True, cwd=tmp_path,
                           timeout=120, env={**ENV, "PYTHONPATH": str(REPO)},
                           preexec_fn=_stderr_closed if stderr == "closed" else None)
    assert r.returncode == 0 and r.stdout.startswith("model  tiny-llama")
    assert verify_log(AuditLog.from_jsonl(log))["ok"]


@pytest.mark.parametrize("argv", [
    ["plan", "tiny-llama"],
    ["plan", "tiny-deepseek-v4", "--max_tokens", "65536", "--compare", "--json"],  # past Python's 8 KiB buffer
    ["models"],
    ["simulate", "tiny-llama", "--workload", "no-reuse", "--requests", "4"],
])
def test_a_result_reaches_stdout_in_one_write(monkeypatch, argv):
    """``kvload plan ... | head`` is a success when the output was all written before head left (README, "Audit
    files"). ``print(text)`` wrote the text and then its newline in a write of its own (with PYTHONUNBUFFERED=1, or
    past Python's 8 KiB buffer): head, gone after the first, failed the second, exit 141 or 120 about half the time.
    One write of a document that fits the pipe lands whole before the reader can leave."""
    import io

    class Writes(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def write(self, text: str) -> int:
            self.calls.append(text)
            return super().write(text)

    stdout = Writes()
    monkeypatch.setattr(sys, "stdout", stdout)
    from kvload.cli.entry import main

    try:
        assert main(argv) == 0
    finally:
        import structlog

        structlog.reset_defaults()
    assert len(stdout.calls) == 1 and stdout.calls[0].endswith("\n") and len(stdout.calls[0]) > 100, \
        [c[:40] for c in stdout.calls]


def test_a_hangup_during_a_kernel_compile_stops_the_compiler_and_leaves_no_file(tmp_path):
    """SIGHUP (the terminal closed, ssh dropped) killed kvload outright (exit 129): its audit temporaries stayed, and
    a first-use kernel compile's ``cc``, in a session of its own, ran on orphaned, its ``.o`` left in the kernel cache.
    Now it is cleaned up as for SIGTERM. A fake ``cc`` writes its output, then waits on a child that would outlive
    it (cc1's place)."""
    pidfile, cache, out = tmp_path / "child.pid", tmp_path / "cache", tmp_path / "out"
    out.mkdir()
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo 'fake cc 1.0'; exit 0; }\n"
                  "prev=; for a in \"$@\"; do [ \"$prev\" = -o ] && : > \"$a\"; prev=$a; done\n"
                  f"sleep 300 &\necho $! > {pidfile}.part && mv {pidfile}.part {pidfile}\nwait\n")
    cc.chmod(0o755)
    proc = subprocess.Popen([sys.executable, "-m", "kvload", "generate", "tiny-llama", "--prompt-ids", "1,2,3",
                             "--max_new_tokens", "2", "--audit-log", out / "a.jsonl"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=signals_as_a_terminal_gives_them, cwd=tmp_path,
                            env={**ENV, "PYTHONPATH": str(REPO), "CC": str(cc), "KVLOAD_CACHE": str(cache)})
    deadline = time.monotonic() + 120
    while not pidfile.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pidfile.exists(), "the compile never started"
    child = int(pidfile.read_text())
    assert [p.name for p in cache.rglob("*.o")]  # the compile's output is there to be removed
    r = interrupt(proc, signal.SIGHUP)
    try:
        assert_refused(r, "hung up (SIGHUP)", folder=out, code=129)
        assert [p for p in cache.rglob("*") if p.is_file()] == []
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:  # killed: reaped by init shortly
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{child}"), "the compiler's child outlived kvload"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_a_sigterm_during_interpreter_shutdown_ends_the_process_without_a_traceback(tmp_path):
    """torchrun SIGTERMs the ranks left after one failed, often while they run their atexit callbacks (torch's
    finalizers): the handler that turns SIGTERM into Terminated raised inside them, and Python printed
    "Exception ignored in atexit callback" and a traceback after kvload's one line. Here an atexit callback
    registered before main (so it runs after main's own) sends the SIGTERM, deterministically."""
    script = ("import atexit, os, signal, sys, time\n"
              "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(5)))\n"
              "from kvload.cli.entry import main\n"
              "sys.exit(main(['plan', 'tiny-llama', '--max_tokens', '4096']))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-2000:]
    assert r.returncode == -signal.SIGTERM, (r.returncode, r.stderr[-2000:])  # ended by it, as without kvload
    assert r.stdout  # the plan was printed before


def test_a_stop_signal_raised_inside_a_finalizer_stops_the_command_all_the_same():
    """The handler raises Terminated where the main thread is; inside a ``__del__`` (or a generator the garbage
    collector closes) Python only printed "Exception ignored in ..." and went on: a simulation ran on for minutes after
    its SIGTERM and exited 0. Here the finalizer sends the SIGTERM itself and spins, so the handler runs inside it."""
    script = ("import os, signal, sys, time\n"
              "from pipeline.signals import Terminated, handle_sigterm\n"
              "handle_sigterm()\n"
              "class Finalized:\n"
              "    def __del__(self):\n"
              "        os.kill(os.getpid(), signal.SIGTERM)\n"
              "        for _ in range(10 ** 6): pass\n"
              "try:\n"
              "    Finalized()\n"
              "    for _ in range(500): time.sleep(0.01)\n"
              "except Terminated:\n"
              "    print('stopped'); sys.exit(143)\n"
              "print('ran to its end')\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                       env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert (r.returncode, r.stdout) == (143, "stopped\n"), (r.returncode, r.stdout, r.stderr[-2000:])
    assert "Exception ignored" not in r.stderr, r.stderr[-2000:]


def test_main_gives_sigterm_back_when_it_returns(capsys, monkeypatch):
    """While a command runs SIGTERM raises Terminated (cleanup as for Ctrl-C); once main returned the process's
    own handler is back, and kvload's, if a signal still reaches it, hands over to that one instead of raising."""
    from kvload.cli import entry
    from pipeline.signals import Terminated, _raise_terminated

    heard = []
    own = signal.signal(signal.SIGTERM, lambda signum, frame: heard.append(signum))
    try:
        mine = signal.getsignal(signal.SIGTERM)
        ns = entry.build_parser().parse_args(["plan", "tiny-llama"])
        seen = {}

        def command(ns):
            seen["during"] = signal.getsignal(signal.SIGTERM)
            with pytest.raises(Terminated) as caught:
                _raise_terminated(signal.SIGTERM, None)
            # kept: a stop's exception let go with no stop taken is one dropped unseen, which main reports as it
            # returns (test_a_stop_dropped_as_the_command_returns_still_stops_it)
            seen["stop"] = caught.value
            return 0

        ns.func = command
        monkeypatch.setattr(entry, "build_parser", lambda: type("P", (), {"parse_args": lambda self, a: ns})())
        assert run_cli(capsys).code == 0
        assert seen["during"] is _raise_terminated
        assert signal.getsignal(signal.SIGTERM) is mine
        _raise_terminated(signal.SIGTERM, None)  # a signal already on its way when main returned
        assert heard == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, own)


@pytest.mark.parametrize(("failure", "code", "line"), [
    ("OutputError", 1, "error: the pools could not be released"),
    ("RuntimeError", 1, "error: RuntimeError: the pools could not be released (run with --debug for the traceback)"),
    ("BrokenPipeError", 141, "error: the output was closed before it was all written (broken pipe)")])
def test_a_stop_whose_cleanup_failed_is_reported_once(capsys, monkeypatch, failure, code, line):
    """A stop taken by the command whose cleanup then failed (the stop is that failure's context) is reported as the
    failure, once: the stop was seen, not dropped. ``release_sigterm`` found it let go once the failure's line was out
    and reported it again as one dropped unseen: a second line, ``error: terminated (SIGTERM)``, and exit 143 under
    the failure's line."""
    from kvload.cli import entry
    from pipeline.errors import OutputError
    from pipeline.signals import _raise_terminated

    own = signal.getsignal(signal.SIGTERM)
    try:
        ns = entry.build_parser().parse_args(["plan", "tiny-llama"])

        def command(ns):
            try:
                _raise_terminated(signal.SIGTERM, None)  # the user's kill, raised where the command was
            finally:  # its cleanup fails on the way out
                error = {"OutputError": OutputError, "RuntimeError": RuntimeError}.get(failure, BrokenPipeError)
                raise error("the pools could not be released")

        ns.func = command
        monkeypatch.setattr(entry, "build_parser", lambda: type("P", (), {"parse_args": lambda self, a: ns})())
        result = run_cli(capsys)
        assert (result.code, result.err.splitlines()) == (code, [line]), result.err
    finally:
        signal.signal(signal.SIGTERM, own)


def _wait_for_progress(proc, timeout: float = 120.0) -> str:
    """Read stderr until the simulation's progress bar shows (replay under way); return what was read."""
    seen: list[str] = []

    def read() -> None:
        while True:
            ch = proc.stderr.read(1)
            if not ch:
                return
            seen.append(ch)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and "req" not in "".join(seen) and proc.poll() is None:
        time.sleep(0.01)
    proc.stderr_reader, proc.stderr_seen = reader, seen
    return "".join(seen)


@pytest.mark.parametrize(("signum", "code", "line"), STOPS)
def test_a_signal_during_simulate_replay_leaves_no_audit_file(tmp_path, signum, code, line):
    """The old simulate published its audit right after planning: interrupting the replay left a complete
    audit for a run that never finished."""
    out = tmp_path / "out"
    out.mkdir()
    # long enough to interrupt (tens of thousands of steps: about 12 s uninterrupted, so a suite slow to see the first
    # progress line still signals mid-run), small enough to start fast (4096-token pools)
    proc = start_kvload("simulate", "tiny-llama", "--workload", "no-reuse", "--requests", "20000", "--workload-arg",
                        "prompt_len=16", "--workload-arg", "answer_len=128", "--max_tokens", "4096", "--progress",
                        "--audit-log", out / "a.jsonl", cwd=tmp_path)
    text = _wait_for_progress(proc)
    assert "req" in text, text[-2000:]
    assert any(p.name.endswith(".tmp") for p in out.iterdir())  # the audit is held until the end
    proc.send_signal(signum)
    proc.wait(timeout=120)
    stdout = proc.stdout.read()
    proc.stderr_reader.join(timeout=30)
    err = "".join(proc.stderr_seen)
    assert proc.returncode == code, err[-2000:]
    assert stdout == "" and "Traceback" not in err
    assert err.count("error: ") == 1 and err.endswith(f"error: {line}; the --audit-log file was not written\n"), \
        err[-500:]
    assert list(out.iterdir()) == []


def test_a_failing_simulate_leaves_no_audit_file(capsys, out):
    r = run_cli(capsys, "simulate", "tiny-llama", "--workload", "long-context", "--max_seq_len", "1024",
                "--audit-log", out / "a.jsonl")
    assert_refused(r, "max_seq_len", folder=out)


def test_serve_quotes_the_host_it_cannot_resolve():
    """``--host ""`` read ``--host : cannot resolve it``: the empty value vanished from the line."""
    from kvload.serve.server import bind
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--host '': cannot resolve it \("):
        bind("", 0)


@pytest.mark.parametrize("host", ["a" * 64, "9" * 5000, "a..b"])
def test_serve_names_a_host_that_is_no_host_name(capsys, host):
    """A label past 63 characters (or empty) fails IDNA's encoding in getaddrinfo: a UnicodeError, not the gaierror
    the check caught, so ``kvload serve --host <64 letters>`` ended "error: UnicodeError: encoding with 'idna' codec
    failed (UnicodeError: label too long)", exit 1, naming no flag."""
    r = run_cli(capsys, "serve", "tiny-llama", "--host", host, "--port", "0")
    assert_refused(r, "--host ")
    assert "not a host name (each dot-separated label is 1 to 63 characters)" in r.err


def test_serve_names_the_host_when_it_is_not_an_address_of_this_machine(capsys):
    """``--host 192.0.2.1`` (an address of no machine here) read ``--port 8000: cannot listen on 192.0.2.1:8000
    (Cannot assign requested address)``: the port was blamed, and it was fine."""
    r = run_cli(capsys, "serve", "tiny-llama", "--host", "192.0.2.1", "--port", "0")
    assert_refused(r, "error: --host '192.0.2.1': not an address of this machine, cannot listen on it (Cannot "
                      "assign requested address); give one of its addresses (127.0.0.1: this machine only, 0.0.0.0: "
                      "all of them)")


def test_serve_names_the_host_whose_address_family_this_machine_lacks(capsys, monkeypatch):
    """``--host ::1`` on a machine with IPv6 off: creating the socket failed outside the checks, and the run ended
    "error: OSError: [Errno 97] Address family not supported by protocol", exit 1, naming no flag."""
    import errno
    import socket

    real = socket.socket

    def no_ipv6(family=-1, *args, **kwargs):
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, os.strerror(errno.EAFNOSUPPORT))
        return real(family, *args, **kwargs)

    monkeypatch.setattr(socket, "socket", no_ipv6)
    r = run_cli(capsys, "serve", "tiny-llama", "--host", "::1", "--port", "0")
    assert_refused(r, f"error: --host '::1': cannot listen on it ({os.strerror(errno.EAFNOSUPPORT)}); give an "
                      "address of a kind this machine has (127.0.0.1: this machine only, 0.0.0.0: all of them)")


def test_serve_blames_no_flag_when_the_machine_is_out_of_sockets(capsys, monkeypatch):
    """socket() failing for want of descriptors (EMFILE) is a runtime failure, exit 1: it was a usage error telling to
    give --host "an address of a kind this machine has", for 127.0.0.1."""
    import errno
    import socket

    def no_descriptors(*args, **kwargs):
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(socket, "socket", no_descriptors)
    r = run_cli(capsys, "serve", "tiny-llama", "--host", "127.0.0.1", "--port", "0")
    assert r.code == 1 and r.one_error_line, r.err
    assert os.strerror(errno.EMFILE) in r.err and "--host" not in r.err, r.err


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_bad_shard_among_several_is_named_not_only_the_checkpoint(capsys, tmp_path, out, damage):
    """safetensors' "Error while deserializing header" names no file, and the line named the checkpoint folder:
    with nine shards, which one to fetch again was left to guess."""
    from models.checkpoint import load_hf_config, resolve_checkpoint
    from models.weights import random_model

    ckpt = tmp_path / "ckpt"
    cfg = load_hf_config(resolve_checkpoint("tiny-llama"))
    random_model(cfg, device="cpu", dtype="float32").save_pretrained(ckpt, max_shard_size="100KB")
    shards = sorted(ckpt.glob("*.safetensors"))
    assert len(shards) > 2
    bad = shards[1]
    bad.write_bytes(bad.read_bytes()[:100] if damage == "truncated" else b"garbage")
    r = run_cli(capsys, "generate", ckpt, "--prompt-ids", "1,2", "--max_new_tokens", "1", "--audit-log",
                out / "a.jsonl")
    assert_refused(r, f"error: {bad}: transformers cannot load the weights: Error while deserializing header: ",
                   folder=out)


# --- the environment --------------------------------------------------------------------------

@pytest.mark.parametrize(("env", "needle"), [
    # the whole value was quoted into the line: 100,000 characters of one "error:" line
    ({"KVLOAD_LOG_LEVEL": "x" * 100_000}, "KVLOAD_LOG_LEVEL='xxx"),
    ({"KVLOAD_LOG_FORMAT": "y" * 100_000}, "KVLOAD_LOG_FORMAT='yyy"),
    ({"WORLD_SIZE": "9" * 5000}, "environment WORLD_SIZE='999"),
    # int() reads other scripts' digits: WORLD_SIZE=2 in Arabic-Indic digits launched as 2 ranks
    ({"WORLD_SIZE": "\u0662"}, "environment WORLD_SIZE='\u0662': expected an integer (torchrun sets it)"),
    ({"RANK": "1_0", "WORLD_SIZE": "20"}, "environment RANK='1_0': expected an integer"),
], ids=["log-level", "log-format", "world-size-5000-digits", "world-size-arabic-digit", "rank-underscore"])
def test_an_environment_variable_kvload_reads_is_quoted_short_and_in_digits_0_9(tmp_path, out, env, needle):
    r = limited_kvload("plan", "tiny-llama", "--audit-log", out / "a.jsonl", env=env)
    assert_refused(r, needle, folder=out)


@pytest.mark.parametrize("case", ["checkpoint-folder", "config-path", "unknown-flag"])
def test_a_control_character_in_a_path_or_flag_stays_one_escaped_line(capsys, tmp_path, out, case):
    """A folder named with a newline split the one error line in two (and an escape sequence in a file name reached
    the terminal); paths and flags are the user's, so they are printed with the control characters escaped."""
    if case == "checkpoint-folder":
        ckpt = tmp_path / "a\nb"
        ckpt.mkdir()
        (ckpt / "config.json").write_text("{bad")
        r = _plan(capsys, ckpt, audit=out / "a.jsonl")
        needle = f"{tmp_path}/a\\nb/config.json: malformed JSON at line 1 column 2"
    elif case == "config-path":
        r = _plan(capsys, "tiny-llama", "--config", tmp_path / "\x1b[31mred.yaml", audit=out / "a.jsonl")
        needle = f"config file {tmp_path}/\\x1b[31mred.yaml: not found"
    else:
        r = _plan(capsys, "tiny-llama", "--max\ntok", audit=out / "a.jsonl")
        needle = "unrecognized arguments: --max\\ntok"
    assert_refused(r, needle, folder=out)
    assert "\x1b" not in r.err


def test_a_checkpoint_folder_named_with_control_characters_plans_with_them_escaped(capsys, tmp_path):
    """The same folder name in a successful plan's report: the heading line printed it raw, an escape sequence reached
    the terminal and a newline split the line."""
    ckpt = tmp_path / "a\nb\x1b[31m"
    ckpt.mkdir()
    write_config(ckpt, llama_config())
    r = _plan(capsys, ckpt)
    assert r.code == 0, r.err
    assert not any((ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) < 0xA0 for c in r.out), r.out[:300]
    assert r.out.startswith(f"model  {tmp_path}/a\\nb\\x1b[31m  (directory: LlamaForCausalLM"), r.out[:300]


def test_a_stop_as_the_audit_log_is_about_to_close_leaves_no_temporary(capsys, tmp_path, monkeypatch):
    """A stop landing after the command returned but before the ``--audit-log`` sink's own close began (where it holds
    signals) left the sink's temporary beside the target: the sink was forgotten before it was closed. Now the stop
    is reported as any other (its line, 143) and the audit discarded, nothing left."""
    import kvload.cli.entry as entry
    from pipeline.signals import Terminated

    calls = []

    def lands_here() -> None:
        calls.append(1)
        raise Terminated()  # as the handler raises a SIGTERM arriving at this point

    monkeypatch.setattr(entry, "dropped_stop", lands_here)
    r = run_cli(capsys, "plan", "tiny-llama", "--audit-log", tmp_path / "a.jsonl")
    assert calls == [1]
    assert (r.code, r.err) == (143, "error: terminated (SIGTERM); the --audit-log file was not written\n")
    assert list(tmp_path.iterdir()) == []
