"""``kvload run|generate|serve --tp_size N`` outside torchrun: the command starts its N ranks itself (vLLM's habit,
``vllm serve MODEL --tensor-parallel-size 2``) and supervises them: one process's output, the ranks' exit status, a
stop signal passed on, a lost rank ending the rest, nothing left behind.

Real processes (gloo on CPU), bounded by timeouts; none is a speed assertion.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

import pipeline
from tests.cli_support import run_cli
from tests.hostile_support import signals_as_a_terminal_gives_them
from tests.tp_support import DIST_TIMEOUT_S, REPO

START_S = 240
EXIT_S = 90
SERVE = ["serve", "tiny-llama", "-tp", "2", "--port", "0", "--max_tokens", "2048"]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TRANSFORMERS_VERBOSITY": "error", "KVLOAD_DIST_TIMEOUT_S": str(DIST_TIMEOUT_S)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # not under a launcher
        env.pop(name, None)
    return env


def _kvload(*argv: str, cwd: Path) -> subprocess.Popen:
    """``python -m kvload ARGV`` (no torchrun) in a session of its own, so a test can kill all it left."""
    return subprocess.Popen([sys.executable, "-m", "kvload", *argv], cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=signals_as_a_terminal_gives_them,
                            start_new_session=True)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _rank_pids(parent: int) -> dict[int, int]:
    """rank → pid of the launcher's children (their RANK variable), once both have started."""
    deadline = time.monotonic() + 30
    while True:
        found = {}
        for pid in _children(parent):
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            found[int(env[b"RANK"])] = pid
        if len(found) == 2 or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    text = stat.read_text() if stat.exists() else ""
    return bool(text) and text.rsplit(")", 1)[1].split()[0] != "Z"


