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


def test_an_ignored_settings_record_is_json_and_a_value_too_large_is_described():
    """What a setting_ignored record keeps of a user's value: numpy keys and values as Python's (json.dumps of the
    audit line failed on a numpy key), and a value past 10,000 items or nested past MAX_DEPTH as its description."""
    import numpy as np

    from pipeline.events import SettingIgnored

    def recorded(value):
        return SettingIgnored(field="f", value=value, reason="r").value

    assert json.dumps(recorded({np.int64(3): np.float32(0.5)})) == '{"3": 0.5}'
    assert recorded(list(range(5))) == [0, 1, 2, 3, 4]
    assert recorded(list(range(20_000))) == "a list of 20000 items"
    chain: list = []
    for _ in range(MAX_DEPTH + 5):  # 37 items, nested past the depth any input may have
        chain = [chain]
    assert recorded(chain) == "a list of 1 item"


def test_a_python_arguments_none_or_true_is_written_as_python_writes_it():
    """short_py: the Python API's refusal says None / True as its caller wrote them (short says JSON's null)."""
    from engine.prompts import template_options
    from pipeline.errors import GenerationError

    for value, shown in ((None, "None"), ([True], "[True]")):
        try:
            template_options(add_generation_prompt=value)
        except GenerationError as exc:
            assert str(exc) == f"chat: add_generation_prompt: expected true or false, got {shown}"
        else:
            raise AssertionError("refused")
