"""A finished turn's partial last block kept as a radix tail (V2, ``TailRun``): the next turn copies those tokens'
KV instead of recomputing them, and every greedy token is the one a run with prefix reuse off produces."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvload
from cache_backends import LayerKV
from cache_backends.request import Request
from cache_backends.v2 import KVCacheV2Scheduler
from engine.sampling_params import SamplingParams
from tests.generate_support import used_blocks
from tests.kv_v2_support import (
    admit,
    blocks_add_up,
    check_kv,
    compute,
    drive,
    full_sliding_layers,
    make_manager,
    prefill,
    split_sliding_layers,
)
from tests.llm_support import llm_kwargs, with_tokenizer

T = 4
FIRST = [5, 17, 300, 42, 9, 88, 123, 7, 64, 256, 11]  # 2 full blocks + 3
USER = [[21, 22, 23], [31, 32], [41, 42, 43, 44, 45]]
FAMILIES = ["llama", "gemma3", "mistral", "deepseek-v3", "deepseek-v4"]


@pytest.fixture(scope="module", params=FAMILIES)
def words(request, tiny_checkpoints, tmp_path_factory):
    family = request.param
    return with_tokenizer(tiny_checkpoints(family), tmp_path_factory.mktemp(f"tail-{family}") / "ckpt", 512)


def conversation(llm: kvload.LLM, answer: int) -> tuple[list[list[int]], list[int]]:
    """Each turn's prompt is the last prompt, its greedy answer and a new user message: the answers, and each turn's
    reused prompt tokens."""
    prompt, answers, reused = list(FIRST), [], []
    for user in [*USER, []]:
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=answer, ignore_eos=True))
        answers.append(list(out.outputs[0].token_ids))
        reused.append(out.reused_prompt_tokens)
        prompt = [*prompt, *answers[-1], *user]
    return answers, reused


def kwargs(**kv):
    return {**llm_kwargs("v2", tokens_per_block=T, **kv), "max_seq_len": 128}


@pytest.mark.parametrize("answer", [3, 6])
def test_each_turn_copies_its_historys_partial_block_and_generates_what_no_reuse_does(words, answer):
    with kvload.LLM(str(words), **kwargs(enable_block_reuse=False)) as llm:
        want, _ = conversation(llm, answer)
    with kvload.LLM(str(words), **kwargs()) as llm:
        got, reused = conversation(llm, answer)
        manager = llm.result.kv_manager
        manager.check_invariants()
        assert used_blocks(llm.result) == 0
        partial = manager.partial_off_reason is None  # (DeepSeek V4's compressed groups: whole blocks only)
        assert (manager.stats().reuse_partial_hits >= 1) == partial  # a tail was copied
        llm.reset_prefix_cache()
        stats = manager.stats()
        assert all(g.evictable == 0 for g in stats.groups.values())
        assert not list(manager._tree.tails()) and manager._tree.num_nodes == 0
    assert got == want
    # the second turn reuses its whole history (the first prompt and answer) but the answer's last token, whose KV
    # was never computed: its partial last block included
    if partial:
        assert reused[1] == len(FIRST) + answer - 1


# --- the manager under the engine's loop: synthetic KV checked every step ---------------------------------------


LAYOUTS = {
    "full": lambda w: [LayerKV(0, "full", 4)],
    "shared": full_sliding_layers,
    "split": split_sliding_layers,
}


def run_conversations(m, turns: list[list[list[int]]], answer: int, firsts: list[list[int]], *, n_batch: int = 8,
                      priorities: list[int] | None = None) -> list[list[int]]:
    """Drive each conversation's turns in waves (every conversation's turn t together): each turn's prompt is the
    last prompt, its answer and the turn's user tokens. Every running request's KV is checked every step."""
    prompts = [list(f) for f in firsts]
    answers: list[list[int]] = []
    for t, users in enumerate([*turns, None]):
        s = KVCacheV2Scheduler(m, max_batch_size=n_batch, max_num_tokens=16, init_ratio=0.0)
        reqs = [Request(f"c{i}t{t}", p, answer, arrival=i, priority=(priorities or [0] * len(prompts))[i])
                for i, p in enumerate(prompts)]
        res = drive(m, s, reqs)
        assert res.stalled is None and len(res.finished) == len(reqs)
        m.check_invariants()
        stats = m.stats()
        assert all(g.used == 0 for g in stats.groups.values()) and blocks_add_up(stats, m.layout.shared)
        answers.append([list(r.output_token_ids) for r in reqs])
        if users is not None:
            prompts = [[*r.all_token_ids, *u] for r, u in zip(reqs, users, strict=True)]
    m.reset_prefix_cache()
    stats = m.stats()
    assert all(g.evictable == 0 and g.used == 0 for g in stats.groups.values())
    assert blocks_add_up(stats, m.layout.shared) and not list(m._tree.tails()) and m._tree.num_nodes == 0
    return answers


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(list(LAYOUTS)), window=st.sampled_from([3, 5, 6, 8, 12]), blocks=st.integers(16, 40),
       host=st.sampled_from([0, None]), lazy=st.booleans(), conversations=st.integers(1, 4),
       answer=st.integers(1, 6), data=st.data())
def test_multi_turn_conversations_read_back_their_kv_under_pressure(layout, window, blocks, host, lazy,
                                                                     conversations, answer, data):
    m = make_manager(LAYOUTS[layout](window), blocks, host_cache_size=host, max_seq_len=96)
    m._lazy = lazy and m._lazy
    tokens = st.lists(st.integers(0, 9), min_size=1, max_size=6)
    firsts = [data.draw(st.lists(st.integers(0, 9), min_size=2, max_size=13)) for _ in range(conversations)]
    turns = [[data.draw(tokens) for _ in range(conversations)] for _ in range(data.draw(st.integers(1, 3)))]
    priorities = data.draw(st.lists(st.integers(0, 2), min_size=conversations, max_size=conversations))
    run_conversations(m, turns, answer, firsts, priorities=priorities)


def conversations(llm: kvload.LLM, firsts: list[list[int]], users: list[list[int]], answer: int) -> list[list[int]]:
    """Every conversation's turn t in one call (so they press on each other's blocks): each turn's prompt is the last
    prompt, its greedy answer and a new user message. The answers, turn by turn."""
    prompts, answers = [list(f) for f in firsts], []
    for user in [*users, None]:
        outs = llm.generate(prompts, SamplingParams(max_tokens=answer, ignore_eos=True))
        got = [list(o.outputs[0].token_ids) for o in outs]
        answers.append(got)
        if user is not None:
            prompts = [[*p, *a, *user] for p, a in zip(prompts, got, strict=True)]
    return answers


PRESSED = [("llama", 0), ("gemma3", 0), ("gemma3", None)]


@pytest.mark.parametrize(("family", "host"), PRESSED, ids=[f"{f}-host-{h}" for f, h in PRESSED])
def test_conversations_under_pressure_generate_what_no_reuse_does(tiny_checkpoints, tmp_path, family, host):
    words = with_tokenizer(tiny_checkpoints(family), tmp_path / "ckpt", 512)
    firsts = [[(7 * i + j) % 500 + 1 for j in range(9 + 2 * i)] for i in range(4)]
    users = [[101, 102, 103], [201], [301, 302, 303, 304, 305]]
    with kvload.LLM(str(words), **kwargs(enable_block_reuse=False, max_tokens=1024)) as llm:
        want = conversations(llm, firsts, users, 5)
    with kvload.LLM(str(words), **{**kwargs(max_tokens=96, host_cache_size=host), "max_num_tokens": 8}) as llm:
        got = conversations(llm, firsts, users, 5)
        manager = llm.result.kv_manager
        manager.check_invariants()
        stats = manager.stats()
        assert used_blocks(llm.result) == 0
        assert any(g.evictions for g in stats.groups.values())  # tails and histories evicted under pressure
    assert got == want


# --- which tail a run keeps ---------------------------------------------------------------------------------------


def finish(m, req_id: str, tokens: list[int]) -> Request:
    r = Request(req_id, tokens, 0)
    prefill(m, r)
    m.free(r)
    m.check_invariants()
    return r


@pytest.mark.parametrize("lazy", [True, False])
def test_a_finished_turn_s_own_tail_replaces_another_conversation_s_on_the_same_run(lazy):
    # two conversations share their whole blocks (a system prompt of 8 tokens) and part ways inside the next block:
    # the later one's tail must be the one its follow-up turn finds, not the first conversation's
    m = make_manager([LayerKV(0, "full", 4)], 32)
    m._lazy = lazy and m._lazy
    system = list(range(1, 9))
    finish(m, "a", [*system, 50, 51, 52])  # tail [50 51 52]
    b = finish(m, "b", [*system, 60, 61])  # tail [60 61]
    follow_up = Request("b2", [*b.all_token_ids, 70, 71], 0)
    admit(m, follow_up)
    assert follow_up.num_computed_tokens == 10  # its history's 8 whole tokens and its 2 partial ones
    check_kv(m, follow_up)
    compute(m, follow_up, 2)
    check_kv(m, follow_up)
    m.check_invariants()


def test_a_tail_missing_a_groups_block_gives_way_to_a_whole_one():
    # pools per group: eviction takes the sliding group's copy of a tail and leaves the full group's; a later finish
    # of the same history must hang its own whole tail instead of keeping the one no hit can copy
    m = make_manager(split_sliding_layers(window=8), {"full": 64, "sliding_w8": 6})
    m._lazy = False
    prompt = [*range(1, 9), 50, 51]
    finish(m, "a", prompt)  # 3 sliding blocks cached, the partial one oldest
    finish(m, "o", list(range(100, 116)))  # 4 sliding blocks: the 3 free and the oldest cached, a's tail
    (tail,) = m._tree.tails()
    assert tail.held == [1]  # the full group's block alone
    finish(m, "b", prompt)  # the same history: its two partial tokens computed again
    follow_up = Request("c", [*prompt, 70, 71], 0)
    admit(m, follow_up)
    assert follow_up.num_computed_tokens == 10
    check_kv(m, follow_up)
    m.check_invariants()


@pytest.mark.parametrize("setting", ["enable_partial_reuse", "enable_block_reuse"])
def test_with_partial_reuse_off_a_finish_keeps_no_tail(setting):
    m = make_manager([LayerKV(0, "full", 4)], 32, **{setting: False})
    a = finish(m, "a", list(range(1, 11)))
    assert not list(m._tree.tails())  # its two whole blocks cached (with block reuse on), its partial one free
    assert m.stats().groups["full"].evictable == (2 if setting == "enable_partial_reuse" else 0)
    follow_up = Request("a2", [*a.all_token_ids, 70], 0)
    admit(m, follow_up)
    assert follow_up.num_computed_tokens == (8 if setting == "enable_partial_reuse" else 0)


@pytest.mark.parametrize("layers", ["full", "shared", "split"])
@pytest.mark.parametrize("lazy", [True, False])
def test_a_request_that_copied_a_tail_is_preempted_suspended_and_aborted_and_reads_back_right(layers, lazy):
    m = make_manager(LAYOUTS[layers](8), 32)
    m._lazy = lazy and m._lazy
    a = finish(m, "a", [*range(1, 9), 50, 51, 52])  # tail [50 51 52] at block 2
    history = list(a.all_token_ids)
    b = Request("b", [*history, 60, 61, 62, 63, 64, 65], 0)
    admit(m, b)
    assert b.num_computed_tokens == 11 and m.stats().reuse_partial_hits == 1
    check_kv(m, b)
    m.preempt(b)  # before computing anything: the run keeps a's tail, the copy goes
    m.check_invariants()
    assert [t.valid for t in m._tree.tails()] == [3]
    admit(m, b)
    assert b.num_computed_tokens == 11
    compute(m, b, 2)
    assert m.suspend(b)
    m.check_invariants()
    assert m.resume(b)
    check_kv(m, b)
    compute(m, b, 2)
    check_kv(m, b)
    m.free(b)  # aborted mid-prompt: 15 tokens committed, block 3 partial
    m.check_invariants()
    c = Request("c", [*b.prompt_token_ids, 70], 0)
    admit(m, c)
    assert c.num_computed_tokens == 15  # b's three whole blocks and the 3 tokens of its partial one
    check_kv(m, c)
    compute(m, c, c.num_tokens - c.num_computed_tokens)
    check_kv(m, c)
    m.free(c)
    m.check_invariants()
    m.reset_prefix_cache()
    stats = m.stats()
    assert all(g.used == 0 and g.evictable == 0 for g in stats.groups.values()) and not list(m._tree.tails())


def test_samples_of_a_turn_that_copied_a_tail_and_a_regenerated_turn_are_what_no_reuse_gives(tiny_checkpoints,
                                                                                             tmp_path):
    # n > 1: the first sample copies the history's tail, the others fork its prefill (their partial block a copy of
    # it); each turn is asked again (the same prompt: its own history's tail copied up to its last token)
    words = with_tokenizer(tiny_checkpoints("gemma3"), tmp_path / "ckpt", 512)

    def turns(llm: kvload.LLM) -> list[tuple[list[list[int]], list[int]]]:
        prompt, out = list(FIRST), []
        for user in [*USER, []]:
            (samples,) = llm.generate([prompt], SamplingParams(max_tokens=3, n=3, ignore_eos=True))
            (again,) = llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))
            out.append(([list(c.token_ids) for c in samples.outputs], list(again.outputs[0].token_ids)))
            prompt = [*prompt, *out[-1][0][1], *user]
        return out

    with kvload.LLM(str(words), **kwargs(enable_block_reuse=False)) as llm:
        want = turns(llm)
    with kvload.LLM(str(words), **kwargs()) as llm:
        got = turns(llm)
        llm.result.kv_manager.check_invariants()
        assert used_blocks(llm.result) == 0 and llm.result.kv_manager.stats().reuse_partial_hits >= 4
    assert got == want
