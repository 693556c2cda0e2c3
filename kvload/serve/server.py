"""Running the app: build engine + metrics over a loaded result, bind a socket, serve with uvicorn.

:func:`serve` blocks until SIGINT/SIGTERM (uvicorn's own handling), then stops the engine.
:class:`ServerThread` runs the same server in a background thread (tests, ``bench_serve``).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from typing import Any

import uvicorn

from engine.serving import ServingEngine
from kvload.serve.app import ServeState, create_app
from kvload.serve.command import AUDIT_KEEP_DEFAULT
from kvload.serve.metrics import ServeMetrics
from kvload.serve.protocol import default_max_request_bytes
from pipeline.errors import ConfigError
from pipeline.limits import MAX_INT, short


def build_state(result: Any, *, model_name: str | None = None, default_max_tokens: int = 256,
                audit_keep: int = AUDIT_KEEP_DEFAULT, max_request_bytes: int | None = None) -> ServeState:
    """Engine (not started) and metrics over a ``load(..., load_weights=True)`` result; from now on its audit log
    keeps the load's records and the newest ``audit_keep`` (``/v1/kvload/audit`` serves them). A request body
    over ``max_request_bytes`` is refused unread (None: :func:`default_max_request_bytes` of the model)."""
    if model_name is not None and not (isinstance(model_name, str) and model_name.strip()):
        raise ConfigError(f"model_name: expected a non-empty name (or None: the model's own), got {model_name!r}")
    if max_request_bytes is not None and not (isinstance(max_request_bytes, int)
                                              and not isinstance(max_request_bytes, bool)
                                              and 1 <= max_request_bytes <= MAX_INT):
        raise ConfigError(f"max_request_bytes: expected an integer >= 1 (bytes), or None for the default derived "
                          f"from max_seq_len, got {short(max_request_bytes)}")
    result.audit.keep_tail(audit_keep)
    name = model_name or (result.model.name if result.model is not None else str(result.args.model))
    metrics = ServeMetrics(name)
    engine = ServingEngine.from_result(result, observer=metrics)
    metrics.attach(engine)
    if max_request_bytes is None:
        max_request_bytes = default_max_request_bytes(engine.executor.max_seq_len, engine.executor.vocab_size)
    return ServeState(result=result, engine=engine, metrics=metrics, model_name=name,
                      max_request_bytes=max_request_bytes, default_max_tokens=default_max_tokens)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; ``ConfigError`` naming ``--host``/``--port`` when it cannot be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror})") from None
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, ending the engine's requests as soon as a stop is asked for.

    uvicorn's graceful shutdown waits for open connections; a stream of thousands of tokens would hold it
    until the timeout, then be cancelled mid-body (a traceback, a client cut off without ``[DONE]``). Asking
    the engine to stop first ends every request with ``finish_reason: "abort"``, so streams close properly
    and the process exits at once.
    """

    def __init__(self, config: uvicorn.Config, state: ServeState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: Any) -> None:  # the SIGINT/SIGTERM handler uvicorn installs
        self.state.engine.request_stop()
        super().handle_exit(sig, frame)


def _server(state: ServeState, log_level: str) -> _Server:
    config = uvicorn.Config(create_app(state), log_level=log_level, access_log=log_level in ("debug", "info"),
                            timeout_graceful_shutdown=5, lifespan="off")
    return _Server(config, state)


def serve(state: ServeState, host: str, port: int, *, log_level: str = "warning",
          ready: Any = None) -> None:
    """Serve until interrupted; the engine loop runs for exactly as long. ``ready(url)`` once listening."""
    sock = bind(host, port)
    server = _server(state, log_level)
    state.engine.start()
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler it found:
    # that is the normal way to stop a server, so it ends the call instead of the process.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if main else None
    try:
        if ready is not None:
            ready(f"http://{host}:{sock.getsockname()[1]}")
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=[sock])
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        state.engine.stop()
        sock.close()


class ServerThread:
    """The server on 127.0.0.1 (a free port by default) in a background thread; ``stop()`` ends both loops."""

    def __init__(self, state: ServeState, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self.state = state
        self.sock = bind(host, port)
        self.host = host
        self.port = self.sock.getsockname()[1]
        self.server = _server(state, log_level)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="kvload-http", daemon=True)

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        """Start the engine and the HTTP server; return once it accepts connections."""
        self.state.engine.start()
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.stop()
                raise RuntimeError(f"the server did not start within {timeout} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        """Stop accepting, end the engine's requests, finish the HTTP loop, stop the engine (idempotent)."""
        self.state.engine.request_stop()
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout)
        self.state.engine.stop(timeout)
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["ServerThread", "bind", "build_state", "serve"]
