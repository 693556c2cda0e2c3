"""The text of one sample as it grows: stop strings found in it, and the deltas a stream may show.

Stop strings are matched on the detokenized text (a stop string may span tokens, or sit inside
one), as vLLM does; the text is cut before the first match and the stop string is not part of it.
While streaming, the last ``len(longest stop) - 1`` characters are held back, because the next
token could complete a stop string that begins there; the final delta releases what remains.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class SampleText:
    """Decoded text of one sample's generated tokens, cut at the first stop string."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.stop_hit: str | None = None
        self._decoded = 0  # token count of the last decode
        self._searched = 0  # characters of text already searched for stop strings
        self._emitted = 0  # characters handed out as deltas

    def update(self, token_ids: Sequence[int], final: bool = False) -> str | None:
        """Decode ``token_ids`` (the sample's tokens that count as text); the stop string found, else None.

        ``final``: the sample ended, so an incomplete multi-byte character at the end is decoded as is.
        """
        if self.stop_hit is not None or (len(token_ids) == self._decoded and not final):
            return self.stop_hit
        self._decoded = len(token_ids)
        # no clean-up pass: it rewrites earlier text (" ." → "."), which a stream could not take back
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if text.endswith("\ufffd") and not final:  # wait for the token that completes the character
            return None
        self.text = text
        if self.stop:
            start = max(0, self._searched - self.hold)
            hits = [(pos, s) for s in self.stop if (pos := text.find(s, start)) != -1]
            self._searched = len(text)
            if hits:
                pos, self.stop_hit = min(hits)
                self.text = text[:pos]
        return self.stop_hit

    def delta(self, final: bool = False) -> str:
        """The text not handed out yet, minus what a stop string could still claim (all of it when ``final``)."""
        end = len(self.text) if final or self.stop_hit is not None else len(self.text) - self.hold
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted:end]
        self._emitted = end
        return out


__all__ = ["SampleText"]
