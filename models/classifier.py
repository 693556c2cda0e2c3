"""Classifier checkpoints (``*ForSequenceClassification``, ``*ForTokenClassification``), as vLLM serves them.

vLLM runs a decoder checkpoint with a classifier head (reward models, rerankers, text classifiers) by pooling the
final norm's output at the prompt's last token (LAST pooling) and applying the head (the ``score`` Linear) to it:
``LLM.classify`` and ``/classify`` give the head's logits through softmax (sigmoid for one label), ``LLM.score``,
``/score`` and ``/rerank`` score a pair as one sequence through the head (a cross-encoder, one label).

kvload loads the checkpoint with transformers' ``AutoModelForSequenceClassification`` (every check of a causal-LM
load applies), then hands the executor its family's causal-LM class over the same decoder, the ``score`` Linear in
place of ``lm_head`` (:func:`as_causal_shell`): the paged forward, prefix reuse and the pooled hidden row
(``engine.pooling.PooledRows``) work unchanged, and the head is applied to that row (:class:`ClassifierHead`).

A decoder family's ``*ForTokenClassification`` (NER, per-token labels) is the same decoder with a ``score`` Linear
(with a bias) applied to every token's hidden state. vLLM has no class of its own for one: its registry resolves the
name to the family's ``*ForCausalLM`` under ``convert="classify"`` (``_SUFFIX_TO_DEFAULTS``), so it is served as the
sequence classifiers are: ``token_classify`` (``LLM.encode``/``LLM.reward``, ``/pooling``'s default) gives every
token's class probabilities, and ``classify`` the last token's. kvload loads it with transformers'
``AutoModelForTokenClassification`` and hands the executor the same causal shell.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from pipeline.errors import ModelError

#: The ``architectures[0]`` names served as classifiers: the decoder families kvload generates with.
LLAMA_CLASSIFIERS = ("LlamaForSequenceClassification", "MistralForSequenceClassification",
                     "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification")
#: Gemma 3's classifiers: the text one (transformers' ``Gemma3TextForSequenceClassification``, a ``Gemma3TextConfig``:
#: the text decoder alone, with its interleaved sliding-window layers) and the multimodal one
#: (``Gemma3ForSequenceClassification``, a ``Gemma3Config``: the same decoder under ``text_config``, its vision tower
#: loaded with it and never run, text prompts only, as kvload serves Gemma3ForConditionalGeneration)
GEMMA3_CLASSIFIER = "Gemma3TextForSequenceClassification"
GEMMA3_CLASSIFIERS = (GEMMA3_CLASSIFIER, "Gemma3ForSequenceClassification")
SEQUENCE_CLASSIFIERS = (*LLAMA_CLASSIFIERS, *GEMMA3_CLASSIFIERS)
#: The ``*ForTokenClassification`` names served (per-token labels): the same decoder families, the ``score`` head over
#: every token's hidden state
TOKEN_CLASSIFIERS = tuple(name.replace("ForSequenceClassification", "ForTokenClassification")
                          for name in LLAMA_CLASSIFIERS)
#: Every classifier architecture served
CLASSIFIERS = (*SEQUENCE_CLASSIFIERS, *TOKEN_CLASSIFIERS)
#: vLLM's ``as_seq_cls_model`` of a causal LM (``convert="classify"``) → the classifier class transformers loads it
#: as: the family's ``*ForSequenceClassification`` (Gemma 3's text one: ``Gemma3ForCausalLM`` is its text decoder)
CONVERTED = {**{name.replace("ForSequenceClassification", "ForCausalLM"): name for name in LLAMA_CLASSIFIERS},
             "Gemma3ForCausalLM": GEMMA3_CLASSIFIER}

#: The attribute of the loaded model that holds its :class:`ClassifierHead` (absent on a generative model).
HEAD_ATTRIBUTE = "kvload_classifier"


def architecture_of(hf_config: Any) -> str:
    """``architectures[0]`` of a config, or ``""``."""
    archs = getattr(hf_config, "architectures", None) or []
    return str(archs[0]) if archs else ""


def unserved_classifier(hf_config: Any) -> str | None:
    """Why a classifier checkpoint (``*ForSequenceClassification``, ``*ForTokenClassification``) kvload does not serve
    is refused, naming those it does (None for any other architecture): loaded as a causal LM it failed on a missing
    ``lm_head.weight``, or ran the decoder without its head."""
    architecture = architecture_of(hf_config)
    if architecture in CLASSIFIERS or not architecture.endswith(("ForSequenceClassification",
                                                                 "ForTokenClassification")):
        return None
    return (f"architectures[0] {architecture} is a classifier kvload does not serve; it serves "
            f"{', '.join(SEQUENCE_CLASSIFIERS)} (LLM.classify and LLM.reward, POST /classify, and /score and /rerank "
            f"for one label) and {', '.join(TOKEN_CLASSIFIERS)} (per-token labels: LLM.encode with pooling_task "
            "token_classify, POST /pooling)")


def is_sequence_classifier(hf_config: Any) -> bool:
    """Whether the checkpoint is one of :data:`SEQUENCE_CLASSIFIERS`."""
    return architecture_of(hf_config) in SEQUENCE_CLASSIFIERS


def is_token_classifier(hf_config: Any) -> bool:
    """Whether the checkpoint is one of :data:`TOKEN_CLASSIFIERS`."""
    return architecture_of(hf_config) in TOKEN_CLASSIFIERS


def classifier_kind(hf_config: Any) -> str | None:
    """``"sequence"`` or ``"token"`` for a classifier kvload serves (the transformers auto class it loads with:
    ``AutoModelFor{Sequence,Token}Classification``), None for any other architecture."""
    if is_sequence_classifier(hf_config):
        return "sequence"
    return "token" if is_token_classifier(hf_config) else None


#: The sentence-transformers activations of a cross-encoder's score kvload applies, by class name (vLLM instantiates
#: any ``torch.nn.modules`` class the config names: ``get_cross_encoder_act_fn``)
SCORE_ACTIVATIONS = {"Identity": "identity", "Sigmoid": "sigmoid", "Tanh": "tanh", "Softmax": "softmax"}


def _score_activation(hf_config: Any) -> str:
    """How vLLM activates a cross-encoder's score (``get_cross_encoder_act_fn``): the sentence-transformers
    activation the config names (one of :data:`SCORE_ACTIVATIONS`), else the classify activation (``classify``); one it
    names that kvload does not apply is a ``ModelError`` naming the config key."""
    from pipeline.errors import ModelError

    st = getattr(hf_config, "sentence_transformers", None)
    if isinstance(st, Mapping) and st.get("activation_fn"):
        key, named = "sentence_transformers.activation_fn", st["activation_fn"]
    elif getattr(hf_config, "sbert_ce_default_activation_function", None):
        key, named = "sbert_ce_default_activation_function", hf_config.sbert_ce_default_activation_function
    else:
        return "classify"
    if isinstance(named, str) and named.startswith("torch.nn.modules.") and \
            named.rsplit(".", 1)[-1] in SCORE_ACTIVATIONS:
        return SCORE_ACTIVATIONS[named.rsplit(".", 1)[-1]]
    raise ModelError(f"config.json: {key}: {str(named)[:120]!r} is not an activation kvload applies to a "
                     f"cross-encoder's score; accepted: torch.nn.modules classes {', '.join(SCORE_ACTIVATIONS)} "
                     "(e.g. torch.nn.modules.activation.Sigmoid), or leave it out (sigmoid)")


@attrs.frozen
class ClassifierHead:
    """What a classifier's outputs need beyond its logits: its labels and how vLLM activates them."""

    architecture: str
    num_labels: int
    id2label: dict[int, str] = attrs.field(factory=dict)
    #: transformers' ``problem_type``: ``regression`` is not activated, ``multi_label_classification`` is sigmoid
    problem_type: str | None = None
    #: the cross-encoder score's activation (:func:`_score_activation`): ``classify`` (as :meth:`probs`) or one of
    #: :data:`SCORE_ACTIVATIONS`' values
    score_activation: str = "classify"

    @classmethod
    def of(cls, hf_config: Any, num_labels: int) -> ClassifierHead:
        """The head of a loaded classifier's config (``num_labels`` from its ``score`` Linear)."""
        labels = getattr(hf_config, "id2label", None) or {}
        return cls(architecture=architecture_of(hf_config), num_labels=num_labels,
                   id2label={int(k): str(v) for k, v in labels.items()},
                   problem_type=getattr(hf_config, "problem_type", None) or None,
                   score_activation=_score_activation(hf_config))

    def probs(self, logits: Any, use_activation: bool = True) -> Any:
        """vLLM's classify activation of one row of logits (float32): softmax, sigmoid for one label or a
        multi-label head, none for a regression head or ``use_activation=False``."""
        import torch

        row = logits.float()
        if not use_activation or self.problem_type == "regression":
            return row
        if self.num_labels < 2 or self.problem_type == "multi_label_classification":
            return torch.sigmoid(row)
        return torch.softmax(row, dim=-1)

    def score(self, logits: Any, use_activation: bool = True) -> float:
        """A cross-encoder's score of one pair (one label): its logit through the score activation."""
        return self.scores(logits[None], use_activation)[0]

    def scores(self, logits: Any, use_activation: bool = True) -> list[float]:
        """:meth:`score` of each row of a stacked ``(pairs, 1)`` tensor of logits, activated at once."""
        import torch

        rows = logits.float()
        act = self.score_activation
        if not use_activation or act == "identity":
            return rows[:, 0].tolist()
        if act == "classify":
            return self.probs(rows)[:, 0].tolist()
        activate = {"sigmoid": torch.sigmoid, "tanh": torch.tanh, "softmax": lambda r: torch.softmax(r, dim=-1)}[act]
        return activate(rows)[:, 0].tolist()

    @property
    def per_token(self) -> bool:
        """Whether the head is a ``*ForTokenClassification``'s (per-token labels)."""
        return self.architecture in TOKEN_CLASSIFIERS

    def label(self, probs: list[float]) -> str | None:
        """The label of the most probable class (``id2label``; None when the config names none), vLLM's ``label``."""
        best = max(range(len(probs)), key=lambda i: probs[i])
        return self.id2label.get(best)


