"""vLLM's request fields that real clients send ``kvload serve``, through the openai client's ``extra_body``: what the
server acts on (``cache_salt``, ``prompt_logprobs`` with vLLM's ranks, ``truncate_prompt_tokens``, ``request_id``,
``stream_options.continuous_usage_stats``, chat's ``echo``, tools shown to the template) gives the Python API's
numbers; what it cannot do ("auto" tool calling, priority scheduling, best_of, vLLM's old guided_* fields) is a 400
naming the field.

One server over the tiny llama with ``test_serve_vllm``'s word-level tokenizer (token ``i`` is ``w<i>``, 1 is the BOS
``<s>``) and its chat template (each message's content, then ``w2`` for the assistant's turn).
"""

from __future__ import annotations

import json

import pytest

from tests.serve_support import serving
from tests.test_serve_vllm import CONV, words_checkpoint

MAX_SEQ = 64
PROMPT = "w5 w17 w30 w42 w7 w9"  # <s> and six words: 7 tokens


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory):
    path = words_checkpoint(tiny_checkpoints, tmp_path_factory.mktemp("fields"))
    with serving(str(path), max_seq_len=MAX_SEQ, kv_cache_config={"max_tokens": 512, "tokens_per_block": 4},
                 state={"model_name": "words", "trust_request_chat_template": True}) as s:
        yield s


def _complete(served, prompt=PROMPT, **extra):
    return served.client.completions.create(model="words", prompt=prompt, max_tokens=3,
                                            extra_body={"ignore_eos": True, **extra})


def _refused(served, path, body, param):
    r = served.http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def _ignored(served, request_id):
    records = [json.loads(line) for line in served.http.get("/v1/kvload/audit").text.splitlines()]
    return {r["field"]: r["value"] for r in records
            if r["event"] == "setting_ignored" and r.get("request") == request_id  # `kvload audit` groups by it
            and r["reason"].endswith(f"(request {request_id})")}


def _ids(served, text):
    return served.http.post("/tokenize", json={"prompt": text}).json()["tokens"]


# --- cache_salt: vLLM's name for the prefix-reuse scope ------------------------------------------------------------


def test_cache_salt_is_the_salt_one_scope_by_either_name(served):
    prompt = "w60 w61 w62 w63 w64 w65 w66 w67 w68"  # <s> + 9 words: two full blocks of 4
    first = _complete(served, prompt, salt="team-a")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = _complete(served, prompt, cache_salt="team-a")  # the blocks salt="team-a" left, found by cache_salt
    assert again.usage.prompt_tokens_details.cached_tokens == 8
    other = _complete(served, prompt, cache_salt="team-b")
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    both = _complete(served, prompt, salt="team-b", cache_salt="team-b")  # the same value twice is one setting
    assert both.usage.prompt_tokens_details.cached_tokens == 8
    message = _refused(served, "/v1/completions", {"prompt": prompt, "salt": "a", "cache_salt": "b"}, "cache_salt")
    assert "salt and cache_salt differ" in message
    assert "non-empty" in _refused(served, "/v1/completions", {"prompt": prompt, "cache_salt": ""}, "cache_salt")
    assert _refused(served, "/v1/completions", {"prompt": prompt, "cache_salt": "s" * 1025}, "cache_salt") == (
        "cache_salt: expected a string of at most 1,024 characters, got 1,025")


# --- prompt_logprobs: vLLM's shape, the Python API's numbers, ranks in the vocabulary ---------------------------------


def _check_prompt_logprobs(served, got, ids, k):
    """``got`` (vLLM's prompt_logprobs) against the Python API's for the same token ids and k."""
    (api,) = served.result.executor.run([ids], max_tokens=1, prompt_logprobs=k, salt="api")
    assert len(got) == len(ids) and got[0] is None
    for j in range(1, len(ids)):
        entry, mine = api.prompt_logprobs[j], got[j]
        token = str(ids[j])
        assert next(iter(mine)) == token  # the token's own entry first, as vLLM's dict has it
        assert mine[token]["logprob"] == pytest.approx(entry[ids[j]], abs=1e-5)
        assert mine[token]["rank"] == entry.rank and mine[token]["decoded_token"] == f"w{ids[j]}"
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:k]  # the top k, ranked 1..k
        for place, (alt, value) in enumerate(best, 1):
            assert mine[str(alt)]["rank"] == place
            assert mine[str(alt)]["logprob"] == pytest.approx(value, abs=1e-5)
        assert set(mine) == {token} | {str(a) for a, _ in best}


def test_prompt_logprobs_of_a_completion_are_the_python_apis_with_vllms_ranks(served):
    r = _complete(served, prompt_logprobs=2)
    got = r.choices[0].model_extra["prompt_logprobs"]
    _check_prompt_logprobs(served, got, _ids(served, PROMPT), 2)
    # some prompt token is not among the model's top 2 there: its rank counts the whole vocabulary
    assert any(e[next(iter(e))]["rank"] > 2 for e in got[1:])
    assert _complete(served).choices[0].model_extra["prompt_logprobs"] is None  # not asked: null, as vLLM's
    zero = _complete(served, prompt_logprobs=0).choices[0].model_extra["prompt_logprobs"]
    assert all(len(e) == 1 for e in zero[1:])  # the token alone


def test_prompt_logprobs_of_a_chat_are_the_answers_own_over_the_templated_prompt(served):
    r = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=2,
                                              extra_body={"ignore_eos": True, "prompt_logprobs": 1})
    ids = served.http.post("/tokenize", json={"messages": CONV}).json()["tokens"]
    assert r.usage.prompt_tokens == len(ids)
    _check_prompt_logprobs(served, r.model_extra["prompt_logprobs"], ids, 1)


