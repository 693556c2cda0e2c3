"""The eviction queue of a tie of a shared arena's cuts: one entry per logical block, counted in pages (PROTOTYPE).

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

Not wired yet: the arena whose logical block owns ``k`` pages and the manager's use of it are missing (see
BENCHMARKS.md "tie57b" for the list, file by function).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cache_backends.v2.group_pool import _SHARED_BIT, STALE_POOLS, EvictionQueue


class RowQueue(EvictionQueue):
    """An :class:`EvictionQueue` whose entry ``b`` weighs ``weight[b]`` pages in its length, shared count and clock."""

    def __init__(self, priority: list[int], weight: list[int], pages: int) -> None:
        super().__init__(priority)
        if len(weight) != len(priority):
            raise ValueError(f"{len(weight)} weights for {len(priority)} entries")
        self._weight = weight  # (the caller's list: an entry's weight is set before it is queued)
        self._stale = STALE_POOLS * pages  # the page queue's threshold: pools' worth of pages
        self._pending = 0  # the pages of the entries the call in progress queues (read by _queued)

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
        self._pending = self._pages(dict.fromkeys(blocks))
        return super().add_released(blocks, priority, ref)

    def _demote_stale(self) -> None:
        before = self._shared_entries()
        super()._demote_stale()
        # EvictionQueue took one a demoted entry off num_shared; the pages they weigh come off instead
        after = self._shared_entries()
        self.num_shared += len(before) - len(after) - self._pages(before - after)

    def _shared_entries(self) -> set[int]:
        tags = self._tag
        return {b for key, bucket in self._by_key.items() if key >> _SHARED_BIT
                for seg in bucket if seg[0] for b in seg[2][seg[3]:] if tags[b] == seg[1]}

    def remove_many(self, blocks: Sequence[int]) -> None:
        """:meth:`EvictionQueue.remove_many`, the length and shared count lowered by the pages taken out."""
        self._counted_out(blocks, lambda: super(RowQueue, self).remove_many(blocks))

    def claim_many(self, blocks: Sequence[int], ref: list[int]) -> None:
        """:meth:`EvictionQueue.claim_many`, the length and shared count lowered by the pages taken out."""
        self._counted_out(blocks, lambda: super(RowQueue, self).claim_many(blocks, ref))

    def _counted_out(self, blocks: Sequence[int], take: object) -> None:
        tags = self._tag
        queued = [b for b in dict.fromkeys(blocks) if 0 <= b < len(tags) and tags[b] >= 0]
        shared = [b for b in queued if tags[b] >> _SHARED_BIT & 1]
        n_len, n_shared = self._len, self.num_shared
        try:
            take()  # type: ignore[operator]
        finally:  # (a KeyError leaves the blocks before the bad one out: count those)
            out = [b for b in queued if tags[b] < 0]
            gone_shared = [b for b in shared if tags[b] < 0]
            self._len = n_len - self._pages(out)
            self.num_shared = n_shared - self._pages(gone_shared)

    def count_shared(self, blocks: Sequence[int]) -> int:
        """The pages of ``blocks`` (queued) queued as shared prefixes' blocks."""
        tags = self._tag
        return self._pages(b for b in blocks if tags[b] >> _SHARED_BIT & 1)

    def requeue(self, leaves: list[int], shared: list[int], priority: int) -> None:
        """:meth:`EvictionQueue.requeue`: ``leaves`` and ``shared`` out, then queued again, weighed in pages."""
        self.remove_many(leaves + shared)
        if leaves:
            self.add_many(leaves, priority)
        if shared:
            self.add_many(shared, priority, True)

    def refresh(self, blocks: Iterable[int]) -> None:
        """:meth:`EvictionQueue.refresh`, the clock moved by each refreshed entry's pages."""
        tags, weight = self._tag, self._weight
        for b in blocks:
            if b >= 0 and tags[b] >= 0:
                super().refresh((b,))
                self._clock += weight[b] - 1

    def pop_many(self, n: int) -> list[int]:
        """Not for a row queue: entries are popped by pages (:meth:`pop_pages`)."""
        raise TypeError("RowQueue pops by pages: pop_pages")

    def pop_pages(self, n: int) -> list[int]:
        """Whole entries in eviction order until they weigh at least ``n`` pages: the rows the page queue's pop of
        ``n`` pages touches, whose every page then leaves (``SharedPool._row_rest``); ``IndexError`` if fewer are
        queued."""
        if n > self._len:
            raise IndexError("no evictable block" if not self._len else f"{n} pages asked, {self._len} evictable")
        out: list[int] = []
        got = 0
        weight, pop_one = self._weight, super().pop_many
        while got < n:  # an entry at a time: a take evicts a row or a few (each weighs its family's cuts)
            before = self.num_shared
            (b,) = pop_one(1)  # (counted one page off the length, and off num_shared where shared)
            w = weight[b]
            out.append(b)
            got += w
            self._len -= w - 1
            if self.num_shared != before:
                self.num_shared -= w - 1
        return out
