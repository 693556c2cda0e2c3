"""vLLM's spellings: the flags that mean exactly a kvload field are aliases; the look-alikes are refused with the
difference; the Python API takes vLLM's names of kvload fields as vLLM's ``LLM(...)`` does; the YAML file refuses them
with the key to write instead."""

from __future__ import annotations

import pytest

import kvload
from kvload.cli.flags import flag_aliases
from kvload.render import render_args
from pipeline.errors import ConfigError, GenerationError
from pipeline.paths import get_in
from pipeline.vllm_compat import DIFFERENT_MEANING, SAME_MEANING
from tests.cli_support import read_events, run_cli

#: vLLM's flag as typed, its words, the field it must set and the value it must hold.
ALIASES = [
    ("--max-model-len", ["512"], "max_seq_len", 512),
    ("--max_model_len", ["512"], "max_seq_len", 512),  # vLLM reads underscores too
    ("--max-num-seqs", ["8"], "max_batch_size", 8),
    ("--max-num-batched-tokens", ["256"], "max_num_tokens", 256),
    ("--block-size", ["16"], "kv_cache_config.tokens_per_block", 16),
    ("-tp", ["2"], "tensor_parallel_size", 2),
    ("--no-enable-prefix-caching", [], "kv_cache_config.enable_block_reuse", False),
    ("--enable-prefix-caching", [], "kv_cache_config.enable_block_reuse", True),
    ("--kv-cache-dtype", ["fp8_e5m2"], "kv_cache_config.dtype", "float8_e5m2"),  # vLLM's value names too
    ("--kv-cache-dtype", ["fp8_e4m3"], "kv_cache_config.dtype", "float8_e4m3fn"),
]


@pytest.mark.parametrize(("flag", "words", "path", "want"), ALIASES, ids=lambda v: str(v))
def test_a_vllm_flag_sets_kvloads_field_as_the_users_cli_setting(capsys, tmp_path, flag, words, path, want):
    log = tmp_path / "a.jsonl"
    r = run_cli(capsys, "plan", "tiny-llama", flag, *words, "--json", "--audit-log", log)
    assert r.code == 0, r.err
    doc = r.json()
    assert get_in(doc["args"], path) == want
    first = doc["provenance"][path][0]
    assert (first["event"], first["source"], first["new"]) == ("args_parsed", "cli", want)
    parsed = [e for e in read_events(log) if e["event"] == "args_parsed"]
    assert {e["field"]: e["source"] for e in parsed} == {"model": "cli", path: "cli"}  # nothing else was set


def test_explain_finds_a_field_by_its_vllm_spelling(capsys, tmp_path):
    log = tmp_path / "a.jsonl"
    r = run_cli(capsys, "plan", "tiny-llama", "--max-model-len", "512", "-tp", "2", "--block-size", "16",
                "--no-enable-prefix-caching", "--audit-log", log)
    assert r.code == 0, r.err
    for name, path, final in [("max-model-len", "max_seq_len", 512), ("max_model_len", "max_seq_len", 512),
                              ("tp", "tensor_parallel_size", 2), ("block-size", "kv_cache_config.tokens_per_block", 16),
                              ("no-enable-prefix-caching", "kv_cache_config.enable_block_reuse", False),
                              ("enable-prefix-caching", "kv_cache_config.enable_block_reuse", False)]:
        r = run_cli(capsys, "explain", log, name, "--json")
        assert r.code == 0, (name, r.err)
        assert list(r.json()) == [path] and r.json()[path]["final"] == final


@pytest.mark.parametrize(("argv", "line"), [
    (["--max-model-len", "0"], "error: --max-model-len: expected an integer >= 1, \"auto\" or null, got 0\n"),
    (["--max-model-len", "1kb"], "error: --max-model-len: expected an integer, got '1kb'\n"),
    (["--max-num-seqs", "0"], "error: --max-num-seqs: expected an integer >= 1, got 0\n"),
    (["--block-size", "0"], "error: --block-size: expected an integer >= 1, got 0\n"),
    (["-tp", "x"], "error: -tp: expected an integer, got 'x'\n"),
    (["-tp", "0"], "error: -tp: expected an integer >= 1, got 0\n"),  # the config's check, after parsing
])
def test_a_bad_value_under_a_vllm_flag_names_the_flag_as_typed(capsys, argv, line):
    r = run_cli(capsys, "plan", "tiny-llama", *argv)
    assert (r.code, r.out, r.one_error_line) == (2, "", True), r.err
    assert r.err.startswith(line), r.err


