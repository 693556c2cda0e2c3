"""KV cache events with a shared arena's cuts tied (``cache_backends.v2.manager.TIE_CUTS``: BENCHMARKS.md "tie57c",
"tie58a"): a consumer of the events (vLLM-style KV events, a prefix-aware router) must not tell the tie from the page
arena of the cuts. Each logical block's store and removal goes out once per cut of its family, with the page arena's
hashes, parent, token ids, cut name and medium, in the page arena's order, through stores, hits, evictions, window
slides, the host tier's suspend / resume and resets."""

from __future__ import annotations

import random

import pytest

from cache_backends import LayerKV
from cache_backends.interface import PrefixCacheInUseError
from cache_backends.kv_events import CLEARED, REMOVED, STORED, KvEventBuffer
from cache_backends.request import Request
from tests.kv_v2_support import make_manager

T = 4
MAX_SEQ = 40

#: shared arenas whose groups are cut: tiny-gemma3's shape (five 1-layer sliding cuts, one full group), and three
#: families (two sliding cuts of 2 layers, three full cuts of 2 layers, an uncut sliding group of another window)
LAYOUTS = {
    "tiny-gemma3": [LayerKV(i, "sliding", 4, window=6) for i in range(5)] + [LayerKV(5, "full", 4)],
    "three families": [LayerKV(i, "sliding", 4, window=6) for i in range(4)]
    + [LayerKV(4 + i, "full", 4) for i in range(6)] + [LayerKV(10 + i, "sliding", 4, window=10) for i in range(2)],
}
TIED_CUTS = {
    "tiny-gemma3": [[f"sliding_w6.{i}" for i in range(5)], ["full"]],
    "three families": [["sliding_w6.0", "sliding_w6.1"], ["full.0", "full.1", "full.2"], ["sliding_w10"]],
}
OPS = ["new"] * 3 + ["grow"] * 4 + ["decode"] * 2 + ["fork", "free", "preempt", "readmit", "cancel", "suspend",
                                                     "resume", "reset", "priority", "flush"]


def _twins(monkeypatch, layout: str, blocks: int, **options) -> tuple:
    """The page arena of ``layout``'s cuts and their tie, each recording KV events into a buffer of its own."""
    out = []
    for tie in ("0", "1"):
        monkeypatch.setattr("cache_backends.v2.manager.TIE_CUTS", tie == "1")
        m = make_manager(LAYOUTS[layout], blocks, T=T, max_seq_len=MAX_SEQ, **options)
        out.append(m)
    cuts, tied = out
    assert cuts._tied_cuts is None and tied._tied_cuts == TIED_CUTS[layout]  # the tie is on, and only on one side
    return cuts, tied


def _events(buffer: KvEventBuffer) -> list[dict]:
    """What a consumer reads: every drained event less its sequence number and time (the tie's are its own)."""
    return [{k: v for k, v in e.items() if k not in ("seq", "ts")} for e in buffer.drain()["events"]]


def _run(m, r: Request, n: int) -> bool:
    if not m.allocate(r, n):
        return False
    m.commit(r, n)
    return True


def _differential(monkeypatch, seed: int) -> list[dict]:
    """A random mix of admissions, prefills, decodes, hits, forks, evictions, suspends and resets on both twins, their
    answers, stats and event streams compared after every step; the events heard, for the caller's coverage check."""
    rng = random.Random(seed)
    layout = sorted(LAYOUTS)[seed % len(LAYOUTS)]
    options = {"enable_partial_reuse": rng.random() < 0.7, "enable_swa_scratch_reuse": rng.random() < 0.7,
               "host_cache_size": rng.choice([0, 0, 1 << 16])}
    blocks = rng.choice([6, 8, 12])
    ms = _twins(monkeypatch, layout, blocks, **options)
    lives: list[list[Request]] = [[], []]
    buffers = [KvEventBuffer(1 << 16), KvEventBuffer(1 << 16)]
    events_at = rng.randrange(20) if rng.random() < 0.3 else 0  # now and then switched on mid-run
    seen: list[list[int]] = []
    heard: list[dict] = []
    n_ops = rng.randrange(40, 120)
    for n_op in range(n_ops):
        op = "events" if n_op == events_at else rng.choice(OPS)
        pick, first, priority = rng.randrange(1000), rng.randrange(12), rng.randrange(3)
        tokens = [rng.randrange(3) for _ in range(rng.randrange(0, 12))]
        salt, k = rng.choice([None, None, "s"]), rng.randrange(1, 10)
        if op in ("new", "fork"):
            prompt = (seen[pick % len(seen)][: 1 + pick % len(seen[pick % len(seen)])] + tokens
                      if seen and pick % 2 else [first, *tokens])[:32]
        answers = []
        for side, (m, live, buffer) in enumerate(zip(ms, lives, buffers, strict=True)):
            answer = None
            if op == "new":
                r = Request(f"r{n_op}", list(prompt), 8, salt=salt, priority=priority)
                m.create(r)
                answer = (m.resume(r), r.num_computed_tokens)  # a hit's reused tokens
                live.append(r)
            elif op == "fork":  # a prompt computed whole, then a sample of it forked (its partial blocks copied)
                r = Request(f"p{n_op}", list(prompt), 8, salt=salt, priority=priority)
                m.create(r)
                answer = [m.resume(r)]
                live.append(r)
                n = r.num_prompt_tokens - r.num_computed_tokens
                if n and _run(m, r, n):
                    child = Request(f"c{n_op}", list(prompt), 8, salt=salt, priority=priority)
                    answer.append(m.fork(r, child))
                    if answer[-1]:
                        live.append(child)
            elif op == "events":
                m.enable_kv_events(buffer)
            elif op == "reset":
                try:
                    m.reset_prefix_cache()
                    answer = "reset"
                except PrefixCacheInUseError:
                    answer = "refused"
                    if pick % 3 == 0:
                        for r in live:
                            m.free(r)
                        live.clear()
                        m.reset_prefix_cache()
            elif op == "flush":  # a long request evicting many cached blocks in one allocation, then let go
                r = Request(f"f{n_op}", [100 + first] + [7] * (MAX_SEQ - 1), 0, salt=salt, priority=priority)
                m.create(r)
                m.resume(r)
                answer = m.fit_tokens(r, MAX_SEQ - 1)
                if answer:
                    _run(m, r, answer)
                m.free(r)
            elif op == "decode":  # a token for every running request: their windows slide in turns
                answer = []
                for r in live:
                    cache = m.cache(r)
                    if cache.is_active and r.num_tokens < MAX_SEQ:
                        r.output_token_ids.append(first % 3)
                        answer.append(_run(m, r, r.num_tokens - cache.committed))
            elif live:
                r = live[pick % len(live)]
                cache = m.cache(r)
                if op == "grow" and cache.is_active:
                    r.output_token_ids.extend(tokens[:max(0, MAX_SEQ - r.num_tokens)])
                    n = min(k, r.num_tokens - cache.committed)
                    answer = bool(n) and _run(m, r, n)
                    if answer and side == 0:
                        seen.append(list(r.all_token_ids[: cache.committed]))
                elif op in ("free", "preempt"):
                    (m.free if op == "free" else m.preempt)(r)
                    live.remove(r)
                elif op == "readmit" and cache.is_active:
                    m.preempt(r)
                    m.create(r)
                    answer = (m.resume(r), r.num_computed_tokens)
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
        where = f"seed {seed} ({layout}, {options}, {blocks} pages per cut): op {n_op} ({op})"
        assert answers[0] == answers[1], where
        cuts, tied = ms
        assert cuts.stats().groups == tied.stats().groups, where
        got = [_events(b) for b in buffers]
        assert got[0] == got[1], where
        heard += got[0]
        tied.check_invariants()
    return heard


