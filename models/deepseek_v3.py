"""DeepSeek V3 / R1: multi-head latent attention (one latent of kv_lora_rank + rope per token)."""

from __future__ import annotations

from models.registry import register_model
from models.spec import ModelSpec


@register_model("DeepseekV3ForCausalLM")
class DeepseekV3Spec(ModelSpec):
    """MLA caches; V1 and V2 both hold the latent, so there is no V2 default."""
