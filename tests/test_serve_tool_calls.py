"""Tool calls on the chat endpoint as vLLM makes them without a tool-call parser: ``tool_choice`` naming a function
holds the reply to that function's ``parameters`` schema, ``"required"`` to a JSON array of calls of the tools; the
openai client reads them as ``message.tool_calls`` (and a stream's ``delta.tool_calls``). ``"auto"`` needs a parser
(``--enable-auto-tool-choice --tool-call-parser hermes``, tests/test_serve_tool_parser.py): refused without one, as
is every bad tool or combination, in one line naming the field."""

from __future__ import annotations

import itertools
import json
import re

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvload.serve.protocol import ToolChoice
from kvload.serve.tool_calls import ToolCallText
from tests.serve_support import serving
from tests.text_support import bytelevel_checkpoint, trained_tokenizer

pytest.importorskip("xgrammar")

#: Shows each tool's name before the messages, so a prompt with tools is longer than one without.
TEMPLATE = ("{% for t in tools or [] %}{{ t['function']['name'] }}: {% endfor %}"
            "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}> {% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    # a pattern, not maxLength: xgrammar's rule for maxLength lets raw control characters into the string
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "[A-Z][a-z]{0,11}"},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                   "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
MESSAGES = [{"role": "user", "content": "Hello world, the sky is"}]


def check_arguments(name: str, arguments: str) -> None:
    """``arguments`` is the JSON object ``name``'s schema asks for, checked by hand (no jsonschema dependency)."""
    doc = json.loads(arguments)
    if name == "get_weather":
        assert set(doc) == {"city", "days"} and re.fullmatch("[A-Z][a-z]{0,11}", doc["city"])
        assert isinstance(doc["days"], int) and not isinstance(doc["days"], bool) and 1 <= doc["days"] <= 7
    else:
        assert name == "get_time" and doc in ({"zone": "UTC"}, {"zone": "CET"})


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory):
    """The tiny llama with a byte-level BPE tokenizer (every character spellable) and a chat template that shows
    the tools."""
    dest = bytelevel_checkpoint(tiny_checkpoints("llama"), tmp_path_factory.mktemp("tools") / "ckpt", TEMPLATE)
    with serving(str(dest)) as running:
        yield running


def chat(served, stream: bool = False, **kw):
    kw.setdefault("max_tokens", 400)
    return served.client.chat.completions.create(model=served.state.model_name, messages=MESSAGES, stream=stream,
                                                 **kw)


def streamed_calls(chunks) -> tuple[dict[int, dict[str, str]], list[str | None]]:
    """A stream's tool call deltas joined as a client joins them (by index), and each chunk's finish reason."""
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        assert not choice.delta.content  # the reply is calls, never text
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:  # a call's first delta names it
                assert delta.id.startswith("chatcmpl-tool-") and delta.type == "function" and delta.function.name
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None and delta.function.name is None
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    return calls, reasons


def test_a_named_tool_choice_replies_with_one_call_whose_arguments_match_its_parameters(served):
    named = {"type": "function", "function": {"name": "get_weather"}}
    before = len(served.result.audit.of("structured_outputs_requested"))
    for temperature, seed in ((0.0, None), (1.0, 0), (1.0, 1)):
        reply = chat(served, tools=TOOLS, tool_choice=named, temperature=temperature, seed=seed)
        (choice,) = reply.choices
        assert choice.finish_reason == "stop"  # vLLM's and OpenAI's for a named call
        assert not choice.message.content
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-") and call.function.name == "get_weather"
        check_arguments("get_weather", call.function.arguments)
    asked = served.result.audit.of("structured_outputs_requested")[before:]
    assert [(e["field"], e["tool_choice"], e["kind"]) for e in asked] == [("tool_choice", "named", "json")] * 3
    # the template still shows the tools, as with tool_choice "none"
    plain = chat(served, max_tokens=1)
    shown = chat(served, max_tokens=1, tools=TOOLS, tool_choice="none")
    assert reply.usage.prompt_tokens == shown.usage.prompt_tokens > plain.usage.prompt_tokens


