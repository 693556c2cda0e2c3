"""Beam search (``LLM.beam_search``, ``Executor.beam_search``): transformers' beams, bounded by max_beam_width."""

from __future__ import annotations

import pytest
import torch

import kvload
import pipeline
from bench.bench_beam_search import hf_beams  # transformers' beams without an EOS: the reference
from engine.beam_search import BeamSearchParams
from pipeline.errors import GenerationError
from tests.generate_support import prompts_for
from tests.llm_support import llm_kwargs, with_tokenizer

WIDTH, NEW = 3, 7


def load_beams(path, width: int = WIDTH, **kw):
    return pipeline.load(str(path), load_weights=True, max_beam_width=width, max_seq_len=96, log=False,
                         kv_cache_config={"max_tokens": 2048, "tokens_per_block": 4, **kw})


def watch_steps(result, monkeypatch) -> list[tuple[int, int]]:
    """Per engine step of the result's scheduler: (tokens it scheduled, requests the KV manager holds after it)."""
    seen: list[tuple[int, int]] = []
    scheduler, manager = result.executor.scheduler, result.executor.manager
    step = scheduler.step

    def watched(waiting, running):
        out = step(waiting, running)
        seen.append((out.num_tokens, manager.stats().requests))
        return out

    monkeypatch.setattr(scheduler, "step", watched)
    return seen


def used_blocks(result) -> int:
    return sum(g.used for g in result.executor.manager.stats().groups.values())


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_beams_equal_transformers_num_beams(tiny_checkpoints, family):
    with load_beams(tiny_checkpoints(family)) as result:
        assert result.route.kv_manager == "KVCacheManager"  # beam search routes to V1 (TensorRT-LLM's rule)
        ps = prompts_for(result.hf_model.config.vocab_size, lengths=(5, 14))
        outs = result.executor.beam_search(ps, BeamSearchParams(beam_width=WIDTH, max_tokens=NEW, ignore_eos=True))
        for p, out in zip(ps, outs, strict=True):
            assert [s.token_ids for s in out.sequences] == hf_beams(result.hf_model, p, WIDTH, NEW)
            assert out.prompt_token_ids == tuple(p)
            scores = [s.score for s in out.sequences]
            assert scores == sorted(scores, reverse=True)
            for s in out.sequences:  # equal lengths: the score is the mean log-probability
                assert s.finish_reason == "length" and s.score == pytest.approx(s.cumulative_logprob / NEW)


def test_a_beam_that_emits_eos_ends_there_as_a_hypothesis_of_its_own(tiny_checkpoints):
    with load_beams(tiny_checkpoints("llama")) as result:
        p = prompts_for(result.hf_model.config.vocab_size, lengths=(9,))[0]
        free = result.executor.beam_search([p], BeamSearchParams(beam_width=WIDTH, max_tokens=NEW, ignore_eos=True))
        best = free[0].sequences[0].token_ids
        result.executor.eos_token_ids = {best[2]}  # the best beam's third token now ends a sequence
        ended = result.executor.beam_search([p], BeamSearchParams(beam_width=WIDTH, max_tokens=NEW))
        seqs = ended[0].sequences
        stopped = [s for s in seqs if s.finish_reason == "stop"]
        assert stopped and all(s.token_ids[-1] == best[2] and best[2] not in s.token_ids[:-1] for s in stopped)
        assert best[:3] in [s.token_ids for s in stopped]  # its prefix ended at the EOS
        assert all(best[2] not in s.token_ids for s in seqs if s.finish_reason == "length")
        scores = [s.score for s in seqs]
        assert scores == sorted(scores, reverse=True) and len(seqs) == WIDTH
        assert result.executor.manager.stats().requests == 0 and used_blocks(result) == 0


