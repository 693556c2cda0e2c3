"""TensorRT-LLM users' inputs: their flag spellings, their options YAML, one memory-size convention,
and the same verdict on a value whichever source (CLI, YAML, Python) gave it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kvload.api import plan
from pipeline.config import parse_size
from pipeline.errors import ConfigError
from pipeline.trtllm_compat import FILE_FLAG_NAMES, IGNORED_KV_CACHE_CONFIG, IGNORED_LLM_ARGS
from tests.cli_support import read_events, run_cli

FRACTION = "kv_cache_config.free_gpu_memory_fraction"

#: What a TensorRT-LLM user's ``extra_llm_api_options`` file typically holds.
TRTLLM_YAML = """\
max_batch_size: 16
max_num_tokens: 4096
cuda_graph_config:
  enable_padding: true
  max_batch_size: 16
enable_chunked_prefill: true
print_iter_log: true
disable_overlap_scheduler: false
enable_attention_dp: false
moe_config:
  backend: CUTLASS
trust_remote_code: false
kv_cache_config:
  free_gpu_memory_fraction: 0.8
  enable_block_reuse: true
  copy_on_partial_reuse: false
"""
IGNORED_IN_YAML = {"cuda_graph_config", "enable_chunked_prefill", "print_iter_log", "disable_overlap_scheduler",
                   "enable_attention_dp", "moe_config", "trust_remote_code", "kv_cache_config.copy_on_partial_reuse"}


@pytest.mark.parametrize("spelling", ["--kv_cache_free_gpu_memory_fraction", "--kv-cache-free-gpu-memory-fraction",
                                      "--kv_cache_fraction", "--kv_cache_free_gpu_mem_fraction",
                                      "--free_gpu_memory_fraction"])  # trtllm-serve's own name of the flag
def test_trtllm_flag_spellings_set_the_same_field(capsys, spelling):
    r = run_cli(capsys, "plan", "tiny-llama", spelling, "0.5", "--json")
    assert r.code == 0, r.err
    assert r.json()["args"]["kv_cache_config"]["free_gpu_memory_fraction"] == 0.5


@pytest.mark.parametrize("spelling", ["--kv_cache_fraction", "--kv_cache_free_gpu_memory_fraction"])
def test_an_error_names_the_spelling_the_user_typed(capsys, spelling):
    r = run_cli(capsys, "plan", "tiny-llama", spelling, "1.5")
    assert r.code == 2 and r.one_error_line
    assert r.err.startswith(f"error: {spelling}: expected a number in (0, 1]")


def test_a_trtllm_options_yaml_loads_with_one_warning_per_ignored_key(capsys, tmp_path):
    cfg = tmp_path / "extra.yaml"
    cfg.write_text(TRTLLM_YAML)
    log = tmp_path / "a.jsonl"
    r = run_cli(capsys, "plan", "tiny-llama", "--extra_llm_api_options", cfg, "--json", "--audit-log", log)
    assert r.code == 0, r.err
    args = r.json()["args"]
    assert (args["max_batch_size"], args["max_num_tokens"]) == (16, 4096)
    assert args["kv_cache_config"]["free_gpu_memory_fraction"] == 0.8
    ignored = [e for e in read_events(log) if e["event"] == "setting_ignored"]
    from_file = [e for e in ignored if e["stage"] == "parse_args"]  # later stages may ignore others (CPU fraction)
    assert {e["field"] for e in from_file} == IGNORED_IN_YAML
    assert all(e["level"] == "warning" and "config_file" in e["reason"] for e in from_file)
    warning_lines = [line for line in r.err.splitlines() if "setting_ignored" in line]
    assert len(warning_lines) == len(ignored)  # one line each, on stderr; stdout stays JSON


def test_an_audit_log_with_ignored_trtllm_keys_still_verifies(capsys, tmp_path):
    cfg = tmp_path / "extra.yaml"
    cfg.write_text(TRTLLM_YAML)
    log = tmp_path / "a.jsonl"
    assert run_cli(capsys, "plan", "tiny-llama", "--config", cfg, "--audit-log", log).code == 0
    assert run_cli(capsys, "audit", log, "--verify").code == 0


def _config_refused(capsys, tmp_path, yaml_text: str, needle: str) -> None:
    """``plan --config`` of ``yaml_text`` exits 2 with one error line that holds ``needle`` and names the file."""
    cfg = tmp_path / "extra.yaml"
    cfg.write_text(yaml_text)
    r = run_cli(capsys, "plan", "tiny-llama", "--config", cfg)
    assert r.code == 2 and r.one_error_line, r.err
    assert needle in r.err and str(cfg) in r.err


@pytest.mark.parametrize(("yaml_text", "needle"), [
    ("cuda_graph_confg: {}\n", "cuda_graph_confg: unknown key; did you mean 'cuda_graph_config'"),
    ("max_batch_sise: 4\n", "max_batch_sise: unknown key; did you mean 'max_batch_size'"),
    ("kv_cache_config:\n  copy_on_partial_reuze: true\n",
     "kv_cache_config.copy_on_partial_reuze: unknown key; did you mean 'copy_on_partial_reuse'"),
    ("no_such_option_anywhere: 1\n", "no_such_option_anywhere: unknown key"),
    ("trust_remote_code: maybe\n", "trust_remote_code: expected true or false, got 'maybe'"),
])
def test_truly_unknown_keys_still_fail_with_a_suggestion(capsys, tmp_path, yaml_text, needle):
    _config_refused(capsys, tmp_path, yaml_text, needle)


def test_trust_remote_code_none_is_written_as_the_python_caller_wrote_it_and_null_in_a_file(capsys, tmp_path):
    """A Python keyword's None reads None in its refusal, as log=None's does (the options file's null reads null)."""
    with pytest.raises(ConfigError, match=r"^trust_remote_code: expected true or false, got None$"):
        plan("tiny-llama", log=False, trust_remote_code=None)
    _config_refused(capsys, tmp_path, "trust_remote_code: null\n",
                    "trust_remote_code: expected true or false, got null")


@pytest.mark.parametrize(("yaml_text", "needle"), [
    # difflib offered max_num_tokens (another setting: tokens per step, not the cache's size)
    ("max_tokens: 4096\n", "max_tokens: a kv_cache_config field, not a top-level one; write kv_cache_config: "
                           "{max_tokens: 4096}"),
    ("tokens_per_block: 64\n", "write kv_cache_config: {tokens_per_block: 64}"),
    # the flags' names: difflib offered max_batch_size for tp_size
    ("tp_size: 2\n", "tp_size: the command line's name for tensor_parallel_size; write tensor_parallel_size: 2"),
])
def test_a_key_at_the_wrong_level_or_in_the_flags_spelling_says_where_it_goes(capsys, tmp_path, yaml_text, needle):
    _config_refused(capsys, tmp_path, yaml_text, needle)


#: NVIDIA's published options files (each names its source): the ones kvload refuses → the start of its one line
OPTIONS_FILES = Path(__file__).parent / "data" / "trtllm_options"
REFUSED_FILES = {"nemotron-super-marlin.yaml": "pipeline_parallel_size: TensorRT-LLM's setting; kvload splits",
                 "r1-blog-min-latency.yaml": "pytorch_backend_config: the nesting of TensorRT-LLM's older releases"}


@pytest.mark.parametrize("name", sorted(p.name for p in OPTIONS_FILES.glob("*.yaml")))
def test_nvidias_options_files_drop_no_key_silently(capsys, tmp_path, name):
    """Each key of a published file acts (an args_parsed event from the file) or is reported setting_ignored once;
    a file kvload cannot honour is one error line naming the key. --tp_size 1: the tiny model has 4 heads."""
    path = OPTIONS_FILES / name
    log = tmp_path / "a.jsonl"
    r = run_cli(capsys, "plan", "tiny-llama", "--extra_llm_api_options", path, "--tp_size", "1", "--audit-log", log)
    if name in REFUSED_FILES:
        assert r.code == 2 and r.one_error_line and REFUSED_FILES[name] in r.err, r.err
        return
    assert r.code == 0, r.err
    events = read_events(log)
    tree = yaml.safe_load(path.read_text())
    keys = [f"kv_cache_config.{k}" for k in tree.get("kv_cache_config", {})]
    keys += [FILE_FLAG_NAMES.get(k, k) for k in tree if k != "kv_cache_config"]
    for key in keys:
        acted = [e for e in events if e["event"] == "args_parsed" and e["source"] == "config_file"
                 and e["field"] == key]
        ignored = [e for e in events if e["event"] == "setting_ignored" and e["stage"] == "parse_args"
                   and e["field"] == key]
        assert (len(acted), len(ignored)) in ((1, 0), (0, 1)), (key, acted, ignored)


def test_nvidias_curated_file_sets_the_fraction_by_its_command_line_name(capsys, tmp_path):
    cfg = OPTIONS_FILES / "qwen3.yaml"  # kv_cache_free_gpu_memory_fraction: 0.8 at the top level
    log = tmp_path / "a.jsonl"
    r = run_cli(capsys, "plan", "tiny-llama", "--extra_llm_api_options", cfg, "--json", "--audit-log", log)
    assert r.code == 0, r.err
    assert r.json()["args"]["kv_cache_config"]["free_gpu_memory_fraction"] == 0.8
    parsed = [e for e in read_events(log) if e["event"] == "args_parsed" and e["field"] == FRACTION]
    assert [(e["new"], e["source"]) for e in parsed] == [(0.8, "config_file")]
    ignored = {e["field"] for e in read_events(log) if e["event"] == "setting_ignored" and e["stage"] == "parse_args"}
    assert ignored == {"moe_expert_parallel_size", "cuda_graph_config", "print_iter_log", "enable_attention_dp"}


def test_the_fraction_under_both_names_must_agree(capsys, tmp_path):
    _config_refused(capsys, tmp_path, "kv_cache_free_gpu_memory_fraction: 0.5\n"
                                      "kv_cache_config:\n  free_gpu_memory_fraction: 0.6\n",
                    "kv_cache_free_gpu_memory_fraction: 0.5 and kv_cache_config.free_gpu_memory_fraction 0.6 set one "
                    "field")
    cfg = tmp_path / "same.yaml"
    cfg.write_text("kv_cache_free_gpu_memory_fraction: 0.5\nkv_cache_config:\n  free_gpu_memory_fraction: 0.5\n")
    r = run_cli(capsys, "plan", "tiny-llama", "--config", cfg, "--json")
    assert r.code == 0 and r.json()["args"]["kv_cache_config"]["free_gpu_memory_fraction"] == 0.5


def test_a_python_keyword_in_the_flags_spelling_is_still_refused():
    with pytest.raises(ConfigError, match=re.escape("kv_cache_free_gpu_memory_fraction: the command line's name for "
                                                    "kv_cache_config.free_gpu_memory_fraction")):
        plan("tiny-llama", kv_cache_free_gpu_memory_fraction=0.5, log=False)


#: trtllm-serve's flags (tensorrt_llm/commands/serve.py) for LlmArgs keys kvload does not act on → the key reported
TRTLLM_SERVE_IGNORED = [
    (["--backend", "pytorch"], "backend", "builds no TensorRT engine"),
    (["--backend", "trt"], "backend", "builds no TensorRT engine"),
    (["--ep_size", "2"], "moe_expert_parallel_size", "parallelism beyond tensor parallel"),
    (["--moe_expert_parallel_size", "2"], "moe_expert_parallel_size", "parallelism beyond tensor parallel"),
    (["--cp_size", "1"], "context_parallel_size", "parallelism beyond tensor parallel"),
    (["--cluster_size", "1"], "moe_cluster_parallel_size", "parallelism beyond tensor parallel"),
    (["--gpus_per_node", "8"], "gpus_per_node", "parallelism beyond tensor parallel"),
    (["--num_postprocess_workers", "4"], "num_postprocess_workers", "serving feature"),
    (["--custom_tokenizer", "deepseek_v32"], "custom_tokenizer", "serving feature"),
    (["--fail_fast_on_attention_window_too_large"], "fail_fast_on_attention_window_too_large", "kv_budget_short"),
    (["--custom_module_dirs", "."], "custom_module_dirs", "imports no code from outside it"),
    (["--pp_size", "1"], "pipeline_parallel_size", "a TensorRT-LLM and vLLM option kvload does not act on: kvload "
                                                   "splits a model by tensor parallel only"),
]


@pytest.mark.parametrize(("argv", "field", "why"), TRTLLM_SERVE_IGNORED)
def test_trtllm_serve_flags_are_taken_and_reported_ignored(capsys, tmp_path, argv, field, why):
    log = tmp_path / "a.jsonl"
    r = run_cli(capsys, "plan", "tiny-llama", *argv, "--audit-log", log)
    assert r.code == 0, r.err
    ignored = [e for e in read_events(log) if e["event"] == "setting_ignored" and e["field"] == field]
    assert len(ignored) == 1 and why in ignored[0]["reason"], ignored


@pytest.mark.parametrize(("argv", "line"), [
    (["--pp_size", "2"], "error: --pp_size: TensorRT-LLM's setting; kvload splits a model by tensor parallel only "
                         "(tensor_parallel_size); accepted: 1, got 2"),
    (["--server_role", "CONTEXT"], "error: --server_role: disaggregated serving"),
    (["--disagg_cluster_uri", "http://h:1"], "error: --disagg_cluster_uri: disaggregated serving"),
    (["--grpc"], "error: --grpc: kvload serve answers HTTP (the OpenAI API) only"),
    (["--backend", "vllm"], "error: --backend: expected one of TensorRT-LLM's backends, pytorch, tensorrt, trt, "
                            "_autodeploy; got 'vllm'"),
])
def test_trtllm_serve_flags_kvload_cannot_honour_are_refused_by_name(capsys, argv, line):
    r = run_cli(capsys, "plan", "tiny-llama", *argv)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith(line), r.err


def test_serve_takes_trtllm_serve_flags_into_its_settings():
    from kvload.cli.commands import build_parser
    from kvload.cli.flags import cli_overrides

    ns = build_parser().parse_args(["serve", "tiny-llama", "--backend", "pytorch", "--ep_size", "4", "--pp_size", "1",
                                    "--free_gpu_memory_fraction", "0.7", "--num_postprocess_workers", "2"])
    assert cli_overrides(ns) == {"backend": "pytorch", "moe_expert_parallel_size": 4, "pipeline_parallel_size": 1,
                                 "num_postprocess_workers": 2, "kv_cache_config": {"free_gpu_memory_fraction": 0.7}}


def _serve_flags(*argv: str) -> object:
    from kvload.cli.commands import build_parser

    return build_parser().parse_args(["serve", "tiny-llama", *argv])


def test_trtllm_serves_tool_parser_qwen3_serves_tool_calls_as_hermes():
    ns = _serve_flags("--tool_parser", "qwen3")  # no --enable-auto-tool-choice: TensorRT-LLM needs none
    assert (ns.tool_call_parser, ns.enable_auto_tool_choice) == ("hermes", True)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--tool_parser", "kimi_k2"], "--tool_parser: no reader for TensorRT-LLM's tool parser 'kimi_k2' in kvload; it "
                                   "reads TensorRT-LLM's qwen3"),
    (["--tool_parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "pythonic"],
     "--tool_parser reads as --tool-call-parser hermes, and --tool-call-parser pythonic was given too"),
])
def test_a_trtllm_tool_parser_kvload_cannot_read_is_refused_by_name(capsys, argv, needle):
    with pytest.raises(SystemExit) as stop:
        _serve_flags(*argv)
    assert stop.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize(("yaml_text", "field", "why"), [
    # NVIDIA's database files (examples/configs/database/deepseek-ai/DeepSeek-R1-0528/B200/1k1k_tp8_conc64.yaml)
    ("backend: pytorch\n", "backend", "builds no TensorRT engine"),
    ("pipeline_parallel_size: 1\n", "pipeline_parallel_size", "a TensorRT-LLM option kvload does not act on"),
    ("fail_fast_on_attention_window_too_large: true\n", "fail_fast_on_attention_window_too_large", "kv_budget_short"),
])
def test_an_options_files_trtllm_keys_are_reported_as_trtllm_ones(capsys, tmp_path, yaml_text, field, why):
    cfg = tmp_path / "extra.yaml"
    cfg.write_text(yaml_text)
    log = tmp_path / "a.jsonl"
    r = run_cli(capsys, "plan", "tiny-llama", "--config", cfg, "--audit-log", log)
    assert r.code == 0, r.err
    ignored = [e for e in read_events(log) if e["event"] == "setting_ignored" and e["field"] == field]
    assert len(ignored) == 1 and why in ignored[0]["reason"], ignored


