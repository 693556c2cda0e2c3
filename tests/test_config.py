"""Config classes and the converter: strict values, unknown keys, explicitness."""

from __future__ import annotations

import attrs
import pytest

from pipeline import ConfigError, KvCacheConfig, LlmArgs, explicit_fields
from pipeline.config import freeze, parse_size
from pipeline.converter import structure, unstructure


def test_defaults_follow_tensorrt_llm():
    kv = KvCacheConfig()
    assert kv.use_kv_cache_manager_v2 == "auto"
    assert (kv.tokens_per_block, kv.enable_block_reuse, kv.enable_partial_reuse) == (32, True, True)
    assert (kv.free_gpu_memory_fraction, kv.max_tokens, kv.max_gpu_total_bytes) == (0.9, None, 0)
    assert (kv.host_cache_size, kv.dtype, kv.max_util_for_resume) == (None, "auto", 0.95)
    assert (kv.enable_swa_scratch_reuse, kv.event_buffer_max_size) == (True, 0)  # kvload's default, not TRT-LLM's
    args = LlmArgs(model="m")
    assert (args.dtype, args.device, args.max_seq_len, args.max_beam_width) == ("auto", "auto", None, 1)


@pytest.mark.parametrize("value", [True, False])
def test_tristate_keeps_bools_by_identity(value):
    kv = structure({"use_kv_cache_manager_v2": value}, KvCacheConfig)
    assert kv.use_kv_cache_manager_v2 is value


@pytest.mark.parametrize("bad", ["invalid", "yes", 1, 0, None, "True", 1.0])
def test_tristate_rejects_everything_else_naming_the_path(bad):
    with pytest.raises(ConfigError) as err:
        structure({"model": "m", "kv_cache_config": {"use_kv_cache_manager_v2": bad}}, LlmArgs)
    assert str(err.value).startswith("kv_cache_config.use_kv_cache_manager_v2: expected true, false or \"auto\"")
    assert err.value.path == "kv_cache_config.use_kv_cache_manager_v2"


@pytest.mark.parametrize("bad", ["yes", 1, "auto", "true", None])
def test_plain_bools_are_strict(bad):
    with pytest.raises(ConfigError, match=r"^kv_cache_config\.enable_block_reuse: expected true or false"):
        structure({"model": "m", "kv_cache_config": {"enable_block_reuse": bad}}, LlmArgs)


def test_direct_construction_is_as_strict_as_structuring():
    with pytest.raises(ConfigError, match="enable_block_reuse: expected true or false, got 'yes'"):
        KvCacheConfig(enable_block_reuse="yes")
    kv = KvCacheConfig()
    with pytest.raises(ConfigError, match="tokens_per_block: expected an integer >= 1, got 0"):
        kv.tokens_per_block = 0


def test_direct_construction_refuses_an_unknown_keyword_with_the_closest_field():
    """DESIGN.md: unknown keys are errors with the closest known key suggested. A dict, the YAML file and plan()'s
    keywords said so; the classes the README shows constructed (``kvload.KvCacheConfig(...)``) raised Python's own
    TypeError, which names no field."""
    with pytest.raises(ConfigError, match=r"^tokens_per_blok: unknown key; did you mean 'tokens_per_block'\?$"):
        KvCacheConfig(tokens_per_blok=64)
    with pytest.raises(TypeError, match=r"^max_batch_siz: unknown key; did you mean 'max_batch_size'\?$"):
        LlmArgs(model="m", max_batch_siz=8)  # still a TypeError for code that caught Python's
    with pytest.raises(ConfigError, match=r"^zzzz: unknown key; known keys: use_kv_cache_manager_v2, tokens_per_bl"):
        KvCacheConfig(zzzz=1)
    # a TensorRT-LLM option a dict takes (setting_ignored) is not offered the kvload field it resembles
    with pytest.raises(ConfigError, match=r"^copy_on_partial_reuse: a TensorRT-LLM option kvload does not act on, "
                                          r"so KvCacheConfig has no such field; give it in kv_cache_config=\{\.\.\.\}"):
        KvCacheConfig(copy_on_partial_reuse=False)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"kv_cache_config": {"enable_blok_reuse": True}},
         "kv_cache_config.enable_blok_reuse: unknown key; did you mean 'enable_block_reuse'?"),
        ({"kv_cache_confg": {}}, "kv_cache_confg: unknown key; did you mean 'kv_cache_config'?"),
        ({"max_batchsize": 4}, "max_batchsize: unknown key; did you mean 'max_batch_size'?"),
        ({"kv_cache_config": {"tokens_per_block": 0}}, "kv_cache_config.tokens_per_block: expected an integer >= 1"),
        ({"kv_cache_config": {"free_gpu_memory_fraction": 1.5}},
         "kv_cache_config.free_gpu_memory_fraction: expected a number in (0, 1]"),
        ({"kv_cache_config": {"dtype": "int3"}}, "kv_cache_config.dtype: expected \"auto\" or one of"),
        ({"kv_cache_config": "big"}, "kv_cache_config: expected a mapping of KvCacheConfig fields, got 'big'"),
        ({"device": "tpu"}, "device: expected \"auto\", \"cpu\", \"cuda\" or \"cuda:N\" (N from 0 to 127), got 'tpu'"),
        ({"max_batch_size": True}, "max_batch_size: expected an integer >= 1, got true"),
        ({"kv_cache_config": {"host_cache_size": "lots"}}, "kv_cache_config.host_cache_size: expected a byte count"),
        *(({"kv_cache_config": {"max_page_padding": bad}}, "kv_cache_config.max_page_padding: expected a number in "
           "[0, 0.5): the share of a sequence's page bytes padded pages may leave unused")
          for bad in (0.5, -0.01, 1, True, "0.1", None, float("nan"))),
    ],
)
def test_errors_name_the_dotted_path(raw, message):
    with pytest.raises(ConfigError) as err:
        structure({"model": "m", **raw}, LlmArgs)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_an_empty_key_and_a_null_or_true_key_are_named_as_written(tmp_path):
    """An empty key vanished from its own line ("kv_cache_config: unknown key", blaming the parent), and a YAML key of
    null or true was said in Python's words (None, True)."""
    from pipeline.sources import read_yaml

    with pytest.raises(ConfigError) as err:
        structure({"model": "m", "kv_cache_config": {"": 1}}, LlmArgs)
    assert str(err.value).startswith("kv_cache_config.'': unknown key; known keys: use_kv_cache_manager_v2")
    for key, shown in (("null", "null"), ("true", "true"), ("~", "null"), ("1.5", "1.5")):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(f"kv_cache_config: {{{key}: 2}}\n")
        with pytest.raises(ConfigError) as err:
            read_yaml(str(cfg))
        assert str(err.value) == f"config file {cfg}: keys must be strings, got {shown}"


