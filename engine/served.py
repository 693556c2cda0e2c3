"""The serving loop's records: a request's loop-side state and a beam search's, the events sent to a request's
sink and its end, and the refusal of a stopped engine."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import attrs
import torch

from cache_backends.request import Request
from engine.beam_search import BeamSearch, BeamSearchParams
from engine.sampling_params import SamplingParams
from engine.stopping import SampleText
from engine.structured import Constraint
from pipeline.errors import GenerationError


@attrs.frozen
class ServeEvent:
    """What a request's sink receives: its new tokens, and on the last event why it ended (or the error)."""

    req_id: str
    new_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # every generated token so far
    finish_reason: str | None = None  # "stop" (EOS or a stop token), "length", "abort" or "error"
    error: str | None = None
    #: with ``finish_reason == "stop"``: the stop token id or the stop string that ended it; None for EOS (vLLM's)
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    #: per new token, when asked: (its log-probability, {token id: log-probability} of the top alternatives)
    logprobs: tuple[tuple[float, dict[int, float]], ...] = ()
    #: with ``prompt_logprobs``, on the first event: per prompt token, its entry (top alternatives and itself), None
    #: for the first token
    prompt_logprobs: tuple[dict[int, float] | None, ...] | None = None

    @property
    def finished(self) -> bool:
        """Whether this is the request's last event."""
        return self.finish_reason is not None

    @property
    def stopped_by_token(self) -> bool:
        """Whether the last token ended it (EOS or a stop token id): that token is in ``token_ids``, not in the text
        (as in ``generate``); a stop string is cut from the text by the face instead."""
        return self.finish_reason == "stop" and not isinstance(self.stop_reason, str)


@attrs.frozen
class FinishedRequest:
    """What an observer learns of a request that ended: its sizes, its reason, and its moments on the loop's clock
    (``time.perf_counter``): queued, first scheduled (None: it never ran), and when each token was sent (the end of
    the step that made it; tokens of one step share it)."""

    prompt_tokens: int
    output_tokens: int
    #: prompt tokens whose KV came from the prefix cache (or a sibling's prefill) when it was first scheduled; a
    #: preempted request's later re-admissions do not change it (vLLM's ``num_cached_tokens``)
    reused_prompt_tokens: int
    reason: str  # "stop", "length", "abort" or "error"
    params: SamplingParams
    sample: int  # which of its prompt's samples (0 ... samples - 1)
    samples: int  # the request's n: samples submitted for its prompt
    queued_at: float
    scheduled_at: float | None
    token_times: tuple[float, ...]
    group: str | None = None  # the first request id of its prompt's n samples (None: a group of one)

    @property
    def ttft_s(self) -> float | None:
        """Queued to first token; None when it never got one (aborted or failed before its prefill ended)."""
        return self.token_times[0] - self.queued_at if self.token_times else None

    @property
    def inter_token_s(self) -> list[float]:
        """Time between consecutive steps that gave it tokens (tokens of one step, drafts confirmed together, are
        one interval: they reached the client together)."""
        return [b - a for a, b in itertools.pairwise(self.token_times) if b > a]

    @property
    def phases(self) -> tuple[float, float, float, float] | None:
        """(queue, prefill, decode, inference) seconds, vLLM's intervals: queued to first scheduled, first scheduled
        to first token, first to last token, first scheduled to last token (prefill + decode; queue + inference is
        the end-to-end latency). None without a first token. A preempted request's recompute counts in the phase
        it interrupted (vLLM measures from the most recent scheduling instead)."""
        if not self.token_times or self.scheduled_at is None:
            return None
        first, last = self.token_times[0], self.token_times[-1]
        return (self.scheduled_at - self.queued_at, first - self.scheduled_at, last - first, last - self.scheduled_at)


@attrs.define(eq=False)
class LiveRequest:
    """The loop's state of one request it serves (one choice of a prompt): sampling, sink, stop and logprobs so far."""

    request: Request
    params: SamplingParams
    sink: Callable[[ServeEvent], Any]
    generator: torch.Generator | None
    stop_token_ids: frozenset[int]
    text: SampleText | None  # with stop strings: the text they are looked for in
    logprobs: int | None
    queued_at: float
    token_times: list[float] = attrs.Factory(list)
    token_logprobs: list[tuple[float, dict[int, float]]] = attrs.Factory(list)
    reported: int = 0
    stop_reason: int | str | None = None  # what ended it with "stop": a stop token id or a stop string
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with params.prompt_logprobs, filled by prefill
    constraint: Constraint | None = None  # with params.structured_outputs: its grammar state
    seed: int | None = None  # the seed its generator started from (with seed_offset): what followers rebuild it from
    sample: int = 0  # its seed_offset: which of its prompt's n samples
    samples: int = 1  # its prompt's n
    scheduled_at: float | None = None  # when a step first scheduled it (the queue time ends there)
    #: a choice given its first token from this first choice's prefill, until sent
    forked_from: LiveRequest | None = None
    group: str | None = None  # its prompt's first choice's request id (what metrics group the n choices by)
    #: an echo without generation (``max_tokens: 0``): the one token it draws is dropped, as an embedding's is (its
    #: end stays "length", what the answer says)
    echo_only: bool = False

    @property
    def drops_token(self) -> bool:
        """Whether the one token its prefill draws is dropped, so it reports and counts none: an embedding's
        (``Request.prefill_only``) or an echo without generation's."""
        return self.request.prefill_only or self.echo_only


@attrs.define(eq=False)
class BeamJob:
    """One beam search the loop runs as a unit of work: its prompt, its choices' sinks and ids, and once started its
    search (``engine.beam_search.BeamSearch``)."""

    ids: list[int]
    params: BeamSearchParams
    sampling: SamplingParams  # what metrics see (max_tokens, greedy)
    sinks: list[Callable[[ServeEvent], Any]]
    req_ids: list[str]  # choice j's id: aborting any of them aborts the search
    salt: str | None
    queued_at: float
    search: BeamSearch | None = None
    scheduled_at: float | None = None


class EngineStopped(GenerationError):
    """:meth:`ServingEngine.submit` after a stop was asked for: nothing was queued (the request would never end)."""


def logprob_and_top(token: int, entry: dict[int, float], k: int) -> tuple[float, dict[int, float]]:
    """A generated token's log-probability and its entry's ``k`` most likely tokens (``ServeEvent.logprobs``)."""
    return entry[token], dict(sorted(entry.items(), key=lambda kv: -kv[1])[:k])


