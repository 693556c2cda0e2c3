"""The request checks of ``kvload serve`` alone: any JSON body is either a Job or a BadRequest naming a field."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling_params import SamplingParams
from kvload.serve.protocol import BadRequest, parse
from pipeline.errors import GenerationError
from pipeline.limits import MAX_LOGPROBS, MAX_SALT_CHARS, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
          "stream", "stream_options", "logprobs", "top_logprobs", "stop_token_ids", "ignore_eos", "echo", "salt",
          "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
          "add_special_tokens", "cache_salt", "prompt_logprobs", "truncate_prompt_tokens", "request_id",
          "response_format", "priority", "best_of", "tools", "tool_choice", "structured_outputs", "guided_json"]
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6)


@settings(max_examples=100, deadline=None)
@given(body=bodies, kind=st.sampled_from(["completion", "chat"]))
def test_any_body_is_a_job_or_a_400_naming_a_field(body, kind):
    try:
        job = parse(body, kind, default_max_tokens=16)
    except BadRequest as exc:
        assert exc.status == 400 and exc.message
        assert exc.param is None or exc.param.split("[")[0].split(".")[0] in (*FIELDS, "max_completion_tokens")
        return
    assert job.params.max_tokens >= 1 and job.n >= 1 and job.prompts


def test_a_good_chat_body_becomes_sampling_params():
    job = parse({"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                                            {"role": "user", "content": "hi"}],
                 "max_completion_tokens": 5, "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": "x", "n": 2,
                 "logprobs": True, "top_logprobs": 2, "stream": True, "stream_options": {"include_usage": True}},
                "chat", default_max_tokens=16)
    assert job.prompts == [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]]
    p = job.params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop, p.logprobs) == (5, 0.7, 0.9, 3, ["x"], 2)
    assert job.n == 2 and job.stream and job.include_usage and job.max_tokens_given


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 3},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name"),
])
def test_chat_refusals_name_the_field(body, param):
    with pytest.raises(BadRequest) as info:
        parse(body, "chat", default_max_tokens=16)
    assert info.value.param == param


def test_a_message_name_reaches_the_chat_template_as_in_the_python_api():
    """llm.chat passes a message's other keys to the template; the server accepted `name` and dropped it."""
    job = parse({"messages": [{"role": "user", "content": "hi", "name": "ada"}]}, "chat", default_max_tokens=16)
    assert job.prompts == [[{"role": "user", "content": "hi", "name": "ada"}]]


@pytest.mark.parametrize("field, value", [
    ("stop", ["s"] * (MAX_STOP + 1)),
    ("stop", ["ok", "x" * (MAX_STOP_CHARS + 1)]),
    ("stop_token_ids", [2] * (MAX_STOP_TOKEN_IDS + 1)),
    ("logprobs", MAX_LOGPROBS + 1),
    ("max_tokens", 2**63),
    ("top_k", 2**63),
])
def test_the_server_refuses_a_size_the_python_api_refuses_with_the_same_line(field, value):
    """One bound per field (``pipeline.limits``) for ``SamplingParams`` and the server, said in the same words."""
    with pytest.raises(GenerationError) as api:
        SamplingParams(**{field: value})
    with pytest.raises(BadRequest) as served:
        parse({"prompt": [1, 2], field: value}, "completion", default_max_tokens=16)
    assert served.value.message == str(api.value).removeprefix("generate: ")
    assert served.value.param == field and served.value.status == 400


