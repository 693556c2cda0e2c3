"""The simulator targets: reuse overhead on no-reuse, V2's hit rate on shared-prefix, Gemma 3 concurrency.

Run from the repository root (one thread is enough: nothing here uses torch kernels)::

    python -m bench.bench_simulate            # full-size workloads, several repeats (a few minutes)
    python -m bench.bench_simulate --quick    # smaller workloads, fewer repeats

1. ``no-reuse`` (512 requests) on tiny-llama with V2, prefix reuse on against off, at the default
   budget (the steady-state working set; the pool fills with cached blocks, so reuse also pays for
   evictions): median step time (manager + scheduler, this thread's CPU time), pairs interleaved,
   order alternating; the ratio is the median of the per-pair ratios.
2. ``shared-prefix`` (1,024 requests) on tiny-llama, V1 and V2 at three budgets: the default (257
   sequences), one that holds the working set (131,072 tokens: the ~104k tokens in use at the peak,
   plus 25%) and a tight one (65,536 tokens); hit rate against the ideal, for seeds 0, 1 and 2.
3. ``long-context`` (16 requests of 7,936 + 256 tokens) on tiny-gemma3 at the default budget (two
   8,192-token sequences in V1's layout): concurrency of V2 over V1 (seeds 0, 1, 2), with the
   plan's prediction (``plan --compare``).
"""

from __future__ import annotations

import argparse
import os

from bench.common import Table, median, ratio, thread_cpu_step_clock, us, verdict
from engine.simulator import simulate
from engine.workloads import make_workload

CPU = {"device": "cpu", "log": False, "progress": False}
OVERHEAD_TARGET = 0.10
HIT_TARGET = 0.95
CONCURRENCY_TARGET = 3.0


def reuse_overhead(quick: bool) -> Table:
    """Target 1: V2 step time with prefix reuse on vs off on no-reuse."""
    pairs = 3 if quick else 7
    wl = make_workload("no-reuse", 128 if quick else None, 0)
    cmd = ("python -m kvload.cli simulate tiny-llama --workload no-reuse --use_kv_cache_manager_v2 true "
           "[--disable_kv_cache_reuse] --json" + (" --requests 128" if quick else ""))
    runs: dict[bool, list] = {True: [], False: []}
    with thread_cpu_step_clock():  # step times in this thread's CPU time: other jobs' time slices do not count
        for i in range(pairs):
            for reuse in ((True, False) if i % 2 == 0 else (False, True)):
                kv = {"use_kv_cache_manager_v2": True, "enable_block_reuse": reuse}
                report = simulate("tiny-llama", wl, kv_cache_config=kv, **CPU)
                runs[reuse].append(report.results["KVCacheManagerV2"].metrics)
    table = Table(f"Target: V2 prefix-reuse bookkeeping on no-reuse ({len(wl.requests)} requests, "
                  f"{pairs} interleaved pairs)", cmd,
                  ["V2 prefix reuse", "step µs (median)", "step µs (p99)", "step µs (mean)", "evictions",
                   "hit rate"])
    for reuse in (False, True):
        ms = runs[reuse]
        table.rows.append(["on" if reuse else "off", us(median([m.step_time_us_median for m in ms])),
                           us(median([m.step_time_us_p99 for m in ms])), us(median([m.step_time_us_mean for m in ms])),
                           f"{ms[0].evictions:,}", f"{ms[0].hit_rate:.2%}"])
    per_pair = [on.step_time_us_median / off.step_time_us_median - 1 for on, off in zip(runs[True], runs[False],
                                                                                        strict=True)]
    mean_pair = [on.step_time_us_mean / off.step_time_us_mean - 1 for on, off in zip(runs[True], runs[False],
                                                                                     strict=True)]
    overhead = median(per_pair)
    table.notes.append(f"Overhead of reuse on vs off, median step time (thread CPU): {overhead:+.1%} (per pair: "
                       + ", ".join(f"{x:+.1%}" for x in per_pair) + f"); mean step time: {median(mean_pair):+.1%}. "
                       f"Target under {OVERHEAD_TARGET:.0%}: {verdict(overhead < OVERHEAD_TARGET)}.")
    return table


