"""``kvload serve`` when a handler fails where nothing expected it (a bug, injected here with monkeypatch): the client
gets HTTP 500 in the API's error body (a stream: an error event, then ``[DONE]``), its keep-alive connection serves
the next request, the request's engine requests are aborted and its slot and parse turn let go, and the server's log
holds one ``request_failed`` record with the traceback (the answer holds none).

Each test failed before the fix: Starlette answered the 500 and raised the exception on to uvicorn, which logged
"Exception in ASGI application" and closed the connection under the client (a stream was cut mid-body).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
from collections.abc import Iterator

import openai
import pytest

from kvload.serve.request_run import _Run
from tests.serve_support import TIMEOUT, serving, wait_for

PROMPT = [3, 1, 4, 1, 5]
INJECTED = "injected: a bug in the handler"
MESSAGE = f"internal server error: RuntimeError: {INJECTED}; the server logged it (request_failed) and serves on"
ERROR = {"message": MESSAGE, "type": "server_error", "param": None, "code": "internal_server_error"}


@pytest.fixture(scope="module")
def served():
    with serving("tiny-llama") as s:
        yield s


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def _uvicorn_errors() -> Iterator[list[str]]:
    """What uvicorn logs at ERROR meanwhile ("Exception in ASGI application")."""
    handler, logger = _Errors(), logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


def _failed_records(served) -> list[dict]:
    lines = served.http.get("/v1/kvload/audit").text.splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "request_failed"]


def _fail(monkeypatch, name: str, after: int = 0) -> None:
    """``_Run.name`` raises RuntimeError(INJECTED) on its call number ``after + 1``, then works again."""
    real, calls = getattr(_Run, name), []

    def failing(self, *args, **kwargs):
        calls.append(None)
        if len(calls) == after + 1:
            raise RuntimeError(INJECTED)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(_Run, name, failing)


def _assert_released(served, aborted_before: float) -> None:
    """The failed request's engine request aborted, its blocks free, its admission slot and parse turn let go."""
    wait_for(lambda: served.metrics().get("kvload_request_success_total{finished_reason=abort}", 0)
             == aborted_before + 1, TIMEOUT, "the failed request's engine request aborted")
    wait_for(lambda: served.state.in_flight == 0, TIMEOUT, "no request in flight")
    manager = served.result.kv_manager
    wait_for(lambda: all(g.used == 0 for g in manager.stats().groups.values()), TIMEOUT, "every block free")
    gate = served.server.server.config.app.state.parse_gate
    assert gate.waiting() == 0 and gate._holder is None


def test_a_handler_failure_is_a_500_and_the_same_keep_alive_connection_serves_the_next_request(served, monkeypatch):
    """Raw http.client on one connection: the 500 keeps it open (no ``Connection: close``), the second request on it
    is answered 200; the failed request's 2,000-token generation was aborted, not left running."""
    aborted = served.metrics().get("kvload_request_success_total{finished_reason=abort}", 0)
    before = len(_failed_records(served))
    _fail(monkeypatch, "collect")  # after its engine request was queued: it must be aborted, not left to run
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True})
    conn = http.client.HTTPConnection("127.0.0.1", served.server.port, timeout=TIMEOUT)
    try:
        with _uvicorn_errors() as errors:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            payload = r.read()
            assert r.status == 500, payload
            assert r.getheader("connection", "").lower() != "close" and not r.will_close
            conn.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 3}),
                         {"Content-Type": "application/json"})  # on main: RemoteDisconnected
            again = conn.getresponse()
            answer = json.loads(again.read())
            assert again.status == 200 and len(answer["choices"][0]["token_ids"]) == 3
            assert r.getheader("content-type") == "application/json"
            assert json.loads(payload) == {"error": ERROR}
            assert b"Traceback" not in payload
            _assert_released(served, aborted)
        assert errors == []  # no "Exception in ASGI application"
    finally:
        conn.close()
    (record,) = _failed_records(served)[before:]
    assert {k: record[k] for k in ("level", "method", "path", "error", "message")} == {
        "level": "error", "method": "POST", "path": "/v1/completions", "error": "RuntimeError", "message": INJECTED}
    assert record["exception"].startswith("Traceback (most recent call last):")
    assert "in failing" in record["exception"] and record["exception"].endswith(f"RuntimeError: {INJECTED}")


