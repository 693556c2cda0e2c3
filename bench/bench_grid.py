"""The V1-vs-V2 grid: both managers at the same budget over presets x workloads x budgets, one row per cell.

Run from the repository root (one thread is enough: nothing here runs torch kernels)::

    python -m bench.bench_grid            # default workload sizes (what BENCHMARKS.md records; a few minutes)
    python -m bench.bench_grid --quick    # a quarter of the requests, for a smoke run
    python -m bench.bench_grid --presets tiny-gemma3 --workloads no-reuse --budgets default
    python -m bench.bench_grid --only timing   # the step-time target alone (interleaved V1/V2 pairs)
    python -m bench.bench_grid --only arena    # DeepSeek V4: split pools vs one slab arena (pool_arena false/true)
    python -m bench.bench_grid --only arena-slabs --quick   # the same at 1x..8x one max_seq_len sequence's slabs
    python -m bench.bench_grid --only grid --real   # published sliding-window checkpoints' configs (GPT-OSS 20B,
                                                    # Gemma 3 27B, Gemma 2 9B) at GPU-sized budgets: pools unbacked
    python -m bench.bench_grid --only grid --decisions /tmp/grid.jsonl   # also each cell's decisions, one line a
                                                    # cell (no timings): `cmp` two trees' files to see what changed

Each cell is one ``kvload simulate <preset> --workload <w> --compare`` (:func:`engine.simulator.simulate`,
the same replay loop; ``mixed-urgent`` is ``--workload mixed --workload-arg urgent_percent=25 --scheduling_policy
priority``), at three budgets: ``default`` (the simulator's default, sized for the workload in
the routed layout), ``tight`` (a quarter of it) and ``generous`` (four times it), passed to both
managers as ``max_gpu_total_bytes``. Per cell: V2 steps to finish over V1's, each manager's hit rate
against the ideal, mean concurrency, V2's suspends and preemptions, and the step-time ratio (median manager +
scheduler time per engine step, V2 / V1). A manager that cannot run the cell says so (``stalled``:
the budget cannot hold one of the workload's sequences).

Each cell also prices both runs' steps on an H200 (``modeled_seconds``, :mod:`engine.step_model`): a step that prefills
thousands of tokens weighs what it computes, where ``steps`` counts it as one; on published configs (``--real``) the
bracket adds each manager's measured manager + scheduler time, what V2's CPU cost per step amounts to beside a real
model's step.

Targets (issue 10), checked per cell: V2 steps <= 1.02x V1's and V2 hit rate >= V1's - 0.5 points (and, reported
beside it, V2 modeled time <= 1.02x V1's);
sliding-window presets (tiny-mistral, tiny-gemma3) on shared-prefix and multi-turn: V2 hit rate >= 95%
of the ideal; tiny-gemma3 long-context: V2 >= 3x V1's concurrency.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from bench.common import Table, machine, ratio, thread_cpu_step_clock, verdict

PRESETS = ("tiny-llama", "tiny-mistral", "tiny-gemma3", "tiny-deepseek-v3")
#: ``--real``: the published configs of sliding-window checkpoints (tests/data/configs): the real windows (128, 1,024,
#: 4,096) and layer mixes at their own budgets, which the tiny presets only imitate. A simulation builds no pools
#: (``LoadRequest.pools_unbacked``), so their tens of GB run on a CPU box.
REAL = ("tests/data/configs/gpt-oss-20b", "tests/data/configs/gemma-3-27b-it", "tests/data/configs/gemma-2-9b-it")
WORKLOADS = ("shared-prefix", "multi-turn", "long-context", "no-reuse", "mixed", "mixed-urgent")
#: Grid workloads that are a simulator workload with other arguments: ``mixed-urgent`` is ``mixed`` with a quarter of
#: the requests urgent, scheduled by ``scheduling_policy=priority`` (the policy decides who is moved out, and the
#: eviction order sees the priorities: what fcfs cells cannot show).
VARIANTS: dict[str, tuple[str, dict[str, int], str]] = {"mixed-urgent": ("mixed", {"urgent_percent": 25}, "priority")}
BUDGETS = {"default": 1.0, "tight": 0.25, "generous": 4.0}
SLIDING = ("tiny-mistral", "tiny-gemma3")
STEPS_TARGET = 1.02
HIT_SLACK = 0.005
SLIDING_HIT_TARGET = 0.95
CONCURRENCY_TARGET = 3.0
CPU = {"device": "cpu", "log": False, "progress": False}


def _cell(preset: str, workload: Any, budget_bytes: int | None, policy: str = "fcfs",
          padding: float | None = None) -> tuple[int, dict[str, Any]]:
    """One ``simulate --compare`` run: (the budget it used, {manager: ManagerResult}); ``padding``: V2's
    ``kv_cache_config.max_page_padding`` (V1 ignores it, with a setting_ignored the quiet log drops)."""
    from engine.simulator import simulate

    kv: dict[str, Any] = {"max_gpu_total_bytes": budget_bytes} if budget_bytes else {}
    if padding is not None:
        kv["max_page_padding"] = padding
    report = simulate(preset, workload, compare=True, kv_cache_config=kv, scheduling_policy=policy, **CPU)
    return report.budget.bytes, report.results


def _hit(m: Any) -> str:
    if m.ideal_hit_rate <= 0:
        return f"{m.hit_rate:.1%}"
    return f"{m.hit_rate:.1%} ({m.hit_rate / m.ideal_hit_rate:.0%})"


def grid(presets: tuple[str, ...] = PRESETS, workloads: tuple[str, ...] = WORKLOADS,
         budgets: tuple[str, ...] = tuple(BUDGETS), quick: bool = False,
         padding: float | None = None) -> tuple[list[dict[str, Any]], Table]:
    """Run the grid: the per-cell records (for checks) and the markdown table (``padding``: every cell with that
    ``kv_cache_config.max_page_padding``)."""
    from engine.workloads import make_workload

    rows: list[dict[str, Any]] = []
    cmd = "python -m bench.bench_grid" + (" --quick" if quick else "") + (" --real" if presets == REAL else "") + (
        f" --max_page_padding {padding}" if padding is not None else "")
    table = Table("V1 vs V2 at the same budget: presets x workloads x budgets", cmd,
                  ["preset", "workload", "budget", "V2/V1 steps", "hit V1 (of ideal)", "hit V2 (of ideal)",
                   "mean conc. V1 / V2", "V2 suspends / preemptions", "V2/V1 step time",
                   "V2/V1 modeled time (+ manager)", "cell target"])
    for preset in presets:
        for name in workloads:
            kind, extra, policy = VARIANTS.get(name, (name, {}, "fcfs"))
            wl = make_workload(kind, None, 0, **extra)
            if quick:
                wl = make_workload(kind, max(4, len(wl.requests) // 4), 0, **extra)
            base: int | None = None
            for label in budgets:
                start = time.perf_counter()
                if label == "default" or base is None:
                    base, default_results = _cell(preset, wl, None, policy, padding)
                results = (default_results if label == "default"
                           else _cell(preset, wl, int(base * BUDGETS[label]), policy, padding)[1])
                row: dict[str, Any] = {"preset": preset, "workload": name, "budget": label}
                v1, v2 = results["KVCacheManager"], results["KVCacheManagerV2"]
                row["status"] = {"v1": v1.status, "v2": v2.status}
                m1, m2 = v1.metrics, v2.metrics
                row["v1"], row["v2"] = m1, m2
                cells = [os.path.basename(preset), name, label]
                if m1 is None or m2 is None:
                    cells += [f"V1 {v1.status} / V2 {v2.status}", _hit(m1) if m1 else "-", _hit(m2) if m2 else "-",
                              f"{m1.mean_concurrency if m1 else '-'} / {m2.mean_concurrency if m2 else '-'}",
                              f"{m2.suspends:,} / {m2.preemptions:,}" if m2 else "-", "-", "-",
                              "V2 runs where V1 cannot" if m2 is not None else "-"]
                    row["ok"] = m2 is not None or m1 is None
                else:
                    steps = m2.steps / m1.steps
                    t = m2.step_time_us_median / m1.step_time_us_median if m1.step_time_us_median else float("nan")
                    ok = steps <= STEPS_TARGET and m2.hit_rate >= m1.hit_rate - HIT_SLACK
                    row.update(steps_ratio=steps, time_ratio=t, ok=ok)
                    modeled = "-"
                    if m1.modeled_seconds and m2.modeled_seconds is not None:
                        row["modeled_ratio"] = m2.modeled_seconds / m1.modeled_seconds
                        row["total_ratio"] = (m2.modeled_seconds + m2.kv_seconds) / (m1.modeled_seconds + m1.kv_seconds)
                        # a tiny preset's GPU step is microseconds: beside its manager time the sum says nothing
                        modeled = ratio(row["modeled_ratio"]) + ("" if os.path.basename(preset).startswith("tiny-")
                                                                 else f" ({ratio(row['total_ratio'])})")
                    conc = f"{m1.mean_concurrency:.1f} / {m2.mean_concurrency:.1f}"
                    moved = f"{m2.suspends:,} / {m2.preemptions:,}"
                    cells += [ratio(steps), _hit(m1), _hit(m2), conc, moved, ratio(t), modeled, verdict(ok)]
                table.rows.append(cells)
                rows.append(row)
                print(f"  {preset} {name} {label}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    table.notes += _target_notes(rows)
    table.notes.append("steps: engine steps until the last request finished (idle steps included); hit: reused "
                       "prompt tokens / prompt tokens, in brackets against the workload's ideal; step time: median "
                       "manager + scheduler time per engine step (kvload simulate's step_time_us_median); modeled "
                       "time: each step's batch priced on one H200 by a roofline of weights and KV read and FLOPs "
                       "(kvload simulate's modeled_seconds), in brackets with each manager's measured manager + "
                       "scheduler time added (this CPU; what a real model's step pays on the host too; not for the "
                       "tiny presets, whose modeled steps take microseconds). Budgets: "
                       "default = simulate's default for the workload, tight = 1/4, generous = 4x, for both managers "
                       "as max_gpu_total_bytes.")
    return rows, table


#: the figures of a run that depend on the managers' decisions alone (no clock): what ``--decisions`` writes
DECISIONS = ("steps", "engine_steps", "hit_rate", "reused_tokens", "computed_tokens", "max_concurrency",
             "mean_concurrency", "suspends", "resumes", "preemptions", "evictions", "waits", "finished")


def decisions(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each cell's clock-free figures per manager (``--decisions``): equal files mean equal decisions."""
    out = []
    for row in rows:
        cell: dict[str, Any] = {k: os.path.basename(row[k]) if k == "preset" else row[k]
                                for k in ("preset", "workload", "budget", "status")}
        for side in ("v1", "v2"):
            m = row[side]
            cell[side] = None if m is None else {k: getattr(m, k) for k in DECISIONS}
        out.append(cell)
    return out


