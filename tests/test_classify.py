"""Sequence-classification checkpoints as vLLM runs them: ``LLM.classify`` gives the classifier head's logits at the
prompt's last token through softmax (sigmoid for one label), checked against transformers'
``AutoModelForSequenceClassification`` reading the same tiny checkpoint; such a model does not generate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvload
from pipeline.errors import GenerationError
from tests.classify_support import classifier_checkpoint, qwen2_classifier, reference_logits
from tests.llm_support import llm_kwargs, with_tokenizer

PROMPTS = [[5, 17, 300, 42, 9, 11, 23, 2, 77, 301, 64, 8, 19], [88, 123, 7]]


@pytest.fixture(scope="module")
def three_labels(tmp_path_factory):
    """A tiny Llama classifier over three labels."""
    return classifier_checkpoint(tmp_path_factory.mktemp("cls") / "llama", "llama",
                                 "LlamaForSequenceClassification", 3)


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_classify_gives_softmax_of_the_heads_logits_as_transformers_computes_them(three_labels, manager):
    """Token ids and text alike, in order, vLLM's fields; a prompt whose prefix the cache holds classifies the same;
    use_activation=False gives the logits as computed; truncate_prompt_tokens keeps the last N tokens."""
    logits = reference_logits(three_labels)
    with kvload.LLM(str(three_labels), dtype="float32", **llm_kwargs(manager)) as llm:
        outs = llm.classify([PROMPTS[0], "w88 w123 w7"])
        assert [type(o).__name__ for o in outs] == ["ClassificationRequestOutput"] * 2
        assert [o.prompt_token_ids for o in outs] == PROMPTS
        assert len({o.request_id for o in outs}) == 2
        for out, ids in zip(outs, PROMPTS, strict=True):
            assert out.outputs.num_classes == 3
            np.testing.assert_allclose(out.outputs.probs, torch.softmax(logits(ids), -1).numpy(), atol=1e-5)
        again = llm.classify(PROMPTS[0])[0]
        assert again.num_cached_tokens >= 8  # its first blocks came from the prefix cache
        np.testing.assert_allclose(again.outputs.probs, outs[0].outputs.probs, atol=1e-6)
        raw = llm.classify([PROMPTS[1]], pooling_params=kvload.PoolingParams(use_activation=False))[0]
        np.testing.assert_allclose(raw.outputs.probs, logits(PROMPTS[1]).numpy(), atol=1e-5)
        cut = llm.classify([PROMPTS[0]], truncate_prompt_tokens=4)[0]
        assert cut.prompt_token_ids == PROMPTS[0][-4:]
        np.testing.assert_allclose(cut.outputs.probs, torch.softmax(logits(PROMPTS[0][-4:]), -1).numpy(), atol=1e-5)


@pytest.mark.parametrize(("family", "architecture"), [("qwen3", "Qwen3ForSequenceClassification"),
                                                      ("mistral", "MistralForSequenceClassification")])
def test_one_label_head_is_sigmoid_in_other_families(tmp_path, family, architecture):
    """A reward model's or a cross-encoder's single logit goes through sigmoid (vLLM's classify activation)."""
    path = classifier_checkpoint(tmp_path / family, family, architecture, 1)
    logits = reference_logits(path)
    with kvload.LLM(str(path), dtype="float32", **llm_kwargs()) as llm:
        out = llm.classify(PROMPTS[0])[0]
    assert out.outputs.num_classes == 1
    np.testing.assert_allclose(out.outputs.probs, torch.sigmoid(logits(PROMPTS[0])).numpy(), atol=1e-5)


def test_a_qwen2_classifier_with_tied_embeddings_classifies_as_transformers_does(tmp_path):
    """Qwen2 (no preset here; the family small rerankers start from), its word embeddings tied: the head is the score
    Linear, never the embedding matrix."""
    path = qwen2_classifier(tmp_path / "qwen2", 2)
    logits = reference_logits(path)
    with kvload.LLM(str(path), dtype="float32", **llm_kwargs()) as llm:
        outs = llm.classify(PROMPTS)
    for out, ids in zip(outs, PROMPTS, strict=True):
        np.testing.assert_allclose(out.outputs.probs, torch.softmax(logits(ids), -1).numpy(), atol=1e-5)


def test_a_classifier_does_not_generate_and_a_generative_model_does_not_classify(three_labels, tiny_checkpoints,
                                                                                  tmp_path):
    """One line each, naming the architecture and what to use instead."""
    with kvload.LLM(str(three_labels), dtype="float32", **llm_kwargs()) as llm:
        for call in (lambda: llm.generate([PROMPTS[1]]), lambda: llm.chat([{"role": "user", "content": "w5"}]),
                     lambda: llm.beam_search([PROMPTS[1]], kvload.BeamSearchParams(beam_width=2, max_tokens=2))):
            with pytest.raises(GenerationError, match=r": the model is a sequence-classification model "
                                                      r"\(LlamaForSequenceClassification: a classifier head over 3 "
                                                      r"labels, no language-model head\), so it does not generate; "
                                                      r"use LLM\.classify"):
                call()
        assert llm.classify(PROMPTS[1])[0].outputs.num_classes == 3  # the refusals left nothing behind
        assert llm.embed(PROMPTS[1])[0].outputs.hidden_size == 64  # the last token's hidden state, still
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "gen", 512)
    with kvload.LLM(str(words), dtype="float32", **llm_kwargs()) as llm, \
            pytest.raises(GenerationError, match=r"^classify: .* is a generative model \(LlamaForCausalLM\), with no "
                                                 r"classifier head; load a \*ForSequenceClassification .*or use "
                                                 r"embeddings$"):
        llm.classify("w5")


