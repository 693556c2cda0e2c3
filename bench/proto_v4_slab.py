"""Prototype, not a manager: DeepSeek V4's split pools against one slab arena whose memory flows between groups.

DeepSeek V4's layer groups have pages of unequal size (tiny-deepseek-v4: ``sliding_w128`` 98,304 B a block,
``csa_c4`` 12,288 B, ``hca_c128`` 384 B; each divides the next), so they cannot share one arena of equal pages as
Gemma's groups do, and the budget is split between per-group pools once (``KvLayout.split_budget``). Memory a
group does not use then sits idle while another waits. This module measures what a **slab arena** would gain: the
budget is cut into slabs of the largest page; a slab is owned by one group at a time and carved into
``slab / page`` blocks of that group; a group takes a slab when its own blocks run out, and a slab none of whose
blocks is in use goes back.

:class:`SlabManagerV2` is ``KVCacheManagerV2`` with each group's ``GroupPool`` replaced by a :class:`SlabPool` whose
block ids are global positions in the arena (block ``b`` of a group with ``k`` blocks a slab lies in slab ``b // k``:
a strided, block-major view of one byte arena, so ``pool[block_ids]`` readers would keep working). Nothing is
allocated (the simulator's pools are unbacked). The slab policy, kept simple:

* **Where a group's blocks come from**, in order: its own free blocks (those of the slab with the fewest free blocks
  that holds a used block first: best fit, so empty slabs stay whole), then a free slab of the arena, then its own
  cached blocks (LRU, as today), then a slab reclaimed from another group (``--policy own-first``, the default).
  ``--policy oldest`` instead compares, block by block, this group's next cached block to evict with the least
  recently cached-into reclaimable slab of the others and takes the older (one global release clock; priorities and
  shared prefixes are not compared across groups). ``--policy free-only`` never reclaims: memory flows only through
  slabs whose blocks all went free (no group evicts another's cache).
* **Which slab is reclaimed**: one whose blocks are all free or cached (none in use), from a group that can spare it
  (its free + cached blocks, less what the same allocation asks of it, cover the slab), the one holding the fewest
  cached bytes (ties: lowest id). Its cached blocks are evicted (unhooked from the radix tree, as an eviction is).
* **A slab whose blocks are all free** (none in use, none cached) goes back to the arena at once.
* **Joint feasibility**: every check of room the manager makes (``short_of``/``shortfall``, ``fit_tokens``,
  ``fit_tokens_new``, the reservation of a step's blocks, ``never_fits``) asks, over all groups at once: the slabs
  the groups short of their own free + cached blocks need (``ceil(deficit / blocks per slab)`` each) must not
  exceed the free slabs plus the whole-slab spares of the others. An allocation takes those slabs first, then every
  group allocates from its own blocks, so a check that passes never fails to allocate.

Per cell three runs at one budget (the grid's, as ``bench_grid --only split``): (a) today's split, (b) the best static
split for the workload (``max_seq_len`` set to its longest request, as BENCHMARKS.md's split section did), (c) the
slab arena over the same bytes (``budget // 98,304`` slabs; ``max_seq_len`` as in (a)). The slab columns add how
fragmented the arena was, sampled once a step: slabs owned and partly in use, and the bytes of owned slabs that a
used block pins to a group without using them (free or cached blocks beside a used one), as a share of the arena.

    python -m bench.proto_v4_slab                      # all six workloads x three budgets (a few minutes)
    python -m bench.proto_v4_slab --workloads no-reuse --budgets tight
    python -m bench.proto_v4_slab --policy oldest --check   # another slab policy; the arena checked every step
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import cache_backends.v2 as v2
from cache_backends.interface import ManagerOptions
from cache_backends.pools import BlockPools
from cache_backends.request import Request
from cache_backends.v2.group_pool import Detach, GroupPool
from cache_backends.v2.manager import KVCacheManagerV2, _most_fitting

PRESET = "tiny-deepseek-v4"


class SlabArena:
    """Who owns each slab, the free slabs, and the slab-level counters of one run."""

    def __init__(self, num_slabs: int, slab_bytes: int, policy: str = "own-first") -> None:
        self.num_slabs = num_slabs
        self.slab_bytes = slab_bytes
        if policy not in POLICIES:
            raise ValueError(f"slab policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.clock = 0  # releases so far, every group's: orders cached blocks across groups ("oldest")
        self.touched = [0] * num_slabs  # the clock when a block of the slab was last cached
        self.pending: list[int] = []  # per group, blocks an allocation in progress still asks (reclaims spare them)
        self.owner = [-1] * num_slabs
        self.free = list(range(num_slabs - 1, -1, -1))  # a stack: low ids first
        self.pools: list[SlabPool] = []
        self.counters = {"slabs_taken": 0, "slabs_reclaimed": 0, "evicted_by_reclaim": 0, "slabs_returned": 0}
        self.partly: list[int] = []  # per step: owned slabs with a used block and a block not in use
        self.pinned: list[float] = []  # per step: bytes not in use in slabs a used block pins, over arena bytes
        self.owned: list[float] = []  # per step: slabs owned, over all slabs

    def check(self) -> None:
        """The prototype's invariants: every slab free or owned by one group, per pool free + used + cached ==
        the blocks of its slabs, and a slab with every block free is not kept."""
        owned = [0] * len(self.pools)
        for o in self.owner:
            if o >= 0:
                owned[o] += 1
        if len(self.free) + sum(owned) != self.num_slabs or len(set(self.free)) != len(self.free):
            raise AssertionError(f"slabs: {len(self.free)} free + {sum(owned)} owned != {self.num_slabs}")
        if any(self.owner[s] >= 0 for s in self.free):
            raise AssertionError("a free slab has an owner")
        for i, pool in enumerate(self.pools):
            if pool.owned != owned[i] or pool.num_blocks != max(1, owned[i] * pool.per):
                raise AssertionError(f"group {pool.name}: owns {owned[i]} slabs, counts {pool.owned}")
            used = sum(1 for b, r in enumerate(pool.ref) if r > 0)
            if used != pool.num_used or pool.nfree + used + len(pool.evictable) != owned[i] * pool.per:
                raise AssertionError(f"group {pool.name}: {pool.nfree} free + {used} used + {len(pool.evictable)} "
                                     f"cached != {owned[i] * pool.per}")
            for b in [*pool.evictable.blocks(), *(b for bl in pool.free_in.values() for b in bl)]:
                if self.owner[b // pool.per] != i:
                    raise AssertionError(f"group {pool.name}: block {b} in a slab it does not own")
            for s, blocks in pool.free_in.items():
                if len(blocks) >= pool.per:
                    raise AssertionError(f"group {pool.name}: slab {s} is all free but kept")

    def sample(self) -> None:
        """Fragmentation now: owned slabs partly in use, and the bytes they pin without using."""
        partly, pinned, owned = 0, 0, 0
        for pool in self.pools:
            per, page = pool.per, pool.page_bytes
            for s in pool.slabs():
                owned += 1
                u = pool.used_in[s]
                if 0 < u < per:
                    partly += 1
                if u:
                    pinned += (per - u) * page
        self.partly.append(partly)
        self.pinned.append(pinned / (self.num_slabs * self.slab_bytes))
        self.owned.append(owned / self.num_slabs)

    def acquire(self, need: Sequence[int], detach: Detach) -> None:
        """Give every group short of its own free + cached blocks for ``need`` (per group) the slabs it lacks: free
        slabs first, then reclaimed ones (:class:`SlabPool` docstring); the caller checked :meth:`short` first."""
        pools = self.pools
        self.pending = [max(0, n) for n in need]
        for i, pool in enumerate(pools):
            n = need[i]
            while n > pool.available:
                if self.free:
                    s = self.free.pop()
                    self.counters["slabs_taken"] += 1
                else:
                    s = self._reclaim(i, need, detach)
                pool.take_slab(s)

    def _reclaim(self, taker: int, need: Sequence[int], detach: Detach) -> int:
        """A slab with no block in use, from a group that can spare it after ``need``: the fewest cached bytes."""
        best: tuple[int, int, int] | None = None
        for j, pool in enumerate(self.pools):
            if j == taker or not pool.empty or pool.available - pool.per < max(0, need[j]):
                continue
            for s in pool.empty:
                cost = (pool.per - len(pool.free_in.get(s, ()))) * pool.page_bytes
                if best is None or (cost, s) < best[:2]:
                    best = (cost, s, j)
        if best is None:
            raise IndexError(f"slab arena: no slab to give group {self.pools[taker].name}")
        _, s, j = best
        self.counters["evicted_by_reclaim"] += self.pools[j].give_up(s, detach)
        self.counters["slabs_reclaimed"] += 1
        return s

    def oldest_slab(self, taker: int) -> tuple[int, int, int] | None:
        """("oldest" policy) (last cached at, slab, group) of the least recently touched slab with no block in use
        that another group can spare beside what the allocation in progress asks of it; None if there is none."""
        best: tuple[int, int, int] | None = None
        touched, pending = self.touched, self.pending
        for j, pool in enumerate(self.pools):
            if j == taker or not pool.empty:
                continue
            if pool.available - pool.per < (pending[j] if j < len(pending) else 0):
                continue
            for s in pool.empty:
                if best is None or touched[s] < best[0]:
                    best = (touched[s], s, j)
        return best

    def short(self, need: Sequence[int], extra: Sequence[int] | None = None) -> int | None:
        """The first group whose ``need`` the arena cannot meet together with the others' (``extra``: blocks more,
        or fewer when negative, each group has), or None when every need fits at once."""
        want, offer, first = 0, len(self.free), None
        for i, pool in enumerate(self.pools):
            have = pool.available + (extra[i] if extra else 0)
            n = max(0, need[i])
            if n > have:
                want += -(-(n - have) // pool.per)
                if first is None:
                    first = i
            elif pool.empty and self.policy != "free-only":
                offer += min(len(pool.empty), (have - n) // pool.per)
        return first if want > offer else None


class SlabPool(GroupPool):
    """A group's blocks in the slabs it owns; block ``b`` lies in slab ``b // per`` (``per`` blocks a slab)."""

    def __init__(self, name: str, arena: SlabArena, index: int, page_bytes: int) -> None:
        per = arena.slab_bytes // page_bytes
        super().__init__(name, arena.num_slabs * per)  # ids of every slab; only owned slabs' ids are ever used
        self.arena, self.index, self.per, self.page_bytes = arena, index, per, page_bytes
        self._free = []  # unused: free blocks are kept per slab
        self.free_in: dict[int, list[int]] = {}  # owned slab -> its free blocks (a stack: low ids first)
        self.nfree = 0
        self.used_in = [0] * arena.num_slabs  # blocks in use per slab
        self.empty: set[int] = set()  # owned slabs with no block in use (free or cached only): reclaimable
        self.owned = 0
        self.num_blocks = 1  # blocks of the owned slabs (at least 1: the manager divides by it)
        self.touched_at = [0] * (arena.num_slabs * per)  # the arena's clock when the block was last cached

    @property
    def num_free(self) -> int:
        """Free blocks in the owned slabs."""
        return self.nfree

    @property
    def available(self) -> int:
        """Free plus cached blocks in the owned slabs (the arena's free slabs are not counted: checks are joint)."""
        return self.nfree + len(self.evictable)

    def slabs(self) -> Iterable[int]:
        """The owned slabs."""
        idx, owner = self.index, self.arena.owner
        return (s for s in range(self.arena.num_slabs) if owner[s] == idx)

    def take_slab(self, s: int) -> None:
        """Own slab ``s`` (free): all its blocks free."""
        self.arena.owner[s] = self.index
        lo = s * self.per
        self.free_in[s] = list(range(lo + self.per - 1, lo - 1, -1))
        self.nfree += self.per
        self.empty.add(s)
        self.owned += 1
        self.num_blocks = max(1, self.owned * self.per)

    def _drop_slab(self, s: int) -> None:
        self.arena.owner[s] = -1
        self.empty.discard(s)
        self.owned -= 1
        self.num_blocks = max(1, self.owned * self.per)

    def give_up(self, s: int, detach: Detach) -> int:
        """Hand slab ``s`` (no block in use) back for another group: its cached blocks evicted; how many."""
        lo = s * self.per
        free = set(self.free_in.pop(s, ()))
        self.nfree -= len(free)
        cached = [b for b in range(lo, lo + self.per) if b not in free]
        if cached:
            self.evictable.remove_many(cached)
            detach(self.name, cached)
            self.evictions += len(cached)
        self._drop_slab(s)
        return len(cached)

    def _to_free(self, blocks: Iterable[int]) -> None:
        per, free_in = self.per, self.free_in
        for b in blocks:
            s = b // per
            lst = free_in.setdefault(s, [])
            lst.append(b)
            self.nfree += 1
            if len(lst) == per:  # every block free: back to the arena
                del free_in[s]
                self.nfree -= per
                self._drop_slab(s)
                self.arena.free.append(s)
                self.arena.counters["slabs_returned"] += 1

    def _cached(self, blocks: Sequence[int]) -> None:
        arena = self.arena
        arena.clock += 1
        now, per, at, touched = arena.clock, self.per, self.touched_at, arena.touched
        for b in blocks:
            at[b] = now
            touched[b // per] = now

    def _used(self, blocks: Iterable[int]) -> None:
        per, used_in, empty = self.per, self.used_in, self.empty
        for b in blocks:
            s = b // per
            if not used_in[s]:
                empty.discard(s)
            used_in[s] += 1

    def _unused(self, b: int) -> None:
        s = b // self.per
        self.used_in[s] -= 1
        if not self.used_in[s]:
            self.empty.add(s)

    def allocate_many(self, n: int, detach: Detach) -> list[int]:
        """``n`` blocks with ``ref == 1``: own free ones (best fit), a free slab's, own cached ones (LRU), then a
        reclaimed slab's (only where the manager's joint checks were bypassed: a fork's or a copy's block)."""
        if n > self.available + len(self.arena.free) * self.per:
            need = [0] * len(self.arena.pools)
            need[self.index] = n
            if self.arena.short(need) is not None:
                raise IndexError(f"group {self.name}: {n} blocks asked, {self.available} free or cached")
            self.arena.acquire(need, detach)
        out: list[int] = []
        while len(out) < n:
            if not self.nfree:
                if self.arena.free:  # a free slab before evicting cached blocks
                    self.take_slab(self.arena.free.pop())
                    self.arena.counters["slabs_taken"] += 1
                elif self.arena.policy == "oldest" and self._reclaim_older(detach):
                    pass  # a slab of another group, cached longer ago than this group's next eviction
                else:
                    k = n - len(out) if self.arena.policy != "oldest" else 1
                    evicted = self.evictable.pop_many(k)
                    detach(self.name, evicted)
                    self.evictions += len(evicted)
                    out += evicted
                    continue
            used_in = self.used_in
            s = min(self.free_in, key=lambda s: (not used_in[s], len(self.free_in[s]), s))
            lst = self.free_in[s]
            k = min(n - len(out), len(lst))
            out += lst[len(lst) - k:][::-1]
            del lst[len(lst) - k:]
            self.nfree -= k
            if not lst:
                del self.free_in[s]
        gen, ref = self.gen, self.ref
        for b in out:
            gen[b] += 1
            ref[b] = 1
        self.num_used += n
        self._used(out)
        if self.index < len(self.arena.pending):
            self.arena.pending[self.index] = max(0, self.arena.pending[self.index] - n)
        return out

    def _reclaim_older(self, detach: Detach) -> bool:
        """("oldest") Take another group's slab if it was last cached into before this group's next block to evict
        was; whether it did. Priorities and shared prefixes are not compared across groups (a prototype)."""
        if not len(self.evictable):
            mine = None
        else:
            queue = self.evictable
            b = next(iter(queue._by_key[min(queue._by_key)]))  # the next pop (buckets are dropped once empty)
            mine = self.touched_at[b]
        other = self.arena.oldest_slab(self.index)
        if other is None or (mine is not None and other[0] >= mine):
            return False
        _, s, j = other
        self.arena.counters["evicted_by_reclaim"] += self.arena.pools[j].give_up(s, detach)
        self.arena.counters["slabs_reclaimed"] += 1
        self.take_slab(s)
        return True

    def incref(self, b: int) -> None:
        """One more holder of ``b``; a cached block comes into use."""
        was = self.ref[b]
        super().incref(b)
        if not was:
            self._used((b,))

    def incref_many(self, blocks: Sequence[int]) -> None:
        """:meth:`incref` of each of ``blocks`` (distinct)."""
        cached = [b for b in blocks if not self.ref[b]]
        super().incref_many(blocks)
        self._used(cached)

    def decref(self, b: int, priority: int, keep_cached: bool, detach: Detach) -> None:
        """One holder lets go of ``b``: at zero cached (attached) or free."""
        if self.ref[b] <= 0:
            raise RuntimeError(f"group {self.name}: block {b} released more often than held")
        self.ref[b] -= 1
        if self.ref[b]:
            return
        self.num_used -= 1
        self._unused(b)
        node = self.node[b]
        if node is not None and keep_cached:
            self.evictable.add(b, priority, bool(node.children))
            self._cached((b,))
            return
        if node is not None:
            detach(self.name, [b])
        self._to_free((b,))

    def release(self, blocks: Iterable[int], priority: int, keep_cached: bool, detach: Detach) -> None:
        """:meth:`decref` of each of ``blocks`` (ids below 0 skipped), cached ones queued together."""
        ref, owner = self.ref, self.node
        cached: list[int] = []
        dropped: list[int] = []
        freed: list[int] = []
        for b in blocks:
            if b < 0:
                continue
            if ref[b] <= 0:
                raise RuntimeError(f"group {self.name}: block {b} released more often than held")
            ref[b] -= 1
            if ref[b]:
                continue
            self.num_used -= 1
            self._unused(b)
            node = owner[b]
            if node is None:
                freed.append(b)
            elif keep_cached:
                cached.append(b)
            else:
                dropped.append(b)
        if cached:
            self.evictable.add_split(cached, owner, priority)
            self._cached(cached)
        if dropped:
            detach(self.name, dropped)
        self._to_free(freed + dropped)

    def reset(self) -> None:
        """Not needed by the workloads measured."""
        raise NotImplementedError("the slab prototype does not reset its prefix cache")


class SlabManagerV2(KVCacheManagerV2):
    """``KVCacheManagerV2`` over a slab arena (split layouts only): every check of room is joint over the groups."""

    #: the bytes the arena is cut from (set by the harness before each run: the cell's budget)
    budget_bytes = 0
    policy = "own-first"  #: or "oldest" (:class:`SlabArena`)
    last: SlabManagerV2 | None = None  # the last one built (the harness reads its arena after the run)

    def __init__(self, pools: BlockPools, options: ManagerOptions) -> None:
        import cache_backends.v2.manager as m

        layout = pools.layout
        if layout.shared or len(layout.groups) < 2:
            raise ValueError("the slab prototype is for split layouts (several groups of unequal pages)")
        slab = max(g.bytes_per_block for g in layout.groups)
        if any(slab % g.bytes_per_block for g in layout.groups):
            raise ValueError("the slab prototype needs every page to divide the largest")
        arena = SlabArena(self.budget_bytes // slab, slab, self.policy)
        made = iter(range(len(layout.groups)))
        pages = {g.name: g.bytes_per_block for g in layout.groups}

        def make(name: str, num_blocks: int) -> SlabPool:
            pool = SlabPool(name, arena, next(made), pages[name])
            arena.pools.append(pool)
            return pool

        saved = m.GroupPool
        m.GroupPool = make  # type: ignore[assignment,misc]
        try:
            super().__init__(pools, options)
        finally:
            m.GroupPool = saved
        self.arena = arena
        self._per = [p.per for p in arena.pools]
        SlabManagerV2.last = self

    # --- the joint check ------------------------------------------------------------------------

    def _short_cycles(self, needs: tuple[list[int], ...], extra: list[int] | None = None,
                      sets: list[int] | None = None) -> tuple[Any, list[str], int] | None:
        per_group = []
        for i, _ in enumerate(self._pool_sets):
            n = sets[i] if sets else 0
            for c, k in self._set_cycles[i]:
                t = sum(need[c] for need in needs)
                if t > 0:
                    n += k * t
            per_group.append(n)
        return self._joint(per_group, extra)

    def _first_short(self, needs: tuple[dict[str, int], ...], extra: list[int] | None = None,
                     ) -> tuple[Any, list[str], int] | None:
        per_group = [max(0, sum(need.get(name, 0) for need in needs)) for _, (name,) in self._pool_sets]
        return self._joint(per_group, extra)

    def _joint(self, per_group: list[int], extra: list[int] | None) -> tuple[Any, list[str], int] | None:
        i = self.arena.short(per_group, extra)
        if i is None:
            return None
        pool, names = self._pool_sets[i]
        return pool, names, per_group[i]

    def usage(self) -> float:
        """As the manager's, and a fragmentation sample (the replay asks once a step)."""
        self.arena.sample()
        return super().usage()

    # --- room: searched, reserved ----------------------------------------------------------------

    def fit_tokens(self, request: Request, want: int, extra: list[int] | None = None) -> int:
        cache = self._active(request)
        want = min(want, self.options.max_seq_len - cache.committed, request.num_tokens_with_drafts - cache.committed)
        if want <= 0:
            return 0
        tables, committed = cache.tables, cache.committed

        def fits(n: int) -> bool:
            return self.arena.short([-(-(committed + n) // tpb) - len(tables[name])
                                     for name, tpb, _ in self._group_pools], extra) is None

        return _most_fitting(want, fits)

    def fit_tokens_new(self, request: Request, want: int, extra: list[int] | None = None, start: int = 0) -> int:
        want = min(want, self.options.max_seq_len - start, request.num_tokens_with_drafts - start)
        if want <= 0:
            return 0

        def fits(n: int) -> bool:
            return self.arena.short([-(-n // tpb) for _, tpb, _ in self._group_pools], extra) is None

        return _most_fitting(want, fits)

    def _reserve_split(self, cache: Any, target: int) -> bool:
        tables = cache.tables
        need = [-(-target // tpb) - len(tables[name]) for name, tpb, _ in self._group_pools]
        if self.arena.short(need) is not None:
            return False
        self.arena.acquire(need, self._detach)
        for (name, _, pool), k in zip(self._group_pools, need, strict=True):
            if k > 0:
                tables[name].extend(pool.allocate_many(k, self._detach))
        cache.room = min(len(tables[name]) * tpb for name, tpb, _ in self._group_pools)
        return True

    def resize(self, request: Request, capacity: int) -> bool:
        cache = self._active(request)
        if cache.history <= capacity <= self.options.max_seq_len:
            need = [-(-capacity // tpb) - len(cache.tables[name]) for name, tpb, _ in self._group_pools]
            if self.arena.short(need) is not None:
                return False
            self.arena.acquire(need, self._detach)
        return super().resize(request, capacity)

    def _never_fits(self, request: Request) -> str | None:
        per_pool = self._pool_sets
        saved = [pool.num_blocks for pool, _ in per_pool]
        try:  # the manager's checks with every pool as large as the whole arena, then the joint one
            for pool, _ in per_pool:
                pool.num_blocks = self.arena.num_slabs * pool.per  # type: ignore[union-attr]
            why = super()._never_fits(request)
        finally:
            for (pool, _), n in zip(per_pool, saved, strict=True):
                pool.num_blocks = n
        if why is not None:
            return why
        n = self.worst_case_tokens(request)
        slabs = sum(-(-g.blocks_for(n) // per) for g, per in zip(self.groups, self._per, strict=True))
        if slabs > self.arena.num_slabs:
            return f"request {request.req_id} needs {slabs} slabs for {n} tokens; the arena has {self.arena.num_slabs}"
        return None


@contextlib.contextmanager
def slab_manager(budget_bytes: int, policy: str = "own-first") -> Iterator[None]:
    """Within the block, V2 is built as :class:`SlabManagerV2` over ``budget_bytes`` with slab ``policy``."""
    SlabManagerV2.budget_bytes = budget_bytes
    SlabManagerV2.policy = policy
    SlabManagerV2.last = None
    saved = v2.KVCacheManagerV2
    v2.KVCacheManagerV2 = SlabManagerV2  # type: ignore[misc]  # what cache_backends.kinds builds V2 from
    try:
        yield
    finally:
        v2.KVCacheManagerV2 = saved  # type: ignore[misc]


POLICIES = ("own-first", "oldest", "free-only")
CPU = {"device": "cpu", "log": False, "progress": False}
BUDGETS = {"default": 1.0, "tight": 0.25, "generous": 4.0}


def _run(wl: Any, budget: int, sched: str, **overrides: Any) -> Any:
    from engine.simulator import simulate
    from pipeline.errors import KvBuildError

    try:
        (result,) = simulate(PRESET, wl, kv_cache_config={"max_gpu_total_bytes": budget}, scheduling_policy=sched,
                             **overrides, **CPU).results.values()
    except KvBuildError as exc:  # the budget cannot hold one of the workload's requests, or the run stalled
        # (a lone request could not grow: free-only slabs never leave the groups that cached into them)
        return "stalled" if "although it runs alone" in str(exc) else None
    return result.metrics


def _hit(m: Any) -> str:
    if m.ideal_hit_rate <= 0:
        return f"{m.hit_rate:.1%}"
    return f"{m.hit_rate:.1%} ({m.hit_rate / m.ideal_hit_rate:.0%})"


def cells(workloads: Sequence[str], budgets: Sequence[str], policy: str = "own-first") -> list[dict[str, Any]]:
    """Each cell's three runs: {workload, budget, bytes, split, best, slab: metrics, None (cannot be built) or a
    status ("stalled"), arena}."""
    from bench.bench_grid import VARIANTS
    from engine.simulator import simulate
    from engine.workloads import make_workload

    out = []
    for name in workloads:
        kind, extra, sched = VARIANTS.get(name, (name, {}, "fcfs"))
        wl = make_workload(kind, None, 0, **extra)
        base = simulate(PRESET, wl, scheduling_policy=sched, **CPU).budget.bytes
        for label in budgets:
            start = time.perf_counter()
            budget = int(base * BUDGETS[label])
            row: dict[str, Any] = {"workload": name, "budget": label, "bytes": budget}
            row["split"] = _run(wl, budget, sched)
            row["best"] = _run(wl, budget, sched, max_seq_len=wl.max_sequence_tokens)
            with slab_manager(budget, policy):
                row["slab"] = _run(wl, budget, sched)
                row["arena"] = SlabManagerV2.last.arena if SlabManagerV2.last is not None else None
            out.append(row)
            print(f"  {name} {label}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return out


def _check_every_step() -> None:
    """Check the arena's invariants at every sample (``--check``: slow)."""
    plain = SlabManagerV2.usage

    def usage(self: SlabManagerV2) -> float:
        self.arena.check()
        return plain(self)

    SlabManagerV2.usage = usage  # type: ignore[method-assign]


def table(rows: list[dict[str, Any]], cmd: str) -> str:
    """The markdown table of :func:`cells`."""
    def three(f: Callable[[Any], str], row: dict[str, Any]) -> str:
        return " · ".join("cannot run" if row[k] is None else row[k] if isinstance(row[k], str) else f(row[k])
                          for k in ("split", "best", "slab"))

    head = ["workload", "budget", "steps: split · best static · slab", "hit (of ideal)", "max / mean concurrency",
            "preemptions", "slabs", "partly used slabs mean / max", "pinned, not in use (mean)", "slab reclaims"]
    lines = [f"`{cmd}`", "", "| " + " | ".join(head) + " |", "|---|---|" + "--:|" * (len(head) - 2)]
    for r in rows:
        a = r["arena"]
        if a is not None and a.partly and not isinstance(r["slab"], str | None):  # a run that finished
            frag = [f"{a.num_slabs:,}", f"{statistics.fmean(a.partly):.1f} / {max(a.partly)}",
                    f"{statistics.fmean(a.pinned):.1%}",
                    f"{a.counters['slabs_reclaimed']:,} ({a.counters['evicted_by_reclaim']:,} blocks evicted)"]
        else:
            frag = ["-"] * 4
        steps = three(lambda m: f"{m.steps:,}", r)
        if not isinstance(r["split"], str | None) and not isinstance(r["slab"], str | None):
            steps += f" ({r['slab'].steps / r['split'].steps:.2f}x)"
        lines.append("| " + " | ".join([
            r["workload"], r["budget"], steps, three(_hit, r),
            three(lambda m: f"{m.max_concurrency} / {m.mean_concurrency:.1f}", r),
            three(lambda m: f"{m.preemptions:,}", r), *frag]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Print the three-way table for the chosen workloads and budgets."""
    from bench.bench_grid import WORKLOADS
    from bench.common import machine

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated workloads")
    p.add_argument("--budgets", default=",".join(BUDGETS), help=f"comma-separated subset of {', '.join(BUDGETS)}")
    p.add_argument("--policy", choices=POLICIES, default=POLICIES[0],
                   help="where a group short of blocks evicts: its own cached blocks before another group's slab "
                        "(own-first), whichever is older (oldest), or never another group's (free-only)")
    p.add_argument("--check", action="store_true", help="check the arena's invariants every step (slow)")
    args = p.parse_args(argv)
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    unknown = [b for b in budgets if b not in BUDGETS]
    if unknown:
        p.error(f"--budgets: unknown budget {unknown[0]!r}; known: {', '.join(BUDGETS)}")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        p.error(f"--workloads: unknown workload {bad[0]!r}; known: {', '.join(WORKLOADS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for key, value in machine().items():
        print(f"- {key}: {value}")
    print()
    cmd = "python -m bench.proto_v4_slab" + ("" if argv is None and len(sys.argv) == 1 else
                                             " " + " ".join(argv if argv is not None else sys.argv[1:]))
    if args.check:
        _check_every_step()
    print(table(cells(workloads, budgets, args.policy), cmd))


if __name__ == "__main__":
    main()
