"""The KV memory budget, and the plan of pools it buys (blocks per group, capacity), computed without allocating.

Budget rules (TensorRT-LLM's, made explicit):

* On CUDA: the device's free memory *when the budget is computed* (after the weights, when they
  are loaded) × ``free_gpu_memory_fraction``.
* Capped by ``max_gpu_total_bytes`` (0 = no cap) and by the bytes that hold ``max_tokens`` tokens
  (:meth:`KvLayout.blocks_for_tokens`: ``ceil(max_tokens / T)`` blocks in every layer group, window
  groups too, as TensorRT-LLM caps tokens per window size, so V1 and V2 get the same bytes for one
  ``max_tokens``; pools split between groups price a window group for ``max_seq_len`` sequences
  instead). When that cap sets the budget, the pools get exactly those blocks.
* On CPU there is no free-memory rule: ``max_tokens`` or ``max_gpu_total_bytes`` must bound the
  budget; otherwise it is unbounded (``budget_bytes`` is None) and only a plan can be reported.
* A budget below one block per group cannot hold anything: :class:`BudgetError`.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from cache_backends.layout import KvLayout, longest


class BudgetError(ValueError):
    """The budget cannot hold the smallest pool set (one block per group)."""


@attrs.frozen
class KvBudget:
    """Every input of the budget and the result; ``limited_by`` names the rule that set it."""

    device: str
    free_bytes: int | None  # free device memory measured when the budget was computed (CUDA only)
    weights_bytes: int  # bytes of weights already resident (already excluded from free_bytes)
    free_gpu_memory_fraction: float
    max_gpu_total_bytes: int
    max_tokens: int | None
    max_seq_len: int
    tokens_cap_bytes: int | None  # bytes that hold max_tokens tokens
    bytes_per_token: float
    min_bytes: int  # one block per group
    budget_bytes: int | None
    limited_by: str | None  # "free_gpu_memory_fraction" | "max_gpu_total_bytes" | "max_tokens" | None
    unbounded_reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain form for events and ``--json``."""
        return attrs.asdict(self)


def is_cuda(device: str) -> bool:
    """Whether a device name ("cuda", "cuda:1") names a CUDA device."""
    return str(device).split(":")[0] == "cuda"


