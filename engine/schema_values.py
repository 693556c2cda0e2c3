"""A JSON schema's ``const`` and ``enum`` values held to the keywords beside them, which xgrammar 0.2.9 passes over.

JSON Schema applies every keyword of a subschema: ``{"const": 1, "type": "string"}`` admits no value, and
``{"enum": ["a", 1], "type": "string"}`` or ``{"enum": [1, 10], "maximum": 6}`` admit only one. xgrammar matches a
subschema with ``const`` or ``enum`` by its values alone (``root ::= "1"`` for the first), so a sample held to it would
write a value the schema refuses. kvload refuses a ``const``, or an ``enum`` none of whose values, that the ``type``,
a length, number or size bound or ``required`` beside it excludes (:func:`contradictions`, "admits no value"), and
compiles an ``enum`` with such values taken out (:func:`keep_admitted_values`). A ``pattern`` beside them is not
checked (JSON Schema's regexes are ECMA-262's, not Python's). No xgrammar import here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from engine.schema_lengths import Path, _subschemas, path_text

#: JSON Schema's type names.
_TYPES = frozenset({"null", "boolean", "integer", "number", "string", "array", "object"})


def _kinds(node: Mapping[str, Any]) -> frozenset[str] | None:
    """The types ``node`` allows, or None when it gives none or one that is not a type name (xgrammar's to refuse)."""
    kind = node.get("type")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) and kind else None
    if kinds is None or not all(isinstance(k, str) and k in _TYPES for k in kinds):
        return None
    return frozenset(kinds)


def is_of(value: Any, kinds: frozenset[str]) -> bool:
    """Whether the JSON value ``value`` has one of the types ``kinds`` (JSON Schema's rules: ``true`` is no integer, a
    number without a fraction, ``1.0``, is one)."""
    if value is None:
        return "null" in kinds
    if isinstance(value, bool):
        return "boolean" in kinds
    if isinstance(value, int):
        return bool(kinds & {"integer", "number"})
    if isinstance(value, float):
        return "number" in kinds or ("integer" in kinds and value.is_integer())
    if isinstance(value, str):
        return "string" in kinds
    if isinstance(value, list):
        return "array" in kinds
    return isinstance(value, Mapping) and "object" in kinds


def _where(path: Path) -> str:
    """A subschema's path as the message names it: ``properties.a.items``, or "the schema" for the root."""
    if not path:
        return "the schema"
    return path_text(path).lstrip(".")


def _typed(kinds: frozenset[str]) -> str:
    return json.dumps(sorted(kinds)[0]) if len(kinds) == 1 else "any of " + json.dumps(sorted(kinds))


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: The bounds beside a ``const``/``enum`` that xgrammar passes over, checked here: (keyword, the JSON type of the
#: values it bounds, whether the bound is a count, the test a value fails, how the refusal words it).
_BOUNDS: tuple[tuple[str, type | tuple[type, ...], bool, Callable[[Any, Any], bool], str], ...] = (
    ("minLength", str, True, lambda v, b: len(v) < b, "is shorter than minLength"),
    ("maxLength", str, True, lambda v, b: len(v) > b, "is longer than maxLength"),
    ("minimum", (int, float), False, lambda v, b: v < b, "is below minimum"),
    ("maximum", (int, float), False, lambda v, b: v > b, "is above maximum"),
    ("exclusiveMinimum", (int, float), False, lambda v, b: v <= b, "is not above exclusiveMinimum"),
    ("exclusiveMaximum", (int, float), False, lambda v, b: v >= b, "is not below exclusiveMaximum"),
    ("minItems", list, True, lambda v, b: len(v) < b, "has fewer items than minItems"),
    ("maxItems", list, True, lambda v, b: len(v) > b, "has more items than maxItems"),
    ("minProperties", dict, True, lambda v, b: len(v) < b, "has fewer properties than minProperties"),
    ("maxProperties", dict, True, lambda v, b: len(v) > b, "has more properties than maxProperties"),
)


def refusal(value: Any, node: Mapping[str, Any]) -> str | None:
    """Why ``value`` (a ``const`` or ``enum`` value of ``node``) fails the keywords beside it that xgrammar passes over
    (``type``, the length, number and size bounds, ``required``), as "is not of type ..." or "is above maximum 6";
    None when it satisfies them (or a keyword is malformed: xgrammar's to refuse, or pass over)."""
    kinds = _kinds(node)
    if kinds is not None and not is_of(value, kinds):
        return f"is not of type {_typed(kinds)}"
    for key, applies_to, counts, fails, words in _BOUNDS:
        bound = node.get(key)
        if not (_count(bound) if counts else _number(bound)):
            continue
        if isinstance(value, applies_to) and not isinstance(value, bool) and fails(value, bound):
            return f"{words} {_short(bound)}"
    required = node.get("required")
    if isinstance(value, Mapping) and isinstance(required, list):
        missing = [name for name in required if isinstance(name, str) and name not in value]
        if missing:
            return f"lacks the required property {json.dumps(missing[0])}"
    return None


def contradictions(schema: Any) -> list[str]:
    """Each subschema of the parsed ``schema`` whose ``const``, or every value of whose ``enum``, fails the keywords
    beside it (:func:`refusal`), as a phrase naming where and why (in document order); [] for a schema without one."""
    out = []
    for path, node, _ in _subschemas(schema):
        if "const" in node:
            why = refusal(node["const"], node)
            if why is not None:
                out.append(f"{_where(path)}: const {_short(node['const'])} {why}")
        values = node.get("enum")
        if isinstance(values, list) and values:
            whys = [refusal(v, node) for v in values]
            if all(w is not None for w in whys):
                kinds = _kinds(node)
                if kinds is not None and not any(is_of(v, kinds) for v in values):
                    out.append(f"{_where(path)}: no value of enum {_short(values)} is of type {_typed(kinds)}")
                else:
                    out.append(f"{_where(path)}: no value of enum {_short(values)} satisfies the keywords beside it "
                               f"({_short(values[0])} {whys[0]})")
    return out


def keep_admitted_values(schema: Any) -> bool:
    """Take the ``enum`` values that fail the keywords beside them (:func:`refusal`) out of the parsed ``schema``, in
    place (an enum none of whose values passes is left, for :func:`contradictions`); whether any was taken."""
    changed = False
    for _, node, _ in _subschemas(schema):
        values = node.get("enum")
        if not isinstance(values, list):
            continue
        kept = [v for v in values if refusal(v, node) is None]
        if kept and len(kept) < len(values):
            node["enum"][:] = kept  # type: ignore[index]
            changed = True
    return changed


__all__ = ["contradictions", "is_of", "keep_admitted_values", "refusal"]
