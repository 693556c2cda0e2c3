"""``kvload serve --uds PATH`` (vLLM's flag, refused before): the server listens on a Unix domain socket instead of
TCP, OpenAI's client talks to it over the socket, the stop removes the socket file, and a path it must not use is
refused in one line before the model loads."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.cli_support import ENV, REPO, ready_url, reap, run_cli, until_ready
from tests.hostile_support import signals_as_a_terminal_gives_them


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A short directory for socket files: pytest's tmp_path can pass the 107 bytes a Unix socket path may have."""
    path = Path(tempfile.mkdtemp(prefix="kvl-uds-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _start(*flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvload", "serve", "tiny-llama", "--max_tokens", "256", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, cwd=REPO,
                            preexec_fn=signals_as_a_terminal_gives_them)


def _openai_over(path: Path, verify: ssl.SSLContext | None = None, max_retries: int = 2) -> openai.OpenAI:
    """OpenAI's client talking HTTP (HTTPS with ``verify``) over the Unix socket at ``path`` (httpx's ``uds``)."""
    transport = httpx.HTTPTransport(uds=str(path), **({"verify": verify} if verify is not None else {}))
    return openai.OpenAI(api_key="unused", base_url=f"{'https' if verify else 'http'}://localhost/v1",
                         http_client=httpx.Client(transport=transport, timeout=60), max_retries=max_retries)


def _stale_socket(path: Path) -> None:
    """What a killed server leaves: a socket file nothing listens on any more."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()


def test_uds_serves_the_openai_client_over_the_socket_and_sigterm_removes_it(sockdir):
    """A stale socket at PATH is replaced; the ready line names unix:PATH; --host and --port, given, are reported
    ignored (and --host 0.0.0.0 with no API key warns of nothing: no other machine reaches the socket); completions,
    streamed or not, answer over the socket; SIGTERM exits 0, no file left."""
    path = sockdir / "kv.sock"
    _stale_socket(path)
    proc = _start("--host", "0.0.0.0", "--port", "0", "--uds", str(path))
    try:
        lines = until_ready(proc)
        assert ready_url(lines[-1]) == f"unix:{path}", lines[-1]
        ignored = [line for line in lines if "setting_ignored" in line]
        assert any("field=--host" in line and "--uds" in line for line in ignored), lines
        assert any("field=--port" in line and "--uds" in line for line in ignored), lines
        assert not any("serve_without_api_key" in line for line in lines), lines
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        with _openai_over(path) as client:
            (model,) = [m.id for m in client.models.list()]
            done = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=3,
                                             extra_body={"ignore_eos": True})
            assert done.usage.completion_tokens == 3 and done.choices[0].finish_reason == "length"
            stream = client.completions.create(model=model, prompt=[9, 8, 7], max_tokens=4, stream=True,
                                               extra_body={"ignore_eos": True})
            assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
        proc.send_signal(signal.SIGTERM)  # what service managers send
        assert proc.wait(timeout=30) == 0
        assert not os.path.lexists(path), "the socket file was left behind"
        assert "Traceback" not in proc.stderr.read()
    finally:
        reap(proc)


def test_uds_with_the_ssl_flags_serves_https_over_the_socket_and_sigint_removes_it(sockdir):
    """uvicorn serves TLS over any socket it is given, vLLM's --uds with --ssl-* included: a client checking the
    certificate generates over the socket, plain HTTP there fails; Ctrl-C (SIGINT) exits 0, no file left."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate with")
    cert, key = sockdir / "cert.pem", sockdir / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True)
    path = sockdir / "tls.sock"
    proc = _start("--uds", str(path), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key))
    try:
        lines = until_ready(proc)
        assert ready_url(lines[-1]) == f"https+unix:{path}", lines[-1]
        assert not any("setting_ignored" in line and "--uds" in line for line in lines), lines  # no --host/--port given
        with _openai_over(path, verify=ssl.create_default_context(cafile=str(cert))) as client:
            done = client.completions.create(model="tiny-llama", prompt=[1, 2, 3], max_tokens=2)
            assert done.usage.completion_tokens == 2
        with pytest.raises(openai.APIConnectionError), _openai_over(path, max_retries=0) as plain:
            plain.models.list()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert not os.path.lexists(path)
    finally:
        reap(proc)


