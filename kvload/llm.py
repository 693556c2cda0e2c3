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
import functools
import inspect
import os
import queue
import random
import re
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from engine.beam_search import BeamSearchOutput, BeamSearchParams
from engine.executor import StreamLeft
from engine.outputs import GenerationStats, RequestOutput, TokenDelta
from engine.pooling import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
    ScorePairsError,
    ScoringOutput,
    ScoringRequestOutput,
    cosine,
    pooled,
    pooled_vector,
    score_pairs,
)
from engine.prompts import check_tree, is_conversation, is_token_id, non_json_in
from engine.reasoning import PARSERS
from engine.sampling_params import SamplingParams, check_keywords, is_int
from kvload.api import LoadResult, api_request, execute
from kvload.llm_ranks import SpawnedRanks, spawn_size
from kvload.metrics import METRIC_NAMINGS, LlmMetrics, Metric
from models.classifier import ClassifierHead, head_logits, head_of, no_head, not_one_score, pair_ids, pair_length
from pipeline.audit import JsonlSink
from pipeline.bus import Subscriber
from pipeline.context import DEFAULT_MAX_TOKENS_FIELD, CallerDefault
from pipeline.errors import (
    ConfigError,
    GenerationError,
    KvBuildError,
    OutputError,
    did_you_mean,
    retitled,
    unknown_argument,
)
from pipeline.events import SettingIgnored
from pipeline.limits import MAX_INT, plain_scalar, short
from pipeline.ranks import ranks_from_env
from pipeline.thread_end import EndingThread
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


def _no_lora(call: str, lora_request: Any) -> None:
    """vLLM's ``lora_request``: None asks for the base weights, which is all kvload serves; so does vLLM's list of one
    per prompt when every one is None."""
    if isinstance(lora_request, (list, tuple)) and all(r is None for r in lora_request):
        return
    if lora_request is not None:
        raise GenerationError(f"{call}: lora_request: kvload serves the checkpoint's own weights and has no LoRA "
                              f"adapters; accepted: None, got {type(lora_request).__name__}")


#: vLLM's ``tokenization_kwargs`` keys kvload does not act on → what to do instead (``truncate_prompt_tokens`` acts)
TOKENIZATION_KWARGS_NOT_TAKEN: dict[str, str] = {
    "add_special_tokens": "kvload tokenizes a text prompt with the tokenizer's defaults (its BOS included); give the "
                          "token ids instead (tokenizer.encode(text, add_special_tokens=False))",
    **dict.fromkeys(("truncation", "max_length"),
                    "kvload cuts a prompt to its last k tokens with tokenization_kwargs={'truncate_prompt_tokens': k}"),
}
#: ``chat``'s word for ``add_special_tokens`` (its messages have no text of the caller's to encode)
_CHAT_SPECIAL_TOKENS = ("kvload's chat adds no special tokens to what the chat template writes (the template holds "
                        "them: add_special_tokens=False, the default of vLLM's chat requests); put a BOS in the "
                        "template (chat_template=...) if the model needs one more")
#: ``tokenization_kwargs``' values that ask for nothing kvload does not do already, taken as given (as
#: ``VLLM_FIELDS_AT_NO_OP`` takes SamplingParams' fields), so a script spelling vLLM's defaults out runs:
#: ``add_special_tokens`` at each call's own (True for a text prompt, vLLM's default; False on ``chat``), no
#: ``truncation``, no ``max_length``
TOKENIZATION_KWARGS_AT_NO_OP: dict[str, tuple[Any, ...]] = {"truncation": (False, None), "max_length": (None,)}


def _at_no_op(call: str, key: str, value: Any) -> bool:
    """Whether ``tokenization_kwargs[key] = value`` asks for nothing on ``call`` (bools and None by identity: 1 or
    0 is not taken as true or false)."""
    if key == "add_special_tokens":
        return value is (call != "chat")
    return any(value is v for v in TOKENIZATION_KWARGS_AT_NO_OP.get(key, ()))


