"""``SamplingParams``: how a generate call picks tokens, validated on construction (no torch needed)."""

from __future__ import annotations

import math
from typing import Any

import attrs

from pipeline.errors import GenerationError


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check(ok: bool, name: str, expected: str, value: Any) -> None:
    if not ok:
        raise GenerationError(f"generate: {name}: expected {expected}, got {value!r}")


@attrs.frozen
class SamplingParams:
    """How a call picks tokens. ``temperature == 0`` is greedy; otherwise softmax(logits / T) within top-p."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None  # prompt i of a call samples from a generator seeded with seed + i
    ignore_eos: bool = False  # keep going past EOS until max_new_tokens (benchmarks)

    def __attrs_post_init__(self) -> None:
        check(is_int(self.max_new_tokens) and self.max_new_tokens >= 1, "max_new_tokens", "an integer >= 1",
               self.max_new_tokens)
        check(is_number(self.temperature) and self.temperature >= 0 and math.isfinite(self.temperature),
              "temperature", "a finite number >= 0 (0 = greedy)", self.temperature)
        check(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p)
        check(self.seed is None or (is_int(self.seed) and 0 <= self.seed <= 2**63 - 1), "seed",
              "an integer in [0, 2**63 - 1] or None", self.seed)
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "true or false", self.ignore_eos)

    @classmethod
    def build(cls, params: SamplingParams | None, keywords: dict[str, Any]) -> SamplingParams:
        """``params`` as given, or one built from keyword fields; an unknown keyword or both forms is an error."""
        if params is not None:
            if not isinstance(params, SamplingParams):
                raise GenerationError(f"generate: sampling_params: expected a SamplingParams, got "
                                      f"{type(params).__name__}")
            if keywords:
                raise GenerationError(f"generate: pass sampling settings either as sampling_params or as keywords "
                                      f"({', '.join(sorted(keywords))}), not both")
            return params
        known = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(keywords) - known)
        if unknown:
            raise GenerationError(f"generate: unknown argument {unknown[0]!r}; sampling fields are "
                                  f"{', '.join(sorted(known))}")
        return cls(**keywords)

    @property
    def greedy(self) -> bool:
        """Whether tokens are picked by argmax."""
        return self.temperature == 0



__all__ = ["SamplingParams", "check", "is_int", "is_number"]
