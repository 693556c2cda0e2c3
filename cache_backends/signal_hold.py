"""Holding the stop signals back for a block of code: their Python handlers swapped for one that only notes them.

Used where a signal's exception must not land inside a few lines (the kernel build while ``Popen`` starts the
compiler; ``pipeline.signals.deferred`` around the audit's temporary files). The signal mask alone does not hold a
Python handler: the mask is the calling thread's own, a signal sent to the process is taken by a thread that does not
block it (torch starts several), and the handler then runs in the main thread at once. Kept in the bottom layer so
the kernel build and the pipeline share it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any


@contextlib.contextmanager
def handlers_held(signums: Iterable[int]) -> Iterator[None]:
    """Note ``signums`` instead of running their Python handlers until the block ends, then run the first one noted,
    as it would have run (its exception raised there).

    Outside the main thread (where Python runs no handler) and for a signal whose handler Python did not set (the
    default action, ignored) nothing changes. The handlers are put back while still noting: a signal landing on one
    already put back raises there, and the rest are still put back before it goes on (none is left swapped)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    holding, noted = [True], []
    replaced: dict[int, Callable[[int, Any], Any]] = {}

    def note(signum: int, frame: Any) -> None:
        if holding[0]:
            noted.append(signum)
        else:  # (a signal taken before the swap was undone, run once the block is over)
            replaced[signum](signum, frame)

    try:
        for signum in signums:
            handler = signal.getsignal(signum)
            if callable(handler):
                replaced[signum] = handler
                signal.signal(signum, note)
        yield
    finally:
        raised = _put_back(replaced)
        holding[0] = False
        if raised is not None:
            raise raised
        if noted:
            replaced[noted[0]](noted[0], None)


def _put_back(replaced: dict[int, Callable[[int, Any], Any]]) -> BaseException | None:
    """Every handler of ``replaced`` set again; the first exception a signal raised meanwhile (from a handler already
    put back, or out of ``signal.signal`` itself, which runs pending handlers first), to raise once all are back."""
    raised = None
    for signum, handler in replaced.items():
        while True:
            try:
                signal.signal(signum, handler)
                break
            except BaseException as exc:  # a stop signal's exception: kept, raised once all are back
                raised = raised or exc
    return raised


__all__ = ["handlers_held"]
