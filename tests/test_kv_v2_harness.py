"""The V2 test support (``tests/kv_v2_support.py``) must be able to fail: its KV checker catches corrupted pages."""

from __future__ import annotations

import pytest

from cache_backends import LayerKV
from cache_backends.request import Request
from cache_backends.v2 import KVCacheManagerV2
from tests.kv_v2_support import (
    check_kv,
    full_sliding_layers,
    make_manager,
    point_at,
    prefix_values,
    split_sliding_layers,
    write_kv,
)

# --- the harness must be able to fail ----------------------------------------------------------


def _one_request(manager: KVCacheManagerV2, n: int = 14, salt: str | None = None) -> Request:
    r = Request("r", list(range(1, n + 1)), 0, salt=salt)
    manager.create(r)
    manager.resume(r)
    assert manager.allocate(r, n)
    write_kv(manager, r, 0, n)
    manager.commit(r, n)
    return r


def test_check_kv_passes_on_written_pages_and_fails_on_a_corrupted_one():
    manager = make_manager(full_sliding_layers(), 8)
    r = _one_request(manager)
    check_kv(manager, r)
    table = manager.block_table(r, "sliding_w8.1")
    manager.pools.tensors["sliding_w8.1"][0, table[-1], 0, 2] += 1  # one element of the second sliding layer
    with pytest.raises(AssertionError, match="sliding_w8.1"):
        check_kv(manager, r)


def test_check_kv_fails_on_a_split_layout_when_one_layer_of_a_page_is_corrupted():
    manager = make_manager(split_sliding_layers(), 8)
    r = _one_request(manager)
    check_kv(manager, r)
    table = manager.block_table(r, "sliding_w8")
    manager.pools.tensors["sliding_w8"][1, table[-1], 0, 2] += 1  # one element, second layer
    with pytest.raises(AssertionError, match="sliding_w8"):
        check_kv(manager, r)


def test_check_kv_fails_when_a_shared_page_belongs_to_another_group():
    """In a shared arena every group's page has the same shape: a table pointing at another group's page
    holding the same prefix must still read back wrong (values depend on the layer index)."""
    manager = make_manager(full_sliding_layers(window=64), 8, enable_block_reuse=False)
    r = _one_request(manager)
    point_at(manager, r, "sliding_w64.0", 0, manager.block_table(r, "full")[0])  # same tokens, another group's page
    with pytest.raises(AssertionError, match="sliding_w64.0 entry 0"):
        check_kv(manager, r)


def test_check_kv_fails_when_a_table_points_at_another_requests_block():
    manager = make_manager(full_sliding_layers(), 8, enable_block_reuse=False)
    a = _one_request(manager)
    b = Request("b", [9, 9, 9, 9, 9], 0)
    manager.create(b)
    manager.resume(b)
    manager.allocate(b, 5)
    write_kv(manager, b, 0, 5)
    manager.commit(b, 5)
    manager.cache(a).tables["full"][0] = manager.block_table(b, "full")[0]  # simulate a bookkeeping bug
    with pytest.raises(AssertionError, match="full entry 0"):
        check_kv(manager, a)


def test_values_depend_on_the_salt_and_the_whole_prefix():
    assert prefix_values([1, 2, 3], None) != prefix_values([1, 2, 3], "tenant")
    assert prefix_values([5, 2, 3], None)[1:] != prefix_values([1, 2, 3], None)[1:]


def test_check_kv_covers_compressed_entries():
    layers = [LayerKV(0, "csa", 4, window=8, compressed_elems=2, compress_rate=2)]
    manager = make_manager(layers, 8)
    r = _one_request(manager, n=9)
    check_kv(manager, r)
    group = next(g for g in manager.groups if g.compress_rate)
    table = manager.block_table(r, group.name)
    manager.pools.tensors[group.name][0, table[0], 1, 0] = -1.0  # entry 1 = tokens 2..3
    with pytest.raises(AssertionError, match=f"{group.name} entry 1"):
        check_kv(manager, r)
