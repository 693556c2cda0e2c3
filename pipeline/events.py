"""Event classes. Their names are a public contract: tests, users and ``jq`` filters grep for them.

Every event becomes a plain dict ``{"event", "stage", "seq", ...payload}`` on the bus. Events
that change a value of the arguments carry ``field``, ``old``, ``new`` and ``source`` and are
listed in :data:`VALUE_EVENTS`; folding them over the framework defaults replays the final args.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from pipeline.limits import plain_values

#: A field's metadata key: the field is left out of the record when None (a record reads as it did before the field
#: came, and carries no ``request=None`` on a line no request gave).
OMIT_NONE = "omit_none"


def omitted_when_none() -> Any:
    """An optional field (default None) that the record leaves out while it is None (:data:`OMIT_NONE`)."""
    return attrs.field(default=None, metadata={OMIT_NONE: True})


#: name -> class, filled by :func:`event`.
EVENT_TYPES: dict[str, type[Event]] = {}


def event(name: str, *, level: str = "info", changes_value: bool = False):
    """Register an attrs event class under its public ``name``."""

    def wrap(cls: type) -> type:
        cls = attrs.define(kw_only=True)(cls)
        cls.name = name
        cls.level = level
        cls.changes_value = changes_value
        EVENT_TYPES[name] = cls
        return cls

    return wrap


@attrs.define(kw_only=True)
class Event:
    """Base of all events; ``stage`` and ``seq`` are filled in by the bus."""

    name: ClassVar[str] = "event"
    level: ClassVar[str] = "info"
    changes_value: ClassVar[bool] = False

    stage: str = ""
    seq: int = -1

    def to_dict(self) -> dict[str, Any]:
        """The wire form: ``event``, ``stage``, ``seq``, (``level`` when not info), then the payload."""
        record: dict[str, Any] = {"event": self.name, "stage": self.stage, "seq": self.seq}
        if self.level != "info":
            record["level"] = self.level
        for a in attrs.fields(type(self)):
            value = getattr(self, a.name)
            if a.name not in ("stage", "seq") and not (value is None and a.metadata.get(OMIT_NONE)):
                record[a.name] = value
        return record


# --- pipeline ------------------------------------------------------------------------------


@event("stage_started")
class StageStarted(Event):
    """A stage begins."""


@event("stage_finished")
class StageFinished(Event):
    """A stage ended normally."""

    duration_ms: float


@event("stage_failed", level="error")
class StageFailed(Event):
    """A stage raised; the pipeline re-raises it as a typed error."""

    error: str
    message: str
    duration_ms: float


@event("pipeline_finished")
class PipelineFinished(Event):
    """The closing record: the final resolved args and route, for ``audit --verify``."""

    args: dict[str, Any]
    route: dict[str, Any] | None = None
    stages: list[str] = attrs.Factory(list)


# --- parse_args / snapshot -----------------------------------------------------------------


@event("args_parsed", changes_value=True)
class ArgsParsed(Event):
    """One leaf the user provided, taken into the args; ``given_as``: the vLLM keyword that gave it (``max_model_len``
    for ``max_seq_len``; ``pipeline.vllm_compat.SAME_MEANING``), left out of the record when it was kvload's name."""

    field: str
    old: Any
    new: Any
    source: str
    given_as: str | None = omitted_when_none()


@event("source_conflict", level="warning")
class SourceConflict(Event):
    """Two sources gave different values for one field; the stronger one won. ``overridden_field``: the key the weaker
    source gave its value under, where it is another spelling of the same setting (vLLM's ``task`` for ``convert``: a
    file's ``task: classify`` under ``--convert none``); left out of the record otherwise."""

    field: str
    kept: Any
    kept_source: str
    overridden: Any
    overridden_source: str
    overridden_field: str | None = omitted_when_none()


@event("user_fields_snapshotted")
class UserFieldsSnapshotted(Event):
    """The set of user-set fields, with raw values and sources, captured before any mutation."""

    fields: dict[str, dict[str, Any]]


