"""A huge text prompt on ``kvload serve``: how long until it is refused, and how long a small request sent meanwhile
(and ``/health``) waits.

Each checkout gets its own ``python -m kvload serve MODEL`` (``PYTHONPATH`` its folder), both up at once; each repeat
sends, to one server then the other, a prompt of ``--mb`` megabytes of text (far past ``max_seq_len`` tokens) on one
thread and, 0.3 s later, a one-token completion and a ``/health`` on another. Medians per checkout.

    python -m bench.bench_big_prompt [--model smollm2-135m] [--mb 8] [--repeats 3] [--baseline /path/to/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import Table, machine, median, ratio

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(pythonpath: Path, model: str) -> tuple[subprocess.Popen[bytes], str]:
    """``kvload serve model`` from the checkout at ``pythonpath``, once its ready line is out; (process, URL)."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "kvload", "serve", model, "--port", str(port), "--max_tokens",
                          "16384"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                         cwd=tempfile.gettempdir())
    assert p.stderr is not None
    for line in p.stderr:
        if b"Ctrl-C stops" in line:  # what it logs later is read and dropped, so its writes never block
            threading.Thread(target=p.stderr.read, daemon=True).start()
            return p, f"http://127.0.0.1:{port}"
    raise RuntimeError(f"kvload serve {model} ended before its ready line (exit {p.wait()})")


def _post(url: str, body: Any) -> tuple[int, float]:
    data = json.dumps(body).encode()
    start = time.perf_counter()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as exc:
        exc.read()
        status = exc.code
    return status, time.perf_counter() - start


def _get(url: str) -> float:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=600) as r:
        r.read()
    return time.perf_counter() - start


def one_round(url: str, prompt: str) -> tuple[float, float, float]:
    """(seconds to the big prompt's refusal, the small request's, /health's) with the big one sent first."""
    big: list[Any] = []
    thread = threading.Thread(target=lambda: big.append(_post(url + "/v1/completions",
                                                              {"prompt": prompt, "max_tokens": 1})))
    thread.start()
    time.sleep(0.3)  # the big body is read and being parsed
    health = _get(url + "/health")
    status, small = _post(url + "/v1/completions", {"prompt": "Hello", "max_tokens": 1})
    thread.join()
    if status != 200 or big[0][0] != 400:
        raise RuntimeError(f"unexpected answers: small {status}, big {big[0][0]}")
    return big[0][1], small, health


def side_by_side(title: str, command: str, columns: list[str], got: dict[str, list[tuple[float, ...]]],
                 sooner: list[tuple[int, str]]) -> str:
    """The markdown table of :func:`interleaved`'s results: a row of medians per checkout (``columns[1:]``, in the
    order ``one`` returns them), and with a baseline how much sooner this checkout is for each ``(column, what)``."""
    table = Table(title, command + (" --baseline DIR" if "baseline" in got else ""), columns)
    for name, rounds in got.items():
        table.rows.append([name, *(f"{median([r[k] for r in rounds]):.3f}" for k in range(len(columns) - 1))])
    if "baseline" in got:
        base, this = got["baseline"], got["this checkout"]
        for k, what in sooner:
            table.notes.append(f"{what}: {ratio(median([r[k] for r in base]) / median([r[k] for r in this]))} "
                               "sooner than the baseline's")
    table.notes.append(", ".join(f"{k}: {v}" for k, v in machine().items()))
    return table.markdown()


def interleaved(trees: dict[str, Path], model: str, repeats: int,
                one: Callable[[str], tuple[float, ...]]) -> dict[str, list[tuple[float, ...]]]:
    """A server per checkout in ``trees``, all up at once; ``repeats`` rounds of ``one(url)``, one server after the
    other each round; each checkout's results. The servers are stopped however it ends."""
    servers = {name: start(tree, model) for name, tree in trees.items()}
    got: dict[str, list[tuple[float, ...]]] = {name: [] for name in trees}
    try:
        for _ in range(repeats):
            for name, (_, url) in servers.items():
                got[name].append(one(url))
    finally:
        for p, _ in servers.values():
            p.terminate()
            p.wait()
    return got


def main() -> None:
    """Start a server per checkout, run ``--repeats`` interleaved rounds, print a markdown table of medians."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--mb", type=float, default=8.0, help="the big prompt's size in megabytes of text")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="another checkout to run side by side (e.g. main)")
    args = ap.parse_args()
    prompt = ("hello world " * int(args.mb * 1e6 / 12 + 1))[: int(args.mb * 1e6)]
    trees = {"this checkout": REPO, **({"baseline": args.baseline} if args.baseline else {})}
    got = interleaved(trees, args.model, args.repeats, lambda url: one_round(url, prompt))
    command = f"python -m bench.bench_big_prompt --model {args.model} --mb {args.mb:g} --repeats {args.repeats}"
    print(side_by_side(f"A {args.mb:g} MB prompt on kvload serve {args.model}", command,
                       ["checkout", "big prompt refused, s", "small request meanwhile, s", "/health meanwhile, s"],
                       got, [(0, "the refusal"), (1, "the small request")]))


if __name__ == "__main__":
    main()
