"""``kvload serve --reasoning-parser {deepseek_r1,qwen3}`` through the openai client: a chat reply's thinking comes
back as ``message.reasoning_content`` (a stream's ``delta.reasoning_content``), the answer as ``content``, the
``<think>`` markers in neither. The model is scripted (tests/serve_support.Script) over a byte-level tokenizer, where
each marker spans several tokens, so the stream must hold a marker cut between tokens."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.serve_support import Script, serving
from tests.text_support import bytelevel_checkpoint

#: Qwen3's switch, as its chat template has it: thinking off writes an empty thinking block into the prompt.
TEMPLATE = ("{% for t in tools or [] %}{{ t['function']['name'] }}: {% endfor %}"
            "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}> "
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
            "{% endif %}")
MESSAGES = [{"role": "user", "content": "Hello world, the sky is"}]
THOUGHT = "The sky is blue <b>by day</b>; say so."
ANSWER = "\n\nBlue."
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}


def _serve(tiny_checkpoints, tmp_path_factory, **state):
    dest = bytelevel_checkpoint(tiny_checkpoints("llama"), tmp_path_factory.mktemp("think") / "ckpt", TEMPLATE)
    return serving(str(dest), state=state)


@pytest.fixture(scope="module")
def r1(tiny_checkpoints, tmp_path_factory):
    """Served with ``--reasoning-parser deepseek_r1 --enable-auto-tool-choice --tool-call-parser hermes``."""
    with _serve(tiny_checkpoints, tmp_path_factory, reasoning_parser="deepseek_r1",
                tool_call_parser="hermes") as running:
        yield SimpleNamespace(served=running, script=Script(running.state.engine))


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoints, tmp_path_factory):
    """Served with ``--reasoning-parser qwen3``."""
    with _serve(tiny_checkpoints, tmp_path_factory, reasoning_parser="qwen3") as running:
        yield SimpleNamespace(served=running, script=Script(running.state.engine))


def chat(server, stream: bool = False, **kw):
    kw.setdefault("max_tokens", 200)
    served = server.served
    return served.client.chat.completions.create(model=served.state.model_name, messages=MESSAGES, stream=stream,
                                                 **kw)


def read_stream(chunks) -> dict:
    """A stream's reasoning and content joined, its tool calls, what came in order, finish reasons, logprob entries
    and usage."""
    out = {"reasoning": "", "content": "", "calls": [], "order": [], "reasons": [], "logprobs": 0, "usage": None}
    for chunk in chunks:
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        out["reasons"].append(choice.finish_reason)
        extra = choice.delta.model_extra or {}
        if extra.get("reasoning_content"):
            assert extra["reasoning"] == extra["reasoning_content"]  # vLLM's newer name, the same text
            out["reasoning"] += extra["reasoning_content"]
            out["order"].append("reasoning")
        if choice.delta.content:
            out["content"] += choice.delta.content
            out["order"].append("content")
        for call in choice.delta.tool_calls or []:  # a call's first delta names it; later ones add to its arguments
            if call.index == len(out["calls"]):
                out["calls"].append((call.function.name, ""))
            name, arguments = out["calls"][call.index]
            out["calls"][call.index] = (name, arguments + (call.function.arguments or ""))
        if choice.logprobs is not None:
            out["logprobs"] += len(choice.logprobs.content)
    return out


def message_of(reply):
    (c,) = reply.choices
    extra = c.message.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")
    return c, extra.get("reasoning_content"), c.message.content


def test_the_thinking_is_reasoning_content_and_the_answer_is_content(r1):
    ids = r1.script.say(THOUGHT + "</think>" + ANSWER)
    reply = chat(r1, logprobs=True)
    c, reasoning, content = message_of(reply)
    assert (reasoning, content, c.finish_reason) == (THOUGHT, ANSWER, "stop")
    # every token is counted and scored, the thinking's and the markers' too (the EOS ends it)
    assert reply.usage.completion_tokens == len(ids) + 1 == len(c.logprobs.content)
    assert "".join(t.token for t in c.logprobs.content[:len(ids)]) == THOUGHT + "</think>" + ANSWER


def test_a_stream_sends_the_thinking_then_the_answer_as_the_whole_reply_splits_them(r1):
    r1.script.say("<think>" + THOUGHT + "</think>" + ANSWER)  # a <think> the model writes itself is dropped too
    _, reasoning, content = message_of(chat(r1))
    assert (reasoning, content) == (THOUGHT, ANSWER)
    got = read_stream(chat(r1, stream=True, logprobs=True, stream_options={"include_usage": True}))
    assert (got["reasoning"], got["content"]) == (THOUGHT, ANSWER)  # no marker, nor a piece of one, was sent
    order = got["order"]
    assert order[0] == "reasoning" and order.count("content") >= 1
    assert order == sorted(order, key=["reasoning", "content"].index)  # all the thinking first
    assert got["reasons"][-1] == "stop" and got["logprobs"] == got["usage"].completion_tokens


def test_include_reasoning_false_leaves_the_thinking_out_whole_and_streamed(r1):
    """vLLM's include_reasoning (default true): false answers with the answer alone, the thinking in no field."""
    ids = r1.script.say(THOUGHT + "</think>" + ANSWER)
    reply = chat(r1, extra_body={"include_reasoning": False})
    c, reasoning, content = message_of(reply)
    assert (reasoning, content, c.finish_reason) == (None, ANSWER, "stop")
    assert reply.usage.completion_tokens == len(ids) + 1  # the thinking's tokens were made, and are counted
    got = read_stream(chat(r1, stream=True, extra_body={"include_reasoning": False}))
    assert (got["reasoning"], got["content"], got["order"][0]) == ("", ANSWER, "content")
    assert message_of(chat(r1, extra_body={"include_reasoning": True}))[1:] == (THOUGHT, ANSWER)


