"""``kvload serve`` against clients that stop sending, over real sockets: a head or a body not all in within
``--request-read-timeout`` is answered 408 with OpenAI's error body and its connection closed, a body the server
answered without reading cannot hold the connection by trickling, and the server keeps serving afterwards.

The server here runs with a 1 s timeout so the tests that wait for it finish soon; no test asserts how long
anything took. A reader that the server never answers is cut off by the socket's own timeout: a failure, not
a hang.
"""

from __future__ import annotations

import json
import re
import select
import socket
import threading

import httpx
import pytest

from tests.serve_support import TIMEOUT, answers_while_held, held_at_step, serving, wait_for

READ_TIMEOUT = 1.0
PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def served():
    with serving("tiny-llama", state={"read_timeout_s": READ_TIMEOUT}) as s:
        yield s


def _connect(served) -> socket.socket:
    return socket.create_connection(("127.0.0.1", served.server.port), timeout=TIMEOUT)


def _read_to_close(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):  # a server that never closes times this out: the test fails, never hangs
        data += chunk
    return data


def _response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, payload = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    return int(status_line.split()[1]), headers, payload


def _assert_timed_out(data: bytes, message: str) -> None:
    status, headers, payload = _response(data)
    assert status == 408, data
    assert headers["connection"] == "close"
    assert json.loads(payload) == {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                             "code": "request_timeout"}}


def _served_normally(served) -> None:
    # a fresh connection each time: a pooled one may be the keep-alive connection the server is closing
    with httpx.Client(base_url=served.url, timeout=TIMEOUT) as http:
        assert http.get("/health").json() == {"status": "ok"}
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3


def _post_head(extra: str) -> bytes:
    return f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{extra}\r\n".encode()


HEAD_MESSAGE = ("the request head did not arrive in time: its headers were not all in within 1 s "
                "(--request-read-timeout sets it)")


@pytest.mark.parametrize("partial", [b"POST /v1/completions HTTP/1.1\r\nHost: te", b"G"])
def test_a_head_never_finished_is_a_408_and_the_connection_closes(served, partial):
    with _connect(served) as sock:
        sock.sendall(partial)
        _assert_timed_out(_read_to_close(sock), HEAD_MESSAGE)
    _served_normally(served)


def test_a_head_never_finished_after_a_keep_alive_response_is_a_408_too(served):
    """uvicorn's keep-alive timer is cancelled by the first byte of the next request: that head was never timed."""
    with _connect(served) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        data = b""
        while b'{"status":"ok"}' not in data:
            data += sock.recv(65536)
        sock.sendall(b"GET /heal")
        status, _, payload = _response(_read_to_close(sock))
        assert status == 408 and json.loads(payload)["error"]["message"] == HEAD_MESSAGE
    _served_normally(served)


def test_a_connection_that_sends_nothing_is_closed(served):
    with _connect(served) as sock:
        assert _read_to_close(sock) == b""  # nothing to answer: no request began
    _served_normally(served)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_that_stops_arriving_is_a_408_naming_the_flag(served, chunked):
    part = b'{"prompt": [1, 2, '
    with _connect(served) as sock:
        if chunked:  # one chunk, then neither the rest nor the last (empty) chunk
            sock.sendall(_post_head("Transfer-Encoding: chunked\r\n") + b"%x\r\n%s\r\n" % (len(part), part))
            expected = "of a chunked body"
        else:
            sock.sendall(_post_head("Content-Length: 100\r\n") + part)
            expected = "of 100"
        _assert_timed_out(_read_to_close(sock), f"the request body did not arrive in time: {len(part)} bytes "
                                                f"{expected} came within 1 s (--request-read-timeout sets it)")
    _served_normally(served)


def test_a_trickled_body_gets_no_more_time_than_a_stopped_one(served):
    """A byte every 50 ms, each well inside the timeout: the deadline is for the whole body, not each read.

    A byte is sent only while no answer has begun, so the server has read every byte when it answers and closes
    (its close is a FIN, never a reset racing the answer).
    """
    sent = 0
    with _connect(served) as sock:
        sock.sendall(_post_head("Content-Length: 1000000\r\n"))
        while not select.select([sock], [], [], 0.05)[0]:
            sock.sendall(b" ")
            sent += 1
            assert sent < 1_000_000  # the whole body sent and still no answer: the trickle was never cut
        status, _, payload = _response(_read_to_close(sock))
    assert status == 408, payload
    message = json.loads(payload)["error"]["message"]
    assert message.startswith("the request body did not arrive in time: ") and "of 1,000,000 came within 1 s" in message
    _served_normally(served)


