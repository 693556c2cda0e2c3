"""Speculative decoding by n-gram lookup (``max_draft_len``): drafts computed beside the last token, then verified.

What a user relies on: the tokens are the ones decoding one token per step gives (the model's argmax at every
position; for a sampled request, each token drawn from its own distribution), a confirmed draft's KV is what its
position needs (later steps, windows and other requests reusing the block read it), a rejected draft's KV is never
read, and the pools hold nothing of a finished request.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvload
from cache_backends.interface import SchedulerOutput
from cache_backends.request import Request
from cache_backends.v1 import GuaranteedNoEvictScheduler
from cache_backends.v2 import KVCacheV2Scheduler
from engine.driver import Driver
from engine.speculation import NgramProposer
from tests.generate_support import greedy_admission, hf_greedy, load, prompts_for, used_blocks
from tests.kv_v1_support import make_manager as make_v1
from tests.kv_v2_support import FULL, check_kv, full_sliding_layers, write_kv
from tests.kv_v2_support import make_manager as make_v2
from tests.llm_support import llm_kwargs
from tests.paged_support import CUDA

# --- the proposer ----------------------------------------------------------------------------------


def brute_force(tokens: list[int], max_ngram: int, limit: int) -> list[int]:
    """The proposer's rule, by scanning: the longest suffix (up to ``max_ngram``) that occurred earlier, its latest
    earlier occurrence, and up to ``limit`` tokens after it."""
    end = len(tokens)
    for n in range(min(max_ngram, end - 1), 0, -1):
        suffix = tokens[end - n:]
        for at in range(end - 1, n - 1, -1):  # exclusive end of an earlier occurrence, latest first
            if tokens[at - n:at] == suffix:
                return tokens[at:at + limit]
    return []


def test_the_proposer_copies_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    p = NgramProposer(max_draft_len=3, max_matching_ngram_size=2, max_seq_len=100)
    r = Request("a", [1, 2, 3, 9, 2, 3, 4, 5, 7, 2, 3], 10)
    assert p.propose(r) == [4, 5, 7]  # "2 3" last occurred before "4 5 7" (not before "9")
    r.output_token_ids.append(8)  # "3 8" and "8" never occurred: no guess
    assert p.propose(r) == []
    r.output_token_ids.append(2)  # "8 2" never occurred, "2" last before "3"
    assert p.propose(r) == [3, 8, 2]


def test_drafts_never_run_past_max_new_tokens_or_max_seq_len():
    p = NgramProposer(max_draft_len=8, max_matching_ngram_size=2, max_seq_len=100)
    r = Request("a", [1, 2, 3, 4, 5, 6, 1, 2], 4)
    r.output_token_ids.append(3)  # 3 of 4 tokens left to generate: at most 2 drafts, then the model's token
    assert p.propose(r) == [4, 5]
    short = NgramProposer(max_draft_len=8, max_matching_ngram_size=2, max_seq_len=11)
    assert short.propose(Request("b", [1, 2, 3, 4, 5, 6, 1, 2], 50)) == [3, 4]  # 8 + 2 + 1 = max_seq_len
    r.output_token_ids += [4, 5]  # the last token to generate: nothing to draft
    assert p.propose(r) == []


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, 4), min_size=1, max_size=30),
       steps=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3), max_size=12),
       max_ngram=st.integers(1, 4), limit=st.integers(1, 5))
def test_the_incremental_index_proposes_what_a_scan_of_the_sequence_finds(prompt, steps, max_ngram, limit):
    p = NgramProposer(max_draft_len=limit, max_matching_ngram_size=max_ngram, max_seq_len=10_000)
    r = Request("r", prompt, 10_000)
    assert p.propose(r) == brute_force(r.all_token_ids, max_ngram, limit)
    for tokens in steps:  # tokens arrive one or a few at a time (confirmed drafts)
        r.output_token_ids += tokens
        assert p.propose(r) == brute_force(r.all_token_ids, max_ngram, limit)
    p.forget("r")
    assert p.tracked == 0


# --- driver, schedulers and managers: a scripted model ------------------------------------------------


def model_token(tokens: list[int]) -> int:
    """A deterministic 'model': mostly repeats the token 4 back (drafts land), every 5th position something new."""
    n = len(tokens)
    return (tokens[-1] * 3 + n) % 11 if n % 5 == 0 or n < 4 else tokens[n - 4]


def scripted(manager, v2_kv: bool):
    """compute() of the scripted model: writes V2's synthetic KV for every computed position (drafts included) and
    answers each reaching request with its confirmed drafts and the token after them."""
    def compute(out: SchedulerOutput) -> dict[str, int | list[int]]:
        answers: dict[str, int | list[int]] = {}
        for chunk in out.scheduled:
            r = chunk.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + chunk.num_tokens
            seen = r.all_token_ids + r.draft_token_ids[:max(0, end - r.num_tokens)]
            if v2_kv:
                write_kv(manager, r, start, chunk.num_tokens, tokens=seen)
            if end < r.num_tokens:
                continue
            known, drafts = r.all_token_ids, seen[r.num_tokens:]
            got = []
            for d in drafts:
                if model_token(known + got) != d:
                    break
                got.append(d)
            answers[r.req_id] = [*got, model_token(known + got)] if drafts else model_token(known)
        return answers
    return compute


def run_scripted(kind: str, prompts: list[list[int]], max_new: int, draft: int, *, blocks: int = 64,
                 budget: int = 64, sliding: bool = False,
                 reuse: bool = True) -> tuple[list[list[int]], int, int, Driver]:
    """Every prompt through a V1 or V2 driver with (``draft`` > 0) or without speculation; checks V2's KV each step."""
    if kind == "v1":
        manager = make_v1(blocks, reuse=reuse)
        scheduler = GuaranteedNoEvictScheduler(manager, 8, budget)
    else:
        manager = make_v2(full_sliding_layers(8) if sliding else FULL, blocks, enable_block_reuse=reuse,
                          max_seq_len=4096)
        scheduler = KVCacheV2Scheduler(manager, 8, budget, init_ratio=0.0)
    proposer = NgramProposer(draft, 2, manager.options.max_seq_len) if draft else None
    driver = Driver(manager, scheduler, propose=proposer.propose if proposer is not None else None)
    drafted = accepted = 0

    def stepped(clock, st) -> None:
        nonlocal drafted, accepted
        drafted += st.draft_tokens
        accepted += st.accepted_draft_tokens
        if kind == "v2":
            for r in driver.running:
                check_kv(manager, r)  # every committed position, confirmed drafts included, holds its own KV
            manager.check_invariants()

    requests = [Request(f"r{i}", p, max_new) for i, p in enumerate(prompts)]
    driver.run(requests, scripted(manager, kind == "v2"), on_step=stepped, max_steps=2000)
    assert sum(g.used for g in manager.stats().groups.values()) == 0  # every block given back (cached ones evictable)
    return [r.output_token_ids for r in requests], drafted, accepted, driver


PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7], [2, 2, 9, 4, 2, 2, 9, 4, 2], [8, 1, 8, 1, 8, 1, 8, 3, 3, 7, 7, 7]]


@pytest.mark.parametrize(("kind", "sliding"), [("v1", False), ("v2", False), ("v2", True)])
def test_scripted_speculation_gives_the_tokens_of_one_token_per_step(kind, sliding):
    plain, *_ = run_scripted(kind, PROMPTS, 24, 0, sliding=sliding)
    spec, drafted, accepted, _ = run_scripted(kind, PROMPTS, 24, 4, sliding=sliding)
    assert spec == plain
    assert 0 < accepted < drafted  # drafts were both confirmed and refused: both paths ran


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_blocks_holding_confirmed_drafts_are_reused_by_a_later_prompt(kind):
    first, _, accepted, driver = run_scripted(kind, PROMPTS[:1], 20, 4, blocks=64)
    assert accepted > 0
    manager, scheduler = driver.manager, driver.scheduler
    again = Request("again", PROMPTS[0] + first[0][:16], 6)  # the prompt and 16 generated tokens: 5 full blocks
    follow = Driver(manager, scheduler, propose=NgramProposer(4, 2, 4096).propose)
    follow.run([again], scripted(manager, kind == "v2"),
               on_step=lambda c, s: kind == "v2" and [check_kv(manager, r) for r in follow.running])
    assert again.num_reused_tokens >= 20  # blocks committed during speculative steps were cached and reused
    reference = list(again.prompt_token_ids)
    for _ in range(6):
        reference.append(model_token(reference))
    assert again.output_token_ids == reference[len(again.prompt_token_ids):]


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_drafts_only_take_the_token_budget_real_tokens_left(kind):
    # budget 3 per step: two decoding requests leave one token of budget for drafts
    spec, drafted, _, _ = run_scripted(kind, PROMPTS[:2], 12, 4, budget=3)
    plain, *_ = run_scripted(kind, PROMPTS[:2], 12, 0, budget=3)
    assert spec == plain and drafted > 0


