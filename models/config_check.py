"""Check the fields of a ``config.json`` that size the KV geometry, before transformers or kvload use them.

transformers builds a config object from whatever the file says (a billion ``num_hidden_layers``
become a billion ``layer_types`` entries; ``num_attention_heads: 0`` divides by zero), so each
field kvload reads is checked here first: its type, and a range that real checkpoints fit with
room to spare. The error names the file and the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.errors import ModelError
from pipeline.limits import short

#: field -> (least, most, may be null). The upper bounds are far above any published model
#: (the largest have ~130 layers, 128 heads, head_dim 256, hidden 16k, 10M positions).
INT_FIELDS: dict[str, tuple[int, int, bool]] = {
    "num_hidden_layers": (1, 16_384, False),
    "num_attention_heads": (1, 65_536, False),
    "num_key_value_heads": (1, 65_536, True),
    "head_dim": (1, 65_536, True),
    "hidden_size": (1, 1_048_576, False),
    "sliding_window": (1, 2**32, True),
    "kv_lora_rank": (1, 1_048_576, True),
    "qk_rope_head_dim": (1, 65_536, True),
    # MLA's other head sizes and its query compression: transformers built a negative one into the model and the load
    # failed as "Trying to create tensor with negative dimension -4: [64, -4]", naming no field
    "qk_nope_head_dim": (0, 65_536, True),
    "v_head_dim": (1, 65_536, True),
    "q_lora_rank": (1, 1_048_576, True),
    "index_head_dim": (0, 65_536, True),
    "max_position_embeddings": (1, 2**32, True),
    "vocab_size": (1, 2**24, True),
}
BOOL_FIELDS = ("use_sliding_window",)
#: The normalisation epsilons: a finite number in (0, 1] (published models use 1e-6 to 1e-5). transformers takes any
#: float: a negative one made RMSNorm's square root NaN and 1e308 scaled every hidden state to zero, and either way
#: generate wrote token 0 over and over with exit 0.
EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
#: The model's dtype: a name (transformers ignored a number there and the model took kvload's default dtype).
DTYPE_FIELDS = ("dtype", "torch_dtype")


#: The RoPE scaling settings (``rope_scaling``, transformers 5's ``rope_parameters``): an object, or one per layer type.
ROPE_FIELDS = ("rope_scaling", "rope_parameters")


#: RoPE types transformers has had for years: a name among them needs no import of transformers to be accepted.
KNOWN_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "yarn", "longrope", "llama3"})


#: Activations transformers has had for years (``ACT2FN``): a ``hidden_act`` among them needs no import of
#: transformers (and through it torch) to be accepted.
KNOWN_ACTIVATIONS = frozenset({"gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "quick_gelu", "relu", "relu6",
                               "sigmoid", "silu", "swish", "tanh", "linear"})


def activations() -> list[str]:
    """The activation names this transformers has (``ACT2FN``), sorted."""
    from transformers.activations import ACT2FN

    return sorted(ACT2FN)


def rope_types() -> list[str]:
    """The RoPE types this transformers has ("default" and its ``ROPE_INIT_FUNCTIONS``), sorted after "default"."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ["default", *sorted(ROPE_INIT_FUNCTIONS)]


def rope_problem(value: Any) -> tuple[str, str] | None:
    """What is wrong with a ``rope_scaling`` / ``rope_parameters`` value, as (the path below the field, e.g.
    ``.factor`` or ``.full_attention.factor``; the problem), or None. Its ``factor`` must be a finite number >= 1,
    transformers' own rule for every scaled type: transformers only logs a warning and builds the model anyway,
    whose positions a factor of -2 runs backwards (text comes out, no error)."""
    if not isinstance(value, Mapping):
        return "", f"expected an object of RoPE settings (rope_type, factor, ...) or null, got {short(value)}"
    if value and all(isinstance(v, Mapping) for v in value.values()):  # one per layer type (Gemma 3's)
        for kind, inner in value.items():
            problem = rope_problem(inner)
            if problem:
                return f".{kind}{problem[0]}", problem[1]
        return None
    for key in ("rope_type", "type"):  # a number there failed the load as "transformers cannot load the weights: 5"
        if key in value and not isinstance(value[key], str):
            return f".{key}", ("expected a RoPE type name such as 'default', 'linear' or 'yarn', "
                               f"got {short(value[key])}")
        if key in value and value[key] not in KNOWN_ROPE_TYPES:
            accepted = rope_types()
            if value[key] not in accepted:  # plan went through with transformers' log line; generate refused it
                return f".{key}", (f"{short(value[key])} is not a RoPE type transformers has; accepted: "
                                   f"{', '.join(accepted)}")
    factor = value.get("factor")
    if factor is not None and not (isinstance(factor, int | float) and not isinstance(factor, bool)
                                   and math.isfinite(factor) and factor >= 1):
        return ".factor", f"expected a number >= 1 (1 = no scaling), got {short(factor)}"
    theta = theta_problem(value.get("rope_theta"))
    if theta:
        return ".rope_theta", theta
    return None


