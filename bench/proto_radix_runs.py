"""Prototype (issue 10 item 4, round 3): a radix node per block vs one per unbranched run of blocks.

Not wired into the manager. Replays the no-reuse pattern of ``bench_step_cost``'s third figure (tiny-llama:
32-token blocks, 16 prompt blocks + 4 decode blocks a request, 19 of them keyed, ~100 requests in flight)
on a pool already full of cached blocks, so every allocation evicts, three ways, in interleaved rounds:

* ``main``: the real :class:`~cache_backends.v2.radix.RadixTree` and
  :class:`~cache_backends.v2.group_pool.GroupPool`, driven as ``KVCacheManagerV2`` drives them (keying as
  ``_key_full_blocks``, release tail first as ``_release_blocks``, ``leave``); since branch ``v2-runs3`` the real
  tree keeps a node per run too, over the block-exact eviction queue (``runs_bq`` below, built in);
* ``runs``: a node per run of blocks (extended in place while its one user keeps filling it), an eviction
  queue of runs (priority, then least recently released run), eviction trimming the LRU run's tail;
* ``off``: reuse off (the same pool, nothing keyed, blocks back to the free list).

It checks that ``main`` and ``runs`` hand out the same blocks in the same order (on this pattern run-tail
eviction is block-exact LRU) and reports thread CPU time per request and each design's overhead over ``off``.
What the prototype leaves out (the redesign's real work): branching and splitting runs, several users of a
run, several layer groups, sliding-window blocks released from a run's head, partial-block matching, KV
events (keys per block of a run, computed lazily), host-tier reclaim marks.

    python -m bench.proto_radix_runs --rounds 7
    python -m bench.proto_radix_runs --attribute   # where reuse's µs go in the real simulation, per step
"""

from __future__ import annotations

import argparse
import random
import time
from collections import OrderedDict
from typing import Any

from cache_backends.hashing import pack_tokens
from cache_backends.v2.group_pool import EvictionQueue, GroupPool
from cache_backends.v2.radix import RadixTree

T = 32
PROMPT_BLOCKS, DECODE_BLOCKS = 16, 4  # 20 blocks allocated, 19 keyed (the last token is never committed)


class Main:
    """The real tree and pool, driven as the manager drives them."""

    def __init__(self, nblocks: int) -> None:
        self.pool = GroupPool("g", nblocks)
        self.tree = RadixTree({"g": (self.pool.node, self.pool.pos)})
        self.handed: list[int] = []

    def admit(self, c: dict[str, Any], packed0: bytes) -> None:
        """The admission's lookup (a miss at the first block)."""
        root = self.tree.root(None)
        if root is not None:
            root.children.get(packed0)
        c["last"], c["keyed"], c["table"] = None, 0, []

    def alloc(self, c: dict[str, Any], n: int) -> None:
        """``n`` blocks, evicting when the free list is dry."""
        out = self.pool.allocate_many(n, self.tree.detach)
        c["table"].extend(out)
        self.handed += out

    def key(self, c: dict[str, Any], packed: bytes, full: int) -> None:
        """Hang the newly full blocks (as ``_key_full_blocks``: the real tree keeps a run per unbranched stretch)."""
        d = c["keyed"]
        c["last"], segs = self.tree.extend(c["last"], None, packed, T)
        c["keyed"] = full
        owner, pos, table = self.pool.node, self.pool.pos, c["table"]
        for run, lo, hi in segs:
            blocks = run.blocks["g"]
            for i, b in enumerate(table[d:d + hi - lo], lo):
                if b >= 0 and owner[b] is None and blocks[i] < 0:
                    blocks[i] = b
                    run.held[i] += 1
                    owner[b] = run
                    pos[b] = run.start + i
            d += hi - lo

    def finish(self, c: dict[str, Any]) -> None:
        """Release tail first, leave the path."""
        self.pool.release(reversed(c["table"]), 0, True, self.tree.detach)
        if c["last"] is not None:
            self.tree.leave(c["last"])


class Run:
    """A run of full blocks with no branch inside it."""

    __slots__ = ("blocks", "children", "chunks", "first", "keys", "n", "parent", "tail_free", "users")

    def __init__(self, parent: Run | None, first: bytes) -> None:
        self.parent, self.first, self.chunks, self.n = parent, first, [], 0
        self.blocks: dict[str, list[int]] = {"g": []}
        self.children: dict[bytes, Run] | None = None
        self.users, self.tail_free, self.keys = 1, 0, None


