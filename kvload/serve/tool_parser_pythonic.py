"""vLLM's ``pythonic`` tool-call parser, kvload's own: a reply that is a Python list of calls,
``[get_weather(city="Paris"), get_time()]`` (Llama 3.2 and 4, ToolACE and others; ``--tool-call-parser pythonic``).

The reply is read as calls only when it begins with ``[`` (after whitespace). Each call names one of the request's
tools and passes keyword arguments whose values are Python literals (strings, numbers, ``True``/``False``/``None``,
lists, tuples, dicts with string keys), read with :mod:`ast`, never evaluated; ``arguments`` is them as a JSON object
(``json.dumps``' form, non-ASCII kept). A call is sent (named in a stream) once its first argument is read (or its
``)`` when it has none), then each further argument as it completes, then the closing ``}``. The first thing that
is no such call (another name, a positional argument, a value that is no literal, a name given twice) ends the
calls: the text from the end of the last argument read is content, the whole reply when no call was made.
"""

from __future__ import annotations

import ast
import json
import keyword
import math
from collections.abc import Collection
from typing import Any

from kvload.serve.tool_reader import ToolReader

_SPACE = " \t\n\r"
_OPENERS = {"(": ")", "[": "]", "{": "}"}


class _NoLiteral(ValueError):
    """A value that is no JSON-able Python literal."""


