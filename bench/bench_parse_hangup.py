"""A client that hangs up before its request is parsed on ``kvload serve``: how long its admission slot stays held;
and what a big body of token ids costs once read as JSON (the value it waits for its turn with, and the read's time).

Each checkout gets its own ``python -m kvload serve MODEL`` (``PYTHONPATH`` its folder), both up at once; each repeat,
on one server then the other (seconds from the client's close until ``kvload_http_requests_in_flight`` is 0):

- ``json``: ``--ids-mb`` MB of token ids sent, the socket closed 0.05 s after its last byte (its JSON being read);
- ``prompts``: 1,024 text prompts of 4,000 characters (the last too long), closed 0.3 s after (being tokenized);
- ``lane``: a second such ids body sent while the first is read, closed 0.2 s after (queued in the body lane):
  seconds from the first one's answer until the slot is free.

Then, per checkout in a fresh process: ``LoadedBody`` of the ids body (the big-body read), its seconds (median of
``--repeats``) and the value it holds over the body's size (tracemalloc, one more run); and, on a test server
(``tiny-llama``) that has read one such body already, the process's RSS growth while the ids body waits in the lane
(held by another).

    python -m bench.bench_parse_hangup [--model smollm2-135m] [--ids-mb 20] [--repeats 3] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

from bench.bench_big_body import _send, bodies
from bench.bench_big_prompt import REPO, interleaved
from bench.common import Table, machine, median, ratio


def _in_flight(url: str) -> float:
    for line in urllib.request.urlopen(url + "/metrics").read().decode().splitlines():
        if line.startswith("kvload_http_requests_in_flight"):
            return float(line.split()[-1])
    raise RuntimeError("no kvload_http_requests_in_flight")


def _send_and_close(url: str, body: bytes, hold: float) -> float:
    where = urllib.parse.urlsplit(url)
    with socket.create_connection((where.hostname, where.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(hold)
    return time.perf_counter()


def _until_free(url: str, since: float) -> float:
    while _in_flight(url) > 0:
        time.sleep(0.01)
    return time.perf_counter() - since


def many_prompts(n: int = 1024, chars: int = 4000) -> bytes:
    text = ("hello world " * (chars // 12 + 1))[:chars]
    prompts = [f"{i} {text}" for i in range(n - 1)] + ["hello world " * 200_000]  # the last: too long
    return json.dumps({"prompt": prompts, "max_tokens": 1}).encode()


def one_round(url: str, ids: bytes, many: bytes) -> tuple[float, float, float]:
    gone_json = _until_free(url, _send_and_close(url, ids, 0.05))
    time.sleep(0.3)
    gone_prompts = _until_free(url, _send_and_close(url, many, 0.3))
    time.sleep(0.3)
    first: list[tuple[int, float]] = []
    thread = threading.Thread(target=lambda: first.append(_send(url, ids)))
    thread.start()
    time.sleep(0.3)
    _send_and_close(url, ids, 0.2)
    thread.join()
    gone_lane = _until_free(url, time.perf_counter())
    return gone_json, gone_prompts, gone_lane


_LOADED = """
import json, sys, time, tracemalloc
from kvload.serve.request_body import LoadedBody
raw = open(sys.argv[1], "rb").read()
times = []
for _ in range(int(sys.argv[2])):
    start = time.perf_counter(); LoadedBody(bytes(raw)); times.append(time.perf_counter() - start)
