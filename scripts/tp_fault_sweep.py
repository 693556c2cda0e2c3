"""Faults against kvload's tensor-parallel runs on 2 real ranks (gloo, CPU, ``tiny-llama``): signals to the command
(or script) that started its ranks, and SIGKILL to rank 1 while idle or while generating, for ``kvload serve --tp_size
2``, ``kvload generate --tp_size 2`` and ``kvload.LLM(tensor_parallel_size=2)`` in a script.

Each case runs in a fresh directory with ``TMPDIR`` inside it and its own session; it must end within ``EXIT_S``
(every wait is bounded), print at most one ``error:`` line (naming rank 1 when rank 1 was killed), leave no process
in its session, nothing new in ``/dev/shm``, no temporary file, and a serve's port free. A case that breaks a rule
is a suspect, with why.

    python scripts/tp_fault_sweep.py [--only NAME] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
START_S = 240.0
EXIT_S = 60.0

LLM_SCRIPT = """
import sys, kvload
from kvload import SamplingParams
try:
    llm = kvload.LLM("tiny-llama", tensor_parallel_size=2, kv_cache_config={"max_tokens": 4096}, log=False)
    print("ready", flush=True)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3000, ignore_eos=True))
    print("done", len(out[0].outputs[0].token_ids), flush=True)
except Exception as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    if "again" not in sys.argv:
        sys.exit(1)
    llm.shutdown()  # then a new LLM in the same process, as the error says to
    llm = kvload.LLM("tiny-llama", tensor_parallel_size=2, kv_cache_config={"max_tokens": 4096}, log=False)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    print("again", len(out[0].outputs[0].token_ids), flush=True)
    llm.shutdown()
