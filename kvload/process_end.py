"""``leave``: end the ``kvload`` process once its command is over, without CPython's module teardown."""

import atexit
import contextlib
import os
import signal
import sys
import threading


def leave(status: int) -> int:
    """End the process with ``status`` once the command is over, as Python's exit would but for its module teardown.

    A command that loaded a model has torch and transformers imported (transformers' model modules import
    ``torch._dynamo``, ``torch._inductor``, sympy and triton: ~2,800 modules, ~380,000 objects). CPython's exit
    then clears every module and runs full garbage collections over all of them: 1.3-2.9 s after the last line
    (BENCHMARKS.md, "Exit after the last line"), with nothing of kvload's left to do. So this runs what Python's exit
    runs that a user can see (the atexit callbacks: logging's, the process group's, ``kvload.api``'s stop of a call
    left running; then the flush of stdout and stderr, a failed one being exit 120 as Python makes it) and ends the
    process there. A thread that is not a daemon still running is Python's to wait for, and ``python -i`` asked
    for a prompt after the command: then the ordinary exit."""
    if sys.flags.inspect:
        return status
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return status
    # as at Python's exit each callback's exception is reported and the rest still run; a Ctrl-C landing between
    # two callbacks ends them with the command's status standing, no traceback
    with contextlib.suppress(KeyboardInterrupt):
        atexit._run_exitfuncs()
    # from here the process is ending: a stop signal now would only trade the status for a traceback or a kill
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # Python's exit ends with 120 when this flush fails; so does this
            status = 120
    os._exit(status)