#: vLLM's rule (``vllm/model_executor/models/adapters.py``) for a classifier made from a causal LM's own head: two
#: tokens ``classifier_from_token = [false, true]`` give one label whose weight is ``lm_head[true] - lm_head[false]``,
#: so its sigmoid is the softmax of the two tokens' logits (Qwen3-Reranker, mxbai-rerank-v2)
FROM_TWO_TOKENS = "from_2_way_softmax"


def token_head_tokens(hf_config: Any) -> list[str] | None:
    """The ``[false, true]`` tokens of a classifier vLLM builds from the causal LM's ``lm_head`` (its ``method``
    ``from_2_way_softmax``, which ``is_original_qwen3_reranker`` implies for Qwen3), or None for a config that asks
    for none. ``ModelError`` naming the key for another method or tokens that are not two strings."""
    if not is_sequence_classifier(hf_config):
        return None
    method = getattr(hf_config, "method", None)
    if method is None and getattr(hf_config, "is_original_qwen3_reranker", False) is True \
            and architecture_of(hf_config) == "Qwen3ForSequenceClassification":
        method = FROM_TWO_TOKENS  # vLLM's Qwen3ForSequenceClassificationConfig
    tokens = getattr(hf_config, "classifier_from_token", None)
    if method is None:
        if tokens is not None:
            raise ModelError(f"classifier_from_token: {tokens!r} needs method {FROM_TWO_TOKENS!r} (or "
                             "is_original_qwen3_reranker true for a Qwen3 checkpoint) in the config to say how the "
                             "head is built from the tokens")
        return None
    if method != FROM_TWO_TOKENS:
        raise ModelError(f"method: {method!r}: kvload builds a classifier from a causal LM's head by vLLM's "
                         f"{FROM_TWO_TOKENS!r} only (classifier_from_token: [false token, true token])")
    if not (isinstance(tokens, (list, tuple)) and len(tokens) == 2 and all(isinstance(t, str) for t in tokens)):
        raise ModelError(f"classifier_from_token: expected two tokens [false, true] for method {FROM_TWO_TOKENS!r} "
                         f"(such as [\"no\", \"yes\"]), got {tokens!r}")
    return list(tokens)


