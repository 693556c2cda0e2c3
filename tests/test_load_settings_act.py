"""Every setting that acts at load or generation time acts, or a ``setting_ignored`` names it: never a silent no-op.

tests/test_precedence_properties.py holds the rule for the settings a ``plan`` acts on; these are the others (the
manager's reuse and resume knobs, the host tier and event buffer as a load builds them, the engine's batch and token
limits, scheduling policy, drafts, backends, model dtype, weights seed, sampling defaults). Each case loads a tiny
checkpoint through ``kvload.LLM`` with one setting at a value other than its default, on V1 and on V2, runs a small
workload that exercises it, and compares what a user can observe against the same load without it: the built
manager's config and options, the scheduler's and executor's, the weights' dtype, the default SamplingParams, the
tokens generated, prompt tokens reused, the run's stats, the KV events recorded. Each case names what must differ, or
that a ``setting_ignored`` names the field (with its reason). ``test_the_cases_cover_every_load_time_field`` keeps the
table in step with the config classes.
"""

from __future__ import annotations

from typing import Any

import pytest

import kvload
from engine.sampling_params import SamplingParams
from pipeline.config import GenerationDefaults, KvCacheConfig, LlmArgs, public_fields
from tests.llm_support import llm_kwargs, with_tokenizer
from tests.test_precedence_properties import PLAN_FIELDS

#: Two groups of prompts sharing 8- and 10-token prefixes (4-token blocks: whole and partial blocks reused).
SHARED = [" ".join(f"w{(i * 7 + j) % 500 + 1}" for j in range(10)) + " "
          + " ".join(f"w{(k * 13 + j) % 500 + 1}" for j in range(5)) for k, i in enumerate([1, 1, 1, 2, 2, 3])]
#: A prompt whose continuation the n-gram drafter can look up (it repeats itself).
REPEAT = " ".join(["w5 w6 w7 w8"] * 4)


def _manager_options(llm: kvload.LLM) -> dict[str, Any]:
    options = llm.result.kv_manager.options
    return {a: getattr(options, a) for a in ("enable_block_reuse", "enable_partial_reuse", "host_cache_size",
                                              "max_util_for_resume", "enable_swa_scratch_reuse")}


def observe(path: str, manager: str, settings: dict[str, Any], workload: str) -> dict[str, Any]:
    """What a user of one load can see: the audit's setting_ignored and kv_manager_built, the built objects' settings,
    the default SamplingParams and what ``workload`` generated."""
    kv = settings.pop("kv_cache_config", {})
    with kvload.LLM(path, **{**llm_kwargs(manager, **kv), **settings}) as llm:
        executor, scheduler = llm.result.executor, llm.result.scheduler
        seen: dict[str, Any] = {
            "built": {k: v for k, v in llm.audit.of("kv_manager_built")[0].items() if k not in ("seq", "ts", "prev")},
            "options": _manager_options(llm),
            "scheduler": (type(scheduler).__name__, scheduler.max_batch_size, scheduler.max_num_tokens,
                          scheduler.scheduling_policy),
            "backends": (executor.flex is not None, executor.decode_kernel is not None, executor.linear is not None),
            "drafts": None if executor.proposer is None else repr(executor.proposer),
            "weights": str(llm.result.hf_model.dtype),
            "defaults": repr(llm.get_default_sampling_params()),
        }
        if workload == "shared":
            outs = llm.generate(SHARED, SamplingParams(max_tokens=6, ignore_eos=True))
            outs += llm.generate(SHARED[:2], SamplingParams(max_tokens=6, ignore_eos=True))
        elif workload == "priority":  # the last prompt ranks first (lower is better, as vLLM's; fcfs takes only 0)
            ranks = [5, 5, 5, 5, 5, 0] if llm.args.scheduling_policy == "priority" else None
            outs = llm.generate(SHARED, SamplingParams(max_tokens=6, ignore_eos=True), priority=ranks)
        elif workload == "repeat":  # one request: within speculation_max_batch_size's default of 1
            outs = llm.generate([REPEAT], SamplingParams(max_tokens=8, ignore_eos=True))
        else:  # "defaults": the load's sampling defaults, no SamplingParams
            outs = llm.generate(SHARED[:2])
        seen["tokens"] = [o.outputs[0].token_ids for o in outs]
        seen["reused"] = [o.reused_prompt_tokens for o in outs]
        stats = llm.last_stats
        seen["stats"] = {k: getattr(stats, k) for k in ("steps", "preemptions", "suspends", "resumes",
                                                          "draft_tokens", "accepted_draft_tokens")}
        if workload == "priority":
            firsts = [o.timings.first_token_s for o in outs]
            seen["order"] = firsts.index(min(firsts))  # the prompt that got its first token first
        seen["kv_events"] = len(llm.result.kv_cache_events()) if kv.get("event_buffer_max_size") else None
        seen["ignored"] = {e["field"]: e["reason"] for e in llm.audit.of("setting_ignored")}
    return seen


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, tmp_path_factory):
    """The tiny llama (no windows) and mistral (sliding windows) with word-level tokenizers."""
    return {family: str(with_tokenizer(tiny_checkpoints(family), tmp_path_factory.mktemp(family) / "ckpt", 512))
            for family in ("llama", "mistral")}


