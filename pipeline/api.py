"""The Python API: ``plan`` (stages 1–5 and the KV plan, no allocation) and ``load`` (all six stages)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from pipeline.audit import AuditLog, JsonlSink
from pipeline.bus import EventBus, Subscriber
from pipeline.config import LlmArgs
from pipeline.context import Context, LoadRequest, ModelInfo, Route
from pipeline.logs import StructlogSubscriber
from pipeline.runner import Pipeline, Stage


def resolve_stages() -> list[Stage]:
    """Stages 1–5: resolve the arguments and route the executor."""
    from stages import ApplyModelDefaults, ParseArgs, ResolveAuto, RouteExecutor, SnapshotUserFields

    return [ParseArgs(), SnapshotUserFields(), ApplyModelDefaults(), ResolveAuto(), RouteExecutor()]


def plan_stages() -> list[Stage]:
    """Stages 1–5, then ``plan_kv``: the KV layout, budget and pools ``load`` would build, allocating nothing."""
    from stages import PlanKv

    return [*resolve_stages(), PlanKv()]


def load_stages() -> list[Stage]:
    """All stages: resolve, route, load the weights (when asked), and build the KV cache manager.

    Weights come before the KV manager so the memory budget sees what they took.
    """
    from stages import BuildKvManager, LoadWeights

    return [*resolve_stages(), LoadWeights(), BuildKvManager()]


@attrs.define
class LoadResult:
    """What a run produced: frozen resolved args, the route, the model, the audit log, the context."""

    args: LlmArgs
    route: Route
    model: ModelInfo
    audit: AuditLog
    context: Context
    bus: EventBus | None = None  # the run's bus: generate calls emit on it, continuing the audit's seq
    _executor: Any = attrs.field(default=None, init=False, repr=False)

    @property
    def kv(self) -> Any:
        """The KV plan (geometry, budget, capacity) when the run computed one."""
        return self.context.kv

    @property
    def kv_manager(self) -> Any:
        """The built KV cache manager (``load`` only)."""
        return self.context.kv_manager

    def reset_prefix_cache(self) -> None:
        """Forget the KV manager's cached prefixes (``load`` only); refused while requests hold a cache."""
        if self.kv_manager is None:
            raise RuntimeError("reset_prefix_cache: this result has no KV cache manager (use load, not plan)")
        self.kv_manager.reset_prefix_cache()

    @property
    def hf_model(self) -> Any:
        """The transformers model with weights (``load(..., load_weights=True)`` only)."""
        return self.context.hf_model

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer, when it has one and weights were loaded."""
        return self.context.tokenizer

    @property
    def scheduler(self) -> Any:
        """The scheduler paired with the manager (``load`` only)."""
        return self.context.scheduler

    @property
    def executor(self) -> Any:
        """The generation executor over this result's model, KV manager and scheduler (built on first use)."""
        if self._executor is None:
            from pipeline.executor import GenerationExecutor  # torch: only when generating

            self._executor = GenerationExecutor.from_result(self)
        return self._executor

    def generate(
        self,
        prompts: Any,
        *,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        salt: str | None = None,
        chat: bool = False,
        ignore_eos: bool = False,
        stream: Callable[[Any], Any] | None = None,
        arrival_steps: Sequence[int] | None = None,
    ) -> list[Any]:
        """Generate through the routed KV manager with continuous batching; one output per prompt, in order.

        Needs ``load(..., load_weights=True)``. ``prompts``: a string or a list of strings (tokenized;
        ``chat=True`` applies the chat template) and/or lists of token ids. Each output has ``text``
        (None without a tokenizer), ``token_ids`` (generated only), ``prompt_token_ids``,
        ``reused_prompt_tokens``, ``finish_reason`` ("eos" or "length") and ``timings``; the call's
        totals are in ``executor.last_stats``. See :meth:`pipeline.executor.GenerationExecutor.generate`.
        """
        return self.executor.generate(
            prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, salt=salt,
            chat=chat, ignore_eos=ignore_eos, stream=stream, arrival_steps=arrival_steps)

    def close(self) -> None:
        """Release the pools and anything else the run allocated."""
        self.context.close()

    def __enter__(self) -> LoadResult:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def execute(
    request: LoadRequest,
    stages: Sequence[Stage] | Pipeline,
    *,
    audit_log: str | os.PathLike[str] | None = None,
    subscribers: Iterable[Subscriber] = (),
    log: bool = True,
) -> LoadResult:
    """Run a request through stages with the standard subscribers; the CLI and the API both use this."""
    pipeline = stages if isinstance(stages, Pipeline) else Pipeline(stages)
    audit = AuditLog()
    sink = JsonlSink(audit_log) if audit_log is not None else None
    subs: list[Subscriber] = [audit]
    if log:
        subs.append(StructlogSubscriber())
    if sink is not None:
        subs.append(sink)
    subs.extend(subscribers)
    ctx = Context(request=request)
    bus = EventBus(subs)
    try:
        pipeline.run(ctx, bus)
    except BaseException:
        if sink is not None:
            sink.close(ok=False)
        raise
    if sink is not None:  # the file is complete; later events (generate) reach the in-memory log only
        sink.close(ok=True)
        bus.unsubscribe(sink)
    return LoadResult(args=ctx.args, route=ctx.route, model=ctx.model, audit=audit, context=ctx, bus=bus)


def plan(
    model: str,
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
    (only the fields passed to it count as user-set). Precedence: defaults < ``config_file`` < overrides.
    """
    request = LoadRequest(model=model, overrides=overrides, source="api",
                          config_file=os.fspath(config_file) if config_file is not None else None)
    return execute(request, stages or plan_stages(), audit_log=audit_log, subscribers=subscribers, log=log)


def load(
    model: str,
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
    request = LoadRequest(model=model, overrides=overrides, source="api",
                          config_file=os.fspath(config_file) if config_file is not None else None,
                          load_weights=load_weights)
    return execute(request, stages or load_stages(), audit_log=audit_log, subscribers=subscribers, log=log)
