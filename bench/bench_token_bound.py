"""The prompt bound's cost (``engine.token_bound.fewest_tokens``, on every text prompt the server checks): a bound
with no dropped characters (a full byte-level vocabulary; every tokenizer before pool41) against SmolLM2's, whose
six control characters are not counted, checked against ``max_seq_len`` 8192 as the server does (``at_least``: they
are counted only once the length alone reaches the limit) and counted regardless (what ``at_least`` saves).

    python -m bench.bench_token_bound [--repeats 7]
"""

from __future__ import annotations

import argparse
import time

from bench.common import Table, median, ratio
from engine.token_bound import Bound, fewest_tokens

SMOLLM2 = Bound(81, "\x04\x06\x13\x14\x16\x1d")  # engine.token_bound.token_bound of SmolLM2-135M's tokenizer
LIMIT = 8192


def _ms(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    table = Table("Prompt bound per text prompt (fewest_tokens), median ms",
                  f"python -m bench.bench_token_bound --repeats {args.repeats}",
                  ["characters", "no dropped characters", "SmolLM2, at_least=8192", "SmolLM2, always counted",
                   "at_least / none", "counted / none"])
    for size in (10_000, 100_000, 1_000_000, 80_000_000):
        text = ("Hello world, 日本 🙂 " * (size // 18 + 1))[:size]
        plain = _ms(lambda text=text: fewest_tokens(text, SMOLLM2.per_token), args.repeats)
        gated = _ms(lambda text=text: fewest_tokens(text, SMOLLM2, LIMIT), args.repeats)
        counted = _ms(lambda text=text: fewest_tokens(text, SMOLLM2), args.repeats)
        table.rows.append([f"{size:,}", f"{plain:.4f}", f"{gated:.4f}", f"{counted:.3f}", ratio(gated / plain),
                           ratio(counted / plain)])
    print(table.markdown())


if __name__ == "__main__":
    main()
