"""Differential check for "no behaviour change" refactors of the KV cache managers: replay simulator scenarios and
digest the managers' observable state after every engine step; compare the digests of two source trees.

    PYTHONPATH=<tree> python scripts/kv_diffcheck.py --out digests-<tree>.json   # once per tree
    python scripts/kv_diffcheck.py --compare digests-main.json digests-branch.json

What is digested after each step: the scheduler's decision (admitted, resumed, suspended, preempted requests,
scheduled chunks, stall text), and V2's state — per request cache: state, lengths, block tables, released
window marks, reused tokens, host slots; per group pool: free list order, eviction order, reference counts,
generations, priorities, which blocks the prefix cache holds (each with its block position and tokens, whether
keyed in the tree or pending a first lookup), use and eviction counters; the manager's counters; the scheduler's
new-token ratio —
or V1's block tables, free queue order and per-block keys. Internal representations that a refactor may
change (how keys are computed, node objects, when a block is hung in the radix tree: lazy keying hangs a prefix
only when a lookup reaches it) are not digested, what they decide is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from typing import Any
from zlib import crc32

#: The whole state is digested every EVERY-th step (and on finishes); the scheduler's decision every step.
EVERY = 4
SCENARIOS: list[tuple[str, str, float, dict[str, Any]]] = []
for _preset in ("tiny-llama", "tiny-gemma3", "tiny-mistral", "tiny-deepseek-v3", "tiny-deepseek-v4"):
    for _wl in ("shared-prefix", "multi-turn", "no-reuse", "long-context"):
        for _scale in (1.0, 0.25):
            SCENARIOS.append((_preset, _wl, _scale, {"use_kv_cache_manager_v2": True}))
        SCENARIOS.append((_preset, _wl, 1.0, {"use_kv_cache_manager_v2": True, "enable_block_reuse": False}))
        SCENARIOS.append((_preset, _wl, 0.5, {"use_kv_cache_manager_v2": True, "enable_partial_reuse": False,
                                              "host_cache_size": 1 << 26}))
    SCENARIOS.append((_preset, "shared-prefix", 1.0, {"use_kv_cache_manager_v2": False}))
    SCENARIOS.append((_preset, "multi-turn", 0.25, {"use_kv_cache_manager_v2": False}))
# Gemma 3 27B: a shared arena cut into 31 groups (26 sliding sub-groups of 2 layers + 5 full), the many-groups paths
# (not shared-prefix: its default budget, 83 GB of pools, exceeds a small host's memory; run from the repo root)
_GEMMA27 = "tests/data/configs/gemma-3-27b-it"
for _wl in ("multi-turn", "no-reuse"):
    for _scale in (1.0, 0.25):
        SCENARIOS.append((_GEMMA27, _wl, _scale, {"use_kv_cache_manager_v2": True}))
    SCENARIOS.append((_GEMMA27, _wl, 0.25, {"use_kv_cache_manager_v2": True, "enable_swa_scratch_reuse": False}))
    SCENARIOS.append((_GEMMA27, _wl, 0.5, {"use_kv_cache_manager_v2": True, "enable_partial_reuse": False,
                                           "host_cache_size": 1 << 28}))
# DeepSeek V4's groups drawing on one slab arena (kv_cache_config.pool_arena); last, so the indexes above stay
for _wl in ("shared-prefix", "multi-turn", "no-reuse", "long-context"):
    for _scale in (1.0, 0.25):
        SCENARIOS.append(("tiny-deepseek-v4", _wl, _scale, {"use_kv_cache_manager_v2": True, "pool_arena": True}))
# Gemma 3 27B with kv_cache_config.max_page_padding 0.1 (opt-in): 6 groups of 11-layer pages, the last sliding group
# padded with 3 unused slots, the full one with 1 (layout.share_pages), the padded paths; last, as the arena's above
for _wl in ("multi-turn", "no-reuse"):
    for _scale in (1.0, 0.25):
        SCENARIOS.append((_GEMMA27, _wl, _scale, {"use_kv_cache_manager_v2": True, "max_page_padding": 0.1}))


def _prefix_block(pool: Any, b: int) -> tuple[int, int] | None:
    """What the prefix cache holds block ``b`` as: (its block position in the prefix, crc of its tokens), or None.

    Whatever the tree's nodes are (a node per block, or a node per run of blocks with the block's position in
    ``pool.pos``), this is what a user can observe, so digests of both representations compare.
    """
    node = pool.node[b]
    if node is None:
        return None
    pos = getattr(pool, "pos", None)
    if pos is None:  # a radix node per block
        return node.depth, crc32(node.tokens)
    return pos[b], crc32(node.block(pos[b] - node.start))


def _v2_state(m: Any) -> Any:
    caches = []
    for req, c in m._caches.items():
        caches.append((req.req_id, c.state.value, c.admitted, c.committed, c.history, c.capacity,
                       sorted(c.tables.items()), sorted(c.released.items()), c.reused_tokens, c.partial_hit,
                       sorted(c.host.items()) if c.host is not None else None,
                       # the marks a resume can still take back (a mark whose block changed hands is dead: whether
                       # it is dropped then or at the resume is internal)
                       sorted((k, sorted((j, bg) for j, bg in v.items()
                                         if m._pool[k].node[bg[0]] is not None and m._pool[k].gen[bg[0]] == bg[1]))
                              for k, v in c.reclaim.items())))
    pools = []
    for name, p in sorted(m._pool.items()):
        # what the prefix cache holds of the blocks nobody uses (a used block's keying is internal: lazy keying
        # hangs a running request's blocks in the tree only when a lookup reaches them)
        nodes = [_prefix_block(p, b) if not p.ref[b] else None for b in range(len(p.node))]
        # a slab pool keeps its free blocks per slab; a tied group's view has none of its own (its arena's free
        # logical ids, and the arena's free pages below)
        free = p.free_ids() if hasattr(p, "free_in") or not hasattr(p, "_free") else list(p._free)
        pools.append((name, free, p.evictable.blocks(), list(p.ref), list(p.gen), list(p.priority),
                      p.num_used, p.evictions, nodes))
    arena = getattr(m, "_arena", None)  # a shared arena: which group each block belongs to, per-group counts
    shared = None if arena is None else (list(arena.group_of), arena.used, arena.cached, arena.evicted)
    if hasattr(arena, "pages"):  # tied cuts: the free pages' order and the pages each logical block owns
        shared = (*shared, list(arena._free), list(arena.pages))
    return caches, pools, shared, sorted(m.counters.items())


def _v1_state(m: Any) -> Any:
    seqs = [(r.req_id, [b.block_id for b in s.blocks]) for r, s in m._seqs.items()]
    pool = m.pool
    blocks = [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks]
    free = [b.block_id for b in pool.free_queue] if hasattr(pool, "free_queue") else None
    return seqs, blocks, free, m.reuse_hit_tokens, pool.evictions


def _out(out: Any) -> Any:
    ids = lambda rs: [r.req_id for r in rs]  # noqa: E731
    return (ids(out.admitted), ids(out.resumed), ids(out.suspended), ids(out.preempted),
            [(c.request.req_id, c.num_tokens) for c in out.scheduled], out.stalled)


def run(selected: list[int] | None) -> dict[str, Any]:
    """Every scenario's per-step digests (or its error)."""
    from engine.driver import Driver
    from engine.simulator import simulate
    from engine.workloads import make_workload

    steps: list[str] = []
    on = [True]
    original = Driver.step

    def step(self: Any, compute: Any) -> Any:
        stats = original(self, compute)
        if not on[0]:
            return stats
        m = self.manager
        # The whole state every EVERY-th step and whenever requests finish (the scheduler's decision every step):
        # digesting every block of a large pool after every step would take minutes per scenario.
        full = len(steps) % EVERY == 0 or stats.finished or not self.has_work
        state = (_v2_state(m) if hasattr(m, "_caches") else _v1_state(m)) if full else None
        extra = getattr(self.scheduler, "new_token_ratio", None)
        steps.append(hashlib.sha1(repr((_out(stats.output), state, extra)).encode()).hexdigest()[:16])
        return stats

    Driver.step = step  # type: ignore[method-assign]
    results: dict[str, Any] = {}
    budgets: dict[tuple[str, str, Any], int] = {}
    try:
        for i, (preset, wl_name, scale, kv) in enumerate(SCENARIOS):
            if selected is not None and i not in selected:
                continue
            label = f"{i}:{preset}:{wl_name}:{scale}:{json.dumps(kv, sort_keys=True)}"
            wl = make_workload(wl_name, None, 0)
            wl = make_workload(wl_name, max(4, len(wl.requests) // 8), 0)
            steps.clear()
            t = time.perf_counter()
            try:
                if scale != 1.0:
                    key = (preset, wl_name, kv.get("use_kv_cache_manager_v2"))
                    if key not in budgets:
                        on[0] = False
                        budgets[key] = simulate(preset, wl, kv_cache_config=kv, device="cpu", log=False,
                                                progress=False).budget.bytes
                        on[0] = True
                    budget = budgets[key]
                    simulate(preset, wl, kv_cache_config={**kv, "max_gpu_total_bytes": int(budget * scale)},
                             device="cpu", log=False, progress=False)
                else:
                    simulate(preset, wl, kv_cache_config=kv, device="cpu", log=False, progress=False)
                results[label] = {"steps": list(steps)}
            except Exception as exc:
                on[0] = True  # the error text is part of the behaviour
                results[label] = {"steps": list(steps), "error": f"{type(exc).__name__}: {exc}"}
            print(f"{label}: {len(steps)} steps, {time.perf_counter() - t:.1f}s"
                  + (f" ({results[label]['error'][:80]})" if "error" in results[label] else ""), file=sys.stderr)
    finally:
        Driver.step = original  # type: ignore[method-assign]
    return results


def compare(a: dict[str, Any], b: dict[str, Any]) -> int:
    """Print where two digest files differ; the number of differing scenarios."""
    bad = 0
    for label in sorted(set(a) | set(b)):
        x, y = a.get(label), b.get(label)
        if x == y:
            continue
        bad += 1
        if x is None or y is None:
            print(f"{label}: only in one file")
            continue
        first = next((i for i, (p, q) in enumerate(zip(x["steps"], y["steps"], strict=False)) if p != q),
                     min(len(x["steps"]), len(y["steps"])))
        print(f"{label}: differs from step {first} ({len(x['steps'])} vs {len(y['steps'])} steps; "
              f"errors {x.get('error')!r} vs {y.get('error')!r})")
    print(f"{len(set(a) | set(b)) - bad} scenarios identical, {bad} differ")
    # an identical error says nothing of the steps it cut short (one the digest itself raised hid every tied
    # scenario once: "rev66"); named, so a run cut short is seen
    kinds = sorted({a[label]["error"].split(":")[0] for label in a if a[label] == b.get(label) and "error" in a[label]})
    if kinds:
        same = sum(a[label] == b.get(label) and "error" in a[label] for label in a)
        print(f"of the identical, {same} ended in the same error ({', '.join(kinds)})")
    return bad


def main() -> None:
    """Write digests, or compare two digest files (exit 1 when they differ)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write this tree's digests here")
    p.add_argument("--only", help="comma-separated scenario indexes")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = p.parse_args()
    if args.compare:
        with open(args.compare[0]) as fa, open(args.compare[1]) as fb:
            sys.exit(1 if compare(json.load(fa), json.load(fb)) else 0)
    selected = [int(x) for x in args.only.split(",")] if args.only else None
    results = run(selected)
    with open(args.out or "/dev/stdout", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
