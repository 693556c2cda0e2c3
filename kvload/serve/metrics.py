"""Prometheus metrics of ``kvload serve``: vLLM's names with a ``kvload_`` prefix, or (``--metrics-name-prefix vllm``)
vLLM's exact names and labels (``vllm:*``, ``engine="0"``) so vLLM's dashboards and autoscalers read them unchanged.

Counters and histograms move as the engine loop reports steps and finished requests; gauges (queue
lengths, KV usage per layer group) and the manager's own counters (prefix-cache queries and hits,
evictions) are read from one consistent engine snapshot at scrape time. The HTTP layer's own two (completion
requests in flight, requests refused by reason) count HTTP requests, not the engine requests they become.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# the finish reasons and buckets are kvload.LLM.get_metrics()'s too: one definition for both
from kvload.metrics import (
    FINISH_REASONS,
    ITERATION_TOKEN_BUCKETS,
    LATENCY_BUCKETS,
    N_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    metric_name,
    one_two_five_buckets,
)

#: ``layer_group`` label of the free pages of an arena shared by several layer groups (V2, equal pages)
SHARED_ARENA_LABEL = "shared_arena"

#: ``source`` label values of ``prompt_tokens_by_source`` (vLLM's, each a series from the start): computed here, read
#: from this server's prefix cache, received from a KV connector (kvload has none: always 0, as vLLM's without one)
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")

#: ``reason`` label of ``kvload_http_requests_refused_total`` by the HTTP status the server refused with; another
#: 4xx counts as ``bad_request``, a 5xx other than 503 is a failure, not a refusal, and is not counted.
REFUSAL_REASONS = {400: "bad_request", 401: "unauthorized", 404: "model_not_found", 408: "read_timeout",
                   413: "too_large", 503: "busy", 505: "bad_request"}  # 505: an HTTP version other than 1.x
#: ... and by the error ``code`` where one status has several causes: a 503 while the server stops is not a busy
#: server (an alert on ``busy`` must not fire on every rolling restart)
REFUSAL_CODES = {"server_shutting_down": "shutting_down", "previous_response_not_found": "response_not_found",
                 "response_not_found": "response_not_found"}


class ServeMetrics:
    """The server's registry; an :class:`engine.serving.EngineObserver` for the loop's reports.

    ``naming``: ``"kvload"`` (``kvload_*``, label ``model_name``) or ``"vllm"``: every series vLLM has under vLLM's
    own name and labels (``vllm:num_requests_waiting{model_name,engine="0"}``), so vLLM's dashboards, alerts and
    autoscalers read it unchanged; the series vLLM has no name for keep their ``kvload_`` name. ``max_model_len``:
    the top of the token-count histograms' buckets (vLLM's 1-2-5 series up to it). ``max_draft_len``: the draft
    positions ``spec_decode_num_accepted_tokens_per_pos`` has a series for from the start (vLLM's)."""

    def __init__(self, model_name: str, *, naming: str = "kvload", max_model_len: int = 4096,
                 max_draft_len: int = 0) -> None:
        disable_created_metrics()  # no *_created series: scrapers of vLLM-style metrics do not expect them
        self.model_name = model_name
        self.naming = naming
        metric_name(naming, "")  # a ValueError naming the schemes for any other
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # vLLM's series: its names and labels under naming="vllm" (one engine: engine="0")
        self.labels = ["model_name", "engine"] if naming == "vllm" else ["model_name"]
        self.label_values = [model_name, "0"] if naming == "vllm" else [model_name]
        own = ["model_name"]  # kvload's own series (no vLLM name) keep kvload's name and label whatever the naming

        def counter(base: str, text: str) -> Any:
            return Counter(metric_name(naming, base), text, self.labels, registry=r).labels(*self.label_values)

        def histogram(base: str, text: str, buckets: Sequence[float]) -> Any:
            return Histogram(metric_name(naming, base), text, self.labels, buckets=buckets,
                             registry=r).labels(*self.label_values)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that ended after their prefill "
                                     "(reused included; a request aborted before its first token counts none)")
        # vLLM's breakdown of the same prompt tokens, counted with them: by source, the cached ones, and the last
        # token of a prompt cached but for it, computed again for its logits (vLLM's rule: cached == prompt - 1)
        by_source = Counter(metric_name(naming, "prompt_tokens_by_source"), "Prompt tokens by source: local_compute "
                            "(computed), local_cache_hit (prefix cache; a recomputed last token counts here too), "
                            "external_kv_transfer (none here)", [*self.labels, "source"], registry=r)
        self.prompt_by_source = {s: by_source.labels(*self.label_values, s) for s in PROMPT_SOURCES}
        self.prompt_cached = counter("prompt_tokens_cached", "Cached prompt tokens (local + external) when the "
                                     "request was first scheduled")
        self.prompt_recomputed = counter("prompt_tokens_recomputed", "Cached prompt tokens recomputed for the forward "
                                         "pass (the last token of a prompt cached but for it)")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.preemptions = counter("num_preemptions", "Requests preempted for recompute")
        self.suspensions = Counter("kvload_num_suspensions", "Requests suspended to the host tier (V2)", own,
                                   registry=r).labels(model_name)
        self.recomputed = Counter("kvload_preemption_recomputed_tokens", "Tokens computed again after a preemption "
                                  "for recompute: what the preempted request had computed, less the prefix cache's "
                                  "hit on its re-admission", own, registry=r).labels(model_name)
        self.steps = Counter("kvload_engine_steps", "Engine steps run", own, registry=r).labels(model_name)
        # vLLM's spec_decode_num_draft_tokens / _num_accepted_tokens (max_draft_len > 0)
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens computed (speculative decoding)")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens the model confirmed")
        self.drafts = counter("spec_decode_num_drafts", "Drafts verified: one per request and step that computed "
                              "draft tokens")
        per_pos = Counter(metric_name(naming, "spec_decode_num_accepted_tokens_per_pos"), "Accepted tokens per "
                          "draft position (0: the first draft)", [*self.labels, "position"], registry=r)
        self.accepted_per_pos = [per_pos.labels(*self.label_values, str(i)) for i in range(max_draft_len)]
        self.success = Counter(metric_name(naming, "request_success"), "Requests that ended, by finish reason",
                               [*self.labels, "finished_reason"], registry=r)
        for reason in FINISH_REASONS:  # every series from the start, at 0 (as vLLM's): rate() needs a first sample
            self.success.labels(*self.label_values, reason)
        self.ttft = histogram("time_to_first_token_seconds", "Time from queueing to the first token", TTFT_BUCKETS)
        # vLLM's newer name; its older one (time_per_output_token_seconds) is the same histogram, copied at scrape
        # time (_Alias): one observation per interval on the loop thread, not two
        itl = Histogram(metric_name(naming, "inter_token_latency_seconds"), "Time between consecutive output tokens",
                        self.labels, buckets=TPOT_BUCKETS, registry=r)
        self.itl = itl.labels(*self.label_values)
        r.register(_Alias(itl, metric_name(naming, "time_per_output_token_seconds"),
                          "Time between consecutive output tokens (the observations of inter_token_latency_seconds)"))
        self.request_tpot = histogram("request_time_per_output_token_seconds", "Per request: its decode time over "
                                      "its output tokens after the first (requests of two or more tokens)",
                                      TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from queueing to the last token", LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time from queueing to first being scheduled",
                               LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Time from first being scheduled to the first token",
                                 LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Time from the first token to the last",
                                LATENCY_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "Time from first being scheduled to the last "
                                   "token (prefill + decode)", LATENCY_BUCKETS)
        sizes = one_two_five_buckets(max_model_len)
        self.request_prompt = histogram("request_prompt_tokens", "Prompt tokens per request", sizes)
        self.request_generation = histogram("request_generation_tokens", "Generated tokens per request", sizes)
        self.request_computed = histogram("request_prefill_kv_computed_tokens", "Prompt tokens per request whose KV "
                                          "was computed (not read from the prefix cache)", sizes)
        self.max_generation = histogram("request_max_num_generation_tokens", "The most tokens generated by one of a "
                                        "prompt's n samples (once per prompt, when its last sample ends)", sizes)
        # group -> [samples not ended yet, most tokens so far, whether params_n observed it]: until its last ends
        self._groups: dict[str, list[Any]] = {}
        self.params_n = histogram("request_params_n", "The n request parameter (once per prompt's n samples)",
                                  N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "The max_tokens request parameter (once per "
                                           "prompt's n samples)", sizes)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step",
                                          ITERATION_TOKEN_BUCKETS)
        # read at scrape time from the count the admission middleware keeps (admission._Admission): one source of truth
        self.http_in_flight = Gauge("kvload_http_requests_in_flight",
                                    "Completion, chat and (de)tokenize requests in the server now, from their "
                                    "headers until their answer ends (what --max-concurrent-requests limits)", own,
                                    registry=r).labels(model_name)
        self.http_refused = Counter("kvload_http_requests_refused",
                                    "HTTP requests refused, by reason: bad_request and model_not_found (400, 404), "
                                    "response_not_found (404: a response id no longer or never kept), "
                                    "unauthorized (401, no accepted --api-key), "
                                    "read_timeout (408, head or body), too_large (413), busy (503), shutting_down "
                                    "(503 while the server stops)",
                                    [*own, "reason"], registry=r)
        for reason in sorted({*REFUSAL_REASONS.values(), *REFUSAL_CODES.values()}):  # every series from the start
            self.http_refused.labels(model_name, reason)
        # the responses /v1/responses keeps (ResponseStore): how many now, the bound, how many the bound dropped
        self.responses_stored = Gauge("kvload_responses_stored", "Responses kept for previous_response_id and GET "
                                      "/v1/responses/{id} now", own, registry=r).labels(model_name)
        self.responses_store_max = Gauge("kvload_responses_store_max", "The most responses kept "
                                         "(--responses-store-max; 0: none)", own, registry=r).labels(model_name)
        self.responses_evicted = Counter("kvload_responses_evicted", "Kept responses dropped, least recently used "
                                         "first, to stay within --responses-store-max", own,
                                         registry=r).labels(model_name)
        self.engine: Any = None

    def watch_responses(self, store: Any) -> None:
        """Read the kept responses' count from ``store`` (a ``ResponseStore``) at scrape time; show its bound."""
        self.responses_stored.set_function(lambda: len(store))
        self.responses_store_max.set(store.max_responses)

    def attach(self, engine: Any) -> None:
        """Read queue lengths and KV usage from ``engine.snapshot()`` at scrape time."""
        self.engine = engine
        self.registry.register(_EngineCollector(self))

    # --- EngineObserver ------------------------------------------------------------------------

    def on_step(self, stats: Any, new_tokens: int) -> None:
        """Count the step, its generated tokens and drafts, its preemptions, suspensions and recomputed tokens."""
        self.steps.inc()
        if stats.scheduled_tokens:
            self.iteration_tokens.observe(stats.scheduled_tokens)
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
        if getattr(stats, "recomputed_tokens", 0):
            self.recomputed.inc(stats.recomputed_tokens)
        if getattr(stats, "draft_tokens", 0):
            self.draft_tokens.inc(stats.draft_tokens)
            self.accepted_tokens.inc(stats.accepted_draft_tokens)
            self.drafts.inc(getattr(stats, "drafts", 0))
            for counter, n in zip(self.accepted_per_pos, getattr(stats, "accepted_per_position", ()), strict=False):
                counter.inc(n)
        out = stats.output
        if out is not None:
            if out.preempted:
                self.preemptions.inc(len(out.preempted))
            if out.suspended:
                self.suspensions.inc(len(out.suspended))

    def on_finished(self, done: Any) -> None:
        """Count a request that ended (an ``engine.serving.FinishedRequest``) and observe its latencies and sizes.
        The per-request histograms count the requests that got a first token (one aborted or failed before its
        prefill ended has no latency to give), so their ``_count`` are equal."""
        self.success.labels(*self.label_values, done.reason).inc()
        gaps = done.inter_token_s
        for t in gaps:
            self.itl.observe(t)
        ttft = done.ttft_s
        self._end_of_sample(done, ttft is not None)
        if ttft is None:
            return
        self.prompt_tokens.inc(done.prompt_tokens)
        cached = done.reused_prompt_tokens
        recomputed = 1 if cached + 1 == done.prompt_tokens else 0  # vLLM's rule: the whole prompt was cached
        self.prompt_by_source["local_compute"].inc(done.prompt_tokens - cached)
        self.prompt_by_source["local_cache_hit"].inc(cached + recomputed)
        self.prompt_cached.inc(cached)
        if recomputed:
            self.prompt_recomputed.inc(recomputed)
        self.ttft.observe(ttft)
        self.e2e.observe(done.token_times[-1] - done.queued_at)
        phases = done.phases
        if phases is not None:
            for histogram, seconds in zip((self.queue, self.prefill, self.decode, self.inference), phases,
                                          strict=True):
                histogram.observe(seconds)
            if done.output_tokens > 1:
                self.request_tpot.observe(phases[2] / (done.output_tokens - 1))
        self.request_prompt.observe(done.prompt_tokens)
        self.request_generation.observe(done.output_tokens)
        self.request_computed.observe(done.prompt_tokens - done.reused_prompt_tokens)
        if done.sample == 0:  # the parameters of a prompt's n samples, once
            self.params_n.observe(done.samples)
            self.params_max_tokens.observe(done.params.max_tokens)

    def _end_of_sample(self, done: Any, first_token: bool) -> None:
        """Observe a prompt's most generated tokens when its last sample ended, once (vLLM's
        request_max_num_generation_tokens), for the groups ``request_params_n`` counts (its sample 0 got a token)."""
        if done.group is None or done.samples <= 1:
            if first_token:
                self.max_generation.observe(done.output_tokens)
            return
        group = self._groups.setdefault(done.group, [done.samples, 0, False])
        group[0] -= 1
        group[1] = max(group[1], done.output_tokens)
        group[2] = group[2] or (done.sample == 0 and first_token)
        if group[0] <= 0:
            del self._groups[done.group]
            if group[2]:
                self.max_generation.observe(group[1])

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