#: vLLM's ``convert`` values that turn a causal LM into a classifier (``--convert classify``; the older
#: ``--task classify`` maps to it for a generative checkpoint): its ``as_seq_cls_model`` adapter
CONVERT_CLASSIFY = "classify"


def classifier_of(architecture: str) -> str | None:
    """The ``*ForSequenceClassification`` architecture vLLM's ``as_seq_cls_model`` makes of a causal LM's (its
    ``_get_pooling_model_name``: ``LlamaForCausalLM`` -> ``LlamaForSequenceClassification``), as transformers names the
    class it loads (:data:`CONVERTED`); None for an architecture kvload does not classify."""
    return CONVERTED.get(architecture)


def convertible(hf_config: Any, given_as: str) -> str:
    """The ``*ForSequenceClassification`` architecture a causal LM's config converts to (:func:`classifier_of`),
    read off the config as it is (nothing imported); ``ModelError`` naming ``given_as`` for one kvload does not
    classify."""
    architecture = architecture_of(hf_config)
    made = classifier_of(architecture)
    if made is None:
        families = ", ".join(CONVERTED)
        raise ModelError(f"{given_as}: {CONVERT_CLASSIFY!r} makes a classifier of a causal LM of the families kvload "
                         f"classifies ({families}); the checkpoint is {architecture or 'of no architecture'}")
    return made


