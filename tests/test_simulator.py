"""The workload simulator's accounting: what it reports equals what the workloads' construction implies."""

from __future__ import annotations

import pytest

from engine.simulator import METRIC_FIELDS, percentile, simulate
from engine.workloads import Workload, make_workload
from pipeline.errors import ConfigError, KvBuildError

CPU = {"device": "cpu", "log": False, "progress": False}
T = 32  # tokens_per_block of the tiny presets
SMALL = {
    "shared-prefix": (12, {"group_size": 4, "prefix_len": 64, "question_len": 8, "answer_len": 6}),
    "multi-turn": (8, {"turns": 4, "first_len": 40, "user_len": 9, "answer_len": 7}),
    "long-context": (3, {"prompt_len": 100, "answer_len": 5}),
    "no-reuse": (10, {"prompt_len": 40, "answer_len": 5}),
    "mixed-priority": (12, {"prompt_len": 40, "answer_len": 5, "urgent_every": 3, "urgent_len": 8,
                            "urgent_answer_len": 3}),
    "mixed": (24, {"prompt_min": 4, "prompt_max": 80, "answer_min": 1, "answer_max": 8, "prefixes": 2,
                   "prefix_len": 64, "shared_percent": 50, "urgent_percent": 25, "max_gap": 2}),
}


def small(name: str, **kw) -> dict:
    requests, params = SMALL[name]
    return {"requests": requests, "params": params, **kw}


