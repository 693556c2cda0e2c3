"""A bound on how much text one token covers, so a prompt that cannot fit is refused before it is tokenized.

Tokenizing runs at about a microsecond a character on one core: an 80 MB prompt held the server's one parsing
worker (and every request queued behind it) for a minute or more, only to be refused for its length. When no token
of the tokenizer covers more than K characters, a text of more than ``(max_seq_len - 1) * K`` characters has at
least ``max_seq_len`` tokens, so it leaves no room to generate whatever its tokens turn out to be.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Any, NamedTuple

#: Normalizers whose output has at least 1/factor of their input's characters. NFC and NFKC compose: one composed
#: character stands for at most 4 of the decomposed ones (Unicode's longest canonical decomposition), and decomposing
#: never shortens; lowercasing and prepending never shorten.
_NORMALIZER_FACTOR = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}
#: Pre-tokenizers that keep every character (they split or map one to one); Whitespace and the like drop some.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


class Bound(NamedTuple):
    """What bounds a tokenizer's count of a text's tokens from below."""

    #: the most characters of the text one token stands for
    per_token: int
    #: characters the tokenizer drops whole (none of their bytes is in its vocabulary, no unknown token stands in):
    #: SmolLM2's byte-level vocabulary has no symbol for the bytes 0x04, 0x06, 0x13, 0x14, 0x16 and 0x1D, so a text
    #: of them is no tokens at all; they are not counted
    dropped: str = ""


def token_bound(tokenizer: Any) -> Bound | None:
    """The :class:`Bound` of ``tokenizer`` (a transformers fast tokenizer), or None when nothing bounds it: a tokenizer
    that is not a fast BPE one (WordPiece's and Unigram's unknown token covers a whole word), fuses unknown characters
    into one token, has an added token that strips the spaces beside it, whose normalizer or pre-tokenizer may drop
    characters (``Strip``, ``Replace``, BERT's, ``Whitespace``), or whose model may drop characters beyond a known few:
    a BPE with no unknown token drops a character it has no symbol for, unless its byte-level pre-tokenizer writes
    every character as byte symbols that (all but those of a few ASCII characters) are in its vocabulary, or its byte
    fallback has all 256 ``<0xNN>`` tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except (ValueError, TypeError, AttributeError):  # not the tokenizers library's own object: nothing to read
        return None
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") is not None and model.get("fuse_unk")):
        return None
    factor = _normalizer_factor(spec.get("normalizer"))
    if factor is None or not _keeps_characters(spec.get("pre_tokenizer")):
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None  # such a token takes in every space beside it (RoBERTa's <mask>): one token, any length
    vocab = model.get("vocab") or {}
    dropped = "" if model.get("unk_token") is not None else _dropped(spec.get("pre_tokenizer"), model, vocab)
    if dropped is None or (dropped and spec.get("normalizer") is not None):
        return None  # it may drop any character (or a normalizer may make the ones it drops of others)
    # a vocabulary entry is written in the model's symbols: one per byte (ByteLevel), or per character (a
    # Metaspace ▁ for a space, a byte-fallback <0x0A> for one byte), so it stands for at most len(entry) characters
    # of the text; an added (special) token is matched as its content, before pre-tokenizing
    longest = max([len(t) for t in vocab] + [len(t.get("content", "")) for t in added]
                  + [1])
    return Bound(longest * factor, dropped)


def chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of a prompt one token of ``tokenizer`` can stand for (:func:`token_bound`), or None.

    Only the tests call it now: the engine reads :func:`token_bound`, whose ``dropped`` this leaves out."""
    bound = token_bound(tokenizer)
    return None if bound is None else bound.per_token


def _dropped(pre_tokenizer: Any, model: dict, vocab: dict) -> str | None:
    """The characters a BPE ``model`` with no unknown token drops whole ("": none), or None when it may drop any
    (a character it has no symbol for is left out: tokenizers' BPE ``merge_word``)."""
    if _has_byte_level(pre_tokenizer):
        symbols = _byte_symbols()
        if any(symbols[b] not in vocab for b in range(0x80, 0xC0)):
            return None  # a character of several bytes keeps one at least when every continuation byte is there
        return "".join(chr(b) for b in range(0x80) if symbols[b] not in vocab)
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return ""
    return None


def _has_byte_level(pre_tokenizer: Any) -> bool:
    """Whether the pre-tokenizer writes every character as GPT-2's byte symbols."""
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_has_byte_level(part) for part in pre_tokenizer.get("pretokenizers") or [])
    return pre_tokenizer.get("type") == "ByteLevel"


def _byte_symbols() -> list[str]:
    """GPT-2's symbol for each byte (tokenizers' ``ByteLevel`` alphabet): printable ones stand for themselves, the
    rest are shifted past 255 in order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(shifted)) for b in range(256)]


def _normalizer_factor(normalizer: Any) -> int | None:
    """How many times shorter the normalizer may make a text (1: never shorter); None when it may drop characters."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers") or []:
            each = _normalizer_factor(part)
            if each is None:
                return None
            factor *= each
        return factor
    return _NORMALIZER_FACTOR.get(kind)


