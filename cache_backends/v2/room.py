"""How much room V2's pools have and a request needs: joint shortfalls, held-back prefixes, growth estimates and
fits (:class:`RoomEstimates`, a part of :class:`~cache_backends.v2.manager.KVCacheManagerV2`)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from itertools import repeat
from operator import add, mul, sub

from cache_backends.layout import longest
from cache_backends.request import Request
from cache_backends.v2.group_pool import GroupPool
from cache_backends.v2.lookup import HitProbe
from cache_backends.v2.sequence import SequenceCache
from cache_backends.v2.shared_pool import SharedPool


def _most_fitting(want: int, fits: Callable[[int], bool], lo: int = 0) -> int:
    """The largest ``n <= want`` with ``fits(n)`` (``fits`` monotone, ``fits(lo)`` true), by binary search."""
    return want if fits(want) else longest(fits, want - 1, lo)


def fit_spans(want: int, available: int, spans: list[tuple[int, int]]) -> int:
    """The most tokens ``n <= want`` (``want >= 0``) whose blocks fit ``available`` arena blocks from empty tables:
    ``sum(count * ceil(n / span)) <= available`` over ``spans`` as (tokens per block, groups with it)."""
    if len(spans) == 1:  # every group's blocks span the same tokens: whole blocks per group, in closed form
        tpb, count = spans[0]
        return min(want, available // count * tpb)

    def fits(n: int) -> bool:
        return sum(-(-n // tpb) * count for tpb, count in spans) <= available

    # n / span <= ceil(n / span) < n / span + 1 brackets the answer within about one block's tokens
    rate = sum(count / tpb for tpb, count in spans)
    hi = min(want, int(available / rate) + 1)
    lo = max(0, min(hi, int((available - sum(count for _, count in spans)) / rate) - 1))
    return _most_fitting(hi, fits, lo if fits(lo) else 0)


class RoomEstimates:
    """Room in the pools and what requests need of it: the estimates admission and scheduling ask."""

    def _where(self, names: list[str]) -> str:
        """How messages name a pool: its group, or the arena the groups share."""
        if self._tied_cuts is not None:  # the tied arena, by the groups the user sees: its cuts
            return f"the arena shared by {len(self.layout.groups)} groups"
        return f"group {names[0]}" if len(names) == 1 else f"the arena shared by {len(names)} groups"

    def short_of(self, *needs: list[int], extra: list[int] | None = None, sets: list[int] | None = None) -> bool:
        """Whether :meth:`shortfall` of the sum of ``needs`` says something, without wording it (the admission
        estimate's check, refused step after step under pressure). ``needs`` are per life cycle, as
        :meth:`cycle_growth` and :meth:`cycle_headroom` give them (every group of a cycle needs the same blocks; a
        cycle's negative sum counts as 0); ``sets`` (per pool set, as :meth:`growth_bound_sets`) adds blocks needed,
        ``extra`` (per pool set, as :meth:`freed_by` counts) adds blocks to what each pool set has available."""
        return self._short_cycles(needs, extra, sets) is not None

    def per_group(self, per_cycle: list[int]) -> dict[str, int]:
        """A per-cycle estimate (:meth:`cycle_growth`, :meth:`cycle_headroom`) as blocks per group, by name."""
        return self._by_cut({g.name: per_cycle[c] for g, c in zip(self._groups, self._cycle_of, strict=True)})

    def _by_cut(self, per_group: dict[str, int]) -> dict[str, int]:
        """A per-group figure by the names the user sees: with the cuts tied, each cut shows its logical group's
        (a logical block is one page of each cut), in ``layout.groups`` order; else ``per_group`` itself."""
        if self._tied_cuts is None:
            return per_group
        return {cut: per_group[g.name] for g, cuts in zip(self._groups, self._tied_cuts, strict=True) for cut in cuts}

    def _logical_needs(self, need: dict[str, int]) -> dict[str, int]:
        """``need`` by cut name as blocks per logical group (with the cuts tied): a cut's ``n`` pages are ``n``
        logical blocks of its group (the most any of its cuts needs), since a tie takes a row of pages at once.
        Logical names (the manager's own calls) pass through."""
        if not self._cut_of:
            return need
        out: dict[str, int] = {}
        for name, n in need.items():
            cut = self._cut_of.get(name)
            key = self._groups[cut[0]].name if cut is not None else name
            out[key] = max(out.get(key, n), n)
        return out

    def shortfall(self, need: dict[str, int]) -> str | None:
        """Why blocks per group ``need`` (negative counts as 0) cannot all be allocated now, or None when they can.

        The one feasibility rule: the needs of the groups that share a pool are summed against that pool's
        free plus evictable blocks (a shared arena: every group's need together; otherwise each group alone).
        """
        short = self._first_short((self._logical_needs(need),))
        if short is None:
            return None
        pool, names, n = short
        if self._slabs is not None:
            return (f"{n} blocks of {self._where(names)} needed, {pool.available} free or evictable in its slabs, "
                    f"{len(self._slabs.free)} free slabs, with the other groups' needs")
        return f"{n} blocks of {self._where(names)} needed, {pool.available} free or evictable"

    def _short_cycles(self, needs: tuple[list[int], ...], extra: list[int] | None = None,
                      sets: list[int] | None = None) -> tuple[GroupPool | SharedPool, list[str], int] | None:
        """:meth:`_first_short` for needs per life cycle, plus ``sets[i]`` blocks needed in pool set ``i``: the
        groups of a cycle need the same, so a set's need is one product per cycle in it (2 on Gemma 3 27B's arena of
        31 groups), not a sum over its groups."""
        set_cycles = self._set_cycles
        if self._slabs is not None:  # pool set i is group i, checked with every other at once
            per_group = []
            for i in range(len(self._pool_sets)):
                n = sets[i] if sets else 0
                for c, k in set_cycles[i]:
                    t = sum(need[c] for need in needs)
                    if t > 0:
                        n += k * t
                per_group.append(n)
            return self._joint(per_group, extra)
        for i, (pool, names) in enumerate(self._pool_sets):
            n = sets[i] if sets else 0
            for c, k in set_cycles[i]:
                t = 0
                for need in needs:
                    t += need[c]
                if t > 0:
                    n += k * t
            if n > pool.available + (extra[i] if extra else 0):
                return pool, names, n
        return None

    def _first_short(self, needs: tuple[dict[str, int], ...], extra: list[int] | None = None,
                     ) -> tuple[GroupPool | SharedPool, list[str], int] | None:
        """The first pool set that cannot hold the per-group sum of ``needs`` (a group's negative sum counts as 0),
        with ``extra[i]`` more blocks available in pool set ``i``: (pool, its groups, blocks needed); None when every
        one can."""
        if self._slabs is not None:
            return self._joint([max(0, sum(need.get(name, 0) for need in needs)) for _, (name,) in self._pool_sets],
                               extra)
        weight = self._page_weight
        for i, (pool, names) in enumerate(self._pool_sets):
            n = 0
            for name in names:
                k = 0
                for need in needs:
                    k += need.get(name, 0)
                if k > 0:
                    n += k * weight[name]  # (pages: a block of the group holds that many)
            if n > pool.available + (extra[i] if extra else 0):
                return pool, names, n
        return None

    def _take_slabs(self, need: list[int]) -> None:
        """After a joint check of ``need`` (blocks per group, in group order) passed, give every group the slabs it
        lacks before any group allocates (a no-op without a slab arena). Why first: a group's cached block taken
        first could sit in the very slab the check counted on another group reclaiming, and then a check that passed
        would fail to allocate."""
        if self._slabs is not None:
            self._slabs.acquire(need, self._detach)

    def _joint(self, per_group: list[int], extra: list[int] | None) -> tuple[GroupPool, list[str], int] | None:
        """A slab arena's :meth:`_first_short`: the first group whose blocks the arena cannot give together with the
        others' (:meth:`SlabArena.short`)."""
        assert self._slabs is not None
        i = self._slabs.short(per_group, extra)
        if i is None:
            return None
        pool, names = self._pool_sets[i]
        return pool, names, per_group[i]  # type: ignore[return-value]

    def window_keeps(self, m: int, committed: int) -> bool:
        """Whether a hit of ``m`` tokens on a sequence's prefix still finds every sliding-group block it reads (the
        window at ``m``) once that sequence has committed ``committed`` tokens: always, unless the blocks a window lets
        go are freed rather than cached (``enable_swa_scratch_reuse`` false) and a window has moved past ``m``'s.
        Why: the scheduler's wait for a prefix in flight must not wait for a block the same step frees."""
        if self.options.enable_swa_scratch_reuse:
            return True
        return all(max(0, m - g.window + 1) // g.tokens_per_block >= max(0, committed - g.window + 1)
                   // g.tokens_per_block for g in self._sliding)

    @property
    def shortest_window(self) -> float:
        """The shortest sliding window in tokens (``inf`` on a layout without one): :meth:`held_back` holds nothing
        while no sequence is longer. Why public: the scheduler tests that bound without building a second hold."""
        return self._min_window

    def held_back(self, share: float, longest: int, probe: HitProbe | None = None) -> list[int] | None:
        """Per pool set, minus the cached blocks of shared prefixes admission leaves alone (at most ``share`` of the
        pool set's blocks), as ``extra`` for :meth:`fit_tokens` and :meth:`short_of`; None on a layout without
        sliding windows, or while no sequence (``longest``: the longest's tokens) is longer than the shortest window:
        then the windows free nothing, V2 has no more room than V1, and holding prefixes would cost concurrency.
        With ``probe``: as its claim, built, would leave them (the shared blocks it takes are no longer queued)."""
        if longest <= self._min_window:
            return None
        if probe is not None:
            return [-min(pool.evictable.num_shared - k, int(share * pool.num_blocks))
                    for (pool, _), k in zip(self._pool_sets, probe.shared_taken, strict=True)]
        return [-min(pool.evictable.num_shared, int(share * pool.num_blocks)) for pool, _ in self._pool_sets]

    def freed_by(self, requests: Iterable[Request]) -> list[int]:
        """Per pool set (``_pool_sets``), the device blocks that would become free or evictable if every one of
        ``requests`` (active) let go of its blocks, by suspension or preemption: those no one else holds.

        Why: the "priority" policy moves out worse-ranked requests for a better-ranked one only when that makes
        it fit (SGLang's rule); moving them out and still refusing it would leave their room idle."""
        held: dict[int, Counter[int]] = {}
        sets = {name: i for i, (_, names) in enumerate(self._pool_sets) for name in names}
        weight = self._page_weight if self._weights is not None else None
        pages_of: dict[int, int] = {}  # a block's pages, where a group's block holds more than one (_pages_per_block)
        for r in requests:
            for name, table in self._active(r).tables.items():
                counts = held.setdefault(sets[name], Counter())
                counts.update(b for b in table if b >= 0)
                if weight is not None:
                    pages_of.update(dict.fromkeys(table, weight[name]))
        out = [0] * len(self._pool_sets)
        for i, counts in held.items():
            ref = self._pool_sets[i][0].ref
            out[i] = sum(1 if weight is None else pages_of[b] for b, k in counts.items() if ref[b] == k)
        return out

    def fit_tokens(self, request: Request, want: int, extra: list[int] | None = None) -> int:
        """The most tokens, up to ``want``, that :meth:`allocate` could reserve now (0: not even one); with ``extra``
        (per pool set) more blocks available, as :meth:`short_of`."""
        cache = self._active(request)
        want = min(want, self.options.max_seq_len - cache.committed,
                   request.num_tokens_with_drafts - cache.committed)
        if want <= 0:
            return 0

        arena, spans = self._arena, self._spans
        if self._slabs is not None:
            slabs, tables, committed = self._slabs, cache.tables, cache.committed

            def joint(n: int) -> bool:
                return slabs.short([-(-(committed + n) // tpb) - len(tables[name])
                                    for name, tpb, _ in self._group_pools], extra) is None

            return _most_fitting(want, joint)
        if arena is None:  # a pool per group: group g can hold len(table) + available blocks, that many tokens
            tables, committed = cache.tables, cache.committed
            if extra is None:
                most = min((len(tables[name]) + pool.available) * tpb for name, tpb, pool in self._group_pools)
            else:  # a pool per group: pool set i is group i
                most = min((len(tables[name]) + pool.available + k) * tpb
                           for (name, tpb, pool), k in zip(self._group_pools, extra, strict=True))
            return max(0, min(want, most - committed))
        available = arena.available + (extra[0] if extra else 0)

        def fits(n: int) -> bool:  # the shortfall rule per span: a span's groups need the same blocks
            return sum(max(0, k) * count for k, (_, count) in zip(self._span_need(cache, cache.committed + n), spans,
                                                                   strict=True)) <= available

        return _most_fitting(want, fits)

    # A request that can claim no cached prefix would start from an empty cache: what create + resume + fit_tokens
    # (and growth_blocks, growth_bound) would say then follows from the pools alone. The scheduler asks these first,
    # so an admission that fails (a long prompt waiting for room, every step under pressure) builds and tears down
    # nothing; the answers equal the built path's (tests/test_kv_v2_scheduler.py checks them side by side).
    def fit_tokens_new(self, request: Request, want: int, extra: list[int] | None = None, start: int = 0) -> int:
        """:meth:`fit_tokens` for ``request`` as :meth:`create` + :meth:`resume` would leave it, when
        :meth:`claims_nothing` holds (an empty cache); nothing is built. With ``start``, a :meth:`probe_hit`'s
        ``tokens`` (and ``extra`` less what it takes: :meth:`HitProbe.less`), as they would leave it: a cache of whole
        blocks of every group needs for ``n`` more tokens what an empty one needs for ``n``."""
        want = min(want, self.options.max_seq_len - start, request.num_tokens_with_drafts - start)
        if want <= 0:
            return 0
        arena, spans = self._arena, self._spans
        if self._slabs is not None:
            slabs = self._slabs

            def joint(n: int) -> bool:
                return slabs.short([-(-n // tpb) for _, tpb, _ in self._group_pools], extra) is None

            return _most_fitting(want, joint)
        if arena is None:
            more = extra or [0] * len(self._group_pools)  # a pool per group: pool set i is group i
            most = min((pool.available + k) * tpb for (_, tpb, pool), k in zip(self._group_pools, more, strict=True))
            # a probe's copied partial block (``start`` inside a block, counted in ``extra``) has room for the rest
            return max(0, min(want, most - start % -self.T))
        available = arena.available + (extra[0] if extra else 0)
        rest = -start % self.T  # a probe's copied partial block (start inside a block: every span T) holds the rest
        if rest:  # (no room at all: the built cache's fit is 0, its block's rest included)
            return 0 if available < 0 else want if want <= rest else fit_spans(want - rest, available, spans) + rest
        return fit_spans(want, available, spans)

    def growth_blocks_new(self, request: Request, ratio: float, scheduled: int) -> dict[str, int]:
        """:meth:`growth_blocks` for ``request`` as :meth:`create` + :meth:`resume` would leave it, when
        :meth:`claims_nothing` holds (capacity 0); nothing is built."""
        return self.per_group(self.cycle_growth_new(request, ratio, scheduled))

    def cycle_growth_new(self, request: Request, ratio: float, scheduled: int, start: int = 0) -> list[int]:
        """:meth:`growth_blocks_new` per life cycle (``_cycles``), as :meth:`short_of` takes it; with ``start``, a
        :meth:`probe_hit`'s ``tokens``, as its claim would leave it (capacity and committed ``start``)."""
        return self._growth(request, start, start + scheduled, ratio)

    def growth_bound_with(self, request: Request) -> dict[str, int]:
        """:meth:`growth_bound` once ``request`` (not admitted yet, claiming nothing) would be active."""
        return self._by_cut(dict(zip(self._names, self._bound_per_group(request), strict=True)))

    def growth_bound_sets(self, request: Request | None = None, probe: HitProbe | None = None) -> list[int]:
        """:meth:`growth_bound` (with ``request``: :meth:`growth_bound_with`) summed per pool set, as ``sets`` for
        :meth:`short_of`: admission's cheap check needs no group's name. With ``probe`` (and its ``request``): as its
        claim would leave it (the cached blocks it takes in use)."""
        per = self._bound_per_group(request, probe.taken_groups if probe is not None else None)
        if self._arena is not None:  # one pool set, every group, in pages
            return [sum(per) if self._weights is None else sum(map(mul, per, self._weights))]
        return list(per)  # a pool per group: pool set i is group i

    def _bound_per_group(self, request: Request | None, taken: list[int] | None = None) -> Iterable[int]:
        """Per group (``groups`` order), :meth:`growth_bound`'s entry, with ``request`` counted as active (and, per
        group, ``taken`` more blocks in use)."""
        worst: Iterable[int] = self._worst_blocks
        if request is not None:
            n = min(request.max_total_tokens, self.options.max_seq_len)
            per = [g.blocks_for(n) for g, _ in self._cycles]
            worst = [w + per[c] for w, c in zip(self._worst_blocks, self._cycle_of, strict=True)]
        # a shared arena keeps every group's use in one list, in groups order (its shares' indexes)
        used: Iterable[int] = (self._arena.used if self._arena is not None
                               else [pool.num_used for _, _, pool in self._group_pools])
        if taken is not None:
            used = map(add, used, taken)
        return map(max, map(sub, worst, used), repeat(0))

    def growth_blocks(self, request: Request, ratio: float, scheduled: int = 0) -> dict[str, int]:
        """Blocks per group ``request`` would still take for ``scheduled`` more tokens, then ``ratio`` of the way on
        to its worst case (:meth:`worst_case_tokens`); a sliding group never needs more than its window's blocks.
        An estimate for admission (block rounding per group, windows as whole), never an allocation."""
        return self.per_group(self.cycle_growth(request, ratio, scheduled))

    def cycle_growth(self, request: Request, ratio: float, scheduled: int = 0) -> list[int]:
        """:meth:`growth_blocks` per life cycle (``_cycles``): every group of a cycle takes the same blocks."""
        cache = self._active(request)
        return self._growth(request, cache.capacity, cache.committed + scheduled, ratio)

    def _growth(self, request: Request, now: int, start: int, ratio: float) -> list[int]:
        """Per life cycle: the blocks a cache holding ``now`` tokens takes to grow to ``start`` tokens (at least
        ``now``), then ``ratio`` of the way on to the request's worst case."""
        start = max(now, start)
        target = start + math.ceil(ratio * max(0, self.worst_case_tokens(request) - start))
        if not now:
            return [g.blocks_for(target) for g, _ in self._cycles]
        return [max(0, g.blocks_for(target) - g.blocks_for(now)) for g, _ in self._cycles]

    def cycle_headroom(self, requests: Iterable[Request], ratio: float) -> list[int]:
        """:meth:`cycle_growth` summed over active ``requests``, per life cycle (one pass, no per-request lists: it
        runs every step that admits)."""
        limit, caches, ceil = self.options.max_seq_len, self._caches, math.ceil
        if len(self._cycles) == 1 and self._cycles[0][0].max_blocks_per_sequence is None:
            # the usual (one life cycle, no window): summed in the same pass, no (now, target) pairs kept and read
            # again by a generator; this runs every step that admits, over every running request. (Map passes over
            # the requests count fewer opcodes but cost 2-3x the CPU: timeit, 22 requests, 6.6 µs against 16-22 µs)
            tpb = self._cycles[0][0].tokens_per_block
            total = 0
            for r in requests:
                cache = caches[r]
                now = cache.capacity
                worst = cache.worst
                if worst < 0:  # once per request: prompt + max_new_tokens within max_seq_len (it never changes)
                    worst = cache.worst = min(r.max_total_tokens, limit)
                if worst > now:
                    total += -(-(now + ceil(ratio * (worst - now))) // tpb) + now // -tpb
            return [total]
        if self._one_span_cap is not None:
            # every cycle one block span, the capped ones one cap: each request's blocks now and after growing counted
            # once for all cycles, in the same pass (no (now, target) pairs read again by a generator per cycle).
            # Why: under pressure this runs every step the head is refused, over every running request (Gemma 3 27B
            # multi-turn at a quarter of the budget: the generators were 3.7% of V2's CPU; BENCHMARKS.md "perf61")
            tpb, cap, capped = self._one_span_cap
            full = win = 0  # blocks an uncapped cycle grows by; a capped one
            for r in requests:
                cache = caches[r]
                now = cache.capacity
                worst = cache.worst
                if worst < 0:  # once per request (as above)
                    worst = cache.worst = min(r.max_total_tokens, limit)
                if worst > now:
                    t = -(-(now + ceil(ratio * (worst - now))) // tpb)
                    n0 = -(-now // tpb)
                    full += t - n0
                    if n0 < cap:  # past the cap a window's blocks stay as many
                        win += (t if t < cap else cap) - n0
            return [win if c else full for c in capped]
        spans: list[tuple[int, int]] = []  # (tokens held now, tokens after growing ``ratio`` of the way)
        for r in requests:
            cache = caches[r]
            now = cache.capacity
            worst = cache.worst
            if worst < 0:  # once per request: prompt + max_new_tokens within max_seq_len (it never changes)
                worst = cache.worst = min(r.max_total_tokens, limit)
            if worst > now:
                spans.append((now, now + ceil(ratio * (worst - now))))
        per = []
        for g, _ in self._cycles:  # once per life cycle, not per group
            tpb, cap = g.tokens_per_block, g.max_blocks_per_sequence
            if cap is None:
                per.append(sum(-(-target // tpb) + (now // -tpb) for now, target in spans))
            else:
                per.append(sum(min(-(-target // tpb), cap) - min(-(-now // tpb), cap) for now, target in spans))
        return per

    def growth_bound(self) -> dict[str, int]:
        """Per group, an upper bound of :meth:`cycle_headroom` over every active cache at any ratio, in O(groups):
        the blocks active caches hold at their worst cases minus the blocks in use (shared ones count once)."""
        return self._by_cut(dict(zip(self._names, self._bound_per_group(None), strict=True)))

    def available_blocks(self) -> dict[str, int]:
        """Blocks per group an allocation could take now (free plus evictable); the groups of a shared arena each
        show the arena's, so check several groups' needs together with :meth:`shortfall`."""
        if self._tied_cuts is not None:  # each cut shows the arena's pages, as the page arena of the cuts does
            return dict.fromkeys((g.name for g in self.layout.groups), self._arena.available)  # type: ignore[union-attr]
        return {name: pool.available for name, pool in self._pool.items()}

    def worst_case_tokens(self, request: Request) -> int:
        """Tokens ``request`` holds at its longest: prompt + max_new_tokens capped at ``max_seq_len``
        (or what it holds now, if a driver already fed it more)."""
        return max(request.num_tokens, min(request.max_total_tokens, self.options.max_seq_len))

    def never_fits(self, request: Request) -> str | None:
        """Why ``request`` could not reach its worst case (:meth:`worst_case_tokens`) even alone in empty pools."""
        # the head of a queue under pressure is asked every step: its answer changes only with its length
        key = (request, request.num_tokens, request.max_total_tokens)
        memo = self._never_fits_memo
        if memo is not None and memo[0] == key:
            return memo[1]
        why = self._never_fits(request)
        self._never_fits_memo = (key, why)
        return why

    def _never_fits(self, request: Request) -> str | None:
        limit = self.options.max_seq_len
        if request.num_prompt_tokens > limit:
            return (f"request {request.req_id} has a {request.num_prompt_tokens}-token prompt, "
                    f"longer than max_seq_len={limit}")
        n = request.num_tokens
        if n > limit:
            return f"request {request.req_id} has {n} tokens, more than max_seq_len={limit}"
        n = self.worst_case_tokens(request)
        what = ""
        if n > request.num_tokens:
            capped = f" capped at max_seq_len={limit}" if n < request.max_total_tokens else ""
            what = f" (prompt + max_new_tokens{capped})"
        if self._slabs is not None:  # alone in the arena: every group's blocks in slabs of its own
            slabs = self._slabs
            per_group = [g.blocks_for(n) for g in self._groups]
            k = slabs.slabs_for(per_group)
            if k > slabs.num_slabs:
                each = ", ".join(f"{g.name} {b} blocks" for g, b in zip(self._groups, per_group, strict=True))
                return (f"request {request.req_id} needs {k} slabs of the arena for {n} tokens{what} ({each}; a slab "
                        f"holds one group's blocks); the arena has {slabs.num_slabs}")
            return None
        for (pool, names), cycles in zip(self._pool_sets, self._pool_cycles, strict=True):
            need = sum(g.blocks_for(n) * count for g, count in cycles)
            if need > pool.num_blocks:
                return f"request {request.req_id} needs {need} blocks of {self._where(names)} for {n} tokens{what}; " \
                       f"the pool has {pool.num_blocks}"
        return None

    def _count_worst(self, cache: SequenceCache, sign: int) -> None:
        """Add (``sign`` 1, on activation) or remove (-1, on release) a cache's worst-case blocks."""
        if cache.worst < 0:
            cache.worst = min(cache.request.max_total_tokens, self.options.max_seq_len)
        worst, totals = cache.worst, self._worst_blocks
        for g, members in self._cycles:
            n = sign * g.blocks_for(worst)
            for i in members:
                totals[i] += n
