"""Test support for the V1 manager and scheduler: a manager over fresh pools, and ``drive`` with a trace.

``drive`` runs requests through the production loop (:meth:`engine.driver.Driver.run`) with a scripted
"forward" that samples a deterministic token whenever a chunk reaches a request's last known token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs

from cache_backends import LayerKV, build_layout
from cache_backends.interface import ManagerOptions, SchedulerOutput
from cache_backends.pools import BlockPools
from cache_backends.request import Request
from cache_backends.v1 import KVCacheManager
from engine.driver import Driver, StalledError

T = 4
KV_HEADS, HEAD_DIM, LAYERS = 2, 3, 2


def make_manager(num_blocks: int = 16, reuse: bool = True, T: int = T, dtype: str = "float32",
                 max_seq_len: int = 1024) -> KVCacheManager:
    layers = [LayerKV(i, "full", 2 * KV_HEADS * HEAD_DIM) for i in range(LAYERS)]
    pools = BlockPools(build_layout(layers, "v1", T, dtype), {"uniform": num_blocks}, "cpu")
    return KVCacheManager(pools, ManagerOptions(max_seq_len=max_seq_len, enable_block_reuse=reuse))


def run_prefill(m: KVCacheManager, r: Request) -> None:
    """Admit ``r`` with its cached prefix and compute the rest of its prompt."""
    m.admit(r, m.find_prefix(r))
    n = r.num_tokens - r.num_computed_tokens
    assert m.allocate_slots(r, n)
    m.commit(r, n)


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
    """Run requests to completion (or until the scheduler stalls) through the engine's loop; return the trace."""
    trace = Trace()
    driver = Driver(manager, scheduler)

    def compute(out: SchedulerOutput) -> dict[str, int]:
        trace.max_running = max(trace.max_running, len(driver.running))
        tokens = {}
        for chunk in out.scheduled:
            if on_chunk is not None:
                on_chunk(chunk)
            r = chunk.request
            if r.num_computed_tokens + chunk.num_tokens == r.num_tokens:
                tokens[r.req_id] = next_token(r)
        return tokens

    def stepped(clock: int, stats: Any) -> None:
        trace.steps += 1
        trace.outputs.append(stats.output)
        trace.admitted += [r.req_id for r in stats.output.admitted]
        trace.finished += [r.req_id for r in stats.finished]
        assert manager.usage() == manager.stats().usage  # the simulator samples usage() alone, every step
        if check is not None:
            check()

    try:
        driver.run(requests, compute, on_step=stepped, max_steps=max_steps)
    except StalledError as exc:
        trace.stalled = str(exc)
    return trace
