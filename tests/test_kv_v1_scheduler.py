"""``GuaranteedNoEvictScheduler``: worst-case admission, FIFO waiting, token and batch limits, stalls."""

from __future__ import annotations

from collections import deque

import pytest

from cache_backends.interface import SchedulerOutput
from cache_backends.request import Request, RequestState
from cache_backends.v1 import GuaranteedNoEvictScheduler
from tests.kv_v1_support import drive, make_manager


def requests(n: int, prompt_len: int = 6, max_new: int = 6, shared: bool = False) -> list[Request]:
    out = []
    for i in range(n):
        prompt = list(range(prompt_len)) if shared else [100 * (i + 1) + j for j in range(prompt_len)]
        out.append(Request(f"r{i}", prompt, max_new))
    return out


def test_a_budget_for_fewer_sequences_than_waiting_makes_them_wait_in_order_and_all_finish():
    m = make_manager(num_blocks=10)  # worst case per request: 12 tokens = 3 blocks -> 3 at a time
    sched = GuaranteedNoEvictScheduler(m, max_batch_size=64, max_num_tokens=256)
    reqs = requests(8)

    def never_short():
        assert m.pool.num_used <= m.num_blocks
        m.pool.check_invariants()

    trace = drive(sched, m, reqs, check=never_short)
    assert trace.stalled is None
    assert trace.admitted == [r.req_id for r in reqs]  # arrival order, nobody skipped ahead
    assert sorted(trace.finished) == sorted(r.req_id for r in reqs)
    assert trace.max_running == 3
    assert all(not out.preempted for out in trace.outputs)
    assert all(r.state is RequestState.FINISHED and len(r.output_token_ids) == 6 for r in reqs)
    assert m.pool.num_used == 0


def test_the_head_of_the_queue_is_never_skipped_for_a_smaller_request():
    m = make_manager(num_blocks=6)
    sched = GuaranteedNoEvictScheduler(m, 64, 256)
    waiting = deque([Request("big", list(range(8)), 8), Request("huge", list(range(50, 70)), 0),
                     Request("tiny", [1], 1)])
    running: list[Request] = []
    out = sched.step(waiting, running)
    assert [r.req_id for r in out.admitted] == ["big"]  # huge (5 blocks) does not fit beside big's 4
    assert [r.req_id for r in waiting] == ["huge", "tiny"]  # tiny would fit, but waits its turn
    assert out.stalled is None


def test_chunked_prefill_respects_max_num_tokens_and_running_requests_go_first():
    m = make_manager(num_blocks=32)
    sched = GuaranteedNoEvictScheduler(m, max_batch_size=8, max_num_tokens=8)
    a = Request("a", list(range(20)), 2)
    waiting, running = deque([a]), []
    sizes = []
    for _ in range(3):
        out = sched.step(waiting, running)
        sizes.append([(c.request.req_id, c.num_tokens) for c in out.scheduled])
        for c in out.scheduled:
            m.commit(c.request, c.num_tokens)
        if not waiting and len(running) == 1 and a.num_computed_tokens == 20 and not a.output_token_ids:
            a.output_token_ids.append(7)
            waiting.append(Request("b", list(range(40, 52)), 1))
    assert sizes[:3] == [[("a", 8)], [("a", 8)], [("a", 4)]]
    out = sched.step(waiting, running)
    assert [(c.request.req_id, c.num_tokens) for c in out.scheduled] == [("a", 1), ("b", 7)]
    assert out.num_tokens == 8


def test_max_batch_size_caps_running_requests():
    m = make_manager(num_blocks=64)
    sched = GuaranteedNoEvictScheduler(m, max_batch_size=2, max_num_tokens=1000)
    trace = drive(sched, m, requests(5))
    assert trace.max_running == 2 and len(trace.finished) == 5


def test_shared_prefixes_let_more_requests_run_at_once():
    # Worst case 12 tokens = 3 blocks each; the first block (4 of 6 prompt tokens) is shared once cached.
    alone = drive(GuaranteedNoEvictScheduler(m1 := make_manager(7), 64, 6), m1, requests(4, shared=False))
    shared = drive(GuaranteedNoEvictScheduler(m2 := make_manager(7), 64, 6), m2, requests(4, shared=True))
    assert alone.max_running == 2
    assert shared.max_running == 3
    assert m2.stats().reuse_hit_tokens > 0 and len(shared.finished) == 4


def test_a_request_that_can_never_fit_stalls_with_the_reason_instead_of_hanging():
    m = make_manager(num_blocks=4)
    sched = GuaranteedNoEvictScheduler(m, 64, 256)
    trace = drive(sched, m, [Request("ok", [1, 2], 2), Request("long", list(range(30)), 10)])
    assert trace.finished == ["ok"]
    assert trace.stalled == ("request long needs 10 blocks for 40 tokens (prompt + max_new_tokens) but the pool "
                             "holds 4 blocks of 4 tokens; it can never be admitted")
    assert trace.steps < 20


