"""What a response kept for ``previous_response_id`` costs in memory (``kvload serve --responses-store-max``).

Run from the repository root::

    python -m bench.bench_responses_store                  # 1000 responses per row, replies of 400 characters
    python -m bench.bench_responses_store --responses 200 --reply 2000

No model: each request goes through the server's own reading of the body (``responses_input.to_chat`` with the store,
so ``previous_response_id`` and the kept input items are built as served) and a response object of the served shape
(``responses_output``) with one message of ``--reply`` characters is kept. ``tracemalloc`` measures what the store
holds after N responses, divided by N. Rows: independent single-turn requests with inputs of several sizes (the text
of each is its own), and one conversation chained turn after turn by ``previous_response_id`` (each turn sends only
its new user message: a kept turn holds its own items and a link to the turn before, so a turn costs its new text),
against the same conversation sent whole in ``input`` each turn (``store: false``), as a client without a store does.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc
from types import SimpleNamespace
from typing import Any

from bench.common import Table
from kvload.serve.responses_input import to_chat
from kvload.serve.responses_output import _message_item, _response
from kvload.serve.responses_store import ResponseStore


def _keep(store: ResponseStore, body: dict[str, Any], i: int, reply: str) -> str:
    """Read ``body`` as the server does (from its JSON text: every request's strings its own), then keep its
    response (a message of ``reply``, its own string too); the response id."""
    _, request = to_chat(json.loads(json.dumps(body)), None, store)
    reply = "".join(reply)  # a new string, as each answer's text is
    run = SimpleNamespace(responses=request, id=f"resp_{i:032x}", created=int(time.time()),
                          state=SimpleNamespace(model_name="smollm2-135m"),
                          job=SimpleNamespace(params=SimpleNamespace(temperature=0.0, top_p=1.0)))
    choice = SimpleNamespace(prompt_tokens=100 + i, reused=0, token_ids=[0] * 100, reasoning_tokens=0)
    doc = _response(run, "completed", [_message_item(f"msg_{i:032x}", reply, "completed")], choice)
    if request.store:  # as responses_output keeps it
        store.put(doc, request.items, request.previous)
    return doc["id"]


def measure(n: int, reply: str, body_of: Any, kept: bool = True) -> tuple[float, float]:
    """Bytes held per kept response, and microseconds per request read and kept, over ``n`` responses (``kept``:
    the bodies do not say ``store: false``)."""
    store = ResponseStore(n)
    gc.collect()
    tracemalloc.start()
    start_bytes = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    previous = None
    for i in range(n):
        previous = _keep(store, body_of(i, previous), i, reply)
    elapsed = time.perf_counter() - start
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - start_bytes
    tracemalloc.stop()
    assert len(store) == (n if kept else 0)
    return held / n, elapsed / n * 1e6


def main(argv: list[str] | None = None) -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--responses", type=int, default=1000, help="responses kept per row (default 1000)")
    parser.add_argument("--reply", type=int, default=400, help="characters of each reply (default 400)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    reply = ("The sky is blue because air scatters blue light most. " * 100)[:args.reply]
    command = "python -m bench.bench_responses_store" + (f" {' '.join(argv)}" if argv else "")
    table = Table(f"Responses kept: memory per response ({args.responses:,} per row, replies of {len(reply):,} "
                  "characters)", command, ["requests", "input characters", "bytes held per response",
                                           "us per request read and kept"])
    for size in (200, 2_000, 20_000):
        text = ("What colour is the sky, and why? " * 1000)[:size]
        per, us = measure(args.responses, reply, lambda i, _, t=text: {"input": t, "instructions": "Be brief."})
        table.rows.append(["independent", f"{size:,}", f"{per:,.0f}", f"{us:,.0f}"])
    question = "And what about the sea at night? "[:200]

    def chained(i: int, previous: str | None) -> dict[str, Any]:
        return {"input": question, **({"previous_response_id": previous} if previous else {})}

    per, us = measure(args.responses, reply, chained)
    table.rows.append([f"one chain of {args.responses:,} turns", f"{len(question):,} a turn", f"{per:,.0f}",
                       f"{us:,.0f}"])
    sent: list[dict[str, Any]] = []  # what a client keeping the conversation itself sends, turn after turn

    def whole(i: int, _: str | None) -> dict[str, Any]:
        if i:
            sent.append({"role": "assistant", "content": reply})
        sent.append({"role": "user", "content": question})
        return {"input": list(sent), "store": False}

    _, us = measure(args.responses, reply, whole, kept=False)
    table.rows.append(["the same conversation sent whole each turn, store: false", f"{len(question):,} a turn",
                       "0", f"{us:,.0f}"])
    print(table.markdown())


if __name__ == "__main__":
    main()
