"""Running the app: build engine + metrics over a loaded result, bind a socket, serve with uvicorn.

:func:`serve` blocks until SIGINT/SIGTERM/SIGHUP (uvicorn's graceful shutdown), then stops the engine.
:class:`ServerThread` runs the same server in a background thread (tests, ``bench_serve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http
import json
import logging
import re
import signal
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE as HEAD_LIMIT
from uvicorn.protocols.http.h11_impl import H11Protocol

from cache_backends.kv_events import KvEventMirror
from engine.content_format import CONTENT_FORMATS
from engine.serving import ServingEngine
from kvload.metrics import METRIC_NAMINGS
from kvload.serve.app import create_app
from kvload.serve.auth import OPEN_PATHS, check_api_key, digest
from kvload.serve.command import (
    AUDIT_KEEP_DEFAULT,
    MAX_CONCURRENT_DEFAULT,
    MAX_TIMEOUT_S,
    READ_TIMEOUT_DEFAULT,
    REASONING_PARSERS,
    RESPONSES_STORE_MAX_DEFAULT,
    TOOL_CALL_PARSERS,
    serve_max_tokens,
)
from kvload.serve.metrics import ServeMetrics
from kvload.serve.protocol import BadRequest, default_max_request_bytes, shutting_down
from kvload.serve.responses_store import ResponseStore, kept_request_bytes
from kvload.serve.state import CorsPolicy, ServeState
from kvload.serve.stats_log import StatsLogger
from kvload.serve.tls import Tls, tls_from_flags
from kvload.serve.uds import UnixListener, uds_url
from pipeline.errors import ConfigError, GenerationError, KvloadError, opening_error
from pipeline.events import ApiKeyRequired, AutoToolChoiceEnabled, KvEventsFileFailed, ReasoningParserEnabled
from pipeline.limits import MAX_INT, short, short_py, short_text
from pipeline.signals import stopping
from pipeline.textfile import read_regular
from pipeline.thread_end import EndingThread
from pipeline.vllm_compat import reasoning_parser_named


def _count(value: Any, low: int) -> bool:
    """Whether ``value`` is an integer (no bool) from ``low`` to 2**63 - 1."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_INT


def _need(ok: bool, name: str, expected: str, value: Any) -> None:
    """``build_state``'s argument ``name`` refused unless ``ok``: one ``ConfigError`` saying what it takes."""
    if not ok:
        raise ConfigError(f"{name}: expected {expected}, got {short(value)}")


