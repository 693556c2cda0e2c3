"""OpenAI's Responses API (``POST /v1/responses``) through the real openai client: ``client.responses.create``, its
stream and ``client.responses.stream``, every body and event checked against ``openai.types.responses``' models. The
model is scripted (tests/serve_support.Script) over a byte-level tokenizer, so each reply is known; a request runs as
the chat request saying the same (the messages the chat template gets are checked), and a refusal names the
Responses body's own field."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Literal

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from tests.serve_support import (
    TIMEOUT,
    Script,
    aborted_on_submit,
    fails_once,
    serving,
    typed_events,
    wait_for,
)
from tests.text_support import bytelevel_checkpoint

#: Shows each tool's name, then every message's role and content (a tool call's name and arguments too).
TEMPLATE = ("{% for t in tools or [] %}{{ t['function']['name'] }}: {% endfor %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
            "{% for c in m.get('tool_calls') or [] %}[{{ c['function']['name'] }}]{% endfor %}\n{% endfor %}"
            "{% if add_generation_prompt %}> {% endif %}")
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "[A-Z][a-z]{0,11}"}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}
CLOCK = {"type": "function", "name": "get_time",
         "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                        "additionalProperties": False}}
EVENTS = TypeAdapter(ResponseStreamEvent)


def _serve(tiny_checkpoints, tmp_path_factory, **state):
    dest = bytelevel_checkpoint(tiny_checkpoints("llama"), tmp_path_factory.mktemp("responses") / "ckpt", TEMPLATE)
    return serving(str(dest), state=state)


class Seen:
    """The conversations the served engine templated, newest last (what the chat template was given)."""

    def __init__(self, engine):
        self.messages: list[list[dict]] = []
        original = engine.encode_messages

        def encode_messages(messages, *args, **kw):
            self.messages.append(json.loads(json.dumps(messages)))
            return original(messages, *args, **kw)

        engine.encode_messages = encode_messages


@pytest.fixture(scope="module")
def plain(tiny_checkpoints, tmp_path_factory):
    """Served without parsers."""
    with _serve(tiny_checkpoints, tmp_path_factory) as running:
        yield SimpleNamespace(served=running, script=Script(running.state.engine), seen=Seen(running.state.engine))


@pytest.fixture(scope="module")
def r1(tiny_checkpoints, tmp_path_factory):
    """Served with ``--reasoning-parser deepseek_r1 --enable-auto-tool-choice --tool-call-parser hermes``."""
    with _serve(tiny_checkpoints, tmp_path_factory, reasoning_parser="deepseek_r1",
                tool_call_parser="hermes") as running:
        yield SimpleNamespace(served=running, script=Script(running.state.engine), seen=Seen(running.state.engine))


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoints, tmp_path_factory):
    """Served with ``--reasoning-parser qwen3``: thinking only from a ``<think>`` the model writes."""
    with _serve(tiny_checkpoints, tmp_path_factory, reasoning_parser="qwen3") as running:
        yield SimpleNamespace(served=running, script=Script(running.state.engine), seen=Seen(running.state.engine))


def create(server, **kw):
    """``client.responses.create``; a whole answer's JSON is checked against openai's Response model first (the
    client builds its objects unchecked)."""
    served = server.served
    kw.setdefault("input", "Hello world, the sky is")
    if kw.get("stream"):
        return served.client.responses.create(model=served.state.model_name, **kw)
    raw = served.client.responses.with_raw_response.create(model=served.state.model_name, **kw)
    Response.model_validate(raw.http_response.json())
    return raw.parse()


def posted(server, **body):
    """The raw JSON answer to ``body``, checked against openai's Response model (no field missing or mistyped)."""
    served = server.served
    r = served.http.post("/v1/responses", json={"model": served.state.model_name, **body})
    assert r.status_code == 200, r.text
    doc = r.json()
    Response.model_validate(doc)
    return doc


def events_of(server, **body) -> list:
    """A raw stream's events, each checked against openai's event models, in order."""
    served = server.served
    out = typed_events(served, "/v1/responses", {"model": served.state.model_name, "stream": True, **body}, EVENTS)
    assert [e.sequence_number for e in out] == list(range(len(out)))
    return out


def refused(server, param: str, **body) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        create(server, **body)
    error = caught.value.body
    assert error["param"] == param, error
    assert caught.value.status_code == 400
    return error["message"]


