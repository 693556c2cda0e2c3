"""TensorRT-LLM ``LlmArgs`` keys kvload accepts without acting on them, so a real options YAML loads.

A TensorRT-LLM ``extra_llm_api_options`` file mixes keys kvload acts on (``max_batch_size``,
``kv_cache_config.free_gpu_memory_fraction``, ...) with engine knobs kvload has no counterpart for
(CUDA graphs, overlap scheduler, attention DP, ...). The known ones are taken out of the tree before
validation and reported as ``setting_ignored`` (one warning line each); a key that is neither kvload's
nor TensorRT-LLM's still fails with a suggestion. A ``speculative_config`` of ``decoding_type: NGram``
sets kvload's n-gram fields (:func:`trtllm_speculative_config`), as vLLM's shape does.

The names come from TensorRT-LLM's ``tensorrt_llm/llmapi/llm_args.py`` (``BaseLlmArgs``,
``TorchLlmArgs``, ``KvCacheConfig``; read at commit 0004396 of NVIDIA/TensorRT-LLM), plus a few
keys older releases accepted that still appear in published YAML files. A name kvload itself
defines is never ignored: when kvload gains a field, its key starts to act.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.config import KvCacheConfig, LlmArgs, public_fields
from pipeline.errors import ConfigError, close_names, did_you_mean
from pipeline.limits import MAX_DRAFT_LEN, MAX_NGRAM, checked_flag, plain_flag, plain_scalar, short
from pipeline.vllm_compat import (
    DUMMY_LOAD,
    DUMMY_LOAD_FORMATS,
    NO_OP_ONLY,
    SECRET_KNOBS,
    reasoning_parser,
    refused_key,
    spec_int,
    spec_keys,
    speculative_config,
    vllm_knob,
    write_as,
)

_ENGINE = "a TensorRT-LLM option kvload does not act on"

#: ``reasoning_parser`` where no request runs (``plan``, ``load``, a YAML file): kvload acts on it at generation
REASONING_PARSER_UNUSED = ("a plan or load runs no requests; reasoning_parser acts on generation, where structured "
                           "outputs' grammar starts after the reasoning: kvload.LLM(reasoning_parser=...), kvload "
                           "generate / serve --reasoning-parser (or the config file's reasoning_parser there), or per "
                           "request StructuredOutputsParams(reasoning_parser=...)")

#: Top-level ``LlmArgs`` keys → why kvload does not act on them.
IGNORED_LLM_ARGS: dict[str, str] = {
    **dict.fromkeys((
        "cuda_graph_config", "encoder_cuda_graph_config", "enable_encoder_decoder_mixed_cuda_graph",
        "torch_compile_config", "prefill_cuda_graph_backend", "prefill_capture_num_tokens",
        "use_cuda_graph", "cuda_graph_batch_sizes", "cuda_graph_padding_enabled",
    ), "CUDA graphs / torch.compile: kvload runs the forward eagerly"),
    **dict.fromkeys((
        "disable_overlap_scheduler", "enable_chunked_prefill", "scheduler_config", "batch_wait_timeout_ms",
        "batch_wait_timeout_iters", "batch_wait_max_tokens_ratio", "reorder_policy_config", "stream_interval",
        "enable_early_first_token_response", "garbage_collection_gen0_threshold",
    ), "scheduling knob: kvload's driver always chunks prefill up to max_num_tokens and has no overlap scheduler"),
    **dict.fromkeys((
        "context_parallel_size", "gpus_per_node",
        "moe_cluster_parallel_size", "moe_tensor_parallel_size", "moe_expert_parallel_size",
        "enable_attention_dp", "attention_dp_config", "enable_lm_head_tp_in_adp", "pp_partition", "cp_config",
        "allreduce_strategy", "orchestrator_type", "dwdp_config", "ray_worker_extension_cls",
        "ray_placement_config", "ray_worker_nsight_options", "num_serve_frontends",
    ), "parallelism beyond tensor parallel (tensor_parallel_size, which kvload acts on)"),
    **dict.fromkeys((
        "speculative_config", "decoding_config", "guided_decoding_backend", "batched_logits_processor",
        "gather_generation_logits", "sampler_type",
        "enable_trtllm_sampler", "sampler_force_async_worker", "enable_in_graph_sampling",
        "enable_speculative_beam_history_d2h", "post_processor_hook",
    ), "decoding feature kvload's sampler does not have"),
    **dict.fromkeys((
        "moe_config", "nvfp4_gemm_config", "attn_backend", "enable_mla_skip_correction",
        "mla_skip_correction_threshold", "enable_autotuner", "use_fine_grained_sync", "enable_min_latency",
        "force_dynamic_quantization", "enable_low_latency_host_dispatch", "use_cute_dsl_blockscaling_mm",
        "use_cute_dsl_blockscaling_bmm", "use_cute_dsl_bf16_bmm", "use_cute_dsl_bf16_gemm",
        "sparse_attention_config", "kv_cache_compression_config", "quant_config", "build_config",
    ), "kernel / quantization choice: kvload runs transformers' modules"),
    **dict.fromkeys((
        "print_iter_log", "enable_iter_perf_stats", "enable_iter_req_stats", "iter_stats_max_iterations",
        "request_stats_max_iterations", "max_stats_len", "return_perf_metrics", "perf_metrics_output_dir",
        "perf_metrics_max_requests", "prometheus_metrics_config", "enable_energy_metrics",
        "otlp_traces_endpoint", "enable_layerwise_nvtx_marker", "telemetry_config",
        "layer_wise_benchmarks_config",
    ), "statistics / tracing: kvload records events in its audit log instead"),
    **dict.fromkeys((
        "tokenizer", "tokenizer_mode", "custom_tokenizer", "skip_tokenizer_init", "tokenizer_revision",
        "revision", "model_kwargs", "load_format", "checkpoint_loader", "checkpoint_format",
        "checkpoint_io_policy", "mx_config", "gms_config", "enable_lora", "lora_config", "peft_cache_config",
        "multimodal_config", "mm_encoder_only", "disable_mm_encoder", "encode_only", "encoder_max_batch_size",
        "encoder_max_num_tokens", "max_input_len", "num_postprocess_workers", "postprocess_tokenizer_dir",
        "env_overrides", "sleep_config", "enable_resource_governor",
        "cache_transceiver_config", "kv_connector_config",
    ), "loading / serving feature kvload does not have (it loads the checkpoint's own tokenizer and weights)"),
    "backend": "kvload runs the checkpoint's PyTorch modules (transformers'), as the pytorch backend does; it builds "
               "no TensorRT engine",
    "fail_fast_on_attention_window_too_large": "kvload never fails on it: a KV budget that holds no whole max_seq_len "
                                               "sequence is a kv_budget_short warning naming the setting to raise",
    "custom_module_dirs": "kvload imports no code from outside it: the families it serves run transformers' built-in "
                          "classes (a checkpoint of an architecture kvload lacks is refused when it loads)",
}

#: TensorRT-LLM's ``backend`` values (trtllm-serve's ``--backend`` choices; ``trt`` is its alias of ``tensorrt``)
TRTLLM_BACKENDS = ("pytorch", "tensorrt", "trt", "_autodeploy")

#: trtllm-serve's flags (and keys) asking for what kvload cannot do → why; refused, naming the flag or key, where a
#: value asks for it (a false ``grpc`` asks for nothing)
REFUSED_TRTLLM: dict[str, str] = {
    **dict.fromkeys(("server_role", "metadata_server_config_file", "disagg_cluster_uri"),
                    "disaggregated serving (context and generation servers exchanging KV caches) is not served: one "
                    "kvload serve runs prefill and decode"),
    "grpc": "kvload serve answers HTTP (the OpenAI API) only, not gRPC",
}

#: Keys of TensorRT-LLM's older releases its current ``LlmArgs`` no longer takes, still in published YAML files (its
#: 2025 blogs' ``pytorch_backend_config``) → where their settings are now; refused saying so (difflib offered
#: ``torch_compile_config``, another setting)
RETIRED_TRTLLM: dict[str, str] = {
    "pytorch_backend_config": (
        "the nesting of TensorRT-LLM's older releases, which its current LlmArgs no longer takes; write its keys at "
        "the top level by today's names: kv_cache_dtype as kv_cache_config: {dtype: ...} (kvload acts on it), "
        "use_cuda_graph and cuda_graph_* as cuda_graph_config, enable_overlap_scheduler as disable_overlap_scheduler, "
        "moe_backend as moe_config: {backend: ...} (kvload takes and ignores these)"),
}

#: ``LlmArgs`` keys TensorRT-LLM shares with vLLM whose no-op value only kvload takes
#: (``pipeline.vllm_compat.NO_OP_ONLY``): from an options file they are TensorRT-LLM's, and said to be
SHARED_NO_OP_ONLY = ("pipeline_parallel_size",)

#: ``kv_cache_config`` keys of TensorRT-LLM's ``KvCacheConfig`` that kvload does not act on.
IGNORED_KV_CACHE_CONFIG: dict[str, str] = {
    **dict.fromkeys((
        "max_attention_window", "sink_token_length", "cross_kv_cache_fraction",
    ), "kvload takes attention windows from the checkpoint config and serves decoder-only models"),
    **dict.fromkeys((
        "disk_cache_size", "disk_cache_path", "secondary_offload_min_priority", "use_uvm", "copy_on_partial_reuse",
        "block_reuse_config", "onboard_blocks",
    ), "memory tier / reuse policy kvload's managers do not have (host tier: host_cache_size)"),
    **dict.fromkeys((
        "kv_events_config", "attention_dp_events_gather_period_ms", "iteration_stats_interval",
        "kv_cache_event_hash_algo",
    ), "KV event publishing: kvload records events in its audit log instead"),
    **dict.fromkeys((
        "enable_kv_pool_rebalance", "kv_pool_rebalance_min_sampled_kv_caches", "kv_pool_rebalance_cooldown_secs",
        "kv_pool_rebalance_target_ratio_update_interval", "kv_pool_rebalance_ratio_threshold",
    ), "V2 pool rebalancing: kvload's V2 pools keep the split they were planned with"),
    **dict.fromkeys((
        "mamba_ssm_cache_dtype", "mamba_ssm_stochastic_rounding", "mamba_ssm_philox_rounds",
        "mamba_state_cache_interval", "mamba_state_config",
    ), "Mamba state cache: kvload serves attention layers only"),
}


def _known(cls: type) -> set[str]:
    return {a.name for a in public_fields(cls)}


def split_ignored(tree: Mapping[str, Any], python: bool = False,
                  vllm_first: bool = False) -> tuple[dict[str, Any], list[tuple[str, Any, str]]]:
    """Take the TensorRT-LLM keys kvload does not act on out of a source's tree.

    Returns the tree kvload validates and ``(dotted path, value, reason)`` for each key taken out.
    ``trust_remote_code`` is reported ignored: kvload never runs code shipped with a checkpoint. A vLLM name
    (``max_model_len``) is refused, with kvload's field to set (written for ``python`` keyword arguments, else for
    YAML). vLLM's engine knobs kvload has no counterpart for (``enforce_eager``) are taken out as TensorRT-LLM's are
    (``pipeline.vllm_compat.vllm_knob``). A name both have (``load_format``, ``tokenizer``) is TensorRT-LLM's unless
    ``vllm_first`` (the command line's vLLM flags, ``LLM(...)`` keywords): then it is reported as vLLM's.
    """
    kept: dict[str, Any] = {}
    ignored: list[tuple[str, Any, str]] = []
    mapped: dict[str, Any] = {}  # kvload's fields a speculative_config sets (vLLM's or TensorRT-LLM's NGram)
    names = _SPECULATIVE_NAMES  # kvload's field → the speculative_config key that set it
    own = _known(LlmArgs)
    nested: dict[str, Any] = {}  # a command-line name a TensorRT-LLM file sets at the top level → its value
    for key, value in tree.items():
        _dashed(key, value, python, vllm_first, own)
        if key in FILE_FLAG_NAMES and key not in own and not python:
            nested[key] = value
        elif key == "trust_remote_code" and key not in own:
            checked_flag(value, lambda why: ConfigError(f"trust_remote_code: {why}", path="trust_remote_code",
                                                        detail="not a bool"), python=python)
            # vLLM scripts pass true habitually; vLLM itself runs its own implementation of the families kvload
            # serves, as kvload runs transformers' built-in one: taken, and nothing from the checkpoint runs
            ignored.append((key, value, "kvload never runs a checkpoint's own code: the families it serves run "
                                        "transformers' built-in classes (a checkpoint that needs its own code is "
                                        "refused when it loads)"))
        elif key == "speculative_config" and key not in own and _trtllm_speculative(value):
            found = trtllm_speculative_config(value)
            if found is None:  # a draft model, EAGLE, MTP, ...: accepted and ignored
                why = f"decoding_type {short(value['decoding_type'])}: kvload drafts by n-gram lookup only " \
                      "(decoding_type: NGram)"
                ignored.append((key, value, f"{_ENGINE}: {why}"))
            else:
                mapped.update(found[0])
                ignored.extend(found[1])
                names = _TRTLLM_SPECULATIVE_NAMES
        elif key == "speculative_config" and key not in own:
            if value is not None:  # vLLM's shape (TensorRT-LLM's has a decoding_type); None: vLLM's unset default
                fields, dropped = speculative_config(value)
                mapped.update(fields)
                ignored.extend(dropped)
        elif vllm_first and isinstance(key, str) and key not in own and (why := vllm_knob(key, value)) is not None:
            if key in SHARED_NO_OP_ONLY:  # the command line's --pp_size (trtllm-serve's) or --pipeline-parallel-size
                ignored.append((key, value, f"a TensorRT-LLM and vLLM option kvload does not act on: {why}"))
            else:
                ignored.append(_vllm_ignored(key, value, why))
        elif key in RETIRED_TRTLLM and key not in own:
            raise ConfigError(f"{key}: {RETIRED_TRTLLM[key]}", path=key, detail="unknown key")
        elif key in REFUSED_TRTLLM and key not in own:
            if value is not None and value is not False:
                raise ConfigError(f"{key}: {REFUSED_TRTLLM[key]}", path=key, detail="not served")
        elif key == "backend" and key not in own and value not in TRTLLM_BACKENDS:
            raise ConfigError(f"backend: expected one of TensorRT-LLM's backends, {', '.join(TRTLLM_BACKENDS)}; got "
                              f"{short(value)}", path=key, detail="not a TensorRT-LLM backend")
        elif key in SHARED_NO_OP_ONLY and key not in own and not vllm_first:
            ignored.append((key, value, f"{_ENGINE}: {_no_op_only(key, value)}"))
        elif key == "reasoning_parser" and key not in own:  # a name kvload does not have is refused, as generate's
            ignored.append((key, reasoning_parser(value, python), REASONING_PARSER_UNUSED))
        elif key in IGNORED_LLM_ARGS and key not in own:
            why = DUMMY_LOAD if key == "load_format" and value in DUMMY_LOAD_FORMATS else IGNORED_LLM_ARGS[key]
            ignored.append((key, value, f"{_ENGINE}: {why}"))
        elif isinstance(key, str) and key not in own and (why := vllm_knob(key, value)) is not None:
            ignored.append(_vllm_ignored(key, value, why))
        elif key == "kv_cache_config" and isinstance(value, Mapping):
            kv_own = _known(KvCacheConfig)
            sub: dict[str, Any] = {}
            for k, v in value.items():
                if k in IGNORED_KV_CACHE_CONFIG and k not in kv_own:
                    ignored.append((f"{key}.{k}", v, f"{_ENGINE}: {IGNORED_KV_CACHE_CONFIG[k]}"))
                else:
                    _near_miss(f"{key}.", k, kv_own, IGNORED_KV_CACHE_CONFIG)
                    sub[k] = v
            kept[key] = sub
        else:
            vllm = refused_key(key, value, python) if isinstance(key, str) and key not in own else None
            if vllm is not None:
                raise ConfigError(f"{key}: {vllm}", path=key, detail=vllm)
            placed = misplaced_key(key, value, python) if isinstance(key, str) and key not in own else None
            if placed is not None:
                raise ConfigError(f"{key}: {placed}", path=key, detail="unknown key")
            _near_miss("", key, own, IGNORED_LLM_ARGS)
            kept[key] = value
    for key, value in nested.items():
        _set_nested(kept, key, value)
    for field, value in mapped.items():  # a speculative_config beside kvload's own names: they must agree
        # numpy's and torch's integers as Python's, as the fields take them: np.int64(2) and 2 agree (True and 1 not)
        given, value = plain_scalar(tree.get(field)), plain_scalar(value)
        if field in tree and not (given == value and type(given) is type(value)):
            whose = "vLLM's" if names is _SPECULATIVE_NAMES else "TensorRT-LLM's"
            same = names[field] == field
            also = "" if same else f" ({names[field]} is {whose} name for {field})"
            raise ConfigError(f"speculative_config: its {names[field]} {short(value)} and "
                              f"{'the top-level ' if same else ''}{field} {short(tree[field])} set one field{also} "
                              "to different values; give one",
                              path="speculative_config", detail="given under two names")
        kept[field] = value
    return kept, ignored


def _dashed(key: Any, value: Any, python: bool, vllm_first: bool, own: set[str]) -> None:
    """Refuse a dashed key whose underscored spelling kvload knows (vLLM's config files spell keys as its flags,
    ``max-num-seqs``) with that spelling and what kvload says of it: difflib offered ``max_num_tokens`` for
    ``max-num-seqs``, another setting, and ``block-size`` got the whole list of keys. Any other key: nothing."""
    if not isinstance(key, str) or "-" not in key or key in own:
        return
    under = key.replace("-", "_")
    lead = f"{key}: {'a keyword is spelled' if python else 'a config file spells its keys'} with underscores"
    try:
        _, ignored = split_ignored({under: value}, python, vllm_first)
    except ConfigError as exc:
        if "unknown key" in str(exc):  # no name kvload knows either way: the usual message, for the key as given
            return
        raise ConfigError(f"{lead} ({under}); {exc}", path=key, detail="unknown key") from None
    if ignored:
        why = ignored[0][2].split(":")[0]
        said = f"{under} is taken ({why}, said setting_ignored)"
    elif under in own:  # a mapping (kv_cache_config) is no value to write out on one line
        said = f"write it as {under}" if isinstance(value, Mapping | list) else write_as(under, value, python)
    else:
        return
    raise ConfigError(f"{lead}; {said}", path=key, detail="unknown key")


def _no_op_only(key: str, value: Any) -> str:
    """Why TensorRT-LLM's ``key`` (one of :data:`SHARED_NO_OP_ONLY`) at ``value`` asks for nothing kvload lacks;
    ``ConfigError`` naming the key and the value accepted for any other value."""
    accepted, why = NO_OP_ONLY[key]
    if not any(value == a and type(value) is type(a) for a in accepted):
        shown = " or ".join(repr(a) for a in accepted)
        raise ConfigError(f"{key}: TensorRT-LLM's setting; {why}; accepted: {shown}, got {short(value)}", path=key,
                          detail=why)
    return f"{why} ({short(value)} asks for nothing else)"


def _vllm_ignored(key: str, value: Any, why: str) -> tuple[str, Any, str]:
    """A vLLM knob's ``setting_ignored`` entry, a secret's value hidden."""
    shown = "(hidden)" if key in SECRET_KNOBS and value is not None else value
    return key, shown, f"a vLLM option kvload does not act on: {why}"


#: kvload's field → the ``speculative_config`` key of vLLM's that sets it
_SPECULATIVE_NAMES = {"max_draft_len": "num_speculative_tokens", "max_matching_ngram_size": "prompt_lookup_max",
                      "speculation_max_batch_size": "disable_by_batch_size"}


def _trtllm_speculative(value: Any) -> bool:
    """Whether a ``speculative_config`` is TensorRT-LLM's (``decoding_type: NGram``, ``Eagle``, ...) rather than
    vLLM's (``method``)."""
    return isinstance(value, Mapping) and "decoding_type" in value


#: kvload's field → the key of TensorRT-LLM's ``NGramDecodingConfig`` that sets it
_TRTLLM_SPECULATIVE_NAMES = {"max_draft_len": "max_draft_len", "max_matching_ngram_size": "max_matching_ngram_size",
                             "speculation_max_batch_size": "max_concurrency"}
#: TensorRT-LLM's ``NGramDecodingConfig`` switches (default true) → why kvload does not do what true asks; false is
#: what kvload's n-gram index does (``engine/speculation.py``)
_TRTLLM_NGRAM_SWITCHES: dict[str, str] = {
    "is_keep_all": "kvload keeps one match per n-gram, its latest occurrence",
    "is_use_oldest": "kvload drafts from the latest earlier occurrence of the n-gram",
    "is_public_pool": "kvload's n-gram index is each request's own (its prompt and output)",
}
#: keys of TensorRT-LLM's ``DecodingBaseConfig`` kvload's n-gram drafts have no counterpart for → why
_TRTLLM_NGRAM_IGNORED: dict[str, str] = {
    **dict.fromkeys(("speculative_model", "speculative_model_dir", "load_format"),
                    "a draft model's setting: n-gram drafts run no draft model"),
    "draft_len_schedule": "kvload drafts max_draft_len tokens while at most max_concurrency requests run "
                          "(speculation_max_batch_size), none beyond",
    **dict.fromkeys(("acceptance_window", "acceptance_length_threshold"),
                    "kvload keeps drafting whatever the acceptance (its audit log and metrics count drafts and "
                    "acceptances)"),
    "use_rejection_sampling": "kvload verifies a sampled request's drafts by drawing each token from the request's "
                              "own distribution, a seed giving the same tokens with drafts on or off",
    "allow_advanced_sampling": "a no-op in TensorRT-LLM too: kvload drafts for greedy and sampled requests alike",
}


def trtllm_speculative_config(value: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, Any, str]]] | None:
    """TensorRT-LLM's ``speculative_config`` with ``decoding_type: NGram`` (``NGramDecodingConfig``) as kvload's
    n-gram fields, and ``(dotted key, value, why)`` for each key given that kvload cannot honour; None for another
    decoding type (a draft model, EAGLE, MTP, ...), which kvload does not run.

    ``max_draft_len`` (required, as TensorRT-LLM requires it) and ``max_matching_ngram_size`` are kvload's fields of
    the same names, ``max_concurrency`` is ``speculation_max_batch_size``; a key ``NGramDecodingConfig`` does not have
    is ``ConfigError`` naming it, as TensorRT-LLM's strict model refuses it."""
    where = "speculative_config"
    kind = value.get("decoding_type")
    if not (isinstance(kind, str) and kind.lower() == "ngram"):
        return None
    known = {"decoding_type", "max_draft_len", "max_matching_ngram_size", "max_concurrency", "max_total_draft_tokens",
             *_TRTLLM_NGRAM_SWITCHES, *_TRTLLM_NGRAM_IGNORED}
    spec_keys(value, known, "not a key of TensorRT-LLM's NGramDecodingConfig; its keys: decoding_type, max_draft_len, "
              "max_matching_ngram_size, max_concurrency, is_keep_all, is_use_oldest, is_public_pool, ...")
    drafts = spec_int(value, "max_draft_len", 1, MAX_DRAFT_LEN,
                      required="decoding_type NGram (the draft tokens per step)")
    fields: dict[str, Any] = {"max_draft_len": drafts}
    size = spec_int(value, "max_matching_ngram_size", 1, MAX_NGRAM)
    if size is not None:  # absent: TensorRT-LLM's default, 2, is kvload's too
        fields["max_matching_ngram_size"] = size
    batch = spec_int(value, "max_concurrency", 1, None)
    if batch is not None:  # absent: TensorRT-LLM drafts at any batch size; kvload's default (1) stands
        fields["speculation_max_batch_size"] = batch
    ignored: list[tuple[str, Any, str]] = []
    total = value.get("max_total_draft_tokens")
    if total is not None and total != drafts:
        ignored.append((f"{where}.max_total_draft_tokens", total, "kvload drafts one chain of max_draft_len tokens "
                                                                  "(no draft tree)"))
    for key, why in _TRTLLM_NGRAM_SWITCHES.items():
        given = plain_flag(value.get(key))
        if given is not None and not isinstance(given, bool):
            raise ConfigError(f"{where}: {key}: expected true or false, got {short(given)}", path=where,
                              detail="not a bool")
        if given:
            ignored.append((f"{where}.{key}", given, why))
    for key, why in _TRTLLM_NGRAM_IGNORED.items():
        if value.get(key) is not None:
            ignored.append((f"{where}.{key}", value[key], why))
    return fields, ignored


