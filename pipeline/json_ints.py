"""JSON integer literals past Python's digit limit, located so a refusal can name the field that holds one.

``json.loads`` hands each integer literal to ``int()``, which refuses one of more than
``sys.get_int_max_str_digits()`` digits (4,300) with a ``ValueError`` whose text advises
``sys.set_int_max_str_digits()``; a message built from it named no field and was cut mid-word.
:class:`LongInts` as ``parse_int`` keeps such a literal as a :class:`TooLongInt` marker instead, and
:func:`too_long_int` finds the first one's path in the parsed document.
"""

from __future__ import annotations

import sys
from typing import Any

import attrs


@attrs.frozen
class TooLongInt:
    """An integer literal of more digits than Python converts, kept as its digit count."""

    digits: int


def digit_limit() -> int:
    """Most digits ``int()`` converts from text (0: no limit)."""
    return sys.get_int_max_str_digits()


class LongInts:
    """``json.loads``'s ``parse_int``: ``int`` for a literal within the limit, a :class:`TooLongInt` past it."""

    def __init__(self) -> None:
        self.found = False

    def __call__(self, text: str) -> int | TooLongInt:
        limit = digit_limit()
        digits = len(text) - text.startswith("-")
        if limit and digits > limit:
            self.found = True
            return TooLongInt(digits)
        return int(text)


def _join(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    key = str(key) if len(str(key)) <= 60 else f"{str(key)[:57]}..."  # a 1 MB key is named, not quoted whole
    return f"{path}.{key}" if path else key


def too_long_int(tree: Any, path: str = "") -> tuple[str, int] | None:
    """``(path, digits)`` of the first :class:`TooLongInt` in ``tree`` (``a.b[0]``; ``path`` prefixes it), or
    None; also finds a Python ``int`` too long to write as text (a schema given as a dict; digits 0)."""
    limit = digit_limit()
    # about 3.32 bits a digit: an int of fewer bits than limit * 3.3 has fewer digits than the limit
    stack: list[tuple[str, Any]] = [(path, tree)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, TooLongInt):
            return where, node.digits
        if limit and isinstance(node, int) and not isinstance(node, bool) and node.bit_length() > limit * 3.3:
            try:
                str(node)
            except ValueError:  # past the limit; its exact digit count would take the conversion refused
                return where, 0
        elif isinstance(node, dict):
            stack.extend((_join(where, k), v) for k, v in reversed(list(node.items())))
        elif isinstance(node, (list, tuple)):
            stack.extend((_join(where, i), v) for i, v in reversed(list(enumerate(node))))
    return None


def too_long_message(digits: int) -> str:
    """The refusal's reason, after the field's name (``digits`` 0: a count not known, past the limit)."""
    count = f"{digits:,}" if digits else f"more than {digit_limit():,}"
    return f"an integer of {count} digits; at most {digit_limit():,} digits are accepted"
