"""Structured outputs (vLLM's ``StructuredOutputsParams``, OpenAI's ``response_format``) with xgrammar: what is
generated parses, matches, or is one of the choices, greedy, sampled, with n samples and with speculative drafts;
bad specs and a missing xgrammar are one line before anything runs; the server takes them from the openai client, and
``kvload generate`` from its flags (--json-schema, --regex, --choice, --grammar, --json-object)."""

from __future__ import annotations

import json
import re
import sys

import openai
import pytest

import kvload
from engine.structured import choice_grammar
from kvload import SamplingParams, StructuredOutputsParams
from pipeline.errors import GenerationError
from tests.cli_support import kvload as kvload_process
from tests.cli_support import read_events, run_cli
from tests.llm_support import llm_kwargs, with_tokenizer
from tests.serve_support import serving
from tests.text_support import bytelevel_checkpoint, trained_tokenizer

pytest.importorskip("xgrammar")

PROMPT = "Hello world, the sky is"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["red", "blue"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
CHOICES = ["yes", "no", 'say "maybe"\nlater']
#: 31 characters xgrammar compiles at once and then matches ever slower: 0.2 s a token by the 20th, 2.2 s by the 38th
NESTED = "(((a|b){0,30}){0,30}){0,30}"


def check_schema(text: str) -> None:
    """``text`` is a JSON object of SCHEMA, checked by hand (no jsonschema dependency)."""
    doc = json.loads(text)
    assert set(doc) == {"ok", "n", "tag"}
    assert isinstance(doc["ok"], bool)
    assert isinstance(doc["n"], int) and not isinstance(doc["n"], bool) and 0 <= doc["n"] <= 99
    assert doc["tag"] in ("red", "blue")


@pytest.fixture(scope="module")
def bytes_ckpt(tiny_checkpoints, tmp_path_factory):
    """The tiny llama with a byte-level BPE tokenizer: every character is spellable, so any grammar is."""
    return bytelevel_checkpoint(tiny_checkpoints("llama"), tmp_path_factory.mktemp("structured") / "ckpt")


@pytest.fixture(scope="module")
def llm(bytes_ckpt):
    with kvload.LLM(str(bytes_ckpt), **llm_kwargs()) as loaded:
        yield loaded


def sample(llm, so: StructuredOutputsParams, **kw):
    kw.setdefault("max_tokens", 48)
    return llm.generate(PROMPT, SamplingParams(structured_outputs=so, **kw))[0].outputs


def test_json_schema_output_parses_and_matches_the_schema_greedy_and_sampled(llm):
    free = sample(llm, None)[0].text  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        json.loads(free)  # unconstrained, the random model writes no JSON
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    for temperature, seed in ((0.0, None), (1.0, 0), (1.0, 1), (1.5, 2)):
        (out,) = sample(llm, so, temperature=temperature, seed=seed)
        assert out.finish_reason == "stop" and out.stop_reason is None  # the grammar ended it with EOS
        check_schema(out.text)
    # the schema as JSON text is the same constraint
    text = sample(llm, StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True))[0].text
    assert text == sample(llm, so)[0].text