@event("auto_captured")
class AutoCaptured(Event):
    """A field that starts as ``"auto"``, remembered before anything can replace it."""

    field: str
    original: str
    explicit: bool
    source: str


# --- model ---------------------------------------------------------------------------------


@event("model_resolved")
class ModelResolved(Event):
    """The checkpoint was read and a model spec chosen."""

    model: str
    kind: str
    path: str
    architecture: str
    model_type: str
    spec: str


@event("model_spec_fallback", level="warning")
class ModelSpecFallback(Event):
    """No spec is registered for the architecture; the generic decoder spec is used."""

    architecture: str
    spec: str
    reason: str


@event("hf_config_overridden")
class HfConfigOverridden(Event):
    """vLLM's ``hf_overrides`` set one key of the checkpoint's config, before its spec, geometry and model defaults
    were read and the weights were built from it (``models.hf_overrides``)."""

    key: str  # the config key, dotted under a nested config (text_config.sliding_window)
    old: Any  # the config's value before; None where it had none (``added``)
    new: Any
    added: bool
    source: str  # where hf_overrides was given: cli, config_file or api
    model: str


@event("model_converted")
class ModelConverted(Event):
    """vLLM's ``convert="classify"`` (or ``task="classify"``) made a causal LM a classifier, as its
    ``as_seq_cls_model`` adapter does: the checkpoint is read as its ``*ForSequenceClassification``, the weights' own
    ``score`` head loaded (``models.classifier``)."""

    given_as: str  # convert or task
    value: str  # classify
    old: str  # architectures[0] of the checkpoint
    new: str  # the classifier's
    source: str  # cli, config_file or api
    model: str


@event("model_default_applied", changes_value=True)
class ModelDefaultApplied(Event):
    """A model default written to a field the user did not set."""

    field: str
    old: Any
    new: Any
    source: str
    spec: str


@event("model_default_skipped")
class ModelDefaultSkipped(Event):
    """A model default not applied because the user set the field."""

    field: str
    proposed: Any
    kept: Any
    kept_source: str
    spec: str
    reason: str


@event("sampling_defaults_resolved")
class SamplingDefaultsResolved(Event):
    """The sampling defaults of every request that leaves a setting unset: the model's ``generation_config.json``
    (vLLM's ``--generation-config``) under ``override_generation_config`` (``pipeline.generation_config``).

    ``defaults`` are SamplingParams fields (max_new_tokens is ``max_tokens``); empty: kvload's built-in defaults.
    ``sources`` says where each came from (``generation_config.json``, ``override_generation_config``, or
    ``do_sample``: greedy for false, temperature 1.0 for true); ``not_applied`` names each key of the file that is
    not a default, and why; ``other_keys`` are the file's keys that are no sampling defaults.
    """

    generation_config: str  # the setting: "auto", "vllm" or a directory
    path: str | None  # the generation_config.json read; None when none was
    defaults: dict[str, Any]
    sources: dict[str, str]
    not_applied: dict[str, str]
    other_keys: list[str]
    reason: str


# --- resolve / route -----------------------------------------------------------------------


@event("auto_resolved", changes_value=True)
class AutoResolved(Event):
    """A field that began as ``"auto"`` got its concrete value (also when a model default set it first)."""

    field: str
    original: str
    old: Any
    new: Any
    source: str
    reason: str


@event("field_derived", changes_value=True)
class FieldDerived(Event):
    """A null field given a value derived from the checkpoint or other fields."""

    field: str
    old: Any
    new: Any
    source: str
    reason: str


@event("executor_routed")
class ExecutorRouted(Event):
    """The KV manager and scheduler chosen, and why."""

    kv_manager: str
    scheduler: str
    use_kv_cache_manager_v2: bool
    reason: str


@event("route_fallback", level="warning", changes_value=True)
class RouteFallback(Event):
    """The router changed a value the user did not set, to a manager that can serve the request."""

    field: str
    old: Any
    new: Any
    source: str
    reason: str


