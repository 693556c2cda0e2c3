"""Issue 10 item 4 in one place: V2/V1 step time (tiny-llama shared-prefix, multi-turn, mixed) and V2's reuse
overhead on no-reuse, in thread CPU time, with interleaved pairs; optionally against another source tree, process
by process.

Run from the repository root (nothing here runs torch kernels)::

    python -m bench.bench_step_cost                      # this tree: 3 pairs per figure
    python -m bench.bench_step_cost --pairs 5 --quick    # a quarter of each workload's requests
    python -m bench.bench_step_cost --against /tmp/base --rounds 4   # before/after: alternating processes
    python -m bench.bench_step_cost --model tests/data/configs/gemma-3-27b-it --only 2,4   # many layer groups
    python -m bench.bench_step_cost --opcodes --model tiny-gemma3 --against /tmp/base   # Python opcodes instead
    python -m bench.bench_step_cost --total --model tiny-gemma3 --against /tmp/base   # whole runs, not median steps

A *pair* runs both sides of one figure back to back (order alternating), each a whole
:func:`engine.simulator.simulate` replay; a side's figure is the median over the run's engine steps of
manager + scheduler time (``scheduler.step``, commits, finishes: the driver's ``kv_seconds``), taken as
this thread's CPU time (``time.thread_time``) so other jobs on a shared machine do not count. A ratio is
the median of the per-pair ratios. ``--against`` alternates processes of this tree and the other (each
process runs ``--pairs`` pairs of every figure) and reports both trees' medians side by side: the same
session, the same load. ``--opcodes`` counts instead the Python opcodes of each side's whole-run KV work, one run
per side (``bench.common.kv_opcode_counter``: deterministic, so it holds on a loaded machine where CPU times drift).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from typing import Any

from bench.common import Table, machine, median, ratio, thread_cpu_step_clock, verdict

CPU = {"device": "cpu", "log": False, "progress": False}
STEP_TARGET, OVERHEAD_TARGET = 1.25, 0.10
#: figure -> (workload, side A settings, side B settings); the figure is B / A
FIGURES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "shared-prefix V2/V1": ("shared-prefix", {"use_kv_cache_manager_v2": False}, {"use_kv_cache_manager_v2": True}),
    "multi-turn V2/V1": ("multi-turn", {"use_kv_cache_manager_v2": False}, {"use_kv_cache_manager_v2": True}),
    "no-reuse V2 reuse on/off": ("no-reuse", {"use_kv_cache_manager_v2": True, "enable_block_reuse": False},
                                 {"use_kv_cache_manager_v2": True, "enable_block_reuse": True}),
    "no-reuse V2/V1": ("no-reuse", {"use_kv_cache_manager_v2": False}, {"use_kv_cache_manager_v2": True}),
    # system prompts among unrelated prompts: cache-aware admission's lookups of waiting requests (with --budget)
    "mixed V2/V1": ("mixed", {"use_kv_cache_manager_v2": False}, {"use_kv_cache_manager_v2": True}),
}


def _at_budget(model: str, wl: Any, budget: float | None, sides: tuple[dict[str, Any], ...]) -> tuple[dict, ...]:
    """Each side's settings, at ``budget`` times the simulator's default budget for ``wl`` (1 where none is given):
    both sides at the same bytes, as the grid's cells. Left to each its own default, a side got the default for its
    own layout: V2's a third of V1's on Gemma 3 (its sliding layers hold a window), so "default" compared V2 queueing
    at a third of the bytes with V1 (mixed: 979 steps against 630, and "2x the CPU" that was mostly those steps)."""
    from engine.simulator import simulate

    budget = 1.0 if budget is None else budget

    base = simulate(model, wl, **CPU).budget.bytes
    return tuple({**kv, "max_gpu_total_bytes": int(base * budget)} for kv in sides)


def _padded(sides: tuple[dict[str, Any], ...], padding: float | None) -> tuple[dict, ...]:
    """The V2 sides with ``kv_cache_config.max_page_padding`` = ``padding`` (V1 has no arena to pad: left as is)."""
    if padding is None:
        return sides
    return tuple({**kv, "max_page_padding": padding} if kv.get("use_kv_cache_manager_v2") else kv for kv in sides)


def measure(pairs: int, quick: bool, only: list[str] | None = None,
            model: str = "tiny-llama", requests: int | None = None,
            opcodes: bool = False, total: bool = False,
            budget: float | None = None, padding: float | None = None) -> dict[str, dict[str, list[float]]]:
    """Per figure: the median step µs of each run of side ``a`` and ``b``, pairs interleaved (order alternating);
    with ``total``, each run's whole manager + scheduler time in ms instead; with ``opcodes``, the Python opcodes of
    each side's KV work over one whole run; with ``budget``, both sides at that fraction of the default budget."""
    from engine.simulator import simulate
    from engine.workloads import make_workload

    if opcodes:
        return _count_opcodes(quick, only, model, requests, budget, padding)
    with thread_cpu_step_clock():
        out: dict[str, dict[str, list[float]]] = {}
        for figure, (name, a, b) in FIGURES.items():
            if only is not None and figure not in only:
                continue
            wl = make_workload(name, None, 0)
            if quick or requests:
                wl = make_workload(name, requests or max(4, len(wl.requests) // 4), 0)
            a, b = _padded(_at_budget(model, wl, budget, (a, b)), padding)
            runs: dict[str, list[float]] = {"a": [], "b": []}
            for i in range(pairs):
                for side in (("a", "b") if i % 2 == 0 else ("b", "a")):
                    # the garbage the last run left is collected now, not inside this run's timed work: a gen-2
                    # collection landing in one run took a no-reuse side from ~60 to ~225 ms (BENCHMARKS.md, v2cpu47)
                    gc.collect()
                    report = simulate(model, wl, kv_cache_config=a if side == "a" else b, **CPU)
                    (result,) = report.results.values()
                    m = result.metrics
                    runs[side].append(m.kv_seconds * 1e3 if total else m.step_time_us_median)
            out[figure] = runs
    return out


def _count_opcodes(quick: bool, only: list[str] | None, model: str,
                   requests: int | None, budget: float | None = None,
                   padding: float | None = None) -> dict[str, dict[str, list[float]]]:
    """Per figure: each side's opcode count over one run (deterministic: one run says it all)."""
    from bench.common import kv_opcode_counter
    from engine.simulator import simulate
    from engine.workloads import make_workload

    out: dict[str, dict[str, list[float]]] = {}
    for figure, (name, a, b) in FIGURES.items():
        if only is not None and figure not in only:
            continue
        wl = make_workload(name, requests or (max(4, len(make_workload(name, None, 0).requests) // 4) if quick
                                              else None), 0)
        a, b = _padded(_at_budget(model, wl, budget, (a, b)), padding)
        runs: dict[str, list[float]] = {}
        for side, kv in (("a", a), ("b", b)):
            with kv_opcode_counter() as count:
                simulate(model, wl, kv_cache_config=kv, **CPU)
            runs[side] = [float(count[0])]
        out[figure] = runs
    return out


def _per_pair(runs: dict[str, list[float]]) -> list[float]:
    return [b / a for a, b in zip(runs["a"], runs["b"], strict=True)]


def table(results: dict[str, dict[str, dict[str, list[float]]]], command: str, model: str = "tiny-llama",
          opcodes: bool = False, total: bool = False) -> Table:
    """One row per (tree, figure): side medians, the ratio (median of pairs) and the target verdict."""
    if opcodes:
        t = Table(f"V2 KV work in Python opcodes ({model}, one run per side)", command,
                  ["tree", "figure", "A opcodes", "B opcodes", "B / A"])
        for tree, figures in results.items():
            for figure, runs in figures.items():
                a, b = runs["a"][0], runs["b"][0]
                t.rows.append([tree, figure, f"{a:,.0f}", f"{b:,.0f}", ratio(b / a) if "V1" in figure
                               else f"{b / a - 1:+.1%}"])
        t.notes.append("A/B: V1/V2, or V2 reuse off/on for no-reuse; opcodes of the whole run's manager + scheduler "
                       "work (bench.common.kv_opcode_counter), which weighs every opcode alike.")
        return t
    unit = "run ms" if total else "step µs"
    t = Table(f"V2 per-{'run' if total else 'step'} cost ({model}, thread CPU time, interleaved pairs)", command,
              ["tree", "figure", f"A {unit} (median)", f"B {unit} (median)", "B / A (median of pairs)",
               "pairs (min-max)", "target"])
    for tree, figures in results.items():
        for figure, runs in figures.items():
            per = _per_pair(runs)
            mid = median(per)
            ok = mid <= STEP_TARGET if "V1" in figure else mid - 1 < OVERHEAD_TARGET
            def show(x: float, v1: bool = "V1" in figure) -> str:
                return ratio(x) if v1 else f"{x - 1:+.1%}"

            t.rows.append([tree, figure, f"{median(runs['a']):,.0f}", f"{median(runs['b']):,.0f}", show(mid),
                           f"{len(per)} ({show(min(per))} to {show(max(per))})", verdict(ok)])
    t.notes.append("A/B: V1/V2 for the step-time figures (target <= 1.25x), V2 reuse off/on for no-reuse (target "
                   "under +10%); each side's figure is " + ("a whole run's" if total else "the median over a run's "
                   "engine steps of") + " manager + scheduler thread CPU time; the ratio is the median of per-pair "
                   "ratios.")
    return t


def _child(tree: str, pairs: int, quick: bool, only: str | None, model: str,
           requests: int | None, opcodes: bool = False, total: bool = False,
           budget: float | None = None, padding: float | None = None) -> dict[str, dict[str, list[float]]]:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # this file, run against the tree's packages: the other tree may predate --model and the 4th figure
    args = [sys.executable, os.path.abspath(__file__), "--json", "--pairs", str(pairs), "--model", model]
    args += (["--quick"] if quick else []) + (["--only", only] if only else [])
    args += ["--requests", str(requests)] if requests else []
    args += ["--opcodes"] if opcodes else []
    args += ["--total"] if total else []
    args += ["--budget", str(budget)] if budget is not None else []  # this file's flag: the other tree needs none
    args += ["--max_page_padding", str(padding)] if padding is not None else []  # needs the setting in that tree
    done = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    """Print the table (or, with ``--json``, this process's raw figures)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=3, help="interleaved pairs per figure (per process)")
    p.add_argument("--quick", action="store_true", help="a quarter of each workload's requests")
    p.add_argument("--against", help="another source tree (e.g. main's): alternate processes of both trees")
    p.add_argument("--rounds", type=int, default=2, help="with --against: processes per tree")
    p.add_argument("--only", help="comma-separated figure numbers, 1-based: " + ", ".join(
        f"{i} = {name}" for i, name in enumerate(FIGURES, 1)))
    p.add_argument("--json", action="store_true", help="print this process's raw figures as one JSON line")
    p.add_argument("--model", default="tiny-llama", help="preset or config directory to simulate (default tiny-llama; "
                   "tests/data/configs/gemma-3-27b-it for a shared arena of 31 layer groups)")
    p.add_argument("--requests", type=int, help="requests per workload (instead of its default or --quick's quarter; "
                   "the simulated pools are sized for them in host memory)")
    p.add_argument("--opcodes", action="store_true", help="count the Python opcodes of each side's KV work over one "
                   "run (deterministic) instead of timing pairs")
    p.add_argument("--total", action="store_true", help="each run's whole manager + scheduler time instead of its "
                   "median step (where the cost is in a few steps: admissions, finishes)")
    p.add_argument("--budget", type=float, help="both sides at this fraction of the simulator's default budget for "
                   "the workload (0.25: the grid's tight cells, where requests wait; default 1: that budget, the "
                   "same bytes for both)")
    p.add_argument("--max_page_padding", type=float, help="the V2 sides with kv_cache_config.max_page_padding at "
                   "this share (padded pages, fewer layer groups on a shared arena; default: the setting's default)")
    args = p.parse_args(argv)
    only = [list(FIGURES)[int(i) - 1] for i in args.only.split(",")] if args.only else None
    if args.json:
        print(json.dumps(measure(args.pairs, args.quick, only, args.model, args.requests, args.opcodes, args.total,
                                 args.budget, args.max_page_padding)))
        return
    # the tree this file belongs to, not the working directory: run from another checkout, "after" would
    # otherwise measure that checkout's code under this tree's name
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = "python -m bench.bench_step_cost" + (f" --pairs {args.pairs}" if args.pairs != 3 else "") + (
        " --quick" if args.quick else "") + (f" --only {args.only}" if args.only else "") + (
        f" --model {args.model}" if args.model != "tiny-llama" else "") + (
        f" --requests {args.requests}" if args.requests else "") + (" --opcodes" if args.opcodes else "") + (
        " --total" if args.total else "") + (f" --budget {args.budget}" if args.budget is not None else "") + (
        f" --max_page_padding {args.max_page_padding}" if args.max_page_padding is not None else "")
    if args.against is None:
        results = {"this tree": measure(args.pairs, args.quick, only, args.model, args.requests, args.opcodes,
                                        args.total, args.budget, args.max_page_padding)}
    else:
        command += " --against <tree>" + ("" if args.opcodes else f" --rounds {args.rounds}")
        trees = {"before (--against)": os.path.abspath(args.against), "after (this tree)": here}
        results = {name: {f: {"a": [], "b": []} for f in only or FIGURES} for name in trees}
        for i in range(1 if args.opcodes else args.rounds):  # opcode counts do not vary: one process per tree
            for name in (list(trees) if i % 2 == 0 else list(trees)[::-1]):
                for f, runs in _child(trees[name], args.pairs, args.quick, args.only, args.model,
                                      args.requests, args.opcodes, args.total, args.budget,
                                      args.max_page_padding).items():
                    results[name][f]["a"] += runs["a"]
                    results[name][f]["b"] += runs["b"]
    print(machine())
    if args.against is not None:
        print("trees: " + ", ".join(f"{name} {path}" for name, path in trees.items()))
    print(f"load average {os.getloadavg()[0]:.2f} at the end\n")
    print(table(results, command, args.model, args.opcodes, args.total).markdown())


if __name__ == "__main__":
    main()