def shared_prefix_hits(quick: bool) -> Table:
    """Target 2: V2's hit rate on shared-prefix against the ideal, at three budgets."""
    requests = 256 if quick else 1024
    seeds = (0,) if quick else (0, 1, 2)
    budgets = [("default (257 sequences)", None), ("working set: 131,072 tokens", 131_072),
               ("tight: 65,536 tokens", 65_536)]
    if quick:
        budgets = budgets[:2]
    table = Table(f"Target: hit rate on shared-prefix ({requests} requests, tiny-llama, seeds "
                  + ", ".join(map(str, seeds)) + ")",
                  "python -m kvload.cli simulate tiny-llama --workload shared-prefix --compare [--max_tokens N] "
                  "[--seed S] --json" + (f" --requests {requests}" if quick else ""),
                  ["budget", "manager", "hit rate", "ideal", "hit / ideal", "peak usage", "max concurrency",
                   "waits", "suspends", "steps", "step µs (median)"])
    v2_ratios = {}
    for label, max_tokens in budgets:
        per: dict[str, list] = {}
        for seed in seeds:
            wl = make_workload("shared-prefix", requests, seed)
            kv = {"max_tokens": max_tokens} if max_tokens else {}
            report = simulate("tiny-llama", wl, compare=True, kv_cache_config=kv, **CPU)
            for name, r in report.results.items():
                per.setdefault(name, []).append(r.metrics)
        for name, ms in per.items():
            rates = [m.hit_rate / m.ideal_hit_rate for m in ms]
            if name == "KVCacheManagerV2":
                v2_ratios[label] = min(rates)
            table.rows.append([label, name, "/".join(f"{m.hit_rate:.2%}" for m in ms), f"{ms[0].ideal_hit_rate:.2%}",
                               f"{min(rates):.3f}", f"{median([m.peak_usage for m in ms]):.1%}",
                               str(median([m.max_concurrency for m in ms])), f"{median([m.waits for m in ms]):,}",
                               str(median([m.suspends for m in ms])), f"{median([m.steps for m in ms]):,}",
                               us(median([m.step_time_us_median for m in ms]))])
    hold = [v for k, v in v2_ratios.items() if not k.startswith("tight")]
    table.notes.append(f"Target: V2 hit rate >= {HIT_TARGET:.0%} of the ideal with a budget that holds the working "
                       f"set: {verdict(min(hold) >= HIT_TARGET)} (worst over seeds: "
                       + ", ".join(f"{k.split(':')[0]} {v:.3f}" for k, v in v2_ratios.items()) + ").")
    table.notes.append("hit rate = reused prompt tokens / prompt tokens (first admission of each request); the ideal "
                       "counts each group's 2,048-token prefix for all but its first prompt. Hit rates per seed are "
                       "listed; counts are deterministic for a seed, step times are medians over the seeds.")
    return table


def gemma_concurrency(quick: bool) -> Table:
    """Target 3: concurrent sequences of V2 over V1 on long-context, Gemma 3 preset, same budget."""
    from engine.capacity import compare_capacity
    from kvload.api import execute, plan_stages
    from pipeline.context import LoadRequest

    seeds = (0,) if quick else (0, 1, 2)
    requests = 12 if quick else 16
    per: dict[str, list] = {}
    budget = None
    for seed in seeds:
        report = simulate("tiny-gemma3", make_workload("long-context", requests, seed), compare=True, **CPU)
        budget = report.budget
        for name, r in report.results.items():
            per.setdefault(name, []).append(r.metrics)
    overrides = {"device": "cpu", "kv_cache_config": {"max_gpu_total_bytes": budget.bytes}}
    plan = execute(LoadRequest("tiny-gemma3", overrides), plan_stages(), log=False)
    predicted = {name: m.max_concurrency(8192) for name, m in compare_capacity(plan).managers.items()}
    table = Table(f"Target: Gemma 3 long-context concurrency ({requests} requests of 8,192 tokens, budget "
                  f"{budget.bytes:,} B = two V1 sequences, seeds " + ", ".join(map(str, seeds)) + ")",
                  "python -m kvload.cli simulate tiny-gemma3 --workload long-context --compare [--seed S] --json"
                  + (f" --requests {requests}" if quick else ""),
                  ["manager", "max concurrency", "mean concurrency", "planned sequences of 8,192", "steps",
                   "suspends", "waits", "peak usage", "step µs (median)"])
    for name, ms in per.items():
        table.rows.append([name, str(median([m.max_concurrency for m in ms])),
                           f"{median([m.mean_concurrency for m in ms]):.2f}", str(predicted[name]),
                           f"{median([m.steps for m in ms]):,}", str(median([m.suspends for m in ms])),
                           f"{median([m.waits for m in ms]):,}", f"{median([m.peak_usage for m in ms]):.1%}",
                           us(median([m.step_time_us_median for m in ms]))])
    v1, v2 = per["KVCacheManager"], per["KVCacheManagerV2"]
    max_ratio = median([b.max_concurrency / a.max_concurrency for a, b in zip(v1, v2, strict=True)])
    mean_ratio = median([b.mean_concurrency / a.mean_concurrency for a, b in zip(v1, v2, strict=True)])
    steps_ratio = median([a.steps / b.steps for a, b in zip(v1, v2, strict=True)])
    table.notes.append(f"V2 / V1: max concurrency {ratio(max_ratio)}, mean concurrency {ratio(mean_ratio)}, "
                       f"finishes in {ratio(steps_ratio)} fewer steps; the plan predicts "
                       f"{ratio(predicted['KVCacheManagerV2'] / predicted['KVCacheManager'])} for whole 8,192-token "
                       f"sequences. Target >= {CONCURRENCY_TARGET:.0f}x: {verdict(max_ratio >= CONCURRENCY_TARGET)}.")
    table.notes.append("V1 keeps all 6 layers x 8,192 tokens per sequence; V2 keeps the full layer's 8,192 tokens plus "
                       "five 512-token windows (17 blocks each). Max concurrency counts requests holding blocks after "
                       "a step's scheduling; V2 admits greedily and suspends to the host tier under pressure.")
    return table


