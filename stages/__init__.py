"""Pipeline stages, one per module, named after the stage."""

from stages.apply_model_defaults import ApplyModelDefaults
from stages.build_kv_manager import BuildKvManager
from stages.load_weights import LoadWeights
from stages.parse_args import ParseArgs
from stages.plan_kv import KvPlan, PlanKv
from stages.resolve_auto import ResolveAuto
from stages.route_executor import RouteExecutor
from stages.snapshot_user_fields import SnapshotUserFields

__all__ = [
    "ApplyModelDefaults",
    "BuildKvManager",
    "KvPlan",
    "LoadWeights",
    "ParseArgs",
    "PlanKv",
    "ResolveAuto",
    "RouteExecutor",
    "SnapshotUserFields",
]
