"""Prometheus metrics of ``kvload serve``, named like vLLM's with a ``kvload_`` prefix.

Counters and histograms move as the engine loop reports steps and finished requests; gauges (queue
lengths, KV usage per layer group) and the manager's own counters (prefix-cache queries and hits,
evictions) are read from one consistent engine snapshot at scrape time. The HTTP layer's own two (completion
requests in flight, requests refused by reason) count HTTP requests, not the engine requests they become.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# the finish reasons and buckets are kvload.LLM.get_metrics()'s too: one definition for both
from kvload.metrics import FINISH_REASONS, LATENCY_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS

#: ``layer_group`` label of the free pages of an arena shared by several layer groups (V2, equal pages)
SHARED_ARENA_LABEL = "shared_arena"

#: ``reason`` label of ``kvload_http_requests_refused_total`` by the HTTP status the server refused with; another
#: 4xx counts as ``bad_request``, a 5xx other than 503 is a failure, not a refusal, and is not counted.
REFUSAL_REASONS = {400: "bad_request", 401: "unauthorized", 404: "model_not_found", 408: "read_timeout",
                   413: "too_large", 503: "busy"}
#: ... and by the error ``code`` where one status has several causes: a 503 while the server stops is not a busy
#: server (an alert on ``busy`` must not fire on every rolling restart)
REFUSAL_CODES = {"server_shutting_down": "shutting_down"}


class ServeMetrics:
    """The server's registry; an :class:`engine.serving.EngineObserver` for the loop's reports."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no *_created series: scrapers of vLLM-style metrics do not expect them
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("kvload_prompt_tokens", "Prompt tokens of requests that ended after their prefill "
                                     "(reused included; a request aborted before its first token counts none)",
                                     labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("kvload_generation_tokens", "Generated tokens", labels,
                                         registry=r).labels(model_name)
        self.preemptions = Counter("kvload_num_preemptions", "Requests preempted for recompute", labels,
                                   registry=r).labels(model_name)
        self.suspensions = Counter("kvload_num_suspensions", "Requests suspended to the host tier (V2)", labels,
                                   registry=r).labels(model_name)
        self.steps = Counter("kvload_engine_steps", "Engine steps run", labels, registry=r).labels(model_name)
        # vLLM's spec_decode_num_draft_tokens / _num_accepted_tokens (max_draft_len > 0)
        self.draft_tokens = Counter("kvload_spec_decode_num_draft_tokens", "Draft tokens computed (speculative "
                                    "decoding)", labels, registry=r).labels(model_name)
        self.accepted_tokens = Counter("kvload_spec_decode_num_accepted_tokens", "Draft tokens the model confirmed",
                                       labels, registry=r).labels(model_name)
        self.success = Counter("kvload_request_success", "Requests that ended, by finish reason",
                               [*labels, "finished_reason"], registry=r)
        for reason in FINISH_REASONS:  # every series from the start, at 0 (as vLLM's): rate() needs a first sample
            self.success.labels(model_name, reason)
        self.ttft = Histogram("kvload_time_to_first_token_seconds", "Time from queueing to the first token",
                              labels, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("kvload_time_per_output_token_seconds", "Time between consecutive output tokens",
                              labels, buckets=TPOT_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("kvload_e2e_request_latency_seconds", "Time from queueing to the last token", labels,
                             buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        # read at scrape time from the count the admission middleware keeps (app._Admission): one source of truth
        self.http_in_flight = Gauge("kvload_http_requests_in_flight",
                                    "Completion, chat and (de)tokenize requests in the server now, from their "
                                    "headers until their answer ends (what --max-concurrent-requests limits)", labels,
                                    registry=r).labels(model_name)
        self.http_refused = Counter("kvload_http_requests_refused",
                                    "HTTP requests refused, by reason: bad_request and model_not_found (400, 404), "
                                    "unauthorized (401, no accepted --api-key), "
                                    "read_timeout (408, head or body), too_large (413), busy (503), shutting_down "
                                    "(503 while the server stops)",
                                    [*labels, "reason"], registry=r)
        for reason in sorted({*REFUSAL_REASONS.values(), *REFUSAL_CODES.values()}):  # every series from the start
            self.http_refused.labels(model_name, reason)
        self.engine: Any = None

    def attach(self, engine: Any) -> None:
        """Read queue lengths and KV usage from ``engine.snapshot()`` at scrape time."""
        self.engine = engine
        self.registry.register(_EngineCollector(self))

    # --- EngineObserver ------------------------------------------------------------------------

    def on_step(self, stats: Any, new_tokens: int) -> None:
        """Count the step, its generated tokens and drafts, its preemptions and suspensions."""
        self.steps.inc()
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
        if getattr(stats, "draft_tokens", 0):
            self.draft_tokens.inc(stats.draft_tokens)
            self.accepted_tokens.inc(stats.accepted_draft_tokens)
        out = stats.output
        if out is not None:
            if out.preempted:
                self.preemptions.inc(len(out.preempted))
            if out.suspended:
                self.suspensions.inc(len(out.suspended))

    def on_finished(self, prompt_tokens: int, output_tokens: int, ttft_s: float | None, tpot_s: list[float],
                    reason: str) -> None:
        """Count a request that ended and observe its latencies."""
        self.success.labels(self.model_name, reason).inc()
        if ttft_s is not None:  # its prompt was processed (not a request aborted while it waited or prefilled)
            self.prompt_tokens.inc(prompt_tokens)
            self.ttft.observe(ttft_s)
            self.e2e.observe(ttft_s + sum(tpot_s))
        for t in tpot_s:
            self.tpot.observe(t)

    # --- the HTTP layer --------------------------------------------------------------------------

    def on_refused(self, status: int, code: str | None = None) -> None:
        """Count a request the server refused with HTTP ``status`` and error ``code`` (see :data:`REFUSAL_REASONS`)."""
        reason = REFUSAL_CODES.get(code or "") or REFUSAL_REASONS.get(status,
                                                                    "bad_request" if 400 <= status < 500 else None)
        if reason is not None:
            self.http_refused.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and manager counters from one engine snapshot per scrape."""

    def __init__(self, metrics: ServeMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # unchecked: names come from collect() only

    def collect(self) -> Iterator[Metric]:
        snap = self.metrics.engine.snapshot()
        name = [self.metrics.model_name]
        for key, text in (("running", "Requests in the running batch"),
                          ("waiting", "Requests waiting for admission"),
                          ("suspended", "Requests suspended to the host tier (V2)")):
            g = GaugeMetricFamily(f"kvload_num_requests_{key}", text, labels=["model_name"])
            g.add_metric(name, snap[key])
            yield g
        stats = snap["manager"]  # a cache_backends.stats.ManagerStats, None once the manager is closed
        usage = GaugeMetricFamily("kvload_kv_cache_usage_perc", "Fraction of KV blocks in use, per layer group",
                                  labels=["model_name", "layer_group"])
        blocks = GaugeMetricFamily("kvload_kv_cache_blocks", "KV blocks per layer group and state",
                                   labels=["model_name", "layer_group", "state"])
        arena_free: int | None = None
        for group, g in (stats.groups if stats is not None else {}).items():
            usage.add_metric([*name, group], float(g.usage))
            states = [("evictable", g.evictable), ("used", g.used)]
            if g.shared:  # the arena's free pages belong to no group: reported once, so sums stay right
                arena_free = g.free
            else:
                states.insert(0, ("free", g.free))
            for state, n in states:
                blocks.add_metric([*name, group, state], float(n))
        if arena_free is not None:
            blocks.add_metric([*name, SHARED_ARENA_LABEL, "free"], float(arena_free))
        yield usage
        yield blocks
        queries = CounterMetricFamily("kvload_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels=["model_name"])
        queries.add_metric(name, float(stats.reuse_query_tokens if stats is not None else 0))
        yield queries
        hits = CounterMetricFamily("kvload_prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache",
                                   labels=["model_name"])
        hits.add_metric(name, float(stats.reuse_hit_tokens if stats is not None else 0))
        yield hits


__all__ = ["REFUSAL_REASONS", "ServeMetrics"]
