"""``LoadResult.generate``: sampling, finishing, bad input, failures that free everything, and the audit log."""

from __future__ import annotations

import collections

import pytest
import torch

import kvload
import pipeline
from engine.executor import GenerationExecutor
from engine.sampling import sample_token
from kvload.explain import verify_log
from pipeline.errors import GenerationError, KvBuildError
from tests.generate_support import NEW_TOKENS, greedy_admission, hf_greedy, load, prompts_for, used_blocks

# --- sampling -------------------------------------------------------------------------------------


def test_sample_token_draws_only_from_the_nucleus_in_proportion():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(0)
    draws = collections.Counter(sample_token(logits, 1.0, 0.8, gen) for _ in range(3000))
    assert set(draws) == {0, 1}  # 0.5 + 0.3 reach 0.8: the nucleus is the first two
    assert draws[0] / 3000 == pytest.approx(0.5 / 0.8, abs=0.04)
    draws = collections.Counter(sample_token(logits, 1.0, 1.0, gen) for _ in range(4000))
    assert draws[3] / 4000 == pytest.approx(0.05, abs=0.02)  # top_p=1 keeps the whole distribution
    assert {sample_token(logits, 1.0, 1e-6, gen) for _ in range(50)} == {0}  # a tiny nucleus is greedy


def test_sampling_is_reproducible_per_seed_and_on_either_manager(tiny_checkpoints):
    runs = {}
    for manager in ("v1", "v2"):
        with load(tiny_checkpoints("llama"), manager) as result:
            ps = prompts_for(result.hf_model.config.vocab_size)
            runs[manager] = [[o.token_ids for o in result.generate(ps, temperature=2.0, seed=s, ignore_eos=True)]
                             for s in (7, 7, 8)]
    assert runs["v1"][0] == runs["v1"][1] == runs["v2"][0]  # same seed, same tokens
    assert runs["v1"][2] != runs["v1"][0]  # another seed, another draw


def test_sampled_tokens_lie_in_the_top_p_nucleus_of_the_reference_logits(tiny_checkpoints):
    top_p = 0.6
    with load(tiny_checkpoints("qwen3"), "v2") as result:
        model = result.hf_model
        ps = prompts_for(model.config.vocab_size, (7, 12))
        outs = result.generate(ps, temperature=1.0, top_p=top_p, seed=3, max_new_tokens=10, ignore_eos=True)
        assert any(o.token_ids != hf_greedy(model, p, 10) for o, p in zip(outs, ps, strict=True))  # it did sample
        for out, prompt in zip(outs, ps, strict=True):
            seq = prompt + out.token_ids
            with torch.inference_mode():
                logits = model(torch.tensor([seq])).logits[0, len(prompt) - 1 : -1]
            probs = torch.softmax(logits.float(), dim=-1)
            for step, token in enumerate(out.token_ids):
                more_likely = probs[step][probs[step] > probs[step, token]].sum()
                assert more_likely < top_p + 1e-4  # the token is inside the nucleus


# --- finishing ------------------------------------------------------------------------------------


def test_eos_ends_a_request_unless_ignored(tiny_checkpoints):
    with load(tiny_checkpoints("llama"), "v1") as result:
        model = result.hf_model
        prompt = prompts_for(model.config.vocab_size, (9,))[0]
        ref = hf_greedy(model, prompt)
        stop = next(t for t in ref[2:] if t not in ref[:2])  # a token greedy decoding meets, not among the first two
        model.generation_config.eos_token_id = stop
        model.config.eos_token_id = stop
        out = result.generate([prompt], max_new_tokens=NEW_TOKENS)[0]
        assert out.finish_reason == "stop" and out.token_ids == ref[: ref.index(stop) + 1]
        out = result.generate([prompt], max_new_tokens=NEW_TOKENS, ignore_eos=True)[0]
        assert out.finish_reason == "length" and out.token_ids == ref


