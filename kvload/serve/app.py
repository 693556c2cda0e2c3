"""The HTTP face of ``kvload serve``: OpenAI's completions, chat completions and Responses API (run as the chat request
saying the same: ``responses_input``, ``responses_output``), Anthropic's Messages API (so: ``messages_input``,
``messages_output``; its refusals in Anthropic's error document), vLLM's /tokenize, /detokenize and /version, metrics,
kvload's audit.

Handlers turn a request body into engine requests (one per prompt and choice) on a worker thread (parsing
and tokenizing a large body would stall every other client on the event loop), wait on an asyncio
queue the engine loop feeds, and answer as one JSON document or as server-sent events. A client that
goes away (a closed stream, or a dropped connection while waiting) has its requests aborted, which
frees their KV blocks. Every refusal is HTTP 400 with OpenAI's error body naming the field (a body
over ``--max-request-bytes`` is 413, refused before it is read; one not all in within
``--request-read-timeout`` is 408; an unknown path 404 and a wrong method 405, in the same body); an error
inside the engine is 500 for that request only — the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from engine.prompts import template_reads
from engine.reasoning import ReasoningText
from engine.schema_refs import OUTSIDE
from engine.serving import EngineStopped, ServeEvent, ServingEngine
from engine.stopping import SampleText
from engine.structured import ANY_VALUE, COSTLY, NO_VALUE, SLOW_COMPILE
from engine.structured_params import StructuredOutputsParams
from kvload.serve.auth import ApiKeyGate, route_path
from kvload.serve.command import MAX_CONCURRENT_DEFAULT, READ_TIMEOUT_DEFAULT
from kvload.serve.messages_input import AnthropicError, MessagesRequest
from kvload.serve.messages_input import renamed as messages_renamed
from kvload.serve.messages_input import renamed_error as messages_error
from kvload.serve.messages_input import to_chat as messages_to_chat
from kvload.serve.messages_output import message_document, message_events
from kvload.serve.metrics import ServeMetrics
from kvload.serve.protocol import (
    EFFORT_UNREAD,
    MAX_REQUEST_ID_CHARS,
    BadRequest,
    Job,
    parse,
    parse_detokenize,
    parse_tokenize,
    request_id,
)
from kvload.serve.responses_input import ResponsesRequest, renamed, renamed_error, to_chat
from kvload.serve.responses_output import in_progress, response_document, response_events
from kvload.serve.responses_store import ResponseStore
from kvload.serve.tool_calls import ToolCallText
from kvload.serve.tool_parser import tool_reader
from kvload.serve.tool_reader import ToolReader
from pipeline.audit import dropped_record
from pipeline.errors import ConfigError, GenerationError, KvBuildError
from pipeline.events import SettingIgnored, StructuredOutputsRequested
from pipeline.limits import MAX_DEPTH, MAX_LOGPROB_TOKENS, MAX_SCORED_PROMPT_TOKENS, json_depth, unique_keys
from pipeline.version import __version__


@attrs.frozen
class CorsPolicy:
    """Which browser origins may call the server, with which methods and headers (vLLM's flags and defaults)."""

    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False


@attrs.define
class ServeState:
    """What the app serves: the loaded result, its engine and metrics, the served model name, limits and defaults."""

    result: Any
    engine: ServingEngine
    metrics: ServeMetrics
    model_name: str
    max_request_bytes: int  # a larger body is refused unread (413); build_state derives it from max_seq_len
    default_max_tokens: int = 256
    #: the model's sampling defaults (``SamplingDefaults.values``): what a request that does not send a field takes
    sampling_defaults: dict[str, Any] = attrs.Factory(dict)
    read_timeout_s: float = READ_TIMEOUT_DEFAULT  # a body not all in by then is a 408 (the head: server._Deadlines)
    max_concurrent_requests: int = MAX_CONCURRENT_DEFAULT  # generation requests in the server at once; more: 503
    #: a request's own chat_template (Jinja run here, its cost the client's to choose) only when the operator says so
    trust_request_chat_template: bool = False
    #: ``POST /reset_prefix_cache`` exists only when the operator says so: any client could otherwise drop every
    #: tenant's cached prefixes, over and over (vLLM keeps it to its dev mode)
    enable_reset_prefix_cache: bool = False
    #: the tool-call parser (``--tool-call-parser``, with ``--enable-auto-tool-choice``) that lets chat's
    #: ``tool_choice`` be ``"auto"``; None: "auto" is refused
    tool_call_parser: str | None = None
    #: the reasoning parser (``--reasoning-parser``) that splits each chat reply into reasoning_content and content;
    #: None: a reply is all content
    reasoning_parser: str | None = None
    #: SHA-256 of each accepted API key (``--api-key``); empty: no key required. Never the keys: no repr shows one
    api_key_digests: tuple[bytes, ...] = attrs.field(default=(), repr=False)
    #: the responses kept for previous_response_id and GET /v1/responses/{id} (``--responses-store-max``)
    responses: ResponseStore = attrs.Factory(ResponseStore)
    #: chat completions' reply role when the request asks for a generation prompt (vLLM's ``--response-role``)
    response_role: str = "assistant"
    #: cross-origin requests from browsers (vLLM's ``--allowed-origins`` ...); None: no CORS headers at all
    cors: CorsPolicy | None = None
    #: logprobs name each token ``token_id:N`` rather than its text (vLLM's ``--return-tokens-as-token-ids``)
    return_tokens_as_token_ids: bool = False
    #: every stream carries usage, in each chunk and a last one, whatever ``stream_options`` says (vLLM's
    #: ``--enable-force-include-usage``)
    force_include_usage: bool = False
    #: the path prefix a proxy keeps in front of every endpoint (vLLM's ``--root-path``); "": none
    root_path: str = ""
    in_flight: int = 0  # generation requests in the server now (only the event loop's thread touches it)
    created: int = attrs.Factory(lambda: int(time.time()))


def create_app(state: ServeState) -> FastAPI:
    """The FastAPI app over a started (or about to start) engine."""
    app = FastAPI(title="kvload serve", docs_url=None, redoc_url=None, openapi_url=None)
    # Starlette answers "/v1/completions/" with a bodiless 307 to the URL the request's Host header names (anyone's
    # host, an open redirect); OpenAI and vLLM's clients never add the slash: a 404 naming the endpoints instead
    app.router.redirect_slashes = False
    app.state.serve = state
    # vLLM's --root-path (its app.root_path): behind a proxy that keeps the prefix, /PREFIX/v1/models is served;
    # /v1/models still is (Starlette strips the prefix only where the path has it)
    app.root_path = state.root_path
    app.add_middleware(_Admission, state=state)
    if state.api_key_digests:  # added last, so outermost: a request without the key takes no admission slot
        app.add_middleware(ApiKeyGate, digests=state.api_key_digests, metrics=state.metrics)
    if state.cors is not None:  # outermost: a browser's preflight carries no API key and takes no admission slot
        from starlette.middleware.cors import CORSMiddleware

        cors = state.cors
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.origins), allow_methods=list(cors.methods),
                           allow_headers=list(cors.headers), allow_credentials=cors.credentials)
    state.metrics.http_in_flight.set_function(lambda: state.in_flight)  # what _Admission counts, read at scrape

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        state.metrics.on_refused(exc.status, exc.code)  # every refusal a handler raises (413, 408, 400, 404, 503)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def routing(request: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's own answers (an unknown path, a method the path does not take) in OpenAI's error body, not
        # FastAPI's {"detail": ...}. Not counted as refusals: no request the server serves was refused, and a 404
        # here is no model_not_found (a probe of random paths would look like clients asking for other models).
        headers = exc.headers
        if exc.status_code == 405:  # Starlette's Allow names the first route the path matched, not every one
            headers = {**(headers or {}), "Allow": ", ".join(_allowed(app, request))}
        exc = HTTPException(exc.status_code, exc.detail, headers)
        return JSONResponse(_shaped(route_path(request.scope), _routing_error(app, request, exc)).body(),
                            status_code=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def failure(_: Request, exc: Exception) -> JSONResponse:  # never a dead server over one request
        return JSONResponse(BadRequest(f"{type(exc).__name__}: {exc}", status=500, kind="server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health() -> Response:
        if state.engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "down", "error": state.engine.loop_error}, status_code=503)

    @app.get("/ping")  # vLLM's: the probe SageMaker sends, by either method
    @app.post("/ping")
    async def ping() -> Response:
        return await health()

    def model_card() -> dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "kvload",
                "max_model_len": state.engine.executor.max_seq_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")  # a served name may hold a slash ("HuggingFaceTB/SmolLM2-135M")
    async def model(model: str) -> dict[str, Any]:
        if model != state.model_name:
            raise _not_served(model, state.model_name)
        return model_card()

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(state.metrics.render)  # a scrape may wait for the step in flight
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    if state.enable_reset_prefix_cache:
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> dict[str, Any]:
            """vLLM's dev-mode route: 200 ``{"reset": true}``; 409 while requests hold a cache (nothing dropped);
            200 ``{"reset": false, "reason": ...}`` when prefix reuse is off (nothing is cached)."""
            done, event = await asyncio.to_thread(state.engine.reset_prefix_cache)  # waits for the step in flight
            if done:
                return {"reset": True}
            if state.engine.executor.salt_ignored() is None:  # reuse is on: requests hold the cache
                raise BadRequest(f"{event.reason}; try again when they have finished", status=409,
                                 kind="conflict_error", code="prefix_cache_in_use")
            return {"reset": False, "reason": event.reason}

    @app.get("/v1/kvload/audit")
    async def audit(request: Request) -> Response:
        _only_query(request)
        log = state.result.audit
        head, tail, dropped = log.tail()
        if dropped:  # said where the records are missing, so no reader takes the log for complete
            head.append(dropped_record(dropped, kept=len(tail), keep=log.max_tail))
        lines = [json.dumps(r, default=str, separators=(",", ":")) for r in [log.header, *head, *tail]]
        return Response("\n".join(lines) + "\n", media_type="application/x-ndjson",
                        headers={"X-Kvload-Audit-Dropped": str(dropped)})

    @app.get("/v1/kvload/explain")
    async def explain(request: Request, field: str | None = None) -> dict[str, Any]:
        _only_query(request, "field")
        from kvload.cli.flags import flag_aliases
        from kvload.explain import field_chain, resolve_field
        from pipeline.config import framework_defaults
        from pipeline.paths import flatten

        if not field:
            raise BadRequest("field: required, e.g. ?field=use_kv_cache_manager_v2", param="field")
        try:
            path = resolve_field(field, flag_aliases())
        except ConfigError as exc:
            raise BadRequest(f"field: {str(exc).removeprefix('explain: ')}", param="field") from None
        keys = [p for p in flatten(framework_defaults()) if p.startswith(path + ".")]
        if keys:  # a mapping (override_generation_config): one chain a request, so one of its keys
            raise BadRequest(f"field: {field!r} is a mapping; ask for one of its keys: {', '.join(keys)}",
                             param="field")
        return field_chain(state.result.audit, path)

    @app.get("/v1/kvload/kv_events")
    async def kv_events(request: Request) -> dict[str, Any]:
        _only_query(request)
        from pipeline.errors import ConfigError as Off

        try:
            return state.result.kv_cache_events()  # drains: each event is served once
        except Off:  # the API's message names the Python setting; a server's operator needs the flag
            raise BadRequest("KV cache events are off on this server; start it with --event_buffer_max_size N "
                             "(N > 0; in Python, kv_cache_config.event_buffer_max_size)",
                             param="event_buffer_max_size") from None

    gate = asyncio.Lock()  # one request's body parsed and tokenized at a time (see _serve)
    # set on the event loop once the server stops (server._Server.shutdown): a body still arriving is not waited for
    app.state.stopping = stopping = asyncio.Event()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(state, request, "completion", gate, stopping)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(state, request, "chat", gate, stopping)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await _serve(state, request, "responses", gate, stopping)

    @app.post("/v1/messages")  # Anthropic's Messages API: every refusal in Anthropic's error document
    async def messages(request: Request) -> Response:
        try:
            return await _serve(state, request, "messages", gate, stopping)
        except BadRequest as exc:
            raise AnthropicError.of(exc) from None

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        try:
            return await _tokenizer_call(state, request, _count_tokens, gate, stopping)
        except BadRequest as exc:
            raise AnthropicError.of(exc) from None

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str, request: Request) -> dict[str, Any]:
        return state.responses.retrieve(response_id, request.query_params).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        return state.responses.remove(response_id, request.query_params)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, request: Request) -> dict[str, Any]:
        return state.responses.input_items(response_id, request.query_params)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await _tokenizer_call(state, request, _tokenize, gate, stopping)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await _tokenizer_call(state, request, _detokenize, gate, stopping)

    @app.get("/version")
    async def version() -> dict[str, str]:  # vLLM's: clients check what they talk to
        return {"version": __version__}

    for route in app.router.routes:  # HTTP's rule: a GET route answers HEAD (its headers; a probe's liveness check)
        # but kv_events, whose GET drains the events it answers: a HEAD would drop them unseen
        if isinstance(route, APIRoute) and route.methods == {"GET"} and route.path != "/v1/kvload/kv_events":
            route.methods.add("HEAD")
    return app