def test_echo_with_logprobs_returns_prompt_logprobs_too_each_with_its_own_top_k(served):
    r = _complete(served, echo=True, logprobs=1, prompt_logprobs=3)
    choice = r.choices[0]
    ids = _ids(served, PROMPT)
    assert all(t is None or len(t) <= 2 for t in choice.logprobs.top_logprobs[:len(ids)])  # logprobs=1: top 1 + it
    _check_prompt_logprobs(served, choice.model_extra["prompt_logprobs"], ids, 3)
    echoed = _complete(served, echo=True, logprobs=1).choices[0]  # vLLM returns the echo's scores here too
    _check_prompt_logprobs(served, echoed.model_extra["prompt_logprobs"], ids, 1)


def test_prompt_logprobs_in_a_stream_are_refused_as_vllm_does_and_zero_is_reported_ignored(served):
    message = _refused(served, "/v1/completions", {"prompt": PROMPT, "stream": True, "prompt_logprobs": 1},
                       "prompt_logprobs")
    assert "stream=true" in message
    _refused(served, "/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs")
    _refused(served, "/v1/completions", {"prompt": PROMPT, "prompt_logprobs": -1}, "prompt_logprobs")
    with served.http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "stream": True, "max_tokens": 2,
                                                             "prompt_logprobs": 0}) as s:
        assert s.status_code == 200
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert _ignored(served, chunks[0]["id"]) == {"serve.prompt_logprobs": 0}


# --- truncate_prompt_tokens: the prompt's last k tokens ------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_k_tokens_as_the_python_api_would_be_given_them(served):
    ids = _ids(served, PROMPT)
    r = _complete(served, truncate_prompt_tokens=3, echo=True)
    assert r.usage.prompt_tokens == 3
    (api,) = served.result.executor.run([ids[-3:]], max_tokens=3, ignore_eos=True)
    assert r.choices[0].model_extra["token_ids"] == api.outputs[0].token_ids
    assert r.choices[0].text.startswith("w42 w7 w9")  # the echo is the prompt the model saw
    untouched = _complete(served, truncate_prompt_tokens=50)  # shorter already: kept whole
    assert untouched.usage.prompt_tokens == len(ids)
    tokens = served.client.completions.create(model="words", prompt=ids, max_tokens=1,
                                              extra_body={"truncate_prompt_tokens": 2})
    assert tokens.usage.prompt_tokens == 2
    chat = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=1,
                                                 extra_body={"truncate_prompt_tokens": 2})
    assert chat.usage.prompt_tokens == 2


def test_truncation_side_right_keeps_the_first_k_tokens_as_vllm_does(served):
    ids = _ids(served, PROMPT)
    r = _complete(served, truncate_prompt_tokens=3, truncation_side="right", echo=True, return_token_ids=True)
    assert r.usage.prompt_tokens == 3 and r.choices[0].model_extra["prompt_token_ids"] == ids[:3]
    (api,) = served.result.executor.run([ids[:3]], max_tokens=3, ignore_eos=True)
    assert r.choices[0].model_extra["token_ids"] == api.outputs[0].token_ids
    assert r.choices[0].text.startswith("w5 w17")  # the echo is the prompt the model saw (the BOS shows as nothing)
    left = _complete(served, truncate_prompt_tokens=3, truncation_side="left", return_token_ids=True)
    assert left.choices[0].model_extra["prompt_token_ids"] == ids[-3:]  # vLLM's default side, kvload's
    templated = served.http.post("/tokenize", json={"messages": CONV}).json()["tokens"]
    chat = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=1,
                                                 extra_body={"truncate_prompt_tokens": 2, "truncation_side": "right",
                                                             "return_token_ids": True})
    assert chat.model_extra["prompt_token_ids"] == templated[:2]
    # with no truncate_prompt_tokens nothing is cut: a side alone changes nothing, and is reported
    alone = _complete(served, truncation_side="right")
    assert alone.usage.prompt_tokens == len(ids)
    assert _ignored(served, alone.id) == {"serve.truncation_side": "right"}
    body = {"prompt": PROMPT, "max_tokens": 1, "truncate_prompt_tokens": 2, "truncation_side": "middle"}
    assert '"right" (keep the first ones)' in _refused(served, "/v1/completions", body, "truncation_side")


