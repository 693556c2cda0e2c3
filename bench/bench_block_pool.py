"""Block allocation: V1's ``BlockPool`` and V2's ``GroupPool`` against a bare ``deque`` of ids, in the same run.

Run from the repository root::

    python -m bench.bench_block_pool            # 5 repeats x 1,000 iterations, 100,000-block pools
    python -m bench.bench_block_pool --quick    # 3 repeats x 300 iterations

Each iteration allocates ``n`` blocks (10, 100, 1,000) from a pool of 100,000 and frees them again,
timing each call. ``deque`` is the floor for a Python allocator: ``popleft`` ``n`` ids, then
``append`` them back. V1: ``BlockPool.allocate(n)`` / ``free(blocks)`` (reference counts, prefix
keys, LRU queue). V2: ``GroupPool.allocate_many(n)`` / ``release(blocks)`` (what the manager calls).
Per repeat, the median and max of each call; reported: the median over repeats of the medians,
the max of the maxes, and V1/V2 over ``deque`` (allocate + free medians, median over repeats).
The three allocators take turns inside each repeat so drift hits them alike.

A second table shows the per-operation cost is flat from 1,000 to 1,000,000 blocks (O(1)).
"""

from __future__ import annotations

import argparse
import time
from collections import deque

from bench.common import Table, median, ratio, us, verdict
from cache_backends.block_pool import BlockPool
from cache_backends.hashing import block_hash
from cache_backends.v2.group_pool import GroupPool

POOL_BLOCKS = 100_000
SIZES = (10, 100, 1_000)
V1_TARGET = 3.0  # V1 allocate+free within 3x of the deque floor


def _no_detach(*_: object) -> None:  # nothing is cached in this benchmark, so nothing is ever evicted
    raise AssertionError("unexpected eviction")


def _deque_impl(pool_blocks: int):
    q = deque(range(pool_blocks))
    pop, append = q.popleft, q.append

    def alloc(n: int) -> list[int]:
        return [pop() for _ in range(n)]

    def free(ids: list[int]) -> None:
        for b in ids:
            append(b)

    return alloc, free


def _v1_impl(pool_blocks: int):
    pool = BlockPool(pool_blocks)
    return pool.allocate, pool.free


def _v2_impl(pool_blocks: int):
    pool = GroupPool("g", pool_blocks)

    def alloc(n: int) -> list[int]:
        return pool.allocate_many(n, _no_detach)

    def free(ids: list[int]) -> None:
        pool.release(ids, 0, True, _no_detach)

    return alloc, free


IMPLS = {"deque": _deque_impl, "V1 BlockPool": _v1_impl, "V2 GroupPool": _v2_impl}


def one_repeat(n: int, iters: int, pool_blocks: int) -> dict[str, dict[str, float]]:
    """Median/max µs per allocate and per free call for each allocator (one fresh pool each)."""
    impls = {name: make(pool_blocks) for name, make in IMPLS.items()}
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in impls}
    clock = time.perf_counter_ns
    for _ in range(iters):
        for name, (alloc, free) in impls.items():  # interleaved: drift hits all three alike
            t0 = clock()
            ids = alloc(n)
            t1 = clock()
            free(ids)
            t2 = clock()
            times[name][0].append((t1 - t0) / 1e3)
            times[name][1].append((t2 - t1) / 1e3)
    return {name: {"alloc_med": median(a), "alloc_max": max(a), "free_med": median(f), "free_max": max(f)}
            for name, (a, f) in times.items()}


