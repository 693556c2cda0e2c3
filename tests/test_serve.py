"""``kvload serve`` on a preset (token-id prompts), through the real ``openai`` client and raw HTTP.

One server per module (one load): completions and streaming against the Python API's tokens,
overlapping requests, a client that disconnects mid-stream, bad requests, metrics, audit and explain.
"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

from tests.serve_support import TIMEOUT, serving, wait_for

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17], [20, 21]]
MAX_TOKENS = [12, 20, 8, 16]
REFERENCE: dict[int, list[int]] = {}


def _reference(result):
    outs = [result.generate([p], max_new_tokens=n, ignore_eos=True)[0]
            for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    REFERENCE.update({i: o.token_ids for i, o in enumerate(outs)})


@pytest.fixture(scope="module")
def served():
    with serving("tiny-llama", before=_reference, max_num_tokens=64) as s:
        yield s


def _complete(served, i, **kw):
    r = served.client.completions.create(model="tiny-llama", prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i],
                                         extra_body={"ignore_eos": True}, **kw)
    return r


def test_completion_gives_the_python_apis_greedy_tokens(served):
    r = _complete(served, 0)
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == REFERENCE[0]
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(PROMPTS[0]) and r.usage.completion_tokens == MAX_TOKENS[0]
    assert r.object == "text_completion" and r.model == "tiny-llama"


def test_logit_bias_penalties_and_min_tokens_give_the_python_apis_tokens(served):
    """OpenAI's logit_bias and penalties, vLLM's repetition_penalty and min_tokens: as in LLM.generate."""
    banned = REFERENCE[0][1]
    settings = {"presence_penalty": 0.8, "frequency_penalty": 0.3, "repetition_penalty": 1.4, "min_tokens": 3}
    (want,) = served.result.generate([PROMPTS[0]], max_new_tokens=MAX_TOKENS[0], ignore_eos=True, salt="pen",
                                     logit_bias={banned: -100}, **settings)
    assert want.token_ids != REFERENCE[0] and banned not in want.token_ids  # the settings change greedy's picks
    r = served.client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=MAX_TOKENS[0],
                                         presence_penalty=0.8, frequency_penalty=0.3, logit_bias={str(banned): -100},
                                         extra_body={"ignore_eos": True, "repetition_penalty": 1.4, "min_tokens": 3})
    assert r.choices[0].model_extra["token_ids"] == want.token_ids


def test_the_server_keeps_no_state_of_finished_requests(served):
    """Its driver lives as long as the server: finished requests (and what penalties keep per request) go."""
    import gc

    from engine import penalties

    for _ in range(3):
        _complete(served, 0, presence_penalty=0.5)

    def forgotten() -> bool:  # the reply's last token can reach the client before the engine's step ends
        gc.collect()
        return served.state.engine.driver.finished == [] and len(penalties._SEEN) == 0

    wait_for(forgotten, TIMEOUT, "no finished request nor penalty state left")


def test_streamed_completion_gives_the_same_tokens_one_chunk_per_token(served):
    chunks = list(_complete(served, 1, stream=True, stream_options={"include_usage": True}))
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert ids == REFERENCE[1]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS[1]


def test_overlapping_requests_give_the_same_tokens_as_one_at_a_time(served):
    audit_before = len(served.result.audit.events)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_complete, served, i % 4, stream=bool(i % 2)) for i in range(8)]
        results = [f.result(timeout=TIMEOUT) for f in futures]
    for i, r in enumerate(results):
        ids = ([t for c in r for t in c.choices[0].model_extra["token_ids"]] if i % 2
               else r.choices[0].model_extra["token_ids"])
        assert ids == REFERENCE[i % 4], i
    # they overlapped in the engine: several were admitted and unfinished at once
    events = served.result.audit.events[audit_before:]
    in_flight = peak = 0
    for e in events:
        in_flight += {"request_admitted": 1, "request_finished": -1}.get(e["event"], 0)
        peak = max(peak, in_flight)
    assert peak >= 4


def test_a_late_request_joins_a_running_one_and_a_client_that_hangs_up_has_its_blocks_freed(served):
    body = {"model": "tiny-llama", "prompt": [3, 1, 4, 1, 5], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=served.url, timeout=TIMEOUT) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        got = []
        for line in lines:
            if line.startswith("data: {"):
                got.append(json.loads(line[6:]))
            if len(got) == 3:
                break
        # a request sent now joins the long one's batch and finishes first, with its own greedy tokens
        assert _complete(served, 2).choices[0].model_extra["token_ids"] == REFERENCE[2]
        assert served.metrics()["kvload_num_requests_running"] == 1  # the long one still generates
    wait_for(lambda: served.metrics()["kvload_num_requests_running"] == 0, what="the request was aborted")
    m = served.metrics()
    assert m["kvload_kv_cache_blocks{layer_group=uniform,state=used}"] == 0
    assert m["kvload_request_success_total{finished_reason=abort}"] >= 1
    finished = [e for e in served.result.audit.of("request_finished") if e["reason"] == "abort"]
    assert finished and finished[-1]["output_tokens"] < 1500


def test_a_client_that_gives_up_on_a_plain_request_has_it_aborted(served):
    aborted = served.metrics().get("kvload_request_success_total{finished_reason=abort}", 0)
    body = {"model": "tiny-llama", "prompt": [2, 7, 1, 8], "max_tokens": 1900, "ignore_eos": True}
    with httpx.Client(base_url=served.url, timeout=0.5) as impatient, pytest.raises(httpx.ReadTimeout):
        impatient.post("/v1/completions", json=body)
    wait_for(lambda: served.metrics().get("kvload_request_success_total{finished_reason=abort}", 0) == aborted + 1,
             what="the abandoned request was aborted")
    m = served.metrics()
    assert m["kvload_num_requests_running"] == 0
    assert m["kvload_kv_cache_blocks{layer_group=uniform,state=used}"] == 0


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens", "integer >= 1"),
    ({"prompt": [1, 2], "temperature": -1}, "temperature", "[0, 2]"),
    ({"prompt": [1, 2], "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": [1, 2], "n": 129, "temperature": 1}, "n", "an integer in [1, 128]"),
    ({"prompt": [[5]] * 100_000, "max_tokens": 1}, "prompt", "at most 1024 per request"),
    ({"prompt": [[5]] * 100, "n": 11, "temperature": 1}, "n", "1,100 choices; at most 1024"),
    # past the context length: refused in vLLM's words, not silently cut to what max_seq_len leaves
    ({"prompt": [1, 2], "max_tokens": 100_000_000}, "max_tokens",
     "'max_tokens' or 'max_completion_tokens' is too large: 100000000. This model's maximum context length is 8192 "
     "tokens and your request has 2 input tokens (100000000 > 8192 - 2)"),
    ({"prompt": [[1, 2], [1, 2, 3]], "max_tokens": 8191}, "max_tokens", "(8191 > 8192 - 2)"),
    ({"prompt": [1, 2], "model": 123}, "model", "model: expected a string (the served model's name), got 123"),
    ({"prompt": [1, 2], "user": 123}, "user", "user: expected a string, got 123"),
    ({"prompt": [1, 2], "best_of": 2}, "best_of", "not supported"),
    ({"prompt": [1, 2], "logit_bias": {str(t): 1 for t in range(5000)}}, "logit_bias",
     "logit_bias: expected at most 4,096 tokens, got 5,000"),
    ({"prompt": [1, 2], "logit_bias": {"x": 1}}, "logit_bias", 'token ids to numbers in [-100, 100], e.g. {"50256"'),
    ({"prompt": [1, 2], "logit_bias": {"3": -101}}, "logit_bias", "to numbers in [-100, 100]"),
    ({"prompt": [1, 2], "logit_bias": {"99999": 1}}, "logit_bias", "token id 99999 is outside the vocabulary"),
    # one token under two spellings: the second bias silently replaced the first
    ({"prompt": [1, 2], "logit_bias": {"7": 5, "007": -5}}, "logit_bias",
     "logit_bias: token 7 is given twice ('7' and '007'); give each token once"),
    # the bounds in the server's words, with what was sent ({"3": -101}, not the API's {3: -101})
    ({"prompt": [1, 2], "logit_bias": {"3": -101}}, "logit_bias",
     'logit_bias: expected an object of token ids to numbers in [-100, 100], e.g. {"50256": -100}, got {\'3\': -101}'),
    ({"prompt": [1, 2], "logit_bias": {"9999999999999999999": 1}}, "logit_bias", "e.g. {\"50256\": -100}, got"),
    ({"prompt": [1, 2], "presence_penalty": 2.5}, "presence_penalty", "presence_penalty: expected a number in [-2, 2]"),
    ({"prompt": [1, 2], "frequency_penalty": "high"}, "frequency_penalty", "expected a number, got 'high'"),
    ({"prompt": [1, 2], "repetition_penalty": 0}, "repetition_penalty", "expected a number in [0.01, 100]"),
    ({"prompt": [1, 2], "repetition_penalty": 1e308}, "repetition_penalty", "expected a number in [0.01, 100]"),
    # a number past a float: its range said, and its size, not 300 of its digits
    ({"prompt": [1, 2], "repetition_penalty": 10**400}, "repetition_penalty",
     "repetition_penalty: expected a number in [0.01, 100] (1 = off), got an integer of about 401 digits"),
    ({"prompt": [1, 2], "frequency_penalty": -10**400}, "frequency_penalty",
     "frequency_penalty: expected a number in [-2, 2] (0 = off), got an integer of about 401 digits"),
    ({"prompt": [1, 2], "temperature": 10**400}, "temperature",
     "temperature: expected a number in [0, 2] (0 = greedy), got an integer of about 401 digits"),
    ({"prompt": [1, 2], "logit_bias": {"3": 10**400}}, "logit_bias", "to numbers in [-100, 100]"),
    ({"prompt": [1, 2], "min_tokens": 9, "max_tokens": 4}, "min_tokens", "an integer in [0, max_tokens=4]"),
    # past the server's default max_tokens, which the request did not send: named as the default, with the field
    # that raises it (it read "max_tokens=256" as if the request had sent it)
    ({"prompt": [1, 2], "min_tokens": 300}, "min_tokens", "min_tokens: expected an integer in [0, max_tokens=256], "
     "the server's default max_tokens (the request sends none), got 300; send max_tokens of at least 300"),
    ({"prompt": [1, 2], "min_p": 2}, "min_p", "min_p: expected a number in [0, 1]"),
    ({"prompt": [1, 2], "stop": ["a"] * 17}, "stop", "expected at most 16 strings, got a list of 17"),
    ({"prompt": [1, 2], "stop_token_ids": [2] * 5000}, "stop_token_ids",
     "expected at most 4,096 token ids, got a list of 5,000"),
    ({"prompt": [1, 2], "logprobs": 99}, "logprobs", "[0, 20]"),
    ({"prompt": [1, 2], "salt": "s" * 5000}, "salt", "salt: expected a string of at most 1,024 characters, got 5,000"),
    ({"prompt": [1, 2], "top_k": 2**64}, "top_k", "top_k: expected at most 2**63 - 1"),
    ({"prompt": [1, 2], "seed": 2**64}, "seed", "an integer in [0, 2**63 - 1]"),
    ({"prompt": []}, "prompt", "non-empty"),
    ({"prompt": [[1, 2], "x", [3.5]]}, "prompt[2]", "token ids"),
    ({}, "prompt", "required"),
    ({"prompt": [1, 99999]}, "prompt", "outside the vocabulary"),
    ({"prompt": [1, 2], "stop_token_ids": [99999]}, "stop_token_ids", "outside the vocabulary"),
    # falsy values of the wrong type were read as "none given" and the request served
    ({"prompt": [1, 2], "stop_token_ids": 0}, "stop_token_ids", "expected a list of token ids (integers >= 0), got 0"),
    ({"prompt": [1, 2], "stop_token_ids": ""}, "stop_token_ids", "expected a list of token ids"),
    ({"prompt": [1, 2], "stop_token_ids": False}, "stop_token_ids", "expected a list of token ids"),
    ({"prompt": [1, 2], "stop_token_ids": {}}, "stop_token_ids", "expected a list of token ids"),
    ({"prompt": "hello"}, "prompt", "no tokenizer"),
    ({"prompt": [1, 2], "max_tokens": 5000}, "max_tokens", "KV pools hold 64"),
])
def test_bad_requests_get_400_naming_the_field(served, body, param, words):
    r = served.http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert words in error["message"]


@pytest.mark.parametrize("prompt, field", [([5] * 1_000_000, "prompt"), ([[1, 2], [5] * 1_000_000], "prompt[1]")])
def test_token_ids_past_the_context_length_are_refused_by_their_count_before_each_id_is_checked(served, monkeypatch,
                                                                                               prompt, field):
    """A body of tens of millions of token ids fits under the default --max-request-bytes (100 MB: 73 s measured):
    each id was checked against the vocabulary before the count refused the prompt, on the one parsing worker
    every request waits on. The count refuses it first, in the same words."""
    ex = served.state.engine.executor
    checked = []
    check_vocab = ex._check_vocab
    monkeypatch.setattr(ex, "_check_vocab", lambda where, ids: (checked.append(len(ids)), check_vocab(where, ids)))
    r = served.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": f"{field}: 1000000 tokens leave no room to generate under "
                                            f"max_seq_len={ex.max_seq_len}; shorten it or raise max_seq_len",
                                 "type": "invalid_request_error", "param": field, "code": None}
    assert all(n < ex.max_seq_len for n in checked)  # the prompt's million ids never went through one by one


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [1, 2], "k" * 12_000: 1}, "k" * 80),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "k" * 12_000: 1}]},
     "messages[0]." + "k" * 80),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {}, "k" * 12_000: 1}}}, "response_format"),
    ("/v1/responses", {"input": "hi", "k" * 12_000: 1}, "k" * 80),
])
def test_an_unknown_field_with_a_huge_name_is_named_in_a_short_line(served, path, body, param):
    """The name was quoted whole, in the message and in ``param``: 24 KB of error for a 12 KB key."""
    r = served.http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "not supported" in error["message"] and len(r.content) < 2_000, r.text[:300]


def test_a_request_that_could_never_fit_gets_advice_a_client_can_follow(served):
    """A client cannot raise the server's KV budget: it is told how many max_tokens would fit after its prompt,
    or, when not one would, to shorten the prompt (naming ``prompt``, not ``max_tokens``)."""
    r = served.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 5000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert r.json()["error"]["message"] == (
        "max_tokens: this request could never fit the KV cache: 2 prompt tokens + max_tokens 5000 need 157 blocks of "
        "layer group 'uniform' (32 tokens each) but the KV pools hold 64; lower max_tokens to at most 2,046, or serve "
        "with a larger KV budget (--max_tokens)")
    r = served.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2047})  # one past the advice
    assert r.status_code == 400 and "at most 2,046," in r.json()["error"]["message"]
    r = served.http.post("/v1/completions", json={"prompt": [1] * 3000, "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"] == (
        "prompt: this request could never fit the KV cache: 3000 prompt tokens + max_tokens 5 need 94 blocks of layer "
        "group 'uniform' (32 tokens each) but the KV pools hold 64; shorten the prompt (the KV cache holds one "
        "sequence of 2,048 tokens), or serve with a larger KV budget (--max_tokens)")


def test_other_refusals_and_the_server_keeps_serving(served):
    r = served.http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = served.http.post("/v1/completions", json={"model": "gpt-4", "prompt": [1]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = served.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"  # a preset has no tokenizer
    with pytest.raises(openai.BadRequestError) as info:
        served.client.completions.create(model="tiny-llama", prompt=[1, 2], max_tokens=-3)
    assert info.value.body["param"] == "max_tokens"
    assert served.http.get("/health").json() == {"status": "ok"}
    assert _complete(served, 2).choices[0].model_extra["token_ids"] == REFERENCE[2]


def test_a_preset_without_a_tokenizer_answers_the_tokenizer_endpoints_with_a_400_saying_so(served):
    for path, body, param in [("/tokenize", {"prompt": "hello"}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
                              ("/detokenize", {"tokens": [1, 2]}, "tokens")]:
        r = served.http.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "tiny-llama has no tokenizer" in error["message"], error
    assert served.http.get("/health").json() == {"status": "ok"}


def _refusals(served) -> dict[str, float]:
    return {k: v for k, v in served.metrics().items() if k.startswith("kvload_http_requests_refused_total")}


def test_a_request_target_without_its_slash_is_named_as_sent(served):
    """``POST v1/completions`` (no leading slash) was answered "Invalid URL (POST /v1/completions): no such
    endpoint", naming an endpoint the server has."""
    import socket

    with socket.create_connection(("127.0.0.1", served.server.port), timeout=30) as sock:
        sock.sendall(b"POST v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404 "), data[:300]
    assert json.loads(body)["error"]["message"].startswith("Invalid URL (POST v1/completions): no such endpoint")