@pytest.mark.parametrize("case", ["no_directory", "regular_file", "directory", "live_server", "too_long", "empty"])
def test_a_uds_path_the_server_cannot_use_is_one_line_naming_it_and_nothing_is_touched(capsys, sockdir, case):
    path = sockdir / "kv.sock"
    live = None
    if case == "no_directory":
        path = sockdir / "missing" / "kv.sock"
    elif case == "regular_file":
        path.write_text("my notes\n")
    elif case == "directory":
        path.mkdir()
    elif case == "live_server":
        live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        live.bind(str(path))
        live.listen(1)
    elif case == "too_long":
        path = sockdir / ("s" * 120)
    said = {"no_directory": "does not exist; create it first", "regular_file": "is a regular file, not a socket",
            "directory": "is a directory, not a socket", "live_server": "a server is listening on it already",
            "too_long": "at most 107 bytes", "empty": "expected the path of a socket file"}[case]
    try:
        r = run_cli(capsys, "serve", "tiny-llama", "--uds", "" if case == "empty" else str(path))
        assert r.code == 2 and r.one_error_line and "--uds" in r.err and said in r.err, r.err
        if case == "regular_file":
            assert path.read_text() == "my notes\n"  # a user's file is never replaced
        if case == "live_server":
            assert stat.S_ISSOCK(os.stat(path).st_mode)  # the other server's socket is left alone
    finally:
        if live is not None:
            live.close()


def test_server_thread_takes_uds_as_kvload_serve_does(sockdir):
    """The in-process server (Python API, tests) takes ``uds=PATH`` with --uds's guarantees: a stale socket is
    replaced, OpenAI's client generates over the socket, a second server on the live socket, a user's file or a
    missing directory is a one-line ConfigError naming uds (nothing touched), host/port with uds is refused, and
    ``stop()`` removes the socket file."""
    import pipeline
    from kvload.serve.server import ServerThread, build_state
    from pipeline.errors import ConfigError

    path = sockdir / "thread.sock"
    _stale_socket(path)
    notes = sockdir / "notes.txt"
    notes.write_text("mine\n")
    result = pipeline.load("tiny-llama", load_weights=True, log=False, kv_cache_config={"max_tokens": 256})
    try:
        state = build_state(result)
        with pytest.raises(ConfigError, match=r"^uds .*: the server listens on that Unix socket only, so port=8000"):
            ServerThread(state, port=8000, uds=str(path))
        with ServerThread(state, uds=str(path)) as server:
            assert server.url == f"unix:{path}" and server.port is None
            assert stat.S_ISSOCK(os.stat(path).st_mode)
            with _openai_over(path) as client:
                done = client.completions.create(model="tiny-llama", prompt=[5, 6, 7], max_tokens=3,
                                                 extra_body={"ignore_eos": True})
                assert done.usage.completion_tokens == 3 and done.choices[0].finish_reason == "length"
                stream = client.completions.create(model="tiny-llama", prompt=[9, 8], max_tokens=2, stream=True,
                                                   extra_body={"ignore_eos": True})
                assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
                for taken, said in ((path, "a server is listening on it already"),
                                    (notes, "is a regular file, not a socket"),
                                    (sockdir / "gone" / "x.sock", "does not exist; create it first")):
                    with pytest.raises(ConfigError, match=r"^uds ") as refused:
                        ServerThread(state, uds=str(taken))
                    assert said in str(refused.value) and "\n" not in str(refused.value)
                assert client.models.list().data[0].id == "tiny-llama"  # the live server was left alone
            assert notes.read_text() == "mine\n"
        assert not os.path.lexists(path), "stop() left the socket file behind"
    finally:
        result.close()
