"""``kvload serve --enable-auto-tool-choice --tool-call-parser hermes`` through the openai client: ``tool_choice:
"auto"`` (or tools without one) lets the model write text, and the ``<tool_call>`` blocks it writes come back as
``message.tool_calls`` (a stream's ``delta.tool_calls``), the rest as ``content``."""

from __future__ import annotations

import json

import pytest

from tests.serve_support import serving
from tests.text_support import bytelevel_checkpoint

TEMPLATE = ("{% for t in tools or [] %}{{ t['function']['name'] }}: {% endfor %}"
            "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}> {% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, CLOCK]
MESSAGES = [{"role": "user", "content": "Hello world, the sky is"}]
#: What the model is made to write (structured outputs' "choice" holds the reply to it): text, a call, a block
#: naming no tool of the request's, more text.
REPLY = ('Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
         '<tool_call>{"name": "get_news", "arguments": {}}</tool_call> Done.')
CONTENT = 'Checking.\n\n<tool_call>{"name": "get_news", "arguments": {}}</tool_call> Done.'


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory):
    """The tiny llama with a byte-level BPE tokenizer (any text spellable, so structured outputs can make it write
    exactly a reply), a chat template that shows the tools, served with the hermes parser."""
    pytest.importorskip("xgrammar")
    dest = bytelevel_checkpoint(tiny_checkpoints("llama"), tmp_path_factory.mktemp("auto") / "ckpt", TEMPLATE)
    with serving(str(dest), state={"tool_call_parser": "hermes", "trust_request_chat_template": True}) as running:
        yield running


def chat(served, stream: bool = False, reply: str | None = REPLY, **kw):
    kw.setdefault("max_tokens", 400)
    if reply is not None:  # the model writes exactly this
        kw["extra_body"] = {"structured_outputs": {"choice": [reply]}, **kw.get("extra_body", {})}
    return served.client.chat.completions.create(model=served.state.model_name, messages=MESSAGES, stream=stream,
                                                 **kw)


def read_stream(chunks) -> tuple[str, list[tuple[int, str, str, str]], list[str | None], list[str], list[int]]:
    """A stream's content joined, its tool calls (index, id, name, arguments joined), each chunk's finish reason,
    what came in order ("content" / "call"), and how many pieces each call's arguments came in. Checks each call's
    first delta names it and the later ones carry only arguments (OpenAI's streaming shape, as vLLM sends it)."""
    content, calls, reasons, order, pieces = "", [], [], [], []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        if choice.delta.content:
            content += choice.delta.content
            order.append("content")
        for delta in choice.delta.tool_calls or []:
            if delta.index == len(calls):  # a new call: named in its first delta
                assert delta.type == "function" and delta.id.startswith("chatcmpl-tool-")
                calls.append([delta.index, delta.id, delta.function.name, delta.function.arguments or ""])
                pieces.append(1)
            else:  # the last call's arguments, a piece more
                assert delta.index == len(calls) - 1 and delta.id is None and delta.function.name is None
                calls[-1][3] += delta.function.arguments
                pieces[-1] += 1
            order.append("call")
    return content, [tuple(c) for c in calls], reasons, order, pieces


@pytest.mark.parametrize("choice", [{"tool_choice": "auto"}, {}])
def test_auto_returns_the_blocks_the_model_wrote_as_tool_calls_and_the_rest_as_content(served, choice):
    reply = chat(served, tools=TOOLS, **choice)
    (c,) = reply.choices
    assert c.finish_reason == "tool_calls"
    (call,) = c.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"zone": "UTC"}
    assert c.message.content == CONTENT  # text around the call, and the block naming no tool, as written
    # the template saw the tools (as with tool_choice "none"), and the grammar is the request's, not a tool's
    shown = chat(served, reply=None, max_tokens=1, tools=TOOLS, tool_choice="none")
    assert reply.usage.prompt_tokens == shown.usage.prompt_tokens
    audit = served.result.audit.of("structured_outputs_requested")[-1]
    assert audit["field"] == "structured_outputs" and audit["tool_choice"] is None


def test_a_stream_sends_the_text_as_it_comes_then_each_call_named_then_its_arguments_in_pieces(served):
    whole = chat(served, tools=TOOLS).choices[0]
    content, calls, reasons, order, pieces = read_stream(chat(served, stream=True, tools=TOOLS))
    assert content == whole.message.content
    ((index, call_id, name, arguments),) = calls
    assert index == 0 and call_id.startswith("chatcmpl-tool-") and name == "get_time"
    assert arguments == whole.message.tool_calls[0].function.arguments == '{"zone": "UTC"}'
    assert pieces[0] > 2  # as the tokens came, not the call whole
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}
    assert order.index("call") > 0 and "content" in order[order.index("call") + 1:]  # text, the call, text


