"""``SampleText``: stop strings found on the growing text, cut before the match, deltas that add up to the text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.stopping import SampleText, marker_prefix
from tests.llm_support import word_tokenizer

TOKENIZER = word_tokenizer(40)  # token i is "w<i>" (w0, the unknown token, is special); words joined by spaces


def oracle(ids: list[int], stops: list[str]) -> tuple[str, str | None, int]:
    """Brute force: decode every prefix, cut at the first stop string seen (earliest start on a tie)."""
    for k in range(1, len(ids) + 1):
        text = TOKENIZER.decode(ids[:k])
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            pos, stop = min(hits)
            return text[:pos], stop, k
    return TOKENIZER.decode(ids), None, len(ids)


def drive(ids: list[int], stops: list[str]) -> tuple[SampleText, list[str], int]:
    """Feed the tokens one at a time, as the executor does, collecting the stream's deltas."""
    text = SampleText(TOKENIZER, stops)
    deltas = []
    for k in range(1, len(ids) + 1):
        hit = text.update(ids[:k])
        if hit is not None or k == len(ids):
            if hit is None:
                text.update(ids[:k], final=True)
            deltas.append(text.delta(final=True))
            return text, deltas, k
        deltas.append(text.delta())
    raise AssertionError("no tokens")


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(1, 39), min_size=1, max_size=20),
       stops=st.lists(st.text(alphabet="w0123 ", min_size=1, max_size=6), max_size=3))
def test_stops_cut_the_text_where_brute_force_does_and_deltas_add_up(ids, stops):
    text, deltas, steps = drive(ids, stops)
    expected, stop, at = oracle(ids, stops)
    assert (text.text, text.stop_hit, steps) == (expected, stop, at)
    assert "".join(deltas) == text.text
    assert not any(s in text.text for s in stops)


def test_a_stream_holds_back_what_could_still_become_a_stop_string():
    text = SampleText(TOKENIZER, ["w3 w4"])
    text.update([1, 2, 3])  # "w1 w2 w3": its last 4 characters could begin the 5-character stop string
    assert text.delta() == "w1 w"
    assert text.update([1, 2, 3, 4]) == "w3 w4"
    assert text.delta() == "2 " and text.text == "w1 w2 "


def test_include_stop_streams_every_character_at_once_and_still_ends_with_the_stop_string():
    """vLLM's include_stop_str_in_output holds nothing back (its stop_buffer_length is 0): the cut falls after the
    stop string, which ends in the newest token's text, so no character already streamed is ever taken back."""
    text = SampleText(TOKENIZER, ["w3 w4"], include_stop=True)
    text.update([1, 2, 3])
    assert text.delta() == "w1 w2 w3"  # excluded, "w1 w" (the last 4 characters could begin the stop string)
    assert text.update([1, 2, 3, 4, 5]) == "w3 w4"
    assert text.delta() == " w4" and text.text == "w1 w2 w3 w4"


def min_tokens_oracle(ids: list[int], stops: list[str], min_tokens: int) -> tuple[str | None, int]:
    """vLLM's rule by brute force: from token min_tokens + 1 on, a stop string ends a sample when it ends in the
    text that token added (the text decoded before is never searched); the earliest such match wins."""
    for k in range(min_tokens + 1, len(ids) + 1):
        text, before = TOKENIZER.decode(ids[:k]), len(TOKENIZER.decode(ids[:k - 1]))
        hits = [(pos, s) for s in stops if (pos := text.find(s, max(0, before - len(s) + 1))) != -1]
        if hits:
            return min(hits)[1], k
    return None, len(ids)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(1, 39), min_size=1, max_size=16),
       stops=st.lists(st.text(alphabet="w0123 ", min_size=1, max_size=12), min_size=1, max_size=3),
       min_tokens=st.integers(0, 8), include=st.booleans())
def test_min_tokens_and_include_stop_end_a_stream_where_vllm_does_and_deltas_add_up(ids, stops, min_tokens, include):
    text, deltas = SampleText(TOKENIZER, stops, include_stop=include), []
    for k in range(1, len(ids) + 1):
        hit = text.update(ids[:k], search=k > min_tokens)
        if hit is not None or k == len(ids):
            if hit is None:
                text.update(ids[:k], final=True, search=k > min_tokens)
            deltas.append(text.delta(final=True))
            break
        deltas.append(text.delta())
    assert (text.stop_hit, k) == min_tokens_oracle(ids, stops, min_tokens)
    assert "".join(deltas) == text.text  # nothing streamed was taken back


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="<>/ab", max_size=12),
       markers=st.lists(st.text(alphabet="<>/ab", min_size=1, max_size=6), min_size=1, max_size=3))
def test_the_text_held_for_a_marker_is_the_longest_end_that_may_still_become_one(text, markers):
    """The reasoning and tool-call parsers hold back this much of a streamed reply: the longest end of it that is a
    proper start of a marker (the next piece may complete it); the rest is sent at once."""
    held = marker_prefix(text, markers)
    assert held == max((n for m in markers for n in range(min(len(m) - 1, len(text)) + 1)
                        if m.startswith(text[len(text) - n:])), default=0)
    # one of several markers holds as much as the most it holds alone
    assert held == max(marker_prefix(text, [m]) for m in markers)


def test_a_marker_written_whole_is_not_held_and_its_start_is():
    assert marker_prefix("reply </thi", ("<think>", "</think>")) == 5
    assert marker_prefix("reply <think>", ("<think>",)) == 0  # a whole marker is found, not held
    assert marker_prefix("reply <", ("</tool_call>", "<tool_call>")) == 1
    assert marker_prefix("", ("<think>",)) == 0