def test_an_options_files_pipeline_parallel_size_is_refused_as_trtllms(capsys, tmp_path):
    # NVIDIA's curated nemotron-super-marlin.yaml sets pipeline_parallel_size: 2; kvload said it was vLLM's setting
    _config_refused(capsys, tmp_path, "pipeline_parallel_size: 2\n",
                    "pipeline_parallel_size: TensorRT-LLM's setting; kvload splits a model by tensor parallel only")


def test_an_older_releases_pytorch_backend_config_says_where_its_keys_are_now(capsys, tmp_path):
    # TensorRT-LLM's blog "Best perf practice on DeepSeek-R1" (docs/source/blogs, 2025): difflib offered
    # torch_compile_config, another setting
    _config_refused(capsys, tmp_path, "pytorch_backend_config:\n  enable_overlap_scheduler: true\n  use_cuda_graph: "
                                      "true\n  moe_backend: TRTLLM\n",
                    "pytorch_backend_config: the nesting of TensorRT-LLM's older releases, which its current LlmArgs "
                    "no longer takes; write its keys at the top level by today's names: kv_cache_dtype as "
                    "kv_cache_config: {dtype: ...}")


def test_a_python_keyword_at_the_wrong_level_says_where_it_goes():
    with pytest.raises(ConfigError, match=re.escape("max_tokens: a kv_cache_config field, not a top-level one; pass "
                                                    "kv_cache_config={'max_tokens': 4096}")):
        plan("tiny-llama", max_tokens=4096, log=False)


