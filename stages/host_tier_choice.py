"""V2's auto host tier: kept where copying an evicted token's KV out and back costs less than recomputing it.

Why: a suspended request's pages cross the host link twice (out when they are evicted, back at the resume) and the
step waits for them; a preempted request recomputes what eviction took instead, and on an accelerator a recomputed
token costs its projections' FLOPs. Per token, on the accelerator's nominal figures (``models.cost.HARDWARE``):

* copy: ``2 x`` the token's KV in every layer (this rank's) ``/`` the host link one way;
* recompute: ``2 x`` the active parameters (this rank's share) ``/`` the peak FLOPs (attention left out).

Recompute wins where the active parameters are fewer than ``peak FLOPs / host link`` (about 15,500 on an H200) per
byte of KV a token holds: the tiny presets (tiny-llama: 0.0003 µs against 0.032 µs), and older models whose every
head keeps its own KV; checkpoints with grouped-query attention keep their tiers, small ones included (a
Qwen2.5-0.5B shape: 0.38 µs to copy against 0.72 µs to recompute), as Gemma 2 9B does (10.8 µs against 16.8 µs).
On the grid the choice took the tiny presets' cells with suspends from 1.08–1.21x V1's modeled time to 0.75–1.00x
and left the published configs' tiers alone (BENCHMARKS.md, "Auto host tier"). It is made only where the
accelerator is known: ``kvload simulate --hardware`` (``LoadRequest.hardware``), or a CUDA device whose name is in
the table. On a CPU the pools already live in host memory, a copy is a ``memcpy`` and the tier is kept; so it is for
a model transformers cannot build to count, and for accelerators not in the table (a GH200's host link is several
times PCIe's).
"""

from __future__ import annotations

from typing import Any

import attrs

from cache_backends.layout import DTYPE_SIZES, KvLayout
from models.cost import HARDWARE, hardware_for_device_name, model_cost
from pipeline.context import Context

FIELD = "kv_cache_config.host_cache_size"


@attrs.frozen
class HostTierChoice:
    """The two costs of one evicted token on ``hardware``, in seconds, and what they decide."""

    hardware: str  # the accelerator's name (HARDWARE's ``name``)
    copy_s: float
    recompute_s: float

    @property
    def keep(self) -> bool:
        """Whether the tier is kept: a copy out and back costs no more than the recompute."""
        return self.copy_s <= self.recompute_s

    @property
    def reason(self) -> str:
        """One line saying which costs less, by how much, and what follows."""
        copy, recompute = f"{self.copy_s * 1e6:.3g} µs", f"{self.recompute_s * 1e6:.3g} µs"
        if self.keep:
            return (f"on {self.hardware}, copying an evicted token's KV to the host and back ({copy}) costs no more "
                    f"than recomputing it ({recompute}): suspended requests are copied to a host tier")
        return (f"on {self.hardware}, recomputing an evicted token ({recompute}) costs less than copying its KV to the "
                f"host and back ({copy}): requests moved out are preempted for recompute, with no host tier; set "
                f"{FIELD} to keep one")


def accelerator(ctx: Context, device: str) -> str | None:
    """The :data:`HARDWARE` key the run is priced on: the caller's, else a CUDA device's by name, else None."""
    if ctx.request is not None and ctx.request.hardware is not None:
        return ctx.request.hardware
    if not device.startswith("cuda"):
        return None
    import torch

    return hardware_for_device_name(torch.cuda.get_device_name(torch.device(device)))  # no index: the current one


def choose_host_tier(ctx: Context, layout: KvLayout, device: str) -> HostTierChoice | None:
    """What the auto host tier costs against recompute on the run's accelerator, or None when that is not known."""
    key = accelerator(ctx, device)
    if key is None or key not in HARDWARE:
        return None
    cost = _cost(ctx.hf_config, str(ctx.args.dtype))
    if cost is None:
        return None
    hw = HARDWARE[key]
    kv_bytes = sum(g.bytes_per_block / g.tokens_per_block for g in layout.groups)
    tp = max(1, int(ctx.args.tensor_parallel_size or 1))
    return HostTierChoice(hw.name, 2.0 * kv_bytes / hw.host_bytes_per_s, cost.flops_per_token / tp / hw.flops_per_s)


def _cost(hf_config: Any, dtype: str) -> Any:
    try:
        return model_cost(hf_config, DTYPE_SIZES.get(dtype, 2))
    except Exception:  # transformers cannot build it on meta: nothing to count, the tier is kept
        return None
