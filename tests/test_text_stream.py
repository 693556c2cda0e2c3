"""Streaming text: the deltas of a growing output add up to the decoded output, multi-byte characters whole."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.outputs import TextStream

CORPUS = ["Hello world, the sky is blue.", "Paris est la capitale de la France.", "naïve café déjà vu",
          "streaming tokens one at a time", "日本語のテキスト", "emoji 🙂🚀 and more"]


@pytest.fixture(scope="module")
def fast_tokenizer():
    """A small byte-level BPE tokenizer (multi-byte characters span several tokens) with an EOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def stream_all(tokenizer, ids: list[int]) -> list[str]:
    stream = TextStream(tokenizer)
    return [stream.push(ids[: i + 1]) for i in range(len(ids))]


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("abc é日🙂 .,")), max_size=40), eos_at_end=st.booleans())
def test_deltas_add_up_to_the_decoded_text(fast_tokenizer, text, eos_at_end):
    ids = fast_tokenizer.encode(text, add_special_tokens=False)
    if eos_at_end:
        ids.append(fast_tokenizer.eos_token_id)
    deltas = stream_all(fast_tokenizer, ids)
    assert "".join(deltas) == fast_tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)  # an incomplete character is held back, never printed


def test_the_fast_path_uses_the_tokenizers_decode_stream(fast_tokenizer):
    assert TextStream(fast_tokenizer)._stream is not None


def test_a_slow_tokenizer_streams_by_redecoding(fast_tokenizer):
    class Slow:  # no backend_tokenizer: the re-decoding fallback
        def decode(self, ids, skip_special_tokens=True):
            return fast_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = fast_tokenizer.encode("emoji 🙂 naïve", add_special_tokens=False)
    assert "".join(stream_all(Slow(), ids)) == "emoji 🙂 naïve"
