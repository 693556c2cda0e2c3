"""Pipeline stages, one per module, named after the stage, and the stage lists ``plan`` and ``load`` run."""

from __future__ import annotations

from stages.agree_ranks import AgreeRanks
from stages.apply_model_defaults import ApplyModelDefaults
from stages.build_kv_manager import BuildKvManager
from stages.check_parallel import CheckParallel
from stages.load_weights import LoadWeights
from stages.parse_args import ParseArgs
from stages.plan_kv import KvPlan, PlanKv
from stages.resolve_auto import ResolveAuto
from stages.route_executor import RouteExecutor
from stages.snapshot_user_fields import SnapshotUserFields


def resolve_stages() -> list:
    """Stages 1–5: resolve the arguments and route the executor; with several ranks, check they all agree.

    ``check_parallel`` (the tensor-parallel size against the checkpoint and the ranks launched) runs
    before routing; ``agree_ranks`` (every rank resolved the same) after it, once the args are frozen.
    """
    return [ParseArgs(), SnapshotUserFields(), ApplyModelDefaults(), ResolveAuto(), CheckParallel(), RouteExecutor(),
            AgreeRanks()]


def plan_stages() -> list:
    """Stages 1–5, then ``plan_kv``: the KV layout, budget and pools ``load`` would build, allocating nothing."""
    return [*resolve_stages(), PlanKv()]


def load_stages() -> list:
    """All stages: resolve, route, load the weights (when asked), and build the KV cache manager.

    Weights come before the KV manager so the memory budget sees what they took.
    """
    return [*resolve_stages(), LoadWeights(), BuildKvManager()]


__all__ = [
    "AgreeRanks",
    "ApplyModelDefaults",
    "BuildKvManager",
    "CheckParallel",
    "KvPlan",
    "LoadWeights",
    "ParseArgs",
    "PlanKv",
    "ResolveAuto",
    "RouteExecutor",
    "SnapshotUserFields",
    "load_stages",
    "plan_stages",
    "resolve_stages",
]
