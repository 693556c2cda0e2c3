"""Tiny ``*ForSequenceClassification`` and ``*ForTokenClassification`` checkpoints (random weights, a word-level
tokenizer) and transformers' own reading of them, for the classifier tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from models.config_view import transformers_config
from tests.llm_support import word_tokenizer
from tests.paged_support import tiny_config

VOCAB = 512  # the tiny presets'


def classifier_checkpoint(dest: Path, family: str, architecture: str, num_labels: int, **extra: Any) -> Path:
    """A saved random classifier of ``family``'s tiny preset: ``num_labels`` labels (named ``L<i>``), seeded."""
    cfg = transformers_config(tiny_config(family))
    cfg.architectures = [architecture]
    cfg.num_labels = num_labels
    cfg.id2label = {i: f"L{i}" for i in range(num_labels)}
    cfg.label2id = {f"L{i}": i for i in range(num_labels)}
    for key, value in extra.items():
        setattr(cfg, key, value)
    return saved_classifier(cfg, dest)


def saved_classifier(cfg: Any, dest: Path) -> Path:
    """A random ``AutoModelForSequenceClassification`` of ``cfg`` saved in ``dest`` with the word-level tokenizer,
    seeded."""
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(cfg)
    with torch.no_grad():  # a head whose logits differ enough between prompts to tell them apart
        model.score.weight.normal_(0, 0.5)
    model.save_pretrained(dest)
    word_tokenizer(VOCAB).save_pretrained(dest)
    return dest


def token_classifier_checkpoint(dest: Path, family: str, architecture: str, num_labels: int) -> Path:
    """A saved random ``*ForTokenClassification`` (``AutoModelForTokenClassification``: the ``score`` Linear has a
    bias) of ``family``'s tiny preset (``qwen2``, which has none: a ``Qwen2Config`` of the same size): ``num_labels``
    labels (named ``L<i>``), seeded."""
    if family == "qwen2":
        cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                       initializer_range=0.2)
    else:
        cfg = transformers_config(tiny_config(family))
    cfg.architectures = [architecture]
    cfg.num_labels = num_labels
    cfg.id2label = {i: f"L{i}" for i in range(num_labels)}
    cfg.label2id = {f"L{i}": i for i in range(num_labels)}
    torch.manual_seed(0)
    model = transformers.AutoModelForTokenClassification.from_config(cfg)
    with torch.no_grad():  # a head (and bias) whose logits differ enough between tokens to tell them apart
        model.score.weight.normal_(0, 0.5)
        model.score.bias.normal_(0, 0.5)
    model.save_pretrained(dest)
    word_tokenizer(VOCAB).save_pretrained(dest)
    return dest


def reference_token_probs(path: Path) -> Any:
    """transformers' ``AutoModelForTokenClassification`` of the checkpoint: a prompt's per-token class probabilities,
    ``softmax(model(ids).logits, -1)`` (eval: no dropout)."""
    model = transformers.AutoModelForTokenClassification.from_pretrained(str(path), dtype=torch.float32,
                                                                         attn_implementation="eager").eval()

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)

    return probs


def reference_logits(path: Path) -> Any:
    """transformers' ``AutoModelForSequenceClassification`` of the checkpoint: a prompt's logits (its last token)."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32,
                                                                            attn_implementation="eager").eval()

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0].float()

    return logits


def qwen2_classifier(dest: Path, num_labels: int) -> Path:
    """A saved random ``Qwen2ForSequenceClassification`` (no preset of its family) with tied word embeddings, as the
    small Qwen2.5 checkpoints rerankers start from."""
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   architectures=["Qwen2ForSequenceClassification"], tie_word_embeddings=True,
                                   num_labels=num_labels)
    return saved_classifier(cfg, dest)


def causal_lm_with_score(dest: Path, family: str, num_labels: int | None, score_rows: int | None) -> Path:
    """A saved random ``*ForCausalLM`` of ``family``'s tiny preset whose weights also carry a ``score.weight`` of
    ``score_rows`` rows (None: none), as some fine-tunes save a reward head next to the language-model head;
    ``num_labels`` written to its config (None: left out, transformers' default 2)."""
    from safetensors.torch import load_file, save_file

    cfg = transformers_config(tiny_config(family))
    cfg.architectures = [cfg.architectures[0]]
    if num_labels is not None:
        cfg.num_labels = num_labels
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(dest)
    if score_rows is not None:
        tensors = load_file(str(dest / "model.safetensors"))
        tensors["score.weight"] = torch.randn(score_rows, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
        tensors["score.weight"] *= 0.5
        save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    word_tokenizer(VOCAB).save_pretrained(dest)
    return dest


def gemma3_multimodal_classifier(dest: Path, num_labels: int) -> Path:
    """A saved random ``Gemma3ForSequenceClassification`` (a ``Gemma3Config``): the tiny Gemma 3 preset's decoder as its
    ``text_config``, a one-layer SigLIP vision tower beside it, a ``score`` head of ``num_labels`` rows."""
    text = transformers_config(tiny_config("gemma3"))
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                    image_token_index=VOCAB - 12, boi_token_index=VOCAB - 14,
                                    eoi_token_index=VOCAB - 13)
    cfg.architectures = ["Gemma3ForSequenceClassification"]
    cfg.num_labels = num_labels
    return saved_classifier(cfg, dest)
