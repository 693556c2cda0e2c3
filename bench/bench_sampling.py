"""What vLLM's penalties, ``min_tokens`` and ``logit_bias`` add to a decode step's sampling (``engine.penalties``).

Run from the repository root::

    python -m bench.bench_sampling               # SmolLM2's vocabulary (49,152), batch 1 / 8 / 32

Each row times one step's pick for ``batch`` decoding requests (512 prompt + 128 output tokens each), as the
executor does it: ``penalize`` then greedy argmax, against the argmax alone; this thread's CPU time, median of
``--repeats`` interleaved rounds. A request's counts are kept between steps, so a step pays O(vocab) per row
whatever the history's length; the first step of a request (its prompt mask) is timed apart.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import machine
from cache_backends.request import Request
from engine.penalties import penalize
from engine.sampling_params import SamplingParams

SETTINGS = {
    "none": SamplingParams(),
    "repetition_penalty": SamplingParams(repetition_penalty=1.2),
    "presence + frequency": SamplingParams(presence_penalty=0.5, frequency_penalty=0.3),
    "all + min_tokens + logit_bias (100)": SamplingParams(
        max_tokens=4096, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=2000,
        logit_bias={t: -5.0 for t in range(100)}),
}


def _requests(batch: int, vocab: int, gen: torch.Generator) -> list[Request]:
    reqs = []
    for b in range(batch):
        r = Request(f"r{b}", torch.randint(0, vocab, (512,), generator=gen).tolist(), 4096)
        r.output_token_ids.extend(torch.randint(0, vocab, (128,), generator=gen).tolist())
        reqs.append(r)
    return reqs


def step_us(params: SamplingParams, logits: torch.Tensor, reqs: list[Request]) -> float:
    """One step's pick (penalize + argmax), µs of this thread's CPU; the requests gain their token."""
    t0 = time.thread_time()
    picks = penalize(logits, [1] * len(reqs), [(params, r) for r in reqs], frozenset({2}))
    tokens = picks.argmax(dim=-1).tolist()
    spent = (time.thread_time() - t0) * 1e6
    for r, t in zip(reqs, tokens, strict=True):
        r.output_token_ids.append(t)
    return spent


def main(argv: list[str] | None = None) -> None:
    """Print one markdown row per setting and batch."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=49_152)
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"machine: {machine()}")
    print("| batch | setting | first step µs | step µs (median) | over argmax alone |")
    print("|--:|---|--:|--:|--:|")
    for batch in (1, 8, 32):
        logits = torch.randn(batch, args.vocab, generator=gen)
        reqs = {name: _requests(batch, args.vocab, gen) for name in SETTINGS}
        first = {name: step_us(params, logits, reqs[name]) for name, params in SETTINGS.items()}
        times: dict[str, list[float]] = {name: [] for name in SETTINGS}
        for _ in range(args.repeats):  # interleaved: every setting sees the same machine
            for name, params in SETTINGS.items():
                times[name].append(step_us(params, logits, reqs[name]))
        base = statistics.median(times["none"])
        for name in SETTINGS:
            med = statistics.median(times[name])
            print(f"| {batch} | {name} | {first[name]:.0f} | {med:.0f} | {med / base:.1f}x |")


if __name__ == "__main__":
    main()
