"""``kvload serve smollm2-135m`` answers the openai client's chat request as ``kvload generate --chat`` does."""

from __future__ import annotations

import random

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.cli_support import run_cli
from tests.conftest import needs_smollm2
from tests.serve_support import answered_meanwhile, fails_once, serving

pytestmark = needs_smollm2

QUESTION = "What is the capital of France?"
KV = {"max_tokens": 2048, "tokens_per_block": 16}


def test_chat_over_http_matches_kvload_generate_chat(capsys):
    r = run_cli(capsys, "generate", "smollm2-135m", "--chat", "--prompt", QUESTION, "--max_new_tokens", "24",
                "--max_tokens", "2048", "--tokens_per_block", "16")
    assert r.code == 0, r.err
    expected = r.out.split("\n")[0]
    assert "Paris" in expected
    with serving("smollm2-135m", kv_cache_config=KV) as s:
        messages = [{"role": "user", "content": QUESTION}]
        reply = s.client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24)
        assert reply.choices[0].message.content == expected
        assert reply.choices[0].message.role == "assistant" and reply.object == "chat.completion"
        assert reply.choices[0].finish_reason in ("stop", "length")
        streamed = s.client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24,
                                                    stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed)
        assert text == expected
        # a stop string cuts the text before it and ends the request with "stop"
        cut = s.client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24,
                                               stop=["Paris"])
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].message.content == expected[:expected.index("Paris")]
        # a stop string completed by the last token (which also starts a 3-byte character) ends it as "stop"
        zh = [{"role": "user", "content": "Translate to Chinese: good morning, friend"}]
        last = s.client.chat.completions.create(model="smollm2-135m", messages=zh, max_tokens=11, stop=[", "])
        assert last.choices[0].finish_reason == "stop" and ", " not in last.choices[0].message.content
        # the second and third asks reused the chat template's prefix
        assert reply.usage.prompt_tokens > 16
        assert cut.usage.prompt_tokens_details.cached_tokens >= 16
        # a completion of text, streamed, gives the same text as without streaming
        plain = s.client.completions.create(model="smollm2-135m", prompt="The sky is", max_tokens=10)
        chunks = s.client.completions.create(model="smollm2-135m", prompt="The sky is", max_tokens=10, stream=True)
        assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text != ""


# --- what vLLM's and OpenAI's clients read: stop_reason, logprobs' tokens, bytes and offsets ---------------------

FRANCE = "The capital of France is"
PERIOD = 30  # SmolLM2's "."
IM_END = 2  # SmolLM2's end of a chat turn, its EOS


@pytest.fixture(scope="module")
def smol():
    with serving("smollm2-135m", kv_cache_config=KV) as s:
        yield s


