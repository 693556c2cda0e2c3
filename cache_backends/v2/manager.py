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
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Container, Iterable, Iterator
from itertools import chain, compress, repeat, takewhile
from operator import add, attrgetter, eq, getitem, itemgetter, mul, not_, or_, sub, truth
from typing import Any

import attrs
import torch

from cache_backends.hashing import pack_tokens
from cache_backends.interface import ManagerOptions, prefix_cache_in_use
from cache_backends.kv_events import REMOVED, STORED, KvEventBuffer
from cache_backends.layout import KvLayout, LayerGroup, cut_families, longest, tied_groups
from cache_backends.pools import BlockPools, even_run, move_pages
from cache_backends.request import Request
from cache_backends.reuse import partial_reuse_off_reason, partial_reuse_unit, reuse_unit
from cache_backends.stats import GroupStats, HostStats, ManagerStats, ReuseStats
from cache_backends.v2.group_pool import EvictionQueue, GroupPool
from cache_backends.v2.host_tier import HostTier, host_slots
from cache_backends.v2.radix import PendingPrefix, RadixNode, RadixTree, TailRun
from cache_backends.v2.sequence import NEVER, CacheState, SequenceCache
from cache_backends.v2.shared_pool import GroupShare, SharedPool, interleave
from cache_backends.v2.slab_pool import SlabArena, SlabPool
from cache_backends.v2.tied_pool import CutTables, TiedArena, TiedShare

#: Whether the V2 manager ties a shared arena's cuts of one group (``layout.share_pages`` cuts a group whose layers
#: outnumber a page's, e.g. Gemma 3 27B: 52 sliding + 10 full layers as 31 groups of 2-layer pages) into one logical
#: group whose block owns a page per cut (``cache_backends.v2.tied_pool``): the manager then walks 2 block tables a
#: request, not 31, at about V1's CPU (BENCHMARKS.md "tie57d", "tie58b"). Its decisions, KV events and host tier are
#: the page arena's (each cut its own group, evicting whole rows: ``SharedPool``); False runs that page arena, the
#: reference the tie is checked against (``tests/test_kv_v2_tied*.py``).
TIE_CUTS = True


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


def _tokens(request: Request, start: int, end: int) -> list[int]:
    """``request.all_token_ids[start:end]`` without concatenating the whole sequence."""
    prompt = request.prompt_token_ids
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return request.output_token_ids[start - n : end - n]
    return prompt[start:] + request.output_token_ids[: end - n]


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


_SALT = attrgetter("salt")
_ACTIVE = CacheState.ACTIVE  # (one global read, not two: commit reads it for every running request every step)
_FIRST_TOKEN = itemgetter(slice(0, 8))  # a run's first block's packed bytes -> its first token's
#: where events go out as they happen (no tie, or no events): a reusable no-op context
_AS_IT_GOES = contextlib.nullcontext()
#: a KV event of the tie's logical group, its cuts' names not yet given: (group, kind, keys or stored stretches,
#: tokens per block) (``KVCacheManagerV2._cut_by_cut``)
_Heard = tuple[str, str, Any, int]


def _first_packed(request: Request) -> bytes:
    """``pack_tokens(_tokens(request, 0, 1))`` (``b""`` for a request without tokens) in one call: every lookup of a
    waiting request starts with it, every step it waits."""
    packed = request.packed_ids
    if not packed:  # kept: a waiting request ruled out by it is asked again at every relook (_packed renews it)
        packed = request.packed_ids = pack_tokens((request.prompt_token_ids or request.output_token_ids)[:1])
    return packed[:8]


def _packed(request: Request, end: int) -> bytes:
    """``pack_tokens(_tokens(request, 0, end))``, or a longer run of the request's leading tokens packed: kept on the
    request (``packed_ids``) and packed again only when a lookup needs more of it. Why: a waiting turn's history,
    packed by each lookup, cost ~6% of V2's KV work on Gemma 3 27B multi-turn at a quarter of the budget (looked up
    twice a step, by the cache-aware order and the admission probe, every step it waits; BENCHMARKS.md "pack61")."""
    packed = request.packed_ids
    if len(packed) < 8 * end:
        packed = request.packed_ids = pack_tokens(_tokens(request, 0, request.num_tokens))
    return packed


