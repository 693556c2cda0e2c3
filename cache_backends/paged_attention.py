"""Paged attention over the block pools, in plain torch: one step's batch plan, K/V writes, gathers, masks.

A step runs every scheduled token of every sequence in one packed row (the executor's forward):

* **packed tokens** — sequence ``b`` brings ``n_b`` new tokens at positions ``s_b .. s_b + n_b - 1``;
  all ``N = Σ n_b`` tokens go through the model as ``input_ids``/``position_ids`` of shape ``(1, N)``,
  so the rotary embedding sees each token's own position.
* **writes** — before attending, a layer writes the new tokens' entries into its pool at the slots
  its block table gives (``pools.py``: slot = ``physical_block * block_slots + pos % T``). The
  chunk then attends to itself through the pool exactly like to its cached prefix.
* **gathers** — per sequence, the slots of the keys its queries may see: positions
  ``max(0, s_b - W + 1) .. s_b + n_b - 1`` for a layer with window ``W`` (all from 0 without one),
  padded to ``(B, max_k)`` with the sequence's first key (pools are not zero-filled, and a masked
  NaN would still poison the output). A window layer never touches blocks that fell out of its
  window, so a released block (``-1``) there is fine; a ``-1`` where a needed key lives is an error.
* **masks** — queries are padded per sequence to ``(B, H, max_q, d)``; the boolean mask
  ``(B, 1, max_q, max_k)`` lets query ``i`` see key ``j`` when the key is real (not padding), not
  after the query (causal), and, with a window, ``key_pos > query_pos - W`` (the query itself and
  the ``W - 1`` before it, as transformers' sliding masks do). Padded query rows see one key so
  softmax stays finite; they are dropped when unpadding. A decode step whose sequences all gather
  the same number of keys needs no mask at all (``None``: SDPA's faster unmasked path).

Layers that share a group and a window share the gather slots and the mask (computed once per step).
Groups that differ only in their block ids — the groups a V2 shared arena cuts from one life cycle
(tiny-gemma3's ``sliding_w512.0`` ... ``.4``, Gemma 3 27B's 26 + 5) — are planned together: their
tables are stacked into one ``(groups, B, width)`` array (``block_tables.StepTables``) and every
group's write and gather slots come from one ``table * T + offset`` operation over it: a step pays the
plan's per-operation costs once per life cycle, not once per cut group (the slots themselves are still
each group's own, so their bytes grow with the groups).
The layer's window comes from the model's geometry (``KvLayout.layers``), not from the pool: V1 keeps
every token of a sliding layer in its uniform pool, and the mask still applies the window.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from cache_backends.block_tables import StepTables
from cache_backends.layout import DECODE_KERNEL_KINDS, SERVED_KINDS  # SERVED_KINDS: the kinds this module serves
from cache_backends.pools import BlockPools

#: Pool dtypes written through a ``uint8`` view of the same bytes: torch's CPU ``index_copy`` has no float8 kernel,
#: and a byte copy of values already cast to the pool's dtype stores exactly the bits a float8 copy would.
_BYTE_WRITTEN = (torch.float8_e4m3fn, torch.float8_e5m2)


def _store(dst: torch.Tensor, dim: int, slots: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_copy_(dim, slots, src)`` with ``src`` cast to ``dst``'s dtype (float8 through byte views)."""
    if src.dtype != dst.dtype:
        src = src.to(dst.dtype)
    if dst.dtype in _BYTE_WRITTEN:
        dst.view(torch.uint8).index_copy_(dim, slots, src.view(torch.uint8))
    else:
        dst.index_copy_(dim, slots, src)


@attrs.define
class _PoolsPlan:
    """What every step over one set of pools shares, worked out once: layer routes, group families, block sizes."""

    #: group -> the groups whose slots are computed with it, for writes and for gathers (see _families)
    families: tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]
    #: layer -> its LayerRoute (PagedBatch.route)
    routes: dict[int, LayerRoute] = attrs.Factory(dict)
    #: the executor's group tuple -> its groups' block sizes, sorted (PagedBatch._check_step)
    block_sizes: dict[tuple[str, ...], list[int]] = attrs.Factory(dict)


#: per pools, one lookup a step
_PLANS: weakref.WeakKeyDictionary[BlockPools, _PoolsPlan] = weakref.WeakKeyDictionary()


def _pools_plan(pools: BlockPools) -> _PoolsPlan:
    plan = _PLANS.get(pools)
    if plan is None:
        plan = _PLANS[pools] = _PoolsPlan(_families(pools))
    return plan


def _families(pools: BlockPools) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """Which groups a step plans together: ``(for writes, for gathers)``, each group -> its family, in pool order.

    A slot is ``block * block_slots + pos % tokens_per_block`` (``BlockPools.block_slots``: ``entries_per_block``
    but in a slab arena), so groups with the same block geometry share the write arithmetic whatever their window; a
    gather also depends on the window, so gather families add it. Compressed groups (DeepSeek V4 writes and reads them
    per entry, in its own forward) stay alone.
    """
    writes: dict[tuple, list[str]] = {}
    gathers: dict[tuple, list[str]] = {}
    for name, g in pools.groups.items():
        geometry = ((g.tokens_per_block, g.entries_per_block, pools.block_slots[name]) if g.compress_rate is None
                    else (name,))
        writes.setdefault(geometry, []).append(name)
        gathers.setdefault((*geometry, g.window), []).append(name)
    return ({n: tuple(f) for f in writes.values() for n in f},
            {n: tuple(f) for f in gathers.values() for n in f})


