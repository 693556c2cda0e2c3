"""Stage 1: merge the user's sources (defaults < YAML file < CLI or Python), validate, build ``LlmArgs``; then fill
the fields neither source set that the caller derived a value for (``LoadRequest.caller_defaults``)."""

from __future__ import annotations

from typing import Any

from pipeline.bus import Emit
from pipeline.config import LlmArgs, framework_defaults, public_fields, set_field
from pipeline.context import Context, LoadRequest, UserValue
from pipeline.converter import structure
from pipeline.errors import ConfigError, close_names, did_you_mean
from pipeline.events import ArgsParsed, FieldDerived, SettingIgnored, SourceConflict
from pipeline.limits import short
from pipeline.paths import flatten, get_in, unflatten
from pipeline.sources import overrides_to_tree, read_yaml
from pipeline.trtllm_compat import split_ignored
from pipeline.vllm_compat import (
    ANSWERED_NAMES,
    DIFFERENT_MEANING,
    IGNORED,
    SAME_MEANING,
    hf_overrides,
    reasoning_parser_named,
    take_same_meaning,
)

#: vLLM's ``convert`` (``task``) value that acts: a causal LM made a classifier (``models.classifier.CONVERT_CLASSIFY``;
#: not imported, this stage loads nothing of models/)
CONVERT_CLASSIFY = "classify"

#: ``convert`` / ``task`` values that choose a conversion other than ``classify`` (``auto`` and ``score`` choose none)
_NOT_CLASSIFY = {"convert": ("none", "embed"), "task": ("generate", "embed")}

_PLACEHOLDER_MODEL = "<model>"


def _contradict(key: str, value: Any, other: str, theirs: Any) -> bool:
    """Whether ``key``'s ``value`` and ``other``'s ``theirs`` (``convert`` and ``task``) choose two conversions: one
    ``classify``, the other one that is not."""
    def says(k: str, v: Any) -> str | None:
        if v == CONVERT_CLASSIFY:
            return CONVERT_CLASSIFY
        return "other" if isinstance(v, str) and v in _NOT_CLASSIFY[k] else None

    return {says(key, value), says(other, theirs)} == {CONVERT_CLASSIFY, "other"}


