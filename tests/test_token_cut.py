"""A huge prompt cut by ``truncate_prompt_tokens`` on a Llama 3 or Qwen 2 style tokenizer (a Split of their own
regex before a byte-level mapping) tokenizes only the end it keeps, as on GPT-2's byte-level one
(``engine.token_bound.cut_points``): the cut, before a space that follows a letter, is a place where those regexes
always split, so the ids past it are the whole text's. Tokenizers trained here, offline, with those exact
pre-tokenizers; any lookalike stays tokenized whole."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from engine.token_bound import cut_points
from kvload.serve.request_input import kept_text_tokens
from tests.text_support import CORPUS, bytelevel_checkpoint

#: The Split regexes as Llama 3's tokenizer.json (meta-llama/Meta-Llama-3-8B) and Qwen 2.5's write them
CUT_REGEXES = {
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
}

#: what the tokenizers are trained on: words, contractions, digit runs, marks, CJK, emoji, whitespace of all kinds
ADVERSARIAL = ["it's don't we're they'll I'd you've I'M SHE'S", "12345 1234567 3.14159 2026-12-05 ٣٤٥ ⅷ",
               "naïve café déjà vu Ångström e\u0301 a\u0308 \u0915\u093c \u0958",
               "日本語のテキスト 中文 한국어 ᄀ\u1161",
               "emoji 🙂🚀 👩‍👩‍👧 and more", "tabs\tand\nnew\r\nlines  \n\n  spaced\u00a0out\u3000wide\u2028sep",
               "«quoted» (paren) [brackets] {braces} --- ... !!! ??? ''' \"\"\"", "Hello world, the sky is blue."]


def trained(regex: str, *, normalizer: Any = None, bos: bool = False, behavior: str = "isolated",
            byte_level_first: bool = False) -> PreTrainedTokenizerFast:
    """A BPE of 500 entries (the tiny checkpoints have 512 rows) trained on :data:`ADVERSARIAL` with the
    pre-tokenizer ``Sequence[Split(regex, behavior), ByteLevel(use_regex=false)]`` (Llama 3's and Qwen 2's form;
    ``byte_level_first``: the other order), every byte's symbol in its vocabulary; ``bos``: a ``<s>`` prepended as
    Llama 3's template adds ``<|begin_of_text|>``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    split = pre_tokenizers.Split(Regex(regex), behavior)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([byte_level, split] if byte_level_first else [split, byte_level])
    tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.train_from_iterator(ADVERSARIAL * 3 + CORPUS, trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _nfc():
    from tokenizers import normalizers

    return normalizers.NFC()


LLAMA3 = trained(CUT_REGEXES["llama3"], bos=True)  # Llama 3's: no normalizer, <|begin_of_text|> first
QWEN2 = trained(CUT_REGEXES["qwen2"], normalizer=_nfc())  # Qwen 2's: NFC, no BOS


def _gpt2_nfc() -> PreTrainedTokenizerFast:
    """GPT-2's byte-level pre-tokenizer (its own regex) under NFC: admitted on the same grounds."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = _nfc()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(ADVERSARIAL * 3 + CORPUS, trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


GPT2_NFC = _gpt2_nfc()
TOKENIZERS = {"llama3": LLAMA3, "qwen2": QWEN2, "gpt2_nfc": GPT2_NFC}


class _Engine:
    """What :func:`kept_text_tokens` reads of a serving engine: its tokenizer and ``tokenize``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def tokenize(self, text: str, *, add_special_tokens: bool = True, where: str = "prompt",
                 tokenizer: Any = None) -> list[int]:
        tok = self.tokenizer if tokenizer is None else tokenizer
        return [int(t) for t in tok(text, add_special_tokens=add_special_tokens)["input_ids"]]


def _ids(tok: Any, text: str, special: bool = False) -> list[int]:
    return [int(t) for t in tok(text, add_special_tokens=special)["input_ids"]]


def _cuts(text: str) -> list[int]:
    """Every place where a letter is followed by a space (where ``kept_text_tokens`` cuts)."""
    return [i for i in range(1, len(text)) if text[i] == " " and text[i - 1].isalpha()]


#: characters from every corner: letters of all scripts, marks, digits, whitespace, symbols, emoji (no surrogates)
_CHARS = st.characters(blacklist_categories=("Cs",))
_PIECES = (*ADVERSARIAL, "a", "é", "ab cd", " ", "  ", "\t", "\n\n", "\r\n", " \n ", "'s", "'T", "'ll", "x'", "12345",
           "7" * 40, "x" * 300, "aaaa" * 50, "«»", "\u0301", " \u0301", "a\u0301 b", "\u1100\u1161 ", "日本 語",
           "🙂 🙂", "\u00a0", "\u3000", "ǅ ", "ʰ ", "Ω ", "Å ")


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(_PIECES) | st.text(_CHARS, max_size=8), min_size=1, max_size=40),
       glue=st.sampled_from(["", " ", "\n", "a "]), which=st.sampled_from(sorted(TOKENIZERS)))
