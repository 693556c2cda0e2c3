"""The configuration flags: their table, how a parser takes them, what the given ones set (overrides, LoadRequest)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import attrs

from kvload.cli.values import (
    field_integer,
    integer,
    json_object,
    json_object_like,
    json_or_text,
    number,
    size,
    token_count,
    token_count_or_auto,
    tri_state,
)
from pipeline.config import ATTENTION_BACKENDS, LINEAR_BACKENDS
from pipeline.paths import set_in
from pipeline.vllm_compat import VLLM_ONLY


@attrs.frozen
class Flag:
    """One plan/run flag: its TensorRT-LLM spelling, the dotted field it sets, and how to parse it."""

    name: str
    path: str
    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    const: Any = None  # for switches: the value the flag sets when present
    metavar: str | None = None
    # other spellings users bring (trtllm-serve, trtllm-bench, vLLM's where the meaning is the same: each also dashed)
    aliases: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        """argparse destination, distinct from every other option's."""
        return "field__" + self.path.replace(".", "__")


FLAGS: tuple[Flag, ...] = (
    Flag("--use_kv_cache_manager_v2", "kv_cache_config.use_kv_cache_manager_v2",
         "KV cache manager V2: auto (let the model decide), true or false; absent = unset", tri_state,
         metavar="{auto,true,false}"),
    Flag("--kv_cache_free_gpu_memory_fraction", "kv_cache_config.free_gpu_memory_fraction",
         "fraction of free device memory for the KV cache, in (0, 1]", number, metavar="F",
         aliases=("--kv_cache_fraction", "--kv_cache_free_gpu_mem_fraction", "--free_gpu_memory_fraction")),
    Flag("--max_tokens", "kv_cache_config.max_tokens", "cap the KV cache at this many tokens", field_integer,
         metavar="N"),
    Flag("--max_gpu_total_bytes", "kv_cache_config.max_gpu_total_bytes",
         "cap the KV cache at this many bytes (0 = no cap; 8GiB = 8G = 8*2**30, 8GB = 8*10**9)", size,
         metavar="BYTES"),
    Flag("--tokens_per_block", "kv_cache_config.tokens_per_block", "tokens per KV block", field_integer, metavar="N",
         aliases=("--block_size",)),
    Flag("--disable_kv_cache_reuse", "kv_cache_config.enable_block_reuse",
         "turn prefix (block) reuse off", const=False, aliases=("--no_enable_prefix_caching",)),
    # vLLM's switch on: the default already, so it only overrides a --config file's enable_block_reuse: false
    Flag("--enable_prefix_caching", "kv_cache_config.enable_block_reuse",
         "turn prefix (block) reuse on (the default; vLLM's spelling)", const=True),
    Flag("--host_cache_size", "kv_cache_config.host_cache_size",
         "V2 host tier size in bytes (0 = none; absent = auto: sized, or none where the accelerator recomputes a token "
         "for less than its copy out and back)", size, metavar="BYTES"),
    Flag("--pool_arena", "kv_cache_config.pool_arena",
         "V2 groups of unequal pages (DeepSeek V4): one slab arena they take memory from as they need it (true), "
         "pools split once (false), or auto (the arena when the budget holds a max_seq_len sequence in slabs; "
         "on CUDA, whose budget comes from free memory, the split)", tri_state, metavar="{auto,true,false}"),
    Flag("--max_page_padding", "kv_cache_config.max_page_padding",
         "V2 shared arena (Gemma 2/3, GPT-OSS): the most of a sequence's page bytes, in [0, 0.5), that pages of more "
         "than gcd(layer counts) layers may leave unused for fewer layer groups (less CPU a step, fewer sequences at "
         "tight budgets); 0 = gcd, no padding (default)", number, metavar="F"),
    Flag("--event_buffer_max_size", "kv_cache_config.event_buffer_max_size",
         "KV cache events (block stored/removed/cleared) kept for readers; 0 = off (default)", field_integer,
         metavar="N"),
    Flag("--kv_cache_dtype", "kv_cache_config.dtype", "KV cache dtype: auto or a dtype name", str, metavar="DTYPE"),
    Flag("--dtype", "dtype", "model dtype: auto, float32, float16, bfloat16", str, metavar="DTYPE"),
    Flag("--device", "device", "where to build: auto (cuda when available), cuda, cuda:N or cpu", str,
         metavar="{auto,cuda,cuda:N,cpu}"),
    Flag("--max_batch_size", "max_batch_size", "most requests scheduled at once", field_integer, metavar="N",
         aliases=("--max_num_seqs",)),
    Flag("--max_seq_len", "max_seq_len", "longest sequence (default: the checkpoint's; 32k = 32,000 and 32K = 32,768, "
         "as vLLM reads them; auto or -1: the longest one sequence the KV cache holds, at most the checkpoint's, "
         "vLLM's max_model_len -1)", token_count_or_auto, metavar="N", aliases=("--max_model_len",)),
    Flag("--max_num_tokens", "max_num_tokens", "most tokens in one forward (prefill chunk; 8k, 8K as vLLM reads them)",
         token_count, metavar="N", aliases=("--max_num_batched_tokens",)),
    Flag("--max_beam_width", "max_beam_width", "beam width (V2 serves only 1)", field_integer, metavar="N"),
    Flag("--scheduling_policy", "scheduling_policy", "fcfs (default: arrival order) or priority (vLLM's: a request's "
         "priority, lower first, orders admission; V2 also moves out lower-ranked running requests for it)", str,
         metavar="{fcfs,priority}"),
    Flag("--attention_backend", "attention_backend", "paged attention of generate: auto, flex (compiled "
         "FlexAttention over the pools), sdpa (gather + SDPA), triton (decode steps on a paged decode kernel, "
         "CUDA) or cpu_kernel (decode steps on a paged decode kernel compiled for this CPU)", str,
         choices=ATTENTION_BACKENDS),
    Flag("--linear_backend", "linear_backend", "projections of generate: auto, torch (F.linear) or cpu_kernel "
         "(steps of few rows on a matmul kernel compiled for this CPU; float32)", str, choices=LINEAR_BACKENDS),
    Flag("--max_draft_len", "max_draft_len", "speculative decoding by n-gram lookup: draft tokens copied from "
         "earlier in the sequence, verified in the step that computes the last token (greedy or sampled); 0 = off "
         "(default)", field_integer, metavar="N"),
    Flag("--max_matching_ngram_size", "max_matching_ngram_size", "with --max_draft_len: the longest suffix "
         "looked up among earlier tokens (default 2)", field_integer, metavar="N"),
    Flag("--speculation_max_batch_size", "speculation_max_batch_size", "with --max_draft_len: draft only while at "
         "most this many requests run (default 1; more rows per step cost more than drafts save on a CPU)",
         field_integer, metavar="N"),
    Flag("--generation_config", "generation_config", "sampling defaults of what the command generates, for each "
         "setting a request leaves unset: auto (the checkpoint's generation_config.json; default), vllm (ignore it: "
         "kvload's built-in defaults) or a directory holding a generation_config.json (vLLM's flag)", str,
         metavar="{auto,vllm,DIR}"),
    Flag("--override_generation_config", "override_generation_config", "generation_config.json keys laid over the "
         "model's sampling defaults, as a JSON object: temperature, top_p, top_k, min_p, repetition_penalty, "
         "max_new_tokens, do_sample (vLLM's flag), e.g. '{\"temperature\": 0.5}'",
         json_object_like('{"temperature": 0.5}'), metavar="JSON"),
    Flag("--tp_size", "tensor_parallel_size",
         "tensor-parallel ranks: run, generate and serve start that many processes (or launch them with "
         "torchrun); plan alone shows rank 0's view", field_integer,
         metavar="N", aliases=("--tensor_parallel_size", "-tp")),
)
def compilation_config(text: str) -> dict[str, Any]:
    """vLLM's ``-O``/``--compilation-config``: a JSON object, or a level (``-O3``: ``{"level": 3}``)."""
    return {"level": int(text)} if text.isdigit() else json_object(text)