def theta_problem(value: Any) -> str | None:
    """What is wrong with a ``rope_theta`` (RoPE's base), or None: a finite number > 0, or null. transformers takes
    any: a string failed the load as "unsupported operand type(s) for ** or pow()", naming no field, and a negative
    or zero base raised nothing, its rotation angles NaN, so the model wrote garbage with exit 0."""
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
                         and value > 0):
        return None
    return f"expected a number > 0 (RoPE's base, 10000 in most models) or null, got {short(value)}"


def _int_problem(value: Any, least: int, most: int, nullable: bool) -> str | None:
    if value is None and nullable:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= most:
        accepted = f"an integer in [{least}, {most:,}]" + (" or null" if nullable else "")
        return f"expected {accepted}, got {short(value)}"
    return None


def token_ids_problem(value: Any, vocab_size: Any) -> str | None:
    """What is wrong with an ``eos_token_id`` (an integer token id, a list of them, or null), or None. An id outside
    the vocabulary (``vocab_size`` when the file states it) is refused: transformers only logs that it "may result in
    unexpected behavior"; generation then never stopped at EOS, and under ``min_tokens`` a negative id, indexing from
    the end, kept a real token from being drawn in its place."""
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return f"expected an integer token id, a list of them, or null; got {short(value)}"
    vocab = vocab_size if isinstance(vocab_size, int) and not isinstance(vocab_size, bool) else None
    bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is None:
        return None
    accepted = f"an integer in [0, {vocab - 1:,}] (vocab_size {vocab:,})" if vocab is not None else "an integer >= 0"
    return f"token id {short(bad)} is not in the vocabulary; accepted: {accepted}, a list of them, or null"


def pad_id_problem(value: Any, vocab_size: Any) -> str | None:
    """What is wrong with a ``pad_token_id``, or None. transformers makes it the embedding's ``padding_idx``: one
    outside ``[-vocab_size, vocab_size)`` failed the weights' load as "Padding_idx must be within num_embeddings"
    behind transformers' own warning line, naming neither the file nor the field (plan went through). A negative
    id inside counts from the end, as torch reads it (old LLaMA conversions say -1): transformers only warns."""
    vocab = vocab_size if isinstance(vocab_size, int) and not isinstance(vocab_size, bool) else None
    if vocab is None or not isinstance(value, int) or isinstance(value, bool) or -vocab <= value < vocab:
        return None  # a wrong type is transformers' to refuse: its line names the field
    return (f"token id {short(value)} is not in the vocabulary; accepted: an integer in [0, {vocab - 1:,}] "
            f"(vocab_size {vocab:,}; a negative one counts from the end) or null")


def pads_an_embedding(data: Mapping[str, Any]) -> bool:
    """Whether the model a ``config.json`` describes makes its ``pad_token_id`` an embedding's ``padding_idx``, found
    by building it on the meta device (nothing allocated) as the load builds it (``AutoModelForCausalLM``).

    Llama, Qwen, Gemma, DeepSeek and most decoders do; GPT-2, GPT-NeoX, GPT-J, Falcon, Bloom and MPT read it only in
    heads kvload never builds, so an id past their vocabulary harms nothing (transformers loads them with a warning),
    and a family registered with ``register_model`` over one of them was refused for it. Asked only of an id already
    out of range; a config transformers cannot build here counts as padding one (refused, as before)."""
    import warnings

    import torch
    import transformers

    from models.compile_cache import use_kvload_compile_cache
    from models.weights import _quiet_load_report

    # transformers' model code imports torch._dynamo, which makes inductor's cache folder: kvload's, not a
    # torchinductor_<user> left in $TMPDIR by a plan that only checked a config (models.cost does the same)
    use_kvload_compile_cache()
    try:
        with _quiet_load_report(), warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")  # the load says what it has to say about the config, once
            settings = {k: v for k, v in data.items() if k != "model_type"}
            config = transformers.AutoConfig.for_model(data["model_type"], **settings)
            transformers.AutoModelForCausalLM.from_config(config)
    except Exception:  # torch's "Padding_idx must be within num_embeddings", or a config that does not build
        return True
    return False


