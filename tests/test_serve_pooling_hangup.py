"""A client that hangs up on a pooling request (``/classify``, ``/pooling``, ``/rerank``, ``/score``,
``/v1/embeddings``, and ``/invocations`` bodies sent to them) has its engine requests aborted at once, as a completion's
are: the prompts not yet prefilled are never computed, its admission slot is freed and the engine holds nothing of it.
They used to run to their end (every prompt prefilled for no one), then be cleaned up.

Over a real socket: the engine is held at the request's second step, the client closes, the step is let go."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from tests.classify_support import classifier_checkpoint
from tests.llm_support import with_tokenizer, word_tokenizer
from tests.serve_support import TIMEOUT, held_at_step, serving, wait_for

KV = {"max_tokens": 512, "tokens_per_block": 4}
#: 64 inputs of 30 tokens, no two sharing a first block (no prefix cache hit): 120 steps of max_num_tokens 16
INPUTS = [[(11 * j + 7 * i) % 500 + 1 for i in range(30)] for j in range(64)]


def text(ids: list[int]) -> str:
    """The word-level tokenizer's text of ``ids`` (token i is "w<i>")."""
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = classifier_checkpoint(tmp_path_factory.mktemp("hangup") / "llama", "llama",
                                 "LlamaForSequenceClassification", 3)
    word_tokenizer(512).save_pretrained(path)
    with serving(str(path), dtype="float32", max_seq_len=64, max_num_tokens=16, kv_cache_config=KV) as s:
        yield s


@pytest.fixture(scope="module")
def generative(tiny_checkpoints, tmp_path_factory):
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path_factory.mktemp("hangup") / "gen", 512)
    with serving(str(words), dtype="float32", max_seq_len=64, max_num_tokens=16, kv_cache_config=KV) as s:
        yield s


def _aborted(served) -> float:
    return sum(v for k, v in served.metrics().items()
               if "request_success" in k and "finished_reason=abort" in k and not k.endswith("_created"))


def _hang_up_mid_request(served, path: str, body: dict) -> None:
    """Send ``body`` to ``path``, close the socket once the engine is in the request's second step, and check the
    server gave it up while that step is held: slot freed; after it, at most a step more and nothing left."""
    engine = served.state.engine
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    aborted = _aborted(served)
    with held_at_step(served, 2) as (reached, release):
        with socket.create_connection(("127.0.0.1", served.server.port), timeout=TIMEOUT) as sock:
            sock.sendall(head + payload)
            assert reached.wait(TIMEOUT), "the request never reached its second step"
            assert served.state.in_flight == 1
        # the client is gone: its slot is freed while the engine still computes the held step (it used to be held
        # until every prompt was prefilled, 120 steps)
        wait_for(lambda: served.state.in_flight == 0, timeout=10, what="the slot freed while the engine is held")
        steps = engine.steps
        release.set()
        wait_for(lambda: engine.snapshot()["running"] == 0 and engine.snapshot()["waiting"] == 0,
                 what="the engine idle")
    assert engine.steps - steps <= 2, f"{engine.steps - steps} steps ran for a client that left"
    prompts = len(body.get("input", body.get("documents", [])))
    # all but the few computed in its two steps (more where an earlier test left their prefix cached)
    wait_for(lambda: _aborted(served) - aborted >= prompts * 3 // 4, what=f"most of its {prompts} requests aborted")
    wait_for(lambda: not engine.executor.pooled, what="no captured row left behind")
    assert served.metrics()["kvload_http_requests_in_flight"] == 0
    r = served.http.post(path, json={**body, **({"input": INPUTS[:2]} if "input" in body else
                                                {"documents": body["documents"][:2]})})
    assert r.status_code == 200, r.text  # and it serves on


@pytest.mark.parametrize(("path", "body"), [
    ("/classify", {"input": INPUTS}),
    ("/pooling", {"input": INPUTS}),  # token_classify: every prompt token's probabilities
    ("/invocations", {"input": INPUTS}),  # sent to /classify
])
def test_a_classifier_request_whose_client_hangs_up_is_aborted_and_frees_its_slot(classifier, path, body):
    _hang_up_mid_request(classifier, path, body)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/embeddings", {"input": INPUTS}),
    ("/invocations", {"input": INPUTS}),  # sent to /v1/embeddings
    ("/pooling", {"input": INPUTS, "task": "embed"}),
    ("/rerank", {"query": text(INPUTS[0][:10]), "documents": [text(ids) for ids in INPUTS]}),
    ("/score", {"queries": text(INPUTS[0][:10]), "documents": [text(ids) for ids in INPUTS]}),
])
def test_an_embedding_request_whose_client_hangs_up_is_aborted_and_frees_its_slot(generative, path, body):
    _hang_up_mid_request(generative, path, body)


@pytest.mark.parametrize("every_token", [False, True])
def test_a_request_taken_during_the_forward_that_computes_its_rows_leaves_none_behind(every_token):
    """A client that leaves while the engine computes its input's last chunk: the handler takes (forgets) its row,
    then the forward ends and wrote it anyway, kept for the server's life (no one takes it again)."""
    from engine.pooling import PooledRows

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(4, 3)

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.head

    model, pooled = Model(), PooledRows()
    pooled.want("gone", every_token=every_token)
    pooled.want("kept", every_token=every_token)
    with pooled.capture(model, [("gone", 0, 0, 2, True), ("kept", 0, 2, 4, True)]):
        model.head(torch.randn(4, 4))
        assert pooled.take("gone") is None  # the handler, on the event loop, as the forward runs
    assert pooled.take("kept") is not None
    assert not pooled, "a row of a request already taken was kept"
