"""``n > 1`` samples fork their prompt's one prefill: the prompt is computed once for any ``n``, on both managers, with
prefix reuse on or off, and every sample is the one it would be had it prefilled alone (its first token drawn from
the one prefill's logits with its own generator, its prompt's partial last block a copy of the first sample's)."""

from __future__ import annotations

import pytest

import kvload
from engine.sampling_params import SamplingParams
from tests.generate_support import used_blocks
from tests.llm_support import llm_kwargs, with_tokenizer

T = 8  # tokens per block
PROMPTS = {
    "under one block": [5, 17, 300],
    "ending mid-block": [5, 17, 300, 42, 9, 88, 123, 7, 64, 256, 11, 3, 400],  # one full block + 5
    "ending on a block": [5, 17, 300, 42, 9, 88, 123, 7, 64, 256, 11, 3, 400, 21, 22, 23],  # two full blocks
}
CONFIGS = [("v1", True), ("v1", False), ("v2", True), ("v2", False)]


@pytest.fixture(scope="module")
def words(tiny_checkpoints, tmp_path_factory):
    return with_tokenizer(tiny_checkpoints("llama"), tmp_path_factory.mktemp("fork-words") / "ckpt", 512)


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{m}-reuse-{'on' if r else 'off'}" for m, r in CONFIGS])
def llm(request, words):
    manager, reuse = request.param
    with kvload.LLM(str(words), **llm_kwargs(manager, enable_block_reuse=reuse, tokens_per_block=T)) as loaded:
        yield loaded


def assert_clean(llm: kvload.LLM) -> None:
    """No block left owned after the call, and the manager's bookkeeping intact."""
    assert used_blocks(llm.result) == 0
    manager = llm.result.kv_manager
    if hasattr(manager, "check_invariants"):
        manager.check_invariants()
    else:
        manager.pool.check_invariants()


def alone(llm: kvload.LLM, ids: list[int], salt: str, **params) -> list[int]:
    """The tokens of one sample that prefills its prompt itself."""
    return llm.generate([ids], SamplingParams(n=1, **params), salt=salt)[0].outputs[0].token_ids


_calls = iter(range(10**6))


def fresh_salt(llm: kvload.LLM) -> str:
    """A reuse scope nothing was cached under (with reuse off the salt is ignored, and said to be)."""
    return f"fork-{llm.route.kv_manager}-{next(_calls)}"


@pytest.mark.parametrize("name", list(PROMPTS))
@pytest.mark.parametrize("n", [1, 2, 8])
def test_the_prompt_is_computed_once_and_each_sample_is_its_seed_s(llm, name, n):
    ids = PROMPTS[name]
    params = {"max_tokens": 6, "temperature": 1.3, "ignore_eos": True}
    (out,) = llm.generate([ids], SamplingParams(n=n, seed=21, **params), salt=fresh_salt(llm))
    assert out.computed_prompt_tokens == len(ids)  # the one prefill: no sample recomputes any of it
    assert out.reused_prompt_tokens == (n - 1) * len(ids)
    finished = llm.audit.of("generation_finished")[-1]
    assert (finished["requests"], finished["prompt_tokens"] - finished["reused_prompt_tokens"]) == (n, len(ids))
    assert_clean(llm)
    # sample j draws from seed + j: exactly the sample that prefilled alone with that seed
    assert [c.token_ids for c in out.outputs] == [alone(llm, ids, fresh_salt(llm), seed=21 + j, **params)
                                                  for j in range(n)]
    assert_clean(llm)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_samples_are_the_greedy_sequence(llm, name):
    ids = PROMPTS[name]
    (out,) = llm.generate([ids], SamplingParams(n=8, max_tokens=7, ignore_eos=True), salt=fresh_salt(llm))
    assert out.computed_prompt_tokens == len(ids)
    ref = alone(llm, ids, fresh_salt(llm), max_tokens=7, ignore_eos=True)
    assert [c.token_ids for c in out.outputs] == [ref] * 8
    assert_clean(llm)


