"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) through the real anthropic client:
``client.messages.create``, ``client.messages.stream`` and ``client.messages.count_tokens``, every body and event
checked against ``anthropic.types``' models. The model is scripted (tests/serve_support.Script) over a byte-level
tokenizer, so each reply is known; a request runs as the chat request saying the same (the messages the chat template
gets are checked), and a refusal is Anthropic's error document naming the Messages body's own field."""

from __future__ import annotations

import json
from types import SimpleNamespace

import anthropic
import httpx
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from pydantic import TypeAdapter

from tests.serve_support import TIMEOUT, Script, aborted_on_submit, fails_once, serving, typed_events
from tests.test_serve_responses import ANSWER, TEMPLATE, THOUGHT, Seen
from tests.text_support import bytelevel_checkpoint

EVENTS = TypeAdapter(RawMessageStreamEvent)
CLOCK = {"name": "get_time", "description": "The time in a zone",
         "input_schema": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                          "additionalProperties": False}}
WEATHER = {"name": "get_weather",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "pattern": "[A-Z][a-z]{0,11}"}},
                            "required": ["city"], "additionalProperties": False}}
HELLO = [{"role": "user", "content": "Hello world, the sky is"}]
KEY = "sk-messages-test"


def _serve(tiny_checkpoints, tmp_path_factory, **state):
    dest = bytelevel_checkpoint(tiny_checkpoints("llama"), tmp_path_factory.mktemp("messages") / "ckpt", TEMPLATE)
    return serving(str(dest), state=state)


def _server(running, key: str = "unused"):
    engine = running.state.engine
    client = anthropic.Anthropic(base_url=running.url, api_key=key, timeout=TIMEOUT, max_retries=0)
    return SimpleNamespace(served=running, script=Script(engine), seen=Seen(engine), client=client)


@pytest.fixture(scope="module")
def plain(tiny_checkpoints, tmp_path_factory):
    """Served without parsers."""
    with _serve(tiny_checkpoints, tmp_path_factory) as running:
        server = _server(running)
        yield server
        server.client.close()


@pytest.fixture(scope="module")
def r1(tiny_checkpoints, tmp_path_factory):
    """Served with ``--reasoning-parser deepseek_r1 --enable-auto-tool-choice --tool-call-parser hermes``."""
    with _serve(tiny_checkpoints, tmp_path_factory, reasoning_parser="deepseek_r1",
                tool_call_parser="hermes") as running:
        server = _server(running)
        yield server
        server.client.close()


def create(server, **kw) -> Message:
    """``client.messages.create``; the answer's JSON is checked against anthropic's Message model first (the client
    builds its objects unchecked)."""
    kw.setdefault("messages", HELLO)
    kw.setdefault("max_tokens", 60)
    raw = server.client.messages.with_raw_response.create(model=server.served.state.model_name, **kw)
    Message.model_validate(raw.http_response.json())
    return raw.parse()


def events_of(server, **body) -> list:
    """A raw stream's events, each checked against anthropic's event models, in order."""
    served = server.served
    body = {"model": served.state.model_name, "messages": HELLO, "max_tokens": 60, "stream": True, **body}
    return typed_events(served, "/v1/messages", body, EVENTS)


def ignored_settings(server, request_id: str) -> dict:
    records = [json.loads(line) for line in server.served.http.get("/v1/kvload/audit").text.splitlines()]
    return {r["field"]: r["value"] for r in records
            if r["event"] == "setting_ignored" and r["reason"].endswith(f"(request {request_id})")}


# --- text -------------------------------------------------------------------------------------------------------------


def test_a_plain_answer_is_the_chat_endpoints_answer(plain):
    ids = plain.script.say("Blue, mostly.")
    # greedy (this client version sends sampling settings as extra fields)
    reply = create(plain, system="Be brief.", max_tokens=40, metadata={"user_id": "u-7"}, service_tier="auto",
                   extra_body={"temperature": 0, "top_p": 1, "top_k": -1})
    assert (reply.type, reply.role, reply.model) == ("message", "assistant", plain.served.state.model_name)
    assert reply.id.startswith("msg_") and reply.stop_reason == "end_turn" and reply.stop_sequence is None
    assert [(b.type, b.text) for b in reply.content] == [("text", "Blue, mostly.")]
    assert plain.seen.messages[-1] == [{"role": "system", "content": "Be brief."}, *HELLO]
    chat = plain.served.client.chat.completions.create(model=plain.served.state.model_name, max_tokens=40,
                                                       temperature=0, messages=plain.seen.messages[-1])
    assert chat.choices[0].message.content == reply.content[0].text
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (chat.usage.prompt_tokens, len(ids) + 1)
    # metadata changes nothing here: reported, not silently dropped
    assert ignored_settings(plain, reply.id) == {"serve.metadata": {"user_id": "u-7"}}


def test_content_blocks_and_a_system_of_text_blocks_become_the_chat_messages(plain):
    plain.script.say("Noted.")
    reply = create(plain, system=[{"type": "text", "text": "You are "}, {"type": "text", "text": "terse.",
                                                                          "cache_control": {"type": "ephemeral"}}],
                   messages=[{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                                          {"type": "text", "text": "there"}]},
                             {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]},
                             {"role": "user", "content": "Again"}])
    assert reply.content[0].text == "Noted."
    assert plain.seen.messages[-1] == [{"role": "system", "content": "You are terse."},
                                       {"role": "user", "content": "Hello there"},
                                       {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again"}]
    assert ignored_settings(plain, reply.id) == {"serve.system[1].cache_control": {"type": "ephemeral"}}


def test_a_stream_sends_anthropics_events_and_its_text_is_the_whole_answers(plain):
    text = "The sky is blue today."
    plain.script.say(text)
    whole = create(plain)
    events = events_of(plain)
    kinds = [e.type for e in events]
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 1 and "".join(deltas) == text == whole.content[0].text
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * len(deltas),
                     "content_block_stop", "message_delta", "message_stop"]
    start = events[0].message
    assert start.id.startswith("msg_") and start.content == [] and start.usage.input_tokens == whole.usage.input_tokens
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens == whole.usage.output_tokens
    # the client's own stream helper assembles the same message
    with plain.client.messages.stream(model=plain.served.state.model_name, messages=HELLO, max_tokens=60) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text
    assert [(b.type, b.text) for b in final.content] == [("text", text)]
    assert final.stop_reason == "end_turn" and final.usage == whole.usage


def test_a_stop_sequence_ends_the_reply_and_is_named(plain):
    plain.script.say("The sky is blue. Then rain.")
    reply = create(plain, stop_sequences=["nothing", "blue"])
    assert (reply.stop_reason, reply.stop_sequence, reply.content[0].text) == ("stop_sequence", "blue", "The sky is ")
    end = events_of(plain, stop_sequences=["blue"])[-2]
    assert (end.delta.stop_reason, end.delta.stop_sequence) == ("stop_sequence", "blue")


def test_max_tokens_cuts_the_reply_and_says_so(plain):
    ids = plain.script.say("The sky is blue today, and tomorrow.")
    reply = create(plain, max_tokens=5)
    assert (reply.stop_reason, reply.usage.output_tokens) == ("max_tokens", 5)
    assert reply.content[0].text == plain.script.tokenizer.decode(ids[:5])
    assert events_of(plain, max_tokens=5)[-2].delta.stop_reason == "max_tokens"


def test_a_final_assistant_message_is_continued_not_answered(plain):
    plain.script.say(" blue.")
    reply = create(plain, messages=[*HELLO, {"role": "assistant", "content": "The sky is"}])
    assert reply.content[0].text == " blue."
    # the template got the assistant's text last, with no generation prompt after it (Anthropic's prefill)
    prompt = plain.served.http.post("/tokenize", json={"messages": [*HELLO, {"role": "assistant",
                                                                              "content": "The sky is"}],
                                                       "add_generation_prompt": False,
                                                       "continue_final_message": True}).json()
    assert reply.usage.input_tokens == prompt["count"]


def test_count_tokens_is_the_prompts_token_count(plain):
    plain.script.say("Ok.")
    body = {"system": "Be brief.", "messages": [*HELLO, {"role": "assistant", "content": "Blue."},
                                                {"role": "user", "content": "Sure?"}]}
    counted = plain.client.messages.count_tokens(model=plain.served.state.model_name, **body)
    assert isinstance(counted, MessageTokensCount)
    assert counted.input_tokens == create(plain, **body).usage.input_tokens
    chat = [{"role": "system", "content": "Be brief."}, *body["messages"]]
    assert counted.input_tokens == plain.served.http.post("/tokenize", json={"messages": chat}).json()["count"] > 10
    # tools are part of the prompt (the template shows them), and counting them needs no tool-call parser
    with_tools = plain.client.messages.count_tokens(model=plain.served.state.model_name, tools=[CLOCK], **body)
    assert with_tools.input_tokens == create(plain, tools=[CLOCK], tool_choice={"type": "none"},
                                             **body).usage.input_tokens > counted.input_tokens


def test_count_tokens_counts_a_conversation_past_the_context(plain):
    """A client counts to learn how much to trim: a conversation longer than the context is counted (as /tokenize
    counts it), not refused with "leave no room to generate" as /v1/messages refuses it."""
    limit = plain.served.state.engine.executor.max_seq_len
    long = [{"role": "user", "content": " ".join(["sky"] * (2 * limit))}]
    counted = plain.client.messages.count_tokens(model=plain.served.state.model_name, messages=long)
    assert counted.input_tokens == plain.served.http.post("/tokenize", json={"messages": long}).json()["count"]
    assert counted.input_tokens > limit
    with pytest.raises(anthropic.BadRequestError, match="no room to generate"):
        create(plain, messages=long)


def test_claude_codes_attribution_block_is_dropped_so_the_prefix_cache_holds(plain):
    """Claude Code puts a per-request hash first in ``system`` (vLLM drops the block): kept, no turn's prompt began as
    the last one's, so the prefix cache reused nothing."""
    plain.script.say("Ok.")

    def turn(cch: str) -> Message:
        return create(plain, system=[
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.3; cch={cch};"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}])

    first = turn("a1b2c")
    assert plain.seen.messages[-1] == [{"role": "system", "content": "You are Claude Code."}, *HELLO]
    assert ignored_settings(plain, first.id) == {"serve.system[0]": "x-anthropic-billing-header",
                                                 "serve.system[1].cache_control": {"type": "ephemeral"}}
    turn("f9e8d")
    assert plain.seen.messages[-1] == plain.seen.messages[-2]  # the same prompt, whatever the hash


def test_the_clients_request_level_cache_control_and_count_tokens_output_config_are_taken(plain):
    """The anthropic client sends both (automatic caching; count_tokens takes output_config too): each was a 400."""
    name = plain.served.state.model_name
    plain.script.say("Ok.")
    reply = create(plain, cache_control={"type": "ephemeral"})
    assert ignored_settings(plain, reply.id) == {"serve.cache_control": {"type": "ephemeral"}}
    # whatever it holds, as a block's: vLLM's request model drops it unread (kvload refused a non-object with a 400)
    for odd in ("ephemeral", 5, {"type": "persistent", "ttl": 3}):
        plain.script.say("Ok.")
        reply = create(plain, extra_body={"cache_control": odd})
        assert ignored_settings(plain, reply.id) == {"serve.cache_control": odd}
    counted = plain.client.messages.count_tokens(model=name, messages=HELLO)
    shaped = plain.client.messages.count_tokens(
        model=name, messages=HELLO, cache_control={"type": "ephemeral", "ttl": "1h"},
        output_config={"effort": "high", "format": {"type": "json_schema", "schema": {"type": "string"}}})
    assert shaped.input_tokens == counted.input_tokens == reply.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError) as caught:
        plain.client.messages.count_tokens(model=name, messages=HELLO, output_config={"format": {"type": "x"}})
    assert caught.value.body["error"]["message"].startswith("output_config.format: expected")


def test_chat_template_kwargs_reach_the_template_as_on_the_chat_endpoint(plain):
    """vLLM's extra on /v1/messages (Qwen3's enable_thinking is the usual one): the template's variables."""
    name = plain.served.state.model_name
    listed = {"chat_template_kwargs": {"tools": [{"function": {"name": "abc"}}]}}  # the template lists tools' names
    counted = plain.client.messages.count_tokens(model=name, messages=HELLO)
    assert plain.client.messages.count_tokens(model=name, messages=HELLO, extra_body=listed).input_tokens == \
        counted.input_tokens + len("abc: ")
    plain.script.say("Ok.")
    assert create(plain, extra_body=listed).usage.input_tokens == counted.input_tokens + len("abc: ")


def test_output_config_format_holds_the_reply_to_its_schema(plain):
    """Anthropic's structured outputs (the anthropic client's output_config, vLLM's too): the reply is JSON the schema
    admits, whatever the model would say; its effort is reported, as chat's reasoning_effort is."""
    pytest.importorskip("xgrammar")
    plain.script.say("Paris is lovely.")
    reply = create(plain, output_config={"format": {"type": "json_schema",
                                                    "schema": {"type": "string", "enum": ["yes", "no"]}},
                                         "effort": "low"})
    (block,) = reply.content
    assert json.loads(block.text) in ("yes", "no") and reply.stop_reason == "end_turn"
    assert ignored_settings(plain, reply.id) == {"serve.output_config.effort": "low"}
    with pytest.raises(anthropic.BadRequestError) as caught:
        create(plain, output_config={"format": {"type": "json_schema", "schema": False}})
    assert caught.value.body["error"]["message"].startswith("output_config.format.schema: ")
    with pytest.raises(anthropic.BadRequestError) as caught:  # two constraints on one reply, named as sent
        create(plain, tools=[WEATHER], tool_choice={"type": "any"},
               output_config={"format": {"type": "json_schema", "schema": {"type": "string"}}})
    assert "output_config.format constrains it too" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as caught:  # the effort is the template's reasoning_effort (vLLM's)
        create(plain, output_config={"effort": "low"}, extra_body={"chat_template_kwargs": {"reasoning_effort": "x"}})
    assert caught.value.body["error"]["message"].startswith("output_config.effort: given both as output_config.effort")


# --- tools and thinking ----------------------------------------------------------------------------------------------


def test_a_tool_call_is_a_tool_use_block_and_its_result_the_next_turn(r1):
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    r1.script.say(THOUGHT + "</think>" + "Let me look." + call)
    ask = [{"role": "user", "content": "Time?"}]
    reply = create(r1, tools=[CLOCK, WEATHER], messages=ask, max_tokens=200,
                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in reply.content] == ["thinking", "text", "tool_use"]
    thinking, text, use = reply.content
    assert thinking.thinking == THOUGHT and text.text == "Let me look."
    assert (use.name, use.input) == ("get_time", {"zone": "CET"}) and use.id
    assert reply.stop_reason == "tool_use"
    assert ignored_settings(r1, reply.id) == {"serve.thinking.budget_tokens": 1024}
    # the client's next turn: the reply as it came, then the tool's result; the answer is text again
    r1.script.say(THOUGHT + "</think>" + ANSWER)
    after = create(r1, tools=[CLOCK, WEATHER], max_tokens=200, messages=[
        *ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "1:00"},
                                     {"type": "text", "text": "Thanks."}]}])
    assert [b.type for b in after.content] == ["thinking", "text"] and after.content[1].text == ANSWER
    assert after.stop_reason == "end_turn"
    assert r1.seen.messages[-1] == [
        *ask,
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}],
         # the thinking sent back reaches the template as the turn's reasoning, as vLLM converts it (interleaved
         # thinking); it was dropped before
         "reasoning": THOUGHT, "reasoning_content": THOUGHT},
        {"role": "tool", "tool_call_id": use.id, "content": "1:00"}, {"role": "user", "content": "Thanks."}]
    assert "serve.messages[1].content[0]" not in ignored_settings(r1, after.id)


