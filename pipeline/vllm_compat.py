"""vLLM's engine-argument names: those that mean exactly a kvload field, and those that only look like one.

Many users arrive from vLLM. The command line accepts vLLM's flag for a field whose meaning is the same (the ``aliases``
of ``kvload.cli.flags.FLAGS``), and so does the Python API (``kvload.LLM``, ``plan``, ``load``,
``engine.simulator.simulate``: :func:`take_same_meaning`, run by ``parse_args`` on the keywords), as vLLM's ``LLM(...)``
takes them: ``max_model_len=4096`` sets ``max_seq_len``, ``block_size=16`` ``kv_cache_config.tokens_per_block`` (merged
with a ``kv_cache_config`` also given), each checked as kvload's field and recorded as the user's (``args_parsed`` with
``given_as``); the same field under both names is refused unless the values agree. The YAML file keeps one name per
field (TensorRT-LLM's ``LlmArgs``) and refuses vLLM's with the key to write. A vLLM setting whose meaning differs (a
share of the whole GPU, a size in GiB) is never taken as kvload's nearest one: it is refused with the difference, from
every source.
vLLM's engine knobs kvload has no counterpart for (CUDA graphs, stats logging, sleep mode) are accepted and reported as
``setting_ignored``, as TensorRT-LLM's are (``pipeline.trtllm_compat``); those whose value would change the model or
the task (``quantization``, ``cpu_offload_gb``, ``task``) are accepted only at their no-op value. ``hf_overrides`` acts:
:func:`hf_overrides` checks it here, ``models.hf_overrides`` lays it over the checkpoint's config.

Checked against vLLM's engine arguments (``vllm/engine/arg_utils.py``, ``vllm/config/cache.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

from pipeline.config import AUTO, LlmArgs, describe
from pipeline.converter import structure
from pipeline.errors import ConfigError
from pipeline.limits import MAX_DRAFT_LEN, MAX_NGRAM, plain_scalar, plain_value, short
from pipeline.paths import get_in, unflatten

#: vLLM's name → kvload's dotted field, where vLLM's setting means exactly what kvload's does (defaults may differ:
#: vLLM's block size is 16, kvload's 32; the CLI flags and the Python keywords are aliases of kvload's, the YAML keys
#: are refused).
SAME_MEANING: dict[str, str] = {
    "max_model_len": "max_seq_len",  # the longest sequence, prompt and output; default: the checkpoint's
    "max_num_seqs": "max_batch_size",  # most requests scheduled in one step
    "max_num_batched_tokens": "max_num_tokens",  # most tokens one step computes (prefill chunks included)
    "block_size": "kv_cache_config.tokens_per_block",  # tokens per KV block
    "kv_cache_dtype": "kv_cache_config.dtype",  # the pools' element type (fp8 = float8_e4m3fn)
    "enable_prefix_caching": "kv_cache_config.enable_block_reuse",  # reuse of cached prompt-prefix blocks
}


#: vLLM's name → (what it means there, how kvload differs, kvload's nearest fields, a note after them): refused.
DIFFERENT_MEANING: dict[str, tuple[str, str, tuple[str, ...], str]] = {
    "gpu_memory_utilization": (
        "vLLM's share of the whole GPU's memory (weights, activations and KV cache)",
        "kvload sizes the KV cache from the memory free after the weights",
        ("kv_cache_config.free_gpu_memory_fraction", "kv_cache_config.max_gpu_total_bytes"), ""),
    "swap_space": (
        "vLLM's CPU swap space in GiB per GPU",
        "kvload's host tier (V2 only) is a byte count",
        ("kv_cache_config.host_cache_size",), " (4GiB where vLLM says 4)"),
    "num_gpu_blocks_override": (
        "vLLM's count of KV cache blocks (of block_size tokens each), in place of the profiled one",
        "kvload sizes its KV cache in tokens",
        ("kv_cache_config.max_tokens",), " (the blocks times the block size)"),
    "kv_cache_memory_bytes": (
        "vLLM's KV cache size in bytes per GPU, in place of gpu_memory_utilization",
        "kvload caps the KV cache at a byte count and within the share of free memory it is allowed",
        ("kv_cache_config.max_gpu_total_bytes",), ""),
}


#: :data:`DIFFERENT_MEANING` names whose value is in kvload's nearest field's unit (bytes): the refusal writes it there
SAME_UNIT = frozenset({"kv_cache_memory_bytes"})


#: vLLM's engine knobs (``LLM(...)`` keywords, YAML keys) kvload has no counterpart for → why: ``setting_ignored``.
IGNORED: dict[str, str] = {
    **dict.fromkeys(("enforce_eager", "max_seq_len_to_capture", "cuda_graph_sizes", "compilation_config",
                     "max_cudagraph_capture_size"),
                    "CUDA graphs / torch.compile: kvload runs the forward eagerly"),
    "disable_cascade_attn": "cascade attention is a path of vLLM's FlashAttention backend; kvload's paged attention "
                            "is --attention_backend's",
    **dict.fromkeys(("otlp_traces_endpoint", "collect_detailed_traces"),
                    "OpenTelemetry tracing: kvload records each request's admission, steps and end in its audit log "
                    "(kvload serve: GET /v1/kvload/audit, --audit-log FILE) and its timings in /metrics"),
    **dict.fromkeys(("show_hidden_metrics_for_version", "enable_mfu_metrics"),
                    "metrics: kvload's /metrics and LLM.get_metrics() have a fixed set of series"),
    **dict.fromkeys(("long_prefill_token_threshold", "max_num_partial_prefills", "max_long_partial_prefills"),
                    "partial-prefill concurrency: kvload chunks every prefill up to max_num_tokens per step"),
    "tokenizer_pool_size": "kvload loads the checkpoint's own tokenizer, one per process",
    **dict.fromkeys(("disable_custom_all_reduce", "distributed_executor_backend"),
                    "multi-GPU plumbing: kvload's ranks are processes over torch.distributed, started by torchrun "
                    "or by the kvload CLI itself"),
    "disable_log_stats": "engine statistics: only kvload serve logs vLLM's periodic throughput line (engine_stats), "
                         "which its --disable-log-stats turns off; here the totals are LLM.get_metrics()'s and the "
                         "audit log's",
    **dict.fromkeys(("disable_async_output_proc", "async_scheduling"),
                    "engine statistics / output processing: kvload records events in its audit log (log=False keeps "
                    "them off stderr) and has LLM.get_metrics()"),
    "enable_sleep_mode": "kvload.LLM has no sleep/wake_up; close() releases the pools and weights",
    "download_dir": "kvload never downloads from a model hub (local directories, presets, smollm2-135m)",
    "max_logprobs": "kvload's bound is fixed: at most 20 logprobs per token (pipeline.limits.MAX_LOGPROBS)",
    "hf_token": "kvload never downloads from a model hub: it reads local directories and the local Hugging Face cache",
    **dict.fromkeys(("max_lora_rank", "max_loras", "max_cpu_loras", "enable_lora", "fully_sharded_loras",
                     "lora_dtype"),
                    "LoRA adapters: kvload runs the base weights, no adapter is loaded (lora_modules and a "
                    "lora_request are refused)"),
    **dict.fromkeys(("limit_mm_per_prompt", "mm_processor_kwargs"),
                    "multimodal inputs: kvload serves text-only models (a prompt's multi_modal_data is refused)"),
    "enable_expert_parallel": "MoE expert parallelism: kvload parallelizes by tensor parallel only "
                              "(tensor_parallel_size)",
    **dict.fromkeys(("use_v2_block_manager", "num_scheduler_steps", "max_parallel_loading_workers"),
                    "an older vLLM engine's knob: kvload's KV cache manager and scheduler are chosen by the route "
                    "(kv_cache_config.use_kv_cache_manager_v2) and step one token at a time"),
    "preemption_mode": "kvload's managers choose: V1 recomputes a preempted request, V2 suspends it to the host tier "
                       "or recomputes it (kv_cache_config.host_cache_size)",
    # names TensorRT-LLM has too: a TensorRT-LLM options file's are reported with its reasons (pipeline.trtllm_compat)
    **dict.fromkeys(("tokenizer", "tokenizer_mode", "skip_tokenizer_init", "revision"),
                    "kvload loads the checkpoint's own tokenizer and files, from the local directory or cache"),
    "enable_chunked_prefill": "kvload always chunks a prefill up to max_num_tokens",
    "load_format": "kvload reads the checkpoint's own files as they are (safetensors, .bin or .gguf)",
}

#: ``load_format`` values that ask for random weights instead of the checkpoint's (vLLM's and TensorRT-LLM's
#: ``dummy``): the reason kvload gives says what it does instead
DUMMY_LOAD_FORMATS = frozenset({"dummy", "DUMMY", "LoadFormat.DUMMY"})
DUMMY_LOAD = ("dummy asks for random weights without reading the checkpoint; kvload loads the checkpoint's real "
              "weights wherever it loads any (plan reads none)")


def _count_at_least(low: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _on_off(value: Any) -> bool:
    """vLLM's boolean knobs take true or false (0 and 1 too, as Python's bool does; numpy's bool as a bool)."""
    value = plain_value(value)
    return isinstance(value, bool) or (type(value) is int and value in (0, 1))


