"""Stages 1–5 end to end through the Python API: the "auto" decision, model defaults, routing."""

from __future__ import annotations

import pytest

import pipeline
from pipeline import ConfigError, KvCacheConfig, ModelError, RouteError

V2 = "kv_cache_config.use_kv_cache_manager_v2"


def resolved(result):
    return result.args.kv_cache_config.use_kv_cache_manager_v2


@pytest.mark.parametrize("explicit_auto", [False, True])
def test_deepseek_v4_auto_resolves_to_v2_and_says_so(log, explicit_auto):
    kw = {"kv_cache_config": {"use_kv_cache_manager_v2": "auto"}} if explicit_auto else {}
    result = pipeline.plan("tiny-deepseek-v4", **kw)
    assert resolved(result) is True
    assert (result.route.kv_manager, result.route.scheduler) == ("KVCacheManagerV2", "KVCacheV2Scheduler")
    # The bug this project exists to prevent: the resolution is logged even though the model default
    # (implicit case) already replaced "auto" before resolve_auto ran.
    assert log.has("auto_resolved", field=V2, original="auto", new=True, source="model_default", level="info")
    assert log.has("auto_captured", field=V2, original="auto", explicit=explicit_auto)
    if explicit_auto:
        assert log.has("model_default_skipped", field=V2, proposed=True, kept="auto", kept_source="api")
    else:
        assert log.has("model_default_applied", field=V2, old="auto", new=True, spec="DeepseekV4Spec")
    assert result.args.kv_cache_config.tokens_per_block == 128
    assert result.args.kv_cache_config.enable_swa_scratch_reuse is True


def test_deepseek_v4_explicit_false_is_a_route_error_that_says_why(log):
    with pytest.raises(RouteError, match=r"use_kv_cache_manager_v2=false \(set by the user via api\).*compressed"):
        pipeline.plan("tiny-deepseek-v4", kv_cache_config=KvCacheConfig(use_kv_cache_manager_v2=False))
    assert log.has("stage_failed", stage="route_executor", error="RouteError")


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3", "tiny-deepseek-v3", "tiny-mistral", "tiny-qwen3"])
def test_models_without_a_v2_default_resolve_false(log, preset):
    result = pipeline.plan(preset)
    assert resolved(result) is False
    assert (result.route.kv_manager, result.route.scheduler) == ("KVCacheManager", "GuaranteedNoEvictScheduler")
    assert log.has("auto_resolved", field=V2, original="auto", old="auto", new=False, source="auto")


@pytest.mark.parametrize(("model_value", "user_value"), [(True, False), (False, True)])
def test_explicit_user_value_beats_the_model_default_both_ways(log, spec_with_defaults, model_value, user_value):
    ckpt = spec_with_defaults({"kv_cache_config": {"use_kv_cache_manager_v2": model_value}})
    result = pipeline.plan(str(ckpt), kv_cache_config={"use_kv_cache_manager_v2": user_value})
    assert resolved(result) is user_value
    assert log.has("model_default_skipped", field=V2, proposed=model_value, kept=user_value, kept_source="api")
    assert not log.has("auto_resolved", field=V2)  # it never was "auto"


@pytest.mark.parametrize("model_value", [True, False])
def test_model_default_decides_auto_in_both_directions(spec_with_defaults, model_value):
    ckpt = spec_with_defaults({"kv_cache_config": {"use_kv_cache_manager_v2": model_value}})
    result = pipeline.plan(str(ckpt), log=False)
    assert resolved(result) is model_value


@pytest.mark.parametrize(("field", "model_value"), [("dtype", "float16"), ("kv_cache_config.dtype", "bfloat16"),
                                                     (V2, True), (V2, False)])