#: vLLM's engine flags kvload has no counterpart for (a launch script copied from ``vllm serve``): each goes into the
#: command line's tree under vLLM's key, where ``pipeline.trtllm_compat.split_ignored`` reports it as
#: ``setting_ignored`` with the reason (``pipeline.vllm_compat``), or refuses a value kvload cannot honour
#: (``--quantization awq``, ``--trust-remote-code``); ``--hf-overrides`` acts (``stages.parse_args`` takes it out of the
#: tree first, ``models.hf_overrides`` applies it). (flag, key, type, metavar; a None type is a switch.)
VLLM_KNOB_FLAGS: tuple[tuple[str, str, Callable[[str], Any] | None, str | None], ...] = (
    ("--enforce-eager", "enforce_eager", None, None),
    ("--max-seq-len-to-capture", "max_seq_len_to_capture", integer, "N"),
    ("--compilation-config", "compilation_config", compilation_config, "JSON"),
    ("--disable-log-stats", "disable_log_stats", None, None),
    ("--async-scheduling", "async_scheduling", None, None),
    ("--enable-sleep-mode", "enable_sleep_mode", None, None),
    ("--disable-custom-all-reduce", "disable_custom_all_reduce", None, None),
    ("--distributed-executor-backend", "distributed_executor_backend", str, "NAME"),
    ("--max-logprobs", "max_logprobs", integer, "N"),
    ("--download-dir", "download_dir", str, "DIR"),
    ("--enable-chunked-prefill", "enable_chunked_prefill", None, None),
    ("--quantization", "quantization", str, "METHOD"),
    ("--cpu-offload-gb", "cpu_offload_gb", number, "GIB"),
    ("--hf-overrides", "hf_overrides", json_object, "JSON"),
    ("--trust-remote-code", "trust_remote_code", None, None),
    ("--disable-async-output-proc", "disable_async_output_proc", None, None),
    ("--skip-tokenizer-init", "skip_tokenizer_init", None, None),
    ("--tokenizer", "tokenizer", str, "NAME"),
    ("--tokenizer-mode", "tokenizer_mode", str, "MODE"),
    ("--revision", "revision", str, "REV"),
    ("--load-format", "load_format", str, "FORMAT"),
    ("--hf-token", "hf_token", str, "TOKEN"),
    ("--max-lora-rank", "max_lora_rank", integer, "N"),
    ("--max-loras", "max_loras", integer, "N"),
    ("--max-cpu-loras", "max_cpu_loras", integer, "N"),
    ("--enable-lora", "enable_lora", None, None),
    ("--fully-sharded-loras", "fully_sharded_loras", None, None),
    ("--lora-dtype", "lora_dtype", str, "DTYPE"),
    ("--cuda-graph-sizes", "cuda_graph_sizes", integer, "N"),
    ("--max-cudagraph-capture-size", "max_cudagraph_capture_size", integer, "N"),
    ("--disable-cascade-attn", "disable_cascade_attn", None, None),
    ("--otlp-traces-endpoint", "otlp_traces_endpoint", str, "URL"),
    ("--collect-detailed-traces", "collect_detailed_traces", str, "MODULES"),
    ("--show-hidden-metrics-for-version", "show_hidden_metrics_for_version", str, "VERSION"),
    ("--enable-mfu-metrics", "enable_mfu_metrics", None, None),
    ("--long-prefill-token-threshold", "long_prefill_token_threshold", integer, "N"),
    ("--max-num-partial-prefills", "max_num_partial_prefills", integer, "N"),
    ("--max-long-partial-prefills", "max_long_partial_prefills", integer, "N"),
    ("--tokenizer-pool-size", "tokenizer_pool_size", integer, "N"),
    ("--model-impl", "model_impl", str, "IMPL"),
    # a decoder model as vLLM's embedding model (--runner pooling): kvload serve answers /v1/embeddings either way
    ("--runner", "runner", str, "RUNNER"),
    ("--task", "task", str, "TASK"),
    ("--convert", "convert", str, "TYPE"),
    ("--rope-scaling", "rope_scaling", json_object, "JSON"),
    ("--rope-theta", "rope_theta", number, "THETA"),
    ("--kv-transfer-config", "kv_transfer_config", json_object, "JSON"),
    # refused (pipeline.vllm_compat.REFUSED): it loads adapters, which kvload does not serve
    ("--lora-modules", "lora_modules", str, "NAME=PATH"),
    ("--limit-mm-per-prompt", "limit_mm_per_prompt", json_object, "JSON"),
    ("--mm-processor-kwargs", "mm_processor_kwargs", json_object, "JSON"),
    ("--enable-expert-parallel", "enable_expert_parallel", None, None),
    ("--data-parallel-size", "data_parallel_size", integer, "N"),
    ("--pipeline-parallel-size", "pipeline_parallel_size", integer, "N"),
    ("--logprobs-mode", "logprobs_mode", str, "MODE"),
    ("--use-v2-block-manager", "use_v2_block_manager", None, None),
    ("--num-scheduler-steps", "num_scheduler_steps", integer, "N"),
    ("--max-parallel-loading-workers", "max_parallel_loading_workers", integer, "N"),
    ("--preemption-mode", "preemption_mode", str, "MODE"),
    # acts: its n-gram method is kvload's drafts (pipeline.vllm_compat.speculative_config); other methods refused
    ("--speculative-config", "speculative_config",
     json_object_like('{"method": "ngram", "num_speculative_tokens": 4}'), "JSON"),
    # vLLM's engine flags kvload does not implement (pipeline.vllm_compat.VLLM_ONLY: each ignored or refused, a value
    # read as vLLM's parser reads a dotted one)
    *(("--" + key.replace("_", "-"), key, None if row.shape in ("switch", "store_true") else json_or_text,
       None if row.shape in ("switch", "store_true") else "VALUE")
      for key, row in VLLM_ONLY.items() if row.shape is not None),
)
#: vLLM's one-dash spellings of some of them (``vllm/engine/arg_utils.py``; ``-O`` is its parser's for a compilation
#: level, ``-O3``); each acts as its long flag does. kvload's own field of the same meaning has vLLM's as an alias
#: (``-tp``, :data:`FLAGS`)
VLLM_KNOB_SHORT: dict[str, tuple[str, ...]] = {
    "--compilation-config": ("-O", "-cc"), "--data-parallel-size": ("-dp",), "--pipeline-parallel-size": ("-pp",),
    "--quantization": ("-q",), "--enable-expert-parallel": ("-ep",), "--speculative-config": ("-sc",),
    **{"--" + key.replace("_", "-"): row.short for key, row in VLLM_ONLY.items() if row.short}}

