"""DeepSeek V4 generates on KV cache manager V2: token-equal to transformers, with its window and compressed entries in
the pools, its compressor side state dropped when a request finishes, and shared prefixes reused from snapshots of
that state."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import kvload
from cache_backends.layout import build_layout, cannot_generate
from cache_backends.paged_attention import PagedBatch, SeqChunk
from cache_backends.pools import BlockPools
from models.deepseek_v4_paged import V4States, step_states
from models.geometry import layers_from_config
from models.paged_forward import route_paged_attention, run_forward
from pipeline.errors import GenerationError
from tests.generate_support import greedy_admission, hf_greedy, load, prompts_for, used_blocks
from tests.paged_support import WINDOW, tiny_config
from tests.serve_support import wait_for

V4 = "deepseek-v4"
#: past the window (8) and several CSA (4) and HCA (8) windows, one shorter than a compressed window
LENGTHS = (21, 5, 34, 2)


@pytest.fixture(scope="module")
def v4_path(tiny_checkpoints):
    return tiny_checkpoints(V4)


@pytest.fixture(scope="module")
def v4_result(v4_path):
    result = load(v4_path, "v2", max_tokens=1024, max_seq_len=64, max_num_tokens=16)
    yield result
    result.close()


def test_greedy_tokens_equal_transformers_generate_on_v2_with_chunked_prefill(v4_result):
    """Four prompts packed in one forward per step, prefilled in chunks of 16 tokens over 4-token blocks: every token is
    transformers' own greedy token (its DynamicCache, compressor and indexer)."""
    model = v4_result.hf_model
    prompts = prompts_for(model.config.vocab_size, LENGTHS)
    outs = v4_result.generate(prompts, max_new_tokens=12)
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 12) for p in prompts]


def test_a_finished_request_leaves_no_block_and_no_side_state(v4_result):
    """While requests run the executor holds their compressor side state; once they finish, neither blocks nor side
    state are left (blocks that left the window were released on the way: a read of one would have failed)."""
    executor = v4_result.executor
    held = []
    prompts = prompts_for(v4_result.hf_model.config.vocab_size, (30, 9), seed=7)
    executor.run(prompts, max_tokens=6, temperature=0.0, on_delta=lambda d: held.append(len(executor.v4)))
    assert max(held) == 2
    assert len(executor.v4) == 0
    assert used_blocks(v4_result) == 0


def test_the_slab_arena_generates_the_split_pools_tokens_while_slabs_pass_between_groups(v4_path, monkeypatch):
    """``pool_arena: true`` on real pools: every group's blocks are views of one tensor no larger than the budget, and
    under a budget of 15 slabs six prompts run with slabs passing from one group to another (a slab the window group
    held is later carved into compressed entries, and back), requests preempted: every token is the split pools' and
    transformers' own, and the plan and the audit say the arena was built."""
    from cache_backends.v2.slab_pool import SlabPool

    owners: dict[int, set[str]] = {}
    take = SlabPool.take_slab

    def taken(pool: SlabPool, s: int) -> None:
        owners.setdefault(s, set()).add(pool.name)
        take(pool, s)

    monkeypatch.setattr(SlabPool, "take_slab", taken)
    tokens = {}
    for arena in (False, True):
        result = load(v4_path, "v2", max_tokens=144, max_seq_len=64, pool_arena=arena)
        try:
            greedy_admission(result)
            prompts = prompts_for(result.hf_model.config.vocab_size, (21, 5, 34, 2, 17, 30))
            tokens[arena] = [o.token_ids for o in result.generate(prompts, max_new_tokens=14)]
            pools, plan = result.kv_manager.pools, result.kv
            (built,) = result.audit.of("kv_manager_built")
            if not arena:
                assert plan.arena_slabs is None and pools.arena is None
                continue
            want = [hf_greedy(result.hf_model, p, 14) for p in prompts]
            assert plan.arena_slabs == pools.slabs and "memory: one slab arena of" in "\n".join(plan.render())
            assert all(g["blocks"] is None for g in built["groups"].values())
            storage = pools.arena.untyped_storage()
            assert {t.untyped_storage().data_ptr() for t in pools.tensors.values()} == {storage.data_ptr()}
            assert storage.nbytes() == built["total_bytes"] == pools.slabs * pools.slab_bytes
            assert storage.nbytes() <= plan.budget.budget_bytes
            counters = result.kv_manager.stats().arena
            assert counters["slabs_reclaimed"] > 0 and result.executor.last_stats.preemptions > 0
            assert any(len(groups) > 1 for groups in owners.values())
            assert used_blocks(result) == 0 and len(result.executor.v4) == 0
        finally:
            result.close()
    assert tokens[True] == tokens[False] == want


