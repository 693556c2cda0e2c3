"""The bounds every input is checked against: the depth of a JSON request body, read before it is parsed."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.limits import MAX_DEPTH, json_depth, nesting_depth

# strings full of what a bracket counter could trip on: brackets, quotes, backslashes
_TEXT = st.text(alphabet=st.sampled_from('ab[]{}"\\:,é\n'), max_size=6)
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | _TEXT,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                     max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(value=_JSON, ascii_only=st.booleans())
def test_json_depth_of_the_text_is_nesting_depth_of_the_value(value, ascii_only):
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert json_depth(raw) == nesting_depth(value)


def test_a_wide_body_is_shallow_and_a_deep_one_is_caught_before_parsing():
    # a million token ids in a thousand prompts nest two levels, however many nodes they are
    wide = json.dumps({"prompt": [[1] * 1000] * 1001, "max_tokens": 1}).encode()
    assert json_depth(wide) == 2
    deep = b"[" * 100_000 + b"]" * 100_000  # json.loads would overflow the recursion limit on this
    assert json_depth(deep) == MAX_DEPTH + 1