def _common_prefix(a: bytes, b: bytes) -> int:
    """How many token ids two packed runs (8 bytes each) share at the start."""
    # equal bytes, equal ids; counted at C speed (the leading Trues of a pairwise comparison): a partial match compares
    # up to T - 1 ids with every candidate run, each waiting turn of a conversation, every step it is looked up
    return sum(takewhile(truth, map(eq, memoryview(a).cast("q"), memoryview(b).cast("q"))))


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
    # (counted in ``taken``); None: no copy
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
        return cls(n, _packed(request, n * T)[:8 * n * T], stop, off, hit, _parts(run, i, n, blocks))

    def decides(self, request: Request, blocks: int, T: int) -> bool:
        """Whether ``request`` (of ``blocks`` whole blocks to look up) walks as this walk did."""
        n, stop = self.n, self.stop
        if blocks != n if stop is None else blocks <= n:
            return False
        packed = _packed(request, blocks * T)  # (the request's own, kept: its walk reads it too)
        if not packed.startswith(self.head):
            return False
        if stop is None:
            return True
        w = 8 * T
        block = packed[n * w:(n + 1) * w]
        if self.off < 0:
            return block not in stop.children
        return stop.tokens[self.off * w:(self.off + 1) * w] != block


class KVCacheManagerV2:
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
        self._span_first = [next(g.name for g in self._groups if g.tokens_per_block == tpb) for tpb in spans]
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

    def free(self, request: Request) -> None:
        """Close ``request``'s cache: device blocks released (cached ones stay reusable), host slots freed.

        A request without a cache is ignored, so finishing a never-admitted request is safe.
        """
        self._check_open()
        cache = self._caches.pop(request, None)
        request.packed_ids = b""  # finished: no lookup reads it again (its bytes stay only as long as the request)
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
                    and old.block(0)[:8 * r] == pack_tokens(_tokens(cache.request, n * T, n * T + r)):
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
        tail.tokens += pack_tokens([*_tokens(request, n * T, n * T + r), *[0] * (T - r)])
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
                self._add_latent(cache, pack_tokens(_tokens(child, 0, 1)))
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

    # --- admission, asked before anything is built ------------------------------------------------------------------
    # A request that can claim no cached prefix would start from an empty cache: what create + resume + fit_tokens
    # (and growth_blocks, growth_bound) would say then follows from the pools alone. The scheduler asks these first,
    # so an admission that fails (a long prompt waiting for room, every step under pressure) builds and tears down
    # nothing; the answers equal the built path's (tests/test_kv_v2_scheduler.py checks them side by side).

    def claims_nothing(self, request: Request) -> bool:
        """Whether admitting ``request`` now would claim no cached block, whole or partial: prefix reuse is off, the
        request reads no cached prefix (``skip_prefix_read``), or no cached run and no pending prefix of its scope
        starts with its first token (:meth:`_admit`'s cheap miss)."""
        if not self._reuse or request.skip_prefix_read:
            return True
        first = _first_packed(request)
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
            key = (request.salt, _packed(request, blocks * T)[:8 * T])
            for walk in memo.get(key, ()):
                if walk.decides(request, blocks, T):
                    return walk.hit, walk.branch
        first = _first_packed(request)
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

    def may_find_prefix(self, requests: list[Request]) -> list[bool]:
        """Per request, False where :meth:`cached_prefix_tokens` would answer 0 from its first token alone: no run
        hung under its salt, and no pending prefix of it, starts with that token (the lookup's cheap miss); True
        where only a lookup answers. Claims nothing and changes nothing.

        Why: a cache-aware pass looks up many waiting requests whose prompts share nothing cached (a miss looked up
        again: unrelated long prompts); each lookup's own calls to reach its cheap miss cost more than the check,
        which this does for them all against the first tokens of the salt's runs (BENCHMARKS.md, "relook44")."""
        if not self._reuse:
            return [False] * len(requests)
        firsts = list(map(_first_packed, requests))
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
            runs = set(map(_FIRST_TOKEN, root.children))
        may = map(runs.__contains__, firsts)
        return list(map(or_, may, map(pending.__contains__, firsts)) if pending else may)

    def probe_hit(self, request: Request, build: bool = False) -> HitProbe | None:
        """What :meth:`create` + :meth:`resume` would claim for ``request`` now (a whole-block cached prefix), found
        without claiming it, for the estimates (``start``/``probe`` arguments) and :meth:`refuse_hit`; None where
        only building it answers: a partial block to copy (it allocates, and may evict), a whole-block hit on a
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
        first = _first_packed(request)
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
        last = tree.claim(*tree.position(run, m // T - 1))  # the build's split; its user is given back at once
        tree.leave(last)
        partial, k = None, 0
        if self._partial and self._prefix_check is None:  # a copy follows (a limited prefix, DeepSeek V4's: none)
            partial, k = self._partial_source(request, last, m)
            # probed only where building and cancelling it leaves no more changed than refuse_hit redoes: the copy's
            # source is the history's partial last block (the cancel's finish keeps it as it is: _keep_tail) and every
            # group has a free block (the copy takes it, evicting nothing; the cancel puts it back). Why: a follow-up
            # turn ends its history inside a block, so under pressure its refused head was built and cancelled every
            # step (tiny-llama multi-turn at a quarter of the budget: a quarter of V2's work)
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
            shared_taken = [arena.evictable.count_shared(list(chain.from_iterable(cached_of))) + evicted_shared]
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
            shared_taken = [pool.evictable.count_shared(cached)
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
                self._add_latent(cache, pack_tokens(_tokens(request, 0, 1)))
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
        was. So a refused hit keeps its history warm (young in the queue), as it did when it was built."""
        priority = request.priority
        last = probe.last
        if last is None:  # an empty claim: building and cancelling it leaves nothing changed
            return
        if probe.partial is not None:
            (self._refuse_copy if self._arena is None else self._refuse_copy_tied)(probe, priority)
            return
        leaves_of, shared_of = self._requeue_order(probe)
        if self._arena is not None:
            self._arena.evictable.requeue(interleave(leaves_of), interleave(shared_of), priority)
            return
        for (_, _, pool), leaves, shared in zip(self._group_pools, leaves_of, shared_of, strict=True):
            pool.evictable.requeue(leaves, shared, priority)

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
        what the build and the cancel do to the pools and the tree, in their order, less the claim's per-block work.
        The claim's cached blocks leave the queue and its path gains a user; the copy holds its source in every group,
        takes a block of each (a free one, else evicting the oldest queued: the same blocks and evictions), lets go of
        the sources (queued again as the youngest of their priority); the cancel puts each copy back on the free list,
        queues the claim's blocks as its release does (split by the runs' shapes after those evictions) and lets go
        of the path. (The claim's blocks leave the queue and come back in Python loops, not in
        ``EvictionQueue.requeue``'s C passes, which take twice the CPU for a history of 25 blocks: timeit, 12 against
        5-7 µs; and only so may an eviction or a stale demotion meet the queue as the build leaves it.)"""
        groups, tree, detach = self._group_pools, self._tree, self._detach
        last, source = probe.last, probe.partial
        assert last is not None and source is not None
        sources = [source.blocks[name][0] for name, _, _ in groups]
        for (_, _, pool), (blocks, refs, _) in zip(groups, probe.claimed, strict=True):
            pool.evictable.remove_many(list(compress(blocks, map(not_, refs))))  # as the claim's incref_many
        held = tree.claim(last, len(last.held) - 1)  # the path ends at the run's end: no split
        for (_, _, pool), src in zip(groups, sources, strict=True):
            pool.incref(src)
        copies = [pool.allocate(detach) for _, _, pool in groups]
        for (_, _, pool), src in zip(groups, sources, strict=True):
            pool.decref(src, pool.priority[src], True, detach)
        leaves_of, shared_of = self._requeue_order(probe)
        for (_, _, pool), b, leaves, shared in zip(groups, copies, leaves_of, shared_of, strict=True):
            pool.release((b,), priority, True, detach)  # the release's first block: the copy, to the free list
            if leaves:
                pool.evictable.add_many(leaves, priority)
            if shared:
                pool.evictable.add_many(shared, priority, True)
        tree.leave(held)

    def _refuse_copy_tied(self, probe: HitProbe, priority: int) -> None:
        """:meth:`_refuse_copy` with the cuts tied: the claim's cached blocks out of the queue group by group (its
        ``incref_groups``), the path claimed, the source held, a logical block of every group taken (evicting as the
        build's take), the source let go, then the cancel's release: the copies freed, the claim queued position by
        position (``TiedArena.release_tables``' order), the path let go. References and counts end as they were."""
        arena, tree, index = self._arena, self._tree, self._share_index
        last, source = probe.last, probe.partial
        assert isinstance(arena, TiedArena) and last is not None and source is not None
        queue, k = arena.evictable, arena.k
        for (blocks, refs, _), i in zip(probe.claimed, index, strict=True):  # (a group's blocks weigh its k pages)
            queue.remove_weighing(list(compress(blocks, map(not_, refs))), k[i])
        held = tree.claim(last, len(last.held) - 1)  # the path ends at the run's end: no split
        srcs = [source.blocks[name][0] for name in self._names]
        arena.incref_each(index, srcs)
        fresh = arena.take_one_each(index, self._detach_mixed)
        arena.decref_each(index, srcs, list(map(arena.priority.__getitem__, srcs)))
        leaves_of, shared_of = self._requeue_order(probe)  # (the runs' shapes after the take's evictions)
        arena.release_tables([(i, [b]) for i, b in zip(index, fresh, strict=True)], priority)  # nobody holds a copy
        leaves, shared = interleave(leaves_of), interleave(shared_of)
        if leaves:
            queue.add_many(leaves, priority)
        if shared:
            queue.add_many(shared, priority, True)
        tree.leave(held)

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

    def check_invariants(self) -> None:
        """Verify the bookkeeping (O(blocks + tokens)); raise ``AssertionError`` listing what is broken."""
        problems: list[str] = []
        on_host = sum(1 for c in self._caches.values() if c.host is not None)
        if on_host != self.num_on_host:
            problems.append(f"num_on_host {self.num_on_host}, but {on_host} caches hold host slots")
        active = {r for r, c in self._caches.items() if c.state is CacheState.ACTIVE}
        if active != self._active_requests:
            problems.append(f"{len(self._active_requests)} requests noted active, {len(active)} caches are "
                            f"(differ: {sorted(r.req_id for r in active ^ self._active_requests)})")
        owners: dict[str, dict[int, int]] = {g.name: {} for g in self._groups}
        on_path: dict[str, RadixNode] = {}  # each cache's last radix run
        for cache in self._caches.values():
            rid = cache.request.req_id
            if not cache.committed <= cache.history <= cache.capacity:
                problems.append(f"{rid}: lengths {cache.committed}/{cache.history}/{cache.capacity}")
            lazy = cache.pending is not None
            if lazy and (not self._lazy or cache.pending.cache is not cache or cache.keyed or cache.key_at != NEVER
                         or self._tree.pending_prefix(cache.request.salt, cache.pending.first) is not cache.pending):
                problems.append(f"{rid}: keyed lazily but not noted as a pending prefix, or keyed too")
            if self._reuse and not lazy and cache.keyed != cache.committed // self.T:
                problems.append(f"{rid}: {cache.keyed} radix positions for {cache.committed} committed tokens")
            if not lazy and cache.key_at != ((cache.keyed + 1) * self.T if self._reuse else NEVER):
                problems.append(f"{rid}: next block keyed at {cache.key_at} tokens with {cache.keyed} keyed")
            last = cache.last
            if (last.start + len(last) if last is not None else 0) != cache.keyed or (
                    last is not None and last.parent is None):
                problems.append(f"{rid}: its radix path does not end at its {cache.keyed} keyed blocks")
            if last is not None:
                on_path[rid] = last
            if not cache.is_active:
                continue
            for window, tpb, members in self._window_sets:  # commits below slide_at skip the window check: safely
                start = max(0, cache.committed - window + 1)
                if cache.committed < cache.slide_at and any(
                        min(start // tpb, len(cache.tables[name])) > cache.released[name] for name, _ in members):
                    problems.append(f"{rid}: a window releases a block at {cache.committed} tokens, before slide_at "
                                    f"{cache.slide_at}")
            for g in self._groups:
                table = cache.tables[g.name]
                held = [b for b in table if b >= 0]
                if len(set(held)) != len(held):
                    problems.append(f"{rid}: group {g.name} holds a block twice")
                if len(table) != math.ceil(cache.capacity / g.tokens_per_block):
                    problems.append(f"{rid}: group {g.name} has {len(table)} blocks for capacity {cache.capacity}")
                if cache.room > len(table) * g.tokens_per_block:
                    problems.append(f"{rid}: room {cache.room} beyond the {len(table)} blocks of group {g.name}")
                for j, b in enumerate(table):
                    if b < 0 and j >= cache.released[g.name]:
                        problems.append(f"{rid}: group {g.name} block {j} missing above the window")
                    if b >= 0 and j < cache.released[g.name]:  # a finish does not look there (release_tables)
                        problems.append(f"{rid}: group {g.name} holds block {j} below its window's release mark")
                    if b >= 0:
                        owners[g.name][b] = owners[g.name].get(b, 0) + 1
        worst = [sum(g.blocks_for(c.worst) for c in self._caches.values() if c.is_active) for g in self._groups]
        if worst != self._worst_blocks:
            problems.append(f"worst-case blocks of active caches {self._worst_blocks}, recomputed {worst}")
        if self._slabs is not None:
            problems += self._slabs.check()
        for pool, names in self._pool_sets:  # per distinct pool: free + every group's used + evictable == blocks
            if isinstance(pool, TiedArena):  # its pages (each logical block's k distinct, owned once), then its ids
                problems += pool.check()
                free, evictable = set(pool._free_ids), set(pool.evictable.blocks())
                used = {b for b in range(len(pool.ref)) if pool.ref[b] > 0}
                if free & evictable or len(free) + len(evictable) + len(used) != len(pool.pages) \
                        or len(free) != len(pool._free_ids):
                    problems.append(f"tied arena: free {len(free)} + evictable {len(evictable)} + used {len(used)} "
                                    f"logical ids != {len(pool.pages)} ({len(free & evictable)} free and queued)")
                continue
            listed = pool.free_ids() if isinstance(pool, SlabPool) else pool._free
            free, evictable = set(listed), set(pool.evictable.blocks())
            if free & evictable:
                problems.append(f"{self._where(names)}: blocks both free and evictable: {sorted(free & evictable)}")
            used = {b for b in range(len(pool.ref)) if pool.ref[b] > 0}  # (a slab pool's ids span the whole arena)
            if len(free) + len(evictable) + len(used) != pool.num_blocks or len(free) != len(listed) \
                    or len(used) != pool.num_used:
                problems.append(f"{self._where(names)}: free {len(free)} + evictable {len(evictable)} + used "
                                f"{len(used)} != {pool.num_blocks} (num_used {pool.num_used})")
        if self._arena is not None:
            problems += self._check_rows(self._arena)
        for g in self._groups:
            pool = self._pool[g.name]
            holds = pool.holds if isinstance(pool, (GroupShare, TiedShare)) else None
            free, evictable = set(pool.free_ids()), set(pool.evictable.blocks())
            ids = range(len(pool.ref))  # a slab pool's ids span the arena; elsewhere len(ref) == num_blocks
            mine = ids if holds is None else [b for b in ids if holds(b)]
            used = {b for b in mine if pool.ref[b] > 0}
            if len(used) != pool.num_used or len(evictable.intersection(mine)) != pool.num_evictable:
                problems.append(f"group {g.name}: used {len(used)} (num_used {pool.num_used}), evictable "
                                f"{len(evictable.intersection(mine))} (num_evictable {pool.num_evictable})")
            if holds is not None:
                stray = [b for b in range(len(pool.ref)) if b not in free and pool.arena.group_of[b] < 0]
                if stray:
                    problems.append(f"shared arena: blocks neither free nor in a group: {stray}")
            for b in mine:
                n_owners = owners[g.name].get(b, 0)
                if pool.ref[b] != n_owners:
                    problems.append(f"group {g.name}: block {b} ref {pool.ref[b]} but {n_owners} owners")
                # (a block held by several caches need not be a cached prefix block: forked samples share their
                # prompt's blocks with prefix reuse off too)
                if b in evictable and pool.node[b] is None:
                    problems.append(f"group {g.name}: evictable block {b} is not in the radix tree")
                if b in free and pool.node[b] is not None:
                    problems.append(f"group {g.name}: free block {b} still in the radix tree")
                run = pool.node[b]
                if run is not None and not (0 <= pool.pos[b] - run.start < len(run)
                                            and run.blocks[g.name][pool.pos[b] - run.start] == b):
                    problems.append(f"group {g.name}: block {b} and its radix run disagree")
            for b in owners[g.name]:
                if holds is not None and not holds(b):
                    problems.append(f"group {g.name}: block {b} in its tables belongs to another group")
        problems += self._check_tree(on_path)
        if self.host is not None:
            held: dict[str, list[int]] = {name: [] for name in self.host.num_slots}
            for cache in self._caches.values():
                for name, slots in (cache.host or {}).items():
                    held[name].extend(s for s in slots if s >= 0)
            for names in self.host.slot_sets():  # a shared host tier: every group's slots together
                n = self.host.num_slots[names[0]]
                free = self.host.free_slots(names[0])
                taken = [s for name in names for s in held[name]]
                if sorted(free + taken) != list(range(n)):
                    problems.append(f"host {self._where(names)}: {len(free)} free + {len(taken)} held slots != {n}")
        # write-back: exactly the suspended caches' pages still cached on the device wait to be copied at eviction
        live = {id(c) for c in self._caches.values()}
        waiting = {(name, b, id(c), j) for name, later in self._write_back.items() for b, entries in later.items()
                   for c, j in entries}
        for name, b, c, _j in waiting:
            if c not in live:
                problems.append(f"group {name}: block {b} waits to be written back for a cache that is gone")
        marked = {(name, b, id(c), j) for c in self._caches.values() if c.host is not None
                  for name, marks in c.reclaim.items() for j, (b, _) in marks.items()}
        for name, b, _c, j in marked - waiting:
            problems.append(f"group {name}: suspended page {j} on block {b} is not in the write-back map")
        for name, b, _c, j in waiting - marked:
            problems.append(f"group {name}: block {b} waits to be written back for page {j} no cache marks")
        for c in self._caches.values():
            for name, marks in (c.reclaim.items() if c.host is not None else ()):
                for j, (b, gen) in marks.items():
                    pool = self._pool[name]
                    if pool.node[b] is None or pool.gen[b] != gen:
                        problems.append(f"group {name}: suspended page {j}'s block {b} changed hands unwritten")
        if problems:
            raise AssertionError("; ".join(problems))

    def _check_rows(self, arena: SharedPool) -> list[str]:
        """A shared arena's cut families leave no partial row cached: where a cut of a family holds a page at a cached
        position (in the tree or a pending prefix), every cut of the family does (``SharedPool._row_rest``); and
        each queued row's pages lie next to each other in the eviction queue."""
        members = arena._members
        if members is None:
            return []
        rows: dict[tuple[int, int, int], list[int]] = {}
        for b in range(arena.num_blocks):
            g, run = arena.group_of[b], arena.node[b]
            if run is not None and g >= 0 and members[g]:
                rows.setdefault((id(run), arena.pos[b], members[g][0]), []).append(g)
        problems = [f"shared arena: position {p} holds cuts {sorted(arena.names[g] for g in gs)} of "
                    f"{len(members[first])}: a partial row is cached"
                    for (_, p, first), gs in rows.items() if len(gs) != len(members[first])]
        # a queued row lies whole and in one piece in the eviction order (one bucket, its pages next to each other):
        # the queue then evicts rows as a queue of whole rows would, the order a tie of the cuts into one logical
        # block (its pages evicted together) can keep exactly
        seen: set[tuple[int, int, int]] = set()
        for _, got in arena.evictable.buckets():
            row: tuple[int, int, int] | None = None
            n = 0
            for b, _ in got:
                g, run = arena.group_of[b], arena.node[b]
                key = (id(run), arena.pos[b], members[g][0]) if run is not None and members[g] else None
                if key is not None and key == row:
                    n += 1
                    continue
                if row is not None and n != len(members[row[2]]):
                    problems.append(f"shared arena: a queued row of {arena.names[row[2]]}'s family at position "
                                    f"{row[1]} has {n} of its {len(members[row[2]])} pages together in the queue")
                if key is not None and key in seen:
                    problems.append(f"shared arena: the queued row of {arena.names[key[2]]}'s family at position "
                                    f"{key[1]} lies in pieces in the queue")
                row, n = key, 1
                if key is not None:
                    seen.add(key)
            if row is not None and n != len(members[row[2]]):
                problems.append(f"shared arena: a queued row of {arena.names[row[2]]}'s family at position {row[1]} "
                                f"has {n} of its {len(members[row[2]])} pages together in the queue")
        return problems

    def _check_tree(self, on_path: dict[str, RadixNode]) -> list[str]:
        """The radix tree's invariants (:mod:`cache_backends.v2.radix`); ``on_path``: each cache's last run."""
        problems: list[str] = []
        users: dict[int, int] = {}
        for last in on_path.values():
            node: RadixNode | None = last
            while node is not None and node.parent is not None:
                users[id(node)] = users.get(id(node), 0) + 1
                node = node.parent
        positions = 0
        for node in [*self._tree.roots.values(), *self._tree.nodes(), *self._tree.tails()]:
            where = f"radix run at block {node.start}"
            if node.by_first is not None:
                for index, width, what in ((node.by_first, 8, "first-token"), (node.by_two, 16, "first-two-tokens")):
                    expected: dict[bytes, list[RadixNode]] = {}
                    for child in node.children.values():
                        expected.setdefault(child.block(0)[:width], []).append(child)
                    if {t: list(group.values()) for t, group in index.items()} != expected:
                        problems.append(f"{where}: {what} index disagrees with its children")
            for first, child in node.children.items():
                if child.parent is not node or not child.held or child.block(0) != first \
                        or child.start != (node.start + len(node) if node.parent is not None else 0):
                    problems.append(f"{where}: child at block {child.start} is not hooked where it belongs")
            if node.parent is None:
                continue
            n = len(node)
            positions += n
            if not n or len(node.tokens) != n * node.width or node.width != 8 * self.T \
                    or any(not 0 <= j < n for j in node.keys) or set(node.blocks) != set(self._pool):
                problems.append(f"{where}: {n} positions but per-position lists of other lengths or groups")
                continue
            if node.users != users.get(id(node), 0):
                problems.append(f"{where}: {node.users} users, {users.get(id(node), 0)} cache paths through it")
            if not node.users and not node.children and not node.held[-1]:
                problems.append(f"{where}: unused, childless, with an empty tail position (not trimmed)")
            held = [0] * n
            for name, blocks in node.blocks.items():
                pool = self._pool[name]
                if len(blocks) != n:
                    problems.append(f"{where}: group {name} has {len(blocks)} entries for {n} positions")
                    continue
                for i, b in enumerate(blocks):
                    if b < 0:
                        continue
                    held[i] += 1
                    if pool.node[b] is not node or pool.pos[b] != node.start + i:
                        problems.append(f"{where} holds block {b} of {name} at position {node.start + i} "
                                        "it does not own")
            if held != node.held:
                problems.append(f"{where}: held counts {node.held}, recomputed {held}")
        if positions != self._tree.num_nodes:
            problems.append(f"radix tree: {self._tree.num_nodes} positions counted, {positions} found")
        latent: dict[tuple[str | None, bytes], int] = {}
        for cache in self._caches.values():
            if cache.latent is not None:
                key = (cache.request.salt, cache.latent)
                latent[key] = latent.get(key, 0) + 1
                if not self._lazy or cache.keyed or cache.pending is not None \
                        or cache.latent != pack_tokens(_tokens(cache.request, 0, 1)):
                    problems.append(f"{cache.request.req_id}: counted as latent but keyed, pending or mis-keyed")
            elif self._lazy and cache.admitted and cache.pending is None and not cache.keyed:
                problems.append(f"{cache.request.req_id}: no block in the tree, neither pending nor latent")
        if latent != self._tree.latent:
            problems.append(f"latent first tokens {self._tree.latent}, recomputed {latent}")
        for salt, by_first in self._tree.pending.items():
            root = self._tree.root(salt)
            for first, prefix in by_first.items():
                where = f"pending prefix {first.hex()}"
                if not by_first or prefix.first != first or prefix.salt != salt or len(first) != 8 \
                        or (root is not None and root.has_child_starting_with(first)) \
                        or (salt, first) in self._tree.latent:
                    problems.append(f"{where}: not noted under its own first token, or a run or a cache without "
                                    "blocks in the tree starts with it too")
                running = prefix.cache
                if running is not None and (
                        running.pending is not prefix or self._caches.get(prefix.request) is not running
                        or len(prefix.held) > running.committed // self.T
                        or any(running.tables[name][j] >= 0 for name, blocks in prefix.blocks.items()
                               for j, b in enumerate(blocks) if b >= 0)):
                    problems.append(f"{where}: a running request's note lost its cache, or holds a block the "
                                    "request still has or beyond its full committed blocks")
                held = [0] * len(prefix.held)
                for name, blocks in prefix.blocks.items():
                    pool = self._pool[name]
                    if len(blocks) != len(held):
                        problems.append(f"{where}: group {name} has {len(blocks)} entries for {len(held)} positions")
                        continue
                    for i, b in enumerate(blocks):
                        if b >= 0:
                            held[i] += 1
                            if pool.node[b] is not prefix or pool.pos[b] != i or pool.ref[b]:
                                problems.append(f"{where} holds block {b} of {name} at {i} that is not its cached one")
                if held != prefix.held or (running is None and not any(held)):
                    problems.append(f"{where}: held counts {prefix.held}, recomputed {held}")
        return problems

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
                for hashes, parent, tokens in what:
                    events.stored(hashes, parent, tokens, tpb, name)

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
        left = iter(rows)
        for name in self._event_cuts[group]:
            for _, stored in steps:
                if not free:
                    row = next(left, None)
                    if row is not None:
                        for cut in self._event_cuts[row[0]]:
                            self._send(cut, row[1])
                        free += len(self._event_cuts[row[0]])
                free -= 1
                self._send(name, stored)
        for g, heard in left:  # (none: the page arena evicts as many rows)
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

    def _attach(self, run: RadixNode, i: int, group: str, block: int) -> None:
        """Hang ``group``'s ``block`` at position ``i`` of ``run`` unless either already has a partner."""
        pool = self._pool[group]
        if run.blocks[group][i] < 0 and pool.node[block] is None:
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
        out: list[tuple[list[bytes], bytes | None, list[int]]] = []
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
                out.append(([tree.key(r, j) for r, j in chain], parent, tokens))
            chain = [item] if item is not None else []
        if group in self._event_cuts:  # tied: each cut's pages are stored there, reported cut by cut
            self._tied_event(group, STORED, out, tpb)
            return
        for hashes, parent, tokens in out:
            events.stored(hashes, parent, tokens, tpb, group)

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

    def _count_worst(self, cache: SequenceCache, sign: int) -> None:
        """Add (``sign`` 1, on activation) or remove (-1, on release) a cache's worst-case blocks."""
        if cache.worst < 0:
            cache.worst = min(cache.request.max_total_tokens, self.options.max_seq_len)
        worst, totals = cache.worst, self._worst_blocks
        for g, members in self._cycles:
            n = sign * g.blocks_for(worst)
            for i in members:
                totals[i] += n

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

    def _key_full_blocks(self, cache: SequenceCache) -> None:
        """Hang newly full committed blocks in the radix tree (found by their tokens: appended to the cache's own
        run when it is the run's only user) and offer the cache's blocks to their positions."""
        T = self.T
        first, full = cache.keyed, cache.committed // T
        if first >= full:
            return
        packed = pack_tokens(_tokens(cache.request, first * T, full * T))  # once for the run
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
        packed = _packed(request, blocks * T)  # (at least the blocks' tokens; compared only within them)
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
            first = _first_packed(request)
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

    def _materialize(self, prefix: PendingPrefix) -> None:
        """Hang a pending prefix in the tree as keying it all along would have (lazy keying: radix module doc)."""
        tree, T = self._tree, self.T
        tree.drop_pending(prefix)
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
            run, segs = tree.extend(None, prefix.salt, pack_tokens(_tokens(prefix.request, 0, n * T)), T)  # type: ignore[arg-type]
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

    def _activate(self, cache: SequenceCache, m: int, hit: bool = True) -> None:
        """Admission's end: ``m`` tokens are cached (a prefix-cache hit, unless ``hit`` is false: a fork); the cache
        becomes active and its window is released."""
        request = cache.request
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
        want_ids = _tokens(request, m, m + self.T)
        want = pack_tokens(want_ids)
        best, best_k = None, 0
        groups = len(self._groups)
        # An indexed node (many children, e.g. every cached prompt after a common BOS): the earliest child with the
        # longest match shares two tokens if any does, so only those are compared; else every child that shares the
        # first token is (any other shares no token).
        two = parent.children_sharing_two(want) if self._partial_unit == 1 and limit >= 2 else None
        for child in two if two is not None else parent.children_starting_with(want_ids[0]):
            if child.held[0] != groups:
                continue
            k = min(_common_prefix(child.block(0), want), limit)
            k -= k % self._partial_unit
            if k > best_k:
                best, best_k = child, k
        tail = parent.tail
        if tail is not None and tail.held[0] == groups and tail.adjacent():  # a finished history's partial block
            k = min(_common_prefix(tail.block(0), want), limit, tail.valid)
            k -= k % self._partial_unit
            if k > best_k:
                best, best_k = tail, k
        if best is None and two is not None:  # none shares two: the earliest that shares the first one, by one token
            best = next((c for c in parent.children_starting_with(want_ids[0]) if c.held[0] == groups), None)
            best_k = 1
        return best, best_k

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