def test_a_stop_token_ends_the_text_before_it_as_in_the_python_api(smol):
    """The stop token's own text (".") was left in the server's text, and in the last streamed chunk."""
    (api,) = smol.result.generate([FRANCE], max_tokens=8, stop_token_ids=[PERIOD])
    assert api.text == " Paris" and api.token_ids[-1] == PERIOD and api.stop_reason == PERIOD
    r = smol.client.completions.create(model="smollm2-135m", prompt=FRANCE, max_tokens=8,
                                       extra_body={"stop_token_ids": [PERIOD]})
    choice = r.choices[0]
    assert choice.text == api.text and choice.finish_reason == "stop"
    assert choice.model_extra["token_ids"] == api.token_ids  # kept in token_ids, as vLLM does
    assert choice.model_extra["stop_reason"] == PERIOD
    chunks = [c.choices[0] for c in smol.client.completions.create(
        model="smollm2-135m", prompt=FRANCE, max_tokens=8, stream=True, extra_body={"stop_token_ids": [PERIOD]})]
    assert "".join(c.text for c in chunks) == api.text
    assert [c.model_extra["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [PERIOD]
    # vLLM's stop_reason: the stop string that cut the text, None for EOS (and for length)
    cut = smol.client.completions.create(model="smollm2-135m", prompt=FRANCE, max_tokens=8, stop=["ris"])
    assert cut.choices[0].text == " Pa" and cut.choices[0].model_extra["stop_reason"] == "ris"
    reply = smol.client.chat.completions.create(model="smollm2-135m", max_tokens=24,
                                                messages=[{"role": "user", "content": QUESTION}])
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].model_extra["stop_reason"] is None
    assert reply.choices[0].model_extra["token_ids"][-1] == IM_END


def test_chat_logprobs_give_each_tokens_own_bytes_and_special_tokens_by_name(smol):
    """Each piece of a multi-byte character read '\ufffd' with bytes [239, 191, 189], and EOS read ""."""
    zh = [{"role": "user", "content": "Translate to Chinese: good morning, friend"}]
    r = smol.client.chat.completions.create(model="smollm2-135m", messages=zh, max_tokens=20, logprobs=True,
                                            top_logprobs=2)
    content = r.choices[0].logprobs.content
    text = r.choices[0].message.content
    assert any(ord(ch) > 0x2E80 for ch in text)  # CJK: characters of three bytes, split over tokens
    assert b"".join(bytes(t.bytes) for t in content).decode() == text  # the bytes add up to the text
    assert all(len(t.top_logprobs) == 2 for t in content)  # chat: exactly top_logprobs
    assert any(t.token == "\ufffd" and t.bytes != [239, 191, 189] for t in content)
    reply = smol.client.chat.completions.create(model="smollm2-135m", max_tokens=24, logprobs=True, top_logprobs=0,
                                                messages=[{"role": "user", "content": QUESTION}])
    *words, end = reply.choices[0].logprobs.content
    assert end.token == "<|im_end|>" and bytes(end.bytes) == b"<|im_end|>"
    assert "".join(t.token for t in words) == reply.choices[0].message.content
    assert all(t.top_logprobs == [] for t in words)


def test_completion_logprobs_show_special_tokens_and_text_offsets(smol):
    tok = smol.state.engine.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    ids = [int(t) for t in (chat["input_ids"] if hasattr(chat, "keys") else chat)]
    r = smol.client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=24, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens[-1] == "<|im_end|>" and "<|im_end|>" in lp.top_logprobs[-1]
    assert all(len(top) in (2, 3) for top in lp.top_logprobs)
    # text_offset: where each token's text starts in the choice's text (vLLM fills it; the openai client reads it)
    text = r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(text)  # the EOS: after all of the text
    for token, start, end in zip(lp.tokens, lp.text_offset, lp.text_offset[1:], strict=False):
        assert text[start:end] == token
    sampled = dict(model="smollm2-135m", prompt="The sky is", max_tokens=16, logprobs=1, temperature=1.5, seed=3)
    plain = smol.client.completions.create(**sampled).choices[0]
    streamed = [c.choices[0] for c in smol.client.completions.create(stream=True, **sampled)]
    offsets = [o for c in streamed if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == plain.logprobs.text_offset
    assert all(plain.text[o:].startswith(t) for t, o in zip(plain.logprobs.tokens, offsets, strict=True))


def test_max_completion_tokens_past_the_context_length_is_refused_naming_it(smol):
    with pytest.raises(openai.BadRequestError) as info:
        smol.client.chat.completions.create(model="smollm2-135m", max_completion_tokens=100_000_000,
                                            messages=[{"role": "user", "content": QUESTION}])
    assert info.value.body["param"] == "max_completion_tokens"
    assert info.value.body["message"].startswith("'max_tokens' or 'max_completion_tokens' is too large: 100000000. "
                                                 "This model's maximum context length is 8192 tokens")


def test_tokenize_of_messages_gives_the_chat_prompt_and_a_prefill_continues_the_reply(smol):
    """vLLM's /tokenize of a conversation is the chat endpoint's prompt, token for token."""
    messages = [{"role": "user", "content": QUESTION}]
    r = smol.http.post("/tokenize", json={"model": "smollm2-135m", "messages": messages, "return_token_strs": True})
    assert r.status_code == 200, r.text
    tokens = r.json()
    tok = smol.state.engine.tokenizer
    expected = tok.apply_chat_template(messages, add_generation_prompt=True)
    expected = [int(t) for t in (expected["input_ids"] if hasattr(expected, "keys") else expected)]
    assert tokens["tokens"] == expected and tokens["max_model_len"] == 8192
    assert tokens["token_strs"][:3] == ["<|im_start|>", "system", "Ċ"]
    reply = smol.client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=4)
    assert reply.usage.prompt_tokens == tokens["count"]
    # the assistant's reply begun by the client (a prefill) and continued, no new turn opened
    prefill = [*messages, {"role": "assistant", "content": "The capital of France is"}]
    cont = smol.client.chat.completions.create(model="smollm2-135m", messages=prefill, max_tokens=3,
                                               extra_body={"add_generation_prompt": False,
                                                           "continue_final_message": True})
    assert cont.choices[0].message.content.startswith(" Paris"), cont.choices[0].message.content
    counted = smol.http.post("/tokenize", json={"messages": prefill, "add_generation_prompt": False,
                                                "continue_final_message": True}).json()
    assert cont.usage.prompt_tokens == counted["count"]
    assert smol.http.post("/detokenize", json={"tokens": counted["tokens"]}).json()["prompt"].endswith(
        "<|im_start|>assistant\nThe capital of France is")


# --- a stream the engine fails --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_a_stream_the_engine_fails_ends_with_its_error_chunk_then_done(smol, monkeypatch, kind):
    """A step that fails (a forward out of device memory) ends a stream with an error chunk; the stream then just
    closed, without the ``data: [DONE]`` vLLM sends after it, so a client reading to [DONE] (as SSE readers of
    OpenAI streams do) saw a truncated stream. Now [DONE] follows the error chunk, on chat and completions alike; the
    openai client still raises the error, and the server serves on."""
    import httpx

    oom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body = {"model": "smollm2-135m", "max_tokens": 8, "stream": True,
            **({"messages": [{"role": "user", "content": QUESTION}]} if kind == "chat" else {"prompt": FRANCE})}
    fails_once(monkeypatch, smol.state.engine.executor, "forward_scored", oom)
    with httpx.stream("POST", smol.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines
    assert lines[-2] == ('data: {"error":{"message":"RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB",'
                         '"type":"server_error","param":null,"code":null}}'), lines
    fails_once(monkeypatch, smol.state.engine.executor, "forward_scored", oom)
    create = smol.client.chat.completions.create if kind == "chat" else smol.client.completions.create
    args = {k: v for k, v in body.items() if k != "stream"}
    with pytest.raises(openai.APIError, match="CUDA out of memory"):
        for _ in create(**args, stream=True):
            pass
    monkeypatch.undo()
    again = create(**args)  # the server serves on
    assert again.choices[0].finish_reason in ("stop", "length")


# --- a long chat, or a prompt cut by truncate_prompt_tokens, tokenized off the parse gate: the same tokens ---------

_WORDS = ("The", "capital", "of", "France", "is", "Paris,", "naïve", "café", "日本語", "—", "it's", "1984.", "\n",
          "  ", "{\"key\":", "<|im_end|>", "tab\tbed", "x" * 40, "Ünïcödé", "🙂", "can't", "(ok)")
_RNG = random.Random(0)
LONG = "".join(_RNG.choice(_WORDS) + _RNG.choice(" \n") for _ in range(20_000))[:70_000]  # past 64 Ki characters
QUICK = ("/v1/completions", {"model": "smollm2-135m", "prompt": "The sky is", "max_tokens": 1})


#: 200 messages of ~350 characters each (each far under 64 Ki characters, 70,000 in all), roles taking turns
MANY = [{"role": ("user", "assistant")[i % 2], "content": LONG[i * 350:(i + 1) * 350]} for i in range(200)]


@pytest.mark.parametrize("path, body, hold", [
    ("/tokenize", {"messages": [{"role": "user", "content": LONG}]}, "__call__"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 1}, "__call__"),
    # cut: only the end of its templated text kept is tokenized (the test below), its templating held aside
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 1,
                              "truncate_prompt_tokens": 100, "return_token_ids": True}, "apply_chat_template"),
    ("/tokenize", {"messages": MANY}, "apply_chat_template"),
    ("/v1/chat/completions", {"messages": MANY, "max_tokens": 1}, "apply_chat_template"),
    ("/v1/chat/completions", {"messages": MANY, "max_tokens": 1, "truncate_prompt_tokens": 100,
                              "return_token_ids": True}, "apply_chat_template"),
], ids=["tokenize-messages", "chat", "chat-truncated", "tokenize-many-messages", "chat-many-messages",
        "chat-many-messages-truncated"])
