"""What travels through the stages: the request, the args being resolved, and each stage's outputs."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs

from pipeline.config import LlmArgs


@attrs.frozen
class UserValue:
    """One leaf the user provided: the value as given, and which input gave it."""

    value: Any
    source: str  # "cli" | "config_file" | "api"


@attrs.frozen
class AutoOrigin:
    """A field captured as ``"auto"`` before any stage could touch it."""

    explicit: bool
    source: str  # where the "auto" came from: "default" or the user's source


#: the field generate, serve and ``kvload.LLM`` derive a value for (the pools' size when nothing else bounds them)
DEFAULT_MAX_TOKENS_FIELD = "kv_cache_config.default_max_tokens"


@attrs.frozen
class CallerDefault:
    """A value a front end derived for a field the user did not set, with who derived it and from what."""

    value: Any
    source: str  # who derived it: "generate", "serve", "LLM"
    reason: str  # from what, in the caller's words (named by errors about what it sized)
    #: for a token count: the sequences it is for, so the pools never exceed that many of the resolved max_seq_len
    #: (a huge max_new_tokens cannot outgrow max_seq_len, which the checkpoint may set only after the caller ran)
    sequences: int | None = None
    #: fill the field over its framework default, not only over null: a caller that needs a setting on (``serve
    #: --kv-events-config`` needs ``event_buffer_max_size``, whose default 0 is off) when the user left it unset
    over_default: bool = False


def keywords_of(call: Callable[..., Any]) -> tuple[str, ...]:
    """The keyword-only parameters of ``call``: a Python entry point's own (``load_weights``), beside the
    ``**overrides`` of LlmArgs fields (:attr:`LoadRequest.call_keywords`)."""
    return tuple(name for name, p in inspect.signature(call).parameters.items() if p.kind is p.KEYWORD_ONLY)


#: The public Python calls that take LlmArgs fields as keywords beside their own, by the name errors give them, with
#: those own keywords (``kvload.api``'s signatures, held alike by tests/test_did_you_mean.py). Kept here, below the
#: layers that define the calls, so that a call of a lower layer (``engine.simulator.simulate``) can name a keyword of
#: one without importing it.
PUBLIC_CALL_KEYWORDS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "kvload.plan()": ("config_file", "audit_log", "subscribers", "stages", "log"),
    "kvload.load()": ("config_file", "load_weights", "audit_log", "subscribers", "stages", "log"),
    "kvload.LLM()": ("config_file", "audit_log", "subscribers", "log", "seed"),
})


def other_call_keywords(own: Sequence[str]) -> dict[str, str]:
    """The keywords of the public calls (:data:`PUBLIC_CALL_KEYWORDS`) that a call whose own keywords are ``own``
    does not take, each with the calls that do (``"kvload.plan() and kvload.load()"``):
    :attr:`LoadRequest.other_call_keywords`."""
    others: dict[str, list[str]] = {}
    for name, keywords in PUBLIC_CALL_KEYWORDS.items():
        for keyword in keywords:
            if keyword not in own:
                others.setdefault(keyword, []).append(name)
    return {keyword: " and ".join(names) for keyword, names in others.items()}


@attrs.define
class LoadRequest:
    """The raw inputs of one run, before anything is validated."""

    model: str | None
    overrides: dict[str, Any] = attrs.Factory(dict)
    source: str = "api"  # label of ``overrides``: "api" from Python, "cli" from the command line
    config_file: str | None = None
    #: ``config_file``'s contents when the caller read them already (``kvload generate`` sizes its pools from the
    #: file's max_seq_len): parse_args takes them rather than reading the file a second time, which a file changed in
    #: between would answer differently
    config: dict[str, Any] | None = None
    load_weights: bool = False
    # Values the caller derived for fields the user may leave null (generate and serve size the pools from their
    # own flags, ``kvload.LLM`` has a CPU default): dotted path -> CallerDefault. Not user input: parse_args
    # applies one only where neither the config file nor the overrides set the field, as ``field_derived``; an
    # error about pools too big names its ``reason`` (the caller's flags), not a field the user never set.
    caller_defaults: dict[str, CallerDefault] = attrs.Factory(dict)
    #: The Python call's own keywords beside the LlmArgs fields (``load``'s ``load_weights``, ``config_file``, ``log``):
    #: an unknown key nearest one of them is suggested it (``load_weight``), where the fields alone offered nothing.
    call_keywords: tuple[str, ...] = ()
    #: The keywords of the other public calls that this one does not take, each with the calls that do (``plan``'s
    #: ``load_weights``: ``"kvload.load()"``), and this call's name (``"kvload.plan()"``): such a key is refused
    #: saying whose keyword it is, not with the list of LlmArgs fields it is none of.
    other_call_keywords: Mapping[str, str] = attrs.Factory(dict)
    call_name: str = ""
    # Whether the caller may read the KV cache events of what it loads (``LoadResult.kv_cache_events()``, serve's
    # endpoint and --kv-events-file). False (kvload run, generate): a user's event_buffer_max_size is reported
    # as setting_ignored and no buffer is kept, since nothing would ever drain it.
    kv_events_reader: bool = True
    #: Whether the caller generates through what it loads (``kvload generate``, ``kvload serve``, ``kvload.LLM``):
    #: a model whose attention kvload cannot run is then refused before its weights load (seconds, gigabytes).
    generates: bool = False
    #: The reasoning parsers the caller acts on (``kvload.LLM``: the default parser of requests' structured outputs;
    #: ``engine.reasoning.PARSERS``), or none: parse_args then takes ``reasoning_parser`` from the config file and the
    #: overrides into ``Context.reasoning_parser`` (the overrides win, a ``source_conflict``; another name is refused)
    #: instead of reporting it ``setting_ignored`` as a plan or load does.
    reasoning_parsers: tuple[str, ...] = ()
    #: The flag that gives the caller text prompts (``kvload generate --prompt``), when it does: a model that loads
    #: without a tokenizer (a preset) is then refused, naming it, before its weights load.
    text_prompts: str | None = None
    #: Token ids the caller will give the model, by what names them (``prompt 0 (--prompt-ids)``): an id outside the
    #: vocabulary the model's config states is refused before its weights load (the executor checks again after).
    token_ids: dict[str, Sequence[int]] = attrs.Factory(dict)
    #: The length in tokens of each prompt the caller knows before loading (``prompt 0 (--prompt-ids)`` -> 3): with
    #: ``text_prompts`` too (at least one token each), a max_seq_len that leaves one of them no room to generate is
    #: refused before the weights load (the executor refused ``--max_seq_len 1`` after them).
    prompt_lengths: dict[str, int] = attrs.Factory(dict)
    #: Counts the caller's text prompts with the checkpoint's tokenizer, ``(tokenizer, model name) -> {what names a
    #: prompt: its length in tokens}`` (``kvload generate --prompt TEXT``, through the chat template with ``--chat``),
    #: raising where a prompt cannot be sent: with a max_seq_len they may not fit, the tokenizer is loaded first (a
    #: fraction of a second) and the counts checked as ``prompt_lengths`` are, before the weights load. The caller's
    #: callable, so this layer needs none of the engine's prompt code.
    prompt_counter: Callable[[Any, str], dict[str, int]] | None = None
    #: Whether the caller never reads or writes the KV pools (``kvload simulate`` replays decisions, not attention):
    #: they are then built on torch's ``meta`` device, shapes without memory, and no host-memory check applies, so a
    #: budget this machine could not hold (a GPU's) is simulated as given. The V2 host tier is sized as for pools on
    #: a device, and unbacked too. No model runs either: route_executor reports the forward pass's and sampling's
    #: settings the user gave setting_ignored.
    pools_unbacked: bool = False
    #: (sequences, tokens): the budget the caller sets when the user sets none (``kvload simulate``: that many
    #: sequences' exact bytes in the routed layout), which ``pool_arena: "auto"`` is weighed on; None: no such default
    default_budget: tuple[int, int] | None = None
    #: The accelerator the caller prices the run on (``kvload simulate --hardware``: a key of
    #: ``models.cost.HARDWARE``), which V2's auto host tier is chosen for; None: the device's own (a CUDA device named
    #: in the table), or no choice (the tier is kept).
    hardware: str | None = None

    def for_call(self, name: str, keywords: Sequence[str]) -> LoadRequest:
        """This request as Python call ``name``'s (``"kvload.plan()"``), whose own keywords are ``keywords``: they,
        the other public calls' keywords (:func:`other_call_keywords`) and the name, for parse_args to name an
        unknown key by."""
        self.call_name, self.call_keywords = name, tuple(keywords)
        self.other_call_keywords = other_call_keywords(self.call_keywords)
        return self


@attrs.frozen
class ModelInfo:
    """The checkpoint and spec ``apply_model_defaults`` chose."""

    name: str
    kind: str
    path: str
    architecture: str
    model_type: str
    spec: str
    v2_required: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form for ``--json`` output."""
        return attrs.asdict(self)


