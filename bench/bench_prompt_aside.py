"""One big text prompt of varied words on ``kvload serve``: how long a small request sent while it is tokenized waits,
and how long the big one takes to be answered; the prompt sent as a completion's (refused by its token count, past
``max_seq_len``), as one chat message (its templated text refused alike), as a completion's cut by
``truncate_prompt_tokens`` (its last 100 tokens kept: answered), as a chat of many messages of 100 characters
(``chat_many``: refused), or as a chat cut by ``truncate_prompt_tokens`` (one message, ``chat_truncated``, or many,
``chat_many_truncated``: answered).

Each checkout gets its own ``python -m kvload serve MODEL``, both up at once; each repeat, on one server then the
other, posts for each case a prompt of ``--chars`` characters of words drawn at random from ``bench/text_prompts.txt``
(seed 0) and, ``--gap`` seconds later, a one-token completion. Medians per checkout.

    python -m bench.bench_prompt_aside [--model smollm2-135m] [--chars 600000] [--repeats 5] [--gap 0.3]
                                       [--cases completion,chat,truncated,chat_many,...] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from pathlib import Path
from typing import Any

from bench.bench_big_prompt import REPO, _post, interleaved, side_by_side

#: each case: (its path, its body for a text, the big one's answer, what the table calls it)
CASES: dict[str, tuple[str, Any, int, str]] = {
    "completion": ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 1}, 400, "prompt refused"),
    "chat": ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 1},
             400, "chat refused"),
    "truncated": ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 100},
                  200, "truncated prompt answered"),
    # the text as messages of 100 characters each, roles taking turns (2 MB: 20,000 messages), refused by its
    # templated text's characters
    "chat_many": ("/v1/chat/completions", lambda text: {"messages": _messages(text), "max_tokens": 1}, 400,
                  "many-message chat refused"),
    # a chat cut by truncate_prompt_tokens (its last 100 tokens kept: answered), as one message or as chat_many's
    "chat_truncated": ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}],
                                                             "max_tokens": 1, "truncate_prompt_tokens": 100},
                       200, "truncated chat answered"),
    "chat_many_truncated": ("/v1/chat/completions", lambda text: {"messages": _messages(text), "max_tokens": 1,
                                                                  "truncate_prompt_tokens": 100},
                            200, "truncated many-message chat answered"),
}


def _messages(text: str, size: int = 100) -> list[dict[str, str]]:
    """``text`` cut into messages of ``size`` characters, user's and assistant's in turn."""
    return [{"role": ("user", "assistant")[i % 2], "content": text[at:at + size]}
            for i, at in enumerate(range(0, len(text), size))]


def one_round(url: str, text: str, gap: float, case: str = "completion") -> tuple[float, float]:
    """(seconds to the big request's answer, the small one's) for ``case``, the small one sent ``gap`` s after."""
    path, body, expected, _ = CASES[case]
    big: list[tuple[int, float]] = []
    thread = threading.Thread(target=lambda: big.append(_post(url + path, body(text))))
    thread.start()
    time.sleep(gap)
    status, small = _post(url + "/v1/completions", {"prompt": "Hello", "max_tokens": 1})
    thread.join()
    if status != 200 or big[0][0] != expected:
        raise RuntimeError(f"unexpected answers ({case}): small {status}, big {big[0][0]}")
    return big[0][1], small


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chars", type=int, default=600_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gap", type=float, default=0.3)
    ap.add_argument("--cases", default="completion", help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--baseline", type=Path)
    args = ap.parse_args()
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"--cases: {', '.join(unknown)}: not a case (give {', '.join(CASES)})")
    rng = random.Random(0)
    words = (REPO / "bench" / "text_prompts.txt").read_text().split()
    text = " ".join(rng.choice(words) for _ in range(args.chars // 3))[: args.chars]
    trees: dict[str, Any] = {"this checkout": REPO, **({"baseline": args.baseline} if args.baseline else {})}
    got = interleaved(trees, args.model, args.repeats,
                      lambda url: tuple(t for case in cases for t in one_round(url, text, args.gap, case)))
    command = (f"python -m bench.bench_prompt_aside --model {args.model} --chars {args.chars} --repeats {args.repeats} "
               f"--gap {args.gap:g}" + (f" --cases {args.cases}" if args.cases != "completion" else ""))
    columns, sooner = ["checkout"], []
    for k, case in enumerate(cases):
        what = CASES[case][3]
        columns += [f"{what}, s", f"small request meanwhile ({case}), s"]
        sooner += [(2 * k + 1, f"the small request ({case})"), (2 * k, f"the big one ({what})")]
    print(side_by_side(f"A small request sent while a {args.chars:,}-character prompt is tokenized on kvload serve "
                       f"{args.model}", command, columns, got, sooner))


if __name__ == "__main__":
    main()