def test_classify_refuses_a_bad_pooling_params(three_labels):
    """use_activation must be a bool; it is an embedding's switch too (vLLM's every task's): the hidden state as
    computed, not L2-normalized."""
    with pytest.raises(GenerationError, match=r"^PoolingParams: use_activation: expected true, false or None"):
        kvload.PoolingParams(use_activation="yes")
    with kvload.LLM(str(three_labels), dtype="float32", **llm_kwargs()) as llm:
        raw = llm.embed(PROMPTS[0], pooling_params=kvload.PoolingParams(use_activation=False))[0].outputs.embedding
        unit = llm.embed(PROMPTS[0])[0].outputs.embedding
        np.testing.assert_allclose(np.array(raw) / np.linalg.norm(raw), unit, atol=1e-5)


def test_vllms_classify_task_and_convert_are_taken_for_a_classifier(three_labels):
    """``LLM(model, task="classify")`` and ``runner="pooling", convert="classify"`` (vLLM's spellings) load the
    classifier, each said ignored (the checkpoint's architecture decides); vLLM's reward task (its conversion of a
    causal LM) stays refused."""
    for kwargs in ({"task": "classify"}, {"runner": "pooling", "convert": "classify"}, {"task": "score"}):
        with kvload.LLM(str(three_labels), dtype="float32", **kwargs, **llm_kwargs()) as llm:
            said = {e["field"]: e["reason"] for e in llm.audit.events if e["event"] == "setting_ignored"}
            assert set(kwargs) <= set(said) and "*ForSequenceClassification one classifies" in said[next(iter(kwargs))]
            assert llm.classify(PROMPTS[1])[0].outputs.num_classes == 3
    with pytest.raises(kvload.ConfigError, match=r"^task: vLLM's setting; .*vLLM's reward conversion of a causal "
                                                 r"LM .*is not served; accepted: 'auto' or 'generate' or 'embed' or "
                                                 r"'classify' or 'score', got 'reward'$"):
        kvload.LLM(str(three_labels), task="reward", **llm_kwargs())


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """A tiny Qwen3 classifier with one label: a cross-encoder (a reranker) or a reward model."""
    return classifier_checkpoint(tmp_path_factory.mktemp("ce") / "qwen3", "qwen3", "Qwen3ForSequenceClassification", 1)


