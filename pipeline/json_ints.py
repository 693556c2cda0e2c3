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


class Abandoned(Exception):
    """A parse :class:`SharedInts` ended because the one who wanted it is gone."""


class SharedInts(LongInts):
    """:class:`LongInts` that hands out one ``int`` object per value under 2**18 (every token id of every vocabulary
    served) for the whole document, and ends the parse with :class:`Abandoned` at its next integer once ``gone.left``
    is true (``gone``, when given: an object another thread sets that on).

    ``json.loads`` made a fresh 28-byte int per literal, so a parsed list of token ids held 36 bytes per id against
    ~7 in its JSON: 20 MB of ids became 103 MB, held while the request waited for its turn. Shared, an id costs the
    list's 8-byte pointer (~1.3x the JSON), and the parse runs ~1.5x faster (a list index, not an allocation). The
    table (2 MiB) lives for one parse."""

    __slots__ = ("_gone", "_table")

    SIZE = 1 << 18

    def __init__(self, gone: Any = None) -> None:
        super().__init__()
        self._gone = gone if gone is not None else _Never
        self._table: list[int | None] = [None] * self.SIZE

    def __call__(self, text: str) -> int | TooLongInt:
        if self._gone.left:
            raise Abandoned("the parse is no longer wanted")
        if len(text) <= 6:  # within the digit limit (at least 640, when set)
            value = int(text)
            if 0 <= value < self.SIZE:
                shared = self._table[value]
                if shared is None:
                    self._table[value] = value
                    return value
                return shared
            return value
        return super().__call__(text)


class _Never:
    left = False


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