def test_a_streamed_tool_call_is_a_tool_use_block_with_its_input_as_json_deltas(r1):
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    r1.script.say(THOUGHT + "</think>" + call)
    events = events_of(r1, tools=[CLOCK], max_tokens=200)
    started = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert started == ["thinking", "tool_use"]
    thinking = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                       and e.delta.type == "thinking_delta")
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    assert thinking == THOUGHT and json.loads(partial) == {"zone": "UTC"}
    assert events[-2].delta.stop_reason == "tool_use"
    with r1.client.messages.stream(model=r1.served.state.model_name, messages=HELLO, tools=[CLOCK],
                                   max_tokens=200) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [("thinking", None),
                                                                           ("tool_use", {"zone": "UTC"})]
    assert final.content == create(r1, tools=[CLOCK], max_tokens=200).content[:1] + final.content[1:]


def test_a_named_tool_holds_the_reply_to_its_call(plain):
    pytest.importorskip("xgrammar")
    plain.script.say('{"city": "Paris"}')  # the grammar lets the scripted arguments through
    reply = create(plain, tools=[WEATHER, CLOCK], tool_choice={"type": "tool", "name": "get_weather"})
    (use,) = reply.content
    assert (use.type, use.name, use.input, reply.stop_reason) == ("tool_use", "get_weather", {"city": "Paris"},
                                                                  "tool_use")