def test_required_replies_with_calls_of_the_tools_each_matching_its_own_parameters(served):
    seen = set()
    for seed in range(3):
        reply = chat(served, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, n=2)
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls" and not choice.message.content
            assert choice.message.tool_calls
            for call in choice.message.tool_calls:
                assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
                check_arguments(call.function.name, call.function.arguments)
                seen.add(call.function.name)
            assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)
    assert seen == {"get_weather", "get_time"}  # either tool may be called
    audit = served.result.audit.of("structured_outputs_requested")[-1]
    assert audit["field"] == "tool_choice" and audit["tool_choice"] == "required"


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_time"}}, "required"])
def test_a_stream_sends_each_call_named_first_then_its_arguments_in_pieces_as_the_whole_answer_has_them(
        served, tool_choice):
    kw = {"tools": TOOLS, "tool_choice": tool_choice, "temperature": 1.0, "seed": 4}
    whole = chat(served, **kw).choices[0]
    calls, reasons = streamed_calls(chat(served, stream=True, **kw))
    assert [c["name"] for c in calls.values()] == [c.function.name for c in whole.message.tool_calls]
    assert [c["arguments"] for c in calls.values()] == [c.function.arguments for c in whole.message.tool_calls]
    assert reasons[-1] == whole.finish_reason and set(reasons[:-1]) == {None}
    assert whole.finish_reason == ("stop" if isinstance(tool_choice, dict) else "tool_calls")
    pieces = sum(1 for c in chat(served, stream=True, **kw) for d in (c.choices[0].delta.tool_calls or [])
                 if c.choices and d.function.arguments)
    assert pieces > len(calls)  # the arguments come token by token, not at the end


def test_a_named_call_cut_by_max_tokens_ends_by_length_with_its_arguments_so_far(served):
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = chat(served, tools=TOOLS, tool_choice=named, max_tokens=3).choices[0]
    assert choice.finish_reason == "length"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    calls, reasons = streamed_calls(chat(served, stream=True, tools=TOOLS, tool_choice=named, max_tokens=3))
    assert calls[0]["arguments"] == call.function.arguments and reasons[-1] == "length"


def test_a_required_reply_a_stop_string_cuts_ends_by_stop_not_tool_calls(served):
    """"tool_calls" says the grammar ended the array; a stop string (here the key's opening quote) cut it short, so
    the reply ends "stop" with the string as its stop_reason, and the calls read so far, as a length cut does."""
    choice = chat(served, tools=TOOLS, tool_choice="required", stop=['"name']).choices[0]
    assert choice.finish_reason == "stop", choice
    assert choice.model_extra.get("stop_reason") == '"name'
    ended = chat(served, tools=TOOLS, tool_choice="required").choices[0]
    assert ended.finish_reason == "tool_calls" and ended.model_extra.get("stop_reason") is None


