"""A chat reply held to ``tool_choice``'s schema, read as OpenAI's ``tool_calls`` (vLLM's named and ``"required"``
tool choice, which need no tool-call parser: the grammar fixes the shape).

Named: the whole reply is the function's arguments. ``"required"``: the reply is a JSON array of
``{"name": ..., "parameters": {...}}`` objects; :class:`ToolCallText` reads it character by character as it grows, so
a stream names each call as soon as its name is complete and then sends its arguments in pieces, and the pieces of a
call joined are exactly the ``arguments`` of the whole answer: the parameters' JSON text as generated, without the
whitespace around it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import attrs

from kvload.serve.protocol import ToolChoice

_SPACE = " \t\n\r"


def tool_call_id() -> str:
    """A fresh tool call id, in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@attrs.define
class _Call:
    """One call as read so far; sent (named in a stream) once its name is complete."""

    id: str = attrs.Factory(tool_call_id)
    name: str | None = None
    arguments: str = ""
    sent: bool = False  # its name went out in a stream delta


class ToolCallText:
    """One choice's reply as tool calls, fed its text as it grows (:meth:`feed`)."""

    def __init__(self, choice: ToolChoice) -> None:
        self.name = choice.name  # the named function; None: "required"
        self.calls: list[_Call] = []
        # "required": the JSON scan's state
        self._stack: list[str] = []  # open "[" and "{"
        self._string: list[str] | None = None  # the chars of a string at the call's level, while in it
        self._escape = False
        self._in_string = False
        self._key: str | None = None  # the call's key being read or last read
        self._value = False  # past the key's ":", before its value ends
        self._args = False  # inside the parameters' value
        self._space = ""  # whitespace in the parameters' value, held until more of the value follows

    @property
    def required(self) -> bool:
        """Whether the reply is ``"required"``'s list of calls (else one named call)."""
        return self.name is None

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Take the reply's next ``text``; the stream deltas it makes (OpenAI's ``delta.tool_calls`` entries): a call's
        first names it (``id``, ``type``, ``function.name``), each carries its new ``function.arguments``."""
        if self.name is not None:
            if not self.calls:
                self.calls.append(_Call(name=self.name))
            self.calls[0].arguments += text
            return self._deltas({0: text}) if text else []
        added: dict[int, str] = {}
        for char in text:
            self._scan(char, added)
        return self._deltas(added)

    def finish(self) -> list[dict[str, Any]]:
        """The reply ended: a named call not yet sent is (its arguments empty, or cut by ``max_tokens``)."""
        if self.name is not None and not self.calls:
            self.calls.append(_Call(name=self.name))
        return self._deltas({})

    def message(self) -> list[dict[str, Any]]:
        """The calls as OpenAI's ``message.tool_calls`` (a ``"required"`` call without a name yet is left out)."""
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls if c.name is not None]

    def _deltas(self, added: dict[int, str]) -> list[dict[str, Any]]:
        out = []
        for index, call in enumerate(self.calls):
            if call.name is None:
                continue
            if not call.sent:
                call.sent = True
                out.append({"index": index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}})
            elif added.get(index):
                out.append({"index": index, "function": {"arguments": added[index]}})
        return out

    def _scan(self, char: str, added: dict[int, str]) -> None:
        """One character of ``"required"``'s JSON array: the call objects are at depth 2 (``[{``), their keys and the
        name's string read there; everything of the parameters' value is its arguments."""
        if self._args:
            if not self._in_string and len(self._stack) == 2 and char in ",}":
                self._args = self._value = False  # the value ended; the char closes or continues the call
                self._space = ""
            else:
                self._argument(char, added)
                return
        if self._in_string:
            if self._string_char(char) and self._string is not None:
                self._end_string("".join(self._string), added)
                self._string = None
                return
            if self._string is not None:
                self._string.append(char)
            return
        if char == '"':
            self._in_string = True
            self._string = [] if len(self._stack) == 2 else None
        elif char in "[{":
            self._stack.append(char)
            if len(self._stack) == 2:  # a call opens
                self.calls.append(_Call())
                self._key, self._value = None, False
        elif char in "]}":
            if self._stack:
                self._stack.pop()
        elif char == ":" and len(self._stack) == 2:
            self._value = True
            self._args = self._key == "parameters" and bool(self.calls)
        elif char == "," and len(self._stack) == 2:
            self._value = False

    def _string_char(self, char: str) -> bool:
        """One character inside a JSON string: escapes followed; whether it closed the string."""
        if self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
        elif char == '"':
            self._in_string = False
            return True
        return False

    def _end_string(self, raw: str, added: dict[int, str]) -> None:
        try:
            text = json.loads(f'"{raw}"')
        except ValueError:  # not JSON the grammar allows: nothing to read
            return
        if not self._value:
            self._key = text
        elif self._key == "name" and self.calls and self.calls[-1].name is None:
            self.calls[-1].name = text
            added.setdefault(len(self.calls) - 1, "")

    def _argument(self, char: str, added: dict[int, str]) -> None:
        """A character of the parameters' value: whitespace outside its strings is held until more value follows
        (none around the value itself is sent)."""
        call = self.calls[-1]
        if self._in_string:
            self._string_char(char)
        elif char in _SPACE:
            if call.arguments:
                self._space += char
            return
        elif char == '"':
            self._in_string = True
        elif char in "[{":
            self._stack.append(char)
        elif char in "]}":
            self._stack.pop()
        piece = self._space + char
        self._space = ""
        call.arguments += piece
        added[len(self.calls) - 1] = added.get(len(self.calls) - 1, "") + piece


__all__ = ["ToolCallText", "tool_call_id"]
