"""The in-flight prefix wait (V2 ``fcfs``, module docstring of ``cache_backends.v2.scheduler``, "Wait for the prefix in
flight") on the real generation path: a prompt whose prefix the chunked prefill of the one before it computes in this
step waits for it, reuses it, and generates what V1 does."""

from __future__ import annotations

import pytest

import kvload
from engine.sampling_params import SamplingParams
from tests.llm_support import llm_kwargs, with_tokenizer

SYSTEM = list(range(3, 29))  # 26 tokens: 6 whole 4-token blocks and 2 of a seventh
PROMPTS = [[*SYSTEM, 40, 41], [*SYSTEM, 50, 51, 52]]


@pytest.fixture(scope="module", params=["llama", "gemma3", "deepseek-v4"])
def words(request, tiny_checkpoints, tmp_path_factory):
    family = request.param
    return with_tokenizer(tiny_checkpoints(family), tmp_path_factory.mktemp(f"flight-{family}") / "ckpt", 512)


def generate(words, manager: str, **kv) -> tuple[list[list[int]], list[int], bool]:
    """Both prompts in one call, the budget 16 tokens a step (the first prompt's 28 are prefilled in two chunks, 16 and
    12, the second step leaving 4 for an admission): the greedy tokens, the prompt tokens each reused, and whether a
    partial block is copied (DeepSeek V4's compressed groups: whole 8-token units only)."""
    with kvload.LLM(str(words), **llm_kwargs(manager, **kv)) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
        partial = manager == "v2" and llm.result.kv_manager.partial_off_reason is None
        if manager == "v2":
            llm.result.kv_manager.check_invariants()
    return [list(o.outputs[0].token_ids) for o in outs], [o.reused_prompt_tokens for o in outs], partial


def test_a_prompt_on_a_prefix_in_flight_reuses_it_and_generates_what_v1_does(words, monkeypatch):
    import cache_backends.v2.scheduler as scheduler

    # V1 with reuse off computes every token; DeepSeek V4's compressed layers run on V2 only (its reuse off there)
    v1 = "deepseek-v4" not in words.parent.name
    want, _, _ = generate(words, "v1" if v1 else "v2", enable_block_reuse=False)
    got, reused, partial = generate(words, "v2")
    assert got == want
    # the second waits while the first's second chunk computes the rest of the system prompt, then claims all of it
    # (its partial last block copied) or, on whole 8-token units only, the 24 tokens of three
    assert reused == [0, 26 if partial else 24]
    monkeypatch.setattr(scheduler, "DEFER_IN_FLIGHT", False)
    got_off, reused_off, _ = generate(words, "v2")
    assert got_off == want
    # without the wait it is admitted beside that chunk and computes its own copy: it claims only the first chunk's
    assert reused_off == [0, 16]