def build_state(result: Any, *, model_name: str | Sequence[str] | None = None,
                default_max_tokens: int | None = None,
                audit_keep: int = AUDIT_KEEP_DEFAULT, max_request_bytes: int | None = None,
                read_timeout_s: float = READ_TIMEOUT_DEFAULT,
                max_concurrent_requests: int = MAX_CONCURRENT_DEFAULT,
                trust_request_chat_template: bool = False, chat_template: str | None = None,
                chat_template_flag: str = "chat_template", api_keys: Sequence[str] | None = (),
                api_key_source: str = "api_keys", enable_reset_prefix_cache: bool = False,
                tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                metrics_naming: str = "kvload",
                responses_store_max: int = RESPONSES_STORE_MAX_DEFAULT, cors: CorsPolicy | None = None,
                response_role: str = "assistant", return_tokens_as_token_ids: bool = False,
                force_include_usage: bool = False, root_path: str = "",
                default_chat_template_kwargs: Mapping[str, Any] | None = None,
                log_stats_interval_s: float | None = None, request_id_headers: bool = False,
                h11_max_incomplete_event_size: int | None = None,
                h11_max_header_count: int | None = None, chat_template_content_format: str = "auto") -> ServeState:
    """Engine (not started) and metrics over a ``load(..., load_weights=True)`` result, served as ``model_name`` (None:
    the model's own name; a list: vLLM's several ``--served-model-name``, the first in every answer, any of them taken
    in a request's ``model``); from now on its audit log
    keeps the load's records and the newest ``audit_keep`` (``/v1/kvload/audit`` serves them). A request body
    over ``max_request_bytes`` is refused unread (None: :func:`default_max_request_bytes` of the model); a
    request's head, and then its body, must each arrive within ``read_timeout_s`` seconds (408); past
    ``max_concurrent_requests`` generation requests at once, more are refused (503); a request's own
    ``chat_template`` is refused (400) unless ``trust_request_chat_template``. ``chat_template``: a Jinja template
    that replaces the tokenizer's for every chat request and ``/tokenize`` of messages (the operator's, e.g. for a
    base model without one; ``chat_template_text`` reads ``--chat-template``), refused for a model without a
    tokenizer by a ``ConfigError`` naming ``chat_template_flag``. ``enable_reset_prefix_cache``: serve
    ``POST /reset_prefix_cache`` (off: 404, as vLLM outside its dev mode; any client could drop every cache). A
    request that sends no sampling field takes the
    model's default for it (``result.sampling_defaults``: its generation_config.json); one that sends no
    ``max_tokens`` takes ``default_max_tokens`` (None: the model's max_new_tokens, else
    :data:`~kvload.serve.command.DEFAULT_MAX_TOKENS`), cut to what max_seq_len leaves. With ``api_keys``, every
    path but ``/health``, ``/metrics`` and ``/version`` answers 401 without ``Authorization: Bearer KEY`` (one of
    them; a key that could not be sent so is a ``ConfigError`` naming ``api_key_source``, never quoting it), and the
    audit gets an ``api_key_required`` record naming ``api_key_source``. ``tool_call_parser`` (one of
    :data:`~kvload.serve.command.TOOL_CALL_PARSERS`; vLLM's ``--enable-auto-tool-choice --tool-call-parser``):
    chat's ``tool_choice: "auto"`` is served, the reply read for tool calls (an ``auto_tool_choice_enabled``
    record); None: refused. ``reasoning_parser`` (one of :data:`~kvload.serve.command.REASONING_PARSERS`; vLLM's
    ``--reasoning-parser``): each chat reply is split into ``reasoning_content`` and ``content`` (a
    ``reasoning_parser_enabled`` record); None: chat replies are all content. ``metrics_naming`` (one of
    :data:`~kvload.metrics.METRIC_NAMINGS`): ``/metrics`` under kvload's names or vLLM's own (``vllm:*``).
    ``responses_store_max``: ``/v1/responses`` answers kept for ``previous_response_id`` and
    ``GET /v1/responses/{id}``, the least recently used dropped past it (0: none kept).
    ``default_chat_template_kwargs`` (vLLM's ``--default-chat-template-kwargs``): template variables every chat
    request gets under its own ``chat_template_kwargs`` (a request's value of a name wins), checked as those are.
    ``log_stats_interval_s``: vLLM's throughput line (an ``engine_stats`` event) every so many seconds while requests
    run (``kvload.serve.stats_log``); None: none. ``request_id_headers``: every answer carries ``X-Request-Id`` (vLLM's
    ``--enable-request-id-headers``); ``h11_max_incomplete_event_size`` / ``h11_max_header_count``: the largest request
    head in bytes and the most headers one may have (vLLM's ``--h11-max-*``; None: uvicorn's 16 KiB, no count), HTTP
    431 past them. ``chat_template_content_format`` (vLLM's ``--chat-template-content-format``): how chat messages'
    content reaches the template, one of :data:`~engine.content_format.CONTENT_FORMATS`."""
    if chat_template_content_format not in CONTENT_FORMATS:
        raise ConfigError(f"chat_template_content_format: expected one of {', '.join(CONTENT_FORMATS)}, got "
                          f"{short(chat_template_content_format)}")
    for name, bound in (("h11_max_incomplete_event_size", h11_max_incomplete_event_size),
                        ("h11_max_header_count", h11_max_header_count)):
        _need(bound is None or _count(bound, 1), name, "an integer >= 1 or None", bound)
    if log_stats_interval_s is not None and not (isinstance(log_stats_interval_s, (int, float))
                                                 and not isinstance(log_stats_interval_s, bool)
                                                 and 0 < log_stats_interval_s <= 86400):
        raise ConfigError(f"log_stats_interval_s: expected a number of seconds > 0 (at most 86,400) or None, got "
                          f"{short(log_stats_interval_s)}")
    template_defaults = dict(default_chat_template_kwargs or {})
    if template_defaults:
        from engine.prompts import template_options

        try:
            template_options(chat_template_kwargs=template_defaults)
        except GenerationError as exc:
            raise ConfigError(f"default_chat_template_kwargs: {str(exc).split(': ', 2)[-1]}") from None
    if metrics_naming not in METRIC_NAMINGS:
        raise ConfigError(f"metrics_naming: expected one of {', '.join(METRIC_NAMINGS)}, "
                          f"got {short_py(metrics_naming)}")
    # vLLM's served_model_name: one name, or several, the first in every answer and any of them in a request
    names = list(model_name) if isinstance(model_name, (list, tuple)) else [model_name]
    if not names or not (names == [None] or all(isinstance(n, str) and n.strip() for n in names)):
        raise ConfigError(f"model_name: expected a non-empty name, a list of them (the first answers) or None (the "
                          f"model's own), got {short_py(model_name)}")
    _need(max_request_bytes is None or _count(max_request_bytes, 1), "max_request_bytes",
          "an integer >= 1 (bytes), or None for the default derived from max_seq_len", max_request_bytes)
    _need(isinstance(read_timeout_s, int | float) and not isinstance(read_timeout_s, bool)
          and 0 < read_timeout_s <= MAX_TIMEOUT_S, "read_timeout_s", f"seconds in (0, {MAX_TIMEOUT_S:g}]",
          read_timeout_s)
    _need(_count(max_concurrent_requests, 1), "max_concurrent_requests", "an integer >= 1", max_concurrent_requests)
    for name, flag in (("trust_request_chat_template", trust_request_chat_template),
                       ("enable_reset_prefix_cache", enable_reset_prefix_cache)):
        _need(isinstance(flag, bool), name, "true or false", flag)
    _need(_count(responses_store_max, 0), "responses_store_max", "an integer >= 0 (0: keep no responses)",
          responses_store_max)
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ConfigError(f"tool_call_parser: {short(tool_call_parser)} is no tool-call parser kvload has; it has: "
                          f"{', '.join(TOOL_CALL_PARSERS)}")
    if reasoning_parser is not None:  # TensorRT-LLM's spelling of a parser (deepseek-r1) is taken as kvload's name
        named = reasoning_parser_named(reasoning_parser)
        if named is None:
            raise ConfigError(f"reasoning_parser: {short(reasoning_parser)} is no reasoning parser kvload has; it has: "
                              f"{', '.join(REASONING_PARSERS)}")
        reasoning_parser = named
    if isinstance(api_keys, str):  # one key given bare would be taken as its characters, each a key
        raise ConfigError(f"{api_key_source}: expected a list of keys, got one string; pass [key]")
    digests = tuple(dict.fromkeys(digest(check_api_key(api_key_source, key)) for key in api_keys or ()))
    if chat_template is not None:
        tokenizer = getattr(result, "tokenizer", None)
        if tokenizer is None:
            raise ConfigError(f"{chat_template_flag}: {result.args.model} has no tokenizer (presets have random "
                              "weights and none): there is no text to template")
        tokenizer.chat_template = check_chat_template(chat_template_flag, chat_template)
    defaults = getattr(result, "sampling_defaults", None)
    sampling = dict(defaults.values) if defaults is not None else {}
    default_max_tokens = serve_max_tokens(default_max_tokens, sampling)
    bus = getattr(result, "bus", None)
    if digests and bus is not None:  # before keep_tail: a load record, kept however many requests follow
        bus.emitter("serve")(ApiKeyRequired(source=api_key_source, keys=len(digests), open_paths=sorted(OPEN_PATHS)))
    if tool_call_parser is not None and bus is not None:  # a load record too: how every "auto" reply is read
        bus.emitter("serve")(AutoToolChoiceEnabled(parser=tool_call_parser))
    if reasoning_parser is not None and bus is not None:  # and how every chat reply is split
        bus.emitter("serve")(ReasoningParserEnabled(parser=reasoning_parser))
    result.audit.keep_tail(audit_keep)
    name = names[0] or (result.model.name if result.model is not None else str(result.args.model))
    aliases = tuple(dict.fromkeys(n for n in names[1:] if n != name))
    engine = ServingEngine.from_result(result)
    engine.content_format = chat_template_content_format
    proposer = engine.executor.proposer  # speculative decoding: the draft positions to count acceptance at
    metrics = ServeMetrics(name, naming=metrics_naming, max_model_len=engine.executor.max_seq_len,
                           max_draft_len=proposer.max_draft_len if proposer is not None else 0)
    engine.observer = metrics
    metrics.attach(engine)
    responses = ResponseStore(responses_store_max, on_evicted=metrics.responses_evicted.inc,
                              max_request_bytes=kept_request_bytes(engine.executor.max_seq_len))
    metrics.watch_responses(responses)
    # vLLM's throughput line every so many seconds while requests run (kvload serve: VLLM_LOG_STATS_INTERVAL, 10)
    stats_logger = StatsLogger(engine, log_stats_interval_s) if log_stats_interval_s is not None else None
    if max_request_bytes is None:
        max_request_bytes = default_max_request_bytes(engine.executor.max_seq_len, engine.executor.vocab_size)
    return ServeState(result=result, engine=engine, metrics=metrics, model_name=name, aliases=aliases,
                      max_request_bytes=max_request_bytes, default_max_tokens=default_max_tokens,
                      sampling_defaults={k: v for k, v in sampling.items() if k != "max_tokens"},
                      read_timeout_s=float(read_timeout_s), max_concurrent_requests=max_concurrent_requests,
                      trust_request_chat_template=trust_request_chat_template, api_key_digests=digests,
                      enable_reset_prefix_cache=enable_reset_prefix_cache, tool_call_parser=tool_call_parser,
                      reasoning_parser=reasoning_parser, responses=responses, cors=cors, response_role=response_role,
                      return_tokens_as_token_ids=return_tokens_as_token_ids,
                      force_include_usage=force_include_usage, root_path=root_path,
                      default_chat_template_kwargs=template_defaults, stats_logger=stats_logger,
                      request_id_headers=bool(request_id_headers),
                      h11_max_incomplete_event_size=h11_max_incomplete_event_size,
                      h11_max_header_count=h11_max_header_count)