def _tokenization_cut(call: str, tokenization_kwargs: Any) -> Any:
    """vLLM's ``tokenization_kwargs`` (where vLLM now takes the prompt cut, ``SamplingParams.truncate_prompt_tokens``
    and the pooling calls' argument being deprecated for it): its ``truncate_prompt_tokens`` (None when it has none);
    None or ``{}`` asks for nothing, and so do vLLM's other keys at values that ask for nothing
    (:data:`TOKENIZATION_KWARGS_AT_NO_OP`); another key or value is refused naming it, with what to do instead."""
    if tokenization_kwargs is None:
        return None
    if not isinstance(tokenization_kwargs, Mapping):
        raise GenerationError(f"{call}: tokenization_kwargs: expected a dict (kvload acts on its "
                              f"truncate_prompt_tokens) or None, got {short(tokenization_kwargs)}")
    for key, value in tokenization_kwargs.items():
        if key == "truncate_prompt_tokens" or (isinstance(key, str) and _at_no_op(call, key, value)):
            continue
        # a plain name as written; anything else (a newline, a lone surrogate, not a str) as its repr, cut, so the
        # message stays one printable line
        name = key if isinstance(key, str) and key.isidentifier() and len(key) <= 80 else short(key)
        if key in TOKENIZATION_KWARGS_NOT_TAKEN:
            why = _CHAT_SPECIAL_TOKENS if call == "chat" and key == "add_special_tokens" \
                else TOKENIZATION_KWARGS_NOT_TAKEN[key]
            raise GenerationError(f"{call}: tokenization_kwargs.{name}={short(value)}: vLLM's, not kvload's: {why}; "
                                  "kvload acts on tokenization_kwargs' truncate_prompt_tokens only")
        known = ["truncate_prompt_tokens", *TOKENIZATION_KWARGS_NOT_TAKEN]
        typo = did_you_mean(key, known) if isinstance(key, str) else ""
        raise GenerationError(f"{call}: tokenization_kwargs.{name}: not a setting kvload's tokenization takes; kvload "
                              f"acts on tokenization_kwargs' truncate_prompt_tokens only{typo}")
    return tokenization_kwargs.get("truncate_prompt_tokens")


def _one_cut(call: str, given: Any, cut: Any, where: str) -> Any:
    """The prompt cut of a call that has it twice (``where``'s and ``tokenization_kwargs``'): one value, or one line
    when they differ."""
    if cut is None or given is None:
        return given if cut is None else cut
    for value in (given, cut):  # no cut at all (NaN, a str): its own check answers, where "they differ" misled
        if not is_int(value):
            return value
    if given == cut:
        return cut
    raise GenerationError(f"{call}: truncate_prompt_tokens: {short(given)} in {where} and {short(cut)} in "
                          "tokenization_kwargs differ; give it once")


def _call_cut(call: str, truncate_prompt_tokens: Any, tokenization_kwargs: Any) -> Any:
    """A pooling call's prompt cut: its ``truncate_prompt_tokens`` argument or ``tokenization_kwargs``' (vLLM's newer
    place for it), one value; one line when they differ."""
    cut = _tokenization_cut(call, tokenization_kwargs)
    return _one_cut(call, truncate_prompt_tokens, cut, "the call's argument")


def _cut_sampling(call: str, sampling_params: Any, sampling: dict[str, Any], cut: Any) -> tuple[Any, dict[str, Any]]:
    """``generate`` / ``chat``'s sampling with ``tokenization_kwargs``' ``truncate_prompt_tokens`` (``cut``) set: on
    the keywords when no SamplingParams is given, else on a copy of each (the caller's objects stay as given)."""
    if cut is None:
        return sampling_params, sampling
    if sampling_params is None:
        keyword = sampling.get("truncate_prompt_tokens")
        return None, {**sampling, "truncate_prompt_tokens": _one_cut(call, keyword, cut, "the keywords")}
    many = isinstance(sampling_params, (list, tuple))
    cut_params = []
    for i, params in enumerate(sampling_params if many else [sampling_params]):
        if isinstance(params, SamplingParams):  # anything else: refused by the call, naming it
            where = f"sampling_params[{i}]" if many else "sampling_params"
            with _named(call):
                cut_copy = attrs.evolve(params, truncate_prompt_tokens=_one_cut(call, params.truncate_prompt_tokens,
                                                                                cut, where))
            # vLLM's no-op fields too (evolve takes the settings only): generate checks them again on the copy
            object.__setattr__(cut_copy, "_vllm_fields", params._vllm_fields)
            params = cut_copy
        cut_params.append(params)
    return (cut_params if many else cut_params[0]), sampling


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


class StreamClosed(Exception):
    """Raised inside the generation thread when the consumer of ``generate_stream`` went away."""


@contextlib.contextmanager
def _named(call: str) -> Iterator[None]:
    """Errors the shared executor titles ``generate:`` name the call the user made (``chat:``, ``beam_search:``,
    ``reward:``), a prompt the KV pools cannot hold (``KvBuildError``) too."""
    try:
        yield
    except (GenerationError, KvBuildError) as e:
        if e.args and isinstance(e.args[0], str):
            e.args = (retitled(e.args[0], call), *e.args[1:])
        raise


def _followed(method: Callable[..., Any]) -> Callable[..., Any]:
    """A method that runs the engine: with ranks this LLM started (``tensor_parallel_size`` outside torchrun), every
    rank makes the call too (:mod:`kvload.llm_ranks`)."""
    @functools.wraps(method)
    def call(self: LLM, *args: Any, **kwargs: Any) -> Any:
        ranks = self.__dict__.get("_ranks")
        if ranks is None:
            return method(self, *args, **kwargs)
        return ranks.call(method.__name__, method, self, args, kwargs)

    return call


