"""``SampleText``: stop strings found on the growing text, cut before the match, deltas that add up to the text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.stopping import SampleText
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