def alloc_free_table(repeats: int = 5, iters: int = 1_000, pool_blocks: int = POOL_BLOCKS) -> Table:
    """The allocate/free table with ratios to the deque floor and the V1 target verdict."""
    cmd = "python -m bench.bench_block_pool" + ("" if (repeats, iters) == (5, 1_000) else " --quick")
    table = Table(f"Allocate + free, {pool_blocks:,}-block pool ({repeats} repeats x {iters:,} iterations)", cmd,
                  ["blocks per call", "allocator", "allocate µs (median)", "allocate µs (max)", "free µs (median)",
                   "free µs (max)", "vs deque (alloc+free)"])
    verdicts = []
    for n in SIZES:
        runs = [one_repeat(n, iters, pool_blocks) for _ in range(repeats)]
        ratios = {name: median([(r[name]["alloc_med"] + r[name]["free_med"]) /
                                (r["deque"]["alloc_med"] + r["deque"]["free_med"]) for r in runs])
                  for name in IMPLS}
        for name in IMPLS:
            table.rows.append([f"{n:,}", name, us(median([r[name]["alloc_med"] for r in runs])),
                               us(max(r[name]["alloc_max"] for r in runs)),
                               us(median([r[name]["free_med"] for r in runs])),
                               us(max(r[name]["free_max"] for r in runs)),
                               "1.00x (floor)" if name == "deque" else ratio(ratios[name])])
        verdicts.append((n, ratios["V1 BlockPool"]))
    ok = all(v <= V1_TARGET for _, v in verdicts)
    table.notes.append(f"Target: V1 allocate+free within {V1_TARGET:.0f}x of the deque floor: {verdict(ok)} ("
                       + ", ".join(f"{v:.2f}x at {n:,}" for n, v in verdicts) + ").")
    table.notes.append("Max is the slowest single call over all repeats (includes the odd GC pause or "
                       "preemption by another process); medians and ratios are the figures to compare.")
    return table


def per_op_ns(num_blocks: int, ops: int = 20_000) -> dict[str, float]:
    """Nanoseconds per allocate+free of one block, and per revival of a cached block from the queue's middle."""
    pool = BlockPool(num_blocks)
    held = pool.allocate(num_blocks // 2)  # a half-full pool, as in serving
    start = time.perf_counter_ns()
    for _ in range(ops):
        (b,) = pool.allocate(1)
        pool.free([b])
    alloc_free = (time.perf_counter_ns() - start) / ops
    keys = [block_hash(None, [i], None) for i in range(min(ops, len(held)))]
    for b, k in zip(held, keys, strict=False):
        pool.cache(b, k)
    pool.free(held[: len(keys)])  # now evictable, spread through the free queue
    start = time.perf_counter_ns()
    for k in keys:
        b = pool.lookup(k)
        pool.touch([b])
        pool.free([b])
    revive = (time.perf_counter_ns() - start) / len(keys)
    return {"alloc_free": alloc_free, "revive": revive}


def scaling_table(sizes: tuple[int, ...] = (1_000, 100_000, 1_000_000), repeats: int = 3) -> Table:
    """V1 per-operation cost at growing pool sizes (flat = O(1))."""
    table = Table("V1 BlockPool cost per operation vs pool size (O(1) check)",
                  "python -m bench.bench_block_pool", ["pool blocks", "allocate+free 1 block, ns (median)",
                                                       "lookup+touch+free a cached block, ns (median)"])
    for n in sizes:
        runs = [per_op_ns(n) for _ in range(repeats)]
        table.rows.append([f"{n:,}", f"{median([r['alloc_free'] for r in runs]):,.0f}",
                           f"{median([r['revive'] for r in runs]):,.0f}"])
    table.notes.append(f"Median of {repeats} runs of 20,000 operations each; half the pool is in use.")
    return table


def run(quick: bool = False) -> list[Table]:
    """Both tables (smaller with ``quick``)."""
    if quick:
        return [alloc_free_table(3, 300), scaling_table((1_000, 100_000), 3)]
    return [alloc_free_table(), scaling_table()]


def main(argv: list[str] | None = None) -> None:
    """Print the tables as markdown."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats and iterations")
    args = p.parse_args(argv)
    for table in run(args.quick):
        print(table.markdown())


if __name__ == "__main__":
    main()
