"""Flag value types: the text-layer parsers argparse calls (``type=``), each refusing bad text in one line."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from pipeline.config import SIZE_HELP, parse_size
from pipeline.limits import MAX_INT, MAX_INT_DIGITS, short_text

# --- text-layer value parsers (argparse `type=`) ---------------------------------------------


def tri_state(text: str) -> bool | str:
    """``auto`` | ``true`` | ``false`` → ``"auto"`` | True | False."""
    word = text.strip().lower()
    if word == "auto":
        return "auto"
    if word in ("true", "false"):
        return word == "true"
    raise argparse.ArgumentTypeError(f"expected auto, true or false, got {text!r}")


class _TooBig(argparse.ArgumentTypeError):
    """An integer past 2**63 - 1: a flag with a smaller range of its own says that range instead."""


#: YAML 1.2 core's octal and hex integers (``0o17``, ``0x1F``, signed), as a ``--config`` file reads them
#: (``pipeline.sources``): ``max_batch_size: 0x40`` was 64 in the file where ``--max_batch_size 0x40`` was refused
_RADIX = re.compile(r"([-+]?)0(?:o([0-7]+)|x([0-9a-fA-F]+))")


def _radix(text: str) -> int | None:
    """The integer a YAML 1.2 octal or hex number stands for, or None for other text."""
    match = _RADIX.fullmatch(text)
    if match is None:
        return None
    sign, octal, hexa = match.groups()
    if len(octal or hexa) > MAX_INT_DIGITS:  # as a decimal one: such a number is refused, not converted
        raise ValueError(text)
    value = int(octal, 8) if octal else int(hexa, 16)
    return -value if sign == "-" else value


def _whole(text: str) -> int:
    """``text`` as a whole number, unbounded; ``argparse.ArgumentTypeError`` when it is none."""
    digits = text.strip()
    if not digits.isascii():  # int() reads any script's digits ('٣٣', '１６'), where a YAML config reads a string
        raise argparse.ArgumentTypeError(f"expected an integer in the digits 0-9, got {short_text(text)}")
    try:
        radix = _radix(digits)
        if radix is not None:
            return radix
        if len(digits.lstrip("+-").replace("_", "")) > MAX_INT_DIGITS:  # never hand int() a 5,000-digit string
            raise ValueError(text)
        # int() itself, not int() of the text without its underscores: that read "_10", "1__0" and "10_" as 10, where
        # the same value in a config file was refused as a string
        return int(digits)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {short_text(text)}") from None


def integer(text: str) -> int:
    """A whole number (``1_000`` allowed, an underscore between two digits, Python's rule and a YAML config's; ``0o``
    octal and ``0x`` hex, a YAML config's too), at most 2**63 - 1 in size (what torch and the budget arithmetic
    take)."""
    value = _whole(text)
    if abs(value) > MAX_INT:
        raise _TooBig(f"expected an integer of at most 2**63 - 1, got {short_text(text)}")
    return value


def field_integer(text: str) -> int:
    """An integer for a flag that sets an LlmArgs field: the field's own check bounds it (at most 2**63 - 1, or its
    range), so --max_draft_len 99999999999999999999999 gets the verdict --max_draft_len 65 and a config file get
    ("from 0 to 64"), not "at most 2**63 - 1"."""
    try:
        return integer(text)
    except _TooBig:
        return _whole(text)  # integer() checked the digits: 0-9, at most MAX_INT_DIGITS


#: vLLM's suffixes of a token count (``human_readable_int``): lowercase decimal, uppercase binary
_DECIMAL_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIX = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def token_count(text: str) -> int:
    """A token count as vLLM's ``--max-model-len`` and ``--max-num-batched-tokens`` take it: an integer, or one with
    vLLM's suffix, ``32k`` (32,000: decimal, a decimal point allowed, ``25.6k``) or ``32K`` (32,768: binary, whole
    numbers only), so a copied launch line means what it meant there."""
    stripped = text.strip()
    suffix = stripped[-1:]
    if suffix in _DECIMAL_SUFFIX or suffix in _BINARY_SUFFIX:
        digits = stripped[:-1]
        whole = digits.isascii() and digits.isdigit() and len(digits) <= MAX_INT_DIGITS
        decimal = digits.count(".") == 1 and digits.replace(".", "", 1).isdigit() and digits.isascii() \
            and len(digits) <= MAX_INT_DIGITS and not digits.startswith(".") and not digits.endswith(".")
        if suffix in _DECIMAL_SUFFIX and (whole or decimal):
            return field_integer(str(int(Decimal(digits) * _DECIMAL_SUFFIX[suffix])))
        if suffix in _BINARY_SUFFIX and whole:
            return field_integer(str(int(digits) * _BINARY_SUFFIX[suffix]))
        if suffix in _BINARY_SUFFIX and decimal:
            raise argparse.ArgumentTypeError(f"a binary suffix ({suffix}) takes a whole number, got {short_text(text)}"
                                             f" (vLLM's rule; {digits}{suffix.lower()} is decimal)")
    return field_integer(text)


def token_count_or_auto(text: str) -> int | str:
    """``--max-model-len``: a :func:`token_count`, or ``auto`` / ``-1`` (vLLM's: the longest sequence the KV cache
    holds, at most the checkpoint's), taken as ``"auto"``."""
    if text.strip().lower() == "auto" or text.strip() == "-1":
        return "auto"
    return token_count(text)


def number(text: str) -> float:
    """A finite decimal number (``inf``, ``nan`` and overflowing exponents such as ``1e400`` refused)."""
    if not text.strip().isascii():  # float() reads any script's digits ('０.５'), as int() does
        raise argparse.ArgumentTypeError(f"expected a number in the digits 0-9, got {short_text(text)}")
    try:
        radix = _radix(text.strip())
        value = float(text) if radix is None else float(radix)  # a YAML config reads 0x1 as a number too
    except OverflowError:  # a hex integer past float's range, as float("1e400") is
        value = math.inf
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {short_text(text)}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {short_text(text)}")
    return value


def size(text: str) -> int:
    """A byte count: ``8589934592``, ``8GiB`` (= ``8G``), ``512MB`` (at most 2**63 - 1)."""
    try:
        radix = _radix(text.strip())  # a YAML config's 0o/0x integers, as a byte-count field there reads them
        if radix is not None and 0 <= radix <= MAX_INT:
            return radix
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {SIZE_HELP} (at most 2**63 - 1), got {short_text(text)}") from None


def json_or_text(text: str) -> Any:
    """A value as vLLM's parser reads a dotted flag's: JSON, else a token count (``80k``), else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return token_count(text)
    except (ValueError, argparse.ArgumentTypeError):
        return text


def json_object(text: str) -> dict[str, Any]:
    """A JSON object (``'{"temperature": 0.5}'``): standard JSON only (no NaN), each key once."""
    return _json_object(text, "")


def json_object_like(example: str) -> Callable[[str], dict[str, Any]]:
    """:func:`json_object` for a flag whose refusal shows ``example``, a value it takes."""
    return lambda text: _json_object(text, f" such as '{example}'")


#: What a JSON value that is no object is, in JSON's words
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false"}


def _json_object(text: str, such: str) -> dict[str, Any]:
    from pipeline.limits import unique_keys

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not standard JSON")

    twice = unique_keys(lambda message: argparse.ArgumentTypeError(f"{message}; keep one"))
    # the reason goes with the refusal: '{"top_k": <5,000 digits>}' and 100,000 nested objects were "expected a JSON
    # object, got '{...'", which they are; and every flag's example was the sampling one, --speculative-config's too
    try:
        value = json.loads(text, object_pairs_hook=twice, parse_constant=constant)
    except json.JSONDecodeError as exc:
        why = f"not JSON ({exc.msg} at column {exc.colno})"
    except RecursionError:
        why = "nested too deeply"
    except ValueError as exc:  # NaN, an integer literal past Python's digit limit
        why = (f"an integer of more than {sys.get_int_max_str_digits():,} digits"
               if "integer string conversion" in str(exc) else str(exc))
    else:
        if isinstance(value, dict):
            return value
        why = f"that is {'null' if value is None else _JSON_KINDS[type(value)]}, not an object"
    raise argparse.ArgumentTypeError(f"expected a JSON object{such}, got {short_text(text)}: {why}")


def token_ids(text: str) -> list[int]:
    """``1,2,3`` or ``"1 2 3"`` → ``[1, 2, 3]``."""
    parts = text.split(",") if "," in text else text.split()
    parts = [p.strip() for p in parts]
    # an empty item (1,,3) is a typo, not a skip; str.isdigit() is true of '²' and '①', which int() refuses (argparse
    # then said "invalid token_ids value"), and of other scripts' digits; a 5,000-digit id int() refuses too
    if not parts or not all(p.isascii() and p.isdigit() and len(p) <= MAX_INT_DIGITS for p in parts):
        raise argparse.ArgumentTypeError(f"expected token ids such as 1,2,3 (the digits 0-9), got {short_text(text)}")
    return [int(p) for p in parts]


def _bounded(kind: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except _TooBig:
            if ok(MAX_INT):  # the range reaches 2**63 - 1: that is the bound the value passed
                raise
            # --n 99999999999999999999999 was "expected an integer of at most 2**63 - 1", where --n 200 was
            # "expected an integer in [1, 128]": true, but not what the flag accepts
            raise argparse.ArgumentTypeError(f"expected {expected}, got {short_text(text)}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


def at_least(least: int) -> Callable[[str], int]:
    """An integer flag's type: a whole number >= ``least`` (and at most 2**63 - 1, as :func:`integer`), refused as
    "expected an integer >= N"; the one check every count or seed flag had written out."""
    return _bounded(integer, lambda v: v >= least, f"an integer >= {least}")


def workload_arg(text: str) -> tuple[str, int]:
    """``KEY=INT`` → (key, int)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=INTEGER, got {text!r}")
    return key.strip(), integer(value)
