"""What a KV-aware router rebuilds from the KV cache events on models of several layer groups (V2): Gemma 3's sliding
windows (a block leaving the window kept cached, ``enable_swa_scratch_reuse`` on, or freed at once, off), DeepSeek
V4's compressed groups (blocks of 128 tokens beside 16-token ones; ``pool_arena`` on and off), and a partial block
copied into a new one (``enable_partial_reuse``). After every step the per-group sets equal the cache, the stream keeps
its invariants, and the hit a router predicts by vLLM's hybrid rule (full groups: the whole prefix; a sliding group:
the blocks its window reads) is the manager's whole-block hit, a lower bound of what a partial copy adds; also read off
the wire as a vLLM consumer decodes it (``block_size``, ``group_idx``, ``kv_cache_spec_sliding_window``)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipeline
from cache_backends.request import Request
from engine.driver import Driver
from tests.kv_router_support import Router, manager_sets, mismatch, predict_hit
from tests.test_kv_events_router import _drive

T = 16
#: (model, kv_cache_config, hf_overrides, max_seq_len, prefix lengths, extra tokens): a 48-token window so that
#: prompts slide it, kept or freed; V4's compressed groups with prompts past its 128-token reuse unit
SETUPS = {
    "gemma3-window-kept": ("tiny-gemma3", {"max_tokens": 192, "enable_swa_scratch_reuse": True},
                           {"sliding_window": 48}, 256, (8, 16, 24, 40), 40),
    "gemma3-window-freed": ("tiny-gemma3", {"max_tokens": 192, "enable_swa_scratch_reuse": False},
                            {"sliding_window": 48}, 256, (8, 16, 24, 40), 40),
    "v4-arena": ("tiny-deepseek-v4", {"max_tokens": 2048, "pool_arena": True}, None, 512, (130, 150, 200, 260), 140),
    "v4-split": ("tiny-deepseek-v4", {"max_tokens": 2048, "pool_arena": False}, None, 512, (130, 150, 200, 260), 140),
    "v4-arena-window-freed": ("tiny-deepseek-v4", {"max_tokens": 2048, "pool_arena": True,
                                                   "enable_swa_scratch_reuse": False}, None, 512, (130, 150, 200, 260),
                              140),
}


def _load(setup: str, **kv):
    model, config, hf, seq_len, _, _ = SETUPS[setup]
    config = {"tokens_per_block": T, "use_kv_cache_manager_v2": True, "event_buffer_max_size": 1 << 16, **config, **kv}
    return pipeline.load(model, kv_cache_config=config, max_seq_len=seq_len, log=False, scheduling_policy="priority",
                         max_num_tokens=32, **({"hf_overrides": hf} if hf else {}))


def _specs(m) -> list[tuple[str, int, int | None]]:
    return [(g.name, g.tokens_per_block, g.window) for g in m.layout.groups]


@pytest.mark.parametrize("setup", sorted(SETUPS))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False))
def test_a_router_follows_every_layer_group_and_predicts_the_hybrid_hit(setup, rng):
    *_, lengths, extra = SETUPS[setup]
    with _load(setup) as r:
        assert _drive(r, rng, 40, lengths, extra, turns=True) == []


def _run(driver: Driver, req: Request) -> None:
    driver.add(req)
    while driver.has_work:
        driver.step(lambda out: {c.request.req_id: 7 for c in out.scheduled
                                 if c.request.num_computed_tokens + c.num_tokens >= c.request.num_tokens})


@pytest.mark.parametrize(("setup", "hit"), [("gemma3-window-kept", 64), ("gemma3-window-freed", 0)])
def test_a_block_leaving_the_window_is_kept_or_removed_in_that_group_alone(setup, hit):
    """A 100-token prompt decoded past it (112 tokens computed, 7 whole blocks): kept (scratch reuse), the window
    groups still hold every block, so a prompt sharing 64 tokens hits 64; freed, the window groups' events remove the
    blocks before the last window (the full group keeps them), so that prompt hits nothing: the window it needs is gone.
    A router that matched the full group alone would predict 64 there. The next turn (the 112 tokens and more) hits
    112 either way, its window (blocks 4-6) still held: a router that asked a window group for the whole prefix would
    predict nothing there. vLLM's hybrid rule predicts what the manager finds in all four."""
    with _load(setup) as r:
        m, router = r.kv_manager, Router()
        prompt = list(range(100, 200))
        first = Request("a", prompt, 13)
        _run(Driver(m, r.scheduler), first)
        router.feed(m.kv_events.drain())
        assert router.problems == [] and mismatch(router, m) is None
        assert len(router.cached["full"]) == 7  # the prompt's and the decode's whole blocks
        for name, _, window in _specs(m):
            if window is not None:  # freed: the blocks its last window reads are left (blocks 4-6: tokens 64-111)
                assert len(router.cached[name]) == (7 if hit else 3), name
        probe = Request("b", [*prompt[:64], 1, 2, 3, 4, 5], 1)
        assert router.hit_tokens("full", probe.all_token_ids, T) == 64  # the full group alone
        assert predict_hit(router, _specs(m), probe.all_token_ids, T, m.reuse_unit) == hit == m.cached_prefix_tokens(
            probe)
        turn = Request("c", [*first.all_token_ids, 1, 2, 3, 4, 5], 1)
        assert predict_hit(router, _specs(m), turn.all_token_ids, T, m.reuse_unit) == 112 == m.cached_prefix_tokens(
            turn)


