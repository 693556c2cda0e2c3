"""Compiled paged attention: FlexAttention reading K/V straight from the block pools, steered by a block mask.

The reference path (``paged_attention.py``) gathers every visible key into a padded ``(B, max_k)``
tensor and runs SDPA over it — a copy of the whole context per layer per step. This path copies
nothing: a layer's pool *is* the key/value tensor, and a ``BlockMask`` built from the block tables
tells ``torch.compile(flex_attention)`` which physical blocks each query reads.

Layout of one call (one layer, one step of ``N`` packed tokens):

* **keys/values** — the layer's pool slots ``(slots, 2 * Hkv * d)`` viewed as ``(1, Hkv, slots, d)``
  (a strided view, no copy); the flex KV block size is the pool's ``tokens_per_block``, so a flex
  KV block *is* a physical block.
* **queries** — GQA is packed into rows: token ``t``'s ``g = H / Hkv`` heads sharing KV head ``h``
  are rows ``t*g .. t*g + g - 1`` of ``Q[0, h]`` (``(1, Hkv, NB * g, d)``), and the flex Q block
  size is ``g``: one Q block per token, so each token reads only its own sequence's blocks and the
  ``g`` heads share every key load. ``NB`` is ``N`` rounded up to a bucket (:data:`BUCKET_BASE`
  powers); padding rows list no blocks and cost nothing. On CUDA a token's rows are padded to a
  multiple of 16 (triton's smallest tile; the kernel needs the Q block to divide into ``BLOCK_M``),
  with ``BLOCK_M=16`` and ``BLOCK_N`` dividing the block size, so the block size must be a multiple
  of 16 there (:data:`CUDA_MIN_BLOCK`; checked before compiling). A shape that still fails to compile
  falls back to gather + SDPA (:class:`FlexUnavailable`).
* **MLA layers** (DeepSeek V2/V3) — the pool holds one ``[latent | rope]`` row per token, shared by
  every head, so the kernel runs the absorbed form (:meth:`FlexPagedAttention.attend_latent`): the
  caller folds ``kv_b_proj``'s key half into the queries (``q_nope W_UK`` per head, then ``q_pe``), the
  rows are the keys of one KV head (all ``H`` query heads of a token in one Q block), their latents the
  values (a V head dim unlike K's, a strided view of the same rows), and the caller up-projects the
  output through the value half. Nothing is expanded per cached token (gather + SDPA expands every
  visible latent into per-head K/V at every step and layer, as transformers' DeepSeek does).
* **block mask** — per token: the blocks from the window's first (``max(0, pos - W + 1)``, or 0) to
  the token's own. The first and last are *partial* (the mask function decides per key: causal,
  window); the ones between are *full* (no mask work). A window's released blocks (``-1``) lie
  before its first block and are never listed; a ``-1`` inside the range is an error, as on the
  reference path.
* **mask function** — ``kv_pos <= q_pos and kv_pos > q_pos - W`` with ``kv_pos`` from the physical
  slot through ``block_pos`` (the logical block each physical block holds: a block shared by prefix
  reuse sits at the same position in every table that holds it).

Compile cost is paid once per shape: the shapes are (bucket, heads, head dims, pool size and strides,
dtype), so a generation run compiles at most one graph per bucket and layer-pool layout, and every
later step and call reuses it (:attr:`FlexPagedAttention.compiles` counts them; the first call of a
shape is timed into :attr:`FlexPagedAttention.warmup_s`, apart from generation time).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch

from cache_backends.pools import BlockPools

#: Token-count buckets are powers of this base (8, 64, 512, ...), capped at the largest step.
BUCKET_BASE = 8

#: A window no sequence reaches (full-attention layers use the same mask function as sliding ones).
NO_WINDOW = 1 << 40


def buckets_up_to(max_tokens: int) -> tuple[int, ...]:
    """The packed-token buckets a step of up to ``max_tokens`` tokens is padded to."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out, b = [], BUCKET_BASE
    while b < max_tokens:
        out.append(b)
        b *= BUCKET_BASE
    out.append(max(max_tokens, 1) if not out else max_tokens)
    return tuple(sorted(set(out)))


