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
]


@pytest.mark.parametrize(("schema", "phrase", "matched"), NO_VALUE)
def test_a_const_or_enum_the_type_beside_it_excludes_is_refused_in_one_line(schema, phrase, matched):
    assert accepts(json.dumps(schema), matched)  # xgrammar would write a value the schema refuses
    with pytest.raises(GenerationError) as info:
        check_spec(StructuredOutputsParams(json=schema))
    text = str(info.value)
    assert text.startswith(f"generate: structured_outputs.json: admits no value: {phrase}; "), text
    assert "\n" not in text


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
])
def test_a_schema_whose_values_agree_with_its_type_is_left_as_it_is(schema):
    assert contradictions(schema) == []
    assert for_xgrammar(json.dumps(schema)) == json.dumps(schema)


def test_json_types_follow_json_schema():
    assert is_of(1, frozenset({"number"})) and is_of(2.0, frozenset({"integer"}))
    assert not is_of(True, frozenset({"integer", "number"})) and is_of(False, frozenset({"boolean"}))
    assert not is_of(0, frozenset({"boolean"})) and is_of([], frozenset({"array"})) and is_of({}, frozenset({"object"}))