def test_a_body_answered_unread_cannot_hold_the_connection_by_trickling(served):
    """405 comes before the body is read; uvicorn then drops what arrives, and its first byte cancelled the
    keep-alive timer, so a trickle held the connection forever. The body's deadline closes it."""
    with _connect(served) as sock:
        sock.sendall(b"POST /health HTTP/1.1\r\nHost: test\r\nContent-Length: 100\r\n\r\n{}")
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
                _response(data)[1]["content-length"]):
            data += sock.recv(65536)
        assert _response(data)[0] == 405
        sock.sendall(b"  ")  # more of the body, after the answer
        assert _read_to_close(sock) == data[len(data):]  # closed, nothing more said
    _served_normally(served)


def _timeouts_counted(served) -> float:
    return served.metrics()["kvload_http_requests_refused_total{reason=read_timeout}"]


@pytest.mark.parametrize("request_bytes", [
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00",  # curl --http2-prior-knowledge's start
    b"GET /health HTTP/3.0\r\nHost: test\r\n\r\n",
], ids=["http2-preface", "http3-request-line"])
def test_a_request_in_another_http_version_is_a_505_saying_which(served, request_bytes):
    """h11 reads any HTTP/d.d: HTTP/2's preface was routed as a request for the path ``*`` and answered 404 "Invalid
    URL (PRI *): no such endpoint", which said nothing of the version the client spoke."""
    before = served.metrics()["kvload_http_requests_refused_total{reason=bad_request}"]
    with _connect(served) as sock:
        sock.sendall(request_bytes)
        status, headers, payload = _response(_read_to_close(sock))  # answered, then closed
    assert served.metrics()["kvload_http_requests_refused_total{reason=bad_request}"] == before + 1
    version = request_bytes.split(b"\r\n", 1)[0].rsplit(b"/", 1)[1].decode()
    assert status == 505, payload
    assert headers["connection"] == "close"
    assert json.loads(payload)["error"] == {
        "message": f"the request is HTTP/{version}; kvload serve speaks HTTP/1.1 (and 1.0): send it over HTTP/1.1 "
                   "(curl: without --http2-prior-knowledge)",
        "type": "invalid_request_error", "param": None, "code": "http_version_not_supported"}
    _served_normally(served)


def test_read_timeouts_are_counted_head_and_body_alike(served):
    """A head's 408 is written below the app (the h11 protocol), a body's by the app: both reach /metrics."""
    before = _timeouts_counted(served)
    with _connect(served) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: te")
        assert _response(_read_to_close(sock))[0] == 408
    assert _timeouts_counted(served) == before + 1
    with _connect(served) as sock:
        sock.sendall(_post_head("Content-Length: 100\r\n") + b'{"prompt": [1, ')
        assert _response(_read_to_close(sock))[0] == 408
    assert _timeouts_counted(served) == before + 2
    with _connect(served) as sock:
        assert _read_to_close(sock) == b""  # no request began: closed, and no refusal to count
    _served_normally(served)
    assert _timeouts_counted(served) == before + 2
    assert served.metrics()["kvload_http_requests_in_flight"] == 0  # the timed-out body's slot was freed


def test_a_stream_whose_client_reads_nothing_is_dropped_and_frees_its_slot(served, monkeypatch):
    """A client that sends a streamed request and never reads: once the socket's buffers filled, each send waited
    for ever, so the request held its --max-concurrent-requests slot and its connection long after its answer was
    generated. Still reading nothing ``--request-read-timeout`` later, it is dropped, its request aborted.

    The server's buffers for this connection are made small, so they fill after a few chunks, not megabytes."""
    from kvload.serve import server

    made = server._Deadlines.connection_made

    def small_buffers(self, transport):
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        transport.set_write_buffer_limits(high=2048)
        made(self, transport)

    monkeypatch.setattr(server._Deadlines, "connection_made", small_buffers)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True,
                       "logprobs": 20}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connecting: the window it advertises
    sock.settimeout(TIMEOUT)
    try:
        sock.connect(("127.0.0.1", served.server.port))
        sock.sendall(_post_head(f"Content-Length: {len(body)}\r\n") + body)
        wait_for(lambda: served.state.in_flight == 1, what="the stream in flight")
        monkeypatch.undo()  # the connections below get the usual buffers
        wait_for(lambda: served.state.in_flight == 0, what="the stalled stream's slot freed")
        wait_for(lambda: served.state.engine.snapshot()["running"] == 0, what="its request aborted")
    finally:
        sock.close()
    _served_normally(served)


