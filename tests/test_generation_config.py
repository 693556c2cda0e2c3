"""A model's generation_config.json as sampling defaults (vLLM's --generation-config / --override-generation-config).

The checkpoint's file (temperature 0.6, top_p 0.9, ...) gives every request that leaves a setting unset its value:
``LLM.get_default_sampling_params()`` and calls without a SamplingParams, ``kvload generate`` without the flag, a
server request without the field; an explicit SamplingParams, a flag given and a field sent win. ``vllm`` ignores
the file, a directory names another, the override lies over it; bad values are one line naming the file or flag and
key; the audit's ``sampling_defaults_resolved`` says which file gave which value.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import kvload
from kvload import SamplingParams
from pipeline.errors import ConfigError
from tests.cli_support import imports_after, read_events, run_cli
from tests.conftest import llama_config, write_config
from tests.hostile_support import assert_refused
from tests.llm_support import llm_kwargs, with_tokenizer

VOCAB = 512  # the tiny llama's
#: a creator's file: Llama 3.1's temperature and top_p, Qwen's top_k, a strong penalty and a short length, so each
#: shows in what is generated; the other keys are no sampling defaults
FILE = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
        "repetition_penalty": 1.5, "max_new_tokens": 5, "transformers_version": "5.24.0"}
DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.5, "max_tokens": 5}
PROMPT = "w5 w17 w300 w42 w9"


def _with_file(directory: Path, data: dict) -> Path:
    (directory / "generation_config.json").write_text(json.dumps(data))
    return directory


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny llama with a word tokenizer and the creator's generation_config.json above."""
    path = with_tokenizer(tiny_checkpoints("llama"), tmp_path_factory.mktemp("genconfig") / "ckpt", VOCAB)
    saved = json.loads((path / "generation_config.json").read_text())  # what save_pretrained wrote: eos ids only
    return _with_file(path, {**saved, **FILE})


@pytest.fixture(scope="module")
def llm(ckpt):
    with kvload.LLM(str(ckpt), **llm_kwargs()) as loaded:
        yield loaded


def _config_only(tmp_path: Path, data: dict | None, name: str = "cfg") -> Path:
    """A config-only checkpoint (plan reads no weights) with ``data`` as its generation_config.json."""
    path = write_config(tmp_path / name, llama_config())
    return _with_file(path, data) if data is not None else path


def _event(result) -> dict:
    (event,) = result.audit.of("sampling_defaults_resolved")
    return event


# --- where the defaults come from, and what the audit says ----------------------------------------------------


def test_the_checkpoints_file_gives_the_defaults_and_the_audit_names_file_keys_and_values(tmp_path):
    path = _config_only(tmp_path, FILE)
    result = kvload.plan(str(path), log=False)
    event = _event(result)
    assert event["stage"] == "apply_model_defaults" and event["generation_config"] == "auto"
    assert event["path"] == str(path / "generation_config.json")
    assert event["defaults"] == DEFAULTS and result.sampling_defaults.values == DEFAULTS
    assert set(event["sources"].values()) == {"generation_config.json"} and event["not_applied"] == {}
    assert event["other_keys"] == ["bos_token_id", "eos_token_id", "transformers_version"]
    # "auto" resolves like every auto field: to the directory whose file gave them, in the final args and replay
    (resolved,) = [e for e in result.audit.of("auto_resolved") if e["field"] == "generation_config"]
    assert (resolved["new"], resolved["source"]) == (str(path), "checkpoint")
    assert result.args.generation_config == str(path)
    assert "temperature 0.6" in resolved["reason"]


@pytest.mark.parametrize(("data", "said"), [
    # save_pretrained's file (eos ids only) read "the checkpoint's generation_config.json gives no sampling default
    # applies from it"; do_sample alone read the same, though it gives the temperature
    ({"eos_token_id": 2, "transformers_version": "5.24.0"},
     "holds no sampling default kvload applies; sampling_defaults_resolved lists its keys"),
    ({"do_sample": True}, "gives temperature 1.0 through its do_sample; sampling_defaults_resolved has the rest"),
    ({"do_sample": False, "top_p": 0.8},
     "gives top_p 0.8, temperature 0.0 through its do_sample; sampling_defaults_resolved has the rest"),
])
def test_plan_says_in_a_sentence_what_the_checkpoints_file_gives(capsys, tmp_path, data, said):
    path = _config_only(tmp_path, data)
    r = run_cli(capsys, "plan", path)
    assert r.code == 0, r.err
    (line,) = [row for row in r.out.splitlines() if row.lstrip().startswith("generation_config ")]
    assert line.endswith(f'"auto" → {path}: the checkpoint\'s generation_config.json {said}'), line


