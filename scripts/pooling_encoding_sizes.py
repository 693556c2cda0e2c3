"""Side by side: one /pooling ``token_embed`` answer of 8,192 x 1,024 values rendered as the route renders it in each
encoding (``pooling_answer``, then ``embeddings.rendered``), one torch thread; seconds (median of 3), the speed-up over
``float``, the body's MiB. Run: ``PYTHONPATH=. python scripts/pooling_encoding_sizes.py``."""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch

from engine.sampling_params import SamplingParams
from kvload.serve.embeddings import rendered
from kvload.serve.pooled_encoding import Encoding
from kvload.serve.pooling import PoolingJob, pooling_answer

torch.set_num_threads(1)
STATE = SimpleNamespace(model_name="m")
ROWS = torch.randn(8192, 1024)
CASES = [("float", Encoding()), ("base64 float32", Encoding("base64")),
         ("base64 float16", Encoding("base64", "float16")), ("bytes float32", Encoding("bytes")),
         ("bytes bfloat16", Encoding("bytes", "bfloat16")), ("bytes fp8_e4m3", Encoding("bytes", "fp8_e4m3"))]
times: dict[str, list[float]] = {name: [] for name, _ in CASES}
sizes: dict[str, int] = {}
print("| encoding | s (median) | vs float | MiB |\n|---|--:|--:|--:|")
for _ in range(3):
    for name, enc in CASES:
        job = PoolingJob([[1] * 8192], SamplingParams(max_tokens=1), "token_embed", enc, normalize=False)
        t = time.perf_counter()
        body = rendered(pooling_answer(STATE, job, [ROWS])).body
        times[name].append(time.perf_counter() - t)
        sizes[name] = len(body)
base = statistics.median(times["float"])
for name, _ in CASES:
    m = statistics.median(times[name])
    print(f"| {name} | {m:.3f} | {base / m:.1f}x | {sizes[name] / 2**20:.1f} |")
