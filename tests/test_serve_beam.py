"""``kvload serve``'s beam search, vLLM's ``use_beam_search``: ``n`` beams, the ``n`` best hypotheses as the choices,
best first, each what ``LLM.beam_search`` gives for the same prompt and ``kvload.BeamSearchParams`` (and so
transformers' ``num_beams``, tested in ``test_beam_search``), run by the server's one engine loop; a server that
cannot search (V2, ``max_beam_width`` 1, ``n`` past it) says which flag to start it with.

The tiny llama with ``test_serve_vllm``'s word tokenizer (token ``i`` is ``w<i>``) and chat template, served by
``test_serve_n_fork``'s ``words_server``.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from engine.beam_search import BeamSearch, BeamSearchParams
from engine.sampling_params import SamplingParams
from kvload.serve.protocol import parse
from tests.serve_support import TIMEOUT, wait_for
from tests.test_serve_n_fork import salt, streamed_choices, used, words_server

PROMPT = [1, 5, 17, 30, 42, 9, 88, 12, 7, 64]
WIDTH = 4


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory):
    with words_server("v1", tmp_path_factory.mktemp("beam"), 8192, 256, tiny_checkpoints,
                      max_beam_width=WIDTH) as s:
        yield s


def reference(served, ids: list[int], **params):
    """``LLM.beam_search``'s hypotheses for ``ids`` on the served model (the loop idle: no request in flight)."""
    (out,) = served.result.executor.beam_search([ids], BeamSearchParams(**params), salt=salt())
    return out.sequences


def generated(served, sequences) -> list[str]:
    """Each hypothesis' generated text, EOS not shown: a choice's (``BeamSequence.text`` is vLLM's whole sequence)."""
    tokenizer = served.result.executor.tokenizer
    return [tokenizer.decode(list(s.token_ids), skip_special_tokens=True) for s in sequences]


def completion(served, body: dict) -> httpx.Response:
    return served.http.post("/v1/completions", json={"model": "words", **body})


@pytest.mark.parametrize("params", [dict(beam_width=WIDTH, max_tokens=6, ignore_eos=True),
                                    dict(beam_width=3, max_tokens=5, length_penalty=0.0),
                                    dict(beam_width=2, max_tokens=4, length_penalty=2.0, ignore_eos=True)])
def test_completion_choices_are_llm_beam_search_best_first(served, params):
    want = reference(served, PROMPT, **params)
    body = {"prompt": PROMPT, "use_beam_search": True, "n": params["beam_width"], "max_tokens": params["max_tokens"],
            "ignore_eos": params.get("ignore_eos", False), "return_token_ids": True, "cache_salt": salt()}
    if "length_penalty" in params:
        body["length_penalty"] = params["length_penalty"]
    r = completion(served, body)
    assert r.status_code == 200, r.text
    doc = r.json()
    choices = sorted(doc["choices"], key=lambda c: c["index"])
    assert [tuple(c["token_ids"]) for c in choices] == [s.token_ids for s in want]
    assert [c["finish_reason"] for c in choices] == [s.finish_reason for s in want]
    assert [c["text"] for c in choices] == generated(served, want)  # the prompt left out, as vLLM's server does
    assert doc["usage"]["prompt_tokens"] == len(PROMPT)
    assert doc["usage"]["completion_tokens"] == sum(len(s.token_ids) for s in want)


def test_streamed_beam_choices_equal_the_plain_answer(served):
    body = {"prompt": PROMPT, "use_beam_search": True, "n": 3, "max_tokens": 5, "ignore_eos": True,
            "cache_salt": salt()}
    plain = completion(served, {**body, "return_token_ids": True}).json()["choices"]
    stream = served.client.completions.create(model="words", prompt=PROMPT, n=3, max_tokens=5, stream=True,
                                              extra_body={"use_beam_search": True, "ignore_eos": True,
                                                          "return_token_ids": True, "cache_salt": salt()})
    got, reasons = streamed_choices(stream, 3)
    assert got == {c["index"]: c["token_ids"] for c in plain}
    assert reasons == {c["index"]: c["finish_reason"] for c in plain}


def test_chat_beam_search_applies_the_chat_template(served):
    # the template writes the user's words, then w2 for the reply: the prompt is [5, 17, 2]
    want = reference(served, [5, 17, 2], beam_width=2, max_tokens=4, ignore_eos=True)
    r = served.client.chat.completions.create(model="words", messages=[{"role": "user", "content": "w5 w17"}], n=2,
                                              max_tokens=4, extra_body={"use_beam_search": True, "ignore_eos": True})
    assert r.usage.prompt_tokens == 3
    assert [c.message.content for c in sorted(r.choices, key=lambda c: c.index)] == generated(served, want)
    assert r.usage.completion_tokens == sum(len(s.token_ids) for s in want)