_BASELINES: dict[tuple[str, str, str], dict[str, Any]] = {}


def baseline(checkpoints: dict[str, str], family: str, manager: str, workload: str) -> dict[str, Any]:
    key = (family, manager, workload)
    if key not in _BASELINES:
        _BASELINES[key] = observe(checkpoints[family], manager, {}, workload)
    return _BASELINES[key]


def _case(manager: str, settings: dict[str, Any], how: str, workload: str = "shared", family: str = "llama") -> Any:
    name = ",".join(f"{k}={v}" for k, v in {**settings.get("kv_cache_config", {}),
                                               **{k: v for k, v in settings.items() if k != "kv_cache_config"}}.items())
    return pytest.param(manager, settings, how, workload, family, id=f"{manager}-{family}-{name}")


def _kv(**kv: Any) -> dict[str, Any]:
    return {"kv_cache_config": kv}


IGNORED = "ignored"  # a setting_ignored names the field
#: (manager, settings, what must differ from the same load without them, workload, family). ``how`` is a key of
#: :func:`observe` ("ignored": a setting_ignored names the field).
CASES = [
    # prefix reuse: off reuses nothing; partial reuse off keeps V2 to whole blocks; V1 reuses whole blocks only
    *[_case(m, _kv(enable_block_reuse=False), "reused") for m in ("v1", "v2")],
    _case("v2", _kv(enable_partial_reuse=False), "reused"),
    _case("v1", _kv(enable_partial_reuse=True), IGNORED),
    _case("v2", _kv(enable_block_reuse=False, enable_partial_reuse=True), IGNORED),
    # the resume threshold: the V2 manager refuses resumes above it (test_kv_v2_manager; a run whose resumes it moves:
    # test_max_util_for_resume_decides_when_a_suspended_request_comes_back); V1 never resumes
    _case("v2", _kv(max_util_for_resume=0.5), "options"),
    _case("v1", _kv(max_util_for_resume=0.5), IGNORED),
    _case("v2", _kv(host_cache_size=0, max_util_for_resume=0.5), IGNORED),
    # window scratch: mistral's out-of-window blocks kept for reuse or dropped; nothing to do without windows or on V1
    _case("v2", _kv(enable_swa_scratch_reuse=False), "reused", family="mistral"),
    _case("v2", _kv(enable_swa_scratch_reuse=True), IGNORED),
    _case("v1", _kv(enable_swa_scratch_reuse=True), IGNORED, family="mistral"),
    # the host tier as the load builds it
    *[_case("v2", _kv(host_cache_size=size), "built") for size in (0, 2**20)],
    _case("v1", _kv(host_cache_size=2**20), IGNORED),
    # KV cache events recorded for kv_cache_events()
    *[_case(m, _kv(event_buffer_max_size=16), "kv_events") for m in ("v1", "v2")],
    # the pools' dtype
    *[_case(m, _kv(dtype="float16"), "built") for m in ("v1", "v2")],
    # the engine's batch and token limits: fewer requests or tokens a step, more steps
    *[_case(m, {"max_batch_size": 1}, "stats") for m in ("v1", "v2")],
    *[_case(m, {"max_num_tokens": 8}, "scheduler") for m in ("v1", "v2")],
    # priority: V2 admits the best-ranked first; V1 only in part (never preempts), said
    _case("v2", {"scheduling_policy": "priority"}, "scheduler", workload="priority"),
    _case("v1", {"scheduling_policy": "priority"}, IGNORED, workload="priority"),
    # n-gram drafts: the executor's proposer; drafted where the batch is within speculation_max_batch_size (the
    # random model's greedy tokens rarely repeat: a few drafts, on the second call's two prompts); their knobs while
    # drafts are off are said to do nothing
    *[_case(m, {"max_draft_len": 4}, "drafts", workload="repeat") for m in ("v1", "v2")],
    _case("v1", {"max_draft_len": 4, "max_matching_ngram_size": 1}, "drafts", workload="repeat"),
    *[_case(m, {"max_draft_len": 4, "speculation_max_batch_size": 8}, "stats") for m in ("v1", "v2")],
    *[_case("v1", {field: value}, IGNORED) for field, value in (("max_matching_ngram_size", 1),
                                                                 ("speculation_max_batch_size", 4))],
    # backends (auto on CPU is cpu_kernel for both): the executor's attention and projection paths
    *[_case(m, {"attention_backend": "sdpa"}, "backends") for m in ("v1", "v2")],
    _case("v1", {"attention_backend": "triton"}, IGNORED),
    *[_case(m, {"linear_backend": "torch"}, "backends") for m in ("v1", "v2")],
    # the model's dtype: the weights (and the pools, kv dtype auto)
    *[_case(m, {"dtype": "bfloat16"}, "weights") for m in ("v1", "v2")],
    # weights_seed seeds a preset's random weights; a checkpoint's are read
    _case("v1", {"weights_seed": 5}, IGNORED),
    # beams: generate returns one sequence a prompt, said
    _case("v1", {"max_beam_width": 2}, IGNORED),
    # sampling defaults for requests that give no SamplingParams
    *[_case("v1", {"override_generation_config": {key: value}}, "defaults", workload="defaults")
      for key, value in (("temperature", 0.5), ("repetition_penalty", 1.2), ("max_new_tokens", 7),
                         ("do_sample", True))],
    _case("v1", {"override_generation_config": {"max_new_tokens": 7}}, "tokens", workload="defaults"),
    # top_p, top_k, min_p under a greedy default temperature: only a request that asks for a temperature samples
    *[_case("v1", {"override_generation_config": {key: value}}, IGNORED, workload="defaults")
      for key, value in (("top_p", 0.9), ("top_k", 5), ("min_p", 0.1))],
    _case("v1", {"override_generation_config": {"do_sample": False, "top_p": 0.9}}, IGNORED, workload="defaults"),
    _case("v1", {"override_generation_config": {"temperature": 0.5, "top_p": 0.9}}, "defaults", workload="defaults"),
    _case("v1", {"override_generation_config": {"temperature": 0.5, "top_k": 5}}, "defaults", workload="defaults"),
    _case("v1", {"override_generation_config": {"temperature": 0.5, "min_p": 0.1}}, "defaults", workload="defaults"),
]