@example(pieces=["a", " \u0301"], glue="", which="qwen2")  # NFC: a mark after the space stays after it
@example(pieces=["x'", "s"], glue=" ", which="llama3")
@example(pieces=["a", "  ", "b"], glue="", which="llama3")  # a space run after a letter: \s+(?!\S) and \s+
def test_a_text_cut_before_a_space_after_a_letter_tokenizes_as_its_two_ends(pieces, glue, which):
    """The claim :func:`cut_points` admits these tokenizers on: wherever a letter is followed by a space, the whole
    text's ids are those of the text before it followed by those of the text from it."""
    tok = TOKENIZERS[which]
    text = glue.join(pieces)
    whole = _ids(tok, text)
    for at in _cuts(text)[:30]:
        assert _ids(tok, text[:at]) + _ids(tok, text[at:]) == whole, (text[:at], text[at:])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(st.sampled_from(_PIECES) | st.text(_CHARS, max_size=6), min_size=1, max_size=400),
       glue=st.sampled_from(["", " ", "\n"]), keep=st.integers(1, 120), side=st.sampled_from(["left", "right"]),
       special=st.booleans(), which=st.sampled_from(sorted(TOKENIZERS)))
def test_the_end_of_a_prompt_tokenized_for_truncate_prompt_tokens_has_the_whole_texts_ids(pieces, glue, keep, side,
                                                                                        special, which):
    """Whatever the text and k, the ids kept from the end tokenized alone (None: the caller tokenizes it all) equal
    the whole text's: its last k (first k for truncation_side "right"), the BOS counted as the whole text's is."""
    tok = TOKENIZERS[which]
    text = glue.join(pieces) * 3
    got = kept_text_tokens(_Engine(tok), text, keep, special, side)
    if got is not None:
        whole = _ids(tok, text, special)
        assert len(whole) > keep
        assert got == (whole[-keep:] if side == "left" else whole[:keep])


LONG = " ".join(ADVERSARIAL) * 400  # 120,800 characters


@pytest.mark.parametrize("which", ["llama3", "qwen2"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_long_prompt_cut_to_k_tokens_tokenizes_only_the_end_it_keeps(encoded, which, side):
    """Llama 3's and Qwen 2's tokenizers were tokenized whole for a cut prompt (main: ``kept_text_tokens`` None, the
    caller then tokenizes all 120,800 characters); now a few thousand characters at the end kept, the same ids."""
    tok = LLAMA3 if which == "llama3" else QWEN2
    whole = _ids(tok, LONG, True)
    encoded.clear()
    got = kept_text_tokens(_Engine(tok), LONG, 100, True, side)
    assert got == (whole[-100:] if side == "left" else whole[:100])
    assert 0 < max(encoded) < 10_000


def _spec(tok: Any) -> dict:
    return json.loads(tok.backend_tokenizer.to_str())


def _with(tok: Any, **changes: Any) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps({**_spec(tok), **changes})))


