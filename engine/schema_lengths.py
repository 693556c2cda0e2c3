"""JSON-schema string length bounds that xgrammar 0.2.9 drops: found, to be reported, and taken out before it compiles.

xgrammar matches a ``"type": "string"`` with a ``pattern``, or with a ``format`` it knows (:data:`XGRAMMAR_FORMATS`),
by the pattern or format alone: its ``minLength`` and ``maxLength`` act on nothing (xgrammar says so only in a C++ line
on stderr, ``... combined with minLength/maxLength is not supported; ignoring minLength/maxLength``). kvload reports
each such bound as ``setting_ignored`` (:func:`ignored_lengths`) and compiles the schema without it
(:func:`without_dropped_lengths`): the same grammar, and no line on the user's terminal. No xgrammar import here.

Only what xgrammar itself drops is named: bounds it refuses (not integers, past int32, ``minLength`` above
``maxLength``) are left for its refusal; a string with ``enum``, ``const``, ``anyOf``, ``oneOf``, ``allOf`` or
``$ref`` is matched by those instead (no warning, nothing taken out); ``maxLength: -1`` and ``minLength: 0`` bound
nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import unquote

from pipeline.limits import short

#: The string formats xgrammar 0.2.9 compiles; any other ``format`` is passed over and the length bounds then act.
XGRAMMAR_FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
                              "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
#: Where a subschema stands, by key: its shape (``one`` subschema, a ``list`` of them, an object of ``named`` ones)
#: and the type the key goes with (``None``: any; a schema without a type takes every one).
_PLACES = {"properties": ("named", "object"), "patternProperties": ("named", "object"),
           "additionalProperties": ("one", "object"), "unevaluatedProperties": ("one", "object"),
           "propertyNames": ("one", "object"), "items": ("one", "array"), "unevaluatedItems": ("one", "array"),
           "prefixItems": ("list", "array"), "anyOf": ("list", None), "oneOf": ("list", None), "allOf": ("list", None),
           "$defs": ("named", None), "definitions": ("named", None)}
#: Keys that, beside ``"type": "string"``, decide what xgrammar matches (its string rule is not used).
_BEFORE_STRING = ("enum", "const", "anyOf", "oneOf", "allOf", "$ref")
_INT32_MIN, _INT32_MAX, _INT64_MIN, _INT64_MAX = -(2**31), 2**31 - 1, -(2**63), 2**63 - 1
#: What each bound is when it bounds nothing (xgrammar's own "not given").
_UNBOUNDED = {"minLength": 0, "maxLength": -1}

#: A path to a subschema: keys and list indices from the schema's root.
Path = tuple[str | int, ...]


def dropped_lengths(schema: Any) -> list[tuple[Path, str, int, str]]:
    """Each bound xgrammar drops in ``schema`` (a parsed JSON schema): (the path to its subschema, ``"minLength"`` or
    ``"maxLength"``, its value, why), in document order."""
    out = []
    for path, node, names in _subschemas(schema):
        why = _why_dropped(node, names)
        if why is not None:
            out += [(path, key, node[key], why) for key, unbounded in _UNBOUNDED.items()
                    if node.get(key, unbounded) != unbounded]
    return out


#: Characters of JSON a ``setting_ignored`` value keeps; a longer one is summarized (:func:`shown`).
MAX_SHOWN_CHARS = 200


def path_text(path: Path) -> str:
    """A JSON path as messages write it after a field: ``.properties.code[0]`` (strip the dot where nothing
    precedes it)."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def named(field: str, entries: Iterable[tuple[Path, str, Any, str]]) -> list[tuple[str, Any, str]]:
    """``(path, key, value, why)`` entries as ``setting_ignored`` ones (name, :func:`shown` value, why), each named by
    its JSON path under ``field`` (``structured_outputs.json.properties.code.maxLength``)."""
    return [(field + path_text((*path, key)), shown(value), why) for path, key, value, why in entries]


def shown(value: Any) -> Any:
    """A keyword's value as its ``setting_ignored`` record carries it: as given when its JSON is at most
    :data:`MAX_SHOWN_CHARS` characters, else a string cut to them or a container summarized ("a mapping of 3 keys").
    A ``not`` or ``oneOf`` holds a whole subschema: each request's record (and the server's log line) carried up to
    100,000 characters a client chose, and the server's audit keeps 100,000 records; the path names it already."""
    if isinstance(value, str):
        return value if len(value) <= MAX_SHOWN_CHARS else value[:MAX_SHOWN_CHARS - 3] + "..."
    if len(json.dumps(value, default=str)) <= MAX_SHOWN_CHARS:
        return value
    return short(value)


def ignored_lengths(schema: Any, field: str) -> list[tuple[str, int, str]]:
    """The bounds xgrammar drops in ``schema`` as ``setting_ignored`` entries (name, value, why), named by
    :func:`named`."""
    return named(field, dropped_lengths(schema))


