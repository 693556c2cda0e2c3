"""Finding a waiting request's cached prefix in V2's radix tree: lookups, the cache-aware pass's memo, probes
of a hit that claim nothing, and what admitting or refusing a probed hit does (:class:`PrefixLookup`, a part of
:class:`~cache_backends.v2.manager.KVCacheManagerV2`)."""

from __future__ import annotations

from collections.abc import Container
from itertools import chain, compress, repeat
from operator import attrgetter, getitem, is_, itemgetter, mul, not_, or_, sub
from typing import Any

import attrs

from cache_backends.hashing import pack_tokens
from cache_backends.layout import LayerGroup
from cache_backends.request import Request
from cache_backends.v2.radix import RadixNode, TailRun
from cache_backends.v2.shared_pool import interleave
from cache_backends.v2.tied_pool import TiedArena
from cache_backends.v2.token_runs import FIRST_TOKEN, first_packed, packed_prefix, token_slice

_SALT = attrgetter("salt")
_NO_HIT = (0, False)  # cached_prefix's answer where nothing cached starts like the request


@attrs.define(eq=False)
class HitProbe:
    """What admitting a waiting request would claim, found without claiming it (:meth:`KVCacheManagerV2.probe_hit`).

    Invariant: the pools and the tree are as they were when it was made (the scheduler asks about it, then admits
    the request, building it, or refuses it with :meth:`KVCacheManagerV2.refuse_hit`, before anything else changes).
    """

    tokens: int  # the prefix the claim holds: whole blocks (a multiple of every group's block span; 0: none), then
    # a copied partial block's tokens where ``partial`` is set
    last: RadixNode | None  # the run the claimed path ends at (already split there, as the claim splits it); None: 0
    claimed: list[tuple[list[int], list[int], int]]  # per group: its blocks on the path from ``lo``, their refs, lo
    taken: list[int]  # per pool set: cached blocks (nobody holds them) the claim takes out of the available ones
    taken_groups: list[int]  # the same per group (its use grows by them: the bound's ``used``)
    shared_taken: list[int]  # per pool set: how many of ``taken`` are queued as shared prefixes' (``held_back``)
    # the finished history's partial last block (``last.tail``) the build would copy into a free block of every group
    # (counted in ``taken``: the estimates are the built claim's; a refusal takes no block for it); None: no copy
    partial: TailRun | None = None

    def less(self, extra: list[int] | None) -> list[int]:
        """``extra`` (per pool set, as :meth:`KVCacheManagerV2.short_of` takes it) less :attr:`taken`: the built
        claim's pools have those fewer blocks available."""
        if extra is None:
            return [-k for k in self.taken]
        return [e - k for e, k in zip(extra, self.taken, strict=True)]


def _parts(run: RadixNode | None, i: int, n: int, blocks: int) -> bool:
    """Whether a walk that matched ``n`` of a request's ``blocks`` blocks, ending at position ``i`` of ``run``, parts
    from cached blocks there: the run holds another block at the next position, or has children (none the request's)."""
    return run is not None and n < blocks and (i + 1 < len(run.held) or bool(run.children))


@attrs.define(eq=False)
class _Walk:
    """What :meth:`KVCacheManagerV2._match` found for one request, and what of the request decided it: its first
    ``n`` blocks (``head``, their tokens) matched, then the walk stopped at block ``n`` because ``stop`` has no child
    keyed by it (``off`` -1) or ``stop``'s position ``off`` holds another block; or, ``stop`` None, the request
    had ``n`` blocks. Another request with the same ``head`` and a block ``n`` that stops it alike (or exactly ``n``
    blocks) walks the same path to the same run and count, so its answer is ``hit`` (while the tree is unchanged)."""

    n: int
    head: bytes  # the first n blocks' tokens, packed
    stop: RadixNode | None
    off: int
    hit: int
    branch: bool = False  # the walk parted from cached blocks (see KVCacheManagerV2.cached_prefix)

    @classmethod
    def of(cls, root: RadixNode | None, run: RadixNode | None, i: int, request: Request, blocks: int, T: int,
           hit: int) -> _Walk:
        """The walk that ended at position ``i`` of ``run`` (None: no child of ``root`` matched the first block)."""
        if run is None:
            n, stop, off = 0, root, -1
        else:
            n = run.start + i + 1
            stop, off = (None, -1) if n == blocks else (run, -1) if i + 1 == len(run.held) else (run, i + 1)
        return cls(n, packed_prefix(request, n * T)[:8 * n * T], stop, off, hit, _parts(run, i, n, blocks))

    def decides(self, request: Request, blocks: int, T: int) -> bool:
        """Whether ``request`` (of ``blocks`` whole blocks to look up) walks as this walk did."""
        n, stop = self.n, self.stop
        if blocks != n if stop is None else blocks <= n:
            return False
        packed = packed_prefix(request, blocks * T)  # (the request's own, kept: its walk reads it too)
        if not packed.startswith(self.head):
            return False
        if stop is None:
            return True
        w = 8 * T
        block = packed[n * w:(n + 1) * w]
        if self.off < 0:
            return block not in stop.children
        return stop.tokens[self.off * w:(self.off + 1) * w] != block


