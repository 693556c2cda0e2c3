"""The ``pythonic`` tool-call parser (``--tool-call-parser pythonic``) as a unit: a reply that is a Python list of
calls of the request's tools with literal keyword arguments is those calls, their arguments as a JSON object (read
with ``ast``, never evaluated), each sent at its first argument and then argument by argument; the first thing
that is no such call, and what follows, is content; a stream in any pieces gives what the whole reply gives."""

from __future__ import annotations

import json
import keyword

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvload.serve.tool_parser_pythonic import PythonicToolCalls
from tests.tool_parser_support import NAMES, calls_of, check_stream_is_whole


@pytest.mark.parametrize(("text", "calls", "content"), [
    ('[get_weather(city="Paris")]', [("get_weather", '{"city": "Paris"}')], None),
    ("[get_time()]", [("get_time", "{}")], None),
    ("\n[get_weather(city='Zürich', days=[1, -2.5, None, True, False], opts={'a': (1, 'b')}),\n get_time(zone=\"\"\"U"
     "'T\"C\"\"\",)]\n", [("get_weather", '{"city": "Zürich", "days": [1, -2.5, null, true, false], "opts": {"a": [1, '
                             '"b"]}}'), ("get_time", '{"zone": "U\'T\\"C"}')], None),
    ("[get_time(zone='a' 'b', x=r'\\d', y=0x1F, z='', w=\"\\u00e9\\n\")]",
     [("get_time", '{"zone": "ab", "x": "\\\\d", "y": 31, "z": "", "w": "é\\n"}')], None),
    # no call: not a list, an empty one, another tool, a value that is no literal (a name, a call, an f-string,
    # an expression), a positional argument, bytes, a set, a number JSON cannot hold
    ("Sure: [get_time()]", [], "Sure: [get_time()]"),
    ("[]", [], "[]"),
    ("[get_news()]", [], "[get_news()]"),
    ("[get_weather(city=Paris)]", [], "[get_weather(city=Paris)]"),
    ("[get_weather(city=str(1))]", [], "[get_weather(city=str(1))]"),
    ("[get_weather(city=f'{x}')]", [], "[get_weather(city=f'{x}')]"),
    ("[get_weather(days=1+2)]", [], "[get_weather(days=1+2)]"),
    ("[get_weather('Paris')]", [], "[get_weather('Paris')]"),
    ("[get_weather(city=b'x')]", [], "[get_weather(city=b'x')]"),
    ("[get_weather(days={1})]", [], "[get_weather(days={1})]"),
    ("[get_weather(days=1e999)]", [], "[get_weather(days=1e999)]"),
    ("[get_weather(**{'city': 'x'})]", [], "[get_weather(**{'city': 'x'})]"),
    ("[get_weather(city='Par", [], "[get_weather(city='Par"),
    ("[get_weather(if=1)]", [], "[get_weather(if=1)]"),
    # the first thing that is no call ends the calls; the text from the last argument read on is content
    ("[get_time(zone='UTC'), get_news()]", [("get_time", '{"zone": "UTC"}')], ", get_news()]"),
    ("[get_time(zone='UTC', x=y)]", [("get_time", '{"zone": "UTC"')], " x=y)]"),
    ("[get_time(zone='UTC', zone='CET')]", [("get_time", '{"zone": "UTC"')], " zone='CET')]"),
    ("[get_time(zone='UTC')]\nDone.", [("get_time", '{"zone": "UTC"}')], "\nDone."),
    # a call cut by the reply's end keeps the arguments read
    ("[get_time(zone='UTC', day='Mo", [("get_time", '{"zone": "UTC"')], None),
    ("[get_time(zone='UTC'), get_weather(ci", [("get_time", '{"zone": "UTC"}')], ", get_weather(ci"),
    ("  ", [], "  "),
])
def test_a_list_of_calls_is_calls_and_the_rest_is_content(text, calls, content):
    for cuts in ([1], [2, 0, 5], [len(text)]):
        reader = check_stream_is_whole("pythonic", text, cuts)
        assert calls_of(reader) == calls and reader.content == content


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = "[get_time(), get_weather(city='Oslo')]"
    reader = check_stream_is_whole("pythonic", text, [3], parallel=False)
    assert calls_of(reader) == [("get_time", "{}")] and reader.content == ", get_weather(city='Oslo')]"


def test_a_stream_sends_a_call_at_its_first_argument_then_each_argument_as_it_completes():
    reader = PythonicToolCalls(NAMES)
    assert reader.feed("[get_weather(city='Pa") == ("", [])
    _, (first,) = reader.feed("ris', days=")
    assert first["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"'}
    assert reader.feed("[1, 2]") == ("", [])  # the list may go on
    assert reader.feed(")") == ("", [{"index": 0, "function": {"arguments": ', "days": [1, 2]}'}}])
    assert reader.feed("]") == ("", [])
    assert reader.finish() == ("", [])


_IDENT = st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True).filter(lambda k: not keyword.iskeyword(k))
_VALUE = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5)
                      | st.floats(allow_nan=False, allow_infinity=False),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                     max_size=3), max_leaves=8)
_CALL = st.tuples(st.sampled_from(sorted(NAMES)), st.dictionaries(_IDENT, _VALUE, max_size=3),
                  st.sampled_from([", ", ",\n  ", ","]))
_TAIL = st.sampled_from(["]", "]\n", "] Done.", ", get_news()]", ", get_time(x=y)]", ")", ""])


@settings(max_examples=300, deadline=None)
@given(lead=st.sampled_from(["", " ", "\n"]), items=st.lists(_CALL, min_size=1, max_size=3), tail=_TAIL,
       cuts=st.lists(st.integers(0, 9), min_size=1).filter(any), parallel=st.booleans())
def test_any_list_read_whole_or_in_any_pieces_gives_its_calls_and_the_text_after_them(lead, items, tail, cuts,
                                                                                     parallel):
    """Calls with any literal arguments (written as Python's repr writes them), then what may follow: the calls
    come out with their arguments as JSON, the rest as content, streamed or not alike."""
    text, ends, expected = lead + "[", [], []
    for i, (name, kwargs, sep) in enumerate(items):
        text += (", " if i else "") + f"{name}({sep.join(f'{k}={v!r}' for k, v in kwargs.items())})"
        ends.append(len(text))
        expected.append((name, json.dumps(kwargs, ensure_ascii=False)))
    text += tail
    reader = check_stream_is_whole("pythonic", text, cuts, parallel)
    kept = expected if parallel else expected[:1]
    assert calls_of(reader) == kept
    after = text[ends[len(kept) - 1]:]
    if after.startswith("]"):  # the list closed: what follows it
        after = after[1:]
    assert reader.content == (after if after.strip() else None)
