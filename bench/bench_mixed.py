"""V1 vs V2 on the ``mixed`` workload over many seeds: does V2 keep its lead on traffic it was not tuned to?

Run from the repository root (nothing here runs torch kernels)::

    python -m bench.bench_mixed                        # 4 presets x 3 budgets x 8 seeds, fcfs
    python -m bench.bench_mixed --seeds 4 --presets tiny-gemma3 --budgets default
    python -m bench.bench_mixed --urgent 25 --policy priority   # a quarter urgent, scheduled by priority

Each cell is ``kvload simulate PRESET --workload mixed --seed S --compare`` at a budget relative to the workload's
default (``default``; ``tight`` a quarter of it; ``half``). Steps, hit rate and computed tokens are deterministic
(decisions, not time), so one run per cell says it. Per preset and budget: V2/V1 steps and computed tokens (medians
over the seeds), hit rates (means), and how many seeds V2 took more steps or reached a lower hit rate than V1.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from bench.bench_grid import CPU
from bench.common import Table, machine

PRESETS = ("tiny-llama", "tiny-mistral", "tiny-gemma3", "tiny-deepseek-v3")
BUDGETS = {"tight": 0.25, "half": 0.5, "default": 1.0}


def cell(preset: str, seed: int, fraction: float, urgent: int, policy: str) -> tuple:
    """(V1 metrics, V2 metrics) of one seed of ``mixed`` at ``fraction`` of its default budget."""
    from engine.simulator import simulate
    from engine.workloads import make_workload

    wl = make_workload("mixed", None, seed, urgent_percent=urgent)
    base = simulate(preset, wl, kv_cache_config={"use_kv_cache_manager_v2": False}, **CPU).budget.bytes
    kv = {"max_gpu_total_bytes": int(base * fraction)}
    report = simulate(preset, wl, compare=True, kv_cache_config=kv, scheduling_policy=policy, **CPU)
    return tuple(report.results[n].metrics for n in ("KVCacheManager", "KVCacheManagerV2"))


def main(argv: list[str] | None = None) -> None:
    """Print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--budgets", default=",".join(BUDGETS))
    p.add_argument("--urgent", type=int, default=0, help="urgent_percent of the workload")
    p.add_argument("--policy", default="fcfs", choices=("fcfs", "priority"))
    args = p.parse_args(argv)
    command = "python -m bench.bench_mixed " + " ".join(argv if argv is not None else sys.argv[1:])
    table = Table(f"V1 vs V2 on mixed traffic ({args.seeds} seeds, urgent_percent={args.urgent}, "
                  f"scheduling_policy={args.policy})", command.strip(),
                  ["preset", "budget", "V2/V1 steps", "V2/V1 computed tokens", "hit V1 / V2", "seeds V2 more steps",
                   "seeds V2 lower hit", "urgent delay V1 / V2"])
    table.notes.append("lower hit: V2's hit rate more than 0.5 points under V1's on that seed; steps and hit rates are "
                       "decisions, the same on any machine")
    for preset in args.presets.split(","):
        for budget in args.budgets.split(","):
            rows = [cell(preset, s, BUDGETS[budget], args.urgent, args.policy) for s in range(args.seeds)]
            if any(a is None or b is None for a, b in rows):
                table.rows.append([preset, budget, "stalled", "-", "-", "-", "-", "-"])
                continue
            steps = statistics.median(b.steps / a.steps for a, b in rows)
            computed = statistics.median(b.computed_tokens / a.computed_tokens for a, b in rows)
            hit1 = statistics.fmean(a.hit_rate for a, _ in rows)
            hit2 = statistics.fmean(b.hit_rate for _, b in rows)
            worse_steps = sum(b.steps > a.steps for a, b in rows)
            worse_hit = sum(b.hit_rate < a.hit_rate - 0.005 for a, b in rows)
            delay = (f"{statistics.fmean(a.admission_delay_top_mean for a, _ in rows):.1f} / "
                     f"{statistics.fmean(b.admission_delay_top_mean for _, b in rows):.1f}") if args.urgent else "-"
            table.rows.append([preset, budget, f"{steps:.2f}x", f"{computed:.3f}x", f"{hit1:.1%} / {hit2:.1%}",
                       f"{worse_steps} of {len(rows)}", f"{worse_hit} of {len(rows)}", delay])
    print(table.markdown())
    print(f"machine: {machine()}")


if __name__ == "__main__":
    main()
