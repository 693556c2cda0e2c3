"""``kvload serve --tp_size 2`` under real ``torchrun`` (gloo, CPU), through the ``openai`` client: rank 0 serves,
rank 1 follows its loop; the answers are one process's, and a stop or a lost rank ends every process.

One launch serves the module's first tests and is stopped by the last (SIGTERM to rank 0, as a service manager
sends). Timeouts bound every wait (a hang fails the test); none is a speed assertion.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import pipeline
from tests.hostile_support import signals_as_a_terminal_gives_them
from tests.tp_support import DIST_TIMEOUT_S, REPO, free_port, kill_launch

#: generous bounds: start-up is two loads on a shared 2-core machine
START_S = 240
EXIT_S = 90
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17], [20, 21]]
MAX_TOKENS = 8
SAMPLED = {"temperature": 1.0, "seed": 7}


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "TRANSFORMERS_VERBOSITY": "error", "KVLOAD_DIST_TIMEOUT_S": str(DIST_TIMEOUT_S), **extra}


SERVE = ["serve", "tiny-llama", "--tp_size", "2", "--port", "0", "--max_tokens", "2048", "--enable-reset-prefix-cache"]


def _url(proc: subprocess.Popen) -> str:
    """The address in rank 0's ready line (rank 0 alone listens; --port 0 picks a free port)."""
    deadline = time.monotonic() + START_S
    line = ""
    while " at http://" not in line:
        assert time.monotonic() < deadline and proc.poll() is None, f"the server did not start: {line}"
        line = proc.stderr.readline()
    assert "tensor parallel over 2 ranks" in line, line
    return line.split(" at ", 1)[1].split(" ", 1)[0]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:  # gone already
        return []


def _rank_pids(launcher: int) -> dict[int, int]:
    """rank → pid of torchrun's worker processes (their RANK variable)."""
    found = {}
    for pid in _children(launcher):
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        found[int(env[b"RANK"])] = pid
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
    return bool(stat) and stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def _kill_group(proc: subprocess.Popen) -> None:
    kill_launch(proc)  # torchrun's ranks too: each leads a session of its own


def _reference() -> dict[str, list[list[int]]]:
    """One process's tokens (the Python API, no tensor parallel): greedy per prompt, and a seeded sample."""
    with pipeline.load("tiny-llama", load_weights=True, kv_cache_config={"max_tokens": 2048}, log=False) as loaded:
        greedy = [loaded.generate([p], max_new_tokens=MAX_TOKENS, ignore_eos=True)[0].token_ids for p in PROMPTS]
        sampled = [loaded.generate([p], max_new_tokens=MAX_TOKENS, ignore_eos=True, **SAMPLED)[0].token_ids
                   for p in PROMPTS[:2]]
        # choice j of an n=3 request is the sample seed + j gives alone
        choices = [loaded.generate([PROMPTS[2]], max_new_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.0,
                                   seed=7 + j)[0].token_ids for j in range(3)]
    return {"greedy": greedy, "sampled": sampled, "choices": choices}