def converted_config(hf_config: Any, given_as: str) -> Any:
    """A copy of a causal LM's transformers config as vLLM's ``as_seq_cls_model`` reads it: ``architectures[0]`` its
    ``*ForSequenceClassification`` (:func:`classifier_of`), so the weights load with a ``score`` head of
    ``num_labels`` rows. ``ModelError`` naming ``given_as`` (``convert`` or ``task``) for an architecture kvload does
    not classify."""
    import copy

    from models.config_view import transformers_config

    made = convertible(hf_config, given_as)
    config = copy.deepcopy(transformers_config(hf_config))
    config.architectures = [made]
    return config


def check_score_head(path: Any, hf_config: Any, given_as: str) -> None:
    """Refuse, before any load, a causal LM converted to a classifier (:func:`converted_config`) whose safetensors
    hold no ``score.weight`` of ``num_labels`` rows: vLLM's adapter loads that head, and without it leaves the head
    uninitialised (its loader raises "Following weights were not initialized from checkpoint: {'score.weight'}").
    ``.bin`` weights, whose names need a load, are left to the load's own check (a missing tensor is refused)."""
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files and any(Path(path).glob("pytorch_model*.bin")):
        return
    rows = None
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            if "score.weight" in f.keys():  # noqa: SIM118
                rows = int(f.get_slice("score.weight").get_shape()[0])
    if rows is None:
        raise ModelError(f"{given_as}: {CONVERT_CLASSIFY!r}: {path} has no classifier head to load (no score.weight "
                         "in its weights); give a checkpoint whose weights carry score.weight (as a "
                         "*ForSequenceClassification fine-tune saves it), or build a one-label head from two tokens of "
                         "its language-model head with hf_overrides {\"method\": \"from_2_way_softmax\", "
                         "\"classifier_from_token\": [false token, true token]}")
    labels = int(getattr(hf_config, "num_labels", 0) or 0)
    if rows != labels:
        raise ModelError(f"{given_as}: {CONVERT_CLASSIFY!r}: {path}'s score.weight has {rows} rows (labels) and its "
                         f"config's num_labels is {labels}; set hf_overrides {{\"num_labels\": {rows}}} to load it")


