"""``kvload serve`` against the Python API: N concurrent streaming clients vs one ``generate`` call, same prompts.

Run from the repository root::

    python -m bench.bench_serve                    # SmolLM2-135M, 8 clients, 64 tokens each, 3 repeats
    python -m bench.bench_serve --clients 1 4 8 --tokens 32 --repeats 2

The server runs as a real process (``python -m kvload serve MODEL --port 0``, one torch thread); the
clients are the ``openai`` package's ``AsyncOpenAI`` in this process, one streaming chat request each,
all sent at once. The Python API side loads the same model in this process (one torch thread) and
generates the same chat prompts in one ``generate`` call. Both use greedy decoding with ``ignore_eos``
so every request generates exactly ``--tokens`` tokens. Per request: TTFT (request sent → first token;
for the API: queued → first token) and TPOT ((last − first token) / (tokens − 1)); total generated
tokens/s = all tokens / wall time of the batch. A third side submits the same prompts straight to the
server's engine loop (``engine.serving.ServingEngine``) in this process, to separate the loop's cost from
HTTP and client costs. Sides alternate order each repeat; medians over repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import Table, median, p99

QUESTIONS = [
    "What is the capital of France?", "Name three primary colours.", "Write a haiku about the sea.",
    "Why is the sky blue?", "Give me a tip for learning Python.", "What is 17 times 23?",
    "Describe a cat in one sentence.", "What does a compiler do?", "Suggest a name for a dog.",
    "What is photosynthesis?", "List two uses of copper.", "How far is the Moon?",
    "What is a prime number?", "Tell me a fun fact about owls.", "What is the boiling point of water?",
    "Translate 'good morning' into Spanish.",
]
REPO = Path(__file__).resolve().parents[1]


def start_server(model: str, max_tokens: int, extra: Sequence[str] = ()) -> tuple[subprocess.Popen, str]:
    """``kvload serve`` on a free port (``extra``: more of its flags); the process and its URL once it listens."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "kvload", "serve", model, "--port", "0", "--max_tokens",
                             str(max_tokens), *extra], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=env, cwd=REPO)
    deadline = time.monotonic() + 600
    assert proc.stderr is not None
    while True:
        line = proc.stderr.readline()
        if " at http://" in line:
            return proc, line.split(" at ", 1)[1].split(" ", 1)[0]
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"kvload serve did not start: {line.strip()}")


async def one_client(client: Any, model: str, question: str, tokens: int) -> dict[str, float]:
    """One streaming chat request; TTFT, TPOT, token count, end time."""
    sent = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=tokens, stream=True,
        extra_body={"ignore_eos": True})
    first = last = None
    count = 0
    async for chunk in stream:
        if not chunk.choices:
            continue
        got = len(chunk.choices[0].model_extra.get("token_ids") or [])
        if got:
            now = time.perf_counter()
            first = now if first is None else first
            last = now
            count += got
    assert first is not None and last is not None
    return {"ttft": first - sent, "tpot": (last - first) / max(count - 1, 1), "tokens": count, "end": last}


async def server_batch(url: str, model: str, questions: list[str], tokens: int) -> dict[str, Any]:
    """All clients at once; per-request figures and total tokens/s."""
    import openai

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_client(client, model, q, tokens) for q in questions))
    wall = max(r["end"] for r in results) - start
    return {"ttft": [r["ttft"] for r in results], "tpot": [r["tpot"] for r in results],
            "tokens_per_s": sum(r["tokens"] for r in results) / wall}


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server started by :func:`start_server`; kill it if it has not exited within 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def api_batch(llm: Any, questions: list[str], tokens: int) -> dict[str, Any]:
    """The same prompts through ``generate`` in one call."""
    from engine.sampling_params import SamplingParams

    start = time.perf_counter()
    outs = llm.generate(questions, SamplingParams(max_tokens=tokens, ignore_eos=True), chat=True)
    wall = time.perf_counter() - start
    ttft, tpot, total = [], [], 0
    for out in outs:
        sample = out.outputs[0] if hasattr(out, "outputs") else out
        n = len(sample.token_ids)
        total += n
        timings = out.timings
        ttft.append(timings.first_token_s)
        tpot.append((timings.total_s - timings.first_token_s) / max(n - 1, 1))
    return {"ttft": ttft, "tpot": tpot, "tokens_per_s": total / wall}


