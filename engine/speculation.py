"""Speculative decoding by n-gram lookup (prompt lookup decoding): draft tokens copied from the sequence itself.

A decode step of a small batch reads every weight once for a handful of rows, so on a memory-bound machine
computing a few more rows costs little. The proposer guesses the next tokens by finding the latest earlier
place where the sequence's last ``n`` tokens occurred (``n`` from ``max_matching_ngram_size`` down to 1) and
copying what followed there; the step computes those drafts beside the last known token, and greedy
verification keeps the drafts the model's argmax agrees with, plus the model's own token after them. Under
greedy decoding the output is the same as one token per step (the same argmax at every position, up to the
rounding of a wider matmul); sampled requests keep each draft with its probability under their own
distribution (:func:`verify_sampled`, which draws each token as one token per step would and keeps a draft it
equals).
Copied text — quoting, summarising, editing code, a repetition loop — is where the guesses land.

TensorRT-LLM calls this ``NGramDecodingConfig(max_draft_len, max_matching_ngram_size)``, vLLM
``speculative_config={"method": "ngram", ...}``; kvload takes the TensorRT-LLM names as two ``LlmArgs`` fields.

Cost: each request keeps a dict from every n-gram (``n <= max_matching_ngram_size``) to the latest position
after it, filled as tokens arrive (O(``max_matching_ngram_size``) per token), so a proposal is a few lookups,
never a scan of the sequence.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from cache_backends.request import Request
from engine.sampling import target_probs

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams


def verify_greedy(best: list[int], drafts: list[int]) -> list[int]:
    """The tokens a greedy step gives: ``best[i]`` is the argmax after the last known token and ``i`` drafts; the
    drafts up to the first the argmax disagrees with, then the argmax after them (``best[:m + 1]``)."""
    m = 0
    while m < len(best) - 1 and best[m] == drafts[m]:
        m += 1
    return best[:m + 1]


def verify_sampled(rows: torch.Tensor, drafts: list[int], params: SamplingParams,
                   generator: torch.Generator) -> list[int]:
    """The tokens a sampled step gives: ``rows[i]`` are the logits after the last known token and ``i`` drafts.
    Row by row, a token is drawn from the request's own distribution (``target_probs``) exactly as one token per
    step would draw it; a draft it equals is kept and the next row drawn, the first it differs from ends the step
    with the drawn token, and after all drafts one more is drawn from the last row.

    This is speculative sampling for a draft that is certain of its tokens (Leviathan et al., 2023, with a one-hot
    draft): draft ``i`` is kept with probability ``p_i(draft)``, and a refused position holds a draw from ``p_i``
    without the draft. Drawing first and comparing spends the request's generator exactly as decoding without
    drafts does (one draw per token), so a seed gives the same tokens with drafts on or off, whatever else runs
    (up to the rounding of a wider step's logits)."""
    probs = target_probs(rows, params)
    kept: list[int] = []
    for i in range(len(rows)):
        token = int(torch.multinomial(probs[i], 1, generator=generator))
        kept.append(token)
        if i >= len(drafts) or token != drafts[i]:
            break
    return kept


def verify_drafted(logits: torch.Tensor, counts: Sequence[int], drafts: Sequence[list[int]],
                   sampling: Sequence[tuple[SamplingParams, torch.Generator | None]],
                   ) -> Iterator[tuple[int, torch.Tensor, list[int]]]:
    """Verification of a step's drafting requests: ``logits`` holds ``counts[i]`` rows per request, in order; for
    each request with drafts (``counts[i] > 1``): ``i``, the logits rows of the tokens it keeps, and those tokens —
    :func:`verify_greedy` over ``drafts[i]``, or :func:`verify_sampled` where ``sampling[i]`` (the request's
    params and generator) samples."""
    start = 0
    for i, c in enumerate(counts):
        if c > 1:
            block = logits[start:start + c]
            params, gen = sampling[i]
            if not params.greedy and gen is not None:
                kept = verify_sampled(block, drafts[i], params, gen)
            else:
                kept = verify_greedy(block.argmax(dim=-1).tolist(), drafts[i])
            yield i, block[:len(kept)], kept
        start += c


class _Index:
    """One sequence's n-grams → the position after their latest occurrence, for ends ``< indexed``."""

    __slots__ = ("after", "indexed")

    def __init__(self) -> None:
        self.after: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in ``after``


class NgramProposer:
    """Draft tokens per request from its own prompt and output (see the module docstring)."""

    def __init__(self, max_draft_len: int, max_matching_ngram_size: int, max_seq_len: int,
                 max_batch_size: int | None = None) -> None:
        if max_draft_len < 1 or max_matching_ngram_size < 1:
            raise ValueError(f"max_draft_len and max_matching_ngram_size must be >= 1, got {max_draft_len} and "
                             f"{max_matching_ngram_size}")
        self.max_draft_len = max_draft_len
        self.max_ngram = max_matching_ngram_size
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size  # draft only while at most this many requests run (None: always)
        self._index: dict[str, _Index] = {}

    def propose(self, request: Request, running: int = 1) -> list[int]:
        """Up to ``max_draft_len`` tokens likely to follow ``request``'s tokens (none when no n-gram recurs, or when
        more than ``max_batch_size`` requests are ``running``).

        Capped so that the drafts and the token after them stay within ``max_new_tokens`` and ``max_seq_len``:
        a request never holds a slot its worst case did not count.
        """
        if self.max_batch_size is not None and running > self.max_batch_size:
            return []
        room = min(request.max_new_tokens - len(request.output_token_ids), self.max_seq_len - request.num_tokens) - 1
        limit = min(self.max_draft_len, room)
        if limit <= 0:
            return []
        end, span = request.num_tokens, request.token_span  # spans: no prompt + output join per step
        index = self._index.get(request.req_id)
        if index is None:
            index = self._index[request.req_id] = _Index()
        after, top = index.after, self.max_ngram
        # n-grams ending before the last token: every earlier place the suffix could have occurred
        first = max(index.indexed, 1)
        if first < end:
            base = max(0, first - top)
            recent = span(base, end)  # the tokens the new n-grams span, once
            for e in range(first, end):
                for n in range(1, min(top, e) + 1):
                    after[tuple(recent[e - n - base:e - base])] = e
        index.indexed = max(index.indexed, end)
        for n in range(min(top, end - 1), 0, -1):  # the longest suffix that occurred before wins
            at = after.get(tuple(span(end - n, end)))
            if at is not None:
                return span(at, min(at + limit, end))
        return []

    def forget(self, req_id: str) -> None:
        """Drop a finished request's index."""
        self._index.pop(req_id, None)

    def clear(self) -> None:
        """Drop every request's index (a call ended)."""
        self._index.clear()

    @property
    def tracked(self) -> int:
        """Requests with an index (kept until :meth:`forget` or :meth:`clear`)."""
        return len(self._index)


__all__ = ["NgramProposer", "verify_drafted", "verify_greedy", "verify_sampled"]