def test_strings_with_a_length_bound_hold_no_raw_control_characters(llm):
    """xgrammar 0.2.9 compiles a string with minLength/maxLength as any character but a quote, a backslash, CR and LF:
    a random model then wrote tabs and other control characters raw into it, and json.loads refused the reply."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12},
                                               "b": {"type": ["string", "null"], "minLength": 3}},
              "required": ["a", "b"], "additionalProperties": False}
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    outs = [o for seed in range(6) for o in sample(llm, so, temperature=2.0, seed=seed, n=4, max_tokens=40)]
    done = [o.text for o in outs if o.finish_reason == "stop"]
    assert len(done) >= 4
    for text in done:
        doc = json.loads(text)  # strict: a raw control character in a string is an error
        # (lengths are xgrammar's count of what the byte-level model wrote, invalid UTF-8 included: not checked here)
        assert isinstance(doc["a"], str) and (doc["b"] is None or isinstance(doc["b"], str))


def test_json_object_is_an_object(llm):
    for seed in range(3):
        (out,) = sample(llm, StructuredOutputsParams(json_object=True, disable_any_whitespace=True), temperature=1.0,
                        seed=seed, max_tokens=60)
        if out.finish_reason == "stop":  # a random model may write a long string; what it ends is an object
            assert isinstance(json.loads(out.text), dict)
        assert out.text.startswith("{")


def test_regex_output_fullmatches_greedy_sampled_and_each_of_n_samples(llm):
    pattern = r"[0-9]{3}-[a-z]{2}(!|\?)"
    so = StructuredOutputsParams(regex=pattern)
    assert re.fullmatch(pattern, sample(llm, so)[0].text)
    outs = sample(llm, so, temperature=1.2, seed=3, n=4)
    assert len(outs) == 4 and all(re.fullmatch(pattern, o.text) and o.finish_reason == "stop" for o in outs)
    assert len({o.text for o in outs}) > 1  # each sample drew its own way through the grammar


def test_choice_output_is_one_of_the_choices_even_with_quotes_and_newlines(llm):
    so = StructuredOutputsParams(choice=CHOICES)
    seen = {o.text for seed in range(4) for o in sample(llm, so, temperature=2.0, seed=seed, n=4)}
    assert seen <= set(CHOICES) and len(seen) > 1
    assert choice_grammar(['a"b\\']) == 'root ::= "a\\"b\\\\"'


def test_choices_with_control_characters_compile_and_are_what_is_generated(llm):
    """A choice holding NUL or an escape sequence was refused with xgrammar's lexer error about kvload's own grammar
    ("EBNF lexer error at line 1, column 12"); every control character is now written as an escape."""
    choices = ["a\x00b", "\x1b[0m", "bell\x07\x7f"]
    seen = {o.text for seed in range(4) for o in sample(llm, StructuredOutputsParams(choice=choices),
                                                         temperature=2.0, seed=seed, n=4)}
    assert seen <= set(choices) and len(seen) > 1


def test_grammar_output_follows_the_grammar(llm):
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "z" [0-9]'
    for seed in range(3):
        (out,) = sample(llm, StructuredOutputsParams(grammar=grammar), temperature=1.0, seed=seed)
        assert re.fullmatch(r"\((?:[a-c]|z[0-9])(?:,(?:[a-c]|z[0-9]))*\)", out.text), out.text


def test_min_tokens_that_would_forbid_the_grammars_end_yields_to_the_grammar(llm):
    """After "no" the grammar allows only EOS, which min_tokens holds back: the grammar wins (what is drawn parses),
    instead of every logit -inf and a token outside the grammar."""
    outs = sample(llm, StructuredOutputsParams(choice=["no", "yes"]), min_tokens=6, n=2, temperature=1.0, seed=0)
    assert all(o.text in ("no", "yes") for o in outs)


def test_token_settings_the_grammar_overrules_are_said_setting_ignored_once(llm):
    """min_tokens, allowed_token_ids or bad_words that leave the grammar no token were set aside without a word
    (hunt65a): the output broke min_tokens, or held a banned or unallowed token, and the audit said nothing. Each given
    one is now a setting_ignored naming it (once for the n samples of one SamplingParams); settings the grammar never
    had to overrule are not."""
    said = lambda: [(e["field"], e["value"]) for e in llm.audit.of("setting_ignored")  # noqa: E731
                    if "the grammar alone chose" in e["reason"]]
    before = len(said())
    outs = sample(llm, StructuredOutputsParams(choice=["no", "yes"]), min_tokens=6, n=2, temperature=1.0, seed=0)
    assert all(o.text in ("no", "yes") and len(o.token_ids) < 6 for o in outs)
    assert said()[before:] == [("generate.min_tokens", 6)]
    spelt = llm.tokenizer.encode("no", add_special_tokens=False)
    other = next(t for t in range(300) if t not in words_eos(llm)
                 and llm.tokenizer.decode([t]) not in ("", "n", "no", "y", "ye", "yes"))
    before = len(said())
    (out,) = sample(llm, StructuredOutputsParams(choice=["no"]), allowed_token_ids=[other])
    assert out.text == "no" and other not in out.token_ids
    assert said()[before:] == [("generate.allowed_token_ids", [other])]
    before = len(said())
    (out,) = sample(llm, StructuredOutputsParams(choice=["no", "yes"]), allowed_token_ids=[*spelt, *words_eos(llm)],
                    min_tokens=1)
    assert out.text == "no" and said()[before:] == []  # the settings and the grammar agree: nothing overruled


def test_a_vocabulary_that_cannot_spell_the_grammar_ends_the_sample_not_the_step(tiny_checkpoints, tmp_path):
    """Word tokens ("w0".."w511") spell no digit: the sample ends with EOS at once, and the request beside it in the
    same steps goes on (neither a token outside the grammar nor a failed step)."""
    with kvload.LLM(str(with_tokenizer(tiny_checkpoints("llama"), tmp_path / "words", 512)), **llm_kwargs()) as words:
        stuck, free = words.generate(["w5 w17", "w5 w17"], [
            SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[0-9]+")),
            SamplingParams(max_tokens=8, ignore_eos=True)])
    assert stuck.outputs[0].finish_reason == "stop" and stuck.outputs[0].token_ids[-1] in words_eos(words)
    assert len(stuck.outputs[0].token_ids) == 1 and len(free.outputs[0].token_ids) == 8


def words_eos(llm) -> frozenset[int]:
    return frozenset(llm.result.executor.eos_token_ids)


def test_speculative_drafts_keep_the_constrained_tokens(bytes_ckpt, llm):
    """Drafts the grammar refuses (after "ababab" the n-gram proposer guesses "ab", the regex wants "c") are masked out
    of their own row; accepted ones are rolled back before the real step: the same tokens as without drafts."""
    so = StructuredOutputsParams(regex=r"(ab){3}c(ab){4}d")
    plain = sample(llm, so)[0]
    with kvload.LLM(str(bytes_ckpt), max_draft_len=4, **llm_kwargs()) as spec:
        drafted = sample(spec, so)[0]
        stats = spec.last_stats
        sampled = sample(spec, so, temperature=1.0, seed=5)[0]
    assert drafted.token_ids == plain.token_ids and re.fullmatch(r"(ab){3}c(ab){4}d", drafted.text)
    assert stats.draft_tokens > 0 and stats.accepted_draft_tokens > 0
    assert re.fullmatch(r"(ab){3}c(ab){4}d", sampled.text)


@pytest.mark.parametrize(("so", "message"), [
    (dict(regex="a(b"), r"^generate: structured_outputs\.regex: xgrammar refused it: Regex parsing error at "
                        r"position 4: The parenthesis is not closed\.$"),
    (dict(json={"type": "objectx"}), r'^generate: structured_outputs\.json: xgrammar refused it: Unsupported type '
                                     r'"objectx"$'),
    (dict(grammar="root ::= foo"), r"^generate: structured_outputs\.grammar: xgrammar refused it: .*Rule \"foo\" is "
                                   r"not defined$"),
    # vLLM's structured outputs examples send this Lark grammar (vLLM hands it to its guidance backend)
    (dict(grammar='\n?start: select\n?select: "SELECT " column " FROM " table\n// a comment\n?column: /[a-z_]+/\n'
                  '?table: /[a-z_]+/\n'),
     r"^generate: structured_outputs\.grammar: xgrammar refused it: EBNF lexer error .*; this reads as a Lark "
     r"grammar \(rules `name: \.\.\.`, none `name ::= \.\.\.`\), which vLLM passes to its guidance backend: kvload "
     r"compiles xgrammar's EBNF only"),
    # xgrammar compiles these in a millisecond, then takes seconds to match each token past the 30th (on the loop
    # every request's step waits for)
    (dict(regex=NESTED), r"^generate: structured_outputs\.regex: too costly to match: a repetition of something that "
                         r"may be empty nests inside another .*start the inner ones at 1 \(\+ or \{1,n\}\)$"),
    (dict(json={"type": "object", "properties": {"x": {"type": "string", "pattern": "^(((a|b)*){0,30}){0,30}$"}}}),
     r"^generate: structured_outputs\.json: too costly to match"),
    (dict(grammar="root ::= x{0,30}\nx ::= y{0,30}\ny ::= [ab]{0,30}"),
     r"^generate: structured_outputs\.grammar: too costly to match"),
])
def test_a_spec_xgrammar_refuses_is_one_line_before_anything_runs(llm, so, message):
    started = len(llm.audit.of("generation_started"))
    with pytest.raises(GenerationError, match=message):
        sample(llm, StructuredOutputsParams(**so))
    assert len(llm.audit.of("generation_started")) == started


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 is greater than maxLength 2 (the schema, or a "
                                                         "part of it: xgrammar refuses"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "Invalid range: minimum greater than maximum"),
    ({"type": "number", "minimum": 5, "maximum": 1}, "Invalid range"),
    ({"enum": []}, "enum array must not be empty"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems is greater than maxItems: 3 > 1"),
    ({"type": "object", "minProperties": 3, "maxProperties": 1}, "minProperties is greater than maxProperties"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "Schema 'false' cannot accept any value"),
    ("false", "the schema is false, which no JSON value satisfies"),
    # xgrammar compiles these: each sample would end at once, empty, or write a property with no value ({"a": })
    ({"anyOf": []}, "xgrammar's grammar for the schema matches only the empty text (an empty anyOf or oneOf"),
    ({"type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]},
     "a part of the schema (xgrammar's rule root_prop_0) matches only the empty text"),
    ({"type": "array", "items": {"oneOf": []}}, "a part of the schema"),
    # a $ref cycle with no way out: xgrammar compiles it, and a sample ran to max_tokens writing ever deeper nesting
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
     "each way through the schema needs it again (a $ref back to it under a required property or a minItems)"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "so no finite JSON satisfies it"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"$ref": "#/properties/a"}, "minItems": 1}}},
     "a part of the schema (xgrammar's rule root_prop_0) admits no finite value"),
])
def test_a_schema_no_json_value_satisfies_is_one_line_saying_so_before_anything_runs(llm, schema, message):
    started = len(llm.audit.of("generation_started"))
    with pytest.raises(GenerationError) as info:
        sample(llm, StructuredOutputsParams(json=schema))
    text = str(info.value)
    assert text.startswith("generate: structured_outputs.json: admits no value: ") and message in text, text
    assert "\n" not in text and len(llm.audit.of("generation_started")) == started


def test_no_rule_of_a_satisfiable_schemas_grammar_is_read_as_matching_only_the_empty_text():
    import xgrammar

    from engine.grammar_shape import empty_only_rules, never_ending_rules

    for schema in (SCHEMA, {"type": "object"}, {"type": "string", "maxLength": 0}, {"type": "array", "maxItems": 0},
                   {"type": "array", "items": False}, {"anyOf": [{"type": "string"}, {"type": "null"}]},
                   {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}):
        assert empty_only_rules(str(xgrammar.Grammar.from_json_schema(json.dumps(schema)))) == [], schema
    assert empty_only_rules(str(xgrammar.Grammar.builtin_json_grammar())) == []
    assert never_ending_rules(str(xgrammar.Grammar.builtin_json_grammar())) == []
    for schema in (SCHEMA, {"anyOf": [{"$ref": "#"}, {"type": "null"}]}, {"type": "array", "items": {"$ref": "#"}},
                   {"type": "object", "properties": {"a": {"$ref": "#"}}}):  # a $ref with a way out: finite values
        assert never_ending_rules(str(xgrammar.Grammar.from_json_schema(json.dumps(schema)))) == [], schema
    assert empty_only_rules(str(xgrammar.Grammar.from_ebnf('root ::= "" | x\nx ::= [a]*'))) == []
    assert empty_only_rules(str(xgrammar.Grammar.from_ebnf('root ::= "a" x\nx ::= ""'))) == ["x"]


@pytest.mark.parametrize(("kind", "spec", "nesting"), [
    ("regex", NESTED, 2),
    ("regex", "(((a|b)*){0,30}){0,30}", 2),  # a star inside: as empty
    ("regex", "((a|b){0,10}((a|b){0,10}){0,10}){0,10}", 2),
    ("regex", "((a|b){0,100}){0,100}", 1),  # one repeat of what may be empty: ~1 ms a token
    ("regex", "(.?){0,2000}", 1),
    ("regex", "(((a){1,20}){1,20}){1,20}", 0),  # nothing empty to repeat
    ("regex", "(((a|b){0,30}x){0,30}){0,30}", 1),  # the x keeps each middle turn from being empty
    ("regex", r"((25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\.){3}(25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)", 0),
    ("regex", r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}", 0),
    ("grammar", "root ::= x{0,30}\nx ::= y{0,30}\ny ::= [ab]{0,30}", 2),  # nested through rules
    ("json", json.dumps(SCHEMA), 0),
    ("json", json.dumps({"type": "array", "items": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                                    "maxItems": 30}, "maxItems": 30}), 0),  # commas between items
])
def test_the_nesting_of_repeats_that_may_be_empty_is_read_from_xgrammars_grammar(kind, spec, nesting):
    import xgrammar

    from engine.grammar_shape import nullable_repeat_nesting

    grammar = {"regex": xgrammar.Grammar.from_regex, "grammar": xgrammar.Grammar.from_ebnf,
               "json": xgrammar.Grammar.from_json_schema}[kind](spec)
    assert nullable_repeat_nesting(str(grammar)) == nesting


@pytest.mark.parametrize(("grammar", "empty"), [
    ("root ::= root", True),
    ('root ::= a b\na ::= "x"\nb ::= b "y"', True),  # b never ends, so neither does root
    ("root ::= [a-z]* root", True),
    ('root ::= "x" | root', False),
    ('root ::= ""', False),  # the empty text is a text
    ('root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "z" [0-9]', False),
    ('root ::= a\na ::= "x" a | "y"', False),  # recursion that can stop
])
def test_a_grammar_that_matches_no_text_is_told_from_xgrammars_grammar(grammar, empty):
    import xgrammar

    from engine.grammar_shape import matches_nothing

    assert matches_nothing(str(xgrammar.Grammar.from_ebnf(grammar))) is empty
    assert not matches_nothing(str(xgrammar.Grammar.from_json_schema(json.dumps(SCHEMA))))


@pytest.mark.parametrize(("kw", "message"), [
    ({}, "give exactly one of json, regex, choice, grammar, json_object; got none"),
    ({"regex": "a", "choice": ["a"]}, "got regex and choice"),
    ({"json": "{not json"}, r"structured_outputs\.json: not JSON text"),
    ({"json": {"type": "integer", "maximum": 10**5000}},  # was "not JSON-serializable (Exceeds the limit ...)"
     r"^generate: structured_outputs\.json: maximum: an integer of more than 4,300 digits; at most 4,300 digits are "
     r"accepted$"),
    ({"json": [1]}, r"structured_outputs\.json: expected a JSON schema \(a dict, or its JSON text\), got list"),
    ({"json": False}, r"^generate: structured_outputs\.json: admits no value: the schema is false"),  # not "none given"
    ({"choice": []}, r"structured_outputs\.choice: expected a non-empty list"),
    # false is no spec: it was taken for "not given" (only json_object=False means that), the other kind served
    ({"regex": "a", "choice": False}, r"^generate: structured_outputs\.choice: expected a non-empty list of non-empty "
                                      r"strings, got False$"),
    ({"json_object": True, "grammar": False}, r"^generate: structured_outputs\.grammar: expected a non-empty string"),
    ({"choice": ["a"], "regex": False}, r"^generate: structured_outputs\.regex: expected a non-empty string"),
    ({"choice": ["a", ""]}, r"structured_outputs\.choice\[1\]: expected a non-empty string"),
    ({"regex": "a", "disable_any_whitespace": True}, r"disable_any_whitespace: applies to json and json_object"),
    # a schema sent as JSON text escapes the request body's depth check: 70 nested objects (140 levels) would
    # compile in seconds, 1,000 in minutes, so the text is held to the dict's limit
    ({"json": '{"type": "object", "properties": {"a": ' * 70 + '{"type": "string"}' + '}}' * 70},
     r"^generate: structured_outputs\.json: nests deeper than 64 levels of objects and arrays$"),
    ({"json": {"type": "string", "enum": [f"v{i}" for i in range(20_000)]}},
     r"structured_outputs\.json: expected at most 100,000 characters of JSON schema, got 188,918$"),
    ({"regex": "(" + "|".join(f"v{i}x" for i in range(20_000)) + ")"},
     r"structured_outputs\.regex: expected at most 100,000 characters, got 148,891$"),
    # a lone surrogate (JSON's "\ud800") in a schema given as a dict: its text was hashed as UTF-8 on compile, a
    # UnicodeEncodeError with a traceback (over HTTP a 500); named where it lies, as in the other kinds' text
    ({"json": {"type": "string", "pattern": "a\ud800"}},
     r"^generate: structured_outputs\.json\.pattern: not valid Unicode text \(a lone surrogate at character 1; "),
    ({"json": {"anyOf": [{"const": "ok"}, {"enum": ["x", "\udfff"]}]}},
     r"^generate: structured_outputs\.json\.anyOf\[1\]\.enum\[1\]: not valid Unicode text"),
    ({"json": {"type": "object", "properties": {"\ud800": {"type": "string"}}}},
     r"^generate: structured_outputs\.json\.properties: not valid Unicode text"),
    # a keyword that is no field is the same one line as SamplingParams' (it was Python's TypeError, naming no
    # field); vLLM's own fields say what to do instead
    ({"regex": "a", "jsn": {}}, r"^generate: structured_outputs: unknown field 'jsn'; fields are choice, "
                                r"disable_any_whitespace, grammar, json, json_object, reasoning_parser, regex; "
                                r"did you mean 'json'\?$"),
    ({"json": {}, "disable_additional_properties": True},
     r"^generate: structured_outputs\.disable_additional_properties: vLLM's StructuredOutputsParams field, not "
     r"kvload's: write \"additionalProperties\": false"),
    ({"regex": "a", "whitespace_pattern": " "}, r"^generate: structured_outputs\.whitespace_pattern: vLLM's"),
])
def test_bad_structured_outputs_params_are_one_line(kw, message):
    with pytest.raises(GenerationError, match=message):
        StructuredOutputsParams(**kw)
    with pytest.raises(GenerationError, match="structured_outputs: expected a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_missing_xgrammar_is_refused_naming_the_extra(llm, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    monkeypatch.setattr(llm.result.executor, "_grammars", None)
    with pytest.raises(GenerationError, match=r"^generate: structured_outputs: structured outputs need the xgrammar "
                                              r"package, which is not installed; pip install 'kvload\[structured\]'$"):
        sample(llm, StructuredOutputsParams(regex="[0-9]"))
    assert sample(llm, None, max_tokens=2)[0].token_ids  # type: ignore[arg-type]  # the rest still generates


def test_a_model_without_a_tokenizer_is_refused():
    with kvload.LLM("tiny-llama", **llm_kwargs()) as preset, \
            pytest.raises(GenerationError, match="structured_outputs: the grammar is matched on token text, but "
                                                 "tiny-llama has no tokenizer"):
        preset.generate([[1, 2, 3]], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))


#: A schema with a length bound xgrammar 0.2.9 drops (a string with a pattern: the pattern alone is matched) and one it
#: keeps (a plain string); xgrammar said so only in a C++ warning line on stderr.
DROPPED = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$", "maxLength": 3},
                                            "name": {"type": "string", "maxLength": 8}},
           "required": ["code", "name"], "additionalProperties": False}
XGRAMMAR_WARNING = "ignoring minLength/maxLength"


def test_a_length_bound_xgrammar_drops_is_reported_once_per_request_and_it_prints_nothing(llm, capfd):
    """kvload's rule: a setting accepted acts or is reported. The bound acted on nothing, and all the user saw was
    xgrammar's C++ line on the terminal: "pattern combined with minLength/maxLength is not supported; ignoring ..."."""
    dropped = lambda: [e for e in llm.audit.of("setting_ignored") if "Length" in e["field"]]  # noqa: E731
    before = len(dropped())
    capfd.readouterr()
    so = StructuredOutputsParams(json={**DROPPED, "title": "api"})  # a schema no other test compiled
    llm.generate([PROMPT, PROMPT], SamplingParams(structured_outputs=so, max_tokens=4))
    (event,) = dropped()[before:]  # one request (two prompts, one SamplingParams): one report
    assert (event["field"], event["value"]) == ("generate.structured_outputs.json.properties.code.maxLength", 3)
    assert event["reason"].startswith("xgrammar ignores minLength and maxLength on a string with a pattern: the "
                                      "pattern alone is matched")
    assert XGRAMMAR_WARNING not in capfd.readouterr().err
    llm.generate(PROMPT, SamplingParams(structured_outputs=so, max_tokens=4))  # each call reports its own
    assert len(dropped()) == before + 2


