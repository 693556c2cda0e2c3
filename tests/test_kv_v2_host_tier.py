"""V2's host tier moves many pages per call (``HostTier.write_many`` / ``load_many``, ``pools.move_pages``): the same
pages land in the same slots and blocks as the one-block-at-a-time copies they replace, on split pools and on a
shared arena (whose groups share one host tensor), for float32 and float8 pages; a suspend and a resume each copy
their pages in one call. Host tensors copy page by page (``pools.HOST_PAGE_BY_PAGE``); ``gather`` runs the device
path's gather and scatter on them instead, so its bytes are checked without a GPU."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_backends import build_layout
from cache_backends import pools as pools_module
from cache_backends.pools import BlockPools, move_pages
from cache_backends.request import Request
from cache_backends.v2 import host_tier as host_tier_module
from cache_backends.v2.host_tier import HostTier
from tests.kv_v2_support import admit, full_sliding_layers, make_manager, split_sliding_layers

LAYOUTS = {"split": split_sliding_layers, "shared": full_sliding_layers}
BLOCKS, SLOTS = 12, 10


def _random_bytes(t: torch.Tensor, gen: torch.Generator) -> None:
    """Random bits in every element of ``t`` (through a byte view: any dtype)."""
    flat = t.view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def _tier(layout_name: str, dtype: str, seed: int) -> HostTier:
    layout = build_layout(LAYOUTS[layout_name](), "v2", 4, dtype)
    pools = BlockPools(layout, {g.name: BLOCKS for g in layout.groups}, "cpu")
    tier = HostTier(pools, {g.name: SLOTS for g in layout.groups})
    gen = torch.Generator().manual_seed(seed)
    for t in {id(t): t for t in [*pools.tensors.values(), *tier.tensors.values()]}.values():
        _random_bytes(t, gen)
    return tier


def _bytes(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A byte copy of each group's tensor; groups that share a tensor (a shared arena and tier) share the copy."""
    copies: dict[int, torch.Tensor] = {}
    return {name: copies.setdefault(id(t), t.view(torch.uint8).clone()) for name, t in tensors.items()}


@st.composite
def _moves(draw, layout_name: str, repeat_blocks: bool) -> dict[str, tuple[list[int], list[int]]]:
    """Per group, distinct slots (a shared tier: distinct across groups, one tensor) paired with blocks (distinct
    unless ``repeat_blocks``; a shared arena: distinct across groups too, as block ids are global)."""
    names = [g.name for g in build_layout(LAYOUTS[layout_name](), "v2", 4, "float32").groups]
    shared = layout_name == "shared"
    slot_pool = draw(st.permutations(range(SLOTS)))
    block_pool = draw(st.permutations(range(BLOCKS)))
    moves, used_slots, used_blocks = {}, 0, 0
    for name in names:
        n = draw(st.integers(0, min(6, SLOTS - used_slots if shared else SLOTS)))
        slots = list(slot_pool[used_slots:used_slots + n] if shared else draw(st.permutations(range(SLOTS)))[:n])
        if repeat_blocks:
            blocks = draw(st.lists(st.integers(0, BLOCKS - 1), min_size=n, max_size=n))
        else:
            blocks = list(block_pool[used_blocks:used_blocks + n] if shared
                          else draw(st.permutations(range(BLOCKS)))[:n])
        if draw(st.booleans()):  # runs that step evenly: the slice paths
            start, step = draw(st.integers(0, 2)), draw(st.sampled_from([1, 2, -1]))
            run = [start + step * i if step > 0 else SLOTS - 1 - start - i for i in range(n)]
            if not shared and all(0 <= s < SLOTS for s in run):
                slots = run
        moves[name] = (slots, blocks)
        used_slots, used_blocks = used_slots + (n if shared else 0), used_blocks + (n if shared else 0)
    return moves


@pytest.mark.parametrize("gather", [False, True])
@settings(max_examples=100, deadline=None)
@given(data=st.data(), layout_name=st.sampled_from(sorted(LAYOUTS)),
       dtype=st.sampled_from(["float32", "float8_e4m3fn"]), seed=st.integers(0, 2**16))
def test_batched_host_copies_move_the_pages_the_per_block_copies_did(gather, data, layout_name, dtype, seed):
    with mock.patch.object(pools_module, "HOST_PAGE_BY_PAGE", not gather):
        _check_batched_host_copies(data, layout_name, dtype, seed)