#: vLLM's on/off engine knobs kvload ignores (``bool`` in vLLM's ``EngineArgs``; ``--X`` / ``--no-X`` switches): a NaN,
#: a dict or a text is refused as vLLM's own argument check refuses it, not taken and reported ignored
BOOL_KNOBS = frozenset({
    "enforce_eager", "disable_cascade_attn", "enable_mfu_metrics", "disable_custom_all_reduce", "disable_log_stats",
    "disable_async_output_proc", "async_scheduling", "enable_sleep_mode", "enable_lora", "fully_sharded_loras",
    "enable_expert_parallel", "use_v2_block_manager", "skip_tokenizer_init", "enable_chunked_prefill",
})


#: vLLM's own checks of knobs kvload ignores → (the check, what vLLM accepts): a value vLLM refuses is refused here too,
#: as a kvload field's bad value is, rather than taken and ignored (``vllm/config/scheduler.py``, ``lora.py``, ...)
KNOB_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "num_scheduler_steps": (_count_at_least(1), "an integer >= 1"),
    "max_parallel_loading_workers": (_count_at_least(1), "an integer >= 1 (a number of workers)"),
    "max_loras": (_count_at_least(1), "an integer >= 1"),
    "max_lora_rank": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v in (1, 8, 16, 32, 64, 128, 256,
                                                                                         320, 512),
                      "one of 1, 8, 16, 32, 64, 128, 256, 320, 512"),
    "preemption_mode": (lambda v: v in ("recompute", "swap"), "recompute or swap"),
    "distributed_executor_backend": (lambda v: v in ("ray", "mp", "uni", "external_launcher"),
                                     "ray, mp, uni or external_launcher"),
    **dict.fromkeys(BOOL_KNOBS, (_on_off, "true or false")),
    # an int too: YAML reads an all-digit commit as one
    "revision": (lambda v: isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)),
                 "a string (a branch, tag or commit)"),
    # TensorRT-LLM's scripts pass a tokenizer object: any object is taken but plain data, which no tokenizer is
    "tokenizer": (lambda v: not isinstance(v, (bool, int, float, complex, bytes, Mapping, list, tuple, set, frozenset)),
                  "a path or a tokenizer object"),
}

#: vLLM knobs whose value is a secret: recorded as hidden, never as given (the log, the audit).
SECRET_KNOBS = frozenset({"hf_token"})

#: Why vLLM's task/runner/convert need no value: a checkpoint is served as its ``architectures[0]`` says.
EMBEDS_TOO = ("kvload serves a checkpoint as its architectures[0] says, so there is no runner to choose: a "
              "*ForCausalLM one generates and embeds (LLM.embed and kvload serve's /v1/embeddings pool the last "
              "token's hidden state, as vLLM's runner pooling does for a decoder model), a *ForSequenceClassification "
              "one classifies (LLM.classify, POST /classify), scores pairs through its head and each token "
              "(LLM.reward) (convert or task 'classify' makes a *ForCausalLM checkpoint carrying score.weight one); "
              "vLLM's reward conversion of a causal LM (its per-token hidden states) is not served")