def test_a_key_holding_a_unicode_line_separator_is_refused_on_one_line(capsys, tmp_path):
    """A config key holding U+2028 (or U+2029) was printed raw in "unknown key": str.splitlines, JSON viewers and log
    shippers read two lines there. It is escaped as the control characters are."""
    from tests.cli_support import run_cli

    cfg = tmp_path / "c.yaml"
    for text, said in (('"a\\u2028b": 1\n', "a\\u2028b: unknown key"),
                       ('kv_cache_config: {"c\\u2029d": 1}\n', "kv_cache_config.c\\u2029d: unknown key")):
        cfg.write_text(text)
        r = run_cli(capsys, "plan", "tiny-llama", "--config", str(cfg))
        assert r.code == 2 and r.one_error_line, r.err
        assert len(r.err.splitlines()) == 1 and said in r.err, r.err


def test_unknown_key_without_a_close_match_lists_known_keys():
    with pytest.raises(ConfigError, match="zzzz: unknown key; known keys: model, dtype, device"):
        structure({"model": "m", "zzzz": 1}, LlmArgs)


@pytest.mark.parametrize(("raw", "message"), [
    ({"kv_cache_config": {1: 2}}, "kv_cache_config: expected a mapping of KvCacheConfig fields with string keys, "
                                  "got the key 1"),
    ({"kv_cache_config": {None: 2, "max_tokens": 8}}, "kv_cache_config: expected a mapping of KvCacheConfig "
                                                      "fields with string keys, got the key null"),
    ({"override_generation_config": {5: 0.5}}, "override_generation_config: expected a mapping of "
                                               "generation_config.json keys"),
])
def test_a_key_that_is_not_a_string_is_named_through_the_python_api(raw, message):
    """A YAML file's keys are checked as it is read; a Python dict's were not, and the unknown-key hint crashed
    comparing 1 with the field names: "parse_args: TypeError: 'int' object is not iterable"."""
    import pipeline

    with pytest.raises(ConfigError) as err:
        pipeline.plan("tiny-llama", log=False, **raw)
    assert str(err.value).startswith(message), str(err.value)


def test_missing_model_is_reported():
    with pytest.raises(ConfigError, match="^model: required"):
        structure({}, LlmArgs)


def test_explicit_fields_are_known_even_when_equal_to_the_default():
    kv = KvCacheConfig(enable_block_reuse=True, use_kv_cache_manager_v2="auto")
    assert explicit_fields(kv) == {"enable_block_reuse", "use_kv_cache_manager_v2"}
    kv.tokens_per_block = 32
    assert "tokens_per_block" in explicit_fields(kv)
    from_dict = structure({"model": "m", "kv_cache_config": {"tokens_per_block": 32}}, LlmArgs)
    assert explicit_fields(from_dict.kv_cache_config) == {"tokens_per_block"}
    assert explicit_fields(KvCacheConfig()) == frozenset()


def test_dtype_aliases_normalise_and_sizes_parse():
    kv = structure({"dtype": "bf16", "host_cache_size": "2GiB", "max_gpu_total_bytes": "1.5GB"}, KvCacheConfig)
    assert (kv.dtype, kv.host_cache_size, kv.max_gpu_total_bytes) == ("bfloat16", 2 * 1024**3, 1_500_000_000)
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError):
        parse_size("1.5B")


