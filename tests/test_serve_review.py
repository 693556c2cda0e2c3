"""``kvload serve`` at the edges the admission limits opened, over real sockets: bytes that are not HTTP after an
answer that left its body unread.

Each test failed before its fix: a fatal-protocol-error traceback and a refusal counted for a client already
answered. No test asserts how long anything took.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterator

import pytest

from tests.serve_support import TIMEOUT, serving, wait_for

PROMPT = [3, 1, 4, 1, 5]


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
    while chunk := sock.recv(65536):  # a server that never closes times this out: the test fails, never hangs
        data += chunk
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