#: the switches of ``VLLM_KNOB_FLAGS`` vLLM declares ``store_true`` (no ``--no-`` form there either;
#: ``--enable-expert-parallel`` was one before vLLM made it a config boolean, ``--X/--no-X``)
VLLM_STORE_TRUE_FLAGS = frozenset({
    "--disable-log-stats", "--use-v2-block-manager",
    *("--" + k.replace("_", "-") for k, r in VLLM_ONLY.items() if r.shape == "store_true")})
#: the ``VLLM_KNOB_FLAGS`` vLLM takes one or more values of (``--lora-modules a=/x b=/y``): all of them, so the flag's
#: own line answers, not "unrecognized arguments: b=/y"
VLLM_LIST_FLAGS = frozenset({"--lora-modules", "--cuda-graph-sizes",
                             *("--" + k.replace("_", "-") for k, r in VLLM_ONLY.items() if r.shape == "values")})


#: trtllm-serve's flags (``tensorrt_llm/commands/serve.py``) for ``LlmArgs`` keys kvload does not act on, and its
#: disaggregated-serving flags: each goes into the command line's tree under the key, where
#: ``pipeline.trtllm_compat.split_ignored`` reports it ``setting_ignored`` with the reason an options file's key gets,
#: or refuses it (``--pp_size 2``, ``--server_role``). (spellings, key, type, metavar; a None type is a switch.) Those
#: it shares with vLLM are :data:`VLLM_KNOB_FLAGS` (``--tokenizer``, ``--revision``, ``--enable_chunked_prefill``).
TRTLLM_SERVE_FLAGS: tuple[tuple[tuple[str, ...], str, Callable[[str], Any] | None, str | None], ...] = (
    (("--backend",), "backend", str, "{pytorch,tensorrt,_autodeploy}"),
    (("--pp_size",), "pipeline_parallel_size", integer, "N"),
    (("--moe_expert_parallel_size", "--ep_size"), "moe_expert_parallel_size", integer, "N"),
    (("--context_parallel_size", "--cp_size"), "context_parallel_size", integer, "N"),
    (("--moe_cluster_parallel_size", "--cluster_size"), "moe_cluster_parallel_size", integer, "N"),
    (("--gpus_per_node",), "gpus_per_node", integer, "N"),
    (("--num_postprocess_workers",), "num_postprocess_workers", integer, "N"),
    (("--custom_tokenizer",), "custom_tokenizer", str, "NAME"),
    (("--custom_module_dirs",), "custom_module_dirs", str, "DIR"),
    (("--fail_fast_on_attention_window_too_large",), "fail_fast_on_attention_window_too_large", None, None),
    (("--server_role",), "server_role", str, "ROLE"),
    (("--metadata_server_config_file",), "metadata_server_config_file", str, "FILE"),
    (("--disagg_cluster_uri",), "disagg_cluster_uri", str, "URI"),
    (("--grpc",), "grpc", None, None),
)


