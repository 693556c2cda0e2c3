"""``pipeline.signals.deferred`` holds a stop signal until its block ends in a process with other threads too.

It blocked the signals in the calling thread only; a signal sent to the process is then taken by another thread (torch
starts several in every ``kvload generate`` / ``serve``), and its handler ran in the main thread at once, inside the
block: between creating an audit temporary and remembering to remove it, the very gap the block is there to close.
A real signal to a real process, sent from inside the block so that it lands there every time.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.cli_support import ENV, REPO
from tests.hostile_support import signals_as_a_terminal_gives_them

_CHILD = textwrap.dedent("""
    import os, signal, sys, threading, time
    from pipeline.signals import Terminated, deferred, handle_sigterm

    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a run under nohup ignores it, and kvload leaves it ignored
    handle_sigterm()
    for _ in range(int(sys.argv[2])):  # idle threads, signals not blocked in them, as torch's
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    try:
        with deferred():
            os.kill(os.getpid(), getattr(signal, sys.argv[1]))
            for _ in range(50):
                time.sleep(0.002)
            print("block finished", flush=True)
        print("after the block", flush=True)
    except KeyboardInterrupt as exc:  # Terminated for SIGTERM
        print(type(exc).__name__, flush=True)
""")


@pytest.mark.parametrize("threads", [0, 3])
@pytest.mark.parametrize("stop_with, raised", [("SIGTERM", "Terminated"), ("SIGINT", "KeyboardInterrupt"),
                                               ("SIGHUP", "HungUp")])
def test_a_stop_signal_is_raised_after_the_deferred_block_not_inside_it(stop_with, raised, threads):
    # SIGINT as a terminal gives it: a suite started with `&` passes it on ignored, and the child then raised nothing
    r = subprocess.run([sys.executable, "-c", _CHILD, stop_with, str(threads)], capture_output=True, text=True,
                       timeout=60, cwd=REPO, env={**ENV, "PYTHONPATH": str(REPO)},
                       preexec_fn=signals_as_a_terminal_gives_them)
    assert (r.returncode, r.stdout.splitlines(), r.stderr) == (0, ["block finished", raised], "")


def test_a_signal_raised_while_the_handlers_are_put_back_leaves_none_swapped(monkeypatch):
    """The block's end puts every handler back even when a stop signal raises between two of them (a signal lands on a
    handler already put back, or ``signal.signal`` runs a pending one first); the exception then goes on. Before, the
    restore stopped at the raise and SIGINT / SIGTERM kept the noting handler for good: later signals were noted by a
    block long over (or bounced between it and kvload's handler until RecursionError)."""
    import signal

    from cache_backends.signal_hold import handlers_held

    def term(signum, frame):
        raise SystemExit(143)

    before = {signal.SIGINT: signal.getsignal(signal.SIGINT), signal.SIGTERM: signal.getsignal(signal.SIGTERM)}
    monkeypatch.setattr(signal, "getsignal", signal.getsignal)  # (monkeypatch restores whatever this test changes)
    signal.signal(signal.SIGTERM, term)
    try:
        real_set = signal.signal
        calls = []

        def set_then_interrupted(signum, handler):
            calls.append(signum)
            got = real_set(signum, handler)
            if len(calls) == 3:  # the first put back (two swapped in): a signal raises right after it
                raise KeyboardInterrupt
            return got

        monkeypatch.setattr(signal, "signal", set_then_interrupted)
        with pytest.raises(KeyboardInterrupt), handlers_held((signal.SIGINT, signal.SIGTERM)):
            assert signal.getsignal(signal.SIGTERM) is not term  # swapped for the noting one
        monkeypatch.setattr(signal, "signal", real_set)
        assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
        assert signal.getsignal(signal.SIGTERM) is term
    finally:
        signal.signal(signal.SIGTERM, before[signal.SIGTERM])


@pytest.mark.parametrize("armed", [True, False])
def test_a_stop_under_way_takes_a_repeated_signal_until_the_command_returns(armed, monkeypatch):
    """``stopping()`` (a server or a rank ending cleanly on a first stop signal): another SIGINT or SIGTERM within
    ``REPEAT_S`` raises nothing into the teardown, a later one raises as before (a teardown that long is cut short as
    asked), and once the command returns every handler is what it was before the command. Outside a command (a
    program running the server itself) it changes nothing: its own handlers stay in charge."""
    import os
    import signal

    from pipeline import signals

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    own_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)  # a suite run with `&` has it ignored
    try:
        if armed:
            signals.handle_sigterm()
        try:
            assert signals.stopping() is armed
            if armed:
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGINT):
                    os.kill(os.getpid(), sig)  # its handler runs before the call returns: nothing raised
                monkeypatch.setattr(signals, "REPEAT_S", 0.0)
                with pytest.raises(signals.Terminated):
                    os.kill(os.getpid(), signal.SIGTERM)
            else:
                with pytest.raises(KeyboardInterrupt):
                    os.kill(os.getpid(), signal.SIGINT)
        finally:
            signals.release_sigterm()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)} == before
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, own_sigint)