#: Largest --chat-template file read (a real model's template is a few KiB; Llama 3.1's, with tools, ~10 KiB).
MAX_CHAT_TEMPLATE_BYTES = 1 << 20


def chat_template_text(value: str, flag: str = "--chat-template") -> str:
    """``--chat-template``: a file's text, or the template itself (vLLM's flag takes either), checked to compile;
    ``ConfigError`` naming ``flag``. The file is opened first and checked and read through that descriptor
    (:func:`pipeline.textfile.read_regular`): a FIFO or device is refused without waiting on it (a FIFO with no writer
    blocked the start for ever, and ``/dev/zero``, size 0, was read without end)."""
    if "{{" in value or "{%" in value:  # the template itself, not a path
        return check_chat_template(flag, value)
    named = f"{flag} {short_text(value, 200)}"  # quoted: a path with spaces, or an empty one, reads as one value
    try:
        raw = read_regular(value, lambda problem: ConfigError(f"{named}: {problem}"), tail="; give a template file",
                           max_bytes=MAX_CHAT_TEMPLATE_BYTES, missing=None, too_big=f"a chat template is at most "
                           f"{MAX_CHAT_TEMPLATE_BYTES:,} bytes (real ones: a few KiB)")
    except FileNotFoundError:  # not a path: a template with no Jinja tag in it, or a path mistyped
        raise ConfigError(f"{flag}: {short_text(value, 200)} is neither a file nor a Jinja template (one holds "
                          "{{ or {%)") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{named}: not UTF-8 text") from None
    return check_chat_template(named, text)