def test_the_server_takes_every_bound_itself_as_the_python_api_does():
    body = {"prompt": [1, 2], "stop": ["s" * MAX_STOP_CHARS] * MAX_STOP,
            "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS)), "logprobs": MAX_LOGPROBS}
    p = parse(body, "completion", default_max_tokens=16).params
    assert (len(p.stop), len(p.stop_token_ids), p.logprobs) == (MAX_STOP, MAX_STOP_TOKEN_IDS, MAX_LOGPROBS)
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": MAX_LOGPROBS}
    assert parse(chat, "chat", default_max_tokens=16).params.logprobs == MAX_LOGPROBS


def test_the_server_bounds_a_salt_as_the_python_api_does():
    """A salt is hashed into every block key of its request and cached per salt: its length is bounded."""
    from engine.sampling_params import check_salt

    salt = "s" * (MAX_SALT_CHARS + 1)
    with pytest.raises(GenerationError) as api:
        check_salt(salt)
    with pytest.raises(BadRequest) as served:
        parse({"prompt": [1, 2], "salt": salt}, "completion", default_max_tokens=16)
    assert served.value.message == str(api.value).removeprefix("generate: ") == (
        f"salt: expected a string of at most {MAX_SALT_CHARS:,} characters, got {MAX_SALT_CHARS + 1:,}")
    assert served.value.param == "salt"
    assert parse({"prompt": [1, 2], "salt": "s" * MAX_SALT_CHARS}, "completion", default_max_tokens=16).salt


def test_chat_takes_vllms_template_options_checked_by_the_python_apis_rules():
    messages = [{"role": "user", "content": "hi"}]
    job = parse({"messages": messages, "add_generation_prompt": False, "continue_final_message": True,
                 "chat_template": "{{ x }}", "chat_template_kwargs": {"enable_thinking": False},
                 "add_special_tokens": True}, "chat", default_max_tokens=16)
    assert job.template == {"enable_thinking": False, "add_generation_prompt": False, "continue_final_message": True,
                            "chat_template": "{{ x }}"}
    assert job.add_special_tokens is True
    plain = parse({"messages": messages, "chat_template": None}, "chat", default_max_tokens=16)
    assert plain.template == {"add_generation_prompt": True, "continue_final_message": False}
    assert plain.add_special_tokens is False  # vLLM's chat default; a completion's text gets them
    assert parse({"prompt": "hi"}, "completion", default_max_tokens=16).add_special_tokens is True
    with pytest.raises(BadRequest) as info:
        parse({"messages": messages, "continue_final_message": True}, "chat", default_max_tokens=16)
    assert info.value.param == "continue_final_message" and info.value.message.startswith("continue_final_message: ")
    with pytest.raises(BadRequest) as info:  # a chat option, not a completion's
        parse({"prompt": "hi", "chat_template_kwargs": {}}, "completion", default_max_tokens=16)
    assert info.value.param == "chat_template_kwargs"


def test_chat_template_kwargs_may_not_name_a_setting_of_apply_chat_template():
    """A chat_template_kwargs key reaches transformers' apply_chat_template as a keyword: one of its own settings
    was taken as that setting, not as a template variable, and did nothing (padding, return_tensors: 200 OK),
    failed as if the model's template had refused the conversation (return_assistant_tokens_mask), or raised
    "got multiple values for argument 'self'". Every parameter of the installed transformers' apply_chat_template
    but tools and documents (template variables too) is refused, naming the field."""
    import inspect

    from transformers import PreTrainedTokenizerBase

    names = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"kwargs", "tools",
                                                                                                "documents"}
    assert {"padding", "return_tensors", "self", "sanitize_control_tokens"} <= names
    messages = [{"role": "user", "content": "hi"}]
    for name in sorted(names):
        with pytest.raises(BadRequest) as info:
            parse({"messages": messages, "chat_template_kwargs": {name: 1}}, "chat", default_max_tokens=16)
        assert info.value.param == "chat_template_kwargs", name
        assert info.value.message.startswith(f"chat_template_kwargs: {name!r} is not a template variable"), name
    tools = [{"type": "function", "function": {"name": "f"}}]
    job = parse({"messages": messages, "chat_template_kwargs": {"tools": tools, "documents": []}}, "chat",
                default_max_tokens=16)
    assert job.template["tools"] == tools and job.template["documents"] == []


def test_tokenize_bodies_take_vllms_two_forms():
    from kvload.serve.protocol import parse_detokenize, parse_tokenize

    text = parse_tokenize({"model": "m", "prompt": "hi"})
    assert (text.prompt, text.messages, text.add_special_tokens, text.return_token_strs) == ("hi", None, True, False)
    chat = parse_tokenize({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False,
                           "return_token_strs": True})
    assert chat.prompt is None and chat.messages == [{"role": "user", "content": "hi"}]
    assert chat.template == {"add_generation_prompt": False, "continue_final_message": False}
    assert (chat.add_special_tokens, chat.return_token_strs) == (False, True)
    assert parse_detokenize({"tokens": [0, 5]}) == [0, 5]
    for bad, param in [({"tokens": [True]}, "tokens"), ({"tokens": [2**63]}, "tokens"), ([], None)]:
        with pytest.raises(BadRequest) as info:
            parse_detokenize(bad)
        assert info.value.param == param


def test_text_parts_of_a_message_are_joined_by_newlines_as_vllm_joins_them():
    job = parse({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "Describe:"},
                                                                         {"type": "text", "text": "the sky"}]}]},
                "chat", default_max_tokens=16)
    assert job.prompts == [[{"role": "user", "content": "Describe:\nthe sky"}]]  # it was "Describe:the sky"


@pytest.mark.parametrize("choice", [{}, {"tool_choice": "none"}, {"tool_choice": "required"}])
def test_chat_refuses_an_empty_tools_array_as_vllm_does(choice):
    """``tools: []`` was taken as no tools; vLLM's chat completions refuse it (a 400 naming ``tools``, matching
    OpenAI), whatever tool_choice says; /tokenize, whose vLLM request has no such rule, still takes it."""
    from kvload.serve.protocol import parse_tokenize

    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(BadRequest) as info:
        parse({"messages": messages, "tools": [], **choice}, "chat", default_max_tokens=16)
    assert info.value.param == "tools"
    assert info.value.message == ("tools: must not be an empty array (vLLM's and OpenAI's rule); give at least one "
                                  "tool or leave tools out")
    assert parse_tokenize({"messages": messages, "tools": []}).template.get("tools") is None


