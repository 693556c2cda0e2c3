"""What the V1 and V2 schedulers share: construction checks, finishing a request, the stall report."""

from __future__ import annotations

from collections import deque
from typing import Any

from cache_backends.interface import ScheduledChunk, SchedulerOutput
from cache_backends.request import SCHEDULING_POLICY_NAMES, Request, RequestState

#: Why-stalled reasons a stall message names before "and N more reasons": a small run names every request.
STALL_REASONS_SHOWN = 8


class SchedulerBase:
    """Holds the manager and the per-step limits; subclasses implement ``step``."""

    def __init__(self, manager: Any, max_batch_size: int, max_num_tokens: int, *,
                 scheduling_policy: str = "fcfs") -> None:
        if scheduling_policy not in SCHEDULING_POLICY_NAMES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICY_NAMES)}, "
                             f"got {scheduling_policy!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
        self.manager = manager
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.scheduling_policy = scheduling_policy
        #: "priority": waiting requests are taken best-ranked first (``Request.rank``), not in arrival order
        self.by_priority = scheduling_policy == "priority"

    def extend_with_drafts(self, out: SchedulerOutput) -> None:
        """Speculative decoding: a chunk that reaches its request's last known token also computes the request's
        drafts (``Request.draft_token_ids``), as many as the step's leftover token budget and the pools allow.

        Runs after every real token of the step was scheduled and every admission made, so a draft never takes
        budget or a block from a real token; it only takes free blocks the request would need for its next tokens
        anyway (drafts stay within its ``max_new_tokens`` and ``max_seq_len``: the proposer caps them).
        """
        for chunk in out.scheduled:  # most steps no chunk has drafts: a lean pass first (half the loop below's cost)
            if chunk.request.draft_token_ids:
                break
        else:
            return
        budget: int | None = None  # the step's leftover tokens, counted at the first chunk with drafts (most have none)
        for i, chunk in enumerate(out.scheduled):
            req = chunk.request
            if not req.draft_token_ids:
                continue
            if budget is None:
                budget = self.max_num_tokens - out.num_tokens
            if budget <= 0:
                return
            if req.num_computed_tokens + chunk.num_tokens != req.num_tokens:
                continue
            got = self.reserve_drafts(req, chunk.num_tokens, min(len(req.draft_token_ids), budget))
            if got > 0:
                out.scheduled[i] = ScheduledChunk(req, chunk.num_tokens + got)
                budget -= got

    def reserve_drafts(self, request: Request, scheduled: int, drafts: int) -> int:
        """Slots for up to ``drafts`` draft tokens after the ``scheduled`` ones; how many (0: none)."""
        raise NotImplementedError

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished and free its blocks (reusable ones stay cached); the caller removes it from running."""
        request.state = RequestState.FINISHED
        request.finish_reason = reason
        self.manager.free(request)

    @staticmethod
    def report_stall(out: SchedulerOutput, reasons: list[str], waiting: deque[Request],
                     running: list[Request]) -> None:
        """Set ``out.stalled`` when nothing was scheduled though work remains, saying why."""
        if out.scheduled or not (waiting or running):
            return
        # a reason per request: 1,000 requests that never fit made a 140 KB error line; the first few say it
        unique = list(dict.fromkeys(reasons))
        shown = unique[:STALL_REASONS_SHOWN]
        if len(unique) > STALL_REASONS_SHOWN:
            more = len(unique) - STALL_REASONS_SHOWN
            shown.append(f"and {more:,} more reason{'s' if more > 1 else ''}")
        idle = sum(1 for r in running if r.num_tokens == r.num_computed_tokens)
        if idle:
            shown.append(f"{idle} running request(s) have no token to compute (append the sampled tokens first)")
        out.stalled = "; ".join(shown) or "no request has a token to compute"