def test_an_explicit_auto_lets_the_model_default_decide_as_unset_does(log, spec_with_defaults, field, model_value):
    # dtype: "auto" skipped the model's float16 (the user set the field) and then resolved as if the model had
    # proposed nothing (float32 from the CPU rule), where the field left unset got float16
    *parent, leaf = field.split(".")
    ckpt = spec_with_defaults({parent[0]: {leaf: model_value}} if parent else {leaf: model_value})
    unset = pipeline.plan(str(ckpt), log=False)
    auto = pipeline.plan(str(ckpt), **({parent[0]: {leaf: "auto"}} if parent else {leaf: "auto"}))
    assert pipeline.converter.unstructure(auto.args) == pipeline.converter.unstructure(unset.args)
    assert pipeline.paths.get_in(auto.args, field) == model_value
    assert log.has("model_default_skipped", field=field, proposed=model_value, kept="auto", kept_source="api")
    assert log.has("auto_resolved", field=field, original="auto", old="auto", new=model_value, source="model_default")


@pytest.mark.parametrize(
    ("defaults", "message"),
    [
        ({"kv_cache_config": {"tokens_per_blok": 64}}, "unknown key 'kv_cache_config.tokens_per_blok'"),
        ({"kv_cache_config": {"tokens_per_block": "big"}}, "key 'kv_cache_config.tokens_per_block': expected an int"),
        ({"kv_cache_config": {"use_kv_cache_manager_v2": "yes"}}, "key 'kv_cache_config.use_kv_cache_manager_v2'"),
        ({"device": "cpu"}, "key 'device' may not be set by a model"),
        ({"kv_cache_config": {"max_gpu_total_bytes": 1}}, "key 'kv_cache_config.max_gpu_total_bytes' may not be set"),
        ({"kv_cache_config": {"use_kv_cache_manager_v2": "auto"}}, "must be concrete"),
        (["not", "a", "dict"], "must return a dict, got list"),
    ],
)
def test_bad_model_defaults_name_the_model_class_and_key(spec_with_defaults, defaults, message):
    ckpt = spec_with_defaults(defaults)
    with pytest.raises(ModelError) as err:
        pipeline.plan(str(ckpt), log=False)
    assert str(err.value).startswith("TestSpec.get_model_defaults: ")
    assert message in str(err.value)


def test_v2_from_model_default_falls_back_for_beam_search(log, spec_with_defaults):
    ckpt = spec_with_defaults({"kv_cache_config": {"use_kv_cache_manager_v2": True}})
    result = pipeline.plan(str(ckpt), max_beam_width=4)
    assert resolved(result) is False
    assert result.route.kv_manager == "KVCacheManager" and result.route.fallback
    assert log.has("route_fallback", field=V2, old=True, new=False, source="route", level="warning")


def test_user_v2_with_beam_search_is_a_route_error():
    with pytest.raises(RouteError, match=r"=true \(set by the user via api\) cannot serve beam search"):
        pipeline.plan("tiny-llama", max_beam_width=2, kv_cache_config={"use_kv_cache_manager_v2": True}, log=False)


def test_v2_required_model_cannot_fall_back_for_beams():
    with pytest.raises(RouteError, match="max_beam_width=2: DeepseekV4ForCausalLM has compressed"):
        pipeline.plan("tiny-deepseek-v4", max_beam_width=2, log=False)


def test_resolved_args_are_frozen_after_routing():
    import attrs

    result = pipeline.plan("tiny-llama", log=False)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        result.args.kv_cache_config.use_kv_cache_manager_v2 = True


def test_every_auto_field_resolves_with_a_reason(log):
    result = pipeline.plan("tiny-llama")
    assert result.args.device == "cpu" and result.args.dtype == "float32"
    assert result.args.kv_cache_config.dtype == "float32"
    fields = [e["field"] for e in log.events if e["event"] == "auto_resolved"]
    assert fields == ["device", "dtype", "kv_cache_config.dtype", V2, "attention_backend",
                      "linear_backend", "generation_config", "kv_cache_config.pool_arena"]
    assert all(e["reason"] for e in log.events if e["event"] == "auto_resolved")
    assert log.has("field_derived", field="max_seq_len", new=8192, source="checkpoint")


BEYOND = "max_seq_len_beyond_positions"


