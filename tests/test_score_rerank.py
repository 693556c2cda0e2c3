"""vLLM's score and rerank APIs for an embedding model, a RAG user's habit: ``POST /score`` (``/v1/score``) answers the
cosine similarity of each pair's embeddings, ``POST /rerank`` (``/v1/rerank``, ``/v2/rerank``) the documents ordered by
their cosine with the query, each score checked against transformers' own ``AutoModel`` vectors of the checkpoint.
The openai client has no rerank method: the requests go as vLLM's docs send them, plain JSON over HTTP."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from tests.llm_support import with_tokenizer
from tests.serve_support import TIMEOUT, serving, wait_for

VOCAB = 512  # the tiny llama's
QUERY = [5, 17, 300, 42, 9]
DOCS = [[88, 123, 7], [5, 17, 300, 42, 11], [301, 64, 8, 19, 2, 77], [9, 42]]


def text(ids: list[int]) -> str:
    """The word-level tokenizer's text of ``ids`` (token i is "w<i>")."""
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def words(tiny_checkpoints, tmp_path_factory):
    """The tiny llama checkpoint with a word-level tokenizer."""
    return with_tokenizer(tiny_checkpoints("llama"), tmp_path_factory.mktemp("words") / "ckpt", VOCAB)


@pytest.fixture(scope="module")
def cos(words):
    """The cosine similarity of transformers' base-model vectors (last token, post norm) of two prompts."""
    model = transformers.AutoModel.from_pretrained(str(words), dtype=torch.float32, attn_implementation="eager")
    model.eval()

    def vector(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            row = model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()
        return row / np.linalg.norm(row)

    return lambda a, b: float(np.dot(vector(a), vector(b)))


@pytest.fixture(scope="module")
def served(words):
    with serving(str(words), dtype="float32", max_seq_len=64,
                 kv_cache_config={"max_tokens": 512, "tokens_per_block": 4}) as s:
        yield s


def _ok(served, path: str, body: dict) -> dict:
    r = served.http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_is_the_cosine_of_transformers_embeddings_one_to_one_one_to_many_and_pairwise(served, cos, path):
    """vLLM's ScoreResponse: one score per pair in order, each transformers' cosine within 1e-5; usage counts each
    pair's two texts (vLLM's count); vLLM's other side names score alike; truncate_prompt_tokens cuts each text."""
    one = _ok(served, path, {"model": served.state.model_name, "text_1": text(QUERY), "text_2": text(DOCS[0])})
    assert one["id"].startswith("score-") and one["object"] == "list" and isinstance(one["created"], int)
    assert one["model"] == served.state.model_name
    assert [(d["index"], d["object"]) for d in one["data"]] == [(0, "score")]
    assert one["data"][0]["score"] == pytest.approx(cos(QUERY, DOCS[0]), abs=1e-5)
    assert one["usage"] == {"prompt_tokens": len(QUERY) + len(DOCS[0]), "total_tokens": len(QUERY) + len(DOCS[0]),
                            "completion_tokens": 0}

    many = _ok(served, path, {"text_1": text(QUERY), "text_2": [text(d) for d in DOCS]})
    assert [d["index"] for d in many["data"]] == [0, 1, 2, 3]
    for d, doc in zip(many["data"], DOCS, strict=True):
        assert d["score"] == pytest.approx(cos(QUERY, doc), abs=1e-5)
    assert many["usage"]["prompt_tokens"] == sum(len(QUERY) + len(doc) for doc in DOCS)

    ids = _ok(served, path, {"text_1": QUERY, "text_2": DOCS})  # token ids, as /v1/embeddings takes them
    assert [d["score"] for d in ids["data"]] == pytest.approx([d["score"] for d in many["data"]], abs=1e-6)

    firsts, seconds = [QUERY, DOCS[2]], [DOCS[1], DOCS[3]]
    pairwise = _ok(served, path, {"text_1": [text(a) for a in firsts], "text_2": [text(b) for b in seconds]})
    for d, a, b in zip(pairwise["data"], firsts, seconds, strict=True):
        assert d["score"] == pytest.approx(cos(a, b), abs=1e-5)

    for first, second in (("data_1", "data_2"), ("queries", "documents"), ("queries", "items")):
        same = _ok(served, path, {first: [text(a) for a in firsts], second: [text(b) for b in seconds]})
        assert [d["score"] for d in same["data"]] == pytest.approx([d["score"] for d in pairwise["data"]], abs=1e-6)

    cut = _ok(served, path, {"text_1": text(QUERY), "text_2": text(DOCS[2]), "truncate_prompt_tokens": 2,
                             "priority": 0})  # vLLM's default: what a first-come server does
    assert cut["data"][0]["score"] == pytest.approx(cos(QUERY[-2:], DOCS[2][-2:]), abs=1e-5)
    assert cut["usage"]["prompt_tokens"] == 4
    assert not served.state.engine.executor.pooled  # every row was handed over


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_the_documents_by_their_cosine_with_the_query(served, cos, path):
    """Jina/Cohere-style rerank as vLLM answers it: every document best first with its index, text and score;
    top_n keeps the best n; return_documents false leaves the texts out; usage counts each pair's tokens."""
    scores = [cos(QUERY, doc) for doc in DOCS]
    best_first = sorted(range(len(DOCS)), key=lambda k: -scores[k])
    assert best_first != list(range(len(DOCS)))  # the order is the scores', not the documents'
    docs = [text(d) for d in DOCS]
    answer = _ok(served, path, {"model": served.state.model_name, "query": text(QUERY), "documents": docs})
    assert answer["id"].startswith("rerank-") and answer["model"] == served.state.model_name
    assert [r["index"] for r in answer["results"]] == best_first
    for r in answer["results"]:
        assert r["document"] == {"text": docs[r["index"]]}
        assert r["relevance_score"] == pytest.approx(scores[r["index"]], abs=1e-5)
    tokens = sum(len(QUERY) + len(d) for d in DOCS)
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}

    top = _ok(served, path, {"query": text(QUERY), "documents": docs, "top_n": 2, "return_documents": False})
    assert [r["index"] for r in top["results"]] == best_first[:2]
    assert all(set(r) == {"index", "relevance_score"} for r in top["results"])
    everything = _ok(served, path, {"query": text(QUERY), "documents": docs, "top_n": 10})  # more than there are
    assert [r["index"] for r in everything["results"]] == best_first