def _kv_blocks_used(served) -> float:
    return sum(v for k, v in served.metrics().items() if k.startswith("kvload_kv_cache_blocks{") and "state=used" in k)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_half_closes_after_its_request_is_a_client_that_left(served, stream):
    """The decision pinned: a client that shuts its sending side (``shutdown(SHUT_WR)``) once its request is sent is
    taken as gone, as uvicorn (and so vLLM), Go's net/http and nginx (499) take an end of stream: its request is
    aborted, nothing is answered, its slot and KV blocks are freed at once. A close and a half-close look the same
    to the server until it writes, and a client that hung up (Ctrl-C on curl) must not keep its request generating
    up to ``max_tokens``; a client wanting its answer keeps its sending side open until it has read it."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": stream}).encode()
    with held_at_step(served, 2) as (reached, release), _connect(served) as sock:
        sock.sendall(_post_head(f"Content-Length: {len(body)}\r\n") + body)
        assert reached.wait(TIMEOUT)  # generating: its blocks are held (the step holds the engine's lock: read as is)
        assert served.state.in_flight == 1 and served.state.engine.manager.stats().usage > 0
        sock.shutdown(socket.SHUT_WR)
        release.set()
        answer = _read_to_close(sock)
    assert b"[DONE]" not in answer and (answer == b"" or stream)  # a stream's first chunk may have gone out
    wait_for(lambda: served.state.in_flight == 0, what="its slot freed")
    wait_for(lambda: served.state.engine.snapshot()["running"] == 0, what="its request aborted")
    wait_for(lambda: _kv_blocks_used(served) == 0, what="its KV blocks freed")
    assert served.metrics()["kvload_http_requests_in_flight"] == 0
    _served_normally(served)


def test_connections_past_the_open_file_limit_are_one_warning_not_a_traceback_per_try(served, monkeypatch, caplog):
    """A flood of connections past ``ulimit -n``: each accept that failed for want of a file descriptor was
    asyncio's error with a traceback, and Python 3.11 retries up to uvicorn's backlog (2,048) times a second: 342,240
    log lines in 10 s. It is one warning line; the connection waiting in the backlog is served once files free up.

    The listening socket's accept fails with EMFILE until the test lets it succeed, as it does at the limit."""
    import errno
    import logging
    import threading

    listening, accept = served.server.sock, socket.socket.accept
    full, tries = threading.Event(), []
    full.set()

    def out_of_files(self):
        if self is listening and full.is_set():
            tries.append(None)
            raise OSError(errno.EMFILE, "Too many open files")
        return accept(self)

    said: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = said.append  # type: ignore[method-assign]
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(handler)
    monkeypatch.setattr(socket.socket, "accept", out_of_files)
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"), _connect(served) as sock:
            sock.sendall(_post_head("Content-Length: 2\r\nConnection: close\r\n") + b"{}")
            wait_for(lambda: len(tries) > 100, what="accept failing")
            full.clear()
            status, _, payload = _response(_read_to_close(sock))  # served once a descriptor is free
        assert status == 400 and b"prompt: required" in payload
        assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
    finally:
        uvicorn_log.removeHandler(handler)
    (line,) = [r for r in said if "cannot accept" in r.getMessage()]
    assert line.getMessage() == ("serve: cannot accept new connections (Too many open files); they wait until some "
                                 "close: raise the open-file limit (ulimit -n); each open connection holds a file, an "
                                 "idle one until --request-read-timeout")
    assert line.exc_info is None  # no traceback


@pytest.mark.parametrize("value", [0, -1.0, True, "30", float("nan"), float("inf"), 86401])
def test_build_state_refuses_a_read_timeout_that_is_not_positive_seconds(served, value):
    from kvload.serve.server import build_state
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^read_timeout_s: expected seconds in \(0, 86400\]") as info:
        build_state(served.result, read_timeout_s=value)
    assert "\n" not in str(info.value)


