"""vLLM's ``llama4_pythonic`` tool-call parser, kvload's own: ``pythonic``'s list of calls, which Llama 4 may wrap in
``<|python_start|>`` ... ``<|python_end|>`` (``--tool-call-parser llama4_pythonic``).

A reply that begins (after whitespace) with ``<|python_start|>`` has it dropped and is read as ``pythonic`` reads a
reply (:mod:`kvload.serve.tool_parser_pythonic`); a ``<|python_end|>`` after the list, or after a call where the list
is left open, closes the block and is dropped too, and what follows it is content. A reply without the start marker
(its special tokens skipped from the text) is read as ``pythonic`` alone. A marker elsewhere is text, as ``pythonic``
reads any.
"""

from __future__ import annotations

from collections.abc import Collection

from kvload.serve.tool_parser_pythonic import PythonicToolCalls

START = "<|python_start|>"
END = "<|python_end|>"
_SPACE = " \t\n\r"


class Llama4PythonicToolCalls(PythonicToolCalls):
    """One choice's reply read as a Python list of calls, perhaps inside Llama 4's python block markers."""

    def __init__(self, names: Collection[str], parallel: bool = True) -> None:
        super().__init__(names, parallel)
        self._opened: bool | None = None  # whether the reply opened with START; None: not known yet

    def _read(self) -> None:
        if self._opened is None:
            text = self._buf.lstrip(_SPACE)
            if not text or (START.startswith(text) and text != START):  # "", "<|python_st": wait for more
                return
            self._opened = text.startswith(START)
            if self._opened:
                self._buf = self._buf[:len(self._buf) - len(text)] + text[len(START):]
        super()._read()

    def _char(self, buf: str, at: int) -> int:
        if self._opened and self._state in ("after", "end") and buf[at] == END[0]:
            ahead = buf[at:at + len(END)]
            if ahead == END:  # the block ends: the marker is dropped, what follows is content
                self._state, self._placed = "text", True
                return len(END)
            if END.startswith(ahead) and at + len(ahead) == len(buf):
                return 0  # "<|python_e" at the end: wait for more
        return super()._char(buf, at)


__all__ = ["END", "START", "Llama4PythonicToolCalls"]
