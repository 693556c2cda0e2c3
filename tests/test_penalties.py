"""vLLM's penalties, ``min_tokens`` and ``min_p``: against transformers' processors where it has them, against the
OpenAI formula where it does not, with and without drafts, and on both managers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.penalties import penalize
from engine.sampling import target_probs
from engine.sampling_params import SamplingParams, greedy_ignored
from pipeline.errors import GenerationError
from tests.generate_support import load, prompts_for, used_blocks

NEW = 24  # tiny random models repeat themselves within a few tokens: a penalty has something to act on


def hf_generate(model: Any, prompt: list[int], n: int, **kw: Any) -> list[int]:
    """transformers' greedy decode with its own logits processors (``repetition_penalty``, ``min_new_tokens``)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def openai_greedy(model: Any, prompt: list[int], n: int, presence: float, frequency: float) -> list[int]:
    """Greedy decode by full forwards, the logits penalized by OpenAI's formula over the output's tokens."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(ids[len(prompt):], dtype=torch.long), minlength=logits.shape[0])
            logits = logits - frequency * counts - presence * (counts > 0).float()
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("manager", ["v1", "v2"])
@pytest.mark.parametrize("family", ["llama", "gemma3", "deepseek-v3"])
def test_repetition_penalty_is_transformers_greedy(tiny_checkpoints, family, manager):
    with load(tiny_checkpoints(family), manager, max_num_tokens=32) as result:
        model = result.hf_model
        ps = prompts_for(model.config.vocab_size, (5, 13))
        for r in (1.8, 0.7):
            outs = result.generate(ps, max_new_tokens=NEW, ignore_eos=True, repetition_penalty=r)
            ref = [hf_generate(model, p, NEW, repetition_penalty=r, eos_token_id=None) for p in ps]
            assert [o.token_ids for o in outs] == ref
        plain = result.generate(ps, max_new_tokens=NEW, ignore_eos=True)
        assert [o.token_ids for o in plain] != ref  # the penalty changed what greedy picks
        assert used_blocks(result) == 0


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_logit_bias_is_transformers_sequence_bias_of_single_tokens(tiny_checkpoints, manager):
    with load(tiny_checkpoints("llama"), manager, max_num_tokens=32) as result:
        model = result.hf_model
        (p,) = prompts_for(model.config.vocab_size, (8,))
        (plain,) = result.generate([p], max_new_tokens=NEW, ignore_eos=True)
        bias = {plain.token_ids[0]: -100.0, plain.token_ids[3]: -7.5, 42: 3.0}
        (out,) = result.generate([p], max_new_tokens=NEW, ignore_eos=True, logit_bias=bias)
        ref = hf_generate(model, p, NEW, eos_token_id=None, sequence_bias={(t,): b for t, b in bias.items()})
        assert out.token_ids == ref and plain.token_ids[0] not in out.token_ids
        with pytest.raises(GenerationError, match=r"logit_bias: token id 99999 is outside the vocabulary"):
            result.generate([p], max_new_tokens=2, logit_bias={99999: 1.0})


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_presence_and_frequency_penalties_follow_openais_formula(tiny_checkpoints, manager):
    with load(tiny_checkpoints("llama"), manager, max_num_tokens=32) as result:
        model = result.hf_model
        (p,) = prompts_for(model.config.vocab_size, (7,))
        for presence, frequency in ((1.5, 0.0), (0.0, 0.9), (0.5, -0.4)):
            (out,) = result.generate([p], max_new_tokens=NEW, ignore_eos=True, presence_penalty=presence,
                                     frequency_penalty=frequency)
            assert out.token_ids == openai_greedy(model, p, NEW, presence, frequency), (presence, frequency)
        # the largest presence penalty accepted keeps a tiny model that repeats itself from doing it as much
        (plain,) = result.generate([p], max_new_tokens=NEW, ignore_eos=True)
        (fresh,) = result.generate([p], max_new_tokens=NEW, ignore_eos=True, presence_penalty=2.0)
        assert len(set(plain.token_ids)) < len(set(fresh.token_ids))


def test_min_tokens_holds_the_stop_token_back_as_transformers_min_new_tokens(tiny_checkpoints):
    with load(tiny_checkpoints("llama"), "v2", max_num_tokens=32) as result:
        model = result.hf_model
        (p,) = prompts_for(model.config.vocab_size, (9,))
        first = hf_generate(model, p, 1, eos_token_id=None)[0]  # the token greedy picks at once: make it the stop
        (early,) = result.generate([p], max_new_tokens=NEW, stop_token_ids=[first])
        assert early.token_ids == [first] and early.finish_reason == "stop"
        (held,) = result.generate([p], max_new_tokens=NEW, stop_token_ids=[first], min_tokens=5)
        ref = hf_generate(model, p, NEW, eos_token_id=first, min_new_tokens=5)
        assert held.token_ids == ref and len(held.token_ids) > 5
        assert first not in held.token_ids[:5]


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_drafts_give_the_same_penalized_tokens_as_one_token_per_step(tiny_checkpoints, manager):
    """Row j of a drafting request is penalized as if its first j drafts were output (n-gram drafts feed on exactly
    the repetition a penalty fights)."""
    path = tiny_checkpoints("qwen3")
    kw = {"max_new_tokens": 30, "ignore_eos": True, "frequency_penalty": 0.05, "min_tokens": 6}
    with load(path, manager, max_num_tokens=32) as result:
        ps = [[3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4], [9, 10, 11, 9, 10, 11, 9]]
        plain = result.generate(ps, **kw)
    with load(path, manager, max_num_tokens=32, llm={"max_draft_len": 4, "speculation_max_batch_size": 8}) as result:
        drafted = result.generate(ps, **kw)
        assert result.executor.last_stats.accepted_draft_tokens > 0  # drafts were verified under the penalty
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]


def test_logprobs_stay_the_models_own_under_a_penalty(tiny_checkpoints):
    """vLLM's default (raw_logprobs): a penalty changes the pick, never the reported distribution."""
    with load(tiny_checkpoints("llama"), "v1", max_num_tokens=32) as result:
        (p,) = prompts_for(result.hf_model.config.vocab_size, (6,))
        (plain,) = result.executor.run([p], max_tokens=1, logprobs=5)[0].outputs
        (penalized,) = result.executor.run([p], max_tokens=1, logprobs=5, repetition_penalty=3.0,
                                           presence_penalty=2.0)[0].outputs
    top = {t: lp for t, lp in plain.logprobs[0].items() if t != plain.token_ids[0]}
    assert all(penalized.logprobs[0][t] == pytest.approx(lp) for t, lp in top.items())


