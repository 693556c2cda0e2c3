"""vLLM's ``speculative_config`` (``LLM(speculative_config={...})``, ``--speculative-config JSON``): its n-gram method
runs kvload's n-gram drafts, keys kvload cannot honour are reported ``setting_ignored``, other methods are refused in
one line naming the method and what is accepted."""

from __future__ import annotations

import json

import pytest

import kvload
from kvload.cli.commands import build_parser
from kvload.cli.flags import cli_overrides
from pipeline.errors import ConfigError
from tests.cli_support import run_cli

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
REPEATING = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4]


def test_llm_runs_vllms_ngram_speculative_config_as_kvloads_drafts():
    with kvload.LLM("tiny-llama", device="cpu", log=False, kv_cache_config={"max_tokens": 256},
                    speculative_config=NGRAM) as llm:
        assert (llm.args.max_draft_len, llm.args.max_matching_ngram_size) == (4, 3)
        drafted = llm.generate([REPEATING], max_tokens=24, ignore_eos=True)[0].outputs[0].token_ids
        assert llm.last_stats.draft_tokens > 0  # the drafts ran
        assert not llm.audit.of("setting_ignored")  # every key given acted
    with kvload.LLM("tiny-llama", device="cpu", log=False, kv_cache_config={"max_tokens": 256}) as plain:
        assert plain.generate([REPEATING], max_tokens=24, ignore_eos=True)[0].outputs[0].token_ids == drafted


def test_vllms_defaults_and_older_spelling_map_as_vllm_reads_them():
    # neither prompt_lookup bound: vLLM's 5; one of them: the other takes it; model "[ngram]": the method
    assert kvload.plan("tiny-llama", log=False, speculative_config={"method": "ngram", "num_speculative_tokens": 2}
                       ).args.max_matching_ngram_size == 5
    old = kvload.plan("tiny-llama", log=False, speculative_config={"model": "[ngram]", "num_speculative_tokens": 3,
                                                                   "prompt_lookup_min": 2, "disable_by_batch_size": 4})
    assert (old.args.max_draft_len, old.args.max_matching_ngram_size, old.args.speculation_max_batch_size) == (3, 2, 4)


def test_keys_kvload_cannot_honour_are_reported_ignored():
    result = kvload.plan("tiny-llama", log=False, speculative_config={
        **NGRAM, "prompt_lookup_min": 2, "disable_logprobs": False, "draft_tensor_parallel_size": 1})
    assert result.args.max_draft_len == 4
    ignored = {e["field"]: e["reason"] for e in result.audit.of("setting_ignored")}
    assert set(ignored) == {"speculative_config.prompt_lookup_min", "speculative_config.disable_logprobs",
                            "speculative_config.draft_tensor_parallel_size"}, ignored
    assert "down to one token" in ignored["speculative_config.prompt_lookup_min"]


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 3},
     "speculative_config: method 'eagle': kvload drafts by n-gram lookup in the prompt and output only; accepted: "
     "method 'ngram'"),
    ({"model": "facebook/opt-125m", "num_speculative_tokens": 5},
     "speculative_config: model 'facebook/opt-125m' (a draft model): kvload drafts by n-gram lookup"),
    ({"method": "mtp", "num_speculative_tokens": 1}, "speculative_config: method 'mtp': kvload drafts by n-gram"),
    ({"method": "ngram"}, "speculative_config: num_speculative_tokens: required with method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_maxx": 4},
     "speculative_config: 'prompt_lookup_maxx': not a vLLM speculative_config key kvload knows"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
     "speculative_config: prompt_lookup_min 3 is more than prompt_lookup_max 2"),
    ({"method": "ngram", "num_speculative_tokens": 100},
     "speculative_config: num_speculative_tokens: expected an integer from 1 to 64, got 100"),
])
def test_another_method_or_a_bad_key_is_one_line_naming_it(config, message):
    with pytest.raises(ConfigError) as info:
        kvload.LLM("tiny-llama", log=False, speculative_config=config)
    assert str(info.value).startswith(message), str(info.value)


def test_one_setting_given_both_ways_with_different_values_is_one_line_naming_both(capsys):
    with pytest.raises(ConfigError, match=r"^speculative_config: its num_speculative_tokens 4 and max_draft_len 2 set "
                                          r"one field \(num_speculative_tokens is vLLM's name for max_draft_len\)"):
        kvload.LLM("tiny-llama", log=False, speculative_config=NGRAM, max_draft_len=2)
    assert kvload.plan("tiny-llama", log=False, speculative_config=NGRAM, max_draft_len=4).args.max_draft_len == 4
    r = run_cli(capsys, "plan", "tiny-llama", "--speculative-config", json.dumps(NGRAM), "--max_draft_len", "2")
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith("error: --speculative-config: its num_speculative_tokens 4 and max_draft_len 2"), r.err


