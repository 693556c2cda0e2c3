"""Plain-text reports: the one table renderer and the value formatters every report uses."""

from __future__ import annotations

import json
from typing import Any

#: Control characters (C0, DEL, C1) as their escapes: a path holding a newline split a one-line message in two, and an
#: escape sequence in a file name (or in an audit file's text, which anyone may have written) reached the terminal.
#: U+2028 and U+2029 too: str.splitlines, JSON viewers and log shippers break a line there (a config key holding one).
_CONTROL_ESCAPES = {c: repr(chr(c))[1:-1] if c < 0xA0 else f"\\u{c:04x}"
                    for c in (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029)}


def one_line(text: str) -> str:
    """``text`` with control characters written as escapes (``\\n``, ``\\x1b``): one line, printable."""
    return text.translate(_CONTROL_ESCAPES)


def table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    """Left-aligned columns two spaces apart; the last column is not padded; each cell stays on its line."""
    rows = [[one_line(c) for c in r] for r in rows]
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


__all__ = ["cell", "literal", "one_line", "show", "table"]
