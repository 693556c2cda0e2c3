"""A seeded random search for workloads where V2 loses to V1 at the same budget: more steps, or fewer prefix hits.

"auto" routes models to V2, so at the same budget V2 should never finish a workload in noticeably more steps, or with
fewer prefix hits, than V1. The grid (``bench.bench_grid``) and the hand-built variants (``bench.probe_mt_variants``)
check chosen points; this samples the space the simulator's workloads span (``engine.workloads.make_workload``, and
``probe_mt_variants.phased`` for workloads that change character mid-run): the workload (``multi-turn``,
``shared-prefix``, ``mixed`` under fcfs or priority, ``no-reuse``, two ``multi-turn`` phases back to back), its
request count (small, so a sample takes a fraction of a second), sizes and their spread, turns per conversation, shared
prefixes, arrival gaps, urgent share, the preset (tiny-llama, tiny-mistral, tiny-gemma3, and the published GPT-OSS 20B
and Gemma 2 9B configs: windows of 128 and 4,096 tokens) and the budget (a share of the simulator's default for the
workload, 0.1x to 4x, as ``max_gpu_total_bytes`` for both managers). Each sample runs ``simulate --compare`` (V1 and
V2, deterministic) and keeps steps, hit rate, suspends and preemptions; the worst V2/V1 steps ratios and hit-rate
deficits are printed, each with the line that replays it::

    python -m bench.search_v2_losses --samples 300 --seed 0 --top 10
    python -m bench.search_v2_losses --replay \
        "preset=tiny-llama,workload=multi-turn,requests=24,wseed=1,budget=0.25,turns=3"
    python -m bench.search_v2_losses --samples 300 --json /tmp/search.json   # every sample's figures

Sample ``i`` of ``--seed S`` depends on (S, i) alone, so a longer search extends a shorter one.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import math
import os
import random
import sys
import time
from typing import Any

CPU = {"device": "cpu", "log": False, "progress": False}
PRESETS = ("tiny-llama", "tiny-mistral", "tiny-gemma3", "tests/data/configs/gpt-oss-20b",
           "tests/data/configs/gemma-2-9b-it")
KINDS = ("multi-turn", "shared-prefix", "mixed", "no-reuse", "phases")
#: a case's keys that are not workload parameters
CASE_KEYS = ("preset", "workload", "requests", "wseed", "budget", "policy")
#: ``phases``: two ``multi-turn`` phases, ``p1_requests`` of ``p1_turns`` turns then ``p2_requests`` of ``p2_turns``;
#: the sizes (first_len, user_len, answer_len) are both phases'
PHASE_KEYS = ("p1_requests", "p1_turns", "p2_requests", "p2_turns")


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return lo if hi <= lo else min(hi, int(lo * (hi / lo) ** rng.random()))


def sample(seed: int, i: int) -> dict[str, Any]:
    """Case ``i`` of search ``seed``: preset, workload, its parameters and the budget share."""
    rng = random.Random(f"search-v2-{seed}-{i}")
    kind = rng.choice(KINDS)
    case: dict[str, Any] = {"preset": rng.choice(PRESETS), "workload": kind, "wseed": rng.randrange(1000),
                            "budget": round(math.exp(rng.uniform(math.log(0.1), math.log(4.0))), 3),
                            "policy": "fcfs"}
    if kind == "multi-turn":
        turns = rng.randint(1, 6)
        case.update(requests=turns * rng.randint(4, 24), turns=turns, first_len=_log_uniform(rng, 64, 1024),
                    user_len=_log_uniform(rng, 8, 256), answer_len=_log_uniform(rng, 8, 256))
    elif kind == "phases":
        t1, t2 = rng.randint(1, 5), rng.randint(1, 5)
        case.update(p1_requests=t1 * rng.randint(4, 16), p1_turns=t1, p2_requests=t2 * rng.randint(4, 16),
                    p2_turns=t2, first_len=_log_uniform(rng, 64, 1024), user_len=_log_uniform(rng, 8, 256),
                    answer_len=_log_uniform(rng, 8, 256))
    elif kind == "shared-prefix":
        case.update(requests=rng.randint(8, 96), group_size=rng.randint(2, 16), prefix_len=_log_uniform(rng, 64, 1024),
                    question_len=_log_uniform(rng, 8, 256), answer_len=_log_uniform(rng, 8, 256))
    elif kind == "mixed":
        lo = _log_uniform(rng, 8, 256)
        alo = _log_uniform(rng, 1, 64)
        prefixes = rng.randint(0, 6)
        case.update(requests=rng.randint(16, 128), prompt_min=lo, prompt_max=_log_uniform(rng, lo, 2048),
                    answer_min=alo, answer_max=_log_uniform(rng, alo, 256), prefixes=prefixes,
                    shared_percent=max(1, rng.randint(0, 100)) if prefixes else 0,
                    urgent_percent=rng.choice((0, 0, 10, 25, 50)), max_gap=rng.randint(0, 8))
        if prefixes:
            case["prefix_len"] = _log_uniform(rng, 64, 1024)
        if case["urgent_percent"] and rng.random() < 0.5:
            case["policy"] = "priority"
    else:  # no-reuse
        case.update(requests=rng.randint(8, 96), prompt_len=_log_uniform(rng, 16, 2048),
                    answer_len=_log_uniform(rng, 1, 256))
    return case


def build(case: dict[str, Any]) -> Any:
    """The case's workload (``make_workload``, or ``probe_mt_variants.phased`` for ``phases``)."""
    from engine.workloads import make_workload

    params = {k: v for k, v in case.items() if k not in CASE_KEYS and k not in PHASE_KEYS}
    if case["workload"] == "phases":
        from bench.probe_mt_variants import phased

        phases = ((case["p1_requests"], {**params, "turns": case["p1_turns"]}),
                  (case["p2_requests"], {**params, "turns": case["p2_turns"]}))
        return phased(phases, case["wseed"])[0]
    return make_workload(case["workload"], case.get("requests"), case["wseed"], **params)


