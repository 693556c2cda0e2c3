"""JSON-schema keyword values of the wrong shape that xgrammar 0.2.9 refuses in its C++ words or takes silently.

``"required": [1]``, ``"pattern": 5`` and ``"format": 5`` were refused as ``"type mismatch! call is<type>() before
get<type>()" && is<std::string>()``, naming neither the keyword nor where it stands; ``"type": []`` (JSON Schema
asks for at least one type) was compiled as any JSON value. :func:`misshapen` names each by its path. No xgrammar
import here.
"""

from __future__ import annotations

from typing import Any

from engine.schema_lengths import Path, _subschemas


def misshapen(schema: Any) -> list[tuple[Path, str, Any, str]]:
    """Each keyword of the parsed ``schema`` (where xgrammar compiles it) whose value has the wrong shape: (the path
    to its subschema, the keyword, its value, what is accepted), in document order."""
    out = []
    for path, node, _ in _subschemas(schema):
        required = node.get("required")
        if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
            out.append((path, "required", required, "a list of property names (strings)"))
        for key, what in (("pattern", "a regular expression (a string)"), ("format", "a format name (a string)")):
            if key in node and not isinstance(node[key], str):
                out.append((path, key, node[key], what))
        if node.get("type") == []:
            out.append((path, "type", [], "a type name or a non-empty list of them"))
    return out


__all__ = ["misshapen"]
