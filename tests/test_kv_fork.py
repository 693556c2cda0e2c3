"""Forks at the manager and driver level (``n > 1`` samples): a sample joins in the step its prompt's first sample
completes the prefill, holding that prompt's KV — whole blocks shared, the partial last block copied — on V1 and on
V2's layouts (one pool, a shared arena with sliding windows, split pools), prefix reuse on and off. The KV each
request reads is checked entry by entry every step (synthetic values), with the managers' invariants."""

from __future__ import annotations

import pytest

from cache_backends.interface import SchedulerOutput
from cache_backends.request import Request
from cache_backends.v1 import GuaranteedNoEvictScheduler
from cache_backends.v2 import KVCacheV2Scheduler
from engine.driver import Driver
from tests import kv_v1_support as v1
from tests.kv_v2_support import (
    FULL,
    blocks_add_up,
    check_kv,
    full_sliding_layers,
    make_manager,
    next_token,
    split_sliding_layers,
    write_kv,
)

LAYOUTS = {"full": FULL, "shared arena, windows": full_sliding_layers(), "split pools, windows": split_sliding_layers()}
PROMPTS = {"under one block": 3, "ending mid-block": 13, "ending on a block": 12}  # tokens (4-token blocks)


def fork_run(manager, scheduler, prompt_len: int, n: int, max_new: int, check=None,
             write: bool = False) -> tuple[list[Request], list[int]]:
    """Drive one prompt's ``n`` samples as forks of the first (``write``: V2's synthetic KV written, for ``check_kv``);
    the samples and the prompt positions each computed."""
    samples = [Request(f"s{j}", list(range(100, 100 + prompt_len)), max_new) for j in range(n)]
    computed = [0] * n
    index = {r.req_id: j for j, r in enumerate(samples)}
    driver = Driver(manager, scheduler)
    driver.fork(samples[0], samples[1:])

    def compute(out: SchedulerOutput) -> dict[str, int]:
        tokens = {}
        for chunk in out.scheduled:
            r = chunk.request
            computed[index[r.req_id]] += max(0, min(r.num_prompt_tokens, r.num_computed_tokens + chunk.num_tokens)
                                             - r.num_computed_tokens)
            if write:
                write_kv(manager, r, r.num_computed_tokens, chunk.num_tokens)
            if r.num_computed_tokens + chunk.num_tokens == r.num_tokens:
                tokens[r.req_id] = next_token(r)
                if r is samples[0] and not r.output_token_ids:  # the one prefill: every sample's first token
                    tokens.update({s.req_id: next_token(s) for s in samples[1:]})
        return tokens

    def stepped(clock, stats) -> None:
        if check is not None:
            check(driver)

    driver.run([samples[0]], compute, on_step=stepped)
    return samples, computed


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no-reuse"])
@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_v2_samples_read_the_one_prefill_s_kv(layout, prompt, reuse):
    m = make_manager(LAYOUTS[layout], 64, enable_block_reuse=reuse)
    s = KVCacheV2Scheduler(m, 16, 64)

    def check(driver: Driver) -> None:
        for r in driver.running:
            check_kv(m, r)  # a forked sample's prompt entries are its first sample's, copied where partial
        m.check_invariants()

    P = PROMPTS[prompt]
    samples, computed = fork_run(m, s, P, 8, 6, check, write=True)
    assert computed == [P] + [0] * 7  # only the first sample computed prompt positions
    assert all(r.num_reused_tokens == P and len(r.output_token_ids) == 6 for r in samples[1:])
    assert len({tuple(r.output_token_ids) for r in samples}) == 8
    assert m.stats().reuse_hit_tokens == 0  # a fork is no prefix-cache hit
    m.check_invariants()
    assert all(g.used == 0 for g in m.stats().groups.values()) and blocks_add_up(m.stats(), m.layout.shared)


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no-reuse"])
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_v1_samples_share_whole_blocks_and_copy_the_partial_one(prompt, reuse):
    m = v1.make_manager(64, reuse=reuse)
    P = PROMPTS[prompt]
    seen = {}

    def check(driver: Driver) -> None:
        for r in driver.running:
            if r.req_id != "s0" and r.req_id not in seen and len(r.output_token_ids) == 1:
                seen[r.req_id] = list(m.block_table(r, m.group))
        m.pool.check_invariants()

    parent_table: list[int] = []
    original = m.fork

    def fork(parent: Request, child: Request) -> bool:
        parent_table[:] = m.block_table(parent, m.group)
        tensor = m.pools.tensors[m.group]
        tensor[:, parent_table[-1]] = float(len(parent_table))  # the partial block's entries, as written
        ok = original(parent, child)
        table = m.block_table(child, m.group)
        assert table[:P // 4] == parent_table[:P // 4]  # whole blocks shared
        if P % 4:
            assert table[-1] != parent_table[-1]  # the partial one copied, not shared (the parent writes there)
            assert bool((tensor[:, table[-1]] == tensor[:, parent_table[-1]]).all())
        return ok

    m.fork = fork
    samples, computed = fork_run(m, GuaranteedNoEvictScheduler(m, 16, 64), P, 8, 6, check)
    assert computed == [P] + [0] * 7
    assert len(seen) == 7 and len({t[-1] for t in seen.values()}) == (7 if P % 4 else 1)
    assert all(r.num_reused_tokens == P for r in samples[1:]) and m.stats().reuse_hit_tokens == 0
    m.pool.check_invariants()
    assert m.stats().groups["uniform"].used == 0


def test_a_fork_without_room_waits_with_its_first_token():
    """Pools for one sequence: no sample forks beside the first; each waits with its token and recomputes."""
    m = v1.make_manager(6, reuse=False)  # 6 blocks of 4: one sequence of 13 + 10 tokens
    samples, computed = fork_run(m, GuaranteedNoEvictScheduler(m, 16, 64), 13, 3, 10)
    assert computed == [13, 13, 13] and all(len(r.output_token_ids) == 10 for r in samples)
    assert all(r.num_reused_tokens == 0 for r in samples)
    m.pool.check_invariants()


def test_a_fork_needs_its_parent_s_prompt_and_no_token():
    m = v1.make_manager(16)
    d = Driver(m, GuaranteedNoEvictScheduler(m, 4, 64))
    with pytest.raises(ValueError, match="a fork has its parent's prompt and no token yet"):
        d.fork(Request("a", [1, 2, 3], 2), [Request("b", [1, 2, 4], 2)])


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no-reuse"])
@pytest.mark.parametrize("generated", [2, 4, 5])  # past the prompt of 6: mid-block, on a block's end, mid-block
def test_v1_forks_a_beam_at_any_committed_length(generated, reuse):
    """Beam search: a beam forks another at the length it has committed, its generated tokens included — whole
    blocks shared, the partial last one copied with its entries — so the new beam computes only its own token."""
    m = v1.make_manager(16, reuse=reuse)
    parent = Request("a", list(range(100, 106)), 8)
    v1.run_prefill(m, parent)
    for t in range(generated):
        parent.output_token_ids.append(200 + t)
        assert m.allocate_slots(parent, 1)
        m.commit(parent, 1)
    L = 6 + generated
    table = m.block_table(parent, m.group)
    tensor = m.pools.tensors[m.group]
    for i, b in enumerate(table):
        tensor[:, b] = float(i + 1)  # each block's entries, as written
    child = Request("b", parent.prompt_token_ids, 8, output_token_ids=[*parent.output_token_ids, 999])
    assert m.fork_blocks_needed(parent, child) == m.max_blocks(child) - L // 4
    assert m.fork(parent, child)
    assert child.num_computed_tokens == L and child.num_reused_tokens == 6
    forked = m.block_table(child, m.group)
    assert forked[:L // 4] == table[:L // 4]  # whole blocks shared
    if L % 4:
        assert forked[-1] != table[-1] and bool((tensor[:, forked[-1]] == tensor[:, table[-1]]).all())
    assert len(forked) == -(-L // 4)
    assert m.allocate_slots(child, 1)  # its own next token goes on from there
    m.commit(child, 1)
    m.pool.check_invariants()
    m.free(parent)
    m.free(child)
    m.pool.check_invariants()
    assert m.stats().groups["uniform"].used == 0


def test_v1_refuses_a_beam_fork_whose_tokens_differ_before_the_fork():
    m = v1.make_manager(16)
    parent = Request("a", [1, 2, 3, 4, 5], 4, output_token_ids=[7])
    v1.run_prefill(m, parent)
    stray = Request("b", [1, 2, 3, 4, 5], 4, output_token_ids=[8, 9])  # its 6th token is not the parent's
    with pytest.raises(ValueError, match="can fork only a computed prompt, and the tokens after it, equal to its own"):
        m.fork(parent, stray)
    assert not m.knows(stray)


def test_a_beam_forks_past_the_prompt_only_where_the_manager_can():
    """``Driver.branch``: V1 forks a beam at any committed length; V2 forks only at a prompt's end, so a beam that
    extends a longer sequence there waits as a request of its own (its prefix from the prefix cache)."""
    for m, scheduler in ((v1.make_manager(16), GuaranteedNoEvictScheduler), (make_manager(FULL, 16),
                                                                              KVCacheV2Scheduler)):
        s = scheduler(m, 8, 64)
        d = Driver(m, s)
        parent = Request("a", [1, 2, 3, 4, 5], 4)
        d.add(parent)
        d.step(lambda out: {"a": 7})
        d.step(lambda out: {"a": 8})  # "a" holds 1..5, 7 committed, 8 to compute
        child = Request("b", [1, 2, 3, 4, 5], 4, output_token_ids=[7, 9])
        forked = d.branch(parent, child)
        assert forked == isinstance(s, GuaranteedNoEvictScheduler)
        assert (child in d.running) == forked and (child in d.waiting) != forked