# --- what is refused, what is reported -------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "says"), [
    ({"max_tokens": None}, "max_tokens: expected an integer of at least 1"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**7}, "max_tokens is too large: 10000000. This model's maximum context length is"),
    ({"container": "c1"}, "container: not supported by kvload serve's /v1/messages"),
    # named as sent: it read "max_tokens: not supported", max_tokens being among the accepted fields
    ({"max_completion_tokens": 5}, "max_completion_tokens: not supported by kvload serve's /v1/messages"),
    ({"output_config": {"format": {"type": "json_object"}}}, 'output_config.format: expected {"type": "json_schema"'),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort: expected \"low\""),
    ({"output_config": {"task_budget": 5}}, "output_config.task_budget: not supported here"),
    ({"service_tier": "priority"}, 'service_tier: expected "auto" or "standard_only" (kvload serves one tier)'),
    ({"messages": [{"role": "system", "content": "a"}]}, "messages[0].role: expected \"user\" or \"assistant\""),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type: 'image' is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id: no tool_use block before it has id 't9'"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type: 'web_search_20250305'"),
    ({"tools": [CLOCK]}, "tool_choice: \"auto\" (the default with tools)"),
    ({"tools": [CLOCK], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name: 'nope' is not among"),
    ({"tools": [{**CLOCK, "input_schema": False}]}, "tools[0].input_schema: admits no value"),
    ({"stop_sequences": "x"}, "stop_sequences: expected a list of strings"),
    ({"stop_sequences": [""]}, "stop_sequences: expected non-empty strings"),
    ({"temperature": "hot"}, "temperature"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens: expected an integer"),
    ({"messages": [*HELLO, {"role": "assistant", "content": [{"type": "thinking", "thinking": 7, "signature": "s"}]},
                   {"role": "user", "content": "and?"}]}, "messages[1].content[0].thinking: expected a string"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "t"}]}]},
     "messages[0].content[0].type: 'thinking' is not supported in a user message"),
    # any object was taken (and reported ignored), though the refusal of a non-object said {"user_id"?}
    ({"metadata": {"user": "u-7"}}, "metadata.user: not supported here; accepted: user_id"),
    ({"metadata": {"user_id": 7}}, "metadata.user_id: expected a string of at most 256 characters"),
    ({"metadata": {"user_id": "u" * 257}}, "metadata.user_id: expected a string of at most 256 characters"),
])
def test_a_bad_field_is_an_anthropic_error_naming_it(plain, body, says):
    with pytest.raises(anthropic.BadRequestError) as caught:  # sent as the body's fields, the client's checks aside
        plain.client.messages.create(model=plain.served.state.model_name, messages=HELLO, max_tokens=10,
                                     extra_body=body)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["type"] == "error", error
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"].startswith(says), error