@event("setting_ignored", level="warning")
class SettingIgnored(Event):
    """A setting the user asked for has no effect with the resolved configuration."""

    field: str
    #: numpy's and torch's scalars as Python's (an ignored ``enforce_eager=np.True_``): the audit's records are JSON
    value: Any = attrs.field(converter=plain_values)
    reason: str
    #: The served request that gave it (``kvload serve``; its reason ends ``(request ID)`` too, for the log line):
    #: ``kvload audit`` counts the same warning of many requests as one.
    request: str | None = omitted_when_none()


@event("max_seq_len_beyond_positions", level="warning")
class MaxSeqLenBeyondPositions(Event):
    """The user's ``max_seq_len`` is longer than the checkpoint's ``max_position_embeddings``.

    A warning, not an error (vLLM refuses it without an override): rope scaling can extend a model's
    context past the positions its config declares.
    """

    field: str  # "max_seq_len", so ``kvload audit`` and ``explain`` name the setting
    max_seq_len: int
    source: str  # where the user set it: cli, config_file or api
    max_position_embeddings: int
    model: str
    config: str  # the file that declares max_position_embeddings (config.json, or the GGUF file)
    rope_scaling: dict[str, Any] | None  # the config's rope scaling; None when it declares none
    reason: str


# --- weights -------------------------------------------------------------------------------


@event("weights_loaded")
class WeightsLoaded(Event):
    """A model's weights are on the device (before the KV budget is computed, so it sees them)."""

    model: str
    source: str  # "random" (preset, seeded), "safetensors", "gguf" (through the converted cache)
    path: str
    device: str
    dtype: str
    parameters: int
    bytes: int
    tokenizer: bool
    converted: bool  # a GGUF converted to the safetensors cache by this load
    seed: int | None
    duration_ms: float


def is_value_event(record: dict[str, Any]) -> bool:
    """Whether a wire record changes a value of the arguments."""
    cls = EVENT_TYPES.get(record.get("event", ""))
    return bool(cls and cls.changes_value)



# --- generation / simulation ---------------------------------------------------------------


@event("request_admitted")
class RequestAdmitted(Event):
    """A request got device blocks; ``reused_prompt_tokens`` came from the prefix cache (or, for an ``n > 1``
    sample, from its prompt's first sample: a fork of that prefill).

    ``readmitted``: it was admitted before and preempted (its KV is being recomputed).
    """

    req_id: str
    prompt_tokens: int
    reused_prompt_tokens: int
    readmitted: bool = False


@event("request_preempted")
class RequestPreempted(Event):
    """A running request lost its device blocks and went back to waiting, to be recomputed (V2, no host room)."""

    req_id: str
    tokens: int  # prompt + generated tokens it holds, to recompute when readmitted


@event("request_suspended")
class RequestSuspended(Event):
    """V2 moved a running request's pages to the host tier to make room."""

    req_id: str
    tokens: int


@event("request_resumed")
class RequestResumed(Event):
    """V2 brought a suspended request's pages back from the host tier."""

    req_id: str
    tokens: int


@event("request_finished")
class RequestFinished(Event):
    """A request ended ("stop": EOS, stop string or stop token; "length"; or "pruned": a beam of beam search that no
    candidate kept) and released its blocks."""

    req_id: str
    reason: str | None
    prompt_tokens: int
    output_tokens: int
    #: as its output's ``usage``: the reuse of its first admission (a preempted request finding its own prefix again
    #: on re-admission is ``request_admitted``'s to tell, ``readmitted`` true)
    reused_prompt_tokens: int


@event("prefix_cache_reset")
class PrefixCacheReset(Event):
    """``reset_prefix_cache`` forgot every cached prefix (``LLM.reset_prefix_cache``, or the server's
    ``POST /reset_prefix_cache`` under ``--enable-reset-prefix-cache``): no later request reuses what was cached
    before it. A reset that could not act (prefix reuse off, requests holding a cache) is a ``setting_ignored``."""

    caller: str  # "LLM.reset_prefix_cache" or "serve"
    cached_blocks: dict[str, int]  # per KV group: the cached (evictable) blocks it dropped


