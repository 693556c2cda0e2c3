"""``ModelSpec``: what kvload knows about one architecture family — defaults and KV geometry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from cache_backends.layout import LayerKV
from models.geometry import HeadSharding, head_sharding, layers_from_config, text_config


class ModelSpec:
    """Base spec; subclasses override :meth:`get_model_defaults` and, rarely, :meth:`kv_layers`.

    The default geometry is read from the config's own fields, so the base class doubles as the
    generic decoder spec for architectures nobody registered.
    """

    architectures: ClassVar[tuple[str, ...]] = ()
    #: Whether kvload's executor can run this family's forward pass through its paged cache.
    supports_generation: ClassVar[bool] = False

    def __init__(self, hf_config: Any) -> None:
        self.hf_config = hf_config

    @property
    def name(self) -> str:
        """The spec's class name, as events and errors show it."""
        return type(self).__name__

    @property
    def architecture(self) -> str:
        """``architectures[0]`` of the checkpoint config (or its model_type when absent)."""
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else str(getattr(self.hf_config, "model_type", "unknown"))

    @property
    def text_config(self) -> Any:
        """The decoder's config (``text_config`` of multimodal wrappers)."""
        return text_config(self.hf_config)

    def get_model_defaults(self, args: Any) -> dict[str, Any]:
        """Nested, partial dict of arg values this model proposes; ``args`` is a frozen read-only view."""
        return {}

    def kv_layers(self, tp_size: int = 1) -> list[LayerKV]:
        """Per-layer KV geometry of the decoder, as one of ``tp_size`` tensor-parallel ranks holds it."""
        return layers_from_config(self.hf_config, self.architecture, tp_size)

    def head_sharding(self, tp_size: int) -> HeadSharding:
        """How ``tp_size`` ranks split the attention heads; ``ModelError`` when they cannot."""
        return head_sharding(self.hf_config, tp_size, self.architecture)

    def v2_required_reason(self) -> str | None:
        """Why only KV cache manager V2 can hold this model's cache, or None when V1 can."""
        kinds = sorted({layer.kind for layer in self.kv_layers() if layer.compress_rate is not None})
        if kinds:
            return (
                f"{self.architecture} has compressed attention layers ({', '.join(kinds)}) whose KV entries "
                "only KV cache manager V2 can hold (V1 keeps one uniform entry per token per layer)"
            )
        return None

    def checkpoint_dtype(self) -> str | None:
        """The dtype the checkpoint declares (``dtype``/``torch_dtype``), as a name, or None."""
        for cfg in (self.hf_config, self.text_config):
            value = getattr(cfg, "dtype", None)  # transformers 5 reads a file's torch_dtype into dtype
            if value is not None:
                return str(value).removeprefix("torch.")
        return None

    def max_position_embeddings(self) -> int | None:
        """The longest sequence the checkpoint was built for, when it says."""
        value = getattr(self.text_config, "max_position_embeddings", None)
        return value if isinstance(value, int) and value > 0 else None

    def rope_scaling(self) -> dict[str, Any] | None:
        """The config's rope scaling (a ``rope_type`` other than ``"default"``), or None when it declares none.

        transformers 5 reads a file's ``rope_scaling`` into ``rope_parameters``, present even when nothing
        scales (``rope_type: "default"``); an older config or preset may hold either. Gemma 3 keeps one entry
        per layer type, so a nested entry that scales counts too.
        """
        for name in ("rope_scaling", "rope_parameters"):
            value = getattr(self.text_config, name, None)
            if isinstance(value, Mapping) and _scales(value):
                return dict(value)
        return None


def _rope_type(rope: Mapping[str, Any]) -> Any:
    return rope.get("rope_type") or rope.get("type")


def _is_entry(rope: Mapping[str, Any]) -> bool:
    """One rope entry (it names a type or a factor), not a map of entries per layer type (Gemma 3)."""
    return _rope_type(rope) is not None or "factor" in rope  # a factor with no type still stretches positions


def _scales(rope: Mapping[str, Any]) -> bool:
    """Whether a rope entry (or any per-layer-type entry inside it) scales positions."""
    if _is_entry(rope):
        return _rope_type(rope) != "default"
    return any(isinstance(inner, Mapping) and _scales(inner) for inner in rope.values())


def describe_rope(rope: Mapping[str, Any]) -> str:
    """A rope scaling entry in a few words (``yarn, factor 4.0``); per layer type when the config nests them."""
    if _is_entry(rope):
        factor = rope.get("factor")
        return f"{_rope_type(rope) or 'unnamed'}" + (f", factor {factor}" if factor is not None else "")
    return "; ".join(f"{layer}: {describe_rope(entry)}" for layer, entry in rope.items()
                     if isinstance(entry, Mapping) and _scales(entry))


class GenericDecoderSpec(ModelSpec):
    """Fallback for unregistered architectures: geometry from the config, no model defaults."""
