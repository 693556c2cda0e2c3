"""The ``hermes`` tool-call parser (``kvload serve --enable-auto-tool-choice --tool-call-parser hermes``) as a unit:
each complete ``<tool_call>`` block naming a tool with object arguments is a call, every other character is content,
and a stream read in any pieces gives what the whole reply gives. The request side: ``tool_choice: "auto"`` is taken
under a parser, and refused without one in a line naming the flags."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvload.serve.protocol import AutoTools, BadRequest, parse
from kvload.serve.tool_parser import OPEN, HermesToolCalls

NAMES = frozenset({"get_weather", "get_time"})


def whole(text: str, parallel: bool = True) -> HermesToolCalls:
    """``text`` read at once, as a reply that is not streamed is."""
    reader = HermesToolCalls(NAMES, parallel)
    reader.feed(text)
    reader.finish()
    return reader


def streamed(text: str, cuts: list[int], parallel: bool = True) -> tuple[str, list[dict]]:
    """``text`` fed in pieces of the ``cuts`` sizes (cycled; 0: an empty piece): the content and call deltas a stream
    sends."""
    reader = HermesToolCalls(NAMES, parallel)
    content, deltas = [], []
    at, sizes = 0, itertools.cycle(cuts)
    while at < len(text):
        step = next(sizes)
        piece, calls = reader.feed(text[at:at + step])
        content.append(piece)
        deltas.extend(calls)
        at += step
    content.append(reader.finish()[0])
    return "".join(content), deltas


def calls_of(reader: HermesToolCalls) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in reader.calls]


@pytest.mark.parametrize(("text", "calls", "content"), [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [("get_weather", '{"city": "Paris"}')], None),
    ('Let me look.\n<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>',
     [("get_time", '{"zone": "UTC"}')], "Let me look.\n"),
    # two calls, whitespace between: no content (vLLM's null)
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\n'
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>\n',
     [("get_time", "{}"), ("get_weather", '{"city": "Zürich"}')], None),
    # what is no call stays text, as written: an unknown tool, arguments no object, no JSON, NaN, never closed
    ('<tool_call>{"name": "get_news", "arguments": {}}</tool_call>', [],
     '<tool_call>{"name": "get_news", "arguments": {}}</tool_call>'),
    ('<tool_call>{"name": "get_time", "arguments": "UTC"}</tool_call>', [],
     '<tool_call>{"name": "get_time", "arguments": "UTC"}</tool_call>'),
    ('a <tool_call>{"name": get_time}</tool_call> b', [], 'a <tool_call>{"name": get_time}</tool_call> b'),
    ('<tool_call>{"name": "get_time", "arguments": {"x": NaN}}</tool_call>', [],
     '<tool_call>{"name": "get_time", "arguments": {"x": NaN}}</tool_call>'),
    ('<tool_call>{"name": "get_time", "arguments": {}}', [], '<tool_call>{"name": "get_time", "arguments": {}}'),
    # one bad block beside a good one: the good one is still a call
    ('<tool_call>[1]</tool_call><tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call> <tool',
     [("get_time", '{"zone": "CET"}')], "<tool_call>[1]</tool_call> <tool"),
    # no call: the text exactly, whitespace too (as with tool_choice "none")
    ("  \n", [], "  \n"),
    ("1 < 2 and </tool_call> is text", [], "1 < 2 and </tool_call> is text"),
])
def test_blocks_that_name_a_tool_are_calls_and_the_rest_is_content(text, calls, content):
    reader = whole(text)
    assert calls_of(reader) == calls and reader.content == content
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in reader.calls)
    for cuts in ([1], [3, 0, 7], [len(text) or 1]):
        sent, deltas = streamed(text, cuts)
        assert sent == (content or "")
        assert [(d["index"], d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [
            (i, name, args) for i, (name, args) in enumerate(calls)]


def test_parallel_tool_calls_false_keeps_the_first_call_and_the_later_blocks_as_text():
    second = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' + second
    reader = whole(text, parallel=False)
    assert calls_of(reader) == [("get_time", "{}")] and reader.content == second
    assert streamed(text, [2], parallel=False)[0] == second
    assert len(whole(text).calls) == 2


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                    max_size=3), max_leaves=8)
_ARGS = st.dictionaries(st.text(max_size=4), _JSON, max_size=3)
_SPACE = st.text(alphabet=" \n\t", max_size=3)
#: Text around the blocks, made of what could be mistaken for one: "<", pieces of the tags, braces.
_TEXT = st.lists(st.sampled_from(["<", "<tool", "_call", ">", "</tool_call>", "tool_call>", "{", "}", " ", "\n", "x",
                                  "é", '"name"']), max_size=6).map("".join)
_CALL = st.tuples(st.just("call"), st.sampled_from(sorted(NAMES)), _ARGS, _SPACE, _SPACE, st.booleans())
_BAD = st.tuples(st.just("bad"), st.sampled_from([
    '{"name": "get_news", "arguments": {}}', '{"name": "get_time"}', '{"name": "get_time", "arguments": [1]}',
    '{"name": 7, "arguments": {}}', '{"name": "get_time", "arguments": {}', "", "get_time()", OPEN]))
_ITEMS = st.lists(st.one_of(st.tuples(st.just("text"), _TEXT), _CALL, _BAD), max_size=6)


@settings(max_examples=300, deadline=None)
@given(items=_ITEMS, cuts=st.lists(st.integers(0, 9), min_size=1).filter(any), parallel=st.booleans())
def test_any_reply_read_whole_or_in_any_pieces_gives_its_calls_and_the_text_around_them(items, cuts, parallel):
    """A reply built from text, calls (keys in either order, whitespace around the JSON) and blocks that are no
    call: the calls come out with their arguments as JSON text, everything else as content, and a stream cut
    anywhere sends exactly that content and those calls."""
    text, content, calls = "", "", []
    for item in items:
        if item[0] == "text":
            piece = item[1]
        elif item[0] == "bad":
            piece = OPEN + item[1] + "</tool_call>"
        else:
            _, name, args, before, after, flip = item
            doc = {"arguments": args, "name": name} if flip else {"name": name, "arguments": args}
            piece = OPEN + before + json.dumps(doc, indent=1 if flip else None) + after + "</tool_call>"
            if parallel or not calls:
                calls.append((name, json.dumps(args, ensure_ascii=False)))
                text += piece
                continue
        text, content = text + piece, content + piece
    # text beside text must not spell a tag the items did not mean (kept out rather than predicted)
    runs = [run for is_text, group in itertools.groupby(items, key=lambda i: i[0] == "text") if is_text
            for run in ["".join(i[1] for i in group)]]
    assume(all(OPEN not in run for run in runs))
    reader = whole(text, parallel)
    assert calls_of(reader) == calls
    assert reader.content == (None if calls and not content.strip() else content)
    sent, deltas = streamed(text, cuts, parallel)
    assert sent == (reader.content or "")
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == calls
    assert [d["index"] for d in deltas] == list(range(len(calls)))


def test_a_stream_sends_text_at_once_and_holds_only_what_may_start_a_call():
    reader = HermesToolCalls(NAMES)
    assert reader.feed("It is") == ("It is", [])
    assert reader.feed(" 3 <") == (" 3 ", [])  # "<" may begin <tool_call>
    assert reader.feed(" 4") == ("< 4", [])
    assert reader.feed("\n<tool_call>") == ("\n", [])
    assert reader.feed('{"name": "get_time", "arguments": {"zone": "UTC"}}') == ("", [])  # held until it closes
    content, (delta,) = reader.feed("</tool_call>")
    assert content == "" and delta["index"] == 0 and delta["function"] == {"name": "get_time",
                                                                           "arguments": '{"zone": "UTC"}'}
    assert reader.finish() == ("", [])


def job(body: dict, parser: str | None = "hermes"):
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return parse({**base, **body}, "chat", default_max_tokens=16, tool_parser=parser)


TOOLS = [{"type": "function", "function": {"name": name}} for name in sorted(NAMES)]


@pytest.mark.parametrize("choice", [{"tool_choice": "auto"}, {}])
def test_auto_under_a_parser_is_free_text_read_for_the_tools_calls(choice):
    parsed = job({"tools": TOOLS, **choice})
    assert parsed.auto_tools == AutoTools("hermes", NAMES, True)
    assert parsed.tool_choice is None and parsed.params.structured_outputs is None  # nothing holds the reply
    assert parsed.template["tools"] == TOOLS  # the chat template shows them, as with any tool_choice
    assert job({"tools": TOOLS, "parallel_tool_calls": False, **choice}).auto_tools.parallel is False
    # the other choices are as without a parser
    assert job({"tools": TOOLS, "tool_choice": "none"}).auto_tools is None
    assert job({"tools": TOOLS, "tool_choice": "required"}).tool_choice.mode == "required"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice",
     'tool_choice: "auto": the model would choose between text and tool calls, which needs a tool-call parser: '
     "start kvload serve with --enable-auto-tool-choice --tool-call-parser hermes"),
    ({"tools": TOOLS}, "tools", "needs a tool-call parser: start kvload serve with --enable-auto-tool-choice "
                                "--tool-call-parser hermes"),
])
def test_auto_without_a_parser_is_refused_naming_the_flags_that_serve_it(body, param, words):
    with pytest.raises(BadRequest) as info:
        job(body, parser=None)
    assert info.value.param == param and words in info.value.message, info.value.message


def test_auto_with_no_tools_is_refused_naming_tools():
    with pytest.raises(BadRequest) as info:
        job({"tool_choice": "auto"})
    assert info.value.param == "tools" and "needs the functions it may call in tools" in info.value.message