class Runs:
    """The prototype: runs of blocks, an eviction queue of runs, eviction from the LRU run's tail."""

    def __init__(self, nblocks: int) -> None:
        self.root = Run(None, b"")
        self.root.children = {}
        self.ref, self.gen = [0] * nblocks, [0] * nblocks
        self.owner: list[Run | None] = [None] * nblocks
        self.free = list(range(nblocks - 1, -1, -1))
        self.by_prio: dict[int, OrderedDict[Run, None]] = {}
        self.heap: list[int] = []
        self.handed: list[int] = []

    def admit(self, c: dict[str, Any], packed0: bytes) -> None:
        """The admission's lookup (a miss at the first block)."""
        self.root.children.get(packed0)  # type: ignore[union-attr]
        c["run"], c["table"], c["keyed"] = None, [], 0

    def alloc(self, c: dict[str, Any], n: int) -> None:
        """``n`` blocks: free ones, then the tails of the least recently released runs of the lowest priority."""
        free = self.free
        k = min(n, len(free))
        out = free[len(free) - k:][::-1]
        del free[len(free) - k:]
        need, owner, ref = n - k, self.owner, self.ref
        while need:
            prio = self.heap[0]
            queue = self.by_prio[prio]
            run = next(iter(queue))
            cached = run.blocks["g"]
            t = min(need, run.tail_free)
            taken = cached[len(cached) - t:][::-1]  # tail first, the order the block queue pops them
            del cached[len(cached) - t:]
            for b in taken:
                if ref[b]:
                    raise RuntimeError("evicting a held block")
                owner[b] = None
            run.n -= t
            run.tail_free -= t
            out += taken
            need -= t
            if not run.tail_free:
                del queue[run]
                if not queue:
                    del self.by_prio[prio]
                    self.heap.pop(0)
                if not cached and not run.users and not run.children:
                    del run.parent.children[run.first]  # type: ignore[union-attr]
        gen = self.gen
        for b in out:
            gen[b] += 1
            ref[b] = 1
        c["table"].extend(out)
        self.handed += out

    def key(self, c: dict[str, Any], packed: bytes, full: int) -> None:
        """A new run for the first keyed blocks, then extend it in place (its only user is at its tail)."""
        run, first = c["run"], c["keyed"]
        if run is None:
            run = c["run"] = Run(self.root, packed[:8 * T])
            self.root.children[run.first] = run  # type: ignore[index]
        elif run.children or run.users != 1 or run.n != first:
            raise RuntimeError("a branch: not part of this replay")
        run.chunks.append(packed)
        run.n += full - first
        bs = c["table"][first:full]
        run.blocks["g"] += bs
        owner = self.owner
        for b in bs:
            owner[b] = run
        c["keyed"] = full

    def finish(self, c: dict[str, Any]) -> None:
        """Release tail first: the run is queued once, as the most recently released."""
        ref, owner, free, run = self.ref, self.owner, self.free, c["run"]
        cached = 0
        for b in reversed(c["table"]):
            ref[b] -= 1
            if ref[b]:
                continue
            if owner[b] is None:
                free.append(b)
            else:
                cached += 1
        if cached:
            queue = self.by_prio.get(0)
            if queue is None:
                queue = self.by_prio[0] = OrderedDict()
                self.heap.append(0)
            queue[run] = None
            queue.move_to_end(run)
            run.tail_free += cached
        run.users -= 1


class RunsBlockQueue(Runs):
    """Runs for the tree, but main's block-exact eviction queue (eviction order and semantics unchanged):
    an evicted block leaves a hole in its run, and a run nobody uses loses its empty tail."""

    def __init__(self, nblocks: int) -> None:
        super().__init__(nblocks)
        self.priority = [0] * nblocks
        self.queue = EvictionQueue(self.priority)
        self.depth = [0] * nblocks  # a block's absolute position (stable when a run is split)

    def alloc(self, c: dict[str, Any], n: int) -> None:
        """Free blocks, then the queue's next blocks; each evicted block is unhooked from its run."""
        free = self.free
        k = min(n, len(free))
        out = free[len(free) - k:][::-1]
        del free[len(free) - k:]
        if n > k:
            evicted = self.queue.pop_many(n - k)
            owner, depth = self.owner, self.depth
            for b in evicted:
                run = owner[b]
                owner[b] = None
                blocks = run.blocks["g"]  # type: ignore[union-attr]
                blocks[depth[b]] = -1  # runs start at depth 0 in this replay
                if not run.users and not run.children:  # type: ignore[union-attr]
                    while blocks and blocks[-1] < 0:
                        blocks.pop()
                        run.n -= 1  # type: ignore[union-attr]
                    if not blocks:
                        del run.parent.children[run.first]  # type: ignore[union-attr]
            out += evicted
        gen, ref = self.gen, self.ref
        for b in out:
            gen[b] += 1
            ref[b] = 1
        c["table"].extend(out)
        self.handed += out

    def key(self, c: dict[str, Any], packed: bytes, full: int) -> None:
        """As :meth:`Runs.key`, recording each block's position."""
        first = c["keyed"]
        super().key(c, packed, full)
        depth = self.depth
        for j, b in enumerate(c["table"][first:full], first):
            depth[b] = j

    def finish(self, c: dict[str, Any]) -> None:
        """Release tail first into the block queue (as ``GroupPool.release``)."""
        ref, owner, free, run = self.ref, self.owner, self.free, c["run"]
        cached: list[int] = []
        for b in reversed(c["table"]):
            ref[b] -= 1
            if ref[b]:
                continue
            if owner[b] is None:
                free.append(b)
            else:
                cached.append(b)
        if cached:
            self.queue.add_many(cached, 0)
        run.users -= 1


