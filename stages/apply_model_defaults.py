"""Stage 3: read the checkpoint, pick its ``ModelSpec``, and apply model defaults the user did not set."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from models import GenericDecoderSpec, load_hf_config, resolve_checkpoint, spec_class_for
from models.classifier import (
    architecture_of,
    check_score_head,
    classifier_kind,
    converted_config,
    convertible,
    token_head_tokens,
    unserved_classifier,
)
from pipeline.bus import Emit
from pipeline.config import AUTO, LlmArgs, framework_defaults, freeze, set_field
from pipeline.context import Context, ModelInfo
from pipeline.converter import structure
from pipeline.errors import ConfigError, ModelError, did_you_mean
from pipeline.events import (
    HfConfigOverridden,
    ModelConverted,
    ModelDefaultApplied,
    ModelDefaultSkipped,
    ModelResolved,
    ModelSpecFallback,
    SettingIgnored,
)
from pipeline.generation_config import FROM_DO_SAMPLE, FROM_FILE, FROM_OVERRIDE, resolve_sampling_defaults
from pipeline.paths import flatten, get_in, unflatten

#: The fields a model may propose. Memory limits, the device and the model itself are the
#: operator's; beam width is a serving decision.
MODEL_SETTABLE: frozenset[str] = frozenset({
    "dtype",
    "max_seq_len",
    "max_num_tokens",
    "max_batch_size",
    "kv_cache_config.use_kv_cache_manager_v2",
    "kv_cache_config.tokens_per_block",
    "kv_cache_config.enable_block_reuse",
    "kv_cache_config.enable_partial_reuse",
    "kv_cache_config.dtype",
    "kv_cache_config.max_util_for_resume",
    "kv_cache_config.enable_swa_scratch_reuse",
    "kv_cache_config.event_buffer_max_size",
})


def validate_model_defaults(proposed: Any, spec_name: str) -> dict[str, Any]:
    """Check a spec's returned dict; return its leaves by dotted path. Errors name the class and key."""
    where = f"{spec_name}.get_model_defaults"
    if not isinstance(proposed, Mapping):
        raise ModelError(f"{where}: must return a dict, got {type(proposed).__name__}")
    known = flatten(framework_defaults())
    leaves = flatten(proposed)
    for path, value in leaves.items():
        if path not in known:
            raise ModelError(f"{where}: unknown key '{path}'{did_you_mean(path, known)}")
        if path not in MODEL_SETTABLE:
            raise ModelError(f"{where}: key '{path}' may not be set by a model (it is the user's to decide)")
        if value == AUTO:
            raise ModelError(f"{where}: key '{path}': a model default must be concrete, got \"auto\"")
    try:
        structure({**unflatten(leaves), "model": "<model>"}, LlmArgs)
    except ConfigError as exc:
        raise ModelError(f"{where}: key '{exc.path}': {exc.detail}") from None
    return leaves


#: The keys transformers' ``get_text_config`` (and kvload's geometry, for ``text_config``) read a model's
#: decoder or encoder config from
_TEXT_CONFIG_NAMES = ("text_config", "decoder", "generator", "text_encoder")


def _check_text_config_names(config: Any, values: dict[str, Any], sources: dict[str, str]) -> None:
    """Refuse a value for a text-config key the model has no nested config under: vLLM would set it as a plain key,
    and then transformers and kvload would read it as the model's text config (a dict with no geometry)."""
    from models.hf_overrides import _is_config

    for key in _TEXT_CONFIG_NAMES:
        if values.get(key) is not None and not _is_config(getattr(config, key, None)):
            where = f"hf_overrides.{key}"
            raise ConfigError(f"{where}: {type(config).__name__} has no nested {key}, and transformers would read "
                              f"this value as the model's text config; set its keys at the top level of hf_overrides",
                              path=where, detail="not a nested config of this model", source=sources.get(key))


