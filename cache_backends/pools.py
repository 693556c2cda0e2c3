"""Device block pools: one tensor per layer group, allocated with ``torch.empty`` (no zero fill).

The memory contract, shared by the managers, the host tier and the paged attention:

* ``tensors[g]`` has shape ``(group.page_layers, num_blocks[g], group.entries_per_block, group.entry_elems)``
  — layer-major, so one layer's blocks are contiguous and ``layer_slots(g, i)`` is a view.
* Token position ``p`` of a sequence lives in logical block ``p // T`` at offset ``p % T`` (``T`` =
  ``group.tokens_per_block``); the group's block table maps logical block → physical block id, and
  the flat slot inside ``layer_slots`` is ``physical * entries_per_block + offset``.
  Compressed groups store entry ``e = p // compress_rate`` at logical block ``e // entries_per_block``.
* A shared layout (:attr:`KvLayout.shared`: every group's block is the same ``G``-layer page) gets ONE
  arena tensor ``(G, P, entries_per_block, entry_elems)`` and every group's ``tensors[g]`` *is* that
  arena, with ``num_blocks[g] == P``: block ids are global (a block belongs to whichever group the
  manager handed it to), and the layer-major contract above holds unchanged for every group. A padded group
  (``group.padding`` > 0: fewer layers than the page holds) views the whole page too; its layer ``i`` is slot ``i``,
  and the slots past its layers are never read or written (``tensors[g].shape[0] == group.page_layers``).
* A slab arena (``slabs``: groups of unequal pages, each dividing the largest, drawing on one budget;
  ``cache_backends.v2.slab_pool``) is ONE tensor of ``slabs`` slabs of the largest page, and ``num_blocks[g] ==
  slabs * k_g`` block ids per group (``k_g`` = largest page / the group's page); block ``b`` of group ``g`` lies in
  slab ``b // k_g`` at page ``b % k_g``, so at byte ``b * page_g``: every group's blocks are a block-major view
  ``(slabs * k_g, layers, entries_per_block, entry_elems)`` of the one tensor, whichever group owns a slab now.
  ``tensors[g]`` is that view transposed to the layer-major shape above (``[:, b]`` is block ``b``, as in split
  pools), but a layer's blocks are no longer contiguous: block ``b`` of layer ``i`` starts ``b * layers *
  entries_per_block`` entries into the group's rows, so ``layer_slots(g, i)`` is the group's rows from layer ``i``'s
  first entry on, and the flat slot is ``physical * block_slots[g] + offset`` with ``block_slots[g] = layers *
  entries_per_block`` (``entries_per_block`` for every other pool). Readers that take ``block_slots`` (the gather
  paths, DeepSeek V4's forward) read an arena as they read split pools; the in-place kernels (flex, the paged
  decode kernels) assume ``entries_per_block`` and are not used on one.
* Attention layers (full, sliding): ``entry_elems == 2 * kv_heads * head_dim``, viewed as
  ``(2, kv_heads, head_dim)``: K at index 0, V at index 1. MLA: the latent, then the rope part.
"""

from __future__ import annotations

from typing import Any

import torch

from cache_backends.layout import KvLayout, LayerGroup

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


