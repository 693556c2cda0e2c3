"""The synthetic workloads: deterministic, honest ideals, no accidental shared prefixes."""

from __future__ import annotations

import itertools

import pytest

from engine import workloads
from engine.workloads import (
    WORKLOADS,
    default_budget_sequences,
    fresh_segments,
    make_workload,
    planned_tokens,
    workload_params,
)


def test_shared_prefix_groups_share_exactly_their_prefix_and_the_ideal_skips_it_after_the_first():
    w = make_workload("shared-prefix", 8, group_size=4, prefix_len=64, question_len=8, answer_len=3)
    assert [r.arrival_step for r in w.requests] == list(range(8))
    for g in range(2):
        group = w.requests[4 * g:4 * g + 4]
        assert len({r.prompt[:64] for r in group}) == 1
        assert len({r.prompt[64] for r in group}) == 4  # questions branch at once
        assert [r.ideal_reuse for r in group] == [0, 64, 64, 64]
    assert w.requests[0].prompt[0] != w.requests[4].prompt[0]
    assert w.ideal_hit_rate == 6 * 64 / (8 * 72)


def test_multi_turn_each_turn_extends_the_last_prompt_and_answer_and_waits_for_it():
    w = make_workload("multi-turn", 6, turns=3, first_len=10, user_len=4, answer_len=5)
    assert [r.req_id for r in w.requests] == ["mt-0-0", "mt-0-1", "mt-0-2", "mt-1-0", "mt-1-1", "mt-1-2"]
    first, second, third = w.requests[:3]
    assert second.after == first.req_id and third.after == second.req_id and first.after is None
    assert second.prompt[:15] == first.prompt + first.answer and len(second.prompt) == 19
    assert second.ideal_reuse == 14 and third.ideal_reuse == 19 + 5 - 1
    assert w.requests[3].arrival_step == 1


