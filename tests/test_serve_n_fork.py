"""``kvload serve`` computes a request's prompt once for its ``n`` choices, on V1 and V2: choice 0 prefills, the
others fork its KV (``engine.serving``'s module docstring), and every choice is the one a request of its own with
seed + j gives, streamed, scored and aborted on its own.

One server per manager over the tiny llama with ``test_serve_vllm``'s word-level tokenizer and chat template;
8-token blocks, so the prompts below end under one block or in the middle of the second.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.sampling_params import SamplingParams
from tests.serve_support import TIMEOUT, serving, wait_for
from tests.test_serve_vllm import words_checkpoint

T = 8  # tokens per block
PROMPTS = {
    "under one block": [1, 5, 17, 30],
    "mid-block": [1, 5, 17, 30, 42, 9, 88, 12, 7, 64, 25, 11, 3],  # one full block + 5
}
COMPUTED = "kvload_request_prefill_kv_computed_tokens_sum"  # prompt tokens whose KV was computed, every request
_salts = itertools.count()


@contextlib.contextmanager
def words_server(manager: str, folder: Path, budget: int, max_seq_len: int, tiny_checkpoints,
                 **load: Any) -> Iterator[Any]:
    """The tiny llama with the word tokenizer served as "words" on ``manager`` ("v1" or "v2"), ``budget`` KV tokens
    in ``T``-token blocks (``load``: more of ``pipeline.load``'s keywords, e.g. ``max_beam_width``)."""
    path = words_checkpoint(tiny_checkpoints, folder)
    config = {"max_tokens": budget, "tokens_per_block": T, "use_kv_cache_manager_v2": manager == "v2"}
    with serving(str(path), max_seq_len=max_seq_len, max_num_tokens=16, kv_cache_config=config,
                 state={"model_name": "words"}, **load) as s:
        yield s


@pytest.fixture(scope="module", params=["v1", "v2"])
def served(request, tiny_checkpoints, tmp_path_factory):
    with words_server(request.param, tmp_path_factory.mktemp(f"nfork-{request.param}"), 8192, 2048,
                      tiny_checkpoints) as s:
        yield s


def streamed_choices(stream, n: int) -> tuple[dict[int, list[int]], dict[int, str]]:
    """A streamed answer's ``n`` choices: each one's token ids, in order, and its finish reason."""
    got: dict[int, list[int]] = {j: [] for j in range(n)}
    reasons = {}
    for chunk in stream:
        for c in chunk.choices:
            got[c.index] += c.model_extra.get("token_ids") or []
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return got, reasons


def salt() -> str:
    """A reuse scope nothing was cached under: every prompt below is computed, not read from an earlier test's."""
    return f"nfork-{next(_salts)}"


def used(served) -> float:
    """KV blocks requests hold now, every layer group's (V1 names its one group "uniform", V2 its own)."""
    return sum(v for k, v in served.metrics().items()
               if k.startswith("kvload_kv_cache_blocks{") and k.endswith(",state=used}"))


def computed(served) -> float:
    return served.metrics()[COMPUTED]


def alone(served, prompt: list[int], j: int, **kw) -> list[int]:
    """Choice ``j`` as a request of its own (n=1, seed + j) gives it: what the server answered before forks."""
    extra = {"ignore_eos": True, "cache_salt": salt()}
    if "seed" in kw:
        kw = {**kw, "seed": kw["seed"] + j}
    r = served.client.completions.create(model="words", prompt=prompt, extra_body=extra, **kw)
    return r.choices[0].model_extra["token_ids"]


@pytest.mark.parametrize("name", list(PROMPTS))
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.3, "seed": 21}], ids=["greedy", "seeded"])
def test_n_choices_compute_the_prompt_once_and_each_is_its_own_requests(served, name, sampling):
    prompt = PROMPTS[name]
    before = served.metrics()
    r = served.client.completions.create(model="words", prompt=prompt, max_tokens=6, n=4,
                                         extra_body={"ignore_eos": True, "cache_salt": salt()}, **sampling)
    after = served.metrics()
    assert after[COMPUTED] - before[COMPUTED] == len(prompt)  # one prefill, not four
    # each choice still counts its prompt, as vLLM's child requests each do
    assert after["kvload_prompt_tokens_total"] - before["kvload_prompt_tokens_total"] == 4 * len(prompt)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 24
    want = [alone(served, prompt, j, max_tokens=6, **sampling) for j in range(4)]
    assert [c.model_extra["token_ids"] for c in r.choices] == want
    if sampling:
        assert len({tuple(w) for w in want}) > 1  # the seeds differ: a copy of choice 0 would fail above
    assert used(served) == 0


@pytest.mark.parametrize("name", list(PROMPTS))
def test_streamed_chat_choices_stream_independently_from_one_prefill(served, name):
    words = " ".join(f"w{t}" for t in PROMPTS[name][1:])  # the template puts <s> first
    messages = [{"role": "user", "content": words}]
    prompt = served.client.chat.completions.create(model="words", messages=messages, max_tokens=1,
                                                   extra_body={"cache_salt": salt()}).usage.prompt_tokens
    before = computed(served)
    stream = served.client.chat.completions.create(model="words", messages=messages, max_tokens=5, n=4, seed=7,
                                                   temperature=1.2, stream=True,
                                                   extra_body={"ignore_eos": True, "cache_salt": salt()})
    got, reasons = streamed_choices(stream, 4)
    assert computed(served) - before == prompt
    assert reasons == dict.fromkeys(range(4), "length")
    for j in range(4):
        r = served.client.chat.completions.create(model="words", messages=messages, max_tokens=5, seed=7 + j,
                                                  temperature=1.2,
                                                  extra_body={"ignore_eos": True, "cache_salt": salt()})
        assert got[j] == r.choices[0].model_extra["token_ids"], j


