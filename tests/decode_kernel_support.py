"""One decode step of random sequences over shuffled pages, on a paged decode kernel and on gather + SDPA."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from cache_backends.layout import LayerKV, build_layout
from cache_backends.paged_attention import PagedBatch, SeqChunk, paged_attention
from cache_backends.pools import BlockPools


def decode_step(kernel: Callable[..., torch.Tensor], lengths: list[int], heads: int, tokens_per_block: int,
                window: int | None, dtype: str, softcap: float | None, seed: int, *, kv_heads: int = 2,
                head_dim: int = 16, device: str = "cpu",
                new: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kernel's output, gather + SDPA's)`` for one decode step; pages wholly before a window are released (-1).

    ``new``: tokens each sequence brings this step (default 1 each: a decode step; more: a prefill chunk, so a
    mixed step), its last at position ``length - 1``.
    """
    new = new or [1] * len(lengths)
    layers = [LayerKV(0, "sliding" if window else "full", 2 * kv_heads * head_dim, window=window)]
    layout = build_layout(layers, "v2", tokens_per_block, dtype)
    blocks = sum(-(-n // tokens_per_block) for n in lengths) + 3
    pools = BlockPools(layout, {g.name: blocks for g in layout.groups}, device)
    gen = torch.Generator().manual_seed(seed)
    (group,) = pools.groups
    pools.tensors[group].copy_(torch.randn(pools.tensors[group].shape, generator=gen).to(pools.dtype))
    free = list(range(blocks))
    random.Random(seed).shuffle(free)  # physical pages in no particular order
    chunks = []
    for n, fresh in zip(lengths, new, strict=True):
        table = [free.pop() for _ in range(-(-n // tokens_per_block))]
        if window:  # pages wholly before the window were released: the kernel must never read them
            lo = max(0, n - fresh + 1 - window)  # the first new token's window reaches back furthest
            table[: lo // tokens_per_block] = [-1] * (lo // tokens_per_block)
        chunks.append(SeqChunk([7] * fresh, n - fresh, {group: table}))
    act = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)
    tokens = sum(new)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(act).to(device)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(act).to(device)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(act).to(device)
    outs = []
    for use in (kernel, None):
        batch = PagedBatch.build(chunks, pools, decode_kernel=use)
        outs.append(paged_attention(batch, 0, q, k, v, head_dim ** -0.5, softcap))
    return outs[0], outs[1]