def _keywords(method: Callable[..., Any]) -> Callable[..., Any]:
    """A public call's keywords checked before it runs: one it does not take is a ``GenerationError`` naming it, with
    the argument (or, for a call that takes sampling fields as keywords, the field) it is close to; Python's own
    TypeError ("unexpected keyword argument 'pooling_param'") suggested nothing."""
    params = list(inspect.signature(method).parameters.values())
    own = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]
    by_position = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.name != "self"]
    sampling = any(p.kind is p.VAR_KEYWORD for p in params)
    taken, call = frozenset(own), method.__name__

    @functools.wraps(method)
    def checked(self: LLM, *args: Any, **kwargs: Any) -> Any:
        extra = [k for k in kwargs if k not in taken]
        if extra:
            if sampling:  # the rest are sampling fields: checked as the call would, with its own names suggested too
                with _named(call):
                    check_keywords({k: kwargs[k] for k in extra}, own)
            else:
                name = extra[0]
                if name in by_position:
                    raise GenerationError(f"{call}: {name}: given by position ({call}({', '.join(by_position)}, "
                                          "...)), not as a keyword")
                raise GenerationError(unknown_argument(call, name, own))
        return method(self, *args, **kwargs)

    return checked


def _is_ids_row(value: Any) -> bool:
    """A prompt's token ids as a row: a list or tuple, or a 1-D array / tensor (not a text, not a dict)."""
    return getattr(value, "ndim", None) == 1 or isinstance(value, (list, tuple))


def _legacy_ids(value: Any) -> tuple[list[Any], bool]:
    """vLLM's older ``generate(prompt_token_ids=...)`` as prompts, and whether it was one prompt's ids: one list of
    token ids, or a list of them; anything else is refused naming the keyword (a text was taken as a prompt's text,
    a number said "prompts: expected a string or a list of prompts")."""
    if getattr(value, "ndim", None) == 1:
        return [value], True
    if getattr(value, "ndim", None) == 2:
        return list(value), False
    if isinstance(value, (list, tuple)):
        if not value:  # said by the prompts' own check, under this name
            return [], False
        if not any(_is_ids_row(t) or isinstance(t, (str, bytes, Mapping)) for t in value):
            return [value], True  # one prompt's ids: each checked as a token id, under this name
        if all(_is_ids_row(t) for t in value):
            return list(value), False
    raise GenerationError(f"generate: prompt_token_ids: expected a list of token ids (ints) or a list of such "
                          f"lists, got {short(value)}")


def _as_legacy_ids(message: str, flat: bool) -> str:
    """A prompt's error (``generate: prompt 1: ...``, ``generate: prompts: ...``) named by ``prompt_token_ids``, the
    keyword the ids were given as (``prompt_token_ids[1]``; one list's: ``prompt_token_ids``)."""
    found = re.match(r"generate: prompt(?:s| (\d+)): ", message)
    if found is None:
        return message
    where = "prompt_token_ids" if flat or found.group(1) is None else f"prompt_token_ids[{found.group(1)}]"
    rest = message[found.end():].replace("expected a string or a list of token ids", "expected a list of token ids")
    return f"generate: {where}: {rest}"


def _one_or_many(data: Any) -> list[Any]:
    """``LLM.score``'s side as a list of prompts: one prompt (a text, a prompt dict, token ids) or a list of them."""
    if isinstance(data, (str, Mapping)) or getattr(data, "ndim", None) == 1:
        return [data]
    if isinstance(data, Sequence) and data and all(is_token_id(t) for t in data):
        return [data]
    return list(data) if isinstance(data, Sequence) else [data]


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


