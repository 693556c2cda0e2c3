"""Prototype in the real step (issue 10 item 4, round 3): ``KVCacheManagerV2`` with runs of blocks, no-reuse only.

An experiment, not a manager: :class:`RunsManagerV2` swaps the per-block radix tree and block eviction queue of
``KVCacheManagerV2`` for :mod:`bench.proto_radix_runs`' design (a node per run, extended in place by its one
user; an eviction queue of runs, lowest priority then least recently released, trimmed from the tail) and
raises ``NotImplementedError`` on anything the no-reuse workload does not do (a prefix hit, a branch, several
layer groups, a shared arena, sliding windows, KV events, a suspend). Each round simulates tiny-llama
no-reuse four ways in one process — reuse off, main's manager, the runs manager, and the runs manager keeping
token ids unpacked (``runs_ids``), and runs over main's block-exact eviction queue (``runs_bq``) — in
alternating order, times
manager + scheduler per step in thread CPU (as ``bench_step_cost``), and checks that the runs manager takes
the same steps and evicts as many blocks as main's.

    python -m bench.proto_radix_runs_sim --rounds 5
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import cache_backends.v2 as v2
from cache_backends.hashing import pack_tokens
from cache_backends.v2.group_pool import GroupPool
from cache_backends.v2.manager import KVCacheManagerV2
from cache_backends.v2.radix import RadixNode
from cache_backends.v2.token_runs import token_slice


class Run:
    """A run of full blocks under a root (no-reuse: every request's path is one run)."""

    __slots__ = ("blocks", "children", "chunks", "n", "parent", "tail_free", "tokens", "users")

    def __init__(self, parent: RadixNode, tokens: bytes) -> None:
        self.parent, self.tokens, self.chunks, self.n = parent, tokens, [], 0
        self.blocks: dict[str, int] = {}  # what partial matching reads (a run with every group: never a candidate)
        self.children: dict = {}
        self.users, self.tail_free = 1, 0


class RunQueue:
    """Runs with cached tail blocks: lowest priority first, then least recently released."""

    def __init__(self) -> None:
        self.by_prio: dict[int, OrderedDict[Run, None]] = {}
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __contains__(self, block: int) -> bool:
        raise NotImplementedError("the prototype never takes a cached block back")


class RunsPool(GroupPool):
    """GroupPool whose cached blocks sit at the tails of runs; eviction trims the LRU run's tail."""

    def __init__(self, name: str, num_blocks: int, tree: RunsTree) -> None:
        super().__init__(name, num_blocks)
        self.evictable = RunQueue()  # type: ignore[assignment]
        self.tree = tree

    def allocate_many(self, n: int, detach: Any) -> list[int]:
        """Free blocks, then the tails of the least recently released runs."""
        free, queue = self._free, self.evictable
        if n > len(free) + queue.count:  # type: ignore[attr-defined]
            raise IndexError(f"group {self.name}: {n} blocks asked")
        k = min(n, len(free))
        out = free[len(free) - k:][::-1]
        del free[len(free) - k:]
        need, owner, ref = n - k, self.node, self.ref
        while need:
            prio = min(queue.by_prio)  # type: ignore[attr-defined]
            runs = queue.by_prio[prio]  # type: ignore[attr-defined]
            run = next(iter(runs))
            cached = run.blocks["_list"]
            t = min(need, run.tail_free)
            taken = cached[len(cached) - t:][::-1]  # tail first: the order the block queue pops them
            del cached[len(cached) - t:]
            for b in taken:
                if ref[b]:
                    raise RuntimeError("evicting a held block")
                owner[b] = None
            run.n -= t
            run.tail_free -= t
            queue.count -= t  # type: ignore[attr-defined]
            self.tree.num_nodes -= t
            self.evictions += t
            out += taken
            need -= t
            if not run.tail_free:
                del runs[run]
                if not runs:
                    del queue.by_prio[prio]  # type: ignore[attr-defined]
                if not cached and not run.users:
                    self.tree.unhook(run)
        gen = self.gen
        for b in out:
            gen[b] += 1
            ref[b] = 1
        self.num_used += n
        return out

    def release(self, blocks: Iterable[int], priority: int, keep_cached: bool, detach: Any) -> None:
        """Blocks reaching zero: cached ones mark their run most recently released, others go free."""
        if not keep_cached:
            raise NotImplementedError("dropping cached blocks")
        ref, owner, free = self.ref, self.node, self._free
        run, cached, released = None, 0, 0
        for b in blocks:
            if b < 0:
                continue
            ref[b] -= 1
            if ref[b]:
                continue
            released += 1
            o = owner[b]
            if o is None:
                free.append(b)
            else:
                if run is not None and o is not run:
                    raise NotImplementedError("a release spanning runs")
                run = o
                cached += 1
        self.num_used -= released
        if cached:
            queue = self.evictable
            runs = queue.by_prio.get(priority)  # type: ignore[attr-defined]
            if runs is None:
                runs = queue.by_prio[priority] = OrderedDict()  # type: ignore[attr-defined]
            runs[run] = None
            runs.move_to_end(run)
            run.tail_free += cached  # type: ignore[union-attr]
            queue.count += cached  # type: ignore[attr-defined]

    def decref(self, b: int, priority: int, keep_cached: bool, detach: Any) -> None:
        """One holder lets go of ``b``."""
        self.release((b,), priority, keep_cached, detach)

    def incref(self, b: int) -> None:
        """Never needed without prefix hits."""
        raise NotImplementedError("sharing a cached block")


class RunsBlockQueuePool(GroupPool):
    """GroupPool keeping main's block-exact eviction queue over runs: an evicted block leaves a hole in its run,
    and a run nobody uses loses its empty tail (eviction order is main's, block for block)."""

    def __init__(self, name: str, num_blocks: int, tree: RunsTree) -> None:
        super().__init__(name, num_blocks)
        self.tree = tree
        self.pos = [0] * num_blocks  # a cached block's index in its run's block list

    def allocate_many(self, n: int, detach: Any) -> list[int]:
        """Free blocks, then the queue's next blocks, each unhooked from its run."""
        free = self._free
        if n > len(free) + len(self.evictable):
            raise IndexError(f"group {self.name}: {n} blocks asked")
        k = min(n, len(free))
        out = free[len(free) - k:][::-1]
        del free[len(free) - k:]
        if n > k:
            evicted = self.evictable.pop_many(n - k)
            owner, pos = self.node, self.pos
            for b in evicted:
                run = owner[b]
                owner[b] = None
                blocks = run.blocks["_list"]  # type: ignore[union-attr]
                blocks[pos[b]] = -1
                if not run.users:  # type: ignore[union-attr]
                    while blocks and blocks[-1] < 0:
                        blocks.pop()
                    if not blocks:
                        self.tree.unhook(run)  # type: ignore[arg-type]
            self.tree.num_nodes -= n - k
            self.evictions += n - k
            out += evicted
        gen, ref = self.gen, self.ref
        for b in out:
            gen[b] += 1
            ref[b] = 1
        self.num_used += n
        return out

    def release(self, blocks: Iterable[int], priority: int, keep_cached: bool, detach: Any) -> None:
        """As GroupPool's (cached blocks queued block by block)."""
        if not keep_cached:
            raise NotImplementedError("dropping cached blocks")
        super().release(blocks, priority, keep_cached, detach)

    def incref(self, b: int) -> None:
        """Never needed without prefix hits."""
        raise NotImplementedError("sharing a cached block")


class RunsTree:
    """Roots (real radix nodes, so partial matching's probe runs as in main) over runs."""

    def __init__(self) -> None:
        self.roots: dict[str | None, RadixNode] = {}
        self.num_nodes = 0
        self.pending: dict = {}  # main's lazy keying is off here (the prototype keys every block, as main then did)
        self.latent: dict = {}
        #: main's kept lookups (``RadixTree.version`` / ``looked``): the prototype tracks none of its changes, so its
        #: version moves at every read and no answer is kept across passes (each pass looks up, as main did before)
        self.looked: dict = {}
        self.looked_at = -1
        self._version = 0

    @property
    def version(self) -> int:
        """A new number at every read: no kept lookup is ever taken as current (see ``looked``)."""
        self._version += 1
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        self._version = value

    def pending_prefix(self, salt: str | None, first: bytes) -> None:
        """No pending prefixes here: every block is keyed (see ``pending``)."""
        return None

    def root(self, salt: str | None) -> RadixNode | None:
        """A salt's root."""
        return self.roots.get(salt)

    def new_run(self, salt: str | None, first: bytes) -> Run:
        """A run below the salt's root starting with block ``first`` (NotImplementedError if one exists)."""
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = RadixNode(None, salt, 0, (), 0)
        if first in root.children:
            raise NotImplementedError("a branch below an existing run")
        run = Run(root, first)
        if not root.children:
            root.children = {}
        root.children[first] = run  # type: ignore[index]
        if root.by_first is not None:
            root.by_first.setdefault(first[:8], {})[first] = run  # type: ignore[dict-item]
        return run

    def unhook(self, run: Run) -> None:
        """Remove an empty, unused run from its root."""
        root = run.parent
        del root.children[run.tokens]  # type: ignore[attr-defined]
        if root.by_first is not None:
            siblings = root.by_first[run.tokens[:8]]
            del siblings[run.tokens]
            if not siblings:
                del root.by_first[run.tokens[:8]]

    def leave(self, run: Run) -> None:
        """A cache lets go of its run (an unused run keeps only up to its last cached block)."""
        run.users -= 1
        blocks = run.blocks["_list"]
        if not run.users:
            while blocks and blocks[-1] < 0:
                blocks.pop()
            if not blocks:
                self.unhook(run)


class RunsManagerV2(KVCacheManagerV2):
    """``KVCacheManagerV2`` keyed by runs of blocks (no-reuse workloads only; see the module doc)."""

    #: pack a run's tokens as main does (True), or keep the token ids and pack only a run's first block (False)
    PACK = True
    #: the pool: a queue of runs, or main's block-exact queue over runs
    POOL: type = RunsPool

    def __init__(self, pools: Any, options: Any) -> None:
        super().__init__(pools, options)
        if len(self.groups) != 1 or self._arena is not None or self._sliding or not self._reuse:
            raise NotImplementedError(f"the prototype handles one full-attention group with reuse on: "
                                      f"{len(self.groups)} groups, arena {self._arena is not None}, "
                                      f"sliding {bool(self._sliding)}, reuse {self._reuse}")
        self._tree = RunsTree()  # type: ignore[assignment]
        self._lazy = False  # the round-3 comparison: every block keyed
        name = self.groups[0].name
        pool = self.POOL(name, pools.num_blocks[name], self._tree)
        self._pool = {name: pool}
        self._pool_sets = [(pool, [name])]
        self._group_pools = [(name, self.groups[0].tokens_per_block, pool)]
        self._attach_steps = [(name, 1, pool.node, pool.pos)]

    def _key_full_blocks(self, cache: Any) -> None:
        """Extend the cache's run in place (a new run for its first blocks)."""
        if self.kv_events is not None:
            raise NotImplementedError("KV events")
        T = self.T
        run = cache.last
        first, full = (run.n if run is not None else 0), cache.committed // T
        if first >= full:
            return
        ids = token_slice(cache.request, first * T, full * T)
        if self.PACK:  # as main: the run's tokens packed as the key encodes them
            ids = pack_tokens(ids)  # type: ignore[assignment]
        if run is None:  # only a run's first block must be packed: it keys the parent's children
            first_block = ids[:8 * T] if self.PACK else pack_tokens(ids[:T])
            run = self._tree.new_run(cache.request.salt, first_block)  # type: ignore[attr-defined]
            run.blocks["_list"] = []
            cache.last = run
        elif run.users != 1 or run.children:
            raise NotImplementedError("a shared run")
        run.chunks.append(ids)
        run.n = full
        cache.key_at = (full + 1) * T
        name, _, owner, _ = self._attach_steps[0]
        blocks = cache.tables[name][first:full]
        for b in blocks:
            if b < 0 or owner[b] is not None:
                raise NotImplementedError("a released or shared block")
            owner[b] = run
        pos = getattr(self._pool[name], "pos", None)
        if pos is not None:
            for j, b in enumerate(blocks, len(run.blocks["_list"])):
                pos[b] = j
        run.blocks["_list"] += blocks
        self._tree.num_nodes += full - first

    def suspend(self, request: Any) -> bool:
        """Not part of the experiment (the host tier's reclaim marks would need runs)."""
        raise NotImplementedError("suspend")

    def _match(self, request: Any) -> tuple[int, list]:
        """The first block's lookup (a hit is not part of the experiment)."""
        root = self._tree.root(request.salt)
        if root is None or request.num_tokens - 1 < self.T:
            return 0, []
        if root.children.get(pack_tokens(token_slice(request, 0, self.T))) is not None:
            raise NotImplementedError("a prefix hit")
        return 0, []


class RunsIdsManagerV2(RunsManagerV2):
    """:class:`RunsManagerV2` keeping a run's token ids unpacked (only its first block is packed)."""

    PACK = False


class RunsBlockQueueManagerV2(RunsManagerV2):
    """:class:`RunsManagerV2` over main's block-exact eviction queue (:class:`RunsBlockQueuePool`)."""

    POOL = RunsBlockQueuePool


def main(argv: list[str] | None = None) -> None:
    """Interleaved rounds of reuse off, main's manager and the runs manager on tiny-llama no-reuse."""
    from bench.common import thread_cpu_step_clock
    from engine.simulator import simulate
    from engine.workloads import make_workload

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    wl = make_workload("no-reuse", None, 0)
    sides = ("off", "main", "runs", "runs_ids", "runs_bq")
    classes = {"runs": RunsManagerV2, "runs_ids": RunsIdsManagerV2, "runs_bq": RunsBlockQueueManagerV2}
    res: dict[str, list[float]] = {s: [] for s in sides}
    mean: dict[str, list[float]] = {s: [] for s in sides}  # kv_seconds per step: every step counted
    facts: dict[str, tuple] = {}
    with thread_cpu_step_clock():
        for r in range(args.rounds):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                if side in classes:
                    v2.KVCacheManagerV2 = classes[side]  # type: ignore[misc]
                try:
                    report = simulate("tiny-llama", wl, device="cpu", log=False, progress=False,
                                      kv_cache_config={"use_kv_cache_manager_v2": True,
                                                       "enable_block_reuse": side != "off"})
                finally:
                    v2.KVCacheManagerV2 = KVCacheManagerV2  # type: ignore[misc]
                (result,) = report.results.values()
                m = result.metrics
                res[side].append(m.step_time_us_median)
                mean[side].append(m.kv_seconds / m.engine_steps * 1e6)
                facts[side] = (m.engine_steps, m.evictions, m.finished, m.hit_rate)
    if not facts["runs"] == facts["runs_ids"] == facts["runs_bq"] == facts["main"]:
        raise SystemExit(f"the runs managers differ from main's: {facts}")

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    def over(side: str, of: dict[str, list[float]] = res) -> list[float]:
        return sorted(b / a - 1 for a, b in zip(of["off"], of[side], strict=True))

    print(f"tiny-llama no-reuse, median step µs (thread CPU) over {args.rounds} rounds: off {med(res['off']):.0f}, "
          f"main {med(res['main']):.0f}, runs {med(res['runs']):.0f}, "
          f"runs_ids {med(res['runs_ids']):.0f}, runs_bq {med(res['runs_bq']):.0f}; "
          f"(steps, evictions, finished, hit rate) "
          f"{facts['main']} all")
    for side in ("main", "runs", "runs_ids", "runs_bq"):
        o = over(side)
        a = over(side, mean)
        print(f"  reuse overhead, {side}: median step {o[len(o) // 2]:+.1%} (median of rounds; {o[0]:+.1%} to "
              f"{o[-1]:+.1%}); mean step {a[len(a) // 2]:+.1%} ({a[0]:+.1%} to {a[-1]:+.1%}), "
              f"{med(mean['off']):.0f} -> {med(mean[side]):.0f} µs; least disturbed round (min mean step) "
              f"{min(mean['off']):.0f} -> {min(mean[side]):.0f} µs = {min(mean[side]) / min(mean['off']) - 1:+.1%}")


if __name__ == "__main__":
    main()