class PrefixLookup:
    """Lookups of cached prefixes for waiting requests, and probed hits admitted or refused."""

    def claims_nothing(self, request: Request) -> bool:
        """Whether admitting ``request`` now would claim no cached block, whole or partial: prefix reuse is off, the
        request reads no cached prefix (``skip_prefix_read``), or no cached run and no pending prefix of its scope
        starts with its first token (:meth:`_admit`'s cheap miss)."""
        if not self._reuse or request.skip_prefix_read:
            return True
        first = first_packed(request)
        return self._tree.pending_prefix(request.salt, first) is None and self._cheap_miss(request, first)

    def cached_prefix_tokens(self, request: Request, memo: dict[Any, list[_Walk]] | None = None) -> int:
        """The whole-block prefix of ``request`` a hit would claim if it were admitted now, claiming nothing (a
        pending prefix the lookup reaches is keyed, as admission's lookup would key it); ``memo`` as
        :meth:`cached_prefix` takes it."""
        return self.cached_prefix(request, memo)[0]

    def cached_prefix(self, request: Request, memo: dict[Any, list[_Walk]] | None = None) -> tuple[int, bool]:
        """:meth:`cached_prefix_tokens`, and whether the request parts from cached blocks where its walk ends: its
        next block differs from the block a cached run holds there, or from every child of the run it ends at (a
        system prompt others went on from), rather than the cached path ending where the request goes on (a
        conversation's history) or the request ending with it.

        ``memo``: a dict kept across the lookups of one pass in which nothing but these lookups changes the tree (the
        scheduler's cache-aware pass): a request whose blocks the walk of an earlier one in it decides (:class:`_Walk`)
        gets that walk's answer without a walk of its own. Why: the waiting prompts on a system prompt are looked up
        every step, each walking the same path (tiny-llama ``mixed`` at a quarter of the budget: 11,512 lookups on
        2,583 first blocks; BENCHMARKS.md, "relook44")."""
        if not self._reuse or request.skip_prefix_read:
            return 0, False
        T = self.T
        blocks = (request.num_tokens - 1) // T
        key = None
        if memo is not None and blocks >= 1 and self._prefix_check is None:
            # a walk under this key got past the pending prefix and the cheap miss: neither applies now either
            key = (request.salt, packed_prefix(request, blocks * T)[:8 * T])
            for walk in memo.get(key, ()):
                if walk.decides(request, blocks, T):
                    return walk.hit, walk.branch
        first = first_packed(request)
        prefix = self._tree.pending_prefix(request.salt, first)
        if prefix is not None:
            self._materialize(prefix)
        elif self._cheap_miss(request, first):  # claims_nothing's answer, its first token packed once
            return 0, False
        hit, run, i = self._match(request)
        if key is not None:
            walk = _Walk.of(self._tree.root(request.salt), run, i, request, blocks, T, hit)
            memo.setdefault(key, []).append(walk)
            return hit, walk.branch
        return hit, _parts(run, i, 0 if run is None else run.start + i + 1, blocks)

    def cached_prefixes(self, requests: list[Request], memo: dict[Any, list[_Walk]] | None = None
                        ) -> list[tuple[int, bool]]:
        """:meth:`cached_prefix` of each of ``requests`` (waiting requests, looked up in one pass: ``memo`` as
        :meth:`cached_prefix` takes it), in order; an answer kept from an earlier pass while the tree has not changed
        since (``RadixTree.version``) is not looked up again, and where several are, :meth:`may_find_prefix` rules
        out at once those no cached run starts like.

        Why: under pressure most steps change nothing in the tree a lookup reads (Gemma 3 27B ``mixed`` at a quarter
        of the budget: no change between 4 in 5 of the cache-aware passes), yet every hinted waiting request was
        looked up again each step, the same answer 95 times in 100 (BENCHMARKS.md "perf66a").

        Exact: a lookup's answer is a function of the request's tokens and of what the tree holds: the salt's root,
        its runs' children, tokens, positions and which of their blocks are there (``_cheap_miss``, ``_match``,
        ``_usable_prefix``, ``_parts``), and a pending prefix of the request's first token (hung by the lookup, so
        none is left there after it). Every change to those raises ``version`` (its docstring) and clears the kept
        answers; a waiting request's tokens do not change (they grow only while it runs: admission drops its kept
        answer, ``_activate``). Off where :meth:`limit_reuse`'s check applies (its answer may change with the
        caller's state) or reuse is off."""
        if not self._reuse or self._prefix_check is not None:
            if len(requests) < 2:
                return [self.cached_prefix(r, memo) for r in requests]
            return [self.cached_prefix(r, memo) if may else _NO_HIT
                    for r, may in zip(requests, self.may_find_prefix(requests), strict=True)]
        tree = self._tree
        looked = tree.looked
        todo: list[int] | None = None  # where the answers of ``rest`` go in ``got`` (None: rest is requests)
        rest = requests
        if tree.looked_at == tree.version:
            got = list(map(looked.get, requests))
            if None not in got:  # (most passes under pressure)
                return got  # type: ignore[return-value]
            if got.count(None) != len(got):
                todo = list(compress(range(len(got)), map(is_, got, repeat(None))))
                rest = list(map(requests.__getitem__, todo))
        else:
            looked.clear()
            tree.looked_at = tree.version
        # (the passes over the requests in C: the relook's ~90 cold requests are mostly ruled out by their first token)
        if len(rest) > 1:
            mays = self.may_find_prefix(rest)
            # those ruled out are kept at this version, before any lookup of the rest can move it (a lookup that hangs
            # a pending prefix does)
            looked.update(zip(compress(rest, map(not_, mays)), repeat(_NO_HIT)))
            answers = [_NO_HIT] * len(rest)
            ahead = compress(range(len(rest)), mays)
        else:
            answers, ahead = [_NO_HIT] * len(rest), range(len(rest))
        for j in ahead:
            r = rest[j]
            answers[j] = answer = self.cached_prefix(r, memo)
            if tree.looked_at != tree.version:  # this lookup hung a pending prefix: the earlier answers go
                looked.clear()
                tree.looked_at = tree.version
            looked[r] = answer
        if todo is None:
            return answers
        for i, answer in zip(todo, answers, strict=True):
            got[i] = answer
        return got  # type: ignore[return-value]

    def may_find_prefix(self, requests: list[Request]) -> list[bool]:
        """Per request, False where :meth:`cached_prefix_tokens` would answer 0 from its first token alone: no run
        hung under its salt, and no pending prefix of it, starts with that token (the lookup's cheap miss); True
        where only a lookup answers. Claims nothing and changes nothing.

        Why: a cache-aware pass looks up many waiting requests whose prompts share nothing cached (a miss looked up
        again: unrelated long prompts); each lookup's own calls to reach its cheap miss cost more than the check,
        which this does for them all against the first tokens of the salt's runs (BENCHMARKS.md, "relook44")."""
        if not self._reuse:
            return [False] * len(requests)
        # first_packed's answer where the request keeps its packed tokens (every one looked at before), without a
        # call per request: the relook's ~90 cold requests every LPM_RELOOK steps (~5.9 against ~8.9 us for 128)
        firsts = [r.packed_ids[:8] or first_packed(r) for r in requests]
        salts = set(map(_SALT, requests))
        if len(salts) == 1:
            return self._may_start(salts.pop(), firsts)
        return [self._may_start(r.salt, [first])[0] for first, r in zip(firsts, requests, strict=True)]

    def _may_start(self, salt: str | None, firsts: list[bytes]) -> list[bool]:
        """Per packed first token in ``firsts``, whether a run hung under ``salt``'s root or a pending prefix of it
        starts with it (for the rest of a pass too: hanging a pending prefix adds a run it names)."""
        root, pending = self._tree.root(salt), self._tree.pending.get(salt)
        if root is None:
            runs: Container[bytes] = ()
        elif root.by_first is not None:  # the root's index (many runs): probed, not copied, every step
            runs = root.by_first
        else:
            runs = set(map(FIRST_TOKEN, root.children))
        may = map(runs.__contains__, firsts)
        return list(map(or_, may, map(pending.__contains__, firsts)) if pending else may)

    def probe_hit(self, request: Request, build: bool = False) -> HitProbe | None:
        """What :meth:`create` + :meth:`resume` would claim for ``request`` now (a whole-block cached prefix), found
        without claiming it, for the estimates (``start``/``probe`` arguments) and :meth:`refuse_hit`; None where
        only building it answers: a partial block to copy (it allocates, and may evict), unless it is the history's
        own partial last block where ``_tail_probes`` allows and no KV events are recorded (then probed: the copy is
        counted in ``taken``, never made: ``HitProbe.partial``; but not where the copy would find no room or slide a
        window at once); a whole-block hit on a
        shared arena whose groups' blocks span several token blocks, reuse off. With ``build``, a None comes with
        the request's cache built (:meth:`create` + :meth:`resume`, in this call), reusing the lookup just made
        where it found a partial block to copy. A request whose first token starts a
        cached run but which can use no whole block (and copies none) is probed on any layout: its claim is empty
        (``tokens`` 0). Pools per group whose blocks span several token blocks (DeepSeek V4's compressed groups)
        are probed too: such a block is kept at the last position it spans.
        Nothing a build would not do changes: a pending prefix its lookup reaches is hung in the tree and the run
        the claimed path ends inside is split, as the build's lookup and claim do first (so the build, if it
        follows, finds the same prefix).

        Why: under pressure the head of the waiting queue is refused step after step, and building its claim of a
        cached history, then cancelling it, was most of V2's work (Gemma 3 27B: every block of the history in each
        of 31 groups, twice, every step; BENCHMARKS.md "V2 refuses a hit without building it"); an empty claim
        was built and cancelled too, its lookup done twice (DeepSeek V4 mixed at a quarter of the budget: 8.8%)."""
        if not self._reuse or request.skip_prefix_read or request in self._caches:
            return self._unprobed(request, build)
        T, tree = self.T, self._tree
        first = first_packed(request)
        prefix = tree.pending_prefix(request.salt, first)
        if prefix is not None:  # as the build's lookup does before anything else
            self._materialize(prefix)
        if self._cheap_miss(request, first):
            return self._unprobed(request, build)
        m, run, _ = self._match(request)
        if not m:  # the build would claim nothing whole; a partial block only where one is copied
            if self._partial and self._prefix_check is None:
                source = self._partial_source(request, tree.root(request.salt), 0)
                if source[0] is not None:
                    return self._unprobed(request, build, (0, None, source))
            sets, groups = len(self._pool_sets), len(self._groups)
            return HitProbe(0, None, [([], [], 0)] * groups, [0] * sets, [0] * groups, [0] * sets)
        if not self._probes:
            return self._unprobed(request, build)
        assert run is not None
        last, i = tree.position(run, m // T - 1)
        if i + 1 < len(last.held) or not last.held[i]:
            last = tree.claim(last, i)  # the build's split; its user is given back at once
            tree.leave(last)
        # else the pair changes nothing: no split (the path ends at the run's end), every run on the path gains a
        # user and loses it, and the leave trims nothing (the path's last position holds a block, so ``last`` keeps
        # it, and every run above has a child). Why skipped: a refused head is probed every step (BENCHMARKS.md
        # "perf66b")
        partial, k = None, 0
        if self._partial and self._prefix_check is None:  # a copy follows (a limited prefix, DeepSeek V4's: none)
            partial, k = self._partial_source(request, last, m)
            # probed only where refuse_hit can redo what building and cancelling it leaves, less the copy's take (a
            # refusal takes no block for a copy it never makes, so evicts none): the copy's source is the history's
            # partial last block (the cancel's finish keeps it as it is: _keep_tail), the estimates counting what the
            # take would evict (_tail_probes). Why: a follow-up turn ends its history inside a block, so under
            # pressure its refused head was built and cancelled every step (tiny-llama multi-turn at a quarter of the
            # budget: a quarter of V2's work)
            if partial is not None and (partial is not last.tail or not self._tail_probes
                                        or self.kv_events is not None):
                # (a leave that trimmed the path's last position would leave it ending elsewhere: looked up again)
                return self._unprobed(request, build, (m, last, (partial, k)) if last.held[-1] else None)
        path = [last]  # the path's runs, root side last: walked once, not once per group (tree.path_blocks)
        while path[-1].parent is not None and path[-1].parent.parent is not None:
            path.append(path[-1].parent)  # type: ignore[arg-type]
        path.reverse()
        # per life cycle: the first group block the claim holds (a window's start), the same for every group of it
        los = [0 if g.window is None else max(0, m - g.window + 1) // g.tokens_per_block for g, _ in self._cycles]
        claimed: list[tuple[list[int], list[int], int]] = []
        taken_groups: list[int] = []
        cached_of: list[list[int]] = []  # per group, the blocks nobody holds: the claim takes them out of the queue
        if self._unit_spans and len(path) == 1:
            # the usual (a history ending in one run, a block per position): the loop below in C passes over the
            # groups. Why: a refused head is probed every step under pressure, a Python pass per group of 31 on
            # Gemma 3 27B (BENCHMARKS.md, "V2 per-step work under pressure")
            lo_of = list(map(los.__getitem__, self._cycle_of))
            blocks_of = list(map(getitem, map(last.blocks.__getitem__, self._names), map(slice, lo_of, repeat(None))))
            refs_of = list(map(list, map(map, self._ref_of, blocks_of)))
            taken_groups = list(map(list.count, refs_of, repeat(0)))
            claimed = list(zip(blocks_of, refs_of, lo_of, strict=True))
            if sum(taken_groups) == sum(map(len, blocks_of)):  # nobody holds any: every block is taken
                cached_of = blocks_of
            else:
                cached_of = [blocks if cached == len(blocks) else list(compress(blocks, map(not_, refs)))
                             for blocks, refs, cached in zip(blocks_of, refs_of, taken_groups, strict=True)]
        else:
            for (name, tpb, pool), c in zip(self._group_pools, self._cycle_of, strict=True):
                lo = los[c]
                # the path's blocks from position lo (the last run ends where the claimed prefix does); a block
                # spanning several token blocks (DeepSeek V4's compressed groups) is kept at the last position it spans
                along = (last.blocks[name] if len(path) == 1
                         else list(chain.from_iterable(run.blocks[name] for run in path)))
                step = tpb // T
                blocks = along[lo:] if step == 1 else along[(lo + 1) * step - 1:m // T:step]
                refs = list(map(pool.ref.__getitem__, blocks))
                cached = refs.count(0)
                taken_groups.append(cached)
                # the usual: a waiting request's history, held by nobody
                cached_of.append(blocks if cached == len(blocks) else list(compress(blocks, map(not_, refs))))
                claimed.append((blocks, refs, lo))
        if self._arena is not None:  # one pool set, one eviction queue; taken in pages
            arena = self._arena
            evicted_shared = 0
            if partial is not None:  # the cuts tied (_tail_probes): a copy's logical block of every group, in pages
                queue = arena.evictable
                srcs = [partial.blocks[name][0] for name in self._names]
                held_srcs = list(compress(srcs, map(not_, map(arena.ref.__getitem__, srcs))))  # queued, the copy holds
                # a copy that takes a window past a block boundary has the build slide it at once: the slid blocks
                # queued again (and the queue's stale demotions with them) before the estimates; only building answers
                for (g, _), lo in zip(self._cycles, los, strict=True):
                    if g.window is not None and max(0, m + k - g.window + 1) // self.T != lo:
                        return self._unprobed(request, build, (m, last, (partial, k)) if last.held[-1] else None)
                skip: set[int] | None = None  # what the claim and the copy's hold take out of the queue, where asked
                short = self._row_pages - len(arena._free)
                if short > 0:  # the copy evicts: the rows the take would pop, those out of the queue skipped
                    out = [*chain.from_iterable(cached_of), *held_srcs]
                    if arena.available - queue._pages(out) < self._row_pages:
                        # no room for the copy: the build copies nothing (only building answers)
                        return self._unprobed(request, build, (m, last, (partial, k)) if last.held[-1] else None)
                    skip = set(out)
                    evicted = queue.peek_pages(short, skip)
                    evicted_shared = queue.count_shared(evicted)
                    skip.update(evicted)
                # the source queued again (a leaf: a tail has no children) may demote stale shared pages
                back = queue._pages(held_srcs)
                if back and queue.num_shared:
                    if skip is None:
                        skip = {*chain.from_iterable(cached_of), *held_srcs}
                    evicted_shared += queue.stale_pages(back, skip)
                taken_groups = [t + 1 for t in taken_groups]
            weights = self._weights
            taken = [sum(taken_groups) if weights is None else sum(map(mul, taken_groups, weights))]
            # (no shared page queued: none of the cached blocks, all queued, is one; a pass over them saved)
            shared_taken = [(arena.evictable.count_shared(list(chain.from_iterable(cached_of)))
                             if arena.evictable.num_shared else 0) + evicted_shared]
        else:  # a pool per group: pool set i is group i
            if partial is not None:  # the copy's block, in use beside the claim's
                for (name, _, pool), t in zip(self._group_pools, taken_groups, strict=True):
                    # what the copy finds available once the claim and its source are out of the queue; none: the
                    # build copies nothing (only building answers then)
                    if pool.available - t - (not pool.ref[partial.blocks[name][0]]) < 1:
                        # (built with the lookup just made, as the tail's copy above: a None with ``build`` comes
                        # with the cache built)
                        return self._unprobed(request, build, (m, last, (partial, k)) if last.held[-1] else None)
                taken_groups = [t + 1 for t in taken_groups]
            taken = taken_groups
            shared_taken = [pool.evictable.count_shared(cached) if pool.evictable.num_shared else 0
                            for (_, _, pool), cached in zip(self._group_pools, cached_of, strict=True)]
        if partial is not None:
            return HitProbe(m + k, last, claimed, taken, taken_groups, shared_taken, partial)
        return HitProbe(m, last, claimed, taken, taken_groups, shared_taken)

    def _unprobed(self, request: Request, build: bool,
                  found: tuple[int, RadixNode | None, tuple[RadixNode | None, int]] | None = None) -> None:
        """:meth:`probe_hit`'s None; with ``build``, the request's cache built first (:meth:`create` + :meth:`resume`),
        its admission given ``found`` (the probe's lookup: :meth:`_admit`) where there is one.

        Why: a follow-up turn on a shared arena (every Gemma 3 27B one) copies its history's partial last block, so
        its probe answers None and the scheduler builds it at once; built apart, its lookup (the match, the path's
        split, the partial source) ran twice. Here nothing runs between the probe's lookup and the build's."""
        if build:
            self._admit(self.create(request), found)
        return None

    def admit_hit(self, probe: HitProbe, request: Request) -> None:
        """:meth:`create` + :meth:`resume` for the request ``probe`` was made for, claiming what the probe found (the
        pools and tree are as it found them: :class:`HitProbe`), without looking it up again: the same cache, the
        same blocks taken out of the eviction queue, the same counters."""
        if probe.partial is not None:  # a copy: built as create + resume would, from the probe's lookup (_unprobed's)
            last = probe.last
            assert last is not None
            m = (last.start + len(last.held)) * self.T  # the claimed path ends at its last run's end
            # (a leave that trimmed the path's last position left it ending elsewhere: looked up again)
            self._admit(self.create(request), (m, last, (probe.partial, probe.tokens - m)) if last.held[-1] else None)
            return
        cache = self.create(request)
        m, last = probe.tokens, probe.last
        self.counters["reuse_query_tokens"] += request.num_tokens
        if last is None:  # an empty claim: as _admit leaves a lookup that matched no whole block (and no partial)
            cache.last = None
            cache.keyed = 0
            cache.key_at = self.T
            if self._lazy:  # a probed request has two tokens or more (no cheap miss): a first one
                self._add_latent(cache, pack_tokens(token_slice(request, 0, 1)))
            self._activate(cache, 0)
            return
        for (name, _, pool), (blocks, _, lo) in zip(self._group_pools, probe.claimed, strict=True):
            pool.incref_many(blocks)
            cache.tables[name] = [-1] * lo + blocks
            cache.released[name] = lo
        cache.last = self._tree.claim(last, len(last.held) - 1)  # the path ends at the run's end: no split
        cache.keyed = m // self.T
        cache.key_at = (cache.keyed + 1) * self.T
        self._activate(cache, m)

    def refuse_hit(self, probe: HitProbe, request: Request) -> None:
        """What building ``probe``'s claim for ``request`` and cancelling it (:meth:`cancel_admission`) leaves
        changed: the claimed blocks nobody else holds go back to the eviction queue as the youngest of the
        request's priority, in the order the release queues them — per group tail first, leaves of the path's last
        run before the shared prefixes' blocks (every earlier run of the path has the next as its child), a shared
        arena's groups position by position (``SharedPool.release_tables``). Everything else a build and cancel
        touch (reference counts, use counts, counters, the request's token counts, the path's users) ends as it
        was. So a refused hit keeps its history warm (young in the queue), as it did when it was built.

        A probe whose build would copy its history's partial last block (``probe.partial``) leaves one thing less
        changed than building and cancelling it did: no block is taken for the copy it never makes, so nothing is
        evicted for it (:meth:`_refuse_copy`). Why: where no block was free, that take evicted the oldest cached
        block (a page row, tied) every step the head stayed refused, shrinking the cache for nothing (Gemma 3 27B
        ``multi-turn`` at a quarter of the budget: 68.2% -> 68.7% of prompt tokens reused; BENCHMARKS.md
        "refuse65")."""
        priority = request.priority
        last = probe.last
        if last is None:  # an empty claim: building and cancelling it leaves nothing changed
            return
        if probe.partial is not None:
            (self._refuse_copy if self._arena is None else self._refuse_copy_tied)(probe, priority)
            return
        if self._arena is not None:
            self._arena.evictable.requeue(*self._requeued(probe), priority)
            return
        leaves_of, shared_of = self._requeue_order(probe)
        for (_, _, pool), leaves, shared in zip(self._group_pools, leaves_of, shared_of, strict=True):
            pool.evictable.requeue(leaves, shared, priority)

    #: :meth:`_requeued`'s last answer and what it was computed from (None: none yet)
    _requeued_memo: tuple[tuple[Any, ...], tuple[list[int], list[int]]] | None = None

    def _requeued(self, probe: HitProbe) -> tuple[list[int], list[int]]:
        """:meth:`_requeue_order` of ``probe`` on a shared arena, each list interleaved position by position (the
        release's order there): (leaves, shared prefixes' blocks). Callers read the lists and never change them.

        Memo, exact: :meth:`_requeue_order` reads nothing but ``probe.claimed`` (blocks, references, first
        position), ``probe.taken_groups``, whether ``probe.partial`` is None, the start and whether there are children
        of ``probe.last``, and the manager's fixed layout (groups, spans, ``_unit_spans``); the last answer is given
        again only where all of those equal, by value, what it was computed from (a copy, kept apart from the probe's
        lists). Why: a head refused step after step is probed with the same claim every step (Gemma 3 27B
        multi-turn at a quarter of the budget: 531 of 585 repeated probes found the same claim), and its order's
        slices and interleaving were ~2% of V2's CPU (BENCHMARKS.md "perf66b")."""
        last = probe.last
        assert last is not None
        key = (probe.claimed, probe.taken_groups, probe.partial is None, last.start, bool(last.children),
               self._unit_spans)
        memo = self._requeued_memo
        if memo is not None and memo[0] == key:
            return memo[1]
        leaves_of, shared_of = self._requeue_order(probe)
        out = interleave(leaves_of), interleave(shared_of)
        kept = ([(list(blocks), list(refs), lo) for blocks, refs, lo in probe.claimed], list(probe.taken_groups),
                *key[2:])
        self._requeued_memo = (kept, out)
        return out

    def _refuse_copy_moved(self, probe: HitProbe, source: TailRun, arena: TiedArena, priority: int) -> bool:
        """:meth:`_refuse_copy_tied` by moving whole queue segments, where the blocks it takes out and queues again are
        each queued as one segment as it would queue them (the last refusal of the same turn left them so: the usual
        for a head refused step after step); False where they are not, with nothing changed.

        Exact, as :meth:`RowQueue.requeue_runs` moves them: what the slow path does to the queue is every claimed block
        nobody holds and every queued source out, then the sources queued as the let-go (``TiedArena.decref_each``)
        queues them (one call while no shared page is left queued and they share a priority and are leaves; else one
        call each), then the leaves, then the shared prefixes' blocks. References and use counts are held and let go
        (net nothing: a queued source is cached, so its owner keeps it); the path's claim and leave change nothing
        where its last position holds a block (:meth:`probe_hit`), else they are made as there. Why: the slow path's
        passes over the history (out of the queue and in again, tags and priorities set per block) ran every step a
        turn waited (Gemma 3 27B multi-turn at a quarter of the budget: ~5% of V2's CPU; BENCHMARKS.md "perf66b")."""
        queue, ref = arena.evictable, arena.ref
        srcs = [b for b in (source.blocks[name][0] for name in self._names) if not ref[b]]  # queued: held, let go
        leaves, shared = self._requeued(probe)
        runs: list[tuple[list[int], int, bool]] = []
        if srcs:
            prio, node = arena.priority, arena.node
            ps = list(map(prio.__getitem__, srcs))
            flags = [bool(getattr(node[b], "children", None)) for b in srcs]
            # the shared pages queued once everything is out (the let-go's choice reads it): the shared list's, and
            # those of the sources queued shared (the leaves' segment, checked below, is a leaf one; every source here
            # is queued, cached and held by nobody, and as a tail's never shared in practice)
            left = queue.num_shared - queue._pages(shared) - queue.count_shared(srcs)
            if not left and not any(flags) and ps.count(ps[0]) == len(ps):
                runs.append((srcs, ps[0], False))
            else:
                runs += [([b], p, f) for b, p, f in zip(srcs, ps, flags, strict=True)]
        if leaves:
            runs.append((leaves, priority, False))
        if shared:
            runs.append((shared, priority, True))
        if not runs or not queue.requeue_runs(runs):
            return False
        last = probe.last
        assert last is not None
        if not last.held[-1]:  # (else the pair changes nothing: see probe_hit)
            self._tree.leave(self._tree.claim(last, len(last.held) - 1))
        return True

    def _requeue_order(self, probe: HitProbe) -> tuple[list[list[int]], list[list[int]]]:
        """Per group, the claimed blocks of ``probe`` nobody else holds as the cancel's release queues them: (leaves,
        shared prefixes' blocks), each tail first (:meth:`refuse_hit`)."""
        last = probe.last
        assert last is not None
        whole_shared = bool(last.children)  # the claimed path's last run has children: all of it is queued shared
        leaves_of: list[list[int]] = []
        shared_of: list[list[int]] = []
        T = self.T
        blocks_of = list(map(itemgetter(0), probe.claimed)) if self._unit_spans else []
        # (a copy's block is counted in taken_groups: its probe takes the loop)
        if blocks_of and probe.partial is None and probe.taken_groups == list(map(len, blocks_of)):
            # the usual (a block per position, the claim held by nobody): the loop below in C passes over the
            # groups, as probe_hit's; blocks[k:] lie in the last run, k = max(0, last.start - lo) with a step of 1
            ks = (list(map(len, blocks_of)) if whole_shared
                  else list(map(max, repeat(0), map(sub, repeat(last.start), map(itemgetter(2), probe.claimed)))))
            back = repeat(slice(None, None, -1))
            leaves_of = list(map(getitem, map(getitem, blocks_of, map(slice, ks, repeat(None))), back))
            shared_of = list(map(getitem, map(getitem, blocks_of, map(slice, repeat(None), ks)), back))
        else:
            for (blocks, refs, lo), (_, tpb, _) in zip(probe.claimed, self._group_pools, strict=True):
                # blocks[k:] lie in the last run (group block j at position (j + 1) * step - 1)
                step = tpb // T
                k = len(blocks) if whole_shared else max(0, -(-(last.start + 1) // step) - 1 - lo)
                head, tail = blocks[:k], blocks[k:]
                if refs.count(0) != len(refs):  # some held by running requests: only the others go back to the queue
                    head = list(compress(head, map(not_, refs[:k])))
                    tail = list(compress(tail, map(not_, refs[k:])))
                leaves_of.append(tail[::-1])
                shared_of.append(head[::-1])
        return leaves_of, shared_of

    def _refuse_copy(self, probe: HitProbe, priority: int) -> None:
        """:meth:`refuse_hit` for a probe whose build copies its history's partial last block (``probe.partial``):
        what the build and the cancel do to the pools and the tree, in their order, less the claim's per-block work
        and less the copy itself. The claim's cached blocks leave the queue and its path gains a user; the copy's
        source is held in every group and let go (queued again as the youngest of its priority, so the history's
        tail stays warm); the claim's blocks are queued as the cancel's release queues them and the path is let go.
        No block is taken for the copy: building took one and the cancel freed it, evicting the oldest queued block
        where none was free, a block lost for a copy never made (BENCHMARKS.md "refuse65"). Free list, references,
        generations and counters end as they were. (The claim's blocks leave the queue and come back in Python
        loops, not in ``EvictionQueue.requeue``'s C passes, which take twice the CPU for a history of 25 blocks:
        timeit, 12 against 5-7 µs; and so a stale demotion meets the queue as the build leaves it.)"""
        groups, tree, detach = self._group_pools, self._tree, self._detach
        last, source = probe.last, probe.partial
        assert last is not None and source is not None
        sources = [source.blocks[name][0] for name, _, _ in groups]
        for (_, _, pool), (blocks, refs, _) in zip(groups, probe.claimed, strict=True):
            pool.evictable.remove_many(list(compress(blocks, map(not_, refs))))  # as the claim's incref_many
        held = tree.claim(last, len(last.held) - 1)  # the path ends at the run's end: no split
        for (_, _, pool), src in zip(groups, sources, strict=True):
            pool.incref(src)
        for (_, _, pool), src in zip(groups, sources, strict=True):
            pool.decref(src, pool.priority[src], True, detach)
        leaves_of, shared_of = self._requeue_order(probe)
        for (_, _, pool), leaves, shared in zip(groups, leaves_of, shared_of, strict=True):
            if leaves:
                pool.evictable.add_many(leaves, priority)
            if shared:
                pool.evictable.add_many(shared, priority, True)
        tree.leave(held)

    def _refuse_copy_tied(self, probe: HitProbe, priority: int) -> None:
        """:meth:`_refuse_copy` with the cuts tied: the claim's cached blocks out of the queue group by group (its
        ``incref_groups``), the path claimed, the source held and let go, then the cancel's release: the claim queued
        position by position (``TiedArena.release_tables``' order), the path let go. No logical block is taken for
        the copy, so no page row is evicted for it; references, counts, free pages and ids end as they were. Where the
        last refusal of the same claim left its blocks and the source queued whole, they are moved back whole instead
        (:meth:`_refuse_copy_moved`: the same queue)."""
        arena, tree, index = self._arena, self._tree, self._share_index
        last, source = probe.last, probe.partial
        assert isinstance(arena, TiedArena) and last is not None and source is not None
        queue, k = arena.evictable, arena.k
        if self._refuse_copy_moved(probe, source, arena, priority):
            return
        for (blocks, refs, _), i in zip(probe.claimed, index, strict=True):  # (a group's blocks weigh its k pages)
            queue.remove_weighing(list(compress(blocks, map(not_, refs))), k[i])
        held = tree.claim(last, len(last.held) - 1)  # the path ends at the run's end: no split
        srcs = [source.blocks[name][0] for name in self._names]
        arena.incref_each(index, srcs)
        arena.decref_each(index, srcs, list(map(arena.priority.__getitem__, srcs)))
        leaves_of, shared_of = self._requeue_order(probe)
        leaves, shared = interleave(leaves_of), interleave(shared_of)
        if leaves:
            queue.add_many(leaves, priority)
        if shared:
            queue.add_many(shared, priority, True)
        tree.leave(held)

    def _match(self, request: Request) -> tuple[int, RadixNode | None, int]:
        """Walk the radix tree over the request's full blocks, comparing tokens: (usable prefix, the run and offset
        of the last matched position).

        Run by run: a run's positions are compared in one slice, the request's blocks packed as far as runs reach (a
        conversation's history is a few runs of many blocks, looked up every step while its next turn waits)."""
        limit = request.num_tokens - 1  # at least the last token is computed, so there are logits
        root = self._tree.root(request.salt)
        T = self.T
        blocks = limit // T
        if root is None or blocks < 1:
            return 0, None, 0
        w = 8 * T
        packed = packed_prefix(request, blocks * T)  # (at least the blocks' tokens; compared only within them)
        run: RadixNode | None = None
        node, i, n = root, 0, 0
        while n < blocks:
            at = n * w
            child = node.children.get(packed[at:at + w])
            if child is None:
                break
            run = child
            m = min(len(child.held), blocks - n)  # the run's positions the request's blocks reach
            # the run's positions after its key against the request's next blocks, in place (startswith at an offset
            # compares without slicing the request's side; the run's side is m - 1 blocks, within the request's)
            if m == 1 or packed.startswith(child.tokens[w:m * w], at + w):
                i, n, node = m - 1, n + m, child  # the whole run, or the request's blocks end inside it
                continue
            lo, hi = 1, m - 1  # equal positions: the first (the child's key), not all m
            while lo < hi:  # the longest equal stretch: equal prefixes are nested, so bisect
                mid = (lo + hi + 1) // 2
                if packed.startswith(child.tokens[w:mid * w], at + w):
                    lo = mid
                else:
                    hi = mid - 1
            i, n = lo - 1, n + lo
            break
        if run is None:
            return 0, None, 0
        return self._usable_prefix(run, n, request), run, i

    def _usable_prefix(self, last: RadixNode, n: int, request: Request | None = None) -> int:
        """The longest multiple of the reuse unit, within the first ``n`` positions of the path through ``last``
        (which holds position ``n - 1``), whose blocks every group still holds (and :meth:`limit_reuse`'s check
        accepts for ``request``)."""
        T, unit = self.T, self.reuse_unit or self.T
        top = n * T // unit * unit
        if top == 0:
            return 0
        # the usual case: every group holds a block at every position of the path (a run's held counts them), so
        # every length suits every group; checked per run, not per group (31 path walks on Gemma 3 27B's arena)
        groups = len(self._groups)
        held = last.held[: n - last.start]
        whole = held.count(groups) == len(held)
        node = last.parent
        while whole and node is not None and node.parent is not None:
            whole = node.held.count(groups) == len(node.held)
            node = node.parent
        limit = self._prefix_check
        if whole and limit is None:
            return top
        ends = self._tree.path_blocks(last, n, limit[0]) if limit is not None else []
        covered: dict[str, int] = {}  # growing groups: group blocks present from 0
        counts: dict[str, list[int]] = {}  # sliding groups whose blocks span several positions: prefix counts
        along_of: dict[str, list[int]] = {}  # sliding groups with a block per position: their blocks on the path
        gaps = []  # the groups missing a block on the path: only they can rule a length out
        for g in () if whole else self._groups:
            step = g.tokens_per_block // T
            along = self._tree.path_blocks(last, n, g.name)
            if step == 1:  # a group block per position: searched at C speed
                if -1 not in along:  # every block there (the usual case), so every length suits the group
                    continue
                if g.window is None:
                    covered[g.name] = along.index(-1)
                else:  # each length's window is looked up where it lies (a few blocks) instead of counting them all
                    along_of[g.name] = along
                gaps.append(g)
                continue
            gaps.append(g)
            present = [along[(j + 1) * step - 1] >= 0 for j in range(n // step)]
            if g.window is None:
                covered[g.name] = next((j for j, p in enumerate(present) if not p), len(present))
            else:
                acc = [0]
                for p in present:
                    acc.append(acc[-1] + p)
                counts[g.name] = acc
        m = top
        while m > 0:
            for g in gaps:  # each group: the longest length up to m it holds the blocks for; any shorter: start over
                fit = self._group_fit(g, m, unit, covered, along_of, counts)
                if fit < m:
                    m = fit
                    break
            else:
                if limit is None or (request is not None and limit[1](request, m, ends[m // T - 1])):
                    return m
                m -= unit
        return 0

    @staticmethod
    def _group_fit(g: LayerGroup, m: int, unit: int, covered: dict[str, int], along_of: dict[str, list[int]],
                   counts: dict[str, list[int]]) -> int:
        """The longest multiple of ``unit``, at most ``m``, whose blocks ``g`` holds (:meth:`_usable_prefix`'s
        tables; 0: none).

        Why a jump rather than a step: a stale hit (a waiting turn whose history's window blocks were evicted) is
        looked up every step, and stepping down one unit at a time re-checked every group at every length below a
        gap; a length fails exactly while its window (or growing prefix) covers a missing block, so the next length
        that can fit is the one whose window ends before the first missing block it covered."""
        tpb = g.tokens_per_block
        if g.window is None:  # blocks present from 0 up to covered[g.name]
            c = covered[g.name]
            return m if m // tpb <= c else ((c + 1) * tpb - 1) // unit * unit
        lo, hi = max(0, m - g.window + 1) // tpb, m // tpb
        blocks = along_of.get(g.name)
        if blocks is not None:
            window = blocks[lo:hi]
            if -1 not in window:
                return m
            gap = lo + window.index(-1)
        else:
            acc = counts[g.name]
            if acc[hi] - acc[lo] == hi - lo:
                return m
            gap = next(j for j in range(lo, hi) if acc[j + 1] == acc[j])
        # a shorter length's window starts no later, so it covers the window's first missing block until it ends
        # before it
        return ((gap + 1) * tpb - 1) // unit * unit

    def _cheap_miss(self, request: Request, first: bytes) -> bool:
        """Whether no cached block of the request's scope starts with its first token (``first``, packed), so that
        neither a full block nor part of one can match (what :meth:`_match` and :meth:`_claim_partial` would find
        then, without packing and looking up a whole block twice: every request of a no-reuse workload takes this
        path)."""
        if len(request.prompt_token_ids) + len(request.output_token_ids) < 2:  # request.num_tokens, inlined
            return True
        root = self._tree.root(request.salt)  # _starts_cached, inlined: every lookup of a waiting request asks it
        return root is None or not root.has_child_starting_with(first)

    def _starts_cached(self, request: Request, first: bytes) -> bool:
        """Whether a run hung under the request's salt starts with the token packed as ``first``."""
        root = self._tree.root(request.salt)
        return root is not None and root.has_child_starting_with(first)
