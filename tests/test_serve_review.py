"""``kvload serve`` at the edges the admission limits opened, over real sockets: bytes that are not HTTP after an
answer that left its body unread, a stop asked for while requests wait to be parsed or their bodies still arrive,
and a request submitted as the engine stops.

Each test failed before its fix: a fatal-protocol-error traceback and a refusal counted for a client already
answered; 500s ("GenerationError: the engine is shutting down", or uvicorn's plain-text one after its graceful
timeout) with "Exception in ASGI application" tracebacks; a request queued after the engine's last drain, never
ended. No test asserts how long anything took: a held hook gives up after ``TIMEOUT``, so a failure is not a hang.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import threading
from collections.abc import Iterator

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import pipeline
from tests.serve_support import TIMEOUT, Served, fails_once, held_at_step, serving, wait_for

PROMPT = [3, 1, 4, 1, 5]


def _assert_shutting_down(answer: bytes) -> None:
    """A raw HTTP answer is OpenAI's 503 ``server_shutting_down``, closing the connection."""
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"connection: close" in head.lower(), answer
    assert json.loads(payload) == {"error": {
        "message": "the server is shutting down and takes no new requests; retry on another server",
        "type": "server_error", "param": None, "code": "server_shutting_down"}}


class _Errors(logging.Handler):
    """Records at ERROR or above (uvicorn's "Exception in ASGI application", asyncio's fatal protocol errors)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _logged_errors() -> Iterator[list[logging.LogRecord]]:
    """What the server logs at ERROR meanwhile; uvicorn's loggers do not propagate to the root, so each is joined."""
    handler = _Errors()
    loggers = [logging.getLogger(name) for name in ("asyncio", "uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


@contextlib.contextmanager
def _stream_held_at_step(served: Served,
                         entered: threading.Event) -> Iterator[tuple[list[logging.LogRecord], Iterator[str]]]:
    """A 50-token completion streamed until its first chunk is out and the engine is held at the step ``entered``
    marks (:func:`held_at_step`); yields what the server logs at ERROR meanwhile and the stream's remaining lines."""
    body = {"prompt": PROMPT, "max_tokens": 50, "ignore_eos": True, "stream": True}
    with _logged_errors() as errors, httpx.Client(base_url=served.url, timeout=TIMEOUT) as http, \
            http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")) != "data: [DONE]"
        assert entered.wait(TIMEOUT)
        yield errors, lines


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)


def _read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length (the connection may stay open)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return data


def _read_to_close(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):  # a server that never closes times this out: the test fails, never hangs
            data += chunk
    except ConnectionResetError:  # closed with bytes we sent unread (an answer with Connection: close): closed too
        pass
    return data


def _post(body: bytes, path: bytes = b"/v1/completions") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (path, len(body), body))


# --- bytes after an answer that left the body unread ---------------------------------------------------------

BAD_REQUEST = "kvload_http_requests_refused_total{reason=bad_request}"


@pytest.fixture(scope="module")
def one_slot():
    with serving("tiny-llama", state={"max_concurrent_requests": 1}) as s:
        yield s


