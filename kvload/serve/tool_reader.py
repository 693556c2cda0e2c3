"""What the ``"auto"`` tool-call parsers (``kvload.serve.tool_parser``) share: a reply's content and calls as it
grows, and the stream deltas that carry them; and :class:`JsonCall`, one ``{"name": ..., "arguments": {...}}`` object
read character by character (hermes and llama3_json write their calls so).

A call is *sent* (named in a stream) as soon as the text can no longer turn out not to be one (for a JSON call: its
name is one of the request's tools and its arguments have begun). From then on it stays a call, whatever follows;
its arguments grow as they are read, so the pieces a stream sends joined are the whole answer's ``arguments``, and a
reply cut by ``max_tokens`` inside them leaves them unfinished (as ``tool_choice: "required"`` does).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from kvload.serve.json_prefix import JsonObjectPrefix
from kvload.serve.tool_calls import tool_call_id


class ToolReader:
    """One choice's ``"auto"`` reply, fed as it grows: its calls (``message.tool_calls``), its content, and what a
    stream sends of them (:meth:`feed`). A parser reads the text in :meth:`_read` and places it with :meth:`_add`
    (content), :meth:`_call` and :meth:`_grow`."""

    def __init__(self, names: Collection[str], parallel: bool = True) -> None:
        self.names = names
        self.parallel = parallel
        self.calls: list[dict[str, Any]] = []  # OpenAI's message.tool_calls entries
        self._announced = 0  # calls whose first delta a stream has sent
        self._args_sent: list[int] = []  # characters of each call's arguments a stream has sent
        self._text = ""  # the reply's content
        self._sent = 0  # characters of it a stream has sent
        self._spoken = False  # content holds more than whitespace (sent as it comes from then on)
        self._buf = ""  # text not placed yet
        self._done = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """Take the reply's next ``text`` (``final``: the reply ends with it); the stream's new content and
        ``delta.tool_calls`` entries."""
        self._buf += text
        self._read()
        if final and not self._done:
            self._done = True
            self._end()
        return self._new_content(), self._deltas()

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The reply ended: what was held is placed; what a stream still owes."""
        return self.feed("", final=True)

    @property
    def content(self) -> str | None:
        """The text outside the calls; None when calls were made and nothing but whitespace is left (vLLM's)."""
        return None if self.calls and not self._spoken else self._text

    @property
    def may_call(self) -> bool:
        """Whether another call may be made (``parallel_tool_calls: false`` allows one)."""
        return self.parallel or not self.calls

    def _read(self) -> None:
        """Place what of ``_buf`` can be placed now."""
        raise NotImplementedError

    def _end(self) -> None:
        """The reply ended: place what is left of ``_buf``."""
        raise NotImplementedError

    def _add(self, text: str) -> None:
        if text:
            self._text += text
            self._spoken = self._spoken or bool(text.strip())

    def _call(self, name: str, arguments: str) -> None:
        self.calls.append({"id": tool_call_id(), "type": "function",
                           "function": {"name": name, "arguments": arguments}})

    def _grow(self, arguments: str) -> None:
        """The last call's arguments as read so far."""
        self.calls[-1]["function"]["arguments"] = arguments

    def _read_arguments(self, call: JsonCall) -> None:
        """Give the text held to ``call`` (a call already made, its arguments being read) and grow the call by what it
        read of them."""
        self._buf = self._buf[call.take(self._buf):]
        self._grow(call.arguments)

    def _new_content(self) -> str:
        """Content a stream may send now: whitespace alone is held, for it is no content once a call is made."""
        if not (self._spoken or (self._done and not self.calls)):
            return ""
        piece, self._sent = self._text[self._sent:], len(self._text)
        return piece

    def _deltas(self) -> list[dict[str, Any]]:
        """Each call's first delta names it (with its arguments so far); later ones carry what its arguments grew."""
        out = []
        for index in range(max(0, self._announced - 1), len(self.calls)):  # earlier calls are complete and sent
            call = self.calls[index]
            arguments = call["function"]["arguments"]
            if index >= self._announced:
                out.append({"index": index, **call, "function": dict(call["function"])})
                self._announced = index + 1
                self._args_sent.append(len(arguments))
            elif len(arguments) > self._args_sent[index]:
                out.append({"index": index, "function": {"arguments": arguments[self._args_sent[index]:]}})
                self._args_sent[index] = len(arguments)
        return out


class JsonCall:
    """One call written as a JSON object, ``{"name": NAME, KEY: {...}}`` (``KEY`` one of ``keys``; other members
    allowed), fed character by character. ``ready`` once NAME is one of ``names`` and the arguments object has begun;
    ``refused`` once it cannot be a call (before ``ready`` only: a call stays one). The first ``name`` and arguments
    keys count."""

    def __init__(self, names: Collection[str], keys: Collection[str] = ("arguments",)) -> None:
        self.names = names
        self.keys = keys
        self.json = JsonObjectPrefix(capture=1)
        self.name: str | None = None
        self.arguments = ""  # the arguments' JSON text as read so far
        self.refused = False
        self._key: str | None = None  # the top object's key whose value is being read
        self._seen: set[str] = set()
        self._in_args = False

    @property
    def ready(self) -> bool:
        """Whether the object is a call: its name is a tool's and its arguments have begun."""
        return self.name is not None and bool(self.arguments)

    @property
    def ended(self) -> bool:
        """Whether no more of the text is the object's: it closed, or no JSON can continue it."""
        return self.json.done or self.json.broken

    def feed(self, char: str) -> bool:
        """Take the next character; False when it is not the object's (it closed, or the text stopped being JSON)."""
        was_ready = self.ready
        events = self.json.feed(char)
        if self.json.broken:
            self.refused = not was_ready
            return False
        take = self._in_args
        for kind, depth, text in events:
            if kind == "key" and depth == 1:
                self._key = text
            elif kind == "begin" and depth == 1:
                take = self._begin(char) or take
            elif kind == "end" and depth == 1:
                if self._key == "name" and self.name is None and not self.refused and "name" in self._seen:
                    self._named(text)
                self._in_args = False
                self._key = None
        if take and not self.refused:
            self.arguments += char
        if self.json.done and not self.ready:
            self.refused = True
        return True

    def take(self, text: str) -> int:
        """Feed ``text`` until the object ends or is refused; how many characters of it were the object's."""
        used = 0
        for char in text:
            if not self.feed(char):
                break
            used += 1
            if self.refused or self.ended:
                break
        return used

    def _begin(self, char: str) -> bool:
        """A value of the top object begins with ``char``: whether it begins the arguments."""
        key = self._key
        if key == "name" and "name" not in self._seen:
            self._seen.add("name")
            self.refused = self.refused or char != '"'
        elif key in self.keys and "arguments" not in self._seen:
            self._seen.add("arguments")
            self._in_args = char == "{"
            self.refused = self.refused or not self._in_args
            return self._in_args
        else:
            self._key = None  # another member (or a repeated key): read, not kept
        return False

    def _named(self, name: str | None) -> None:
        if name is not None and name in self.names:
            self.name = name
        else:
            self.refused = True


__all__ = ["JsonCall", "ToolReader"]
