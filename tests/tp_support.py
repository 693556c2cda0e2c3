"""Tensor-parallel tests: run scenarios on 2 real ranks (``torchrun``, gloo), bounded by timeouts.

Each 2-process launch costs ~10-20 s of start-up on 2 cores, so one launch runs every scenario
(``python -m tests.tp_support OUT_DIR`` under torchrun) and each rank writes ``OUT_DIR/rank<N>.json``;
the tests read those. A scenario that fails records its error and the next one still runs: every
rank takes part in every collective, so one scenario's failure cannot strand the other rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "tests" / "data" / "configs"
#: Seconds a collective may wait inside the ranks; a test run never waits longer than LAUNCH_TIMEOUT_S.
DIST_TIMEOUT_S = 60
LAUNCH_TIMEOUT_S = 300


def free_port() -> int:
    """A TCP port nobody listens on now (torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*argv: str, nproc: int = 2, timeout: float = LAUNCH_TIMEOUT_S,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node N ARGV...`` from the repository root; the whole process group dies on timeout."""
    # torchrun is torch.distributed.run's console script; the module form needs no PATH lookup
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), *argv]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                "TRANSFORMERS_VERBOSITY": "error", "KVLOAD_DIST_TIMEOUT_S": str(DIST_TIMEOUT_S), **(env or {})}
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = kill_launch(proc)
        raise AssertionError(f"torchrun {' '.join(argv)} did not finish in {timeout} s\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_launch(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGKILL a launcher started in a session of its own and every rank it started; then its (stdout, stderr).

    torchrun starts each rank in a session of its own: SIGKILL to torchrun's group alone left the ranks running (a
    server still serving), and, as they hold torchrun's stdout and stderr, the ``communicate()`` after it waited for
    ever. So each child's group goes first (a rank's own children with it), while they are still torchrun's."""
    for pid in _children(proc.pid):
        with contextlib.suppress(ProcessLookupError):  # gone, or not leading a group (then in the launcher's)
            os.killpg(pid, signal.SIGKILL)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate()


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started that are still its children (Linux's /proc); none once it is gone."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def all_children(pid: int) -> set[int]:
    """The live child processes of ``pid`` that any of its threads started (Linux's /proc); a thread that ended as it
    was read is skipped."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            continue
    return found


def four_kv_head_llama(path: Path) -> Path:
    """The tiny llama with four KV heads (so that four ranks split them), random weights saved at ``path``."""
    from models.weights import random_model
    from tests.paged_support import tiny_config

    random_model(tiny_config("llama", num_key_value_heads=4), device="cpu", dtype="float32", seed=0).save_pretrained(
        path)
    return path


def run_scenarios(out_dir: Path, *names: str) -> list[dict[str, Any]]:
    """Run scenarios on 2 ranks; each rank's results, in rank order."""
    r = torchrun("-m", "tests.tp_support", str(out_dir), *names)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads((out_dir / f"rank{n}.json").read_text()) for n in range(2)]


# --- what runs inside each rank ---------------------------------------------------------------


def _events(records: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in records if r["event"] == name]


def agree(out: Path, rank: int) -> dict[str, Any]:
    """Same inputs on every rank: the ranks agree, each writes its own audit file."""
    import pipeline

    result = pipeline.plan("tiny-llama", tensor_parallel_size=2, kv_cache_config={"max_tokens": 4096}, log=False,
                           audit_log=out / "agree.jsonl")
    return {"agreed": result.audit.of("ranks_agreed"), "joined": result.audit.of("rank_joined"),
            "kv": result.kv.to_dict()}


def disagree(out: Path, rank: int) -> dict[str, Any]:
    """A rank-local override (rank 1 asks for a shorter max_seq_len): every rank must fail, naming the field."""
    import pipeline
    from pipeline.errors import RankError

    records: list[dict[str, Any]] = []
    try:
        pipeline.plan("tiny-llama", tensor_parallel_size=2, max_seq_len=2048 if rank == 0 else 1024, log=False,
                      subscribers=[records.append], audit_log=out / "disagree.jsonl")
    except RankError as exc:
        return {"error": str(exc), "events": _events(records, "ranks_disagreed"),
                "audit_written": sorted(p.name for p in out.glob("disagree*"))}
    return {"error": None}


def geometry(out: Path, rank: int) -> dict[str, Any]:
    """Each rank's KV heads and bytes per token for Llama 3.1 (8 KV heads), Qwen2.5 (4) and a 1-KV-head model."""
    from transformers import LlamaConfig

    import pipeline
    from pipeline.ranks import ranks_from_env

    one_head = out / "one-kv-head"
    if rank == 0:  # one writer; every rank must read the same checkpoint (agree_ranks compares its path)
        LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=1, max_position_embeddings=1024, architectures=["LlamaForCausalLM"]
                    ).save_pretrained(one_head)
    ranks_from_env().barrier()
    found = {}
    for name, path in (("llama", CONFIGS / "llama-3.1-8b-instruct"), ("qwen", CONFIGS / "qwen2.5-7b-instruct"),
                       ("one_kv_head", one_head)):
        kv = pipeline.plan(str(path), tensor_parallel_size=2, log=False).kv
        found[name] = {"heads": kv.heads, "per_rank": kv.bytes_per_token, "total": kv.bytes_per_token_total}
    return found


