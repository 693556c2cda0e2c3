"""``kvload run|generate|serve --tp_size N`` outside torchrun: start the N rank processes and supervise them.

vLLM's habit (``vllm serve MODEL --tensor-parallel-size 2``: the engine starts its own workers). Outside torchrun
(no ``WORLD_SIZE``) and with a ``tensor_parallel_size`` above 1 that the checkpoint's heads accept, the command is
run again as N children of this process (``python -m kvload`` with the same arguments), with torchrun's variables
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free port) and
``KVLOAD_LAUNCHER=kvload`` (each rank's audit then records ``ranks_launched``). From there each rank runs the torchrun
path unchanged: it starts the process group (gloo on CPU, NCCL on CUDA), rank 0 prints and writes ``--audit-log``.

This process supervises: the children share its stdout (only rank 0 prints there); their stderr comes through it, rank
0's as it arrives and the others' only with ``--debug``, so nothing is said twice, and of the ranks' ``error:`` lines
the one of the rank that failed first (its cause, not the "lost contact" its failure gave the others) is printed,
once, naming that rank when it is not rank 0. The exit status is that rank's. SIGINT, SIGTERM and SIGHUP are passed on
to every rank; a rank that fails leaves the others a few seconds to end on their own (they meet its absence at their
next collective), then they get SIGTERM, then SIGKILL; every child is reaped, and a child whose parent dies gets
SIGTERM (the kernel's parent-death signal), so none outlives it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

import attrs

from pipeline.ranks import LAUNCHER_ENV

#: The commands that need every rank present (``plan`` plans rank 0's view in one process).
LAUNCHING_COMMANDS = ("run", "generate", "serve")
#: torchrun's variables: any of them set means a launcher already started this process as one rank.
RANK_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
#: Seconds the ranks left get to end on their own after one failed (they fail at their next collective).
GRACE_S = 3.0
#: Seconds after SIGTERM before SIGKILL (serve's rank > 0 waits up to 10 s for rank 0's stop; torchrun gives 30).
KILL_AFTER_S = 20.0
_POLL_S = 0.05
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: What a rank says when another one went away: the effect of a failure, not its cause.
_CONSEQUENCES = (b"error: lost contact with another rank", b"error: terminated (SIGTERM)", b"error: interrupted",
                 b"error: hung up (SIGHUP)")
#: A rank's own line when a stop signal ended it, and the signal: this process's, passed on, or one sent to that
#: rank alone from outside, which the line (said of the whole command) does not tell apart.
_SIGNALLED = {b"error: terminated (SIGTERM)": "SIGTERM", b"error: interrupted": "SIGINT",
              b"error: hung up (SIGHUP)": "SIGHUP"}


def ranks_to_launch(ns: argparse.Namespace) -> int:
    """How many rank processes this command should start itself: ``tensor_parallel_size`` outside torchrun for
    ``run``/``generate``/``serve``, else 0. A size the checkpoint refuses raises its one-line error here, before any
    process starts."""
    if getattr(ns, "command", None) not in LAUNCHING_COMMANDS or any(v in os.environ for v in RANK_VARIABLES):
        return 0
    from kvload.cli.flags import cli_overrides

    if "tensor_parallel_size" not in cli_overrides(ns) and getattr(ns, "config", None) is None:
        return 0  # models may not set it: only a flag or a --config file can ask for ranks
    return _resolved_size(ns)


def _resolved_size(ns: argparse.Namespace) -> int:
    """``tensor_parallel_size`` as the stages resolve it, checked against the checkpoint's heads (no torch imported,
    nothing logged or written: each rank resolves and logs it again)."""
    from kvload.api import execute
    from kvload.cli.flags import _request
    from stages import ApplyModelDefaults, CheckParallel, ParseArgs, ResolveAuto, SnapshotUserFields

    if ns.config is not None and getattr(ns, "config_read", None) is None:
        from pipeline.sources import read_yaml

        # read once for this process: the command's own request takes this tree, not a second read of a file that
        # may have changed in between (and each rank reads the file itself; agree_ranks compares what they resolved)
        ns.config_read = read_yaml(ns.config)
    # generate and serve load weights: check_parallel then refuses a size transformers' plan cannot load, too
    request = _request(ns, load_weights=ns.command in ("generate", "serve"), kv_events_reader=False)
    request.config = copy.deepcopy(request.config)  # the stages may normalise the tree the command gets after
    result = execute(request, [ParseArgs(), SnapshotUserFields(), ApplyModelDefaults(), ResolveAuto(),
                              CheckParallel(starts_ranks=True)], log=False)
    size = result.args.tensor_parallel_size
    return size if size > 1 else 0


def free_port(addr: str) -> int:
    """A TCP port on ``addr`` nobody listens on now (rank 0 listens there for the rendezvous)."""
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


@attrs.define
class _Rank:
    """One child: its process, the first ``error:`` line it printed, and when it ended."""

    rank: int
    proc: subprocess.Popen
    error: bytes | None = None
    ended_at: float | None = None
    code: int | None = None  # the exit status as a shell reports it (128 + signal for a signal's death)
    reader: threading.Thread | None = None


def _lost_contact(r: _Rank) -> bool:
    """Whether rank ``r``'s line says another rank went away (the effect of a failure, never its cause)."""
    return r.error is not None and r.error.startswith(_CONSEQUENCES[0])


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def rank_env(rank: int, world: int, addr: str, port: int) -> dict[str, str]:
    """Rank ``rank``'s environment: this process's with torchrun's variables and kvload's launcher mark (the CLI's
    ranks and the workers ``kvload.LLM`` starts take the same)."""
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": addr, "MASTER_PORT": str(port),
            LAUNCHER_ENV: "kvload"}


