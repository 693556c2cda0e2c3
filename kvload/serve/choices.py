"""One choice of an answer as it grows (stop strings, held-back text, offsets, tool calls, reasoning), and its echo."""

from __future__ import annotations

from typing import Any

import attrs

from engine.reasoning import ReasoningText
from engine.serving import ServeEvent, ServingEngine
from engine.stopping import SampleText
from kvload.serve.tool_calls import ToolCallText
from kvload.serve.tool_reader import ToolReader


@attrs.frozen
class _Update:
    """What one engine event adds to a choice: text, token ids, their logprobs and text offsets."""

    text: str
    token_ids: list[int]
    logprobs: list[tuple[float, dict[int, float]]]
    offsets: list[int]


@attrs.define(eq=False)
class _Choice:
    """One choice's growing text: stop strings cut it, an incomplete character or a possible stop is held back."""

    index: int
    engine: ServingEngine
    sample: SampleText | None  # None without a tokenizer (token ids only)
    track_offsets: bool = False  # completions' logprobs.text_offset asked for
    min_tokens: int = 0  # stop strings are looked for only after this many tokens (as the engine does)
    #: the text of every token so far, for the offsets (no stop string cuts it); None without a tokenizer
    offsets: SampleText | None = None
    req_id: str = ""
    token_ids: list[int] = attrs.Factory(list)
    logprobs: list[tuple[float, dict[int, float]]] = attrs.Factory(list)
    text_offsets: list[int] = attrs.Factory(list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    reused: int = 0
    echo: _Echo | None = None  # completions' echo: the prompt, put before the choice's text (and its logprobs)
    echoed: bool = False  # a stream sent the echo (in the choice's first chunk)
    echo_only: bool = False  # echo without generation (max_tokens 0): the token the engine draws is dropped
    opened: bool = False  # a stream sent the choice's first chunk (return_token_ids: its prompt_token_ids)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # when scored (engine): echo or prompt_logprobs
    tools: ToolCallText | None = None  # chat's tool_choice named or "required": the reply read as tool calls
    auto: ToolReader | None = None  # chat's tool_choice "auto" under a parser: the free text read for calls
    thinking: ReasoningText | None = None  # chat under --reasoning-parser: the reply split into reasoning, content
    #: /v1/responses under --reasoning-parser: the reply read as it grows, to count the tokens made while thinking
    gauge: ReasoningText | None = None
    reasoning_tokens: int = 0  # tokens from the one that began the thinking to the one that ended it
    _thinking_from: int = 0  # the token the gauge's thinking began with (deepseek_r1: the first)
    _settled: int = 0  # the tokens whose text the gauge has placed (none of it held as a possible marker)

    def update(self, ev: ServeEvent) -> _Update:
        """Take one engine event; the new text, token ids, logprobs and text offsets to report."""
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs = list(ev.prompt_logprobs)
        if self.echo_only:  # vLLM's echo without generation: the prompt alone, ended by max_tokens 0
            self.prompt_tokens, self.reused = ev.prompt_tokens, ev.reused_prompt_tokens
            if ev.finish_reason is not None:
                self.finish_reason = "length" if ev.finish_reason in ("stop", "length") else ev.finish_reason
                self.error = ev.error
            return _Update("", [], [], [])
        self.token_ids = list(ev.token_ids)
        self.logprobs.extend(ev.logprobs)
        self.prompt_tokens, self.reused = ev.prompt_tokens, ev.reused_prompt_tokens
        if ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason
            self.stop_reason = ev.stop_reason
            self.error = ev.error
        offsets = self._offsets(len(ev.new_token_ids))
        self.text_offsets.extend(offsets)
        delta = ""
        if self.sample is not None:  # the same text rules as LLM.generate: stop strings cut, never shown
            final = self.finish_reason is not None
            # the EOS or stop token that ended it stays in token_ids, not in the text unless include_stop_str_in_output
            # (generate's rule, vLLM's)
            ids = self.token_ids[:-1] if ev.stopped_by_token and not self.sample.include_stop else self.token_ids
            m, new = self.min_tokens, len(ev.new_token_ids)
            if m and new > 1:  # confirmed drafts: searched token by token, as the engine searched them
                for end in range(max(1, len(self.token_ids) - new + 1), len(ids)):
                    self.sample.update(self.token_ids[:end], search=end > m)
            self.sample.update(ids, final=final, search=len(ids) > m)
            delta = self.sample.delta(final=final)
            self.text += delta
        if self.gauge is not None:
            started, ended = self.gauge.thinking_started, self.gauge.ended
            self.gauge.feed(delta)
            if not started and self.gauge.thinking_started:  # qwen3's <think>: the thinking counts from the token
                self._thinking_from = self._settled  # that began the marker (its text was held until it completed)
            if not self.gauge.holding:  # nothing held that may be a marker: the text so far is placed
                self._settled = len(self.token_ids)
            if self.gauge.thinking_started and not ended:  # the event that ends the thinking counts as thinking
                self.reasoning_tokens = len(self.token_ids) - self._thinking_from
        return _Update(delta, list(ev.new_token_ids), list(ev.logprobs), offsets)

    def _offsets(self, new: int) -> list[int]:
        """Where each of the last ``new`` tokens' text begins in the choice's text (characters, as vLLM counts); a
        token that only starts a character begins where the token completing it does. Without a tokenizer the
        text is empty: 0."""
        if not self.track_offsets or self.offsets is None:
            return [0] * new if self.track_offsets else []
        return _token_offsets(self.offsets, self.token_ids, len(self.token_ids) - new)

    @property
    def reason(self) -> str:
        """OpenAI's finish reason; "tool_calls" for a "required" reply the grammar ended (vLLM's: a named call's
        stays "stop", as in OpenAI's API; a stop string or stop token that cut it is "stop", its ``stop_reason``
        saying which), and for an "auto" reply that made a call (vLLM's, cut by length too)."""
        reason = {"stop": "stop", "length": "length"}.get(self.finish_reason or "", self.finish_reason or "stop")
        if self.auto is not None and self.auto.calls and reason in ("stop", "length"):
            return "tool_calls"
        ended = reason == "stop" and self.stop_reason is None  # by the grammar's end-of-sequence, not a user's stop
        answered = self.thinking is None or self.thinking.ended  # a reply that never ended its thinking made no call
        return "tool_calls" if ended and answered and self.tools is not None and self.tools.required else reason


@attrs.frozen
class _Echo:
    """A completion prompt as ``echo`` puts it before the choice: its text, token ids and each token's text offset."""

    text: str
    token_ids: list[int]
    offsets: list[int]

    @classmethod
    def of(cls, prompt: Any, ids: list[int], tokenizer: Any, skip_special: bool, spaced: bool = True) -> _Echo:
        """The prompt as given when text (vLLM's), else its decoded ids; offsets where each token's text begins."""
        if tokenizer is None:
            return cls("", list(ids), [0] * len(ids))
        decoded = SampleText(tokenizer, skip_special=skip_special, spaced=spaced)
        offsets = _token_offsets(decoded, ids, 0, final=True)
        return cls(prompt if isinstance(prompt, str) else decoded.text, list(ids), offsets)


def _token_offsets(text: SampleText, token_ids: list[int], first: int, final: bool = False) -> list[int]:
    """Where tokens ``first`` on begin in ``text``, decoded up to each in turn (``text`` holds tokens ``:first``
    already); a token that only starts a character begins where the token completing it does. ``final``: the last
    token ends the text (an unfinished character at the end is decoded as is)."""
    out = []
    for end in range(first + 1, len(token_ids) + 1):
        out.append(len(text.text))  # the text before this token (an unfinished character held back)
        text.update(token_ids[:end], final=final and end == len(token_ids))
    return out
