"""What running a model costs on an accelerator: its weights counted, and the accelerators' nominal figures.

Two readers: ``kvload simulate``'s roofline of each step (``engine.step_model``), and V2's auto host tier
(``stages.host_tier_choice``), which compares recomputing an evicted token with copying its KV out and back.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs


@attrs.frozen
class Hardware:
    """One accelerator's nominal figures: HBM bandwidth, dense 16-bit tensor throughput, and the host link one way
    (what a suspend's copy to the host tier and a resume's copy back cross)."""

    name: str
    bytes_per_s: float
    flops_per_s: float
    host_bytes_per_s: float


#: The accelerators ``--hardware`` names (NVIDIA's data sheets: SXM parts, dense bf16 without sparsity; the host link
#: per direction).
HARDWARE: dict[str, Hardware] = {
    "h200": Hardware("H200", 4.8e12, 989e12, 64e9),  # PCIe Gen5 x16 to the host
    "h100": Hardware("H100", 3.35e12, 989e12, 64e9),
    "a100": Hardware("A100-80GB", 2.039e12, 312e12, 32e9),  # PCIe Gen4 x16
    "l40s": Hardware("L40S", 0.864e12, 362e12, 32e9),
}
DEFAULT_HARDWARE = "h200"


@attrs.frozen
class ModelCost:
    """A model's weights as the roofline sees them: bytes read and FLOPs per token."""

    dense_bytes: int  # weights every step reads whole (attention, norms, shared experts, the LM head)
    expert_bytes: int  # routed experts' weights, all of them
    dense_params: int  # parameters every token runs through, less the embedding and the LM head
    expert_params: int  # routed experts' parameters, all of them
    num_experts: int  # routed experts per MoE layer (0: dense)
    experts_per_token: int
    lm_head_flops: int  # 2 x vocab x hidden: the logits of one sampled position
    attn_width: int  # query heads x head dim: attention's FLOPs per query-key pair are 4x this

    @property
    def flops_per_token(self) -> float:
        """FLOPs of one computed token through the projections (the routed experts it picks), attention aside."""
        share = self.experts_per_token / self.num_experts if self.num_experts else 0.0
        return 2.0 * (self.dense_params + self.expert_params * share)


def model_cost(hf_config: Any, dtype_bytes: int) -> ModelCost:
    """:func:`count_weights`, once per config (a grid prices one model in many cells)."""
    key = (json.dumps(hf_config.to_dict(), sort_keys=True, default=str), dtype_bytes)
    cost = _COSTS.get(key)
    if cost is None:
        cost = _COSTS[key] = count_weights(hf_config, dtype_bytes)
    return cost


_COSTS: dict[tuple[str, int], ModelCost] = {}


def count_weights(hf_config: Any, dtype_bytes: int) -> ModelCost:
    """Count the weights of ``hf_config``'s decoder on torch's meta device (no memory, ~1 s: transformers' own model
    code, so every family counts right); raises when transformers cannot build it."""
    import torch
    import transformers

    from models.compile_cache import use_kvload_compile_cache
    from models.config_view import transformers_config
    from models.geometry import text_config

    # transformers' model code imports torch._dynamo, which makes inductor's cache folder: kvload's, not a
    # torchinductor_<user> left in $TMPDIR (a kvload cache that cannot be created leaves torch's default: nothing
    # compiles here, so no setting is lost; a load that compiles says so, stages.load_weights)
    use_kvload_compile_cache()
    cfg = text_config(transformers_config(hf_config))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    embed_in, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    tied = embed_in is head
    dense = expert = 0
    for name, p in model.named_parameters():  # tied weights are listed once
        n = p.numel()
        if ".experts." in name:  # routed experts (shared experts are named otherwise and run for every token)
            expert += n
        elif p is not embed_in or tied:  # an untied input embedding is a gather of the batch's rows, not a read
            dense += n
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    lm_head = head.numel()
    num_experts = int(getattr(cfg, "num_local_experts", None) or getattr(cfg, "n_routed_experts", None)
                      or getattr(cfg, "num_experts", None) or 0) if expert else 0
    per_token = int(getattr(cfg, "num_experts_per_tok", None) or 0) if expert else 0
    return ModelCost(dense_bytes=dense * dtype_bytes, expert_bytes=expert * dtype_bytes,
                     dense_params=dense - lm_head, expert_params=expert,
                     num_experts=num_experts, experts_per_token=per_token,
                     lm_head_flops=2 * lm_head, attn_width=heads * head_dim)


def hardware_for_device_name(name: str) -> str | None:
    """The :data:`HARDWARE` key of a CUDA device name (``torch.cuda.get_device_name``), or None when none matches."""
    for key in HARDWARE:  # a whole word: "NVIDIA GH200" is not an H200 (its host link is NVLink-C2C, not PCIe)
        if re.search(rf"(?<![A-Z0-9]){re.escape(key.upper())}(?![A-Z0-9])", name.upper()):
            return key
    return None
