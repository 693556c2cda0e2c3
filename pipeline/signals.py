"""SIGTERM and SIGHUP handled like SIGINT, a stop under way not cut short by another, and short sections that no
signal may cut in half.

``kvload`` turns SIGTERM into :class:`Terminated` and SIGHUP (a closed terminal, a dropped ssh
session) into :class:`HungUp` (both ``KeyboardInterrupt``), so every cleanup path that already runs
for Ctrl-C (releasing pools, discarding a half-written audit file, killing a kernel compile) runs
for ``kill`` and a hangup too. :func:`deferred` holds the signals back while a temporary file is created or
published, so it is never left behind between ``open`` and the bookkeeping that removes it.

One stop at a time. Once a stop signal was taken (its exception raised, or :func:`stopping`: ``kvload serve``'s server
stopped on one, a tensor-parallel rank waits for rank 0's stop), another one within ``REPEAT_S`` repeats that stop
and raises nothing: the cleanup it started, the command's teardown and its one line run to their end, with the first
signal's exit status. torchrun passes a terminal's Ctrl-C on to ranks the terminal already reached (every rank gets
it twice), and a second Ctrl-C pressed at once raised into the cleanup of the first (a traceback from a finalizer,
exit -15 from a SIGTERM in the exit, an unpublished audit). One later than that acts as before (raised: a teardown
that long is cut short as the user asks). A process that ends with its command (:func:`ends_process`) ignores them
for its exit within ``REPEAT_S`` (later, one ends it: its default action).

A stop signal whose exception Python swallows is sent again. The handler raises where the main thread is, and when
that is a finalizer (a ``__del__``, a generator closed by the garbage collector, a weakref callback) Python only
reports it to :func:`sys.unraisablehook` ("Exception ignored in ...") and goes on: the command ran to its end and
exited 0 as if never stopped. While armed, kvload's hook has that signal sent to the process again (from a thread of
its own), so it is raised once the main thread is out of the finalizer. C code that clears it (torch's start-up does
so with whatever its numpy import raised) reports nothing: a thread of kvload's sees the stop's exception held by
nobody but this module, with no stop taken, and sends the signal again, so the command stops within a fraction of a
second with the first signal's line and status (it had gone on as if never stopped, or failed on the half-imported
numpy: a rank under torchrun, which sends one SIGTERM, ran on until its SIGKILL 30 s later). Any failure before that
is reported as the stop (:func:`dropped_stop`): the stop came first and was ending the command anyway. The watcher
looks only while armed: a stop dropped in the command's last moments is handed back by :func:`release_sigterm` for
the command to report it as taken.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from cache_backends.signal_hold import handlers_held

#: Signals :func:`handle_sigterm` turns into :class:`Terminated` (SIGINT raises ``KeyboardInterrupt``).
_HANDLED = (signal.SIGTERM, signal.SIGHUP)
_HELD = {signal.SIGINT, *_HANDLED}
#: Seconds after a stop was taken during which another stop signal repeats it (raises nothing)
REPEAT_S = 3.0
#: Seconds between two looks of the watcher (:func:`_watch`) at a stop's exception not yet taken; it resends a
#: dropped one on its second look (one look could fall between the handler's store of the exception and its raise)
_WATCH_S = 0.05


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived; raised where the program was, like ``KeyboardInterrupt`` for SIGINT."""

    signal_number = signal.SIGTERM
    #: how the one-line error names it
    describe = "terminated (SIGTERM)"


class HungUp(Terminated):
    """SIGHUP arrived (the terminal closed, the ssh session dropped): cleaned up as for SIGTERM."""

    signal_number = signal.SIGHUP
    describe = "hung up (SIGHUP)"


#: ``armed``: the signals raise; ``previous``: the handlers :func:`handle_sigterm` replaced; ``unraisable``: the
#: :func:`sys.unraisablehook` it replaced (``None`` while not armed); ``taken``: when the stop under way was taken
#: (``time.monotonic()``; ``None``: none); ``ends_process``: :func:`ends_process` was called.
#: ``exit_taken``: the ``taken`` of the stop a process that ends with its command exits on. ``raised``: the stop's
#: exception until the command took it (:func:`stopping`); one only this module still holds was dropped unseen.
#: ``watcher``: ``(pid, lock)`` of :func:`_watch`'s thread in process ``pid``, woken by releasing ``lock``.
_state: dict[str, Any] = {"armed": False, "previous": {}, "unraisable": None, "taken": None, "ends_process": False,
                          "exit_taken": 0.0, "raised": None, "watcher": None}


def _stop_exception(signum: int) -> KeyboardInterrupt:
    return HungUp() if signum == signal.SIGHUP else Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _swallowed_stop(unraisable: Any) -> None:
    """:func:`sys.unraisablehook` while armed: a stop signal's exception raised inside a finalizer, which Python would
    only print and drop, is sent as its signal again (raised outside it); anything else goes to the hook replaced."""
    exc = unraisable.exc_value
    if _state["armed"] and isinstance(exc, KeyboardInterrupt):
        signum = exc.signal_number if isinstance(exc, Terminated) else signal.SIGINT
        _untake()  # the stop was dropped: the signal sent again must raise, not repeat it
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


