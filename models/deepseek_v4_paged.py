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
  ``table[w * c // tokens_per_block] * entries_per_block + w % entries_per_block`` (a CSA entry holds the
  compressor's ``head_dim`` then the indexer's ``index_head_dim``); the model's own compressor and indexer modules
  compute them, per sequence, against :class:`_SeqCache`, whose ``update_compressor_states`` writes the new entries
  into the pool and hands back every entry so far read from it;
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

The compressor and attention run one sequence at a time inside the packed forward (the projections, MoE and
hyper-connections run on the packed row): correctness first, the per-sequence loop is what DeepSeek V4 costs here.
"""

from __future__ import annotations

import array
import hashlib
import sys
import types
from collections.abc import Callable, Iterable, Sequence
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

    def get(self, block: int, gen: int, pos: int, digest: bytes) -> V4Snapshot | None:
        """The snapshot of the prefix ``digest`` at ``pos`` kept with ``block`` at generation ``gen``, or None."""
        got = self.by_block.get(block)
        if got is None or got[0] != gen or got[1].pos != pos or got[1].digest != digest:
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


class _SeqCacheLayer:
    """What transformers' DeepSeek V4 compressor and indexer call on ``cache.layers[i]``, for one sequence: the
    partial window and overlap in the request's side state, the compressed entries in the pool."""

    def __init__(self, series: dict[str, _Series], view: torch.Tensor, table: torch.Tensor, group: Any,
                 head_dim: int, layer: int = 0, state: V4SequenceState | None = None) -> None:
        self.series = series
        self.layer = layer
        self.marks = state.marks if state is not None else ()
        self.captured = state.captured if state is not None else {}
        self.view = view  # the layer's compressed pool entries, (slots, entry_elems)
        self.table = table  # the sequence's block table in the compressed group, (width,) int64 (-1: none)
        self.group = group
        self.cols = {"compressor": (0, head_dim), "indexer": (head_dim, group.entry_elems)}

    def _series(self, name: str) -> _Series:
        return self.series.setdefault(name, _Series())

    def _slots(self, first: int, count: int) -> torch.Tensor:
        g = self.group
        entries = torch.arange(first, first + count, dtype=torch.long)
        blocks = self.table[entries * g.compress_rate // g.tokens_per_block]
        if count and int(blocks.min()) < 0:
            raise RuntimeError(f"group {g.name!r}: no block for compressed entry {first}..{first + count - 1}")
        return (blocks * g.entries_per_block + entries % g.entries_per_block).to(self.view.device)

    def store_compression_weights(self, name: str, kv: torch.Tensor,
                                  gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The new projections after the buffered ones, cut at the last full window (the rest stays buffered)."""
        s = self._series(name)
        rate = self.group.compress_rate
        first = s.count * rate
        if s.buf_kv is not None and s.buf_kv.shape[1]:
            kv = torch.cat([s.buf_kv, kv], dim=1)
            gate = torch.cat([s.buf_gate, gate], dim=1)
        usable = (kv.shape[1] // rate) * rate
        s.buf_kv, s.buf_gate = kv[:, usable:].clone(), gate[:, usable:].clone()
        for b in self.marks:  # a boundary is a multiple of every rate: this series has no partial window there
            if first < b <= first + usable:
                self.captured.setdefault(b, {}).setdefault(self.layer, {})[name] = _Series(b // rate)
        return kv[:, :usable], gate[:, :usable], first

    def update_overlap_state(self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor,
                             head_dim: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """CSA: the previous full window's first-half series (None at the first), and keep this call's last."""
        s = self._series(name)
        prior = (s.overlap_kv, s.overlap_gate)
        rate = self.group.compress_rate
        for b in self.marks:  # the overlap a continuation at b starts from: the window that ends at b
            j = (b - s.count * rate) // rate - 1  # the windows of this call start at the series' entry count
            if 0 <= j < chunk_kv.shape[1]:
                snap = self.captured[b][self.layer][name]
                snap.overlap_kv = chunk_kv[:, j, :, :head_dim].clone()
                snap.overlap_gate = chunk_gate[:, j, :, :head_dim].clone()
        s.overlap_kv = chunk_kv[:, -1, :, :head_dim].clone()
        s.overlap_gate = chunk_gate[:, -1, :, :head_dim].clone()
        return prior

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        """Store the new entries ``(1, n, width)`` in the pool; return every entry so far, read from it."""
        s = self._series(name)
        lo, hi = self.cols[name]
        n = compressed.shape[1]
        if n:
            self.view[self._slots(s.count, n), lo:hi] = compressed[0].to(self.view.dtype)
        s.count += n
        return self.view[self._slots(0, s.count), lo:hi].to(compressed.dtype).unsqueeze(0)


class _SeqCache:
    """The ``cache`` a DeepSeek V4 compressor gets for one sequence: ``layers[i]`` only."""

    def __init__(self, layer: int, cache_layer: _SeqCacheLayer) -> None:
        self.layers = {layer: cache_layer}


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


def _window_plan(group: Any, table: torch.Tensor, start: int, n: int, window: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's window keys in a step: their slots in the window group, and the additive mask ``(1, 1, n, k)``
    of its ``n`` queries over them (a key is seen when it is not after the query and within ``window`` of it)."""
    end = start + n
    lo = max(0, start - window + 1)
    k_pos = torch.arange(lo, end)
    blocks = table[k_pos // group.tokens_per_block]
    if int(blocks.min()) < 0:
        raise RuntimeError(f"group {group.name!r}: no window block for positions {lo}..{end - 1} (released or never "
                           "allocated)")
    slots = (blocks * group.entries_per_block + k_pos % group.tokens_per_block).to(device)
    q_pos = torch.arange(start, end)
    seen = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
    mask = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, float("-inf")).to(device)[None, None]
    return slots, mask


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
    outs = []
    first = 0
    for b, chunk in enumerate(batch.chunks):
        n = len(chunk.token_ids)
        plan = batch.side_plans.get((wname, window, b))
        if plan is None:  # every layer reads the same window through the same table: planned once a step
            plan = batch.side_plans[(wname, window, b)] = _window_plan(wgroup, wtable[b], chunk.start_pos, n, window,
                                                                       q.dtype, wview.device)
        slots, mask = plan
        keys = wview[slots].to(kv.dtype).view(1, 1, -1, hd)
        if module.compressor is not None:
            series = states[b].layers.setdefault(layer, {})
            seq_cache = _SeqCache(layer, _SeqCacheLayer(series, cview, ctable[b], cgroup, hd, layer, states[b]))
            rows = slice(first, first + n)
            compressed, block_bias = module.compressor(hidden_states[:, rows], q_residual[:, rows],
                                                       position_ids[:, rows], seq_cache, layer)
            keys = torch.cat([keys, compressed], dim=2)
            extra = (block_bias.to(mask.dtype) if block_bias is not None
                     else mask.new_zeros((1, 1, n, compressed.shape[2])))
            mask = torch.cat([mask, extra], dim=-1)
        out, _ = mod.eager_attention_forward(module, q[:, :, first:first + n], keys, keys, mask,
                                             scaling=module.scaling, dropout=0.0)
        outs.append(out)  # (1, n, H, hd)
        first += n
    attn_output = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    attn_output = mod.apply_rotary_pos_emb(attn_output.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = module.o_a_proj(attn_output.reshape(1, n_tok, module.config.o_groups, -1)).flatten(2)
    return module.o_b_proj(grouped), None


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