@pytest.mark.parametrize("requests", [1, 3, 5, 7, 10])
def test_multi_turn_gives_the_requests_asked_for_when_they_are_not_whole_conversations(requests):
    # `kvload simulate --workload multi-turn --requests 5` simulated 4 (5 // 4 conversations of 4 turns), 10 gave 8,
    # while 3 gave 3: the last conversation is now cut short, as it already was under `turns` requests
    params = {"turns": 4, "first_len": 10, "user_len": 4, "answer_len": 5}
    w = make_workload("multi-turn", requests, **params)
    assert len(w.requests) == requests
    assert [r.req_id for r in w.requests][:5] == ["mt-0-0", "mt-0-1", "mt-0-2", "mt-0-3", "mt-1-0"][:requests]
    assert planned_tokens("multi-turn", requests, params) == sum(len(r.prompt) + len(r.answer) for r in w.requests)
    assert default_budget_sequences(w) == -(-requests // 4)  # one per conversation, the short one too
    # a conversation of more turns than requests is its first turns: sized as built, not refused as one of 10**8
    assert len(make_workload("multi-turn", requests, **{**params, "turns": 10**8}).requests) == requests


#: Small sizes of every workload, for the marker tests below.
_SIZES = {"shared-prefix": {"group_size": 3, "prefix_len": 4, "question_len": 2, "answer_len": 1},
          "multi-turn": {"turns": 3, "first_len": 4, "user_len": 2, "answer_len": 1},
          "long-context": {"prompt_len": 3, "answer_len": 1}, "no-reuse": {"prompt_len": 3, "answer_len": 1},
          "mixed-priority": {"prompt_len": 3, "answer_len": 1, "urgent_every": 2, "urgent_len": 2,
                             "urgent_answer_len": 1},
          "mixed": {"prompt_min": 2, "prompt_max": 6, "answer_min": 1, "answer_max": 2, "prefixes": 3, "prefix_len": 4}}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_fresh_segments_counts_the_markers_a_workload_draws(name, monkeypatch):
    """The count make_workload checks vocab against, computed without building, is what building draws."""
    drawn = []
    real = workloads._Segments.__call__
    monkeypatch.setattr(workloads._Segments, "__call__", lambda self, n: drawn.append(n) or real(self, n))
    for requests in (1, 2, 7, 10):
        drawn.clear()
        make_workload(name, requests, 0, **_SIZES[name])
        assert fresh_segments(name, requests, {**workload_params(name), **_SIZES[name]}) == len(drawn)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_a_vocab_too_small_for_distinct_markers_is_refused_naming_the_least_that_fits(name):
    """vocab=2 made every prompt's tokens all 1s: no-reuse hit 89% (V1) / 95% (V2) against an ideal of 0%. A vocab
    whose ids cannot open each unrelated segment with its own marker is refused, naming the least that can."""
    need = fresh_segments(name, 10, {**workload_params(name), **_SIZES[name]}) + 1
    with pytest.raises(ValueError, match=rf"^workload {name}: vocab={need - 1} gives {need - 2} distinct marker .* "
                                         rf"give --workload-arg vocab={need} or more, or fewer --requests$"):
        make_workload(name, 10, 0, **_SIZES[name], vocab=need - 1)
    w = make_workload(name, 10, 0, **_SIZES[name], vocab=need)
    assert max(t for r in w.requests for t in r.prompt) < need


def test_the_default_vocab_grows_past_32000_segments_so_markers_stay_distinct():
    """On main the 32,000th unrelated prompt began with the first one's marker again (vocab 32,000 by default)."""
    w = make_workload("no-reuse", 32_001, 0, prompt_len=2, answer_len=1)
    assert len({r.prompt[0] for r in w.requests}) == 32_001
    small = make_workload("no-reuse", 50, 0, prompt_len=16, answer_len=2)  # below 32,000: the ids as before
    assert small == make_workload("no-reuse", 50, 0, prompt_len=16, answer_len=2, vocab=32_000)


@pytest.mark.parametrize("name", ["long-context", "no-reuse"])
def test_unrelated_prompts_share_not_even_a_first_token(name):
    w = make_workload(name, 50, prompt_len=16, answer_len=2)
    assert len({r.prompt[0] for r in w.requests}) == 50
    assert w.ideal_reused_tokens == 0


def test_mixed_priority_puts_a_short_urgent_request_every_nth_arrival_and_plans_its_tokens_exactly():
    w = make_workload("mixed-priority", 9, prompt_len=20, answer_len=4, urgent_every=3, urgent_len=5,
                      urgent_answer_len=2)
    assert [r.arrival_step for r in w.requests] == list(range(9))
    assert [r.priority for r in w.requests] == [0, 0, 1] * 3
    assert {(len(r.prompt), len(r.answer)) for r in w.requests if r.priority} == {(5, 2)}
    assert {(len(r.prompt), len(r.answer)) for r in w.requests if not r.priority} == {(20, 4)}
    assert len({r.prompt[0] for r in w.requests}) == 9 and w.ideal_reused_tokens == 0
    params = {"prompt_len": 20, "answer_len": 4, "urgent_every": 3, "urgent_len": 5, "urgent_answer_len": 2}
    assert planned_tokens("mixed-priority", 9, params) == sum(len(r.prompt) + len(r.answer) for r in w.requests)
    assert default_budget_sequences(w) == 2  # answer_len // 4, at least 2: requests queue


def test_mixed_draws_sizes_in_range_puts_shared_prompts_after_a_system_prompt_and_counts_their_reuse():
    params = {"prompt_min": 4, "prompt_max": 64, "answer_min": 2, "answer_max": 9, "prefixes": 2, "prefix_len": 16,
              "shared_percent": 60, "urgent_percent": 30, "max_gap": 3}
    w = make_workload("mixed", 120, 5, **params)
    systems = {r.prompt[:16] for r in w.requests if r.ideal_reuse}
    assert len(systems) == 2  # both system prompts came back after their first use
    first_at: dict[tuple[int, ...], int] = {}
    shared = 0
    for r in w.requests:
        on_system = r.prompt[:16] in systems and len(r.prompt) > 16
        own = len(r.prompt) - 16 if on_system else len(r.prompt)
        assert 4 <= own <= 64 and 2 <= len(r.answer) <= 9
        if on_system:
            shared += 1
            first = first_at.setdefault(r.prompt[:16], r.arrival_step)
            assert r.ideal_reuse == (16 if first < r.arrival_step else 0)  # the first use's burst computes it
        else:
            assert r.ideal_reuse == 0
    assert 50 <= shared <= 90 and 15 <= sum(r.priority for r in w.requests) <= 55
    gaps = [b.arrival_step - a.arrival_step for a, b in itertools.pairwise(w.requests)]
    assert set(gaps) == {0, 1, 2, 3}  # bursts (several at one step) and pauses
    assert {len(r.prompt) for r in w.requests} != {len(w.requests[0].prompt)}  # lengths vary
    # the requests' ids, and the system prompts drawn up front to build them
    assert planned_tokens("mixed", 120, params, 5) == 2 * 16 + sum(len(r.prompt) + len(r.answer) for r in w.requests)
    assert default_budget_sequences(w) == 2  # answer_max // 32, at least 2
    none = make_workload("mixed", 30, 1, prefixes=0, shared_percent=0, urgent_percent=0, max_gap=0)
    assert {r.arrival_step for r in none.requests} == {0} and none.ideal_reused_tokens == 0
    assert not any(r.priority for r in none.requests) and len({r.prompt[0] for r in none.requests}) == 30


@pytest.mark.parametrize(("params", "message"), [
    ({"shared_percent": 101}, "shared_percent is a percentage, 0 to 100, got 101"),
    ({"prompt_min": 300, "prompt_max": 200}, "prompt_min=300 is more than prompt_max=200; need prompt_min <= "
                                             "prompt_max"),
    ({"answer_min": 300}, "answer_min=300 is more than answer_max=256"),
    ({"prefix_len": 0}, "prefix_len must be an integer >= 1, got 0"),
    # sharing asked for with nothing to share: it used to be dropped silently
    ({"prefixes": 0, "shared_percent": 50}, r"shared_percent=50 does nothing with prefixes=0 \(no prompt then shares "
                                            r"a system prompt\); give prefixes >= 1, or leave shared_percent out"),
    ({"prefixes": 0, "prefix_len": 64}, "prefix_len=64 does nothing with prefixes=0"),
    ({"shared_percent": 0, "prefixes": 3}, "prefixes=3 does nothing with shared_percent=0"),
    ({"shared_percent": 0, "prefix_len": 64}, "prefix_len=64 does nothing with shared_percent=0"),
])
def test_mixed_refuses_sizes_that_cannot_be_drawn_naming_them(params, message):
    with pytest.raises(ValueError, match=message):
        make_workload("mixed", 4, **params)


def test_same_seed_same_tokens():
    for name in WORKLOADS:
        assert make_workload(name, 4, 7) == make_workload(name, 4, 7)
        assert make_workload(name, 4, 7) != make_workload(name, 4, 8)


def test_default_budgets_follow_the_documented_rule():
    sp = make_workload("shared-prefix", 300, group_size=4, prefix_len=32, question_len=8, answer_len=16)
    assert default_budget_sequences(sp) == 17
    assert default_budget_sequences(make_workload("shared-prefix", 5, answer_len=16)) == 5  # capped by requests
    assert default_budget_sequences(make_workload("multi-turn", 12, turns=4, first_len=8, user_len=2,
                                                  answer_len=2)) == 3
    assert default_budget_sequences(make_workload("long-context", 16, prompt_len=8, answer_len=2)) == 2
    assert workload_params("no-reuse") == {"prompt_len": 512, "answer_len": 128, "vocab": 32000}