def _dropped() -> int | None:
    """The signal of the stop whose exception was dropped unseen (held by :data:`_state` alone: code that drops every
    error cleared it, and the command never took it); None if there is none."""
    exc = _state["raised"]
    if exc is None or sys.getrefcount(exc) > 3:  # (this dict's reference, this local's, the call's)
        return None
    return exc.signal_number if isinstance(exc, Terminated) else signal.SIGINT


def _watch(wake: Any) -> None:
    """The watcher's thread: from each stop raised (``wake`` released) until it is taken or the command is over, the
    stop's signal sent again while its exception is dropped (its handler, :func:`_repeated_stop`, raises it anew)."""
    while True:
        wake.acquire()
        looks = 0
        while _state["armed"] and _state["raised"] is not None:
            time.sleep(_WATCH_S)
            signum = _dropped()
            looks = looks + 1 if signum is not None else 0
            if looks >= 2:
                looks = 0
                os.kill(os.getpid(), signum)


def _start_watcher() -> None:
    """:func:`_watch`'s thread, once per process, before any stop: a thread started from a signal's handler could
    wait forever on a lock of ``threading``'s the interrupted main thread holds."""
    if _state["watcher"] is None or _state["watcher"][0] != os.getpid():  # none yet, or it stayed in a forked parent
        wake = threading.Lock()
        wake.acquire()
        threading.Thread(target=_watch, args=(wake,), name="stop-watcher", daemon=True).start()
        _state["watcher"] = (os.getpid(), wake)


def _raise_terminated(signum: int, frame: Any) -> None:
    """SIGINT, SIGTERM and SIGHUP while armed: the stop is taken and its exception raised where the main thread is."""
    if _state["armed"]:
        _take()
        # kept here, in no local of this frame (its traceback holds the frame): see _dropped
        _state["raised"] = _stop_exception(signum)
        if _state["watcher"] is not None:
            with contextlib.suppress(RuntimeError):  # (released already: a wake-up is pending)
                _state["watcher"][1].release()
        raise _state["raised"]
    # released (the command is over) but not yet swapped out: act as the handler kvload replaced would, never
    # raising into atexit callbacks or finalizers
    previous = _state["previous"].get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _repeated_stop(signum: int, frame: Any) -> None:
    """A stop signal while a stop is under way: nothing raised into its cleanup within ``REPEAT_S`` of it; later, as
    before (a teardown that long is cut short as asked)."""
    taken = _state["taken"]
    if not _state["armed"]:
        return
    if _dropped() is not None:
        # the stop's exception is gone and the command never took it: code that drops every error cleared it (torch's
        # C start-up does so with whatever its numpy import raised); nobody is stopping, so this one is a first stop
        # (sent by the watcher, or by the user)
        _state["taken"] = None
        _raise_terminated(signum, frame)
    if taken is None or time.monotonic() - taken > REPEAT_S:
        raise _stop_exception(signum)


def _exiting_stop(signum: int, frame: Any) -> None:
    """A stop signal while a process that ended on a stop exits: nothing within ``REPEAT_S`` of that stop; later the
    signal's default action, at once (an exit that hangs is ended as asked, nothing printed)."""
    if time.monotonic() - _state["exit_taken"] > REPEAT_S:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _take(replacing: Mapping[int, Any] | None = None) -> None:
    """The stop under way from now: every stop signal's handler (but an ignored one) repeats it. ``replacing``: the
    handlers found under the caller's own (one ignored there is ignored again)."""
    if _state["taken"] is None:
        _state["taken"] = time.monotonic()
    for signum in (signal.SIGINT, *_HANDLED):
        found = signal.getsignal(signum)
        if (replacing or {}).get(signum, found) == signal.SIG_IGN:
            if found != signal.SIG_IGN:
                signal.signal(signum, signal.SIG_IGN)
        elif found is not _repeated_stop:
            # swapped in one call: the caller's handler or this one at every moment, never a raising one between
            signal.signal(signum, _repeated_stop)


def _untake() -> None:
    """No stop under way after all (its exception was dropped): the stop signals raise again."""
    _state["taken"] = _state["raised"] = None
    for signum in (signal.SIGINT, *_HANDLED):
        if signal.getsignal(signum) is _repeated_stop:
            signal.signal(signum, _raise_terminated)


def handle_sigterm() -> None:
    """Make SIGINT, SIGTERM and SIGHUP raise ``KeyboardInterrupt``, :class:`Terminated`, :class:`HungUp` in the main
    thread (a no-op elsewhere) until :func:`release_sigterm`, one stop at a time (the module's docstring). An ignored
    SIGHUP or SIGINT stays ignored: ``nohup kvload ...`` and a job started with ``&`` asked for that."""
    if threading.current_thread() is threading.main_thread():
        _state["taken"] = _state["raised"] = None
        _start_watcher()
        if not _state["armed"]:
            # what this command replaces, only: a signal skipped (ignored since an earlier command) keeps no handler
            # of that command's to be put back when this one returns
            _state["previous"] = {}
        for signum in (signal.SIGINT, *_HANDLED):
            if signum != signal.SIGTERM and signal.getsignal(signum) == signal.SIG_IGN:
                continue
            previous = signal.signal(signum, _raise_terminated)
            if previous not in (_raise_terminated, _repeated_stop):
                _state["previous"][signum] = signal.SIG_DFL if previous is None else previous
        if sys.unraisablehook is not _swallowed_stop:
            _state["unraisable"] = sys.unraisablehook
            sys.unraisablehook = _swallowed_stop
        _state["armed"] = True


