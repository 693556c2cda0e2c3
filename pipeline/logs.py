"""structlog wiring: a bus subscriber that logs each event, and the CLI's renderer set-up."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
#: Other engines' log levels → kvload's nearest (trtllm-serve's ``--log_level`` has verbose, trace and
#: internal_error; uvicorn's and vLLM's critical and trace): their users' habits act, not "invalid choice".
LEVEL_ALIASES = {"verbose": "debug", "trace": "debug", "critical": "error", "internal_error": "error"}


def log_level_named(text: str) -> str:
    """A log level as written (any case, another engine's name for a level) as kvload's nearest level's name;
    anything else as given (lowered), for the caller to refuse."""
    level = text.strip().lower()
    return LEVEL_ALIASES.get(level, level)


class HeldStream:
    """A text stream that holds lines until told whether the run succeeded.

    The CLI logs through it at its default level: on success the held warnings go to stderr; on
    failure they are dropped, so the one-line error is all a user sees.
    """

    def __init__(self, target: TextIO | None = None) -> None:
        self._target = target
        self._held: list[str] = []
        self._through = False

    def write(self, text: str) -> int:
        """Hold ``text`` (or write it at once, after :meth:`pass_through`)."""
        if self._through:
            self._emit(text)
        else:
            self._held.append(text)
        return len(text)

    def flush(self) -> None:
        """Nothing to do until :meth:`release`."""

    def pass_through(self) -> None:
        """The outcome that holding waits for is known early (a server that loaded and now serves): write what
        was held and, from now on, every line as it comes — an operator sees a warning while it matters."""
        self.release(True)
        self._through = True

    def release(self, ok: bool) -> None:
        """Write what was held (``ok``) or drop it."""
        if ok and self._held:
            self._emit("".join(self._held))
        self._held.clear()

    def _emit(self, text: str) -> None:
        # a stderr that cannot take the lines (a full disk, closed) has nowhere to say so either: the warnings are
        # lost, not the run; the OSError made a run that had succeeded (its --audit-log published) exit 1
        target = self._target or sys.stderr
        if target is None:  # started with stderr closed (`2>&-`): Python's sys.stderr is None
            return
        with contextlib.suppress(OSError, ValueError):
            target.write(text)
            target.flush()


def configure_logging(fmt: str = "console", level: str = "info", stream: TextIO | None = None) -> None:
    """Send structlog output to ``stream`` (stderr) as console lines or JSON, at ``level`` and above."""
    renderer: Any = (
        structlog.processors.JSONRenderer(sort_keys=False)
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False, sort_keys=False)
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )


#: Environment variables a library user (or the CLI, as its flags' defaults) sets kvload's logging with.
LEVEL_ENV, FORMAT_ENV = "KVLOAD_LOG_LEVEL", "KVLOAD_LOG_FORMAT"
FORMATS = ("console", "json")


def env_log_settings() -> tuple[str | None, str | None]:
    """``(level, format)`` from ``KVLOAD_LOG_LEVEL`` / ``KVLOAD_LOG_FORMAT`` (None when unset).

    A value that is not accepted is a ``ConfigError`` naming the variable.
    """
    from pipeline.errors import ConfigError
    from pipeline.limits import short_text  # quoted and cut: the line must stay one readable line

    level = log_level_named(os.environ.get(LEVEL_ENV, "")) or None
    fmt = os.environ.get(FORMAT_ENV, "").strip().lower() or None
    if level is not None and level not in _LEVELS:
        raise ConfigError(f"{LEVEL_ENV}={short_text(os.environ[LEVEL_ENV])}: expected one of {', '.join(_LEVELS)}")
    if fmt is not None and fmt not in FORMATS:
        raise ConfigError(f"{FORMAT_ENV}={short_text(os.environ[FORMAT_ENV])}: expected one of {', '.join(FORMATS)}")
    return level, fmt


def logging_configured() -> bool:
    """Whether the application set up the standard library's ``logging`` (a handler on root or ``kvload``)."""
    return bool(logging.getLogger().handlers or logging.getLogger(LOGGER_NAME).handlers)


#: The standard-library logger kvload's events go to when an application configured ``logging``.
LOGGER_NAME = "kvload"


def _renderer(fmt: str | None) -> Any:
    if fmt == "json":
        return structlog.processors.JSONRenderer(sort_keys=False)
    return structlog.dev.ConsoleRenderer(colors=False, sort_keys=False)


def _library_logger() -> Any:
    """Where kvload's events go when kvload is used as a library, first match wins:

    1. an application that configured structlog (or pytest-structlog) gets them as structlog events;
    2. one that configured the standard library's ``logging`` gets them as records of the ``kvload``
       logger (message = the event name, the payload in ``extra`` and in the message), at the
       event's level, so its handlers, formatters and levels decide;
    3. otherwise warnings and errors go to stderr, one line each, as the CLI prints them.
    ``KVLOAD_LOG_LEVEL`` sets the least severe event passed on in routes 2 (default: every event; the
    handlers' levels still apply) and 3 (default: warning); ``KVLOAD_LOG_FORMAT`` (console, json) the
    format of route 3. In route 1 the structlog configuration decides (the CLI reads both variables as
    the defaults of ``--log-level`` / ``--log-format``).
    """
    if structlog.is_configured():
        return structlog.get_logger(LOGGER_NAME)
    level, fmt = env_log_settings()
    if logging_configured():
        std = logging.getLogger(LOGGER_NAME)
        return structlog.wrap_logger(
            std, processors=[_StdlibRecord()],
            wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level] if level else logging.DEBUG))
    return structlog.wrap_logger(
        structlog.PrintLogger(sys.stderr),
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True),
                    _renderer(fmt)],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level or "warning"]),
    )


class _StdlibRecord:
    """structlog processor: hand an event to a ``logging.Logger`` as ``msg`` plus ``extra``."""

    def __call__(self, logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        event = event_dict.pop("event")
        detail = " ".join(f"{k}={v!r}" for k, v in event_dict.items())
        return {"msg": f"{event} {detail}".rstrip(), "extra": {"kvload_event": event, "kvload": dict(event_dict)}}


class StructlogSubscriber:
    """Logs every bus record through structlog, at the event's level, with the payload as keys."""

    def __init__(self, logger: Any = None) -> None:
        self._logger = logger if logger is not None else _library_logger()

    def __call__(self, record: dict[str, Any]) -> None:
        payload = {k: v for k, v in record.items() if k not in ("event", "level", "ts")}
        # the log's reader gone (a broken pipe, a full disk): the line is lost, as logging's handlers lose it, and
        # the work that emitted it (a serving step) and the subscribers after this one go on
        with contextlib.suppress(OSError):
            getattr(self._logger, record.get("level", "info"))(record["event"], **payload)