def _left_in(cwd: Path) -> list[int]:
    """Live processes running in ``cwd`` (each test's own directory: the launcher and its ranks run there)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if Path(os.readlink(proc / "cwd")) == cwd.resolve() and _alive(int(proc.name)):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def _ready(proc: subprocess.Popen) -> tuple[str, list[str]]:
    """The address in the ready line the launcher passed on from rank 0, and the stderr lines up to it."""
    deadline = time.monotonic() + START_S
    lines: list[str] = []
    while not lines or " at http://" not in lines[-1]:
        assert time.monotonic() < deadline and proc.poll() is None, f"the server did not start: {lines[-5:]}"
        lines.append(proc.stderr.readline())
    assert "tensor parallel over 2 ranks" in lines[-1], lines[-1]
    return lines[-1].split(" at ", 1)[1].split(" ", 1)[0], lines


def _cleanup(proc: subprocess.Popen, pids: dict[int, int]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids.values():
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.communicate()


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generate_starts_its_ranks_and_prints_what_one_process_prints(tmp_path, capsys):
    argv = ["generate", "tiny-llama", "--prompt-ids", "1,2,3,4,5", "--prompt-ids", "7,8,9", "--max_new_tokens", "12",
            "--max_tokens", "4096"]
    alone = run_cli(capsys, *argv)
    assert alone.code == 0, alone.err
    proc = _kvload(*argv, "--tensor-parallel-size", "2", "--audit-log", str(tmp_path / "gen.jsonl"), cwd=tmp_path)
    try:
        out, err = proc.communicate(timeout=START_S)
    finally:
        _cleanup(proc, {})
    assert proc.returncode == 0, err[-3000:]
    assert _left_in(tmp_path) == []
    assert out.splitlines()[:2] == alone.out.splitlines()[:2] and len(out.splitlines()) == 3  # rank 0's reply, once
    assert "error" not in err and err.count("kv_budget_short") == 1, err  # rank 1's warning is not said again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen.jsonl", "gen.rank1.jsonl"]  # once each, no temporary
    for rank, name in enumerate(("gen.jsonl", "gen.rank1.jsonl")):
        records = _records(tmp_path / name)
        (launched,) = [r for r in records if r["event"] == "ranks_launched"]
        assert (launched["rank"], launched["world_size"], launched["launcher"]) == (rank, 2, "kvload")
        assert launched["master_addr"] == "127.0.0.1" and launched["master_port"] > 0
        assert [r["world_size"] for r in records if r["event"] == "rank_joined"] == [2]
        assert any(r["event"] == "generation_finished" for r in records)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_serve_starts_its_ranks_answers_and_a_stop_signal_leaves_nothing(tmp_path, stop):
    proc = _kvload(*SERVE, "--audit-log", str(tmp_path / "audit.jsonl"), cwd=tmp_path)
    pids: dict[int, int] = {}
    try:
        with pipeline.load("tiny-llama", load_weights=True, kv_cache_config={"max_tokens": 2048}, log=False) as alone:
            want = alone.generate([[1, 2, 3, 4, 5]], max_new_tokens=8, ignore_eos=True)[0].token_ids
        url, lines = _ready(proc)
        pids = _rank_pids(proc.pid)
        assert sorted(pids) == [0, 1]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
        r = client.completions.create(model="tiny-llama", prompt=[1, 2, 3, 4, 5], max_tokens=8,
                                      extra_body={"ignore_eos": True})
        client.close()
        assert r.choices[0].model_extra["token_ids"] == want
        proc.send_signal(stop)  # a service manager stopping the command it started, or a terminal's Ctrl-C
        err = proc.communicate(timeout=EXIT_S)[1]
    finally:
        _cleanup(proc, pids)
    assert proc.returncode == 0, err[-3000:]  # every rank stopped cleanly, as one serving process does
    assert not any(_alive(p) for p in pids.values()) and _left_in(tmp_path) == []
    err = "".join(lines) + err
    assert "Traceback" not in err and "error:" not in err, err[-3000:]
    assert err.count("kv_budget_short") == 1 and err.count(" at http://") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.jsonl", "audit.rank1.jsonl"]
    assert any(r["event"] == "ranks_launched" for r in _records(tmp_path / "audit.jsonl"))
    port = int(url.rsplit(":", 1)[1])
    with socket.socket() as s:  # rank 0's listening socket went with it
        s.bind(("127.0.0.1", port))


def test_a_rank_killed_ends_the_command_in_one_line(tmp_path):
    proc = _kvload(*SERVE, "--audit-log", str(tmp_path / "audit.jsonl"), cwd=tmp_path)
    pids: dict[int, int] = {}
    try:
        _ready(proc)
        pids = _rank_pids(proc.pid)
        os.kill(pids[1], signal.SIGKILL)
        err = proc.communicate(timeout=EXIT_S)[1]  # no hang: rank 0 is stopped as well
    finally:
        _cleanup(proc, pids)
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert not any(_alive(p) for p in pids.values()) and _left_in(tmp_path) == []
    assert "Traceback" not in err, err[-3000:]
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert errors == [f"error: rank 1 of 2 (pid {pids[1]}) was killed by SIGKILL; kvload stopped the other ranks"]
    # a failed run publishes no audit log, on any rank; the killed rank's temporary is removed for it
    assert list(tmp_path.iterdir()) == []


def test_an_error_every_rank_meets_is_said_once_with_its_status(tmp_path):
    # each rank refuses the audit path (rank 1's is beside rank 0's): one line, rank 0's words, exit 2, no process left
    proc = _kvload("run", "tiny-llama", "--tp_size", "2", "--max_tokens", "4096", "--audit-log",
                   str(tmp_path / "missing" / "a.jsonl"), cwd=tmp_path)
    try:
        out, err = proc.communicate(timeout=START_S)
    finally:
        _cleanup(proc, {})
    assert (proc.returncode, out) == (2, ""), err[-3000:]
    assert err == f"error: --audit-log {tmp_path}/missing/a.jsonl: directory {tmp_path}/missing does not exist\n"
    assert _left_in(tmp_path) == []


@pytest.mark.parametrize("flag", ["--tp_size", "-tp", "--tensor-parallel-size"])
def test_ranks_are_started_only_for_a_size_the_checkpoint_takes(capsys, monkeypatch, tmp_path, flag):
    from kvload.cli import launch

    started = []
    monkeypatch.setattr(launch.Launcher, "run", lambda self: started.append((self.argv, self.world)) or 0)
    for command in ("run", "serve"):  # 4 attention heads: 3 ranks is refused in one line before any process starts
        r = run_cli(capsys, command, "tiny-llama", flag, "3")
        assert (r.code, r.one_error_line, r.out) == (2, True, ""), r.err
        assert "tensor_parallel_size=3: LlamaForCausalLM has 4 attention heads" in r.err
    assert started == []
    for command in ("run", "generate", "serve"):
        r = run_cli(capsys, command, "tiny-llama", flag, "2", "--max_tokens", "4096")
        assert r.code == 0, r.err
    assert started == [([c, "tiny-llama", flag, "2", "--max_tokens", "4096"], 2) for c in ("run", "generate", "serve")]
    assert run_cli(capsys, "plan", "tiny-llama", flag, "2").code == 0 and len(started) == 3  # plan runs alone
    config = tmp_path / "tp.yaml"  # the --config file may ask for the ranks too
    config.write_text("tensor_parallel_size: 2\n")
    assert run_cli(capsys, "run", "tiny-llama", "--config", config).code == 0
    assert started[3] == (["run", "tiny-llama", "--config", str(config)], 2)
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun: this process is one of the ranks already
    assert launch.ranks_to_launch(argparse.Namespace(command="run", config=None)) == 0


def test_the_python_api_refuses_a_size_the_heads_do_not_take_before_starting_any_rank():
    # kvload.LLM starts its own ranks outside torchrun (tests/test_llm_tensor_parallel.py); a size the checkpoint
    # refuses is said in one line first, and nothing is started
    import kvload
    from pipeline.errors import ModelError

    with pytest.raises(ModelError) as caught:
        kvload.LLM("tiny-llama", tensor_parallel_size=3, kv_cache_config={"max_tokens": 1024}, log=False)
    assert str(caught.value) == ("tensor_parallel_size=3: LlamaForCausalLM has 4 attention heads, which do not divide "
                                 "by 3 ranks; accepted: 1, 2, 4 (4 only to plan and run: loading weights needs a "
                                 "size that divides the 2 KV heads)")
    assert not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()


def test_a_size_transformers_plan_cannot_load_is_refused_before_any_rank_starts(capsys, monkeypatch):
    # tiny-llama's 2 KV heads on 4 ranks: the heads take it (replicated) but transformers' plan cannot load it; the
    # commands that load weights started 4 ranks that each failed at load_weights (~20 s), now one line at once
    import kvload
    from kvload import llm_ranks
    from kvload.cli import launch
    from pipeline.errors import ModelError

    started = []
    monkeypatch.setattr(launch.Launcher, "run", lambda self: started.append((self.argv, self.world)) or 0)
    monkeypatch.setattr(llm_ranks.SpawnedRanks, "start", lambda self: started.append(self.world))
    why = ("tensor_parallel_size=4: transformers' tensor-parallel plan for LlamaForCausalLM cannot split its 2 KV "
           "heads over 4 ranks")
    for command in ("generate", "serve"):
        r = run_cli(capsys, command, "tiny-llama", "-tp", "4", "--max_tokens", "4096")
        assert (r.code, r.one_error_line, r.out) == (2, True, ""), r.err
        assert why in r.err and "loading weights needs one that divides the KV heads (1, 2)" in r.err
    with pytest.raises(ModelError, match=why):
        kvload.LLM("tiny-llama", tensor_parallel_size=4, kv_cache_config={"max_tokens": 1024}, log=False)
    assert started == []
    assert run_cli(capsys, "run", "tiny-llama", "-tp", "4", "--max_tokens", "4096").code == 0  # run loads none
    assert started == [(["run", "tiny-llama", "-tp", "4", "--max_tokens", "4096"], 4)]


def test_more_ranks_than_cuda_devices_is_refused_before_any_rank_starts(capsys, monkeypatch):
    # vLLM's -tp 2 on a one-GPU machine: rank N runs on cuda:N, so rank 1 met torch's "invalid device ordinal" once
    # every rank had started; now one line naming the setting and the devices (the count is faked: no GPU here)
    import kvload
    from kvload import llm_ranks
    from kvload.cli import launch
    from pipeline.errors import RankError
    from stages import check_parallel

    started = []
    monkeypatch.setattr(launch.Launcher, "run", lambda self: started.append((self.argv, self.world)) or 0)
    monkeypatch.setattr(llm_ranks.SpawnedRanks, "start", lambda self: started.append(self.world))
    monkeypatch.setattr(check_parallel, "cuda_devices", lambda: 1, raising=False)
    why = ("tensor_parallel_size=2: each rank runs on its own CUDA device (rank N on cuda:N), and this machine has 1; "
           "accepted here: 1")
    r = run_cli(capsys, "serve", "tiny-llama", "-tp", "2", "--device", "cuda", "--max_tokens", "4096")
    assert (r.code, r.one_error_line, r.out, r.err.strip()) == (2, True, "", f"error: {why}")
    with pytest.raises(RankError, match=re.escape(why)):
        kvload.LLM("tiny-llama", tensor_parallel_size=2, device="cuda", kv_cache_config={"max_tokens": 1024}, log=False)
    assert started == []
    monkeypatch.setattr(check_parallel, "cuda_devices", lambda: 2)
    assert run_cli(capsys, "serve", "tiny-llama", "-tp", "2", "--device", "cuda", "--max_tokens", "4096").code == 0
    assert started == [(["serve", "tiny-llama", "-tp", "2", "--device", "cuda", "--max_tokens", "4096"], 2)]


@pytest.mark.parametrize(("name", "tp", "sizes"), [
    # 8 KV heads: 16 ranks replicate them, which transformers' plans cannot load (as the heads' own refusal says)
    ("llama-3.1-8b-instruct", 32, "1, 2, 4, 8, 16 (16 only to plan and run: loading weights needs a size that divides "
                                  "the 8 KV heads)"),
    ("deepseek-r1-0528", 32, "1, 2, 4, 8, 16"),  # the MLA latent is whole on every rank: nothing replicates
])
def test_the_cuda_device_refusal_marks_the_sizes_that_replicate_kv_heads(capsys, monkeypatch, name, tp, sizes):
    # "accepted here" listed 16 bare for an 8-KV-head model on a 16-GPU machine, sending `generate -tp 16` to the
    # plan's refusal next; it now says it as models.geometry.accepted_sizes says it for a size the heads refuse
    import kvload
    from kvload import llm_ranks
    from kvload.cli import launch
    from pipeline.errors import RankError
    from stages import check_parallel

    started = []
    monkeypatch.setattr(launch.Launcher, "run", lambda self: started.append(self.argv) or 0)
    monkeypatch.setattr(llm_ranks.SpawnedRanks, "start", lambda self: started.append(self.world))
    monkeypatch.setattr(check_parallel, "cuda_devices", lambda: 16)
    model = str(Path(__file__).parent / "data" / "configs" / name)
    why = (f"tensor_parallel_size={tp}: each rank runs on its own CUDA device (rank N on cuda:N), and this machine "
           f"has 16; accepted here: {sizes}")
    r = run_cli(capsys, "run", model, "-tp", str(tp), "--device", "cuda", "--max_tokens", "4096")
    assert (r.code, r.one_error_line, r.out, r.err.strip()) == (2, True, "", f"error: {why}")
    with pytest.raises(RankError) as caught:
        kvload.LLM(model, tensor_parallel_size=tp, device="cuda", kv_cache_config={"max_tokens": 4096}, log=False)
    assert str(caught.value) == why
    assert started == []


def test_plan_on_a_machine_with_fewer_cuda_devices_than_ranks_plans_rank_0_s_view(capsys, monkeypatch):
    # plan starts no rank: tp 8 planned on a one-GPU workstation for an 8-GPU target is rank 0's view (the module's
    # docstring), not the launchers' "this machine has 1" (the count is faked: no GPU here)
    import kvload
    from stages import check_parallel

    monkeypatch.setattr(check_parallel, "cuda_devices", lambda: 1)
    r = run_cli(capsys, "plan", "tiny-llama", "-tp", "2", "--device", "cuda", "--max_tokens", "4096", "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["args"]["tensor_parallel_size"] == 2
    assert kvload.plan("tiny-llama", tensor_parallel_size=2, device="cuda", log=False).args.tensor_parallel_size == 2


@pytest.mark.slow  # two ranks load tiny-llama and generate (~20 s on two busy cores)
def test_a_stop_signal_to_one_rank_alone_names_that_rank(tmp_path):
    # SIGTERM to rank 1 alone (`kill PID`, a process manager), not to the command: the rank ends by it and the others
    # are stopped. Its own line, "error: terminated (SIGTERM)", was printed as it was, which reads as the command's
    # having been stopped: the line names the rank that got the signal
    proc = _kvload("generate", "tiny-llama", "--tp_size", "2", "--prompt-ids", "1,2,3", "--max_new_tokens", "3000",
                   "--ignore_eos", "--max_tokens", "4096", cwd=tmp_path)
    pids: dict[int, int] = {}
    try:
        assert proc.stdout.read(1)  # the reply streams as it is generated: both ranks are stepping
        pids = _rank_pids(proc.pid)
        os.kill(pids[1], signal.SIGTERM)
        err = proc.communicate(timeout=EXIT_S)[1]
    finally:
        _cleanup(proc, pids)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert not any(_alive(p) for p in pids.values()) and _left_in(tmp_path) == []
    assert "Traceback" not in err, err[-3000:]
    assert [x for x in err.splitlines() if x.startswith("error:")] == [
        f"error: rank 1 of 2 (pid {pids[1]}) was sent SIGTERM, not through kvload; kvload stopped the other ranks"]


def test_a_rank_signalled_alone_is_named_when_the_others_end_in_the_same_poll(capsys):
    # rank 1 was SIGTERMed alone; rank 0 lost contact ~0.1 s later, but a loaded supervisor saw both end in one poll:
    # rank 0's "lost contact" line (first by rank number) was printed and rank 1 never named
    from types import SimpleNamespace

    from kvload.cli import launch

    launcher = launch.Launcher(["generate", "tiny-llama"], 2)
    lost = SimpleNamespace(pid=4100, returncode=1)
    signalled = SimpleNamespace(pid=4101, returncode=128 + signal.SIGTERM)
    launcher.ranks = [launch._Rank(0, lost, b"error: lost contact with another rank (rank 1)\n", 7.0, 1),
                      launch._Rank(1, signalled, b"error: terminated (SIGTERM)\n", 7.0, 128 + signal.SIGTERM)]
    assert launcher._report() == 128 + signal.SIGTERM
    assert capsys.readouterr().err == ("error: rank 1 of 2 (pid 4101) was sent SIGTERM, not through kvload; kvload "
                                       "stopped the other ranks\n")


def test_a_rank_other_than_0_that_fails_on_its_own_is_named_in_the_line(capsys):
    # rank 2 of 4 raised (its own error, not a lost peer); the others lost contact after it. Its line was printed as
    # it was, "error: RuntimeError: ...", which did not say which of the four ranks to look at
    from types import SimpleNamespace

    from kvload.cli import launch

    launcher = launch.Launcher(["generate", "ckpt"], 4)
    lost = b"error: lost contact with another rank (it exited or was killed): Connection closed by peer\n"
    own = b"error: RuntimeError: boom (run with --debug for the traceback)\n"
    launcher.ranks = [launch._Rank(r, SimpleNamespace(pid=4100 + r, returncode=1), own if r == 2 else lost,
                                   7.0 if r == 2 else 7.1, 1) for r in range(4)]
    assert launcher._report() == 1
    assert capsys.readouterr().err == ("error: rank 2 of 4 (pid 4102): RuntimeError: boom (run with --debug for the "
                                       "traceback)\n")
    # the same error on rank 0 (every rank refusing a flag, or rank 0's alone) stays rank 0's words, as one process
    launcher.ranks[0].error, launcher.ranks[0].ended_at = own, 7.0
    assert launcher._report() == 1
    assert capsys.readouterr().err == own.decode()


#: rank 2's ``sitecustomize``: its first broadcast in generation raises (an error of its own, not a lost peer)
_RANK_2_RAISES = """
import os
import re
if os.environ.get("RANK") == "2":
    import pipeline.ranks

    def broadcast(self, obj, src=0):
        raise RuntimeError("rank two broke")

    pipeline.ranks.Ranks.broadcast = broadcast
