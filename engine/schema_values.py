"""A JSON schema's ``const`` and ``enum`` values held to the ``type`` beside them, which xgrammar 0.2.9 passes over.

JSON Schema applies every keyword of a subschema: ``{"const": 1, "type": "string"}`` admits no value, and
``{"enum": ["a", 1], "type": "string"}`` admits only ``"a"``. xgrammar matches a subschema with ``const`` or ``enum``
by its values alone (``root ::= "1"`` for the first), so a sample held to it would write a value the schema refuses.
kvload refuses a ``const`` or an ``enum`` none of whose values has the type (:func:`contradictions`, "admits no value")
and compiles an ``enum`` with the values of other types taken out (:func:`keep_typed_values`). No xgrammar import here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engine.schema_lengths import Path, _subschemas

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
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _typed(kinds: frozenset[str]) -> str:
    return json.dumps(sorted(kinds)[0]) if len(kinds) == 1 else "any of " + json.dumps(sorted(kinds))


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def contradictions(schema: Any) -> list[str]:
    """Each subschema of the parsed ``schema`` whose ``const``, or every value of whose ``enum``, is not of the
    ``type`` beside it, as a phrase naming where and what (in document order); [] for a schema without one."""
    out = []
    for path, node, _ in _subschemas(schema):
        kinds = _kinds(node)
        if kinds is None:
            continue
        if "const" in node and not is_of(node["const"], kinds):
            out.append(f"{_where(path)}: const {_short(node['const'])} is not of type {_typed(kinds)}")
        values = node.get("enum")
        if isinstance(values, list) and values and not any(is_of(v, kinds) for v in values):
            out.append(f"{_where(path)}: no value of enum {_short(values)} is of type {_typed(kinds)}")
    return out


def keep_typed_values(schema: Any) -> bool:
    """Take the ``enum`` values that are not of the ``type`` beside them out of the parsed ``schema``, in place (an
    enum none of whose values has the type is left, for :func:`contradictions`); whether any was taken."""
    changed = False
    for _, node, _ in _subschemas(schema):
        kinds = _kinds(node)
        values = node.get("enum")
        if kinds is None or not isinstance(values, list):
            continue
        kept = [v for v in values if is_of(v, kinds)]
        if kept and len(kept) < len(values):
            node["enum"][:] = kept  # type: ignore[index]
            changed = True
    return changed


__all__ = ["contradictions", "is_of", "keep_typed_values"]
