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
from kvload.serve.parse_gate import Departure, ParseGate
from kvload.serve.protocol import shutting_down
from kvload.serve.request_body import CLIENT_CLOSED, Body
from kvload.serve.request_run import _Run
from kvload.serve.responses_output import response_document, response_events
from kvload.serve.state import ServeState
from kvload.serve.worker import _on_worker, _read


async def _serve(state: ServeState, request: Request, kind: str, gate: ParseGate,
                 stopping: asyncio.Event) -> Response:
    departure = Departure()  # the client watched from its body's end until its parse is done
    try:
        raw = await _read(request, state, gate, stopping, departure)
        run = _Run(state, request, asyncio.get_running_loop())
        try:
            return await _answer(state, request, kind, gate, stopping, run, raw, departure)
        except BaseException:  # a refusal, a failure (a bug: _Failures answers it 500), a stop: nothing stays queued
            run.cancel()
            raise
    except ClientDisconnect:  # hung up mid-upload, or while its body was read or parsed: no one to answer
        return Response(status_code=CLIENT_CLOSED)
    finally:
        departure.close()


async def _answer(state: ServeState, request: Request, kind: str, gate: ParseGate, stopping: asyncio.Event,
                  run: _Run, raw: Body, departure: Departure) -> Response:
    """``_serve`` once the body is in: parsed and queued under the gate, then answered whole or streamed."""
    # Parsing, tokenizing and checking a body of up to --max-request-bytes takes seconds of CPU: done on a worker
    # thread, so other streams and /health go on meanwhile (a fast tokenizer releases the GIL while it encodes).
    # One request at a time (vLLM's API server tokenizes on a single worker thread too): no two encodes share
    # the tokenizer at once, and a flood of big bodies uses one core, not all of them. A request of many prompts
    # lets those waiting go first between two of its prompts (parse_gate.pass_turn).
    # A client that leaves meanwhile gives its place up (ClientDisconnect), or its parse stops at its next prompt
    # (pass_turn) and queues nothing (run.cancel): seconds of tokenizing for no one, ahead of every request behind it.
    async with gate.turn(departure) as turn:
        if state.engine.stopping:  # queued here when a stop was asked for: refused at once, not parsed first
            raise shutting_down()
        if departure.left:
            raise ClientDisconnect()
        departure.on_leave(run.cancel)
        pooled = await _on_worker(stopping, run.cancel, _prepare, state, run, raw, kind, gone=departure, held=turn)
    departure.close()  # the answer's own watch takes over (on_disconnect; Starlette's for a stream)
    if departure.left:
        raise ClientDisconnect()
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
    departure = Departure()
    try:
        raw = await _read(request, state, gate, stopping, departure)
        async with gate.turn(departure) as turn:  # as _serve: a client gone is not parsed, nor answered
            answer = await _on_worker(stopping, lambda: None, work, state, raw, gone=departure, held=turn)
        if departure.left:
            raise ClientDisconnect()
        return JSONResponse(answer)
    except ClientDisconnect:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        departure.close()