# --- text -------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "param", "where"), [
    ('"user": "a\\ud800"', "user", "user"),
    ('"metadata": {"k": "a\\ud800"}', "metadata", "metadata.k"),
    ('"metadata": {"k\\ud800": "a"}', "metadata", "metadata"),
    ('"text": {"format": {"type": "json_schema", "name": "a\\ud800", "schema": {"type": "string"}}}', "text.format",
     "text.format.name"),
])
def test_an_echoed_field_holding_a_lone_surrogate_is_a_400_naming_it_not_a_500(plain, field, param, where):
    """The answer echoes ``user``, ``metadata`` and ``text``: a lone surrogate (JSON's "\\ud800") in one failed its
    UTF-8 encoding, HTTP 500 ``UnicodeEncodeError``, after the request had been generated."""
    served = plain.served
    body = b'{"model": %s, "input": "hi", "max_output_tokens": 2, %s}' % (
        json.dumps(served.state.model_name).encode(), field.encode())
    r = served.http.post("/v1/responses", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{where}: not valid Unicode text (a lone surrogate at character ")


def test_vllms_sampling_extras_act_as_on_the_chat_endpoint(plain):
    """vLLM's ResponsesRequest takes stop, seed, ignore_eos, repetition_penalty, logit_bias, skip_special_tokens,
    include_stop_str_in_output and structured_outputs (the openai client sends them in extra_body): each was a 400."""
    plain.script.say("Blue, mostly.")
    cut = create(plain, max_output_tokens=40, extra_body={"stop": [","], "seed": 3, "ignore_eos": False,
                                                          "repetition_penalty": 1.0, "skip_special_tokens": True})
    assert (cut.output_text, cut.status) == ("Blue", "completed")
    kept = create(plain, max_output_tokens=40, extra_body={"stop": ",", "include_stop_str_in_output": True})
    assert kept.output_text == "Blue,"
    comma = plain.script.tokenizer.encode(",", add_special_tokens=False)[0]
    banned = create(plain, max_output_tokens=4, extra_body={"logit_bias": {str(comma): -100}})
    assert not banned.output_text.startswith("Blue,")
    assert "logit_bias" in refused(plain, "logit_bias", extra_body={"logit_bias": {"x": 1}})


def test_vllms_structured_outputs_hold_a_response_as_on_the_chat_endpoint(plain):
    pytest.importorskip("xgrammar")
    plain.script.say("Blue, mostly.")
    held = create(plain, max_output_tokens=40, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert held.output_text in ("yes", "no")
    assert "give one" in refused(plain, "structured_outputs", text={"format": {"type": "json_object"}},
                                 extra_body={"structured_outputs": {"regex": "[a-z]+"}})


def test_a_plain_input_is_answered_as_the_chat_endpoint_answers_it(plain):
    ids = plain.script.say("Blue, mostly.")
    reply = create(plain, max_output_tokens=40, metadata={"run": "7"})
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.status == "completed"
    assert reply.output_text == "Blue, mostly." and reply.metadata == {"run": "7"}
    (message,) = reply.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert plain.seen.messages[-1] == [{"role": "user", "content": "Hello world, the sky is"}]
    chat = plain.served.client.chat.completions.create(model=plain.served.state.model_name, max_tokens=40,
                                                       messages=plain.seen.messages[-1])
    assert chat.choices[0].message.content == reply.output_text
    usage = reply.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, len(ids) + 1)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    # the same prompt again: its prefix is served from the cache, and said so
    long = "Hello world, the sky is " * 6  # past a whole KV block, which the prefix cache keeps
    create(plain, input=long, max_output_tokens=40)
    doc = posted(plain, input=long, max_output_tokens=40)
    assert 0 < doc["usage"]["input_tokens_details"]["cached_tokens"] <= doc["usage"]["input_tokens"]
    # vLLM's request_id names the response (an X-Request-Id header wins)
    assert create(plain, max_output_tokens=2, extra_body={"request_id": "run-7"}).id == "resp_run-7"
    assert create(plain, max_output_tokens=2, extra_body={"request_id": "run-7"},
                  extra_headers={"X-Request-Id": "hdr-1"}).id == "resp_hdr-1"


def test_instructions_and_a_list_of_items_become_the_chat_messages(plain):
    plain.script.say("Noted.")
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello "},
                                                             {"type": "input_text", "text": "there"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Hi.", "annotations": []}]},
             {"role": "user", "content": "Again"}]
    reply = create(plain, input=items, instructions="You are terse.", max_output_tokens=20)
    assert reply.output_text == "Noted." and reply.instructions == "You are terse."
    assert plain.seen.messages[-1] == [{"role": "system", "content": "You are terse."},
                                       {"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hello there"},
                                       {"role": "assistant", "content": "Hi."},
                                       {"role": "user", "content": "Again"}]


def test_a_stream_sends_the_responses_events_in_order_and_the_client_assembles_the_response(plain):
    text = "The sky is blue today."
    plain.script.say(text)
    events = events_of(plain, input="Hello world, the sky is", max_output_tokens=60)
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == text
    start = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    end = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
           "response.completed"]
    assert kinds == start + ["response.output_text.delta"] * len(deltas) + end
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.status == "completed" and final.output_text == text and final.usage.output_tokens > len(deltas)
    assert events[-4].text == text and events[-2].item.content[0].text == text
    assert len({e.response.id for e in (events[0], events[1], events[-1])}) == 1
    # the client's own stream helpers
    streamed = create(plain, stream=True, max_output_tokens=60)
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == text
    with plain.served.client.responses.stream(model=plain.served.state.model_name, input="Hi",
                                              max_output_tokens=60) as stream:
        pieces = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(pieces) == text and final.output_text == text and final.status == "completed"


def test_max_output_tokens_cuts_the_reply_and_the_response_is_incomplete(plain):
    ids = plain.script.say("The sky is blue today, and tomorrow.")
    cut = plain.script.tokenizer.decode(ids[:5])
    reply = create(plain, max_output_tokens=5)
    assert (reply.status, reply.incomplete_details.reason, reply.output_text) == ("incomplete", "max_output_tokens",
                                                                                  cut)
    assert reply.usage.output_tokens == 5 and reply.output[0].status == "incomplete"
    assert reply.max_output_tokens == 5
    events = events_of(plain, input="Hi", max_output_tokens=5)
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == cut
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_a_response_the_servers_stop_cut_short_is_cancelled_and_its_last_item_incomplete(plain, monkeypatch):
    """A request in flight when the server stops ends with chat's "abort": the response is "cancelled", and the item
    it cut short said "completed", as if it were whole."""
    engine = plain.served.state.engine
    plain.script.say("Blue sky and more.")
    aborted_on_submit(monkeypatch, engine)
    doc = posted(plain, input="Hi", max_output_tokens=50)
    assert doc["status"] == "cancelled" and doc["output"][-1]["status"] == "incomplete"
    events = events_of(plain, input="Hi", max_output_tokens=50)
    assert events[-1].response.status == "cancelled" and events[-1].response.output[-1].status == "incomplete"
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]


