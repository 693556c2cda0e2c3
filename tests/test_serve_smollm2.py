"""``kvload serve smollm2-135m`` answers the openai client's chat request as ``kvload generate --chat`` does."""

from __future__ import annotations

from tests.cli_support import run_cli
from tests.conftest import needs_smollm2
from tests.serve_support import serving

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