def test_each_step_computes_one_token_per_live_beam_and_a_finished_search_frees_its_beams(tiny_checkpoints,
                                                                                        monkeypatch):
    """The beams stay running requests: after the prompts, a step computes exactly one token per live beam (a new
    beam forks another at its length: its partial block is copied, not recomputed); a prompt whose search ends
    (here at max_seq_len, 4 tokens in) frees its beams at once while the other goes on, and nothing is left held."""
    with load_beams(tiny_checkpoints("llama")) as result:
        short, long = prompts_for(result.hf_model.config.vocab_size, lengths=(5, 92))  # room: 7 and 96 - 92 = 4
        seen = watch_steps(result, monkeypatch)
        calls = len(result.audit.of("generation_started"))
        outs = result.executor.beam_search([short, long], BeamSearchParams(beam_width=WIDTH, max_tokens=NEW,
                                                                           ignore_eos=True))
        for p, out, room in ((short, outs[0], NEW), (long, outs[1], 4)):
            assert [s.token_ids for s in out.sequences] == hf_beams(result.hf_model, p, WIDTH, room)
        assert [tokens for tokens, _ in seen] == [5 + 92] + [2 * WIDTH] * 3 + [WIDTH] * 3
        assert [held for _, held in seen] == [2] + [2 * WIDTH] * 3 + [WIDTH] * 3  # the losing beams freed each step
        assert result.executor.last_stats.steps == NEW  # one engine step per token, the call's own stats
        assert len(result.audit.of("generation_started")) == calls + 1  # one audit segment per call
        stats = result.executor.manager.stats()
        assert stats.requests == 0 and used_blocks(result) == 0


def test_beams_wider_than_the_pools_still_end_and_equal_transformers(tiny_checkpoints, monkeypatch):
    """Pools for one sequence, three beams: the forks that find no room wait, and beams that wait for the others let
    go of their KV (audited as preempted) so those can run; the search still ends, with transformers' beams, and
    holds nothing after."""
    with load_beams(tiny_checkpoints("llama"), max_tokens=24) as result:  # 6 blocks of 4: 14 + 7 tokens, once
        (p,) = prompts_for(result.hf_model.config.vocab_size, lengths=(14,))
        (out,) = result.executor.beam_search([p], BeamSearchParams(beam_width=WIDTH, max_tokens=NEW, ignore_eos=True))
        assert [s.token_ids for s in out.sequences] == hf_beams(result.hf_model, p, WIDTH, NEW)
        assert result.audit.of("request_preempted")
        assert result.executor.manager.stats().requests == 0 and used_blocks(result) == 0
        # stopped mid-search (LLM.close does this), with beams waiting and let go: it fails and holds nothing either
        steps = watch_steps(result, monkeypatch)
        stop = result.executor.scheduler.step

        def stopping(waiting, running):
            if len(steps) == 6:
                result.executor.stop("stopped mid-search")
            return stop(waiting, running)

        monkeypatch.setattr(result.executor.scheduler, "step", stopping)
        with pytest.raises(GenerationError, match="^stopped mid-search$"):
            result.executor.beam_search([p], BeamSearchParams(beam_width=WIDTH, max_tokens=NEW, ignore_eos=True))
        assert result.audit.of("generation_failed")[-1]["message"] == "stopped mid-search"
        assert result.executor.manager.stats().requests == 0 and used_blocks(result) == 0


def test_beam_search_on_v2_is_transformers_greedy_at_one_token_a_step(tiny_checkpoints, monkeypatch):
    """V2 holds one beam (max_beam_width routes wider searches to V1): it runs as one request, a token a step."""
    with load_beams(tiny_checkpoints("llama"), width=1, use_kv_cache_manager_v2=True) as result:
        assert result.route.kv_manager == "KVCacheManagerV2"
        (p,) = prompts_for(result.hf_model.config.vocab_size, lengths=(9,))
        seen = watch_steps(result, monkeypatch)
        (out,) = result.executor.beam_search([p], BeamSearchParams(beam_width=1, max_tokens=NEW, ignore_eos=True))
        assert [s.token_ids for s in out.sequences] == hf_beams(result.hf_model, p, 1, NEW)
        assert [tokens for tokens, _ in seen] == [9] + [1] * (NEW - 1)
        assert used_blocks(result) == 0


