"""vLLM's ``hermes`` tool-call parser, kvload's own: a free-text chat reply read for
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (``tool_choice: "auto"`` under
``kvload serve --enable-auto-tool-choice --tool-call-parser hermes``).

Each complete block whose JSON object names one of the request's tools and gives its ``arguments`` as an object
becomes a tool call (``arguments`` re-serialized as JSON text, as vLLM does); every other character of the reply
(text around the blocks, a block that does not parse, one never closed) is the reply's ``content``. A stream is read
as it grows (:meth:`HermesToolCalls.feed`): content goes out at once up to a possible ``<tool_call>``, a block is held
until it closes and then sent as one whole tool call (or as content), so the pieces joined are the whole answer's.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from kvload.serve.tool_calls import tool_call_id

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # Python's json takes NaN and Infinity; arguments must be JSON


def read_call(inner: str, names: Collection[str]) -> tuple[str, str] | None:
    """A block's text as (name, arguments JSON), or None when it is no call of one of ``names``."""
    try:
        doc = json.loads(inner, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    name, arguments = doc.get("name"), doc.get("arguments")
    if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


class HermesToolCalls:
    """One choice's reply, fed as it grows; its tool calls and content, and the stream deltas that carry them."""

    def __init__(self, names: Collection[str], parallel: bool = True) -> None:
        self.names = names
        self.parallel = parallel
        self.calls: list[dict[str, Any]] = []  # OpenAI's message.tool_calls entries
        self._text = ""  # the reply's text outside the calls
        self._sent = 0  # characters of it a stream has sent
        self._spoken = False  # content holds more than whitespace (sent as it comes from then on)
        self._buf = ""  # text not placed yet: a possible start of OPEN, or an open block
        self._inside = False  # _buf starts with OPEN
        self._scanned = 0  # characters of _buf already searched for CLOSE
        self._done = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Take the reply's next ``text``; the stream's new content and ``delta.tool_calls`` entries."""
        self._buf += text
        calls = len(self.calls)
        while self._buf:
            if not self._inside:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = _open_prefix(self._buf)  # a "<tool" at the end may yet become a block
                    self._add(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                self._add(self._buf[:at])
                self._buf, self._inside, self._scanned = self._buf[at:], True, len(OPEN)
            end = self._buf.find(CLOSE, max(len(OPEN), self._scanned - len(CLOSE) + 1))
            if end < 0:
                self._scanned = len(self._buf)
                break
            block, self._buf = self._buf[:end + len(CLOSE)], self._buf[end + len(CLOSE):]
            self._inside = False
            call = read_call(block[len(OPEN):end], self.names) if self.parallel or not self.calls else None
            if call is None:
                self._add(block)  # the model's text, as written (vLLM keeps a reply it cannot read as content)
            else:
                self.calls.append({"id": tool_call_id(), "type": "function",
                                   "function": {"name": call[0], "arguments": call[1]}})
        return self._new_content(), [{"index": i, **c} for i, c in enumerate(self.calls[calls:], calls)]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The reply ended: a block never closed (or a partial ``<tool_call>``) is content; what a stream still owes."""
        if not self._done:
            self._done = True
            self._add(self._buf)
            self._buf = ""
        return self._new_content(), []

    @property
    def content(self) -> str | None:
        """The text outside the calls; None when calls were made and nothing but whitespace is left (vLLM's)."""
        return None if self.calls and not self._spoken else self._text

    def _add(self, text: str) -> None:
        if text:
            self._text += text
            self._spoken = self._spoken or bool(text.strip())

    def _new_content(self) -> str:
        """Content a stream may send now: whitespace alone is held, for it is no content once a call is made."""
        if not (self._spoken or (self._done and not self.calls)):
            return ""
        piece, self._sent = self._text[self._sent:], len(self._text)
        return piece


def _open_prefix(text: str) -> int:
    """How many characters at the end of ``text`` are a proper prefix of ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


__all__ = ["CLOSE", "OPEN", "HermesToolCalls", "read_call"]