def _target_notes(rows: list[dict[str, Any]]) -> list[str]:
    """One line per target: met or which cells miss."""
    notes = []
    cells = [r for r in rows if "ok" in r]
    misses = [f"{r['preset']} {r['workload']} {r['budget']}" for r in cells if not r["ok"]]
    notes.append(f"Every cell, V2 steps <= {STEPS_TARGET}x V1 and V2 hit >= V1 - {HIT_SLACK * 100:.1f} points: "
                 f"{verdict(not misses)}" + (f" (missed: {', '.join(misses)})" if misses else "") + ".")
    modeled = [r for r in cells if "modeled_ratio" in r]
    if modeled:
        slow = [f"{r['preset']} {r['workload']} {r['budget']} {ratio(r['modeled_ratio'])}" for r in modeled
                if r["modeled_ratio"] > STEPS_TARGET]
        notes.append(f"Every cell, V2 modeled time (steps priced on an H200, engine.step_model) <= {STEPS_TARGET}x "
                     "V1's: "
                     f"{verdict(not slow)}" + (f" (missed: {', '.join(slow)})" if slow else "") + ".")
    sw = [r for r in rows if r["preset"] in SLIDING and r["workload"] in ("shared-prefix", "multi-turn")
          and r["v2"] is not None and r["v2"].ideal_hit_rate > 0]
    if sw:
        worst = min(sw, key=lambda r: r["v2"].hit_rate / r["v2"].ideal_hit_rate)
        w = worst["v2"].hit_rate / worst["v2"].ideal_hit_rate
        notes.append(f"Sliding-window presets on shared-prefix / multi-turn, V2 hit >= {SLIDING_HIT_TARGET:.0%} of "
                     f"the ideal: worst {w:.1%} ({worst['preset']} {worst['workload']} {worst['budget']}): "
                     f"{verdict(w >= SLIDING_HIT_TARGET)}.")
    lc = [r for r in rows if r["preset"] == "tiny-gemma3" and r["workload"] == "long-context"
          and r["budget"] == "default" and r["v1"] is not None and r["v2"] is not None]
    for r in lc:
        c = r["v2"].max_concurrency / r["v1"].max_concurrency
        notes.append(f"tiny-gemma3 long-context (default budget), V2 max concurrency {r['v2'].max_concurrency} vs V1 "
                     f"{r['v1'].max_concurrency} = {ratio(c)} (mean {r['v2'].mean_concurrency:.2f} vs "
                     f"{r['v1'].mean_concurrency:.2f}); target >= {CONCURRENCY_TARGET:.0f}x: "
                     f"{verdict(c >= CONCURRENCY_TARGET)}.")
    timed = [r for r in rows if r["preset"] == "tiny-llama" and r["workload"] in ("shared-prefix", "multi-turn")
             and r["budget"] == "default" and "time_ratio" in r]
    if timed:
        notes.append("tiny-llama step time V2/V1 in this table (default budget; wall time, one run each, so other "
                     "jobs on the machine swing it): " + ", ".join(f"{r['workload']} {ratio(r['time_ratio'])}"
                                                              for r in timed)
                     + "; the step-time target is judged by the interleaved CPU-time table (--only timing).")
    return notes


