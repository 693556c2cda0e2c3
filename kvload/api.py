"""The Python API: ``plan`` (stages 1–5 and the KV plan, no allocation) and ``load`` (all stages); ``LoadResult``."""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs

from engine.sampling_params import SamplingParams
from pipeline.bus import Subscriber
from pipeline.context import PUBLIC_CALL_KEYWORDS, LoadRequest
from pipeline.errors import ConfigError, GenerationError
from pipeline.run import RunResult, flag_argument, path_argument
from pipeline.run import execute as run_stages
from pipeline.runner import Pipeline, Stage
from stages import load_stages, plan_stages, resolve_stages

#: what a generate call stopped by :meth:`LoadResult.close` raises
RESULT_CLOSED_DURING_GENERATION = ("generate: the result was closed during generation (LoadResult.close(), or leaving "
                                   "its with block); the call was stopped and its KV blocks freed")


class _Calls:
    """Where :meth:`LoadResult.close` and the generate call running on the result meet: close stops the call through
    its executor (``executor.stop``: it fails between two steps, freeing its requests), waits for it, then releases.
    A close from inside the call (a stream callback, a subscriber) cannot wait for it: the call releases as it ends.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle = threading.Event()
        self.idle.set()
        self.runner: threading.Thread | None = None  # the thread inside the executor now
        self.executor: Any = None  # the running call's executor, which close() asks to stop
        self.closed = False
        self.release_deferred = False
        self.release_lock = threading.Lock()  # held through the release: a second close() returns once it is done
        self.released = False


@attrs.define
class LoadResult(RunResult):
    """What ``plan``/``load`` produced (args, route, model, audit, context), and generation over a loaded model."""

    _executor: Any = attrs.field(default=None, init=False, repr=False)
    _calls: _Calls = attrs.field(factory=_Calls, init=False, repr=False)

    @property
    def executor(self) -> Any:
        """The generation executor over this result's model, KV manager and scheduler (built on first use)."""
        if self._executor is None:
            from engine.executor import GenerationExecutor  # torch: only when generating

            self._executor = GenerationExecutor.from_result(self)
        return self._executor

    def generate(self, prompts: Any, sampling_params: SamplingParams | None = None, **kwargs: Any) -> list[Any]:
        """Generate through the routed KV manager with continuous batching; one output per prompt, in order.

        Needs ``load(..., load_weights=True)``. ``prompts``: a string or a list of strings (tokenized;
        ``chat=True`` applies the chat template) and/or lists of token ids. ``sampling_params`` (or its
        fields as keywords: ``max_tokens``/``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
        ``seed``, ``stop``, ``stop_token_ids``, ``logprobs``, ``ignore_eos``) says how tokens are picked;
        ``salt``, ``chat``, ``stream`` and ``arrival_steps`` as in
        :meth:`engine.executor.GenerationExecutor.generate`. Each output has ``text`` (None without a
        tokenizer), ``token_ids`` (generated only), ``prompt_token_ids``, ``reused_prompt_tokens``,
        ``finish_reason`` ("stop" or "length"), ``stop_reason``, ``logprobs`` and ``timings``; the call's
        totals are in ``executor.last_stats``. One sample per prompt: for ``n > 1`` use ``kvload.LLM`` (or
        ``executor.run``), which return ``RequestOutput``s. :meth:`close` during the call (from another thread,
        or the ``stream`` callback) stops it with ``GenerationError``.
        """
        with self.running() as executor:
            return executor.generate(prompts, sampling_params, **kwargs)

    @contextlib.contextmanager
    def running(self) -> Iterator[Any]:
        """The executor, with this thread registered as the one running it, so :meth:`close` can stop it and wait;
        ``GenerationError`` once closed, or while another call runs (the executor runs one at a time)."""
        calls = self._calls
        if calls.closed:
            raise GenerationError(_CLOSED)
        executor = self.executor  # built outside the lock: the first call compiles and loads kernels
        with calls.lock:
            if calls.closed:  # close() may have run meanwhile
                raise GenerationError(_CLOSED)
            if calls.runner is not None:
                raise GenerationError("generate: this result is already generating (in another thread, or this "
                                      "call is inside a running one's callback); wait for it to end")
            calls.runner, calls.executor = threading.current_thread(), executor
            calls.idle.clear()
            _generating[id(self)] = self
        try:
            yield executor
        finally:
            with calls.lock:
                calls.runner = calls.executor = None
                deferred = calls.release_deferred
            calls.idle.set()
            if deferred:  # close() ran inside this call and left the release to it
                self._release()

    def close(self, message: str = RESULT_CLOSED_DURING_GENERATION) -> None:
        """Stop a running generate call (it raises ``GenerationError(message)``, the audit records
        ``generation_failed``), wait for it to end, then release the KV pools and weights. Safe to call twice, from
        any thread, and from inside the call (a stream callback: the call releases as it ends)."""
        calls = self._calls
        with calls.lock:
            calls.closed = True
            if calls.executor is not None:
                calls.executor.stop(message)  # it fails at its next step, freeing its requests
            if calls.runner is threading.current_thread():  # waiting would deadlock
                calls.release_deferred = True
                return
        calls.idle.wait()  # the pools go only once nothing runs on them
        self._release()

    def stop_running(self, message: str, timeout: float) -> None:
        """Stop the call running on another thread, if any (it raises ``GenerationError(message)`` at its next step,
        freeing its requests), and wait up to ``timeout`` s for it to end; the pools stay (unlike :meth:`close`)."""
        calls = self._calls
        with calls.lock:
            if calls.executor is None or calls.runner is threading.current_thread():
                return
            calls.executor.stop(message)
        calls.idle.wait(timeout)

    def _release(self) -> None:
        with self._calls.release_lock:
            if self._calls.released:
                return
            self._calls.released = True
            super().close()

    def kv_cache_events(self, jsonl: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """Drain the KV cache events recorded since the last call: ``{"events": [...], "dropped": n}``.

        Needs ``load`` with ``kv_cache_config.event_buffer_max_size > 0`` (the buffer keeps that many
        events; older ones are dropped and counted). ``jsonl`` appends the drained events to that file,
        one JSON object per line. Event types: ``kv_block_stored``, ``kv_block_removed``,
        ``kv_all_blocks_cleared`` (see :mod:`cache_backends.kv_events`).
        """

        manager = self.kv_manager
        buffer = getattr(manager, "kv_events", None)
        if buffer is None:
            raise ConfigError("kv_cache_events: KV cache events are off; load with "
                              "kv_cache_config.event_buffer_max_size > 0 (a load, not a plan)",
                              path="kv_cache_config.event_buffer_max_size")
        if jsonl is None:
            return buffer.drain()
        return _append_events(buffer, path_argument("kv_cache_events: jsonl", jsonl))

    def __enter__(self) -> LoadResult:
        return self


def _append_events(buffer: Any, path: str) -> dict[str, Any]:
    """Drain ``buffer`` and append its events to ``path``, one JSON object per line. The file is opened before the
    drain (a directory, a missing folder: refused with the events kept), and a write that fails (a full disk) cuts
    the file back to its last whole line: no half-written event. ``open`` took an int as a file descriptor, so
    ``jsonl=5`` wrote into whatever descriptor 5 was."""
    import json

    from pipeline.errors import OutputError, opening_error

    try:
        f = open(path, "ab", buffering=0)  # noqa: SIM115 - closed below, after the drain; unbuffered: close writes nothing
    except OSError as exc:
        # a full disk (no inode for the new file) or a quota is outside the settings: exit 1, as when it shows mid-write
        raise opening_error(exc)(f"kv_cache_events: jsonl {path}: cannot append to it ({exc.strerror or exc}); the "
                                 "events stay in the buffer") from None
    with f:
        batch = buffer.drain()
        data = memoryview("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in batch["events"]).encode())
        start = f.seek(0, os.SEEK_END)
        try:
            while data:
                data = data[f.write(data):]
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(f.fileno(), start)
            raise OutputError(f"kv_cache_events: jsonl {path}: cannot write the {len(batch['events']):,} events "
                              f"drained ({exc.strerror or exc}); the file is cut back to what it held, the events are "
                              "lost") from None
    return batch


#: What a call still running when the interpreter exits raises (on its own thread; nobody reads it by then).
EXITED_DURING_GENERATION = "generate: the interpreter exited during generation; the call was stopped at its next step"
#: Seconds exit waits for such a call to reach its next step.
EXIT_WAIT_S = 30.0
#: Results that have run a call, by id (attrs' eq makes a result unhashable): at exit, one still running is stopped
#: (weak: a result dropped is not kept alive).
_generating: weakref.WeakValueDictionary[int, LoadResult] = weakref.WeakValueDictionary()


def _stop_calls_at_exit() -> None:
    """At interpreter exit, stop a call still running on another thread (a ``generate_stream`` left open, a
    ``generate`` on a daemon thread) and let it leave torch: Python ends daemon threads where they stand, and one
    inside a torch op aborted the process ("terminate called without an active exception", SIGABRT) instead of
    letting the script exit with its own status."""
    for result in list(_generating.values()):
        result.stop_running(EXITED_DURING_GENERATION, EXIT_WAIT_S)


atexit.register(_stop_calls_at_exit)

_CLOSED = ("generate: this result was closed (LoadResult.close released its KV pools and weights); load the model "
           "again")


def execute(
    request: LoadRequest,
    stages: Sequence[Stage] | Pipeline,
    *,
    audit_log: str | os.PathLike[str] | None = None,
    subscribers: Iterable[Subscriber] = (),
    log: bool = True,
) -> LoadResult:
    """Run a request through stages with the standard subscribers (see :func:`pipeline.run.execute`)."""
    return run_stages(request, stages, audit_log=audit_log, subscribers=subscribers, log=log, result_type=LoadResult)


def api_request(model: Any, config_file: Any, load_weights: bool, overrides: dict[str, Any],
                call: str) -> LoadRequest:
    """The request of Python call ``call`` (a name of ``pipeline.context.PUBLIC_CALL_KEYWORDS``, ``"kvload.plan()"``):
    ``overrides`` are the caller's ``LlmArgs`` fields (source "api"); its own keywords are suggested for an unknown
    key near one of them (``load(..., load_weight=True)``), and a keyword of another public call is named as that
    call's (``plan(..., load_weights=True)``: ``kvload.load()``'s)."""
    request = LoadRequest(model=model_argument(model), overrides=overrides, source="api",
                          config_file=path_argument("config_file", config_file) if config_file is not None else None,
                          load_weights=load_weights)
    return request.for_call(call, PUBLIC_CALL_KEYWORDS[call])


def _stages(stages: Any, default: Callable[[], Any]) -> Any:
    """``stages`` as given, or the call's own (``default()``) for None or an empty list; the truth of anything else
    is not asked (a numpy array's raised "ambiguous", naming no argument): the pipeline checks it by name."""
    if stages is None or (isinstance(stages, (list, tuple)) and not stages):
        return default()
    return stages


def model_argument(model: Any) -> Any:
    """A checkpoint directory given as a ``pathlib.Path`` (any ``os.PathLike``) as its string; anything else as is,
    for the ``model`` check to name."""
    return os.fspath(model) if isinstance(model, os.PathLike) else model


def plan(
    model: str | os.PathLike[str],
    *,
    config_file: str | os.PathLike[str] | None = None,
    audit_log: str | os.PathLike[str] | None = None,
    subscribers: Iterable[Subscriber] = (),
    stages: Sequence[Stage] | Pipeline | None = None,
    log: bool = True,
    **overrides: Any,
) -> LoadResult:
    """Resolve a model's arguments and route (stages 1–5), and plan the KV cache; allocates nothing.

    ``overrides`` are ``LlmArgs`` fields; ``kv_cache_config`` may be a dict or a ``KvCacheConfig``
    (only the fields passed to it count as user-set); vLLM's names of fields (``max_model_len``, ``block_size``:
    ``pipeline.vllm_compat.SAME_MEANING``) are taken as them. Precedence: defaults < ``config_file`` < overrides.
    """
    request = api_request(model, config_file, False, overrides, "kvload.plan()")
    return execute(request, _stages(stages, plan_stages), audit_log=audit_log, subscribers=subscribers, log=log)


def load(
    model: str | os.PathLike[str],
    *,
    config_file: str | os.PathLike[str] | None = None,
    load_weights: bool = False,
    audit_log: str | os.PathLike[str] | None = None,
    subscribers: Iterable[Subscriber] = (),
    stages: Sequence[Stage] | Pipeline | None = None,
    log: bool = True,
    **overrides: Any,
) -> LoadResult:
    """Run all stages: resolve, route, load weights (``load_weights=True``), build the KV cache manager.

    Weights load on the resolved device and dtype before the KV budget is computed; presets get
    deterministic random weights.
    """
    load_weights = flag_argument("load_weights", load_weights)  # "no" loaded the weights before it was checked
    request = api_request(model, config_file, load_weights, overrides, "kvload.load()")
    return execute(request, _stages(stages, load_stages), audit_log=audit_log, subscribers=subscribers, log=log)


__all__ = ["LoadResult", "execute", "load", "load_stages", "plan", "plan_stages", "resolve_stages"]