def test_a_long_chat_tokenized_off_the_gate_has_the_tokens_of_the_tokenizer(smol, monkeypatch, path, body, hold):
    """A long chat's templated text (one long message, or 200 short ones: templated off the gate too), tokenized on
    the server's copy of SmolLM2's tokenizer while a small request is answered, has the ids the tokenizer itself gives
    (all of them, the count of a refusal, or the last 100 kept)."""
    tok = smol.state.engine.tokenizer
    if "messages" in body:
        full = tok.apply_chat_template(body["messages"], add_generation_prompt=True)
        full = [int(t) for t in (full["input_ids"] if hasattr(full, "keys") else full)]
    else:
        full = [int(t) for t in tok(LONG)["input_ids"]]
    assert len(full) > 8192  # past the context: tokenized whole, then cut, counted or refused
    if hold == "apply_chat_template":  # its templated text equals the tokenizer's own too
        text = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        assert smol.state.engine.encode_messages(body["messages"], room=False) == full
        assert len(text) > 70_000 and max(len(m["content"]) for m in MANY) < 400
    big, small, order = answered_meanwhile(smol, monkeypatch, path, {"model": "smollm2-135m", **body}, *QUICK,
                                           hold=hold)
    assert small.status_code == 200, small.text
    assert order == ["small answered", "big tokenized"]  # main: the small one waited for the whole tokenizing
    assert big.status_code == (400 if "truncate_prompt_tokens" not in body and path != "/tokenize" else 200)
    if path == "/tokenize":
        assert big.json()["tokens"] == full
    elif "truncate_prompt_tokens" not in body:
        assert big.json()["error"]["message"].startswith(f"messages: {len(full)} tokens leave no room to generate")
    else:
        assert big.json()["prompt_token_ids"] == full[-100:]


