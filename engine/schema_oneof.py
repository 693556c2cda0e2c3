"""Whether xgrammar 0.2.9 holds a JSON-schema ``oneOf`` to exactly one branch: only when it proves them disjoint.

xgrammar matches ``oneOf`` as ``anyOf`` (any branch, one or more) and prints a C++ warning ("oneOf with overlapping or
non-provably-disjoint branches cannot be represented exactly; falling back to anyOf semantics") unless one of two
proofs holds: every branch is an object requiring one same property whose ``const``/``enum`` values differ between
branches (a discriminator), or every branch is either a ``const``/``enum`` or a bare ``type`` other than object
(annotations aside), pairwise disjoint (``integer`` and ``number`` overlap; two numbers not both integers may be
equal). :func:`proven_disjoint` is that decision, checked against xgrammar's warning in ``tests/test_schema_oneof.py``.
No xgrammar import here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

_TYPES = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})
_ANNOTATIONS = frozenset({"title", "default", "description", "examples", "deprecated", "readOnly", "writeOnly",
                          "$comment", "$schema"})
_NESTED = ("$ref", "anyOf", "allOf", "oneOf")
_INT64 = range(-(2**63), 2**63)


def proven_disjoint(options: Sequence[Any]) -> bool:
    """Whether xgrammar proves the ``oneOf`` branches ``options`` pairwise disjoint (and so enforces exactly one)."""
    return bool(options) and (_by_discriminator(options) or _by_type_or_values(options))


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)


def _is_int64(value: Any) -> bool:
    """An integer as xgrammar's JSON reader keeps one (past int64 it reads a double)."""
    return type(value) is int and value in _INT64


def _may_overlap(a: Any, b: Any) -> bool:
    """Whether the JSON values ``a`` and ``b`` may be the same value, as xgrammar judges it."""
    if _is_number(a) or _is_number(b):
        return _is_number(a) and _is_number(b) and (a == b if _is_int64(a) and _is_int64(b) else True)
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(_may_overlap, a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and len(a) == len(b) and all(
            key in b and _may_overlap(value, b[key]) for key, value in a.items())
    return a == b


def _values(schema: Mapping[str, Any]) -> list[Any] | None:
    """The values a ``const`` or a non-empty ``enum`` allows, or None."""
    if "const" in schema:
        return [schema["const"]]
    enum = schema.get("enum")
    return list(enum) if isinstance(enum, list) and enum else None


def _matches(value: Any, kind: str) -> bool:
    """Whether the JSON value is of the JSON-schema type ``kind``."""
    if kind == "integer":
        return _is_int64(value) or (type(value) is float and math.isfinite(value) and value.is_integer())
    return {"null": value is None, "boolean": isinstance(value, bool), "string": isinstance(value, str),
            "number": _is_number(value), "array": isinstance(value, list), "object": isinstance(value, dict)}[kind]


def _types(value: Any) -> set[str] | None:
    """The type set of a ``type`` (a name or a non-empty list of names xgrammar knows), or None."""
    names = [value] if isinstance(value, str) else value if isinstance(value, list) and value else None
    if names is None or not all(isinstance(n, str) and n in _TYPES for n in names):
        return None
    return set(names)


def _arm(option: Any) -> tuple[str, Any] | None:
    """A branch xgrammar can compare: ("values", its values) or ("types", its type set); None when it cannot."""
    if not isinstance(option, Mapping) or any(key in option for key in _NESTED):
        return None
    values = _values(option)
    if values is not None:
        return "values", values
    if "type" not in option or not set(option) - _ANNOTATIONS <= {"type"}:
        return None
    types = _types(option["type"])
    return None if types is None or "object" in types else ("types", types)


def _types_overlap(a: set[str], b: set[str]) -> bool:
    return bool(a & b) or bool(a & {"integer", "number"} and b & {"integer", "number"})


def _values_overlap(a: list[Any], b: list[Any]) -> bool:
    return any(_may_overlap(x, y) for x in a for y in b)


def _values_overlap_types(values: list[Any], types: set[str]) -> bool:
    return any((_is_number(v) and types & {"integer", "number"}) or any(_matches(v, t) for t in types)
               for v in values)


def _disjoint(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
    if a[0] == b[0] == "types":
        return not _types_overlap(a[1], b[1])
    if a[0] == b[0] == "values":
        return not _values_overlap(a[1], b[1])
    values, types = (a[1], b[1]) if a[0] == "values" else (b[1], a[1])
    return not _values_overlap_types(values, types)


def _by_type_or_values(options: Sequence[Any]) -> bool:
    arms = [_arm(option) for option in options]
    if any(arm is None for arm in arms):
        return False
    return all(_disjoint(arms[i], arms[j]) for i in range(len(arms)) for j in range(i + 1, len(arms)))


def _required_values(option: Any, key: str) -> list[Any] | None:
    """The values an object branch allows its required property ``key`` (a discriminator), or None."""
    if not isinstance(option, Mapping) or any(k in option for k in _NESTED) or option.get("type") != "object":
        return None
    required, properties = option.get("required"), option.get("properties")
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required) or key not in required:
        return None
    if not isinstance(properties, Mapping) or not isinstance(properties.get(key), Mapping):
        return None
    return _values(properties[key])


def _by_discriminator(options: Sequence[Any]) -> bool:
    first = options[0]
    if not isinstance(first, Mapping):
        return False
    required, properties = first.get("required"), first.get("properties")
    if not isinstance(required, list) or not isinstance(properties, Mapping):
        return False
    for key in required:
        if not isinstance(key, str) or not isinstance(properties.get(key), Mapping) \
                or _values(properties[key]) is None:
            continue
        values = [_required_values(option, key) for option in options]
        if any(v is None for v in values):
            continue
        if not any(_values_overlap(values[i], values[j])
                   for i in range(len(values)) for j in range(i + 1, len(values))):
            return True
    return False


__all__ = ["proven_disjoint"]