# --- --max-concurrent-requests -------------------------------------------------------------------------------

LIMIT = 2


@pytest.fixture(scope="module")
def limited():
    # room for one long stream (8,192 tokens of KV); the default read timeout, so a held body stays held
    with serving("tiny-llama", state={"max_concurrent_requests": LIMIT},
                 kv_cache_config={"max_tokens": 8192}) as s:
        yield s


IN_FLIGHT = "kvload_http_requests_in_flight"
BUSY = "kvload_http_requests_refused_total{reason=busy}"


def _in_flight(served, n: int) -> None:
    """Wait until ``n`` requests are in flight, as the server counts them and as /metrics reports them."""
    wait_for(lambda: served.state.in_flight == n, what=f"{n} requests in flight")
    wait_for(lambda: served.metrics()[IN_FLIGHT] == n, what=f"/metrics showing {n} requests in flight")


def _held(served) -> socket.socket:
    """A completion request whose body never finishes: in flight until the socket closes."""
    sock = _connect(served)
    sock.sendall(_post_head("Content-Length: 100\r\n") + b'{"prompt": [1, ')
    return sock


def _assert_busy(served) -> None:
    before = served.metrics()
    with httpx.Client(base_url=served.url, timeout=TIMEOUT) as http:
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.headers["connection"] == "close"  # the refused body is not read
        assert r.json() == {"error": {"message": "the server is busy: 2 requests are already in flight, "
                                                 "the most it takes at once (--max-concurrent-requests sets it); "
                                                 "retry later",
                                      "type": "server_error", "param": None, "code": "server_busy"}}
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503
        assert http.post("/v1/responses", json={"input": "hi"}).status_code == 503
        r = http.post("/v1/messages", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"  # Anthropic's error there
        # /tokenize reads a body of up to --max-request-bytes too: counted, so a flood of them is refused unread
        assert http.post("/tokenize", json={"prompt": "hi"}).status_code == 503
        # what a load balancer and a scraper ask keeps answering (uvicorn's limit_concurrency would 503 them)
        assert http.get("/health").json() == {"status": "ok"}
        assert "kvload_generation_tokens_total" in http.get("/metrics").text
    after = served.metrics()
    assert after[BUSY] == before[BUSY] + 5  # every refusal counted; /health and /metrics are neither in flight
    assert after[IN_FLIGHT] == before[IN_FLIGHT] == LIMIT  # nor refused


def test_past_the_limit_a_request_is_a_503_and_a_freed_slot_is_used_again(limited):
    first, second = _held(limited), _held(limited)
    try:
        _in_flight(limited, 2)
        _assert_busy(limited)
    finally:
        first.close()
        second.close()
    _in_flight(limited, 0)  # a client that hung up mid-body frees its slot
    _served_normally(limited)


def test_a_stream_holds_its_slot_until_its_client_hangs_up(limited):
    body = {"prompt": [3, 1, 4, 1, 5], "max_tokens": 8000, "ignore_eos": True, "stream": True}
    held = _held(limited)
    _in_flight(limited, 1)
    try:
        with httpx.Client(base_url=limited.url, timeout=TIMEOUT) as http, \
                http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: a dropped iterator closes the response when collected
            next(lines)  # streaming: in flight until it ends or its client leaves
            _in_flight(limited, 2)
            _assert_busy(limited)
        _in_flight(limited, 1)  # the stream's client left: its slot is free, the held body's is not
        _served_normally(limited)
    finally:
        held.close()
    _in_flight(limited, 0)


def test_requests_leave_the_in_flight_gauge_however_they_end(limited):
    """A stream read to its end, a plain answer, and a plain request whose client hangs up while it generates."""
    body = {"prompt": [3, 1, 4, 1, 5], "max_tokens": 4, "ignore_eos": True}
    with httpx.Client(base_url=limited.url, timeout=TIMEOUT) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert list(response.iter_lines())[-2:] == ["data: [DONE]", ""]
        assert http.post("/v1/completions", json=body).status_code == 200
    _in_flight(limited, 0)
    long = json.dumps({**body, "max_tokens": 8000}).encode()
    with _connect(limited) as sock:
        sock.sendall(_post_head(f"Content-Length: {len(long)}\r\n") + long)
        _in_flight(limited, 1)  # generating, no answer yet
    _in_flight(limited, 0)  # the client hung up: its requests were aborted and its slot freed


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "8"])
def test_build_state_refuses_a_concurrency_limit_that_is_not_a_positive_integer(limited, value):
    from kvload.serve.server import build_state
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^max_concurrent_requests: expected an integer >= 1, got ") as info:
        build_state(limited.result, max_concurrent_requests=value)
    assert "\n" not in str(info.value)