def stopping(replacing: Mapping[int, Any] | None = None) -> bool:
    """The command took a stop signal of its own (a server's handler, a wait that caught one) and ends cleanly now:
    another stop signal repeats that stop (the module's docstring). ``replacing``: the handlers the caller set its own
    over and would have put back (``serve``'s). False (nothing changed) outside the main thread or
    :func:`handle_sigterm`: a program that runs the server itself keeps its own handlers."""
    if threading.current_thread() is not threading.main_thread() or not _state["armed"]:
        return False
    _state["raised"] = None  # the stop reached the command (and this module lets its exception go)
    _take(replacing)
    return True


def dropped_stop() -> KeyboardInterrupt | None:
    """The exception of a stop signal that code which drops every error cleared before the command saw it (torch's
    start-up), for any failure that followed it (numpy half-imported, or not: the stop came first and was ending the
    command within ~0.1 s) to be reported as that stop; None if there is none. The command takes it
    (:func:`stopping`) as it reports it."""
    return _state["raised"] if _dropped() is not None else None


def stop_behind(failure: BaseException) -> None:
    """The command reports ``failure``: a stop raised on the way to it (its cause or context: a cleanup that failed
    while the stop unwound) was seen, not dropped, and is taken here, so that :func:`release_sigterm` does not find
    it let go once the failure's line is out and report it a second time (its line, 128 + its number)."""
    stop = _state["raised"]
    if stop is None:
        return
    # (a stack, not the first link only: ``raise X from None`` hides the context it keeps)
    todo: list[BaseException | None] = [failure]
    seen: set[int] = set()
    while todo:
        exc = todo.pop()
        if exc is stop:
            stopping()
            return
        if exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            todo += (exc.__cause__, exc.__context__)


def release_sigterm() -> KeyboardInterrupt | None:
    """Put back the SIGINT, SIGTERM and SIGHUP handlers :func:`handle_sigterm` replaced (once the command returned);
    the exception of a stop dropped unseen that the watcher had not yet sent again, for the caller to report (its line
    and status, as a stop taken a moment earlier), else None.

    The watcher looks twice, ~0.1 s, before it sends a dropped stop again, and looks only while armed: a stop dropped
    in the command's last moments was lost, and the command exited 0 as if never stopped. It is taken here instead.

    After the command, interpreter shutdown runs atexit callbacks and finalizers (torch's, the process group's);
    a launcher's SIGTERM then (torchrun stopping the ranks left after one failed) raised ``Terminated`` inside them
    and Python printed "Exception ignored in atexit callback" with a traceback. Now such a signal acts as it would
    without kvload: by default it ends the process, with nothing printed. Unless the command ended on a stop (one was
    taken) and the process ends with it (:func:`ends_process`): then it is ignored within ``REPEAT_S`` of that stop,
    and ends the process by its default action later (an exit that hangs can still be stopped without SIGKILL).
    """
    if threading.current_thread() is threading.main_thread() and _state["armed"]:
        _state["armed"] = False  # first: a signal during the swap already acts as the previous handler
        # looked at once disarmed: no stop raised after this look can be dropped (a signal now acts as the previous
        # handler). One dropped has its ``taken`` (set as it was raised), so the exit below treats it as taken
        dropped = dropped_stop()
        taken, _state["taken"], _state["raised"] = _state["taken"], None, None
        if taken is not None and _state["ends_process"]:
            # the command ended on a stop and the process ends with it: another one while it exits (torchrun passing
            # the terminal's Ctrl-C on, a second kill) would only trade the first one's status for a kill; one past
            # REPEAT_S ends an exit that hangs (an ignored one stays ignored)
            _state["exit_taken"] = taken
            # past the window already: the default action itself, which also ends an exit hung inside a C call
            # (where no Python handler runs)
            exiting = _exiting_stop if time.monotonic() - taken <= REPEAT_S else signal.SIG_DFL
            for signum in (signal.SIGINT, *_HANDLED):
                if signal.getsignal(signum) != signal.SIG_IGN:
                    signal.signal(signum, exiting)
        else:
            for signum, previous in _state["previous"].items():
                signal.signal(signum, previous)
        if sys.unraisablehook is _swallowed_stop:
            sys.unraisablehook = _state["unraisable"] or sys.__unraisablehook__
        _state["unraisable"] = None
        return dropped
    return None


def ends_process() -> None:
    """The process ends when the command returns (``python -m kvload``, the ``kvload`` script): once a command that
    ended on a stop returns, :func:`release_sigterm` ignores further stop signals for the exit (within ``REPEAT_S``)."""
    _state["ends_process"] = True


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
