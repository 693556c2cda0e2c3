"""The text of one sample as it grows: stop strings found in it, and the deltas a stream may show; and how much of a
streamed text may still become a marker (:func:`marker_prefix`, for the reply parsers of `kvload serve`).

Stop strings are matched on the detokenized text (a stop string may span tokens, or sit inside
one), as vLLM does; the text is cut before the first match and the stop string is not part of it.
While streaming, the last ``len(longest stop) - 1`` characters are held back, because the next
token could complete a stop string that begins there; the final delta releases what remains. With
``include_stop`` nothing is held back (vLLM's ``stop_buffer_length`` 0): the text is then cut after
the stop string, which ends in the newest token's text, so no character already handed out is cut.

The text grows incrementally: each step decodes only a short window — a few tokens already
decoded (at least :data:`CONTEXT_TOKENS` that are not special) plus the new ones — and appends
what the new tokens add to the window's text, so a step costs the same at token 10 and at token
10,000 (re-decoding the whole output every step made a sample's text quadratic in its length).
The window's leading tokens give the decoder the context a token's text depends on (SentencePiece's
leading space, a byte-level character split over tokens, the spaces a word-level decoder joins
with). The final text of a sample is one full decode, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

#: already decoded, non-special tokens each window starts with (vLLM's incremental detokenizer uses 5)
CONTEXT_TOKENS = 6


class SampleText:
    """Decoded text of one sample's generated tokens, cut at the first stop string.

    ``include_stop``: the cut falls after the stop string, not before it (vLLM's ``include_stop_str_in_output``);
    ``skip_special``: special tokens (EOS, chat markers) decode to nothing (vLLM's ``skip_special_tokens``);
    ``spaced`` false: an added token right after another is joined to it without the separator the decoder may put
    between tokens (a word-level decoder's space; vLLM's ``spaces_between_special_tokens``, which acts only where
    special tokens are shown).
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), *, include_stop: bool = False,
                 skip_special: bool = True, spaced: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.skip_special = skip_special
        # the added tokens (special ones and the rest, as vLLM takes them) whose neighbours are joined unspaced
        added = () if skip_special or spaced else (getattr(tokenizer, "added_tokens_decoder", None) or {})
        self._joined = frozenset(int(t) for t in added)
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # most text an unfinished stop string spans
        # what a stream holds back: only text that a stop string may still cut away
        self._held = 0 if include_stop else self.hold
        self.text = ""
        self.stop_hit: str | None = None
        self._decoded = 0  # token count of the last update
        self._final = False  # whether that update decoded them as final (then the same tokens need no decode again)
        self._searched = 0  # characters of text already searched for stop strings
        self._emitted = 0  # characters handed out as deltas
        self._ids: list[int] = []  # the tokens whose text is in _full
        self._full = ""  # the decoded text of _ids (before any stop cut)
        self._start = 0  # the first token of the next window
        special = getattr(tokenizer, "all_special_ids", None) or ()
        self._special = frozenset(int(t) for t in special)

    def _decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        joined = self._joined
        # unspaced added tokens: decoded in pieces cut before each added token that follows another, so nothing the
        # decoder puts between two tokens comes between those two (each piece keeps its own tokens' context)
        cuts = [i for i in range(1, len(ids)) if ids[i] in joined and ids[i - 1] in joined] if joined else []
        return "".join(self._decode_piece(ids[a:b]) for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True))

    def _decode_piece(self, ids: list[int]) -> str:
        # no clean-up pass: it rewrites earlier text (" ." → "."), which a stream could not take back
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special, clean_up_tokenization_spaces=False)

    def _window_start(self) -> int:
        """Where the next window begins: far enough back to hold CONTEXT_TOKENS non-special tokens."""
        seen, i = 0, len(self._ids)
        while i > 0 and seen < CONTEXT_TOKENS:
            i -= 1
            if self._ids[i] not in self._special:
                seen += 1
        return i

    def _grow(self, token_ids: Sequence[int]) -> str | None:
        """The text of ``token_ids`` (which extend ``_ids``) from a window decode; None if it needs a full one."""
        window = self._ids[self._start:]
        before = self._decode(window)
        after = self._decode(window + list(token_ids[len(self._ids):]))
        if not after.startswith(before):  # the decoder rewrote context text: only a full decode is safe
            return None
        return self._full + after[len(before):]

    def update(self, token_ids: Sequence[int], final: bool = False, search: bool = True) -> str | None:
        """Decode ``token_ids`` (the sample's tokens that count as text); the stop string found, else None.

        ``final``: the sample ended, so an incomplete multi-byte character at the end is decoded as is.
        ``search``: False while ``min_tokens`` holds stops back; the text decoded meanwhile is never searched
        (vLLM's rule), only a stop string that ends after it.
        """
        if self.stop_hit is not None or (len(token_ids) == self._decoded and (not final or self._final)):
            return self.stop_hit  # (token_ids only grow: the same count is the same tokens)
        self._decoded, self._final = len(token_ids), final
        n = len(self._ids)
        text = None
        start = self._start
        # token_ids grows by appending: checking the window's tokens (what the next decode reads) keeps a
        # step's work independent of the output's length; a list that changed inside them gets a full decode
        if not final and len(token_ids) > n and list(token_ids[start:n]) == self._ids[start:]:
            text = self._grow(token_ids)
        grown = text is not None
        if text is None:  # the first tokens, the final text, or tokens that do not extend the decoded ones
            text = self._decode(token_ids)
        if text.endswith("\ufffd") and not final:  # wait for the token that completes the character
            return None
        if grown:
            self._ids.extend(token_ids[n:])  # the tokens before n are the ones decoded before
        else:
            self._ids = list(token_ids)
        self._full = text
        self._start = self._window_start()
        self.text = text
        if self.stop and not search:
            self._searched = len(text)
        elif self.stop:
            # each stop string is looked for only where it would end in the new text (vLLM's lookback of its
            # length - 1): one common start, the longest's, also found a shorter one wholly inside text decoded
            # under min_tokens, which is never searched, so an unrelated long stop string changed where a sample ended
            searched = self._searched
            hits = [(pos, s) for s in self.stop if (pos := text.find(s, max(0, searched - len(s) + 1))) != -1]
            self._searched = len(text)
            if hits:
                pos, self.stop_hit = min(hits)
                self.text = text[:pos + len(self.stop_hit)] if self.include_stop else text[:pos]
        return self.stop_hit

    def delta(self, final: bool = False) -> str:
        """The text not handed out yet, minus what a stop string could still claim (all of it when ``final``)."""
        end = len(self.text) if final or self.stop_hit is not None else len(self.text) - self._held
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted:end]
        self._emitted = end
        return out


def marker_prefix(text: str, markers: Iterable[str]) -> int:
    """How many characters at the end of ``text`` are a proper prefix of one of ``markers`` (the most): what a
    stream read for markers (``</think>``, ``<tool_call>``) holds back, as the next piece may complete one."""
    held = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), held, -1):
            if marker.startswith(text[-n:]):
                held = n
                break
    return held


__all__ = ["CONTEXT_TOKENS", "SampleText", "marker_prefix"]
