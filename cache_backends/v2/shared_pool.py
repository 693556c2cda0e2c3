"""One free list and one eviction queue for every layer group of a shared arena (V2, equal pages).

Why: with a pool per group, the budget is split between the groups once, for sequences of
``max_seq_len`` tokens. Many short requests on a sliding-window model then fill the window pool while
the full-attention pool stays mostly empty (and the out-of-window blocks a prefix hit needs are
evicted at once). vLLM's hybrid allocator instead cuts the groups into groups of equal pages
(:func:`cache_backends.layout.share_pages`), so any block can serve any group, and keeps one free
list for all of them; this module is that free list.

:class:`SharedPool` holds what :class:`~cache_backends.v2.group_pool.GroupPool` holds for one group —
reference counts, generations, radix owners, eviction priorities, the free list and the
:class:`~cache_backends.v2.group_pool.EvictionQueue` — once for the arena, with block ids global, plus
``group_of[b]``: the group a used or cached block belongs to, so an eviction unhooks the right group
of its radix node. Eviction order is global (lowest priority, then least recently released, whatever
the group): a cached full-attention block can be evicted to give a sliding group a page, and the
other way round. Each group sees the arena through a :class:`GroupShare`, which has GroupPool's
interface (the manager's per-group code is unchanged) and keeps the group's own used, cached and
evicted counts for stats. So per group ``used`` and ``evictable`` are its own, ``free`` and
``available`` are the arena's, and ``free + sum(used) + sum(evictable) == num_blocks``.

Feasibility is joint: what several groups need at once must fit the arena's ``available`` together
(``KVCacheManagerV2.shortfall``), not each group's need on its own.

Why the batch methods (:meth:`SharedPool.take_each`, :meth:`~SharedPool.release_slices`,
:meth:`~SharedPool.release_tables`, :meth:`~SharedPool.incref_many`): the sub-groups cut from one group share
its life cycle — they take a block, leave the window and are released at the same moments — so Gemma 3 27B's
31 groups would otherwise cost 31 calls where one group costs one. Each batch method hands out or takes back
exactly the blocks, in exactly the order, that the per-group calls would (``scripts/kv_diffcheck.py`` checks it
step by step); only the per-block work remains per group.

Rows (``families``, :func:`~cache_backends.layout.cut_families`): a prefix position's pages of one family's cuts are a
*row*; a hit needs the whole row. An eviction that takes some of a row's pages frees the row's other queued pages with
them (:meth:`SharedPool._row_rest`), so no partial row stays cached (``KVCacheManagerV2.check_invariants`` checks
it). This is the eviction rule of a tie of the cuts into one logical block (BENCHMARKS.md "tie57"). With families, a
take per group and one batch take may free different rows (the rest a group's take frees serves the next group's),
so the batch methods equal the per-group calls only without families (``tests/test_kv_v2_shared.py`` checks them so).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from itertools import chain, compress, repeat
from operator import attrgetter, itemgetter, sub
from typing import TYPE_CHECKING

from cache_backends.v2.group_pool import Detach, EvictionQueue

if TYPE_CHECKING:
    from cache_backends.v2.radix import RadixNode

#: ``detach_mixed(blocks, groups)``: :data:`~cache_backends.v2.group_pool.Detach` for evicted blocks of several groups
#: in one call, ``groups[k]`` the arena index of the group of ``blocks[k]`` (in eviction order); what one ``Detach``
#: call per group would do.
DetachMixed = Callable[[list[int], list[int]], None]

_first = itemgetter(0)
_second = itemgetter(1)
_children = attrgetter("children")  # a radix run's children (C speed over a set of runs: no generator per slide)


#: :func:`_groups_along`'s tuples by their groups and lengths; emptied once they hold ``_ALONG_LIMIT`` entries in all
_along: dict[tuple[int, ...], tuple[int, ...]] = {}
_along_size = [0]
_ALONG_LIMIT = 1 << 16


def _groups_along(groups: Sequence[int], lens: Sequence[int], interleaved: bool = False) -> tuple[int, ...]:
    """``groups[i]`` ``lens[i]`` times, for each ``i`` in order: what ``group_of`` must read along the batch methods'
    concatenated tables (a finish's, a hit's) when each block is its table's group's; ``interleaved``: along the
    tables interleaved (:func:`interleave`, a finish's queue order) instead.

    Why memoized: a finish and a hit build it for every block they check (~10-25 ns a block from the iterator, a
    tenth of Gemma 3 27B's multi-turn finish), yet a chat's turns repeat a few shapes; a
    lookup costs one key of twice the groups. Bounded in entries, not in shapes, so long tables cannot hoard memory."""
    key = (*groups, -2 if interleaved else -1, *lens)
    got = _along.get(key)
    if got is None:
        got = (tuple(interleave(list(map(list, map(repeat, groups, lens))))) if interleaved
               else tuple(chain.from_iterable(map(repeat, groups, lens))))
        if _along_size[0] + len(got) > _ALONG_LIMIT:
            _along.clear()
            _along_size[0] = 0
        if len(got) <= _ALONG_LIMIT // 4:
            _along[key] = got
            _along_size[0] += len(got)
    return got


def interleave(lists: list[list[int]]) -> list[int]:
    """The lists' blocks position by position (each list's first, then each one's second, ...).

    Why: the groups of an arena hold a prefix together, and a hit needs every group's blocks for it. Queued group by
    group, eviction took one group's blocks of a finished request before another's, and once part of a request's
    blocks were gone, the other groups' blocks of the same positions were useless yet still cached; position by
    position, tail first, what is left is always a whole, shorter prefix (Gemma 2 9B on ``mixed`` at a quarter of the
    budget: 18.4% of prompt tokens reused against 18.9%; interleaved, 18.9%)."""
    lists = list(filter(None, lists))
    if len(lists) < 2:
        return lists[0] if lists else []
    # by runs of positions that the same lists reach: each run is one slice assignment per list, at C speed (a
    # per-block loop here cost Gemma 3 27B's finishes a fifth more Python work: 31 groups x every block); the
    # lists that reach a run picked at C speed too (comprehensions over 31 lists were ~700 opcodes a finish)
    out: list[int] = []
    lo = 0
    lens = list(map(len, lists))
    for hi in sorted(set(lens)):  # positions lo .. hi are reached by the lists at least hi long (the first run: all)
        reach = list(compress(lists, map(hi.__le__, lens))) if lo else lists
        n = len(reach)
        run = [0] * ((hi - lo) * n)
        for i, lst in enumerate(reach):
            run[i::n] = lst[lo:hi]
        out += run
        lo = hi
    return out


def _interleave_tails(tables: list[list[int]], lens: list[int]) -> list[int]:
    """``interleave([table[len(table) - k:][::-1] for table, k in zip(tables, lens)])`` (each table's last ``k``
    blocks, tail first, position by position), each table read backwards straight into the result.

    Why: a finish's release queues Gemma 3 27B's 31 tables this way; reversing each tail into a list of its own, then
    slicing it again for the interleave, copied every block twice more (~15 ns a block: a tenth of the release)."""
    out: list[int] = []
    lo, short = 0, min(lens, default=0)
    for hi in sorted(set(lens)):  # as interleave's runs, counted from each table's end
        if not hi:
            continue
        reach = tables if hi <= short else list(compress(tables, map(hi.__le__, lens)))
        n = len(reach)
        run = [0] * ((hi - lo) * n)
        for i, table in enumerate(reach):
            end = len(table) - 1
            stop = end - hi
            run[i::n] = table[end - lo:stop if stop >= 0 else None:-1]
        out += run
        lo = hi
    return out


class SharedPool:
    """Free list, reference counts, radix owners and eviction queue of an arena shared by ``names``."""

    def __init__(self, names: Sequence[str], num_blocks: int, families: Sequence[int] | None = None) -> None:
        self.names = list(names)
        self.num_blocks = num_blocks
        #: ``families[g]``: the group ``g`` was cut from (:func:`~cache_backends.layout.cut_families`); the cuts of
        #: one family leave the cache a whole row at a time (:meth:`_row_rest`). None: every group its own family.
        self._members: list[tuple[int, ...]] | None = None
        self._first: list[int] = []
        if families is not None:
            if len(families) != len(self.names):
                raise ValueError(f"{len(families)} families for {len(self.names)} groups")
            of: dict[int, list[int]] = {}
            for g, f in enumerate(families):
                of.setdefault(f, []).append(g)
            if any(len(m) > 1 for m in of.values()):
                # per group: every cut of its family, itself included, in arena order (empty: a family of one)
                self._members = [tuple(of[f]) if len(of[f]) > 1 else () for f in families]
                #: per group: its family's first group, or -1 for a family of one
                self._first = [of[f][0] if len(of[f]) > 1 else -1 for f in families]
        self.ref = [0] * num_blocks
        self.gen = [0] * num_blocks
        self.node: list[RadixNode | None] = [None] * num_blocks
        self.pos = [0] * num_blocks  # an attached block's position in the prefix
        self.priority = [0] * num_blocks
        self.group_of = [-1] * num_blocks  # index of the group a used or cached block belongs to
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out low ids first
        self.evictable = EvictionQueue(self.priority)
        self.used = [0] * len(self.names)
        self.cached = [0] * len(self.names)
        self.evicted = [0] * len(self.names)
        self.shares = [GroupShare(self, i) for i in range(len(self.names))]

    @property
    def available(self) -> int:
        """Pages any group can get: free plus evictable."""
        return len(self._free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        """Pages in use by any group."""
        return sum(self.used)

    def take(self, group: int, n: int, detach: Detach) -> list[int]:
        """``n`` pages for ``group`` with ``ref == 1``: free ones first, then the globally next to evict."""
        return self.take_each((group,), (n,), detach)[0]

    def take_each(self, groups: Sequence[int], counts: Sequence[int], detach: Detach,
                  detach_mixed: DetachMixed | None = None) -> list[list[int]]:
        """``counts[i]`` pages for ``groups[i]`` each, exactly as :meth:`take` called group by group in this order
        would hand them out (the same blocks and evictions; the same blocks detached), in one pass.

        Why: the sub-groups :func:`~cache_backends.layout.share_pages` cut from one group share a life cycle, so
        they need blocks at the same moments; a block boundary of a Gemma 3 27B request takes 31 pages at once.
        Group by group, the free list hands out its blocks in order and, once it is empty, the eviction queue
        does; so the blocks are the free list's then one ``pop_many`` (the queue pops in the same order either
        way). The evicted blocks are detached in one call per group they belong to (a group's ``take`` detached per
        call: the radix runs end the same, ``RadixTree.detach`` being confluent; KV events come grouped so), or,
        given ``detach_mixed``, all of them in one call with their groups (a decode's block boundary on Gemma 3 27B
        evicts a block or two of each of up to 31 groups: a call per group cost more than the detaching itself).
        """
        free = self._free
        total = sum(counts)
        if total > len(free) + len(self.evictable):
            whom = f"group {self.names[groups[0]]}" if len(groups) == 1 else f"{len(groups)} groups"
            raise IndexError(f"shared arena: {total} blocks asked for {whom}, {self.available} free or evictable")
        k = min(total, len(free))
        out = free[len(free) - k:][::-1]
        del free[len(free) - k:]
        if total > k:
            group_of = self.group_of
            evicted = self.evictable.pop_many(total - k)
            rest = self._row_rest(evicted) if self._members is not None else None
            if rest:  # detached with the evicted blocks, then freed (below): not handed out by this take
                evicted += rest
            names, cached, evictions = self.names, self.cached, self.evicted
            if detach_mixed is not None:  # one call for every group's evicted blocks, in eviction order
                of = list(map(group_of.__getitem__, evicted))
                seen = set(of)
                if len(seen) * 8 <= len(of):  # a few groups' many blocks (a prefill's take): counted at C speed
                    for g in seen:
                        k = of.count(g)
                        cached[g] -= k
                        evictions[g] += k
                else:  # a block or two of each of many groups (a decode's boundary on Gemma 3 27B): a pass over them
                    for g in of:
                        cached[g] = cached[g] - 1
                        evictions[g] = evictions[g] + 1
                detach_mixed(evicted, of)
                if rest:
                    self._free_rest(evicted, len(rest))
                out += evicted
                return self._hand_out(out, groups, counts)
            # every evicted block's group, then one detach per group: a finish queues its groups' blocks position
            # by position, so evictions alternate groups, and a detach per group per take cost Gemma 3 27B's
            # no-reuse a fifth more Python work (detaching is confluent: the runs end the same whatever the order)
            by_group: dict[int, list[int]] = {}
            for b in evicted:  # this loop runs for every evicted block: kept lean
                g = group_of[b]
                got = by_group.get(g)
                if got is None:
                    by_group[g] = [b]
                else:
                    got.append(b)
            for g, blocks in by_group.items():
                cached[g] -= len(blocks)
                evictions[g] += len(blocks)
                detach(names[g], blocks)
            if rest:
                self._free_rest(evicted, len(rest))
            out += evicted
        return self._hand_out(out, groups, counts)

    def _row_rest(self, evicted: list[int]) -> list[int]:
        """The queued blocks of the rows ``evicted`` (just popped, not detached yet) leaves behind: for each evicted
        block of a cut group, the blocks its family's other cuts hold at the same radix position, where nobody holds
        them; in the order the rows were first evicted, each row's cuts in arena order.

        Why: the cuts :func:`~cache_backends.layout.share_pages` makes of one group hold a prefix position together
        and a hit needs every one of them (``KVCacheManagerV2._usable_prefix``), yet the queue hands out pages one at a
        time, so a take of ``n`` pages split rows: a third of the rows evictions touched on tiny-gemma3 (BENCHMARKS.md
        "tie57"), and the cuts left behind stayed cached, useless, while whole rows were evicted in their place. Taking
        the rest of each row with it frees them instead (tiny-gemma3 ``mixed`` at a quarter of the budget: 13.5% of
        prompt tokens reused against 19.8% with whole rows). A cut some request holds stays: it is not cached waste."""
        members, node, ref = self._members, self.node, self.ref
        assert members is not None
        # rows by (run, position, family's first group), counted at C speed: a decode's block boundary on Gemma 3 27B
        # evicts a row or two of 26 + 5 pages, so the Python loop runs per row, not per page
        of = list(map(self.group_of.__getitem__, evicted))
        rows = Counter(zip(map(node.__getitem__, evicted), map(self.pos.__getitem__, evicted),
                           map(self._first.__getitem__, of), strict=True))
        names, queued = self.names, self.evictable
        rest: list[int] = []
        for (run, p, first), n in rows.items():  # in the order the rows were first evicted
            if first < 0 or run is None:
                continue
            fam = members[first]
            if n == len(fam):
                continue
            i = p - run.start
            for s in fam:  # the evicted cuts' own blocks are out of the queue already: skipped as not queued
                blocks = run.blocks.get(names[s])
                if blocks is not None and i < len(blocks):
                    b = blocks[i]
                    if b >= 0 and not ref[b] and b in queued:
                        rest.append(b)
        if rest:
            queued.remove_many(rest)
        return rest

    def _free_rest(self, evicted: list[int], n: int) -> None:
        """Move the last ``n`` of ``evicted`` (a take's :meth:`_row_rest`, detached now) to the free list."""
        rest = evicted[len(evicted) - n:]
        del evicted[len(evicted) - n:]
        group_of = self.group_of
        for b in rest:
            group_of[b] = -1
        self._free += rest

    def take_one_each(self, groups: Sequence[int], detach_mixed: DetachMixed) -> list[int]:
        """A page for each of ``groups`` (``groups[i]`` gets the ``i``-th): exactly :meth:`take_each` with every count
        1, given ``detach_mixed``, without its lists per group.

        Why: a decode's block boundary takes one page per group at a time (every group's table grows by a block), so
        on a small layout (tiny-gemma3: 6 groups) the general method's per-group pieces and checks cost as much as
        the pages' own work."""
        free = self._free
        total = len(groups)
        if total > len(free) + len(self.evictable):
            whom = f"group {self.names[groups[0]]}" if total == 1 else f"{total} groups"
            raise IndexError(f"shared arena: {total} blocks asked for {whom}, {self.available} free or evictable")
        k = min(total, len(free))
        out = free[len(free) - k:][::-1]
        del free[len(free) - k:]
        group_of = self.group_of
        if total > k:
            evicted = self.evictable.pop_many(total - k)
            rest = self._row_rest(evicted) if self._members is not None else None
            if rest:  # detached with the evicted blocks, then freed: not handed out by this take
                evicted += rest
            of = list(map(group_of.__getitem__, evicted))
            cached, evictions = self.cached, self.evicted
            for g in of:
                cached[g] = cached[g] - 1
                evictions[g] = evictions[g] + 1
            detach_mixed(evicted, of)
            if rest:
                self._free_rest(evicted, len(rest))
            out += evicted
        gen, ref, used = self.gen, self.ref, self.used
        for b, g in zip(out, groups, strict=True):  # this loop runs for every block handed out: kept lean
            gen[b] = gen[b] + 1  # (not +=: two opcodes fewer, ~20% less CPU on Python 3.11)
            ref[b] = 1
            group_of[b] = g
            used[g] = used[g] + 1
        return out

    def _hand_out(self, out: list[int], groups: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
        """:meth:`take_each`'s end: the blocks ``out`` (free ones, then evicted ones) given to ``groups`` in order,
        ``counts[i]`` each, with ``ref == 1``."""
        gen, ref, group_of, used = self.gen, self.ref, self.group_of, self.used
        if counts and min(counts) == 1 == max(counts):  # a block boundary of a decode: a block for every group
            for b, g in zip(out, groups, strict=True):  # this loop runs for every block handed out: kept lean
                gen[b] = gen[b] + 1  # (not +=: two opcodes fewer)
                ref[b] = 1
                group_of[b] = g
                used[g] = used[g] + 1
            return [[b] for b in out]
        pieces: list[list[int]] = []
        pos = 0
        for g, c in zip(groups, counts, strict=True):
            if c <= 0:
                pieces.append([])
                continue
            piece = out[pos:pos + c]
            pos += c
            for b in piece:  # this loop runs for every block handed out: kept lean
                gen[b] = gen[b] + 1  # (not +=: two opcodes fewer)
                ref[b] = 1
                group_of[b] = g
            used[g] += c
            pieces.append(piece)
        return pieces

    def incref_many(self, group: int, blocks: Sequence[int]) -> None:
        """:meth:`incref` for each of ``blocks`` (a prefix hit's distinct blocks of ``group``), in one pass."""
        ref, group_of = self.ref, self.group_of
        n = len(blocks)
        get = itemgetter(*blocks) if n > 1 else None
        if get is not None and get(ref).count(0) == n and get(group_of).count(group) == n:
            # the usual hit: every block this group's, cached and held by nobody (checked at C speed)
            for b in blocks:
                ref[b] = 1
            cached: Sequence[int] = blocks
        else:
            was_cached: list[int] = []
            for b in blocks:  # this loop runs for every block a hit claims: kept lean
                if group_of[b] != group:
                    raise RuntimeError(f"group {self.names[group]}: block {b} is not one of its used or cached "
                                       "blocks")
                r = ref[b]
                if not r:
                    was_cached.append(b)
                ref[b] = r + 1
            cached = was_cached
        self._unqueue(cached, lambda b: group)  # one pass over the queue, not a call per block
        self.cached[group] -= len(cached)
        self.used[group] += len(cached)

    def _unqueue(self, blocks: list[int], group_of: Callable[[int], int]) -> None:
        """Take ``blocks`` out of the eviction queue in one pass; one not queued is a caller's error, named with its
        group (``group_of(block)``)."""
        try:
            self.evictable.remove_many(blocks)
        except KeyError as e:
            raise RuntimeError(f"group {self.names[group_of(e.args[0])]}: block {e.args[0]} is not one of its used or "
                               "cached blocks") from None

    def incref_groups(self, groups: Sequence[int], pieces: Sequence[Sequence[int]]) -> None:
        """:meth:`incref_many` of ``pieces[i]`` for ``groups[i]``, for each ``i`` in order: a prefix hit's claimed
        blocks of every group.

        The usual hit of a shared arena (every block its group's, cached and held by nobody: a finished turn's history)
        is checked and claimed in one pass over every group's blocks and one queue removal (the removals commute), not
        a call per group (31 on Gemma 3 27B); any other takes the calls."""
        ref = self.ref
        first = next((piece[0] for piece in pieces if piece), None)
        if first is not None and not ref[first]:  # (a shared prompt other requests hold shows at its first block)
            blocks = list(chain.from_iterable(pieces))
            n = len(blocks)
            get = itemgetter(*blocks) if n > 1 else None
            if get is not None and get(ref).count(0) == n and \
                    get(self.group_of) == _groups_along(groups, list(map(len, pieces))):
                try:  # references set and the queue left in one pass
                    self.evictable.claim_many(blocks, ref)
                except KeyError as e:
                    g = next(g for g, piece in zip(groups, pieces, strict=True) if e.args[0] in piece)
                    raise RuntimeError(f"group {self.names[g]}: block {e.args[0]} is not one of its used or cached "
                                       "blocks") from None
                cached, used = self.cached, self.used
                for g, piece in zip(groups, pieces, strict=True):
                    k = len(piece)
                    cached[g] -= k
                    used[g] += k
                return
        for g, piece in zip(groups, pieces, strict=True):
            self.incref_many(g, piece)

    def incref_each(self, groups: Sequence[int], blocks: Sequence[int]) -> None:
        """:meth:`incref` of ``blocks[i]`` for ``groups[i]``, for each ``i`` in order, in one pass.

        Why: a partial hit holds the block of every group its source run has at one position while it copies them;
        on Gemma 3 27B a call per group through its view cost 31 calls and 31 queue removals a hit."""
        ref, group_of, cached, used = self.ref, self.group_of, self.cached, self.used
        queued: list[int] = []
        for g, b in zip(groups, blocks, strict=True):  # a block a group (every group's differs: no repeats)
            if group_of[b] != g:
                raise RuntimeError(f"group {self.names[g]}: block {b} is not one of its used or cached blocks")
            r = ref[b]
            if not r:
                queued.append(b)
                cached[g] = cached[g] - 1
                used[g] = used[g] + 1
            ref[b] = r + 1
        if queued:  # one pass over the queue, not a call per block
            self._unqueue(queued, lambda b: groups[list(blocks).index(b)])

    def decref_each(self, groups: Sequence[int], blocks: Sequence[int], priorities: Sequence[int]) -> None:
        """:meth:`release` of ``blocks[i]`` by ``groups[i]`` with ``keep_cached`` at ``priorities[i]``, for each ``i``
        in order, in one pass (what :meth:`incref_each` held goes back: a cached block to the queue, an uncached one
        free).

        The blocks that go to the queue are queued in order, one by one as the calls would queue them, but a row's
        (a cut family's blocks of one run position, next to each other, of one priority and sharedness) in one call,
        as a tie of the cuts queues the row as one entry; in one ``add_many`` when that is the same: all leaves of one
        priority while no shared block is queued (then no stale shared block is demoted between them)."""
        ref, group_of, owner, free = self.ref, self.group_of, self.node, self._free
        cached, used = self.cached, self.used
        # (block, priority, shared, its family's first group or -1, its run, its position)
        queued: list[tuple[int, int, bool, int, int, int]] = []
        for g, b, p in zip(groups, blocks, priorities, strict=True):
            if b < 0:
                continue
            r = ref[b] - 1
            if r < 0 or group_of[b] != g:
                raise RuntimeError(f"group {self.names[g]}: block {b} released more often than held")
            ref[b] = r
            if r:
                continue
            used[g] = used[g] - 1
            node = owner[b]
            if node is None:
                free.append(b)
                group_of[b] = -1
            else:
                cached[g] = cached[g] + 1
                queued.append((b, p, bool(node.children), self._first[g] if self._first else -1, id(node), self.pos[b]))
        if not queued:
            return
        queue = self.evictable
        p = queued[0][1]
        if not queue.num_shared and all(not s and q == p for _, q, s, *_ in queued):
            queue.add_many([b for b, *_ in queued], p)
            return
        # one by one, but a row of a cut family (its cuts' blocks next to each other, of one priority and sharedness)
        # in one call: one segment at one clock, as a tie of the cuts queues the row as one entry (a stale demotion
        # then moves the row whole)
        row: list[int] = []
        key: tuple[int, bool, int, int, int] | None = None
        for b, *at in queued:
            if at[2] >= 0 and key == tuple(at):
                row.append(b)
                continue
            if row:
                queue.add_many(row, *key[:2])  # type: ignore[index]
            row, key = [b], tuple(at)  # type: ignore[assignment]
        queue.add_many(row, *key[:2])  # type: ignore[index]

    def drop_each(self, groups: Sequence[int], blocks: Sequence[int], detach_mixed: DetachMixed) -> None:
        """For each ``i`` in order, ``blocks[i]`` of ``groups[i]`` (ids below 0 skipped) goes free if nobody holds it
        (taken out of the eviction queue and unhooked from its run): what :meth:`incref` then :meth:`release` without
        ``keep_cached`` does, group by group, in one pass (a finished turn's stale partial tail, a block in every
        group)."""
        ref, group_of, owner, free, cached = self.ref, self.group_of, self.node, self._free, self.cached
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
            cached[g] -= 1  # (held for the drop then let go: its used count ends as it was)
            free.append(b)
            group_of[b] = -1
            if owner[b] is not None:
                gone.append(b)
                gone_groups.append(g)
        if queued:
            self._unqueue(queued, lambda b: groups[list(blocks).index(b)])
        if gone:
            detach_mixed(gone, gone_groups)

    def release_slices(self, members: Sequence[tuple[int, list[int]]], lo: int, hi: int, priority: int) -> None:
        """Let go of ``table[lo:hi]`` of every ``(group, table)`` (ids below 0 skipped) and mark them -1; blocks in
        the prefix cache stay cached. The same as :meth:`release` with ``keep_cached`` per block, in order, in one
        pass: the sliding sub-groups of one window leave it together.

        The usual slides are checked at C speed and done without the per-block branches (Gemma 3 27B's window sets
        slide 26 groups at every block boundary of every decode): every block there and its group's, and either
        all held by other tables too (a shared prompt's blocks that other requests' windows still see: nothing
        leaves), or all held by this table alone and then all cached in runs without children, or none cached."""
        ref, owner, free, group_of = self.ref, self.node, self._free, self.group_of
        k = hi - lo
        if k == 1 and len(members) > 1:  # (a prefill's slide of several blocks is rarer: it takes the loop)
            got = [table[lo] for _, table in members]
            get = itemgetter(*got)
            if -1 not in got and get(group_of) == tuple(map(_first, members)):
                refs = get(ref)
                ones = refs.count(1)
                if not ones and 0 not in refs:  # every block held by others too: nothing leaves
                    for _, table in members:
                        table[lo] = -1
                    for b in got:
                        ref[b] = ref[b] - 1
                    return
                if ones == len(got):
                    nodes = get(owner)
                    none = nodes.count(None)
                    if none == ones or (not none and not any(map(_children, {*nodes}))):
                        for _, table in members:
                            table[lo] = -1
                        used = self.used
                        if none:  # none cached: all go free, in order
                            for b in got:
                                ref[b] = 0
                                group_of[b] = -1
                            free += got
                            for g, _ in members:
                                used[g] -= k
                            return
                        for b in got:
                            ref[b] = 0
                        cached = self.cached
                        for g, _ in members:
                            used[g] -= k
                            cached[g] += k
                        self._queue(got, [], priority)
                        return
        leaves: list[int] = []  # cached blocks split as EvictionQueue.add_split would, in the same pass
        shared: list[int] = []
        used, kept = self.used, self.cached
        # position by position (each position's blocks of every group, then the next position's): the queue then
        # holds each row of a family's cuts (SharedPool._row_rest) together, as a finish's interleave does; group by
        # group, a slide of two positions queued (j, cut 0), (j + 1, cut 0), (j, cut 1), ..., so a take of two pages
        # split two rows and freed both (a tie of the cuts, one logical block a row, needs each row in one place)
        for j in range(lo, hi):
            for group, table in members:
                b = table[j]
                if b < 0:
                    continue
                if ref[b] <= 0 or group_of[b] != group:
                    raise RuntimeError(f"group {self.names[group]}: block {b} released more often than held")
                table[j] = -1
                ref[b] = ref[b] - 1
                if ref[b]:
                    continue
                used[group] -= 1
                node = owner[b]
                if node is None:
                    free.append(b)
                    group_of[b] = -1
                else:
                    kept[group] += 1
                    (shared if node.children else leaves).append(b)
        self._queue(leaves, shared, priority)

    def release_tables(self, tables: Sequence[tuple[int, list[int]]], priority: int,
                       starts: Sequence[int] | None = None) -> None:
        """Let go of every block of every ``(group, table)``, each table tail first (ids below 0 skipped); blocks in
        the prefix cache stay cached. :meth:`release` group by group with ``keep_cached``, in one pass.

        ``starts[i]``: table ``i`` holds only ids below 0 before it (a sliding window released them), so they are not
        looked at: at a long request's finish most of a sliding table is such a run (Gemma 3 27B: 26 of 31 tables).

        A keyed finish's usual table (checked at C speed: every block there, its group's and held by this table
        alone; every block cached in runs without children but perhaps the last, not full and not cached) is let go
        without the per-block loop: its last block goes free, the others are the table's leaves, whose references
        are cleared in the loop that queues them (``EvictionQueue.add_released``). So a block of Gemma 3 27B's
        31 groups costs one pass, not two (a release loop, then the queue's). Any other table takes the loop.

        When every table is such a table (a finished turn of a multi-turn chat), the checks run once over every
        table's blocks (:meth:`_release_lean`), not table by table."""
        if len(tables) > 1 and self._release_lean(tables, priority, starts):
            return
        ref, owner, free, group_of = self.ref, self.node, self._free, self.group_of
        used, kept = self.used, self.cached
        by_group: list[tuple[list[int], list[int]]] = []  # each group's cached (leaves, shared), tail first
        lean: list[list[int]] = []  # leaves of the tables let go without the loop: references cleared when queued
        try:
            for t, (group, table) in enumerate(tables):
                lo = starts[t] if starts is not None else 0
                tail = table[:lo - 1:-1] if lo else table[::-1]
                n = len(tail)
                if n > 2 and ref[tail[-1]] == 1 and min(tail) >= 0:  # the first block shows a prompt others hold
                    get = itemgetter(*tail)
                    if get(ref).count(1) == n and get(group_of).count(group) == n:
                        nodes = get(owner)
                        runs = {*nodes}  # (Nones counted only where there is one: see _release_lean)
                        none = nodes.count(None) if None in runs else 0
                        if ((not none or (none == 1 and nodes[0] is None))
                                and not any(map(_children, {*nodes[1:]} if none else runs))):
                            if none:  # the last block, not cached: free
                                b = tail[0]
                                ref[b] = 0
                                free.append(b)
                                group_of[b] = -1
                                del tail[0]
                            used[group] -= n
                            kept[group] += len(tail)
                            by_group.append((tail, []))
                            lean.append(tail)
                            continue
                n_free = len(free)
                leaves: list[int] = []  # cached blocks split as EvictionQueue.add_split would, in the same pass
                shared: list[int] = []
                for b in tail:  # this loop runs for every block of every group: kept lean
                    if b < 0:
                        continue
                    r = ref[b] - 1
                    if r < 0 or group_of[b] != group:
                        raise RuntimeError(f"group {self.names[group]}: block {b} released more often than held")
                    ref[b] = r
                    if r:
                        continue
                    node = owner[b]
                    if node is None:
                        free.append(b)
                        group_of[b] = -1
                    else:
                        (shared if node.children else leaves).append(b)
                n_cached = len(leaves) + len(shared)
                used[group] -= len(free) - n_free + n_cached
                kept[group] += n_cached
                by_group.append((leaves, shared))
        except RuntimeError:  # the tables before the bad one let go, as the loop alone leaves them
            for tail in lean:
                for b in tail:
                    ref[b] = 0
            raise
        leaves = interleave([lv for lv, _ in by_group])
        if lean and leaves:  # (a loop table's leaves are at 0 already)
            self._add_released(leaves, priority)
            self._queue([], interleave([sh for _, sh in by_group]), priority)
            return
        self._queue(leaves, interleave([sh for _, sh in by_group]), priority)

    def _release_lean(self, tables: Sequence[tuple[int, list[int]]], priority: int,
                      starts: Sequence[int] | None) -> bool:
        """:meth:`release_tables` of two or more tables when every one is a keyed finish's usual table, with its
        checks made once over every table's blocks; False, with nothing changed, when one is not.

        Why: a Gemma 3 27B multi-turn finish lets go of 31 tables of ~30 blocks each; table by table, the checks'
        dozen C calls and their set-up cost more than the blocks' own work in them (~120 ns a block in all)."""
        ref, owner, group_of = self.ref, self.node, self.group_of
        rows = list(map(_second, tables))
        if starts is None:
            lens = list(map(len, rows))
        elif len(starts) == len(rows):
            lens = list(map(sub, map(len, rows), starts))
        else:
            raise ValueError(f"{len(starts)} starts for {len(rows)} tables")
        if min(lens) <= 2:
            return False
        # every table's blocks in the order the queue takes them (checked in that order: no other copy is made)
        blocks = _interleave_tails(rows, lens)
        if min(blocks) < 0:
            return False
        get = itemgetter(*blocks)
        groups = list(map(_first, tables))
        if get(ref).count(1) != len(blocks) or get(group_of) != _groups_along(groups, lens, True):
            return False
        # each table's blocks cached in runs without children, but perhaps its last (its tail's first); Nones
        # counted only where the set of runs has one (the usual finish has none: its last block is full and cached),
        # for a tuple's count(None) compares each run to None the slow way (~20 ns a block: a fifth of the checks)
        nodes = get(owner)
        runs = {*nodes}
        none, n = 0, len(rows)
        if None in runs:
            last_nodes = nodes[:n]  # every table's last block: each reaches the first position
            none = last_nodes.count(None)
            if nodes.count(None) != none:
                return False
            runs.discard(None)
        if any(map(_children, runs)):
            return False
        used, kept = self.used, self.cached
        if none:
            lasts = blocks[:n]
            uncached = [node is None for node in last_nodes]
            gone = list(compress(lasts, uncached))
            if len({*gone}) < none:  # one block listed in two tables: the table by table path raises
                return False
            for b in gone:  # (in table order: the free list as table by table)
                ref[b] = 0
                group_of[b] = -1
            free = self._free
            free += gone
            # each such table's queue order starts a position later: the same order without its last block
            blocks = _interleave_tails([row[:-1] if u else row for row, u in zip(rows, uncached, strict=True)],
                                       [k - u for k, u in zip(lens, uncached, strict=True)])
            for g, k, u in zip(groups, lens, uncached, strict=True):
                used[g] -= k
                kept[g] += k - u
        else:
            for g, k in zip(groups, lens, strict=True):
                used[g] -= k
                kept[g] += k
        self._add_released(blocks, priority)
        return True

    def _add_released(self, leaves: list[int], priority: int) -> None:
        """Queue a finish's ``leaves`` (held by this table alone: references cleared as they are queued)."""
        if self.evictable.add_released(leaves, priority, self.ref) != len(leaves):
            # the checks at C speed count references, not repeats: a block listed twice (or queued already) is
            # caught here, as the loop's reference check caught it, not later as a free list gone wrong
            b = next((b for b, k in Counter(leaves).items() if k > 1), None)
            if b is None:
                raise RuntimeError("a released block was queued already: released more often than held")
            raise RuntimeError(f"group {self.names[self.group_of[b]]}: block {b} released more often than held")

    def _queue(self, leaves: list[int], shared: list[int], priority: int) -> None:
        """Queue released cached blocks, split by their runs' shape as :meth:`EvictionQueue.add_split` splits them
        (the release loops split them as they go: a second pass over blocks x groups blocks cost as much again)."""
        if leaves:
            self.evictable.add_many(leaves, priority)
        if shared:
            self.evictable.add_many(shared, priority, True)

    def incref(self, group: int, b: int) -> None:
        """One more cache of ``group`` holds ``b`` (a reused or reclaimed cached block of that group)."""
        if self.group_of[b] != group or (self.ref[b] == 0 and b not in self.evictable):
            raise RuntimeError(f"group {self.names[group]}: block {b} is not one of its used or cached blocks")
        if self.ref[b] == 0:
            self.evictable.remove(b)
            self.cached[group] -= 1
            self.used[group] += 1
        self.ref[b] += 1

    def release(self, group: int, blocks: Iterable[int], priority: int, keep_cached: bool, detach: Detach) -> None:
        """``group`` lets go of ``blocks`` (ids below 0 skipped), as ``GroupPool.release``."""
        ref, owner, free, group_of = self.ref, self.node, self._free, self.group_of
        cached: list[int] = []
        dropped: list[int] = []
        released = 0
        name = self.names[group]
        try:
            for b in blocks:
                if b < 0:
                    continue
                if ref[b] <= 0 or group_of[b] != group:
                    raise RuntimeError(f"group {name}: block {b} released more often than held")
                ref[b] = ref[b] - 1
                if ref[b]:
                    continue
                released += 1
                node = owner[b]
                if node is None:
                    free.append(b)
                    group_of[b] = -1
                elif keep_cached:
                    cached.append(b)
                else:
                    dropped.append(b)
                    free.append(b)
                    group_of[b] = -1
        finally:
            self.used[group] -= released
            if cached:
                self.evictable.add_split(cached, self.node, priority)
                self.cached[group] += len(cached)
            if dropped:
                detach(name, dropped)

    def reset(self) -> None:
        """Drop every cached page to the free list (the manager empties the radix tree); none may be in use."""
        if self.num_used:
            raise RuntimeError(f"shared arena: {self.num_used} blocks are in use; the cache cannot be reset")
        self.node[:] = [None] * self.num_blocks
        self.group_of[:] = [-1] * self.num_blocks
        self._free[:] = range(self.num_blocks - 1, -1, -1)
        self.evictable = EvictionQueue(self.priority)
        self.cached[:] = [0] * len(self.names)


class GroupShare:
    """One group's view of a :class:`SharedPool`, with :class:`GroupPool`'s interface (ids are the arena's)."""

    def __init__(self, arena: SharedPool, index: int) -> None:
        self.arena = arena
        self.index = index
        self.name = arena.names[index]
        self.num_blocks = arena.num_blocks  # what the group could hold alone
        # the arena's lists themselves (never rebound), so the manager's inlined hot paths read them directly
        self.ref, self.gen, self.node, self.pos, self.priority, self._free = (
            arena.ref, arena.gen, arena.node, arena.pos, arena.priority, arena._free)

    @property
    def evictable(self) -> EvictionQueue:
        """The arena's eviction queue (every group's cached blocks)."""
        return self.arena.evictable

    @property
    def num_free(self) -> int:
        """The arena's free pages."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """This group's cached blocks nobody owns."""
        return self.arena.cached[self.index]

    @property
    def available(self) -> int:
        """Pages this group could get now: the arena's free plus evictable (shared with every group)."""
        return len(self._free) + len(self.arena.evictable)

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

    def allocate(self, detach: Detach) -> int:
        """One page for this group (see :meth:`SharedPool.take`)."""
        return self.arena.take(self.index, 1, detach)[0]

    def allocate_many(self, n: int, detach: Detach) -> list[int]:
        """``n`` pages for this group (see :meth:`SharedPool.take`)."""
        return self.arena.take(self.index, n, detach)

    def incref(self, b: int) -> None:
        """One more cache of this group holds ``b``."""
        self.arena.incref(self.index, b)

    def incref_many(self, blocks: Sequence[int]) -> None:
        """:meth:`incref` for each of ``blocks``, in one pass (:meth:`SharedPool.incref_many`)."""
        self.arena.incref_many(self.index, blocks)

    def decref(self, b: int, priority: int, keep_cached: bool, detach: Detach) -> None:
        """One holder lets go of ``b`` (as ``GroupPool.decref``)."""
        self.arena.release(self.index, (b,), priority, keep_cached, detach)

    def release(self, blocks: Iterable[int], priority: int, keep_cached: bool, detach: Detach) -> None:
        """Let go of ``blocks`` (as ``GroupPool.release``)."""
        self.arena.release(self.index, blocks, priority, keep_cached, detach)

    def reset(self) -> None:
        """Reset the whole arena (every group's view shares it)."""
        self.arena.reset()

    def free_ids(self) -> list[int]:
        """The arena's free list."""
        return list(self._free)