def head_groups_problem(cfg: Mapping[str, Any], prefix: str = "") -> str | None:
    """Why the query heads cannot be split evenly over the KV heads (grouped-query attention), or None.

    Each KV head serves ``num_attention_heads / num_key_value_heads`` query heads, so the count must divide;
    transformers builds such a model anyway and only its attention fails, at the first forward. An MLA
    config (``kv_lora_rank``) caches one latent that every head expands, so its ``num_key_value_heads`` is
    not a grouping and is not checked. A field that is absent or not a positive integer is left to the
    range checks (transformers fills an absent ``num_key_value_heads`` in).
    """
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if cfg.get("kv_lora_rank") or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                           for n in (heads, kv)):
        return None
    if heads % kv == 0:
        return None
    return (f"{prefix}num_attention_heads ({heads}) is not a multiple of {prefix}num_key_value_heads ({kv}); "
            f"accepted: a {prefix}num_key_value_heads that divides {prefix}num_attention_heads, so each KV head "
            "serves the same number of query heads")


def check_fields(data: Mapping[str, Any], file: Path | str, prefix: str = "", sep: str = ": ") -> None:
    """``ModelError`` naming ``file`` and the first KV-geometry field with a wrong type or an implausible size
    (``file: field: ...``; ``sep="."`` names a setting instead: ``hf_overrides.field: ...``)."""

    def fail(field: str, problem: str) -> None:
        raise ModelError(f"{file}{sep}{prefix}{field}: {problem}")

    for field, (least, most, nullable) in INT_FIELDS.items():
        if field in data:
            problem = _int_problem(data[field], least, most, nullable)
            if problem:
                fail(field, problem)
    for field in BOOL_FIELDS:
        if field in data and data[field] is not None and not isinstance(data[field], bool):
            fail(field, f"expected true, false or null, got {short(data[field])}")
    for field in EPS_FIELDS:
        value = data.get(field)
        if value is not None and not (isinstance(value, int | float) and not isinstance(value, bool)
                                      and math.isfinite(value) and 0 < value <= 1):
            fail(field, f"expected a number in (0, 1] (1e-6 in most models) or null, got {short(value)}")
    quant = data.get("quantization_config")
    if quant is not None and not isinstance(quant, Mapping):  # transformers: "'str' object has no attribute 'to_dict'"
        fail("quantization_config", f"expected an object with a quant_method, got {short(quant)}")
    for field in DTYPE_FIELDS:
        if data.get(field) is not None and not isinstance(data[field], str):
            fail(field, f"expected a torch dtype name such as float32, float16 or bfloat16, or null; got "
                        f"{short(data[field])}")
    layer_types = data.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
            fail("layer_types", f"expected a list of layer type names, got {short(layer_types)}")
        layers = data.get("num_hidden_layers")
        if isinstance(layers, int) and len(layer_types) != layers:
            fail("layer_types", f"has {len(layer_types)} entries but num_hidden_layers is {layers}; "
                                "give one type per layer")
    problem = head_groups_problem(data, prefix)
    if problem:
        raise ModelError(f"{file}: {problem}")
    inner = data.get("text_config") if not prefix else None  # a multimodal config states the decoder's vocabulary there
    vocab = data.get("vocab_size", inner.get("vocab_size") if isinstance(inner, Mapping) else None)
    problem = token_ids_problem(data.get("eos_token_id"), vocab)
    if problem:
        fail("eos_token_id", problem)
    problem = pad_id_problem(data.get("pad_token_id"), vocab)
    if problem and pads_an_embedding(data):
        fail("pad_token_id", problem)
    rates = data.get("compress_rates")
    if rates is not None:
        if not isinstance(rates, Mapping):
            fail("compress_rates", f"expected a mapping of layer type to rate, got {short(rates)}")
        for kind, rate in rates.items():
            problem = _int_problem(rate, 1, 1_048_576, False)
            if problem:
                fail(f"compress_rates.{kind}", problem)
    theta = theta_problem(data.get("rope_theta"))
    if theta:
        fail("rope_theta", theta)
    for field in ROPE_FIELDS:
        if data.get(field) is not None:
            rope = rope_problem(data[field])
            if rope:
                fail(field + rope[0], rope[1])
    if not prefix and "text_config" in data and data["text_config"] is not None:
        inner = data["text_config"]
        if not isinstance(inner, Mapping):
            fail("text_config", f"expected an object of the decoder's config fields (or null), got {short(inner)}")
        check_fields(inner, file, prefix="text_config.", sep=sep)
