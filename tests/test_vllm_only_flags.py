"""vLLM's engine flags kvload has no counterpart for: each one is taken and reported ``setting_ignored`` saying why, or
refused in one line naming it as a vLLM engine flag kvload does not implement (with what kvload offers instead),
never argparse's "unrecognized arguments": on the ``kvload`` commands, in a vLLM script's parser
(``FlexibleArgumentParser`` with ``EngineArgs.add_cli_args``), through ``EngineArgs.from_cli_args`` and as
``kvload.LLM`` / ``kvload.plan`` keywords. One table decides: ``pipeline.vllm_compat.VLLM_ONLY``."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

import kvload
from kvload import EngineArgs, FlexibleArgumentParser
from kvload.cli.commands import build_parser
from pipeline.errors import ConfigError
from pipeline.vllm_compat import DIFFERENT_MEANING, VLLM_ONLY
from tests.cli_support import run_cli
from tests.llm_support import llm_kwargs

#: Every flag of vLLM's ``EngineArgs.add_cli_args`` (vllm-project/vllm ``vllm/engine/arg_utils.py`` at 99d7eb5d),
#: in its order, with its one-dash spellings
VLLM_ENGINE_FLAGS = (
    "--model", "--runner", "--convert", "--task", "--tokenizer", "--tokenizer-mode", "--trust-remote-code", "--dtype",
    "--seed", "--hf-config-path", "--allowed-local-media-path", "--allowed-media-domains", "--revision",
    "--code-revision", "--rope-scaling", "--rope-theta", "--tokenizer-revision", "--max-model-len", "--quantization",
    "--enforce-eager", "--max-logprobs", "--logprobs-mode", "--disable-sliding-window", "--disable-cascade-attn",
    "--skip-tokenizer-init", "--enable-prompt-embeds", "--served-model-name", "--config-format", "--hf-token",
    "--hf-overrides", "--pooler-config", "--override-pooler-config", "--logits-processor-pattern",
    "--generation-config", "--override-generation-config", "--enable-sleep-mode", "--model-impl",
    "--override-attention-dtype", "--logits-processors", "--io-processor-plugin", "--load-format", "--download-dir",
    "--safetensors-load-strategy", "--model-loader-extra-config", "--ignore-patterns", "--use-tqdm-on-load",
    "--pt-load-map-location", "--reasoning-parser", "--guided-decoding-backend", "--guided-decoding-disable-fallback",
    "--guided-decoding-disable-any-whitespace", "--guided-decoding-disable-additional-properties",
    "--distributed-executor-backend", "--pipeline-parallel-size", "--tensor-parallel-size",
    "--decode-context-parallel-size", "--data-parallel-size", "--data-parallel-rank", "--data-parallel-start-rank",
    "--data-parallel-size-local", "--data-parallel-address", "--data-parallel-rpc-port", "--data-parallel-backend",
    "--data-parallel-hybrid-lb", "--enable-expert-parallel", "--all2all-backend", "--enable-dbo",
    "--dbo-decode-token-threshold", "--dbo-prefill-token-threshold", "--disable-nccl-for-dp-synchronization",
    "--enable-eplb", "--eplb-config", "--expert-placement-strategy", "--num-redundant-experts", "--eplb-window-size",
    "--eplb-step-interval", "--eplb-log-balancedness", "--max-parallel-loading-workers", "--ray-workers-use-nsight",
    "--disable-custom-all-reduce", "--worker-cls", "--worker-extension-cls",
    "--enable-multimodal-encoder-data-parallel", "--block-size", "--gpu-memory-utilization",
    "--kv-cache-memory-bytes", "--swap-space", "--kv-cache-dtype", "--num-gpu-blocks-override",
    "--enable-prefix-caching", "--prefix-caching-hash-algo", "--cpu-offload-gb", "--calculate-kv-scales",
    "--kv-sharing-fast-prefill", "--mamba-cache-dtype", "--mamba-ssm-cache-dtype", "--mamba-block-size",
    "--limit-mm-per-prompt", "--enable-mm-embeds", "--media-io-kwargs", "--mm-processor-kwargs",
    "--mm-processor-cache-gb", "--disable-mm-preprocessor-cache", "--mm-processor-cache-type",
    "--mm-shm-cache-max-object-size-mb", "--mm-encoder-tp-mode", "--mm-encoder-attn-backend",
    "--interleave-mm-strings", "--skip-mm-profiling", "--video-pruning-rate", "--enable-lora", "--max-loras",
    "--max-lora-rank", "--lora-extra-vocab-size", "--lora-dtype", "--max-cpu-loras", "--fully-sharded-loras",
    "--default-mm-loras", "--show-hidden-metrics-for-version", "--otlp-traces-endpoint", "--collect-detailed-traces",
    "--max-num-batched-tokens", "--max-num-seqs", "--max-num-partial-prefills", "--max-long-partial-prefills",
    "--long-prefill-token-threshold", "--num-lookahead-slots", "--scheduling-policy", "--enable-chunked-prefill",
    "--disable-chunked-mm-input", "--scheduler-cls", "--disable-hybrid-kv-cache-manager", "--async-scheduling",
    "--cudagraph-capture-sizes", "--cuda-graph-sizes", "--max-cudagraph-capture-size", "--speculative-config",
    "--kv-transfer-config", "--kv-events-config", "--compilation-config", "--additional-config",
    "--structured-outputs-config", "--disable-log-stats", "--aggregate-engine-logging",
)
#: vLLM's one-dash spellings: those of 99d7eb5d, and the newer ones of vLLM's main (``-pcp``, ``-dph``, ``-dpe``,
#: ``-dpm``, ``-ep``, ``-n``, ``-r``, ``-cc``, ``-ac``, ``-sc``), each with its long flag
VLLM_SHORT_FLAGS = ('-O', '-dcp', '-dp', '-dpa', '-dpb', '-dpl', '-dpn', '-dpp', '-dpr', '-pp', '-q', '-tp',
                    '-pcp', '-dph', '-dpe', '-dpm', '-ep', '-n', '-r', '-cc', '-ac', '-sc')
#: flags of vLLM's main newer than 99d7eb5d whose one-dash spelling is above
NEWER_VLLM_FLAGS = ("--prefill-context-parallel-size", "--data-parallel-multi-port-external-lb",
                    "--attention-config", "--data-parallel-external-lb")
#: the flags vLLM declares ``BooleanOptionalAction`` (a ``--no-`` form too)
VLLM_SWITCHES = frozenset({
    '--trust-remote-code',
    '--enforce-eager',
    '--disable-sliding-window',
    '--disable-cascade-attn',
    '--skip-tokenizer-init',
    '--enable-prompt-embeds',
    '--enable-sleep-mode',
    '--use-tqdm-on-load',
    '--data-parallel-hybrid-lb',
    '--enable-expert-parallel',
    '--enable-dbo',
    '--disable-nccl-for-dp-synchronization',
    '--enable-eplb',
    '--eplb-log-balancedness',
    '--ray-workers-use-nsight',
    '--disable-custom-all-reduce',
    '--enable-prefix-caching',
    '--calculate-kv-scales',
    '--kv-sharing-fast-prefill',
    '--enable-mm-embeds',
    '--interleave-mm-strings',
    '--skip-mm-profiling',
    '--enable-lora',
    '--fully-sharded-loras',
    '--enable-chunked-prefill',
    '--disable-chunked-mm-input',
    '--disable-hybrid-kv-cache-manager',
    '--async-scheduling',
})

#: ``kvload serve``'s own flags (sampling seed, served names, KV events): ``run``/``plan`` do not take them
#: (``--reasoning-parser`` they take, reported unused: tests/test_reasoning_parser_names.py)
SERVE_ONLY = frozenset({"--seed", "--served-model-name", "--guided-decoding-backend", "--kv-events-config"})
#: vLLM's flags whose meaning differs from kvload's nearest one: the commands refuse them in one line of their own
DIFFERENT = frozenset("--" + name.replace("_", "-") for name in DIFFERENT_MEANING)


def _commands() -> dict[str, argparse.ArgumentParser]:
    top = build_parser()
    subs = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices
    return {name: subs[name] for name in ("plan", "run", "generate", "serve", "simulate")}


def _script_parser() -> argparse.ArgumentParser:
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    return parser


@pytest.mark.parametrize("command", ["plan", "run", "generate", "serve", "simulate"])
def test_every_vllm_engine_flag_is_known_to_each_command(command):
    """Before: 84 of vLLM's 144 engine flags (``--enable-eplb``, ``-dcp``, ``--worker-cls``, ...) were argparse's
    "unrecognized arguments" on ``kvload run``."""
    options = _commands()[command]._option_string_actions
    skip = DIFFERENT | (set() if command == "serve" else SERVE_ONLY)
    missing = [f for f in (*VLLM_ENGINE_FLAGS, *NEWER_VLLM_FLAGS, *VLLM_SHORT_FLAGS)
               if f not in options and f not in skip]
    assert not missing
    missing_no = [f for f in VLLM_SWITCHES if "--no-" + f[2:] not in options]
    assert not missing_no


def test_every_vllm_engine_flag_is_known_to_a_vllm_scripts_parser():
    options = _script_parser()._option_string_actions
    missing = [f for f in (*VLLM_ENGINE_FLAGS, *NEWER_VLLM_FLAGS, *VLLM_SHORT_FLAGS,
                           *("--no-" + f[2:] for f in VLLM_SWITCHES))
               if f not in options]
    assert not missing


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _given(key: str) -> list[str]:
    """The flag of ``key`` given a value that is not vLLM's default (a switch turned on)."""
    row = VLLM_ONLY[key]
    if row.shape in ("switch", "store_true"):
        return [_flag(key)]
    return [_flag(key), "7", "8"] if row.shape == "values" else [_flag(key), "7"]