def _only_query(request: Request, *accepted: str) -> None:
    """A kvload route's query: each of ``accepted`` at most once, nothing else (``?field=a&field=b`` read the last;
    a misspelt parameter was dropped unread), as the /v1/responses routes take theirs."""
    params = request.query_params
    for name in params:
        if name not in accepted:
            takes = f"accepted: {', '.join(accepted)}" if accepted else "this route takes none"
            raise BadRequest(f"{name[:60]}: query parameter not supported; {takes}", param=name[:60])
        if len(params.getlist(name)) > 1:
            raise BadRequest(f"{name[:60]}: given {len(params.getlist(name))} times; give it once", param=name[:60])


def _allowed(app: FastAPI, request: Request) -> list[str]:
    """Every method some route takes at the request's path (``/v1/responses/{id}``: GET and DELETE), sorted."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(request.scope)
        if match is Match.PARTIAL:  # the path matched, the method did not
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


def _routing_error(app: FastAPI, request: Request, exc: HTTPException) -> BadRequest:
    """OpenAI's error for a Starlette ``HTTPException``, naming the method and path (and for a 405 the methods
    the path takes, as its ``Allow`` header does)."""
    # the path as routing saw it: request.url rebuilds a URL, which put back the "/" a request target without one
    # ("POST v1/completions") lacked, and the 404 then named an endpoint the server has
    method, path = request.method, request.scope.get("path", request.url.path)
    asked = f"{method} {path}"[:300]  # the path is the client's: quoted, never whole if it is huge
    if exc.status_code == 404:
        paths = sorted({route.path for route in app.routes if getattr(route, "path", None)})
        message = f"Invalid URL ({asked}): no such endpoint; kvload serve answers {', '.join(paths)}"
    elif exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow", "")
        message = f"Invalid method ({asked}): {path[:300]} takes {allow or 'other methods'} only"
    else:
        message = f"{asked}: {exc.detail}"
    return BadRequest(message, status=exc.status_code,
                      kind="server_error" if exc.status_code >= 500 else "invalid_request_error")


#: The scope key of the response id a kept Responses request reserved (``ResponseStore.claim``).
CLAIMED = "kvload.claimed_response_id"


class _Admission:
    """At most ``state.max_concurrent_requests`` generation requests in the server at once; past it, 503 at once.

    Counted from the head's arrival until the answer (a stream too) is done or the client gone, so a flood is
    refused before its bodies are read, parsed or queued for the engine. An ASGI middleware rather than uvicorn's
    ``limit_concurrency``: that counts connections, idle keep-alive ones included, and every path, so a flood
    would answer /health and /metrics with a plain-text 503 too; this leaves them answering.
    """

    #: all read a body
    PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                       "/v1/messages/count_tokens", "/tokenize", "/detokenize"})

    def __init__(self, app: Any, state: ServeState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Admit the request, or answer 503 without reading it."""
        state = self.state
        if scope["type"] != "http" or route_path(scope) not in self.PATHS:
            await self.app(scope, receive, send)
            return
        if state.in_flight >= state.max_concurrent_requests:
            limit = state.max_concurrent_requests
            busy = BadRequest(f"the server is busy: {limit:,} request{'s are' if limit != 1 else ' is'} "
                              f"already in flight, the most it takes at once (--max-concurrent-requests sets it); "
                              "retry later", status=503, kind="server_error", code="server_busy")
            state.metrics.on_refused(503)
            # Connection: close, so the body it refused is not read (uvicorn would drain it up to the read timeout)
            await JSONResponse(_shaped(route_path(scope), busy).body(), status_code=503,
                               headers={"Retry-After": "1", "Connection": "close"})(scope, receive, send)
            return
        state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:  # an exception, a cancellation (the client left mid-stream) or the answer's end
            state.in_flight -= 1
            claimed = scope.get(CLAIMED)
            if claimed is not None:
                state.responses.release(claimed)


#: The status nginx logs for a client that closed the connection before the answer; nobody receives it.
CLIENT_CLOSED = 499


