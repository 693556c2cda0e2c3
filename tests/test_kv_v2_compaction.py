"""A slab arena's compaction (``KVCacheManagerV2.compact_slabs``) forced at random moments: every holder of a block id
follows each moved block, and nothing a user sees changes.

The scheduler compacts only where a request alone could not grow, which seeded runs reach rarely; here it is forced
before random steps and in the middle of steps (before a reservation), on slab-arena layouts with prefix reuse, partial
hits, forks, drafts, aborts and KV events. After every step and every forced compaction: the invariants, every running
request's KV read back through its tables, every cached block's KV read back through the radix tree (runs and tails),
and the KV events (every removed hash was stored, and what is stored and not removed is exactly what the tree holds).
A forced run finishes the same requests with the same tokens and reasons as the unforced one: packing only relabels
blocks and evicts cached ones, so decisions and hits may differ, outputs may not.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_backends.budget import plan_arena, slab_bytes
from cache_backends.interface import ManagerOptions, SchedulerOutput
from cache_backends.kv_events import CLEARED, REMOVED, STORED, KvEventBuffer
from cache_backends.layout import build_layout
from cache_backends.pools import BlockPools
from cache_backends.request import Request, RequestState
from cache_backends.v2 import KVCacheManagerV2, KVCacheV2Scheduler
from engine.driver import StalledError
from tests.kv_v2_support import (
    _entries,
    _entry_value,
    _expected,
    check_kv,
    prefix_values,
    split_sliding_layers,
)
from tests.test_kv_v2_scheduler import COMPRESSED, _drafting_driver

LAYOUTS = [split_sliding_layers(8), *COMPRESSED]


def _path_tokens(run: Any) -> list[int]:
    """The token ids of every position of the path that ends at ``run`` (a run or a tail: its padded block too)."""
    parts = []
    node = run
    while node is not None and node.parent is not None:
        parts.append(bytes(node.tokens))
        node = node.parent
    packed = b"".join(reversed(parts))
    return list(struct.unpack(f"<{len(packed) // 8}q", packed))


def check_tree_kv(m: KVCacheManagerV2) -> None:
    """Assert that every block the radix tree holds (runs, and tails still adjacent: the only ones a partial match
    reads) holds the KV of the prefix at its position: a block moved without its references, or its references
    without its pages, reads back wrong here."""
    tree, T = m._tree, m.T
    for run in [*tree.nodes(), *(tail for tail in tree.tails() if tail.adjacent())]:
        tokens = _path_tokens(run)
        tail = run is not None and hasattr(run, "valid")
        for i in range(len(run.held)):
            p = run.start + i
            known = p * T + run.valid if tail else (p + 1) * T
            vals = prefix_values(tokens[:known], run.salt)
            for g in m.groups:
                b = run.blocks[g.name][i]
                if b < 0:
                    continue
                epb = m.pools.groups[g.name].entries_per_block
                gb = p // max(1, g.tokens_per_block // T)  # the group block the position ends (or a tail lies in)
                entries = [e for e in _entries(g, 0, known) if gb * epb <= e < (gb + 1) * epb]
                if not entries:
                    continue
                got = m.pools.tensors[g.name][:, b, [e % epb for e in entries]]
                want = _expected(m, g.name, [_entry_value(vals, g, e) for e in entries])
                assert torch.equal(got[..., 0], want), f"group {g.name}: cached block {b} at position {p} holds " \
                    f"the wrong KV"
    for by_first in tree.pending.values():  # lazily keyed prefixes (no KV events): blocks at request positions
        for prefix in by_first.values():
            tokens, n = prefix.request.all_token_ids, len(prefix.held)
            for i in range(n):
                known = i * T + prefix.tail if prefix.tail and i == n - 1 else (i + 1) * T
                vals = prefix_values(tokens[:known], prefix.salt)
                for g in m.groups:
                    b = prefix.blocks[g.name][i] if g.name in prefix.blocks else -1
                    if b < 0:
                        continue
                    epb = m.pools.groups[g.name].entries_per_block  # (lazy keying: every group block spans T)
                    entries = [e for e in _entries(g, 0, known) if i * epb <= e < (i + 1) * epb]
                    if not entries:
                        continue
                    got = m.pools.tensors[g.name][:, b, [e % epb for e in entries]]
                    want = _expected(m, g.name, [_entry_value(vals, g, e) for e in entries])
                    assert torch.equal(got[..., 0], want), f"group {g.name}: pending block {b} at {i}: wrong KV"


class EventLedger:
    """What a KV-event reader knows is cached: per group, the hashes stored and not removed since."""

    def __init__(self, m: KVCacheManagerV2) -> None:
        self.m = m
        self.buffer = KvEventBuffer(1 << 20)
        m.enable_kv_events(self.buffer)
        self.live: dict[str, set[str]] = {g.name: set() for g in m.groups}

    def check(self) -> None:
        """Replay the new events (a removed hash must be live, a stored one must not be) and compare with the tree."""
        for e in self.buffer.drain()["events"]:
            if e["type"] == CLEARED:
                for s in self.live.values():
                    s.clear()
                continue
            live = self.live[e["layer_group"]]
            for h in e["block_hashes"]:
                if e["type"] == STORED:
                    assert h not in live, f"{e['layer_group']}: {h[:12]} stored twice"
                    live.add(h)
                else:
                    assert e["type"] == REMOVED
                    assert h in live, f"{e['layer_group']}: {h[:12]} removed but not stored"
                    live.remove(h)
        tree = self.m._tree
        for g in self.m.groups:
            held = {tree.key(run, i).hex() for run in tree.nodes() for i in range(len(run.held))
                    if run.blocks[g.name][i] >= 0}
            assert held == self.live[g.name], f"{g.name}: events say {len(self.live[g.name])} blocks, tree {len(held)}"


def _check_all(m: KVCacheManagerV2, running: list[Request], ledger: EventLedger | None) -> None:
    m.check_invariants()
    for r in running:
        if m.has_cache(r) and m.cache(r).is_active:
            check_kv(m, r)
    check_tree_kv(m)
    if ledger is not None:
        ledger.check()


def forced_run(seed: int, force: bool) -> tuple[list, int]:
    """A seeded driven run on a slab arena (the engine's Driver, synthetic KV written and checked every step); with
    ``force``, ``compact_slabs`` before random steps and before random reservations inside a step, everything checked
    after each. (the finished requests' ids, reasons and tokens or the stall, blocks moved)."""
    rng = random.Random(seed)
    layers = rng.choice(LAYOUTS)
    max_seq_len = rng.choice([40, 4096])
    layout = build_layout(layers, "v2", 4, "float32")
    plan = plan_arena(layout, max(rng.randint(3, 12), len(layout.groups)) * slab_bytes(layout), max_seq_len)
    m = KVCacheManagerV2(BlockPools(layout, plan.num_blocks, "cpu", slabs=plan.slabs),
                         ManagerOptions(max_seq_len=max_seq_len, host_cache_size=0,
                                        enable_partial_reuse=rng.random() < .5))
    s = KVCacheV2Scheduler(m, rng.randint(2, 8), rng.randint(2, 40), scheduling_policy=rng.choice(["fcfs", "priority"]),
                           init_ratio=rng.choice([0.0, 0.7]))
    ledger = EventLedger(m) if rng.random() < .6 else None
    drafting = rng.random() < .7
    force_rng = random.Random(seed * 7 + 1)  # its own stream: the unforced run draws the same workload

    if force:
        step, reserve = s.step, m.schedule_tokens

        def forced_step(waiting, running) -> SchedulerOutput:
            if force_rng.random() < .5 and m.compact_slabs():
                _check_all(m, running, ledger)
            return step(waiting, running)

        def forced_reserve(request: Request, want: int) -> int:
            if force_rng.random() < .3 and m.compact_slabs():  # mid-step: others hold this step's reservations
                _check_all(m, [], ledger)
            return reserve(request, want)

        s.step = forced_step  # type: ignore[method-assign]
        m.schedule_tokens = forced_reserve  # type: ignore[method-assign]

    driver, compute = _drafting_driver(m, s, max_seq_len, drafting)

    stems = [[rng.randint(0, 3)] + [(i * 5 + j) % 13 for j in range(rng.randint(3, 20))] for i in range(3)]
    requests, aborts = [], {}
    for i in range(rng.randint(3, 10)):
        prompt = rng.choice(stems) + [40 + i] * rng.randint(0, 8)
        r = Request(f"q{i}", prompt, rng.randint(1, 24), priority=rng.randint(0, 2))
        if m.never_fits(r) is not None:
            continue
        requests.append(r)
        if rng.random() < .25:  # aborted once it has this many tokens (running or waiting)
            aborts[r.req_id] = len(prompt) + rng.randint(0, 6)
        if rng.random() < .25:  # n > 1: samples that join holding the prompt's KV
            kids = [Request(f"q{i}.{k}", prompt, r.max_new_tokens, priority=r.priority) for k in range(2)]
            driver.fork(r, [k for k in kids if m.never_fits(k) is None])
    aborted: list[tuple[str, str | None, list[int]]] = []

    def stepped(_clock: int, _stats: Any) -> None:
        for r in [*driver.running, *driver.waiting]:
            if r.req_id in aborts and r.num_tokens >= aborts[r.req_id] and not driver.forks_pending:
                s.finish(r, "abort")
                (driver.running if r in driver.running else driver.waiting).remove(r)
                aborted.append((r.req_id, "abort", []))  # its tokens so far depend on the schedule
        _check_all(m, driver.running, ledger)

    try:
        driver.run(requests, compute, on_step=stepped, max_steps=3000)
        end: Any = sorted([*((r.req_id, r.finish_reason, r.output_token_ids) for r in driver.finished), *aborted])
    except StalledError as exc:
        end = str(exc)
    assert all(r.state is RequestState.FINISHED for r in requests if isinstance(end, list))
    return end, m._slabs.counters["blocks_moved"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 100_000))
def test_compaction_forced_at_random_moments_keeps_every_block_holder_and_every_output(seed):
    unforced, _ = forced_run(seed, False)
    forced, _ = forced_run(seed, True)
    if isinstance(unforced, list):  # (an abort lands after a step: one that adds several tokens may finish it first)
        assert isinstance(forced, list), forced
        assert [r[0] for r in forced] == [r[0] for r in unforced]
        assert [r for r, f in zip(unforced, forced, strict=True) if "abort" not in (r[1], f[1])] == \
            [f for r, f in zip(unforced, forced, strict=True) if "abort" not in (r[1], f[1])]


def test_a_private_copy_moved_by_compaction_still_takes_the_cached_blocks_place_when_that_one_is_evicted():
    # "b" computes "a"'s prompt side by side with it (no hit: nothing was cached yet), so b's blocks are private copies
    # noted under a's keyed ones (_copies); "c" in between leaves b's window blocks one a slab. Compaction moves one of
    # b's noted copies; the note must follow it (its new id, at the generation that id has now): once a lets go and its
    # blocks are evicted, b's moved copy takes the position, so the prefix stays cached with b's KV, and a later turn
    # hits it. A note left on the old id (freed) or on the old generation would leave the position empty.
    from tests.kv_v2_support import admit, compute, slab_manager

    m = slab_manager(24)
    a, b, c = Request("a", [2, 4] * 6, 8), Request("b", [2, 4] * 6, 8), Request("c", [1, 3] * 6, 8)
    for r in (a, c, b):
        admit(m, r)
    for _ in range(4):
        for r in (a, c, b):
            compute(m, r, 2)
    m.free(c)
    before = {g.name: list(m.cache(b).tables[g.name]) for g in m.groups}
    noted = {g.name: {x for got in m._copies[g.name].values() for x, v in got if m._pool[g.name].gen[x] == v
                      and m._pool[g.name].ref[x]} for g in m.groups}  # the live notes (a window let some go)
    assert all(x in before[n] and m._pool[n].node[x] is None for n, xs in noted.items() for x in xs)  # b's, private
    assert m.compact_slabs()
    _check_all(m, [a, b], None)
    after = {g.name: m.cache(b).tables[g.name] for g in m.groups}
    moved = {n: [(x, y) for x, y in zip(before[n], after[n], strict=True) if x != y and x in noted[n]] for n in noted}
    assert any(moved.values())  # a noted copy moved
    for n, pairs in moved.items():
        pool = m._pool[n]
        notes = {x: v for got in m._copies[n].values() for x, v in got}
        for _, y in pairs:
            assert notes.get(y) == pool.gen[y]  # the note names the copy's new id at its generation now
    m.free(a)
    for g in m.groups:  # a's cached blocks evicted as an allocation evicts (free blocks, a free slab, then LRU)
        pool, held = m._pool[g.name], []
        keys = [k for k in m._copies[g.name]]
        while any(pool.node[k] is not None and k not in after[g.name] for k in keys):
            held += pool.allocate_many(1, m._detach)
        pool.release(held, 0, False, m._detach)
    _check_all(m, [b], None)
    for n, pairs in moved.items():
        for _, y in pairs:
            assert m._pool[n].node[y] is not None, f"{n}: b's moved copy {y} did not take its position"
    m.free(b)
    e = Request("e", [2, 4] * 6, 2)
    admit(m, e)
    assert e.num_reused_tokens == 8  # the reuse unit (the compressed group's 8 tokens): b's copies, moved one included
    assert any(y in m.cache(e).tables[n] for n, pairs in moved.items() for _, y in pairs)
    check_kv(m, e)


def test_a_slab_arena_refuses_a_host_tier_so_no_suspended_cache_holds_a_block_compaction_would_move():
    # compact_slabs moves the tables of active caches only: a suspended cache's reclaim marks and write-back entries
    # (host tier) would keep old block ids. The manager refuses a host tier on a slab arena outright, and the default
    # (None: sized automatically elsewhere) gives none here.
    layout = build_layout(COMPRESSED[1], "v2", 4, "float32")
    plan = plan_arena(layout, 8 * slab_bytes(layout), 64)
    with pytest.raises(ValueError, match="slab arena .* runs without a host tier"):
        KVCacheManagerV2(BlockPools(layout, plan.num_blocks, "cpu", slabs=plan.slabs),
                         ManagerOptions(max_seq_len=64, host_cache_size=1 << 20))
    m = KVCacheManagerV2(BlockPools(layout, plan.num_blocks, "cpu", slabs=plan.slabs),
                         ManagerOptions(max_seq_len=64, host_cache_size=None))
    assert m.host is None and m.num_on_host == 0


def test_packing_evicts_the_kept_slabs_cached_blocks_in_eviction_order():
    # g (4 blocks a slab): slab 0 holds two used blocks and two cached ones, block 3 released before block 2; slab 1
    # one used block. Packing keeps slab 0 and needs one place there: the cached block an allocation would evict first
    # (3, the least recently released), not the first in slab order (2, the one just released)
    from types import SimpleNamespace

    from cache_backends.v2.slab_pool import SlabArena, SlabPool

    arena = SlabArena(4, 1024)
    g = SlabPool("g", arena, 256)
    detached: list[int] = []

    def detach(_name: str, blocks: list[int]) -> None:
        for b in blocks:
            g.node[b] = None
        detached.extend(blocks)

    assert sorted(g.allocate_many(4, detach)) == [0, 1, 2, 3] and g.allocate_many(1, detach) == [4]
    for b in (3, 2):
        g.node[b] = SimpleNamespace(children=())  # attached: cached on release
        g.release([b], 0, True, detach)
    assert g.evictable.blocks() == [3, 2]
    assert g.packing_moves(detach) == [(4, 3)] and detached == [3]
    g.move([(4, 3)])
    assert g.evictable.blocks() == [2] and not arena.check()
