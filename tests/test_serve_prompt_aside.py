"""One big text prompt (past 64 KiB of text, under the character bound) is tokenized off the parse gate, on a copy of
the tokenizer: a small request sent meanwhile is answered. It was tokenized in one turn (~0.5 s for ~660 KB on
SmolLM2), and every request sent meanwhile waited for all of it. Its tokens are the whole text's, as before."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.llm_support import with_tokenizer
from tests.serve_support import TIMEOUT, answered_meanwhile, serving

BIG = " ".join(f"w{i % 500 + 1}" for i in range(20_000))  # ~100,000 characters: 20,000 tokens


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings"])
def test_a_big_prompt_is_tokenized_off_the_gate_and_a_small_request_is_answered_meanwhile(tiny_checkpoints,
                                                                                          tmp_path, monkeypatch, path):
    field, small_body = ("prompt", {"prompt": "w1 w2", "max_tokens": 1}) if path == "/v1/completions" else \
        ("input", {"input": "w1 w2"})
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "gen", 512)
    with serving(str(words), dtype="float32", max_seq_len=64, kv_cache_config={"max_tokens": 512}) as served:
        tok = served.state.engine.tokenizer
        expected = len(tok(BIG)["input_ids"])
        entered, release = threading.Event(), threading.Event()
        real = type(tok).__call__

        def held(self, text, *args, **kwargs):
            if isinstance(text, str) and len(text) > 65536:
                entered.set()
                release.wait(TIMEOUT)  # gives up in the end: a failure, not a hang
            return real(self, text, *args, **kwargs)

        monkeypatch.setattr(type(tok), "__call__", held)
        answers: dict[str, httpx.Response] = {}

        def send_big() -> None:
            with httpx.Client(base_url=served.url, timeout=TIMEOUT) as http:
                answers["big"] = http.post(path, json={**small_body, field: BIG})

        big = threading.Thread(target=send_big)
        big.start()
        try:
            assert entered.wait(TIMEOUT)
            with httpx.Client(base_url=served.url, timeout=TIMEOUT / 4) as http:  # main: a ReadTimeout here
                small = http.post(path, json=small_body)
            assert small.status_code == 200, small.text
            assert not release.is_set() and big.is_alive()
        finally:
            release.set()
            big.join(TIMEOUT)
        # refused by its token count, the whole text's, in the words of before
        assert answers["big"].status_code == 400
        message = answers["big"].json()["error"]["message"]
        if field == "prompt":
            assert message == (f"prompt: {expected} tokens leave no room to generate under max_seq_len=64; shorten "
                               "it or raise max_seq_len")
        else:
            assert message.startswith(f"input: {expected} tokens;"), message


def test_a_tokenizer_that_cannot_be_copied_tokenizes_a_big_prompt_on_the_gate_as_before(tiny_checkpoints, tmp_path,
                                                                                        monkeypatch):
    from kvload.serve import request_input

    def refuse(value, memo=None):
        raise TypeError("cannot pickle 'Tokenizer' object")

    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "gen", 512)
    with serving(str(words), dtype="float32", max_seq_len=64, kv_cache_config={"max_tokens": 512}) as served:
        monkeypatch.setattr(request_input.copy, "deepcopy", refuse)  # the server up: only the tokenizer's copy fails
        expected = len(served.state.engine.tokenizer(BIG)["input_ids"])
        with httpx.Client(base_url=served.url, timeout=TIMEOUT) as http:
            big = http.post("/v1/completions", json={"prompt": BIG, "max_tokens": 1})
            again = http.post("/tokenize", json={"prompt": BIG})
            small = http.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 1})
            # the server's log and audit say so, once: it was silent, and such a server's requests waited for every
            # long text unexplained
            warned = [json.loads(line) for line in http.get("/v1/kvload/audit").text.splitlines()]
        warned = [r for r in warned if r["event"] == "setting_ignored" and r["field"] == "serve.tokenizer_copy"]
        # not a 500: the same refusal as from the copy, then the server answers as before
        assert big.status_code == 400, big.text
        assert big.json()["error"]["message"] == (f"prompt: {expected} tokens leave no room to generate under "
                                                  "max_seq_len=64; shorten it or raise max_seq_len")
        assert again.status_code == 200 and again.json()["count"] == expected, again.text
        assert small.status_code == 200, small.text
        assert len(warned) == 1, warned
        assert warned[0]["reason"].startswith("the tokenizer cannot be copied (TypeError: cannot pickle 'Tokenizer' "
                                              "object): a text past 65,536 characters"), warned[0]


# --- a chat's templated text, and a prompt cut by truncate_prompt_tokens ------------------------------------------

TEMPLATE = "{% for m in messages %}{{ m.content }} {% endfor %}"  # the word tokenizer's chat template: the words


def _chat(content: str, **body: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": content}], **body}


CHAT_CASES = [  # (path, the big body, its status, the small body)
    ("/v1/chat/completions", _chat(BIG, max_tokens=1), 400, _chat("w1 w2", max_tokens=1)),
    ("/v1/chat/completions", _chat(BIG, max_tokens=1, truncate_prompt_tokens=8), 200, _chat("w1 w2", max_tokens=1)),
    ("/v1/responses", {"input": BIG, "max_output_tokens": 1}, 400, {"input": "w1 w2", "max_output_tokens": 1}),
    ("/v1/messages", _chat(BIG, max_tokens=1), 400, _chat("w1 w2", max_tokens=1)),
    ("/tokenize", _chat(BIG), 200, _chat("w1 w2")),
    ("/pooling", _chat(BIG), 400, _chat("w1 w2")),
    ("/v1/completions", {"prompt": BIG, "max_tokens": 1, "truncate_prompt_tokens": 8}, 200,
     {"prompt": "w1 w2", "max_tokens": 1}),
]


@pytest.mark.parametrize("path, big_body, status, small_body", CHAT_CASES,
                         ids=[f"{c[0]}{'-truncated' if 'truncate_prompt_tokens' in c[1] else ''}" for c in CHAT_CASES])
def test_a_long_chat_or_truncated_prompt_is_tokenized_off_the_gate_and_a_small_request_is_answered_meanwhile(
        tiny_checkpoints, tmp_path, monkeypatch, path, big_body, status, small_body):
    """A chat's templated text (chat completions, responses, Anthropic's messages, /tokenize and /pooling of
    messages) and a prompt cut by truncate_prompt_tokens were tokenized in one turn of the parse gate however long: a
    small request sent meanwhile waited for all of it. Now it is answered while the long one is tokenized, which then
    gets its answer of before: refused by its token count, its ids, or its last 8 tokens kept."""
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "gen", 512)
    with serving(str(words), dtype="float32", max_seq_len=64, kv_cache_config={"max_tokens": 512}) as served:
        tok = served.state.engine.tokenizer
        tok.chat_template = TEMPLATE
        if path == "/v1/messages":  # Anthropic's API names the model
            model = {"model": served.state.served_names[0]}
            big_body, small_body = {**big_body, **model}, {**small_body, **model}
        ids = [int(t) for t in tok(BIG + " ", add_special_tokens=False)["input_ids"]]
        big, small, order = answered_meanwhile(served, monkeypatch, path, big_body, path, small_body)
        assert small.status_code == 200, small.text
        assert order == ["small answered", "big tokenized"]  # main: the small one waited for the whole tokenizing
        assert big.status_code == status, big.text
        if path == "/tokenize":
            assert big.json()["tokens"] == ids
        elif status == 200:  # its last 8 tokens kept
            assert big.json()["usage"]["prompt_tokens"] == 8
        else:  # refused by the count of all its tokens
            field = "input" if path == "/v1/responses" else "messages"
            assert big.json()["error"]["message"].startswith(f"{field}: {len(ids)} tokens"), big.text


# --- a long conversation of many messages: templated off the gate too ---------------------------------------------

MANY = [{"role": ("user", "assistant")[i % 2], "content": " ".join(f"w{(i + j) % 500 + 1}" for j in range(100))}
        for i in range(200)]  # ~100,000 characters over 200 messages, none past 64 Ki characters
MANY_CASES = [  # (path, the big body, its status)
    ("/v1/chat/completions", {"messages": MANY, "max_tokens": 1}, 400),
    ("/v1/responses", {"input": MANY, "max_output_tokens": 1}, 400),
    ("/v1/messages", {"messages": MANY, "max_tokens": 1}, 400),
    ("/tokenize", {"messages": MANY}, 200),
    ("/pooling", {"messages": MANY}, 400),
]


@pytest.mark.parametrize("path, big_body, status", MANY_CASES, ids=[c[0] for c in MANY_CASES])
def test_a_long_conversation_of_many_messages_is_templated_off_the_gate_and_a_small_request_is_answered_meanwhile(
        tiny_checkpoints, tmp_path, monkeypatch, path, big_body, status):
    """A conversation of many messages, each short, was templated in one turn of the parse gate (2 MB over 2,000
    messages took ~0.6 s of SmolLM2's template), and a small request sent meanwhile waited for it: only a long
    templated text's tokenizing went aside. Now the templating goes aside too, on the tokenizer's copy: the small
    request is answered while it runs, and the big one gets its answer of before (its ids, or refused by their
    count)."""
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "gen", 512)
    with serving(str(words), dtype="float32", max_seq_len=64, kv_cache_config={"max_tokens": 512}) as served:
        tok = served.state.engine.tokenizer
        tok.chat_template = TEMPLATE
        small = {"model": served.state.served_names[0], "prompt": "w1 w2", "max_tokens": 1}
        if path == "/v1/messages":
            big_body = {**big_body, "model": small["model"]}
        text = "".join(m["content"] + " " for m in MANY)
        ids = [int(t) for t in tok(text, add_special_tokens=False)["input_ids"]]
        big, quick, order = answered_meanwhile(served, monkeypatch, path, big_body, "/v1/completions", small,
                                               hold="apply_chat_template")
        assert quick.status_code == 200, quick.text
        assert order == ["small answered", "big tokenized"]  # main: the small one waited for the templating
        assert big.status_code == status, big.text
        if path == "/tokenize":
            assert big.json()["tokens"] == ids
        else:  # refused by the count of all its tokens
            field = "input" if path == "/v1/responses" else "messages"
            assert big.json()["error"]["message"].startswith(f"{field}: {len(ids)} tokens"), big.text


# --- a long list of messages: checked and structured off the gate too ---------------------------------------------

#: 2,000 short messages (past protocol.ASIDE_ITEMS), the last one's role unknown: refused, naming it
LONG_LIST = [{"role": ("user", "assistant")[i % 2], "content": f"w{i % 500 + 1} w2"} for i in range(1999)] + [
    {"role": "robot", "content": "w1"}]
LIST_CASES = [  # (path, the big body, where its list is checked and structured, the refusal of before)
    ("/v1/chat/completions", {"messages": LONG_LIST, "max_tokens": 1}, ("kvload.serve.protocol", "chat_messages"),
     "messages[1999].role: expected system, user, assistant, developer or tool, got 'robot'"),
    ("/v1/responses", {"input": LONG_LIST, "max_output_tokens": 1}, ("kvload.serve.responses_input", "_input"),
     "input[1999].role: expected user, system, developer, assistant, got 'robot'"),
    ("/v1/messages", {"messages": LONG_LIST, "max_tokens": 1}, ("kvload.serve.messages_input", "_messages"),
     "messages[1999].role: expected \"user\" or \"assistant\", got 'robot'"),
]


@pytest.mark.parametrize("path, big_body, where, refusal", LIST_CASES, ids=[c[0] for c in LIST_CASES])
def test_a_long_list_of_messages_is_structured_off_the_gate_and_a_small_request_is_answered_meanwhile(
        tiny_checkpoints, tmp_path, monkeypatch, path, big_body, where, refusal):
    """A body of thousands of messages (or Responses input items) was checked and made the template's messages in its
    turn of the parse gate (20,000 took ~0.1-0.2 s), and a small request sent meanwhile waited for it. Now a list past
    1,024 items goes aside: the small request is answered while it is checked, and the big one gets the refusal of
    before, word for word."""
    import importlib

    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "gen", 512)
    with serving(str(words), dtype="float32", max_seq_len=64, kv_cache_config={"max_tokens": 512}) as served:
        gate = served.server.server.config.app.state.parse_gate
        model = served.state.served_names[0]
        module = importlib.import_module(where[0])
        real = getattr(module, where[1])
        entered = threading.Event()
        order: list[str] = []

        def held(value, *args, **kwargs):
            if isinstance(value, list) and len(value) > 1024:
                entered.set()
                for _ in range(int(TIMEOUT / 0.01)):  # the small one answered, or (main) queued behind this turn
                    if "small answered" in order or gate.waiting():
                        break
                    time.sleep(0.01)
                order.append("big structured")
            return real(value, *args, **kwargs)

        monkeypatch.setattr(module, where[1], held)
        answers: dict[str, httpx.Response] = {}

        def send_big() -> None:
            with httpx.Client(base_url=served.url, timeout=TIMEOUT) as http:
                answers["big"] = http.post(path, json={**big_body, "model": model})

        big = threading.Thread(target=send_big)
        big.start()
        try:
            while big.is_alive() and not entered.wait(0.05):
                pass
            assert entered.is_set(), answers["big"].text[:300]
            with httpx.Client(base_url=served.url, timeout=TIMEOUT) as http:
                small = http.post("/v1/completions", json={"model": model, "prompt": "w1 w2", "max_tokens": 1})
            order.append("small answered")
        finally:
            big.join(TIMEOUT)
        assert small.status_code == 200, small.text
        assert order == ["small answered", "big structured"]  # main: the small one waited for the whole list
        assert answers["big"].status_code == 400
        assert answers["big"].json()["error"]["message"] == refusal