def _torchrun(out: Path) -> subprocess.Popen:
    """``torchrun --nproc-per-node 2 -m kvload serve tiny-llama --tp_size 2 ...`` in a session of its own, each rank's
    audit log in ``out``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "kvload", *SERVE, "--audit-log", str(out / "audit.jsonl")]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    preexec_fn=signals_as_a_terminal_gives_them,
                            start_new_session=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """torchrun with 2 ranks serving tiny-llama; the reference tokens computed while it starts."""
    out = tmp_path_factory.mktemp("tp-serve")
    proc = _torchrun(out)
    try:
        reference = _reference()
        url = _url(proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
        yield {"proc": proc, "url": url, "client": client, "reference": reference, "out": out}
        client.close()
    finally:
        _kill_group(proc)


def _complete(client: openai.OpenAI, i: int, **kw: object) -> list[int]:
    extra = {"ignore_eos": True, **{k: kw.pop(k) for k in ("seed",) if k in kw}}
    r = client.completions.create(model="tiny-llama", prompt=PROMPTS[i], max_tokens=MAX_TOKENS, extra_body=extra,
                                  **kw)
    assert r.choices[0].finish_reason == "length"
    return r.choices[0].model_extra["token_ids"]


def _ended(http: httpx.Client, reason: str) -> float:
    """Requests rank 0's /metrics counts as ended with ``reason`` (prometheus_client's parser)."""
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "kvload_request_success_total" and sample.labels.get("finished_reason") == reason:
                return sample.value
    raise AssertionError("no kvload_request_success_total series for " + reason)


def test_greedy_and_seeded_completions_are_one_processs_tokens(served):
    client, want = served["client"], served["reference"]
    assert _complete(client, 0) == want["greedy"][0]
    for i in (0, 1):
        assert _complete(client, i, **SAMPLED) == want["sampled"][i]
    assert want["sampled"][0] != want["greedy"][0]  # the sample is not greedy's in disguise
    with httpx.Client(base_url=served["url"], timeout=60) as http:  # rank 0's own endpoints
        assert http.get("/health").json() == {"status": "ok"}
        assert "kvload_generation_tokens_total" in http.get("/metrics").text


def _computed(http: httpx.Client) -> float:
    """Prompt tokens whose KV rank 0 computed, every request's (``request_prefill_kv_computed_tokens``' sum)."""
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "kvload_request_prefill_kv_computed_tokens_sum":
                return sample.value
    raise AssertionError("no kvload_request_prefill_kv_computed_tokens_sum")


def test_n_choices_fork_one_prefill_on_every_rank(served):
    # rank 1 forks the choices as rank 0 does (StepOrders.groups): were it to prefill them, the per-step check would
    # fail the step (a 500), and the ranks would stop
    with httpx.Client(base_url=served["url"], timeout=60) as http:
        before = _computed(http)
        r = served["client"].completions.create(model="tiny-llama", prompt=PROMPTS[2], max_tokens=MAX_TOKENS, n=3,
                                                temperature=1.0, seed=7, extra_body={"ignore_eos": True})
        assert _computed(http) - before == len(PROMPTS[2])  # one prefill for the three
    assert [c.model_extra["token_ids"] for c in r.choices] == served["reference"]["choices"]


def test_concurrent_requests_and_a_cancelled_stream(served):
    client, want = served["client"], served["reference"]
    body = {"model": "tiny-llama", "prompt": [3, 1, 4, 1, 5], "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=served["url"], timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        chunks = 0
        for line in response.iter_lines():  # the long stream is running on both ranks; then its client goes
            chunks += line.startswith("data: {")
            if chunks == 2:
                break
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # these join its batch
            futures = [pool.submit(_complete, client, i) for i in range(4)]
            got = [f.result(timeout=120) for f in futures]
    assert got == want["greedy"]
    # the cancelled stream is aborted (not run to its 1,000 tokens), on rank 1 too: the ranks still step together
    # (a rank that kept it would schedule another batch, which the per-step check refuses); the audits show it
    with httpx.Client(base_url=served["url"], timeout=60) as http:
        deadline = time.monotonic() + 60
        while _ended(http, "abort") != 1:
            assert time.monotonic() < deadline, "the cancelled stream was not aborted"
            time.sleep(0.1)
    assert _complete(client, 3) == want["greedy"][3]


def test_a_prefix_cache_reset_reaches_every_rank(served):
    # were rank 1 to keep its cached prefix, it would schedule the prompt's cached blocks where rank 0 computes them:
    # the per-step check fails that step (a 500), and the ranks stop
    client, prompt = served["client"], list(range(1, 41))

    def cached() -> int:
        r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True})
        return r.usage.prompt_tokens_details.cached_tokens

    assert [cached(), cached()] == [0, 32]  # one 32-token block shared
    with httpx.Client(base_url=served["url"], timeout=60) as http:
        assert http.post("/reset_prefix_cache").json() == {"reset": True}
    assert cached() == 0


def test_sigterm_to_rank_0_stops_every_rank_cleanly(served):
    # last in the module: it ends the fixture's server
    proc = served["proc"]
    pids = _rank_pids(proc.pid)
    assert sorted(pids) == [0, 1]
    os.kill(pids[0], signal.SIGTERM)  # what a service manager sends the serving process
    assert proc.wait(timeout=EXIT_S) == 0  # torchrun: every rank exited 0
    assert not any(_alive(p) for p in pids.values())
    err = proc.stderr.read()
    assert "Traceback" not in err and "error:" not in err, err[-3000:]
    out = served["out"]
    assert sorted(p.name for p in out.iterdir()) == ["audit.jsonl", "audit.rank1.jsonl"]
    ends = []
    for name in ("audit.jsonl", "audit.rank1.jsonl"):  # each rank's own log, of the same requests
        records = [json.loads(line) for line in (out / name).read_text().splitlines()]
        ends.append(sorted(r["reason"] for r in records if r.get("event") == "request_finished"))
    assert ends[0] == ends[1] and ends[0].count("abort") == 1, ends


def test_ctrl_c_under_torchrun_stops_every_rank_cleanly(tmp_path):
    # a terminal's Ctrl-C reaches torchrun and both ranks at once (and torchrun passes it on): rank 1 waits for rank
    # 0's stop rather than dying mid-collective, so both end cleanly and publish their audit logs
    proc = _torchrun(tmp_path)
    try:
        url = _url(proc)
        pids = _rank_pids(proc.pid)
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.post("/v1/completions", json={"model": "tiny-llama", "prompt": [1, 2], "max_tokens": 2}
                             ).status_code == 200
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=EXIT_S)  # torchrun's own status is its signal's
        err = proc.stderr.read()
    finally:
        _kill_group(proc)
    assert not any(_alive(p) for p in pids.values())
    assert not [x for x in err.splitlines() if x.startswith("error:")], err[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.jsonl", "audit.rank1.jsonl"]


def test_a_follower_that_dies_fails_the_requests_and_ends_rank_0(tmp_path):
    # rank 1 SIGKILLed mid-request: rank 0 answers 500 and exits 1 with one line instead of hanging. Two processes
    # launched here rather than by torchrun, whose SIGTERM to the survivor would race rank 0's own finding.
    env = _env(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, "-m", "kvload", *SERVE], cwd=tmp_path,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              preexec_fn=signals_as_a_terminal_gives_them, start_new_session=True) for rank in (0, 1)]
    try:
        url = _url(procs[0])
        with httpx.Client(base_url=url, timeout=60) as http:
            body = {"model": "tiny-llama", "prompt": [3, 1, 4], "max_tokens": 2000, "ignore_eos": True,
                    "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                for line in lines:
                    if line.startswith("data: {"):
                        break
                procs[1].send_signal(signal.SIGKILL)
                rest = [x for x in lines if x.startswith("data: ")]
            assert rest[-1] == "data: [DONE]", rest[-3:]  # the stream ends as any does, after its error chunk
            last = json.loads(rest[-2][6:])  # the server error, not a cut connection
            assert last["error"]["type"] == "server_error", last
            assert last["error"]["message"].startswith("lost contact with another rank"), last
        err = procs[0].communicate(timeout=EXIT_S)[1]
    finally:
        for p in procs:
            _kill_group(p)
    assert procs[0].returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
    assert line.startswith("error: lost contact with another rank (it exited or was killed): "), line


#: rank 1 as ``python -m kvload`` with a slow set-up: 1.5 s more before it starts following rank 0's loop
_SLOW_FOLLOWER = """
import sys, time
from engine.serving import ServingEngine
follow = ServingEngine.follow
def slow(self, *args, **kw):
    time.sleep(1.5)
    return follow(self, *args, **kw)
