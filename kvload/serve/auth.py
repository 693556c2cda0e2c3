"""``kvload serve --api-key``: vLLM's bearer-key check, for every path but the probes.

vLLM (``--api-key`` / ``VLLM_API_KEY``, its ``AuthenticationMiddleware``) answers 401 to a request under ``/v1``
without ``Authorization: Bearer KEY`` (any of its keys; the scheme in any case), lets ``OPTIONS`` through (a CORS
preflight carries no credentials) and leaves every other path open. kvload checks the same header the same way,
and takes the key as ``X-Api-Key`` too (Anthropic's clients send it so, to ``/v1/messages``), but only
``/health``, ``/ping``, ``/metrics``, ``/version`` and ``/load`` stay open (probes, scrapers and routers send no key,
as under vLLM):

* ``/tokenize`` and ``/detokenize``, open in vLLM (its issue #18892 reports them as reachable without the key),
  share the server's ``--max-concurrent-requests`` slots and its one-at-a-time parse gate with completions and run
  the chat template (a request's own, with ``--trust-request-chat-template``): left open, a client without the key
  could fill the slots or hold the gate with bodies of up to --max-request-bytes, and key holders would wait or
  get 503.
* a path kvload does not serve gets 401 rather than the 404 listing every endpoint, and a route added later is
  protected unless it is added to :data:`OPEN_PATHS`: what is open is a short list, not what happens to lie
  outside ``/v1``.

Keys are kept as SHA-256 digests (as vLLM does), so no repr of the server's state holds one, and compared with
``hmac.compare_digest`` over every key (constant time, whichever matches). The key itself is never logged,
audited or quoted in an error: the audit says that a key is required and where it came from.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Mapping, Sequence
from typing import Any

from kvload.serve.protocol import BadRequest
from pipeline.errors import ConfigError

#: The environment variable ``kvload serve`` reads a key from (a key on the command line shows in ``ps``).
API_KEY_ENV = "KVLOAD_API_KEY"
#: vLLM's, honoured after kvload's own: a server moved over from vLLM with it set stays protected, never open.
VLLM_API_KEY_ENV = "VLLM_API_KEY"
#: Paths answered without a key (with one too): liveness probes, Prometheus scrapers, version checks, and vLLM's
#: ``/load`` (a load-aware router's poll: the count /metrics' ``kvload_http_requests_in_flight`` gives anyway).
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/load"})


def route_path(scope: Mapping[str, Any]) -> str:
    """The request's path as the router matches it: under ``--root-path /p`` (vLLM's, FastAPI's ``root_path``)
    ``/p/v1/models`` is ``/v1/models``, as Starlette strips it, so the middleware judges what the route serves."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path


def check_api_key(where: str, key: Any) -> str:
    """``key`` when it can be sent as ``Authorization: Bearer KEY``: a non-empty string of visible ASCII characters
    (an HTTP header carries no other reliably, and a space would end it); else ``ConfigError`` naming ``where`` and
    what is wrong, never the key itself."""
    if not isinstance(key, str):
        raise ConfigError(f"{where}: expected a key (a string), got {type(key).__name__}")
    if not key:
        leave = "unset it" if where.isupper() else "leave it out"  # an environment variable, or a flag
        raise ConfigError(f"{where}: the key is empty; give a key, or {leave} to serve without one (an empty key "
                          "never turns the check off)")
    bad = next((i for i, c in enumerate(key) if not "!" <= c <= "~"), None)
    if bad is not None:
        what = "a space" if key[bad] == " " else "a control character" if ord(key[bad]) < 0x20 or key[bad] == "\x7f" \
            else "a non-ASCII character"
        raise ConfigError(f"{where}: the key's character {bad + 1} of {len(key)} is {what}; a key is sent as "
                          "'Authorization: Bearer KEY', so it takes visible ASCII characters only (no spaces)")
    return key