"""


@pytest.mark.slow  # four ranks load a tiny model and generate (~30-60 s on two busy cores)
def test_a_rank_among_four_that_raises_mid_generation_is_named_and_the_others_end(tmp_path):
    # rank 2 of 4 fails on its own at its first generation collective; the others meet its absence. The command ends
    # with rank 2's line naming it (it was "error: RuntimeError: rank two broke", no rank), its status, nothing left
    from tests.tp_support import four_kv_head_llama

    ckpt = four_kv_head_llama(tmp_path / "ckpt")
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(_RANK_2_RAISES)
    env = {**_env(), "PYTHONPATH": f"{inject}{os.pathsep}{REPO}"}
    proc = subprocess.Popen([sys.executable, "-m", "kvload", "generate", str(ckpt), "--tp_size", "4", "--prompt-ids",
                             "1,2,3", "--max_new_tokens", "8", "--max_tokens", "4096"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=signals_as_a_terminal_gives_them, start_new_session=True)
    try:
        err = proc.communicate(timeout=START_S)[1]
    finally:
        _cleanup(proc, {})
    assert proc.returncode == 1, err[-3000:]
    assert _left_in(tmp_path) == []
    assert "Traceback" not in err, err[-3000:]
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert re.fullmatch(r"error: rank 2 of 4 \(pid \d+\): RuntimeError: rank two broke \(run with --debug for the "
                        r"traceback\)", line), line