# --- a prompt cut by truncate_prompt_tokens: only the end it keeps tokenized, the same ids -------------------------

HUGE = LONG * 30  # 2.1 MB


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_huge_prompt_cut_by_truncate_prompt_tokens_is_tokenized_at_the_end_it_keeps_only(smol, encoded, side):
    """A prompt cut by truncate_prompt_tokens was tokenized whole however long (no character bound holds it: it is
    cut, not refused), 2 MB in ~2 s of one parse turn. Now only an end of it long enough to hold the tokens kept is
    tokenized (a few thousand characters here), cut where SmolLM2's tokenizer splits whatever comes before: the same
    ids as the whole text's, its last (truncation_side "right": first) 100."""
    tok = smol.state.engine.tokenizer
    full = [int(t) for t in tok(HUGE)["input_ids"]]
    encoded.clear()  # the texts encoded from here on: the request's
    r = smol.http.post("/v1/completions", json={"model": "smollm2-135m", "prompt": HUGE, "max_tokens": 1,
                                                 "truncate_prompt_tokens": 100, "truncation_side": side,
                                                 "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["prompt_token_ids"] == (full[-100:] if side == "left" else full[:100])
    assert r.json()["usage"]["prompt_tokens"] == 100
    assert max(encoded) < 10_000  # main: the whole 2.1 MB tokenized


_PIECES = (*_WORDS, "a", "b", "é", "ab cd", " ", "  ", "\t", "\n\n", "'s", "'ll", "12345", "x" * 300, "aaaa" * 50, "«»")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.sampled_from(_PIECES) | st.text(max_size=6), min_size=1, max_size=600),
       glue=st.sampled_from(["", " ", "\n"]), keep=st.integers(1, 120), side=st.sampled_from(["left", "right"]),
       special=st.booleans())
