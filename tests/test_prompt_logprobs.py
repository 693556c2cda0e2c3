"""``prompt_logprobs`` (vLLM's): every prompt token scored by the same paged prefill that generates, chunked or not,
on both managers; the prompt is prefilled whole (a cached prefix computes no logits) and its samples share it."""

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
        assert used_blocks(result) == 0


def test_a_scored_prompt_is_prefilled_whole_its_samples_share_it_and_the_cache_is_left_to_others(tiny_checkpoints):
    with load(tiny_checkpoints("llama"), "v2", max_num_tokens=16) as result:
        (p,) = prompts_for(result.hf_model.config.vocab_size, (13,))
        result.executor.run([p], max_tokens=2, ignore_eos=True)  # cached now
        (scored,) = result.executor.run([p], max_tokens=2, ignore_eos=True, prompt_logprobs=0, n=2,
                                        temperature=1.0, seed=3)
        assert all(e is not None for e in scored.prompt_logprobs[1:])
        assert scored.reused_prompt_tokens == 12  # not from the earlier call: the second sample reused the first's
        (again,) = result.executor.run([p], max_tokens=2, ignore_eos=True)
        assert again.reused_prompt_tokens == 12 and again.prompt_logprobs is None  # the shared cache still serves


def test_a_bad_prompt_logprobs_names_the_field(tiny_checkpoints):
    with load(tiny_checkpoints("llama"), "v1") as result, \
            pytest.raises(GenerationError, match=r"prompt_logprobs: expected an integer in \[0, 20\] \(top tokens to "
                                                 r"report per prompt token\), got 21"):
        result.executor.run([[3, 4, 5]], max_tokens=2, prompt_logprobs=21)
