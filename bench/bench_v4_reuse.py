"""DeepSeek V4 prefix reuse: a multi-turn conversation and prompts sharing a long prefix on tiny-deepseek-v4.

Run from the repository root::

    python -m bench.bench_v4_reuse                      # reuse on (the preset's defaults)
    python -m bench.bench_v4_reuse --no-reuse           # kv_cache_config.enable_block_reuse: false

``multi-turn``: ``--turns`` calls, each one request whose prompt is the previous prompt, its answer and
``--turn-tokens`` new tokens (the first: a ``--prefix``-token system prompt); ``shared-prefix``: ``--requests``
calls, one request each, a ``--prefix``-token prefix then ``--turn-tokens`` tokens of its own. Greedy, ``--new-tokens``
generated per request, one thread. Prints, per workload, the prompt tokens, how many of them were reused from the
prefix cache (``GenerationStats``), and the wall and calling-thread CPU time of all its calls (``time.thread_time``:
with one torch thread the model computes on it, so other processes on a shared machine barely move it; medians of
``--repeats``, each on a fresh prefix cache). Token ids are seeded random: what the text says does not change the cost.
"""

from __future__ import annotations

import argparse

import torch

import kvload
from bench.common import repeat_timed


def ids(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    """``n`` random token ids clear of the usual special ids."""
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


def multi_turn(llm: kvload.LLM, args: argparse.Namespace, vocab: int) -> tuple[int, int]:
    """One conversation: (prompt tokens, reused prompt tokens) over its turns."""
    gen = torch.Generator().manual_seed(1)
    prompt = ids(gen, args.prefix, vocab)
    params = kvload.SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    total = reused = 0
    for _ in range(args.turns):
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        total += len(prompt)
        reused += out.num_cached_tokens
        prompt = prompt + list(out.outputs[0].token_ids) + ids(gen, args.turn_tokens, vocab)
    return total, reused


def shared_prefix(llm: kvload.LLM, args: argparse.Namespace, vocab: int) -> tuple[int, int]:
    """Requests one after another sharing a prefix: (prompt tokens, reused prompt tokens)."""
    gen = torch.Generator().manual_seed(2)
    prefix = ids(gen, args.prefix, vocab)
    params = kvload.SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    total = reused = 0
    for _ in range(args.requests):
        prompt = prefix + ids(gen, args.turn_tokens, vocab)
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        total += len(prompt)
        reused += out.num_cached_tokens
    return total, reused


def main() -> None:
    """Run both workloads and print one line each."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-deepseek-v4")
    p.add_argument("--no-reuse", action="store_true", help="kv_cache_config.enable_block_reuse: false")
    p.add_argument("--prefix", type=int, default=1024, help="system prompt / shared prefix tokens")
    p.add_argument("--turn-tokens", type=int, default=64, help="new tokens each turn / request adds")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    kv = {"max_tokens": 16384, "enable_block_reuse": not args.no_reuse}
    llm = kvload.LLM(args.model, kv_cache_config=kv, max_seq_len=4096, log=False)
    try:
        vocab = llm.result.hf_model.config.vocab_size
        for name, run in (("multi-turn", multi_turn), ("shared-prefix", shared_prefix)):
            times, (total, reused) = repeat_timed(  # each on a fresh prefix cache, after one warm-up
                lambda run=run: run(llm, args, vocab), args.repeats, warmups=1,
                before=None if args.no_reuse else llm.reset_prefix_cache)
            print(f"{name}: {'reuse off' if args.no_reuse else 'reuse on'}: {reused}/{total} prompt tokens reused, "
                  f"{times.wall:.2f} s wall, {times.cpu:.2f} s thread CPU "
                  f"(medians of {args.repeats})", flush=True)
    finally:
        llm.close()


if __name__ == "__main__":
    main()