def test_samples_ended_by_their_first_token_need_no_kv(llm):
    ids = PROMPTS["ending mid-block"]
    (out,) = llm.generate([ids], SamplingParams(n=8, max_tokens=1, temperature=1.0, seed=3), salt=fresh_salt(llm))
    assert out.computed_prompt_tokens == len(ids)
    assert [len(c.token_ids) for c in out.outputs] == [1] * 8
    assert [c.token_ids for c in out.outputs] == [alone(llm, ids, fresh_salt(llm), max_tokens=1, temperature=1.0,
                                                        seed=3 + j) for j in range(8)]
    # a stop token drawn first ends every sample at once ("stop"), the first sample's included
    (out,) = llm.generate([ids], SamplingParams(n=4, max_tokens=5, logit_bias={77: 100.0}, stop_token_ids=[77],
                                                temperature=1.0, seed=1), salt=fresh_salt(llm))
    assert [(c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs] == [([77], "stop", 77)] * 4
    assert out.computed_prompt_tokens == len(ids)
    assert_clean(llm)


def test_many_prompts_each_computed_once(llm):
    prompts = [[i + 1, *ids[1:]] for i, ids in enumerate(PROMPTS.values())]  # no prompt a prefix of another
    outs = llm.generate(prompts, SamplingParams(n=8, max_tokens=4, temperature=0.9, seed=5, ignore_eos=True,
                                                repetition_penalty=1.3, logprobs=2), salt=fresh_salt(llm))
    assert [o.computed_prompt_tokens for o in outs] == [len(p) for p in prompts]
    # vLLM's rule: every prompt's sample j draws from seed + j, whatever the call's other prompts
    for ids, o in zip(prompts, outs, strict=True):
        for j, c in enumerate(o.outputs):
            got = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.9, seed=5 + j, ignore_eos=True,
                                                     repetition_penalty=1.3, logprobs=2), salt=fresh_salt(llm))[0]
            # the tokens exactly; the logprobs to float32 rounding: a batch of 8 samples and a batch of one may sum a
            # matmul in another order (one OpenMP thread picks other kernels than several)
            assert c.token_ids == got.outputs[0].token_ids
            assert [list(d) for d in c.logprobs] == [list(d) for d in got.outputs[0].logprobs]
            assert c.logprobs == [{t: pytest.approx(v, rel=1e-4, abs=1e-5) for t, v in d.items()}
                                  for d in got.outputs[0].logprobs]
    assert_clean(llm)


@pytest.mark.parametrize(("manager", "reuse"), CONFIGS)
def test_without_room_a_sample_waits_and_still_matches(words, manager, reuse):
    """Pools for one sequence: the others cannot fork beside the first, so they wait with their first token and
    compute what the prefix cache no longer holds (all of it with reuse off) once it is done."""
    ids = PROMPTS["ending mid-block"]
    kwargs = llm_kwargs(manager, enable_block_reuse=reuse, tokens_per_block=T, max_tokens=24)
    with kvload.LLM(str(words), **{**kwargs, "max_seq_len": 24}) as llm:
        params = {"max_tokens": 10, "temperature": 1.1, "ignore_eos": True}
        (out,) = llm.generate([ids], SamplingParams(n=3, seed=8, **params))
        assert [c.token_ids for c in out.outputs] == [alone(llm, ids, f"w{j}", seed=8 + j, **params) for j in range(3)]
        # with reuse off each sample computes its whole prompt; V1 reuses the whole block and computes the 5 after;
        # V2 may also take those 5 from the first sample's block once it is full and cached (partial reuse)
        least = {(False, "v1"): 3 * 13, (False, "v2"): 3 * 13, (True, "v1"): 13 + 2 * 5, (True, "v2"): 13}
        assert least[reuse, manager] <= out.computed_prompt_tokens <= 3 * 13
        assert_clean(llm)
