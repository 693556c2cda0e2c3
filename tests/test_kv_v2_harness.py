"""Test harness for the V2 manager and scheduler: synthetic KV written through block tables, checked back.

Every token position gets a value that depends on the whole prefix up to it and on the reuse salt
(a rolling hash), plus the layer's position in its group, so a page that holds the wrong prefix,
the wrong salt, the wrong layer or stale bytes reads back wrong. Compressed groups get one value per
complete entry of ``c`` tokens. Values stay below 2**24, exact in float32.

``drive`` runs the loop of ``cache_backends/interface.py``: step, write the scheduled chunks, commit,
sample a token when a chunk reached the end, finish at ``max_new_tokens`` — checking every running
request's KV after every step. The tests below prove the checker fails on corrupted pages.
"""

from __future__ import annotations

import zlib
from collections import deque
from typing import Any

import attrs
import pytest
import torch

from cache_backends import LayerKV, build_layout
from cache_backends.interface import ManagerOptions, SchedulerOutput
from cache_backends.pools import BlockPools
from cache_backends.request import Request
from cache_backends.v2 import KVCacheManagerV2, KVCacheV2Scheduler

LAYER_STRIDE = 1 << 20


def prefix_values(tokens: list[int], salt: str | None) -> list[int]:
    """A value per position that depends on every token up to it and on the salt (all < 2**20)."""
    h = zlib.crc32((salt or "").encode()) % 997
    out = []
    for t in tokens:
        h = (h * 31 + t + 1) % LAYER_STRIDE
        out.append(h)
    return out


