"""A client that hangs up before its request is parsed: while its big body waits for the body lane, while that body is
read as JSON, or while its prompts are tokenized. It used to be noticed only once all of that had run (seconds for a
20 MB body), for no one, holding its admission slot and, ahead of everyone behind it, the lane or the gate; one that
left while it queued in the lane was read whole all the same. Now its slot is let go as soon as it leaves, its body is
not read (in the lane) or no further (at the JSON's next integer, the next prompt), and nothing reaches the engine.

Over real sockets: what runs is held at a known point, the client closes, then it is let go."""

from __future__ import annotations

import json
import socket
import threading

import pytest

import kvload.serve.request_body as request_body
import kvload.serve.worker as worker
from tests.llm_support import with_tokenizer
from tests.serve_support import TIMEOUT, serving, wait_for

#: a body past worker.SMALL_BODY (read as JSON in the body lane), answered with one token
BIG = json.dumps({"prompt": "w1 w2 w3", "max_tokens": 1, "user": "u" * (80 << 10)}).encode()


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory):
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path_factory.mktemp("parse_hangup") / "gen", 512)
    with serving(str(words), dtype="float32", max_seq_len=64, kv_cache_config={"max_tokens": 512}) as s:
        yield s


def _send(served, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", served.server.port), timeout=TIMEOUT)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def _answered(served, body: bytes) -> tuple[threading.Thread, list[int]]:
    """``body`` posted on a thread; the status it got, once it has."""
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(served.http.post(
        "/v1/completions", content=body, headers={"Content-Type": "application/json"}).status_code))
    thread.start()
    return thread, status


def _hold(monkeypatch, owner, name: str, when=lambda *a: True):
    """``owner.name`` held on its first call that ``when(*args)`` accepts until ``release`` is set; (entered, release,
    calls)."""
    real, entered, release, calls = getattr(owner, name), threading.Event(), threading.Event(), []

    def held(*args, **kwargs):
        calls.append(args)
        if not entered.is_set() and when(*args):
            entered.set()
            release.wait(TIMEOUT)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, held)
    return entered, release, calls


def _small_answered(served) -> None:
    r = served.http.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 1})
    assert r.status_code == 200, r.text


def _requests(served) -> float:
    return sum(v for k, v in served.metrics().items() if k.startswith("kvload_request_success_total"))


def test_a_big_body_whose_client_left_while_it_queued_in_the_lane_is_never_read_and_frees_its_slot_at_once(
        served, monkeypatch):
    entered, release, loads = _hold(monkeypatch, worker, "LoadedBody")
    read: list[int] = []
    real_read = worker._read_body

    async def reading(*args):
        raw = await real_read(*args)
        read.append(len(raw))
        return raw

    monkeypatch.setattr(worker, "_read_body", reading)
    first, status = _answered(served, BIG)  # holds the lane: its JSON read is held
    try:
        assert entered.wait(TIMEOUT)
        with _send(served, BIG):
            wait_for(lambda: len(read) == 2, what="the second big body read, queued in the lane")
            assert served.state.in_flight == 2
        # gone: its slot is let go while the first body still holds the lane (it was held until that one was read,
        # then read itself, for no one)
        wait_for(lambda: served.state.in_flight == 1, timeout=10, what="the slot freed while the lane is held")
    finally:
        release.set()
        first.join(TIMEOUT)
    assert status == [200]
    assert len(loads) == 1, "the body of a client that left was read as JSON"
    _small_answered(served)
    assert served.metrics()["kvload_http_requests_in_flight"] == 0


def test_a_big_body_whose_client_left_while_it_was_read_as_json_frees_its_slot_and_the_lane(served, monkeypatch):
    ids = json.dumps({"prompt": [[(7 * i + j) % 500 + 1 for j in range(40)] for i in range(600)],
                      "max_tokens": 1}).encode()
    assert len(ids) > worker.SMALL_BODY
    entered, release, _ = _hold(monkeypatch, request_body, "json_depth")  # inside its read, on the parse thread
    requests = _requests(served)
    try:
        with _send(served, ids):
            assert entered.wait(TIMEOUT)
            assert served.state.in_flight == 1
        wait_for(lambda: served.state.in_flight == 0, timeout=10, what="the slot freed while its JSON is read")
        _small_answered(served)  # a small body takes no lane
    finally:
        release.set()
    status = served.http.post("/v1/completions", content=BIG, headers={"Content-Type": "application/json"})
    assert status.status_code == 200, status.text  # the lane let go once the read stopped
    assert _requests(served) - requests == 2  # the two answered; none for the client that left
    assert served.metrics()["kvload_http_requests_in_flight"] == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings"])
def test_a_request_of_many_prompts_whose_client_left_is_tokenized_no_further_and_queues_nothing(
        served, monkeypatch, path):
    prompts = [" ".join(f"w{(i * 7 + j) % 500 + 1}" for j in range(20)) for i in range(64)]
    field = "prompt" if path == "/v1/completions" else "input"
    body = json.dumps({field: prompts, **({"max_tokens": 1} if field == "prompt" else {})}).encode()
    engine = served.state.engine
    name = "encode" if field == "prompt" else "tokenize"
    entered, release, calls = _hold(monkeypatch, engine, name, lambda text, **kw: text == prompts[3])
    requests = _requests(served)
    try:
        sock = socket.create_connection(("127.0.0.1", served.server.port), timeout=TIMEOUT)
        with sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n".encode()
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert entered.wait(TIMEOUT)
        # its slot is let go while its fourth prompt is still being tokenized
        wait_for(lambda: served.state.in_flight == 0, timeout=10, what="the slot freed while a prompt is tokenized")
    finally:
        release.set()
    _small_answered(served)  # the gate let go once that prompt's tokenizing ended
    done = sum(1 for args in calls if args[0] in prompts)
    assert done == 4, f"{done} of its 64 prompts tokenized for a client that left"
    assert engine.snapshot()["running"] == 0 and engine.snapshot()["waiting"] == 0
    assert _requests(served) - requests == 1  # the small request's alone