def test_score_of_a_one_label_classifier_scores_each_pair_as_one_sequence_through_its_head(cross_encoder):
    """vLLM's cross-encoder score: the pair goes in as one sequence (the tokenizer's pair: here the two texts' ids
    one after the other), its score the head's logit through sigmoid, as transformers computes it; one against many
    and pairwise; use_activation=False gives the logit; ids are refused (texts only)."""
    logits = reference_logits(cross_encoder)
    query, docs = [5, 17, 300], [[88, 123, 7], [301, 64], [9, 42, 11, 23]]

    def text(ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)

    with kvload.LLM(str(cross_encoder), dtype="float32", **llm_kwargs()) as llm:
        outs = llm.score(text(query), [text(d) for d in docs])
        assert [o.prompt_token_ids for o in outs] == [query + d for d in docs]
        for out, doc in zip(outs, docs, strict=True):
            assert out.outputs.score == pytest.approx(float(torch.sigmoid(logits(query + doc))[0]), abs=1e-5)
        pairwise = llm.score([text(docs[1]), text(query)], [text(docs[0]), text(docs[2])])
        assert [o.prompt_token_ids for o in pairwise] == [docs[1] + docs[0], query + docs[2]]
        raw = llm.score(text(query), text(docs[0]), pooling_params=kvload.PoolingParams(use_activation=False))[0]
        assert raw.outputs.score == pytest.approx(float(logits(query + docs[0])[0]), abs=1e-5)
        with pytest.raises(GenerationError, match=r"^score: data_2\[1\]: a cross-encoder scores texts"):
            llm.score(text(query), [text(docs[0]), docs[1]])


def test_score_of_a_many_label_classifier_is_refused_in_one_line(three_labels):
    with kvload.LLM(str(three_labels), dtype="float32", **llm_kwargs()) as llm, \
            pytest.raises(GenerationError, match=r"^score: the model is a classifier over 3 labels "
                                                 r"\(LlamaForSequenceClassification\), which gives no single score "
                                                 r"per pair; .*use classify"):
        llm.score("w5", "w6")


def test_the_heads_activation_follows_vllms_rules_for_the_configs_problem_type_and_sentence_transformers():
    """vLLM's classify activation: softmax, sigmoid for one label or a multi-label head, none for regression; a
    cross-encoder's score activation: the sentence-transformers activation the config names (Identity: none)."""
    from types import SimpleNamespace

    from models.classifier import ClassifierHead

    logits = torch.tensor([0.5, -1.0, 2.0])
    cfg = SimpleNamespace(architectures=["Qwen3ForSequenceClassification"], id2label={0: "a", 1: "b", 2: "c"})
    head = ClassifierHead.of(cfg, 3)
    assert torch.allclose(head.probs(logits), torch.softmax(logits, -1)) and head.label([0.1, 0.2, 0.7]) == "c"
    multi = ClassifierHead.of(SimpleNamespace(**vars(cfg), problem_type="multi_label_classification"), 3)
    assert torch.allclose(multi.probs(logits), torch.sigmoid(logits))
    regression = ClassifierHead.of(SimpleNamespace(**vars(cfg), problem_type="regression"), 3)
    assert torch.equal(regression.probs(logits), logits)
    one = torch.tensor([0.7])
    plain = ClassifierHead.of(SimpleNamespace(architectures=["X"]), 1)
    assert plain.score(one) == pytest.approx(float(torch.sigmoid(one)[0])) and plain.label([0.3]) is None
    identity = ClassifierHead.of(SimpleNamespace(architectures=["X"], sentence_transformers={
        "activation_fn": "torch.nn.modules.linear.Identity"}), 1)
    assert identity.score(one) == pytest.approx(0.7)
    assert ClassifierHead.of(SimpleNamespace(architectures=["X"], sbert_ce_default_activation_function=
                                             "torch.nn.modules.linear.Identity"), 1).score(one) == pytest.approx(0.7)


