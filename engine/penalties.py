"""vLLM's penalties and ``min_tokens`` on a step's logits, per request over its own tokens.

Applied to the raw logits before temperature, top-k, top-p and min-p (transformers' and vLLM's order), greedy or
sampled; log-probabilities stay the model's own (vLLM's default ``raw_logprobs``):

* ``repetition_penalty`` r: a token of the prompt or the output has its logit divided by r when positive, else
  multiplied by it (transformers' ``RepetitionPenaltyLogitsProcessor``, vLLM's);
* ``frequency_penalty`` f and ``presence_penalty`` p: ``logit -= f * count + p * (count > 0)``, counting the
  output's tokens only (OpenAI's);
* ``min_tokens`` m: while the output holds fewer than m tokens, EOS (unless ``ignore_eos``) and the stop token ids
  cannot be drawn;
* ``logit_bias``: added to its tokens' logits first (OpenAI's);
* ``allowed_token_ids`` (vLLM's): every other token cannot be drawn (applied before the bias);
* ``bad_words`` (vLLM's, as token id sequences): a word's last token cannot be drawn where the output so far ends
  with the tokens before it (a one-token word: never).

A step with drafts (speculative decoding) has one row per draft position: row ``j`` of a request is penalized as
if its first ``j`` drafts were already output, exactly as a step per token would. Each request's counts are kept
between steps and grow by the tokens it gained, sparse: a step costs O(distinct tokens) per row, neither O(vocab) nor
O(tokens so far) (``bench.bench_sampling``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Any

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


class _PerParams:
    """Tensors built from a SamplingParams setting once per params object and device, the newest 256 kept (a
    long-running server sees many requests' params). ``setting`` is the value they were built from: a caller may
    change a mutable one (a ``logit_bias`` dict) in place between calls, so a different value builds again."""

    def __init__(self) -> None:
        self._hits: dict[tuple[int, torch.device], tuple[SamplingParams, Any, Any]] = {}

    def get(self, params: SamplingParams, device: torch.device, setting: Any, build: Callable[[], Any],
            keep: Callable[[Any], Any] = lambda v: v) -> Any:
        """The tensors ``build()`` made for ``params`` on ``device`` from ``setting``, built now if none match;
        ``keep`` copies a mutable ``setting`` for the next comparison."""
        key = (id(params), device)
        hit = self._hits.get(key)
        if hit is None or hit[0] is not params or (hit[1] is not setting and hit[1] != setting):
            hit = self._hits[key] = (params, keep(setting), build())
            if len(self._hits) > 256:
                del self._hits[next(iter(self._hits))]
        return hit[2]


_BIASES, _ALLOWED = _PerParams(), _PerParams()


def _bias(params: SamplingParams, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``params.logit_bias`` as (ids, biases) tensors, built once per SamplingParams and device."""
    return _BIASES.get(params, device, params.logit_bias, lambda: (
        torch.tensor(list(params.logit_bias), dtype=torch.long, device=device),
        torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)), keep=dict)


def _allowed(params: SamplingParams, device: torch.device) -> torch.Tensor:
    """``params.allowed_token_ids`` as a long tensor, built once per SamplingParams and device (a list the caller may
    change in place between calls, as ``logit_bias``: kept as a copy to compare)."""
    return _ALLOWED.get(params, device, params.allowed_token_ids, lambda: torch.tensor(
        sorted(set(params.allowed_token_ids or ())), dtype=torch.long, device=device), keep=list)


def _banned(words: Sequence[Sequence[int]], out: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The bad words' last tokens banned after ``out`` then ``drafts`` (vLLM's rule: a word whose tokens before its
    last are the tail of the output so far; the output only, never the prompt)."""
    n_out, n = len(out), len(out) + len(drafts)
    banned = []
    for word in words:
        k = len(word) - 1
        if k > n:
            continue
        if all((out[p] if p < n_out else drafts[p - n_out]) == word[i] for i, p in enumerate(range(n - k, n))):
            banned.append(word[-1])
    return banned


def penalize(logits: torch.Tensor, counts: Sequence[int], requests: Sequence[tuple[SamplingParams, Request]],
             eos_token_ids: Collection[int]) -> torch.Tensor:
    """``logits`` (``counts[i]`` rows per request ``i``, in order: 1, or 1 + the drafts it computed) with each
    request's penalties applied; the same tensor when no request has any, else a float32 copy."""
    if not any(p.penalizes for p, _ in requests):
        return logits
    out = logits.float().clone()
    vocab = out.shape[-1]
    rows: list[_Row] = []
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
            words = params._bad_words_token_ids
            out_ids = request.output_token_ids
            # row j follows the first j drafts: output, as a step per token would have them
            rows.extend((start + j, params, seen, stop_ids, generated + j, drafts[:j],
                         _banned(words, out_ids, drafts[:j]) if words else []) for j in range(c))
        start += c
    _penalize_rows(out, rows)
    return out