#: vLLM's knobs whose only value kvload can honour is their no-op one → (the accepted values, why others are refused).
NO_OP_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "quantization": ((None,), "kvload runs the checkpoint's weights in dtype, unquantized"),
    "cpu_offload_gb": ((0, 0.0), "kvload keeps every weight on the device"),
    # a decoder checkpoint as vLLM's embedding model is kvload's LLM itself: embed() pools as vLLM's does
    "task": (("auto", "generate", "embed", "classify", "score"), EMBEDS_TOO),
    "runner": (("auto", "generate", "pooling"), EMBEDS_TOO),
    "convert": (("auto", "none", "embed", "classify"), EMBEDS_TOO),
    "data_parallel_size": ((1,), "kvload runs one engine per process (start one kvload serve per replica)"),
    "pipeline_parallel_size": ((1,), "kvload splits a model by tensor parallel only (tensor_parallel_size)"),
    "model_impl": (("auto", "transformers"), "kvload runs transformers' built-in model classes"),
    "rope_scaling": ((None, {}), "kvload reads the checkpoint's config.json as it is (its rope_scaling); "
                                 "hf_overrides={'rope_scaling': {...}} changes it, as in vLLM today"),
    "rope_theta": ((None,), "kvload reads the checkpoint's config.json as it is (its rope_theta); "
                            "hf_overrides={'rope_theta': N} changes it, as in vLLM today"),
    "kv_transfer_config": ((None, {}), "disaggregated prefill (KV transfer between instances) is not served: one "
                                       "kvload serve runs prefill and decode; its KV cache events go out by "
                                       "--kv-events-config"),
    "logprobs_mode": (("raw_logprobs",), "kvload's logprobs are the model's raw distribution, before temperature "
                                         "and the penalties (vLLM's default, raw_logprobs)"),
}


#: vLLM's settings that would load something kvload does not serve → why, and what to do instead: refused with any
#: value but their unset one (None, or an empty list)
REFUSED: dict[str, str] = {
    "lora_modules": "LoRA adapters are not served by kvload (it runs the base weights); serve a checkpoint with the "
                    "adapter merged into its weights (peft's merge_and_unload) instead",
}


#: vLLM's ``--reasoning-parser`` names kvload has (``engine.reasoning`` implements them; ``engine.reasoning.PARSERS``):
#: every source that names one is checked against these, a plan's and a load's too, where it acts on nothing
REASONING_PARSERS = ("deepseek_r1", "qwen3")

#: TensorRT-LLM's names of those parsers (the keys its ``ReasoningParserFactory`` registers them under: ``trtllm-serve
#: --reasoning_parser deepseek-r1``, an options file's ``reasoning_parser``; its ``deepseek-r1`` reads a reply as
#: kvload's ``deepseek_r1``, thinking from the first character, its ``qwen3`` as kvload's ``qwen3``) → kvload's name.
#: Matched in any case, as TensorRT-LLM's factory lowercases the name it is given; taken from every source as that
#: parser and recorded under kvload's name.
REASONING_PARSER_ALIASES = {"deepseek-r1": "deepseek_r1", "qwen3": "qwen3"}


def reasoning_parser_named(value: Any) -> str | None:
    """kvload's name of the parser ``value`` names (one of :data:`REASONING_PARSERS`, or TensorRT-LLM's name of one:
    :data:`REASONING_PARSER_ALIASES`); None when it names none of them."""
    if not isinstance(value, str):
        return None
    if value in REASONING_PARSERS:
        return value
    return REASONING_PARSER_ALIASES.get(value.lower())


def reasoning_parser(value: Any, python: bool, source: str | None = None) -> Any:
    """kvload's name of the parser ``value`` names (:func:`reasoning_parser_named`; None: no parser); ``ConfigError``
    naming ``reasoning_parser`` and kvload's names otherwise (``python``: a keyword argument, None; else a YAML key,
    null; ``source``: the error's, ``"api"`` for ``kvload.LLM(reasoning_parser=...)``)."""
    if value is None:
        return None
    if (name := reasoning_parser_named(value)) is not None:
        return name
    detail = f"expected one of {', '.join(REASONING_PARSERS)} (or {'None' if python else 'null'}), got {short(value)}"
    raise ConfigError(f"reasoning_parser: {detail}", path="reasoning_parser", detail=detail, source=source)


#: vLLM's engine arguments a ``plan`` / ``load`` call (or a YAML file) does not take → where kvload takes them: refused
#: naming that, never with the nearest kvload spelling (``kv_events_config`` is not ``kv_cache_config``)
TAKEN_ELSEWHERE: dict[str, str] = {
    "kv_events_config": "vLLM's KV cache event publisher; kvload.LLM(kv_events_config={...}) and kvload serve "
                        "--kv-events-config take it (a plan or load keeps the events with kv_cache_config="
                        "{'event_buffer_max_size': N}, read by LoadResult.kv_cache_events())",
    "seed": "vLLM's sampling seed; kvload.LLM(seed=N) and kvload serve --seed take it (weights_seed seeds a preset's "
            "random weights, another setting)",
    "served_model_name": "the model name vLLM's server answers to; kvload serve --served-model-name takes it",
}

#: every vLLM engine argument name the tables above answer (act on, report ignored, refuse naming kvload's setting,
#: or take elsewhere), in the tables' order: ``kvload.EngineArgs``' fields and the names a mistyped keyword is offered
ANSWERED_NAMES: tuple[str, ...] = (*SAME_MEANING, *DIFFERENT_MEANING, *IGNORED, *NO_OP_ONLY, *REFUSED, *TAKEN_ELSEWHERE)