def test_a_client_that_leaves_a_stream_has_its_request_aborted_and_its_blocks_freed(plain):
    served = plain.served
    plain.script.say("ab " * 400)
    aborted = served.metrics().get("kvload_request_success_total{finished_reason=abort}", 0)
    body = {"model": served.state.model_name, "input": "Hi", "max_output_tokens": 1500, "stream": True}
    with httpx.Client(base_url=served.url, timeout=TIMEOUT) as http, \
            http.stream("POST", "/v1/responses", json=body) as response:
        deltas = 0
        for line in response.iter_lines():
            deltas += '"response.output_text.delta"' in line
            if deltas == 3:
                break
    wait_for(lambda: served.metrics().get("kvload_request_success_total{finished_reason=abort}", 0) == aborted + 1,
             what="the abandoned stream was aborted")
    m = served.metrics()
    assert m["kvload_num_requests_running"] == 0
    assert m["kvload_kv_cache_blocks{layer_group=uniform,state=used}"] == 0


def test_a_client_that_gives_up_on_a_whole_response_has_it_aborted(plain):
    served = plain.served
    plain.script.say("ab " * 400)
    aborted = served.metrics().get("kvload_request_success_total{finished_reason=abort}", 0)
    body = {"model": served.state.model_name, "input": "Hi", "max_output_tokens": 1500}
    with httpx.Client(base_url=served.url, timeout=0.5) as impatient, pytest.raises(httpx.ReadTimeout):
        impatient.post("/v1/responses", json=body)
    wait_for(lambda: served.metrics().get("kvload_request_success_total{finished_reason=abort}", 0) == aborted + 1,
             what="the abandoned request was aborted")
    assert served.metrics()["kvload_kv_cache_blocks{layer_group=uniform,state=used}"] == 0


def test_a_step_the_engine_fails_is_a_500_or_a_failed_event_and_the_blocks_are_freed(plain, monkeypatch):
    served = plain.served
    plain.script.say("Blue.")
    executor = served.state.engine.executor
    fails_once(monkeypatch, executor, "forward_scored", RuntimeError("injected: the device failed"))
    r = served.http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 5})
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "RuntimeError: injected: the device failed", "type": "server_error",
                                  "param": None, "code": None}}
    fails_once(monkeypatch, executor, "forward_scored", RuntimeError("injected again"))
    events = events_of(plain, input="Hi", max_output_tokens=5)
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert failed.error.message == "RuntimeError: injected again"
    assert served.metrics()["kvload_kv_cache_blocks{layer_group=uniform,state=used}"] == 0
    assert create(plain, input="Hi", max_output_tokens=5).output_text == "Blue."  # and it serves on


# --- tools ------------------------------------------------------------------------------------------------------------


