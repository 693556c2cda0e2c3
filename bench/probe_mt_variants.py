"""V1 against V2 over the ``multi-turn`` workload's variants, side by side: steps and prefix reuse.

The table of BENCHMARKS.md "A conversation's wait carries": tiny-llama ``multi-turn``
(``make_workload("multi-turn", None, 0, **args)``) at a quarter of each variant's default budget unless said, and
"Cache-aware admission"'s two-turn case at 3,072-6,144 tokens of KV. V1's
figures do not depend on V2's scheduler, so ``--v1-cache FILE`` keeps them between runs (a probe of a V2 rule then
runs V2 only)::

    python -m bench.probe_mt_variants                        # every variant, both managers
    python -m bench.probe_mt_variants --only turns3,half --v1-cache /tmp/v1.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

CPU = {"device": "cpu", "log": False, "progress": False}
#: label -> (workload arguments, share of the variant's default budget)
VARIANTS: dict[str, tuple[dict[str, int], float]] = {
    "default": ({}, 0.25),
    "turns3": ({"turns": 3}, 0.25),
    "turns5": ({"turns": 5}, 0.25),
    "turns6": ({"turns": 6}, 0.25),
    "first640": ({"first_len": 640}, 0.25),
    "first384": ({"first_len": 384}, 0.25),
    "answer96": ({"answer_len": 96}, 0.25),
    "user128": ({"user_len": 128}, 0.25),
    "half": ({}, 0.5),
}
#: "Cache-aware admission"'s tail case: 16 two-turn conversations of 640-token prompts, 32-token turns and answers, at
#: a budget in tokens (``max_tokens``) -> the budget
TWO_TURNS = {"user_len": 32, "answer_len": 32, "turns": 2, "first_len": 640}
VARIANTS.update({f"2turn-{n}": (TWO_TURNS, float(n)) for n in (3072, 4096, 5120, 6144)})
#: Workloads that change character mid-run (the short-conversation estimate must follow the recent joins): label ->
#: phases, each ``(requests, multi-turn arguments)`` in order, a phase's first turns arriving one per step after the
#: previous phase's; the budget is a quarter of the ``multi-turn`` default (a longest sequence per conversation) of the
#: phase with the most turns, in tokens, as the other variants' (one-shot prompts are one-turn conversations).
ONE_SHOT = {"turns": 1}
SHIFTS: dict[str, tuple[tuple[int, dict[str, int]], ...]] = {
    "shift-oneshot-then-chat": ((200, ONE_SHOT), (256, {})),
    "shift-chat-then-oneshot": ((256, {}), (200, ONE_SHOT)),
    "shift-2turn-then-chat": ((128, {"turns": 2}), (256, {})),
    "shift-chat-then-2turn": ((256, {}), (128, {"turns": 2})),
    # "Cache-aware admission"'s two-turn case at 4,096 tokens of KV after as many four-turn conversations of its sizes
    "shift-chat-then-2turn-4096": ((64, {**TWO_TURNS, "turns": 4}), (32, TWO_TURNS)),
    "shift-2turn-then-chat-4096": ((32, TWO_TURNS), (64, {**TWO_TURNS, "turns": 4})),
}
#: SHIFTS variants with a budget of their own (tokens)
SHIFT_BUDGET = {"shift-chat-then-2turn-4096": 4096, "shift-2turn-then-chat-4096": 4096}
VARIANTS.update({label: ({}, 0.25) for label in SHIFTS})


def shifted(label: str) -> tuple[Any, int]:
    """The workload of a ``SHIFTS`` variant and its budget in tokens (see :func:`phased`)."""
    wl, (_, tokens) = phased(SHIFTS[label])
    return wl, SHIFT_BUDGET.get(label, int(VARIANTS[label][1] * tokens))


def phased(phases: tuple[tuple[int, dict[str, int]], ...], seed: int = 0) -> tuple[Any, tuple[int, int]]:
    """``multi-turn`` workloads (seeds ``seed``, ``seed + 1``, ...) back to back, ids prefixed by the phase, each
    phase's tokens moved by a bijection of the vocabulary so that no phase's prompt starts with another's marker token
    (each phase numbers its markers from 1); and (turns, tokens) of the phase with the most turns: its conversations'
    longest sequences (the ``multi-turn`` default budget of that phase)."""
    import attrs

    from engine.workloads import Workload, make_workload

    out, start, vocab, budget = [], 0, 32000, (0, 0)
    for k, (requests, args) in enumerate(phases):
        wl = make_workload("multi-turn", requests, seed + k, **args)
        shift = k * (vocab - 1) // len(phases)

        def move(tokens: tuple[int, ...], shift: int = shift) -> tuple[int, ...]:
            return tuple((t - 1 + shift) % (vocab - 1) + 1 for t in tokens)

        last = 0
        for r in wl.requests:
            out.append(attrs.evolve(r, req_id=f"p{k}-{r.req_id}", prompt=move(r.prompt), answer=move(r.answer),
                                    arrival_step=start + r.arrival_step if r.after is None else 0,
                                    after=None if r.after is None else f"p{k}-{r.after}"))
            last = max(last, r.arrival_step)
        start += last + 1
        conversations = len({r.req_id.rsplit("-", 1)[0] for r in wl.requests})
        budget = max(budget, (wl.params["turns"], conversations * wl.max_sequence_tokens))
    return Workload("multi-turn", tuple(out), seed, {}), budget


def run_variant(label: str, model: str, v1: dict[str, Any] | None) -> dict[str, Any]:
    """Both managers (V1 from ``v1`` when given) on one variant: steps, hit rate, ideal hit rate."""
    from engine.simulator import simulate
    from engine.workloads import make_workload

    args, share = VARIANTS[label]
    two = label.startswith("2turn-")
    if label in SHIFTS:
        wl, tokens = shifted(label)
    else:
        wl = make_workload("multi-turn", 32 if two else None, 0, **args)
    if v1 is None:
        kv: dict[str, Any] = ({"max_tokens": int(share)} if two else {"max_tokens": tokens} if label in SHIFTS
                              else {"max_gpu_total_bytes": int(simulate(model, wl, **CPU).budget.bytes * share)})
        report = simulate(model, wl, compare=True, kv_cache_config=kv, **CPU)
        m1, m2 = report.results["KVCacheManager"].metrics, report.results["KVCacheManagerV2"].metrics
        v1 = {"steps": m1.steps, "hit": m1.hit_rate, "kv": kv}
    else:
        kv = {**v1["kv"], "use_kv_cache_manager_v2": True}
        report = simulate(model, wl, kv_cache_config=kv, **CPU)
        m2 = report.results["KVCacheManagerV2"].metrics
    return {"v1": v1, "v2": {"steps": m2.steps, "hit": m2.hit_rate, "ideal": m2.ideal_hit_rate}}


def main(argv: list[str] | None = None) -> None:
    """Run the variants and print one line each."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--v1-cache", default=None, help="JSON file of V1's figures: read where present, else written")
    p.add_argument("--json", default=None, help="write the figures here")
    a = p.parse_args(argv)
    labels = a.only.split(",")
    unknown = [x for x in labels if x not in VARIANTS]
    if unknown:
        p.error(f"--only: unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    cache: dict[str, Any] = {}
    if a.v1_cache and os.path.exists(a.v1_cache):
        with open(a.v1_cache) as f:
            cache = json.load(f)
    out: dict[str, Any] = {}
    print("| variant | V1 steps | V2 steps | V2/V1 | hit V1 | hit V2 (of ideal) |")
    print("|---|--:|--:|--:|--:|--:|")
    for label in labels:
        start = time.perf_counter()
        key = f"{a.model}:{label}"
        r = run_variant(label, a.model, cache.get(key))
        cache[key] = r["v1"]
        out[label] = r
        v1, v2 = r["v1"], r["v2"]
        print(f"| {label} | {v1['steps']:,} | {v2['steps']:,} | {v2['steps'] / v1['steps']:.3f} | {v1['hit']:.1%} | "
              f"{v2['hit']:.1%} ({v2['hit'] / v2['ideal']:.0%}) |", flush=True)
        print(f"  {label}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    if a.v1_cache:
        with open(a.v1_cache, "w") as f:
            json.dump(cache, f, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