def check_chat_template(where: str, text: Any) -> str:
    """``text`` when it is a Jinja template that compiles as transformers compiles chat templates (its sandbox, with
    its ``{% generation %}`` tag and Jinja's ``{% break %}`` / ``{% continue %}``), else ``ConfigError`` naming
    ``where`` and the line."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template  # the one apply_chat_template uses

    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{where}: expected a Jinja chat template, got {short(text)}")
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{where}: not a Jinja template: line {exc.lineno}: {exc.message}") from None
    return text


def mirror_kv_events(state: ServeState, path: str, flag: str = "--kv-events-file") -> KvEventMirror:
    """Append the served manager's KV cache events to ``path`` (JSON Lines) as they happen; ``ConfigError`` naming
    ``flag`` when it cannot be opened (``OutputError``: a full disk or quota). A write that fails later (a full disk)
    is reported once, as a ``kv_events_file_failed`` warning in the server's log and audit, and stops the mirror:
    never a request."""
    buffer = state.result.kv_manager.kv_events

    def failed(mirror: KvEventMirror) -> None:  # called on the engine loop thread, mid-step: queued, not emitted
        state.engine.notify(KvEventsFileFailed(field=flag, path=mirror.path, error=mirror.error_text,
                                               reason=mirror.describe()))

    try:
        mirror = KvEventMirror(path, flag, on_failure=failed)
    except OSError as exc:
        # a full disk (no inode for the new file) or a quota: outside the settings (exit 1), not a path refused
        raise opening_error(exc)(f"{flag} {short_text(path, 200)}: cannot open it for writing "
                                 f"({exc.strerror or exc})") from None
    buffer.mirror = mirror
    return mirror


#: socket()'s errors that mean the machine has no such kind of address (IPv6 off): --host's to change.
_FAMILY_ERRNOS = frozenset({errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT, errno.ESOCKTNOSUPPORT, errno.EPFNOSUPPORT})


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; ``ConfigError`` naming ``--host``/``--port`` when it cannot be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {short_text(host)}: cannot resolve it ({exc.strerror})") from None
    except UnicodeError:  # IDNA's encoding of a host name: a label (the text between dots) empty or past 63 characters
        raise ConfigError(f"--host {short_text(host)}: not a host name (each dot-separated label is 1 to 63 "
                          "characters); give an address (127.0.0.1: this machine only, 0.0.0.0: all of them) or a "
                          "host name") from None
    family, kind, proto, _, addr = infos[0]
    try:
        sock = socket.socket(family, kind, proto)
    except OSError as exc:  # an IPv6 address where IPv6 is off (EAFNOSUPPORT): the host's kind, not the port
        if exc.errno not in _FAMILY_ERRNOS:  # out of descriptors or memory (EMFILE, ENOBUFS): no fault of --host's
            raise
        raise ConfigError(f"--host {short_text(host)}: cannot listen on it ({exc.strerror}); give an address of a "
                          "kind this machine has (127.0.0.1: this machine only, 0.0.0.0: all of them)") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRNOTAVAIL:  # the host, not the port: the line named --port, which was fine
            raise ConfigError(f"--host {short_text(host)}: not an address of this machine, cannot listen on it "
                              f"({exc.strerror}); give one of its addresses (127.0.0.1: this machine only, "
                              "0.0.0.0: all of them)") from None
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise ConfigError(f"--port {port}: cannot listen on {where} ({exc.strerror})") from None
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, ending the engine's requests as soon as a stop is asked for.

    uvicorn's graceful shutdown waits for open connections; a stream of thousands of tokens would hold it
    until the timeout, then be cancelled mid-body (a traceback, a client cut off without ``[DONE]``). Asking
    the engine to stop first ends every request with ``finish_reason: "abort"``, so streams close properly
    and the process exits at once. A request whose body is still arriving is answered 503 once the shutdown
    begins (the app's ``stopping`` event), not waited for.
    """

    def __init__(self, config: uvicorn.Config, state: ServeState, stopping: asyncio.Event, *,
                 exit_on_engine_failure: bool = False) -> None:
        super().__init__(config)
        self.state = state
        self.stopping = stopping
        self.exit_on_engine_failure = exit_on_engine_failure
        #: the engine loop's failure that stopped the server (``exit_on_engine_failure``); None otherwise
        self.engine_failure: str | None = None
        #: the first stop signal taken (None: none yet)
        self.stop_signal: int | None = None

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s); with ``exit_on_engine_failure``, a dead engine loop stops the server.

        The loop's failure already ended its requests with "error" (500s, error chunks) and /health answers 503
        from then on; the shutdown that follows lets those answers finish, refuses new connections, and
        :func:`serve` raises :class:`EngineFailed`, so a supervisor (systemd, Kubernetes) sees the process end
        and restarts it rather than probing a server that will never serve again (vLLM stops too)."""
        engine = self.state.engine
        if self.exit_on_engine_failure and self.engine_failure is None and engine.loop_error is not None \
                and not engine.alive:  # the thread ended: its last drain (every request's 500) is posted
            self.engine_failure = engine.loop_error
            self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: Any) -> None:  # the stop handler: uvicorn's, and serve()'s around it
        if self.stop_signal is None:
            self.stop_signal = sig
        self.state.engine.request_stop()
        super().handle_exit(sig, frame)
        # uvicorn takes a second SIGINT as "force quit": it stops waiting for open answers and cancels their handlers,
        # so a stream waiting on a step was cut mid-body and logged a CancelledError traceback. The first stop ends
        # every request at once (a stream's last chunk, then [DONE]), so another signal only repeats it; the wait
        # stays bounded by the graceful timeout (5 s).
        self.force_exit = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup, with :func:`_out_of_files` handling the loop's errors first."""
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_out_of_files(loop.get_exception_handler()))
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, after telling the handlers (on the loop, which a signal handler is not)."""
        self.state.engine.request_stop()  # already, unless should_exit was set some other way
        self.stopping.set()
        for connection in list(self.server_state.connections):
            if isinstance(connection, _Deadlines):
                connection.refuse_unfinished_head()
        await super().shutdown(sockets)


#: How long the out-of-files line stays said (:func:`_out_of_files`): once a minute while it lasts.
OUT_OF_FILES_EVERY_S = 60.0


def _out_of_files(then: Any) -> Any:
    """The loop's exception handler: a connection that cannot be accepted for want of file descriptors (a flood
    of connections past ``ulimit -n``) is one warning line a minute, not asyncio's error and traceback for each
    try. Python 3.11's accept loop (cpython gh-151615) retried it up to uvicorn's backlog (2,048) times a second,
    each logged: 342,240 lines in 10 s under ``ulimit -n 200`` and 400 connections. The connections wait in the
    listen backlog and are taken once some close (the read timeout closes idle ones). Anything else goes to
    ``then`` (the loop's default handler when None)."""
    said = [float("-inf"), 0]  # when the line was last said, tries since

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != "socket.accept() out of system resource":
            if then is not None:
                then(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        said[1] += 1
        now = time.monotonic()
        if now - said[0] < OUT_OF_FILES_EVERY_S:
            return
        exc = context.get("exception")
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        again = "" if said[0] == float("-inf") else f"; {said[1]:,} tries in the last {OUT_OF_FILES_EVERY_S:g} s"
        logging.getLogger("uvicorn.error").warning(
            "serve: %scannot accept new connections (%s%s); they wait until some close: raise the open-file limit "
            "(ulimit -n); each open connection holds a file, an idle one until --request-read-timeout",
            "still " if again else "", why, again)
        said[:] = [now, 0]

    return handle


class _Deadlines(H11Protocol):
    """uvicorn's h11 protocol with a read deadline: a request's head, then its body, must each arrive within
    ``read_timeout_s`` seconds.

    uvicorn times only the idle gap after a response (``timeout_keep_alive``, cancelled by the next byte that
    arrives). A client that connects and never finishes a request's head, or starts one after a response and
    stops, held the connection forever; so did one trickling a body the app answered without reading (uvicorn
    drops those bytes, and the first one cancelled its keep-alive timer). The app times the bodies it reads
    (408 with OpenAI's error body, :func:`kvload.serve.request_body._read_body`); this closes the rest. A head's time
    runs from its first byte (a new connection's also from its opening); a head not all in by then gets the
    same 408 and the connection closes. A body's time runs from the end of its head; one still arriving then,
    after the app answered without reading it, has its connection closed.
    """

    read_timeout_s: float = READ_TIMEOUT_DEFAULT  # set on the subclass :func:`_server` makes
    metrics: ServeMetrics | None = None  # likewise: counts the refusals made here, below the app
    max_header_count: int | None = None  # likewise: --h11-max-header-count (None: no count)

    def connection_made(self, transport: Any) -> None:
        self._deadline: asyncio.TimerHandle | None = None
        self._lingering: asyncio.TimerHandle | None = None  # set while refused bytes are read and dropped
        self._linger_cap: asyncio.TimerHandle | None = None  # the lingering's end however the client sends
        self._stalled: asyncio.TimerHandle | None = None
        self._phase: tuple[Any, ...] | None = None
        self._refused: h11.RemoteProtocolError | None = None
        self._head_request = False  # the request in hand is a HEAD: its refusal is answered without a body
        next_event = self.conn.next_event

        def caught() -> Any:  # uvicorn drops h11's reason before send_400_response: kept here, for the answer
            try:
                event = next_event()
                if isinstance(event, h11.Request):
                    self._head_request = event.method == b"HEAD"
                    _check_head_size(event, self.config.h11_max_incomplete_event_size or HEAD_LIMIT)
                    _check_version(event)
                    _check_framing(event)
                    _check_header_count(event, self.max_header_count)
                    event = _origin_form(event)
                return event
            except h11.RemoteProtocolError as exc:
                self._refused = exc
                raise

        self.conn.next_event = caught  # type: ignore[method-assign]
        self.logger = _HttpLog(self.logger)  # type: ignore[assignment]
        super().connection_made(transport)
        self.transport = _Writes(transport)  # type: ignore[assignment]  # what each request's cycle writes to
        self._track()

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:  # the request was refused and answered: what still comes is dropped
            self._lingering.cancel()
            self._lingering = self.loop.call_later(LINGER_S, self.transport.close)
            return
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        self._head_request = False
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        for timer in (self._lingering, self._linger_cap):  # a pending timer would keep this connection's buffers
            if timer is not None:
                timer.cancel()
        self._lingering = self._linger_cap = None
        self._unstall()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The socket's buffers are full: the client reads nothing of its answer. One that still reads nothing
        ``read_timeout_s`` seconds later is dropped: it held its request's slot (--max-concurrent-requests) and
        connection for ever once its answer was generated, each send waiting on a socket it never drained, so a
        few such clients could keep the server refusing everyone else (503) while it generated nothing."""
        super().pause_writing()
        if self._stalled is None:
            self._stalled = self.loop.call_later(self.read_timeout_s, self._write_stalled)

    def resume_writing(self) -> None:
        self._unstall()
        super().resume_writing()

    def refuse_unfinished_head(self) -> None:
        """At the stop, a request whose head is still arriving gets the 503 one whose body is still arriving gets
        (``server_shutting_down``), not uvicorn's bare close, which left its client guessing why."""
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE or not self.conn.trailing_data[0]:
            return
        self.transport.write(_raw_error(shutting_down()))
        if self.metrics is not None:
            self.metrics.on_refused(503, "server_shutting_down")
        self.transport.close()

    def _unstall(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _write_stalled(self) -> None:
        self._stalled = None
        if not self.transport.is_closing():
            # aborted, not closed: a close would wait for the unread bytes to drain. connection_lost follows, which
            # marks the request's client gone (the app aborts it and frees its slot) and wakes its waiting send
            self.transport.abort()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's plain-text 400 for bytes h11 cannot parse as HTTP (a malformed or oversized head), counted."""
        # IDLE (a malformed head) and SEND_RESPONSE (a malformed body being read) can still be answered. Otherwise
        # the request was answered already, without reading its body (a 503 past --max-concurrent-requests, a 404,
        # a 405), and what came after it is not HTTP (bad chunk framing): h11 refused a second response mid-callback,
        # which asyncio logged as a fatal protocol error with a traceback. The client has its answer: close, and
        # count no second refusal.
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            self.transport.close()
            return
        status, body = _not_http(self._refused, self.config.h11_max_incomplete_event_size or HEAD_LIMIT)
        if self.metrics is not None:
            self.metrics.on_refused(status)
        # uvicorn's answer is plain text ("Invalid HTTP request received."): a client reading OpenAI's error body got
        # no JSON, and the reason h11 gave (a bad header line, a head too large) was not said
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                   (b"connection", b"close")]
        self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers,
                                                         reason=http.HTTPStatus(status).phrase.encode())))
        # a HEAD's answer has the headers a GET's would, and no body (RFC 9110 9.3.2): h11 refused the body's bytes
        # ("Too much data for declared Content-Length"), which asyncio logged as a fatal error with a traceback and
        # answered by dropping the connection after the status line
        if not self._head_request:
            self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        if self.cycle is not None and not self.cycle.response_complete:
            # a request's body was being read: its app is running and holds a slot until it hears the client left,
            # which a lingering close would put off by seconds; the answer is written, the body's rest not wanted
            self.transport.close()
            return
        self._linger()

    def _linger(self) -> None:
        """Close after an answer sent before the request was all read (a head past the limit, bytes that are not
        HTTP), as nginx's lingering close does: the answer is sent and the sending side shut (FIN), then what the
        client still sends is read and dropped until it closes or sends nothing for :data:`LINGER_S` seconds, at most
        ``read_timeout_s`` in all. Closing at once with its bytes unread made the kernel reset the connection, and a
        client still sending (a 1 MB header) got ``Connection reset by peer`` instead of the answer."""
        self._cancel()
        if self.transport.is_closing() or not self.transport.can_write_eof():  # TLS cannot half-close
            self.transport.close()
            return
        self.transport.write_eof()
        self._lingering = self.loop.call_later(LINGER_S, self.transport.close)
        self._linger_cap = self.loop.call_later(self.read_timeout_s, self.transport.close)  # one sending for ever

    def _unsupported_upgrade_warning(self) -> None:
        """uvicorn's two warnings for a request asking to switch protocols (a WebSocket, h2c), logged at debug: the
        request is answered as the plain HTTP request it also is, and any client could fill the operator's log with
        "No supported WebSocket library detected. Please use pip install 'uvicorn[standard]'", advice that does not
        apply (kvload serves no WebSocket)."""
        self.logger.debug("upgrade request (%s) answered as plain HTTP", (self._get_upgrade() or b"").decode("latin-1"))

    def _track(self) -> None:
        """A fresh deadline whenever the connection starts waiting for a new head or a new body; none otherwise."""
        state = self.conn.their_state
        phase: tuple[Any, ...] | None = None
        if self.transport.is_closing():
            pass
        elif state is h11.IDLE:
            started = bool(self.conn.trailing_data[0])  # part of the next head is in
            if started or self.cycle is None:  # idle after a response: uvicorn's keep-alive timer closes it
                phase = (state, self.cycle, started)
        elif state is h11.SEND_BODY:
            phase = (state, self.cycle)  # the cycle tells one request's body from the next's
        if phase == self._phase:
            return
        self._cancel()
        self._phase = phase
        if phase is not None:
            self._deadline = self.loop.call_later(self.read_timeout_s, self._expired)

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self._phase is None:
            return
        if self._phase[0] is h11.IDLE:
            if self._phase[2]:  # part of a head came: say why the connection closes
                self.transport.write(_head_timeout(self.read_timeout_s))
                if self.metrics is not None:
                    self.metrics.on_refused(408)
            self.transport.close()  # else a new connection that sent nothing: closed as keep-alive's timer would
        elif self.cycle is not None and self.cycle.response_complete:
            self.transport.close()  # answered without reading the body, which still has not all come
        # else the app is reading the body under its own deadline (a 408), or answering: it ends the request


