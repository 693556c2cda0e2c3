"""Block pool cost per operation at growing pool sizes: flat numbers mean O(1) operations.

Run: ``python -m bench.bench_block_pool`` from the repository root.
"""

from __future__ import annotations

import time

from cache_backends.block_pool import BlockPool
from cache_backends.hashing import block_hash


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


def main() -> None:
    """Print a table of per-operation costs."""
    print(f"{'blocks':>10}  {'allocate+free ns':>17}  {'lookup+touch+free ns':>21}")
    for n in (1_000, 100_000, 1_000_000):
        r = per_op_ns(n)
        print(f"{n:>10,}  {r['alloc_free']:>17.0f}  {r['revive']:>21.0f}")


if __name__ == "__main__":
    main()