def test_a_reply_without_a_call_is_the_text_as_tool_choice_none_gives_it(served):
    plain = 'No tool needed: 1 < 2, and "<tool" is text.'
    for kw in ({"tool_choice": "none"}, {"tool_choice": "auto"}, {}):
        c = chat(served, reply=plain, tools=TOOLS, **kw).choices[0]
        assert c.finish_reason == "stop" and c.message.content == plain and not c.message.tool_calls
    content, calls, reasons, *_ = read_stream(chat(served, stream=True, reply=plain, tools=TOOLS))
    assert content == plain and calls == [] and reasons[-1] == "stop"
    # greedy, unconstrained: the same text whether the parser reads it or not
    free = {"reply": None, "max_tokens": 24, "tools": TOOLS}
    assert chat(served, **free).choices[0].message.content == \
        chat(served, tool_choice="none", **free).choices[0].message.content


def test_parallel_tool_calls_false_keeps_the_first_call(served):
    two = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    c = chat(served, reply=two, tools=TOOLS).choices[0]
    assert [t.function.name for t in c.message.tool_calls] == ["get_time", "get_weather"] and c.message.content is None
    c = chat(served, reply=two, tools=TOOLS, parallel_tool_calls=False).choices[0]
    assert [t.function.name for t in c.message.tool_calls] == ["get_time"]
    assert c.message.content == two[two.index("<tool_call>", 1):]


def test_the_parser_is_in_the_audit(served):
    (record,) = served.result.audit.of("auto_tool_choice_enabled")
    assert record["parser"] == "hermes"


#: A Hermes-style chat template (as Qwen2.5's and SmolLM2-1.7B's): the tools in the system turn, with the
#: <tool_call> format to answer in.
HERMES_TEMPLATE = """<|im_start|>system
You are a helpful assistant with access to the following functions. Use them if required.
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>
For each function call, return a JSON object with the function name and arguments within <tool_call></tool_call> XML \
tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% for m in messages %}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_smollm2_asked_about_the_weather_calls_get_weather_for_the_city():
    """A real model writes the call: SmolLM2-135M-Instruct under a Hermes template, shown one call in the
    conversation, answers a new question with a <tool_call> block of its own (greedy)."""
    from tests.conftest import needs_smollm2

    if needs_smollm2.args[0]:
        pytest.skip(needs_smollm2.kwargs["reason"])
    messages = [{"role": "user", "content": "What is the weather like in Rome?"},
                {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
                                                 "\n</tool_call>"},
                {"role": "user", "content": "What is the weather like in Paris?"}]
    state = {"tool_call_parser": "hermes", "chat_template": HERMES_TEMPLATE}
    with serving("smollm2-135m", kv_cache_config={"max_tokens": 2048}, state=state) as running:
        ask = {"model": running.state.model_name, "messages": messages, "max_tokens": 48, "tools": [WEATHER]}
        reply = running.client.chat.completions.create(**ask)
        content, calls, reasons, *_ = read_stream(running.client.chat.completions.create(stream=True, **ask))
    (c,) = reply.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert content == "" and [(i, n, a) for i, _, n, a in calls] == [(0, "get_weather", call.function.arguments)]
    assert reasons[-1] == "tool_calls"


#: A template that writes what a tool-use template reads of an agent's turns: the calls (arguments as an object, as
#: transformers documents and vLLM passes them) and the id a tool's answer carries.
RENDER_CALLS = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
                "{% for c in m.get('tool_calls') or [] %}[{{ c['id'] }} {{ c['function']['name'] }} "
                "{{ c['function']['arguments'] | tojson }} {{ c['function']['arguments']['zone'] }}]{% endfor %}"
                "{% if m.get('tool_call_id') %}<{{ m['tool_call_id'] }}>{% endif %}|{% endfor %}")


@pytest.mark.parametrize("dump", [False, True])
def test_an_agents_next_turn_sends_back_the_calls_and_their_answers(served, dump):
    """The openai client's tool loop: the reply's message (its tool_calls, content possibly null; as the client's
    object or its model_dump(), whose refusal, audio, annotations and function_call are null) goes back into the
    conversation with a "tool" message answering each call by its tool_call_id. All were a 400 ("messages[1].
    tool_calls: not supported (text messages only)"), so no agent got past its first call."""
    reply = chat(served, tools=TOOLS)
    message = reply.choices[0].message
    (call,) = message.tool_calls
    turns = [*MESSAGES, message.model_dump() if dump else message,
             {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    again = served.client.chat.completions.create(model=served.state.model_name, messages=turns, tools=TOOLS,
                                                  max_tokens=2)
    assert again.choices[0].finish_reason == "length"
    # what the chat template is given: arguments parsed from their JSON text, and the ids
    bare = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}
    ids = served.http.post("/tokenize", json={"messages": [*MESSAGES, bare, {"role": "tool", "tool_call_id": "call_1",
                                                                              "content": "12:00"}],
                                               "chat_template": RENDER_CALLS}).json()["tokens"]
    text = served.http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == ('user:Hello world, the sky is|assistant:[call_1 get_time {"zone": "UTC"} UTC]'
                    '[call_2 get_weather {} ]|tool:12:00<call_1>|')


@pytest.mark.parametrize(("message", "param", "says"), [
    ({"role": "assistant", "content": None, "tool_calls": "get_time"}, "messages[1].tool_calls", "expected [{"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"arguments": "{}"}}]},
     "messages[1].tool_calls[0].function.name", "the called function's name"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{zone: 1}"}}]},
     "messages[1].tool_calls[0].function.arguments", "expected JSON text"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[NaN]"}}]},
     "messages[1].tool_calls[0].function.arguments", "NaN is not standard JSON"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[" * 40}}]},
     "messages[1].tool_calls[0].function.arguments", "nested deeper than 32 levels"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}, "status": "done"}]},
     "messages[1].tool_calls[0]", "status: not part of a tool call"),
    ({"role": "tool", "content": "12:00", "tool_call_id": 7}, "messages[1].tool_call_id", "expected a string"),
    ({"role": "user", "content": "hi", "tool_call_id": "c"}, "messages[1].tool_call_id",
     "not supported (a tool message's); a message has role, content, name"),
    ({"role": "user", "content": "hi", "tool_calls": []}, "messages[1].tool_calls",
     "not supported (an assistant message's)"),
    ({"role": "assistant", "content": "hi", "audio": {"id": "a"}}, "messages[1].audio",
     "not supported; a message has role, content, name, tool_calls"),
])
def test_a_malformed_tool_turn_is_a_400_naming_it(served, message, param, says):
    r = served.http.post("/v1/chat/completions", json={"model": served.state.model_name, "max_tokens": 1,
                                                        "messages": [*MESSAGES, message]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param) and says in error["message"], error


def test_build_state_refuses_a_parser_kvload_does_not_have(served):
    from kvload.serve.server import build_state
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="tool_call_parser: 'mistral' is no tool-call parser kvload has; it "
                                          "has: hermes, llama3_json, pythonic, llama4_pythonic"):
        build_state(served.result, tool_call_parser="mistral")