def test_the_width_is_bounded_by_max_beam_width_and_generate_still_serves_one_sequence(tiny_checkpoints):
    with load_beams(tiny_checkpoints("llama"), width=2) as result:
        [one] = result.generate([[5, 6, 7]], max_new_tokens=3)
        assert len(one.token_ids) == 3
        with pytest.raises(GenerationError, match=r"^beam_search: beam_width=3 exceeds max_beam_width=2, .*load it "
                                                  r"with max_beam_width >= 3$"):
            result.executor.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=3, max_tokens=2))
        (ignored,) = [e for e in result.audit.of("setting_ignored") if e["field"] == "max_beam_width"]
        assert "bounds LLM.beam_search's beam_width" in ignored["reason"]


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"beam_width": 0}, r"beam_width: expected an integer in \[1, 128\], got 0"),
    ({"beam_width": 2, "max_tokens": 0}, r"max_tokens: expected an integer >= 1, got 0"),
    ({"beam_width": 2, "temperature": 0.7}, r"temperature: expected 0 \(beam search keeps the most likely"),
    ({"beam_width": 2, "length_penalty": float("nan")}, r"length_penalty: expected a finite number, got nan"),
    ({"beam_width": True}, r"beam_width: expected an integer"),
    # past int64, as SamplingParams' max_tokens; a keyword that is no field is one line, not Python's TypeError
    ({"beam_width": 2, "max_tokens": 2**64}, r"^generate: max_tokens: expected at most 2\*\*63 - 1, got "
                                             r"18446744073709551616$"),
    ({"beam_width": 2, "beam_witdh": 4}, r"^generate: unknown BeamSearchParams field 'beam_witdh'; fields are "
                                         r"beam_width, ignore_eos, length_penalty, logprobs, max_tokens, temperature; "
                                         r"did you mean 'beam_width'\?$"),
    ({"beam_width": 2, "include_stop_str_in_output": True},
     r"^generate: include_stop_str_in_output: vLLM's BeamSearchParams field, not kvload's: kvload's beam search "
     r"takes no stop strings"),
])
def test_bad_params_name_the_field(kwargs, says):
    with pytest.raises(GenerationError, match=says):
        BeamSearchParams(**kwargs)


def test_llm_beam_search_returns_texts_like_vllm(tiny_checkpoints, tmp_path):
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "ckpt", 512)
    with kvload.LLM(str(words), max_beam_width=2, **llm_kwargs("v1")) as llm:
        (out,) = llm.beam_search(["w5 w17 w300 w42"], kvload.BeamSearchParams(beam_width=2, max_tokens=4,
                                                                             ignore_eos=True))
        assert isinstance(out, kvload.BeamSearchOutput) and out.prompt == "w5 w17 w300 w42"
        assert len(out.sequences) == 2 and out.sequences[0].token_ids != out.sequences[1].token_ids
        for s in out.sequences:
            # vLLM's text: tokenizer.decode(beam.tokens), the prompt's then the generated words (it left the prompt out)
            assert s.text == "w5 w17 w300 w42 " + " ".join(f"w{t}" for t in s.token_ids)
            # vLLM's BeamSearchSequence names: the whole sequence, the summed log-probability, no stop string or id
            assert s.tokens == [*out.prompt_token_ids, *s.token_ids] and out.prompt_token_ids[-4:] == (5, 17, 300, 42)
            assert (s.cum_logprob, s.stop_reason) == (s.cumulative_logprob, None)
        # special tokens shown, as vLLM's decode shows them (w0 is this tokenizer's unk_token)
        (out,) = llm.beam_search([[0, 5]], kvload.BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=True))
        assert [s.text for s in out.sequences] == [" ".join(f"w{t}" for t in s.tokens) for s in out.sequences]
        assert out.sequences[0].text.startswith("w0 w5 w")


def test_llm_beam_search_takes_vllms_other_arguments(tiny_checkpoints, tmp_path, monkeypatch):
    """vLLM's beam_search(prompts, params, lora_request, use_tqdm, concurrency_limit): a script passing them ran
    into a TypeError; concurrency_limit searches that many prompts at once, the same hypotheses."""
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "ckpt", 512)
    params = kvload.BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    prompts = ["w5 w17 w300 w42", [7, 8, 9]]
    with kvload.LLM(str(words), max_beam_width=2, **llm_kwargs("v1")) as llm:
        seen = watch_steps(llm.result, monkeypatch)
        together = llm.beam_search(prompts, params)
        both = max(held for _, held in seen)
        seen.clear()
        apart = llm.beam_search(prompts, params, None, False, 1)
        assert [[s.tokens for s in o.sequences] for o in apart] == [[s.tokens for s in o.sequences] for o in together]
        assert max(held for _, held in seen) <= 2 < both  # one prompt's beams at a time, not both prompts'
        with pytest.raises(GenerationError, match="beam_search: concurrency_limit: expected an integer >= 1"):
            llm.beam_search(prompts, params, concurrency_limit=0)
        with pytest.raises(GenerationError, match="beam_search: lora_request: kvload serves the checkpoint's own"):
            llm.beam_search(prompts, params, lora_request=object())