@pytest.mark.parametrize("path", ["/v1/completions", "/health"])
def test_bad_chunk_framing_after_an_answer_that_left_the_body_unread_closes_quietly(one_slot, path):
    """A 503 (past --max-concurrent-requests) or a 405 answers before the body is read; uvicorn then parses the
    rest of the body to drop it. Framing it cannot parse made it try a second response (its 400), which h11
    refused mid-callback: asyncio logged a fatal protocol error with a traceback, and the refusal was counted
    although the client never saw it."""
    port = one_slot.server.port
    held = _connect(port)
    try:
        if path == "/v1/completions":  # the one slot taken by a body that never finishes
            held.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{"prompt": [1, ')
            wait_for(lambda: one_slot.state.in_flight == 1, what="the slot held")
        before = one_slot.metrics()[BAD_REQUEST]
        with _logged_errors() as errors, _connect(port) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{{}}\r\n".encode())
            answer = _read_response(sock)
            assert answer.startswith(b"HTTP/1.1 503 " if path == "/v1/completions" else b"HTTP/1.1 405 "), answer
            sock.sendall(b"not-a-chunk-size\r\n\r\n")  # where the next chunk's size belongs
            assert _read_to_close(sock) == b""  # closed, and no second answer
        assert [r.getMessage() for r in errors] == []
        assert one_slot.metrics()[BAD_REQUEST] == before  # the client was refused once, as counted already
    finally:
        held.close()
    wait_for(lambda: one_slot.state.in_flight == 0, what="the slot freed")
    r = one_slot.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2


# --- a stop asked for while requests wait to be parsed ---------------------------------------------------------


def test_requests_waiting_to_be_parsed_when_the_server_stops_get_one_clear_503():
    """One request held mid-tokenization, two more (one streaming) queued behind it for the parsing worker, then a
    stop (what SIGTERM does: the engine told first, then uvicorn). Each gets OpenAI's 503 naming the shutdown, no
    traceback is logged, nothing is left in flight, and the server thread ends."""
    with serving("tiny-llama") as served:
        engine = served.state.engine
        entered, release = threading.Event(), threading.Event()
        encode = engine.encode

        def held_encode(prompt, **kw):
            if not entered.is_set():
                entered.set()
                release.wait(TIMEOUT)
            return encode(prompt, **kw)

        engine.encode = held_encode
        socks = []
        try:
            with _logged_errors() as errors:
                for stream in (False, True, False):
                    body = json.dumps({"prompt": PROMPT, "max_tokens": 50, "ignore_eos": True, "stream": stream})
                    sock = _connect(served.server.port)
                    sock.sendall(_post(body.encode()))
                    socks.append(sock)
                    assert entered.wait(TIMEOUT)
                wait_for(lambda: served.state.in_flight == 3, what="three requests in the server")
                stopper = threading.Thread(target=served.server.stop)
                stopper.start()
                wait_for(lambda: engine.stopping, what="the stop asked for")
                release.set()  # the held request carries on, now that the server is stopping
                answers = [_read_to_close(sock) for sock in socks]
                stopper.join(TIMEOUT)
                assert not stopper.is_alive() and not served.server.thread.is_alive()
            for answer in answers:
                _assert_shutting_down(answer)
            assert [r.getMessage() for r in errors] == []
            assert served.state.in_flight == 0
            # counted as refused while stopping, not as a busy server (an alert on busy fires on real overload only)
            refused = {s.labels["reason"]: s.value
                       for family in text_string_to_metric_families(served.state.metrics.render().decode())
                       for s in family.samples if s.name == "kvload_http_requests_refused_total"}
            assert refused["shutting_down"] == 3 and refused["busy"] == 0
        finally:
            release.set()
            engine.encode = encode
            for sock in socks:
                sock.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_request_being_parsed_when_the_server_stops_gets_a_503_at_once(path):
    """A big body's parse runs on a worker thread for seconds (100 MB of token ids: about 7); a stop meanwhile
    waited for it past uvicorn's graceful timeout, then cancelled the handler: uvicorn's plain-text 500, never
    OpenAI's error body. It is answered the stop's 503 at once; the worker ends its parse for no one."""
    with serving("tiny-llama") as served:
        served.server.server.config.timeout_graceful_shutdown = 0.5  # a failure is a 500 soon, not in 5 s
        engine = served.state.engine
        entered, release = threading.Event(), threading.Event()
        held_name = "encode" if path == "/v1/completions" else "tokenize"
        original = getattr(engine, held_name)

        def held(*args, **kw):  # a parse that takes long
            entered.set()
            release.wait(TIMEOUT)
            return original(*args, **kw)

        setattr(engine, held_name, held)
        body = json.dumps({"prompt": PROMPT, "max_tokens": 4} if path == "/v1/completions" else {"prompt": "hi"})
        try:
            with _logged_errors() as errors, _connect(served.server.port) as sock:
                sock.sendall(_post(body.encode(), path.encode()))
                assert entered.wait(TIMEOUT)
                stopper = threading.Thread(target=served.server.stop)
                stopper.start()
                answer = _read_to_close(sock)
                release.set()
                stopper.join(TIMEOUT)
                assert not stopper.is_alive() and not served.server.thread.is_alive()
            _assert_shutting_down(answer)
            assert [r.getMessage() for r in errors] == []
            assert served.state.in_flight == 0
        finally:
            release.set()
            delattr(engine, held_name)


def test_a_stop_during_a_parse_that_goes_on_ends_the_server_without_waiting_for_it():
    """The 503 went out at once, but the parse ran on asyncio's default executor, which ``asyncio.run`` joins when
    the server's loop ends: ``kvload serve`` stopped while an 80 MB prompt was encoded (minutes on one core) stayed
    up, its audit unpublished, until the encode ended (the sweep's SIGINT waited past 120 s). The server's thread
    now ends while the parse is still held."""
    with serving("tiny-llama") as served:
        engine = served.state.engine
        entered, release = threading.Event(), threading.Event()
        original = engine.encode

        def held(*args, **kw):  # an encode that outlasts the stop
            entered.set()
            release.wait(TIMEOUT)
            return original(*args, **kw)

        engine.encode = held
        try:
            with _connect(served.server.port) as sock:
                sock.sendall(_post(json.dumps({"prompt": PROMPT, "max_tokens": 4}).encode()))
                assert entered.wait(TIMEOUT)
                answer = _stop_and_read(served, sock)  # the parse is still held: the stop must not wait for it
                assert not release.is_set()
            _assert_shutting_down(answer)
        finally:
            release.set()
            del engine.encode


def _stop_and_read(served: Served, sock: socket.socket) -> bytes:
    """Stop the server while ``sock``'s request is part-sent: what the client reads until the close; the stop (and the
    server's thread) must end within ``TIMEOUT``."""
    stopper = threading.Thread(target=served.server.stop)
    stopper.start()
    answer = _read_to_close(sock)
    stopper.join(TIMEOUT)
    assert not stopper.is_alive() and not served.server.thread.is_alive()
    return answer


def test_a_body_still_arriving_when_the_server_stops_gets_a_503_at_once():
    """The stop waited out uvicorn's graceful timeout (5 s) for the rest of the body, then cancelled the handler:
    "Exception in ASGI application" with a CancelledError traceback, and uvicorn's plain-text 500."""
    with serving("tiny-llama") as served:
        body = json.dumps({"prompt": PROMPT, "max_tokens": 4}).encode()
        with _logged_errors() as errors, _connect(served.server.port) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:5]))
            wait_for(lambda: served.state.in_flight == 1, what="the upload in flight")
            answer = _stop_and_read(served, sock)
        _assert_shutting_down(answer)
        assert [r.getMessage() for r in errors] == []
        assert served.state.in_flight == 0