@attrs.frozen
class Route:
    """The executor ``route_executor`` chose: KV manager, scheduler, and the reason."""

    kv_manager: str
    scheduler: str
    use_kv_cache_manager_v2: bool
    reason: str
    fallback: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON form for events and ``--json`` output."""
        return attrs.asdict(self)


@attrs.define
class Context:
    """One run's state; each stage reads it and writes only its own outputs."""

    request: LoadRequest
    args: LlmArgs | None = None
    user_values: dict[str, UserValue] = attrs.Factory(dict)  # parse_args: winning source per leaf
    user_fields: Mapping[str, UserValue] = MappingProxyType({})  # snapshot_user_fields: read-only copy
    #: parse_args: vLLM's hf_overrides, per config key (the source that gave it); apply_model_defaults applies them
    hf_overrides: dict[str, UserValue] = attrs.Factory(dict)
    #: parse_args: vLLM's ``convert="classify"`` (or ``task="classify"``) as ``(the key that gave it, its value)``;
    #: apply_model_defaults makes the causal LM a classifier (``models.classifier.converted_config``)
    convert: tuple[str, UserValue] | None = None
    #: parse_args, where the request ``takes_reasoning_parser``: the reasoning parser the sources name (None: none)
    reasoning_parser: UserValue | None = None
    auto_originals: dict[str, AutoOrigin] = attrs.Factory(dict)  # snapshot_user_fields
    checkpoint: Any = None  # apply_model_defaults: models.Checkpoint
    hf_config: Any = None  # apply_model_defaults: transformers config
    spec: Any = None  # apply_model_defaults: models.ModelSpec instance
    model: ModelInfo | None = None  # apply_model_defaults
    model_defaults: dict[str, Any] = attrs.Factory(dict)  # apply_model_defaults: proposals, flat
    sampling_defaults: Any = None  # apply_model_defaults: pipeline.generation_config.SamplingDefaults
    route: Route | None = None  # route_executor
    #: resolve_auto: True when max_seq_len was "auto" (vLLM's max_model_len -1): the KV plan lowers it to the longest
    #: sequence its budget holds
    fit_max_seq_len: bool = False
    ranks: Any = None  # pipeline.ranks.Ranks: this process among the run's ranks (set by execute)
    heads: Any = None  # check_parallel: models.geometry.HeadSharding, the heads this rank holds
    kv: Any = None  # KV plan (geometry, budget), for plan and load
    kv_manager: Any = None  # build_kv_manager
    scheduler: Any = None  # build_kv_manager
    hf_model: Any = None  # weights, when loaded
    tokenizer: Any = None
    extras: dict[str, Any] = attrs.Factory(dict)  # for user-inserted stages
    _cleanup: contextlib.ExitStack = attrs.Factory(contextlib.ExitStack)

    def on_close(self, release: Callable[[], Any]) -> None:
        """Register a release action (pools, weights) run by :meth:`close`, last registered first."""
        self._cleanup.callback(release)

    def close(self) -> None:
        """Release everything registered with :meth:`on_close`."""
        self._cleanup.close()
