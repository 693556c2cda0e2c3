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
inside the engine is 500 for that request only — the server keeps serving; so is any failure nothing expected (a
bug: ``failures``), answered on the same keep-alive connection.

The routes are here; what they share lives in modules named for it: ``state`` (``ServeState``), ``admission``,
``request_body``, ``request_input``, ``handlers`` (a request's way through a route), ``request_run`` (its engine
requests and answer), ``choices``, ``openai_output``, ``tokenizer_routes``, ``route_errors``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from kvload.serve.admission import _Admission
from kvload.serve.auth import ApiKeyGate, route_path
from kvload.serve.classify import classify_route
from kvload.serve.embeddings import embeddings_route
from kvload.serve.failures import _Failures, internal_error
from kvload.serve.handlers import _serve, _tokenizer_call
from kvload.serve.messages_input import AnthropicError
from kvload.serve.parse_gate import ParseGate
from kvload.serve.pooling import pooling_route_post
from kvload.serve.protocol import BadRequest
from kvload.serve.request_id import _RequestIdHeader
from kvload.serve.request_input import _not_served
from kvload.serve.reset_prefix import reset_prefix_cache as reset_prefix
from kvload.serve.route_errors import _allowed, _only_query, _routing_error, _shaped
from kvload.serve.scoring import rerank_route, score_route
from kvload.serve.state import ServeState
from kvload.serve.tokenizer_routes import _count_tokens, _detokenize, _tokenize
from pipeline.audit import dropped_record
from pipeline.errors import ConfigError
from pipeline.version import __version__


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
    _add_middleware(app, state)
    _add_error_handlers(app, state)
    _add_info_routes(app, state)
    _add_kvload_routes(app, state)
    _add_inference_routes(app, state)
    _head_for_get(app)
    return app


def _add_middleware(app: FastAPI, state: ServeState) -> None:
    """The middleware, innermost first: failures answered, admission, the API key, CORS, the request id header."""
    # innermost: an unexpected exception is answered (500) before any other middleware sees the answer go by
    app.add_middleware(_Failures, state=state)
    app.add_middleware(_Admission, state=state)
    if state.api_key_digests:  # added last, so outermost: a request without the key takes no admission slot
        app.add_middleware(ApiKeyGate, digests=state.api_key_digests, metrics=state.metrics)
    if state.cors is not None:  # outermost: a browser's preflight carries no API key and takes no admission slot
        from starlette.middleware.cors import CORSMiddleware

        cors = state.cors
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.origins), allow_methods=list(cors.methods),
                           allow_headers=list(cors.headers), allow_credentials=cors.credentials)
    if state.request_id_headers:  # outermost: a refused request's answer carries the id too
        app.add_middleware(_RequestIdHeader)
    state.metrics.http_in_flight.set_function(lambda: state.in_flight)  # what _Admission counts, read at scrape


def _add_error_handlers(app: FastAPI, state: ServeState) -> None:
    """Refusals, Starlette's own answers and last-resort failures, each in OpenAI's error body."""
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
    async def failure(request: Request, exc: Exception) -> JSONResponse:
        # Starlette's last resort, for a failure outside _Failures (in an outer middleware): it raises the exception
        # on to uvicorn afterwards, which closes the connection; a handler's failure never gets here
        return JSONResponse(_shaped(route_path(request.scope), internal_error(exc)).body(), status_code=500)


