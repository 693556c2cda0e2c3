"""An HTTP request's way through a route: body read, parsed on a worker under the gate, answered whole or streamed."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from kvload.serve.messages_output import message_document, message_events
from kvload.serve.request_body import CLIENT_CLOSED, _read_body, _shutting_down
from kvload.serve.request_run import _Run
from kvload.serve.responses_output import response_document, response_events
from kvload.serve.state import ServeState


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
    its end or the process's; ``on_stop`` sees that what it queues, if anything, is aborted."""
    worker = _on_daemon_thread(work, *args)
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


def _on_daemon_thread(work: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    """``work(*args)`` on a daemon thread of its own, its result or exception in the returned future.

    Not ``asyncio.to_thread``: the loop's default executor is joined when ``asyncio.run`` ends (uvicorn's
    ``server.run``), so a stop during an 80 MB prompt's encode (minutes on one core) held ``kvload serve`` after its
    503s went out, its audit unpublished, until the encode ended. A daemon thread ends with the process."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()  # as to_thread: the request's context (structlog's bound fields) goes along

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = context.run(work, *args), None
        except BaseException as exc:  # handed to the awaiting handler, as to_thread does
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (the server stopped): no one to tell
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="kvload-parse", daemon=True).start()
    return future