def _check_head_size(request: h11.Request, limit: int) -> None:
    """A ``RemoteProtocolError`` (431) for a request whose head, all in, is larger than ``limit`` bytes
    (``--h11-max-incomplete-event-size``).

    h11 applies its limit only to a head still arriving: one that came in a single read (up to 256 KiB on
    loopback) was served, a larger one refused, so the same request was taken or not by how TCP cut it. Counted as
    sent, less the spaces h11 strips around header values (so never more than was sent)."""
    size = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n\r\n") + sum(
        len(name) + len(value) + 4 for name, value in request.headers)  # "name: value\r\n"
    if size > limit:
        raise h11.RemoteProtocolError(f"{HEAD_TOO_LARGE}: {size:,} bytes came, at most {limit:,} are taken",
                                      error_status_hint=431)


def _check_framing(request: h11.Request) -> None:
    """A ``RemoteProtocolError`` for a request that gives both ``Transfer-Encoding`` and ``Content-Length``.

    h11 reads such a body as chunked and ignores the length (RFC 9112 §6.3's rule), so a body framed by its
    Content-Length alone was read as a chunk header that never ended, and the client waited for the body's 408.
    RFC 9112 §6.1 lets a server refuse it instead, and says to close the connection after answering either way (the
    two lengths are how requests are smuggled past a proxy that reads the other one): refused at once, 400, closed.
    """
    names = {name for name, _ in request.headers}  # h11 gives the names lowercased
    if b"transfer-encoding" in names and b"content-length" in names:
        raise h11.RemoteProtocolError("both Transfer-Encoding and Content-Length given; send the body with one of "
                                      "them (RFC 9112 section 6.1)", error_status_hint=400)


