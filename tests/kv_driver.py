"""A test driver for the interface.py loop: schedule, "compute", commit, sample, finish; with a trace."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from cache_backends.request import Request


@attrs.define
class Trace:
    """What happened, step by step."""

    admitted: list[str] = attrs.Factory(list)  # request ids in admission order
    finished: list[str] = attrs.Factory(list)
    max_running: int = 0
    steps: int = 0
    stalled: str | None = None
    outputs: list[Any] = attrs.Factory(list)


def next_token(request: Request) -> int:
    """A deterministic "sampled" token."""
    return 1000 + (request.num_tokens * 7 + len(request.req_id)) % 97


def drive(scheduler: Any, manager: Any, requests: Iterable[Request], *, max_steps: int = 10_000,
          on_chunk: Callable[[Any], None] | None = None, check: Callable[[], None] | None = None) -> Trace:
    """Run requests to completion (or until the scheduler stalls); return the trace."""
    waiting: deque[Request] = deque(requests)
    running: list[Request] = []
    trace = Trace()
    while (waiting or running) and trace.steps < max_steps:
        out = scheduler.step(waiting, running)
        trace.steps += 1
        trace.outputs.append(out)
        trace.admitted += [r.req_id for r in out.admitted]
        trace.max_running = max(trace.max_running, len(running))
        if out.stalled:
            trace.stalled = out.stalled
            break
        for chunk in out.scheduled:
            if on_chunk is not None:
                on_chunk(chunk)
            manager.commit(chunk.request, chunk.num_tokens)
        for r in list(running):
            if r.num_computed_tokens < r.num_tokens:
                continue  # prefill continues next step
            if len(r.output_token_ids) >= r.max_new_tokens:
                scheduler.finish(r, "length")
                running.remove(r)
                trace.finished.append(r.req_id)
            else:
                r.output_token_ids.append(next_token(r))
        if check is not None:
            check()
    return trace