def _slots(manager: KVCacheManagerV2, request: Request, group: str, positions: list[int]):
    """(block ids, offsets) of ``positions`` — token positions, or entry indices for compressed groups."""
    g = manager.pools.groups[group]
    table = manager.block_table(request, group)
    blocks = [table[p // g.entries_per_block] for p in positions]
    if any(b < 0 for b in blocks):
        raise AssertionError(f"{request.req_id}: group {group} has no block for entries {positions}")
    device = manager.pools.device
    return (torch.tensor(blocks, device=device),
            torch.tensor([p % g.entries_per_block for p in positions], device=device))


def _expected(manager: KVCacheManagerV2, group: str, values: list[int]) -> torch.Tensor:
    g = manager.pools.groups[group]
    layer_offsets = torch.arange(len(g.layers), dtype=torch.float64) * LAYER_STRIDE
    vals = torch.tensor(values, dtype=torch.float64)
    expected = (vals[None, :] + layer_offsets[:, None]).to(manager.pools.dtype)  # (layers, positions)
    return expected.to(manager.pools.device)


def _entries(group, start: int, end: int) -> list[int]:
    """Indices of a group's entries (tokens, or compressed entries) completed by positions [start, end)."""
    c = group.compress_rate or 1
    return list(range(start // c, end // c)) if c > 1 else list(range(start, end))


def _entry_value(vals: list[int], group, e: int) -> int:
    c = group.compress_rate or 1
    return vals[(e + 1) * c - 1] if c > 1 else vals[e]


def write_kv(manager: KVCacheManagerV2, request: Request, start: int, n: int) -> None:
    """Write the synthetic KV of positions ``[start, start + n)`` of ``request`` (what a forward would)."""
    vals = prefix_values(request.all_token_ids[: start + n], request.salt)
    for g in manager.groups:
        entries = _entries(g, start, start + n)  # compressed: the entries whose last token is in the chunk
        if not entries:
            continue
        blocks, offs = _slots(manager, request, g.name, entries)
        expected = _expected(manager, g.name, [_entry_value(vals, g, e) for e in entries])
        t = manager.pools.tensors[g.name]
        t[:, blocks, offs] = expected[:, :, None].expand(-1, -1, g.entry_elems)


def live_entries(manager: KVCacheManagerV2, request: Request, group) -> list[int]:
    """The entries of ``group`` an attention step would read now: all, or the window's."""
    committed = manager.cache(request).committed
    if group.compress_rate:
        return _entries(group, 0, committed)
    start = 0 if group.window is None else max(0, committed - group.window + 1)
    return list(range(start, committed))


def check_kv(manager: KVCacheManagerV2, request: Request) -> None:
    """Assert that every live entry of ``request`` holds its synthetic value, in every group and layer."""
    committed = manager.cache(request).committed
    vals = prefix_values(request.all_token_ids[:committed], request.salt)
    for g in manager.groups:
        entries = live_entries(manager, request, g)
        if not entries:
            continue
        blocks, offs = _slots(manager, request, g.name, entries)
        got = manager.pools.tensors[g.name][:, blocks, offs]  # (layers, entries, elems)
        want = _expected(manager, g.name, [_entry_value(vals, g, e) for e in entries])
        bad = (got != want[:, :, None]).any(dim=-1).any(dim=0)
        if bad.any():
            first = int(bad.nonzero()[0].item())
            raise AssertionError(
                f"{request.req_id}: group {g.name} entry {entries[first]} holds {got[:, first, 0].tolist()}, "
                f"expected {want[:, first].tolist()}"
            )


def next_token(request: Request) -> int:
    """A deterministic 'sampled' token."""
    return (zlib.crc32(request.req_id.encode()) + 7 * request.num_tokens) % 50


def make_manager(layers: list[LayerKV], blocks: int | dict[str, int], *, T: int = 4, dtype: str = "float32",
                 device: str = "cpu", **options: Any) -> KVCacheManagerV2:
    """A V2 manager over fresh pools; ``blocks`` per group (an int gives every group that many)."""
    layout = build_layout(layers, "v2", T, dtype)
    counts = blocks if isinstance(blocks, dict) else {g.name: blocks for g in layout.groups}
    options.setdefault("max_seq_len", 4096)
    return KVCacheManagerV2(BlockPools(layout, counts, device), ManagerOptions(**options))


def full_sliding_layers(window: int = 8) -> list[LayerKV]:
    """One full layer and two sliding layers (two layers in one group) with 4-element entries."""
    return [LayerKV(0, "full", 4), LayerKV(1, "sliding", 4, window=window), LayerKV(2, "sliding", 4, window=window)]


@attrs.define
class DriveResult:
    """What a driven run did."""

    steps: int = 0
    outputs: list[SchedulerOutput] = attrs.Factory(list)
    finished: list[Request] = attrs.Factory(list)
    stalled: str | None = None
    max_running: int = 0

    def count(self, field: str) -> int:
        """Total of one ``SchedulerOutput`` list field over the run."""
        return sum(len(getattr(o, field)) for o in self.outputs)


def drive(manager: KVCacheManagerV2, scheduler: KVCacheV2Scheduler, requests: list[Request],
          max_steps: int = 5000, check: bool = True) -> DriveResult:
    """Run the interface's driving loop to completion or a stall, verifying KV and the step limits."""
    waiting: deque[Request] = deque(requests)
    running: list[Request] = []
    result = DriveResult()
    while waiting or running:
        if result.steps >= max_steps:
            raise AssertionError(f"no completion after {max_steps} steps")
        out = scheduler.step(waiting, running)
        result.steps += 1
        result.outputs.append(out)
        result.max_running = max(result.max_running, len(running))
        assert len(running) <= scheduler.max_batch_size
        assert out.num_tokens <= scheduler.max_num_tokens
        if out.stalled:
            assert not out.scheduled
            result.stalled = out.stalled
            return result
        assert out.scheduled, "a step that is not stalled schedules something"
        for chunk in out.scheduled:
            r = chunk.request
            assert r in running
            write_kv(manager, r, r.num_computed_tokens, chunk.num_tokens)
            manager.commit(r, chunk.num_tokens)
        for chunk in out.scheduled:
            r = chunk.request
            if r.num_computed_tokens == r.num_tokens:
                if len(r.output_token_ids) >= r.max_new_tokens:
                    scheduler.finish(r, "length")
                    running.remove(r)
                    result.finished.append(r)
                else:
                    r.output_token_ids.append(next_token(r))
        if check:
            for r in running:
                check_kv(manager, r)
            manager.check_invariants()
    return result


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
    table = manager.block_table(r, "sliding_w8")
    manager.pools.tensors["sliding_w8"][1, table[-1], 0, 2] += 1  # one element, second layer
    with pytest.raises(AssertionError, match="sliding_w8"):
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