@pytest.mark.parametrize(("named", "activate"), [
    ("torch.nn.modules.activation.Tanh", torch.tanh),
    ("torch.nn.modules.activation.Sigmoid", torch.sigmoid),
    ("torch.nn.modules.activation.Softmax", lambda t: torch.softmax(t, -1)),
])
def test_a_cross_encoders_sentence_transformers_activation_is_applied(named, activate):
    """vLLM instantiates the torch.nn.modules activation the config names; use_activation=False leaves the logit."""
    from types import SimpleNamespace

    from models.classifier import ClassifierHead

    logits = torch.tensor([[0.7], [-2.5]])
    head = ClassifierHead.of(SimpleNamespace(architectures=["X"], sentence_transformers={"activation_fn": named}), 1)
    assert head.score(logits[1]) == pytest.approx(float(activate(logits[1:])[0, 0]))
    assert head.scores(logits) == pytest.approx(activate(logits)[:, 0].tolist())
    assert head.scores(logits, use_activation=False) == pytest.approx([0.7, -2.5])


def test_an_activation_kvload_does_not_apply_is_refused_naming_the_config_key():
    from types import SimpleNamespace

    from models.classifier import ClassifierHead
    from pipeline.errors import ModelError

    for config, key in (({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.GELU"}},
                         r"sentence_transformers\.activation_fn: 'torch\.nn\.modules\.activation\.GELU'"),
                        ({"sbert_ce_default_activation_function": "os.system"},
                         r"sbert_ce_default_activation_function: 'os\.system'")):
        with pytest.raises(ModelError, match=rf"^config\.json: {key} is not an activation kvload applies to a "
                                             r"cross-encoder's score; accepted: torch\.nn\.modules classes Identity, "
                                             r"Sigmoid, Tanh, Softmax"):
            ClassifierHead.of(SimpleNamespace(architectures=["X"], **config), 1)


def test_a_pair_joins_by_the_tokenizers_pair_or_as_one_text_when_the_config_says_use_pad_token_false():
    """vLLM's get_score_prompt: ``tokenizer(text_1, text_2)``; "LLM as reranker" configs (use_pad_token false) join the
    two texts first (here "w5 w6" + "w7" is the words w5 and "w6w7", unknown: id 0)."""
    from types import SimpleNamespace

    from models.classifier import pair_ids
    from tests.llm_support import word_tokenizer

    tok = word_tokenizer(512)
    assert pair_ids(tok, SimpleNamespace(), "w5 w6", "w7") == [5, 6, 7]
    assert pair_ids(tok, SimpleNamespace(use_pad_token=False), "w5 w6", "w7") == [5, 0]


def test_a_classifier_is_refused_across_tensor_parallel_ranks_in_one_line(three_labels):
    from models.weights import pretrained_model
    from pipeline.errors import ModelError

    with pytest.raises(ModelError, match=r"^tensor_parallel_size=2: .* is a sequence-classification checkpoint, "
                                         r"which kvload runs on one rank; run it with tensor_parallel_size=1$"):
        pretrained_model(three_labels, device="cpu", dtype="float32", tp_size=2, classifier=True)


def test_a_cross_encoders_truncation_cuts_the_document_and_keeps_the_query(cross_encoder):
    """vLLM tokenizes a truncated pair with ``truncation=True, max_length=N``: the longer text (the document) is cut,
    the query kept whole, and the score is transformers' of that pair; -1 is the model's length (nothing cut here)."""
    from transformers import AutoTokenizer

    logits = reference_logits(cross_encoder)
    tokenizer = AutoTokenizer.from_pretrained(str(cross_encoder))
    query, doc = [5, 17, 300], list(range(40, 60))
    q_text, d_text = " ".join(f"w{i}" for i in query), " ".join(f"w{i}" for i in doc)
    expected = tokenizer(q_text, d_text, truncation=True, max_length=8)["input_ids"]
    assert expected == query + doc[:5]
    with kvload.LLM(str(cross_encoder), dtype="float32", **llm_kwargs()) as llm:
        for kwargs in ({"truncate_prompt_tokens": 8},
                       {"pooling_params": kvload.PoolingParams(truncate_prompt_tokens=8)}):
            out = llm.score(q_text, d_text, **kwargs)[0]
            assert out.prompt_token_ids == expected
            assert out.outputs.score == pytest.approx(float(torch.sigmoid(logits(expected))[0]), abs=1e-5)
        assert llm.score(q_text, d_text, truncate_prompt_tokens=-1)[0].prompt_token_ids == query + doc


def test_normalize_is_refused_and_use_activation_is_every_calls_switch(three_labels, cross_encoder):
    """vLLM removed PoolingParams' normalize (use_activation is every task's switch): it is refused where it is
    given, in one line pointing to use_activation; classify and a cross-encoder's score take use_activation."""
    with pytest.raises(TypeError, match=r"^PoolingParams: normalize was removed, as vLLM removed it; use "
                                        r"use_activation \(False: "):
        kvload.PoolingParams(normalize=False)
    with kvload.LLM(str(three_labels), dtype="float32", **llm_kwargs()) as llm:
        logits = llm.classify(PROMPTS[0], pooling_params=kvload.PoolingParams(use_activation=False))[0].outputs.probs
        probs = llm.classify(PROMPTS[0])[0].outputs.probs
        np.testing.assert_allclose(torch.softmax(torch.tensor(logits), -1).numpy(), probs, atol=1e-5)
    with kvload.LLM(str(cross_encoder), dtype="float32", **llm_kwargs()) as llm:
        logit = llm.score("w5", "w6", pooling_params=kvload.PoolingParams(use_activation=False))[0].outputs.score
        assert abs(torch.sigmoid(torch.tensor(logit)).item() - llm.score("w5", "w6")[0].outputs.score) < 1e-5


def test_classify_and_reward_refusals_name_the_call_and_what_it_makes(three_labels):
    """A prompt past max_seq_len is named as the request it would be (a classification, a reward), not an embedding;
    a prompt the KV pools cannot hold is titled by the call made (reward:), not generate:."""
    from pipeline.errors import KvBuildError

    with kvload.LLM(str(three_labels), dtype="float32", **llm_kwargs()) as llm:
        with pytest.raises(GenerationError, match=r"^classify: prompt 0: 65 tokens; a classification takes at most "
                                                  r"max_seq_len=64"):
            llm.classify([[1] * 65])
        with pytest.raises(GenerationError, match=r"^reward: prompt 0: 65 tokens; a reward \(every token's scores\) "
                                                  r"takes at most max_seq_len=64"):
            llm.reward([[1] * 65])
        with pytest.raises(GenerationError, match=r"^embed: prompt 0: 65 tokens; an embedding takes at most"):
            llm.embed([[1] * 65])
    with kvload.LLM(str(three_labels), dtype="float32", **llm_kwargs(max_tokens=16)) as llm, \
            pytest.raises(KvBuildError, match=r"^reward: prompt 0: 40 prompt tokens \+ nothing generated need "):
        llm.reward([[1] * 40])



def test_reward_rows_of_a_preempted_prompt_are_its_tokens_once(three_labels):
    """A per-token request the V2 manager preempts is computed again from token 0: its rows are the prompt's, one per
    token, as LLM.reward computes it alone (the first attempt's rows were kept before the second's: 116 for 60)."""
    from engine.sampling_params import SamplingParams
    from models.classifier import head_logits

    a = [(7 * i + 5) % 500 + 1 for i in range(60)]
    b = [(5 * i + 3) % 500 + 1 for i in range(60)]
    kwargs = {**llm_kwargs("v2", max_tokens=64, host_cache_size=0), "max_num_tokens": 8}
    with kvload.LLM(str(three_labels), dtype="float32", scheduling_policy="priority", **kwargs) as llm:
        with llm.result.running() as executor:
            outs = executor.run([a, b], SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), pool=True,
                                every_token=True, priority=[5, 0], arrival_steps=[0, 3])
            rows = [executor.pooled.take(o.request_id) for o in outs]
        assert llm.result.kv_manager.counters["preemptions"] > 0  # b's arrival preempted a, which then ran again
        assert [r.shape[0] for r in rows] == [60, 60]
        head = llm._head("reward")
        for got, ids in zip(rows, (a, b), strict=True):
            want = llm.reward([ids])[0].outputs.data
            torch.testing.assert_close(head.probs(head_logits(llm.result.hf_model, got), True), want,
                                       atol=1e-5, rtol=1e-4)
