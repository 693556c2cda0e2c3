"""DeepSeek V4: sliding, compressed-sparse (csa) and heavily-compressed (hca) attention layers."""

from __future__ import annotations

from typing import Any

from models.registry import register_model
from models.spec import ModelSpec


@register_model("DeepseekV4ForCausalLM")
class DeepseekV4Spec(ModelSpec):
    """Opts in to KV cache manager V2: its compressed layers need per-group pools (generate runs them through
    ``models.deepseek_v4_paged``, on V2 only)."""

    def get_model_defaults(self, args: Any) -> dict[str, Any]:
        """V2 with 128-token blocks (one hca entry per block)."""
        return {
            "kv_cache_config": {
                "use_kv_cache_manager_v2": True,
                "tokens_per_block": 128,
            }
        }
