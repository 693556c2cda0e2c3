"""Seeded random multi-turn workloads over the tiny families, V1 and V2: each greedy sample equals transformers'
``model.generate`` of its prompt alone, and each call leaves no block held.

The per-family tests check one feature at a time on fixed prompts; this one mixes them the way a chat server sees
them: follow-up turns that extend an earlier prompt and its output (prefix hits ending inside a block, so V2's partial
copies, or their absence with ``enable_partial_reuse`` off), shared system prefixes, several calls on one manager,
``n = 2`` forks, late arrivals, 4- and 8-token blocks, small chunks, n-gram drafts, the CPU kernel and budgets tight
enough to suspend to the host tier or preempt. A compact form of the differential fuzz of session 57 ("diff65"),
which ran such workloads over every combination of these settings and found kvload equal to transformers throughout.

The reference passes an all-ones attention mask: a follow-up turn may hold token 0, which ``model.generate`` would
otherwise take for padding (``pad_token_id=0``) and mask out."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from engine.sampling_params import SamplingParams
from tests.generate_support import greedy_admission, load, used_blocks

MAX_SEQ_LEN = 48

#: (family, manager, settings): each case forces a few hard paths at once
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # sliding + full layers in V2's shared arena, partial copies, drafts, suspended to the host tier
    "gemma3-v2-host-drafts": ("gemma3", "v2", {"tokens_per_block": 4, "max_tokens": 48, "max_num_tokens": 8,
                                               "host_cache_size": 1 << 20, "max_draft_len": 2, "greedy": True}),
    # a window on V1's uniform pool, 8-token blocks, 4-token chunks: long prompts wait and prefill in pieces
    "mistral-v1-chunks": ("mistral", "v1", {"tokens_per_block": 8, "max_tokens": 64, "max_num_tokens": 4}),
    # MLA latents, no partial copies, no host tier: preempted requests recompute, with 4-token drafts
    "deepseek-v3-v2-recompute": ("deepseek-v3", "v2", {"tokens_per_block": 8, "max_tokens": 64, "max_num_tokens": 16,
                                                       "host_cache_size": 0, "enable_partial_reuse": False,
                                                       "max_draft_len": 4, "greedy": True}),
    # the CPU paged decode kernel over V2's partial copies
    "qwen3-v2-kernel": ("qwen3", "v2", {"tokens_per_block": 4, "max_tokens": 256, "max_num_tokens": 16,
                                        "attention_backend": "cpu_kernel"}),
}


def workload(rng: random.Random, vocab: int, history: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Prompts and their ``max_tokens``: follow-ups of ``history`` (a prompt and its output), cuts of a system
    prompt with a tail, and fresh prompts; each fits ``MAX_SEQ_LEN`` with its output."""
    system = [(i * 37) % (vocab - 3) + 3 for i in range(rng.choice((7, 9, 12)))]
    prompts, news = [], []
    for _ in range(rng.randint(3, 6)):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randint(0, 6))]
        kind = rng.random()
        if history and kind < 0.5:
            prompt = rng.choice(history) + tail
        elif kind < 0.8:
            prompt = system[:rng.randint(1, len(system))] + tail + [rng.randrange(3, vocab)]
        else:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 20))]
        new = rng.randint(1, 10)
        prompts.append(prompt[:MAX_SEQ_LEN - new])
        news.append(new)
    return prompts, news


def reference(model: Any, prompt: list[int], new: int) -> list[int]:
    """transformers' greedy tokens for ``prompt`` alone, token 0 not taken for padding."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


#: two seeds a case; where the admission is greedy, seeds whose workloads push a request out (most do not)
SEEDS = {"gemma3-v2-host-drafts": (1, 3), "deepseek-v3-v2-recompute": (0, 1)}


@pytest.mark.parametrize(("case", "seed"), [(case, seed) for case in CASES for seed in SEEDS.get(case, (0, 1))])
def test_random_multi_turn_workloads_equal_transformers_and_leave_nothing(tiny_checkpoints, case, seed):
    family, manager, settings = CASES[case]
    settings = dict(settings)
    greedy, backend = settings.pop("greedy", False), settings.pop("attention_backend", "auto")
    llm = {"max_draft_len": settings.pop("max_draft_len")} if "max_draft_len" in settings else None
    rng = random.Random(f"{case}/{seed}")
    with load(tiny_checkpoints(family), manager, max_seq_len=MAX_SEQ_LEN, attention_backend=backend, llm=llm,
              **settings) as result:
        if greedy:
            greedy_admission(result)  # no growth headroom: a tight budget then really suspends or preempts
        model, history, totals = result.hf_model, [], {"reused": 0, "pressure": 0}
        for _ in range(3):  # one manager, its prefix cache kept between the calls
            prompts, news = workload(rng, model.config.vocab_size, history)
            n = rng.choice((1, 2))
            outs = result.executor.run(prompts, [SamplingParams(max_tokens=m, temperature=0.0, n=n) for m in news],
                                       arrival_steps=[rng.randint(0, 3) for _ in prompts])
            for prompt, new, out in zip(prompts, news, outs, strict=True):
                want = reference(model, prompt, new)
                assert [list(c.token_ids) for c in out.outputs] == [want] * n, (prompt, new)
                history.append(prompt + want)
            stats = result.executor.last_stats
            totals["reused"] += stats.reused_prompt_tokens
            totals["pressure"] += stats.suspends + stats.preemptions
            assert used_blocks(result) == 0  # finished requests gave their blocks back
            if manager == "v2":
                result.kv_manager.check_invariants()
        assert totals["reused"] > 0  # the follow-ups and forks hit the prefix cache
        if greedy:
            assert totals["pressure"] > 0, totals  # the budget pushed a request out at least once
