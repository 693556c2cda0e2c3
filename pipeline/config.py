"""Configuration classes: what a user can ask for, with TensorRT-LLM's names and defaults.

Values are checked strictly where they are set (construction and assignment), so the same rules
hold for the Python API, YAML and the CLI. Every instance remembers which fields were passed or
assigned explicitly: explicitness is recorded, never inferred by comparing with defaults.
"""

from __future__ import annotations

import decimal
import fractions
import functools
import math
import re
from typing import Any, Literal, NewType, Union

import attrs

from cache_backends.layout import DTYPE_SIZES
from cache_backends.request import SCHEDULING_POLICY_NAMES
from pipeline.errors import ConfigError, did_you_mean
from pipeline.limits import (
    MAX_DRAFT_LEN,
    MAX_INT,
    MAX_NGRAM,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    plain_value,
    short,
)

AUTO = "auto"

#: ``true | false | "auto"``; after ``resolve_auto`` only ``True``/``False`` remain.
TriState = Union[bool, Literal["auto"]]  # noqa: UP007  (cattrs matches this exact Union object)
#: A byte count; the text layers (YAML, CLI) also accept sizes such as ``"8GiB"``.
Bytes = NewType("Bytes", int)
#: ``"auto"`` or a dtype name from :data:`DTYPE_BYTES` (aliases such as ``bf16`` are normalised).
DTypeName = NewType("DTypeName", str)
#: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
DeviceName = NewType("DeviceName", str)
#: A sequence length in tokens, or ``"auto"`` (``max_seq_len``; after the KV plan only the integer remains).
SeqLen = NewType("SeqLen", int)

#: Bytes per element of each dtype name kvload accepts: the KV library's own table (one table, one truth).
DTYPE_BYTES: dict[str, int] = DTYPE_SIZES
DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",  # vLLM's --kv-cache-dtype names
    "fp8_e5m2": "float8_e5m2",
}


class FieldError(ConfigError):
    """A value rejected for one field; the converter prefixes the dotted path of its parents."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}", path=field, detail=message)
        self.field = field


class UnknownFieldError(FieldError, TypeError):
    """A keyword a config class does not have (``KvCacheConfig(tokens_per_blok=64)``): refused as the dict, YAML and
    CLI layers refuse an unknown key, with the closest field suggested; still a ``TypeError``, as Python's own was."""


