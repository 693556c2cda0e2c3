"""``POST /reset_prefix_cache`` (vLLM's dev-mode route, served under ``--enable-reset-prefix-cache``).

vLLM's route takes two query parameters, each a FastAPI bool (``true``/``false``, ``1``/``0``, ``yes``/``no``,
``on``/``off``; another value is refused): ``reset_running_requests`` (preempt the running requests so the reset can
proceed) and ``reset_external`` (also reset a KV connector's cache); any other query parameter is dropped unread, as
FastAPI drops it. kvload reads both the same way: it never preempts a running request to reset (while requests hold a
cache the answer is a 409 saying so, ``reset_running_requests`` named when it was asked for), and it has no KV
connector, so ``reset_external=true`` is reported ``setting_ignored``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from kvload.serve.protocol import BadRequest
from kvload.serve.state import ServeState
from pipeline.events import SettingIgnored

#: vLLM's query parameters of the route, both false by default.
FLAGS = ("reset_running_requests", "reset_external")
#: The texts FastAPI (pydantic) reads as a bool, lower-cased.
_TRUE, _FALSE = frozenset({"true", "1", "yes", "on", "y", "t"}), frozenset({"false", "0", "no", "off", "n", "f"})


def query_flag(request: Request, name: str) -> bool:
    """``name``'s value as vLLM's ``Query(default=False)`` bool reads it (the last one given, as FastAPI takes it);
    a 400 naming it otherwise."""
    value = request.query_params.get(name)
    if value is None:
        return False
    text = value.lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise BadRequest(f"{name}: expected true or false, got {value[:60]!r}", param=name)


async def reset_prefix_cache(state: ServeState, request: Request) -> dict[str, Any]:
    """vLLM's route: 200 ``{"reset": true}``; 409 while requests hold a cache (nothing dropped); 200
    ``{"reset": false, "reason": ...}`` when prefix reuse is off (nothing is cached)."""
    running, external = (query_flag(request, name) for name in FLAGS)  # both checked before anything is reset
    done, event = await asyncio.to_thread(state.engine.reset_prefix_cache)  # waits for the step in flight
    if external:
        state.engine.notify(SettingIgnored(
            field="serve.reset_prefix_cache.reset_external", value=True,
            reason="kvload has no KV connector: there is no external prefix cache to reset (the local one is reset "
                   "as the route asks)"))
    if done:
        return {"reset": True}
    if state.engine.executor.salt_ignored() is None:  # reuse is on: requests hold the cache
        said = ("; reset_running_requests=true: kvload does not preempt running requests to reset" if running
                else "")
        raise BadRequest(f"{event.reason}{said}; try again when they have finished", status=409,
                         kind="conflict_error", code="prefix_cache_in_use")
    return {"reset": False, "reason": event.reason}


__all__ = ["FLAGS", "query_flag", "reset_prefix_cache"]
