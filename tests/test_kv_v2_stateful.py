"""Hypothesis state machine: random V2 life cycles keep the block bookkeeping and the KV bytes right.

Random create / fork-by-prefix / resume / grow (allocate, write, commit) / suspend / preempt / close
sequences (some requests skip reading the prefix cache, as a scored prompt does, so they compute and key duplicates of
cached blocks) over small pools (so allocation fails, blocks get evicted, the host tier fills), on two
layouts: ``split`` — a full group, a sliding group and a compressed group, each with a pool of its own
(their pages differ) — and ``shared`` — a full layer and two sliding layers with equal pages, so three
1-layer groups take their blocks from one arena (one free list, global eviction) — and ``uniform`` — full layers
only, in two groups of different pages. On all three, requests that share no first token are keyed lazily
(pending prefixes hung in the radix tree only when a later lookup reaches them). After every step:

* no block is owned twice by one cache, reference counts equal the number of owning caches, and
  only cached prefix blocks are shared;
* per group ``free + used + cached == total`` (a shared arena: its free pages plus every group's used
  and cached ones), and the stats agree;
* ``committed <= history <= capacity`` for every cache;
* every active cache reads back, through its block tables, exactly the KV written for its tokens
  (reused, copied, restored and windowed pages included).

At the end, with everything closed, no block is used and every host slot is free.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, currently_in_test_context, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cache_backends import LayerKV
from cache_backends.interface import PrefixCacheInUseError
from cache_backends.request import Request
from cache_backends.v2 import CacheState
from tests.kv_v2_support import blocks_add_up, check_kv, make_manager, own_groups, write_kv

BLOCKS = 5
MAX_SEQ = 48
TOKENS = st.lists(st.integers(0, 5), min_size=1, max_size=14)
SALTS = st.sampled_from([None, "tenant"])


def event(name: str) -> None:
    """Count a path in ``--hypothesis-show-statistics`` (a no-op when the machine is driven by hand)."""
    if currently_in_test_context():
        hypothesis_event(name)


class V2CacheMachine(RuleBasedStateMachine):
    """Drives one manager through random life cycles."""

    def __init__(self) -> None:
        super().__init__()
        self.m = None
        self.live: list[Request] = []
        self.seen: list[tuple[list[int], str | None]] = []
        self.count = 0

    @initialize(partial=st.booleans(), scratch=st.booleans(), window=st.sampled_from([3, 6, 64]),
                host=st.sampled_from(["none", "small", "auto"]), seeds=st.lists(TOKENS, min_size=2, max_size=2),
                layout=st.sampled_from(["split", "shared", "uniform"]))
    def build(self, partial, scratch, window, host, seeds=(), layout="split"):
        per_block = 2 * 4 * 4  # entry elems x float32 x tokens (csa: 2 entries of 2 elems per block: 16)
        if layout == "split":
            layers = [LayerKV(0, "full", 2), LayerKV(1, "sliding", 2, window=window),
                      LayerKV(2, "csa", 2, window=window, compressed_elems=2, compress_rate=2)]
            small = 2 * (3 * per_block + 16)
        elif layout == "uniform":  # no window: groups full (4-element entries) and full_1 (8), lazy keying
            layers = [LayerKV(0, "full", 2), LayerKV(1, "full", 4), LayerKV(2, "full", 4)]
            small = 2 * (per_block + 2 * per_block)
        else:  # equal pages: full, sliding_w.0, sliding_w.1 share BLOCKS * 3 pages
            layers = [LayerKV(0, "full", 2), LayerKV(1, "sliding", 2, window=window),
                      LayerKV(2, "sliding", 2, window=window)]
            small = 2 * (3 * per_block + per_block)
        host_size = {"none": 0, "auto": None, "small": small}[host]
        self.m = make_manager(layers, BLOCKS, max_seq_len=MAX_SEQ, enable_partial_reuse=partial,
                              enable_swa_scratch_reuse=scratch, host_cache_size=host_size)
        # lazy keying wherever every group's block spans one token block (here all three layouts)
        assert self.m.layout.shared == (layout == "shared") and self.m._lazy
        for tokens in seeds:  # start with admitted caches so every rule has something to act on
            self.m.resume(self._new(tokens, None, 0))

    # --- helpers -------------------------------------------------------------------------------

    def _new(self, tokens: list[int], salt: str | None, priority: int, skip: bool = False) -> Request:
        self.count += 1
        r = Request(f"r{self.count}", tokens[:MAX_SEQ], 0, priority=priority, salt=salt, arrival=self.count,
                    skip_prefix_read=skip)
        self.m.create(r)
        self.live.append(r)
        self.seen.append((list(r.all_token_ids), salt))
        return r

    def _with(self, state: CacheState, admitted: bool | None = None) -> list[Request]:
        out = []
        for r in self.live:
            c = self.m.cache(r)
            if c.state is state and (admitted is None or c.admitted == admitted):
                out.append(r)
        return out

    def _pick_active(self, data) -> Request | None:
        active = self._with(CacheState.ACTIVE)
        return data.draw(st.sampled_from(active)) if active else None

    # --- rules ---------------------------------------------------------------------------------

    @rule(tokens=TOKENS, salt=SALTS, priority=st.integers(0, 2), skip=st.booleans())
    def create(self, tokens, salt, priority, skip):
        self._new(tokens, salt, priority, skip)

    @rule(data=st.data(), suffix=TOKENS, priority=st.integers(0, 2), same_salt=st.booleans(), skip=st.booleans())
    def fork_by_prefix(self, data, suffix, priority, same_salt, skip):
        if not self.seen:
            return
        tokens, salt = data.draw(st.sampled_from(self.seen))
        k = data.draw(st.integers(1, len(tokens)))
        r = self._new(tokens[:k] + suffix, salt if same_salt else ("other" if salt is None else None), priority, skip)
        assert self.m.resume(r)
        assert r.num_computed_tokens < r.num_tokens  # reuse leaves at least one token to compute
        assert not (skip and r.num_computed_tokens)  # one that skips reading computes its prompt whole (and is keyed)
        event("fork reused a prefix" if r.num_computed_tokens else "fork skipped reading" if skip
              else "fork reused nothing")

    @rule(data=st.data())
    def resume(self, data):
        candidates = [r for r in self.live if not self.m.cache(r).is_active]
        if not candidates:
            return
        r = data.draw(st.sampled_from(candidates))
        cache = self.m.cache(r)
        fresh = not cache.admitted
        committed = cache.committed
        refusal = self.m.resume_refusal(r)
        ok = self.m.resume(r)
        assert ok == (refusal is None)
        event("admit" if fresh else "restore" if ok else "restore refused")
        if fresh:
            assert ok and r.num_computed_tokens < r.num_tokens
            assert not (r.skip_prefix_read and r.num_computed_tokens)
        elif ok:
            assert cache.committed == committed
        else:
            assert cache.state is CacheState.SUSPENDED

    @rule(data=st.data(), n=st.integers(1, 10), new_tokens=st.lists(st.integers(0, 5), max_size=10))
    def grow(self, data, n, new_tokens):
        r = self._pick_active(data)
        if r is None:
            return
        cache = self.m.cache(r)
        room = MAX_SEQ - r.num_tokens
        r.output_token_ids.extend(new_tokens[:room])  # generated tokens arrive
        n = min(n, r.num_tokens - cache.committed)
        if n == 0:
            return
        before = (cache.committed, cache.history, cache.capacity)
        if not self.m.allocate(r, n):
            assert (cache.committed, cache.history, cache.capacity) == before
            event("allocation refused")
            return
        write_kv(self.m, r, cache.committed, n)
        self.m.commit(r, data.draw(st.integers(0, n)))
        if cache.committed:
            self.seen.append((list(r.all_token_ids[: cache.committed]), r.salt))

    @rule(data=st.data())
    def suspend(self, data):
        r = self._pick_active(data)
        if r is None:
            return
        cache = self.m.cache(r)
        committed = cache.committed
        if self.m.suspend(r):
            assert cache.state is CacheState.SUSPENDED and cache.history == committed
            event("suspended")
        else:
            assert cache.is_active

    @rule(data=st.data())
    def preempt(self, data):
        r = self._pick_active(data)
        if r is None:
            return
        self.m.preempt(r)
        self.live.remove(r)
        assert r.num_computed_tokens == 0 and not self.m.has_cache(r)

    @rule(data=st.data())
    def close(self, data):
        if not self.live:
            return
        r = data.draw(st.sampled_from(self.live))
        self.m.free(r)
        self.live.remove(r)

    @rule(free_all=st.booleans())
    def reset_prefix_cache(self, free_all):
        if free_all:
            for r in self.live:
                self.m.free(r)
            self.live.clear()
        if self.live:
            nodes = self.m.stats().reuse.radix_nodes
            with pytest.raises(PrefixCacheInUseError, match="still hold a KV cache"):
                self.m.reset_prefix_cache()
            assert self.m.stats().reuse.radix_nodes == nodes  # the refusal changed nothing
            event("reset refused")
            return
        self.m.reset_prefix_cache()
        stats = self.m.stats()
        assert stats.reuse.radix_nodes == 0
        assert all(g.free == g.total and g.evictable == g.used == 0 for g in stats.groups.values())
        if self.seen:  # nothing seen before hits any more
            tokens, salt = self.seen[-1]
            r = self._new(tokens, salt, 0)
            assert self.m.resume(r) and r.num_computed_tokens == 0
        event("reset")

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def bookkeeping_holds(self):
        if self.m is None:
            return
        self.m.check_invariants()
        stats = self.m.stats().groups
        active = self._with(CacheState.ACTIVE)
        for g, cuts in own_groups(self.m):  # references are the manager's own blocks' (tied: a logical block's)
            owners: dict[int, int] = {}
            for r in active:
                table = [b for b in self.m.cache(r).tables[g.name] if b >= 0]
                assert len(table) == len(set(table)), f"{r.req_id} owns a block of {g.name} twice"
                for b in table:
                    owners[b] = owners.get(b, 0) + 1
            pool = self.m._pool[g.name]
            shared = self.m.layout.shared
            ids = len(pool.ref)  # (a tied arena's logical ids: as many as its pages)
            mine = [b for b in range(ids) if not shared or pool.holds(b)]  # a shared arena: this group's
            assert set(owners) <= set(mine), f"a table of {g.name} holds another group's block"
            for b in mine:
                assert pool.ref[b] == owners.get(b, 0)
                if owners.get(b, 0) > 1:
                    assert pool.node[b] is not None, "only cached prefix blocks are shared"
            for cut in cuts:  # what the user sees per group: its pages, each held once per table, counted in use
                pages: set[int] = set()
                for r in active:
                    table = [b for b in self.m.block_table(r, cut) if b >= 0]
                    assert len(table) == len(set(table)), f"{r.req_id} owns a page of {cut} twice"
                    pages.update(table)
                s = stats[cut]
                assert s.total == BLOCKS * (len(self.m.groups) if shared else 1)
                assert s.used == len(owners) == len(pages)
        assert blocks_add_up(self.m.stats(), self.m.layout.shared)

    @invariant()
    def lengths_are_ordered(self):
        for r in self.live:
            c = self.m.cache(r)
            assert c.committed <= c.history <= c.capacity
            if c.is_active:
                for g in self.m.groups:
                    assert len(self.m.block_table(r, g.name)) == math.ceil(c.capacity / g.tokens_per_block)

    @invariant()
    def kv_reads_back(self):
        for r in self._with(CacheState.ACTIVE):
            check_kv(self.m, r)

    def teardown(self):
        if self.m is None:
            return
        for r in list(self.live):
            self.m.free(r)
        stats = self.m.stats()
        if any(g.evictions for g in stats.groups.values()):
            event("evicted")
        if stats.reuse_partial_hits:
            event("partial reuse")
        assert all(g.used == 0 for g in stats.groups.values()) and blocks_add_up(stats, self.m.layout.shared)
        assert all(h.used == 0 for h in (stats.host or {}).values())
        self.m.check_invariants()
        self.m.close()


V2CacheMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_v2_cache_life_cycles = V2CacheMachine.TestCase


@pytest.mark.parametrize("layout", ["split", "shared", "uniform"])
@pytest.mark.parametrize("seed", [0])
def test_machine_exercises_reuse_suspend_and_eviction(seed, layout):
    """The machine's moves reach the interesting paths (guards against a machine that tests nothing)."""
    import random

    rng = random.Random(seed)
    totals = {"reuse_hit_tokens": 0, "suspends": 0, "resumes": 0, "evictions": 0, "reuse_partial_hits": 0}
    lazy = {"hung while running": 0, "hung after release": 0, "evicted unhung": 0}
    for _ in range(20):
        machine = V2CacheMachine()
        machine.build(partial=True, scratch=rng.random() < 0.5, window=6, host="auto", layout=layout)
        m = machine.m
        materialize, drop = m._materialize, m._tree.drop_pending

        def counted_materialize(prefix, materialize=materialize):
            lazy["hung while running" if prefix.cache is not None else "hung after release"] += 1
            materialize(prefix)

        def counted_drop(prefix, drop=drop):
            lazy["evicted unhung"] += prefix.cache is None and not any(prefix.held)
            drop(prefix)

        m._materialize, m._tree.drop_pending = counted_materialize, counted_drop
        for _ in range(60):
            active = machine._with(CacheState.ACTIVE)
            move = rng.random()
            if move < 0.25 or not machine.live:
                tokens = [rng.randrange(3) for _ in range(rng.randrange(4, 14))]
                tokens[0] = rng.randrange(9)  # first tokens that collide sometimes, not always (lazy keying)
                if machine.seen and rng.random() < 0.7:
                    src, _ = rng.choice(machine.seen)
                    tokens = src[: rng.randrange(1, len(src) + 1)] + tokens[:3]
                r = machine._new(tokens, None, rng.randrange(3))
                machine.m.resume(r)
            elif move < 0.7 and active:
                r = rng.choice(active)
                r.output_token_ids.append(rng.randrange(3))
                n = r.num_tokens - machine.m.cache(r).committed
                if machine.m.allocate(r, n):
                    write_kv(machine.m, r, machine.m.cache(r).committed, n)
                    machine.m.commit(r, n)
                    machine.seen.append((list(r.all_token_ids), None))
            elif move < 0.8 and active:
                machine.m.suspend(rng.choice(active))
            elif move < 0.9:
                suspended = [r for r in machine.live if not machine.m.cache(r).is_active]
                if suspended:
                    machine.m.resume(rng.choice(suspended))
            else:
                r = rng.choice(machine.live)
                machine.m.free(r)
                machine.live.remove(r)
            machine.bookkeeping_holds()
            machine.kv_reads_back()
        stats = machine.m.stats()
        for key in totals:
            totals[key] += getattr(stats, key)  # evictions: the sum over the groups
        machine.teardown()
    assert all(v > 0 for v in totals.values()), totals
    assert all(v > 0 for v in lazy.values()), lazy
