"""Run one request through stages with the standard subscribers, and what the run produced (:class:`RunResult`)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from pipeline.audit import AuditLog, check_output_path
from pipeline.bus import EventBus, Subscriber
from pipeline.config import LlmArgs
from pipeline.context import Context, LoadRequest, ModelInfo, Route
from pipeline.errors import ConfigError, KvloadError
from pipeline.limits import checked_flag, short_py, short_text
from pipeline.logs import StructlogSubscriber
from pipeline.ranks import close_rank_audit, rank_audit_sink, ranks_from_env
from pipeline.runner import Pipeline, Stage


@attrs.define
class RunResult:
    """What a run produced: frozen resolved args, the route, the model, the audit log, the context."""

    args: LlmArgs
    route: Route
    model: ModelInfo
    audit: AuditLog
    context: Context
    bus: EventBus | None = None  # the run's bus: later events (generate) continue the audit's seq

    @property
    def kv(self) -> Any:
        """The KV plan (geometry, budget, capacity) when the run computed one."""
        return self.context.kv

    @property
    def sampling_defaults(self) -> Any:
        """The sampling defaults of requests that leave a setting unset (the model's generation_config.json under
        ``override_generation_config``): a ``pipeline.generation_config.SamplingDefaults``, empty when the stages
        did not read one."""
        found = self.context.sampling_defaults
        if found is None:
            from pipeline.generation_config import SamplingDefaults

            return SamplingDefaults(reason="apply_model_defaults did not run: kvload's built-in sampling defaults")
        return found

    @property
    def kv_manager(self) -> Any:
        """The built KV cache manager (``load`` only)."""
        return self.context.kv_manager

    def reset_prefix_cache(self) -> None:
        """Forget the KV manager's cached prefixes (``load`` only); refused while requests hold a cache."""
        if self.kv_manager is None:
            raise RuntimeError("reset_prefix_cache: this result has no KV cache manager (use load, not plan)")
        self.kv_manager.reset_prefix_cache()

    @property
    def hf_model(self) -> Any:
        """The transformers model with weights (``load(..., load_weights=True)`` only)."""
        return self.context.hf_model

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer, when it has one and weights were loaded."""
        return self.context.tokenizer

    @property
    def scheduler(self) -> Any:
        """The scheduler paired with the manager (``load`` only)."""
        return self.context.scheduler

    def close(self) -> None:
        """Release the pools and anything else the run allocated."""
        self.context.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


R = TypeVar("R", bound=RunResult)


def flag_argument(name: str, value: Any) -> bool:
    """A flag of the Python API (``log``, ``load_weights``) as Python's bool (numpy's bool and a 0-d bool tensor
    taken); anything else is a ``ConfigError`` naming the argument: "no" or 0 would silently mean the opposite of what
    was meant."""
    return checked_flag(value, lambda why: ConfigError(f"{name}: {why}"))


def path_argument(name: str, value: Any) -> str:
    """A file argument of the Python API (``config_file``, ``audit_log``) as a string: a ``str`` or an ``os.PathLike``
    giving one; anything else (an int, bytes, a list) is a ``ConfigError`` naming the argument, where ``os.fspath``
    raised a bare ``TypeError`` that named none."""
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str):
        raise ConfigError(f"{name}: expected a path (a str or os.PathLike), got {short_py(value)}")
    if "\x00" in text:  # open() and os.stat raised a bare "embedded null byte"
        raise ConfigError(f"{name}: a path cannot hold a NUL character (at character {text.index(chr(0))}), got "
                          f"{short_text(text)}")
    try:  # a surrogateescape'd name (os.listdir of a non-UTF-8 one) encodes back; a lone '\ud800' does not
        os.fsencode(text)
    except UnicodeEncodeError as exc:  # it escaped as "parse_args: UnicodeEncodeError: 'utf-8' codec can't ..."
        raise ConfigError(f"{name}: not a path the file system can hold (a lone surrogate at character "
                          f"{exc.start}), got {short_text(text)}") from None
    return text


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file: the same real path, or two names of it (a hard link); a path that does not
    exist yet names no file another does."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def _subscribers(value: Any) -> list[Subscriber]:
    """``subscribers``: callables, each given every event record; anything else is a ``ConfigError`` naming it before
    anything runs (a non-iterable was a bare ``TypeError`` naming nothing, a non-callable one raised at the first
    event, mid-stage)."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ConfigError(f"subscribers: expected a list of callables (each called with every event record), got "
                          f"{type(value).__name__}")
    subs = list(value)
    for i, sub in enumerate(subs):
        if not callable(sub):
            raise ConfigError(f"subscribers[{i}]: expected a callable (called with every event record), got "
                              f"{type(sub).__name__}")
    return subs


def execute(
    request: LoadRequest,
    stages: Sequence[Stage] | Pipeline,
    *,
    audit_log: str | os.PathLike[str] | None = None,
    subscribers: Iterable[Subscriber] = (),
    log: bool = True,
    result_type: type[R] = RunResult,  # type: ignore[assignment]
) -> R:
    """Run a request through stages with the standard subscribers; the CLI, the API and the engine use this.

    Under torchrun each rank runs the stages; rank 0 writes ``audit_log`` as given, rank N writes
    ``<stem>.rankN<suffix>`` beside it (:func:`pipeline.ranks.rank_audit_path`).
    """
    log = flag_argument("log", log)
    subscribers = _subscribers(subscribers)
    pipeline = stages if isinstance(stages, Pipeline) else Pipeline(stages)
    audit = AuditLog()
    ranks = ranks_from_env()
    sink = None
    if audit_log is not None:  # a directory or missing parent fails now, not after the whole load
        audit_log = path_argument("audit_log", audit_log)
        if ranks.rank != 0:  # rank N writes another file (rank_audit_sink checks it): the path as given fails first
            check_output_path(audit_log, flag="audit_log")
        config_file = getattr(request, "config_file", None)
        if config_file and same_file(audit_log, config_file):  # the log replaced the YAML this call had just read
            raise ConfigError(f"audit_log {audit_log}: is the config_file this call reads; give the audit log a "
                              "file of its own")
        sink = rank_audit_sink(audit_log, ranks, flag="audit_log")  # as the CLI's --audit-log, always replacing
    subs: list[Subscriber] = [audit]
    if log:
        subs.append(StructlogSubscriber())
    if sink is not None:
        subs.append(sink)
    subs.extend(subscribers)
    ctx = Context(request=request, ranks=ranks)
    bus = EventBus(subs)
    try:
        pipeline.run(ctx, bus)
    except BaseException as exc:
        if sink is not None:
            close_rank_audit(sink, ranks, ok=False)
        if isinstance(exc, KvloadError):  # the events up to stage_failed, for a caller asking why (no file is left)
            exc.audit = audit  # type: ignore[attr-defined]
        raise
    if sink is not None:  # the file is complete; later events (generate) reach the in-memory log only
        close_rank_audit(sink, ranks, ok=True)
        bus.unsubscribe(sink)
    return result_type(args=ctx.args, route=ctx.route, model=ctx.model, audit=audit, context=ctx, bus=bus)


__all__ = ["RunResult", "execute"]
