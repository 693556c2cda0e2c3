"""``oneOf`` in xgrammar 0.2.9, checked against xgrammar itself: each ``oneOf`` kvload reports is one xgrammar reads as
``anyOf`` (it says so only in a C++ warning line), none it enforces is reported, and kvload's rewrite to ``anyOf``
compiles to the same grammar without the warning."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.schema_ignored import for_xgrammar, ignored_settings
from engine.schema_oneof import proven_disjoint
from tests import schema_support

xgr = pytest.importorskip("xgrammar")
testing = pytest.importorskip("xgrammar.testing")

WARNING = "falling back to anyOf semantics"


def compiled(spec: str) -> tuple[str, int]:
    """xgrammar's grammar of the schema text ``spec`` (or its refusal) and how many oneOf it matched as anyOf."""
    return schema_support.compiled(spec, WARNING)


VALUES = st.sampled_from([1, 2, 1.0, 1.5, 2**70, True, False, None, "a", "b", [1], [1.0], [1, 2], {"a": 1},
                          {"a": 1.0}, {"b": 1}])
TYPES = st.sampled_from(["string", "integer", "number", "boolean", "null", "array", "object", ["string", "null"],
                         ["integer", "string"], "stringy", []])
BRANCH = st.one_of(
    TYPES.map(lambda t: {"type": t}),
    TYPES.map(lambda t: {"type": t, "title": "t", "description": "d"}),  # annotations aside
    TYPES.map(lambda t: {"type": t, "minimum": 0}),  # any other key: not provable
    VALUES.map(lambda v: {"const": v}),
    st.lists(VALUES, max_size=3).map(lambda vs: {"enum": vs}),
    st.tuples(st.sampled_from(["kind", "k2"]), st.lists(VALUES, min_size=1, max_size=2), st.booleans()).map(
        lambda t: {"type": "object", "properties": {t[0]: {"enum": t[1]}, "x": {"type": "integer"}},
                   "required": [t[0]] if t[2] else ["x"]}),  # a discriminator, required or not
    st.just({"anyOf": [{"type": "string"}]}),
    st.just({}),
)
ONE_OF = st.lists(BRANCH, max_size=3).map(lambda bs: {"oneOf": bs})
SCHEMAS = st.one_of(
    ONE_OF,
    ONE_OF.map(lambda o: {"type": "object", "properties": {"a": o, "b": {"type": "array", "items": o}}}),
    st.tuples(ONE_OF, ONE_OF).map(lambda t: {"oneOf": [{**t[0], "type": "object"}, {"type": "string"}], **t[1]}),
    ONE_OF.map(lambda o: {**o, "anyOf": [{"type": "integer"}]}),  # anyOf first: the oneOf is passed over
    ONE_OF.map(lambda o: {"type": "object", "properties": {"x": {"$ref": "#/$defs/o"}}, "$defs": {"o": o}}),
    st.just({"oneOf": [{"$ref": "#/$defs/s"}, {"type": "integer"}], "$defs": {"s": {"type": "string"}}}),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS)
def test_the_oneof_named_are_those_xgrammar_matches_as_anyof_and_rewriting_them_changes_nothing(schema):
    spec = json.dumps(schema)
    grammar, warned = compiled(spec)
    named = [n for n, _, _ in ignored_settings(schema, "structured_outputs.json") if n.endswith(".oneOf")]
    rewritten = for_xgrammar(spec)
    again, warned_again = compiled(rewritten)
    assert warned_again == 0  # nothing left for it to print on the user's terminal
    assert again == grammar  # the same grammar (or the same refusal)
    if not grammar.startswith("refused: "):
        assert bool(named) == bool(warned)
    assert (rewritten == spec) == (not named)


def test_a_oneof_xgrammar_matches_as_anyof_is_named_by_its_json_path_and_lets_two_branches_match():
    schema = {"type": "object", "properties": {
        "n": {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]},  # 1 is both
        "pet": {"oneOf": [  # a discriminator: exactly one, enforced
            {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]},
            {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"]}]}},
        "required": ["n"], "additionalProperties": False}
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema))
    assert testing._is_grammar_accept_string(grammar, '{"n": 1}')  # matches both branches: a oneOf forbids it
    assert [(n, why) for n, _, why in ignored_settings(schema, "structured_outputs.json")] == [
        ("structured_outputs.json.properties.n.oneOf", "xgrammar holds the value to any one of them (anyOf), not "
         "exactly one: it enforces exactly one only for branches of distinct types or values, or objects with a "
         "required property of distinct values; kvload compiles it as anyOf (the same grammar)")]
    assert json.loads(for_xgrammar(json.dumps(schema)))["properties"] == {
        "n": {"anyOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}, "pet": schema["properties"]["pet"]}


@pytest.mark.parametrize(("options", "disjoint"), [
    ([{"type": "string"}, {"type": "integer"}], True),
    ([{"type": "integer"}, {"type": "number"}], False),
    ([{"const": 1}, {"const": 1.0}], False),  # equal numbers, one not an integer literal: may overlap
    ([{"const": 1}, {"const": 2}], True),
    ([{"const": "a"}, {"type": "string"}], False),
    ([{"enum": [1, "a"]}, {"type": "boolean"}], True),
    ([{"type": "object"}, {"type": "string"}], False),  # an object branch needs a discriminator
    ([], False),
])
def test_proven_disjoint_agrees_with_xgrammar(options, disjoint):
    assert proven_disjoint(options) is disjoint
    assert compiled(json.dumps({"oneOf": options}))[1] == (0 if disjoint else 1)
