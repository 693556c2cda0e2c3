"""/metrics under kvload's names and under vLLM's own (``--metrics-name-prefix vllm``), read with prometheus_client's
parser: the families a vLLM dashboard or autoscaler reads exist with vLLM's types and labels, and the request
histograms count every request served, with phases that add up to the end-to-end latency."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cli_support import run_cli, served_with
from tests.serve_support import serving

#: family (prometheus_client's name: a counter's without ``_total``) → type, with the prefix left off
COUNTERS = ("prompt_tokens", "generation_tokens", "num_preemptions", "request_success", "prefix_cache_queries",
            "prefix_cache_hits", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            "spec_decode_num_drafts", "prompt_tokens_by_source", "prompt_tokens_cached", "prompt_tokens_recomputed")
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "cache_config_info")
#: the histograms with one observation per request served
REQUEST_HISTOGRAMS = ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_prefill_time_seconds", "request_decode_time_seconds",
                      "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                      "request_prefill_kv_computed_tokens", "request_time_per_output_token_seconds")
HISTOGRAMS = (*REQUEST_HISTOGRAMS, "time_per_output_token_seconds", "inter_token_latency_seconds",
              "request_params_n", "request_params_max_tokens", "request_max_num_generation_tokens",
              "iteration_tokens_total")
#: kvload's own series, which keep their name under either scheme
OWN = ("kvload_num_requests_suspended", "kvload_engine_steps", "kvload_num_suspensions", "kvload_kv_cache_blocks",
       "kvload_preemption_recomputed_tokens", "kvload_http_requests_in_flight", "kvload_http_requests_refused",
       "kvload_responses_stored",
       "kvload_responses_store_max", "kvload_responses_evicted")

PROMPTS = [[3, 4, 5, 6, 7], [9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27]]
MAX_TOKENS = [6, 4, 5]


def _prefix(naming):
    return "vllm:" if naming == "vllm" else "kvload_"


class _Served:
    """A served model and the naming its /metrics uses."""

    def __init__(self, served, naming):
        self.client, self.http, self.naming = served.client, served.http, naming


@pytest.fixture(scope="module", params=["kvload", "vllm"])
def served(request):
    with serving("tiny-llama", state={"metrics_naming": request.param}) as s:
        yield _Served(s, request.param)


def _families(served):
    return {f.name: f for f in text_string_to_metric_families(served.http.get("/metrics").text)}


def _value(families, family, suffix="", **labels):
    """The one sample of ``family`` named ``family + suffix`` with ``labels`` among its labels."""
    (value,) = [s.value for s in families[family].samples
                if s.name == family + suffix and labels.items() <= s.labels.items()]
    return value


def test_every_family_has_the_schemes_name_type_and_labels(served):
    p = _prefix(served.naming)
    fams = _families(served)
    want_labels = {"model_name", "engine"} if served.naming == "vllm" else {"model_name"}
    expected = {**dict.fromkeys(COUNTERS, "counter"), **dict.fromkeys(GAUGES, "gauge"),
                **dict.fromkeys(HISTOGRAMS, "histogram")}
    for base, kind in expected.items():
        family = fams.get(p + base)
        assert family is not None, f"{p + base} missing"
        assert family.type == kind, (base, family.type)
        assert family.samples, base
        for s in family.samples:
            if base == "cache_config_info" and served.naming == "vllm":  # vLLM's: the settings and engine only
                assert s.labels["engine"] == "0" and "model_name" not in s.labels and s.value == 1.0
                assert s.labels["enable_prefix_caching"] == "True" and int(s.labels["num_gpu_blocks"]) > 0
                continue
            extra = set(s.labels) - want_labels
            assert want_labels <= set(s.labels), (s.name, s.labels)
            allowed = {"le", "finished_reason", "source", "block_size", "num_gpu_blocks", "enable_prefix_caching",
                       "kv_cache_manager"}
            if served.naming == "kvload":  # kvload's usage is per layer group; vLLM's one gauge has no such label
                allowed.add("layer_group")
            assert extra <= allowed, (s.name, s.labels)
            assert s.labels["model_name"] == "tiny-llama"
            if served.naming == "vllm":
                assert s.labels["engine"] == "0"
    reasons = {s.labels["finished_reason"] for s in fams[p + "request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error"}
    for name in OWN:
        assert name in fams, name
    if served.naming == "vllm":  # nothing vLLM has a name for is left under kvload's
        assert not {n for n in fams if n.startswith("kvload_")} - set(OWN) - {"kvload_kv_cache_usage_perc"}
        (usage,) = fams["vllm:kv_cache_usage_perc"].samples  # vLLM's one gauge, not one per layer group
        assert 0.0 <= usage.value <= 1.0
    else:
        assert not [n for n in fams if n.startswith("vllm:")]


def test_counters_move_and_request_histograms_count_every_request_served(served):
    p = _prefix(served.naming)
    before = _families(served)
    for ids, n in zip(PROMPTS, MAX_TOKENS, strict=True):
        r = served.client.completions.create(model="tiny-llama", prompt=ids, max_tokens=n,
                                             extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == n
    two = served.client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=3, n=2,
                                           extra_body={"ignore_eos": True})
    assert len(two.choices) == 2
    after = _families(served)

    def delta(base, suffix="", **labels):
        return _value(after, p + base, suffix, **labels) - _value(before, p + base, suffix, **labels)

    served_requests = len(PROMPTS) + 2  # n=2 is two engine requests
    prompt_sum = sum(map(len, PROMPTS)) + 2 * len(PROMPTS[0])
    generated = sum(MAX_TOKENS) + 2 * 3
    assert delta("prompt_tokens", "_total") == prompt_sum
    computed, hit = (delta("prompt_tokens_by_source", "_total", source=s) for s in ("local_compute", "local_cache_hit"))
    assert computed + hit - delta("prompt_tokens_recomputed", "_total") == prompt_sum
    assert hit - delta("prompt_tokens_recomputed", "_total") == delta("prompt_tokens_cached", "_total")
    assert delta("generation_tokens", "_total") == generated
    assert delta("request_success", "_total", finished_reason="length") == served_requests
    assert delta("prefix_cache_queries", "_total") > 0
    for base in REQUEST_HISTOGRAMS:
        assert delta(base, "_count") == served_requests, base
    assert delta("request_prompt_tokens", "_sum") == prompt_sum
    assert delta("request_generation_tokens", "_sum") == generated
    assert delta("request_prefill_kv_computed_tokens", "_sum") <= prompt_sum
    # the inter-token intervals: one per step after the first of each request (one token a step here)
    assert delta("inter_token_latency_seconds", "_count") == generated - served_requests
    assert delta("time_per_output_token_seconds", "_count") == generated - served_requests
    # n and max_tokens once per prompt's samples: 4 prompts, the last with n=2
    assert delta("request_params_n", "_count") == len(PROMPTS) + 1
    assert delta("request_params_n", "_sum") == len(PROMPTS) + 2
    assert delta("request_params_max_tokens", "_sum") == sum(MAX_TOKENS) + 3
    assert delta("request_max_num_generation_tokens", "_count") == len(PROMPTS) + 1  # when the group's last ends
    assert delta("request_max_num_generation_tokens", "_sum") == sum(MAX_TOKENS) + 3
    # the phases add up: inference = prefill + decode, end-to-end = queue + inference (one clock, per request)
    assert delta("request_inference_time_seconds", "_sum") == pytest.approx(
        delta("request_prefill_time_seconds", "_sum") + delta("request_decode_time_seconds", "_sum"), abs=1e-6)
    assert delta("e2e_request_latency_seconds", "_sum") == pytest.approx(
        delta("request_queue_time_seconds", "_sum") + delta("request_inference_time_seconds", "_sum"), abs=1e-6)
    assert delta("time_to_first_token_seconds", "_sum") == pytest.approx(
        delta("request_queue_time_seconds", "_sum") + delta("request_prefill_time_seconds", "_sum"), abs=1e-6)
    # one observation per step that computed tokens, each step's tokens once
    steps = _value(after, "kvload_engine_steps", "_total") - _value(before, "kvload_engine_steps", "_total")
    assert delta("iteration_tokens_total", "_count") == steps
    assert delta("iteration_tokens_total", "_sum") >= generated
    # prompts land in vLLM's 1-2-5 buckets: at most 5 tokens: 5, 3 and 5 twice; the 8-token one above
    assert delta("request_prompt_tokens", "_bucket", le="5.0") == 4  # 5 tokens thrice (n=2), 3 once: cumulative
    assert delta("request_prompt_tokens", "_bucket", le="2.0") == 0
    assert _value(after, p + "num_requests_running") == 0 and _value(after, p + "num_requests_waiting") == 0


def test_the_flag_reaches_the_served_state_and_a_bad_one_exits_2_with_one_line(capsys, monkeypatch):
    assert served_with(monkeypatch)["metrics_naming"] == "kvload"
    assert served_with(monkeypatch, "--metrics-name-prefix", "vllm")["metrics_naming"] == "vllm"
    assert served_with(monkeypatch, "--metrics_name_prefix", "vllm")["metrics_naming"] == "vllm"
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", "--metrics-name-prefix", "prom")
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith("error: --metrics-name-prefix: expected one of kvload, vllm, got 'prom'"), r.err
