"""vLLM's ``allowed_token_ids`` and ``bad_words``: only allowed ids are drawn (sampled or greedy, with drafts too),
a banned word never appears in the output, bad values are one line; the server takes both through ``extra_body``."""

from __future__ import annotations

import openai
import pytest
import torch

import kvload
from engine.penalties import penalize
from engine.sampling_params import SamplingParams
from pipeline.errors import GenerationError
from tests.generate_support import load
from tests.llm_support import llm_kwargs, with_tokenizer
from tests.serve_support import serving

VOCAB = 512
PROMPT = "w5 w17 w300 w42 w9 w88 w123 w7 w64 w256 w11 w3 w400"
ALLOWED = [3, 11, 42, 99, 256, 300, 401]


@pytest.fixture(scope="module")
def words(tiny_checkpoints, tmp_path_factory):
    return with_tokenizer(tiny_checkpoints("llama"), tmp_path_factory.mktemp("words") / "ckpt", VOCAB)


@pytest.fixture(scope="module")
def llm(words):
    with kvload.LLM(str(words), **llm_kwargs()) as loaded:
        yield loaded


def tokens(llm, **kw) -> list[int]:
    return llm.generate(PROMPT, max_tokens=16, ignore_eos=True, **kw)[0].outputs[0].token_ids


def test_sampling_draws_only_allowed_ids_whatever_the_seed(llm):
    for seed in range(4):
        free = tokens(llm, temperature=1.5, seed=seed)
        assert not set(free) <= set(ALLOWED)  # unconstrained, the model goes elsewhere
        assert set(tokens(llm, temperature=1.5, seed=seed, allowed_token_ids=ALLOWED)) <= set(ALLOWED)


def test_greedy_picks_the_most_likely_allowed_token(llm):
    ids = llm.tokenizer(PROMPT)["input_ids"]
    with torch.inference_mode():
        logits = llm.result.hf_model(torch.tensor([ids])).logits[0, -1]
    best = ALLOWED[int(logits[ALLOWED].argmax())]
    assert int(logits.argmax()) != best  # the constraint changes the pick
    assert tokens(llm, allowed_token_ids=ALLOWED)[0] == best


def test_allowed_ids_that_leave_nothing_to_draw_are_one_line_before_any_step(llm):
    """Every allowed id banned (a one-token bad word, or an end-of-sequence id held back by min_tokens): every logit
    would be -inf, and greedy returned token 0 without a word. Refused before generating, naming both settings."""
    eos = sorted(llm.result.executor.eos_token_ids)[0]
    with pytest.raises(GenerationError, match=r"^generate: allowed_token_ids: every allowed token is banned by "
                                              r"bad_words, so no token could be generated; allow another token$"):
        llm.generate(PROMPT, max_tokens=4, allowed_token_ids=[42], bad_words=["w42"])
    with pytest.raises(GenerationError, match=r"allowed_token_ids: every allowed token is banned by min_tokens"):
        llm.generate(PROMPT, max_tokens=4, allowed_token_ids=[eos], min_tokens=2)
    # one allowed id left over is enough, and the reason does not apply without min_tokens
    assert set(tokens(llm, allowed_token_ids=[42, 99], bad_words=["w42"])) == {99}
    assert llm.generate(PROMPT, max_tokens=1, allowed_token_ids=[eos])[0].outputs[0].token_ids == [eos]