class ApplyModelDefaults:
    """Writes ``ctx.checkpoint``, ``ctx.hf_config``, ``ctx.spec``, ``ctx.model``, ``ctx.model_defaults`` and
    ``ctx.sampling_defaults`` (the model's generation_config.json: the defaults of the requests it will serve)."""

    name = "apply_model_defaults"
    error = ModelError

    def run(self, ctx: Context, emit: Emit) -> None:
        """Resolve the checkpoint and spec, then apply each proposed leaf unless the user set it."""
        checkpoint = resolve_checkpoint(ctx.args.model)
        hf_config = load_hf_config(checkpoint)
        if ctx.hf_overrides:  # vLLM's hf_overrides: before anything reads the config, as vLLM applies them
            hf_config = self._override(ctx, checkpoint, hf_config, emit)
        if ctx.convert is not None:  # vLLM's convert="classify": after hf_overrides, as vLLM adapts the model class
            hf_config = self._convert(ctx, checkpoint, hf_config, emit)
        unserved = unserved_classifier(hf_config)
        if unserved is not None:  # before the generic spec reads it as a decoder and the load misses its lm_head
            raise ModelError(f"{checkpoint.path / 'config.json'}: {unserved}")
        archs = getattr(hf_config, "architectures", None) or []
        arch = archs[0] if archs else None
        spec_cls = spec_class_for(arch) if arch else None
        if spec_cls is None:
            spec_cls = GenericDecoderSpec
            what = f"architecture {arch!r} has no registered spec" if arch else "config.json names no architectures"
            emit(ModelSpecFallback(architecture=arch or "", spec=spec_cls.__name__,
                                   reason=f"{what}; using the generic decoder spec (geometry from the config, "
                                          "no model defaults)"))
        spec = spec_cls(hf_config)
        try:
            spec.kv_layers()  # a model whose geometry kvload cannot read fails here, before any default applies
        except ModelError as exc:
            generic = " (no registered spec; the generic decoder spec read the config)" \
                if spec_cls is GenericDecoderSpec else ""
            given = f" (with hf_overrides {', '.join(ctx.hf_overrides)} applied)" if ctx.hf_overrides else ""
            raise ModelError(f"{checkpoint.path / 'config.json'}{given}: {exc}{generic}") from None
        if token_head_tokens(hf_config) is not None and checkpoint.kind == "preset":  # checked before any load
            raise ModelError(f"classifier_from_token: {checkpoint.name} is a preset, with random weights and no "
                             "tokenizer to look the tokens up in; give a checkpoint directory")
        ctx.checkpoint, ctx.hf_config, ctx.spec = checkpoint, hf_config, spec
        ctx.model = ModelInfo(
            name=checkpoint.name, kind=checkpoint.kind, path=str(checkpoint.path), architecture=spec.architecture,
            model_type=str(getattr(hf_config, "model_type", "")), spec=spec.name,
            v2_required=spec.v2_required_reason(),
        )
        emit(ModelResolved(model=checkpoint.name, kind=checkpoint.kind, path=str(checkpoint.path),
                           architecture=spec.architecture, model_type=ctx.model.model_type, spec=spec.name))

        view = freeze(copy.deepcopy(ctx.args))  # models read the args; they never write them
        leaves = validate_model_defaults(spec.get_model_defaults(view), spec.name)
        ctx.model_defaults = leaves
        framework = flatten(framework_defaults())
        for path, value in leaves.items():
            current = get_in(ctx.args, path)
            user = ctx.user_fields.get(path)
            if user is not None:
                why = ("the user set \"auto\" explicitly; resolve_auto lets the model decide"
                       if user.value == AUTO else f"the user set it ({user.source}); an explicit value always wins")
                emit(ModelDefaultSkipped(field=path, proposed=value, kept=current, kept_source=user.source,
                                         spec=spec.name, reason=why))
                continue
            switched = ctx.request.caller_defaults.get(path) if ctx.request is not None else None
            if (switched is not None and switched.over_default and current == switched.value
                    and value == framework[path]):
                # the caller turned the setting on for a switch the user gave (vLLM's enable_kv_cache_events): the
                # model's framework default would turn it off again, the user's switch losing to a model default
                emit(ModelDefaultSkipped(field=path, proposed=value, kept=current, kept_source=switched.source,
                                         spec=spec.name, reason=f"{switched.reason}; the model's {value!r} would "
                                                                "turn it off"))
                continue
            set_field(ctx.args, path, value)
            emit(ModelDefaultApplied(field=path, old=current, new=get_in(ctx.args, path), source="model_default",
                                     spec=spec.name))
        self._sampling_defaults(ctx, emit)

    @staticmethod
    def _override(ctx: Context, checkpoint: Any, hf_config: Any, emit: Emit) -> Any:
        """The checkpoint's config with ``ctx.hf_overrides`` set on it; one ``hf_config_overridden`` per key set."""
        from models.config_view import takes_overrides, transformers_config
        from models.hf_overrides import apply_overrides, check_overridden

        values = {key: given.value for key, given in ctx.hf_overrides.items()}
        # a preset's light view takes plain int/bool keys itself (a plan imports no transformers; the weights'
        # config gets them from the view); anything else needs transformers' config: nested configs, its checks
        config = hf_config if takes_overrides(hf_config, values) else transformers_config(hf_config)
        sources = {key: given.source for key, given in ctx.hf_overrides.items()}
        _check_text_config_names(config, values, sources)
        before = config.to_dict()
        done_all = apply_overrides(config, values, sources)
        check_overridden(before, config.to_dict(), sources)  # before anything sizes a model from them
        for done in done_all:
            emit(HfConfigOverridden(key=done.key, old=done.old, new=done.new, added=done.added,
                                    source=sources[done.key.split(".", 1)[0]], model=checkpoint.name))
        return config

    @staticmethod
    def _convert(ctx: Context, checkpoint: Any, hf_config: Any, emit: Emit) -> Any:
        """vLLM's ``convert="classify"`` (``as_seq_cls_model``): a causal LM's config read as its
        ``*ForSequenceClassification``, its weights' ``score.weight`` checked before any load (one
        ``model_converted``); a classifier already is left as it is (``setting_ignored``); anything else is refused."""
        key, given = ctx.convert
        architecture = architecture_of(hf_config)
        kind = classifier_kind(hf_config)
        if kind is not None:
            what = "*ForSequenceClassification" if kind == "sequence" else "*ForTokenClassification"
            emit(SettingIgnored(field=key, value=given.value,
                                reason=f"the checkpoint is a classifier already ({architecture}): a "
                                       f"{what} one classifies as it is, as vLLM leaves a pooling "
                                       f"model unconverted (from {given.source})"))
            return hf_config
        convertible(hf_config, key)  # refuses an architecture kvload does not classify, importing nothing
        if checkpoint.kind == "preset" or checkpoint.gguf_file:  # before converted_config imports transformers
            what = "a preset, with random weights" if checkpoint.kind == "preset" else "a GGUF file, a language model"
            raise ModelError(f"{key}: {given.value!r}: {checkpoint.name} is {what} and no classifier head "
                             "(score.weight) to load; give a checkpoint directory whose weights carry score.weight")
        config = converted_config(hf_config, key)
        if token_head_tokens(config) is None:  # the head comes from the weights, not from two tokens of lm_head
            check_score_head(checkpoint.path, config, key)
        emit(ModelConverted(given_as=key, value=given.value, old=architecture, new=architecture_of(config),
                            source=given.source, model=checkpoint.name))
        return config

    @staticmethod
    def _sampling_defaults(ctx: Context, emit: Emit) -> None:
        """The model's sampling defaults (vLLM's --generation-config): not LlmArgs values, so no value event; one
        ``sampling_defaults_resolved`` says which file gave which values, and what did not apply and why."""
        setting = ctx.user_fields.get("generation_config")
        override = [v.source for p, v in ctx.user_fields.items() if p.startswith("override_generation_config.")]
        defaults = resolve_sampling_defaults(
            ctx.args.generation_config, ctx.args.override_generation_config, ctx.checkpoint.path,
            model=ctx.checkpoint.name, setting_source=setting.source if setting is not None else None,
            override_source=override[-1] if override else None)
        ctx.sampling_defaults = defaults
        emit(defaults.event())
        for path, value, why in greedy_default_inert(ctx, defaults):
            emit(SettingIgnored(field=path, value=value, reason=why))


