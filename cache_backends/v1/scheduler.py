"""``GuaranteedNoEvictScheduler``: admit a request only when its worst case fits, so nothing is ever evicted.

A request's worst case is ``ceil(min(prompt + max_new_tokens, max_seq_len) / T)`` blocks. Blocks that
running requests may still allocate are reserved; a waiting request is admitted (first come first
served) when its own worst case fits in what is free minus those reservations. Hence every later
``allocate_slots`` of an admitted request succeeds, and no request is ever preempted.

``scheduling_policy="priority"`` changes the order admission takes waiting requests in: best-ranked first
(``Request.rank``: higher priority, then earlier arrival) instead of arrival order. That is all it does here:
this scheduler never preempts, so a better-ranked arrival never displaces a running request (V2's does).

A request that could never be admitted, even into an empty pool (its prompt is longer than
``max_seq_len``, or its worst case needs more blocks than the pool has), is skipped and stays in
``waiting``; the requests behind it keep their order and are admitted as if it were not there. It is
reported in ``stalled`` once nothing else can run. A request whose first-come turn has come but
does not fit *yet* is never skipped: it waits for running requests to finish.

A sample of an ``n > 1`` prompt is forked (:meth:`GuaranteedNoEvictScheduler.fork`) by the same rule: in
the step its prompt's prefill completes it joins ``running`` holding that prompt's KV when its worst case
fits beside the reservations and the batch has room; otherwise its driver queues it as any request. A beam
of beam search forks another beam the same way, at the length that beam has committed.

Each step: running requests first (a decode token, or the next prefill chunk, never past
``max_seq_len``), then admissions, within ``max_num_tokens`` tokens and ``max_batch_size`` running
requests. A running request that reached ``max_seq_len`` is not scheduled again: its driver must
finish it (reason ``"length"``).
"""

from __future__ import annotations

from collections import deque
from operator import attrgetter

from cache_backends.interface import ScheduledChunk, SchedulerOutput
from cache_backends.request import Request, RequestState
from cache_backends.scheduler_base import SchedulerBase
from cache_backends.v1.manager import KVCacheManager

_RANK = attrgetter("rank")


class GuaranteedNoEvictScheduler(SchedulerBase):
    """FIFO admission by worst-case blocks over a :class:`KVCacheManager`; implements ``SchedulerProtocol``."""

    manager: KVCacheManager

    def step(self, waiting: deque[Request], running: list[Request]) -> SchedulerOutput:
        """Schedule running requests, then admit in arrival order (``"priority"``: best-ranked first) while worst cases
        fit (never-fitting ones skipped)."""
        out = SchedulerOutput()
        reasons: list[str] = []
        budget = self.max_num_tokens
        limit = self.manager.options.max_seq_len
        for request in running:
            if budget == 0:
                break
            pending = request.num_tokens - request.num_computed_tokens
            n = min(pending, budget, limit - request.num_computed_tokens)
            if n > 0:
                self._allocate(request, n)
                out.scheduled.append(ScheduledChunk(request, n))
                budget -= n
            elif pending > 0:
                reasons.append(f"request {request.req_id} reached max_seq_len={limit}; finish it (reason 'length')")

        available = self.manager.num_free_blocks - sum(self.manager.blocks_to_completion(r) for r in running)
        if self.by_priority and len(waiting) > 1:  # the queue in admission order (an O(n) sort when nearly sorted)
            ranked = sorted(waiting, key=_RANK)
            waiting.clear()
            waiting.extend(ranked)
        i = 0
        while i < len(waiting) and len(running) < self.max_batch_size and budget > 0:
            request = waiting[i]
            why = self.manager.never_fits(request)
            if why is not None:  # skipped, not a head-of-line block: it would wait forever
                reasons.append(why)
                i += 1
                continue
            hit = self.manager.find_prefix(request)
            need = self.manager.blocks_needed(request, hit)
            if need > available:
                reasons.append(f"request {request.req_id} does not fit yet ({need} blocks, {available} free "
                               "beyond what running requests may still take)")
                break
            del waiting[i]
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

        self.report_stall(out, reasons, waiting, running)
        self.extend_with_drafts(out)
        return out

    def fork(self, parent: Request, child: Request, running: list[Request]) -> bool:
        """Admit ``child`` into ``running`` holding ``parent``'s committed KV (``KVCacheManager.fork``: its prompt, or a
        beam's sequence) when the batch has room and its worst case fits in what is free beyond the running
        requests' reservations; False (nothing changed) otherwise."""
        m = self.manager
        if len(running) >= self.max_batch_size or m.never_fits(child) is not None:
            return False
        available = m.num_free_blocks - sum(m.blocks_to_completion(r) for r in running)
        if m.fork_blocks_needed(parent, child) > available or not m.fork(parent, child):
            return False
        child.state = RequestState.RUNNING
        running.append(child)
        return True

    def reserve_drafts(self, request: Request, scheduled: int, drafts: int) -> int:
        """Draft slots within the request's worst case (reserved at admission, so they always fit)."""
        drafts = min(drafts, self.manager.options.max_seq_len - request.num_computed_tokens - scheduled)
        if drafts <= 0 or not self.manager.allocate_slots(request, scheduled + drafts):
            return 0
        return drafts

    def _allocate(self, request: Request, n: int) -> None:
        if not self.manager.allocate_slots(request, n):  # the reservation makes this impossible
            raise RuntimeError(f"request {request.req_id}: no free block for an admitted request "
                               "(the no-evict reservation was broken)")