def edited(spec: str, edit: Callable[[Any], bool]) -> str:
    """The JSON schema text ``spec`` after ``edit`` changed its parsed schema in place (``edit`` says whether it
    changed anything), or ``spec`` itself when nothing changed, it is not JSON (refused by xgrammar in its own words)
    or it no longer writes as JSON."""
    try:
        schema = json.loads(spec)
    except (ValueError, RecursionError):
        return spec
    if not edit(schema):
        return spec
    try:
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except ValueError:  # a number past a float (1e999) reads back as infinity: left as written, warning and all
        return spec


def drop_lengths(schema: Any) -> bool:
    """Take the bounds xgrammar drops out of the parsed ``schema``; whether there were any."""
    dropped = dropped_lengths(schema)
    for path, key, _, _ in dropped:
        node = schema
        for step in path:
            node = node[step]
        del node[key]
    return bool(dropped)


def without_dropped_lengths(spec: str) -> str:
    """The JSON schema text ``spec`` with the bounds xgrammar drops taken out (the grammar it compiles is the same;
    it no longer prints its warning), or ``spec`` itself when it has none."""
    if "Length" not in spec:  # neither minLength nor maxLength: the common case, not parsed
        return spec
    return edited(spec, drop_lengths)


def _subschemas(schema: Any) -> Iterator[tuple[Path, Mapping[str, Any], bool]]:
    """Every subschema xgrammar compiles, with its path and whether it names property names (a string even without a
    type), the root first and then in document order (iterative: a deep schema is no recursion), each once; what a
    ``$ref`` points at is one of them wherever it stands (xgrammar compiles it there)."""
    stack: list[tuple[Path, Any, bool]] = [((), schema, False)]
    seen: set[Path] = set()
    while stack:
        at, node, names = stack.pop()
        if not isinstance(node, Mapping) or at in seen:
            continue
        seen.add(at)
        yield at, node, names
        kind = node.get("type")
        kinds = {"object", "array"} if kind is None else {kind} if isinstance(kind, str) else \
            {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else set()  # else: xgrammar's to refuse
        found: list[tuple[Path, Any, bool]] = []
        for key, value in node.items():
            shape, goes_with = _PLACES.get(key, (None, None))
            if shape is None or (goes_with is not None and goes_with not in kinds):
                continue  # not a subschema, or one xgrammar passes over for this type (items of an object)
            if shape == "one":
                found.append(((*at, key), value, key == "propertyNames"))
            elif shape == "list" and isinstance(value, list):  # anyOf of property names: still names
                found += [((*at, key, i), item, names and goes_with is None) for i, item in enumerate(value)]
            elif shape == "named" and isinstance(value, Mapping):
                found += [((*at, key, name), item, False) for name, item in value.items()]
        target = _pointed(schema, node.get("$ref"))
        if target is not None:  # after the node's own: a key of the author's own, or a place passed over above
            found.append(target)
        stack.extend(reversed(found))


def _pointed(schema: Any, ref: Any) -> tuple[Path, Any, bool] | None:
    """What the local ``$ref`` ``ref`` (``#/x-shared/code``, a JSON pointer in a URI fragment) points at in
    ``schema``, with its path; None for any other reference or one that points at nothing (xgrammar's to refuse)."""
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return None
    node, at = schema, []
    for token in ref[2:].split("/"):
        step: str | int = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and isinstance(step, str) and step.isdigit():
            step = int(step)
        try:
            node = node[step]
        except (KeyError, IndexError, TypeError):
            return None
        at.append(step)
    return tuple(at), node, False


def _why_dropped(node: Mapping[str, Any], names: bool) -> str | None:
    """Why xgrammar drops ``node``'s length bounds (``names``: it is a ``propertyNames`` schema, a string when it gives
    no type), or None when it keeps them (or refuses them)."""
    kind = node.get("type", "string" if names else None)
    if not (kind == "string" or (isinstance(kind, list) and "string" in kind)) \
            or any(key in node for key in _BEFORE_STRING):
        return None
    pattern, fmt = node.get("pattern"), node.get("format")
    if isinstance(fmt, str) and fmt in XGRAMMAR_FORMATS:  # a format it knows wins over a pattern too
        by = f"format {fmt!r}: the format alone is matched"
    elif isinstance(pattern, str):
        by = "a pattern: the pattern alone is matched (bound the length in the pattern, as in ^[A-Z]{1,3}$)"
    else:
        return None
    low, high = (node.get(key, unbounded) for key, unbounded in _UNBOUNDED.items())
    if not (type(low) is int and _INT32_MIN <= low <= _INT32_MAX and type(high) is int
            and _INT64_MIN <= high <= _INT64_MAX):
        return None  # xgrammar refuses the schema, saying why (or wraps a minLength past int32: left to it)
    high = -1 if high > _INT32_MAX else high  # xgrammar reads a maxLength past int32 as none
    if (high != -1 and low > high) or (low, high) == tuple(_UNBOUNDED.values()):
        return None  # refused (minLength above maxLength), or no bound at all
    return f"xgrammar ignores minLength and maxLength on a string with {by}"


__all__ = ["XGRAMMAR_FORMATS", "Path", "drop_lengths", "dropped_lengths", "edited", "ignored_lengths", "named",
           "path_text", "without_dropped_lengths"]