def test_a_keyword_xgrammar_does_not_enforce_is_reported_by_its_json_path_and_it_prints_nothing(llm, capfd):
    """``not`` and ``uniqueItems`` compile and hold nothing (xgrammar prints nothing either); a ``oneOf`` of
    overlapping branches is held as ``anyOf`` (xgrammar's C++ line "falling back to anyOf semantics" was all the user
    saw): each is reported, and the terminal shows no line of xgrammar's."""
    ignored = lambda: [(e["field"], e["reason"]) for e in llm.audit.of("setting_ignored")]  # noqa: E731
    before = len(ignored())
    capfd.readouterr()
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "not": {"const": ""}}, "uniqueItems": True},
        "n": {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}},
        "required": ["tags", "n"], "additionalProperties": False}
    llm.generate(PROMPT, SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), max_tokens=4))
    reported = ignored()[before:]
    assert [field for field, _ in reported] == ["generate.structured_outputs.json.properties.tags.uniqueItems",
                                                "generate.structured_outputs.json.properties.tags.items.not",
                                                "generate.structured_outputs.json.properties.n.oneOf"]
    assert reported[2][1].startswith("xgrammar holds the value to any one of them (anyOf), not exactly one")
    assert "anyOf semantics" not in capfd.readouterr().err


def test_generate_json_schema_flag_reports_a_dropped_length_bound_on_the_terminal_not_xgrammars_line(capfd,
                                                                                                        bytes_ckpt):
    r = generate(capfd, bytes_ckpt, "--json-schema", json.dumps({**DROPPED, "title": "cli"}))
    assert r.code == 0, r.err
    (line,) = [x for x in r.err.splitlines() if "setting_ignored" in x]
    assert "generate.structured_outputs.json.properties.code.maxLength" in line and "pattern alone" in line
    assert XGRAMMAR_WARNING not in r.err


