"""``kvload models``: every preset and packaged model, with plan/build/generate derived from the code."""

from __future__ import annotations

import pytest

from models.checkpoint import PACKAGED, load_hf_config, packaged_config, presets, resolve_checkpoint
from tests.cli_support import run_cli
from tests.conftest import needs_smollm2


@pytest.fixture(scope="module")
def listing():
    from kvload.catalog import catalog

    return {row["name"]: row for row in catalog()["models"]}


def test_every_preset_and_packaged_model_is_listed(listing):
    assert set(listing) == {*presets(), *PACKAGED}
    assert listing["smollm2-135m"]["architecture"] == "LlamaForCausalLM"
    assert listing["tiny-deepseek-v3"]["generate"] is True  # MLA is served by the paged attention
    v4 = listing["tiny-deepseek-v4"]
    assert (v4["plan"], v4["build"], v4["generate"]) == (True, True, True)  # its layers run on V2 only
    assert v4["managers"] == ["KVCacheManagerV2"] and v4["why_not"] is None


@pytest.mark.parametrize("preset", presets())
def test_the_listing_says_what_generate_does(capsys, listing, preset):
    r = run_cli(capsys, "generate", preset, "--prompt-ids", "1,2,3", "--max_new_tokens", "1", "--device", "cpu")
    assert (r.code == 0) is listing[preset]["generate"], r.err
    if not listing[preset]["generate"]:
        assert r.one_error_line and "paged attention serves" in r.err


@pytest.mark.parametrize("preset", presets())
def test_the_listing_says_which_managers_can_be_built(capsys, listing, preset):
    for manager, v2 in (("KVCacheManager", "false"), ("KVCacheManagerV2", "true")):
        r = run_cli(capsys, "run", preset, "--device", "cpu", "--max_tokens", "4096", "--max_seq_len", "512",
                    "--use_kv_cache_manager_v2", v2)
        assert (r.code == 0) is (manager in listing[preset]["managers"]), r.err


def test_the_text_listing_has_a_row_per_model(capsys):
    out = run_cli(capsys, "models").out
    for name in (*presets(), *PACKAGED):
        assert any(line.split()[:1] == [name] for line in out.splitlines()), name


@needs_smollm2
def test_the_stored_packaged_config_matches_the_installed_file():
    stored = packaged_config("smollm2-135m")
    real = load_hf_config(resolve_checkpoint("smollm2-135m"))
    for key in ("architectures", "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "hidden_size", "max_position_embeddings", "sliding_window", "vocab_size"):
        assert stored.get(key) == getattr(real, key, None), key
