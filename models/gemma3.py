"""Gemma 3: interleaved sliding-window and full-attention layers; no V2 default."""

from __future__ import annotations

from models.classifier import GEMMA3_CLASSIFIERS
from models.registry import register_model
from models.spec import ModelSpec


@register_model("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", *GEMMA3_CLASSIFIERS)
class Gemma3Spec(ModelSpec):
    """Gemma 3 text decoders (the multimodal wrapper keeps the decoder in ``text_config``)."""

    supports_generation = True