def test_a_logit_bias_changed_in_place_acts_on_the_next_call(tiny_checkpoints):
    """SamplingParams is frozen but its dict is not: the biases are read from it each call, never a stale copy."""
    with load(tiny_checkpoints("llama"), "v1") as result:
        params = SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={7: -1.0})
        (before,) = result.generate([[3, 4, 5]], sampling_params=params)
        params.logit_bias[7] = 100.0
        (after,) = result.generate([[3, 4, 5]], sampling_params=params)
    assert after.token_ids == [7, 7, 7, 7] != before.token_ids


def test_settings_that_can_change_nothing_are_reported_ignored(tiny_checkpoints):
    """A setting accepted must act or say it is ignored: a text setting without text or stop strings, min_tokens when
    nothing could end a sample early."""
    with load(tiny_checkpoints("llama"), "v1") as result:  # no tokenizer: token ids in, no text out
        result.generate([[3, 4, 5]], max_new_tokens=4, ignore_eos=True, min_tokens=2,
                        include_stop_str_in_output=True, skip_special_tokens=False)
        ignored = {e["field"]: e["reason"] for e in result.audit.of("setting_ignored")}
        assert set(ignored) == {"generate.include_stop_str_in_output", "generate.skip_special_tokens",
                                "generate.min_tokens"}
        assert "no stop strings" in ignored["generate.include_stop_str_in_output"]
        result.generate([[3, 4, 5]], max_new_tokens=4, min_tokens=2, stop_token_ids=[7], salt="acts")
        assert len(result.audit.of("setting_ignored")) == 3  # min_tokens holds EOS and stop ids back: it acts


