"""The server's parse gate (kvload.serve.parse_gate): turns in arrival order, a parse thread that passes its turn
between prompts lets the requests then waiting go first, and one whose handler let go ends instead of waiting on."""

from __future__ import annotations

import asyncio
import threading

from kvload.serve.parse_gate import ParseGate, pass_turn
from kvload.serve.protocol import ASIDE_ITEMS, BadRequest, items_aside
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


def test_a_long_list_checked_aside_for_a_request_the_server_gave_up_on_ends_in_its_503_not_its_result():
    """A request's long list (a chat's messages) is checked off the gate; the server stopping ends its handler
    meanwhile: the parse ends with 503 ``server_shutting_down`` (Connection: close) rather than going on with the
    checked list as if it held the turn, and the gate is left free."""

    async def main() -> None:
        gate = ParseGate()
        in_work, release = threading.Event(), threading.Event()
        ended: list[object] = []
        items = list(range(ASIDE_ITEMS + 1))

        def check() -> str:
            in_work.set()
            assert release.wait(TIMEOUT)
            return "checked"

        def parse() -> None:
            try:
                ended.append(items_aside(items, check))
            except BadRequest as exc:
                ended.append((exc.status, exc.code, exc.headers))

        async def handler() -> None:
            async with gate.turn():
                await _on_daemon_thread(parse)

        task = asyncio.ensure_future(handler())
        await _until(in_work.is_set)
        task.cancel()
        await asyncio.sleep(0.05)
        release.set()
        await _until(lambda: bool(ended))
        assert ended == [(503, "server_shutting_down", {"Connection": "close"})]
        async with asyncio.timeout(TIMEOUT), gate.turn():
            assert gate.waiting() == 0

    asyncio.run(main())
    assert items_aside(list(range(ASIDE_ITEMS + 1)), lambda: "checked") == "checked"  # no gate held: in place


def test_outside_a_served_request_passing_the_turn_does_nothing():
    assert pass_turn() is True  # the Python API's encode: no gate held


def test_a_big_body_of_token_ids_read_ahead_of_its_turn_holds_about_its_size_not_five_times_it():
    """A big body is read as JSON in the body lane, then waits for its turn holding that value: 20 MB of token ids
    held 103 MB (a fresh 28-byte int per id, and its list's pointer). Each id's int is now shared: the list's pointer
    alone, the same value."""
    import json
    import tracemalloc

    from kvload.serve.request_body import LoadedBody

    raw = json.dumps({"prompt": [[(i * 7919 + j * 104729) % 49152 for j in range(700)] for i in range(1024)],
                      "max_tokens": 1}).encode()  # ~4.8 MB, ids of SmolLM2's vocabulary
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        loaded = LoadedBody(raw)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert loaded.error is None and loaded.value == json.loads(raw)
    assert held < 2 * len(raw), f"the value held {held / len(raw):.2f}x its JSON"


def test_work_aside_hands_the_gil_on_often_and_the_interval_of_before_comes_back_however_it_ends():
    """Work aside (a chat template's Jinja, mostly Python) shared the GIL at CPython's 5 ms switches with what it let
    run meanwhile, so the engine's step, taking the GIL back after each torch call, waited for its end: a one-token
    completion sent during a 20,000-message chat was answered only as the templating ended. Two asides overlapping,
    in this order: A starts, B starts, A ends (failing) while B still runs at 0.5 ms switches, B ends, and the
    interval of before is back (each aside putting back the interval it found gave B 5 ms, then left 0.5 ms)."""
    import sys

    import pytest

    from kvload.serve.parse_gate import aside

    before = sys.getswitchinterval()
    assert before > 0.0005
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, float] = {}

    def work_a() -> str:
        a_in.set()
        assert b_in.wait(TIMEOUT)
        seen["A"] = sys.getswitchinterval()
        raise ValueError("refused")

    def work_b() -> str:
        b_in.set()
        assert a_out.wait(TIMEOUT)  # A's aside over
        seen["B after A ended"] = sys.getswitchinterval()
        return "done"

    async def main() -> list[object]:
        gate = ParseGate()

        async def a() -> object:
            async with gate.turn():
                try:
                    return await _on_daemon_thread(lambda: aside(work_a))
                except ValueError as exc:
                    return exc
                finally:
                    a_out.set()

        async def b() -> object:
            await asyncio.to_thread(a_in.wait, TIMEOUT)  # B's aside begins once A's runs
            async with gate.turn():
                return await _on_daemon_thread(lambda: aside(work_b))

        return await asyncio.gather(a(), b())

    failed, ok = asyncio.run(main())
    assert ok == ("done", True) and isinstance(failed, ValueError)
    assert seen == {"A": pytest.approx(0.0005), "B after A ended": pytest.approx(0.0005)}
    assert sys.getswitchinterval() == pytest.approx(before)