@event("generation_started")
class GenerationStarted(Event):
    """A ``generate`` call begins: its prompts and sampling settings (each call is one audit segment)."""

    call: int  # 0 for the first generate call on a loaded result, then 1, 2, ...
    requests: int  # sequences: every sample of every prompt
    prompt_tokens: int
    max_new_tokens: int | None  # None: up to max_seq_len (SamplingParams(max_tokens=None), vLLM's)
    temperature: float
    top_p: float
    seed: int | None
    salted: bool  # a reuse-scope salt was given (the salt itself is not logged)
    kv_manager: str
    top_k: int = 0
    n: int = 1  # samples per prompt (``requests`` counts every sample)
    stop_strings: int = 0  # how many stop strings (their text is not logged)
    stop_token_ids: list[int] = attrs.Factory(list)
    logprobs: int | None = None
    per_prompt_params: bool = False  # one SamplingParams per prompt: the sampling fields above are prompt 0's
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    min_p: float = 0.0
    #: the sampling fields above that are the model's defaults (``sampling_defaults_resolved``), not the caller's
    model_defaults: list[str] = attrs.Factory(list)
    #: prompt 0's structured outputs: ``{"kind", "chars", "sha256", "any_whitespace", "reasoning_parser"}`` of its
    #: spec (never the spec), or None
    structured_outputs: dict[str, Any] | None = None
    #: ``kvload.LLM(seed=...)`` (vLLM's engine seed): samples without a seed of their own draw from its sequence
    llm_seed: int | None = None


@event("structured_outputs_requested")
class StructuredOutputsRequested(Event):
    """A server request asked for structured outputs (``generate`` records them in ``generation_started``): what
    kind, and the spec's size and SHA-256, never the spec (a schema may be large, or the client's secret)."""

    request: str  # the answer's id
    field: str  # the body field that asked: response_format, structured_outputs or tool_choice
    kind: str  # json, regex, choice, grammar or json_object
    chars: int
    sha256: str
    any_whitespace: bool = True
    tool_choice: str | None = None  # field tool_choice: "named" (a function's parameters) or "required" (calls)
    #: the server's reasoning parser when the grammar holds only the answer after the thinking, else None
    reasoning_parser: str | None = None


@event("generation_finished")
class GenerationFinished(Event):
    """A ``generate`` call ended: every request finished; totals and throughput."""

    call: int
    requests: int  # sequences: every sample of every prompt
    prompt_tokens: int
    reused_prompt_tokens: int
    generated_tokens: int
    steps: int
    suspends: int
    resumes: int
    preemptions: int
    duration_ms: float
    tokens_per_s: float  # generated tokens per second of wall time
    draft_tokens: int = 0  # speculative decoding (max_draft_len > 0): draft tokens computed
    accepted_draft_tokens: int = 0  # of those, the ones the model confirmed


@event("generation_failed", level="error")
class GenerationFailed(Event):
    """A ``generate`` call raised; its requests were aborted and their blocks freed."""

    call: int
    error: str
    message: str
    finished: int  # requests that had finished before the failure


@event("engine_step_failed", level="error")
class EngineStepFailed(Event):
    """A step of the serving loop raised (a forward out of device memory, a scheduler that cannot progress): the
    requests it held ended with finish_reason "error" and their blocks were freed; the loop serves on."""

    error: str  # the exception's class name
    message: str
    requests: int  # requests the failure ended


@event("engine_loop_failed", level="error")
class EngineLoopFailed(Event):
    """The serving loop's own code raised (a bug, outside a step): the requests it held ended with finish_reason
    "error" and the loop is gone; ``kvload serve`` then stops and exits 1."""

    error: str  # the exception's class name
    message: str
    requests: int  # requests the failure ended


@event("request_failed", level="error")
class RequestFailed(Event):
    """An HTTP request of ``kvload serve`` raised where nothing expected it (a bug in a handler): answered HTTP 500,
    its engine requests aborted, the connection kept; the traceback is in ``exception`` (structlog's key)."""

    method: str
    path: str
    error: str  # the exception's class name
    message: str
    exception: str  # the formatted traceback


