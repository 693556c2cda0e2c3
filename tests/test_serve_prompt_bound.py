"""A text prompt too long for the context by its characters alone is refused before it is tokenized
(``engine.token_bound``): an 80 MB prompt's encode held the server's one parsing worker, and every request queued
behind it, for a minute or more, only to be refused for its length."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from engine.token_bound import chars_per_token, fewest_tokens
from tests.serve_support import serving
from tests.test_serve_responses import TEMPLATE
from tests.text_support import CORPUS, bytelevel_checkpoint, trained_tokenizer

BYTELEVEL = trained_tokenizer("bytelevel", 300)
METASPACE = trained_tokenizer("metaspace", 300)


def _wordpiece(normalizer=None, pre_tokenizer=None, kind: str = "wordpiece"):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]"])
    else:
        tok = Tokenizer(models.BPE())
        trainer = trainers.BpeTrainer(vocab_size=200)
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel()
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_a_byte_level_or_metaspace_bpe_is_bounded_by_its_longest_entry():
    for tok in (BYTELEVEL, METASPACE):
        assert chars_per_token(tok) == max(len(t) for t in tok.get_vocab())


def test_tokenizers_that_can_drop_or_merge_characters_have_no_bound():
    """WordPiece's [UNK] covers a whole word; a Strip normalizer or a Whitespace pre-tokenizer drops characters: a
    text of any length may then be a handful of tokens, so no bound is claimed and the prompt is tokenized."""
    from tokenizers import normalizers, pre_tokenizers

    assert chars_per_token(_wordpiece()) is None
    assert chars_per_token(_wordpiece(kind="bpe", normalizer=normalizers.Strip())) is None
    assert chars_per_token(_wordpiece(kind="bpe", pre_tokenizer=pre_tokenizers.Whitespace())) is None
    assert chars_per_token(_wordpiece(kind="bpe", normalizer=normalizers.NFC())) is not None


def test_an_added_token_that_strips_the_spaces_beside_it_leaves_no_bound():
    """RoBERTa's <mask> (lstrip) takes in every space before it: a few tokens can stand for any number of
    characters, so a bound would refuse a prompt that fits."""
    from tokenizers import AddedToken

    tok = trained_tokenizer("bytelevel", 300)
    per_token = chars_per_token(tok)
    tok.add_special_tokens({"mask_token": AddedToken("<mask>", lstrip=True)})
    text = " " * (per_token * 40) + "<mask>"
    assert len(tok(text, add_special_tokens=False)["input_ids"]) < fewest_tokens(text, per_token)  # the old claim
    assert chars_per_token(tok) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([*"ab ĠĊ\n\t#éa\u0301🙂日", "Hello", "world", "</s>", "<pad>"]),
                max_size=200).map("".join))
def test_no_text_has_fewer_tokens_than_the_bound_says(text):
    for tok in (BYTELEVEL, METASPACE):
        assert len(tok(text, add_special_tokens=False)["input_ids"]) >= fewest_tokens(text, chars_per_token(tok))


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory):
    dest = bytelevel_checkpoint(tiny_checkpoints("llama"), tmp_path_factory.mktemp("bound") / "ckpt", TEMPLATE)
    with serving(str(dest)) as running:
        yield running


@pytest.fixture
def encoded(monkeypatch):
    """The length of every text the tokenizer is asked to encode meanwhile."""
    lengths: list[int] = []
    call = PreTrainedTokenizerFast.__call__

    def spy(self, text=None, *args, **kwargs):
        if isinstance(text, str):
            lengths.append(len(text))
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "__call__", spy)
    return lengths


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", lambda big: {"prompt": big, "max_tokens": 1}, "prompt"),
    ("/v1/completions", lambda big: {"prompt": [[1, 2], big], "max_tokens": 1}, "prompt[1]"),
    ("/v1/completions", lambda big: {"prompt": big, "max_tokens": 1, "add_special_tokens": False}, "prompt"),
    ("/v1/chat/completions", lambda big: {"messages": [{"role": "user", "content": big}], "max_tokens": 1},
     "messages"),
])
def test_a_prompt_too_long_by_its_characters_is_refused_untokenized_in_the_full_paths_words(served, encoded, path,
                                                                                             body, param):
    engine = served.state.engine
    limit, per_token = engine.executor.max_seq_len, chars_per_token(engine.tokenizer)
    big = "Hello world " * ((limit * per_token) // 12 + 10)  # a few characters past what max_seq_len tokens cover
    r = served.http.post(path, json=body(big))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert error["message"].startswith(f"{param}: at least ")
    assert error["message"].endswith(f"leave no room to generate under max_seq_len={limit}; shorten it or raise "
                                     "max_seq_len")
    assert f"its {len(big):,} characters" in error["message"] or param == "messages"
    assert [n for n in encoded if n >= len(big)] == []  # never tokenized


def test_a_prompt_within_the_bound_is_tokenized_and_refused_by_its_count(served, encoded):
    """Under the bound the prompt's tokens decide, as before: the exact count is said."""
    engine = served.state.engine
    limit = engine.executor.max_seq_len
    text = "日🙂" * limit  # more than max_seq_len tokens (a token each at least), fewer characters than the bound
    r = served.http.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
    assert r.status_code == 400, r.text
    count = len(engine.tokenizer(text)["input_ids"])
    assert r.json()["error"]["message"] == (f"prompt: {count} tokens leave no room to generate under "
                                            f"max_seq_len={limit}; shorten it or raise max_seq_len")
    assert len(text) in encoded


def test_an_embeddings_input_too_long_by_its_characters_is_refused_untokenized(served, encoded):
    """/v1/embeddings takes an input of up to max_seq_len tokens; one past it by its characters alone is refused
    before it is tokenized, in the words of the count's refusal; with truncate_prompt_tokens it is cut, as before."""
    engine = served.state.engine
    limit, per_token = engine.executor.max_seq_len, chars_per_token(engine.tokenizer)
    big = "Hello world " * ((limit * per_token) // 12 + 10)
    r = served.http.post("/v1/embeddings", json={"input": ["hi", big]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input"
    assert error["message"].startswith("input[1]: at least "), error["message"]
    assert f"an embedding takes at most max_seq_len={limit} (vLLM's max_model_len)" in error["message"]
    assert [n for n in encoded if n >= len(big)] == []
