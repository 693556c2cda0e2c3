"""The JSON prefix reader the tool-call parsers stream arguments by: it says a text is broken exactly where no JSON
can continue it, and done exactly when the object closes, judged against Python's own ``json``."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvload.serve.json_prefix import JsonObjectPrefix


def _no_constant(name: str):
    raise ValueError(name)


def is_json_object(text: str) -> bool:
    """Python's verdict: ``text`` is one JSON object (strict: no NaN, no control characters in strings)."""
    try:
        return isinstance(json.loads(text, parse_constant=_no_constant), dict)
    except ValueError:
        return False


def read(text: str) -> tuple[int | None, bool]:
    """(where the reader broke, or None; whether it was done at the end)."""
    scan = JsonObjectPrefix()
    for at, char in enumerate(text):
        scan.feed(char)
        if scan.broken:
            return at, False
        if scan.done and at < len(text) - 1:
            return at + 1, True  # more after the object: the caller's, not JSON's
    return None, scan.done


_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                       | st.text(max_size=6), lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=10)
_OBJECTS = st.dictionaries(st.text(max_size=4), _VALUES, max_size=4)


@settings(max_examples=300, deadline=None)
@given(doc=_OBJECTS, ascii_=st.booleans(), indent=st.sampled_from([None, 0, 2, "\t"]))
def test_every_prefix_of_a_json_object_reads_on_and_the_whole_is_done(doc, ascii_, indent):
    text = " " + json.dumps(doc, ensure_ascii=ascii_, indent=indent) + "\n"
    assert read(text.rstrip()) == (None, True)


#: Pieces to build near-JSON from: what a model writing JSON badly writes.
_PIECES = st.lists(st.sampled_from(['{', '}', '[', ']', '"a"', '"', ':', ',', ' ', '1', '-', '0', '.', 'e', '+',
                                    'true', 'tru', 'null', 'NaN', '\\', '\\u00e9', '\\x', '\n', '01', 'é']),
                   max_size=14).map("".join)


@settings(max_examples=1000, deadline=None)
@given(text=_PIECES)
def test_it_breaks_where_python_says_no_json_object_can_continue(text):
    broke, done = read(text)
    if done and broke is None:
        assert is_json_object(text)
    elif is_json_object(text.strip()):
        assert (broke is None and done) or text != text.strip()
    if broke is not None and not done:  # no text after the break makes it an object
        for tail in ("", "}", '"}', "]}", "0}", '""}', "}}", "]]}}"):
            assert not is_json_object(text[:broke + 1] + tail)


@pytest.mark.parametrize(("text", "broke"), [
    ('{"a": NaN}', 6), ('{"a": 01}', 7), ('{"a": 1.}', 8), ('{"a": [1,]}', 9), ('{"a"\n: "x\ny"}', 9),
    ("{'a': 1}", 1), ('[1]', 0), ('{"a": tru }', 9), ('{"a": "\\x"}', 8), ('{"a": 1}}', 8),
])
def test_where_it_breaks(text, broke):
    assert read(text)[0] == broke