def with_token_head(model: Any, tokenizer: Any, tokens: list[str], where: Any) -> Any:
    """A causal LM as vLLM's ``from_2_way_softmax`` classifier: its output projection a one-label Linear whose
    weight is ``lm_head[true] - lm_head[false]`` (``tokens``: ``[false, true]``, looked up in ``tokenizer``), the
    :class:`ClassifierHead` attached; ``use_pad_token`` false unless the config says (vLLM: an LLM as a reranker
    joins a pair's texts as they are). ``ModelError`` naming a token the vocabulary does not have."""
    import torch

    if tokenizer is None:
        raise ModelError(f"classifier_from_token: {where} has no tokenizer to look the tokens {tokens!r} up in")
    ids = []
    for token in tokens:
        found = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(found, int) or (found == tokenizer.unk_token_id and token != tokenizer.unk_token):
            raise ModelError(f"classifier_from_token: {token!r} is not a token of {where}'s tokenizer")
        ids.append(found)
    lm_head = model.get_output_embeddings()
    weight = lm_head.weight.detach()
    score = torch.nn.Linear(weight.shape[1], 1, bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        score.weight.copy_(weight[[ids[1]]] - weight[[ids[0]]])
    model.lm_head = score  # the tied embedding, if any, stays the input's
    config = model.config
    config.num_labels = 1
    if getattr(config, "use_pad_token", None) is None:
        config.use_pad_token = False
    setattr(model, HEAD_ATTRIBUTE, ClassifierHead.of(config, 1))
    return model.eval()


def as_causal_shell(classifier: Any) -> Any:
    """The family's causal-LM class over a loaded ``*ForSequenceClassification``'s (or ``*ForTokenClassification``'s)
    decoder, its ``score`` Linear (a token classifier's has a bias; its dropout is not run) as the output projection,
    the :class:`ClassifierHead` attached: what the executor runs (its logits rows are the head's logits; the pooled
    row is the final norm's output at the last token, the head's input)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # nothing allocated: both parts are the loaded model's
        shell = AutoModelForCausalLM.from_config(classifier.config)
    shell.model = classifier.model
    shell.lm_head = classifier.score
    shell.config = classifier.config
    setattr(shell, HEAD_ATTRIBUTE, ClassifierHead.of(classifier.config, int(classifier.score.out_features)))
    return shell.eval()


def head_of(model: Any) -> ClassifierHead | None:
    """The loaded model's :class:`ClassifierHead`, or None for a generative model."""
    return getattr(model, HEAD_ATTRIBUTE, None) if model is not None else None


def pair_ids(tokenizer: Any, hf_config: Any, text_1: str, text_2: str, max_length: int | None = None) -> list[int]:
    """A cross-encoder's pair as one sequence, tokenized as vLLM's ``get_score_prompt`` does: ``tokenizer(text_1,
    text_2)`` (the tokenizer's own pair template), or the two texts joined as one when the config says
    ``use_pad_token: false`` (vLLM's "LLM as reranker" models). ``max_length`` (a ``truncate_prompt_tokens``, as
    :func:`pair_length` resolves it): vLLM's ``truncation=True, max_length=N``, which cuts the longer text (the
    document, not the query), never the last N tokens of the joined pair."""
    cut = {} if max_length is None else {"truncation": True, "max_length": max_length}
    if getattr(hf_config, "use_pad_token", True) is False:
        return list(tokenizer(text=text_1 + text_2, **cut)["input_ids"])
    return list(tokenizer(text=text_1, text_pair=text_2, **cut)["input_ids"])


def pair_length(truncate_prompt_tokens: int | None, max_seq_len: int) -> int | None:
    """The ``max_length`` a pair is tokenized to for a ``truncate_prompt_tokens`` (vLLM's
    ``_validate_truncation_size``: -1 is the model's length), None for no cut."""
    return max_seq_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens


def not_one_score(call: str, head: ClassifierHead) -> str | None:
    """Why the head cannot score a pair (vLLM's cross-encoder score needs one label), or None when it can."""
    if head.num_labels == 1:
        return None
    return (f"{call}: the model is a classifier over {head.num_labels} labels ({head.architecture}), which gives no "
            "single score per pair; a cross-encoder's score needs one label (num_labels 1); use classify for its "
            "class probabilities")


def head_logits(model: Any, rows: Any) -> Any:
    """The classifier head (the loaded model's output projection, its ``score`` Linear) applied once to the pooled
    rows (``engine.pooling.PooledRows``; a list of rows, or a ``(tokens, hidden)`` tensor of one prompt's) stacked: a
    ``(rows, labels)`` float32 tensor on the CPU, one copy each way."""
    import torch

    head = model.get_output_embeddings()
    with torch.no_grad():
        # stacked where the rows are, then moved once (a copy per row was one device transfer per token for reward)
        stacked = rows if isinstance(rows, torch.Tensor) else torch.stack(list(rows))
        return head(stacked.to(device=head.weight.device, dtype=head.weight.dtype)).float().cpu()


def no_head(call: str, model: str, architecture: str) -> str:
    """The line a classifying call on a generative model raises: it has no classifier head."""
    return (f"{call}: {model} is a generative model ({architecture}), with no classifier head; load a "
            f"*ForSequenceClassification checkpoint ({', '.join(SEQUENCE_CLASSIFIERS)}) to classify, or use "
            "embeddings")


def not_generative(call: str, head: ClassifierHead) -> str:
    """The line a generating call on a classifier raises (vLLM: only generative models generate)."""
    if head.per_token:
        return (f"{call}: the model is a token-classification model ({head.architecture}: a classifier head over "
                f"{head.num_labels} label{'s' if head.num_labels != 1 else ''} for every token, no language-model "
                "head), so it does not generate; use LLM.encode(prompts, pooling_task=\"token_classify\") or POST "
                "/pooling for its per-token class probabilities")
    return (f"{call}: the model is a sequence-classification model ({head.architecture}: a classifier head over "
            f"{head.num_labels} label{'s' if head.num_labels != 1 else ''}, no language-model head), so it does not "
            "generate; use LLM.classify or POST /classify (LLM.score, /score and /rerank for a one-label "
            "cross-encoder)")


__all__ = ["CLASSIFIERS", "CONVERTED", "CONVERT_CLASSIFY", "FROM_TWO_TOKENS", "GEMMA3_CLASSIFIER", "GEMMA3_CLASSIFIERS",
           "HEAD_ATTRIBUTE", "LLAMA_CLASSIFIERS", "SCORE_ACTIVATIONS", "SEQUENCE_CLASSIFIERS", "TOKEN_CLASSIFIERS",
           "ClassifierHead", "architecture_of", "as_causal_shell", "check_score_head", "classifier_kind",
           "classifier_of", "converted_config", "convertible", "head_logits", "head_of", "is_sequence_classifier",
           "is_token_classifier", "no_head", "not_generative", "not_one_score", "pair_ids", "pair_length",
           "token_head_tokens", "unserved_classifier", "with_token_head"]
