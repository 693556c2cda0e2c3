"""The reasoning gate of structured outputs (``StructuredOutputsParams.reasoning_parser``): a sample's grammar held
back while it thinks, and the tables over the vocabulary it reads tokens by.

A :class:`ThinkingGate` (one a sample, made by ``GrammarBackend.constraint``) holds the grammar back while the sample
thinks: its tokens are read as that reasoning parser reads the reply (``engine.reasoning``, on xgrammar's bytes of
each token), and the grammar holds the answer from its first character, the characters after the end marker in the
token that completes it included. While thinking a row is free but for the tokens that would end the thinking with
characters the grammar cannot begin with (``</think>\n`` before a JSON object): those are masked, so what the grammar
is fed always parses. Under ``qwen3`` (thinking only from a ``<think>`` the model writes) the reply's start is
undecided (:attr:`ThinkingGate.pending`): a token may begin ``<think>`` (after whitespace) or be one the grammar takes
first; once the text can no longer become ``<think>`` it is content, and the grammar holds it from its first character.
Vocabulary bytes are read as Latin-1 text, one character a byte: the markers are ASCII, so they
are found where the bytes hold them, and the answer's bytes go to the matcher unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch

from engine.reasoning import END, START, ReasoningText

if TYPE_CHECKING:
    from engine.structured import GrammarBackend

#: What may come before a ``<think>`` under qwen3 and still open the thinking: whitespace (the parser reads any text
#: there as content, but only whitespace keeps the reply's content parseable, as the answer the grammar holds).
BEFORE_THINK = " \t\r\n"
PENDING, OPENS, CONTENT, REFUSED = "pending", "opens", "content", "refused"


def classify_start(prefix: str, text: str) -> tuple[str, str | None]:
    """How a qwen3 reply's start ``prefix`` (whitespace, then a proper prefix of ``<think>``: still undecided) reads
    after ``text``: still ``"pending"``; ``"opens"`` the thinking (with the answer's characters when ``text`` also ends
    it, else None); ``"refused"`` (a ``<think>`` after other text: the parser would split the content around it); or
    ``"content"`` (the grammar holds the whole text from its first character)."""
    if not text:  # begins nothing (a token past the tokenizer's, a special one skipped): the grammar's to take or not
        return CONTENT, None
    s = (prefix.lstrip(BEFORE_THINK) + text).lstrip(BEFORE_THINK)
    if s.startswith(START):
        rest = s[len(START):]
        return OPENS, rest.split(END, 1)[1] if END in rest else None
    if START.startswith(s):
        return PENDING, None
    return (REFUSED if START in s else CONTENT), None


class ThinkingGate:
    """One sample's thinking, which its grammar does not hold (``StructuredOutputsParams.reasoning_parser``): the
    reply read so far (:attr:`reader`), and which tokens would end the thinking with an answer the grammar refuses."""

    __slots__ = ("_pending_rows", "_refused", "_rows", "_starts", "backend", "compiled", "pending", "reader",
                 "skip_special")

    def __init__(self, backend: GrammarBackend, compiled: Any, parser: str, skip_special: bool) -> None:
        self.backend = backend
        self.compiled = compiled
        self.reader = ReasoningText(parser)
        self.skip_special = skip_special  # special tokens are no text (SamplingParams.skip_special_tokens)
        #: qwen3's undecided start: the text so far (whitespace, then part of ``<think>``), which may still open the
        #: thinking or become content; None once decided (and always under deepseek_r1, which thinks from the start)
        self.pending: str | None = "" if parser == "qwen3" else None
        self._pending_rows: dict[str, torch.Tensor] = {}  # undecided text -> its bitmask row
        self._refused: dict[tuple[str, str, bool, str], frozenset[int]] = {}  # per reader state
        self._rows: dict[frozenset[int], torch.Tensor] = {}  # a bitmask row allowing all but these tokens
        self._starts: dict[str, bool] = {}  # answer text -> whether the grammar can begin with it

    def read(self, reader: ReasoningText, token: int) -> tuple[ReasoningText, str | None]:
        """``reader`` after ``token`` (``reader`` unchanged), and the answer's first characters when the token ended the
        thinking ("" when it ended right at the marker), else None."""
        after = reader.fork()
        if not (self.skip_special and token in self.backend.special_token_ids):
            after.feed(self.backend.tables.token_text(token))
        return after, after.answer if after.ended else None

    def text(self, token: int) -> str:
        """``token``'s text as the reply shows it ("" for a special token skipped)."""
        if self.skip_special and token in self.backend.special_token_ids:
            return ""
        return self.backend.tables.token_text(token)

    def classify(self, prefix: str, token: int) -> tuple[str, str]:
        """:func:`classify_start` of ``token`` after the undecided ``prefix`` (an end-of-sequence token is content:
        the reply ends there, so the grammar must be complete), and the token's text."""
        text = self.text(token)
        if token in self.backend.stop_token_ids:
            return CONTENT, text
        kind, answer = classify_start(prefix, text)
        if kind == OPENS and answer and not self.starts(answer):
            kind = REFUSED  # opens and ends the thinking with an answer the grammar cannot begin with
        return kind, text

    def pending_row(self, prefix: str, words: int) -> torch.Tensor:
        """The bitmask row after the undecided ``prefix``: the tokens the grammar takes after it as content, and those
        that keep the start undecided or open the thinking; none that write ``<think>`` after other text."""
        got = self._pending_rows.get(prefix)
        if got is None:
            bitmask = self.backend.xgr.allocate_token_bitmask(1, self.backend.vocab_size)
            matcher = self.matcher(prefix)
            if matcher is None:  # the grammar cannot begin with it: only <think> may come of it
                bitmask.zero_()
            else:
                matcher.fill_next_token_bitmask(bitmask, 0)
            bits = bitmask[0].tolist()[:words]  # the step's bitmask is as wide: one vocabulary
            pending, opens, refused = self.backend.tables.starting(prefix.lstrip(BEFORE_THINK), self.skip_special)
            on = [*pending, *(t for t, answer in opens if not answer or self.starts(answer))]
            off = [*refused, *(t for t, answer in opens if answer and not self.starts(answer))]
            for t in on:
                bits[t // 32] |= 1 << (t % 32)
            for t in off:
                bits[t // 32] &= ~(1 << (t % 32))
            bits = [b & 0xFFFFFFFF for b in bits]
            got = self._pending_rows[prefix] = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits],
                                                            dtype=torch.int32)
        return got

    def refused(self, reader: ReasoningText) -> frozenset[int]:
        """The tokens that, read next by ``reader``, would end the thinking with characters the grammar cannot begin
        with (masked out of the row: the grammar must be able to take what follows the marker)."""
        got = self._refused.get(reader.key)
        if got is None:
            got = frozenset(t for t, answer in self.backend.tables.ending(reader)
                            if answer and not (self.skip_special and t in self.backend.special_token_ids)
                            and not self.starts(answer))
            self._refused[reader.key] = got
        return got

    def row(self, refused: frozenset[int], words: int) -> torch.Tensor:
        """A bitmask row of ``words`` int32 words allowing every token but ``refused`` (xgrammar's layout: bit
        ``t % 32`` of word ``t // 32``), built once per set."""
        got = self._rows.get(refused)
        if got is None:
            bits = [-1] * words
            for t in refused:
                word = bits[t // 32] & 0xFFFFFFFF & ~(1 << (t % 32))
                bits[t // 32] = word - (1 << 32) if word >= 1 << 31 else word
            got = self._rows[refused] = torch.tensor(bits, dtype=torch.int32)
        return got

    def starts(self, answer: str) -> bool:
        """Whether the grammar can begin with ``answer`` (kept: the same few marker tokens come back)."""
        ok = self._starts.get(answer)
        if ok is None:
            ok = self._starts[answer] = self.matcher(answer) is not None
        return ok

    def matcher(self, answer: str) -> Any:
        """A fresh matcher that took ``answer``, or None when the grammar refuses it."""
        matcher = self.backend.xgr.GrammarMatcher(self.compiled)
        return matcher if not answer or matcher.accept_string(answer.encode("latin-1")) else None


class GateTables:
    """Thinking gates' tables over one vocabulary (a :class:`~engine.structured.GrammarBackend`'s), built when first
    needed: each token's bytes as Latin-1 text, the tokens that hold the end marker's last character (only those can
    end the thinking), and per reader state the tokens that would end it and the answer's characters they would
    bring, and per qwen3 start the tokens that keep it undecided, open the thinking or are refused."""

    def __init__(self, info: Any, stop_token_ids: Collection[int], special_token_ids: Collection[int]) -> None:
        self.info = info  # xgrammar's TokenizerInfo
        self.stop_token_ids = stop_token_ids
        self.special_token_ids = special_token_ids
        self._lock = threading.Lock()  # the server's handler threads share the backend
        self._texts: list[str] | None = None
        self._enders: list[tuple[int, str]] = []
        self._ending: dict[tuple[str, str, bool, str], tuple[tuple[int, str], ...]] = {}
        self._starting: dict[tuple[str, bool], tuple[list[int], list[tuple[int, str | None]], list[int]]] = {}

    def token_text(self, token: int) -> str:
        """``token``'s bytes as xgrammar matches them, as Latin-1 text (one character a byte); "" past the
        vocabulary."""
        texts = self.token_texts()
        return texts[token] if 0 <= token < len(texts) else ""

    def ending(self, reader: ReasoningText) -> tuple[tuple[int, str], ...]:
        """The tokens that, read next by ``reader``, end its thinking, each with the answer's characters it brings."""
        got = self._ending.get(reader.key)
        if got is None:
            self.token_texts()
            found = []
            for token, text in self._enders:
                after = reader.fork()
                after.feed(text)
                if after.ended:
                    found.append((token, after.answer))
            got = tuple(found)
            with self._lock:
                self._ending[reader.key] = got
        return got

    def starting(self, prefix: str, skip_special: bool) -> tuple[list[int], list[tuple[int, str | None]], list[int]]:
        """After qwen3's undecided start ``prefix`` (a proper prefix of ``<think>``, whitespace before it dropped): the
        tokens that keep it undecided, those that open the thinking (each with the answer it would begin, or None),
        and those that would write ``<think>`` after other text (:func:`classify_start`); end-of-sequence tokens in
        none (built once per prefix: one pass over the vocabulary)."""
        key = (prefix, skip_special)
        got = self._starting.get(key)
        if got is None:
            pending, opens, refused = [], [], []
            for token, text in enumerate(self.token_texts()):
                if token in self.stop_token_ids:
                    continue
                if skip_special and token in self.special_token_ids:
                    text = ""
                kind, answer = classify_start(prefix, text)
                if kind == PENDING:
                    pending.append(token)
                elif kind == OPENS:
                    opens.append((token, answer))
                elif kind == REFUSED:
                    refused.append(token)
            got = (pending, opens, refused)
            with self._lock:
                self._starting[key] = got
        return got

    def token_texts(self) -> list[str]:
        """Each token's bytes as Latin-1 text, built once (the first call's thread: 62 ms over SmolLM2's vocabulary)."""
        with self._lock:
            if self._texts is None:
                self._texts = [bytes(b).decode("latin-1") for b in self.info.decoded_vocab]
                self._enders = [(t, text) for t, text in enumerate(self._texts) if END[-1] in text]
            return self._texts


__all__ = ["BEFORE_THINK", "CONTENT", "OPENS", "PENDING", "REFUSED", "GateTables", "ThinkingGate", "classify_start"]