def test_other_refusals_are_anthropic_errors_too(plain):
    with pytest.raises(anthropic.NotFoundError) as caught:
        plain.client.messages.create(model="claude-sonnet-4-5", messages=HELLO, max_tokens=10)
    assert caught.value.body["error"] == {"type": "not_found_error", "message": caught.value.body["error"]["message"]}
    assert "'claude-sonnet-4-5' is not served here" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        plain.client.messages.count_tokens(model=plain.served.state.model_name, messages=[{"role": "robot",
                                                                                           "content": "a"}])
    assert caught.value.body["error"]["message"].startswith("messages[0].role")
    r = plain.served.http.post("/v1/messages", content=b"{not json")
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["message"].startswith("the request body is not valid JSON")


@pytest.fixture(scope="module")
def keyed(tiny_checkpoints, tmp_path_factory):
    """Served with ``--api-key``."""
    with _serve(tiny_checkpoints, tmp_path_factory, api_keys=[KEY]) as running:
        yield running


def test_the_anthropic_clients_x_api_key_is_taken_as_the_key(keyed):
    model = keyed.state.model_name
    with anthropic.Anthropic(base_url=keyed.url, api_key=KEY, timeout=TIMEOUT, max_retries=0) as client:
        assert client.messages.count_tokens(model=model, messages=HELLO).input_tokens > 0  # sent as X-Api-Key
    with anthropic.Anthropic(base_url=keyed.url, auth_token=KEY, timeout=TIMEOUT, max_retries=0) as client:
        assert client.messages.count_tokens(model=model, messages=HELLO).input_tokens > 0  # Authorization: Bearer
    with anthropic.Anthropic(base_url=keyed.url, api_key="sk-wrong", timeout=TIMEOUT, max_retries=0) as client, \
            pytest.raises(anthropic.AuthenticationError) as caught:
        client.messages.count_tokens(model=model, messages=HELLO)
    assert caught.value.body["error"]["type"] == "authentication_error"
    with httpx.Client(base_url=keyed.url, timeout=TIMEOUT) as http:
        assert http.post("/v1/messages", json={}).status_code == 401
        assert http.post("/tokenize", json={"prompt": "a"}, headers={"X-Api-Key": KEY}).status_code == 200
        refused = http.post("/tokenize", json={"prompt": "a"}, headers={"X-Api-Key": "sk-wrong"})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_a_step_the_engine_fails_is_an_api_error_or_an_error_event_and_the_server_serves_on(plain, monkeypatch):
    served = plain.served
    plain.script.say("Blue.")
    executor = served.state.engine.executor
    fails_once(monkeypatch, executor, "forward_scored", RuntimeError("injected: the device failed"))
    with pytest.raises(anthropic.InternalServerError) as caught:
        create(plain, max_tokens=5)
    assert caught.value.body == {"type": "error", "error": {"type": "api_error",
                                                            "message": "RuntimeError: injected: the device failed"}}
    fails_once(monkeypatch, executor, "forward_scored", RuntimeError("injected again"))
    # read raw (the SDK raises on it): the stream began, and its last event is Anthropic's error
    with served.http.stream("POST", "/v1/messages", json={"model": served.state.model_name, "messages": HELLO,
                                                           "max_tokens": 5, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[0] == "event: message_start" and lines[-2] == "event: error"
    assert json.loads(lines[-1].removeprefix("data: ")) == {"type": "error", "error": {
        "type": "api_error", "message": "RuntimeError: injected again"}}
    assert served.metrics()["kvload_kv_cache_blocks{layer_group=uniform,state=used}"] == 0
    assert create(plain, max_tokens=5).content[0].text == "Blue."  # and it serves on
    assert plain.served.http.get("/v1/messages").json()["type"] == "error"  # a wrong method: Anthropic's document too


def test_an_answer_the_servers_stop_cut_short_is_an_overloaded_error_never_end_turn(plain, monkeypatch):
    """Anthropic has no stop reason for chat's ``abort`` (what a request in flight ends with when the server stops):
    ``end_turn`` would tell the client the answer was whole."""
    served, engine = plain.served, plain.served.state.engine
    plain.script.say("Blue sky and more.")
    aborted_on_submit(monkeypatch, engine)
    with pytest.raises(anthropic.InternalServerError) as caught:
        create(plain, max_tokens=50)
    assert caught.value.status_code == 503 and caught.value.body["error"]["type"] == "overloaded_error"
    assert "shutting down" in caught.value.body["error"]["message"]
    with served.http.stream("POST", "/v1/messages", json={"model": served.state.model_name, "messages": HELLO,
                                                           "max_tokens": 50, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[0] == "event: message_start" and lines[-2] == "event: error"
    assert json.loads(lines[-1].removeprefix("data: "))["error"]["type"] == "overloaded_error"
    assert not any("end_turn" in line for line in lines)
    monkeypatch.undo()
    assert create(plain, max_tokens=50).stop_reason == "end_turn"  # a whole answer still says so


def test_settings_that_change_nothing_here_are_reported(plain):
    plain.script.say("Ok.")
    reply = create(plain, thinking={"type": "enabled", "budget_tokens": 2048}, tools=[CLOCK],
                   tool_choice={"type": "none"}, messages=[
                       {"role": "user", "content": "Time?"},
                       {"role": "assistant", "content": [
                           {"type": "redacted_thinking", "data": "opaque"},
                           {"type": "tool_use", "id": "t1", "name": "get_time", "input": {"zone": "UTC"}}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                                     "content": [{"type": "text", "text": "no clock"}]}]}])
    assert reply.content[0].text == "Ok."
    assert ignored_settings(plain, reply.id) == {"serve.thinking": "enabled",  # no --reasoning-parser here
                                                 "serve.messages[1].content[0]": "redacted_thinking",
                                                 "serve.messages[2].content[0].is_error": True}
    assert plain.seen.messages[-1][1:] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "no clock"}]


def test_two_tools_of_one_name_are_refused_under_the_default_auto_choice_too(r1):
    """Messages' default tool_choice is "auto": the chat path checked names only for a grammar ("any", "tool")."""
    with pytest.raises(anthropic.BadRequestError) as caught:
        create(r1, tools=[CLOCK, {**WEATHER, "name": CLOCK["name"]}])
    assert caught.value.body["error"]["message"] == ("tools[1].name: 'get_time' is given twice (tools[0] too); each "
                                                     "tool needs its own name")


def test_disable_parallel_tool_use_keeps_the_reply_to_one_call(r1):
    calls = "".join(f'<tool_call>{{"name": "get_time", "arguments": {{"zone": "{z}"}}}}</tool_call>'
                    for z in ("UTC", "CET"))
    r1.script.say(THOUGHT + "</think>" + calls)
    both = create(r1, tools=[CLOCK], max_tokens=200)
    assert [b.input for b in both.content if b.type == "tool_use"] == [{"zone": "UTC"}, {"zone": "CET"}]
    one = create(r1, tools=[CLOCK], max_tokens=200, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.input for b in one.content if b.type == "tool_use"] == [{"zone": "UTC"}]
    assert one.stop_reason == "tool_use"


def test_the_chat_paths_names_are_read_back_as_the_messages_body_names_them():
    from kvload.serve.messages_input import renamed, to_chat

    chat, request = to_chat({"model": "m", "max_tokens": 5, "system": "Be brief.", "stop_sequences": ["x"],
                             "messages": [
                                 {"role": "user", "content": "a"},
                                 {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                    "input": {}}]},
                                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"},
                                                              {"type": "text", "text": "b"}]}]})
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool", "user"]
    assert request.sources == ("system", "messages[0]", "messages[1]", "messages[2].content[0]", "messages[2]")
    assert renamed("messages[3].content: bad", request) == "messages[2].content[0].content: bad"
    assert renamed("messages[0].content: bad", request) == "system.content: bad"
    assert renamed("tools[1].function.parameters: xgrammar refused it", request) == \
        "tools[1].input_schema: xgrammar refused it"
    assert renamed("stop[0]: too long", request) == "stop_sequences[0]: too long"
    assert renamed("stop: too many", request) == "stop_sequences: too many"