#: (row, params, seen, stop ids, tokens generated before it, the drafts before it, bad words' tokens banned) of one
#: row to penalize
_Row = tuple[int, SamplingParams, _Seen, list[int], int, Sequence[int], list[int]]


def _penalize_rows(out: torch.Tensor, rows: list[_Row]) -> None:
    """Each row in place (float32): its request's tokens so far, then its drafts as if output after them; one gather
    / scatter per kind over the flattened logits for all rows, not one per row (a batch of 32 decoding requests
    paid ~150 µs a row)."""
    flat = out.view(-1)
    vocab = out.shape[-1]
    device = out.device

    def at(row: int, ids: torch.Tensor) -> torch.Tensor:
        return ids + row * vocab

    allowed = [(row, _allowed(p, device)) for row, p, *_ in rows if p.allowed_token_ids is not None]
    if allowed:  # first, as vLLM's: every other token of the row to -inf, the allowed ones kept
        where = torch.cat([at(row, ids) for row, ids in allowed])
        kept = flat[where]
        out[torch.tensor([row for row, _ in allowed], dtype=torch.long, device=device)] = -torch.inf
        flat[where] = kept
    biased = [(row, *_bias(p, device)) for row, p, *_ in rows if p.logit_bias]
    if biased:  # first, as vLLM's logits processors come before its penalties
        flat.index_add_(0, torch.cat([at(row, ids) for row, ids, _ in biased]), torch.cat([b for *_, b in biased]))
    repeated: list[tuple[torch.Tensor, torch.Tensor]] = []  # flat indices, the r of each
    counted: list[tuple[torch.Tensor, torch.Tensor]] = []
    fresh_at: list[int] = []  # drafts neither seen nor output before, once each: their flat index, their r
    fresh_r: list[float] = []
    drafted_at: list[int] = []  # each distinct draft before a row: its flat index, what presence + frequency take
    drafted: list[float] = []
    for row, p, seen, _, _, drafts, _ in rows:
        rep, f, pres = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
        if rep != 1.0:
            repeated.append((at(row, seen.seen_ids), torch.full((len(seen.seen_ids),), rep, device=device)))
        if (f or pres) and seen.counts:
            counted.append((at(row, seen.out_ids), -(f * seen.out_counts + pres)))
        if drafts:
            extra: dict[int, int] = {}  # the drafts before this row, as output
            for t in drafts:
                extra[t] = extra.get(t, 0) + 1
            for t, n in extra.items():
                if rep != 1.0 and t not in seen.seen:
                    fresh_at.append(row * vocab + t)
                    fresh_r.append(rep)
                if f or pres:
                    drafted_at.append(row * vocab + t)
                    drafted.append(-(f * n + (pres if t not in seen.counts else 0.0)))
    if fresh_at:  # apart from the seen tokens of the same row, so repeated but once
        repeated.append((torch.tensor(fresh_at, dtype=torch.long, device=device),
                         torch.tensor(fresh_r, dtype=torch.float32, device=device)))
    if repeated:
        where = torch.cat([ids for ids, _ in repeated])
        r = torch.cat([rp for _, rp in repeated])
        values = flat[where]
        flat[where] = torch.where(values > 0, values / r, values * r)
    if drafted_at:
        counted.append((torch.tensor(drafted_at, dtype=torch.long, device=device),
                        torch.tensor(drafted, dtype=torch.float32, device=device)))
    if counted:
        flat.index_add_(0, torch.cat([ids for ids, _ in counted]), torch.cat([d for _, d in counted]))
    held = [row * vocab + t for row, p, _, stop_ids, generated, _, _ in rows if generated < p.min_tokens
            for t in stop_ids]
    held += [row * vocab + t for row, *_, banned in rows for t in banned]
    if held:
        flat[torch.tensor(held, dtype=torch.long, device=device)] = -torch.inf


__all__ = ["penalize"]