def _knob_dest(key: str) -> str:
    return "vllm_knob__" + key


FLAG_FOR_PATH: dict[str, str] = {}
for _f in FLAGS:  # the first flag of a field (--disable_kv_cache_reuse, not its --enable_prefix_caching)
    FLAG_FOR_PATH.setdefault(_f.path, _f.name)


def _dashed(name: str) -> str:
    """``--max_tokens`` → ``--max-tokens``; a one-dash name (vLLM's ``-tp``) as it is."""
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def _underscored(name: str) -> str:
    """``--max-tokens`` → ``--max_tokens``: a dashed flag's other spelling (:func:`_dashed`'s inverse)."""
    return "--" + name[2:].replace("-", "_")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """MODEL, the config flags (with dashed aliases), and the output/logging options."""
    model = p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                           help="a preset or packaged model (see `kvload models`), a checkpoint directory, a .gguf "
                                "file, or a Hugging Face id in the local cache (--model MODEL too, vLLM's spelling)")
    # MODEL may come as vLLM's --model (`python -m vllm.entrypoints.openai.api_server --model X` launch lines):
    # optional to argparse, required by take_model_option (the usage line still says MODEL, not [MODEL])
    model.shown_required = True  # type: ignore[attr-defined]
    p.add_argument("--model", dest="model_option", metavar="MODEL", default=None, help=argparse.SUPPRESS)
    p.finish = take_model_option  # type: ignore[attr-defined]
    group = p.add_argument_group("configuration (TensorRT-LLM spelling; dashed and vLLM aliases accepted)")
    for f in FLAGS:
        names = list(dict.fromkeys(n for name in (f.name, *f.aliases) for n in (name, _dashed(name))))
        if f.const is not None:
            group.add_argument(*names, dest=f.dest, action="store_const", const=f.const, default=None, help=f.help)
        else:
            group.add_argument(*names, dest=f.dest, type=f.type, choices=f.choices, metavar=f.metavar,
                               default=None, help=f.help)
    knobs = p.add_argument_group("vLLM engine options kvload does not act on (each accepted with a setting_ignored "
                                 "warning saying why, or refused where its value would change the model)")
    for name, key, kind, metavar in VLLM_KNOB_FLAGS:
        names = (name, _underscored(name), *VLLM_KNOB_SHORT.get(name, ()))
        if kind is None:
            knobs.add_argument(*names, dest=_knob_dest(key), action="store_const", const=True, default=None,
                               help=argparse.SUPPRESS)
            if name not in VLLM_STORE_TRUE_FLAGS:  # vLLM's config booleans are --X/--no-X (BooleanOptionalAction)
                knobs.add_argument("--no-" + name[2:], "--no_" + key, dest=_knob_dest(key), action="store_const",
                                   const=False, default=None, help=argparse.SUPPRESS)
        else:
            knobs.add_argument(*names, dest=_knob_dest(key), type=kind, metavar=metavar, default=None,
                               nargs="+" if name in VLLM_LIST_FLAGS else None, help=argparse.SUPPRESS)
    trt = p.add_argument_group("trtllm-serve options kvload does not act on (each accepted with a setting_ignored "
                                "warning saying why, or refused where kvload cannot do what it asks)")
    for spellings, key, kind, metavar in TRTLLM_SERVE_FLAGS:
        names = list(dict.fromkeys(n for name in spellings for n in (name, _dashed(name))))
        if kind is None:
            trt.add_argument(*names, dest=_knob_dest(key), action="store_const", const=True, default=None,
                             help=argparse.SUPPRESS)
        else:
            trt.add_argument(*names, dest=_knob_dest(key), type=kind, metavar=metavar, default=None,
                             action="append" if key == "custom_module_dirs" else None, help=argparse.SUPPRESS)
    group.add_argument("--config", "--extra_llm_api_options", "--extra-llm-api-options", dest="config",
                       metavar="FILE.yaml", help="YAML file of LlmArgs fields (CLI flags win); TensorRT-LLM options "
                                                 "kvload does not act on are accepted with a warning each")
    out = p.add_argument_group("output")
    out.add_argument("--audit-log", "--audit_log", dest="audit_log", metavar="FILE.jsonl",
                     help="write every event as JSON Lines, hash-chained (HMAC with KVLOAD_AUDIT_KEY when set); "
                          "written only when the command succeeds")
    out.add_argument("--force", action="store_true",
                     help="replace an --audit-log (or plan --chart) file that already exists (without it, an "
                          "existing file is refused)")
    out.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    add_log_flags(out)


