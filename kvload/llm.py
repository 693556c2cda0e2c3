"""``kvload.LLM``: the front door shaped like vLLM's and TensorRT-LLM's ``LLM`` class.

``LLM(model, **llm_args)`` runs every stage with weights (``kvload.load(..., load_weights=True)``)
and keeps the result: ``.generate`` returns ``RequestOutput``s, ``.generate_stream`` yields
``TokenDelta``s as tokens are produced, ``.audit`` / ``.args`` / ``.route`` say what was decided and
why. On CPU with neither ``kv_cache_config.max_tokens`` nor ``max_gpu_total_bytes``, the pools hold
:data:`DEFAULT_CPU_MAX_TOKENS` tokens, or 8 x (max_new_tokens + 1024) when the model's generation_config.json gives
max_new_tokens (:func:`cpu_pool_default`; ``kv_cache_config.default_max_tokens``, filled in by ``LLM`` when neither
the arguments nor the config file set it: the audit records it as ``field_derived``, not as user-set, and replays
it); pass either bound, or ``default_max_tokens``, to choose.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from engine.beam_search import BeamSearchOutput, BeamSearchParams
from engine.outputs import GenerationStats, RequestOutput
from engine.prompts import check_tree, is_conversation, non_json_in
from engine.reasoning import PARSERS
from engine.sampling_params import SamplingParams, is_int
from kvload.api import LoadResult, api_request, execute
from kvload.llm_calls import (
    as_legacy_ids,
    checked_keywords,
    cut_sampling,
    errors_titled,
    followed_by_ranks,
    legacy_ids,
    no_lora,
    tokenization_cut,
)
from kvload.llm_pooling import PoolingCalls
from kvload.llm_ranks import SpawnedRanks, spawn_size
from kvload.llm_stream import StreamCalls, StreamClosed  # noqa: F401
from kvload.metrics import METRIC_NAMINGS, LlmMetrics, Metric
from pipeline.audit import JsonlSink
from pipeline.bus import Subscriber
from pipeline.context import DEFAULT_MAX_TOKENS_FIELD, CallerDefault
from pipeline.errors import (
    ConfigError,
    GenerationError,
    OutputError,
)
from pipeline.events import SettingIgnored
from pipeline.limits import MAX_INT, checked_flag, plain_scalar, plain_value, short, short_py
from pipeline.ranks import ranks_from_env
from pipeline.vllm_compat import reasoning_parser as vllm_reasoning_parser
from stages import load_stages

#: Tokens the KV pools hold on CPU when no bound is given: one SmolLM2 sequence of its full 8192-token
#: context, or many short ones (SmolLM2-135M: 46 KB per token in float32, so ~380 MB).
DEFAULT_CPU_MAX_TOKENS = 8192
#: When the model's generation_config.json (or the user's override_generation_config) gives max_new_tokens, the CPU
#: pools hold this many sequences of it plus :data:`CPU_PROMPT_ALLOWANCE` prompt tokens, at most this many of
#: max_seq_len: ``kvload serve``'s sizing, so a request taking the defaults fits as it does there.
CPU_DEFAULT_SEQUENCES = 8
CPU_PROMPT_ALLOWANCE = 1024


def cpu_pool_default(request: Any) -> CallerDefault:
    """``kv_cache_config.default_max_tokens`` as ``LLM`` derives it for ``request`` (a load the user left unbounded).

    The model's default length is more specific than LLM's generic 8192 tokens, so it wins, as it does for the
    requests' ``max_tokens`` and in ``kvload generate`` and ``kvload serve``: with a ``max_new_tokens`` in the model's
    generation_config.json (or the user's ``override_generation_config``) the pools hold
    ``CPU_DEFAULT_SEQUENCES x (max_new_tokens + CPU_PROMPT_ALLOWANCE)`` tokens, at most ``CPU_DEFAULT_SEQUENCES``
    sequences of max_seq_len. Why: with 8192 tokens whatever the model said, a model whose max_new_tokens is 12,000
    refused ``llm.generate(prompt)`` with its own defaults (the pools hold 8,192) while ``kvload generate`` ran it."""
    from kvload.cli.sampling_defaults import default_length_origin, peek_sampling_defaults

    peeked = peek_sampling_defaults(request)
    length = peeked.values.get("max_tokens")
    if length is None:
        return CallerDefault(DEFAULT_CPU_MAX_TOKENS, "LLM",
                             f"{DEFAULT_MAX_TOKENS_FIELD} (kvload.LLM's default: the pools hold "
                             f"{DEFAULT_CPU_MAX_TOKENS} tokens when neither max_tokens nor max_gpu_total_bytes bounds "
                             "them)")
    tokens = min(MAX_INT, CPU_DEFAULT_SEQUENCES * (length + CPU_PROMPT_ALLOWANCE))
    return CallerDefault(tokens, "LLM",
                         f"{default_length_origin(peeked)} (kvload.LLM sizes the pools for {CPU_DEFAULT_SEQUENCES} x "
                         f"(max_new_tokens + {CPU_PROMPT_ALLOWANCE}) = {tokens} tokens when neither max_tokens nor "
                         "max_gpu_total_bytes bounds them)", sequences=CPU_DEFAULT_SEQUENCES)


#: What a call that ``close()`` stopped raises (between two steps, its requests freed, before the pools are released).
CLOSED_DURING_GENERATION = ("generate: the LLM was closed during generation (LLM.close(), or leaving its with block); "
                            "the call was stopped and its KV blocks freed")


#: What every call of an LLM raises in a process forked after it was built: torch's intra-op threads do not survive a
#: fork (a forward in the child waited for ever on the parent's OpenMP pool), and a close there rewrote the parent's
#: audit log.
FORKED = ("generate: this LLM was built in process {pid} and this is a child forked from it (os.fork(), "
          "multiprocessing's 'fork'), which cannot use it: torch's threads do not survive a fork, so a forward here "
          "could wait for ever, and its KV pools and audit log are the parent's; create the LLM in a process started "
          "with multiprocessing's 'spawn' or 'forkserver'")


def _kv_events(value: Any, kv_cache_config: Any, config_file: Any = None) -> Any:
    """vLLM's ``kv_events_config`` keyword checked (None when not given), before anything loads: events on with the
    user's ``event_buffer_max_size`` 0 (the keyword's, else the config file's) is refused, as ``kvload serve
    --kv-events-config`` refuses it."""
    if value is None:
        return None
    from kvload.serve.kv_publisher import kv_events_argument

    events = kv_events_argument(value)
    if isinstance(kv_cache_config, Mapping):
        size = kv_cache_config.get("event_buffer_max_size")
    else:  # a KvCacheConfig: its value counts only where the user set it
        size = getattr(kv_cache_config, "event_buffer_max_size", None) \
            if "event_buffer_max_size" in getattr(kv_cache_config, "_explicit", ()) else None
    if size is None and config_file is not None:  # the file's 0 turned the events off without a word
        from pipeline.sources import read_yaml

        try:
            kv = read_yaml(os.fspath(config_file)).get("kv_cache_config")
        except (ConfigError, TypeError):  # not the events' problem: the load names the file
            kv = None
        size = kv.get("event_buffer_max_size") if isinstance(kv, Mapping) else None
    if events.enable_kv_cache_events and size is not None and plain_scalar(size) == 0:
        raise ConfigError("kv_events_config: enable_kv_cache_events is true but kv_cache_config.event_buffer_max_size "
                          "is 0 (events off); drop that setting or give N > 0", path="kv_events_config",
                          detail="events off")
    return events


#: ``vllm.LLM`` attributes ``kvload.LLM`` does not have → what to use instead (the AttributeError says it).
VLLM_ATTRIBUTES_NOT_TAKEN: dict[str, str] = {
    "llm_engine": "the engine object; kvload's load is llm.result (its executor, kv_manager, scheduler, audit), "
                  "the settings llm.args (llm.args.max_seq_len is vLLM's model_config.max_model_len), the tokenizer "
                  "llm.get_tokenizer()",
    **dict.fromkeys(("sleep", "wake_up"), "kvload.LLM has no sleep mode; close() releases the pools and weights"),
    **dict.fromkeys(("collective_rpc", "apply_model"),
                    "kvload runs no user functions on its workers; the torch model is llm.result.hf_model"),
    **dict.fromkeys(("start_profile", "stop_profile"), "profile a generate call with torch.profiler"),
    "set_tokenizer": "kvload uses the checkpoint's own tokenizer",
    **dict.fromkeys(("update_weights", "init_weight_transfer_engine"),
                    "kvload loads a checkpoint's weights once and takes no weight updates; load the new checkpoint "
                    "with a new kvload.LLM"),
    "model_config": "vLLM's model settings; kvload's resolved settings are llm.args (llm.args.max_seq_len is vLLM's "
                    "model_config.max_model_len, llm.args.dtype its dtype)",
}


#: ``tensorrt_llm.LLM`` methods ``kvload.LLM`` does not have → what to use instead (the AttributeError says it; its
#: ``generate``, ``shutdown`` and ``tokenizer`` are kvload's too).
TRTLLM_ATTRIBUTES_NOT_TAKEN: dict[str, str] = {
    "generate_async": "kvload's calls block the thread that makes them: LLM.generate(prompts, sampling_params) returns "
                      "each prompt's RequestOutput (a list, also for one prompt, as vLLM's), and "
                      "LLM.generate_stream(prompt, sampling_params) yields its tokens as they come (streaming=True)",
    **dict.fromkeys(("get_stats", "get_stats_async"),
                    "llm.last_stats holds the last call's tokens, steps and times, llm.get_metrics() the counters "
                    "since the load"),
    **dict.fromkeys(("get_kv_cache_events", "get_kv_cache_events_async"),
                    "llm.result.kv_cache_events() drains them, with kv_cache_config={'event_buffer_max_size': N} "
                    "on the LLM"),
    "save": "it writes a TensorRT engine; kvload builds none and loads the checkpoint itself each time",
}


class LLM(PoolingCalls, StreamCalls):
    """A loaded model that generates through kvload's KV cache manager (``with LLM(...) as llm:``).

    ``llm_args`` are ``LlmArgs`` fields (``kv_cache_config`` as a dict or ``KvCacheConfig``,
    ``max_seq_len``, ``device``, ``dtype``, ...), or vLLM's names of them (``max_model_len``, ``max_num_seqs``,
    ``block_size``, ...: ``pipeline.vllm_compat.SAME_MEANING``); ``config_file`` is a YAML of them (arguments win).
    ``audit_log``: the load's events go there, and on :meth:`close` the file is rewritten with the
    generation events too. ``log=False`` keeps kvload's event lines off stderr. ``seed``: vLLM's engine seed (0 by
    default, as in vLLM's V1 engine): samples whose SamplingParams has no seed draw their seeds from one sequence it
    starts, so a script repeats run to run (None: fresh randomness each call). vLLM's engine knobs kvload has no
    counterpart for (``enforce_eager``) are accepted and reported ``setting_ignored``; README "Coming from vLLM" lists
    what maps, what is ignored, what is refused. ``kv_events_config``: vLLM's KV event publisher (a dict of its
    ``KVEventsConfig`` keys, or one), as ``kvload serve --kv-events-config``: the blocks generation stores and evicts
    go out over ZeroMQ until :meth:`close` (``publisher: "null"``: kept for ``llm.result.kv_cache_events()``).
    ``tensor_parallel_size=N`` outside torchrun: this process is rank 0 and starts ranks 1..N-1, which follow its
    engine calls (:mod:`kvload.llm_ranks`); under torchrun every rank runs the script.
    """

    def __init__(self, model: str | os.PathLike[str], *, config_file: str | os.PathLike[str] | None = None,
                 audit_log: str | os.PathLike[str] | None = None, subscribers: Iterable[Subscriber] = (),
                 log: bool = True, seed: int | None = 0, **llm_args: Any) -> None:
        seed = plain_scalar(seed)  # a numpy / torch integer, as vLLM takes it
        if seed is not None and not (is_int(seed) and 0 <= seed <= MAX_INT):  # checked before anything loads
            detail = f"expected an integer in [0, 2**63 - 1] or None, got {short(seed)}"
            raise ConfigError(f"seed: {detail}", path="seed", detail=detail, source="api")
        events = _kv_events(llm_args.pop("kv_events_config", None), llm_args.get("kv_cache_config"), config_file)
        reasoning_parser = vllm_reasoning_parser(llm_args.pop("reasoning_parser", None), True, "api")
        # the keyword beats a config file's reasoning_parser (a source_conflict); parse_args takes both (Context)
        given = llm_args if reasoning_parser is None else {**llm_args, "reasoning_parser": reasoning_parser}
        request = api_request(model, config_file, True, given, "kvload.LLM()")
        request.reasoning_parsers = PARSERS
        request.generates = True  # a model kvload cannot generate for is refused before its weights load
        # the CPU pools' size when neither the user nor the config file bounds them: not a user setting, so the audit
        # records it as derived by LLM (field_derived) and a value the user gives wins
        request.caller_defaults[DEFAULT_MAX_TOKENS_FIELD] = cpu_pool_default(request)
        if events is not None and events.enable_kv_cache_events:  # vLLM's switch turns the recording on, as serve's
            from kvload.serve.command import EVENT_BUFFER_DEFAULT, EVENT_BUFFER_FIELD

            request.caller_defaults[EVENT_BUFFER_FIELD] = CallerDefault(
                EVENT_BUFFER_DEFAULT, "LLM", f"kv_events_config enables KV cache events (vLLM's "
                f"enable_kv_cache_events); llm.result.kv_cache_events() drains the newest {EVENT_BUFFER_DEFAULT:,}",
                over_default=True)
        self._busy = threading.Lock()
        self._pid = os.getpid()  # a forked child has this object but not what it stands on (see _check_open)
        # tensor_parallel_size outside torchrun: this process is rank 0 and starts the others (vLLM's habit)
        world = spawn_size(model, config_file, llm_args)
        ranks = None
        if world:
            ranks = SpawnedRanks(world, model, {"config_file": config_file, "audit_log": audit_log, "seed": seed,
                                                "subscribers": subscribers, "log": log,
                                                "reasoning_parser": reasoning_parser, **llm_args})
            ranks.start()
        self._ranks = ranks
        publisher = None
        # under torchrun every rank runs the script: rank 0 publishes (vLLM's one publisher per engine), as serve's;
        # rank 1 binding the same endpoint failed, and with it the LLM on that rank
        if events is not None and events.publishes and ranks_from_env().is_first:
            from kvload.serve.kv_publisher import ZmqKvEventPublisher

            try:  # a taken port fails before the load
                publisher = ZmqKvEventPublisher(events, name="kv_events_config")
            except BaseException:
                if ranks is not None:
                    ranks.close()
                raise
        try:
            with ranks.rank_zero() if ranks is not None else contextlib.nullcontext():
                self.result: LoadResult = execute(request, load_stages(), audit_log=audit_log,
                                                  subscribers=subscribers, log=log)
        except BaseException as exc:
            if publisher is not None:
                publisher.close()
            if ranks is not None:
                cause = ranks.load_failed(exc)
                if cause is not exc:
                    raise cause from exc
            raise
        try:
            if events is not None:
                self._start_publishing(events, publisher)
            if ranks is not None:
                ranks.loaded()
        except BaseException:
            if publisher is not None:
                publisher.close()
            self.result.close()
            if ranks is not None:
                ranks.close()
            raise
        if ranks is not None:  # garbage collection and interpreter exit end the ranks too
            weakref.finalize(self, ranks.close)
        if audit_log is not None:  # registered after the pools: runs first, while the release is under way
            self.result.context.on_close(lambda: self._write_audit(audit_log))
        self._closed = False
        self._said_no_tqdm = False  # use_tqdm=True is reported once per LLM, not once per call
        self._said_no_mm_cache = False  # reset_mm_cache() too: a benchmark calls it between every run
        self._said_no_connector = False  # reset_prefix_cache(reset_connector=True): said once, as reset_mm_cache
        self._metrics = LlmMetrics(str(self.args.model), self.args.max_draft_len)
        if seed is not None:  # vLLM's engine seed: unseeded samples draw from one seeded sequence, so a run repeats
            executor = self.result.executor
            executor.call_seeds, executor.llm_seed = random.Random(seed), int(seed)
        taken = self.result.context.reasoning_parser  # the keyword's, else the config file's
        self.result.executor.reasoning_parser = taken.value if taken is not None else None

    def _start_publishing(self, events: Any, publisher: Any) -> None:
        """Hand the manager's KV events to ``publisher`` until :meth:`close` (detached and closed before the pools
        are released, as ``kvload serve`` does); a zmq publisher with the events off says it is ignored."""
        buffer = getattr(self.result.kv_manager, "kv_events", None)
        if events.enable_kv_cache_events and buffer is None:  # the config file's event_buffer_max_size: 0
            raise ConfigError("kv_events_config: enable_kv_cache_events is true but kv_cache_config."
                              "event_buffer_max_size is 0 (events off); drop that setting or give N > 0",
                              path="kv_events_config", detail="events off")
        if publisher is not None:
            publisher.attach(self.result.kv_manager.layout)
            buffer.publisher = publisher

            def stop() -> None:
                buffer.publisher = None
                publisher.close()

            self.result.context.on_close(stop)
        elif events.publisher == "zmq" and not events.enable_kv_cache_events and self.result.bus is not None:
            self.result.bus.emitter("LLM")(SettingIgnored(
                field="kv_events_config.publisher", value="zmq",
                reason="enable_kv_cache_events is false, so no KV cache events are recorded to publish (vLLM's "
                       "rule)"))

    def _write_audit(self, path: str | os.PathLike[str]) -> None:
        """On close: rewrite ``audit_log`` with the generation segments too. A failed write (a full disk) leaves the
        file the load published, so the one line says that, not "nothing was written" (which named no argument)."""
        sink = JsonlSink(path, flag="audit_log")
        try:
            with sink:
                for record in self.result.audit.events:
                    sink(record)
        except OutputError as exc:
            # the write the OS refused, or the temporary's creation or the publish it refused (the error's cause);
            # None: not the OS (the path appeared meanwhile), and the sink's line says why
            failed = sink.failed or (exc.__cause__ if isinstance(exc.__cause__, OSError) else None)
            if failed is None:
                raise
            raise OutputError(f"audit_log {os.fspath(path)}: cannot write the generation events "
                              f"({failed.strerror or failed}); the file keeps the load's events only, as written when "
                              "the LLM was created") from exc

    # --- what was loaded ------------------------------------------------------------------------

    @property
    def args(self) -> Any:
        """The resolved, frozen ``LlmArgs``."""
        return self.result.args

    @property
    def route(self) -> Any:
        """The routing decision: KV cache manager and scheduler, and why."""
        return self.result.route

    @property
    def audit(self) -> Any:
        """The audit log: the load's events, then one segment per generate call."""
        return self.result.audit

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (None for presets, which take token ids)."""
        return self.result.tokenizer

    def get_tokenizer(self) -> Any:
        """The tokenizer (vLLM's spelling)."""
        return self.tokenizer

    @checked_keywords
    def get_world_size(self, include_dp: bool = True) -> int:
        """vLLM's ``LLM.get_world_size``: the ranks the model runs on, ``tensor_parallel_size`` (kvload has no
        pipeline or data parallelism, so ``include_dp`` changes nothing: both counts are the same)."""
        checked_flag(include_dp, lambda why: GenerationError(f"get_world_size: include_dp: {why}"))
        return int(self.args.tensor_parallel_size)

    def reset_mm_cache(self) -> None:
        """vLLM's ``LLM.reset_mm_cache`` (benchmarks call it beside :meth:`reset_prefix_cache`): kvload serves text-only
        models and keeps no multimodal cache, so there is nothing to reset; said once as ``setting_ignored``."""
        self._check_open()
        if self._said_no_mm_cache or self.result.bus is None:
            return
        self._said_no_mm_cache = True
        self.result.bus.emitter("generate")(SettingIgnored(
            field="LLM.reset_mm_cache", value=True,
            reason="kvload serves text-only models and keeps no multimodal cache: there is nothing to reset"))

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the SamplingParams a call given none uses, from the model's ``generation_config.json`` under
        ``override_generation_config`` (``generation_config="vllm"``: kvload's built-in ``SamplingParams()``). Keywords
        given to :meth:`generate` replace single fields of it; a SamplingParams given is used as it is (vLLM's rule).
        The audit's ``sampling_defaults_resolved`` says which file gave which value, and what did not apply."""
        return SamplingParams(**self.result.sampling_defaults.values)

    @property
    def last_stats(self) -> GenerationStats | None:
        """Totals of the last generate call: tokens, reuse, steps, wall time, tokens/s."""
        return self.result.executor.last_stats

    # --- generating -----------------------------------------------------------------------------

    @checked_keywords
    @followed_by_ranks
    def generate(self, prompts: Any = None, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: Any = None, salt: str | None = None, chat: bool | Mapping[str, Any] = False,
                 priority: Sequence[int] | None = None, lora_request: Any = None, prompt_token_ids: Any = None,
                 tokenization_kwargs: Mapping[str, Any] | None = None, **sampling: Any) -> list[RequestOutput]:
        """One :class:`RequestOutput` per prompt, in order (a single prompt still gives a list of one).

        ``prompts``: a string, a list of strings (``chat=True`` applies the chat template), lists of
        token ids (or 1-D integer numpy arrays / torch tensors), and vLLM's ``{"prompt": TEXT}`` /
        ``{"prompt_token_ids": IDS}`` dicts. ``sampling_params``: one :class:`SamplingParams` for all
        prompts, a list of one per prompt, or None (defaults; its fields may be given as keywords
        instead). ``use_tqdm``: taken for vLLM compatibility; kvload draws no progress bar, so a true
        value is reported once as ``setting_ignored``. ``salt`` scopes prefix reuse (prompts under
        different salts never share cached blocks). ``priority``: vLLM's, one integer per prompt, lower served
        first (ties by arrival); it needs ``scheduling_policy="priority"`` (under "fcfs" only 0 is accepted).
        ``lora_request``: vLLM's; kvload has no LoRA adapters, so only None (or vLLM's list of one per prompt, all
        None) is accepted. ``prompt_token_ids``: vLLM's
        older way to give token ids (one list, or a list of them), in place of ``prompts``. ``tokenization_kwargs``:
        vLLM's; its ``truncate_prompt_tokens`` (where vLLM now takes the cut) acts as the SamplingParams field does,
        on every prompt; None or ``{}`` asks for nothing, and its other keys are refused naming them.
        """
        no_lora("generate", lora_request)
        sampling_params, sampling = cut_sampling("generate", sampling_params, sampling,
                                                  tokenization_cut("generate", tokenization_kwargs))
        if prompt_token_ids is None:
            return self._generate("generate", prompts, sampling_params, use_tqdm, salt, chat, sampling, priority)
        # vLLM's legacy keyword (scripts written for vLLM before 0.10 pass it)
        if prompts is not None:
            raise GenerationError("generate: give the prompts as prompts or as prompt_token_ids, not both (a "
                                  "text with its ids: {'prompt_token_ids': IDS})")
        prompts, flat = legacy_ids(prompt_token_ids)
        try:
            return self._generate("generate", prompts, sampling_params, use_tqdm, salt, chat, sampling, priority)
        except GenerationError as e:  # the prompts' errors name the keyword the user gave them as
            if e.args and isinstance(e.args[0], str):
                e.args = (as_legacy_ids(e.args[0], flat), *e.args[1:])
            raise

    def _generate(self, call: str, prompts: Any, sampling_params: Any, use_tqdm: Any, salt: str | None,
                  chat: bool | Mapping[str, Any], sampling: dict[str, Any],
                  priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """:meth:`generate` as ``call`` (``generate`` or ``chat``), which titles its errors and their audit record."""
        with self._exclusive(call):
            self._no_progress_bar(use_tqdm, call)
            with self._running(call) as executor:
                outputs = executor.run(prompts, sampling_params, salt=salt, chat=chat, priority=priority, **sampling)
                self._metrics.record(outputs, executor.last_stats)
                return outputs


    @checked_keywords
    @followed_by_ranks
    def beam_search(self, prompts: Any, params: BeamSearchParams, lora_request: Any = None, use_tqdm: Any = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: the best ``params.beam_width`` hypotheses of every prompt, best first.

        Every live beam is a running request that computes one token a step, a new beam a fork of its parent
        (``engine.beam_search``); the width is bounded by the load's ``max_beam_width``
        (``LLM(model, max_beam_width=4)``). vLLM's other arguments, in its order: ``lora_request`` (only None, as
        :meth:`generate`'s), ``use_tqdm`` (as :meth:`generate`'s) and ``concurrency_limit`` (at most this many
        prompts searched at once, the next ones after them: less KV held at a time, the same hypotheses).
        """
        no_lora("beam_search", lora_request)
        if concurrency_limit is not None and not (is_int(concurrency_limit) and concurrency_limit >= 1):
            raise GenerationError(f"beam_search: concurrency_limit: expected an integer >= 1 (prompts searched at "
                                  f"once) or None, got {short(concurrency_limit)}")
        with self._exclusive("beam_search"):
            self._no_progress_bar(use_tqdm, "beam_search")
            with self._running("beam_search") as executor:
                # the groups are cut from the checked prompts, so a refusal names a prompt by its place in prompts
                # (a group's slice named the third prompt "prompt 0", once the groups before it had been searched)
                return executor.beam_search(prompts, params, concurrency_limit=concurrency_limit)

    @checked_keywords
    @followed_by_ranks
    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: Any = None, lora_request: Any = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             tokenization_kwargs: Mapping[str, Any] | None = None, *, salt: str | None = None,
             **sampling: Any) -> list[RequestOutput]:
        """Reply to a conversation through the tokenizer's chat template (vLLM's ``LLM.chat``).

        ``messages``: one conversation (a list of ``{"role": ..., "content": ...}`` dicts) or a list of
        conversations; one :class:`RequestOutput` per conversation, whose ``prompt`` is the templated
        text. vLLM's template options: ``add_generation_prompt`` (open the assistant's turn; default true),
        ``continue_final_message`` (continue the last, assistant, message instead: a reply's prefill; needs
        ``add_generation_prompt=False``), ``chat_template`` (a Jinja template in place of the tokenizer's) and
        ``chat_template_kwargs`` (extra template variables). ``tools``: vLLM's, OpenAI-style tool definitions handed
        to the template as its ``tools`` variable (the model may then write a call; ``kvload serve`` parses them).
        ``chat_template_content_format``: vLLM's, how each message's content reaches the template: ``"string"`` (text
        parts joined by newlines), ``"openai"`` (the list of ``{"type": "text", "text": ...}`` parts; a string is one
        part) or ``"auto"``: ``"openai"`` for a template that loops over a message's content, else ``"string"``
        (:mod:`engine.content_format`). The other arguments are :meth:`generate`'s. Those
        before ``salt`` stand in vLLM's order, so a call that passes them by position reads as it does there.
        """
        no_lora("chat", lora_request)
        sampling_params, sampling = cut_sampling("chat", sampling_params, sampling,
                                                  tokenization_cut("chat", tokenization_kwargs))
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise GenerationError("chat: tools: expected a list of tool definitions (dicts), got "
                                      f"{short_py(tools)}")
            # OpenAI's tool definitions are JSON, and a template reads them as such (tojson): bytes or an object in
            # one failed there, or passed unread by a template that ignores tools
            found = non_json_in(tools, "tools")
            if found is not None:
                raise GenerationError(f"chat: {found[0]}: expected JSON values (a tool definition is an object such "
                                      "as {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}), "
                                      f"got {short(found[1])}")
            with errors_titled("chat"):  # named as given, before they join the template's variables
                check_tree("tools", tools)
            if isinstance(chat_template_kwargs, dict) and "tools" in chat_template_kwargs:
                raise GenerationError("chat: tools: given both as chat's argument and in chat_template_kwargs; give "
                                      "it once")
            if chat_template_kwargs is None or isinstance(chat_template_kwargs, dict):  # anything else: refused below
                chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        conversations = [messages] if is_conversation(messages) else messages
        if isinstance(conversations, (str, bytes)) or not isinstance(conversations, Sequence) or not conversations \
                or not all(is_conversation(c) for c in conversations):
            raise GenerationError("chat: messages: expected a conversation (a non-empty list of "
                                  "{'role': ..., 'content': ...} dicts) or a list of conversations, got "
                                  f"{short_py(messages)}")
        options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                   "chat_template": chat_template, "chat_template_kwargs": chat_template_kwargs,
                   "chat_template_content_format": chat_template_content_format}  # checked by run
        return self._generate("chat", list(conversations), sampling_params, use_tqdm, salt, options, sampling)

    def _no_progress_bar(self, use_tqdm: Any, call: str = "generate") -> None:
        """vLLM's ``use_tqdm``: false needs nothing; true (or a tqdm factory) is said to be ignored, once; anything
        else (a text, a number, a list) is refused, as vLLM's type says, rather than read as true or false."""
        flag = plain_value(use_tqdm)  # numpy's bool (a 0-d bool tensor) as a bool
        boolean = isinstance(flag, bool) or (type(flag) is int and flag in (0, 1))
        if not (flag is None or boolean or callable(flag)):
            raise GenerationError(f"{call}: use_tqdm: expected true, false or a tqdm factory (a callable), got "
                                  f"{short(use_tqdm)}")
        if not use_tqdm or self._said_no_tqdm:
            return
        self._said_no_tqdm = True
        if self.result.bus is not None:
            self.result.bus.emitter("generate")(SettingIgnored(
                field="generate.use_tqdm", value=flag if isinstance(flag, bool) else repr(use_tqdm),
                reason="kvload.LLM draws no progress bar; llm.last_stats has the call's totals"))


    @checked_keywords
    @followed_by_ranks
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix, so the next call computes its prompts afresh (vLLM's ``LLM.reset_prefix_cache``,
        which benchmarks call between runs): True when it did (the audit's ``prefix_cache_reset``). False, with a
        ``setting_ignored``, when prefix reuse is off (nothing is cached). While a call runs on this LLM (a
        ``generate_stream`` still open, another thread generating) it raises ``GenerationError`` as every other call
        does: its requests hold the cache, and a False a benchmark never reads would time a warm cache as a cold one.

        vLLM's arguments, in its order: ``reset_running_requests`` (vLLM preempts the running requests first; here a
        reset runs only between calls, when no request runs, so true and false reset alike) and ``reset_connector``
        (vLLM's KV connector's cache too; kvload has no KV connector, so true is reported ``setting_ignored``, once
        per LLM).
        """
        reset_running_requests = checked_flag(reset_running_requests, lambda why: GenerationError(
            f"reset_prefix_cache: reset_running_requests: {why}"))
        reset_connector = checked_flag(reset_connector, lambda why: GenerationError(
            f"reset_prefix_cache: reset_connector: {why}"))
        with self._exclusive("reset_prefix_cache"), self._running("reset_prefix_cache") as executor:
            if reset_connector and not self._said_no_connector:  # said once: a benchmark resets between every run
                self._said_no_connector = True
                executor._event(SettingIgnored(
                    field="LLM.reset_prefix_cache.reset_connector", value=True,
                    reason="kvload has no KV connector (vLLM's kv_transfer_config) whose cache could be reset; the "
                           "prefix cache is reset as asked"))
            done, event = executor.reset_prefix_cache("LLM.reset_prefix_cache")
            executor._event(event)
            return done

    @checked_keywords
    def get_metrics(self, *, metrics_name_prefix: str = "kvload") -> list[Metric]:
        """vLLM's ``LLM.get_metrics()``: every series now, as ``kvload.metrics.Counter`` / ``Gauge`` / ``Histogram``
        records (``name``, ``labels``, then ``value`` or ``count``, ``sum``, ``buckets``), named as ``kvload serve``'s
        ``/metrics`` names them (``kvload_prompt_tokens``, ``kvload_request_success{finished_reason}``, ...).

        Counters and histograms count the ``generate`` / ``chat`` / ``generate_stream`` calls that returned (a
        histogram observes each prompt once); the prefix cache totals and KV usage per layer group are the manager's,
        read now. While a call runs on this LLM it raises ``GenerationError``, as every other call does.
        ``metrics_name_prefix="vllm"``: named as vLLM's own ``get_metrics()`` names them (``vllm:prompt_tokens``,
        labels ``model_name`` and ``engine``), as ``kvload serve --metrics-name-prefix vllm`` does.
        """
        if metrics_name_prefix not in METRIC_NAMINGS:
            raise GenerationError(f"get_metrics: metrics_name_prefix: expected one of {', '.join(METRIC_NAMINGS)}, "
                                  f"got {short_py(metrics_name_prefix)}")
        with self._exclusive("get_metrics"):
            manager = self.result.executor.manager
            return self._metrics.snapshot(None if getattr(manager, "closed", False) else manager.stats(),
                                          metrics_name_prefix)

    # --- lifetime -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if os.getpid() != self._pid:
            raise GenerationError(FORKED.format(pid=self._pid))
        if self._closed:
            raise GenerationError("generate: this LLM was closed (its KV pools and weights were released); "
                                  "create a new kvload.LLM")

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """One generate call at a time: the executor drives one batch of requests per call."""
        with errors_titled(what):
            self._check_open()
            if not self._busy.acquire(blocking=False):
                raise GenerationError(f"{what}: this LLM is already generating (a generate_stream is still open, "
                                      "or another thread is generating); finish or close it first")
            try:
                yield
            finally:
                self._busy.release()

    @contextlib.contextmanager
    def _running(self, call: str) -> Iterator[Any]:
        """The executor, with this thread registered as the one running it, so ``close()`` can stop it and wait
        (the result's :meth:`~kvload.api.LoadResult.running`), running as the user's ``call``."""
        self._check_open()
        with self.result.running() as executor, executor.called_as(call):
            yield executor

    def close(self) -> None:
        """Stop a running generation, wait for it to end, then release the KV pools and weights.

        The stopped call raises ``GenerationError`` (the audit records ``generation_failed``); with ``audit_log``,
        the file is rewritten with the generation events too. Safe to call twice, from any thread; in a forked child it
        only marks this copy closed (what it would release is the parent's).
        """
        self._closed = True
        if os.getpid() != self._pid:  # a forked child: the pools, the audit log and the running call are the parent's
            return
        ranks = self.__dict__.get("_ranks")
        if ranks is not None:
            ranks.stopping = True  # a call running now raises rank 0's "closed" error, not the ranks' end
        try:
            self.result.close(CLOSED_DURING_GENERATION)  # the result's: stop the call, wait for it, then release
        finally:
            if ranks is not None:
                ranks.close()

    def shutdown(self) -> None:
        """TensorRT-LLM's ``LLM.shutdown()``, which its scripts (and vLLM's proposed teardown) call: :meth:`close`."""
        self.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        """Only for what is missing: vLLM's attributes kvload lacks are named with what to use instead."""
        why = VLLM_ATTRIBUTES_NOT_TAKEN.get(name)
        if why is not None:
            raise AttributeError(f"LLM.{name}: vLLM's, not kvload's: {why}", name=name, obj=self)
        why = TRTLLM_ATTRIBUTES_NOT_TAKEN.get(name)
        if why is not None:
            raise AttributeError(f"LLM.{name}: TensorRT-LLM's, not kvload's: {why}", name=name, obj=self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.route.kv_manager} on {self.args.device}"
        return f"LLM({self.args.model!r}, {state})"


__all__ = ["DEFAULT_CPU_MAX_TOKENS", "LLM", "TRTLLM_ATTRIBUTES_NOT_TAKEN", "VLLM_ATTRIBUTES_NOT_TAKEN"]
