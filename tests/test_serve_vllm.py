"""What vLLM's users send ``kvload serve``: the chat template's options on chat completions (through the openai
client's ``extra_body``), ``add_special_tokens``, ``POST /tokenize`` and ``/detokenize``, ``GET /version``.

One server per module over the tiny llama with a word-level tokenizer (token ``i`` is the text ``w<i>``, token 1 is
its BOS ``<s>``) and a chat template that writes each message's content, then ``w2`` for the assistant's turn, and
a ``who`` variable when one is given: every prompt's token ids can be read off the text.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from tests.serve_support import TIMEOUT, answers_while_held, held_at_step, serving

VOCAB = 512  # the tiny llama's
TEMPLATE = ("{% if who %}{{ who }} {% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}w2{% endif %}")
READ_TIMEOUT = 2.0
MAX_BYTES = 64 * 1024
CONV = [{"role": "user", "content": "w5 w17"}, {"role": "assistant", "content": "w30"}]


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab["<s>"] = vocab.pop("w1")
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="<s>")
    fast.chat_template = TEMPLATE
    return fast


def words_checkpoint(tiny_checkpoints, folder: Path) -> Path:
    """The tiny llama with this word tokenizer, as a checkpoint directory under ``folder``: what these tests serve."""
    path = folder / "ckpt"
    shutil.copytree(tiny_checkpoints("llama"), path)
    _tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory):
    path = words_checkpoint(tiny_checkpoints, tmp_path_factory.mktemp("bos-words"))
    with serving(str(path), max_seq_len=64, kv_cache_config={"max_tokens": 512, "tokens_per_block": 4},
                 state={"model_name": "words", "read_timeout_s": READ_TIMEOUT, "max_request_bytes": MAX_BYTES,
                        "trust_request_chat_template": True}) as s:
        yield s


def _chat(served, messages=CONV, **extra):
    return served.client.chat.completions.create(model="words", messages=messages, max_tokens=2,
                                                 extra_body={"ignore_eos": True, **extra})


def _tokenize(served, **body):
    r = served.http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# --- chat completions: vLLM's chat template options -------------------------------------------------------------


def test_tokenize_of_messages_is_what_the_chat_endpoint_prompts_with_under_every_option(served):
    cases = [({}, [5, 17, 30, 2]),
             ({"add_generation_prompt": False}, [5, 17, 30]),
             ({"add_generation_prompt": False, "continue_final_message": True}, [5, 17, 30]),
             ({"chat_template_kwargs": {"who": "w42"}}, [42, 5, 17, 30, 2]),  # the variable reached the template
             ({"chat_template": "{% for m in messages %}{{ m['content'] }} w7 {% endfor %}"}, [5, 17, 7, 30, 7]),
             ({"add_special_tokens": True}, [1, 5, 17, 30, 2])]  # the tokenizer's BOS on top of the template's text
    for options, ids in cases:
        tokens = _tokenize(served, messages=CONV, **options)
        assert tokens["tokens"] == ids and tokens["count"] == len(ids), options
        assert _chat(served, **options).usage.prompt_tokens == len(ids), options


def test_a_requests_own_chat_template_needs_the_operators_trust(served):
    """vLLM's rule: Jinja from the client runs only on a server started with --trust-request-chat-template."""
    template = "{% for m in messages %}{{ m['content'] }} w7 {% endfor %}"
    served.state.trust_request_chat_template = False
    try:
        for path, body in (("/v1/chat/completions", {"model": "words", "messages": CONV, "max_tokens": 1}),
                           ("/tokenize", {"messages": CONV})):
            r = served.http.post(path, json={**body, "chat_template": template})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "chat_template"
            assert "--trust-request-chat-template" in error["message"]
            assert served.http.post(path, json=body).status_code == 200  # the model's template still serves
    finally:
        served.state.trust_request_chat_template = True


def test_chat_template_kwargs_reach_the_template_of_a_chat_completion(served):
    """The prompt grows by the variable's token: without it the template prints nothing."""
    plain = _chat(served).usage.prompt_tokens
    assert _chat(served, chat_template_kwargs={"who": "w42 w43"}).usage.prompt_tokens == plain + 2
    assert _chat(served, chat_template_kwargs={}).usage.prompt_tokens == plain


