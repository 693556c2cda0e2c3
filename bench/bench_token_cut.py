"""A text prompt cut by ``truncate_prompt_tokens`` on a Llama 3 or Qwen 2 style tokenizer: the whole text tokenized
and its last (or first) k ids kept, as every such tokenizer was before ``tok42``, against only an end of it
(``kvload.serve.request_input.kept_text_tokens``, cut where ``engine.token_bound.cut_points`` says the tokenizer
splits); the same ids, checked.

The tokenizers are BPEs trained here, offline, on ``bench/text_prompts.txt`` with those tokenizers' exact
pre-tokenizers (``engine.token_bound.CUT_REGEXES`` split ``Isolated``, then a byte-level mapping without its own
regex; Qwen 2's NFC normalizer); the text, words drawn at random from that file (seed 0) as ``bench_prompt_aside``
draws them. Interleaved, medians.

    python -m bench.bench_token_cut [--chars 2000000] [--keep 100] [--repeats 7] [--vocab 4000]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

from bench.common import Table, median, ratio
from engine.token_bound import CUT_REGEXES, cut_points
from kvload.serve.request_input import kept_text_tokens

REPO = Path(__file__).resolve().parent.parent


def trained(regex: str, nfc: bool, bos: bool, vocab: int, corpus: list[str]) -> Any:
    """A BPE of ``vocab`` entries trained on ``corpus`` with ``Sequence[Split(regex, Isolated),
    ByteLevel(use_regex=false)]`` (``nfc``: Qwen 2's normalizer; ``bos``: a ``<s>`` first, as Llama 3's)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


class _Engine:
    """What ``kept_text_tokens`` reads of a serving engine."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def tokenize(self, text: str, *, add_special_tokens: bool = True, where: str = "prompt",
                 tokenizer: Any = None) -> list[int]:
        tok = self.tokenizer if tokenizer is None else tokenizer
        return [int(t) for t in tok(text, add_special_tokens=add_special_tokens)["input_ids"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, default=2_000_000)
    ap.add_argument("--keep", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--vocab", type=int, default=4000)
    args = ap.parse_args()
    lines = (REPO / "bench" / "text_prompts.txt").read_text().splitlines()
    words = " ".join(lines).split()
    rng = random.Random(0)
    text = " ".join(rng.choice(words) for _ in range(args.chars // 3))[: args.chars]
    table = Table(f"A {args.chars:,}-character prompt cut to {args.keep} tokens, median s",
                  f"python -m bench.bench_token_cut --chars {args.chars} --keep {args.keep} --repeats {args.repeats} "
                  f"--vocab {args.vocab}",
                  ["tokenizer", "side", "whole text tokenized (before)", "its end only (kept_text_tokens)",
                   "before / now"])
    for name, nfc, bos in (("llama3", False, True), ("qwen2", True, False)):
        tok = trained(CUT_REGEXES[name], nfc, bos, args.vocab, lines)
        assert cut_points(tok), name
        engine = _Engine(tok)
        for side in ("left", "right"):
            whole_s, cut_s = [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                ids = engine.tokenize(text)
                whole = ids[-args.keep:] if side == "left" else ids[:args.keep]
                whole_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                cut = kept_text_tokens(engine, text, args.keep, True, side)
                cut_s.append(time.perf_counter() - start)
                assert cut == whole, (name, side)
            table.rows.append([name, side, f"{median(whole_s):.3f}", f"{median(cut_s):.4f}",
                               ratio(median(whole_s) / median(cut_s))])
    print(table.markdown())


if __name__ == "__main__":
    main()