class LLM:
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

    @_keywords
    def get_world_size(self, include_dp: bool = True) -> int:
        """vLLM's ``LLM.get_world_size``: the ranks the model runs on, ``tensor_parallel_size`` (kvload has no
        pipeline or data parallelism, so ``include_dp`` changes nothing: both counts are the same)."""
        if not isinstance(include_dp, bool):
            raise GenerationError(f"get_world_size: include_dp: expected true or false, got {short(include_dp)}")
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

    @_keywords
    @_followed
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
        _no_lora("generate", lora_request)
        sampling_params, sampling = _cut_sampling("generate", sampling_params, sampling,
                                                  _tokenization_cut("generate", tokenization_kwargs))
        if prompt_token_ids is None:
            return self._generate("generate", prompts, sampling_params, use_tqdm, salt, chat, sampling, priority)
        # vLLM's legacy keyword (scripts written for vLLM before 0.10 pass it)
        if prompts is not None:
            raise GenerationError("generate: give the prompts as prompts or as prompt_token_ids, not both (a "
                                  "text with its ids: {'prompt_token_ids': IDS})")
        prompts, flat = _legacy_ids(prompt_token_ids)
        try:
            return self._generate("generate", prompts, sampling_params, use_tqdm, salt, chat, sampling, priority)
        except GenerationError as e:  # the prompts' errors name the keyword the user gave them as
            if e.args and isinstance(e.args[0], str):
                e.args = (_as_legacy_ids(e.args[0], flat), *e.args[1:])
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

    @_keywords
    @_followed
    def embed(self, prompts: Any, *, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: Any = None, lora_request: Any = None,
              tokenization_kwargs: Mapping[str, Any] | None = None,
              salt: str | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed`` for a decoder model: one :class:`EmbeddingRequestOutput` per prompt, in order, its
        ``outputs.embedding`` the final norm's output at the prompt's last token, L2-normalized (vLLM's LAST pooling
        and its embed task's default; ``PoolingParams(use_activation=False)``: as computed).

        ``prompts`` as :meth:`generate` takes them (text, token ids, vLLM's prompt dicts). ``pooling_params``: one
        :class:`PoolingParams` for every prompt or a list of one per prompt. ``truncate_prompt_tokens``: keep each
        prompt's last N tokens (-1: the model's length), as ``PoolingParams.truncate_prompt_tokens`` (vLLM's
        ``tokenization_kwargs={"truncate_prompt_tokens": N}`` too, where vLLM now takes it). The prompt is
        prefilled as a generate call's is (its prefix cached and reused); the one token its logits give is dropped as
        it is drawn, its KV never written, so a prompt may have up to ``max_seq_len`` tokens (vLLM's
        ``max_model_len``; -1 keeps that many).
        """
        truncate_prompt_tokens = _call_cut("embed", truncate_prompt_tokens, tokenization_kwargs)
        return self._embed("embed", prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request, salt)

    @_keywords
    @_followed
    def score(self, data_1: Any, data_2: Any, /, *, truncate_prompt_tokens: int | None = None, use_tqdm: Any = None,
              pooling_params: PoolingParams | None = None, lora_request: Any = None,
              tokenization_kwargs: Mapping[str, Any] | None = None,
              salt: str | None = None) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: one :class:`ScoringRequestOutput` per pair, in order (``outputs.score``). ``data_1``
        one prompt scored against each of ``data_2`` (one or a list), or a list as long as ``data_2``, scored pairwise.
        An embedding model scores a pair by the cosine similarity of its two :meth:`embed` vectors (prompts as
        :meth:`generate` takes them, every prompt embedded in one batch); a one-label classifier (a cross-encoder) by
        its head's logit through sigmoid over the pair as one sequence (texts, joined by the tokenizer as vLLM joins
        them; ``PoolingParams(use_activation=False)``: the logit), every pair in one batch."""
        truncate_prompt_tokens = _call_cut("score", truncate_prompt_tokens, tokenization_kwargs)
        firsts, seconds = _one_or_many(data_1), _one_or_many(data_2)
        try:
            pairs = score_pairs(len(firsts), len(seconds))
        except ScorePairsError as e:
            raise GenerationError(f"score: {e}") from None
        head = head_of(self.result.hf_model)
        if head is not None:
            return self._cross_score(head, firsts, seconds, pairs, pooling_params, truncate_prompt_tokens, use_tqdm,
                                     lora_request, salt)
        outs = self._embed("score", [*firsts, *seconds], pooling_params, truncate_prompt_tokens, use_tqdm,
                           lora_request, salt)
        vectors = [torch.tensor(o.outputs.embedding) for o in outs]
        scores = []
        for i, j in pairs:
            a, b = outs[i], outs[j]
            scores.append(ScoringRequestOutput(request_id=f"{a.request_id}_{b.request_id}",
                                               outputs=ScoringOutput(cosine(vectors[i], vectors[j])),
                                               prompt_token_ids=[*a.prompt_token_ids, *b.prompt_token_ids]))
        return scores

    def _cross_score(self, head: ClassifierHead, firsts: list[Any], seconds: list[Any], pairs: list[tuple[int, int]],
                     pooling_params: Any, truncate_prompt_tokens: int | None, use_tqdm: Any, lora_request: Any,
                     salt: str | None) -> list[ScoringRequestOutput]:
        """:meth:`score` of a cross-encoder: each pair tokenized as one sequence, scored by the head."""
        why = not_one_score("score", head)
        if why is not None:
            raise GenerationError(why)
        if isinstance(pooling_params, Sequence):
            raise GenerationError("score: pooling_params: expected one kvload.PoolingParams for every pair, got a "
                                  "list")
        texts = []
        for k, prompt in enumerate([*firsts, *seconds]):
            side, i = ("data_1", k) if k < len(firsts) else ("data_2", k - len(firsts))
            text = prompt.get("prompt") if isinstance(prompt, Mapping) and set(prompt) == {"prompt"} else prompt
            if not isinstance(text, str):
                raise GenerationError(f"score: {side}[{i}]: a cross-encoder scores texts (its tokenizer joins each "
                                      f"pair as one sequence), got {short(prompt)}")
            texts.append(text)
        if self.tokenizer is None:
            raise GenerationError(f"score: {self.args.model} has no tokenizer to join each pair as one sequence")
        config = self.result.hf_model.config
        keep = truncate_prompt_tokens
        if keep is None and isinstance(pooling_params, PoolingParams):
            keep = pooling_params.truncate_prompt_tokens
        PoolingParams(truncate_prompt_tokens=keep)  # its check, its message, before the tokenizer takes it
        # the pair tokenized to that length cuts the longer text (vLLM's truncation=True): the query is kept; _pool's
        # cut to the last N tokens then has nothing left to cut
        length = pair_length(keep, self.args.max_seq_len)
        ids = [pair_ids(self.tokenizer, config, texts[i], texts[j], length) for i, j in pairs]
        outputs, rows, pooling = self._pool("score", ids, pooling_params, truncate_prompt_tokens, use_tqdm,
                                            lora_request, salt)
        logits = head_logits(self.result.hf_model, rows)
        return [ScoringRequestOutput(request_id=out.request_id, prompt_token_ids=list(out.prompt_token_ids),
                                     outputs=ScoringOutput(head.scores(row[None], p.use_activation is not False)[0]))
                for out, row, p in zip(outputs, logits, pooling, strict=True)]

    def _embed(self, call: str, prompts: Any, pooling_params: Any, truncate_prompt_tokens: int | None, use_tqdm: Any,
               lora_request: Any, salt: str | None) -> list[EmbeddingRequestOutput]:
        """:meth:`embed` as ``call`` (``embed`` or ``score``), which titles its errors."""
        outputs, rows, pooling = self._pool(call, prompts, pooling_params, truncate_prompt_tokens, use_tqdm,
                                            lora_request, salt)
        return [EmbeddingRequestOutput(
            request_id=out.request_id, prompt=out.prompt, prompt_token_ids=list(out.prompt_token_ids),
            num_cached_tokens=out.num_cached_tokens, outputs=EmbeddingOutput(pooled_vector(row, p.use_activation)))
            for out, row, p in zip(outputs, rows, pooling, strict=True)]

    def _pool(self, call: str, prompts: Any, pooling_params: Any, truncate_prompt_tokens: int | None, use_tqdm: Any,
              lora_request: Any, salt: str | None, every_token: bool = False) -> tuple[
                  list[RequestOutput], list[torch.Tensor], list[PoolingParams]]:
        """Every prompt prefilled in one batch, as ``call`` (which titles its errors): each prompt's output, its last
        hidden row (the final norm's output at its last token; ``every_token``: a ``(tokens, hidden)`` tensor of
        every prompt token's, the prompt computed whole) and its PoolingParams, in order."""
        _no_lora(call, lora_request)
        with _named(call):
            # a text is not a list of PoolingParams (its letters were taken as one each)
            per_prompt = isinstance(pooling_params, Sequence) and not isinstance(pooling_params, (str, bytes))
            given = list(pooling_params) if per_prompt else [pooling_params]  # type: ignore[arg-type]
            for i, p in enumerate(given):
                if p is not None and not isinstance(p, PoolingParams):
                    where = f"pooling_params[{i}]" if per_prompt else "pooling_params"
                    raise GenerationError(f"{call}: {where}: expected a kvload.PoolingParams, got "
                                          f"{type(p).__name__}")
            pooling = [p if p is not None else PoolingParams() for p in given]
            if truncate_prompt_tokens is not None:
                PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)  # its check, its message
                clash = next((p for p in pooling if p.truncate_prompt_tokens not in (None, truncate_prompt_tokens)),
                             None)
                if clash is not None:
                    raise GenerationError(f"{call}: truncate_prompt_tokens {truncate_prompt_tokens} and "
                                          f"pooling_params' truncate_prompt_tokens {clash.truncate_prompt_tokens} "
                                          "differ; give one")
                pooling = [attrs.evolve(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in pooling]
            # the prefill's forward gives the hidden state; its one greedy token is computed and dropped
            sampling = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                       truncate_prompt_tokens=p.truncate_prompt_tokens) for p in pooling]
        with self._exclusive(call):
            self._no_progress_bar(use_tqdm, call)
            with self._running(call) as executor:
                outputs = executor.run(prompts, sampling if per_prompt else sampling[0], salt=salt, pool=True,
                                       every_token=every_token)
                rows = [executor.pooled.take(o.request_id) for o in outputs]
        for i, row in enumerate(rows):
            if row is None:  # every prompt's last token is computed by some step: a missing row is a bug, said so
                raise GenerationError(f"{call}: prompt {i}: its last hidden state was not captured")
        return outputs, rows, [pooling[i if per_prompt else 0] for i in range(len(outputs))]  # type: ignore[misc]

    def _head(self, call: str) -> ClassifierHead:
        """The loaded classifier's head; ``GenerationError`` for a generative model, which has none."""
        head = head_of(self.result.hf_model)
        if head is None:
            raise GenerationError(no_head(call, str(self.args.model), self.result.model.architecture))
        return head

    @_keywords
    @_followed
    def classify(self, prompts: Any, *, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 truncate_prompt_tokens: int | None = None, use_tqdm: Any = None, lora_request: Any = None,
                 tokenization_kwargs: Mapping[str, Any] | None = None,
                 salt: str | None = None) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify`` for a ``*ForSequenceClassification`` checkpoint: one
        :class:`ClassificationRequestOutput` per prompt, in order, its ``outputs.probs`` the classifier head's logits at
        the prompt's last token through softmax (sigmoid for one label; ``PoolingParams(use_activation=False)``: the
        logits as computed). Arguments as :meth:`embed`'s; a generative model has no head (``GenerationError``)."""
        truncate_prompt_tokens = _call_cut("classify", truncate_prompt_tokens, tokenization_kwargs)
        head = self._head("classify")
        outputs, rows, pooling = self._pool("classify", prompts, pooling_params, truncate_prompt_tokens, use_tqdm,
                                            lora_request, salt)
        return [ClassificationRequestOutput(
            request_id=out.request_id, prompt=out.prompt, prompt_token_ids=list(out.prompt_token_ids),
            num_cached_tokens=out.num_cached_tokens,
            outputs=ClassificationOutput(head.probs(logits, p.use_activation is not False).tolist()))
            for out, logits, p in zip(outputs, head_logits(self.result.hf_model, rows), pooling, strict=True)]

    @_keywords
    @_followed
    def reward(self, prompts: Any, *, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               truncate_prompt_tokens: int | None = None, use_tqdm: Any = None, lora_request: Any = None,
               tokenization_kwargs: Mapping[str, Any] | None = None,
               salt: str | None = None) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.reward`` (its ``token_classify`` pooling) for a classifier checkpoint: one
        :class:`PoolingRequestOutput` per prompt, in order, its ``outputs.data`` a ``(prompt tokens, labels)`` float32
        tensor: the classifier head applied to every prompt token's final norm output, each row activated as
        :meth:`classify` activates its one (its last row is that call's ``probs``). Each prompt is computed whole (a
        cached prefix gives no rows), so ``num_cached_tokens`` is 0. Arguments as :meth:`classify`'s; a generative
        model has no head to score tokens with (``GenerationError``)."""
        truncate_prompt_tokens = _call_cut("reward", truncate_prompt_tokens, tokenization_kwargs)
        head = self._head("reward")
        outputs, rows, pooling = self._pool("reward", prompts, pooling_params, truncate_prompt_tokens, use_tqdm,
                                            lora_request, salt, every_token=True)
        model = self.result.hf_model
        return [PoolingRequestOutput(
            request_id=out.request_id, prompt=out.prompt, prompt_token_ids=list(out.prompt_token_ids),
            num_cached_tokens=out.num_cached_tokens,
            outputs=PoolingOutput(head.probs(head_logits(model, tokens), p.use_activation is not False)))
            for out, tokens, p in zip(outputs, rows, pooling, strict=True)]

    @_keywords
    @_followed
    def encode(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: Any = None, lora_request: Any = None,
               pooling_task: str | None = None, tokenization_kwargs: Mapping[str, Any] | None = None,
               salt: str | None = None) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.encode``: one :class:`PoolingRequestOutput` per prompt, in order, its ``outputs.data`` a
        float32 tensor pooled by ``pooling_task``, one of the tasks the model serves (vLLM's adapters give them):

        - a classifier (``*ForSequenceClassification``, ``*ForTokenClassification``, a causal LM under
          ``convert="classify"``): ``token_classify``, a ``(prompt tokens, labels)`` tensor of every token's class
          probabilities (:meth:`reward`'s rows; a token classifier's per-token labels), and ``classify``, the last
          token's (:meth:`classify`'s ``probs``); ``PoolingParams(use_activation=False)``: the logits;
        - a generative model: ``token_embed``, a ``(prompt tokens, hidden)`` tensor of every token's final norm
          output, and ``embed``, the last token's (:meth:`embed`'s vector), each row L2-normalized unless
          ``PoolingParams(use_activation=False)``.

        ``pooling_task`` is required, as vLLM requires it; a task the model does not serve is a ``GenerationError``
        naming those it does. A per-token task's prompt is computed whole (``num_cached_tokens`` 0). Other arguments
        as :meth:`embed`'s."""
        truncate_prompt_tokens = _call_cut("encode", truncate_prompt_tokens, tokenization_kwargs)
        model = self.result.hf_model
        head = head_of(model)
        tasks = ("token_classify", "classify") if head is not None else ("token_embed", "embed")
        if pooling_task not in tasks:
            kind = (f"{head.architecture}, a classifier" if head is not None else
                    f"{self.result.model.architecture}, a generative model: no classifier head")
            accepted = ", ".join(f'"{t}"' for t in tasks)
            if pooling_task is None:
                raise GenerationError(f"encode: pooling_task: required, as vLLM's LLM.encode requires it; this model "
                                      f"({kind}) serves {accepted}")
            raise GenerationError(f"encode: pooling_task: {short(pooling_task)} is not served by this model "
                                  f"({kind}); accepted: {accepted}")
        every = pooling_task.startswith("token_")
        outputs, rows, pooling = self._pool("encode", prompts, pooling_params, truncate_prompt_tokens, use_tqdm,
                                            lora_request, salt, every_token=every)
        if head is None:
            data = [pooled(row, p.use_activation is not False) for row, p in zip(rows, pooling, strict=True)]
        elif every:
            data = [head.probs(head_logits(model, tokens), p.use_activation is not False)
                    for tokens, p in zip(rows, pooling, strict=True)]
        else:
            data = [head.probs(logits, p.use_activation is not False)
                    for logits, p in zip(head_logits(model, rows), pooling, strict=True)]
        return [PoolingRequestOutput(request_id=out.request_id, prompt=out.prompt,
                                     prompt_token_ids=list(out.prompt_token_ids),
                                     num_cached_tokens=out.num_cached_tokens, outputs=PoolingOutput(d))
                for out, d in zip(outputs, data, strict=True)]

    @_keywords
    @_followed
    def beam_search(self, prompts: Any, params: BeamSearchParams, lora_request: Any = None, use_tqdm: Any = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: the best ``params.beam_width`` hypotheses of every prompt, best first.

        Every live beam is a running request that computes one token a step, a new beam a fork of its parent
        (``engine.beam_search``); the width is bounded by the load's ``max_beam_width``
        (``LLM(model, max_beam_width=4)``). vLLM's other arguments, in its order: ``lora_request`` (only None, as
        :meth:`generate`'s), ``use_tqdm`` (as :meth:`generate`'s) and ``concurrency_limit`` (at most this many
        prompts searched at once, the next ones after them: less KV held at a time, the same hypotheses).
        """
        _no_lora("beam_search", lora_request)
        if concurrency_limit is not None and not (is_int(concurrency_limit) and concurrency_limit >= 1):
            raise GenerationError(f"beam_search: concurrency_limit: expected an integer >= 1 (prompts searched at "
                                  f"once) or None, got {short(concurrency_limit)}")
        with self._exclusive("beam_search"):
            self._no_progress_bar(use_tqdm, "beam_search")
            with self._running("beam_search") as executor:
                # the groups are cut from the checked prompts, so a refusal names a prompt by its place in prompts
                # (a group's slice named the third prompt "prompt 0", once the groups before it had been searched)
                return executor.beam_search(prompts, params, concurrency_limit=concurrency_limit)

    @_keywords
    @_followed
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
        _no_lora("chat", lora_request)
        sampling_params, sampling = _cut_sampling("chat", sampling_params, sampling,
                                                  _tokenization_cut("chat", tokenization_kwargs))
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise GenerationError(f"chat: tools: expected a list of tool definitions (dicts), got {tools!r}"[:200])
            # OpenAI's tool definitions are JSON, and a template reads them as such (tojson): bytes or an object in
            # one failed there, or passed unread by a template that ignores tools
            found = non_json_in(tools, "tools")
            if found is not None:
                raise GenerationError(f"chat: {found[0]}: expected JSON values (a tool definition is an object such "
                                      "as {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}), "
                                      f"got {short(found[1])}")
            with _named("chat"):  # named as given, before they join the template's variables
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
                                  f"{messages!r}"[:200])
        options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                   "chat_template": chat_template, "chat_template_kwargs": chat_template_kwargs,
                   "chat_template_content_format": chat_template_content_format}  # checked by run
        return self._generate("chat", list(conversations), sampling_params, use_tqdm, salt, options, sampling)

    def _no_progress_bar(self, use_tqdm: Any, call: str = "generate") -> None:
        """vLLM's ``use_tqdm``: false needs nothing; true (or a tqdm factory) is said to be ignored, once; anything
        else (a text, a number, a list) is refused, as vLLM's type says, rather than read as true or false."""
        flag = plain_scalar(use_tqdm)
        # numpy's bool (np.bool_, np.bool in numpy 2) as a bool
        boolean = isinstance(flag, bool) or type(flag).__name__ in ("bool", "bool_") or (
            type(flag) is int and flag in (0, 1))
        if not (flag is None or boolean or callable(flag)):
            raise GenerationError(f"{call}: use_tqdm: expected true, false or a tqdm factory (a callable), got "
                                  f"{short(use_tqdm)}")
        if not use_tqdm or self._said_no_tqdm:
            return
        self._said_no_tqdm = True
        if self.result.bus is not None:
            self.result.bus.emitter("generate")(SettingIgnored(
                field="generate.use_tqdm", value=use_tqdm if isinstance(use_tqdm, bool) else repr(use_tqdm),
                reason="kvload.LLM draws no progress bar; llm.last_stats has the call's totals"))

    @_keywords
    def generate_stream(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                        *, salt: str | None = None, chat: bool = False, lora_request: Any = None,
                        **sampling: Any) -> Iterator[TokenDelta]:
        """Yield a :class:`TokenDelta` per generated token of every sample, as the tokens are produced.

        A sample's ``delta.text`` pieces concatenate to its final text; its last delta has
        ``finish_reason`` set, and a prompt's last delta carries the prompt's ``RequestOutput``.
        Generation runs in a background thread; leaving the loop early (``break``, an exception)
        stops it and frees its KV blocks. Sampling settings are checked here, the prompts on the
        first ``next()``. ``lora_request``: as :meth:`generate`'s, only None. With ranks this LLM
        started, they run the stream too and stop after the same step as rank 0 (:mod:`kvload.llm_ranks`).
        """
        with _named("generate_stream"):  # checked now, as the call will build them (over the model's defaults)
            self._check_open()
            _no_lora("generate_stream", lora_request)
            self.result.executor._params(sampling_params, sampling, 0)
        return self._stream(prompts, sampling_params, sampling, salt, chat)

    def _followed_stream(self, prompts: Any, sampling_params: Any = None, *, salt: str | None = None,
                         chat: bool = False, **sampling: Any) -> None:
        """On a rank ``kvload.LLM`` started: rank 0's ``generate_stream`` made here, its tokens dropped, ending after
        the step where rank 0's consumer stopped reading (:mod:`kvload.llm_ranks`)."""
        with contextlib.suppress(StreamLeft):
            for _ in self._stream(prompts, sampling_params, sampling, salt, chat, follow=True):
                pass

    def _stream(self, prompts: Any, params: Any, sampling: dict[str, Any], salt: str | None,
                chat: bool, follow: bool = False) -> Iterator[TokenDelta]:
        with self._exclusive("generate_stream"):
            items: queue.SimpleQueue[Any] = queue.SimpleQueue()
            closed = threading.Event()
            done = object()
            ranks = self._ranks
            # with ranks this LLM started, rank 0 says at each step whether its consumer left, and every rank stops
            # after that same step (engine.executor's stream_stop); a rank's own stop would leave the others mid-step
            in_step = ranks is not None or follow
            ended: list[BaseException | None] = [None]

            def on_delta(delta: TokenDelta) -> None:
                if closed.is_set():
                    if in_step:
                        return  # the step's answer stops every rank after this step
                    raise StreamClosed("the generate_stream consumer stopped reading")
                items.put(delta)

            def work() -> None:
                try:
                    with self._running("generate_stream") as executor, \
                            executor.stream_stopped_by(closed.is_set) if in_step else contextlib.nullcontext():
                        outputs = executor.run(prompts, params, salt=salt, chat=chat, on_delta=on_delta, **sampling)
                        self._metrics.record(outputs, executor.last_stats)
                except BaseException as exc:  # handed to the consumer, which raises it
                    ended[0] = exc
                    items.put(exc)
                else:
                    items.put(done)

            if ranks is not None:  # every other rank makes the call too (its _followed_stream)
                ranks.begin("generate_stream", LLM.generate_stream, self, (prompts, params),
                            {"salt": salt, "chat": chat, **sampling})

            worker = EndingThread(target=work, name="kvload-generate-stream", daemon=True)
            worker.start()
            try:
                while True:
                    item = items.get()
                    if item is done:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                closed.set()
                # it stops at its next token; a Ctrl-C meanwhile is raised once it has, so a caller that handles it
                # (a REPL) finds the LLM free, not "already generating" (see pipeline.thread_end)
                try:
                    worker.wait_end()
                finally:
                    if ranks is not None:  # the consumer leaving is no failure: every rank stopped after one step
                        ranks.end("generate_stream", None if isinstance(ended[0], StreamLeft) else ended[0])

    @_keywords
    @_followed
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
        for name, value in (("reset_running_requests", reset_running_requests), ("reset_connector", reset_connector)):
            if not isinstance(value, bool):
                raise GenerationError(f"reset_prefix_cache: {name}: expected true or false, got {short(value)}")
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

    @_keywords
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
                                  f"got {metrics_name_prefix!r}")
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
        with _named(what):
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
        if why is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)
        raise AttributeError(f"LLM.{name}: vLLM's, not kvload's: {why}", name=name, obj=self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.route.kv_manager} on {self.args.device}"
        return f"LLM({self.args.model!r}, {state})"


__all__ = ["DEFAULT_CPU_MAX_TOKENS", "LLM", "VLLM_ATTRIBUTES_NOT_TAKEN"]