def test_python_overrides_get_the_same_treatment():
    result = plan("tiny-llama", cuda_graph_config={"enable_padding": True},
                  kv_cache_config={"max_tokens": 4096, "use_uvm": False}, log=False)
    fields = {r["field"] for r in result.audit.of("setting_ignored")}
    assert {"cuda_graph_config", "kv_cache_config.use_uvm"} <= fields
    assert result.args.kv_cache_config.max_tokens == 4096


def test_ignored_lists_never_shadow_a_kvload_field():
    from pipeline.config import KvCacheConfig, LlmArgs, public_fields

    assert not set(IGNORED_LLM_ARGS) & {a.name for a in public_fields(LlmArgs)}
    assert not set(IGNORED_KV_CACHE_CONFIG) & {a.name for a in public_fields(KvCacheConfig)}


# --- memory sizes: one convention ----------------------------------------------------------


@given(st.integers(min_value=0, max_value=4096), st.sampled_from(["", "K", "M", "G", "T"]))
def test_bare_and_iec_suffixes_are_binary_si_are_decimal(n, unit):
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit]
    if unit:
        binary = n * 1024**power
        assert parse_size(f"{n}{unit}") == parse_size(f"{n}{unit}iB") == parse_size(f"{n}{unit.lower()}") == binary
        assert parse_size(f"{n}{unit}B") == n * 1000**power
    else:
        assert parse_size(str(n)) == n