#: Llama 3's regex but a letter run takes the space after it: "ab cd" is "ab ", "cd"
TRAILING = CUT_REGEXES["llama3"].replace(r"\p{L}+|", r"\p{L}+ ?|", 1)
#: Llama 3's regex with a look-behind: a space after a letter joins the word that follows only after a non-letter
BEHIND = CUT_REGEXES["llama3"].replace(r"[^\r\n\p{L}\p{N}]?\p{L}+", r"(?<!\p{L})[^\r\n\p{L}\p{N}]?\p{L}+", 1)
#: llama.cpp's spelling of Llama 3's regex: the same splits, but not the tokenizer.json's spelling, so not admitted
LLAMA_CPP = CUT_REGEXES["llama3"].replace("(?i:'s|'t|'re|'ve|'m|'ll|'d)",
                                          "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])")


def test_the_llama3_and_qwen2_pre_tokenizers_are_admitted_as_tokenizer_json_writes_them():
    assert _spec(LLAMA3)["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == CUT_REGEXES["llama3"]
    assert cut_points(LLAMA3) and cut_points(QWEN2) and cut_points(GPT2_NFC)


@pytest.mark.parametrize("tok", [
    pytest.param(lambda: trained(TRAILING), id="a letter run taking the space after it"),
    pytest.param(lambda: trained(BEHIND), id="a look-behind"),
    pytest.param(lambda: trained(LLAMA_CPP), id="another spelling"),
    pytest.param(lambda: trained(CUT_REGEXES["llama3"] + "|x"), id="one alternative more"),
    pytest.param(lambda: trained(CUT_REGEXES["llama3"], behavior="merged_with_previous"), id="merged, not isolated"),
    pytest.param(lambda: trained(CUT_REGEXES["llama3"], byte_level_first=True), id="split after the byte mapping"),
    pytest.param(lambda: _with(LLAMA3, normalizer={"type": "NFKC"}), id="NFKC"),
    pytest.param(lambda: _with(LLAMA3, normalizer={"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}),
        id="Llama 2's normalizer"),
    pytest.param(lambda: _with(LLAMA3, pre_tokenizer={"type": "Metaspace", "replacement": "▁",
                                                      "prepend_scheme": "first", "split": False}), id="Metaspace"),
    pytest.param(lambda: _with(LLAMA3, model={**_spec(LLAMA3)["model"], "dropout": 0.1}), id="BPE dropout"),
])
def test_a_tokenizer_not_known_to_split_there_is_tokenized_whole(tok):
    """A pre-tokenizer that only looks like the admitted ones is not admitted: ``kept_text_tokens`` gives None and the
    caller tokenizes the whole text."""
    tok = tok()
    assert not cut_points(tok)
    assert kept_text_tokens(_Engine(tok), LONG, 100, True, "left") is None


@pytest.mark.parametrize("regex", [TRAILING, BEHIND], ids=["trailing space", "look-behind"])
def test_the_lookalikes_refused_would_change_the_ids_if_cut(regex):
    """Why they are refused: cut there, their ids are not the whole text's."""
    tok = trained(regex)
    text = "the sky is blue and the sky is wide"
    assert any(_ids(tok, text[:at]) + _ids(tok, text[at:]) != _ids(tok, text) for at in _cuts(text))


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory):
    from tests.serve_support import serving

    dest = bytelevel_checkpoint(tiny_checkpoints("llama"), tmp_path_factory.mktemp("cut") / "ckpt", tokenizer=LLAMA3)
    with serving(str(dest)) as running:
        yield running


def test_a_served_prompt_cut_by_truncate_prompt_tokens_on_a_llama3_tokenizer_tokenizes_only_its_end(served,
                                                                                                      encoded):
    """Through /v1/completions: the last 50 ids of the whole 120,800-character prompt (BOS not among them), and no
    text past 10,000 characters tokenized (main: the whole prompt)."""
    whole = _ids(served.state.engine.tokenizer, LONG, True)
    encoded.clear()
    r = served.http.post("/v1/completions", json={"prompt": LONG, "max_tokens": 1, "truncate_prompt_tokens": 50,
                                                  "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["prompt_token_ids"] == whole[-50:]
    assert r.json()["usage"]["prompt_tokens"] == 50
    assert 0 < max(encoded) < 10_000
