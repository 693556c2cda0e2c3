"""Run every CPU benchmark and write one markdown report: the machine, then a table per benchmark.

Run from the repository root::

    python -m bench.run_all                        # full sizes (several minutes on 2 cores)
    python -m bench.run_all --quick --out bench.md # smaller sizes, also written to a file
    python -m bench.run_all --only block_pool,hashing

Benchmarks: ``block_pool`` (allocate/free vs a deque floor, O(1) scaling), ``hashing`` (prefix keys),
``scheduler`` (a decode step with 256 running requests), ``simulate`` (the simulator targets).
The paged-attention benchmark (``bench.bench_attention``) needs torch kernels and runs separately
(``scripts/gpu_check.sh`` runs it on CUDA).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench import bench_block_pool, bench_hashing, bench_scheduler, bench_simulate
from bench.common import Table, machine

BENCHES: dict[str, Callable[[bool], list[Table]]] = {
    "block_pool": bench_block_pool.run,
    "hashing": bench_hashing.run,
    "scheduler": bench_scheduler.run,
    "simulate": bench_simulate.run,
}


def report(names: list[str], quick: bool) -> str:
    """The markdown report of the named benchmarks."""
    info = machine()
    lines = ["## kvload benchmarks" + (" (quick sizes)" if quick else ""), ""]
    lines += [f"- {key}: {value}" for key, value in info.items()]
    lines.append(f"- command: `python -m bench.run_all{' --quick' if quick else ''}"
                 f"{' --only ' + ','.join(names) if names != list(BENCHES) else ''}`")
    lines.append("")
    for name in names:
        start = time.perf_counter()
        print(f"running {name} ...", file=sys.stderr, flush=True)
        for table in BENCHES[name](quick):
            lines.append(table.markdown())
        print(f"  {name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run, print (and write) the report."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    p.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated subset of {', '.join(BENCHES)}")
    p.add_argument("--out", metavar="FILE.md", help="also write the report to this file")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        p.error(f"unknown benchmark {unknown[0]!r}; known: {', '.join(BENCHES)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    text = report(names, args.quick)
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