def test_a_named_function_call_and_the_next_turn_with_its_output(plain):
    pytest.importorskip("xgrammar")
    plain.script.say('{"city": "Paris"}')  # the grammar lets the scripted arguments through
    named = {"type": "function", "name": "get_weather"}
    reply = create(plain, tools=[WEATHER, CLOCK], tool_choice=named, max_output_tokens=60)
    assert reply.status == "completed" and reply.output_text == ""
    (call,) = reply.output
    assert (call.type, call.name, call.arguments, call.status) == ("function_call", "get_weather", '{"city": "Paris"}',
                                                                   "completed")
    assert call.call_id and call.id.startswith("fc_")
    assert reply.tool_choice.name == "get_weather" and [t.name for t in reply.tools] == ["get_weather", "get_time"]
    assert plain.seen.messages[-1] == [{"role": "user", "content": "Hello world, the sky is"}]
    # the agent's next turn: the call, then its output; the reply is text again
    plain.script.say("It is sunny.")
    after = create(plain, tools=[WEATHER, CLOCK], tool_choice="none", max_output_tokens=30,
                   input=[{"role": "user", "content": "Weather?"}, *[item.model_dump() for item in reply.output],
                          {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert after.output_text == "It is sunny."
    assert plain.seen.messages[-1] == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}]


def test_an_agent_turn_of_text_and_calls_is_one_assistant_message(plain):
    plain.script.say("Done.")
    calls = [{"type": "function_call", "call_id": f"c{i}", "name": "get_time", "arguments": f'{{"zone": "{z}"}}',
              "id": f"fc_{i}", "status": "completed"} for i, z in enumerate(("UTC", "CET"))]
    outputs = [{"type": "function_call_output", "call_id": f"c{i}", "output": t}
               for i, t in enumerate(("1:00", "2:00"))]
    reply = create(plain, tools=[CLOCK], tool_choice="none", max_output_tokens=20, input=[
        {"role": "user", "content": "Times?"}, {"type": "reasoning", "id": "rs_1", "summary": [], "content": []},
        {"role": "assistant", "content": "Let me look."}, *calls, *outputs])
    assert reply.output_text == "Done."
    (user, turn, first, second) = plain.seen.messages[-1]
    assert user == {"role": "user", "content": "Times?"}
    assert turn["role"] == "assistant" and turn["content"] == "Let me look."
    assert [(c["id"], c["function"]["arguments"]) for c in turn["tool_calls"]] == [("c0", {"zone": "UTC"}),
                                                                                  ("c1", {"zone": "CET"})]
    assert (first["tool_call_id"], second["tool_call_id"]) == ("c0", "c1") and first["role"] == second["role"] == "tool"
    # a reply's calls first and its text after them: one turn too
    create(plain, tools=[CLOCK], tool_choice="none", max_output_tokens=20, input=[
        {"role": "user", "content": "Times?"}, *calls, {"role": "assistant", "content": "Looking."}, *outputs])
    turn = plain.seen.messages[-1][1]
    assert turn["content"] == "Looking." and len(turn["tool_calls"]) == 2 and len(plain.seen.messages[-1]) == 4


CALLS = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]'


def test_required_tool_calls_stream_as_function_call_items(plain):
    pytest.importorskip("xgrammar")
    plain.script.say(CALLS)
    reply = create(plain, tools=[WEATHER, CLOCK], tool_choice="required", max_output_tokens=120)
    assert reply.status == "completed"
    assert [(c.type, c.name, c.arguments) for c in reply.output] == [("function_call", "get_time", '{"zone": "UTC"}'),
                                                                     ("function_call", "get_weather",
                                                                      '{"city": "Rome"}')]
    assert len({c.call_id for c in reply.output}) == 2
    events = events_of(plain, input="Hi", tools=[WEATHER, CLOCK], tool_choice="required", max_output_tokens=120)
    final = events[-1].response
    assert final.status == "completed"
    assert [(c.name, c.arguments) for c in final.output] == [(c.name, c.arguments) for c in reply.output]
    for index, item in enumerate(final.output):  # each item's argument deltas, joined, are its arguments
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                  and e.output_index == index]
        assert "".join(pieces) == item.arguments
        (added,) = [e.item for e in events if e.type == "response.output_item.added" and e.output_index == index]
        assert (added.type, added.name, added.call_id, added.arguments) == ("function_call", item.name, item.call_id,
                                                                            "")
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert done == [item.arguments for item in final.output]
    with plain.served.client.responses.stream(model=plain.served.state.model_name, input="Hi", tools=[WEATHER, CLOCK],
                                              tool_choice="required", max_output_tokens=120) as stream:
        final = stream.get_final_response()
    assert [(c.name, c.arguments) for c in final.output] == [(c.name, c.arguments) for c in reply.output]
    assert final.output[1].parsed_arguments == {"city": "Rome"}  # a strict tool's arguments, parsed by the client
    # the client's own objects sent back as the next turn's input, as agents do
    plain.script.say("Noon in Rome.")
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "12:00"} for c in final.output]
    after = create(plain, tools=[WEATHER, CLOCK], tool_choice="none", max_output_tokens=30,
                   input=[{"role": "user", "content": "Hi"}, *final.output, *outputs])
    assert after.output_text == "Noon in Rome."
    (_, turn, *answers) = plain.seen.messages[-1]
    assert [c["id"] for c in turn["tool_calls"]] == [c.call_id for c in final.output]
    assert [a["tool_call_id"] for a in answers] == [c.call_id for c in final.output]