class VllmOnly(NamedTuple):
    """One vLLM engine argument kvload implements no counterpart for: what kvload does with it, why, its flag."""

    #: ``"ignore"``: accepted at any value and reported ``setting_ignored`` (it concerns only vLLM's internals, or
    #: inputs kvload never takes); ``"refuse"``: one line naming it, unless given its ``default`` (reported ignored)
    policy: Literal["ignore", "refuse"]
    #: why, and what kvload offers instead where it has an equivalent
    why: str
    #: its flag's shape in vLLM's ``add_cli_args``: ``switch`` (--X / --no-X), ``store_true`` (--X alone), ``value``,
    #: ``values`` (one or more); None: no flag (an ``EngineArgs`` field only, or a flag of ``vllm serve``'s own)
    shape: Literal["switch", "store_true", "value", "values"] | None = "value"
    #: vLLM's default, which asks for nothing (a switch's is False; None is always taken as unset)
    default: Any = None
    #: vLLM's one-dash spellings (``-dcp``)
    short: tuple[str, ...] = ()


_MULTIMODAL = "multimodal inputs: kvload serves text-only models (a prompt's multi_modal_data is refused)"
_DATA_PARALLEL = ("data parallelism: kvload runs one engine per process (data_parallel_size 1); instead, start one "
                  "kvload serve per replica behind a load balancer")
_EPLB = ("MoE expert load balancing across GPUs: kvload splits a model by tensor parallel only (instead: "
         "tensor_parallel_size)")
_OWN_CODE = "kvload runs its own workers and scheduler (kv_cache_config.use_kv_cache_manager_v2 picks the KV cache " \
            "manager, scheduling_policy the order); no class of yours is loaded"
_LOADER = "kvload reads the checkpoint's own files as they are (safetensors, .bin or .gguf), every one of them"
_SWITCH, _STORE_TRUE, _VALUES = "switch", "store_true", "values"