FLAGGED = sorted(key for key, row in VLLM_ONLY.items() if row.shape is not None)
REFUSED = [key for key in FLAGGED if VLLM_ONLY[key].policy == "refuse"]
IGNORED = [key for key in FLAGGED if VLLM_ONLY[key].policy == "ignore"]


@pytest.mark.parametrize("key", REFUSED)
def test_a_vllm_flag_kvload_does_not_implement_is_one_line_naming_it(capsys, key):
    r = run_cli(capsys, "plan", "tiny-llama", *_given(key))
    line = f"error: {_flag(key)}: a vLLM engine flag kvload does not implement: {VLLM_ONLY[key].why}"
    assert r.code == 2 and r.err.strip() == line, r.err


@pytest.mark.parametrize("key", IGNORED)
def test_a_vllm_flag_that_only_concerns_vllm_is_taken_and_said_ignored(capsys, key):
    r = run_cli(capsys, "plan", "tiny-llama", *_given(key))
    assert r.code == 0, r.err
    warned = [line for line in r.err.splitlines() if "setting_ignored" in line and f"field={key} " in line]
    assert len(warned) == 1 and VLLM_ONLY[key].why[:40] in warned[0], r.err


def test_a_refused_switch_at_vllms_default_is_taken_and_said_ignored(capsys):
    """``--no-enable-eplb`` (a launch line spelling vLLM's defaults out) asks for nothing: taken, said ignored."""
    r = run_cli(capsys, "plan", "tiny-llama", "--no-enable-eplb", "-dcp", "1", "--data-parallel-backend", "mp")
    assert r.code == 0, r.err
    for key in ("enable_eplb", "decode_context_parallel_size", "data_parallel_backend"):
        assert any("setting_ignored" in line and f"field={key} " in line for line in r.err.splitlines()), key