@pytest.mark.parametrize(("argv", "line"), [
    (["--gpu-memory-utilization", "0.9"],
     "error: --gpu-memory-utilization: vLLM's share of the whole GPU's memory (weights, activations and KV cache); "
     "kvload sizes the KV cache from the memory free after the weights: --kv_cache_free_gpu_memory_fraction (or "
     "--max_gpu_total_bytes)\n"),
    (["--gpu_memory_utilization=0.9"], "error: --gpu_memory_utilization: vLLM's share of the whole GPU's memory"),
    (["--swap-space", "4"], "error: --swap-space: vLLM's CPU swap space in GiB per GPU; kvload's host tier (V2 "
                            "only) is a byte count: --host_cache_size (4GiB where vLLM says 4)\n"),
])
def test_a_vllm_flag_that_means_something_else_is_refused_with_the_difference(capsys, argv, line):
    for command in ("plan", "run"):
        r = run_cli(capsys, command, "tiny-llama", *argv)
        assert (r.code, r.out, r.one_error_line) == (2, "", True), r.err
        assert r.err.startswith(line), r.err


def test_vllm_engine_flags_without_a_counterpart_are_taken_and_reported_as_python_reports_them(capsys, tmp_path):
    log = tmp_path / "audit.jsonl"
    r = run_cli(capsys, "plan", "tiny-llama", "--enforce-eager", "--max_logprobs", "5", "--tokenizer", "x",
                "--audit-log", log)
    assert r.code == 0, r.err
    said = {e["field"]: e["reason"] for e in read_events(log) if e["event"] == "setting_ignored"}
    assert set(said) == {"enforce_eager", "max_logprobs", "tokenizer"}
    assert said["enforce_eager"].startswith("a vLLM option kvload does not act on: CUDA graphs")
    assert said["enforce_eager"].endswith("(from cli)")


def test_trust_remote_code_is_taken_and_reported_as_ignored_since_no_checkpoint_code_ever_runs(capsys, tmp_path):
    """``LLM(model, trust_remote_code=True)`` / ``vllm serve --trust-remote-code`` are in most vLLM scripts; kvload
    refused them, though nothing would run differently: vLLM runs its own implementation of the families kvload serves,
    kvload runs transformers' built-in one, and no code from the checkpoint runs either way."""
    log = tmp_path / "audit.jsonl"
    r = run_cli(capsys, "plan", "tiny-llama", "--trust-remote-code", "--audit-log", log)
    assert r.code == 0, r.err
    said = {e["field"]: e["reason"] for e in read_events(log) if e["event"] == "setting_ignored"}
    assert said["trust_remote_code"].startswith("kvload never runs a checkpoint's own code"), said
    result = kvload.plan("tiny-llama", trust_remote_code=True, log=False)
    (event,) = [e for e in result.audit.of("setting_ignored") if e["field"] == "trust_remote_code"]
    assert event["value"] is True
    with pytest.raises(ConfigError, match="^trust_remote_code: expected true or false, got 'yes'"):
        kvload.plan("tiny-llama", trust_remote_code="yes", log=False)


@pytest.mark.parametrize(("argv", "field", "reason"), [
    (["--hf-token", "hf_secret"], "hf_token", "kvload never downloads"),
    (["-dp", "1"], "data_parallel_size", "kvload runs one engine per process"),
    (["--pipeline-parallel-size", "1"], "pipeline_parallel_size", "kvload splits a model by tensor parallel only"),
    (["--max-lora-rank", "16"], "max_lora_rank", "LoRA adapters"),
    (["--limit-mm-per-prompt", '{"image": 0}'], "limit_mm_per_prompt", "multimodal inputs"),
    (["--load-format", "safetensors"], "load_format", "a vLLM option kvload does not act on: kvload reads the "
                                                      "checkpoint's own files"),
    (["--logprobs-mode", "raw_logprobs"], "logprobs_mode", "kvload's logprobs are the model's raw distribution"),
    (["--enable-expert-parallel"], "enable_expert_parallel", "MoE expert parallelism"),
])
def test_more_vllm_launch_line_flags_are_taken_with_a_warning_each(capsys, tmp_path, argv, field, reason):
    """Flags of common ``vllm serve`` launch lines were "unrecognized arguments" (``--hf-token`` even suggested
    ``--max-num-tokens``); each is taken with one setting_ignored saying why, a secret's value hidden."""
    log = tmp_path / "audit.jsonl"
    r = run_cli(capsys, "plan", "tiny-llama", *argv, "--audit-log", log)
    assert r.code == 0, r.err
    said = {e["field"]: e for e in read_events(log) if e["event"] == "setting_ignored"}
    assert reason in said[field]["reason"], said
    assert "hf_secret" not in r.err and "hf_secret" not in log.read_text()


