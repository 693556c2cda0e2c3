"""``prompt_logprobs`` (vLLM's): every prompt token scored by the same paged prefill that generates, chunked or not,
on both managers; the prompt is prefilled whole (a cached prefix computes no logits: the request reads none), its
blocks are cached for later requests as any request's, and its samples share it."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import GenerationError
from tests.generate_support import load, prompts_for, used_blocks


def reference(model, prompt: list[int]) -> torch.Tensor:
    """Log-probabilities after each prompt token, by one full transformers forward."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("manager", ["v1", "v2"])
@pytest.mark.parametrize("family", ["llama", "gemma3", "deepseek-v3"])
def test_prompt_logprobs_are_the_models_own_across_prefill_chunks(tiny_checkpoints, family, manager):
    with load(tiny_checkpoints(family), manager, max_num_tokens=8) as result:  # 8-token chunks: prompts span several
        model = result.hf_model
        ps = prompts_for(model.config.vocab_size, (21, 5, 2))
        outs = result.executor.run(ps, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
        for p, out in zip(ps, outs, strict=True):
            ref = reference(model, p)
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
            for j in range(1, len(p)):
                entry = out.prompt_logprobs[j]
                assert entry[p[j]] == pytest.approx(float(ref[j - 1, p[j]]), abs=1e-4)
                best = ref[j - 1].topk(2).indices.tolist()
                assert set(best) <= set(entry) and len(entry) <= 3  # the top 2 and the token itself
                # vLLM's rank: tokens at least as likely as this one, itself included, in the whole vocabulary (the
                # reference's order, up to tokens within the two forwards' rounding of it)
                lp = ref[j - 1, p[j]]
                assert int((ref[j - 1] > lp + 1e-4).sum()) + 1 <= entry.rank <= int((ref[j - 1] >= lp - 1e-4).sum())
        assert used_blocks(result) == 0


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_a_scored_prompt_reads_no_cached_prefix_and_leaves_its_blocks_to_later_requests(tiny_checkpoints, manager):
    """A cached prefix computes no logits, so a scored prompt is prefilled whole even when its blocks are cached (by
    an earlier scored request here); its own blocks are cached under the caller's salt, so a plain request with the
    prompt hits them, and a scored duplicate of a cached prompt leaves the manager consistent."""
    with load(tiny_checkpoints("llama"), manager, max_num_tokens=8) as result:
        ex = result.executor
        (p,) = prompts_for(result.hf_model.config.vocab_size, (13,))
        ref = reference(result.hf_model, p)
        want = [float(ref[j - 1, p[j]]) for j in range(1, len(p))]
        for _ in range(2):  # the second run finds the first's blocks cached and must not read them
            (scored,) = ex.run([p], max_tokens=2, ignore_eos=True, prompt_logprobs=0, salt="tenant")
            assert scored.reused_prompt_tokens == 0 and scored.computed_prompt_tokens == 13
            assert [scored.prompt_logprobs[j][p[j]] for j in range(1, len(p))] == pytest.approx(want, abs=1e-4)
        check_manager(result)
        (plain,) = ex.run([p], max_tokens=2, ignore_eos=True, salt="tenant")
        assert plain.reused_prompt_tokens == 12  # three full blocks, cached by the scored requests
        (other,) = ex.run([p], max_tokens=2, ignore_eos=True, salt="other")
        assert other.reused_prompt_tokens == 0  # under the caller's salt, not everyone's
        check_manager(result)
        assert used_blocks(result) == 0


def check_manager(result) -> None:
    """The manager's own invariant checks (V2's whole bookkeeping, V1's block pool)."""
    m = result.kv_manager
    m.check_invariants() if hasattr(m, "check_invariants") else m.pool.check_invariants()


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_a_scored_prompts_samples_share_its_prefill(tiny_checkpoints, manager):
    with load(tiny_checkpoints("llama"), manager, max_num_tokens=16) as result:
        (p,) = prompts_for(result.hf_model.config.vocab_size, (13,))
        (scored,) = result.executor.run([p], max_tokens=2, ignore_eos=True, prompt_logprobs=0, n=2,
                                        temperature=1.0, seed=3)
        assert all(e is not None for e in scored.prompt_logprobs[1:])
        # the first sample scores (reads nothing, computes 13); the second forks its KV, computing none of it
        assert (scored.computed_prompt_tokens, scored.reused_prompt_tokens) == (13, 13)
        (again,) = result.executor.run([p], max_tokens=2, ignore_eos=True)
        assert again.reused_prompt_tokens == 12 and again.prompt_logprobs is None


def test_a_bad_prompt_logprobs_names_the_field(tiny_checkpoints):
    with load(tiny_checkpoints("llama"), "v1") as result, \
            pytest.raises(GenerationError, match=r"prompt_logprobs: expected an integer in \[0, 20\] \(top tokens to "
                                                 r"report per prompt token\), got 21"):
        result.executor.run([[3, 4, 5]], max_tokens=2, prompt_logprobs=21)