def test_a_tool_call_with_an_integer_json_cannot_write_is_one_error_naming_the_call_and_where():
    """A grammar's integer has no length bound, so a model may write 5,000 digits in a tool's arguments: parsing them
    for the tool_use block raised json's ValueError ("Exceeds the limit (4300 digits) ..."), a 500 with a traceback;
    its text was read into {} only when it was cut short. Now one Anthropic error naming the call and the place."""
    from kvload.serve.messages_input import AnthropicError
    from kvload.serve.messages_output import _tool_use

    call = {"id": "c", "function": {"name": "count", "arguments": '{"n": [2, ' + "9" * 5000 + "]}"}}
    with pytest.raises(AnthropicError) as caught:
        _tool_use(call)
    assert caught.value.status == 500 and caught.value.body()["error"] == {
        "type": "api_error",
        "message": "the model's call of 'count' holds an integer of 5,000 digits at n[1], past the 4,300 a tool_use "
                   "block's input can hold; ask for a stream (its input comes as JSON text) or use "
                   "/v1/chat/completions (arguments as text)"}
    assert _tool_use({**call, "function": {"name": "count", "arguments": '{"n": [2, ' + "9" * 4300 + "]}"}})[
        "input"] == {"n": [2, int("9" * 4300)]}  # at the limit: read as before


@pytest.mark.parametrize("block, field", [
    ({"type": "thinking", "thinking": "a\ud800", "signature": "s"}, "thinking"),
    ({"type": "thinking", "thinking": "a", "signature": 5}, "signature"),
    ({"type": "thinking", "thinking": "a", "signature": {"a": [1]}}, "signature"),
    ({"type": "redacted_thinking", "data": 10**30}, "data"),
    ({"type": "redacted_thinking", "data": "x", "zzz": 1}, "zzz")])
def test_a_thinking_blocks_bad_field_is_refused_naming_the_block_s_own_field(plain, block, field):
    """A thinking block's lone surrogate was named as the chat path's messages[1].reasoning, a field the Messages
    body does not have; a signature or redacted_thinking's data of any JSON (and any extra key) was served."""
    body = {"model": plain.served.state.model_name, "max_tokens": 5, "messages": [
        *HELLO, {"role": "assistant", "content": [block, {"type": "text", "text": "Hi."}]},
        {"role": "user", "content": "More."}]}
    r = plain.served.http.post("/v1/messages", content=json.dumps(body).encode(),
                               headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error", error
    assert error["message"].startswith(f"messages[1].content[0].{field}: "), error