def test_max_seq_len_ends_a_request_with_length_and_longer_prompts_are_refused(tiny_checkpoints):
    with load(tiny_checkpoints("llama"), "v2", max_seq_len=12) as result:
        ps = prompts_for(result.hf_model.config.vocab_size, (8, 12))
        out = result.generate([ps[0]], max_new_tokens=10, ignore_eos=True)[0]
        assert len(out.token_ids) == 4 and out.finish_reason == "length"
        with pytest.raises(GenerationError, match=r"prompt 0: 12 tokens leave no room to generate under "
                                                  r"max_seq_len=12"):
            result.generate([ps[1]])


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_new_tokens": 0}, "max_new_tokens: expected an integer >= 1, got 0"),
    ({"temperature": -0.5}, "temperature: expected a finite number >= 0"),
    ({"top_p": 0}, r"top_p: expected a number in \(0, 1\], got 0"),
    ({"seed": -2}, r"seed: expected an integer in \[0, 2\*\*63 - 1\] or None, got -2"),
    ({"prompts": []}, "prompts: expected at least one prompt"),
    ({"prompts": [[1, 2], 3]}, r"^generate: prompts: a list of prompts mixes token ids with other prompts; give one "
                               r"prompt of token ids as \[1, 2, 3\] and several as \[\[1, 2, 3\], \[4, 5\]\]$"),
    ({"prompts": ["hello"]}, "prompt 0 is text, but .* has no tokenizer"),
    ({"prompts": [[5], [1, 10_000]]}, r"prompt 1: token id 10000 is outside the vocabulary \(0\.\.\d+\)"),
    # past str()'s 4,300 digits: was a bare ValueError raised while the refusal was worded
    ({"prompts": [[5], [1, 10**5000]]},
     r"^generate: prompt 1: token id an integer of about 5001 digits is outside the vocabulary \(0\.\.\d+\)$"),
    ({"prompts": [[5], []]}, "prompt 1: empty"),
    ({"prompts": [[5]], "chat": True}, "chat=True needs text prompts"),
    ({"prompts": [[5]], "arrival_steps": [0, 1]}, "arrival_steps: expected 1 integers >= 0"),
    # stream=True (read as "stream it") was "'bool' object is not callable" at the first token, mid-call
    ({"stream": True}, r"^generate: stream: expected a callable \(called with a StreamEvent per token\) or None, got "
                       r"bool; kvload.LLM.generate_stream yields the tokens$"),
])
def test_bad_arguments_are_one_clear_error_and_nothing_runs(tiny_checkpoints, kwargs, message):
    with load(tiny_checkpoints("llama"), "v1") as result:
        prompts = kwargs.pop("prompts", [[5, 6, 7]])
        with pytest.raises(GenerationError, match=message):
            result.generate(prompts, **kwargs)
        assert result.audit.of("generation_started") == []


def test_a_request_larger_than_the_pools_is_refused_before_anything_runs(tiny_checkpoints):
    with load(tiny_checkpoints("llama"), "v1", max_tokens=16) as result:  # 4 blocks of 4 tokens
        ps = prompts_for(result.hf_model.config.vocab_size, (3, 14))
        with pytest.raises(KvBuildError, match=r"prompt 1: 14 prompt tokens \+ max_new_tokens 8 need 6 blocks of "
                                               r"layer group 'uniform' \(4 tokens each\) but the KV pools hold 4; "
                                               r"raise kv_cache_config\.max_tokens \(--max_tokens\) or lower "
                                               r"max_new_tokens to at most 2$"):
            result.generate(ps, max_new_tokens=8)
        assert used_blocks(result) == 0
        # a prompt that leaves no room for one new token: max_new_tokens cannot help, so it is not the advice
        (long,) = prompts_for(result.hf_model.config.vocab_size, (16,))
        with pytest.raises(KvBuildError, match=r"prompt 0: 16 prompt tokens \+ max_new_tokens 1 need 5 blocks .* "
                                               r"or shorten the prompt \(the pools hold one sequence of 16 tokens\)$"):
            result.generate([long], max_new_tokens=1)
        assert result.generate([ps[0]], max_new_tokens=2)[0].token_ids  # the executor is still usable


def test_results_without_a_model_or_closed_cannot_generate(tiny_checkpoints):
    path = tiny_checkpoints("llama")
    with pytest.raises(GenerationError, match=r"no KV cache manager \(it came from pipeline.plan\); use "
                                              r"pipeline.load\(MODEL, load_weights=True"):
        pipeline.plan(str(path), log=False).generate([[1, 2]])
    no_weights = pipeline.load(str(path), kv_cache_config={"max_tokens": 64}, max_seq_len=64, log=False)
    with no_weights, pytest.raises(GenerationError, match="no model weights .*load_weights=True"):
        no_weights.generate([[1, 2]])
    result = load(path, "v2")
    result.generate([[1, 2]], max_new_tokens=1)
    result.close()
    with pytest.raises(GenerationError, match=r"this result was closed"):
        result.generate([[1, 2]])