def add_unused_reasoning_parser(p: argparse.ArgumentParser) -> None:
    """``--reasoning-parser NAME`` (vLLM's engine flag) on a command that runs no requests (plan, run, simulate): a
    name kvload has is reported unused (``setting_ignored``, as a ``--config`` file's is), another is refused in
    generate's and serve's one line."""
    from kvload.cli.structured_flags import reasoning_parser_name

    p.add_argument("--reasoning-parser", "--reasoning_parser", dest=_knob_dest("reasoning_parser"), default=None,
                   metavar="NAME", type=reasoning_parser_name, help=argparse.SUPPRESS)


def take_model_option(parser: argparse.ArgumentParser, ns: argparse.Namespace, *, required: bool = True) -> None:
    """MODEL from vLLM's ``--model`` when it was given that way; the same model both ways is taken, two different
    ones are one usage error, and none at all (``required``) argparse's own."""
    option = getattr(ns, "model_option", None)
    if option is not None:
        if ns.model is not None and ns.model != option:
            parser.error(f"--model {option}: MODEL is {ns.model} already; give the model once (MODEL or --model)")
        ns.model = option
    if ns.model is None and required:
        parser.error("the following arguments are required: MODEL")


def _log_level(text: str) -> str:
    """``--log-level``'s value as kvload's level (:func:`pipeline.logs.log_level_named`: trtllm-serve's verbose is
    debug). Imported when a value is parsed: structlog must not load before main's stop handling is armed."""
    from pipeline.logs import log_level_named

    return log_level_named(text)