def _refused_shutting_down(served: Served) -> float:
    """``kvload_http_requests_refused_total{reason="shutting_down"}``, from the metrics (the server may be gone)."""
    text = served.state.metrics.render().decode()
    return next(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                if sample.name == "kvload_http_requests_refused_total" and sample.labels["reason"] == "shutting_down")


def test_a_head_still_arriving_when_the_server_stops_gets_the_same_503():
    """A client part-way through a request's headers when the server stopped had its connection closed with no
    answer, where one part-way through the body gets 503 server_shutting_down; it gets that 503 too, counted."""
    with serving("tiny-llama") as served:
        before = _refused_shutting_down(served)
        with _logged_errors() as errors, _connect(served.server.port) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Ty")
            wait_for(lambda: any(c.conn.trailing_data[0] for c in served.server.server.server_state.connections),
                     what="the partial head read")
            answer = _stop_and_read(served, sock)
        _assert_shutting_down(answer)
        assert [r.getMessage() for r in errors] == []
        assert _refused_shutting_down(served) == before + 1


def test_a_second_stop_signal_still_ends_each_stream_with_its_last_chunk_and_done():
    """Ctrl-C pressed twice (or SIGINT then SIGTERM) while a stream waited on a step: the second signal was uvicorn's
    "force quit", which skipped waiting for open answers and cancelled their handlers, so the client read a chunked
    body cut short and the log an "Exception in ASGI application" CancelledError traceback. The first stop already
    ends every request at once, so the stream gets its last chunk (``finish_reason: "abort"``) and ``[DONE]``."""
    import signal

    # the third step waits: a long step on a big model
    with serving("tiny-llama") as served, held_at_step(served, 3) as (entered, release):
        with _stream_held_at_step(served, entered) as (errors, lines):
            for sig in (signal.SIGINT, signal.SIGINT):  # what serve()'s handler gets for each
                served.server.server.handle_exit(sig, None)
            served.server.thread.join(0.5)  # a forced exit ends the server now, cutting the stream
            release.set()
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        assert [r.getMessage() for r in errors] == []
        served.server.thread.join(TIMEOUT)
        assert not served.server.thread.is_alive()