@pytest.mark.parametrize("tools", [{}, {"tools": [CLOCK]}])  # an "auto" reply's answer is read for calls
def test_a_reply_cut_before_its_end_marker_is_all_thinking(r1, tools):
    ids = r1.script.say(THOUGHT + "</think>" + ANSWER)
    cut = r1.script.tokenizer.decode(ids[:6])
    c, reasoning, content = message_of(chat(r1, max_tokens=6, **tools))
    assert (reasoning, content, c.finish_reason) == (cut, None, "length") and not c.message.tool_calls
    got = read_stream(chat(r1, stream=True, max_tokens=6, **tools))
    assert (got["reasoning"], got["content"], got["reasons"][-1]) == (cut, "", "length")


@pytest.mark.parametrize("tools", [{}, {"tools": [CLOCK]}])
def test_a_reply_that_ends_with_its_thinking_has_content_null(r1, tools):
    r1.script.say(THOUGHT + "</think>")
    c, reasoning, content = message_of(chat(r1, **tools))
    assert (reasoning, content, c.finish_reason) == (THOUGHT, None, "stop") and not c.message.tool_calls


def test_tool_calls_are_read_from_the_answer_only(r1):
    mention = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    r1.script.say("I could write " + mention + " here.</think>" + call)
    c, reasoning, content = message_of(chat(r1, tools=[CLOCK]))
    assert reasoning == "I could write " + mention + " here." and content is None
    assert c.finish_reason == "tool_calls"
    (made,) = c.message.tool_calls
    assert made.function.name == "get_time" and json.loads(made.function.arguments) == {"zone": "UTC"}
    got = read_stream(chat(r1, stream=True, tools=[CLOCK]))
    assert got["reasoning"] == reasoning and got["calls"] == [("get_time", made.function.arguments)]
    assert got["content"] == "" and got["reasons"][-1] == "tool_calls"