"""


def env_for(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TRANSFORMERS_VERBOSITY": "error", "TMPDIR": str(tmp / "tmp")}
    for name in ("KVLOAD_DIST_TIMEOUT_S", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def rank_pids(parent: int, want: int, deadline: float) -> dict[int, int]:
    """rank -> pid among ``parent``'s children and their children (their RANK variable); ``parent`` itself is rank 0
    when it has RANK (a kvload.LLM script has none: its ranks' RANK is set in their environment only)."""
    while True:
        found: dict[int, int] = {}
        for pid in children(parent):
            try:
                env = dict(v.split(b"=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                           if b"=" in v)
            except OSError:
                continue
            if b"RANK" in env:
                found[int(env[b"RANK"])] = pid
        if len(found) >= want or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``."""
    out = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(p.name))
    return out


class Case:
    def __init__(self, name: str, argv: list[str], tmp: Path) -> None:
        self.name, self.tmp = name, tmp
        self.script_traceback_ok = False
        (tmp / "tmp").mkdir(parents=True)
        self.shm_before = set(os.listdir("/dev/shm"))
        self.proc = subprocess.Popen(argv, cwd=tmp, env=env_for(tmp), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True,
                                     preexec_fn=_default_signals)
        self.rank_sids: set[int] = set()
        self.out: list[str] = []
        self.err: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.out), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.err), daemon=True).start()

    @staticmethod
    def _pump(stream: Any, into: list[str]) -> None:
        while True:  # stdout unbuffered by lines: a streamed reply's tokens come without a newline
            chunk = stream.read(1) if into is not None else ""
            if not chunk:
                return
            if into and not into[-1].endswith("\n"):
                into[-1] += chunk
            else:
                into.append(chunk)

    def __enter__(self) -> Case:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def rank_pids(self, want: int, deadline: float) -> dict[int, int]:
        """The launcher's ranks (``rank_pids``), kept for ``kill``."""
        found = rank_pids(self.proc.pid, want, deadline)
        self.rank_sids.update(found.values())
        return found

    def kill(self) -> None:
        """SIGKILL whatever the case left: the launcher's session and each rank's (sessions of their own), however
        the case's body ended (a harness error before ``finish`` included: the next case must not find them)."""
        sids = {self.proc.pid, *self.rank_sids, *children(self.proc.pid)}
        for pid in sorted({p for sid in sids for p in session_pids(sid)}):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def url(self) -> str:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            for line in self.err:
                if " at http://" in line:
                    return line.split(" at ", 1)[1].split(" ", 1)[0]
            time.sleep(0.05)
        raise RuntimeError(f"no ready line: {''.join(self.err[-5:])}")

    def wait_stdout(self, text: str) -> None:
        deadline = time.monotonic() + START_S
        while not any(text in x for x in self.out):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"no {text!r} on stdout: {''.join(self.err[-5:])}")
            time.sleep(0.02)

    def finish(self, rec: dict[str, Any], killed_rank: int | None, expect_rc: tuple[int, ...]) -> dict[str, Any]:
        why: list[str] = []
        start = time.monotonic()
        try:
            self.proc.wait(EXIT_S)
        except subprocess.TimeoutExpired:
            why.append(f"still running {EXIT_S} s after the fault")
        rec["exit_s"] = round(time.monotonic() - start, 2)
        rec["rc"] = self.proc.poll()
        # the ranks run in sessions of their own (signals reach them from their launcher only): each is looked for
        sessions = [self.proc.pid, *rec.get("ranks", {}).values()]

        def left_running() -> list[int]:
            return sorted({p for sid in sessions for p in session_pids(sid)})

        deadline = time.monotonic() + EXIT_S  # ranks outliving a killed parent end by its death signal, in time
        while left_running() and time.monotonic() < deadline:
            time.sleep(0.1)
        rec["all_gone_s"] = round(time.monotonic() - start, 2)
        left = left_running()
        if left:
            why.append(f"processes left: {left}")
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        time.sleep(0.2)
        errors = [x.rstrip() for x in self.err if x.startswith("error:") or "Error:" in x or "Traceback" in x]
        rec["errors"] = errors[:5]
        if rec["rc"] is not None and rec["rc"] not in expect_rc:
            why.append(f"exit status {rec['rc']}, expected {expect_rc}")
        if any("terminate called" in x or "Fatal Python" in x for x in self.err) or (
                any("Traceback" in x for x in self.err) and not (
                    self.script_traceback_ok and self.err and self.err[-1].rstrip().endswith("KeyboardInterrupt"))):
            why.append("a traceback / abort on stderr")
        if len([x for x in errors if x.startswith("error:")]) > 1:
            why.append(f"{len(errors)} error lines")
        if killed_rank is not None and not any(f"rank {killed_rank}" in x for x in errors):
            why.append(f"no error line naming rank {killed_rank}")
        new_shm = set(os.listdir("/dev/shm")) - self.shm_before
        if new_shm:
            why.append(f"/dev/shm left: {sorted(new_shm)[:5]}")
        tmp_left = [str(p.relative_to(self.tmp)) for p in (self.tmp / "tmp").rglob("*")]
        if tmp_left:
            why.append(f"temporary files left: {tmp_left[:5]}")
        stray = [p.name for p in self.tmp.iterdir() if p.name not in ("tmp", "script.py")
                 and not p.name.endswith(".jsonl")]
        if stray:
            why.append(f"files left in cwd: {stray[:5]}")
        rec["why"] = why
        rec["stderr_tail"] = "".join(self.err[-6:])[-1200:]
        return rec


def _default_signals() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))


SERVE = [sys.executable, "-m", "kvload", "serve", "tiny-llama", "--tp_size", "2", "--port", "0", "--max_tokens",
         "4096"]
GENERATE = [sys.executable, "-m", "kvload", "generate", "tiny-llama", "--tp_size", "2", "--prompt-ids", "1,2,3",
            "--max_new_tokens", "3000", "--ignore_eos", "--max_tokens", "4096"]


def stream_then(c: Case, url: str, act: Callable[[], None]) -> dict[str, Any]:
    """A long stream on the server; once its first chunk is in, ``act()``; what the client then saw."""
    import httpx

    seen: dict[str, Any] = {}
    body = {"model": "tiny-llama", "prompt": [3, 1, 4], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=url, timeout=EXIT_S) as http, \
                http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            act()
            rest = [x for x in lines if x.startswith("data: ")]
            seen["stream_end"] = rest[-2:]
    except Exception as e:
        seen["stream_exc"] = f"{type(e).__name__}: {e}"[:200]
    return seen