def measure_free_bytes(device: str) -> int | None:
    """Free memory of a CUDA device now (``torch.cuda.mem_get_info``); None for CPU or without CUDA.

    The caching allocator's unused blocks (left by loading the weights, say) are handed back first:
    ``mem_get_info`` counts them as taken although the pools could use them. Callers check that the
    device exists first (an index past the last device is an error here, not None).
    """
    if not is_cuda(device):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def host_available_bytes() -> int | None:
    """Memory the host can give without swapping (``MemAvailable``), when the OS says."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


#: ``host_cache_size=None`` sizes the V2 host tier like the device pools, capped at this share of the
#: host memory available (less the pools themselves when they live on the host).
AUTO_HOST_FRACTION = 0.5


def host_tier_slots(layout: KvLayout, num_blocks: dict[str, int], host_cache_size: int | None,
                    available_bytes: int | None) -> dict[str, int]:
    """Host-tier slots per group: ``None`` = auto, ``0`` = no tier, else bytes split like the pools.

    Auto: one slot per device block, scaled down to fit ``AUTO_HOST_FRACTION`` of ``available_bytes``
    (host memory the tier may take; unknown or <= 0: not capped), at least one slot per group. A byte
    budget gives every group one slot first, then shares the rest in proportion to each group's device
    bytes; ``ValueError`` when it cannot hold one block of every group. A shared arena gets one set of
    page slots that every group counts (auto: one per arena page; bytes: ``host_cache_size // page``),
    so host memory is not counted once per group. Allocates nothing.
    """
    groups = layout.groups
    if host_cache_size == 0:
        return {}
    if host_cache_size is not None and host_cache_size < 0:
        raise ValueError(f"host_cache_size must be >= 0 bytes (0 = no host tier, null = auto), got {host_cache_size}")
    if layout.shared:  # one host tensor of pages for the one arena: sized once, every group counts all of it
        page, pages = layout.groups[0].bytes_per_block, layout.arena_blocks(num_blocks)
        if host_cache_size is None:
            cap = int((available_bytes or 0) * AUTO_HOST_FRACTION)
            slots = pages if cap >= pages * page or cap <= 0 else max(len(groups), cap // page)
        elif host_cache_size < layout.min_bytes():
            slots = 0
        else:
            slots = host_cache_size // page
        if slots:
            return {g.name: slots for g in groups}
    device_bytes = {g.name: num_blocks[g.name] * g.bytes_per_block for g in groups}
    total_device = sum(device_bytes.values())
    if host_cache_size is None:
        cap = int((available_bytes or 0) * AUTO_HOST_FRACTION)
        scale = 1.0 if cap >= total_device or cap <= 0 else cap / total_device
        return {g.name: max(1, int(num_blocks[g.name] * scale)) for g in groups}
    minimum = layout.min_bytes()
    if host_cache_size is None or host_cache_size < minimum:
        raise ValueError(
            f"host_cache_size={host_cache_size} bytes cannot hold one block of every layer group "
            f"(needs at least {minimum}); use 0 for no host tier or null to size it automatically"
        )
    rest = host_cache_size - minimum
    return {g.name: 1 + int(rest * device_bytes[g.name] / total_device) // g.bytes_per_block for g in groups}


def host_tier_bytes(layout: KvLayout, slots: dict[str, int]) -> int:
    """Host bytes a tier of ``slots`` holds (one block of every layer of its group per slot; shared: once)."""
    if layout.shared and slots:
        return max(slots.values()) * layout.groups[0].bytes_per_block
    return sum(slots.get(g.name, 0) * g.bytes_per_block for g in layout.groups)


def compute_budget(
    layout: KvLayout,
    *,
    device: str,
    max_seq_len: int,
    free_gpu_memory_fraction: float,
    max_gpu_total_bytes: int = 0,
    max_tokens: int | None = None,
    free_bytes: int | None = None,
    weights_bytes: int = 0,
) -> KvBudget:
    """The KV budget in bytes from the rules above (None when nothing bounds it); never allocates.

    ``free_bytes`` is the device's free memory measured now (:func:`measure_free_bytes`); it is
    used on CUDA only. ``weights_bytes`` is recorded for the report: weights already loaded are
    not free, so they are already excluded from ``free_bytes``.
    """
    candidates: dict[str, int] = {}
    if is_cuda(device) and free_bytes is not None:
        candidates["free_gpu_memory_fraction"] = int(free_bytes * free_gpu_memory_fraction)
    if max_gpu_total_bytes:
        candidates["max_gpu_total_bytes"] = int(max_gpu_total_bytes)
    tokens_cap = layout.bytes_for_tokens(max_tokens, max_seq_len) if max_tokens else None
    if tokens_cap is not None:
        candidates["max_tokens"] = tokens_cap
    unbounded = None
    if candidates:
        limited_by: str | None = min(candidates, key=lambda k: candidates[k])
        budget: int | None = candidates[limited_by]
    else:
        limited_by, budget = None, None
        unbounded = (f"the free memory of {device} cannot be measured (no CUDA device)" if is_cuda(device)
                     else f"{device} has no free-memory rule to size it from")
    return KvBudget(
        device=str(device), free_bytes=free_bytes, weights_bytes=int(weights_bytes),
        free_gpu_memory_fraction=float(free_gpu_memory_fraction), max_gpu_total_bytes=int(max_gpu_total_bytes),
        max_tokens=max_tokens, max_seq_len=max_seq_len, tokens_cap_bytes=tokens_cap,
        bytes_per_token=layout.bytes_per_token, min_bytes=layout.min_bytes(), budget_bytes=budget,
        limited_by=limited_by, unbounded_reason=unbounded,
    )


@attrs.frozen
class PoolPlan:
    """The pools a budget buys: blocks per group, bytes, capacity in tokens, sequences at ``max_seq_len``."""

    num_blocks: dict[str, int]
    total_bytes: int
    capacity_tokens: int
    max_concurrency: int  # sequences of max_seq_len that fit at once
    slabs: int | None = None  # a slab arena (pool_arena): its slabs; num_blocks are then each group's id space


def plan_pools(layout: KvLayout, budget_bytes: int, max_seq_len: int, max_tokens: int | None = None) -> PoolPlan:
    """The pools a budget buys; :class:`BudgetError` if it cannot hold one block per group.

    With ``max_tokens`` (pass it when the ``max_tokens`` cap set the budget) the blocks are the ones
    :meth:`KvLayout.blocks_for_tokens` derives, so the pools hold ``max_tokens`` rounded up to one
    block per group, never a block per sequence more. Otherwise the budget is split over the groups
    by :meth:`KvLayout.split_budget` (a shared arena: ``budget // page_bytes`` pages every group counts).
    ``total_bytes`` counts a shared arena once.
    """
    if budget_bytes < layout.min_bytes():
        per_group = ", ".join(f"{g.name} {g.bytes_per_block}" for g in layout.groups)
        raise BudgetError(
            f"a KV budget of {budget_bytes} bytes cannot hold one block per layer group: "
            f"at least {layout.min_bytes()} bytes are needed (bytes per block: {per_group})"
        )
    if max_tokens:
        blocks = layout.blocks_for_tokens(max_tokens, max_seq_len)
    else:
        blocks = layout.split_budget(budget_bytes, max_seq_len)
    total = layout.pool_bytes(blocks)
    return PoolPlan(blocks, total, layout.capacity_tokens(blocks, max_seq_len),
                    layout.max_sequences(blocks, max_seq_len))


def arena_unfit_reason(layout: KvLayout) -> str | None:
    """Why ``layout``'s groups cannot draw on one slab arena (``pool_arena``), or None when they can: V2 groups of
    unequal pages, each dividing the largest (DeepSeek V4)."""
    if layout.manager != "v2":
        return "KV cache manager V1 keeps one pool of equal blocks"
    if len(layout.groups) < 2:
        return "the model has one layer group: one pool holds all of it"
    if layout.shared:
        return "the layer groups already share one arena of equal pages"
    slab = max(g.bytes_per_block for g in layout.groups)
    odd = [g.name for g in layout.groups if slab % g.bytes_per_block]
    if odd:
        return f"the pages of {', '.join(odd)} do not divide the largest ({slab} B), so slabs cannot be carved"
    return None


def slab_bytes(layout: KvLayout) -> int:
    """A slab arena's slab: the largest page."""
    return max(g.bytes_per_block for g in layout.groups)


def slabs_for_sequence(layout: KvLayout, length: int) -> int:
    """Slabs one sequence of ``length`` tokens takes alone in a slab arena (each group's blocks in slabs of its own)."""
    slab = slab_bytes(layout)
    return sum(-(-g.blocks_for(length) // (slab // g.bytes_per_block)) for g in layout.groups)


def arena_sequences(layout: KvLayout, slabs: int, length: int) -> int:
    """How many sequences of ``length`` tokens a slab arena of ``slabs`` slabs holds at once (the groups' blocks of
    all of them packed into whole slabs)."""
    slab = slab_bytes(layout)
    per = [(g.blocks_for(max(length, 1)), slab // g.bytes_per_block) for g in layout.groups]

    def fits(n: int) -> bool:
        return sum(-(-(n * b) // k) for b, k in per) <= slabs

    # the bound: every sequence takes at least a block of each group, so at most slabs * k sequences fit
    return longest(fits, max(1, slabs) * max(k for _, k in per))


def arena_longest(layout: KvLayout, slabs: int, most: int) -> int:
    """The longest sequence, up to ``most`` tokens, a slab arena of ``slabs`` slabs holds alone (0: none)."""
    return longest(lambda n: slabs_for_sequence(layout, n) <= slabs, most)


def plan_arena(layout: KvLayout, budget_bytes: int, max_seq_len: int) -> PoolPlan:
    """The slab arena a budget buys (``pool_arena``): ``budget // slab`` slabs, each group's ids ``slabs * k``;
    :class:`BudgetError` below one slab per group. ``capacity_tokens``: the longest sequence it holds alone, up to
    ``max_seq_len`` (no group's share is fixed, so no per-group figure is)."""
    slab = slab_bytes(layout)
    slabs = budget_bytes // slab
    if slabs < len(layout.groups):
        raise BudgetError(f"a KV budget of {budget_bytes} bytes holds {slabs} slabs of {slab} B; a slab arena needs "
                          f"one per layer group ({len(layout.groups)})")
    blocks = {g.name: slabs * (slab // g.bytes_per_block) for g in layout.groups}
    return PoolPlan(blocks, slabs * slab, arena_longest(layout, slabs, max_seq_len),
                    arena_sequences(layout, slabs, max_seq_len), slabs=slabs)