@pytest.mark.parametrize(("argv", "line"), [
    # named as typed, as kvload's own flags are (-tp 0): the short spelling, not the long one the user never wrote
    (["-dp", "2"], "error: -dp: vLLM's setting; kvload runs one engine per process (start one kvload serve per "
                   "replica); accepted: 1, got 2"),
    (["-dp=2"], "error: -dp: vLLM's setting; kvload runs one engine per process"),
    (["--data-parallel-size", "2"], "error: --data-parallel-size: vLLM's setting; kvload runs one engine per process"),
    (["-pp", "2"], "error: -pp: vLLM's setting; kvload splits a model by tensor parallel only "
                   "(tensor_parallel_size); accepted: 1, got 2"),
    (["-q", "awq"], "error: -q: vLLM's setting; kvload runs the checkpoint's weights in dtype, unquantized"),
    (["--logprobs-mode", "processed_logprobs"], "error: --logprobs-mode: vLLM's setting; kvload's logprobs are the "
                                                "model's raw distribution"),
])
def test_a_vllm_parallel_or_logprobs_setting_kvload_cannot_honour_is_one_line(capsys, argv, line):
    r = run_cli(capsys, "plan", "tiny-llama", *argv)
    assert (r.code, r.out, r.one_error_line) == (2, "", True) and r.err.startswith(line), r.err


@pytest.mark.parametrize(("argv", "line"), [
    (["--enable-prefix-caching", "--no-enable-prefix-caching"],
     "error: --no-enable-prefix-caching: contradicts --enable-prefix-caching; give one\n"),
    (["--disable_kv_cache_reuse", "--enable-prefix-caching"],
     "error: --enable-prefix-caching: contradicts --disable_kv_cache_reuse; give one\n"),
    (["-tp", "2", "--tp_size", "2"], "error: -tp: given more than once (also as --tp_size); give it once\n"),
    (["--max-model-len", "64", "--max_seq_len", "64"],
     "error: --max-model-len: given more than once (also as --max_seq_len); give it once\n"),
])
def test_one_setting_given_both_ways_is_refused_not_the_last_winning(capsys, argv, line):
    r = run_cli(capsys, "plan", "tiny-llama", *argv)
    assert (r.code, r.out, r.err) == (2, "", line)


def test_every_vllm_name_of_the_same_meaning_is_a_flag_of_that_field():
    aliases = flag_aliases()
    for name, path in SAME_MEANING.items():
        assert aliases["--" + name.replace("_", "-")] == path, name
    assert not {"--" + name.replace("_", "-") for name in DIFFERENT_MEANING} & set(aliases)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"gpu_memory_utilization": 0.9}, "gpu_memory_utilization: vLLM's share of the whole GPU's memory (weights, "
                                      "activations and KV cache); kvload sizes the KV cache from the memory free "
                                      "after the weights: kv_cache_config.free_gpu_memory_fraction (or "
                                      "kv_cache_config.max_gpu_total_bytes)"),
    ({"swap_space": 4}, "swap_space: vLLM's CPU swap space in GiB per GPU; kvload's host tier (V2 only) is a byte "
                        "count: kv_cache_config.host_cache_size (4GiB where vLLM says 4)"),
    ({"max_model_len": 64, "swap_space": 4}, "swap_space: vLLM's CPU swap space in GiB per GPU"),  # a taken one first
    # a byte count either way: the line writes the keyword's value where kvload takes its cap
    ({"kv_cache_memory_bytes": 2**30}, "kv_cache_memory_bytes: vLLM's KV cache size in bytes per GPU, in place of "
                                       "gpu_memory_utilization; kvload caps the KV cache at a byte count and within "
                                       "the share of free memory it is allowed: kv_cache_config.max_gpu_total_bytes "
                                       "(pass kv_cache_config={'max_gpu_total_bytes': 1073741824} for that cap)"),
])
def test_the_python_api_refuses_a_vllm_name_that_means_something_else_with_the_difference(kwargs, message):
    with pytest.raises(ConfigError) as info:
        kvload.LLM("tiny-llama", log=False, **kwargs)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    assert info.value.source == "api"


