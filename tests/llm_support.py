"""Helpers for the ``kvload.LLM`` tests: a tiny checkpoint with a word-level tokenizer, so text paths run fast."""

from __future__ import annotations

import shutil
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Token ``i`` is the word ``w<i>``; text decodes as the words joined by spaces (no special tokens)."""
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")


def with_tokenizer(checkpoint: Path, dest: Path, vocab_size: int) -> Path:
    """A copy of ``checkpoint`` in ``dest`` with a word-level tokenizer saved next to its weights."""
    shutil.copytree(checkpoint, dest)
    word_tokenizer(vocab_size).save_pretrained(dest)
    return dest


def llm_kwargs(manager: str = "v1", **kv: object) -> dict[str, object]:
    """``kvload.LLM`` arguments for the tiny checkpoints: CPU, 4-token blocks, a small budget, quiet."""
    return {"device": "cpu", "max_seq_len": 64, "max_num_tokens": 16, "log": False,
            "kv_cache_config": {"use_kv_cache_manager_v2": manager == "v2", "tokens_per_block": 4,
                                "max_tokens": 512, **kv}}