def _pages_read(longest: int, tokens_per_block: int, window: int | None) -> int:
    """The most pages one sequence reads in a decode step whose longest sequence holds ``longest`` tokens (sizes the
    Triton kernel's splits; a block table is max_seq_len wide): a window reads at most its span's pages."""
    pages = -(-longest // tokens_per_block)
    return pages if window is None else min(pages, -(-window // tokens_per_block) + 1)


@attrs.frozen
class SeqChunk:
    """This step's new tokens of one sequence: ids, the position of the first, and a block table per group."""

    token_ids: tuple[int, ...] = attrs.field(converter=tuple)
    start_pos: int
    block_tables: Mapping[str, Sequence[int]]

    def __attrs_post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a chunk needs at least one new token")
        if self.start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {self.start_pos}")

    @property
    def end_pos(self) -> int:
        """One past the position of the last new token (the sequence length after this step)."""
        return self.start_pos + len(self.token_ids)


@attrs.frozen
class LayerRoute:
    """Where one layer's entries live, and the window its attention applies."""

    layer: int
    kind: str
    window: int | None
    group: str
    layer_pos: int
    entry_elems: int


@attrs.frozen
class KeyGather:
    """The keys one (group, window) pair gathers per sequence, and the mask over them."""

    slots: torch.Tensor  # (B, max_k) int64 flat slots into layer_slots(group, ·); the row's first key under padding
    mask: torch.Tensor | None  # (B, 1, max_q, max_k) bool: True = the query sees the key; None: sees all
    max_k: int
    k_len: np.ndarray | None = None  # (B,) real keys per sequence (the rest of max_k is padding)
    lo: np.ndarray | None = None  # (B,) position of each sequence's first gathered key
    flat: torch.Tensor | None = None  # slots as (B * max_k,): what index_select takes (flattened once per step)


@attrs.frozen
class _WindowKeys:
    """The keys a window reads per sequence in one step, for every group with that window."""

    lo: np.ndarray  # (B,) position of each sequence's first visible key
    k_len: np.ndarray  # (B,) visible keys per sequence
    max_k: int
    k_pos: np.ndarray  # (B, max_k) key positions (past k_len: padding)
    k_valid: np.ndarray  # (B, max_k) bool: a real key
    padded: bool  # some row has padding
    mask: torch.Tensor | None  # (B, 1, max_q, max_k) bool on the device; None: every query sees every key


#: A chunk of at most this many new tokens (a decode with its draft tokens, a prefill's tail) attends on the paged
#: decode kernel, one kernel row per token, where the step has one (``PagedBatch.attend_mixed``): each row reads its
#: pages in place, where gather + SDPA would copy the sequence's keys for a handful of queries.
KERNEL_CHUNK_MAX = 8


@attrs.define
class _MixedSplit:
    """A step split for the paged decode kernel: the tokens of its short chunks as kernel rows, and a plan of its long
    chunks alone (None when it has none)."""

    decode_seqs: np.ndarray  # (D,) the kernel rows' sequence indices (a short chunk's, once per token of it)
    decode_tokens: torch.Tensor  # (D,) their packed token indices, on the device
    prefill_tokens: torch.Tensor  # (N - D,) the long chunks' packed token indices, on the device
    lens: torch.Tensor  # (D,) keys per kernel row (its position + 1), on the device
    longest: int  # the most keys a kernel row has
    prefill: PagedBatch | None  # the long chunks' own plan (gathers and masks over their keys; writes are the step's)
    tables: dict[str, torch.Tensor] = attrs.Factory(dict)  # per group, the decode rows' tables on the device


class PagedBatch:
    """One step's plan: packed inputs, per-group write slots, and per (group, window) gathers and masks.

    Build it with :meth:`build`; the model code reaches it through the attention function
    (``models.paged_forward``), which calls :meth:`write`, :meth:`gather`, :meth:`mask`,
    :meth:`pad_queries` and :meth:`unpad`.
    """

    def __init__(self, chunks: Sequence[SeqChunk], pools: BlockPools,
                 tables: Mapping[str, torch.Tensor] | None = None) -> None:
        if not chunks:
            raise ValueError("a step needs at least one chunk")
        if pools.released:
            raise ValueError("the block pools were released")
        self.chunks = tuple(chunks)
        self.pools = pools
        self.device = pools.device
        self._on_cpu = self.device.type == "cpu"
        self._plan = plan = _pools_plan(pools)
        #: routes depend on the pools only: kept across steps (a layer's route is checked once per pools)
        self._routes: dict[int, LayerRoute] = plan.routes
        self._gathers: dict[tuple[str, int | None], KeyGather] = {}
        self._windows: dict[int | None, _WindowKeys] = {}
        self._split_pos: dict[tuple[int | None, int, int], tuple[np.ndarray, ...]] = {}

        # Index arithmetic in numpy, wrapped with torch.from_numpy (no copy): at a few hundred tokens each
        # torch CPU op costs its dispatch overhead (~5 us) and a plan is dozens of them, every step.
        # (a decode step's plan is a few dozen such calls on arrays of B elements: sums over short lists in Python)
        B = len(self.chunks)
        counts = [len(c.token_ids) for c in self.chunks]
        starts = [c.start_pos for c in self.chunks]
        n = np.array(counts, dtype=np.int64)
        start = np.array(starts, dtype=np.int64)
        self.num_seqs = B
        self.num_tokens = sum(counts)
        self.max_q = max(counts)
        self._longest = max(map(operator.add, starts, counts))  # the longest sequence after this step
        if self.max_q == 1:  # pure decode: token b is sequence b's only one, at its start position
            seq, offset, pos = np.arange(B), np.zeros(B, dtype=np.int64), start
            ids = np.array([c.token_ids[0] for c in self.chunks], dtype=np.int64)
        else:
            seq = np.repeat(np.arange(B), n)
            offset = np.arange(self.num_tokens) - np.repeat(np.cumsum(n) - n, n)
            pos = start[seq] + offset
            ids = np.fromiter((t for c in self.chunks for t in c.token_ids), dtype=np.int64, count=self.num_tokens)
        self._n_np, self._start_np, self._end_np = n, start, start + n  # (read only: pos may be start itself)
        self._seq_np, self._pos_np = seq, pos
        self._offset_np = offset
        self.input_ids = self._to_device(ids.reshape(1, -1))
        self.position_ids = self._to_device(pos.reshape(1, -1))
        self._last_token_index: torch.Tensor | None = None
        self._keep: np.ndarray | None = None  # logits rows kept per sequence (its last ones), None: its last only
        self._q_row_t: torch.Tensor | None = None
        #: the executor's stacked tables (every group in one array), or None
        self._step: StepTables | None = tables if isinstance(tables, StepTables) else None
        self._tables: dict[str, torch.Tensor] = {}
        if self._step is not None:
            self._check_step(self._step)
        elif tables is not None:
            self._tables = dict(tables)
            for group, table in self._tables.items():
                self._check_table(group, table)
        self._given_tables = dict(self._tables)  # tables passed per group (not planned from the chunks' lists)
        self._write_family, self._gather_family = plan.families
        self._stacks: dict[tuple[str, ...], np.ndarray] = {}
        #: the compiled path (``cache_backends.flex_paged``) when the step runs on it; None: gather + SDPA
        self.flex: Any = None
        #: the paged decode kernel a decode-only step's full and sliding layers attend through, reading the pool in
        #: place (``cache_backends.paged_decode.paged_decode`` on CUDA, ``cache_backends.cpu_decode`` on CPU); None:
        #: gather + SDPA
        self.decode_kernel: Callable[..., torch.Tensor] | None = None
        self._decode_tables: dict[str, torch.Tensor] = {}  # per group, on the device (uploaded once a step)
        self._decode_stack: torch.Tensor | None = None  # the executor's stacked tables, on the device
        self._decode_lens: torch.Tensor | None = None  # keys per sequence, on the device
        self._decode_scratch: dict[tuple, torch.Tensor] = {}  # the kernel's partials, shared by the step's layers
        self._mixed: _MixedSplit | None = None  # a mixed step's split (attend_mixed), once planned
        self._mixed_planned = False
        #: MLA layers whose latent cache stored this step's entries and gathered nothing (the compiled path
        #: attends over the latents in place; ``models.paged_forward``)
        self.latent_in_place: set[int] = set()
        self._write_slots: dict[str, torch.Tensor] = {}
        self._splits: dict[int, list[tuple[int, int, int, int, bool]] | None] = {}
        self._biases: dict[tuple[int | None, torch.dtype], torch.Tensor] = {}
        #: DeepSeek V4: each sequence's side state (``models.deepseek_v4_paged.V4SequenceState``), in chunk order, and
        #: the window gathers its layers share, planned at the first layer of the step
        self.side: list[Any] | None = None
        self.side_plans: dict[Any, Any] = {}

    def attend_decode(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                      softcap: float | None, written: bool = False) -> torch.Tensor | None:
        """A decode-only step's attention of a full or sliding layer on the paged decode kernel, reading the pool in
        place: packed ``(B, heads, d)``; None when the kernel does not serve this step or layer (nothing written).

        ``key`` / ``value``: the new tokens' ``(B, kv_heads, d)``, stored first unless ``written``: by the kernel
        in the same call where it can (the CPU kernel, K/V already in the pool's dtype), else by :meth:`write_kv`.
        """
        r = self.route(layer)
        if self.decode_kernel is None or self.max_q != 1 or r.kind not in DECODE_KERNEL_KINDS:
            return None
        tables = self._decode_tables.get(r.group)
        if tables is None:  # one upload per step: every group's tables at once when the executor stacked them
            if self._step is not None and r.group in self._step.index:
                if self._on_cpu:  # a view of the stacked array (a torch index of the stack costs ~3x as much)
                    tables = torch.from_numpy(self._step.array[self._step.index[r.group]])
                else:
                    if self._decode_stack is None:
                        self._decode_stack = self._to_device(self._step.array)
                    tables = self._decode_stack[self._step.index[r.group]]
            else:
                tables = self._to_device(self._table(r.group).numpy())
            self._decode_tables[r.group] = tables
        if self._decode_lens is None:
            self._decode_lens = self._to_device(self._end_np)
        slots = self._views(r)[0]
        kv_heads = key.shape[1]
        new_kv = None
        if not written:
            if getattr(self.decode_kernel, "writes_new_kv", False) and key.dtype == slots.dtype == value.dtype \
                    and key.stride(2) == 1 and value.stride(2) == 1:
                new_kv = (key, value)
            else:
                write_kv(self, layer, key, value)
        T = self.pools.groups[r.group].tokens_per_block
        extra = {"new_kv": new_kv} if new_kv is not None else {}
        return self.decode_kernel(query, slots, tables, self._decode_lens, kv_heads, T, scale, r.window, softcap,
                                  _pages_read(self._longest, T, r.window), self._decode_scratch, **extra)

    def attend_mixed(self, layer: int, query: torch.Tensor, kv_heads: int, head_dim: int, scale: float,
                     softcap: float | None) -> torch.Tensor | None:
        """A step with more than one new token in some sequence, for a full or sliding layer whose new K/V are
        written: every token of a short chunk (a decode, or a decode with its draft tokens: up to
        :data:`KERNEL_CHUNK_MAX` tokens) as a row of the paged decode kernel, attending to the keys up to its own
        position (the pages read in place), and the longer chunks on gather + SDPA over their own keys only. Packed
        ``(N, heads, d)``; None when the kernel does not serve this step or layer.

        Gather + SDPA would copy every sequence's visible keys, the decode rows' long contexts included, padded to
        the longest; those are most of the copy when a new prompt's chunk joins running requests.
        """
        r = self.route(layer)
        if self.decode_kernel is None or self.max_q == 1 or r.kind not in DECODE_KERNEL_KINDS:
            return None
        split = self._mixed_split()
        if split is None:
            return None
        tables = split.tables.get(r.group)
        if tables is None:
            tables = split.tables[r.group] = self._to_device(np.ascontiguousarray(
                self._table(r.group).numpy()[split.decode_seqs]))
        T = self.pools.groups[r.group].tokens_per_block
        decoded = self.decode_kernel(query.index_select(0, split.decode_tokens), self._views(r)[0], tables, split.lens,
                                     kv_heads, T, scale, r.window, softcap, _pages_read(split.longest, T, r.window),
                                     self._decode_scratch)
        sub = split.prefill
        if sub is None:  # every chunk is short: the kernel's rows are the step's tokens, in order
            return decoded.to(query.dtype)
        k, v = sub.gather_kv(layer, kv_heads, head_dim, query.dtype)
        prefilled = attend_packed(sub, layer, query.index_select(0, split.prefill_tokens), k, v, scale, softcap)
        out = query.new_empty(query.shape[0], query.shape[1], prefilled.shape[-1])
        out.index_copy_(0, split.decode_tokens, decoded.to(out.dtype))
        out.index_copy_(0, split.prefill_tokens, prefilled)
        return out

    def _mixed_split(self) -> _MixedSplit | None:
        """The step's kernel rows (the tokens of its short chunks) and long chunks, planned once for its layers; None
        when it has no short chunk."""
        if self._mixed_planned:
            return self._mixed
        self._mixed_planned = True
        short = self._n_np <= KERNEL_CHUNK_MAX
        if not short.any():
            return None
        chunks = np.nonzero(~short)[0]
        token_is_row = short[self._seq_np]
        row_tokens = np.nonzero(token_is_row)[0]
        row_seqs = self._seq_np[row_tokens]  # a short chunk's table, once per token of it
        lens = self._pos_np[row_tokens] + 1  # each token attends to the keys up to its own position
        prefill = None
        if len(chunks):
            tables: Mapping[str, torch.Tensor] | None = None  # None: the chunks' own lists
            if self._step is not None:
                tables = StepTables(self._step.groups, self._step.array[:, chunks], self._step.index)
            elif self._given_tables:
                rows = torch.from_numpy(chunks)
                tables = {g: t[rows] for g, t in self._given_tables.items()}
            prefill = PagedBatch([self.chunks[b] for b in chunks.tolist()], self.pools, tables)
        self._mixed = _MixedSplit(
            decode_seqs=row_seqs, decode_tokens=self._to_device(row_tokens),
            prefill_tokens=self._to_device(np.nonzero(~token_is_row)[0]),
            lens=self._to_device(lens), longest=int(lens.max()), prefill=prefill)
        return self._mixed

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A plan array on the pools' device; to a GPU through pinned memory without blocking.

        A plain ``.to("cuda")`` of CPU memory synchronizes the stream after the copy: each of a step's
        plan uploads (inputs, positions, write slots, the gather slots planned at the first layer,
        masks) stalled the host until the GPU had drained its queue, in the middle of a launch-bound
        decode. From pinned memory the copy is queued like any kernel (the caching host allocator keeps
        the pinned buffer until the copy has run).
        """
        t = torch.from_numpy(array)
        if self._on_cpu:
            return t
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def attention_work(self) -> tuple[int, int]:
        """``(Σ queries x visible keys, Σ visible keys)`` over the step's sequences, for a layer with no window."""
        return int((self._n_np * self._end_np).sum()), int(self._end_np.sum())

    @property
    def last_token_index(self) -> torch.Tensor:
        """Index of each sequence's last new token in the packed row (where its next-token logits are); with
        :meth:`keep_last`, of each sequence's last ``keep[b]`` tokens, in order."""
        if self._last_token_index is None:
            ends = np.cumsum(self._n_np)
            if self._keep is None:
                index = ends - 1
            else:
                keep = self._keep
                index = np.repeat(ends - keep, keep) + (np.arange(int(keep.sum())) - np.repeat(np.cumsum(keep) - keep,
                                                                                              keep))
            self._last_token_index = self._to_device(index)
        return self._last_token_index

    def keep_last(self, keep: Sequence[int]) -> None:
        """Keep the logits of sequence ``b``'s last ``keep[b]`` new tokens, not only its last one (speculative
        decoding verifies each draft with the logits before it); call before the forward."""
        counts = np.array(keep, dtype=np.int64)
        if counts.shape != (self.num_seqs,) or (counts < 1).any() or (counts > self._n_np).any():
            raise ValueError(f"keep: expected one count per sequence, each from 1 to its new tokens, got {list(keep)}")
        self._keep = None if (counts == 1).all() else counts
        self._last_token_index = None

    @property
    def logits_to_keep(self) -> int | torch.Tensor:
        """What a transformers forward's ``logits_to_keep`` gets: every token (0) when each one is its sequence's last.

        A decode step's tokens are all last tokens: no index tensor to upload, no index op on the hidden states.
        """
        return 0 if self.max_q == 1 or (self._keep is not None and self._keep.sum() == self.num_tokens) \
            else self.last_token_index

    @property
    def _q_row(self) -> torch.Tensor:
        """Row of each packed token in the padded ``(B * max_q)`` query layout (only a step with max_q > 1 pads)."""
        if self._q_row_t is None:
            self._q_row_t = self._to_device(self._seq_np * self.max_q + self._offset_np)
        return self._q_row_t

    @classmethod
    def build(cls, chunks: Sequence[SeqChunk], pools: BlockPools, tables: Mapping[str, torch.Tensor] | None = None,
              flex: Any = None, decode_kernel: Callable[..., torch.Tensor] | None = None) -> PagedBatch:
        """Plan a step; checks every group's tables cover the new tokens (gathers are planned lazily per layer).

        ``tables`` gives each group's block tables as a ``(B, width)`` tensor padded with -1 (kept across
        steps by ``cache_backends.block_tables.BlockTableStore``); without it they come from the chunks'
        lists. ``flex`` (a ``cache_backends.flex_paged.FlexPagedAttention``) runs the step's attention
        on the compiled path; ``decode_kernel`` (a paged decode kernel: ``cache_backends.paged_decode.paged_decode``
        or a ``cache_backends.cpu_decode.CpuDecodeKernel``) runs a decode-only step's full and sliding layers.
        """
        batch = cls(chunks, pools, tables)
        batch.flex = flex
        batch.decode_kernel = decode_kernel
        if decode_kernel is None or batch.max_q != 1:
            for group, g in pools.groups.items():
                if g.compress_rate is None:  # DeepSeek V4's compressed entries are written per entry, not per token
                    batch.write_slots(group)
        # else: a decode step on a paged decode kernel: the kernel stores its full and sliding layers' new K/V and
        # checks the page it stores into; the slots of a layer it does not serve are computed on that layer's write
        return batch

    # --- routing -------------------------------------------------------------------------

    def route(self, layer: int) -> LayerRoute:
        """Group, position in the group and window of a decoder layer."""
        cached = self._routes.get(layer)
        if cached is not None:
            return cached
        layers = {kv.index: kv for kv in self.pools.layout.layers}  # once per layer and pools (routes are kept)
        kv = layers.get(layer)
        if kv is None:
            raise ValueError(f"layer {layer} is not in the KV layout (layers 0..{len(layers) - 1})")
        if kv.kind not in SERVED_KINDS or kv.compress_rate is not None:
            raise ValueError(f"layer {layer} is a {kv.kind!r} layer; paged attention serves "
                             f"{', '.join(SERVED_KINDS)} layers only")
        (group, pos), *rest = self.pools.layer_index[layer]
        if rest:
            raise ValueError(f"layer {layer} has entries in several pools; paged attention reads one")
        route = LayerRoute(layer, kv.kind, kv.window, group, pos, kv.entry_elems)
        self._routes[layer] = route
        return route

    def _check_step(self, step: StepTables) -> None:
        """Stacked tables: known groups, one row per sequence, wide enough for every new token's block."""
        sizes = self._plan.block_sizes
        tpbs = sizes.get(step.groups)  # the executor's store passes the same groups every step: checked once
        if tpbs is None:
            unknown = [g for g in step.groups if g not in self.pools.groups]
            if unknown:
                raise ValueError(f"block tables for group {unknown[0]!r}, which the pools do not have")
            tpbs = sizes[step.groups] = sorted({self.pools.groups[g].tokens_per_block for g in step.groups})
        if step.array.shape[1] != self.num_seqs:
            raise ValueError(f"block tables of shape {tuple(step.array.shape[1:])} per group, expected "
                             f"({self.num_seqs}, blocks)")
        width = step.array.shape[2]
        for tpb in tpbs:
            if (self._longest - 1) // tpb < width:  # the longest sequence fits: all do
                continue
            short = (self._end_np - 1) // tpb >= width
            if short.any():
                b = int(short.nonzero()[0][0])
                group = next(g for g in step.groups if self.pools.groups[g].tokens_per_block == tpb)
                end = int(self._end_np[b])
                raise ValueError(f"sequence {b}: block table of group {group!r} has {width} blocks of {tpb} "
                                 f"tokens; position {end - 1} needs {(end + tpb - 1) // tpb}")

    def _check_table(self, group: str, table: torch.Tensor) -> None:
        """A given table: one row per sequence, wide enough for every new token's block."""
        if group not in self.pools.groups:
            raise ValueError(f"block tables for group {group!r}, which the pools do not have")
        if table.dim() != 2 or table.shape[0] != self.num_seqs:
            raise ValueError(f"group {group!r}: block tables of shape {tuple(table.shape)}, expected "
                             f"({self.num_seqs}, blocks)")
        tpb = self.pools.groups[group].tokens_per_block
        short = (self._end_np - 1) // tpb >= table.shape[1]
        if short.any():
            b = int(short.nonzero()[0][0])
            end = int(self._end_np[b])
            raise ValueError(f"sequence {b}: block table of group {group!r} has {table.shape[1]} blocks of {tpb} "
                             f"tokens; position {end - 1} needs {(end + tpb - 1) // tpb}")

    def table(self, group: str) -> torch.Tensor:
        """Block tables of a group as a ``(B, width)`` CPU int64 tensor, padded with -1."""
        return self._table(group)

    def _table(self, group: str) -> torch.Tensor:
        """Block tables of a group as a (B, max_blocks) CPU tensor, padded with -1."""
        table = self._tables.get(group)
        if table is None and self._step is not None and group in self._step.index:
            table = self._tables[group] = self._step[group]
        if table is None:
            rows = []
            for b, c in enumerate(self.chunks):
                try:
                    rows.append(list(c.block_tables[group]))
                except KeyError:
                    raise ValueError(f"sequence {b}: no block table for group {group!r}") from None
            width = max(1, max(len(r) for r in rows))
            table = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long)
            tpb = self.pools.groups[group].tokens_per_block
            short = np.array([len(r) for r in rows]) * tpb < self._end_np
            if short.any():
                b = int(short.nonzero()[0][0])
                raise ValueError(f"sequence {b}: block table of group {group!r} has {len(rows[b])} blocks of {tpb} "
                                 f"tokens; position {int(self._end_np[b]) - 1} needs "
                                 f"{(int(self._end_np[b]) + tpb - 1) // tpb}")
            self._tables[group] = table
        return table

    def _stack(self, family: tuple[str, ...]) -> np.ndarray:
        """``(len(family), B, width)`` block tables of a family's groups (a view of the step's stack when it can)."""
        out = self._stacks.get(family)
        if out is not None:
            return out
        if self._step is not None and all(g in self._step.index for g in family):
            out = self._step.stack(family)
        else:
            tables = [self._table(g).numpy() for g in family]
            width = max(t.shape[1] for t in tables)
            out = np.full((len(tables), self.num_seqs, width), -1, dtype=np.int64)
            for i, t in enumerate(tables):
                out[i, :, : t.shape[1]] = t
        self._stacks[family] = out
        return out

    def _per_group(self, arrays: np.ndarray) -> tuple[torch.Tensor, ...]:
        """One ``(groups, ...)`` array as a device tensor per group (one copy to the device for all of them)."""
        if arrays.shape[0] == 1:
            return (self._to_device(arrays[0]),)
        return self._to_device(arrays).unbind(0)

    def write_slots(self, group: str) -> torch.Tensor:
        """(N,) flat slots of the new tokens in a group, in packed order."""
        slots = self._write_slots.get(group)
        if slots is not None:
            return slots
        g = self.pools.groups[group]
        if g.compress_rate is not None:
            raise ValueError(f"group {group!r} is compressed; paged attention does not read compressed entries")
        family = self._write_family[group]
        T = g.tokens_per_block
        seq, pos = self._seq_np, self._pos_np
        tables = self._stack(family)  # (groups, B, width): every group of the family in one take
        blocks = np.take(tables.reshape(len(family), -1), seq * tables.shape[2] + pos // T, axis=1)
        missing = blocks < 0
        if missing.any():
            f, i = (int(x[0]) for x in missing.nonzero())
            b, p = int(seq[i]), int(pos[i])
            raise ValueError(f"sequence {b}: group {family[f]!r} has no block for position {p}, which a new token "
                             f"needs (logical block {p // T} is -1: released or never allocated)")
        blocks *= self.pools.block_slots[group]  # in place (the take made a fresh array): see _gather
        blocks += pos % T
        for name, one in zip(family, self._per_group(blocks), strict=True):
            self._write_slots[name] = one
        return self._write_slots[group]

    def _window_keys(self, window: int | None) -> _WindowKeys:
        """What a window's gather is, whatever the group: visible key positions per sequence and the mask.

        The groups a shared arena cuts from one group (``sliding_w512.0`` ... ``.4``) read the same
        positions through different tables: this part is computed once per window, only the slots per group.
        """
        keys = self._windows.get(window)
        if keys is not None:
            return keys
        start, end = self._start_np, self._end_np
        lo = np.maximum(start - window + 1, 0) if window else np.zeros_like(start)
        k_len = end - lo
        max_k = int(k_len.max())
        j = np.arange(max_k)
        k_pos = lo[:, None] + j[None, :]  # (B, max_k)
        k_valid = j[None, :] < k_len[:, None]
        padded = not bool(k_valid.all())
        mask = None
        if not (self.max_q == 1 and not padded):
            # (one query per sequence at its last position with every key real sees them all — the window
            # already bounded the gather — so no mask: SDPA's unmasked path is the faster one)
            i = np.arange(self.max_q)
            q_pos = start[:, None] + i[None, :]  # (B, max_q)
            q_valid = i[None, :] < self._n_np[:, None]
            seen = k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
            if window:
                seen &= k_pos[:, None, :] > q_pos[:, :, None] - window
            # padded query rows see key 0 only, so their softmax stays finite; unpad drops them
            seen[:, :, 0] |= ~q_valid
            mask = self._to_device(seen[:, None])
        keys = self._windows[window] = _WindowKeys(lo, k_len, max_k, k_pos, k_valid, padded, mask)
        return keys

    def _gather(self, layer: int) -> KeyGather:
        """The slots and mask of a layer's (group, window) pair, planned once per step in numpy.

        Per sequence the visible keys are the contiguous positions ``lo .. end - 1``; a key's slot is
        ``table[b, pos // T] * entries_per_block + pos % T``. numpy does this ``(B, max_k)`` arithmetic
        in a few vector operations where torch paid its per-op dispatch a dozen times (about 8x less
        plan time at 8 x 2,048 keys). The groups of the layer's gather family (cut from one life cycle)
        get their slots from the same operations over their stacked tables.
        """
        r = self.route(layer)
        key = (r.group, r.window)
        plan = self._gathers.get(key)
        if plan is not None:
            return plan
        g = self.pools.groups[r.group]
        if g.compress_rate is not None:
            raise ValueError(f"group {r.group!r} is compressed; paged attention does not read compressed entries")
        family = self._gather_family[r.group]
        T, E = g.tokens_per_block, self.pools.block_slots[r.group]  # E: a block's slots (entries_per_block but in
        # a slab arena, whose layer views step over the other layers' entries between two blocks)
        w = self._window_keys(r.window)
        lo, k_len, max_k, k_valid = w.lo, w.k_len, w.max_k, w.k_valid
        tables = self._stack(family)  # (groups, B, width)
        if not lo.any():  # every sequence reads from position 0: whole blocks, T slots at a time
            nblk = -(-max_k // T)
            blocks = tables[:, :, :nblk]
            need = np.arange(nblk)[None, :] < -(-k_len // T)[:, None]
            missing = need & (blocks < 0)
            if missing.any():
                f, b, i = (int(x[0]) for x in missing.nonzero())
                raise ValueError(f"sequence {b}: group {family[f]!r} has no block for position {i * T}, which "
                                 f"attention needs (logical block {i} is -1: released or never allocated)")
            every_slot = np.empty((*blocks.shape, T), dtype=np.int64)  # in place: see the note below
            np.multiply(blocks[..., None], E, out=every_slot)
            every_slot += np.arange(T)
            slots = every_slot.reshape(len(family), self.num_seqs, -1)
            if slots.shape[2] != max_k:
                slots = np.ascontiguousarray(slots[:, :, :max_k])
            if w.padded:
                np.copyto(slots, slots[:, :, :1], where=~k_valid)
        else:
            split = self._split_pos.get((r.window, T, tables.shape[2]))
            if split is None:  # the same for every group of the window: block index and offset of each key
                pos = np.where(k_valid, w.k_pos, lo[:, None]) if w.padded else w.k_pos
                blk = pos // T
                flat = blk + np.arange(self.num_seqs)[:, None] * tables.shape[2]  # row-major index into (B, width)
                split = self._split_pos[(r.window, T, tables.shape[2])] = (pos, blk, pos % T, flat)
            pos, blk, off, flat = split
            # (groups, B, max_k): one take over the flattened rows (numpy's mixed slice/fancy indexing is slower)
            blocks = np.take(tables.reshape(len(family), -1), flat, axis=1)
            if blocks.min() < 0:  # padding reads the row's first key, which is always needed
                f, b, i = (int(x[0]) for x in (blocks < 0).nonzero())
                p = int(pos[b, i])
                raise ValueError(f"sequence {b}: group {family[f]!r} has no block for position {p}, which attention "
                                 f"needs (logical block {p // T} is -1: released or never allocated)")
            blocks *= E
            blocks += off
            slots = blocks
        # Why in place: at these sizes (groups x B x keys int64, ~1 MB for 31 groups) every temporary a
        # ``blocks * E + off`` expression allocates is fresh memory the kernel maps page by page; two
        # temporaries cost ~10x the arithmetic itself (1.5 ms vs 0.15 ms, 26 groups x 8 x 512 keys).
        # Padding reads the row's first key: pools come from torch.empty, and a masked key whose value
        # is NaN still poisons the output (0 * NaN). Each row's first key is always real.
        for name, one in zip(family, self._per_group(slots), strict=True):
            self._gathers[(name, r.window)] = KeyGather(one, w.mask, max_k, k_len, lo, one.view(-1))
        return self._gathers[key]

    # --- what the attention function calls -----------------------------------------------

    def _views(self, r: LayerRoute, kv_heads: int = 0, head_dim: int = 0) -> tuple[torch.Tensor, ...]:
        """A layer's pool as ``(slots, entry_elems)``, and with ``kv_heads`` its K and V as ``(1, kv_heads, slots, d)``.

        Views of the pool tensors, built once per pools and layer and kept on the pools (``BlockPools.views``,
        dropped by ``release``): a step used to slice and view every layer's pool again for its write and
        for its gather, 4-6 dispatched torch calls per layer per step for the same views.
        """
        key = (r.layer, kv_heads, head_dim)
        views = self.pools.views.get(key)
        if views is not None:
            return views
        entries = self.pools.layer_slots(r.group, r.layer_pos)
        if entries.shape[1] != r.entry_elems:  # V1's uniform pool is as wide as the widest layer
            entries = entries[:, : r.entry_elems]
        views = (entries,)
        if kv_heads:
            if 2 * kv_heads * head_dim != r.entry_elems:
                raise ValueError(f"layer {r.layer}: K/V of {kv_heads} heads x {head_dim} need entries of "
                                 f"{2 * kv_heads * head_dim} elements; the KV layout gives {r.entry_elems}")
            kv = entries.view(entries.shape[0], 2, kv_heads, head_dim)  # pools.py: K at index 0, V at 1
            views = (entries, kv[:, 0].transpose(0, 1).unsqueeze(0), kv[:, 1].transpose(0, 1).unsqueeze(0))
        self.pools.views[key] = views
        return views

    def write(self, layer: int, entries: torch.Tensor) -> None:
        """Store the new tokens' entries ``(N, entry_elems)`` of a layer at their slots (cast to the pool dtype)."""
        r = self.route(layer)
        if entries.shape != (self.num_tokens, r.entry_elems):
            raise ValueError(f"layer {layer}: entries of shape {tuple(entries.shape)}, expected "
                             f"({self.num_tokens}, {r.entry_elems}) from the KV layout")
        _store(self._views(r)[0], 0, self.write_slots(r.group), entries)

    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the new tokens' K and V as the model made them, ``(1, kv_heads, N, head_dim)`` each.

        One ``index_copy_`` each, straight into the pool's K and V views: no stacking of K and V into
        entries first (a copy, and three more dispatched calls per layer).
        """
        r = self.route(layer)
        if key.shape[0] != 1 or key.shape[2] != self.num_tokens or value.shape != key.shape:
            raise ValueError(f"layer {layer}: K/V of shapes {tuple(key.shape)} and {tuple(value.shape)}, expected "
                             f"(1, kv_heads, {self.num_tokens}, head_dim) each")
        _, k, v = self._views(r, key.shape[1], key.shape[3])
        slots = self.write_slots(r.group)
        _store(k, 2, slots, key)
        _store(v, 2, slots, value)

    def gather(self, layer: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The entries of the keys a layer's queries may see: ``(B, max_k, entry_elems)``."""
        r = self.route(layer)
        plan = self._gather(layer)
        out = self._views(r)[0].index_select(0, plan.flat).view(self.num_seqs, plan.max_k, r.entry_elems)
        return out if dtype is None or out.dtype == dtype else out.to(dtype)

    def gather_kv(self, layer: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the keys a layer's queries may see: ``(B, kv_heads, max_k, head_dim)`` each, from one gather."""
        r = self.route(layer)
        plan = self._gather(layer)
        out = self._views(r)[0].index_select(0, plan.flat).view(self.num_seqs, plan.max_k, 2, kv_heads, head_dim)
        if dtype is not None and out.dtype != dtype:
            out = out.to(dtype)
        k, v = out.unbind(2)
        return k.transpose(1, 2), v.transpose(1, 2)

    def mask(self, layer: int) -> torch.Tensor | None:
        """``(B, 1, max_q, max_k)`` bool: which gathered key each padded query sees; None when it sees every key."""
        return self._gather(layer).mask

    def bias(self, layer: int, dtype: torch.dtype) -> torch.Tensor | None:
        """:meth:`mask` as SDPA's additive form in ``dtype`` (0 where a query sees a key, -inf elsewhere), or None.

        SDPA turns a boolean mask into this form itself, on every call: 2 ``scalar_tensor`` + ``where``
        + a cast per layer of a step whose sequences see unequal key counts. Built once per step and
        window here instead.
        """
        mask = self._gather(layer).mask
        if mask is None:
            return None
        key = (self.route(layer).window, dtype)
        bias = self._biases.get(key)
        if bias is None:
            bias = self._biases[key] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
                mask.logical_not(), float("-inf"))
        return bias

    def pad_queries(self, q: torch.Tensor) -> torch.Tensor:
        """Packed ``(N, H, d)`` → padded ``(B, H, max_q, d)``."""
        if self.max_q == 1:  # pure decode: one query per sequence, no padding
            return q.unsqueeze(2)
        padded = q.new_zeros(self.num_seqs * self.max_q, *q.shape[1:])
        padded.index_copy_(0, self._q_row, q)
        return padded.view(self.num_seqs, self.max_q, *q.shape[1:]).transpose(1, 2)

    def split_plan(self, layer: int) -> list[tuple[int, int, int, int, bool]] | None:
        """How to attend a step's queries without padding them to ``(B, max_q)``, or None to pad.

        A step that mixes prefill chunks of unequal lengths pads every sequence's queries to the
        longest chunk and its keys to the longest context: ``B * max_q * max_k`` scores where the
        sequences need ``Σ n_b * k_b`` (one 200-token prompt beside six short ones computes ~4x the
        scores it needs). When the padding at least doubles the work, each multi-token chunk attends
        on its own, over its own keys, and the one-token (decode) rows attend together:
        ``[(first packed token, tokens, first sequence, sequences, pure causal), ...]``.
        """
        if self.max_q == 1:
            return None
        if layer in self._splits:
            return self._splits[layer]
        plan = self._gather(layer)
        n, k_len = self._n_np, plan.k_len
        parts: list[tuple[int, int, int, int, bool]] | None = None
        if self.num_seqs * self.max_q * plan.max_k >= 2 * int((n * k_len).sum()):
            window = self.route(layer).window
            first = np.cumsum(n) - n
            parts = []
            for b in range(self.num_seqs):
                if n[b] == 1:
                    last = parts[-1] if parts else None
                    if last is not None and last[1] == last[3] and last[2] + last[3] == b:  # extend a decode run
                        parts[-1] = (last[0], last[1] + 1, last[2], last[3] + 1, False)
                    else:
                        parts.append((int(first[b]), 1, b, 1, False))
                    continue
                # a chunk from position 0 with no window sees exactly the causal triangle of its keys
                causal = int(self._start_np[b]) == 0 and window is None and int(k_len[b]) == int(n[b])
                parts.append((int(first[b]), int(n[b]), b, 1, causal))
        self._splits[layer] = parts
        return parts

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        """Padded ``(B, H, max_q, d)`` → packed ``(N, H, d)``."""
        if self.max_q == 1:
            return out.squeeze(2)
        rows = out.transpose(1, 2).reshape(self.num_seqs * self.max_q, out.shape[1], out.shape[3])
        return rows.index_select(0, self._q_row)


def write_kv(batch: PagedBatch, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Store new K and V ``(N, kv_heads, head_dim)`` as one ``(2, kv_heads, head_dim)`` entry per token."""
    batch.write_kv(layer, key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float | None = None) -> torch.Tensor:
    """Masked attention of padded queries ``(B, H, max_q, d)`` over keys ``(B, Hkv, max_k, d)`` (GQA when H > Hkv).

    ``mask``: boolean (True = the query sees the key) or additive (:meth:`PagedBatch.bias`), or None.
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads")
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads)
    # SDPA has no logit soft-capping (Gemma 2): tanh-cap the scores before the mask
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def attend_packed(batch: PagedBatch, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  softcap: float | None = None) -> torch.Tensor:
    """Packed queries ``(N, H, d)`` over gathered keys ``(B, Hkv, max_k, d)``: packed ``(N, H, d_v)``.

    Pads the queries to ``(B, H, max_q, d)`` for one call, unless :meth:`PagedBatch.split_plan` says the
    padding would at least double the work; then each prefill chunk attends alone over its own keys
    (a chunk from position 0 with no window as SDPA's causal triangle, which skips the blocks above it)
    and runs of decode rows attend together.
    """
    parts = batch.split_plan(layer)
    mask = batch.bias(layer, q.dtype)
    if parts is None:
        return batch.unpad(attend(batch.pad_queries(q), k, v, mask, scale, softcap))
    k_len = batch._gather(layer).k_len
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    for first, tokens, s0, count, causal in parts:
        if count > 1 or tokens == 1:  # decode rows: one query each, keys padded to the longest of them
            width = int(k_len[s0:s0 + count].max())
            qs = q[first:first + tokens].unsqueeze(2)
            m = mask[s0:s0 + count, :, :1, :width] if mask is not None else None
            res = attend(qs, k[s0:s0 + count, :, :width], v[s0:s0 + count, :, :width], m, scale, softcap)
            out[first:first + tokens] = res.squeeze(2)
            continue
        width = int(k_len[s0])
        qs = q[first:first + tokens].transpose(0, 1).unsqueeze(0)  # (1, H, n, d)
        ks, vs = k[s0:s0 + 1, :, :width], v[s0:s0 + 1, :, :width]
        if causal and softcap is None:
            res = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                 enable_gqa=qs.shape[1] != ks.shape[1])
        else:
            m = mask[s0:s0 + 1, :, :tokens, :width] if mask is not None else None
            res = attend(qs, ks, vs, m, scale, softcap)
        out[first:first + tokens] = res[0].transpose(0, 1)
    return out


def attend_compiled(batch: PagedBatch, layer: int, query: torch.Tensor, kv_heads: int, head_dim: int, scale: float,
                    softcap: float | None) -> torch.Tensor | None:
    """The compiled path's output, or None when it could not compile (the batch then stays on gather + SDPA)."""
    from cache_backends.flex_paged import FlexUnavailable

    try:
        return batch.flex.attend(batch, layer, query, kv_heads, head_dim, scale, softcap)
    except FlexUnavailable:
        batch.flex = None  # its ``failed`` says why; the executor reports it
        return None


def paged_attention(batch: PagedBatch, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    scale: float, softcap: float | None = None) -> torch.Tensor:
    """One layer of a step: write the new K/V, gather the visible K/V, attend. Packed ``(N, heads, d)`` in and out.

    A batch planned with ``flex=`` attends on the compiled path instead (no gather); one planned with
    ``decode_kernel=`` attends a decode-only step's full and sliding layers on that paged decode kernel.
    """
    out = attend_in_place(batch, layer, query, key, value, scale, softcap)
    if out is not None:
        return out
    k, v = batch.gather_kv(layer, key.shape[1], key.shape[2], query.dtype)
    return attend_packed(batch, layer, query, k, v, scale, softcap)


def attend_in_place(batch: PagedBatch, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    scale: float, softcap: float | None = None) -> torch.Tensor | None:
    """Store a full or sliding layer's new K/V ``(N, kv_heads, d)`` and attend where the step reads the pools in
    place — the compiled path, a decode step on the paged decode kernel (which may store the K/V itself), a mixed
    step's decode rows on it: packed ``(N, heads, d)``, or None when the caller must gather (K/V stored either way).
    """
    written = batch.flex is not None
    if written:
        write_kv(batch, layer, key, value)
        out = attend_compiled(batch, layer, query, key.shape[1], key.shape[2], scale, softcap)
        if out is not None:
            return out
    if batch.decode_kernel is not None:
        out = batch.attend_decode(layer, query, key, value, scale, softcap, written)  # writes K/V unless written
        if out is not None:
            return out
    if not written:
        write_kv(batch, layer, key, value)
    if batch.decode_kernel is not None:
        return batch.attend_mixed(layer, query, key.shape[1], key.shape[2], scale, softcap)
    return None


def attend_latent(batch: PagedBatch, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kv: torch.Tensor,
                  scale: float) -> torch.Tensor | None:
    """MLA on the compiled path in the absorbed form: packed ``(N, H, d_v)``, or None when it could not compile.

    ``q_nope`` ``(N, H, nope)`` and ``q_pe`` ``(N, H, rope)`` are the queries' two parts; ``w_kv`` is
    ``kv_b_proj.weight`` per head, ``(H, nope + d_v, rank)``: its key half ``W_UK`` then its value half
    ``W_UV``. A head's score against a cached token is ``q_nope · (W_UK latent) + q_pe · rope`` =
    ``[q_nope W_UK | q_pe] · [latent | rope]``, and its output ``W_UV Σ p latent``: so the kernel reads the
    cached ``[latent | rope]`` rows as one shared KV head (keys; their latents as values) and nothing is
    expanded per cached token — the per-token work is on the new queries only (DeepSeek's "absorbed" MLA).
    """
    from cache_backends.flex_paged import FlexUnavailable

    query = _fold_queries(q_nope, q_pe, w_kv)
    try:
        out = batch.flex.attend_latent(batch, layer, query, w_kv.shape[-1], scale)  # (N, H, rank)
    except FlexUnavailable:
        batch.flex = None  # its ``failed`` says why; the executor reports it
        return None
    return _unfold_outputs(out, w_kv, q_nope.shape[-1])


def _fold_queries(q_nope: torch.Tensor, q_pe: torch.Tensor, w_kv: torch.Tensor) -> torch.Tensor:
    """Queries folded into latent space, ``[q_nope W_UK | q_pe]``: ``(N, H, rank + rope)``."""
    q_lat = torch.matmul(q_nope.transpose(0, 1), w_kv[:, :q_nope.shape[-1]])  # (H, N, rank)
    return torch.cat((q_lat.transpose(0, 1), q_pe.to(q_lat.dtype)), dim=-1)


def _unfold_outputs(out: torch.Tensor, w_kv: torch.Tensor, nope: int) -> torch.Tensor:
    """Latent-space outputs ``(N, H, rank)`` up-projected through ``W_UV``, the value half: ``(N, H, d_v)``."""
    return torch.matmul(out.transpose(0, 1), w_kv[:, nope:].transpose(1, 2)).transpose(0, 1)


#: How many MLA layer calls gather + SDPA served absorbed (:func:`attend_latent_gathered`) and expanded (the latents
#: through ``kv_b_proj``), since the process started: tests read it to see which form really ran.
MLA_CALLS: dict[str, int] = {"absorbed": 0, "expanded": 0}

#: How fast absorbed MLA over gathered latents does a query-key pair's multiply-adds (small batched matmuls:
#: each sequence's ``H * max_q`` query rows against its own latents) against the expanded form's GEMMs
#: (``kv_b_proj`` over every gathered latent, then SDPA). Both run as plain matmuls here, so near 1; see
#: BENCHMARKS.md ("MLA on gather + SDPA, absorbed").
GATHERED_ABSORBED_RATE = 1.0


def absorbed_costs_less(batch: PagedBatch, rank: int, rope: int, nope: int, dv: int, rate: float,
                        padded: bool = False, fold: bool = False) -> bool:
    """Whether a step's MLA layers cost fewer multiply-adds absorbed than expanded (``rate``: absorbed's speed).

    Absorbed, each (query, key) pair costs ``2 * rank + rope`` per head (the latent row's dot product and
    its latent's share of the output); expanded, each key costs ``rank * (nope + dv)`` per head once per
    step, plus ``nope + rope + dv`` per pair. ``padded``: the absorbed form scores every sequence's padded
    queries against the longest context (gather + SDPA pads; the compiled kernel skips what no query sees).
    ``fold``: count the absorbed form's per-query work too, ``rank * (nope + dv)`` per head (folding the query
    through ``W_UK``, up-projecting its output through ``W_UV``) — as much as expanding one key, so a chunk
    from position 0 (as many queries as keys) never pays absorbed, as gather + SDPA measured.
    """
    pairs, keys = batch.attention_work()
    absorbed = pairs
    if padded:  # what attend_latent_gathered scores: padded, unless padding would double the work (split_plan)
        square = batch.num_seqs * batch.max_q * int(batch._end_np.max())
        absorbed = square if square < 2 * pairs else pairs
    per_query = batch.num_tokens * rank * (nope + dv) if fold else 0
    return (per_query + absorbed * (2 * rank + rope)
            <= rate * (keys * rank * (nope + dv) + pairs * (nope + rope + dv)))


def _absorbed(query: torch.Tensor, entries: torch.Tensor, bias: torch.Tensor | None, scale: float,
              rank: int) -> torch.Tensor:
    """Folded queries ``(B, q, H, rank + rope)`` over gathered rows ``(B, k, rank + rope)``: ``(B, q, H, rank)``.

    ``bias``: ``(B, 1, q, k)`` additive (:meth:`PagedBatch.bias`), one row per query shared by its heads, or None.
    A sequence's ``q * H`` query rows (query i, head h: row ``i * H + h``) are the rows of one matmul.
    """
    B, q, H, _ = query.shape
    scores = torch.matmul(query.reshape(B, q * H, -1), entries.transpose(1, 2)).view(B, q, H, -1)
    scores.mul_(scale)
    if bias is not None:
        scores.add_(bias.transpose(1, 2))
    if scores.dtype in (torch.float16, torch.bfloat16):  # softmax in float32, as SDPA's math does
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.view(B, q * H, -1), entries[..., :rank]).view(B, q, H, rank)


def attend_latent_gathered(batch: PagedBatch, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                           w_kv: torch.Tensor, scale: float) -> torch.Tensor:
    """MLA over the gathered latents in the absorbed form, in plain matmuls: packed ``(N, H, d_v)``.

    The form of :func:`attend_latent` without a compiled kernel: the latents are gathered once,
    ``(B, max_k, rank + rope)``, and serve as one KV head shared by every query head, so a sequence's
    ``max_q * H`` folded queries are the rows of one ``(rows, rank + rope) x (rank + rope, max_k)`` product
    and their softmax the rows of one product with the latents; nothing is expanded per cached token.
    Padded query rows are dropped at the end (the mask lets each see one key, so they stay finite); where
    padding would at least double the work (:meth:`PagedBatch.split_plan`) each prefill chunk attends alone
    over its own keys and the decode rows together, as :func:`attend_packed` does.
    """
    rank = w_kv.shape[-1]
    entries = batch.gather(layer, q_nope.dtype)  # (B, max_k, rank + rope)
    query = _fold_queries(q_nope, q_pe, w_kv)  # (N, H, rank + rope)
    B, H, max_q = batch.num_seqs, query.shape[1], batch.max_q
    bias = batch.bias(layer, query.dtype)  # (B, 1, max_q, max_k): one row per query, shared by the heads
    parts = batch.split_plan(layer)
    if parts is not None:  # padding would at least double the work: each chunk alone, decode rows together
        k_len = batch._gather(layer).k_len
        out = query.new_empty(query.shape[0], H, rank)
        for first, tokens, s0, count, _ in parts:
            rows = 1 if tokens == count else tokens  # decode rows: one query per sequence
            width = int(k_len[s0:s0 + count].max())
            q = query[first:first + tokens].view(count, rows, H, -1)
            b = bias[s0:s0 + count, :, :rows, :width] if bias is not None else None
            out[first:first + tokens] = _absorbed(q, entries[s0:s0 + count, :width], b, scale, rank).flatten(0, 1)
    else:
        if max_q > 1:  # pad to (B * max_q, H, ·): sequence b's query i is row b * max_q + i
            padded = query.new_zeros(B * max_q, H, query.shape[-1])
            padded.index_copy_(0, batch._q_row, query)
            query = padded
        out = _absorbed(query.view(B, max_q, H, -1), entries, bias, scale, rank).view(B * max_q, H, rank)
        if max_q > 1:
            out = out.index_select(0, batch._q_row)
    MLA_CALLS["absorbed"] += 1
    return _unfold_outputs(out, w_kv, q_nope.shape[-1])


def mla_paged_attention(batch: PagedBatch, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                        latent: torch.Tensor, rope: torch.Tensor, w_kv: torch.Tensor, scale: float,
                        absorbed: bool | None = None) -> torch.Tensor:
    """One MLA layer of a step: write the new ``[latent | rope]`` entries, attend. Packed ``(N, H, d_v)`` out.

    ``latent`` ``(N, rank)`` and ``rope`` ``(N, rope)`` are the new tokens' cache parts (the roped key part
    shared by every head); ``w_kv`` is ``kv_b_proj.weight`` per head, ``(H, nope + d_v, rank)``. On the
    compiled path (a batch planned with ``flex=``) the absorbed form (:func:`attend_latent`); on gather + SDPA
    the absorbed form over the gathered latents (:func:`attend_latent_gathered`) where it costs less
    (:func:`absorbed_costs_less`; ``absorbed`` forces the choice), else the gathered latents are expanded into
    per-head K/V as transformers' DeepSeek does (one ``kv_b_proj`` over every visible latent) for SDPA.
    """
    batch.write(layer, torch.cat((latent, rope), dim=-1))
    if batch.flex is not None:
        out = attend_latent(batch, layer, q_nope, q_pe, w_kv, scale)
        if out is not None:
            return out
    heads, nope, rank = w_kv.shape[0], q_nope.shape[-1], w_kv.shape[-1]
    if absorbed is None:
        dv = w_kv.shape[1] - nope
        absorbed = absorbed_costs_less(batch, rank, q_pe.shape[-1], nope, dv, GATHERED_ABSORBED_RATE, padded=True,
                                       fold=True)
    if absorbed:
        return attend_latent_gathered(batch, layer, q_nope, q_pe, w_kv, scale)
    MLA_CALLS["expanded"] += 1
    entries = batch.gather(layer, q_nope.dtype)  # (B, max_k, rank + rope)
    kv = F.linear(entries[..., :rank], w_kv.view(-1, rank)).unflatten(-1, (heads, -1)).transpose(1, 2)
    k_nope, v = kv[..., :nope], kv[..., nope:]  # (B, H, max_k, ·)
    k = torch.cat((k_nope, entries[:, None, :, rank:].expand(-1, heads, -1, -1)), dim=-1)
    return attend_packed(batch, layer, torch.cat((q_nope, q_pe), dim=-1), k, v, scale)