# --- parsing and tokenizing off the event loop -----------------------------------------------------------------


def test_health_answers_while_a_request_is_being_tokenized(served):
    """The tokenizer is held inside ``engine.encode`` until /health has answered: were the prompt encoded on the
    event loop, /health could not answer (the hook gives up after a while, so a failure is not a hang)."""

    def scrape(http: httpx.Client) -> None:
        assert http.get("/health").json() == {"status": "ok"}
        assert "kvload_generation_tokens_total" in http.get("/metrics").text

    r = answers_while_held(served, served.state.engine, "encode",
                           lambda http: http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3,
                                                                          "ignore_eos": True}), scrape)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3


def test_a_request_whose_client_left_while_it_waited_to_be_parsed_is_never_parsed(served, monkeypatch):
    """Requests are parsed one at a time; one whose client left meanwhile was still parsed and tokenized (seconds of
    CPU for a big body) and queued for the engine, ahead of every request waiting behind it."""
    engine = served.state.engine
    connections = served.server.server.server_state.connections  # uvicorn's: a connection leaves it once closed
    encoded: list[object] = []
    real = engine.encode
    monkeypatch.setattr(engine, "encode", lambda *a, **k: (encoded.append(a), real(*a, **k))[1])
    body = json.dumps({"prompt": [7, 8, 9], "max_tokens": 2}).encode()

    def then_leave(http: httpx.Client) -> None:  # A is held in its parse: B waits for the parse gate, then leaves
        with _connect(served) as left:
            left.sendall(_post_head(f"Content-Length: {len(body)}\r\n") + body)
            wait_for(lambda: served.metrics()["kvload_http_requests_in_flight"] == 2, what="B waits to be parsed")
            open_now = len(connections)
        wait_for(lambda: len(connections) == open_now - 1, what="the server saw B's connection close")

    r = answers_while_held(served, engine, "encode", lambda http: http.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}), then_leave)
    assert r.status_code == 200
    wait_for(lambda: served.metrics()["kvload_http_requests_in_flight"] == 0, what="B's handler ended")
    assert len(encoded) == 1  # A's prompt alone
    _served_normally(served)


BIG = [[11 + i, 12 + i, 13 + i] for i in range(0, 80, 10)]  # eight prompts, each told apart by its first id
SMALL = [7, 8, 9]


@pytest.mark.parametrize("path, method, field, body", [
    ("/v1/completions", "encode", "prompt", {"max_tokens": 1}),
    ("/v1/embeddings", "check", "input", {}),
])
def test_a_small_request_is_parsed_between_two_prompts_of_a_many_prompt_one(served, monkeypatch, path, method, field,
                                                                           body):
    """The parse gate took one request whole: a small request sent while one of 1,024 prompts was being tokenized
    waited for all of them. Now the big one, held in its first prompt until the small one waits at the gate, lets
    it be parsed before its second prompt; both are answered."""
    engine = served.state.engine
    gate = served.server.server.config.app.state.parse_gate
    seen: list[int] = []
    real = getattr(engine, method)

    def spy(ids, *args, **kwargs):
        seen.append(ids[0])
        if ids[0] == BIG[0][0]:  # the big request's first prompt: wait till the small one queues behind it
            wait_for(lambda: gate.waiting() == 1, what="the small request waits at the parse gate")
        return real(ids, *args, **kwargs)

    monkeypatch.setattr(engine, method, spy)
    answers: dict[str, httpx.Response] = {}

    def send(name: str, prompt: object) -> None:
        with httpx.Client(base_url=served.url, timeout=TIMEOUT) as http:
            answers[name] = http.post(path, json={field: prompt, **body})

    big = threading.Thread(target=send, args=("big", BIG))
    big.start()
    try:
        wait_for(lambda: BIG[0][0] in seen, what="the big request's first prompt is being parsed")
        send("small", [SMALL])
    finally:
        big.join(TIMEOUT)
    assert answers["big"].status_code == answers["small"].status_code == 200, answers
    assert seen.index(SMALL[0]) < seen.index(BIG[1][0])  # parsed before the big one's second prompt
    assert [s for s in seen if s != SMALL[0]][:len(BIG)] == [p[0] for p in BIG]  # the big one's in order, each once
    _served_normally(served)


