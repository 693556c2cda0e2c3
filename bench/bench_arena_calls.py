"""The shared arena's block work per call, timed alone: a finish, a prefix hit, decode block boundaries and a
prefill's take, on an arena cut into many layer groups (Gemma 3 27B: 31), optionally against another source tree.

Run from the repository root (no torch, no simulator: only :class:`cache_backends.v2.shared_pool.SharedPool`)::

    python -m bench.bench_arena_calls                              # 31 groups x 29 blocks, this tree
    python -m bench.bench_arena_calls --against /tmp/base --rounds 4   # before/after, processes alternating
    python -m bench.bench_arena_calls --groups 6 --blocks 16       # tiny-gemma3's six groups

Why: a whole simulated run mixes these calls with every other step's work, and on a shared 2-core machine its
thread CPU time drifts by more than a 10% change of one of them. Each call here is timed on a freshly built
arena (``time.perf_counter_ns``), ``--repeat`` times, and its figure is the fastest run (the one least disturbed
by other jobs) and the median. The arena is built as a finish finds it: each group's table taken one block
boundary at a time (``take_each`` with one page per group, as decodes do), every block but the last (a partial
block, not keyed) cached under one of two childless radix runs (a conversation's earlier turns and this one).
Python opcodes are not what this counts: a check at C speed over a table costs ~10 ns an entry, about what a
Python 3.11 loop step costs, so fewer opcodes are not always less time (BENCHMARKS.md, "V2 arena calls").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.common import Table, machine, median

CALLS = ("finish", "hit", "decode boundaries", "prefill take")


def _arena(groups: int, blocks: int) -> tuple[Any, list[list[int]]]:
    """An arena of ``groups`` groups, each holding a table of ``blocks`` blocks shaped as at a finish."""
    from cache_backends.v2.radix import RadixNode
    from cache_backends.v2.shared_pool import SharedPool

    pool = SharedPool([f"g{g}" for g in range(groups)], 4 * groups * blocks)
    keep = lambda group, evicted: None  # noqa: E731  (nothing is evicted: the arena has room)
    tables: list[list[int]] = [[] for _ in range(groups)]
    for _ in range(blocks):
        for g, piece in enumerate(pool.take_each(range(groups), [1] * groups, keep)):
            tables[g] += piece
    runs = [RadixNode(None, None, 0, (), 8) for _ in range(2)]
    for table in tables:
        for i, b in enumerate(table[:-1]):
            pool.node[b] = runs[i * 2 // blocks]
    return pool, tables


def _time(setup: Callable[[], Any], call: Callable[[Any], None], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        state = setup()
        t = time.perf_counter_ns()
        call(state)
        out.append((time.perf_counter_ns() - t) / 1e3)
    return out


def measure(groups: int, blocks: int, repeat: int) -> dict[str, list[float]]:
    """Per call: µs of each of ``repeat`` runs, each on a fresh arena."""
    from cache_backends.v2.shared_pool import SharedPool

    keep = lambda group, evicted: None  # noqa: E731

    def finished() -> tuple[Any, list[list[int]]]:
        pool, tables = _arena(groups, blocks)
        pool.release_tables(list(enumerate(tables)), 0)
        return pool, [table[:-1] for table in tables]  # what the next turn's hit claims: the cached blocks

    def hit(state: tuple[Any, list[list[int]]]) -> None:
        pool, claims = state
        for g, claimed in enumerate(claims):
            pool.incref_many(g, claimed)

    def decodes(pool: Any) -> None:
        for _ in range(blocks):
            pool.take_each(range(groups), [1] * groups, keep)

    fresh = lambda: SharedPool([f"g{g}" for g in range(groups)], 4 * groups * blocks)  # noqa: E731
    return {
        "finish": _time(lambda: _arena(groups, blocks),
                        lambda s: s[0].release_tables(list(enumerate(s[1])), 0), repeat),
        "hit": _time(finished, hit, repeat),
        "decode boundaries": _time(fresh, decodes, repeat),
        "prefill take": _time(fresh, lambda pool: pool.take_each(range(groups), [blocks] * groups, keep), repeat),
    }


def _child(tree: str, groups: int, blocks: int, repeat: int) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, os.path.abspath(__file__), "--json", "--groups", str(groups), "--blocks", str(blocks),
            "--repeat", str(repeat)]
    done = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    """Print the table (or, with ``--json``, this process's raw figures)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=31, help="layer groups in the arena (default 31: Gemma 3 27B)")
    p.add_argument("--blocks", type=int, default=29, help="blocks in each group's table (default 29)")
    p.add_argument("--repeat", type=int, default=200, help="timed runs of each call per process (default 200)")
    p.add_argument("--against", help="another source tree (e.g. main's): alternate processes of both trees")
    p.add_argument("--rounds", type=int, default=2, help="with --against: processes per tree (default 2)")
    p.add_argument("--json", action="store_true", help="print this process's raw figures as one JSON line")
    args = p.parse_args(argv)
    for name in ("groups", "blocks", "repeat", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.json:
        print(json.dumps(measure(args.groups, args.blocks, args.repeat)))
        return
    command = f"python -m bench.bench_arena_calls --groups {args.groups} --blocks {args.blocks} --repeat {args.repeat}"
    trees = {"this tree": os.getcwd()}
    if args.against:
        command += f" --against <tree> --rounds {args.rounds}"
        trees = {"before (--against)": os.path.abspath(args.against), "after (this tree)": os.getcwd()}
    runs: dict[str, dict[str, list[float]]] = {name: {c: [] for c in CALLS} for name in trees}
    for i in range(args.rounds if args.against else 1):
        for name in (list(trees) if i % 2 == 0 else list(trees)[::-1]):
            for call, values in _child(trees[name], args.groups, args.blocks, args.repeat).items():
                runs[name][call] += values
    t = Table(f"Shared arena calls, {args.groups} groups x {args.blocks} blocks (µs per call)", command,
              ["call", *(f"{name}: fastest / median" for name in trees)]
              + (["after / before (fastest)"] if args.against else []))
    for call in CALLS:
        row = [call] + [f"{min(runs[n][call]):.1f} / {median(runs[n][call]):.1f}" for n in trees]
        if args.against:
            before, after = (min(runs[n][call]) for n in trees)
            row.append(f"{after / before:.2f}x")
        t.rows.append(row)
    t.notes.append("finish: release_tables of every group's table; hit: incref_many of each group's cached blocks "
                   f"after it; decode boundaries: {args.blocks} take_each calls of one page per group; prefill take: "
                   f"one take_each of {args.blocks} pages per group. Each run on a freshly built arena.")
    print(machine())
    print(f"load average {os.getloadavg()[0]:.2f} at the end\n")
    print(t.markdown())


if __name__ == "__main__":
    main()
