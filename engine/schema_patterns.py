"""The repetition counts of a JSON schema's regular expressions, whose squares xgrammar 0.2.9's compile time follows.

xgrammar compiles a ``pattern`` (and a ``patternProperties`` name) of a JSON schema in time that grows with the square
of each ``{n}``, ``{n,}`` or ``{n,m}`` count in it, about 0.25 s per million for one character (``^.{1000}$``), three
times that for a choice of three (``(?:\\w|\\W|.){1000}``): ``^.{3000}$`` took 2.6 s, ``^a{50000}$`` 203 s, on the
thread that parses every request's body. (The same counts in a ``regex`` spec compile in milliseconds; nested counts,
``(.{1000}){1000}``, cost only their own squares.) :func:`pattern_cost` adds them up. No xgrammar import here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from engine.schema_lengths import Path, _subschemas

#: A ``{n}``, ``{n,}`` or ``{n,m}`` count (the text after an unescaped ``{`` outside a character class).
_COUNT = re.compile(r"(\d+)(?:,(\d*))?\}")


def counts(regex: str) -> Iterator[int]:
    """The largest number of each ``{n}``, ``{n,}`` or ``{n,m}`` in ``regex``, in order (escaped braces and braces in
    a character class are literal text, not counts)."""
    i, in_class = 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if regex[i + 1:i + 2] == "]":  # "[]...]": a leading ] is a member
                i += 1
        elif c == "{":
            m = _COUNT.match(regex, i + 1)
            if m:
                low, high = m.group(1), m.group(2) or ""
                yield max(int(low[:12]), int(high[:12] or 0))  # 12 digits at most: never a huge int()
                i = m.end()
                continue
        i += 1


def pattern_cost(schema: Any) -> tuple[int, Path, str, int]:
    """The sum of the squares of every count in the parsed ``schema``'s patterns (where xgrammar compiles them), with
    the path, the keyword and the count of the largest one (``((), "", 0)`` for none)."""
    total, largest = 0, ((), "", 0)
    for path, node, _ in _subschemas(schema):
        found = [("pattern", node["pattern"])] if isinstance(node.get("pattern"), str) else []
        names = node.get("patternProperties")
        if isinstance(names, dict):
            found += [(f"patternProperties[{name!r}]" if len(name) <= 40 else "patternProperties", name)
                      for name in names if isinstance(name, str)]
        for key, regex in found:
            for n in counts(regex):
                total += n * n
                if n > largest[2]:
                    largest = (path, key, n)
    return (total, *largest)


__all__ = ["counts", "pattern_cost"]
