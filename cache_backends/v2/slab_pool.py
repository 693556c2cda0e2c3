"""A slab arena: V2's layer groups of unequal pages draw their blocks from one budget (``pool_arena``).

DeepSeek V4's groups have pages of unequal size, each dividing the largest (tiny-deepseek-v4: ``sliding_w128``
98,304 B a block, ``csa_c4`` 12,288 B, ``hca_c128`` 384 B), so they cannot share one arena of equal pages as Gemma's
groups do (:mod:`cache_backends.v2.shared_pool`). Split pools (``KvLayout.split_budget``) fix each group's share once;
memory one group does not use then sits idle while another waits. Here the budget is cut into **slabs** of the
largest page instead; a slab belongs to one group at a time and is carved into ``slab / page`` blocks of that group.

Block ids are positions in the arena: block ``b`` of a group with ``per`` blocks a slab lies in slab ``b // per``
(a block-major view of one byte arena, ``cache_backends.pools``), so a group's id space is ``num_slabs * per``, of
which only its owned slabs' ids are ever handed out.

Invariants (:meth:`SlabArena.check`, called by ``KVCacheManagerV2.check_invariants``):

* every slab is either on the arena's free list or owned by exactly one group (``owner[s]``), never both;
* per group, ``free + used + cached == per * slabs owned`` (``num_blocks``: what it holds now, not fixed), and every
  free or cached block lies in a slab the group owns;
* a slab whose every block is free is not kept: it goes back to the arena at once;
* ``used_in[s]`` counts the used blocks of slab ``s``; ``empty`` holds exactly the owned slabs with none in use (the
  ones another group may reclaim, their cached blocks evicted).

Where a group's next block comes from, in order: its own free blocks (those of the slab with a block in use and the
fewest free ones first: best fit, so whole slabs stay whole), a free slab of the arena, its own cached blocks (LRU
order of the eviction queue), then a slab reclaimed from another group (one with no block in use, from a group that
can spare it beside what the same allocation asks of it, the fewest cached bytes first).

Joint feasibility (:meth:`SlabArena.short`): a request's blocks must fit in every group at once, so every check of
room asks over all groups together: the slabs the groups short of their own free + cached blocks need
(``ceil(deficit / per)`` each) must not exceed the free slabs plus the other groups' whole spare slabs. An allocation
takes those slabs first (:meth:`SlabArena.acquire`), then each group allocates from its own blocks, so a check that
passes never fails to allocate.

Compaction (:meth:`SlabPool.packing_moves`, :meth:`SlabPool.move`; ``KVCacheManagerV2.compact_slabs`` copies the pages
and moves the references): a group's used blocks can pin more slabs than they fill (a request's blocks kept while
others ran beside it, one a slab), so a request alone could find no slab for another group although its worst case
fits the arena. Packing every group's used blocks into ``ceil(used / per)`` slabs leaves the rest free or holding only
cached blocks (reclaimable), and then the joint check counts exactly the slabs the request's blocks fill. It runs only
where the scheduler would otherwise report a request that runs alone as unable to grow.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cache_backends.v2.group_pool import Detach, EvictionQueue, GroupPool


class SlabArena:
    """Who owns each slab, the free slabs, and the arena's counters."""

    def __init__(self, num_slabs: int, slab_bytes: int) -> None:
        if num_slabs < 1:
            raise ValueError(f"a slab arena needs at least one slab, got {num_slabs}")
        self.num_slabs = num_slabs
        self.slab_bytes = slab_bytes
        self.owner = [-1] * num_slabs  # the group index owning each slab; -1: free
        self.free = list(range(num_slabs - 1, -1, -1))  # a stack: low ids first
        self.pools: list[SlabPool] = []
        self.counters = {"slabs_taken": 0, "slabs_reclaimed": 0, "evicted_by_reclaim": 0, "slabs_returned": 0,
                         "blocks_moved": 0}

    def check(self) -> list[str]:
        """What breaks the module's invariants (empty when none does)."""
        problems: list[str] = []
        owned = [0] * len(self.pools)
        for o in self.owner:
            if o >= 0:
                owned[o] += 1
        if len(self.free) + sum(owned) != self.num_slabs or len(set(self.free)) != len(self.free):
            problems.append(f"slab arena: {len(self.free)} free + {sum(owned)} owned slabs != {self.num_slabs}")
        if any(self.owner[s] >= 0 for s in self.free):
            problems.append("slab arena: a free slab has an owner")
        for i, pool in enumerate(self.pools):
            problems += pool.check(owned[i])
        return problems

    def short(self, need: Sequence[int], extra: Sequence[int] | None = None) -> int | None:
        """The first group whose ``need`` (blocks per group) the arena cannot meet together with the others' (with
        ``extra[i]`` blocks more, or fewer when negative, available to group ``i``), or None when every need fits."""
        want, offer, first = 0, len(self.free), None
        for i, pool in enumerate(self.pools):
            more = extra[i] if extra else 0
            have = pool.available + more
            n = max(0, need[i])
            if n > have:
                want += -(-(n - have) // pool.per)
                if first is None:
                    first = i
            elif pool.empty:  # whole slabs it can spare beside its own need, of those with no block in use; blocks
                # fewer (a hit's claim takes cached ones into use) may each put a used block in one of them
                offer += max(0, min(len(pool.empty) + min(0, more), (have - n) // pool.per))
        return first if want > offer else None

    def acquire(self, need: Sequence[int], detach: Detach) -> None:
        """Give every group short of its own free + cached blocks for ``need`` the slabs it lacks: free slabs first,
        then reclaimed ones; the caller checked :meth:`short` first."""
        for i, pool in enumerate(self.pools):
            while need[i] > pool.available:
                if self.free:
                    s = self.free.pop()
                    self.counters["slabs_taken"] += 1
                else:
                    s = self._reclaim(i, need, detach)
                pool.take_slab(s)

    def _reclaim(self, taker: int, need: Sequence[int], detach: Detach) -> int:
        """A slab with no block in use from a group that can spare it after ``need``: the fewest cached bytes."""
        best: tuple[int, int, int] | None = None
        for j, pool in enumerate(self.pools):
            if j == taker or not pool.empty or pool.available - pool.per < max(0, need[j] if j < len(need) else 0):
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

    def slabs_for(self, blocks: Sequence[int]) -> int:
        """Slabs that ``blocks`` (per group) take when each group starts from none."""
        return sum(-(-max(0, n) // pool.per) for n, pool in zip(blocks, self.pools, strict=True))


class SlabPool(GroupPool):
    """A group's blocks in the slabs it owns; block ``b`` lies in slab ``b // per`` (``per`` blocks a slab)."""

    def __init__(self, name: str, arena: SlabArena, page_bytes: int) -> None:
        if arena.slab_bytes % page_bytes:
            raise ValueError(f"group {name}: its page of {page_bytes} B does not divide the slab of "
                             f"{arena.slab_bytes} B")
        per = arena.slab_bytes // page_bytes
        super().__init__(name, arena.num_slabs * per)  # ids of every slab; only owned slabs' ids are handed out
        self.arena, self.index, self.per, self.page_bytes = arena, len(arena.pools), per, page_bytes
        arena.pools.append(self)
        self._free = []  # unused: free blocks are kept per slab (free_in)
        self.free_in: dict[int, list[int]] = {}  # owned slab -> its free blocks (a stack: low ids first)
        self.nfree = 0
        self.used_in = [0] * arena.num_slabs  # blocks in use per slab
        self.empty: set[int] = set()  # owned slabs with no block in use (free or cached only): reclaimable
        self.owned = 0
        self.num_blocks = 0  # blocks of the owned slabs: what the group holds now

    @property
    def num_free(self) -> int:
        """Free blocks in the owned slabs."""
        return self.nfree

    @property
    def available(self) -> int:
        """Free plus cached blocks in the owned slabs (the arena's free slabs are not counted: checks are joint)."""
        return self.nfree + len(self.evictable)

    def free_ids(self) -> list[int]:
        """The free blocks of the owned slabs (for checks and tests)."""
        return [b for blocks in self.free_in.values() for b in blocks]

    def slabs(self) -> list[int]:
        """The owned slabs."""
        return [s for s, o in enumerate(self.arena.owner) if o == self.index]

    def check(self, owned: int) -> list[str]:
        """This group's share of :meth:`SlabArena.check` (``owned``: slabs the arena says it owns)."""
        out: list[str] = []
        if self.owned != owned or self.num_blocks != owned * self.per:
            out.append(f"group {self.name}: owns {owned} slabs, counts {self.owned} ({self.num_blocks} blocks)")
        used = sum(1 for r in self.ref if r > 0)
        if used != self.num_used or self.nfree + used + len(self.evictable) != owned * self.per:
            out.append(f"group {self.name}: {self.nfree} free + {used} used + {len(self.evictable)} cached != "
                       f"{owned * self.per} blocks of its slabs")
        for b in [*self.evictable.blocks(), *self.free_ids()]:
            if self.arena.owner[b // self.per] != self.index:
                out.append(f"group {self.name}: block {b} lies in slab {b // self.per}, which it does not own")
        for s, blocks in self.free_in.items():
            if len(blocks) >= self.per:
                out.append(f"group {self.name}: slab {s} is all free but kept")
        counts = [0] * self.arena.num_slabs
        for b, r in enumerate(self.ref):
            if r > 0:
                counts[b // self.per] += 1
        if counts != self.used_in:
            out.append(f"group {self.name}: blocks in use per slab disagree with used_in")
        if self.empty != {s for s in self.slabs() if not counts[s]}:
            out.append(f"group {self.name}: its reclaimable slabs disagree with the slabs it holds no used block in")
        return out

    def take_slab(self, s: int) -> None:
        """Own slab ``s`` (free): all its blocks free."""
        self.arena.owner[s] = self.index
        lo = s * self.per
        self.free_in[s] = list(range(lo + self.per - 1, lo - 1, -1))
        self.nfree += self.per
        self.empty.add(s)
        self.owned += 1
        self.num_blocks = self.owned * self.per

    def _drop_slab(self, s: int) -> None:
        self.arena.owner[s] = -1
        self.empty.discard(s)
        self.owned -= 1
        self.num_blocks = self.owned * self.per

    def give_up(self, s: int, detach: Detach) -> int:
        """Hand slab ``s`` (no block in use) over to another group: its cached blocks evicted; how many."""
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
        reclaimed slab's (where the manager's joint checks were not asked: a fork's or a partial copy's block);
        ``IndexError`` (nothing changed) when the arena cannot give them."""
        arena = self.arena
        if n > self.available:
            need = [0] * len(arena.pools)
            need[self.index] = n
            if arena.short(need) is not None:
                raise IndexError(f"group {self.name}: {n} blocks asked, {self.available} free or cached, "
                                 f"{len(arena.free)} free slabs")
            if n > self.available + len(arena.free) * self.per:  # free slabs alone would not do: reclaim first
                arena.acquire(need, detach)
        out: list[int] = []
        while len(out) < n:
            if not self.nfree:
                if arena.free:  # a free slab before evicting cached blocks
                    self.take_slab(arena.free.pop())
                    arena.counters["slabs_taken"] += 1
                else:
                    evicted = self.evictable.pop_many(n - len(out))
                    detach(self.name, evicted)
                    self.evictions += len(evicted)
                    out += evicted
                    continue
            used_in, free_in = self.used_in, self.free_in
            s = min(free_in, key=lambda s: (not used_in[s], len(free_in[s]), s))
            lst = free_in[s]
            k = min(n - len(out), len(lst))
            out += lst[len(lst) - k:][::-1]
            del lst[len(lst) - k:]
            self.nfree -= k
            if not lst:
                del free_in[s]
        gen, ref = self.gen, self.ref
        for b in out:
            gen[b] += 1
            ref[b] = 1
        self.num_used += n
        self._used(out)
        return out

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
        """One holder lets go of ``b`` (``b >= 0``): at zero cached (attached, ``keep_cached``) or free.

        :meth:`release` of the one block: the same steps in the same order (out of use, then queued, or detached
        and freed). Why not hooks in ``GroupPool.decref`` for ``_unused`` and ``_to_free``: it runs per block on
        V2's hot path, and a flag checked there a call is a cost every split pool would pay for the arena."""
        self.release((b,), priority, keep_cached, detach)

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
        if dropped:
            detach(self.name, dropped)
        self._to_free(freed + dropped)

    def packing_moves(self, detach: Detach) -> list[tuple[int, int]]:
        """Where each used block outside the fewest slabs that can hold them all goes: ``(block, its new place)``
        pairs, every new place a block of one of those slabs that is now neither free nor cached (a cached one is
        evicted here, after every free one is taken, in eviction order); empty when the used blocks are packed
        already. The caller copies the pages and moves every reference, then calls :meth:`move`.

        Which slabs keep theirs: the most used first (the fewest moves), then the fewest cached blocks to evict."""
        per, used_in, free_in = self.per, self.used_in, self.free_in
        owned = self.slabs()
        k = -(-self.num_used // per)
        if sum(1 for s in owned if used_in[s]) <= k:
            return []
        order = sorted(owned, key=lambda s: (-used_in[s], -len(free_in.get(s, ())), s))
        keep, ref = order[:k], self.ref
        sources = [b for s in order[k:] if used_in[s] for b in range(s * per, (s + 1) * per) if ref[b] > 0]
        places: list[int] = []
        for s in keep:  # free blocks first: nothing evicted for them
            lst = free_in.get(s)
            while lst and len(places) < len(sources):
                places.append(lst.pop())
                self.nfree -= 1
            if lst is not None and not lst:
                del free_in[s]
        if len(places) < len(sources):  # then cached blocks of the kept slabs (room enough: k * per >= num_used)
            # in the eviction queue's order (leaves before shared prefixes, least recently released first), as an
            # allocation evicts them: in slab order a hot prefix went while a cold block beside it stayed (review55)
            kept = set(keep)
            evicted = [b for b in self.evictable.blocks() if b // per in kept][:len(sources) - len(places)]
            self.evictable.remove_many(evicted)
            detach(self.name, evicted)
            self.evictions += len(evicted)
            places += evicted
        assert len(places) == len(sources), "the kept slabs hold every used block"
        return list(zip(sources, places, strict=True))

    def move(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Give each pair's new place (from :meth:`packing_moves`) its block's holders, run and position, and free
        the block it left (a slab left all free goes back to the arena)."""
        ref, gen, node, pos, prio = self.ref, self.gen, self.node, self.pos, self.priority
        for old, new in pairs:
            ref[new], node[new], pos[new], prio[new] = ref[old], node[old], pos[old], prio[old]
            gen[new] += 1  # handed out anew: whoever remembers (new, an older gen) sees it changed hands
            ref[old], node[old] = 0, None
            self._unused(old)
            self._used((new,))
        self._to_free(old for old, _ in pairs)

    def reset(self) -> None:
        """Drop every cached block (the manager empties the radix tree): every slab goes back to the arena."""
        if self.num_used:
            raise RuntimeError(f"group {self.name}: {self.num_used} blocks are in use; the cache cannot be reset")
        self.node[:] = [None] * len(self.node)  # in place: the manager keeps references to these lists
        self.evictable = EvictionQueue(self.priority)
        for s in self.slabs():
            self.free_in.pop(s, None)
            self._drop_slab(s)
            self.arena.free.append(s)
        self.nfree = 0
