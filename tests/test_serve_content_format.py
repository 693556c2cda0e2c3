"""``kvload serve --chat-template-content-format`` (vLLM's flag; "openai" was not served): a chat template written for
OpenAI's content parts gets the parts, by the flag or detected ("auto", the default), on chat and /tokenize alike."""

from __future__ import annotations

import pytest

from tests.llm_support import with_tokenizer
from tests.serve_support import serving

#: Writes each text part of each message, then the part's number (as a word, w1, w2, ...); given a string, it loops
#: over its characters and writes no text of the message.
PARTS = "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }} w{{ loop.index }} {% endfor %}{% endfor %}"
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "w5 w6"}, {"type": "text", "text": "w17"}]},
            {"role": "user", "content": "w9"}]


@pytest.fixture(scope="module")
def words(tiny_checkpoints, tmp_path_factory):
    """The tiny llama with a word-level tokenizer: token i is the text "w<i>"."""
    return with_tokenizer(tiny_checkpoints("llama"), tmp_path_factory.mktemp("words") / "ckpt", 512)


@pytest.mark.parametrize("fmt", ["openai", "auto", None])
def test_a_template_over_content_parts_gets_the_parts(words, fmt):
    state = {"chat_template": PARTS} | ({} if fmt is None else {"chat_template_content_format": fmt})
    with serving(str(words), state=state) as s:
        tokens = s.http.post("/tokenize", json={"model": s.state.model_name, "messages": MESSAGES,
                                                 "add_generation_prompt": False}).json()["tokens"]
        assert tokens == [5, 6, 1, 17, 2, 9, 1]  # each part as sent, the string as one
        reply = s.client.chat.completions.create(model=s.state.model_name, messages=MESSAGES, max_tokens=1)
        assert reply.usage.prompt_tokens == 7


def test_string_format_gives_the_joined_text_as_before(words):
    """"string" is vLLM's and kvload's earlier way: the template gets one string, so one written for parts loops over
    characters; a template that prints the content gets the parts joined by newlines."""
    with serving(str(words), state={"chat_template": PARTS, "chat_template_content_format": "string"}) as s:
        tokens = s.http.post("/tokenize", json={"model": s.state.model_name, "messages": MESSAGES}).json()["tokens"]
        assert tokens == [*range(1, 10), 1, 2]  # a number for each character of "w5 w6\nw17" and "w9", no text
    printing = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    with serving(str(words), state={"chat_template": printing}) as s:  # auto: a string template
        tokens = s.http.post("/tokenize", json={"model": s.state.model_name, "messages": MESSAGES}).json()["tokens"]
        assert tokens == [5, 6, 17, 9]
