"""``LoadResult.generate`` through the real executor equals transformers' greedy ``generate``, V1 and V2.

Tiny random checkpoints per family (float32, saved as safetensors so ``pipeline.load`` reads them like
any checkpoint directory); windows shrunk to 8 tokens so prompts run past them; 4-token blocks and
``max_num_tokens=16`` so long prompts are prefilled in chunks that share forwards with decodes.
"""

from __future__ import annotations

import pytest

import pipeline
from tests.generate_support import NEW_TOKENS, greedy_admission, hf_greedy, load, prompts_for, used_blocks
from tests.paged_support import CUDA, FAMILIES, PAGE_PADDING

STAGGER = [0, 1, 2, 5]


# --- greedy equality, family by family -----------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("manager", ["v1", "v2"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_transformers_generate_together_and_staggered(tiny_checkpoints, family, manager, device):
    with load(tiny_checkpoints(family), manager, device=device) as result:
        model = result.hf_model
        ps = prompts_for(model.config.vocab_size)
        ref = [hf_greedy(model, p) for p in ps]

        together = result.generate(ps, max_new_tokens=NEW_TOKENS)
        assert [o.token_ids for o in together] == ref
        assert result.executor.last_stats.steps < sum(len(r) for r in ref)  # requests shared forwards

        staggered = result.generate(ps, max_new_tokens=NEW_TOKENS, arrival_steps=STAGGER)
        assert [o.token_ids for o in staggered] == ref
        for out, p in zip(staggered, ps, strict=True):
            assert out.prompt_token_ids == p and out.text is None
            assert out.finish_reason == ("stop" if len(out.token_ids) < NEW_TOKENS else "length")
            assert 0 <= out.timings.first_token_s <= out.timings.total_s
        assert used_blocks(result) == 0  # finished requests gave their blocks back
        assert model.config._attn_implementation == "sdpa"  # model.generate still works after generate


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_a_prompt_holding_token_id_0_generates_transformers_tokens(tiny_checkpoints, manager):
    """Token id 0 is a token like any other inside a prompt (a follow-up turn holds earlier outputs, which may be 0):
    kvload attends to it, as transformers does given the prompt's whole attention mask (``hf_greedy``; without the
    mask transformers reads a 0 as padding when ``pad_token_id`` is 0, and the reference itself differed, diff65)."""
    with load(tiny_checkpoints("qwen3"), manager) as result:
        model = result.hf_model
        ps = [[*p[:5], 0, *p[5:]] for p in prompts_for(model.config.vocab_size, (12, 20))]
        outs = result.generate(ps, max_new_tokens=NEW_TOKENS)
        assert [o.token_ids for o in outs] == [hf_greedy(model, p) for p in ps]


def test_outputs_come_back_in_prompt_order_whatever_finishes_first(tiny_checkpoints):
    with load(tiny_checkpoints("llama"), "v2") as result:
        ps = prompts_for(result.hf_model.config.vocab_size, (30, 3))
        finished_order: list[int] = []
        outs = result.generate(ps, max_new_tokens=4, ignore_eos=True, arrival_steps=[2, 0],
                               stream=lambda e: e.output is not None and finished_order.append(e.index))
        assert finished_order == [1, 0]  # the short prompt, there first, finishes first
        assert [o.index for o in outs] == [0, 1] and [o.prompt_token_ids for o in outs] == ps


def test_stream_reports_every_token_as_it_is_produced(tiny_checkpoints):
    with load(tiny_checkpoints("qwen3"), "v1") as result:
        ps = prompts_for(result.hf_model.config.vocab_size, (6, 9))
        seen: dict[int, list[int]] = {0: [], 1: []}
        finals = {}

        def on_token(event):
            assert event.token_ids[:-1] == tuple(seen[event.index])  # one new token at a time, in order
            seen[event.index].append(event.token_id)
            if event.output is not None:
                finals[event.index] = event.output

        outs = result.generate(ps, max_new_tokens=5, ignore_eos=True, stream=on_token)
        assert [seen[0], seen[1]] == [o.token_ids for o in outs]
        assert finals == {0: outs[0], 1: outs[1]}


# --- prefix reuse ---------------------------------------------------------------------------------


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_a_cached_prefix_is_skipped_and_reported_and_a_salt_isolates_it(tiny_checkpoints, manager):
    with load(tiny_checkpoints("llama"), manager) as result:
        model = result.hf_model
        first, tail = prompts_for(model.config.vocab_size, (24, 5), seed=99)
        second = first[:21] + tail  # shares 21 tokens: five full 4-token blocks, and one token more
        ref = hf_greedy(model, second)

        a = result.generate([first], max_new_tokens=4)[0]
        assert a.reused_prompt_tokens == 0
        b = result.generate([second], max_new_tokens=NEW_TOKENS)[0]
        assert b.token_ids == ref
        assert b.reused_prompt_tokens >= 20  # V1 full blocks; V2 may copy part of the next one too
        admitted = result.audit.of("request_admitted")[-1]
        assert admitted["req_id"] == b.req_id and admitted["reused_prompt_tokens"] == b.reused_prompt_tokens

        c = result.generate([second], max_new_tokens=NEW_TOKENS, salt="tenant-b")[0]
        assert c.reused_prompt_tokens == 0 and c.token_ids == ref


