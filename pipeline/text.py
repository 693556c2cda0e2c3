"""Plain-text reports: the one table renderer and the value formatters every report uses."""

from __future__ import annotations

import json
from typing import Any


def table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    """Left-aligned columns two spaces apart; the last column is not padded."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def literal(value: Any) -> str:
    """A value as JSON spells it (``"auto"``, ``true``, ``null``), so strings and booleans never blur."""
    return json.dumps(value, default=str)


def show(value: Any) -> str:
    """A value as a user would type it: true/false/null, strings bare."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    return json.dumps(value)


def cell(value: Any, spec: str = "{:,}") -> str:
    """A table cell: ``-`` for a missing value, numbers through ``spec`` (thousands separators), text as is."""
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return spec.format(value)
    return str(value)


__all__ = ["cell", "literal", "show", "table"]
