"""``engine.driver.Driver``: the one driving loop of the executor, the simulator and the test support."""

from __future__ import annotations

import pytest

from cache_backends import LayerKV, build_layout
from cache_backends.interface import ManagerOptions, SchedulerOutput
from cache_backends.pools import BlockPools
from cache_backends.request import Request
from cache_backends.v1 import GuaranteedNoEvictScheduler, KVCacheManager
from cache_backends.v2 import KVCacheManagerV2, KVCacheV2Scheduler
from engine.driver import Arrival, Driver, StalledError
from tests.kv_v1_support import make_manager


def driver(num_blocks: int = 16, max_seq_len: int = 1024, *, eos: frozenset[int] = frozenset(),
           events: list | None = None, batch: int = 8) -> Driver:
    m = make_manager(num_blocks, max_seq_len=max_seq_len)
    return Driver(m, GuaranteedNoEvictScheduler(m, batch, 64), eos_token_ids=eos,
                  emit=events.append if events is not None else None)


def answer(token: int = 5):
    """A scripted compute: every request reaching its last known token samples ``token``."""
    def compute(out: SchedulerOutput) -> dict[str, int]:
        return {c.request.req_id: token for c in out.scheduled
                if c.request.num_computed_tokens + c.num_tokens == c.request.num_tokens}
    return compute


def test_requests_run_to_max_new_tokens_and_give_their_blocks_back():
    d = driver()
    reqs = [Request("a", [1, 2, 3], 4), Request("b", [4, 5], 2)]
    stats = d.run(reqs, answer())
    assert {r.req_id: r.output_token_ids for r in reqs} == {"a": [5] * 4, "b": [5] * 2}
    assert all(r.finish_reason == "length" for r in reqs)
    assert [r.req_id for r in stats.finished] == ["b", "a"] and stats.engine_steps == stats.steps == 4
    assert d.manager.stats()["groups"]["uniform"]["used"] == 0 and not d.has_work


def test_eos_and_max_seq_len_end_a_request_early():
    d = driver(eos=frozenset({7}), max_seq_len=6)
    eos, long = Request("eos", [1, 2], 10), Request("long", [3, 4, 5], 10)
    d.run([eos], answer(7))
    d.run([long], answer(5))
    assert (eos.finish_reason, eos.output_token_ids) == ("stop", [7])
    assert (long.finish_reason, long.num_tokens) == ("length", 6)  # stopped at max_seq_len, not max_new_tokens


def test_arrivals_join_at_their_step_and_the_clock_jumps_over_idle_stretches():
    d = driver()
    seen: list[tuple[str, int]] = []
    stats = d.run([Arrival(Request("late", [1], 1), step=10), Arrival(Request("early", [2], 2), step=0)],
                  answer(), on_arrival=lambda r, clock: seen.append((r.req_id, clock)))
    assert seen == [("early", 0), ("late", 10)]
    assert stats.engine_steps == 3 and stats.steps == 11  # idle steps 2-9 are skipped, not run


def test_a_request_after_another_arrives_the_step_after_it_finished():
    d = driver()
    seen: list[tuple[str, int]] = []
    first = Request("first", [1, 2], 3)
    stats = d.run([Arrival(Request("then", [3], 1), after="first"), Arrival(first)], answer(),
                  on_arrival=lambda r, clock: seen.append((r.req_id, clock)))
    assert seen == [("first", 0), ("then", 3)] and [r.req_id for r in stats.finished] == ["first", "then"]


def test_on_step_sees_every_engine_step_with_the_schedulers_decision():
    d = driver()
    steps: list[tuple[int, int]] = []
    d.run([Request("a", [1, 2, 3], 2)], answer(), on_step=lambda clock, st: steps.append((clock, st.scheduled_tokens)))
    assert steps == [(0, 3), (1, 1)]


def test_a_scheduler_stall_is_raised_with_its_reason_instead_of_looping():
    d = driver(num_blocks=2)
    with pytest.raises(StalledError, match="request big needs .* it can never be admitted"):
        d.run([Request("big", list(range(20)), 4)], answer())


def test_a_scheduler_that_schedules_nothing_forever_is_stopped():
    class Idle:
        def step(self, waiting, running):
            return SchedulerOutput()

    d = Driver(make_manager(), Idle())
    with pytest.raises(StalledError, match="5 steps in a row scheduled nothing while 0 running and 1 waiting"):
        d.run([Request("a", [1], 1)], answer(), max_idle_steps=4)


