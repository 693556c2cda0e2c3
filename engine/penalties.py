"""vLLM's penalties and ``min_tokens`` on a step's logits, per request over its own tokens.

Applied to the raw logits before temperature, top-k, top-p and min-p (transformers' and vLLM's order), greedy or
sampled; log-probabilities stay the model's own (vLLM's default ``raw_logprobs``):

* ``repetition_penalty`` r: a token of the prompt or the output has its logit divided by r when positive, else
  multiplied by it (transformers' ``RepetitionPenaltyLogitsProcessor``, vLLM's);
* ``frequency_penalty`` f and ``presence_penalty`` p: ``logit -= f * count + p * (count > 0)``, counting the
  output's tokens only (OpenAI's);
* ``min_tokens`` m: while the output holds fewer than m tokens, EOS (unless ``ignore_eos``) and the stop token ids
  cannot be drawn;
* ``logit_bias``: added to its tokens' logits first (OpenAI's).

A step with drafts (speculative decoding) has one row per draft position: row ``j`` of a request is penalized as
if its first ``j`` drafts were already output, exactly as a step per token would. Each request's counts are kept
between steps and grow by the tokens it gained, so a step costs O(vocab) per row, not O(tokens so far).
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Sequence

import attrs
import torch

from cache_backends.request import Request
from engine.sampling_params import SamplingParams


@attrs.define
class _Seen:
    """One request's tokens as vocabulary-sized tensors: its prompt's (a mask) and its output's (counts so far)."""

    prompt: torch.Tensor  # bool (vocab,): in the prompt
    counts: torch.Tensor  # float32 (vocab,): times in the output, for the first ``upto`` output tokens
    upto: int = 0


#: per request, while it lives (a finished request's entry goes with it)
_SEEN: weakref.WeakKeyDictionary[Request, _Seen] = weakref.WeakKeyDictionary()


def _seen(request: Request, vocab: int, device: torch.device) -> _Seen:
    """``request``'s counts, brought up to its output so far."""
    seen = _SEEN.get(request)
    if seen is None or seen.counts.shape[0] != vocab or seen.counts.device != device:
        prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        prompt[torch.tensor(request.prompt_token_ids, device=device)] = True
        seen = _SEEN[request] = _Seen(prompt, torch.zeros(vocab, dtype=torch.float32, device=device))
    out = request.output_token_ids
    if len(out) > seen.upto:
        _count(seen.counts, out[seen.upto:])
        seen.upto = len(out)
    return seen


def _count(counts: torch.Tensor, tokens: Sequence[int]) -> None:
    counts.index_add_(0, torch.tensor(tokens, device=counts.device),
                      torch.ones(len(tokens), dtype=counts.dtype, device=counts.device))


def _penalize_row(row: torch.Tensor, params: SamplingParams, seen: _Seen, counts: torch.Tensor, generated: int,
                  stop_ids: list[int]) -> None:
    """One row in place (float32), its request's output so far being ``counts`` (``generated`` tokens)."""
    if params.logit_bias:  # first, as vLLM's logits processors come before its penalties
        ids, biases = _bias(params, row.device)
        row.index_add_(0, ids, biases)
    r = params.repetition_penalty
    if r != 1.0:
        hit = seen.prompt | (counts > 0)
        row.copy_(torch.where(hit, torch.where(row > 0, row / r, row * r), row))
    if params.frequency_penalty:
        row.sub_(params.frequency_penalty * counts)
    if params.presence_penalty:
        row.sub_(params.presence_penalty * (counts > 0).to(row.dtype))
    if generated < params.min_tokens and stop_ids:
        row[stop_ids] = -torch.inf


def _bias(params: SamplingParams, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``params.logit_bias`` as (ids, biases) tensors, built once per SamplingParams and device."""
    key = (id(params), device)
    hit = _BIASES.get(key)
    if hit is None or hit[0] is not params:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
        biases = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
        hit = _BIASES[key] = (params, ids, biases)
        if len(_BIASES) > 256:  # a long-running server sees many requests' params: keep the newest
            del _BIASES[next(iter(_BIASES))]
    return hit[1], hit[2]


_BIASES: dict[tuple[int, torch.device], tuple[SamplingParams, torch.Tensor, torch.Tensor]] = {}


def penalize(logits: torch.Tensor, counts: Sequence[int], requests: Sequence[tuple[SamplingParams, Request]],
             eos_token_ids: Collection[int]) -> torch.Tensor:
    """``logits`` (``counts[i]`` rows per request ``i``, in order: 1, or 1 + the drafts it computed) with each
    request's penalties applied; the same tensor when no request has any, else a float32 copy."""
    if not any(p.penalizes for p, _ in requests):
        return logits
    out = logits.float().clone()
    vocab = out.shape[-1]
    start = 0
    for c, (params, request) in zip(counts, requests, strict=True):
        if params.penalizes:
            seen = _seen(request, vocab, out.device)
            stop_ids = sorted({t for t in params.stop_token_ids if t < vocab}
                              | (set() if params.ignore_eos else {t for t in eos_token_ids if t < vocab}))
            tally = seen.counts
            drafts = request.draft_token_ids
            generated = len(request.output_token_ids)
            for j in range(c):
                if j:  # row j follows the first j drafts: counted as output, as a step per token would have them
                    tally = tally.clone()
                    _count(tally, [drafts[j - 1]])
                _penalize_row(out[start + j], params, seen, tally, generated + j, stop_ids)
        start += c
    return out


__all__ = ["penalize"]
