"""``engine.schema_lengths``: the JSON-schema length bounds xgrammar 0.2.9 drops (a string with a pattern or a format
it knows), checked against xgrammar itself: each one it warns about is named, and taking the named ones out changes
nothing it compiles and leaves it nothing to warn about."""

from __future__ import annotations

import functools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.schema_lengths import XGRAMMAR_FORMATS, dropped_lengths, ignored_lengths, without_dropped_lengths
from tests import schema_support

xgr = pytest.importorskip("xgrammar")

WARNING = "combined with minLength/maxLength is not supported; ignoring minLength/maxLength"


def compiled(spec: str) -> tuple[str, int]:
    """xgrammar's grammar of the schema text ``spec`` (or its refusal) and how many bounds it said it ignored."""
    return schema_support.compiled(spec, WARNING)


LENGTHS = st.sampled_from([None, 0, 2, 5, -1, -3, -(2**31), 2**31, 2**63, "3", True, 2.0])
STRING = st.fixed_dictionaries({"type": st.sampled_from(["string", ["string", "null"], "integer", None])}, optional={
    "pattern": st.sampled_from(["[a-z]+", "^A{2,4}$", "", 5]),
    "format": st.sampled_from([*sorted(XGRAMMAR_FORMATS)[:4], "zzz"]),
    "minLength": LENGTHS, "maxLength": LENGTHS,
    "enum": st.just(["ab"]), "title": st.just("t"),
}).map(lambda d: {k: v for k, v in d.items() if v is not None})


def nest(children: st.SearchStrategy) -> st.SearchStrategy:
    """Every place a subschema can stand in a schema xgrammar compiles."""
    return st.one_of(
        st.dictionaries(st.sampled_from(["a", "b.c", "d"]), children, min_size=1, max_size=3).map(
            lambda p: {"type": "object", "properties": p}),
        children.map(lambda c: {"type": "object", "additionalProperties": c}),
        children.map(lambda c: {"type": "object", "patternProperties": {"^x": c}}),
        STRING.map(lambda c: {"type": "object", "propertyNames": c}),  # a string, with or without its type
        children.map(lambda c: {"type": "array", "items": c}),
        st.lists(children, min_size=1, max_size=2).map(lambda c: {"type": "array", "prefixItems": c}),
        st.lists(children, min_size=1, max_size=2).map(lambda c: {"anyOf": [*c, {"type": "integer"}]}),
        st.lists(children, min_size=1, max_size=2).map(lambda c: {"allOf": c}),
    )


NESTED = st.recursive(STRING, nest, max_leaves=5)
#: ... and the definitions a schema's root holds, referred to from it
SCHEMAS = st.one_of(NESTED, *[st.tuples(NESTED, NESTED).map(lambda t, k=k: {
    "type": "object", "properties": {"x": {"$ref": f"#/{k}/s"}, "y": t[0]}, k: {"s": t[1]}})
    for k in ("$defs", "definitions", "x-shared")])  # a $ref may point anywhere in the document


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS)
def test_the_bounds_named_are_those_xgrammar_drops_and_taking_them_out_changes_nothing(schema):
    spec = json.dumps(schema)
    grammar, warned = compiled(spec)
    named = ignored_lengths(schema, "structured_outputs.json")
    stripped = without_dropped_lengths(spec)
    again, warned_again = compiled(stripped)
    assert warned_again == 0  # nothing left for it to print on the user's terminal
    assert again.startswith("refused: ") == grammar.startswith("refused: ")  # a schema refused is still refused
    if not grammar.startswith("refused: "):  # (a schema refused never runs: what it would drop is moot)
        assert bool(named) == bool(warned)  # a bound dropped is named; none is named that xgrammar keeps
    assert (stripped == spec) == (not named)
    dropped = dropped_lengths(schema)
    for path in {path for path, _, _, _ in dropped}:
        node = functools.reduce(lambda n, step: n[step], path, schema)
        keys = {key for at, key, _, _ in dropped if at == path}
        # the string compiles alone as it did with its bounds: only what xgrammar ignores was taken out (the whole
        # schema's rules may be named otherwise: two strings the same once stripped are compiled once)
        alone = {k: v for k, v in node.items() if k not in keys}
        assert compiled(json.dumps(alone))[0] == compiled(json.dumps(node))[0]
    for _, _, value, why in dropped:
        assert type(value) is int and why.startswith("xgrammar ignores minLength and maxLength on a string with ")
    assert [n for n, _, _ in named] == [
        "structured_outputs.json" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in (*path, key))
        for path, key, _, _ in dropped]


