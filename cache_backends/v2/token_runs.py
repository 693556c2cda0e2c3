"""A request's token ids as V2's radix tree keys them: slices of the sequence and runs packed 8 bytes an id."""

from __future__ import annotations

from itertools import takewhile
from operator import eq, itemgetter, truth

from cache_backends.hashing import pack_tokens
from cache_backends.request import Request

FIRST_TOKEN = itemgetter(slice(0, 8))  # a run's first block's packed bytes -> its first token's


def token_slice(request: Request, start: int, end: int) -> list[int]:
    """``request.all_token_ids[start:end]`` without concatenating the whole sequence."""
    prompt = request.prompt_token_ids
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return request.output_token_ids[start - n : end - n]
    return prompt[start:] + request.output_token_ids[: end - n]


def first_packed(request: Request) -> bytes:
    """``pack_tokens(token_slice(request, 0, 1))`` (``b""`` for a request without tokens) in one call: every lookup of a
    waiting request starts with it, every step it waits."""
    packed = request.packed_ids
    if not packed:  # kept: a waiting request ruled out by it is asked again at every relook (packed_prefix renews it)
        packed = request.packed_ids = pack_tokens((request.prompt_token_ids or request.output_token_ids)[:1])
    return packed[:8]


def packed_prefix(request: Request, end: int) -> bytes:
    """``pack_tokens(token_slice(request, 0, end))``, or a longer run of the leading tokens packed: kept on the
    request (``packed_ids``) and packed again only when a lookup needs more of it. Why: a waiting turn's history,
    packed by each lookup, cost ~6% of V2's KV work on Gemma 3 27B multi-turn at a quarter of the budget (looked up
    twice a step, by the cache-aware order and the admission probe, every step it waits; BENCHMARKS.md "pack61")."""
    packed = request.packed_ids
    if len(packed) < 8 * end:
        packed = request.packed_ids = pack_tokens(token_slice(request, 0, request.num_tokens))
    return packed


def common_prefix(a: bytes, b: bytes) -> int:
    """How many token ids two packed runs (8 bytes each) share at the start."""
    # equal bytes, equal ids; counted at C speed (the leading Trues of a pairwise comparison): a partial match compares
    # up to T - 1 ids with every candidate run, each waiting turn of a conversation, every step it is looked up
    return sum(takewhile(truth, map(eq, memoryview(a).cast("q"), memoryview(b).cast("q"))))
