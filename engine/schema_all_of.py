"""JSON-schema ``allOf``s of more than one schema, which xgrammar 0.2.9 turns into "any JSON value".

xgrammar holds an ``allOf`` of one schema to it; one of two or more it compiles as any JSON value, dropping the
``type``, ``properties`` and every other keyword beside it too (``{"type": "object", "allOf": [A, B]}`` lets a reply
be ``7``), printing only a C++ warning ("Support for allOf with multiple options is still ongoing"). kvload refuses
such an ``allOf`` by its path (:func:`unmerged_all_of`) rather than let the schema hold nothing. No xgrammar import
here.
"""

from __future__ import annotations

from typing import Any

from engine.schema_lengths import Path, _subschemas


def unmerged_all_of(schema: Any) -> list[tuple[Path, int]]:
    """Each subschema of the parsed ``schema`` (where xgrammar compiles it) whose ``allOf`` lists more than one
    schema, with its path and how many, in document order."""
    return [(path, len(node["allOf"])) for path, node, _ in _subschemas(schema)
            if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1]


__all__ = ["unmerged_all_of"]