#: The sampling defaults that change nothing while the default temperature is 0 (greedy), with their no-op values.
_SAMPLING_ONLY_DEFAULTS = (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0))


def greedy_default_inert(ctx: Context, defaults: Any) -> list[tuple[str, Any, str]]:
    """``(field, value, why)`` for each ``override_generation_config`` key the user set that greedy decoding leaves
    unused: top_p, top_k or min_p while the default temperature is 0 (kvload's own, or do_sample false). It acts, in
    part: only on a request that asks for a temperature above 0 and leaves that key unset."""
    values, sources = defaults.values, defaults.sources
    if values.get("temperature", 0.0) != 0:
        return []
    by = {FROM_DO_SAMPLE: "do_sample is false", FROM_FILE: "the generation_config.json's temperature 0",
          FROM_OVERRIDE: "override_generation_config's temperature 0"}.get(sources.get("temperature", ""),
                                                                          "kvload's built-in default")
    advice = "" if sources.get("temperature") == FROM_DO_SAMPLE else (
        " (override_generation_config.temperature sets a sampled default)")
    out = []
    for key, unset in _SAMPLING_ONLY_DEFAULTS:
        path = f"override_generation_config.{key}"
        value = values.get(key)
        if path not in ctx.user_fields or value is None or value == unset or (key == "top_k" and value < 0):
            continue
        out.append((path, value, f"in part: the default temperature is 0 (greedy, {by}), so a request that takes "
                                 f"the defaults samples nothing and {key} changes none of its tokens; it applies to "
                                 f"a request that asks for a temperature above 0 and leaves {key} unset{advice}"))
    return out