def _add_info_routes(app: FastAPI, state: ServeState) -> None:
    """What probes, routers and clients ask about the server: health, models, load, metrics, version."""
    @app.get("/health")
    async def health() -> Response:
        if state.engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "down", "error": state.engine.loop_error}, status_code=503)

    @app.get("/ping")  # vLLM's: the probe SageMaker sends, by either method
    @app.post("/ping")
    async def ping() -> Response:
        return await health()

    given = getattr(getattr(state.result, "args", None), "model", None)  # MODEL as given: vLLM's card's root
    root = str(given) if given is not None else state.model_name

    def model_card(name: str) -> dict[str, Any]:
        # vLLM's card: ``root`` is the model it loaded (clients find its tokenizer there), ``parent`` a LoRA's base
        return {"id": name, "object": "model", "created": state.created, "owned_by": "kvload", "root": root,
                "parent": None, "max_model_len": state.engine.executor.max_seq_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:  # one card per served name, as vLLM lists them
        return {"object": "list", "data": [model_card(name) for name in state.served_names]}

    @app.get("/v1/models/{model:path}")  # a served name may hold a slash ("HuggingFaceTB/SmolLM2-135M")
    async def model(model: str) -> dict[str, Any]:
        if model not in state.served_names:
            raise _not_served(model, state.served_names)
        return model_card(model)

    @app.get("/load")  # vLLM's: what a load-aware router polls; the requests _Admission counts, as /metrics' gauge
    async def load() -> dict[str, int]:
        return {"server_load": state.in_flight}

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(state.metrics.render)  # a scrape may wait for the step in flight
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    if state.enable_reset_prefix_cache:
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(request: Request) -> dict[str, Any]:
            """vLLM's dev-mode route, its query parameters read as vLLM's (``kvload.serve.reset_prefix``)."""
            return await reset_prefix(state, request)

    @app.get("/version")
    async def version() -> dict[str, str]:  # vLLM's: clients check what they talk to
        return {"version": __version__}


def _add_kvload_routes(app: FastAPI, state: ServeState) -> None:
    """kvload's own routes: the audit log, a field's decision chain, the KV cache events."""
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


def _add_inference_routes(app: FastAPI, state: ServeState) -> None:
    """The routes that run the model: OpenAI's, Anthropic's, SageMaker's and vLLM's, one body parsed at a time."""
    app.state.parse_gate = gate = ParseGate()  # one request's body parsed and tokenized at a time (see _serve)
    # set on the event loop once the server stops (server._Server.shutdown): a body still arriving is not waited for
    app.state.stopping = stopping = asyncio.Event()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(state, request, "completion", gate, stopping)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(state, request, "chat", gate, stopping)

    @app.post("/invocations")  # SageMaker's route, as vLLM serves it: the body's fields pick the route
    async def invocations(request: Request) -> Response:
        return await _serve(state, request, "invocations", gate, stopping)

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

    @app.post("/v1/embeddings")  # OpenAI's Embeddings API: the prompt's last hidden state, as vLLM's pooling runner
    async def embeddings(request: Request) -> Response:
        return await embeddings_route(state, request, gate, stopping)

    @app.post("/classify")  # vLLM's classification API: a *ForSequenceClassification checkpoint's head, activated
    async def classify(request: Request) -> Response:
        return await classify_route(state, request, gate, stopping)

    @app.post("/pooling")  # vLLM's pooling API: by task, the last or every prompt token's hidden state or head output
    async def pooling(request: Request) -> Response:
        return await pooling_route_post(state, request, gate, stopping)

    @app.post("/score")  # vLLM's score API: the cosine of each pair's embeddings (its embedding models' score)
    @app.post("/v1/score")
    async def score(request: Request) -> Response:
        return await score_route(state, request, gate, stopping)

    @app.post("/rerank")  # vLLM's Jina/Cohere-style rerank: the documents by their cosine with the query
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(request: Request) -> Response:
        return await rerank_route(state, request, gate, stopping)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await _tokenizer_call(state, request, _tokenize, gate, stopping)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await _tokenizer_call(state, request, _detokenize, gate, stopping)


def _head_for_get(app: FastAPI) -> None:
    """HTTP's rule: a GET route answers HEAD (its headers; a probe's liveness check); but kv_events, whose GET drains
    the events it answers: a HEAD would drop them unseen."""
    for route in app.router.routes:
        if isinstance(route, APIRoute) and route.methods == {"GET"} and route.path != "/v1/kvload/kv_events":
            route.methods.add("HEAD")


__all__ = ["create_app"]
