"""Reading a reply with a ``"auto"`` tool-call parser, whole or as a stream in pieces, and checking the stream's
deltas have OpenAI's shape: a call's first delta names it, later ones carry only arguments, in order."""

from __future__ import annotations

from typing import Any

from kvload.serve.tool_parser import tool_reader
from kvload.serve.tool_reader import ToolReader
from tests.text_support import pieces

NAMES = frozenset({"get_weather", "get_time"})


def whole(parser: str, text: str, parallel: bool = True) -> ToolReader:
    """``text`` read at once, as a reply that is not streamed is."""
    reader = tool_reader(parser, NAMES, parallel)
    reader.feed(text)
    reader.finish()
    return reader


def calls_of(reader: ToolReader) -> list[tuple[str, str]]:
    """The whole answer's calls as (name, arguments)."""
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in reader.calls)
    return [(c["function"]["name"], c["function"]["arguments"]) for c in reader.calls]


def joined(deltas: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """A stream's ``delta.tool_calls`` entries joined per call, checked for OpenAI's streaming shape."""
    calls: list[list[str]] = []
    for d in deltas:
        if d["index"] == len(calls):  # a new call: named in its first delta
            assert d["id"].startswith("chatcmpl-tool-") and d["type"] == "function", d
            assert set(d["function"]) == {"name", "arguments"}, d
            calls.append([d["function"]["name"], d["function"]["arguments"]])
        else:  # more of the last call's arguments, and nothing else
            assert d["index"] == len(calls) - 1 and set(d) == {"index", "function"}, d
            assert set(d["function"]) == {"arguments"} and d["function"]["arguments"], d
            calls[-1][1] += d["function"]["arguments"]
    return [(name, arguments) for name, arguments in calls]


def streamed(parser: str, text: str, cuts: list[int], parallel: bool = True
             ) -> tuple[str, list[tuple[str, str]], list[dict[str, Any]]]:
    """``text`` fed in pieces of the ``cuts`` sizes (cycled; 0: an empty piece): the content a stream sends joined,
    its calls joined, and its deltas."""
    reader = tool_reader(parser, NAMES, parallel)
    content, deltas = [], []
    for cut in pieces(text, cuts):
        piece, calls = reader.feed(cut)
        content.append(piece)
        deltas.extend(calls)
    piece, calls = reader.finish()
    content.append(piece)
    deltas.extend(calls)
    return "".join(content), joined(deltas), deltas


def check_stream_is_whole(parser: str, text: str, cuts: list[int], parallel: bool = True) -> ToolReader:
    """A stream of ``text`` in any pieces sends exactly the whole answer's content and calls; the whole reader."""
    reader = whole(parser, text, parallel)
    sent, calls, _ = streamed(parser, text, cuts, parallel)
    assert sent == (reader.content or "")
    assert calls == calls_of(reader)
    return reader