@pytest.mark.parametrize(("host", "moved"), [(0, "preemptions"), (1 << 20, "suspends")])
def test_a_preempted_or_suspended_request_continues_with_the_right_side_state(v4_path, host, moved):
    """Under a budget too small for six requests at once, a preempted request recomputes from position 0 with a fresh
    side state, and one suspended to the host tier resumes with the state it had: every token is still transformers'."""
    result = load(v4_path, "v2", max_tokens=144, max_seq_len=64, host_cache_size=host)
    try:
        greedy_admission(result)
        prompts = prompts_for(result.hf_model.config.vocab_size, (21, 5, 34, 2, 17, 30))
        outs = result.generate(prompts, max_new_tokens=14)
        assert getattr(result.executor.last_stats, moved) > 0
        assert [o.token_ids for o in outs] == [hf_greedy(result.hf_model, p, 14) for p in prompts]
        assert used_blocks(result) == 0 and len(result.executor.v4) == 0
    finally:
        result.close()


def test_the_pools_hold_the_window_keys_and_the_compressed_entries(v4_path):
    """One prefill through run_forward: each layer's window group holds the raw K (== V) of the window's tokens at the
    request's slots, each compressed group the compressor's (and CSA's indexer's) entries, equal to what transformers'
    cache layers hold; the partial window is the request's side state. A decode with the blocks before the window
    released (-1) then gives transformers' next logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(v4_path, dtype=torch.float32)
    cfg = model.config
    prompt = prompts_for(cfg.vocab_size, (21,))[0]
    with torch.inference_mode():
        ref = model(torch.tensor([prompt]), use_cache=True)
    cache = ref.cache
    layout = build_layout(layers_from_config(cfg), "v2", 4, "float32")
    pools = BlockPools(layout, {g.name: 16 for g in layout.groups}, "cpu")
    # blocks handed out backwards, so a slot is not its position by accident
    tables = {g.name: list(range(15, 15 - (32 // g.tokens_per_block) - 1, -1)) for g in layout.groups}
    route_paged_attention(model)
    states = V4States()
    batch = PagedBatch.build([SeqChunk(prompt, 0, tables)], pools)
    step_states(batch, states, ["r"])
    logits = run_forward(model, batch)
    torch.testing.assert_close(logits[0], ref.logits[0, -1], rtol=1e-4, atol=1e-4)
    state = states.states["r"]
    assert state.pos == len(prompt)
    hd = cfg.head_dim
    for i, ref_layer in enumerate(cache.layers):
        for name, pos in pools.layer_index[i]:
            g = pools.groups[name]
            view = pools.layer_slots(name, pos)
            if g.compress_rate is None:  # the last W - 1 tokens, which transformers' sliding layer keeps
                kept = range(len(prompt) - ref_layer.keys.shape[2], len(prompt))
                slots = [tables[name][p // g.tokens_per_block] * g.entries_per_block + p % g.tokens_per_block
                         for p in kept]
                torch.testing.assert_close(view[slots], ref_layer.keys[0, 0])
                continue
            for series, cols in (("compressor", slice(0, hd)), ("indexer", slice(hd, None))):
                want = ref_layer.compressed_kv.get(series)
                if want is None:
                    continue
                entries = range(want.shape[1])
                slots = [tables[name][w * g.compress_rate // g.tokens_per_block] * g.entries_per_block
                         + w % g.entries_per_block for w in entries]
                torch.testing.assert_close(view[slots, cols], want[0])
                torch.testing.assert_close(state.layers[i][series].buf_kv, ref_layer.buffer_kv[series])
    nxt = int(logits[0].argmax())
    window = cfg.sliding_window
    for g in layout.groups:
        if g.window is not None:  # what the manager releases: blocks wholly before the next query's window
            for j in range((len(prompt) + 1 - window) // g.tokens_per_block):
                tables[g.name][j] = -1
    batch = PagedBatch.build([SeqChunk([nxt], len(prompt), tables)], pools)
    step_states(batch, states, ["r"])
    with torch.inference_mode():
        want = model(torch.tensor([[nxt]]), cache=cache, use_cache=True).logits[0, -1]
    torch.testing.assert_close(run_forward(model, batch)[0], want, rtol=1e-4, atol=1e-4)


def _apart_pools(cfg: Any, sequences: int, tokens: int) -> tuple[BlockPools, list[dict[str, list[int]]]]:
    """Pools for ``sequences`` sequences of up to ``tokens`` tokens, and each one's block tables: its blocks handed
    out backwards from its own range, so a slot of another sequence (or a padded one) is never right by accident."""
    layout = build_layout(layers_from_config(cfg), "v2", 4, "float32")
    per_seq = {g.name: -(-tokens // g.tokens_per_block) for g in layout.groups}
    pools = BlockPools(layout, {name: n * sequences for name, n in per_seq.items()}, "cpu")
    tables = [{name: list(range((b + 1) * n - 1, b * n - 1, -1)) for name, n in per_seq.items()}
              for b in range(sequences)]
    return pools, tables


def _count_attention_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The batch size of every call of transformers' V4 attention from now on (the list fills as they come)."""
    import transformers.models.deepseek_v4.modeling_deepseek_v4 as v4_modeling

    calls: list[int] = []
    eager = v4_modeling.eager_attention_forward

    def counted(module, query, *args, **kwargs):
        calls.append(query.shape[0])
        return eager(module, query, *args, **kwargs)

    monkeypatch.setattr(v4_modeling, "eager_attention_forward", counted)
    return calls


