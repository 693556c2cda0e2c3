"""Regression tests for the code review of the KV managers, schedulers, budget, plan/build stages and driver.

Each test reproduces one finding (the reviewer's scripts) and fails without its fix. Scheduler-only
findings live next to their suites (``test_kv_v1_scheduler.py``, ``test_kv_v2_scheduler.py``,
``test_kv_budget.py``); these are the ones that cross the driver, the stages and the API.
"""

from __future__ import annotations

import pytest

from cache_backends import LayerKV, build_layout
from cache_backends.interface import ManagerOptions
from cache_backends.pools import BlockPools
from cache_backends.request import Request
from cache_backends.v1 import GuaranteedNoEvictScheduler, KVCacheManager
from cache_backends.v2 import KVCacheManagerV2, KVCacheV2Scheduler
from pipeline.driver import Driver

KINDS = [("v1", KVCacheManager, GuaranteedNoEvictScheduler), ("v2", KVCacheManagerV2, KVCacheV2Scheduler)]


def make_driver(kind: str, blocks: int = 16, max_seq_len: int = 8, events: list | None = None, **options) -> Driver:
    manager_cls, scheduler_cls = {k: (m, s) for k, m, s in KINDS}[kind]
    layout = build_layout([LayerKV(0, "full", 2)], kind, 4, "float32")
    m = manager_cls(BlockPools(layout, {layout.groups[0].name: blocks}, "cpu"),
                    ManagerOptions(max_seq_len=max_seq_len, **options))
    return Driver(m, scheduler_cls(m, 4, 64), emit=events.append if events is not None else None)


def run(driver: Driver) -> None:
    def compute(out):
        return {c.request.req_id: 7 for c in out.scheduled
                if c.request.num_computed_tokens + c.num_tokens == c.request.num_tokens}

    for _ in range(500):
        if not driver.has_work:
            return
        driver.step(compute)
    raise AssertionError("the driver did not finish")


# --- 1. max_seq_len while requests run ------------------------------------------------------------------


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


# --- 10. driver nits --------------------------------------------------------------------------------------


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
