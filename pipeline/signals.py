"""SIGTERM handled like SIGINT, and short sections that no signal may cut in half.

``kvload`` turns SIGTERM into :class:`Terminated` (a ``KeyboardInterrupt``), so every cleanup
path that already runs for Ctrl-C (releasing pools, discarding a half-written audit file) runs
for ``kill`` too. :func:`deferred` holds both signals back while a temporary file is created or
published, so it is never left behind between ``open`` and the bookkeeping that removes it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

_HELD = {signal.SIGINT, signal.SIGTERM}


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived; raised where the program was, like ``KeyboardInterrupt`` for SIGINT."""

    signal_number = signal.SIGTERM


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def handle_sigterm() -> None:
    """Make SIGTERM raise :class:`Terminated` in the main thread (a no-op elsewhere)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends; they are delivered (and raise) right after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