def test_an_unknown_path_and_a_wrong_method_get_openais_error_body_not_fastapis_detail(served):
    """404 and 405 came as FastAPI's {"detail": "Not Found"}; every other error is OpenAI's body."""
    refused = _refusals(served)
    r = served.http.post("/v1/nowhere", json={"prompt": [1]})
    assert r.status_code == 404 and "detail" not in r.json(), r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] is None
    message = r.json()["error"]["message"]
    assert message.startswith("Invalid URL (POST /v1/nowhere): no such endpoint; kvload serve answers ")
    assert "/v1/completions" in message and "/v1/chat/completions" in message and "/health" in message
    r = served.http.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
    assert r.json() == {"error": {"message": "Invalid method (GET /v1/completions): /v1/completions takes POST only",
                                  "type": "invalid_request_error", "param": None, "code": None}}
    r = served.http.delete("/health")
    assert r.status_code == 405 and r.json()["error"]["message"].endswith("/health takes GET, HEAD only"), r.text
    with pytest.raises(openai.NotFoundError) as info:  # the real client reads the message out of the body
        served.client.moderations.create(model="tiny-llama", input="hello")
    assert info.value.body["message"].startswith("Invalid URL (POST /v1/moderations): no such endpoint")
    # a routing answer is no refusal of a request the server serves (and no model_not_found): counted as before
    assert _refusals(served) == refused
    assert _complete(served, 2).choices[0].model_extra["token_ids"] == REFERENCE[2]