#: vLLM's own defaults of refused arguments (``ParallelConfig``, ``EPLBConfig``, ``LoadConfig``, ``EngineArgs``): a
#: launch line or script spelling them out asks for nothing, so it is taken and said ignored (they were refused)
VLLM_DEFAULTS = [("master_addr", "127.0.0.1"), ("master_port", 29501), ("nnodes", 1), ("node_rank", 0),
                 ("worker_cls", "auto"), ("worker_extension_cls", ""), ("eplb_window_size", 1000),
                 ("eplb_step_interval", 3000), ("num_redundant_experts", 0), ("kv_offloading_backend", "native"),
                 ("ignore_patterns", ["original/**/*"])]


@pytest.mark.parametrize(("key", "value"), VLLM_DEFAULTS)
def test_a_refused_argument_at_vllms_default_is_taken_and_said_ignored(capsys, key, value):
    said = [e["reason"] for e in kvload.plan("tiny-llama", log=False, **{key: value}).audit.events
            if e["event"] == "setting_ignored" and e["field"] == key]
    assert len(said) == 1 and "vLLM's default" in said[0]
    flag = [_flag(key), *(value if isinstance(value, list) else [str(value)])]
    r = run_cli(capsys, "plan", "tiny-llama", *flag)
    assert r.code == 0, r.err
    assert any("setting_ignored" in line and f"field={key} " in line for line in r.err.splitlines()), r.err


