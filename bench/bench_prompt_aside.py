"""One big text prompt of varied words on ``kvload serve``: how long a small request sent while it is tokenized waits,
and how long the big one takes to be refused (by its token count, past ``max_seq_len``).

Each checkout gets its own ``python -m kvload serve MODEL``, both up at once; each repeat, on one server then the
other, posts a prompt of ``--chars`` characters of words drawn at random from ``bench/text_prompts.txt`` (seed 0) and,
``--gap`` seconds later, a one-token completion. Medians per checkout.

    python -m bench.bench_prompt_aside [--model smollm2-135m] [--chars 600000] [--repeats 5] [--gap 0.3]
                                       [--baseline DIR]
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from pathlib import Path
from typing import Any

from bench.bench_big_prompt import REPO, _post, interleaved, side_by_side


def one_round(url: str, text: str, gap: float) -> tuple[float, float]:
    big: list[tuple[int, float]] = []
    thread = threading.Thread(target=lambda: big.append(_post(url + "/v1/completions",
                                                              {"prompt": text, "max_tokens": 1})))
    thread.start()
    time.sleep(gap)
    status, small = _post(url + "/v1/completions", {"prompt": "Hello", "max_tokens": 1})
    thread.join()
    if status != 200 or big[0][0] != 400:
        raise RuntimeError(f"unexpected answers: small {status}, big {big[0][0]}")
    return big[0][1], small


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chars", type=int, default=600_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gap", type=float, default=0.3)
    ap.add_argument("--baseline", type=Path)
    args = ap.parse_args()
    rng = random.Random(0)
    words = (REPO / "bench" / "text_prompts.txt").read_text().split()
    text = " ".join(rng.choice(words) for _ in range(args.chars // 3))[: args.chars]
    trees: dict[str, Any] = {"this checkout": REPO, **({"baseline": args.baseline} if args.baseline else {})}
    got = interleaved(trees, args.model, args.repeats, lambda url: one_round(url, text, args.gap))
    command = (f"python -m bench.bench_prompt_aside --model {args.model} --chars {args.chars} --repeats {args.repeats} "
               f"--gap {args.gap:g}")
    print(side_by_side(f"A small request sent while a {args.chars:,}-character prompt is tokenized on kvload serve "
                       f"{args.model}", command, ["checkout", "big prompt refused, s", "small request meanwhile, s"],
                       got, [(1, "the small request"), (0, "the big prompt's refusal")]))

if __name__ == "__main__":
    main()
