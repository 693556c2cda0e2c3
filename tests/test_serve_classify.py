"""vLLM's classification API, ``POST /classify``, for a ``*ForSequenceClassification`` checkpoint: each input's class
probabilities (softmax of the head's logits at its last token, checked against transformers'
``AutoModelForSequenceClassification``), ``num_classes`` and ``label``; ``/invocations`` routes an ``input`` body there
for a classifier; the admission slot and ``/metrics`` as for ``/v1/embeddings``. Plain JSON over HTTP, as vLLM's docs
send it."""

from __future__ import annotations

import pytest
import torch

from tests.classify_support import classifier_checkpoint, reference_logits
from tests.llm_support import with_tokenizer
from tests.serve_support import TIMEOUT, serving, wait_for

INPUTS = [[5, 17, 300, 42, 9], [88, 123, 7], [301, 64, 8, 19, 2, 77]]
KV = {"max_tokens": 512, "tokens_per_block": 4}


def text(ids: list[int]) -> str:
    """The word-level tokenizer's text of ``ids`` (token i is "w<i>")."""
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama classifier over three labels (``L0``, ``L1``, ``L2``)."""
    return classifier_checkpoint(tmp_path_factory.mktemp("cls") / "llama", "llama", "LlamaForSequenceClassification",
                                 3)


@pytest.fixture(scope="module")
def served(checkpoint):
    with serving(str(checkpoint), dtype="float32", max_seq_len=64, kv_cache_config=KV) as s:
        yield s


def _ok(served, path: str, body: dict) -> dict:
    r = served.http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_classify_answers_vllms_classification_response_as_transformers_computes_it(served, checkpoint):
    """One input or a list, texts or token ids: per input, in order, softmax of transformers' logits within 1e-5,
    num_classes and the best class's label from id2label; usage counts the prompt tokens; use_activation false (or
    vLLM's older softmax false) gives the logits as computed."""
    logits = reference_logits(checkpoint)
    doc = _ok(served, "/classify", {"model": served.state.model_name, "input": [text(i) for i in INPUTS]})
    assert doc["id"].startswith("classify-") and doc["object"] == "list" and isinstance(doc["created"], int)
    assert doc["model"] == served.state.model_name
    assert [d["index"] for d in doc["data"]] == [0, 1, 2]
    for d, ids in zip(doc["data"], INPUTS, strict=True):
        probs = torch.softmax(logits(ids), -1)
        assert d["probs"] == pytest.approx(probs.tolist(), abs=1e-5)
        assert d["num_classes"] == 3 and d["label"] == f"L{int(probs.argmax())}"
    tokens = sum(map(len, INPUTS))
    assert doc["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                            "prompt_tokens_details": None}
    one = _ok(served, "/classify", {"input": INPUTS[1]})  # one input's token ids
    assert len(one["data"]) == 1 and one["data"][0]["probs"] == pytest.approx(doc["data"][1]["probs"], abs=1e-6)
    for field in ("use_activation", "softmax"):
        raw = _ok(served, "/classify", {"input": text(INPUTS[0]), field: False})
        assert raw["data"][0]["probs"] == pytest.approx(logits(INPUTS[0]).tolist(), abs=1e-5)


@pytest.mark.parametrize(("body", "param", "says"), [
    ({}, "input", "input"),
    ({"input": []}, "input", "input"),
    ({"input": "w1", "use_activation": "no"}, "use_activation", "use_activation: expected true or false"),
    ({"input": "w1", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "truncate_prompt_tokens: expected"),
    # past int64: the engine's own check answered a 500 "server_error" naming generate
    ({"input": "w1", "truncate_prompt_tokens": 2 ** 63}, "truncate_prompt_tokens", "truncate_prompt_tokens: expected"),
    ({"input": "w1", "encoding_format": "float"}, "encoding_format", "encoding_format"),
    ({"input": "w1", "normalize": False}, "normalize", "normalize: the parameter was removed (vLLM's: use "
                                                       "use_activation instead); send use_activation (false: the "
                                                       "logits as computed)"),
    ({"input": "w1", "normalize": None}, "normalize", "use use_activation instead"),  # vLLM's: any value
    ({"input": [[1, 2], "w1 w2", 99999]}, "input[2]", "input[2]: expected"),
    ({"input": [[1, 2], [3, 99999]]}, "input", "input[1]"),
    ({"input": " ".join(["w1"] * 65)}, "input", "input: 65 tokens; a classification takes at most max_seq_len=64"),
    ({"input": [[1] * 65]}, "input", "input[0]: 65 tokens; a classification takes at most max_seq_len=64"),
    # the tokenizer has no chat template: the field that takes a prompt here is input, not /v1/completions
    ({"messages": [{"role": "user", "content": "w1"}]}, "messages", "; give input (texts or token ids) instead"),
])
def test_bad_classify_bodies_are_a_400_naming_the_field(served, body, param, says):
    r = served.http.post("/classify", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_invocations_routes_an_input_body_to_classify_for_a_classifier(served):
    """vLLM picks the pooling request by the model's task: a classifier's ``input`` body is a classification."""
    body = {"input": [text(i) for i in INPUTS[:2]]}
    via, own = _ok(served, "/invocations", body), _ok(served, "/classify", body)
    assert via["id"].startswith("classify-")
    for mine, theirs in zip(via["data"], own["data"], strict=True):
        assert mine["probs"] == pytest.approx(theirs["probs"], abs=1e-6)
    assert via["usage"] == own["usage"]


def test_a_classifier_does_not_generate_and_a_generative_model_does_not_classify(served, tiny_checkpoints,
                                                                                  tmp_path):
    """A completion on the classifier is a 400 saying it is a classification model; /classify on a generative model
    is a 400 saying it has no classifier head (vLLM: "does not support Classification API")."""
    r = served.http.post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 2})
    assert r.status_code == 400 and "is a sequence-classification model (LlamaForSequenceClassification" in \
        r.json()["error"]["message"], r.text
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "gen", 512)
    with serving(str(words), kv_cache_config=KV) as s:
        r = s.http.post("/classify", json={"input": "w5"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert "is a generative model (LlamaForCausalLM), with no classifier head" in r.json()["error"]["message"]
        assert s.http.post("/invocations", json={"input": "w5"}).json()["object"] == "list"  # still embeddings
        assert s.http.post("/invocations", json={"input": "w5"}).json()["data"][0]["object"] == "embedding"


def test_metrics_count_a_classification_as_prompt_tokens_and_no_generated_token(served):
    before = served.metrics()
    _ok(served, "/classify", {"input": [text(i) for i in INPUTS]})
    after = served.metrics()

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert grew("kvload_prompt_tokens_total") == sum(map(len, INPUTS))
    assert grew("kvload_generation_tokens_total") == 0
    assert grew("kvload_request_success_total{finished_reason=stop}") == 3


def test_classify_takes_an_admission_slot_as_embeddings_do(checkpoint):
    """Past --max-concurrent-requests a classify request is refused at once with a 503; once the slot frees it is
    served."""
    import socket

    with serving(str(checkpoint), state={"max_concurrent_requests": 1}, kv_cache_config=KV) as s:
        with socket.create_connection(("127.0.0.1", s.server.port), timeout=TIMEOUT) as held:
            held.sendall(b'POST /classify HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{"input": [1, ')
            wait_for(lambda: s.state.in_flight == 1, what="the slot held")
            r = s.http.post("/classify", json={"input": "w5"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy", r.text
        wait_for(lambda: s.state.in_flight == 0, what="the slot freed")
        assert s.http.post("/classify", json={"input": "w5"}).status_code == 200


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """A tiny Qwen3 classifier with one label: a cross-encoder."""
    return classifier_checkpoint(tmp_path_factory.mktemp("ce") / "qwen3", "qwen3", "Qwen3ForSequenceClassification", 1)


def test_score_and_rerank_of_a_cross_encoder_score_each_pair_as_one_sequence_through_its_head(cross_encoder):
    """vLLM's cross-encoder score: each pair as one sequence (here the two texts' ids one after the other), its score
    sigmoid of the head's logit as transformers computes it; usage counts each pair's sequence; /rerank orders the
    documents by it; use_activation false gives the logit; token ids and a many-label head are a 400."""
    logits = reference_logits(cross_encoder)
    query, docs = INPUTS[0], [*INPUTS[1:], [9, 42]]

    def expected(a: list[int], b: list[int], activate: bool = True) -> float:
        row = logits(a + b)
        return float(torch.sigmoid(row)[0] if activate else row[0])

    with serving(str(cross_encoder), dtype="float32", max_seq_len=64, kv_cache_config=KV) as s:
        doc = _ok(s, "/score", {"text_1": text(query), "text_2": [text(d) for d in docs]})
        assert [d["score"] for d in doc["data"]] == pytest.approx([expected(query, d) for d in docs], abs=1e-5)
        tokens = sum(len(query) + len(d) for d in docs)
        assert doc["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
        pairwise = _ok(s, "/v1/score", {"text_1": [text(docs[0]), text(query)], "text_2": [text(query), text(docs[1])],
                                        "use_activation": False})
        assert [d["score"] for d in pairwise["data"]] == pytest.approx(
            [expected(docs[0], query, False), expected(query, docs[1], False)], abs=1e-5)
        ranked = _ok(s, "/rerank", {"query": text(query), "documents": [text(d) for d in docs]})
        scores = [expected(query, d) for d in docs]
        assert [r["index"] for r in ranked["results"]] == sorted(range(len(docs)), key=lambda k: -scores[k])
        assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(sorted(scores, reverse=True),
                                                                                  abs=1e-5)
        assert ranked["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
        r = s.http.post("/score", json={"text_1": query, "text_2": docs[0]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text_1", r.text
        assert "a cross-encoder scores texts" in r.json()["error"]["message"]
        r = s.http.post("/score", json={"text_1": "w5", "text_2": "w6", "softmax": "yes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "softmax", r.text


@pytest.mark.parametrize(("route", "body", "param", "where"), [
    ("/score", b'{"text_1": "w1 \\ud800", "text_2": "w2"}', "text_1", "text_1"),
    ("/score", b'{"text_1": "w1", "text_2": ["w2", "\\udc00"]}', "text_2", "text_2[1]"),
    ("/rerank", b'{"query": "\\ud800", "documents": ["w2"]}', "query", "query"),
    ("/rerank", b'{"query": "w1", "documents": ["w2", "w3 \\ud800"]}', "documents", "documents[1]"),
])
def test_a_lone_surrogate_in_a_cross_encoders_text_is_a_400_naming_it(cross_encoder, route, body, param, where):
    """JSON's "\\ud800" decodes to a lone surrogate, which no tokenizer encodes: the pair's tokenizer raised a 500
    "TextInputSequence must be str"; the server still answers after."""
    with serving(str(cross_encoder), dtype="float32", max_seq_len=64, kv_cache_config=KV) as s:
        r = s.http.post(route, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["message"].startswith(f"{where}: not valid Unicode text"), error
        assert s.http.post("/score", json={"text_1": "w1", "text_2": "w2"}).status_code == 200


def test_score_of_a_many_label_classifier_and_activation_on_an_embedding_model_are_a_400(served, tiny_checkpoints,
                                                                                         tmp_path):
    r = served.http.post("/rerank", json={"query": "w5", "documents": ["w6"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert "classifier over 3 labels" in r.json()["error"]["message"]
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "gen", 512)
    with serving(str(words), kv_cache_config=KV) as s:
        r = s.http.post("/score", json={"text_1": "w5", "text_2": "w6", "use_activation": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "use_activation", r.text
        assert "no classifier head for it to act on" in r.json()["error"]["message"]


def test_score_and_rerank_of_a_cross_encoder_truncate_the_document_and_keep_the_query(cross_encoder):
    """truncate_prompt_tokens as vLLM tokenizes a pair (``truncation=True, max_length=N``): the document is cut, the
    query kept; the score is transformers' of that pair and usage counts N tokens."""
    from transformers import AutoTokenizer

    logits = reference_logits(cross_encoder)
    query, doc = [5, 17, 300], list(range(40, 60))
    kept = AutoTokenizer.from_pretrained(str(cross_encoder))(text(query), text(doc), truncation=True,
                                                              max_length=8)["input_ids"]
    assert kept == query + doc[:5]
    want = float(torch.sigmoid(logits(kept))[0])
    with serving(str(cross_encoder), dtype="float32", max_seq_len=64, kv_cache_config=KV) as s:
        scored = _ok(s, "/score", {"text_1": text(query), "text_2": text(doc), "truncate_prompt_tokens": 8})
        assert scored["data"][0]["score"] == pytest.approx(want, abs=1e-5) and scored["usage"]["prompt_tokens"] == 8
        ranked = _ok(s, "/rerank", {"query": text(query), "documents": [text(doc)], "truncate_prompt_tokens": 8})
        assert ranked["results"][0]["relevance_score"] == pytest.approx(want, abs=1e-5)


def test_the_head_runs_once_over_the_stacked_rows_off_the_event_loop(served, monkeypatch):
    """A classification's model work is not done on the server's event loop (which serves every other request
    meanwhile): the head is applied once, to every input's row stacked, on a worker thread; the answer is the same."""
    import asyncio

    import kvload.serve.classify as classify
    from models.classifier import head_logits

    before = _ok(served, "/classify", {"input": [text(i) for i in INPUTS]})
    calls = []

    def spy(model, rows):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:  # no loop runs on this thread
            on_loop = False
        logits = head_logits(model, rows)
        calls.append((on_loop, tuple(logits.shape) if hasattr(logits, "shape") else len(logits)))
        return logits

    monkeypatch.setattr(classify, "head_logits", spy)
    after = _ok(served, "/classify", {"input": [text(i) for i in INPUTS]})
    assert calls == [(False, (3, 3))]
    for a, b in zip(after["data"], before["data"], strict=True):
        assert a["probs"] == pytest.approx(b["probs"], abs=1e-6) and a["label"] == b["label"]