def test_v2_under_pressure_drafts_never_push_a_request_out():
    # few blocks: V2 suspends or preempts; drafts take free blocks only, so outputs stay exact and nothing stalls
    spec, drafted, _, driver = run_scripted("v2", PROMPTS, 16, 4, blocks=12, sliding=True)
    plain, *_ = run_scripted("v2", PROMPTS, 16, 0, blocks=12, sliding=True)
    assert spec == plain and drafted > 0
    stats = driver.manager.stats()
    assert stats.suspends + stats.preemptions > 0  # the pressure was real


def test_a_compute_that_answers_with_a_token_it_did_not_draft_is_refused():
    manager = make_v1(16)
    driver = Driver(manager, GuaranteedNoEvictScheduler(manager, 4, 64), propose=lambda r, running: [5, 6])

    def liar(out: SchedulerOutput) -> dict[str, int | list[int]]:
        r = out.scheduled[0].request
        return {r.req_id: [9, 9] if r.draft_token_ids else 5}  # "confirms" a 9 that was never computed

    with pytest.raises(RuntimeError, match="every token but the last must be a draft the step computed"):
        driver.run([Request("a", [1, 2, 3], 8)], liar)


# --- the real executor: tiny checkpoints of every family ----------------------------------------------

REPEATING = ([3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4], [9, 10, 11, 9, 10, 11, 9])
NEW = 30  # tiny random models fall into runs of one token within 30: drafts get confirmed


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("manager", ["v1", "v2"])
@pytest.mark.parametrize("family", ["llama", "gemma3", "deepseek-v3"])
def test_generate_with_drafts_equals_transformers_greedy(tiny_checkpoints, family, manager, device):
    with load(tiny_checkpoints(family), manager, max_num_tokens=32, device=device,
              llm={"max_draft_len": 4, "speculation_max_batch_size": 8}) as result:
        model = result.hf_model
        ps = [*prompts_for(model.config.vocab_size, (5, 13)), *map(list, REPEATING)]
        ref = [hf_greedy(model, p, NEW) for p in ps]
        outs = result.generate(ps, max_new_tokens=NEW)
        assert [o.token_ids for o in outs] == ref
        stats = result.executor.last_stats
        assert stats.draft_tokens > 0 and stats.accepted_draft_tokens > 0  # the verify path ran, and confirmed some
        # the call's steps summed per draft position (vLLM's spec_decode_num_accepted_tokens_per_pos)
        assert sum(stats.accepted_per_position) == stats.accepted_draft_tokens and len(stats.accepted_per_position) <= 4
        assert stats.steps < max(len(r) for r in ref) + 4  # (prefill chunks of 32 tokens: a few steps)
        assert used_blocks(result) == 0
        # the blocks those steps committed are reused: the prompt and its output, continued, is still exact
        longer = ps[1] + ref[1][:20]
        again = result.generate([longer], max_new_tokens=6)[0]
        assert again.reused_prompt_tokens > 0 and again.token_ids == hf_greedy(model, longer, 6)


@pytest.mark.parametrize("family, max_tokens", [("llama", 160), ("gemma3", 96)])
def test_v2_with_drafts_under_a_tight_budget_gives_transformers_greedy_tokens(tiny_checkpoints, family, max_tokens):
    # V2 reserves each decode's one token in the step's scan of the running requests (schedule_decode) and its drafts
    # after every real token: under a KV budget of a few sequences and 8 tokens a step, decodes find no block, requests
    # move out and come back, drafts are confirmed and refused, and every token must still be transformers' greedy one
    spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 16}
    with kvload.LLM(str(tiny_checkpoints(family)), speculative_config=spec,
                    **{**llm_kwargs("v2", max_tokens=max_tokens), "max_num_tokens": 8}) as llm:
        greedy_admission(llm.result)  # no growth headroom: admission fills the pool, so decodes run out of blocks
        model = llm.result.hf_model
        ps = [*prompts_for(model.config.vocab_size, (5, 13, 21, 2, 9, 17)), *map(list, REPEATING)]
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], max_tokens=NEW, temperature=0.0)
        stats = llm.result.executor.last_stats
        assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(model, p, NEW) for p in ps]
        assert stats.suspends + stats.preemptions > 0 and stats.accepted_draft_tokens > 0
        assert used_blocks(llm.result) == 0