def test_a_stream_still_waiting_on_a_step_when_the_graceful_timeout_ends_logs_no_traceback():
    """A step longer than the stop's graceful timeout (a long prefill on a big model): uvicorn cancels the stream's
    handler, as it must to stop, and said so in one line, then logged "Exception in ASGI application" with a
    CancelledError traceback for each such request. Now its one line is all the log holds, and the server ends."""
    # the second step outlasts the graceful timeout
    with serving("tiny-llama") as served, held_at_step(served, 2) as (entered, _):
        served.server.server.config.timeout_graceful_shutdown = 0.2  # uvicorn reads it when the stop comes
        with _stream_held_at_step(served, entered) as (errors, lines):
            served.server.server.handle_exit(15, None)  # SIGTERM
            served.server.thread.join(TIMEOUT)
            assert not served.server.thread.is_alive()
            with pytest.raises(httpx.RemoteProtocolError):  # cut: the stop could wait no longer
                list(lines)
        assert [(r.getMessage(), r.exc_info) for r in errors] == [
            ("Cancel 1 running task(s), timeout graceful shutdown exceeded", None)]


def test_a_client_gone_mid_burst_leaves_no_warning_per_chunk_in_the_log(caplog):
    """A stream's chunks written to a socket the client had reset: the first send failed and closed the transport,
    but uvicorn stops writing only once told on a later turn of the loop, so each chunk of the burst (16 choices
    of a step) was written to the dead socket and asyncio warned "socket.send() raised exception." for each past
    the fourth. A client that hangs up is no news for the operator's log; its request still ends, its blocks freed.

    Deterministic: the loop is held while the client resets and the engine posts its step, so the burst is written
    before the loop reads the reset, as a burst already under way meets a client leaving."""
    with serving("tiny-llama") as served:
        executor, loop = served.state.engine.executor, served.server.server.servers[0].get_loop()
        forward = executor.forward_scored
        entered, release, stepped, calls = threading.Event(), threading.Event(), threading.Event(), []

        def held_forward(*args, **kw):
            calls.append(None)
            if len(calls) == 3:
                entered.set()
                release.wait(TIMEOUT)
            if len(calls) == 4:
                stepped.set()  # step 3's events are posted to the loop before step 4 runs
            return forward(*args, **kw)

        executor.forward_scored = held_forward
        looping, unhold = threading.Event(), threading.Event()
        body = json.dumps({"prompt": PROMPT, "max_tokens": 50, "ignore_eos": True, "stream": True, "n": 16})
        try:
            with caplog.at_level(logging.WARNING, logger="asyncio"):
                sock = _connect(served.server.port)
                sock.sendall(_post(body.encode()))
                got = b""
                while b"data: " not in got:  # the stream is under way (a server that sends nothing times this out)
                    got += sock.recv(65536)
                assert entered.wait(TIMEOUT)
                loop.call_soon_threadsafe(lambda: (looping.set(), unhold.wait(TIMEOUT)))
                assert looping.wait(TIMEOUT)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()  # a reset: the server's next send fails
                release.set()
                assert stepped.wait(TIMEOUT)
                unhold.set()
                wait_for(lambda: served.state.in_flight == 0, what="the request ended")
            assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
            wait_for(lambda: served.metrics()["kvload_num_requests_running"] == 0, what="its choices aborted")
            assert served.metrics()['kvload_kv_cache_blocks{layer_group=uniform,state=used}'] == 0
        finally:
            release.set()
            unhold.set()
            executor.forward_scored = forward


def test_a_request_submitted_as_the_engine_stops_is_refused_not_queued_after_the_last_drain():
    """``submit`` checked for a stop before its checks and queued after them: a loop that ended meanwhile had
    drained its inbox for the last time, so the request was queued for no one and its client waited forever."""
    from engine.sampling_params import SamplingParams
    from engine.serving import EngineStopped, ServingEngine

    result = pipeline.load("tiny-llama", load_weights=True, log=False, kv_cache_config={"max_tokens": 2048})
    engine = ServingEngine.from_result(result)
    try:
        engine.start()
        check = engine._check  # what submit checks through

        def check_then_stop(ids, params, notes, **kw):
            request = check(ids, params, notes, **kw)
            engine.stop(TIMEOUT)  # the loop ends, aborting what it holds and draining the inbox, mid-submit
            assert not engine.alive
            return request

        engine._check = check_then_stop
        events = []
        with pytest.raises(EngineStopped, match="^the engine is shutting down$"):
            engine.submit(PROMPT, SamplingParams(max_tokens=2), events.append)
        assert engine._inbox == [] and events == []  # nothing left queued that no loop will ever end
    finally:
        engine.stop(TIMEOUT)
        result.close()


