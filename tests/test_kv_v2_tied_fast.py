"""The one-pass paths of a shared arena with its cuts tied (``TIE_CUTS``, the default): a lazily keyed
cache's finish (``_finish_parked``), a decode's window slide of the one logical sliding group (``_slide_parked``) and a
hit's claim (``_claim_arena_path``, with ``probe_hit`` / ``refuse_hit``'s passes) must be taken with the tie, and leave
the tied arena exactly as the per-group paths do: the same logical blocks owning the same pages, the same free pages
and ids in the same order, the row queue's page counts, every cut's KV readable."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_backends import LayerKV
from cache_backends.request import Request
from cache_backends.v2 import KVCacheManagerV2
from cache_backends.v2.scheduler import KVCacheV2Scheduler
from tests.kv_v2_support import arena_owner, check_kv, drive, make_manager, next_token, prefill, write_kv


def _gemma_like(window: int) -> list[LayerKV]:
    """Five sliding layers and one full layer with equal entries, as tiny-gemma3: six cuts, tied into 2 groups."""
    return [LayerKV(i, "sliding", 4, window=window) for i in range(5)] + [LayerKV(5, "full", 4)]


def _tied_manager(window: int, pages: int, **options: object) -> KVCacheManagerV2:
    m = make_manager(_gemma_like(window), pages, **options)
    assert m._tied_cuts == [[f"sliding_w{window}.{i}" for i in range(5)], ["full"]]  # the tie is on: 2 groups
    return m


def _paths(m: KVCacheManagerV2, fast: bool) -> dict[str, int]:
    """Count the one-pass paths ``m`` takes; with ``fast`` false, decline them all (the per-group paths instead:
    ``_park`` + ``_release_blocks``, ``_park_blocks`` + ``release_slices``, the per-group claim loop)."""
    took = {"finish": 0, "slide": 0, "claim": 0}
    finish, slide, claim = m._finish_parked, m._slide_parked, m._claim_arena_path

    def finished(cache: object) -> bool:
        done = finish(cache) if fast else False
        took["finish"] += done
        return done

    def slid(*args: object) -> bool:
        done = slide(*args) if fast else False
        took["slide"] += done
        return done

    def claimed(*args: object) -> None:
        took["claim"] += 1
        claim(*args)

    m._finish_parked = finished  # type: ignore[method-assign]
    m._slide_parked = slid  # type: ignore[method-assign]
    m._claim_arena_path = claimed  # type: ignore[method-assign]
    if not fast:
        m._unit_spans = False  # the per-group claim loop (and probe_hit's, refuse_hit's)
    return took


def _tied_state(m: KVCacheManagerV2) -> list:
    """What a step leaves in the tied arena: each logical block's pages, weight, counters, owner and position, the
    free pages and ids in order, the row queue's order and page counts, each cache's logical and cut tables."""
    arena = m._arena

    queue = arena.evictable
    caches = []
    for request, cache in sorted(m._caches.items(), key=lambda item: item[0].req_id):
        pending = cache.pending
        caches.append((request.req_id, {k: list(v) for k, v in cache.tables.items()}, dict(cache.released),
                       cache.committed, cache.room,
                       m.block_tables(request) if cache.is_active else None,
                       None if pending is None else (list(pending.held),
                                                     {k: list(v) for k, v in pending.blocks.items()}, pending.tail)))
    return [list(arena._free), list(arena._free_ids), list(arena.pages), list(arena.weight), list(arena.ref),
            list(arena.gen), list(arena.group_of), [arena_owner(arena, b) for b in range(len(arena.pages))],
            queue.buckets(), len(queue), queue.num_shared, queue._clock,
            list(arena.used), list(arena.cached), list(arena.evicted), caches, m.stats()]


def _run(monkeypatch: pytest.MonkeyPatch, requests: list[tuple[str, list[int], int, int]], fast: bool, window: int,
         at_once: int, pages: int) -> tuple[list, dict[str, int]]:
    """Requests (id, prompt, new tokens, draft tokens reserved when it ends: blocks past the full ones, the tail a
    finish frees) through the tied arena, ``at_once`` at a time, a token per decode step (reserved by
    ``schedule_tokens``, as the scheduler does), every running request's KV read back through its cut tables; the
    state after every step and the one-pass paths taken."""
    m = _tied_manager(window, pages)
    took = _paths(m, fast)
    queue = [Request(rid, prompt, new) for rid, prompt, new, _ in requests]
    ahead = {rid: k for rid, _, _, k in requests}
    running: list[Request] = []
    states = []
    while queue or running:
        while queue and len(running) < at_once:
            r = queue.pop(0)
            prefill(m, r)
            running.append(r)
        for r in list(running):
            if len(r.output_token_ids) >= r.max_new_tokens:
                check_kv(m, r)
                if ahead[r.req_id]:
                    r.draft_token_ids = [3] * ahead[r.req_id]
                    assert m.schedule_tokens(r, ahead[r.req_id]) == ahead[r.req_id]
                m.free(r)
                running.remove(r)
                continue
            r.output_token_ids.append(next_token(r))
            assert m.schedule_tokens(r, 1) == 1
            write_kv(m, r, r.num_computed_tokens, 1)
            m.commit(r, 1)
            check_kv(m, r)
        m.check_invariants()  # the tie's own (TiedArena.check: k distinct pages a block, none owned twice)
        states.append(_tied_state(m))
    return states, took


def _same_run(monkeypatch: pytest.MonkeyPatch, requests: list[tuple[str, list[int], int, int]], window: int,
              at_once: int, pages: int) -> dict[str, int]:
    fast, took = _run(monkeypatch, requests, True, window, at_once, pages)
    slow, none = _run(monkeypatch, requests, False, window, at_once, pages)
    assert none == {"finish": 0, "slide": 0, "claim": 0}
    assert len(fast) == len(slow)
    for step, (got, want) in enumerate(zip(fast, slow, strict=True)):
        assert got == want, f"step {step}"
    return took


def test_tied_finishes_slides_and_hits_take_the_one_pass_paths_and_leave_the_arena_as_the_per_group_paths(
        monkeypatch):
    # distinct openings (lazily keyed: finished and slid in one pass), some with draft tokens reserved at the end (a
    # tail of logical blocks past the full ones, freed with their pages), then requests opening with r0's prompt
    # (hits on its parked blocks, claimed in one pass, windows past position 0); 14 pages a cut: evictions
    requests = [(f"r{k}", [1000 * k + t + 1 for t in range(10 + k)], 6 + k, 2 * k) for k in range(5)]
    requests += [(f"h{k}", [1 + t for t in range(10)] + [500 + k, 501 + k], 4, k) for k in range(3)]
    took = _same_run(monkeypatch, requests, 8, 2, 14)
    assert took["finish"] >= 5 and took["slide"] > 0 and took["claim"] > 0, took


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 24), st.integers(1, 16), st.booleans(), st.integers(0, 9)),
                min_size=1, max_size=7),
       st.sampled_from([4, 8, 12]), st.integers(1, 3))
def test_tied_one_pass_paths_leave_the_arena_as_the_per_group_paths_on_any_mix(spec, window, at_once):
    # prompts of 1-24 tokens (some shorter than a block: nothing to park), a shared opening for some (hits: claimed,
    # keyed, not pending), 1-16 new tokens, 0-9 draft tokens reserved at the end; pages for ``at_once`` requests of
    # 49 tokens, so finished requests' logical blocks are evicted and their pages reused
    with pytest.MonkeyPatch.context() as monkeypatch:
        requests = [(f"r{k}", ([7, 8, 9, 10, 11] if shared else []) + [1000 * k + t + 1 for t in range(length)], new,
                     ahead) for k, (length, new, shared, ahead) in enumerate(spec)]
        _same_run(monkeypatch, requests, window, at_once, 13 * at_once)


def _driven(monkeypatch: pytest.MonkeyPatch, fast: bool) -> tuple[list, dict[str, int]]:
    """Shared-prefix requests scheduled under pressure on the tied arena (probes, refused hits, evictions), each
    step's KV checked by ``drive``: what each step scheduled, admitted and preempted, and the paths taken."""
    m = _tied_manager(8, 12)
    took = _paths(m, fast)
    # every other request opens with a shared prompt (hits, keyed), the others with their own (lazily keyed)
    requests = [Request(f"q{k}", ([1, 2, 3, 4, 5, 6, 7, 8, 9][: 5 + k % 5] if k % 2 else [])
                        + [100 * k + t for t in range(1, 4 + k)], 3 + k % 4) for k in range(12)]
    result = drive(m, KVCacheV2Scheduler(m, 4, 24), requests)
    assert result.stalled is None and len(result.finished) == len(requests)
    steps = [([(c.request.req_id, c.num_tokens) for c in out.scheduled], [r.req_id for r in out.admitted],
              [r.req_id for r in out.preempted]) for out in result.outputs]
    return [steps, m.stats(), [r.num_reused_tokens for r in requests]], took