#: vLLM's ``LLM(...)`` keywords the tests below pass, and kvload's fields they must set.
VLLM_KEYWORDS = {"max_model_len": 32, "max_num_seqs": 2, "enable_prefix_caching": False, "block_size": 8,
                 "max_num_batched_tokens": 16}


def test_llm_takes_vllms_names_of_kvload_fields_and_they_act():
    with kvload.LLM("tiny-llama", device="cpu", log=False, kv_cache_config={"max_tokens": 256},
                    **VLLM_KEYWORDS) as llm:
        args = llm.args
        assert (args.max_seq_len, args.max_batch_size, args.max_num_tokens) == (32, 2, 16)
        assert (args.kv_cache_config.enable_block_reuse, args.kv_cache_config.tokens_per_block) == (False, 8)
        assert args.kv_cache_config.max_tokens == 256  # the kv_cache_config given beside them is kept
        (built,) = llm.audit.of("kv_manager_built")
        assert (built["tokens_per_block"], built["max_seq_len"]) == (8, 32)
        with pytest.raises(GenerationError, match=r"prompt 0: 40 tokens leave no room to generate under "
                                                  r"max_seq_len=32"):
            llm.generate([list(range(1, 41))], max_tokens=2)
        prompt = list(range(1, 21))
        llm.generate([prompt], max_tokens=2)
        assert llm.generate([prompt], max_tokens=2)[0].num_cached_tokens == 0  # prefix caching off: nothing reused
        llm.generate([[1, 2, 3]] * 4, max_tokens=3, ignore_eos=True)
        assert llm.last_stats.steps == 2 * 3  # two requests at a time: a prefill and two decodes each
    with kvload.LLM("tiny-llama", device="cpu", log=False, block_size=8, kv_cache_config={"max_tokens": 256}) as llm:
        llm.generate([prompt], max_tokens=2)
        assert llm.generate([prompt], max_tokens=2)[0].num_cached_tokens == 16  # on: its two full 8-token blocks


def test_none_under_a_vllm_name_is_vllms_unset_default_and_sets_nothing():
    unset = {name: None for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                                     "kv_cache_dtype", "enable_prefix_caching")}
    given = kvload.plan("tiny-llama", log=False, **unset)
    plain = kvload.plan("tiny-llama", log=False)
    assert given.args == plain.args  # every field at kvload's default, as vLLM's None leaves vLLM's
    assert {e["field"] for e in given.audit.of("args_parsed")} == {e["field"] for e in plain.audit.of("args_parsed")}
    # beside kvload's own name, None is no second value to conflict with
    assert kvload.plan("tiny-llama", log=False, max_seq_len=64, max_model_len=None).args.max_seq_len \
        == 64


def test_a_vllm_keyword_is_the_users_setting_in_the_audit_and_the_plan_table(capsys, tmp_path):
    log = tmp_path / "a.jsonl"
    result = kvload.plan("tiny-llama", log=False, audit_log=log, kv_cache_dtype="fp8",
                         kv_cache_config=kvload.KvCacheConfig(max_tokens=512), **VLLM_KEYWORDS)
    parsed = {e["field"]: (e["source"], e["new"], e.get("given_as")) for e in result.audit.of("args_parsed")}
    assert parsed == {"model": ("api", "tiny-llama", None), "max_seq_len": ("api", 32, "max_model_len"),
                      "max_batch_size": ("api", 2, "max_num_seqs"),
                      "kv_cache_config.enable_block_reuse": ("api", False, "enable_prefix_caching"),
                      "kv_cache_config.tokens_per_block": ("api", 8, "block_size"),
                      "max_num_tokens": ("api", 16, "max_num_batched_tokens"),
                      "kv_cache_config.dtype": ("api", "float8_e4m3fn", "kv_cache_dtype"),
                      "kv_cache_config.max_tokens": ("api", 512, None)}
    (snapshot,) = result.audit.of("user_fields_snapshotted")
    assert snapshot["fields"]["max_seq_len"] == {"value": 32, "source": "api"}
    rows = {line.split()[0]: line for line in render_args(result)[2:]}
    assert rows["max_seq_len"].split()[1:] == ["32", "api", "given", "as", "vLLM's", "max_model_len"]
    assert rows["max_num_tokens"].endswith("api     given as vLLM's max_num_batched_tokens")
    assert result.audit.provenance("max_seq_len")[-1]["given_as"] == "max_model_len"
    with kvload.load("tiny-llama", log=False, max_model_len=48, kv_cache_config={"max_tokens": 256}) as loaded:
        assert loaded.kv.max_seq_len == 48
    r = run_cli(capsys, "audit", log, "--verify")
    assert r.code == 0, r.err
    r = run_cli(capsys, "explain", log, "max_model_len")
    assert r.code == 0 and "passed to the Python API as vLLM's max_model_len" in r.out, r.out


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_model_len": 4096, "max_seq_len": 2048},
     "max_model_len=4096 and max_seq_len=2048 set one field (max_model_len is vLLM's name for max_seq_len) to "
     "different values; give one"),
    ({"max_seq_len": 2048, "max_model_len": 4096},
     "max_model_len=4096 and max_seq_len=2048 set one field (max_model_len is vLLM's name for max_seq_len) to "
     "different values; give one"),
    ({"block_size": 16, "kv_cache_config": {"tokens_per_block": 32}},
     "block_size=16 and kv_cache_config={'tokens_per_block': 32} set one field (block_size is vLLM's name for "
     "kv_cache_config.tokens_per_block) to different values; give one"),
    ({"enable_prefix_caching": False, "kv_cache_config": kvload.KvCacheConfig(enable_block_reuse=True)},
     "enable_prefix_caching=False and kv_cache_config={'enable_block_reuse': True} set one field "
     "(enable_prefix_caching is vLLM's name for kv_cache_config.enable_block_reuse) to different values; give one"),
])
def test_one_field_given_under_both_names_with_different_values_is_one_line_naming_both(kwargs, message):
    with pytest.raises(ConfigError) as info:
        kvload.LLM("tiny-llama", log=False, **kwargs)
    assert (str(info.value), info.value.source) == (message, "api")