def master_address() -> tuple[str, int]:
    """Where rank 0 listens for the rendezvous: ``MASTER_ADDR`` / ``MASTER_PORT`` when set, else a free local port."""
    addr = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT", "").isdigit() else free_port(addr)
    return addr, port


def ended_how(returncode: int) -> str:
    """How a child ended, in words: ``was killed by SIGKILL`` or ``exited with status N``."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def die_with_parent(parent: int) -> None:
    """``preexec_fn``: SIGTERM this child when the launcher dies (even by SIGKILL), as its cleanup then still runs."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the launcher died before the call above
        os.kill(os.getpid(), signal.SIGTERM)


class Launcher:
    """Start ``world`` ranks of ``argv`` and supervise them to their end (see the module's docstring)."""

    def __init__(self, argv: Sequence[str], world: int, *, debug: bool = False, audit_log: str | None = None) -> None:
        self.argv, self.world, self.debug, self.audit_log = list(argv), world, debug, audit_log
        self.addr, self.port = master_address()
        self.ranks: list[_Rank] = []
        self._signals: list[int] = []
        self._lock = threading.Lock()
        self._term_at: float | None = None  # when the supervisor stopped the ranks left after one failed
        self._passed_on = False  # a stop signal this process got was passed on to the ranks

    def env(self, rank: int) -> dict[str, str]:
        """Rank ``rank``'s environment: this one's with torchrun's variables and kvload's launcher mark."""
        return rank_env(rank, self.world, self.addr, self.port)

    def run(self) -> int:
        """Start the ranks, pass on stop signals, end them all when one fails; the exit status."""
        previous = {s: signal.getsignal(s) for s in _STOP_SIGNALS}
        try:
            for signum, handler in previous.items():
                if handler != signal.SIG_IGN:  # an ignored SIGHUP (nohup) stays ignored, here and in the ranks
                    signal.signal(signum, self._note_signal)
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.flush()  # what this process printed comes before the ranks' output
            before = {r: self._audit_temporaries(r) for r in range(self.world)}
            self._start()
            self._supervise()
        finally:
            self._stop_all(signal.SIGKILL)  # only if this process itself was cut short: every child goes
            for r in self.ranks:
                r.proc.wait()
                if r.reader is not None:
                    r.reader.join(timeout=5)
                if r.proc.returncode < 0 and self.audit_log:  # a death with no cleanup (SIGKILL): its audit log goes
                    from pipeline.audit import remove_new_temporaries

                    remove_new_temporaries(self._audit_path(r.rank), before.get(r.rank, set()))
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return self._report()

    def _audit_path(self, rank: int) -> str:
        """Rank ``rank``'s ``--audit-log`` (rank N's is ``<stem>.rankN<suffix>`` beside rank 0's)."""
        from pipeline.ranks import Ranks, rank_audit_path

        return rank_audit_path(self.audit_log or "", Ranks(rank, self.world, rank))

    def _audit_temporaries(self, rank: int) -> set[str]:
        """The temporaries (``pipeline.audit``'s ``.NAME.<12 hex>.tmp``) beside rank ``rank``'s ``--audit-log``."""
        from pipeline.audit import temporaries

        return temporaries(self._audit_path(rank)) if self.audit_log else set()

    def _note_signal(self, signum: int, frame: Any) -> None:
        self._signals.append(signum)  # passed on by the supervising loop (no Popen calls inside a handler)

    def _start(self) -> None:
        cmd = [sys.executable, "-m", "kvload", *self.argv]
        parent = os.getpid()
        for rank in range(self.world):
            proc = subprocess.Popen(cmd, env=self.env(rank), stdin=None if rank == 0 else subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, start_new_session=True,  # signals come from here only
                                    preexec_fn=lambda: die_with_parent(parent))
            self.ranks.append(_Rank(rank, proc))
        for r in self.ranks:  # threads after every fork: preexec_fn runs in a child forked from a threaded parent
            r.reader = threading.Thread(target=self._read, args=(r,), name=f"kvload-rank{r.rank}-stderr", daemon=True)
            r.reader.start()

    def _read(self, r: _Rank) -> None:
        """Pass on rank ``r``'s stderr: rank 0's lines, the others' with --debug; keep its first ``error:`` line."""
        stream: IO[bytes] = r.proc.stderr  # type: ignore[assignment]
        for line in iter(stream.readline, b""):
            if line.startswith(b"error: "):
                if r.error is None:
                    r.error = line if line.endswith(b"\n") else line + b"\n"
                continue
            if r.rank == 0:
                self._write(line)
            elif self.debug:
                self._write(f"[rank {r.rank}] ".encode() + line)
        stream.close()

    def _write(self, data: bytes) -> None:
        """``data`` on this process's stderr as it is now (a redirection of ``sys.stderr`` included), bytes as sent."""
        with self._lock, contextlib.suppress(OSError, ValueError):
            stream = sys.stderr
            out = getattr(stream, "buffer", None)
            if out is None:
                stream.write(data.decode(errors="replace"))
                stream.flush()
                return
            stream.flush()  # what went through its text layer first
            out.write(data)
            out.flush()

    def _alive(self) -> list[_Rank]:
        return [r for r in self.ranks if r.code is None]

    def _stop_all(self, signum: int) -> None:
        for r in self._alive():
            if r.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(r.proc.pid, signum)

    def _supervise(self) -> None:
        failed_at = term_at = kill_at = None
        while self._alive():
            now = time.monotonic()
            while self._signals:  # the user's (or a service manager's) stop: every rank gets it
                signum = self._signals.pop(0)
                self._passed_on = True
                self._stop_all(signum)
                kill_at = kill_at or now + KILL_AFTER_S
            for r in self._alive():
                code = r.proc.poll()
                if code is not None:
                    r.code, r.ended_at = _exit_status(code), now
                    if r.code != 0 and failed_at is None:
                        failed_at = now
            if failed_at is not None and term_at is None and now >= failed_at + GRACE_S and self._alive():
                term_at = now  # a rank failed and the others are still up (busy between collectives): stop them
                self._stop_all(signal.SIGTERM)
                kill_at = min(kill_at or now + KILL_AFTER_S, now + KILL_AFTER_S)
            if kill_at is not None and now >= kill_at:
                self._stop_all(signal.SIGKILL)
            time.sleep(_POLL_S)
        self._term_at = term_at

    def _report(self) -> int:
        """Print the one line of the failure that ended the ranks (the first rank's to fail, its cause preferred to
        the consequences it had on the others) and return its exit status; 0 when every rank ended with 0."""
        # ranks seen ending in one poll: by rank, but a "lost contact" line after the others when no stop signal came
        # through here (a rank sent SIGTERM alone ends first; the others lose contact ~0.1 s later, in the same poll
        # on a loaded machine: its line, not theirs, says what happened)
        failed = sorted((r for r in self.ranks if r.code not in (0, None)),
                        key=lambda r: (r.ended_at, not self._passed_on and _lost_contact(r), r.rank))
        if not failed:
            return 0
        term_at = self._term_at
        before = [r for r in failed if term_at is None or r.ended_at < term_at] or failed
        causes = [r for r in before if r.error is None or not r.error.startswith(_CONSEQUENCES)]
        # the same error on every rank (a bad flag each rank refuses): rank 0's words, as torchrun's user reads first
        cause = next((r for r in causes if r.rank == 0 and r.error is not None), causes[0] if causes else before[0])
        signalled = next((name for head, name in _SIGNALLED.items() if cause.error is not None
                          and cause.error.startswith(head)), None)
        if signalled is not None and not self._passed_on and (term_at is None or cause.ended_at < term_at):
            # a stop signal sent to this rank alone (not through this process): its own line would read as the
            # command's ("error: terminated (SIGTERM)"); say which rank got it, and what its line added
            error = cause.error or b""
            rest = error.split(b";", 1)[1].strip().decode(errors="replace") if b";" in error else ""
            line = (f"error: rank {cause.rank} of {self.world} (pid {cause.proc.pid}) was sent {signalled}, not "
                    f"through kvload; kvload stopped the other ranks{'; ' + rest if rest else ''}\n").encode()
        elif cause.error is not None and cause.rank != 0 and not cause.error.startswith(_CONSEQUENCES):
            # a rank other than 0 failed on its own (rank 0's words win when every rank says the same): its line as
            # it was did not say which of the N ranks failed, so where to look (its --debug output, its machine)
            line = (f"error: rank {cause.rank} of {self.world} (pid {cause.proc.pid}): ".encode()
                    + cause.error[len(b"error: "):])
        elif cause.error is not None:
            line = cause.error
        else:
            how = ended_how(cause.proc.returncode)
            line = (f"error: rank {cause.rank} of {self.world} (pid {cause.proc.pid}) {how}; kvload stopped the other "
                    "ranks\n").encode()
        self._write(line)
        return cause.code or 1


def launch(ns: argparse.Namespace, argv: Sequence[str], world: int) -> int:
    """Run the command as ``world`` ranks started here; the ranks' exit status."""
    debug, audit_log = bool(getattr(ns, "debug", False)), getattr(ns, "audit_log", None)
    return Launcher(argv, world, debug=debug, audit_log=audit_log).run()


__all__ = ["GRACE_S", "KILL_AFTER_S", "LAUNCHING_COMMANDS", "RANK_VARIABLES", "Launcher", "die_with_parent",
           "ended_how", "free_port", "launch", "master_address", "rank_env", "ranks_to_launch"]
