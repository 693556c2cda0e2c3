"""``kvload serve``'s ``n`` choices when the KV budget has room for one sequence only: the choices that would fork
choice 0's prefill cannot join it (``Driver._fork``'s "no room now" path), so each waits with the first token it drew
and is admitted once room frees, computing what the prefix cache no longer holds. Through the real server and the
``openai`` client, on V1 and V2: the answer still has its ``n`` choices, each the one a request of its own with
seed + j gives, and no block is left held afterwards.

The budget (24 tokens in 8-token blocks, ``max_seq_len`` 24) is ``tests/test_n_fork.py``'s driver-level case of it.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.serve_support import TIMEOUT, wait_for
from tests.test_serve_n_fork import COMPUTED, salt, streamed_choices, used, words_server

BUDGET = 24  # tokens: three blocks, one sequence's worth at max_seq_len
PROMPT = [1, 5, 17, 30, 42, 9, 88, 12, 7, 64, 25, 11, 3]  # one full block + 5: with 10 new tokens, all three blocks


@pytest.fixture(scope="module", params=["v1", "v2"])
def tight(request, tiny_checkpoints, tmp_path_factory):
    with words_server(request.param, tmp_path_factory.mktemp(f"noroom-{request.param}"), BUDGET, BUDGET,
                      tiny_checkpoints) as s:
        yield s


@pytest.fixture
def refused(tight, monkeypatch):
    """Every fork the scheduler refused during the test: proof the choices took the "no room" path."""
    scheduler = tight.state.engine.driver.scheduler
    real, seen = scheduler.fork, []

    def fork(parent, child, running):
        ok = real(parent, child, running)
        if not ok:
            seen.append(child.req_id)
        return ok

    monkeypatch.setattr(scheduler, "fork", fork)
    return seen


def alone(served, prompt: list[int], j: int, **kw) -> tuple[list[int], str]:
    """Choice ``j`` as a request of its own (n=1, seed + j): its tokens and text."""
    kw = {**kw, "seed": kw["seed"] + j}
    r = served.client.completions.create(model="words", prompt=prompt, extra_body={"ignore_eos": True,
                                                                                   "cache_salt": salt()}, **kw)
    return r.choices[0].model_extra["token_ids"], r.choices[0].text


def ended(served) -> dict[str, float]:
    """Requests (choices) ended so far, by finish reason."""
    head = "kvload_request_success_total{finished_reason="
    return {k[len(head):-1]: v for k, v in served.metrics().items() if k.startswith(head)}


def settled(served) -> None:
    """Nothing running or waiting and no block held: what every test here ends with."""
    m = served.metrics()
    assert used(served) == 0
    assert m["kvload_num_requests_running"] == 0 and m["kvload_num_requests_waiting"] == 0
    engine = served.state.engine
    assert not engine.driver.forks_pending and not engine.driver.has_work
    manager = engine.manager
    if hasattr(manager, "check_invariants"):
        manager.check_invariants()
    else:
        manager.pool.check_invariants()


def test_choices_without_room_to_join_wait_and_are_each_their_own_requests(tight, refused):
    sampling = {"max_tokens": 10, "temperature": 1.1, "seed": 8}
    before = tight.metrics()[COMPUTED]
    r = tight.client.completions.create(model="words", prompt=PROMPT, n=3,
                                        extra_body={"ignore_eos": True, "cache_salt": salt()}, **sampling)
    computed = tight.metrics()[COMPUTED] - before
    assert len(refused) == 2  # neither fork had room beside choice 0: both took the waiting path
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.finish_reason for c in r.choices] == ["length"] * 3
    assert r.usage.prompt_tokens == len(PROMPT) and r.usage.completion_tokens == 30
    want = [alone(tight, PROMPT, j, **sampling) for j in range(3)]
    assert [(c.model_extra["token_ids"], c.text) for c in r.choices] == want
    assert len({w[1] for w in want}) > 1  # the seeds differ: copies of choice 0 would fail above
    # a waiting choice computes what the prefix cache no longer holds: at least the prompt once, at most once each
    assert len(PROMPT) <= computed <= 3 * len(PROMPT)
    settled(tight)


def test_streamed_chat_choices_without_room_each_stream_to_the_end(tight, refused):
    messages = [{"role": "user", "content": "w5 w17 w30 w42 w9 w88"}]
    stream = tight.client.chat.completions.create(model="words", messages=messages, max_tokens=6, n=3, seed=2,
                                                  temperature=1.3, stream=True,
                                                  extra_body={"ignore_eos": True, "cache_salt": salt()})
    got, reasons = streamed_choices(stream, 3)
    assert refused  # some choice could not join at once
    assert reasons == dict.fromkeys(range(3), "length")
    for j in range(3):
        r = tight.client.chat.completions.create(model="words", messages=messages, max_tokens=6, seed=2 + j,
                                                 temperature=1.3,
                                                 extra_body={"ignore_eos": True, "cache_salt": salt()})
        assert got[j] == r.choices[0].model_extra["token_ids"], j
    settled(tight)


def test_a_client_that_hangs_up_while_choices_wait_for_room_frees_them_all(tight, refused, monkeypatch):
    engine = tight.state.engine
    step, abort = engine._compute, engine.abort
    hung_up, heard = threading.Event(), threading.Event()

    def held(out):
        if hung_up.is_set():  # no step until the server has heard the hang-up: else choice 0 could end, and a
            heard.wait(TIMEOUT)  # waiting choice take its room and end, first
        else:  # the tiny model's steps take well under a millisecond: all would end before the client reads one
            time.sleep(0.03)
        return step(out)

    def heard_abort(req_id):
        abort(req_id)
        heard.set()

    monkeypatch.setattr(engine, "_compute", held)
    monkeypatch.setattr(engine, "abort", heard_abort)
    before = ended(tight)
    body = {"model": "words", "prompt": PROMPT, "max_tokens": 11, "n": 3, "temperature": 1.0, "seed": 1,
            "ignore_eos": True, "stream": True, "cache_salt": salt()}
    with httpx.Client(base_url=tight.url, timeout=TIMEOUT) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # held: a generator dropped mid-way closes the stream
        for line in lines:
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                break  # choice 0 streams; the other two wait for room with their first token
        hung_up.set()  # at once: asking the server anything now takes steps (and steps end choices)
    assert len(refused) == 2, refused  # both forks found no room beside choice 0
    wait_for(lambda: sum(ended(tight).values()) == sum(before.values()) + 3, what="the three choices ended")
    after = ended(tight)
    # choice 0 may end at most one token on ("length", if that was its last); the other two had no room to run
    assert after.get("abort", 0) - before.get("abort", 0) >= 2, (before, after)
    settled(tight)