@pytest.mark.parametrize("options, param, words", [
    ({"continue_final_message": True}, "continue_final_message", "cannot be true with add_generation_prompt true"),
    ({"add_generation_prompt": "no"}, "add_generation_prompt", "add_generation_prompt: expected true or false"),
    ({"continue_final_message": 1}, "continue_final_message", "continue_final_message: expected true or false"),
    ({"chat_template": 3}, "chat_template", "chat_template: expected a Jinja template string"),
    ({"chat_template": "  "}, "chat_template", "chat_template: expected a Jinja template string"),
    ({"chat_template_kwargs": ["who"]}, "chat_template_kwargs", "chat_template_kwargs: expected a dict"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "'tokenize' is not a template variable"),
    ({"add_special_tokens": "yes"}, "add_special_tokens", "add_special_tokens: expected true or false"),
    ({"chat_template": "{% for m in messages %}"}, "chat_template",
     "the chat_template given is not a Jinja template: line 1"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_bad_template_options_are_400s_naming_the_field(served, path, options, param, words):
    r = served.http.post(path, json={"messages": CONV, "max_tokens": 2, **options} if path != "/tokenize"
                         else {"messages": CONV, **options})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert words in error["message"] and not error["message"].startswith("chat: "), error


def test_a_completion_takes_add_special_tokens_as_vllm_does(served):
    with_bos = served.client.completions.create(model="words", prompt="w5 w17", max_tokens=2,
                                                extra_body={"ignore_eos": True})
    without = served.client.completions.create(model="words", prompt="w5 w17", max_tokens=2,
                                               extra_body={"ignore_eos": True, "add_special_tokens": False})
    assert (with_bos.usage.prompt_tokens, without.usage.prompt_tokens) == (3, 2)
    r = served.http.post("/v1/completions", json={"prompt": "w5", "add_special_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens"


# --- /tokenize, /detokenize ---------------------------------------------------------------------------------


def test_tokenize_a_prompt_as_vllm_answers(served):
    max_len = served.client.models.retrieve("words").model_extra["max_model_len"]
    assert _tokenize(served, prompt="w5 w17") == {"count": 3, "max_model_len": max_len, "tokens": [1, 5, 17],
                                                  "token_strs": None}
    assert _tokenize(served, model="words", prompt="w5 w17", add_special_tokens=False,
                     return_token_strs=True) == {"count": 2, "max_model_len": max_len, "tokens": [5, 17],
                                                 "token_strs": ["w5", "w17"]}
    assert _tokenize(served, prompt="w5", return_token_strs=True)["token_strs"] == ["<s>", "w5"]
    assert _tokenize(served, messages=CONV, return_token_strs=True)["token_strs"] == ["w5", "w17", "w30", "w2"]
    # no room check: /tokenize tells how long a prompt is, the longest ones included
    long = " ".join(["w9"] * (max_len + 5))
    assert _tokenize(served, prompt=long)["count"] == max_len + 6


def test_detokenize_gives_the_text_with_special_tokens(served):
    r = served.http.post("/detokenize", json={"model": "words", "tokens": [1, 5, 17]})
    assert r.status_code == 200 and r.json() == {"prompt": "<s> w5 w17"}
    assert served.http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/detokenize", {"tokens": [5, VOCAB]}, 400, "tokens", "tokens[1]: token id 512 is outside the tokenizer's "
                                                           "vocabulary (0..511)"),
    ("/detokenize", {"tokens": [5, -1]}, 400, "tokens", "a list of token ids"),
    ("/detokenize", {"tokens": "w5"}, 400, "tokens", "a list of token ids"),
    ("/detokenize", {}, 400, "tokens", "a list of token ids"),
    ("/detokenize", {"tokens": [5], "prompt": "w5"}, 400, "prompt", "not supported"),
    ("/detokenize", {"model": "gpt-4", "tokens": [5]}, 404, "model", "not served here"),
    ("/tokenize", {"model": "gpt-4", "prompt": "w5"}, 404, "model", "not served here"),
    ("/tokenize", {"model": 3, "prompt": "w5"}, 400, "model", "a string"),
    ("/tokenize", {}, 400, "prompt", "prompt: required"),
    ("/tokenize", {"prompt": [5, 17]}, 400, "prompt", "prompt: expected a string"),
    ("/tokenize", {"prompt": "w5", "messages": CONV}, 400, "messages", "not both"),
    ("/tokenize", {"prompt": "w5", "add_generation_prompt": False}, 400, "add_generation_prompt", "not supported"),
    ("/tokenize", {"prompt": "w5", "return_token_strs": "yes"}, 400, "return_token_strs", "true or false"),
    ("/tokenize", {"messages": []}, 400, "messages", "a non-empty list"),
    ("/tokenize", {"messages": CONV, "documents": []}, 400, "documents", "not supported"),
    ("/tokenize", {"messages": CONV, "tools": [{"type": "function"}]}, 400, "tools[0]", '"function": {"name"'),
])
def test_tokenizer_endpoint_refusals_name_the_field(served, path, body, status, param, words):
    r = served.http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    if status == 404:
        assert error["code"] == "model_not_found"


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_tokenizer_endpoints_have_the_completions_body_limits(served, path):
    for body, words in [(b'{"prompt": "w5", "prompt": "w6"}', "key 'prompt' appears twice"),
                        (b'{"tokens": ' + b"[" * 40 + b"]" * 40 + b"}", "at most 32 levels"),
                        (b"{not json", "not valid JSON")]:
        r = served.http.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    big = json.dumps({"prompt": "w5 " * MAX_BYTES}).encode()
    r = served.http.post(path, content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    # a body that stops arriving is a 408 once --request-read-timeout passes
    with socket.create_connection(("127.0.0.1", served.server.port), timeout=TIMEOUT) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     "Content-Length: 100\r\n\r\n{\"prom".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 408"), data
    assert b"did not arrive in time" in data


def test_tokenize_runs_off_the_event_loop(served):
    """The tokenizer is held until /health has answered: were the body tokenized on the event loop, /health could
    not answer (the hook gives up after a while, so a failure is not a hang)."""
    def health(http: httpx.Client) -> None:
        assert http.get("/health").json() == {"status": "ok"}

    r = answers_while_held(served, served.state.engine, "tokenize",
                           lambda http: http.post("/tokenize", json={"prompt": "w5"}), health)
    assert r.status_code == 200 and r.json()["tokens"] == [1, 5]


# --- /version and the list of endpoints ------------------------------------------------------------------------


def test_version_and_the_404_lists_the_new_endpoints(served):
    from pipeline.version import __version__

    assert served.http.get("/version").json() == {"version": __version__}
    r = served.http.get("/nowhere")
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert all(p in message for p in ("/tokenize", "/detokenize", "/version")), message


def test_stop_strings_min_tokens_and_include_stop_str_in_output_cut_the_text_as_generate_does(served):
    def complete(**extra):
        body = {"model": "words", "prompt": "w5 w17", "max_tokens": 8, "ignore_eos": True, **extra}
        r = served.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    base = complete()["text"]
    words = base.split()
    stop = f"{words[1]} {words[2]}"  # complete at token 3
    cut = complete(stop=[stop])
    assert (cut["finish_reason"], cut["text"]) == ("stop", base[:base.index(stop)])
    kept = complete(stop=[stop], include_stop_str_in_output=True)
    assert kept["text"] == base[:base.index(stop) + len(stop)]
    held = complete(stop=[stop], min_tokens=6)  # found only before min_tokens: never searched, never cut
    assert (held["finish_reason"], held["text"]) == ("length", base)
    for field, value in (("include_stop_str_in_output", "yes"), ("skip_special_tokens", 1)):
        r = served.http.post("/v1/completions", json={"prompt": "w5", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_include_stop_str_in_output_keeps_the_stop_token_that_ended_a_choice_as_vllm_does(served):
    body = {"model": "words", "prompt": "w5 w17", "max_tokens": 8, "ignore_eos": True}
    base = served.http.post("/v1/completions", json=body).json()["choices"][0]
    stop = base["token_ids"][2]
    for stream in (False, True):
        r = served.http.post("/v1/completions", json={**body, "stop_token_ids": [stop], "stream": stream,
                                                      "include_stop_str_in_output": True})
        assert r.status_code == 200, r.text
        chunks = ([json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")] if stream
                  else [r.json()])
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == " ".join(f"w{t}" for t in base["token_ids"][:3]), (stream, text)


def test_a_stream_keeping_its_stop_string_shows_each_token_as_it_comes_as_vllm_streams_it(served):
    """With include_stop_str_in_output no text is held back (vLLM's stop_buffer_length 0): each chunk's text is its
    own token's, where excluding the stop string holds the last len(stop) - 1 characters until they cannot be cut."""
    body = {"model": "words", "prompt": "w5 w17", "max_tokens": 8, "ignore_eos": True}
    base = served.http.post("/v1/completions", json=body).json()["choices"][0]
    stop = " ".join(base["text"].split()[4:6])  # complete at token 6
    r = served.http.post("/v1/completions", json={**body, "stream": True, "stop": [stop],
                                                  "include_stop_str_in_output": True})
    chunks = [json.loads(line[6:])["choices"][0] for line in r.text.splitlines() if line.startswith("data: {")]
    assert [c["text"].strip() for c in chunks] == [f"w{t}" for t in base["token_ids"][:6]]
    assert "".join(c["text"] for c in chunks) == base["text"][:base["text"].index(stop) + len(stop)]
    assert chunks[-1]["finish_reason"] == "stop" and chunks[-1]["stop_reason"] == stop


def test_a_stop_string_inside_min_tokens_text_is_never_searched_whatever_longer_one_comes_with_it(served):
    """vLLM looks for each stop string only where it would end in new text: one written under min_tokens never ends
    the choice, also beside a long stop string (whose reach made the server search the min_tokens text)."""
    body = {"model": "words", "prompt": "w5 w17", "max_tokens": 8, "ignore_eos": True, "min_tokens": 5}
    base = served.http.post("/v1/completions", json=body).json()["choices"][0]
    inside = base["text"].split()[4]  # completed by token 5, under min_tokens
    assert base["text"].split().count(inside) == 1
    for stop in ([inside], [inside, "a stop string this output never writes"]):
        for stream in (False, True):
            r = served.http.post("/v1/completions", json={**body, "stop": stop, "stream": stream})
            chunks = ([json.loads(line[6:])["choices"][0] for line in r.text.splitlines()
                       if line.startswith("data: {")] if stream else r.json()["choices"])
            got = ("".join(c["text"] for c in chunks), chunks[-1]["finish_reason"], chunks[-1]["stop_reason"])
            assert got == (base["text"], "length", None), (stop, stream)


def test_echo_puts_the_prompt_and_its_logprobs_before_the_completion_as_lm_eval_reads_them(served):
    """lm-evaluation-harness scores a continuation by one completions request: echo, logprobs=1, max_tokens=1; the
    prompt's token_logprobs (the first null) are the model's, the same numbers the Python API's prompt_logprobs give."""
    context, continuation = "w5 w17 w30", " w42 w7"
    body = {"model": "words", "prompt": context + continuation, "max_tokens": 1, "echo": True, "logprobs": 1,
            "temperature": 0}
    r = served.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    ids = served.http.post("/tokenize", json={"prompt": context + continuation}).json()["tokens"]  # <s> w5 ... w7
    assert lp["tokens"][:len(ids)] == ["<s>", "w5", "w17", "w30", "w42", "w7"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert choice["text"].startswith(context + continuation) and len(lp["tokens"]) == len(ids) + 1
    assert lp["text_offset"][:len(ids)] == sorted(lp["text_offset"][:len(ids)])
    (api,) = served.result.executor.run([ids], max_tokens=1, prompt_logprobs=1, salt="api")
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx([api.prompt_logprobs[j][ids[j]]
                                                              for j in range(1, len(ids))], abs=1e-5)
    ctxlen = 4  # <s> w5 w17 w30: lm-eval sums the continuation's and checks each is the greedy pick
    assert sum(lp["token_logprobs"][ctxlen:-1]) == pytest.approx(sum(api.prompt_logprobs[j][ids[j]]
                                                                     for j in range(ctxlen, len(ids))), abs=1e-4)
    # streamed: the prompt comes in the first chunk, and the chunks add up to the same text
    with served.http.stream("POST", "/v1/completions", json={**body, "stream": True, "max_tokens": 3,
                                                             "ignore_eos": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(context + continuation) and first["logprobs"]["token_logprobs"][0] is None
    # offsets count from the start of the echoed text in every chunk, as in the whole answer
    whole = served.http.post("/v1/completions", json={**body, "max_tokens": 3, "ignore_eos": True}).json()
    streamed = [o for c in chunks for o in (c["choices"][0]["logprobs"] or {}).get("text_offset", [])]
    assert streamed == whole["choices"][0]["logprobs"]["text_offset"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    # echo without logprobs: the prompt's text only
    plain = served.http.post("/v1/completions", json={**body, "logprobs": None}).json()["choices"][0]
    assert plain["text"].startswith(context + continuation) and plain["logprobs"] is None


def test_min_tokens_past_what_the_context_leaves_is_refused_naming_it_when_max_tokens_is_not_given(served):
    """The default max_tokens is what max_seq_len leaves after the prompt; a min_tokens the request sent past it is
    refused naming min_tokens and that bound, as vLLM refuses it (min_tokens may not exceed the max_tokens it
    defaults to max_model_len - prompt), not cut to a length the client never asked for."""
    body = {"model": "words", "prompt": "w5 w17", "min_tokens": 100, "ignore_eos": True}
    r = served.http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "min_tokens"
    assert error["message"].startswith("min_tokens: expected an integer in [0, max_tokens=61], what max_seq_len=64 "
                                       "leaves after the prompt's 3 tokens (the request sends no max_tokens), got 100")
    r = served.http.post("/v1/completions", json={**body, "min_tokens": 61})  # exactly what is left: served
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 64 - 3  # <s> w5 w17
    r = served.http.post("/v1/completions", json={**body, "prompt": ["w5 w17", "w5"]})  # n prompts: which one
    assert r.status_code == 400 and "(prompt 0)" in r.json()["error"]["message"]


def test_the_operators_chat_template_replaces_the_tokenizers_for_chat_and_tokenize(tiny_checkpoints, tmp_path):
    """``--chat-template`` (build_state's chat_template): a base model without a template gets one; the server's
    chat requests and /tokenize of messages use it, with no trust flag (it is the operator's, not a request's)."""
    import shutil

    from tests.llm_support import word_tokenizer

    path = tmp_path / "base"
    shutil.copytree(tiny_checkpoints("llama"), path)
    word_tokenizer(VOCAB).save_pretrained(path)  # no chat template
    template = "{% for m in messages %}w9 {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w4{% endif %}"
    with serving(str(path), max_seq_len=64, kv_cache_config={"max_tokens": 512, "tokens_per_block": 4},
                 state={"model_name": "base", "chat_template": template}) as s:
        r = s.http.post("/tokenize", json={"messages": [{"role": "user", "content": "w5 w17"}]})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == [9, 5, 17, 4]
        chat = s.client.chat.completions.create(model="base", messages=[{"role": "user", "content": "w5 w17"}],
                                                max_tokens=1)
        assert chat.usage.prompt_tokens == 4


def test_a_scored_prompt_reads_no_cached_prefix_and_leaves_its_blocks_to_later_requests(served):
    """echo + logprobs scores every prompt token, so a cached prefix (a plain request's, under the same salt) is not
    read and no logprob is null; the scored request's own blocks are cached under its salt for later requests."""
    prompt = "w5 w17 w30 w42 w7 w9 w11 w13 w15 w19 w21 w23 w25 w27 w29 w31"  # 17 tokens with <s>: 4 full blocks

    def complete(salt: str, **extra) -> dict:
        r = served.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "salt": salt, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    assert complete("scored-after")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # caches the prompt
    scores = []
    for _ in range(2):
        doc = complete("scored-after", echo=True, logprobs=0)
        assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        scores.append(doc["choices"][0]["logprobs"]["token_logprobs"][1:17])
        assert None not in scores[-1]
    assert scores[0] == pytest.approx(scores[1], abs=1e-5)
    # scored first, under a salt nothing else used: a plain request then hits the scored request's blocks
    assert complete("scored-first", echo=True, logprobs=0)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete("scored-first")["usage"]["prompt_tokens_details"]["cached_tokens"] == 16


def test_echo_with_logprobs_is_bounded_per_request(served, monkeypatch):
    from kvload.serve import request_run

    monkeypatch.setattr(request_run, "MAX_SCORED_PROMPT_TOKENS", 4)
    body = {"prompt": ["w5 w17", "w30 w42 w7"], "max_tokens": 1, "echo": True, "logprobs": 1}
    r = served.http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    assert "at most 4 prompt tokens per request, got 7" in r.json()["error"]["message"]
    assert served.http.post("/v1/completions", json={**body, "logprobs": None}).status_code == 200  # echo alone


def test_several_served_model_names_are_each_served_and_answers_carry_the_first():
    """vLLM's ``--served-model-name A B``: a request may give any of the names, ``/v1/models`` lists each, and every
    answer (and the metrics' ``model_name``) says the first; another name is still a 404 naming them all."""
    import openai

    with serving("tiny-llama", state={"model_name": ["first", "org/second"]}) as s:
        ids = [c.id for c in s.client.models.list().data]
        assert ids == ["first", "org/second"]
        assert s.http.get("/v1/models/org/second").json()["id"] == "org/second"
        for name in ("first", "org/second"):
            done = s.client.completions.create(model=name, prompt=[1, 2, 3], max_tokens=2)
            assert done.model == "first" and len(done.choices[0].token_ids) == 2
        with pytest.raises(openai.NotFoundError) as info:
            s.client.completions.create(model="third", prompt=[1, 2, 3], max_tokens=2)
        assert info.value.body["message"] == ("model: 'third' is not served here; this server serves 'first' or "
                                              "'org/second'")
        assert s.http.get("/v1/models/third").status_code == 404
        assert 'model_name="first"' in s.http.get("/metrics").text


# --- SageMaker's /invocations, vLLM's /load ---------------------------------------------------------------------


def test_invocations_serves_a_chat_or_a_completions_body_as_its_own_endpoint_does(served):
    """SageMaker sends every request to POST /invocations: vLLM answers a body with messages as a chat completion,
    one with a prompt as a completion; each answer is the one its own endpoint gives (greedy: the same tokens)."""
    chat = {"model": "words", "messages": CONV, "max_tokens": 3, "ignore_eos": True}
    completion = {"model": "words", "prompt": "w5 w17", "max_tokens": 3, "ignore_eos": True}
    for body, endpoint, kind in [(chat, "/v1/chat/completions", "chat.completion"),
                                 (completion, "/v1/completions", "text_completion")]:
        r = served.http.post("/invocations", json=body)
        assert r.status_code == 200, r.text
        doc, own = r.json(), served.http.post(endpoint, json=body).json()
        assert doc["object"] == own["object"] == kind
        assert doc["choices"][0]["token_ids"] == own["choices"][0]["token_ids"] and doc["usage"] == own["usage"]
    with served.http.stream("POST", "/invocations", json={**chat, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert r.status_code == 200 and chunks[0]["object"] == "chat.completion.chunk"
    # a chat body's refusal is the chat endpoint's, naming its field
    r = served.http.post("/invocations", json={**chat, "temperature": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    for body in [{"model": "words", "max_tokens": 3}, ["w5"]]:  # no field that picks a route; not an object
        r = served.http.post("/invocations", json=body)
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and "none of the fields that pick a route" in message, r.text
        assert all(name in message for name in ("messages", "prompt", "input", "query", "text_1", "queries"))


def test_invocations_serves_an_embeddings_body_as_v1_embeddings_does(served):
    """vLLM's /invocations tries an embedding request after a chat's and a completion's: a body with input (and no
    messages or prompt) is answered as POST /v1/embeddings answers it, vectors and usage alike."""
    body = {"model": "words", "input": ["w5 w17", "w3"]}
    doc, own = (served.http.post(path, json=body) for path in ("/invocations", "/v1/embeddings"))
    assert doc.status_code == own.status_code == 200, doc.text
    doc, own = doc.json(), own.json()
    assert doc["object"] == "list" and doc["usage"] == own["usage"]
    assert [d["index"] for d in doc["data"]] == [0, 1]
    for got, want in zip(doc["data"], own["data"], strict=True):
        assert got["embedding"] == pytest.approx(want["embedding"], abs=1e-6)
    r = served.http.post("/invocations", json={"input": "w5", "encoding_format": "hex"})  # the route's refusal
    assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format", r.text


def test_load_counts_the_requests_in_the_server_as_vllms_does(served):
    """vLLM's GET /load, a load-aware router's poll: {"server_load": N}, the requests in the server now."""
    assert served.http.get("/load").json() == {"server_load": 0}
    answers = []
    with held_at_step(served, 2) as (reached, _release):
        thread = threading.Thread(target=lambda: answers.append(served.http.post("/invocations", json={
            "model": "words", "prompt": "w5", "max_tokens": 3, "ignore_eos": True})))
        thread.start()
        assert reached.wait(TIMEOUT)
        assert served.http.get("/load").json() == {"server_load": 1}
    thread.join(TIMEOUT)
    assert answers[0].status_code == 200 and served.http.get("/load").json() == {"server_load": 0}