def test_choices_that_end_on_their_first_token_hold_no_blocks(served):
    prompt = PROMPTS["mid-block"]
    before = computed(served)
    r = served.client.completions.create(model="words", prompt=prompt, max_tokens=1, n=4, temperature=1.5, seed=3,
                                         extra_body={"ignore_eos": True, "cache_salt": salt()})
    assert computed(served) - before == len(prompt)
    assert [c.model_extra["token_ids"] for c in r.choices] == [alone(served, prompt, j, max_tokens=1,
                                                                     temperature=1.5, seed=3) for j in range(4)]
    assert used(served) == 0


def test_prompt_logprobs_are_scored_once_and_given_to_every_choice(served):
    prompt = PROMPTS["mid-block"]
    before = computed(served)
    r = served.client.completions.create(model="words", prompt=prompt, max_tokens=3, n=3, temperature=1.1, seed=4,
                                         extra_body={"ignore_eos": True, "cache_salt": salt(), "prompt_logprobs": 2})
    assert computed(served) - before == len(prompt)
    one = served.client.completions.create(model="words", prompt=prompt, max_tokens=3, temperature=1.1, seed=4,
                                           extra_body={"ignore_eos": True, "cache_salt": salt(),
                                                       "prompt_logprobs": 2})
    want = one.choices[0].model_extra["prompt_logprobs"]
    assert want[0] is None and len(want) == len(prompt)
    for c in r.choices:
        scored = c.model_extra["prompt_logprobs"]
        assert [set(e) if e else e for e in scored] == [set(e) if e else e for e in want]
        for got, exp in zip(scored[1:], want[1:], strict=True):
            for k in exp:
                assert got[k]["logprob"] == pytest.approx(exp[k]["logprob"], abs=1e-4)
    assert r.choices[0].model_extra["token_ids"] == one.choices[0].model_extra["token_ids"]


def test_a_client_that_hangs_up_mid_stream_has_every_choices_blocks_freed(served, monkeypatch):
    engine = served.state.engine
    step = engine._compute

    def slow(out):  # the tiny model's steps take well under a millisecond: the choices would end before the hang-up
        time.sleep(0.005)
        return step(out)

    monkeypatch.setattr(engine, "_compute", slow)
    aborted = served.metrics().get("kvload_request_success_total{finished_reason=abort}", 0)
    before = computed(served)
    body = {"model": "words", "prompt": PROMPTS["mid-block"], "max_tokens": 1900, "n": 4, "temperature": 1.0,
            "ignore_eos": True, "stream": True, "cache_salt": salt()}
    with httpx.Client(base_url=served.url, timeout=TIMEOUT) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        seen: set[int] = set()
        lines = response.iter_lines()  # held: a generator dropped mid-way closes the stream
        for line in lines:
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
            if len(seen) == 4:  # every choice streams: all four hold blocks now
                break
        assert used(served) > 0
    wait_for(lambda: served.metrics().get("kvload_request_success_total{finished_reason=abort}", 0) == aborted + 4,
             what="the four choices were aborted")
    assert computed(served) - before == len(body["prompt"])  # the three forks held choice 0's prompt KV
    assert used(served) == 0 and served.metrics()["kvload_num_requests_running"] == 0


LONG = [1, *range(100, 140)]  # 41 tokens: three 16-token prefill steps, so the forks wait two steps


def _group(served, params, n, prompt=LONG):
    """A request's ``n`` choices submitted to the engine, with their events; the loop held until the caller aborts
    or lets go, so what it aborts is applied before the choice 0's prefill has ended."""
    engine = served.state.engine
    events: dict[int, list] = {j: [] for j in range(n)}
    done = threading.Event()

    def sink(j, ev):
        events[j].append(ev)
        if all(e and e[-1].finished for e in events.values()):
            done.set()

    ids = engine.submit_group(prompt, params, [lambda ev, j=j: sink(j, ev) for j in range(n)], salt=salt())
    return engine, ids, events, done


def test_aborting_choices_still_waiting_for_the_prefill_frees_everything(served):
    with served.state.engine.state_lock:  # no step until the aborts are queued: they land while choice 0 prefills
        engine, ids, events, done = _group(served, SamplingParams(max_tokens=50, ignore_eos=True), 4)
        for rid in ids:
            engine.abort(rid)
    assert done.wait(TIMEOUT)
    assert [e[-1].finish_reason for e in events.values()] == ["abort"] * 4
    assert not engine.driver.forks_pending and not engine.driver.has_work
    wait_for(lambda: used(served) == 0, what="no block held")


def test_aborting_choice_0_mid_prefill_hands_the_prefill_to_the_next_choice(served):
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=1.4, seed=9)
    with served.state.engine.state_lock:
        engine, ids, events, done = _group(served, params, 3)
        engine.abort(ids[0])
    assert done.wait(TIMEOUT)
    assert events[0][-1].finish_reason == "abort"
    got = [list(events[j][-1].token_ids) for j in (1, 2)]
    assert got == [alone(served, LONG, j, max_tokens=5, temperature=1.4, seed=9) for j in (1, 2)]
    wait_for(lambda: used(served) == 0, what="no block held")
