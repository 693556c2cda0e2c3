"""vLLM's ``hf_overrides`` laid over a checkpoint's config, as vLLM does before anything reads the config.

vLLM (``vllm/config/model.py``) sets each key on the transformers config, recursing into a nested config
(``text_config``) given an object; any other value replaces the key's whole value (a ``rope_scaling`` object too).
kvload does the same on the config ``apply_model_defaults`` reads, so the spec, the KV geometry, the model
defaults (``max_seq_len`` from ``max_position_embeddings``) and the weights all follow it; each key set is one
``hf_config_overridden`` event. The values were checked as JSON data by ``pipeline.vllm_compat.hf_overrides``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, NamedTuple

from pipeline.errors import ConfigError, ModelError, first_line
from pipeline.limits import short


class Override(NamedTuple):
    """One config key an override set: its dotted key, the value before (None where ``added``) and after."""

    key: str
    old: Any
    new: Any
    added: bool


_MISSING = object()

#: Keys transformers 5 reads from ``rope_parameters`` once a config is built (``standardize_rope_params`` moved them
#: there): set alone, the model would not see them
_INTO_ROPE_PARAMETERS = ("rope_theta", "partial_rotary_factor")


def _into_rope_parameters(config: Any, key: str, value: Any, where: str, source: str | None, current: Any) -> Any:
    """Carry ``key`` into the config's ``rope_parameters``, where the rotary embedding reads it; the value it had
    there (``current`` where it had none). ``ConfigError`` when they are kept per layer type (Gemma 3's local and
    global thetas), where one value is ambiguous (the layer types named sorted: the light view's config.json and
    transformers' built config hold them in different orders)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):  # an older config reads the key itself
        return current
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ConfigError(f"{where}: transformers' {config_class_name(config)} keeps {key} per layer type in "
                          f"rope_parameters ({', '.join(sorted(params))}); override rope_parameters instead",
                          path=where, detail="per layer type", source=source)
    config.rope_parameters = {**params, key: copy.deepcopy(value)}
    return params.get(key, current)


def config_class_name(config: Any) -> str:
    """The name of transformers' config class of ``config`` (a light view names the class it stands for)."""
    named = getattr(config, "transformers_class_name", None)
    return named if isinstance(named, str) else type(config).__name__


def _is_config(value: Any) -> bool:
    """Whether ``value`` is a nested transformers config (``text_config``), which an object recurses into."""
    return hasattr(value, "to_dict") and hasattr(value, "model_type") and not isinstance(value, Mapping)


def _plain(value: Any) -> Any:
    """A config value as the audit records it: a nested config as its dict, anything else as it is."""
    return value.to_dict() if _is_config(value) else copy.deepcopy(value)


def apply_overrides(config: Any, overrides: Mapping[str, Any], sources: Mapping[str, str] | None = None,
                    prefix: str = "") -> list[Override]:
    """Set each of ``overrides`` on the transformers ``config`` (in place); the keys set, in order.

    ``ConfigError`` naming ``hf_overrides.<key>`` (``source`` from ``sources``) for a key that names a method of the
    config, or a value its class refuses to take."""
    done: list[Override] = []
    for key, value in overrides.items():
        dotted = f"{prefix}{key}"
        where = f"hf_overrides.{dotted}"
        source = (sources or {}).get(dotted.split(".", 1)[0])
        current = getattr(config, key, _MISSING)
        if _is_config(current) and isinstance(value, Mapping):
            done += apply_overrides(current, value, sources, f"{dotted}.")
            continue
        if callable(current) and not _is_config(current):
            raise ConfigError(f"{where}: names a method of transformers' {config_class_name(config)}, not a config key",
                              path=where, detail="not a config key", source=source)
        try:
            setattr(config, key, copy.deepcopy(value))
        except Exception as exc:  # a property without a setter, a strict config's own check
            raise ConfigError(f"{where}: transformers' {config_class_name(config)} does not take {short(value)}: "
                              f"{first_line(exc)}", path=where, detail="cannot be set",
                              source=source) from None
        if key in _INTO_ROPE_PARAMETERS:
            current = _into_rope_parameters(config, key, value, where, source, current)
        added = current is _MISSING
        done.append(Override(dotted, None if added else _plain(current), _plain(getattr(config, key)), added))
    return done


def check_overridden(before: Mapping[str, Any], after: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """``ConfigError`` naming ``hf_overrides.<field>`` when the overridden config (``after``, its ``to_dict()``) has a
    KV-geometry field a ``config.json`` could not have (``models.config_check``'s ranges): transformers takes
    ``num_hidden_layers: 1e9`` (kvload then built a billion layer records, a hang), ``vocab_size: 0`` or
    ``sliding_window: -1`` and fails later naming neither. A problem the config had before (``before``) is not the
    overrides'."""
    from models.config_check import KNOWN_ACTIVATIONS, activations, check_fields

    act = after.get("hidden_act")
    if isinstance(act, str) and act != before.get("hidden_act") and act not in KNOWN_ACTIVATIONS:
        accepted = activations()
        if act not in accepted:  # transformers failed the weights' load as "'nosuch'", naming nothing
            raise ConfigError(f"hf_overrides.hidden_act: {short(act)} is not an activation transformers has; "
                              f"accepted: {', '.join(accepted)}", path="hf_overrides.hidden_act",
                              detail="unknown activation", source=sources.get("hidden_act"))
    try:
        check_fields(after, "hf_overrides", sep=".")
    except ModelError as exc:
        message = str(exc)
        try:
            check_fields(before, "hf_overrides", sep=".")
        except ModelError as old:
            if str(old) == message:  # the checkpoint's own, already taken when it loaded
                return
        field = message.split(": ", 1)[0]
        source = sources.get(field.removeprefix("hf_overrides.").split(".", 1)[0])
        raise ConfigError(message, path=field if field != "hf_overrides" else "hf_overrides",
                          detail=message.split(": ", 1)[-1], source=source) from None
