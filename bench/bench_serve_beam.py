"""``kvload serve``'s beam search (``use_beam_search``) against ``LLM.beam_search`` in-process: what the server adds.

Run from the repository root::

    python -m bench.bench_serve_beam                     # SmolLM2-135M, float32, CPU: 64 prompt tokens, 4 x 16
    python -m bench.bench_serve_beam --beams 4 --new-tokens 32 --prompt-len 200 --repeats 5

Two sides, on the same model, dtype, KV budget and block size, one torch thread each, after one warm-up each:

* ``LLM.beam_search``: ``executor.beam_search`` in this process (what ``LLM.beam_search`` calls), timed by this
  process's CPU seconds (``time.process_time``);
* ``kvload serve``: one ``POST /v1/completions`` with ``use_beam_search``, ``n`` = beams, to a real ``kvload serve
  --max_beam_width K`` process (``bench.bench_serve.start_server``), timed by that process's CPU seconds
  (``/proc/PID/stat``: the HTTP layer, parsing and the engine loop together) and the request's wall time.

Both search with ``ignore_eos`` from the same seeded token-id prompt under a reuse salt of their own each repeat (no
repeat reads what another cached), and the run checks they return the same hypotheses, best first. Medians over
``--repeats``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

import pipeline
from bench.bench_serve import start_server, stop_server
from bench.bench_serve_n import counters
from bench.common import machine
from engine.beam_search import BeamSearchParams


def served(http: Any, pid: int, prompt: list[int], beams: int, new: int, salt: str) -> tuple[Any, float, float]:
    """One beam search request: its choices' token ids (best first), server CPU seconds and wall seconds."""
    before, start = counters(http, pid)["cpu"], time.perf_counter()
    r = http.post("/v1/completions", json={"prompt": prompt, "use_beam_search": True, "n": beams, "max_tokens": new,
                                           "ignore_eos": True, "cache_salt": salt})
    wall = time.perf_counter() - start
    r.raise_for_status()
    ids = [tuple(c["token_ids"]) for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    return ids, counters(http, pid)["cpu"] - before, wall


def main(argv: list[str] | None = None) -> None:
    """Run both sides and print one markdown table (plus the machine)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="anything kvload serve takes (default smollm2-135m)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens-per-block", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8192, help="the KV budget of both sides")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import httpx

    k, new = args.beams, args.new_tokens
    flags = ["--max_beam_width", str(k), "--dtype", args.dtype, "--device", "cpu", "--tokens_per_block",
             str(args.tokens_per_block)]
    proc, url = start_server(args.model, args.max_tokens, flags)
    rows: dict[str, list[tuple[float, float]]] = {"LLM.beam_search": [], "kvload serve": []}
    try:
        with pipeline.load(args.model, load_weights=True, device="cpu", dtype=args.dtype, max_beam_width=k, log=False,
                           kv_cache_config={"max_tokens": args.max_tokens,
                                            "tokens_per_block": args.tokens_per_block}) as result, \
                httpx.Client(base_url=url, timeout=600) as http:
            executor = result.executor
            vocab = int(result.hf_model.config.vocab_size)
            prompt = torch.randint(10, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
            params = BeamSearchParams(beam_width=k, max_tokens=new, ignore_eos=True)

            def local(salt: str) -> tuple[Any, float, float]:
                start, cpu = time.perf_counter(), time.process_time()
                (out,) = executor.beam_search([prompt], params, salt=salt)
                return [s.token_ids for s in out.sequences], time.process_time() - cpu, time.perf_counter() - start

            local("warm"), served(http, proc.pid, prompt, k, new, "warm")  # first-call costs
            for i in range(args.repeats):
                mine, cpu, wall = local(f"local-{i}")
                rows["LLM.beam_search"].append((cpu, wall))
                theirs, cpu, wall = served(http, proc.pid, prompt, k, new, f"served-{i}")
                rows["kvload serve"].append((cpu, wall))
                if mine != theirs:
                    raise RuntimeError(f"repeat {i}: the server's hypotheses differ from LLM.beam_search's")
    finally:
        stop_server(proc)
    base = statistics.median(c for c, _ in rows["LLM.beam_search"])
    print(f"### kvload serve use_beam_search vs LLM.beam_search ({args.model}, {args.dtype}, CPU, 1 thread: "
          f"{args.prompt_len} prompt tokens, {k} beams x {new} tokens, median of {args.repeats})\n")
    print(f"`python -m bench.bench_serve_beam --model {args.model} --beams {k} --new-tokens {new} "
          f"--prompt-len {args.prompt_len} --repeats {args.repeats}`\n")
    print("| side | CPU p50 (s) | vs LLM.beam_search | wall p50 (s) |")
    print("|---|---|---|---|")
    for side, got in rows.items():
        cpu, wall = statistics.median(c for c, _ in got), statistics.median(w for _, w in got)
        print(f"| {side} | {cpu:.3f} | {cpu / base:.2f}x | {wall:.3f} |")
    print(f"\nboth sides returned the same {k} hypotheses in every repeat.")
    print("\n" + "; ".join(f"{key}: {value}" for key, value in machine().items()))


if __name__ == "__main__":
    main()
