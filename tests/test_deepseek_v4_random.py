"""DeepSeek V4 on V2 under random seeded workloads: prompts sharing random prefixes cut around the window (8), the
compress rates (4, 8) and the reuse unit (8), small pools (preemption, eviction of cached prefixes, the host tier),
``n = 2`` forks, late arrivals and, in the serving loop, requests aborted midway. Every finished request's greedy
tokens are transformers' ``model.generate`` for its prompt alone; afterwards no side state or block is held, the
manager's invariants hold, snapshots never outnumber cached boundary blocks, and ``reset_prefix_cache`` leaves none.

Seeded ``random`` rather than Hypothesis: each example loads a model and pools (about a second), so a few fixed seeds
that each mix every feature cover more per second than shrinking would. The seeds are fixed for another reason too: a
preempted request recomputes its prompt and answer as one prefill, and transformers' own prefill of those tokens can
pick another token than its decode did where the two best logits nearly tie (serving seed 114: 0.0085 apart, where
kvload's recomputed request equals transformers' ``model.generate`` of the longer prompt): such a seed checks
nothing kvload controls."""

from __future__ import annotations

import functools
import random
import threading
from typing import Any

import pytest

from engine.sampling_params import SamplingParams
from tests.generate_support import greedy_admission, hf_greedy, load, used_blocks
from tests.serve_support import wait_for
from tests.test_deepseek_v4_generate import snapshots_within_cached_boundaries

V4 = "deepseek-v4"
VOCAB = 512
#: prefix cuts around the window, compress-rate and reuse-unit boundaries (the base prompts are 8 to 24 tokens)
CUTS = (0, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 23, 24)


@pytest.fixture(scope="module")
def v4_path(tiny_checkpoints):
    return tiny_checkpoints(V4)


@pytest.fixture(scope="module")
def reference(v4_path):
    """transformers' greedy tokens for a prompt alone, computed once per (prompt, length) for the module."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(v4_path)
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def want(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy(model, prompt, n)
        return cache[key]

    return want


def workload(rng: random.Random, count: int) -> list[list[int]]:
    """``count`` prompts, each a random cut of one of two random bases plus a random tail."""
    bases = [[rng.randrange(3, VOCAB) for _ in range(rng.choice((8, 16, 24)))] for _ in range(2)]
    prompts = []
    for _ in range(count):
        base = rng.choice(bases)
        cut = min(rng.choice(CUTS), len(base))
        prompts.append(base[:cut] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0 if cut else 1, 14))])
    return prompts


def check_manager(result: Any) -> None:
    """The V2 manager's own checks, as its tests run them every step (``tests/kv_v2_support.py``)."""
    manager = result.kv_manager
    manager.check_invariants()
    assert manager.usage() == manager.stats().usage


def check_idle(result: Any) -> None:
    """Nothing is held once every request ended: no side state, no block a request owns, the manager consistent,
    the snapshots within the cached boundary blocks, and none after a reset of the prefix cache."""
    executor = result.executor
    assert len(executor.v4) == 0
    assert used_blocks(result) == 0
    check_manager(result)
    snapshots_within_cached_boundaries(result)


def load_small(v4_path: Any, rng: random.Random) -> Any:
    """A V2 load with a random small budget (about two 64-token sequences), host tier and chunk size."""
    result = load(v4_path, "v2", max_tokens=rng.choice((96, 112, 128, 144)), max_seq_len=64,
                  max_num_tokens=rng.choice((8, 12, 16)), host_cache_size=rng.choice((0, 1 << 20)))
    if rng.random() < 0.5:  # admit without growth headroom: running requests then really run out of blocks
        greedy_admission(result)
    return result


#: seeds whose workloads suspend to the host tier (6, 11) and preempt (13, 15), besides reusing and evicting prefixes
@pytest.mark.parametrize("seed", (6, 11, 13, 15))
def test_random_generate_workloads_give_transformers_tokens_and_leave_nothing(v4_path, reference, seed):
    """Three ``generate`` calls per seed over one manager (later calls reuse, or find evicted, earlier prefixes)."""
    rng = random.Random(seed)
    result = load_small(v4_path, rng)
    try:
        executor = result.executor
        salts = random.Random(-seed)  # apart, so that the workloads stay what the seeds were picked for
        for _ in range(3):
            prompts = workload(rng, rng.randint(2, 6))
            n, new = rng.choice((1, 1, 2)), rng.randint(4, 14)
            outs = executor.run(prompts, SamplingParams(max_tokens=new, temperature=0.0, n=n),
                                salt=salts.choice((None, None, "other")),  # reuse only within a salt's scope
                                arrival_steps=[rng.randint(0, 4) for _ in prompts],
                                on_delta=lambda d: check_manager(result))
            for prompt, out in zip(prompts, outs, strict=True):
                assert [list(c.token_ids) for c in out.outputs] == [reference(prompt, new)] * n, prompt
            check_idle(result)
        assert executor.reset_prefix_cache("test")[0]
        assert len(executor.v4.snapshots) == 0
    finally:
        result.close()


