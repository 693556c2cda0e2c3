"""Test support for the V2 manager and scheduler: synthetic KV written through block tables, checked back.

Every token position gets a value that depends on the whole prefix up to it and on the reuse salt
(a rolling hash), plus the layer's index, so a page that holds the wrong prefix, the wrong salt, the
wrong layer (or another group's page of a shared arena) or stale bytes reads back wrong (layer indices
stay below 16 so values stay exact in float32). Compressed groups get one value per
complete entry of ``c`` tokens. Values stay below 2**24, exact in float32.

``drive`` runs requests through the production loop (:meth:`engine.driver.Driver.run`): the "forward"
writes the scheduled chunks' synthetic KV and samples a token when a chunk reached the end, and every
running request's KV is checked after every step. ``tests/test_kv_v2_harness.py`` proves the checker
fails on corrupted pages.
"""

from __future__ import annotations

import zlib
from typing import Any

import attrs
import torch

from cache_backends import LayerKV, build_layout
from cache_backends.budget import plan_arena, slab_bytes
from cache_backends.interface import ManagerOptions, SchedulerOutput
from cache_backends.pools import BlockPools
from cache_backends.request import Request
from cache_backends.v2 import KVCacheManagerV2, KVCacheV2Scheduler
from cache_backends.v2.radix import PendingPrefix
from engine.driver import Driver, StalledError

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
    # the layer's index (not its position in the group): in a shared arena every group's page is the
    # same G-layer shape, so a page of another group holding the same prefix must still read back wrong
    layer_offsets = torch.tensor(g.layers, dtype=torch.float64) * LAYER_STRIDE
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


def write_kv(manager: KVCacheManagerV2, request: Request, start: int, n: int,
             tokens: list[int] | None = None) -> None:
    """Write the synthetic KV of positions ``[start, start + n)`` of ``request`` (what a forward would); ``tokens``:
    the ids the forward read, when they run past the request's own (draft tokens)."""
    vals = prefix_values((tokens if tokens is not None else request.all_token_ids)[: start + n], request.salt)
    for g in manager.groups:
        entries = _entries(g, start, start + n)  # compressed: the entries whose last token is in the chunk
        if not entries:
            continue
        blocks, offs = _slots(manager, request, g.name, entries)
        expected = _expected(manager, g.name, [_entry_value(vals, g, e) for e in entries])
        t = manager.pools.tensors[g.name][: len(g.layers)]  # a padded group's page: the slots past its layers unused
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
        got = manager.pools.tensors[g.name][: len(g.layers), blocks, offs]  # (layers, entries, elems)
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
    """A V2 manager over fresh pools; ``blocks`` per group (an int gives every group that many; a shared arena
    then gets that many pages per group, the bytes the groups would have had apart)."""
    layout = build_layout(layers, "v2", T, dtype, options.pop("max_page_padding", 0.0))
    if isinstance(blocks, int) and layout.shared:
        blocks = blocks * len(layout.groups)
    counts = blocks if isinstance(blocks, dict) else {g.name: blocks for g in layout.groups}
    options.setdefault("max_seq_len", 4096)
    return KVCacheManagerV2(BlockPools(layout, counts, device), ManagerOptions(**options))


def slab_manager(num_slabs: int, device: str = "cpu") -> KVCacheManagerV2:
    """A V2 manager over a slab arena of ``num_slabs`` slabs: DeepSeek V4-like groups of unequal pages (full: a slab
    a block; sliding_w6: 2 blocks a slab; csa_c8: 4), 2-token blocks, max_seq_len 24, no host tier."""
    layers = [LayerKV(0, "full", 4), LayerKV(1, "csa", 2, window=6, compressed_elems=2, compress_rate=8)]
    layout = build_layout(layers, "v2", 2, "float32")
    plan = plan_arena(layout, num_slabs * slab_bytes(layout), 24)
    return KVCacheManagerV2(BlockPools(layout, plan.num_blocks, device, slabs=plan.slabs),
                            ManagerOptions(max_seq_len=24, host_cache_size=0))


def full_sliding_layers(window: int = 8) -> list[LayerKV]:
    """One full layer and two sliding layers with 4-element entries: equal pages, so the layout shares one arena
    between groups ``full``, ``sliding_w{window}.0`` and ``sliding_w{window}.1`` (one layer each)."""
    return [LayerKV(0, "full", 4), LayerKV(1, "sliding", 4, window=window), LayerKV(2, "sliding", 4, window=window)]


def split_sliding_layers(window: int = 8) -> list[LayerKV]:
    """One full layer with 4-element entries and two sliding layers with 8: other page shapes, so the layout
    keeps a pool per group (``full``, ``sliding_w{window}`` of two layers), split once."""
    return [LayerKV(0, "full", 4), LayerKV(1, "sliding", 8, window=window), LayerKV(2, "sliding", 8, window=window)]