def budget(out: Path, rank: int) -> dict[str, Any]:
    """Different byte caps per rank: every rank builds the smallest rank's pools, and says whose it was."""
    import pipeline

    cap = (2 << 20) if rank == 0 else (1 << 20)
    with pipeline.load("tiny-llama", tensor_parallel_size=2, kv_cache_config={"max_gpu_total_bytes": cap},
                       max_seq_len=1024, log=False) as loaded:
        event = loaded.audit.of("kv_budget_computed")[0]
        return {"blocks": loaded.kv.pools.num_blocks, "budget_bytes": loaded.kv.budget_bytes,
                "pool_bytes": loaded.kv_manager.pools.nbytes, "event": event}


def _replay_recording_tables(loaded: Any, workload: Any) -> dict[str, Any]:
    """Replay a workload; hash every running request's block tables after each scheduler decision."""
    from engine.simulator import replay

    manager, scheduler = loaded.kv_manager, loaded.scheduler
    groups = [g.name for g in manager.pools.layout.groups]
    digest = hashlib.sha256()
    steps = 0
    original = scheduler.step

    def step(waiting: Any, running: Any) -> Any:
        nonlocal steps
        decided = original(waiting, running)
        steps += 1
        for req in sorted(running, key=lambda r: r.req_id):
            digest.update(json.dumps([req.req_id, [manager.block_table(req, g) for g in groups]]).encode())
        return decided

    scheduler.step = step
    metrics = replay(manager, scheduler, workload)
    return {"digest": digest.hexdigest(), "steps": steps, "suspends": metrics.suspends, "waits": metrics.waits}


def block_tables(out: Path, rank: int) -> dict[str, Any]:
    """A workload through V1 and V2 on both ranks: a digest of every step's block tables, per manager."""
    import pipeline
    from engine.workloads import shared_prefix

    found = {}
    for v2 in (False, True):
        wl = shared_prefix(24, seed=3, group_size=4, prefix_len=96, question_len=16, answer_len=24, vocab=500)
        kv = {"use_kv_cache_manager_v2": v2, "max_tokens": 640}
        with pipeline.load("tiny-llama", tensor_parallel_size=2, max_seq_len=256, max_num_tokens=64,
                           kv_cache_config=kv, log=False) as loaded:
            found["v2" if v2 else "v1"] = _replay_recording_tables(loaded, wl)
    return found


def generate(out: Path, rank: int) -> dict[str, Any]:
    """Weights sharded by transformers' TP plan: each rank's shard and pools, and what it generates."""
    import pipeline

    with pipeline.load("tiny-llama", load_weights=True, tensor_parallel_size=2, kv_cache_config={"max_tokens": 1024},
                       log=False) as loaded:
        k_proj = loaded.hf_model.model.layers[0].self_attn.k_proj.weight
        greedy = loaded.generate([[1, 2, 3, 4, 5], [9, 8, 7]], max_new_tokens=8)
        sampled = loaded.generate([[1, 2, 3]], max_new_tokens=8, temperature=1.0)  # seed=None: rank 0's seed
        return {"k_proj_local_rows": k_proj.to_local().shape[0] if hasattr(k_proj, "to_local") else None,
                "pool_shape": loaded.kv_manager.pools.describe()["uniform"]["shape"],
                "greedy": [o.token_ids for o in greedy], "sampled": sampled[0].token_ids,
                "weights_event": loaded.audit.of("weights_loaded")[0],
                "linear_auto": [(e["new"], e["reason"]) for e in loaded.audit.of("auto_resolved")
                                if e["field"] == "linear_backend"],
                "linear_asked": linear_asked(), "drafted": drafted(), "beams": beams()}


#: DeepSeek V4 under TP: two prompts sharing their first 260 tokens (two of the preset's 128-token reuse units)
V4_PROMPTS = [[(7 * i) % 500 + 1 for i in range(300)], [(7 * i) % 500 + 1 for i in range(260)] + [3, 1, 4, 1, 5]]


def deepseek_v4(out: Path, rank: int) -> dict[str, Any]:
    """DeepSeek V4 under TP (transformers' plan shards its experts, its attention is whole on every rank): greedy
    tokens of two prompts run one after the other, the second reusing the first's prefix."""
    import pipeline

    with pipeline.load("tiny-deepseek-v4", load_weights=True, tensor_parallel_size=2,
                       kv_cache_config={"max_tokens": 4096}, log=False) as loaded:
        outs = [loaded.generate([p], max_new_tokens=6, ignore_eos=True)[0] for p in V4_PROMPTS]
        return {"greedy": [o.token_ids for o in outs], "reused": [o.reused_prompt_tokens for o in outs]}