def test_the_first_stop_signal_raises_and_the_next_ones_repeat_it():
    """Armed, a first SIGINT raises ``KeyboardInterrupt``; SIGINT and SIGTERM right after it raise nothing (the cleanup
    it started runs on), and the command's next start raises again."""
    import os
    import signal

    from pipeline import signals

    own_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for _ in range(2):  # two commands in one process, as main() called twice
            signals.handle_sigterm()
            try:
                with pytest.raises(KeyboardInterrupt) as caught:
                    os.kill(os.getpid(), signal.SIGINT)
                assert not isinstance(caught.value, signals.Terminated)
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGINT)
            finally:
                signals.release_sigterm()
    finally:
        signal.signal(signal.SIGINT, own_sigint)


def test_a_command_run_again_leaves_a_signal_ignored_since_the_first_one_ignored():
    """``main()`` called twice in one process (tests do; a notebook): a SIGINT or SIGHUP the program ignored between
    the two calls (a job put in the background, ``nohup``'s habit) is left alone by the second call, as its docstring
    says, and must still be ignored once it returns. It was set back to the handler the first call had found."""
    import signal

    from pipeline import signals

    own = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signals.handle_sigterm()
        signals.release_sigterm()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signals.handle_sigterm()
        signals.release_sigterm()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        for signum, handler in own.items():
            signal.signal(signum, handler)


_EXITING = textwrap.dedent("""
    import os, signal, sys, time
    from pipeline import signals

    signals.REPEAT_S = 60.0
    signals.ends_process()  # python -m kvload
    signals.handle_sigterm()
    signals.stopping()  # the command ends on a stop ...
    signals.release_sigterm()  # ... and returned: the process exits
    os.kill(os.getpid(), signal.SIGTERM)  # within the window: ignored
    os.kill(os.getpid(), signal.SIGINT)
    print("alive", flush=True)
    signals.REPEAT_S = 0.0  # (the window over)
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    time.sleep(30)
    print("not ended", flush=True)
""")


@pytest.mark.parametrize("again", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_process_exiting_on_a_stop_ignores_a_repeat_then_ends_on_a_later_one(again):
    """``python -m kvload`` whose command ended on a stop: another stop signal while it exits is ignored within
    ``REPEAT_S`` (the first one's status stands), and one later ends it by its default action (an exit that hangs is not
    left to SIGKILL: they were ignored for the whole exit)."""
    import signal

    r = subprocess.run([sys.executable, "-c", _EXITING, again], capture_output=True, text=True, timeout=60,
                       env={**ENV, "PYTHONPATH": str(REPO)}, cwd=REPO,
                       preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL)
                                           for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)])
    assert (r.returncode, r.stdout, r.stderr) == (-getattr(signal, again), "alive\n", "")


def test_a_stop_signal_after_one_swallowed_unseen_still_stops():
    """The first stop's exception cleared by code that drops every error (torch's C start-up clears whatever its
    numpy import raised: a SIGTERM landing there was lost and ``kvload run`` finished, exit 0): further stop signals
    within ``REPEAT_S`` repeated a stop nobody was carrying out, and were lost too. One that finds the stop's
    exception gone, never taken by kvload's handler, raises as a first one."""
    import contextlib
    import os
    import signal

    from pipeline import signals

    own_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        signals.handle_sigterm()
        try:
            with contextlib.suppress(BaseException):  # what a C caller clearing the error does
                os.kill(os.getpid(), signal.SIGTERM)
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
            signals.stopping()  # taken by the command (kvload.cli.entry's handler says so) ...
            os.kill(os.getpid(), signal.SIGTERM)  # ... and this one is that stop's repeat: nothing raised
        finally:
            signals.release_sigterm()
    finally:
        signal.signal(signal.SIGINT, own_sigint)