class Sky(BaseModel):
    color: Literal["blue", "grey"]
    n: int


def test_a_json_schema_format_holds_the_reply_to_the_schema(plain):
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"color": {"enum": ["blue", "grey"]}, "n": {"type": "integer"}},
              "required": ["color", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "sky", "schema": schema, "strict": True}
    plain.script.say('{"color": "red", "n": 3}')  # "red" is not in the enum: the grammar refuses it
    reply = create(plain, text={"format": fmt}, max_output_tokens=80)
    doc = json.loads(reply.output_text)
    assert doc["color"] in ("blue", "grey") and isinstance(doc["n"], int)
    assert reply.text.format.type == "json_schema" and reply.text.format.name == "sky"
    asked = plain.served.result.audit.of("structured_outputs_requested")[-1]
    assert (asked["request"], asked["field"], asked["kind"]) == (reply.id, "text.format", "json")
    plain.script.say('{"color": "blue", "n": 3}')
    assert json.loads(create(plain, text={"format": fmt}, max_output_tokens=80).output_text) == {"color": "blue",
                                                                                                 "n": 3}
    # the client's own structured outputs: a pydantic model as the schema, the answer parsed into it
    plain.script.say('{"color": "grey", "n": 12}')
    parsed = plain.served.client.responses.parse(model=plain.served.state.model_name, input="Sky?", text_format=Sky,
                                                 max_output_tokens=80)
    assert parsed.output_parsed == Sky(color="grey", n=12)
    plain.script.say("not json")
    assert isinstance(json.loads(create(plain, text={"format": {"type": "json_object"}},
                                        max_output_tokens=80).output_text), dict)


def test_a_schema_xgrammar_refuses_is_named_as_text_format(plain):
    pytest.importorskip("xgrammar")
    fmt = {"type": "json_schema", "name": "bad", "schema": {"type": "objectx"}}
    assert refused(plain, "text.format", text={"format": fmt}).startswith("text.format: xgrammar refused it")


# --- reasoning --------------------------------------------------------------------------------------------------------

THOUGHT = "The sky is blue <b>by day</b>; say so."
ANSWER = "\n\nBlue."


def test_the_thinking_is_a_reasoning_item_before_the_message(r1):
    ids = r1.script.say(THOUGHT + "</think>" + ANSWER)
    reply = create(r1, max_output_tokens=200, reasoning={"effort": "low"})
    reasoning, message = reply.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == [THOUGHT]
    assert message.type == "message" and reply.output_text == ANSWER
    tok = r1.script.tokenizer  # every token up to the one that completed </think>
    assert reply.usage.output_tokens_details.reasoning_tokens == next(
        i + 1 for i in range(len(ids)) if "</think>" in tok.decode(ids[:i + 1]))
    assert reply.usage.output_tokens == len(ids) + 1
    events = events_of(r1, input="Hi", max_output_tokens=200)
    kinds = [e.type for e in events]
    thinking = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    answer = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(thinking) == THOUGHT and "".join(answer) == ANSWER  # no marker, nor a piece of one
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == THOUGHT and final.output_text == ANSWER
    with r1.served.client.responses.stream(model=r1.served.state.model_name, input="Hi",
                                           max_output_tokens=200) as stream:
        assert stream.get_final_response().output_text == ANSWER


