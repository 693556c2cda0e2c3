"""The workload simulator behind ``kvload simulate``: replay a workload through a built KV manager + scheduler.

No forward pass: :class:`~engine.driver.Driver` runs the real scheduler and manager, and the
``compute`` step is scripted — a request whose known tokens are all in the cache after a step
"samples" the next token of its scripted answer. Each step therefore commits one token per running
decode and prefill chunks up to ``max_num_tokens``, exactly as the generation executor would.

Clock: one engine step per :meth:`Driver.step`. A request is added before the step numbered its
``arrival_step``; one that comes ``after`` another is added before the step following the one in
which that request finished. When nothing is waiting or running, the clock jumps to the next
arrival (idle steps cost nothing and are not timed, but they count in ``steps``).

Metrics of one run (:class:`RunMetrics`), precisely:

* ``hit_rate`` = reused prompt tokens / prompt tokens, where a request's reused tokens are the
  prompt tokens its *first* admission took from the prefix cache (a V2 re-admission after a
  preemption does not count twice). ``ideal_hit_rate`` is the workload's (``engine.workloads``).
* ``peak_usage`` / ``mean_usage``: the manager's ``stats().usage`` right after the scheduler's
  decision of each engine step (all of the step's blocks allocated, none freed yet): used blocks /
  blocks for V1, used bytes / pool bytes over every layer group for V2. Evictable (cached, unowned)
  blocks count as free.
* ``max_concurrency`` / ``mean_concurrency``: requests running (holding device blocks) at that point.
* ``waits``: request-steps spent waiting after arrival — the sum over engine steps of requests that
  had arrived but were not running after the scheduler's decision (not yet admitted, suspended or
  preempted). ``admission_delay_mean``: mean steps from arrival to first admission;
  ``admission_delay_top_mean``: the same over the requests of the workload's highest priority only (what
  ``scheduling_policy="priority"`` shortens; equal to the mean when every request has one priority).
* ``steps``: engine steps from step 0 until the last request finished (idle steps included);
  ``engine_steps`` leaves idle steps out.
* ``suspends``/``resumes``/``preemptions``/``evictions``: the manager's counters (V1: 0 except evictions).
* ``step_time_us_median``/``_p99``: manager + scheduler time per engine step — ``scheduler.step``,
  the commits and the finishes (:attr:`StepStats.kv_seconds`); p99 is the nearest-rank percentile.
* ``computed_tokens``: tokens whose KV was computed (sum of scheduled chunks); without preemption it
  equals the sum of ``prompt + answer - 1`` minus the reused tokens (the last answer token is never fed).
* ``modeled_seconds``: the engine steps priced on a GPU (``hardware``, default H200) by
  :mod:`engine.step_model`'s roofline: weights and attended KV read, FLOPs computed, per step's batch. Unlike
  ``steps`` it weighs a step by what it computes (a prefill chunk of thousands of tokens against one decode token
  per request), so prefix reuse and batching show as time, plus the host link's time for what V2's suspends and
  resumes copied; None when the model's weights cannot be counted.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from cache_backends.interface import SchedulerOutput
from cache_backends.request import Request
from engine.capacity import MANAGERS, Budget, refusal_reason, routed_budget, variant_request
from engine.driver import Arrival, Driver, StalledError
from engine.step_model import DEFAULT_HARDWARE, HARDWARE, StepModel
from engine.workloads import WORKLOADS, Workload, default_budget_sequences, make_workload
from pipeline.audit import JsonlSink, check_output_path
from pipeline.bus import Subscriber
from pipeline.config import V2_FIELD
from pipeline.context import LoadRequest, keywords_of
from pipeline.errors import ConfigError, KvBuildError, RouteError
from pipeline.events import Event, RequestAdmitted
from pipeline.limits import short_py
from pipeline.paths import flatten
from pipeline.run import RunResult, _subscribers, execute, flag_argument, path_argument
from pipeline.sources import overrides_to_tree
from pipeline.text import table
from stages import load_stages, plan_stages
from stages.build_kv_manager import check_bookkeeping

#: The metric fields of one result, in report order (None when the manager did not run).
METRIC_FIELDS = (
    "hit_rate", "ideal_hit_rate", "reused_tokens", "prompt_tokens", "computed_tokens", "output_tokens",
    "peak_usage", "mean_usage", "max_concurrency", "mean_concurrency", "steps", "engine_steps", "finished",
    "suspends", "resumes", "preemptions", "evictions", "waits", "admission_delay_mean",
    "admission_delay_top_mean", "step_time_us_median", "step_time_us_p99", "step_time_us_mean", "kv_seconds",
    "modeled_seconds",
)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in (0, 100]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@attrs.frozen
class RunMetrics:
    """What one replay measured; see the module docstring for each definition."""

    hit_rate: float
    ideal_hit_rate: float
    reused_tokens: int
    prompt_tokens: int
    computed_tokens: int
    output_tokens: int
    peak_usage: float
    mean_usage: float
    max_concurrency: int
    mean_concurrency: float
    steps: int
    engine_steps: int
    finished: int
    suspends: int
    resumes: int
    preemptions: int
    evictions: int
    waits: int
    admission_delay_mean: float
    admission_delay_top_mean: float
    step_time_us_median: float
    step_time_us_p99: float
    step_time_us_mean: float
    kv_seconds: float
    step_times_us: list[float] = attrs.field(repr=False, eq=False)
    modeled_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The metric fields (without the per-step times)."""
        return {name: getattr(self, name) for name in METRIC_FIELDS}


