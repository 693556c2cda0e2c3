"""Test support for the paged path: the tiny model families, and a minimal reference driver.

The driver does toy block allocation + prefill/decode through kvload's paged path.

Not the executor: no scheduler, no budget, no sampling — greedy only. It gives each request a block
table per layer group from a free list over a ``BlockPools``, runs every active request's next chunk
in one packed forward (``models.paged_forward.run_forward``), and releases sliding-window blocks
that fell out of the window (so attention meets ``-1`` entries like it will with KV manager V2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import torch

from cache_backends.flex_paged import FlexPagedAttention
from cache_backends.layout import build_layout
from cache_backends.paged_attention import PagedBatch, SeqChunk
from cache_backends.pools import BlockPools
from models.checkpoint import load_hf_config, resolve_checkpoint
from models.geometry import layers_from_config
from models.paged_forward import run_forward, use_paged_attention


@attrs.define(eq=False)
class ToyRequest:
    """One prompt's progress: tokens, computed count, block tables, outputs and per-step logits."""

    prompt: list[int]
    arrival: int
    max_new_tokens: int
    output: list[int] = attrs.Factory(list)
    logits: list[torch.Tensor] = attrs.Factory(list)
    computed: int = 0
    tables: dict[str, list[int]] = attrs.Factory(dict)
    done: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class ToyAllocator:
    """A LIFO free list per group (one for all groups of a shared arena, whose block ids are global); blocks are
    handed out as sequences grow and returned on release."""

    def __init__(self, pools: BlockPools) -> None:
        self.pools = pools
        self.free = {g: list(range(n - 1, -1, -1)) for g, n in pools.num_blocks.items()}
        if pools.shared:
            one = next(iter(self.free.values()))
            self.free = dict.fromkeys(self.free, one)

    def cover(self, tables: dict[str, list[int]], length: int) -> None:
        for name, g in self.pools.groups.items():
            table = tables.setdefault(name, [])
            while len(table) * g.tokens_per_block < length:
                if not self.free[name]:
                    raise RuntimeError(f"toy allocator: group {name} is out of blocks")
                table.append(self.free[name].pop())

    def drop_out_of_window(self, tables: dict[str, list[int]], next_pos: int) -> None:
        """Release blocks whose every position is before the window of a query at ``next_pos``."""
        for name, g in self.pools.groups.items():
            if g.window is None:
                continue
            table = tables[name]
            first_needed = max(0, next_pos - g.window + 1)
            for i in range(first_needed // g.tokens_per_block):
                if table[i] >= 0:
                    self.free[name].append(table[i])
                    table[i] = -1

    def release(self, tables: dict[str, list[int]]) -> None:
        for name, table in tables.items():
            self.free[name].extend(b for b in reversed(table) if b >= 0)
            table.clear()


class RefDriver:
    """Greedy generation over a model switched to ``kvload_paged`` attention, with toy block tables."""

    def __init__(self, model: Any, *, manager: str = "v2", tokens_per_block: int = 4, blocks_per_group: int = 128,
                 kv_dtype: str | None = None, flex: bool = False, max_num_tokens: int = 64,
                 max_page_padding: float = 0.0) -> None:
        self.model = use_paged_attention(model)
        device = next(model.parameters()).device
        dtype = kv_dtype or str(next(model.parameters()).dtype).removeprefix("torch.")
        self.layout = build_layout(layers_from_config(model.config), manager, tokens_per_block, dtype,
                                   max_page_padding)
        # a shared arena gets the pages the groups would have had apart
        blocks = blocks_per_group * (len(self.layout.groups) if self.layout.shared else 1)
        self.pools = BlockPools(self.layout, {g.name: blocks for g in self.layout.groups}, device)
        self.allocator = ToyAllocator(self.pools)
        #: the compiled attention path (``flex=True``); None runs gather + SDPA
        self.flex = FlexPagedAttention(self.pools, max_num_tokens) if flex else None
        self.steps = 0
        self.max_tokens_in_step = 0

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, chunk_size: int | None = None,
                 arrivals: Sequence[int] | None = None) -> list[ToyRequest]:
        """Run until every request has ``max_new_tokens``; request ``i`` joins at step ``arrivals[i]``."""
        arrivals = arrivals or [0] * len(prompts)
        reqs = [ToyRequest(list(p), a, max_new_tokens) for p, a in zip(prompts, arrivals, strict=True)]
        step = 0
        while not all(r.done for r in reqs):
            active = [r for r in reqs if r.arrival <= step and not r.done]
            step += 1
            if not active:
                continue
            chunks = []
            for r in active:
                new = r.tokens[r.computed:]
                if chunk_size is not None:
                    new = new[:chunk_size]
                self.allocator.cover(r.tables, r.computed + len(new))
                chunks.append(SeqChunk(new, r.computed, {g: list(t) for g, t in r.tables.items()}))
            logits = run_forward(self.model, PagedBatch.build(chunks, self.pools, flex=self.flex))
            self.steps += 1
            self.max_tokens_in_step = max(self.max_tokens_in_step, sum(len(c.token_ids) for c in chunks))
            for r, chunk, row in zip(active, chunks, logits, strict=True):
                r.computed += len(chunk.token_ids)
                if r.computed < len(r.tokens):
                    self.allocator.drop_out_of_window(r.tables, r.computed)
                    continue  # mid-prefill: this chunk's last logits predict nothing yet
                r.logits.append(row.float().cpu())
                r.output.append(int(row.argmax()))
                if len(r.output) >= r.max_new_tokens:
                    r.done = True
                    self.allocator.release(r.tables)
                else:
                    self.allocator.drop_out_of_window(r.tables, r.computed)
        return reqs

    def close(self) -> None:
        self.pools.release()


