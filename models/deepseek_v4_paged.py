"""DeepSeek V4 over kvload's block pools: its attention layers in a packed forward, and the per-request side state.

transformers' ``DeepseekV4Attention`` does three things per layer: sliding-window attention where K == V (every
layer), a compressor that pools every ``c`` tokens' projections into one compressed entry (HCA: ``c = 128``
non-overlapping; CSA: ``c = 4`` with an overlap series, plus a lightning indexer that keeps each query's top-k
compressed entries), and one softmax with a learned sink over the window keys and the visible compressed entries.
Its compressed masks (``block_bias``) only reach the softmax through a tensor ``attention_mask``, which the
``kvload_paged`` attention function never gets, so kvload runs this layer's forward itself (:func:`paged_v4_forward`,
installed per module by :func:`route_v4_attention`; a forward without a ``kvload_batch`` runs transformers' own):

* the raw window entry (K == V, ``head_dim``) of every packed token goes into the V2 window group at the request's
  slots; each sequence attends over the last ``sliding_window`` of them, gathered from the pool (the manager
  releases blocks that left the window, as for Mistral);
* the compressed entries go into the layer's compressed group, entry ``w`` of a sequence at
  ``table[w * c // tokens_per_block] * block_slots + w % entries_per_block`` (``BlockPools.block_slots``: a block's
  slots in a layer's view, ``entries_per_block`` but in a slab arena; a CSA entry holds the compressor's ``head_dim``
  then the indexer's ``index_head_dim``); kvload pools them with the weights of the
  model's own compressor and indexer modules and their math (:func:`_pool_windows`), writes them into the pool and
  reads every entry so far back from it;
* what is not yet a full entry — the partial window of raw ``kv``/``gate`` projections (fewer than ``c`` tokens per
  compressor series) and CSA's overlap state (the last full window's first-half series) — lives in a per-request
  :class:`V4SequenceState` that the executor owns (:class:`V4States`) and drops when the request finishes, like a
  recurrent model's state;
* prefix reuse (like SGLang's state caching for hybrid models): at every multiple of the manager's reuse unit (a
  multiple of every group's block span, so of every compress rate: no series has a partial window there) a chunk that
  crosses it snapshots what the blocks cannot give back, CSA's overlap series (:class:`V4Snapshots`, keyed by the
  window group's block that ends there and the prefix's digest, dropped once that block leaves the radix tree); the
  manager reuses a cached prefix only up to a length with a snapshot (``limit_reuse``), and the request's side state
  is rebuilt from it.

The projections, MoE and hyper-connections run on the packed row. A step's one-token (decode) chunks attend in one
call (:func:`_decode_attention`): window keys and compressed entries padded to the longest, ``-inf`` on the padding,
their compressor and indexer batched (:func:`_absorb`, which pools a window that fills as the model's compressor does).
The other chunks (several tokens, or one that crosses a reuse boundary: it snapshots) are cut into tiles of up to
:data:`PREFILL_TILE` queries that attend together (:func:`_prefill_attention`): each tile over the window keys its
queries need (not its whole chunk's) and its sequence's compressed entries, padded to the most; their compressor and
indexer run over every chunk at once (:func:`_absorb_chunks`: one projection, every window that fills pooled in one
call).
"""

from __future__ import annotations

import array
import hashlib
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs
import torch

from cache_backends.layout import V4_KINDS

ATTENTION_CLASS = "DeepseekV4Attention"
#: Why generate drafts nothing for DeepSeek V4 (the ``setting_ignored`` reason for ``max_draft_len``).
V4_NO_DRAFTS = ("a rejected draft token would stay in DeepSeek V4's compressor side state, which kvload cannot roll "
                "back; generate decodes one token per step")


@attrs.define
class _Series:
    """One compressor series of one layer ("compressor", or CSA's "indexer"): what is not a full entry yet."""

    count: int = 0  # entries emitted (and stored in the pool) so far
    buf_kv: torch.Tensor | None = None  # (1, < c, width): projections of the tokens after the last full window
    buf_gate: torch.Tensor | None = None
    overlap_kv: torch.Tensor | None = None  # CSA: (1, c, head_dim) first-half series of the last full window
    overlap_gate: torch.Tensor | None = None

    def clone(self) -> _Series:
        """A deep copy (a forked sample continues from the same prompt state)."""
        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.clone()
        return _Series(self.count, copy(self.buf_kv), copy(self.buf_gate), copy(self.overlap_kv),
                       copy(self.overlap_gate))


@attrs.define
class V4SequenceState:
    """One request's DeepSeek V4 side state: the tokens it has absorbed and, per compressed layer, its series."""

    pos: int = 0
    layers: dict[int, dict[str, _Series]] = attrs.Factory(dict)
    #: reuse boundaries the step's chunk crosses (positions to snapshot at), and the snapshots taken there: position ->
    #: layer -> series (entry count and CSA's overlap; no partial window at a boundary), filed by the executor
    marks: tuple[int, ...] = ()
    captured: dict[int, dict[int, dict[str, _Series]]] = attrs.Factory(dict)

    def clone(self) -> V4SequenceState:
        """A deep copy (of the state, not of the step's snapshots)."""
        return V4SequenceState(self.pos, _copy_layers(self.layers))

    def nbytes(self) -> int:
        """Bytes of the tensors held."""
        return sum(t.numel() * t.element_size() for series in self.layers.values() for s in series.values()
                   for t in (s.buf_kv, s.buf_gate, s.overlap_kv, s.overlap_gate) if t is not None)