def test_one_field_given_under_both_names_with_one_value_is_taken_as_kvloads():
    result = kvload.plan("tiny-llama", log=False, max_model_len=64, max_seq_len=64, kv_cache_dtype="fp8",
                         kv_cache_config={"dtype": "float8_e4m3fn"})  # fp8 is float8_e4m3fn: one value
    assert (result.args.max_seq_len, result.args.kv_cache_config.dtype) == (64, "float8_e4m3fn")
    parsed = {e["field"]: e.get("given_as") for e in result.audit.of("args_parsed")}
    assert parsed == {"model": None, "max_seq_len": None, "kv_cache_config.dtype": None}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_model_len": 0}, "max_model_len: expected an integer >= 1, \"auto\" or null, got 0 (vLLM's name for "
                           "max_seq_len)"),
    ({"max_num_seqs": True}, "max_num_seqs: expected an integer >= 1, got true (vLLM's name for max_batch_size)"),
    ({"block_size": "16"}, "block_size: expected an integer >= 1, got '16' (vLLM's name for "
                           "kv_cache_config.tokens_per_block)"),
    ({"enable_prefix_caching": "yes", "kv_cache_config": {"max_tokens": 64}},
     "enable_prefix_caching: expected true or false, got 'yes' (vLLM's name for kv_cache_config.enable_block_reuse)"),
    ({"kv_cache_dtype": "fp9"}, "kv_cache_dtype: expected \"auto\" or one of float32, float16, bfloat16, "
                                "float8_e4m3fn, float8_e5m2 (aliases: fp32, float, fp16, half, bf16, fp8, fp8_e4m3, "
                                "fp8_e5m2), got 'fp9' (vLLM's name for kv_cache_config.dtype)"),
    ({"block_size": 16, "kv_cache_config": "x"},
     "kv_cache_config: expected a mapping of KvCacheConfig fields, got 'x'"),
])
def test_a_bad_value_under_a_vllm_keyword_is_one_line_naming_it_and_what_is_accepted(kwargs, message):
    with pytest.raises(ConfigError) as info:
        kvload.LLM("tiny-llama", log=False, **kwargs)
    assert (str(info.value), info.value.source) == (message, "api")