def test_bad_words_or_min_tokens_that_ban_the_whole_vocabulary_are_one_line_before_any_step(llm):
    """Without allowed_token_ids the same hole was open (hunt65a): bad_words naming every token left every logit -inf,
    so sampling raised torch's RuntimeError ("probability tensor contains either inf, nan or element < 0") from
    inside a step and greedy returned token 0, a banned word, as "length"; min_tokens holding back stop_token_ids
    that cover what is left did the same. Refused before generating, naming the setting, and the LLM is unchanged."""
    every = [f"w{i}" for i in range(VOCAB)]
    before = tokens(llm)
    for temperature in (0.0, 1.0):
        with pytest.raises(GenerationError, match=r"^generate: bad_words: they ban every token of the vocabulary "
                                                  r"\(512 ids\), so no token could be generated; ban fewer words$"):
            llm.generate(PROMPT, max_tokens=4, temperature=temperature, bad_words=every)
        with pytest.raises(GenerationError, match=r"^generate: min_tokens: every token of the vocabulary \(512 ids\) "
                                                  r"is a stop or end-of-sequence token it holds back or a one-token "
                                                  r"bad word, so no first token could be generated; lower min_tokens"):
            llm.generate(PROMPT, max_tokens=4, temperature=temperature, bad_words=every[1:], stop_token_ids=[0],
                         min_tokens=1)
        with pytest.raises(GenerationError, match=r"^generate: min_tokens: every token of the vocabulary \(512 ids\) "
                                                  r"is a stop or end-of-sequence token it holds back, so"):
            llm.generate(PROMPT, max_tokens=4, temperature=temperature, stop_token_ids=list(range(VOCAB)),
                         min_tokens=1)
    stats = llm.result.executor.manager.stats()
    assert stats.requests == 0 and all(g.used == 0 for g in stats.groups.values())
    assert tokens(llm) == before
    # one token left is enough: it is drawn every step (greedy or sampled), and ends the sample as a stop id
    assert set(tokens(llm, bad_words=every[:7] + every[8:])) == {7}
    assert set(tokens(llm, bad_words=every[:7] + every[8:], temperature=1.0, seed=0)) == {7}
    out = llm.generate(PROMPT, max_tokens=4, bad_words=every[1:], stop_token_ids=[0])[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == ([0], "stop")


def test_a_bad_word_is_never_generated_and_the_rest_stays_greedy(llm):
    plain = tokens(llm)
    banned = plain[3]
    out = tokens(llm, bad_words=[f"w{banned}"])
    assert banned not in out and len(out) == 16 and all(0 <= t < VOCAB for t in out)
    assert out[:3] == plain[:3]  # greedy up to the banned token
    # a two-token word: its second token is banned only right after its first
    a, b = plain[5], plain[6]
    two = tokens(llm, bad_words=[f"w{a} w{b}"])
    assert two[:6] == plain[:6] and two[6] != b
    assert all(two[i:i + 2] != [a, b] for i in range(len(two) - 1))


def test_bad_values_are_one_line_naming_the_field(llm):
    # a list is shown as the list given (the server's JSON array, --stop), not as the tuple kept: "got ('',)" read as
    # Python's, not the client's
    cases = [({"allowed_token_ids": []}, r"^generate: allowed_token_ids: expected a non-empty list of token ids "
                                         r"\(integers >= 0\), or None for any, got \[\]$"),
             ({"allowed_token_ids": [3, VOCAB]}, rf"^generate: allowed_token_ids: token id {VOCAB} is outside the "
                                                 rf"vocabulary \(0\.\.{VOCAB - 1}\)$"),
             ({"bad_words": "w5"}, r"^generate: bad_words: expected a list of non-empty strings, got 'w5'$"),
             ({"bad_words": [" "]}, r"^generate: bad_words: expected a list of non-empty strings, got \[' '\]$"),
             ({"stop": ["a", ""]}, r"^generate: stop: expected a non-empty string or a list of them, got \['a', ''\]$")]
    for kw, match in cases:
        with pytest.raises(GenerationError, match=match) as info:
            tokens(llm, **kw)
        assert "\n" not in str(info.value)


def test_bad_words_without_a_tokenizer_are_refused(tiny_checkpoints):
    refused = pytest.raises(GenerationError, match=r"^generate: bad_words: banned words are tokenized, but .* has "
                                                   r"no tokenizer")
    with load(tiny_checkpoints("llama"), "v1", max_num_tokens=32) as result, refused:  # no tokenizer in it
        result.generate([[1, 2, 3]], max_new_tokens=2, bad_words=["w1"])


def test_a_draft_row_bans_a_bad_word_completed_by_the_drafts_before_it():
    from cache_backends.request import Request

    params = SamplingParams(bad_words=["x y"])
    object.__setattr__(params, "_bad_words_token_ids", ((4, 7),))  # what the executor's tokenizer gives
    req = Request("r", [1, 2], 16)
    req.output_token_ids.extend([5, 4])
    req.draft_token_ids = [9, 4]  # rows: after [5, 4], after [.., 9], after [.., 9, 4]
    out = penalize(torch.zeros(3, 10), [3], [(params, req)], frozenset())
    assert out[:, 7].tolist() == [-torch.inf, 0.0, -torch.inf]
    assert (out[:, :7] == 0).all() and (out[:, 8:] == 0).all()


def test_allowed_ids_give_the_same_tokens_with_speculative_drafts(tiny_checkpoints):
    path = tiny_checkpoints("qwen3")
    kw = {"max_new_tokens": 24, "ignore_eos": True, "allowed_token_ids": [3, 4, 5, 6, 7, 9]}
    ps = [[3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4], [9, 10, 11, 9, 10, 11, 9]]
    with load(path, "v1", max_num_tokens=32) as result:
        plain = result.generate(ps, **kw)
    with load(path, "v1", max_num_tokens=32, llm={"max_draft_len": 4, "speculation_max_batch_size": 8}) as result:
        drafted = result.generate(ps, **kw)
        assert result.executor.last_stats.draft_tokens > 0
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert all(set(o.token_ids) <= set(kw["allowed_token_ids"]) for o in drafted)


def test_the_server_takes_both_fields_through_extra_body(words):
    with serving(str(words)) as served:
        def complete(**extra):
            return served.client.completions.create(model=served.state.model_name, prompt=PROMPT, max_tokens=8,
                                                    extra_body={"ignore_eos": True, **extra})

        plain = complete().choices[0].text.split()
        assert set(complete(allowed_token_ids=[3, 11, 42]).choices[0].text.split()) <= {"w3", "w11", "w42"}
        assert plain[0] not in complete(bad_words=[plain[0]]).choices[0].text.split()
        for extra, field in (({"allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
                             ({"bad_words": "w5"}, "bad_words")):
            with pytest.raises(openai.BadRequestError) as info:
                complete(**extra)
            assert info.value.status_code == 400 and info.value.body["param"] == field
