"""kvload's pipeline: config classes, events, the audit log, the stage runner and the public API."""

from pipeline.api import LoadResult, execute, load, load_stages, plan, plan_stages, resolve_stages
from pipeline.audit import AuditLog, JsonlSink
from pipeline.bus import EventBus
from pipeline.config import AUTO, KvCacheConfig, LlmArgs, explicit_fields
from pipeline.context import Context, LoadRequest, ModelInfo, Route
from pipeline.errors import (
    AuditError,
    ConfigError,
    GenerationError,
    KvBuildError,
    KvloadError,
    ModelError,
    RouteError,
)
from pipeline.runner import Pipeline, Stage
from pipeline.version import __version__

__all__ = [
    "AUTO",
    "AuditError",
    "AuditLog",
    "ConfigError",
    "Context",
    "EventBus",
    "GenerationError",
    "JsonlSink",
    "KvBuildError",
    "KvCacheConfig",
    "KvloadError",
    "LlmArgs",
    "LoadRequest",
    "LoadResult",
    "ModelError",
    "ModelInfo",
    "Pipeline",
    "Route",
    "RouteError",
    "Stage",
    "__version__",
    "execute",
    "explicit_fields",
    "load",
    "load_stages",
    "plan",
    "plan_stages",
    "resolve_stages",
]
