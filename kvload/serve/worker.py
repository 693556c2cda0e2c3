"""Work run off the event loop: a request's parse and tokenize on a daemon thread, given up on when the server stops."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import threading
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect

from kvload.serve.parse_gate import Departure, ParseGate
from kvload.serve.protocol import shutting_down
from kvload.serve.request_body import Body, LoadedBody, _read_body
from kvload.serve.state import ServeState

#: Bodies of at most this many bytes are read as JSON in their turn at the parse gate (a millisecond or so); a bigger
#: one is read first, in the gate's body lane (:func:`_read`).
SMALL_BODY = 64 << 10


async def _read(request: Any, state: ServeState, gate: ParseGate, stopping: asyncio.Event,
                departure: Departure) -> Body:
    """The request's body, as a route's parse takes it, with ``departure`` watching its client from then on. One of
    more than :data:`SMALL_BODY` bytes is read as JSON here (:class:`LoadedBody`), on a worker thread, in the gate's
    body lane (one such body at a time, in arrival order), holding no turn at the gate: 20 MB of token ids took seconds
    of ``json.loads`` in its turn, and every request that came meanwhile, a one-token completion too, waited for all
    of it. A flood of big bodies still reads one at a time. ``ClientDisconnect`` as soon as the client leaves while
    the body waits for the lane (unread) or is read (at its next integer; the lane is let go once the reading thread
    stops), and the refusals of :func:`_read_body` as it raises them."""
    raw = await _read_body(request, state.max_request_bytes, state.read_timeout_s, stopping)
    departure.watch(request)
    if len(raw) <= SMALL_BODY:
        return raw
    _trim()  # what reading it freed (its chunks, the connection's buffers) handed back: ~1x its size held, not ~3-5x
    if not await departure.acquire(gate.bodies):  # left while it queued in the lane: seconds of parse for no one,
        raise ClientDisconnect()  # ahead of every big body behind it
    lane = _Lane()
    try:
        if stopping.is_set():  # queued here when the stop came: no JSON read for a request that is refused
            raise shutting_down()
        loaded = await _on_worker(stopping, lambda: None, LoadedBody, raw, departure, gone=departure, held=lane)
    finally:
        if lane.until is not None and not lane.until.done():  # its client left: the lane is the thread's until it
            lane.until.add_done_callback(lambda _: gate.bodies.release())  # stops, at its next integer
        else:
            gate.bodies.release()
    if departure.left:  # its parse ended early (Abandoned), or as it left: not parsed further in its turn
        raise ClientDisconnect()
    return loaded


class _Lane:
    """The body lane, held by a request: ``until`` as a gate turn's (``parse_gate._Turn.until``)."""

    def __init__(self) -> None:
        self.until: asyncio.Future[Any] | None = None


async def _on_worker(stopping: asyncio.Event, on_stop: Callable[[], Any], work: Callable[..., Any], *args: Any,
                     gone: Departure | None = None, held: Any = None) -> Any:
    """``work(*args)`` on a worker thread; 503 ``server_shutting_down`` as soon as ``stopping`` is set, after
    ``on_stop()``. A thread cannot be stopped, and uvicorn's stop waited for it (a 100 MB body's parse takes
    seconds), then past its graceful timeout cancelled the handler: uvicorn's plain-text 500. The thread runs on to
    its end or the process's; ``on_stop`` sees that what it queues, if anything, is aborted.

    ``gone``: ``ClientDisconnect`` as soon as the client leaves, its admission slot let go then, not once the thread
    stops (at its next prompt or integer); ``held`` (a gate turn or the body lane that the thread needs alone) is
    handed the thread's future as its ``until``, so it is let go only once the thread stops."""
    worker = _on_daemon_thread(work, *args)
    stop = asyncio.ensure_future(stopping.wait())
    left = asyncio.ensure_future(gone.wait()) if gone is not None else None
    try:
        await asyncio.wait((worker, stop, *([left] if left is not None else [])), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        worker.cancel()
        raise
    finally:
        stop.cancel()
        if left is not None:
            left.cancel()
    if not worker.done() and not stopping.is_set() and gone is not None and gone.left:
        if held is not None:
            held.until = worker
        worker.add_done_callback(lambda f: f.cancelled() or f.exception())  # its ClientDisconnect: no one to tell
        raise ClientDisconnect()
    if not worker.done():
        on_stop()
        worker.add_done_callback(lambda f: f.cancelled() or f.exception())  # its refusal: no one left to tell
        raise shutting_down()
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


def _trim() -> None:
    """glibc's ``malloc_trim(0)``: the heap's free pages given back to the system (a millisecond or ten after a 20 MB
    body). glibc keeps what a big body's reading freed (its raised mmap threshold puts such buffers on the heap), so a
    body waiting in the lane held ~3x its size of the process's memory. Nothing elsewhere (no glibc)."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM: Any = None