class WorkloadMismatch(AssertionError):
    """A finished request's output differs from its scripted answer: the replay's bookkeeping is broken."""


def replay(manager: Any, scheduler: Any, workload: Workload, *,
           on_finish: Callable[[int], None] | None = None, step_model: StepModel | None = None) -> RunMetrics:
    """Run ``workload`` to completion through ``manager`` + ``scheduler``; :class:`StalledError` if it cannot.
    ``step_model`` prices each step's batch (``modeled_seconds``)."""
    answers = {r.req_id: r.answer for r in workload.requests}
    arrivals = [Arrival(Request(sr.req_id, list(sr.prompt), len(sr.answer), priority=sr.priority, salt=sr.salt),
                        sr.arrival_step, sr.after) for sr in workload.requests]
    arrived_at: dict[str, int] = {}
    first_reuse: dict[str, int] = {}
    admission_delay: list[int] = []
    top = max(sr.priority for sr in workload.requests)
    top_ids = {sr.req_id for sr in workload.requests if sr.priority == top}
    top_delay: list[int] = []
    clock = 0

    def collect(event: Event) -> None:
        if isinstance(event, RequestAdmitted) and event.req_id not in first_reuse:
            first_reuse[event.req_id] = event.reused_prompt_tokens
            admission_delay.append(clock - arrived_at[event.req_id])
            if event.req_id in top_ids:
                top_delay.append(admission_delay[-1])

    driver = Driver(manager, scheduler, emit=collect)
    usage: list[float] = []
    running: list[int] = []
    waits = 0
    step_times: list[float] = []
    computed = 0
    modeled = 0.0

    def sample() -> None:
        # After the scheduler's decision: the step's blocks are allocated and nothing is freed yet (its peak).
        nonlocal waits
        usage.append(manager.usage())
        running.append(len(driver.running))
        waits += len(driver.waiting)

    def compute(out: SchedulerOutput) -> dict[str, int]:
        nonlocal modeled
        sample()
        tokens = {}
        for chunk in out.scheduled:
            r = chunk.request
            if r.num_computed_tokens + chunk.num_tokens == r.num_tokens:
                tokens[r.req_id] = answers[r.req_id][len(r.output_token_ids)]
        if step_model is not None:
            modeled += step_model.step_seconds([(c.request.num_computed_tokens, c.num_tokens,
                                                 c.request.req_id in tokens) for c in out.scheduled])
        return tokens

    def arrived(request: Request, now: int) -> None:
        nonlocal clock
        clock = now
        arrived_at[request.req_id] = now

    host = getattr(manager, "host", None)  # V2's host tier: the bytes its suspends and resumes copy
    host_seen = 0

    def stepped(now: int, stats: Any) -> None:
        nonlocal clock, computed, modeled, host_seen
        if step_model is not None and host is not None:
            moved = host.bytes_stored + host.bytes_loaded
            modeled += step_model.transfer_seconds(moved - host_seen)
            host_seen = moved
        clock = now + 1  # request_admitted fires inside the next step: it must see that step's clock
        if not stats.output.scheduled:  # nothing scheduled: compute was not called
            sample()
        step_times.append(stats.kv_seconds * 1e6)
        computed += stats.scheduled_tokens
        if stats.finished and on_finish is not None:
            on_finish(len(stats.finished))

    run = driver.run(arrivals, compute, on_arrival=arrived, on_step=stepped)
    finished = run.finished

    for req in finished:
        if tuple(req.output_token_ids) != answers[req.req_id]:
            raise WorkloadMismatch(f"request {req.req_id}: output differs from its scripted answer")
    s = manager.stats()
    prompt_tokens = workload.prompt_tokens
    reused = sum(first_reuse.values())
    return RunMetrics(
        hit_rate=round(reused / prompt_tokens, 6) if prompt_tokens else 0.0,
        ideal_hit_rate=round(workload.ideal_hit_rate, 6),
        reused_tokens=reused,
        prompt_tokens=prompt_tokens,
        computed_tokens=computed,
        output_tokens=sum(len(r.output_token_ids) for r in finished),
        peak_usage=round(max(usage, default=0.0), 6),
        mean_usage=round(statistics.fmean(usage), 6) if usage else 0.0,
        max_concurrency=max(running, default=0),
        mean_concurrency=round(statistics.fmean(running), 3) if running else 0.0,
        steps=run.steps,
        engine_steps=len(step_times),
        finished=len(finished),
        suspends=s.suspends,
        resumes=s.resumes,
        preemptions=s.preemptions,
        evictions=s.evictions,
        waits=waits,
        admission_delay_mean=round(statistics.fmean(admission_delay), 3) if admission_delay else 0.0,
        admission_delay_top_mean=round(statistics.fmean(top_delay), 3) if top_delay else 0.0,
        step_time_us_median=round(statistics.median(step_times), 2) if step_times else 0.0,
        step_time_us_p99=round(percentile(step_times, 99), 2) if step_times else 0.0,
        step_time_us_mean=round(statistics.fmean(step_times), 2) if step_times else 0.0,
        kv_seconds=round(sum(step_times) / 1e6, 6),
        step_times_us=step_times,
        modeled_seconds=float(f"{modeled:.6g}") if step_model is not None else None,
    )