def test_truncate_prompt_tokens_minus_one_fits_a_long_prompt_to_what_max_tokens_leaves(served):
    long = " ".join(f"w{10 + i}" for i in range(80))  # 81 tokens: past max_seq_len
    _refused(served, "/v1/completions", {"prompt": long, "max_tokens": 4}, "prompt")
    r = _complete(served, long, truncate_prompt_tokens=-1, max_tokens=4)
    assert r.usage.prompt_tokens == MAX_SEQ - 4 and r.usage.completion_tokens == 4
    message = _refused(served, "/v1/completions", {"prompt": long, "max_tokens": 4, "truncate_prompt_tokens": 61},
                       "truncate_prompt_tokens")
    assert "61 is more than max_model_len - max_tokens = 64 - 4 = 60" in message
    for bad in (0, -2, "3", 1.5):
        _refused(served, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": bad}, "truncate_prompt_tokens")
    # max_tokens alone fills the context: no truncation could help, so the refusal names max_tokens
    message = _refused(served, "/v1/completions", {"prompt": long, "max_tokens": MAX_SEQ, "truncate_prompt_tokens": 5},
                       "max_tokens")
    assert message == (f"max_tokens: {MAX_SEQ} leaves no room for a prompt in this model's context length of {MAX_SEQ} "
                       "tokens (truncate_prompt_tokens cannot help); ask for fewer")


def test_truncate_prompt_tokens_of_max_model_len_without_max_tokens_is_taken_as_vllm_takes_it(served):
    """vLLM bounds ``truncate_prompt_tokens`` by ``max_model_len - max_tokens``, ``max_model_len`` when no
    ``max_tokens`` is given; kvload refused k = max_model_len there whatever the prompt. A shorter prompt is served
    whole; one that long keeps one token fewer (a sequence never grows past max_seq_len), said as setting_ignored."""
    def complete(prompt):
        r = served.http.post("/v1/completions", json={"prompt": prompt, "truncate_prompt_tokens": MAX_SEQ,
                                                       "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()

    short = complete(PROMPT)
    assert short["usage"]["prompt_tokens"] == len(_ids(served, PROMPT))
    assert _ignored(served, short["id"]) == {}
    r = complete(" ".join(f"w{10 + i}" for i in range(80)))
    assert r["usage"]["prompt_tokens"] == MAX_SEQ - 1 and r["usage"]["completion_tokens"] == 1
    assert _ignored(served, r["id"]) == {"serve.truncate_prompt_tokens": MAX_SEQ}
    message = _refused(served, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": MAX_SEQ + 1},
                       "truncate_prompt_tokens")
    assert f"{MAX_SEQ + 1} is more than max_model_len = {MAX_SEQ}" in message


def test_truncate_prompt_tokens_with_echos_max_tokens_zero_counts_no_generated_token(served):
    """``echo`` with ``max_tokens`` 0 asks for no token: k = max_model_len is bounded as without ``max_tokens`` (it was
    a 400 reading "max_tokens = 64 - 1", a max_tokens of 1 the request never sent), and the one token fewer kept
    is said, as it is there."""
    long = " ".join(f"w{10 + i}" for i in range(80))
    r = served.http.post("/v1/completions", json={"prompt": long, "max_tokens": 0, "echo": True,
                                                   "truncate_prompt_tokens": MAX_SEQ})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (MAX_SEQ - 1, 0)
    assert _ignored(served, r.json()["id"]) == {"serve.truncate_prompt_tokens": MAX_SEQ}
    message = _refused(served, "/v1/completions", {"prompt": long, "max_tokens": 0, "echo": True,
                                                   "truncate_prompt_tokens": MAX_SEQ + 1}, "truncate_prompt_tokens")
    assert f"is more than max_model_len - max_tokens = {MAX_SEQ} - 0 = {MAX_SEQ};" in message


# --- the answer's id, usage per chunk -------------------------------------------------------------------------------


def test_request_id_names_the_answer_and_an_x_request_id_header_wins(served):
    assert _complete(served, request_id="job-7").id == "cmpl-job-7"
    r = served.client.completions.create(model="words", prompt=PROMPT, max_tokens=1,
                                         extra_body={"request_id": "job-8"}, extra_headers={"X-Request-Id": "trace-1"})
    assert r.id == "cmpl-trace-1"
    chat = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=1,
                                                 extra_body={"request_id": "job-9"})
    assert chat.id == "chatcmpl-job-9"
    _refused(served, "/v1/completions", {"prompt": PROMPT, "request_id": "x" * 257}, "request_id")
    _refused(served, "/v1/completions", {"prompt": PROMPT, "request_id": "a\nb"}, "request_id")


def test_an_x_request_id_header_that_is_not_ascii_or_given_twice_is_a_400_naming_it(served):
    """Its bytes past ASCII were read as Latin-1, so UTF-8 sent there named the answer in mojibake ("cmpl-Ã¿Ã¾"); two
    of them named it by the first, the second dropped unsaid."""
    for headers in ([("X-Request-Id", "\u00ff\u00fe".encode())], [("X-Request-Id", b"a"), ("X-Request-Id", b"b")]):
        r = served.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id", r.text
    assert "expected printable ASCII" in served.http.post(
        "/v1/chat/completions", json={"messages": CONV, "max_tokens": 1},
        headers=[("X-Request-Id", "caf\u00e9".encode())]).json()["error"]["message"]
    assert _complete(served, request_id="caf\u00e9").id == "cmpl-caf\u00e9"  # Unicode belongs in the body


def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk(served):
    stream = served.client.completions.create(model="words", prompt=PROMPT, max_tokens=4, n=2, temperature=1.0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True,
                                                          "stream_options": {"continuous_usage_stats": True}})
    chunks = list(stream)
    *steps, last = chunks
    prompt = len(_ids(served, PROMPT))
    seen = {0: 0, 1: 0}
    for chunk in steps:
        (choice,) = chunk.choices
        seen[choice.index] += len(choice.model_extra["token_ids"])
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (prompt, seen[choice.index])
    assert seen == {0: 4, 1: 4}
    assert last.choices == [] and last.usage.completion_tokens == 8  # the request's, at the end
    # vLLM's: per-chunk usage only with include_usage (its default true: on when not given)
    off = served.client.completions.create(model="words", prompt=PROMPT, max_tokens=2, stream=True,
                                           extra_body={"ignore_eos": True, "stream_options": {
                                               "include_usage": False, "continuous_usage_stats": True}})
    chunks = list(off)
    assert all(c.usage is None for c in chunks)
    assert _ignored(served, chunks[0].id) == {"serve.stream_options.continuous_usage_stats": True}
    on = served.http.post("/v1/chat/completions", json={
        "messages": CONV, "max_tokens": 2, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    docs = [json.loads(line[6:]) for line in on.text.splitlines() if line.startswith("data: {")]
    assert docs[0]["usage"]["completion_tokens"] == 0 and docs[0]["choices"][0]["delta"]["role"] == "assistant"
    assert docs[-1]["choices"] == [] and docs[-1]["usage"]["completion_tokens"] == 2


# --- chat's echo, and the tools ---------------------------------------------------------------------------------------


def test_chat_echo_puts_the_last_message_before_a_reply_in_its_role(served):
    body = {"add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True}
    plain = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=3, extra_body=body)
    echoed = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=3,
                                                   extra_body={**body, "echo": True})
    assert echoed.choices[0].message.content == "w30" + plain.choices[0].message.content  # the assistant's "w30"
    stream = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=3, stream=True,
                                                   extra_body={**body, "echo": True})
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert deltas[0].role == "assistant" and deltas[1].content == "w30"  # in a chunk of its own, after the role's
    assert "".join(d.content or "" for d in deltas) == echoed.choices[0].message.content
    # the reply opens a new assistant turn after a user message: nothing of the user's is echoed
    user = [{"role": "user", "content": "w5 w17"}]
    opened = served.client.chat.completions.create(model="words", messages=user, max_tokens=3,
                                                   extra_body={"echo": True, "ignore_eos": True})
    unechoed = served.client.chat.completions.create(model="words", messages=user, max_tokens=3,
                                                     extra_body={"ignore_eos": True})
    assert opened.choices[0].message.content == unechoed.choices[0].message.content


TOOLS = [{"type": "function", "function": {"name": "w9", "description": "look up", "parameters": {}}}]
TOOL_TEMPLATE = ("{% for t in tools or [] %}{{ t['function']['name'] }} {% endfor %}"
                 "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w2{% endif %}")


def test_tools_with_tool_choice_none_reach_the_chat_template_as_vllm_shows_them(served):
    body = {"model": "words", "messages": CONV, "max_tokens": 1, "chat_template": TOOL_TEMPLATE}
    without = served.http.post("/v1/chat/completions", json=body).json()
    shown = served.http.post("/v1/chat/completions", json={**body, "tools": TOOLS, "tool_choice": "none"}).json()
    assert shown["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"] + 1  # "w9 " before the messages
    tokens = served.http.post("/tokenize", json={"messages": CONV, "chat_template": TOOL_TEMPLATE, "tools": TOOLS})
    assert tokens.json()["tokens"][0] == 9
    assert served.http.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).status_code == 200
    assert "tool-call parser" in _refused(served, "/v1/chat/completions", {**body, "tools": TOOLS}, "tools")
    message = _refused(served, "/v1/chat/completions", {**body, "tools": TOOLS, "tool_choice": "auto"}, "tool_choice")
    assert "tool-call parser" in message and '"required"' in message  # named and "required": test_serve_tool_calls
    _refused(served, "/v1/chat/completions", {**body, "tools": [{"type": "function"}], "tool_choice": "none"},
             "tools[0]")


