"""The responses ``/v1/responses`` keeps (OpenAI's ``store``, ``--responses-store-max``), through the openai client:
``previous_response_id`` chains a turn onto a kept response (the model is given the earlier turns), ``retrieve``,
``delete`` and ``input_items.list`` answer for kept ones, and an unknown, dropped, deleted or ``store: false`` id is a
404 in OpenAI's error body. The bound holds: past it the least recently used response is dropped, and counted."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseItemList

from tests.cli_support import run_cli
from tests.serve_support import TIMEOUT, Script, answers_while_held, held_at_step, wait_for
from tests.test_serve_responses import WEATHER, Seen, _serve, create, events_of

BOUND = 4


@pytest.fixture(scope="module")
def kept(tiny_checkpoints, tmp_path_factory):
    """Served keeping the newest :data:`BOUND` responses."""
    with _serve(tiny_checkpoints, tmp_path_factory, responses_store_max=BOUND) as running:
        yield SimpleNamespace(served=running, script=Script(running.state.engine), seen=Seen(running.state.engine))


@pytest.fixture(scope="module")
def none_kept(tiny_checkpoints, tmp_path_factory):
    """Served with ``--responses-store-max 0``: no response kept."""
    with _serve(tiny_checkpoints, tmp_path_factory, responses_store_max=0) as running:
        yield SimpleNamespace(served=running, script=Script(running.state.engine), seen=Seen(running.state.engine))


def _not_found(call) -> dict:
    with pytest.raises(openai.NotFoundError) as caught:
        call()
    assert caught.value.status_code == 404
    return caught.value.body


def _metric(server, name: str) -> float:
    return server.served.metrics()[name]


def test_a_chained_turn_gives_the_model_the_earlier_turns_but_not_their_instructions(kept):
    kept.script.say("Hello Ada.")
    first = create(kept, input="My name is Ada.", instructions="Answer in French.", max_output_tokens=20)
    assert first.store is True and first.previous_response_id is None
    kept.script.say("Ada.")
    second = create(kept, input="What is my name?", previous_response_id=first.id, instructions="Be brief.",
                    max_output_tokens=20)
    assert second.output_text == "Ada." and second.previous_response_id == first.id
    conversation = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Hello Ada."},
                    {"role": "user", "content": "What is my name?"}]
    assert kept.seen.messages[-1] == [{"role": "system", "content": "Be brief."}, *conversation]
    # the model's prompt is the whole conversation's: as many tokens as when the client sends it all itself
    whole = create(kept, input=conversation, instructions="Be brief.", max_output_tokens=20, store=False)
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert second.usage.input_tokens > first.usage.input_tokens + 10
    # a chain carries every turn before it, not only the last
    kept.script.say("Yes.")
    create(kept, input="Sure?", previous_response_id=second.id, max_output_tokens=20)
    assert kept.seen.messages[-1] == [*conversation, {"role": "assistant", "content": "Ada."},
                                      {"role": "user", "content": "Sure?"}]


def test_a_kept_response_is_retrieved_listed_and_deleted(kept):
    client = kept.served.client
    kept.script.say("Blue.")
    first = create(kept, input="The sky?", max_output_tokens=20)
    kept.script.say("Green.")
    reply = create(kept, input=[{"role": "user", "content": [{"type": "input_text", "text": "The grass?"}]}],
                   previous_response_id=first.id, max_output_tokens=20, metadata={"turn": "2"})
    raw = kept.served.http.get(f"/v1/responses/{reply.id}")
    assert raw.status_code == 200
    Response.model_validate(raw.json())
    got = client.responses.retrieve(reply.id)
    assert got.model_dump() == reply.model_dump()
    assert (got.output_text, got.metadata, got.store) == ("Green.", {"turn": "2"}, True)
    # the input items that made it, its chain's first: newest first (OpenAI's default order), each with an id
    page = kept.served.http.get(f"/v1/responses/{reply.id}/input_items").json()
    ResponseItemList.model_validate(page)
    texts = [(i["role"], i["content"][0]["text"]) for i in page["data"]]
    assert texts == [("user", "The grass?"), ("assistant", "Blue."), ("user", "The sky?")]
    assert page["data"][1]["id"] == first.output[0].id and page["has_more"] is False
    assert page["first_id"] == page["data"][0]["id"] and page["last_id"] == page["data"][-1]["id"]
    listed = client.responses.input_items.list(reply.id, order="asc", limit=2)
    assert [i.content[0].text for i in listed.data] == ["The sky?", "Blue."] and listed.has_more
    assert [i.content[0].text for i in listed] == ["The sky?", "Blue.", "The grass?"]  # the client pages on
    # deleted: gone for GET, for chaining and for a second delete
    r = kept.served.http.delete(f"/v1/responses/{reply.id}")
    assert (r.status_code, r.json()) == (200, {"id": reply.id, "object": "response", "deleted": True})
    assert _not_found(lambda: client.responses.retrieve(reply.id))["code"] == "response_not_found"
    assert _not_found(lambda: client.responses.delete(reply.id))["code"] == "response_not_found"
    assert _not_found(lambda: create(kept, input="x", previous_response_id=reply.id))["code"] == \
        "previous_response_not_found"
    client.responses.delete(first.id)  # the openai client's own delete: no error
    assert _not_found(lambda: client.responses.input_items.list(first.id))["code"] == "response_not_found"


def test_unknown_ids_are_404s_in_openais_error_body_counted_as_such(kept):
    http = kept.served.http
    before = _metric(kept, "kvload_http_requests_refused_total{reason=response_not_found}")
    body = _not_found(lambda: create(kept, input="Hi", previous_response_id="resp_nope"))
    assert body["message"].startswith("Previous response with id 'resp_nope' not found.")
    assert {k: body[k] for k in ("type", "param", "code")} == {
        "type": "invalid_request_error", "param": "previous_response_id", "code": "previous_response_not_found"}
    for method, path in (("GET", "/v1/responses/resp_nope"), ("DELETE", "/v1/responses/resp_nope"),
                         ("GET", "/v1/responses/resp_nope/input_items")):
        r = http.request(method, path)
        assert r.status_code == 404, (method, path)
        assert r.json() == {"error": {"message": "Response with id 'resp_nope' not found.",
                                      "type": "invalid_request_error", "param": "response_id",
                                      "code": "response_not_found"}}
    after = _metric(kept, "kvload_http_requests_refused_total{reason=response_not_found}")
    assert after == before + 4
    assert _metric(kept, "kvload_http_requests_refused_total{reason=model_not_found}") == 0
    # a bad page request names its parameter
    kept.script.say("Ok.")
    rid = create(kept, input="Hi", max_output_tokens=5).id
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order"),
                         ("after=msg_none", "after"), ("before=x", "before"),
                         ("limit=1&limit=50", "limit")):  # one of the two was read, unsaid
        r = http.get(f"/v1/responses/{rid}/input_items?{query}")
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), query
    for method, query in (("GET", "stream=true"), ("DELETE", "force=1")):  # taken by none: not silently unread
        r = http.request(method, f"/v1/responses/{rid}?{query}")
        assert (r.status_code, r.json()["error"]["param"]) == (400, query.split("=")[0]), query
    assert kept.served.client.responses.retrieve(rid).id == rid  # and nothing was deleted
    refused = kept.served.http.post("/v1/responses", json={"input": "Hi", "previous_response_id": 7})
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "previous_response_id")


@pytest.mark.parametrize("limit", ["%C2%B2", "1" * 5000, "%EF%BC%95"])  # superscript 2, 5,000 digits, fullwidth 5
def test_a_page_limit_that_is_no_plain_number_is_a_400_naming_it(kept, limit):
    """Digits int() refuses, or too many for it to read, were a 500 with a traceback in the server's log."""
    kept.script.say("Ok.")
    rid = create(kept, input="Hi", max_output_tokens=5).id
    r = kept.served.http.get(f"/v1/responses/{rid}/input_items?limit={limit}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text
    assert r.json()["error"]["message"].startswith("limit: expected an integer from 1 to 100, got ")


def test_store_false_is_not_kept_and_a_stream_is_kept_as_it_completed(kept):
    kept.script.say("Not kept.")
    gone = create(kept, input="Hi", store=False, max_output_tokens=20)
    assert gone.store is False and gone.output_text == "Not kept."
    assert _not_found(lambda: kept.served.client.responses.retrieve(gone.id))["code"] == "response_not_found"
    assert _not_found(lambda: create(kept, input="x", previous_response_id=gone.id))["param"] == \
        "previous_response_id"
    kept.script.say("Streamed and kept.")
    events = events_of(kept, input="Stream it", max_output_tokens=40)
    assert events[0].response.store is True
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert kept.served.client.responses.retrieve(final.id).model_dump() == final.model_dump()
    kept.script.say("Next.")
    events_of(kept, input="And then?", previous_response_id=final.id, max_output_tokens=40)
    assert kept.seen.messages[-1] == [{"role": "user", "content": "Stream it"},
                                      {"role": "assistant", "content": "Streamed and kept."},
                                      {"role": "user", "content": "And then?"}]


def _id_in_use(call) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    assert caught.value.body["code"] == "response_id_in_use"
    return caught.value.body


def test_an_id_that_names_a_kept_response_is_refused_not_replaced(kept):
    """A reused X-Request-Id (or request_id) must not silently swap the response a chain reaches for another."""
    kept.script.say("First.")
    first = create(kept, input="One", max_output_tokens=10, extra_headers={"X-Request-Id": "same-1"})
    assert first.id == "resp_same-1"
    kept.script.say("Second.")
    body = _id_in_use(lambda: create(kept, input="Two", max_output_tokens=10, extra_headers={"X-Request-Id": "same-1"}))
    assert body["param"] == "X-Request-Id" and "'resp_same-1' already names a kept response" in body["message"]
    body = _id_in_use(lambda: create(kept, input="Two", max_output_tokens=10, extra_body={"request_id": "same-1"}))
    assert body["param"] == "request_id"
    assert kept.served.client.responses.retrieve(first.id).output_text == "First."  # the kept one is untouched
    # not kept, it takes nothing: store false answers under that id; once deleted, the id is free again
    assert create(kept, input="Two", store=False, max_output_tokens=10, extra_body={"request_id": "same-1"}).id == \
        first.id
    kept.served.client.responses.delete(first.id)
    again = create(kept, input="Three", max_output_tokens=10, extra_body={"request_id": "same-1"})
    assert kept.served.client.responses.retrieve(again.id).output_text == "Second."
    # a request refused after its id was reserved leaves the id free
    refused = kept.served.http.post("/v1/responses", headers={"X-Request-Id": "same-2"},
                                    json={"input": "x", "max_output_tokens": 10**6})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_output_tokens"
    assert create(kept, input="Four", max_output_tokens=10, extra_headers={"X-Request-Id": "same-2"}).id == \
        "resp_same-2"


def test_an_id_a_kept_request_in_flight_holds_is_refused(kept):
    """Two requests in flight with one id: the second is refused, not left to replace the first once both end."""
    kept.script.say("Held.")

    def first(http):
        return http.post("/v1/responses", json={"input": "Hold", "max_output_tokens": 10},
                         headers={"X-Request-Id": "live-1"})

    def second(http):
        r = http.post("/v1/responses", json={"input": "Also", "max_output_tokens": 10},
                      headers={"X-Request-Id": "live-1"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "response_id_in_use", r.text
        assert "request still in flight" in r.json()["error"]["message"]

    # the engine's forward is held: the first request is queued, its id reserved, while the second arrives
    done = answers_while_held(kept.served, kept.served.state.engine.executor, "forward_scored", first, second)
    assert done.status_code == 200 and done.json()["id"] == "resp_live-1"
    assert kept.served.client.responses.retrieve("resp_live-1").output_text == "Held."


def _refused_in_progress(r, param: str, code: str) -> None:
    assert (r.status_code, r.json()["error"]["param"], r.json()["error"]["code"]) == (400, param, code), r.text
    assert "is still in progress" in r.json()["error"]["message"]


def test_a_kept_stream_in_progress_is_answered_as_it_stands_not_as_unknown(kept):
    """While a kept response is generated, GET is its object so far (status in_progress, OpenAI's answer), and
    DELETE and previous_response_id are 400s saying why: all three were 404s saying it did not exist."""
    http, script = kept.served.http, "Partly there, then all done."
    kept.script.say(script)
    events: list[dict] = []

    def stream() -> None:
        body = {"model": kept.served.state.model_name, "input": "Stream it", "stream": True, "max_output_tokens": 40}
        with httpx.Client(base_url=kept.served.url, timeout=TIMEOUT) as client, \
                client.stream("POST", "/v1/responses", json=body) as r:
            events.extend(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: "))

    def text_so_far() -> str:
        return "".join(e["delta"] for e in list(events) if e["type"] == "response.output_text.delta")

    with held_at_step(kept.served, 4) as (reached, _):  # three tokens out, the fourth held
        thread = threading.Thread(target=stream)
        thread.start()
        wait_for(lambda: reached.is_set() and text_so_far() != "", what="the stream's first text")
        rid = events[0]["response"]["id"]
        now = http.get(f"/v1/responses/{rid}")
        assert now.status_code == 200, now.text
        Response.model_validate(now.json())
        doc = now.json()
        assert (doc["id"], doc["status"], doc["usage"], doc["store"]) == (rid, "in_progress", None, True)
        (item,) = doc["output"]
        assert (item["type"], item["status"]) == ("message", "in_progress")
        assert item["content"][0]["text"].startswith(text_so_far()) and script.startswith(item["content"][0]["text"])
        items = http.get(f"/v1/responses/{rid}/input_items").json()["data"]
        assert [i["content"][0]["text"] for i in items] == ["Stream it"]
        _refused_in_progress(http.delete(f"/v1/responses/{rid}"), "response_id", "response_in_progress")
        _refused_in_progress(http.post("/v1/responses", json={"input": "Next", "previous_response_id": rid}),
                             "previous_response_id", "previous_response_in_progress")
        assert thread.is_alive()  # all answered while it was still being generated
    thread.join(TIMEOUT)
    assert events[-1]["type"] == "response.completed"
    done = http.get(f"/v1/responses/{rid}").json()
    assert done == events[-1]["response"] and done["output"][0]["content"][0]["text"] == script
    assert http.delete(f"/v1/responses/{rid}").json()["deleted"] is True  # once it ended, as any kept one


def test_a_kept_response_answered_whole_is_in_progress_until_it_is(kept):
    kept.script.say("Held.")
    rid = "resp_whole-1"

    def first(client):
        return client.post("/v1/responses", json={"input": "Hold", "max_output_tokens": 10},
                           headers={"X-Request-Id": "whole-1"})

    def meanwhile(client):
        doc = client.get(f"/v1/responses/{rid}").json()
        assert (doc["id"], doc["status"], doc["output"]) == (rid, "in_progress", []), doc
        _refused_in_progress(client.delete(f"/v1/responses/{rid}"), "response_id", "response_in_progress")

    done = answers_while_held(kept.served, kept.served.state.engine.executor, "forward_scored", first, meanwhile)
    assert done.status_code == 200
    assert kept.served.client.responses.retrieve(rid).model_dump()["status"] == "completed"
    # not kept: never in progress either (store: false answers nothing to GET)
    kept.script.say("Gone.")
    gone = create(kept, input="Hi", store=False, max_output_tokens=10)
    assert _not_found(lambda: kept.served.client.responses.retrieve(gone.id))["code"] == "response_not_found"


def test_a_request_too_large_to_keep_is_refused_naming_store_and_served_with_store_false(kept):
    """A kept response holds what its request sent besides the prompt (a reasoning item's text, ids), which nothing
    bounded: 20 MB reasoning items, kept 1,000 times over, grew the server by gigabytes."""
    kept.script.say("Ok.")
    limit = kept.served.state.responses.max_request_bytes
    thinking = {"type": "reasoning", "id": "rs_1", "summary": [],
                "content": [{"type": "reasoning_text", "text": "t" * limit}]}
    body = {"input": [{"role": "user", "content": "Hi"}, thinking, {"role": "user", "content": "Again"}],
            "max_output_tokens": 5}
    stored = len(kept.served.state.responses)
    r = kept.served.http.post("/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "store", r.text
    assert r.json()["error"]["message"].startswith(f"store: a response is kept only for a request of at most "
                                                   f"{limit:,} bytes (one 8,192-token prompt as text")
    assert len(kept.served.state.responses) == stored
    r = kept.served.http.post("/v1/responses", json={**body, "store": False})
    assert r.status_code == 200 and r.json()["store"] is False


def test_a_function_call_output_answers_the_kept_responses_call(kept):
    pytest.importorskip("xgrammar")
    kept.script.say('{"city": "Paris"}')
    asked = create(kept, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=60,
                   tool_choice={"type": "function", "name": "get_weather"})
    (call,) = asked.output
    kept.script.say("Sunny.")
    # the agent sends only the call's output: the call it answers is the kept response's
    answer = create(kept, previous_response_id=asked.id, tools=[WEATHER], tool_choice="none", max_output_tokens=20,
                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert answer.output_text == "Sunny."
    assert kept.seen.messages[-1] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}]
    # its input items, oldest first, in the shapes openai's models read
    page = kept.served.http.get(f"/v1/responses/{answer.id}/input_items?order=asc").json()
    ResponseItemList.model_validate(page)
    assert [i["type"] for i in page["data"]] == ["message", "function_call", "function_call_output"]
    assert page["data"][1] == call.model_dump(exclude_none=True)
    assert page["data"][2]["call_id"] == call.call_id and page["data"][2]["id"].startswith("fco_")


def test_past_the_bound_the_least_recently_used_is_dropped_and_counted(kept):
    assert _metric(kept, "kvload_responses_store_max") == BOUND
    evicted = _metric(kept, "kvload_responses_evicted_total")
    held = _metric(kept, "kvload_responses_stored")
    kept.script.say("Ok.")
    ids = [create(kept, input=f"Turn {i}", max_output_tokens=5).id for i in range(BOUND)]
    assert _metric(kept, "kvload_responses_stored") == BOUND
    assert _metric(kept, "kvload_responses_evicted_total") == evicted + held
    kept.served.client.responses.retrieve(ids[0])  # used: now the most recent
    newer = create(kept, input="One more", max_output_tokens=5).id
    assert _not_found(lambda: kept.served.client.responses.retrieve(ids[1]))["code"] == "response_not_found"
    for rid in (ids[0], *ids[2:], newer):
        assert kept.served.client.responses.retrieve(rid).id == rid
    assert _metric(kept, "kvload_responses_stored") == BOUND
    assert _metric(kept, "kvload_responses_evicted_total") == evicted + held + 1


def test_a_kept_turn_still_carries_the_earlier_turns_the_bound_dropped(kept):
    kept.script.say("One.")
    first = create(kept, input="Count.", max_output_tokens=5)
    kept.script.say("Two.")
    second = create(kept, input="Go on.", previous_response_id=first.id, max_output_tokens=5)
    for i in range(BOUND - 1):  # the first turn is now the least recently used: dropped
        create(kept, input=f"Filler {i}", max_output_tokens=5)
    assert _not_found(lambda: kept.served.client.responses.retrieve(first.id))["code"] == "response_not_found"
    kept.script.say("Three.")
    create(kept, input="Again.", previous_response_id=second.id, max_output_tokens=5)
    assert kept.seen.messages[-1] == [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One."},
                                      {"role": "user", "content": "Go on."}, {"role": "assistant", "content": "Two."},
                                      {"role": "user", "content": "Again."}]
    listed = kept.served.client.responses.input_items.list(second.id, order="asc")
    assert [i.content[0].text for i in listed.data] == ["Count.", "One.", "Go on."]


def test_a_server_that_keeps_none_reports_store_and_names_the_flag(none_kept):
    none_kept.script.say("Ok.")
    raw = none_kept.served.client.responses.with_raw_response.create(
        model=none_kept.served.state.model_name, input="Hi", store=True, max_output_tokens=5)
    reply = raw.parse()
    assert reply.store is False
    assert _not_found(lambda: none_kept.served.client.responses.retrieve(reply.id))["code"] == "response_not_found"
    records = [json.loads(line) for line in none_kept.served.http.get("/v1/kvload/audit").text.splitlines()]
    ignored = {r["field"]: r["reason"] for r in records
               if r["event"] == "setting_ignored" and r["reason"].endswith(f"(request {reply.id})")}
    assert list(ignored) == ["serve.store"] and "--responses-store-max 0" in ignored["serve.store"]
    body = _not_found(lambda: create(none_kept, input="Hi", previous_response_id=reply.id))
    assert body["code"] == "previous_response_not_found" and "--responses-store-max 0" in body["message"]
    assert none_kept.served.metrics()["kvload_responses_store_max"] == 0


@settings(max_examples=200, deadline=None)
@given(bound=st.integers(0, 4), ops=st.lists(st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 6)),
                                            max_size=40))
def test_the_store_keeps_the_most_recently_used_within_its_bound(bound, ops):
    """Against a plain model of LRU: the same ids kept, in the same order, and every one dropped counted."""
    from kvload.serve.responses_store import ResponseStore

    dropped: list[int] = []
    store = ResponseStore(bound, on_evicted=dropped.append)
    model: list[str] = []  # least recently used first
    evicted = 0
    for op, n in ops:
        rid = f"resp_{n}"
        if op == "put":
            store.put({"id": rid, "output": []}, ())
            if bound:
                model = [m for m in model if m != rid] + [rid]
                evicted += max(0, len(model) - bound)
                model = model[-bound:]
        elif op == "get":
            assert (store.get(rid) is not None) == (rid in model)
            if rid in model:
                model = [m for m in model if m != rid] + [rid]
        else:
            assert store.delete(rid) == (rid in model)
            model = [m for m in model if m != rid]
        assert len(store) == len(model) <= bound
    assert list(store._kept) == model and sum(dropped) == evicted


@pytest.mark.parametrize("value", ["-1", "1.5", "many"])
def test_a_bad_responses_store_max_exits_2_with_one_line_naming_it(capsys, value):
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", "--responses-store-max", value)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith("error: --responses-store-max: expected an integer"), r.err


def test_the_flag_bounds_the_served_store(monkeypatch, capsys):
    """``--responses-store-max`` (and its underscore spelling) reaches the served state; the default is 1000."""
    from kvload.cli.commands import build_parser
    from kvload.serve import command, server

    parse = build_parser().parse_args
    bounds = []
    real = server.build_state

    def build_state(result, **kwargs):
        state = real(result, **kwargs)
        bounds.append(state.responses.max_responses)
        return state

    monkeypatch.setattr(server, "build_state", build_state)
    monkeypatch.setattr(server, "serve", lambda state, host, port, log_level, ready, **_: None)
    base = ["serve", "tiny-llama", "--port", "0", "--max_tokens", "1024"]
    for flags in (["--responses-store-max", "7"], ["--responses_store_max", "0"], []):
        assert command.cmd_serve(parse([*base, *flags])) == 0
    assert bounds == [7, 0, 1000]


@pytest.mark.parametrize("key, value", [("id", "msg_\ud800"), ("id", "msg\x00\n1")])
def test_an_input_items_id_that_is_no_printable_text_is_a_400_naming_it(kept, key, value):
    """An input item's id is kept and listed back by ``input_items``: a lone surrogate in it was kept, and the
    listing then failed to encode (a 500 for every later read of that response's items); no other response's
    listing is touched."""
    http = kept.served.http
    kept.script.say("Hi.")
    body = json.dumps({"input": [{"role": "user", "content": "Hello", key: value}], "max_output_tokens": 5})
    r = http.post("/v1/responses", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == f"input[0].{key}" and error["message"].startswith(f"input[0].{key}: expected a string of "
                                                                                 "1 to "), error
    kept.script.say("Hi.")
    fine = create(kept, input=[{"role": "user", "content": "Hello", "id": "msg_1"}], max_output_tokens=5)
    listed = http.get(f"/v1/responses/{fine.id}/input_items")
    assert listed.status_code == 200 and listed.json()["data"][0]["id"] == "msg_1"


@pytest.mark.parametrize("key, value, param", [
    ("summary", [{"type": "summary_text", "text": "a\ud800"}], "input[0].summary"),
    ("content", [{"type": "reasoning_text", "text": "a\ud800"}], "input[0].content"),
    ("encrypted_content", "a\ud800", "input[0].encrypted_content")])
def test_a_reasoning_items_text_that_is_no_unicode_is_a_400_naming_it_not_a_kept_500(kept, key, value, param):
    """A reasoning item is kept and listed back as sent: a lone surrogate in its text (thinking no assistant turn
    follows, or no template renders) was served 200, and every ``input_items`` listing of that response was then a
    500 (it could not be encoded)."""
    http = kept.served.http
    kept.script.say("Hi.")
    item = {"type": "reasoning", "id": "rs_1", "summary": [], key: value}
    body = json.dumps({"input": [item, {"role": "user", "content": "Hello"}], "max_output_tokens": 5})
    r = http.post("/v1/responses", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text[:300],
                                  http.get(f"/v1/responses/{r.json().get('id')}/input_items").status_code)
    error = r.json()["error"]
    assert error["param"].startswith(param) and "not valid Unicode text (a lone surrogate" in error["message"], error