def test_8g_means_8_gib_on_the_command_line_and_in_yaml(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("kv_cache_config:\n  max_gpu_total_bytes: 8G\n")
    from_yaml = run_cli(capsys, "plan", "tiny-llama", "--config", cfg, "--json")
    from_cli = run_cli(capsys, "plan", "tiny-llama", "--max_gpu_total_bytes", "8G", "--json")
    for r in (from_yaml, from_cli):
        assert r.code == 0, r.err
        assert r.json()["args"]["kv_cache_config"]["max_gpu_total_bytes"] == 8 * 2**30


def test_the_size_convention_is_in_the_help(capsys):
    r = run_cli(capsys, "plan", "--help")
    assert "8GiB = 8G = 8*2**30" in " ".join(r.out.split())


# --- one verdict per value, whatever its source --------------------------------------------


def _verdicts(capsys, tmp_path, flag: str, key: str, value: str) -> list[tuple[int, str]]:
    """(exit status, message) for the value given on the CLI, in YAML, and through Python."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"{key}: {value}\n")
    cli = run_cli(capsys, "plan", "tiny-llama", flag, value, "--max_tokens", "8192")
    yml = run_cli(capsys, "plan", "tiny-llama", "--config", cfg, "--max_tokens", "8192")
    try:
        plan("tiny-llama", log=False, kv_cache_config={"max_tokens": 8192}, **{key: value})
        api = (0, "")
    except ConfigError as exc:
        api = (2, str(exc))
    return [(cli.code, cli.err), (yml.code, yml.err), api]


def test_cuda_index_device_is_accepted_from_every_source(capsys, tmp_path):
    verdicts = _verdicts(capsys, tmp_path, "--device", "device", "cuda:0")
    assert [code for code, _ in verdicts] == [0, 0, 0], verdicts


def test_unknown_device_is_refused_from_every_source_with_one_message(capsys, tmp_path):
    verdicts = _verdicts(capsys, tmp_path, "--device", "device", "tpu")
    assert [code for code, _ in verdicts] == [2, 2, 2]
    assert all('expected "auto", "cpu", "cuda" or "cuda:N"' in msg for _, msg in verdicts)


@pytest.mark.parametrize("value", ["cuda:256", "cuda:128", "cuda:01", "cuda:\u0663"])
def test_a_cuda_index_torch_would_wrap_or_refuse_is_refused_from_every_source(capsys, tmp_path, value):
    """torch keeps a device index in 8 bits: cuda:256 was cuda:0 (a run on another GPU than the one asked for) and
    cuda:128 cuda:-128; "cuda:01" and other scripts' digits planned, then failed in torch with a traceback."""
    verdicts = _verdicts(capsys, tmp_path, "--device", "device", value)
    assert [code for code, _ in verdicts] == [2, 2, 2], verdicts
    assert all(f'"cuda:N" (N from 0 to 127), got {value!r}' in msg for _, msg in verdicts), verdicts


def test_fp8_model_dtype_is_refused_from_every_source_before_generate(capsys, tmp_path):
    verdicts = _verdicts(capsys, tmp_path, "--dtype", "dtype", "fp8")
    assert [code for code, _ in verdicts] == [2, 2, 2]
    assert all("float8 is a KV cache dtype only" in msg for _, msg in verdicts)


def test_fp8_kv_cache_dtype_stays_valid(capsys):
    r = run_cli(capsys, "plan", "tiny-llama", "--kv_cache_dtype", "fp8", "--max_tokens", "8192", "--json")
    assert r.code == 0, r.err
    assert r.json()["args"]["kv_cache_config"]["dtype"] == "float8_e4m3fn"


# --- a budget that holds no whole sequence is a warning that says what to raise ------------


def test_a_budget_below_one_sequence_warns_and_says_what_to_raise(capsys, tmp_path):
    log = tmp_path / "a.jsonl"
    r = run_cli(capsys, "run", "tiny-llama", "--device", "cpu", "--max_tokens", "1024", "--audit-log", log)
    assert r.code == 0, r.err
    [short] = [e for e in read_events(log) if e["event"] == "kv_budget_short"]
    assert (short["capacity_tokens"], short["max_seq_len"]) == (1024, 8192)
    assert "raise kv_cache_config.max_tokens (--max_tokens) to at least 8192" in short["advice"]
    assert sum("kv_budget_short" in line for line in r.err.splitlines()) == 1


def test_a_budget_that_holds_a_sequence_does_not_warn(capsys):
    r = run_cli(capsys, "plan", "tiny-llama", "--max_tokens", "1024", "--max_seq_len", "1024")
    assert r.code == 0 and "kv_budget_short" not in r.err