tracemalloc.start(); before = tracemalloc.get_traced_memory()[0]
loaded = LoadedBody(raw); held = tracemalloc.get_traced_memory()[0] - before
assert loaded.error is None
times.sort()
print(json.dumps([times[len(times) // 2], held / len(raw)]))
"""


_LANE = """
import json, socket, sys, threading, time
import kvload.serve.worker as worker
from tests.serve_support import serving
raw_body = open(sys.argv[1], "rb").read()
release, entered, real = threading.Event(), threading.Event(), worker.LoadedBody
hold = []
def held(raw, *args):
    if hold and not entered.is_set():
        entered.set(); release.wait(120)
    return real(raw, *args)
worker.LoadedBody = held
def rss():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))
def post(body):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\n"
              + f"Content-Length: {len(body)}\\r\\n\\r\\n".encode() + body)
    return s
with serving("tiny-llama", max_seq_len=64, state={"max_request_bytes": 1 << 30}) as served:
    port = served.server.port
    served.http.post("/v1/completions", content=raw_body)  # a server that read one such body already (refused)
    hold.append(True)
    first = post(json.dumps({"prompt": [1, 2], "max_tokens": 1, "user": "u" * (100 << 10)}).encode())
    assert entered.wait(60)
    time.sleep(0.5)
    before = rss()
    second = post(raw_body)
    while rss() - before < 0.9 * len(raw_body):
        time.sleep(0.05)
    time.sleep(2)
    print(json.dumps((rss() - before) / len(raw_body)))
    release.set()
"""


def lane_rss(tree: Path, path: Path) -> float:
    """The server process's memory growth (RSS) over the body's size while the body at ``path`` waits in the lane."""
    out = subprocess.run([sys.executable, "-c", _LANE, str(path)], check=True, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}, cwd=tempfile.gettempdir()).stdout
    return float(out.strip().splitlines()[-1])


def loaded_body(tree: Path, path: Path, repeats: int) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", _LOADED, str(path), str(repeats)], check=True, capture_output=True,
                         env={"PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}, text=True,
                         cwd=tempfile.gettempdir()).stdout  # not this folder: -c puts the working directory first
    seconds, held = json.loads(out.strip().splitlines()[-1])
    return seconds, held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ids-mb", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="another checkout to run side by side (e.g. main)")
    args = ap.parse_args()
    ids = bodies(0.001, args.ids_mb)["ids"]
    many = many_prompts()
    trees = {"this checkout": REPO, **({"baseline": args.baseline} if args.baseline else {})}
    got = interleaved(trees, args.model, args.repeats, lambda url: one_round(url, ids, many))
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        f.write(ids)
        f.flush()
        loads = {name: loaded_body(tree, Path(f.name), args.repeats) for name, tree in trees.items()}
        lane = {name: lane_rss(tree, Path(f.name)) for name, tree in trees.items()}
    command = (f"python -m bench.bench_parse_hangup --model {args.model} --ids-mb {args.ids_mb:g} "
               f"--repeats {args.repeats}")
    table = Table(f"A client that hangs up before its request is parsed, on kvload serve {args.model}",
                  command + (" --baseline DIR" if args.baseline else ""),
                  ["checkout", f"gone while its JSON ({len(ids) / 1e6:.1f} MB of ids) is read: slot held, s",
                   "gone while 1,024 prompts are tokenized: slot held, s",
                   "gone while queued in the body lane: slot held after the lane's turn, s",
                   "LoadedBody of the ids, s", "value held / body size",
                   "server RSS growth / body size, the ids queued in the lane"])
    for name, rounds in got.items():
        table.rows.append([name, *(f"{median([r[k] for r in rounds]):.3f}" for k in range(3)),
                           f"{loads[name][0]:.3f}", f"{loads[name][1]:.2f}x", f"{lane[name]:.2f}x"])
    if args.baseline:
        base, this = got["baseline"], got["this checkout"]
        for k, what in enumerate(("json", "prompts", "lane")):
            sooner = ratio(median([r[k] for r in base]) / median([r[k] for r in this]))
            table.notes.append(f"{what}: the slot freed {sooner} sooner than the baseline's")
        table.notes.append(f"LoadedBody: {ratio(loads['baseline'][0] / loads['this checkout'][0])} faster, "
                           f"{ratio(loads['baseline'][1] / loads['this checkout'][1])} less held")
    table.notes.append(", ".join(f"{k}: {v}" for k, v in machine().items()))
    print(table.markdown())


if __name__ == "__main__":
    main()