class Off:
    """Reuse off: the same pool, nothing keyed, every block back to the free list."""

    def __init__(self, nblocks: int) -> None:
        self.pool = GroupPool("g", nblocks)
        self.handed: list[int] = []

    def admit(self, c: dict[str, Any], packed0: bytes) -> None:
        """No lookup."""
        c["table"] = []

    def alloc(self, c: dict[str, Any], n: int) -> None:
        """Free blocks only."""
        c["table"].extend(self.pool.allocate_many(n, None))  # type: ignore[arg-type]

    def key(self, c: dict[str, Any], packed: bytes, full: int) -> None:
        """Nothing is keyed."""

    def finish(self, c: dict[str, Any]) -> None:
        """Every block back to the free list."""
        self.pool.release(reversed(c["table"]), 0, True, None)  # type: ignore[arg-type]


def lifecycle_ops(seed: int, nreq: int, inflight: int) -> list[tuple]:
    """A fixed random interleaving of ``nreq`` requests' phases, ``inflight`` at a time."""
    rng = random.Random(seed)
    ops: list[tuple] = []
    phase: dict[int, int] = {}
    pending, active = list(range(nreq)), []

    def toks(i: int, j: int, n: int) -> bytes:
        return pack_tokens([(i * 7919 + (j + x) * 31 + 1) % 32000 for x in range(n * T)])

    while pending or active:
        while pending and len(active) < inflight:
            i = pending.pop(0)
            active.append(i)
            phase[i] = 0
        i = active[rng.randrange(len(active))]
        p = phase[i]
        if p == 0:
            ops += [("admit", i, toks(i, 0, 1)), ("alloc", i, PROMPT_BLOCKS + 1),
                    ("key", i, toks(i, 0, PROMPT_BLOCKS), PROMPT_BLOCKS)]
        elif p <= DECODE_BLOCKS - 1:
            j = PROMPT_BLOCKS + p - 1
            ops += [("alloc", i, 1), ("key", i, toks(i, j, 1), j + 1)]
        else:
            ops.append(("finish", i))
            active.remove(i)
        phase[i] = p + 1
    return ops


def replay(impl: Any, ops: list[tuple]) -> float:
    """Run ``ops`` on ``impl``; thread CPU seconds."""
    caches: dict[int, dict[str, Any]] = {}
    t0 = time.thread_time()
    for op in ops:
        kind, i = op[0], op[1]
        if kind == "admit":
            c = caches[i] = {}
            impl.admit(c, op[2])
        elif kind == "alloc":
            impl.alloc(caches[i], op[2])
        elif kind == "key":
            impl.key(caches[i], op[2], op[3])
        else:
            impl.finish(caches.pop(i))
    return time.thread_time() - t0