def test_drafts_wait_while_more_requests_run_than_speculation_max_batch_size(tiny_checkpoints):
    with load(tiny_checkpoints("qwen3"), "v2", llm={"max_draft_len": 4, "speculation_max_batch_size": 1}) as result:
        ps = prompts_for(result.hf_model.config.vocab_size, (5, 13))
        result.generate(ps, max_new_tokens=NEW, ignore_eos=True)
        both = result.executor.last_stats
        result.generate(ps[1:], max_new_tokens=NEW, ignore_eos=True, salt="alone")
        alone = result.executor.last_stats
    # the two run to the end together: no drafts until one finished; alone, the request drafts
    assert both.draft_tokens == 0 and alone.draft_tokens > 0


def test_a_stop_token_among_confirmed_drafts_ends_the_output_there_with_its_logprobs(tiny_checkpoints):
    with load(tiny_checkpoints("qwen3"), "v1", llm={"max_draft_len": 4}) as result:
        model = result.hf_model
        seed = prompts_for(model.config.vocab_size, (5,))[0]
        # the model's own greedy text as the prompt: its continuation copies the prompt, so a confirmed draft can be
        # a token the output has not had yet (a draft always copies an earlier token)
        p = seed + hf_greedy(model, seed, 13)
        steps: list[list[int]] = []
        out = result.executor.run([p], max_tokens=12, ignore_eos=True, logprobs=2,
                                  on_delta=lambda d: steps.append(list(d.token_ids)))[0].outputs[0]
        plain = hf_greedy(model, p, 12)
        assert out.token_ids == plain and len(out.logprobs) == len(plain)
        assert all(t in lp for t, lp in zip(out.token_ids, out.logprobs, strict=True))
        # a step that gave a confirmed draft and more after it, whose first token is new to the output: stop there
        seen: list[int] = []
        stop = None
        for tokens in steps:
            if len(tokens) > 1 and tokens[0] not in seen:
                stop = tokens[0]
                break
            seen += tokens
        assert stop is not None, f"no step confirmed a draft new to the output: {steps}"
        cut = result.executor.run([p], max_tokens=12, ignore_eos=True, stop_token_ids=[stop], logprobs=1,
                                  salt="stop")[0].outputs[0]
        assert cut.token_ids == plain[:plain.index(stop) + 1] and cut.finish_reason == "stop"
        assert len(cut.logprobs) == len(cut.token_ids)  # the confirmed tokens after the stop left no logprobs


def test_sampled_requests_draft_too_keeping_their_distribution_and_their_seed(tiny_checkpoints):
    with load(tiny_checkpoints("qwen3"), "v2", llm={"max_draft_len": 4}) as result:
        prompt = prompts_for(result.hf_model.config.vocab_size, (5,))[0]
        greedy = result.generate([prompt], max_new_tokens=NEW, ignore_eos=True, salt="g")[0].token_ids
        greedy_stats = result.executor.last_stats
        assert greedy_stats.accepted_draft_tokens > 0
        # top_k=1 samples from a one-hot distribution: exactly the greedy tokens, with the same drafts kept
        one_hot = result.generate([prompt], max_new_tokens=NEW, ignore_eos=True, temperature=0.8, top_k=1, seed=3,
                                  salt="k")[0].token_ids
        assert one_hot == greedy
        stats = result.executor.last_stats
        assert (stats.draft_tokens, stats.accepted_draft_tokens, stats.steps) == \
            (greedy_stats.draft_tokens, greedy_stats.accepted_draft_tokens, greedy_stats.steps)
        # a seed fixes a sampled request's tokens with drafts on, to the tokens it gives with drafts off, whatever
        # runs beside it (a second prompt keeps drafts off until it ends: speculation_max_batch_size is 1)
        seeded = {"temperature": 0.2, "seed": 11, "max_new_tokens": NEW, "ignore_eos": True}
        drafted = result.generate([prompt], salt="s0", **seeded)[0].token_ids
        assert result.executor.last_stats.accepted_draft_tokens > 0
        from engine.sampling_params import SamplingParams

        other = prompts_for(result.hf_model.config.vocab_size, (9,))[0]
        beside = result.executor.generate([prompt, other], [SamplingParams(temperature=0.2, seed=11, max_tokens=NEW,
                                                                           ignore_eos=True),
                                                            SamplingParams(max_tokens=3, ignore_eos=True)], salt="s1")
        assert beside[0].token_ids == drafted
        result.executor.use_speculation(0)
        plain = result.generate([prompt], salt="s2", **seeded)[0].token_ids
        assert drafted == plain
        assert not [e for e in result.audit.of("setting_ignored") if e["field"] == "max_draft_len"]