@attrs.frozen
class ManagerResult:
    """One manager's replay of the workload, or why it did not run."""

    kv_manager: str
    status: str  # "ok" | "not_routable" | "not_buildable" | "stalled"
    reason: str | None = None
    scheduler: str | None = None
    budget_bytes: int | None = None
    pool_bytes: int | None = None
    capacity_tokens: int | None = None
    layer_groups: dict[str, int] | None = None
    metrics: RunMetrics | None = None
    wall_seconds: float | None = None
    #: V2's auto host tier on the priced hardware: why it was kept or left out (None: not chosen, or V1)
    host_tier: str | None = None
    #: a slab arena (pool_arena): its slabs, and ``layer_groups`` is None (no group's share is fixed)
    arena_slabs: int | None = None
    #: what max_page_padding did to this manager's pages (KvLayout.padding_note); None when it is 0
    padding: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object under ``results[kv_manager]``: status, budget, and every metric (None if not run)."""
        metrics = self.metrics.to_dict() if self.metrics else dict.fromkeys(METRIC_FIELDS)
        return {
            "status": self.status,
            "reason": self.reason,
            "kv_manager": self.kv_manager,
            "scheduler": self.scheduler,
            "budget_bytes": self.budget_bytes,
            "pool_bytes": self.pool_bytes,
            "capacity_tokens": self.capacity_tokens,
            "layer_groups": self.layer_groups,
            **metrics,
            "wall_seconds": self.wall_seconds,
            "host_tier": self.host_tier,
            "padding": self.padding,
            **({"arena_slabs": self.arena_slabs} if self.arena_slabs is not None else {}),
        }


@attrs.frozen
class SimulationReport:
    """The whole ``simulate`` result: the workload, the shared budget, one :class:`ManagerResult` per manager."""

    model: str
    workload: Workload
    budget: Budget
    settings: dict[str, Any]
    results: dict[str, ManagerResult]

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` document."""
        w = self.workload
        return {
            "model": self.model,
            "workload": w.name,
            "requests": len(w.requests),
            "seed": w.seed,
            "params": dict(w.params),
            "prompt_tokens": w.prompt_tokens,
            "ideal_hit_rate": round(w.ideal_hit_rate, 6),
            "budget_bytes": self.budget.bytes,
            "budget": self.budget.to_dict(),
            "settings": self.settings,
            "results": {name: r.to_dict() for name, r in self.results.items()},
        }

    def check_finished(self) -> None:
        """``KvBuildError`` (exit 2) when no manager finished the workload, as a single manager's stall is."""
        if any(r.status == "ok" for r in self.results.values()):
            return
        names = list(self.results)
        who = names[0] if len(names) == 1 else "neither " + " nor ".join(names)
        def brief(reason: str) -> str:  # a stall lists every request: the first ones say enough on one line
            return reason if len(reason) <= 240 else reason[:237] + "..."

        why = "; ".join(f"{n}: {r.status}" + (f" ({brief(r.reason)})" if r.reason else "")
                        for n, r in self.results.items())
        raise KvBuildError(f"{who} can finish workload {self.workload.name} at a budget of {self.budget.bytes:,} B: "
                           f"{why}; raise --max_tokens or --max_gpu_total_bytes")

    def render(self) -> str:
        """A readable table: one column per manager."""
        w = self.workload
        params = ", ".join(f"{k}={v}" for k, v in w.params.items())
        s = self.settings
        lines = [
            f"simulate  {self.model}  workload {w.name} ({len(w.requests)} requests, seed {w.seed}; {params})",
            f"  {w.prompt_tokens:,} prompt tokens; ideal prefix-reuse hit rate {w.ideal_hit_rate:.2%}",
            f"  budget {self.budget.bytes:,} B for each manager ({self.budget.source})",
            f"  device {s['device']}, max_seq_len {s['max_seq_len']:,}, max_batch_size {s['max_batch_size']:,}, "
            f"max_num_tokens {s['max_num_tokens']:,}, tokens_per_block {s['tokens_per_block']}, "
            f"block reuse {'on' if s['enable_block_reuse'] else 'off'}"
            + (f", max_page_padding {s['max_page_padding']:g}" if s.get("max_page_padding") else ""),
            "",
        ]
        names = list(self.results)
        rows = [["", *names]]

        def fmt(value: Any, kind: str) -> str:
            if value is None:
                return "-"
            if kind == "pct":
                return f"{value:.2%}"
            if kind == "us":
                return f"{value:,.1f} µs"
            if kind == "s":
                return f"{value:,.4g} s"
            return f"{value:,}" if isinstance(value, int) else f"{value:,.3g}"

        spec = [("hit rate (reused / prompt tokens)", "hit_rate", "pct"), ("ideal hit rate", "ideal_hit_rate", "pct"),
                ("peak usage", "peak_usage", "pct"), ("mean usage", "mean_usage", "pct"),
                ("max concurrency", "max_concurrency", ""), ("mean concurrency", "mean_concurrency", ""),
                ("steps to finish", "steps", ""), ("suspends / resumes", None, ""),
                ("preemptions", "preemptions", ""), ("evictions", "evictions", ""),
                ("waits (request-steps)", "waits", ""), ("mean admission delay (steps)", "admission_delay_mean", ""),
                ("step time median", "step_time_us_median", "us"), ("step time p99", "step_time_us_p99", "us"),
                ("manager time (all steps)", "kv_seconds", "s")]
        if s.get("modeled_time_off") is None:
            spec.insert(spec.index(("steps to finish", "steps", "")) + 1,
                        (f"modeled time ({s.get('hardware')})", "modeled_seconds", "s"))
        if len({r.priority for r in w.requests}) > 1:  # one priority: the top class's delay is the mean's
            spec.insert(spec.index(("mean admission delay (steps)", "admission_delay_mean", "")) + 1,
                        ("  of the top priority", "admission_delay_top_mean", ""))
        rows.append(["pool bytes", *(fmt(self.results[n].pool_bytes, "") for n in names)])
        for label, key, kind in spec:
            cells = []
            for n in names:
                m = self.results[n].metrics
                if m is None:
                    cells.append("-")
                elif key is None:
                    cells.append(f"{m.suspends:,} / {m.resumes:,}")
                else:
                    cells.append(fmt(getattr(m, key), kind))
            rows.append([label, *cells])
        lines += table(rows)
        for n in names:
            r = self.results[n]
            if r.status != "ok":
                lines.append(f"  {n}: {r.status.replace('_', ' ')}: {r.reason}")
            if r.host_tier is not None:
                lines.append(f"  {n} host tier: {r.host_tier}")
            if r.padding is not None and len(names) > 1:  # alone, the routed run's own log already says it
                lines.append(f"  {n}: {r.padding}")
        lines.append("  (step time: scheduler.step + commits + finishes per engine step; usage sampled after "
                     "the scheduler's decision)")
        if s.get("modeled_time_off") is None:
            lines.append(f"  (modeled time: each step's batch priced on one {s.get('hardware')} by a roofline of "
                         "weights and KV read and FLOPs; manager time not included)")
        else:
            lines.append(f"  (no modeled time: {s['modeled_time_off']})")
        return "\n".join(lines)


