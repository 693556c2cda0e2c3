"""V2's radix tree as blocks join and leave it, and the KV cache events that tell it (stored, removed; a tied
arena's cut by cut) (:class:`TreeEvents`, a part of :class:`~cache_backends.v2.manager.KVCacheManagerV2`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Any

from cache_backends.hashing import pack_tokens
from cache_backends.kv_events import REMOVED, STORED, KvEventBuffer
from cache_backends.v2.radix import RadixNode
from cache_backends.v2.sequence import SequenceCache
from cache_backends.v2.token_runs import token_slice

#: where events go out as they happen (no tie, or no events): a reusable no-op context
_AS_IT_GOES = contextlib.nullcontext()


#: a KV event of the tie's logical group, its cuts' names not yet given: (group, kind, keys or stored stretches,
#: tokens per block) (``KVCacheManagerV2._cut_by_cut``)
_Heard = tuple[str, str, Any, int]


class TreeEvents:
    """Blocks hung in and detached from the tree, keyed, and reported as KV cache events."""

    def _detach(self, group: str, blocks: list[int]) -> None:
        """Unhook evicted or dropped blocks of ``group`` from their radix runs (the pool's other bookkeeping is the
        caller's); a suspended cache's page among them is copied to its host slot first (write-back)."""
        if self._event_cuts and self._batch is None and self.kv_events is not None:
            # the cuts tied: what one call reports (its removals, then the stores of the copies it hangs in their
            # place) goes out cut by cut, as the page arena's call per cut reports it (inside, _batch is set)
            with self._cut_by_cut(group):
                self._detach(group, blocks)
            return
        later = self._write_back[group]
        if later:
            slots: list[int] = []
            of: list[int] = []
            cuts = self._tied_cuts[self._names.index(group)] if self._tied_cuts is not None else None
            for b in blocks:
                for cache, j in later.pop(b, ()):
                    assert self.host is not None and cache.host is not None
                    if cuts is None:
                        slots.append(cache.host[group][j])
                        of.append(b)
                    else:  # a tied block: each cut's page to that cut's slot (one shared host tensor)
                        slots += [cache.host[cut][j] for cut in cuts]
                        of += self._arena.pages[b]  # type: ignore[union-attr]
                    del cache.reclaim[group][j]
            if slots:  # (tied: by the first cut's name, the host tensor every cut shares)
                self.host.write(group if cuts is None else cuts[0], slots, of)  # type: ignore[union-attr]
                self.host.sync()  # type: ignore[union-attr]  # on the host before the block changes hands
        if self.kv_events is not None:
            key, pool = self._tree.key, self._pool[group]
            keys = [key(pool.node[b], pool.pos[b] - pool.node[b].start)  # type: ignore[union-attr]
                    for b in blocks]
            if group in self._event_cuts:  # tied: reported per cut (the caller is inside _cut_by_cut)
                self._tied_event(group, REMOVED, keys, 0)
            else:
                self.kv_events.removed(keys, group)
        copies = self._copies[group]
        if copies:
            pool = self._pool[group]
            vacated = [(pool.node[b], pool.pos[b], got) for b in blocks if (got := copies.pop(b, None))]
            self._tree.detach(group, blocks)
            for run, p, got in vacated:
                self._hang_copy(group, run, p, got)  # type: ignore[arg-type]
            return
        self._tree.detach(group, blocks)

    @contextlib.contextmanager
    def _cut_by_cut(self, group: str | None) -> Iterator[list[_Heard]]:
        """With the cuts tied and KV events on: the events of ``group`` (a logical group) inside go out when it ends,
        once per cut of the group, cut by cut, each cut's in the order they happened, under the cut's name. With
        ``group`` None the events of any group are only recorded, in the list yielded (``_restore`` sends them).

        Why: a logical block is a page of each cut, and where the page arena runs a call or a loop per cut (a detach,
        a window's slide dropping blocks one by one), its events come cut by cut; the tie's one pass over logical
        blocks would report them block by block."""
        assert self._batch is None and self.kv_events is not None
        heard: list[_Heard] = []
        self._batch = (group, heard)
        try:
            yield heard
        finally:
            self._batch = None
            if group is not None:
                for name in self._event_cuts[group]:
                    self._send(name, heard)

    def _send(self, name: str, heard: list[_Heard]) -> None:
        """Send ``heard`` (``_cut_by_cut``'s events) under the cut ``name``."""
        events = self.kv_events
        assert events is not None
        for _, kind, what, tpb in heard:
            if kind == REMOVED:
                events.removed(what, name)
            else:
                for hashes, parent, tokens, salt in what:
                    events.stored(hashes, parent, tokens, tpb, name, salt=salt)

    def _tied_event(self, group: str, kind: str, what: Any, tpb: int) -> None:
        """An event of the tie's logical ``group`` (``_cut_by_cut``'s form): heard by the batch open, else sent per
        cut at once."""
        if self._batch is None:
            with self._cut_by_cut(group):
                self._tied_event(group, kind, what, tpb)
            return
        assert self._batch[0] in (group, None), (self._batch[0], group)  # a batch replays one family's cuts
        self._batch[1].append((group, kind, what, tpb))

    def _allocate_as_pages(self, group: str) -> int:
        """A block of the tie's logical ``group`` (KV events on), its take's events sent in the order the page arena's
        take of a page per cut, cut by cut, sends them (:meth:`_send_paged`)."""
        free = len(self._arena._free)  # type: ignore[union-attr]
        with self._cut_by_cut(None) as heard:
            b = self._pool[group].allocate(self._detach)
        self._send_paged(group, free, [(heard, [])])
        return b

    def _send_paged(self, group: str, free: int, steps: list[tuple[list[_Heard], list[_Heard]]]) -> None:
        """Send the events recorded while the logical ``group`` took blocks one at a time (``_restore``, ``fork``) in
        the page arena's order.

        ``steps``: per logical block allocated, what its take's evictions reported (each evicted row's removal, and
        the stores of copies hung in its place) and what hanging the new block stored. The page arena of the cuts
        allocates cut by cut, a page at a time: a cut's allocation stores its page, and evicts the next row of the
        queue (reported whole, each of its cuts) when the arena has no free page left (``free`` at the start, and
        each evicted row's pages after); the tie evicted the same rows, in the same order, a block at a time."""
        rows: list[tuple[str, list[_Heard]]] = []  # each evicted row: its logical group, its events
        for evicted, _ in steps:
            for g, kind, what, tpb in evicted:
                if kind == REMOVED:
                    rows += [(g, [(g, kind, [key], 0)]) for key in what]
                else:  # a copy hung where an evicted block was: that block's row reports it (its key is the copy's)
                    first = what[0][0][0]
                    row = next((r for r in reversed(rows) if r[0] == g and r[1][0][2][0] == first), rows[-1])
                    row[1].append((g, kind, what, tpb))
        sent = 0  # rows sent so far (in queue order)
        for name in self._event_cuts[group]:
            for _, stored in steps:
                # a store of a position whose evicted row the order above would send later goes out after that row: the
                # tie hung the block where that row's block was, so the page arena's order would report the key stored
                # twice, then removed while it is cached (a router would drop a cached block)
                upto = sent + 1 if not free and sent < len(rows) else sent
                keys = {h for _, kind, what, _ in stored if kind == STORED for hashes, *_ in what for h in hashes}
                if keys:
                    for k in range(len(rows) - 1, upto - 1, -1):
                        if rows[k][0] == group and rows[k][1][0][2][0] in keys:
                            upto = k + 1
                            break
                for g, heard in rows[sent:upto]:
                    for cut in self._event_cuts[g]:
                        self._send(cut, heard)
                    free += len(self._event_cuts[g])
                sent = max(sent, upto)
                free -= 1
                self._send(name, stored)
        for g, heard in rows[sent:]:  # (none: the page arena evicts as many rows)
            for cut in self._event_cuts[g]:
                self._send(cut, heard)

    def _hang_copy(self, group: str, run: RadixNode, p: int, copies: list[tuple[int, int]]) -> None:
        """Hang the first of ``copies`` (a request's live, private copy of the block that just left position ``p`` of
        ``run``) still live and private there, if the run still holds that position: the prefix stays reachable."""
        if type(run) is not RadixNode or run.parent is None or not run.users:
            return  # unhooked, a tail or a pending prefix: no path through it to keep
        i = p - run.start
        if not 0 <= i < len(run.held) or run.blocks[group][i] >= 0:
            return
        pool = self._pool[group]
        for b, gen in copies:
            if pool.gen[b] == gen and pool.ref[b] and pool.node[b] is None:
                self._attach(run, i, group, b)
                return

    def _detach_mixed(self, blocks: list[int], groups: list[int]) -> None:
        """:meth:`_detach` for a shared arena's evicted blocks of several groups (``groups[k]``: the arena index of
        ``blocks[k]``'s group), in one pass when there is nothing to do per group (no KV events, no write-back
        waiting); else group by group, each group's blocks in eviction order, the groups in order of first eviction
        (as :meth:`SharedPool.take_each` without it calls them)."""
        names = self._arena.names  # type: ignore[union-attr]
        if self.kv_events is None and not any(self._write_back.values()) and not any(self._copies.values()):
            self._tree.detach_mixed(names, blocks, groups)
            return
        by_group: dict[int, list[int]] = {}
        for b, g in zip(blocks, groups, strict=True):
            by_group.setdefault(g, []).append(b)
        for g, got in by_group.items():
            self._detach(names[g], got)

    def _attach(self, run: RadixNode, i: int, group: str, block: int) -> None:
        """Hang ``group``'s ``block`` at position ``i`` of ``run`` unless either already has a partner."""
        pool = self._pool[group]
        if run.blocks[group][i] < 0 and pool.node[block] is None:
            self._tree.version += 1  # (a lookup's memo: RadixTree.version)
            run.blocks[group][i] = block
            run.held[i] += 1
            pool.node[block] = run
            pool.pos[block] = run.start + i
            if self.kv_events is not None:
                self._stored(group, [(run, i)])

    def _stored(self, group: str, at: list[tuple[RadixNode, int]]) -> None:
        """``kv_block_stored`` for ``group``'s blocks now held at the (run, offset) positions ``at`` (along one path,
        in order): one event per stretch of consecutive blocks.

        A group whose blocks span ``step`` positions (a compressed group's 128 tokens over 16-token positions) hangs
        each block at the last position it covers: its event carries that block's ``step x T`` tokens, its size,
        and the key of the group's previous block as parent (not the position before, which it never stored)."""
        events = self.kv_events
        assert events is not None
        tree = self._tree
        tpb = self._group[group].tokens_per_block
        step = tpb // self.T
        chain: list[tuple[RadixNode, int]] = []
        out: list[tuple[list[bytes], bytes | None, list[int], str | None]] = []
        for item in [*at, None]:
            if item is not None and (not chain or item[0].start + item[1] == chain[-1][0].start + chain[-1][1] + step):
                chain.append(item)
                continue
            if chain:
                run, i = chain[0]
                if step == 1:
                    parent = tree.parent_key(run, i)
                    tokens = [t for r, j in chain for t in r.token_ids(j)]
                else:
                    first = run.start + i - step + 1  # the first position the chain's first block covers
                    last = chain[-1][0]
                    parent = tree.key(*tree.position(last, first - 1)) if first > 0 else None
                    tokens = []
                    for q in range(first, last.start + chain[-1][1] + 1):
                        r, j = tree.position(last, q)
                        tokens += r.token_ids(j)
                out.append(([tree.key(r, j) for r, j in chain], parent, tokens, run.salt))
            chain = [item] if item is not None else []
        if group in self._event_cuts:  # tied: each cut's pages are stored there, reported cut by cut
            self._tied_event(group, STORED, out, tpb)
            return
        for hashes, parent, tokens, salt in out:
            events.stored(hashes, parent, tokens, tpb, group, salt=salt)

    def _pages_of(self, group: str, blocks: list[int]) -> tuple[Any, list[int]]:
        """The tensor ``group``'s blocks live in and their page ids there: the blocks themselves, or with the cuts
        tied each logical block's pages, in cut order, in the arena's one tensor."""
        if self._tied_cuts is None:
            return self.pools.tensors[group], blocks
        pages = self._arena.pages  # type: ignore[union-attr]
        # (C passes: a partial hit's copy reads every block's pages)
        return self.pools.tensors[self._tied_cuts[0][0]], list(chain.from_iterable(map(pages.__getitem__, blocks)))

    def enable_kv_events(self, buffer: KvEventBuffer) -> None:
        """Record stored / removed / cleared prefix-cache blocks into ``buffer`` from now on."""
        self.key_pending()  # events report blocks as they are stored: none may stay unkeyed
        self.kv_events = buffer

    def key_pending(self) -> None:
        """Hang every pending prefix in the radix tree now (lazy keying: :mod:`cache_backends.v2.radix`)."""
        for by_first in list(self._tree.pending.values()):
            for prefix in list(by_first.values()):
                self._materialize(prefix)

    def _key_full_blocks(self, cache: SequenceCache) -> None:
        """Hang newly full committed blocks in the radix tree (found by their tokens: appended to the cache's own
        run when it is the run's only user) and offer the cache's blocks to their positions."""
        T = self.T
        first, full = cache.keyed, cache.committed // T
        if first >= full:
            return
        self._tree.version += 1  # new positions, or blocks on positions (a lookup's memo: RadixTree.version)
        packed = pack_tokens(token_slice(cache.request, first * T, full * T))  # once for the run
        cache.keyed = full
        cache.key_at = (full + 1) * T
        tables = cache.tables
        events = self.kv_events
        last = cache.last
        if last is not None and last.users == 1 and not last.children:
            # The common case: the cache's own leaf run grows in place (what extend() would do there).
            owner = self._one_owner
            if owner is not None and events is None and full > first + 1:
                # Several new positions (a turn's prefill), a block per group at each, none hung yet: checked for
                # every group at once at C speed and hung in bulk, else the per-group path below (Gemma 3 27B
                # multi-turn: a turn's 3 new positions cost ~44 us group by group over 31 groups)
                names, k = self._names, full - first
                got = [table[first:full] for table in map(tables.__getitem__, names)]
                flat = list(chain.from_iterable(got))
                if len(flat) == k * len(names) and -1 not in flat \
                        and list(map(owner.__getitem__, flat)).count(None) == len(flat):
                    last.tokens += packed
                    self._tree.num_nodes += k
                    for blocks, piece in zip(map(last.blocks.__getitem__, names), got, strict=True):
                        blocks += piece
                    pos = self._arena.pos  # type: ignore[union-attr]
                    for b in flat:
                        owner[b] = last
                    for piece in got:
                        for i, b in enumerate(piece, first):
                            pos[b] = i
                    last.held += [len(names)] * k
                    return
            if full == first + 1 and events is None:  # a decode filled one block: no slicing, no bulk checks
                i = len(last.held)
                last.tokens += packed
                self._tree.num_nodes += 1
                if owner is not None:  # one block per group at one position: checked at C speed, hung in bulk
                    names = self._names
                    # (a comprehension's subscripts, and one store loop over the groups: ~25% less than reading the
                    # tables and the run's lists through map(dict.__getitem__) and storing in two loops, on Python
                    # 3.11 with Gemma 3 27B's 31 groups)
                    got = [tables[name][first] for name in names]
                    if -1 not in got and list(map(owner.__getitem__, got)).count(None) == len(got):
                        pos = self._arena.pos  # type: ignore[union-attr]
                        run_blocks = last.blocks
                        for name, b in zip(names, got, strict=True):
                            run_blocks[name].append(b)
                            owner[b] = last
                            pos[b] = first
                        last.held.append(len(got))
                        return
                for blocks in last.blocks.values():
                    blocks.append(-1)
                held = 0
                for name, step, owner, pos in self._attach_steps:
                    if step == 1 or not full % step:  # a group block ends at this position
                        b = tables[name][full // step - 1]
                        if b >= 0 and owner[b] is None:
                            last.blocks[name][i] = b
                            owner[b] = last
                            pos[b] = first
                            held += 1
                last.held.append(held)
                return
            segs = [(last, self._tree.append(last, packed, T), len(last.held))]
        else:
            if cache.latent is not None:  # its path's first block: no longer latent
                self._drop_latent(cache)
            cache.last, segs = self._tree.extend(last, cache.request.salt, packed, T)
        # Offer every group block that ends on a new position to it (= _attach; inlined, it runs for every block).
        # A scored prompt's copies are never hung where a block is (module doc); any other request's are noted.
        scored = cache.request.skip_prefix_read
        for name, step, owner, pos in self._attach_steps:
            table = tables[name]
            copies, gen, ref = self._copies[name], self._pool[name].gen, self._pool[name].ref
            stored: list[tuple[RadixNode, int]] | None = [] if events is not None else None
            d = first  # block position of the segment's first entry
            for run, lo, hi in segs:
                blocks, held, shift = run.blocks[name], run.held, run.start
                k = hi - lo
                if step == 1:  # a group block per token block
                    got = table[d:d + k]
                    d += k
                    # Fresh positions and the cache's own blocks (the usual case): checked at C speed, set in bulk.
                    if -1 not in got and blocks[lo:hi].count(-1) == k \
                            and list(map(owner.__getitem__, got)).count(None) == k:
                        blocks[lo:hi] = got
                        held[lo:hi] = [h + 1 for h in held[lo:hi]]
                        for i, b in enumerate(got, shift + lo):
                            owner[b] = run
                            pos[b] = i
                        if stored is not None:
                            stored += [(run, i) for i in range(lo, hi)]
                        continue
                    pairs: Iterable[tuple[int, int]] = enumerate(got, lo)
                else:  # positions p whose end is a group block's end: (p + 1) % step == 0
                    pairs = ((i, table[(i + shift + 1) // step - 1])
                             for i in range(-(-(d + 1) // step) * step - 1 - shift, hi, step))
                    d += k
                for i, b in pairs:
                    if b >= 0 and owner[b] is None and blocks[i] >= 0 and not scored:
                        # the position holds another copy: this one stays private, noted to take its place later
                        noted = copies.get(blocks[i])
                        if noted is None:
                            copies[blocks[i]] = [(b, gen[b])]
                        else:  # the copies let go of meanwhile are dropped: a hot prefix's list stays short
                            noted[:] = [(x, g) for x, g in noted if gen[x] == g and ref[x] and owner[x] is None]
                            noted.append((b, gen[b]))
                        continue
                    if b >= 0 and owner[b] is None and blocks[i] < 0:
                        blocks[i] = b
                        held[i] += 1
                        owner[b] = run
                        pos[b] = shift + i
                        if stored is not None:
                            stored.append((run, i))
            if stored:
                self._stored(name, stored)