def test_step_with_nothing_to_do_is_not_a_stall_and_bad_limits_are_refused():
    m = make_manager()
    sched = GuaranteedNoEvictScheduler(m, 1, 1)
    out = sched.step(deque(), [])
    assert isinstance(out, SchedulerOutput) and out.scheduled == [] and out.stalled is None
    with pytest.raises(ValueError, match="max_batch_size must be >= 1, got 0"):
        GuaranteedNoEvictScheduler(m, 0, 8)
    with pytest.raises(ValueError, match="max_num_tokens must be >= 1, got 0"):
        GuaranteedNoEvictScheduler(m, 8, 0)


def test_finish_frees_blocks_and_marks_the_request():
    m = make_manager(num_blocks=8)
    sched = GuaranteedNoEvictScheduler(m, 4, 64)
    r = Request("a", list(range(5)), 1)
    waiting, running = deque([r]), []
    out = sched.step(waiting, running)
    m.commit(r, out.scheduled[0].num_tokens)
    sched.finish(r, "stop")
    running.remove(r)
    assert (r.state, r.finish_reason) == (RequestState.FINISHED, "stop")
    assert m.pool.num_used == 0 and m.block_table(r, "uniform") == []


# --- review fixes: never-fitting requests and max_seq_len ------------------------------------------------


def test_a_never_fitting_request_is_skipped_so_the_ones_behind_it_run_then_it_is_reported():
    m = make_manager(num_blocks=4)  # 16 tokens
    sched = GuaranteedNoEvictScheduler(m, 4, 64)
    big, small = Request("big", [1, 2, 3, 4], 16), Request("small", [5, 6], 2)  # big: 20 tokens = 5 blocks
    out = sched.step(deque([big, small]), running := [])
    assert [r.req_id for r in out.admitted] == ["small"] and out.stalled is None and running == [small]
    trace = drive(sched, m, [big, Request("later", [7, 8], 2)])
    assert trace.finished == ["later"]  # FCFS among the others; big never blocks them
    assert trace.stalled == ("request big needs 5 blocks for 20 tokens (prompt + max_new_tokens) but the pool "
                             "holds 4 blocks of 4 tokens; it can never be admitted")
    assert big.state is RequestState.WAITING and not m.knows(big)


def test_a_prompt_longer_than_max_seq_len_is_refused_at_admission():
    m = make_manager(num_blocks=16, max_seq_len=8)
    sched = GuaranteedNoEvictScheduler(m, 4, 64)
    long, short = Request("long", list(range(1, 31)), 10), Request("short", [1, 2], 2)
    # the engine refuses it before it is queued ...
    with pytest.raises(ValueError, match="prompt of 30 tokens leaves no room to generate within max_seq_len=8"):
        drive(sched, m, [long, short])
    # ... and the scheduler, driven directly, refuses to admit it and says why
    waiting = deque([long, short])
    out = sched.step(waiting, running := [])
    assert [r.req_id for r in out.admitted] == ["short"] and list(waiting) == [long]
    out = sched.step(waiting, running)
    assert out.stalled is None or "longer than max_seq_len=8" in out.stalled
    assert long.num_computed_tokens == 0


def test_the_worst_case_is_capped_at_max_seq_len():
    m = make_manager(num_blocks=4, max_seq_len=8)  # 8 tokens = 2 blocks per request at most
    sched = GuaranteedNoEvictScheduler(m, 4, 64)
    a, b = Request("a", [1, 2, 3, 4], 100), Request("b", [5, 6, 7, 8], 100)
    assert m.max_blocks(a) == 2 and m.never_fits(a) is None
    out = sched.step(deque([a, b]), running := [])
    assert [r.req_id for r in out.admitted] == ["a", "b"] and len(running) == 2


def test_a_running_request_is_never_scheduled_past_max_seq_len():
    m = make_manager(num_blocks=8, max_seq_len=8)
    sched = GuaranteedNoEvictScheduler(m, 4, 64)
    r = Request("r", [1, 2, 3, 4, 5, 6], 10)  # max_new_tokens would take it past max_seq_len
    trace = drive(sched, m, [r])
    # the engine ends it at max_seq_len ("length"); the last sampled token is never fed, so 7 are computed
    assert trace.stalled is None and trace.finished == ["r"] and r.finish_reason == "length"
    assert r.num_tokens == 8 and r.num_computed_tokens == 7 and m.stats().groups["uniform"].used == 0
    # and the scheduler itself never schedules past max_seq_len, whoever drives it
    r2 = Request("r2", [1, 2, 3, 4, 5, 6, 7], 10)
    waiting, running = deque([r2]), []
    for _ in range(3):  # a driver that ignores max_seq_len and keeps sampling
        out = sched.step(waiting, running)
        if not out.scheduled:
            break
        m.commit(r2, out.scheduled[0].num_tokens)
        r2.output_token_ids.append(9)
    assert r2.num_computed_tokens == 8 and out.scheduled == []
    assert out.stalled == "request r2 reached max_seq_len=8; finish it (reason 'length')"