def test_tied_one_pass_paths_schedule_as_the_per_group_paths_do(monkeypatch):
    fast, took = _driven(monkeypatch, True)
    slow, none = _driven(monkeypatch, False)
    assert took["finish"] and took["slide"] and took["claim"], took
    assert none == {"finish": 0, "slide": 0, "claim": 0}
    assert fast == slow
    assert sum(fast[2]) > 0  # hits were made


def test_a_tied_finish_gives_its_tail_s_pages_and_ids_back_as_a_release_does(monkeypatch):
    """A lazily keyed request that ends with draft tokens reserved past its full blocks: its one-pass finish parks
    the full blocks and frees the tail's logical blocks with their pages (the page arena's finish wrote a tied
    arena's page list with logical ids): every page is free or owned once, and the freed pages serve the next
    request, whose KV reads back."""
    m = _tied_manager(8, 6)
    took = _paths(m, True)
    arena = m._arena
    r = Request("r", list(range(1, 11)), 2)  # 10 tokens, then 2: 3 full blocks
    prefill(m, r)
    for _ in range(2):
        r.output_token_ids.append(next_token(r))
        assert m.schedule_tokens(r, 1) == 1
        write_kv(m, r, r.num_computed_tokens, 1)
        m.commit(r, 1)
    r.draft_token_ids = [3] * 5  # blocks 3 and 4 (tokens 12-16): not committed, the tail a finish frees
    assert m.schedule_tokens(r, 5) == 5
    tail = [m.cache(r).tables[name][3:] for name in m._names]
    assert all(len(t) == 2 for t in tail)
    free_before = len(arena._free)
    m.free(r)
    assert took["finish"] == 1
    assert arena.check() == []
    m.check_invariants()
    for b in (b for t in tail for b in t):
        assert arena.pages[b] == () and arena.group_of[b] == -1 and b in arena._free_ids
    assert len(arena._free) == free_before + 2 * sum(arena.k)  # two logical blocks a group, k pages each
    other = Request("o", [900 + t for t in range(20)], 1)  # 30 pages: the free ones (the tail's) and evicted ones
    prefill(m, other)
    check_kv(m, other)
    m.check_invariants()


def test_a_tied_slide_is_one_logical_group_s_position_taken_in_one_pass(monkeypatch):
    """With the cuts tied a window set is one logical group (``len(got) == 1`` in ``_slide_parked``): each decode
    slide of a lazily keyed request parks and lets go of that one block (its 5 pages) in one pass, as many times
    as the window moves past a block."""
    m = _tied_manager(4, 10)
    took = _paths(m, True)
    assert [len(names) for *_, names, _ in m._arena_windows] == [1]
    r = Request("r", [1, 2, 3, 4, 5], 12)
    prefill(m, r)
    slid = took["slide"]
    for _ in range(12):
        r.output_token_ids.append(next_token(r))
        assert m.schedule_tokens(r, 1) == 1
        write_kv(m, r, r.num_computed_tokens, 1)
        m.commit(r, 1)
        check_kv(m, r)
        m.check_invariants()
    # committed 5 -> 17, the window (4) from token 2 to 14: blocks 0, 1 and 2 left it, one a decode step
    assert took["slide"] - slid == 3
    pending = m.cache(r).pending
    assert pending is not None and -1 not in pending.blocks["sliding_w4"][:3]  # parked under its pending prefix

