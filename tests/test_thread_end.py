"""``pipeline.thread_end.EndingThread``: a wait for a thread's end that a stop signal's exception does not cut short."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from pipeline.thread_end import EndingThread


def test_a_sigint_during_the_wait_is_raised_once_the_thread_ended_and_it_is_said_to_have():
    """CPython 3.11's ``join`` cut by the KeyboardInterrupt marked the running thread stopped (``is_alive()`` False,
    later joins returning at once); here the interrupt comes after the thread's end."""
    # a terminal's Ctrl-C as a plain Python process takes it: a suite started in the background (`pytest ... &` from a
    # script, as CI runners may) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    release = threading.Event()
    worker = EndingThread(target=release.wait, args=(30,), daemon=True)
    worker.start()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    threading.Timer(0.6, release.set).start()  # the thread ends only after the signal landed
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.wait_end()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert release.is_set() and worker.ended.is_set() and not worker.is_alive()


def test_a_wait_that_times_out_says_so_and_the_thread_is_still_alive():
    release = threading.Event()
    worker = EndingThread(target=release.wait, args=(30,), daemon=True)
    worker.start()
    assert worker.wait_end(0.05) is False and worker.is_alive()
    release.set()
    assert worker.wait_end(30) is True and not worker.is_alive()
    with pytest.raises(RuntimeError, match="current thread"):
        _wait_self()  # as join: a thread cannot wait for itself


def _wait_self() -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            me.wait_end(1)
        except BaseException as exc:
            errors.append(exc)

    me = EndingThread(target=run)
    me.start()
    me.join(30)
    raise errors[0]
