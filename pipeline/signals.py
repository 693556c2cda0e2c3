"""SIGTERM handled like SIGINT, and short sections that no signal may cut in half.

``kvload`` turns SIGTERM into :class:`Terminated` (a ``KeyboardInterrupt``), so every cleanup
path that already runs for Ctrl-C (releasing pools, discarding a half-written audit file) runs
for ``kill`` too. :func:`deferred` holds both signals back while a temporary file is created or
published, so it is never left behind between ``open`` and the bookkeeping that removes it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

_HELD = {signal.SIGINT, signal.SIGTERM}


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived; raised where the program was, like ``KeyboardInterrupt`` for SIGINT."""

    signal_number = signal.SIGTERM


#: ``armed``: SIGTERM raises :class:`Terminated`; ``previous``: the handler :func:`handle_sigterm` replaced.
_state: dict[str, Any] = {"armed": False, "previous": signal.SIG_DFL}


def _raise_terminated(signum: int, frame: Any) -> None:
    if _state["armed"]:
        raise Terminated()
    # released (the command is over) but not yet swapped out: act as the handler kvload replaced would, never
    # raising into atexit callbacks or finalizers
    previous = _state["previous"]
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def handle_sigterm() -> None:
    """Make SIGTERM raise :class:`Terminated` in the main thread (a no-op elsewhere) until :func:`release_sigterm`."""
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
        if previous is not _raise_terminated:
            _state["previous"] = signal.SIG_DFL if previous is None else previous
        _state["armed"] = True


def release_sigterm() -> None:
    """Put back the SIGTERM handler :func:`handle_sigterm` replaced (once the command returned).

    After the command, interpreter shutdown runs atexit callbacks and finalizers (torch's, the process group's);
    a launcher's SIGTERM then (torchrun stopping the ranks left after one failed) raised ``Terminated`` inside them
    and Python printed "Exception ignored in atexit callback" with a traceback. Now such a signal acts as it would
    without kvload: by default it ends the process, with nothing printed.
    """
    if threading.current_thread() is threading.main_thread() and _state["armed"]:
        _state["armed"] = False  # first: a SIGTERM during the swap already acts as the previous handler
        signal.signal(signal.SIGTERM, _state["previous"])


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