def test_documents_reach_the_chat_template_as_vllm_passes_them(served):
    """vLLM's documents (a RAG template's): the template's ``documents`` variable, as chat_template_kwargs would be."""
    template = "{% for d in documents or [] %}{{ d['text'] }} {% endfor %}" + TOOL_TEMPLATE
    body = {"model": "words", "messages": CONV, "max_tokens": 1, "chat_template": template}
    without = served.http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
    docs = [{"title": "a", "text": "w11 w12"}]
    shown = served.http.post("/v1/chat/completions", json={**body, "documents": docs, "return_token_ids": True})
    assert shown.json()["prompt_token_ids"][:2] == [11, 12] and shown.json()["usage"]["prompt_tokens"] == without + 2
    assert "a list of objects of strings" in _refused(served, "/v1/chat/completions",
                                                      {**body, "documents": ["w11"]}, "documents")
    assert "give one" in _refused(served, "/v1/chat/completions", {
        **body, "documents": docs, "chat_template_kwargs": {"documents": docs}}, "documents")


def test_reasoning_effort_reaches_the_chat_template_as_vllm_passes_it(served):
    """vLLM's: reasoning_effort is the template's variable (gpt-oss's reads it), and enable_thinking is true unless it
    is "none" (Qwen3's switch), the request's own chat_template_kwargs winning; reported only when the template reads
    neither."""
    template = ("{% if reasoning_effort == 'low' %}w11 {% endif %}{% if enable_thinking is false %}w12 {% endif %}"
                + TOOL_TEMPLATE)
    body = {"model": "words", "messages": CONV, "max_tokens": 1, "chat_template": template, "return_token_ids": True}

    def prompt(**extra):
        reply = served.http.post("/v1/chat/completions", json={**body, **extra}).json()
        return reply["prompt_token_ids"][:1], _ignored(served, reply["id"])

    plain = served.http.post("/v1/chat/completions", json=body).json()["prompt_token_ids"][:1]
    assert prompt(reasoning_effort="low") == ([11], {})
    assert prompt(reasoning_effort="none") == ([12], {})
    assert prompt(reasoning_effort="high") == (plain, {})  # read, and thinking on: what the template does unasked
    assert prompt(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == (plain, {})
    assert "give one" in _refused(served, "/v1/chat/completions", {
        **body, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "reasoning_effort")


def test_vllms_fields_kvload_does_not_serve_are_refused_saying_what_it_does_instead(served):
    """They read "not supported by kvload serve" and a list of 70 fields; session_id (an agent's conversation id)
    changes nothing here, so it is served and reported."""
    message = _refused(served, "/v1/chat/completions", {"messages": CONV, "max_tokens": 1,
                                                        "thinking_token_budget": 64}, "thinking_token_budget")
    assert message.startswith("thinking_token_budget: not supported by kvload serve (vLLM's field: kvload does not "
                              "bound a model's thinking; max_tokens bounds the whole reply); accepted fields: ")
    assert "fill-in-the-middle" in _refused(served, "/v1/completions", {"prompt": PROMPT, "suffix": "w9"}, "suffix")
    reply = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=3,
                                                  extra_body={"ignore_eos": True, "session_id": "conv-9"})
    assert _ignored(served, reply.id) == {"serve.session_id": "conv-9"}
    _refused(served, "/v1/completions", {"prompt": PROMPT, "session_id": 9}, "session_id")


def test_include_reasoning_without_a_reasoning_parser_is_reported(served):
    """vLLM's include_reasoning: false leaves a reply's thinking out, which only a --reasoning-parser tells apart."""
    reply = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=3,
                                                  extra_body={"ignore_eos": True, "include_reasoning": False})
    assert _ignored(served, reply.id) == {"serve.include_reasoning": False}
    kept = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=3,
                                                 extra_body={"ignore_eos": True, "include_reasoning": True})
    assert _ignored(served, kept.id) == {}
    _refused(served, "/v1/chat/completions", {"messages": CONV, "max_tokens": 1, "include_reasoning": "no"},
             "include_reasoning")