def test_the_deepseek_v4_preset_generates_transformers_greedy_tokens_through_load_and_llm():
    """kvload's bundled DeepSeek V4 preset (128-token window and blocks, CSA and HCA layers) generates on V2 through
    ``pipeline.load`` and ``kvload.LLM``, token-equal to transformers' greedy decode of the same weights."""
    prompt = [(i * 37) % 500 + 2 for i in range(140)]  # past one 128-token HCA window
    with pipeline.load("tiny-deepseek-v4", load_weights=True, kv_cache_config={"max_tokens": 512}, log=False) as r:
        (out,) = r.generate([prompt], max_new_tokens=4)
        assert out.token_ids == hf_greedy(r.hf_model, prompt, 4)
    llm = kvload.LLM("tiny-deepseek-v4", log=False)
    try:
        (got,) = llm.generate([prompt[:20]], kvload.SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert list(got.outputs[0].token_ids) == hf_greedy(llm.result.hf_model, prompt[:20], 4)
    finally:
        llm.close()


# --- failures free what the call held ---------------------------------------------------------------


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_a_failing_call_frees_its_requests_and_the_executor_stays_usable(tiny_checkpoints, manager):
    with load(tiny_checkpoints("gemma3"), manager, max_tokens=40) as result:
        model = result.hf_model
        ps = prompts_for(model.config.vocab_size)
        if manager == "v2":  # greedy admission (no growth headroom), so the pressure suspends a request
            greedy_admission(result)

        seen = []

        def explode(event):
            seen.append(event)
            # V2: strike while a request's pages sit in the host tier; V1: while requests still wait
            suspended = result.kv_manager.stats().suspended if manager == "v2" else 0
            if suspended or (manager == "v1" and len(seen) == 3):
                raise KeyboardInterrupt  # what ^C during a long generate looks like

        with pytest.raises(KeyboardInterrupt):
            result.generate(ps, max_new_tokens=NEW_TOKENS, stream=explode)
        assert used_blocks(result) == 0
        assert len(result.executor._block_tables) == 0  # no request's block table rows outlive the call
        if manager == "v2":
            stats = result.kv_manager.stats()
            assert all(g.used == 0 for g in stats.host.values())  # no suspended pages left in the host tier
            assert (stats.active, stats.suspended) == (0, 0)
        failed = result.audit.of("generation_failed")[-1]
        assert failed["error"] == "KeyboardInterrupt" and failed["level"] == "error"
        outs = result.generate(ps, max_new_tokens=NEW_TOKENS)
        assert [o.token_ids for o in outs] == [hf_greedy(model, p) for p in ps]
        assert len(result.executor._block_tables) == 0  # nor a finished call's
        assert model.config._attn_implementation == "sdpa"


# --- the audit log ----------------------------------------------------------------------------------


def test_each_call_is_an_audit_segment_on_the_loads_sequence(tiny_checkpoints, tmp_path):
    audit_file = tmp_path / "load.jsonl"
    result = pipeline.load(str(tiny_checkpoints("llama")), load_weights=True, max_seq_len=64, audit_log=audit_file,
                           kv_cache_config={"max_tokens": 256, "tokens_per_block": 4}, log=False)
    with result:
        ps = prompts_for(result.hf_model.config.vocab_size, (6, 3))
        loaded = len(result.audit)
        result.generate(ps, max_new_tokens=3, seed=1)
        result.generate([ps[0]], max_new_tokens=2)
    events = result.audit.events
    assert [e["seq"] for e in events] == list(range(len(events)))
    segment = events[loaded:]
    assert {e["stage"] for e in segment} == {"generate"}
    assert [e["event"] for e in segment] == [  # a seed under greedy sampling does nothing, and says so
        "generation_started", "setting_ignored", "request_admitted", "request_admitted", "request_finished",
        "request_finished", "generation_finished",
        "generation_started", "request_admitted", "request_finished", "generation_finished"]
    first, second = segment[0], segment[7]
    assert (first["call"], first["requests"], first["prompt_tokens"], first["seed"]) == (0, 2, 9, 1)
    assert second["call"] == 1 and segment[-1]["generated_tokens"] == 2
    assert {e["req_id"] for e in segment if e["event"] == "request_finished"} == {"0.0", "0.1", "1.0"}
    assert verify_log(result.audit)["ok"]  # generation events change no argument: the replay still holds
    # the file was complete at load time; later events reach the in-memory log only, and no temp file leaks
    assert [p.name for p in tmp_path.iterdir()] == ["load.jsonl"]
    assert "generation_started" not in audit_file.read_text()


def test_an_executor_without_a_bus_still_generates(tiny_checkpoints):
    with load(tiny_checkpoints("qwen3"), "v1") as result:
        executor = GenerationExecutor(result.hf_model, result.kv_manager, result.scheduler)
        p = prompts_for(result.hf_model.config.vocab_size, (5,))[0]
        assert executor.generate([p], max_tokens=16)[0].token_ids == hf_greedy(result.hf_model, p, 16)
        assert result.audit.of("generation_started") == []


def test_a_steps_report_reads_the_requests_the_step_touched_not_every_request_of_the_call(monkeypatch):
    """After each step the executor reported new tokens by scanning every request of the call, and for each finished
    one every request again to find its prompt's samples: O(requests**2), so 16,000 one-token prompts in one
    ``generate`` took 16.6 s (5.4 s now), growing with the square. Each step's report now reads the requests the step
    ran (and the samples forked from them): about one per request and token in all. Counted, not timed."""
    seen = []
    report = GenerationExecutor._report_tokens

    def counted(self, finished, touched, *rest):
        seen.append(len(touched))
        return report(self, finished, touched, *rest)

    monkeypatch.setattr(GenerationExecutor, "_report_tokens", counted)
    with kvload.LLM("tiny-llama", log=False, max_batch_size=8, kv_cache_config={"max_tokens": 1024}) as llm:
        outs = llm.generate([[1, 2, i] for i in range(1, 161)], max_tokens=1)
        forked = llm.generate([[5, 6, 7]] * 4, max_tokens=3, n=3, temperature=1.0, seed=1)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1] * 160
    assert [len(o.outputs) for o in forked] == [3] * 4
    assert all(len(c.token_ids) == 3 for o in forked for c in o.outputs)
    assert len(seen) >= 160 // 8 and sum(seen) <= 2 * (160 + 4 * 3 * 3)  # a scan of all 160: 20 steps x 160