REFUSED = "holds the reply to tool calls"


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice",
     "start kvload serve with --enable-auto-tool-choice --tool-call-parser "
     "hermes|llama3_json|pythonic|llama4_pythonic (vLLM's "
     "flags); else accepted: "
     '"required" or {"type": "function", "function": {"name": ...}}'),
    ({"tools": TOOLS}, "tools", "start kvload serve with --enable-auto-tool-choice --tool-call-parser "
                                "hermes|llama3_json|pythonic|llama4_pythonic, or pass "
                                'tool_choice "required" or {"type": "function"'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice",
     "tool_choice.function.name: 'get_news' is not among the tools ('get_weather', 'get_time')"),
    ({"tool_choice": "required"}, "tools", "tool_choice: 'required' needs the functions it may call in tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice",
     'expected "none", "required", or {"type": "function", "function": {"name": ...}} ("auto" needs a '
     "tool-call parser: kvload serve --enable-auto-tool-choice --tool-call-parser "
     "hermes|llama3_json|pythonic|llama4_pythonic)"),
    ({"tools": [WEATHER, {"type": "function", "function": {"description": "no name"}}], "tool_choice": "required"},
     "tools[1]", 'expected a {"type": "function", "function": {"name": ...'),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}], "tool_choice": "required"}, "tools[0]",
     'expected a {"type": "function"'),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name",
     "'get_weather' is given twice (tools[0] too)"),
    # under "none" too (it was checked only where a grammar is built): the template shows both to the model
    ({"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "tools[1].function.name",
     "'get_weather' is given twice (tools[0] too)"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": [1]}}], "tool_choice": "required"},
     "tools[0].function.parameters", "expected a JSON schema object, got [1]"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "bad", "parameters": {"type": "objectx"}}}],
      "tool_choice": {"type": "function", "function": {"name": "bad"}}}, "tools[1].function.parameters",
     'tools[1].function.parameters: xgrammar refused it: Unsupported type "objectx"'),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "bad", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools[1].function.parameters",
     'tools[1].function.parameters: xgrammar refused it: Unsupported type "objectx"'),
    # parameters no JSON value satisfies: named by the tool, under "required" too
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "none", "parameters": False}}],
      "tool_choice": "required"}, "tools[1].function.parameters",
     "tools[1].function.parameters: admits no value: the schema is false"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "none", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}}}],
      "tool_choice": "required"}, "tools[1].function.parameters",
     "tools[1].function.parameters: admits no value: Invalid range"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "none", "parameters": {
        "type": "object", "properties": {"n": {"anyOf": []}}, "required": ["n"]}}}],
      "tool_choice": {"type": "function", "function": {"name": "none"}}}, "tools[1].function.parameters",
     "tools[1].function.parameters: admits no value: a part of the schema"),
    # a pattern count xgrammar compiles in time growing with its square (^a{50000}$: 203 s on the parsing thread)
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "slow", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^[0-9]{2100}$"}}}}}],
      "tool_choice": "required"}, "tools[1].function.parameters",
     "tools[1].function.parameters: properties.code.pattern: too costly to compile: a repetition count of 2,100"),
    # an allOf of two schemas: xgrammar matched any JSON value for the whole parameters, their type included
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "both", "parameters": {
        "type": "object", "allOf": [{"required": ["a"]}, {"required": ["b"]}]}}}],
      "tool_choice": "required"}, "tools[1].function.parameters",
     "tools[1].function.parameters: allOf: an allOf of 2 schemas is not held: xgrammar matches any JSON value there"),
    # a $ref xgrammar does not resolve: it matched any JSON value there (and printed a C++ warning line per request)
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "far", "parameters": {
        "type": "object", "properties": {"city": {"$ref": "https://example.com/city.json"}}}}}],
      "tool_choice": "required"}, "tools[1].function.parameters",
     "tools[1].function.parameters: properties.city.$ref: 'https://example.com/city.json' is not a JSON-pointer "
     "reference into the schema"),
    # a pattern nesting repeats that may be empty: xgrammar would take seconds a token to match it, stalling the
    # engine loop for every request
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "slow", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "^(((a|b)*){0,30}){0,30}$"}}}}}],
      "tool_choice": "required"}, "tools[1].function.parameters",
     "tools[1].function.parameters: too costly to match: a repetition of something that may be empty nests"),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls",
     "parallel_tool_calls: expected true or false, got 'no'"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     f"tool_choice: 'required' {REFUSED}, and response_format constrains it too; give one"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
      "structured_outputs": {"regex": "[0-9]+"}}, "tool_choice",
     f"tool_choice: function 'get_time' {REFUSED}, and structured_outputs constrains it too; give one"),
])
def test_what_tool_calling_cannot_take_is_a_400_naming_the_field(served, extra, param, words):
    before = len(served.result.audit.of("structured_outputs_requested"))
    with pytest.raises(openai.BadRequestError) as info:
        chat(served, extra_body=extra)
    body = info.value.body
    assert body["param"] == param and words in body["message"], body
    assert "\n" not in body["message"].strip()
    assert len(served.result.audit.of("structured_outputs_requested")) == before  # nothing was served


def test_parallel_tool_calls_false_holds_a_required_reply_to_one_call(served):
    """vLLM's parallel_tool_calls: absent or true, "required" may make several calls; false, exactly one (the array's
    schema takes one item). The tokens that go on to a next call are biased for, so the model calls on and on unless
    the grammar refuses them (the grammar wins over logit_bias)."""
    tok = served.state.engine.tokenizer
    more = {str(i): 10 for i in range(len(tok)) if tok.decode([i]).strip() == ","}
    kw = {"tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": 0, "n": 2, "logit_bias": more}
    for parallel in ({}, {"parallel_tool_calls": True}):
        for c in chat(served, **parallel, **kw).choices:
            assert c.finish_reason == "length" and len(c.message.tool_calls) > 1
    for c in chat(served, parallel_tool_calls=False, **kw).choices:
        assert c.finish_reason == "tool_calls"
        (call,) = c.message.tool_calls
        check_arguments(call.function.name, call.function.arguments)
    named = {"type": "function", "function": {"name": "get_time"}}  # one call anyway: accepted as is
    (call,) = chat(served, tools=TOOLS, tool_choice=named, parallel_tool_calls=False).choices[0].message.tool_calls
    check_arguments("get_time", call.function.arguments)


