"""``SamplingParams``: how a generate call picks tokens, validated on construction (no torch needed).

The fields and their meaning follow vLLM's and TensorRT-LLM's ``SamplingParams``. The length field's
canonical name is ``max_tokens`` (as in vLLM, TensorRT-LLM and the OpenAI API); ``max_new_tokens``
(transformers' spelling, kvload's first name for it) is accepted as a constructor keyword and readable
as a property, so both spellings keep working.
"""

from __future__ import annotations

import copy
import enum
import math
import numbers
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import attrs

from engine.prompts import array_ints, check_text
from engine.structured_params import StructuredOutputsParams
from pipeline.errors import GenerationError, did_you_mean
from pipeline.generation_config import FROM_OVERRIDE
from pipeline.limits import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_BIAS,
    MAX_INT,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_SALT_CHARS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MIN_REPETITION_PENALTY,
    int_text,
    node_count,
    plain_flag,
    plain_scalar,
    short,
    short_py,
)


class RequestOutputKind(enum.Enum):
    """vLLM's ``RequestOutputKind`` (``from vllm.sampling_params import RequestOutputKind``): what a streamed output
    holds. ``LLM.generate`` returns each prompt's final output whatever it says (vLLM's ``LLM.generate`` sets
    ``FINAL_ONLY`` on every params it is given), so ``SamplingParams(output_kind=...)`` takes ``CUMULATIVE`` (vLLM's
    default) and ``FINAL_ONLY``, which ask for nothing else; ``DELTA`` is refused (``LLM.generate_stream`` yields the
    deltas)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2

    def __repr__(self) -> str:  # as a script writes it (the refusal lists what is accepted)
        return f"RequestOutputKind.{self.name}"


#: Tokens generated per prompt when nothing says otherwise: the Python API and ``kvload generate``
#: share it (vLLM defaults to 16, TensorRT-LLM to 32; 64 lets a short chat reply finish).
DEFAULT_MAX_TOKENS = 64

#: ``max_tokens`` not given (it is then :data:`DEFAULT_MAX_TOKENS`); a ``max_tokens`` of None is vLLM's "up to the
#: context length": as many tokens as ``max_seq_len`` leaves after the prompt
_NOT_GIVEN: Any = type("_NotGiven", (), {"__repr__": lambda self: "<not given>"})()


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool) or type(v).__name__ == "bool_"  # numpy's bool is no int subclass, but still a flag


def is_int(v: Any) -> bool:
    """An integer: ``int`` or a numpy integer (any ``numbers.Integral``), never a bool."""
    return isinstance(v, numbers.Integral) and not _is_bool(v)


def _plain_int(v: Any) -> Any:
    """A numpy integer (or 0-d integer torch tensor) as a Python int; anything else unchanged (the checks then judge
    it)."""
    plain = plain_scalar(v)
    return plain if isinstance(plain, int) and not isinstance(plain, bool) else v


def is_number(v: Any) -> bool:
    """A real number: ``int``, ``float`` or a numpy scalar of either (any ``numbers.Real``), never a bool."""
    return isinstance(v, numbers.Real) and not _is_bool(v)


def is_finite(v: Any) -> bool:
    """A real number a float holds: ``math.isfinite`` raises on an integer past ~1.8e308 (a JSON literal of 400
    digits), where this says no."""
    if not is_number(v):
        return False
    if isinstance(v, numbers.Integral):
        return abs(int(v)) < 2**1024
    return math.isfinite(v)


def _plain_number(v: Any) -> Any:
    """A numpy (or 0-d torch) float or integer as a Python float; Python numbers and anything else unchanged."""
    if isinstance(v, (int, float)):
        return v
    plain = plain_scalar(v)
    return float(plain) if plain is not v and isinstance(plain, (int, float)) else v


#: Most nodes (items of items, counted at each occurrence) of a value :func:`_shown` writes out with ``repr``.
_SHOWN_NODES = 64


def _shown(value: Any) -> str:
    """A value for an error message: its repr, but a huge integer or a long list by its size and long text cut
    (``repr`` of a 5,000-digit int raises; of a million-item list, it is a 5 MB line)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return int_text(value)
    if isinstance(value, (list, tuple, range)) and len(value) > 8:
        return f"a list of {len(value):,} items"
    if isinstance(value, tuple):  # a list the caller gave (JSON's array, --stop), kept as a tuple: shown as given,
        value = list(value)  # not "got ('',)"
    if node_count(value, _SHOWN_NODES) > _SHOWN_NODES:  # an alias bomb (a few lists naming one another 2**40 items
        return short(value)  # when written out): repr never returned; its size instead, as a long list's
    try:
        text = repr(value)
    except ValueError:  # a huge integer inside (a logit_bias key): its size, never the repr's own error
        return short(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check(ok: bool, name: str, expected: str, value: Any) -> None:
    if not ok:
        raise GenerationError(f"generate: {name}: expected {expected}, got {_shown(value)}")


def check_stop_sizes(stop: Sequence[str]) -> None:
    """At most :data:`MAX_STOP` stop strings of at most :data:`MAX_STOP_CHARS` characters (the server's too)."""
    if len(stop) > MAX_STOP:
        raise GenerationError(f"generate: stop: expected at most {MAX_STOP} strings, got a list of {len(stop):,}")
    for i, text in enumerate(stop):
        if isinstance(text, str) and len(text) > MAX_STOP_CHARS:
            raise GenerationError(f"generate: stop[{i}]: expected a string of at most {MAX_STOP_CHARS:,} characters, "
                                  f"got {len(text):,}")


def check_stop_token_ids_count(count: int) -> None:
    """At most :data:`MAX_STOP_TOKEN_IDS` stop token ids (the server's bound too)."""
    if count > MAX_STOP_TOKEN_IDS:
        raise GenerationError(f"generate: stop_token_ids: expected at most {MAX_STOP_TOKEN_IDS:,} token ids, got a "
                              f"list of {count:,}")


def check_logprobs(value: Any, name: str = "logprobs") -> None:
    """``logprobs`` (or ``prompt_logprobs``): None or an integer in [0, :data:`MAX_LOGPROBS`] (the server's bound
    too)."""
    what = "prompt token" if name == "prompt_logprobs" else "generated token"
    check(value is None or (is_int(value) and 0 <= value <= MAX_LOGPROBS), name,
          f"an integer in [0, {MAX_LOGPROBS}] (top tokens to report per {what})", value)


def check_salt(salt: Any, name: str = "salt") -> None:
    """A prefix-reuse salt: None or valid Unicode text of at most :data:`MAX_SALT_CHARS` characters (the server's
    bound too); it is hashed into every block key of its request. ``name``: the setting, as errors name it."""
    check(salt is None or isinstance(salt, str), name, "a string or None", salt)
    if salt is not None:
        if len(salt) > MAX_SALT_CHARS:
            raise GenerationError(f"generate: {name}: expected a string of at most {MAX_SALT_CHARS:,} characters, got "
                                  f"{len(salt):,}")
        check_text(name, salt)  # hashed as UTF-8 into every block key


def _at_most_int64(name: str, value: Any) -> None:
    """An integer setting past int64 (what torch and the KV budget take), refused by its name (as seed is)."""
    if is_int(value) and value > MAX_INT:
        raise GenerationError(f"generate: {name}: expected at most 2**63 - 1, got {int_text(value)}")


def _strings(value: Any) -> Any:
    """``stop``: one string or a list of strings → a list of its own (vLLM's type: ``params.stop.append(...)``; anything
    else is left for the check to name)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        check_stop_sizes(value)  # counted before it is copied
        return list(value)
    return value


def _biases(value: Any) -> Any:
    """``logit_bias``: None → {}; a mapping → a dict of plain ints to plain numbers (anything else is left for the
    check to name), counted before it is copied."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        check_logit_bias_count(len(value))  # counted before it is copied
        return {_plain_int(t): _plain_number(b) for t, b in value.items()}
    return value


def _token_key(key: Any) -> Any:
    """A ``logit_bias`` key written as text (``"50256"``, JSON's object keys) as the token id it names; anything else
    unchanged, for the check to judge."""
    if isinstance(key, str) and key.strip().isascii() and key.strip().isdigit() and len(key) <= 20:
        return int(key)
    return key


def check_logit_bias_count(count: int) -> None:
    """At most :data:`MAX_LOGIT_BIAS` biased tokens (the server's bound too)."""
    if count > MAX_LOGIT_BIAS:
        raise GenerationError(f"generate: logit_bias: expected at most {MAX_LOGIT_BIAS:,} tokens, got {count:,}")


def _ints(value: Any) -> Any:
    """``stop_token_ids``: None → []; a list, or a 1-D integer numpy array or torch tensor (vLLM's ``list(...)`` takes
    one, as a prompt's ids are taken), → a list of plain ints, counted before it is copied (anything else is left for
    the check to name)."""
    value = array_ints(value)
    if value is None:
        return []
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        check_stop_token_ids_count(len(value))  # counted before it is copied
        return list(map(_plain_int, value))  # numpy ids (from an array) stored as Python ints
    return value


def _allowed(value: Any) -> Any:
    """``allowed_token_ids``: None stays None; a list (or a 1-D integer array) → a list of plain ints, counted before it
    is copied (anything else is left for the check to name)."""
    value = array_ints(value)  # a 1-D integer array or tensor, as stop_token_ids and a prompt's ids take one
    if value is None:
        return None
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        if len(value) > MAX_ALLOWED_TOKEN_IDS:
            raise GenerationError(f"generate: allowed_token_ids: expected at most {MAX_ALLOWED_TOKEN_IDS:,} token ids, "
                                  f"got a list of {len(value):,}")
        return list(map(_plain_int, value))
    return value


def _words(value: Any) -> Any:
    """``bad_words``: None → []; a list → a list of its own, counted before it is copied (a lone string is refused by
    the check: vLLM takes a list, and a string would be read as its characters)."""
    if value is None:
        return []
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        if len(value) > MAX_BAD_WORDS:
            raise GenerationError(f"generate: bad_words: expected at most {MAX_BAD_WORDS:,} strings, got a list of "
                                  f"{len(value):,}")
        return list(value)
    return value


@attrs.frozen(init=False)
class SamplingParams:
    """How a call picks tokens: greedy at ``temperature == 0``, else softmax(logits / T) within top-k and top-p.

    ``max_tokens`` (alias ``max_new_tokens``): most tokens generated per sample. ``top_k``: keep the k
    most likely tokens (0 or -1: all). ``seed``: each prompt's sample ``j`` draws from a generator seeded with
    ``seed + j`` (vLLM's rule; None: the next seed of ``kvload.LLM``'s seeded sequence, or fresh without one).
    ``stop``: strings that end a sample when they appear in its text (not included in ``.text``); ``stop_token_ids``:
    ids that end it (kept in ``token_ids``, as EOS is); at most ``pipeline.limits.MAX_STOP`` strings of
    ``MAX_STOP_CHARS`` characters and ``MAX_STOP_TOKEN_IDS`` ids. ``n``: samples per prompt (at most
    ``pipeline.limits.MAX_N``), sharing the prompt's KV blocks. ``logprobs``: per generated token, the
    log-probabilities of the ``logprobs`` most likely tokens plus the sampled one (None: none; at most
    ``MAX_LOGPROBS``).
    ``ignore_eos``: keep going past EOS (stop strings/ids still end).

    vLLM's penalties and bounds (``engine.penalties``; applied to the logits before temperature, greedy or sampled):
    ``repetition_penalty`` (in [0.01, 100]; 1 = off) divides a positive logit and multiplies a negative one of every
    token in the prompt or the output (transformers' and vLLM's); ``presence_penalty`` and ``frequency_penalty`` (in
    [-2, 2]; 0 = off) subtract, per token, once if the output holds it and per time it does (OpenAI's);
    ``min_tokens``: no EOS, stop token id or stop string ends a sample before it has this many tokens (at most
    ``max_tokens``). ``min_p`` (in [0, 1]; 0 = off): drop tokens less likely than ``min_p`` times the most likely
    one (after temperature; sampling only). ``logit_bias``: token id → a number in [-100, 100] added to its logit
    before the penalties (OpenAI's; -100 in effect bans the token), at most ``MAX_LOGIT_BIAS`` tokens.
    ``include_stop_str_in_output``: ``.text`` keeps the stop string that ended it; ``skip_special_tokens`` (default
    true): special tokens decode to nothing in ``.text``; ``spaces_between_special_tokens`` (default true; false
    acts with ``skip_special_tokens`` false): an added token right after another joins it without the space the
    tokenizer's decoder may put between tokens (vLLM's three text settings). ``prompt_logprobs``: the
    prompt's tokens scored too (``RequestOutput.prompt_logprobs``, vLLM's; the prompt is then prefilled whole, not
    read from the prefix cache, as its logits are needed; its blocks are still cached for later requests).
    ``allowed_token_ids`` (vLLM's): only these ids may be sampled (None: any; at most ``MAX_ALLOWED_TOKEN_IDS``).
    ``bad_words`` (vLLM's): strings never generated: each is tokenized (as is and after a space, vLLM's rule) and its
    last token is banned wherever the output so far ends with the tokens before it; needs a tokenizer (at most
    ``MAX_BAD_WORDS`` of ``MAX_STOP_CHARS`` characters). ``structured_outputs`` (vLLM's): a
    :class:`~engine.structured_params.StructuredOutputsParams`: the output matches a JSON schema, a regex, one of some
    choices or a grammar (``engine.structured``; needs xgrammar and a tokenizer). ``truncate_prompt_tokens`` (vLLM's):
    each prompt is cut to its last k tokens (a BOS too) before it runs, k at most ``max_seq_len``; -1 is
    ``max_seq_len`` (vLLM's ``max_model_len``); None cuts nothing.
    """

    max_tokens: int | None = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    # lists, as vLLM's (scripts append to them: ``params.stop.append("###")``); a list changed in place is checked again
    # by the next generate call (:meth:`SamplingParams.recheck`); not hashed, as ``logit_bias`` is not
    stop: list[str] = attrs.field(factory=list, hash=False)
    stop_token_ids: list[int] = attrs.field(factory=list, hash=False)
    n: int = 1
    logprobs: int | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    min_p: float = 0.0
    logit_bias: dict[int, float] = attrs.field(factory=dict, hash=False)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = attrs.field(default=None, hash=False)
    bad_words: list[str] = attrs.field(factory=list, hash=False)
    structured_outputs: StructuredOutputsParams | None = attrs.field(default=None, hash=False)
    detokenize: bool = True
    #: vLLM's: keep each prompt's last k tokens (-1: as many as ``max_seq_len`` leaves after ``max_tokens``)
    truncate_prompt_tokens: int | None = None
    #: ``bad_words`` as token id sequences, set by the executor from its tokenizer (vLLM's ``_bad_words_token_ids``)
    _bad_words_token_ids: tuple[tuple[int, ...], ...] = attrs.field(default=(), init=False, eq=False, repr=False)
    #: what the list and dict fields held when last checked (:meth:`recheck` checks again only what changed since: a
    #: server's request of 262,144 allowed ids took 0.3 s to check, and a comparison takes milliseconds)
    _checked: tuple[Any, ...] | None = attrs.field(default=None, init=False, eq=False, repr=False, hash=False)
    #: vLLM's fields kvload lacks, given at values that ask for nothing (:data:`VLLM_FIELDS_AT_NO_OP`): kept so a script
    #: reads back what it set (``params.output_kind``), as vLLM's params would hold it; not settings, so not compared
    _vllm_fields: dict[str, Any] = attrs.field(factory=dict, init=False, eq=False, repr=False, hash=False)

    def __init__(self, *, max_tokens: int | None = _NOT_GIVEN, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop: str | Sequence[str] | None = None,
                 stop_token_ids: Sequence[int] | None = None, n: int = 1, logprobs: int | None = None,
                 ignore_eos: bool = False, max_new_tokens: int | None = None, repetition_penalty: float = 1.0,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, min_tokens: int = 0,
                 min_p: float = 0.0, logit_bias: Mapping[int, float] | None = None,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 prompt_logprobs: int | None = None, spaces_between_special_tokens: bool = True,
                 allowed_token_ids: Sequence[int] | None = None, bad_words: Sequence[str] | None = None,
                 structured_outputs: StructuredOutputsParams | None = None, detokenize: bool = True,
                 truncate_prompt_tokens: int | None = None, **unknown: Any) -> None:
        """Keywords only (the field order may grow); ``max_new_tokens`` is an alias of ``max_tokens``; ``max_tokens``
        None (vLLM's): no cap but the context, as many tokens as ``max_seq_len`` leaves after the prompt."""
        if "bad" in unknown:  # TensorRT-LLM's name of bad_words: a string, or a list of them
            bad = unknown.pop("bad")
            if bad is not None and bad_words is not None:
                raise GenerationError("generate: bad and bad_words are one setting (bad is TensorRT-LLM's name of "
                                      "bad_words); give one")
            if bad is not None:
                bad_words = [bad] if isinstance(bad, str) else bad
        taken = {k: v for k, v in unknown.items() if _asks_nothing(k, v, n)}  # vLLM's "not set": taken, as vLLM's
        for name in taken:  # defaults they are (SamplingParams(best_of=None), a config's logits_processors: [])
            del unknown[name]
        if unknown:
            raise GenerationError(unknown_field(next(iter(unknown))))
        length_name = "max_tokens"
        if max_new_tokens is not None:
            if max_tokens is not _NOT_GIVEN and max_tokens is not None and max_tokens != max_new_tokens:
                # each cut short (short_py): a huge int's repr raised, a list nesting itself 40 deep never returned
                raise GenerationError(f"generate: max_tokens={short_py(max_tokens)} and max_new_tokens="
                                      f"{short_py(max_new_tokens)}: they are one setting (max_new_tokens is an alias); "
                                      "give one")
            max_tokens, length_name = max_new_tokens, "max_new_tokens"
        if max_tokens is _NOT_GIVEN:
            max_tokens = DEFAULT_MAX_TOKENS
            _past_default_length(_plain_int(min_tokens), max_tokens, "kvload's default max_tokens (none was given)")
        # vLLM's rules: seed -1 is no seed of the request's own; True asks for the sampled (or prompt) token's logprob
        # and its 1 most likely alternative
        logprobs = 1 if logprobs is True else logprobs
        prompt_logprobs = 1 if prompt_logprobs is True else prompt_logprobs
        # numpy scalars and 0-d torch tensors (an n, a seed or a temperature taken from an array) count as numbers,
        # stored as Python's
        max_tokens, top_k, seed, n, logprobs, min_tokens, prompt_logprobs, truncate_prompt_tokens = map(
            _plain_int, (max_tokens, top_k, seed, n, logprobs, min_tokens, prompt_logprobs, truncate_prompt_tokens))
        seed = None if is_int(seed) and seed == -1 else seed
        # numpy's bool and a 0-d bool tensor (a flag computed from an array) as Python's bool
        ignore_eos, include_stop_str_in_output, skip_special_tokens, spaces_between_special_tokens, detokenize = map(
            plain_flag, (ignore_eos, include_stop_str_in_output, skip_special_tokens, spaces_between_special_tokens,
                         detokenize))
        temperature, top_p, repetition_penalty, presence_penalty, frequency_penalty, min_p = map(
            _plain_number, (temperature, top_p, repetition_penalty, presence_penalty, frequency_penalty, min_p))
        check(max_tokens is None or (is_int(max_tokens) and max_tokens >= 1), length_name, "an integer >= 1",
              max_tokens)
        _at_most_int64(length_name, max_tokens)
        self.__attrs_init__(max_tokens, temperature, top_p, top_k, seed, _strings(stop), _ints(stop_token_ids), n,
                            logprobs, ignore_eos, repetition_penalty, presence_penalty, frequency_penalty,
                            min_tokens, min_p, _biases(logit_bias), include_stop_str_in_output,
                            skip_special_tokens, prompt_logprobs, spaces_between_special_tokens,
                            _allowed(allowed_token_ids), _words(bad_words), structured_outputs, detokenize,
                            truncate_prompt_tokens)
        self._vllm_fields.update(taken)

    def __getattr__(self, name: str) -> Any:
        """vLLM's fields kvload lacks read back as given (:attr:`_vllm_fields`), else as vLLM's default: a script that
        reads ``params.output_kind`` or ``params.best_of`` gets what vLLM's params would say."""
        if name == "bad":  # TensorRT-LLM's name of bad_words, read back as its params hold it (None when none)
            return object.__getattribute__(self, "bad_words") or None
        defaults = VLLM_FIELDS_AT_NO_OP.get(name, TRTLLM_FIELDS_AT_NO_OP.get(name))
        if defaults is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            given = object.__getattribute__(self, "_vllm_fields")
        except AttributeError:  # not yet initialised (copy/pickle restore the slots one by one)
            given = {}
        return given.get(name, defaults[0])

    def __attrs_post_init__(self) -> None:
        check(is_finite(self.temperature) and self.temperature >= 0,
              "temperature", "a finite number >= 0 (0 = greedy)", self.temperature)
        check(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p)
        check(is_int(self.top_k) and self.top_k >= -1, "top_k", "an integer >= 1, or 0 / -1 for all tokens",
              self.top_k)
        _at_most_int64("top_k", self.top_k)
        check(self.seed is None or (is_int(self.seed) and 0 <= self.seed <= 2**63 - 1), "seed",
              "an integer in [0, 2**63 - 1] or None", self.seed)
        check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop",
              "a non-empty string or a list of them", self.stop)
        check_stop_sizes(self.stop)
        for i, text in enumerate(self.stop):  # decoded text is valid Unicode: a lone surrogate could never match
            check_text(f"stop[{i}]", text)
        check(isinstance(self.stop_token_ids, list) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids", "a list of token ids (integers >= 0)", self.stop_token_ids)
        # bounded as logit_bias and allowed_token_ids are: an id past int64 reached the vocabulary check only at
        # generate, so a SamplingParams built ahead held what no model takes
        huge = next((t for t in self.stop_token_ids if t > MAX_INT), None)
        if huge is not None:
            raise GenerationError(f"generate: stop_token_ids: expected token ids of at most 2**63 - 1, got "
                                  f"{int_text(huge)}")
        check(is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"an integer in [1, {MAX_N}]", self.n)
        check_logprobs(self.logprobs)
        check_logprobs(self.prompt_logprobs, "prompt_logprobs")
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "true or false", self.ignore_eos)
        check(is_number(self.repetition_penalty)
              and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
              f"a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 = off)",
              self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(is_number(value) and -2 <= value <= 2, name, "a number in [-2, 2] (0 = off)", value)
        most = MAX_INT if self.max_tokens is None else self.max_tokens
        check(is_int(self.min_tokens) and 0 <= self.min_tokens <= most, "min_tokens",
              f"an integer in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        check(is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1] (0 = off)", self.min_p)
        check(self.truncate_prompt_tokens is None or (is_int(self.truncate_prompt_tokens) and (
            self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)), "truncate_prompt_tokens",
              "an integer >= 1 (keep each prompt's last k tokens, k at most max_seq_len), -1 (max_seq_len: "
              "vLLM's max_model_len) or None (no cut)", self.truncate_prompt_tokens)
        _at_most_int64("truncate_prompt_tokens", self.truncate_prompt_tokens)

        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                     "detokenize"):
            check(isinstance(getattr(self, name), bool), name, "true or false", getattr(self, name))
        check(isinstance(self.logit_bias, dict)
              and all(is_int(t) and 0 <= t <= MAX_INT and is_number(b) and -MAX_BIAS <= b <= MAX_BIAS
                      for t, b in self.logit_bias.items()),
              "logit_bias", f"a mapping of token ids (integers >= 0) to numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}]",
              self.logit_bias)
        check(self.allowed_token_ids is None
              or (isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
                  and all(is_int(t) and 0 <= t <= MAX_INT for t in self.allowed_token_ids)),
              "allowed_token_ids", "a non-empty list of token ids (integers >= 0), or None for any",
              self.allowed_token_ids)
        check(isinstance(self.bad_words, list) and all(isinstance(w, str) and w.strip() for w in self.bad_words),
              "bad_words", "a list of non-empty strings", self.bad_words)
        for i, word in enumerate(self.bad_words):
            if len(word) > MAX_STOP_CHARS:
                raise GenerationError(f"generate: bad_words[{i}]: expected a string of at most {MAX_STOP_CHARS:,} "
                                      f"characters, got {len(word):,}")
            check_text(f"bad_words[{i}]", word)  # tokenized: a lone surrogate would reach the tokenizer
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "a StructuredOutputsParams (kvload.StructuredOutputsParams) or None",
              self.structured_outputs)
        if self.stop and not self.detokenize:  # vLLM's rule: stop strings are looked for in the text
            raise GenerationError("generate: stop: stop strings are matched on the text, and detokenize is false; "
                                  "use stop_token_ids, or detokenize=True")
        object.__setattr__(self, "_checked", self._contents())

    def _contents(self) -> tuple[Any, ...]:
        """What the mutable fields hold now, as a value to compare (:attr:`_checked`)."""
        allowed = None if self.allowed_token_ids is None else tuple(self.allowed_token_ids)
        return (tuple(self.stop), tuple(self.stop_token_ids), tuple(self.bad_words), allowed,
                tuple(self.logit_bias.items()))

    def recheck(self) -> None:
        """Check the fields again as the constructor checks them: a list or dict changed in place since
        (``params.stop.append("")``, vLLM's lists invite it) is refused naming the field, and what it holds is kept in
        its plain form (a numpy id appended as an int), in place, so the caller's reference to the list still reaches
        it. Every generate call runs this on the SamplingParams it is given, before anything runs. vLLM's no-op fields
        are looked at again too: one read back and changed in place (``params.logits_processors.append(fn)``) is
        refused, not run without it."""
        for name, value in self._vllm_fields.items():  # (empty unless a script spelled vLLM's defaults out)
            if not _asks_nothing(name, value, self.n):
                raise GenerationError(unknown_field(name))
        if self._contents() == self._checked:
            return
        checked = attrs.evolve(self)
        for name in ("stop", "stop_token_ids", "bad_words"):
            getattr(self, name)[:] = getattr(checked, name)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids[:] = checked.allowed_token_ids
        if any(type(t) is not int or type(b) not in (int, float) for t, b in self.logit_bias.items()):
            self.logit_bias.clear()
            self.logit_bias.update(checked.logit_bias)
        object.__setattr__(self, "_checked", checked._checked)

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's ``SamplingParams.clone``): its fields, ``logit_bias`` dict and structured outputs spec
        are the copy's own, so setting one (``copy.max_tokens = 8``) leaves the original alone."""
        return copy.deepcopy(self)

    @classmethod
    def from_optional(cls, **fields: Any) -> SamplingParams:
        """vLLM's ``SamplingParams.from_optional``: a field given as None takes kvload's default (where vLLM's
        defaults differ, kvload's: temperature 0, max_tokens 64), the others are checked as the constructor does.
        ``logit_bias`` as vLLM's takes it there: keys may be token ids written as text (JSON's ``{"50256": -100}``), and
        each bias is clamped to [-100, 100]."""
        bias = fields.get("logit_bias")
        if isinstance(bias, Mapping):
            check_logit_bias_count(len(bias))
            fields["logit_bias"] = {_token_key(t): max(-MAX_BIAS, min(MAX_BIAS, b)) if is_finite(b) else b
                                    for t, b in bias.items()}
        return cls(**{k: v for k, v in fields.items() if v is not None})

    @property
    def penalizes(self) -> bool:
        """Whether the logits change before temperature: a bias, a penalty, or ``min_tokens`` holding back the stop
        tokens."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0 or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words))

    @classmethod
    def _beam_step(cls, alternatives: int) -> SamplingParams:
        """One greedy token with its ``alternatives`` most likely next tokens: a beam search step, which needs
        2 x beam_width of them (up to 2 x MAX_N, past the MAX_LOGPROBS a caller may ask for)."""
        params = cls(max_tokens=1, ignore_eos=True, logprobs=0)
        object.__setattr__(params, "logprobs", alternatives)  # the one bypass of check_logprobs: not a user's value
        return params

    @property
    def max_new_tokens(self) -> int | None:
        """Alias of :attr:`max_tokens` (transformers' spelling)."""
        return self.max_tokens

    @property
    def greedy(self) -> bool:
        """Whether tokens are picked by argmax."""
        return self.temperature == 0

    def to_dict(self) -> dict[str, Any]:
        """Plain form (copies of the lists, JSON's string keys for ``logit_bias``), e.g. for JSON."""
        data = attrs.asdict(self)
        del data["_bad_words_token_ids"], data["_checked"], data["_vllm_fields"]  # derived or no-ops, not settings
        data["stop"], data["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        data["bad_words"] = list(self.bad_words)
        data["allowed_token_ids"] = None if self.allowed_token_ids is None else list(self.allowed_token_ids)
        data["logit_bias"] = {str(t): b for t, b in self.logit_bias.items()}  # JSON's keys are strings (OpenAI's)
        data["structured_outputs"] = None if self.structured_outputs is None else self.structured_outputs.to_dict()
        return data

    @classmethod
    def build(cls, params: SamplingParams | None, keywords: dict[str, Any],
              defaults: Mapping[str, Any] | None = None, sources: Mapping[str, str] | None = None) -> SamplingParams:
        """``params`` as given (vLLM's rule: an explicit SamplingParams is used as it is), or one built from keyword
        fields over ``defaults`` (the model's sampling defaults, ``SamplingDefaults.values``: a keyword wins); an
        unknown keyword or both forms is an error. ``sources``: where each default came from
        (``SamplingDefaults.sources``), so a refusal names the user's override_generation_config as theirs."""
        keywords = check_keywords(keywords)
        if params is not None:
            if not isinstance(params, SamplingParams):
                raise GenerationError(f"generate: sampling_params: expected a SamplingParams, got "
                                      f"{type(params).__name__}")
            if keywords:
                raise GenerationError(f"generate: pass sampling settings either as sampling_params or as keywords "
                                      f"({', '.join(sorted(keywords))}), not both")
            return params
        given = _given_fields(keywords)
        fields = {k: v for k, v in (defaults or {}).items() if k not in given}
        if is_int(fields.get("max_tokens")):  # a default length, not one the caller gave: said so, by its source
            _past_default_length(_plain_int(keywords.get("min_tokens", 0)), fields["max_tokens"],
                                 default_length_origin((sources or {}).get("max_tokens")))
        return cls(**fields, **keywords)


def default_length_origin(source: str | None) -> str:
    """Where a default ``max_tokens`` the caller did not give came from, as a refusal names it: the user's own
    ``override_generation_config`` (their setting, not the model's), else the model's generation_config.json."""
    if source == FROM_OVERRIDE:
        return "the default of this LLM's override_generation_config (its max_new_tokens; no max_tokens was given)"
    return "the model's default (its generation_config.json's max_new_tokens; no max_tokens was given)"


def _past_default_length(min_tokens: Any, length: int, origin: str) -> None:
    """Refuse ``min_tokens`` past a default ``length`` the caller did not give, naming that default (``origin``) and
    the keyword that raises it: "max_tokens=64" alone read as if max_tokens had been given."""
    if is_int(min_tokens) and min_tokens > length:
        raise GenerationError(f"generate: min_tokens: expected an integer in [0, max_tokens={length}], {origin}, "
                              f"got {min_tokens}; give max_tokens of at least {min_tokens} "
                              "(None: no cap but the context)")


#: vLLM's ``SamplingParams`` fields kvload does not have → what to do instead.
VLLM_FIELDS_NOT_TAKEN: dict[str, str] = {
    "best_of": "vLLM's V1 engine dropped it too; ask for n samples and keep the best by cumulative_logprob "
               "(with logprobs=0)",
    "guided_decoding": "vLLM's older name; pass structured_outputs=kvload.StructuredOutputsParams(...)",
    "logits_processors": "kvload runs no user code in its sampler; logit_bias, allowed_token_ids, bad_words and "
                         "structured_outputs shape the logits",
    "output_kind": "LLM.generate returns each prompt's final RequestOutput, as vLLM's LLM.generate does whatever "
                   "output_kind says; for deltas, LLM.generate_stream yields a TokenDelta per token",
    "extra_args": "kvload has no sampler plugins to read them",
    "logprob_token_ids": "kvload returns the top logprobs=k tokens (and the sampled one), not chosen ids; ask for "
                         "logprobs=20 and read the ids you need, or score a candidate with prompt_logprobs",
    **dict.fromkeys(("prompt_logprob_token_ids", "prompt_logprob_start"),
                    "kvload scores every prompt token with prompt_logprobs=k (its top k and the token itself)"),
    "flat_logprobs": "kvload's logprobs are vLLM's list of dicts of Logprob-like floats",
    "stream_interval": "LLM.generate_stream yields every token as it comes; batch the deltas yourself",
    "thinking_token_budget": "kvload does not bound a model's thinking; max_tokens bounds the whole reply",
    "repetition_detection": "kvload does not end a sample on repeated n-grams; repetition_penalty, "
                            "frequency_penalty and presence_penalty discourage repeats",
    "skip_reading_prefix_cache": "give the call its own salt= (LLM.generate(..., salt=...)): prompts under "
                                 "different salts share no cached blocks",
    **dict.fromkeys(("skip_clone", "routed_experts_prompt_start", "trace_decode_token_ids"),
                    "vLLM's internal or debugging field; kvload has none"),
}

#: vLLM's ``LLM.generate`` / ``LLM.chat`` arguments kvload does not take (None, which asks for nothing, is accepted by
#: ``kvload.LLM``'s own keywords where one exists: ``lora_request``) → what to do instead.
VLLM_CALL_ARGUMENTS_NOT_TAKEN: dict[str, str] = {
    "lora_request": "kvload serves the checkpoint's own weights, with no LoRA adapters; accepted: None",
    "tokenization_kwargs": "LLM.generate, chat and the pooling calls take its truncate_prompt_tokens; here give "
                           "truncate_prompt_tokens=k as a sampling field (kvload tokenizes with the tokenizer's "
                           "defaults)",
    "prompt_adapter_request": "kvload has no prompt adapters",
    "guided_options_request": "vLLM's older argument; pass SamplingParams(structured_outputs=...)",
    "mm_processor_kwargs": "kvload serves text-only models",
}


#: vLLM's ``SamplingParams`` fields kvload lacks → the values that ask for nothing there (vLLM's defaults): accepted
#: and dropped, so a script or config that spells the defaults out runs; any other value is refused
#: (:data:`VLLM_FIELDS_NOT_TAKEN`).
VLLM_FIELDS_AT_NO_OP: dict[str, tuple[Any, ...]] = {
    "best_of": (None,),  # and best_of == n: n drawn, the best n kept, is the n samples
    "guided_decoding": (None,),
    "logits_processors": (None, []),
    "extra_args": (None, {}),
    # vLLM's defaults of its newer fields: a script (or a dict of every field) spelling them out asks for nothing
    "flat_logprobs": (False,),
    "skip_clone": (False, True),  # whether vLLM may skip copying the params: nothing to skip here either way
    **dict.fromkeys(("stream_interval", "thinking_token_budget", "repetition_detection", "skip_reading_prefix_cache",
                     "logprob_token_ids", "prompt_logprob_token_ids", "prompt_logprob_start",
                     "trace_decode_token_ids"), (None,)),
    "routed_experts_prompt_start": (0,),
    # vLLM's LLM.generate sets FINAL_ONLY on every params itself: its default and FINAL_ONLY are what generate returns
    "output_kind": (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY),
}

#: TensorRT-LLM's ``SamplingParams`` fields (``tensorrt_llm/sampling_params.py``) kvload does not have → what to do
#: instead; its ``bad`` acts (it is kvload's ``bad_words``), and the fields both have (``best_of``) are vLLM's above.
_BEAM = "kvload's beam search is LLM.beam_search(prompts, BeamSearchParams(beam_width=k, length_penalty=...))"
TRTLLM_FIELDS_NOT_TAKEN: dict[str, str] = {
    "end_id": "kvload ends a sample at the model's EOS (its generation_config's eos_token_id) already; for another "
              "end token give stop_token_ids=[id] (with ignore_eos=True for it alone)",
    "pad_id": "kvload returns each sample's tokens unpadded",
    "bad_token_ids": "give logit_bias={id: -100} for each token never to generate, or bad_words=[...] for strings",
    "embedding_bias": "give logit_bias={token_id: bias}, a dict of the entries that are not 0",
    "logits_processor": "kvload runs no user code in its sampler; logit_bias, allowed_token_ids, bad_words and "
                        "structured_outputs shape the logits",
    "apply_batched_logits_processor": "kvload runs no user code in its sampler",
    "use_beam_search": _BEAM,
    **dict.fromkeys(("beam_search_diversity_rate", "length_penalty", "early_stopping", "beam_width_array"), _BEAM),
    **dict.fromkeys(("top_p_min", "top_p_reset_ids", "top_p_decay"), "kvload's top_p stays as given for every token"),
    "no_repeat_ngram_size": "kvload does not ban repeated n-grams; repetition_penalty, frequency_penalty and "
                            "presence_penalty discourage repeats",
    **dict.fromkeys(("return_context_logits", "return_generation_logits"),
                    "kvload returns log-probabilities, not logits: prompt_logprobs=k for the prompt's, logprobs=k for "
                    "each generated token's"),
    "return_log_probs": "TensorRT-LLM's older switch; give logprobs=k (0: the sampled token's alone)",
    "exclude_input_from_output": "kvload's outputs never hold the prompt: RequestOutput.prompt_token_ids does",
    "return_encoder_output": "kvload serves decoder-only models",
    "return_perf_metrics": "kvload records each request's admission, steps and end in its audit log",
    "additional_model_outputs": "kvload returns tokens, text and logprobs only",
    "lookahead_config": "kvload's speculative decoding is n-gram drafts, set on the LLM (max_draft_len=k)",
    "add_special_tokens": "kvload tokenizes a prompt with the tokenizer's special tokens; for other tokens give "
                          "TokensPrompt(prompt_token_ids=[...])",
}
#: TensorRT-LLM's fields kvload lacks → the values that ask for nothing (TensorRT-LLM's defaults): accepted and
#: dropped, as :data:`VLLM_FIELDS_AT_NO_OP`'s are; any other value is refused (:data:`TRTLLM_FIELDS_NOT_TAKEN`).
TRTLLM_FIELDS_AT_NO_OP: dict[str, tuple[Any, ...]] = {
    **dict.fromkeys(("end_id", "pad_id", "embedding_bias", "top_p_min", "top_p_reset_ids", "top_p_decay",
                     "beam_search_diversity_rate", "length_penalty", "early_stopping", "no_repeat_ngram_size",
                     "beam_width_array", "additional_model_outputs", "lookahead_config"), (None,)),
    **dict.fromkeys(("bad_token_ids", "logits_processor"), (None, [])),
    **dict.fromkeys(("apply_batched_logits_processor", "use_beam_search", "return_context_logits",
                     "return_generation_logits", "return_encoder_output", "return_perf_metrics", "return_log_probs"),
                    (False,)),
    **dict.fromkeys(("exclude_input_from_output", "add_special_tokens"), (True,)),
}


#: vLLM's ``LLM.generate`` / ``LLM.chat`` arguments kvload lacks → the values that ask for nothing (their defaults).
VLLM_CALL_ARGUMENTS_AT_NO_OP: dict[str, tuple[Any, ...]] = {
    **dict.fromkeys(("mm_processor_kwargs", "tokenization_kwargs"), (None, {})),
    **dict.fromkeys(("prompt_adapter_request", "guided_options_request"), (None,)),
}


def _asks_nothing(name: str, value: Any, n: Any) -> bool:
    """Whether vLLM's field ``name`` at ``value`` asks for nothing kvload does not do."""
    if name == "best_of" and is_int(value) and value == n:
        return True
    at_no_op = VLLM_FIELDS_AT_NO_OP.get(name, TRTLLM_FIELDS_AT_NO_OP.get(name, ()))
    # the type first: a numpy array's == is elementwise, and its truth raised a message naming no field
    return any(type(value) is type(v) and value == v for v in at_no_op)


def _known_keywords() -> set[str]:
    return {a.name for a in attrs.fields(SamplingParams) if a.init} | {"max_new_tokens"}


def _set_field(self: SamplingParams, name: str, value: Any) -> None:
    """``params.max_tokens = 256``: vLLM's SamplingParams is mutable and its examples set fields on the default params
    (``llm.get_default_sampling_params()``); the new value is checked with the others as the constructor checks it, and
    a bad one changes nothing."""
    name = "max_tokens" if name == "max_new_tokens" else name
    if name == "bad":  # TensorRT-LLM's name of bad_words (a string or a list), as the constructor takes it
        name, value = "bad_words", [value] if isinstance(value, str) else value
    if name not in _known_keywords():
        if _asks_nothing(name, value, self.n):  # vLLM's "not set", which the error below says is accepted
            # read back as set (__getattr__); a new dict, not written into: a shallow copy holds the same one
            object.__setattr__(self, "_vllm_fields", {**self._vllm_fields, name: value})
            return
        raise GenerationError(unknown_field(name))
    checked = attrs.evolve(self, **{name: value})  # the constructor's conversions (a stop string to a list) and checks
    for field in attrs.fields(SamplingParams):  # _bad_words_token_ids too: the executor derives it again each call
        if field.name != "_vllm_fields":  # not a setting the constructor rebuilds: kept as the caller set them
            object.__setattr__(self, field.name, getattr(checked, field.name))


SamplingParams.__setattr__ = _set_field  # type: ignore[method-assign,assignment]


def unknown_field(name: str) -> str:
    """The one-line error for a ``SamplingParams`` keyword that is not a field: vLLM's with what to do instead."""
    why = VLLM_FIELDS_NOT_TAKEN.get(name)
    if why is not None:
        taken = VLLM_FIELDS_AT_NO_OP.get(name)
        if taken is not None:  # what is accepted: vLLM's "not set"
            why += f"; accepted: {' or '.join(map(repr, taken))}" + (
                ", or n itself" if name == "best_of" else "") + ", which ask for nothing"
        return f"generate: {name}: vLLM's SamplingParams field, not kvload's: {why}"
    why = TRTLLM_FIELDS_NOT_TAKEN.get(name)
    if why is not None:
        taken = " or ".join(map(repr, TRTLLM_FIELDS_AT_NO_OP[name]))
        return f"generate: {name}: TensorRT-LLM's SamplingParams field, not kvload's: {why}; accepted: {taken}, " \
               "which ask for nothing"
    known = sorted(_known_keywords())
    return f"generate: unknown SamplingParams field {name!r}; fields are {', '.join(known)}{did_you_mean(name, known)}"


def check_keywords(keywords: Mapping[str, Any], arguments: Sequence[str] = ()) -> dict[str, Any]:
    """Sampling keywords given to a generate call (``llm.generate(p, max_tokens=8)``): each a SamplingParams field;
    vLLM's call arguments kvload does not take are named with what to do instead. The keywords, less vLLM's call
    arguments at their defaults (``mm_processor_kwargs=None``), which ask for nothing. ``arguments``: the call's
    own (``chat_template``), which an unknown name is compared with too (``chat_templte``)."""
    out = dict(keywords)
    for name in sorted(set(keywords) - _known_keywords()):
        value = keywords[name]
        if any(value == v and type(value) is type(v) for v in VLLM_CALL_ARGUMENTS_AT_NO_OP.get(name, ())):
            del out[name]  # vLLM's default for its argument: nothing asked
            continue
        if _asks_nothing(name, value, keywords.get("n", 1)):
            continue  # taken as the constructor takes it
        why = VLLM_CALL_ARGUMENTS_NOT_TAKEN.get(name) or VLLM_FIELDS_NOT_TAKEN.get(name)
        if why is not None:
            raise GenerationError(f"generate: {name}: vLLM's argument, not kvload's: {why}")
        if name in TRTLLM_FIELDS_NOT_TAKEN:
            raise GenerationError(unknown_field(name))
        known = sorted(_known_keywords())
        own = f"; the call's own arguments are {', '.join(arguments)}" if arguments else ""
        raise GenerationError(f"generate: unknown argument {name[:80]!r}; sampling fields are {', '.join(known)}{own}"
                              f"{did_you_mean(name, [*arguments, *known])}")
    return out


def _given_fields(keywords: Mapping[str, Any]) -> set[str]:
    """The SamplingParams fields keywords set (``max_new_tokens`` is ``max_tokens``)."""
    return {"max_tokens" if k == "max_new_tokens" else k for k in keywords}


def defaulted_fields(params: SamplingParams | None, keywords: Mapping[str, Any],
                     defaults: Mapping[str, Any]) -> frozenset[str]:
    """The fields :meth:`SamplingParams.build` takes from ``defaults`` (the model's) for these arguments: none for an
    explicit SamplingParams, else every default no keyword sets. Not the caller's choices, so a default greedy
    decoding leaves unused is no ``setting_ignored``."""
    if params is not None:
        return frozenset()
    return frozenset(set(defaults) - _given_fields(keywords))


def greedy_ignored(params: SamplingParams, n: int | None = None,
                   model_defaults: Collection[str] = ()) -> list[tuple[str, Any, str]]:
    """The settings greedy decoding ignores in ``params`` (``n``: samples asked for, default ``params.n``), each as
    (name, value, why); none when ``params`` samples. The Python API and ``kvload serve`` both report these as
    ``setting_ignored``, so a seed, nucleus or top-k the caller gave never silently does nothing. ``model_defaults``:
    fields that hold the model's sampling default (:func:`defaulted_fields`), not the caller's: not reported (the
    load's ``sampling_defaults_resolved`` event records them)."""
    if not params.greedy:
        return []
    n = params.n if n is None else n
    nothing = "temperature is 0 (greedy): nothing is sampled"
    asked = (("seed", params.seed, None, nothing), ("top_p", params.top_p, 1.0, nothing),
             ("top_k", max(params.top_k, 0), 0, nothing),  # -1 and 0 both mean every token
             ("min_p", params.min_p, 0.0, nothing),
             ("n", n, 1, "temperature is 0 (greedy): the samples are identical"))
    return [(name, value, why) for name, value, unset, why in asked if value != unset and name not in model_defaults]


def inert_settings(params: SamplingParams, has_tokenizer: bool,
                   eos_special: bool = True) -> list[tuple[str, Any, str]]:
    """The settings in ``params`` that can change nothing whatever the model does, each as (name, value, why): the
    text settings where there is no text or no stop string, ``min_tokens`` where nothing could end a sample early.
    Reported as ``setting_ignored`` beside :func:`greedy_ignored`'s, by the Python API and ``kvload serve``.
    ``eos_special``: every EOS id is a special token (``skip_special_tokens`` leaves its text out)."""
    out = []
    no_text = ("the model has no tokenizer: there is no text" if not has_tokenizer
               else "detokenize is false: there is no text" if not params.detokenize else None)
    # it keeps a stop string, and (vLLM's) the text of the stop token id or EOS that ended a sample: EOS shows only with
    # skip_special_tokens false (a special token decodes to nothing otherwise) and ends nothing under ignore_eos
    if params.include_stop_str_in_output:
        eos_silent = params.ignore_eos or (params.skip_special_tokens and eos_special)
        if not params.stop and not params.stop_token_ids and eos_silent:
            eos = "ends nothing (ignore_eos)" if params.ignore_eos else "decodes to nothing (skip_special_tokens)"
            out.append(("include_stop_str_in_output", True,
                        f"no stop strings or stop token ids, and EOS {eos}: there is no stop text to keep"))
        elif no_text is not None:
            out.append(("include_stop_str_in_output", True, no_text))
    if not params.skip_special_tokens and no_text is not None:
        out.append(("skip_special_tokens", False, no_text))
    if not params.spaces_between_special_tokens:
        if no_text is not None:
            out.append(("spaces_between_special_tokens", False, no_text))
        elif params.skip_special_tokens:
            out.append(("spaces_between_special_tokens", False,
                        "skip_special_tokens is true: no special token is in the text to be spaced"))
    if params.min_tokens and params.ignore_eos and not params.stop and not params.stop_token_ids:
        out.append(("min_tokens", params.min_tokens, "ignore_eos and no stop strings or ids: nothing could end a "
                                                     "sample before max_tokens"))
    return out


__all__ = ["DEFAULT_MAX_TOKENS", "TRTLLM_FIELDS_NOT_TAKEN", "VLLM_CALL_ARGUMENTS_NOT_TAKEN", "VLLM_FIELDS_NOT_TAKEN",
           "RequestOutputKind",
           "SamplingParams", "check",
           "check_keywords", "check_logit_bias_count", "check_logprobs", "check_salt",
           "check_stop_sizes", "check_stop_token_ids_count", "defaulted_fields", "greedy_ignored", "inert_settings",
           "is_finite", "is_int", "is_number", "unknown_field"]
