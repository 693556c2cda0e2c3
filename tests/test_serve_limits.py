"""``kvload serve`` against oversized input, over real sockets: a body past ``--max-request-bytes`` is a 413
refused before it is read (by its Content-Length, or as soon as a chunked one passes the cap), a body at the
cap is served, and the server keeps serving afterwards.

A refused body is never sent (or never finished) here: the server answering anyway is the proof that it did
not wait to read, let alone hold, the body it refused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve_support import TIMEOUT, serving

CAP = 4096
PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def served():
    with serving("tiny-llama", state={"max_request_bytes": CAP}) as s:
        yield s


def _raw(served, head: bytes, *body: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``head`` and ``body`` on a fresh connection, read until the server closes it: status, headers, body.

    One write, under uvicorn's 64 KiB read-ahead: the server has taken every byte off the socket when it answers
    and closes, so its close is a FIN, never a reset racing the answer (bytes arriving after a refusal would be).
    """
    with socket.create_connection(("127.0.0.1", served.server.port), timeout=TIMEOUT) as sock:
        sock.sendall(head + b"".join(body))
        data = b""
        while chunk := sock.recv(65536):  # a server waiting for the rest of the body times this out: no hang
            data += chunk
    head_text, _, payload = data.partition(b"\r\n\r\n")
    status_line, *lines = head_text.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    return int(status_line.split()[1]), headers, payload


def _post_head(extra: str) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{extra}\r\n"
            .encode())


def _assert_too_large(status, headers, payload, got: str) -> None:
    assert status == 413, payload
    assert headers["connection"] == "close"  # the rest of the body is never read
    error = json.loads(payload)["error"]
    assert error == {"message": f"the request body is too large: at most {CAP:,} bytes are accepted "
                                f"(--max-request-bytes sets it), got {got}",
                     "type": "invalid_request_error", "param": None, "code": "request_too_large"}


def _served_normally(served) -> None:
    assert served.http.get("/health").json() == {"status": "ok"}
    r = served.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3


@pytest.mark.parametrize("length", [CAP + 1, 90 * 2**20, 10**15])
def test_a_body_announced_past_the_cap_is_refused_before_a_byte_of_it_is_sent(served, length):
    _assert_too_large(*_raw(served, _post_head(f"Content-Length: {length}\r\n")), f"Content-Length {length:,}")
    _served_normally(served)


def test_a_chunked_body_is_refused_once_it_passes_the_cap_without_waiting_for_its_end(served):
    chunk = b'{"prompt": [' + b"1, " * 600  # never finished: no closing bracket, no last (empty) chunk
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    assert 2 * len(chunk) <= CAP < 3 * len(chunk)
    _assert_too_large(*_raw(served, _post_head("Transfer-Encoding: chunked\r\n"), framed, framed, framed),
                      f"more than {CAP:,} bytes sent")
    _served_normally(served)


