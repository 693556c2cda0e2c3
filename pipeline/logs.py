"""structlog wiring: a bus subscriber that logs each event, and the CLI's renderer set-up."""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class HeldStream:
    """A text stream that holds lines until told whether the run succeeded.

    The CLI logs through it at its default level: on success the held warnings go to stderr; on
    failure they are dropped, so the one-line error is all a user sees.
    """

    def __init__(self, target: TextIO | None = None) -> None:
        self._target = target
        self._held: list[str] = []

    def write(self, text: str) -> int:
        """Hold ``text``."""
        self._held.append(text)
        return len(text)

    def flush(self) -> None:
        """Nothing to do until :meth:`release`."""

    def release(self, ok: bool) -> None:
        """Write what was held (``ok``) or drop it."""
        if ok and self._held:
            target = self._target or sys.stderr
            target.write("".join(self._held))
            target.flush()
        self._held.clear()


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


def _library_logger() -> Any:
    # An application that configured structlog (or pytest-structlog) gets our events as is; one
    # that did not should not see every info event on stdout, so we default to warnings on stderr.
    if structlog.is_configured():
        return structlog.get_logger("kvload")
    return structlog.wrap_logger(
        structlog.PrintLogger(sys.stderr),
        processors=[structlog.processors.add_log_level, structlog.dev.ConsoleRenderer(colors=False)],
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    )


class StructlogSubscriber:
    """Logs every bus record through structlog, at the event's level, with the payload as keys."""

    def __init__(self, logger: Any = None) -> None:
        self._logger = logger if logger is not None else _library_logger()

    def __call__(self, record: dict[str, Any]) -> None:
        payload = {k: v for k, v in record.items() if k not in ("event", "level")}
        getattr(self._logger, record.get("level", "info"))(record["event"], **payload)