def test_sampled_verification_draws_each_token_from_the_requests_own_distribution():
    # speculative sampling's promise, checked by counting: the first token kept is distributed as p_0 whatever the
    # draft, and the second (given the first draft kept) as p_1; a verifier that kept every draft, or redrew the
    # refused position from p_0 itself, fails by a wide margin
    import torch

    from engine.sampling_params import SamplingParams
    from engine.speculation import verify_sampled

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 3.0, -2.0, 1.0, 0.5], [1.0, 1.0, 1.0, 1.0, 1.0]])
    params = SamplingParams(temperature=0.9, top_k=4)
    from engine.sampling import target_probs

    p = target_probs(logits, params).double()
    gen = torch.Generator().manual_seed(0)
    n = 40_000
    first, second = torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
    for _ in range(n):
        kept = verify_sampled(logits, [1, 3], params, gen)  # draft 1 is p_0's second choice, 3 p_1's second
        first[kept[0]] += 1
        if kept[0] == 1:
            second[kept[1]] += 1
    assert (first / n - p[0]).abs().max() < 0.01
    assert (second / second.sum() - p[1]).abs().max() < 0.015
    assert first[3] == 0  # outside row 0's top-k: never drawn
    assert all(verify_sampled(logits, [3, 1], params, gen)[0] != 3 for _ in range(500))  # nor kept as a draft


def test_ngram_size_without_drafts_is_reported_ignored_and_a_bad_value_is_one_line(tmp_path, capsys):
    import pipeline
    from kvload.cli.entry import main

    result = pipeline.plan("tiny-llama", max_matching_ngram_size=3)
    ignored = result.audit.of("setting_ignored")
    assert any(e["field"] == "max_matching_ngram_size" and "max_draft_len=0" in e["reason"] for e in ignored)
    code = main(["plan", "tiny-llama", "--max_draft_len", "-1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "max_draft_len" in err[0]


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("max_draft_len", 65, "max_draft_len: expected an integer from 0 to 64, got 65"),
    ("max_draft_len", True, "max_draft_len: expected an integer from 0 to 64, got true"),
    ("max_matching_ngram_size", 10**6, "max_matching_ngram_size: expected an integer from 1 to 8, got 1000000"),
    ("max_matching_ngram_size", 0, "max_matching_ngram_size: expected an integer from 1 to 8, got 0"),
    ("speculation_max_batch_size", "2", "speculation_max_batch_size: expected an integer >= 1, got '2'"),
])
def test_a_draft_setting_out_of_bounds_is_one_error_naming_it(field, value, expected):
    # the proposer indexes every n-gram up to max_matching_ngram_size of every token: a huge one would hang a load
    import pipeline
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        pipeline.plan("tiny-llama", **{field: value})
    assert str(exc.value).splitlines() == [expected]


def test_the_generate_summary_and_json_report_drafts(tiny_checkpoints):
    with load(tiny_checkpoints("qwen3"), "v1", llm={"max_draft_len": 4}) as result:
        result.generate(prompts_for(result.hf_model.config.vocab_size, (5,)), max_new_tokens=NEW, ignore_eos=True)
        stats = result.executor.last_stats
    assert f"{stats.accepted_draft_tokens} of {stats.draft_tokens} draft tokens accepted" in stats.line()
    plain = json.loads(json.dumps(stats.to_dict()))
    assert plain["draft_tokens"] == stats.draft_tokens and 0 < plain["acceptance_rate"] <= 1


