"""A JSON schema's ``$ref``s that point outside it, which xgrammar 0.2.9 does not resolve.

xgrammar follows ``#`` and ``#/...`` only; any other reference (``other.json#/x``, ``https://...``, an anchor
``#name``) it compiles as "any JSON value", printing a C++ warning line on the terminal each time it compiles it.
kvload fetches nothing, so such a reference is refused by name (:func:`foreign_refs`) rather than held to nothing.
No xgrammar import here.
"""

from __future__ import annotations

from typing import Any

from engine.schema_lengths import Path, _subschemas

#: What the refusal says after the field's name (kvload serve finds the tool it is about by it too).
OUTSIDE = "is not a JSON-pointer reference into the schema"


def is_local(ref: str) -> bool:
    """Whether xgrammar resolves the ``$ref`` ``ref``: the schema itself (``#``) or a JSON pointer into it."""
    return ref == "#" or ref.startswith("#/")


def foreign_refs(schema: Any) -> list[tuple[Path, str]]:
    """Each ``$ref`` of the parsed ``schema`` (where xgrammar compiles it) that is a string xgrammar does not resolve,
    with the path to its subschema, in document order."""
    return [(path, node["$ref"]) for path, node, _ in _subschemas(schema)
            if isinstance(node.get("$ref"), str) and not is_local(node["$ref"])]


__all__ = ["OUTSIDE", "foreign_refs", "is_local"]
