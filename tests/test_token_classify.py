"""A decoder family's ``*ForTokenClassification`` checkpoint (per-token labels, such as NER): the ``score`` head
(with its bias) over every token's hidden state, served as vLLM serves one (its registry's ``convert="classify"`` of
the family's causal LM): ``LLM.encode(pooling_task="token_classify")`` and ``LLM.reward`` give every token's class
probabilities, checked against transformers' ``softmax(AutoModelForTokenClassification(ids).logits, -1)`` on the
same tiny checkpoint; ``classify`` the last token's; ``POST /pooling``'s default task is ``token_classify``; such a
model does not generate."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import kvload
from pipeline.errors import GenerationError
from tests.classify_support import reference_token_probs, token_classifier_checkpoint
from tests.llm_support import llm_kwargs, with_tokenizer
from tests.serve_support import serving

LONG = [(7 * i + 5) % 500 + 1 for i in range(40)]  # prefilled in three chunks of max_num_tokens 16
SHORT = [88, 123, 7]


def text(ids: list[int]) -> str:
    """The word-level tokenizer's text of ``ids`` (token i is "w<i>")."""
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def ner(tmp_path_factory):
    """A tiny LlamaForTokenClassification over five labels."""
    return token_classifier_checkpoint(tmp_path_factory.mktemp("tok") / "llama", "llama",
                                       "LlamaForTokenClassification", 5)


@pytest.mark.parametrize(("family", "architecture", "manager"), [
    ("llama", "LlamaForTokenClassification", "v1"), ("llama", "LlamaForTokenClassification", "v2"),
    ("mistral", "MistralForTokenClassification", "v1"), ("qwen2", "Qwen2ForTokenClassification", "v1"),
    ("qwen3", "Qwen3ForTokenClassification", "v1")])
def test_encode_token_classify_gives_every_tokens_class_probabilities_as_transformers_computes_them(
        tmp_path, family, architecture, manager):
    """One PoolingRequestOutput per prompt, in order, one row of probabilities per prompt token, within 1e-5 of
    transformers' softmax over the token classifier's logits: a prompt prefilled in three chunks, and the same
    prompt again once the prefix cache holds its blocks (computed whole: the same rows); reward gives the same
    rows, classify the last one; use_activation=False the logits."""
    path = token_classifier_checkpoint(tmp_path / family, family, architecture, 5)
    probs = reference_token_probs(path)
    logits_model = transformers.AutoModelForTokenClassification.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager").eval()
    with kvload.LLM(str(path), dtype="float32", **llm_kwargs(manager)) as llm:
        assert llm.result.model.architecture == architecture
        # (transformers reads the word-level tokenizer saved next to a qwen2 config as Qwen2's own: ids there)
        short = SHORT if family == "qwen2" else text(SHORT)
        outs = llm.encode([LONG, short], pooling_task="token_classify")
        assert [type(o).__name__ for o in outs] == ["PoolingRequestOutput"] * 2
        assert [o.prompt_token_ids for o in outs] == [LONG, SHORT]
        for out, ids in zip(outs, [LONG, SHORT], strict=True):
            assert tuple(out.outputs.data.shape) == (len(ids), 5) and out.outputs.data.dtype == torch.float32
            np.testing.assert_allclose(out.outputs.data.numpy(), probs(ids).numpy(), atol=1e-5)
        assert llm.classify(LONG)[0].outputs.probs == pytest.approx(probs(LONG)[-1].tolist(), abs=1e-5)
        again = llm.encode(LONG, pooling_task="token_classify")[0]  # its blocks are in the prefix cache now
        assert again.num_cached_tokens == 0
        np.testing.assert_allclose(again.outputs.data.numpy(), probs(LONG).numpy(), atol=1e-5)
        np.testing.assert_allclose(llm.reward(LONG)[0].outputs.data.numpy(), probs(LONG).numpy(), atol=1e-5)
        raw = llm.encode(SHORT, kvload.PoolingParams(use_activation=False), pooling_task="token_classify")[0]
        with torch.no_grad():
            expected = logits_model(input_ids=torch.tensor([SHORT])).logits[0]
        np.testing.assert_allclose(raw.outputs.data.numpy(), expected.numpy(), atol=1e-5)
        last = llm.encode(SHORT, pooling_task="classify")[0].outputs.data
        np.testing.assert_allclose(last.numpy(), probs(SHORT)[-1].numpy(), atol=1e-5)