def _progress(total: int, desc: str, enabled: bool | None) -> Any:
    """A tqdm bar on stderr; ``enabled`` None shows it only when stderr is a terminal."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=None if enabled is None else not enabled,
                leave=False, dynamic_ncols=True)


def run_manager(routed: RunResult, name: str, v2: bool | None, budget: Budget, workload: Workload, *,
                progress: bool | None = None, keep_going: bool = False,
                step_model: StepModel | None = None) -> ManagerResult:
    """Build one manager at the shared budget (``v2`` None: as routed) and replay the workload through it.

    ``keep_going``: a route refusal, a build failure or a stall becomes the result's ``status``
    instead of an error (the other manager of a comparison still runs).
    """
    fields: dict[str, Any] = {"max_gpu_total_bytes": budget.bytes, "max_tokens": None}
    if v2 is not None:
        fields["use_kv_cache_manager_v2"] = v2
    try:
        result = execute(variant_request(routed.context.request, **fields), load_stages(), log=False)
    except RouteError as exc:
        if not keep_going:
            raise
        return ManagerResult(name, "not_routable", refusal_reason(routed, name, exc))
    except KvBuildError as exc:
        if not keep_going or exc.exit_code != 2:
            raise
        return ManagerResult(name, "not_buildable", str(exc))
    with result:
        manager, scheduler, kv = result.kv_manager, result.scheduler, result.kv
        name = type(manager).__name__
        base = {"scheduler": type(scheduler).__name__, "budget_bytes": kv.budget_bytes,
                "pool_bytes": kv.pools.total_bytes, "capacity_tokens": kv.capacity_tokens,
                "layer_groups": None if kv.arena else dict(kv.pools.num_blocks),
                # auto: why the tier was kept or not; a size the user gave: the tier (on a CPU --compare logs the
                # routed V1 plan only, whose setting_ignored says V1 has none, while this column uses it)
                "host_tier": kv.host_choice if kv.host_choice is not None or not kv.host_bytes else kv.host_tier_text(),
                # --compare logs the routed plan's events only: each column says what the padding did to it
                "padding": kv.layout.padding_note(kv.max_seq_len)}
        if kv.arena:
            base["arena_slabs"] = kv.arena_slabs
        bar = _progress(len(workload.requests), f"{name} {workload.name}", progress)
        start = time.perf_counter()
        try:
            metrics = replay(manager, scheduler, workload, on_finish=bar.update, step_model=step_model)
        except StalledError as exc:
            if not keep_going:
                layout, seq_len = kv.layout, routed.context.args.max_seq_len
                split = layout.split_length(seq_len)
                lower = ("" if split >= seq_len or budget.bytes >= layout.bytes_for_sequence(seq_len) else
                         f", or lower --max_seq_len ({seq_len:,}) to the longest request: these pools are split for "
                         f"sequences of {split:,} tokens beside one of max_seq_len, which a budget this small does "
                         "not hold")
                raise KvBuildError(f"{name} cannot finish workload {workload.name} at a budget of "
                                   f"{budget.bytes:,} B: {exc}; raise --max_tokens or --max_gpu_total_bytes"
                                   f"{lower}") from None
            return ManagerResult(name, "stalled", str(exc), **base)
        finally:
            bar.close()
        return ManagerResult(name, "ok", None, metrics=metrics, wall_seconds=round(time.perf_counter() - start, 3),
                             **base)


def simulate(model: str, workload: str | Workload, *, requests: int | None = None, seed: int = 0,
             params: dict[str, int] | None = None, compare: bool = False, config_file: str | None = None,
             source: str = "api", audit_log: str | None = None, progress: bool | None = None, log: bool = True,
             subscribers: Iterable[Subscriber] = (), hardware: str = DEFAULT_HARDWARE,
             **overrides: Any) -> SimulationReport:
    """Replay a synthetic workload (a name, or a built :class:`Workload`) through the routed manager, or V1 and V2.

    Both managers get the same KV budget (:func:`engine.capacity.routed_budget`): the user's
    ``max_tokens`` / ``max_gpu_total_bytes`` priced in the routed layout, else the bytes of the workload's
    default number of its longest sequences (:func:`engine.workloads.default_budget_sequences`) in the
    routed layout. ``overrides`` are ``LlmArgs`` fields as for
    :func:`pipeline.load`; ``audit_log`` records the routed resolution that set the budget, and is
    written only once every manager has run (an interrupted or failing simulation leaves none);
    ``subscribers`` receive the same events (the CLI's own audit sink, published when it succeeds);
    ``hardware`` (one of :data:`engine.step_model.HARDWARE`) prices the steps (``modeled_seconds``).
    """
    compare, progress, log, subscribers = _checked_keywords(workload, requests, seed, params, compare, config_file,
                                                            source, audit_log, progress, log, subscribers, hardware)
    sink = JsonlSink(audit_log) if audit_log is not None else None
    try:
        report = _simulate(model, workload, requests, seed, params, compare, config_file, source, progress, log,
                           [*subscribers, *([sink] if sink is not None else [])], overrides, hardware)
    except BaseException:
        if sink is not None:
            sink.close(ok=False)
        raise
    if sink is not None:
        sink.close(ok=True)
    return report


def _checked_keywords(workload: Any, requests: Any, seed: Any, params: Any, compare: Any, config_file: Any,
                      source: Any, audit_log: Any, progress: Any, log: Any, subscribers: Any,
                      hardware: Any) -> tuple[bool, bool | None, bool, list[Subscriber]]:
    """:func:`simulate`'s own keywords checked before anything runs, each refusal a ``ConfigError`` naming it (a list
    for ``hardware`` was "unhashable type: 'list'", a dict for ``params`` "argument after ** must be a mapping", an
    int for ``audit_log`` pathlib's bare TypeError; none named the keyword); returns the flags and the subscribers
    as Python's bool and a list."""
    def refuse(name: str, expected: str, value: Any) -> ConfigError:
        return ConfigError(f"{name}: expected {expected}, got {short_py(value)}", path=name)

    if not isinstance(workload, (str, Workload)):
        raise refuse("workload", f"a workload name ({', '.join(WORKLOADS)}) or a built Workload", workload)
    for name, value in (("requests", requests), ("seed", seed)):
        if (value is not None or name == "seed") and (not isinstance(value, int) or isinstance(value, bool)):
            raise refuse(name, "an integer" + (" or None" if name == "requests" else ""), value)
    if params is not None and (not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params)):
        raise refuse("params", "a dict of workload parameter names to integers, or None", params)
    if config_file is not None:
        path_argument("config_file", config_file)
    if audit_log is not None:  # "" was "audit log .: cannot write it (Device or resource busy)", from the sink
        check_output_path(path_argument("audit_log", audit_log), flag="audit_log")
    if not isinstance(source, str):
        raise refuse("source", 'a str ("api" or "cli")', source)
    if not isinstance(hardware, str) or hardware not in HARDWARE:
        raise ConfigError(f"hardware: {short_py(hardware)} is not one of {', '.join(HARDWARE)}", path="hardware")
    flags = (flag_argument("compare", compare), None if progress is None else flag_argument("progress", progress),
             flag_argument("log", log))
    return (*flags, _subscribers(subscribers))


