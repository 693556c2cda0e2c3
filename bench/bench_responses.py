"""``kvload serve``'s Responses API against its chat endpoint: the same streaming requests, what the second API costs.

Run from the repository root::

    python -m bench.bench_responses                    # SmolLM2-135M, 8 clients, 64 tokens at most, 3 repeats
    python -m bench.bench_responses --clients 1 8 --tokens 32 --repeats 2

One real ``kvload serve`` process (``bench.bench_serve.start_server``); per side, N ``openai.AsyncOpenAI`` streaming
requests sent at once: ``chat.completions.create(stream=True, max_tokens=T)`` or ``responses.create(stream=True,
max_output_tokens=T)`` with the same chat prompts, greedy, so both generate the same tokens (the Responses API has no
``ignore_eos``: a reply may end before T). Per request: TTFT (sent → first text); per batch: generated tokens (each
answer's own usage) / wall time. Sides alternate order each repeat; medians over repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

from bench.bench_serve import QUESTIONS, start_server, stop_server
from bench.common import Table, median, p99


async def one_client(client: Any, side: str, model: str, question: str, tokens: int) -> dict[str, float]:
    """One streaming request; TTFT, generated tokens (from the answer's usage), end time."""
    sent = time.perf_counter()
    first = None
    count = 0
    if side == "chat":
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=tokens, stream=True,
            stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.perf_counter()
            if chunk.usage is not None:
                count = chunk.usage.completion_tokens
    else:
        stream = await client.responses.create(model=model, input=question, max_output_tokens=tokens, stream=True)
        async for event in stream:
            if event.type == "response.output_text.delta" and first is None:
                first = time.perf_counter()
            if event.type in ("response.completed", "response.incomplete"):
                count = event.response.usage.output_tokens
    end = time.perf_counter()
    assert first is not None and count
    return {"ttft": first - sent, "tokens": count, "end": end}


async def batch(url: str, side: str, model: str, questions: list[str], tokens: int) -> dict[str, Any]:
    """All clients at once; TTFTs, total tokens and tokens/s."""
    import openai

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_client(client, side, model, q, tokens) for q in questions))
    wall = max(r["end"] for r in results) - start
    total = sum(r["tokens"] for r in results)
    return {"ttft": [r["ttft"] for r in results], "tokens": total, "tokens_per_s": total / wall}


def main() -> None:
    """Print the side-by-side table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--clients", type=int, nargs="+", default=[8])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", dest="max_tokens", type=int, default=8192, help="the server's KV budget")
    ns = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    proc, url = start_server(ns.model, ns.max_tokens)
    table = Table(f"kvload serve: Responses API vs chat completions ({ns.model}, greedy, at most {ns.tokens} tokens "
                  f"per request, median of {ns.repeats})",
                  f"python -m bench.bench_responses --model {ns.model} --clients {' '.join(map(str, ns.clients))} "
                  f"--tokens {ns.tokens} --repeats {ns.repeats}",
                  ["clients", "side", "TTFT p50 (s)", "TTFT p99 (s)", "generated tokens", "generated tokens/s",
                   "vs chat"])
    try:
        for n in ns.clients:
            questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
            for side in ("chat", "responses"):  # warm-up: first-call costs
                asyncio.run(batch(url, side, ns.model, questions[:1], 4))
            runs: dict[str, list[dict[str, Any]]] = {"chat": [], "responses": []}
            order = list(runs)
            for i in range(ns.repeats):
                for side in (order if i % 2 == 0 else order[::-1]):
                    runs[side].append(asyncio.run(batch(url, side, ns.model, questions, ns.tokens)))
            speed = {side: median([r["tokens_per_s"] for r in rs]) for side, rs in runs.items()}
            for side in order:
                ttft = [t for r in runs[side] for t in r["ttft"]]
                table.rows.append([str(n), side, f"{median(ttft):.3f}", f"{p99(ttft):.3f}",
                                   str(runs[side][0]["tokens"]), f"{speed[side]:.1f}",
                                   f"{speed[side] / speed['chat']:.2f}x" if side != "chat" else ""])
    finally:
        stop_server(proc)
    print(table.markdown())


if __name__ == "__main__":
    main()
