"""Read a model's KV geometry from its Hugging Face config (after ``AutoConfig`` filled it in).

Only the config's own fields are used (``layer_types``, ``sliding_window``, ``use_sliding_window``,
``kv_lora_rank``, ``head_dim``, ``text_config``, DeepSeek V4's ``compress_rates``), so an
architecture with no spec of its own still gets the right geometry.
"""

from __future__ import annotations

from typing import Any

from cache_backends.layout import LayerKV
from pipeline.errors import ModelError

V4_LAYER_KINDS = {
    "sliding_attention": "v4_sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
_PLAIN_LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}


def text_config(cfg: Any) -> Any:
    """The decoder's config: ``text_config`` for multimodal wrappers, else the config itself."""
    inner = getattr(cfg, "text_config", None)
    if inner is not None and not hasattr(inner, "num_hidden_layers") and not isinstance(inner, dict):
        raise ModelError(f"text_config: expected the decoder's config, got {type(inner).__name__}")
    return inner if inner is not None else cfg


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    value = getattr(cfg, name, default)
    return default if value is None else value


def _required(cfg: Any, name: str, arch: str) -> int:
    value = getattr(cfg, name, None)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelError(
            f"{arch}: config has no usable '{name}' (got {value!r}); kvload cannot derive the KV geometry"
        )
    return value


def head_dim(cfg: Any, arch: str = "model") -> int:
    """``head_dim`` when the config gives one, else ``hidden_size / num_attention_heads``.

    A ``head_dim`` that is there but unusable (0, negative, not an integer) is an error, never
    silently replaced by the division.
    """
    if getattr(cfg, "head_dim", None) is not None:
        return _required(cfg, "head_dim", arch)
    return _required(cfg, "hidden_size", arch) // _required(cfg, "num_attention_heads", arch)


def kv_heads(cfg: Any, arch: str = "model") -> int:
    """``num_key_value_heads``, or ``num_attention_heads`` when absent (GPT-2 style); an unusable value is an error."""
    if getattr(cfg, "num_key_value_heads", None) is not None:
        return _required(cfg, "num_key_value_heads", arch)
    return _required(cfg, "num_attention_heads", arch)


def layers_from_config(cfg: Any, arch: str = "model") -> list[LayerKV]:
    """One :class:`LayerKV` per decoder layer, per the rules of ``kv-geometry.md``."""
    cfg = text_config(cfg)
    n_layers = _required(cfg, "num_hidden_layers", arch)
    layer_types = getattr(cfg, "layer_types", None)

    if layer_types and any(t in ("compressed_sparse_attention", "heavily_compressed_attention") for t in layer_types):
        return _deepseek_v4_layers(cfg, layer_types, arch)

    if getattr(cfg, "kv_lora_rank", None):
        latent = _required(cfg, "kv_lora_rank", arch) + _required(cfg, "qk_rope_head_dim", arch)
        return [LayerKV(i, "mla", latent) for i in range(n_layers)]

    entry = 2 * kv_heads(cfg, arch) * head_dim(cfg, arch)
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) is False:
        window = None
    if layer_types:
        if len(layer_types) != n_layers:
            raise ModelError(f"{arch}: layer_types has {len(layer_types)} entries for {n_layers} layers")
        unknown = sorted({t for t in layer_types if t not in _PLAIN_LAYER_KINDS})
        if unknown:
            raise ModelError(
                f"{arch}: layer type(s) {', '.join(unknown)} have no KV geometry kvload knows "
                f"(known: {', '.join(dict.fromkeys([*_PLAIN_LAYER_KINDS, *V4_LAYER_KINDS]))})"
            )
        if "sliding_attention" in layer_types and not window:
            raise ModelError(f"{arch}: sliding_attention layers but no sliding_window in the config")
        return [
            LayerKV(i, "sliding", entry, window=window) if t == "sliding_attention" else LayerKV(i, "full", entry)
            for i, t in enumerate(layer_types)
        ]
    if window:  # Mistral style: a window and no layer_types means every layer slides
        return [LayerKV(i, "sliding", entry, window=window) for i in range(n_layers)]
    return [LayerKV(i, "full", entry) for i in range(n_layers)]


def _deepseek_v4_layers(cfg: Any, layer_types: list[str], arch: str) -> list[LayerKV]:
    window = _required(cfg, "sliding_window", arch)
    hd = head_dim(cfg, arch)
    raw = kv_heads(cfg, arch) * hd  # K and V are one tensor in V4
    rates = dict(getattr(cfg, "compress_rates", None) or {})
    index_hd = _get(cfg, "index_head_dim", 0)
    layers = []
    for i, t in enumerate(layer_types):
        kind = V4_LAYER_KINDS.get(t)
        if kind is None:
            raise ModelError(f"{arch}: layer {i} has type {t!r}; DeepSeek V4 layers are {', '.join(V4_LAYER_KINDS)}")
        if kind == "v4_sliding":
            layers.append(LayerKV(i, kind, raw, window=window))
            continue
        rate = rates.get(t)
        if not isinstance(rate, int) or rate <= 0:
            raise ModelError(f"{arch}: compress_rates has no positive rate for {t}")
        compressed = hd + index_hd if kind == "csa" else hd
        layers.append(LayerKV(i, kind, raw, window=window, compressed_elems=compressed, compress_rate=rate))
    return layers