_ABSOLUTE_FORM = re.compile(rb"(?i)https?://([^/?#]*)(.*)", re.DOTALL)


def _origin_form(request: h11.Request) -> h11.Request:
    """A request whose target is in absolute form (``GET http://host:port/v1/models``, as a client sends it to a
    proxy) as the same request in origin form (``GET /v1/models``), its ``Host`` the target's authority.

    RFC 9112 §3.2.2: a server MUST accept the absolute form, and MUST use the target's host, not the Host header's.
    uvicorn took the whole URL for the path, so every such request was a 404 "no such endpoint"."""
    match = _ABSOLUTE_FORM.fullmatch(request.target)
    if match is None:
        return request
    authority = match[1].rpartition(b"@")[2]  # a userinfo is no part of the host (RFC 9110 §4.2.4)
    if not authority:  # RFC 9110 §4.2.1: an http(s) URI with an empty host must be rejected as invalid
        target = request.target.decode("ascii", "replace")
        raise h11.RemoteProtocolError(f"the request target {short_text(target, 80)} names no host; send the path "
                                      "alone (/v1/models) or a URL with a host", error_status_hint=400)
    rest = match[2]
    target = rest if rest.startswith(b"/") else b"/" + rest  # "http://host" and "http://host?x" have the path "/"
    headers = [(name, value) for name, value in request.headers if name != b"host"]
    headers.insert(0, (b"host", authority))  # an HTTP/1.0 request may have no Host: it gets the target's
    return h11.Request(method=request.method, headers=headers, target=target, http_version=request.http_version)


def _check_version(request: h11.Request) -> None:
    """A ``RemoteProtocolError`` (505) for a request line naming an HTTP version other than 1.0 or 1.1.

    h11 reads any ``HTTP/d.d``: HTTP/2's prior-knowledge preface (``PRI * HTTP/2.0``, what ``curl
    --http2-prior-knowledge`` sends first) was routed as a request for the path ``*`` and answered 404 "no such
    endpoint", which said nothing of the version; RFC 9110 §15.6.6's 505 says it, then the connection closes."""
    if request.http_version not in (b"1.0", b"1.1"):
        version = request.http_version.decode("ascii", "replace")
        raise h11.RemoteProtocolError(f"the request is HTTP/{version}; kvload serve speaks HTTP/1.1 (and 1.0): send "
                                      "it over HTTP/1.1 (curl: without --http2-prior-knowledge)",
                                      error_status_hint=505)


#: what :func:`_check_head_size`'s refusal says first
HEAD_TOO_LARGE = "the request head is too large"
#: Seconds a refused connection's further bytes are read and dropped before it closes (:meth:`_Deadlines._linger`).
LINGER_S = 2.0
#: what :func:`_check_header_count`'s refusal says first (:func:`_not_http` answers it as itself, not as a large head)
TOO_MANY_HEADERS = "too many headers"


def _check_header_count(request: h11.Request, most: int | None) -> None:
    """A ``RemoteProtocolError`` (431) for a request with more than ``most`` headers (vLLM's
    ``--h11-max-header-count``); None: no count."""
    if most is not None and len(request.headers) > most:
        raise h11.RemoteProtocolError(f"{TOO_MANY_HEADERS}: {len(request.headers):,} came, at most {most:,} are taken "
                                      "(--h11-max-header-count); send fewer", error_status_hint=431)