def test_a_tied_arena_s_kv_events_are_the_page_arena_s_through_random_runs(monkeypatch):
    """Random runs on tiny-gemma3's shape and on three families of cuts (stores, hits, evictions, window slides,
    forks, suspends with and without a host tier, resets, events switched on mid-run): after every step the tie's event
    stream is the page arena's, event for event."""
    heard: list[dict] = []
    for seed in range(24):
        heard += _differential(monkeypatch, seed)
    kinds = {e["type"] for e in heard}
    assert kinds == {STORED, REMOVED, CLEARED}  # every kind of event went by
    groups = {e["layer_group"] for e in heard if e["type"] != CLEARED}
    assert groups == {name for cuts in [*TIED_CUTS.values()] for family in cuts for name in family}


def _prefill(m, r: Request) -> None:
    m.create(r)
    assert m.resume(r)
    assert _run(m, r, r.num_tokens - r.num_computed_tokens)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_cut_hears_a_tied_block_stored_slid_out_hit_evicted_written_back_and_cleared(monkeypatch, layout):
    """One scripted life on both twins: a prompt's blocks stored (one event per cut, each cut's name), a decode
    sliding its window (the sliding cuts' blocks leave), a second request hitting the prefix (nothing new stored for
    it), a suspend to the host tier whose cached blocks others evict (removed, per cut), a resume, a reset
    (cleared): the same events, in the same order, from the tie as from the page arena."""
    streams = []
    for m in _twins(monkeypatch, layout, 8, host_cache_size=1 << 16):
        buffer = KvEventBuffer(1 << 16)
        m.enable_kv_events(buffer)
        a = Request("a", list(range(1, 14)), 8)
        _prefill(m, a)
        stored = _events(buffer)
        for _ in range(6):  # decodes: the window slides past a's first blocks
            a.output_token_ids.append(3)
            assert _run(m, a, 1)
        slid = _events(buffer)
        b = Request("b", [*range(1, 14), 20, 21], 4)
        _prefill(m, b)
        hit = b.num_computed_tokens
        after_hit = _events(buffer)
        assert m.suspend(a)
        for i in range(4):  # others fill the arena: cached blocks (a's among them) are evicted
            o = Request(f"o{i}", [50 + 10 * i + t for t in range(13)], 4)
            _prefill(m, o)
            m.free(o)
        evicted = _events(buffer)
        assert m.resume(a)
        m.free(a)
        m.free(b)
        m.reset_prefix_cache()
        streams.append({"stored": stored, "slid": slid, "hit": hit, "after_hit": after_hit, "evicted": evicted,
                        "end": _events(buffer), "evictions": m.stats().evictions})
    cuts, tied = streams
    assert tied == cuts
    names = [name for family in TIED_CUTS[layout] for name in family]
    # the prompt's 3 full blocks: one store per cut, cut by cut in the layout's order, each carrying the same chain
    assert [e["layer_group"] for e in cuts["stored"]] == names
    assert len({(tuple(e["block_hashes"]), tuple(e["token_ids"])) for e in cuts["stored"]}) == 1
    assert cuts["hit"] > 0 and cuts["evictions"] > 0
    assert any(e["type"] == REMOVED for e in cuts["evicted"])
    assert cuts["end"][-1] == {"type": CLEARED}