ServingEngine.follow = slow
from kvload.cli.entry import main
sys.exit(main(sys.argv[1:]))
"""


def _two_ranks(cwd: Path, *signals: tuple[int, signal.Signals], audit: bool = False, warm: bool = True,
               slow_follower: bool = False) -> list[tuple[int, str]]:
    """Two serving ranks launched here (each rank's exit status seen, which torchrun's own hides); once rank 0 is
    ready (``warm``: and a completion has run), send each ``(rank, signal)`` in turn (0.5 s apart, as a launcher
    passing a signal on may); each rank's exit status and stderr. ``audit``: each rank writes ``--audit-log
    audit.jsonl`` in ``cwd`` (rank 1's is ``audit.rank1.jsonl``); ``slow_follower``: rank 1 sets up 1.5 s longer."""
    env = _env(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    args = [*SERVE, "--audit-log", "audit.jsonl"] if audit else SERVE
    procs = [subprocess.Popen([sys.executable, *(("-c", _SLOW_FOLLOWER) if rank and slow_follower else
                                                  ("-m", "kvload")), *args], cwd=cwd,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, preexec_fn=signals_as_a_terminal_gives_them,
                              start_new_session=True) for rank in (0, 1)]
    try:
        url = _url(procs[0])
        if warm:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
            _complete(client, 0)
        for k, (rank, sig) in enumerate(signals):
            if k:
                time.sleep(0.5)
            procs[rank].send_signal(sig)
        errs = [p.communicate(timeout=EXIT_S)[1] for p in procs]
        return [(p.returncode, err) for p, err in zip(procs, errs, strict=True)]
    finally:
        for p in procs:
            _kill_group(p)


def test_the_ready_line_comes_once_every_rank_follows_so_a_stop_signal_then_ends_them_cleanly(tmp_path):
    # rank 0's ready line came as soon as its own loop started; rank 1, still setting up, met a stop signal sent on
    # that line there: exit 143, its audit unwritten, and rank 0 lost it. Ready now means every rank steps.
    (rc0, err0), (rc1, err1) = _two_ranks(tmp_path, (1, signal.SIGTERM), (0, signal.SIGTERM), audit=True, warm=False,
                                          slow_follower=True)
    assert (rc0, rc1) == (0, 0), (err0[-2000:], err1[-2000:])
    for err in (err0, err1):
        assert "Traceback" not in err and "error:" not in err, err[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.jsonl", "audit.rank1.jsonl"]


def test_a_stop_signal_to_every_rank_ends_the_follower_cleanly_too(tmp_path):
    # Ctrl-C or torchrun reach rank 1 first: it waits for rank 0's stop and exits 0. It used to end at once, its steps
    # still inside a gloo collective: C++ "terminate called", SIGABRT (-6), which torchrun's own status hid
    (rc0, err0), (rc1, err1) = _two_ranks(tmp_path, (1, signal.SIGTERM), (0, signal.SIGTERM))
    assert (rc0, rc1) == (0, 0), err1[-2000:]
    for err in (err0, err1):
        assert "terminate called" not in err and "Fatal Python error" not in err and "error:" not in err, err[-2000:]


def test_a_stop_signal_repeated_while_the_ranks_stop_still_ends_them_cleanly(tmp_path):
    # torchrun passes a terminal's Ctrl-C on to ranks the terminal already reached, so each gets SIGINT twice. The
    # second, while rank 1 waited for rank 0's stop or while a rank tore down, was raised there: "error: interrupted;
    # the --audit-log file was not written" (exit 130). A stop under way is repeated, not cut short.
    sig = signal.SIGINT
    (rc0, err0), (rc1, err1) = _two_ranks(tmp_path, (1, sig), (1, sig), (0, sig), (0, sig), audit=True)
    assert (rc0, rc1) == (0, 0), (err0[-2000:], err1[-2000:])
    for err in (err0, err1):
        assert "terminate called" not in err and "Traceback" not in err and "error:" not in err, err[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.jsonl", "audit.rank1.jsonl"]


def test_a_follower_whose_rank_0_does_not_stop_ends_by_its_signal_in_one_line(tmp_path):
    # SIGTERM to rank 1 alone: after its grace it ends by the signal (143, one line); rank 0 then loses it (exit 1)
    (rc0, err0), (rc1, err1) = _two_ranks(tmp_path, (1, signal.SIGTERM))
    assert rc1 == 143, err1[-2000:]
    assert "terminate called" not in err1 and "Traceback" not in err1, err1[-2000:]
    assert [x for x in err1.splitlines() if x.startswith("error: ")] == ["error: terminated (SIGTERM)"]
    assert rc0 == 1 and "error: lost contact with another rank" in err0, err0[-2000:]
