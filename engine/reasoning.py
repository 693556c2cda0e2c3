"""vLLM's ``deepseek_r1`` and ``qwen3`` reasoning parsers, kvload's own: a chat reply split into the model's thinking
(``message.reasoning_content``) and its answer (``content``) at the ``<think>`` / ``</think>`` markers
(``kvload serve --reasoning-parser NAME``).

``deepseek_r1``: the reply is reasoning up to the first ``</think>`` and content after it; the ``<think>`` that opens
it is usually in the prompt (the chat template writes it), so the reply may start without one, and one the model
writes itself before ``</think>`` is dropped. No ``</think>`` at all: everything is reasoning (the thinking was cut
short), the content null. ``qwen3``: reasoning only once the model writes ``<think>``, up to ``</think>``; text before
``<think>`` and after ``</think>`` is content, and a reply without ``<think>`` is all content.

A stream is read as it grows (:meth:`ReasoningText.feed`): each piece of text goes out at once as reasoning or content,
but for the end of it that may still become a marker (``</thi``), held until the next piece (or the end) says. So the
markers never reach the client and the pieces joined are exactly the whole answer's two parts.

Structured outputs read a sample with the same rules (``engine.structured``, with
``StructuredOutputsParams.reasoning_parser``): the grammar holds only :attr:`ReasoningText.answer`, from the moment
:attr:`ReasoningText.ended`. Here rather than in ``kvload.serve``, so that the engine and the server agree on where the
thinking ends.
"""

from __future__ import annotations

from engine.stopping import marker_prefix
from pipeline.vllm_compat import REASONING_PARSERS

START = "<think>"
END = "</think>"
#: The parsers (vLLM's ``--reasoning-parser`` names; a plan checks a name against the same ones).
PARSERS = REASONING_PARSERS

_BEFORE, _THINKING, _AFTER = "before", "thinking", "after"  # content before <think>, reasoning, content after


class ReasoningText:
    """One choice's reply, fed as it grows: its reasoning and content, and the stream pieces of each."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"no reasoning parser {parser!r}")
        self.parser = parser
        # deepseek_r1 thinks from the first character (its <think> is in the prompt); qwen3 once it writes <think>
        self._state = _THINKING if parser == "deepseek_r1" else _BEFORE
        self._opened = parser == "qwen3"  # a <think> was taken (deepseek_r1 drops one written before </think>)
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._answer: list[str] = []  # the content after </think> (the content less qwen3's text before <think>)
        self._buf = ""  # text not placed yet: the end of what came that may still become a marker
        self._done = False

    def feed(self, text: str) -> tuple[str, str]:
        """Take the reply's next ``text``; the stream's new (reasoning, content)."""
        before, reasoning, answer = self.read(text)
        return reasoning, before + answer

    def read(self, text: str) -> tuple[str, str, str]:
        """:meth:`feed` with the content in its two places: the stream's new (content before the thinking, reasoning,
        answer after it)."""
        self._buf += text
        parts: dict[str, list[str]] = {_BEFORE: [], _THINKING: [], _AFTER: []}
        while self._buf:
            if self._state == _AFTER:  # past </think>: every character is the answer's, markers included
                parts[_AFTER].append(self._buf)
                self._buf = ""
                break
            markers = (START, END) if self._state == _THINKING and not self._opened else \
                (START,) if self._state == _BEFORE else (END,)
            found = [(at, m) for m in markers if (at := self._buf.find(m)) >= 0]
            out = parts[self._state]
            if not found:
                keep = marker_prefix(self._buf, markers)
                out.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            at, marker = min(found)
            out.append(self._buf[:at])
            self._buf = self._buf[at + len(marker):]
            if marker == START:
                self._state, self._opened = _THINKING, True
            else:
                self._state = _AFTER
        return self._take(parts)

    def finish(self) -> tuple[str, str]:
        """The reply ended: a partial marker held back is text; what a stream still owes, (reasoning, content)."""
        before, reasoning, answer = self.finish_read()
        return reasoning, before + answer

    def finish_read(self) -> tuple[str, str, str]:
        """:meth:`finish` with the content in its two places, as :meth:`read` gives them."""
        if self._done:
            return "", "", ""
        self._done = True
        held, self._buf = self._buf, ""
        return self._take({_BEFORE: [], _THINKING: [], _AFTER: [], self._state: [held]})

    @property
    def reasoning(self) -> str | None:
        """The thinking; None when the reply had none (qwen3 without ``<think>``)."""
        return "".join(self._reasoning) if self._state != _BEFORE else None

    @property
    def content(self) -> str | None:
        """The answer: the text outside the thinking; null when there was thinking and nothing else (vLLM's)."""
        content = "".join(self._content)
        return content if self.reasoning is None else content or None

    @property
    def ended(self) -> bool:
        """Whether the thinking has ended: the end marker was read, and all that follows is the answer."""
        return self._state == _AFTER

    @property
    def holding(self) -> bool:
        """Whether the end of the text fed so far is held back, as it may still become a marker."""
        return bool(self._buf)

    @property
    def thinking_started(self) -> bool:
        """Whether the thinking has begun (always under deepseek_r1; under qwen3 once ``<think>`` was read)."""
        return self._state != _BEFORE

    @property
    def answer(self) -> str:
        """The text read after the end marker ("" before it): the content less qwen3's text before ``<think>``."""
        return "".join(self._answer)

    @property
    def key(self) -> tuple[str, str, bool, str]:
        """What decides how the text to come is read: two readers with equal keys read any text alike."""
        return self.parser, self._state, self._opened, self._buf

    def fork(self) -> ReasoningText:
        """A reader that goes on from where this one is, with nothing read yet (this one is unchanged): what a
        structured output's gate tries a token with, and keeps when the token is taken."""
        fork = ReasoningText(self.parser)
        fork._state, fork._opened, fork._buf = self._state, self._opened, self._buf
        return fork

    def _take(self, parts: dict[str, list[str]]) -> tuple[str, str, str]:
        before, reasoning, answer = ("".join(parts[p]) for p in (_BEFORE, _THINKING, _AFTER))
        if reasoning:
            self._reasoning.append(reasoning)
        if before or answer:
            self._content.append(before + answer)
        if answer:
            self._answer.append(answer)
        return before, reasoning, answer


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """A whole reply as (reasoning, content), as :class:`ReasoningText` reads it."""
    split = ReasoningText(parser)
    split.feed(text)
    split.finish()
    return split.reasoning, split.content


__all__ = ["END", "PARSERS", "START", "ReasoningText", "split_reasoning"]