#: vLLM's engine arguments (``EngineArgs`` fields and the flags of ``EngineArgs.add_cli_args``,
#: ``vllm/engine/arg_utils.py``) kvload implements no counterpart for → :class:`VllmOnly`, one row each: the Python
#: API (``kvload.LLM``, ``plan``, a YAML file), the ``kvload`` commands' flags (``kvload.cli.flags``) and
#: ``kvload.EngineArgs.add_cli_args`` all read it, so such a flag is never argparse's "unrecognized arguments".
VLLM_ONLY: dict[str, VllmOnly] = {
    # -- refused: each would change what is loaded or how it runs, and kvload cannot honour it
    "hf_config_path": VllmOnly("refuse", "kvload reads config.json from the model's own directory; instead, give "
                                         "a directory holding it, or hf_overrides={...} to change its keys"),
    "config_format": VllmOnly("refuse", "kvload reads a checkpoint's config.json, or a .gguf file's metadata",
                              default="auto"),
    "code_revision": VllmOnly("refuse", "kvload never runs a checkpoint's own code (trust_remote_code is ignored)"),
    "enable_prompt_embeds": VllmOnly("refuse", "kvload takes prompts as text or token ids, not embeddings", _SWITCH),
    "disable_sliding_window": VllmOnly("refuse", "kvload runs each layer's attention window as the checkpoint's "
                                                 "config.json sets it", _SWITCH),
    "override_attention_dtype": VllmOnly("refuse", "kvload runs attention in the model's dtype; instead, dtype sets "
                                                   "the whole model's"),
    **dict.fromkeys(("pooler_config", "override_pooler_config"), VllmOnly(
        "refuse", "kvload pools as vLLM's LAST pooling does; instead, kvload.PoolingParams per call "
                  "(use_activation, truncate_prompt_tokens) with LLM.embed / classify / score / encode")),
    "logits_processor_pattern": VllmOnly("refuse", "kvload runs no custom logits processors; instead, "
                                                   "SamplingParams' own fields (logit_bias, allowed_token_ids, ...)"),
    "logits_processors": VllmOnly("refuse", "kvload runs no custom logits processors; instead, SamplingParams' own "
                                            "fields (logit_bias, allowed_token_ids, ...)", _VALUES),
    "io_processor_plugin": VllmOnly("refuse", "kvload loads no input/output processor plugins"),
    "model_loader_extra_config": VllmOnly("refuse", _LOADER, default={}),
    "ignore_patterns": VllmOnly("refuse", _LOADER, _VALUES, default=["original/**/*"]),  # vLLM's LoadConfig's
    **dict.fromkeys(("guided_decoding_disable_fallback", "guided_decoding_disable_any_whitespace",
                     "guided_decoding_disable_additional_properties"), VllmOnly(
        "refuse", "vLLM's deprecated engine-wide structured-output switches; kvload's structured outputs run on "
                  "xgrammar, set per request (SamplingParams(structured_outputs=...), response_format)")),
    "structured_outputs_config": VllmOnly("refuse", "kvload's structured outputs run on xgrammar; instead, set them "
                                                    "per request (SamplingParams(structured_outputs=...), "
                                                    "response_format)"),
    "decode_context_parallel_size": VllmOnly("refuse", "kvload splits attention heads by tensor parallel only "
                                                       "(instead: tensor_parallel_size)", default=1,
                                             short=("-dcp",)),
    "dcp_kv_cache_interleave_size": VllmOnly("refuse", "decode context parallelism: kvload splits attention heads "
                                                       "by tensor parallel only (instead: tensor_parallel_size)",
                                             default=1),
    "data_parallel_rank": VllmOnly("refuse", _DATA_PARALLEL, short=("-dpn",)),
    "data_parallel_start_rank": VllmOnly("refuse", _DATA_PARALLEL, short=("-dpr",)),
    "data_parallel_size_local": VllmOnly("refuse", _DATA_PARALLEL, short=("-dpl",)),
    "data_parallel_address": VllmOnly("refuse", _DATA_PARALLEL, short=("-dpa",)),
    "data_parallel_rpc_port": VllmOnly("refuse", _DATA_PARALLEL, short=("-dpp",)),
    "data_parallel_backend": VllmOnly("refuse", _DATA_PARALLEL, default="mp", short=("-dpb",)),
    "data_parallel_hybrid_lb": VllmOnly("refuse", _DATA_PARALLEL, _SWITCH, short=("-dph",)),
    "data_parallel_external_lb": VllmOnly("refuse", _DATA_PARALLEL, _SWITCH, short=("-dpe",)),
    "data_parallel_multi_port_external_lb": VllmOnly("refuse", _DATA_PARALLEL, _STORE_TRUE, short=("-dpm",)),
    "prefill_context_parallel_size": VllmOnly("refuse", "prefill context parallelism: kvload splits attention heads "
                                                        "by tensor parallel only (instead: tensor_parallel_size)",
                                              default=1, short=("-pcp",)),
    # vLLM's defaults (ParallelConfig): one node, rank 0, its rendezvous at 127.0.0.1:29501
    **{name: VllmOnly(
        "refuse", "multi-node serving: kvload's ranks run on one machine (tensor_parallel_size processes, started "
                  "by torchrun or by the kvload CLI itself)", default=default, short=short)
       for name, default, short in (("master_addr", "127.0.0.1", ()), ("master_port", 29501, ()),
                                    ("nnodes", 1, ("-n",)), ("node_rank", 0, ("-r",)))},
    "enable_dbo": VllmOnly("refuse", "dual-batch overlap: kvload runs each step as one batch", _SWITCH),
    "enable_eplb": VllmOnly("refuse", _EPLB, _SWITCH),
    "eplb_config": VllmOnly("refuse", _EPLB, default={}),
    "expert_placement_strategy": VllmOnly("refuse", _EPLB, default="linear"),
    **{name: VllmOnly("refuse", _EPLB, default=default)  # vLLM's defaults (EPLBConfig / ParallelConfig)
       for name, default in (("num_redundant_experts", 0), ("eplb_window_size", 1000), ("eplb_step_interval", 3000))},
    "eplb_log_balancedness": VllmOnly("refuse", _EPLB, _SWITCH),
    "worker_cls": VllmOnly("refuse", _OWN_CODE, default="auto"),
    "worker_extension_cls": VllmOnly("refuse", _OWN_CODE, default=""),
    "scheduler_cls": VllmOnly("refuse", _OWN_CODE),
    "additional_config": VllmOnly("refuse", "vLLM platform plugins' settings: kvload loads no platform plugins",
                                  default={}),
    "calculate_kv_scales": VllmOnly("refuse", "kvload's fp8 KV cache (kv_cache_dtype fp8) casts values without "
                                              "calibrated scales", _SWITCH),
    "kv_sharing_fast_prefill": VllmOnly("refuse", "kvload prefills every layer of every prompt token (no "
                                                  "cross-layer KV sharing)", _SWITCH),
    "disable_hybrid_kv_cache_manager": VllmOnly("refuse", "kvload's route picks the KV cache manager; instead: "
                                                          "kv_cache_config.use_kv_cache_manager_v2", _SWITCH),
    # kv_offloading_size's default (None) offloads nothing; the backend's ("native") applies only with a size
    **{name: VllmOnly(
        "refuse", "vLLM's KV offloading connector; instead, kvload's host tier: kv_cache_config.host_cache_size "
                  "(V2 only)", default=default)
       for name, default in (("kv_offloading_size", None), ("kv_offloading_backend", "native"))},
    "ec_transfer_config": VllmOnly("refuse", "encoder-cache transfer between instances: kvload serves text-only "
                                             "models on one instance"),
    "default_mm_loras": VllmOnly("refuse", "LoRA adapters are not served by kvload (it runs the base weights)"),
    "tokens_only": VllmOnly("refuse", "kvload's engine detokenizes its outputs itself", _SWITCH),
    # vllm serve's (AsyncEngineArgs) flags: kvload serve takes them and reports them ignored; an LLM has no requests log
    **dict.fromkeys(("enable_log_requests", "disable_log_requests"), VllmOnly(
        "refuse", "vllm serve's request logging: kvload serve takes the flag (kvload records each request in its "
                  "audit log)", None)),
    # -- ignored: only vLLM's internals, or inputs kvload never takes; any value asks for nothing kvload does
    "tokenizer_revision": VllmOnly("ignore", "kvload loads the checkpoint's own tokenizer and files, from the local "
                                             "directory or cache"),
    "use_tqdm_on_load": VllmOnly("ignore", "vLLM's weight-loading progress bar: kvload logs its load stages as "
                                           "events", _SWITCH),
    **dict.fromkeys(("safetensors_load_strategy", "pt_load_map_location"), VllmOnly("ignore", _LOADER)),
    "ray_workers_use_nsight": VllmOnly("ignore", "Ray workers' profiling: kvload runs no Ray workers", _SWITCH),
    "aggregate_engine_logging": VllmOnly("ignore", "statistics per data-parallel engine: kvload runs one engine per "
                                                   "process", _STORE_TRUE),
    "disable_nccl_for_dp_synchronization": VllmOnly("ignore", "data-parallel plumbing: kvload runs one engine per "
                                                              "process", _SWITCH),
    "all2all_backend": VllmOnly("ignore", "MoE expert parallelism's all-to-all: kvload splits a model by tensor "
                                          "parallel only (tensor_parallel_size)"),
    **dict.fromkeys(("dbo_decode_token_threshold", "dbo_prefill_token_threshold"), VllmOnly(
        "ignore", "dual-batch overlap's thresholds (--enable-dbo): kvload runs each step as one batch")),
    "prefix_caching_hash_algo": VllmOnly("ignore", "kvload keys cached prefix blocks by its own hash of their tokens "
                                                   "(kv_cache_config.enable_block_reuse turns reuse on or off)"),
    "num_lookahead_slots": VllmOnly("ignore", "speculative decoding's slot reservation: kvload's n-gram drafts "
                                              "reserve their own blocks (max_draft_len)"),
    "cudagraph_capture_sizes": VllmOnly("ignore", "CUDA graphs / torch.compile: kvload runs the forward eagerly",
                                        _VALUES),
    "attention_config": VllmOnly("ignore", "vLLM's attention kernels (its backend, FlashAttention version, ...): "
                                           "kvload's paged attention is attention_backend's (auto, flex, sdpa, triton, "
                                           "cpu_kernel)", short=("-ac",)),
    **dict.fromkeys(("mamba_cache_dtype", "mamba_ssm_cache_dtype", "mamba_block_size"), VllmOnly(
        "ignore", "Mamba (state-space) layers' cache: kvload serves no model with such layers")),
    **dict.fromkeys(("enable_lora_bias", "lora_extra_vocab_size"), VllmOnly(
        "ignore", "LoRA adapters: kvload runs the base weights, no adapter is loaded (lora_modules and a "
                  "lora_request are refused)")),
    **dict.fromkeys(("allowed_local_media_path", "media_io_kwargs", "mm_processor_cache_gb", "mm_processor_cache_type",
                     "mm_shm_cache_max_object_size_mb", "mm_encoder_tp_mode", "mm_encoder_attn_backend",
                     "video_pruning_rate"), VllmOnly("ignore", _MULTIMODAL)),
    "allowed_media_domains": VllmOnly("ignore", _MULTIMODAL, _VALUES),
    **dict.fromkeys(("enable_mm_embeds", "interleave_mm_strings", "skip_mm_profiling", "disable_chunked_mm_input"),
                    VllmOnly("ignore", _MULTIMODAL, _SWITCH)),
    **dict.fromkeys(("disable_mm_preprocessor_cache", "enable_multimodal_encoder_data_parallel"),
                    VllmOnly("ignore", _MULTIMODAL, _STORE_TRUE)),
}

