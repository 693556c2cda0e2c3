"""vLLM's ``LLM.reward`` (its ``token_classify`` pooling) of a classifier checkpoint: the classifier head applied to
every prompt token's final norm output, each row activated as ``classify`` activates its one, checked against
transformers' ``AutoModelForSequenceClassification`` (its decoder's hidden states through its ``score`` head) reading
the same tiny checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import kvload
from pipeline.errors import GenerationError
from tests.classify_support import classifier_checkpoint
from tests.llm_support import llm_kwargs, with_tokenizer

LONG = [(7 * i + 5) % 500 + 1 for i in range(40)]  # computed in three chunks of max_num_tokens 16
SHORT = [88, 123, 7]


@pytest.fixture(scope="module")
def three_labels(tmp_path_factory):
    """A tiny Llama classifier over three labels."""
    return classifier_checkpoint(tmp_path_factory.mktemp("rw") / "llama", "llama", "LlamaForSequenceClassification", 3)


def token_logits(path):
    """transformers' per-token logits of the classifier: its decoder's last hidden states through its score head."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager").eval()

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model.score(model.model(input_ids=torch.tensor([ids])).last_hidden_state)[0].float()

    return logits


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_reward_gives_every_prompt_tokens_class_probabilities_as_transformers_computes_them(three_labels, manager):
    """One PoolingRequestOutput per prompt, in order, its data one row per prompt token (a prompt computed over
    several steps too); the last row is classify's; a prompt whose blocks the cache holds is computed whole (its
    cached prefix has no rows) and gives the same; use_activation=False gives the logits; truncate_prompt_tokens
    keeps the last N tokens."""
    logits = token_logits(three_labels)
    with kvload.LLM(str(three_labels), dtype="float32", **llm_kwargs(manager)) as llm:
        outs = llm.reward([LONG, " ".join(f"w{i}" for i in SHORT)])
        assert [type(o).__name__ for o in outs] == ["PoolingRequestOutput"] * 2
        assert [o.prompt_token_ids for o in outs] == [LONG, SHORT]
        for out, ids in zip(outs, [LONG, SHORT], strict=True):
            assert tuple(out.outputs.data.shape) == (len(ids), 3) and out.outputs.data.dtype == torch.float32
            np.testing.assert_allclose(out.outputs.data.numpy(), torch.softmax(logits(ids), -1).numpy(), atol=1e-5)
        last = llm.classify(LONG)[0].outputs.probs
        np.testing.assert_allclose(outs[0].outputs.data[-1].numpy(), last, atol=1e-6)
        again = llm.reward(LONG)[0]  # the classify above left the prompt's blocks in the cache
        assert again.num_cached_tokens == 0
        np.testing.assert_allclose(again.outputs.data.numpy(), outs[0].outputs.data.numpy(), atol=1e-6)
        raw = llm.reward([SHORT], pooling_params=kvload.PoolingParams(use_activation=False))[0]
        np.testing.assert_allclose(raw.outputs.data.numpy(), logits(SHORT).numpy(), atol=1e-5)
        cut = llm.reward(LONG, truncate_prompt_tokens=5)[0]
        assert cut.prompt_token_ids == LONG[-5:]
        np.testing.assert_allclose(cut.outputs.data.numpy(), torch.softmax(logits(LONG[-5:]), -1).numpy(),
                                   atol=1e-5)
        assert llm.generate is not None and llm.classify(SHORT)[0].outputs.num_classes == 3  # nothing left behind


def test_reward_on_a_generative_model_and_an_embeddings_switch_are_refused(three_labels, tiny_checkpoints, tmp_path):
    """One line: a generative model has no head to score tokens with."""
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "gen", 512)
    with kvload.LLM(str(words), dtype="float32", **llm_kwargs()) as llm, \
            pytest.raises(GenerationError, match=r"^reward: .* is a generative model \(LlamaForCausalLM\), with no "
                                                 r"classifier head"):
        llm.reward("w5")
