"""``GuaranteedNoEvictScheduler``: admit a request only when its worst case fits, so nothing is ever evicted.

A request's worst case is ``ceil((prompt + max_new_tokens) / T)`` blocks. Blocks that running
requests may still allocate are reserved; a waiting request is admitted (in arrival order, never
skipping the head) when its own worst case fits in what is free minus those reservations. Hence
every later ``allocate_slots`` of an admitted request succeeds, and no request is ever preempted.

Each step: running requests first (a decode token, or the next prefill chunk), then admissions,
within ``max_num_tokens`` tokens and ``max_batch_size`` running requests.
"""

from __future__ import annotations

from collections import deque

from cache_backends.interface import ScheduledChunk, SchedulerOutput
from cache_backends.request import Request, RequestState
from cache_backends.v1.manager import KVCacheManager


class GuaranteedNoEvictScheduler:
    """FIFO admission by worst-case blocks over a :class:`KVCacheManager`; implements ``SchedulerProtocol``."""

    def __init__(self, manager: KVCacheManager, max_batch_size: int, max_num_tokens: int) -> None:
        if max_batch_size < 1 or max_num_tokens < 1:
            raise ValueError(f"max_batch_size and max_num_tokens must be >= 1, got {max_batch_size}, {max_num_tokens}")
        self.manager = manager
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens

    def step(self, waiting: deque[Request], running: list[Request]) -> SchedulerOutput:
        """Schedule running requests, then admit from the head of ``waiting`` while worst cases fit."""
        out = SchedulerOutput()
        budget = self.max_num_tokens
        for request in running:
            if budget == 0:
                break
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if n > 0:
                self._allocate(request, n)
                out.scheduled.append(ScheduledChunk(request, n))
                budget -= n

        available = self.manager.num_free_blocks - sum(self.manager.blocks_to_completion(r) for r in running)
        while waiting and len(running) < self.max_batch_size and budget > 0:
            request = waiting[0]
            hit = self.manager.find_prefix(request)
            need = self.manager.blocks_needed(request, hit)
            if need > available:
                break
            waiting.popleft()
            self.manager.admit(request, hit)
            request.state = RequestState.RUNNING
            running.append(request)
            out.admitted.append(request)
            available -= need
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if n > 0:
                self._allocate(request, n)
                out.scheduled.append(ScheduledChunk(request, n))
                budget -= n

        if not out.scheduled and (waiting or running):
            out.stalled = self._why_stalled(waiting, running)
        return out

    def finish(self, request: Request, reason: str) -> None:
        """Mark the request finished and free its blocks (they stay cached for reuse)."""
        request.state = RequestState.FINISHED
        request.finish_reason = reason
        self.manager.free(request)

    def _allocate(self, request: Request, n: int) -> None:
        if not self.manager.allocate_slots(request, n):  # the reservation makes this impossible
            raise RuntimeError(f"request {request.req_id}: no free block for an admitted request "
                               "(the no-evict reservation was broken)")

    def _why_stalled(self, waiting: deque[Request], running: list[Request]) -> str:
        if running:
            return f"{len(running)} running request(s) have no token to compute (append the sampled tokens first)"
        head = waiting[0]
        need = self.manager.max_blocks(head)
        if need > self.manager.num_blocks:
            return (f"request {head.req_id} needs {need} blocks for {head.max_total_tokens} tokens "
                    f"(prompt + max_new_tokens) but the pool holds {self.manager.num_blocks} blocks of "
                    f"{self.manager.tokens_per_block} tokens; it can never be admitted")
        return f"request {head.req_id} does not fit ({need} blocks, {self.manager.num_free_blocks} free)"
