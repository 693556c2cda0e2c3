"""A paged decode kernel (Triton): each sequence's one new query attends over its own pages, read in place.

Gather + SDPA copies every visible key of every layer before attending, and the compiled flex path scans a block
mask as wide as the pool; on a GPU both leave decode far below contiguous SDPA (BENCHMARKS.md, "GPU check"). This
kernel is the serving engines' answer (vLLM's and FlashInfer's paged decode): a program per (sequence, KV head,
split of the sequence's pages) walks the sequence's block table, loads each page's K and V straight from the pool,
scores the KV head's whole group of query heads against it (GQA: the K/V page is read once for all of them) with an
online softmax, and writes a partial result; a second launch merges the splits (split-KV, so a few long sequences
still fill the GPU).

What it serves: decode-only steps (one new token per sequence) of full and sliding-window attention layers, pools of
any kvload dtype (float8 is read and widened in the kernel), logit softcapping. Everything else (prefill chunks,
MLA, compressed layers) stays on gather + SDPA. ``TRITON_INTERPRET=1`` runs the kernel on CPU tensors (how the tests
check it against the reference on machines without a GPU); in use it is for CUDA only.

Layout read (``cache_backends.pools``): a layer's slots are ``(num_blocks * T, entry_elems)`` rows of
``(2, kv_heads, head_dim)`` — K at 0, V at 1 — and token position ``p`` of a sequence lives at slot
``table[p // T] * T + p % T``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

#: ``tl.dot`` on a GPU multiplies tiles of at least 16 along every dimension.
MIN_TILE = 16
#: Splits of a sequence's pages: enough programs to fill a GPU at small batches, few partials to merge.
MAX_SPLITS = 16
#: Pages per split below which a sequence is not split further (a split's fixed cost is a partial to write).
MIN_PAGES_PER_SPLIT = 8


def paged_decode_unsupported(device: torch.device | str, tokens_per_block: int, head_dim: int) -> str | None:
    """Why the kernel cannot serve these pools, or None when it can."""
    dev = torch.device(device)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if dev.type != "cuda" and not interpret:
        return f"the paged decode kernel is a Triton kernel for CUDA devices; the pools are on {dev.type}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (it comes with CUDA builds of torch)"
    if tokens_per_block < MIN_TILE or tokens_per_block & (tokens_per_block - 1):
        return (f"the kernel reads a page as one tile: tokens_per_block must be a power of two >= {MIN_TILE}, "
                f"got {tokens_per_block}")
    if head_dim & (head_dim - 1) or head_dim < MIN_TILE:
        return f"the kernel reads a head as one tile: head_dim must be a power of two >= {MIN_TILE}, got {head_dim}"
    return None


@functools.cache
def _kernel() -> Any:
    """The jitted kernel, built on first use (so importing this module needs no triton, and ``TRITON_INTERPRET``
    is read when a kernel is first wanted)."""
    import triton
    import triton.language as tl

    @triton.jit
    def decode_pages(q_ptr, kv_ptr, tables_ptr, lens_ptr, acc_ptr, m_ptr, l_ptr,
                     stride_qb, stride_qh, stride_slot, stride_tb, v_offset, window, splits, scale, softcap,
                     G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
                     HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        end = tl.load(lens_ptr + b)  # keys [lo, end) are visible: end - 1 is the new token's position
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(end - window, 0)
        first = lo // T
        pages = tl.cdiv(end, T) - first
        per = tl.cdiv(pages, splits)
        page_lo = first + s * per
        page_hi = tl.minimum(page_lo + per, first + pages)

        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        t = tl.arange(0, T)
        q = tl.load(q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :],
                    mask=(g < G)[:, None], other=0.0)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        k_col = h * D + d
        for j in range(page_lo, page_hi):
            page = tl.load(tables_ptr + b * stride_tb + j).to(tl.int64)
            pos = j * T + t
            seen = (pos >= lo) & (pos < end)
            rows = (page * T + t)[:, None] * stride_slot
            # widened (float8 pools) or kept as the query's dtype, as the reference path converts its gather
            k = tl.load(kv_ptr + rows + k_col[None, :], mask=seen[:, None], other=0.0).to(q.dtype)
            v = tl.load(kv_ptr + rows + v_offset + k_col[None, :], mask=seen[:, None], other=0.0).to(q.dtype)
            if IEEE:  # noqa: SIM108 (a constexpr branch: triton compiles one side, a ternary would trace both)
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k)).to(tl.float32)
            scores = scores * scale
            if HAS_SOFTCAP:  # softcap * tanh(x / softcap), tanh through exp (present in every triton)
                scores = softcap * (2.0 / (1.0 + tl.exp(-2.0 * scores / softcap)) - 1.0)
            scores = tl.where(seen[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m = m_new
        out = ((b * tl.num_programs(1) + h) * splits + s) * G_PAD + g
        tl.store(m_ptr + out, m)
        tl.store(l_ptr + out, l_sum)
        tl.store(acc_ptr + out[:, None] * D + d[None, :], acc)

    @triton.jit
    def merge_splits(acc_ptr, m_ptr, l_ptr, out_ptr, stride_ob, stride_oh, splits,
                     G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, S_PAD: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, S_PAD)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        base = (b * tl.num_programs(1) + h) * splits
        rows = (base + sp)[:, None] * G_PAD + g[None, :]  # (S_PAD, G_PAD)
        real = (sp < splits)[:, None]
        top = tl.max(tl.load(m_ptr + rows, mask=real, other=float("-inf")), 0)  # (G_PAD,)
        num = tl.zeros([G_PAD, D], tl.float32)
        den = tl.zeros([G_PAD], tl.float32)
        for i in range(0, splits):  # one split's (G_PAD, D) tile at a time: a whole 3-D load would spill
            row = (base + i) * G_PAD + g
            m = tl.load(m_ptr + row)
            w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)  # a split that read no page weighs 0
            den += w * tl.load(l_ptr + row)
            num += w[:, None] * tl.load(acc_ptr + row[:, None] * D + d[None, :])
        out = num / den[:, None]
        tl.store(out_ptr + b * stride_ob + (h * G + g)[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])

    return decode_pages, merge_splits


def paged_decode(query: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 kv_heads: int, tokens_per_block: int, scale: float, window: int | None = None,
                 softcap: float | None = None, max_pages: int | None = None,
                 scratch: dict[tuple, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of one new query per sequence over its pages: ``(B, heads, d)`` out, like ``query``.

    ``slots``: the layer's ``(num_blocks * T, entry_elems)`` pool view (rows ``(2, kv_heads, d)``); ``tables``:
    ``(B, width)`` physical block per logical block (int32/int64, -1 past the end); ``lens``: ``(B,)`` keys per
    sequence including the new token's (already written); ``window``: sliding window (keys ``[len - window, len)``).
    ``max_pages``: the most pages a sequence reads (sizes the splits; default: the table's width). ``scratch``: a
    dict kept across calls that run one after another on one stream (a step's layers) to reuse the partials' buffer.
    """
    B, H, D = query.shape
    if H % kv_heads:
        raise ValueError(f"{H} query heads are not a multiple of {kv_heads} KV heads")
    if slots.shape[1] < 2 * kv_heads * D or slots.stride(1) != 1:
        raise ValueError(f"pool rows of {slots.shape[1]} elements cannot hold K and V of {kv_heads} heads x {D}")
    G = H // kv_heads
    G_PAD = max(MIN_TILE, 1 << (G - 1).bit_length())
    pages = max_pages if max_pages is not None else tables.shape[1]
    splits = max(1, min(MAX_SPLITS, pages // MIN_PAGES_PER_SPLIT))
    q = query if query.stride(2) == 1 else query.contiguous()
    shape = (B, kv_heads, splits, G_PAD)
    buf = scratch.get(shape) if scratch is not None else None
    if buf is None:  # one buffer: acc (..., D), then m and l (...) for every (sequence, KV head, split, head row)
        buf = torch.empty(B * kv_heads * splits * G_PAD * (D + 2), device=query.device, dtype=torch.float32)
        if scratch is not None:
            scratch[shape] = buf
    n = B * kv_heads * splits * G_PAD
    acc, m, l_sum = buf[: n * D], buf[n * D: n * (D + 1)], buf[n * (D + 1):]
    decode_pages, merge_splits = _kernel()
    decode_pages[(B, kv_heads, splits)](
        q, slots, tables, lens, acc, m, l_sum,
        q.stride(0), q.stride(1), slots.stride(0), tables.stride(0), kv_heads * D,
        window or 0, splits, scale, softcap or 0.0,
        G=G, G_PAD=G_PAD, D=D, T=tokens_per_block, HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        IEEE=query.dtype == torch.float32)
    # merge the splits (each an online softmax's (acc, m, l) over its pages) in one more launch, not ~10 torch ops
    out = torch.empty(B, H, D, device=query.device, dtype=query.dtype)
    merge_splits[(B, kv_heads)](acc, m, l_sum, out, out.stride(0), out.stride(1), splits,
                                G=G, G_PAD=G_PAD, D=D, S_PAD=max(2, 1 << (splits - 1).bit_length()))
    return out
