"""Shared pieces of the text tests: small trained tokenizers, and the re-decoding ``SampleText`` as an oracle."""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

CORPUS = ["Hello world, the sky is blue.", "Paris est la capitale de la France.", "naïve café déjà vu",
          "streaming tokens one at a time", "日本語のテキスト", "emoji 🙂🚀 and more"]


def trained_tokenizer(kind: str = "bytelevel", vocab_size: int = 300) -> Any:
    """A BPE tokenizer trained on :data:`CORPUS` with ``</s>`` (EOS) and ``<pad>`` special tokens.

    ``bytelevel``: GPT-2 / SmolLM2 style (a multi-byte character spans several tokens);
    ``metaspace``: SentencePiece / Llama style (``▁`` marks a word start, the first one's space is dropped).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=kind == "metaspace"))
    if kind == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
        alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>", "<pad>"], initial_alphabet=alphabet)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")


class RedecodeText:
    """The previous ``engine.stopping.SampleText``: re-decodes the whole output at every update (the oracle)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.stop_hit: str | None = None
        self._decoded = 0
        self._searched = 0
        self._emitted = 0

    def update(self, token_ids: Sequence[int], final: bool = False) -> str | None:
        """As ``SampleText.update``."""
        if self.stop_hit is not None or (len(token_ids) == self._decoded and not final):
            return self.stop_hit
        self._decoded = len(token_ids)
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if text.endswith("\ufffd") and not final:
            return None
        self.text = text
        if self.stop:
            start = max(0, self._searched - self.hold)
            hits = [(pos, s) for s in self.stop if (pos := text.find(s, start)) != -1]
            self._searched = len(text)
            if hits:
                pos, self.stop_hit = min(hits)
                self.text = text[:pos]
        return self.stop_hit

    def delta(self, final: bool = False) -> str:
        """As ``SampleText.delta``."""
        end = len(self.text) if final or self.stop_hit is not None else len(self.text) - self.hold
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted:end]
        self._emitted = end
        return out


def bytelevel_checkpoint(source: Path, dest: Path, chat_template: str | None = None, tokenizer: Any = None) -> Path:
    """A copy of the checkpoint ``source`` at ``dest`` with a byte-level BPE tokenizer (every character spellable,
    so any grammar can be followed; ``tokenizer``: this one instead), its EOS the tokenizer's (the presets' EOS id 2
    is a byte there)."""
    shutil.copytree(source, dest)
    tok = trained_tokenizer("bytelevel", 300) if tokenizer is None else tokenizer
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(dest)
    for name in ("config.json", "generation_config.json"):
        path = dest / name
        if path.exists():
            path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": tok.eos_token_id}))
    return dest


def drive(text: Any, ids: list[int], stream: bool = True, drop_last: bool = False) -> tuple[list[Any], int]:
    """Feed ``ids`` one token at a time as the executor does; (what each step showed, tokens consumed).

    Each step records the stop string (or None) and, when ``stream``, the delta. The sample ends at a
    stop string or at the last token; ``drop_last``: it ended on a stop token id, so the final text
    leaves that token out (the executor's ``tokens[:-1]``).
    """
    seen: list[Any] = []
    for k in range(1, len(ids) + 1):
        hit = text.update(ids[:k])
        seen.append(hit)
        if hit is not None or k == len(ids):
            if hit is None:
                text.update(ids[:k - 1] if drop_last else ids[:k], final=True)
            seen.append(text.delta(final=True))
            return seen, k
        if stream:
            seen.append(text.delta())
    raise AssertionError("no tokens")


def pieces(text: str, cuts: list[int]) -> Iterator[str]:
    """``text`` cut in pieces of the ``cuts`` sizes, cycled (0: an empty piece): how a stream's tokens arrive."""
    at, sizes = 0, itertools.cycle(cuts)
    while at < len(text):
        step = next(sizes)
        yield text[at:at + step]
        at += step