def test_a_wrong_method_names_every_method_the_path_takes(served):
    """/v1/responses/{id} takes GET and DELETE: Starlette's Allow named only the first route's GET."""
    for method in ("POST", "PUT"):
        r = served.http.request(method, "/v1/responses/resp_x")
        assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET, HEAD", r.headers
        assert r.json()["error"]["message"] == (f"Invalid method ({method} /v1/responses/resp_x): /v1/responses/resp_x "
                                                "takes DELETE, GET, HEAD only")
    assert served.http.delete("/v1/responses/resp_x").json()["error"]["code"] == "response_not_found"  # it does


def test_every_get_route_answers_head_with_its_headers_alone(served):
    """HTTP's rule (RFC 9110: a general-purpose server supports GET and HEAD); a monitor's HEAD /health was a 405."""
    for path in ("/health", "/v1/models", "/v1/models/tiny-llama", "/version", "/metrics"):
        get, head = served.http.get(path), served.http.head(path)
        assert head.status_code == get.status_code == 200 and head.content == b"", (path, head.status_code)
        assert head.headers["content-type"] == get.headers["content-type"]
    assert served.http.head("/v1/responses/resp_x").status_code == 404  # as its GET
    assert served.http.head("/v1/completions").headers["allow"] == "POST"  # a POST route takes no HEAD


