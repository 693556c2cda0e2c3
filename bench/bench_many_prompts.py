"""A request of many prompts on ``kvload serve``: how long a small request sent while it is tokenized waits.

Each checkout gets its own ``python -m kvload serve MODEL`` (``PYTHONPATH`` its folder), both up at once; each repeat
sends, to one server then the other, a ``/v1/completions`` body of ``--prompts`` text prompts of ``--chars`` characters
each, its last one past ``max_seq_len`` by its characters (so it is refused once every prompt before it was tokenized:
no engine work), and 0.3 s later a one-token completion from another thread. Medians per checkout.

    python -m bench.bench_many_prompts [--model smollm2-135m] [--prompts 1024] [--chars 4000] [--repeats 3]
                                       [--baseline /path/to/checkout]
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Any

from bench.bench_big_prompt import REPO, _post, interleaved, side_by_side


def one_round(url: str, prompts: list[str]) -> tuple[float, float]:
    """(seconds to the many-prompt request's refusal, the small request's) with the many-prompt one sent first."""
    big: list[Any] = []
    thread = threading.Thread(target=lambda: big.append(_post(url + "/v1/completions",
                                                              {"prompt": prompts, "max_tokens": 1})))
    thread.start()
    time.sleep(0.3)  # the big body is read and being tokenized
    status, small = _post(url + "/v1/completions", {"prompt": "Hello", "max_tokens": 1})
    thread.join()
    if status != 200 or big[0][0] != 400:
        raise RuntimeError(f"unexpected answers: small {status}, big {big[0][0]}")
    return big[0][1], small


def main() -> None:
    """Start a server per checkout, run ``--repeats`` interleaved rounds, print a markdown table of medians."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=1024, help="prompts in the big request (at most 1,024)")
    ap.add_argument("--chars", type=int, default=4000, help="characters of each of its prompts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="another checkout to run side by side (e.g. main)")
    args = ap.parse_args()
    text = ("hello world " * (args.chars // 12 + 1))[: args.chars]
    prompts = [f"{i} {text}" for i in range(args.prompts - 1)] + ["hello world " * 200_000]  # the last: too long
    trees = {"this checkout": REPO, **({"baseline": args.baseline} if args.baseline else {})}
    got = interleaved(trees, args.model, args.repeats, lambda url: one_round(url, prompts))
    command = (f"python -m bench.bench_many_prompts --model {args.model} --prompts {args.prompts} --chars {args.chars} "
               f"--repeats {args.repeats}")
    print(side_by_side(f"{args.prompts} prompts of {args.chars:,} characters in one request on kvload serve "
                       f"{args.model}", command, ["checkout", "many-prompt request refused, s",
                                                  "small request meanwhile, s"],
                       got, [(1, "the small request"), (0, "the many-prompt request")]))

if __name__ == "__main__":
    main()
