"""The host tier: CPU memory (pinned when the pools are on CUDA) that suspended caches' pages move to.

One tensor per layer group, block-major — ``tensors[g]`` has shape
``(slots, group.page_layers, entries_per_block, entry_elems)`` so each slot is one contiguous page —
and a free list of slots. A shared layout (one device arena for every group) gets one host tensor and
one free list too, which every group's ``tensors[g]`` / slots name, sized for the arena once. Copies
are whole blocks, every layer, so a round trip is byte-exact; :meth:`write`, :meth:`write_many` and :meth:`load_many`
move many blocks in one gather and one copy per host tensor (:func:`cache_backends.pools.move_pages`).
On CUDA the copies are ``non_blocking`` from/to pinned memory and :meth:`sync` waits for them;
callers sync before a slot or a device block is handed to anyone else.
"""

from __future__ import annotations

import torch

from cache_backends.budget import AUTO_HOST_FRACTION, host_available_bytes, host_tier_slots
from cache_backends.pools import BlockPools, move_pages

__all__ = ["AUTO_HOST_FRACTION", "HostTier", "available_host_bytes", "host_slots"]


def available_host_bytes() -> int:
    """Memory this machine can give without swapping (``MemAvailable``; 0 when the OS does not say).

    The same probe the build stage checks host memory with, so the two agree.
    """
    return host_available_bytes() or 0


def host_slots(pools: BlockPools, host_cache_size: int | None) -> dict[str, int]:
    """Slots per group for a host budget (:func:`cache_backends.budget.host_tier_slots`).

    For the auto size, pools that live on the host count against the memory available to the tier,
    as the plan counts them (``torch.empty`` has not touched their pages yet, so the OS does not).
    """
    available = available_host_bytes()
    if pools.device.type == "cpu":
        available -= pools.nbytes
    return host_tier_slots(pools.layout, pools.num_blocks, host_cache_size, available)