def describe(value: Any) -> str:
    """Show a rejected value the way the user typed it (strings quoted, None as null)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return short(value)


def normalize_dtype(value: str) -> str:
    """Map a dtype alias to its canonical name (``bf16`` → ``bfloat16``); other names are kept."""
    return DTYPE_ALIASES.get(value, value)


#: One convention for byte counts (README "Memory sizes"): SI suffixes (kB, MB, GB, TB) are powers of
#: 1000, IEC suffixes (KiB, MiB, GiB, TiB) powers of 1024, and a bare letter (K, M, G, T) is binary,
#: as vLLM reads it: ``8G`` = ``8GiB``. Case does not matter.
_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
    "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4,
}
#: How a byte count may be written, for help texts and error messages.
SIZE_HELP = ("a byte count, in whole bytes, such as 8589934592, 8GiB (= 8G = 8*2**30), 8GB (= 8*10**9) or "
             "1.5KiB (= 1536)")


def byte_count(value: Any, field: attrs.Attribute) -> Any:
    """A ``Bytes`` field's converter: a size string (``"8GiB"``) as its bytes; a float refused saying why (YAML reads
    ``1e9`` as one); anything else left to the field's check. One rule for the class and the dict / YAML / CLI doors,
    whose messages differed (``KvCacheConfig(max_gpu_total_bytes="8GiB")`` was refused as "an integer >= 0")."""
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError:
            raise FieldError(field.name, f"expected a byte count such as 8589934592 or '8GiB', got "
                                         f"{describe(value)}") from None
    if isinstance(value, float) and math.isfinite(value) and 0 <= value <= MAX_INT:
        # "expected an integer >= 0, got 1000000000.0" named neither the string forms nor why; a float is not
        # converted (1.5e16's digits past 2**53 are already gone)
        why = (f"YAML reads a number with an exponent or a decimal point as a float: write {int(value)}, or quote "
               "it" if value.is_integer() else "a byte count is whole bytes")
        raise FieldError(field.name, f"expected a byte count such as 8589934592 or '8GiB', got the float "
                                     f"{describe(value)}; {why}")
    return value


_BYTES = attrs.Converter(byte_count, takes_field=True)


def parse_size(text: str) -> int:
    """Parse ``"8GiB"``, ``"8G"`` (GiB), ``"512MB"``, ``"1e9"`` or ``"4096"`` into bytes; ``ValueError`` otherwise."""
    s = text.strip().lower()
    # an underscore only between two digits, as int() and a YAML number take them: every one was dropped first, so
    # "_8GiB" and "8__GiB" were 8 GiB (Decimal() takes those too)
    if re.search(r"(?<![0-9])_|_(?![0-9])", s):
        raise ValueError(text)
    s = s.replace("_", "")
    if not s.isascii():  # Decimal() reads any script's digits ('٣GiB'); the integer flags take 0-9 only
        raise ValueError(text)
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):].strip()
    if unit not in _SIZE_UNITS or not num:
        raise ValueError(text)
    if len(num) > 40:  # int("9" * 5000) raises past 4300 digits, float() overflows to inf
        raise ValueError(text)
    try:  # exactly: float rounded 2**63 - 1, took 1e-400GiB as 0 (no cap) and 1.0000000000000000001KiB as 1024
        exact = decimal.Decimal(num)
    except decimal.InvalidOperation:
        raise ValueError(text) from None
    # a bounded exponent first: 1e999999999 is a short text for a number no one could store (nor compute with)
    if not exact.is_finite() or (exact and not -40 <= exact.adjusted() <= 40):
        raise ValueError(text)
    value = fractions.Fraction(exact) * _SIZE_UNITS[unit]
    if value.denominator != 1 or value < 0 or value > MAX_INT:  # whole bytes only
        raise ValueError(text)
    return int(value)


# --- validators: strict on type first, then range -------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(pred, expected: str):
    def validator(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        try:
            ok = bool(pred(value))
        except Exception:  # a numpy array's == is elementwise (its truth ambiguous); a user's own __eq__ may raise:
            ok = False  # neither is a value of the field (the message named no field: "LlmArgs: The truth value...")
        if not ok:
            raise FieldError(attribute.name, f"expected {expected}, got {describe(value)}")
        if _is_int(value) and value > MAX_INT:  # past int64: torch and the budget arithmetic cannot take it
            raise FieldError(attribute.name, f"expected {expected} and at most 2**63 - 1, got {describe(value)}")

    validator.expected = expected  # type: ignore[attr-defined]  # shown by `kvload models` and errors
    return validator


def field_check(pred: Any, expected: str) -> Any:
    """An attrs validator for config classes outside this module: ``pred(value)``, else one ``FieldError`` naming the
    field and ``expected`` (the converter prefixes its parents' path)."""
    return _check(pred, expected)


strict_bool = _check(lambda v: isinstance(v, bool), "true or false")
tri_state = _check(lambda v: v is True or v is False or v == AUTO, 'true, false or "auto"')
pos_int = _check(lambda v: _is_int(v) and v >= 1, "an integer >= 1")
non_neg_int = _check(lambda v: _is_int(v) and v >= 0, "an integer >= 0")
opt_pos_int = _check(lambda v: v is None or (_is_int(v) and v >= 1), "an integer >= 1 or null")
opt_non_neg_int = _check(lambda v: v is None or (_is_int(v) and v >= 0), "an integer >= 0 or null")
#: max_seq_len: "auto" is vLLM's max_model_len -1/auto, the longest one sequence the KV budget holds (at most the
#: checkpoint's)
seq_len = _check(lambda v: v is None or v == AUTO or (_is_int(v) and v >= 1), 'an integer >= 1, "auto" or null')
draft_len = _check(lambda v: _is_int(v) and 0 <= v <= MAX_DRAFT_LEN, f"an integer from 0 to {MAX_DRAFT_LEN}")
ngram_size = _check(lambda v: _is_int(v) and 1 <= v <= MAX_NGRAM, f"an integer from 1 to {MAX_NGRAM}")
fraction = _check(
    lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1, "a number in (0, 1]"
)
#: kv_cache_config.max_page_padding: 0 (gcd pages, the default) up to, not including, half a sequence's page bytes
page_padding = _check(lambda v: _finite(v) and 0 <= v < 0.5,
                      "a number in [0, 0.5): the share of a sequence's page bytes padded pages may leave unused "
                      "(0 = pages of gcd(layer counts) layers, none padded)")
dtype_name = _check(
    lambda v: isinstance(v, str) and (v == AUTO or v in DTYPE_BYTES),
    '"auto" or one of ' + ", ".join(DTYPE_BYTES) + " (aliases: " + ", ".join(DTYPE_ALIASES) + ")",
)
#: Dtypes a model's weights (and so its forward pass) can take; float8 is a KV cache dtype only,
#: so ``dtype: fp8`` is refused here, from every source, before anything is planned.
MODEL_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
model_dtype_name = _check(
    lambda v: isinstance(v, str) and (v == AUTO or v in MODEL_DTYPES),
    '"auto", ' + ", ".join(MODEL_DTYPES) + " (float8 is a KV cache dtype only: kv_cache_config.dtype, flag "
    "--kv_cache_dtype, as fp8 or float8_e4m3fn, or float8_e5m2)",
)


#: The highest CUDA device index torch can hold: it keeps the index in 8 bits, so ``torch.device("cuda:256")`` is
#: cuda:0 and "cuda:128" is cuda:-128 (a run on another GPU than the one asked for, or torch's traceback).
MAX_CUDA_INDEX = 127


def _is_device(v: Any) -> bool:
    if not isinstance(v, str):
        return False
    if v in (AUTO, "cpu", "cuda"):
        return True
    head, _, idx = v.partition(":")
    # the digits 0-9 only (str.isdigit takes other scripts' digits, which torch refuses), no leading zero (torch
    # refuses "cuda:01" too), and an index torch does not wrap
    return head == "cuda" and re.fullmatch(r"0|[1-9][0-9]{0,2}", idx) is not None and int(idx) <= MAX_CUDA_INDEX


device_name = _check(_is_device, f'"auto", "cpu", "cuda" or "cuda:N" (N from 0 to {MAX_CUDA_INDEX})')
#: Paged attention of ``generate``: compiled FlexAttention over the pools, gather + SDPA (the reference), or a
#: paged decode kernel (Triton on CUDA, C on CPU); "auto" picks by device (``stages.resolve_auto``).
ATTENTION_BACKENDS = ("auto", "flex", "sdpa", "triton", "cpu_kernel")
*_first, _last = ATTENTION_BACKENDS
attention_backend_name = _check(lambda v: v in ATTENTION_BACKENDS,
                                ", ".join(f'"{b}"' for b in _first) + f' or "{_last}"')
#: The projections (``nn.Linear``) of ``generate``'s forward: torch's ``F.linear``, or a C kernel for CPUs on steps of
#: few rows (``models.small_linear``); "auto" picks by device and dtype (``stages.resolve_auto``).
LINEAR_BACKENDS = ("auto", "torch", "cpu_kernel")
linear_backend_name = _check(lambda v: v in LINEAR_BACKENDS, '"auto", "torch" or "cpu_kernel"')
model_name = _check(lambda v: isinstance(v, str) and v.strip() != "", "a preset name or a checkpoint directory")
#: How the scheduler picks among requests (vLLM's ``--scheduling-policy``): first come first served, or by the
#: request's priority (vLLM's sign: lower value first, ties by arrival) — the one list, the schedulers' own.
scheduling_policy_name = _check(lambda v: v in SCHEDULING_POLICY_NAMES, '"fcfs" or "priority"')


#: ``generation_config``'s two words (vLLM's ``--generation-config``); any other value names a directory (or file).
GENERATION_CONFIG_AUTO, GENERATION_CONFIG_NONE = AUTO, "vllm"
generation_config_name = _check(
    lambda v: isinstance(v, str) and v.strip() != "",
    '"auto" (the checkpoint\'s generation_config.json), "vllm" (none: kvload\'s built-in sampling defaults) or a '
    "directory holding a generation_config.json",
)


def _finite(v: Any) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    return abs(v) < 2**1024 if isinstance(v, int) else math.isfinite(v)  # math.isfinite overflows on a huge int


# The sampling keys of a generation_config.json, checked in SamplingParams' words (engine.sampling_params): one
# verdict per value, whether it comes from a model's file or the user's override_generation_config
opt_temperature = _check(lambda v: v is None or (_finite(v) and v >= 0), "a finite number >= 0 (0 = greedy) or null")
opt_top_p = _check(lambda v: v is None or (_finite(v) and 0 < v <= 1), "a number in (0, 1] or null")
opt_top_k = _check(lambda v: v is None or (_is_int(v) and v >= -1),
                   "an integer >= 1, or 0 / -1 for all tokens, or null")
opt_min_p = _check(lambda v: v is None or (_finite(v) and 0 <= v <= 1), "a number in [0, 1] (0 = off) or null")
opt_repetition_penalty = _check(
    lambda v: v is None or (_finite(v) and MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY),
    f"a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 = off) or null")
opt_bool = _check(lambda v: v is None or isinstance(v, bool), "true, false or null")


def _norm_dtype(v: Any) -> Any:
    if type(v).__module__ == "torch" and type(v).__name__ == "dtype":  # vLLM takes torch.float16 too (no torch import
        v = str(v).removeprefix("torch.")  # here: the config layer stays light)
    return normalize_dtype(v) if isinstance(v, str) else v


# --- explicitness and freezing ---------------------------------------------------------------


def _record_setattr(inst: Any, attribute: attrs.Attribute, value: Any) -> Any:
    if inst._frozen:
        raise attrs.exceptions.FrozenInstanceError()
    inst._explicit.add(attribute.name)
    return value


_ON_SETATTR = attrs.setters.pipe(attrs.setters.convert, attrs.setters.validate, _record_setattr)


def _internal(factory) -> Any:
    return attrs.field(factory=factory, init=False, repr=False, eq=False, on_setattr=attrs.setters.NO_OP,
                       metadata={"internal": True})


def plain_fields(cls: type, fields: list[attrs.Attribute]) -> list[attrs.Attribute]:
    """Every public field converts numpy / torch scalars first (then its own converter, if any), at construction and
    at assignment alike: the same values a config dict takes, also when the class is built directly. An attrs
    ``field_transformer``: any attrs class :func:`pipeline.converter.structure` builds needs it (the converter's
    number and flag hooks pass values through), not only the config classes (``KvEventsConfig``)."""
    return [f if f.metadata.get("internal")
            else f.evolve(converter=plain_value if f.converter is None else attrs.converters.pipe(plain_value,
                                                                                                  f.converter))
            for f in fields]


def config_class(cls: type) -> type:
    """Make an attrs config class that records explicitly passed fields and can be frozen."""
    cls = attrs.define(on_setattr=_ON_SETATTR, field_transformer=plain_fields)(cls)
    init_names = [a.name for a in attrs.fields(cls) if a.init]
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unknown = [k for k in kwargs if k not in init_names]
        if unknown:  # Python's own TypeError named no close field, where a dict's or the YAML's unknown key does
            raise UnknownFieldError(unknown[0], _unknown_keyword(cls.__name__, unknown[0], init_names))
        original(self, *args, **kwargs)
        self._explicit.update(init_names[: len(args)])
        self._explicit.update(kwargs)

    cls.__init__ = __init__
    return cls


def _unknown_keyword(cls_name: str, key: str, init_names: list[str]) -> str:
    """Why a config class refuses keyword ``key``: the closest field, or, for a TensorRT-LLM option kvload takes and
    ignores in a dict (``kv_cache_config={"copy_on_partial_reuse": False}``), where to give it instead of a field it
    merely resembles (``enable_partial_reuse``)."""
    from pipeline import trtllm_compat  # it imports this module

    ignored = {"KvCacheConfig": trtllm_compat.IGNORED_KV_CACHE_CONFIG, "LlmArgs": trtllm_compat.IGNORED_LLM_ARGS}
    if key in ignored.get(cls_name, {}):
        where = "in kv_cache_config={...} as a dict" if cls_name == "KvCacheConfig" else "as a keyword of plan/load/LLM"
        return (f"a TensorRT-LLM option kvload does not act on, so {cls_name} has no such field; give it {where}, "
                "where it is taken and reported setting_ignored, or leave it out")
    return f"unknown key{did_you_mean(key, init_names) or '; known keys: ' + ', '.join(init_names)}"


def explicit_fields(obj: Any) -> frozenset[str]:
    """Names of the fields of a config object that were passed or assigned explicitly."""
    return frozenset(obj._explicit)


def freeze(obj: Any) -> Any:
    """Make a config object (and the config objects inside it) reject further assignment."""
    for a in attrs.fields(type(obj)):
        child = getattr(obj, a.name)
        if attrs.has(type(child)):
            freeze(child)
    obj._frozen = True
    return obj


def is_frozen(obj: Any) -> bool:
    """Whether :func:`freeze` was applied to this config object."""
    return bool(obj._frozen)


def set_field(root: Any, path: str, value: Any) -> None:
    """Write a dotted path inside a config object, validated, without marking it user-set.

    Stages use this: explicitness belongs to the user's inputs, not to what the pipeline derived.
    """
    *parents, leaf = path.split(".")
    obj = root
    for part in parents:
        obj = getattr(obj, part)
    if obj._frozen:
        raise attrs.exceptions.FrozenInstanceError()
    attribute = attrs.fields_dict(type(obj))[leaf]
    if attribute.converter is not None:
        value = attribute.converter(value)
    if attribute.validator is not None:
        attribute.validator(obj, attribute, value)
    object.__setattr__(obj, leaf, value)


def refit_max_seq_len(args: Any, value: int) -> None:
    """Lower ``max_seq_len`` in frozen args: the one write after the freeze, for ``max_seq_len: auto`` (vLLM's
    ``max_model_len`` -1), which needs the KV budget, known only once the pools are planned."""
    args._frozen = False
    try:
        set_field(args, "max_seq_len", value)
    finally:
        args._frozen = True


def public_fields(cls: type) -> list[attrs.Attribute]:
    """The user-facing fields of a config class (internal bookkeeping left out)."""
    return [a for a in attrs.fields(cls) if not a.metadata.get("internal")]


# --- the classes -----------------------------------------------------------------------------


@config_class
class KvCacheConfig:
    """KV cache settings; names and defaults follow TensorRT-LLM's ``KvCacheConfig``."""

    use_kv_cache_manager_v2: TriState = attrs.field(default=AUTO, validator=tri_state)
    tokens_per_block: int = attrs.field(default=32, validator=pos_int)
    enable_block_reuse: bool = attrs.field(default=True, validator=strict_bool)
    enable_partial_reuse: bool = attrs.field(default=True, validator=strict_bool)
    free_gpu_memory_fraction: float = attrs.field(default=0.9, validator=fraction)
    max_tokens: int | None = attrs.field(default=None, validator=opt_pos_int)
    # tokens the pools hold when no rule bounds the budget (CPU without max_tokens/max_gpu_total_bytes);
    # null: such a load is refused. kvload generate sets it for its prompts.
    default_max_tokens: int | None = attrs.field(default=None, validator=opt_pos_int)
    max_gpu_total_bytes: Bytes = attrs.field(default=0, converter=_BYTES, validator=non_neg_int)
    host_cache_size: Bytes | None = attrs.field(default=None, converter=_BYTES, validator=opt_non_neg_int)
    dtype: DTypeName = attrs.field(default=AUTO, converter=_norm_dtype, validator=dtype_name)
    max_util_for_resume: float = attrs.field(default=0.95, validator=fraction)
    # Not TensorRT-LLM's default (False): blocks that leave a sliding window stay in the prefix cache, so
    # sliding-window models get prefix hits (issue 10); False drops them as they leave the window.
    enable_swa_scratch_reuse: bool = attrs.field(default=True, validator=strict_bool)
    event_buffer_max_size: int = attrs.field(default=0, validator=non_neg_int)
    # V2 layer groups of unequal pages (DeepSeek V4): true draws every group's blocks from one slab arena, false splits
    # the budget between per-group pools once; "auto" picks by the budget (stages.arena_choice). Elsewhere inert.
    pool_arena: TriState = attrs.field(default=AUTO, validator=tri_state)
    # V2 shared arena (Gemma 2/3, GPT-OSS): the most of a sequence's page bytes a page of more than gcd(layer counts)
    # layers may leave unused in a kind's last, padded cut, for fewer groups (less CPU a step); 0: gcd, no padding, as
    # padded pages hold fewer sequences at tight budgets (cache_backends.layout.share_pages). Elsewhere inert.
    max_page_padding: float = attrs.field(default=0.0, validator=page_padding)
    _explicit: set[str] = _internal(set)
    _frozen: bool = _internal(bool)


@config_class
class GenerationDefaults:
    """Sampling defaults in ``generation_config.json``'s keys (transformers' names): ``override_generation_config``
    (vLLM's ``--override-generation-config``), laid over the model's own file. Null: not given."""

    temperature: float | None = attrs.field(default=None, validator=opt_temperature)
    top_p: float | None = attrs.field(default=None, validator=opt_top_p)
    top_k: int | None = attrs.field(default=None, validator=opt_top_k)
    min_p: float | None = attrs.field(default=None, validator=opt_min_p)
    repetition_penalty: float | None = attrs.field(default=None, validator=opt_repetition_penalty)
    max_new_tokens: int | None = attrs.field(default=None, validator=opt_pos_int)  # SamplingParams.max_tokens
    # transformers' switch between greedy (false) and sampling (true); see pipeline.generation_config
    do_sample: bool | None = attrs.field(default=None, validator=opt_bool)
    _explicit: set[str] = _internal(set)
    _frozen: bool = _internal(bool)


@config_class
class LlmArgs:
    """Everything a load is configured by; ``model`` names a preset or a checkpoint directory."""

    model: str = attrs.field(validator=model_name)
    dtype: DTypeName = attrs.field(default=AUTO, converter=_norm_dtype, validator=model_dtype_name)
    device: DeviceName = attrs.field(default=AUTO, validator=device_name)
    max_batch_size: int = attrs.field(default=2048, validator=pos_int)
    max_seq_len: SeqLen | None = attrs.field(default=None, validator=seq_len)
    max_num_tokens: int = attrs.field(default=8192, validator=pos_int)
    max_beam_width: int = attrs.field(default=1, validator=pos_int)
    # vLLM's --scheduling-policy: "priority" admits (and on V2 moves out) requests by their priority (README)
    scheduling_policy: str = attrs.field(default="fcfs", validator=scheduling_policy_name)
    weights_seed: int = attrs.field(default=0, validator=non_neg_int)  # random weights of presets
    attention_backend: str = attrs.field(default=AUTO, validator=attention_backend_name)
    linear_backend: str = attrs.field(default=AUTO, validator=linear_backend_name)
    # speculative decoding by n-gram lookup (engine.speculation), TensorRT-LLM's NGramDecodingConfig names and
    # defaults: draft tokens per step (0 = off), the longest suffix matched against earlier tokens; and while at most
    # how many requests run it drafts (its max_concurrency; more requests make a step compute-bound, where drafts cost)
    max_draft_len: int = attrs.field(default=0, validator=draft_len)
    max_matching_ngram_size: int = attrs.field(default=2, validator=ngram_size)
    speculation_max_batch_size: int = attrs.field(default=1, validator=pos_int)
    # ranks the attention heads (and KV heads) are split over; the operator's, never a model's
    tensor_parallel_size: int = attrs.field(default=1, validator=pos_int)
    # vLLM's --generation-config and --override-generation-config: where the sampling defaults of a request that
    # does not set them come from (pipeline.generation_config), and the user's values laid over them
    generation_config: str = attrs.field(default=GENERATION_CONFIG_AUTO, validator=generation_config_name)
    override_generation_config: GenerationDefaults = attrs.field(factory=GenerationDefaults)
    kv_cache_config: KvCacheConfig = attrs.field(factory=KvCacheConfig)
    _explicit: set[str] = _internal(set)
    _frozen: bool = _internal(bool)

    @kv_cache_config.validator
    def _kv_is_config(self, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, KvCacheConfig):
            raise FieldError(attribute.name, f"expected a mapping of KvCacheConfig fields, got {describe(value)}")

    @override_generation_config.validator
    def _override_is_config(self, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, GenerationDefaults):
            raise FieldError(attribute.name, f"expected a mapping of generation_config.json keys, got "
                                             f"{describe(value)}")


#: The dotted path of the decision at kvload's heart.
V2_FIELD = "kv_cache_config.use_kv_cache_manager_v2"

#: Whether V2's groups of unequal pages share one slab arena (``stages.arena_choice``).
ARENA_FIELD = "kv_cache_config.pool_arena"

#: Fields whose value may be ``"auto"`` and that ``resolve_auto`` turns into a concrete value.
AUTO_FIELDS: tuple[str, ...] = ("dtype", "device", V2_FIELD, "kv_cache_config.dtype", "attention_backend",
                                 "linear_backend", "generation_config", "max_seq_len", ARENA_FIELD)


def framework_defaults() -> dict[str, Any]:
    """The args before any source spoke: every default, and ``model`` unset (null)."""
    from pipeline.converter import unstructure  # converter imports this module

    tree = unstructure(LlmArgs(model="<unset>"))
    tree["model"] = None
    return tree