def _not_http(exc: h11.RemoteProtocolError | None, head_limit: int) -> tuple[int, bytes]:
    """The status and OpenAI's error body for bytes h11 refused as HTTP/1.1: 431 for a head past ``head_limit``
    bytes (h11's hint), 505 for another HTTP version (:func:`_check_version`), else 400 saying what h11 found wrong."""
    if exc is not None and exc.error_status_hint == 505:
        error = BadRequest(str(exc), status=505, code="http_version_not_supported")
    elif exc is not None and exc.error_status_hint == 431 and str(exc).startswith(TOO_MANY_HEADERS):
        error = BadRequest(f"the request has {exc}", status=431, code="request_header_fields_too_large")
    elif exc is not None and exc.error_status_hint == 431 and str(exc).startswith(HEAD_TOO_LARGE):
        error = BadRequest(f"{exc} (--h11-max-incomplete-event-size sets it); send fewer or shorter headers",
                           status=431, code="request_header_fields_too_large")
    elif exc is not None and exc.error_status_hint == 431:
        error = BadRequest(f"{HEAD_TOO_LARGE}: more than {head_limit:,} bytes came without the blank line that ends "
                           f"the headers, at most {head_limit:,} are taken (--h11-max-incomplete-event-size sets it); "
                           "send fewer or shorter headers", status=431, code="request_header_fields_too_large")
    else:
        # h11 quotes what it refused as bytearray(b'...'): the bytes' repr alone, shorter and still escaped
        why = re.sub(r"bytearray\(b('.*'|\".*\")\)", r"\1", str(exc)) if exc is not None and str(exc) else "malformed"
        error = BadRequest(f"the request is not valid HTTP/1.1 ({why[:200]})", code="invalid_http_request")
    return error.status, json.dumps(error.body()).encode()


def _head_timeout(timeout: float) -> bytes:
    """The raw 408 for a head that did not arrive in time (h11 sends no response before a request's head)."""
    return _raw_error(BadRequest(f"the request head did not arrive in time: its headers were not all in within "
                                 f"{timeout:g} s (--request-read-timeout sets it)", status=408,
                                 code="request_timeout"))


def _raw_error(error: BadRequest) -> bytes:
    """An error answer as raw bytes, its connection closing: for a request whose head is not all in (h11 sends no
    response before one)."""
    body = json.dumps(error.body()).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (error.status, http.HTTPStatus(error.status).phrase.encode(),
                                                len(body), body))


class _Writes:
    """A connection's transport that drops what is written once it is closing.

    A send that fails (the client went away: a reset, a broken pipe) closes the transport at once, but uvicorn
    hears of it (``connection_lost``, which stops its writes) only on a later turn of the loop; a stream's chunks
    queued meanwhile (``n`` choices, a step's burst) were each written to the dead socket, and asyncio logged
    "socket.send() raised exception." at warning for each past the fourth: lines in the operator's log that any
    client could cause by hanging up, saying nothing of which request. Nothing written after a close is sent."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data: bytes) -> None:
        """``transport.write``, unless the transport is closing."""
        if not self._transport.is_closing():
            self._transport.write(data)


class _HttpLog:
    """uvicorn's ``uvicorn.error`` logger as its h11 protocol uses it, but for the warning it logs for each request
    that is not HTTP ("Invalid HTTP request received.", saying nothing of why), logged at debug: the client is told
    why (:func:`_not_http`) and ``kvload_http_requests_refused_total`` counts it, and any client could fill the
    operator's log with the line. Likewise a handler the stop cancelled (its graceful timeout ran out while the
    answer waited on a step): uvicorn has said so in one line ("Cancel N running task(s), ..."), and then logged a
    CancelledError traceback for each such request, at debug here."""

    NOT_HTTP = "Invalid HTTP request received."
    ASGI_FAILED = "Exception in ASGI application\n"

    def __init__(self, logger: Any) -> None:
        self._logger = logger

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)

    def warning(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        """``logger.warning``, but for :attr:`NOT_HTTP`, at debug."""
        (self._logger.debug if msg == self.NOT_HTTP else self._logger.warning)(msg, *args, **kwargs)

    def error(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        """``logger.error``, but for a handler's cancellation (only uvicorn's stop cancels one), at debug."""
        cancelled = msg == self.ASGI_FAILED and isinstance(kwargs.get("exc_info"), asyncio.CancelledError)
        (self._logger.debug if cancelled else self._logger.error)(msg, *args, **kwargs)


class EngineFailed(KvloadError):
    """The serving engine's loop died (a bug): ``kvload serve`` stopped, exit 1."""

    exit_code = 1


def _server(state: ServeState, log_level: str, *, exit_on_engine_failure: bool = False,
            access_log: bool | None = None, tls: Tls | None = None) -> _Server:
    # h11, named rather than "auto": the read deadlines above are built on its protocol class (httptools is
    # not a dependency of the serve extra, so "auto" meant h11 unless something else installed it)
    protocol = type("_Deadlines", (_Deadlines,), {"read_timeout_s": state.read_timeout_s, "metrics": state.metrics,
                                                  "max_header_count": state.h11_max_header_count})
    limits = {} if state.h11_max_incomplete_event_size is None else {
        "h11_max_incomplete_event_size": state.h11_max_incomplete_event_size}
    app = create_app(state)
    if access_log is None:  # a line per request where the operator asked for info or more
        access_log = log_level in ("debug", "info", "trace")
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=5, lifespan="off", http=protocol, ws="none", **limits,
                            **(tls.uvicorn_options() if tls is not None else {}))
    return _Server(config, state, app.state.stopping, exit_on_engine_failure=exit_on_engine_failure)