def test_a_trailing_slash_is_a_404_naming_the_endpoints_not_a_redirect_to_the_clients_host(served):
    """Starlette answered "/v1/completions/" with a bodiless 307 to the host the request's Host header named."""
    for path in ("/v1/completions/", "/v1/messages/", "/health/"):
        r = served.http.post(path, json={"prompt": [1], "max_tokens": 1}, headers={"Host": "elsewhere.example"})
        assert r.status_code == 404 and "location" not in r.headers, (path, r.status_code, r.headers)
        error = r.json()["error"]
        assert error["message"].startswith(f"Invalid URL (POST {path}): no such endpoint; kvload serve answers ")
        assert error.get("type") in ("invalid_request_error", "not_found_error")
    assert _complete(served, 2).choices[0].model_extra["token_ids"] == REFERENCE[2]


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt",
     "prompt: not valid Unicode text (a lone surrogate at character 0"),
    ("/v1/completions", b'{"prompt": ["a\\udfff", "ok"], "max_tokens": 2}', "prompt[0]",
     "prompt[0]: not valid Unicode text (a lone surrogate at character 1"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\ud800"}]}', "messages",
     "messages[0].content: not valid Unicode text (a lone surrogate at character 1"),
    ("/v1/completions", b'{"prompt": [1, 2], "salt": "\\ud800"}', "salt", "valid Unicode"),
    # the Responses API echoes user in its answer, whose UTF-8 a lone surrogate failed: a 500 (one parse, every route)
    ("/v1/completions", b'{"prompt": [1, 2], "user": "a\\ud800"}', "user",
     "user: not valid Unicode text (a lone surrogate at character 1"),
    ("/v1/completions", b'{"prompt": [1, 2], "stop": ["ok", "\\udfff"]}', "stop",
     "stop[1]: not valid Unicode text (a lone surrogate at character 0"),
    ("/v1/completions", b'{"prompt": [1, 2], "max_tokens": 2, "max_tokens": 3}', None,  # json keeps the last
     "key 'max_tokens' appears twice in one object"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a", "content": "b"}]}', None,
     "key 'content' appears twice"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nests too deeply"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}", None, "at most 32 levels"),
    # json refuses to read an integer literal past 4,300 digits (a ValueError, not a JSONDecodeError): was a 500
    ("/v1/completions", b'{"prompt": [1, 2], "max_tokens": ' + b"9" * 5000 + b"}", "max_tokens",
     "max_tokens: an integer of 5,000 digits; at most 4,300 digits are accepted; no field takes an integer past "
     "2**63 - 1"),
    # in a schema it named no field ("the request body holds an integer literal ..."); json's own message was
    # Python's advice to call sys.set_int_max_str_digits()
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
     b'"json_schema", "json_schema": {"name": "a", "schema": {"type": "integer", "maximum": -' + b"9" * 5000 +
     b"}}}}", "response_format", "response_format.json_schema.schema.maximum: an integer of 5,000 digits; at most "
     "4,300 digits are accepted"),
    ("/v1/completions", b'{"prompt": [1, 2], "structured_outputs": {"json": {"enum": [1, ' + b"7" * 4301 + b"]}}}",
     "structured_outputs", "structured_outputs.json.enum[1]: an integer of 4,301 digits"),
    # a lone surrogate in a JSON schema: a UnicodeEncodeError when the grammar was keyed, a 500 with a traceback
    ("/v1/completions", b'{"prompt": [1, 2], "structured_outputs": {"json": {"enum": ["ok", "\\ud800"]}}}',
     "structured_outputs", "structured_outputs.json.enum[1]: not valid Unicode text (a lone surrogate at character 0"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
     b'"json_schema", "json_schema": {"name": "a", "schema": {"type": "string", "pattern": "a\\udfff"}}}}',
     "response_format", "response_format.json_schema.schema.pattern: not valid Unicode text (a lone surrogate at "
     "character 1"),
    # a refusal quoting a lone surrogate (an unknown field's name) could not be written as UTF-8: a 500, the
    # connection dropped; it is quoted as its escape
    ("/v1/completions", b'{"prompt": [1, 2], "\\ud800x": 1}', "\\ud800x",
     "\\ud800x: not supported by kvload serve; accepted fields: "),
    # UTF-16's bytes hide brackets from the nesting check ("\u2200" holds a quote byte): 100,000 passed it and
    # json's decoder raised RecursionError, a 500; the check reads the body decoded, so they are counted
    ("/v1/completions", ('{"prompt": "\u2200", "x": ' + "[" * 100_000 + "]" * 100_000 + ', "y": "\u2200"}'
                         ).encode("utf-16-le"), None, "nests too deeply"),
    ("/v1/completions", "nope".encode("utf-16-le"), None, "the request body is not valid JSON: Expecting value"),
    ("/v1/completions", b"\xff\xfe" + '{"prompt": "'.encode("utf-16-le") + b"\x00\xd8" + '"}'.encode("utf-16-le"),
     None, "the request body is not UTF-16 text: byte 0x00 at offset 26 (illegal UTF-16 surrogate)"),
    ("/v1/completions", b'{"prompt": "a \xed\xa0\x80"}', None,  # a surrogate encoded in UTF-8's way
     "the request body is not UTF-8 text: byte 0xed at offset 14 (invalid continuation byte)"),
])
def test_bodies_the_tokenizer_or_json_cannot_take_get_400_and_the_server_keeps_serving(served, path, body, param,
                                                                                      words):
    r = served.http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert words in error["message"]
    assert _complete(served, 3).choices[0].model_extra["token_ids"] == REFERENCE[3]


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le",
                                      "utf-32-be"])
