"""A JSON object read one character at a time, as a model writes it: whether the text so far can still be the start
of JSON, and where the values of the top object begin and end (the tool-call parsers stream a call's arguments by it).

It is strict JSON, as ``json.loads`` reads it except for ``NaN`` and ``Infinity`` (not JSON, and no arguments a
client could parse): no control character unescaped in a string, no trailing comma, no leading zero.
"""

from __future__ import annotations

import json

_SPACE = " \t\n\r"
_HEX = frozenset("0123456789abcdefABCDEF")
_DIGITS = frozenset("0123456789")
#: (number state, character class) -> next state; the classes: "d" digit (0 apart), "0", ".", "e", "+", "-"
_NUMBER = {("minus", "0"): "zero", ("minus", "d"): "int", ("zero", "."): "dot", ("zero", "e"): "e",
           ("int", "d"): "int", ("int", "0"): "int", ("int", "."): "dot", ("int", "e"): "e",
           ("dot", "d"): "frac", ("dot", "0"): "frac", ("frac", "d"): "frac", ("frac", "0"): "frac",
           ("frac", "e"): "e", ("e", "+"): "sign", ("e", "-"): "sign", ("e", "d"): "exp", ("e", "0"): "exp",
           ("sign", "d"): "exp", ("sign", "0"): "exp", ("exp", "d"): "exp", ("exp", "0"): "exp"}
_NUMBER_ENDS = frozenset({"zero", "int", "frac", "exp"})
_CLOSER = {"{": "}", "[": "]"}

#: An event of :meth:`JsonObjectPrefix.feed`: ("begin", depth, char): a value starts with this character, inside
#: ``depth`` containers; ("end", depth, text): a value there ended with this character (``text``: a captured
#: string's value, else None); ("before", depth, None): a number there ended just before this character;
#: ("key", depth, text): a key of the object ``depth`` deep was read (captured keys only, else None).
Event = tuple[str, int, str | None]


def _kind(char: str) -> str:
    if char == "0":
        return "0"
    if char in _DIGITS:
        return "d"
    return "e" if char in "eE" else char


class JsonObjectPrefix:
    """One JSON object, fed character by character; ``broken`` once no JSON can continue the text, ``done`` once the
    object closed. Strings (keys and values) ``capture`` or fewer containers deep are decoded for the caller."""

    def __init__(self, capture: int = 1) -> None:
        self.capture = capture
        self.stack: list[str] = []  # the open "{" and "["
        self.state = "value"  # value | key | colon | after | string | number | literal
        self.first = False  # the innermost container was just opened: its closer may come now
        self.is_key = False  # the string being read is a key
        self.escape = 0  # in a string: 1 after a backslash, 2 to 5 while \u's hex digits are read
        self.number = ""  # the number's state
        self.literal = ""  # the rest of true/false/null still to come
        self.chars: list[str] | None = None  # the captured string's characters, as written
        self.done = False
        self.broken = False

    def feed(self, char: str) -> list[Event]:
        """Take the next character; the events it makes (none once ``broken``: the character is no JSON here)."""
        events: list[Event] = []
        if self.broken or self.done or not self._step(char, events):
            self.broken = True
            return []
        return events

    def _step(self, char: str, events: list[Event]) -> bool:
        state = self.state
        if state == "string":
            return self._string(char, events)
        if state == "literal":
            if char != self.literal[0]:
                return False
            self.literal = self.literal[1:]
            if not self.literal:
                self._ended(events, None)
            return True
        if state == "number":
            step = _NUMBER.get((self.number, _kind(char)))
            if step is not None:
                self.number = step
                return True
            if self.number not in _NUMBER_ENDS:
                return False
            events.append(("before", len(self.stack), None))
            self.state = "after"  # the character is read after the number
        if char in _SPACE:
            return True
        if self.state == "value":
            return self._value(char, events)
        if self.state == "key":
            if char == "}" and self.first:
                return self._close(char, events)
            if char != '"':
                return False
            self.state, self.is_key, self.first = "string", True, False
            self.chars = [] if len(self.stack) <= self.capture else None
            return True
        if self.state == "colon":
            if char != ":":
                return False
            self.state = "value"
            return True
        # after a value inside a container
        if char == ",":
            self.state = "key" if self.stack[-1] == "{" else "value"
            return True
        return char == _CLOSER[self.stack[-1]] and self._close(char, events)

    def _value(self, char: str, events: list[Event]) -> bool:
        if char == "]" and self.first:
            return self._close(char, events)
        if not self.stack and char != "{":
            return False
        depth = len(self.stack)
        if char in "{[":
            events.append(("begin", depth, char))
            self.stack.append(char)
            self.state = "key" if char == "{" else "value"
            self.first = True
            return True
        if char == '"':
            self.state, self.is_key = "string", False
            self.chars = [] if depth <= self.capture else None
        elif char == "-" or char in _DIGITS:
            self.state, self.number = "number", {"-": "minus", "0": "zero"}.get(char, "int")
        elif char in "tfn":
            self.state, self.literal = "literal", {"t": "rue", "f": "alse", "n": "ull"}[char]
        else:
            return False
        self.first = False
        events.append(("begin", depth, char))
        return True

    def _string(self, char: str, events: list[Event]) -> bool:
        if self.escape == 1:
            if char == "u":
                self.escape = 5
            elif char in '"\\/bfnrt':
                self.escape = 0
            else:
                return False
        elif self.escape:
            if char not in _HEX:
                return False
            self.escape = self.escape - 1 if self.escape > 2 else 0
        elif char == "\\":
            self.escape = 1
        elif char == '"':
            text = json.loads(f'"{"".join(self.chars)}"') if self.chars is not None else None
            self.chars = None
            if self.is_key:
                self.state = "colon"
                events.append(("key", len(self.stack), text))
            else:
                self._ended(events, text)
            return True
        elif char < " ":
            return False
        if self.chars is not None:
            self.chars.append(char)
        return True

    def _close(self, char: str, events: list[Event]) -> bool:
        self.stack.pop()
        self.first = False
        if not self.stack:
            self.done = True
            events.append(("end", 0, None))
            return True
        self._ended(events, None)
        return True

    def _ended(self, events: list[Event], text: str | None) -> None:
        events.append(("end", len(self.stack), text))
        self.state = "after"


__all__ = ["Event", "JsonObjectPrefix"]