def test_the_openai_client_gets_an_internal_server_error_then_is_served(served, monkeypatch):
    """The openai client raises InternalServerError carrying OpenAI's error body; its next call is answered."""
    _fail(monkeypatch, "_usage")
    with pytest.raises(openai.InternalServerError) as caught:
        served.client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2)
    assert caught.value.status_code == 500 and caught.value.body == ERROR
    again = served.client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2)
    assert again.usage.completion_tokens == 2


def test_a_stream_that_fails_midway_ends_with_an_error_event_and_done(served, monkeypatch):
    """A stream already under way (its 200 and first chunks sent) gets an error event and ``[DONE]``, its body ended
    properly: the openai client raises APIError with the message, and the next stream on it is whole."""
    aborted = served.metrics().get("kvload_request_success_total{finished_reason=abort}", 0)
    _fail(monkeypatch, "_chunk", after=2)
    stream = served.client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2000,
                                              stream=True, extra_body={"ignore_eos": True})
    got = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in stream:
            got.append(chunk)
    assert len(got) == 2 and caught.value.message == MESSAGE
    _assert_released(served, aborted)
    again = served.client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=3, stream=True)
    assert sum(len(c.choices[0].text) > 0 or c.choices[0].finish_reason is not None for c in again) >= 1


def test_a_stream_failure_on_a_raw_connection_is_chunked_to_its_end_and_the_connection_serves_on(served,
                                                                                                   monkeypatch):
    _fail(monkeypatch, "_chunk", after=1)
    conn = http.client.HTTPConnection("127.0.0.1", served.server.port, timeout=TIMEOUT)
    try:
        body = json.dumps({"prompt": PROMPT, "max_tokens": 50, "ignore_eos": True, "stream": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        events = [e for e in r.read().decode().split("\n\n") if e]  # a body cut short raises IncompleteRead here
        assert r.status == 200 and not r.will_close
        assert events[-2:] == [f"data: {json.dumps({'error': ERROR}, separators=(',', ':'))}", "data: [DONE]"]
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def test_a_messages_request_that_fails_is_answered_in_anthropics_error_document(served, monkeypatch):
    _fail(monkeypatch, "prepare")  # on the parse's worker thread
    r = served.http.post("/v1/messages", json={"model": "tiny-llama", "max_tokens": 3,
                                               "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 500
    assert r.json() == {"type": "error", "error": {"type": "api_error", "message": MESSAGE}}


class _Engine:
    """What ``_Failures`` reads of a serving engine: a loop that runs, taking the records it is handed."""

    alive = True

    def __init__(self) -> None:
        self.records: list = []

    def notify(self, *records) -> None:
        self.records.extend(records)


@pytest.mark.parametrize("path, events", [
    ("/v1/messages", [("error", {"type": "error", "error": {"type": "api_error", "message": MESSAGE}})]),
    ("/v1/responses", [("error", {"type": "error", "sequence_number": 2, "code": "internal_server_error",
                                  "message": MESSAGE, "param": None})]),
    ("/v1/chat/completions", [(None, {"error": ERROR}), (None, "[DONE]")]),
])
def test_a_stream_under_way_ends_in_its_apis_error_event(path, events):
    """Each API's stream ends in the error event its clients read (Anthropic's ``event: error``, the Responses API's
    ``error`` event, numbered after the stream's last, as OpenAI's ``ResponseErrorEvent`` has it; chat's error chunk
    then ``[DONE]``), its body ended, one ``request_failed`` record handed on."""
    import asyncio
    import types

    from kvload.serve.failures import _Failures

    async def app(scope, receive, send):  # a stream whose second chunk fails
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        for n, kind in enumerate(("response.created", "response.in_progress")):  # the Responses API numbers them
            event = json.dumps({"type": kind, "sequence_number": n}, separators=(",", ":"))
            await send({"type": "http.response.body", "body": f"event: {kind}\ndata: {event}\n\n".encode(),
                        "more_body": True})
        raise RuntimeError(INJECTED)

    engine = _Engine()
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": []}
    asyncio.run(_Failures(app, types.SimpleNamespace(engine=engine))(scope, None, send))
    assert sent[-1]["more_body"] is False
    got = []
    for block in sent[-1]["body"].decode().split("\n\n")[:-1]:
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = lines["data"]
        got.append((lines.get("event"), data if data == "[DONE]" else json.loads(data)))
    assert got == events
    (record,) = engine.records
    assert (record.path, record.error, record.message) == (path, "RuntimeError", INJECTED)