def test_the_audit_records_the_kind_and_a_digest_not_the_spec(llm):
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    sample(llm, so, max_tokens=4)
    record = llm.audit.of("generation_started")[-1]["structured_outputs"]
    assert record["kind"] == "json" and record["chars"] == len(so.spec) and len(record["sha256"]) == 64
    assert record["any_whitespace"] is False and "properties" not in json.dumps(record)
    assert SamplingParams(structured_outputs=so).to_dict()["structured_outputs"] == {
        "json": SCHEMA, "disable_any_whitespace": True}


def test_the_server_takes_response_format_and_structured_outputs_from_the_openai_client(bytes_ckpt):
    with serving(str(bytes_ckpt)) as served:
        def complete(stream: bool = False, **extra):
            return served.client.completions.create(model=served.state.model_name, prompt=PROMPT, max_tokens=48,
                                                    stream=stream, extra_body=extra)

        fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}}
        before = len(served.result.audit.of("structured_outputs_requested"))
        # vLLM's compact-JSON switch goes with structured_outputs; response_format keeps any whitespace, so the
        # random model is given the schema both ways and what ends is checked
        check_schema(complete(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}).choices[0].text)
        out = complete(response_format=fmt).choices[0]
        if out.finish_reason == "stop":
            check_schema(out.text)
        assert out.text.startswith("{")
        assert re.fullmatch(r"[0-9]{3}", complete(structured_outputs={"regex": "[0-9]{3}"}).choices[0].text)
        streamed = "".join(c.choices[0].text for c in complete(True, structured_outputs={"choice": CHOICES},
                                                                temperature=1.0, seed=1) if c.choices)
        assert streamed in CHOICES
        asked = served.result.audit.of("structured_outputs_requested")[before:]
        assert [(e["field"], e["kind"]) for e in asked] == [("structured_outputs", "json"),
                                                           ("response_format", "json"),
                                                           ("structured_outputs", "regex"),
                                                           ("structured_outputs", "choice")]
        # a min_tokens the grammar's end overrules is said, naming the request (it was set aside without a word)
        overruled = lambda: [e for e in served.result.audit.of("setting_ignored")  # noqa: E731
                             if e["field"] == "serve.min_tokens"]
        assert complete(structured_outputs={"choice": ["no", "yes"]}, min_tokens=6).choices[0].text in ("no", "yes")
        (said,) = overruled()
        assert said["value"] == 6 and said["request"] and "the grammar alone chose" in said["reason"]
        for extra, param, words in (
                ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                             "schema": {"type": "objectx"}}}},
                 "response_format", 'response_format: xgrammar refused it: Unsupported type "objectx"'),
                ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs",
                 "structured_outputs.regex: xgrammar refused it: Regex parsing error"),
                ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "got regex and choice"),
                ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                    "type": "integer", "minimum": 5, "maximum": 1}}}},
                 "response_format", "response_format: admits no value: Invalid range"),
                ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}},
                 "response_format.json_schema.schema", "response_format.json_schema.schema: admits no value"),
                ({"structured_outputs": {"json": False}}, "structured_outputs",
                 "structured_outputs.json: admits no value: the schema is false"),
                ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"anyOf": []}}}}},
                 "structured_outputs", "structured_outputs.json: admits no value: a part of the schema"),
                ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                    "type": "object", "properties": {"a": {"enum": [1, 2], "type": "string"}}}}}},
                 "response_format", 'response_format: admits no value: properties.a: no value of enum [1, 2] is of '
                                    'type "string"'),
                ({"structured_outputs": {"json": '{"type": "object", "properties": {"a": {}, "a": {}}}'}},
                 "structured_outputs", "structured_outputs.json: key 'a' appears twice in one object"),
                ({"structured_outputs": {"regex": NESTED}}, "structured_outputs",
                 "structured_outputs.regex: too costly to match"),
                ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                    "type": "string", "pattern": "^(((a|b)*){0,30}){0,30}$"}}}},
                 "response_format", "response_format: too costly to match"),
                ({"structured_outputs": {"backend": "outlines"}}, "structured_outputs",
                 "structured_outputs.backend: not supported"),
                ({"guided_json": SCHEMA}, "guided_json", 'send structured_outputs: {"json": ...} instead'),
                ({"response_format": {"type": "grammar"}}, "response_format", "type 'grammar' is not supported"),
                ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
                 "structured_outputs", "give one")):
            with pytest.raises(openai.BadRequestError) as info:
                complete(**extra)
            assert info.value.body["param"] == param and words in info.value.body["message"]
            assert "\n" not in info.value.body["message"].strip()