def block_granular_hits(w: Workload) -> int:
    """Reused tokens a full-block prefix cache gets when nothing is evicted: the ideal rounded down to blocks.

    Every ideal here is a prefix the cache holds whole (a shared prefix, or the previous turn's
    computed tokens), so the cache reuses its full blocks, leaving the last prompt token to compute.
    """
    return sum(min(r.ideal_reuse, len(r.prompt) - 1) // T * T for r in w.requests)


def whole_hits(w: Workload) -> int:
    """Reused tokens a prefix cache that also copies a history's partial last block gets when nothing is evicted
    (V2): the ideal, less the last prompt token."""
    return sum(min(r.ideal_reuse, len(r.prompt) - 1) for r in w.requests)


def accounted(m, w: Workload) -> None:
    """Every request finished with its scripted answer, and each computed token is accounted for."""
    assert m.finished == len(w.requests)
    assert m.output_tokens == sum(len(r.answer) for r in w.requests)
    assert m.prompt_tokens == w.prompt_tokens
    # each request computes prompt + answer - 1 tokens (the last answer token is never fed), minus reuse
    if m.preemptions == 0:
        assert m.computed_tokens == sum(len(r.prompt) + len(r.answer) - 1 for r in w.requests) - m.reused_tokens
    assert 0 < m.peak_usage <= 1 and 0 < m.mean_usage <= m.peak_usage
    assert 1 <= m.max_concurrency <= len(w.requests)
    assert m.engine_steps <= m.steps and len(m.step_times_us) == m.engine_steps
    assert m.step_time_us_median <= m.step_time_us_p99


@pytest.mark.parametrize("name", list(SMALL))
def test_each_workload_replays_completely_on_both_managers_with_exact_accounting(name):
    report = simulate("tiny-llama", name, compare=True, kv_cache_config={"max_tokens": 1 << 16}, **small(name), **CPU)
    w = report.workload
    v1, v2 = report.results["KVCacheManager"], report.results["KVCacheManagerV2"]
    assert (v1.status, v2.status) == ("ok", "ok")
    assert v1.budget_bytes == v2.budget_bytes == report.budget.bytes
    for r in (v1, v2):
        accounted(r.metrics, w)
        assert r.metrics.waits == 0 and r.metrics.suspends == r.metrics.preemptions == 0  # ample memory
        assert r.metrics.reused_tokens == (whole_hits(w) if r is v2 else block_granular_hits(w))
        assert r.metrics.hit_rate == round(r.metrics.reused_tokens / w.prompt_tokens, 6)
        assert r.metrics.ideal_hit_rate == round(w.ideal_hit_rate, 6)


@pytest.mark.parametrize("v2", [False, True])
def test_priority_policy_admits_the_urgent_requests_of_mixed_priority_first(v2):
    """Memory for a few batch requests while one arrives per step: under "fcfs" the urgent requests queue behind
    them; under "priority" each is admitted as soon as room frees, so their mean admission delay falls (the table
    shows it on its own row), and every request still finishes with its answer."""
    kw = {"requests": 64, "params": {"prompt_len": 200, "answer_len": 16, "urgent_every": 4, "urgent_len": 16,
                                      "urgent_answer_len": 4},
          "kv_cache_config": {"max_tokens": 4 * 256, "use_kv_cache_manager_v2": v2}, **CPU}
    runs = {p: simulate("tiny-llama", "mixed-priority", scheduling_policy=p, **kw) for p in ("fcfs", "priority")}
    fcfs, prio = ((r.results[next(iter(r.results))].metrics) for r in runs.values())
    for m in (fcfs, prio):
        accounted(m, runs["fcfs"].workload)
    assert fcfs.admission_delay_top_mean > 2 * max(1.0, prio.admission_delay_top_mean)
    assert prio.admission_delay_top_mean < prio.admission_delay_mean  # the batch requests wait for them
    assert "  of the top priority" in runs["priority"].render()


def test_one_priority_top_delay_is_the_mean_and_the_table_leaves_its_row_out():
    report = simulate("tiny-llama", "no-reuse", **small("no-reuse", kv_cache_config={"max_tokens": 256}), **CPU)
    (res,) = report.results.values()
    assert res.metrics.admission_delay_top_mean == res.metrics.admission_delay_mean > 0
    assert "of the top priority" not in report.render()


def test_v2_hit_rate_on_shared_prefix_equals_the_ideal_when_memory_is_ample():
    report = simulate("tiny-llama", "shared-prefix", kv_cache_config={"use_kv_cache_manager_v2": True,
                      "max_tokens": 1 << 16}, **small("shared-prefix"), **CPU)
    (v2,) = report.results.values()
    w = report.workload
    # 3 groups of 4: the 3 later prompts of each group reuse the 64-token prefix
    assert v2.kv_manager == "KVCacheManagerV2" and w.ideal_reused_tokens == 3 * 3 * 64
    assert v2.metrics.reused_tokens == w.ideal_reused_tokens
    assert v2.metrics.hit_rate == v2.metrics.ideal_hit_rate == round(9 * 64 / (12 * 72), 6)


def test_multi_turn_reuses_each_previous_turn_whole_on_v2_rounded_down_to_whole_blocks_on_v1():
    report = simulate("tiny-llama", "multi-turn", compare=True, kv_cache_config={"max_tokens": 1 << 16},
                      **small("multi-turn"), **CPU)
    w = report.workload
    # turn k reuses turn k-1's prompt + answer except its last answer token: 39+7, then +9+7 per turn
    histories = [40 + 7, 40 + 7 + 9 + 7, 40 + 2 * (7 + 9) + 7]
    assert sorted({r.ideal_reuse for r in w.requests if r.after}) == [h - 1 for h in histories]
    v1, v2 = report.results["KVCacheManager"].metrics, report.results["KVCacheManagerV2"].metrics
    assert v1.reused_tokens == 2 * sum((h - 1) // T * T for h in histories) < w.ideal_reused_tokens  # two conversations
    assert v1.hit_rate < v1.ideal_hit_rate
    # V2 copies the partial last block each finished turn left cached too: the whole history
    assert v2.reused_tokens == 2 * sum(h - 1 for h in histories) == w.ideal_reused_tokens
    assert v2.hit_rate == v2.ideal_hit_rate


def test_under_pressure_v2_admits_a_conversations_next_turn_while_its_history_is_cached():
    # 16 conversations of two turns (640-token first prompts) in room for about nine sequences: in arrival order
    # every second turn queues behind the others' first turns, which evict its history (V1 reuses nothing); V2's
    # cache-aware admission lets it in first
    report = simulate("tiny-llama", "multi-turn", compare=True, kv_cache_config={"max_tokens": 6144}, requests=32,
                      params={"turns": 2, "first_len": 640, "user_len": 32, "answer_len": 32}, **CPU)
    v1, v2 = report.results["KVCacheManager"].metrics, report.results["KVCacheManagerV2"].metrics
    assert v1.reused_tokens == 0
    assert v2.hit_rate > 0.8 * v2.ideal_hit_rate
    assert v2.admission_delay_mean < v1.admission_delay_mean
    for r in report.results.values():
        accounted(r.metrics, report.workload)


@pytest.mark.parametrize("v2", [False, True])
def test_reuse_disabled_hits_nothing(v2):
    report = simulate("tiny-llama", "shared-prefix", kv_cache_config={
        "use_kv_cache_manager_v2": v2, "max_tokens": 1 << 16, "enable_block_reuse": False}, **small("shared-prefix"),
        **CPU)
    (r,) = report.results.values()
    assert report.workload.ideal_reused_tokens > 0
    assert r.metrics.reused_tokens == 0 and r.metrics.hit_rate == 0.0
    accounted(r.metrics, report.workload)


def test_gemma3_long_context_at_one_tight_budget_v2_runs_more_sequences_than_v1():
    # sequences of 1,024 tokens; V1 keeps 6 layers x 1,024 tokens each, V2 one full layer plus five
    # 512-token windows (17 blocks), so the same bytes hold about 6*32 / (32 + 5*17) = 1.6x more.
    report = simulate("tiny-gemma3", "long-context", compare=True, requests=6, max_seq_len=1024,
                      params={"prompt_len": 1000, "answer_len": 24}, kv_cache_config={"max_tokens": 2 * 1024},
                      **CPU)
    v1, v2 = report.results["KVCacheManager"], report.results["KVCacheManagerV2"]
    assert v1.budget_bytes == v2.budget_bytes == 2 * 6 * 1024 * 256  # 2 sequences in V1's layout
    assert v1.metrics.max_concurrency == 2
    assert v2.metrics.max_concurrency >= 3
    assert v2.metrics.steps < v1.metrics.steps
    for r in (v1, v2):
        accounted(r.metrics, report.workload)
        assert r.metrics.waits > 0  # requests arrive together and queue


def test_v2_under_pressure_suspends_and_resumes_and_still_finishes_everything():
    from cache_backends.v2 import KVCacheV2Scheduler
    from engine.simulator import replay
    from kvload.api import load

    workload = make_workload("long-context", 4, 0, prompt_len=40, answer_len=200)
    with load("tiny-llama", device="cpu", max_seq_len=256,
              kv_cache_config={"use_kv_cache_manager_v2": True, "max_tokens": 2 * 256}) as result:
        manager = result.kv_manager  # greedy admission (no headroom) over-admits, so pressure is certain
        greedy = KVCacheV2Scheduler(manager, result.args.max_batch_size, result.args.max_num_tokens, init_ratio=0.0)
        m = replay(manager, greedy, workload)
        assert m.suspends >= 1 and m.resumes == m.suspends
        accounted(m, workload)
        assert m.peak_usage == 1.0
        # the same workload with the default, headroom-keeping admission: no suspension needed
        calm = replay(manager, KVCacheV2Scheduler(manager, result.args.max_batch_size, result.args.max_num_tokens),
                      workload)
        assert calm.suspends == m.suspends and calm.finished == 4  # the manager's counter did not move


def test_a_model_v1_cannot_serve_is_reported_not_routable_and_v2_still_runs():
    report = simulate("tiny-deepseek-v4", "no-reuse", compare=True, requests=3, max_seq_len=1024,
                      params={"prompt_len": 300, "answer_len": 4}, **CPU)
    v1, v2 = report.results["KVCacheManager"], report.results["KVCacheManagerV2"]
    assert v1.status == "not_routable" and v1.metrics is None
    assert "V1 cannot serve this model" in v1.reason and "compressed" in v1.reason
    assert v2.status == "ok" and v2.metrics.finished == 3
    doc = report.to_dict()["results"]["KVCacheManager"]
    assert doc["status"] == "not_routable" and all(doc[k] is None for k in METRIC_FIELDS)


def test_deepseek_v4_runs_at_least_half_the_conversations_its_budget_is_priced_for():
    """The model "auto" sends to V2: its split pools must not hold short requests back behind a window pool sized
    for max_seq_len sequences (4 of 64 conversations ran at once; BENCHMARKS.md "DeepSeek V4's split pools")."""
    report = simulate("tiny-deepseek-v4", "multi-turn", requests=64, **CPU)  # 16 conversations of 4 turns
    (v2,) = report.results.values()
    assert report.budget.default and "16 sequence(s) of 1,216 tokens" in report.budget.source
    assert report.settings["max_seq_len"] == 65536 and v2.metrics.finished == 64
    assert v2.metrics.max_concurrency >= 16 // 2
    assert v2.metrics.hit_rate >= 0.8 * v2.metrics.ideal_hit_rate


def test_a_split_budget_below_one_max_seq_len_sequence_that_stalls_says_to_lower_max_seq_len():
    """Split pools under one max_seq_len sequence hold a longest request about half as long as the budget could hold
    alone; the refusal names the flag that gives it back (an 8,192-token request in a budget of exactly one)."""
    budget = {"max_gpu_total_bytes": 1_007_616}  # one 8,192-token tiny-deepseek-v4 sequence, windows included
    kw = {"requests": 2, "params": {"prompt_len": 8000, "answer_len": 192}, **CPU}
    with pytest.raises(KvBuildError, match=r"or lower --max_seq_len \(65,536\) to the longest request: these pools "
                                           r"are split for sequences of 1,986 tokens"):
        simulate("tiny-deepseek-v4", "long-context", kv_cache_config=budget, **kw)
    (v2,) = simulate("tiny-deepseek-v4", "long-context", kv_cache_config=budget, max_seq_len=8192,
                     **kw).results.values()
    assert v2.metrics.finished == 2
    with pytest.raises(KvBuildError) as caught:  # one pool for every layer: no such advice
        simulate("tiny-llama", "long-context", kv_cache_config={"max_tokens": 64}, requests=2,
                 params={"prompt_len": 100, "answer_len": 4}, **CPU)
    assert "--max_seq_len" not in str(caught.value)


def test_the_default_budget_holds_the_workloads_sequences_in_the_routed_layout():
    report = simulate("tiny-llama", "no-reuse", **small("no-reuse"), **CPU)
    w = report.workload
    # no-reuse: answer_len + 1 = 6 sequences of 45 tokens, priced in V1's layout (1,024 B per token)
    assert report.budget.default and "6 sequence(s) of 45 tokens" in report.budget.source
    assert report.budget.bytes == 6 * 2 * 32 * 1024 == report.results["KVCacheManager"].budget_bytes  # 2 blocks each
    assert w.max_sequence_tokens == 45


def test_a_stall_names_the_budget_flags_and_in_a_comparison_becomes_a_status():
    kw = {"requests": 2, "params": {"prompt_len": 100, "answer_len": 4}, "kv_cache_config": {"max_tokens": 64}}
    with pytest.raises(KvBuildError, match=r"cannot finish workload long-context.*--max_tokens"):
        simulate("tiny-llama", "long-context", **kw, **CPU)
    report = simulate("tiny-llama", "long-context", compare=True, **kw, **CPU)
    assert {r.status for r in report.results.values()} == {"stalled"}
    assert all(r.metrics is None and r.reason for r in report.results.values())
    with pytest.raises(KvBuildError, match=r"^neither KVCacheManager nor KVCacheManagerV2 can finish workload "
                                           r"long-context at a budget of .* B: KVCacheManager: stalled \(.*"
                                           r"--max_tokens"):
        report.check_finished()


def test_same_seed_same_result_and_another_seed_other_tokens():
    def run(seed):
        r = simulate("tiny-llama", "shared-prefix", seed=seed, compare=True, kv_cache_config={"max_tokens": 1 << 16},
                     **small("shared-prefix"), **CPU)
        timing = {"step_time_us_median", "step_time_us_p99", "step_time_us_mean", "kv_seconds"}
        return {n: {k: v for k, v in x.metrics.to_dict().items() if k not in timing} for n, x in r.results.items()}

    assert run(3) == run(3)
    a = make_workload("shared-prefix", 12, 3, **SMALL["shared-prefix"][1])
    b = make_workload("shared-prefix", 12, 4, **SMALL["shared-prefix"][1])
    assert a == make_workload("shared-prefix", 12, 3, **SMALL["shared-prefix"][1]) and a != b


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"workload": "chat"}, "unknown workload 'chat'"),
    ({"workload": "no-reuse", "requests": 0}, "requests must be an integer >= 1"),
    ({"workload": "no-reuse", "params": {"prefix_len": 8}}, "no parameter 'prefix_len'; known: prompt_len"),
    ({"workload": "no-reuse", "params": {"vocab": 1}}, "vocab must be an integer >= 2"),
    ({"workload": "long-context", "max_seq_len": 512}, r"max_seq_len=512 is below the longest sequence .*8192"),
    ({"workload": "no-reuse", "compare": True, "kv_cache_config": {"use_kv_cache_manager_v2": True}},
     "drop --use_kv_cache_manager_v2"),
])
def test_bad_input_is_one_config_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        simulate("tiny-llama", **kwargs, **CPU)