def _padded(size: int) -> bytes:
    """A good completion request of exactly ``size`` bytes (JSON whitespace makes up the rest)."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_at_the_cap_is_served_and_one_byte_more_is_not(served, chunked):
    for size, status in ((CAP, 200), (CAP + 1, 413)):
        body = _padded(size)
        assert len(body) == size
        if chunked:
            half = size // 2
            parts = [b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:half], body[half:])] + [b"0\r\n\r\n"]
            got = _raw(served, _post_head("Transfer-Encoding: chunked\r\nConnection: close\r\n"), *parts)
        else:
            got = _raw(served, _post_head(f"Content-Length: {size}\r\nConnection: close\r\n"), body)
        assert got[0] == status, got
        if status == 200:
            assert len(json.loads(got[2])["choices"][0]["token_ids"]) == 2
    _served_normally(served)


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate, gzip"])
def test_a_compressed_body_is_a_415_naming_content_encoding_refused_unread(served, path, encoding):
    """A gzip body was read as JSON text: a 400 saying byte 0x8b is not UTF-8, which told the client nothing of the
    header it sent; the body is not read (never sent here: the answer is the proof)."""
    head = (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Encoding: {encoding}"
            "\r\nContent-Length: 100\r\n\r\n").encode()
    status, headers, payload = _raw(served, head)
    assert status == 415 and headers["connection"] == "close", payload
    assert json.loads(payload)["error"] == {
        "message": f"Content-Encoding {encoding!r}: not accepted; send the request body uncompressed (identity)",
        "type": "invalid_request_error", "param": None, "code": "unsupported_content_encoding"}
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()  # identity, said or not, is served
    for said in ("Content-Encoding: identity\r\n", ""):
        got = _raw(served, _post_head(f"{said}Content-Length: {len(body)}\r\nConnection: close\r\n"), body)
        assert got[0] == 200, got
    _served_normally(served)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages", "/tokenize"])
@pytest.mark.parametrize("media", ["text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x"])
def test_a_body_in_a_content_type_other_than_json_is_a_415_refused_unread(served, path, media):
    """Read as JSON whatever it said: a browser posts these three from any web page without a CORS preflight, so any
    site a user visited could run requests on their local server (vLLM refuses them too)."""
    head = f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: {media}\r\nContent-Length: 100\r\n\r\n".encode()
    status, headers, payload = _raw(served, head)
    assert status == 415 and headers["connection"] == "close", payload
    error = json.loads(payload)["error"]
    assert error["message"] == (f"Content-Type {media!r}: not accepted; send the request body as JSON "
                                "(Content-Type: application/json)")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()  # JSON, said in any spelling, or unsaid, is served
    for said in ("application/json; charset=utf-8", "application/vnd.x+json", None):
        head = _post_head(f"Content-Length: {len(body)}\r\nConnection: close\r\n")
        if said != "application/json":
            head = head.replace(b"application/json", said.encode()) if said else head.replace(
                b"Content-Type: application/json\r\n", b"")
        got = _raw(served, head, body)
        assert got[0] == 200, got
    _served_normally(served)


def test_logprobs_over_more_generated_tokens_than_a_request_may_keep_are_refused_before_anything_runs(served):
    """Each generated token's top log-probabilities are kept until the answer is sent: 1,024 choices of 8,191 tokens
    at logprobs=20 were tens of GB from one request (scored prompt tokens had this bound, generated ones none)."""
    from pipeline.limits import MAX_LOGPROB_TOKENS

    running = served.metrics()["kvload_num_requests_running"]
    body = {"prompt": [PROMPT] * 8, "n": 128, "max_tokens": MAX_LOGPROB_TOKENS // 1024 + 1, "logprobs": 1,
            "temperature": 1.0}
    r = served.http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    message = r.json()["error"]["message"]
    assert message.startswith("logprobs: every generated token's top log-probabilities are kept until the answer is "
                              f"sent; at most {MAX_LOGPROB_TOKENS:,} generated tokens per request with logprobs, and "
                              f"this one may generate {1024 * body['max_tokens']:,} (1,024 choices")
    assert served.metrics()["kvload_num_requests_running"] == running  # nothing queued
    small = served.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "logprobs": 1})
    assert small.status_code == 200 and len(small.json()["choices"][0]["logprobs"]["top_logprobs"]) == 2
    _served_normally(served)


def test_the_default_cap_takes_the_largest_request_of_token_ids_the_model_serves(served):
    """1024 prompts (MAX_PROMPTS) of max_seq_len - 1 token ids, each the widest id, as json.dumps writes them."""
    from kvload.serve.protocol import MAX_PROMPTS, default_max_request_bytes
    from kvload.serve.server import build_state

    ex = served.state.engine.executor
    cap = default_max_request_bytes(ex.max_seq_len, ex.vocab_size)
    prompt = json.dumps([ex.vocab_size - 1] * (ex.max_seq_len - 1))
    largest = len('{"model": "tiny-llama", "prompt": []}') + MAX_PROMPTS * (len(prompt) + 2)
    assert largest <= cap < 4 * largest  # room for text prompts (16 bytes a token), not an unbounded read
    other = build_state(served.result)
    try:
        assert other.max_request_bytes == cap
    finally:
        other.engine.stop()


@pytest.mark.parametrize("value", [0, -1, True, 2.5, "64MiB", 2**63])
def test_build_state_refuses_a_cap_that_is_not_a_positive_byte_count(served, value):
    from kvload.serve.server import build_state
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^max_request_bytes: expected an integer >= 1 \(bytes\)") as info:
        build_state(served.result, max_request_bytes=value)
    assert "\n" not in str(info.value)


# --- refusals in /metrics ----------------------------------------------------------------------------------------

REFUSED = "kvload_http_requests_refused_total"


def _refused(served) -> dict[str, float]:
    """``kvload_http_requests_refused_total`` by reason, parsed from /metrics."""
    prefix = f"{REFUSED}{{reason="
    return {k.removeprefix(prefix).removesuffix("}"): v for k, v in served.metrics().items() if k.startswith(prefix)}


def test_every_refusal_reason_is_a_series_from_the_start(served):
    from kvload.serve.metrics import REFUSAL_CODES, REFUSAL_REASONS

    # rate() over a reason never seen is 0, not absent
    assert set(_refused(served)) == {*REFUSAL_REASONS.values(), *REFUSAL_CODES.values()}
    assert served.metrics()["kvload_http_requests_in_flight"] == 0


def test_refusals_are_counted_by_reason_as_a_client_meets_them(served):
    before = _refused(served)
    assert _raw(served, _post_head(f"Content-Length: {CAP + 1}\r\n"))[0] == 413
    chunk = b'{"prompt": [' + b"1, " * 600
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    assert _raw(served, _post_head("Transfer-Encoding: chunked\r\n"), framed, framed, framed)[0] == 413
    bad = b'{"prompt": [1, 2'  # not JSON
    assert _raw(served, _post_head(f"Content-Length: {len(bad)}\r\nConnection: close\r\n"), bad)[0] == 400
    r = served.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 5})
    assert r.status_code == 400
    r = served.http.post("/v1/chat/completions", json={"model": "not-this-one",
                                                       "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert _raw(served, b"NOT HTTP AT ALL\r\n\r\n")[0] == 400  # uvicorn's own 400, below the app: counted too
    _served_normally(served)  # a request served is no refusal
    after = _refused(served)
    moved = {reason: after[reason] - before[reason] for reason in after if after[reason] != before[reason]}
    assert moved == {"too_large": 2, "bad_request": 3, "model_not_found": 1}


@pytest.mark.parametrize("sent, status, code, says", [
    (b"NOT HTTP AT ALL\r\n\r\n", 400, "invalid_http_request", "(illegal request line: 'NOT HTTP AT ALL')"),
    (b"GET /health HTTP/1.1\r\nHost: t\r\nBad Header: x\r\n\r\n", 400, "invalid_http_request",
     "(illegal header line: 'Bad Header: x')"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400,
     "invalid_http_request", "(conflicting Content-Length headers)"),
    (b"GET /health HTTP/1.1\r\n\r\n", 400, "invalid_http_request", "(Missing mandatory Host: header)"),
    # both lengths (RFC 9112 6.1: how requests are smuggled): refused at once, the connection closed, whichever
    # framing the body has (framed by its Content-Length, h11 read it as a chunk header and waited for the 408)
    *[(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nContent-Length: %d\r\n\r\n%s"
       % (len(body), body), 400, "invalid_http_request",
       "(both Transfer-Encoding and Content-Length given; send the body with one of them")
      for body in (b'{"prompt": [1], "max_tokens": 1}', b'20\r\n{"prompt": [1], "max_tokens": 1}\r\n0\r\n\r\n')],
    # an absolute-form target with no host (RFC 9110 4.2.1: to be rejected as invalid); with one it is served
    (b"GET http:///v1/models HTTP/1.1\r\nHost: t\r\n\r\n", 400, "invalid_http_request",
     "(the request target 'http:///v1/models' names no host; send the path alone (/v1/models) or a URL with a host)"),
    # a head still arriving past h11's limit (all of it sent, so the close is a FIN, not a reset)
    (b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 20_000, 431, "request_header_fields_too_large",
     "more than 16,384 bytes came without the blank line that ends the headers"),
])
def test_bytes_that_are_not_http_get_openais_error_body_counted(served, sent, status, code, says):
    """uvicorn answered these itself, below the app, in plain text ("Invalid HTTP request received."): a client
    reading OpenAI's error document got none, and what was wrong went unsaid; and it logged that line as a warning
    for each, which any client could repeat into the operator's log."""
    before = _refused(served)["bad_request"]
    with _warnings() as records:
        got, headers, payload = _raw(served, sent)
    assert [r.getMessage() for r in records] == []
    assert (got, headers["content-type"], headers["connection"]) == (status, "application/json", "close")
    error = json.loads(payload)["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, code)
    assert says in error["message"], error["message"]
    assert _refused(served)["bad_request"] == before + 1
    _served_normally(served)


@contextlib.contextmanager
def _warnings() -> Iterator[list[logging.LogRecord]]:
    """What uvicorn's error logger (which does not propagate to the root) logs at WARNING or above meanwhile."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_an_upgrade_request_is_answered_as_plain_http_without_warnings_in_the_operators_log(served):
    """uvicorn logged two warnings for each, one telling the operator to install a WebSocket library kvload never
    uses: any client could fill the log with them."""
    with _warnings() as records:
        for upgrade in ("websocket", "h2c"):
            got, _, payload = _raw(served, f"GET /health HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, close\r\n"
                                           f"Upgrade: {upgrade}\r\nSec-WebSocket-Key: AAAAAAAAAAAAAAAAAAAAAA==\r\n"
                                           "Sec-WebSocket-Version: 13\r\n\r\n".encode())
            assert (got, json.loads(payload)) == (200, {"status": "ok"})
    assert [r.getMessage() for r in records] == []


@pytest.mark.parametrize("target, host", [
    ("http://127.0.0.1:{port}/v1/models", "Host: 127.0.0.1:{port}\r\n"),
    ("HTTP://proxy.example/v1/models?limit=1", "Host: 127.0.0.1:{port}\r\n"),  # the target's host, not Host's
    ("https://user@proxy.example:8443/v1/models", "Host: t\r\n"),
])
def test_an_absolute_form_request_target_is_served_as_its_path(served, target, host):
    """RFC 9112 3.2.2: a server MUST accept a request target in absolute form (a client configured with the server as
    its proxy sends one). uvicorn took the whole URL for the path: every such request was a 404 "no such endpoint"."""
    port = served.server.port
    head = f"GET {target} HTTP/1.1\r\n{host}Connection: close\r\n\r\n".format(port=port)
    got, _, payload = _raw(served, head.encode())
    assert got == 200, payload
    assert [card["id"] for card in json.loads(payload)["data"]] == ["tiny-llama"]
    body = json.dumps({"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}).encode()
    head = (f"POST http://127.0.0.1:{port}/v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")  # HTTP/1.0: no Host header, the target's host stands for it
    got, _, payload = _raw(served, head.encode(), body)
    assert got == 200, payload
    assert len(json.loads(payload)["choices"][0]["token_ids"]) == 3


@pytest.mark.parametrize("headers, code", [
    ("Content-Encoding: identity\r\nContent-Encoding: gzip\r\n", "unsupported_content_encoding"),
    ("Content-Type: text/plain\r\n", "unsupported_media_type"),  # after _post_head's application/json
])
def test_a_header_given_twice_is_read_whole_not_by_its_first_field(served, headers, code):
    """The first field alone was read: a gzip body sent after "Content-Encoding: identity" was parsed as JSON text
    (a 400 saying it is not UTF-8), and a text/plain after application/json passed as JSON."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
    status, _, payload = _raw(served, _post_head(f"Content-Length: {len(body)}\r\n{headers}"), body)
    assert status == 415 and json.loads(payload)["error"]["code"] == code, payload


def test_a_refusal_s_reason_follows_its_status_and_a_server_failure_is_no_refusal():
    from kvload.serve.metrics import ServeMetrics

    m = ServeMetrics("m")
    for status in (413, 413, 408, 503, 404, 400, 401, 418, 500, 200):
        m.on_refused(status)
    m.on_refused(503, "server_shutting_down")  # a 503 while the server stops is not a busy server
    m.on_refused(503, "server_busy")
    m.on_refused(404, "previous_response_not_found")  # a 404 for a response no longer kept: no model_not_found
    got = {s.labels["reason"]: s.value for f in text_string_to_metric_families(m.render().decode())
           for s in f.samples if s.name == REFUSED}
    assert got == {"too_large": 2, "read_timeout": 1, "busy": 2, "model_not_found": 1, "bad_request": 2,
                   "shutting_down": 1, "unauthorized": 1, "response_not_found": 1}


def test_prompt_tokens_count_prompts_that_were_processed_and_every_finish_reason_starts_at_zero():
    from engine.sampling_params import SamplingParams
    from engine.serving import FinishedRequest
    from kvload.serve.metrics import FINISH_REASONS, ServeMetrics

    m = ServeMetrics("m")

    def samples() -> dict[str, float]:
        return {s.name + "".join(f"{{{v}}}" for k, v in s.labels.items() if k == "finished_reason"): s.value
                for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}

    start = samples()
    # a scraper's rate() needs each series before its first increase, as vLLM exposes them
    assert {f"kvload_request_success_total{{{r}}}" for r in FINISH_REASONS} <= set(start)
    params = SamplingParams(max_tokens=5)
    # aborted while it waited: never scheduled, its prompt never processed
    m.on_finished(FinishedRequest(40, 0, 0, "abort", params, 0, 1, 0.0, None, ()))
    m.on_finished(FinishedRequest(30, 5, 0, "length", params, 0, 1, 0.0, 0.05, (0.2, 0.21, 0.22, 0.23, 0.24)))
    after = samples()
    assert after["kvload_prompt_tokens_total"] == 30
    assert after["kvload_request_success_total{abort}"] == after["kvload_request_success_total{length}"] == 1
    # the request histograms count the one that was processed, the inter-token intervals its four
    assert after["kvload_request_prompt_tokens_count"] == after["kvload_request_queue_time_seconds_count"] == 1
    assert after["kvload_inter_token_latency_seconds_count"] == 4


@pytest.mark.parametrize("size", [17_000, 200_000, 4_000_000])
def test_a_head_past_the_limit_is_a_431_naming_it_however_it_arrives_never_a_reset(served, size):
    """A whole head past 16 KiB that came in one read (up to ~256 KiB on loopback) was served, as h11 limits only a
    head still arriving; a larger one was refused and the connection closed with the rest unread: the kernel reset
    it, and the client got ``Connection reset by peer`` instead of the 431. Now every such head is a 431 naming the
    limit and its flag, its client's remaining bytes read and dropped before the close."""
    before = _refused(served)["bad_request"]
    got, headers, payload = _raw(served, b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * size + b"\r\n\r\n")
    assert (got, headers["content-type"], headers["connection"]) == (431, "application/json", "close")
    error = json.loads(payload)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "request_header_fields_too_large")
    assert "at most 16,384 are taken (--h11-max-incomplete-event-size sets it)" in error["message"], error["message"]
    assert _refused(served)["bad_request"] == before + 1
    _served_normally(served)


