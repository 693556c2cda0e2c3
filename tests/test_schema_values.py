"""``engine.schema_values``: a JSON schema's ``const`` and ``enum`` held to the ``type`` beside them, which xgrammar
0.2.9 passes over (checked against xgrammar itself): a schema no value satisfies is refused in one line, an enum's
values of another type never reach the grammar."""

from __future__ import annotations

import json

import pytest

from engine.schema_ignored import for_xgrammar
from engine.schema_values import contradictions, is_of
from engine.structured import check_spec
from engine.structured_params import StructuredOutputsParams
from pipeline.errors import GenerationError

xgr = pytest.importorskip("xgrammar")
testing = pytest.importorskip("xgrammar.testing")


def accepts(spec: str, value: str) -> bool:
    """Whether xgrammar's grammar of the schema text ``spec`` matches the JSON text ``value``."""
    return testing._is_grammar_accept_string(xgr.Grammar.from_json_schema(spec), value)


#: (schema no JSON value satisfies, the phrase naming where and why, a value xgrammar would match)
NO_VALUE = [
    ({"const": 1, "type": "string"}, 'the schema: const 1 is not of type "string"', "1"),
    ({"enum": [1, 2], "type": "string"}, 'the schema: no value of enum [1, 2] is of type "string"', "2"),
    ({"const": 1.5, "type": "integer"}, 'the schema: const 1.5 is not of type "integer"', "1.5"),
    ({"const": True, "type": "integer"}, 'the schema: const true is not of type "integer"', "true"),  # no integer
    ({"const": None, "type": ["string", "integer"]},
     'the schema: const null is not of type any of ["integer", "string"]', "null"),
    ({"const": {"a": 1}, "type": "array"}, 'the schema: const {"a": 1} is not of type "array"', '{"a":1}'),
    ({"type": "object", "properties": {"a": {"const": "x", "type": "integer"}}},
     'properties.a: const "x" is not of type "integer"', '{"a": "x"}'),  # optional, yet xgrammar writes it
    ({"type": "array", "items": {"anyOf": [{"type": "null"}, {"enum": ["x"], "type": "boolean"}]}},
     'items.anyOf[1]: no value of enum ["x"] is of type "boolean"', '["x"]'),
    # the bounds beside a const or enum, which xgrammar passes over as it does the type
    ({"type": "string", "const": "abc", "maxLength": 2}, 'the schema: const "abc" is longer than maxLength 2',
     '"abc"'),
    ({"const": "a", "minLength": 2}, 'the schema: const "a" is shorter than minLength 2', '"a"'),
    ({"type": "integer", "enum": [7, 10], "maximum": 6},
     "the schema: no value of enum [7, 10] satisfies the keywords beside it (7 is above maximum 6)", "10"),
    ({"enum": [1, 2], "exclusiveMinimum": 2},
     "the schema: no value of enum [1, 2] satisfies the keywords beside it (1 is not above exclusiveMinimum 2)", "1"),
    ({"const": 0.5, "exclusiveMaximum": 0.5}, "the schema: const 0.5 is not below exclusiveMaximum 0.5", "0.5"),
    ({"const": -1, "minimum": 0}, "the schema: const -1 is below minimum 0", "-1"),
    ({"type": "array", "const": [1, 2, 3], "maxItems": 2},
     "the schema: const [1, 2, 3] has more items than maxItems 2", "[1,2,3]"),
    ({"const": [], "minItems": 1}, "the schema: const [] has fewer items than minItems 1", "[]"),
    ({"const": {"a": 1}, "maxProperties": 0},
     'the schema: const {"a": 1} has more properties than maxProperties 0', '{"a":1}'),
    ({"type": "object", "const": {"a": 1}, "required": ["b"]},
     'the schema: const {"a": 1} lacks the required property "b"', '{"a":1}'),
]


@pytest.mark.parametrize(("schema", "phrase", "matched"), NO_VALUE)
def test_a_const_or_enum_the_type_beside_it_excludes_is_refused_in_one_line(schema, phrase, matched):
    assert accepts(json.dumps(schema), matched)  # xgrammar would write a value the schema refuses
    with pytest.raises(GenerationError) as info:
        check_spec(StructuredOutputsParams(json=schema))
    text = str(info.value)
    assert text.startswith(f"generate: structured_outputs.json: admits no value: {phrase}; "), text
    assert "\n" not in text


def test_an_enums_values_past_a_bound_beside_it_are_not_matched_and_the_rest_are():
    schema = {"type": "object", "properties": {
        "n": {"type": "integer", "enum": [1, 5, 10], "maximum": 6},
        "s": {"enum": ["ok", "toolong", 3], "maxLength": 3}}, "required": ["n", "s"]}
    check_spec(StructuredOutputsParams(json=schema))
    spec = for_xgrammar(json.dumps(schema))
    assert json.loads(spec)["properties"]["n"]["enum"] == [1, 5]
    assert json.loads(spec)["properties"]["s"]["enum"] == ["ok", 3]  # maxLength bounds strings only
    assert accepts(spec, '{"n": 5, "s": "ok"}') and accepts(spec, '{"n": 1, "s": 3}')
    assert not accepts(spec, '{"n": 10, "s": "ok"}') and not accepts(spec, '{"n": 1, "s": "toolong"}')


def test_an_enums_values_of_another_type_are_not_matched_and_the_rest_are():
    schema = {"type": "object", "properties": {"a": {"enum": ["x", 1, None, "y"], "type": "string"}},
              "required": ["a"]}
    check_spec(StructuredOutputsParams(json=schema))  # "x" and "y" satisfy it
    spec = for_xgrammar(json.dumps(schema))
    assert json.loads(spec)["properties"]["a"]["enum"] == ["x", "y"]
    assert accepts(spec, '{"a": "y"}') and not accepts(spec, '{"a": 1}') and not accepts(spec, '{"a": null}')


@pytest.mark.parametrize("schema", [
    {"const": "x", "type": "string"}, {"const": 1, "type": "number"}, {"const": 1.0, "type": "integer"},
    {"const": 2, "type": ["string", "integer"]}, {"enum": [None, "a"], "type": ["null", "string"]}, {"const": 1},
    {"const": 1, "type": "objectx"},  # not a type name: xgrammar's to refuse, in its words
    {"enum": ["a", 1]}, {"description": "const and enum in words only", "type": "string"},
    {"const": 5, "maximum": 6, "minimum": 5, "exclusiveMaximum": 5.5, "multipleOf": 5}, {"const": "ab", "maxLength": 2},
    {"const": 5, "maxLength": 1}, {"const": "abc", "maximum": 1},  # a bound of another type's values bounds nothing
    {"const": 5, "maximum": "six"}, {"const": "abc", "maxLength": -1}, {"const": 1, "minimum": True},  # malformed
    {"const": {"a": 1, "b": 2}, "required": ["a"], "maxProperties": 2}, {"const": 1.0, "maximum": 1},
])
def test_a_schema_whose_values_agree_with_its_type_is_left_as_it_is(schema):
    assert contradictions(schema) == []
    assert for_xgrammar(json.dumps(schema)) == json.dumps(schema)


def test_json_types_follow_json_schema():
    assert is_of(1, frozenset({"number"})) and is_of(2.0, frozenset({"integer"}))
    assert not is_of(True, frozenset({"integer", "number"})) and is_of(False, frozenset({"boolean"}))
    assert not is_of(0, frozenset({"boolean"})) and is_of([], frozenset({"array"})) and is_of({}, frozenset({"object"}))
