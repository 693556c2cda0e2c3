"""Lazy keying (``cache_backends.v2.radix``): a request whose first token starts no cached prefix is hung in the radix
tree only when a later lookup reaches it. What a user can observe must be what keying every block at once gives:
the same hits, block tables, free lists, eviction order and cached blocks, step by step."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cache_backends import LayerKV
from cache_backends.request import Request
from cache_backends.v2 import CacheState
from tests.kv_v2_support import full_sliding_layers, make_manager, split_sliding_layers

T = 4
BLOCKS = 10
MAX_SEQ = 40
#: no window, two groups of different pages
UNIFORM = [LayerKV(0, "full", 2), LayerKV(1, "full", 4)]
#: lazy keying applies to all of these: no window; windows in pools of their own; windows in a shared arena; only
#: windows (Mistral); a compressed group (two entries a block)
LAYOUTS = {"uniform": UNIFORM, "split windows": split_sliding_layers(3), "shared arena": full_sliding_layers(3),
           "windows only": [LayerKV(0, "sliding", 2, window=3)],
           "compressed": [LayerKV(0, "full", 2), LayerKV(1, "sliding", 2, window=3),
                          LayerKV(2, "csa", 2, window=3, compressed_elems=2, compress_rate=2)]}


def _manager(lazy: bool, host: bool, layout: str = "uniform", scratch: bool = True):
    m = make_manager(LAYOUTS[layout], BLOCKS, T=T, max_seq_len=MAX_SEQ, enable_partial_reuse=True,
                     host_cache_size=None if host else 0, enable_swa_scratch_reuse=scratch)
    assert m._lazy and m.layout.shared == (layout == "shared arena")
    m._lazy = lazy  # the reference: every full block keyed as it fills
    return m


def _observe(m, requests: list[Request]) -> tuple:
    """What a user of the manager can see: per request its cache's lengths, tables and hits; per group the free list,
    eviction order, reference counts, generations and what each cached (unused) block holds."""
    caches = []
    for r in requests:
        if m.has_cache(r):
            c = m.cache(r)
            caches.append((r.req_id, c.state.value, c.committed, c.history, c.capacity, sorted(c.tables.items()),
                           c.reused_tokens, c.partial_hit, r.num_computed_tokens,
                           sorted(c.host.items()) if c.host is not None else None))
    pools = []
    for name, p in sorted(m._pool.items()):
        held = [(p.pos[b], p.node[b].block(p.pos[b] - p.node[b].start)) if not p.ref[b] and p.node[b] is not None
                else None for b in range(p.num_blocks)]
        pools.append((name, p.free_ids(), p.evictable.blocks(), list(p.ref), list(p.gen), held,
                      p.num_used, p.num_evictable, p.evictions))
    return caches, pools, sorted(m.counters.items())


OPS = st.lists(st.tuples(st.sampled_from(["new", "new", "grow", "grow", "grow", "grow", "free", "preempt", "suspend",
                                          "resume"]),
                         st.integers(0, 1000), st.lists(st.integers(0, 2), min_size=1, max_size=9),
                         st.integers(0, 30)),  # a fresh prompt's first token: shared now and then, not always
               min_size=10, max_size=80)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, host=st.booleans(), salted=st.booleans(), layout=st.sampled_from(sorted(LAYOUTS)),
       scratch=st.booleans())
def test_lazy_keying_is_indistinguishable_from_keying_every_block(ops, host, salted, layout, scratch):
    sides = [(_manager(True, host, layout, scratch), []), (_manager(False, host, layout, scratch), [])]
    seen: list[list[int]] = []
    for n_op, (op, pick, tokens, first) in enumerate(ops):
        if op == "new":  # a fresh prompt, or a previous sequence's prefix and a suffix
            if seen and pick % 3:
                src = seen[pick % len(seen)]
                tokens = src[: 1 + pick % len(src)] + tokens
            else:
                tokens = [first, *tokens]
            tokens = tokens[:MAX_SEQ - 8]
        for m, live in sides:
            if op == "new":
                r = Request(f"r{n_op}", list(tokens), 0, salt="s" if salted and pick % 2 else None, priority=first % 2,
                            skip_prefix_read=pick % 7 == 1)  # a scored prompt: reads nothing, keys duplicates
                m.create(r)
                assert m.resume(r)
                live.append(r)
                continue
            if not live:
                continue
            r = live[pick % len(live)]
            cache = m.cache(r)
            if op == "grow" and cache.is_active:
                room = MAX_SEQ - r.num_tokens
                r.output_token_ids.extend(tokens[:max(0, room)])
                n = min(first % 9 + 1, r.num_tokens - cache.committed)
                if n and m.allocate(r, n):
                    m.commit(r, n - (pick % 2 if n > 1 else 0))
                    if m is sides[0][0] and cache.committed:
                        seen.append(list(r.all_token_ids[: cache.committed]))
            elif op in ("free", "preempt"):
                (m.free if op == "free" else m.preempt)(r)
                live.remove(r)
            elif op == "suspend" and cache.is_active:
                m.suspend(r)
            elif op == "resume" and not cache.is_active:
                m.resume(r)
        (lazy, lazy_live), (eager, eager_live) = sides
        assert _observe(lazy, lazy_live) == _observe(eager, eager_live), f"after op {n_op} ({op})"
        for by_first in lazy._tree.pending.values():
            for prefix in by_first.values():
                event("a running request's window left blocks cached" if prefix.cache is not None and prefix.held
                      else "a released request's blocks cached unkeyed" if prefix.cache is None else "pending")
        lazy.check_invariants()
    for m, live in sides:  # everything let go: the same blocks stay cached, in the same order
        for r in list(live):
            m.free(r)
        m.check_invariants()
    assert _observe(sides[0][0], []) == _observe(sides[1][0], [])


def test_prompts_that_share_nothing_are_never_hung_and_a_later_prompt_still_hits_them():
    m = make_manager(UNIFORM, 32, T=T, max_seq_len=MAX_SEQ)
    done = []
    for i in range(5):  # five prompts with five first tokens: each a cheap miss, none keyed
        r = Request(f"p{i}", [10 + i, *range(9)], 0)
        m.create(r)
        m.resume(r)
        m.allocate(r, r.num_tokens)
        m.commit(r, r.num_tokens)
        done.append(r)
        assert m.cache(r).pending is not None and m.stats().reuse.radix_nodes == 0
    for r in done:
        m.free(r)
    stats = m.stats()
    # cached, unkeyed: each prompt's two full blocks and its partial last one (a follow-up turn copies it)
    assert stats.reuse.radix_nodes == 0 and all(g.evictable == 15 for g in stats.groups.values())
    m.check_invariants()
    again = Request("again", [12, *range(9), 99], 0)  # p2's ten tokens and one more: its two full blocks hit
    m.create(again)
    m.resume(again)
    # p2 alone was hung: two positions and its tail, whose two tokens were copied
    assert again.num_computed_tokens == 10 and m.stats().reuse.radix_nodes == 3
    assert len(m._tree.pending[None]) == 4
    m.check_invariants()


def test_a_suspended_request_takes_its_unevicted_blocks_back_as_when_keyed_at_once():
    m = make_manager(UNIFORM, 8, T=T, max_seq_len=MAX_SEQ, host_cache_size=None)
    r = Request("r", [5, *range(11)], 0)
    m.create(r)
    m.resume(r)
    m.allocate(r, r.num_tokens)
    m.commit(r, r.num_tokens)
    tables = {name: list(t) for name, t in m.cache(r).tables.items()}
    assert m.suspend(r)  # hung in the tree first, so resume can tell its blocks are still there
    assert m.cache(r).state is CacheState.SUSPENDED and m.stats().reuse.radix_nodes == 3
    assert m.resume(r)
    assert {name: list(t) for name, t in m.cache(r).tables.items()} == tables  # taken back, not copied
    m.check_invariants()



def test_a_pending_prefix_keeps_the_tokens_its_blocks_hold_when_the_caller_reuses_its_lists():
    hits = []
    for lazy in (True, False):
        m = _manager(lazy, host=False)
        prompt = [7, 1, 2, 3, 4, 5, 6, 8, 9]
        r = Request("r", prompt, 0)
        m.create(r)
        m.resume(r)
        assert m.allocate(r, 9)
        m.commit(r, 9)
        m.free(r)
        prompt[1:] = [0] * 8  # the caller reuses its list: the cached blocks still hold 7, 1, 2, ...
        assert r.all_token_ids[:2] == [7, 1]  # ...and so does the request, which copied it
        again = Request("again", [7, 0, 0, 0, 0, 0, 0, 0, 0, 0], 0)
        m.create(again)
        m.resume(again)
        hits.append(again.num_computed_tokens)
        assert not m.cache(again).partial_hit or again.num_computed_tokens == 1  # [7] of the cached [7, 1, ...]
        m.check_invariants()
    assert hits[0] == hits[1] and hits[0] < 8
