"""Stage 4: give every field that began as ``"auto"`` a concrete value, and say why."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from models.spec import describe_rope
from pipeline.bus import Emit
from pipeline.config import (
    ARENA_FIELD,
    AUTO,
    GENERATION_CONFIG_NONE,
    MODEL_DTYPES,
    V2_FIELD,
    normalize_dtype,
    set_field,
)
from pipeline.context import AutoOrigin, Context
from pipeline.errors import ConfigError
from pipeline.events import AutoResolved, FieldDerived, MaxSeqLenBeyondPositions
from pipeline.paths import get_in

V2 = V2_FIELD


def gpu_driver_present() -> bool:
    """Whether this machine has an NVIDIA or ROCm device node (a GPU torch might use)."""
    import os

    nodes = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")
    return any(os.path.exists(p) for p in nodes)


def _no_gpu_driver() -> bool:
    """True when this machine certainly has no GPU torch could use, and torch is not imported yet.

    Lets ``device: auto`` resolve to cpu without importing torch (seconds) on a machine without a GPU.
    """
    if "torch" in sys.modules:
        return False  # already paid for: ask torch itself
    return not gpu_driver_present()


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (False when torch is missing, or no GPU driver is there)."""
    if _no_gpu_driver():
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve_attention_backend(device: str, layer_kinds: set[str] | None = None) -> tuple[str, str, str]:
    """``"auto"`` attention, as measured: on CPU decode steps on the CPU paged decode kernel where it can run, gather +
    SDPA otherwise (no torch import)."""
    if device.startswith("cuda"):
        return "sdpa", "auto", ("on an H200 (BENCHMARKS.md, \"GPU check\") generate ran at 0.77-0.85x of "
                                "model.generate on gather + SDPA and 0.65-0.71x on the compiled FlexAttention, "
                                "whose kernel is no faster than the gather at batch 32 and 5x slower at batch 1; "
                                "\"flex\" still selects it")
    from cache_backends.layout import DECODE_KERNEL_KINDS

    if layer_kinds is not None and not layer_kinds & DECODE_KERNEL_KINDS:
        mla = " (MLA attends in the absorbed form on gather + SDPA)" if "mla" in layer_kinds else ""
        return "sdpa", "auto", (f"the model's attention layers are {', '.join(sorted(layer_kinds))}; the CPU paged "
                                f"decode kernel serves full and sliding-window layers{mla}")
    missing = _no_compiler("CPU paged decode kernel")
    if missing is not None:
        return "sdpa", "auto", f"{missing}; gather + SDPA needs none"
    return "cpu_kernel", "auto", ("on CPU the paged decode kernel reads each sequence's pages in place where gather + "
                                  "SDPA copies them first: 0.9-1.8x contiguous SDPA per decode layer with the step's "
                                  "plan against 0.2-0.6x, 1.2-8x gather + SDPA for the decode rows of a mixed step "
                                  "(BENCHMARKS.md, \"The CPU paged decode kernel, round 2\"); built once per machine "
                                  "with the C compiler, prefill chunks stay on gather + SDPA")


def _no_compiler(kernel: str) -> str | None:
    """Why ``"auto"`` cannot pick a kvload C kernel here (no C compiler to build it with), or None."""
    from cache_backends.cpu_kernel_build import compiler

    if compiler() is not None:
        return None
    return f"no C compiler here to build the {kernel} with (set $CC, or install gcc, for \"cpu_kernel\")"


def resolve_linear_backend(device: str, dtype: str, tensor_parallel_size: int = 1) -> tuple[str, str, str]:
    """``"auto"`` projections, as measured: on CPU in float32 the small-batch kernel where a compiler can build it,
    torch's ``F.linear`` otherwise (no torch import)."""
    if device.startswith("cuda"):
        return "torch", "auto", "on CUDA the projections run on cuBLAS; the small-batch kernel is for CPUs"
    if tensor_parallel_size > 1:
        return "torch", "auto", (f"tensor_parallel_size={tensor_parallel_size}: the weights are sharded as DTensors, "
                                 "which the small-batch kernel does not read")
    if dtype != "float32":
        return "torch", "auto", f"the small-batch kernel multiplies float32 weights; the model is {dtype}"
    missing = _no_compiler("CPU small-batch linear kernel")
    if missing is not None:
        return "torch", "auto", missing
    return "cpu_kernel", "auto", ("on CPU, steps of a few rows (decode) multiply on a kernel that reads each weight "
                                  "once for all rows: 0.5-0.65x torch's time at 4-12 rows, 0.8-0.95x at 16-32, "
                                  "0.97x at 1-2 (AVX-512; BENCHMARKS.md, \"Small-batch projections on CPU\"); built "
                                  "once per machine with the C compiler; larger steps, and builds without AVX2, stay "
                                  "on torch")


