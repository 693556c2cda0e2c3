"""``engine.schema_all_of``: an ``allOf`` of several schemas, which xgrammar 0.2.9 compiles as any JSON value (the type
and keywords beside it dropped too), is refused by its path; one of one schema is held and passes."""

from __future__ import annotations

import json

import pytest

from engine.schema_all_of import unmerged_all_of
from engine.structured import check_spec
from engine.structured_params import StructuredOutputsParams
from pipeline.errors import GenerationError

xgr = pytest.importorskip("xgrammar")
testing = pytest.importorskip("xgrammar.testing")

TWO = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
       "allOf": [{"required": ["a"]}, {"properties": {"b": {"type": "string"}}}]}


def accepts(schema: dict, value: str) -> bool:
    return testing._is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema)), value)


@pytest.mark.parametrize(("schema", "where", "forbidden"), [
    (TWO, "allOf", "7"),  # not even an object: the type beside it is dropped too
    ({"type": "array", "items": {"allOf": [{"type": "string"}, {"maxLength": 3}]}}, "items.allOf", "[7]"),
    ({"anyOf": [{"type": "null"}, {"allOf": [{"minimum": 1}, {"maximum": 2}, {"type": "integer"}]}]}, "anyOf[1].allOf",
     '"x"'),
])
def test_an_all_of_of_several_schemas_is_refused_by_its_path(schema, where, forbidden):
    assert accepts(schema, forbidden)  # xgrammar holds the value to nothing there
    with pytest.raises(GenerationError) as info:
        check_spec(StructuredOutputsParams(json=schema))
    ((_, n),) = unmerged_all_of(schema)
    assert str(info.value) == (f"generate: structured_outputs.json: {where}: an allOf of {n} schemas is not held: "
                               "xgrammar matches any JSON value there, dropping the type and every keyword beside it "
                               "too; merge them into one schema (an allOf of one schema is held)")


def test_an_all_of_of_one_schema_is_held_and_passes():
    schema = {"type": "object", "properties": {"a": {"allOf": [{"type": "integer"}]}}, "required": ["a"]}
    check_spec(StructuredOutputsParams(json=schema))
    assert accepts(schema, '{"a": 1}') and not accepts(schema, '{"a": "x"}')
    assert unmerged_all_of(schema) == [] and unmerged_all_of({"description": "allOf", "type": "string"}) == []