@pytest.mark.parametrize("path, body, status", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, 200),
    ("/v1/embeddings", {"input": [PROMPT]}, 200),
    ("/detokenize", {"tokens": PROMPT}, 400),  # tiny-llama has no tokenizer: refused in its turn, as before
])
def test_a_small_request_is_answered_while_a_big_bodys_json_is_read(served, monkeypatch, path, body, status):
    """A big body's JSON was read in its turn at the parse gate: 20 MB of token ids took seconds of ``json.loads``
    and every request sent meanwhile, a one-token completion too, waited for all of it. Now a body past 64 KiB is read
    before its turn (one at a time, in the gate's body lane): the big one's read is held until a small request has
    been answered; then it is answered too, and a big body that is no JSON is refused in the same words as before."""
    gate = served.server.server.config.app.state.parse_gate
    entered, release, real = threading.Event(), threading.Event(), json.loads
    padding = " " * 100_000  # JSON's whitespace: a body past 64 KiB that any route takes

    def held(text, *args, **kwargs):
        if len(text) > 65536:
            entered.set()
            release.wait(TIMEOUT)  # gives up in the end: a failure, not a hang
        return real(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", held)
    answers: dict[str, httpx.Response] = {}

    def send_big() -> None:
        with httpx.Client(base_url=served.url, timeout=TIMEOUT) as http:
            answers["big"] = http.post(path, content=json.dumps(body) + padding,
                                       headers={"Content-Type": "application/json"})

    big = threading.Thread(target=send_big)
    big.start()
    try:
        assert entered.wait(TIMEOUT)
        with httpx.Client(base_url=served.url, timeout=TIMEOUT / 4) as http:  # main: a ReadTimeout here
            small = http.post(path, json=body)
        assert small.status_code == status, small.text
        assert not release.is_set() and big.is_alive() and gate.waiting() == 0
    finally:
        release.set()
        big.join(TIMEOUT)
    assert answers["big"].status_code == status and answers["big"].json().keys() == small.json().keys()
    if status != 200:
        assert answers["big"].json() == small.json()
    refused = served.http.post(path, content="{" + padding, headers={"Content-Type": "application/json"})
    assert refused.status_code == 400 and refused.json()["error"]["message"] == (
        "the request body is not valid JSON: Expecting property name enclosed in double quotes: line 1 column "
        "100002 (char 100001)")
    _served_normally(served)


@pytest.mark.parametrize("name, bad, expected", [
    ("h11_max_incomplete_event_size", True, "an integer >= 1 or None"),
    ("h11_max_header_count", 0, "an integer >= 1 or None"),
    ("max_request_bytes", 2**63, "an integer >= 1 (bytes), or None for the default derived from max_seq_len"),
    ("max_concurrent_requests", 0, "an integer >= 1"),
    ("trust_request_chat_template", 1, "true or false"),
    ("enable_reset_prefix_cache", "yes", "true or false"),
    ("responses_store_max", -1, "an integer >= 0 (0: keep no responses)"),
])
def test_build_state_refuses_each_bad_argument_and_takes_its_edge_before_the_engine_is_read(name, bad, expected):
    """Each of build_state's argument checks, in one line naming the argument, before the loaded result is read
    (None here); the edge of each range passes on to the next check (a bad tool_call_parser's line)."""
    from kvload.serve.server import build_state
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"^{name}: expected {re.escape(expected)}, got "):
        build_state(None, **{name: bad})
    edges = {"h11_max_incomplete_event_size": 1, "h11_max_header_count": 1, "max_request_bytes": 2**63 - 1,
             "max_concurrent_requests": 1, "trust_request_chat_template": True, "enable_reset_prefix_cache": True,
             "responses_store_max": 0}
    with pytest.raises(ConfigError, match=r"^tool_call_parser: "):
        build_state(None, **edges, tool_call_parser="no-such-parser")
