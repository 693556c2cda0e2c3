"""The admission middleware: at most ``--max-concurrent-requests`` generation requests in the server, 503 past it."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from kvload.serve.auth import route_path
from kvload.serve.protocol import BadRequest
from kvload.serve.route_errors import _shaped
from kvload.serve.state import ServeState

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
                       "/v1/messages/count_tokens", "/invocations", "/tokenize", "/detokenize", "/v1/embeddings",
                       "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify",
                       "/pooling"})

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
