"""Beam search: kvload's ``beam_search`` (beams kept as running requests, forked) against the per-step calls it
replaced and transformers' ``model.generate(num_beams=...)``, side by side in one run.

Run from the repository root::

    python -m bench.bench_beam_search                    # SmolLM2-135M, float32, CPU, one thread: 64 + 4 x 16
    python -m bench.bench_beam_search --beams 4 --new-tokens 32 --prompt-len 200 --repeats 5
    python -m bench.bench_beam_search --model tiny-llama --tokens-per-block 16

Sides, interleaved each repeat after one warm-up each, on one load (V1, where ``max_beam_width > 1`` routes):

* ``kvload beam_search``: ``executor.beam_search`` — each prompt prefills once, each live beam is a running request,
  a new beam forks its parent at its length (whole pages shared, the partial last one copied), so a step computes
  one token per live beam;
* ``kvload per-step calls``: the algorithm ``beam_search`` ran before (session 6), reproduced here: one
  ``executor.run`` per token for every live beam, each re-admitting the beam's sequence through the prefix cache
  (V1 caches whole pages only: each beam's last partial page is computed again every step);
* ``transformers num_beams``: ``model.generate(num_beams=K, num_return_sequences=K)`` without an EOS token.

All three search with ``ignore_eos`` (EOS an ordinary token) from the same seeded token-id prompt, and the run
checks that the three give the same sequences. Times are the calling thread's CPU time (``time.thread_time``; with
one torch thread the work is on that thread, so other jobs on a shared machine barely move it) and wall time,
medians over ``--repeats``. "tokens computed" counts the tokens the engine steps scheduled (the forward's rows):
deterministic. Each kvload repeat uses its own reuse salt, so no repeat reads what another cached.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

import pipeline
from bench.common import machine, timed
from engine.beam_search import BeamSearchParams
from engine.sampling_params import SamplingParams


def hf_beams(model: Any, prompt: list[int], beams: int, new: int) -> list[tuple[int, ...]]:
    """transformers' beam search without an EOS token: its ``beams`` sequences, best first."""
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), num_beams=beams, num_return_sequences=beams, do_sample=False,
                                 max_new_tokens=new, pad_token_id=0, early_stopping=False, length_penalty=1.0)
    finally:
        model.generation_config.eos_token_id = saved
    return [tuple(row[len(prompt):].tolist()) for row in out]


def stepwise_beams(executor: Any, prompt: list[int], beams: int, new: int, salt: str) -> list[tuple[int, ...]]:
    """Session 6's ``beam_search`` (``ignore_eos``, one prompt): one ``executor.run`` per token for every live beam,
    each beam's whole sequence re-admitted through the prefix cache; its sequences, best first."""
    step = SamplingParams._beam_step(2 * beams)
    live: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    for _ in range(new):
        outs = executor.run([prompt + list(tokens) for tokens, _ in live], step, salt=salt)
        cands = []
        for (tokens, cum), out in zip(live, outs, strict=True):
            (first,) = out.outputs[0].logprobs
            cands += [(cum + lp, (*tokens, tok)) for tok, lp in first.items()]
        cands.sort(key=lambda c: -c[0])
        live = [(tokens, cum) for cum, tokens in cands[:beams]]
    return [tokens for tokens, _ in sorted(live, key=lambda h: -h[1] / max(1, len(h[0])))]


def counting(scheduler: Any) -> list[int]:
    """Tokens ``scheduler`` schedules, summed into the returned one-element list (the forward's rows)."""
    total = [0]
    step = scheduler.step

    def counted(waiting: Any, running: Any) -> Any:
        out = step(waiting, running)
        total[0] += out.num_tokens
        return out

    scheduler.step = counted
    return total


def main(argv: list[str] | None = None) -> None:
    """Run the sides and print one markdown table (plus the machine)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="anything kvload generate takes (default smollm2-135m)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens-per-block", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    k, new = args.beams, args.new_tokens
    with pipeline.load(args.model, load_weights=True, device="cpu", dtype=args.dtype, max_beam_width=k, log=False,
                       kv_cache_config={"max_tokens": 8192, "tokens_per_block": args.tokens_per_block}) as result:
        executor, model = result.executor, result.hf_model
        vocab = int(model.config.vocab_size)
        prompt = torch.randint(10, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
        computed = counting(executor.scheduler)
        params = BeamSearchParams(beam_width=k, max_tokens=new, ignore_eos=True)
        runs = 0

        def forked() -> list[tuple[int, ...]]:
            nonlocal runs
            runs += 1
            (out,) = executor.beam_search([prompt], params, salt=f"forked-{runs}")
            return [s.token_ids for s in out.sequences]

        def stepwise() -> list[tuple[int, ...]]:
            nonlocal runs
            runs += 1
            return stepwise_beams(executor, prompt, k, new, salt=f"stepwise-{runs}")

        sides: dict[str, Callable[[], list[tuple[int, ...]]]] = {
            "kvload beam_search (forked beams)": forked, "kvload per-step calls (session 6)": stepwise,
            "transformers num_beams": lambda: hf_beams(model, prompt, k, new)}
        cpu: dict[str, list[float]] = {name: [] for name in sides}
        wall: dict[str, list[float]] = {name: [] for name in sides}
        tokens: dict[str, int] = {}
        want = None
        for repeat in range(args.repeats + 1):  # repeat 0 warms up
            for name, side in sides.items():
                before = computed[0]
                got, w, c = timed(side)
                if want is None:
                    want = got
                if got != want:
                    raise SystemExit(f"{name} found other sequences than the first side: {got} != {want}")
                if repeat:
                    cpu[name].append(c)
                    wall[name].append(w)
                    tokens[name] = computed[0] - before
        hf = statistics.median(cpu["transformers num_beams"])
        print(f"{args.model} {args.dtype}, {k} beams x {new} new tokens, a {args.prompt_len}-token prompt, "
              f"{args.tokens_per_block}-token pages, {args.threads} thread(s), median of {args.repeats}; "
              f"every side's {k} sequences equal\n")
        print("| side | thread CPU (s) | wall (s) | tokens computed | vs transformers (CPU) |")
        print("|---|--:|--:|--:|--:|")
        for name in sides:
            c = statistics.median(cpu[name])
            count = tokens.get(name, 0)
            print(f"| {name} | {c:.3f} | {statistics.median(wall[name]):.3f} | {count if count else '—'} | "
                  f"{hf / c:.2f}x |")
        print("\n" + "; ".join(f"{key}: {value}" for key, value in machine().items()))


if __name__ == "__main__":
    main()