class ParseArgs:
    """Builds ``ctx.args`` and ``ctx.user_values``; one ``args_parsed`` per user leaf, in source order."""

    name = "parse_args"
    error = ConfigError

    def run(self, ctx: Context, emit: Emit) -> None:
        """Validate each source alone (so errors name it), then merge and emit the changes."""
        req = ctx.request
        sources: list[tuple[str, dict[str, Any]]] = []
        if req.config_file is not None:  # "" is a mistake to report, not "no file"
            sources.append(("config_file", req.config if req.config is not None else read_yaml(req.config_file)))
        tree = overrides_to_tree(req.overrides)
        if req.model is not None:
            tree = {"model": req.model, **tree}
        given_as: dict[str, str] = {}  # field -> the vLLM keyword it was given as (max_model_len for max_seq_len)
        if req.source == "api":  # vLLM's LLM(...) keywords of kvload's fields; YAML keeps one name per field
            try:
                tree, given_as = take_same_meaning(tree)
            except ConfigError as exc:
                raise ConfigError(str(exc), path=exc.path, detail=exc.detail, source=req.source) from None
        sources.append((req.source, tree))
        sources = [(label, self._take_hf_overrides(ctx, label, tree, req.config_file, emit)) for label, tree in sources]
        sources = self._take_convert(ctx, sources, emit, req.config_file)
        if req.reasoning_parsers:
            sources = self._take_reasoning_parser(ctx, sources, req.reasoning_parsers, req.config_file, emit)
        sources = [(label, self._drop_ignored(label, tree, req.config_file, emit)) for label, tree in sources]

        # Normalised leaves per source (e.g. dtype "bf16" -> "bfloat16"), checked one source at a time.
        checked = [(label, self._check(label, tree, req.config_file, req if label == "api" else None))
                   for label, tree in sources]

        merged: dict[str, UserValue] = {}
        for label, leaves in checked:
            for path, value in leaves.items():
                merged[path] = UserValue(value, label)
        if "model" not in merged:
            raise ConfigError("model: required (a preset name or a checkpoint directory)", path="model")
        ctx.args = structure(unflatten({p: v.value for p, v in merged.items()}), LlmArgs)

        current = flatten(framework_defaults())
        seen: dict[str, UserValue] = {}
        for label, leaves in checked:
            for path, value in leaves.items():
                earlier = seen.get(path)
                if earlier is not None and earlier.value != value:
                    emit(SourceConflict(field=path, kept=value, kept_source=label,
                                        overridden=earlier.value, overridden_source=earlier.source))
                alias = given_as.get(path) if label == req.source else None
                emit(ArgsParsed(field=path, old=current.get(path), new=value, source=label, given_as=alias))
                current[path] = value
                seen[path] = UserValue(value, label)
        ctx.user_values = merged
        # a value generate / serve / LLM derived is not the user's: it fills a field only the framework default
        # (null) holds, and the audit says who derived it and from what
        for path, derived in req.caller_defaults.items():
            old = get_in(ctx.args, path)  # null, or the framework default an over_default caller fills over
            if path in merged or (old is not None and not derived.over_default):
                continue
            set_field(ctx.args, path, derived.value)
            emit(FieldDerived(field=path, old=old, new=derived.value, source=derived.source, reason=derived.reason))

    @staticmethod
    def _take_hf_overrides(ctx: Context, label: str, tree: Any, config_file: str | None, emit: Emit) -> Any:
        """Take vLLM's ``hf_overrides`` out of a source's tree into ``ctx.hf_overrides`` (a later source's key wins,
        reported as a ``source_conflict`` on ``hf_overrides.<key>``); ``apply_model_defaults`` lays them over the
        checkpoint's config."""
        if not isinstance(tree, dict) or "hf_overrides" not in tree:
            return tree
        rest = dict(tree)
        try:
            given = hf_overrides(rest.pop("hf_overrides"))
        except ConfigError as exc:
            where = f"config file {config_file}: " if label == "config_file" else ""
            raise ConfigError(f"{where}{exc}", path=exc.path, detail=exc.detail, source=label) from None
        for key, value in given.items():
            earlier = ctx.hf_overrides.get(key)
            if earlier is not None and earlier.value != value:
                emit(SourceConflict(field=f"hf_overrides.{key}", kept=value, kept_source=label,
                                    overridden=earlier.value, overridden_source=earlier.source))
            ctx.hf_overrides[key] = UserValue(value, label)
        return rest

    @staticmethod
    def _take_convert(ctx: Context, sources: list[tuple[str, Any]], emit: Emit,
                      config_file: str | None = None) -> list[tuple[str, Any]]:
        """Take vLLM's ``convert="classify"`` (and ``task="classify"``, which vLLM maps to it for a generative model)
        out of the sources' trees into ``ctx.convert``: ``apply_model_defaults`` makes a causal LM a classifier, or
        says the setting ignored for a classifier. A later source's other value wins (a ``source_conflict``) and stays
        a vLLM knob, whether it comes under the same key or the other one: ``task`` and ``convert`` both choose what
        the model is converted to, so a file's ``task: classify`` yields to the command line's ``--convert none`` (one
        ``source_conflict`` on ``convert`` whose ``overridden_field`` is ``task``). One source giving both a classify
        and another conversion is refused, as is ``classify`` with a runner or task ``generate`` (vLLM has no
        conversion for its generate runner, ``_RUNNER_CONVERTS["generate"]`` is empty: a classifier pools)."""
        taken: list[tuple[str, Any]] = []
        last: dict[str, UserValue] = {}  # convert / task / runner -> the last source's value
        for label, tree in sources:
            if not isinstance(tree, dict):
                taken.append((label, tree))
                continue
            rest = dict(tree)
            if "convert" in rest and "task" in rest and "generate" not in (rest["task"], rest["convert"]) \
                    and _contradict("convert", rest["convert"], "task", rest["task"]):
                ck, ok = ("convert", "task") if rest["convert"] == CONVERT_CLASSIFY else ("task", "convert")
                where = f"config file {config_file}: " if label == "config_file" else ""
                raise ConfigError(f"{where}{ck}: {CONVERT_CLASSIFY!r} makes a classifier and {ok} "
                                  f"{short(rest[ok])} (from {label}) does not; both choose what the model is "
                                  "converted to (task is vLLM's older spelling of convert): give one", path=ck,
                                  source=label)
            for key in ("convert", "task", "runner"):
                if key not in rest:
                    continue
                value = rest[key]
                earlier = last.get(key)
                if key != "runner" and earlier is not None and CONVERT_CLASSIFY in (earlier.value, value) \
                        and earlier.value != value:
                    # the other leaf of the conflict never reaches the merge (one of them is popped here)
                    emit(SourceConflict(field=key, kept=value, kept_source=label, overridden=earlier.value,
                                        overridden_source=earlier.source))
                other = {"convert": "task", "task": "convert"}.get(key)
                theirs = last.get(other) if other is not None else None
                if theirs is not None and theirs.source != label and _contradict(key, value, other, theirs.value):
                    # the other key said the opposite in a weaker source: this one wins, the other says nothing more
                    emit(SourceConflict(field=key, kept=value, kept_source=label, overridden=theirs.value,
                                        overridden_source=theirs.source, overridden_field=other))
                    del last[other]
                last[key] = UserValue(value, label)
                if key != "runner" and value == CONVERT_CLASSIFY:
                    rest.pop(key)
            taken.append((label, rest))
        classify = [key for key in ("convert", "task") if key in last and last[key].value == CONVERT_CLASSIFY]
        if classify:
            generate = [key for key in ("task", "runner") if key in last and last[key].value == "generate"]
            if generate:
                key, other = classify[0], generate[0]
                raise ConfigError(f"{key}: {CONVERT_CLASSIFY!r} makes a classifier, which pools, and {other} "
                                  f"{last[other].value!r} (from {last[other].source}) does not pool; drop one (runner "
                                  "'pooling' or 'auto' with convert 'classify')", path=key,
                                  source=last[key].source)
            ctx.convert = (classify[-1], last[classify[-1]])
        return taken

    @staticmethod
    def _take_reasoning_parser(ctx: Context, sources: list[tuple[str, Any]], names: tuple[str, ...],
                               config_file: str | None, emit: Emit) -> list[tuple[str, Any]]:
        """Take ``reasoning_parser`` out of the sources' trees into ``ctx.reasoning_parser`` for a caller that acts on
        it (``kvload.LLM``, ``kvload generate`` and ``serve``); a later source's other value wins (a
        ``source_conflict``). A null is no parser named; TensorRT-LLM's spelling of one (``deepseek-r1``) is taken as
        kvload's name (``pipeline.vllm_compat.REASONING_PARSER_ALIASES``), so the audit names it so."""
        taken: list[tuple[str, Any]] = []
        for label, tree in sources:
            if not isinstance(tree, dict) or "reasoning_parser" not in tree:
                taken.append((label, tree))
                continue
            rest = dict(tree)
            given = rest.pop("reasoning_parser")
            value = reasoning_parser_named(given) if given is not None else None
            if given is not None and value not in names:
                detail = f"expected one of {', '.join(names)} (or null), got {short(given)}"
                where = f"config file {config_file}: " if label == "config_file" else ""
                raise ConfigError(f"{where}reasoning_parser: {detail}", path="reasoning_parser", detail=detail,
                                  source=label)
            earlier = ctx.reasoning_parser
            if value is not None:
                if earlier is not None and earlier.value != value:
                    emit(SourceConflict(field="reasoning_parser", kept=value, kept_source=label,
                                        overridden=earlier.value, overridden_source=earlier.source))
                ctx.reasoning_parser = UserValue(value, label)
            taken.append((label, rest))
        return taken

    @staticmethod
    def _drop_ignored(label: str, tree: dict[str, Any], config_file: str | None, emit: Emit) -> dict[str, Any]:
        """Take out TensorRT-LLM keys kvload does not act on; one ``setting_ignored`` (a warning) for each."""
        try:
            # the command line's and LLM(...)'s names are vLLM's where both have one (--load-format); a YAML file's
            # TensorRT-LLM's (extra_llm_api_options)
            kept, ignored = split_ignored(tree, python=label == "api", vllm_first=label in ("cli", "api"))
        except ConfigError as exc:
            where = f"config file {config_file}: " if label == "config_file" else ""
            raise ConfigError(f"{where}{exc}", path=exc.path, detail=exc.detail, source=label) from None
        for path, value, reason in ignored:
            emit(SettingIgnored(field=path, value=value, reason=f"{reason} (from {label})"))
        return kept

    @staticmethod
    def _check(label: str, tree: dict[str, Any], config_file: str | None,
               call: LoadRequest | None = None) -> dict[str, Any]:
        """Validate one source's tree; return its leaves with values as the args will hold them. ``call``: the
        Python call's request, whose own keywords (``load_weights``) are offered for an unknown top-level key nearest
        one of them, and a keyword of another public call is named as that call's."""
        probe = tree if "model" in tree else {**tree, "model": _PLACEHOLDER_MODEL}
        try:
            args = structure(probe, LlmArgs)
        except ConfigError as exc:
            where = f"config file {config_file}: " if label == "config_file" else ""
            message, detail = str(exc), exc.detail
            key = exc.path or ""
            if call is not None and key and "." not in key and str(detail).startswith("unknown key"):
                others = call.other_call_keywords
                known = [a.name for a in public_fields(LlmArgs)] + list(call.call_keywords) + list(others)
                near = close_names(key, known + list(VLLM_KEYWORDS))
                if key in others:  # plan(..., load_weights=True): was "known keys: <the fields>"
                    detail = f"unknown key; {_whose(key, call)}"
                    message = f"{key}: {detail}"
                elif any(name in call.call_keywords or name in others for name in near):
                    detail = f"unknown key{did_you_mean(key, known)}"  # load_weight: was "known keys: <the fields>"
                    foreign = [_whose(name, call) for name in near if name in others]
                    detail += f" ({'; '.join(foreign)})" if foreign else ""
                    message = f"{key}: {detail}"
                elif near and all(name in VLLM_KEYWORDS for name in near):
                    # a typo of a vLLM name LLM(...) takes (max_num_seq): the fields alone offered another setting
                    # (max_num_tokens) or the whole list
                    detail = f"unknown key{did_you_mean(key, near)} ({'; '.join(_vllm_note(n) for n in near)})"
                    message = f"{key}: {detail}"
            raise ConfigError(f"{where}{message}", path=exc.path, detail=detail, source=label) from None
        return {path: get_in(args, path) for path in flatten(tree)}


#: vLLM's engine argument names a Python call answers to (acts on, reports ignored, or refuses naming kvload's
#: setting): offered for a mistyped keyword nearest one of them, as kvload's own fields are
VLLM_KEYWORDS = frozenset({*ANSWERED_NAMES, "trust_remote_code", "hf_overrides"})


def _vllm_note(name: str) -> str:
    """What kvload does with vLLM's ``name``, in a few words, after the suggestion of it."""
    if name in SAME_MEANING:
        return f"vLLM's name for {SAME_MEANING[name]}"
    if name in DIFFERENT_MEANING:
        return f"vLLM's name, refused naming kvload's setting ({', '.join(DIFFERENT_MEANING[name][2])})"
    if name in IGNORED or name == "trust_remote_code":
        return f"vLLM's {name}, taken and reported setting_ignored"
    return f"vLLM's {name}"


def _whose(keyword: str, call: LoadRequest) -> str:
    """``keyword`` named as the keyword of the other public calls that take it, not of ``call``'s."""
    return (f"{keyword!r} is a keyword of {call.other_call_keywords[keyword]}"
            + (f", not of {call.call_name}" if call.call_name else ""))