def test_a_reasoning_item_sent_back_is_its_turns_reasoning_for_the_template(r1):
    """An agent sends a reply's output back as input (OpenAI's way, and vLLM's example): its reasoning item was dropped
    and reported, so a template that shows the model its own thinking between tool calls (interleaved thinking) got
    none. As vLLM converts it, the item is the reasoning of the assistant turn after it; kept responses' too."""
    r1.script.say(THOUGHT + "</think>" + ANSWER)
    first = create(r1, input="Sky?", max_output_tokens=200)
    r1.script.say("Ok.")
    create(r1, input=[{"role": "user", "content": "Sky?"}, *[item.model_dump() for item in first.output],
                      {"role": "user", "content": "Sure?"}], max_output_tokens=20)
    user, turn, again = r1.seen.messages[-1]
    assert turn["role"] == "assistant" and turn["content"] == ANSWER
    assert turn["reasoning"] == turn["reasoning_content"] == THOUGHT  # vLLM's two names: templates read either
    assert (user["content"], again["content"]) == ("Sky?", "Sure?")
    r1.script.say("Ok.")  # the same thinking carried by previous_response_id
    create(r1, previous_response_id=first.id, input="Sure?", max_output_tokens=20)
    assert r1.seen.messages[-1][1]["reasoning"] == THOUGHT
    # OpenAI's own reasoning items carry a summary (their content is encrypted): the summary is the thinking
    r1.script.say("Ok.")
    reply = r1.served.client.responses.with_raw_response.create(
        model=r1.served.state.model_name, max_output_tokens=20, input=[
            {"role": "user", "content": "Times?"},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Check the clock."}],
             "encrypted_content": "gAAAA"},
            {"type": "function_call", "call_id": "c0", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c0", "output": "1:00"}])
    _, call, _ = r1.seen.messages[-1]
    assert call["reasoning"] == "Check the clock." and call["tool_calls"][0]["id"] == "c0"
    records = [json.loads(line) for line in r1.served.http.get("/v1/kvload/audit").text.splitlines()]
    assert not [r for r in records if r["event"] == "setting_ignored" and r.get("field") == "serve.input[1]"
                and r["reason"].endswith(f"(request {reply.parse().id})")]


def test_a_reasoning_item_no_turn_follows_or_without_text_is_reported(plain):
    for thinking, why in [
            ({"type": "reasoning", "summary": [{"type": "summary_text", "text": "Hmm."}]},
             "no assistant message or function_call follows it"),
            ({"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}, "only encrypted_content")]:
        plain.script.say("Ok.")
        rid = create(plain, max_output_tokens=10, input=[{"role": "user", "content": "a"}, thinking,
                                                         {"role": "user", "content": "b"}]).id
        assert all("reasoning" not in m for m in plain.seen.messages[-1])
        records = [json.loads(line) for line in plain.served.http.get("/v1/kvload/audit").text.splitlines()]
        (ignored,) = [r for r in records
                      if r["event"] == "setting_ignored" and r["reason"].endswith(f"(request {rid})")]
        assert ignored["field"] == "serve.input[1]" and why in ignored["reason"], ignored


def test_a_reply_cut_while_thinking_has_only_its_reasoning_item(r1):
    ids = r1.script.say(THOUGHT + "</think>" + ANSWER)
    reply = create(r1, max_output_tokens=6)
    (reasoning,) = reply.output
    assert reasoning.content[0].text == r1.script.tokenizer.decode(ids[:6]) and reply.status == "incomplete"
    assert reply.usage.output_tokens_details.reasoning_tokens == 6 and reply.output_text == ""


def test_auto_tool_calls_after_the_thinking_are_function_call_items(r1):
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    r1.script.say(THOUGHT + "</think>" + "Let me look." + call)
    reply = create(r1, tools=[CLOCK], max_output_tokens=200)  # no tool_choice: "auto", read by the hermes parser
    assert [item.type for item in reply.output] == ["reasoning", "message", "function_call"]
    assert reply.output_text == "Let me look." and reply.tool_choice == "auto"
    assert (reply.output[2].name, json.loads(reply.output[2].arguments)) == ("get_time", {"zone": "CET"})
    events = events_of(r1, input="Hi", tools=[CLOCK], max_output_tokens=200)
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Let me look." and final.output[2].arguments == reply.output[2].arguments
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]


def test_under_qwen3_only_a_reply_that_thinks_has_a_reasoning_item_and_reasoning_tokens(qwen3):
    ids = qwen3.script.say("Blue, no thinking.")
    reply = create(qwen3, max_output_tokens=100)
    assert [item.type for item in reply.output] == ["message"] and reply.output_text == "Blue, no thinking."
    assert reply.usage.output_tokens_details.reasoning_tokens == 0 and reply.usage.output_tokens == len(ids) + 1
    tok = qwen3.script.tokenizer
    qwen3.script.say("Hm. <think>" + THOUGHT + "</think>" + ANSWER)
    reply = create(qwen3, max_output_tokens=200)
    # the text before <think> is a message of its own, before the reasoning, as a stream sends them
    assert [item.type for item in reply.output] == ["message", "reasoning", "message"]
    assert reply.output[1].content[0].text == THOUGHT and reply.output_text == "Hm. " + ANSWER
    assert [c.text for c in reply.output[0].content] == ["Hm. "]
    events = events_of(qwen3, input="Hi", max_output_tokens=200)
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "reasoning", "message"]
    assert [(i.content[0].text) for i in final.output] == ["Hm. ", THOUGHT, ANSWER]
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["message", "reasoning", "message"]
    # from the token that began <think> to the one that ended </think> (a token may carry text on either side)
    ids = tok.encode("Hm. <think>" + THOUGHT + "</think>" + ANSWER, add_special_tokens=False)
    first = next(i for i in range(len(ids)) if "<" in tok.decode(ids[:i + 1]))
    last = next(i for i in range(len(ids)) if "</think>" in tok.decode(ids[:i + 1]))
    assert reply.usage.output_tokens_details.reasoning_tokens == last + 1 - first


# --- what is refused, what is reported -------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"extra_body": {"stop_token_ids": [5]}}, "stop_token_ids", "not supported"),
    # chat's names, sent by a client moving from chat: named as sent (they read as "input: not supported", "accepted:
    # ..., input, ..."), with the Responses name
    ({"extra_body": {"messages": [{"role": "user", "content": "a"}]}}, "messages",
     "messages: not supported by kvload serve's /v1/responses (the Responses API calls it input)"),
    ({"extra_body": {"max_tokens": 5}}, "max_tokens",
     "max_tokens: not supported by kvload serve's /v1/responses (the Responses API calls it max_output_tokens)"),
    ({"background": True}, "background", "not supported"),
    ({"truncation": "auto"}, "truncation", "disabled"),
    ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "function tools"),
    ({"tools": [{**CLOCK, "type": "function"}]}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": [CLOCK], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "tool_choice.name: 'nope' is not among the tools"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format", "json_schema"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name", "non-empty string"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": False}}}, "text.format.schema",
     "text.format.schema: admits no value: the schema is false"),
    ({"tools": [{**CLOCK, "parameters": False}]}, "tools[0].parameters", "admits no value: the schema is false"),
    ({"reasoning": {"effort": 3}}, "reasoning.effort", '"low", "medium", "high"'),
    # any string was taken (and reported ignored) where chat's reasoning_effort is checked
    ({"reasoning": {"effort": "ultra"}}, "reasoning.effort", 'expected "none", "minimal", "low"'),
    ({"reasoning": {"summary": "verbose"}}, "reasoning.summary", 'expected "auto", "concise" or "detailed"'),
    ({"max_tool_calls": 0}, "max_tool_calls", "an integer >= 1"),
    ({"extra_body": {"stream_options": {"include_obfuscation": "yes"}}}, "stream_options.include_obfuscation",
     "true or false"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "kvload serves text"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}, "input[1].role", "robot"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "non-empty string"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "item_reference"),
    # an output answering no call before it: OpenAI refuses it ("No tool call found for function call output")
    ({"input": [{"role": "user", "content": "a"}, {"type": "function_call_output", "call_id": "c9", "output": "x"}]},
     "input[1].call_id", "no function_call item before it has call_id 'c9'"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"},
                {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"}]},
     "input[0].call_id", "before its output"),
    ({"max_output_tokens": 10**7}, "max_output_tokens", "max_output_tokens"),
    ({"metadata": {"k": 1}}, "metadata", "string"),
    # an item's id and status are kept and listed back as sent: any JSON there broke input_items for the client
    ({"input": [{"role": "user", "content": "a", "status": {"any": 1}}]}, "input[0].status",
     "expected 'in_progress' or 'completed' or 'incomplete'"),
    ({"input": [{"role": "user", "content": "a", "id": 5}]}, "input[0].id",
     "a string of 1 to 256 printable characters"),
    # falsy formats were read as none given (plain text) and served
    *[({"input": "a", "text": {"format": value}}, "text.format", says)
      for value, says in ((False, "got False"), ("", "got ''"), (0, "got 0"), ({}, "type None is not supported"))],
    ({"input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "phase": "draft"}]},
     "input[1].phase", "'commentary' or 'final_answer'"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "reasoning", "summary": [{"type": "x", "text": "t"}]},
                {"role": "user", "content": "b"}]}, "input[1].summary", '{"type": "summary_text", "text": ...}'),
    ({"input": [{"role": "user", "content": "a"}, {"type": "reasoning", "summary": [],
                                                   "content": [{"type": "reasoning_text", "text": 5}]},
                {"role": "user", "content": "b"}]}, "input[1].content", '{"type": "reasoning_text", "text": ...}'),
])
def test_a_bad_field_is_refused_naming_it(plain, body, param, says):
    assert says in refused(plain, param, **body)