SKY = {"type": "object", "properties": {"sky": {"type": "string"}}, "required": ["sky"], "additionalProperties": False}
SCHEMA_FORMAT = {"response_format": {"type": "json_schema", "json_schema": {"name": "sky", "schema": SKY}}}
#: thinking that no JSON schema would take, and an answer that SKY does
NOT_JSON = "Say {not json} <b>here</b>, then answer."
SKY_ANSWER = '{"sky": "blue"}'
NAMED = {"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}


def test_a_grammar_holds_only_the_answer_after_the_thinking_whole_and_streamed_for_each_choice(r1):
    """vLLM's gate: the thinking runs free and the grammar holds the answer (once a 400 here). Thinking no schema
    would take stays reasoning_content; the content parses against the schema; a stream joins to the whole reply."""
    r1.script.say(NOT_JSON + "</think>" + SKY_ANSWER)
    whole = chat(r1, n=2, **SCHEMA_FORMAT)
    streams = {0: [], 1: []}
    for chunk in chat(r1, stream=True, n=2, **SCHEMA_FORMAT):
        for choice in chunk.choices:
            streams[choice.index].append(SimpleNamespace(choices=[choice], usage=None))
    for c in whole.choices:  # each sample has its own gate
        extra = c.message.model_extra
        assert (extra["reasoning_content"], c.message.content, c.finish_reason) == (NOT_JSON, SKY_ANSWER, "stop")
        assert json.loads(c.message.content) == {"sky": "blue"}
        got = read_stream(streams[c.index])
        assert (got["reasoning"], got["content"], got["reasons"][-1]) == (NOT_JSON, SKY_ANSWER, "stop")
    audit = r1.served.result.audit.of("structured_outputs_requested")[-1]
    assert (audit["field"], audit["reasoning_parser"]) == ("response_format", "deepseek_r1")


def test_the_answer_after_the_thinking_is_held_to_the_grammar(r1):
    r1.script.say(NOT_JSON + "</think>Blue, of course.")  # the scripted answer is no JSON: the grammar refuses it
    c, reasoning, content = message_of(chat(r1, max_tokens=60, **SCHEMA_FORMAT))
    assert reasoning == NOT_JSON and content.startswith('{"sky"')  # what the grammar allowed, not the script
    if c.finish_reason == "stop":
        assert set(json.loads(content)) == {"sky"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_calls_after_the_thinking(r1, stream):
    r1.script.say(NOT_JSON + "</think>" + '{"zone": "UTC"}')
    if stream:
        got = read_stream(chat(r1, stream=True, **NAMED))
        assert (got["reasoning"], got["content"], got["reasons"][-1]) == (NOT_JSON, "", "stop")
        assert got["calls"] == [("get_time", '{"zone": "UTC"}')]
        return
    c, reasoning, content = message_of(chat(r1, **NAMED))
    assert (reasoning, content, c.finish_reason) == (NOT_JSON, "", "stop")
    (call,) = c.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_time", '{"zone": "UTC"}')


def test_a_required_tool_choice_calls_after_the_thinking(r1):
    r1.script.say(NOT_JSON + "</think>" + '[{"name": "get_time", "parameters": {"zone": "UTC"}}]')
    c, reasoning, content = message_of(chat(r1, tools=[CLOCK], tool_choice="required"))
    assert content == ""  # as without thinking: the calls are the answer
    assert (reasoning, c.finish_reason) == (NOT_JSON, "tool_calls")
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_time", {"zone": "UTC"})]
    got = read_stream(chat(r1, stream=True, tools=[CLOCK], tool_choice="required"))
    assert (got["reasoning"], got["reasons"][-1]) == (NOT_JSON, "tool_calls")
    assert got["calls"] == [(t.function.name, t.function.arguments) for t in c.message.tool_calls]


@pytest.mark.parametrize("extra", [SCHEMA_FORMAT, NAMED, {"tools": [CLOCK], "tool_choice": "required"}])
def test_max_tokens_during_the_thinking_ends_the_reply_with_no_answer(r1, extra):
    ids = r1.script.say(NOT_JSON + "</think>" + SKY_ANSWER)
    cut = r1.script.tokenizer.decode(ids[:6])
    c, reasoning, content = message_of(chat(r1, max_tokens=6, **extra))
    assert (reasoning, c.finish_reason, c.message.tool_calls or []) == (cut, "length", [])
    assert content in (None, "")  # content null; a tool_choice reply's content is empty, as without thinking
    got = read_stream(chat(r1, stream=True, max_tokens=6, **extra))
    assert (got["reasoning"], got["content"], got["calls"], got["reasons"][-1]) == (cut, "", [], "length")


def test_qwen3_holds_the_answer_after_its_own_thinking_to_the_grammar(qwen3):
    qwen3.script.say("<think>" + NOT_JSON + "</think>" + SKY_ANSWER)
    c, reasoning, content = message_of(chat(qwen3, **SCHEMA_FORMAT))
    assert (reasoning, content, c.finish_reason) == (NOT_JSON, SKY_ANSWER, "stop")
    got = read_stream(chat(qwen3, stream=True, **SCHEMA_FORMAT))
    assert (got["reasoning"], got["content"]) == (NOT_JSON, SKY_ANSWER)


def test_completions_are_not_split(r1):
    text = THOUGHT + "</think>" + ANSWER
    r1.script.say(text)
    reply = r1.served.client.completions.create(model=r1.served.state.model_name, prompt="Hello", max_tokens=200)
    assert reply.choices[0].text == text


def test_the_parser_is_in_the_audit(r1, qwen3):
    assert [r["parser"] for r in r1.served.result.audit.of("reasoning_parser_enabled")] == ["deepseek_r1"]
    assert [r["parser"] for r in qwen3.served.result.audit.of("reasoning_parser_enabled")] == ["qwen3"]


def test_qwen3_thinks_only_inside_the_markers_the_model_writes(qwen3):
    qwen3.script.say("<think>" + THOUGHT + "</think>" + ANSWER)
    _, reasoning, content = message_of(chat(qwen3))
    assert (reasoning, content) == (THOUGHT, ANSWER)
    got = read_stream(chat(qwen3, stream=True))
    assert (got["reasoning"], got["content"]) == (THOUGHT, ANSWER)
    qwen3.script.say(ANSWER)  # no <think>: an answer only, reasoning_content null (and there, as vLLM's)
    reply = chat(qwen3)
    _, reasoning, content = message_of(reply)
    assert (reasoning, content) == (None, ANSWER) and "reasoning_content" in reply.choices[0].message.model_extra
    got = read_stream(chat(qwen3, stream=True))
    assert (got["reasoning"], got["content"]) == ("", ANSWER)


def _split_reply(path: str, reply: dict) -> tuple:
    """(the thinking or None, the answer's text, the prompt's tokens) of a chat or Responses answer."""
    if path == "/v1/chat/completions":
        message = reply["choices"][0]["message"]
        return message["reasoning_content"], message["content"], reply["usage"]["prompt_tokens"]
    parts = {part["type"]: part for part in reply["output"]}
    thinking = parts["reasoning"]["content"][0]["text"] if "reasoning" in parts else None
    return thinking, parts["message"]["content"][0]["text"], reply["usage"]["input_tokens"]


@pytest.mark.parametrize(("path", "key"), [("/v1/chat/completions", "reasoning_effort"),
                                           ("/v1/responses", "reasoning")])
def test_qwen3_with_an_effort_of_none_does_not_think(qwen3, path, key):
    """vLLM's: an effort of "none" is enable_thinking false for the chat template (Qwen3's switch), so the reply is
    content whole; any other effort leaves the thinking on. Responses' reasoning.effort is chat's reasoning_effort."""
    written = "<think>" + THOUGHT + "</think>" + ANSWER
    qwen3.script.say(written)
    served = qwen3.served
    body = {"model": served.state.model_name, "input" if path == "/v1/responses" else "messages": MESSAGES,
            "max_output_tokens" if path == "/v1/responses" else "max_tokens": 200}

    def ask(effort: str) -> tuple:
        r = served.http.post(path, json={**body, key: effort if key == "reasoning_effort" else {"effort": effort}})
        assert r.status_code == 200, r.text
        return _split_reply(path, r.json())

    thinking, answer, off = ask("none")
    assert (thinking, answer) == (None, written)
    thinking, answer, on = ask("low")
    assert (thinking, answer) == (THOUGHT, ANSWER)
    assert off > on  # the template wrote its empty thinking block for "none"


def test_qwen3_with_thinking_switched_off_answers_in_content_and_takes_a_grammar(qwen3):
    off = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    written = "<think>" + THOUGHT + "</think>" + ANSWER  # whatever the model writes is the answer
    qwen3.script.say(written)
    reply = chat(qwen3, **off)
    _, reasoning, content = message_of(reply)
    assert (reasoning, content) == (None, written)
    assert reply.usage.prompt_tokens > chat(qwen3, max_tokens=1).usage.prompt_tokens  # the template saw the switch
    got = read_stream(chat(qwen3, stream=True, **off))
    assert (got["reasoning"], got["content"]) == ("", written)
    qwen3.script.say("Blue.")
    held = chat(qwen3, extra_body={**off["extra_body"], "structured_outputs": {"choice": ["Blue.", "Grey."]}})
    assert held.choices[0].message.content == "Blue."


#: A call to get_time as each tool-call parser reads one.
CALLS = {"hermes": '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
         "llama3_json": '{"name": "get_time", "parameters": {"zone": "UTC"}}',
         "pythonic": '[get_time(zone="UTC")]'}


@pytest.fixture(scope="module", params=sorted(CALLS))
def qwen3_tools(request, tiny_checkpoints, tmp_path_factory):
    """Served with ``--reasoning-parser qwen3`` and each tool-call parser."""
    with _serve(tiny_checkpoints, tmp_path_factory, reasoning_parser="qwen3",
                tool_call_parser=request.param) as running:
        yield request.param, SimpleNamespace(served=running, script=Script(running.state.engine))


def test_every_tool_call_parser_reads_the_answer_only_whole_and_streamed_for_each_choice(qwen3_tools):
    """The two parsers were written apart and joined in app.py: each choice's thinking is reasoning_content (a call
    written there included), its answer read for calls by the server's tool-call parser, a stream joined per choice
    is the whole reply."""
    parser, server = qwen3_tools
    call = CALLS[parser]
    server.script.say("<think>" + THOUGHT + " " + call + "</think>\n\n" + call)
    whole = chat(server, tools=[CLOCK], n=2)
    streams = {0: [], 1: []}
    for chunk in chat(server, stream=True, tools=[CLOCK], n=2):
        for choice in chunk.choices:
            streams[choice.index].append(SimpleNamespace(choices=[choice], usage=None))
    for c in whole.choices:
        assert (c.message.model_extra["reasoning_content"], c.message.content) == (THOUGHT + " " + call, None)
        assert c.finish_reason == "tool_calls"
        assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
            ("get_time", {"zone": "UTC"})]
        got = read_stream(streams[c.index])
        assert (got["reasoning"], got["content"], got["reasons"][-1]) == (THOUGHT + " " + call, "", "tool_calls")
        assert got["calls"] == [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