@pytest.mark.parametrize("setup", ["llama", "gemma3-window-kept"])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False))
def test_a_whole_block_router_predicts_a_lower_bound_of_a_partial_hit(setup, rng):
    """``enable_partial_reuse``: a prompt that parts from a cached block inside it gets that block's shared tokens
    copied into a block of its own. The copy is no cached block (no event until it fills, under its own tokens'
    hash), so a router matching whole blocks predicts the whole-block hit: the manager's lookup, and at most a block
    below the hit the request reports (vLLM has no partial hit to say more)."""
    if setup == "llama":
        kv = {"max_tokens": 160, "tokens_per_block": T, "use_kv_cache_manager_v2": True,
              "event_buffer_max_size": 1 << 16, "enable_partial_reuse": True}
        r = pipeline.load("tiny-llama", kv_cache_config=kv, max_seq_len=256, log=False, max_num_tokens=24)
    else:
        r = _load(setup, enable_partial_reuse=True)
    with r:
        m, router = r.kv_manager, Router()
        driver = Driver(m, r.scheduler)
        prefixes = [[rng.randrange(1, 50) for _ in range(rng.choice([20, 40, 70]))] for _ in range(3)]
        for n in range(10):
            prompt = list(rng.choice(prefixes))
            prompt = (prompt[:rng.randrange(1, len(prompt) + 1)] + [rng.randrange(1, 50) for _ in range(30)])[:120]
            req = Request(f"r{n}", prompt, rng.randrange(1, 12), salt=rng.choice([None, "tenant"]))
            predicted = predict_hit(router, _specs(m), prompt, T, m.reuse_unit, req.salt)
            assert predicted == m.cached_prefix_tokens(req), n
            _run(driver, req)
            router.feed(m.kv_events.drain())
            assert router.problems == [] and mismatch(router, m) is None, n
            assert predicted <= req.num_cached_tokens < predicted + T, n


