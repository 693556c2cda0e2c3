"""Picking the next token: temperature + top-p sampling, and the end-of-sequence ids of a model."""

from __future__ import annotations

from typing import Any

import torch

from engine.sampling_params import is_int


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token from ``(vocab,)`` logits: softmax at ``temperature``, cut to the top-p nucleus, drawn by ``generator``.

    The nucleus is the smallest set of most likely tokens whose probability reaches ``top_p`` (the
    most likely token is always in it).
    """
    # float64, and the largest logit subtracted first: a tiny temperature (1e-300) then sharpens to
    # argmax instead of overflowing float32 to inf/nan; a huge one flattens to uniform.
    # The probabilities themselves are fine in float32 (sorting them there is the cost of top-p).
    scaled = logits.double()
    probs = torch.softmax((scaled - scaled.max()) / temperature, dim=-1).float()
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the more likely tokens
        cut = before >= top_p
        cut[..., 0] = False  # the most likely token is always kept, however small top_p is (1e-50)
        sorted_probs = sorted_probs.masked_fill(cut, 0.0)
        pick = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[pick])
    return int(torch.multinomial(probs, 1, generator=generator))


def eos_token_ids(model: Any, tokenizer: Any = None) -> frozenset[int]:
    """End-of-sequence ids from the generation config, the model config and the tokenizer (each may give a list)."""
    sources = [getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer]
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        sources.append(config.get_text_config())
    ids: set[int] = set()
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if is_int(value):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if is_int(v))
    return frozenset(ids)


__all__ = ["eos_token_ids", "sample_token"]
