"""A live sample of a generate call: its request, SamplingParams, generator, stop state and outputs so far."""

from __future__ import annotations

import attrs
import torch

from cache_backends.request import Request
from engine.sampling_params import SamplingParams
from engine.stopping import SampleText
from engine.structured import Constraint


@attrs.define(eq=False)
class LiveSample:
    """Executor-side state of one request (one sample of a prompt) of the current call."""

    index: int
    request: Request
    prompt: str | None
    arrival_step: int
    generator: torch.Generator | None = None
    params: SamplingParams = attrs.Factory(SamplingParams)
    sample: int = 0  # which of the prompt's n samples
    parent: LiveSample | None = None  # the prompt's first sample (which prefills for the others)
    text: SampleText | None = None  # None without a tokenizer
    logprobs: list[dict[int, float]] | None = None  # one entry per generated token, with SamplingParams.logprobs
    #: with SamplingParams.prompt_logprobs, on the prompt's first sample (which prefills): one entry per prompt token,
    #: None for the first (vLLM's shape)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    stop_reason: str | int | None = None
    finish_reason: str | None = None
    queued_at: float = 0.0
    arrived_wall: float = 0.0  # time.time() when queued (RequestMetrics.arrival_time)
    admitted_at: float | None = None  # first admission (RequestMetrics.scheduled_ts)
    first_token_at: float | None = None
    finished_at: float = 0.0
    reported: int = 0  # generated tokens already reported (streamed)
    #: with SamplingParams.structured_outputs: this sample's grammar state (``engine.structured``)
    constraint: Constraint | None = None