def _check_batched_host_copies(data, layout_name, dtype, seed):
    tier = _tier(layout_name, dtype, seed)
    pools = tier.pools
    # store: device blocks (a block may go to several slots: suspended caches sharing a cached page) into slots
    moves = data.draw(_moves(layout_name, repeat_blocks=True))
    want = _bytes(tier.tensors)
    for name, (slots, blocks) in moves.items():
        for slot, b in zip(slots, blocks, strict=True):
            want[name][slot].copy_(pools.tensors[name][:, b].view(torch.uint8))
    devices = _bytes(pools.tensors)
    tier.write_many(moves)
    for name in moves:
        assert torch.equal(tier.tensors[name].view(torch.uint8), want[name]), name
        assert torch.equal(pools.tensors[name].view(torch.uint8), devices[name]), name  # the source untouched
    n_pages = {name: len(slots) for name, (slots, _) in moves.items()}
    assert tier.bytes_stored == sum(pools.groups[name].bytes_per_block * n for name, n in n_pages.items())

    # load: slots back into distinct device blocks
    moves = data.draw(_moves(layout_name, repeat_blocks=False))
    want = _bytes(pools.tensors)
    for name, (slots, blocks) in moves.items():
        for slot, b in zip(slots, blocks, strict=True):
            want[name][:, b].copy_(tier.tensors[name][slot].view(torch.uint8))
    hosts = _bytes(tier.tensors)
    tier.load_many(moves)
    for name in moves:
        assert torch.equal(pools.tensors[name].view(torch.uint8), want[name]), name
        assert torch.equal(tier.tensors[name].view(torch.uint8), hosts[name]), name
    assert tier.bytes_loaded == sum(pools.groups[name].bytes_per_block * len(slots)
                                    for name, (slots, _) in moves.items())


@pytest.mark.parametrize("gather", [False, True])
@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 8), data=st.data(), dtype=st.sampled_from([torch.float32, torch.float8_e5m2]))
def test_moving_pages_between_two_tensors_is_the_per_page_copy(gather, n, data, dtype):
    with mock.patch.object(pools_module, "HOST_PAGE_BY_PAGE", not gather):
        _check_moving_pages(n, data, dtype)


def _check_moving_pages(n, data, dtype):
    src = torch.randint(0, 256, (9, 2, 12), dtype=torch.uint8).view(dtype)
    dst = torch.randint(0, 256, (11, 2, 12), dtype=torch.uint8).view(dtype)
    dst_ids = data.draw(st.permutations(range(11)))[:n]
    src_ids = data.draw(st.lists(st.integers(0, 8), min_size=n, max_size=n))
    if data.draw(st.booleans()):
        dst_ids = data.draw(st.sampled_from([list(range(n)), list(range(10, 10 - n, -1)), list(range(0, 2 * n, 2))]))
        dst_ids = dst_ids if all(0 <= d < 11 for d in dst_ids) else list(range(n))
    want = dst.view(torch.uint8).clone()
    for d, s in zip(dst_ids, src_ids, strict=True):
        want[d] = src.view(torch.uint8)[s]
    move_pages(dst, dst_ids, src, src_ids)
    assert torch.equal(dst.view(torch.uint8), want)


@pytest.mark.parametrize(("dst_ids", "src_ids", "error"), [
    ([0, 3, 1], [2, 0, 9], IndexError),  # a source page past the 9 pages
    ([11, 2], [0, 1], IndexError),  # a destination page past the 11 pages
    ([0, 1, 2], [3, 4], ValueError),  # lists of two lengths
])
def test_unbacked_pages_refuse_the_ids_backed_ones_refuse(dst_ids, src_ids, error):
    """A simulation's pools and host tier are unbacked (``meta``): nothing moves, but a page id past either tensor
    or lists of two lengths are refused as on real memory. (torch's meta gather cannot check an id: a page past the
    pool went through unnoticed in a simulation and failed only on real memory.)"""
    with pytest.raises((error, RuntimeError)):  # (torch's own words on real memory: a shape mismatch)
        move_pages(torch.empty((11, 2, 12)), dst_ids, torch.empty((9, 2, 12)), src_ids)
    with pytest.raises(error):
        move_pages(torch.empty((11, 2, 12), device="meta"), dst_ids, torch.empty((9, 2, 12), device="meta"), src_ids)
    move_pages(torch.empty((11, 2, 12), device="meta"), [5, 0, 10], torch.empty((9, 2, 12), device="meta"), [8, 8, 0])


def test_a_suspend_and_a_resume_each_copy_their_pages_in_one_call(monkeypatch):
    m = make_manager(full_sliding_layers(window=64), 12, dtype="bfloat16", enable_block_reuse=False)
    r = Request("a", list(range(1, 23)), 0)  # 22 tokens: 6 blocks in each of 3 groups, none cached
    admit(m, r)
    assert m.allocate(r, 22)
    for t in m.pools.tensors.values():
        t.copy_(torch.randn(t.shape).to(t.dtype))
    m.commit(r, 22)
    saved = {g.name: [m.pools.tensors[g.name][:, b].clone() for b in m.block_table(r, g.name)] for g in m.groups}
    calls = []

    def counted(*args, **kwargs):
        calls.append(len(args[1]))
        return move_pages(*args, **kwargs)

    monkeypatch.setattr(host_tier_module, "move_pages", counted)
    assert m.suspend(r)
    assert calls == [18] and m.host.bytes_stored == 18 * m.pools.groups["full"].bytes_per_block
    for t in m.pools.tensors.values():
        t.zero_()
    calls.clear()
    assert m.resume(r)
    assert calls == [18]
    for g in m.groups:
        for b, page in zip(m.block_table(r, g.name), saved[g.name], strict=True):
            assert torch.equal(m.pools.tensors[g.name][:, b], page), g.name
    m.check_invariants()