def test_smollm2_chat_answers_in_the_json_schema_asked_for():
    from tests.conftest import needs_smollm2

    if needs_smollm2.args[0]:
        pytest.skip(needs_smollm2.kwargs["reason"])
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    with serving("smollm2-135m", kv_cache_config={"max_tokens": 2048}) as served:
        reply = served.client.chat.completions.create(
            model=served.state.model_name, max_tokens=48,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    doc = json.loads(choice.message.content)
    assert set(doc) == {"city", "country"} and all(isinstance(v, str) for v in doc.values())
    assert "Paris" in doc["city"]


# --- kvload generate's flags ---------------------------------------------------------------------------------------


def generate(capsys, ckpt, *args):
    """``kvload generate`` in this process, on the CPU, as the Python tests run the checkpoint."""
    return run_cli(capsys, "generate", ckpt, "--prompt", PROMPT, "--max_new_tokens", "48", "--device", "cpu",
                   "--max_seq_len", "64", "--max_tokens", "512", *args)


def test_generate_json_schema_flag_holds_the_output_to_the_schema_inline_or_from_a_file(capsys, bytes_ckpt, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    audit = tmp_path / "gen.jsonl"
    r = generate(capsys, bytes_ckpt, "--json-schema", f"@{schema}", "--disable-any-whitespace", "--json",
                 "--audit-log", audit)
    assert r.code == 0, r.err
    (out,) = r.json()["outputs"][0]["outputs"]
    assert out["finish_reason"] == "stop"
    check_schema(out["text"])
    started = next(e for e in read_events(audit) if e["event"] == "generation_started")
    assert started["structured_outputs"]["kind"] == "json" and started["structured_outputs"]["any_whitespace"] is False
    inline = generate(capsys, bytes_ckpt, "--json_schema", json.dumps(SCHEMA), "--disable_any_whitespace")
    assert inline.code == 0, inline.err
    assert inline.out.splitlines()[0] == out["text"]  # the reply streams as text: the same JSON


@pytest.mark.parametrize(("args", "check"), [
    (("--regex", r"[0-9]{3}-[a-z]{2}(!|\?)"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}(!|\?)", t)),
    (("--grammar", 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "z" [0-9]'),
     lambda t: re.fullmatch(r"\((?:[a-c]|z[0-9])(?:,(?:[a-c]|z[0-9]))*\)", t)),
    (("--json-object", "--disable-any-whitespace"), lambda t: t.startswith("{")),
])
def test_generate_regex_grammar_and_json_object_flags_hold_each_sample_to_them(capsys, bytes_ckpt, args, check):
    r = generate(capsys, bytes_ckpt, *args, "--n", "3", "--temperature", "1.0", "--seed", "4", "--json")
    assert r.code == 0, r.err
    texts = [o["text"] for o in r.json()["outputs"][0]["outputs"]]
    assert len(texts) == 3 and all(check(t) for t in texts), texts


def test_generate_choice_flags_give_one_of_the_choices(capsys, bytes_ckpt):
    seen = set()
    for seed in range(3):
        r = generate(capsys, bytes_ckpt, *[a for c in CHOICES for a in ("--choice", c)], "--n", "4",
                     "--temperature", "2.0", "--seed", str(seed), "--json")
        assert r.code == 0, r.err
        seen |= {o["text"] for o in r.json()["outputs"][0]["outputs"]}
    assert seen <= set(CHOICES) and len(seen) > 1


@pytest.mark.parametrize(("args", "message"), [
    (("--regex", "a", "--choice", "b"), "error: --choice: given with --regex; give one kind of structured output "
                                        "(--json-schema, --regex, --choice, --grammar or --json-object)"),
    (("--json-object", "--json_schema", "{}"), "error: --json_schema: given with --json-object; give one kind"),
    (("--regex", "a", "--regex", "b"), "error: --regex: given more than once; give it once"),
    (("--json-schema", '{"type": "objectx"}'), 'error: --json-schema: xgrammar refused it: Unsupported type "objectx"'),
    (("--regex", "a(b"), "error: --regex: xgrammar refused it: Regex parsing error at position 4: The parenthesis is "
                         "not closed."),
    (("--regex", NESTED), "error: --regex: too costly to match: a repetition of something that may be empty nests"),
    (("--grammar", "root ::= foo"), 'error: --grammar: xgrammar refused it: EBNF parser error at line 1, column 10: '
                                    'Rule "foo" is not defined'),
    (("--grammar", "root ::= root"), "error: --grammar: matches no text: rule root never ends"),  # was one empty token
    (("--grammar", 'root ::= "(" x\nx ::= "a" x'), "error: --grammar: matches no text"),
    (("--json-schema", "{x"), "error: --json-schema: not JSON text"),
    # an integer past Python's 4,300 digits was "not JSON text (Exceeds the limit (4300 digits) for integer string
    # conversion: value has 5000 digits; use sys.set_int_max_str_digits() t)", cut mid-word and naming no field
    (("--json-schema", '{"type": "integer", "maximum": ' + "9" * 5000 + "}"),
     "error: --json-schema: maximum: an integer of 5,000 digits; at most 4,300 digits are accepted\n"),
    (("--json-schema", '{"enum": ["a", -' + "1" * 4301 + "]}"),
     "error: --json-schema: enum[1]: an integer of 4,301 digits; at most 4,300 digits are accepted\n"),
    (("--json-schema", "[1]"), "error: --json-schema: expected a JSON schema object, got a JSON array"),
    (("--json-schema", "null"), "error: --json-schema: expected a JSON schema object, got null"),  # was "JSON NoneType"
    (("--json-schema", '{"type": "string", "minLength": 5, "maxLength": 2}'),
     "error: --json-schema: admits no value: minLength 5 is greater than maxLength 2"),
    (("--json-schema", '{"anyOf": []}'), "error: --json-schema: admits no value: xgrammar's grammar for the schema "
                                         "matches only the empty text"),
    (("--json-schema", "false"), "error: --json-schema: admits no value: the schema is false"),
    # JSON text that json reads and xgrammar reads otherwise: the last "type" of two (xgrammar's own parser may keep
    # the first), 1e400 (xgrammar refused it as "RuntimeError"), NaN
    (("--json-schema", '{"type": "string", "type": "integer"}'),
     "error: --json-schema: key 'type' appears twice in one object; give standard JSON, each key once"),
    (("--json-schema", '{"type": "integer", "maximum": 1e400}'),
     "error: --json-schema: the number 1e400 is past a double's range (about 1.8e308)"),
    (("--json-schema", '{"type": "number", "minimum": NaN}'), "error: --json-schema: NaN is not standard JSON"),
    # xgrammar refused these as '"type mismatch! call is<type>() before get<type>()" && is<std::string>()', and took
    # "type": [] as any value
    (("--json-schema", '{"type": "object", "properties": {"a": {"type": "object", "required": [1]}}}'),
     "error: --json-schema: properties.a.required: expected a list of property names (strings), got [1]"),
    (("--json-schema", '{"type": "string", "pattern": 5}'),
     "error: --json-schema: pattern: expected a regular expression (a string), got 5"),
    (("--json-schema", '{"type": "array", "items": {"type": "string", "format": false}}'),
     "error: --json-schema: items.format: expected a format name (a string), got false"),
    (("--json-schema", '{"type": []}'), "error: --json-schema: type: expected a type name or a non-empty list of them"),
    (("--json-schema", '{"type": "array", "items": {"$ref": "defs.json#/item"}}'),
     "error: --json-schema: items.$ref: 'defs.json#/item' is not a JSON-pointer reference into the schema; xgrammar "
     "resolves only '#' and '#/...' (any JSON value would be matched there) and kvload fetches nothing"),
    (("--json-schema", '{"const": 1, "type": "string"}'),
     'error: --json-schema: admits no value: the schema: const 1 is not of type "string"'),
    (("--json-schema", "@MISSING"), "error: --json-schema: @MISSING: not found"),
    (("--grammar", "@"), "error: --grammar: @ names no file; give @FILE, or a grammar itself"),
    (("--choice", "a", "--choice", ""), "error: --choice #2: expected a non-empty string, got ''"),
    (("--regex", "a", "--disable-any-whitespace"), "error: --disable-any-whitespace: applies to --json-schema and "
                                                   "--json-object (JSON's whitespace), not --regex"),
    (("--disable-any-whitespace",), "error: --disable-any-whitespace: applies to --json-schema and --json-object"),
])
def test_generate_refuses_bad_structured_flags_in_one_line_before_the_model_loads(capsys, bytes_ckpt, tmp_path,
                                                                                  monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)  # @MISSING is looked for here
    monkeypatch.setattr("kvload.api.execute", _never_loads)
    audit = tmp_path / "a.jsonl"
    r = generate(capsys, bytes_ckpt, *args, "--audit-log", audit)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith(message), r.err
    assert not audit.exists()


def _never_loads(*args, **kwargs):
    raise AssertionError("the model was loaded for flags that could be refused before")


def test_generate_json_schema_given_a_path_without_its_at_says_how_to_read_the_file(capsys, bytes_ckpt, tmp_path,
                                                                                     monkeypatch):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    monkeypatch.setattr("kvload.api.execute", _never_loads)
    r = generate(capsys, bytes_ckpt, "--json-schema", str(schema))
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.rstrip().endswith(f"; to read the file {schema}, give @{schema}")


def test_generate_without_xgrammar_names_the_extra_before_the_model_loads(capsys, bytes_ckpt, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    monkeypatch.setattr("kvload.api.execute", _never_loads)
    r = generate(capsys, bytes_ckpt, "--choice", "yes", "--choice", "no")
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err == ("error: --choice: structured outputs need the xgrammar package, which is not installed; "
                     "pip install 'kvload[structured]'\n")


def test_generate_structured_flag_on_a_model_without_a_tokenizer_names_the_flag(capsys, tmp_path):
    audit = tmp_path / "a.jsonl"
    r = run_cli(capsys, "generate", "tiny-llama", "--prompt-ids", "1,2", "--regex", "[0-9]+", "--device", "cpu",
                "--max_tokens", "256", "--audit-log", audit)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith("error: --regex: the grammar is matched on token text, but tiny-llama has no tokenizer")
    assert not audit.exists()


def test_smollm2_generate_answers_in_the_json_schema_and_the_choices_given_as_flags(tmp_path):
    from tests.conftest import needs_smollm2

    if needs_smollm2.args[0]:
        pytest.skip(needs_smollm2.kwargs["reason"])
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                  "required": ["city"], "additionalProperties": False}))
    common = ("generate", "smollm2-135m", "--chat", "--max_tokens", "2048", "--max_new_tokens", "48", "--device",
              "cpu")
    r = kvload_process(*common, "--prompt", "What is the capital of France? Answer in JSON.", "--json-schema",
                       f"@{schema}", "--disable-any-whitespace")
    assert r.code == 0, r.err[-2000:]
    assert json.loads(r.out.splitlines()[0]) == {"city": "Paris"}
    r = kvload_process(*common, "--prompt", "Is Paris in France?", "--choice", "yes", "--choice", "no")
    assert r.code == 0, r.err[-2000:]
    assert r.out.splitlines()[0] in ("yes", "no")


def test_a_repeated_spec_compiles_once_and_only_the_latest_compiled_grammars_are_kept(monkeypatch):
    """A server fed a new schema per request must not grow without bound (xgrammar's own cache, bounded by bytes,
    still grew the process 26 KB a schema once full), and a client repeating one schema must not recompile it."""
    import engine.structured as structured

    monkeypatch.setattr(structured, "COMPILED_GRAMMARS", 3)
    backend = structured.GrammarBackend(trained_tokenizer("bytelevel", 300), 512, {2})
    calls: list[str] = []
    real = backend.compiler.compile_regex
    monkeypatch.setattr(backend.compiler, "compile_regex", lambda spec: calls.append(spec) or real(spec))
    specs = [StructuredOutputsParams(regex=f"a{i}b") for i in range(4)]
    first = backend.compile(specs[0])
    assert backend.compile(StructuredOutputsParams(regex="a0b")) is first and calls == ["a0b"]  # equal spec: kept
    for p in specs[1:]:
        backend.constraint(p)
    assert calls == ["a0b", "a1b", "a2b", "a3b"] and len(backend._grammars) == 3
    backend.compile(specs[0])  # the least recently used went: compiled again
    assert calls[-1] == "a0b" and len(calls) == 5


@pytest.mark.parametrize(("schema", "strict"), [
    ({"type": "object", "properties": {"nm": {"type": "number", "description": "Length of the wave, in nm"}}}, False),
    ({"type": "object", "properties": {"maxLength": {"type": "integer"}}}, False),  # the word, as a property's name
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 12}}}, True),
])
def test_a_schema_is_read_once_per_compile_unless_its_bounded_strings_are_rewritten(monkeypatch, schema, strict):
    """Compiling reads a JSON schema twice (once for the compiled grammar, once, without a tokenizer, for its shape
    checks); the rewrite of length-bounded strings (``_strict_strings``) must add no third and fourth reading where
    the grammar has no such string to rewrite."""
    import xgrammar

    import engine.structured as structured

    backend = structured.GrammarBackend(trained_tokenizer("bytelevel", 300), 512, {2})
    reads: list[str] = []
    parse, compile_schema = xgrammar.Grammar.from_json_schema, xgrammar.GrammarCompiler.compile_json_schema
    monkeypatch.setattr(xgrammar.Grammar, "from_json_schema",
                        staticmethod(lambda *a, **kw: reads.append("parse") or parse(*a, **kw)))
    monkeypatch.setattr(xgrammar.GrammarCompiler, "compile_json_schema",
                        lambda self, *a, **kw: reads.append("compile") or compile_schema(self, *a, **kw))
    compiled = backend.compile(StructuredOutputsParams(json=schema))
    assert len(reads) == 2, reads
    assert ("[^\\0-\\x1f" in str(compiled.grammar)) is strict  # bounded strings: control characters excluded