#: the names :data:`VLLM_ONLY` refuses (vLLM's engine arguments named as vLLM's, never offered a kvload field spelled
#: alike)
VLLM_ENGINE_ARGS = frozenset(name for name, row in VLLM_ONLY.items() if row.policy == "refuse")


def vllm_only(name: str, value: Any) -> str | None:
    """Why :data:`VLLM_ONLY`'s ``name`` does nothing here (reported ``setting_ignored``), None for a name not in it;
    ``ConfigError`` naming it for a refused one given other than its default."""
    row = VLLM_ONLY.get(name)
    if row is None:
        return None
    if row.policy == "ignore":
        return row.why
    default = False if row.shape in ("switch", "store_true") else row.default
    if value is None or (value == default and type(value) is type(default)):
        return f"vLLM's default {short(value)} asks for nothing (kvload does not implement it: {row.why})"
    detail = f"a vLLM engine argument kvload does not implement: {row.why}"
    raise ConfigError(f"{name}: {detail}", path=name, detail=detail)


def not_taken(name: str) -> str | None:
    """Why vLLM's engine argument ``name`` is refused here, naming where kvload takes it when it does; None for a
    name that is not one (it gets the converter's unknown-key line, with a close kvload field suggested)."""
    if name in TAKEN_ELSEWHERE:
        return TAKEN_ELSEWHERE[name]
    if name in VLLM_ENGINE_ARGS:
        return f"a vLLM engine argument kvload does not implement: {VLLM_ONLY[name].why}"
    return None


def vllm_knob(name: str, value: Any) -> str | None:
    """Why vLLM's engine knob ``name`` does nothing in kvload (reported as ``setting_ignored``), or None for a name
    that is not one; ``ConfigError`` for a knob given a value kvload cannot honour (``quantization="awq"``) or one
    kvload does not implement (:data:`VLLM_ONLY`)."""
    if name in VLLM_ONLY:
        return vllm_only(name, value)
    if name in REFUSED:
        if value is None or value == []:
            return f"{REFUSED[name]} (none was given)"
        raise ConfigError(f"{name}: {REFUSED[name]}", path=name, detail="not served")
    if name in IGNORED:
        entry_check = KNOB_VALUES.get(name)
        if entry_check is not None and value is not None and not entry_check[0](value):
            raise ConfigError(f"{name}: vLLM's setting; expected {entry_check[1]}, got {short(value)}", path=name,
                              detail="not a value vLLM accepts")
        if name == "load_format" and value in DUMMY_LOAD_FORMATS:
            return DUMMY_LOAD
        return IGNORED[name]
    entry = NO_OP_ONLY.get(name)
    if entry is None:
        return None
    accepted, why = entry
    if not any(type(value) is type(a) and value == a for a in accepted):  # the type first, as above
        shown = " or ".join(repr(a) for a in accepted)
        raise ConfigError(f"{name}: vLLM's setting; {why}; accepted: {shown}, got {short(value)}", path=name,
                          detail=why)
    return f"{why} ({short(value)} asks for nothing else)"


#: The deepest nesting an ``hf_overrides`` value may have (a config's values are a few levels deep at most).
HF_OVERRIDES_DEPTH = 16
#: What ``hf_overrides`` takes, as its refusals say.
HF_OVERRIDES_ACCEPTED = ("a dict of config.json keys such as {\"max_position_embeddings\": 4096}, each value JSON data "
                         "(null, true/false, a number, a string, a list or an object of those)")


def hf_overrides(value: Any) -> dict[str, Any]:
    """vLLM's ``hf_overrides`` checked (``{}`` for None): a mapping of config keys to JSON data. ``ConfigError``
    naming ``hf_overrides`` (a callable, which vLLM allows and kvload cannot record as events, or no mapping) or
    ``hf_overrides.<key>`` (a key that is no attribute name, a value that is not JSON data)."""
    if value is None:
        return {}
    if callable(value) and not isinstance(value, Mapping):
        raise ConfigError("hf_overrides: a callable is not accepted (kvload records each key it changes in the "
                          f"config as an event); give {HF_OVERRIDES_ACCEPTED}", path="hf_overrides",
                          detail="a callable")
    if not isinstance(value, Mapping):
        raise ConfigError(f"hf_overrides: expected {HF_OVERRIDES_ACCEPTED}, got {short(value)}", path="hf_overrides",
                          detail="not a dict")
    for key, item in value.items():
        if not isinstance(key, str) or not key.isidentifier() or key.startswith("_"):
            raise ConfigError(f"hf_overrides: key {short(key)} is not a config key (a name such as "
                              "max_position_embeddings, not starting with _)", path="hf_overrides",
                              detail="not a config key")
        _json_data(item, f"hf_overrides.{key}", 0)
    return dict(value)


