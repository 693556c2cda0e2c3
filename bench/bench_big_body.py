"""A big request body on ``kvload serve``: how long a small request sent while the big one is read waits.

Each checkout gets its own ``python -m kvload serve MODEL`` (``PYTHONPATH`` its folder), both up at once; each repeat
sends, to one server then the other, a big ``/v1/completions`` body on one thread and, once all its bytes are sent
plus ``--gap`` seconds, a one-token completion (``"Hello"``) on another. Two big bodies, each refused with no engine
work:

- ``prompt``: one text prompt of ``--prompt-mb`` megabytes, past ``max_seq_len`` by its characters;
- ``ids``: ``--ids-mb`` megabytes of token ids, 1,024 prompts, the last with an id past the vocabulary (so every
  prompt before it is read and checked).

Each round also times the small request alone. Bodies are serialized before timing starts. Medians per checkout and
body.

    python -m bench.bench_big_body [--model smollm2-135m] [--prompt-mb 8] [--ids-mb 20] [--repeats 5] [--gap 0.05]
                                   [--baseline /path/to/checkout]
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from bench.bench_big_prompt import REPO, interleaved
from bench.common import Table, machine, median, ratio

VOCAB = 49152  # SmolLM2's: the ids body's last prompt holds one past it


def _send(url: str, body: bytes, sent: threading.Event | None = None) -> tuple[int, float]:
    """POST ``body`` to ``url``'s /v1/completions; (status, seconds from the first byte sent to the answer read).
    ``sent`` is set once every byte of the body was handed to the socket."""
    where = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=600)
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        if sent is not None:
            sent.set()
        r = conn.getresponse()
        r.read()
        return r.status, time.perf_counter() - start
    finally:
        conn.close()


SMALL = json.dumps({"prompt": "Hello", "max_tokens": 1}).encode()


def alone(url: str) -> float:
    """Seconds the small request takes with nothing else sent."""
    status, took = _send(url, SMALL)
    if status != 200:
        raise RuntimeError(f"unexpected answer to the small request alone: {status}")
    return took


def one_round(url: str, big: bytes, gap: float) -> tuple[float, float]:
    """(seconds to the big body's refusal, the small request's), the small one sent ``gap`` s after the big one's
    last byte."""
    answer: list[tuple[int, float]] = []
    sent = threading.Event()
    thread = threading.Thread(target=lambda: answer.append(_send(url, big, sent)))
    thread.start()
    sent.wait(600)
    time.sleep(gap)
    status, small = _send(url, SMALL)
    thread.join()
    if status != 200 or answer[0][0] != 400:
        raise RuntimeError(f"unexpected answers: small {status}, big {answer[0][0]}")
    return answer[0][1], small


def bodies(prompt_mb: float, ids_mb: float) -> dict[str, bytes]:
    """The two big bodies, serialized."""
    text = ("hello world " * int(prompt_mb * 1e6 / 12 + 1))[: int(prompt_mb * 1e6)]
    per_prompt = int(ids_mb * 1e6 / 1024 / 7)  # "12345, ": about 7 bytes an id
    prompts: list[Any] = [[(i * 7919 + j * 104729) % VOCAB for j in range(per_prompt)] for i in range(1023)]
    prompts.append([1, 2, VOCAB + 5])
    return {"prompt": json.dumps({"prompt": text, "max_tokens": 1}).encode(),
            "ids": json.dumps({"prompt": prompts, "max_tokens": 1}).encode()}


def main() -> None:
    """Start a server per checkout, run ``--repeats`` interleaved rounds per body, print a markdown table of medians."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-mb", type=float, default=8.0, help="the one-prompt body's prompt, in megabytes of text")
    ap.add_argument("--ids-mb", type=float, default=20.0, help="the token-id body's size in megabytes")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gap", type=float, default=0.05, help="seconds from the big body's last byte to the small one")
    ap.add_argument("--baseline", type=Path, help="another checkout to run side by side (e.g. main)")
    args = ap.parse_args()
    big = bodies(args.prompt_mb, args.ids_mb)
    trees = {"this checkout": REPO, **({"baseline": args.baseline} if args.baseline else {})}
    got = interleaved(trees, args.model, args.repeats,
                      lambda url: (*(t for body in big.values() for t in one_round(url, body, args.gap)), alone(url)))
    command = (f"python -m bench.bench_big_body --model {args.model} --prompt-mb {args.prompt_mb:g} --ids-mb "
               f"{args.ids_mb:g} --repeats {args.repeats} --gap {args.gap:g}")
    sizes = {name: f"{len(body) / 1e6:.1f} MB" for name, body in big.items()}
    table = Table(f"A small request sent while a big body is read on kvload serve {args.model}",
                  command + (" --baseline DIR" if args.baseline else ""),
                  ["checkout", *(f"{name} body ({sizes[name]}) refused, s" for name in big),
                   *(f"small request during {name} body, s" for name in big), "small request alone, s"])
    columns = [2 * k for k in range(len(big))] + [2 * k + 1 for k in range(len(big))] + [2 * len(big)]
    for name, rounds in got.items():
        table.rows.append([name, *(f"{median([r[k] for r in rounds]):.3f}" for k in columns)])
    if args.baseline:
        base, this = got["baseline"], got["this checkout"]
        for k, name in enumerate(big):
            for j, what in ((2 * k + 1, f"the small request during the {name} body"),
                            (2 * k, f"the {name} body's refusal")):
                table.notes.append(f"{what}: {ratio(median([r[j] for r in base]) / median([r[j] for r in this]))} "
                                   "sooner than the baseline's")
    table.notes.append(", ".join(f"{k}: {v}" for k, v in machine().items()))
    print(table.markdown())


if __name__ == "__main__":
    main()
