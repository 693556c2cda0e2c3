"""vLLM's ``llama3_json`` tool-call parser, kvload's own: Llama 3.1/3.2's JSON tool calls, a reply that is
``{"name": ..., "parameters": {...}}`` (``"arguments"`` taken too), several separated by ``;``, optionally after
``<|python_tag|>`` (``--tool-call-parser llama3_json``).

The reply is read as calls only when it begins with one (after whitespace and the tag): a reply that begins with
anything else is content, whatever JSON it holds later. Each object naming one of the request's tools with its
parameters as a JSON object is a call, its ``arguments`` the object's JSON text as written, sent (named in a stream)
as soon as its name is known and its parameters have begun (:class:`~kvload.serve.tool_reader.JsonCall`). The
first thing that is no call ends the calls: it and the rest of the reply are content (all of it when no call was
made); so is the text where a call's JSON broke after it was sent, which keeps its arguments as read.
"""

from __future__ import annotations

from collections.abc import Collection

from kvload.serve.tool_reader import JsonCall, ToolReader

PYTHON_TAG = "<|python_tag|>"
_SPACE = " \t\n\r"


class Llama3JsonToolCalls(ToolReader):
    """One choice's reply read as Llama 3's ``;``-separated JSON calls."""

    def __init__(self, names: Collection[str], parallel: bool = True) -> None:
        super().__init__(names, parallel)
        self._state = "start"  # start | object (not a call yet) | call | between | text
        self._held = ""  # text read since the last call grew: content should it turn out no call
        self._json: JsonCall | None = None
        self._semicolon = False  # "between": the ";" was read

    def _read(self) -> None:
        while self._buf and getattr(self, f"_in_{self._state}")():
            pass

    def _end(self) -> None:
        # a call cut inside its JSON keeps what was read, and a ";" after the last call is no text (vLLM's); the
        # rest is content
        if self._state not in ("call", "between"):
            self._add(self._held + self._buf)
        self._held = self._buf = ""

    def _as_text(self) -> bool:
        """The rest of the reply is content."""
        self._buf, self._held, self._state = self._held + self._buf, "", "text"
        return True

    def _in_text(self) -> bool:
        self._add(self._buf)
        self._buf = ""
        return False

    def _in_start(self) -> bool:
        rest = self._buf.lstrip(_SPACE)
        if rest.startswith(PYTHON_TAG):
            rest = rest[len(PYTHON_TAG):].lstrip(_SPACE)
        elif PYTHON_TAG.startswith(rest):  # whitespace, or the tag's start: wait for more
            return False
        if not rest:
            return False
        if rest[0] != "{":
            return self._as_text()
        self._held, self._buf = self._buf[:len(self._buf) - len(rest)], rest
        return self._object()

    def _object(self) -> bool:
        self._json, self._state = JsonCall(self.names, ("parameters", "arguments")), "object"
        return True

    def _in_object(self) -> bool:
        call = self._json
        assert call is not None
        used = call.take(self._buf)
        self._held, self._buf = self._held + self._buf[:used], self._buf[used:]
        if call.refused:
            return self._as_text()
        if call.ready:
            self._call(call.name, call.arguments)  # type: ignore[arg-type]
            self._held = ""
            return self._called(call)
        return False

    def _in_call(self) -> bool:
        call = self._json
        assert call is not None
        self._read_arguments(call)
        return self._called(call)

    def _called(self, call: JsonCall) -> bool:
        if not call.ended:
            self._state = "call"
            return False
        if call.json.broken:  # the text from where it broke is content
            return self._as_text()
        self._state, self._semicolon = "between", False
        return True

    def _in_between(self) -> bool:
        """After a call: whitespace, ";", whitespace, and the next call's "{"; anything else ends the calls."""
        for at, char in enumerate(self._buf):
            if char in _SPACE:
                continue
            if char == ";" and not self._semicolon:
                self._semicolon = True
                continue
            if char == "{" and self._semicolon and self.may_call:
                self._held, self._buf = self._held + self._buf[:at], self._buf[at:]
                return self._object()
            return self._as_text()
        self._held, self._buf = self._held + self._buf, ""
        return False


__all__ = ["PYTHON_TAG", "Llama3JsonToolCalls"]
