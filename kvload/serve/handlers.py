"""An HTTP request's way through a route: body read, parsed on a worker under the gate, answered whole or streamed."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from kvload.serve.embeddings import pooling_run
from kvload.serve.invocations import Pooled, prepare_invocation
from kvload.serve.messages_output import message_document, message_events
from kvload.serve.parse_gate import ParseGate
from kvload.serve.request_body import CLIENT_CLOSED, Body, _shutting_down
from kvload.serve.request_run import _Run
from kvload.serve.responses_output import response_document, response_events
from kvload.serve.state import ServeState
from kvload.serve.worker import _on_worker, _read


async def _serve(state: ServeState, request: Request, kind: str, gate: ParseGate,
                 stopping: asyncio.Event) -> Response:
    try:
        raw = await _read(request, state, gate, stopping)
    except ClientDisconnect:  # hung up mid-upload: the client's doing, not a server error with a traceback
        return Response(status_code=CLIENT_CLOSED)
    run = _Run(state, request, asyncio.get_running_loop())
    try:
        return await _answer(state, request, kind, gate, stopping, run, raw)
    except BaseException:  # a refusal, a failure (a bug: _Failures answers it 500), a stop: nothing stays queued
        run.cancel()
        raise


async def _answer(state: ServeState, request: Request, kind: str, gate: ParseGate, stopping: asyncio.Event,
                  run: _Run, raw: Body) -> Response:
    """``_serve`` once the body is in: parsed and queued under the gate, then answered whole or streamed."""
    # Parsing, tokenizing and checking a body of up to --max-request-bytes takes seconds of CPU: done on a worker
    # thread, so other streams and /health go on meanwhile (a fast tokenizer releases the GIL while it encodes).
    # One request at a time (vLLM's API server tokenizes on a single worker thread too): no two encodes share
    # the tokenizer at once, and a flood of big bodies uses one core, not all of them. A request of many prompts
    # lets those waiting go first between two of its prompts (parse_gate.pass_turn).
    async with gate.turn():
        if state.engine.stopping:  # queued here when a stop was asked for: refused at once, not parsed first
            raise _shutting_down()
        if await request.is_disconnected():  # left while it queued here: its parse (seconds for a big body) is
            return Response(status_code=CLIENT_CLOSED)  # work for no one, ahead of every request queued behind it
        pooled = await _on_worker(stopping, run.cancel, _prepare, state, run, raw, kind)
    if pooled is not None:  # an /invocations body for /v1/embeddings, /rerank or /score: answered as they answer
        return await pooling_run(state, request, pooled.job, pooled.answer)
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


def _prepare(state: ServeState, run: _Run, raw: bytes | bytearray, kind: str) -> Pooled | None:
    """``run.prepare`` (on the worker), or for ``/invocations`` the body's route picked first: ``Pooled`` when
    that is a pooling route's (nothing queued yet), else ``None`` with ``run`` prepared as the chat or completion."""
    if kind == "invocations":
        return prepare_invocation(state, run, raw)
    run.prepare(raw, kind)
    return None


async def _tokenizer_call(state: ServeState, request: Request, work: Any, gate: ParseGate,
                          stopping: asyncio.Event) -> Response:
    """vLLM's /tokenize or /detokenize: the body read under the completions' limits, then ``work(state, body)``
    on a worker thread under the same gate as their parsing and tokenizing (a big body's encode would stall the
    event loop, and the tokenizer is used by one request at a time)."""
    try:
        raw = await _read(request, state, gate, stopping)
    except ClientDisconnect:
        return Response(status_code=CLIENT_CLOSED)
    async with gate.turn():
        if await request.is_disconnected():  # as _serve: no one to answer
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(await _on_worker(stopping, lambda: None, work, state, raw))
