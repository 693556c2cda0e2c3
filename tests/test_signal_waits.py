"""A stop signal landing while kvload waits for one of its threads to end: real processes, real signals.

CPython 3.11's ``Thread.join``, interrupted by the signal's exception, marks the still-running thread stopped; these
waits are on an Event instead (``pipeline.thread_end``) and raise the signal's exception once the thread ended. Each
child slows its model's forward after the first, prints a line just before the wait, and is signalled inside it."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx

from tests.cli_support import ENV, REPO, ready_url, until_ready

#: Child prelude: every forward after the first takes SLOW seconds (the signal lands well inside it), and
#: ``running()`` names the kvload threads still running (``threading.enumerate``: a thread leaves it as it ends,
#: whatever 3.11's ``is_alive`` says after an interrupted join).
_PRELUDE = """
import json, signal, sys, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's Ctrl-C (a suite run with `&` has it ignored)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT}})
sys.path.insert(0, {repo!r})
import engine.executor
SLOW = {slow}
second = threading.Event()
_forward = engine.executor.GenerationExecutor.forward
def forward(self, *a, **k):
    if getattr(self, "_test_calls", 0) >= 1:
        second.set()
        print("slow step", file=sys.stderr, flush=True)
        time.sleep(SLOW)
    self._test_calls = getattr(self, "_test_calls", 0) + 1
    return _forward(self, *a, **k)
engine.executor.GenerationExecutor.forward = forward
def running():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("kvload"))
"""


def _child(body: str, slow: float) -> subprocess.Popen[str]:
    code = _PRELUDE.format(repo=str(REPO), slow=slow) + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, cwd=REPO)


def _signal_after(proc: subprocess.Popen[str], line: str, signum: int, delay: float = 1.0) -> tuple[str, str]:
    """Once the child prints ``line`` on stdout, wait ``delay`` s (it is then inside the wait) and send ``signum``."""
    try:
        seen = proc.stdout.readline()
        assert seen.strip() == line, (seen, "" if seen else proc.communicate(timeout=60)[1][-3000:])
        time.sleep(delay)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return out, err


def test_ctrl_c_while_a_closed_stream_waits_for_its_worker_leaves_the_llm_free():
    """A REPL's Ctrl-C as a ``generate_stream`` closes: the KeyboardInterrupt comes once the worker stopped, so the
    next ``generate`` runs; the 3.11 join let it through with the worker mid-step ("already generating")."""
    proc = _child("""
        import kvload
        from tests.llm_support import llm_kwargs
        llm = kvload.LLM("tiny-llama", **llm_kwargs())
        stream = llm.generate_stream([[1, 2, 3]], max_tokens=40, ignore_eos=True)
        next(stream)
        print("closing", flush=True)
        try:
            stream.close()
        except KeyboardInterrupt:
            left = running()
            try:
                nxt = len(llm.generate([[1, 2]], max_tokens=2, ignore_eos=True)[0].outputs[0].token_ids)
            except Exception as exc:
                nxt = str(exc)
            print(json.dumps({"running": left, "next": nxt}), flush=True)
            raise
        print("not interrupted", flush=True)
    """, slow=6.0)
    out, err = _signal_after(proc, "closing", signal.SIGINT)
    assert json.loads(out) == {"running": [], "next": 2}, (out, err)
    assert proc.returncode == -signal.SIGINT and err.rstrip().endswith("KeyboardInterrupt"), err[-2000:]


def test_ctrl_c_during_server_thread_stop_comes_once_both_threads_ended():
    """``ServerThread.stop()`` with a request mid-step: a Ctrl-C inside it is raised after the HTTP thread and the
    engine loop ended, not with both still running as the process exits."""
    proc = _child("""
        import httpx, pipeline
        from kvload.serve.server import ServerThread, build_state
        result = pipeline.load("tiny-llama", load_weights=True, log=False, kv_cache_config={"max_tokens": 2048})
        server = ServerThread(build_state(result)).start()
        def ask():
            try:
                httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"prompt": [1, 2, 3], "max_tokens": 20, "ignore_eos": True})
            except Exception:
                pass
        threading.Thread(target=ask, daemon=True).start()
        assert second.wait(60)
        print("stopping", flush=True)
        try:
            server.stop()
        except KeyboardInterrupt:
            print(json.dumps({"running": running()}), flush=True)
            raise
        print("not interrupted", flush=True)
    """, slow=6.0)
    out, err = _signal_after(proc, "stopping", signal.SIGINT)
    assert json.loads(out) == {"running": []}, (out, err)
    assert proc.returncode == -signal.SIGINT and err.rstrip().endswith("KeyboardInterrupt"), err[-2000:]


def test_a_second_sigterm_while_kvload_serve_waits_for_its_engine_step_exits_143_with_the_loop_ended():
    """``kvload serve``'s own ``main``: SIGTERM stops the server; uvicorn cuts the answer still waiting on a long step
    after 5 s, and the engine's stop then waits for that step. A second SIGTERM there ends the command as a
    SIGTERM does (one line, exit 143) once the loop ended: none of kvload's threads is left running."""
    proc = _child("""
        from kvload.cli.entry import main
        print("serving", flush=True)
        code = main(["serve", "tiny-llama", "--port", "0", "--max_tokens", "1024", "--device", "cpu"])
        print(json.dumps({"code": code, "running": running()}), flush=True)
        sys.exit(code)
    """, slow=20.0)
    try:
        assert proc.stdout.readline().strip() == "serving"
        url = ready_url(until_ready(proc)[-1])

        def ask() -> None:
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(url + "/v1/completions", timeout=60, json={"prompt": [1, 2, 3], "max_tokens": 20,
                                                                       "ignore_eos": True, "stream": True})

        threading.Thread(target=ask, daemon=True).start()
        while (line := proc.stderr.readline()) and line.strip() != "slow step":
            pass
        assert line, "the request's second step never started"
        proc.send_signal(signal.SIGTERM)  # the server stops; its graceful shutdown gives up on the answer at 5 s
        time.sleep(10.0)  # past that, inside the engine's stop, which waits for the 20 s step
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert json.loads(out.splitlines()[-1]) == {"code": 143, "running": []}, (out, err)
    assert proc.returncode == 143 and "error: terminated (SIGTERM)" in err and "Traceback" not in err, err[-2000:]
