"""Llama family: Llama, Mistral (sliding window), Qwen2, Qwen3. Standard GQA caches; no V2 default."""

from __future__ import annotations

from models.classifier import LLAMA_CLASSIFIERS, TOKEN_CLASSIFIERS
from models.registry import register_model
from models.spec import ModelSpec


@register_model("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", *LLAMA_CLASSIFIERS,
                *TOKEN_CLASSIFIERS)
class LlamaSpec(ModelSpec):
    """Decoder-only GQA models; Mistral's and Qwen's sliding windows come from their configs. Their
    ``*ForSequenceClassification`` and ``*ForTokenClassification`` checkpoints (``models.classifier``) have the same
    decoder and KV geometry."""

    supports_generation = True