def _headers_under_inductor_cache() -> None:
    """Inductor's precompiled C++ headers under ``TORCHINDUCTOR_CACHE_DIR`` when one is set (weight loading sets
    kvload's, ``models.compile_cache``), not in ``$TMPDIR``, where torch puts them whatever that variable says."""
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not cache:
        return
    import torch._inductor.codecache as codecache
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.join(default_cache_dir(), "precompiled_headers")
    # module globals read at each precompile; absent in another torch, whose layout then stands as it is
    if getattr(codecache, "_HEADER_DIR", None) == default and hasattr(codecache, "_HEADER_LOCK_DIR"):
        codecache._HEADER_DIR = os.path.join(cache, "precompiled_headers")
        codecache._HEADER_LOCK_DIR = os.path.join(cache, "precompiled_headers", "locks")


@functools.cache
def compiled_flex() -> Callable[..., torch.Tensor]:
    """``torch.compile(flex_attention)``, built once per process (graphs are cached per shape inside it)."""
    _headers_under_inductor_cache()
    import torch._dynamo.config as dynamo_config
    from torch.nn.attention.flex_attention import flex_attention

    # every shape is a recompile of the same function; the default limit (8) would fall back to eager
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


class FlexUnavailable(RuntimeError):
    """torch.compile could not build the kernel for a shape; the caller falls back to gather + SDPA."""


#: Pool dtypes the compiled kernel reads (float8 pools stay on gather + SDPA).
FLEX_DTYPES = ("float32", "float16", "bfloat16")


#: The most host memory the compiled path's mask indices may take (a GPU holds a copy as well): they
#: are ``(tokens, pool blocks)`` per distinct (pool, window), so a big pool and a large token budget
#: per step can ask for gigabytes; past this, gather + SDPA runs instead.
MAX_INDEX_BYTES = 1 << 30


#: On CUDA the kernel reads a block in tiles of at least this many tokens (triton's smallest ``tl.dot``);
#: on an H200 blocks of 4 and 8 tokens failed to compile and 16 and 32 ran.
CUDA_MIN_BLOCK = 16


def flex_unsupported(layout: Any, device: str | torch.device = "cpu") -> str | None:
    """Why a KV layout cannot run on the compiled path on ``device``, or None when it can."""
    if layout.dtype not in FLEX_DTYPES:
        return f"the KV cache dtype {layout.dtype} is not one the compiled kernel reads ({', '.join(FLEX_DTYPES)})"
    if torch.device(device).type == "cuda":
        sizes = sorted({g.tokens_per_block for g in layout.groups if g.tokens_per_block % CUDA_MIN_BLOCK})
        if sizes:
            return (f"on CUDA the compiled kernel reads a block in tiles of {CUDA_MIN_BLOCK} tokens, and "
                    f"tokens_per_block={sizes[0]} is not a multiple of {CUDA_MIN_BLOCK}")
    return None


#: Shapes compiled in this process (torch.compile's graph cache is process-wide, so this set is too).
_COMPILED: set[tuple] = set()
#: Shapes that failed to compile in this process, and why (never retried: a failed compile can take minutes).
_FAILED: dict[tuple, str] = {}


def dynamo_graphs() -> int:
    """Graphs torch.compile has built in this process (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _signature(k: torch.Tensor, v: torch.Tensor) -> tuple:
    """What makes a compiled graph of one layer's K/V views: shapes, strides, dtype, device."""
    return (tuple(k.shape), k.stride(), tuple(v.shape), v.stride(), k.dtype, str(k.device))


@attrs.define(eq=False)
class _Buffers:
    """Persistent block-mask inputs of one (group, window, bucket) shape, rewritten each step.

    ``host`` holds numpy arrays the plan writes; ``dev`` the tensors the kernel reads (on a CPU the
    same memory, through ``torch.from_numpy``; on a GPU copies of the rows a step wrote).
    """

    host: dict[str, np.ndarray]
    dev: dict[str, torch.Tensor]