def test_a_token_classifier_does_not_generate_and_encode_needs_a_task_it_serves(ner, tiny_checkpoints, tmp_path):
    """One line each: generate and chat name the architecture and where its per-token probabilities are; encode
    without pooling_task, or with an embedding task, names the tasks the model serves; a generative model's encode
    serves the embedding tasks only."""
    with kvload.LLM(str(ner), dtype="float32", **llm_kwargs()) as llm:
        refusal = (r"^{}: the model is a token-classification model \(LlamaForTokenClassification: a classifier head "
                   r"over 5 labels for every token, no language-model head\), so it does not generate; use "
                   r"LLM\.encode\(prompts, pooling_task=\"token_classify\"\) or POST /pooling")
        with pytest.raises(GenerationError, match=refusal.format("generate")):
            llm.generate(SHORT)
        with pytest.raises(GenerationError, match=refusal.format("chat")):
            llm.chat([{"role": "user", "content": "w5"}])
        with pytest.raises(GenerationError, match=r"^encode: pooling_task: required, as vLLM's LLM\.encode requires "
                                                  r"it; this model \(LlamaForTokenClassification, a classifier\) "
                                                  r"serves \"token_classify\", \"classify\"$"):
            llm.encode(SHORT)
        with pytest.raises(GenerationError, match=r"^encode: pooling_task: 'token_embed' is not served by this model "
                                                  r"\(LlamaForTokenClassification, a classifier\); accepted: "
                                                  r"\"token_classify\", \"classify\"$"):
            llm.encode(SHORT, pooling_task="token_embed")
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "gen", 512)
    with kvload.LLM(str(words), dtype="float32", **llm_kwargs()) as llm:
        with pytest.raises(GenerationError, match=r"^encode: pooling_task: 'token_classify' is not served by this "
                                                  r"model \(LlamaForCausalLM, a generative model: no classifier "
                                                  r"head\); accepted: \"token_embed\", \"embed\"$"):
            llm.encode("w5", pooling_task="token_classify")
        rows = llm.encode(SHORT, pooling_task="token_embed")[0].outputs.data
        vector = llm.embed(SHORT)[0].outputs.embedding
        assert tuple(rows.shape) == (3, len(vector))
        np.testing.assert_allclose(rows[-1].numpy(), vector, atol=1e-5)
        np.testing.assert_allclose(rows.norm(dim=-1).numpy(), np.ones(3), atol=1e-5)
        np.testing.assert_allclose(llm.encode(SHORT, pooling_task="embed")[0].outputs.data.numpy(), vector,
                                   atol=1e-6)
        # use_activation is the embedding tasks' switch too, as vLLM's: the rows as computed
        raw = llm.encode(SHORT, kvload.PoolingParams(use_activation=False), pooling_task="token_embed")[0].outputs.data
        np.testing.assert_allclose(torch.nn.functional.normalize(raw, dim=-1).numpy(), rows.numpy(), atol=1e-5)
        assert not np.allclose(raw.norm(dim=-1).numpy(), np.ones(3), atol=1e-3)


def test_the_server_answers_token_classify_by_default_and_refuses_completions(ner):
    """POST /pooling without a task gives every token's probabilities (transformers' within 1e-5), a prompt
    prefilled in chunks and again from the prefix cache alike; /classify the last token's; /v1/completions is a
    400 naming the architecture and where its probabilities are."""
    probs = reference_token_probs(ner)
    kv = {"max_tokens": 512, "tokens_per_block": 4}
    with serving(str(ner), dtype="float32", max_seq_len=64, max_num_tokens=16, kv_cache_config=kv) as served:
        for _ in range(2):  # the second time its blocks are in the prefix cache
            r = served.http.post("/pooling", json={"input": [text(LONG), SHORT]})
            assert r.status_code == 200, r.text
            for d, ids in zip(r.json()["data"], [LONG, SHORT], strict=True):
                np.testing.assert_allclose(np.array(d["data"]), probs(ids).numpy(), atol=1e-5)
        r = served.http.post("/classify", json={"input": SHORT})
        assert r.status_code == 200, r.text
        assert r.json()["data"][0]["probs"] == pytest.approx(probs(SHORT)[-1].tolist(), abs=1e-5)
        r = served.http.post("/v1/completions", json={"model": served.state.model_name, "prompt": "w5"})
        assert r.status_code == 400 and "token-classification model (LlamaForTokenClassification" in r.text


def test_token_embed_projects_no_logits_for_its_pooled_rows(tiny_checkpoints, tmp_path):
    """A per-token pooled prompt's rows are its hidden states: the output projection (a causal LM's vocab-wide
    lm_head) runs on none of them, only on rows whose logits are read (each step's last row per sequence), so a
    chunk of N tokens no longer makes N x vocab logits; the rows are the same, and a scored prompt (prompt_logprobs)
    still projects every position."""
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "gen", 512)
    with kvload.LLM(str(words), dtype="float32", **llm_kwargs()) as llm:
        head = llm.result.executor.model.get_output_embeddings()
        projected: list[int] = []
        hook = head.register_forward_hook(lambda _m, _a, out: projected.append(out.reshape(-1, out.shape[-1]).shape[0]))
        try:
            rows = llm.encode([LONG, SHORT], pooling_task="token_embed")
            assert projected and max(projected) <= 2, projected  # one row per scheduled prompt, at most
            assert [tuple(o.outputs.data.shape) for o in rows] == [(len(LONG), rows[0].outputs.data.shape[1]),
                                                                   (len(SHORT), rows[0].outputs.data.shape[1])]
            np.testing.assert_allclose(rows[0].outputs.data[-1].numpy(), llm.embed(LONG)[0].outputs.embedding,
                                       atol=1e-6)
            projected.clear()
            scored = llm.generate(LONG, kvload.SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
            assert len(scored.prompt_logprobs) == len(LONG) and max(projected) == 16  # a whole chunk's logits
        finally:
            hook.remove()