class BlockPools:
    """The device tensors of a KV layout; :meth:`release` (or a failed allocation) frees them all."""

    def __init__(self, layout: KvLayout, num_blocks: dict[str, int], device: str | torch.device,
                 slabs: int | None = None) -> None:
        missing = [g.name for g in layout.groups if num_blocks.get(g.name, 0) < 1]
        if missing:
            raise ValueError(f"every layer group needs at least one block; none for {', '.join(missing)}")
        self.layout = layout
        self.num_blocks = dict(num_blocks)
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[layout.dtype]
        #: a slab arena's slabs (None: a pool per group, or a shared arena) and its slab's bytes (the largest page)
        self.slabs = slabs
        self.slab_bytes = max(g.bytes_per_block for g in layout.groups)
        if slabs is not None:
            check_slab_layout(layout, self.num_blocks, slabs)
        self.groups: dict[str, LayerGroup] = {g.name: g for g in layout.groups}
        self.tensors: dict[str, torch.Tensor] = {}
        #: a block's slots in a layer's view (``layer_slots``): a flat slot is ``block * block_slots[g] + offset``
        self.block_slots: dict[str, int] = {g.name: g.entries_per_block for g in layout.groups}
        #: a slab arena's one tensor (``slabs * slab_bytes`` bytes in the KV dtype), None without one
        self.arena: torch.Tensor | None = None
        #: views of these tensors that readers build once and keep (paged attention's per-layer K/V views);
        #: :meth:`release` drops them with the tensors, so no kept view holds the memory
        self.views: dict[Any, Any] = {}
        if layout.shared and len({self.num_blocks[g.name] for g in layout.groups}) > 1:
            raise ValueError("a shared arena has one block count for every group, got "
                             + ", ".join(f"{g.name} {self.num_blocks[g.name]}" for g in layout.groups))
        try:
            if slabs is not None:
                self._build_slab_arena(slabs)
            arena: torch.Tensor | None = None
            for g in layout.groups if slabs is None else ():
                # a padded group's blocks are the arena's whole pages: its layers use the first slots of each
                shape = (g.page_layers, self.num_blocks[g.name], g.entries_per_block, g.entry_elems)
                if layout.shared and arena is not None:
                    self.tensors[g.name] = arena  # every group views the one arena (block ids are global)
                    continue
                self.tensors[g.name] = arena = torch.empty(shape, dtype=self.dtype, device=self.device)
        except BaseException:
            self.release()
            raise
        # layer index -> (group name, position of the layer inside the group), for every group holding it
        self.layer_index: dict[int, list[tuple[str, int]]] = {}
        for g in layout.groups:
            for pos, layer in enumerate(g.layers):
                self.layer_index.setdefault(layer, []).append((g.name, pos))

    def _build_slab_arena(self, slabs: int) -> None:
        """One tensor of ``slabs`` slabs; each group's blocks a view of all of it (see the module docstring)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        self.arena = torch.empty(slabs * self.slab_bytes // size, dtype=self.dtype, device=self.device)
        for g in self.layout.groups:
            per = self.slab_bytes // g.bytes_per_block
            blocks = self.arena.view(slabs * per, g.page_layers, g.entries_per_block, g.entry_elems)
            self.tensors[g.name] = blocks.transpose(0, 1)  # layer-major, as split pools: [:, b] is block b
            self.block_slots[g.name] = g.page_layers * g.entries_per_block

    @property
    def arena_bytes(self) -> int | None:
        """A slab arena's bytes (every group's memory together), or None without one."""
        return None if self.slabs is None else self.slabs * self.slab_bytes

    @property
    def shared(self) -> bool:
        """Whether every group's blocks come from one arena (:attr:`KvLayout.shared`)."""
        return self.layout.shared

    @property
    def nbytes(self) -> int:
        """Bytes held on the device (a shared arena counted once; a slab arena's, the slabs')."""
        if self.arena is not None:
            return self.arena.numel() * self.arena.element_size()
        unique = {id(t): t for t in self.tensors.values()}
        return sum(t.numel() * t.element_size() for t in unique.values())

    def layer_slots(self, group: str, layer_pos: int) -> torch.Tensor:
        """One layer's entries in a group as a ``(slots, entry_elems)`` view, slot ``block * block_slots[group] +
        offset`` (split pools: ``num_blocks * entries_per_block`` slots; a slab arena: the group's rows from this
        layer's first entry on, every other layer's entries between two of its blocks)."""
        g = self.groups[group]
        if self.slabs is None:
            return self.tensors[group][layer_pos].view(self.num_blocks[group] * g.entries_per_block, g.entry_elems)
        rows = self.tensors[group].transpose(0, 1).view(-1, g.entry_elems)  # the block-major rows
        first = layer_pos * g.entries_per_block
        return rows[first:first + (self.num_blocks[group] - 1) * self.block_slots[group] + g.entries_per_block]

    def block(self, group: str, block_id: int) -> torch.Tensor:
        """Every layer's data of one physical block: ``(n_layers, entries_per_block, entry_elems)`` (a view)."""
        return self.tensors[group][:, block_id]

    def release(self) -> None:
        """Drop the device tensors (idempotent); the caching allocator gets the memory back."""
        self.tensors.clear()
        self.views.clear()
        self.arena = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def released(self) -> bool:
        """Whether :meth:`release` ran."""
        return not self.tensors

    def describe(self) -> dict[str, Any]:
        """Per-group blocks and bytes, for events and reports (a shared arena's groups each show the whole arena; a slab
        arena's show none: no group's share is fixed)."""
        if self.slabs is not None:  # a slab arena: a group's ids span every slab, its share of them is not fixed
            return {name: {"blocks": None, "bytes": None, "shape": list(t.shape), "shared": False, "arena": True}
                    for name, t in self.tensors.items()}
        return {
            name: {"blocks": self.num_blocks[name], "bytes": t.numel() * t.element_size(), "shape": list(t.shape),
                   "shared": self.shared}
            for name, t in self.tensors.items()
        }