class _Alias:
    """A histogram's samples under another family name (vLLM serves its old and new names for one measurement)."""

    def __init__(self, source: Histogram, name: str, documentation: str) -> None:
        self.source, self.name, self.documentation = source, name, documentation

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, "histogram")]

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            alias = Metric(self.name, self.documentation, "histogram")
            alias.samples = [s._replace(name=self.name + s.name[len(family.name):]) for s in family.samples]
            yield alias


class _EngineCollector:
    """Gauges and manager counters from one engine snapshot per scrape."""

    def __init__(self, metrics: ServeMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # unchecked: names come from collect() only

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        snap = m.engine.snapshot()
        vllm = m.naming == "vllm"
        labels, values = m.labels, m.label_values
        name = [m.model_name]
        # vLLM's waiting queue holds its preempted requests too: under its names, a suspended request (V2, off the
        # device until it resumes) waits as well, so an autoscaler on num_requests_waiting sees every one not running
        waiting = snap["waiting"] + snap["suspended"] if vllm else snap["waiting"]
        for key, count, text in (("running", snap["running"], "Requests in the running batch"),
                                 ("waiting", waiting, "Requests waiting for admission" + (
                                     " or suspended to the host tier" if vllm else ""))):
            g = GaugeMetricFamily(metric_name(m.naming, f"num_requests_{key}"), text, labels=labels)
            g.add_metric(values, count)
            yield g
        g = GaugeMetricFamily("kvload_num_requests_suspended", "Requests suspended to the host tier (V2)",
                              labels=["model_name"])
        g.add_metric(name, snap["suspended"])
        yield g
        stats = snap["manager"]  # a cache_backends.stats.ManagerStats, None once the manager is closed
        groups = stats.groups if stats is not None else {}
        if vllm:  # vLLM's one gauge: the device KV memory in use (weighted by bytes across layer groups)
            usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "Fraction of KV cache memory in use (1 = 100%)",
                                      labels=labels)
            if stats is not None:
                usage.add_metric(values, float(stats.usage))
            yield usage
        usage = GaugeMetricFamily("kvload_kv_cache_usage_perc", "Fraction of KV blocks in use, per layer group",
                                  labels=["model_name", "layer_group"])
        blocks = GaugeMetricFamily("kvload_kv_cache_blocks", "KV blocks per layer group and state",
                                   labels=["model_name", "layer_group", "state"])
        arena_free: int | None = None
        arena_total = 0
        pages = 0
        for group, g in groups.items():
            usage.add_metric([*name, group], float(g.usage))
            states = [("evictable", g.evictable), ("used", g.used)]
            if g.shared:  # the arena's free pages belong to no group: reported once, so sums stay right
                arena_free, arena_total = g.free, g.total
            else:
                states.insert(0, ("free", g.free))
                pages += g.total
            for state, n in states:
                blocks.add_metric([*name, group, state], float(n))
        if arena_free is not None:
            blocks.add_metric([*name, SHARED_ARENA_LABEL, "free"], float(arena_free))
        yield usage
        yield blocks
        slab_arena = stats.arena if stats is not None else None
        if slab_arena:  # a slab arena (pool_arena): its free slabs belong to no group, and no group's total is fixed
            slabs = GaugeMetricFamily("kvload_kv_cache_slabs", "Slabs of a slab arena (pool_arena): free, or owned by "
                                      "a layer group (its blocks are in the group's series)",
                                      labels=["model_name", "state"])
            free_slabs = slab_arena["free_slabs"]
            slabs.add_metric([*name, "free"], float(free_slabs))
            slabs.add_metric([*name, "owned"], float(slab_arena["slabs"] - free_slabs))
            yield slabs
        queries = CounterMetricFamily(metric_name(m.naming, "prefix_cache_queries"),
                                      "Prompt tokens looked up in the prefix cache", labels=labels)
        queries.add_metric(values, float(stats.reuse_query_tokens if stats is not None else 0))
        yield queries
        hits = CounterMetricFamily(metric_name(m.naming, "prefix_cache_hits"),
                                   "Prompt tokens whose KV came from the prefix cache", labels=labels)
        hits.add_metric(values, float(stats.reuse_hit_tokens if stats is not None else 0))
        yield hits
        if stats is not None:  # vLLM's info gauge (always 1): the cache settings kvload has, as labels
            info = {"block_size": ",".join(str(n) for n in sorted({g.tokens_per_block for g in groups.values()})),
                    "num_gpu_blocks": str(pages + arena_total),
                    "enable_prefix_caching": str(bool(stats.reuse.enabled)),
                    "kv_cache_manager": stats.kind}
            if vllm:  # vLLM's labels: the settings and the engine, no model_name
                info["engine"] = "0"
            else:  # every kvload_ series names its model
                info = {"model_name": m.model_name, **info}
            g = GaugeMetricFamily(metric_name(m.naming, "cache_config_info"), "The KV cache's settings (value 1)",
                                  labels=list(info))
            g.add_metric(list(info.values()), 1.0)
            yield g


__all__ = ["REFUSAL_REASONS", "ServeMetrics"]
