"""The ``llama4_pythonic`` tool-call parser (``--tool-call-parser llama4_pythonic``) as a unit: ``pythonic``'s list of
calls, perhaps inside Llama 4's ``<|python_start|>`` ... ``<|python_end|>`` block, whose markers are no content; a
stream in any pieces gives what the whole reply gives."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvload.serve.tool_parser_llama4 import Llama4PythonicToolCalls
from tests.test_tool_parser_pythonic import _CALL
from tests.tool_parser_support import NAMES, calls_of, check_stream_is_whole

S, E = "<|python_start|>", "<|python_end|>"


@pytest.mark.parametrize(("text", "calls", "content"), [
    (f'{S}[get_weather(city="Paris")]{E}', [("get_weather", '{"city": "Paris"}')], None),
    (f"\n{S}[get_time(), get_weather(city='Oslo')]\n{E}\n",
     [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')], None),
    (f"{S}[get_time()]", [("get_time", "{}")], None),  # the block never closed: its calls still stand
    ('[get_weather(city="Paris")]', [("get_weather", '{"city": "Paris"}')], None),  # markers skipped: pythonic's
    (f"{S}[get_time(zone='UTC')]{E} Done.", [("get_time", '{"zone": "UTC"}')], " Done."),
    (f"{S}[get_time(zone='UTC'){E}Done.", [("get_time", '{"zone": "UTC"}')], "Done."),  # the list left open
    (f"{S}[get_time(zone='{E}')]{E}", [("get_time", '{"zone": "<|python_end|>"}')], None),  # in a string: text
    # no call: what pythonic makes no call, the start marker dropped; a marker not at the start is text
    (f"{S}Hello", [], "Hello"),
    (f"{S}[get_news()]{E}", [], f"[get_news()]{E}"),
    (f"Sure: {S}[get_time()]{E}", [], f"Sure: {S}[get_time()]{E}"),
    (f"{E}[get_time()]", [], f"{E}[get_time()]"),
    ("<|python_sta", [], "<|python_sta"),
    (f"{S}[get_time()]<|python_e", [("get_time", "{}")], "<|python_e"),
    ("  ", [], "  "),
])
def test_a_list_of_calls_in_or_out_of_the_python_block_is_calls_and_the_rest_is_content(text, calls, content):
    for cuts in ([1], [2, 0, 5], [len(text)]):
        reader = check_stream_is_whole("llama4_pythonic", text, cuts)
        assert calls_of(reader) == calls and reader.content == content


def test_a_stream_holds_what_may_still_be_a_marker_and_sends_the_call_at_its_first_argument():
    reader = Llama4PythonicToolCalls(NAMES)
    assert reader.feed("<|python_") == ("", [])
    assert reader.feed("start|>[get_weather(city='Pa") == ("", [])
    _, (first,) = reader.feed("ris')")
    assert first["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert reader.feed("]<|python_") == ("", [])
    assert reader.feed("end|>\nOK") == ("\nOK", [])
    assert reader.finish() == ("", [])


_TAIL = st.sampled_from(["]", f"]{E}", f"]\n{E}", f"]{E} Done.", f"]{E}\n", ", get_news()]", E, f"{E} x", "",
                         f"]{E[:5]}"])


@settings(max_examples=300, deadline=None)
@given(lead=st.sampled_from(["", " ", "\n"]), opened=st.booleans(), items=st.lists(_CALL, min_size=1, max_size=3),
       tail=_TAIL, cuts=st.lists(st.integers(0, 9), min_size=1).filter(any), parallel=st.booleans())
def test_any_list_read_whole_or_in_any_pieces_gives_its_calls_and_the_text_after_the_block(lead, opened, items, tail,
                                                                                          cuts, parallel):
    """Calls with any literal arguments, in the block or not, then what may follow: the calls come out with their
    arguments as JSON, the text after the block (or after the last call) as content, streamed or not alike."""
    text, ends, expected = lead + (S if opened else "") + "[", [], []
    for i, (name, kwargs, sep) in enumerate(items):
        text += (", " if i else "") + f"{name}({sep.join(f'{k}={v!r}' for k, v in kwargs.items())})"
        ends.append(len(text))
        expected.append((name, json.dumps(kwargs, ensure_ascii=False)))
    text += tail
    reader = check_stream_is_whole("llama4_pythonic", text, cuts, parallel)
    kept = expected if parallel else expected[:1]
    assert calls_of(reader) == kept
    after = text[ends[len(kept) - 1]:]
    if after.startswith("]"):  # the list closed: what follows it
        after = after[1:]
    if opened and after.lstrip(" \n").startswith(E):
        after = after.lstrip(" \n")[len(E):]  # the block's end is no content
    assert reader.content == (after if after.strip() else None)