_LAYOUTS: dict[str, Any] = {}


def default_bytes(preset: str, wl: Any) -> int:
    """The simulator's default budget for ``wl`` on ``preset`` (its default number of the workload's longest sequences
    in the routed layout, as ``engine.capacity.routed_budget``), without a run."""
    from engine.workloads import default_budget_sequences
    from pipeline import plan

    if preset not in _LAYOUTS:
        _LAYOUTS[preset] = plan(preset, log=False, device="cpu").kv.layout
    return default_budget_sequences(wl) * _LAYOUTS[preset].bytes_for_sequence(wl.max_sequence_tokens)


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Both managers on one case: per manager its status and (when it ran) steps, hit rate, suspends, preemptions,
    and the V2/V1 steps ratio and hit deficit (V1's hit rate - V2's, in points of 1) where both ran."""
    from engine.simulator import simulate
    from pipeline.errors import ConfigError, KvBuildError

    try:
        wl = build(case)
    except ValueError as exc:  # parameters make_workload refuses (a replay line edited by hand)
        return {"case": case, "error": str(exc).splitlines()[0][:200]}
    budget = max(1, int(default_bytes(case["preset"], wl) * case["budget"]))
    out: dict[str, Any] = {"case": case, "budget_bytes": budget}
    try:
        report = simulate(case["preset"], wl, compare=True, kv_cache_config={"max_gpu_total_bytes": budget},
                          scheduling_policy=case["policy"], **CPU)
    except (ConfigError, KvBuildError) as exc:  # e.g. a sequence past the preset's max_seq_len
        out["error"] = str(exc).splitlines()[0][:200]
        return out
    out["ideal"] = wl.ideal_hit_rate
    for key, name in (("v1", "KVCacheManager"), ("v2", "KVCacheManagerV2")):
        r = report.results[name]
        m = r.metrics
        out[key] = {"status": r.status} if m is None else {
            "status": r.status, "steps": m.steps, "hit": round(m.hit_rate, 6), "suspends": m.suspends,
            "preemptions": m.preemptions, "mean_conc": round(m.mean_concurrency, 3)}
    if "steps" in out["v1"] and "steps" in out["v2"]:
        out["steps_ratio"] = out["v2"]["steps"] / out["v1"]["steps"]
        out["hit_deficit"] = out["v1"]["hit"] - out["v2"]["hit"]
    return out


def case_str(case: dict[str, Any]) -> str:
    """The ``--replay`` form of a case: ``key=value`` pairs, comma-separated."""
    return ",".join(f"{k}={v}" for k, v in case.items())


def parse_case(text: str) -> dict[str, Any]:
    """A case from its ``--replay`` form (or a JSON object)."""
    if text.lstrip().startswith("{"):
        return dict(json.loads(text))
    case: dict[str, Any] = {}
    for part in text.replace(" ", ",").split(","):
        if not part:
            continue
        key, _, value = part.partition("=")
        if not _:
            raise ValueError(f"--replay: {part!r} is not key=value")
        try:
            case[key] = int(value)
        except ValueError:
            try:
                case[key] = float(value)
            except ValueError:
                case[key] = value
    missing = [k for k in ("preset", "workload", "wseed", "budget") if k not in case]
    if missing:
        raise ValueError(f"--replay: missing {', '.join(missing)}")
    case.setdefault("policy", "fcfs")
    return case


def row(r: dict[str, Any]) -> str:
    """One markdown row: V2/V1 steps, both hits, V2's suspends / preemptions, the case."""
    v1, v2 = r["v1"], r["v2"]
    return (f"| {r['steps_ratio']:.3f} | {v1['steps']:,} / {v2['steps']:,} | {v1['hit']:.1%} / {v2['hit']:.1%} "
            f"(ideal {r['ideal']:.1%}) | {v2['suspends']} / {v2['preemptions']} (V1 {v1['preemptions']}) | "
            f"`{case_str(r['case'])}` |")


