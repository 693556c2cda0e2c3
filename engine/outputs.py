"""What a generate call returns: request outputs (vLLM/TensorRT-LLM shaped), timings, call totals, stream deltas.

``RequestOutput`` (one per prompt) holds ``CompletionOutput``s (one per sample, ``n`` of them), the
prompt, how many prompt tokens were computed and how many reused from the prefix cache, and timings.
``GenerationOutput`` is the flat one-sample form ``LoadResult.generate`` has returned from the start.
``finish_reason`` is ``"stop"`` (EOS, a stop string or a stop token id) or ``"length"`` (``max_tokens``
or ``max_seq_len`` reached), as in vLLM and the OpenAI API.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs


@attrs.frozen
class GenerationTimings:
    """Seconds from the moment a request was queued to its first generated token, and to its end."""

    first_token_s: float
    total_s: float


@attrs.frozen
class GenerationOutput:
    """One prompt's result; ``token_ids`` are the generated ids only (an EOS that ended it included)."""

    index: int  # position of the prompt in the call
    req_id: str
    prompt: str | None  # the text, when the prompt was text
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None  # decoded without special tokens; None without a tokenizer
    finish_reason: str  # "stop" (EOS, stop string, stop token) or "length" (max_tokens, or max_seq_len reached)
    reused_prompt_tokens: int  # prompt tokens whose KV came from the prefix cache
    timings: GenerationTimings
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS or length)
    logprobs: list[dict[int, float]] | None = None  # per generated token, with SamplingParams.logprobs

    def to_dict(self) -> dict[str, Any]:
        """Plain form for ``--json``."""
        return attrs.asdict(self)


FinishReason = Literal["stop", "length"]


class _VllmOutput:
    """What vLLM's output classes carry that kvload has no counterpart for (None), and the plain form."""

    __slots__ = ()

    @property
    def lora_request(self) -> None:
        """vLLM's: the LoRA adapter that generated it; None, as kvload runs the checkpoint's own weights."""
        return None

    @property
    def kv_transfer_params(self) -> None:
        """vLLM's: remote KV transfer (disaggregated prefill) parameters; None, as kvload transfers no KV."""
        return None

    def to_dict(self) -> dict[str, Any]:
        """Plain form for ``--json``."""
        return attrs.asdict(self)


@attrs.define
class CompletionOutput(_VllmOutput):
    """One sample of a prompt, as vLLM's and TensorRT-LLM's ``CompletionOutput`` (mutable, as vLLM's dataclass is:
    a script may rewrite ``out.text`` in place).

    ``token_ids`` are every generated id (an EOS or stop token that ended the sample included);
    ``text`` is their decoded text without special tokens, cut before a stop string (None without a
    tokenizer). ``logprobs[t]`` maps the top token ids at generated token ``t`` (the sampled one
    included) to log-probabilities, its ``rank`` attribute the sampled token's rank in the vocabulary
    (``engine.sampling.TokenLogprobs``); ``cumulative_logprob`` sums the sampled tokens' (both None unless
    ``SamplingParams.logprobs`` is set).
    """

    index: int  # sample number within the prompt, 0 .. n-1
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: FinishReason | None  # None while the sample is still running (streaming)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS or length)

    def finished(self) -> bool:
        """Whether the sample ended (a method, as vLLM's ``CompletionOutput.finished()``)."""
        return self.finish_reason is not None


@attrs.define
class RequestMetrics:
    """When one prompt's request moved through the engine, with the names of vLLM's ``RequestOutput.metrics``
    (its V1 ``RequestStateStats``). ``arrival_time`` is wall-clock (``time.time()``); the ``*_ts`` times are
    ``time.perf_counter()`` seconds, to subtract from each other; over ``n`` samples: the first queued, the first
    admitted, the first token of any, the last token of all."""

    arrival_time: float  # wall clock when the prompt was queued
    queued_ts: float
    scheduled_ts: float  # admitted: its first KV blocks allocated
    first_token_ts: float
    last_token_ts: float
    first_token_latency: float  # seconds from queued to the first generated token (timings.first_token_s)
    num_generation_tokens: int  # over every sample


@attrs.define
class RequestOutput(_VllmOutput):
    """One prompt's result: its samples (``outputs``), the prompt, prompt-token reuse, and timings (mutable, as
    vLLM's is).

    ``computed_prompt_tokens`` + ``reused_prompt_tokens`` count over all ``n`` samples: the samples fork
    one prefill, so ``computed_prompt_tokens`` is one prompt's length (less what the prefix cache held) and
    the rest is ``reused_prompt_tokens`` (KV found in the prefix cache, or forked from the first sample).
    ``timings`` run from the moment the prompt was queued to its first generated token and to its last sample's end.
    """

    request_id: str
    prompt: str | None  # the text, when the prompt was text
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    computed_prompt_tokens: int
    reused_prompt_tokens: int
    timings: GenerationTimings
    finished: bool = True
    #: with SamplingParams.prompt_logprobs: per prompt token, its logprob entry (its top alternatives and itself; its
    #: ``rank`` attribute is the token's rank in the vocabulary, ``engine.sampling.TokenLogprobs``), None for the first
    #: token (vLLM's shape); None when not asked
    prompt_logprobs: list[dict[int, float] | None] | None = None
    #: vLLM's ``metrics``: queue, admission and token times (None only where built without them)
    metrics: RequestMetrics | None = None
    #: vLLM's: the prompt tokens whose KV the prefix cache held, at most the prompt's length (the first sample's reuse;
    #: ``reused_prompt_tokens`` also counts what the other samples forked from it)
    num_cached_tokens: int = 0

    @property
    def encoder_prompt(self) -> None:
        """vLLM's: an encoder-decoder model's encoder prompt; None, as for vLLM's decoder-only models."""
        return None

    @property
    def encoder_prompt_token_ids(self) -> None:
        """vLLM's: the encoder prompt's token ids; None, as for vLLM's decoder-only models."""
        return None


