"""The server's parse gate: one request's body parsed and tokenized at a time, in arrival order, and a request of many
prompts hands its turn to those waiting between two prompts, so a small request is not parsed after all of them. A big
body's JSON is read before its turn, in the gate's body lane, so a small request does not wait for that either."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from starlette.requests import ClientDisconnect


class Departure:
    """Whether a request's client left while its body is read as JSON, waits for its turn or is parsed: watched on the
    event loop once the body is in (:meth:`watch`: ASGI's ``http.disconnect``), read by its parse thread where it can
    stop (:func:`pass_turn` between two prompts, the JSON's next integer: ``kvload.serve.request_body._load``).

    The client used to be noticed only once its parse and tokenizing had ended (seconds for a 20 MB body), all for no
    one, holding its admission slot and, ahead of every request behind it, the body lane and the gate; and one that
    left while it queued in the lane was read whole all the same (its socket, paused by uvicorn's flow control,
    was not read for the close until the lane's check, which found nothing yet)."""

    def __init__(self) -> None:
        self.left = False
        self._calls: list[Callable[[], Any]] = []
        self._event: asyncio.Event | None = None
        self._watcher: asyncio.Task[None] | None = None

    def watch(self, request: Any) -> None:
        """Start watching ``request`` (its body read: what it receives now can only be its disconnect)."""
        if self._watcher is None:
            self._event = asyncio.Event()
            self._watcher = asyncio.ensure_future(self._watch(request))

    async def _watch(self, request: Any) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.leave()

    def close(self) -> None:
        """Stop watching (the answer's own watch takes over: ``on_disconnect``, or Starlette's for a stream)."""
        if self._watcher is not None:
            self._watcher.cancel()

    def on_leave(self, call: Callable[[], Any]) -> None:
        """``call()`` on the event loop once the client leaves (at once if it left)."""
        if self.left:
            call()
        else:
            self._calls.append(call)

    def leave(self) -> None:
        """The client left (on the event loop): every ``on_leave`` call, once."""
        if self.left:
            return
        self.left = True
        if self._event is not None:
            self._event.set()
        calls, self._calls = self._calls, []
        for call in calls:
            call()

    async def wait(self) -> None:
        """Until the client leaves (for ever when not watched)."""
        if self._event is None:
            await asyncio.get_running_loop().create_future()
        else:
            await self._event.wait()

    async def acquire(self, lock: asyncio.Lock) -> bool:
        """``lock`` acquired, True; or False, not acquired, as soon as the client leaves (or has left)."""
        if self.left:
            return False
        if self._event is None:  # not watched
            await lock.acquire()
            return True
        taking = asyncio.ensure_future(lock.acquire())
        gone = asyncio.ensure_future(self._event.wait())
        try:
            await asyncio.wait((taking, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not taking.done():
                taking.cancel()
                await asyncio.wait((taking,))  # a cancelled acquire hands the lock on; one that ended holds it
        if taking.cancelled():
            return False
        taking.result()
        if self.left:  # both at once: the lock is not wanted
            lock.release()
            return False
        return True


class _Turn:
    """One request's place at the gate: ``waiting`` (queued), ``held`` (its parse may run), ``aside`` (its parse runs
    work off the gate: :func:`aside`) or ``done`` (let go)."""

    __slots__ = ("departure", "state", "until", "wake")

    def __init__(self, departure: Departure | None = None) -> None:
        self.state = "waiting"
        self.wake: Any = None  # called under the gate's lock when the turn is handed to it
        self.departure = departure
        #: set when the handler leaves before its parse thread ends (its client left): the turn is let go once this
        #: future (the thread's) is done, so no two parses tokenize at once
        self.until: asyncio.Future[Any] | None = None


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
    async def turn(self, departure: Departure | None = None) -> AsyncIterator[_Turn]:
        """Wait for this request's turn, hold it for the block (the parse on a worker thread included), then let go.
        ``departure``: a client that leaves while its request waits here, at first or between two prompts, gives its
        place up at once (``ClientDisconnect``; :func:`pass_turn` raises it in the parse)."""
        me = _Turn(departure)
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
            if departure is not None:
                departure.on_leave(lambda: self._withdraw(me))
            try:
                await ready
            except BaseException:  # cancelled while queued (the server stops): the turn, if given meanwhile, goes on
                self._leave(me)
                raise
            if me.state != "held":  # withdrawn: its client left while it queued
                raise ClientDisconnect()
        elif departure is not None:
            departure.on_leave(lambda: self._withdraw(me))
        token = _CURRENT.set((self, me))
        try:
            yield me
        finally:
            _CURRENT.reset(token)
            if me.until is not None and not me.until.done():
                me.until.add_done_callback(lambda _: self._leave(me))
            else:
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

    def _aside(self, me: _Turn, work: Callable[[], Any]) -> tuple[Any, bool]:
        """``work()`` with ``me``'s turn handed on meanwhile (to the first request waiting, or to whoever comes), then
        the turn taken back, behind those then waiting; (its result, whether ``me`` holds the turn again: False when
        its handler let go meanwhile)."""
        with self._lock:
            if me.state != "held":
                return None, False
            me.state = "aside"
            self._hand_on()
        back = threading.Event()
        try:
            with _quick_switches():
                result = work()
        finally:
            with self._lock:
                if me.state != "aside" or (me.departure is not None and me.departure.left):
                    if me.state == "aside":  # its client left meanwhile: no turn to take back for it
                        me.state = "done"
                    back.set()  # let go meanwhile (the server stopped, or its client left)
                elif self._holder is None and not self._queue:
                    me.state, self._holder = "held", me
                    back.set()
                else:
                    me.state, me.wake = "waiting", back.set
                    self._queue.append(me)
            back.wait()
        return result, me.state == "held"

    def _withdraw(self, me: _Turn) -> None:
        """``me``'s client left: out of the queue if it waits there (woken, it finds itself done); a turn held stays
        held until its parse stops at its next prompt (no two parses tokenize at once)."""
        with self._lock:
            if me.state == "waiting":
                me.state = "done"
                self._queue.remove(me)
                me.wake()

    def _hand_on(self) -> None:
        """The turn to the first request queued, or to no one (under ``_lock``)."""
        self._holder = self._queue.popleft() if self._queue else None
        if self._holder is not None:
            self._holder.state = "held"
            self._holder.wake()


#: The GIL's switch interval (``sys.setswitchinterval``) while work runs aside: 0.5 ms, not CPython's 5 ms.
ASIDE_SWITCH_S = 0.0005
_switches = [0, 0.0]  # how many asides run, and the interval before the first
_switches_lock = threading.Lock()


@contextlib.contextmanager
def _quick_switches() -> Iterator[None]:
    """The GIL handed on every :data:`ASIDE_SWITCH_S` while work runs aside, the interval of before put back once
    none runs. Work aside is mostly Python (a chat template's Jinja over thousands of messages, their checks) and
    shares the GIL with what it lets run meanwhile: the engine's step, whose every torch call lets go of the GIL and
    then waited up to a whole 5 ms interval to take it back, and the event loop's every wake. A one-token completion
    sent during a 20,000-message chat's templating was answered only as the templating ended (0.5-0.7 s, ~0.1 s
    alone)."""
    with _switches_lock:
        if _switches[0] == 0:
            _switches[1] = sys.getswitchinterval()
            sys.setswitchinterval(min(_switches[1], ASIDE_SWITCH_S))
        _switches[0] += 1
    try:
        yield
    finally:
        with _switches_lock:
            _switches[0] -= 1
            if _switches[0] == 0:
                sys.setswitchinterval(_switches[1])


def _call_soon(loop: asyncio.AbstractEventLoop, call: Any, *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (the server stopped): no one waits
        loop.call_soon_threadsafe(call, *args)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():  # cancelled meanwhile: _leave passes the turn on
        future.set_result(None)


def pass_turn() -> bool:
    """Between two prompts of a parse: let the requests waiting at the gate go first, then go on; at once when none
    waits or when no gate is held here (the Python API). False when the server gave up on this request meanwhile;
    ``ClientDisconnect`` when its client left (before or meanwhile): the rest of its prompts are for no one."""
    current = _CURRENT.get()
    if current is None:
        return True
    gate, me = current
    if me.departure is not None and me.departure.left:
        raise ClientDisconnect()
    held = gate._pass(me)
    if me.departure is not None and me.departure.left:
        raise ClientDisconnect()
    return held


def aside(work: Callable[[], Any]) -> tuple[Any, bool]:
    """``work()`` off the gate: the requests waiting (or coming) take the turn meanwhile, then the parse takes it back;
    for work that needs no tokenizer the gate guards (one prompt's encode on a tokenizer of its own: a prompt of
    hundreds of KB took ~0.5 s, more on a slower tokenizer, in one turn). (its result, False when the server gave up
    on this request meanwhile); ``ClientDisconnect`` when its client left. ``work()`` in place where no gate is held
    here (the Python API)."""
    current = _CURRENT.get()
    if current is None:
        return work(), True
    gate, me = current
    if me.departure is not None and me.departure.left:
        raise ClientDisconnect()
    result, held = gate._aside(me, work)
    if me.departure is not None and me.departure.left:
        raise ClientDisconnect()
    return result, held


__all__ = ["Departure", "ParseGate", "aside", "pass_turn"]
