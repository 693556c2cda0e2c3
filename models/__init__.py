"""Model registry, per-family ``ModelSpec`` classes, checkpoints and embedded presets."""

from models import deepseek_v3, deepseek_v4, gemma3, llama  # noqa: F401  (register the built-in specs)
from models.checkpoint import Checkpoint, load_hf_config, presets, resolve_checkpoint
from models.registry import register_model, registered, spec_class_for, unregister_model
from models.spec import GenericDecoderSpec, ModelSpec

__all__ = [
    "Checkpoint",
    "GenericDecoderSpec",
    "ModelSpec",
    "load_hf_config",
    "presets",
    "register_model",
    "registered",
    "resolve_checkpoint",
    "spec_class_for",
    "unregister_model",
]
