"""vLLM's ``hermes`` tool-call parser, kvload's own: a free-text chat reply read for
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (``tool_choice: "auto"`` under
``kvload serve --enable-auto-tool-choice --tool-call-parser hermes``); :func:`tool_reader` picks the parser.

A block whose JSON object names one of the request's tools and gives its ``arguments`` as an object is a tool call,
its ``arguments`` the object's JSON text as written. It is one as soon as its name is known to be a tool's and its
arguments have begun (:class:`~kvload.serve.tool_reader.JsonCall`): a stream names it then and sends its arguments
as they are read. What follows the call's JSON in its block (whitespace, or text that broke the JSON) is not content;
the block ends at its ``</tool_call>``, or where a new ``<tool_call>`` begins. A block that is no call (not JSON,
another name, ``arguments`` no object, never closed before being a call) is content, as written, to its
``</tool_call>``; so is all text around the blocks, sent at once up to a possible ``<tool_call>``.
"""

from __future__ import annotations

from collections.abc import Collection

from engine.stopping import marker_prefix
from kvload.serve.tool_reader import JsonCall, ToolReader

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesToolCalls(ToolReader):
    """One choice's reply read for ``<tool_call>`` blocks."""

    def __init__(self, names: Collection[str], parallel: bool = True) -> None:
        super().__init__(names, parallel)
        self._state = "text"  # text | block (not a call yet) | call | skip (after a call's JSON) | content
        self._block = ""  # an open block's text while it may still be a call
        self._json: JsonCall | None = None
        self._tail = ""  # "content": the end of the block's text sent, where a </tool_call> may have begun

    def _read(self) -> None:
        while self._buf and getattr(self, f"_in_{self._state}")():
            pass

    def _end(self) -> None:
        if self._state in ("text", "content", "block"):  # a block never closed that was no call yet is text
            self._add(self._block + self._buf)
        self._block = self._buf = ""

    # each state takes what it can of _buf; True: read on (in the state it left)

    def _in_text(self) -> bool:
        at = self._buf.find(OPEN)
        if at < 0:
            keep = marker_prefix(self._buf, (OPEN,))  # a "<tool" at the end may yet become a block
            self._add(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._add(self._buf[:at])
        if not self.may_call:  # parallel_tool_calls false, and a call made: the block is text
            self._buf, self._state, self._tail = self._buf[at:], "content", ""
            return True
        self._buf = self._buf[at + len(OPEN):]
        self._block, self._json, self._state = OPEN, JsonCall(self.names), "block"
        return True

    def _in_block(self) -> bool:
        call = self._json
        assert call is not None
        used = call.take(self._buf)
        self._block, self._buf = self._block + self._buf[:used], self._buf[used:]
        if call.refused:  # no call: the block is text, to its </tool_call>
            self._buf, self._block, self._state, self._tail = self._block + self._buf, "", "content", ""
            return True
        if call.ready:
            self._call(call.name, call.arguments)  # type: ignore[arg-type]
            self._block, self._state = "", "skip" if call.ended else "call"
            return True
        return False

    def _in_call(self) -> bool:
        call = self._json
        assert call is not None
        self._read_arguments(call)
        if call.ended:
            self._state = "skip"
            return True
        return False

    def _in_skip(self) -> bool:
        """After a call's JSON: the rest of its block is dropped, to the </tool_call> or a new <tool_call>."""
        ends = [(at, tag) for tag in (CLOSE, OPEN) if (at := self._buf.find(tag)) >= 0]
        if not ends:
            keep = marker_prefix(self._buf, (CLOSE, OPEN))
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        at, tag = min(ends)
        self._buf = self._buf[at + len(CLOSE):] if tag == CLOSE else self._buf[at:]
        self._state = "text"
        return True

    def _in_content(self) -> bool:
        """A block that is no call: content, as written, to its </tool_call>."""
        seen = self._tail + self._buf
        at = seen.find(CLOSE)
        if at < 0:
            self._add(self._buf)
            self._tail, self._buf = seen[-(len(CLOSE) - 1):], ""
            return False
        end = at + len(CLOSE) - len(self._tail)
        self._add(self._buf[:end])
        self._buf, self._tail, self._state = self._buf[end:], "", "text"
        return True


def tool_reader(parser: str, names: Collection[str], parallel: bool = True) -> ToolReader:
    """The reader of one ``"auto"`` reply under ``--tool-call-parser parser`` (one of ``TOOL_CALL_PARSERS``)."""
    from kvload.serve.tool_parser_llama import Llama3JsonToolCalls
    from kvload.serve.tool_parser_llama4 import Llama4PythonicToolCalls
    from kvload.serve.tool_parser_pythonic import PythonicToolCalls

    kinds: dict[str, type[ToolReader]] = {"hermes": HermesToolCalls, "llama3_json": Llama3JsonToolCalls,
                                          "pythonic": PythonicToolCalls, "llama4_pythonic": Llama4PythonicToolCalls}
    return kinds[parser](names, parallel)


__all__ = ["CLOSE", "OPEN", "HermesToolCalls", "tool_reader"]