def test_an_assistant_messages_reasoning_reaches_the_chat_template_as_llm_chat_passes_it(served):
    """Interleaved thinking sent back: a 400 ("messages[1].reasoning: not supported"); vLLM shows it to the template."""
    template = "{% for m in messages %}{{ m['content'] }} {{ m.get('reasoning_content') or '' }} {% endfor %}"
    conv = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6", "reasoning": "w7 w8"}]
    tokens = served.http.post("/tokenize", json={"messages": conv, "chat_template": template}).json()["tokens"]
    assert tokens == [5, 6, 7, 8]
    body = {"model": "words", "messages": conv, "max_tokens": 1, "chat_template": template}
    assert served.http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"] == 4
    conv[0]["reasoning"] = "w7"
    assert "not supported (an assistant message's)" in _refused(served, "/v1/chat/completions", body,
                                                                "messages[0].reasoning")


# --- accepted at the one value kvload serves, else refused naming the field ----------------------------------------


def test_response_format_text_priority_zero_and_best_of_n_are_served(served):
    r = served.client.completions.create(model="words", prompt=PROMPT, max_tokens=2, n=2, temperature=1.0, seed=1,
                                         extra_body={"response_format": {"type": "text"}, "priority": 0,
                                                     "best_of": 2, "ignore_eos": True})
    plain = served.client.completions.create(model="words", prompt=PROMPT, max_tokens=2, n=2, temperature=1.0,
                                             seed=1, extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [c.text for c in plain.choices]
    chat = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=1,
                                                 response_format={"type": "text"})
    assert chat.choices[0].message.role == "assistant"


@pytest.mark.parametrize("path, extra, param, words", [
    ("/v1/chat/completions", {"response_format": {"type": "structural_tag"}}, "response_format",
     "type 'structural_tag' is not supported"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "expected a JSON schema object, got None"),
    ("/v1/completions", {"guided_regex": "[0-9]+"}, "guided_regex",
     "removed in its recent releases; send structured_outputs: {\"regex\": ...} instead"),
    ("/v1/completions", {"response_format": "text"}, "response_format", '{"type": "text"}'),
    ("/v1/completions", {"priority": 1}, "priority", "first come, first served"),
    ("/v1/chat/completions", {"priority": -5}, "priority", "only priority 0"),
    ("/v1/completions", {"priority": 10**400}, "priority",
     "about 401 digits: kvload serve schedules first come, first served (vLLM's default policy, fcfs), where only "
     "priority 0"),
    ("/v1/completions", {"best_of": 3, "n": 2}, "best_of", "only best_of = n"),
    ("/v1/completions", {"best_of": 0}, "best_of", "an integer >= 1"),
    ("/v1/completions", {"best_of": 10**400}, "best_of", "about 401 digits with n=1 is not supported: kvload serve "
                                                         "returns every sample it draws, so only best_of = n"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice", "tool-call parser"),
    # JSON's false for a spec was taken for "not given" and the other kind served
    ("/v1/chat/completions", {"structured_outputs": {"regex": "w[0-9]", "choice": False}}, "structured_outputs",
     "structured_outputs.choice: expected a non-empty list of non-empty strings, got False"),
    # rendered into the prompt as Python wrote it (a dict's repr, 9223372036854775808): the other routes refuse it
    *[("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "description": value}}],
        "tool_choice": "none"}, "tools[0].function.description", f"expected a string, got {shown}")
      for value, shown in ((2**63, "9223372036854775808"), ({"a": 1}, "{'a': 1}"), ([], "[]"), (False, "False"))],
    # likewise: a strict of any JSON was taken (vLLM's is a bool, /v1/responses checks its tools[i].strict so)
    *[("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "strict": value}}],
        "tool_choice": "none"}, "tools[0].function.strict", f"expected true or false, got {shown}")
      for value, shown in ((2**63, "9223372036854775808"), ({"a": [1]}, "{'a': [1]}"), ("abc", "'abc'"), (0, "0"))],
])
def test_what_kvload_cannot_do_is_a_400_naming_the_field(served, path, extra, param, words):
    body = {"messages": CONV} if path.endswith("chat/completions") else {"prompt": PROMPT}
    assert words in _refused(served, path, {**body, "max_tokens": 1, **extra}, param)


def test_spaces_between_special_tokens_false_joins_shown_special_tokens_as_the_python_api_does(served):
    """The word-level decoder puts a space between every two tokens; vLLM's false drops it between two added
    tokens (here a reply forced to the BOS ``<s>`` by logit_bias, then ``w7``), where special tokens are shown."""
    body = {"logit_bias": {"1": 100}, "skip_special_tokens": False, "ignore_eos": True}
    shown = _complete(served, **body).choices[0]
    assert shown.text == "<s> <s> <s>"
    joined = _complete(served, **body, spaces_between_special_tokens=False)
    assert joined.choices[0].text == "<s><s><s>"
    ids = _ids(served, PROMPT)
    (api,) = served.result.executor.run([ids], max_tokens=3, ignore_eos=True, logit_bias={1: 100},
                                        skip_special_tokens=False, spaces_between_special_tokens=False)
    assert api.outputs[0].text == "<s><s><s>"
    stream = served.client.completions.create(model="words", prompt=PROMPT, max_tokens=3, stream=True,
                                              extra_body={**body, "spaces_between_special_tokens": False})
    assert "".join(c.choices[0].text for c in stream) == "<s><s><s>"
    # only between two added tokens: an ordinary word after one keeps the decoder's space
    echo = _complete(served, [1, 1, 7], max_tokens=1, echo=True, **body, spaces_between_special_tokens=False)
    assert echo.choices[0].text == "<s><s> w7<s>"
    # special tokens skipped (the default): nothing to space, said once for the request
    skipped = _complete(served, spaces_between_special_tokens=False)
    assert _ignored(served, skipped.id) == {"serve.spaces_between_special_tokens": False}
    _refused(served, "/v1/completions", {"prompt": PROMPT, "spaces_between_special_tokens": "no"},
             "spaces_between_special_tokens")


