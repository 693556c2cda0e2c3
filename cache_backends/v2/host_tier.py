"""The host tier: CPU memory (pinned when the pools are on CUDA) that suspended caches' pages move to.

One tensor per layer group, block-major — ``tensors[g]`` has shape
``(slots, len(group.layers), entries_per_block, entry_elems)`` so each slot is one contiguous page —
and a free list of slots. Copies are whole blocks, every layer, so a round trip is byte-exact.
On CUDA the copies are ``non_blocking`` from/to pinned memory and :meth:`sync` waits for them;
callers sync before a slot or a device block is handed to anyone else.
"""

from __future__ import annotations

import os

import torch

from cache_backends.pools import BlockPools

#: ``host_cache_size=None`` sizes the tier like the device pools, capped at this share of free host RAM.
AUTO_HOST_FRACTION = 0.5


def available_host_bytes() -> int:
    """Free physical memory of this machine (0 when the OS does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def host_slots(pools: BlockPools, host_cache_size: int | None) -> dict[str, int]:
    """Slots per group for a host budget: ``None`` = auto, ``0`` = no tier, else bytes split like the pools.

    A byte budget gives every group one block first, then shares the rest in proportion to each
    group's device bytes; ``ValueError`` when it cannot hold one block of every group.
    """
    groups = pools.layout.groups
    if host_cache_size == 0:
        return {}
    if host_cache_size is not None and host_cache_size < 0:
        raise ValueError(f"host_cache_size must be >= 0 bytes (0 = no host tier, null = auto), got {host_cache_size}")
    device_bytes = {g.name: pools.num_blocks[g.name] * g.bytes_per_block for g in groups}
    total_device = sum(device_bytes.values())
    if host_cache_size is None:
        cap = int(available_host_bytes() * AUTO_HOST_FRACTION)
        scale = 1.0 if cap >= total_device or cap <= 0 else cap / total_device
        return {g.name: max(1, int(pools.num_blocks[g.name] * scale)) for g in groups}
    minimum = sum(g.bytes_per_block for g in groups)
    if host_cache_size < minimum:
        raise ValueError(
            f"host_cache_size={host_cache_size} bytes cannot hold one block of every layer group "
            f"(needs at least {minimum}); use 0 for no host tier or null to size it automatically"
        )
    rest = host_cache_size - minimum
    return {g.name: 1 + int(rest * device_bytes[g.name] / total_device) // g.bytes_per_block for g in groups}


class HostTier:
    """Host copies of device blocks, by slot; :meth:`release` frees the memory (idempotent)."""

    def __init__(self, pools: BlockPools, slots: dict[str, int]) -> None:
        self.pools = pools
        self.pinned = pools.device.type == "cuda"
        self.num_slots = dict(slots)
        self.tensors: dict[str, torch.Tensor] = {}
        self._free: dict[str, list[int]] = {}
        try:
            for name, n in self.num_slots.items():
                g = pools.groups[name]
                shape = (n, len(g.layers), g.entries_per_block, g.entry_elems)
                self.tensors[name] = torch.empty(shape, dtype=pools.dtype, device="cpu", pin_memory=self.pinned)
                self._free[name] = list(range(n - 1, -1, -1))
        except BaseException:
            self.release()
            raise

    @property
    def nbytes(self) -> int:
        """Host bytes held."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def num_free(self, group: str) -> int:
        """Free slots of a group (0 for a group without a tier)."""
        return len(self._free.get(group, ()))

    def store(self, group: str, block: int) -> int:
        """Copy device ``block`` into a free slot and return the slot (call :meth:`sync` before reuse)."""
        slot = self._free[group].pop()
        self.tensors[group][slot].copy_(self.pools.tensors[group][:, block], non_blocking=self.pinned)
        return slot

    def load(self, group: str, slot: int, block: int) -> None:
        """Copy ``slot`` back into device ``block`` (call :meth:`sync` before the slot is freed)."""
        self.pools.tensors[group][:, block].copy_(self.tensors[group][slot], non_blocking=self.pinned)

    def free(self, group: str, slots: list[int]) -> None:
        """Give slots back."""
        self._free[group].extend(s for s in slots if s >= 0)

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