def resolve_generation_config(found: Any, model: str) -> tuple[str, str, str]:
    """``"auto"`` sampling defaults: the directory whose generation_config.json ``apply_model_defaults`` read (its
    ``sampling_defaults_resolved`` has the values), or ``"vllm"`` (kvload's built-in defaults) when it had none."""
    if found is not None and found.path is not None:
        from pipeline.generation_config import FROM_DO_SAMPLE, FROM_FILE

        # an empty describe() read "gives no sampling default applies from it"; do_sample alone gives a temperature
        derived = found.describe(FROM_DO_SAMPLE)
        gives = ", ".join(v for v in (found.describe(FROM_FILE), derived and f"{derived} through its do_sample") if v)
        said = (f"gives {gives}; sampling_defaults_resolved has the rest" if gives else
                "holds no sampling default kvload applies; sampling_defaults_resolved lists its keys")
        return str(Path(found.path).parent), "checkpoint", f"the checkpoint's generation_config.json {said}"
    return GENERATION_CONFIG_NONE, "auto", (f"{model} has no generation_config.json: kvload's built-in sampling "
                                            f"defaults (\"{GENERATION_CONFIG_NONE}\")")


class ResolveAuto:
    """Resolves ``device``, ``dtype``, ``kv_cache_config.dtype``, ``use_kv_cache_manager_v2``,
    ``attention_backend``, ``linear_backend``, ``generation_config`` and (once ``max_seq_len`` is derived)
    ``kv_cache_config.pool_arena``, in that order.

    ``auto_resolved`` fires for every field captured as ``"auto"`` by the snapshot, also when a
    model default already replaced the value: then ``old`` is the model's value and the reason says so.
    """

    name = "resolve_auto"
    error = ConfigError

    def run(self, ctx: Context, emit: Emit) -> None:
        """Resolve in dependency order (the dtype rule needs the device, the KV dtype needs the dtype)."""
        for path in ("device", "dtype", "kv_cache_config.dtype", V2, "attention_backend", "linear_backend",
                     "generation_config"):
            self._resolve(ctx, emit, path)
        self._derive_max_seq_len(ctx, emit)
        self._warn_past_positions(ctx, emit)
        self._resolve(ctx, emit, ARENA_FIELD)  # weighs the budget against max_seq_len: after it is derived

    def _resolve(self, ctx: Context, emit: Emit, path: str) -> None:
        origin = ctx.auto_originals.get(path)
        if origin is None:
            return
        old = get_in(ctx.args, path)
        new, source, reason = self._decide(ctx, path, old, origin)
        if new != old:
            set_field(ctx.args, path, new)
        emit(AutoResolved(field=path, original=AUTO, old=old, new=get_in(ctx.args, path), source=source,
                          reason=reason))

    def _decide(self, ctx: Context, path: str, current: Any, origin: AutoOrigin) -> tuple[Any, str, str]:
        spec_name = ctx.spec.name if ctx.spec is not None else "the model"
        if current != AUTO:  # a model default got here first; keep it and say so
            return current, "model_default", f"{spec_name} set it through its model defaults"
        proposed = ctx.model_defaults.get(path)
        if proposed is not None:  # an explicit "auto" kept the model default out: it lets the model decide, as unset
            return proposed, "model_default", (f"{spec_name} proposes {str(proposed).lower()} in its model defaults; "
                                               f"the explicit \"auto\" (via {origin.source}) lets the model decide")
        if path == "device":
            if cuda_available():
                return "cuda", "auto", "a CUDA device is available"
            return "cpu", "auto", "no CUDA device is available"
        if path == "dtype":
            declared = ctx.spec.checkpoint_dtype() if ctx.spec is not None else None
            if declared is not None and normalize_dtype(declared) in MODEL_DTYPES:
                return normalize_dtype(declared), "checkpoint", f"the checkpoint declares dtype {declared}"
            # A declared dtype kvload cannot run a model in (float64, int4, float8: a KV cache dtype only) is named,
            # not passed on to fail as if the user had set it, nor reported as no dtype at all.
            why = ("the checkpoint declares no dtype" if declared is None else
                   f"the checkpoint declares dtype {declared}, which kvload does not run models in "
                   f"({', '.join(MODEL_DTYPES)})")
            if str(ctx.args.device).startswith("cuda"):
                return "bfloat16", "auto", f"{why}; bfloat16 on CUDA"
            return "float32", "auto", f"{why}; float32 on CPU"
        if path == "kv_cache_config.dtype":
            return ctx.args.dtype, "auto", f"follows the model dtype ({ctx.args.dtype})"
        if path == V2:
            return False, "auto", f"{spec_name} proposes no V2 default, so \"auto\" means false"
        if path == "attention_backend":
            kinds = {layer.kind for layer in ctx.spec.kv_layers()} if ctx.spec is not None else None
            return resolve_attention_backend(str(ctx.args.device), kinds)
        if path == "linear_backend":
            return resolve_linear_backend(str(ctx.args.device), str(ctx.args.dtype), ctx.args.tensor_parallel_size)
        if path == "generation_config":
            return resolve_generation_config(ctx.sampling_defaults, ctx.model.name if ctx.model else "the model")
        if path == ARENA_FIELD:
            from stages.arena_choice import resolve_pool_arena

            return resolve_pool_arena(ctx)
        raise AssertionError(f"no rule resolves {path}")

    @staticmethod
    def _derive_max_seq_len(ctx: Context, emit: Emit) -> None:
        current = ctx.args.max_seq_len
        auto = "max_seq_len" in ctx.auto_originals
        if auto and current != AUTO:  # a model default got here first; keep it and say so
            spec_name = ctx.spec.name if ctx.spec is not None else "the model"
            emit(AutoResolved(field="max_seq_len", original=AUTO, old=current, new=current, source="model_default",
                              reason=f"{spec_name} set it through its model defaults"))
            return
        if current is not None and not auto:
            return
        proposed = ctx.model_defaults.get("max_seq_len") if auto else None
        if proposed is not None:  # an explicit "auto" kept the model default out: it lets the model decide, as unset
            spec_name = ctx.spec.name if ctx.spec is not None else "the model"
            new, source = proposed, "model_default"
            reason = (f"{spec_name} proposes {proposed} in its model defaults; the explicit \"auto\" lets the model "
                      "decide")
        else:
            new = ctx.spec.max_position_embeddings() if ctx.spec is not None else None
            if new is None:
                why = "auto (vLLM's max_model_len -1) starts from it" if auto else "set max_seq_len"
                raise ConfigError(f"max_seq_len: the checkpoint declares no max_position_embeddings; {why}; set "
                                  "max_seq_len to a number", path="max_seq_len")
            source, reason = "checkpoint", f"the checkpoint's max_position_embeddings {new}"
        set_field(ctx.args, "max_seq_len", new)
        if auto:
            ctx.fit_max_seq_len = True
            emit(AutoResolved(field="max_seq_len", original=AUTO, old=AUTO, new=new, source=source,
                              reason=f"{reason}, lowered by the KV plan to the longest sequence its budget holds when "
                                     "that is less (vLLM's max_model_len -1/auto)"))
            return
        emit(FieldDerived(field="max_seq_len", old=None, new=new, source="checkpoint",
                          reason="null takes the checkpoint's max_position_embeddings"))

    @staticmethod
    def _warn_past_positions(ctx: Context, emit: Emit) -> None:
        """``max_seq_len_beyond_positions`` when the user asked for more positions than the checkpoint declares.

        Only a value the user set: a derived one equals the limit, and a model default is the model's own word.
        """
        user = ctx.user_fields.get("max_seq_len")
        limit = ctx.spec.max_position_embeddings() if ctx.spec is not None else None
        n = ctx.args.max_seq_len
        if user is None or user.value == AUTO or limit is None or n is None or n <= limit:
            return  # an explicit "auto" is a model default's length, or one within the limit
        rope = ctx.spec.rope_scaling()
        checkpoint = ctx.checkpoint
        config = checkpoint.gguf_path or checkpoint.path / "config.json"
        flag = " (--max_seq_len)" if user.source == "cli" else ""
        if rope is None:
            why = (f"the config declares no rope scaling, so positions past {limit} are ones the model was never "
                   f"trained on and its output there degrades; lower max_seq_len{flag} to {limit} unless the "
                   "model's context was extended another way")
        else:
            why = (f"the config declares rope scaling ({describe_rope(rope)}), which may extend the context past "
                   f"max_position_embeddings or may already be counted in it; check the model's documented "
                   f"context length, else lower max_seq_len{flag} to {limit}")
        emit(MaxSeqLenBeyondPositions(
            field="max_seq_len", max_seq_len=n, source=user.source, max_position_embeddings=limit,
            model=checkpoint.name, config=str(config), rope_scaling=rope,
            reason=f"max_seq_len {n} (set via {user.source}) is longer than the checkpoint's "
                   f"max_position_embeddings {limit}; kept as set: {why}",
        ))

