"""V2's page copies that move many blocks at once, timed alone: a suspend (every page to the host tier), a resume
(every page back) and a fork (each group's partial last block copied), on a model's layout (default Gemma 3 27B: a
shared arena of 31 groups), optionally against another source tree.

Run from the repository root::

    python -m bench.bench_host_copies                                  # unbacked pools, as the simulator's
    python -m bench.bench_host_copies --device cpu --tokens 200        # real pages in host memory (bytes copied)
    python -m bench.bench_host_copies --against /tmp/base --rounds 3   # before/after, processes alternating
    python -m bench.bench_host_copies --opcodes                        # Python opcodes per call: deterministic

Why: the simulated runs suspend a few times a run (Gemma 3 27B multi-turn at a quarter of the budget: 4 suspends
and 4 resumes of ~500 pages), too few for their CPU time to show one call's cost above the noise. Here one request of
``--tokens`` tokens is admitted on a fresh manager, computed and committed (prefix reuse off, so every page is
copied on suspend, none left cached for a write-back), suspended and resumed ``--repeat`` times; a fork is a second
request admitted as the first's sample (its prompt ends mid-block, so every group copies one page). Each figure is
``time.perf_counter_ns`` around the one call: the fastest of the repeats and the median.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from bench.common import Table, machine, median

CALLS = ("suspend", "resume", "fork")


def _manager(model: str, device: str, tokens: int) -> Any:
    """A V2 manager over ``model``'s layout with room for two requests of ``tokens`` tokens and a host tier for one."""
    from transformers import AutoConfig

    from cache_backends import build_layout
    from cache_backends.interface import ManagerOptions
    from cache_backends.pools import BlockPools
    from cache_backends.v2 import KVCacheManagerV2
    from models.geometry import layers_from_config

    layout = build_layout(layers_from_config(AutoConfig.from_pretrained(model)), "v2", 16, "bfloat16")
    per_group = 2 * -(-tokens // 16) + 2
    blocks = {g.name: per_group * (len(layout.groups) if layout.shared else 1) for g in layout.groups}
    host = sum(g.bytes_per_block * (per_group // 2) for g in layout.groups)
    return KVCacheManagerV2(BlockPools(layout, blocks, device),
                            ManagerOptions(max_seq_len=4 * tokens, enable_block_reuse=False, host_cache_size=host))


def _run(model: str, device: str, tokens: int, repeat: int, count: Any) -> dict[str, list[float]]:
    """Per call: ``count``'s figure (µs, or opcodes) of each of ``repeat`` calls."""
    from cache_backends.request import Request

    out: dict[str, list[float]] = {c: [] for c in CALLS}
    for i in range(repeat + 1):  # the first round warms up (torch's lazy imports and dispatch caches), not counted
        m = _manager(model, device, tokens)
        r = Request(f"r{i}", [1 + t % 1000 for t in range(tokens)], 4)
        m.create(r)
        assert m.resume(r) and m.allocate(r, tokens)
        m.commit(r, tokens)
        got, ok = count(lambda: m.suspend(r))  # noqa: B023  (called at once)
        assert ok, "the host tier took the request"
        out["suspend"].append(got)
        got, ok = count(lambda: m.resume(r))  # noqa: B023
        assert ok
        out["resume"].append(got)
        child = Request(f"c{i}", r.prompt_token_ids, 4)
        got, ok = count(lambda: m.fork(r, child))  # noqa: B023
        assert ok
        out["fork"].append(got)
        m.close()
    return {c: got[1:] for c, got in out.items()}


def _timed(call: Any) -> tuple[float, Any]:
    t = time.perf_counter_ns()
    got = call()
    return (time.perf_counter_ns() - t) / 1e3, got


def _opcodes(call: Any) -> tuple[float, Any]:
    n = [0]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            n[0] += 1
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return local

    sys.settrace(tracer)
    try:
        got = call()
    finally:
        sys.settrace(None)
    return float(n[0]), got


def _child(tree: str, args: argparse.Namespace) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, os.path.abspath(__file__), "--json", "--model", os.path.abspath(args.model), "--device",
            args.device, "--tokens", str(args.tokens), "--repeat", str(args.repeat)] + (
        ["--opcodes"] if args.opcodes else [])
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    """Print the table (or, with ``--json``, this process's raw figures)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tests/data/configs/gemma-3-27b-it", help="a config directory")
    p.add_argument("--device", default="meta", help="where the pools live: meta (unbacked, the simulator's) or cpu")
    p.add_argument("--tokens", type=int, default=250, help="the request's tokens, not a multiple of 16 (pages: "
                   "tokens / 16 per group, rounded up; the last one partial, which a fork copies)")
    p.add_argument("--repeat", type=int, default=7, help="calls of each kind per process")
    p.add_argument("--opcodes", action="store_true", help="count Python opcodes per call instead of timing it")
    p.add_argument("--against", help="another source tree (e.g. main's): alternate processes of both trees")
    p.add_argument("--rounds", type=int, default=2, help="with --against: processes per tree")
    p.add_argument("--json", action="store_true", help="print this process's raw figures as one JSON line")
    args = p.parse_args(argv)
    if args.tokens % 16 == 0:
        p.error("--tokens: a multiple of 16 ends on a block, and a fork then copies nothing")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.json:
        print(json.dumps(_run(args.model, args.device, args.tokens, args.repeat,
                              _opcodes if args.opcodes else _timed)))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this tree": here} | ({"against": os.path.abspath(args.against)} if args.against else {})
    figures: dict[str, dict[str, list[float]]] = {name: {c: [] for c in CALLS} for name in trees}
    for _ in range(args.rounds if args.against else 1):
        for name, tree in trees.items():
            for c, got in _child(tree, args).items():
                figures[name][c] += got
    unit = "opcodes" if args.opcodes else "µs"
    command = "python -m bench.bench_host_copies " + " ".join(sys.argv[1:] if argv is None else argv)
    t = Table(f"V2 page copies per call ({os.path.basename(args.model)}, {args.device} pools, {args.tokens} tokens)",
              command, ["call"] + [f"{name} {unit}: min / median" for name in trees])
    for c in CALLS:
        t.rows.append([c] + [f"{min(figures[n][c]):,.0f} / {median(figures[n][c]):,.0f}" for n in trees])
    info = machine()
    t.notes.append(f"{info['cpu']}, {info['date']}; {len(figures['this tree']['suspend'])} calls of each kind a tree")
    print(t.markdown())

if __name__ == "__main__":
    main()
