"""The KV budget with several ranks: each rank computes its own, every rank takes the smallest.

TensorRT-LLM min-all-reduces the KV block count across tensor-parallel ranks; kvload gathers each
rank's whole budget and every rank adopts the smallest one (ties: the lowest rank), so the pools, their
block counts and the capacity are identical everywhere. The V2 host tier is agreed the same way
(the smallest rank's host bytes, split by one deterministic rule; none on every rank when any rank has none,
as when ranks on different accelerators choose the auto tier differently), and a rank that cannot build makes every
rank refuse, naming it.
"""

from __future__ import annotations

import attrs

from cache_backends.budget import KvBudget, PoolPlan, host_tier_bytes, host_tier_slots
from cache_backends.layout import KvLayout
from pipeline.ranks import Ranks


@attrs.frozen
class AgreedBudget:
    """The budget every rank takes, whose rank it was, and each rank's own budget in bytes (None: unbounded)."""

    budget: KvBudget
    reason: str
    limited_by_rank: int
    rank_budget_bytes: list[int | None]


def min_budget(ranks: Ranks, budget: KvBudget, reason: str) -> AgreedBudget:
    """All-gather every rank's budget; return the smallest (an unbounded budget is the largest)."""
    gathered: list[tuple[KvBudget, str]] = ranks.all_gather((budget, reason))
    sizes = [b.budget_bytes for b, _ in gathered]
    bounded = [r for r, n in enumerate(sizes) if n is not None]
    limiting = min(bounded, key=lambda r: (sizes[r], r)) if bounded else 0
    chosen, why = gathered[limiting]
    if len(set(sizes)) > 1 and bounded:
        why = (f"rank {limiting} has the smallest budget of the {ranks.world_size} ranks ({why}); every rank takes it "
               f"so all pools are identical (each rank's bytes: {', '.join(map(str, sizes))})")
    else:
        why = f"{why}; the same on all {ranks.world_size} ranks"
    return AgreedBudget(chosen, why, limiting, sizes)


def agree_rest(ranks: Ranks, layout: KvLayout, pools: PoolPlan | None, problem: str | None, host_size: int | None,
               host_slots: dict[str, int] | None, host_bytes: int | None
               ) -> tuple[str | None, int | None, dict[str, int] | None, int | None]:
    """Agree the build problem (any rank's stops every rank) and the V2 host tier (the smallest, split alike)."""
    gathered: list[tuple[str | None, int | None]] = ranks.all_gather((problem, host_bytes))
    if problem is None:
        other = next(((r, p) for r, (p, _) in enumerate(gathered) if p is not None), None)
        if other is not None:
            problem = f"rank {other[0]} cannot build its pools: {other[1]}"
    sizes = [b for _, b in gathered]
    if pools is not None and host_slots and 0 in sizes:
        # a rank without a tier (its own 0, or its accelerator's auto choice): the smallest is none, on every rank,
        # or one would suspend where another preempts and the per-step schedule check would part them mid-run
        return problem, 0, {}, 0
    if pools is not None and host_slots and all(b for b in sizes):
        smallest = min(sizes)  # type: ignore[type-var]
        if len(set(sizes)) > 1 or host_size is None:
            # one explicit size, split by one rule, gives every rank the same slots (auto-sizing reads local memory)
            host_size = int(smallest)
            host_slots = host_tier_slots(layout, pools.num_blocks, host_size, None)
            host_bytes = host_tier_bytes(layout, host_slots)
    return problem, host_size, host_slots, host_bytes