def test_a_size_in_decimal_or_exponent_form_is_read_exactly_and_must_be_whole_bytes():
    """Decimals and exponents went through float: 1e-400GiB underflowed to 0 and was taken (0 means no cap for
    max_gpu_total_bytes, no host tier for host_cache_size), 1.0000000000000000001KiB rounded to a whole 1024, and
    9.007199254740993e15 rounded to a neighbouring whole number. Read exactly, the first two are not whole bytes."""
    assert parse_size("9.007199254740993e15") == 9_007_199_254_740_993
    assert (parse_size("1.5KiB"), parse_size("1e3"), parse_size("0.5e1KB")) == (1536, 1000, 5000)
    for text in ("1e-400GiB", "1.0000000000000000001KiB", "1e999999999", "1e-999999999KiB"):
        with pytest.raises(ValueError):
            parse_size(text)


@pytest.mark.parametrize(("yaml_value", "says"), [
    ("1e9", "got the float 1000000000.0; YAML reads a number with an exponent or a decimal point as a float: write "
            "1000000000, or quote it"),
    ("2.0", "got the float 2.0; YAML reads a number with an exponent or a decimal point as a float: write 2, or "
            "quote it"),
    ("8.5", "got the float 8.5; a byte count is whole bytes"),
])
@pytest.mark.parametrize("field", ["max_gpu_total_bytes", "host_cache_size"])
def test_a_float_byte_count_in_a_config_file_says_what_to_write(capsys, tmp_path, field, yaml_value, says):
    """``--max_gpu_total_bytes 1e9`` and ``'1e9'`` in the file are 10**9 bytes, but YAML reads a bare 1e9 as a float:
    the line was "expected an integer >= 0, got 1000000000.0", naming neither the size forms taken nor why."""
    from tests.cli_support import run_cli

    config = tmp_path / "c.yaml"
    config.write_text(f"kv_cache_config:\n  {field}: {yaml_value}\n")
    r = run_cli(capsys, "plan", "tiny-llama", "--config", config)
    assert (r.code, r.out) == (2, "")
    assert r.err == (f"error: config file {config}: kv_cache_config.{field}: expected a byte count such as "
                     f"8589934592 or '8GiB', {says}\n")
    config.write_text(f"kv_cache_config:\n  {field}: '1e9'\n")  # quoted: a size, as the flag reads it
    assert run_cli(capsys, "plan", "tiny-llama", "--config", config).code == 0


@pytest.mark.parametrize("value", ["8GiB", "lots", 1e9, 1.5, -5, True, "1_0KiB"])
@pytest.mark.parametrize("field", ["max_gpu_total_bytes", "host_cache_size"])
def test_a_byte_count_is_one_rule_for_the_class_and_the_dict(field, value):
    """``KvCacheConfig(max_gpu_total_bytes="8GiB")`` was refused as "an integer >= 0" where the dict, YAML and CLI
    doors take it; and their errors named the size forms where the class's did not. Both doors now take the same
    values to the same bytes, and refuse the rest in the same words (the dict's prefixed by its path)."""
    try:
        direct: object = getattr(KvCacheConfig(**{field: value}), field)
    except ConfigError as exc:
        direct = str(exc)
    try:
        through: object = getattr(structure({field: value}, KvCacheConfig), field)
    except ConfigError as exc:
        through = str(exc)
    assert direct == through
    if value == "8GiB":
        assert direct == 8 * 2**30
        c = KvCacheConfig()
        setattr(c, field, "1GiB")  # assignment converts as construction does
        assert getattr(c, field) == 2**30
    elif value == "1_0KiB":
        assert direct == 10 * 1024
    elif value in ("lots", 1e9, 1.5):
        assert "expected a byte count such as 8589934592 or '8GiB'" in direct


def test_a_size_takes_an_underscore_only_between_two_digits_as_an_integer_does():
    """Every underscore was dropped before the number was read: "_8GiB", "8__GiB" and "8_GiB" were 8 GiB, where an
    integer flag, int() and a YAML number refuse them (--host_cache_size, --max_gpu_total_bytes, the config file's)."""
    assert (parse_size("1_024KiB"), parse_size("1_000"), parse_size("1_0.5e1KB")) == (1_048_576, 1000, 105_000)
    for text in ("_8GiB", "8__GiB", "8_GiB", "8_", "_", "1_.5KiB"):
        with pytest.raises(ValueError):
            parse_size(text)


def test_frozen_config_rejects_assignment_everywhere():
    args = freeze(LlmArgs(model="m"))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        args.dtype = "float16"
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        args.kv_cache_config.tokens_per_block = 64


def test_unstructure_round_trips_and_hides_bookkeeping():
    args = structure({"model": "m", "kv_cache_config": {"tokens_per_block": 64}}, LlmArgs)
    tree = unstructure(args)
    assert "_explicit" not in tree and "_explicit" not in tree["kv_cache_config"]
    assert structure(tree, LlmArgs) == args