def literal(text: str) -> Any:
    """A keyword argument's value text as the JSON value it spells; ``_NoLiteral`` when it is none."""
    try:
        node = ast.parse(text.strip(_SPACE), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise _NoLiteral(str(exc)) from None
    return _value(node)


def _value(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool, int, float))):
        value = node.value
    elif (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
          and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
        value = -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [_value(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        out = {}
        for key, item in zip(node.keys, node.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise _NoLiteral("a dict's keys must be strings")
            out[key.value] = _value(item)
        return out
    else:
        raise _NoLiteral(f"{type(node).__name__} is no literal")
    if isinstance(value, float) and not math.isfinite(value):
        raise _NoLiteral("not a finite number")  # JSON has no inf or nan
    return value


class PythonicToolCalls(ToolReader):
    """One choice's reply read as a Python list of calls."""

    def __init__(self, names: Collection[str], parallel: bool = True) -> None:
        super().__init__(names, parallel)
        self._state = "start"  # start | name | open | key | equals | value | after | end | text
        self._held = ""  # text read since the last part was placed: content should the calls end there
        self._listed = False  # a call was read in the list (so "]" may follow a ",")
        self._name = ""
        self._called = False  # the call being read was sent
        self._args = ""  # its arguments' JSON so far
        self._keys: set[str] = set()
        self._key = ""
        self._value = ""
        self._stack: list[str] = []  # the value's open brackets
        self._quote = ""  # the value's open string's quote ('"', "'", or tripled); "" outside strings
        self._escape = False

    def _read(self) -> None:
        buf, at = self._buf, 0
        while at < len(buf) and self._state != "text":
            used = self._char(buf, at)
            if used == 0:  # a quote that may be tripled: wait for more
                break
            self._held += buf[at:at + used]
            at += used
            if self._state == "broken":  # the calls end: what was held and the rest are content
                self._add(self._held + buf[at:])
                self._held, self._state, at = "", "text", len(buf)
            elif self._placed:
                self._placed, self._held = False, ""
        self._buf = buf[at:]
        if self._state == "text":
            self._add(self._buf)
            self._buf = ""

    _placed = False  # the character just read completed a part: what was held is placed

    def _end(self) -> None:
        if self._state == "text":
            return
        if not (self._called and self._state in ("key", "equals", "value")):  # a sent call cut: its rest is its own
            self._add(self._held + self._buf)
        self._held = self._buf = ""

    def _break(self) -> int:
        self._state = "broken"
        return 1

    def _char(self, buf: str, at: int) -> int:
        """Read the character at ``at`` (more when a quote may be tripled); how many were read, 0: wait."""
        char, state = buf[at], self._state
        if state == "value":
            return self._in_value(buf, at)
        if char in _SPACE:  # a name or key ends at it
            if state == "name" and self._name:
                self._state = "open"
            elif state == "key" and self._key:
                self._state = "equals"
            return 1
        if state == "start":
            if char != "[":
                return self._break()
            self._state = "name"
        elif state in ("name", "open"):
            if state == "name" and (self._name + char).isidentifier():
                self._name += char
            elif char == "(" and self._name:
                if self._name not in self.names or not self.may_call:
                    return self._break()
                self._state, self._called, self._args, self._keys, self._key = "key", False, "", set(), ""
            elif char == "]" and state == "name" and not self._name and self._listed:  # "[f(), ]"
                self._state, self._placed = "end", True
            else:
                return self._break()
        elif state == "key":
            if (self._key + char).isidentifier():
                self._key += char
            elif char == ")" and not self._key:
                self._close()
            elif char == "=" and self._key:
                return self._named()
            else:
                return self._break()
        elif state == "equals":
            if char != "=":
                return self._break()
            return self._named()
        elif state == "after":
            if char == ",":
                self._state, self._name = "name", ""
            elif char == "]":
                self._state, self._placed = "end", True
            else:
                return self._break()
        else:  # "end": only whitespace may follow the list
            return self._break()
        return 1

    def _named(self) -> int:
        """A keyword argument's "=": its name must be new and no Python keyword."""
        if keyword.iskeyword(self._key) or self._key in self._keys:
            return self._break()
        self._keys.add(self._key)
        self._state, self._value, self._stack, self._quote, self._escape = "value", "", [], "", False
        return 1

    def _in_value(self, buf: str, at: int) -> int:
        char = buf[at]
        if self._quote:
            used = 1
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == self._quote[0]:
                ahead = buf[at:at + len(self._quote)]
                if len(self._quote) == 3 and ahead != self._quote:
                    if self._quote.startswith(ahead) and at + len(ahead) == len(buf):
                        return 0
                else:
                    used, self._quote = len(self._quote), ""
            self._value += buf[at:at + used]
            return used
        if char in "'\"":
            ahead = buf[at:at + 3]
            if ahead == char * 3:
                self._quote = ahead
            elif at + len(ahead) == len(buf) and ahead == char * len(ahead):
                return 0  # '' or ''' ?
            elif ahead[:2] == char * 2:
                self._value += char * 2  # an empty string
                return 2
            else:
                self._quote = char
            self._value += self._quote
            return len(self._quote)
        if char == "#":
            return self._break()
        if char in _OPENERS:
            self._stack.append(_OPENERS[char])
        elif char in ")]}" and self._stack:
            if self._stack.pop() != char:
                return self._break()
        elif char in ",)" and not self._stack:
            return self._argument(char)
        elif char in "]}":
            return self._break()
        self._value += char
        return 1

    def _argument(self, end: str) -> int:
        """A keyword argument's value ended (at ``end``, "," or ")"): its pair joins the arguments."""
        try:
            value = literal(self._value)
        except _NoLiteral:
            return self._break()
        pair = f"{json.dumps(self._key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        if self._called:
            self._args += ", " + pair
            self._grow(self._args)
        else:
            self._args = "{" + pair
            self._call(self._name, self._args)
            self._called = True
        self._placed, self._key = True, ""
        if end == ")":
            self._close()
        else:
            self._state = "key"
        return 1

    def _close(self) -> None:
        """The call's ")": its arguments are complete."""
        if self._called:
            self._args += "}"
            self._grow(self._args)
        else:
            self._args = "{}"
            self._call(self._name, self._args)
            self._called = True
        self._state, self._placed, self._listed = "after", True, True


__all__ = ["PythonicToolCalls", "literal"]