def tied(manager: KVCacheManagerV2) -> bool:
    """Whether the manager ties each cut family of its shared arena into one logical group (``TIE_CUTS``)."""
    return manager._tied_cuts is not None


def cuts_of(manager: KVCacheManagerV2, name: str) -> list[str]:
    """The groups the user sees (``manager.groups``, the cuts) that the manager's own group ``name`` stands for: itself,
    or with the cuts tied its logical group's cuts (one page of each per logical block)."""
    if manager._tied_cuts is None:
        return [name]
    return manager._tied_cuts[manager._names.index(name)]


def own_groups(manager: KVCacheManagerV2) -> list[tuple[Any, list[str]]]:
    """The manager's own groups (its tables, radix runs and pools are keyed by them) with the cuts each stands for:
    ``(group, [group.name])`` for every group, or with the cuts tied ``(logical group, its cuts)``."""
    return [(g, cuts_of(manager, g.name)) for g in manager._groups]


def pool_sets(manager: KVCacheManagerV2) -> list[tuple[Any, list[str]]]:
    """Per pool set (the order of ``extra`` and ``growth_bound_sets``), its pool and the names of the groups the user
    sees in it: the manager's own names, with the cuts tied each logical group's cuts."""
    return [(pool, [cut for name in names for cut in cuts_of(manager, name)]) for pool, names in manager._pool_sets]


def point_at(manager: KVCacheManagerV2, request: Request, group: str, j: int, page: int) -> None:
    """Make position ``j`` of ``group``'s block table of ``request`` read ``page`` (a bookkeeping bug, simulated): the
    table's entry, or with the cuts tied the page its logical block holds for the cut (tables there are logical)."""
    if manager._tied_cuts is None:
        manager.cache(request).tables[group][j] = page
        return
    g, i = manager._cut_of[group]
    arena = manager._arena
    b = manager.cache(request).tables[manager._groups[g].name][j]
    pages = list(arena.pages[b])  # type: ignore[union-attr]
    pages[i] = page
    arena.pages[b] = tuple(pages)  # type: ignore[union-attr]


def blocks_add_up(stats: Any, shared: bool) -> bool:
    """free + evictable + used == total: per group, or for a shared arena its free pages plus every group's."""
    groups = list(stats.groups.values())
    if shared:
        return groups[0].free + sum(g.evictable + g.used for g in groups) == groups[0].total
    return all(g.free + g.evictable + g.used == g.total for g in groups)


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
    """Run requests through the engine's driving loop to completion or a stall, verifying KV and the step limits."""
    result = DriveResult()
    driver = Driver(manager, scheduler)

    def compute(out: SchedulerOutput) -> dict[str, int]:
        result.max_running = max(result.max_running, len(driver.running))
        assert len(driver.running) <= scheduler.max_batch_size
        assert out.num_tokens <= scheduler.max_num_tokens
        tokens = {}
        for chunk in out.scheduled:
            r = chunk.request
            assert r in driver.running
            write_kv(manager, r, r.num_computed_tokens, chunk.num_tokens)
            if r.num_computed_tokens + chunk.num_tokens == r.num_tokens:
                tokens[r.req_id] = next_token(r)
        return tokens

    def stepped(clock: int, stats: Any) -> None:
        result.steps += 1
        result.outputs.append(stats.output)
        result.finished += stats.finished
        if result.steps >= max_steps and driver.has_work:
            raise AssertionError(f"no completion after {max_steps} steps")
        if check:
            for r in driver.running:
                check_kv(manager, r)
            manager.check_invariants()
            assert manager.usage() == manager.stats().usage  # the simulator samples usage() alone, every step

    try:
        driver.run(requests, compute, on_step=stepped)
    except StalledError as exc:
        result.stalled = str(exc)
    return result


FULL = [LayerKV(0, "full", 4)]


def admit(manager: KVCacheManagerV2, request: Request) -> None:
    manager.create(request)
    assert manager.resume(request)


def compute(manager: KVCacheManagerV2, request: Request, n: int) -> None:
    """Allocate, 'run the forward' (write synthetic KV) and commit ``n`` tokens."""
    assert manager.allocate(request, n)
    write_kv(manager, request, request.num_computed_tokens, n)
    manager.commit(request, n)


def prefill(manager: KVCacheManagerV2, request: Request) -> None:
    admit(manager, request)
    compute(manager, request, request.num_tokens - request.num_computed_tokens)


def arena_owner(arena: Any, b: int) -> object:
    """Page / logical block ``b``'s owner on a shared or tied arena, as state comparisons read it: None, a pending
    prefix by its request and position, or a keyed run by its start, length and the block's position."""
    node = arena.node[b]
    if node is None:
        return None
    if isinstance(node, PendingPrefix):
        return ("pending", node.request.req_id, arena.pos[b])
    return ("run", node.start, len(node.held), arena.pos[b])

