"""The registry of KV cache manager kinds: one place that says what V1 and V2 are called and built from.

Routing, planning, building, the simulator, capacity reports and the CLI all read it, so the decision
``use_kv_cache_manager_v2 = true | false`` has one form below the tri-state: a :class:`ManagerKind`.
"""

from __future__ import annotations

import importlib

import attrs


@attrs.frozen
class ManagerKind:
    """One manager kind: its layout name, the tri-state value that routes to it, public class names."""

    name: str  # layout kind: "v1" (one uniform pool) or "v2" (a pool per layer group)
    use_v2: bool  # the resolved kv_cache_config.use_kv_cache_manager_v2 that selects it
    manager: str  # manager class name (public: routes, events, reports)
    scheduler: str  # scheduler class name
    summary: str  # what the route gives, for the route's reason
    module: str  # package holding both classes, imported only when built

    def classes(self) -> tuple[type, type]:
        """The (manager, scheduler) classes; the package is imported on first call."""
        package = importlib.import_module(self.module)
        return getattr(package, self.manager), getattr(package, self.scheduler)


V1 = ManagerKind("v1", False, "KVCacheManager", "GuaranteedNoEvictScheduler",
                 "one uniform pool, no-evict admission", "cache_backends.v1")
V2 = ManagerKind("v2", True, "KVCacheManagerV2", "KVCacheV2Scheduler",
                 "per-group pools, prefix reuse, suspend/resume", "cache_backends.v2")

#: Every kind, V1 first (the order reports and comparisons use).
KINDS: tuple[ManagerKind, ...] = (V1, V2)


def kind_for(use_v2: bool) -> ManagerKind:
    """The kind a resolved tri-state routes to (identity check: ``"auto"`` is not a bool)."""
    if use_v2 is True:
        return V2
    if use_v2 is False:
        return V1
    raise ValueError(f"use_kv_cache_manager_v2 must be resolved to true or false, got {use_v2!r}")


def kind_named(name: str) -> ManagerKind:
    """A kind by layout name (``"v1"``) or manager class name (``"KVCacheManagerV2"``)."""
    for kind in KINDS:
        if name in (kind.name, kind.manager):
            return kind
    raise KeyError(f"unknown KV cache manager {name!r}; known: "
                   + ", ".join(f"{k.name} ({k.manager})" for k in KINDS))


__all__ = ["KINDS", "V1", "V2", "ManagerKind", "kind_for", "kind_named"]