def _keeps_characters(pre_tokenizer: Any) -> bool:
    """Whether the pre-tokenizer hands every character of the text on to the model (none dropped)."""
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(part) for part in pre_tokenizer.get("pretokenizers") or [])
    if kind in ("Split", "Punctuation") and pre_tokenizer.get("behavior") == "Removed":
        return False
    return kind in _KEEPING_PRE_TOKENIZERS


def fewest_tokens(text: str, bound: int | Bound | None, at_least: int = 0) -> int:
    """The fewest tokens ``text`` can have under a tokenizer whose tokens cover at most ``bound`` characters (a
    :class:`Bound`: its dropped characters not counted; 0 when unbounded). ``at_least``: the count the caller checks
    against; while the text's length alone says fewer, that smaller figure is returned without counting the dropped
    characters (a pass over the text for each: 3.6 ms a megabyte, on every prompt)."""
    if bound is None:
        return 0
    if isinstance(bound, int):
        bound = Bound(bound)
    most = math.ceil(len(text) / bound.per_token)
    if not bound.dropped or most < at_least:
        return most
    kept = len(text) - sum(text.count(c) for c in bound.dropped)
    return math.ceil(kept / bound.per_token)


#: The Split regexes of tokenizer.json pre-tokenizers (``Sequence[Split(regex, Isolated), ByteLevel(use_regex=false)]``)
#: under which a text is split wherever a character that is not whitespace is followed by a space: Llama 3's (and
#: tiktoken's cl100k_base, digits in threes) and Qwen 2's (Qwen 2.5's, Qwen 3's: digits one by one). Each is an
#: alternation of letters (an optional non-letter first), digits, contractions, punctuation (an optional space
#: first, line breaks after) and runs of whitespace: no alternative matches a space after a non-space character,
#: and every character starts a match (no gaps), so the match holding that character ends before the space; the
#: next match is searched from there, reading only forward (a look-ahead, no look-behind, anchor or ``\b``), as in
#: the text's end cut there; and the match before it reads past its last character only to fail on it (a letter,
#: digit, punctuation or line break wanted, none of which a space or the text's end is), as in the text's start cut
#: there. Any other spelling, however close, is not admitted (:func:`cut_points`): a ``\p{L}+\s?`` takes the space.
CUT_REGEXES = {
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
}


def cut_points(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` (a transformers fast tokenizer) splits a text wherever a letter is followed by a space,
    whatever comes before and after, and makes its tokens within the pieces: then an end of a text cut at such a place
    has the whole text's tokens past it (``truncate_prompt_tokens`` tokenizes only the end it keeps).

    True for a BPE (no dropout) with no normalizer or NFC (Qwen 2's), whose pre-tokenizer is GPT-2's byte-level one
    (its regex: a letter is never matched with a space after it; no look-behind) or one of :data:`CUT_REGEXES` split
    ``Isolated`` before a byte-level mapping without its own regex (Llama 3's, Qwen 2's), digits split or not, and no
    added token that holds a letter and a space or takes in spaces or words around it. NFC keeps the cut: a space has
    no decomposition, composes with nothing before or after it and bounds the reordering of marks, so the normalized
    text is the two ends' normalized, and a letter is never normalized into whitespace. False for any other (a
    Metaspace, whose pieces a prepended ``▁`` or merges across ``▁`` may change; a Split of another regex; another
    normalizer), which is tokenized whole."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        spec = json.loads(backend.to_str())
    except (ValueError, TypeError, AttributeError):
        return False
    model = spec.get("model") or {}
    normalizer = spec.get("normalizer")
    if model.get("type") != "BPE" or model.get("dropout") or normalizer not in (None, {"type": "NFC"}):
        return False
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers") or [] if pre.get("type") == "Sequence" else [pre]
    if not _cut_pre_tokenizer(parts):
        return False
    for t in spec.get("added_tokens") or []:
        content = t.get("content", "")
        if t.get("lstrip") or t.get("rstrip") or t.get("single_word") or any(
                a.isalpha() and b.isspace() for a, b in itertools.pairwise(content)):
            return False
    return True


def _cut_pre_tokenizer(parts: list[dict]) -> bool:
    """Whether the pre-tokenizers ``parts`` (in order) split before every space that follows a letter, each piece
    alike wherever the text starts: Digits anywhere, and either GPT-2's ``ByteLevel`` with its regex, or a Split of
    :data:`CUT_REGEXES` (matches kept as pieces) and after it a ``ByteLevel`` without its regex (before the Split, it
    would hand it ``Ġ``, a letter, for each space)."""
    split_seen = byte_level_seen = False
    for part in parts:
        kind = part.get("type")
        if kind == "Digits":
            continue
        if kind == "ByteLevel" and part.get("use_regex", True):
            byte_level_seen = True
            split_seen = True  # GPT-2's own regex splits
        elif kind == "ByteLevel":
            if not split_seen:
                return False
            byte_level_seen = True
        elif kind == "Split":
            pattern = part.get("pattern") or {}
            if (byte_level_seen or pattern.get("Regex") not in CUT_REGEXES.values()
                    or part.get("behavior") != "Isolated" or part.get("invert")):
                return False
            split_seen = True
        else:
            return False
    return byte_level_seen and split_seen