def test_reuse_within_one_call_for_a_later_arrival(tiny_checkpoints):
    with load(tiny_checkpoints("qwen3"), "v2") as result:
        model = result.hf_model
        base, tail = prompts_for(model.config.vocab_size, (16, 4), seed=5)
        ps = [base, base + tail]
        outs = result.generate(ps, max_new_tokens=NEW_TOKENS, arrival_steps=[0, 6])
        assert [o.token_ids for o in outs] == [hf_greedy(model, p) for p in ps]
        assert outs[1].reused_prompt_tokens >= 16


@pytest.mark.parametrize("family", ["gemma3", "gemma3-padded", "mistral"])
def test_sliding_window_prefix_reuse_keeps_tokens_exact(tiny_checkpoints, family):
    """Sliding-window models on V2 with the default settings (gemma3-padded: padded pages opted into): the reused
    prefix is longer than the window."""
    with load(tiny_checkpoints(family), "v2", max_page_padding=PAGE_PADDING.get(family, 0.0)) as result:
        # gemma3: one arena for its 1-layer groups; gemma3-padded: for its 2-layer pages, one group's half unused
        assert result.kv_manager.layout.shared == family.startswith("gemma3")
        assert any(g.padding for g in result.kv_manager.layout.groups) == (family == "gemma3-padded")
        model = result.hf_model
        first, tail = prompts_for(model.config.vocab_size, (24, 6), seed=7)
        second = first[:20] + tail
        result.generate([first], max_new_tokens=4)
        out = result.generate([second], max_new_tokens=NEW_TOKENS)[0]
        assert out.reused_prompt_tokens > 8  # past the 8-token window
        assert out.token_ids == hf_greedy(model, second)


# --- pressure ---------------------------------------------------------------------------------------


def admitted_after_a_finish(result: pipeline.LoadResult) -> bool:
    """Whether some request was admitted only after another finished (it had to wait for blocks)."""
    names = [e["event"] for e in result.audit.events if e["event"] in ("request_admitted", "request_finished")]
    return "request_admitted" in names[names.index("request_finished"):]


def test_v1_under_pressure_makes_requests_wait_and_all_complete(tiny_checkpoints):
    with load(tiny_checkpoints("llama"), "v1", max_tokens=40) as result:  # 10 blocks; the four need 21 at worst
        model = result.hf_model
        ps = prompts_for(model.config.vocab_size)
        outs = result.generate(ps, max_new_tokens=NEW_TOKENS)
        assert [o.token_ids for o in outs] == [hf_greedy(model, p) for p in ps]
        assert admitted_after_a_finish(result)
        assert used_blocks(result) == 0


@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma3-padded"])
def test_v2_under_pressure_suspends_to_the_host_tier_and_resumes_exactly(tiny_checkpoints, family):
    with load(tiny_checkpoints(family), "v2", max_tokens=40, max_page_padding=PAGE_PADDING.get(family, 0.0)) as result:
        # suspend/resume through the shared arena (gemma3-padded: whole pages, a padded group's unused slot too)
        assert result.kv_manager.layout.shared == family.startswith("gemma3")
        model = result.hf_model
        ps = prompts_for(model.config.vocab_size)
        greedy_admission(result)  # the default headroom avoids this pressure; the mechanics are under test
        outs = result.generate(ps, max_new_tokens=NEW_TOKENS)
        assert [o.token_ids for o in outs] == [hf_greedy(model, p) for p in ps]
        stats = result.executor.last_stats
        assert stats.suspends >= 1 and stats.resumes >= 1
        assert len(result.audit.of("request_suspended")) == stats.suspends
        assert used_blocks(result) == 0


def test_v2_without_a_host_tier_recomputes_preempted_requests(tiny_checkpoints):
    with load(tiny_checkpoints("llama"), "v2", max_tokens=40, host_cache_size=0) as result:
        model = result.hf_model
        ps = prompts_for(model.config.vocab_size)
        greedy_admission(result)  # the default headroom avoids this pressure; the mechanics are under test
        outs = result.generate(ps, max_new_tokens=NEW_TOKENS)
        assert [o.token_ids for o in outs] == [hf_greedy(model, p) for p in ps]
        assert result.executor.last_stats.preemptions >= 1
        assert result.executor.last_stats.suspends == 0
        # the prompts share no block: a preempted request's re-admission finds only its own prefix, not a cache hit
        assert [o.reused_prompt_tokens for o in outs] == [0] * len(ps)
        # and the audit's request_finished says what the output says (re-admissions are request_admitted's to tell)
        assert [r["reused_prompt_tokens"] for r in result.audit.of("request_finished")] == [0] * len(ps)
        assert any(r["readmitted"] and r["reused_prompt_tokens"] for r in result.audit.of("request_admitted"))
