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
between steps and grow by the tokens it gained, sparse: a step costs O(distinct tokens) per row, neither O(vocab) nor
O(tokens so far) (``bench.bench_sampling``).
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
    """One request's tokens, sparse: the distinct tokens of its prompt and output (for the repetition penalty) and
    its output's tokens with their counts (for presence and frequency), as Python collections and as tensors.

    Sparse because a request holds hundreds of distinct tokens among a vocabulary of 50,000 to 250,000: gathering
    and scattering those costs far less than a pass over the vocabulary per row.
    """

    seen: set[int]  # tokens of the prompt or the output
    seen_ids: torch.Tensor  # the same, as a long tensor
    counts: dict[int, int]  # output token -> times in the output, for its first ``upto`` tokens
    out_ids: torch.Tensor | None = None  # counts' keys and values as tensors (None: rebuilt on next use)
    out_counts: torch.Tensor | None = None
    upto: int = 0


#: per request, while it lives (a finished request's entry goes with it)
_SEEN: weakref.WeakKeyDictionary[Request, _Seen] = weakref.WeakKeyDictionary()


def _seen(request: Request, device: torch.device) -> _Seen:
    """``request``'s tokens, brought up to its output so far."""
    seen = _SEEN.get(request)
    if seen is None or seen.seen_ids.device != device:
        distinct = set(request.prompt_token_ids)
        seen = _SEEN[request] = _Seen(distinct, torch.tensor(sorted(distinct), dtype=torch.long, device=device), {})
    out = request.output_token_ids
    if len(out) > seen.upto:
        fresh = []
        for t in out[seen.upto:]:
            seen.counts[t] = seen.counts.get(t, 0) + 1
            if t not in seen.seen:
                seen.seen.add(t)
                fresh.append(t)
        if fresh:
            seen.seen_ids = torch.cat([seen.seen_ids, torch.tensor(fresh, dtype=torch.long, device=device)])
        seen.out_ids = seen.out_counts = None
        seen.upto = len(out)
    if seen.out_ids is None:
        seen.out_ids = torch.tensor(list(seen.counts), dtype=torch.long, device=device)
        seen.out_counts = torch.tensor(list(seen.counts.values()), dtype=torch.float32, device=device)
    return seen


def _repeat(value: torch.Tensor, r: float) -> torch.Tensor:
    """The repetition penalty of logits: divided by ``r`` when positive, multiplied when not."""
    return torch.where(value > 0, value / r, value * r)


def _penalize_row(row: torch.Tensor, params: SamplingParams, seen: _Seen, drafts: Sequence[int], generated: int,
                  stop_ids: list[int]) -> None:
    """One row in place (float32): its request's tokens so far, then ``drafts`` as if output after them
    (``generated`` tokens in all)."""
    if params.logit_bias:  # first, as vLLM's logits processors come before its penalties
        ids, biases = _bias(params, row.device)
        row.index_add_(0, ids, biases)
    r, f, p = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    if r != 1.0:
        row[seen.seen_ids] = _repeat(row[seen.seen_ids], r)
    if (f or p) and seen.counts:
        row.index_add_(0, seen.out_ids, -(f * seen.out_counts + p))
    extra: dict[int, int] = {}  # the drafts before this row, as output: once each for what was not seen or output
    for t in drafts:
        if r != 1.0 and t not in seen.seen and t not in extra:
            row[t] = _repeat(row[t], r)
        if f or p:
            row[t] -= f + (p if t not in seen.counts and t not in extra else 0.0)
        extra[t] = extra.get(t, 0) + 1
    if generated < params.min_tokens and stop_ids:
        row[stop_ids] = -torch.inf


def _bias(params: SamplingParams, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``params.logit_bias`` as (ids, biases) tensors, built once per SamplingParams and device."""
    key = (id(params), device)
    hit = _BIASES.get(key)
    # the same object with the same biases: a caller may have changed its (mutable) dict in place between calls
    if hit is None or hit[0] is not params or hit[3] != params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
        biases = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
        hit = _BIASES[key] = (params, ids, biases, dict(params.logit_bias))
        if len(_BIASES) > 256:  # a long-running server sees many requests' params: keep the newest
            del _BIASES[next(iter(_BIASES))]
    return hit[1], hit[2]


_BIASES: dict[tuple[int, torch.device], tuple[SamplingParams, torch.Tensor, torch.Tensor, dict[int, float]]] = {}


def penalize(logits: torch.Tensor, counts: Sequence[int], requests: Sequence[tuple[SamplingParams, Request]],
             eos_token_ids: Collection[int]) -> torch.Tensor:
    """``logits`` (``counts[i]`` rows per request ``i``, in order: 1, or 1 + the drafts it computed) with each
    request's penalties applied; the same tensor when no request has any, else a float32 copy."""
    if not any(p.penalizes for p, _ in requests):
        return logits
    out = logits.float().clone()
    vocab = out.shape[-1]
    firsts = []  # (row, params, seen, stop ids, generated) of each request's first row: done together, below
    start = 0
    for c, (params, request) in zip(counts, requests, strict=True):
        if params.penalizes:
            seen = _seen(request, out.device)
            generated = len(request.output_token_ids)
            # read only while min_tokens holds them back (row j: generated + j < min_tokens), so built only then
            stop_ids = sorted({t for t in params.stop_token_ids if t < vocab}
                              | (set() if params.ignore_eos else {t for t in eos_token_ids if t < vocab})) \
                if generated < params.min_tokens else []
            drafts = request.draft_token_ids
            firsts.append((start, params, seen, stop_ids, generated))
            for j in range(1, c):  # row j follows the first j drafts: output, as a step per token would have them
                _penalize_row(out[start + j], params, seen, drafts[:j], generated + j, stop_ids)
        start += c
    _penalize_firsts(out, firsts)
    return out


def _penalize_firsts(out: torch.Tensor, firsts: list[tuple[int, SamplingParams, _Seen, list[int], int]]) -> None:
    """:func:`_penalize_row` without drafts for several rows at once: one gather / scatter per kind over the
    flattened logits, not one per row (a batch of 32 decoding requests paid ~150 µs a row)."""
    flat = out.view(-1)
    vocab = out.shape[-1]
    device = out.device

    def at(row: int, ids: torch.Tensor) -> torch.Tensor:
        return ids + row * vocab

    biased = [(row, *_bias(p, device)) for row, p, *_ in firsts if p.logit_bias]
    if biased:
        flat.index_add_(0, torch.cat([at(row, ids) for row, ids, _ in biased]), torch.cat([b for *_, b in biased]))
    repeated = [(at(row, seen.seen_ids), p.repetition_penalty) for row, p, seen, *_ in firsts
                if p.repetition_penalty != 1.0]
    if repeated:
        where = torch.cat([ids for ids, _ in repeated])
        r = torch.cat([torch.full((len(ids),), rp, device=device) for ids, rp in repeated])
        values = flat[where]
        flat[where] = torch.where(values > 0, values / r, values * r)
    counted = [(at(row, seen.out_ids), -(p.frequency_penalty * seen.out_counts + p.presence_penalty))
               for row, p, seen, *_ in firsts if (p.frequency_penalty or p.presence_penalty) and seen.counts]
    if counted:
        flat.index_add_(0, torch.cat([ids for ids, _ in counted]), torch.cat([d for _, d in counted]))
    held = [row * vocab + t for row, p, _, stop_ids, generated in firsts if generated < p.min_tokens
            for t in stop_ids]
    if held:
        flat[torch.tensor(held, dtype=torch.long, device=device)] = -torch.inf


__all__ = ["penalize"]