def test_a_head_at_the_limit_is_served(served):
    head = b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\nX-Big: "
    pad = 16_384 - len(head) - len(b"\r\n\r\n")
    got, _, payload = _raw(served, head + b"a" * pad + b"\r\n\r\n")
    assert (got, json.loads(payload)) == (200, {"status": "ok"})


@pytest.mark.parametrize("head, status", [
    (b"HEAD /v1/models HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 60_000 + b"\r\n\r\n", 431),
    (b"HEAD /health HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nContent-Length: 0\r\n\r\n", 400),
    (b"HEAD /v1/models HTTP/1.2\r\nHost: t\r\n\r\n", 505)])
def test_a_refused_head_request_is_answered_headers_only_and_logs_no_failure(served, head, status, caplog):
    """A HEAD request refused below the app (a head past the limit, both lengths, another HTTP version) was
    answered with the status line and then dropped: its error body is no HEAD answer's, h11 refused it, and asyncio
    logged "Fatal error: protocol.data_received() call failed" with a traceback, a line any client could cause."""
    with caplog.at_level(logging.WARNING):
        got, headers, payload = _raw(served, head)
    assert (got, headers["content-type"], headers["connection"], payload) == (status, "application/json", "close",
                                                                              b"")
    assert int(headers["content-length"]) > 0  # what the GET's body would be, as HEAD says
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    _served_normally(served)
