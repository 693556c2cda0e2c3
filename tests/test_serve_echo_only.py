"""vLLM's echo without generation on ``/v1/completions``: ``max_tokens: 0`` with ``echo: true`` answers the prompt
alone — its text, with ``logprobs`` its tokens' scores (the first null) — and no generated token (completion_tokens 0,
finish_reason "length"), as evaluation harnesses send it to score text. Without ``echo`` it stays a 400.

One server over the tiny llama with ``test_serve_vllm``'s word-level tokenizer (token ``i`` is ``w<i>``, 1 is the BOS
``<s>``), through the real openai client.
"""

from __future__ import annotations

import pytest

from tests.serve_support import serving
from tests.test_serve_vllm import words_checkpoint

PROMPT = "w5 w17 w30 w42 w7 w9"  # <s> and six words: 7 tokens
OTHER = [1, 9, 8, 300]  # token ids: echoed as their text, "<s> w9 w8 w300" (the BOS shows as nothing: "w9 w8 w300")


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory):
    path = words_checkpoint(tiny_checkpoints, tmp_path_factory.mktemp("echo-only"))
    with serving(str(path), max_seq_len=64, kv_cache_config={"max_tokens": 512, "tokens_per_block": 4},
                 state={"model_name": "words"}) as s:
        yield s


def _complete(served, prompt=PROMPT, max_tokens=0, **body):
    return served.client.completions.create(model="words", prompt=prompt, max_tokens=max_tokens, echo=True,
                                            **body)


def _ids(served, text):
    return served.http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def _without_last(logprobs):
    """A completion's legacy logprobs less its last token (the one generated)."""
    return {"tokens": logprobs.tokens[:-1], "token_logprobs": logprobs.token_logprobs[:-1],
            "top_logprobs": logprobs.top_logprobs[:-1], "text_offset": logprobs.text_offset[:-1]}