def add_log_flags(p: Any) -> None:
    """``--log-format``, ``--log-level`` and ``--debug``."""
    p.add_argument("--log-format", "--log_format", dest="log_format", choices=("console", "json"), default=None,
                   help="how events are logged on stderr (default: $KVLOAD_LOG_FORMAT, else console)")
    p.add_argument("--log-level", "--log_level", dest="log_level", choices=("debug", "info", "warning", "error"),
                   type=_log_level, default=None,
                   help="least severe event logged on stderr (default: $KVLOAD_LOG_LEVEL, else warning; "
                        "trtllm-serve's verbose and trace are debug, internal_error and critical error)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def cli_overrides(ns: argparse.Namespace) -> dict[str, Any]:
    """The flags the user gave, as a nested dict of fields (absent flags are absent, not defaults)."""
    tree: dict[str, Any] = {}
    for f in FLAGS:
        value = getattr(ns, f.dest, None)
        if value is None:
            continue
        set_in(tree, f.path, value)
    for key in dict.fromkeys((*(key for _, key, _, _ in VLLM_KNOB_FLAGS), *(key for _, key, _, _ in TRTLLM_SERVE_FLAGS),
                              "reasoning_parser")):
        value = getattr(ns, _knob_dest(key), None)
        if value is not None:
            tree[key] = value
    return tree


def flag_aliases() -> dict[str, str]:
    """Each flag's name, with and without dashes, in either spelling → the field it sets."""
    out: dict[str, str] = {}
    for f in FLAGS:
        for name in (f.name, _dashed(f.name), *f.aliases, *map(_dashed, f.aliases)):
            out[name] = out[name.lstrip("-")] = f.path
    return out


def _request(ns: argparse.Namespace, load_weights: bool = False, kv_events_reader: bool = True,
             generates: bool = False) -> Any:
    """The command's LoadRequest; ``kv_events_reader=False`` where the command reads no KV cache events,
    ``generates=True`` where it generates through what it loads: ``generate`` and ``serve``, which act on a reasoning
    parser, so parse_args takes ``--reasoning-parser`` and the ``--config`` file's ``reasoning_parser`` into
    ``Context.reasoning_parser`` (the flag winning, a ``source_conflict``) as it does ``kvload.LLM``'s keyword and
    file, instead of reporting the file's unused as a plan does."""
    from pipeline.context import LoadRequest

    overrides = cli_overrides(ns)
    parsers: tuple[str, ...] = ()
    if generates:
        from pipeline.vllm_compat import REASONING_PARSERS

        parsers = REASONING_PARSERS
        if getattr(ns, "reasoning_parser", None) is not None:  # kvload's name already (the flag's type)
            overrides["reasoning_parser"] = ns.reasoning_parser
    # config_read: the --config tree this process read already (kvload.cli.launch), so the file is read once
    return LoadRequest(model=ns.model, overrides=overrides, source="cli", config_file=ns.config,
                       config=getattr(ns, "config_read", None), reasoning_parsers=parsers,
                       load_weights=load_weights, kv_events_reader=kv_events_reader, generates=generates)
