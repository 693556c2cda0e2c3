"""``scheduling_policy``: vLLM's ``fcfs`` | ``priority``, from the config to the schedulers, the Python API, the server.

Under "priority" a request's rank is kvload's (higher ``Request.priority`` first, then arrival); the user-facing
``priority`` (``LLM.generate(priority=[...])``, the server's field) is vLLM's, lower first, negated on the way in.
Orders are read from what the engine decided (admitted and finished order, the audit's ``request_admitted``), never
from timing.
"""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvload
import pipeline
from cache_backends.request import Request
from cache_backends.v1 import GuaranteedNoEvictScheduler
from cache_backends.v2 import KVCacheV2Scheduler
from engine.driver import Arrival
from engine.sampling_params import SamplingParams
from pipeline.errors import ConfigError, GenerationError
from tests import kv_v1_support, kv_v2_support
from tests.cli_support import run_cli
from tests.llm_support import llm_kwargs
from tests.serve_support import TIMEOUT, serving, wait_for

# --- the schedulers ----------------------------------------------------------------------------------------------


def _scheduler(kind: str, policy: str, blocks: int, max_batch_size: int, **options):
    if kind == "v1":
        m = kv_v1_support.make_manager(num_blocks=blocks)
        return m, GuaranteedNoEvictScheduler(m, max_batch_size, 64, scheduling_policy=policy)
    m = kv_v2_support.make_manager(kv_v2_support.FULL, blocks, **options)
    return m, KVCacheV2Scheduler(m, max_batch_size, 64, scheduling_policy=policy)


def _drive(kind: str, m, s, arrivals) -> tuple[list[str], list[str], list]:
    """(admitted ids, finished ids, scheduler outputs) of a run to completion."""
    if kind == "v1":
        trace = kv_v1_support.drive(s, m, arrivals)
        assert trace.stalled is None
        return trace.admitted, trace.finished, trace.outputs
    res = kv_v2_support.drive(m, s, arrivals)  # checks every running request's KV after every step
    assert res.stalled is None
    return ([r.req_id for o in res.outputs for r in o.admitted], [r.req_id for r in res.finished], res.outputs)


def _prompt(i: int, n: int = 8) -> list[int]:
    return [i * 40 + j for j in range(n)]


@pytest.mark.parametrize("kind", ["v1", "v2"])
@pytest.mark.parametrize(("policy", "order"), [("priority", ["a", "hi", "lo1", "lo2"]),
                                                ("fcfs", ["a", "lo1", "lo2", "hi"])])
def test_priority_admits_a_later_better_ranked_arrival_before_earlier_ones(kind, policy, order):
    """One request runs at a time; ``hi`` (kvload's priority 1) arrives at step 1, behind ``lo1`` and ``lo2``."""
    m, s = _scheduler(kind, policy, blocks=16, max_batch_size=1)
    reqs = {name: Request(name, _prompt(i), 4, priority=1 if name == "hi" else 0)
            for i, name in enumerate(["a", "lo1", "lo2", "hi"])}
    arrivals = [Arrival(r, step=1 if name == "hi" else 0) for name, r in reqs.items()]
    admitted, finished, _ = _drive(kind, m, s, arrivals)
    assert admitted == order and finished == order
    assert all(len(r.output_token_ids) == 4 for r in reqs.values())


@pytest.mark.parametrize("host", [None, 0], ids=["suspended", "preempted"])
@pytest.mark.parametrize(("policy", "hi_priority", "displaced"), [("priority", 1, True), ("priority", 0, False),
                                                                  ("fcfs", 1, False)])