async def _read_body(request: Request, limit: int, timeout: float, stopping: asyncio.Event) -> bytearray:
    """The request body, refused with 413 once it is known to pass ``limit`` bytes: by its Content-Length
    before a byte is read, else (chunked) as soon as what arrived passes it, so no oversized body is held.
    Refused with 408 when it has not all arrived ``timeout`` seconds after the handler began reading: a client
    that stops sending, or trickles, would otherwise hold the connection and the handler forever. Refused with
    503 as soon as ``stopping`` is set: uvicorn's shutdown would wait for the upload, then cancel the handler
    (a traceback and a plain-text 500). Refused with 415, unread, when it comes compressed (a Content-Encoding but
    identity), or in a Content-Type other than JSON's (none given is read as JSON)."""
    # each header as all its fields joined (HTTP's list rule): the first alone let "Content-Encoding: identity" then
    # "Content-Encoding: gzip" through, and the gzip bytes were read as JSON text
    encoding = ", ".join(request.headers.getlist("content-encoding")).strip().lower() or "identity"
    if encoding not in ("", "identity"):  # its bytes were read as JSON text: "not valid JSON: can't decode 0x8b"
        raise BadRequest(f"Content-Encoding {encoding[:40]!r}: not accepted; send the request body uncompressed "
                         "(identity)", status=415, code="unsupported_content_encoding",
                         headers={"Connection": "close"})  # refused unread, as a 413: the body is not waited for
    media = ", ".join(request.headers.getlist("content-type")) or None
    if media is not None and not _is_json(media):
        # vLLM refuses these too (FastAPI reads only a JSON body as JSON); a browser sends text/plain, a form or
        # multipart from any web page without asking the server first (no CORS preflight), so taking them as JSON
        # let every site a user visits run requests on a server with no --api-key on their machine
        raise BadRequest(f"Content-Type {media[:80]!r}: not accepted; send the request body as JSON "
                         "(Content-Type: application/json)", status=415, code="unsupported_media_type",
                         headers={"Connection": "close"})
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:  # the HTTP layer refuses a malformed Content-Length itself
        raise _too_large(limit, f"Content-Length {int(length):,}")
    body = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise _too_large(limit, f"more than {limit:,} bytes sent")

    reader = asyncio.ensure_future(read())
    stop = asyncio.ensure_future(stopping.wait())
    try:
        async with asyncio.timeout(timeout):  # the whole body, not each read: a trickle gets no more time
            await asyncio.wait((reader, stop), return_when=asyncio.FIRST_COMPLETED)
    except TimeoutError:
        expected = f"of {int(length):,}" if length.isdigit() else "of a chunked body"
        raise BadRequest(f"the request body did not arrive in time: {len(body):,} bytes {expected} came within "
                         f"{timeout:g} s (--request-read-timeout sets it)", status=408, code="request_timeout",
                         headers={"Connection": "close"}) from None
    finally:  # whichever did not finish (a cancelled handler leaves neither behind)
        stop.cancel()
        reader.cancel()
    if not reader.done() or reader.cancelled():
        raise _shutting_down()
    reader.result()  # a 413, or ClientDisconnect (the client hung up mid-upload)
    return body


def _is_json(media: str) -> bool:
    """Whether a Content-Type names JSON (``application/json``, ``application/*+json``, any parameters), or is blank."""
    kind = media.split(";", 1)[0].strip().lower()
    return kind in ("", "application/json") or (kind.startswith("application/") and kind.endswith("+json"))


def _shutting_down() -> BadRequest:
    # Connection: close, as uvicorn closes every connection once a stop is asked for
    return BadRequest("the server is shutting down and takes no new requests; retry on another server", status=503,
                      kind="server_error", code="server_shutting_down", headers={"Connection": "close"})


def _too_large(limit: int, got: str) -> BadRequest:
    # Connection: close, so the server never reads (or waits for) the rest of the body it refused
    return BadRequest(f"the request body is too large: at most {limit:,} bytes are accepted (--max-request-bytes "
                      f"sets it), got {got}", status=413, code="request_too_large", headers={"Connection": "close"})


async def _serve(state: ServeState, request: Request, kind: str, gate: asyncio.Lock,
                 stopping: asyncio.Event) -> Response:
    try:
        raw = await _read_body(request, state.max_request_bytes, state.read_timeout_s, stopping)
    except ClientDisconnect:  # hung up mid-upload: the client's doing, not a server error with a traceback
        return Response(status_code=CLIENT_CLOSED)
    run = _Run(state, request, asyncio.get_running_loop())
    # Parsing, tokenizing and checking a body of up to --max-request-bytes takes seconds of CPU: done on a worker
    # thread, so other streams and /health go on meanwhile (a fast tokenizer releases the GIL while it encodes).
    # One request at a time (vLLM's API server tokenizes on a single worker thread too): no two encodes share
    # the tokenizer at once, and a flood of big bodies uses one core, not all of them.
    async with gate:
        if state.engine.stopping:  # queued here when a stop was asked for: refused at once, not parsed first
            raise _shutting_down()
        if await request.is_disconnected():  # left while it queued here: its parse (seconds for a big body) is
            return Response(status_code=CLIENT_CLOSED)  # work for no one, ahead of every request queued behind it
        try:
            await _on_worker(stopping, run.cancel, run.prepare, raw, kind)
        except asyncio.CancelledError:  # the server is stopping: what the worker submitted, or still does, ends
            run.cancel()
            raise
    if run.job.stream:
        events = response_events(run) if run.responses is not None else message_events(run) \
            if run.messages is not None else run.stream()
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    doc = await run.collect()
    if doc and run.responses is not None:
        doc = response_document(run, doc)
    elif doc and run.messages is not None:
        doc = message_document(run, doc)
    return JSONResponse(doc)


async def _tokenizer_call(state: ServeState, request: Request, work: Any, gate: asyncio.Lock,
                          stopping: asyncio.Event) -> Response:
    """vLLM's /tokenize or /detokenize: the body read under the completions' limits, then ``work(state, body)``
    on a worker thread under the same gate as their parsing and tokenizing (a big body's encode would stall the
    event loop, and the tokenizer is used by one request at a time)."""
    try:
        raw = await _read_body(request, state.max_request_bytes, state.read_timeout_s, stopping)
    except ClientDisconnect:
        return Response(status_code=CLIENT_CLOSED)
    async with gate:
        if await request.is_disconnected():  # as _serve: no one to answer
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(await _on_worker(stopping, lambda: None, work, state, raw))


async def _on_worker(stopping: asyncio.Event, on_stop: Callable[[], Any], work: Callable[..., Any], *args: Any) -> Any:
    """``work(*args)`` on a worker thread; 503 ``server_shutting_down`` as soon as ``stopping`` is set, after
    ``on_stop()``. A thread cannot be stopped, and uvicorn's stop waited for it (a 100 MB body's parse takes
    seconds), then past its graceful timeout cancelled the handler: uvicorn's plain-text 500. The thread runs on to
    its end; ``on_stop`` sees that what it queues, if anything, is aborted."""
    worker = asyncio.ensure_future(asyncio.to_thread(work, *args))
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait((worker, stop), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        worker.cancel()
        raise
    finally:
        stop.cancel()
    if not worker.done():
        on_stop()
        worker.add_done_callback(lambda f: f.cancelled() or f.exception())  # its refusal: no one left to tell
        raise _shutting_down()
    return worker.result()


def _tokenize(state: ServeState, raw: bytes | bytearray) -> dict[str, Any]:
    """``POST /tokenize``'s answer (on a worker thread): a text's token ids, or a conversation's as the chat
    endpoint prompts with it; ``BadRequest`` naming the field."""
    body = _load(raw)
    job = parse_tokenize(body)
    _check_model(state, body)
    _check_template(state, job.template)
    engine = state.engine
    try:
        if job.messages is not None:
            ids = engine.encode_messages(job.messages, job.template, add_special_tokens=job.add_special_tokens,
                                         room=False)
        else:
            ids = engine.tokenize(job.prompt or "", add_special_tokens=job.add_special_tokens)
    except GenerationError as exc:
        raise (_messages_error(exc, job.template) if job.messages is not None
               else _field_error(exc, "prompt")) from None
    return {"count": len(ids), "max_model_len": engine.executor.max_seq_len, "tokens": ids,
            "token_strs": engine.token_strs(ids) if job.return_token_strs else None}


def _count_tokens(state: ServeState, raw: bytes | bytearray) -> dict[str, Any]:
    """Anthropic's ``POST /v1/messages/count_tokens`` (on a worker thread): the prompt's tokens, as
    ``/v1/messages`` templates the same body; ``BadRequest`` naming the Messages field."""
    chat, request = messages_to_chat(_load(raw), state.tool_call_parser, state.reasoning_parser, count=True)
    try:
        ids, _ = _encode(state.engine, _parse_body(state, chat, "chat"))
    except BadRequest as exc:
        raise messages_error(exc, request) from None
    return {"input_tokens": len(ids[0])}


def _shaped(path: str, exc: BadRequest) -> BadRequest:
    """``exc`` in the error document of the API that ``path`` serves (Anthropic's under /v1/messages)."""
    return AnthropicError.of(exc) if path.startswith("/v1/messages") else exc


def _detokenize(state: ServeState, raw: bytes | bytearray) -> dict[str, Any]:
    """``POST /detokenize``'s answer (on a worker thread): the text of token ids, special tokens shown."""
    body = _load(raw)
    tokens = parse_detokenize(body)
    _check_model(state, body)
    try:
        return {"prompt": state.engine.detokenize(tokens)}
    except GenerationError as exc:
        raise _field_error(exc, "tokens") from None


def _field_error(exc: GenerationError, field: str) -> BadRequest:
    return BadRequest(str(exc).removeprefix("generate: "), param=field)


def _messages_error(exc: GenerationError, template: dict[str, Any]) -> BadRequest:
    """A conversation the tokenizer or the chat template refused; a template the request gave is named for
    what it refused (its Jinja is the client's)."""
    msg = str(exc).removeprefix("generate: ")
    given = "chat_template" in template and "chat_template given " in msg  # refused it, or was stopped
    return BadRequest(msg, param="chat_template" if given else "messages")


def _parse(state: ServeState, raw: bytes | bytearray, kind: str) -> Job:
    """The request body as a ``Job``; ``BadRequest`` naming what is wrong."""
    body = _load(raw)
    return _parse_body(state, body, kind)


def _parse_body(state: ServeState, body: Any, kind: str) -> Job:
    """A loaded request body as a ``Job`` (``kind``: "completion" or "chat"); ``BadRequest`` naming what is wrong."""
    job = parse(body, kind, default_max_tokens=state.default_max_tokens,
                by_priority=getattr(state.engine.scheduler, "by_priority", False), defaults=state.sampling_defaults,
                tool_parser=state.tool_call_parser, reasoning_parser=state.reasoning_parser)
    _check_model(state, body)
    _check_template(state, job.template)
    if job.beam is not None:
        _check_beam(state, job.n)
    return job


def _check_beam(state: ServeState, n: int) -> None:
    """A beam search this server can run, or the 400 that says which flags serve it: beam search needs KV cache
    manager V1 and a ``max_beam_width`` of at least ``n`` (the load routes ``max_beam_width > 1`` to V1)."""
    engine = state.engine
    if engine.ranks is not None:
        raise BadRequest("use_beam_search: not served under tensor parallel (--tp_size > 1); serve the model on one "
                         "device for beam search", param="use_beam_search")
    width = engine.executor.max_beam_width
    if width <= 1:
        v2 = type(engine.manager).__name__ == "KVCacheManagerV2"
        why = " on KV cache manager V2, which cannot fork beams" if v2 else ""
        flags = f"--max_beam_width {max(n, 2)}" + (" --use_kv_cache_manager_v2 false" if v2 else "")
        raise BadRequest(f"use_beam_search: this server was started with max_beam_width=1{why}; start it with {flags} "
                         "to serve beam search", param="use_beam_search")
    if n > width:
        raise BadRequest(f"n: {n} beams with use_beam_search exceed this server's max_beam_width={width}; send n <= "
                         f"{width}, or start the server with --max_beam_width {n}", param="n")


def _check_template(state: ServeState, template: dict[str, Any]) -> None:
    """A request's own ``chat_template`` is Jinja the server runs, as slow as the client writes it (and one request
    parses at a time): refused unless the server was started with ``--trust-request-chat-template`` (vLLM's rule)."""
    if template.get("chat_template") is not None and not state.trust_request_chat_template:
        raise BadRequest("chat_template: a request's own chat template needs a server started with "
                         "--trust-request-chat-template; this one applies the model's", param="chat_template")


def _check_model(state: ServeState, body: dict[str, Any]) -> None:
    """404 ``model_not_found`` for a ``model`` (checked a string already) that is not the one served."""
    model = body.get("model")
    if model is not None and model != state.model_name:
        raise _not_served(model, state.model_name)


def _load(raw: bytes | bytearray) -> Any:
    """A request body's JSON (UTF-8 text, RFC 8259's rule for JSON between systems; a leading BOM is skipped);
    ``BadRequest`` for one that is not UTF-8, nested too deeply, not JSON, or with a key given twice."""
    try:
        # decoded here, strictly: json.loads of bytes also reads UTF-16 and UTF-32, whose bytes the depth check below
        # cannot read (a "\u2200" is a quote byte there: 100,000 brackets passed as a string, then json's decoder
        # raised RecursionError, a 500 with a traceback), and lets UTF-8-encoded surrogates through
        text = raw.decode("utf-8-sig")  # straight from the bytearray: no bytes copy of up to 129 MiB first
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset {exc.start:,} "
                         f"({exc.reason}); JSON request bodies must be UTF-8") from None
    if json_depth(raw) > MAX_DEPTH:  # before parsing: json's decoder recurses once per level
        raise BadRequest(f"the request body nests too deeply: at most {MAX_DEPTH} levels of arrays and objects "
                         "are accepted (an OpenAI request needs about 5)")
    try:
        # json keeps the last of a key given twice: refused, as in config.json and audit files
        body = json.loads(text, object_pairs_hook=unique_keys(lambda m: BadRequest(f"the request body is ambiguous: "
                                                                                    f"{m}; keep one")))
    except json.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    except ValueError:  # int() refuses a literal past sys.get_int_max_str_digits(): was a 500 with Python's advice
        raise BadRequest(f"the request body holds an integer literal of more than {sys.get_int_max_str_digits()} "
                         "digits; no field takes one past 2**63 - 1") from None
    return body


