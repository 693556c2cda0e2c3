"""Picking the next token (transformers' logits warpers + a seeded draw), log-probabilities, and EOS ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.sampling_params import SamplingParams, is_int


def warpers(top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> LogitsProcessorList:
    """transformers' top-k, top-p then min-p warpers (``generate``'s order; temperature comes first, in float64).

    The nucleus is the smallest set of most likely tokens whose probability reaches ``top_p`` (the
    most likely token is always in it); ``top_k`` of 0 or -1 keeps every token; ``min_p`` drops the tokens less
    likely than ``min_p`` times the most likely one.
    """
    procs = LogitsProcessorList()
    if top_k > 0:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(float(top_p)))
    if min_p > 0.0:
        procs.append(MinPLogitsWarper(float(min_p)))
    return procs


def sample_rows(logits: torch.Tensor, params: SamplingParams,
                generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of ``(rows, vocab)`` logits; row ``i`` draws from ``generators[i]`` (greedy: argmax)."""
    if params.greedy:
        return logits.argmax(dim=-1).tolist()
    probs = target_probs(logits, params)
    return [int(torch.multinomial(row, 1, generator=gen)) for row, gen in zip(probs, generators, strict=True)]


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from, per row of ``(rows, vocab)`` logits (penalized already,
    ``engine.penalties``): softmax at its temperature within its top-k, top-p and min-p (float32)."""
    # transformers' temperature warper in float64 on max-subtracted logits: a tiny temperature (1e-300)
    # then sharpens to argmax instead of overflowing float32 to inf/nan, a huge one flattens to uniform;
    # the scaled scores are fine in float32, where the top-p sort is cheaper
    scores = logits.double()
    scores = scores - scores.max(dim=-1, keepdim=True).values
    if params.temperature != 1.0:
        scores = TemperatureLogitsWarper(float(params.temperature))(None, scores)
    scores = warpers(params.top_k, params.top_p, params.min_p)(None, scores.float())
    return torch.softmax(scores, dim=-1)


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator,
                 top_k: int = 0) -> int:
    """One token from ``(vocab,)`` logits: softmax at ``temperature`` within top-k and the top-p nucleus."""
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    return sample_rows(logits[None], params, [generator])[0]


class Logprob(float):
    """One token's log-probability: a float, with vLLM's ``Logprob`` attributes ``logprob`` (the same value),
    ``rank`` (its 1-based rank in the vocabulary) and ``decoded_token`` (the token's text, special tokens shown; None
    without a tokenizer or with ``detokenize=False``), so ``entry[token].logprob`` reads as it does in vLLM."""

    __slots__ = ("decoded_token", "rank")

    def __new__(cls, value: float, rank: int, decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, value)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (Logprob, (float(self), self.rank, self.decoded_token))

    @property
    def logprob(self) -> float:
        """The log-probability, as a plain float (vLLM's ``Logprob.logprob``)."""
        return float(self)


class TokenLogprobs(dict):
    """One token's logprob entry, a plain ``{token id: log-probability}`` dict of the top alternatives and the token
    itself, with ``rank``: that token's 1-based rank in the whole vocabulary, how many tokens are at least as likely,
    itself included (vLLM's ``Logprob.rank``; the top alternatives' ranks are their places, 1 to k)."""

    __slots__ = ("rank",)

    def __init__(self, entries: Any, rank: int) -> None:
        super().__init__(entries)
        self.rank = rank


#: logits rows compared at once for the ranks: the comparison's (rows, vocab) booleans stay a few tens of MB
_RANK_ROWS = 256


def top_logprobs(logits: torch.Tensor, k: int, sampled: Sequence[int]) -> list[TokenLogprobs]:
    """Per row: the ``k`` most likely token ids → log-probability, plus the sampled token (as vLLM reports them), and
    the sampled token's rank in the vocabulary (:class:`TokenLogprobs`).

    Log-probabilities are of the model's own distribution (log-softmax of the raw logits, before
    temperature, top-k or top-p), so a sample's tokens can be scored whatever the sampling settings.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    k = min(k, logp.shape[-1])
    values, ids = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
    chosen = logp.gather(-1, torch.tensor(list(sampled), dtype=torch.long, device=logp.device).view(-1, 1))
    ranks: list[int] = []
    for start in range(0, logp.shape[0], _RANK_ROWS):  # (logp >= chosen) at once would be rows x vocab booleans
        end = start + _RANK_ROWS
        ranks.extend((logp[start:end] >= chosen[start:end]).sum(dim=-1).tolist())
    out = []
    for vals, idx, token, lp, rank in zip(values.tolist(), ids.tolist(), sampled, chosen.view(-1).tolist(), ranks,
                                          strict=True):
        entry = {t: Logprob(v, place) for place, (t, v) in enumerate(zip(idx, vals, strict=True), start=1)}
        entry.setdefault(int(token), Logprob(lp, rank))
        out.append(TokenLogprobs(entry, rank))
    return out


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


__all__ = ["Logprob", "TokenLogprobs", "eos_token_ids", "sample_rows", "sample_token", "top_logprobs", "warpers"]
