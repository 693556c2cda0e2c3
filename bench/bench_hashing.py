"""Prefix hashing throughput: the chained SHA-256 block keys both managers compute for every full block.

Run from the repository root::

    python -m bench.bench_hashing [--quick]

``chain_hashes`` over a 65,536-token sequence at 16, 32 and 128 tokens per block (random int64-range
token ids < 2^17, no salt), and one ``block_hash`` call at 32 tokens with a salt. Median of the
repeats; throughput in blocks and tokens per second.
"""

from __future__ import annotations

import argparse
import random
import time

from bench.common import Table, median
from cache_backends.hashing import block_hash, chain_hashes

TOKENS = 65_536


def chain_seconds(tokens: list[int], tokens_per_block: int, salt: str | None) -> float:
    """Seconds for one ``chain_hashes`` over ``tokens``."""
    start = time.perf_counter()
    chain_hashes(tokens, tokens_per_block, salt)
    return time.perf_counter() - start


def run(quick: bool = False) -> list[Table]:
    """Throughput per block size, and the cost of one salted block key."""
    repeats = 3 if quick else 7
    rng = random.Random(0)
    tokens = [rng.randrange(1, 1 << 17) for _ in range(TOKENS)]
    table = Table(f"Prefix hashing (chained SHA-256 keys) over {TOKENS:,} tokens, median of {repeats}",
                  "python -m bench.bench_hashing" + (" --quick" if quick else ""),
                  ["tokens per block", "µs per block", "blocks/s", "M tokens/s"])
    for tpb in (16, 32, 128):
        secs = median([chain_seconds(tokens, tpb, None) for _ in range(repeats)])
        blocks = TOKENS // tpb
        table.rows.append([str(tpb), f"{secs / blocks * 1e6:.2f}", f"{blocks / secs:,.0f}",
                           f"{TOKENS / secs / 1e6:.1f}"])
    block = tokens[:32]
    parent = block_hash(None, block, "tenant-a")
    n = 20_000
    per = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            block_hash(parent, block, "tenant-a")
        per.append((time.perf_counter() - start) / n * 1e6)
    table.notes.append(f"One salted block_hash (32 tokens, with a parent): {median(per):.2f} µs (median of "
                       f"{repeats} x {n:,} calls). Keys are full 256-bit digests; encoding: tagged parent, "
                       "length-prefixed salt, int64 tokens.")
    return [table]


def main(argv: list[str] | None = None) -> None:
    """Print the table as markdown."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats")
    args = p.parse_args(argv)
    for table in run(args.quick):
        print(table.markdown())


if __name__ == "__main__":
    main()
