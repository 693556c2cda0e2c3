"""/metrics under vLLM's names for what the prompt tokens were made of and what the samples and drafts gave, read with
prometheus_client's parser against real runs through the server: ``prompt_tokens_by_source`` / ``_cached`` /
``_recomputed`` (a shared prefix, a prompt cached but for its last token, a run under pressure that preempts),
``request_max_num_generation_tokens`` (n=3) and ``spec_decode_num_drafts`` / ``_num_accepted_tokens_per_pos``
(n-gram drafts)."""

from __future__ import annotations

import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.generate_support import prompts_for
from tests.serve_support import serving

M = "tiny-llama"
SOURCES = {"local_compute", "local_cache_hit", "external_kv_transfer"}


def _families(served):
    return {f.name: f for f in text_string_to_metric_families(served.http.get("/metrics").text)}


def _value(families, name, **labels):
    """The one sample named ``name`` with ``labels`` among its labels."""
    family = name.removesuffix("_total").removesuffix("_sum").removesuffix("_count")
    (value,) = [s.value for s in families[family].samples if s.name == name and labels.items() <= s.labels.items()]
    return value


class _Delta:
    """Samples' change between two scrapes."""

    def __init__(self, before, after):
        self.before, self.after = before, after

    def __call__(self, name, **labels):
        return _value(self.after, name, **labels) - _value(self.before, name, **labels)

    def source(self, source):
        return self("vllm:prompt_tokens_by_source_total", source=source)


@pytest.fixture(scope="module")
def served():
    with serving(M, state={"metrics_naming": "vllm"}) as s:  # V1, blocks of 32 tokens
        yield s


def test_the_prompt_token_families_have_vllms_names_types_and_labels(served):
    fams = _families(served)
    for name in ("vllm:prompt_tokens_by_source", "vllm:prompt_tokens_cached", "vllm:prompt_tokens_recomputed"):
        assert fams[name].type == "counter", name
        for s in fams[name].samples:
            assert s.labels["model_name"] == M and s.labels["engine"] == "0", s
    by_source = fams["vllm:prompt_tokens_by_source"].samples
    assert {s.labels["source"] for s in by_source} == SOURCES  # each a series from the start
    assert {frozenset(s.labels) for s in by_source} == {frozenset({"model_name", "engine", "source"})}
    assert fams["vllm:request_max_num_generation_tokens"].type == "histogram"
    assert fams["vllm:spec_decode_num_drafts"].type == "counter"


def test_a_shared_prefix_counts_as_cache_hits_and_the_rest_as_computed(served):
    shared = list(range(100, 164))  # two full blocks of 32
    before = _families(served)
    first = served.client.completions.create(model=M, prompt=[*shared, 7, 8, 9], max_tokens=2)
    second = served.client.completions.create(model=M, prompt=[*shared, 11, 12, 13, 14], max_tokens=2)
    d = _Delta(before, _families(served))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 64
    assert d.source("local_cache_hit") == 64 and d("vllm:prompt_tokens_cached_total") == 64
    assert d.source("local_compute") == 67 + 68 - 64
    assert d.source("external_kv_transfer") == 0 and d("vllm:prompt_tokens_recomputed_total") == 0
    assert d.source("local_compute") + d.source("local_cache_hit") == d("vllm:prompt_tokens_total")
    assert d("vllm:prefix_cache_hits_total") == 64


def test_a_prompt_cached_but_for_its_last_token_counts_that_token_recomputed(served):
    prompt = list(range(200, 265))  # 65 tokens: its first 64 fill two blocks, the last is computed for its logits
    before = _families(served)
    for _ in range(2):
        r = served.client.completions.create(model=M, prompt=prompt, max_tokens=2)
    d = _Delta(before, _families(served))
    assert r.usage.prompt_tokens_details.cached_tokens == 64
    assert d("vllm:prompt_tokens_recomputed_total") == 1
    assert d("vllm:prompt_tokens_cached_total") == 64
    # vLLM's invariant: computed + cache hits - recomputed = prompt tokens (the last token is a hit and computed)
    assert d.source("local_cache_hit") == 65 and d.source("local_compute") == 65 + 1
    assert d.source("local_compute") + d.source("local_cache_hit") - 1 == d("vllm:prompt_tokens_total") == 130