def test_a_user_max_seq_len_past_the_positions_is_kept_with_one_warning(log):
    """vLLM refuses a max_model_len past the model's positions without an override; kvload keeps it and says so."""
    result = pipeline.plan("tiny-llama", max_seq_len=16384)
    assert result.args.max_seq_len == 16384
    [event] = [e for e in log.events if e["event"] == BEYOND]
    assert event["level"] == "warning" and event["stage"] == "resolve_auto"
    assert (event["field"], event["max_seq_len"], event["max_position_embeddings"]) == ("max_seq_len", 16384, 8192)
    assert (event["source"], event["model"], event["rope_scaling"]) == ("api", "tiny-llama", None)
    assert event["config"].endswith("tiny-llama/config.json")
    assert "declares no rope scaling" in event["reason"] and "lower max_seq_len to 8192" in event["reason"]
    assert [e["seq"] for e in result.audit.of(BEYOND)] == [event["seq"]]  # the audit log has it, once
    assert not log.has("field_derived", field="max_seq_len")


@pytest.mark.parametrize("max_seq_len", [None, 1024, 8192])
def test_a_max_seq_len_within_the_positions_does_not_warn(log, max_seq_len):
    pipeline.plan("tiny-llama", max_seq_len=max_seq_len)
    assert not log.has(BEYOND)


def test_a_model_default_past_the_positions_does_not_warn(spec_with_defaults):
    """Only the user's value is checked: a model's default is the model's own word on its context."""
    ckpt = spec_with_defaults({"max_seq_len": 4096})  # the test checkpoint declares 1024 positions
    result = pipeline.plan(str(ckpt), log=False)
    assert result.args.max_seq_len == 4096 and result.audit.of(BEYOND) == []


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_the_warning_names_the_rope_scaling_the_config_declares(checkpoint_dir, key):
    """transformers 5 writes rope_parameters; older files (most published configs) hold rope_scaling."""
    rope = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    ckpt = checkpoint_dir(**{key: rope})
    result = pipeline.plan(str(ckpt), max_seq_len=4096, log=False)
    [event] = result.audit.of(BEYOND)
    assert event["max_position_embeddings"] == 1024 and event["config"] == str(ckpt / "config.json")
    assert event["rope_scaling"]["rope_type"] == "linear" and event["rope_scaling"]["factor"] == 4.0
    assert "declares rope scaling (linear, factor 4.0)" in event["reason"]


def test_a_rope_scaling_of_one_layer_type_is_named_with_it():
    """Gemma 3 scales the positions of its full-attention layers only (rope_scaling per layer type)."""
    from pathlib import Path

    gemma = Path(__file__).parent / "data" / "configs" / "gemma-3-27b-it"
    result = pipeline.plan(str(gemma), max_seq_len=262144, log=False)
    [event] = result.audit.of(BEYOND)
    assert event["max_position_embeddings"] == 131072
    assert "rope scaling (full_attention: linear, factor 8.0)" in event["reason"]


def test_checkpoint_dtype_wins_over_the_cpu_default(checkpoint_dir):
    result = pipeline.plan(str(checkpoint_dir(dtype="bfloat16")), log=False)
    assert result.args.dtype == "bfloat16"
    assert result.audit.provenance("dtype")[-1]["source"] == "checkpoint"


@pytest.mark.parametrize("declared", ["float64", "int4", "float8_e4m3fn"])
def test_a_checkpoint_dtype_kvload_cannot_run_falls_back_and_says_what_was_declared(checkpoint_dir, declared):
    """Not "the checkpoint declares no dtype" (it does), and not a refusal of a dtype field the user never set."""
    result = pipeline.plan(str(checkpoint_dir(dtype=declared)), log=False)
    assert result.args.dtype == "float32"  # the CPU default, as for a checkpoint that declares none
    (event,) = [e for e in result.audit.of("auto_resolved") if e["field"] == "dtype"]
    assert f"declares dtype {declared}" in event["reason"] and "no dtype" not in event["reason"]
    assert "float32, float16, bfloat16" in event["reason"]