# --- OpenAI's newer chat fields: what SDKs and agents send, served and reported --------------------------------------


def test_openai_chat_fields_agents_send_are_served_and_reported_not_refused(served):
    # the openai SDK's chat.completions.create takes them, and agents send them (reasoning_effort for a reasoning
    # model, prompt_cache_key and safety_identifier where user was, verbosity, service_tier): each was a 400, so such
    # a client could not talk to kvload at all. They change nothing generated here, as on /v1/responses.
    reply = served.client.chat.completions.create(
        model="words", messages=CONV, max_tokens=3, reasoning_effort="low", verbosity="high",
        prompt_cache_key="conv-7", prompt_cache_retention="24h", safety_identifier="user-42", service_tier="auto",
        extra_body={"ignore_eos": True})
    plain = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=3,
                                                  extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == plain.choices[0].message.content
    assert reply.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    # service_tier "auto" is what kvload does (one tier): nothing to report
    assert _ignored(served, reply.id) == {"serve.reasoning_effort": "low", "serve.verbosity": "high",
                                         "serve.prompt_cache_key": "conv-7", "serve.prompt_cache_retention": "24h",
                                         "serve.safety_identifier": "user-42"}
    streamed = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=3, stream=True,
                                                     reasoning_effort="none", extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert _ignored(served, chunks[0].id) == {"serve.reasoning_effort": "none"}
    hinted = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=3, modalities=["text"],
                                                   prediction={"type": "content", "content": "w5 w6"},
                                                   extra_body={"ignore_eos": True})
    assert hinted.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    assert _ignored(served, hinted.id) == {"serve.prediction": "content"}  # text is what kvload writes: no report
    null = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=3,
                                                 extra_body={"ignore_eos": True, "reasoning_effort": None,
                                                             "prompt_cache_key": None})
    assert _ignored(served, null.id) == {}  # null is absent, as for every other field


def test_openai_chat_store_and_metadata_are_served_and_reported_not_refused(served):
    # OpenAI's stored completions (store, with metadata to find them by): the openai SDK takes both on chat and agents
    # pass them through; kvload keeps no chat completion, so store: true and metadata are reported, store: false is
    # what it does anyway
    reply = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=3, store=True,
                                                  metadata={"run": "eval-7", "user": "u1"},
                                                  extra_body={"ignore_eos": True})
    plain = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=3,
                                                  extra_body={"ignore_eos": True})
    assert reply.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    assert _ignored(served, reply.id) == {"serve.store": True, "serve.metadata": {"run": "eval-7", "user": "u1"}}
    kept_not = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=3, store=False,
                                                     metadata={}, extra_body={"ignore_eos": True})
    assert _ignored(served, kept_not.id) == {}
    assert "16 string keys" in _refused(served, "/v1/chat/completions", {
        "messages": CONV, "max_tokens": 1, "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata")
    assert "true or false" in _refused(served, "/v1/chat/completions",
                                       {"messages": CONV, "max_tokens": 1, "store": "yes"}, "store")


@pytest.mark.parametrize("extra, param, words", [
    ({"reasoning_effort": "extreme"}, "reasoning_effort",
     '"none", "minimal", "low", "medium", "high", "xhigh" or "max", got \'extreme\''),
    ({"reasoning_effort": 2}, "reasoning_effort", "got 2"),
    ({"verbosity": "terse"}, "verbosity", '"low", "medium" or "high"'),
    ({"prompt_cache_key": 7}, "prompt_cache_key", "a string, got 7"),
    ({"safety_identifier": ["u"]}, "safety_identifier", "a string"),
    ({"service_tier": "flex"}, "service_tier", '"auto" or "default" (kvload serves one tier)'),
    ({"prompt_cache_retention": "1h"}, "prompt_cache_retention", '"in_memory" or "24h"'),
    ({"modalities": ["text", "audio"]}, "modalities", '["text"] (kvload writes text; no audio)'),
    ({"prediction": {"type": "content", "content": 5}}, "prediction", '{"type": "content", "content": a string'),
])
def test_openai_chat_fields_with_a_value_kvload_cannot_take_are_a_400_naming_the_field(served, extra, param, words):
    assert words in _refused(served, "/v1/chat/completions", {"messages": CONV, "max_tokens": 1, **extra}, param)
    # a completions body is no chat: OpenAI's legacy endpoint has none of them
    _refused(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, **extra}, param)


# --- return_token_ids: vLLM's prompt_token_ids in the answer ---------------------------------------------------------


