"""``kvload generate``'s printer: each reply on stdout as it is generated, its logprobs after it."""

from __future__ import annotations

import json
import sys
from typing import Any


class _TokenPrinter:
    """``on_delta`` of ``kvload generate``: one sample streams token by token; several print as each ends.

    With ``--logprobs`` each sample's tokens follow it, one line each: the token, its logprob, then the top
    alternatives (the other most likely tokens, with theirs).
    """

    def __init__(self, tokenizer: Any, several: bool, labelled_samples: bool, logprobs: bool = False,
                 reasoning_parser: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.reasoning_parser = reasoning_parser  # print each reply's thinking and answer apart, each labelled
        self._split: Any = None  # one streamed reply under the parser: its ReasoningText
        self._section: str | None = None  # the label the streamed reply prints under now
        self.has_text = tokenizer is not None  # False: a model without a tokenizer prints token ids
        self.several = several
        self.labelled_samples = labelled_samples  # "[i.j]" rather than "[i]"
        self.logprobs = logprobs
        self.parts: dict[tuple[int, int], list[str]] = {}  # each sample's token ids (no tokenizer) or text pieces
        self.scores: dict[tuple[int, int], list[tuple[int, dict[int, float]]]] = {}  # (token, its entry) per token

    def __call__(self, delta: Any) -> None:
        key = (delta.index, delta.sample)
        if self.logprobs and delta.logprobs is not None:
            self.scores.setdefault(key, []).extend(zip(delta.token_ids, delta.logprobs, strict=True))
        label = f"{delta.index}.{delta.sample}" if self.labelled_samples else f"{delta.index}"
        if not self.several and self.reasoning_parser is not None and self.has_text:
            self._stream_split(delta.text, delta.finish_reason is not None)
        elif not self.several:
            piece = delta.text if self.has_text else " ".join(map(str, delta.token_ids)) + " "
            sys.stdout.write(piece + ("\n" if delta.finish_reason is not None else ""))
            sys.stdout.flush()
        else:
            parts = self.parts.setdefault(key, [])
            parts.extend([delta.text] if self.has_text else map(str, delta.token_ids))
            if delta.finish_reason is not None and self.reasoning_parser is not None and self.has_text:
                from engine.reasoning import split_reasoning

                reasoning, content = split_reasoning(self.reasoning_parser, "".join(parts))
                lines = [] if reasoning is None else [f"[{label}] reasoning: {reasoning}"]
                print("\n".join([*lines, f"[{label}] content:" + (f" {content}" if content else "")]), flush=True)
            elif delta.finish_reason is not None:
                print(f"[{label}] {('' if self.has_text else ' ').join(parts)}", flush=True)
        if delta.finish_reason is not None and self.logprobs:
            self._print_logprobs(label if self.several else None, self.scores.pop(key, []))

    def _stream_split(self, text: str, last: bool) -> None:
        """One streamed reply under ``--reasoning-parser``: each piece under its label (``reasoning:``,
        ``content:``), a new line and label where the reply passes from one to the other; a marker, or the end of a
        piece that may still become one, is never printed. A reply that ends with no answer ends on an empty
        ``content:`` line."""
        from engine.reasoning import ReasoningText

        if self._split is None:
            self._split = ReasoningText(self.reasoning_parser)
        pieces = [self._split.read(text)]
        if last:
            pieces.append(self._split.finish_read())
        out = []
        for before, reasoning, answer in pieces:
            for section, piece in (("content", before), ("reasoning", reasoning), ("content", answer)):
                if piece:
                    if section != self._section:
                        out.append(("\n" if self._section else "") + f"{section}: ")
                        self._section = section
                    out.append(piece)
        if last:
            if self._section != "content":
                out.append(("\n" if self._section else "") + "content:")
            out.append("\n")
            self._split = self._section = None
        sys.stdout.write("".join(out))
        sys.stdout.flush()

    def _print_logprobs(self, label: str | None, scores: list[tuple[int, dict[int, float]]]) -> None:
        """One line per token: ``token logprob | alternative logprob, ...`` (most likely first)."""
        lines = [f"logprobs{f' [{label}]' if label else ''}: token logprob | top alternatives"]
        for token, entry in scores:
            others = sorted(((t, lp) for t, lp in entry.items() if t != token), key=lambda x: -x[1])
            alternatives = ", ".join(f"{self._token(t)} {lp:.3f}" for t, lp in others)
            lines.append(f"  {self._token(token)} {entry[token]:.3f}" + (f" | {alternatives}" if alternatives else ""))
        print("\n".join(lines), flush=True)

    def _token(self, token: int) -> str:
        """A token as its text, quoted (spaces and newlines show), or its id without a tokenizer."""
        if self.tokenizer is None:
            return str(token)
        return json.dumps(self.tokenizer.decode([token]), ensure_ascii=False)
