"""``KVCacheManagerV2``: per-group pools, radix-tree prefix reuse, a host tier, priority + LRU eviction.

How the pieces fit (TensorRT-LLM's V2 ideas, this project's code):

* **Layer groups.** One :class:`~cache_backends.v2.group_pool.GroupPool` per group of the layout. Token
  position ``p`` of a sequence lives in logical block ``p // tpb(g)`` of group ``g`` (``tpb`` =
  ``group.tokens_per_block``; compressed groups hold ``tpb / c`` entries per block).
* **Shared memory.** When the layout is shared (:attr:`KvLayout.shared`: every group's block is the
  same page), every group takes its blocks from one :class:`~cache_backends.v2.shared_pool.SharedPool`
  (one free list, one eviction queue, global block ids) through a per-group view, and every check of
  room is joint: :meth:`shortfall` sums what the groups of one pool need against that pool's
  ``available``. Layouts that cannot share keep one ``GroupPool`` per group.
* **Windows.** After each commit a sliding group releases every block that lies wholly before
  ``committed - window + 1`` (the oldest key the next query can see). A released block that is a
  keyed prefix block stays in the prefix cache (evictable, like any cached block nobody holds), so a
  later request whose prefix is longer than the window still hits: a sliding group's part of a hit at
  ``m`` tokens needs only the blocks the window at ``m`` reads (``[m - window + 1, m)``), not the ones
  before it (vLLM's sliding-window manager matches the same way). ``enable_swa_scratch_reuse`` (on
  by default) is that keeping; set to false, out-of-window blocks go straight to the free list instead
  (their memory is never held by the cache, and prefixes longer than a window are not reused).
* **Prefix reuse.** Full committed ``T``-token blocks are hung in a :class:`~cache_backends.v2.radix.RadixTree`
  under the request's salt, found by their tokens; their chained SHA-256 keys are computed only when
  something reports them (KV cache events). The tree keeps one node per unbranched *run* of blocks (path
  compression): a cache's path ends at the end of ``cache.last``, keying appends to that run while the cache is
  its only user, and a match or branch that ends inside a run splits it; a pool's ``node[b]`` / ``pos[b]`` name
  the run and block position holding ``b``. **Lazy keying**: where every group's block spans one token block and no
  KV events are recorded, a request whose first token starts no cached prefix is only noted as pending; the
  blocks its windows let go and, when it lets go, its full committed blocks stay cached under the note, and the first
  admission with that first token hangs it in the tree before looking up
  (:class:`~cache_backends.v2.radix.PendingPrefix`; a user sees what keying every block at once gives). A request
  with ``skip_prefix_read`` (one that scores its prompt) claims nothing but is keyed as any other: where its path
  meets a position that already holds a block, that block stays and the request's copy is never hung (it is freed,
  not cached, when the request lets go). Any other request's copy is noted (``_copies``) and takes the position
  when the block there leaves it (evicted or dropped) while the copy is still live and private (:meth:`_hang_copy`),
  so a prefix a preempted request recomputed stays reachable while it runs.
  A new request walks it over its
  tokens and takes the longest prefix ``m`` that (a) is a multiple of the *reuse unit* — the lcm of
  every group's block span, so compressed groups reuse whole blocks only — (b) leaves at least one
  token to compute (logits), (c) has every block of every growing group below ``m`` still cached and
  (d) for a sliding group, every block the window at ``m`` covers. With ``enable_partial_reuse`` (and
  every group spanning exactly ``T`` tokens) the next block may be matched in part: the child with
  the longest common token prefix (rounded down to the compress rates) is copied into a fresh block
  (copy-on-write); the cached original is never written. When the geometry rules that out — some
  group spans more than ``T``, or the compress rates' lcm is not below ``T`` (DeepSeek V4) — partial
  reuse is off and ``stats().reuse.partial_disabled_reason`` says why
  (:func:`cache_backends.reuse.partial_reuse_off_reason`, which the plan stage asks too).
* **Host tier.** ``suspend`` reserves a host slot for every page of the request and drops its device
  blocks (cached ones stay cached). Pages no one else can find (the partial last block; every page
  without prefix reuse) are copied at once; a cached page is copied only when its device block is
  evicted or dropped, just before it changes hands (write-back, SGLang HiCache's ``write_back``
  policy): a request resumed before the pool needed its blocks crossed the host link for its tail
  alone. ``resume`` takes back cached blocks that were never evicted and copies the rest back,
  byte-exact, into fresh blocks. ``resume`` is refused when the pools lack room
  for the pages plus the block the next token starts (a resumed request must be able to run), or
  when it would lift any group's device use above ``max_util_for_resume`` — the latter unless nothing
  else holds device blocks, since waiting could not help then.
* **Eviction.** Cached blocks nobody owns are evicted lowest priority first (the priority of the
  last request that held them), then least recently released; a request's blocks are released tail
  first, so the tail of a cached prefix goes before its head. At a finish, the blocks a window let go that a
  whole-block hit on the finished history still reads are requeued as released then (``_refresh_window_head``).

**Forks.** ``fork(parent, child)`` admits a sample of the same prompt (``n > 1``) holding the parent's
prompt KV the moment the parent's prefill is committed: in every group the blocks wholly inside the prompt
are shared (a window's released ones stay released) and the block holding the prompt's partial end is
copied into one of the child's own (copy-on-write: the parent goes on writing there). With prefix reuse on
the child takes the parent's radix path, so its own blocks are keyed from there on as a hit's would be; it
needs no reuse, though: it is the prompt's own KV, not a cached prefix (``reuse_hit_tokens`` does not count it).

The first ``resume`` of a cache is its admission: it claims the cached prefix and sets
``request.num_computed_tokens`` to its length (never the whole sequence). That one is never
refused for utilisation; the scheduler decides admission.

**Where the parts live.** This module holds the manager's life cycle (create, admission's claim, growth, commit,
forks, block tables, stats); the class takes the rest from one module per concern, each a plain mixin over the same
state: :mod:`~cache_backends.v2.room` (room in the pools and the estimates admission asks),
:mod:`~cache_backends.v2.lookup` (cached-prefix lookups and probed hits), :mod:`~cache_backends.v2.release` (window
slides, finished requests' blocks parked in the cache), :mod:`~cache_backends.v2.host_moves` (suspend and resume
through the host tier), :mod:`~cache_backends.v2.tree_events` (the tree's attach/detach and KV cache events) and
:mod:`~cache_backends.v2.invariants` (``check_invariants``); :mod:`~cache_backends.v2.token_runs` packs a request's
token ids as the tree keys them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from itertools import chain, repeat
from operator import add, attrgetter, getitem, itemgetter, mul
from typing import Any

import torch

from cache_backends.hashing import pack_tokens
from cache_backends.interface import ManagerOptions, prefix_cache_in_use
from cache_backends.kv_events import KvEventBuffer
from cache_backends.layout import KvLayout, LayerGroup, cut_families, tied_groups
from cache_backends.pools import BlockPools, even_run, move_pages
from cache_backends.request import Request
from cache_backends.reuse import partial_reuse_off_reason, partial_reuse_unit, reuse_unit
from cache_backends.stats import GroupStats, HostStats, ManagerStats, ReuseStats
from cache_backends.v2.group_pool import GroupPool
from cache_backends.v2.host_moves import HostMoves
from cache_backends.v2.host_tier import HostTier, host_slots
from cache_backends.v2.invariants import Invariants
from cache_backends.v2.lookup import PrefixLookup
from cache_backends.v2.radix import PendingPrefix, RadixNode, RadixTree
from cache_backends.v2.release import Release
from cache_backends.v2.room import RoomEstimates
from cache_backends.v2.sequence import NEVER, CacheState, SequenceCache
from cache_backends.v2.shared_pool import GroupShare, SharedPool
from cache_backends.v2.slab_pool import SlabArena, SlabPool
from cache_backends.v2.tied_pool import CutTables, TiedArena
from cache_backends.v2.token_runs import common_prefix, first_packed, packed_prefix, token_slice
from cache_backends.v2.tree_events import TreeEvents, _Heard

#: Whether the V2 manager ties a shared arena's cuts of one group (``layout.share_pages`` cuts a group whose layers
#: outnumber a page's, e.g. Gemma 3 27B: 52 sliding + 10 full layers as 31 groups of 2-layer pages) into one logical
#: group whose block owns a page per cut (``cache_backends.v2.tied_pool``): the manager then walks 2 block tables a
#: request, not 31, at about V1's CPU (BENCHMARKS.md "tie57d", "tie58b"). Its decisions, KV events and host tier are
#: the page arena's (each cut its own group, evicting whole rows: ``SharedPool``); False runs that page arena, the
#: reference the tie is checked against (``tests/test_kv_v2_tied*.py``).
TIE_CUTS = True

_ACTIVE = CacheState.ACTIVE  # (one global read, not two: commit reads it for every running request every step)


def _copy_pages(pages: Any, dst: list[int], src: list[int]) -> None:
    """``pages[:, dst] = pages[:, src]`` for distinct ``dst`` blocks none of which is in ``src``: one strided copy where
    both lists step evenly (a partial hit's usual source run and fresh blocks: consecutive ids), else one gather and
    one scatter by index tensors (in host memory, page by page: :func:`cache_backends.pools.move_pages`); on unbacked
    (meta) pools nothing moves, the lists are only checked."""
    # ``pages[:, dst] = pages[:, src]`` as written costs ~65 us of torch's Python decompositions on unbacked pools (a
    # simulation): a tenth of a Gemma 3 27B multi-turn run's KV time; the same gather and scatter as ``index_select``
    # and ``index_copy_`` ~20-27 us; a slice copy ~4 us, checks included
    n = len(dst)
    if pages.is_meta:  # unbacked pools (a simulation): no bytes to move, only the lists to check
        # torch's meta gather and scatter check the lists' lengths (not the ids: a meta index has no values) through
        # Python decompositions, ~35 us warm and ~90 us within a run: a tenth of tiny-gemma3 multi-turn's V2 KV time
        # (BENCHMARKS.md "perf59"). Checked here instead: the lengths, and the ids against the pool
        if len(src) != n:
            raise ValueError(f"{n} destination pages for {len(src)} source pages")
        if n and max(max(dst), max(src)) >= pages.shape[1]:
            raise IndexError(f"page ids {dst} <- {src} outside a pool of {pages.shape[1]} pages")
        return
    if n > 1:
        if dst[0] > dst[-1]:  # a descending run read backwards: the same pairs
            dst, src = dst[::-1], src[::-1]
        put, take = even_run(dst), even_run(src)
        if put is not None and take is not None:
            pages[:, put].copy_(pages[:, take])
            return
    elif n == 1:
        pages[:, dst[0]].copy_(pages[:, src[0]])
        return
    if pages.device.type == "cpu":  # in host memory page by page: no temporary, and float8 has no CPU index_copy
        by_block = pages.transpose(0, 1)
        move_pages(by_block, dst, by_block, src)
        return
    index = {"dtype": torch.long, "device": pages.device}
    pages.index_copy_(1, torch.tensor(dst, **index), pages.index_select(1, torch.tensor(src, **index)))


class KVCacheManagerV2(RoomEstimates, PrefixLookup, HostMoves, Release, TreeEvents, Invariants):
    """KV cache manager V2 over ``BlockPools`` built from a ``"v2"`` layout; see the module docstring."""

    def __init__(self, pools: BlockPools, options: ManagerOptions) -> None:
        if pools.layout.manager != "v2":
            raise ValueError(f"KVCacheManagerV2 needs pools built from a 'v2' layout, got {pools.layout.manager!r}")
        if pools.released:
            raise ValueError("KVCacheManagerV2: the block pools were already released")
        if options.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {options.max_seq_len}")
        if not 0 < options.max_util_for_resume <= 1:
            raise ValueError(f"max_util_for_resume must be in (0, 1], got {options.max_util_for_resume}")
        self.layout: KvLayout = pools.layout
        self.pools = pools
        self.options = options
        self.T = self.layout.tokens_per_block
        self._groups: tuple[LayerGroup, ...] = self.layout.groups
        self._tie_cuts()
        self._build_pools(pools)
        self._plan_steps()
        self._plan_windows()
        self._plan_cycles()
        self._plan_reuse(options)
        self._tree = self._new_tree()
        self.host: HostTier | None = None
        slots = host_slots(pools, options.host_cache_size) if self._slabs is None else {}
        if self._slabs is not None and options.host_cache_size:
            raise ValueError("a slab arena (pool_arena) runs without a host tier; set host_cache_size to 0")
        if slots:
            self.host = HostTier(pools, slots)
        #: per group, a cached device block a suspended cache left on the device -> (cache, logical block) whose
        #: reserved host slot it is copied to when it is evicted or dropped (write-back)
        self._write_back: dict[str, dict[int, list[tuple[SequenceCache, int]]]] = {g.name: {} for g in self._groups}
        #: per group, a position's block -> the live copies (block, its allocation's ``gen``) requests filled for that
        #: position while it was held: kept private then, one of them takes the position when that block leaves it
        #: (:meth:`_detach`), so the prefix stays reachable while a copy runs (BENCHMARKS.md, "V2's loss on a tiny
        #: budget with preemptions": a preempted request recomputed a shared prefix, the tree's copy was evicted)
        self._copies: dict[str, dict[int, list[tuple[int, int]]]] = {g.name: {} for g in self._groups}
        self._caches: dict[Request, SequenceCache] = {}
        #: who moves what it keys by a block along when :meth:`compact_slabs` moves blocks (:meth:`watch_moves`)
        self._move_watchers: list[Callable[[str, list[tuple[int, int]]], None]] = []
        #: the requests whose cache is ACTIVE (kept where a cache's state changes): ``check_running``'s one C pass
        self._active_requests: set[Request] = set()
        #: requests whose pages wait on the host tier (suspended, not resumed or freed yet)
        self.num_on_host = 0
        # per group: sum over active caches of the blocks each holds at its worst case (growth_bound's cheap bound)
        self._worst_blocks = [0] * len(self._groups)
        self._closed = False
        self._never_fits_memo: tuple[tuple[Request, int, int], str | None] | None = None
        self._stats_fixed: tuple[int, int, str | None] | None = None  # stats(): pool bytes, host bytes, memory
        self.kv_events: KvEventBuffer | None = None
        self.counters = {"suspends": 0, "resumes": 0, "preemptions": 0, "reuse_hit_tokens": 0,
                         "reuse_partial_hits": 0, "reuse_query_tokens": 0}

    def _tie_cuts(self) -> None:
        """A shared arena's cuts of one group tied into logical groups (``_groups``), or none tied."""
        #: A shared arena's cuts of one group are tied (:data:`TIE_CUTS`, :func:`~cache_backends.layout.tied_groups`;
        #: BENCHMARKS.md "tie57" to "tie58"): ``self._groups`` are the logical groups (Gemma 3 27B: 2, not 31), each
        #: block owning a page per cut (``TiedArena``); ``layout.groups`` stay the cuts, and pages appear where memory
        #: is touched (``block_tables``, ``fork``, ``_claim_partial_arena``). KV events go out per cut
        #: (``_event_cuts``: ``_detach``, ``_stored``). The host tier holds a slot per page (``cache.host`` by cut;
        #: ``reclaim`` and the write-back map by logical group, ``_suspend_tied``, ``_restore``). The public per-group
        #: APIs (:attr:`groups`, ``stats()``, ``block_table``, ``shortfall``, ``per_group``, ``growth_*``,
        #: ``available_blocks``) speak the cuts either way. ``_tied_cuts[i]``: logical group ``i``'s cut names.
        self._tied_cuts: list[list[str]] | None = None
        #: with the tie on, each cut's name -> (its logical group's index, its page's index in a logical block)
        self._cut_of: dict[str, tuple[int, int]] = {}
        #: with the tie on, each logical group's name -> its cuts' names, in order: the names its KV events go out under
        #: (a consumer hears each cut's stores and removals, as from the page arena); empty with the tie off
        self._event_cuts: dict[str, list[str]] = {}
        #: with the tie on, inside :meth:`_cut_by_cut` (or ``_restore``'s recording: group None): its logical group
        #: and the events it heard, each ``(logical group, REMOVED, keys, 0)`` or ``(logical group, STORED, [(hashes,
        #: parent, token ids)] stretches, tokens per block)``, with no cut name yet; else None
        self._batch: tuple[str | None, list[_Heard]] | None = None
        logical, cuts = tied_groups(self.layout.groups) if TIE_CUTS and self.layout.shared else ([], [])
        if any(len(c) > 1 for c in cuts):  # (an arena of uncut groups is its own tie: a page a block)
            self._tied_cuts = [[self.layout.groups[i].name for i in c] for c in cuts]
            self._groups = tuple(logical)
            self._cut_of = {name: (g, j) for g, names in enumerate(self._tied_cuts) for j, name in enumerate(names)}
            self._event_cuts = {g.name: names for g, names in zip(logical, self._tied_cuts, strict=True)}
        self._group = {g.name: g for g in self._groups}

    def _build_pools(self, pools: BlockPools) -> None:
        """The groups' pools (one arena, tied or shared; a slab arena's pools; or a pool per group) and
        each group's block weight in pages."""
        #: per group (in group order), the arena pages one of its blocks holds: 1, or with the cuts tied its
        #: family's cuts, a logical block holding a page per cut. Every check of blocks
        #: against a pool set's ``available`` (pages) weighs a block by it: ``_spans``, ``_set_cycles`` and
        #: ``_pool_cycles`` count pages, ``_first_short``, ``resume_refusal``, ``probe_hit``, ``_reserve_shared`` and
        #: ``_claim_partial_arena`` weigh the groups' blocks.
        self._pages_per_block: list[int] = ([1] * len(self._groups) if self._tied_cuts is None
                                            else [len(c) for c in self._tied_cuts])
        self._page_weight = dict(zip((g.name for g in self._groups), self._pages_per_block, strict=True))
        # the pages of a block of every group (a decode's boundary takes one of each), and the weights where any
        # differs from 1 (else None: the hot paths sum blocks as they are)
        self._row_pages = sum(self._pages_per_block)
        self._weights = None if self._row_pages == len(self._groups) else self._pages_per_block
        self._arena: SharedPool | None = None
        #: a slab arena (``pools.slabs``: groups of unequal pages drawing on one budget), or None
        self._slabs: SlabArena | None = None
        # (pool, its groups' names) per distinct pool: one SharedPool for a shared layout, else a GroupPool per group
        self._pool_sets: list[tuple[GroupPool | SharedPool, list[str]]]
        if self.layout.shared:
            names = [g.name for g in self._groups]
            if self._tied_cuts is not None:
                self._arena = TiedArena(names, self._pages_per_block, pools.num_blocks[self._tied_cuts[0][0]])
            else:
                self._arena = SharedPool(names, pools.num_blocks[names[0]], cut_families(self._groups))
            self._pool: dict[str, GroupPool | GroupShare] = dict(zip(names, self._arena.shares, strict=True))
            self._pool_sets = [(self._arena, names)]
        elif pools.slabs is not None:
            self._slabs = SlabArena(pools.slabs, pools.slab_bytes)
            own = {g.name: SlabPool(g.name, self._slabs, g.bytes_per_block) for g in self._groups}
            self._pool = dict(own)
            self._pool_sets = [(pool, [name]) for name, pool in own.items()]
        else:
            own = {g.name: GroupPool(g.name, pools.num_blocks[g.name]) for g in self._groups}
            self._pool = dict(own)
            self._pool_sets = [(pool, [name]) for name, pool in own.items()]
        self._group_pools = [(g.name, g.tokens_per_block, self._pool[g.name]) for g in self._groups]

    def _plan_steps(self) -> None:
        """Per group, what keying and a hit's claim walk (fixed lists, read on the hot paths), and the arena's
        or the per-group versions of the paths that differ."""
        # (group, token blocks per group block, pool's block -> run list, pool's block -> position list) for keying;
        # with reuse on, every group block spans a whole number of token blocks.
        self._attach_steps = [(g.name, max(1, g.tokens_per_block // self.T), self._pool[g.name].node,
                               self._pool[g.name].pos) for g in self._groups]
        self._names = [g.name for g in self._groups]
        # a hit's claim per group: (group, block span in tokens, in token blocks, window, what claims its blocks: its
        # pool's incref_many, or None on a shared arena, whose claims are made for every group at once)
        self._claim_steps = [(g.name, g.tokens_per_block, g.tokens_per_block // self.T, g.window,
                              None if self._arena is not None else self._pool[g.name].incref_many)
                             for g in self._groups]
        # a shared arena whose every group block spans one token block: its block -> run list, which every group's
        # view shares (a decode that fills a block keys every group's block at one position, checked in bulk)
        self._one_owner = (self._arena.node if self._arena is not None and all(g.tokens_per_block == self.T
                                                                                for g in self._groups) else None)
        # the arena's versions of per-group paths (one pass over the groups), or the per-group ones: plain functions
        # called with the manager (a bound method kept on the manager would make it a reference cycle, and its pools
        # would outlive it until the garbage collector runs)
        cls = type(self)
        self._claim_partial_fn = cls._claim_partial_arena if self._arena is not None else cls._claim_partial
        self._tail_fn = (cls._tail_to_keep_arena if self._arena is not None and len(self._names) > 1
                         else cls._tail_to_keep)

    def _plan_windows(self) -> None:
        """The sliding groups by window and block span (released in lockstep), and the block spans a shared
        arena's need is counted by."""
        self._sliding = [g for g in self._groups if g.window is not None]
        # sliding groups by (window, block span): they release in lockstep, so one bound serves them all
        windows: dict[tuple[int, int], list[tuple[str, GroupPool | GroupShare]]] = {}
        for g in self._sliding:
            windows.setdefault((g.window, g.tokens_per_block), []).append((g.name, self._pool[g.name]))  # type: ignore[arg-type]
        self._window_sets = [(w, tpb, members) for (w, tpb), members in windows.items()]
        # sliding groups in group order (the order a finish requeues their blocks in): (group, pool, its set's index)
        slot = {name: k for k, members in enumerate(windows.values()) for name, _ in members}
        self._window_groups = [(g.name, self._pool[g.name], slot[g.name]) for g in self._sliding]
        # the shortest sliding window (no window: never shorter than a sequence): held_back holds nothing below it
        self._min_window = min((g.window for g in self._sliding), default=math.inf)
        spans: dict[int, int] = {}
        for g, w in zip(self._groups, self._pages_per_block, strict=True):
            spans[g.tokens_per_block] = spans.get(g.tokens_per_block, 0) + w
        self._spans = list(spans.items())  # (block span, pages of its groups' blocks): a shared arena's need per span
        # a shared arena: every group's index in it and the slot of its span in _spans (one take_each per step)
        self._share_index = [self._pool[g.name].index for g in self._groups] if self.layout.shared else []  # type: ignore[union-attr]
        self._span_slot = [list(spans).index(g.tokens_per_block) for g in self._groups]

    def _plan_cycles(self) -> None:
        """The groups' life cycles (one span and window: one estimate), per pool set, and a shared arena's
        window sets."""
        # life cycles: groups of one block span and window hold the same blocks for any length (blocks_for), so the
        # admission estimates are computed once per cycle; (a group of it, its groups' indexes), and each group's cycle
        cycles: dict[tuple[int, int | None], list[int]] = {}
        for i, g in enumerate(self._groups):
            cycles.setdefault((g.tokens_per_block, g.window), []).append(i)
        self._cycles = [(self._groups[members[0]], members) for members in cycles.values()]
        self._cycle_of = [list(cycles).index((g.tokens_per_block, g.window)) for g in self._groups]
        #: per life cycle (the order of :meth:`cycle_growth`'s lists): whether its groups slide a window
        self.cycle_windowed: tuple[bool, ...] = tuple(g.window is not None for g, _ in self._cycles)
        # cycle_headroom's one pass where every cycle has one block span and the windowed ones one block cap (Gemma 2
        # and 3: a full and a sliding cycle): (span, cap, windowed per cycle); None where it does not apply
        spans_of = {g.tokens_per_block for g, _ in self._cycles}
        caps_of = {g.max_blocks_per_sequence for g, _ in self._cycles} - {None}
        self._one_span_cap: tuple[int, int, tuple[bool, ...]] | None = (
            (spans_of.pop(), caps_of.pop(), tuple(g.max_blocks_per_sequence is not None for g, _ in self._cycles))
            if len(self._cycles) > 1 and len(spans_of) == 1 and len(caps_of) == 1 else None)
        self._span_first = [next(g.name for g in self._groups if g.tokens_per_block == tpb)
                            for tpb, _ in self._spans]
        # per pool set: (a group of each life cycle in it, the pages a block of each of the set's groups in that
        # cycle holds, together: how many of them share the cycle, each block weighed by _pages_per_block)
        index = {g.name: i for i, g in enumerate(self._groups)}
        weight = self._page_weight
        set_counts: list[Counter[int]] = []
        for _, names in self._pool_sets:
            count: Counter[int] = Counter()
            for name in names:
                count[self._cycle_of[index[name]]] += weight[name]
            set_counts.append(count)
        self._pool_cycles: list[list[tuple[LayerGroup, int]]] = [
            [(self._cycles[c][0], k) for c, k in count.items()] for count in set_counts]
        # the same as (cycle index, pages): admission's estimates are per cycle (:meth:`short_of`)
        self._set_cycles: list[list[tuple[int, int]]] = [list(count.items()) for count in set_counts]
        # a shared arena's window sets as (window, span, first member, [(arena index, member name)], member names):
        # released at once
        self._arena_windows = [(w, tpb, members[0][0], [(pool.index, name) for name, pool in members],  # type: ignore[union-attr]
                                [name for name, _ in members], tuple(pool.index for _, pool in members))  # type: ignore[union-attr]
                               for w, tpb, members in self._window_sets] if self.layout.shared else []
        # a finish's window refresh of a lazily keyed cache in one pass per window set (_refresh_window_head): where
        # the arena's window sets, one after another, list the sliding groups in their order (the order it requeues)
        in_sets = [name for *_, names, _ in self._arena_windows for name in names]
        self._arena_refresh = ([(w, tpb, first, names) for w, tpb, first, _, names, _ in self._arena_windows]
                               if in_sets and in_sets == [g.name for g in self._sliding] else None)

    def _plan_reuse(self, options: ManagerOptions) -> None:
        """Whether prefix and partial-block reuse are on (and why not), and the lookups' shapes they allow."""
        spans = [g.tokens_per_block for g in self._groups]
        self.reuse_unit: int | None = reuse_unit(self.layout)
        self.reuse_off_reason: str | None = None
        if not options.enable_block_reuse:
            self.reuse_off_reason = "enable_block_reuse is false"
        elif self.reuse_unit is None:
            self.reuse_off_reason = (
                f"layer group blocks span {spans} tokens, not all multiples of tokens_per_block={self.T}, "
                "so they cannot be keyed by token blocks"
            )
        self._reuse = self.reuse_off_reason is None
        self._partial_unit = partial_reuse_unit(self.layout)
        self.partial_off_reason: str | None = None  # why partial-block reuse is off, None when it is on
        if not self._reuse:
            self.partial_off_reason = "prefix reuse is off"
        elif not options.enable_partial_reuse:
            self.partial_off_reason = "enable_partial_reuse is false"
        else:
            self.partial_off_reason = partial_reuse_off_reason(self.layout)
        self._partial = self.partial_off_reason is None
        #: a caller's say on which cached prefix lengths a request may reuse (:meth:`limit_reuse`), or None
        self._prefix_check: tuple[str, Callable[[Request, int, int], bool]] | None = None
        # lazy keying (cache_backends.v2.radix): where a request's blocks stay as they are until it lets go of them
        self._lazy = self._reuse and all(g.tokens_per_block == self.T for g in self._groups)
        # where a whole-block hit's claim is asked about before it is built (probe_hit): pools per group, or an arena
        # whose every group holds a block per position (its release interleaves the groups position by position)
        self._probes = self._reuse and (self._arena is None or self._lazy)
        # every group block spans one token block: probe_hit's claim per group is a slice of the run's blocks, taken
        # (and refuse_hit's requeue) in C passes over the groups where there are a few (for one or two, the passes'
        # fixed cost is more than the loop's: tiny-llama +0.2% opcodes). Tied, always: the tie's 2 logical groups
        # (a sliding one of k cuts) take the passes for less than the loop (tiny-gemma3 and Gemma 3 27B multi-turn
        # -0.1% opcodes; BENCHMARKS.md "tie58b")
        self._unit_spans = all(g.tokens_per_block == self.T for g in self._groups) and (
            len(self._groups) >= 4 or self._tied_cuts is not None)
        # where a whole-block hit followed by the copy of its history's partial last block is probed too (probe_hit),
        # each group's block one token block: pools per group without a window (admission holds back no shared
        # prefix, so what the copy evicts changes no estimate), or the cuts tied (the eviction's shared pages are
        # counted: RowQueue.peek_pages). Why tied: under pressure Gemma 3 27B's follow-up turns were built and
        # cancelled every step they waited (BENCHMARKS.md "tailprobe60")
        self._tail_probes = (self._probes and self._partial and self._slabs is None
                             and all(g.tokens_per_block == self.T for g in self._groups)
                             and (self._tied_cuts is not None if self._arena is not None else not self._sliding))
        # per group, its pool's reference counts' reader (the list is never rebound; an arena's groups share it)
        self._ref_of = [pool.ref.__getitem__ for _, _, pool in self._group_pools]

    # --- life cycle ----------------------------------------------------------------------------

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        """The layer groups as the user and the executor see them (``layout.groups``: the cuts, tie or not)."""
        return self.layout.groups

    def create(self, request: Request) -> SequenceCache:
        """Register a suspended, empty cache for ``request``; :meth:`resume` admits it."""
        self._check_open()
        if request in self._caches:
            raise ValueError(f"request {request.req_id}: already has a KV cache")
        if request.num_computed_tokens:
            raise ValueError(f"request {request.req_id}: claims {request.num_computed_tokens} computed tokens "
                             "but has no KV cache here")
        if request.num_tokens > self.options.max_seq_len:
            raise ValueError(f"request {request.req_id}: {request.num_tokens} tokens exceed max_seq_len="
                             f"{self.options.max_seq_len}")
        cache = SequenceCache(request, {g.name: [] for g in self._groups}, {g.name: 0 for g in self._groups},
                              key_at=self.T if self._reuse else NEVER)
        self._caches[request] = cache
        return cache

    def cache(self, request: Request) -> SequenceCache:
        """The cache of ``request`` (read its lengths and state; do not mutate)."""
        self._check_open()
        cache = self._caches.get(request)
        if cache is None:
            raise ValueError(f"request {request.req_id}: has no KV cache in this manager (create() it first)")
        return cache

    def has_cache(self, request: Request) -> bool:
        """Whether ``request`` has a cache here (active or suspended)."""
        return request in self._caches

    def resume(self, request: Request) -> bool:
        """Admit a new cache (claim its cached prefix) or bring a suspended one back; False when refused."""
        cache = self.cache(request)
        if cache.is_active:
            raise ValueError(f"request {request.req_id}: cache is already active")
        if not cache.admitted:
            self._admit(cache)
            return True
        if self.resume_refusal(request) is not None:
            return False
        self._restore(cache)
        return True

    def preempt(self, request: Request) -> None:
        """Drop ``request``'s cache so it is recomputed later (its prefix stays cached for reuse); what it loses is
        recorded on it (``lost_tokens``, ``first_reused_tokens``)."""
        self.free(request)
        request.lost_tokens = max(request.lost_tokens, request.num_computed_tokens)
        if request.first_reused_tokens is None:
            request.first_reused_tokens = request.num_reused_tokens
        request.num_computed_tokens = 0
        request.num_reused_tokens = 0
        self.counters["preemptions"] += 1

    def fork(self, parent: Request, child: Request) -> bool:
        """Admit ``child`` (a sample of ``parent``'s prompt) holding the parent's computed prompt: blocks wholly in the
        prompt shared, the partial last block of each group copied into a fresh block; ``num_computed_tokens`` and
        ``num_reused_tokens`` are the prompt's length. False (nothing changed) when the copies do not fit.

        ``parent`` must be active with exactly its prompt committed (the step its prefill completes)."""
        src = self._active(parent)
        P = parent.num_prompt_tokens
        if src.committed != P or child.prompt_token_ids != parent.prompt_token_ids or child.salt != parent.salt:
            raise ValueError(f"request {child.req_id}: can fork only a just-computed prompt equal to its own, under "
                             f"its salt ({parent.req_id} has {src.committed} of {P} committed)")
        if child in self._caches:
            raise ValueError(f"request {child.req_id}: already has a KV cache")
        copies = {g.name: int(P % g.tokens_per_block != 0 and src.tables[g.name][P // g.tokens_per_block] >= 0)
                  for g in self._groups}
        if self.shortfall(copies) is not None:
            return False
        self._take_slabs([copies[g.name] for g in self._groups])
        if src.pending is not None:  # keyed lazily: hang the prompt in the tree so the child's path can run through it
            self._materialize(src.pending)
        cache = self.create(child)
        pages: dict[int, tuple[Any, list[int], list[int]]] = {}  # per pool tensor (a shared arena: one) its copies
        for g in self._groups:
            name, full = g.name, P // g.tokens_per_block
            pool, table = self._pool[name], src.tables[name]
            shared = table[:full]
            pool.incref_many([b for b in shared if b >= 0])
            own = list(shared)
            if copies[name]:
                # (tied, with KV events: the evictions sent as the page arena's take per cut sends them)
                b = (self._allocate_as_pages(name) if self._event_cuts and self.kv_events is not None
                     else pool.allocate(self._detach))
                tensor, got = self._pages_of(name, [b])
                _, to, of = pages.setdefault(id(tensor), (tensor, [], []))
                to += got
                of += self._pages_of(name, [table[full]])[1]
                own.append(b)
            elif P % g.tokens_per_block:
                own.append(-1)  # the window already let the partial block go
            cache.tables[name] = own
            cache.released[name] = min(src.released[name], len(own))
        for tensor, to, of in pages.values():  # the parent holds every source: no allocation above reused one
            _copy_pages(tensor, to, of)
        if self._reuse:
            keyed = P // self.T
            cache.keyed, cache.key_at = keyed, (keyed + 1) * self.T
            if keyed:
                assert src.last is not None, "an eagerly keyed parent's path holds its prompt's full blocks"
                cache.last = self._tree.claim(*self._tree.position(src.last, keyed - 1))
            elif self._lazy:
                self._add_latent(cache, pack_tokens(token_slice(child, 0, 1)))
        self._activate(cache, P, hit=False)
        return True

    def unfork(self, child: Request) -> None:
        """Undo :meth:`fork` before anything was computed (the scheduler refused the fork after building it)."""
        cache = self.cache(child)
        if cache.committed != cache.reused_tokens or cache.committed != child.num_prompt_tokens:
            raise ValueError(f"request {child.req_id}: only a just-forked cache can be undone")
        self.free(child)
        child.num_computed_tokens = child.num_reused_tokens = 0

    def cancel_admission(self, request: Request) -> None:
        """Undo an admission that computed nothing yet: drop the cache as if it had never been created."""
        cache = self.cache(request)
        if not cache.admitted or cache.committed != cache.reused_tokens or cache.host is not None:
            raise ValueError(f"request {request.req_id}: only a just-admitted cache can be cancelled")
        self.counters["reuse_hit_tokens"] -= cache.reused_tokens
        self.counters["reuse_partial_hits"] -= cache.partial_hit
        self.counters["reuse_query_tokens"] -= request.num_tokens if self._reuse and not request.skip_prefix_read \
            else 0
        self.free(request)
        request.num_computed_tokens = 0
        request.num_reused_tokens = 0

    # --- growth ----------------------------------------------------------------------------------

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Reserve slots for the next ``num_tokens`` tokens and count them in ``history``; False when no room.

        All-or-nothing: on False nothing changed.
        """
        cache = self._active(request)
        if num_tokens < 0:
            raise ValueError(f"request {request.req_id}: num_tokens must be >= 0, got {num_tokens}")
        target = cache.committed + num_tokens
        if target > request.num_tokens_with_drafts:
            raise ValueError(f"request {request.req_id}: cannot schedule {num_tokens} tokens from "
                             f"{cache.committed}; it has {request.num_tokens_with_drafts}")
        if target > cache.capacity and not self.resize(request, target):
            return False
        cache.history = max(cache.history, target)
        return True

    def resize(self, request: Request, capacity: int) -> bool:
        """Reserve (or give back) blocks so exactly ``capacity`` token slots are held; False when no room."""
        cache = self._active(request)
        if capacity < cache.history:
            raise ValueError(f"request {request.req_id}: capacity {capacity} is below history {cache.history}")
        if capacity > self.options.max_seq_len:
            raise ValueError(f"request {request.req_id}: capacity {capacity} exceeds max_seq_len="
                             f"{self.options.max_seq_len}")
        if self._arena is not None:  # a span's groups need the same blocks: check and take them per span
            per_span = self._span_need(cache, capacity)
            if all(k >= 0 for k in per_span):
                if sum(k * count for k, (_, count) in zip(per_span, self._spans, strict=True)) > self._arena.available:
                    return False
                self._take_shared(cache.tables, per_span)
                cache.capacity = capacity
                cache.room = min(len(cache.tables[first]) * tpb
                                 for first, (tpb, _) in zip(self._span_first, self._spans, strict=True))
                return True
        need = {g.name: math.ceil(capacity / g.tokens_per_block) - len(cache.tables[g.name]) for g in self._groups}
        if self.shortfall(need) is not None:
            return False
        self._take_slabs([need[g.name] for g in self._groups])
        for name, n in need.items():
            pool, table = self._pool[name], cache.tables[name]
            if n > 0:
                table.extend(pool.allocate_many(n, self._detach))
            while n < 0:  # shrinking: the tail blocks hold no committed token, so they were never cached
                b = table.pop()
                if b >= 0:
                    pool.decref(b, request.priority, True, self._detach)
                n += 1
        cache.capacity = capacity
        cache.room = min(len(cache.tables[name]) * tpb for name, tpb, _ in self._group_pools)
        return True

    def schedule_tokens(self, request: Request, want: int) -> int:
        """Reserve the most tokens, up to ``want``, that fit now (:meth:`fit_tokens` then :meth:`allocate`); how many.

        The scheduler's per-request call: one lookup, and when everything fits (the common case) no search.
        """
        cache = self._caches.get(request)
        if cache is None or cache.state is not CacheState.ACTIVE:
            return self.fit_tokens(request, want)  # raises the usual error
        committed = cache.committed
        # ``min(want, max_seq_len - committed, request.num_tokens_with_drafts - committed)`` with the properties
        # inlined: this runs for every running request every step, and the two property calls were most of its cost
        end = len(request.prompt_token_ids) + len(request.output_token_ids) + len(request.draft_token_ids)
        limit = self.options.max_seq_len
        if end > limit:
            end = limit
        if want > end - committed:
            want = end - committed
        if want <= 0:
            return 0
        target = committed + want
        if target > cache.room:  # some group needs a block (else the tables already hold the slots)
            reserve = self._reserve_split if self._arena is None else self._reserve_shared
            if not reserve(cache, target):  # not all of it fits now: search
                return self._fit_and_allocate(request, want)
        if target > cache.capacity:
            cache.capacity = target
        if target > cache.history:
            cache.history = target
        return want

    def schedule_decode(self, request: Request) -> int:
        """:meth:`schedule_tokens` of ``request``'s one pending token (its tokens are one past those computed): 1 when
        its slot is reserved, else 0.

        The scheduler's call for every decode every step: with the cache's committed tokens the request's computed
        ones, that one token is within the sequence, so only ``max_seq_len`` bounds it (no length read). That one
        token is pending is the caller's word, not checked: for a request with none it would reserve a slot past its
        tokens (``schedule_tokens`` answers 0), and a commit would then count a token the request does not have."""
        return self.schedule_decodes([request])

    def schedule_decodes(self, requests: list[Request]) -> int:
        """:meth:`schedule_decode` of each of ``requests`` in order until one answers 0 (that one changed nothing):
        how many got their slot, the first ones.

        Why one call for the step's decodes: the scheduler reserved them a call each, nearly every running request every
        step, each call paying its frame and the manager's attribute reads again (BENCHMARKS.md, "perfchunk60"); the
        manager's attributes are read once for them all."""
        caches, active, limit = self._caches, CacheState.ACTIVE, self.options.max_seq_len
        reserve = self._reserve_split if self._arena is None else self._reserve_shared
        for i, request in enumerate(requests):
            cache = caches.get(request)
            if cache is None or cache.state is not active or cache.committed != request.num_computed_tokens:
                if not self.schedule_tokens(request, 1):
                    return i
                continue
            target = cache.committed + 1
            if target > limit:
                return i
            # some group needs a block (else the tables hold the slot); none now: schedule_tokens' search for one
            if target > cache.room and not reserve(cache, target):
                if not self._fit_and_allocate(request, 1):
                    return i
                continue
            if target > cache.capacity:
                cache.capacity = target
            if target > cache.history:
                cache.history = target
        return len(requests)

    def _fit_and_allocate(self, request: Request, want: int) -> int:
        """The miss path of :meth:`schedule_tokens` and :meth:`schedule_decode`: not all of ``want`` fits at once, so
        search for the most that does (:meth:`fit_tokens`) and allocate it; how many. Only a miss pays the call."""
        n = self.fit_tokens(request, want)
        if n and not self.allocate(request, n):
            raise RuntimeError(f"request {request.req_id}: allocation of {n} tokens failed after fitting")
        return n

    def _reserve_split(self, cache: SequenceCache, target: int) -> bool:
        """Grow every group's table to hold ``target`` tokens when all of it fits now (else change nothing); whether
        it did. Pools per group: each group's new blocks against its own pool."""
        tables = cache.tables
        needs = []
        slabs = self._slabs
        for name, tpb, pool in self._group_pools:
            k = -(-target // tpb) - len(tables[name])
            if slabs is None and k > len(pool._free) + len(pool.evictable):  # pool.available, inlined (hot path)
                return False
            needs.append(k)
        detach = self._detach
        if slabs is not None:  # every group's blocks at once: the slabs they lack first
            if slabs.short(needs) is not None:
                return False
            self._take_slabs(needs)
        for (name, _, pool), k in zip(self._group_pools, needs, strict=True):
            if k > 0:
                tables[name].extend(pool.allocate_many(k, detach))
        cache.room = min(len(tables[name]) * tpb for name, tpb, _ in self._group_pools)
        return True

    def _reserve_shared(self, cache: SequenceCache, target: int) -> bool:
        """:meth:`_reserve_split` for a shared arena: the groups' new blocks together against the arena.

        Every group's table holds ``ceil(capacity / tokens_per_block)`` blocks (``check_invariants``), so
        the new blocks depend only on the block span: one sum per distinct span, not one per group.
        """
        capacity = cache.capacity
        total = 0
        for tpb, count in self._spans:
            total += (-(-target // tpb) + capacity // -tpb) * count
        if total:
            arena = self._arena
            assert arena is not None
            if total > len(arena._free) + len(arena.evictable):
                return False
            if total == self._row_pages and len(self._spans) == 1:  # a block for every group: a decode's boundary
                tables = cache.tables
                for name, b in zip(self._names, arena.take_one_each(self._share_index, self._detach_mixed),
                                   strict=True):
                    tables[name].append(b)
                # one span: the room below without the generator over the spans (a decode's boundary, every group)
                cache.room = len(tables[self._span_first[0]]) * self._spans[0][0]
                return True
            else:
                self._take_shared(cache.tables, [-(-target // tpb) + capacity // -tpb for tpb, _ in self._spans])
        tables = cache.tables
        cache.room = min(len(tables[first]) * tpb for first, (tpb, _) in zip(self._span_first, self._spans,
                                                                               strict=True))
        return True

    def _span_need(self, cache: SequenceCache, capacity: int) -> list[int]:
        """Per block span (``_spans``): blocks each of its groups needs for ``capacity`` (below 0: to give back).
        Every group's table holds ``ceil(capacity / tokens_per_block)`` blocks, so a span's groups need the same."""
        tables = cache.tables
        return [-(-capacity // tpb) - len(tables[first]) for first, (tpb, _) in zip(self._span_first, self._spans,
                                                                                      strict=True)]

    def _take_shared(self, tables: dict[str, list[int]], per_span: list[int]) -> None:
        """Extend every group's table by its span's count of new arena blocks (``per_span`` follows ``_spans``),
        in one :meth:`SharedPool.take_each` (the groups of one span share a life cycle: they grow together)."""
        arena = self._arena
        assert arena is not None
        one = len(per_span) == 1
        counts = [per_span[0]] * len(self._groups) if one else [per_span[s] for s in self._span_slot]
        pieces = arena.take_each(self._share_index, counts, self._detach, self._detach_mixed)
        for (name, _, _), piece in zip(self._group_pools, pieces, strict=True):
            if piece:
                tables[name] += piece

    def check_running(self, requests: Iterable[Request]) -> None:
        """``ValueError`` unless every request has an active cache here (the scheduler's guard, one pass)."""
        if not isinstance(requests, list | tuple):
            requests = list(requests)  # read twice below when the check fails
        if self._active_requests.issuperset(requests):  # at C speed: this runs every step over every running request
            return
        caches = self._caches
        for r in requests:
            cache = caches.get(r)
            if cache is None or cache.state is not CacheState.ACTIVE:
                raise ValueError(f"request {r.req_id} is in running but has no active KV cache; "
                                 "only the scheduler moves requests into running")

    def commit(self, request: Request, num_tokens: int) -> None:
        """The next ``num_tokens`` scheduled tokens have their KV written: advance, key full blocks, slide windows."""
        cache = self._caches.get(request)
        if cache is None or cache.state is not _ACTIVE:
            cache = self._active(request)  # raises the usual error
        committed = cache.committed + num_tokens  # (a local: this runs for every running request every step)
        if num_tokens < 0 or committed > cache.history:
            raise ValueError(f"request {request.req_id}: cannot commit {num_tokens} tokens; "
                             f"{cache.history - cache.committed} are scheduled")
        cache.committed = request.num_computed_tokens = committed
        if committed >= cache.key_at:  # a block just filled up (never true with reuse off)
            self._key_full_blocks(cache)  # (keys blocks: cache.committed stays)
        if self._sliding and committed >= cache.slide_at:  # some window may have a block to let go
            self._release_window(cache)

    def block_table(self, request: Request, group: str) -> list[int]:
        """Physical block per logical block of ``request`` in ``group``; -1 where a window released it."""
        cache = self._active(request)
        cut = self._cut_of.get(group)
        if cut is not None:  # a cut's pages of its logical group's blocks
            g, j = cut
            return self._arena.cut_tables(g, cache.tables[self._groups[g].name])[j]  # type: ignore[union-attr]
        if group not in cache.tables or self._cut_of:
            names = self._cut_of or cache.tables
            raise ValueError(f"no layer group {group!r}; groups: {', '.join(names)}")
        return list(cache.tables[group])

    def block_tables(self, request: Request) -> list[list[int]]:
        """Every group's block table, in ``layout.groups`` order: the manager's own lists, not copies.

        Read them before the next call into the manager and never modify them. The executor calls this
        for every request every step and compares the lists with the ones it holds (most steps change
        none), so copying them would cost more than the comparison: ~1 µs per list, 31 lists per request
        on Gemma 3 27B's shared arena.
        """
        cache = self._active(request)
        tables = cache.tables
        if self._tied_cuts is not None:  # each logical table as its cuts' page tables, kept in step (CutTables)
            readers = cache.cut_tables
            if readers is None:
                readers = cache.cut_tables = [CutTables(self._arena, i) for i in range(len(self._groups))]  # type: ignore[arg-type]
            return [t for g, reader in zip(self._groups, readers, strict=True) for t in reader.read(tables[g.name])]
        return [tables[g.name] for g in self._groups]

    def limit_reuse(self, group: str, check: Callable[[Request, int, int], bool]) -> None:
        """Reuse a cached prefix of length ``m`` only where ``check(request, m, block)`` holds, ``block`` being
        ``group``'s cached block that ends at ``m`` on the matched path: a caller that keeps state the blocks do not
        hold (DeepSeek V4's compressor overlap) keys it by that block. Whole blocks only: no partial block is claimed
        past such a length."""
        self._prefix_check = (group, check)

    def block_life(self, group: str, block: int) -> tuple[int, int | None, bool]:
        """``group``'s ``block``: how often it was handed out (what it holds is the same while this stays), the block
        position it holds in the radix tree or a pending prefix (None: in neither), and whether a request holds it."""
        pool = self._pool[group]
        return pool.gen[block], None if pool.node[block] is None else pool.pos[block], pool.ref[block] > 0

    def watch_moves(self, fn: Callable[[str, list[tuple[int, int]]], None]) -> None:
        """Call ``fn(group, [(old, new), ...])`` after :meth:`compact_slabs` moved blocks of ``group``: whoever keys
        something by a block (DeepSeek V4's snapshots) moves it along (``block_life`` of ``old`` still answers as
        before the move, ``new``'s gives the generation it has now)."""
        self._move_watchers.append(fn)

    def compact_slabs(self) -> int:
        """Pack every group's blocks in use into the fewest slabs of a slab arena, so the slabs they leave can serve
        another group; how many blocks moved (0 without a slab arena, or when every group is packed).

        Why: a request's used blocks of one group can sit one a slab (those it kept while others ran beside it), so a
        request alone may find no slab for another group's next block although its worst case fits the arena (the
        stall bughunt54 pinned). Each move copies the block's page into a free block of a kept slab (else a cached
        one, evicted) and hands every reference over: the request tables, the block's radix run (or tail, or pending
        prefix), private copies noted for a position. The scheduler calls it only where it would otherwise report a
        request that runs alone as unable to grow, so no other decision changes."""
        slabs = self._slabs
        if slabs is None:
            return 0
        assert self.host is None and not any(self._write_back.values()), "a slab arena has no host tier"
        moved = 0
        for g in self._groups:
            name, pool = g.name, self._pool[g.name]
            assert isinstance(pool, SlabPool)
            pairs = pool.packing_moves(self._detach)
            if not pairs:
                continue
            _copy_pages(self.pools.tensors[name], [new for _, new in pairs], [old for old, _ in pairs])
            to = dict(pairs)
            node, pos = pool.node, pool.pos
            for old, new in pairs:
                run = node[old]
                if run is not None:
                    run.blocks[name][pos[old] - run.start] = new
            for cache in self._caches.values():
                if cache.is_active:
                    table = cache.tables[name]
                    if any(b in to for b in table):
                        table[:] = [to.get(b, b) for b in table]
            pool.move(pairs)
            copies = self._copies[name]
            if copies:  # keyed by a position's block, each copy with its generation (a moved one's: its new place's)
                gen = pool.gen  # (a moved block's old generation is unchanged: a live copy still matches it)
                moved_copies = {to.get(b, b): [(to[c], gen[to[c]]) if c in to and gen[c] == v else (c, v)
                                               for c, v in got] for b, got in copies.items()}
                copies.clear()
                copies.update(moved_copies)
            moved += len(pairs)
            slabs.counters["blocks_moved"] += len(pairs)
            for fn in self._move_watchers:
                fn(name, pairs)
        return moved

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: the radix tree is emptied and every block of every group is free.

        Refused (``PrefixCacheInUseError``) while any request has a cache here, active or suspended: their
        paths run through the tree, and a suspended one may take cached blocks back on resume.
        """
        self._check_open()
        if self._caches:
            raise prefix_cache_in_use([r.req_id for r in self._caches])
        for pool, _ in self._pool_sets:
            pool.reset()
        self._tree = self._new_tree()
        for copies in self._copies.values():
            copies.clear()
        if self.kv_events is not None:
            self.kv_events.cleared()

    # --- reporting -------------------------------------------------------------------------------

    def _fixed_stats(self) -> tuple[int, int, str | None]:
        """What never changes after construction: pool bytes, host bytes, the memory line (computed once)."""
        if self._stats_fixed is None:
            slabs = self._slabs
            if slabs is not None:
                total = slabs.num_slabs * slabs.slab_bytes
                memory = (f"memory: a slab arena of {slabs.num_slabs:,} slabs of {slabs.slab_bytes:,} B that the "
                          "groups take as they grow and give back once free (pool_arena); no group's share is fixed")
            else:
                total = self.layout.pool_bytes(self.pools.num_blocks)
                memory = self.layout.memory_text(self.pools.num_blocks, self.options.max_seq_len)
            self._stats_fixed = (total, self.host.nbytes if self.host is not None else 0, memory)
        return self._stats_fixed

    def usage(self) -> float:
        """``stats().usage`` alone: used bytes over pool bytes, every group weighted by its block's bytes (with
        Gemma 3 27B's 31 groups, a tenth of what building the whole stats costs)."""
        self._check_open()
        total_bytes = self._fixed_stats()[0]
        used_bytes = sum(pool.num_used * g.bytes_per_block for g, (_, _, pool) in zip(self._groups, self._group_pools,
                                                                                      strict=True))
        return used_bytes / total_bytes if total_bytes else 0.0

    def stats(self) -> ManagerStats:
        """Usage, per-group free/evictable/used blocks, host slots, reuse hits in tokens, suspends/resumes."""
        self._check_open()
        groups = {}
        used_bytes = 0
        for g in self._groups:
            pool = self._pool[g.name]
            groups[g.name] = GroupStats(total=pool.num_blocks, free=pool.num_free, evictable=pool.num_evictable,
                                        used=pool.num_used,
                                        usage=pool.num_used / pool.num_blocks if pool.num_blocks else 0.0,
                                        evictions=pool.evictions, tokens_per_block=g.tokens_per_block,
                                        shared=self.layout.shared,
                                        slabs=pool.owned if isinstance(pool, SlabPool) else None)
            used_bytes += pool.num_used * g.bytes_per_block
        if self._tied_cuts is not None:  # per cut, as the page arena of the cuts counts them (a logical block is a page
            groups = self._cut_stats()  # of each cut): the same figures, evictions summed over cuts included
        total_bytes, host_bytes, memory = self._fixed_stats()  # stats runs every step in a driver
        host = None
        if self.host is not None:
            host = {name: HostStats(total=n, used=self.host.num_used(name))
                    for name, n in self.host.num_slots.items()}
        active = sum(1 for c in self._caches.values() if c.is_active)
        c = self.counters
        return ManagerStats(
            kind="v2",
            usage=used_bytes / total_bytes if total_bytes else 0.0,
            groups=groups,
            requests=len(self._caches),
            active=active,
            suspended=len(self._caches) - active,
            reuse_hit_tokens=c["reuse_hit_tokens"],
            reuse_query_tokens=c["reuse_query_tokens"],
            reuse_partial_hits=c["reuse_partial_hits"],
            evictions=sum(g.evictions for g in groups.values()),
            suspends=c["suspends"],
            resumes=c["resumes"],
            preemptions=c["preemptions"],
            host=host,
            host_bytes=host_bytes,
            reuse=ReuseStats(enabled=self._reuse, disabled_reason=self.reuse_off_reason,
                             unit_tokens=self.reuse_unit if self._reuse else None, partial=self._partial,
                             partial_disabled_reason=self.partial_off_reason, radix_nodes=self._tree.num_nodes),
            memory=memory,
            arena=None if self._slabs is None else {
                "slabs": self._slabs.num_slabs, "free_slabs": len(self._slabs.free),
                "slab_bytes": self._slabs.slab_bytes, **self._slabs.counters},
        )

    def _cut_stats(self) -> dict[str, GroupStats]:
        """``stats().groups`` with the cuts tied: per cut, the arena's pages as total and free, and its logical
        group's used, cached and evicted blocks (each one page of the cut)."""
        arena = self._arena
        assert isinstance(arena, TiedArena)
        total, free = arena.num_pages, len(arena._free)
        out = {}
        for i, cuts in enumerate(self._tied_cuts or ()):
            used = arena.used[i]
            for name in cuts:
                out[name] = GroupStats(total=total, free=free, evictable=arena.cached[i], used=used,
                                       usage=used / total if total else 0.0, evictions=arena.evicted[i],
                                       tokens_per_block=self._groups[i].tokens_per_block, shared=True, slabs=None)
        return out

    def close(self) -> None:
        """Release the device pools and the host tier (idempotent); the manager is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        self._caches.clear()
        self._active_requests.clear()
        self._tree = self._new_tree()
        if self.host is not None:
            self.host.release()
        self.pools.release()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    # --- internals -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("KVCacheManagerV2 is closed")

    def _active(self, request: Request) -> SequenceCache:
        cache = self.cache(request)
        if not cache.is_active:
            raise ValueError(f"request {request.req_id}: cache is suspended; resume() it first")
        return cache

    def _new_tree(self) -> RadixTree:
        """An empty radix tree over this manager's pools (a split rewrites their block -> run lists)."""
        return RadixTree({g.name: (self._pool[g.name].node, self._pool[g.name].pos) for g in self._groups})

    def _admit(self, cache: SequenceCache,
               found: tuple[int, RadixNode | None, tuple[RadixNode | None, int]] | None = None) -> None:
        """First resume: claim the longest usable cached prefix (plus a partial block), activate. A request that
        reads no cached prefix (``skip_prefix_read``) claims nothing but is keyed as any other: its full blocks join
        the tree where no block of the same prefix is cached yet (``_key_full_blocks`` keeps one that is).

        ``found``: what :meth:`probe_hit` looked up for this request in the same call, nothing changed since (the
        usable prefix, the run its path ends at, already split there, and the partial block's source): not looked
        up again (:meth:`_unprobed`)."""
        request, T = cache.request, self.T
        m = 0
        if self._reuse:
            skip = request.skip_prefix_read
            if not skip:  # one that reads nothing asked the cache nothing
                self.counters["reuse_query_tokens"] += request.num_tokens
            first = first_packed(request)
            prefix = self._tree.pending_prefix(request.salt, first) if found is None else None
            if prefix is not None:  # a prefix that starts like this one: in the tree before the lookup (and keying)
                self._materialize(prefix)
            miss = found is None and self._cheap_miss(request, first)  # (the probe's lookup found something)
            if miss or skip:  # nothing to claim, whole or partial: skip the lookups
                cache.last = None
                cache.keyed = 0
                cache.key_at = T
                if self._lazy and first:
                    # noted as pending only where no run starts with its first token (a miss of two or more tokens
                    # has none; a skipping request may have one, and then keys eagerly like a request that hit)
                    if self.kv_events is None and (request.salt, first) not in self._tree.latent and (
                            (miss and request.num_tokens >= 2) or not self._starts_cached(request, first)):
                        cache.pending = PendingPrefix(request.salt, first, request, cache, 8 * T)
                        self._tree.add_pending(cache.pending)
                        cache.key_at = NEVER
                    else:
                        self._add_latent(cache, first)
                self._activate(cache, 0)
                return
            if found is None:
                m, run, i = self._match(request)
                source = None
            else:  # the probe's: its path's last run ends at the prefix's last position
                m, run, source = found
                i = 0
            cache.last = None
            if m:  # else nothing matched: the tables stay as create() left them
                assert run is not None
                run, i = self._tree.position(run, m // T - 1)
                if self._arena is not None and self._unit_spans:  # one pass over the groups (its docstring)
                    self._claim_arena_path(cache, run, m)
                else:
                    # each group's pool claims its blocks; on a shared arena the claims collect them, then every
                    # group's are claimed in one pass (the paths are only read in the loop; 31 calls on Gemma 3 27B),
                    # and only then go into the tables: a table never holds a block unclaimed, and an interrupted loop
                    # leaves nothing
                    got: list[tuple[str, int, list[int]]] = []
                    for name, tpb, step, window, claim in self._claim_steps:
                        lo = 0 if window is None else max(0, m - window + 1) // tpb
                        along = self._tree.path_blocks(run, i + run.start + 1, name)
                        claimed = along[lo:] if step == 1 else [along[(j + 1) * step - 1] for j in range(lo, m // tpb)]
                        if claim is None:
                            got.append((name, lo, claimed))
                            continue
                        claim(claimed)
                        cache.tables[name] = [-1] * lo + claimed
                        cache.released[name] = lo
                    if got:
                        self._arena.incref_groups(self._share_index, [claimed for _, _, claimed in got])  # type: ignore[union-attr]
                        for name, lo, claimed in got:
                            cache.tables[name] = [-1] * lo + claimed
                            cache.released[name] = lo
                cache.last = self._tree.claim(run, i)
            cache.keyed = m // T
            cache.key_at = (m // T + 1) * T
            if self._lazy and not cache.keyed and first:
                self._add_latent(cache, first)
            if self._partial and self._prefix_check is None:  # a limited prefix ends where its caller's state does
                m += self._claim_partial_fn(self, cache, m, source)
        self._activate(cache, m)

    def _claim_arena_path(self, cache: SequenceCache, last: RadixNode, m: int) -> None:
        """:meth:`_admit`'s claim of the cached path ending at ``last`` (``m`` tokens, whole blocks) on a shared
        arena whose every group block spans one token block: each group's blocks from its window's first position,
        claimed in one :meth:`SharedPool.incref_groups` and only then put in the tables, as the per-group loop does.

        Why: the loop walked the path and built each group's claim and table in Python (31 groups on Gemma 3 27B,
        every hit); here the path is walked once and the groups are passed over at C speed."""
        arena, names, n = self._arena, self._names, m // self.T
        assert arena is not None
        # per life cycle, the first position its groups claim (a window's start), then per group
        los = [0 if g.window is None else max(0, m - g.window + 1) // self.T for g, _ in self._cycles]
        lo_of = list(map(los.__getitem__, self._cycle_of))
        runs = [last]  # the path's runs, root side last (the root's child is the first)
        while runs[-1].parent is not None and runs[-1].parent.parent is not None:
            runs.append(runs[-1].parent)  # type: ignore[arg-type]
        if len(runs) == 1:  # the usual: one run from the root
            along_of = list(map(last.blocks.__getitem__, names))
        else:  # every run's blocks root side first; positions past the path's end are cut by the slice below
            runs.reverse()
            dicts = list(map(attrgetter("blocks"), runs))
            along_of = list(map(list, map(chain.from_iterable, map(map, map(itemgetter, names), repeat(dicts)))))
        claimed_of = list(map(getitem, along_of, map(slice, lo_of, repeat(n))))
        arena.incref_groups(self._share_index, claimed_of)
        tables = list(map(add, map(mul, repeat([-1]), lo_of), claimed_of))
        cache.tables.update(zip(names, tables, strict=True))
        cache.released.update(zip(names, lo_of, strict=True))

    def _materialize(self, prefix: PendingPrefix) -> None:
        """Hang a pending prefix in the tree as keying it all along would have (lazy keying: radix module doc)."""
        tree, T = self._tree, self.T
        tree.drop_pending(prefix)
        tree.version += 1  # its runs and blocks go in the tree (a lookup's memo: RadixTree.version)
        cache = prefix.cache
        if cache is not None:  # still running: key its full blocks now, and from now on as they fill
            cache.pending = None
            cache.key_at = T
            if cache.committed >= T:
                self._key_full_blocks(cache)
                if prefix.held:  # blocks that left its window: at their positions on its path
                    for name, _, owner, _ in self._attach_steps:
                        for j, b in enumerate(prefix.blocks[name]):
                            if b >= 0:
                                run, i = tree.position(cache.last, j)  # type: ignore[arg-type]
                                run.blocks[name][i] = b
                                run.held[i] += 1
                                owner[b] = run
            else:  # (nothing left a window: only full committed blocks do)
                self._add_latent(cache, prefix.first)
            return
        held = prefix.held
        full = n = len(held) - (prefix.tail > 0)
        while n and not held[n - 1]:
            n -= 1
        run = None
        if n:
            run, segs = tree.extend(None, prefix.salt, pack_tokens(token_slice(prefix.request, 0, n * T)), T)  # type: ignore[arg-type]
            assert segs == [(run, 0, n)], "a pending prefix's first token starts no run"
            counts = run.held
            if self._one_owner is not None:  # a shared arena of one-block spans: a group without holes in bulk
                self._hang_parked(run, prefix, n)
            else:
                for name, _, owner, _ in self._attach_steps:
                    dst = run.blocks[name]
                    for i, b in enumerate(prefix.blocks[name][:n]):
                        if b >= 0:
                            dst[i] = b
                            owner[b] = run  # its position (pos[b] == i) stays
                            counts[i] += 1
        if prefix.tail and held[full]:  # its parked partial last block: the run's tail, or loose if the run ends early
            # (with no run: a parent of its own, outside the tree, as a removed run is for a tail it left loose)
            parent = run if run is not None else RadixNode(None, prefix.salt, 0, (), 0)
            tail = self._hang_tail(parent, prefix.request, full, prefix.tail,  # type: ignore[arg-type]
                                   {name: prefix.blocks[name][full] for name in self._names})
            if run is not None and n == full:
                run.tail = tail
            else:
                tree.loose.add(tail)
        if run is not None:
            tree.leave(run)  # nobody's path: trimmed like any unused run

    def _activate(self, cache: SequenceCache, m: int, hit: bool = True) -> None:
        """Admission's end: ``m`` tokens are cached (a prefix-cache hit, unless ``hit`` is false: a fork); the cache
        becomes active and its window is released."""
        request = cache.request
        self._tree.looked.pop(request, None)  # its tokens grow from now on: a lookup's kept answer goes with them
        cache.committed = cache.history = cache.capacity = m
        cache.state = CacheState.ACTIVE
        self._active_requests.add(request)
        self._count_worst(cache, 1)
        cache.admitted = True
        cache.reused_tokens = m
        request.num_computed_tokens = m
        request.num_reused_tokens = min(m, request.num_prompt_tokens)
        # running, it is looked up no more (a preemption's lookups pack it again): 8 bytes a token not kept for its
        # whole run (rev61: 256 running requests of 32k tokens held 64 MiB)
        request.packed_ids = b""
        if hit:
            self.counters["reuse_hit_tokens"] += m
        self._release_window(cache)

    def _claim_partial(self, cache: SequenceCache, m: int, source: tuple[RadixNode | None, int] | None = None) -> int:
        """Copy the best partially matching next block into fresh blocks (copy-on-write); tokens gained. Pools of
        their own (a shared arena takes :meth:`_claim_partial_arena`). ``source``: :meth:`_partial_source`'s answer,
        where the caller has it."""
        request = cache.request
        best, best_k = (self._partial_source(request, cache.last if m else self._tree.root(request.salt), m)
                        if source is None else source)
        if best is None:
            return 0
        src_of = {g.name: best.blocks[g.name][0] for g in self._groups}
        for g in self._groups:  # hold the source so our own allocation cannot evict it
            self._pool[g.name].incref(src_of[g.name])
        gained = 0
        if self.shortfall({g.name: 1 for g in self._groups}) is None:
            self._take_slabs([1] * len(self._groups))
            fresh = [self._pool[g.name].allocate(self._detach) for g in self._groups]
            for g, b in zip(self._groups, fresh, strict=True):
                src = src_of[g.name]
                self.pools.tensors[g.name][:, b].copy_(self.pools.tensors[g.name][:, src])
                cache.tables[g.name].append(b)
            gained = best_k
            cache.partial_hit = True
            self.counters["reuse_partial_hits"] += 1
        for g in self._groups:
            pool, src = self._pool[g.name], src_of[g.name]
            pool.decref(src, pool.priority[src], True, self._detach)
        return gained

    def _claim_partial_arena(self, cache: SequenceCache, m: int,
                             source: tuple[RadixNode | None, int] | None = None) -> int:
        """:meth:`_claim_partial` on a shared arena (``_claim_partial_fn``): the source's block of every group held and
        let go in one pass each (:meth:`SharedPool.incref_each`, :meth:`SharedPool.decref_each`), the room check one
        comparison (a page a group against the arena's free or evictable: one pool set), the pages taken in one
        :meth:`SharedPool.take_one_each`. The same blocks, counts and queue order as the per-group calls (on Gemma 3
        27B, 31 of each a partial hit)."""
        request = cache.request
        best, best_k = (self._partial_source(request, cache.last if m else self._tree.root(request.salt), m)
                        if source is None else source)
        if best is None:
            return 0
        arena, blocks, index = self._arena, best.blocks, self._share_index
        assert arena is not None
        srcs = [blocks[name][0] for name in self._names]
        arena.incref_each(index, srcs)  # hold the source so our own allocation cannot evict it
        gained = 0
        if self._row_pages <= arena.available:  # a page of each group's new block (its pages, tied)
            fresh = arena.take_one_each(index, self._detach_mixed)
            # every group's tensor is the one arena: all pages in one go
            _copy_pages(*self._pages_of(self._names[0], fresh), self._pages_of(self._names[0], srcs)[1])
            tables = cache.tables
            for name, b in zip(self._names, fresh, strict=True):
                tables[name].append(b)
            gained = best_k
            cache.partial_hit = True
            self.counters["reuse_partial_hits"] += 1
        arena.decref_each(index, srcs, list(map(arena.priority.__getitem__, srcs)))
        return gained

    def _partial_source(self, request: Request, parent: RadixNode | None, m: int) -> tuple[RadixNode | None, int]:
        """The run whose first block :meth:`_claim_partial` would copy after a claimed prefix of ``m`` tokens ending
        at ``parent`` (the root when ``m`` is 0), and the tokens it shares; (None, 0) when there is none.

        The candidates are the first positions of the children of the run the cache's claimed path ends at
        (:meth:`RadixTree.claim` split it there): a node per block's children, exactly."""
        if parent is None or request.num_tokens < 2:  # nothing cached, or nothing to match (_match's limit)
            return None, 0
        limit = min(self.T - 1, request.num_tokens - 1 - m)
        if limit < 1:  # nothing a partial block could add
            return None, 0
        # the request's tokens [m, m + T) packed: a slice of its packed ids (kept: packed_prefix), not packed again.
        # Why: a refused head's probe asks this every step it waits (BENCHMARKS.md "perf66b")
        end = min(m + self.T, request.num_tokens)
        want = packed_prefix(request, end)[8 * m:8 * end]
        best, best_k = None, 0
        groups = len(self._groups)
        # An indexed node (many children, e.g. every cached prompt after a common BOS): the earliest child with the
        # longest match shares two tokens if any does, so only those are compared; else every child that shares the
        # first token is (any other shares no token). A leaf run (a history's last run) has none to look at.
        two = parent.children_sharing_two(want) if self._partial_unit == 1 and limit >= 2 else None
        for child in (two if two is not None else parent.children_starting_with(token_slice(request, m, m + 1)[0])
                      if parent.children else ()):
            if child.held[0] != groups:
                continue
            k = min(common_prefix(child.block(0), want), limit)
            k -= k % self._partial_unit
            if k > best_k:
                best, best_k = child, k
        tail = parent.tail
        if tail is not None and tail.held[0] == groups and tail.adjacent():  # a finished history's partial block
            k = min(limit, tail.valid)
            # the tokens shared, at most k: k itself where the first k are equal (a follow-up turn on its history's
            # tail: the usual), compared as bytes at once; else counted
            if tail.tokens[:8 * k] != want[:8 * k]:
                k = min(common_prefix(tail.block(0), want), k)
            k -= k % self._partial_unit
            if k > best_k:
                best, best_k = tail, k
        if best is None and two is not None:  # none shares two: the earliest that shares the first one, by one token
            best = next((c for c in parent.children_starting_with(token_slice(request, m, m + 1)[0])
                         if c.held[0] == groups), None)
            best_k = 1
        return best, best_k


