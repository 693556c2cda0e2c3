"""vLLM's rarer ``vllm serve`` front-end flags, which were "unrecognized arguments" (exit 2): those kvload serve can
honour act (``--enable-request-id-headers``, ``--h11-max-incomplete-event-size``, ``--h11-max-header-count``), a
no-op value is taken (``--api-server-count 1``), logging knobs are ``setting_ignored``, the rest refused in one line."""

from __future__ import annotations

import contextlib
import re
import socket
import time

import pytest

from tests.cli_support import run_cli, served_with
from tests.serve_support import serving

PROMPT = [5, 17, 300, 42]


def test_request_id_headers_carry_the_requests_own_or_a_fresh_one():
    with serving(state={"request_id_headers": True}) as s:
        raw = s.client.completions.with_raw_response.create(model=s.state.model_name, prompt=PROMPT, max_tokens=2,
                                                             extra_headers={"X-Request-Id": "trace-42"})
        assert raw.headers["x-request-id"] == "trace-42"
        fresh = s.http.get("/v1/models")
        assert re.fullmatch(r"[0-9a-f]{32}", fresh.headers["x-request-id"]), fresh.headers
        refused = s.http.post("/v1/completions", json={"model": "nope", "prompt": PROMPT},
                              headers={"X-Request-Id": "r1"})
        assert refused.status_code == 404 and refused.headers["x-request-id"] == "r1"  # an error answer carries it too
    with serving() as s:  # off by default, as vLLM's
        assert "x-request-id" not in s.http.get("/v1/models").headers


def _raw(port: int, head: bytes) -> bytes:
    """The answer to ``head`` sent as a slow client sends it: all but its blank line, then that (h11 bounds a head
    that has not all arrived; one read holding a whole head is parsed whatever its size, in vLLM too)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head[:-2])
        time.sleep(0.3)
        with contextlib.suppress(OSError):  # refused already: the server may have closed
            sock.sendall(head[-2:])
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data


def test_the_h11_limits_bound_a_request_head():
    """A head past --h11-max-incomplete-event-size bytes, or with more than --h11-max-header-count headers, is HTTP
    431 in OpenAI's error body; smaller ones are served as before."""
    pad = b"X-Pad: " + b"a" * 3000 + b"\r\n"
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(12))
    with serving(state={"h11_max_incomplete_event_size": 2048, "h11_max_header_count": 10}) as s:
        port = s.server.port
        big = _raw(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + pad + b"Connection: close\r\n\r\n")
        assert big.startswith(b"HTTP/1.1 431"), big[:200]
        counted = _raw(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + many + b"Connection: close\r\n\r\n")
        assert counted.startswith(b"HTTP/1.1 431") and b"too many headers: 14 came, at most 10" in counted, counted
        ok = _raw(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200"), ok[:200]
    with serving() as s:  # the defaults: uvicorn's 16 KiB head, no count
        port = s.server.port
        assert _raw(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + pad + many + b"Connection: close\r\n\r\n"
                    ).startswith(b"HTTP/1.1 200")


def test_serve_hands_the_flags_to_the_server_and_takes_one_api_server(monkeypatch, log):
    seen = served_with(monkeypatch, "--enable-request-id-headers", "--h11-max-incomplete-event-size", "4096",
                       "--h11-max-header-count", "64", "--api-server-count", "1", "--enable-log-outputs",
                       "--log-error-stack")
    assert (seen["request_id_headers"], seen["h11_max_incomplete_event_size"], seen["h11_max_header_count"]) == (
        True, 4096, 64)
    ignored = {e["field"] for e in log.events if e.get("event") == "setting_ignored"}
    assert {"--enable-log-outputs", "--log-error-stack"} <= ignored and "--api-server-count" not in ignored


@pytest.mark.parametrize(("argv", "line"), [
    (["--api-server-count", "4"], "error: --api-server-count: kvload serve runs one HTTP front end in its process"),
    (["--middleware", "my.module.Middleware"], "error: --middleware: kvload serve imports no code named on its "
                                               "command line"),
    (["--h11-max-header-count", "0"], "--h11-max-header-count: expected an integer >= 1"),
])
def test_a_front_end_flag_kvload_cannot_honour_is_one_line(capsys, argv, line):
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", *argv)
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1 and line in r.err, r.err
