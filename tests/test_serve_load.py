"""``kvload serve`` under many clients at once against a tight KV budget (8 blocks of 32 tokens): requests wait for
room, yet every one is answered, what /metrics counts is what the clients were told, and once they are all answered
the engine is idle with every KV block back."""

from __future__ import annotations

import json
import random
import threading

import httpx
import pytest

from tests.serve_support import TIMEOUT, serving, wait_for

KV_TOKENS = 256  # 8 blocks of 32: a few requests at a time


@pytest.fixture(scope="module")
def served():
    with serving("tiny-llama", kv_cache_config={"max_tokens": KV_TOKENS}) as s:
        yield s


def test_a_request_without_max_tokens_gets_what_the_kv_cache_holds_after_its_prompt(served):
    """No max_tokens is the default's (256 for tiny-llama, cut to what max_seq_len leaves), and a server whose KV
    budget is under prompt + default refused every such request, most chat clients' (``param: prompt``, telling
    the client to lower a max_tokens it never sent). The default is cut to what the KV cache holds after the prompt
    instead; a max_tokens the client sent past that is still refused, naming it."""
    prompt = list(range(5, 5 + KV_TOKENS - 6))  # 6 tokens of room left in the pools
    r = served.http.post("/v1/completions", json={"prompt": prompt})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 6
    assert r.json()["usage"]["completion_tokens"] == 6
    r = served.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "lower max_tokens to at most 6," in r.json()["error"]["message"]
    r = served.http.post("/v1/completions", json={"prompt": list(range(5, 5 + KV_TOKENS + 1))})  # no room at all
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    # a min_tokens past that cut is the client's to lower (vLLM refuses min_tokens > its default max_tokens)
    r = served.http.post("/v1/completions", json={"prompt": prompt, "min_tokens": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    assert r.json()["error"]["message"].startswith(
        f"min_tokens: expected an integer in [0, max_tokens=6], what the KV cache (one sequence of {KV_TOKENS:,} "
        f"tokens) leaves after the prompt's {KV_TOKENS - 6} tokens (the request sends no max_tokens), got 7")
    r = served.http.post("/v1/completions", json={"prompt": prompt, "min_tokens": 6, "ignore_eos": True})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 6


def _body(i: int) -> dict:
    """Request ``i`` of the load: a mix of what clients send (no max_tokens, echo without generation, n > 1,
    logprobs, stop token ids, streams with usage)."""
    rng = random.Random(i)
    body: dict = {"prompt": [rng.randint(5, 200) for _ in range(rng.choice([3, 31, 33, 64, 120]))],
                  "n": rng.choice([1, 2, 3]), "stream": i % 2 == 1}
    kind = i % 6
    if kind == 0:
        body["prompt"] = body["prompt"] + [7] * (KV_TOKENS - 8 - len(body["prompt"]))  # the default: 8 tokens fit
    elif kind == 1:
        body.update(echo=True, max_tokens=0, logprobs=1)
    elif kind == 2:
        body.update(max_tokens=rng.choice([1, 5, 12]), logprobs=2)
    elif kind == 3:
        body.update(max_tokens=10, stop_token_ids=list(range(5, 100)), min_tokens=2)
    else:
        body.update(max_tokens=rng.choice([4, 16]), temperature=0.8, seed=i)
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    return body


def _send(url: str, body: dict) -> tuple[int, int, int, list[str]]:
    """(prompt tokens, generated tokens, n, finish reasons) as the client was told them."""
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        if not body["stream"]:
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            doc = r.json()
            usage, reasons = doc["usage"], [c["finish_reason"] for c in doc["choices"]]
        else:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "[DONE]"  # every stream ends
            docs = [json.loads(line) for line in lines[:-1]]
            usage = docs[-1]["usage"]
            reasons = [c["finish_reason"] for d in docs for c in d["choices"] if c["finish_reason"]]
    return usage["prompt_tokens"], usage["completion_tokens"], body["n"], reasons


def test_many_clients_at_once_are_all_answered_counted_as_told_and_leave_every_block_free(served):
    """24 clients at once, a mix of what clients send, more than the pools hold at a time: each is answered whole,
    /metrics' token and finish totals are what the answers' usage and finish reasons say (each of a prompt's n
    choices counting its prompt, as vLLM's), and then nothing runs or waits and no KV block is in use."""
    before = served.metrics()
    told: list[tuple[int, int, int, list[str]]] = []
    failed: list[BaseException] = []

    def client(i: int) -> None:
        try:
            told.append(_send(served.url, _body(i)))
        except BaseException as exc:  # an assertion in a thread: reported by the test's own
            failed.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not failed, failed[0]
    assert len(told) == 24
    engine = served.state.engine
    wait_for(lambda: not any(engine.snapshot()[k] for k in ("running", "waiting", "suspended")), what="idle")
    after = served.metrics()

    def moved(name: str) -> float:
        return after[name] - before[name]

    assert moved("kvload_prompt_tokens_total") == sum(p * n for p, _, n, _ in told)
    assert moved("kvload_generation_tokens_total") == sum(g for _, g, _, _ in told)
    for reason in ("stop", "length", "abort", "error"):
        assert moved(f"kvload_request_success_total{{finished_reason={reason}}}") == \
            sum(rs.count(reason) for *_, rs in told), reason
    assert after["kvload_num_requests_running"] == after["kvload_num_requests_waiting"] == 0
    assert after["kvload_http_requests_in_flight"] == 0
    assert sum(v for k, v in after.items() if k.startswith("kvload_kv_cache_blocks{") and "state=used" in k) == 0
    assert engine.snapshot()["manager"].requests == 0  # no sequence left in the manager