#: What the model is made to write under each of the other parsers: two calls, in their format.
OTHERS = {"llama3_json": '{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                         '{"name": "get_weather", "parameters": {"city": "Zürich"}}',
          "pythonic": "[get_time(zone='UTC'), get_weather(city=\"Zürich\")]",
          "llama4_pythonic": "<|python_start|>[get_time(zone='UTC'), get_weather(city=\"Zürich\")]<|python_end|>"}


@pytest.fixture(scope="module", params=sorted(OTHERS))
def served_by(request, tiny_checkpoints, tmp_path_factory):
    """The same model served with the llama3_json, the pythonic or the llama4_pythonic parser."""
    pytest.importorskip("xgrammar")
    dest = bytelevel_checkpoint(tiny_checkpoints("llama"), tmp_path_factory.mktemp(request.param) / "ckpt", TEMPLATE)
    with serving(str(dest), state={"tool_call_parser": request.param}) as running:
        yield request.param, running


def test_the_llama3_json_and_pythonic_parsers_read_their_calls_whole_and_streamed(served_by):
    parser, served = served_by
    reply = chat(served, reply=OTHERS[parser], tools=TOOLS)
    (c,) = reply.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Zürich"})]
    assert [t.function.arguments for t in c.message.tool_calls] == ['{"zone": "UTC"}', '{"city": "Zürich"}']
    content, calls, reasons, _, pieces = read_stream(chat(served, stream=True, reply=OTHERS[parser], tools=TOOLS))
    assert content == "" and reasons[-1] == "tool_calls"
    assert [(i, n, a) for i, _, n, a in calls] == [(i, t.function.name, t.function.arguments)
                                                   for i, t in enumerate(c.message.tool_calls)]
    if parser == "llama3_json":  # JSON arguments stream as the tokens come (pythonic's at each argument's end)
        assert min(pieces) > 2
    # a reply that is not calls is the text, as tool_choice "none" gives it
    plain = "It is sunny; {no call} [here]."
    c = chat(served, reply=plain, tools=TOOLS).choices[0]
    assert c.finish_reason == "stop" and c.message.content == plain and not c.message.tool_calls
    assert read_stream(chat(served, stream=True, reply=plain, tools=TOOLS))[:2] == (plain, [])
    (record,) = served.result.audit.of("auto_tool_choice_enabled")
    assert record["parser"] == parser