def test_a_decode_step_of_several_lengths_attends_in_one_call_per_layer_with_transformers_logits(v4_path, monkeypatch):
    """Five sequences (past the window or not, with CSA's top-k choosing among more entries than it keeps, or no
    compressed entry yet) decode four steps together: each step's attention is one call per layer for all of them
    (their keys padded to the longest), and every sequence's logits are transformers' own for that sequence, windows
    that close on the step included."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(v4_path, dtype=torch.float32)
    cfg = model.config
    lengths = (23, 5, 35, 2, 12)
    prompts = prompts_for(cfg.vocab_size, lengths, seed=13)
    pools, tables = _apart_pools(cfg, len(lengths), 48)
    route_paged_attention(model)
    states = V4States()
    ids = [f"r{b}" for b in range(len(lengths))]
    batch = PagedBatch.build([SeqChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)], pools)
    step_states(batch, states, ids)
    logits = run_forward(model, batch)
    caches = []
    with torch.inference_mode():
        for b, prompt in enumerate(prompts):
            ref = model(torch.tensor([prompt]), use_cache=True)
            torch.testing.assert_close(logits[b], ref.logits[0, -1], rtol=1e-4, atol=1e-4)
            caches.append(ref.cache)
    calls = _count_attention_calls(monkeypatch)
    positions = list(lengths)
    for _ in range(4):
        nxt = [int(row.argmax()) for row in logits]
        batch = PagedBatch.build([SeqChunk([t], p, tb) for t, p, tb in zip(nxt, positions, tables, strict=True)],
                                 pools)
        step_states(batch, states, ids)
        calls.clear()
        logits = run_forward(model, batch)
        assert calls == [len(lengths)] * cfg.num_hidden_layers  # one call per layer, every sequence in it
        with torch.inference_mode():
            for b, t in enumerate(nxt):
                want = model(torch.tensor([[t]]), cache=caches[b], use_cache=True).logits[0, -1]
                torch.testing.assert_close(logits[b], want, rtol=1e-4, atol=1e-4)
        positions = [p + 1 for p in positions]


@pytest.mark.parametrize("one_tile_a_call", [False, True])
def test_prefill_chunks_of_several_sequences_attend_together_with_transformers_logits(v4_path, monkeypatch,
                                                                                      one_tile_a_call):
    """Five prompts of different lengths prefill in one step (their CSA and HCA windows closing at different offsets,
    two past the window, one with no compressed entry yet), then three of them continue with chunks that start inside
    a compressed window beside two one-token decodes: a step's prefill chunks attend in one call per layer (a mixed
    step: one more for its decodes; or, with a budget of scores per call that fits one tile, one call per tile), and
    every sequence's logits are transformers' own for that sequence."""
    from transformers import AutoModelForCausalLM

    import models.deepseek_v4_paged as v4_paged

    if one_tile_a_call:
        monkeypatch.setattr(v4_paged, "CPU_SCORES_PER_CALL", 1)

    model = AutoModelForCausalLM.from_pretrained(v4_path, dtype=torch.float32)
    cfg = model.config
    firsts = (13, 6, 22, 3, 9)
    seconds = (11, 1, 7, 18, 1)
    chunks = prompts_for(cfg.vocab_size, firsts + seconds, seed=17)
    pools, tables = _apart_pools(cfg, len(firsts), 40)
    route_paged_attention(model)
    states = V4States()
    ids = [f"r{b}" for b in range(len(firsts))]
    calls = _count_attention_calls(monkeypatch)
    caches = [None] * len(firsts)
    starts = [0] * len(firsts)
    for step, lengths in enumerate((firsts, seconds)):
        part = chunks[step * len(firsts):(step + 1) * len(firsts)]
        batch = PagedBatch.build([SeqChunk(c[:n], s, t) for c, n, s, t in zip(part, lengths, starts, tables,
                                                                                strict=True)], pools)
        step_states(batch, states, ids)
        calls.clear()
        logits = run_forward(model, batch)
        tile = min(WINDOW, v4_paged.PREFILL_TILE)
        prefill_calls = sum(-(-n // tile) for n in lengths if n > 1) if one_tile_a_call else 1
        assert len(calls) == cfg.num_hidden_layers * (prefill_calls + (step > 0))
        with torch.inference_mode():
            for b, (c, n) in enumerate(zip(part, lengths, strict=True)):
                ref = model(torch.tensor([c[:n]]), cache=caches[b], use_cache=True)
                torch.testing.assert_close(logits[b], ref.logits[0, -1], rtol=1e-4, atol=1e-4)
                caches[b] = ref.cache
        starts = [s + n for s, n in zip(starts, lengths, strict=True)]


def test_prompts_prefilled_together_snapshot_their_own_side_state_for_reuse(v4_path):
    """Four prompts prefilled in one step each snapshot their side state at the reuse boundaries they cross; four
    prompts that share a prefix of each, prefilled together again, reuse it from that sequence's snapshot (not a
    neighbour's) and continue from different positions: every token is transformers' own."""
    result = load(v4_path, "v2", max_tokens=1024, max_seq_len=64, max_num_tokens=256)
    try:
        model = result.hf_model
        vocab = model.config.vocab_size
        firsts = prompts_for(vocab, (19, 30, 11, 26), seed=21)
        outs = result.generate(firsts, max_new_tokens=2)
        assert [o.token_ids for o in outs] == [hf_greedy(model, p, 2) for p in firsts]
        tails = prompts_for(vocab, (5, 3, 9, 2), seed=22)
        seconds = [p[:k] + t for p, k, t in zip(firsts, (18, 27, 10, 25), tails, strict=True)]
        outs = result.generate(seconds, max_new_tokens=6)
        assert result.executor.last_stats.reused_prompt_tokens == 16 + 24 + 8 + 24
        assert [o.token_ids for o in outs] == [hf_greedy(model, p, 6) for p in seconds]
    finally:
        result.close()


def snapshots_within_cached_boundaries(result: Any) -> int:
    """The executor's DeepSeek V4 snapshots, checked to be no more than the window group's cached blocks that end at
    a reuse boundary (what they are kept with); returns how many there are."""
    executor, manager = result.executor, result.kv_manager
    key, unit, T = executor._v4_key, manager.reuse_unit, manager.T
    cached = sum(1 for b in range(manager.pools.num_blocks[key])
                 if (at := manager.block_life(key, b)[1]) is not None and (at + 1) * T % unit == 0)
    held = len(executor.v4.snapshots)
    assert held <= cached
    return held


def test_a_shared_prefix_is_reused_from_its_snapshot_and_forked_samples_continue_the_prompts_state(v4_path):
    """A second prompt sharing 37 tokens with the first (past the window, over several CSA and HCA windows) reuses
    32 of them (the longest boundary of the reuse unit, 8 tokens, with a snapshot), a third that continues the first's
    conversation (its answer included) reuses more, and every token is transformers' own; reuse is not said ignored
    any more, drafts and the compiled attention are (once each); a prompt's second greedy sample, forked from the
    first, continues its side state; beam search is refused in one line; the snapshots go with the prefix cache."""
    events: list[dict] = []
    llm = kvload.LLM(str(v4_path), kv_cache_config={"tokens_per_block": 4, "max_tokens": 1024}, max_seq_len=96,
                     max_draft_len=2, attention_backend="flex", log=False, subscribers=[events.append])
    try:
        model = llm.result.hf_model
        first, tail, more = prompts_for(model.config.vocab_size, (40, 6, 5), seed=3)
        second = first[:37] + tail
        greedy = kvload.SamplingParams(max_tokens=8, temperature=0.0, n=2)
        (out,) = llm.generate([first], greedy, use_tqdm=False)
        answer = hf_greedy(model, first, 8)
        assert [list(c.token_ids) for c in out.outputs] == [answer, answer]
        assert out.num_cached_tokens == 0
        (out,) = llm.generate([second], greedy, use_tqdm=False)
        assert [list(c.token_ids) for c in out.outputs] == [hf_greedy(model, second, 8)] * 2
        assert out.num_cached_tokens == 32
        third = first + answer[:7] + more  # the first's answer is cached too, up to its last computed token
        (out,) = llm.generate([third], kvload.SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        assert list(out.outputs[0].token_ids) == hf_greedy(model, third, 8)
        assert out.num_cached_tokens == 40
        ignored = {e["field"]: e["reason"] for e in events if e["event"] == "setting_ignored"}
        assert "kv_cache_config.enable_block_reuse" not in ignored
        assert "rejected draft" in ignored["max_draft_len"]
        assert "their own forward" in ignored["attention_backend"]
        assert used_blocks(llm.result) == 0 and len(llm.result.executor.v4) == 0
        assert snapshots_within_cached_boundaries(llm.result) > 0
        assert llm.reset_prefix_cache()
        assert len(llm.result.executor.v4.snapshots) == 0
        with pytest.raises(GenerationError, match=r"beam_search: .* DeepSeek V4 .*; use generate"):
            llm.beam_search([{"prompt_token_ids": first}], kvload.BeamSearchParams(beam_width=2, max_tokens=2))
    finally:
        llm.close()


def test_after_eviction_a_shorter_cached_prefix_is_reused_from_its_own_snapshot(v4_path):
    """Under a small budget a second prompt that shares the first 16 tokens of a cached 48-token prefix reuses them and
    evicts the rest of it (its window blocks and their snapshots go first): the prefix read again reuses only those 16
    tokens, the longest boundary left with its blocks and snapshot, and every token is still transformers'; the
    snapshots never outnumber the cached boundary blocks. (Split pools: a slab arena of this budget lets the window
    group take the compressed groups' spare memory, and keeps 24 tokens of the prefix.)"""
    result = load(v4_path, "v2", max_tokens=256, max_seq_len=64, pool_arena=False)
    try:
        model = result.hf_model
        prefix, tail, other = prompts_for(model.config.vocab_size, (48, 4, 32), seed=5)
        result.generate([prefix], max_new_tokens=4)
        before = snapshots_within_cached_boundaries(result)
        (out,) = result.generate([prefix[:16] + other], max_new_tokens=4)
        assert out.token_ids == hf_greedy(model, prefix[:16] + other, 4)
        assert result.executor.last_stats.reused_prompt_tokens == 16
        snapshots_within_cached_boundaries(result)
        prompt = prefix + tail
        (out,) = result.generate([prompt], max_new_tokens=6)
        assert out.token_ids == hf_greedy(model, prompt, 6)
        assert result.executor.last_stats.reused_prompt_tokens == 16
        assert before > 0 and snapshots_within_cached_boundaries(result) > 0
    finally:
        result.close()


def test_v1_is_refused_in_one_line_naming_v2():
    layers = layers_from_config(tiny_config(V4))
    assert cannot_generate("tiny-deepseek-v4", layers, "v2") is None
    why = cannot_generate("tiny-deepseek-v4", layers, "v1")
    assert why is not None and "\n" not in why
    assert "csa, hca" in why and "use_kv_cache_manager_v2: true" in why


def ended(ends: dict[int, Any], j: int, event: Any) -> None:
    """A serving sink: keeps choice ``j``'s last event."""
    if event.finished:
        ends[j] = event


def test_the_serving_loop_reuses_a_shared_prefix_and_forks_choices_from_the_prompts_state(v4_path):
    """``kvload serve``'s loop: a prompt's two greedy choices (forked from one prefill) equal transformers' tokens; a
    second prompt sharing its first 37 tokens reuses 32 of them (restored from the snapshot at that boundary) and its
    choices equal transformers' too; reuse is not said ignored, beam search is refused in one line, and nothing is
    held once the requests end."""
    from engine.sampling_params import SamplingParams
    from engine.serving import ServingEngine

    events: list[dict] = []
    result = load(v4_path, "v2", max_tokens=1024, max_seq_len=64)
    result.bus.subscribe(events.append)
    engine = ServingEngine.from_result(result)
    try:
        engine.start()
        first, tail = prompts_for(result.hf_model.config.vocab_size, (40, 5), seed=11)
        for prompt, reused in ((first, 0), (first[:37] + tail, 32)):
            want = hf_greedy(result.hf_model, prompt, 6)
            ends: dict[int, Any] = {}
            engine.submit_group(prompt, SamplingParams(max_tokens=6, temperature=0.0),
                                [functools.partial(ended, ends, j) for j in (0, 1)])
            wait_for(lambda: len(ends) == 2, what="both choices")  # noqa: B023 (waited for within the iteration)
            assert [list(ends[j].token_ids) for j in (0, 1)] == [want, want]
            assert ends[0].reused_prompt_tokens == reused
        with pytest.raises(GenerationError, match="DeepSeek V4"):
            engine.submit_beam(first, kvload.BeamSearchParams(beam_width=2, max_tokens=2), [print, print])
        wait_for(lambda: len(result.executor.v4) == 0, what="side state dropped")
        assert used_blocks(result) == 0
    finally:
        engine.stop(60)
        result.close()
    assert not [e for e in events if e.get("field") == "kv_cache_config.enable_block_reuse"]


def test_compaction_forced_before_every_step_keeps_tokens_and_reuse_from_snapshots(v4_path, monkeypatch):
    """A slab arena compacted before every step (the scheduler does it only where a request alone would stall): the
    compressed groups' moved blocks take their pages along and the executor's block-table rows follow them, so prompts
    prefilled together and then reused from their snapshots give transformers' own tokens and the unforced run's hits.
    (The window group, whose blocks the snapshots are kept with, has the largest page, a slab a block: its blocks are
    packed already and never move here; test_pool_arena's snapshot test covers a moved one.)"""
    from cache_backends.v2 import KVCacheV2Scheduler

    step = KVCacheV2Scheduler.step

    def compacting(self, waiting, running):
        self.manager.compact_slabs()
        return step(self, waiting, running)

    monkeypatch.setattr(KVCacheV2Scheduler, "step", compacting)
    result = load(v4_path, "v2", max_tokens=1024, max_seq_len=64, max_num_tokens=256, pool_arena=True)
    try:
        model = result.hf_model
        firsts = prompts_for(model.config.vocab_size, (19, 30, 11, 26), seed=21)
        outs = result.generate(firsts, max_new_tokens=3)
        assert [o.token_ids for o in outs] == [hf_greedy(model, p, 3) for p in firsts]
        tails = prompts_for(model.config.vocab_size, (5, 3, 9, 2), seed=22)
        seconds = [p[:k] + t for p, k, t in zip(firsts, (18, 27, 10, 25), tails, strict=True)]
        outs = result.generate(seconds, max_new_tokens=6)
        assert [o.token_ids for o in outs] == [hf_greedy(model, p, 6) for p in seconds]
        assert result.executor.last_stats.reused_prompt_tokens == 16 + 24 + 8 + 24  # as without compaction
        assert result.kv_manager.stats().arena["blocks_moved"] > 0
        assert used_blocks(result) == 0 and len(result.executor.v4) == 0
    finally:
        result.close()