def _json_data(value: Any, where: str, depth: int) -> None:
    """``ConfigError`` naming ``where`` unless ``value`` is JSON data a config.json could hold."""
    if depth > HF_OVERRIDES_DEPTH:
        raise ConfigError(f"{where}: nested more than {HF_OVERRIDES_DEPTH} levels deep", path=where,
                          detail="nested too deeply")
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(f"{where}: {short(value)} is not a JSON number", path=where, detail="not JSON data")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _json_data(item, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(f"{where}: key {short(key)} is not a string (config.json keys are)", path=where,
                                  detail="not JSON data")
            _json_data(item, f"{where}.{key}", depth + 1)
        return
    raise ConfigError(f"{where}: expected JSON data (null, true/false, a number, a string, a list or an object), got "
                      f"{type(value).__name__} {short(value)}", path=where, detail="not JSON data")


def different_meaning(name: str, spell: Callable[[str], str]) -> str | None:
    """Why a vLLM setting ``name`` (underscored) is not kvload's nearest one, naming those with ``spell`` (a field's
    path → a flag, or the path itself); None for a name that is not such a setting."""
    entry = DIFFERENT_MEANING.get(name)
    if entry is None:
        return None
    there, here, nearest, note = entry
    first, *others = map(spell, nearest)
    also = f" (or {', '.join(others)})" if others else ""
    return f"{there}; {here}: {first}{also}{note}"


def refused_key(name: str, value: Any, python: bool) -> str | None:
    """The error detail for vLLM's ``name`` given as a key (``python``: a keyword argument, else a YAML key): the
    kvload field to set instead, with the value given, or why there is none; None for a name vLLM does not have."""
    path = SAME_MEANING.get(name)
    if path is None:
        why = different_meaning(name, lambda p: p)
        if why is not None and name in SAME_UNIT:  # a byte count either way: the value carries over as the cap
            why += f" ({write_as(DIFFERENT_MEANING[name][2][0], value, python)} for that cap)"
        return why or not_taken(name)
    return f"vLLM's name for {path}; {write_as(path, value, python)}"


def write_as(path: str, value: Any, python: bool) -> str:
    """``pass kv_cache_config={'max_tokens': 5}`` (``python``: a keyword argument) or ``write kv_cache_config:
    {max_tokens: 5}`` (a YAML key): how to give ``value`` to the dotted field ``path``."""
    *parents, leaf = path.split(".")
    if python:  # Python's True/False; any other value cut short as errors quote values
        shown = repr(value) if isinstance(value, bool) else short(value)
        given = f"{leaf}={shown}" if not parents else f"{parents[0]}={{{leaf!r}: {shown}}}"
        return f"pass {given}"
    given = f"{leaf}: {describe(value)}" if not parents else f"{parents[0]}: {{{leaf}: {describe(value)}}}"
    return f"write {given}"


def take_same_meaning(tree: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Python keywords with vLLM's names of kvload fields (:data:`SAME_MEANING`) put at kvload's field, and
    kvload's dotted path → the vLLM name it was given as (for the audit).

    Each value is checked as kvload's field is, the error naming vLLM's name; a nested one (``block_size``) joins a
    ``kv_cache_config`` given beside it. A field given under both names is ``ConfigError`` naming both unless the
    values agree once checked (``kv_cache_dtype="fp8"`` and ``dtype: "float8_e4m3fn"``): then kvload's name stands.
    ``None`` under a vLLM name is vLLM's unset default and sets nothing.
    """
    names = [key for key in tree if key in SAME_MEANING]
    if not names:
        return dict(tree), {}
    nested = tree.get("kv_cache_config")
    if "kv_cache_config" in tree and not isinstance(nested, Mapping) \
            and any("." in SAME_MEANING[n] for n in names):
        _checked("kv_cache_config", nested)  # not a mapping to join: the field's own error
    kv: dict[str, Any] | None = dict(nested) if isinstance(nested, Mapping) else None
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in tree.items():
        path = SAME_MEANING.get(key)
        if path is None:
            out[key] = kv if key == "kv_cache_config" and kv is not None else value
            continue
        if value is None:  # vLLM's "not set" (its default for every one of these): kvload's default stands
            continue
        # the type first: a numpy array's == is elementwise, and its truth raised a message naming no setting
        if key == "max_model_len" and type(value) is int and value == -1:  # vLLM's sentinel of "auto"
            value = AUTO
        try:
            mine = _checked(path, value)
        except ConfigError as exc:
            raise ConfigError(f"{key}: {exc.detail} (vLLM's name for {path})", path=key, detail=exc.detail) from None
        parent, _, leaf = path.rpartition(".")
        holder: Mapping[str, Any]  # where kvload's name of the field would be
        target: dict[str, Any]  # where this value goes
        if parent:
            if kv is None:  # no kv_cache_config given: this name starts it, where it stands
                kv = out[parent] = {}
            holder = target = kv
        else:
            holder, target = tree, out
        if leaf in holder:  # kvload's name too: it stands when the two agree
            try:
                theirs = _checked(path, holder[leaf])
            except ConfigError:
                continue  # its own error comes when the keywords are checked
            if not (theirs == mine and type(theirs) is type(mine)):
                shown = _python(holder[leaf])
                other = f"{parent}={{{leaf!r}: {shown}}}" if parent else f"{leaf}={shown}"
                raise ConfigError(f"{key}={_python(value)} and {other} set one field ({key} is vLLM's name for "
                                  f"{path}) to different values; give one", path=key, detail="given under two names")
            continue
        target[leaf] = value
        given_as[path] = key
    return out, given_as


def _checked(path: str, value: Any) -> Any:
    """``value`` for the dotted field ``path`` as the args would hold it (``"fp8"`` → ``"float8_e4m3fn"``);
    ``ConfigError`` as the field's check words it."""
    probe = unflatten({"model": "<model>", path: value})
    return get_in(structure(probe, LlmArgs), path)


def _python(value: Any) -> str:
    """A value as a Python keyword's is written in an error: True/False as Python spells them, others cut short."""
    return repr(value) if isinstance(value, bool) else short(value)


#: vLLM's ``speculative_config`` methods that are n-gram lookup in the prompt and output, which kvload drafts by
#: (``[ngram]`` is older vLLM's spelling, also given as ``model``; ``ngram_gpu`` the same lookup run on the GPU)
NGRAM_METHODS = ("ngram", "[ngram]", "ngram_gpu")
#: vLLM's default n-gram size when neither ``prompt_lookup_max`` nor ``prompt_lookup_min`` is given
#: (``vllm/config/speculative.py``: 5 and 5)
VLLM_PROMPT_LOOKUP_DEFAULT = 5
#: ``speculative_config`` keys vLLM has that kvload's n-gram drafts have no counterpart for → why (``setting_ignored``)
SPECULATIVE_IGNORED: dict[str, str] = {
    **dict.fromkeys(("draft_tensor_parallel_size", "quantization", "max_model_len", "revision", "code_revision",
                     "enforce_eager", "draft_load_config", "moe_backend", "attention_backend",
                     "speculative_token_tree", "parallel_drafting", "hf_overrides", "tensor_parallel_size"),
                    "a draft model's setting: n-gram drafts run no draft model"),
    "disable_logprobs": "kvload returns the logprobs a request asks for with drafts on or off",
    "disable_log_stats": "kvload records every step's drafts and acceptances in its audit log and metrics",
    "disable_padded_drafter_batch": "a drafter batching knob: kvload's drafts are rows of the next step",
    **dict.fromkeys(("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                     "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"),
                    "suffix decoding's setting: kvload drafts by n-gram lookup"),
}


def speculative_config(value: Any) -> tuple[dict[str, Any], list[tuple[str, Any, str]]]:
    """vLLM's ``speculative_config`` (``LLM(speculative_config={...})``, ``--speculative-config JSON``) as kvload's
    n-gram fields, and ``(dotted key, value, why)`` for each key given that kvload cannot honour.

    ``method: "ngram"`` (or older vLLM's ``model: "[ngram]"``) maps ``num_speculative_tokens`` to ``max_draft_len``,
    ``prompt_lookup_max`` to ``max_matching_ngram_size`` (vLLM's defaults: ``prompt_lookup_min`` when only it is
    given, else 5) and ``disable_by_batch_size`` to ``speculation_max_batch_size``; ``prompt_lookup_min`` above 1 is
    reported (kvload looks shorter suffixes up down to one token). Any other method (a draft model, EAGLE, Medusa,
    MTP, ...) is ``ConfigError`` naming it; so is a key vLLM does not have."""
    where = "speculative_config"
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected an object such as {{\"method\": \"ngram\", "
                          f"\"num_speculative_tokens\": 4}}, got {short(value)}", path=where, detail="not an object")
    method, model = value.get("method"), value.get("model")
    if method is None and model in NGRAM_METHODS:
        method = model
    if method not in NGRAM_METHODS:
        what = f"method {short(method)}" if method is not None else (
            f"model {short(model)} (a draft model)" if model is not None else "no method")
        raise ConfigError(f"{where}: {what}: kvload drafts by n-gram lookup in the prompt and output only; accepted: "
                          "method 'ngram' with num_speculative_tokens (and prompt_lookup_max, prompt_lookup_min)",
                          path=where, detail="not an n-gram method")
    known = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
             "disable_by_batch_size", *SPECULATIVE_IGNORED}
    spec_keys(value, known, "not a vLLM speculative_config key kvload knows; its n-gram keys: method, "
              "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, disable_by_batch_size")
    drafts = spec_int(value, "num_speculative_tokens", 1, MAX_DRAFT_LEN,
                      required="method 'ngram' (the draft tokens per step, kvload's max_draft_len)")
    low = spec_int(value, "prompt_lookup_min", 1, None)
    high = spec_int(value, "prompt_lookup_max", 1, MAX_NGRAM)
    if high is None:
        high = low if low is not None else VLLM_PROMPT_LOOKUP_DEFAULT
        if high > MAX_NGRAM:
            raise ConfigError(f"{where}: prompt_lookup_min {high} without prompt_lookup_max: kvload matches at most "
                              f"{MAX_NGRAM} tokens; give prompt_lookup_max (1 to {MAX_NGRAM})", path=where,
                              detail="too long")
    if low is not None and low > high:  # vLLM's rule
        raise ConfigError(f"{where}: prompt_lookup_min {low} is more than prompt_lookup_max {high}", path=where,
                          detail="min above max")
    fields: dict[str, Any] = {"max_draft_len": drafts, "max_matching_ngram_size": high}
    batch = spec_int(value, "disable_by_batch_size", 1, None)
    if batch is not None:
        fields["speculation_max_batch_size"] = batch
    ignored: list[tuple[str, Any, str]] = []
    if low is not None and low > 1:
        ignored.append((f"{where}.prompt_lookup_min", low,
                        "kvload looks up shorter suffixes down to one token when the longest never occurred (vLLM "
                        "stops at prompt_lookup_min); the tokens are the same, verified either way"))
    if model is not None and model not in NGRAM_METHODS:
        ignored.append((f"{where}.model", model, "n-gram drafts run no draft model"))
    for key, why in SPECULATIVE_IGNORED.items():
        if key in value and value[key] is not None:
            ignored.append((f"{where}.{key}", value[key], why))
    return fields, ignored


def spec_keys(value: Mapping[str, Any], known: set[str], why: str) -> None:
    """Refuse the first key of ``speculative_config`` not in ``known``: ``speculative_config: KEY: why``. vLLM's
    shape and TensorRT-LLM's NGram (``pipeline.trtllm_compat``) check theirs through this, as :func:`spec_int`."""
    for key in value:
        if key not in known:
            raise ConfigError(f"speculative_config: {short(key)}: {why}", path="speculative_config",
                              detail="unknown key")


def spec_int(value: Mapping[str, Any], key: str, low: int, high: int | None,
             required: str | None = None) -> int | None:
    """``speculative_config[key]``, an integer from ``low`` to ``high``; None when absent (or null), refused when
    absent if ``required`` (what the key is required with, said in the error). vLLM's shape and TensorRT-LLM's NGram
    (``pipeline.trtllm_compat``) check theirs through this."""
    given = plain_scalar(value.get(key))  # numpy's and torch's integers as Python's, as the top-level fields take them
    if given is None:
        if required is not None:
            raise ConfigError(f"speculative_config: {key}: required with {required}", path="speculative_config",
                              detail="required")
        return None
    if not isinstance(given, int) or isinstance(given, bool) or given < low or (high is not None and given > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ConfigError(f"speculative_config: {key}: expected an integer {bound}, got {short(given)}",
                          path="speculative_config", detail="out of range")
    return given