def test_a_checkpoint_without_the_file_keeps_kvloads_defaults_and_resolves_auto_to_vllm(tmp_path):
    result = kvload.plan(str(_config_only(tmp_path, None)), log=False)
    event = _event(result)
    assert (event["path"], event["defaults"]) == (None, {}) and "has no generation_config.json" in event["reason"]
    assert result.args.generation_config == "vllm"


def test_vllm_ignores_the_checkpoints_file(tmp_path):
    result = kvload.plan(str(_config_only(tmp_path, FILE)), generation_config="vllm", log=False)
    event = _event(result)
    assert (event["generation_config"], event["path"], event["defaults"]) == ("vllm", None, {})
    assert "is not read" in event["reason"]


def test_a_directory_names_another_generation_config(tmp_path):
    (tmp_path / "other").mkdir()
    other = _with_file(tmp_path / "other", {"temperature": 0.3, "min_p": 0.05})
    result = kvload.plan(str(_config_only(tmp_path, FILE)), generation_config=str(other), log=False)
    event = _event(result)
    assert event["path"] == str(other / "generation_config.json")
    assert event["defaults"] == {"temperature": 0.3, "min_p": 0.05}


def test_the_override_lies_over_the_file_and_says_what_it_replaced(tmp_path):
    result = kvload.plan(str(_config_only(tmp_path, FILE)), log=False,
                         override_generation_config={"temperature": 0.5, "max_new_tokens": 7})
    event = _event(result)
    assert event["defaults"] == {**DEFAULTS, "temperature": 0.5, "max_tokens": 7}
    assert event["sources"]["temperature"] == event["sources"]["max_tokens"] == "override_generation_config"
    assert event["sources"]["top_p"] == "generation_config.json"
    assert event["not_applied"] == {"temperature": "override_generation_config gives 0.5",
                                    "max_new_tokens": "override_generation_config gives 7"}
    # the user's keys are user-set leaves, replayed like any
    assert result.audit.provenance("override_generation_config.temperature")[0]["source"] == "api"


def test_do_sample_false_means_greedy_and_says_which_keys_it_left_out(tmp_path):
    """transformers generates greedily under do_sample false whatever the temperature; vLLM ignores do_sample.
    kvload reads it as the file's author meant it, and lists what it left out: never silent."""
    greedy = {"do_sample": False, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.2}
    path = _config_only(tmp_path, greedy)
    event = _event(kvload.plan(str(path), log=False))
    # greedy: temperature 0; top_p stays for a request that asks for a temperature (it does nothing while greedy)
    assert event["defaults"] == {"temperature": 0.0, "top_p": 0.9, "repetition_penalty": 1.2}
    assert event["sources"]["temperature"] == "do_sample"
    assert set(event["not_applied"]) == {"temperature"}
    assert "do_sample is false" in event["not_applied"]["temperature"] and "greedy" in event["reason"]
    # the user's do_sample decides for the file's keys
    event = _event(kvload.plan(str(path), log=False, override_generation_config={"do_sample": True}))
    assert event["defaults"] == {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.2}


def test_do_sample_true_without_a_temperature_samples_at_one_as_transformers_and_vllm_do(tmp_path):
    gemma3 = {"do_sample": True, "top_k": 64, "top_p": 0.95}  # Gemma 3's file: no temperature
    event = _event(kvload.plan(str(_config_only(tmp_path, gemma3)), log=False))
    assert event["defaults"] == {"temperature": 1.0, "top_p": 0.95, "top_k": 64}
    assert event["sources"]["temperature"] == "do_sample"


def test_a_null_value_is_no_value(tmp_path):
    event = _event(kvload.plan(str(_config_only(tmp_path, {"temperature": None, "top_p": 0.8})), log=False))
    assert event["defaults"] == {"top_p": 0.8}


