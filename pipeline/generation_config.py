"""The sampling defaults a model's creators publish in ``generation_config.json`` (vLLM's ``--generation-config``).

Llama 3.1 ships temperature 0.6 and top_p 0.9, Qwen top_k 20 and repetition_penalty 1.05; vLLM applies them to
every request that leaves them unset, and so does kvload, saying so. :func:`resolve_sampling_defaults` reads the
file (plain JSON: no transformers, so ``plan`` stays quick), lays the user's ``override_generation_config`` over it,
and returns what applies, where each value came from, and what does not apply and why; ``apply_model_defaults``
records that as one ``sampling_defaults_resolved`` event.

The keys taken are vLLM's (``ModelConfig.get_diff_sampling_param``): temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens as ``SamplingParams.max_tokens``; a null value is no value. Every other key
(``eos_token_id``, ``num_beams``, ...) is no sampling default: the event lists them as ``other_keys``.

``do_sample`` is read as transformers reads it, where vLLM ignores it. ``false`` means greedy whatever the file's
temperature says (transformers' ``generate`` then warns that temperature/top_p "are only used in sample-based
generation modes"): the file's temperature, top_p, top_k and min_p are not applied (each listed in ``not_applied``)
and the default temperature is 0. Ignoring it, as vLLM does, would sample from a model whose author asked for greedy
decoding, and kvload's own default is greedy. ``true`` with no temperature anywhere means transformers' temperature
1.0 (vLLM's default too), not kvload's greedy 0: Gemma 3 publishes ``do_sample: true, top_k: 64, top_p: 0.95``
only. Absent, the keys apply as written. ``repetition_penalty`` and ``max_new_tokens`` act on greedy decoding too,
so ``do_sample`` never drops them. ``override_generation_config`` is the user's: its keys always apply, and its
``do_sample`` decides for the file's keys.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

from models.checkpoint import read_generation_config, read_json_object
from models.user_paths import expand_user
from pipeline.config import GENERATION_CONFIG_AUTO, GENERATION_CONFIG_NONE, GenerationDefaults, public_fields
from pipeline.converter import structure
from pipeline.errors import ConfigError, ModelError
from pipeline.events import SamplingDefaultsResolved
from pipeline.text import literal

#: generation_config.json key -> the SamplingParams field it is the default of (vLLM's list and renaming).
SAMPLING_KEYS: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
#: The key ``do_sample: false`` takes out of the file's defaults: its temperature (greedy decoding is temperature 0).
#: top_p, top_k and min_p stay: they do nothing while greedy, and a request that asks for a temperature samples with
#: them, as transformers' ``generate(do_sample=True, ...)`` does over such a file.
SAMPLING_ONLY = ("temperature",)
#: What ``generation_config`` accepts, for error lines.
ACCEPTED = (f'"{GENERATION_CONFIG_AUTO}" (the checkpoint\'s generation_config.json), "{GENERATION_CONFIG_NONE}" '
            "(ignore it: kvload's built-in sampling defaults) or a directory holding a generation_config.json")
#: The labels of ``SamplingDefaults.sources``.
FROM_FILE, FROM_OVERRIDE, FROM_DO_SAMPLE = "generation_config.json", "override_generation_config", "do_sample"


@attrs.frozen
class SamplingDefaults:
    """The sampling defaults of a load: ``values`` are ``SamplingParams`` fields that a request leaving them unset
    takes (an explicit ``SamplingParams``, a set flag or a sent field wins); empty: kvload's built-in defaults."""

    setting: str = GENERATION_CONFIG_AUTO  # generation_config as the args hold it
    path: str | None = None  # the generation_config.json read, when one was
    values: dict[str, Any] = attrs.field(factory=dict)
    sources: dict[str, str] = attrs.field(factory=dict)  # field -> FROM_FILE, FROM_OVERRIDE or FROM_DO_SAMPLE
    not_applied: dict[str, str] = attrs.field(factory=dict)  # file key -> why it is not a default
    other_keys: tuple[str, ...] = ()  # the file's keys that are no sampling defaults
    reason: str = "kvload's built-in sampling defaults"

    def describe(self, source: str | None = None) -> str:
        """``temperature 0.6, top_p 0.9`` (empty when there are none); ``source``: only those from there."""
        return ", ".join(f"{name} {literal(value)}" for name, value in self.values.items()
                         if source is None or self.sources.get(name) == source)

    def event(self) -> SamplingDefaultsResolved:
        """The ``sampling_defaults_resolved`` record of these defaults."""
        return SamplingDefaultsResolved(generation_config=self.setting, path=self.path, defaults=dict(self.values),
                                        sources=dict(self.sources), not_applied=dict(self.not_applied),
                                        other_keys=list(self.other_keys), reason=self.reason)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``plan --json``)."""
        return {"generation_config": self.setting, "path": self.path, "defaults": dict(self.values),
                "sources": dict(self.sources), "not_applied": dict(self.not_applied),
                "other_keys": list(self.other_keys), "reason": self.reason}


def _given(config: GenerationDefaults) -> dict[str, Any]:
    """The keys of a GenerationDefaults that hold a value (null is no value)."""
    return {a.name: getattr(config, a.name) for a in public_fields(GenerationDefaults)
            if getattr(config, a.name) is not None}


def _locate(setting: str, model_dir: Path | None, source: str | None) -> tuple[Path | None, dict[str, Any] | None]:
    """The file ``setting`` names and its contents (None, None: no file to read)."""
    if setting == GENERATION_CONFIG_NONE:
        return None, None
    if setting == GENERATION_CONFIG_AUTO:
        if model_dir is None:
            return None, None
        data = read_generation_config(model_dir)  # the eos_token_id checks every load of the checkpoint runs
        return (model_dir / "generation_config.json", data) if data is not None else (None, None)
    given = expand_user(setting)

    def refused(problem: str) -> ConfigError:
        detail = f"{problem}; accepted: {ACCEPTED}"
        return ConfigError(f"generation_config: {detail}", path="generation_config", detail=detail, source=source)

    try:
        is_dir = given.is_dir()
    except OSError as exc:  # a name too long, a directory that cannot be searched
        raise refused(f"{setting!r}: cannot read ({exc.strerror or type(exc).__name__})") from None
    file = given / "generation_config.json" if is_dir else given
    if not os.path.lexists(file):
        raise refused(f"{setting!r}: the directory holds no generation_config.json" if is_dir
                      else f"{setting!r}: no such directory")
    return file.absolute(), read_json_object(file, "a generation config")


def resolve_sampling_defaults(setting: str, override: GenerationDefaults, model_dir: Path | None, *,
                              model: str = "the model", setting_source: str | None = None,
                              override_source: str | None = None) -> SamplingDefaults:
    """The sampling defaults ``generation_config`` (``setting``) and ``override_generation_config`` give a model
    whose checkpoint directory is ``model_dir`` (None: it has none). ``ConfigError`` for a ``setting`` that names
    nothing usable or an override that contradicts itself, ``ModelError`` naming the file and key for a file value
    ``SamplingParams`` would refuse."""
    file, data = _locate(setting, model_dir, setting_source)
    own: dict[str, Any] = {}
    others: tuple[str, ...] = ()
    if data is not None:
        picked = {key: data[key] for key in (*SAMPLING_KEYS, "do_sample") if key in data}
        try:
            own = _given(structure(picked, GenerationDefaults))
        except ConfigError as exc:  # in SamplingParams' words, naming the file and the key
            raise ModelError(f"{file}: {exc.path}: {exc.detail}") from None
        others = tuple(sorted(k for k in data if k not in SAMPLING_KEYS and k != "do_sample"))
    users = _given(override)
    if users.get("do_sample") is False and users.get("temperature", 0) != 0:
        detail = (f"do_sample false asks for greedy decoding, temperature {literal(users['temperature'])} for "
                  "sampling; give one")
        raise ConfigError(f"override_generation_config: {detail}", path="override_generation_config",
                          detail=detail, source=override_source)

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    not_applied: dict[str, str] = {}
    do_sample = users.get("do_sample", own.get("do_sample"))
    said = "override_generation_config" if "do_sample" in users else "the file"
    for key, field in SAMPLING_KEYS.items():
        if key in users:
            values[field], sources[field] = users[key], FROM_OVERRIDE
            if key in own:
                not_applied[key] = f"override_generation_config gives {literal(users[key])}"
        elif key in own:
            if do_sample is False and key in SAMPLING_ONLY:
                not_applied[key] = f"do_sample is false in {said} (transformers then decodes greedily)"
            else:
                values[field], sources[field] = own[key], FROM_FILE
    if "temperature" not in values:
        if do_sample is False:
            values["temperature"], sources["temperature"] = 0.0, FROM_DO_SAMPLE
        elif do_sample is True:  # transformers' (and vLLM's) temperature when sampling; kvload's own is 0
            values["temperature"], sources["temperature"] = 1.0, FROM_DO_SAMPLE
    values = {f: values[f] for f in SAMPLING_KEYS.values() if f in values}  # one order, the table's
    sources = {f: sources[f] for f in values}
    return SamplingDefaults(setting=setting, path=str(file) if file is not None else None, values=values,
                            sources=sources, not_applied=not_applied, other_keys=others,
                            reason=_reason(setting, file, model, values, sources, do_sample, said, bool(users)))


def _reason(setting: str, file: Path | None, model: str, values: dict[str, Any], sources: dict[str, str],
            do_sample: bool | None, said: str, overridden: bool) -> str:
    """One sentence: where the defaults came from, and how to turn them off."""
    under = " under override_generation_config" if overridden and values else ""
    if setting == GENERATION_CONFIG_NONE:
        head = (f'generation_config is "{GENERATION_CONFIG_NONE}": {model}\'s generation_config.json is not read; '
                f"kvload's built-in sampling defaults apply{under}")
    elif file is None:
        head = f"{model} has no generation_config.json: kvload's built-in sampling defaults apply{under}"
    elif not values:
        head = f"{file} holds no sampling defaults: kvload's built-in ones apply"
    else:
        head = (f"{file}{under}: the defaults of every request that leaves a setting unset (an explicit "
                f"SamplingParams, a flag given or a field sent wins); generation_config \"{GENERATION_CONFIG_NONE}\" "
                "ignores the file")
    if sources.get("temperature") == FROM_DO_SAMPLE and do_sample is False:
        head += f"; do_sample is false in {said}: greedy (temperature 0)"
    elif sources.get("temperature") == FROM_DO_SAMPLE:
        head += (f"; do_sample is true in {said}: temperature 1.0 where none is given (transformers' and "
                 "vLLM's)")
    return head


__all__ = ["ACCEPTED", "FROM_DO_SAMPLE", "FROM_FILE", "FROM_OVERRIDE", "SAMPLING_KEYS", "SamplingDefaults",
           "resolve_sampling_defaults"]
