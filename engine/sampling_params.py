"""``SamplingParams``: how a generate call picks tokens, validated on construction (no torch needed).

The fields and their meaning follow vLLM's and TensorRT-LLM's ``SamplingParams``. The length field's
canonical name is ``max_tokens`` (as in vLLM, TensorRT-LLM and the OpenAI API); ``max_new_tokens``
(transformers' spelling, kvload's first name for it) is accepted as a constructor keyword and readable
as a property, so both spellings keep working.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs

from engine.prompts import check_text, is_token_id
from pipeline.errors import GenerationError
from pipeline.limits import MAX_N

#: Tokens generated per prompt when nothing says otherwise: the Python API and ``kvload generate``
#: share it (vLLM defaults to 16, TensorRT-LLM to 32; 64 lets a short chat reply finish).
DEFAULT_MAX_TOKENS = 64


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _plain_int(v: Any) -> Any:
    """A numpy integer as a Python int; anything else unchanged (the checks then judge it)."""
    return int(v) if is_token_id(v) and not isinstance(v, int) else v


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check(ok: bool, name: str, expected: str, value: Any) -> None:
    if not ok:
        raise GenerationError(f"generate: {name}: expected {expected}, got {value!r}")


def _strings(value: Any) -> Any:
    """``stop``: one string or a list of strings → a tuple (anything else is left for the check to name)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        return tuple(value)
    return value


def _ints(value: Any) -> Any:
    if value is None:
        return ()
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        return tuple(value)
    return value


@attrs.frozen(init=False)
class SamplingParams:
    """How a call picks tokens: greedy at ``temperature == 0``, else softmax(logits / T) within top-k and top-p.

    ``max_tokens`` (alias ``max_new_tokens``): most tokens generated per sample. ``top_k``: keep the k
    most likely tokens (0 or -1: all). ``seed``: prompt ``i``'s sample ``j`` draws from a generator
    seeded with ``seed + i * n + j`` (None: a fresh random seed per call). ``stop``: strings that end a
    sample when they appear in its text (not included in ``.text``); ``stop_token_ids``: ids that end
    it (kept in ``token_ids``, as EOS is). ``n``: samples per prompt (at most ``pipeline.limits.MAX_N``),
    sharing the prompt's KV blocks. ``logprobs``: per generated token, the log-probabilities of the
    ``logprobs`` most likely tokens plus the sampled one (None: none). ``ignore_eos``: keep going past
    EOS (stop strings/ids still end).
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    logprobs: int | None = None
    ignore_eos: bool = False

    def __init__(self, *, max_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop: str | Sequence[str] | None = None,
                 stop_token_ids: Sequence[int] | None = None, n: int = 1, logprobs: int | None = None,
                 ignore_eos: bool = False, max_new_tokens: int | None = None) -> None:
        """Keywords only (the field order may grow); ``max_new_tokens`` is an alias of ``max_tokens``."""
        length_name = "max_tokens"
        if max_new_tokens is not None:
            if max_tokens is not None and max_tokens != max_new_tokens:
                raise GenerationError(f"generate: max_tokens={max_tokens!r} and max_new_tokens={max_new_tokens!r}: "
                                      "they are one setting (max_new_tokens is an alias); give one")
            max_tokens, length_name = max_new_tokens, "max_new_tokens"
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        # numpy integers (an n or a seed taken from an array) count as integers, stored as Python ints
        max_tokens, top_k, seed, n, logprobs = map(_plain_int, (max_tokens, top_k, seed, n, logprobs))
        check(is_int(max_tokens) and max_tokens >= 1, length_name, "an integer >= 1", max_tokens)
        self.__attrs_init__(max_tokens, temperature, top_p, top_k, seed, _strings(stop), _ints(stop_token_ids), n,
                            logprobs, ignore_eos)

    def __attrs_post_init__(self) -> None:
        check(is_number(self.temperature) and self.temperature >= 0 and math.isfinite(self.temperature),
              "temperature", "a finite number >= 0 (0 = greedy)", self.temperature)
        check(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p)
        check(is_int(self.top_k) and self.top_k >= -1, "top_k", "an integer >= 1, or 0 / -1 for all tokens",
              self.top_k)
        check(self.seed is None or (is_int(self.seed) and 0 <= self.seed <= 2**63 - 1), "seed",
              "an integer in [0, 2**63 - 1] or None", self.seed)
        check(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop), "stop",
              "a non-empty string or a list of them", self.stop)
        for i, text in enumerate(self.stop):  # decoded text is valid Unicode: a lone surrogate could never match
            check_text(f"stop[{i}]", text)
        check(isinstance(self.stop_token_ids, tuple) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids", "a list of token ids (integers >= 0)", self.stop_token_ids)
        check(is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"an integer in [1, {MAX_N}]", self.n)
        check(self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= 0), "logprobs",
              "an integer >= 0 (top tokens to report per generated token) or None", self.logprobs)
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "true or false", self.ignore_eos)

    @property
    def max_new_tokens(self) -> int:
        """Alias of :attr:`max_tokens` (transformers' spelling)."""
        return self.max_tokens

    @property
    def greedy(self) -> bool:
        """Whether tokens are picked by argmax."""
        return self.temperature == 0

    def to_dict(self) -> dict[str, Any]:
        """Plain form (lists for the tuples), e.g. for JSON."""
        data = attrs.asdict(self)
        data["stop"], data["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        return data

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
        known = {a.name for a in attrs.fields(cls)} | {"max_new_tokens"}
        unknown = sorted(set(keywords) - known)
        if unknown:
            raise GenerationError(f"generate: unknown argument {unknown[0]!r}; sampling fields are "
                                  f"{', '.join(sorted(known))}")
        return cls(**keywords)


__all__ = ["DEFAULT_MAX_TOKENS", "SamplingParams", "check", "is_int", "is_number"]