def test_each_bound_is_named_by_its_json_path_and_why():
    schema = {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]+$", "minLength": 0, "maxLength": 3},
        "when": {"type": ["string", "null"], "format": "date", "minLength": 10},
        "name": {"type": "string", "maxLength": 20},  # acts: not named
        "odd": {"type": "string", "format": "zzz", "maxLength": 4},  # a format xgrammar does not know: the bound acts
        "tags": {"type": "array", "prefixItems": [{"$ref": "#/$defs/tag"}]}},
        "$defs": {"tag": {"type": "string", "pattern": "[a-z]+", "minLength": 1, "maxLength": 8}}}
    assert ignored_lengths(schema, "structured_outputs.json") == [
        ("structured_outputs.json.properties.code.maxLength", 3, "xgrammar ignores minLength and maxLength on a string "
         "with a pattern: the pattern alone is matched (bound the length in the pattern, as in ^[A-Z]{1,3}$)"),
        ("structured_outputs.json.properties.when.minLength", 10, "xgrammar ignores minLength and maxLength on a "
         "string with format 'date': the format alone is matched"),
        ("structured_outputs.json.$defs.tag.minLength", 1, "xgrammar ignores minLength and maxLength on a string with "
         "a pattern: the pattern alone is matched (bound the length in the pattern, as in ^[A-Z]{1,3}$)"),
        ("structured_outputs.json.$defs.tag.maxLength", 8, "xgrammar ignores minLength and maxLength on a string with "
         "a pattern: the pattern alone is matched (bound the length in the pattern, as in ^[A-Z]{1,3}$)")]
    assert [n for n, _, _ in ignored_lengths({"type": "array", "prefixItems": [
        {"type": "string", "format": "uuid", "maxLength": 5}]}, "tools[2].function.parameters")] == [
        "tools[2].function.parameters.prefixItems[0].maxLength"]


def test_a_bound_reached_only_through_a_ref_is_named_and_taken_out():
    """xgrammar compiles what a ``$ref`` points at wherever it stands (a key of the author's own, the ``items`` of an
    object-typed schema it would otherwise pass over): a bound it drops there is named and taken out too, once."""
    code = {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}
    for schema, where in [
            ({"type": "object", "properties": {"a": {"$ref": "#/x-shared/code"}, "b": {"$ref": "#/x-shared/code"}},
              "required": ["a", "b"], "x-shared": {"code": code}}, "x-shared.code"),
            ({"type": "object", "properties": {"a": {"$ref": "#/properties/b/items"}, "b": {
                "type": "object", "items": code}}, "required": ["a"]}, "properties.b.items"),
            ({"type": "object", "properties": {"a": {"$ref": "#/x~1y/c%20d"}}, "required": ["a"],
              "x/y": {"c d": code}}, "x/y.c d")]:
        spec = json.dumps(schema)
        assert compiled(spec)[1] == 1
        assert [n for n, _, _ in ignored_lengths(schema, "j")] == [f"j.{where}.maxLength"]
        stripped = without_dropped_lengths(spec)
        assert compiled(stripped) == (compiled(spec)[0], 0)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=3),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                        st.sampled_from(["type", "properties", "items", "anyOf", "pattern", "format", "minLength",
                                         "maxLength", "propertyNames", "$defs", "prefixItems", "enum", "x"]),
                        inner, max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(schema=JSON)
def test_any_json_document_is_walked_without_an_error(schema):
    """The server reads every request's schema before xgrammar does: a schema of any shape (a type of unhashable
    items, a list where an object goes) is xgrammar's to refuse, never an error of kvload's."""
    named = ignored_lengths(schema, "structured_outputs.json")
    assert without_dropped_lengths(json.dumps(schema)) == json.dumps(schema) or named
