"""V2 against V1 where the pools are under pressure: manager + scheduler CPU per step and over the whole run.

Run from the repository root (nothing here runs torch kernels)::

    python -m bench.bench_pressure                  # the cells below, one V1/V2 pair each
    python -m bench.bench_pressure --pairs 3 --only long-context
    python -m bench.bench_pressure --opcodes        # Python opcodes of the KV work instead: deterministic

The grid (``bench.bench_grid``) judges steps and hit rates; its step-time column is wall time, one run. Here each
cell runs both managers back to back (order alternating per pair) under ``bench.common.thread_cpu_step_clock``, so
the figures are this thread's CPU time: the median step (``step_time_us_median``) and the whole run
(``kv_seconds``), the second being the fair one where V2 finishes in fewer steps than V1. Budgets as the grid's:
``default`` is the simulator's for the workload, ``tight`` a quarter of it.
"""

from __future__ import annotations

import argparse
import os
import statistics

from bench.bench_grid import BUDGETS, CPU
from bench.common import thread_cpu_step_clock

#: (preset, workload, budget): where V2 refuses admissions step after step, suspends, or runs more at once
CELLS = [("tiny-llama", "long-context", "default"), ("tiny-mistral", "long-context", "default"),
         ("tiny-gemma3", "long-context", "default"), ("tiny-llama", "no-reuse", "tight"),
         ("tiny-gemma3", "no-reuse", "tight"), ("tiny-llama", "multi-turn", "tight"),
         ("tiny-gemma3", "multi-turn", "tight"), ("tiny-mistral", "no-reuse", "tight")]


def measure(cells: list[tuple[str, str, str]], pairs: int) -> list[dict[str, object]]:
    """Per cell: each manager's median step µs, run total s and steps (medians over ``pairs`` interleaved runs)."""
    from engine.simulator import simulate
    from engine.workloads import make_workload

    rows = []
    with thread_cpu_step_clock():
        for preset, name, budget in cells:
            wl = make_workload(name, None, 0)
            base = simulate(preset, wl, kv_cache_config={"use_kv_cache_manager_v2": False}, **CPU).budget.bytes
            kv = {"max_gpu_total_bytes": int(base * BUDGETS[budget])}
            runs: dict[bool, list[tuple[float, float, int]]] = {False: [], True: []}
            for i in range(pairs):
                for v2 in ((False, True) if i % 2 == 0 else (True, False)):
                    (res,) = simulate(preset, wl, kv_cache_config={**kv, "use_kv_cache_manager_v2": v2},
                                      **CPU).results.values()
                    m = res.metrics
                    if m is not None:
                        runs[v2].append((m.step_time_us_median, m.kv_seconds, m.steps))
            row: dict[str, object] = {"cell": f"{preset} {name} {budget}"}
            for v2, side in ((False, "v1"), (True, "v2")):
                if runs[v2]:
                    row[side] = tuple(statistics.median(r[j] for r in runs[v2]) for j in range(3))
            rows.append(row)
    return rows


def count_opcodes(cells: list[tuple[str, str, str]]) -> list[tuple[str, int | None, int | None]]:
    """Per cell: the Python opcodes of each manager's KV work over the whole run (``bench.common.kv_opcode_counter``;
    None where it stalled)."""
    from bench.common import kv_opcode_counter
    from engine.simulator import simulate
    from engine.workloads import make_workload

    rows = []
    for preset, name, budget in cells:
        wl = make_workload(name, None, 0)
        base = simulate(preset, wl, kv_cache_config={"use_kv_cache_manager_v2": False}, **CPU).budget.bytes
        kv = {"max_gpu_total_bytes": int(base * BUDGETS[budget])}
        got: list[int | None] = []
        for v2 in (False, True):
            with kv_opcode_counter() as count:
                (res,) = simulate(preset, wl, kv_cache_config={**kv, "use_kv_cache_manager_v2": v2},
                                  **CPU).results.values()
            got.append(count[0] if res.metrics is not None else None)
        rows.append((f"{preset} {name} {budget}", got[0], got[1]))
    return rows


def main(argv: list[str] | None = None) -> None:
    """Print one line per cell."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=1, help="interleaved V1/V2 pairs per cell")
    p.add_argument("--only", default="", help="cells whose 'preset workload budget' contains this text")
    p.add_argument("--opcodes", action="store_true",
                   help="count the Python opcodes of the KV work (deterministic) instead of timing it")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cells = [c for c in CELLS if args.only in " ".join(c)]
    if not cells:
        p.error(f"--only: no cell matches {args.only!r}")
    if args.opcodes:
        print("| cell | V1 opcodes | V2 opcodes | V2/V1 |")
        print("|---|--:|--:|--:|")
        for cell, a, b in count_opcodes(cells):
            ratio = f"{b / a:.2f}x" if a and b else "-"
            print(f"| {cell} | {'stalled' if a is None else f'{a:,}'} | {'stalled' if b is None else f'{b:,}'} | "
                  f"{ratio} |")
        return
    print("| cell | V1 step µs | V2 step µs | V2/V1 step | V1 / V2 steps | V2/V1 whole run |")
    print("|---|--:|--:|--:|--:|--:|")
    for row in measure(cells, args.pairs):
        v1, v2 = row.get("v1"), row.get("v2")
        if v1 is None or v2 is None:
            print(f"| {row['cell']} | {'stalled' if v1 is None else f'{v1[0]:.1f}'} | "
                  f"{'stalled' if v2 is None else f'{v2[0]:.1f}'} | - | - | - |")
            continue
        print(f"| {row['cell']} | {v1[0]:.1f} | {v2[0]:.1f} | {v2[0] / v1[0]:.2f}x | {v1[2]:,.0f} / {v2[2]:,.0f} | "
              f"{v2[1] / v1[1]:.2f}x |")


if __name__ == "__main__":
    main()
