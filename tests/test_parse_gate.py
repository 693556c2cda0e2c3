"""The server's parse gate (kvload.serve.parse_gate): turns in arrival order, a parse thread that passes its turn
between prompts lets the requests then waiting go first, and one whose handler let go ends instead of waiting on."""

from __future__ import annotations

import asyncio
import threading

from kvload.serve.parse_gate import ParseGate, pass_turn
from kvload.serve.worker import _on_daemon_thread

TIMEOUT = 30.0


def _until(check, loop_sleep=0.01):
    async def wait() -> None:
        async with asyncio.timeout(TIMEOUT):
            while not check():
                await asyncio.sleep(loop_sleep)
    return wait()


def test_a_parse_that_passes_its_turn_lets_the_waiting_requests_go_first_in_arrival_order():
    order: list[str] = []

    async def main() -> None:
        gate = ParseGate()
        go = threading.Event()

        def big_parse() -> list[bool]:
            order.append("big 0")
            assert go.wait(TIMEOUT)
            passed = pass_turn()  # two wait: both go first, in the order they came
            order.append("big 1")
            return [passed, pass_turn()]  # none waits: at once

        async def big() -> list[bool]:
            async with gate.turn():
                return await _on_daemon_thread(big_parse)

        async def small(name: str) -> None:
            async with gate.turn():
                order.append(name)

        first = asyncio.ensure_future(big())
        await _until(lambda: order == ["big 0"])
        a = asyncio.ensure_future(small("a"))
        await _until(lambda: gate.waiting() == 1)
        b = asyncio.ensure_future(small("b"))
        await _until(lambda: gate.waiting() == 2)
        go.set()
        assert await first == [True, True]
        await asyncio.gather(a, b)
        assert gate.waiting() == 0

    asyncio.run(main())
    assert order == ["big 0", "a", "b", "big 1"]


def test_a_parse_whose_handler_let_go_while_it_waited_for_its_turn_back_is_told_so_and_the_gate_goes_on():
    """The server stopping ends a handler while its parse thread waits in ``pass_turn``: the thread learns it (the
    parse ends with a 503 no one reads) rather than waiting for ever, and it holds no turn after."""

    async def main() -> None:
        gate = ParseGate()
        go, hold_small, small_in = threading.Event(), asyncio.Event(), asyncio.Event()
        told: list[bool] = []

        def big_parse() -> None:
            assert go.wait(TIMEOUT)
            told.append(pass_turn())

        async def big() -> None:
            async with gate.turn():
                await _on_daemon_thread(big_parse)

        async def small() -> None:
            async with gate.turn():
                small_in.set()
                await hold_small.wait()

        handler = asyncio.ensure_future(big())
        await asyncio.sleep(0)
        other = asyncio.ensure_future(small())
        await _until(lambda: gate.waiting() == 1)
        go.set()
        await asyncio.wait_for(small_in.wait(), TIMEOUT)  # the big one passed its turn and waits for it back
        handler.cancel()
        await _until(lambda: told == [False])
        hold_small.set()
        await other
        async with asyncio.timeout(TIMEOUT), gate.turn():  # free: no turn was left held by the parse given up on
            assert gate.waiting() == 0

    asyncio.run(main())


def test_outside_a_served_request_passing_the_turn_does_nothing():
    assert pass_turn() is True  # the Python API's encode: no gate held


def test_a_big_body_whose_client_left_while_it_queued_in_the_body_lane_is_not_read(monkeypatch):
    """Big bodies are read as JSON one at a time in the gate's body lane, seconds each at 20 MB; one whose client
    hung up while it queued there was read all the same, ahead of every big body behind it. Now it ends as the
    client's disconnect, unread."""
    from starlette.requests import ClientDisconnect

    import kvload.serve.worker as worker

    raw = b"[" + b"1," * worker.SMALL_BODY + b"1]"
    read = []

    async def body(*args):
        return raw

    class Gone:
        async def is_disconnected(self) -> bool:
            return True

    class State:
        max_request_bytes, read_timeout_s = 1 << 30, 60.0

    monkeypatch.setattr(worker, "_read_body", body)
    monkeypatch.setattr(worker, "LoadedBody", lambda data: read.append(len(data)))

    async def main() -> str:
        try:
            await worker._read(Gone(), State(), ParseGate(), asyncio.Event())
        except ClientDisconnect:
            return "disconnect"
        return "read"

    assert asyncio.run(main()) == "disconnect" and read == []