def test_plan_shows_the_defaults_and_json_carries_them(capsys, tmp_path):
    path = _config_only(tmp_path, FILE)
    r = run_cli(capsys, "plan", path)
    assert r.code == 0, r.err
    assert "sampling defaults  temperature 0.6, top_p 0.9, top_k 20, repetition_penalty 1.5, max_tokens 5" in r.out
    r = run_cli(capsys, "plan", path, "--override-generation-config", '{"top_k": 3}', "--json")
    assert r.code == 0, r.err
    assert r.json()["sampling_defaults"]["defaults"] == {**DEFAULTS, "top_k": 3}


def test_explain_and_audit_show_where_the_defaults_came_from(capsys, tmp_path):
    path, log = _config_only(tmp_path, FILE), tmp_path / "a.jsonl"
    assert run_cli(capsys, "plan", path, "--generation_config", "auto", "--override-generation-config",
                   '{"top_k": 3}', "--audit-log", log).code == 0
    r = run_cli(capsys, "explain", log, "generation_config")
    assert r.code == 0, r.err
    assert "sampling defaults: temperature 0.6 (generation_config.json)" in r.out and f'→ "{path}"' in r.out
    # the flag's name is the mapping: explained as the keys the user gave
    r = run_cli(capsys, "explain", log, "override-generation-config")
    assert r.code == 0, r.err
    assert r.out.startswith("override_generation_config.top_k = 3\n") and "top_k 3 (override_generation_config)" \
        in r.out and "= null" not in r.out
    r = run_cli(capsys, "audit", log, "--verify")
    assert r.code == 0, r.err
    assert "sampling defaults (of requests that leave a setting unset):" in r.out and "verify  ok" in r.out


def test_reading_the_defaults_imports_neither_torch_nor_transformers(tmp_path):
    """The file is plain JSON: plan of a preset with a generation_config directory and an override stays quick."""

    (tmp_path / "gen").mkdir()
    other = _with_file(tmp_path / "gen", FILE)
    loaded = imports_after(f"""
        from kvload.cli.entry import main
        assert main(["plan", "tiny-llama", "--device", "cpu", "--generation-config", r"{other}",
                     "--override-generation-config", '{{"top_k": 3}}']) == 0
    """)
    assert loaded == {"torch": False, "transformers": False}


# --- bad values: one line naming the file or flag and the key -------------------------------------------------


@pytest.mark.parametrize(("data", "needle"), [
    ({"temperature": -1}, "temperature: expected a finite number >= 0 (0 = greedy) or null, got -1"),
    ({"top_p": "x"}, "top_p: expected a number in (0, 1] or null, got 'x'"),
    ({"top_k": 1.5}, "top_k: expected an integer >= 1, or 0 / -1 for all tokens, or null, got 1.5"),
    ({"max_new_tokens": 0}, "max_new_tokens: expected an integer >= 1 or null, got 0"),
    ({"repetition_penalty": 0}, "repetition_penalty: expected a number in [0.01, 100] (1 = off) or null, got 0"),
    ({"do_sample": "yes"}, "do_sample: expected true, false or null, got 'yes'"),
])
def test_a_bad_value_in_the_file_is_one_line_naming_the_file_and_key(capsys, tmp_path, data, needle):
    path = _config_only(tmp_path, data)
    assert_refused(run_cli(capsys, "plan", path), f"{path}/generation_config.json: {needle}")