#: The command line's names (trtllm-serve's flags) for fields whose key is spelled otherwise.
FLAG_NAMES: dict[str, str] = {
    "tp_size": "tensor_parallel_size",
    "kv_cache_free_gpu_memory_fraction": "kv_cache_config.free_gpu_memory_fraction",
}


#: The command line's names a TensorRT-LLM options file may set at the top level, as trtllm-serve's ``--config`` merges
#: them (NVIDIA's curated ``examples/configs/curated/qwen3.yaml``, ``deepseek-r1-throughput.yaml`` and
#: ``gpt-oss-120b-latency.yaml`` carry ``kv_cache_free_gpu_memory_fraction: 0.8``) → the nested field each sets. A
#: Python keyword of that name is still refused (:func:`misplaced_key`): ``LLM(...)`` takes ``LlmArgs`` fields only.
FILE_FLAG_NAMES: dict[str, str] = {
    "kv_cache_free_gpu_memory_fraction": "kv_cache_config.free_gpu_memory_fraction",
}


def _set_nested(kept: dict[str, Any], key: str, value: Any) -> None:
    """Set ``FILE_FLAG_NAMES[key]`` in the tree kvload validates; a file that also gives the nested field a different
    value is ``ConfigError`` naming both (one setting under two names)."""
    parent, leaf = FILE_FLAG_NAMES[key].split(".")
    sub = kept.get(parent)
    if sub is None:
        sub = kept[parent] = {}
    if not isinstance(sub, dict):  # not a mapping: the converter refuses kv_cache_config itself, in its own words
        return
    if leaf in sub:
        given, mine = plain_scalar(sub[leaf]), plain_scalar(value)
        if not (given == mine and type(given) is type(mine)):
            raise ConfigError(f"{key}: {short(value)} and {FILE_FLAG_NAMES[key]} {short(sub[leaf])} set one field "
                              f"({key} is the command line's name for {FILE_FLAG_NAMES[key]}) to different values; "
                              "give one", path=key, detail="given under two names")
    sub[leaf] = value