def test_v2_a_better_ranked_arrival_moves_out_a_running_request_and_both_complete(host, policy, hi_priority,
                                                                                    displaced):
    """8 blocks of 4 tokens. ``lo`` grows to 28 tokens (7 blocks); at step 10 it holds 5 and ``hi`` arrives with a
    16-token prompt (4 blocks), which does not fit beside it. Under "priority" ``hi`` takes the room: ``lo`` is
    suspended to the host tier (or, with none, preempted for recompute) and resumes after ``hi`` finished. An equal
    priority displaces nobody (ties go by arrival), and neither does "fcfs"."""
    m, s = _scheduler("v2", policy, blocks=8, max_batch_size=8, host_cache_size=host)
    lo = Request("lo", _prompt(0), 20)
    hi = Request("hi", _prompt(1, 16), 4, priority=hi_priority)
    _, finished, outputs = _drive("v2", m, s, [Arrival(lo, 0), Arrival(hi, 10)])
    moved = [r.req_id for o in outputs for r in o.suspended + o.preempted]
    assert finished == (["hi", "lo"] if displaced else ["lo", "hi"])
    assert moved == (["lo"] if displaced else [])
    if displaced:
        assert [r.req_id for o in outputs for r in (o.suspended if host is None else o.preempted)] == ["lo"]
    assert len(lo.output_token_ids) == 20 and len(hi.output_token_ids) == 4  # every request completes


def _recording_displacements(s: KVCacheV2Scheduler) -> list[list[Request]]:
    """Per step, the requests the scheduler moved out to admit another (not those moved out under growth pressure)."""
    per_step: list[list[Request]] = []
    admit, move_out, step = s._admit, s._move_out, s.step
    admitting = []

    def admit_spy(*args, **kwargs):
        admitting.append(True)
        try:
            return admit(*args, **kwargs)
        finally:
            admitting.pop()

    def move_spy(victim, *args, **kwargs):
        if admitting:
            per_step[-1].append(victim)
        return move_out(victim, *args, **kwargs)

    def step_spy(*args, **kwargs):
        per_step.append([])
        return step(*args, **kwargs)

    s._admit, s._move_out, s.step = admit_spy, move_spy, step_spy
    return per_step


@pytest.mark.parametrize("host", [None, 0], ids=["suspended", "preempted"])
def test_v2_moves_nobody_out_for_an_arrival_that_would_not_fit_even_then(host):
    """8 blocks of 4 tokens. ``top`` (kvload priority 3) grows to 24 tokens (6 blocks), ``lo`` (0) to 8 (2 blocks);
    at step 2 ``hi`` (2) arrives needing 3 blocks for its prompt and one more to finish, while ``top`` still needs
    its sixth. Moving ``lo`` out would free 2 blocks: enough for the prompt, not for what ``top`` and ``hi`` still
    need together; so ``lo`` keeps running and finishes, and ``hi`` waits for room instead of leaving ``lo``'s
    blocks idle."""
    m, s = _scheduler("v2", "priority", blocks=8, max_batch_size=8, host_cache_size=host)
    displaced = _recording_displacements(s)
    top = Request("top", _prompt(0, 16), 8, priority=3)
    lo = Request("lo", _prompt(1, 4), 4)
    hi = Request("hi", _prompt(2, 12), 4, priority=2)
    _, finished, outputs = _drive("v2", m, s, [Arrival(top, 0), Arrival(lo, 0), Arrival(hi, 2)])
    assert [r.req_id for o in outputs for r in o.suspended + o.preempted] == []
    assert [v for step in displaced for v in step] == []
    assert finished.index("lo") < finished.index("hi")
    assert [len(r.output_token_ids) for r in (top, lo, hi)] == [8, 4, 4]


@pytest.mark.parametrize("host", [None, 0], ids=["suspended", "preempted"])
def test_v2_moves_nobody_out_when_a_finish_makes_room_next_step(host):
    """8 blocks of 4 tokens. ``lo`` (8 + 8 tokens) and ``end`` (4 + 2) run; at step 1 ``hi`` (kvload priority 1, 8 + 4)
    arrives and does not fit beside them. ``end`` decodes its last token in that step, and its blocks are then room
    enough: ``hi`` waits that one step rather than move ``end`` (the worst-ranked, the latest arrival) to the host
    tier and back, or recompute it, for a request finishing anyway."""
    m, s = _scheduler("v2", "priority", blocks=8, max_batch_size=8, host_cache_size=host)
    displaced = _recording_displacements(s)
    lo = Request("lo", _prompt(0), 8)
    end = Request("end", _prompt(1, 4), 2)
    hi = Request("hi", _prompt(2, 8), 4, priority=1)
    _, finished, outputs = _drive("v2", m, s, [Arrival(lo, 0), Arrival(end, 0), Arrival(hi, 1)])
    assert [r.req_id for o in outputs for r in o.suspended + o.preempted] == []
    assert [v for step in displaced for v in step] == []
    assert [[r.req_id for r in o.admitted] for o in outputs[:3]] == [["lo", "end"], [], ["hi"]]
    assert finished.index("end") < finished.index("hi")
    assert [len(r.output_token_ids) for r in (lo, end, hi)] == [8, 2, 4]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 24), st.integers(1, 12), st.integers(-2, 2), st.integers(0, 12)),
                min_size=2, max_size=10),
       st.sampled_from([None, 0]), st.sampled_from([0.0, 0.5, 1.0]), st.integers(8, 24),
       st.sampled_from(["full", "shared arena", "pool per group"]))