HEAD = ("| V2/V1 steps | steps V1 / V2 | hit V1 / V2 | V2 suspends / preemptions | case (--replay) |\n"
        "|--:|--:|--:|--:|---|")


def apply_patch(kv: str) -> None:
    """``MODULE.ATTR=VALUE``: set an existing module constant (``VALUE`` a Python literal, or ``inf``)."""
    key, sep, value = kv.partition("=")
    mod, _, attr = key.rpartition(".")
    if not sep or not mod:
        raise ValueError("expected MODULE.ATTR=VALUE")
    module = importlib.import_module(mod)
    if not hasattr(module, attr):
        raise AttributeError(f"{mod} has no {attr}")
    setattr(module, attr, math.inf if value == "inf" else ast.literal_eval(value))


def read_base(path: str) -> list[dict[str, Any]]:
    """The samples a ``--json`` file recorded as run on both managers (``ValueError`` naming what is wrong)."""
    try:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not a --json file of this search (line {exc.lineno}: {exc.msg})") from None
    if not all(isinstance(r, dict) and "case" in r and "index" in r for r in rows):
        raise ValueError("not a --json file of this search (each line a sample with its case and index)")
    return [r for r in rows if "steps_ratio" in r]


def compare_against(base: list[dict[str, Any]], out: str | None = None) -> None:
    """Rerun every sample of ``base`` (read by :func:`read_base`); print the changed ones (before -> after) and the
    counts over 1.02x V1's steps and with hits more than 0.5 points below V1's. ``out``: the rerun's rows, as
    ``--json`` writes them (the next comparison's base)."""
    now, better, worse, gone = [], 0, 0, 0
    with open(out, "w") if out is not None else contextlib.nullcontext() as sink:  # closed however it ends
        for b in base:
            x = run_case(b["case"])
            if sink is not None:
                sink.write(json.dumps({"index": b["index"], **x}) + "\n")
                sink.flush()
            if "steps_ratio" not in x:
                gone += 1
                print(f"#{b['index']} no longer runs on both: {x.get('error', 'stalled')} | {case_str(b['case'])}")
                continue
            now.append(x)
            if (x["steps_ratio"], x["hit_deficit"]) == (b["steps_ratio"], b["hit_deficit"]):
                continue
            better += x["steps_ratio"] < b["steps_ratio"]
            worse += x["steps_ratio"] > b["steps_ratio"]
            print(f"#{b['index']} steps {b['steps_ratio']:.3f} -> {x['steps_ratio']:.3f}, V2 - V1 hit "
                  f"{-100 * b['hit_deficit']:+.1f} -> {-100 * x['hit_deficit']:+.1f} points | {case_str(b['case'])}",
                  flush=True)

    def counts(rows: list[dict[str, Any]]) -> str:
        return (f"{sum(r['steps_ratio'] > 1.02 for r in rows)} over 1.02x V1's steps, "
                f"{sum(r['hit_deficit'] > 0.005 for r in rows)} with hits > 0.5 points below V1's")

    left = f" ({gone} no longer run on both: left out of after)" if gone else ""
    print(f"{len(base)} samples: steps better on {better}, worse on {worse}; before {counts(base)}; after "
          f"{counts(now)}{left}")


