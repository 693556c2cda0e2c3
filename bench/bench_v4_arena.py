"""DeepSeek V4 on real pools: split pools against one slab arena (``pool_arena``) at the same budget, side by side.

Run from the repository root::

    python -m bench.bench_v4_arena                       # tiny-deepseek-v4, budgets of 12 and 48 slabs
    python -m bench.bench_v4_arena --slabs 8,16 --repeats 5

At each budget (``--slabs`` slabs of the model's largest page, given as ``max_gpu_total_bytes``) two ``kvload.LLM``
are loaded, ``pool_arena`` false and true, and the same ``--prompts`` prompts (lengths spread over ``--lengths``,
seeded random ids, greedy, ``--new-tokens`` each, prefix reuse off so every repeat computes every prompt) run
through one ``generate`` call, the two alternated call by call (drift on a shared machine hits both alike), one torch
thread. Prints per budget and mode: the pools' bytes (the tensors' storage, measured), steps, preemptions, the median
wall and calling-thread CPU time of ``--repeats`` calls after a warm-up, and whether the arena's tokens are the split's.
"""

from __future__ import annotations

import argparse

import torch

import kvload

try:
    from bench.common import Timings, machine
except ImportError:  # run as a script: this script's folder is on the path, not its root
    from common import Timings, machine  # type: ignore[no-redef]


def pool_bytes(llm: kvload.LLM) -> int:
    """Bytes of the KV tensors' storage, each storage counted once (a slab arena: its one tensor)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in llm.result.kv_manager.pools.tensors.values()}
    return sum(storages.values())


def main(argv: list[str] | None = None) -> None:
    """Run both modes at every budget and print one line each."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-deepseek-v4")
    p.add_argument("--slabs", default="12,48", help="comma-separated budgets, in slabs of the largest page")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--lengths", default="300,601", metavar="LO,HI")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    try:
        budgets = [int(x) for x in args.slabs.split(",")]
        lo, hi = (int(x) for x in args.lengths.split(","))
    except ValueError:
        p.error(f"--slabs and --lengths: expected comma-separated integers, got {args.slabs!r}, {args.lengths!r}")
    if min(budgets) < 1 or not 1 <= lo <= hi or args.repeats < 1 or args.prompts < 1:
        p.error("--slabs, --lengths, --prompts and --repeats take integers >= 1 (LO <= HI)")
    torch.set_num_threads(1)
    print(f"machine: {machine()}", flush=True)
    import pipeline

    plan = pipeline.plan(args.model, log=False, device="cpu", max_seq_len=args.max_seq_len,
                         kv_cache_config={"max_tokens": args.max_seq_len})
    slab = max(g.bytes_per_block for g in plan.kv.layout.groups)  # a slab: the largest page
    for slabs in budgets:
        llms: dict[bool, kvload.LLM] = {}
        try:
            for arena in (False, True):
                kv = {"max_gpu_total_bytes": slabs * slab, "pool_arena": arena, "enable_block_reuse": False}
                llms[arena] = kvload.LLM(args.model, kv_cache_config=kv, max_seq_len=args.max_seq_len, log=False)
            vocab = llms[False].result.hf_model.config.vocab_size
            gen = torch.Generator().manual_seed(0)
            step = (hi - lo) / max(1, args.prompts - 1)
            prompts = [torch.randint(3, vocab, (round(lo + i * step),), generator=gen).tolist()
                       for i in range(args.prompts)]
            params = kvload.SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
            times = {arena: Timings() for arena in llms}
            tokens: dict[bool, list[list[int]]] = {}
            for arena, llm in llms.items():  # warm-up
                tokens[arena] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
            for _ in range(args.repeats):
                for arena, llm in llms.items():
                    times[arena].add(lambda llm=llm, ps=prompts, sp=params: llm.generate(ps, sp, use_tqdm=False))
            for arena, llm in llms.items():
                stats = llm.result.executor.last_stats
                print(f"{slabs} slabs ({slabs * slab:,} B budget), {'arena' if arena else 'split'}: pools "
                      f"{pool_bytes(llm):,} B, {stats.steps} steps, {stats.preemptions} preemptions, "
                      f"{times[arena].wall:.3f} s wall, {times[arena].cpu:.3f} s thread CPU (medians of "
                      f"{args.repeats}; CPU runs {', '.join(f'{c:.3f}' for c in times[arena].cpus)})", flush=True)
            print(f"{slabs} slabs: arena / split thread CPU {times[True].cpu / times[False].cpu:.2f}x; tokens equal: "
                  f"{tokens[True] == tokens[False]}", flush=True)
        finally:
            for llm in llms.values():
                llm.close()


if __name__ == "__main__":
    main()