def _same_answer(doc: dict, own: dict) -> None:
    """Two answers alike but for their ids and times; scores within float noise."""
    for key in ("object", "model", "usage"):
        assert doc.get(key) == own.get(key), key
    for got, want in [("data", "score"), ("results", "relevance_score")]:
        if got in own:
            assert [{k: v for k, v in d.items() if k != want} for d in doc[got]] == \
                [{k: v for k, v in d.items() if k != want} for d in own[got]]
            assert [d[want] for d in doc[got]] == pytest.approx([d[want] for d in own[got]], abs=1e-6)


def test_invocations_answers_a_score_or_a_rerank_body_as_its_own_route_does(served, cos):
    """SageMaker sends every request to POST /invocations, and vLLM routes a score body (each of its four pairs of
    side names) to its score handler, a query with documents to rerank: the answers are those routes' own."""
    docs = [text(d) for d in DOCS]
    for first, second in [("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items")]:
        body = {"model": served.state.model_name, first: text(QUERY), second: docs}
        doc = _ok(served, "/invocations", body)
        assert doc["id"].startswith("score-") and [d["object"] for d in doc["data"]] == ["score"] * len(DOCS)
        assert [d["score"] for d in doc["data"]] == pytest.approx([cos(QUERY, d) for d in DOCS], abs=1e-5)
        _same_answer(doc, _ok(served, "/score", body))
    body = {"query": text(QUERY), "documents": docs, "top_n": 3}
    doc = _ok(served, "/invocations", body)
    assert doc["id"].startswith("rerank-") and len(doc["results"]) == 3
    assert [r["index"] for r in doc["results"]] == sorted(range(len(DOCS)), key=lambda k: -cos(QUERY, DOCS[k]))[:3]
    _same_answer(doc, _ok(served, "/rerank", body))


NORMALIZE_REFUSED = ("normalize: the parameter was removed (vLLM's: use use_activation instead); send use_activation "
                     "(false: a cross-encoder's logit as computed")


