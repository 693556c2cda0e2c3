"""A request's unexpected failure (a bug in a handler): HTTP 500 in the API's error body, one ``request_failed`` record
with the traceback in the server's log, and the client's keep-alive connection serving on.

Starlette's own last resort (``ServerErrorMiddleware``) answers such a failure but then raises it on to uvicorn, which
logs "Exception in ASGI application" and closes the connection under the client: a pooled connection of the
``openai`` client, and every request queued behind it on that connection, broke. Here the failure is answered and
ends with the request.
"""

from __future__ import annotations

import contextlib
import json
import re
import traceback
from typing import Any

from starlette.requests import ClientDisconnect

from kvload.serve.auth import route_path
from kvload.serve.protocol import BadRequest
from kvload.serve.route_errors import _shaped
from kvload.serve.state import ServeState
from pipeline.errors import first_line
from pipeline.events import RequestFailed

#: How much of the exception's first line the client is told (the log has all of it, and the traceback).
MESSAGE_CHARS = 300


def internal_error(exc: BaseException) -> BadRequest:
    """The 500 a client gets for ``exc``: its class and first line, never its traceback."""
    return BadRequest(f"internal server error: {type(exc).__name__}: {first_line(exc, '')[:MESSAGE_CHARS]}; the "
                      "server logged it (request_failed) and serves on", status=500, kind="server_error",
                      code="internal_server_error")


class _Failures:
    """ASGI middleware, inside every other one (so a 500 carries CORS and ``X-Request-Id`` headers as any answer, and
    the admission slot is let go by ``_Admission`` as for any answer): an exception out of the app is logged once and
    answered, the connection kept.

    Not yet answered: the 500. A stream already under way (its 200 sent): an error event, then ``[DONE]``, as an
    engine failure ends a stream, and the body ended in its own framing. A JSON answer cut short mid-body cannot be
    mended: raised on, and uvicorn closes the connection."""

    def __init__(self, app: Any, state: ServeState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, ended, stream = False, False, False
        numbered = [-1]  # the Responses API's last sequence_number sent: its error event takes the next

        async def sending(message: dict[str, Any]) -> None:
            nonlocal started, ended, stream
            if message["type"] == "http.response.start":
                started = True
                stream = any(k.lower() == b"content-type" and v.lower().startswith(b"text/event-stream")
                             for k, v in message.get("headers", ()))
            elif message["type"] == "http.response.body":
                ended = not message.get("more_body", False)
                if stream and (found := _SEQUENCE.findall(message.get("body", b""))):
                    numbered[0] = int(found[-1])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except ClientDisconnect:  # the client hung up: no one to answer, nothing went wrong here
            return
        except Exception as exc:
            self._log(scope, exc)
            if ended:  # answered whole before it failed (a background task): the client has its answer
                return
            error = _shaped(route_path(scope), internal_error(exc))
            if not started:
                payload = json.dumps(error.body()).encode()
                await send({"type": "http.response.start", "status": 500,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(payload)).encode())]})
                await send({"type": "http.response.body", "body": payload, "more_body": False})
            elif stream:
                end = _stream_end(route_path(scope), error, numbered[0] + 1)
                await send({"type": "http.response.body", "body": end, "more_body": False})
            else:
                raise

    def _log(self, scope: dict[str, Any], exc: Exception) -> None:
        """One ``request_failed`` record (level error), the traceback in its ``exception`` field (structlog's key:
        its console renderer prints it under the line), through the engine loop as every serving record goes; by
        this thread when the loop no longer runs (nothing else emits then)."""
        record = RequestFailed(method=scope.get("method", ""), path=route_path(scope)[:300], error=type(exc).__name__,
                               message=first_line(exc, ""),
                               exception="".join(traceback.format_exception(exc)).rstrip())
        engine = self.state.engine
        if engine.alive:
            engine.notify(record)
        else:
            with contextlib.suppress(Exception):  # reporting must not turn the 500 into a dropped connection
                engine.executor._event(record)


#: a Responses API event's number, as its stream writes it (json.dumps' default separators)
_SEQUENCE = re.compile(rb'"sequence_number": ?(\d+)')


def _stream_end(path: str, error: BadRequest, sequence: int = 0) -> bytes:
    """The events that end a stream under way with ``error``, in its API's words: Anthropic's ``error`` event under
    /v1/messages, the Responses API's ``error`` event under /v1/responses, else OpenAI's error chunk and ``[DONE]``
    (what an engine failure ends a chat or completion stream with)."""
    if path.startswith("/v1/messages"):  # error: already Anthropic's document, {"type": "error", "error": {...}}
        return f"event: error\ndata: {json.dumps(error.body(), separators=(',', ':'))}\n\n".encode()
    if path.startswith("/v1/responses"):
        doc = {"type": "error", "sequence_number": sequence, "code": error.code, "message": error.message,
               "param": None}
        return f"event: error\ndata: {json.dumps(doc, separators=(',', ':'))}\n\n".encode()
    return f"data: {json.dumps(error.body(), separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode()


__all__ = ["internal_error"]