def test_a_config_file_refuses_a_vllm_name_with_the_key_to_write(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("block_size: 16\n")
    r = run_cli(capsys, "plan", "tiny-llama", "--config", cfg)
    assert (r.code, r.out) == (2, "")
    assert r.err == (f"error: config file {cfg}: block_size: vLLM's name for kv_cache_config.tokens_per_block; "
                     "write kv_cache_config: {tokens_per_block: 16}\n")


@pytest.mark.parametrize(("line", "said"), [
    # vLLM's own config files spell keys as its flags, dashed: `max-num-seqs` was offered 'max_num_tokens', another
    # setting, and `block-size` got the whole list of keys; now the underscored key's own words, and that spelling
    ("max-num-seqs: 4", "max-num-seqs: a config file spells its keys with underscores (max_num_seqs); max_num_seqs: "
                        "vLLM's name for max_batch_size; write max_batch_size: 4"),
    ("block-size: 16", "block-size: a config file spells its keys with underscores (block_size); block_size: vLLM's "
                       "name for kv_cache_config.tokens_per_block; write kv_cache_config: {tokens_per_block: 16}"),
    ("max-seq-len: 2048", "max-seq-len: a config file spells its keys with underscores; write max_seq_len: 2048"),
    ("max-tokens: 64", "max-tokens: a config file spells its keys with underscores (max_tokens); max_tokens: a "
                       "kv_cache_config field, not a top-level one; write kv_cache_config: {max_tokens: 64}"),
    ("enforce-eager: true", "enforce-eager: a config file spells its keys with underscores; enforce_eager is taken "
                            "(a vLLM option kvload does not act on, said setting_ignored)"),
    ("kv-cache-config: {max_tokens: 64}", "kv-cache-config: a config file spells its keys with underscores; write it "
                                          "as kv_cache_config"),
])
def test_a_config_files_dashed_key_is_refused_with_the_underscored_keys_own_words(capsys, tmp_path, line, said):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(line + "\n")
    r = run_cli(capsys, "plan", "tiny-llama", "--config", cfg)
    assert (r.code, r.out, r.err) == (2, "", f"error: config file {cfg}: {said}\n")


@pytest.mark.parametrize(("argv", "field", "value"), [
    (["--max-model-len", "32k"], "max_seq_len", 32_000),
    (["--max-model-len", "32K"], "max_seq_len", 32_768),
    (["--max_seq_len", "25.6k"], "max_seq_len", 25_600),
    (["--max-num-batched-tokens", "8K"], "max_num_tokens", 8_192),
    (["--max-num-batched-tokens", "2048"], "max_num_tokens", 2_048),
])
def test_token_counts_take_vllms_suffixes_as_vllm_reads_them(capsys, argv, field, value):
    """vLLM reads ``--max-model-len 32k`` as 32,000 and ``32K`` as 32,768 (``human_readable_int``); a launch line
    with one was "expected an integer"."""
    r = run_cli(capsys, "plan", "tiny-llama", *argv, "--json")
    assert r.code == 0, r.err
    assert get_in(r.json()["args"], field) == value


def test_a_binary_suffix_on_a_decimal_is_refused_as_vllm_refuses_it(capsys):
    r = run_cli(capsys, "plan", "tiny-llama", "--max-model-len", "1.5K")
    assert (r.code, r.one_error_line) == (2, True) and r.err.startswith(
        "error: --max-model-len: a binary suffix (K) takes a whole number, got '1.5K'"), r.err


@pytest.mark.parametrize(("key", "said"), [
    ("max_num_seq", "did you mean 'max_num_seqs'? (vLLM's name for max_batch_size)"),  # was: 'max_num_tokens'
    ("max_model_length", "did you mean 'max_model_len'? (vLLM's name for max_seq_len)"),  # was: every field
    ("enable_prefix_cache", "did you mean 'enable_prefix_caching'? (vLLM's name for "
                            "kv_cache_config.enable_block_reuse)"),
    ("gpu_memory_util", "did you mean 'gpu_memory_utilization'? (vLLM's name, refused naming kvload's setting "
                        "(kv_cache_config.free_gpu_memory_fraction, kv_cache_config.max_gpu_total_bytes))"),
    ("enforce_eger", "did you mean 'enforce_eager'? (vLLM's enforce_eager, taken and reported setting_ignored)"),
])
def test_a_mistyped_vllm_keyword_is_offered_the_vllm_name_the_api_takes(key, said):
    """``LLM(...)`` / ``plan(...)`` take vLLM's names; a typo of one was offered only kvload's fields: another
    setting (``max_num_seq``: 'max_num_tokens') or the whole list of them."""
    with pytest.raises(ConfigError) as err:
        kvload.plan("tiny-llama", **{key: 4})
    assert str(err.value) == f"{key}: unknown key; {said}"
    suggested = said.split("'")[1]
    if suggested in SAME_MEANING:  # what was offered is taken
        assert kvload.plan("tiny-llama", **{suggested: True if suggested.startswith("enable") else 64}).args is not None
