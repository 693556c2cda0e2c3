"""The ``hermes`` tool-call parser (``kvload serve --enable-auto-tool-choice --tool-call-parser hermes``) as a unit:
a ``<tool_call>`` block naming a tool with object arguments is a call, sent as soon as it is known to be one and its
arguments as they are read; every other character is content; and a stream read in any pieces gives what the whole
reply gives. The request side: ``tool_choice: "auto"`` is taken under a parser, and refused without one in a line
naming the flags."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvload.serve.protocol import AutoTools, BadRequest, parse
from kvload.serve.tool_parser import OPEN, HermesToolCalls
from tests.tool_parser_support import NAMES, calls_of, check_stream_is_whole


@pytest.mark.parametrize(("text", "calls", "content"), [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [("get_weather", '{"city": "Paris"}')], None),
    ('Let me look.\n<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>',
     [("get_time", '{"zone": "UTC"}')], "Let me look.\n"),
    # two calls, whitespace between: no content (vLLM's null); arguments as written
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\n'
     '<tool_call>{"name":"get_weather","arguments":{"city":"Z\\u00fcrich",\n "days": [1, 2]}}</tool_call>\n',
     [("get_time", "{}"), ("get_weather", '{"city":"Z\\u00fcrich",\n "days": [1, 2]}')], None),
    # what is no call stays text, as written: an unknown tool, arguments no object, no JSON, never a call
    ('<tool_call>{"name": "get_news", "arguments": {}}</tool_call>', [],
     '<tool_call>{"name": "get_news", "arguments": {}}</tool_call>'),
    ('<tool_call>{"name": "get_time", "arguments": "UTC"}</tool_call>', [],
     '<tool_call>{"name": "get_time", "arguments": "UTC"}</tool_call>'),
    ('a <tool_call>{"name": get_time}</tool_call> b', [], 'a <tool_call>{"name": get_time}</tool_call> b'),
    ('<tool_call>{"name": "get_time"}</tool_call>', [], '<tool_call>{"name": "get_time"}</tool_call>'),
    ('<tool_call>{"name": "get_time", "arg', [], '<tool_call>{"name": "get_time", "arg'),
    ('<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_t', [],
     '<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_t'),
    # once a call, always one: its JSON breaking (or cut) later leaves its arguments as read, and the rest of its
    # block is not content (the block ends at </tool_call>, or at a new <tool_call>)
    ('<tool_call>{"name": "get_time", "arguments": {"x": NaN}}</tool_call> ok', [("get_time", '{"x": ')], " ok"),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}</tool_call>', [("get_time", '{"zone": "UTC"}')],
     None),
    ('<tool_call>{"name": "get_time", "arguments": {}}}\n<tool_call>{"name": "get_weather", "arguments": {}}',
     [("get_time", "{}"), ("get_weather", "{}")], None),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Ro', [("get_weather", '{"city": "Ro')], None),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "</tool_call>"}}</tool_call>',
     [("get_time", '{"zone": "</tool_call>"}')], None),
    # one bad block beside a good one: the good one is still a call
    ('<tool_call>[1]</tool_call><tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call> <tool',
     [("get_time", '{"zone": "CET"}')], "<tool_call>[1]</tool_call> <tool"),
    # no call: the text exactly, whitespace too (as with tool_choice "none")
    ("  \n", [], "  \n"),
    ("1 < 2 and </tool_call> is text", [], "1 < 2 and </tool_call> is text"),
])
def test_blocks_that_name_a_tool_are_calls_and_the_rest_is_content(text, calls, content):
    for cuts in ([1], [3, 0, 7], [len(text) or 1]):
        reader = check_stream_is_whole("hermes", text, cuts)
        assert calls_of(reader) == calls and reader.content == content


def test_parallel_tool_calls_false_keeps_the_first_call_and_the_later_blocks_as_text():
    second = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' + second
    reader = check_stream_is_whole("hermes", text, [2], parallel=False)
    assert calls_of(reader) == [("get_time", "{}")] and reader.content == second
    assert len(check_stream_is_whole("hermes", text, [2]).calls) == 2


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                    max_size=3), max_leaves=8)
_ARGS = st.dictionaries(st.text(max_size=4), _JSON, max_size=3)
#: How a model may write the arguments: (ensure_ascii, indent, separators)
_STYLE = st.tuples(st.booleans(), st.sampled_from([None, 1]), st.sampled_from([None, (",", ":")]))
_SPACE = st.text(alphabet=" \n\t", max_size=3)
#: Text around the blocks, made of what could be mistaken for one: "<", pieces of the tags, braces.
_TEXT = st.lists(st.sampled_from(["<", "<tool", "_call", ">", "</tool_call>", "tool_call>", "{", "}", " ", "\n", "x",
                                  "é", '"name"']), max_size=6).map("".join)
_CALL = st.tuples(st.just("call"), st.sampled_from(sorted(NAMES)), _ARGS, _STYLE, _SPACE, _SPACE, st.booleans())
_BAD = st.tuples(st.just("bad"), st.sampled_from([
    '{"name": "get_news", "arguments": {}}', '{"name": "get_time"}', '{"name": "get_time", "arguments": [1]}',
    '{"name": 7, "arguments": {}}', '{"arguments": {}, "name": "get_news"}', "", "get_time()", OPEN]))
#: Blocks that are calls whose JSON breaks after they were sent: (the block's text, the arguments read)
_BROKEN = st.tuples(st.just("broken"), st.sampled_from([
    ('{"name": "get_time", "arguments": {}', "{}"), ('{"name": "get_time", "arguments": {"x": NaN}}', '{"x": '),
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}}', '{"city": "Oslo"}'),
    ("{\"name\": \"get_time\", \"arguments\": {'zone': 'UTC'}}", "{"),
    ('{"name": "get_time", "arguments": {"zone": "UTC"}} and text', '{"zone": "UTC"}')]))
_ITEMS = st.lists(st.one_of(st.tuples(st.just("text"), _TEXT), _CALL, _BAD, _BROKEN), max_size=6)


def _build(items: list, parallel: bool) -> tuple[str, str, list[tuple[str, str]]]:
    """The reply the items make, and the content and calls it holds."""
    text, content, calls = "", "", []
    for item in items:
        if item[0] == "text":
            piece = item[1]
        elif item[0] == "bad":
            piece = OPEN + item[1] + "</tool_call>"
        elif item[0] == "broken":
            piece = OPEN + item[1][0] + "</tool_call>"
            if parallel or not calls:
                calls.append(("get_weather" if "get_weather" in piece else "get_time", item[1][1]))
                text += piece
                continue
        else:
            _, name, args, (ascii_, indent, separators), before, after, flip = item
            written = json.dumps(args, ensure_ascii=ascii_, indent=indent, separators=separators)
            doc = (f'{{"arguments": {written}, "name": {json.dumps(name)}}}' if flip
                   else f'{{"name": {json.dumps(name)},\n "arguments": {written}}}')
            piece = OPEN + before + doc + after + "</tool_call>"
            if parallel or not calls:
                calls.append((name, written))
                text += piece
                continue
        text, content = text + piece, content + piece
    return text, content, calls


@settings(max_examples=300, deadline=None)
@given(items=_ITEMS, cuts=st.lists(st.integers(0, 9), min_size=1).filter(any), parallel=st.booleans())
def test_any_reply_read_whole_or_in_any_pieces_gives_its_calls_and_the_text_around_them(items, cuts, parallel):
    """A reply built from text, calls (keys in either order, written in any JSON style, whitespace around), blocks
    that are no call and calls whose JSON breaks: the calls come out with their arguments as written, everything else
    as content, and a stream cut anywhere sends exactly that content and those calls, each call's arguments in
    pieces that join to the whole answer's."""
    text, content, calls = _build(items, parallel)
    # text beside text must not spell a tag the items did not mean (kept out rather than predicted)
    runs = [run for is_text, group in itertools.groupby(items, key=lambda i: i[0] == "text") if is_text
            for run in ["".join(i[1] for i in group)]]
    assume(all(OPEN not in run for run in runs))
    reader = check_stream_is_whole("hermes", text, cuts, parallel)
    assert calls_of(reader) == calls
    assert reader.content == (None if calls and not content.strip() else content)


