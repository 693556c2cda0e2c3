"""``engine.schema_patterns``: the repetition counts of a JSON schema's patterns, whose squares xgrammar's compile time
follows; a schema past :data:`~pipeline.limits.MAX_PATTERN_COUNT_SQUARES` is refused before xgrammar sees it."""

from __future__ import annotations

import pytest

from engine.schema_patterns import counts, pattern_cost
from engine.structured import check_spec
from engine.structured_params import StructuredOutputsParams
from pipeline.errors import GenerationError
from pipeline.limits import MAX_PATTERN_COUNT_SQUARES

pytest.importorskip("xgrammar")


@pytest.mark.parametrize(("regex", "found"), [
    ("^a{5}$", [5]), ("^(b{2,}){3,10}$", [2, 10]), ("^x{0,4}y{7,}$", [4, 7]),
    ("^\\{9}$", []), ("^[{9}]$", []), ("^[]{9}]$", []), ("^[\\]{9}]$", []),  # literal braces, not counts
    ("^x{,4}$", []), ("^a{b}$", []), ("^" + "9" * 40 + "$", []),
    ("^a{" + "9" * 40 + "}$", [999_999_999_999]),  # digits capped before int()
])
def test_counts_are_the_repetitions_of_a_regex(regex, found):
    assert list(counts(regex)) == found


def test_the_cost_adds_the_squares_of_every_pattern_where_xgrammar_compiles_it():
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^.{30}$"}},
              "patternProperties": {"^x{40}$": {"type": "array", "items": {"type": "string", "pattern": "z{3,50}"}}},
              "not": {"type": "string", "pattern": "^a{9999}$"}}  # not compiled by xgrammar: not counted
    total, path, key, n = pattern_cost(schema)
    assert total == 30 ** 2 + 40 ** 2 + 50 ** 2 and (path, key, n) == (("patternProperties", "^x{40}$", "items"),
                                                                       "pattern", 50)


@pytest.mark.parametrize(("schema", "where"), [
    ({"type": "string", "pattern": "^a{50000}$"}, "pattern"),  # 203 s in xgrammar, on the request-parsing thread
    ({"type": "object", "properties": {"p": {"type": "string", "pattern": "^.{2100}$"}}}, "properties.p.pattern"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^.{1000}$"} for i in range(5)}},
     "properties.p0.pattern"),  # each one small, together past the budget
])
def test_a_schema_whose_patterns_xgrammar_would_take_long_to_compile_is_refused_at_once(schema, where):
    with pytest.raises(GenerationError) as info:
        check_spec(StructuredOutputsParams(json=schema))
    text = str(info.value)
    assert text.startswith(f"generate: structured_outputs.json: {where}: too costly to compile: a repetition count "
                           "of "), text
    assert f"at most {MAX_PATTERN_COUNT_SQUARES:,} are taken" in text and "\n" not in text


def test_patterns_within_the_budget_compile():
    check_spec(StructuredOutputsParams(json={"type": "string", "pattern": "^[A-Z]{1,8}-[0-9]{1000}$"}))
    check_spec(StructuredOutputsParams(regex="^a{50000}$"))  # a regex spec compiles such counts at once