def misplaced_key(key: str, value: Any, python: bool) -> str | None:
    """Where a top-level key that is not an ``LlmArgs`` field belongs, when it is a ``KvCacheConfig`` field
    (``max_tokens``: difflib offered ``max_num_tokens``, another setting) or a command-line flag's name (``tp_size``:
    it offered ``max_batch_size``); None for any other key."""
    if key in FLAG_NAMES:
        return f"the command line's name for {FLAG_NAMES[key]}; {write_as(FLAG_NAMES[key], value, python)}"
    if key in _known(KvCacheConfig):
        return f"a kv_cache_config field, not a top-level one; {write_as('kv_cache_config.' + key, value, python)}"
    return None


def _near_miss(prefix: str, key: Any, own: set[str], ignored: Mapping[str, str]) -> None:
    """A mistyped TensorRT-LLM key gets a suggestion of that key (the converter suggests kvload's own)."""
    if not isinstance(key, str) or key in own:
        return
    known = own | set(ignored)
    close = close_names(key, known)
    theirs = [repr(name) for name in close if name in ignored]
    if not theirs:
        return
    if len(theirs) < len(close):  # --cuda_graph: some of the names it begins are kvload's own
        note = f"{' and '.join(theirs)}: TensorRT-LLM option{'s' if len(theirs) > 1 else ''} kvload accepts and ignores"
    else:
        note = "TensorRT-LLM options kvload accepts and ignores" if len(theirs) > 1 else \
            "a TensorRT-LLM option kvload accepts and ignores"
    raise ConfigError(f"{prefix}{key}: unknown key{did_you_mean(key, known)} ({note})", path=prefix + key,
                      detail="unknown key")