def serve_case(tmp: Path, name: str, fault: str) -> dict[str, Any]:
    with Case(name, [*SERVE, "--audit-log", str(tmp / "audit.jsonl")], tmp) as c:
        rec: dict[str, Any] = {"case": name}
        if fault.endswith("_loading"):  # while the ranks load: 2 s after both started
            ranks = c.rank_pids(2, time.monotonic() + 30)
            time.sleep(2.0)
            rec["ranks"] = ranks
            if fault == "kill1_loading":
                os.kill(ranks[1], signal.SIGKILL)
                return c.finish(rec, 1, (137,))
            c.proc.send_signal(signal.SIGTERM)
            return c.finish(rec, None, (143,))
        url = c.url()
        port = int(url.rsplit(":", 1)[1])
        ranks = c.rank_pids(2, time.monotonic() + 30)
        rec["ranks"] = ranks
        killed = None
        expect: tuple[int, ...] = (0,)
        if fault in ("sigterm", "sigint", "sighup"):  # SIGHUP: the terminal closed (armed like the others)
            c.proc.send_signal({"sigterm": signal.SIGTERM, "sigint": signal.SIGINT, "sighup": signal.SIGHUP}[fault])
        elif fault == "sigint_group":  # a terminal's Ctrl-C: the command and its ranks at once
            os.killpg(c.proc.pid, signal.SIGINT)
        elif fault in ("sigint_twice", "sigint_sigterm"):  # Ctrl-C pressed again (or kill) while the ranks stop
            c.proc.send_signal(signal.SIGINT)
            time.sleep(0.1)  # inside the stop (about 0.3 s)
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(signal.SIGINT if fault == "sigint_twice" else signal.SIGTERM)
        elif fault == "sigterm_streaming":
            rec.update(stream_then(c, url, lambda: c.proc.send_signal(signal.SIGTERM)))
        elif fault == "kill1_idle":
            os.kill(ranks[1], signal.SIGKILL)
            killed, expect = 1, (137,)
        elif fault == "kill1_streaming":
            rec.update(stream_then(c, url, lambda: os.kill(ranks[1], signal.SIGKILL)))
            killed, expect = 1, (137,)
            if "stream_end" in rec and not any("lost contact" in x or "rank 1" in x for x in rec["stream_end"]):
                rec["client_why"] = "the stream did not end with an error naming the lost rank"
        elif fault == "sigterm_rank1":  # rank 1 alone: it waits for rank 0's stop, then ends by the signal
            os.kill(ranks[1], signal.SIGTERM)
            killed, expect = 1, (143,)
        elif fault == "kill_parent":  # the command itself SIGKILLed: its ranks get the parent-death signal
            c.proc.kill()
            expect = (-signal.SIGKILL,)
        elif fault == "kill0_streaming":
            rec.update(stream_then(c, url, lambda: os.kill(ranks[0], signal.SIGKILL)))
            killed, expect = 0, (137,)
        rec = c.finish(rec, killed, expect)
        if expect == (0,) and not (tmp / "audit.jsonl").exists():  # a clean stop publishes rank 0's audit
            rec["why"].append("exit 0 without its --audit-log")
        if rec.pop("client_why", None):
            rec["why"].append("the stream did not end with an error naming the lost rank")
        with socket.socket() as s:  # as a restarted server binds it (a closed connection's TIME_WAIT does not count)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                s.listen()
            except OSError:
                rec["why"].append(f"port {port} still held")
        return rec


def generate_case(tmp: Path, name: str, fault: str) -> dict[str, Any]:
    with Case(name, [*GENERATE, "--audit-log", str(tmp / "gen.jsonl")], tmp) as c:
        rec: dict[str, Any] = {"case": name}
        deadline = time.monotonic() + START_S
        while not c.out and c.proc.poll() is None and time.monotonic() < deadline:  # the reply's first token
            time.sleep(0.02)
        ranks = c.rank_pids(2, time.monotonic() + 5)
        rec["ranks"] = ranks
        killed = None
        if fault == "kill1":
            os.kill(ranks[1], signal.SIGKILL)
            killed, expect = 1, (137,)
        elif fault == "kill_parent":
            c.proc.kill()
            expect = (-signal.SIGKILL,)
        elif fault == "sigterm":
            c.proc.send_signal(signal.SIGTERM)
            expect = (143,)
        elif fault == "sigint_group":
            os.killpg(c.proc.pid, signal.SIGINT)
            expect = (130,)
        elif fault == "sighup":
            c.proc.send_signal(signal.SIGHUP)
            expect = (129,)
        elif fault in ("sigint_twice", "sigint_sigterm"):  # Ctrl-C pressed again (or kill) while the ranks stop:
            c.proc.send_signal(signal.SIGINT)  # one stop, the first signal's status (a repeat within 3 s repeats it)
            time.sleep(0.1)
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(signal.SIGINT if fault == "sigint_twice" else signal.SIGTERM)
            expect = (130,)
        else:
            c.proc.send_signal(signal.SIGINT)
            expect = (130,)
        return c.finish(rec, killed, expect)