def attribute() -> None:
    """Thread CPU per step of the manager's reuse-related calls in the no-reuse simulation, reuse on and off.

    Each listed method is wrapped with a timer (its cost, measured, is subtracted per call); nested calls are
    counted in their callers too (``extend`` inside ``_key_full_blocks``, ``pop_many`` and ``detach`` inside
    ``allocate_many``).
    """
    from collections import defaultdict

    from cache_backends.v2 import group_pool, invariants, lookup, manager, radix, release, token_runs, tree_events
    from engine.simulator import simulate
    from engine.workloads import make_workload

    acc: dict[str, float] = defaultdict(float)
    cnt: dict[str, int] = defaultdict(int)
    tt = time.thread_time

    def wrap(cls: Any, name: str) -> None:
        f = getattr(cls, name)

        def timed(*a: Any, **k: Any) -> Any:
            t = tt()
            r = f(*a, **k)
            acc[name] += tt() - t
            cnt[name] += 1
            return r
        setattr(cls, name, timed)

    for cls, names in [(radix.RadixTree, ["extend", "detach", "leave"]),
                       (manager.KVCacheManagerV2, ["_key_full_blocks", "_match", "_claim_partial", "_admit"]),
                       (group_pool.EvictionQueue, ["pop_many", "add_many"]),
                       (group_pool.GroupPool, ["allocate_many", "release"])]:
        for n in names:
            wrap(cls, n)
    # every module of the manager's that binds them (split65 spread the callers over the mixins' modules: timing
    # manager's names alone missed _key_full_blocks', the lookups' and the releases' calls)
    for module in (manager, lookup, release, tree_events, invariants, token_runs):
        for fn in ("token_slice", "pack_tokens"):
            if hasattr(module, fn):
                setattr(module, fn, _timed_fn(getattr(module, fn), fn, acc, cnt))

    def nop() -> None:
        pass

    for _ in range(100_000):
        t = tt()
        nop()
        acc["_wrapper"] += tt() - t
    per_call = acc.pop("_wrapper") / 100_000
    wl = make_workload("no-reuse", None, 0)
    for reuse in (True, False):
        acc.clear()
        cnt.clear()
        report = simulate("tiny-llama", wl, device="cpu", log=False, progress=False,
                          kv_cache_config={"use_kv_cache_manager_v2": True, "enable_block_reuse": reuse})
        (result,) = report.results.values()
        steps = result.metrics.engine_steps
        print(f"reuse {'on' if reuse else 'off'}: {steps} steps, kv time {result.metrics.kv_seconds / steps * 1e6:.0f} "
              f"µs/step (mean, timers included), {result.metrics.evictions / steps:.1f} evictions/step")
        for k in sorted(acc, key=lambda k: -acc[k]):
            own = acc[k] - per_call * cnt[k]
            print(f"  {k:18s} {cnt[k] / steps:5.2f} calls/step {own / steps * 1e6:6.1f} µs/step "
                  f"{own / cnt[k] * 1e6:6.2f} µs/call")


def _timed_fn(f: Any, name: str, acc: dict[str, float], cnt: dict[str, int]) -> Any:
    def timed(*a: Any) -> Any:
        t = time.thread_time()
        r = f(*a)
        acc[name] += time.thread_time() - t
        cnt[name] += 1
        return r
    return timed


def main(argv: list[str] | None = None) -> None:
    """Interleaved rounds of the three designs; medians per request and overhead ratios."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--attribute", action="store_true", help="time the manager's reuse calls in the simulation instead")
    args = p.parse_args(argv)
    if args.attribute:
        attribute()
        return
    inflight = 100
    nblocks = inflight * (PROMPT_BLOCKS + DECODE_BLOCKS) + 3000
    warm, ops = lifecycle_ops(1, 600, inflight), lifecycle_ops(2, args.requests, inflight)
    impls = {"main": Main, "runs": Runs, "runs_bq": RunsBlockQueue, "off": Off}
    res: dict[str, list[float]] = {k: [] for k in impls}
    for r in range(args.rounds):
        handed = {}
        for name in (("main", "runs", "runs_bq", "off") if r % 2 == 0 else ("off", "runs_bq", "runs", "main")):
            impl = impls[name](nblocks)
            replay(impl, warm)  # the pool fills with cached blocks: from here on every allocation evicts
            res[name].append(replay(impl, ops) / args.requests * 1e6)
            handed[name] = impl.handed
        if not handed["main"] == handed["runs"] == handed["runs_bq"]:
            raise SystemExit("main and runs handed out different blocks: eviction order differs")

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    over = sorted((r - o) / (m - o) for r, m, o in zip(res["runs"], res["main"], res["off"], strict=True))
    over_bq = sorted((r - o) / (m - o) for r, m, o in zip(res["runs_bq"], res["main"], res["off"], strict=True))
    print(f"µs per request (20 blocks allocated, each evicting; 19 keyed; 1 admission; 1 release), median of "
          f"{args.rounds} rounds: main {med(res['main']):.1f}, runs {med(res['runs']):.1f}, "
          f"runs + block queue {med(res['runs_bq']):.1f}, off {med(res['off']):.1f}")
    main_over, runs_over = med(res["main"]) - med(res["off"]), med(res["runs"]) - med(res["off"])
    print(f"overhead over off: main {main_over:.1f}, runs {runs_over:.1f} µs; "
          f"runs/main {over[len(over) // 2]:.2f} ({over[0]:.2f} to {over[-1]:.2f}); same blocks in the same order")
    print(f"runs + block queue: overhead {med(res['runs_bq']) - med(res['off']):.1f} µs; runs_bq/main "
          f"{over_bq[len(over_bq) // 2]:.2f} ({over_bq[0]:.2f} to {over_bq[-1]:.2f})")


if __name__ == "__main__":
    main()
