"""``SampleText`` grows its text incrementally: byte-identical to re-decoding the whole output every step.

The oracle is the previous implementation (``tests.text_support.RedecodeText``). Every step must show
the same thing — stop string found, stream delta, final text — for stop strings across token
boundaries, multi-byte characters split over tokens, special tokens (skipped), and a sample that
ends on a stop token id (its final text leaves that token out).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.stopping import CONTEXT_TOKENS, SampleText
from tests.llm_support import word_tokenizer
from tests.text_support import RedecodeText, drive, trained_tokenizer

WORDS = word_tokenizer(40)  # token i is "w<i>"; w0 (unknown) is special and skipped; words joined by spaces


@pytest.fixture(scope="module", params=["bytelevel", "metaspace"])
def bpe(request):
    return trained_tokenizer(request.param)


def same_as_redecoding(tokenizer, ids: list[int], stops: list[str], stream: bool, drop_last: bool) -> SampleText:
    new, old = SampleText(tokenizer, stops), RedecodeText(tokenizer, stops)
    got, expected = drive(new, ids, stream, drop_last), drive(old, ids, stream, drop_last)
    assert got == expected
    assert (new.text, new.stop_hit) == (old.text, old.stop_hit)
    return new


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, 39), min_size=1, max_size=40),
       stops=st.lists(st.text(alphabet="w0123 ", min_size=1, max_size=6), max_size=3),
       stream=st.booleans(), drop_last=st.booleans())
def test_word_level_text_is_byte_identical_to_redecoding(ids, stops, stream, drop_last):
    same_as_redecoding(WORDS, ids, stops, stream, drop_last)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), stops=st.lists(st.text(alphabet=st.sampled_from(list("ae é日🙂.,")), min_size=1, max_size=4),
                                      max_size=2),
       stream=st.booleans(), drop_last=st.booleans())
def test_bpe_text_is_byte_identical_to_redecoding(bpe, data, stops, stream, drop_last):
    # any token ids at all: byte tokens that split (or never complete) a UTF-8 character, EOS and pad
    ids = data.draw(st.lists(st.integers(0, len(bpe) - 1), min_size=1, max_size=40))
    same_as_redecoding(bpe, ids, stops, stream, drop_last)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.sampled_from(list("abc é日🙂 .,")), min_size=1, max_size=60), specials=st.booleans())
def test_encoded_text_streams_back_byte_identical(bpe, text, specials):
    ids = bpe.encode(text, add_special_tokens=False)
    if specials:  # special tokens inside the output are skipped in the text, as before
        ids = [t for i in ids for t in ((i, bpe.pad_token_id) if i % 3 == 0 else (i,))] + [bpe.eos_token_id]
    sample = same_as_redecoding(bpe, ids, [], stream=True, drop_last=False)
    assert sample.text == bpe.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_a_stop_string_across_tokens_and_inside_a_multibyte_split(bpe):
    ids = bpe.encode("naïve café déjà vu and emoji 🙂🚀", add_special_tokens=False)
    for stop in ("é d", "🚀", "vu a", "ïv"):
        sample = same_as_redecoding(bpe, ids, [stop], stream=True, drop_last=False)
        assert sample.stop_hit == stop and stop not in sample.text


class CountingTokenizer:
    """Wraps a tokenizer, recording how many tokens each decode call gets."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.all_special_ids = inner.all_special_ids

    def decode(self, ids, **kw):
        self.calls.append(len(ids))
        return self.inner.decode(ids, **kw)


def test_each_step_decodes_a_short_window_not_the_whole_output():
    tok = CountingTokenizer(WORDS)
    sample = SampleText(tok, ["never"])
    ids = [1 + i % 39 for i in range(300)]
    for k in range(1, len(ids) + 1):
        assert sample.update(ids[:k]) is None
    # two window decodes per step (context + new token), each bounded whatever the output's length
    assert max(tok.calls) <= CONTEXT_TOKENS + 1
    sample.update(ids, final=True)  # the final text is one full decode, as before
    assert tok.calls[-1] == len(ids)
    assert sample.text == WORDS.decode(ids)
