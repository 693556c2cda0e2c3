"""``plan`` of a preset with ``hf_overrides`` of any plain kind (a float, a string, a bool, a list, vLLM's usual
``rope_theta``) reads the preset's light config view: no torch, no transformers imported, the same plan, the same
events and the same one-line refusals naming ``hf_overrides.<key>`` as through transformers' config."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

import kvload
from pipeline.errors import ConfigError
from tests.cli_support import imports_after

#: (preset, overrides) of each plain kind a launch line or a script gives
PLAIN = [
    ("tiny-llama", {"rope_theta": 1000000.0}),  # vLLM's commonest: carried into rope_parameters
    ("tiny-llama", {"rope_theta": 500000}),  # an int, as JSON writes a round number
    ("tiny-llama", {"rms_norm_eps": 1e-5, "hidden_act": "gelu"}),
    ("tiny-qwen3", {"attention_dropout": 0.1, "tie_word_embeddings": False}),
    ("tiny-gemma3", {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
                     "hidden_activation": "gelu"}),
    ("tiny-deepseek-v4", {"compress_rope_theta": 20000.0, "scoring_func": "sigmoid"}),
]


@pytest.mark.parametrize(("preset", "given"), PLAIN)
def test_a_preset_plan_with_plain_overrides_of_any_kind_imports_neither_torch_nor_transformers(preset, given):
    """Before: any float, string or list override (and rope_theta, a key the config keeps in rope_parameters) built
    transformers' config, importing torch: 3 s of a 0.4 s plan."""
    loaded = imports_after(f"""
        from kvload.cli.entry import main
        assert main(["plan", {preset!r}, "--hf-overrides", {json.dumps(given)!r}, "--device", "cpu",
                     "--max_tokens", "4096"]) == 0
    """)
    assert loaded == {"torch": False, "transformers": False}


def _both(monkeypatch, preset, given):
    """``plan`` through the light view and through transformers' config, each a result or its ConfigError; the first
    must build no transformers config."""
    import models.config_view

    built = []
    real_config = models.config_view.transformers_config
    monkeypatch.setattr(models.config_view, "transformers_config", lambda cfg: built.append(cfg) or real_config(cfg))
    out = []
    for light in (True, False):
        if not light:
            assert built == []  # the light view answered alone
            monkeypatch.setattr(models.config_view, "takes_overrides", lambda cfg, overrides: False)
        try:
            out.append(kvload.plan(preset, log=False, hf_overrides=copy.deepcopy(given)))
        except ConfigError as exc:
            out.append(exc)
    return out


@pytest.mark.parametrize(("preset", "given"), PLAIN)
def test_the_light_view_plans_as_transformers_config_would(monkeypatch, preset, given):
    from models.config_view import ConfigView

    light, real = _both(monkeypatch, preset, given)
    assert isinstance(light.context.hf_config, ConfigView) and not isinstance(real.context.hf_config, ConfigView)
    events = [[{k: e[k] for k in ("key", "old", "new", "added")} for e in r.audit.of("hf_config_overridden")]
              for r in (light, real)]
    assert events[0] == events[1] and len(events[0]) == len(given)
    assert light.args == real.args and light.kv.layout == real.kv.layout


REFUSED = [
    ("tiny-llama", {"rms_norm_eps": -1.0}, "hf_overrides.rms_norm_eps: expected a number in (0, 1]"),
    ("tiny-llama", {"rope_theta": -5.0}, "hf_overrides.rope_theta: expected a number > 0"),
    ("tiny-gemma3", {"rope_theta": 1000.0}, "hf_overrides.rope_theta: transformers' Gemma3TextConfig keeps "
                                            "rope_theta per layer type in rope_parameters"),
    ("tiny-llama", {"hidden_act": "nosuch"}, "hf_overrides.hidden_act: 'nosuch' is not an activation transformers "
                                             "has; accepted: "),
    # the layer types named in one order either way (the light view said "(compress, main)", transformers' config
    # "(main, compress)")
    ("tiny-deepseek-v4", {"rope_theta": 1000.0}, "hf_overrides.rope_theta: transformers' DeepseekV4Config keeps "
                                                 "rope_theta per layer type in rope_parameters (compress, main); "
                                                 "override rope_parameters instead"),
]


@pytest.mark.parametrize(("preset", "given", "message"), REFUSED)
def test_a_refusal_is_the_same_one_line_either_way(monkeypatch, preset, given, message):
    light, real = _both(monkeypatch, preset, given)
    assert isinstance(light, ConfigError) and isinstance(real, ConfigError)
    assert str(light) == str(real) and str(light).startswith(message) and "\n" not in str(light)
    assert light.path == real.path and light.path.startswith("hf_overrides")


def test_a_refused_value_that_needs_no_name_list_imports_nothing_heavy():
    loaded = imports_after("""
        from kvload.cli.entry import main
        assert main(["plan", "tiny-gemma3", "--hf-overrides", '{"rope_theta": 1000.0}']) == 2
        assert main(["plan", "tiny-llama", "--hf-overrides", '{"rms_norm_eps": -1.0}']) == 2
    """)
    assert loaded == {"torch": False, "transformers": False}


def test_what_the_light_view_takes_transformers_config_takes_and_names_as_it_does():
    """Each preset field the view admits a value of its own kind for is a plain field of transformers' class: no
    alias, no property, a type hint that takes any value of that kind (no Literal), one validator (the type's)."""
    from transformers.activations import ACT2FN

    from models.checkpoint import load_hf_config, presets, resolve_checkpoint
    from models.config_check import KNOWN_ACTIVATIONS
    from models.config_view import _ROPE_CARRIED, takes_overrides, transformers_config

    assert set(ACT2FN) >= KNOWN_ACTIVATIONS
    for preset in presets():
        view = load_hf_config(resolve_checkpoint(preset))
        real = transformers_config(view)
        assert view.transformers_class_name == type(real).__name__
        hints = {f.name: str(f.type) for f in dataclasses.fields(type(real))}
        for key, value in view.to_dict().items():
            if not takes_overrides(view, {key: value}):
                continue
            assert key not in real.attribute_map and not hasattr(getattr(type(real), key, None), "__set__"), key
            assert len(getattr(real, "__validators__", {}).get(key, ())) <= 1, (preset, key)
            assert "Literal" not in hints.get(key, ""), (preset, key)
            probe = copy.deepcopy(real)
            setattr(probe, key, copy.deepcopy(value))
            assert getattr(probe, key) == value and type(getattr(probe, key)) is type(value), (preset, key)
        for key in _ROPE_CARRIED:
            if takes_overrides(view, {key: 1.0}) and key not in view.to_dict():
                assert not hasattr(type(real), key), (preset, key)  # a plain attribute there, carried by kvload