def _same_scores(got, want):
    """Two legacy logprobs (dicts of lists) hold the same tokens, offsets and numbers."""
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
    assert got["token_logprobs"][0] is None and want["token_logprobs"][0] is None
    assert got["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=1e-5)
    assert [None if t is None else set(t) for t in got["top_logprobs"]] == \
        [None if t is None else set(t) for t in want["top_logprobs"]]


def test_echo_without_generation_answers_the_prompt_and_its_real_scores(served):
    ids = _ids(served, PROMPT)
    r = _complete(served, logprobs=2, extra_body={"prompt_logprobs": 3})
    (choice,) = r.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert choice.model_extra["token_ids"] == [] and choice.model_extra["stop_reason"] is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 0, len(ids))
    # the scores are the model's: those of the same request generating one token, less that token
    one = _complete(served, max_tokens=1, logprobs=2, extra_body={"prompt_logprobs": 3}).choices[0]
    assert len(one.logprobs.tokens) == len(ids) + 1
    got = {k: getattr(choice.logprobs, k) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    _same_scores(got, _without_last(one.logprobs))
    assert got["tokens"] == ["<s>", *PROMPT.split()]
    assert all(lp < 0 for lp in got["token_logprobs"][1:])  # scored, not zeros
    assert len(set(got["token_logprobs"][1:])) > 1
    # vLLM's prompt_logprobs, asked with it, are the one-token request's too
    mine, theirs = choice.model_extra["prompt_logprobs"], one.model_extra["prompt_logprobs"]
    assert mine[0] is None and len(mine) == len(ids)
    for a, b in zip(mine[1:], theirs[1:], strict=True):
        assert list(a) == list(b)
        assert [v["logprob"] for v in a.values()] == pytest.approx([v["logprob"] for v in b.values()], abs=1e-5)
    # without logprobs: the prompt's text alone
    plain = _complete(served).choices[0]
    assert (plain.text, plain.logprobs, plain.finish_reason) == (PROMPT, None, "length")


def test_a_stream_sends_the_echo_first_then_the_ending_and_the_same_scores(served):
    whole = _complete(served, logprobs=1).choices[0]
    chunks = list(_complete(served, logprobs=1, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.completion_tokens, usage.prompt_tokens) == (0, len(_ids(served,
                                                                                                         PROMPT)))
    first, last = chunks[0].choices[0], chunks[-2].choices[0]
    assert len(chunks) == 3  # the echo, the ending, the usage
    assert (first.text, first.finish_reason) == (PROMPT, None)
    assert (last.text, last.finish_reason, last.logprobs) == ("", "length", None)
    got = {k: getattr(first.logprobs, k) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    want = {k: getattr(whole.logprobs, k) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    _same_scores(got, want)


def test_n_choices_of_several_prompts_each_echo_their_prompt_alone(served):
    body = {"n": 2, "temperature": 1.0, "seed": 7, "logprobs": 0}
    r = _complete(served, prompt=[PROMPT, OTHER], **body)
    texts = [PROMPT, PROMPT, "w9 w8 w300", "w9 w8 w300"]
    assert [c.text for c in r.choices] == texts and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert {c.finish_reason for c in r.choices} == {"length"}
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(_ids(served, PROMPT)) + len(OTHER)
    for c in r.choices:
        assert c.model_extra["token_ids"] == []
        assert len(c.logprobs.tokens) == len(OTHER if c.index >= 2 else _ids(served, PROMPT))
    assert r.choices[2].logprobs.token_logprobs[1:] == pytest.approx(
        r.choices[3].logprobs.token_logprobs[1:], abs=1e-5)  # the prompt scored once, each choice given it
    alone = _complete(served, prompt=OTHER, logprobs=0).choices[0].logprobs
    assert r.choices[2].logprobs.token_logprobs[1:] == pytest.approx(alone.token_logprobs[1:], abs=1e-5)
    # streamed: each choice its echo, then its ending
    by_index: dict[int, list] = {}
    for chunk in _complete(served, prompt=[PROMPT, OTHER], stream=True, **body):
        for c in chunk.choices:
            by_index.setdefault(c.index, []).append(c)
    assert sorted(by_index) == [0, 1, 2, 3]
    for index, parts in by_index.items():
        assert [p.text for p in parts] == [texts[index], ""]
        assert [p.finish_reason for p in parts] == [None, "length"]


def test_max_tokens_zero_without_echo_is_refused_in_one_line_naming_what_is_accepted(served):
    for body in ({"prompt": PROMPT, "max_tokens": 0}, {"prompt": PROMPT, "max_tokens": 0, "echo": False}):
        r = served.http.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "max_tokens" and "\n" not in error["message"]
        assert error["message"].startswith("max_tokens: expected an integer >= 1, or 0 with echo: true")
    # chat's max_tokens stays >= 1 (its echo puts the last message before a reply, which needs one)
    r = served.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5"}],
                                                        "max_tokens": 0, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens: expected an integer >= 1, got 0"
    # min_tokens asks for tokens no such answer has
    r = served.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "echo": True, "min_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    assert "[0, max_tokens=0]" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_metrics_count_no_generated_token_where_the_answer_says_none(served, stream):
    """The token the engine draws for an echo without generation is dropped, and the answer's usage says 0 generated
    tokens: /metrics said 1 per choice (``generation_tokens_total`` and the per-request histogram), so a dashboard's
    token totals disagreed with what clients were billed. Its prompt and its end are counted as any request's."""
    before = served.metrics()
    r = _complete(served, n=2, logprobs=1, stream=stream, **({"stream_options": {"include_usage": True}}
                                                             if stream else {}))
    usage = [c for c in r if c.usage is not None][-1].usage if stream else r.usage
    after = served.metrics()

    def moved(name: str) -> float:
        return after[name] - before[name]

    assert usage.completion_tokens == 0
    assert moved("kvload_generation_tokens_total") == 0
    assert moved("kvload_request_generation_tokens_sum") == 0 and moved("kvload_request_generation_tokens_count") == 2
    assert moved("kvload_request_max_num_generation_tokens_sum") == 0
    assert moved("kvload_prompt_tokens_total") == 2 * usage.prompt_tokens  # each choice's, as vLLM counts them
    assert moved("kvload_request_success_total{finished_reason=length}") == 2  # "length", as the answer says