def test_nearest_rank_percentile():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0 and percentile([5.0], 99) == 5.0


@pytest.mark.cuda
def test_on_cuda_both_managers_finish_a_pressured_workload_with_device_pools():
    report = simulate("tiny-gemma3", "long-context", compare=True, requests=6, max_seq_len=1024,
                      params={"prompt_len": 1000, "answer_len": 24}, kv_cache_config={"max_tokens": 2 * 1024},
                      device="cuda", log=False, progress=False)
    assert report.settings["device"].startswith("cuda")
    for r in report.results.values():
        assert r.status == "ok"
        accounted(r.metrics, report.workload)
    v1, v2 = report.results["KVCacheManager"], report.results["KVCacheManagerV2"]
    assert v2.metrics.max_concurrency > v1.metrics.max_concurrency


def test_a_tight_shared_prefix_run_on_v2_does_not_admit_and_suspend_in_a_loop():
    """Admission keeps headroom for running requests' growth: at ~40% of the working set, greedy admission
    suspends 55 times here (and loses cached prefixes); V2's default admission stays within a small bound."""
    workload = make_workload("shared-prefix", 128, 0, group_size=16, prefix_len=256, question_len=32, answer_len=64)
    report = simulate("tiny-llama", workload, compare=True, max_seq_len=512, kv_cache_config={"max_tokens": 3072},
                      **CPU)
    v1, v2 = (report.results[n].metrics for n in ("KVCacheManager", "KVCacheManagerV2"))
    assert v2.finished == 128 and v2.suspends + v2.preemptions <= 8
    assert v2.hit_rate >= 0.98 * v2.ideal_hit_rate  # greedy: 0.97 (cached prefixes evicted while suspended)
    assert v2.steps <= v1.steps


