"""Side by side: a /pooling per-token answer of 8,192 x 1,024 floats rendered on a worker thread by Starlette's
JSONResponse (as main did) and by ``kvload.serve.embeddings.json_response`` (a row at a time); the main thread's
longest wait for the GIL (1 ms sleeps) and the total, medians of 3. Run: ``PYTHONPATH=. python
scripts/pooling_render_stall.py``."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch
from fastapi.responses import JSONResponse

from engine.sampling_params import SamplingParams
from kvload.serve.embeddings import json_response
from kvload.serve.pooling import PoolingJob, pooled_data, pooling_answer

STATE = SimpleNamespace(model_name="m")
ROWS = torch.randn(8192, 1024)
JOB = PoolingJob([[1] * 8192], SamplingParams(max_tokens=1), "token_embed", normalize=False)


def whole() -> None:
    """main's rendering: every row's floats in one json.dumps."""
    data = [{"index": 0, "object": "pooling", "data": d.tolist()} for d in pooled_data(STATE, JOB, [ROWS])]
    JSONResponse({"data": data})


def by_rows() -> None:
    """The route's rendering now."""
    json_response(pooling_answer(STATE, JOB, [ROWS]))


def run(work: Callable[[], None]) -> tuple[float, float]:
    """(the main thread's longest gap between 1 ms sleeps, the total) while ``work`` runs on another thread."""
    thread = threading.Thread(target=work)
    gaps: list[float] = []
    last = start = time.perf_counter()
    thread.start()
    while thread.is_alive():
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    return max(gaps), time.perf_counter() - start


if __name__ == "__main__":
    for name, work in (("JSONResponse (main)", whole), ("json_response (rows)", by_rows)):
        got = [run(work) for _ in range(3)]
        stall, total = statistics.median(g for g, _ in got), statistics.median(t for _, t in got)
        print(f"{name}: longest stall {stall:.3f} s, total {total:.2f} s")