def test_v2_every_displacement_admits_the_request_it_was_for(specs, host, ratio, blocks, layout):
    """Under "priority", in any workload and layout (one pool, a shared arena with sliding groups, a pool per
    group): a step that moves requests out to admit another admits it, and each request moved out ranks below it;
    and every request completes."""
    layers = {"full": kv_v2_support.FULL, "shared arena": kv_v2_support.full_sliding_layers(),
              "pool per group": kv_v2_support.split_sliding_layers()}[layout]
    m = kv_v2_support.make_manager(layers, blocks, host_cache_size=host)
    s = KVCacheV2Scheduler(m, 4, 16, scheduling_policy="priority", init_ratio=ratio)
    displaced = _recording_displacements(s)
    fit = [(i, spec) for i, spec in enumerate(specs) if spec[0] + spec[1] <= blocks * 4]  # each fits alone
    reqs = [Request(f"r{i}", _prompt(i, p), n, priority=prio) for i, (p, n, prio, _) in fit]
    arrivals = [Arrival(r, step) for r, (_, (_, _, _, step)) in zip(reqs, fit, strict=True)]
    res = kv_v2_support.drive(m, s, arrivals)
    assert res.stalled is None
    for victims, out in zip(displaced, res.outputs, strict=True):
        if victims:
            assert out.admitted, f"moved out {[v.req_id for v in victims]} and admitted nobody"
            best = min(r.rank for r in out.admitted)
            assert all(v.rank > best for v in victims)
    assert all(len(r.output_token_ids) == r.max_new_tokens for r in reqs)


def test_scheduler_refuses_an_unknown_policy():
    m = kv_v1_support.make_manager()
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, got 'lifo'"):
        GuaranteedNoEvictScheduler(m, 1, 8, scheduling_policy="lifo")


# --- the config, the route, the CLI --------------------------------------------------------------------------------


def test_an_invalid_policy_is_one_line_naming_the_field_and_the_accepted_values(capsys):
    with pytest.raises(ConfigError, match=r'^scheduling_policy: expected "fcfs" or "priority", got \'lifo\'$'):
        pipeline.plan("tiny-llama", scheduling_policy="lifo", log=False)
    r = run_cli(capsys, "plan", "tiny-llama", "--scheduling-policy", "lifo")
    assert r.code == 2 and r.one_error_line
    assert 'scheduling-policy: expected "fcfs" or "priority"' in r.err


@pytest.mark.parametrize("v2", [False, True])
def test_v1_says_priority_acts_only_on_admission(v2):
    result = pipeline.plan("tiny-llama", scheduling_policy="priority", log=False,
                           kv_cache_config={"use_kv_cache_manager_v2": v2})
    assert result.args.scheduling_policy == "priority"
    ignored = [e for e in result.audit.events if e["event"] == "setting_ignored" and e["field"] == "scheduling_policy"]
    if v2:
        assert ignored == []
    else:
        (e,) = ignored
        assert e["value"] == "priority" and "never preempts" in e["reason"] and "admission only" in e["reason"]


# --- the Python API ------------------------------------------------------------------------------------------------

PROMPTS = [[5, 17, 30], [42, 7, 9, 88], [123, 7, 64, 256, 11]]


