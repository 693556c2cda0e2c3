"""``engine.schema_ignored``: JSON-schema keywords xgrammar 0.2.9 accepts and does not enforce, checked against xgrammar
itself: for each keyword named, a value the keyword forbids still matches xgrammar's grammar; a keyword it enforces is
not named."""

from __future__ import annotations

import json

import pytest

from engine.schema_ignored import ignored_keywords, ignored_settings

xgr = pytest.importorskip("xgrammar")
testing = pytest.importorskip("xgrammar.testing")


def accepts(schema: dict, value: str) -> bool:
    """Whether xgrammar's grammar of ``schema`` matches the JSON text ``value``."""
    return testing._is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema)), value)


INT_OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
INT_ARRAY = {"type": "array", "items": {"type": "integer"}}

#: (schema, the keyword named in it, a value that keyword forbids)
NOT_ENFORCED = [
    ({"type": "string", "not": {"const": "a"}}, "not", '"a"'),
    ({"type": "string", "if": {"const": "a"}, "then": {"pattern": "^b$"}}, "if", '"a"'),
    ({"type": "string", "if": {"const": "a"}, "then": {"pattern": "^b$"}}, "then", '"a"'),
    ({"type": "string", "if": {"const": "a"}, "else": {"const": "a"}}, "else", '"b"'),
    ({**INT_OBJECT, "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas", '{"a": 1}'),
    ({**INT_OBJECT, "dependentRequired": {"a": ["b"]}}, "dependentRequired", '{"a": 1}'),
    ({**INT_OBJECT, "dependencies": {"a": ["b"]}}, "dependencies", '{"a": 1}'),
    ({**INT_ARRAY, "uniqueItems": True}, "uniqueItems", "[1, 1]"),
    ({**INT_ARRAY, "contains": {"const": 1}}, "contains", "[2]"),
    ({**INT_ARRAY, "contains": {"const": 1}, "maxContains": 1}, "maxContains", "[1, 1, 1]"),
    ({"type": "number", "multipleOf": 3}, "multipleOf", "4"),
    ({"type": "string", "format": "date", "pattern": "^x$"}, "pattern", '"2020-01-31"'),
    ({"type": ["string", "null"], "format": "uuid", "pattern": "^x$"}, "pattern",
     '"123e4567-e89b-12d3-a456-426614174000"'),
    ({"type": "string", "format": "zip-code"}, "format", '"not a zip"'),
    ({"type": "string", "format": "zip-code", "pattern": "^[0-9]+$"}, "format", '"1"'),  # the pattern acts, alone
    ({"pattern": "^x$"}, "pattern", "1"),
    ({"format": "date"}, "format", '"yesterday"'),
    ({"minLength": 3}, "minLength", '"a"'),
    ({"required": ["a"]}, "required", "{}"),
    ({"maximum": 3}, "maximum", "9"),
    ({"exclusiveMinimum": 3}, "exclusiveMinimum", "1"),
    # beside a const or enum xgrammar matches the values alone (kvload checks the type and the bounds itself)
    ({"type": "string", "enum": ["abc", "x"], "pattern": "^x$"}, "pattern", '"abc"'),
    ({"const": "abc", "format": "email"}, "format", '"abc"'),
    ({"type": "integer", "enum": [3, 4], "multipleOf": 3}, "multipleOf", "4"),
    ({"type": "object", "const": {"yy": 1}, "propertyNames": {"maxLength": 1}}, "propertyNames", '{"yy":1}'),
]


@pytest.mark.parametrize(("schema", "keyword", "forbidden"), NOT_ENFORCED)
def test_each_keyword_named_is_one_xgrammar_does_not_enforce(schema, keyword, forbidden):
    assert accepts(schema, forbidden)  # xgrammar lets through what the keyword forbids ...
    assert keyword in [key for path, key, _, _ in ignored_keywords(schema) if path == ()]  # ... and kvload says so


#: (schema, a keyword xgrammar enforces in it, a value that keyword forbids): not named
ENFORCED = [
    ({"type": "integer", "multipleOf": 3}, "multipleOf", "4"),
    ({"type": "string", "format": "zzz", "pattern": "^x$"}, "pattern", '"y"'),  # beside a format it does not know
    ({"type": "string", "pattern": "^x$"}, "pattern", '"y"'),
    ({**INT_ARRAY, "minContains": 2}, "minContains", "[1]"),
    ({**INT_OBJECT, "maxProperties": 1}, "maxProperties", '{"a": 1, "b": 2}'),
    ({"properties": {"a": {"type": "integer"}}, "required": ["a"]}, "required", "{}"),  # an object without a type
    ({"items": {"type": "integer"}, "minItems": 1}, "minItems", "[]"),  # an array without a type
    ({"type": "object", "propertyNames": {"pattern": "^x"}, "additionalProperties": True}, "propertyNames", '{"y": 1}'),
    ({"enum": ["a"]}, "enum", '"b"'),
]


@pytest.mark.parametrize(("schema", "keyword", "forbidden"), ENFORCED)
def test_a_keyword_xgrammar_enforces_is_not_named(schema, keyword, forbidden):
    assert not accepts(schema, forbidden)
    assert keyword not in [key for _, key, _, _ in ignored_keywords(schema)]


def test_each_is_named_by_its_json_path_and_why_after_the_length_bounds():
    schema = {"type": "object", "properties": {
        "code": {"type": "string", "format": "date", "pattern": "^[0-9]+$", "maxLength": 3},
        "tags": {"type": "array", "items": {"type": "string", "not": {"const": ""}}, "uniqueItems": True},
        "any": {"pattern": "^x$"}},
        "$defs": {"n": {"type": "number", "multipleOf": 0.5}}}
    assert ignored_settings(schema, "structured_outputs.json") == [
        ("structured_outputs.json.properties.code.maxLength", 3, "xgrammar ignores minLength and maxLength on a string "
         "with format 'date': the format alone is matched"),
        ("structured_outputs.json.properties.code.pattern", "^[0-9]+$",
         "xgrammar ignores a pattern beside format 'date': the format alone is matched"),
        ("structured_outputs.json.properties.tags.uniqueItems", True,
         "xgrammar does not enforce uniqueItems: an item may repeat"),
        ("structured_outputs.json.properties.tags.items.not", {"const": ""},
         "xgrammar does not enforce not: a value the subschema matches is still allowed"),
        ("structured_outputs.json.properties.any.pattern", "^x$", "xgrammar matches any JSON value for a schema "
         'without a type: give it one for this to act'),
        ("structured_outputs.json.$defs.n.multipleOf", 0.5,
         "xgrammar ignores multipleOf on a number (it acts on an integer)")]
    assert [n for n, _, _ in ignored_settings({"type": "array", "prefixItems": [{"type": "string", "not": {}}]},
                                              "tools[0].function.parameters")] == [
        "tools[0].function.parameters.prefixItems[0].not"]


def test_a_large_value_is_recorded_summarized_not_whole():
    """A ``not`` or ``oneOf`` holds a whole subschema, a pattern any text: each request's ``setting_ignored`` carried
    it whole (85 KB here, and the server's audit keeps 100,000 records) and the server printed it in its log line."""
    schema = {"type": "object", "not": {"enum": [f"{'x' * 50}{i}" for i in range(1500)]},
              "properties": {"a": {"pattern": "y" * 5000}, "b": {"type": "string", "not": {"const": ""}}}}
    assert ignored_settings(schema, "structured_outputs.json") == [
        ("structured_outputs.json.not", "a mapping of 1 keys",
         "xgrammar does not enforce not: a value the subschema matches is still allowed"),
        ("structured_outputs.json.properties.a.pattern", "y" * 197 + "...", "xgrammar matches any JSON value for a "
         "schema without a type: give it one for this to act"),
        ("structured_outputs.json.properties.b.not", {"const": ""},  # a small one is kept as given
         "xgrammar does not enforce not: a value the subschema matches is still allowed")]