def test_return_token_ids_gives_each_prompts_token_ids_as_vllm_does(served):
    # RL and agent frameworks read back the exact tokens the model saw (a chat's templated prompt) with vLLM's
    # return_token_ids; it was a 400. kvload always returns each choice's generated token_ids.
    other = "w9 w8"
    asked = {"ignore_eos": True, "return_token_ids": True}
    r = served.client.completions.create(model="words", prompt=[PROMPT, other], max_tokens=2, n=2, extra_body=asked)
    want = [_ids(served, PROMPT)] * 2 + [_ids(served, other)] * 2
    assert [c.model_extra["prompt_token_ids"] for c in r.choices] == want
    assert "prompt_token_ids" not in _complete(served).choices[0].model_extra  # not asked: not sent
    assert "prompt_token_ids" not in _complete(served, return_token_ids=False).choices[0].model_extra
    # a stream: in each choice's first chunk only, as vLLM sends it
    firsts: dict[int, list[int]] = {}
    for chunk in served.client.completions.create(model="words", prompt=[PROMPT, other], max_tokens=3, n=2,
                                                  stream=True, extra_body=asked):
        for c in chunk.choices:
            got = c.model_extra.get("prompt_token_ids")
            assert (got is not None) == (c.index not in firsts), (c.index, got)
            firsts.setdefault(c.index, got)
    assert [firsts[j] for j in range(4)] == want
    # chat: the templated prompt (what /tokenize gives for the conversation), once per answer, and in a stream once
    # per choice, on the chunk that opens it (its role)
    templated = served.http.post("/tokenize", json={"messages": CONV}).json()["tokens"]
    chat = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=2, extra_body=asked)
    assert chat.model_extra["prompt_token_ids"] == templated
    assert len(templated) == chat.usage.prompt_tokens
    plain = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=2)
    assert "prompt_token_ids" not in plain.model_extra
    chunks = list(served.client.chat.completions.create(model="words", messages=CONV, max_tokens=2, n=2, stream=True,
                                                        temperature=1.0, seed=3, extra_body=asked))
    opened = [c for c in chunks if "prompt_token_ids" in c.model_extra]
    assert [(c.choices[0].index, c.choices[0].delta.role, c.model_extra["prompt_token_ids"]) for c in opened] == \
        [(0, "assistant", templated), (1, "assistant", templated)]
    _refused(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "return_token_ids": "yes"},
             "return_token_ids")


def test_stream_options_include_obfuscation_is_served_and_reported_as_on_the_responses_api(served):
    # the openai SDK's stream_options take include_obfuscation (OpenAI pads chunks against side channels; clients turn
    # it off to save bandwidth): it was a 400 on chat and completions
    stream = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=3, stream=True,
                                                   stream_options={"include_usage": True,
                                                                   "include_obfuscation": False},
                                                   extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 3
    assert _ignored(served, chunks[0].id) == {"serve.stream_options.include_obfuscation": False}
    with served.http.stream("POST", "/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 2, "stream": True,
            "stream_options": {"include_obfuscation": True}}) as s:
        assert s.status_code == 200
        first = next(json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {"))
    assert _ignored(served, first["id"]) == {"serve.stream_options.include_obfuscation": True}
    _refused(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "stream": True,
                                         "stream_options": {"include_obfuscation": "no"}},
             "stream_options.include_obfuscation")


def test_the_response_role_names_the_reply_of_a_generation_prompt_as_vllms_flag_does(served):
    user = [{"role": "user", "content": "w5 w17"}]
    served.state.response_role = "w-bot"  # kvload serve --response-role w-bot
    try:
        r = served.client.chat.completions.create(model="words", messages=user, max_tokens=2)
        assert r.choices[0].message.role == "w-bot"
        stream = served.client.chat.completions.create(model="words", messages=user, max_tokens=2, stream=True)
        roles = [c.choices[0].delta.role for c in stream if c.choices]  # read to the end: the stream closes
        assert roles[0] == "w-bot"
        # without a generation prompt the reply goes on the last message, in its role (vLLM's rule)
        cont = served.client.chat.completions.create(model="words", messages=CONV, max_tokens=2, extra_body={
            "add_generation_prompt": False, "continue_final_message": True})
        assert cont.choices[0].message.role == CONV[-1]["role"]
    finally:
        served.state.response_role = "assistant"


def test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id_as_vllms_flag_does(served):
    """``kvload serve --return-tokens-as-token-ids``: every logprobs token (the chosen and its top alternatives,
    streamed too) is ``token_id:N``, so a token whose text JSON cannot carry is still identified."""
    user = [{"role": "user", "content": "w5 w17"}]
    served.state.return_tokens_as_token_ids = True
    try:
        r = served.http.post("/v1/completions", json={"model": "words", "prompt": PROMPT, "max_tokens": 3,
                                                      "ignore_eos": True, "logprobs": 2})
        choice = r.json()["choices"][0]
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for k in top)
        chat = served.client.chat.completions.create(model="words", messages=user, max_tokens=3, logprobs=True,
                                                     top_logprobs=2, extra_body={"ignore_eos": True})
        content = chat.choices[0].logprobs.content
        assert [c.token for c in content] == [f"token_id:{t}" for t in chat.choices[0].token_ids]
        assert all(a.token.startswith("token_id:") for c in content for a in c.top_logprobs)
        assert content[0].bytes != list(content[0].token.encode())  # the token's own bytes, as vLLM keeps them
        stream = served.client.chat.completions.create(model="words", messages=user, max_tokens=3, logprobs=True,
                                                       stream=True, extra_body={"ignore_eos": True})
        streamed = [c.choices[0].logprobs.content for c in stream if c.choices and c.choices[0].logprobs]
        assert [t.token for part in streamed for t in part] == [c.token for c in content]
        stream = served.client.completions.create(model="words", prompt=PROMPT, max_tokens=3, logprobs=1,
                                                  stream=True, extra_body={"ignore_eos": True})
        tokens = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert tokens == choice["logprobs"]["tokens"]
    finally:
        served.state.return_tokens_as_token_ids = False


def test_force_include_usage_puts_usage_in_every_stream_as_vllms_flag_does(served):
    """``kvload serve --enable-force-include-usage``: a stream that asks for no usage gets it anyway, as vLLM's
    flag gives it: in every chunk (the choice's so far) and a last chunk with the whole request's."""
    served.state.force_include_usage = True
    try:
        for create, kwargs in ((served.client.completions.create, {"prompt": PROMPT}),
                               (served.client.chat.completions.create,
                                {"messages": [{"role": "user", "content": "w5 w17"}]})):
            chunks = list(create(model="words", max_tokens=3, stream=True, extra_body={"ignore_eos": True},
                                 **kwargs))
            assert all(c.usage is not None for c in chunks), chunks
            last = chunks[-1]
            assert last.choices == [] and last.usage.completion_tokens == 3
            assert last.usage.total_tokens == last.usage.prompt_tokens + 3
            # and a request that says no usage still gets it (the flag overrides stream_options)
            said_no = list(create(model="words", max_tokens=1, stream=True, stream_options={"include_usage": False},
                                  extra_body={"ignore_eos": True}, **kwargs))
            assert said_no[-1].choices == [] and said_no[-1].usage.completion_tokens == 1
    finally:
        served.state.force_include_usage = False


