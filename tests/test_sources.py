"""Sources and precedence: framework default < YAML file < CLI/Python, with source_conflict events."""

from __future__ import annotations

import pytest

import pipeline
from pipeline import ConfigError, KvCacheConfig


@pytest.fixture
def yaml_file(tmp_path):
    def make(text: str):
        path = tmp_path / "cfg.yaml"
        path.write_text(text)
        return path

    return make


def test_yaml_then_python_precedence_and_conflict(log, yaml_file):
    cfg = yaml_file("kv_cache_config:\n  tokens_per_block: 64\n  enable_block_reuse: false\nmax_batch_size: 8\n")
    result = pipeline.plan("tiny-llama", config_file=cfg, kv_cache_config={"tokens_per_block": 16})
    kv = result.args.kv_cache_config
    assert (kv.tokens_per_block, kv.enable_block_reuse, result.args.max_batch_size) == (16, False, 8)
    assert log.has("source_conflict", field="kv_cache_config.tokens_per_block", kept=16, kept_source="api",
                   overridden=64, overridden_source="config_file", level="warning")
    chain = result.audit.provenance("kv_cache_config.tokens_per_block")
    assert [(s["source"], s["old"], s["new"]) for s in chain] == [("config_file", 32, 64), ("api", 64, 16)]


def test_yaml_auto_and_yaml_bools(yaml_file):
    cfg = yaml_file("kv_cache_config:\n  use_kv_cache_manager_v2: auto\n")
    result = pipeline.plan("tiny-deepseek-v4", config_file=cfg, log=False)
    assert result.args.kv_cache_config.use_kv_cache_manager_v2 is True
    assert result.audit.of("auto_captured")[2]["source"] == "config_file"


@pytest.mark.parametrize("word", ["yes", "on", "1", "auto"])
def test_yaml_bool_fields_take_only_true_false(yaml_file, word):
    cfg = yaml_file(f"kv_cache_config:\n  enable_block_reuse: {word}\n")
    with pytest.raises(ConfigError, match=r"cfg.yaml: kv_cache_config.enable_block_reuse: expected true or false"):
        pipeline.plan("tiny-llama", config_file=cfg, log=False)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kv_cache_config: [1, 2\n", "malformed YAML"),
        ("- a\n- b\n", "expected a mapping of LlmArgs fields at the top level, got list"),
        ("kv_cache_config:\n  enable_partial: true\n", "did you mean 'enable_partial_reuse'"),
    ],
)
def test_bad_yaml_files_name_the_file(yaml_file, text, message):
    cfg = yaml_file(text)
    with pytest.raises(ConfigError) as err:
        pipeline.plan("tiny-llama", config_file=cfg, log=False)
    assert str(err.value).startswith(f"config file {cfg}")
    assert message in str(err.value)


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="config file .*nope.yaml: not found"):
        pipeline.plan("tiny-llama", config_file=tmp_path / "nope.yaml", log=False)


def test_config_object_contributes_only_its_explicit_fields(log):
    kv = KvCacheConfig(enable_block_reuse=True)  # equal to the default, still user-set
    result = pipeline.plan("tiny-llama", kv_cache_config=kv)
    assert "kv_cache_config.enable_block_reuse" in result.context.user_fields
    assert "kv_cache_config.tokens_per_block" not in result.context.user_fields
    assert log.has("args_parsed", field="kv_cache_config.enable_block_reuse", old=True, new=True, source="api")


def test_model_in_yaml_is_overridden_by_the_argument(yaml_file):
    cfg = yaml_file("model: tiny-gemma3\n")
    result = pipeline.plan("tiny-llama", config_file=cfg, log=False)
    assert result.args.model == "tiny-llama"
