"""``kvload.LLM.get_metrics()``: vLLM's in-memory metrics snapshot, with the names ``kvload serve`` exposes.

vLLM's ``LLM.get_metrics()`` returns ``Counter`` / ``Gauge`` / ``Histogram`` / ``Vector`` records read from its
Prometheus registry; kvload's are the same shapes, counted from what each ``generate`` / ``chat`` call returned (its
``RequestOutput``s and ``GenerationStats``) and read from the KV cache manager at the time of asking, so no
``prometheus_client`` is needed. Names and labels are the server's (``kvload.serve.metrics``), and so are the
histogram buckets, defined here for both.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import attrs

from pipeline.limits import short_py

#: ``finished_reason`` label values of ``kvload_request_success`` (the server's, where a request can also end in
#: ``abort`` or ``error``; ``LLM`` counts the samples of calls that returned)
FINISH_REASONS = ("stop", "length", "abort", "error")
#: Buckets in seconds (vLLM's, which span GPU and CPU latencies).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0)
#: tokens computed per engine step (vLLM's ``iteration_tokens_total``)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
#: the ``n`` request parameter
N_BUCKETS = (1, 2, 5, 10, 20)

#: Naming schemes of the metrics: ``kvload`` (``kvload_prompt_tokens``, label ``model_name``) or ``vllm`` (vLLM's
#: own names, ``vllm:prompt_tokens``, labels ``model_name`` and ``engine``), so a vLLM dashboard or autoscaler
#: reads kvload unchanged.
METRIC_NAMINGS = ("kvload", "vllm")


def metric_name(naming: str, base: str) -> str:
    """``base`` (vLLM's name without its prefix: ``num_requests_waiting``) under ``naming``."""
    if naming not in METRIC_NAMINGS:
        raise ValueError(f"metric naming: expected one of {', '.join(METRIC_NAMINGS)}, got {short_py(naming)}")
    return f"vllm:{base}" if naming == "vllm" else f"kvload_{base}"


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets, up to the model's length)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@attrs.frozen
class Metric:
    """A metric family's one series: its name (the server's family name) and labels."""

    name: str
    labels: dict[str, str] = attrs.field(hash=False)


@attrs.frozen
class Counter(Metric):
    """A count that only grows (vLLM's ``vllm.v1.metrics.reader.Counter``)."""

    value: int


@attrs.frozen
class Gauge(Metric):
    """A value that goes up and down (vLLM's ``Gauge``)."""

    value: float


@attrs.frozen
class Histogram(Metric):
    """Observations in buckets (vLLM's ``Histogram``): ``buckets`` maps each upper bound, as Prometheus writes its
    ``le`` label (``"0.5"``, ``"+Inf"``), to the cumulative count of observations at most that; ``count`` is the
    ``"+Inf"`` bucket's, ``sum`` the observations' total."""

    count: int
    sum: float
    buckets: dict[str, int] = attrs.field(hash=False)


@attrs.frozen
class Vector(Metric):
    """Counts by position (vLLM's ``Vector``): ``spec_decode_num_accepted_tokens_per_pos``, the drafts confirmed at
    each draft position (0: the first), one value per position ``max_draft_len`` allows."""

    values: list[int] = attrs.field(hash=False)


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


class _Buckets:
    """One histogram's running counts."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = (*bounds, math.inf)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1

    def metric(self, name: str, labels: dict[str, str]) -> Histogram:
        return Histogram(name, labels, count=self.counts[-1], sum=self.sum,
                         buckets={_le(b): c for b, c in zip(self.bounds, self.counts, strict=True)})


class LlmMetrics:
    """The totals behind :meth:`kvload.LLM.get_metrics`: what every returned call produced, plus the manager's own."""

    def __init__(self, model_name: str, max_draft_len: int = 0) -> None:
        self.model_name = model_name
        #: drafts confirmed per draft position (speculative decoding; empty without it, as vLLM has no series then)
        self.accepted_per_pos = [0] * max_draft_len
        self._lock = threading.Lock()  # a stream's thread records while the caller may ask
        self.counts = dict.fromkeys(("prompt_tokens", "generation_tokens", "num_preemptions", "num_suspensions",
                                     "engine_steps", "spec_decode_num_draft_tokens",
                                     "spec_decode_num_accepted_tokens"), 0)
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = _Buckets(TTFT_BUCKETS)
        self.e2e = _Buckets(LATENCY_BUCKETS)

    def record(self, outputs: Sequence[Any], stats: Any) -> None:
        """Count one call that returned: its ``RequestOutput``s and its ``GenerationStats``."""
        with self._lock:
            c = self.counts
            c["prompt_tokens"] += stats.prompt_tokens
            c["generation_tokens"] += stats.generated_tokens
            c["num_preemptions"] += stats.preemptions
            c["num_suspensions"] += stats.suspends
            c["engine_steps"] += stats.steps
            c["spec_decode_num_draft_tokens"] += stats.draft_tokens
            c["spec_decode_num_accepted_tokens"] += stats.accepted_draft_tokens
            for i, n in enumerate(stats.accepted_per_position[:len(self.accepted_per_pos)]):
                self.accepted_per_pos[i] += n
            for out in outputs:
                for sample in out.outputs:
                    self.success[sample.finish_reason] += 1
                self.ttft.observe(out.timings.first_token_s)
                self.e2e.observe(out.timings.total_s)

    def snapshot(self, manager_stats: Any, naming: str = "kvload") -> list[Metric]:
        """Every series now: the counters and histograms of the calls so far, and the manager's gauges and prefix
        cache totals (``manager_stats``: a ``ManagerStats``, or None once the pools are released). ``naming``: as
        the server's ``--metrics-name-prefix`` (``"vllm"``: vLLM's names and labels for the series it has, one
        ``vllm:kv_cache_usage_perc``; the others keep their ``kvload_`` name)."""
        vllm = naming == "vllm"

        def name(base: str) -> str:
            return metric_name(naming, base)

        labels = {"model_name": self.model_name, **({"engine": "0"} if vllm else {})}
        own = {"model_name": self.model_name}  # kvload's own series, whatever the naming
        with self._lock:
            out: list[Metric] = [Counter(f"kvload_{key}", dict(own), value) if key in _OWN_COUNTERS
                                 else Counter(name(key), dict(labels), value) for key, value in self.counts.items()]
            out += [Counter(name("request_success"), {**labels, "finished_reason": reason}, n)
                    for reason, n in self.success.items()]
            if self.accepted_per_pos:
                out.append(Vector(name("spec_decode_num_accepted_tokens_per_pos"), dict(labels),
                                  list(self.accepted_per_pos)))
            out += [self.ttft.metric(name("time_to_first_token_seconds"), dict(labels)),
                    self.e2e.metric(name("e2e_request_latency_seconds"), dict(labels))]
        if manager_stats is not None:
            out += [Counter(name("prefix_cache_queries"), dict(labels), manager_stats.reuse_query_tokens),
                    Counter(name("prefix_cache_hits"), dict(labels), manager_stats.reuse_hit_tokens)]
            if vllm:  # vLLM's one gauge: device KV memory in use, bytes-weighted across layer groups
                out.append(Gauge("vllm:kv_cache_usage_perc", dict(labels), float(manager_stats.usage)))
            out += [Gauge("kvload_kv_cache_usage_perc", {**own, "layer_group": group}, float(g.usage))
                    for group, g in manager_stats.groups.items()]
        return out


#: ``LlmMetrics.counts`` vLLM has no series for: they keep their ``kvload_`` name under vLLM's naming
_OWN_COUNTERS = frozenset({"num_suspensions", "engine_steps"})

__all__ = ["FINISH_REASONS", "ITERATION_TOKEN_BUCKETS", "LATENCY_BUCKETS", "METRIC_NAMINGS", "N_BUCKETS",
           "TPOT_BUCKETS", "TTFT_BUCKETS", "Counter", "Gauge", "Histogram", "LlmMetrics", "Metric", "Vector",
           "metric_name", "one_two_five_buckets"]
