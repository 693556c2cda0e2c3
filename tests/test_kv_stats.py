"""``stats()`` of both KV cache managers: one attrs shape (``cache_backends.stats``), JSON-ready."""

from __future__ import annotations

import json

import attrs
import pytest

from cache_backends import LayerKV, build_layout
from cache_backends.interface import ManagerOptions, SchedulerOutput
from cache_backends.pools import BlockPools
from cache_backends.request import Request
from cache_backends.stats import GroupStats, HostStats, ManagerStats, ReuseStats
from cache_backends.v1 import GuaranteedNoEvictScheduler, KVCacheManager
from cache_backends.v2 import KVCacheManagerV2, KVCacheV2Scheduler
from engine.driver import Driver

KINDS = {"v1": (KVCacheManager, GuaranteedNoEvictScheduler), "v2": (KVCacheManagerV2, KVCacheV2Scheduler)}


def answer(out: SchedulerOutput) -> dict[str, int]:
    return {c.request.req_id: 5 for c in out.scheduled
            if c.request.num_computed_tokens + c.num_tokens == c.request.num_tokens}


def run(kind: str, **options) -> tuple[ManagerStats, list[ManagerStats]]:
    """Two requests sharing a two-block prefix, one after the other, on one full layer: (final, per-step) stats."""
    manager_cls, scheduler_cls = KINDS[kind]
    layout = build_layout([LayerKV(0, "full", 4)], kind, 4, "float32")
    m = manager_cls(BlockPools(layout, {g.name: 16 for g in layout.groups}, "cpu"),
                    ManagerOptions(max_seq_len=64, **options))
    steps: list[ManagerStats] = []
    d = Driver(m, scheduler_cls(m, 8, 64))
    d.run([Request("a", list(range(1, 13)), 2)], answer, on_step=lambda now, s: steps.append(m.stats()))
    d.run([Request("b", [*range(1, 11), 50, 51], 2)], answer, on_step=lambda now, s: steps.append(m.stats()))
    return m.stats(), steps


def comparable(s: ManagerStats) -> dict:
    """What the same operations must give both managers: all but the kind, group names and the radix tree."""
    d = s.to_dict()
    del d["kind"], d["reuse"]["radix_nodes"], d["reuse"]["partial_disabled_reason"]
    d["groups"] = list(d["groups"].values())
    return d


def test_both_managers_return_one_shape_with_the_same_values_after_the_same_operations():
    # V2 without partial reuse and host tier: what V1 does, so every counter must agree
    v1, v1_steps = run("v1")
    v2, v2_steps = run("v2", enable_partial_reuse=False, host_cache_size=0)
    assert type(v1) is type(v2) is ManagerStats
    assert [type(g) for g in (*v1.groups.values(), *v2.groups.values())] == [GroupStats, GroupStats]
    assert type(v1.reuse) is type(v2.reuse) is ReuseStats
    assert attrs.fields_dict(type(v1)).keys() == v1.to_dict().keys() == v2.to_dict().keys()
    assert (v1.kind, v2.kind) == ("v1", "v2")
    assert (v1.host, v2.host, v1.host_bytes, v2.host_bytes) == (None, None, 0, 0)
    assert comparable(v1) == comparable(v2)
    assert v1.reuse_hit_tokens == 8 and v1.reuse_query_tokens == 24 and v1.requests == v1.active == 0
    (g,) = v1.groups.values()
    assert (g.total, g.free, g.evictable, g.used, g.tokens_per_block) == (16, 12, 4, 0, 4)
    assert len(v1_steps) == len(v2_steps) and [comparable(s) for s in v1_steps] == [comparable(s) for s in v2_steps]
    assert max(s.active for s in v1_steps) == 1 and max(s.usage for s in v1_steps) > 0
    for s in (v1, v2, *v1_steps, *v2_steps):
        assert s.evictions == sum(g.evictions for g in s.groups.values())
        assert s.requests == s.active + s.suspended
        assert all(g.free + g.evictable + g.used == g.total for g in s.groups.values())


def test_v1_reads_as_a_manager_without_suspends_host_tier_or_radix_tree():
    on, _ = run("v1")
    assert (on.suspends, on.resumes, on.preemptions, on.reuse_partial_hits, on.suspended) == (0, 0, 0, 0, 0)
    assert on.reuse == ReuseStats(enabled=True, disabled_reason=None, unit_tokens=4, partial=False,
                                  partial_disabled_reason="V1 reuses full blocks only", radix_nodes=0)
    off, _ = run("v1", enable_block_reuse=False)
    assert off.reuse == ReuseStats(enabled=False, disabled_reason="enable_block_reuse is false", unit_tokens=None,
                                   partial=False, partial_disabled_reason="prefix reuse is off", radix_nodes=0)
    assert off.reuse_hit_tokens == 0
    v2_off, _ = run("v2", enable_block_reuse=False)
    assert attrs.evolve(v2_off.reuse, radix_nodes=0) == off.reuse  # V2 says it in the same words


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_to_dict_round_trips_through_json(kind):
    stats, _ = run(kind)
    doc = stats.to_dict()
    assert json.loads(json.dumps(doc)) == doc
    rebuilt = ManagerStats(**{
        **doc,
        "groups": {name: GroupStats(**g) for name, g in doc["groups"].items()},
        "host": None if doc["host"] is None else {name: HostStats(**h) for name, h in doc["host"].items()},
        "reuse": ReuseStats(**doc["reuse"]),
    })
    assert rebuilt == stats
    assert set(doc["groups"][next(iter(doc["groups"]))]) == {"total", "free", "evictable", "used", "usage",
                                                             "evictions", "tokens_per_block", "shared", "slabs"}
