"""A thread whose end can be waited for through a stop signal: the signal's exception is raised once it ended.

CPython 3.11's ``Thread.join``, interrupted by a signal handler's exception (Ctrl-C's ``KeyboardInterrupt``,
kvload's ``Terminated``), releases the still-running thread's state lock and marks the thread stopped: ``is_alive()``
says False and every later ``join()`` returns at once, while the thread runs on (fixed in CPython 3.13). A stream
closed by Ctrl-C then let the next ``generate`` in while its worker still ran ("already generating"), and a server's
stop left its threads mid-step as the process exited. :meth:`EndingThread.wait_end` waits on an Event its target
sets as it returns, which a signal does not corrupt, and holds the signal's exception until the wait is over.
"""

from __future__ import annotations

import threading
import time


class EndingThread(threading.Thread):
    """A ``threading.Thread`` whose :attr:`ended` is set once its target returned or raised; see :meth:`wait_end`."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.ended = threading.Event()

    def run(self) -> None:
        """The target, then :attr:`ended` set."""
        try:
            super().run()
        finally:
            self.ended.set()

    def wait_end(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s (None: for as long as it takes) for the thread to end; True if it did.

        An exception a signal handler raises meanwhile (``KeyboardInterrupt``, ``SystemExit``) does not cut the wait
        short: the first is raised once the thread ended or the time ran out, so whoever handles it finds the thread
        gone (or, timed out, still running and said to be)."""
        if self is threading.current_thread():  # as join: it would wait for itself
            raise RuntimeError("cannot wait for the current thread to end")
        deadline = None if timeout is None else time.monotonic() + timeout
        held: BaseException | None = None
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                if self.ended.wait(left):
                    # past its target only the interpreter's bookkeeping is left: so is_alive() and enumerate() agree
                    self.join(1.0)
                break
            except BaseException as exc:  # a signal's, raised in this (main) thread: after the wait
                held = held or exc
        if held is not None:
            raise held
        return self.ended.is_set()
