"""What routing refuses, in the error document of the API asked: an unknown path, a wrong method, a bad query."""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.routing import Match

from kvload.serve.messages_input import AnthropicError
from kvload.serve.protocol import BadRequest


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


def _shaped(path: str, exc: BadRequest) -> BadRequest:
    """``exc`` in the error document of the API that ``path`` serves (Anthropic's under /v1/messages)."""
    return AnthropicError.of(exc) if path.startswith("/v1/messages") else exc
