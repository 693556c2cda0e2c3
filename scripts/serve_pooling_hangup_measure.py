"""A client that hangs up on a 64-input pooling request (``/classify`` on a tiny Llama classifier, ``/v1/embeddings``
on a tiny generative Llama; 30 tokens each, ``max_num_tokens`` 16: about 120 steps) once the engine ran 2 of its
steps: seconds until its admission slot frees, engine steps run after the close, engine requests aborted, pooled rows
left. Three hang-ups per route, one JSON line per route.

    PYTHONPATH=<tree> python scripts/serve_pooling_hangup_measure.py <tree>
"""

from __future__ import annotations

import json
import pathlib
import socket
import statistics
import sys
import tempfile
import time

TREE = sys.argv[1]
sys.path.insert(0, TREE)

from models.weights import random_model  # noqa: E402
from tests.classify_support import classifier_checkpoint  # noqa: E402
from tests.llm_support import word_tokenizer  # noqa: E402
from tests.paged_support import tiny_config  # noqa: E402
from tests.serve_support import serving, wait_for  # noqa: E402

KV = {"max_tokens": 512, "tokens_per_block": 4}


def aborted(s) -> float:
    return sum(v for k, v in s.metrics().items()
               if "request_success" in k and "finished_reason=abort" in k and not k.endswith("_created"))


def hang_up(s, path: str, rep: int) -> tuple[float, int, int, int]:
    """One hang-up: (seconds to the slot freed, steps after the close, requests aborted, pooled rows left)."""
    eng = s.state.engine
    inputs = [[(11 * j + 7 * i + 13 * rep) % 500 + 1 for i in range(30)] for j in range(64)]  # no prefix shared
    payload = json.dumps({"input": inputs}).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    a0, s0 = aborted(s), eng.steps
    sock = socket.create_connection(("127.0.0.1", s.server.port))
    sock.sendall(head + payload)
    wait_for(lambda: eng.steps >= s0 + 2, what="2 steps")
    sock.close()
    t0, s1 = time.monotonic(), eng.steps
    wait_for(lambda: s.state.in_flight == 0, timeout=120, what="the slot freed")
    freed = time.monotonic() - t0
    wait_for(lambda: not any(eng.snapshot()[k] for k in ("running", "waiting")), timeout=120, what="engine idle")
    time.sleep(0.3)
    return freed, eng.steps - s1, int(aborted(s) - a0), len(eng.executor.pooled._rows)


def main() -> None:
    work = pathlib.Path(tempfile.mkdtemp())
    cls = classifier_checkpoint(work / "cls", "llama", "LlamaForSequenceClassification", 3)
    gen = work / "gen"
    random_model(tiny_config("llama"), device="cpu", dtype="float32", seed=0).save_pretrained(gen)
    for p in (cls, gen):
        word_tokenizer(512).save_pretrained(p)
    for ckpt, path in ((cls, "/classify"), (gen, "/v1/embeddings")):
        with serving(str(ckpt), dtype="float32", max_seq_len=64, max_num_tokens=16, kv_cache_config=KV) as s:
            rows = [hang_up(s, path, rep) for rep in range(3)]
            print(json.dumps({"tree": TREE, "route": path, "slot_freed_s": [round(r[0], 3) for r in rows],
                              "median_slot_freed_s": round(statistics.median(r[0] for r in rows), 3),
                              "steps_after_close": [r[1] for r in rows], "aborted_of_64": [r[2] for r in rows],
                              "pooled_rows_left": [r[3] for r in rows]}), flush=True)


if __name__ == "__main__":
    main()
