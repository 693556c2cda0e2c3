"""The ``llama3_json`` tool-call parser (``--tool-call-parser llama3_json``) as a unit: a reply that begins with
Llama 3's ``{"name": ..., "parameters": {...}}`` objects (``;`` between them, ``<|python_tag|>`` before) is calls of
the request's tools, each sent once its name and parameters began and its arguments as written; the first thing
that is no call, and what follows, is content; a stream in any pieces gives what the whole reply gives."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvload.serve.tool_parser_llama import Llama3JsonToolCalls
from tests.tool_parser_support import NAMES, calls_of, check_stream_is_whole


@pytest.mark.parametrize(("text", "calls", "content"), [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", '{"city": "Paris"}')], None),
    ('<|python_tag|>{"name": "get_time", "parameters": {}}', [("get_time", "{}")], None),
    ('\n{"parameters": {"zone": "UTC"}, "name": "get_time"}; {"name": "get_weather", "arguments": {"city": "Oslo"}}',
     [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Oslo"}')], None),
    # the reply must begin with the calls; JSON later in the text is text (vLLM's stream reads it so too)
    ('Sure! {"name": "get_time", "parameters": {}}', [], 'Sure! {"name": "get_time", "parameters": {}}'),
    ('{"name": "get_news", "parameters": {}}', [], '{"name": "get_news", "parameters": {}}'),
    ('{"name": "get_time", "parameters": "UTC"}', [], '{"name": "get_time", "parameters": "UTC"}'),
    ('{"name": "get_time"}', [], '{"name": "get_time"}'),
    ('{"a": 1}', [], '{"a": 1}'),
    ("<|python_tag|>print(1)", [], "<|python_tag|>print(1)"),
    ('{"name": "get_time", "param', [], '{"name": "get_time", "param'),
    # the first thing that is no call ends the calls; it and the rest are content
    ('{"name": "get_time", "parameters": {}}\n\nDone.', [("get_time", "{}")], "\n\nDone."),
    ('{"name": "get_time", "parameters": {}}; {"name": "get_news", "parameters": {}}',
     [("get_time", "{}")], '; {"name": "get_news", "parameters": {}}'),
    ('{"name": "get_time", "parameters": {}} ; \n', [("get_time", "{}")], None),
    # a call stays one: its JSON breaking leaves the arguments read, the text from the break is content
    ('{"name": "get_time", "parameters": {"x": NaN}}', [("get_time", '{"x": ')], "NaN}}"),
    ('{"name": "get_weather", "parameters": {"city": "Ro', [("get_weather", '{"city": "Ro')], None),
    ("  ", [], "  "),
])
def test_a_reply_of_json_calls_is_calls_and_the_rest_is_content(text, calls, content):
    for cuts in ([1], [2, 0, 5], [len(text)]):
        reader = check_stream_is_whole("llama3_json", text, cuts)
        assert calls_of(reader) == calls and reader.content == content


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    reader = check_stream_is_whole("llama3_json", text, [3], parallel=False)
    assert calls_of(reader) == [("get_time", "{}")] and reader.content == text[text.index(";"):]


def test_a_stream_names_a_call_once_its_parameters_begin_then_sends_them_as_written():
    reader = Llama3JsonToolCalls(NAMES)
    assert reader.feed("<|python") == ("", [])
    assert reader.feed('_tag|>{"name": "get_weather", ') == ("", [])
    _, (first,) = reader.feed('"parameters": {"ci')
    assert first["function"] == {"name": "get_weather", "arguments": '{"ci'} and first["index"] == 0
    assert reader.feed('ty": "Oslo"}}; {"name": "get_time", "parameters": {') == ("", [
        {"index": 0, "function": {"arguments": 'ty": "Oslo"}'}},
        {"index": 1, "id": reader.calls[1]["id"], "type": "function",
         "function": {"name": "get_time", "arguments": "{"}}])
    assert reader.feed("}}") == ("", [{"index": 1, "function": {"arguments": "}"}}])
    assert reader.finish() == ("", [])
    # text: sent at once, once it cannot be a call
    reader = Llama3JsonToolCalls(NAMES)
    assert reader.feed(" \n") == ("", [])
    assert reader.feed("The") == (" \nThe", [])


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                    max_size=3), max_leaves=8)
_CALL = st.tuples(st.sampled_from(sorted(NAMES)), st.dictionaries(st.text(max_size=4), _JSON, max_size=3),
                  st.sampled_from(["parameters", "arguments"]), st.booleans(), st.booleans(),
                  st.sampled_from([None, 1]))
_TAIL = st.sampled_from(["", " ", "\n\n", " Done.", '; {"name": "get_news", "parameters": {}}', "; x", ";",
                         '; {"name": "get_time"}', "}"])


@settings(max_examples=300, deadline=None)
@given(lead=st.sampled_from(["", "<|python_tag|>", "\n", " <|python_tag|>\n"]), items=st.lists(_CALL, max_size=4),
       seps=st.lists(st.sampled_from([";", "; ", " ;\n"]), min_size=4, max_size=4), tail=_TAIL,
       cuts=st.lists(st.integers(0, 9), min_size=1).filter(any), parallel=st.booleans())
def test_any_reply_read_whole_or_in_any_pieces_gives_its_calls_and_the_text_after_them(lead, items, seps, tail,
                                                                                      cuts, parallel):
    """Calls in any key order and JSON style, then what may follow: the calls come out with their arguments as
    written (the first only, under parallel_tool_calls false), the rest as content, streamed or not alike."""
    written, text, ends = [], lead, []
    for i, (name, args, key, flip, ascii_, indent) in enumerate(items):
        arguments = json.dumps(args, ensure_ascii=ascii_, indent=indent)
        written.append((name, arguments))
        text += (f'{{"{key}": {arguments}, "name": "{name}"}}' if flip
                 else f'{{"name": "{name}", "{key}": {arguments}}}')
        ends.append(len(text))
        text += seps[i] if i < len(items) - 1 else ""
    text += tail
    reader = check_stream_is_whole("llama3_json", text, cuts, parallel)
    if not written:
        assert calls_of(reader) == [] and reader.content == text
        return
    kept = written if parallel else written[:1]
    assert calls_of(reader) == kept
    after = text[ends[len(kept) - 1]:]  # the text after the last call kept
    assert reader.content == (None if after.strip() in ("", ";") else after)