def check_slab_layout(layout: KvLayout, num_blocks: dict[str, int], slabs: int) -> None:
    """``ValueError`` unless ``layout`` can be a slab arena of ``slabs`` slabs with ``num_blocks`` ids per group."""
    if layout.shared or len(layout.groups) < 2:
        raise ValueError("a slab arena is for several layer groups of unequal pages (pool_arena)")
    slab = max(g.bytes_per_block for g in layout.groups)
    odd = [g.name for g in layout.groups if slab % g.bytes_per_block]
    if odd:
        raise ValueError(f"a slab arena needs every page to divide the largest ({slab} B); not {', '.join(odd)}")
    wrong = [g.name for g in layout.groups if num_blocks[g.name] != slabs * (slab // g.bytes_per_block)]
    if wrong:
        raise ValueError(f"a slab arena of {slabs} slabs gives each group slabs x blocks a slab ids; not "
                         f"{', '.join(wrong)}")


#: Dtypes scattered through a ``uint8`` view of the same bytes: torch's CPU ``index_copy`` has no float8 kernel
_BYTE_SCATTERED = (torch.float8_e4m3fn, torch.float8_e5m2)
#: :func:`move_pages` between two host tensors copies page by page (tests turn it off to run the device path's gather
#: and scatter on host bytes)
HOST_PAGE_BY_PAGE = True


def even_run(ids: list[int]) -> slice | None:
    """``ids`` (two or more) as one slice when they step evenly upwards, else None."""
    a, s = ids[0], ids[1] - ids[0]
    if s > 0 and ids == list(range(a, a + len(ids) * s, s)):
        return slice(a, a + (len(ids) - 1) * s + 1, s)
    return None


def move_pages(dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int],
               non_blocking: bool = False) -> None:
    """``dst[dst_ids] = src[src_ids]`` along dim 0 of two block-major views (a page a row; either may be on the host)
    for distinct ``dst_ids``: one slice copy where both lists step evenly; else, with a device (or unbacked ``meta``
    tensors) on either side, a slice where one list steps evenly and one gather on ``src``'s device and one scatter on
    ``dst``'s for the other, so ``n`` pages cost at most one host <-> device transfer and a few launches instead of
    ``n``; both in host memory, page by page.

    ``non_blocking`` (pinned host memory): the transfer is queued as the per-page copies were; a gather of host pages
    goes through pinned memory so it stays asynchronous, and a scatter on the host waits for the pages it reads."""
    n = len(dst_ids)
    if dst.is_meta and src.is_meta:  # unbacked (a simulation's host tier and pools): no bytes to move
        # torch's meta gather and scatter only check the lists' lengths, through Python decompositions: 17 us for 4
        # scattered pages, 190 us for 8, on every write-back and resume of a simulation (as ``_copy_pages`` in
        # cache_backends/v2/manager.py skips them, "perf59"); checked here instead: the lengths, and the ids
        if len(src_ids) != n:
            raise ValueError(f"{n} destination pages for {len(src_ids)} source pages")
        if n and (max(dst_ids) >= dst.shape[0] or max(src_ids) >= src.shape[0]
                  or min(dst_ids) < -dst.shape[0] or min(src_ids) < -src.shape[0]):
            raise IndexError(f"page ids {dst_ids} <- {src_ids} outside {dst.shape[0]} / {src.shape[0]} pages")
        return
    # one page: the plain copy (an index tensor and a gather would only add launches); the moved bytes are the same
    if n < 2:
        if n:
            dst[dst_ids[0]].copy_(src[src_ids[0]], non_blocking=non_blocking)
        return
    if dst_ids[0] > dst_ids[-1]:  # a descending run read backwards: the same pairs
        dst_ids, src_ids = dst_ids[::-1], src_ids[::-1]
    take, put = even_run(src_ids), even_run(dst_ids)
    if take is not None and put is not None:
        dst[put].copy_(src[take], non_blocking=non_blocking)
        return
    if HOST_PAGE_BY_PAGE and src.device.type == dst.device.type == "cpu":
        # both in host memory: no launch or transfer to save, and a gather's temporary costs more than the copies
        # (400 pages of 256 KiB: ~20 ms page by page, 0.8-0.9 s through index_select's new tensor of a layer-major
        # arena's blocks, its fresh memory faulted in)
        for d, s in zip(dst_ids, src_ids, strict=True):
            dst[d].copy_(src[s])
        return
    # a slice of the source only where no scatter on its device follows: torch refuses to scatter a tensor's view
    # into the tensor itself (one arena's blocks), so there the gather copies
    if take is not None and src.device != dst.device:
        pages = src[take]
    else:
        index = torch.tensor(src_ids, dtype=torch.long, device=src.device)
        if non_blocking and src.device.type == "cpu":  # (pinned memory: torch keeps it until the upload is done)
            pages = torch.index_select(src, 0, index, out=torch.empty((n, *src.shape[1:]), dtype=src.dtype,
                                                                      pin_memory=True))
        else:
            pages = src.index_select(0, index)
    if put is not None:
        dst[put].copy_(pages, non_blocking=non_blocking)
        return
    # the scatter runs where dst is; a download waits (``non_blocking`` would land in pinned memory the host scatter
    # could read before the pages arrive)
    pages = pages.to(dst.device, non_blocking=non_blocking and dst.device.type != "cpu")
    index = torch.tensor(dst_ids, dtype=torch.long, device=dst.device)
    if dst.dtype in _BYTE_SCATTERED:
        dst.view(torch.uint8).index_copy_(0, index, pages.view(torch.uint8))
    else:
        dst.index_copy_(0, index, pages)