def test_a_stream_holds_only_what_may_still_turn_out_no_call():
    """Text goes out at once but for a possible "<tool_call>"; a block is held until it is known to be a call (then
    named, its arguments sent as they come) or not (then sent as text at once)."""
    reader = HermesToolCalls(NAMES)
    assert reader.feed("It is") == ("It is", [])
    assert reader.feed(" 3 <") == (" 3 ", [])  # "<" may begin <tool_call>
    assert reader.feed(" 4") == ("< 4", [])
    assert reader.feed("\n<tool_call>") == ("\n", [])
    assert reader.feed('{"name": "get_time", "argu') == ("", [])  # a call of get_time? not yet
    content, (first,) = reader.feed('ments": {"zo')
    assert content == "" and first["index"] == 0 and first["id"].startswith("chatcmpl-tool-")
    assert first["type"] == "function" and first["function"] == {"name": "get_time", "arguments": '{"zo'}
    assert reader.feed('ne": "U') == ("", [{"index": 0, "function": {"arguments": 'ne": "U'}}])
    assert reader.feed('TC"}}\n</tool_call> ') == (" ", [{"index": 0, "function": {"arguments": 'TC"}'}}])
    assert reader.feed('Then <tool_call>{"name": "get_news"') == ('Then <tool_call>{"name": "get_news"', [])
    assert reader.feed(', "arguments": {}}</tool_call>') == (', "arguments": {}}</tool_call>', [])
    assert reader.finish() == ("", [])
    # arguments before the name: held until the name says it is a call
    reader = HermesToolCalls(NAMES)
    assert reader.feed('<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_ti') == ("", [])
    assert reader.feed('me"}</tool_call>')[1][0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}


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
     "start kvload serve with --enable-auto-tool-choice --tool-call-parser "
     "hermes|llama3_json|pythonic|llama4_pythonic"),
    ({"tools": TOOLS}, "tools", "needs a tool-call parser: start kvload serve with --enable-auto-tool-choice "
                                "--tool-call-parser hermes|llama3_json|pythonic|llama4_pythonic"),
])
def test_auto_without_a_parser_is_refused_naming_the_flags_that_serve_it(body, param, words):
    with pytest.raises(BadRequest) as info:
        job(body, parser=None)
    assert info.value.param == param and words in info.value.message, info.value.message


def test_auto_with_no_tools_is_refused_naming_tools():
    with pytest.raises(BadRequest) as info:
        job({"tool_choice": "auto"})
    assert info.value.param == "tools" and "needs the functions it may call in tools" in info.value.message