def test_the_server_drafts_and_answers_with_one_token_per_step_s_tokens(tiny_checkpoints):
    from tests.serve_support import serving

    path = tiny_checkpoints("qwen3")
    refs: dict[int, list[int]] = {}
    prompt = prompts_for(512, (5,))[0]

    def reference(result):
        refs[0] = hf_greedy(result.hf_model, prompt, NEW)

    with serving(str(path), before=reference, max_draft_len=4, max_seq_len=64,
                 kv_cache_config={"max_tokens": 512, "tokens_per_block": 4}) as served:
        model = served.client.models.list().data[0].id
        before = served.metrics()
        r = served.client.completions.create(model=model, prompt=prompt, max_tokens=NEW, logprobs=2,
                                             extra_body={"ignore_eos": True})
        assert r.choices[0].model_extra["token_ids"] == refs[0]
        assert len(r.choices[0].logprobs.token_logprobs) == NEW
        chunks = list(served.client.completions.create(model=model, prompt=prompt, max_tokens=NEW, stream=True,
                                                       extra_body={"ignore_eos": True}))
        per_chunk = [c.choices[0].model_extra["token_ids"] for c in chunks if c.choices]
        assert [t for ids in per_chunk for t in ids] == refs[0]
        assert max(len(ids) for ids in per_chunk) > 1  # a step's confirmed drafts arrive together
        after = served.metrics()
        # sampled requests draft too: top_k=1 gives the greedy tokens, a seed gives the same tokens twice
        one_hot = served.client.completions.create(model=model, prompt=prompt, max_tokens=NEW, temperature=0.9,
                                                   seed=5, extra_body={"ignore_eos": True, "top_k": 1})
        assert one_hot.choices[0].model_extra["token_ids"] == refs[0]
        seeded = [served.client.completions.create(model=model, prompt=prompt, max_tokens=NEW, temperature=0.7,
                                                   seed=9, extra_body={"ignore_eos": True})
                  .choices[0].model_extra["token_ids"] for _ in range(2)]
        assert seeded[0] == seeded[1]
        last = served.metrics()
        assert not [e for e in served.result.audit.of("setting_ignored") if e["field"] == "max_draft_len"]
    for a, b in ((before, after), (after, last)):  # greedy requests, then sampled ones
        drafted = b["kvload_spec_decode_num_draft_tokens_total"] - a["kvload_spec_decode_num_draft_tokens_total"]
        accepted = (b["kvload_spec_decode_num_accepted_tokens_total"]
                    - a["kvload_spec_decode_num_accepted_tokens_total"])
        assert drafted > 0 and 0 < accepted <= drafted


def test_greedy_verification_keeps_drafts_up_to_the_first_disagreement_then_the_models_token():
    from engine.speculation import verify_greedy

    assert verify_greedy([5, 6, 7], [5, 9]) == [5, 6]  # draft 1 confirmed, draft 2 refused: the model's 6 instead
    assert verify_greedy([5, 6, 7], [5, 6]) == [5, 6, 7]  # both confirmed, then the token after them
    assert verify_greedy([4, 6, 7], [5, 6]) == [4]  # the first refused: one token, as without drafts
    assert verify_greedy([3], []) == [3]


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["v1", "v2", "v2-sliding"]), draft=st.integers(1, 6),
       blocks=st.integers(10, 40), budget=st.integers(2, 24), reuse=st.booleans(),
       prompts=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=14), min_size=1, max_size=4),
       max_new=st.integers(1, 14))
def test_any_budget_pool_and_draft_length_gives_the_tokens_of_one_token_per_step(kind, draft, blocks, budget, reuse,
                                                                                 prompts, max_new):
    # V2's KV contents and invariants are checked after every step (run_scripted); every block comes back
    manager_kind, sliding = kind.split("-")[0], kind.endswith("sliding")
    plain, *_ = run_scripted(manager_kind, prompts, max_new, 0, blocks=blocks, budget=budget, sliding=sliding,
                             reuse=reuse)
    spec, *_ = run_scripted(manager_kind, prompts, max_new, draft, blocks=blocks, budget=budget, sliding=sliding,
                            reuse=reuse)
    assert spec == plain