def test_a_length_bound_xgrammar_drops_is_reported_once_per_request_named_as_the_request_named_it(served):
    """A string with a pattern (or a format xgrammar knows) is matched by it alone: its minLength/maxLength acted on
    nothing, and only xgrammar's C++ warning on the server's stderr said so. Each is a setting_ignored naming the
    field under the request's own name for the schema: the tool's parameters, response_format's or
    structured_outputs' schema."""
    code = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$", "maxLength": 3},
                                             "day": {"type": "string", "format": "date", "minLength": 10}},
            "required": ["code", "day"], "additionalProperties": False}
    coded = {"type": "function", "function": {"name": "get_code", "parameters": code}}

    def dropped(request_id: str) -> list[tuple[str, object]]:
        records = [json.loads(line) for line in served.http.get("/v1/kvload/audit").text.splitlines()]
        return [(r["field"], r["value"]) for r in records if r["event"] == "setting_ignored"
                and "Length" in r["field"] and r["reason"].endswith(f"(request {request_id})")]

    named = chat(served, tools=[CLOCK, coded], tool_choice={"type": "function", "function": {"name": "get_code"}},
                 max_tokens=4, n=2)  # two choices, one request: one report a bound
    assert dropped(named.id) == [("serve.tools[1].function.parameters.properties.code.maxLength", 3),
                                 ("serve.tools[1].function.parameters.properties.day.minLength", 10)]
    required = chat(served, tools=[coded, CLOCK], tool_choice="required", max_tokens=4)
    assert dropped(required.id) == [("serve.tools[0].function.parameters.properties.code.maxLength", 3),
                                    ("serve.tools[0].function.parameters.properties.day.minLength", 10)]
    other = chat(served, tools=[coded, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}},
                 max_tokens=4)
    assert dropped(other.id) == []  # the tool that holds the reply has no such bound
    fmt = chat(served, max_tokens=4, response_format={"type": "json_schema", "json_schema": {"name": "c",
                                                                                             "schema": code}})
    assert dropped(fmt.id)[0] == ("serve.response_format.json_schema.schema.properties.code.maxLength", 3)
    so = served.client.completions.create(model=served.state.model_name, prompt="Hello", max_tokens=4,
                                          extra_body={"structured_outputs": {"json": code}})
    assert dropped(so.id)[0] == ("serve.structured_outputs.json.properties.code.maxLength", 3)


