"""Small-batch projections on CPU: torch's ``F.linear`` against kvload's kernel (``linear_backend: cpu_kernel``).

Run from the repository root::

    python -m bench.bench_linear                          # SmolLM2-135M's shapes, 1-32 rows, one thread
    python -m bench.bench_linear --rows 1,8 --threads 2 --shape llama-1b

One point = every projection of the model's layers (q, k, v, o, gate, up, down; each layer its own weights, so
the pass streams them from memory as a decode step does) and then its LM head, for ``rows`` rows of input: a
decode step of ``rows`` sequences. Both sides multiply the same float32 tensors, interleaved in one process;
medians of ``--reps`` passes of the calling thread's CPU time (``--threads 1``: all of the work; with more
threads, wall time is reported instead). ``x`` = torch / kernel: > 1 means the kernel is faster. The kernel
takes the row counts in ``models.small_linear.ROWS`` for its build inside kvload; this bench times every row
count asked for, so the table shows where that range comes from.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

#: name -> (hidden, intermediate, layers, q heads x head_dim, kv heads x head_dim, vocab)
SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "smollm2-135m": (576, 1536, 30, 576, 192, 49152),
    "llama-1b": (2048, 8192, 16, 2048, 512, 128256),
    "tiny": (40, 72, 2, 40, 24, 300),  # the tests' smoke run: every dimension past whole vectors
}


def model_weights(shape: str, seed: int = 0) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """Random float32 weights of ``shape``'s projections, ``[out, in]`` as ``nn.Linear`` stores them."""
    hidden, inter, layers, q, kv, vocab = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    dims = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inter, hidden), (inter, hidden), (hidden, inter)]
    weights = [[torch.randn(n, k, generator=gen) / k ** 0.5 for n, k in dims] for _ in range(layers)]
    return weights, torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5


def one_pass(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], weights: list[list[torch.Tensor]],
             head: torch.Tensor, rows: int, clock: Callable[[], float]) -> tuple[float, float]:
    """(layers, head) seconds of one pass of ``fn`` over every weight at ``rows`` rows."""
    inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for layer in weights for w in layer}}
    start = clock()
    for layer in weights:
        for w in layer:
            fn(inputs[w.shape[1]], w)
    mid = clock()
    fn(inputs[head.shape[1]], head)
    return mid - start, clock() - mid


def main(argv: list[str] | None = None) -> None:
    """Parse flags, time both sides at every row count, print a table."""
    from models.gguf_cache import cache_root
    from models.small_linear import ISA_NAMES, load_small_linear

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--rows", default="1,2,4,8,12,16,32", help="comma-separated row counts (sequences in a step)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the kernel uses as many)")
    p.add_argument("--reps", type=int, default=7, help="passes per side and row count (median)")
    p.add_argument("--kernel-cache", type=Path, default=None, help="where the kernel is built (default: kvload's)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernel = load_small_linear(args.kernel_cache or cache_root() / "kernels")
    weights, head = model_weights(args.shape)
    sides: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "torch": lambda x, w: F.linear(x, w), "kernel": lambda x, w: kernel(x, w)}
    for rows in (int(r) for r in args.rows.split(",")):  # the two sides agree before either is timed
        x = torch.randn(rows, head.shape[1])
        torch.testing.assert_close(kernel(x, head), F.linear(x, head), rtol=1e-4, atol=1e-4)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(f"{args.shape} projections, float32, {args.threads} thread(s), {ISA_NAMES.get(kernel.isa)} build "
          f"(kvload routes {kernel.rows[0]}-{kernel.rows[1]} rows to it)" if kernel.rows else
          f"{args.shape} projections, {args.threads} thread(s): this build serves no row count")
    print(f"ms per pass ({'thread CPU' if args.threads == 1 else 'wall'}), median of {args.reps}")
    print(f"{'rows':>5} {'torch_layers':>12} {'kernel_layers':>13} {'x':>5} {'torch_head':>10} {'kernel_head':>11} "
          f"{'x':>5} {'x_all':>6}")
    for rows in (int(r) for r in args.rows.split(",")):
        for side in sides.values():  # warm-up
            one_pass(side, weights, head, rows, clock)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
        for _ in range(args.reps):
            for name, side in sides.items():
                times[name].append(one_pass(side, weights, head, rows, clock))
        med = {name: (statistics.median(a for a, _ in t) * 1e3, statistics.median(b for _, b in t) * 1e3,
                      statistics.median(a + b for a, b in t) * 1e3) for name, t in times.items()}
        (tl, th, ta), (kl, kh, ka) = med["torch"], med["kernel"]
        print(f"{rows:>5} {tl:>12.1f} {kl:>13.1f} {tl / kl:>5.2f} {th:>10.1f} {kh:>11.1f} {th / kh:>5.2f} "
              f"{ta / ka:>6.2f}")


if __name__ == "__main__":
    main()