def engine_batch(llm: Any, questions: list[str], tokens: int) -> dict[str, Any]:
    """The same prompts submitted straight to a ``ServingEngine`` (the server's loop, no HTTP, no client)."""
    import threading

    from engine.sampling_params import SamplingParams
    from engine.serving import ServingEngine

    engine = ServingEngine.from_result(llm)
    prompts = [engine.encode_messages([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    seen: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
    sent: dict[int, float] = {}
    left = [len(prompts)]
    done = threading.Event()

    def sink(i: int, ev: Any) -> None:
        seen[i].extend([time.perf_counter()] * len(ev.new_token_ids))
        if ev.finished:
            left[0] -= 1
            if not left[0]:
                done.set()

    engine.start()
    try:
        start = time.perf_counter()
        for i, ids in enumerate(prompts):
            sent[i] = time.perf_counter()
            engine.submit(ids, params, lambda ev, i=i: sink(i, ev))
        if not done.wait(1800):
            raise RuntimeError("the engine did not finish within 30 minutes")
    finally:
        engine.stop()
    wall = max(t[-1] for t in seen.values()) - start
    return {"ttft": [seen[i][0] - sent[i] for i in seen],
            "tpot": [(t[-1] - t[0]) / max(len(t) - 1, 1) for t in seen.values()],
            "tokens_per_s": sum(len(t) for t in seen.values()) / wall}


def main() -> None:
    """Print the side-by-side table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--clients", type=int, nargs="+", default=[8])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", dest="max_tokens", type=int, default=8192, help="KV budget of both sides")
    ns = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    import kvload

    proc, url = start_server(ns.model, ns.max_tokens)
    table = Table(f"kvload serve vs the Python API ({ns.model}, greedy, {ns.tokens} tokens per request, "
                  f"median of {ns.repeats})",
                  f"python -m bench.bench_serve --model {ns.model} --clients {' '.join(map(str, ns.clients))} "
                  f"--tokens {ns.tokens} --repeats {ns.repeats}",
                  ["clients", "side", "TTFT p50 (s)", "TTFT p99 (s)", "TPOT p50 (ms)", "TPOT p99 (ms)",
                   "generated tokens/s", "vs API"])
    try:
        with kvload.load(ns.model, load_weights=True, kv_cache_config={"max_tokens": ns.max_tokens},
                         log=False) as llm:
            for n in ns.clients:
                questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
                asyncio.run(server_batch(url, ns.model, questions[:1], 4))  # warm-up: first-call costs
                api_batch(llm, questions[:1], 4)
                runs: dict[str, list[dict[str, Any]]] = {"API": [], "engine loop (no HTTP)": [], "server": []}
                order = list(runs)
                for i in range(ns.repeats):
                    for side in (order if i % 2 == 0 else order[::-1]):
                        if side == "API":
                            runs[side].append(api_batch(llm, questions, ns.tokens))
                        elif side == "server":
                            runs[side].append(asyncio.run(server_batch(url, ns.model, questions, ns.tokens)))
                        else:
                            runs[side].append(engine_batch(llm, questions, ns.tokens))
                speed = {side: median([r["tokens_per_s"] for r in rs]) for side, rs in runs.items()}
                for side in order:
                    rs = runs[side]
                    ttft = [t for r in rs for t in r["ttft"]]
                    tpot = [t for r in rs for t in r["tpot"]]
                    table.rows.append([str(n), side, f"{median(ttft):.3f}", f"{p99(ttft):.3f}",
                                       f"{median(tpot) * 1000:.1f}", f"{p99(tpot) * 1000:.1f}",
                                       f"{speed[side]:.1f}",
                                       f"{speed[side] / speed['API']:.2f}x" if side != "API" else ""])
    finally:
        stop_server(proc)
    print(table.markdown())


if __name__ == "__main__":
    main()