def test_a_checkpoint_directory_may_be_a_path_object(checkpoint_dir):
    """os.PathLike, as from_pretrained takes it: a pathlib.Path was refused as 'expected a preset name or a
    checkpoint directory, got PosixPath(...)' although it names one."""
    ckpt = checkpoint_dir()
    by_path = pipeline.plan(ckpt, log=False)
    assert by_path.args.model == str(ckpt) and by_path.model.architecture == "LlamaForCausalLM"
    assert by_path.audit.replay() == pipeline.plan(str(ckpt), log=False).audit.replay()


def test_unknown_architecture_uses_the_generic_spec_with_a_warning(log, checkpoint_dir):
    result = pipeline.plan(str(checkpoint_dir("MysteryForCausalLM")))
    assert result.model.spec == "GenericDecoderSpec"
    assert log.has("model_spec_fallback", architecture="MysteryForCausalLM", level="warning")
    assert resolved(result) is False


def test_user_registered_spec_is_used(spec_with_defaults):
    ckpt = spec_with_defaults({"kv_cache_config": {"tokens_per_block": 16}}, arch="MyOwnForCausalLM")
    result = pipeline.plan(str(ckpt), log=False)
    assert result.model.spec == "TestSpec"
    assert result.args.kv_cache_config.tokens_per_block == 16


def test_user_stage_can_be_inserted():
    seen = {}

    class Peek:
        name = "peek"

        def run(self, ctx, emit):
            seen["v2"] = ctx.args.kv_cache_config.use_kv_cache_manager_v2

    stages = pipeline.plan_stages()
    stages.insert(3, Peek())  # after apply_model_defaults, before resolve_auto
    result = pipeline.plan("tiny-deepseek-v4", stages=stages, log=False)
    assert seen["v2"] is True
    assert [e["stage"] for e in result.audit.of("stage_started")][3] == "peek"


def test_stage_names_given_for_stages_are_refused_naming_the_entry_and_what_is_accepted():
    # README: "pass stages=[...]"; a list of the names the audit shows ("parse_args", ...) was refused with "every
    # stage needs a non-empty string 'name'", naming neither the entry nor what a stage is
    for stages, got in ((["parse_args"], "got the string 'parse_args', a name"),
                        ([*pipeline.plan_stages()[:2], None], "got null (no non-empty string 'name')")):
        with pytest.raises(TypeError) as caught:
            pipeline.plan("tiny-llama", stages=stages, log=False)
        index = len(stages) - 1
        assert str(caught.value) == (f"stages[{index}]: expected a stage object (a non-empty string 'name' and "
                                     "run(ctx, emit); kvload's own: pipeline.plan_stages(), or from stages import "
                                     f"ParseArgs, ...), {got}")


def test_model_errors_are_one_clear_line(tmp_path):
    with pytest.raises(ModelError, match="not a preset or a directory; presets: tiny-deepseek-v3"):
        pipeline.plan("no-such-model", log=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="directory has no config.json"):
        pipeline.plan(str(tmp_path / "empty"), log=False)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ModelError, match=r"config.json: malformed JSON at line 1"):
        pipeline.plan(str(bad), log=False)


def test_bad_override_is_a_config_error():
    with pytest.raises(ConfigError, match="^kv_cache_config.enable_block_reuse: expected true or false, got 'yes'"):
        pipeline.plan("tiny-llama", kv_cache_config={"enable_block_reuse": "yes"}, log=False)


@pytest.mark.parametrize("argument", ["config_file", "audit_log"])
@pytest.mark.parametrize("value", [5, b"serve.yaml", ["a.yaml"]])
def test_a_path_argument_of_the_wrong_type_is_a_config_error_naming_it(argument, value):
    """Not Python's bare TypeError ('expected str, bytes or os.PathLike object, not int'), which names no argument."""
    with pytest.raises(ConfigError, match=f"^{argument}: expected a path") as info:
        pipeline.plan("tiny-llama", log=False, **{argument: value})
    assert str(info.value).endswith(f"got {value!r}")


@pytest.mark.parametrize("value", ["no", 0, None])
def test_log_takes_true_or_false_only(value):
    # log="no" is truthy: it used to print the event lines it was meant to silence
    with pytest.raises(ConfigError, match=f"^log: expected true or false, got {value!r}$"):
        pipeline.plan("tiny-llama", log=value)