def _not_served(model: str, served: str) -> BadRequest:
    return BadRequest(f"model: {model[:300]!r} is not served here; this server serves {served!r}", param="model",
                      status=404, code="model_not_found")


def _encode(engine: ServingEngine, job: Job) -> tuple[list[list[int]], list[bool]]:
    """Token ids of every prompt, kept to their last (``truncation_side`` "right": first) ``truncate_prompt_tokens``
    (and whether each was cut); ``BadRequest`` naming the prompt or the messages when one is unusable."""
    keep = _kept_tokens(engine, job)

    def kept(ids: list[int]) -> list[int]:
        return ids if not keep else ids[:keep] if job.truncation_side == "right" else ids[-keep:]

    if job.kind == "chat":
        try:
            ids = engine.encode_messages(job.prompts[0], job.template, add_special_tokens=job.add_special_tokens,
                                         room=keep is None)  # cut first, then it fits
        except GenerationError as exc:
            raise _messages_error(exc, job.template) from None
        return [kept(ids)], [keep is not None and len(ids) > keep]
    out, cut = [], []
    for i, prompt in enumerate(job.prompts):
        field = "prompt" if len(job.prompts) == 1 else f"prompt[{i}]"
        if engine.stopping:  # a stop asked for mid-request: end now, not after encoding up to 1,024 prompts
            raise _shutting_down()
        try:
            if keep is not None:  # vLLM's: the token ids are cut (a BOS too), then checked as any prompt's
                ids = engine.prompt_ids(prompt, add_special_tokens=job.add_special_tokens)
                cut.append(len(ids) > keep)
                prompt = kept(ids)
            out.append(engine.encode(prompt, add_special_tokens=job.add_special_tokens))
        except GenerationError as exc:
            detail = str(exc).removeprefix("generate: ").removeprefix("prompt 0: ").removeprefix("prompt 0 ")
            raise BadRequest(f"{field}: {detail}", param=field) from None
    return out, cut or [False] * len(out)


def _kept_tokens(engine: ServingEngine, job: Job) -> int | None:
    """How many of each prompt's last tokens ``truncate_prompt_tokens`` keeps (None: all): at most what the
    context length leaves after ``max_tokens`` (1 when not given), which -1 asks for, as vLLM counts it."""
    if job.truncate is None:
        return None
    limit = engine.executor.max_seq_len
    wanted = job.params.max_tokens if job.max_tokens_given else 1
    room = limit - wanted
    if room < 1:  # no truncation can help: max_tokens alone fills the context (a prompt needs a token)
        raise BadRequest(f"{job.max_tokens_field}: {wanted} leaves no room for a prompt in this model's context "
                         f"length of {limit} tokens (truncate_prompt_tokens cannot help); ask for fewer",
                         param=job.max_tokens_field)
    if job.truncate == -1:
        return max(room, 1)  # a max_tokens past the context length is refused as such (submit)
    if job.truncate > room:
        raise BadRequest(f"truncate_prompt_tokens: {job.truncate} is more than max_model_len - "
                         f"{job.max_tokens_field if job.max_tokens_given else 'one generated token'} = {limit} - "
                         f"{wanted} = {room}; request a smaller truncation size (or -1 for that many)",
                         param="truncate_prompt_tokens")
    return job.truncate


@attrs.frozen
class _Update:
    """What one engine event adds to a choice: text, token ids, their logprobs and text offsets."""

    text: str
    token_ids: list[int]
    logprobs: list[tuple[float, dict[int, float]]]
    offsets: list[int]