# --- KV cache ------------------------------------------------------------------------------


@event("kv_budget_computed")
class KvBudgetComputed(Event):
    """The KV memory budget: every input (measured free memory, caps, geometry) and the result."""

    manager: str  # "v1" | "v2": the layout the budget was computed for
    device: str
    free_bytes: int | None
    weights_bytes: int
    free_gpu_memory_fraction: float
    max_gpu_total_bytes: int
    max_tokens: int | None
    max_seq_len: int
    tokens_cap_bytes: int | None
    bytes_per_token: float
    min_bytes: int
    budget_bytes: int | None
    limited_by: str | None
    reason: str
    # tensor parallel: every rank takes the smallest budget; which rank set it, and each rank's own budget
    rank: int = 0
    limited_by_rank: int | None = None
    rank_budget_bytes: list[int | None] | None = None


@event("kv_host_tier_chosen")
class KvHostTierChosen(Event):
    """V2's auto host tier (``host_cache_size`` null) kept or left out: whether copying an evicted token's KV to the
    host and back costs less than recomputing it on ``hardware``."""

    hardware: str
    copy_us_per_token: float  # the token's KV in every layer, out and back over the host link
    recompute_us_per_token: float  # the token through the projections at the accelerator's peak
    host_tier: bool  # kept (suspends copy) or none (preemptions recompute)
    reason: str


@event("kv_host_tier_sized")
class KvHostTierSized(Event):
    """V2's host tier as the plan sizes it (before anything is allocated): its bytes and slots per layer group,
    and which setting or rule sized it: ``host_cache_size`` the user's (or a model's), auto (null: one host slot
    per device block, capped at a share of the host memory available), the accelerator's costs
    (``kv_host_tier_chosen``), or the slab arena (no tier)."""

    host_cache_size: int | None  # the setting as resolved: bytes, 0 = none, None = auto
    host_bytes: int  # the tier's host memory (0 = none)
    host_slots: dict[str, int]  # slots per layer group ({} = none)
    sized_by: str  # "host_cache_size" | "auto" | "kv_host_tier_chosen" | "pool_arena"
    reason: str


@event("kv_budget_short", level="warning")
class KvBudgetShort(Event):
    """The KV pools hold no whole sequence of ``max_seq_len``: a request that long would never be admitted."""

    capacity_tokens: int
    max_seq_len: int
    sequence_bytes: int  # what one sequence of max_seq_len needs
    budget_bytes: int
    limited_by: str | None  # the dotted field whose rule set the budget
    advice: str


@event("kv_blocks_oversized", level="warning")
class KvBlocksOversized(Event):
    """Whole blocks of ``tokens_per_block`` make the pools far bigger than asked: a block longer than any sequence,
    or ``max_tokens`` rounded up to more than twice itself."""

    tokens_per_block: int
    max_seq_len: int
    max_tokens: int | None  # the cap that set the budget, when it did
    reason: str
    advice: str


@event("kv_events_file_failed", level="warning")
class KvEventsFileFailed(Event):
    """The file KV cache events were mirrored to could not be written (a full disk): it stops at its last complete
    line; requests and the in-memory buffer go on (publishing never fails a step, as in vLLM)."""

    field: str  # the flag that named the file (--kv-events-file), so the warning line names it
    path: str
    error: str  # the OS error, as "[Errno 28] No space left on device"
    reason: str


@event("engine_stats")
class EngineStats(Event):
    """``kvload serve``'s periodic throughput line, vLLM's "Avg prompt throughput: X tokens/s, ..." (every
    ``VLLM_LOG_STATS_INTERVAL`` seconds, 10 by default, while requests run; ``--disable-log-stats`` turns it off)."""

    prompt_throughput: float  # tokens/s of the prompts whose first token came out in the interval (cached included)
    generation_throughput: float  # tokens/s generated in the interval
    running: int  # requests running now
    waiting: int  # requests waiting now (suspended ones included)
    kv_cache_usage: float  # percent of the KV cache in use now
    prefix_cache_hit_rate: float  # percent of the prompt tokens looked up in the interval that the prefix cache held
    interval_s: float  # the seconds the throughputs are over