def main(argv: list[str] | None = None) -> None:
    """Search (or replay one case) and print the worst cases as markdown."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0, help="first sample index (to resume or split a search)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--replay", default=None, help="one case, as printed (key=value,...)")
    p.add_argument("--json", default=None, help="write every sample's figures here (JSON lines)")
    p.add_argument("--patch", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                   help="set a module constant first (a literal: int, float, inf), e.g. "
                        "cache_backends.v2.scheduler.SHARED_HOLD=0.25; repeatable; not kept")
    p.add_argument("--against", default=None, metavar="BASE.jsonl",
                   help="rerun the samples a --json file recorded (ran on both) and print those whose figures changed "
                        "(with --json: the rerun's rows written there)")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for kv in a.patch:
        try:
            apply_patch(kv)
        except (ValueError, SyntaxError, ImportError, AttributeError) as exc:
            p.error(f"--patch {kv}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    if a.against is not None:
        given = [f"--{k}" for k in ("samples", "seed", "start", "top", "replay") if getattr(a, k) != p.get_default(k)]
        if given:
            p.error(f"--against reruns the samples its file recorded; {', '.join(given)} do not apply to it")
        try:
            base = read_base(a.against)
        except ValueError as exc:
            p.error(f"--against {a.against}: {exc}")
        compare_against(base, a.json)
        return
    if a.replay is not None:
        try:
            case = parse_case(a.replay)
        except ValueError as exc:
            p.error(str(exc))
        r = run_case(case)
        print(json.dumps(r, indent=1))
        if "steps_ratio" in r:
            print(HEAD)
            print(row(r))
        return
    results, errors, stalled = [], 0, 0
    start = time.perf_counter()
    sink = open(a.json, "w") if a.json else None  # noqa: SIM115 - written as the search goes
    try:
        for i in range(a.start, a.start + a.samples):
            r = run_case(sample(a.seed, i))
            r["index"] = i
            if sink:
                sink.write(json.dumps(r) + "\n")
                sink.flush()
            if "error" in r:
                errors += 1
            elif "steps_ratio" not in r:
                stalled += 1
            else:
                results.append(r)
            if (i - a.start + 1) % 25 == 0:
                worst = max((x["steps_ratio"] for x in results), default=float("nan"))
                print(f"  {i - a.start + 1} samples, {time.perf_counter() - start:.0f} s, worst steps {worst:.3f}",
                      file=sys.stderr, flush=True)
    finally:
        if sink:
            sink.close()
    print(f"{a.samples} samples (seed {a.seed}, from {a.start}) in {time.perf_counter() - start:.0f} s: {len(results)} "
          f"ran on both managers, {stalled} stalled on one (budget below a sequence), {errors} refused (e.g. past "
          "max_seq_len)")
    worse = [r for r in results if r["steps_ratio"] > 1.02]
    print(f"V2 > 1.02x V1's steps: {len(worse)}; V2 hit > 0.5 points below V1's: "
          f"{sum(r['hit_deficit'] > 0.005 for r in results)}\n")
    print(f"Worst {a.top} by V2/V1 steps:\n\n{HEAD}")
    for r in sorted(results, key=lambda r: -r["steps_ratio"])[:a.top]:
        print(row(r))
    print(f"\nWorst {a.top} by hit deficit (V1 - V2):\n\n{HEAD}")
    for r in sorted(results, key=lambda r: -r["hit_deficit"])[:a.top]:
        if r["hit_deficit"] > 0:
            print(row(r))


if __name__ == "__main__":
    main()