@attrs.define(eq=False)
class _Choice:
    """One choice's growing text: stop strings cut it, an incomplete character or a possible stop is held back."""

    index: int
    engine: ServingEngine
    sample: SampleText | None  # None without a tokenizer (token ids only)
    track_offsets: bool = False  # completions' logprobs.text_offset asked for
    min_tokens: int = 0  # stop strings are looked for only after this many tokens (as the engine does)
    #: the text of every token so far, for the offsets (no stop string cuts it); None without a tokenizer
    offsets: SampleText | None = None
    req_id: str = ""
    token_ids: list[int] = attrs.Factory(list)
    logprobs: list[tuple[float, dict[int, float]]] = attrs.Factory(list)
    text_offsets: list[int] = attrs.Factory(list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    reused: int = 0
    echo: _Echo | None = None  # completions' echo: the prompt, put before the choice's text (and its logprobs)
    echoed: bool = False  # a stream sent the echo (in the choice's first chunk)
    echo_only: bool = False  # echo without generation (max_tokens 0): the token the engine draws is dropped
    opened: bool = False  # a stream sent the choice's first chunk (return_token_ids: its prompt_token_ids)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # when scored (engine): echo or prompt_logprobs
    tools: ToolCallText | None = None  # chat's tool_choice named or "required": the reply read as tool calls
    auto: ToolReader | None = None  # chat's tool_choice "auto" under a parser: the free text read for calls
    thinking: ReasoningText | None = None  # chat under --reasoning-parser: the reply split into reasoning, content
    #: /v1/responses under --reasoning-parser: the reply read as it grows, to count the tokens made while thinking
    gauge: ReasoningText | None = None
    reasoning_tokens: int = 0  # tokens from the one that began the thinking to the one that ended it
    _thinking_from: int = 0  # the token the gauge's thinking began with (deepseek_r1: the first)
    _settled: int = 0  # the tokens whose text the gauge has placed (none of it held as a possible marker)

    def update(self, ev: ServeEvent) -> _Update:
        """Take one engine event; the new text, token ids, logprobs and text offsets to report."""
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs = list(ev.prompt_logprobs)
        if self.echo_only:  # vLLM's echo without generation: the prompt alone, ended by max_tokens 0
            self.prompt_tokens, self.reused = ev.prompt_tokens, ev.reused_prompt_tokens
            if ev.finish_reason is not None:
                self.finish_reason = "length" if ev.finish_reason in ("stop", "length") else ev.finish_reason
                self.error = ev.error
            return _Update("", [], [], [])
        self.token_ids = list(ev.token_ids)
        self.logprobs.extend(ev.logprobs)
        self.prompt_tokens, self.reused = ev.prompt_tokens, ev.reused_prompt_tokens
        if ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason
            self.stop_reason = ev.stop_reason
            self.error = ev.error
        offsets = self._offsets(len(ev.new_token_ids))
        self.text_offsets.extend(offsets)
        delta = ""
        if self.sample is not None:  # the same text rules as LLM.generate: stop strings cut, never shown
            final = self.finish_reason is not None
            # the EOS or stop token that ended it stays in token_ids, not in the text unless include_stop_str_in_output
            # (generate's rule, vLLM's)
            ids = self.token_ids[:-1] if ev.stopped_by_token and not self.sample.include_stop else self.token_ids
            m, new = self.min_tokens, len(ev.new_token_ids)
            if m and new > 1:  # confirmed drafts: searched token by token, as the engine searched them
                for end in range(max(1, len(self.token_ids) - new + 1), len(ids)):
                    self.sample.update(self.token_ids[:end], search=end > m)
            self.sample.update(ids, final=final, search=len(ids) > m)
            delta = self.sample.delta(final=final)
            self.text += delta
        if self.gauge is not None:
            started, ended = self.gauge.thinking_started, self.gauge.ended
            self.gauge.feed(delta)
            if not started and self.gauge.thinking_started:  # qwen3's <think>: the thinking counts from the token
                self._thinking_from = self._settled  # that began the marker (its text was held until it completed)
            if not self.gauge.holding:  # nothing held that may be a marker: the text so far is placed
                self._settled = len(self.token_ids)
            if self.gauge.thinking_started and not ended:  # the event that ends the thinking counts as thinking
                self.reasoning_tokens = len(self.token_ids) - self._thinking_from
        return _Update(delta, list(ev.new_token_ids), list(ev.logprobs), offsets)

    def _offsets(self, new: int) -> list[int]:
        """Where each of the last ``new`` tokens' text begins in the choice's text (characters, as vLLM counts); a
        token that only starts a character begins where the token completing it does. Without a tokenizer the
        text is empty: 0."""
        if not self.track_offsets or self.offsets is None:
            return [0] * new if self.track_offsets else []
        return _token_offsets(self.offsets, self.token_ids, len(self.token_ids) - new)

    @property
    def reason(self) -> str:
        """OpenAI's finish reason; "tool_calls" for a "required" reply the grammar ended (vLLM's: a named call's
        stays "stop", as in OpenAI's API; a stop string or stop token that cut it is "stop", its ``stop_reason``
        saying which), and for an "auto" reply that made a call (vLLM's, cut by length too)."""
        reason = {"stop": "stop", "length": "length"}.get(self.finish_reason or "", self.finish_reason or "stop")
        if self.auto is not None and self.auto.calls and reason in ("stop", "length"):
            return "tool_calls"
        ended = reason == "stop" and self.stop_reason is None  # by the grammar's end-of-sequence, not a user's stop
        answered = self.thinking is None or self.thinking.ended  # a reply that never ended its thinking made no call
        return "tool_calls" if ended and answered and self.tools is not None and self.tools.required else reason


@attrs.frozen
class _Echo:
    """A completion prompt as ``echo`` puts it before the choice: its text, token ids and each token's text offset."""

    text: str
    token_ids: list[int]
    offsets: list[int]

    @classmethod
    def of(cls, prompt: Any, ids: list[int], tokenizer: Any, skip_special: bool, spaced: bool = True) -> _Echo:
        """The prompt as given when text (vLLM's), else its decoded ids; offsets where each token's text begins."""
        if tokenizer is None:
            return cls("", list(ids), [0] * len(ids))
        decoded = SampleText(tokenizer, skip_special=skip_special, spaced=spaced)
        offsets = _token_offsets(decoded, ids, 0, final=True)
        return cls(prompt if isinstance(prompt, str) else decoded.text, list(ids), offsets)


def _header_request_id(request: Request) -> str | None:
    """The ``X-Request-Id`` header (vLLM's), checked as ``request_id`` is, and ASCII: a header's other bytes are read
    as Latin-1, so UTF-8 sent there came back in the answer's id as mojibake (``Ã¿``). Given twice is a 400: which one
    names the request is not for the server to guess."""
    values = request.headers.getlist("x-request-id")
    if len(values) > 1:
        raise BadRequest(f"X-Request-Id: given {len(values)} times; give it once", param="X-Request-Id")
    value = values[0] if values else None
    if value is not None and not value.isascii():
        raise BadRequest(f"X-Request-Id: expected printable ASCII of 1 to {MAX_REQUEST_ID_CHARS} characters (a header "
                         f"carries no other text; send request_id in the body for Unicode), got {value[:60]!r}",
                         param="X-Request-Id")
    return request_id(value, "X-Request-Id")


def _token_offsets(text: SampleText, token_ids: list[int], first: int, final: bool = False) -> list[int]:
    """Where tokens ``first`` on begin in ``text``, decoded up to each in turn (``text`` holds tokens ``:first``
    already); a token that only starts a character begins where the token completing it does. ``final``: the last
    token ends the text (an unfinished character at the end is decoded as is)."""
    out = []
    for end in range(first + 1, len(token_ids) + 1):
        out.append(len(text.text))  # the text before this token (an unfinished character held back)
        text.update(token_ids[:end], final=final and end == len(token_ids))
    return out


class _Run:
    """The engine requests of one HTTP request, and their answer."""

    def __init__(self, state: ServeState, request: Request, loop: asyncio.AbstractEventLoop) -> None:
        self.state = state
        self.engine = state.engine
        self.request = request
        self.loop = loop
        self.job: Job = None  # type: ignore[assignment]  # set by prepare
        self.prompts: list[list[int]] = []
        self.queue: asyncio.Queue[tuple[int, ServeEvent] | None] = asyncio.Queue()  # None: the client left
        self.choices: list[_Choice] = []
        self.open: set[int] = set()
        self.id = ""
        self.created = 0
        self.role = "assistant"  # chat: the reply's role (vLLM's: the last message's without a generation prompt)
        self.chat_echo = ""  # chat's echo: the last message's content, put before each reply (vLLM's)
        # prepare runs on a worker thread: cancel (the event loop's) and each submit take turns under this lock,
        # so a request the server gave up on while it was being submitted never stays queued in the engine
        self.lock = threading.Lock()
        self.cancelled = False
        self.responses: ResponsesRequest | None = None  # a /v1/responses request: what its answer echoes
        self.messages: MessagesRequest | None = None  # a /v1/messages request: where its chat messages came from
        self.streamed: list[dict[str, Any]] = []  # a Responses stream's output items so far (the open one last)

    def prepare(self, raw: bytes | bytearray, kind: str) -> None:
        """Parse, tokenize, check and queue the request (on a worker thread); ``BadRequest`` when refused.
        ``kind`` "responses": OpenAI's Responses body ("messages": Anthropic's Messages body), served as the chat
        body saying the same, its refusals named in its own words."""
        if kind == "messages":
            self._prepare_messages(raw)
            return
        if kind != "responses":
            self._prepare(_parse(self.state, raw, kind))
            return
        try:
            chat, self.responses = to_chat(_load(raw), self.state.tool_call_parser, self.state.responses)
            if self.responses.store:  # what a kept response holds is about what its request sent
                self.state.responses.check_size(len(raw), self.engine.executor.max_seq_len)
            job = _parse_body(self.state, chat, "chat")
            job = attrs.evolve(job, max_tokens_field="max_output_tokens",
                               effort_field=job.effort_field and "reasoning.effort",
                               structured_field="text.format" if job.structured_field == "response_format"
                               else job.structured_field,
                               ignored=tuple((renamed(name, self.responses), value, why)
                                             for name, value, why in job.ignored) + self.responses.ignored)
            self._prepare(job)
        except BadRequest as exc:
            raise renamed_error(exc, self.responses) from None

    def _prepare_messages(self, raw: bytes | bytearray) -> None:
        """:meth:`prepare` for Anthropic's Messages body: served as the chat body saying the same, refusals and
        reported settings named in its own words."""
        try:
            chat, self.messages = messages_to_chat(_load(raw), self.state.tool_call_parser,
                                                   self.state.reasoning_parser)
            job = _parse_body(self.state, chat, "chat")
            job = attrs.evolve(job, max_tokens_field="max_tokens",
                               effort_field=job.effort_field and "output_config.effort",
                               ignored=tuple((messages_renamed(name, self.messages), value, why)
                                             for name, value, why in job.ignored) + self.messages.ignored)
            self._prepare(job)
        except BadRequest as exc:
            raise messages_error(exc, self.messages) from None

    def _prepare(self, job: Job) -> None:
        """:meth:`prepare` once the body is a ``Job``."""
        self.job = job
        # vLLM's: an X-Request-Id header names the request, else its request_id, else a fresh id
        given = _header_request_id(self.request) or job.request_id
        prefix = "resp_" if self.responses is not None else "msg_" if self.messages is not None \
            else "chatcmpl-" if job.kind == "chat" else "cmpl-"
        self.id = prefix + (given or uuid.uuid4().hex)
        if given and self.responses is not None and self.responses.store:  # a fresh id names nothing kept
            header = "x-request-id" in self.request.headers
            self.state.responses.claim(self.id, "X-Request-Id" if header else "request_id")
            self.request.scope[CLAIMED] = self.id  # let go by _Admission once the request ends, however it ends
        self.prompts, cut = _encode(self.engine, job)
        scored = sum(map(len, self.prompts)) if job.params.prompt_logprobs is not None else 0
        if scored > MAX_SCORED_PROMPT_TOKENS:
            field = "prompt_logprobs" if job.prompt_logprobs is not None else "echo"
            why = "prompt_logprobs" if field == "prompt_logprobs" else "echo: with logprobs"
            raise BadRequest(f"{why} every prompt token is scored and returned; at most "
                             f"{MAX_SCORED_PROMPT_TOKENS:,} prompt tokens per request, got {scored:,} (send fewer "
                             "prompts per request)", param=field)
        tok = self.engine.tokenizer
        offsets = job.kind == "completion" and job.logprobs is not None
        p = job.params
        text = {"skip_special": p.skip_special_tokens, "spaced": p.spaces_between_special_tokens}
        self.choices = [_Choice(i, self.engine, SampleText(tok, job.stop, include_stop=p.include_stop_str_in_output,
                                                           **text) if tok is not None else None,
                                track_offsets=offsets, min_tokens=p.min_tokens,
                                offsets=SampleText(tok, **text) if offsets and tok is not None else None)
                        for i in range(len(self.prompts) * job.n)]
        if job.echo and job.kind == "completion":  # a cut prompt is echoed as what the model saw: its kept tokens
            echoes = [_Echo.of(ids if was_cut else prompt, ids, tok, p.skip_special_tokens,
                               p.spaces_between_special_tokens)
                      for prompt, ids, was_cut in zip(job.prompts, self.prompts, cut, strict=True)]
            for c in self.choices:
                c.echo, c.echo_only = echoes[c.index // job.n], job.echo_only
        if job.tool_choice is not None:
            for c in self.choices:
                c.tools = ToolCallText(job.tool_choice)
        if job.auto_tools is not None:
            for c in self.choices:
                c.auto = tool_reader(job.auto_tools.parser, job.auto_tools.names, job.auto_tools.parallel)
        if job.reasoning is not None:
            for c in self.choices:
                c.thinking = ReasoningText(job.reasoning)
                if self.responses is not None:  # usage.output_tokens_details.reasoning_tokens
                    c.gauge = ReasoningText(job.reasoning)
        if job.kind == "chat":  # vLLM's reply role, and its echo: the last message when it is the reply's role
            last = job.prompts[0][-1]
            self.role = self.state.response_role if job.template.get("add_generation_prompt", True) else last["role"]
            self.chat_echo = last["content"] if job.echo and last["role"] == self.role else ""
        self.created = int(time.time())
        if self.responses is not None and self.responses.store:  # GET answers it while it is generated, not a 404
            self.state.responses.begin(self.id, functools.partial(in_progress, self))
            self.request.scope[CLAIMED] = self.id  # dropped by _Admission once the request ends, however it ends
        self.submit()

    def cancel(self) -> None:
        """Give up on the request from the event loop: what is queued is aborted, nothing more is queued."""
        with self.lock:
            self.cancelled = True
            self.abort()

    def submit(self) -> None:
        """Check every engine request fits, then queue them all (nothing queued when one is refused)."""
        job = self.job
        plan = []
        for i, ids in enumerate(self.prompts):
            if self.engine.stopping:  # as in _encode: up to 1,024 checks would only end in EngineStopped
                raise _shutting_down()
            params = job.params
            room = self.engine.room(ids)
            if not job.max_tokens_given:  # the default never asks for more than max_seq_len leaves
                cap = max(1, min(params.max_tokens, room))  # min_tokens past it ends by length, as in generate
                params = attrs.evolve(params, max_tokens=cap, min_tokens=min(params.min_tokens, cap))
            elif 0 < room < params.max_tokens:  # asked for: refused, as vLLM does, not silently cut (a prompt with
                raise self._too_long(i, ids, params.max_tokens)  # no room at all is the prompt's error, below
            try:
                self.engine.check(ids, params)
            except GenerationError as exc:  # a sampling value the model cannot take (stop_token_ids, logprobs)
                msg = str(exc).removeprefix("generate: ")
                head = msg.split(":", 1)[0].split("[", 1)[0]  # bad_words[2]: the field
                if head.split(".", 1)[0] == "structured_outputs" and job.structured_field is not None:
                    # the schema xgrammar refused (or xgrammar missing), named as the request named it
                    field, msg = (job.structured_field, msg) if job.tool_choice is None else \
                        self._refused_tool(ids, params, msg)
                    if field != "structured_outputs":
                        msg = field + ":" + msg.split(":", 1)[1]
                    raise BadRequest(msg, param=field) from None
                raise BadRequest(msg, param=head if head.isidentifier() else "prompt") from None
            except KvBuildError as exc:
                raise self._never_fits(job, i, len(ids), exc) from None
            plan.append((ids, params))
        if job.params.logprobs is not None:
            most = sum(params.max_tokens for _, params in plan) * job.n
            if most > MAX_LOGPROB_TOKENS:
                raise BadRequest(f"logprobs: every generated token's top log-probabilities are kept until the answer "
                                 f"is sent; at most {MAX_LOGPROB_TOKENS:,} generated tokens per request with logprobs, "
                                 f"and this one may generate {most:,} ({len(plan) * job.n:,} choices × max_tokens); "
                                 "ask for fewer choices or tokens per request", param="logprobs")
        # once per HTTP request (not per prompt or choice), and only for one that is served
        # under beam search n is its width, not identical greedy samples
        self.engine.report_ignored(job.params, 1 if job.beam is not None else job.n, request=self.id, salt=job.salt,
                                   model_defaults=job.model_defaults)
        if job.params.structured_outputs is not None:  # what was asked, never the spec itself
            self.engine.notify(StructuredOutputsRequested(request=self.id, field=job.structured_field or "",
                                                          tool_choice=job.tool_choice and job.tool_choice.mode,
                                                          **job.params.structured_outputs.describe()))
        if job.effort_field is not None and not template_reads(self.engine.tokenizer, job.template,
                                                               ("reasoning_effort", "enable_thinking")):
            job = attrs.evolve(job, ignored=(*job.ignored, (job.effort_field, job.template["reasoning_effort"],
                                                            EFFORT_UNREAD)))
        if job.ignored:  # accepted as vLLM accepts them, yet they can change nothing here
            self.engine.notify(*[SettingIgnored(field=f"serve.{name}", value=value, reason=f"{why} (request {self.id})")
                                 for name, value, why in job.ignored])
        try:
            for i, (ids, params) in enumerate(plan):
                indices = range(i * job.n, (i + 1) * job.n)  # the prompt's n choices: one prefill, n forks of it
                sinks = [functools.partial(_post, self.loop, self.queue, index) for index in indices]
                with self.lock:
                    if self.cancelled:
                        return
                    try:
                        if job.beam is not None:  # the prompt's n best hypotheses, best first
                            rids = self.engine.submit_beam(ids, attrs.evolve(job.beam, max_tokens=params.max_tokens),
                                                           sinks, salt=job.salt)
                        else:
                            rids = self.engine.submit_group(ids, params, sinks, salt=job.salt,
                                                            priority=job.priority)
                    except EngineStopped as exc:  # a 503 naming the cause, not a 500 with a traceback
                        if self.engine.loop_error is None:
                            raise _shutting_down() from None
                        # the loop died (a bug, /health says "down"): this server will answer nothing more
                        raise BadRequest(str(exc), status=500, kind="server_error") from None
                    for index, rid in zip(indices, rids, strict=True):
                        self.choices[index].req_id = rid
                        self.open.add(index)
        except BaseException:
            with self.lock:
                self.abort()
            raise

    def _refused_tool(self, ids: list[int], params: Any, msg: str) -> tuple[str, str]:
        """The field to name when xgrammar refused ``tool_choice``'s schema, and the refusal: the named function's
        parameters; for "required", the first tool whose parameters are refused on their own, with that refusal (its
        paths within the tool's parameters, not within the schema of all the calls) (``tools`` when none is: their
        combination); ``tool_choice`` when it is not the schema (xgrammar missing)."""
        choice = self.job.tool_choice
        schema_words = ("xgrammar refused it", ANY_VALUE, COSTLY, NO_VALUE, OUTSIDE, SLOW_COMPILE)
        if not any(words in msg for words in schema_words):
            return "tool_choice", msg
        tools = [choice.tool] if choice.tool is not None else range(len(choice.schemas))
        for i in tools:
            alone = attrs.evolve(params, structured_outputs=StructuredOutputsParams(json=choice.schemas[i]))
            try:
                self.engine.check(ids, alone)
            except GenerationError as exc:
                return f"tools[{i}].function.parameters", str(exc).removeprefix("generate: ")
            except KvBuildError:  # past the schema's checks: not this one
                continue
        return "tools", msg

    def _never_fits(self, job: Any, i: int, prompt: int, exc: KvBuildError) -> BadRequest:
        """A request that could not complete even alone in the KV cache, with the advice a client can follow: fewer
        ``max_tokens`` when some would fit after its prompt, else a shorter prompt (``prompt``/``messages``)."""
        where = "" if len(self.prompts) == 1 else f"prompt {i}: "
        text = getattr(exc, "shortfall", None)
        longest = getattr(exc, "longest_sequence", None)
        if text is None or longest is None:  # not _check_fits' refusal: its own words
            text, advice = str(exc).removeprefix("generate: "), ""
        elif longest > prompt:
            advice = (f"; lower max_tokens to at most {longest - prompt:,}, or serve with a larger KV budget "
                      "(--max_tokens)")
        else:
            advice = (f"; shorten the prompt (the KV cache holds one sequence of {longest:,} tokens), or serve with a "
                      "larger KV budget (--max_tokens)")
        prompt_field = "messages" if job.kind == "chat" else "prompt"
        field = job.max_tokens_field if job.max_tokens_given and longest is not None and longest > prompt \
            else prompt_field
        text = text.replace("max_new_tokens", "max_tokens")
        return BadRequest(f"{field}: this request could never fit the KV cache: {where}{text}{advice}", param=field)

    def _too_long(self, i: int, ids: list[int], max_tokens: int) -> BadRequest:
        """vLLM's refusal of a ``max_tokens`` past what the context length leaves after the prompt, in its words."""
        limit, field = self.engine.executor.max_seq_len, self.job.max_tokens_field
        where = "" if len(self.prompts) == 1 else f" (prompt {i})"
        return BadRequest(f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                          f"context length is {limit} tokens and your request has {len(ids)} input tokens "
                          f"({max_tokens} > {limit} - {len(ids)}){where}", param=field)

    def abort(self) -> None:
        """Abort every engine request still open (the client went away or something failed)."""
        for index in self.open:
            self.engine.abort(self.choices[index].req_id)
        self.open.clear()

    async def _next(self) -> tuple[int, ServeEvent] | None:
        """The next engine event; None when the client disconnected (its requests are then aborted)."""
        item = await self.queue.get()
        if item is None:
            self.abort()
        return item

    async def _watch_disconnect(self) -> None:
        """Wait for the client to go away (ASGI ``http.disconnect``), then wake :meth:`collect` to abort.

        Only for plain responses: a streaming response has Starlette listen and cancel the stream itself.
        """
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                self.queue.put_nowait(None)  # type: ignore[arg-type]
                return

    async def collect(self) -> dict[str, Any]:
        """Wait for every choice; the whole response document."""
        watcher = asyncio.create_task(self._watch_disconnect())
        try:
            while self.open:
                item = await self._next()
                if item is None:
                    return {}
                index, ev = item
                self.choices[index].update(ev)
                if ev.finished:
                    self.open.discard(index)
        finally:
            watcher.cancel()
            self.abort()
        failed = next((c for c in self.choices if c.finish_reason == "error"), None)
        if failed is not None:  # the engine's failure (an out-of-memory forward): said once in the operator's log
            # (engine_step_failed), so a 500 here with no traceback, and the keep-alive connection serves on
            raise BadRequest(failed.error or "the engine failed this request", status=500, kind="server_error")
        doc = {"id": self.id, "object": "chat.completion" if self.job.kind == "chat" else "text_completion",
               "created": self.created, "model": self.state.model_name,
               "choices": [self._choice(c) for c in self.choices], "usage": self._usage()}
        if self.job.kind == "chat":  # vLLM's: the conversation's prompt scores, once per answer
            doc["prompt_logprobs"] = self._prompt_logprobs(self.choices[0])
            if self.job.return_token_ids:  # and its tokens, the template's output
                doc["prompt_token_ids"] = self.prompts[0]
        return doc

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events: a chunk per step with new text, a last chunk with the finish reason (or an error chunk),
        then [DONE]."""
        try:
            if self.job.kind == "chat":
                nothing = _Update("", [], [], [])
                for c in self.choices:
                    yield _sse(self._chunk(c, {"role": self.role, "content": ""}, nothing, False))
                if self.chat_echo:  # vLLM's: the echoed message in a chunk of its own, after the role's
                    for c in self.choices:
                        yield _sse(self._chunk(c, self.chat_echo, nothing, False))
            async for c, update, finished, delta in self.deltas():
                if delta is None:
                    err = BadRequest(c.error or "the engine failed this request", status=500, kind="server_error")
                    yield _sse(err.body())
                    yield "data: [DONE]\n\n"  # vLLM's too: a client reading to [DONE] is not left waiting on the close
                    return
                if c.echo_only and not c.echoed:  # echo without generation: the prompt, then the ending on its own
                    yield _sse(self._chunk(c, "", update, False))
                yield _sse(self._chunk(c, delta, update, finished))
            if self.job.include_usage or self.state.force_include_usage:
                yield _sse({"id": self.id, "object": self._chunk_object, "created": self.created,
                            "model": self.state.model_name, "choices": [], "usage": self._usage()})
            yield "data: [DONE]\n\n"
        finally:  # a closed connection cancels this generator: free what it still holds
            self.abort()

    async def deltas(self) -> AsyncIterator[tuple[_Choice, _Update, bool, Any]]:
        """Each engine event that says something, as (choice, update, finished, delta): the delta a stream sends for
        it (the new text, or under a reasoning parser or tools chat's delta object); None for a choice the engine
        failed, which ends it. Ends when every choice has finished or the client went away."""
        while self.open:
            item = await self._next()
            if item is None:
                return
            index, ev = item
            c = self.choices[index]
            update = c.update(ev)
            if ev.finished:
                self.open.discard(index)
            if c.finish_reason == "error":
                yield c, update, True, None
                return
            if update.text or update.token_ids or ev.finished:
                delta: Any = update.text
                if c.thinking is not None:  # the thinking as it comes; the answer as content (or read for calls)
                    delta = self._thinking_delta(c, update.text, ev.finished)
                elif c.tools is not None:  # the text as tool call deltas (none yet: an empty delta, its tokens)
                    calls = c.tools.feed(update.text) + (c.tools.finish() if ev.finished else [])
                    delta = {"tool_calls": calls} if calls else {}
                elif c.auto is not None:  # the text outside the calls; each call named, then its arguments as read
                    delta = self._auto_delta(c.auto, update.text, ev.finished)
                yield c, update, ev.finished, delta

    # --- documents ---------------------------------------------------------------------------

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.job.kind == "chat" else "text_completion"

    def _chunk(self, c: _Choice, delta: Any, update: _Update, finished: bool) -> dict[str, Any]:
        ids, lps = update.token_ids, update.logprobs
        ending = {"finish_reason": c.reason if finished else None, "stop_reason": c.stop_reason if finished else None,
                  "token_ids": ids}
        if self.job.kind == "chat":
            body = delta if isinstance(delta, dict) else {"content": delta}
            choice = {"index": c.index, "delta": body, "logprobs": self._chat_logprobs(ids, lps), **ending}
        else:
            # the prompt, in the first chunk (echo without generation: in one before the ending's)
            echo = c.echo is not None and not c.echoed and bool(ids or finished or c.echo_only)
            c.echoed = c.echoed or echo
            choice = {"index": c.index, "text": (c.echo.text if echo else "") + delta,
                      "logprobs": self._completion_logprobs(ids, lps, update.offsets, c, echo), **ending}
        doc = {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.state.model_name,
               "choices": [choice]}
        if self.job.return_token_ids and not c.opened:  # vLLM's: in the choice's first chunk (chat: its role's)
            (doc if self.job.kind == "chat" else choice)["prompt_token_ids"] = self.prompts[c.index // self.job.n]
        c.opened = True
        # vLLM's: the choice's prompt and its tokens so far, in every chunk (--enable-force-include-usage: always)
        if self.job.continuous_usage or self.state.force_include_usage:
            prompt = len(self.prompts[c.index // self.job.n])
            doc["usage"] = {"prompt_tokens": prompt, "completion_tokens": len(c.token_ids),
                            "total_tokens": prompt + len(c.token_ids)}
        return doc

    def _choice(self, c: _Choice) -> dict[str, Any]:
        ids = c.token_ids
        if self.job.kind == "chat":
            message: dict[str, Any] = {"role": self.role, "content": self.chat_echo + c.text}
            if c.thinking is not None:  # vLLM's: the thinking apart; the answer as content, or read for calls
                message = self._thinking_message(c)
            elif c.tools is not None:  # vLLM's: the content empty (but an echo), the reply read as the calls
                c.tools.feed(c.text)
                c.tools.finish()
                message = {"role": self.role, "content": self.chat_echo, "tool_calls": c.tools.message()}
            elif c.auto is not None:  # the calls the text holds, and the text around them (vLLM's: null when none)
                message = self._auto_message(c.auto, c.text)
            if self.state.reasoning_parser is not None and "reasoning_content" not in message:  # vLLM's: always there
                message.update(reasoning_content=None, reasoning=None)  # (qwen3 with its thinking switched off)
            ending = {"finish_reason": c.reason, "stop_reason": c.stop_reason, "token_ids": ids}  # the calls read
            return {"index": c.index, "message": message, "logprobs": self._chat_logprobs(ids, c.logprobs), **ending}
        ending = {"finish_reason": c.reason, "stop_reason": c.stop_reason, "token_ids": ids}
        return {"index": c.index, "text": (c.echo.text if c.echo is not None else "") + c.text,
                "logprobs": self._completion_logprobs(ids, c.logprobs, c.text_offsets, c, c.echo is not None),
                **ending, "prompt_logprobs": self._prompt_logprobs(c),
                **({"prompt_token_ids": self.prompts[c.index // self.job.n]} if self.job.return_token_ids else {})}

    def _auto_message(self, auto: ToolReader, text: str) -> dict[str, Any]:
        """An "auto" reply's message: the calls ``text`` holds, and the text around them (vLLM's: null when none)."""
        auto.feed(text)
        auto.finish()
        content = auto.content
        return {"role": self.role, "content": self.chat_echo + content if content is not None else self.chat_echo
                or None, "tool_calls": auto.calls}

    def _thinking_message(self, c: _Choice) -> dict[str, Any]:
        """A reply under ``--reasoning-parser``: ``reasoning_content`` (vLLM's newer name ``reasoning`` too; null when
        none) and the answer as content, or read for calls: "auto" tools' or a named or "required" ``tool_choice``'s
        (none when the thinking never ended)."""
        thinking, auto = c.thinking, c.auto
        thinking.feed(c.text)
        thinking.finish()
        reasoning, answer = thinking.reasoning, thinking.content
        if c.tools is not None:  # the grammar held the answer: it is the calls; qwen3's text before <think> is content
            if thinking.ended:
                c.tools.feed(thinking.answer)
                c.tools.finish()
            before = (answer or "")[:len(answer or "") - len(thinking.answer)]
            message = {"role": self.role, "content": self.chat_echo + before, "tool_calls": c.tools.message()}
        elif auto is not None and answer is not None:  # no answer (the thinking never ended): no calls, content null
            message = self._auto_message(auto, answer)
        else:
            message = {"role": self.role, "content": self.chat_echo + answer if answer is not None
                       else self.chat_echo or None}
            if auto is not None:
                message["tool_calls"] = []
        if not self.job.include_reasoning:  # vLLM's include_reasoning: false
            reasoning = None
        return {**message, "reasoning_content": reasoning, "reasoning": reasoning}

    def _thinking_delta(self, c: _Choice, text: str, finished: bool) -> dict[str, Any]:
        """A stream's delta for a reply's new ``text`` under ``--reasoning-parser``: its new thinking as
        ``reasoning_content`` (and ``reasoning``), the answer as content or, for tools, content and calls."""
        before, reasoning, answer = c.thinking.read(text)
        if finished:
            more = c.thinking.finish_read()
            before, reasoning, answer = before + more[0], reasoning + more[1], answer + more[2]
        if c.tools is not None:  # named or "required": the answer is the calls, as the whole answer reads them
            calls = c.tools.feed(answer) if answer else []  # (nothing while thinking: a reply cut there made no call)
            if finished and c.thinking.ended:
                calls += c.tools.finish()
            delta: dict[str, Any] = {"content": before} if before else {}
            if calls:
                delta["tool_calls"] = calls
        elif c.auto is not None:
            delta = self._auto_delta(c.auto, before + answer, finished)
        else:
            delta = {"content": before + answer} if before or answer else {}
        if reasoning and self.job.include_reasoning:
            return {"reasoning_content": reasoning, "reasoning": reasoning, **delta}
        return delta

    @staticmethod
    def _auto_delta(auto: ToolReader, text: str, finished: bool) -> dict[str, Any]:
        """A stream's delta for an "auto" reply's new ``text``: its content, and its calls' new names and arguments."""
        content, calls = auto.feed(text, final=finished)
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _prompt_logprobs(self, c: _Choice) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's ``prompt_logprobs`` of the choice's prompt: per token (the first None) the token's own entry then
        its top alternatives, each ``{"logprob", "rank", "decoded_token"}`` keyed by token id; None when not
        scored. A completion's echo with ``logprobs`` scores the prompt, and vLLM returns the scores then too."""
        job = self.job
        k = job.prompt_logprobs
        if k is None and job.kind == "completion" and job.echo:
            k = job.logprobs
        if k is None or c.prompt_logprobs is None:
            return None
        out: list[dict[str, dict[str, Any]] | None] = []
        for token, entry in zip(self.prompts[c.index // job.n], c.prompt_logprobs, strict=True):
            if entry is None:
                out.append(None)
                continue
            doc = {str(token): self._scored(token, entry[token], getattr(entry, "rank", None))}
            # the top k by place (1 to k); the token, when among them, takes its place there (vLLM's order)
            for place, (alt, value) in enumerate(_best(entry, k), 1):
                doc[str(alt)] = self._scored(alt, value, place)
            out.append(doc)
        return out

    def _scored(self, token: int, logprob: float, rank: int | None) -> dict[str, Any]:
        # the text, under --return-tokens-as-token-ids too (vLLM names only the answer's logprobs so)
        text = self.engine.token_piece(token)[0] if self.engine.tokenizer is not None else None
        # -inf (a token the model rules out) as -9999.0, vLLM's and OpenAI's stand-in JSON can hold
        return {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": text}

    def _usage(self) -> dict[str, Any]:
        per_prompt = self.choices[::self.job.n]
        prompt = sum(c.prompt_tokens for c in per_prompt)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(c.reused for c in per_prompt)}}

    def _token(self, token_id: int) -> str:
        return self._piece(token_id)[0]

    def _piece(self, token_id: int) -> tuple[str, bytes]:
        """A token as logprobs name it, and its raw bytes: ``token_id:N`` under ``--return-tokens-as-token-ids``
        or the request's ``return_tokens_as_token_ids`` (vLLM's, which wins over the flag; for tokens whose text JSON
        cannot carry), its bytes still the token's own, as vLLM's are."""
        text, raw = self.engine.token_piece(token_id)
        asked = self.job.return_tokens_as_token_ids
        as_id = self.state.return_tokens_as_token_ids if asked is None else asked
        return (f"token_id:{token_id}", raw) if as_id else (text, raw)

    def _completion_logprobs(self, ids: list[int], lps: list[Any], offsets: list[int], c: _Choice,
                             echo: bool = False) -> dict[str, Any] | None:
        """OpenAI's legacy completions logprobs; with ``echo``, the prompt's tokens first (the first has none)."""
        if self.job.logprobs is None or not (lps or echo):
            return None
        tokens: list[str] = []
        values: list[float | None] = []
        top: list[dict[str, float] | None] = []
        shift = 0
        where: list[int] = []
        if echo and c.echo is not None:
            scored = c.prompt_logprobs or [None] * len(c.echo.token_ids)
            k = self.job.logprobs or 0  # the prompt may be scored with more (prompt_logprobs): `logprobs` shown
            for t, entry in zip(c.echo.token_ids, scored, strict=True):
                tokens.append(self._token(t))
                values.append(None if entry is None else entry[t])
                top.append(None if entry is None else self._top(t, entry[t], dict(_best(entry, k))))
            where = list(c.echo.offsets)
        if c.echo is not None:  # every chunk's offsets count from the start of the echoed text, as the whole answer's
            shift = len(c.echo.text)
        for t, (lp, alts) in zip(ids, lps, strict=False):
            tokens.append(self._token(t))
            values.append(lp)
            top.append(self._top(t, lp, alts))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top,
                "text_offset": where + [o + shift for o in offsets[:len(lps)]]}

    def _top(self, token: int, lp: float, alts: dict[int, float]) -> dict[str, float]:
        # the top `logprobs` tokens plus the one chosen (vLLM's and OpenAI's legacy completions; chat: exactly k)
        entry = {self._token(token): lp}
        for a, v in alts.items():
            entry.setdefault(self._token(a), v)
        return entry

    def _chat_logprobs(self, ids: list[int], lps: list[Any]) -> dict[str, Any] | None:
        if self.job.logprobs is None or not lps:
            return None
        content = []
        for t, (lp, alts) in zip(ids, lps, strict=False):
            token, raw = self._piece(t)
            top = []
            for a, v in alts.items():
                alt, alt_raw = self._piece(a)
                top.append({"token": alt, "logprob": v, "bytes": list(alt_raw)})
            content.append({"token": token, "logprob": lp, "bytes": list(raw), "top_logprobs": top})
        return {"content": content}


def _best(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely of a logprob entry's tokens (its top alternatives and the scored token)."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def _post(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any], index: int, ev: ServeEvent) -> None:
    """The engine's sink: hand the event to the request's queue on the server's event loop."""
    with contextlib.suppress(RuntimeError):  # the loop closed: the server is going away
        loop.call_soon_threadsafe(queue.put_nowait, (index, ev))


def _sse(doc: dict[str, Any]) -> str:
    return f"data: {json.dumps(doc, separators=(',', ':'))}\n\n"


__all__ = ["ServeState", "create_app"]
