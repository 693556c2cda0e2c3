"""vLLM's chat form of ``POST /classify`` (``ClassificationChatRequest``): ``messages`` in place of ``input``, one
conversation through the chat template (the assistant's turn not opened unless ``add_generation_prompt`` says),
classified as its token ids are (checked against transformers' ``AutoModelForSequenceClassification``), a bad
conversation refused with the chat endpoint's own 400 (here ``/tokenize``'s, which checks it the same way)."""

from __future__ import annotations

import pytest
import torch

from tests.classify_support import classifier_checkpoint, reference_logits
from tests.llm_support import word_tokenizer
from tests.serve_support import serving

KV = {"max_tokens": 512, "tokens_per_block": 4}
#: each message's words, a space after each; the generation prompt is the word w3
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
CHAT = [{"role": "user", "content": "w5 w17 w300"}, {"role": "assistant", "content": "w88 w123"}]
IDS = [5, 17, 300, 88, 123]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama classifier over three labels whose tokenizer has a chat template."""
    path = classifier_checkpoint(tmp_path_factory.mktemp("cls") / "llama", "llama", "LlamaForSequenceClassification",
                                 3)
    tok = word_tokenizer(512)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(checkpoint):
    with serving(str(checkpoint), dtype="float32", max_seq_len=64, kv_cache_config=KV) as s:
        yield s


def test_messages_are_classified_through_the_chat_template(served, checkpoint):
    """The conversation's templated ids are classified as transformers computes them; add_generation_prompt opens the
    assistant's turn (one more token); truncate_prompt_tokens keeps the last N; use_activation false the logits."""
    logits = reference_logits(checkpoint)
    doc = served.http.post("/classify", json={"model": served.state.model_name, "messages": CHAT}).json()
    assert doc["id"].startswith("classify-") and len(doc["data"]) == 1, doc
    probs = torch.softmax(logits(IDS), -1)
    assert doc["data"][0]["probs"] == pytest.approx(probs.tolist(), abs=1e-5)
    assert doc["data"][0]["label"] == f"L{int(probs.argmax())}" and doc["data"][0]["num_classes"] == 3
    assert doc["usage"]["prompt_tokens"] == len(IDS)
    opened = served.http.post("/classify", json={"messages": CHAT, "add_generation_prompt": True}).json()
    assert opened["usage"]["prompt_tokens"] == len(IDS) + 1
    assert opened["data"][0]["probs"] == pytest.approx(torch.softmax(logits([*IDS, 3]), -1).tolist(), abs=1e-5)
    cut = served.http.post("/classify", json={"messages": CHAT, "truncate_prompt_tokens": 2,
                                              "use_activation": False}).json()
    assert cut["data"][0]["probs"] == pytest.approx(logits(IDS[-2:]).tolist(), abs=1e-5)


@pytest.mark.parametrize("messages", [[], [{"role": "user"}], [{"role": "wizard", "content": "w5"}],
                                      [{"role": "user", "content": 5}], "w5 w17"])
def test_bad_messages_get_the_chat_endpoints_400(served, messages):
    """The same status, message and param as the chat path's check of the same conversation."""
    got = served.http.post("/classify", json={"messages": messages})
    chat = served.http.post("/tokenize", json={"messages": messages})
    assert got.status_code == chat.status_code == 400, (got.text, chat.text)
    assert got.json()["error"]["message"] == chat.json()["error"]["message"]
    assert got.json()["error"]["param"] == chat.json()["error"]["param"]


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"messages": CHAT, "input": "w5"}, "messages", "give input (texts or token ids) or messages (a conversation), "
                                                    "not both"),
    ({"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True}, "continue_final_message",
     "cannot be true with add_generation_prompt true"),
    ({"messages": CHAT, "chat_template": "{{ 'w1' }}"}, "chat_template", "--trust-request-chat-template"),
    ({"messages": CHAT, "encoding_format": "float"}, "encoding_format", "encoding_format"),
    ({"messages": [{"role": "user", "content": " ".join(["w1"] * 70)}]}, "messages", "max_seq_len"),
])
def test_a_chat_body_kvload_cannot_classify_is_a_400_naming_the_field(served, body, param, says):
    r = served.http.post("/classify", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and says in r.json()["error"]["message"], \
        r.text
    assert served.http.post("/classify", json={"messages": CHAT}).status_code == 200  # nothing left behind


def test_invocations_routes_a_messages_body_to_classify_for_a_classifier(served):
    """vLLM's /invocations: a classifier has no chat handler, so a messages body is its classification's chat form."""
    body = {"messages": CHAT, "use_activation": False}
    via = served.http.post("/invocations", json=body)
    own = served.http.post("/classify", json=body)
    assert via.status_code == own.status_code == 200, via.text
    assert via.json()["data"] == own.json()["data"] and via.json()["usage"] == own.json()["usage"]
    bad = served.http.post("/invocations", json={"messages": [{"role": "wizard", "content": "w5"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == \
        served.http.post("/classify", json={"messages": [{"role": "wizard", "content": "w5"}]}).json()["error"]["param"]
