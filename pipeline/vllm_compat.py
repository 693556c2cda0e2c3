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
the task (``quantization``, ``hf_overrides``, ``cpu_offload_gb``, ``task``) are accepted only at their no-op value.

Checked against vLLM's engine arguments (``vllm/engine/arg_utils.py``, ``vllm/config/cache.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pipeline.config import LlmArgs, describe
from pipeline.converter import structure
from pipeline.errors import ConfigError
from pipeline.limits import short
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
}


#: vLLM's engine knobs (``LLM(...)`` keywords, YAML keys) kvload has no counterpart for → why: ``setting_ignored``.
IGNORED: dict[str, str] = {
    **dict.fromkeys(("enforce_eager", "max_seq_len_to_capture", "cuda_graph_sizes", "compilation_config"),
                    "CUDA graphs / torch.compile: kvload runs the forward eagerly"),
    **dict.fromkeys(("disable_custom_all_reduce", "distributed_executor_backend"),
                    "multi-GPU plumbing: kvload's ranks are torchrun processes over torch.distributed"),
    **dict.fromkeys(("disable_log_stats", "disable_async_output_proc", "async_scheduling"),
                    "engine statistics / output processing: kvload records events in its audit log (log=False keeps "
                    "them off stderr) and has LLM.get_metrics()"),
    "enable_sleep_mode": "kvload.LLM has no sleep/wake_up; close() releases the pools and weights",
    "download_dir": "kvload never downloads from a model hub (local directories, presets, smollm2-135m)",
    "max_logprobs": "kvload's bound is fixed: at most 20 logprobs per token (pipeline.limits.MAX_LOGPROBS)",
    "hf_token": "kvload never downloads from a model hub: it reads local directories and the local Hugging Face cache",
    **dict.fromkeys(("max_lora_rank", "max_loras", "max_cpu_loras"),
                    "LoRA adapters: kvload runs the base weights (a lora_request is refused)"),
    **dict.fromkeys(("limit_mm_per_prompt", "mm_processor_kwargs"),
                    "multimodal inputs: kvload serves text-only models (a prompt's multi_modal_data is refused)"),
    "enable_expert_parallel": "MoE expert parallelism: kvload parallelizes by tensor parallel only "
                              "(tensor_parallel_size)",
    **dict.fromkeys(("use_v2_block_manager", "num_scheduler_steps", "max_parallel_loading_workers"),
                    "an older vLLM engine's knob: kvload's KV cache manager and scheduler are chosen by the route "
                    "(kv_cache_config.use_kv_cache_manager_v2) and step one token at a time"),
    "preemption_mode": "kvload's managers choose: V1 recomputes a preempted request, V2 suspends it to the host tier "
                       "or recomputes it (kv_cache_config.host_cache_size)",
}

#: vLLM knobs whose value is a secret: recorded as hidden, never as given (the log, the audit).
SECRET_KNOBS = frozenset({"hf_token"})

#: vLLM's knobs whose only value kvload can honour is their no-op one → (the accepted values, why others are refused).
NO_OP_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "quantization": ((None,), "kvload runs the checkpoint's weights in dtype, unquantized"),
    "cpu_offload_gb": ((0, 0.0), "kvload keeps every weight on the device"),
    "hf_overrides": ((None, {}), "kvload reads the checkpoint's config.json as it is"),
    "task": (("auto", "generate"), "kvload generates text (no pooling, embedding or scoring models)"),
    "runner": (("auto", "generate"), "kvload generates text (no pooling, embedding or scoring models)"),
    "data_parallel_size": ((1,), "kvload runs one engine per process (start one kvload serve per replica)"),
    "pipeline_parallel_size": ((1,), "kvload splits a model by tensor parallel only (tensor_parallel_size)"),
    "logprobs_mode": (("raw_logprobs",), "kvload's logprobs are the model's raw distribution, before temperature "
                                         "and the penalties (vLLM's default, raw_logprobs)"),
}


def vllm_knob(name: str, value: Any) -> str | None:
    """Why vLLM's engine knob ``name`` does nothing in kvload (reported as ``setting_ignored``), or None for a name
    that is not one; ``ConfigError`` for a knob given a value kvload cannot honour (``quantization="awq"``)."""
    if name in IGNORED:
        return IGNORED[name]
    entry = NO_OP_ONLY.get(name)
    if entry is None:
        return None
    accepted, why = entry
    if not any(value == a and type(value) is type(a) for a in accepted):
        shown = " or ".join(repr(a) for a in accepted)
        raise ConfigError(f"{name}: vLLM's setting; {why}; accepted: {shown}, got {short(value)}", path=name,
                          detail=why)
    return f"{why} ({short(value)} asks for nothing else)"


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
        return different_meaning(name, lambda p: p)
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