@pytest.mark.parametrize(("body", "param", "said"), [
    ({"query": "w1"}, "documents", "documents: required"),  # part of a rerank: rerank's refusal
    ({"query": "w1", "documents": ["w2"], "top_n": -1}, "top_n", "an integer >= 0"),
    ({"text_1": "w1"}, "text_2", "text_2: required"),  # part of a score: score's
    ({"queries": "w1", "items": ["w2"], "text_1": "w3"}, "text_1", "not with queries and items"),
    # a score, not half a rerank
    ({"query": "w1", "text_1": "w1", "text_2": "w2"}, "query", "accepted fields: activation, data_1"),
    ({"query": "w1", "documents": ["w2"], "normalize": False}, "normalize", NORMALIZE_REFUSED),
])
def test_invocations_refuses_a_score_or_rerank_body_as_its_route_does(served, body, param, said):
    """A body with a rerank's or a score's fields goes to that route even when it is unusable there, so the 400 names
    the field the route needs rather than saying no route takes it; nothing is queued."""
    r = served.http.post("/invocations", json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and said in error["message"], (r.status_code, error)
    assert not served.state.engine.executor.pooled


LONG = text([(7 * i + 3) % VOCAB for i in range(65)])  # one token past max_seq_len (64)


@pytest.mark.parametrize(("path", "body", "param", "said"), [
    ("/score", {}, "text_1", "text_1: required"),
    ("/score", {"text_1": "w1"}, "text_2", "text_2: required"),
    ("/score", {"text_1": [], "text_2": "w1"}, "text_1", "expected a non-empty string, a list of strings, a list "
                                                         "of token ids"),
    ("/score", {"text_1": "w1", "text_2": [[1, VOCAB]]}, "text_2", "text_2[0]: token id 512 is outside the vocabulary"),
    ("/score", {"text_1": "w1", "text_2": ["w2", 5]}, "text_2[1]", "expected a non-empty string"),
    ("/score", {"text_1": ["w1", "w2"], "text_2": ["w1", "w2", "w3"]}, "text_1",
     "text_1 has 2 texts and text_2 3; give one text_1 text"),
    ("/score", {"text_1": "w1", "text_2": "w2", "data_1": "w3"}, "data_1", "not with text_1 and text_2"),
    ("/score", {"text_1": "w1", "text_2": "w2", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
     "expected an integer >= 1"),
    ("/v1/score", {"text_1": "w1", "text_2": "w2", "use_activation": True}, "use_activation",
     "no classifier head for it to act on"),
    ("/v1/score", {"text_1": LONG, "text_2": "w2"}, "text_1", "an embedding takes at most max_seq_len=64"),
    ("/v1/score", {"text_1": "w1", "text_2": "w2", "model": 3}, "model", "a string"),
    ("/v1/score", {"text_1": "w1", "text_2": "w2", "priority": 3}, "priority",
     "schedules first come, first served (vLLM's default policy, fcfs), where only priority 0 is accepted"),
    ("/rerank", {"query": "w1", "documents": ["w2"], "priority": -1}, "priority", "only priority 0"),
    ("/rerank", {"documents": ["w1"]}, "query", "expected a non-empty string"),
    ("/rerank", {"query": "w1"}, "documents", "documents: required"),
    ("/rerank", {"query": "w1", "documents": []}, "documents", "a non-empty list of non-empty strings"),
    ("/rerank", {"query": "w1", "documents": "w2"}, "documents", "a non-empty list of non-empty strings"),
    ("/v1/rerank", {"query": "w1", "documents": ["w2", ""]}, "documents[1]", "expected a non-empty string"),
    ("/v1/rerank", {"query": "w1", "documents": ["w2"], "top_n": -1}, "top_n", "an integer >= 0"),
    ("/v1/rerank", {"query": "w1", "documents": ["w2"], "return_documents": "yes"}, "return_documents",
     "true or false"),
    ("/v2/rerank", {"query": "w1", "documents": ["w2", LONG]}, "documents", "documents[1]: 65 tokens"),
    ("/v2/rerank", {"query": "w1", "documents": ["w2"], "rank_fields": ["text"]}, "rank_fields",
     "not supported by kvload serve"),
    # vLLM's removed switch, refused as /v1/embeddings, /pooling and /classify refuse it (any value, null too)
    ("/score", {"text_1": "w1", "text_2": "w2", "normalize": True}, "normalize", NORMALIZE_REFUSED),
    ("/rerank", {"query": "w1", "documents": ["w2"], "normalize": None}, "normalize", NORMALIZE_REFUSED),
])
def test_an_unusable_score_or_rerank_body_is_a_400_naming_the_field(served, path, body, param, said):
    """Nothing is queued: each refusal names the field (the item where one is), as /v1/embeddings' do."""
    r = served.http.post(path, json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and said in error["message"], (r.status_code, error)
    assert not served.state.engine.executor.pooled


@pytest.mark.parametrize("path", ["/score", "/rerank"])
def test_a_model_this_server_does_not_serve_is_a_404(served, path):
    body = {"text_1": "w1", "text_2": "w2"} if path == "/score" else {"query": "w1", "documents": ["w2"]}
    r = served.http.post(path, json={**body, "model": "another-model"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_metrics_count_a_score_and_a_rerank_as_embeddings_prompt_tokens_and_no_generated_token(served):
    """Each text is one pooling request (the query of a one-to-many score embedded once): /metrics counts its prompt
    tokens, no generated token, and its end as "stop", as vLLM counts a pooling request."""
    before = served.metrics()
    _ok(served, "/score", {"text_1": text(QUERY), "text_2": [text(d) for d in DOCS[:2]]})
    _ok(served, "/v1/rerank", {"query": text(DOCS[3]), "documents": [text(d) for d in DOCS[2:]]})
    after = served.metrics()

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert grew("kvload_prompt_tokens_total") == len(QUERY) + sum(map(len, DOCS[:2])) + len(DOCS[3]) \
        + sum(map(len, DOCS[2:]))
    assert grew("kvload_generation_tokens_total") == 0
    assert grew("kvload_request_generation_tokens_count") == 6
    assert grew("kvload_request_generation_tokens_sum") == 0
    assert grew("kvload_request_success_total{finished_reason=stop}") == 6


def test_score_and_rerank_take_an_admission_slot_as_embeddings_do(words):
    """Past --max-concurrent-requests a score or rerank request is refused at once with a 503, as a completion or an
    embedding would be, rather than queued past the bound; once the slot frees it is served."""
    import socket

    with serving(str(words), state={"max_concurrent_requests": 1},
                 kv_cache_config={"max_tokens": 512, "tokens_per_block": 4}) as s:
        body = {"/score": {"text_1": "w5", "text_2": ["w6", "w7"]}, "/v2/rerank": {"query": "w5", "documents": ["w6"]}}
        with socket.create_connection(("127.0.0.1", s.server.port), timeout=TIMEOUT) as held:
            held.sendall(b'POST /v1/embeddings HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{"input": [1, ')
            wait_for(lambda: s.state.in_flight == 1, what="the slot held")
            for path, json in body.items():
                r = s.http.post(path, json=json)
                assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy", (path, r.text)
        wait_for(lambda: s.state.in_flight == 0, what="the slot freed")
        for path, json in body.items():
            assert s.http.post(path, json=json).status_code == 200


def test_a_score_requests_priority_orders_its_texts_admission_under_the_priority_policy(words, cos):
    """Under --scheduling_policy priority a score's vLLM ``priority`` acts as a completion's: its texts queued first
    (priority 5) are admitted after a completion that arrived later with priority 2 (under fcfs only 0 is taken)."""
    import concurrent.futures
    import threading

    with serving(str(words), dtype="float32", scheduling_policy="priority", max_batch_size=1, max_seq_len=64,
                 kv_cache_config={"max_tokens": 512, "tokens_per_block": 4}) as s:
        engine, gate = s.state.engine, threading.Event()
        original = engine._compute

        def gated(out):
            gate.wait(TIMEOUT)
            return original(out)

        def complete(prompt: list[int], priority: int, max_tokens: int) -> object:
            return s.client.completions.create(model=s.state.model_name, prompt=prompt, max_tokens=max_tokens,
                                               extra_body={"ignore_eos": True, "priority": priority})

        before = len(s.result.audit.events)
        engine._compute = gated
        try:
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                blocker = pool.submit(complete, [9] * 6, 0, 4)
                wait_for(lambda: bool(engine.driver.running), what="the blocker runs")
                scored = pool.submit(s.http.post, "/score",
                                     json={"text_1": text(QUERY), "text_2": text(DOCS[3]), "priority": 5})
                wait_for(lambda: len(engine._inbox) == 2, what="the score's two texts queued")
                later = pool.submit(complete, [7] * 3, 2, 2)  # after the texts, were theirs the default 0
                wait_for(lambda: len(engine._inbox) == 3, what="the later completion queued")
                gate.set()
                answers = [f.result(timeout=TIMEOUT) for f in (blocker, scored, later)]
        finally:
            gate.set()
            del engine._compute  # the class's method again
        assert answers[1].status_code == 200, answers[1].text
        assert answers[1].json()["data"][0]["score"] == pytest.approx(cos(QUERY, DOCS[3]), abs=1e-5)
        admitted = [e["prompt_tokens"] for e in s.result.audit.events[before:] if e["event"] == "request_admitted"]
        assert admitted == [6, 3, len(QUERY), len(DOCS[3])]  # the blocker, the later completion, then the texts