def test_n_samples_observe_the_most_tokens_one_of_them_generated_once_the_last_ends(served):
    before = _families(served)
    # sampled with a seed, a stop token every 6 ids: the three choices end at different lengths, the same each run
    r = served.client.completions.create(model=M, prompt=[5, 6, 7], max_tokens=12, n=3, temperature=1.5, seed=5,
                                        extra_body={"return_token_ids": True, "stop_token_ids": list(range(0, 512, 6))})
    lengths = [len(c.model_extra["token_ids"]) for c in r.choices]
    one = served.client.completions.create(model=M, prompt=[5, 6, 7], max_tokens=4, extra_body={"ignore_eos": True})
    d = _Delta(before, _families(served))
    assert len(set(lengths)) == 3, lengths  # max, sum and last differ
    assert one.usage.completion_tokens == 4
    assert d("vllm:request_max_num_generation_tokens_count") == 2  # one per prompt, as request_params_n
    assert d("vllm:request_params_n_count") == 2
    assert d("vllm:request_max_num_generation_tokens_sum") == max(lengths) + 4


def test_prompt_tokens_recomputed_after_a_preemption_are_not_counted_as_cached():
    """Neither in /metrics nor in the response's ``usage.prompt_tokens_details.cached_tokens``: vLLM counts a prompt's
    sources once, as it was first scheduled: the prefix a preempted request finds again on re-admission is its own
    recompute, not a cache hit (it shows in iteration_tokens_total, as in vLLM, and in kvload's own
    kvload_preemption_recomputed_tokens)."""
    kv = {"max_tokens": 128, "tokens_per_block": 16, "use_kv_cache_manager_v2": True, "host_cache_size": 0}
    prompts = [[i * 20 + k + 1 for k in range(20)] for i in range(6)]  # no two share a block
    with serving(M, state={"metrics_naming": "vllm"}, kv_cache_config=kv, max_seq_len=128) as s:
        before = _families(s)
        done, cached = [], []

        def ask(prompt):
            r = s.client.completions.create(model=M, prompt=prompt, max_tokens=60, extra_body={"ignore_eos": True})
            done.append(r.usage.completion_tokens)
            cached.append(r.usage.prompt_tokens_details.cached_tokens)

        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        d = _Delta(before, _families(s))
    assert done == [60] * 6
    assert d("vllm:num_preemptions_total") > 0  # six requests growing to 80 tokens in 128 tokens of KV
    assert cached == [0] * 6  # the client's usage says the same: its prompt was first computed, not found cached
    assert d("vllm:prompt_tokens_total") == 120
    assert d.source("local_compute") == 120 and d.source("local_cache_hit") == 0
    assert d("vllm:prompt_tokens_cached_total") == 0 and d("vllm:prompt_tokens_recomputed_total") == 0
    assert d("vllm:request_prefill_kv_computed_tokens_sum") == 120
    # kvload's own count of them: every token computed is a prompt's once, a decode step's, or one computed again
    recomputed = d("kvload_preemption_recomputed_tokens_total")
    assert recomputed > 0
    assert d("vllm:iteration_tokens_total_sum") == 120 + 6 * 59 + recomputed


def test_drafts_and_accepted_tokens_per_position(tiny_checkpoints):
    path = tiny_checkpoints("qwen3")
    with serving(str(path), max_draft_len=4, max_seq_len=64, state={"metrics_naming": "vllm"},
                 kv_cache_config={"max_tokens": 512, "tokens_per_block": 4}) as served:
        model = served.client.models.list().data[0].id
        before = _families(served)
        per_pos = before["vllm:spec_decode_num_accepted_tokens_per_pos"]
        assert per_pos.type == "counter"
        assert {s.labels["position"]: s.value for s in per_pos.samples} == {"0": 0, "1": 0, "2": 0, "3": 0}
        assert all(s.labels["engine"] == "0" and s.labels["model_name"] == model for s in per_pos.samples)
        for prompt in prompts_for(512, (5, 7)):
            served.client.completions.create(model=model, prompt=prompt, max_tokens=30,
                                             extra_body={"ignore_eos": True})
        after = _families(served)
    d = _Delta(before, after)
    drafts = d("vllm:spec_decode_num_drafts_total")
    accepted = [d("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(4)]
    assert drafts > 0 and drafts <= d("vllm:spec_decode_num_draft_tokens_total") <= 4 * drafts
    assert sum(accepted) == d("vllm:spec_decode_num_accepted_tokens_total") > 0
    # a draft's position i is accepted only after 0 ... i-1: never more at a later position, none past a draft
    assert drafts >= accepted[0] >= accepted[1] >= accepted[2] >= accepted[3]