def test_a_beam_search_waits_its_turn_and_counts_as_requests(served):
    """A beam search and plain requests sent together all finish (the loop runs the search as one unit of work
    between them), and /metrics counts each of its choices as a finished request."""
    key = "kvload_request_success_total{finished_reason=length}"
    before = served.metrics().get(key, 0.0)
    answers: dict[str, httpx.Response] = {}

    def send(name: str, body: dict) -> None:
        with httpx.Client(base_url=served.url, timeout=TIMEOUT) as http:
            answers[name] = http.post("/v1/completions", json={"model": "words", "prompt": PROMPT, "max_tokens": 5,
                                                               "ignore_eos": True, **body})

    threads = [threading.Thread(target=send, args=(f"plain{i}", {"cache_salt": salt()})) for i in range(2)]
    threads.insert(1, threading.Thread(target=send, args=("beam", {"use_beam_search": True, "n": 3})))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {name: r.status_code for name, r in answers.items()} == {"plain0": 200, "beam": 200, "plain1": 200}
    assert len(answers["beam"].json()["choices"]) == 3
    assert served.metrics()[key] == before + 5


def test_aborting_a_running_beam_search_frees_every_beam_and_the_loop_goes_on(served, monkeypatch):
    engine = served.state.engine
    compute = BeamSearch._compute

    def slow(self, out):  # the tiny model's steps take well under a millisecond: the search would end first
        time.sleep(0.005)
        return compute(self, out)

    monkeypatch.setattr(BeamSearch, "_compute", slow)
    events: dict[int, object] = {}
    done = threading.Event()

    def sink(j, ev):
        events[j] = ev
        if len(events) == 3:
            done.set()

    ids = engine.submit_beam(PROMPT, BeamSearchParams(beam_width=3, max_tokens=200, ignore_eos=True),
                             [lambda ev, j=j: sink(j, ev) for j in range(3)], salt=salt())
    wait_for(lambda: used(served) > 0, what="the beams hold blocks")
    engine.abort(ids[1])  # any choice's id stands for the whole search
    assert done.wait(TIMEOUT)
    assert [events[j].finish_reason for j in range(3)] == ["abort"] * 3
    wait_for(lambda: used(served) == 0, what="no block held")
    monkeypatch.undo()
    r = completion(served, {"prompt": PROMPT, "use_beam_search": True, "n": 2, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_a_request_sent_after_a_beam_search_waits_until_it_ends(served, monkeypatch):
    """First come, first served: the loop runs a search alone, so a short request queued behind a long search ends
    after it, and /metrics counts it waiting meanwhile."""
    engine = served.state.engine
    compute = BeamSearch._compute

    def slow(self, out):
        time.sleep(0.005)
        return compute(self, out)

    monkeypatch.setattr(BeamSearch, "_compute", slow)
    ended: list[str] = []
    done = threading.Event()

    def sink(name, ev):
        if ev.finished:
            ended.append(name)
            if name == "plain":
                done.set()

    with engine.state_lock:  # both queued before the loop's next step
        engine.submit_beam(PROMPT, BeamSearchParams(beam_width=2, max_tokens=150, ignore_eos=True),
                           [lambda ev: sink("beam", ev)] * 2, salt=salt())
        engine.submit(PROMPT, SamplingParams(max_tokens=1), lambda ev: sink("plain", ev), salt=salt())
    wait_for(lambda: served.metrics()["kvload_num_requests_waiting"] >= 1, what="the request counted waiting")
    assert done.wait(TIMEOUT)
    assert ended == ["beam", "beam", "plain"]


def test_length_penalty_without_beam_search_is_reported_as_ignored():
    job = parse({"prompt": "w5", "length_penalty": 1.5}, "completion", default_max_tokens=4)
    assert job.beam is None
    assert [(name, value) for name, value, _ in job.ignored] == [("length_penalty", 1.5)]


def test_n_past_max_beam_width_names_the_flag(served):
    r = completion(served, {"prompt": PROMPT, "use_beam_search": True, "n": WIDTH + 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "n"
    assert f"--max_beam_width {WIDTH + 1}" in err["message"] and f"max_beam_width={WIDTH}" in err["message"]


@pytest.mark.parametrize(("field", "value"), [("stop", ["w9"]), ("prompt_logprobs", 2), ("temperature", 0.7),
                                               ("response_format", {"type": "json_object"})])
def test_what_beam_search_cannot_honour_is_refused_by_name(served, field, value):
    r = completion(served, {"prompt": PROMPT, "use_beam_search": True, "n": 2, field: value})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == field and "use_beam_search" in err["message"]


def test_echo_with_logprobs_is_refused_as_beam_search_does_not_score_the_prompt(served):
    """A completion's echo with logprobs shows the prompt's tokens scored (lm-eval's loglikelihood): under beam search
    they came back null, a 200 that read as scored; refused naming echo, and either alone is served."""
    body = {"prompt": PROMPT, "use_beam_search": True, "n": 2, "max_tokens": 3}
    for logprobs in (0, 1):
        r = completion(served, {**body, "echo": True, "logprobs": logprobs})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "echo" and "logprobs" in err["message"] and "use_beam_search" in err["message"]
    assert completion(served, {**body, "echo": True}).status_code == 200
    assert completion(served, {**body, "logprobs": 1}).status_code == 200


@pytest.mark.parametrize(("manager", "flags"), [("v1", "; start it with --max_beam_width 2"),
                                                ("v2", " on KV cache manager V2, which cannot fork beams; start it "
                                                       "with --max_beam_width 2 --use_kv_cache_manager_v2 false")])
def test_a_server_without_beam_search_names_the_flags_to_start_it_with(manager, flags, tiny_checkpoints,
                                                                      tmp_path_factory):
    """One sentence each: V1's ran "max_beam_width=1 start it with ..." together."""
    with words_server(manager, tmp_path_factory.mktemp(f"nobeam-{manager}"), 2048, 256, tiny_checkpoints) as s, \
            pytest.raises(openai.BadRequestError) as info:
        s.client.completions.create(model="words", prompt=PROMPT, n=2, max_tokens=3,
                                    extra_body={"use_beam_search": True})
    err = info.value.body
    assert err["param"] == "use_beam_search"
    assert err["message"] == (f"use_beam_search: this server was started with max_beam_width=1{flags} to serve "
                              "beam search")


def test_completion_logprobs_of_a_one_beam_search_equal_a_greedy_requests(served):
    """One beam is greedy decoding: its choice's ``logprobs`` (tokens, values, the top 3 — more than the 2 a step
    ranks — and text offsets) are the plain greedy request's, in the same shape."""
    body = {"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "logprobs": 3, "temperature": 0}
    plain = completion(served, {**body, "cache_salt": salt()})
    beam = completion(served, {**body, "use_beam_search": True, "n": 1, "cache_salt": salt()})
    assert plain.status_code == 200 and beam.status_code == 200, beam.text
    want, got = plain.json()["choices"][0]["logprobs"], beam.json()["choices"][0]["logprobs"]
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-5)
    assert [list(t) for t in got["top_logprobs"]] == [list(t) for t in want["top_logprobs"]]
    for g, w in zip(got["top_logprobs"], want["top_logprobs"], strict=True):
        assert g == pytest.approx(w, abs=1e-5)


def test_each_beam_choice_carries_its_hypothesis_logprobs(served):
    """Completions and chat: per choice, its hypothesis' tokens' log-probabilities (summing to the search's
    cumulative log-probability) with the asked number of alternatives, in each endpoint's usual shape."""
    want = reference(served, PROMPT, beam_width=3, max_tokens=4, ignore_eos=True)
    r = completion(served, {"prompt": PROMPT, "use_beam_search": True, "n": 3, "max_tokens": 4, "ignore_eos": True,
                            "logprobs": 2, "cache_salt": salt()})
    assert r.status_code == 200, r.text
    for c, s in zip(sorted(r.json()["choices"], key=lambda c: c["index"]), want, strict=True):
        lp = c["logprobs"]
        assert lp["tokens"] == [f"w{t}" for t in s.token_ids]
        assert sum(lp["token_logprobs"]) == pytest.approx(s.cumulative_logprob, abs=1e-5)
        assert all(len(top) in (2, 3) and tok in top for tok, top in zip(lp["tokens"], lp["top_logprobs"],
                                                                         strict=True))
    chat = reference(served, [5, 17, 2], beam_width=2, max_tokens=3, ignore_eos=True)
    r = served.client.chat.completions.create(model="words", messages=[{"role": "user", "content": "w5 w17"}], n=2,
                                              max_tokens=3, logprobs=True, top_logprobs=5,
                                              extra_body={"use_beam_search": True, "ignore_eos": True})
    for c, s in zip(sorted(r.choices, key=lambda c: c.index), chat, strict=True):
        content = c.logprobs.content
        assert [t.token for t in content] == [f"w{t}" for t in s.token_ids]
        assert sum(t.logprob for t in content) == pytest.approx(s.cumulative_logprob, abs=1e-5)
        assert all(len(t.top_logprobs) == 5 for t in content)