#: DeepSeek V3 under TP: two prompts, the second sharing the first's first 64 tokens (two 32-token blocks)
V3_PROMPTS = [[(5 * i) % 500 + 1 for i in range(70)], [(5 * i) % 500 + 1 for i in range(64)] + [2, 7, 1, 8]]


def deepseek_v3(out: Path, rank: int) -> dict[str, Any]:
    """DeepSeek V3 under TP (transformers' plan shards kv_b_proj by heads, the MLA latent is whole on every rank):
    greedy tokens of two prompts run one after the other, the second reusing the first's prefix."""
    import pipeline

    with pipeline.load("tiny-deepseek-v3", load_weights=True, tensor_parallel_size=2,
                       kv_cache_config={"max_tokens": 1024}, log=False) as loaded:
        outs = [loaded.generate([p], max_new_tokens=6, ignore_eos=True)[0] for p in V3_PROMPTS]
        return {"greedy": [o.token_ids for o in outs], "reused": [o.reused_prompt_tokens for o in outs]}


#: the prompts and width of the beam search run on every rank (and in one process, by the test)
BEAM_PROMPTS, BEAM_WIDTH = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3]], 3


def beams() -> list[list[list[int]]]:
    """``LLM.beam_search`` under TP: rank 0's top 2k on every rank, so every rank forks and frees the same beams;
    each prompt's sequences."""
    import pipeline
    from engine.beam_search import BeamSearchParams

    with pipeline.load("tiny-llama", load_weights=True, tensor_parallel_size=2, kv_cache_config={"max_tokens": 1024,
                       "tokens_per_block": 4}, max_beam_width=BEAM_WIDTH, log=False) as loaded:
        outs = loaded.executor.beam_search(BEAM_PROMPTS, BeamSearchParams(beam_width=BEAM_WIDTH, max_tokens=6,
                                                                          ignore_eos=True))
        return [[list(s.token_ids) for s in o.sequences] for o in outs]


#: a prompt whose tokens recur, so n-gram drafts are proposed from its first decode step on
DRAFT_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


def drafted() -> dict[str, Any]:
    """``max_draft_len: 4`` under TP: drafts are proposed from the tokens (rank 0's), so every rank schedules them
    alike; the tokens and the draft counts."""
    import pipeline

    with pipeline.load("tiny-llama", load_weights=True, tensor_parallel_size=2, kv_cache_config={"max_tokens": 1024},
                       max_draft_len=4, log=False) as loaded:
        out = loaded.generate([DRAFT_PROMPT], max_new_tokens=12, ignore_eos=True)[0]
        stats = loaded.executor.last_stats
        return {"tokens": out.token_ids, "draft_tokens": stats.draft_tokens,
                "accepted": stats.accepted_draft_tokens}


def linear_asked() -> list[str]:
    """``linear_backend: cpu_kernel`` asked for under TP: the ``setting_ignored`` reasons (the shards are DTensors)."""
    import pipeline

    with pipeline.load("tiny-llama", load_weights=True, tensor_parallel_size=2, kv_cache_config={"max_tokens": 1024},
                       linear_backend="cpu_kernel", log=False) as loaded:
        assert loaded.executor.linear is None
        return [e["reason"] for e in loaded.audit.of("setting_ignored") if e["field"] == "linear_backend"]


def compare_cli(out: Path, rank: int) -> dict[str, Any]:
    """``kvload plan --compare`` on both ranks (its variant plans run the collectives too): rank 0 prints."""
    import contextlib
    import io

    from kvload.cli.entry import main

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["plan", "tiny-llama", "--tp_size", "2", "--max_tokens", "4096", "--compare", "--json"])
    return {"code": code, "stdout": stdout.getvalue()}


SCENARIOS: dict[str, Callable[[Path, int], dict[str, Any]]] = {
    "agree": agree, "disagree": disagree, "geometry": geometry, "budget": budget, "block_tables": block_tables,
    "generate": generate, "compare_cli": compare_cli, "deepseek_v4": deepseek_v4, "deepseek_v3": deepseek_v3,
}


def main(argv: list[str]) -> int:
    """Run the named scenarios (all by default) on this rank; write ``rank<N>.json`` in the output directory."""
    out = Path(argv[0])
    names = argv[1:] or list(SCENARIOS)
    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for name in names:
        try:
            results[name] = SCENARIOS[name](out, rank)
        except Exception as exc:  # recorded for the test to show; the other scenarios still run
            results[name] = {"exception": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    (out / f"rank{rank}.json").write_text(json.dumps(results, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