class HostTier:
    """Host copies of device blocks, by slot; :meth:`release` frees the memory (idempotent)."""

    def __init__(self, pools: BlockPools, slots: dict[str, int]) -> None:
        self.pools = pools
        self.pinned = pools.device.type == "cuda"
        where = "meta" if pools.device.type == "meta" else "cpu"  # unbacked pools (a simulation): an unbacked tier
        self.num_slots = dict(slots)
        self.tensors: dict[str, torch.Tensor] = {}
        self._free: dict[str, list[int]] = {}
        self._used = dict.fromkeys(self.num_slots, 0)  # slots each group's suspended pages hold
        #: bytes copied device -> host (suspends) and host -> device (resumes) so far: what the host link carried
        self.bytes_stored = 0
        self.bytes_loaded = 0
        self.shared = pools.shared and len(self.num_slots) > 1
        if self.shared and len(set(self.num_slots.values())) > 1:
            raise ValueError(f"a shared host tier has one slot count for every group, got {self.num_slots}")
        try:
            for name, n in self.num_slots.items():
                if self.shared and self.tensors:  # the first group's tensor and free list serve every group
                    first = next(iter(self.tensors))
                    self.tensors[name], self._free[name] = self.tensors[first], self._free[first]
                    continue
                g = pools.groups[name]
                shape = (n, g.page_layers, g.entries_per_block, g.entry_elems)  # a whole page, padding included
                self.tensors[name] = torch.empty(shape, dtype=pools.dtype, device=where, pin_memory=self.pinned)
                self._free[name] = list(range(n - 1, -1, -1))
        except BaseException:
            self.release()
            raise

    @property
    def nbytes(self) -> int:
        """Host bytes held (a shared tensor counted once)."""
        unique = {id(t): t for t in self.tensors.values()}
        return sum(t.numel() * t.element_size() for t in unique.values())

    def slot_sets(self) -> list[list[str]]:
        """Groups per distinct set of slots: all groups together when shared, else one group each."""
        names = list(self.num_slots)
        return [names] if self.shared else [[n] for n in names]

    def has_room(self, pages: dict[str, int]) -> bool:
        """Whether free slots can take ``pages`` per group at once (a shared tier: their sum)."""
        if self.shared:
            return sum(pages.values()) <= len(next(iter(self._free.values()), ()))
        return all(n <= self.num_free(name) for name, n in pages.items())

    def num_free(self, group: str) -> int:
        """Free slots of a group (0 for a group without a tier)."""
        return len(self._free.get(group, ()))

    def reserve(self, group: str) -> int:
        """Take a free slot for a page :meth:`write` copies (at once, or on write-back: when its device block is
        evicted)."""
        slot = self._free[group].pop()
        self._used[group] += 1
        return slot

    def write(self, group: str, slots: list[int], blocks: list[int]) -> None:
        """Copy device ``blocks`` of ``group`` into reserved ``slots``, pair by pair, in one gather and one copy
        (:func:`cache_backends.pools.move_pages`); slots distinct, a block may repeat. Call :meth:`sync` before the
        blocks are reused."""
        move_pages(self.tensors[group], slots, self._by_block(group), blocks, self.pinned)
        self.bytes_stored += self.pools.groups[group].bytes_per_block * len(slots)

    def write_many(self, moves: dict[str, tuple[list[int], list[int]]]) -> None:
        """:meth:`write` for each group's ``(slots, blocks)``; a shared tier's groups (one host tensor, one device
        arena) in one call for all of them."""
        for name, slots, blocks in self._batches(moves):
            self.write(name, slots, blocks)

    def load_many(self, moves: dict[str, tuple[list[int], list[int]]]) -> None:
        """Copy each group's ``slots`` back into its device ``blocks``, pair by pair, in one gather and one copy per
        host tensor (a shared tier: one for all groups); blocks distinct. Call :meth:`sync` before the slots are
        freed."""
        for name, slots, blocks in self._batches(moves):
            move_pages(self._by_block(name), blocks, self.tensors[name], slots, self.pinned)
            self.bytes_loaded += self.pools.groups[name].bytes_per_block * len(slots)

    def _batches(self, moves: dict[str, tuple[list[int], list[int]]]) -> list[tuple[str, list[int], list[int]]]:
        """``moves`` as (group, slots, blocks) per host tensor, the empty ones left out: a shared tier's groups joined
        into one, named by the first (every group's page has the same bytes)."""
        if not self.shared:
            return [(name, slots, blocks) for name, (slots, blocks) in moves.items() if slots]
        names = [name for name, (slots, _) in moves.items() if slots]
        if len(names) < 2:
            return [(names[0], *moves[names[0]])] if names else []
        return [(names[0], [s for n in names for s in moves[n][0]], [b for n in names for b in moves[n][1]])]

    def _by_block(self, group: str) -> torch.Tensor:
        """The group's device pages block-major (``[b]`` is block ``b``), built once and kept with the pools' views."""
        key = ("host tier: block-major", group)
        view = self.pools.views.get(key)
        if view is None:
            view = self.pools.views[key] = self.pools.tensors[group].transpose(0, 1)
        return view

    def free(self, group: str, slots: list[int]) -> None:
        """Give slots back."""
        back = [s for s in slots if s >= 0]
        self._free[group].extend(back)
        self._used[group] -= len(back)

    def num_used(self, group: str) -> int:
        """Slots holding pages of ``group`` (0 for a group without a tier)."""
        return self._used.get(group, 0)

    def sync(self) -> None:
        """Wait for the copies queued on the device's current stream."""
        if self.pinned:
            torch.cuda.current_stream(self.pools.device).synchronize()

    def free_slots(self, group: str) -> list[int]:
        """A group's free slots (for checks and tests)."""
        return list(self._free.get(group, ()))

    def release(self) -> None:
        """Drop the host tensors (idempotent)."""
        self.tensors.clear()
        self._free.clear()
        self._used.clear()
