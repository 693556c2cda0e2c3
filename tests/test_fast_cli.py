"""``plan``/``explain``/``models`` of a preset import neither torch nor transformers, and plan the same."""

from __future__ import annotations

import pytest

from models import spec_class_for
from models.checkpoint import load_hf_config, presets, resolve_checkpoint
from models.config_view import ConfigView, transformers_config
from pipeline.config import LlmArgs, freeze
from tests.cli_support import imports_after

#: Fields where transformers' object differs from the stored JSON without changing what kvload reads:
#: its own bookkeeping, integer vs string label keys, a private pattern it derives layer_types from.
BOOKKEEPING = {"transformers_version", "_name_or_path", "dtype", "id2label", "label2id", "_sliding_window_pattern"}


@pytest.mark.parametrize("preset", presets())
def test_a_preset_view_answers_what_autoconfig_answers(preset):
    view = load_hf_config(resolve_checkpoint(preset))
    assert isinstance(view, ConfigView)
    real = transformers_config(view)
    mine, theirs = view.to_dict(), real.to_dict()
    differ = {k for k in set(mine) | set(theirs) if mine.get(k, "<missing>") != theirs.get(k, "<missing>")}
    assert differ <= BOOKKEEPING, {k: (mine.get(k), theirs.get(k)) for k in differ - BOOKKEEPING}
    assert getattr(view, "dtype", None) == getattr(real, "dtype", None)  # None: presets declare none
    spec_cls = spec_class_for(view.architectures[0])
    a, b = spec_cls(view), spec_cls(real)
    assert a.kv_layers() == b.kv_layers()
    assert (a.checkpoint_dtype(), a.max_position_embeddings(), a.v2_required_reason()) == (
        b.checkpoint_dtype(), b.max_position_embeddings(), b.v2_required_reason())
    args = freeze(LlmArgs(model=preset))
    assert a.get_model_defaults(args) == b.get_model_defaults(args)


@pytest.mark.parametrize("device", ["cpu", "auto"])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-deepseek-v4"])
def test_plan_of_a_preset_imports_neither_torch_nor_transformers(preset, device):
    from stages.resolve_auto import gpu_driver_present

    if device == "auto" and gpu_driver_present():
        pytest.skip("a GPU driver is present: device auto asks torch whether CUDA works, as it must")
    loaded = imports_after(f"""
        from kvload.cli.entry import main
        assert main(["plan", "{preset}", "--max_tokens", "65536", "--device", "{device}"]) == 0
    """)
    assert loaded == {"torch": False, "transformers": False}


def test_models_and_explain_import_neither_torch_nor_transformers(tmp_path):
    log = tmp_path / "plan.jsonl"
    loaded = imports_after(f"""
        from kvload.cli.entry import main
        assert main(["plan", "tiny-gemma3", "--max_tokens", "8192", "--device", "cpu", "--audit-log", r"{log}"]) == 0
        assert main(["explain", r"{log}", "use_kv_cache_manager_v2"]) == 0
        assert main(["models"]) == 0
    """)
    assert loaded == {"torch": False, "transformers": False}


def test_run_of_a_preset_still_builds_with_the_real_config(capsys):
    from tests.cli_support import run_cli

    r = run_cli(capsys, "generate", "tiny-llama", "--prompt-ids", "1,2,3", "--max_new_tokens", "2",
                "--device", "cpu", "--json")
    assert r.code == 0, r.err
    assert len(r.json()["outputs"][0]["outputs"][0]["token_ids"]) == 2


def test_fields_assigned_on_a_view_reach_the_transformers_config():
    view = load_hf_config(resolve_checkpoint("tiny-llama"))
    view.initializer_range = 0.5
    view.sliding_window = 16
    assert (view.initializer_range, view.sliding_window) == (0.5, 16)
    real = transformers_config(view)
    assert (real.initializer_range, real.sliding_window) == (0.5, 16)
