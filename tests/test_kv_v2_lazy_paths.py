"""Lazy keying (``cache_backends.v2.radix``) on paths ``test_kv_v2_lazy`` does not drive: layouts whose every group
slides (Mistral), windows no longer than a block, allocations that evict many blocks in one batch, cancelled
admissions, preempted requests admitted again, KV cache events switched on mid-run, resets and priorities changed
mid-run. Lazy must stay indistinguishable from keying every block at once, keep its bookkeeping
(``check_invariants``) and leave no pending prefix behind that holds no block."""

from __future__ import annotations

import random

import pytest

from cache_backends import LayerKV
from cache_backends.interface import PrefixCacheInUseError
from cache_backends.kv_events import KvEventBuffer
from cache_backends.request import Request
from tests.kv_v2_support import make_manager
from tests.test_kv_v2_lazy import _observe

T = 4
MAX_SEQ = 40


def _pending(m) -> list:
    return [p for by_first in m._tree.pending.values() for p in by_first.values()]


def _run(m, r: Request, n: int) -> None:
    assert m.allocate(r, n)
    m.commit(r, n)


@pytest.mark.parametrize("scratch", [False, True])
def test_a_released_request_whose_full_blocks_all_left_its_window_leaves_no_pending_prefix(scratch):
    # Every group slides with a window of at most a block: at 10 tokens both full blocks are out of the window.
    # Kept (scratch reuse) they are evicted by another request's allocation; else they went straight to the free list.
    m = make_manager([LayerKV(0, "sliding", 4, window=3)], 10, T=T, max_seq_len=MAX_SEQ,
                     enable_swa_scratch_reuse=scratch)
    assert m._lazy
    r = Request("r", list(range(1, 11)), 0)
    m.create(r)
    m.resume(r)
    _run(m, r, 10)
    assert m.cache(r).tables[m.groups[0].name][:2] == [-1, -1]
    if scratch:  # the two parked blocks are evicted while r runs
        q = Request("q", [99] * 38, 0)
        m.create(q)
        m.resume(q)
        _run(m, q, 36)
        assert m.stats().evictions == 2
    m.free(r)
    # nothing of r is cached: a pending prefix would only pin r (its token lists) until a prompt starting with 1 came
    assert all(p.request is not r for p in _pending(m))
    m.check_invariants()


def test_an_eviction_batch_that_interleaves_two_pending_prefixes_drops_each_once():
    # Two requests' windows let go of blocks in turns, so the eviction queue holds a0 b0 a1 (parked) then a's last
    # blocks; one allocation evicting all of them empties a's pending prefix with b's block in between.
    m = make_manager([LayerKV(0, "sliding", 4, window=6)], 10, T=T, max_seq_len=MAX_SEQ)
    a, b = Request("a", [1] * 16, 0), Request("b", [2] * 12, 0)
    for r in (a, b):
        m.create(r)
        m.resume(r)
    _run(m, a, 12)
    _run(m, b, 12)
    _run(m, a, 4)
    m.free(a)
    pool = m._pool[m.groups[0].name]
    owners = [pool.node[x] for x in pool.evictable.blocks()]
    assert owners[0] is owners[2] is not owners[1]  # a, b, a
    c = Request("c", [3] * 33, 0)
    m.create(c)
    m.resume(c)
    _run(m, c, 32)  # evicts all five cached blocks in one batch
    assert pool.evictions == 5 and all(p.request is not a for p in _pending(m))
    m.check_invariants()


#: layouts lazy keying applies to that ``test_kv_v2_lazy`` leaves out: every group sliding (in pools of their own or
#: one arena), windows shorter than a block; one with a full group for the paths (events, resets, cancels) on it
LAYOUTS = {
    "sliding w3": [LayerKV(0, "sliding", 4, window=3)],
    "sliding w6": [LayerKV(0, "sliding", 4, window=6)],
    "two windows": [LayerKV(0, "sliding", 4, window=2), LayerKV(1, "sliding", 8, window=5)],
    "arena, all sliding": [LayerKV(0, "sliding", 4, window=3), LayerKV(1, "sliding", 4, window=7)],
    "arena, full and sliding": [LayerKV(0, "full", 4), LayerKV(1, "sliding", 4, window=6),
                                LayerKV(2, "sliding", 4, window=6)],
}
OPS = ["new"] * 3 + ["grow"] * 4 + ["decode"] * 2 + ["free", "preempt", "readmit", "cancel", "suspend", "resume",
                                                     "reset", "priority", "flush"]


def _observed(m, live: list[Request]) -> tuple:
    """``test_kv_v2_lazy``'s observation plus eviction priorities, reused prompt tokens and the stats' block counts."""
    groups = [(name, g.free, g.evictable, g.used) for name, g in m.stats().groups.items()]
    return (_observe(m, live), [r.num_reused_tokens for r in live],
            [list(p.priority) for _, p in sorted(m._pool.items())], groups)


def _events(buffer: KvEventBuffer | None) -> list | None:
    if buffer is None:
        return None
    return [{k: v for k, v in e.items() if k not in ("seq", "ts")} for e in buffer.drain()["events"]]


