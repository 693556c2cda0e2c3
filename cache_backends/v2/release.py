"""What V2 does with the blocks a request lets go: windows sliding past them, a finished request's blocks parked in
the prefix cache tail first, tails kept for the next turn (:class:`Release`, a part of
:class:`~cache_backends.v2.manager.KVCacheManagerV2`)."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import compress, repeat
from operator import itemgetter, not_

from cache_backends.hashing import pack_tokens
from cache_backends.request import Request
from cache_backends.v2.group_pool import EvictionQueue
from cache_backends.v2.radix import PendingPrefix, RadixNode, TailRun
from cache_backends.v2.sequence import NEVER, SequenceCache
from cache_backends.v2.shared_pool import interleave
from cache_backends.v2.token_runs import token_slice


class Release:
    """Blocks let go: window slides, finishes parked in the cache, kept tails."""

    def free(self, request: Request) -> None:
        """Close ``request``'s cache: device blocks released (cached ones stay reusable), host slots freed.

        A request without a cache is ignored, so finishing a never-admitted request is safe.
        """
        self._check_open()
        cache = self._caches.pop(request, None)
        request.packed_ids = b""  # finished: no lookup reads it again (its bytes stay only as long as the request)
        # its lookup kept by the cache-aware pass (a request aborted while waiting has one): else kept, and the request
        # with it, until the tree next changes (``RadixTree.looked``: a thousand aborted, a thousand kept)
        self._tree.looked.pop(request, None)
        if cache is None:
            return
        self._active_requests.discard(request)
        if cache.pending is None and self._tail_fn(self, cache):
            self._keep_tail(cache)
        pending, active = cache.pending, cache.is_active  # (the release below clears cache.pending)
        if cache.pending is not None and self._one_owner is not None and cache.is_active \
                and self._finish_parked(cache):
            pass  # parked and let go in one pass
        else:
            if cache.pending is not None:
                self._park(cache, self._tail_fn(self, cache))
            elif cache.latent is not None:
                self._drop_latent(cache)
            if cache.is_active:
                self._release_blocks(cache)
        if cache.host is not None and self.host is not None:
            self._forget_write_back(cache)
            for name, slots in cache.host.items():
                self.host.free(name, slots)
            cache.host = None
            self.num_on_host -= 1
        if active and self._sliding and self._reuse and self.options.enable_swa_scratch_reuse:
            self._refresh_window_head(cache, pending)
        if cache.last is not None:
            self._tree.leave(cache.last)
            cache.last = None

    def _tail_to_keep(self, cache: SequenceCache) -> int:
        """The tokens of a finishing cache's partial last block (``committed % T``) a finish keeps cached for the next
        turn's partial match to copy (:meth:`_keep_tail`, or parked with a pending prefix); 0: none (partial reuse or
        the cache off, KV events on, no full block before it, too few tokens, or a block some table shares or a
        window let go)."""
        if not self._partial or not cache.is_active or self.kv_events is not None:
            return 0
        n, r = divmod(cache.committed, self.T)
        if not n or r < self._partial_unit:
            return 0
        tables, pools = cache.tables, self._pool
        for name in self._names:
            table = tables[name]
            # (the block before it let go by a window no wider than r: a hit on the history cannot end there)
            if len(table) <= n or table[n] < 0 or table[n - 1] < 0 or pools[name].ref[table[n]] != 1 \
                    or pools[name].node[table[n]]:
                return 0
        return r

    def _tail_to_keep_arena(self, cache: SequenceCache) -> int:
        """:meth:`_tail_to_keep` on a shared arena of several groups (``_tail_fn``), every group's block checked
        at once at C speed (a finish asks it: 31 groups on Gemma 3 27B)."""
        if not self._partial or not cache.is_active or self.kv_events is not None:
            return 0
        n, r = divmod(cache.committed, self.T)
        if not n or r < self._partial_unit:
            return 0
        got = list(map(cache.tables.__getitem__, self._names))
        if min(map(len, got)) <= n:
            return 0
        at, before = list(map(itemgetter(n), got)), list(map(itemgetter(n - 1), got))
        if min(at) < 0 or min(before) < 0:  # (the block before it let go by a window: see _tail_to_keep)
            return 0
        get, arena = itemgetter(*at), self._arena
        return r if get(arena.ref).count(1) == len(at) and not any(get(arena.node)) else 0  # type: ignore[union-attr]

    def _keep_tail(self, cache: SequenceCache) -> None:
        """At a finish of an eagerly keyed cache, keep the partial last block (:meth:`_tail_to_keep`) cached as its
        path's :class:`~cache_backends.v2.radix.TailRun`, for the next turn's partial match to copy.

        Why: whole-block reuse stops at the history's last full block, so a follow-up turn recomputed up to ``T - 1``
        tokens of it (tiny-gemma3 ``multi-turn``: 31 of 32 per turn, 3.7% of the workload's ideal; BENCHMARKS.md). A
        lazily keyed cache parks it with its pending prefix instead (:meth:`_materialize` hangs it). A tail already
        continuing the run with these tokens (or more), a block in every group, is kept (a turn that copied it); any
        other is dropped for the new one: a shorter one, one left behind (its run grew), one an eviction took a
        group's block of (no hit copies it), or another conversation's that parted from this one inside the block
        (its follow-up turn would find the other's tokens and copy none)."""
        T = self.T
        n, r = divmod(cache.committed, T)
        tables, pools = cache.tables, self._pool
        last = cache.last
        if last is None or cache.keyed != n or last.start + len(last.held) != n:
            return
        old = last.tail
        if old is not None:
            if old.adjacent() and old.valid >= r and old.held[0] == len(self._names) \
                    and old.block(0)[:8 * r] == pack_tokens(token_slice(cache.request, n * T, n * T + r)):
                return
            if self._arena is not None:  # left behind: its blocks go free (out of the queue, dropped), in one pass
                blocks = old.blocks
                self._arena.drop_each(self._share_index, [blocks[name][0] for name in self._names],
                                      self._detach_mixed)
            else:
                for name in self._names:  # left behind: its blocks go free (taken out of the queue, then dropped)
                    b = old.blocks[name][0]
                    if b >= 0:
                        pool = pools[name]
                        pool.incref(b)
                        pool.decref(b, 0, False, self._detach)
            if last.tail is old:  # (every block of it was evicted already: unhooked by the last detach otherwise)
                last.tail = None
        last.tail = self._hang_tail(last, cache.request, n, r, {name: tables[name][n] for name in self._names})

    def _hang_tail(self, parent: RadixNode, request: Request, n: int, r: int, blocks: dict[str, int]) -> TailRun:
        """A :class:`~cache_backends.v2.radix.TailRun` at position ``n`` under ``parent`` holding ``blocks`` (-1: none;
        the caller hooks it: ``parent.tail`` or the tree's loose tails)."""
        T = self.T
        tail = TailRun(parent, request.salt, n, self._names, 8 * T, r)
        tail.tokens += pack_tokens([*token_slice(request, n * T, n * T + r), *[0] * (T - r)])
        held = 0
        for name, _, owner, pos in self._attach_steps:
            b = blocks[name]
            tail.blocks[name].append(b)
            if b >= 0:
                owner[b] = tail
                pos[b] = n
                held += 1
        tail.held.append(held)
        self._tree.num_nodes += 1
        return tail

    def _refresh_window_head(self, cache: SequenceCache, pending: PendingPrefix | None) -> None:
        """At a finish, requeue at the young end of the eviction queue the blocks each window let go that a hit on the
        finished history's whole blocks still reads: positions ``[(m - window + 1) // tpb, released)``, ``m`` its
        committed tokens rounded down to the reuse unit.

        Why: the window lets a block go as soon as the next query no longer reads it, so the block holding
        ``m - window + 1`` leaves at the last commits before the finish (the partial last block is not cached, so the
        hit stops at ``m``, below ``committed``). Queued then, it would be evicted before the blocks other requests'
        windows let go after it, which no hit needs, and losing it loses every length of the history's hit (a shorter
        one needs older window blocks, evicted earlier). vLLM's sliding-window manager has the same ordering; on
        tiny-gemma3 ``multi-turn`` at a quarter of the budget one of six lost histories was this (BENCHMARKS.md)."""
        unit = self.reuse_unit or self.T
        m = cache.committed // unit * unit
        if not m or (pending is None and cache.last is None):
            return
        T, released = self.T, cache.released
        if self._arena_refresh is not None:  # a window set at once: every finish on Gemma 3 comes here
            arena = self._arena
            got: list[int] = []
            for window, tpb, first, names in self._arena_refresh:
                lo, hi = max(0, m - window + 1) // tpb, released[first]  # (a set's groups release in lockstep)
                if lo < hi:
                    step = tpb // T
                    if pending is not None:  # at C speed; position by position (a row's pages together: below)
                        cut = itemgetter(slice((lo + 1) * step - 1, hi * step, step))
                        got += interleave([x[::-1] for x in map(cut, map(pending.blocks.get, names, repeat(())))])
                        continue
                    # keyed: the set's positions looked up on the path once, then every group's block at each in one
                    # comprehension (the loop below made one a group: 26 on Gemma 3 27B, at a third of its finishes)
                    tree, keyed, last = self._tree, cache.keyed, cache.last
                    at = [tree.position(last, p) for j in range(hi - 1, lo - 1, -1)  # type: ignore[arg-type]
                          if (p := (j + 1) * step - 1) < keyed]
                    # position by position, tail first: each row of the set's cuts requeued together, so the queue
                    # keeps every row's pages next to each other (``KVCacheManagerV2._check_rows``)
                    got += [run.blocks[name][i] for run, i in at for name in names]
            if got:
                got = list(filter((0).__le__, got))
                got = list(compress(got, map(not_, map(arena.ref.__getitem__, got))))  # type: ignore[union-attr]
                if got:
                    arena.evictable.refresh(got, self._row_runs(got))  # type: ignore[union-attr]
            return
        tree = self._tree
        # per (window, span) set, once: the first position a hit on m tokens reads, and the span in token blocks
        # (group block j sits at token-block position (j + 1) * step - 1)
        bounds = [(max(0, m - w + 1) // tpb, tpb // T) for w, tpb, _ in self._window_sets]
        spots: dict[tuple[int, int], list[tuple[RadixNode, int]]] = {}  # (keyed) per set and bound: (run, offset)
        by_group = pending.blocks if pending is not None else None
        one = self._arena is not None  # a shared arena: one queue for every group
        shared: list[list[int]] = []  # a shared arena's window groups' blocks, group by group
        queues: dict[int, tuple[EvictionQueue, list[int]]] = {}
        for name, pool, k in self._window_groups:
            lo, step = bounds[k]
            hi = released[name]
            if lo >= hi:
                continue
            if by_group is not None:
                along = by_group.get(name)
                if not along:
                    continue
                seg = along[(lo + 1) * step - 1: hi * step: step][::-1]  # tail first, as a release queues
            else:
                at = spots.get((k, hi))
                if at is None:  # the runs and offsets of the set's positions, looked up once for all its groups
                    keyed, last = cache.keyed, cache.last
                    at = spots[k, hi] = [tree.position(last, p) for j in range(hi - 1, lo - 1, -1)  # type: ignore[arg-type]
                                         if (p := (j + 1) * step - 1) < keyed]
                seg = [run.blocks[name][i] for run, i in at]
            ref = pool.ref
            if one:  # the arena's: interleaved below, a row's pages together as the one pass above queues them
                shared.append(seg)  # type: ignore[arg-type]
                continue
            got = queues.setdefault(id(pool.evictable), (pool.evictable, []))[1]
            for b in seg:
                if b >= 0 and not ref[b]:
                    got.append(b)
        if shared:
            arena = self._arena
            assert arena is not None
            rows = [b for b in interleave(shared) if b >= 0 and not arena.ref[b]]  # type: ignore[arg-type]
            if rows:
                arena.evictable.refresh(rows, self._row_runs(rows))
        for queue, blocks in queues.values():
            if blocks:
                queue.refresh(blocks)

    def _row_runs(self, blocks: list[int]) -> list[int] | None:
        """The lengths of the runs of ``blocks`` (an arena's queued pages, each row's together) that are one row of a
        cut family each (a page of a family of one: a row of its own); None without families (page by page).

        Why: a refresh then moves each row as one segment at one clock (``EvictionQueue.refresh``), so a stale
        demotion never splits a row, as a tie of the cuts, one queue entry a row, would not."""
        arena = self._arena
        assert arena is not None
        first = arena._first
        if not first:
            return None
        of, node, pos = arena.group_of, arena.node, arena.pos
        sizes: list[int] = []
        last: object = None
        for b in blocks:
            f = first[of[b]]
            key = (id(node[b]), pos[b], f) if f >= 0 else None
            if key is not None and key == last:
                sizes[-1] += 1
            else:
                sizes.append(1)
            last = key
        return sizes

    def _release_blocks(self, cache: SequenceCache) -> None:
        """Let go of every device block, tail first so the tail is evicted before the head."""
        self._count_worst(cache, -1)
        priority = cache.request.priority
        if self._arena is not None:
            tables, released = cache.tables, cache.released
            # below released[name] a table holds only -1 (what its window let go): not looked at again
            self._arena.release_tables([(i, tables[name]) for i, (name, _, _) in zip(self._share_index,
                                                                                      self._group_pools, strict=True)],
                                       priority, [released[name] for name in self._names])
            for name in tables:
                tables[name] = []
            cache.room = 0
            return
        for name, _, pool in self._group_pools:
            pool.release(reversed(cache.tables[name]), priority, True, self._detach)
            cache.tables[name] = []
        cache.room = 0

    def _release_window(self, cache: SequenceCache) -> None:
        """Release sliding-group blocks that lie wholly before the oldest key the next query sees."""
        keep_cached = self.options.enable_swa_scratch_reuse
        priority = cache.request.priority
        tables, released = cache.tables, cache.released
        if keep_cached and self._arena is not None:  # a window set's sub-groups leave the window together
            for window, tpb, first, shares, names, index in self._arena_windows:
                start = max(0, cache.committed - window + 1)
                upto = min(start // tpb, len(tables[first]))
                lo = released[first]
                if upto <= lo:  # the common case: nothing left this window
                    continue
                pending = cache.pending
                if pending is None or upto != lo + 1 or not self._slide_parked(pending, names, index, tables, lo,
                                                                                 priority):
                    if pending is not None:
                        self._park_blocks(pending, names, tables, lo, upto)
                    self._arena.release_slices([(i, tables[name]) for i, name in shares], lo, upto, priority)
                for name in names:
                    released[name] = upto
            windows = self._arena_windows
            if len(windows) == 1:  # one window set (Gemma 3): no generator per slide
                window, tpb, first, _, _, _ = windows[0]
                cache.slide_at = (released[first] + 1) * tpb + window - 1
            else:
                cache.slide_at = min(((released[first] + 1) * tpb + window - 1
                                      for window, tpb, first, _, _, _ in windows), default=NEVER)
            return
        for window, tpb, members in self._window_sets:
            start = max(0, cache.committed - window + 1)
            upto = min(start // tpb, len(tables[members[0][0]]))
            if upto <= released[members[0][0]]:  # the common case: nothing left this window (any member)
                continue
            for name, pool in members:
                table = tables[name]
                if cache.pending is not None and keep_cached:
                    self._park_blocks(cache.pending, (name,), tables, released[name], upto)
                if self._event_cuts and self.kv_events is not None:
                    # tied: the drops sent cut by cut, as the page arena's loop per cut sends them
                    with self._cut_by_cut(name):
                        for j in range(released[name], upto):
                            if table[j] >= 0:
                                pool.decref(table[j], priority, keep_cached, self._detach)
                                table[j] = -1
                else:
                    for j in range(released[name], upto):
                        if table[j] >= 0:
                            pool.decref(table[j], priority, keep_cached, self._detach)
                            table[j] = -1
                released[name] = max(released[name], upto)
        cache.slide_at = min(((released[name] + 1) * tpb + window - 1
                              for window, tpb, members in self._window_sets for name, _ in members), default=NEVER)

    def _slide_parked(self, prefix: PendingPrefix, names: list[str], index: tuple[int, ...],
                      tables: dict[str, list[int]], lo: int, priority: int) -> bool:
        """A lazily keyed cache's decode slide on a shared arena, in one pass: position ``lo`` of each of a window
        set's groups (``names``, arena indexes ``index``) parked under ``prefix`` and let go, when every group has its
        block there and holds it alone (the usual slide); whether it did (else nothing changed). Exactly
        :meth:`_park_blocks` then :meth:`SharedPool.release_slices` of that position (``TiedArena.release_slices``
        with the cuts tied, where a window set is one logical group).

        Why: a slide moves a block or two of each group, so the calls, lists and checks around those two (six calls
        a slide) cost more than the blocks' own work; on tiny-gemma3 ``no-reuse`` every decode block boundary
        slides."""
        arena = self._arena
        assert arena is not None
        got = [table[lo] for table in map(tables.__getitem__, names)]
        ref = arena.ref
        if len(got) < 2:
            # one group: a tie's logical sliding group (the page arena's single groups keep the per-group calls);
            # itemgetter of one id answers the item, not a tuple
            if self._tied_cuts is None or not got:
                return False
            b = got[0]
            if b < 0 or arena.group_of[b] != index[0] or ref[b] != 1:
                return False
        else:
            if -1 in got:
                return False
            get = itemgetter(*got)
            if get(arena.group_of) != index or get(ref).count(1) != len(got):
                return False
        # parked: what _park_blocks does for one position (a pending prefix has no children, so the blocks go to
        # the leaves, as release_slices queues them)
        if len(prefix.held) <= lo:
            self._grow(prefix, lo + 1)
        owner, pos, used, cached = arena.node, arena.pos, arena.used, arena.cached
        blocks = prefix.blocks
        for name, b in zip(names, got, strict=True):
            blocks[name][lo] = b
            tables[name][lo] = -1
        for b in got:
            owner[b] = prefix  # type: ignore[call-overload]
            pos[b] = lo
            ref[b] = 0
        for g in index:
            used[g] -= 1
            cached[g] += 1
        prefix.held[lo] += len(got)
        arena.evictable.add_many(got, priority)
        return True

    def _hang_parked(self, run: RadixNode, prefix: PendingPrefix, n: int) -> None:
        """:meth:`_materialize`'s hanging of a pending prefix's first ``n`` positions on ``run`` (fresh: every block
        -1, every count 0) on a shared arena: a group with a block at every position in one slice assignment, the
        counts raised once for all such groups (26 sliding and 5 full groups a prefix on Gemma 3 27B)."""
        counts, owner, whole = run.held, self._one_owner, 0
        assert owner is not None
        for name in self._names:
            dst, src = run.blocks[name], prefix.blocks[name][:n]
            if len(src) == n and -1 not in src:
                dst[:] = src
                for b in src:
                    owner[b] = run  # its position (pos[b] == i) stays
                whole += 1
                continue
            for i, b in enumerate(src):
                if b >= 0:
                    dst[i] = b
                    owner[b] = run
                    counts[i] += 1
        if whole:
            counts[:] = [c + whole for c in counts]

    def _add_latent(self, cache: SequenceCache, first: bytes) -> None:
        """Count a keyed-eagerly cache with no block in the tree yet: it may hang a run starting with ``first``."""
        latent, key = self._tree.latent, (cache.request.salt, first)
        latent[key] = latent.get(key, 0) + 1
        cache.latent = first

    def _drop_latent(self, cache: SequenceCache) -> None:
        """The cache hung its first block, or let go: it no longer stops ``first`` from being noted as pending."""
        latent, key = self._tree.latent, (cache.request.salt, cache.latent)
        cache.latent = None
        if latent[key] == 1:  # type: ignore[index]
            del latent[key]  # type: ignore[arg-type]
        else:
            latent[key] -= 1  # type: ignore[index]

    def _park(self, cache: SequenceCache, tail: int = 0) -> None:
        """A lazily keyed cache lets go: its full committed blocks stay cached under its pending prefix (and its
        partial last block of ``tail`` tokens: :meth:`_tail_to_keep`)."""
        prefix = cache.pending
        assert prefix is not None
        cache.pending = None
        n = cache.committed // self.T
        if not n or not cache.is_active:
            self._tree.drop_pending(prefix)
            return
        prefix.cache = None
        # below released[name] a table holds only -1 (a window let them go, parked then or freed): the groups that
        # released as far (a window set, the full-attention groups) are parked together
        by_lo: dict[int, list[str]] = {}
        released = cache.released
        for name, _, _, _ in self._attach_steps:
            lo = released[name]
            got = by_lo.get(lo)
            if got is None:
                by_lo[lo] = [name]
            else:
                got.append(name)
        for lo, names in by_lo.items():
            self._park_blocks(prefix, names, cache.tables, lo, n)
        if tail:  # the partial last block too, at position n (_materialize hangs it as its run's tail)
            self._park_blocks(prefix, self._names, cache.tables, n, n + 1)
            prefix.tail = tail
        if not any(prefix.held):  # every full block left a window and was freed (scratch reuse off): nothing cached
            self._tree.drop_pending(prefix)

    def _finish_parked(self, cache: SequenceCache) -> bool:
        """A lazily keyed cache's finish on a shared arena whose groups' blocks each span one token block, in one pass
        per table: its full committed blocks parked under its pending prefix and every block let go, when each table
        holds a block at every position from its window mark on, each its group's and held by this table alone, and
        none after the full ones is in the cache (the usual finish); whether it did (else nothing changed). Exactly
        :meth:`_park` then :meth:`_release_blocks`, on the page arena or with the cuts tied (a ``TiedArena``: the
        blocks are logical, a freed one gives its pages and id back).

        Why: the two walked every block twice (parking, then releasing with a branch per block for what a parked
        block is known to be), ~100 blocks a finish on tiny-gemma3 (6 groups), 512 finishes a ``no-reuse`` run."""
        n = cache.committed // self.T
        if not n:
            return False
        arena = self._arena
        assert arena is not None
        tables, released, names, index = cache.tables, cache.released, self._names, self._share_index
        ref, group_of, owner = arena.ref, arena.group_of, arena.node
        live: list[int] = []  # every table's blocks from its window mark on, and the group each should be
        want: list[int] = []
        tails: list[int] = []  # the blocks after the full ones
        for g, name in zip(index, names, strict=True):
            table = tables[name]
            lo = released[name]
            if lo > n or len(table) < n:
                return False
            got = table[lo:]
            live += got
            want += [g] * len(got)
            tails += table[n:]
        if not live:
            return False
        if len(live) > 1:
            get = itemgetter(*live)
            if min(live) < 0 or get(ref).count(1) != len(live) or list(get(group_of)) != want:
                return False
        elif live[0] < 0 or ref[live[0]] != 1 or group_of[live[0]] != want[0]:
            return False
        if tails and list(map(owner.__getitem__, tails)).count(None) != len(tails):
            return False
        # the checks passed: park and let go (what _park, _park_blocks, _release_blocks and release_tables do)
        prefix = cache.pending
        assert prefix is not None
        cache.pending = None
        prefix.cache = None
        r = self._tail_fn(self, cache)  # a partial last block parked too, at position n (its tokens: prefix.tail)
        end = n + 1 if r else n
        if len(prefix.held) < end:
            self._grow(prefix, end)
        self._count_worst(cache, -1)
        blocks, held, pos, free = prefix.blocks, prefix.held, arena.pos, arena._free
        used, kept = arena.used, arena.cached
        by_lo: dict[int, int] = {}  # window mark -> groups parked from it (a window set shares one)
        leaves: list[list[int]] = []  # each group's parked blocks, tail first (a pending prefix has no children)
        for g, name in zip(index, names, strict=True):
            table = tables[name]
            lo = released[name]
            got = table[lo:end]
            if got:
                blocks[name][lo:end] = got
                for j, b in enumerate(got, lo):  # this loop runs for every parked block: kept lean
                    owner[b] = prefix  # type: ignore[call-overload]
                    pos[b] = j
                    ref[b] = 0
                if lo < n:
                    by_lo[lo] = by_lo.get(lo, 0) + 1
                leaves.append(got[::-1])
            tail = table[end:]
            if tail:  # not full: free, tail first
                for b in tail:
                    ref[b] = 0
                    group_of[b] = -1
                if self._tied_cuts is None:
                    free += tail[::-1]
                else:  # tied, _free is pages: each logical block's pages and id go back (as release_tables frees)
                    arena._let_go(tail[::-1])  # type: ignore[attr-defined]
            used[g] -= len(table) - lo
            kept[g] += len(got)
            tables[name] = []
        for lo, k in by_lo.items():
            held[lo:n] = [h + k for h in held[lo:n]]
        if r:
            held[n] = len(names)
            prefix.tail = r
        if not any(held):  # (nothing parked: every group's mark at its full blocks' end)
            self._tree.drop_pending(prefix)
        arena._queue(interleave(leaves), [], cache.request.priority)
        cache.room = 0
        return True

    def _grow(self, prefix: PendingPrefix, n: int) -> None:
        """Give a pending prefix ``n`` positions (empty ones appended)."""
        k = n - len(prefix.held)
        prefix.held += [0] * k
        empty = [-1] * k
        blocks = prefix.blocks
        if len(blocks) < len(self._names):  # its first growth: a list per group
            for name in self._names:
                blocks.setdefault(name, [])
        for got in blocks.values():  # (every window slide of a lazily keyed cache grows it by one position)
            got += empty

    def _park_blocks(self, prefix: PendingPrefix, names: Iterable[str], tables: dict[str, list[int]], lo: int,
                     hi: int) -> None:
        """``tables[name][lo:hi]`` of each of ``names`` (a lazily keyed cache's blocks: leaving a window, or all its
        full ones when it lets go) stay cached under its pending prefix, as, keyed, they would stay in the tree.
        The groups of a window set or a life cycle in one call: Gemma 3 27B's window slides 26 groups at once."""
        if len(prefix.held) < hi:
            self._grow(prefix, hi)
        blocks, held = prefix.blocks, prefix.held
        if hi == lo + 1:  # a decode's slide: one position of each group (no slices, no enumerate per group)
            pools, k = self._pool, 0
            for name in names:
                b = tables[name][lo]
                if b >= 0:
                    pool = pools[name]
                    blocks[name][lo] = b
                    pool.node[b] = prefix  # type: ignore[call-overload]
                    pool.pos[b] = lo
                    k += 1
            held[lo] += k
            return
        whole = 0  # groups with a block at every position: their held counts are added once, after the loop
        for name in names:
            pool = self._pool[name]
            owner, pos, dst = pool.node, pool.pos, blocks[name]
            got = tables[name][lo:hi]
            if -1 not in got:  # the usual case: set in bulk
                dst[lo:hi] = got
                for j, b in enumerate(got, lo):
                    owner[b] = prefix  # type: ignore[call-overload]
                    pos[b] = j
                whole += 1
                continue
            for j, b in enumerate(got, lo):
                if b >= 0:
                    dst[j] = b
                    owner[b] = prefix  # type: ignore[call-overload]
                    pos[b] = j
                    held[j] += 1
        if whole:
            held[lo:hi] = [h + whole for h in held[lo:hi]]