def serve(state: ServeState, host: str, port: int, *, log_level: str = "warning",
          ready: Any = None, access_log: bool | None = None, tls: Tls | None = None, uds: str | None = None) -> None:
    """Serve until SIGINT, SIGTERM or SIGHUP; the engine loop runs for exactly as long. ``uds``: listen on that Unix
    socket instead of ``host``/``port`` (vLLM's ``--uds``), its file removed when the server stops. ``ready(url)`` once
    listening: a stop signal from then on, whenever it comes, ends the call (not the process) once the server
    has shut down. Should the engine loop die, the server shuts down the same way and :class:`EngineFailed` is
    raised (chained to the loop's exception); under tensor parallel (rank 0; the others run :func:`follow`) the
    loop's own error is raised instead (``engine.fatal``: another rank lost, one line, exit 1)."""
    # uvicorn installs its SIGINT/SIGTERM handlers only inside server.run, once its loop runs, puts back the ones
    # it found when it is done and re-raises what it caught to them. So the stop is kvload's handler from here
    # on: the same handle_exit, which before the loop runs leaves uvicorn to bind, skip its main loop and shut
    # down at once (a signal just after the ready line was lost, or with SIGINT broke asyncio.run's start-up), and
    # which afterwards takes the re-raised signal without ending the process. SIGHUP (the terminal closed), which
    # uvicorn leaves alone, stops the server the same way, its audit published as for SIGTERM.
    main = threading.current_thread() is threading.main_thread()
    server = _server(state, log_level, exit_on_engine_failure=True, access_log=access_log, tls=tls)
    previous: dict[int, Any] = {}
    sock: socket.socket | None = None
    unix: UnixListener | None = None
    try:
        if main:
            for sig in _STOP_SIGNALS:
                found = signal.signal(sig, server.handle_exit)
                previous[sig] = signal.SIG_DFL if found is None else found
        if uds is not None:
            unix = UnixListener(uds)
            sock = unix.sock
        else:
            sock = bind(host, port)
        # tensor parallel: a loop that failed (another rank lost) stops the server, whose requests it already ended
        state.engine.on_fatal = lambda: setattr(server, "should_exit", True)
        state.engine.start()
        if state.stats_logger is not None:
            state.stats_logger.start()
        # ready once every rank steps with the loop (a stop then finds them all where it ends them cleanly); a loop
        # that failed first stops the server at its first tick, a stop signal meanwhile at once
        if ready is not None and state.engine.wait_joined(lambda: server.should_exit):
            ready(uds_url(uds, tls=tls is not None) if uds is not None else
                  http_url(host, sock.getsockname()[1], scheme="https" if tls is not None else "http"))
        server.run(sockets=[sock])
    finally:
        # stopped by a signal: another one (Ctrl-C again, torchrun passing the terminal's on) repeats that stop, rather
        # than cutting the engine's stop, the command's teardown or its --audit-log publication short
        if not (previous and server.stop_signal is not None and stopping(previous)):
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if state.stats_logger is not None:
            state.stats_logger.stop()
        state.engine.stop()
        if unix is not None:  # closed, and its file removed: nothing left at the path once the server stopped
            unix.close()
        elif sock is not None:
            sock.close()
    if state.engine.fatal is not None:  # the ranks parted: the one line, exit 1 (the requests got their 500s)
        raise state.engine.fatal
    if server.engine_failure is not None:
        raise EngineFailed(f"serve: the engine loop failed ({server.engine_failure}); the server stopped, its "
                           "requests in flight answered HTTP 500; restart it") from state.engine.loop_exception


def http_url(host: str, port: int, scheme: str = "http") -> str:
    """``http://host:port`` (``https://`` under TLS), an IPv6 address in brackets (``http://[::1]:8000``, its zone's
    ``%`` as ``%25``, RFC 6874): the ready line said ``http://::1:8000``, which no client reads as a URL."""
    if ":" in host:
        host = "[" + host.replace("%", "%25") + "]"
    return f"{scheme}://{host}:{port}"


#: What stops :func:`serve`: uvicorn's two, and the hangup of a closed terminal or a dropped ssh session.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class ServerThread:
    """The server on 127.0.0.1 (a free port by default) in a background thread; ``stop()`` ends both loops.

    ``ssl_certfile``, ``ssl_keyfile``, ``ssl_ca_certs``, ``ssl_cert_reqs``: HTTPS as ``kvload serve``'s
    ``--ssl-*`` flags (vLLM's) serve it, checked by the same code before the port is bound (``ConfigError`` naming the
    flag of the same name). ``uds``: listen on that Unix socket instead of TCP, as ``kvload serve --uds`` (vLLM's):
    a stale socket a killed server left there is replaced, a live one, a missing directory or a path that is not a
    socket is a ``ConfigError`` naming ``uds``, and ``stop()`` removes the file; ``host``/``port`` cannot be given
    with it (the server listens on the socket only)."""

    def __init__(self, state: ServeState, host: str | None = None, port: int | None = None,
                 log_level: str = "warning", *, ssl_certfile: str | None = None, ssl_keyfile: str | None = None,
                 ssl_ca_certs: str | None = None, ssl_cert_reqs: int | None = None, uds: str | None = None) -> None:
        if uds is not None and (host is not None or port is not None):
            given = " and ".join(f"{name}={value!r}" for name, value in (("host", host), ("port", port))
                                 if value is not None)
            raise ConfigError(f"uds {short_text(uds, 200)}: the server listens on that Unix socket only, so {given} "
                              "would not be used; give uds or host/port, not both")
        self.state = state
        self.tls = tls_from_flags(ssl_keyfile, ssl_certfile, ssl_ca_certs, ssl_cert_reqs)  # before binding: no leak
        self.uds = uds
        self._unix: UnixListener | None = None
        if uds is not None:
            self._unix = UnixListener(uds, flag="uds")
            self.sock = self._unix.sock
            self.host: str | None = None
            self.port: int | None = None
        else:
            self.host = "127.0.0.1" if host is None else host
            self.sock = bind(self.host, 0 if port is None else port)
            self.port = self.sock.getsockname()[1]
        try:
            self.server = _server(state, log_level, tls=self.tls)
        except BaseException:
            self._close_socket()
            raise
        self.thread = EndingThread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                   name="kvload-http", daemon=True)

    @property
    def url(self) -> str:
        """``http://host:port`` (``https://`` with a certificate); with ``uds``, ``unix:PATH`` as ``kvload serve``'s
        ready line names it (a client reaches it through a Unix-socket transport, e.g. httpx's ``uds=``)."""
        if self.uds is not None:
            return uds_url(self.uds, tls=self.tls is not None)
        assert self.host is not None and self.port is not None
        return http_url(self.host, self.port, scheme="https" if self.tls is not None else "http")

    def start(self, timeout: float = 30.0) -> ServerThread:
        """Start the engine and the HTTP server; return once it accepts connections."""
        self.state.engine.start()
        if self.state.stats_logger is not None:
            self.state.stats_logger.start()
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.stop()
                raise RuntimeError(f"the server did not start within {timeout} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        """Stop accepting, end the engine's requests, finish the HTTP loop, stop the engine (idempotent). A stop
        signal's exception meanwhile is raised once both threads ended (or their ``timeout`` s passed)."""
        self.state.engine.request_stop()
        self.server.should_exit = True
        try:
            if self.thread.is_alive():
                self.thread.wait_end(timeout)
        finally:
            if self.state.stats_logger is not None:
                self.state.stats_logger.stop()
            self.state.engine.stop(timeout)
            self._close_socket()

    def _close_socket(self) -> None:
        """Close the listening socket; with ``uds``, its file removed too (unless another has taken the path)."""
        if self._unix is not None:
            self._unix.close()
        else:
            with contextlib.suppress(OSError):
                self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["EngineFailed", "ServerThread", "bind", "build_state", "serve"]