@pytest.mark.parametrize(("manager", "settings", "how", "workload", "family"), CASES)
def test_a_load_time_setting_acts_or_is_said_to_be_ignored(checkpoints, manager, settings, how, workload, family):
    before = baseline(checkpoints, family, manager, workload)
    after = observe(checkpoints[family], manager, dict(settings), workload)
    fields = {f"kv_cache_config.{k}" for k in settings.get("kv_cache_config", {})}
    fields |= {f"override_generation_config.{k}" for k in settings.get("override_generation_config", {})}
    fields |= {k for k in settings if k not in ("kv_cache_config", "override_generation_config")}
    if how == IGNORED:
        named = fields & set(after["ignored"])
        assert named, f"{settings} on {manager}: no setting_ignored names it ({after['ignored']})"
        assert all(after["ignored"][f] for f in named)  # with its reason
        return
    assert after[how] != before[how], f"{settings} on {manager}: {how} is {after[how]!r} either way"
    assert not fields & set(after["ignored"]), after["ignored"]  # it acted: not said to be ignored too


def test_priority_on_v2_runs_the_best_ranked_request_first(checkpoints):
    """The workload scheduling_policy=priority exercises: one batch slot, the last prompt ranked best."""
    fcfs = observe(checkpoints["llama"], "v2", {"max_batch_size": 1}, "priority")
    ranked = observe(checkpoints["llama"], "v2", {"max_batch_size": 1, "scheduling_policy": "priority"}, "priority")
    assert fcfs["order"] == 0 and ranked["order"] == len(SHARED) - 1


