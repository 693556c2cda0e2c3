"""vLLM's ``--enable-request-id-headers``: every answer carries an ``X-Request-Id`` header, the request's own one or a
fresh id, so a client or proxy can match a response (an error included) to its request."""

from __future__ import annotations

import uuid
from typing import Any

HEADER = b"x-request-id"


class _RequestIdHeader:
    """ASGI middleware: the request's ``X-Request-Id`` (its first; h11 checked its bytes) or a fresh uuid4 hex, as
    vLLM's, set on the answer in place of any the app set."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name.lower() == HEADER), None)
        request_id = given if given else uuid.uuid4().hex.encode()

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, sending)
