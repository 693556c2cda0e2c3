"""The server's parse gate: one request's body parsed and tokenized at a time, in arrival order, and a request of many
prompts hands its turn to those waiting between two prompts, so a small request is not parsed after all of them. A big
body's JSON is read before its turn, in the gate's body lane, so a small request does not wait for that either."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections import deque
from collections.abc import AsyncIterator
from typing import Any


class _Turn:
    """One request's place at the gate: ``waiting`` (queued), ``held`` (its parse may run) or ``done`` (let go)."""

    __slots__ = ("state", "wake")

    def __init__(self) -> None:
        self.state = "waiting"
        self.wake: Any = None  # called under the gate's lock when the turn is handed to it


#: The turn of the request whose parse runs in this context (the worker thread gets a copy of the handler's).
_CURRENT: contextvars.ContextVar[tuple[ParseGate, _Turn] | None] = contextvars.ContextVar("kvload_parse_turn",
                                                                                          default=None)


class ParseGate:
    """At most one request parsed and tokenized at a time (no two encodes share the tokenizer, and a flood of big
    bodies uses one core), turns given in arrival order. Held from the event loop (:meth:`turn`); the worker thread
    doing the parse calls :func:`pass_turn` between prompts, which lets every request then waiting go first."""

    def __init__(self) -> None:
        #: the body lane: a big body is read as JSON under it, one at a time in arrival order, before its turn here
        #: (kvload.serve.worker._read), so its JSON (seconds for 20 MB of token ids) holds no small request back
        self.bodies = asyncio.Lock()
        self._lock = threading.Lock()  # the event loop and parse threads both hand turns over
        self._holder: _Turn | None = None
        self._queue: deque[_Turn] = deque()

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Wait for this request's turn, hold it for the block (the parse on a worker thread included), then let go."""
        me = _Turn()
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._holder is None and not self._queue:
                me.state, self._holder = "held", me
                ready = None
            else:
                ready = loop.create_future()
                me.wake = lambda: _call_soon(loop, _settle, ready)
                self._queue.append(me)
        if ready is not None:
            try:
                await ready
            except BaseException:  # cancelled while queued (the server stops): the turn, if given meanwhile, goes on
                self._leave(me)
                raise
        token = _CURRENT.set((self, me))
        try:
            yield
        finally:
            _CURRENT.reset(token)
            self._leave(me)

    def waiting(self) -> int:
        """How many requests wait for their turn."""
        with self._lock:
            return len(self._queue)

    def _pass(self, me: _Turn) -> bool:
        """``me``'s turn handed to every request waiting now, ``me`` queued behind them; False when ``me`` no longer
        holds it (its handler let go: the server gave up on it), True once the turn is back."""
        back = threading.Event()
        with self._lock:
            if me.state != "held" or not self._queue:
                return me.state == "held"
            me.state, me.wake = "waiting", back.set
            self._queue.append(me)
            self._hand_on()
        back.wait()
        return me.state == "held"

    def _leave(self, me: _Turn) -> None:
        """``me`` done: out of the queue, or its held turn handed to the next request waiting."""
        with self._lock:
            was, me.state = me.state, "done"
            if was == "waiting":
                self._queue.remove(me)
                if me.wake is not None:
                    me.wake()  # a parse thread waiting in pass_turn: let it see it is done
            elif was == "held":
                self._hand_on()

    def _hand_on(self) -> None:
        """The turn to the first request queued, or to no one (under ``_lock``)."""
        self._holder = self._queue.popleft() if self._queue else None
        if self._holder is not None:
            self._holder.state = "held"
            self._holder.wake()


def _call_soon(loop: asyncio.AbstractEventLoop, call: Any, *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (the server stopped): no one waits
        loop.call_soon_threadsafe(call, *args)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():  # cancelled meanwhile: _leave passes the turn on
        future.set_result(None)


def pass_turn() -> bool:
    """Between two prompts of a parse: let the requests waiting at the gate go first, then go on; at once when none
    waits or when no gate is held here (the Python API). False when the server gave up on this request meanwhile."""
    current = _CURRENT.get()
    if current is None:
        return True
    gate, me = current
    return gate._pass(me)


__all__ = ["ParseGate", "pass_turn"]
