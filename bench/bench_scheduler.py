"""One scheduler step with 256 running requests in decode: V1, V2 with prefix reuse, V2 without.

Run from the repository root::

    python -m bench.bench_scheduler [--quick] [--running 256]

Each manager gets its own pool (one layer, 32 tokens per block, room for every request) and the
shared :class:`~engine.driver.Driver`: 256 requests with prompts of 512-543 tokens (staggered, so
block boundaries do not all fall on the same step) are prefilled, then ``--steps`` decode steps are
timed. A step's time is what the simulator reports: ``scheduler.step`` + one commit per request +
finishes (none here). Median and p99 per step over the decode steps; median over ``--repeats``.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from bench.common import Table, median, p99, ratio, us
from cache_backends.interface import ManagerOptions, SchedulerOutput
from cache_backends.layout import LayerKV, build_layout
from cache_backends.pools import BlockPools
from cache_backends.request import Request
from engine.driver import Driver

T = 32
VARIANTS = {"V1 (GuaranteedNoEvictScheduler)": ("v1", True), "V2 reuse on (KVCacheV2Scheduler)": ("v2", True),
            "V2 reuse off": ("v2", False)}


def build(kind: str, reuse: bool, blocks: int, running: int) -> tuple[Any, Any]:
    """A manager and its scheduler over a one-layer pool of ``blocks`` blocks."""
    layout = build_layout([LayerKV(0, "full", 2)], kind, T, "float32")
    pools = BlockPools(layout, {layout.groups[0].name: blocks}, "cpu")
    options = ManagerOptions(max_seq_len=4096, enable_block_reuse=reuse, host_cache_size=0)
    if kind == "v1":
        from cache_backends.v1 import GuaranteedNoEvictScheduler, KVCacheManager

        manager = KVCacheManager(pools, options)
        return manager, GuaranteedNoEvictScheduler(manager, running, 8192)
    from cache_backends.v2 import KVCacheManagerV2, KVCacheV2Scheduler

    manager = KVCacheManagerV2(pools, options)
    return manager, KVCacheV2Scheduler(manager, running, 8192)


def decode_steps_us(kind: str, reuse: bool, running: int, steps: int, seed: int) -> list[float]:
    """Manager + scheduler µs of each of ``steps`` decode steps with ``running`` requests."""
    rng = random.Random(seed)
    max_new = steps + 64
    blocks = running * ((512 + 32 + max_new) // T + 2)
    manager, scheduler = build(kind, reuse, blocks, running)
    driver = Driver(manager, scheduler)
    for i in range(running):
        prompt = [i + 1] + [rng.randrange(1, 32000) for _ in range(511 + i % 32)]
        driver.add(Request(f"r{i}", prompt, max_new))

    def compute(out: SchedulerOutput) -> dict[str, int]:
        return {c.request.req_id: 7 for c in out.scheduled if c.request.num_computed_tokens + c.num_tokens
                == c.request.num_tokens}

    while driver.waiting or any(not r.output_token_ids for r in driver.running):  # prefill everyone
        driver.step(compute)
    for _ in range(8):  # warm-up decode steps
        driver.step(compute)
    times = []
    for _ in range(steps):
        stats = driver.step(compute)
        assert stats.scheduled_tokens == running  # one decode token each, nothing else
        times.append(stats.kv_seconds * 1e6)
    manager.close()
    return times


def run(quick: bool = False, running: int = 256) -> list[Table]:
    """The decode-step table."""
    repeats, steps = (2, 64) if quick else (5, 200)
    cmd = "python -m bench.bench_scheduler" + (" --quick" if quick else "")
    table = Table(f"One decode step with {running} running requests ({repeats} repeats x {steps} steps)", cmd,
                  ["manager + scheduler", "µs per step (median)", "µs per step (p99)", "µs per request",
                   "vs V1"])
    results: dict[str, list[list[float]]] = {name: [] for name in VARIANTS}
    for r in range(repeats):
        for name, (kind, reuse) in VARIANTS.items():  # interleaved across repeats
            results[name].append(decode_steps_us(kind, reuse, running, steps, seed=r))
    base = None
    for name, runs in results.items():
        med = median([median(t) for t in runs])
        base = base or med
        table.rows.append([name, us(med), us(median([p99(t) for t in runs])), us(med / running), ratio(med / base)])
    table.notes.append("Per step: scheduler.step (ranking, one slot per request, a new block every 32 tokens) "
                       "+ 256 commits (V2 with reuse also keys each block that fills up).")
    return [table]


def main(argv: list[str] | None = None) -> None:
    """Print the table as markdown."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats and steps")
    p.add_argument("--running", type=int, default=256, help="requests running at once (default 256)")
    args = p.parse_args(argv)
    for table in run(args.quick, args.running):
        print(table.markdown())


if __name__ == "__main__":
    main()