# --- the engine failing ------------------------------------------------------------------------------------------


@pytest.fixture
def broken_server():
    """A server of its own: these tests break its engine."""
    with serving("tiny-llama", kv_cache_config={"max_tokens": 1024, "use_kv_cache_manager_v2": True}) as s:
        yield s


def _audit(served) -> list[dict]:
    return [json.loads(line) for line in served.http.get("/v1/kvload/audit").text.splitlines()]


def test_a_step_the_device_fails_is_a_500_naming_it_one_error_record_and_the_connection_serves_on(broken_server,
                                                                                                 monkeypatch):
    """A forward that runs out of device memory fails the requests of its step (a failing machine, not a bad
    request). The client got a 500, but the app raised it on to uvicorn: "Exception in ASGI application" with a
    traceback of that re-raise (nothing of the failure itself), and uvicorn closed the keep-alive connection under the
    client. A stream's failure left the operator's log nothing at all. Now: the 500 in OpenAI's body, no traceback, the
    connection serves on, and one ``engine_step_failed`` record (level error) names the failure; the blocks are free."""
    served = broken_server
    engine = served.state.engine
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    fails_once(monkeypatch, engine.executor, "forward_scored", oom)
    with _logged_errors() as errors:
        r = served.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 500, r.text
        assert r.json() == {"error": {"message": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
                                      "type": "server_error", "param": None, "code": None}}
        again = served.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
        assert again.status_code == 200 and len(again.json()["choices"][0]["token_ids"]) == 3
    assert [r.getMessage() for r in errors] == []
    failed = [r for r in _audit(served) if r["event"] == "engine_step_failed"]
    assert [{k: r[k] for k in ("level", "error", "message", "requests")} for r in failed] == [
        {"level": "error", "error": "OutOfMemoryError", "message": "CUDA out of memory. Tried to allocate 2.00 GiB",
         "requests": 1}]
    manager = served.result.kv_manager
    manager.check_invariants()
    assert all(g.used == 0 for g in manager.stats().groups.values())


def test_requests_after_the_engine_loop_died_are_answered_at_once_not_left_waiting(broken_server, monkeypatch):
    """A failure in the loop's own code (outside a step) ends the loop thread: the requests it held were failed and
    /health says "down", but a request sent afterwards was queued for a loop that no longer ran and its client waited
    for ever (the openai client's default timeout is 10 minutes). Now it is answered at once: a 500 naming the
    failure, and it holds no slot."""
    served = broken_server
    engine = served.state.engine
    fails_once(monkeypatch, engine, "_collect", RuntimeError("injected: the loop's own code failed"))
    r = served.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    assert r.status_code == 500 and "injected: the loop's own code failed" in r.json()["error"]["message"]
    wait_for(lambda: not engine.alive, TIMEOUT, "the loop thread's end")
    with httpx.Client(base_url=served.url, timeout=TIMEOUT) as http:  # a hang fails here (ReadTimeout), never waits
        assert http.get("/health").status_code == 503
        for body in ({"prompt": PROMPT, "max_tokens": 3}, {"prompt": PROMPT, "max_tokens": 3, "stream": True}):
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 500, r.text
            assert r.json()["error"] == {
                "message": "the engine loop stopped after a failure (RuntimeError: injected: the loop's own code "
                           "failed) and serves no more requests; /health reports it; restart the server",
                "type": "server_error", "param": None, "code": None}
    assert engine._inbox == []
    wait_for(lambda: served.state.in_flight == 0, TIMEOUT, "no request in flight")  # freed as each answer ends
    # one error record names it (the thread's traceback is no longer printed; kvload serve exits on it, and an
    # in-process ServerThread serves on with /health 503, as above)
    failed = [r for r in _audit(served) if r["event"] == "engine_loop_failed"]
    assert [{k: r[k] for k in ("level", "error", "message", "requests")} for r in failed] == [
        {"level": "error", "error": "RuntimeError", "message": "injected: the loop's own code failed", "requests": 1}]
    assert isinstance(engine.loop_exception, RuntimeError)