def test_rows_of_a_request_without_penalties_are_left_alone():
    logits = torch.randn(3, 50)
    req = _request([1, 2, 3], [4, 4])
    same = penalize(logits, [1, 1, 1], [(SamplingParams(), req)] * 3, frozenset())
    assert same is logits
    # the drafting request's second row counts its first draft (token 7) as output
    drafting = _request([1, 2, 3], [4, 4])
    drafting.draft_token_ids = [7]
    mixed = penalize(logits, [1, 2], [(SamplingParams(), req), (SamplingParams(presence_penalty=1.0), drafting)],
                     frozenset())
    assert torch.equal(mixed[0], logits[0])
    assert mixed[2, 7] == pytest.approx(logits[2, 7] - 1.0) and mixed[1, 7] == pytest.approx(logits[1, 7])
    assert mixed[1, 4] == pytest.approx(logits[1, 4] - 1.0) and mixed[1, 1] == pytest.approx(logits[1, 1])


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, 19), min_size=1, max_size=6), output=st.lists(st.integers(0, 19), max_size=6),
       drafts=st.lists(st.integers(0, 19), max_size=4), min_tokens=st.integers(0, 12),
       r=st.sampled_from([1.0, 0.5, 1.7]), presence=st.sampled_from([0.0, 1.0, -0.5]),
       frequency=st.sampled_from([0.0, 0.3]))
def test_a_drafting_requests_row_j_is_penalized_as_if_its_first_j_drafts_were_output(prompt, output, drafts,
                                                                                      min_tokens, r, presence,
                                                                                      frequency):
    params = SamplingParams(max_tokens=16, repetition_penalty=r, presence_penalty=presence,
                            frequency_penalty=frequency, min_tokens=min_tokens, stop_token_ids=[2])
    logits = torch.randn(1 + len(drafts), 20)
    req = _request(prompt, output)
    req.draft_token_ids = list(drafts)
    rows = penalize(logits, [1 + len(drafts)], [(params, req)], frozenset({0}))
    for j in range(1 + len(drafts)):  # one step per token: the drafts so far already output
        alone = penalize(logits[j:j + 1], [1], [(params, _request(prompt, output + drafts[:j]))], frozenset({0}))
        # atol: a logit the penalties bring near 0 differs in its 8th decimal between the batched and one-row paths
        assert torch.allclose(rows[j], alone[0], atol=1e-6), j


def test_min_p_keeps_only_tokens_near_the_most_likely_and_greedy_reports_it_ignored():
    logits = torch.randn(4, 200) * 3
    params = SamplingParams(temperature=0.7, min_p=0.2)
    probs = target_probs(logits, params)
    plain = target_probs(logits, SamplingParams(temperature=0.7))
    cut = plain < 0.2 * plain.max(dim=-1, keepdim=True).values
    assert torch.all(probs[cut] == 0) and torch.all(probs[~cut] > 0)
    assert [name for name, _, _ in greedy_ignored(SamplingParams(min_p=0.2))] == ["min_p"]


@pytest.mark.parametrize(("kw", "message"), [
    ({"repetition_penalty": 0}, r"repetition_penalty: expected a number in \[0.01, 100\]"),
    ({"repetition_penalty": float("inf")}, r"repetition_penalty: expected a number in \[0.01, 100\]"),
    ({"repetition_penalty": 1e39}, r"repetition_penalty: expected a number in \[0.01, 100\]"),  # float32 overflow
    ({"repetition_penalty": 1e-39}, r"repetition_penalty: expected a number in \[0.01, 100\]"),  # logits / r: inf
    ({"temperature": 10**400}, "temperature: expected a finite number"),
    ({"presence_penalty": 2.5}, r"presence_penalty: expected a number in \[-2, 2\]"),
    ({"frequency_penalty": float("nan")}, r"frequency_penalty: expected a number in \[-2, 2\]"),
    ({"min_tokens": 9, "max_tokens": 8}, r"min_tokens: expected an integer in \[0, max_tokens=8\]"),
    ({"min_tokens": 1.5}, "min_tokens: expected an integer"),
    ({"min_p": -0.1}, r"min_p: expected a number in \[0, 1\]"),
    ({"logit_bias": {3: 101}}, r"logit_bias: expected a mapping of token ids \(integers >= 0\) to numbers in"),
    ({"logit_bias": {-3: 1}}, r"logit_bias: expected a mapping of token ids"),
    ({"logit_bias": dict.fromkeys(range(5000), 1.0)}, "logit_bias: expected at most 4,096 tokens, got 5,000"),
])
def test_bad_penalty_values_name_the_field(kw, message):
    with pytest.raises(GenerationError, match=message):
        SamplingParams(**kw)


def _request(prompt: list[int], output: list[int]) -> Any:
    from cache_backends.request import Request

    req = Request("r", prompt, 16)
    req.output_token_ids.extend(output)
    return req