def resolve_api_keys(flag: Sequence[str] | None, environ: Mapping[str, str]) -> tuple[tuple[str, ...], str | None,
                                                                                        list[str]]:
    """``(keys, source, unused)``: the keys of the first of ``--api-key``, ``$KVLOAD_API_KEY``, ``$VLLM_API_KEY``
    that is given (``source``: its name; None and no keys when none is), and the later ones that are set too but
    do not act. A source that is given but empty is a ``ConfigError`` naming it: an empty key never means "no
    key" (vLLM serves with none then, which a typo in a deployment would leave open)."""
    found: list[tuple[str, tuple[str, ...]]] = []
    if flag is not None:
        found.append(("--api-key", tuple(flag)))
    for name in (API_KEY_ENV, VLLM_API_KEY_ENV):
        if name in environ:
            found.append((name, (environ[name],)))
    if not found:
        return (), None, []
    source, keys = found[0]
    for key in keys:
        check_api_key(source, key)
    return keys, source, [name for name, _ in found[1:]]


def digest(key: str) -> bytes:
    """What the server keeps of a key: its SHA-256."""
    return hashlib.sha256(key.encode("ascii")).digest()


def is_loopback(address: str) -> bool:
    """Whether a bound socket's address is reachable from this machine only (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


class ApiKeyGate:
    """ASGI middleware: 401, in OpenAI's error body (Anthropic's under ``/v1/messages``), for a request without an
    accepted ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY`` on any path but :data:`OPEN_PATHS` (``OPTIONS``
    passes, as in vLLM).

    Outermost, so a request refused here holds no ``--max-concurrent-requests`` slot and has no body read: the
    answer closes the connection (``Connection: close``), as the server's other refusals before the body do.
    """

    def __init__(self, app: Any, digests: Sequence[bytes], metrics: Any = None) -> None:
        # imported here, not at the top: `kvload serve --api-key` checks its keys with this module while parsing,
        # before serve says that the serve extra (fastapi) is missing
        from fastapi.responses import JSONResponse

        self._response = JSONResponse
        self.app = app
        self.digests = tuple(digests)
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Pass the request on, or answer 401 without reading it."""
        # only HTTP: the app has no websocket route (the router closes any such connection) and lifespan is off
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or route_path(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        values = [v for k, v in scope["headers"] if k == b"authorization"]  # ASGI names are lower-case
        # Anthropic's clients send the key as X-Api-Key
        keys = [v for k, v in scope["headers"] if k == b"x-api-key"]
        if (values and self.accepts(values)) or (keys and self.accepts_key(keys)):
            await self.app(scope, receive, send)
            return
        if values or keys:
            message = ("Incorrect API key provided: the Authorization header must be 'Bearer ' and a key this server "
                       "accepts (or the X-Api-Key header that key)")
        else:
            message = ("You didn't provide an API key: this server requires the header 'Authorization: Bearer KEY' "
                       "(the openai client sends its api_key so) or 'X-Api-Key: KEY' (the anthropic client's)")
        refused = BadRequest(message, status=401, code="invalid_api_key")
        if self.metrics is not None:
            self.metrics.on_refused(401)
        if route_path(scope).startswith("/v1/messages"):  # Anthropic's error document on Anthropic's paths
            from kvload.serve.messages_input import AnthropicError

            refused = AnthropicError.of(refused)
        await self._response(refused.body(), status_code=401,
                           headers={"WWW-Authenticate": "Bearer", "Connection": "close"})(scope, receive, send)

    def accepts(self, values: list[bytes]) -> bool:
        """Whether the request's Authorization header carries one of the keys: one header (two are malformed, and
        which one a proxy checked is unknown), the scheme ``Bearer`` in any case (RFC 7235, vLLM), then one or more
        spaces (RFC 7235's 1*SP; vLLM takes exactly one) and the key."""
        if len(values) != 1:
            return False
        scheme, _, rest = values[0].partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return self._known(rest.lstrip(b" "))

    def accepts_key(self, values: list[bytes]) -> bool:
        """Whether the request's X-Api-Key header (one) is one of the keys."""
        return len(values) == 1 and self._known(values[0].strip(b" "))

    def _known(self, key: bytes) -> bool:
        presented = hashlib.sha256(key).digest()
        ok = False
        for known in self.digests:  # every key compared, so the time says nothing about which one matched
            ok |= hmac.compare_digest(presented, known)
        return ok


__all__ = ["API_KEY_ENV", "OPEN_PATHS", "VLLM_API_KEY_ENV", "ApiKeyGate", "check_api_key", "digest",
           "is_loopback", "resolve_api_keys"]