def test_a_json_body_in_utf_16_or_utf_32_is_read_as_vllm_reads_it(served, encoding):
    """RFC 8259/4627's encodings, with a BOM or without: vLLM's FastAPI reads them (``json.loads`` of bytes); kvload
    answered "not valid JSON" (no BOM: its NULs are UTF-8) or "not UTF-8 text" (a BOM)."""
    body = json.dumps({"prompt": PROMPTS[3], "max_tokens": MAX_TOKENS[3], "ignore_eos": True, "user": "h\u00e9 \u2200"},
                      ensure_ascii=False)
    r = served.http.post("/v1/completions", content=body.encode(encoding), headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == REFERENCE[3]


def test_greedy_n_gives_n_identical_choices_as_openai_and_vllm_do(served):
    r = served.client.completions.create(model="tiny-llama", prompt=PROMPTS[1], max_tokens=MAX_TOKENS[1], n=3,
                                         extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in r.choices] == [REFERENCE[1]] * 3
    assert r.usage.completion_tokens == 3 * MAX_TOKENS[1]


def test_logprobs_sampling_seeds_and_n(served):
    r = served.client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=6, logprobs=3,
                                         extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and all(len(top) == 3 for top in lp.top_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token
    kw = {"model": "tiny-llama", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.5, "seed": 5, "n": 3,
          "extra_body": {"ignore_eos": True}}
    a, b = served.client.completions.create(**kw), served.client.completions.create(**kw)
    ids = [c.model_extra["token_ids"] for c in a.choices]
    assert ids == [c.model_extra["token_ids"] for c in b.choices]  # same seed, same samples
    assert [c.index for c in a.choices] == [0, 1, 2] and len({tuple(x) for x in ids}) > 1
    assert a.usage.completion_tokens == 24


def test_metrics_parse_and_move_as_requests_run(served):
    before = served.metrics()
    _complete(served, 3)
    _complete(served, 3)  # the same prompt again: its full blocks... (2 tokens: nothing to reuse), still a query
    after = served.metrics()
    assert after["kvload_generation_tokens_total"] - before["kvload_generation_tokens_total"] == 2 * MAX_TOKENS[3]
    assert after["kvload_prompt_tokens_total"] - before["kvload_prompt_tokens_total"] == 2 * len(PROMPTS[3])
    assert after["kvload_time_to_first_token_seconds_count"] - before["kvload_time_to_first_token_seconds_count"] == 2
    assert (after["kvload_time_per_output_token_seconds_count"]
            - before["kvload_time_per_output_token_seconds_count"]) == 2 * (MAX_TOKENS[3] - 1)
    assert after["kvload_prefix_cache_queries_total"] > before["kvload_prefix_cache_queries_total"]
    assert after["kvload_engine_steps_total"] > before["kvload_engine_steps_total"]
    for key in ("kvload_num_requests_running", "kvload_num_requests_waiting", "kvload_num_requests_suspended",
                "kvload_num_preemptions_total", "kvload_kv_cache_usage_perc{layer_group=uniform}"):
        assert key in after


def test_prefix_cache_hits_show_in_metrics(served):
    long_prompt = list(range(100, 180))  # 80 tokens: two full blocks of 32 to reuse
    before = served.metrics()["kvload_prefix_cache_hits_total"]
    for _ in range(2):
        served.client.completions.create(model="tiny-llama", prompt=long_prompt, max_tokens=2)
    r = served.client.completions.create(model="tiny-llama", prompt=long_prompt, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens >= 64
    assert served.metrics()["kvload_prefix_cache_hits_total"] - before >= 64


def test_models_audit_and_explain(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    lines = served.http.get("/v1/kvload/audit").text.strip().split("\n")
    records = [json.loads(line) for line in lines]
    assert records[0]["event"] == "audit_header"
    assert any(r["event"] == "pipeline_finished" for r in records)
    assert any(r["event"] == "request_finished" for r in records)  # generation events join the log
    chain = served.http.get("/v1/kvload/explain", params={"field": "max_tokens"}).json()
    assert chain["field"] == "kv_cache_config.max_tokens" and chain["final"] == 2048
    assert chain["chain"][-1]["source"] == "api"
    r = served.http.get("/v1/kvload/explain", params={"field": "no_such_field"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "field"
    # a client's field name is quoted cut: a 60,000-character one came back whole in the message
    r = served.http.get("/v1/kvload/explain", params={"field": "a" * 12_000})  # the head stays under 16 KiB
    assert r.status_code == 400 and "a" * 78 not in r.text, len(r.text)
    assert r.json()["error"]["message"].startswith("field: '" + "a" * 77 + "'... is not an LlmArgs field; fields: ")


def test_kvloads_routes_refuse_a_query_parameter_they_do_not_read_or_one_given_twice(served):
    """?field=a&field=b explained b alone, and a misspelt parameter (?feild=...) was dropped unread; the /v1/responses
    routes refused theirs already."""
    cases = [("/v1/kvload/explain?field=max_tokens&field=dtype", "field", "field: given 2 times; give it once"),
             ("/v1/kvload/explain?field=dtype&verbose=1", "verbose",
              "verbose: query parameter not supported; accepted: field"),
             ("/v1/kvload/audit?since=5", "since", "since: query parameter not supported; this route takes none"),
             ("/v1/kvload/kv_events?limit=5", "limit", "limit: query parameter not supported; this route takes none")]
    for path, param, message in cases:
        r = served.http.get(path)
        assert r.status_code == 400 and r.json()["error"] == {"message": message, "type": "invalid_request_error",
                                                              "param": param, "code": None}, (path, r.text)
    assert served.http.get("/v1/kvload/explain?field=dtype").json()["field"] == "dtype"


def test_a_client_that_hangs_up_while_sending_its_body_is_not_a_server_error(served):
    """A dropped upload is the client's doing: the app answers it without raising (uvicorn logs what escapes an app
    as "Exception in ASGI application" with a traceback) and submits nothing."""
    import asyncio

    from kvload.serve.app import create_app

    app = create_app(served.state)
    incoming = [{"type": "http.request", "body": b'{"prompt": [1, 2', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))  # raised ClientDisconnect before
    assert sent and sent[0]["type"] == "http.response.start"
    assert served.metrics()["kvload_num_requests_running"] == 0


@pytest.mark.parametrize("name", ["", "  ", 5])
def test_build_state_refuses_a_blank_model_name_instead_of_using_the_models(served, name):
    """The API side of --served-model-name '': `model_name or MODEL's name` dropped it without a word."""
    from kvload.serve.server import build_state
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="^model_name: expected a non-empty name"):
        build_state(served.result, model_name=name)


def test_build_state_refuses_a_chat_template_without_a_tokenizer_naming_the_model(served):
    """The API side of ``serve --chat-template`` on a preset: the one check both share names the model given."""
    from kvload.serve.server import build_state
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^chat_template: tiny-llama has no tokenizer \(presets have random "
                                          r"weights and none\): there is no text to template$"):
        build_state(served.result, chat_template="{{ messages[0]['content'] }}")


def test_the_served_model_answers_its_own_callers_while_the_server_runs(served):
    # the serving loop runs kvload's attention for as long as the server lives; a caller of the same transformers
    # model in this process (a scoring pass beside the server) still gets the model's own attention and masks
    import torch

    model = served.result.hf_model
    ids, mask = torch.tensor([[0, 0, 1, 2, 3], [4, 5, 6, 7, 8]]), torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.inference_mode():
        both = model(input_ids=ids, attention_mask=mask).logits
        alone = model(input_ids=ids[:1, 2:]).logits  # the padded row, unpadded: padding must not change it
    assert torch.allclose(both[0, 2:], alone[0], atol=1e-5)
    assert _complete(served, 0).choices[0].model_extra["token_ids"] == REFERENCE[0]  # and the server still serves


def test_an_engine_seed_makes_unseeded_requests_repeat_as_vllms_serve_seed_does(served):
    """``kvload serve --seed N`` (vLLM's engine seed) starts the sequence unseeded requests draw from, so the same
    requests in the same order sample the same tokens run to run (0 by default, as vLLM's V1 engine)."""
    import random

    executor = served.result.executor

    def run() -> list[list[int]]:
        executor.call_seeds = random.Random(7)  # what --seed 7 sets at start-up
        body = {"ignore_eos": True, "top_k": 0}
        return [c.model_extra["token_ids"] for n in (1, 3) for c in served.client.completions.create(
            model="tiny-llama", prompt=PROMPTS[0], max_tokens=6, temperature=1.5, n=n, extra_body=body).choices]

    try:
        first, again = run(), run()
    finally:
        executor.call_seeds = None
    assert first == again and len({tuple(t) for t in first}) > 1