def test_the_end_of_a_prompt_tokenized_for_truncate_prompt_tokens_has_the_whole_texts_ids(smol, pieces, glue, keep,
                                                                                        side, special):
    """Whatever the text and k, the ids kept from the end tokenized alone (or None: then all of it is tokenized)
    equal the whole text's on SmolLM2's tokenizer: its last k (first k for truncation_side "right")."""
    from kvload.serve.request_input import kept_text_tokens

    text = glue.join(pieces) * 3
    engine = smol.state.engine
    got = kept_text_tokens(engine, text, keep, special, side)
    if got is not None:
        whole = engine.tokenize(text, add_special_tokens=special)
        assert len(whole) > keep
        assert got == (whole[-keep:] if side == "left" else whole[:keep])


def test_the_end_of_a_long_text_is_what_is_tokenized_for_truncate_prompt_tokens(smol):
    from kvload.serve.request_input import kept_text_tokens

    whole = smol.state.engine.tokenize(LONG)
    assert kept_text_tokens(smol.state.engine, LONG, 100, True, "left") == whole[-100:]
    assert kept_text_tokens(smol.state.engine, LONG, 100, True, "right") == whole[:100]


# --- a chat cut by truncate_prompt_tokens: only the end of its templated text it keeps tokenized, the same ids ------

#: 2.1 MB over 6,000 messages of ~350 characters (templated off the gate), and one message of 2.1 MB
HUGE_CHATS = {"many": [{"role": ("user", "assistant")[i % 2], "content": HUGE[i * 350:(i + 1) * 350]}
                       for i in range(6000)],
              "one": [{"role": "user", "content": HUGE}]}


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("chat", ["many", "one"])
def test_a_huge_chat_cut_by_truncate_prompt_tokens_is_tokenized_at_the_end_it_keeps_only(smol, encoded, chat, side):
    """A chat cut by truncate_prompt_tokens had its whole templated text tokenized however long (2 MB: ~2 s, on the
    tokenizer's copy), then cut. Now only an end of that text long enough for the tokens kept is tokenized, as a
    text prompt's: the ids of SmolLM2's own apply_chat_template, its last (truncation_side "right": first) 100."""
    messages = HUGE_CHATS[chat]
    tok = smol.state.engine.tokenizer
    full = tok.apply_chat_template(messages, add_generation_prompt=True)
    full = [int(t) for t in (full["input_ids"] if hasattr(full, "keys") else full)]
    encoded.clear()  # the texts encoded from here on: the request's
    r = smol.http.post("/v1/chat/completions", json={"model": "smollm2-135m", "messages": messages, "max_tokens": 1,
                                                      "truncate_prompt_tokens": 100, "truncation_side": side,
                                                      "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == (full[-100:] if side == "left" else full[:100])
    assert r.json()["usage"]["prompt_tokens"] == 100
    assert encoded and max(encoded) < 10_000  # main: the whole 2.1 MB templated text tokenized


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(contents=st.lists(st.lists(st.sampled_from(_PIECES) | st.text(max_size=6), min_size=1, max_size=300),
                         min_size=1, max_size=8),
       glue=st.sampled_from(["", " ", "\n"]), keep=st.integers(1, 120), side=st.sampled_from(["left", "right"]),
       special=st.booleans(), opened=st.booleans())
def test_the_end_of_a_chat_tokenized_for_truncate_prompt_tokens_has_the_whole_texts_ids(smol, contents, glue, keep,
                                                                                      side, special, opened):
    """Whatever the conversation (special tokens' text in it too), k and side, the ids kept from the end of its
    templated text tokenized alone equal SmolLM2's ids of the whole templated text, cut: its last k (first k for
    truncation_side "right"), and it says it was cut exactly when the whole had more than k."""
    from kvload.serve.request_input import kept_messages_tokens

    engine = smol.state.engine
    messages = [{"role": ("user", "assistant")[i % 2], "content": glue.join(c) * 3} for i, c in enumerate(contents)]
    template = {"add_generation_prompt": opened}
    whole = engine.encode_messages(messages, template, add_special_tokens=special, room=False)
    got, cut = kept_messages_tokens(engine, messages, template, keep, side, add_special_tokens=special)
    assert got == (whole[-keep:] if side == "left" else whole[:keep])
    assert cut == (len(whole) > keep)
