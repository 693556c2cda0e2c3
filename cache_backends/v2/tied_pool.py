"""A tie of a shared arena's cuts: logical blocks of k pages and their eviction queue, counted in pages.

Why: Gemma 3 27B's arena is 31 groups (26 sliding cuts and 5 full cuts of 2 layers each, ``layout.share_pages``)
that take, slide, release and leave the cache a row at a time (``SharedPool._row_rest``; BENCHMARKS.md "tie57",
"tie57b"), yet the manager walks 31 block tables for every admission, claim, keying, release and slide. A tie gives
the manager one logical group per family (2 on Gemma 3 27B) whose logical block owns ``k`` pages, one a cut. For its
decisions to stay those of the page arena, its queue must evict the rows the page queue evicts, in the same order,
and count what the page queue counts: queued pages (``len``: the arena's ``available``), shared pages
(``num_shared``: ``KVCacheManagerV2.held_back``) and the clock of queued pages (stale shared prefixes are demoted
``STALE_POOLS`` pools' worth of *pages* later). :class:`RowQueue` is :class:`EvictionQueue` with each entry weighing
``weight[b]`` pages in all of those; :meth:`RowQueue.pop_pages` pops whole entries until it has the pages asked,
which is what the page queue's pop of ``n`` pages followed by freeing the rest of every row it touched does, as long
as every queued row's pages lie next to each other in the page queue (``KVCacheManagerV2._check_rows`` checks it).

Invariants (weights fixed while an entry is queued): ``len(q) == sum(weight[b] for b in q.blocks())``;
``q.num_shared`` is the same sum over the shared buckets; ``q._clock`` is the pages ever queued (a refresh counts its
entries' pages again, as the page queue counts each refreshed page).

:class:`TiedArena` is the arena of the tie: logical blocks owning ``k`` pages each, per-logical-block references,
radix owners and queue, free space in pages (its takes, slides, finish release, hit claims, a partial hit's source
hold and a stale tail's drop checked against ``SharedPool`` of the cuts in ``tests/test_kv_v2_tied.py``);
:class:`TiedShare` is a logical group's view with ``GroupShare``'s interface, counted in blocks of ``k`` pages. The
manager runs on it wherever a shared arena has cuts (``cache_backends.v2.manager.TIE_CUTS``; BENCHMARKS.md "tie57"
to "tie58").
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from operator import itemgetter, mul

from cache_backends.v2 import group_pool
from cache_backends.v2.group_pool import _SHARED_BIT, EvictionQueue, _key_of
from cache_backends.v2.shared_pool import interleave

_SHARED = 1 << _SHARED_BIT  # a queued block's tag carries it where the block is a shared prefix's


class RowQueue(EvictionQueue):
    """An :class:`EvictionQueue` whose entry ``b`` weighs ``weight[b]`` pages in its length, shared count and clock."""

    def __init__(self, priority: list[int], weight: list[int], pages: int, heaviest: int | None = None) -> None:
        super().__init__(priority)
        if len(weight) != len(priority):
            raise ValueError(f"{len(weight)} weights for {len(priority)} entries")
        self._weight = weight  # (the caller's list: an entry's weight is set before it is queued)
        # the page queue's threshold: pools' worth of pages (read as EvictionQueue reads it: when built)
        self._stale = group_pool.STALE_POOLS * pages
        self._pending = 0  # the pages of the entries the call in progress queues (read by _queued)
        # no entry weighs more (None: not known): pop_pages pops as many entries at once as must go in any case
        self._heaviest = heaviest

    def _pages(self, blocks: Iterable[int]) -> int:
        return sum(map(self._weight.__getitem__, blocks))

    def _queued(self, n: int, shared: bool) -> None:
        super()._queued(self._pending, shared)

    def add_many(self, blocks: Sequence[int], priority: int, shared: bool = False) -> None:
        """Queue ``blocks`` as :meth:`EvictionQueue.add_many` does, each weighing its pages."""
        self._pending = self._pages(blocks)
        super().add_many(blocks, priority, shared)

    def add_released(self, blocks: Sequence[int], priority: int, ref: list[int]) -> int:
        """:meth:`EvictionQueue.add_released`, each entry weighing its pages (a block listed twice: see there)."""
        tags = self._tag  # (the pages of those it queues anew: not one listed twice or queued already)
        self._pending = self._pages(b for b in dict.fromkeys(blocks) if tags[b] < 0)
        return super().add_released(blocks, priority, ref)

    def _demote_stale(self) -> None:
        # the entries EvictionQueue._demote_stale moves: each shared bucket's front segments while dead or stale (it
        # looks at no others). Why not every shared entry before and after: that walk ran at every queue call while
        # any shared entry was queued, ~200 us a call with 1,000 shared rows queued (BENCHMARKS.md "rev58")
        limit, tags = self._clock - self._stale, self._tag
        demoted: list[int] = []
        for key, bucket in self._by_key.items():
            if key >> _SHARED_BIT:
                for live, tag, blocks, at, clock in bucket:
                    if live and clock >= limit:
                        break
                    if live:
                        demoted += [b for b in blocks[at:] if tags[b] == tag]
        super()._demote_stale()
        # EvictionQueue took one a demoted entry off num_shared; the pages they weigh come off instead
        self.num_shared += len(demoted) - self._pages(demoted)

    def remove_many(self, blocks: Sequence[int]) -> None:
        """:meth:`EvictionQueue.remove_many`, the length and shared count lowered by the pages taken out."""
        self._counted_out(blocks, lambda: super(RowQueue, self).remove_many(blocks))

    def remove_weighing(self, blocks: Sequence[int], weight: int) -> None:
        """:meth:`remove_many` of ``blocks`` that each weigh ``weight`` pages (one logical group's, ids of its blocks):
        :meth:`EvictionQueue.remove_many` counts one off the length (and the shared count) an entry it takes out, even
        where it stops at an error, so the pages are those counts times ``weight``, with no pass over the blocks' tags
        and weights. Why: a hit's claim and a refused copy take a history's blocks out group by group, every step a
        waiting turn is refused under pressure (Gemma 3 27B multi-turn at a quarter of the budget: the passes of
        :meth:`_counted_out` were 3.3% of V2's CPU; BENCHMARKS.md "perf61")."""
        n_len, n_shared = self._len, self.num_shared
        try:
            EvictionQueue.remove_many(self, blocks)
        finally:
            self._len = n_len - (n_len - self._len) * weight
            self.num_shared = n_shared - (n_shared - self.num_shared) * weight

    def claim_many(self, blocks: Sequence[int], ref: list[int]) -> None:
        """:meth:`EvictionQueue.claim_many`, the length and shared count lowered by the pages taken out."""
        self._counted_out(blocks, lambda: super(RowQueue, self).claim_many(blocks, ref))

    def _counted_out(self, blocks: Sequence[int], take: object) -> None:
        tags = self._tag
        n_len, n_shared = self._len, self.num_shared
        try:  # every listed block's tag before the take, in one C pass (a hit's claim: every block it claims)
            before = list(map(tags.__getitem__, blocks))
        except (IndexError, TypeError):  # an id outside the queue (the caller's error): the take raises, counted below
            before = None
        if before is not None:
            try:
                take()  # type: ignore[operator]
            except BaseException:
                self._count_out(dict(zip(blocks, before, strict=True)), n_len, n_shared)
                raise
            # taken without error: every block was queued, once (the take raises on one that is not, a repeat
            # included) and is out now: what the pass below counts, without the passes
            weight = self._weight
            self._len = n_len - sum(map(weight.__getitem__, blocks))
            self.num_shared = n_shared - sum(itertools.compress(map(weight.__getitem__, blocks),
                                                                map(_SHARED.__and__, before)))
            return
        tags_of = {b: tags[b] for b in blocks if 0 <= b < len(tags)}
        try:
            take()  # type: ignore[operator]
        finally:
            self._count_out(tags_of, n_len, n_shared)

    def _count_out(self, before: dict[int, int], n_len: int, n_shared: int) -> None:
        """The length and shared count after a take that may have stopped at an error (a KeyError leaves the blocks
        before the bad one out): lowered by the pages of those queued ``before`` (block -> tag, the take's blocks in
        order) that are out now."""
        tags = self._tag
        queued = [b for b, tag in before.items() if 0 <= b < len(tags) and tag >= 0]
        out = [b for b in queued if tags[b] < 0]
        self._len = n_len - self._pages(out)
        self.num_shared = n_shared - self._pages(b for b in out if before[b] >> _SHARED_BIT & 1)

    def count_shared(self, blocks: Sequence[int]) -> int:
        """The pages of ``blocks`` (queued) queued as shared prefixes' blocks."""
        # (bit 64 of a tag, as ``tag >> _SHARED_BIT & 1`` reads it, in C passes: a refused head's probe counts its
        # whole history every step; BENCHMARKS.md "perf66b")
        return sum(itertools.compress(map(self._weight.__getitem__, blocks),
                                      map(_SHARED.__and__, map(self._tag.__getitem__, blocks))))

    def requeue(self, leaves: list[int], shared: list[int], priority: int) -> None:
        """:meth:`EvictionQueue.requeue`: ``leaves`` and ``shared`` out, then queued again, weighed in pages; each list
        the whole of one segment (the last refusal's) moved to its bucket's young end whole, as there. Why: a refused
        hit on the tied arena took its history out and queued it again entry by entry every step it was refused."""
        leaf_seg = self._whole_segment(leaves, _key_of(priority, False))
        shared_seg = self._whole_segment(shared, _key_of(priority, True))
        if leaf_seg is not None and shared_seg is not None:  # EvictionQueue.requeue's moves, counted in pages
            leaf_pages, shared_pages = self._pages(leaves), self._pages(shared)
            if shared_seg:
                shared_seg[0] = 0  # (out: a demotion meanwhile passes it by as taken out)
                self._len -= shared_pages
                self.num_shared -= shared_pages
            if leaf_seg:
                leaf_seg[0] = 0
                self._len -= leaf_pages
                self._to_young_end(leaf_seg, len(leaves))
                self._pending = leaf_pages
                self._queued(leaf_pages, False)
            if shared_seg:
                self._to_young_end(shared_seg, len(shared))
                self._pending = shared_pages
                self._queued(shared_pages, True)
            return
        self.remove_many(leaves + shared)
        if leaves:
            self.add_many(leaves, priority)
        if shared:
            self.add_many(shared, priority, True)

    def requeue_runs(self, runs: Sequence[tuple[list[int], int, bool]]) -> bool:
        """Where each run ``(blocks, priority, shared)`` (non-empty; no block in two) is exactly the live entries of one
        segment of its bucket: every run's blocks out, then each run queued again in order as :meth:`add_many` of it
        would (each segment moved whole to its bucket's young end, as :meth:`requeue` moves one), and True; else
        False, the queue untouched.

        Exact: the moved segment's blocks keep their tag (their bucket is the run's, so their priority and sharedness
        are the run's), every block is out (no live entry) before the first is queued again, so a stale demotion in
        a queue call between passes them by as :meth:`remove_many` would have left them, and each run is queued at the
        clock then, its pages counted by :meth:`_queued` as :meth:`add_many`'s. Why: a refused turn's copy on the tied
        arena queued its history and the copy's source again entry by entry every step it was refused
        (``PrefixLookup._refuse_copy_tied``; BENCHMARKS.md "perf66b")."""
        segs = []
        for blocks, priority, shared in runs:
            seg = self._whole_segment(blocks, _key_of(priority, shared))
            if not seg:
                return False
            segs.append(seg)
        pages = list(map(self._pages, map(itemgetter(0), runs)))
        for seg, n, (_, _, shared) in zip(segs, pages, runs, strict=True):
            seg[0] = 0  # (out: a demotion meanwhile passes it by as taken out)
            self._len -= n
            if shared:
                self.num_shared -= n
        for seg, n, (blocks, _, shared) in zip(segs, pages, runs, strict=True):
            self._to_young_end(seg, len(blocks))
            self._pending = n
            self._queued(n, shared)
        return True

    def refresh(self, blocks: Iterable[int], rows: Sequence[int] | None = None) -> None:
        """:meth:`EvictionQueue.refresh`, the clock moved by each refreshed entry's pages; each entry is a row already,
        so ``rows`` (the page queue's row lengths) is not needed: None, or a run of one per entry."""
        if rows is not None and any(n != 1 for n in rows):
            raise ValueError("a row queue's entries are rows: each refreshed run is one entry")
        tags, weight = self._tag, self._weight
        for b in blocks:
            if b >= 0 and tags[b] >= 0:
                super().refresh((b,))
                self._clock += weight[b] - 1

    def pop_many(self, n: int) -> list[int]:
        """Not for a row queue: entries are popped by pages (:meth:`pop_pages`)."""
        raise TypeError("RowQueue pops by pages: pop_pages")

    def peek_pages(self, n: int, skip: set[int]) -> list[int]:
        """The entries :meth:`pop_pages` of ``n`` pages would pop were ``skip`` (queued or not) taken out first, in
        eviction order, without popping them: fewer where they weigh less than ``n``. Why: a probe of a hit whose copy
        evicts counts the shared pages the eviction takes (``KVCacheManagerV2.probe_hit``) before anything changes;
        taking out queues nothing, so no stale demotion can fall between the look and the pop."""
        out: list[int] = []
        got, tags, weight, by_key = 0, self._tag, self._weight, self._by_key
        for key in sorted(by_key):  # the heap's order: the least key present first
            for live, tag, blocks, at, _ in by_key[key]:
                if not live:
                    continue
                for b in itertools.islice(blocks, at, None):
                    if tags[b] == tag and b not in skip:
                        out.append(b)
                        got += weight[b]
                        if got >= n:
                            return out
        return out

    def stale_pages(self, queued: int, skip: set[int]) -> int:
        """The shared pages a queue call of ``queued`` pages would demote (:meth:`_demote_stale`) were ``skip`` taken
        out first: those of the shared segments the clock then leaves behind. Why: a probed copy's build queues its
        source again before admission's estimates, and that queueing may demote (``KVCacheManagerV2.probe_hit``)."""
        limit, tags, weight = self._clock + queued - self._stale, self._tag, self._weight
        n = 0
        for key, bucket in self._by_key.items():
            if key >> _SHARED_BIT:
                for live, tag, blocks, at, clock in bucket:  # oldest first: a shared bucket's clocks never fall
                    if clock >= limit:  # no segment from here on is stale
                        break
                    if live:  # (a dead one may have handed its tag on to a moved one: its entries are that one's)
                        n += sum(weight[b] for b in itertools.islice(blocks, at, None)
                                 if tags[b] == tag and b not in skip)
        return n

    def pop_pages(self, n: int) -> list[int]:
        """Whole entries in eviction order until they weigh at least ``n`` pages: the rows the page queue's pop of
        ``n`` pages touches, whose every page then leaves (``SharedPool._row_rest``); ``IndexError`` if fewer are
        queued."""
        if n > self._len:
            raise IndexError("no evictable block" if not self._len else f"{n} pages asked, {self._len} evictable")
        out: list[int] = []
        got = 0
        weight, pop_many, heaviest = self._weight, super().pop_many, self._heaviest
        while got < n:
            # the entries that go whatever they weigh: the first m - 1 of them weigh less than the pages still asked,
            # so popped at once they are the next m popped one at a time. Why: a prompt's take evicts tens of entries
            # (tiny-gemma3 mixed at a quarter of the budget: up to 130), a pop call each
            m = 1 if heaviest is None else -(-(n - got) // heaviest)
            before = self.num_shared
            if m == 1:  # one entry (most pops: a decode's boundary), without the batch's passes
                (b,) = pop_many(1)
                w = weight[b]
                out.append(b)
                got += w
                self._len -= w - 1
                if self.num_shared != before:
                    self.num_shared -= w - 1
                continue
            batch = pop_many(m)  # (counted one page off the length an entry, and off num_shared a shared one)
            pages = sum(map(weight.__getitem__, batch))
            self._len -= pages - m
            shared = before - self.num_shared
            if shared:  # the last ``shared`` popped: a pop takes every leaf bucket's entries before a shared one's
                self.num_shared -= (pages if shared == m else sum(map(weight.__getitem__, batch[m - shared:]))) - shared
            out += batch
            got += pages
        return out


def _no_detach(name: str, blocks: list[int]) -> None:
    raise AssertionError("take_each detaches through detach_mixed here")


class TiedArena:
    """Logical blocks of tied groups (the core of a tie, the manager's arena where a shared arena has cuts):
    logical group ``g``'s block ``L`` owns ``k[g]`` pages of one page arena,
    ``pages[L]`` (one a cut, in cut order); reference counts, radix owners, priorities and the eviction queue
    (:class:`RowQueue`) are per logical block, free space is in pages.

    Invariants: a used or cached logical block owns exactly ``k`` distinct pages and no other block owns them; a free
    logical id owns none (``pages[L] == ()``); ``len(free pages) + Σ k over used and cached blocks == num_pages``;
    ``ref[L] >= 1`` for a used block, ``ref[L] == 0`` and queued for a cached one. What a take of ``n`` blocks of
    several groups evicts equals what ``SharedPool.take_each`` of their cuts evicts when each queued row's pages lie
    together in its queue (``KVCacheManagerV2._check_rows``): whole rows, in the same order, until the pages are there.
    """

    def __init__(self, names: Sequence[str], k: Sequence[int], num_pages: int) -> None:
        if len(k) != len(names) or min(k, default=1) < 1:
            raise ValueError(f"pages per block {list(k)} for groups {list(names)}")
        self.names, self.k, self.num_pages = list(names), list(k), num_pages
        n = num_pages  # (a logical block owns a page at least: never more ids than pages)
        self.pages: list[tuple[int, ...]] = [()] * n
        self.ref = [0] * n
        self.gen = [0] * n
        self.node: list[object | None] = [None] * n
        self.pos = [0] * n
        self.priority = [0] * n
        self.group_of = [-1] * n
        self.weight = [0] * n  # pages of a used or cached block (what the queue weighs it)
        self._free = list(range(num_pages - 1, -1, -1))  # stacks: pop() hands out low ids first
        self._free_ids = list(range(n - 1, -1, -1))
        self.evictable = RowQueue(self.priority, self.weight, num_pages, max(self.k, default=1))
        self.used = [0] * len(self.names)
        self.cached = [0] * len(self.names)
        self.evicted = [0] * len(self.names)
        self.shares = [TiedShare(self, i) for i in range(len(self.names))]
        # SharedPool's families of cuts (read by KVCacheManagerV2._row_runs, _check_rows): none here, a logical block
        # is a whole row already
        self._members: list[tuple[int, ...]] | None = None
        self._first: list[int] = []

    @property
    def available(self) -> int:
        """Pages any group can get: free plus those of evictable blocks."""
        return len(self._free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        """Pages in use by any group (the manager's pool-set checks compare pages: ``resume_refusal``'s limit)."""
        return sum(map(int.__mul__, self.used, self.k))

    @property
    def num_blocks(self) -> int:
        """The arena's pages: what a pool set's ``num_blocks`` means to the manager (``held_back``, ``resume_refusal``,
        ``_never_fits``), each of its groups' blocks weighed by its pages (``KVCacheManagerV2._pages_per_block``)."""
        return self.num_pages

    def _let_go(self, blocks: Iterable[int]) -> None:
        """``blocks`` (used or cached no more) give their pages and ids back."""
        pages, free_pages, free_ids, group_of, weight = (self.pages, self._free, self._free_ids, self.group_of,
                                                          self.weight)
        for b in blocks:
            free_pages += pages[b]
            pages[b] = ()
            group_of[b] = -1
            weight[b] = 0
            free_ids.append(b)

    def _make_room(self, need: int, detach: Callable[[str, list[int]], None],
                   detach_mixed: Callable[[list[int], list[int]], None] | None) -> None:
        """``need`` pages free for a take: the pages of whole cached blocks in eviction order where the free ones fall
        short (:meth:`RowQueue.pop_pages`), detached per group, or given ``detach_mixed``, in one call with their groups
        (``IndexError`` where not even those are enough)."""
        free = len(self._free)
        if need <= free:
            return
        if need > free + len(self.evictable):
            raise IndexError(f"tied arena: {need} pages asked, {self.available} free or evictable")
        evicted = self.evictable.pop_pages(need - free)
        groups = list(map(self.group_of.__getitem__, evicted))  # (C passes: a take at a block boundary evicts)
        cached, counted = self.cached, self.evicted
        if detach_mixed is not None:
            for g in dict.fromkeys(groups):
                n = groups.count(g)
                cached[g] -= n
                counted[g] += n
            detach_mixed(evicted, groups)
        else:
            by_group: dict[int, list[int]] = {}
            for b, g in zip(evicted, groups, strict=True):
                by_group.setdefault(g, []).append(b)
            for g, blocks in by_group.items():
                cached[g] -= len(blocks)
                counted[g] += len(blocks)
                detach(self.names[g], blocks)
        self._let_go(evicted)

    def take_each(self, groups: Sequence[int], counts: Sequence[int],
                  detach: Callable[[str, list[int]], None],
                  detach_mixed: Callable[[list[int], list[int]], None] | None = None) -> list[list[int]]:
        """``counts[i]`` blocks for ``groups[i]`` each (``ref == 1``), each with its group's pages: free pages first,
        then the pages of whole cached blocks in eviction order (:meth:`RowQueue.pop_pages`), detached per group, or
        given ``detach_mixed``, all in one call with their groups (``SharedPool.take_each``'s signature)."""
        if len(groups) != len(counts):
            raise ValueError(f"{len(counts)} counts for {len(groups)} groups")
        self._make_room(sum(map(mul, map(self.k.__getitem__, groups), counts)), detach, detach_mixed)
        out: list[list[int]] = []
        free_pages, free_ids = self._free, self._free_ids
        pages, weight, gen, ref, group_of = self.pages, self.weight, self.gen, self.ref, self.group_of
        for g, c in zip(groups, counts, strict=True):
            if not c:
                out.append([])
                continue
            k = self.k[g]
            # the c blocks' ids and pages cut off the free lists' ends in one slice each, as c pops would take them
            # (last first; a block's k pages last first): a prompt's take is hundreds of blocks
            piece = free_ids[-c:]
            del free_ids[-c:]
            piece.reverse()
            n = c * k
            got = free_pages[-n:]
            del free_pages[-n:]
            got.reverse()
            for b, t in zip(piece, zip(*[iter(got)] * k, strict=True), strict=True):  # (k pages a block, tuples in C)
                pages[b] = t
                weight[b] = k
                gen[b] += 1
                ref[b] = 1
                group_of[b] = g
            self.used[g] += c
            out.append(piece)
        return out

    def release_tables(self, tables: Sequence[tuple[int, list[int]]], priority: int,
                       starts: Sequence[int] | None = None) -> None:
        """Let go of every block of every ``(group, table)``, the tables' blocks tail first and position by position
        (ids below 0 skipped); cached blocks (a radix owner) are queued, leaves before shared prefixes' blocks, the
        others freed: ``SharedPool.release_tables`` per logical block (``starts``, its hint that a table holds only
        ids below 0 before it, changes nothing here: those are skipped)."""
        by_table: list[tuple[list[int], list[int]]] = []  # each table's cached (leaves, shared), tail first
        gone: list[int] = []
        ref, group_of, owner, used, cached = self.ref, self.group_of, self.node, self.used, self.cached
        for _, table in tables:  # table by table, then the cached ones interleaved: SharedPool.release_tables' loop
            leaves: list[int] = []
            shared: list[int] = []
            for b in reversed(table):  # (this loop runs for every block of every finish: locals, one ref read)
                if b < 0:
                    continue
                n = ref[b]
                if n <= 0:
                    raise RuntimeError(f"tied arena: block {b} released more often than held")
                ref[b] = n = n - 1
                if n:
                    continue
                g = group_of[b]
                used[g] -= 1
                node = owner[b]
                if node is None:
                    gone.append(b)
                else:
                    cached[g] += 1
                    (shared if getattr(node, "children", None) else leaves).append(b)
            by_table.append((leaves, shared))
        self._let_go(gone)
        leaves = interleave([lv for lv, _ in by_table])
        shared = interleave([sh for _, sh in by_table])
        if leaves:
            self.evictable.add_many(leaves, priority)
        if shared:
            self.evictable.add_many(shared, priority, True)

    def incref_many(self, group: int, blocks: Sequence[int]) -> None:
        """One more holder of each of ``blocks`` (used or cached blocks of ``group``): a prefix hit's claim."""
        cached = []
        ref, group_of = self.ref, self.group_of  # (locals: this loop runs for every block a hit claims)
        for b in blocks:
            if group_of[b] != group:
                raise RuntimeError(f"group {self.names[group]}: block {b} is not one of its used or cached blocks")
            n = ref[b]
            if not n:
                cached.append(b)
            ref[b] = n + 1
        self.evictable.remove_weighing(cached, self.k[group])  # (every block of a group weighs its k pages)
        self.cached[group] -= len(cached)
        self.used[group] += len(cached)

    def check(self) -> list[str]:
        """The tie's invariants (see the class): what is broken, or nothing."""
        problems: list[str] = []
        owner: dict[int, int] = {}
        queued = set(self.evictable.blocks())
        for b in range(len(self.pages)):
            got, g = self.pages[b], self.group_of[b]
            if g < 0:
                if got:
                    problems.append(f"tied arena: free block {b} owns pages {list(got)}")
                continue
            if len(got) != self.k[g] or len(set(got)) != len(got) or self.weight[b] != len(got):
                problems.append(f"tied arena: block {b} of {self.names[g]} owns pages {list(got)}, not {self.k[g]} "
                                f"distinct ones (weighs {self.weight[b]})")
            if (self.ref[b] > 0) == (b in queued):
                problems.append(f"tied arena: block {b} has ref {self.ref[b]} and is{'' if b in queued else ' not'} "
                                "queued")
            for p in got:
                if p in owner:
                    problems.append(f"tied arena: page {p} is owned by blocks {owner[p]} and {b}")
                owner[p] = b
        free = set(self._free)
        if len(free) != len(self._free) or free & owner.keys() or len(free) + len(owner) != self.num_pages:
            problems.append(f"tied arena: {len(self._free)} free pages and {len(owner)} owned of "
                            f"{self.num_pages}, {len(free & owner.keys())} both")
        return problems

    def release_slices(self, members: Sequence[tuple[int, list[int]]], lo: int, hi: int, priority: int) -> None:
        """Let go of ``table[lo:hi]`` of every ``(group, table)`` and mark them -1, position by position (a window
        slide): ``SharedPool.release_slices`` per logical block (cached ones queued, leaves before shared)."""
        ref, group_of, owner = self.ref, self.group_of, self.node
        leaves: list[int] = []
        shared: list[int] = []
        gone: list[int] = []
        for j in range(lo, hi):
            for _, table in members:
                b = table[j]
                if b < 0:
                    continue
                if ref[b] <= 0:
                    raise RuntimeError(f"tied arena: block {b} released more often than held")
                table[j] = -1
                ref[b] -= 1
                if ref[b]:
                    continue
                g = group_of[b]
                self.used[g] -= 1
                node = owner[b]
                if node is None:
                    gone.append(b)
                else:
                    self.cached[g] += 1
                    (shared if getattr(node, "children", None) else leaves).append(b)
        self._let_go(gone)
        if leaves:
            self.evictable.add_many(leaves, priority)
        if shared:
            self.evictable.add_many(shared, priority, True)

    def take_one_each(self, groups: Sequence[int],
                      detach_mixed: Callable[[list[int], list[int]], None]) -> list[int]:
        """A block for each of ``groups`` (a decode's block boundary): :meth:`take_each` with every count 1, the
        evicted blocks detached in one call with their groups (``SharedPool.take_one_each``)."""
        # detached inside the take, before the evicted blocks' pages and ids are handed out again: a write-back
        # (``KVCacheManagerV2._detach``) reads an evicted block's pages, which afterwards belong to another block
        k = self.k
        self._make_room(sum(map(k.__getitem__, groups)), _no_detach, detach_mixed)
        # take_each's loop with every count 1, without its lists per group (every decode's block boundary)
        out: list[int] = []
        free_pages, free_ids, used = self._free, self._free_ids, self.used
        pages, weight, gen, ref, group_of = self.pages, self.weight, self.gen, self.ref, self.group_of
        for g in groups:
            n = k[g]
            b = free_ids.pop()
            pages[b] = tuple(free_pages[len(free_pages) - n:][::-1])
            del free_pages[len(free_pages) - n:]
            weight[b] = n
            gen[b] += 1
            ref[b] = 1
            group_of[b] = g
            used[g] += 1
            out.append(b)
        return out

    def incref_groups(self, groups: Sequence[int], pieces: Sequence[Sequence[int]]) -> None:
        """:meth:`incref_many` of ``pieces[i]`` for ``groups[i]``, for each ``i`` in order (a hit's claim of every
        logical group's blocks)."""
        for g, piece in zip(groups, pieces, strict=True):
            self.incref_many(g, piece)

    def release(self, group: int, blocks: Iterable[int], priority: int, keep_cached: bool,
                detach: Callable[[str, list[int]], None]) -> None:
        """``group`` lets go of ``blocks`` (ids below 0 skipped): a block nobody holds any more is queued where cached
        and ``keep_cached``, else freed (detached first where cached): ``SharedPool.release`` per logical block."""
        cached: list[int] = []
        shared: list[int] = []
        dropped: list[int] = []
        gone: list[int] = []
        try:
            for b in blocks:
                if b < 0:
                    continue
                if self.ref[b] <= 0 or self.group_of[b] != group:
                    raise RuntimeError(f"group {self.names[group]}: block {b} released more often than held")
                self.ref[b] -= 1
                if self.ref[b]:
                    continue
                self.used[group] -= 1
                node = self.node[b]
                if node is None:
                    gone.append(b)
                elif keep_cached:
                    (shared if getattr(node, "children", None) else cached).append(b)
                else:
                    dropped.append(b)
        finally:  # what was released before an error is queued or freed, as SharedPool.release leaves it
            if dropped:
                detach(self.names[group], dropped)
            self._let_go(gone + dropped)
            self.cached[group] += len(cached) + len(shared)
            if cached:
                self.evictable.add_many(cached, priority)
            if shared:
                self.evictable.add_many(shared, priority, True)

    def reset(self) -> None:
        """Every cached block freed (the manager empties the radix tree); none may be in use."""
        if sum(self.used):
            raise RuntimeError(f"tied arena: {sum(self.used)} blocks are in use; the cache cannot be reset")
        queued = self.evictable.blocks()
        self._let_go(queued)
        for b in queued:
            self.node[b] = None
        self.evictable = RowQueue(self.priority, self.weight, self.num_pages, max(self.k, default=1))
        self.cached[:] = [0] * len(self.names)

    def cut_tables(self, group: int, table: Sequence[int]) -> list[list[int]]:
        """``group``'s logical block table as its ``k`` cuts' page tables (``-1`` kept where a block was released):
        what attention reads, one table per cut in cut order.

        Why here: pages appear only where memory is touched; the manager keeps logical tables and hands these to the
        executor (it should cache them per request and rebuild them only when the logical table changed, as the
        executor compares the lists every step)."""
        k, pages = self.k[group], self.pages
        if k == 1:
            return [[pages[b][0] if b >= 0 else -1 for b in table]]
        gone = (-1,) * k
        return [list(col) for col in zip(*[pages[b] if b >= 0 else gone for b in table], strict=True)] if table \
            else [[] for _ in range(k)]

    def _queue(self, leaves: list[int], shared: list[int], priority: int) -> None:
        """Queue released cached blocks, leaves then shared prefixes' (``SharedPool._queue``)."""
        if leaves:
            self.evictable.add_many(leaves, priority)
        if shared:
            self.evictable.add_many(shared, priority, True)

    def incref(self, group: int, b: int) -> None:
        """One more holder of ``b`` (a used or cached block of ``group``): ``SharedPool.incref`` per logical block."""
        self.incref_many(group, (b,))

    def incref_each(self, groups: Sequence[int], blocks: Sequence[int]) -> None:
        """One more holder of ``blocks[i]`` of ``groups[i]``, for each ``i`` in order (a partial hit holds its source
        run's block of every logical group while it copies them): ``SharedPool.incref_each`` per logical block."""
        ref, group_of = self.ref, self.group_of
        queued: list[int] = []
        for g, b in zip(groups, blocks, strict=True):
            if group_of[b] != g:
                raise RuntimeError(f"group {self.names[g]}: block {b} is not one of its used or cached blocks")
            if not ref[b]:
                queued.append(b)
                self.cached[g] -= 1
                self.used[g] += 1
            ref[b] += 1
        if queued:
            self.evictable.remove_many(queued)

    def decref_each(self, groups: Sequence[int], blocks: Sequence[int], priorities: Sequence[int]) -> None:
        """What :meth:`incref_each` held goes back (ids below 0 skipped): a block nobody holds any more is queued at
        ``priorities[i]`` where cached (shared where its run has children), else freed: ``SharedPool.decref_each``,
        whose row of a cut family (one call, one segment) is one logical block here.

        Queued one entry a call, in order, as the page arena queues row by row; all in one call where it does so too
        (only leaves of one priority while no shared block is queued: no stale demotion can fall between them)."""
        ref, group_of, owner = self.ref, self.group_of, self.node
        queued: list[tuple[int, int, bool]] = []
        gone: list[int] = []
        for g, b, p in zip(groups, blocks, priorities, strict=True):
            if b < 0:
                continue
            if ref[b] <= 0 or group_of[b] != g:
                raise RuntimeError(f"group {self.names[g]}: block {b} released more often than held")
            ref[b] -= 1
            if ref[b]:
                continue
            self.used[g] -= 1
            node = owner[b]
            if node is None:
                gone.append(b)
            else:
                self.cached[g] += 1
                queued.append((b, p, bool(getattr(node, "children", None))))
        self._let_go(gone)
        if not queued:
            return
        queue = self.evictable
        p = queued[0][1]
        if not queue.num_shared and all(not s and q == p for _, q, s in queued):
            queue.add_many([b for b, _, _ in queued], p)
            return
        for b, q, s in queued:
            queue.add_many([b], q, s)

    def drop_each(self, groups: Sequence[int], blocks: Sequence[int],
                  detach_mixed: Callable[[list[int], list[int]], None]) -> None:
        """For each ``i`` in order, ``blocks[i]`` of ``groups[i]`` (ids below 0 skipped) goes free with its pages if
        nobody holds it (out of the queue, detached from its run: a finished turn's stale partial tail):
        ``SharedPool.drop_each`` per logical block."""
        ref, group_of, owner = self.ref, self.group_of, self.node
        queued: list[int] = []
        gone: list[int] = []
        gone_groups: list[int] = []
        for g, b in zip(groups, blocks, strict=True):
            if b < 0:
                continue
            if group_of[b] != g:
                raise RuntimeError(f"group {self.names[g]}: block {b} is not one of its used or cached blocks")
            if ref[b]:
                continue  # held by a table: it stays
            queued.append(b)
            self.cached[g] -= 1
            if owner[b] is not None:
                gone.append(b)
                gone_groups.append(g)
        if queued:
            self.evictable.remove_many(queued)
        if gone:
            detach_mixed(gone, gone_groups)
        self._let_go(queued)


class TiedShare:
    """One logical group's view of a :class:`TiedArena`, with ``GroupShare``'s interface counted in logical blocks:
    ``available`` is the arena's free and evictable pages // ``k`` (the blocks this group alone could get now).

    Deliberately without ``GroupShare._free``: the manager's inlined checks ``len(pool._free) + len(pool.evictable)``
    count blocks of one page, which a tie's pages are not (``KVCacheManagerV2._reserve_split``, ``_finish_parked``);
    each must weigh a logical block by its ``k`` pages, so one that reads ``_free`` through a logical group's view
    fails (AttributeError) rather than count pages as blocks."""

    def __init__(self, arena: TiedArena, index: int) -> None:
        self.arena = arena
        self.index = index
        self.name = arena.names[index]
        self.k = arena.k[index]
        self.num_blocks = arena.num_pages // self.k  # what the group could hold alone
        self.ref, self.gen, self.node, self.pos, self.priority = (arena.ref, arena.gen, arena.node, arena.pos,
                                                                   arena.priority)

    @property
    def evictable(self) -> RowQueue:
        """The arena's eviction queue (every logical group's cached blocks; its length in pages)."""
        return self.arena.evictable

    @property
    def num_free(self) -> int:
        """Blocks of this group the arena's free pages would make."""
        return len(self.arena._free) // self.k

    @property
    def num_evictable(self) -> int:
        """This group's cached blocks nobody owns."""
        return self.arena.cached[self.index]

    @property
    def available(self) -> int:
        """Blocks this group could get now: the arena's free plus evictable pages // ``k``."""
        return self.arena.available // self.k

    @property
    def num_used(self) -> int:
        """This group's blocks in use."""
        return self.arena.used[self.index]

    @property
    def evictions(self) -> int:
        """This group's cached blocks evicted (for any group's allocation)."""
        return self.arena.evicted[self.index]

    def holds(self, b: int) -> bool:
        """Whether ``b`` is one of this group's used or cached blocks."""
        return self.arena.group_of[b] == self.index

    def allocate(self, detach: Callable[[str, list[int]], None]) -> int:
        """One block (``k`` pages) for this group (see :meth:`TiedArena.take_each`)."""
        return self.arena.take_each((self.index,), (1,), detach)[0][0]

    def allocate_many(self, n: int, detach: Callable[[str, list[int]], None]) -> list[int]:
        """``n`` blocks for this group (see :meth:`TiedArena.take_each`)."""
        return self.arena.take_each((self.index,), (n,), detach)[0]

    def incref(self, b: int) -> None:
        """One more holder of ``b``."""
        self.arena.incref(self.index, b)

    def incref_many(self, blocks: Sequence[int]) -> None:
        """:meth:`incref` for each of ``blocks`` (:meth:`TiedArena.incref_many`)."""
        self.arena.incref_many(self.index, blocks)

    def decref(self, b: int, priority: int, keep_cached: bool, detach: Callable[[str, list[int]], None]) -> None:
        """One holder lets go of ``b`` (as ``GroupPool.decref``)."""
        self.arena.release(self.index, (b,), priority, keep_cached, detach)

    def release(self, blocks: Iterable[int], priority: int, keep_cached: bool,
                detach: Callable[[str, list[int]], None]) -> None:
        """Let go of ``blocks`` (as ``GroupPool.release``)."""
        self.arena.release(self.index, blocks, priority, keep_cached, detach)

    def reset(self) -> None:
        """Reset the whole arena (every group's view shares it)."""
        self.arena.reset()

    def free_ids(self) -> list[int]:
        """The arena's free logical ids (each owning no page)."""
        return list(self.arena._free_ids)


class CutTables:
    """One logical block table's cut page tables (what attention reads, one list per cut), kept in step with it
    (for ``KVCacheManagerV2.block_tables`` with the cuts tied): :meth:`read` changes only the positions whose
    logical block changed since the last read (a block is the same while its id and ``gen`` are), appends what the
    logical table gained and cuts what it lost, so the lists stay the same objects from read to read.

    Why: the executor compares every table it holds with the manager's every step (most steps change none), so an
    expansion rebuilt at each read would cost the tie what it saves; the check here is one C-speed comparison of ids
    and generations per logical group (2 on Gemma 3 27B) instead of the executor's per-cut lists."""

    __slots__ = ("_gens", "_ids", "arena", "group", "tables")

    def __init__(self, arena: TiedArena, group: int) -> None:
        self.arena, self.group = arena, group
        self._ids: list[int] = []
        self._gens: list[int] = []
        self.tables: list[list[int]] = [[] for _ in range(arena.k[group])]

    def read(self, table: list[int]) -> list[list[int]]:
        """The cut tables of ``table`` (this group's logical table), updated in place where it changed."""
        # at C speed; a -1 reads the last id's gen: a spurious change there only rewrites -1 as -1
        gens = list(map(self.arena.gen.__getitem__, table))
        ids, old_gens = self._ids, self._gens
        if ids == table and old_gens == gens:
            return self.tables
        pages, tables = self.arena.pages, self.tables
        k = len(tables)
        m = min(len(ids), len(table))
        for j in range(m):  # the positions whose block changed (a slide's -1, a restore's new block)
            if ids[j] != table[j] or old_gens[j] != gens[j]:
                b = table[j]
                row = pages[b] if b >= 0 else (-1,) * k
                for i in range(k):
                    tables[i][j] = row[i]
        if len(table) < len(ids):
            for t in tables:
                del t[len(table):]
        elif len(table) > m:
            for t, more in zip(tables, self.arena.cut_tables(self.group, table[m:]), strict=True):
                t += more
        self._ids, self._gens = list(table), gens
        return tables