@pytest.mark.parametrize(("prompt", "param", "got"), [
    ([1, 2.0], "prompt[1]", "2.0"),
    ([5, 6, True], "prompt[2]", "True"),
    ([7, "x"], "prompt[1]", "'x'"),
    ([[1, 2], [3, None]], "prompt[1][1]", "None"),
])
def test_a_token_id_list_with_one_bad_item_names_that_item(prompt, param, got):
    """``[1, 2.0]`` was read as a list of prompts and refused as ``prompt[0]: expected a non-empty string or a
    non-empty list of token ids, got 1``: the one id that was right, not the item that was wrong."""
    with pytest.raises(BadRequest) as info:
        parse({"prompt": prompt, "max_tokens": 2}, "completion", default_max_tokens=16)
    assert info.value.param == param
    assert info.value.message == (f"{param}: expected a token id (an integer >= 0; the list's first item is one), "
                                  f"got {got}")


def test_a_field_kvload_does_not_serve_sent_as_null_asks_for_nothing_and_is_taken():
    """Clients that serialize every field of OpenAI's or vLLM's request type send the unset ones as null
    (``"audio": null``, ``"kv_transfer_params": null``): each was a 400 though it asked for nothing, as vLLM takes it.
    Given a value, each is still refused naming it and what to send instead."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    nulls = dict.fromkeys(("audio", "functions", "function_call", "web_search_options", "kv_transfer_params",
                           "vllm_xargs", "mm_processor_kwargs", "thinking_token_budget"))
    assert parse({**chat, **nulls}, "chat", default_max_tokens=16).params == parse(chat, "chat",
                                                                                   default_max_tokens=16).params
    assert parse({"prompt": "hi", "suffix": None, "prompt_embeds": None}, "completion",
                 default_max_tokens=16).prompts == ["hi"]
    with pytest.raises(BadRequest, match=r"^functions: not supported by kvload serve \(OpenAI's field: the deprecated "
                                         r"form of tools and tool_choice") as info:
        parse({**chat, "functions": [{"name": "f", "parameters": {}}]}, "chat", default_max_tokens=16)
    assert info.value.param == "functions"
    with pytest.raises(BadRequest, match=r"^suffix: not supported by kvload serve \(vLLM's field"):
        parse({"prompt": "hi", "suffix": "x"}, "completion", default_max_tokens=16)
    with pytest.raises(BadRequest, match="^no_such_field: not supported by kvload serve; accepted fields"):
        parse({**chat, "no_such_field": None}, "chat", default_max_tokens=16)  # a name kvload does not know


@pytest.mark.parametrize("body, kind", [(None, "null"), ([], "an array"), ("x", "a string"), (3, "a number"),
                                        (1.5, "a number"), (True, "true or false")])
def test_a_body_that_is_json_but_not_an_object_is_named_in_jsons_words(body, kind):
    """It said Python's type: "got NoneType" for a body of ``null``, "got list" for an array, on every endpoint."""
    from kvload.serve import messages_input, responses_input

    calls = [lambda: parse(body, "completion", default_max_tokens=16),
             lambda: parse(body, "chat", default_max_tokens=16),
             lambda: responses_input.to_chat(body), lambda: messages_input.to_chat(body)]
    for call in calls:
        with pytest.raises(BadRequest) as info:
            call()
        assert info.value.message == f"the request body must be a JSON object ({{...}}), got {kind}"


@pytest.mark.parametrize("bad, first", [
    ({"presence_penalty": "x", "temperature": 5}, "presence_penalty"),  # the extras before the core settings
    ({"bad_words": 5, "allowed_token_ids": 5}, "allowed_token_ids"),
    ({"temperature": 5, "seed": "x"}, "temperature"),  # temperature, top_p, top_k, then seed
    ({"top_k": "x", "seed": "x"}, "top_k"),
    ({"seed": "x", "stop": 5}, "seed"),  # the core settings before the stops
    ({"stop": [""], "stop_token_ids": 5}, "stop"),
    ({"stop": ["ok", "x\ud800"], "ignore_eos": "x"}, "stop"),  # checked here, not only by SamplingParams later
    ({"stop_token_ids": [2] * (MAX_STOP_TOKEN_IDS + 1), "ignore_eos": "x"}, "stop_token_ids"),
    ({"ignore_eos": "x", "truncate_prompt_tokens": 0}, "ignore_eos"),
    ({"truncate_prompt_tokens": 0, "truncation_side": "middle"}, "truncate_prompt_tokens"),
    ({"truncation_side": "middle", "session_id": 5}, "truncation_side"),
])
def test_a_body_with_two_bad_fields_is_refused_for_the_same_one_first(bad, first):
    """Which of two bad fields a 400 names is the order of parse's checks: a client fixing one mistake at a time
    sees the same sequence however parse is laid out in helpers."""
    with pytest.raises(BadRequest) as refused:
        parse({"prompt": [1, 2], **bad}, "completion", default_max_tokens=16)
    assert refused.value.param == first