def reuse_cost_breakdown(quick: bool) -> Table:
    """Where reuse's extra step time goes: cProfile of ``Driver.step`` on no-reuse, reuse on minus off, by function.

    Profiling inflates small calls, so the table gives each function's share of the difference,
    not absolute times. Each setting is profiled 3 times (1 with ``quick``), alternating, after a
    full collection, and each function's own time is the median over its runs: one run's garbage
    collection pause, charged to whatever allocated at the time, cannot swing the table.
    """
    import cProfile
    import gc
    import pstats

    import engine.driver as driver_module

    wl = make_workload("no-reuse", 128 if quick else None, 0)
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    original = driver_module.Driver.step
    repeats = 1 if quick else 3
    for reuse in [r for i in range(repeats) for r in ((True, False) if i % 2 == 0 else (False, True))]:
        gc.collect()
        prof = cProfile.Profile()

        def step(self, compute, _prof=prof):
            _prof.enable()
            try:
                return original(self, compute)
            finally:
                _prof.disable()

        driver_module.Driver.step = step
        try:
            simulate("tiny-llama", wl, kv_cache_config={"use_kv_cache_manager_v2": True,
                                                        "enable_block_reuse": reuse}, **CPU)
        finally:
            driver_module.Driver.step = original
        stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, ncalls, tottime, cumtime, callers)
        own: dict[str, float] = {}
        for (file, _line, name), row in stats.items():
            key = f"{os.path.basename(file)}:{name}" if file != "~" else name
            own[key] = own.get(key, 0.0) + row[2]
        runs[reuse].append(own)
    names = {k for r in runs[True] + runs[False] for k in r}
    diff = {k: median([r.get(k, 0.0) for r in runs[True]]) - median([r.get(k, 0.0) for r in runs[False]])
            for k in names}
    total = sum(diff.values())
    table = Table("Where prefix reuse's extra manager time goes on no-reuse (V2, profiled)",
                  "python -m bench.bench_simulate --only breakdown" + (" --quick" if quick else ""),
                  ["function (own time)", "share of the extra time"])
    for key, value in sorted(diff.items(), key=lambda kv: -kv[1])[:12]:
        table.rows.append([f"`{key}`", f"{value / total:.1%}"])
    table.notes.append(f"Own (exclusive) time under cProfile, reuse on minus reuse off, over every engine step, "
                       f"median of {repeats} alternating run(s) per setting; profiling inflates per-call costs, so "
                       f"read shares, not microseconds" + ("." if total > 0 else
                                                          "; the runs did not resolve a positive difference (noise)."))
    return table


def run(quick: bool = False) -> list[Table]:
    """The three target tables and the overhead breakdown."""
    return [reuse_overhead(quick), reuse_cost_breakdown(quick), shared_prefix_hits(quick), gemma_concurrency(quick)]


def main(argv: list[str] | None = None) -> None:
    """Print the tables as markdown."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller workloads, fewer repeats")
    p.add_argument("--only", choices=("overhead", "breakdown", "hits", "concurrency"), help="run one part")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    fns = {"overhead": reuse_overhead, "breakdown": reuse_cost_breakdown, "hits": shared_prefix_hits,
           "concurrency": gemma_concurrency}
    for name, fn in fns.items():
        if args.only in (None, name):
            print(fn(args.quick).markdown())


if __name__ == "__main__":
    main()
