"""``kvload serve`` as OpenAI's and vLLM's clients expect it, on a preset (token ids): settings greedy decoding ignores
said so, a ``max_tokens`` past the context length refused, completions' top logprobs holding the chosen token,
and ``models.retrieve``.

Each test failed before its fix: seed/top_p/top_k/n accepted under greedy without a ``setting_ignored``; an explicit
``max_tokens`` of 100,000,000 cut to what ``max_seq_len`` leaves (200); the chosen token missing from its
``top_logprobs`` and ``logprobs=0`` giving ``{}``; ``GET /v1/models/{id}`` a 404 for the served model.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.serve_support import serving

PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def served():
    with serving("tiny-llama") as s:
        yield s


def _ignored(served, request_id: str) -> dict[str, object]:
    """The ``setting_ignored`` records ``/v1/kvload/audit`` holds for one request: field → value."""
    records = [json.loads(line) for line in served.http.get("/v1/kvload/audit").text.splitlines()]
    return {r["field"]: r["value"] for r in records
            if r["event"] == "setting_ignored" and r.get("request") == request_id  # `kvload audit` groups by it
            and r["reason"].endswith(f"(request {request_id})")}


def test_sampling_settings_greedy_decoding_ignores_are_reported_once_per_request(served):
    r = served.client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=4, seed=5, top_p=0.5, n=2,
                                         extra_body={"top_k": 3, "ignore_eos": True})
    assert r.choices[0].model_extra["token_ids"] == r.choices[1].model_extra["token_ids"]  # greedy: identical
    # one record per setting for the request (not one per choice), in the audit the server log also prints from
    assert _ignored(served, r.id) == {"serve.seed": 5, "serve.top_p": 0.5, "serve.top_k": 3, "serve.n": 2}
    records = [json.loads(line) for line in served.http.get("/v1/kvload/audit").text.splitlines()]
    mine = [x for x in records if x["event"] == "setting_ignored" and r.id in x["reason"]]
    assert len(mine) == 4 and all(x["reason"].startswith("temperature is 0 (greedy): ") for x in mine)
    # sampling uses them all: nothing to report
    sampled = served.client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=4, seed=5, top_p=0.5,
                                               n=2, temperature=0.7, extra_body={"top_k": 3})
    assert _ignored(served, sampled.id) == {}


def test_settings_that_can_change_nothing_are_reported_once_per_request(served):
    r = served.client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=4,
                                         extra_body={"ignore_eos": True, "min_tokens": 2,
                                                     "include_stop_str_in_output": True, "skip_special_tokens": False})
    assert _ignored(served, r.id) == {"serve.include_stop_str_in_output": True, "serve.skip_special_tokens": False,
                                      "serve.min_tokens": 2}


def test_user_is_openais_caller_id_a_string(served):
    r = served.client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2, user="ada")
    assert len(r.choices[0].model_extra["token_ids"]) == 2
    assert _ignored(served, r.id) == {}  # the README says it changes nothing; no record per request
    with pytest.raises(openai.BadRequestError) as info:
        served.client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2, extra_body={"user": 123})
    assert info.value.body["param"] == "user"


def test_completion_top_logprobs_hold_the_top_k_and_the_chosen_token(served):
    for k in (0, 1, 3):
        r = served.client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=12, logprobs=k,
                                             temperature=2.0, seed=11, extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        ids = r.choices[0].model_extra["token_ids"]
        assert lp.tokens == [str(t) for t in ids]  # no tokenizer: the ids as text
        for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert top[token] == chosen
            assert k <= len(top) <= k + 1
        assert lp.text_offset == [0] * len(ids)  # no tokenizer: the text is empty
    # temperature 2 picks tokens outside the top one: the chosen is then an extra entry
    assert any(len(top) == 2 for top in served.client.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=12, logprobs=1, temperature=2.0, seed=11,
        extra_body={"ignore_eos": True}).choices[0].logprobs.top_logprobs)


def test_the_model_card_names_the_loaded_model_as_vllms_root_for_clients_that_find_the_tokenizer_there(served):
    """vLLM's ``/v1/models`` card carries ``root`` (the model it loaded; benchmark and eval clients load the tokenizer
    from it when the served name is an alias) and ``parent`` (a LoRA's base, null otherwise); kvload's had neither."""
    (card,) = served.client.models.list().data
    assert (card.model_extra["root"], card.model_extra["parent"]) == ("tiny-llama", None)
    assert served.client.models.retrieve("tiny-llama").model_extra["root"] == "tiny-llama"


def test_the_openai_client_retrieves_the_served_model_and_an_unknown_one_is_a_404(served):
    model = served.client.models.retrieve("tiny-llama")
    assert model.id == "tiny-llama" and model.object == "model" and model.model_extra["max_model_len"] == 8192
    with pytest.raises(openai.NotFoundError) as info:
        served.client.models.retrieve("gpt-4/turbo")
    assert info.value.body == {"message": "model: 'gpt-4/turbo' is not served here; this server serves 'tiny-llama'",
                               "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


def test_max_tokens_past_the_context_length_is_refused_and_the_default_is_capped():
    with serving("tiny-llama", max_seq_len=64, state={"default_max_tokens": 1000}) as s:
        r = s.http.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 64 - len(PROMPT)
        r = s.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 60})
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": "'max_tokens' or 'max_completion_tokens' is too large: 60. This model's maximum context length "
                       "is 64 tokens and your request has 5 input tokens (60 > 64 - 5)",
            "type": "invalid_request_error", "param": "max_tokens", "code": None}
        r = s.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 59, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 59


def test_a_salt_with_prefix_reuse_off_is_reported_ignored():
    with serving("tiny-llama", kv_cache_config={"max_tokens": 2048, "enable_block_reuse": False}) as s:
        r = s.client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2, extra_body={"salt": "team-a"})
        assert len(r.choices[0].model_extra["token_ids"]) == 2  # served as asked
        assert _ignored(s, r.id) == {"serve.salt": "team-a"}
    # with reuse on the salt scopes what is shared: nothing to report
    with serving("tiny-llama") as s:
        r = s.client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2, extra_body={"salt": "team-a"})
        assert _ignored(s, r.id) == {}