def test_the_flag_sets_kvloads_fields_on_every_command_and_names_itself_when_refused(capsys):
    r = run_cli(capsys, "plan", "tiny-llama", "--json", "--speculative-config", json.dumps(NGRAM))
    assert r.code == 0, r.err
    args = json.loads(r.out)["args"]
    assert (args["max_draft_len"], args["max_matching_ngram_size"]) == (4, 3)
    medusa = '{"method": "medusa", "num_speculative_tokens": 2}'
    r = run_cli(capsys, "plan", "tiny-llama", "--speculative-config", medusa)
    assert r.code == 2 and r.one_error_line and r.err.startswith("error: --speculative-config: method 'medusa'"), r.err
    ns = build_parser().parse_args(["serve", "tiny-llama", "--speculative-config", json.dumps(NGRAM)])
    assert cli_overrides(ns)["speculative_config"] == NGRAM  # kvload serve takes it, as vllm serve does


#: TensorRT-LLM's ``NGramDecodingConfig`` as an ``extra_llm_api_options`` file writes it
TRTLLM_NGRAM = """\
speculative_config:
  decoding_type: NGram
  max_draft_len: 4
  max_matching_ngram_size: 3
  max_concurrency: 2
"""


def test_a_trtllm_ngram_speculative_config_in_yaml_runs_kvloads_drafts(capsys, tmp_path):
    """TensorRT-LLM's NGram shape was only reported ignored, so a file that asks for n-gram drafts ran without them
    while vLLM's shape ran them: its fields are kvload's (max_concurrency is speculation_max_batch_size)."""
    config = tmp_path / "extra.yaml"
    config.write_text(TRTLLM_NGRAM)
    r = run_cli(capsys, "plan", "tiny-llama", "--extra_llm_api_options", config, "--json")
    assert r.code == 0, r.err
    args = json.loads(r.out)["args"]
    assert (args["max_draft_len"], args["max_matching_ngram_size"], args["speculation_max_batch_size"]) == (4, 3, 2)
    assert "setting_ignored" not in r.err, r.err  # every key given acted
    with kvload.LLM("tiny-llama", device="cpu", log=False, kv_cache_config={"max_tokens": 256},
                    speculative_config={"decoding_type": "NGram", "max_draft_len": 4}) as llm:
        assert (llm.args.max_draft_len, llm.args.max_matching_ngram_size) == (4, 2)  # TensorRT-LLM's default size
        llm.generate([REPEATING], max_tokens=24, ignore_eos=True)
        assert llm.last_stats.draft_tokens > 0  # the drafts ran


def test_trtllm_ngram_keys_kvload_cannot_honour_are_reported_ignored():
    result = kvload.plan("tiny-llama", log=False, speculative_config={
        "decoding_type": "NGram", "max_draft_len": 3, "is_keep_all": True, "is_use_oldest": True,
        "is_public_pool": False, "max_total_draft_tokens": 3, "speculative_model_dir": "/drafts/x"})
    assert result.args.max_draft_len == 3
    ignored = {e["field"]: e["reason"] for e in result.audit.of("setting_ignored")}
    # is_public_pool false and max_total_draft_tokens equal to max_draft_len are what kvload does: not reported
    assert set(ignored) == {"speculative_config.is_keep_all", "speculative_config.is_use_oldest",
                            "speculative_config.speculative_model_dir"}, ignored
    assert "latest" in ignored["speculative_config.is_use_oldest"]


@pytest.mark.parametrize(("config", "message"), [
    ({"decoding_type": "NGram", "max_matching_ngram_size": 3},
     "speculative_config: max_draft_len: required with decoding_type NGram"),
    ({"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_sizee": 3},
     "speculative_config: 'max_matching_ngram_sizee': not a key of TensorRT-LLM's NGramDecodingConfig"),
    ({"decoding_type": "NGram", "max_draft_len": 4, "max_concurrency": 0},
     "speculative_config: max_concurrency: expected an integer >= 1, got 0"),
    ({"decoding_type": "NGram", "max_draft_len": 4, "is_keep_all": "yes"},
     "speculative_config: is_keep_all: expected true or false, got 'yes'"),
])
def test_a_bad_trtllm_ngram_config_is_one_line_naming_the_key(config, message):
    with pytest.raises(ConfigError) as info:
        kvload.plan("tiny-llama", log=False, speculative_config=config)
    assert str(info.value).startswith(message), str(info.value)


def test_a_trtllm_ngram_config_and_a_different_top_level_max_draft_len_are_one_line(capsys, tmp_path):
    config = tmp_path / "extra.yaml"
    config.write_text(TRTLLM_NGRAM + "max_draft_len: 2\n")
    r = run_cli(capsys, "plan", "tiny-llama", "--config", config)
    assert r.code == 2 and r.one_error_line, r.err
    assert "speculative_config: its max_draft_len 4 and the top-level max_draft_len 2 set one field" in r.err, r.err


def test_another_trtllm_decoding_type_is_still_taken_and_reported_ignored(capsys, tmp_path):
    config = tmp_path / "extra.yaml"
    config.write_text("speculative_config:\n  decoding_type: Eagle\n  max_draft_len: 3\n"
                      "  speculative_model_dir: /drafts/eagle\n")
    r = run_cli(capsys, "plan", "tiny-llama", "--config", config, "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["args"]["max_draft_len"] == 0
    (line,) = [line for line in r.err.splitlines() if "setting_ignored" in line]
    assert "field=speculative_config " in line and "kvload drafts by n-gram lookup only" in line, line