def test_a_setting_the_grammar_overrules_is_said_once_per_sampling_params_whichever_step_overrules_it(llm):
    """One SamplingParams over three prompts and n=4: its samples reach the grammar's end, where min_tokens is set
    aside, at different steps ("no" before "yes yes yes yes"). It was said once per step that first overruled a
    sample of it (3 lines here, rev65); the call says it once, as its other setting_ignored lines are said."""
    said = lambda: [(e["field"], e["value"]) for e in llm.audit.of("setting_ignored")  # noqa: E731
                    if "the grammar alone chose" in e["reason"]]
    before = len(said())
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["no", "yes yes yes yes"]),
                            min_tokens=12, n=4, temperature=1.0, seed=3, max_tokens=48)
    outs = llm.generate([PROMPT, PROMPT + " x", PROMPT + " y"], params)
    texts = {o.text for r in outs for o in r.outputs}
    assert texts == {"no", "yes yes yes yes"}  # (both ends, so overruled at different steps: what this checks)
    assert said()[before:] == [("generate.min_tokens", 12)]
    # two SamplingParams in one call: each is said once
    other = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["no"]), min_tokens=5, max_tokens=8)
    before = len(said())
    llm.generate([PROMPT, PROMPT + " x", PROMPT + " y"], [params, other, params])
    assert sorted(said()[before:]) == [("generate.min_tokens", 5), ("generate.min_tokens", 12)]
