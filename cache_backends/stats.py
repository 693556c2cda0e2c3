"""What ``stats()`` of either KV cache manager returns: one shape for V1 and V2.

The simulator, the executor, the server's metrics and ``kvload run --json`` read these attributes
without asking which manager they hold; what a manager does not do reads as zero, ``None`` or
disabled with a reason (V1 never suspends, has no host tier and no radix tree). Counters count since
the manager was built (a ``reset_prefix_cache`` does not zero them). :meth:`ManagerStats.to_dict`
is the JSON form.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class GroupStats:
    """Blocks of one layer group's device pool, by state."""

    total: int  # blocks in the pool (a shared arena: all its pages, what the group could hold alone)
    free: int  # blocks holding nothing (neither used nor cached; a shared arena: the arena's free pages)
    evictable: int  # blocks nobody uses that hold a cached prefix (allocation may take them back)
    used: int  # blocks with at least one owner; free + evictable + used == total (a shared arena:
    #            free + the sum of every group's evictable + used == total)
    usage: float  # used / total (evictable blocks count as not used)
    evictions: int  # cached blocks overwritten by allocation since the manager was built
    tokens_per_block: int  # tokens one block of this group spans
    shared: bool = False  # its pages come from an arena shared with other groups (``free`` is the arena's)
    # a slab arena (pool_arena): the slabs the group owns now; ``total`` is their blocks, and moves as the group takes
    # slabs and gives them back (None: the group's pool has a fixed size)
    slabs: int | None = None


@attrs.frozen
class HostStats:
    """Slots of one layer group's host tier (suspended requests' pages)."""

    total: int  # host slots, one block each (a shared arena's tier: every group's, what it could hold alone)
    used: int  # slots holding a suspended request's block of this group


@attrs.frozen
class ReuseStats:
    """Whether prefix reuse is on, at what granularity, and why not."""

    enabled: bool  # full-block prefix reuse is on
    disabled_reason: str | None  # why it is off, None when on
    unit_tokens: int | None  # tokens a reusable unit spans, None when reuse is off
    partial: bool  # partial-block reuse (a hit ending inside a block) is on
    partial_disabled_reason: str | None  # why partial reuse is off, None when on
    radix_nodes: int  # nodes of the prefix tree (V1 keys blocks in a flat table: 0)


@attrs.frozen
class ManagerStats:
    """A manager's pools, requests and counters at one moment, in the same shape for V1 and V2."""

    kind: str  # "v1" or "v2" (cache_backends.kinds)
    usage: float  # fraction of device KV memory in use (bytes-weighted across groups)
    groups: dict[str, GroupStats]  # per layer group, by group name
    requests: int  # requests holding a cache: active + suspended
    active: int  # requests whose blocks are on the device
    suspended: int  # requests whose cache is suspended (V2; pages on the host tier or dropped)
    reuse_hit_tokens: int  # prompt tokens served from the prefix cache
    reuse_query_tokens: int  # prompt tokens looked up in the prefix cache (the hit rate's denominator)
    reuse_partial_hits: int  # hits that ended inside a block (V2 partial reuse)
    evictions: int  # sum of the groups' evictions
    suspends: int  # caches suspended (V2)
    resumes: int  # suspended caches resumed (V2)
    preemptions: int  # caches dropped to be recomputed (V2; V1 never preempts: 0)
    host: dict[str, HostStats] | None  # host tier per layer group, None without a host tier
    host_bytes: int  # bytes of host memory the host tier holds, 0 without one
    reuse: ReuseStats  # prefix reuse settings
    memory: str | None = None  # V2 with several groups: one arena shared by all, or split between them (why)
    # a slab arena (pool_arena): {"slabs", "free_slabs", "slab_bytes", "slabs_taken", "slabs_reclaimed",
    # "evicted_by_reclaim", "slabs_returned"}; None without one
    arena: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts, lists and numbers (JSON-ready)."""
        return attrs.asdict(self)


__all__ = ["GroupStats", "HostStats", "ManagerStats", "ReuseStats"]
