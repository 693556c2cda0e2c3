"""A text prompt too long for the context by its characters alone is refused before it is tokenized
(``engine.token_bound``): an 80 MB prompt's encode held the server's one parsing worker, and every request queued
behind it, for a minute or more, only to be refused for its length."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from engine.token_bound import Bound, chars_per_token, fewest_tokens, token_bound
from tests.conftest import needs_smollm2
from tests.serve_support import serving
from tests.test_serve_responses import TEMPLATE
from tests.text_support import CORPUS, bytelevel_checkpoint, trained_tokenizer

BYTELEVEL = trained_tokenizer("bytelevel", 300)
METASPACE = trained_tokenizer("metaspace", 300)  # its byte fallback has no <0xNN> token: it drops what it can't spell


def _with_bytes(tok):
    """``tok`` (a byte-fallback BPE) with all 256 ``<0xNN>`` tokens in its vocabulary, as Llama's has."""
    import json

    from tokenizers import Tokenizer

    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="</s>",
                                   pad_token="<pad>")


def _gapped_bytelevel():
    """A byte-level BPE whose vocabulary lacks the symbols of the bytes 0x04 and 0x1D, as SmolLM2's lacks those of
    six control characters: it drops them from any text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    missing = {chr(0x100 + 4), chr(0x100 + 0x1D)}  # GPT-2's symbols for 0x04 and 0x1D
    alphabet = [c for c in pre_tokenizers.ByteLevel.alphabet() if c not in missing]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>", "<pad>"],
                                                        initial_alphabet=alphabet))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")


FALLBACK = _with_bytes(METASPACE)
GAPPED = _gapped_bytelevel()


def _wordpiece(normalizer=None, pre_tokenizer=None, kind: str = "wordpiece"):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]"])
    else:
        tok = Tokenizer(models.BPE())  # every byte's symbol in its vocabulary: it drops none
        trainer = trainers.BpeTrainer(vocab_size=200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel()
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_a_byte_level_or_metaspace_bpe_is_bounded_by_its_longest_entry():
    for tok in (BYTELEVEL, FALLBACK):
        assert chars_per_token(tok) == max(len(t) for t in tok.get_vocab())


def test_a_bpe_that_drops_characters_it_cannot_spell_has_no_bound():
    """A BPE with no unknown token leaves out a character it has no symbol for (its byte fallback short of a byte's
    <0xNN>): a text of any length of such characters may be one token, so a bound would refuse a prompt that fits."""
    text = "a" + "Ġ" * 10_000
    assert len(METASPACE(text, add_special_tokens=False)["input_ids"]) == 1
    assert chars_per_token(METASPACE) is None
    assert fewest_tokens(text, token_bound(METASPACE)) == 0
    assert len(FALLBACK(text, add_special_tokens=False)["input_ids"]) >= fewest_tokens(text, token_bound(FALLBACK)) > 1


def test_a_byte_level_bpe_missing_a_few_ascii_symbols_keeps_its_bound_but_does_not_count_them():
    """SmolLM2's vocabulary has no symbol for six control characters: it drops them, so they are not counted; every
    other character still is, so a huge prompt is still refused untokenized."""
    bound = token_bound(GAPPED)
    assert bound == Bound(max(len(t) for t in GAPPED.get_vocab()), "\x04\x1d")
    text = "\x04\x1d" * 10_000
    assert GAPPED(text, add_special_tokens=False)["input_ids"] == []
    assert fewest_tokens(text, bound) == 0
    assert fewest_tokens(text + "ab" * 100, bound) == -(-200 // bound.per_token)
    # checked against a limit (the server's max_seq_len), they are counted only once the length alone reaches it
    assert fewest_tokens(text, bound, at_least=10**9) < 10**9 and fewest_tokens(text, bound, at_least=10) == 0


@needs_smollm2
def test_smollm2s_tokenizer_keeps_its_bound():
    """The bound's point (refusing a huge prompt before tokenizing it) is kept for SmolLM2's byte-level BPE."""
    from bench.bench_structured import smollm2_tokenizer

    tok = smollm2_tokenizer()
    bound = token_bound(tok)
    assert bound is not None and bound.per_token == max(len(t) for t in tok.get_vocab())
    assert bound.dropped == "\x04\x06\x13\x14\x16\x1d"
    for text in ("Hello world " * 50, "".join(map(chr, range(128))) * 4, "\x04\x1d" * 100 + "日🙂"):
        assert len(tok(text, add_special_tokens=False)["input_ids"]) >= fewest_tokens(text, bound) > 0


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
@given(st.lists(st.sampled_from([*"ab ĠĊ\n\t#éa\u0301🙂日\x04\x1d", "Hello", "world", "</s>", "<pad>"]),
                max_size=200).map("".join))
@example("aĠĠĠĠĠĠĠĠĠĠ")  # the metaspace BPE drops the Ġ it cannot spell: one token, not the two once claimed
@example("\x04\x1d" * 20 + "a")  # the gapped byte-level BPE drops both
def test_no_text_has_fewer_tokens_than_the_bound_says(text):
    for tok in (BYTELEVEL, METASPACE, FALLBACK, GAPPED):
        assert len(tok(text, add_special_tokens=False)["input_ids"]) >= fewest_tokens(text, token_bound(tok))


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory):
    dest = bytelevel_checkpoint(tiny_checkpoints("llama"), tmp_path_factory.mktemp("bound") / "ckpt", TEMPLATE)
    with serving(str(dest)) as running:
        yield running


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


@pytest.fixture(scope="module")
def gapped(tiny_checkpoints, tmp_path_factory):
    """A server whose tokenizer drops two control characters (as SmolLM2's drops six)."""
    dest = bytelevel_checkpoint(tiny_checkpoints("llama"), tmp_path_factory.mktemp("gapped") / "ckpt",
                                tokenizer=GAPPED)
    with serving(str(dest)) as running:
        yield running


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", lambda big: {"prompt": big, "max_tokens": 1}, "prompt"),
    ("/v1/embeddings", lambda big: {"input": big}, "input"),
])
def test_a_refusal_by_the_characters_says_how_many_the_tokenizer_drops(gapped, encoded, path, body, param):
    """The characters the tokenizer drops are not counted, so the refusal says how many of the text's are such:
    the tokens it names follow from the others; a text with none of them is refused in the usual words."""
    engine = gapped.state.engine
    limit, per_token = engine.executor.max_seq_len, token_bound(engine.tokenizer).per_token
    words = "Hello world " * ((limit * per_token) // 12 + 10)
    big = "\x04\x1d" * 5_000 + words
    r = gapped.http.post(path, json=body(big))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    fewest = -(-len(words) // per_token)
    assert error["message"].startswith(f"{param}: at least {fewest:,} tokens (its {len(big):,} characters, 10,000 of "
                                       f"them ones this tokenizer drops, a token of this tokenizer covering at most "
                                       f"{per_token})"), error["message"]
    assert [n for n in encoded if n >= len(words)] == []  # never tokenized
    error = gapped.http.post(path, json=body(words)).json()["error"]
    assert error["message"].startswith(f"{param}: at least {fewest:,} tokens (its {len(words):,} characters, a "
                                       f"token of this tokenizer covering at most {per_token})"), error["message"]