@pytest.mark.parametrize("output", ["ok \ud800", [{"type": "input_text", "text": "ok \ud800"}]])
def test_a_lone_surrogate_in_a_calls_output_is_named_as_the_items_own_field(plain, output):
    """It was named as the tool message the output becomes (``input[1].content``, param ``input``), a field the
    request does not have. Sent as raw JSON: the openai client cannot encode a lone surrogate."""
    body = {"model": plain.served.state.model_name, "input": [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": output}]}
    r = plain.served.http.post("/v1/responses", content=json.dumps(body).encode(),
                               headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "input[1].output", error
    assert error["message"].startswith("input[1].output"), error
    assert "not valid Unicode text (a lone surrogate at character 3" in error["message"], error


def test_call_arguments_that_are_not_json_are_named_as_the_items_own_field(plain):
    # the chat path's name, input[k].tool_calls[j].function.arguments, named a field no item has, and for the second
    # call of one reply the item of the first (the calls join one chat message, named by where it began)
    call = {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{not json"}
    message = refused(plain, "input[2].arguments", instructions="Be brief.",
                      input=[{"role": "user", "content": "a"}, {"type": "reasoning", "id": "rs_1", "summary": []},
                             call, {"type": "function_call_output", "call_id": "c1", "output": "x"}])
    assert message.startswith("input[2].arguments: expected JSON text")
    good = {**call, "call_id": "c0", "arguments": '{"zone": "UTC"}'}
    message = refused(plain, "input[2].arguments", input=[{"role": "user", "content": "a"}, good, call])
    assert message.startswith("input[2].arguments: expected JSON text")


def test_settings_that_change_nothing_are_reported_once(plain):
    plain.script.say("Ok.")
    reply = plain.served.client.responses.with_raw_response.create(
        model=plain.served.state.model_name, input="Hi", store=True, reasoning={"effort": "high"},
        include=["reasoning.encrypted_content"], max_output_tokens=10, text={"verbosity": "low"}, max_tool_calls=3)
    rid = reply.parse().id
    records = [json.loads(line) for line in plain.served.http.get("/v1/kvload/audit").text.splitlines()]
    ignored = {r["field"]: r["value"] for r in records
               if r["event"] == "setting_ignored" and r["reason"].endswith(f"(request {rid})")}
    assert ignored == {"serve.reasoning.effort": "high",  # store: true acts (test_serve_responses_store)
                       "serve.include": "reasoning.encrypted_content", "serve.text.verbosity": "low",
                       "serve.max_tool_calls": 3}  # the openai client takes it (was a 400)


def test_fields_agents_send_by_default_are_reported_not_refused(plain):
    # Codex CLI and other agents send prompt_cache_key (and may send safety_identifier, stream_options) on every
    # request: each was a 400, so the agent could not talk to kvload at all
    plain.script.say("Ok.")
    reply = plain.served.client.responses.with_raw_response.create(
        model=plain.served.state.model_name, input="Hi", max_output_tokens=10, prompt_cache_key="conv-7",
        prompt_cache_retention="in_memory", safety_identifier="user-42",
        extra_body={"stream_options": {"include_obfuscation": False}})
    assert reply.parse().output_text == "Ok."
    rid = reply.parse().id
    records = [json.loads(line) for line in plain.served.http.get("/v1/kvload/audit").text.splitlines()]
    ignored = {r["field"]: r["value"] for r in records
               if r["event"] == "setting_ignored" and r["reason"].endswith(f"(request {rid})")}
    assert ignored == {"serve.prompt_cache_key": "conv-7", "serve.prompt_cache_retention": "in_memory",
                       "serve.safety_identifier": "user-42", "serve.stream_options.include_obfuscation": False}
    message = refused(plain, "stream_options", input="Hi", extra_body={"stream_options": {"include_usage": True}})
    assert message.startswith("stream_options.include_usage: not supported")


def test_the_chat_paths_names_are_read_back_as_the_responses_body_names_them():
    from kvload.serve.responses_input import renamed, to_chat

    _, request = to_chat({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "a"}, {"type": "reasoning", "id": "rs_1"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]})
    assert request.sources == (None, 0, 2)
    assert renamed("messages[0].content: bad", request) == "instructions.content: bad"
    assert renamed("messages[2].tool_calls[0]: bad", request) == "input[2].tool_calls[0]: bad"
    # the operator's flag keeps its name; the request's field takes the Responses one
    assert renamed("max_tokens: lower max_tokens to at most 5, or serve with a larger KV budget (--max_tokens)",
                   request) == ("max_output_tokens: lower max_output_tokens to at most 5, or serve with a larger KV "
                                "budget (--max_tokens)")
    assert renamed("response_format.json_schema.schema.properties.a.maxLength", request) == \
        "text.format.schema.properties.a.maxLength"
    assert renamed("tools[1].function.parameters: xgrammar refused it", request) == \
        "tools[1].parameters: xgrammar refused it"
