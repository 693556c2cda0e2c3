"""/metrics on a V2 model whose layer groups share one arena: free pages are counted once, not per group."""

from __future__ import annotations

from kvload.serve.metrics import SHARED_ARENA_LABEL
from tests.serve_support import serving


def test_an_arena_s_free_pages_are_one_series_so_the_states_add_up_to_the_pages():
    with serving("tiny-gemma3", kv_cache_config={"max_tokens": 2048, "use_kv_cache_manager_v2": True}) as served:
        done = served.client.completions.create(model="tiny-gemma3", prompt=[5, 6, 7, 8] * 20, max_tokens=4)
        assert done.choices[0].finish_reason in ("length", "stop")
        stats = served.result.kv_manager.stats()
        groups = stats.groups
        assert len(groups) > 1 and all(g.shared for g in groups.values())  # the arena, not a split
        pages = next(iter(groups.values())).total
        m = served.metrics()
    blocks = {k: v for k, v in m.items() if k.startswith("kvload_kv_cache_blocks{")}
    free = [k for k in blocks if k.endswith("state=free}")]
    assert free == [f"kvload_kv_cache_blocks{{layer_group={SHARED_ARENA_LABEL},state=free}}"]
    assert sum(blocks.values()) == pages  # free once + every group's cached and used pages
    assert any(v > 0 for k, v in blocks.items() if "state=evictable" in k)  # the finished prompt stays cached


def test_a_slab_arena_s_slabs_are_one_series_free_or_owned_by_the_groups_that_hold_blocks():
    """DeepSeek V4 served from a slab arena (``pool_arena: true``): its free slabs belong to no group, so /metrics
    gives them as their own series; the slabs the groups own hold the cached prompt's blocks."""
    kv = {"max_tokens": 8192, "pool_arena": True}
    with serving("tiny-deepseek-v4", max_seq_len=2048, kv_cache_config=kv) as served:
        done = served.client.completions.create(model="tiny-deepseek-v4", prompt=list(range(5, 305)), max_tokens=4,
                                                temperature=0.0)
        assert done.usage.completion_tokens == 4
        arena = served.result.kv_manager.stats().arena
        m = served.metrics()
    free, owned = (m[f"kvload_kv_cache_slabs{{state={s}}}"] for s in ("free", "owned"))
    assert free + owned == arena["slabs"] == served.result.kv.arena_slabs and owned > 0
    cached = [k for k, v in m.items() if k.startswith("kvload_kv_cache_blocks{") and "state=evictable" in k and v]
    assert cached  # the prompt's whole blocks stay cached in the slabs their groups own