WINDOW = 8

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("tiny-llama", {}),
    "qwen3": ("tiny-qwen3", {}),
    "mistral": ("tiny-mistral", {"sliding_window": WINDOW}),
    "gemma3": ("tiny-gemma3", {"sliding_window": WINDOW}),
    # 9 sliding + 2 full layers: with kv_cache_config.max_page_padding (PAGE_PADDING) a shared arena of 2-layer pages
    # (6 groups, not gcd's eleven 1-layer ones) whose last sliding group holds 1 layer in a 2-layer page
    "gemma3-padded": ("tiny-gemma3", {"sliding_window": WINDOW, "num_hidden_layers": 11,
                                      "layer_types": [*["sliding_attention"] * 4, "full_attention",
                                                      *["sliding_attention"] * 5, "full_attention"]}),
    "deepseek-v3": ("tiny-deepseek-v3", {}),
}

#: ``kv_cache_config.max_page_padding`` a family's layout is built with (the opt-in padded pages; 0 elsewhere):
#: gemma3-padded's 2-layer pages leave at most 1/12 of a sequence's page bytes unused
PAGE_PADDING: dict[str, float] = {"gemma3-padded": 0.10}

#: DeepSeek V4 with windows and compression rates small enough that short prompts cross several of each (V2 only, and
#: not driven by RefDriver, which keeps no side state: see tests/test_deepseek_v4_generate.py)
V4_FAMILY = ("tiny-deepseek-v4", {
    "sliding_window": WINDOW, "index_topk": 3,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}})

CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA device")])


def tiny_config(family: str, **extra: Any) -> Any:
    """The preset config of a family with a raised initializer range (and its window shrunk to ``WINDOW``)."""
    preset, overrides = V4_FAMILY if family == "deepseek-v4" else FAMILIES[family]
    cfg = load_hf_config(resolve_checkpoint(preset))
    for key, value in {"initializer_range": 0.2, **overrides, **extra}.items():
        setattr(cfg, key, value)
    return cfg
