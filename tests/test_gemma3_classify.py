"""Gemma 3's classifiers (transformers' ``Gemma3TextForSequenceClassification``: the text decoder with its interleaved
sliding-window layers and a ``score`` head; the multimodal ``Gemma3ForSequenceClassification``, text prompts; a
``Gemma3ForCausalLM`` carrying ``score.weight`` under ``convert="classify"``) classify as transformers computes it,
over prompts longer than the window; a classifier kvload does not serve is refused in one line naming those it does."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import kvload
from pipeline.errors import ModelError
from tests.classify_support import (
    causal_lm_with_score,
    classifier_checkpoint,
    gemma3_multimodal_classifier,
    reference_logits,
)
from tests.cli_support import run_cli
from tests.llm_support import llm_kwargs
from tests.paged_support import WINDOW

LONG = [(11 * i + 3) % 500 + 1 for i in range(3 * WINDOW + 5)]  # past the sliding window, computed in chunks
SHORT = [88, 123, 7]


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_a_gemma3_text_classifier_classifies_and_rewards_as_transformers_computes_it(tmp_path, manager):
    path = classifier_checkpoint(tmp_path / "gemma3", "gemma3", "Gemma3TextForSequenceClassification", 3)
    logits = reference_logits(path)
    with kvload.LLM(str(path), dtype="float32", **llm_kwargs(manager)) as llm:
        assert llm.result.model.architecture == "Gemma3TextForSequenceClassification"
        outs = llm.classify([LONG, SHORT])
        for out, ids in zip(outs, [LONG, SHORT], strict=True):
            np.testing.assert_allclose(out.outputs.probs, torch.softmax(logits(ids), -1).numpy(), atol=1e-5)
        again = llm.classify(LONG)[0]  # its prefix from the cache, the window's layers too
        np.testing.assert_allclose(again.outputs.probs, outs[0].outputs.probs, atol=1e-6)
        rows = llm.reward(LONG)[0].outputs.data
        assert tuple(rows.shape) == (len(LONG), 3)
        np.testing.assert_allclose(rows[-1].numpy(), outs[0].outputs.probs, atol=1e-5)


@pytest.mark.parametrize("kind", ["multimodal", "converted"])
def test_gemma3s_multimodal_classifier_and_a_converted_causal_lm_classify_as_transformers_computes_it(tmp_path, kind):
    """The multimodal one runs its text decoder (the vision tower loaded, never run); a Gemma3ForCausalLM's own
    score.weight is its Gemma3TextForSequenceClassification head (vLLM's as_seq_cls_model)."""
    if kind == "multimodal":
        path, extra = gemma3_multimodal_classifier(tmp_path / "mm", 3), {}
    else:
        path, extra = causal_lm_with_score(tmp_path / "causal", "gemma3", 3, 3), {"convert": "classify"}
    logits = reference_logits(path)
    with kvload.LLM(str(path), dtype="float32", **extra, **llm_kwargs()) as llm:
        assert llm.result.model.architecture == ("Gemma3ForSequenceClassification" if kind == "multimodal" else
                                                 "Gemma3TextForSequenceClassification")
        for out, ids in zip(llm.classify([LONG, SHORT]), [LONG, SHORT], strict=True):
            np.testing.assert_allclose(out.outputs.probs, torch.softmax(logits(ids), -1).numpy(), atol=1e-5)


def test_a_classifier_of_a_family_kvload_does_not_serve_is_refused_in_one_line(tmp_path, capsys):
    """A token classifier of a family kvload does not serve (or any other family's classifier) is named with what is
    served, before any load, rather than failing on a missing lm_head."""
    path = classifier_checkpoint(tmp_path / "tok", "llama", "LlamaForSequenceClassification", 3)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2MoeForTokenClassification"]}))
    line = (r"^.*config\.json: architectures\[0\] Qwen2MoeForTokenClassification is a classifier kvload does not "
            r"serve; it serves LlamaForSequenceClassification, .*Gemma3TextForSequenceClassification.* and "
            r"LlamaForTokenClassification, .*Qwen3ForTokenClassification \(per-token labels")
    with pytest.raises(ModelError, match=line):
        kvload.LLM(str(path), **llm_kwargs())
    r = run_cli(capsys, "plan", str(path))
    assert r.code == 2 and "Qwen2MoeForTokenClassification is a classifier kvload does not serve" in r.err
    assert len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err