def _differential(seed: int) -> None:
    rng = random.Random(seed)
    layout = sorted(LAYOUTS)[seed % len(LAYOUTS)]
    options = {"enable_partial_reuse": rng.random() < 0.7, "enable_swa_scratch_reuse": rng.random() < 0.7,
               "host_cache_size": rng.choice([0, None, 384])}
    blocks = rng.choice([6, 8, 12])
    sides = []
    for lazy in (True, False):
        m = make_manager(LAYOUTS[layout], blocks, T=T, max_seq_len=MAX_SEQ, **options)
        assert m._lazy
        m._lazy = lazy  # the reference: every full block keyed as it fills
        sides.append({"m": m, "live": [], "events": None})
    seen: list[list[int]] = []
    n_ops = rng.randrange(20, 100)
    events_at = rng.randrange(2 * n_ops) if rng.random() < 0.4 else -1  # KV cache events switched on mid-run
    for n_op in range(n_ops):
        op = "events" if n_op == events_at else rng.choice(OPS)
        pick, first, priority = rng.randrange(1000), rng.randrange(12), rng.randrange(3)
        tokens = [rng.randrange(3) for _ in range(rng.randrange(0, 12))]  # a 1-token prompt now and then
        salt, k, hold_back = rng.choice([None, None, "s"]), rng.randrange(1, 10), rng.randrange(2)
        if op == "new":
            prompt = (seen[pick % len(seen)][: 1 + pick % len(seen[pick % len(seen)])] + tokens
                      if seen and pick % 2 else [first, *tokens])[:32]
        answers = []
        for side in sides:
            m, live = side["m"], side["live"]
            answer = None
            if op == "new":
                r = Request(f"r{n_op}", list(prompt), 8, salt=salt, priority=priority)
                m.create(r)
                m.resume(r)
                live.append(r)
            elif op == "events":
                side["events"] = KvEventBuffer(1 << 16)
                m.enable_kv_events(side["events"])
            elif op == "reset":
                try:
                    m.reset_prefix_cache()
                    answer = "reset"
                except PrefixCacheInUseError:
                    answer = "refused"
                    if pick % 4 == 0:  # let everything go, then reset
                        for r in live:
                            m.free(r)
                        live.clear()
                        m.reset_prefix_cache()
            elif op == "flush":  # a long request that evicts many cached blocks in one allocation, then lets go
                r = Request(f"f{n_op}", [100 + first] + [7] * (MAX_SEQ - 1), 0, salt=salt, priority=priority)
                m.create(r)
                m.resume(r)
                answer = m.fit_tokens(r, MAX_SEQ - 1)
                if answer:
                    _run(m, r, answer)
                m.free(r)
            elif op == "decode":  # a token for every running request in turn: their windows let go of blocks in turns
                answer = []
                for r in live:
                    cache = m.cache(r)
                    if cache.is_active and r.num_tokens < MAX_SEQ:
                        r.output_token_ids.append(first % 3)
                        answer.append(m.allocate(r, r.num_tokens - cache.committed))
                        if answer[-1]:
                            m.commit(r, r.num_tokens - cache.committed)
            elif live:
                r = live[pick % len(live)]
                cache = m.cache(r)
                if op == "grow" and cache.is_active:
                    r.output_token_ids.extend(tokens[:max(0, MAX_SEQ - r.num_tokens)])
                    n = min(k, r.num_tokens - cache.committed)
                    answer = bool(n) and m.allocate(r, n)
                    if answer:
                        m.commit(r, n - (hold_back if n > 1 else 0))
                        if side is sides[0] and cache.committed:
                            seen.append(list(r.all_token_ids[: cache.committed]))
                elif op in ("free", "preempt"):
                    (m.free if op == "free" else m.preempt)(r)
                    live.remove(r)
                elif op == "readmit" and cache.is_active:  # preempted, then the same Request admitted again
                    m.preempt(r)
                    m.create(r)
                    m.resume(r)
                    answer = r.num_computed_tokens
                elif op == "cancel":
                    try:
                        m.cancel_admission(r)
                        live.remove(r)
                        answer = "cancelled"
                    except ValueError:
                        answer = "kept"
                elif op == "suspend" and cache.is_active:
                    answer = m.suspend(r)
                elif op == "resume" and not cache.is_active:
                    answer = m.resume(r)
                elif op == "priority":
                    r.priority = priority
            answers.append(answer)
        lazy, eager = sides
        where = f"seed {seed} ({layout}, {options}, {blocks} blocks): op {n_op} ({op})"
        assert answers[0] == answers[1], where
        assert _observed(lazy["m"], lazy["live"]) == _observed(eager["m"], eager["live"]), where
        assert _events(lazy["events"]) == _events(eager["events"]), where
        lazy["m"].check_invariants()
    for side in sides:
        for r in side["live"]:
            side["m"].free(r)
    lazy_m = sides[0]["m"]
    lazy_m.check_invariants()
    assert _observed(lazy_m, []) == _observed(sides[1]["m"], [])
    assert not lazy_m._tree.latent
    assert all(p.cache is None and any(p.held) for p in _pending(lazy_m))  # every note left holds a cached block


@pytest.mark.parametrize("seed", range(80))
def test_lazy_keying_matches_eager_keying_on_sliding_only_layouts_big_evictions_and_rare_paths(seed):
    _differential(seed)