def step_time(quick: bool = False, pairs: int = 3) -> Table:
    """The step-time target, measured fairly: V1 and V2 runs interleaved (alternating order), one manager per
    run, median of the per-pair ratios of median step time (tiny-llama, shared-prefix and multi-turn)."""
    from engine.simulator import simulate
    from engine.workloads import make_workload

    with thread_cpu_step_clock():  # thread CPU time, not wall time (see the helper)
        return _step_time(quick, pairs, simulate, make_workload)


def _step_time(quick: bool, pairs: int, simulate: Any, make_workload: Any) -> Table:
    cmd = "python -m bench.bench_grid --only timing" + (" --quick" if quick else "")
    table = Table(f"Step time, V2 / V1 (tiny-llama, default budget, {pairs} interleaved pairs)", cmd,
                  ["workload", "V1 step µs (median of medians)", "V2 step µs", "V2 / V1 (median of pairs)",
                   "per pair", "target <= 1.25x"])
    for name in ("shared-prefix", "multi-turn"):
        wl = make_workload(name, None, 0)
        if quick:
            wl = make_workload(name, max(4, len(wl.requests) // 4), 0)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(pairs):
            for v2 in ((False, True) if i % 2 == 0 else (True, False)):
                report = simulate("tiny-llama", wl, kv_cache_config={"use_kv_cache_manager_v2": v2}, **CPU)
                (result,) = report.results.values()
                times[v2].append(result.metrics.step_time_us_median)
        per = [b / a for a, b in zip(times[False], times[True], strict=True)]
        mid = sorted(per)[len(per) // 2]
        table.rows.append([name, f"{sorted(times[False])[pairs // 2]:,.0f}", f"{sorted(times[True])[pairs // 2]:,.0f}",
                           ratio(mid), ", ".join(ratio(x) for x in per), verdict(mid <= 1.25)])
    table.notes.append("Manager + scheduler time per engine step (scheduler.step, commits, finishes), median over "
                       "the run's engine steps, measured as this thread's CPU time (time.thread_time), not wall time; "
                       "both managers at the simulator's default budget for the workload.")
    return table


@contextlib.contextmanager
def _split_for_max_seq_len() -> Iterator[None]:
    """Split pools sized for ``max_seq_len`` sequences, the rule before ``KvLayout.split_length`` (for comparison)."""
    from cache_backends.layout import KvLayout

    rule = KvLayout.split_length
    KvLayout.split_length = lambda self, seq_len: seq_len  # type: ignore[method-assign]
    try:
        yield
    finally:
        KvLayout.split_length = rule  # type: ignore[method-assign]


def split_pools(preset: str = "tiny-deepseek-v4", workloads: tuple[str, ...] = WORKLOADS,
                budgets: tuple[str, ...] = tuple(BUDGETS), quick: bool = False) -> Table:
    """DeepSeek V4 (the model "auto" routes to V2; V1 cannot take it): V2 with its split pools sized for
    ``max_seq_len`` sequences (the rule before) and for the length where windows cost what growth does, side by
    side in one run at each cell's budget."""
    from engine.simulator import simulate
    from engine.workloads import make_workload
    from pipeline.errors import KvBuildError

    cmd = "python -m bench.bench_grid --only split" + (" --quick" if quick else "")
    table = Table(f"{preset}: split pools sized for max_seq_len -> for S / u tokens (V2 only)", cmd,
                  ["workload", "budget", "steps", "hit (of ideal)", "max / mean concurrency", "preemptions",
                   "modeled time"])
    for name in workloads:
        kind, extra, policy = VARIANTS.get(name, (name, {}, "fcfs"))
        wl = make_workload(kind, None, 0, **extra)
        if quick:
            wl = make_workload(kind, max(4, len(wl.requests) // 4), 0, **extra)
        base = simulate(preset, wl, kv_cache_config={"pool_arena": False}, scheduling_policy=policy,
                        **CPU).budget.bytes
        for label in budgets:
            # split pools both times: "auto" would draw the groups from one slab arena where the budget holds it
            kv = {"max_gpu_total_bytes": int(base * BUDGETS[label]), "pool_arena": False}
            runs = []
            for old in (True, False):
                with _split_for_max_seq_len() if old else contextlib.nullcontext():
                    try:
                        (result,) = simulate(preset, wl, kv_cache_config=kv, scheduling_policy=policy,
                                             **CPU).results.values()
                    except KvBuildError:  # a request needs more than its pool holds: it could never run
                        runs.append(None)
                        continue
                runs.append(result.metrics)
            def pair(f: Callable[[Any], str], runs: list[Any] = runs) -> str:
                return " -> ".join("cannot run" if m is None else f(m) for m in runs)

            a, b = runs
            steps = pair(lambda m: f"{m.steps:,}") + (f" ({ratio(b.steps / a.steps)})" if a and b else "")
            modeled = (ratio(b.modeled_seconds / a.modeled_seconds) if a and b and a.modeled_seconds else "-")
            table.rows.append([name, label, steps, pair(_hit), pair(lambda m: f"{m.max_concurrency} / "
                                                                    f"{m.mean_concurrency:.1f}"),
                               pair(lambda m: f"{m.preemptions:,}"), modeled])
            print(f"  split {preset} {name} {label}", file=sys.stderr, flush=True)
    table.notes.append("Both columns in one run: V2 on the same workload and budget, its split pools sized for "
                       "max_seq_len sequences (KvLayout.split_length patched to return max_seq_len) -> sized as "
                       "kvload now sizes them (one max_seq_len sequence, then windows for sequences of S / u "
                       "tokens). modeled time: after / before. Budgets as in the grid.")
    return table


def arena_pools(preset: str = "tiny-deepseek-v4", workloads: tuple[str, ...] = WORKLOADS,
                budgets: tuple[str, ...] = tuple(BUDGETS), quick: bool = False) -> Table:
    """DeepSeek V4 on V2 through ``kv_cache_config.pool_arena``: split pools (false) against one slab arena (true), side
    by side in one run at each cell's budget, and what "auto" resolves to there."""
    from engine.simulator import simulate
    from engine.workloads import make_workload
    from pipeline.context import LoadRequest
    from pipeline.errors import KvBuildError
    from pipeline.run import execute
    from stages import plan_stages

    cmd = "python -m bench.bench_grid --only arena" + (" --quick" if quick else "")
    table = Table(f"{preset}: pool_arena false -> true (V2 only)", cmd,
                  ["workload", "budget", "slabs", "auto", "steps", "hit (of ideal)", "max / mean concurrency",
                   "preemptions", "modeled time"])
    for name in workloads:
        kind, extra, policy = VARIANTS.get(name, (name, {}, "fcfs"))
        wl = make_workload(kind, None, 0, **extra)
        if quick:
            wl = make_workload(kind, max(4, len(wl.requests) // 4), 0, **extra)
        base = simulate(preset, wl, scheduling_policy=policy, **CPU).budget.bytes
        for label in budgets:
            kv = {"max_gpu_total_bytes": int(base * BUDGETS[label])}
            runs, slabs = [], "-"
            for arena in (False, True):
                try:
                    (result,) = simulate(preset, wl, kv_cache_config={**kv, "pool_arena": arena},
                                         scheduling_policy=policy, **CPU).results.values()
                except KvBuildError:  # a request needs more than the pools (or the arena's slabs) hold alone
                    runs.append(None)
                    continue
                runs.append(result.metrics)
                if arena:
                    slabs = f"{result.arena_slabs:,}"
            events: list[dict[str, Any]] = []  # what "auto" resolves to: the plan a simulation makes at this budget
            execute(LoadRequest(model=preset, overrides={"device": "cpu", "kv_cache_config": kv}, pools_unbacked=True),
                    plan_stages(), subscribers=[events.append], log=False)
            auto = next(e["new"] for e in events if e["event"] == "auto_resolved"
                        and e["field"] == "kv_cache_config.pool_arena")

            def pair(f: Callable[[Any], str], runs: list[Any] = runs) -> str:
                return " -> ".join("cannot run" if m is None else f(m) for m in runs)

            a, b = runs
            steps = pair(lambda m: f"{m.steps:,}") + (f" ({ratio(b.steps / a.steps)})" if a and b else "")
            modeled = (ratio(b.modeled_seconds / a.modeled_seconds) if a and b and a.modeled_seconds else "-")
            table.rows.append([name, label, slabs, "arena" if auto else "split", steps, pair(_hit),
                               pair(lambda m: f"{m.max_concurrency} / {m.mean_concurrency:.1f}"),
                               pair(lambda m: f"{m.preemptions:,}"), modeled])
            print(f"  arena {preset} {name} {label}", file=sys.stderr, flush=True)
    table.notes.append("Both runs in one process: V2 on the same workload and budget (max_gpu_total_bytes), pools "
                       "split once (pool_arena false) -> one slab arena (true); auto: what pool_arena \"auto\" "
                       "resolves to at that budget. modeled time: arena / split. Budgets as in the grid.")
    return table


#: ``--only arena-slabs``: budgets in multiples of the slabs one ``max_seq_len`` sequence takes (pool_arena "auto"'s
#: floor), from the floor up.
SLAB_FACTORS = (1.0, 1.5, 2.0, 3.0, 4.0, 8.0)
#: ``--only arena-slabs`` also replays ``bench.bench_v4_arena``'s prompts: 8 of 300..601 tokens arriving at once,
#: 32 answer tokens each, nothing shared.
V4_ARENA_PROMPTS = ("mixed", {"prompt_min": 300, "prompt_max": 601, "answer_min": 32, "answer_max": 32,
                              "prefixes": 0, "shared_percent": 0, "max_gap": 0}, 8)


def arena_slabs(preset: str = "tiny-deepseek-v4", workloads: tuple[str, ...] = (*WORKLOADS, "v4-arena-prompts"),
                factors: tuple[float, ...] = SLAB_FACTORS, max_seq_len: int | None = None,
                quick: bool = False) -> Table:
    """DeepSeek V4's split pools against its slab arena at budgets of 1x..8x the slabs one ``max_seq_len`` sequence
    takes (``max_seq_len``: each workload's longest sequence unless given), and what "auto" resolves to there: where
    the arena's per-group slab rounding costs running requests, and whether anything "auto" knows tells it."""
    from cache_backends.budget import slab_bytes, slabs_for_sequence
    from engine.simulator import simulate
    from engine.workloads import make_workload
    from pipeline.context import LoadRequest
    from pipeline.errors import KvBuildError
    from pipeline.run import execute
    from stages import plan_stages

    cmd = ("python -m bench.bench_grid --only arena-slabs" + (f" --max-seq-len {max_seq_len}" if max_seq_len else "")
           + (" --quick" if quick else ""))
    table = Table(f"{preset}: pool_arena false -> true at budgets in slabs of one max_seq_len sequence (V2 only)", cmd,
                  ["workload", "max_seq_len", "slabs (x one sequence's)", "auto", "steps", "mean concurrency",
                   "preemptions"])
    layout = None
    for name in workloads:
        if name == "v4-arena-prompts":
            kind, extra, count = V4_ARENA_PROMPTS
            policy, wl = "fcfs", make_workload(kind, count, 0, **extra)
        else:
            kind, extra, policy = VARIANTS.get(name, (name, {}, "fcfs"))
            wl = make_workload(kind, None, 0, **extra)
            if quick:
                wl = make_workload(kind, max(4, len(wl.requests) // 4), 0, **extra)
        longest = max(len(r.prompt) + len(r.answer) for r in wl.requests)
        length = max_seq_len or longest
        if length < longest:
            table.rows.append([name, f"{length:,}", f"- (its longest sequence is {longest:,} tokens)", "-", "-", "-",
                               "-"])
            continue
        if layout is None:
            from pipeline import plan
            layout = plan(preset, log=False, device="cpu", max_seq_len=length, kv_cache_config={"max_tokens": length}
                          ).kv.layout
        need = slabs_for_sequence(layout, length)
        for factor in factors:
            slabs = max(need, round(need * factor))
            kv = {"max_gpu_total_bytes": slabs * slab_bytes(layout)}
            runs = []
            for arena in (False, True):
                try:
                    (result,) = simulate(preset, wl, kv_cache_config={**kv, "pool_arena": arena}, max_seq_len=length,
                                         scheduling_policy=policy, **CPU).results.values()
                except KvBuildError:
                    runs.append(None)
                    continue
                runs.append(result.metrics)
            events: list[dict[str, Any]] = []
            execute(LoadRequest(model=preset, overrides={"device": "cpu", "kv_cache_config": kv, "max_seq_len": length},
                                pools_unbacked=True), plan_stages(), subscribers=[events.append], log=False)
            auto = next(e["new"] for e in events if e["event"] == "auto_resolved"
                        and e["field"] == "kv_cache_config.pool_arena")

            def pair(f: Callable[[Any], str], runs: list[Any] = runs) -> str:
                return " -> ".join("cannot run" if m is None else f(m) for m in runs)

            a, b = runs
            steps = pair(lambda m: f"{m.steps:,}") + (f" ({ratio(b.steps / a.steps)})" if a and b else "")
            table.rows.append([name, f"{length:,}", f"{slabs:,} ({slabs / need:.1f}x {need})",
                               "arena" if auto else "split", steps, pair(lambda m: f"{m.mean_concurrency:.1f}"),
                               pair(lambda m: f"{m.preemptions:,}")])
            print(f"  arena-slabs {name} {slabs} slabs", file=sys.stderr, flush=True)
    table.notes.append("Both runs in one process at each budget (max_gpu_total_bytes = slabs x the largest page): "
                       "V2's pools split once (pool_arena false) -> one slab arena (true); max_seq_len: each "
                       "workload's longest sequence unless --max-seq-len; x one sequence's: the budget over the slabs "
                       "one max_seq_len sequence takes (\"auto\"'s floor); auto: what pool_arena \"auto\" resolves "
                       "to there. v4-arena-prompts: bench.bench_v4_arena's prompts (8 of 300..601 tokens at once, 32 "
                       "answer tokens).")
    return table


def run(quick: bool = False) -> list[Table]:
    """The grid table and the step-time table (``bench.run_all`` entry point)."""
    return [grid(quick=quick)[1], step_time(quick)]


def main(argv: list[str] | None = None) -> None:
    """Print the machine and the grid as markdown."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a quarter of each workload's requests")
    p.add_argument("--presets", default=None, help="comma-separated presets or checkpoint directories")
    p.add_argument("--real", action="store_true", help="the published sliding-window configs (REAL) as the presets")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated workloads")
    p.add_argument("--budgets", default=",".join(BUDGETS), help=f"comma-separated subset of {', '.join(BUDGETS)}")
    p.add_argument("--only", choices=("grid", "timing", "split", "arena", "arena-slabs"),
                   help="run one part (default: grid and timing; split: DeepSeek V4's split pools, old rule vs new; "
                        "arena: DeepSeek V4's split pools vs its slab arena, pool_arena false vs true; arena-slabs: "
                        "the same at budgets of 1x..8x one max_seq_len sequence's slabs)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="arena-slabs: one max_seq_len for every workload (default: each workload's longest sequence)")
    p.add_argument("--decisions", metavar="FILE", default=None,
                   help="grid: also write each cell's clock-free figures (steps, hits, suspends, ...) as JSON lines")
    p.add_argument("--max_page_padding", type=float, default=None, metavar="F",
                   help="grid: every cell with kv_cache_config.max_page_padding F (V2's padded shared-arena pages; "
                        "default: the setting's default, 0)")
    args = p.parse_args(argv)
    budgets = tuple(b.strip() for b in args.budgets.split(",") if b.strip())
    unknown = [b for b in budgets if b not in BUDGETS]
    if unknown:
        p.error(f"--budgets: unknown budget {unknown[0]!r}; known: {', '.join(BUDGETS)}")
    if args.max_seq_len is not None and (args.only != "arena-slabs" or args.max_seq_len < 1):
        p.error(f"--max-seq-len: a positive integer, for --only arena-slabs alone; got {args.max_seq_len} with "
                f"--only {args.only}")
    if args.max_page_padding is not None and args.only not in (None, "grid"):
        p.error(f"--max_page_padding: for the grid, --only grid (or no --only) alone; got --only {args.only}")
    if args.decisions and args.only not in (None, "grid"):
        p.error(f"--decisions: the grid's decisions, for --only grid (or no --only) alone; got --only {args.only}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for key, value in machine().items():
        print(f"- {key}: {value}")
    print()
    if args.only in (None, "grid"):
        presets = args.presets.split(",") if args.presets else REAL if args.real else PRESETS
        rows, table = grid(tuple(presets), tuple(args.workloads.split(",")), budgets, args.quick,
                           args.max_page_padding)
        print(table.markdown())
        if args.decisions:
            with open(args.decisions, "w") as f:
                f.writelines(json.dumps(cell, sort_keys=True) + "\n" for cell in decisions(rows))
    if args.only in (None, "timing"):
        print(step_time(args.quick).markdown())
    if args.only == "split":
        print(split_pools(workloads=tuple(args.workloads.split(",")), budgets=budgets, quick=args.quick).markdown())
    if args.only == "arena":
        print(arena_pools(workloads=tuple(args.workloads.split(",")), budgets=budgets, quick=args.quick).markdown())
    if args.only == "arena-slabs":
        names = tuple(args.workloads.split(",")) if args.workloads != ",".join(WORKLOADS) else None
        print(arena_slabs(**({"workloads": names} if names else {}), max_seq_len=args.max_seq_len,
                          quick=args.quick).markdown())


if __name__ == "__main__":
    main()