@pytest.mark.parametrize("seed", range(3))
def test_random_serving_workloads_with_aborts_give_transformers_tokens_and_leave_nothing(v4_path, reference, seed):
    """The serving loop: single requests and two-choice groups submitted over time, some aborted after a random
    number of tokens (or a group's first choice at once); what finishes equals transformers, what was aborted is a
    prefix of it."""
    from engine.serving import ServingEngine

    rng = random.Random(100 + seed)
    result = load_small(v4_path, rng)
    engine = ServingEngine.from_result(result)
    ends: dict[str, Any] = {}
    lock = threading.Lock()

    def sink(key: str, abort_after: int | None, event: Any) -> None:
        if event.finished:
            with lock:
                ends[key] = event
        elif abort_after is not None and len(event.token_ids) >= abort_after:
            engine.abort(event.req_id)

    try:
        engine.start()
        wanted: dict[str, tuple[list[int], int]] = {}
        for i, prompt in enumerate(workload(rng, 6)):
            new = rng.randint(2, 10)
            params = SamplingParams(max_tokens=new, temperature=0.0)
            cut = rng.choice((None, None, 1, 2))
            if rng.random() < 0.3:
                keys = [f"{i}.{j}" for j in (0, 1)]
                ids = engine.submit_group(prompt, params, [functools.partial(sink, k, cut if j else None)
                                                           for j, k in enumerate(keys)])
                if rng.random() < 0.3:  # the first choice leaves, likely before its prefill: the next prefills
                    engine.abort(ids[0])
            else:
                keys = [str(i)]
                engine.submit(prompt, params, functools.partial(sink, keys[0], cut))
            for key in keys:
                wanted[key] = (prompt, new)
            if rng.random() < 0.5:  # the next one arrives while this one runs
                wait_for(lambda: bool(ends) or engine.steps > 0, what="a step")
        wait_for(lambda: len(ends) == len(wanted), what="every request to end")
        for key, (prompt, new) in wanted.items():
            event, want = ends[key], reference(prompt, new)
            assert event.finish_reason in ("length", "abort", "stop"), (key, event)
            got = list(event.token_ids)
            assert got == (want[:len(got)] if event.finish_reason == "abort" else want), (key, prompt)
        wait_for(lambda: len(result.executor.v4) == 0, what="side state dropped")
        with engine.state_lock:
            check_idle(result)
            assert result.executor.reset_prefix_cache("test")[0]
            assert len(result.executor.v4.snapshots) == 0
    finally:
        engine.stop(60)
        result.close()


def test_an_abort_that_ends_the_last_request_drops_the_snapshots_of_its_uncached_blocks(v4_path):
    """Found by the random serving test: two requests with one 8-token prompt computed in the same step both snapshot
    its boundary (one window block cached, the other's a duplicate only its request holds); the first ends by length,
    the second is aborted, with no step after it. Its duplicate block leaves the cache with it, and so must the
    snapshot kept with that block: idle, the snapshots never outnumber the cached boundary blocks."""
    from engine.serving import ServingEngine

    result = load(v4_path, "v2", max_tokens=256, max_seq_len=48)
    engine = ServingEngine.from_result(result)
    ends: dict[str, Any] = {}

    def sink(key: str, event: Any) -> None:
        if event.finished:
            ends[key] = event
        else:
            engine.abort(event.req_id)

    try:
        prompt = list(range(10, 18))
        engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0), functools.partial(sink, "done"))
        engine.submit(prompt, SamplingParams(max_tokens=9, temperature=0.0), functools.partial(sink, "aborted"))
        engine.start()  # both join the first step
        wait_for(lambda: len(ends) == 2, what="both requests to end")
        assert ends["aborted"].finish_reason == "abort"
        wait_for(lambda: len(result.executor.v4) == 0, what="side state dropped")
        with engine.state_lock:
            check_idle(result)
    finally:
        engine.stop(60)
        result.close()


def test_a_failed_generate_call_drops_the_snapshots_of_the_blocks_it_left_uncached(v4_path):
    """``generate``'s counterpart: a call whose ``on_delta`` raises after the first step (two requests with one
    8-token prompt, each snapshotting its boundary) frees its requests' blocks with no step after; the snapshot of
    the duplicate block that left the cache goes too."""
    result = load(v4_path, "v2", max_tokens=256, max_seq_len=48)

    def fail(delta: Any) -> None:
        raise KeyboardInterrupt

    try:
        prompt = list(range(10, 18))
        with pytest.raises(KeyboardInterrupt):
            result.executor.run([prompt, prompt], max_tokens=5, temperature=0.0, on_delta=fail)
        check_idle(result)
    finally:
        result.close()


def test_a_lookup_through_cached_blocks_without_snapshots_hashes_no_prefix(v4_path, monkeypatch):
    """The manager asks, for each reuse boundary down from the longest cached one, whether a snapshot is kept there;
    where none is (here its snapshots were dropped by hand) the answer must not hash the
    prompt's prefix each time (2 ms per boundary at 32k tokens, every lookup of every waiting request): the only
    hashes are of the boundaries the prompt's own forward files, nothing is reused, the tokens are transformers'."""
    import engine.v4_side_state

    result = load(v4_path, "v2", max_tokens=256, max_seq_len=64)
    try:
        prefix = list(range(10, 58))
        result.generate([prefix], max_new_tokens=2)
        result.executor.v4.snapshots.clear()
        hashed: list[int] = []
        digest = engine.v4_side_state.prefix_digest
        monkeypatch.setattr(engine.v4_side_state, "prefix_digest",
                            lambda salt, tokens: hashed.append(len(tokens)) or digest(salt, tokens))
        prompt = [*prefix, 5, 6, 7]
        (out,) = result.generate([prompt], max_new_tokens=3)
        assert result.executor.last_stats.reused_prompt_tokens == 0
        assert out.token_ids == hf_greedy(result.hf_model, prompt, 3)
        assert hashed == list(range(8, 49, 8)), "hashed where no snapshot is (only its own new ones are filed)"
    finally:
        result.close()