def test_a_one_dash_spelling_is_named_as_typed(capsys):
    r = run_cli(capsys, "run", "tiny-llama", "-dpn", "1")
    assert r.code == 2 and r.err.startswith("error: -dpn: a vLLM engine flag kvload does not implement: data "
                                            "parallelism"), r.err


def test_kvload_serve_refuses_one_before_serving(capsys):
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", "--enable-eplb")
    assert r.code == 2, r.err
    assert r.err.strip().splitlines()[-1].startswith("error: --enable-eplb: a vLLM engine flag kvload does not "
                                                     "implement: MoE expert load balancing"), r.err


@pytest.mark.parametrize("key", REFUSED)
def test_a_vllm_script_gets_a_value_error_naming_the_argument(key):
    """``LLM(**vars(parser.parse_args()))`` (vLLM's examples): the parser takes the flag, ``kvload`` refuses the
    keyword in one line (a ``ConfigError``, which is a ``ValueError``)."""
    ns = _script_parser().parse_args(["--model", "tiny-llama", *_given(key)])
    engine_args = EngineArgs.from_cli_args(ns)
    assert key in dataclasses.asdict(engine_args)
    with pytest.raises(ValueError) as err:
        kvload.plan(log=False, **dataclasses.asdict(engine_args))
    assert isinstance(err.value, ConfigError)
    assert str(err.value) == f"{key}: a vLLM engine argument kvload does not implement: {VLLM_ONLY[key].why}"


def test_from_cli_args_keeps_a_vllm_argument_kvload_ignores_and_llm_says_so(log):
    """Before: ``from_cli_args`` dropped ``all2all_backend`` (no such field), so the setting vanished silently."""
    ns = argparse.Namespace(model="tiny-llama", all2all_backend="pplx", use_tqdm_on_load=True, max_tokens=5)
    given = dataclasses.asdict(EngineArgs.from_cli_args(ns))
    assert given == {"model": "tiny-llama", "all2all_backend": "pplx", "use_tqdm_on_load": True}
    llm = kvload.LLM(**given, **{k: v for k, v in llm_kwargs().items() if k != "log"})
    llm.close()
    for key, value in (("all2all_backend", "pplx"), ("use_tqdm_on_load", True)):
        assert log.has("setting_ignored", field=key, value=value), key


def test_llm_keyword_refused_at_its_default_is_said_ignored(log):
    kvload.plan("tiny-llama", enable_eplb=False, data_parallel_rank=None)
    assert log.has("setting_ignored", field="enable_eplb", value=False)
