"""DeepSeek V4 prefill: several prompts' prefill chunks in one step, on tiny-deepseek-v4.

Run from the repository root (or with ``PYTHONPATH`` on another tree, to measure that tree's kvload: the script
imports only ``kvload``, ``torch`` and its own ``bench/common.py``)::

    python -m bench.bench_v4_prefill                          # 8 prompts of 300..601 tokens, one step each chunk
    python -m bench.bench_v4_prefill --max-num-tokens 1024    # chunked: steps mix several prompts' chunks
    python bench/bench_v4_prefill.py --profile 25             # cProfile of one generate, the top 25 by own time
    python -m bench.bench_v4_prefill --against ../base        # A/B in one process against another tree's forward

``--prompts`` prompts of lengths spread evenly over ``--lengths LO,HI`` (seeded random ids), one ``generate`` call,
greedy, ``--new-tokens`` each (few: prefill dominates), prefix reuse off (every repeat computes every prompt), one
torch thread. Prints the median wall and calling-thread CPU time (``time.thread_time``: with one torch thread the model
computes on it, so other processes on a shared machine barely move it) of ``--repeats`` generates after a warm-up, and
the steps taken. ``--against TREE`` loads ``TREE/models/deepseek_v4_paged.py`` beside this tree's and alternates
the two forwards generate by generate in one process (on a shared machine drift then hits both alike), printing both
medians and their ratio.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import pstats
import sys
from pathlib import Path

import torch

import kvload

try:
    from bench.common import Timings, repeat_timed
except ImportError:  # run as a script on another tree's PYTHONPATH: this script's folder is on the path, not its root
    from common import Timings, repeat_timed  # type: ignore[no-redef]


def main(argv: list[str] | None = None) -> None:
    """Time the prefill-heavy generate and print one line (or a profile)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-deepseek-v4")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--lengths", default="300,601", metavar="LO,HI", help="shortest and longest prompt")
    p.add_argument("--new-tokens", type=int, default=2)
    p.add_argument("--max-num-tokens", type=int, default=8192, help="most tokens in one forward (chunked prefill)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="profile one generate; print the top N")
    p.add_argument("--against", default="", metavar="TREE", help="alternate with TREE's DeepSeek V4 forward")
    args = p.parse_args(argv)
    try:
        lo, hi = (int(x) for x in args.lengths.split(","))
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        p.error(f"--lengths: expected LO,HI, two integers with 1 <= LO <= HI, got {args.lengths!r}")
    for flag in ("prompts", "new_tokens", "max_num_tokens", "repeats"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: expected an integer >= 1, got {getattr(args, flag)}")
    against = Path(args.against) / "models" / "deepseek_v4_paged.py"
    if args.against and not against.is_file():
        p.error(f"--against: {args.against} has no models/deepseek_v4_paged.py (expected a kvload tree)")
    torch.set_num_threads(1)
    kv = {"max_tokens": 16384, "enable_block_reuse": False}
    llm = kvload.LLM(args.model, kv_cache_config=kv, max_seq_len=1024, max_num_tokens=args.max_num_tokens, log=False)
    try:
        vocab = llm.result.hf_model.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        step = (hi - lo) / max(1, args.prompts - 1)
        prompts = [torch.randint(3, vocab, (round(lo + i * step),), generator=gen).tolist()
                   for i in range(args.prompts)]
        params = kvload.SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            llm.generate(prompts, params, use_tqdm=False)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
            return
        if args.against:
            here = sys.modules["models.deepseek_v4_paged"]
            spec = importlib.util.spec_from_file_location("v4_against", against)
            other = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(other)
            forwards = {"this": here.paged_v4_forward, "against": other.paged_v4_forward}
            times = {name: Timings() for name in forwards}
            try:
                for _ in range(args.repeats):
                    for name, forward in forwards.items():
                        here.paged_v4_forward = forward  # what the routed modules' forward calls
                        times[name].add(lambda: llm.generate(prompts, params, use_tqdm=False))
            finally:
                here.paged_v4_forward = forwards["this"]
            this, against = (times[name].cpu for name in forwards)
            print(f"prefill: {args.prompts} prompts of {lo}..{hi} tokens, max_num_tokens {args.max_num_tokens}: thread "
                  f"CPU {this:.3f} s (this tree) vs {against:.3f} s ({args.against}): {this / against:.2f}x (medians "
                  f"of {args.repeats}, alternated)", flush=True)
            return
        times, _ = repeat_timed(lambda: llm.generate(prompts, params, use_tqdm=False), args.repeats)
        steps = llm.result.executor.last_stats.steps
        tree = sys.modules["models.deepseek_v4_paged"].__file__.rsplit("/models/", 1)[0]
        print(f"{tree}: prefill: {args.prompts} prompts of {lo}..{hi} tokens, max_num_tokens {args.max_num_tokens}, "
              f"{steps} steps: {times.wall:.3f} s wall, {times.cpu:.3f} s thread CPU "
              f"(medians of {args.repeats}; CPU runs {', '.join(f'{c:.3f}' for c in times.cpus)})", flush=True)
    finally:
        llm.close()


if __name__ == "__main__":
    main()
