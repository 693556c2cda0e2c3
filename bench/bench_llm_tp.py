"""``kvload.LLM(..., tensor_parallel_size=2)``: a call's cost with the ranks the LLM starts, against torchrun's.

Two modes of the same script, interleaved: "LLM's ranks" (a plain ``python`` process; the LLM starts rank 1, which
follows each call over its socket) and "torchrun" (``torchrun --nproc-per-node 2``; both ranks run the script). Each
run loads tiny-llama sharded over 2 ranks (gloo, CPU), makes 3 warm-up calls, then times ``--calls`` calls of
``generate([[1, 2, 3, 4]], max_tokens=8)`` on rank 0 (wall time per call, median) and the close. The tokens of both
modes must be the same.

    python -m bench.bench_llm_tp [--repeats 3] [--calls 30]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import Table, machine, median, ratio

REPO = Path(__file__).resolve().parents[1]


def child(calls: int) -> None:
    """One run (rank 0 prints its JSON line)."""
    import kvload

    llm = kvload.LLM("tiny-llama", tensor_parallel_size=2, kv_cache_config={"max_tokens": 2048}, log=False)
    for _ in range(3):
        llm.generate([[1, 2, 3, 4]], max_tokens=8, ignore_eos=True)
    per_call, tokens = [], None
    for _ in range(calls):
        start = time.perf_counter()
        out = llm.generate([[1, 2, 3, 4]], max_tokens=8, ignore_eos=True)
        per_call.append(time.perf_counter() - start)
        tokens = out[0].outputs[0].token_ids
    start = time.perf_counter()
    llm.close()
    closed = time.perf_counter() - start
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps({"call_ms": median(per_call) * 1e3, "close_s": closed, "tokens": tokens}), flush=True)


def one_run(mode: str, calls: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    script = ["-m", "bench.bench_llm_tp", "--child", "--calls", str(calls)]
    if mode == "torchrun":
        from kvload.cli.launch import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port("127.0.0.1")), *script]
    else:
        cmd = [sys.executable, *script]
    start = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{r.stderr[-3000:]}")
    found = json.loads(r.stdout.strip().splitlines()[-1])
    found["wall_s"] = time.perf_counter() - start
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        child(ns.calls)
        return
    modes = ("LLM's ranks", "torchrun")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(ns.repeats):
        for mode in modes:
            runs[mode].append(one_run(mode, ns.calls))
    tokens = {json.dumps(r["tokens"]) for rs in runs.values() for r in rs}
    assert len(tokens) == 1, f"the modes' tokens differ: {tokens}"
    table = Table("LLM(tensor_parallel_size=2): the LLM's ranks against torchrun's",
                  f"python -m bench.bench_llm_tp --repeats {ns.repeats} --calls {ns.calls}",
                  ["mode", "generate call (8 tokens), ms", "close, s", "process wall, s"])
    for mode in modes:
        table.rows.append([mode, f"{median([r['call_ms'] for r in runs[mode]]):.1f}",
                   f"{median([r['close_s'] for r in runs[mode]]):.2f}",
                   f"{median([r['wall_s'] for r in runs[mode]]):.1f}"])
    print(table.markdown())
    a, b = (median([r["call_ms"] for r in runs[m]]) for m in modes)
    print(f"call: LLM's ranks / torchrun = {ratio(a / b)}; medians of {ns.repeats} runs x {ns.calls} calls")
    print(machine())


if __name__ == "__main__":
    main()
