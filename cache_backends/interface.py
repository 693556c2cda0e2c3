"""The contract between KV managers, schedulers and whoever drives them (executor, simulator).

Driving loop, one iteration::

    out = scheduler.step(waiting, running)       # admits / suspends / resumes, allocates slots
    for chunk in out.scheduled:                  # compute KV of chunk.request.all_token_ids[c : c + n]
        ...                                      #   c = chunk.request.num_computed_tokens, n = chunk.num_tokens
        manager.block_table(chunk.request, g)    #   where to write/read, per layer group (pools.py contract)
    manager.commit(chunk.request, chunk.num_tokens)   # after the forward: KV is written; hashes, windows
    # append sampled tokens to request.output_token_ids; when a request ends:
    scheduler.finish(request, reason)            # frees its blocks (they stay cached for reuse)

``step`` never hangs: when nothing can run and nothing can be made to run, it returns an empty
``scheduled`` with ``stalled`` saying why.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol

import attrs

from cache_backends.layout import KvLayout
from cache_backends.request import Request
from cache_backends.stats import ManagerStats

if TYPE_CHECKING:  # pools import torch; the protocol itself must stay importable without it
    from cache_backends.pools import BlockPools


class PrefixCacheInUseError(RuntimeError):
    """``reset_prefix_cache`` was asked while requests still hold KV blocks (or host pages)."""


def prefix_cache_in_use(req_ids: list[str]) -> PrefixCacheInUseError:
    """The refusal of ``reset_prefix_cache``: which requests still hold a KV cache."""
    shown = ", ".join(req_ids[:5]) + (f" and {len(req_ids) - 5} more" if len(req_ids) > 5 else "")
    return PrefixCacheInUseError(f"reset_prefix_cache: {len(req_ids)} request(s) still hold a KV cache ({shown}); "
                                 "finish or free them first")


@attrs.frozen
class ManagerOptions:
    """Manager settings, as plain values (this library does not import the pipeline's config)."""

    max_seq_len: int
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True
    host_cache_size: int | None = None  # V2: None = auto-size a host tier, 0 = none
    max_util_for_resume: float = 0.95  # V2: refuse to resume above this device utilisation
    enable_swa_scratch_reuse: bool = True  # V2: out-of-window blocks stay in the prefix cache (False: dropped)


@attrs.frozen(init=False)
class ScheduledChunk:
    """Compute ``num_tokens`` tokens of ``request`` this step, from ``request.num_computed_tokens`` on."""

    request: Request
    num_tokens: int

    def __init__(self, request: Request, num_tokens: int) -> None:
        # What attrs' frozen __init__ does, through the slots' own setters: that one binds object.__setattr__ and
        # calls it per field (~0.7 µs a chunk, against ~0.35 µs), and a step makes a chunk per running request
        _set_request(self, request)
        _set_num_tokens(self, num_tokens)


_set_request = ScheduledChunk.request.__set__  # type: ignore[attr-defined]  # the slots' member descriptors
_set_num_tokens = ScheduledChunk.num_tokens.__set__  # type: ignore[attr-defined]


@attrs.define
class SchedulerOutput:
    """What one ``step`` decided."""

    scheduled: list[ScheduledChunk] = attrs.Factory(list)
    admitted: list[Request] = attrs.Factory(list)
    suspended: list[Request] = attrs.Factory(list)  # V2: moved to the host tier this step
    resumed: list[Request] = attrs.Factory(list)  # V2: brought back from the host tier this step
    preempted: list[Request] = attrs.Factory(list)  # sent back to waiting, blocks freed
    stalled: str | None = None  # set when nothing could be scheduled, with the reason

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(c.num_tokens for c in self.scheduled)


class KVCacheManagerProtocol(Protocol):
    """What both managers offer a driver. Construction: ``Manager(pools, options)``."""

    layout: KvLayout
    pools: BlockPools
    options: ManagerOptions

    def block_table(self, request: Request, group: str) -> list[int]:
        """Physical block per logical block of ``request`` in ``group``; -1 where released (window) or absent."""

    def block_tables(self, request: Request) -> list[list[int]]:
        """Every group's ``block_table``, in ``layout.groups`` order, for one read (may be the manager's own lists:
        read them before the next call into the manager, never modify them)."""

    def commit(self, request: Request, num_tokens: int) -> None:
        """The KV of the next ``num_tokens`` tokens is written: advance ``num_computed_tokens``, hash full blocks,
        release blocks that fell out of a window."""

    def free(self, request: Request) -> None:
        """Release a finished request's blocks (reusable ones stay cached, tail evicted first)."""

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: no later hit, every block free; ``PrefixCacheInUseError`` while requests
        hold a cache."""

    def stats(self) -> ManagerStats:
        """Usage, free/evictable/used blocks per group, reuse hits in tokens, suspends/resumes (one shape for both)."""

    def usage(self) -> float:
        """``stats().usage`` alone, without building the rest (a driver samples it every step)."""

    def close(self) -> None:
        """Release the device pools and the host tier (idempotent)."""


class SchedulerProtocol(Protocol):
    """What both schedulers offer. Construction: ``Scheduler(manager, max_batch_size, max_num_tokens, *,
    scheduling_policy="fcfs")`` (``"priority"``: waiting requests are taken best-ranked first)."""

    def step(self, waiting: deque[Request], running: list[Request]) -> SchedulerOutput:
        """Decide this iteration: move requests between ``waiting`` and ``running``, allocate, report."""

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished and free its blocks; the caller removes it from ``running``."""

    def fork(self, parent: Request, child: Request, running: list[Request]) -> bool:
        """Admit ``child`` (a sample of ``parent``'s prompt, its first token already drawn) into ``running`` holding
        ``parent``'s just-committed prompt KV (the manager's ``fork``: whole blocks shared, the partial last block
        copied) when admission's rules let it in now; False (nothing changed) otherwise."""