def _from_wire(batches: list, specs: dict[str, tuple[str, int, int | None]]) -> list[dict]:
    """The events of vLLM's decoded ``KVEventBatch`` messages as the router's, each group named by its
    ``group_idx`` and described (``specs``) by what the wire says of it: ``block_size`` and
    ``kv_cache_spec_sliding_window``."""
    from tests.test_serve_kv_publisher import BlockRemoved, BlockStored

    out = []
    for _, batch in batches:
        for e in batch.events:
            if isinstance(e, BlockStored):
                group = str(e.group_idx)
                specs[group] = (group, e.block_size, e.kv_cache_spec_sliding_window)
                salt = e.extra_keys[0][0] if e.extra_keys and e.extra_keys[0] else None
                parent = None if e.parent_block_hash is None else str(e.parent_block_hash)
                out.append({"type": "kv_block_stored", "block_hashes": [str(h) for h in e.block_hashes],
                            "parent_block_hash": parent, "token_ids": e.token_ids, "tokens_per_block": e.block_size,
                            "layer_group": group, "cache_salt": salt})
            elif isinstance(e, BlockRemoved):
                out.append({"type": "kv_block_removed", "block_hashes": [str(h) for h in e.block_hashes],
                            "layer_group": str(e.group_idx)})
            else:
                out.append({"type": "kv_all_blocks_cleared"})
    for seq, e in enumerate(out, 1):
        e["seq"] = seq
    return out


@pytest.mark.parametrize("setup", ["gemma3-window-freed", "v4-arena", "v4-split"])
def test_the_wire_tells_a_vllm_consumer_each_groups_blocks_and_their_size(setup):
    """Through vLLM's publisher (msgpack decoded into vLLM's structs, from the replay endpoint): a compressed group's
    ``BlockStored`` has ``block_size`` 128 and 128 token ids a block, its parent the group's block before; a router
    keyed by ``group_idx`` that reads each group's ``block_size`` and sliding window off the wire holds the cache
    (the 64-bit hashes vLLM sends) and predicts every prompt's hit by vLLM's hybrid rule."""
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    from kvload.serve.kv_publisher import MASK64, KvEventsConfig, ZmqKvEventPublisher
    from tests.test_serve_kv_publisher import _replayed

    address = f"inproc://hunt69-{setup}"
    config = KvEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"inproc://hunt69-pub-{setup}",
                            replay_endpoint=address)
    publisher = ZmqKvEventPublisher(config)
    *_, lengths, extra = SETUPS[setup]
    try:
        with _load(setup) as r:
            m = r.kv_manager
            publisher.attach(m.layout)
            m.kv_events.publisher = publisher
            rng = random.Random(69)
            assert _drive(r, rng, 30, lengths, extra) == []
            lo, *cuts = (40, 60, 100, 150) if setup.startswith("gemma3") else (140, 150, 260, 300)
            prompts = [[rng.randrange(1, 500) for _ in range(cuts[-1])] for _ in range(2)]
            driver = Driver(m, r.scheduler)
            for n, prompt in enumerate(prompts * 2):
                _run(driver, Request(f"p{n}", prompt[:rng.randrange(lo, cuts[-1])], 4))
            want = m.kv_events.drain()["events"][-1]["seq"]
            for _ in range(100):  # the publishing thread sends what the steps queued within a few ms
                batches = _replayed(address)
                if sum(len(b.events) for _, b in batches) >= want:
                    break
            specs: dict[str, tuple[str, int, int | None]] = {}
            router = Router()
            router.feed({"events": _from_wire(batches, specs), "dropped": 0})
            assert router.problems == []
            index = {g.name: str(i) for i, g in enumerate(m.layout.groups)}
            cached = {index[g]: {str(int(h[-16:], 16) & MASK64) for h in hs} for g, hs in manager_sets(m).items()}
            assert router.sets() == cached
            assert set(specs) == set(index.values())  # every group stored blocks
            for name, g in zip(index.values(), m.layout.groups, strict=True):
                assert specs[name][1:] == (g.tokens_per_block, g.window), g.name
            unit = math.lcm(*(tpb for _, tpb, _ in specs.values()))  # vLLM aligns a hybrid hit so
            assert unit == m.reuse_unit
            for prompt in prompts:
                for cut in cuts:
                    req = Request("probe", prompt[:cut], 1)
                    assert predict_hit(router, list(specs.values()), req.all_token_ids, T, unit) == \
                        m.cached_prefix_tokens(req), (cut, setup)
    finally:
        publisher.close()