def _copy_layers(layers: dict[int, dict[str, _Series]]) -> dict[int, dict[str, _Series]]:
    """A deep copy of a state's series (a snapshot is restored into, and forked from, copies)."""
    return {i: {n: s.clone() for n, s in series.items()} for i, series in layers.items()}


def prefix_digest(salt: str | None, tokens: Sequence[int]) -> bytes:
    """What identifies a prefix a snapshot belongs to: its scope (salt) and token ids."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(salt).encode())
    h.update(array.array("q", tokens).tobytes())
    return h.digest()


@attrs.define
class V4Snapshot:
    """The side state of a prefix at a reuse boundary ``pos``: what its cached blocks cannot give back."""

    pos: int
    digest: bytes
    layers: dict[int, dict[str, _Series]]


class V4Snapshots:
    """Snapshots of cached prefixes, one per block of the window group that ends at a reuse boundary, kept while that
    block holds what it held when the snapshot was taken (its generation) and is cached or held by a request
    (:meth:`prune`): once no request runs, never more of them than such blocks in the prefix cache, and none after
    ``reset_prefix_cache``."""

    def __init__(self, tokens_per_block: int) -> None:
        self.T = tokens_per_block
        self.by_block: dict[int, tuple[int, V4Snapshot]] = {}  # block -> (its generation, snapshot)

    def __len__(self) -> int:
        return len(self.by_block)

    def put(self, block: int, gen: int, snapshot: V4Snapshot) -> None:
        """Keep ``snapshot`` with the window-group ``block`` (of generation ``gen``) that ends at its position."""
        self.by_block[block] = (gen, snapshot)

    def get(self, block: int, gen: int, pos: int, digest: Callable[[], bytes]) -> V4Snapshot | None:
        """The snapshot at ``pos`` kept with ``block`` at generation ``gen`` of the prefix whose :func:`prefix_digest`
        ``digest()`` gives, or None; the prefix is hashed only where such a snapshot is kept (2 ms at 32k tokens, and
        the manager asks about every boundary down from the longest)."""
        got = self.by_block.get(block)
        if got is None or got[0] != gen or got[1].pos != pos or got[1].digest != digest():
            return None
        return got[1]

    def prune(self, life: Callable[[int], tuple[int, int | None, bool]]) -> None:
        """Drop the snapshots whose block was handed out again, or is neither cached where they put it nor held
        (``life(block)``: the manager's ``block_life`` of the window group)."""
        T = self.T
        gone = []
        for b, (gen, snap) in self.by_block.items():
            now, at, held = life(b)
            if now != gen or not (at == snap.pos // T - 1 or (at is None and held)):
                gone.append(b)
        for b in gone:
            del self.by_block[b]

    def move(self, pairs: Sequence[tuple[int, int]], gen: Callable[[int], int]) -> None:
        """Blocks moved to other ids (a slab arena's compaction, ``(old, new)``, the same bytes): a snapshot kept with
        ``old`` at its generation then (``gen(old)``: unchanged by a move) goes with ``new`` at ``gen(new)``."""
        by_block = self.by_block
        for old, new in pairs:
            got = by_block.pop(old, None)
            if got is not None and got[0] == gen(old):
                by_block[new] = (gen(new), got[1])

    def clear(self) -> None:
        """Drop every snapshot."""
        self.by_block.clear()


class V4States:
    """Per-request DeepSeek V4 side state, owned by the executor: created at a request's first chunk, dropped when
    it finishes (:meth:`free`, :meth:`keep_only`, :meth:`clear`). With a reuse ``unit`` (prefix reuse on), a chunk
    that crosses a multiple of it snapshots its state there (:class:`V4Snapshots`)."""

    def __init__(self, unit: int | None = None, tokens_per_block: int = 1) -> None:
        self.states: dict[str, V4SequenceState] = {}
        self.unit = unit
        self.snapshots = V4Snapshots(tokens_per_block)

    def restore(self, req_id: str, snapshot: V4Snapshot) -> None:
        """``req_id`` continues a reused prefix from its snapshot (entries before it are in the pools)."""
        self.states[req_id] = V4SequenceState(snapshot.pos, _copy_layers(snapshot.layers))

    def __len__(self) -> int:
        return len(self.states)

    def for_step(self, req_ids: Sequence[str], starts: Sequence[int]) -> list[V4SequenceState]:
        """The states of a step's chunks, in order: a chunk from position 0 starts afresh (a new or preempted
        request); one that continues must find its state at its start position (one line otherwise: never a guess)."""
        out = []
        for req_id, start in zip(req_ids, starts, strict=True):
            state = self.states.get(req_id)
            if start == 0:
                state = self.states[req_id] = V4SequenceState()
            elif state is None or state.pos != start:
                have = "none" if state is None else f"one at position {state.pos}"
                raise RuntimeError(f"request {req_id}: DeepSeek V4 continues at position {start}, but its compressor "
                                   f"side state is {have}, and no snapshot of it was kept; kvload cannot rebuild it "
                                   "(speculative decoding and beam search are off for DeepSeek V4 for this reason)")
            out.append(state)
        return out

    def mark(self, states: Sequence[V4SequenceState], starts: Sequence[int], lengths: Sequence[int]) -> None:
        """Set the reuse boundaries each chunk crosses (where its forward snapshots the state)."""
        unit = self.unit
        for state, start, n in zip(states, starts, lengths, strict=True):
            state.captured = {}
            state.marks = tuple(range((start // unit + 1) * unit, start + n + 1, unit)) if unit else ()

    def copy(self, src: str, dst: str) -> None:
        """``dst`` continues from ``src``'s state (a sample forked from a prompt's first one)."""
        self.states[dst] = self.states[src].clone()

    def free(self, req_id: str) -> None:
        """Drop a finished request's state."""
        self.states.pop(req_id, None)

    def keep_only(self, req_ids: Iterable[str]) -> None:
        """Drop every state but these requests'."""
        keep = set(req_ids)
        for req_id in [r for r in self.states if r not in keep]:
            del self.states[req_id]

    def clear(self) -> None:
        """Drop every state."""
        self.states.clear()


def uses_v4(layers: Iterable[Any]) -> bool:
    """Whether a KV layout's layers are DeepSeek V4's (their forwards need :class:`V4SequenceState`)."""
    return any(layer.kind in V4_KINDS for layer in layers)


def _groups(batch: Any, layer: int) -> tuple[tuple[str, int], tuple[str, int] | None]:
    """(window group, position) and (compressed group, position) or None of a V4 layer."""
    window = compressed = None
    for name, pos in batch.pools.layer_index[layer]:
        if batch.pools.groups[name].compress_rate is None:
            window = (name, pos)
        else:
            compressed = (name, pos)
    if window is None:
        raise RuntimeError(f"layer {layer}: no window group in the KV layout (DeepSeek V4 generates on V2 only)")
    return window, compressed


@attrs.define
class _DecodePlan:
    """The step's one-token chunks that attend together (see :func:`_decode_attention`): their packed rows and
    positions, and their window keys' slots, padded to the longest window with a validity mask."""

    seqs: list[int]  # chunk indices, in packed order
    rows: torch.Tensor  # (B,) packed rows
    pos: list[int]  # each one's position
    pos_ids: torch.Tensor  # (B, 1) positions (the compressor's and indexer's rope)
    slots: torch.Tensor  # (B, W) window slots (padding: slot 0, masked)
    valid: torch.Tensor  # (B, W) bool
    mask: torch.Tensor  # (B, 1, 1, W) additive mask: -inf on padding


def _packed_rows(batch: Any) -> Iterator[tuple[int, int, int, int]]:
    """Each chunk of the step as (its index, its first row in the packed tokens, its tokens, its first position)."""
    first = 0
    for b, chunk in enumerate(batch.chunks):
        n = len(chunk.token_ids)
        yield b, first, n, chunk.start_pos
        first += n


def _decode_plan(batch: Any, group: Any, table: torch.Tensor, window: int, dtype: torch.dtype,
                 device: torch.device, position_ids: torch.Tensor) -> _DecodePlan | None:
    """The step's decode plan (None when no chunk qualifies): a one-token chunk that snapshots nothing this step."""
    seqs, rows, pos = [], [], []
    for b, first, n, start in _packed_rows(batch):
        if n == 1 and not batch.side[b].marks:
            seqs.append(b)
            rows.append(first)
            pos.append(start)
    if not seqs:
        return None
    T, stride = group.tokens_per_block, batch.pools.block_slots[group.name]
    lows = [max(0, p - window + 1) for p in pos]
    width = max(p - lo + 1 for p, lo in zip(pos, lows, strict=True))
    k = torch.arange(width)
    k_pos = torch.tensor(lows)[:, None] + k[None, :]
    valid = k_pos <= torch.tensor(pos)[:, None]
    k_pos = torch.where(valid, k_pos, 0)
    blocks = table[torch.tensor(seqs)[:, None], k_pos // T]
    if bool((blocks[valid] < 0).any()):
        raise RuntimeError(f"group {group.name!r}: no window block for a decode sequence's window (released or never "
                           "allocated)")
    slots = torch.where(valid, blocks * stride + k_pos % T, 0).to(device)
    mask = torch.zeros(valid.shape, dtype=dtype).masked_fill_(~valid, float("-inf")).to(device)[:, None, None]
    row_t = torch.tensor(rows, device=device)
    return _DecodePlan(seqs, row_t, pos, position_ids[0, row_t][:, None], slots, valid.to(device), mask)


def _entry_slots(group: Any, stride: int, table: torch.Tensor, seqs: list[int], counts: list[int],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of every compressed entry of each sequence, ``(B, most)`` padded with slot 0, and which are real
    (``stride``: the group's slots a block, ``BlockPools.block_slots``)."""
    most = max(counts)
    w = torch.arange(most)[None, :].expand(len(seqs), most)
    valid = w < torch.tensor(counts)[:, None]
    blocks = table[torch.tensor(seqs)[:, None], w * group.compress_rate // group.tokens_per_block]
    if bool((blocks[valid] < 0).any()):
        raise RuntimeError(f"group {group.name!r}: no block for a decode sequence's compressed entries")
    slots = torch.where(valid, blocks * stride + w % group.entries_per_block, 0)
    return slots.to(device), valid.to(device)


def _pool(comp: Any, series: Any, kv: torch.Tensor, gate: torch.Tensor, csa: bool, rate: int, hd: int,
          pos_ids: torch.Tensor) -> torch.Tensor:
    """The entries of ``E`` windows that close this step, ``(E, width)`` each, as the model's compressor (or CSA's
    indexer, ``series``) pools them: one window per sequence, after the overlap its series kept (CSA)."""
    E = kv.shape[0]
    each = list(enumerate(series)) if csa else []
    return _pool_windows(comp, kv.view(E, rate, -1), gate.view(E, rate, -1), csa, rate, hd, pos_ids.view(1, E),
                         each, each)[:, None]


def _pool_windows(comp: Any, kv: torch.Tensor, gate: torch.Tensor, csa: bool, rate: int, hd: int,
                  positions: torch.Tensor, priors: Sequence[tuple[int, _Series]],
                  keeps: Sequence[tuple[int, _Series]]) -> torch.Tensor:
    """The entries of ``W`` full windows ``(W, rate, width)`` of one or more sequences, each sequence's in order, as
    the model's compressor (or CSA's indexer) pools them: ``(W, width)``; ``positions`` ``(1, W)``: each window's
    first token. CSA: a window pools the previous window's first-half series with its own second half; a sequence's
    first window ``w`` (``priors``: ``(w, series)``) takes the overlap that series kept (none: zero weight), and
    ``keeps`` ``(w, series)``: the series (or a snapshot) keeps window ``w``'s first half as its overlap."""
    gate = gate + comp.position_bias
    if csa:
        W = kv.shape[0]
        new_kv = kv.new_zeros((W, 2 * rate, hd))
        new_gate = gate.new_full((W, 2 * rate, hd), float("-inf"))
        new_kv[:, rate:] = kv[..., hd:]
        new_gate[:, rate:] = gate[..., hd:]
        new_kv[1:, :rate] = kv[:-1, :, :hd]  # across a sequence's first window too: set from its own series below
        new_gate[1:, :rate] = gate[:-1, :, :hd]
        for w, s in priors:
            if s.overlap_kv is not None:
                new_kv[w, :rate] = s.overlap_kv[0].to(new_kv.dtype)
                new_gate[w, :rate] = s.overlap_gate[0].to(new_gate.dtype)
            else:
                new_kv[w, :rate] = 0.0
                new_gate[w, :rate] = float("-inf")
        for w, s in keeps:
            s.overlap_kv = kv[w:w + 1, :, :hd].clone()
            s.overlap_gate = gate[w:w + 1, :, :hd].clone()
        kv, gate = new_kv, new_gate
    compressed = comp.kv_norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))[None]
    cos, sin = comp.rotary_emb(compressed, position_ids=positions, layer_type=comp.rope_layer_type)
    return sys.modules[type(comp).__module__].apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin)[0, 0]


def _absorb(comp: Any, name: str, plan: _DecodePlan, states: Sequence[V4SequenceState], layer: int,
            h: torch.Tensor, view: torch.Tensor, table: torch.Tensor, group: Any, stride: int, cols: tuple[int, int],
            csa: bool, hd: int, plans: dict[Any, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """One compressor series over the decode sequences' tokens: each token's projections join its sequence's partial
    window; a window that fills is pooled into its entry and stored in the pool (the model's compressor would emit
    nothing else at one token). Returns every entry of each sequence read back, padded to ``(B, most, width)`` with
    zeros (the pool's unwritten slots may hold anything), and which are real ``(B, most)``."""
    kv, gate = comp.kv_proj(h), comp.gate_proj(h)  # (B, width)
    rate = group.compress_rate
    full, counts = [], []
    for i, b in enumerate(plan.seqs):
        s = states[b].layers.setdefault(layer, {}).setdefault(name, _Series())
        if s.buf_kv is not None and s.buf_kv.shape[1]:
            s.buf_kv = torch.cat([s.buf_kv, kv[None, i:i + 1]], dim=1)
            s.buf_gate = torch.cat([s.buf_gate, gate[None, i:i + 1]], dim=1)
        else:
            s.buf_kv, s.buf_gate = kv[None, i:i + 1].clone(), gate[None, i:i + 1].clone()
        if s.buf_kv.shape[1] == rate:
            full.append((i, b, s))
        counts.append(s.count + (s.buf_kv.shape[1] == rate))
    lo, hi = cols
    if full:
        series = [s for _, _, s in full]
        new = _pool(comp, series, torch.cat([s.buf_kv for s in series]), torch.cat([s.buf_gate for s in series]),
                    csa, rate, hd, torch.tensor([[s.count * rate] for s in series], device=h.device))
        slots = []
        for _, b, s in full:
            blk = int(table[b, s.count * rate // group.tokens_per_block])
            if blk < 0:
                raise RuntimeError(f"group {group.name!r}: no block for compressed entry {s.count}")
            slots.append(blk * stride + s.count % group.entries_per_block)
            s.count += 1
            s.buf_kv, s.buf_gate = s.buf_kv[:, rate:].clone(), s.buf_gate[:, rate:].clone()
        view[torch.tensor(slots, device=view.device), lo:hi] = new[:, 0].to(view.dtype)
    if not max(counts):
        return h.new_zeros((len(plan.seqs), 0, hi - lo)), torch.zeros((len(plan.seqs), 0), dtype=torch.bool)
    key = ("v4-entries", group.name, tuple(counts))  # every layer of the group has the same entries in a step
    got = plans.get(key)
    if got is None:
        got = plans[key] = _entry_slots(group, stride, table, plan.seqs, counts, view.device)
    slots, valid = got
    entries = view[slots, lo:hi].to(h.dtype)
    return entries.masked_fill_(~valid[..., None], 0.0), valid


def _decode_attention(module: Any, mod: Any, plan: _DecodePlan, q: torch.Tensor, q_residual: torch.Tensor,
                      hidden_states: torch.Tensor, keys: torch.Tensor, states: Sequence[V4SequenceState], layer: int,
                      comp: tuple[Any, torch.Tensor, torch.Tensor, int] | None, plans: dict[Any, Any]) -> torch.Tensor:
    """The decode sequences' attention in one call: each query over its window keys then its compressed entries (CSA:
    its indexer's top-k of them), both padded to the longest with ``-inf`` in the mask. Returns ``(B, 1, H, hd)``."""
    hd = module.head_dim
    mask = plan.mask
    if module.compressor is not None:
        group, view, table, stride = comp
        c = module.compressor
        h = hidden_states[0, plan.rows]
        csa = hasattr(c, "indexer")
        entries, real = _absorb(c, "compressor", plan, states, layer, h, view, table, group, stride, (0, hd), csa, hd,
                                plans)
        most = entries.shape[1]
        if most:
            if csa:  # the indexer's pick of entries per query (at one token every entry is before the query)
                idx = c.indexer
                ikeys, _ = _absorb(idx, "indexer", plan, states, layer, h, view, table, group, stride,
                                   (hd, group.entry_elems), True, idx.head_dim, plans)
                B = len(plan.seqs)
                cos_q, sin_q = idx.rotary_emb(h, position_ids=plan.pos_ids, layer_type=idx.rope_layer_type)
                qi = idx.q_b_proj(q_residual[0, plan.rows]).view(B, 1, -1, idx.head_dim).transpose(1, 2)
                qi = mod.apply_rotary_pos_emb(qi, cos_q, sin_q).transpose(1, 2)
                scores = idx.scorer(qi, ikeys, h[:, None])[:, 0]  # (B, most)
                scores = scores.masked_fill(~real, float("-inf"))
                top = scores.topk(min(idx.index_topk, most), dim=-1).indices
                picked = torch.zeros_like(real).scatter_(1, top, True) & real
                extra = torch.zeros(real.shape, dtype=mask.dtype, device=mask.device).masked_fill_(~picked,
                                                                                                   float("-inf"))
            else:
                extra = torch.zeros(real.shape, dtype=mask.dtype, device=mask.device).masked_fill_(~real,
                                                                                                 float("-inf"))
            keys = torch.cat([keys, entries[:, None]], dim=2)
            mask = torch.cat([mask, extra[:, None, None]], dim=-1)
        elif csa:  # the indexer still absorbs its tokens
            _absorb(c.indexer, "indexer", plan, states, layer, h, view, table, group, stride, (hd, group.entry_elems),
                    True, c.indexer.head_dim, plans)
    qd = q[0][:, plan.rows].transpose(0, 1).unsqueeze(2)  # (B, H, 1, hd)
    out, _ = mod.eager_attention_forward(module, qd, keys, keys, mask, scaling=module.scaling, dropout=0.0)
    return out


#: queries per prefill tile: a tile's keys span ``tile + window - 1`` positions, its chunk's would span it all
PREFILL_TILE = 32
#: on CPU, most attention scores (tiles x heads x queries x keys) in one call: larger calls' intermediates leave the
#: cache and cost more than the calls they save (eight prompts' prefill on the tiny preset, thread CPU: 0.45 s at 2**15,
#: 0.36 s at 2**17, 0.37 s at 2**18; one call for all tiles took 1.5x a call per 8 of them)
CPU_SCORES_PER_CALL = 1 << 17


@attrs.define
class _PrefillPlan:
    """The step's other chunks (several tokens, or a snapshot to take), cut into query tiles of up to
    :data:`PREFILL_TILE` tokens that attend together (see :func:`_prefill_attention`): each tile's queries over the
    window keys they need (at most ``tile + window - 1``) then their sequence's compressed entries."""

    seqs: list[int]  # chunk indices, in packed order
    lens: list[int]  # each one's tokens
    rows: torch.Tensor | None  # (R,) their packed rows, in order (None: every row of the step)
    pos_ids: torch.Tensor  # (1, R) their positions
    #: (sequence, first row among the R, first row packed, first position, queries, keys spanned), widest keys first
    tiles: list[tuple[int, int, int, int, int, int]]
    window: int
    group: Any  # the window group
    table: torch.Tensor
    dtype: torch.dtype
    device: torch.device
    stride: int  # the window group's slots a block (BlockPools.block_slots)


@attrs.define
class _Slice:
    """Tiles that attend in one call, padded to their own most queries, window keys and compressed entries."""

    seq: torch.Tensor  # (n,) each tile's sequence (an index into the plan's seqs)
    tile_r: torch.Tensor  # (n, t) each tile's rows among the R (padding: 0)
    tile_p: torch.Tensor  # (n, t) the same rows in the packed step
    real: torch.Tensor  # (n * t,) which tile rows are real
    out: torch.Tensor  # (V,) the R row of each real one
    slots: torch.Tensor  # (n, K) window slots (padding: slot 0, masked)
    valid: torch.Tensor  # (n, K) bool
    mask: torch.Tensor  # (n, 1, t, K) additive mask of the window keys
    most: int  # compressed entries of its sequences, most
    seen: torch.Tensor | None  # (n, t, most) which entries each query sees (their window ends at or before it)


def _prefill_plan(batch: Any, group: Any, table: torch.Tensor, window: int, dtype: torch.dtype,
                  device: torch.device, position_ids: torch.Tensor, skip: set[int]) -> _PrefillPlan | None:
    """The step's prefill plan over the chunks not in ``skip`` (the decode plan's), or None when there are none."""
    seqs, lens, firsts, starts = [], [], [], []
    for b, first, n, start in _packed_rows(batch):
        if b not in skip:
            seqs.append(b)
            lens.append(n)
            firsts.append(first)
            starts.append(start)
    if not seqs:
        return None
    t = min(window, PREFILL_TILE)
    tiles = []
    r = 0
    for i, (n, f, s) in enumerate(zip(lens, firsts, starts, strict=True)):
        for a in range(0, n, t):
            count = min(t, n - a)
            tiles.append((i, r + a, f + a, s + a, count, s + a + count - max(0, s + a - window + 1)))
        r += n
    tiles.sort(key=lambda tile: -tile[5])  # a call's tiles alike in keys: a short prompt's are not padded to a long's
    everything = len(seqs) == len(batch.chunks)
    rows = None if everything else torch.cat([torch.arange(f, f + n) for f, n in zip(firsts, lens, strict=True)])
    pos = position_ids if rows is None else position_ids[:, rows.to(position_ids.device)]
    return _PrefillPlan(seqs, lens, None if rows is None else rows.to(device), pos, tiles, window, group, table, dtype,
                        device, batch.pools.block_slots[group.name])


def _slices(plan: _PrefillPlan, heads: int, counts: Sequence[int], rate: int | None) -> list[_Slice]:
    """The plan's tiles in calls of at most :data:`CPU_SCORES_PER_CALL` scores (on CPU; elsewhere one call), for a
    layer of ``heads`` whose sequences have ``counts`` compressed entries (of ``rate`` tokens each)."""
    g, dev, window = plan.group, plan.device, plan.window
    most = max(counts, default=0)
    tiles = plan.tiles
    cuts = []
    a = 0
    while a < len(tiles):
        b = a + 1
        if dev.type == "cpu":
            t, K = tiles[a][4], tiles[a][5]  # the widest keys come first
            while b < len(tiles) and (b - a + 1) * heads * max(t, tiles[b][4]) * (K + most) <= CPU_SCORES_PER_CALL:
                t = max(t, tiles[b][4])
                b += 1
        else:
            b = len(tiles)
        cuts.append((a, b))
        a = b
    out = []
    for a, b in cuts:
        seq, r0, p0, pos0, count, span = (torch.tensor(col) for col in zip(*tiles[a:b], strict=True))
        t, K = int(count.max()), int(span.max())
        j = torch.arange(t)[None, :]
        q_real = j < count[:, None]
        q_pos = torch.where(q_real, pos0[:, None] + j, -1)
        lows = (pos0 - window + 1).clamp(min=0)
        last = pos0 + count - 1
        k_pos = lows[:, None] + torch.arange(K)[None, :]
        valid = k_pos <= last[:, None]
        k_pos = torch.where(valid, k_pos, 0)
        blocks = plan.table[torch.tensor(plan.seqs)[seq][:, None], k_pos // g.tokens_per_block]
        if bool((blocks[valid] < 0).any()):
            raise RuntimeError(f"group {g.name!r}: no window block for a prefill chunk's window (released or never "
                               "allocated)")
        slots = torch.where(valid, blocks * plan.stride + k_pos % g.tokens_per_block, 0)
        seen = (valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
                & (k_pos[:, None, :] > q_pos[:, :, None] - window))
        mask = torch.zeros(seen.shape, dtype=plan.dtype).masked_fill_(~seen, float("-inf"))[:, None]
        m = max(counts[i] for i in seq.tolist()) if counts else 0
        entries = None
        if m:
            entries = (torch.arange(m)[None, None, :] < ((q_pos + 1) // rate)[..., None]).to(dev)
        tile_r = torch.where(q_real, r0[:, None] + j, 0)
        out.append(_Slice(seq.to(dev), tile_r.to(dev), torch.where(q_real, p0[:, None] + j, 0).to(dev),
                          q_real.flatten().to(dev), tile_r.flatten()[q_real.flatten()].to(dev), slots.to(dev),
                          valid.to(dev), mask.to(dev), m, entries))
    return out


def _absorb_chunks(comp: Any, name: str, plan: _PrefillPlan, states: Sequence[V4SequenceState], layer: int,
                   h: torch.Tensor, view: torch.Tensor, table: torch.Tensor, group: Any, stride: int,
                   cols: tuple[int, int], csa: bool, hd: int) -> list[int]:
    """One compressor series over the prefill chunks' tokens ``h`` ``(R, hidden)``: each chunk's projections after its
    sequence's partial window; the windows that fill, of every chunk, pooled in one call as the model's compressor
    pools them and stored in the pool; the rest kept as the partial windows, and at a reuse boundary a chunk crosses
    the series' snapshot. Returns each sequence's entry count."""
    kv, gate = comp.kv_proj(h), comp.gate_proj(h)  # (R, width)
    rate = group.compress_rate
    T, epb = group.tokens_per_block, group.entries_per_block
    kvs, gates, positions, slots, priors, keeps, counts = [], [], [], [], [], [], []
    W = r = 0
    for b, n in zip(plan.seqs, plan.lens, strict=True):
        state = states[b]
        s = state.layers.setdefault(layer, {}).setdefault(name, _Series())
        ckv, cgate = kv[r:r + n], gate[r:r + n]
        r += n
        if s.buf_kv is not None and s.buf_kv.shape[1]:
            ckv, cgate = torch.cat([s.buf_kv[0], ckv]), torch.cat([s.buf_gate[0], cgate])
        usable = (ckv.shape[0] // rate) * rate
        s.buf_kv, s.buf_gate = ckv[None, usable:].clone(), cgate[None, usable:].clone()
        first = s.count * rate
        for m in state.marks:  # a boundary is a multiple of every rate: this series has no partial window there
            if first < m <= first + usable:
                snap = state.captured.setdefault(m, {}).setdefault(layer, {})[name] = _Series(m // rate)
                if csa:  # the overlap a continuation at m starts from: the window that ends at m
                    keeps.append((W + (m - first) // rate - 1, snap))
        nw = usable // rate
        if nw:
            kvs.append(ckv[:usable])
            gates.append(cgate[:usable])
            positions.extend(range(first, first + usable, rate))
            if csa:
                priors.append((W, s))
                keeps.append((W + nw - 1, s))
            entries = torch.arange(s.count, s.count + nw)
            blocks = table[b, entries * rate // T]
            if int(blocks.min()) < 0:
                raise RuntimeError(f"group {group.name!r}: no block for compressed entry {s.count}..{s.count + nw - 1}")
            slots.append(blocks * stride + entries % epb)
            s.count += nw
            W += nw
        counts.append(s.count)
    if W:
        pooled = _pool_windows(comp, torch.cat(kvs).view(W, rate, -1), torch.cat(gates).view(W, rate, -1), csa, rate,
                               hd, torch.tensor([positions], device=h.device), priors, keeps)
        view[torch.cat(slots).to(view.device), cols[0]:cols[1]] = pooled.to(view.dtype)
    return counts


def _prefill_attention(module: Any, mod: Any, plan: _PrefillPlan, q: torch.Tensor, q_residual: torch.Tensor,
                       hidden_states: torch.Tensor, wview: torch.Tensor, states: Sequence[V4SequenceState],
                       layer: int, comp: tuple[Any, torch.Tensor, torch.Tensor, int] | None,
                       plans: dict[Any, Any]) -> torch.Tensor:
    """The prefill chunks' attention over their query tiles, as many tiles a call as fit
    :data:`CPU_SCORES_PER_CALL` (all of them off the CPU; see :func:`_slices`): each tile's queries over its window
    keys then its sequence's compressed entries (those whose window closed at or before the query; CSA: the indexer's
    top-k of them), padding masked with ``-inf``; their compressor and indexer run over every chunk at once
    (:func:`_absorb_chunks`). Returns ``(R, H, hd)``, the chunks' rows in packed order."""
    hd = module.head_dim
    rows = plan.rows
    h = hidden_states[0] if rows is None else hidden_states[0, rows]
    qt_all = q[0].transpose(0, 1)  # (N, H, hd)
    counts: list[int] = []
    rate = csa = None
    if module.compressor is not None:
        group, view, table, stride = comp
        c = module.compressor
        csa = hasattr(c, "indexer")
        rate = group.compress_rate
        counts = _absorb_chunks(c, "compressor", plan, states, layer, h, view, table, group, stride, (0, hd), csa,
                                hd)
        if csa:
            idx = c.indexer
            _absorb_chunks(idx, "indexer", plan, states, layer, h, view, table, group, stride,
                           (hd, group.entry_elems), True, idx.head_dim)
    # the same for every layer of the window and compressed groups
    key = ("v4-prefill-slices", plan.group.name, plan.window, module.num_heads, rate, tuple(counts))
    cuts = plans.get(key)
    if cuts is None:
        cuts = plans[key] = _slices(plan, module.num_heads, counts, rate)
    most = max(counts, default=0)
    if most:
        ekey = ("v4-prefill-entries", group.name, tuple(counts))
        got = plans.get(ekey)
        if got is None:
            got = plans[ekey] = _entry_slots(group, stride, table, plan.seqs, counts, view.device)
        eslots, real = got
        entries_all = view[eslots].to(h.dtype).masked_fill_(~real[..., None], 0.0)  # (P, most, width)
        if csa:
            R = h.shape[0]
            res = q_residual[0] if rows is None else q_residual[0, rows]
            cos_q, sin_q = idx.rotary_emb(h[None], position_ids=plan.pos_ids, layer_type=idx.rope_layer_type)
            qi_all = idx.q_b_proj(res).view(1, R, -1, idx.head_dim).transpose(1, 2)
            qi_all = mod.apply_rotary_pos_emb(qi_all, cos_q, sin_q).transpose(1, 2)[0]  # (R, Hi, d)
    out = q.new_empty((h.shape[0], *qt_all.shape[1:]))
    for cut in cuts:
        keys = wview[cut.slots].to(q.dtype).masked_fill_(~cut.valid[..., None], 0.0).unsqueeze(1)
        mask = cut.mask
        if cut.most:
            entries = entries_all[cut.seq, :cut.most]
            seen = cut.seen
            if csa:  # the indexer's pick of the entries each query sees
                scores = idx.scorer(qi_all[cut.tile_r], entries[..., hd:], h[cut.tile_r])  # (tiles, t, most)
                scores = scores.masked_fill(~seen, float("-inf"))
                top = scores.topk(min(idx.index_topk, cut.most), dim=-1).indices
                seen = torch.zeros_like(seen).scatter_(-1, top, True) & seen
            extra = torch.zeros(seen.shape, dtype=mask.dtype, device=mask.device).masked_fill_(~seen, float("-inf"))
            keys = torch.cat([keys, entries[:, None, :, :hd]], dim=2)
            mask = torch.cat([mask, extra[:, None]], dim=-1)
        qt = qt_all[cut.tile_p].transpose(1, 2)  # (tiles, H, t, hd)
        o, _ = mod.eager_attention_forward(module, qt, keys, keys, mask, scaling=module.scaling, dropout=0.0)
        out[cut.out] = o.flatten(0, 1)[cut.real]  # (tiles, t, H, hd): the real rows, to their places
    return out


def paged_v4_forward(module: Any, hidden_states: torch.Tensor, position_embeddings: Any, position_ids: torch.Tensor,
                     attention_mask: Any = None, cache: Any = None, *, kvload_batch: Any,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``DeepseekV4Attention.forward`` over the pools for one packed step (see the module docstring)."""
    mod = sys.modules[type(module).__module__]  # the model's own rope, attention and sink math
    batch = kvload_batch
    layer = module.layer_idx
    states = batch.side
    if states is None or len(states) != batch.num_seqs:
        raise RuntimeError("DeepSeek V4 needs each sequence's side state on the step (PagedBatch.side)")
    hd = module.head_dim
    n_tok = hidden_states.shape[1]
    cos, sin = position_embeddings[module.rope_layer_type]
    q_residual = module.q_a_norm(module.q_a_proj(hidden_states))
    q = module.q_b_proj(q_residual).view(1, n_tok, -1, hd).transpose(1, 2)
    q = mod.apply_rotary_pos_emb(module.q_b_norm(q), cos, sin)  # (1, H, N, hd)
    kv = module.kv_norm(module.kv_proj(hidden_states)).view(1, n_tok, -1, hd).transpose(1, 2)
    kv = mod.apply_rotary_pos_emb(kv, cos, sin)  # (1, 1, N, hd): K == V

    (wname, wpos), comp = _groups(batch, layer)
    wgroup = batch.pools.groups[wname]
    wview = batch.pools.layer_slots(wname, wpos)
    wview[batch.write_slots(wname)] = kv[0, 0].to(wview.dtype)
    window = module.sliding_window
    wtable = batch.table(wname)
    if comp is not None:
        cgroup = batch.pools.groups[comp[0]]
        cview = batch.pools.layer_slots(*comp)
        ctable = batch.table(comp[0])
        cstride = batch.pools.block_slots[comp[0]]
    key = ("v4-decode", wname, window)
    dplan = batch.side_plans.get(key, False)
    if dplan is False:  # every layer reads the same windows through the same table: planned once a step
        dplan = batch.side_plans[key] = _decode_plan(batch, wgroup, wtable, window, q.dtype, wview.device,
                                                     position_ids)
    batched = None
    if dplan is not None:
        keys = wview[dplan.slots].to(kv.dtype).masked_fill_(~dplan.valid[..., None], 0.0).unsqueeze(1)
        batched = _decode_attention(module, mod, dplan, q, q_residual, hidden_states, keys, states, layer,
                                    (cgroup, cview, ctable, cstride) if comp is not None else None, batch.side_plans)
        if len(dplan.seqs) == batch.num_seqs:  # a decode-only step: the packed order is the batch's
            return _project_out(module, mod, batched.transpose(0, 1), cos, sin), None
    key = ("v4-prefill", wname, window)
    pplan = batch.side_plans.get(key, False)
    if pplan is False:
        pplan = batch.side_plans[key] = _prefill_plan(batch, wgroup, wtable, window, q.dtype, wview.device,
                                                      position_ids, set(dplan.seqs) if dplan is not None else set())
    out = _prefill_attention(module, mod, pplan, q, q_residual, hidden_states, wview, states, layer,
                             (cgroup, cview, ctable, cstride) if comp is not None else None, batch.side_plans)
    if dplan is None and pplan.rows is None:  # a prefill-only step: the tiles' rows are the packed rows
        return _project_out(module, mod, out[None], cos, sin), None
    full = out.new_empty((n_tok, *out.shape[1:]))
    full[pplan.rows] = out
    full[dplan.rows] = batched[:, 0]
    return _project_out(module, mod, full[None], cos, sin), None


def _project_out(module: Any, mod: Any, attn_output: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """The packed attention output ``(1, N, H, hd)`` with its rope undone, through the grouped output projections
    (as transformers' forward ends)."""
    attn_output = mod.apply_rotary_pos_emb(attn_output.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = module.o_a_proj(attn_output.reshape(1, attn_output.shape[1], module.config.o_groups, -1)).flatten(2)
    return module.o_b_proj(grouped)


def _forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """A routed module's forward: kvload's with a step's batch, the class's own otherwise."""
    if kwargs.get("kvload_batch") is not None:
        return paged_v4_forward(self, *args, **kwargs)
    return type(self).forward(self, *args, **kwargs)


# A bound method pickles as ``getattr(module, its name)``: named "forward", an unpickled routed module gets its class's
# forward back (and route_v4_attention routes it again) instead of failing to load.
_forward.__name__ = _forward.__qualname__ = "forward"


def route_v4_attention(model: Any) -> int:
    """Give every DeepSeek V4 attention module of ``model`` kvload's forward when a step's batch comes with the call
    (its own otherwise); idempotent. Returns how many modules it routed."""
    routed = 0
    for module in model.modules():
        if type(module).__name__ != ATTENTION_CLASS:
            continue
        if getattr(module.__dict__.get("forward"), "__func__", None) is not _forward:
            module.forward = types.MethodType(_forward, module)  # on the instance: the class's stays the model's own
        routed += 1
    return routed


def step_states(batch: Any, states: V4States | None = None, req_ids: Sequence[str] | None = None) -> None:
    """Put the chunks' side states on a step (``batch.side``): from ``states`` by request id, or fresh ones for a
    batch whose chunks all start at position 0 (a one-off forward)."""
    starts = [c.start_pos for c in batch.chunks]
    if states is None:
        if any(starts):
            raise RuntimeError("DeepSeek V4: a chunk after position 0 needs its request's side state (V4States)")
        batch.side = [V4SequenceState() for _ in starts]
        return
    batch.side = states.for_step(list(req_ids or ()), starts)
    states.mark(batch.side, starts, [len(c.token_ids) for c in batch.chunks])


def advance(batch: Any) -> None:
    """After a step's forward: each state has absorbed its chunk."""
    for state, chunk in zip(batch.side, batch.chunks, strict=True):
        state.pos = chunk.start_pos + len(chunk.token_ids)