def _simulate(model: str, workload: str | Workload, requests: int | None, seed: int, params: dict[str, int] | None,
              compare: bool, config_file: str | None, source: str, progress: bool | None, log: bool,
              subscribers: list[Subscriber], overrides: dict[str, Any], hardware: str) -> SimulationReport:
    if isinstance(workload, Workload):  # built once by the caller (benchmarks repeat one workload)
        if requests is not None or params:
            raise ConfigError("pass requests and params to make_workload, not with a built Workload",
                              path="workload")
        wl = workload
    else:
        try:
            wl = make_workload(workload, requests, seed, **(params or {}))
        except ValueError as exc:
            raise ConfigError(str(exc), path="workload") from None
    # the replay reads and writes no KV: pools of any budget, without the memory (LoadRequest.pools_unbacked)
    # priced on ``hardware``: V2's auto host tier is chosen for it (stages.host_tier_choice)
    request = LoadRequest(model=model, overrides=overrides, source=source, config_file=config_file,
                          pools_unbacked=True, hardware=hardware,
                          default_budget=(default_budget_sequences(wl), wl.max_sequence_tokens))
    if source == "api":  # simulate(..., load_weights=True): named as kvload.load()'s keyword, not a field
        request.for_call("engine.simulator.simulate()", keywords_of(simulate))
    if compare and V2_FIELD in flatten(overrides_to_tree(overrides)):
        raise ConfigError("--compare simulates both managers; drop --use_kv_cache_manager_v2",
                          path=V2_FIELD)
    routed = execute(request, plan_stages(), subscribers=subscribers, log=log)
    args = routed.args
    if wl.max_sequence_tokens > args.max_seq_len:
        raise ConfigError(f"max_seq_len={args.max_seq_len} is below the longest sequence of workload {wl.name} "
                          f"({wl.max_sequence_tokens} tokens); raise --max_seq_len or shrink the workload",
                          path="max_seq_len")
    budget = routed_budget(routed, default_budget_sequences(wl), wl.max_sequence_tokens, prefer_default=True)
    if not budget.default:  # every manager gets it as max_gpu_total_bytes: too big is said of the setting given
        check_bookkeeping(routed.kv, routed.context)
    kv = args.kv_cache_config
    settings = {"device": str(args.device), "max_seq_len": args.max_seq_len, "max_batch_size": args.max_batch_size,
                "max_num_tokens": args.max_num_tokens, "tokens_per_block": kv.tokens_per_block,
                "enable_block_reuse": kv.enable_block_reuse, "enable_partial_reuse": kv.enable_partial_reuse,
                "routed": routed.route.kv_manager,
                # changes V2's pages (and so its pool bytes and steps) on a shared arena: a report must say it was on
                "max_page_padding": kv.max_page_padding}
    step_model, why_not = _step_model(routed, hardware)
    settings["hardware"] = HARDWARE[hardware].name
    settings["modeled_time_off"] = why_not
    if compare:
        results = {name: run_manager(routed, name, v2, budget, wl, progress=progress, keep_going=True,
                                     step_model=step_model)
                   for name, v2 in MANAGERS.items()}
    else:
        one = run_manager(routed, routed.route.kv_manager, None, budget, wl, progress=progress, step_model=step_model)
        results = {one.kv_manager: one}
    return SimulationReport(routed.model.name, wl, budget, settings, results)


def _step_model(routed: RunResult, hardware: str) -> tuple[StepModel | None, str | None]:
    """The routed model's step pricing on ``hardware``, or (None, why not): a model transformers cannot build (DeepSeek
    V4's preset) has no weights to count."""
    kv = routed.kv
    try:
        model = StepModel.build(routed.context.hf_config, kv.layout.layers, str(routed.args.dtype), kv.layout.dtype,
                                hardware)
    except Exception as exc:  # any failure to build the model on meta means: no modeled time
        return None, f"transformers cannot build {routed.model.name} to count its weights: {str(exc)[:160]}"
    return model, None