@event("audit_log_failed", level="warning")
class AuditLogFailed(Event):
    """``kvload serve``'s ``--audit-log`` file could not be written (a full disk), said when it happens: the file is
    not published (the server exits 1 when it stops) and the records from here on are kept only in memory; requests
    go on."""

    field: str  # the flag that named the file (--audit-log), so the warning line names it
    path: str
    error: str  # the OS error, as "[Errno 28] No space left on device"
    reason: str


@event("api_key_required")
class ApiKeyRequired(Event):
    """``kvload serve`` answers only requests with ``Authorization: Bearer KEY`` (one of ``keys`` keys) on every path
    but ``open_paths``; never the key itself, only where it came from."""

    source: str  # "--api-key", "KVLOAD_API_KEY", "VLLM_API_KEY", or "api_keys" (build_state's keyword)
    keys: int
    open_paths: list[str]


@event("auto_tool_choice_enabled")
class AutoToolChoiceEnabled(Event):
    """``kvload serve`` serves chat's ``tool_choice: "auto"`` (vLLM's ``--enable-auto-tool-choice``): each such reply
    is free text, read for tool calls by ``parser`` (``--tool-call-parser``)."""

    parser: str  # "hermes"


@event("reasoning_parser_enabled")
class ReasoningParserEnabled(Event):
    """``kvload serve`` splits each chat reply into the model's thinking (``reasoning_content``) and its answer
    (``content``) with ``parser`` (vLLM's ``--reasoning-parser``)."""

    parser: str  # "deepseek_r1" or "qwen3"


@event("serve_without_api_key", level="warning")
class ServeWithoutApiKey(Event):
    """``kvload serve`` listens beyond this machine (``--host 0.0.0.0``) and requires no API key."""

    host: str  # as given to --host
    address: str  # the address the socket bound
    reason: str


@event("kv_manager_built")
class KvManagerBuilt(Event):
    """The KV cache manager and its pools exist on the device: per-group blocks and bytes, capacity."""

    kv_manager: str
    scheduler: str
    device: str
    dtype: str
    tokens_per_block: int
    groups: dict[str, dict[str, Any]]
    total_bytes: int
    capacity_tokens: int
    max_seq_len: int
    max_concurrency: int
    host_bytes: int = 0  # V2 host tier (host memory, pinned on CUDA); not part of total_bytes


# --- ranks (tensor parallel) ---------------------------------------------------------------


@event("rank_joined")
class RankJoined(Event):
    """This process's rank in the run and the attention heads it holds (rank 0 of 1 without torchrun)."""

    rank: int
    world_size: int
    local_rank: int
    tensor_parallel_size: int
    heads: dict[str, Any]  # models.geometry.HeadSharding.to_dict(): mode, heads and KV heads per rank


@event("ranks_launched")
class RanksLaunched(Event):
    """The ranks were started by kvload's own launcher (the CLI outside torchrun), not by torchrun."""

    rank: int
    world_size: int  # how many rank processes the launcher started
    launcher: str  # "kvload"
    master_addr: str  # the rendezvous address and port the launcher chose
    master_port: int


@event("ranks_agreed")
class RanksAgreed(Event):
    """Every rank resolved the same arguments (byte caps aside) and route: their digests match."""

    rank: int
    world_size: int
    digest: str  # sha256 of the compared fields, the same on every rank
    fields: int  # how many fields were compared
    excluded: list[str]  # fields not compared (byte caps: min-reduced instead)


@event("ranks_disagreed", level="error")
class RanksDisagreed(Event):
    """Ranks resolved different values: each differing field with every rank's value, in rank order."""

    rank: int
    world_size: int
    differences: dict[str, list[Any]]