def test_a_dependency_that_never_arrives_is_reported():
    with pytest.raises(StalledError, match="requests wait for ghost"):
        driver().run([Arrival(Request("a", [1], 1), after="ghost")], answer())


def test_requests_that_cannot_generate_are_refused_when_added():
    d = driver(max_seq_len=4)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        d.run([Request("zero", [1], 0)], answer())
    with pytest.raises(ValueError, match="leaves no room to generate within max_seq_len=4"):
        d.run([Request("long", [1, 2, 3, 4], 1)], answer())


def test_the_driver_reports_admissions_and_finishes_as_events():
    events: list = []
    driver(events=events).run([Request("a", [1, 2], 1)], answer())
    assert [type(e).__name__ for e in events] == ["RequestAdmitted", "RequestFinished"]
    assert events[1].reason == "length" and events[1].output_tokens == 1


KINDS = [("v1", KVCacheManager, GuaranteedNoEvictScheduler), ("v2", KVCacheManagerV2, KVCacheV2Scheduler)]


def make_driver(kind: str, blocks: int = 16, max_seq_len: int = 8, events: list | None = None, **options) -> Driver:
    manager_cls, scheduler_cls = {k: (m, s) for k, m, s in KINDS}[kind]
    layout = build_layout([LayerKV(0, "full", 2)], kind, 4, "float32")
    m = manager_cls(BlockPools(layout, {layout.groups[0].name: blocks}, "cpu"),
                    ManagerOptions(max_seq_len=max_seq_len, **options))
    greedy = {"init_ratio": 0.0} if kind == "v2" else {}  # V2 admits without headroom: pressure must happen
    return Driver(m, scheduler_cls(m, 4, 64, **greedy), emit=events.append if events is not None else None)


def run(driver: Driver) -> None:
    driver.run([], answer(7), max_steps=500)


# --- both managers: max_seq_len while requests run, refusals, preemption reports ---


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_the_driver_ends_generation_at_max_seq_len(kind):
    d = make_driver(kind, max_seq_len=8)
    long, short = Request("long", [1, 2, 3, 4, 5, 6], 10), Request("short", [9, 9], 3)
    d.add(long)
    d.add(short)
    run(d)  # V2 used to raise StalledError ("reached max_seq_len"); V1 ran 'long' to 16 tokens
    assert {r.req_id for r in d.finished} == {"long", "short"}
    assert (long.num_tokens, long.finish_reason, len(long.output_token_ids)) == (8, "length", 2)
    assert (short.finish_reason, len(short.output_token_ids)) == ("length", 3)
    assert d.manager.stats()["usage"] == 0


@pytest.mark.parametrize("kind", ["v1", "v2"])
@pytest.mark.parametrize("prompt_len", [8, 30])
def test_a_prompt_that_leaves_no_room_under_max_seq_len_is_refused_by_the_driver(kind, prompt_len):
    d = make_driver(kind, max_seq_len=8)
    with pytest.raises(ValueError, match=rf"^request p: its prompt of {prompt_len} tokens leaves no room to generate "
                                         r"within max_seq_len=8$"):
        d.add(Request("p", list(range(1, prompt_len + 1)), 4))
    assert not d.has_work


# --- --------------------------------------------------------------------------------------


def test_max_new_tokens_zero_is_refused_instead_of_generating_one_token():
    d = make_driver("v1")
    with pytest.raises(ValueError, match=r"^request z: max_new_tokens must be >= 1, got 0$"):
        d.add(Request("z", [1, 2], 0))


def test_preemption_is_reported_and_a_readmission_says_so():
    events: list = []
    d = make_driver("v2", blocks=4, max_seq_len=64, events=events, host_cache_size=0, enable_block_reuse=False)
    for i in range(2):
        d.add(Request(f"r{i}", [i + 1] * 4, 8))  # 12 tokens = 3 blocks each; 4 blocks hold both prompts only
    run(d)
    assert len(d.finished) == 2
    names = [e.name for e in events]
    preempted = [e for e in events if e.name == "request_preempted"]
    assert preempted and names.count("request_admitted") == 2 + len(preempted)
    for r in d.finished:
        admissions = [e.readmitted for e in events if e.name == "request_admitted" and e.req_id == r.req_id]
        times = sum(1 for p in preempted if p.req_id == r.req_id)
        assert admissions == [False] + [True] * times
    assert all(p.tokens > 4 for p in preempted)  # it had generated tokens, all to recompute
    assert d.manager.stats()["preemptions"] == len(preempted)