def test_a_report_says_max_page_padding_was_on_as_its_pool_bytes_and_steps_depend_on_it():
    """Two runs of one workload whose pages differ only by max_page_padding must not read as the same settings."""
    model = "tests/data/configs/gemma-3-27b-it"  # 52 sliding + 10 full layers: at 0.1, 11-layer pages, 6 groups
    kv = {"use_kv_cache_manager_v2": True, "max_tokens": 4096}
    off = simulate(model, "no-reuse", **small("no-reuse"), kv_cache_config=kv, **CPU)
    on = simulate(model, "no-reuse", **small("no-reuse"), kv_cache_config={**kv, "max_page_padding": 0.1}, **CPU)
    (r_off,), (r_on,) = off.results.values(), on.results.values()
    assert r_on.budget_bytes != r_off.budget_bytes  # the padded pages do act here
    assert on.settings["max_page_padding"] == 0.1 and on.to_dict()["settings"]["max_page_padding"] == 0.1
    assert off.settings["max_page_padding"] == 0
    assert "max_page_padding 0.1" in on.render() and "max_page_padding" not in off.render()


@pytest.mark.parametrize(("model", "says"), [
    ("tests/data/configs/gemma-3-27b-it", "pages of 11 layers for 6 groups, at most 9.1%"),
    ("tiny-gemma3", "max_page_padding padded no page: no page larger than gcd(layer counts) = 1"),
])
def test_a_comparison_says_what_max_page_padding_did_to_the_v2_column(model, says):
    """--compare logs the routed (on a CPU, V1) plan's setting_ignored only: V2's result says whether it padded."""
    report = simulate(model, "no-reuse", compare=True, **small("no-reuse"),
                      kv_cache_config={"max_tokens": 4096, "max_page_padding": 0.1}, **CPU)
    v1, v2 = report.results["KVCacheManager"], report.results["KVCacheManagerV2"]
    assert v2.padding.startswith(says) and v1.padding is None
    assert report.to_dict()["results"]["KVCacheManagerV2"]["padding"] == v2.padding
    assert f"KVCacheManagerV2: {v2.padding}" in report.render()


def test_a_single_run_leaves_max_page_padding_to_its_log_and_says_it_once():
    """Routed alone, the run's own setting_ignored already says the padding was inert: the table does not repeat it."""
    report = simulate("tiny-gemma3", "no-reuse", **small("no-reuse"), **CPU,
                      kv_cache_config={"use_kv_cache_manager_v2": True, "max_tokens": 4096, "max_page_padding": 0.1})
    (v2,) = report.results.values()
    assert v2.padding.startswith("max_page_padding padded no page") and "padded no page" not in report.render()
