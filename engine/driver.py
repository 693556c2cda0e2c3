"""The driving loop shared by the generation executor, the workload simulator and the test harnesses.

:meth:`Driver.run` is the only loop: it adds each :class:`Arrival` when the clock reaches its step (or
the step after the request it waits for finished), runs :meth:`Driver.step` while anything waits or
runs, jumps the clock over idle stretches, and stops with :class:`StalledError` when the scheduler
reports that nothing can make progress or schedules nothing for ``max_idle_steps`` steps in a row.

One :meth:`Driver.step`: the scheduler decides (admit / suspend / resume / allocate), a ``compute``
callable produces the next token of every request whose known tokens are all in the cache after
this step (a forward pass for the executor, the scripted answer for the simulator), the manager
commits what was computed, and finished requests release their blocks. Timing of the manager and
scheduler work is kept separately from ``compute`` so benchmarks can report it alone.

Speculative decoding: a ``propose`` hook gives each request that got a token its draft tokens for the
next step (``Request.draft_token_ids``); the scheduler may compute them beside the last known token,
``compute`` answers with the drafts the model confirmed and the token after them, and the driver
appends those one by one (each may end the request) and commits a confirmed draft's KV; an unconfirmed
draft's KV is never committed, so it is overwritten before anything reads it.

Forks (``n > 1`` samples of one prompt, :meth:`Driver.fork`): only the prompt's first request prefills. In
the step its prompt is committed, ``compute`` answers for its other samples too (their first tokens, drawn
from that prefill's logits), and before the first request's own token can end it the driver appends each
sample's token (which may end that sample at once) and has the scheduler admit the sample holding the
prompt's KV (``scheduler.fork``: shared whole blocks, a copy of the partial last one). A sample the
scheduler cannot admit now waits in ``waiting`` with its token, admitted later as any request (the prefix
cache may hold its prompt's whole blocks; the rest is computed again).

Branches (beam search, :meth:`Driver.branch`): a new request whose tokens extend a running request's committed
ones joins holding that request's KV at once (``scheduler.fork`` at the committed length, where the manager forks
past a prompt), or waits as any request.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from cache_backends.interface import SchedulerOutput
from cache_backends.request import Request, RequestState
from pipeline.events import (
    Event,
    RequestAdmitted,
    RequestFinished,
    RequestPreempted,
    RequestResumed,
    RequestSuspended,
)

#: compute(output) -> {req_id: next token} for each scheduled request that reaches its last known token; with drafts
#: (speculative decoding) a list instead: the drafts the model confirmed, in order, then the token after them.
Compute = Callable[[SchedulerOutput], dict[str, int | list[int]]]


#: Steps in a row that may schedule nothing before :meth:`Driver.run` gives up (the schedulers report
#: stalls themselves; this only guards against a scheduler that breaks that promise).
MAX_IDLE_STEPS = 64


def at_length(req: Request, max_seq_len: int) -> bool:
    """Whether ``req``'s newest token is its last: ``max_new_tokens`` generated, or prompt + output at ``max_seq_len``
    (it ends "length" unless a stop rule ends it first)."""
    return len(req.output_token_ids) >= req.max_new_tokens or req.num_tokens >= max_seq_len


class StalledError(RuntimeError):
    """Nothing can run and nothing can be made to run; the message says why."""


@attrs.frozen
class Arrival:
    """A request and when it joins: at step ``step``, or after request ``after`` finished (whichever is later)."""

    request: Request
    step: int = 0
    after: str | None = None


@attrs.define
class RunStats:
    """What :meth:`Driver.run` did: the clock at the end (idle steps included), engine steps, finished requests."""

    steps: int = 0
    engine_steps: int = 0
    finished: list[Request] = attrs.Factory(list)


@attrs.define
class StepStats:
    """What one step did and what it cost."""

    scheduled_tokens: int
    running: int
    waiting: int
    kv_seconds: float  # scheduler.step + commits + finishes
    compute_seconds: float
    finished: list[Request]
    output: SchedulerOutput | None = None  # the scheduler's decision of this step
    draft_tokens: int = 0  # speculative decoding: draft tokens the step computed
    accepted_draft_tokens: int = 0  # and of those, the ones the model confirmed (now output tokens)
    drafts: int = 0  # requests whose drafts the step computed (vLLM's num_drafts: one per request and step)
    #: per draft position (0: the first draft), how many of the step's drafts had it confirmed; sums to
    #: ``accepted_draft_tokens`` (a draft's position i is confirmed only after 0 ... i-1)
    accepted_per_position: list[int] = attrs.Factory(list)
    #: tokens whose KV the step computed again: a preempted request's tokens it had computed before (less the
    #: prefix cache's hit on its re-admission, which it need not compute)
    recomputed_tokens: int = 0


class Driver:
    """Owns the waiting queue and the running list; feeds a scheduler step by step."""

    def __init__(self, manager: Any, scheduler: Any, *, eos_token_ids: frozenset[int] = frozenset(),
                 emit: Callable[[Event], Any] | None = None,
                 stop: Callable[[Request, int], bool] | None = None,
                 propose: Callable[[Request, int], list[int]] | None = None) -> None:
        self.manager = manager
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.stop = stop  # stop(request, token just appended): True ends it with "stop" (stop strings, stop ids)
        # propose(request, requests running) -> its draft tokens for the next step (speculative decoding)
        self.propose = propose
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self._emit = emit
        self._arrivals = 0
        self._admitted_before: set[Request] = set()  # so a re-admission after preemption says so
        #: prompt's first request id -> (it, its other samples), until the step its prompt is committed
        self._forks: dict[str, tuple[Request, list[Request]]] = {}
        self._on_arrival: Callable[[Request, int], Any] | None = None  # run's hook, for forked samples too
        self.clock = 0  # run's step clock

    @property
    def max_seq_len(self) -> int:
        """The manager's ``max_seq_len``: prompt + generated tokens never exceed it."""
        return self.manager.options.max_seq_len

    def add(self, request: Request) -> None:
        """Queue a request; arrival order breaks scheduling ties.

        ``ValueError`` when it could not generate a token: ``max_new_tokens`` below 1, or a prompt that
        leaves no room under ``max_seq_len`` (a ``prefill_only`` request's may fill it: its token is dropped, its KV
        never written). Generation ends ("stop") at EOS or when the ``stop`` hook says
        so, or ("length") at ``max_new_tokens`` or when prompt + output reach ``max_seq_len``, whichever
        comes first.
        """
        if request.max_new_tokens < 1:
            raise ValueError(f"request {request.req_id}: max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if request.num_prompt_tokens >= self.max_seq_len + request.prefill_only:  # its token is dropped: may fill it
            raise ValueError(f"request {request.req_id}: its prompt of {request.num_prompt_tokens} tokens leaves no "
                             f"room to generate within max_seq_len={self.max_seq_len}")
        self._arrive(request)
        self.waiting.append(request)

    def _arrive(self, request: Request) -> None:
        request.arrival = self._arrivals
        self._arrivals += 1
        request.state = RequestState.WAITING

    def fork(self, parent: Request, children: Iterable[Request]) -> None:
        """Make ``children`` (samples of ``parent``'s prompt, not added) forks of ``parent``: they join in the step
        ``parent``'s prompt is committed, each with the token ``compute`` drew for it from that step's logits,
        holding the prompt's KV (module docstring)."""
        kids = list(children)
        for child in kids:
            if child.prompt_token_ids != parent.prompt_token_ids or child.output_token_ids:
                raise ValueError(f"request {child.req_id}: a fork has its parent's prompt and no token yet")
        if kids:
            self._forks[parent.req_id] = (parent, kids)

    def branch(self, parent: Request, child: Request) -> bool:
        """Add ``child``, whose tokens extend ``parent``'s committed ones (a beam of beam search forking another), as
        a running request holding ``parent``'s KV (``scheduler.fork``: whole blocks shared, the partial last one
        copied) where the scheduler admits it now; else it waits as any request (its prefix from the prefix cache
        where it still is). Whether it forked. A manager forks past the prompt only where it says so
        (``forks_past_prompt``: V1); elsewhere only at the prompt's end."""
        self._arrive(child)
        committed = parent.num_computed_tokens
        forkable = (parent.state is RequestState.RUNNING and parent in self.running
                    and (committed == parent.num_prompt_tokens or getattr(self.manager, "forks_past_prompt", False)))
        if forkable and self.scheduler.fork(parent, child, self.running):
            self._admitted_fork(child)
            return True
        self.waiting.append(child)
        return False

    def unfork(self, child: Request) -> bool:
        """Drop ``child`` from the samples waiting for its parent's prefill (:meth:`fork`); whether it was one."""
        for parent_id, (_, kids) in list(self._forks.items()):
            if child in kids:
                kids.remove(child)
                if not kids:
                    del self._forks[parent_id]
                return True
        return False

    def forks_of(self, parent: Request) -> list[Request]:
        """The samples still waiting for ``parent``'s prefill (:meth:`fork`), taken from it: the caller forks them
        again from another parent or adds them."""
        fork = self._forks.pop(parent.req_id, None)
        return fork[1] if fork is not None else []

    def forks_for(self, parent_id: str) -> list[Request]:
        """The samples waiting for the prefill of request ``parent_id`` (none: an empty list)."""
        fork = self._forks.get(parent_id)
        return list(fork[1]) if fork is not None else []

    @property
    def forks_waiting(self) -> int:
        """Samples waiting for their prompt's prefill (:meth:`fork`): not yet in ``waiting``."""
        return sum(len(kids) for _, kids in self._forks.values())

    @property
    def forks_pending(self) -> bool:
        """Whether some prompt's samples wait for its prefill (:meth:`fork`)."""
        return bool(self._forks)

    @property
    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def step(self, compute: Compute) -> StepStats:
        """Run one iteration; raise :class:`StalledError` when the scheduler reports no possible progress."""
        t0 = time.perf_counter()
        out = self.scheduler.step(self.waiting, self.running)
        kv_seconds = time.perf_counter() - t0
        self._report(out)
        if not out.scheduled:
            if out.stalled and self.has_work:
                raise StalledError(out.stalled)
            return StepStats(0, len(self.running), len(self.waiting), kv_seconds, 0.0, [], out)

        t1 = time.perf_counter()
        next_tokens = compute(out)
        compute_seconds = time.perf_counter() - t1

        t2 = time.perf_counter()
        done: list[Request] = []
        drafted = accepted = recomputed = 0
        per_position: list[int] = []
        computed: dict[Request, int] = {}  # draft tokens each request's chunk computed this step
        for chunk in out.scheduled:
            req = chunk.request
            drafts = req.num_computed_tokens + chunk.num_tokens - req.num_tokens
            if req.lost_tokens:
                recomputed += _computed_again(req, chunk.num_tokens - max(drafts, 0))
            if drafts > 0:
                computed[req] = drafts
                drafted += drafts
                self.manager.commit(req, chunk.num_tokens - drafts)  # the drafts' KV is committed once confirmed
            else:
                self.manager.commit(req, chunk.num_tokens)
        if self._forks:  # before any token is appended: a first request its token ends lets go of the prompt's KV
            for chunk in out.scheduled:
                fork = self._forks.get(chunk.request.req_id)
                if fork is not None and not chunk.request.in_prefill:
                    del self._forks[chunk.request.req_id]
                    self._fork(*fork, next_tokens, done)
        for chunk in out.scheduled:
            req = chunk.request
            got = next_tokens.get(req.req_id)
            if got is None:
                continue
            tokens = got if isinstance(got, list) else [got]
            drafts, req.draft_token_ids = req.draft_token_ids[:computed.get(req, 0)], []
            # a confirmed token's KV is committed: it must be a draft this step computed, at its place
            if len(tokens) > len(drafts) + 1 or tokens[:-1] != drafts[:len(tokens) - 1]:
                raise RuntimeError(f"request {req.req_id}: compute returned {tokens} after drafts {drafts}; every "
                                   "token but the last must be a draft the step computed, in order")
            for i, token in enumerate(tokens):
                req.output_token_ids.append(token)
                confirmed = i < len(tokens) - 1  # a draft the model confirmed: its KV was written this step
                accepted += confirmed
                if confirmed:
                    if i == len(per_position):
                        per_position.append(0)
                    per_position[i] += 1
                reason = self._finish_reason(req, token)
                if reason is not None:
                    self.scheduler.finish(req, reason)
                    req.finish_reason = reason
                    self.running.remove(req)
                    done.append(req)
                    break
                if confirmed:
                    self.manager.commit(req, 1)
            if self.propose is not None and not req.is_finished:
                req.draft_token_ids = self.propose(req, len(self.running))
        kv_seconds += time.perf_counter() - t2
        for req in done:
            self._admitted_before.discard(req)
            self.finished.append(req)
            if self._emit:
                self._emit(RequestFinished(req_id=req.req_id, reason=req.finish_reason,
                                           prompt_tokens=req.num_prompt_tokens, output_tokens=len(req.output_token_ids),
                                           reused_prompt_tokens=req.num_cached_tokens))
        return StepStats(out.num_tokens, len(self.running), len(self.waiting), kv_seconds, compute_seconds, done, out,
                         drafted, accepted, len(computed), per_position, recomputed)

    def _fork(self, parent: Request, children: list[Request], next_tokens: dict[str, int | list[int]],
              done: list[Request]) -> None:
        """``parent``'s prompt is committed: each child takes its first token and is admitted holding the prompt's KV
        (or finishes at once, or waits for room)."""
        for child in children:
            self._arrive(child)
            if self._on_arrival is not None:
                self._on_arrival(child, self.clock)
            got = next_tokens.get(child.req_id)
            if got is None:  # compute drew it no token: it prefills as any request
                self.waiting.append(child)
                continue
            token = got[-1] if isinstance(got, list) else got
            child.output_token_ids.append(token)
            reason = self._finish_reason(child, token)
            if reason is not None:  # ended by its first token: it never needs the prompt's KV
                child.num_reused_tokens = child.num_prompt_tokens
                self.scheduler.finish(child, reason)
                child.finish_reason = reason
                done.append(child)
            elif self.scheduler.fork(parent, child, self.running):
                self._admitted_fork(child)
            else:  # no room now: admitted later as any request, its prompt from the prefix cache where it still is
                self.waiting.append(child)

    def run(self, arrivals: Iterable[Arrival | Request], compute: Compute, *,
            on_arrival: Callable[[Request, int], Any] | None = None,
            on_step: Callable[[int, StepStats], Any] | None = None,
            max_steps: int | None = None, max_idle_steps: int = MAX_IDLE_STEPS) -> RunStats:
        """Drive every arrival to completion; a plain :class:`Request` arrives at step 0.

        ``on_arrival(request, clock)`` runs as a request is queued, ``on_step(clock, stats)`` after
        each engine step. :class:`StalledError` when no progress is possible (the scheduler says so,
        nothing is scheduled for ``max_idle_steps`` steps in a row, or ``max_steps`` engine steps pass).
        """
        ready: list[tuple[int, int, Request]] = []  # (step it may arrive, order, request)
        dependents: dict[str, list[tuple[int, int, Request]]] = {}
        for order, item in enumerate(arrivals):
            a = item if isinstance(item, Arrival) else Arrival(item)
            if a.after is None:
                ready.append((a.step, order, a.request))
            else:
                dependents.setdefault(a.after, []).append((a.step, order, a.request))
        heapq.heapify(ready)
        stats = RunStats()
        clock = idle = 0
        self._on_arrival = on_arrival
        while ready or self.has_work:
            self.clock = clock
            while ready and ready[0][0] <= clock:
                _, _, request = heapq.heappop(ready)
                self.add(request)
                if on_arrival is not None:
                    on_arrival(request, clock)
            if not self.has_work:
                clock = ready[0][0]  # idle until the next arrival
                continue
            if max_steps is not None and stats.engine_steps >= max_steps:
                raise StalledError(f"no completion after {max_steps} engine steps")
            st = self.step(compute)
            stats.engine_steps += 1
            idle = idle + 1 if st.scheduled_tokens == 0 else 0
            if idle > max_idle_steps:
                raise StalledError(f"{idle} steps in a row scheduled nothing while {len(self.running)} running and "
                                   f"{len(self.waiting)} waiting requests remain")
            for req in st.finished:
                stats.finished.append(req)
                for step, order, request in dependents.pop(req.req_id, ()):
                    heapq.heappush(ready, (max(step, clock + 1), order, request))
            if on_step is not None:
                on_step(clock, st)
            clock += 1
        if self._forks:
            raise StalledError("samples wait for the prefill of " + ", ".join(sorted(self._forks)) + ", which ended")
        if dependents:
            waiting_on = ", ".join(sorted(dependents))
            raise StalledError(f"requests wait for {waiting_on}, which never arrived or finished")
        stats.steps = clock
        return stats

    def _finish_reason(self, req: Request, token: int) -> str | None:
        """"stop" (EOS or the ``stop`` hook), "length" (max_new_tokens or max_seq_len), else None (vLLM's names)."""
        if token in self.eos_token_ids:
            return "stop"
        if self.stop is not None and self.stop(req, token):
            return "stop"
        if at_length(req, self.max_seq_len):
            return "length"
        return None

    def _admitted_fork(self, child: Request) -> None:
        """``child`` was admitted by ``scheduler.fork`` (holding its parent's KV), not by a schedule: recorded as the
        scheduler's admissions are (:meth:`_report`), as a first admission."""
        self._admitted_before.add(child)
        if self._emit:
            self._emit(RequestAdmitted(req_id=child.req_id, prompt_tokens=child.num_prompt_tokens,
                                       reused_prompt_tokens=child.num_reused_tokens, readmitted=False))

    def _report(self, out: SchedulerOutput) -> None:
        readmitted = [req in self._admitted_before for req in out.admitted]
        self._admitted_before.update(out.admitted)
        if self._emit is None:
            return
        for req, again in zip(out.admitted, readmitted, strict=True):
            self._emit(RequestAdmitted(req_id=req.req_id, prompt_tokens=req.num_prompt_tokens,
                                       reused_prompt_tokens=req.num_reused_tokens, readmitted=again))
        for req in out.preempted:
            self._emit(RequestPreempted(req_id=req.req_id, tokens=req.num_tokens))
        for req in out.suspended:
            self._emit(RequestSuspended(req_id=req.req_id, tokens=req.num_computed_tokens))
        for req in out.resumed:
            self._emit(RequestResumed(req_id=req.req_id, tokens=req.num_computed_tokens))


def _computed_again(req: Request, tokens: int) -> int:
    """Of the ``tokens`` known tokens ``req`` computes this step from ``num_computed_tokens`` on, those it had computed
    before a preemption (``lost_tokens``, cleared once all are computed again)."""
    lost, start = req.lost_tokens, req.num_computed_tokens
    if start + tokens >= lost:
        req.lost_tokens = 0
    return max(0, min(start + tokens, lost) - start)
