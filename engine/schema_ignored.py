"""JSON-schema keywords xgrammar 0.2.9 accepts and does not enforce, found so that kvload reports each one.

Checked against xgrammar itself (``tests/test_schema_ignored.py``): a value the keyword forbids still matches the
grammar. On a schema xgrammar compiles (the walk of :mod:`engine.schema_lengths`): ``not``, ``if``/``then``/``else``,
``dependentSchemas``, ``dependentRequired`` and ``dependencies`` (on an object), ``uniqueItems``, ``contains`` and
``maxContains`` (on an array; ``minContains`` acts, as a ``minItems``), ``multipleOf`` on a ``number`` (xgrammar also
prints a C++ warning for it; it is left in: taking it out changes the text of the grammar), a ``pattern`` beside a
``format`` xgrammar knows (the format alone is matched, silently), a ``format`` it does not know (any string), and on
a schema with no ``type`` (which matches any JSON value) the string and number keywords; and a ``oneOf`` whose
branches xgrammar cannot prove disjoint (:mod:`engine.schema_oneof`), which it matches as ``anyOf`` with a C++ warning:
kvload writes it ``anyOf`` before compiling (:func:`for_xgrammar`: the same grammar, no warning). No xgrammar import
here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.schema_lengths import XGRAMMAR_FORMATS, Path, _subschemas, drop_lengths, dropped_lengths, edited, named
from engine.schema_oneof import proven_disjoint
from engine.schema_values import keep_admitted_values

#: Keywords xgrammar passes over wherever they stand, and why (the type they go with: None for any).
_NEVER = {
    "not": (None, "xgrammar does not enforce not: a value the subschema matches is still allowed"),
    "if": (None, "xgrammar does not enforce if/then/else: neither branch is applied"),
    "then": (None, "xgrammar does not enforce if/then/else: neither branch is applied"),
    "else": (None, "xgrammar does not enforce if/then/else: neither branch is applied"),
    "dependentSchemas": ("object", "xgrammar does not enforce dependentSchemas: a property present does not bring "
                                   "its schema"),
    "dependentRequired": ("object", "xgrammar does not enforce dependentRequired: a property present does not make "
                                    "the others required"),
    "dependencies": ("object", "xgrammar does not enforce dependencies: a property present does not bring its "
                               "schema or required properties"),
    "uniqueItems": ("array", "xgrammar does not enforce uniqueItems: an item may repeat"),
    "contains": ("array", "xgrammar does not enforce contains: no item need match it (minContains only raises "
                          "minItems)"),
    "maxContains": ("array", "xgrammar does not enforce maxContains"),
}
#: Keywords that act only with a type: on a schema without a ``type`` (or one of :data:`_SHAPING`) xgrammar matches
#: any JSON value.
_TYPED = ("pattern", "format", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
          "multipleOf", "required", "patternProperties", "propertyNames", "minProperties", "maxProperties", "minItems",
          "maxItems")
#: Keys by which xgrammar matches a schema without a type otherwise: as an object (``properties``,
#: ``additionalProperties``, ``unevaluatedProperties``), an array (``items``, ``prefixItems``, ``unevaluatedItems``),
#: or by what they say.
_SHAPING = ("properties", "additionalProperties", "unevaluatedProperties", "items", "prefixItems", "unevaluatedItems",
            "enum", "const", "anyOf", "oneOf", "allOf", "$ref")
#: Keys that, beside a type, decide what xgrammar matches (its string or number rule is not used).
_BEFORE = ("enum", "const", "anyOf", "oneOf", "allOf", "$ref")
#: Keywords beside a ``const`` or ``enum`` that neither xgrammar (it matches the values alone) nor kvload checks
#: (``engine.schema_values`` checks the type, the bounds and ``required``): JSON Schema's regexes are ECMA-262's.
_BESIDE_VALUES = ("pattern", "format", "multipleOf", "patternProperties", "propertyNames")
#: Keys xgrammar matches a schema by before its ``oneOf`` (which it then passes over).
_BEFORE_ONE_OF = ("$ref", "const", "enum", "anyOf")
_ONE_OF = ("xgrammar holds the value to any one of them (anyOf), not exactly one: it enforces exactly one only for "
           "branches of distinct types or values, or objects with a required property of distinct values; kvload "
           "compiles it as anyOf (the same grammar)")


def ignored_keywords(schema: Any) -> list[tuple[Path, str, Any, str]]:
    """Each keyword xgrammar accepts and does not enforce in ``schema`` (a parsed JSON schema), other than the length
    bounds of :func:`engine.schema_lengths.dropped_lengths`: (the path to its subschema, the keyword, its value, why),
    in document order."""
    out: list[tuple[Path, str, Any, str]] = []
    for path, node, names in _subschemas(schema):
        out += [(path, key, node[key], why) for key, why in _why_ignored(node, names)]
    return out


def ignored_settings(schema: Any, field: str) -> list[tuple[str, Any, str]]:
    """Everything in ``schema`` xgrammar does not enforce (length bounds it drops, then other keywords) as
    ``setting_ignored`` entries (name, value, why), each named by its JSON path under ``field``
    (``structured_outputs.json.properties.code.maxLength``)."""
    return named(field, [*dropped_lengths(schema), *ignored_keywords(schema)])


def _why_ignored(node: Mapping[str, Any], names: bool) -> list[tuple[str, str]]:
    """``node``'s keywords xgrammar does not enforce and why (``names``: a ``propertyNames`` schema, a string when it
    gives no type)."""
    kind = node.get("type", "string" if names else None)
    kinds = {kind} if isinstance(kind, str) else {k for k in kind if isinstance(k, str)} \
        if isinstance(kind, list) else set()
    out = [(key, why) for key, (goes_with, why) in _NEVER.items()
           if key in node and (goes_with is None or goes_with in kinds or kind is None)
           and not (key == "uniqueItems" and node[key] is not True)]
    if _one_of_as_any_of(node):
        out.append(("oneOf", _ONE_OF))
    held = "const" if "const" in node else "enum" if "enum" in node else None
    if held is not None:  # the type and the bounds beside them kvload checks itself (engine.schema_values)
        out += [(key, f"xgrammar matches a {held} by its values alone, and kvload does not check this keyword "
                      f"against them: a {held} value it forbids is still written") for key in _BESIDE_VALUES
                if key in node]
    if kind is None:
        if not any(key in node for key in _SHAPING):
            out += [(key, "xgrammar matches any JSON value for a schema without a type: give it one for this "
                          "to act") for key in _TYPED if key in node]
        return out
    if any(key in node for key in _BEFORE):
        return out
    fmt = node.get("format")
    if "string" in kinds and isinstance(fmt, str):
        if fmt in XGRAMMAR_FORMATS and isinstance(node.get("pattern"), str):
            out.append(("pattern", f"xgrammar ignores a pattern beside format {fmt!r}: the format alone is matched"))
        elif fmt not in XGRAMMAR_FORMATS:
            out.append(("format", "xgrammar does not know this format: the pattern alone is matched"
                        if isinstance(node.get("pattern"), str) else
                        "xgrammar does not know this format: any string is matched (give a pattern)"))
    multiple = node.get("multipleOf")
    if "number" in kinds and type(multiple) in (int, float) and multiple > 0:
        out.append(("multipleOf", "xgrammar ignores multipleOf on a number (it acts on an integer)"))
    return out


def _one_of_as_any_of(node: Mapping[str, Any]) -> bool:
    """Whether xgrammar matches ``node``'s ``oneOf`` as an ``anyOf`` (it cannot prove the branches disjoint)."""
    options = node.get("oneOf")
    return isinstance(options, list) and not any(key in node for key in _BEFORE_ONE_OF) \
        and not proven_disjoint(options)


