"""A stop signal (SIGTERM, SIGINT) while kvload builds a CPU C kernel ends the compiler with it: no ``cc`` (nor its
``cc1``/``as``/``ld``) left running in its session of its own, no half-written object or library in the kernel cache,
and the command's usual one line and exit status.

A signal during the compile proper was already handled (``cpu_kernel_build._run`` kills the compiler's group on any
exception). One that landed while ``subprocess.Popen`` was starting the compiler raised inside ``Popen.__init__``,
before ``_run`` held the process: ``cc`` ran on after kvload had exited and wrote its ``.o`` into the cache. These
tests send a real signal to a real process at that moment (the process sends it to itself as the compiler has just
started, which a ``kill`` from outside hits only by chance), with a fake compiler that starts a child, writes its
output half a second later and then hangs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.cli_support import ENV, REPO
from tests.hostile_support import signals_as_a_terminal_gives_them

#: The child: the signal sent to itself just as the compile (``cc ... -c``) has been started, then either the build
#: alone (``build``: a stop signal ends it as kvload's CLI would, 128 + the signal) or ``kvload`` with the arguments.
_CHILD = textwrap.dedent("""
    import os, signal, subprocess, sys

    sent = []
    real = subprocess.Popen._execute_child

    def started_then_stopped(self, args, *rest):
        real(self, args, *rest)
        if "-c" in args and not sent:
            sent.append(1)
            os.kill(os.getpid(), getattr(signal, os.environ["STOP_WITH"]))

    subprocess.Popen._execute_child = started_then_stopped
    if sys.argv[1] == "build":
        from pathlib import Path
        from cache_backends.cpu_kernel_build import build_kernel
        from pipeline.signals import Terminated, handle_sigterm
        handle_sigterm()
        try:
            build_kernel(Path(sys.argv[2]))
        except Terminated:
            sys.exit(143)
        except KeyboardInterrupt:
            sys.exit(130)
        sys.exit(0)
    from kvload.__main__ import main
    sys.argv = ["kvload", *sys.argv[1:]]
    sys.exit(main())
""")


def _fake_cc(tmp_path: Path) -> tuple[Path, Path]:
    """A compiler that starts a child (``cc1``'s stand-in, its pid written down), writes half its output 0.5 s in,
    then waits for that child forever; and the file its child's pid goes to."""
    pidfile = tmp_path / "child.pid"
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo 'fake cc 1.0'; exit 0; }\n"
                  "out=; prev=; for a; do [ \"$prev\" = -o ] && out=$a; prev=$a; done\n"
                  f"sleep 300 &\necho $! > {pidfile}\nsleep 0.5\necho half > \"$out\"\nwait\n")
    cc.chmod(0o755)
    return cc, pidfile


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _session(sid: int) -> list[int]:
    """The live processes of session ``sid`` (the child's: it starts in one of its own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def _stop_during_start(tmp_path: Path, stop_with: str, *argv: str) -> tuple[subprocess.CompletedProcess, int, Path]:
    """Run the child under the fake compiler; its result, the compiler's child's pid and the kernel cache."""
    cc, pidfile = _fake_cc(tmp_path)
    cache = tmp_path / "cache"
    env = {**ENV, "PYTHONPATH": str(REPO), "CC": str(cc), "KVLOAD_CACHE": str(cache), "STOP_WITH": stop_with}
    argv = tuple(a.replace("{cache}", str(cache / "kernels")) for a in argv)
    # SIGINT as a terminal gives it: a suite started with `&` passes it on ignored, and the SIGINT cases ran on
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, *argv], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=signals_as_a_terminal_gives_them)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    for _ in range(50):  # the fake compiler writes its child's pid at once; it may not have run at all
        if pidfile.exists() and pidfile.read_text().strip():
            break
        time.sleep(0.02)
    child = int(pidfile.read_text()) if pidfile.exists() and pidfile.read_text().strip() else -1
    time.sleep(1)  # past the fake compiler's 0.5 s: a compiler left running has written its half file by now
    left = [pid for pid in [child, *_session(proc.pid)] if pid > 0 and _running(pid)]
    names = [_command(pid) for pid in left]
    for pid in left:  # clean up after a failure; the assertions below name them
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left running: {left} {names}; stderr: {err}"
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), child, cache / "kernels"


@pytest.mark.parametrize("stop_with, status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_stop_signal_as_the_compiler_starts_stops_it_and_leaves_no_file(tmp_path, stop_with, status):
    r, _, kernels = _stop_during_start(tmp_path, stop_with, "build", "{cache}")
    assert r.returncode == status, r.stderr
    assert "Traceback" not in r.stderr
    assert not list(kernels.iterdir())  # no half-written .o / .so under any name


@pytest.mark.slow  # imports torch and builds the tiny model (~10 s on two busy cores)
@pytest.mark.parametrize("stop_with, status, line", [("SIGTERM", 143, "error: terminated (SIGTERM)\n"),
                                                     ("SIGINT", 130, "error: interrupted\n")])
def test_generate_stopped_as_it_starts_the_compiler_exits_with_one_line_and_nothing_left(tmp_path, stop_with,
                                                                                          status, line):
    r, _, kernels = _stop_during_start(tmp_path, stop_with, "generate", "tiny-llama", "--prompt-ids", "1,2,3",
                                       "--max_new_tokens", "2", "--attention_backend", "cpu_kernel")
    assert (r.returncode, r.stderr) == (status, line)
    assert not list(kernels.iterdir())