@attrs.frozen
class TokenDelta:
    """One step of one sample while streaming: the token it produced and the text that token adds.

    Concatenating a sample's ``text`` deltas gives its final ``CompletionOutput.text`` (text that
    could still turn out to be part of a stop string is held back until it cannot). The last delta of
    a sample has ``finish_reason`` set; the last delta of a prompt carries its ``RequestOutput``.
    """

    index: int  # the prompt's position in the call
    sample: int  # the sample (CompletionOutput.index)
    token_ids: list[int]  # the new token(s)
    text: str  # the text they add ("" without a tokenizer or while it is held back)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    output: RequestOutput | None = None  # set on the prompt's very last delta


@attrs.frozen
class GenerationStats:
    """Totals of one ``generate`` call; ``forward_s`` is model time, ``kv_s`` scheduler and manager time.

    ``warmup_s`` is the time spent compiling attention shapes this call met first (the compiled path
    pays it once per shape per process); ``wall_s`` and ``forward_s`` leave it out.
    """

    requests: int
    prompt_tokens: int
    reused_prompt_tokens: int
    generated_tokens: int
    steps: int
    wall_s: float
    forward_s: float
    kv_s: float
    suspends: int
    resumes: int
    preemptions: int
    samples: int = 0  # sequences generated (prompts x n); 0 = one per prompt
    warmup_s: float = 0.0  # compiling attention shapes first seen in this call; not in wall_s/forward_s
    draft_tokens: int = 0  # speculative decoding: draft tokens computed
    accepted_draft_tokens: int = 0  # drafts the model confirmed (each one a token without a step of its own)
    #: per draft position (0: the first draft), the drafts confirmed there (sums to accepted_draft_tokens)
    accepted_per_position: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        """Share of the computed drafts the model confirmed (0 without speculation)."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time."""
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        """Prompt tokens computed plus generated tokens, per second of wall time."""
        computed = self.prompt_tokens - self.reused_prompt_tokens + self.generated_tokens
        return computed / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain form for ``--json`` and benchmarks."""
        return {**attrs.asdict(self), "tokens_per_s": self.tokens_per_s, "total_tokens_per_s": self.total_tokens_per_s,
                "acceptance_rate": self.acceptance_rate}

    def line(self) -> str:
        """The one-line throughput summary ``kvload generate`` ends with."""
        n = self.requests
        samples = f" ({self.samples} samples)" if self.samples > n else ""
        moves = f"; {self.suspends} suspended, {self.resumes} resumed" if self.suspends or self.resumes else ""
        if self.warmup_s:
            moves += f"; {self.warmup_s:.1f} s compiling attention, not counted"
        if self.draft_tokens:
            moves += (f"; {self.accepted_draft_tokens} of {self.draft_tokens} draft tokens accepted "
                      f"({self.acceptance_rate:.0%})")
        return (f"-- {n} prompt{'s' if n != 1 else ''}{samples}: {self.prompt_tokens} prompt tokens "
                f"({self.reused_prompt_tokens} reused), {self.generated_tokens} generated in {self.wall_s:.2f} s, "
                f"{self.steps} steps: "
                f"{self.tokens_per_s:.1f} generated tokens/s, {self.total_tokens_per_s:.1f} tokens/s with prefill"
                f"{moves}")


@attrs.frozen
class StreamEvent:
    """What a ``stream`` callback receives for every generated token; ``output`` is set on the last one."""

    index: int
    token_id: int
    token_ids: tuple[int, ...]
    output: GenerationOutput | None = None


class TextStream:
    """Turns the growing token ids of one output into text deltas, holding back an incomplete character.

    A fast (Rust-backed) tokenizer streams through ``tokenizers``' own ``DecodeStream``, which decodes
    each new token against a short window of the previous ones (constant work per token); a slow
    tokenizer re-decodes the whole output and prints what it adds.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text = ""
        self._fed = 0
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._stream = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, token_ids: Sequence[int]) -> str:
        """The text the new tokens add (may be empty while a multi-byte character is incomplete)."""
        if self._stream is not None:
            new = list(token_ids[self._fed:])
            self._fed = len(token_ids)
            return "".join(piece for t in new if (piece := self._stream.step(self._backend, t)) is not None)
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self._text):]  # a tokenizer that rewrites earlier text cannot unprint it
        self._text = text
        return delta


__all__ = ["CompletionOutput", "FinishReason", "GenerationOutput", "GenerationStats", "GenerationTimings",
           "RequestMetrics", "RequestOutput", "StreamEvent", "TextStream", "TokenDelta"]
