"""Moving a V2 request out to the host tier and back: suspend (write-back of cached pages), resume's refusals and
the restore of its pages (:class:`HostMoves`, a part of :class:`~cache_backends.v2.manager.KVCacheManagerV2`)."""

from __future__ import annotations

import math
from operator import itemgetter

from cache_backends.request import Request
from cache_backends.v2.sequence import CacheState, SequenceCache
from cache_backends.v2.tied_pool import TiedArena
from cache_backends.v2.tree_events import _AS_IT_GOES, _Heard


class HostMoves:
    """Suspend to the host tier, and the checks and copies of a resume."""

    def suspend(self, request: Request) -> bool:
        """Move an active cache's pages to the host tier and free its device blocks; False when no room there.

        Tokens scheduled but not committed are dropped (``history`` falls back to ``committed``).
        """
        cache = self._active(request)
        if self.host is None:
            return False
        keep = {g.name: math.ceil(cache.committed / g.tokens_per_block) for g in self._groups}
        held = {g.name: sum(1 for b in cache.tables[g.name][: keep[g.name]] if b >= 0) for g in self._groups}
        if self._tied_cuts is not None:
            return self._suspend_tied(cache, keep, held)
        if not self.host.has_room(held):
            return False
        if cache.pending is not None:  # its blocks are taken back on resume only if they are in the tree
            self._materialize(cache.pending)
        host: dict[str, list[int]] = {}
        reclaim: dict[str, dict[int, tuple[int, int]]] = {}
        moves: dict[str, tuple[list[int], list[int]]] = {}  # the uncached pages, copied together below
        for g in self._groups:
            pool = self._pool[g.name]
            slots = [-1] * keep[g.name]
            marks: dict[int, tuple[int, int]] = {}
            later = self._write_back[g.name]
            to, of = moves[g.name] = ([], [])
            for j, b in enumerate(cache.tables[g.name][: keep[g.name]]):
                if b >= 0:
                    slots[j] = self.host.reserve(g.name)
                    if pool.node[b] is not None:  # stays cached on the device: copied only if it is evicted first
                        marks[j] = (b, pool.gen[b])
                        later.setdefault(b, []).append((cache, j))
                    else:
                        to.append(slots[j])
                        of.append(b)
            host[g.name] = slots
            reclaim[g.name] = marks
        self._moved_out(cache, host, reclaim, moves)
        return True

    def _suspend_tied(self, cache: SequenceCache, keep: dict[str, int], held: dict[str, int]) -> bool:
        """:meth:`suspend` with the cuts tied: a host slot per page, ``cache.host`` keyed by the cuts
        (the host tier's groups), ``cache.reclaim`` and the write-back map by logical group and block (a cached
        logical block still on the device is written back, every page, only if it is evicted first)."""
        host_tier, arena, cuts = self.host, self._arena, self._tied_cuts
        assert host_tier is not None and isinstance(arena, TiedArena) and cuts is not None
        if not host_tier.has_room({cut: held[g.name] for g, names in zip(self._groups, cuts, strict=True)
                                   for cut in names}):
            return False
        if cache.pending is not None:  # its blocks are taken back on resume only if they are in the tree
            self._materialize(cache.pending)
        host: dict[str, list[int]] = {}
        reclaim: dict[str, dict[int, tuple[int, int]]] = {}
        moves: dict[str, tuple[list[int], list[int]]] = {}  # the uncached pages, copied together below
        for g, names in zip(self._groups, cuts, strict=True):
            pool = self._pool[g.name]
            slots = [[-1] * keep[g.name] for _ in names]
            marks: dict[int, tuple[int, int]] = {}
            later = self._write_back[g.name]
            for j, b in enumerate(cache.tables[g.name][: keep[g.name]]):
                if b < 0:
                    continue
                cached = pool.node[b] is not None
                for i, cut in enumerate(names):
                    slots[i][j] = slot = host_tier.reserve(cut)
                    if not cached:
                        to, of = moves.setdefault(cut, ([], []))
                        to.append(slot)
                        of.append(arena.pages[b][i])
                if cached:  # stays cached on the device: copied only if it is evicted first
                    marks[j] = (b, pool.gen[b])
                    later.setdefault(b, []).append((cache, j))
            host.update(zip(names, slots, strict=True))
            reclaim[g.name] = marks
        self._moved_out(cache, host, reclaim, moves)
        return True

    def _moved_out(self, cache: SequenceCache, host: dict[str, list[int]],
                   reclaim: dict[str, dict[int, tuple[int, int]]],
                   moves: dict[str, tuple[list[int], list[int]]]) -> None:
        """A suspend's end, tied or not: the uncached pages copied to their host slots (``moves``), the cache's slots
        and write-back marks set, its device blocks released, the cache suspended."""
        assert self.host is not None
        self.host.write_many(moves)
        self.host.sync()  # the uncached pages are on the host before their device blocks change hands
        cache.host, cache.reclaim = host, reclaim  # before the release: one that drops a cached block writes it back
        self._release_blocks(cache)
        self.num_on_host += 1
        cache.state = CacheState.SUSPENDED
        self._active_requests.discard(cache.request)
        cache.history = cache.capacity = cache.committed
        self.counters["suspends"] += 1

    def resume_refusal(self, request: Request, extra: list[int] | None = None) -> str | None:
        """Why :meth:`resume` would refuse a suspended cache now, or None.

        Resuming needs room for the cache's pages *and* its next token (a resumed request must be able
        to run at once, or the resume only churns the host tier), and must keep every group's device
        use within ``max_util_for_resume``. ``extra`` (per pool set, as :meth:`short_of`): more blocks
        available, or fewer when negative (:meth:`held_back`).
        """
        cache = self.cache(request)
        if cache.is_active or not cache.admitted:
            return None
        needs = self._restore_needs(cache)
        if self._weights is not None:  # in pages: a group's block holds _pages_per_block of them
            weight = self._page_weight
            needs = {n: (a * weight[n], b * weight[n], c * weight[n]) for n, (a, b, c) in needs.items()}
        for i, (pool, names) in enumerate(self._pool_sets):  # a shared arena: the groups' needs together
            pages = sum(needs[n][0] for n in names)
            reclaim_cached = sum(needs[n][1] for n in names)
            nxt = sum(needs[n][2] for n in names)
            more = extra[i] if extra else 0
            if pages + nxt > pool.available - reclaim_cached + more:
                why = f" ({pages} for its pages, {nxt} for its next token)" if nxt else ""
                held = f", {-more} of them left to shared prefixes" if more < 0 else ""
                return (f"resuming {request.req_id} needs {pages + nxt} blocks of {self._where(names)}{why}; "
                        f"{pool.available - reclaim_cached} are free or evictable{held}")
        if all(pool.num_used == 0 for pool, _ in self._pool_sets):
            return None  # nothing else on the device: waiting for room could never help
        limit = self.options.max_util_for_resume
        for pool, names in self._pool_sets:
            after = pool.num_used + sum(sum(needs[n]) for n in names)
            if after > limit * pool.num_blocks:
                return (f"resuming {request.req_id} would use {after}/{pool.num_blocks} blocks of "
                        f"{self._where(names)}, above max_util_for_resume={limit}")
        return None

    def _restore_needs(self, cache: SequenceCache) -> dict[str, tuple[int, int, int]]:
        """Per group: (pages to allocate and copy back, cached unowned blocks to take back as they are,
        new blocks the next token needs — 1 when it starts a block, else 0)."""
        request = cache.request
        next_len = cache.committed + (1 if request.num_tokens > cache.committed else 0)
        needs = {}
        for g in self._groups:
            name = g.name
            # (tied: the positions' slots of the first cut, every cut holding one at the same positions)
            slots = cache.host[name if self._tied_cuts is None else self._tied_cuts[self._names.index(name)][0]]
            pool, marks = self._pool[name], cache.reclaim[name]
            # every page with a host slot is copied back unless its mark (a cached device block, only ever set beside
            # a slot) is still valid: counted per group at C speed, the marks checked all at once (a suspended request
            # is asked every step it waits; Gemma 3 27B's 31 groups made a Python pass over every page a tenth of
            # V2's work under pressure), per mark only where some went stale
            new = len(slots) - slots.count(-1)
            reclaim_cached = 0
            if len(marks) > 1:
                blocks, gens = zip(*marks.values(), strict=True)
                get = itemgetter(*blocks)
                if get(pool.gen) == gens and get(pool.node).count(None) == 0:  # every mark still valid
                    new -= len(blocks)
                    reclaim_cached = get(pool.ref).count(0)
                    marks = {}
            for j in marks:
                b = self._reclaimable(cache, name, j)
                if b is not None:
                    new -= 1
                    if pool.ref[b] == 0:
                        reclaim_cached += 1
            nxt = max(0, math.ceil(next_len / g.tokens_per_block) - len(slots))
            needs[name] = (new, reclaim_cached, nxt)
        return needs

    def _reclaimable(self, cache: SequenceCache, group: str, j: int) -> int | None:
        """The device block logical block ``j`` had at suspend, if it is still cached untouched."""
        mark = cache.reclaim[group].get(j)
        if mark is None:
            return None
        b, gen = mark
        pool = self._pool[group]
        return b if pool.node[b] is not None and pool.gen[b] == gen else None

    def _restore(self, cache: SequenceCache) -> None:
        """Bring a suspended cache's pages back: take back untouched cached blocks, copy the rest from host."""
        assert self.host is not None and cache.host is not None
        T = self.T
        tables: dict[str, list[int]] = {}
        cuts = self._tied_cuts
        # each group's slots per position (tied: the first cut's; every cut has one at the same positions)
        at = {g.name: cache.host[g.name if cuts is None else cuts[i][0]] for i, g in enumerate(self._groups)}
        for g in self._groups:  # first take back, in every group, so allocating below cannot evict them
            pool, slots = self._pool[g.name], at[g.name]
            table = tables[g.name] = [-1] * len(slots)
            for j, slot in enumerate(slots):
                if slot >= 0:
                    b = self._reclaimable(cache, g.name, j)
                    if b is not None:
                        pool.incref(b)
                        table[j] = b
        moves: dict[str, tuple[list[int], list[int]]] = {}  # copied together once every block is allocated
        # tied with KV events: each allocation's events recorded, then sent in the page arena's order (_send_paged)
        replay = cuts is not None and self.kv_events is not None
        for gi, g in enumerate(self._groups):
            pool, slots, table = self._pool[g.name], at[g.name], tables[g.name]
            of, to = moves[g.name] = ([], [])
            free = len(self._arena._free) if replay else 0  # type: ignore[union-attr]
            steps: list[tuple[list[_Heard], list[_Heard]]] = []
            with self._cut_by_cut(None) if replay else _AS_IT_GOES as heard:
                for j, slot in enumerate(slots):
                    if slot >= 0 and table[j] < 0:
                        # (an eviction here copies the page it evicts to that page's own host slot now: before the
                        # copy below overwrites the block)
                        b = pool.allocate(self._detach)
                        if replay:
                            steps.append((heard[:], []))
                            heard.clear()
                        if cuts is None:
                            of.append(slot)
                            to.append(b)
                        else:  # each cut's slot into that cut's page of the new logical block
                            for i, cut in enumerate(cuts[gi]):
                                cut_of, cut_to = moves.setdefault(cut, ([], []))
                                cut_of.append(cache.host[cut][j])
                                cut_to.append(self._arena.pages[b][i])  # type: ignore[union-attr]
                        table[j] = b
                        end = (j + 1) * g.tokens_per_block
                        if self._reuse and end <= cache.committed and end % T == 0:
                            assert cache.last is not None
                            self._attach(*self._tree.position(cache.last, end // T - 1), g.name, b)
                        if replay:
                            steps[-1][1].extend(heard)
                            heard.clear()
            if replay:
                self._send_paged(g.name, free, steps)
            cache.tables[g.name] = table
        self.host.load_many(moves)
        self.host.sync()  # the copies are done before the slots can be overwritten
        self._forget_write_back(cache)
        for name, slots in cache.host.items():
            self.host.free(name, slots)
        cache.host, cache.reclaim = None, {}
        self.num_on_host -= 1
        cache.state = CacheState.ACTIVE
        self._active_requests.add(cache.request)
        self._count_worst(cache, 1)
        self.counters["resumes"] += 1

    def _forget_write_back(self, cache: SequenceCache) -> None:
        """Drop a suspended cache's pages still waiting on the device from the write-back map (resumed or freed)."""
        for name, marks in cache.reclaim.items():
            later = self._write_back[name]
            for j, (b, _) in marks.items():
                entries = later.get(b)
                if entries is not None:
                    entries[:] = [e for e in entries if not (e[0] is cache and e[1] == j)]
                    if not entries:
                        del later[b]