def for_xgrammar(spec: str) -> str:
    """The JSON schema text ``spec`` as kvload gives it to xgrammar: without the length bounds it drops, with each
    ``oneOf`` it matches as ``anyOf`` written so (the same grammar, and no warning line from it on the terminal), and
    each ``enum`` without the values the keywords beside it exclude (xgrammar matches them all, ``type`` or not)."""
    if "Length" not in spec and "oneOf" not in spec and "enum" not in spec and "\\u" not in spec:  # the common
        return spec  # case, not parsed
    # the bounds first: their paths may run through a oneOf that is then renamed
    return edited(spec, lambda schema: drop_lengths(schema) | _one_of_written_as_any_of(schema)
                  | keep_admitted_values(schema))


def _one_of_written_as_any_of(schema: Any) -> bool:
    """Rename each ``oneOf`` of the parsed ``schema`` that xgrammar matches as ``anyOf`` to ``anyOf``, in place, its
    key order kept; whether there was any."""
    paths = [path for path, node, _ in _subschemas(schema) if _one_of_as_any_of(node)]
    for path in sorted(paths, key=len, reverse=True):  # the deepest first: renaming one changes its children's paths
        node = schema
        for step in path:
            node = node[step]
        items = list(node.items())
        node.clear()
        node.update(("anyOf" if key == "oneOf" else key, value) for key, value in items)
    return bool(paths)


__all__ = ["for_xgrammar", "ignored_keywords", "ignored_settings"]