def _admitted(llm, since: int) -> list[str]:
    return [e["req_id"] for e in llm.audit.events[since:] if e["event"] == "request_admitted"]


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_generate_priority_orders_admission_lowest_vllm_value_first(manager):
    with kvload.LLM("tiny-llama", scheduling_policy="priority", max_batch_size=1, **llm_kwargs(manager)) as llm:
        before = len(llm.audit.events)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=3, ignore_eos=True), priority=[5, -1, 2])
        assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3, 3]  # outputs stay in prompt order
        assert _admitted(llm, before) == ["0.1", "0.2", "0.0"]  # vLLM's sign: -1 first, then 2, then 5
        with pytest.raises(GenerationError, match=r"priority: expected a list of 3 integers \(one per prompt\)"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=1), priority=[1, 2])
        # a 1-D integer array, as prompts take (it was refused whole: "got array([5, -1, 2])")
        before = len(llm.audit.events)
        llm.generate(PROMPTS, SamplingParams(max_tokens=1, ignore_eos=True), priority=np.array([5, -1, 2]))
        assert _admitted(llm, before) == ["1.1", "1.2", "1.0"]  # the refused call never started
        with pytest.raises(GenerationError, match=r"^generate: priority: expected a list of 3 integers \(one per "
                                                  r"prompt\), got array\(\[0\.5, 1\. , 2\. \]\)$"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=1), priority=np.array([0.5, 1.0, 2.0]))


def test_generate_under_fcfs_refuses_a_nonzero_priority_as_vllm_does():
    with kvload.LLM("tiny-llama", max_batch_size=1, **llm_kwargs("v2")) as llm:
        with pytest.raises(GenerationError, match=r"^generate: priority\[1\]: got priority 3 but priority scheduling "
                                                  r"is not enabled \(scheduling_policy is \"fcfs\"\)"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=2), priority=[0, 3, 0])
        before = len(llm.audit.events)
        llm.generate(PROMPTS, SamplingParams(max_tokens=2, ignore_eos=True), priority=[0, 0, 0])
        assert _admitted(llm, before) == ["0.0", "0.1", "0.2"]  # arrival order (the refused call never started)


# --- the server ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served_by_priority():
    with serving("tiny-llama", scheduling_policy="priority", max_batch_size=1, max_seq_len=64,
                 kv_cache_config={"max_tokens": 512, "tokens_per_block": 4}) as s:
        yield s


def _complete(served, prompt, priority, max_tokens=2):
    return served.client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=max_tokens,
                                            extra_body={"ignore_eos": True, "priority": priority})


def test_server_schedules_waiting_requests_by_priority(served_by_priority):
    """A blocker holds the one batch slot (its first step waits on a gate); three requests queue behind it, then the
    gate opens: they are admitted lowest vLLM priority first, whatever order they reached the engine in."""
    served = served_by_priority
    engine = served.state.engine
    gate = threading.Event()
    original = engine._compute

    def gated(out):
        gate.wait(TIMEOUT)
        return original(out)

    before = len(served.result.audit.events)
    engine._compute = gated
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            blocker = pool.submit(_complete, served, [9] * 6, 0, 4)
            wait_for(lambda: bool(engine.driver.running), what="the blocker runs")
            queued = [pool.submit(_complete, served, prompt, p) for prompt, p in zip(PROMPTS, [5, -1, 2], strict=True)]
            wait_for(lambda: len(engine._inbox) == 3, what="three requests queued")
            gate.set()
            results = [f.result(timeout=TIMEOUT) for f in [blocker, *queued]]
    finally:
        gate.set()
        del engine._compute  # the class's method again
    assert [r.usage.completion_tokens for r in results] == [4, 2, 2, 2]
    admitted = [e["prompt_tokens"] for e in served.result.audit.events[before:] if e["event"] == "request_admitted"]
    assert admitted == [6, 4, 5, 3]  # the blocker, then priority -1, 2, 5


def test_server_bounds_priority_under_the_priority_policy(served_by_priority):
    with pytest.raises(openai.BadRequestError) as err:
        _complete(served_by_priority, PROMPTS[0], 2**70)
    assert err.value.body["param"] == "priority" and "at most 2**63 - 1" in err.value.body["message"]