#: Fields a load or generation acts on (PLAN_FIELDS' are held to the rule by tests/test_precedence_properties.py);
#: tensor_parallel_size > 1 starts ranks (tests/test_llm_tensor_parallel.py), generation_config reads a file
#: (tests/test_generation_config.py), kv_cache_config.tokens_per_block and the budget fields are plan fields.
LOAD_FIELDS = {
    "kv_cache_config.enable_block_reuse", "kv_cache_config.enable_partial_reuse",
    "kv_cache_config.max_util_for_resume", "kv_cache_config.enable_swa_scratch_reuse",
    "max_batch_size", "max_num_tokens", "scheduling_policy", "max_draft_len", "max_matching_ngram_size",
    "speculation_max_batch_size", "attention_backend", "linear_backend", "dtype", "weights_seed", "max_beam_width",
    *(f"override_generation_config.{a.name}" for a in public_fields(GenerationDefaults)),
}
ELSEWHERE = {"model", "kv_cache_config", "override_generation_config", "tensor_parallel_size", "generation_config"}


def test_the_cases_cover_every_load_time_field():
    every = {a.name for a in public_fields(LlmArgs)}
    every |= {f"kv_cache_config.{a.name}" for a in public_fields(KvCacheConfig)}
    every |= {f"override_generation_config.{a.name}" for a in public_fields(GenerationDefaults)}
    assert every - set(PLAN_FIELDS) - ELSEWHERE == LOAD_FIELDS
    covered = set()
    for param in CASES:
        _, settings, *_ = param.values
        covered |= {f"kv_cache_config.{k}" for k in settings.get("kv_cache_config", {})}
        covered |= {f"override_generation_config.{k}" for k in settings.get("override_generation_config", {})}
        covered |= {k for k in settings if k not in ("kv_cache_config", "override_generation_config")}
    assert covered >= LOAD_FIELDS


def test_max_util_for_resume_decides_when_a_suspended_request_comes_back(monkeypatch):
    """A ``kvload simulate`` run that suspends (``mixed-priority``: an urgent request every 8th arrival displaces a
    running one under ``scheduling_policy=priority``, its pages kept in a host tier the user sized) at two resume
    thresholds. At 0.95 every suspended request came back as soon as its pages fit, lifting the pool to 87-94% used;
    at 0.5 each waited until the pool had drained to where its pages leave it at most half used, so fewer requests ran
    beside it, fewer were suspended again, and the run took more steps. Without a host tier nothing is suspended, and
    the same setting is said to do nothing."""
    from cache_backends.v2.manager import KVCacheManagerV2
    from engine.simulator import simulate

    resumed: list[tuple[float, float]] = []  # (pool use before, after) of each resume of a suspended request
    real = KVCacheManagerV2.resume

    def resume(self, request):
        suspended, before = self.cache(request).admitted, self.usage()
        ok = real(self, request)
        if suspended and ok:
            resumed.append((before, self.usage()))
        return ok

    monkeypatch.setattr(KVCacheManagerV2, "resume", resume)

    def run(util: float, **kv: Any) -> tuple[Any, list[tuple[float, float]], dict[str, str]]:
        resumed.clear()
        events: list[dict[str, Any]] = []
        report = simulate("tiny-llama", "mixed-priority", requests=32, scheduling_policy="priority", max_seq_len=512,
                          params={"prompt_len": 128, "answer_len": 64}, device="cpu", log=False, progress=False,
                          subscribers=[events.append],
                          kv_cache_config={"use_kv_cache_manager_v2": True, "max_tokens": 1024,
                                           "max_util_for_resume": util, **kv})
        (result,) = report.results.values()
        ignored = {e["field"]: e["reason"] for e in events if e["event"] == "setting_ignored"}
        return result.metrics, list(resumed), ignored

    host = {"host_cache_size": 1 << 24}
    eager, eager_resumes, said = run(0.95, **host)
    strict, strict_resumes, said_strict = run(0.5, **host)
    assert "kv_cache_config.max_util_for_resume" not in {**said, **said_strict}
    for m in (eager, strict):
        assert m.finished == 32 and m.preemptions == 0 and m.resumes == m.suspends >= 3
    assert len(eager_resumes) == eager.resumes and len(strict_resumes) == strict.resumes
    # when: 0.95 resumes into a pool already over half used; 0.5 only once the pool is left at most half used
    assert all(after > 0.5 for _, after in eager_resumes)
    assert all(after <= 0.5 for _, after in strict_resumes)
    # so fewer requests run beside a resumed one: fewer suspended again, and more steps waiting for the pool to drain
    assert strict.suspends < eager.suspends and strict.steps > eager.steps and strict.waits > eager.waits
    # without a host tier (auto: recomputing costs less on the priced H200) there is nothing to resume, said
    off, off_resumes, said_off = run(0.5)
    assert off.suspends == off.resumes == 0 and off.preemptions > 0 and not off_resumes
    assert "nothing is suspended or resumed" in said_off["kv_cache_config.max_util_for_resume"]
