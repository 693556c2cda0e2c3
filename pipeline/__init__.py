"""kvload's resolution core: config classes, the converter, events, bus, audit log, context, errors, runner.

Importing ``pipeline`` (or any module of it) loads nothing else: each name below is imported on first
use. ``pipeline.plan`` / ``pipeline.load`` / ``pipeline.LoadResult`` are the public API, which lives
in the face layer (:mod:`kvload.api`); they are re-exported here, lazily, so ``pipeline.plan(...)``
keeps working while ``import models`` (which uses :mod:`pipeline.errors`) stays light.
"""

from __future__ import annotations

from pipeline.lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS = {
    "AUTO": "pipeline.config",
    "KvCacheConfig": "pipeline.config",
    "LlmArgs": "pipeline.config",
    "explicit_fields": "pipeline.config",
    "AuditLog": "pipeline.audit",
    "JsonlSink": "pipeline.audit",
    "EventBus": "pipeline.bus",
    "Context": "pipeline.context",
    "LoadRequest": "pipeline.context",
    "ModelInfo": "pipeline.context",
    "Route": "pipeline.context",
    "AuditError": "pipeline.errors",
    "ConfigError": "pipeline.errors",
    "GenerationError": "pipeline.errors",
    "KvBuildError": "pipeline.errors",
    "KvloadError": "pipeline.errors",
    "ModelError": "pipeline.errors",
    "RouteError": "pipeline.errors",
    "Pipeline": "pipeline.runner",
    "Stage": "pipeline.runner",
    "RunResult": "pipeline.run",
    "__version__": "pipeline.version",
    # the public API (face layer), re-exported for ``pipeline.plan`` / ``pipeline.load``
    "LoadResult": "kvload.api",
    "execute": "kvload.api",
    "load": "kvload.api",
    "plan": "kvload.api",
    "load_stages": "stages",
    "plan_stages": "stages",
    "resolve_stages": "stages",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), submodules=True)