def test_a_keyword_xgrammar_does_not_enforce_is_reported_named_as_the_request_named_it(served):
    """``not`` compiles and holds nothing: a setting_ignored naming it under the request's own name for the schema."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "not": {"const": "Paris"}}},
              "required": ["city"], "additionalProperties": False}

    def ignored(request_id: str) -> list[str]:
        records = [json.loads(line) for line in served.http.get("/v1/kvload/audit").text.splitlines()]
        return [r["field"] for r in records if r["event"] == "setting_ignored"
                and r["reason"].endswith(f"(request {request_id})")]

    fmt = chat(served, max_tokens=4, response_format={"type": "json_schema", "json_schema": {"name": "c",
                                                                                             "schema": schema}})
    assert ignored(fmt.id) == ["serve.response_format.json_schema.schema.properties.city.not"]
    tool = {"type": "function", "function": {"name": "visit", "parameters": schema}}
    named = chat(served, tools=[CLOCK, tool], tool_choice={"type": "function", "function": {"name": "visit"}},
                 max_tokens=4)
    assert ignored(named.id) == ["serve.tools[1].function.parameters.properties.city.not"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", '"tools": [{"type": "function", "function": {"name": "f\\udc00"}}], '
                             '"tool_choice": "required"', "tools[0].function.name"),
    ("/v1/chat/completions", '"tools": [{"type": "function", "function": {"name": "f", "description": "\\ud800"}}], '
                             '"tool_choice": {"type": "function", "function": {"name": "f"}}', "tools[0]"),
    ("/tokenize", '"tools": [{"type": "function", "function": {"name": "f\\udc00"}}]', "tools[0].function.name"),
    ("/v1/chat/completions", '"chat_template_kwargs": {"x": ["\\udc00"]}', "chat_template_kwargs"),
])
def test_a_lone_surrogate_the_chat_template_would_render_is_a_400_naming_where(served, path, body, param):
    """JSON's "\\udc00" in a tool (or a template variable) reached the tokenizer through the chat template: a 500
    with a traceback, before. Sent as raw JSON text: the openai client cannot encode a lone surrogate."""
    raw = f'{{"model": "{served.state.model_name}", "messages": [{{"role": "user", "content": "hi"}}], {body}}}'
    reply = served.http.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and "not valid Unicode text (a lone surrogate" in error["message"], error
    assert "\n" not in error["message"]
    assert chat(served, max_tokens=2).choices[0].finish_reason == "length"  # still serving


def test_smollm2_calls_the_named_function_with_the_city_asked_about():
    from tests.conftest import needs_smollm2

    if needs_smollm2.args[0]:
        pytest.skip(needs_smollm2.kwargs["reason"])
    with serving("smollm2-135m", kv_cache_config={"max_tokens": 2048}) as running:
        reply = running.client.chat.completions.create(
            model=running.state.model_name, max_tokens=48,
            messages=[{"role": "user", "content": "What is the weather like in Paris today?"}],
            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
        required = running.client.chat.completions.create(
            model=running.state.model_name, max_tokens=96,
            messages=[{"role": "user", "content": "What is the weather like in Paris today?"}],
            tools=TOOLS, tool_choice="required")
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop" and call.function.name == "get_weather"
    check_arguments("get_weather", call.function.arguments)
    assert "Paris" in json.loads(call.function.arguments)["city"]
    assert required.choices[0].finish_reason == "tool_calls"
    for call in required.choices[0].message.tool_calls:
        check_arguments(call.function.name, call.function.arguments)


#: A tool whose parameters refer to themselves (a tree) and to their own properties, as schemas for nested data do.
TREE = {"type": "function", "function": {"name": "plant", "parameters": {
    "type": "object", "properties": {"v": {"type": "integer"}, "w": {"$ref": "#/properties/v"},
                                     "kids": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["v", "w", "kids"], "additionalProperties": False}}}


@pytest.mark.parametrize("tools", [[TREE], [TREE, CLOCK]])
def test_required_keeps_a_tools_own_refs_pointing_into_its_parameters(tools):
    """``"required"`` nests each tool's parameters inside one array schema, where ``"#"`` and ``"#/properties/..."``
    then meant the array: the grammar refused the tree's valid arguments and took a call list as a child instead."""
    from engine.structured import GrammarBackend
    from kvload.serve.protocol import parse

    job = parse({"model": "m", "messages": MESSAGES, "tools": tools, "tool_choice": "required"}, "chat",
                default_max_tokens=16)
    tok = trained_tokenizer("bytelevel", 300)
    backend = GrammarBackend(tok, len(tok), {tok.eos_token_id})

    def takes(text: str) -> bool:
        matcher = backend.constraint(job.params.structured_outputs).matcher
        return matcher.accept_string(text) and matcher.accept_token(tok.eos_token_id)

    tree = '{"v": 1, "w": 2, "kids": [{"v": 3, "w": 4, "kids": []}]}'
    assert takes(f'[{{"name": "plant", "parameters": {tree}}}]')
    assert not takes('[{"name": "plant", "parameters": {"v": 1, "w": "x", "kids": []}}]')
    assert not takes('[{"name": "plant", "parameters": {"v": 1, "w": 2, "kids": [[{"name": "plant", '
                     '"parameters": {"v": 1, "w": 2, "kids": []}}]]}}]')


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                    max_size=3), max_leaves=8)
_SPACES = st.text(alphabet=" \t\n\r", max_size=2)


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(st.tuples(st.text(min_size=1, max_size=6), st.dictionaries(st.text(max_size=4), _JSON,
                                                                                 max_size=3)), min_size=1, max_size=3),
       spaces=st.lists(_SPACES, min_size=12, max_size=12), cuts=st.lists(st.integers(0, 5), min_size=1).filter(any))
def test_required_replies_read_in_any_pieces_give_the_calls_json_reads(calls, spaces, cuts):
    """Whatever whitespace the grammar let in and however the text is cut into stream pieces, each call's name is
    the JSON's, its arguments are its parameters' JSON text (spaces around it dropped), joined from its deltas."""
    s = iter(spaces * 40)
    text = "[" + next(s) + ",".join(
        f'{next(s)}{{{next(s)}"name"{next(s)}:{next(s)}{json.dumps(name)}{next(s)},{next(s)}"parameters"{next(s)}:'
        f'{next(s)}{json.dumps(args, indent=1 if len(name) % 2 else None)}{next(s)}}}{next(s)}'
        for name, args in calls) + "]"
    reader = ToolCallText(ToolChoice(None, None, ()))
    joined: dict[int, list[str]] = {}
    at, pieces = 0, itertools.cycle(cuts)  # a 0: an empty piece
    while at < len(text):
        step = next(pieces)
        for delta in reader.feed(text[at:at + step]):
            entry = joined.setdefault(delta["index"], [delta["function"].get("name"), ""])
            entry[1] += delta["function"]["arguments"]
        at += step
    assert [c["function"]["name"] for c in reader.message()] == [name for name, _ in calls]
    assert [json.loads(c["function"]["arguments"]) for c in reader.message()] == [args for _, args in calls]
    assert [c["function"]["arguments"] for c in reader.message()] == [a for _, a in joined.values()]
    assert all(a == a.strip() for _, a in joined.values())
