"""SIGTERM and SIGHUP handled like SIGINT, and short sections that no signal may cut in half.

``kvload`` turns SIGTERM into :class:`Terminated` and SIGHUP (a closed terminal, a dropped ssh
session) into :class:`HungUp` (both ``KeyboardInterrupt``), so every cleanup path that already runs
for Ctrl-C (releasing pools, discarding a half-written audit file, killing a kernel compile) runs
for ``kill`` and a hangup too. :func:`deferred` holds the signals back while a temporary file is created or
published, so it is never left behind between ``open`` and the bookkeeping that removes it.

A stop signal whose exception Python swallows is sent again. The handler raises where the main thread is, and when
that is a finalizer (a ``__del__``, a generator closed by the garbage collector, a weakref callback) Python only
reports it to :func:`sys.unraisablehook` ("Exception ignored in ...") and goes on: the command ran to its end and
exited 0 as if never stopped. While armed, kvload's hook has that signal sent to the process again (from a thread of
its own), so it is raised once the main thread is out of the finalizer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from cache_backends.signal_hold import handlers_held

#: Signals :func:`handle_sigterm` turns into :class:`Terminated` (SIGINT already raises ``KeyboardInterrupt``).
_HANDLED = (signal.SIGTERM, signal.SIGHUP)
_HELD = {signal.SIGINT, *_HANDLED}


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived; raised where the program was, like ``KeyboardInterrupt`` for SIGINT."""

    signal_number = signal.SIGTERM
    #: how the one-line error names it
    describe = "terminated (SIGTERM)"


class HungUp(Terminated):
    """SIGHUP arrived (the terminal closed, the ssh session dropped): cleaned up as for SIGTERM."""

    signal_number = signal.SIGHUP
    describe = "hung up (SIGHUP)"


#: ``armed``: the signals raise :class:`Terminated`; ``previous``: the handlers :func:`handle_sigterm` replaced;
#: ``unraisable``: the :func:`sys.unraisablehook` it replaced (``None`` while not armed).
_state: dict[str, Any] = {"armed": False, "previous": {}, "unraisable": None}


def _swallowed_stop(unraisable: Any) -> None:
    """:func:`sys.unraisablehook` while armed: a stop signal's exception raised inside a finalizer, which Python would
    only print and drop, is sent as its signal again (raised outside it); anything else goes to the hook replaced."""
    exc = unraisable.exc_value
    if _state["armed"] and isinstance(exc, KeyboardInterrupt):
        signum = exc.signal_number if isinstance(exc, Terminated) else signal.SIGINT
        # sent a moment later from another thread: sent at once, its handler ran inside this hook (or in
        # Thread.start's wait, still inside it), and that raise was dropped too
        again = threading.Timer(0.05, os.kill, (os.getpid(), signum))
        again.daemon = True
        try:
            again.start()
        except RuntimeError:  # no new thread at interpreter shutdown: reported as Python would
            pass
        else:
            return
    (_state["unraisable"] or sys.__unraisablehook__)(unraisable)


def _raise_terminated(signum: int, frame: Any) -> None:
    if _state["armed"]:
        raise HungUp() if signum == signal.SIGHUP else Terminated()
    # released (the command is over) but not yet swapped out: act as the handler kvload replaced would, never
    # raising into atexit callbacks or finalizers
    previous = _state["previous"].get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def handle_sigterm() -> None:
    """Make SIGTERM and SIGHUP raise :class:`Terminated` (:class:`HungUp`) in the main thread (a no-op elsewhere)
    until :func:`release_sigterm`. An ignored SIGHUP stays ignored: ``nohup kvload ...`` asked for that."""
    if threading.current_thread() is threading.main_thread():
        for signum in _HANDLED:
            if signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN:
                continue
            previous = signal.signal(signum, _raise_terminated)
            if previous is not _raise_terminated:
                _state["previous"][signum] = signal.SIG_DFL if previous is None else previous
        if sys.unraisablehook is not _swallowed_stop:
            _state["unraisable"] = sys.unraisablehook
            sys.unraisablehook = _swallowed_stop
        _state["armed"] = True


def release_sigterm() -> None:
    """Put back the SIGTERM and SIGHUP handlers :func:`handle_sigterm` replaced (once the command returned).

    After the command, interpreter shutdown runs atexit callbacks and finalizers (torch's, the process group's);
    a launcher's SIGTERM then (torchrun stopping the ranks left after one failed) raised ``Terminated`` inside them
    and Python printed "Exception ignored in atexit callback" with a traceback. Now such a signal acts as it would
    without kvload: by default it ends the process, with nothing printed.
    """
    if threading.current_thread() is threading.main_thread() and _state["armed"]:
        _state["armed"] = False  # first: a signal during the swap already acts as the previous handler
        for signum, previous in _state["previous"].items():
            signal.signal(signum, previous)
        if sys.unraisablehook is _swallowed_stop:
            sys.unraisablehook = _state["unraisable"] or sys.__unraisablehook__
        _state["unraisable"] = None


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP until the block ends; they are delivered (and raise) right after it.

    Held twice over: their Python handlers noted instead of run (:func:`cache_backends.signal_hold.handlers_held`: a
    signal sent to the process is taken by any thread that does not block it, torch starts several, and its Python
    handler then ran in the main thread at once, inside the block); and blocked in the calling thread, which holds a
    default action (SIGTERM before :func:`handle_sigterm`) only while no other thread can take it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        with handlers_held(_HELD):
            try:
                yield
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
    finally:  # (put back once more: a signal's exception out of the handlers' restore must not leave it blocked)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