def test_the_request_field_return_tokens_as_token_ids_wins_over_the_servers_flag_as_in_vllm(served):
    body = {"model": "words", "prompt": PROMPT, "max_tokens": 2, "ignore_eos": True, "logprobs": 1}
    chat = {"model": "words", "messages": [{"role": "user", "content": "w5 w17"}], "max_tokens": 2,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 1}
    asked = served.http.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()
    assert all(t.startswith("token_id:") for t in asked["choices"][0]["logprobs"]["tokens"])
    asked = served.http.post("/v1/chat/completions", json={**chat, "return_tokens_as_token_ids": True}).json()
    assert all(c["token"].startswith("token_id:") for c in asked["choices"][0]["logprobs"]["content"])
    served.state.return_tokens_as_token_ids = True  # kvload serve --return-tokens-as-token-ids
    try:
        declined = served.http.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()
        assert not any(t.startswith("token_id:") for t in declined["choices"][0]["logprobs"]["tokens"])
    finally:
        served.state.return_tokens_as_token_ids = False
    _refused(served, "/v1/completions", {**body, "return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids")


def test_default_chat_template_kwargs_reach_every_chat_request_under_its_own(served):
    """vLLM's ``--default-chat-template-kwargs '{"enable_thinking": false}'`` (Qwen3 served without thinking): every
    chat request's template gets them, a request's own value of a name wins; /tokenize of messages agrees."""
    from kvload.serve.server import build_state
    from pipeline.errors import ConfigError

    template = "{% if extra %}w{{ extra }} {% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}w2"
    messages = [{"role": "user", "content": "w5"}]
    served.state.default_chat_template_kwargs = {"extra": 9}  # kvload serve --default-chat-template-kwargs
    try:
        def prompt_ids(**extra):
            r = served.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                                "chat_template": template, "return_token_ids": True,
                                                                **extra})
            assert r.status_code == 200, r.text
            return r.json()["prompt_token_ids"]

        assert prompt_ids() == [9, 5, 2]  # token i is "w<i>"
        assert prompt_ids(chat_template_kwargs={"extra": 8}) == [8, 5, 2]  # the request's wins
        tokens = served.http.post("/tokenize", json={"messages": messages, "chat_template": template}).json()
        assert tokens["tokens"] == [9, 5, 2]
    finally:
        served.state.default_chat_template_kwargs = {}
    assert prompt_ids() == [5, 2]
    # a default of a name the request gives as its own field: the request's field wins (it was a 400 "given both")
    effort = "{{ reasoning_effort }} {% for m in messages %}{{ m['content'] }} {% endfor %}w2"
    served.state.default_chat_template_kwargs = {"reasoning_effort": "w7", "documents": [{"text": "x"}]}
    try:
        for extra, want in (({}, [7, 5, 2]), ({"reasoning_effort": "high", "documents": [{"text": "y"}]}, None)):
            r = served.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **extra,
                                                                "chat_template": effort, "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert want is None or r.json()["prompt_token_ids"] == want
    finally:
        served.state.default_chat_template_kwargs = {}
    with pytest.raises(ConfigError, match="^default_chat_template_kwargs: "):
        build_state(served.result, default_chat_template_kwargs={"not a name": 1})


def test_a_requests_reasoning_effort_overrides_the_servers_default_enable_thinking_as_vllm_does(served):
    """kvload serve --default-chat-template-kwargs '{"enable_thinking": false}' (Qwen3 served without thinking): a
    request asking reasoning_effort "high" thinks, as vLLM's does (the effort's enable_thinking is the request's, the
    server's default is not); "none" under a default true does not; the request's own enable_thinking still wins."""
    template = "{% if enable_thinking is false %}w12 {% endif %}" + TOOL_TEMPLATE
    body = {"model": "words", "messages": CONV, "max_tokens": 1, "chat_template": template, "return_token_ids": True}

    def first(default, **extra):
        served.state.default_chat_template_kwargs = default
        try:
            r = served.http.post("/v1/chat/completions", json={**body, **extra})
        finally:
            served.state.default_chat_template_kwargs = {}
        assert r.status_code == 200, r.text
        return r.json()["prompt_token_ids"][0]

    off, on = {"enable_thinking": False}, {"enable_thinking": True}
    plain = first({})
    assert plain != 12 and first(off) == 12  # the default alone: thinking off
    assert first(off, reasoning_effort="high") == plain  # the request asked for effort: thinking on
    assert first(on, reasoning_effort="none") == 12
    assert first(off, reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}) == 12


def test_newer_vllm_fields_are_refused_saying_what_kvload_does_and_taken_as_null(served):
    """vLLM's watermarking, return_prompt_text, return_token_offsets and routed_experts_prompt_start were refused as
    any unknown name ("not supported by kvload serve" and the list): now each says what kvload does instead, and a
    client that sends every field of vLLM's request type as null is served."""
    body = {"model": "words", "messages": CONV, "max_tokens": 1}
    for field, said in (("watermarking", "kvload does not watermark its output"),
                        ("return_prompt_text", "POST /tokenize with the same messages"),
                        ("return_token_offsets", "not character offsets"),
                        ("routed_experts_prompt_start", "kvload returns no MoE routing decisions")):
        message = _refused(served, "/v1/chat/completions", {**body, field: True}, field)
        assert message.startswith(f"{field}: not supported by kvload serve (vLLM's field: ") and said in message
        assert served.http.post("/v1/chat/completions", json={**body, field: None}).status_code == 200, field