def test_concurrency_limit_names_a_bad_prompt_by_its_place_and_searches_nothing_first(tiny_checkpoints, tmp_path):
    """With concurrency_limit, each group was searched as a call of its own: a prompt too long in the third group was
    refused as "prompt 0" (its place in the group), after the groups before it had been searched."""
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "ckpt", 512)
    params = kvload.BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    with kvload.LLM(str(words), max_beam_width=2, **{**llm_kwargs("v1"), "max_seq_len": 16}) as llm:
        segments = len(llm.audit.of("generation_started"))
        with pytest.raises(GenerationError, match=r"^beam_search: prompt 2: 20 tokens leave no room to generate"):
            llm.beam_search([[5, 6], [7, 8], list(range(1, 21))], params, concurrency_limit=1)
        assert len(llm.audit.of("generation_started")) == segments  # refused before any group ran
        assert llm.result.kv_manager.stats().usage == 0
        # the groups still give what one call gives, in the prompts' order
        prompts = ["w5 w17 w300", [7, 8, 9], [4, 4]]
        apart = llm.beam_search(prompts, params, concurrency_limit=2)
        together = llm.beam_search(prompts, params)
        assert [[s.tokens for s in o.sequences] for o in apart] == [[s.tokens for s in o.sequences] for o in together]


def test_a_width_past_ten_still_gets_its_2k_alternatives_a_step(tiny_checkpoints):
    """A step asks for 2 x beam_width alternatives: past the MAX_LOGPROBS (20) a caller may ask for, and allowed."""
    with load_beams(tiny_checkpoints("llama"), width=11) as result:
        p = prompts_for(result.hf_model.config.vocab_size, lengths=(6,))[0]
        (out,) = result.executor.beam_search([p], BeamSearchParams(beam_width=11, max_tokens=2, ignore_eos=True))
        assert [s.token_ids for s in out.sequences] == hf_beams(result.hf_model, p, 11, 2)


def test_each_sequence_carries_its_tokens_logprobs_summing_to_its_cumulative_logprob(tiny_checkpoints):
    """Per generated token, the entry of the step that chose it (vLLM's ``BeamSearchSequence.logprobs``): the chosen
    token's log-probability is the model's log-softmax there (transformers' forward over the sequence), the entry
    holds the ``logprobs`` most likely besides it, and the chosen ones sum to ``cumulative_logprob``."""
    with load_beams(tiny_checkpoints("llama")) as result:
        p = prompts_for(result.hf_model.config.vocab_size, lengths=(9,))[0]
        eos = result.executor.eos_token_ids = {
            result.executor.beam_search([p], BeamSearchParams(beam_width=WIDTH, max_tokens=NEW, ignore_eos=True))[0]
            .sequences[0].token_ids[2]}  # the best beam's third token ends a sequence: an EOS entry too
        for alts in (None, 0, 2 * WIDTH + 3):  # the 2k ranked (vLLM's), none besides the chosen, more than ranked
            (out,) = result.executor.beam_search([p], BeamSearchParams(beam_width=WIDTH, max_tokens=NEW,
                                                                       logprobs=alts))
            assert "stop" in {s.finish_reason for s in out.sequences}
            for s in out.sequences:
                assert len(s.logprobs) == len(s.token_ids)
                assert sum(e[t] for t, e in zip(s.token_ids, s.logprobs, strict=True)) == \
                    pytest.approx(s.cumulative_logprob, abs=1e-9)
                with torch.no_grad():
                    logits = result.hf_model(torch.tensor([[*p, *s.token_ids]])).logits[0].float()
                want = torch.log_softmax(logits[len(p) - 1:-1], dim=-1)
                for row, t, entry in zip(want, s.token_ids, s.logprobs, strict=True):
                    top = row.topk(2 * WIDTH if alts is None else alts)
                    assert entry[t] == pytest.approx(float(row[t]), abs=1e-4)
                    assert entry.rank == int((row >= row[t]).sum())
                    assert set(entry) == {t, *top.indices.tolist()}
                    for a, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                        assert entry[a] == pytest.approx(v, abs=1e-4)
            assert eos & {s.token_ids[-1] for s in out.sequences}


def test_logprobs_past_max_logprobs_is_refused_by_name():
    with pytest.raises(GenerationError, match=r"logprobs: expected an integer in \[0, 20\]"):
        BeamSearchParams(beam_width=2, logprobs=21)