def llm_case(tmp: Path, name: str, fault: str) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    script = tmp / "script.py"
    script.write_text(LLM_SCRIPT)
    with Case(name, [sys.executable, str(script), *(["again"] if fault == "kill1_again" else [])], tmp) as c:
        rec: dict[str, Any] = {"case": name}
        if fault == "kill1_loading":  # rank 1 killed 2 s after it started: the LLM(...) line raises, naming it
            ranks = c.rank_pids(1, time.monotonic() + 60)
            time.sleep(2.0)
            os.kill(ranks[1], signal.SIGKILL)
            rec["ranks"] = ranks
            rec = c.finish(rec, 1, (1,))
            if any(x.startswith("ready") for x in c.out):
                rec["why"].append("LLM(...) returned although rank 1 died while it loaded")
            return rec
        c.wait_stdout("ready")
        ranks = c.rank_pids(1, time.monotonic() + 5)
        rec["ranks"] = ranks
        time.sleep(1.0)  # the generate is running (3,000 tokens: tens of seconds)
        killed = None
        if fault in ("kill1", "kill1_again"):
            os.kill(ranks[1], signal.SIGKILL)
            killed, expect = 1, (1,) if fault == "kill1" else (0,)
        elif fault == "kill_parent":  # the script SIGKILLed: its ranks get the parent-death signal
            c.proc.kill()
            expect = (-signal.SIGKILL,)
        elif fault == "sigterm":  # the script installs no handler: it dies by the signal, as any Python script does
            c.proc.send_signal(signal.SIGTERM)
            expect = (-signal.SIGTERM,)
        else:  # its KeyboardInterrupt, uncaught, is the script's own traceback (and Python's exit by SIGINT)
            (os.killpg if fault == "sigint_group" else os.kill)(c.proc.pid, signal.SIGINT)
            expect = (-signal.SIGINT,)
            c.script_traceback_ok = True
        rec = c.finish(rec, killed, expect)
        if fault == "kill1_again" and not any(x.startswith("again 4") for x in c.out):
            rec["why"].append(f"no new LLM after the lost rank: {c.out[-2:]}")
        return rec


CASES: dict[str, Callable[[Path], dict[str, Any]]] = {
    **{f"serve.{f}": (lambda t, f=f: serve_case(t, f"serve.{f}", f))
       for f in ("sigterm", "sigint", "sighup", "sigint_group", "sigint_twice", "sigint_sigterm",
                 "sigterm_streaming", "kill1_idle", "kill1_streaming", "kill0_streaming", "sigterm_rank1",
                 "kill_parent", "kill1_loading", "sigterm_loading")},
    **{f"generate.{f}": (lambda t, f=f: generate_case(t, f"generate.{f}", f))
       for f in ("kill1", "sigterm", "sigint", "sighup", "sigint_group", "sigint_twice", "sigint_sigterm",
                 "kill_parent")},
    **{f"llm.{f}": (lambda t, f=f: llm_case(t, f"llm.{f}", f)) for f in ("kill1", "kill1_again", "sigterm", "sigint",
                                                                          "sigint_group", "kill_parent",
                                                                          "kill1_loading")},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="the cases whose name holds this (or any of these, comma-separated)")
    ap.add_argument("--out", type=Path, default=None, help="one JSON line a case")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tp_fault_sweep-") as work:
        for name, run in CASES.items():
            if not any(o in name for o in a.only.split(",")):
                continue
            start = time.monotonic()
            try:
                rec = run(Path(work) / name)
            except Exception as e:
                rec = {"case": name, "why": [f"harness: {type(e).__name__}: {e}"[:300]]}
            rec["s"] = round(time.monotonic() - start, 1)
            rows.append(rec)
            print(json.dumps(rec, default=str), flush=True)
            if a.out is not None:
                with a.out.open("a") as f:
                    f.write(json.dumps(rec, default=str) + "\n")
    bad = [r for r in rows if r["why"]]
    print(f"{len(rows)} cases, {len(bad)} suspects")
    for r in bad:
        print(f"{r['case']}: {'; '.join(r['why'])} -- errors {r.get('errors')}")


if __name__ == "__main__":
    main()
