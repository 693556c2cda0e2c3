"""Helpers for the generate tests: load a tiny checkpoint on V1 or V2, prompts, transformers' reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import pipeline

NEW_TOKENS = 8
PROMPT_LENGTHS = (5, 13, 21, 2)


def load(path: Path | str, manager: str, *, device: str = "cpu", max_tokens: int = 512, max_seq_len: int = 64,
         max_num_tokens: int = 16, attention_backend: str = "auto", llm: dict[str, Any] | None = None,
         **kv: Any) -> pipeline.LoadResult:
    """``pipeline.load`` with weights on the given manager (``"v1"``/``"v2"``), 4-token blocks, chunked prefill;
    ``llm``: more ``LlmArgs`` fields, ``kv``: more ``KvCacheConfig`` fields.

    The budget holds ``max_tokens`` tokens as sequences of ``max_seq_len`` (so, with windows, it holds
    the windows of ``max_tokens / max_seq_len`` sequences).
    """
    kv_config = {"use_kv_cache_manager_v2": manager == "v2", "tokens_per_block": 4, "max_tokens": max_tokens, **kv}
    return pipeline.load(str(path), load_weights=True, device=device, max_num_tokens=max_num_tokens,
                         max_seq_len=max_seq_len, kv_cache_config=kv_config, attention_backend=attention_backend,
                         log=False, **(llm or {}))


def prompts_for(vocab: int, lengths: tuple[int, ...] = PROMPT_LENGTHS, seed: int = 1234) -> list[list[int]]:
    """Random prompts of the given lengths (ids from 3 up, clear of the usual special ids)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model: Any, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """transformers' own greedy decode of one prompt (its attention and DynamicCache; stops at the model's EOS)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    # the mask given: without it transformers infers one from pad_token_id, masking a prompt's own token 0 as padding
    # (a follow-up turn holding an earlier output's 0 got another reference; diff65)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy_admission(result: pipeline.LoadResult) -> None:
    """Make a V2 result's scheduler admit greedily (no growth headroom), so a tight budget really suspends."""
    result.scheduler.init_ratio = result.scheduler.new_token_ratio = 0.0


def used_blocks(result: pipeline.LoadResult) -> int:
    """Device blocks some request still owns (cached, evictable blocks are not counted)."""
    stats = result.kv_manager.stats()
    return sum(g.used for g in stats.groups.values())


def chat_ids(tokenizer, text: str) -> list[int]:
    """The token ids of ``text`` as one user turn of the tokenizer's chat template, ready to generate."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