class FlexPagedAttention:
    """The compiled path's state over one set of pools: shape buckets, mask buffers, compile counters.

    Build it before any KV is written to the pools (the executor does, on its first ``generate``):
    it zero-fills them. The kernel reads whole blocks and masks what a query may not see, and a masked
    key's probability is 0, but 0 x NaN — garbage ``torch.empty`` may leave in a never-written slot —
    is NaN. Slots written once stay finite. (The pools themselves stay ``torch.empty``: the host-memory
    probes count untouched pages as the plan does.)
    """

    def __init__(self, pools: BlockPools, max_num_tokens: int) -> None:
        if pools.released:
            raise ValueError("the block pools were released")
        for t in pools.tensors.values():
            t.zero_()
        self.pools = pools
        self.device = pools.device
        self.buckets = buckets_up_to(max_num_tokens)
        #: shapes this object compiled (a step of a shape the process knows compiles nothing)
        self.compiles = 0
        #: seconds spent in first calls of new shapes (compilation), kept apart from generation time
        self.warmup_s = 0.0
        self.calls = 0
        #: why compiling failed (the path then stays off for this object), or None
        self.failed: str | None = None
        self._on_cpu = self.device.type == "cpu"
        # physical block -> logical block index, per group (numpy on the host; the kernel reads `_block_pos`)
        self._block_pos_np = {g: np.zeros(n, dtype=np.int64) for g, n in pools.num_blocks.items()}
        self._block_pos = {g: self._device(a) for g, a in self._block_pos_np.items()}
        self._buffers: dict[tuple, _Buffers] = {}
        self._views: dict[tuple, tuple] = {}

    def _device(self, host: np.ndarray) -> torch.Tensor:
        """A device tensor for a host array: the same memory on a CPU, a copy elsewhere."""
        t = torch.from_numpy(host)
        return t if self._on_cpu else t.to(self.device)

    def bucket(self, n: int) -> int:
        """The bucket a step of ``n`` packed tokens is padded to (past the largest: the next power, a new shape)."""
        for b in self.buckets:
            if n <= b:
                return b
        b = self.buckets[-1]
        while b < n:
            b *= BUCKET_BASE
        return b

    # --- the per-step plan -------------------------------------------------------------------

    def _buffer_key(self, group: str, window: int | None, nb: int) -> tuple:
        # Groups of one arena have the same block count and block size: the groups of one window share
        # one buffer set (the kernel wants indices as wide as the pool, so a set per group would grow
        # with groups x arena); a mask is rebuilt when another group wrote the set since (block_mask).
        pg = self.pools.groups[group]
        return (self.pools.num_blocks[group], pg.tokens_per_block, window, nb)

    def _buffers_for(self, group: str, window: int | None, nb: int) -> _Buffers:
        key = self._buffer_key(group, window, nb)
        buf = self._buffers.get(key)
        if buf is None:
            nblk = self.pools.num_blocks[group]
            host = {"kv_num": np.zeros((1, 1, nb), dtype=np.int32),
                    "kv_idx": np.zeros((1, 1, nb, nblk), dtype=np.int32),
                    "full_num": np.zeros((1, 1, nb), dtype=np.int32),
                    "full_idx": np.zeros((1, 1, nb, nblk), dtype=np.int32),
                    "tok_pos": np.zeros(nb, dtype=np.int64), "window": np.array(window or NO_WINDOW, dtype=np.int64)}
            buf = self._buffers[key] = _Buffers(host, {k: self._device(v) for k, v in host.items()})
        return buf

    def rows_per_token(self, g: int) -> int:
        """Q rows a token takes: its ``g`` heads of one KV head (on CUDA padded to a multiple of 16)."""
        return g if self._on_cpu else -(-g // 16) * 16

    def _kernel_options(self, block_size: int) -> dict[str, int] | None:
        if self._on_cpu:
            return None
        return {"BLOCK_M": 16, "BLOCK_N": next(b for b in (64, 32, 16, block_size) if block_size % b == 0)}

    def block_mask(self, batch: Any, group: str, window: int | None, g: int) -> Any:
        """The step's ``BlockMask`` for a (group, window) pair with Q blocks of ``g`` rows (cached in the batch)."""
        cache = batch.__dict__.setdefault("_flex_masks", {})
        key = (self._buffer_key(group, window, self.bucket(batch.num_tokens)), g)
        built = cache.get(key)
        if built is None or built[0] != group:  # none yet, or another group's mask now owns the buffers
            built = cache[key] = (group, self._build_mask(batch, group, window, g))
        return built[1]

    @staticmethod
    def index_bytes(pools: BlockPools, max_num_tokens: int) -> int:
        """Host bytes of the mask index buffers at worst (every bucket used; a GPU holds a copy too)."""
        keys = {(pools.num_blocks[g.name], g.tokens_per_block, g.window) for g in pools.layout.groups}
        per_token = sum(2 * 4 * n for n, _, _ in keys)  # kv_idx + full_idx, int32, one row per packed token
        return per_token * sum(buckets_up_to(max_num_tokens))

    def _build_mask(self, batch: Any, group: str, window: int | None, g: int) -> Any:
        from torch.nn.attention.flex_attention import BlockMask

        pg = self.pools.groups[group]
        if pg.compress_rate is not None:
            raise ValueError(f"group {group!r} is compressed; paged attention does not read compressed entries")
        T, nblk = pg.tokens_per_block, self.pools.num_blocks[group]
        table = batch.table(group).numpy()
        n_tok = batch.num_tokens
        nb = self.bucket(n_tok)
        seq, pos = batch._seq_np, batch._pos_np
        lo = np.maximum(pos - window + 1, 0) if window else np.zeros_like(pos)
        lo_blk, hi_blk = lo // T, pos // T
        rows = table[seq]  # (N, W): each token's sequence's table
        j = np.arange(table.shape[1])
        missing = (j[None, :] >= lo_blk[:, None]) & (j[None, :] <= hi_blk[:, None]) & (rows < 0)
        if missing.any():
            t, blk = (int(x[0]) for x in missing.nonzero())
            raise ValueError(f"sequence {int(seq[t])}: group {group!r} has no block for position {blk * T}.., which "
                             f"attention needs (logical block {blk} is -1: released or never allocated)")
        # physical block -> logical block, for the mask function; a block is at one position in every table
        valid = table >= 0
        phys, logical = table[valid], np.broadcast_to(j, table.shape)[valid]
        block_pos = self._block_pos_np[group]
        block_pos[phys] = logical
        if (block_pos[phys] != logical).any():
            raise ValueError(f"group {group!r}: a physical block sits at two logical positions in this step's "
                             "tables; the compiled path needs one position per block")
        if not self._on_cpu:
            self._block_pos[group].copy_(torch.from_numpy(block_pos))
        full_num = np.maximum(hi_blk - lo_blk - 1, 0)
        width = int(full_num.max())
        buf = self._buffers_for(group, window, nb)
        h = buf.host
        h["kv_num"][0, 0, :] = 0
        h["full_num"][0, 0, :] = 0
        h["kv_num"][0, 0, :n_tok] = 1 + (hi_blk > lo_blk)
        t = np.arange(n_tok)
        h["kv_idx"][0, 0, :n_tok, 0] = rows[t, hi_blk]
        h["kv_idx"][0, 0, :n_tok, 1] = rows[t, lo_blk]
        if width:
            cols = np.minimum(lo_blk[:, None] + 1 + np.arange(width)[None, :], table.shape[1] - 1)
            h["full_idx"][0, 0, :n_tok, :width] = np.maximum(rows[t[:, None], cols], 0)
            h["full_num"][0, 0, :n_tok] = full_num
        h["tok_pos"][:n_tok] = pos
        d = buf.dev
        if not self._on_cpu:  # copy what this step wrote
            for name in ("kv_num", "full_num", "tok_pos"):
                d[name].copy_(torch.from_numpy(h[name]))
            d["kv_idx"][0, 0, :n_tok, :2].copy_(torch.from_numpy(h["kv_idx"][0, 0, :n_tok, :2]))
            if width:
                d["full_idx"][0, 0, :n_tok, :width].copy_(torch.from_numpy(h["full_idx"][0, 0, :n_tok, :width]))
        tok_pos, win, bpos = d["tok_pos"], d["window"], self._block_pos[group]

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            q_pos = tok_pos[q_idx // g]
            kv_pos = bpos[kv_idx // T] * T + kv_idx % T
            return (kv_pos <= q_pos) & (kv_pos > q_pos - win)

        return BlockMask.from_kv_blocks(d["kv_num"], d["kv_idx"], d["full_num"], d["full_idx"], BLOCK_SIZE=(g, T),
                                        mask_mod=mask_mod, seq_lengths=(nb * g, nblk * T), compute_q_blocks=False)

    # --- one layer ---------------------------------------------------------------------------

    def _kv_views(self, group: str, layer_pos: int, kv_heads: int, head_dim: int) -> tuple:
        """K and V of one layer as ``(1, Hkv, slots, d)`` views of its pool, and their shape signature (cached)."""
        key = (group, layer_pos, kv_heads, head_dim)
        views = self._views.get(key)
        if views is None:
            view = self.pools.layer_slots(group, layer_pos)
            entries = view[:, : 2 * kv_heads * head_dim].unflatten(1, (2, kv_heads, head_dim))
            k = entries[:, 0].permute(1, 0, 2).unsqueeze(0)
            v = entries[:, 1].permute(1, 0, 2).unsqueeze(0)
            views = self._views[key] = (k, v, _signature(k, v))
        return views

    def _latent_views(self, group: str, layer_pos: int, width: int, rank: int) -> tuple:
        """An MLA pool as one KV head: K = its ``[latent | rope]`` rows ``(1, 1, slots, width)``, V = the latents."""
        key = (group, layer_pos, "latent", width, rank)
        views = self._views.get(key)
        if views is None:
            k = self.pools.layer_slots(group, layer_pos)[:, :width].unsqueeze(0).unsqueeze(0)
            v = k[..., :rank]  # a strided view of the same rows: the kernel takes a V head dim unlike K's
            views = self._views[key] = (k, v, _signature(k, v))
        return views

    def attend(self, batch: Any, layer: int, query: torch.Tensor, kv_heads: int, head_dim: int, scale: float,
               softcap: float | None = None) -> torch.Tensor:
        """Attention of the packed queries ``(N, H, d)`` over the layer's pool (its new K/V already written)."""
        r = batch.route(layer)
        k, v, signature = self._kv_views(r.group, r.layer_pos, kv_heads, head_dim)
        return self._attend(batch, r, query, kv_heads, k, v, signature, scale, softcap)

    def attend_latent(self, batch: Any, layer: int, query: torch.Tensor, rank: int, scale: float) -> torch.Tensor:
        """Absorbed MLA: queries ``(N, H, rank + rope)`` in latent space over an MLA layer's pool, out ``(N, H, rank)``.

        Every query head reads the one cached ``[latent | rope]`` row per token as its key (MQA: all ``H``
        heads of a token in one Q block, sharing each key load) and the row's latent as its value; the
        caller folds ``kv_b_proj``'s per-head key and value halves into the query and the output
        (``paged_attention.attend_latent``).
        """
        r = batch.route(layer)
        if r.kind != "mla":
            raise ValueError(f"layer {layer} is a {r.kind!r} layer; attend_latent reads MLA latents")
        if query.shape[-1] != r.entry_elems or not 0 < rank < r.entry_elems:
            raise ValueError(f"layer {layer}: latent queries of width {query.shape[-1]} and rank {rank} do not fit "
                             f"entries of {r.entry_elems} elements")
        k, v, signature = self._latent_views(r.group, r.layer_pos, r.entry_elems, rank)
        return self._attend(batch, r, query, 1, k, v, signature, scale, None)

    def _attend(self, batch: Any, r: Any, query: torch.Tensor, kv_heads: int, k: torch.Tensor, v: torch.Tensor,
                signature: tuple, scale: float, softcap: float | None) -> torch.Tensor:
        """Packed queries ``(N, H, d)`` over the pool views ``k``/``v`` of one layer: ``(N, H, d_v)``."""
        n, heads, qd = query.shape
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads")
        g = heads // kv_heads
        nb = self.bucket(n)
        rows = self.rows_per_token(g)
        packed = query.view(n, kv_heads, g, qd).transpose(0, 1)  # (Hkv, N, g, d): a token's g heads together
        if n == nb and rows == g:
            q = packed.reshape(1, kv_heads, n * g, qd).to(k.dtype)
        else:  # padding rows list no blocks (or belong to no head); zeros keep them finite anyway
            q = query.new_zeros((kv_heads, nb, rows, qd), dtype=k.dtype)
            q[:, :n, :g] = packed
            q = q.view(1, kv_heads, nb * rows, qd)
        block_size = self.pools.groups[r.group].tokens_per_block
        mask = self.block_mask(batch, r.group, r.window, rows)
        score_mod = None
        if softcap is not None:
            cap = float(softcap)

            def score_mod(score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
                return torch.tanh(score / cap) * cap

        key = (signature, block_size, nb, heads, softcap)
        first = key not in _COMPILED
        start = time.perf_counter() if first else 0.0
        if self.failed is None and key in _FAILED:
            self.failed = _FAILED[key]
        if self.failed is not None:
            raise FlexUnavailable(self.failed)
        try:
            out = compiled_flex()(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale,
                                  kernel_options=self._kernel_options(block_size))
        except Exception as exc:  # a backend that cannot build this shape (no compiler, an unsupported block size)
            if not first:
                raise
            self.failed = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            _FAILED[key] = self.failed
            raise FlexUnavailable(self.failed) from exc
        if first:
            _COMPILED.add(key)
            self.compiles += 1
            self.warmup_s += time.perf_counter() - start
        self.calls += 1
        out = out[0].view(kv_heads, nb, rows, -1)[:, :n, :g].transpose(0, 1).reshape(n, heads, -1)
        return out if out.dtype == query.dtype else out.to(query.dtype)