def test_a_bad_value_in_a_named_directory_is_named_too_and_vllm_never_reads_it(capsys, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    _with_file(other, {"top_p": 2})
    path = _config_only(tmp_path, None)
    assert_refused(run_cli(capsys, "plan", path, "--generation-config", other),
                   f"{other}/generation_config.json: top_p: expected a number in (0, 1]")
    assert run_cli(capsys, "plan", _config_only(tmp_path, {"top_p": 2}, "bad"), "--generation-config", "vllm").code == 0


@pytest.mark.parametrize(("flags", "needle"), [
    (["--generation-config", "/no/such/dir"], "error: --generation-config: '/no/such/dir': no such directory; "
                                              'accepted: "auto" (the checkpoint\'s generation_config.json), "vllm"'),
    (["--generation_config", "none"], "error: --generation_config: 'none': no such directory; accepted: "),
    (["--generation_config", "~no_such_user_kvload/x"],
     "error: --generation_config: '~no_such_user_kvload/x': no such directory; accepted: "),
    (["--override-generation-config", "temperature=0.5"], "error: --override-generation-config: expected a JSON "
                                                          "object such as '{\"temperature\": 0.5}'"),
    (["--override-generation-config", '{"temperature": NaN}'], "expected a JSON object"),
    (["--override-generation-config", '{"top_k": 1, "top_k": 2}'], "key 'top_k' appears twice"),
    (["--override-generation-config", '{"temperature": -1}'],
     "error: --override-generation-config: temperature: expected a finite number >= 0 (0 = greedy) or null, got -1"),
    (["--override_generation_config", '{"temprature": 1}'],
     "error: --override_generation_config: temprature: unknown key; did you mean 'temperature'?"),
    (["--override-generation-config", '{"max_tokens": 9}'], "max_tokens: unknown key; did you mean 'max_new_tokens'?"),
    (["--override-generation-config", '{"do_sample": false, "temperature": 0.5}'],
     "error: --override-generation-config: do_sample false asks for greedy decoding, temperature 0.5 for sampling"),
])
def test_a_bad_flag_is_one_line_naming_it_and_what_is_accepted(capsys, tmp_path, flags, needle):
    out = tmp_path / "out"
    out.mkdir()
    r = run_cli(capsys, "plan", _config_only(tmp_path, FILE), *flags, "--audit-log", out / "a.jsonl")
    assert_refused(r, needle, folder=out)


def test_a_directory_without_the_file_is_refused(capsys, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_refused(run_cli(capsys, "plan", "tiny-llama", "--generation-config", empty),
                   f"--generation-config: '{empty}': the directory holds no generation_config.json")


def test_the_config_file_and_the_python_api_refuse_in_the_same_words(capsys, tmp_path):
    yaml = tmp_path / "serve.yaml"
    yaml.write_text("override_generation_config:\n  top_p: 2\n")
    assert_refused(run_cli(capsys, "plan", "tiny-llama", "--config", yaml),
                   f"config file {yaml}: override_generation_config.top_p: expected a number in (0, 1] or null, got 2")
    with pytest.raises(ConfigError, match=r"^override_generation_config.top_p: expected a number in \(0, 1\]"):
        kvload.plan("tiny-llama", override_generation_config={"top_p": 2}, log=False)
    with pytest.raises(ConfigError, match="^override_generation_config: expected a mapping of generation_config.json "
                                          "keys"):
        kvload.plan("tiny-llama", override_generation_config=0.5, log=False)


# --- kvload.LLM: the defaults of calls given no SamplingParams; an explicit one is used as given ------------------


def _started(llm) -> dict:
    return llm.audit.of("generation_started")[-1]


def test_get_default_sampling_params_and_a_call_without_params_use_the_file(llm):
    assert llm.get_default_sampling_params() == SamplingParams(**DEFAULTS)
    (out,) = llm.generate(PROMPT, seed=3, ignore_eos=True)  # keywords for what the file does not set
    started = _started(llm)
    assert (started["temperature"], started["top_p"], started["top_k"], started["repetition_penalty"],
            started["max_new_tokens"]) == (0.6, 0.9, 20, 1.5, 5)
    assert sorted(started["model_defaults"]) == sorted(DEFAULTS)
    assert len(out.outputs[0].token_ids) == 5  # the file's max_new_tokens
    # the same as asking for those values explicitly
    (same,) = llm.generate(PROMPT, SamplingParams(**DEFAULTS, seed=3, ignore_eos=True))
    assert same.outputs[0].token_ids == out.outputs[0].token_ids
    assert _started(llm)["model_defaults"] == []


def test_an_explicit_sampling_params_is_used_as_given(llm):
    """vLLM's rule: a SamplingParams is not merged with the model's defaults (greedy, no penalty, 64 tokens)."""
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
    started = _started(llm)
    assert (started["temperature"], started["top_p"], started["top_k"], started["repetition_penalty"],
            started["max_new_tokens"], started["model_defaults"]) == (0.0, 1.0, 0, 1.0, 8, [])
    assert len(out.outputs[0].token_ids) == 8


def test_a_keyword_replaces_one_default_and_an_unused_default_is_not_the_callers_setting(llm):
    llm.generate(PROMPT, temperature=0, max_tokens=4)
    started = _started(llm)
    assert (started["temperature"], started["top_p"], started["max_new_tokens"]) == (0.0, 0.9, 4)
    assert sorted(started["model_defaults"]) == ["repetition_penalty", "top_k", "top_p"]
    ignored = [e["field"] for e in llm.audit.of("setting_ignored") if e["seq"] > started["seq"]]
    assert ignored == []  # greedy leaves the model's top_p/top_k unused: the caller asked for neither
    llm.generate(PROMPT, temperature=0, top_p=0.5, max_tokens=4)  # one the caller gave still is reported
    started = _started(llm)
    assert [e["field"] for e in llm.audit.of("setting_ignored") if e["seq"] > started["seq"]] == ["generate.top_p"]


def test_generate_stream_without_params_uses_the_file(llm):
    deltas = list(llm.generate_stream(PROMPT, ignore_eos=True, seed=3))
    assert sum(len(d.token_ids) for d in deltas) == 5 and _started(llm)["temperature"] == 0.6


def test_vllm_gives_kvloads_built_in_defaults(ckpt):
    with kvload.LLM(str(ckpt), generation_config="vllm", **llm_kwargs()) as plain:
        assert plain.get_default_sampling_params() == SamplingParams()
        plain.generate(PROMPT, max_tokens=2)
        assert (_started(plain)["temperature"], _started(plain)["model_defaults"]) == (0.0, [])


# --- kvload generate: a flag left out takes the model's default; a flag given wins -------------------------------


def _generate(capsys, tmp_path, ckpt, *flags):
    log = tmp_path / f"g{len(list(tmp_path.iterdir()))}.jsonl"
    r = run_cli(capsys, "generate", ckpt, "--prompt-ids", "5,17,300", "--ignore_eos", "--device", "cpu",
                "--max_tokens", "512", "--json", "--audit-log", log, *flags)
    assert r.code == 0, r.err
    (started,) = [e for e in read_events(log) if e["event"] == "generation_started"]
    return r.json()["outputs"][0]["outputs"][0], started


def test_cli_generate_takes_the_models_defaults_for_flags_left_out(capsys, tmp_path, ckpt):
    out, started = _generate(capsys, tmp_path, ckpt, "--seed", "3")
    assert len(out["token_ids"]) == 5 and (started["temperature"], started["top_k"]) == (0.6, 20)
    out, started = _generate(capsys, tmp_path, ckpt, "--max_new_tokens", "3", "--temperature", "0")
    assert len(out["token_ids"]) == 3 and started["temperature"] == 0.0
    assert sorted(started["model_defaults"]) == ["repetition_penalty", "top_k", "top_p"]
    out, started = _generate(capsys, tmp_path, ckpt, "--generation-config", "vllm", "--max_seq_len", "16")
    assert (started["max_new_tokens"], started["temperature"], started["model_defaults"]) == (64, 0.0, [])
    out, started = _generate(capsys, tmp_path, ckpt, "--override-generation-config", '{"max_new_tokens": 2}')
    assert len(out["token_ids"]) == 2


def test_cli_generate_names_where_the_default_max_new_tokens_came_from(capsys, tmp_path):
    """--min_tokens past the default length names that length's origin: the override (a flag or --config key the
    user gave), not a generation_config.json that tiny-llama does not have; the checkpoint's file by its name, and
    --max_new_tokens as the flag that raises it."""
    r = run_cli(capsys, "generate", "tiny-llama", "--prompt-ids", "1,2", "--override_generation_config",
                '{"max_new_tokens": 2}', "--min_tokens", "3")
    assert_refused(r, "error: --min_tokens: expected at most override_generation_config.max_new_tokens (2), got 3")
    assert "generation_config.json" not in r.err
    path = _config_only(tmp_path, {"max_new_tokens": 2})
    r = run_cli(capsys, "generate", path, "--prompt-ids", "1,2", "--min_tokens", "3")
    assert_refused(r, f"error: --min_tokens: expected at most 2, the model's max_new_tokens "
                      f"({path / 'generation_config.json'}), got 3; give --max_new_tokens of at least 3 to raise it")


def test_cli_generate_sizes_its_pools_for_the_models_max_new_tokens(capsys, tmp_path, tiny_checkpoints):
    """generate sizes the CPU pools by max_new_tokens before loading: the model's, read then, not the flag's default
    (64), which would refuse a request of 1,100 tokens as one that could never fit."""
    path = tmp_path / "long"
    shutil.copytree(tiny_checkpoints("llama"), path)
    _with_file(path, {"eos_token_id": 2, "max_new_tokens": 1100})
    log = tmp_path / "a.jsonl"
    stops = ",".join(map(str, range(VOCAB)))  # every token stops: one token is generated, quickly
    r = run_cli(capsys, "generate", path, "--prompt-ids", "5,17,300", "--device", "cpu", "--stop_token_ids", stops,
                "--audit-log", log)
    assert r.code == 0, r.err
    (derived,) = [e for e in read_events(log) if e["event"] == "field_derived"
                  and e["field"] == "kv_cache_config.default_max_tokens"]
    assert derived["new"] == 1100 + 1024 and f"max_new_tokens ({path / 'generation_config.json'})" in derived["reason"]


# --- kvload serve: a field the client did not send takes the model's default; one it sent wins ------------------


def test_serve_takes_the_models_defaults_for_fields_not_sent(ckpt, monkeypatch):
    from tests.serve_support import serving

    with serving(str(ckpt), max_seq_len=64, kv_cache_config={"max_tokens": 512, "tokens_per_block": 4},
                 state={"model_name": "words"}) as served:
        engine, asked = served.state.engine, []
        submit = engine.submit_group  # the server submits a request's choices together (one prefill)
        monkeypatch.setattr(engine, "submit_group", lambda ids, params, *a, **k: (asked.append(params), submit(
            ids, params, *a, **k))[1])

        def complete(extra=(), **fields):
            r = served.client.completions.create(model="words", prompt=PROMPT, seed=7,
                                                 extra_body={"ignore_eos": True, **dict(extra)}, **fields)
            return r.choices[0].token_ids, r.usage.completion_tokens

        def picked(params):
            return (params.temperature, params.top_p, params.top_k, params.repetition_penalty, params.max_tokens)

        defaulted, tokens = complete()
        assert tokens == 5 and picked(asked[-1]) == (0.6, 0.9, 20, 1.5, 5)  # the file's, max_new_tokens included
        explicit, _ = complete({"top_k": 20, "repetition_penalty": 1.5}, max_tokens=5, temperature=0.6, top_p=0.9)
        assert defaulted == explicit  # the defaults act as the same values sent would
        # a field sent wins (null is not sent); the rest still take the model's
        greedy, tokens = complete({"top_p": None}, temperature=0, max_tokens=3)
        assert tokens == 3 and picked(asked[-1]) == (0.0, 0.9, 20, 1.5, 3) and greedy != defaulted[:3]
        complete({"top_k": -1, "repetition_penalty": 1.0}, top_p=1.0, max_tokens=2)
        assert picked(asked[-1]) == (0.6, 1.0, -1, 1.0, 2)
        ignored = [e["field"] for e in served.result.audit.of("setting_ignored")]
        assert "serve.top_p" not in ignored and "serve.top_k" not in ignored  # the model's, not the client's
        chain = served.http.get("/v1/kvload/explain", params={"field": "generation_config"}).json()
        assert [s["event"] for s in chain["chain"]][-2:] == ["sampling_defaults_resolved", "auto_resolved"]
        r = served.http.get("/v1/kvload/explain", params={"field": "override_generation_config"})
        assert r.status_code == 400 and "override_generation_config.temperature" in r.json()["error"]["message"]


def test_cli_serve_sizes_its_pools_and_default_max_tokens_by_the_models_max_new_tokens(tmp_path, tiny_checkpoints,
                                                                                      monkeypatch):
    """Without --default-max-tokens a request's max_tokens is the model's max_new_tokens, and the CPU pools are sized
    for it before loading (8 x (1,100 + 1,024), not 8 x (256 + 1,024)); the flag given wins."""
    from kvload.cli.commands import build_parser
    from kvload.serve import command, server

    path = tmp_path / "long"
    shutil.copytree(tiny_checkpoints("llama"), path)
    _with_file(path, {"eos_token_id": 2, "max_new_tokens": 1100})
    seen, real = {}, server.build_state

    def build_state(result, **kwargs):  # stop the command once it has said how to serve
        state = real(result, **kwargs)
        seen.update(default_max_tokens=state.default_max_tokens, derived=[
            e["new"] for e in result.audit.of("field_derived") if e["field"] == "kv_cache_config.default_max_tokens"])
        raise SystemExit(0)

    monkeypatch.setattr(server, "build_state", build_state)
    for flags, tokens, pools in (([], 1100, 8 * (1100 + 1024)), (["--default-max-tokens", "10"], 10, 8 * (10 + 1024))):
        with pytest.raises(SystemExit):
            command.cmd_serve(build_parser().parse_args(["serve", str(path), "--port", "0", "--device", "cpu", *flags]))
        assert seen == {"default_max_tokens": tokens, "derived": [pools]}


def test_cli_serve_pools_for_the_models_max_new_tokens_stop_at_max_seq_len(tmp_path, tiny_checkpoints,
                                                                             monkeypatch):
    """A model's max_new_tokens past max_seq_len (valid in its file: no request grows past max_seq_len anyway) sizes
    serve's CPU pools for 8 sequences of max_seq_len, as generate's are capped, not for 8 x (max_new_tokens + 1,024):
    that refused to serve naming --default-max-tokens, a flag the user never gave, or allocated memory no request
    could use; the audit names the file."""
    from kvload.cli.commands import build_parser
    from kvload.serve import command, server

    path = tmp_path / "long"
    shutil.copytree(tiny_checkpoints("llama"), path)
    _with_file(path, {"eos_token_id": 2, "max_new_tokens": 2**62})
    seen = {}

    def build_state(result, **kwargs):  # stop the command once the pools are built
        seen.update(budget=[e["max_tokens"] for e in result.audit.of("kv_budget_computed")],
                    reasons=[e["reason"] for e in result.audit.of("field_derived")
                             if e["field"] == "kv_cache_config.default_max_tokens"])
        raise SystemExit(0)

    monkeypatch.setattr(server, "build_state", build_state)
    with pytest.raises(SystemExit):
        command.cmd_serve(build_parser().parse_args(["serve", str(path), "--port", "0", "--device", "cpu",
                                                     "--max_seq_len", "64"]))
    assert seen["budget"] == [8 * 64]
    (reason,) = seen["reasons"]
    assert f"max_new_tokens ({path / 'generation_config.json'})" in reason
    assert reason.startswith("the requests' default max_tokens: give --default-max-tokens below")  # not "lower" it


@pytest.mark.parametrize("flags", [["--default-max-tokens", "100000"], ["--default-max-tokens", str(2**63 - 1)], []],
                         ids=["flag", "flag-at-2**63-1", "serve's-256"])
def test_cli_serve_pools_stop_at_8_sequences_of_max_seq_len_whatever_set_the_default_length(
        tmp_path, tiny_checkpoints, monkeypatch, flags):
    """serve's CPU pools are for 8 sequences; no request grows past max_seq_len, so they hold at most 8 x max_seq_len
    tokens whether the default length is the model's, the operator's --default-max-tokens or serve's 256, as
    generate's are capped whatever gave --max_new_tokens. The flag's value was not capped: --default-max-tokens
    100000 beside --max_seq_len 64 allocated pools for 808,192 tokens, and 2**63 - 1 (an "as long as max_seq_len
    lets it" default, valid per request) refused to serve; each request still defaults to the flag's length, cut to
    what max_seq_len leaves."""
    from kvload.cli.commands import build_parser
    from kvload.serve import command, server

    seen, real = {}, server.build_state

    def build_state(result, **kwargs):  # stop the command once it has said how to serve
        state = real(result, **kwargs)
        seen.update(budget=[e["max_tokens"] for e in result.audit.of("kv_budget_computed")],
                    default_max_tokens=state.default_max_tokens)
        raise SystemExit(0)

    monkeypatch.setattr(server, "build_state", build_state)
    with pytest.raises(SystemExit):
        command.cmd_serve(build_parser().parse_args(["serve", str(tiny_checkpoints("llama")), "--port", "0",
                                                     "--device", "cpu", "--max_seq_len", "64", *flags]))
    assert seen == {"budget": [8 * 64], "default_max_tokens": int(flags[1]) if flags else 256}
