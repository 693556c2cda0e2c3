"""DeepSeek V4's compressor side state beside the KV cache: snapshots at reuse boundaries filed, restored, moved
with their blocks and dropped (:class:`V4SideState`, a part of :class:`~engine.executor.GenerationExecutor`)."""

from __future__ import annotations

from collections.abc import Iterable

from cache_backends.interface import SchedulerOutput
from cache_backends.request import Request
from engine.live_sample import LiveSample
from models.deepseek_v4_paged import V4Snapshot, prefix_digest


class V4SideState:
    """DeepSeek V4's side state of running requests and of cached prefixes' reuse boundaries."""

    def _v4_reusable(self, request: Request, m: int, block: int) -> bool:
        """The manager's :meth:`limit_reuse` check: whether the side state of ``request``'s first ``m`` tokens was
        snapshotted with the window-group ``block`` that ends there (DeepSeek V4)."""
        assert self.v4 is not None and self._v4_key is not None
        if block < 0:
            return False
        gen = self.manager.block_life(self._v4_key, block)[0]
        return self.v4.snapshots.get(block, gen, m, lambda: prefix_digest(request.salt, request.token_span(0, m))) \
            is not None

    def _v4_moved(self, group: str, pairs: list[tuple[int, int]]) -> None:
        """The manager moved ``group``'s blocks (a slab arena's compaction): the snapshots kept with them follow."""
        assert self.v4 is not None
        if group == self._v4_key:
            self.v4.snapshots.move(pairs, lambda b: self.manager.block_life(group, b)[0])

    def _v4_restore(self, out: SchedulerOutput) -> None:
        """A request that continues a reused prefix (no side state at its start) gets it back from the snapshot the
        manager's check found (DeepSeek V4)."""
        assert self.v4 is not None
        states, key = self.v4.states, self._v4_key
        for s in out.scheduled:
            req = s.request
            start = req.num_computed_tokens
            state = states.get(req.req_id)
            if not start or key is None or (state is not None and state.pos == start):
                continue
            block = self.manager.block_table(req, key)[start // self.v4.snapshots.T - 1]
            if block < 0:
                continue
            snap = self.v4.snapshots.get(block, self.manager.block_life(key, block)[0], start,
                                         lambda r=req, n=start: prefix_digest(r.salt, r.token_span(0, n)))
            if snap is not None:  # else V4States.for_step says, in one line, that the state cannot be rebuilt
                self.v4.restore(req.req_id, snap)

    def _v4_file(self, out: SchedulerOutput) -> None:
        """Keep the snapshots a step took at reuse boundaries, each with the window-group block that ends there."""
        assert self.v4 is not None and self._v4_key is not None
        key, T = self._v4_key, self.v4.snapshots.T
        for s in out.scheduled:
            req = s.request
            state = self.v4.states.get(req.req_id)
            if state is None or not state.captured:
                continue
            table = self.manager.block_table(req, key)
            for pos, layers in state.captured.items():
                block = table[pos // T - 1]
                if block >= 0:
                    self.v4.snapshots.put(block, self.manager.block_life(key, block)[0],
                                          V4Snapshot(pos, prefix_digest(req.salt, req.token_span(0, pos)), layers))
            state.captured = {}

    def prune_v4(self) -> None:
        """Drop the DeepSeek V4 snapshots whose block left the prefix cache (after each step, and a reset)."""
        if self.v4 is not None and self._v4_key is not None and self.v4.snapshots.by_block:
            key = self._v4_key
            self.v4.snapshots.prune(lambda b: self.manager.block_life(key, b))

    def _drop_v4(self, lives: Iterable[LiveSample]) -> None:
        """Drop the side state of a call's requests (DeepSeek V4), finished or not."""
        if self.v4 is not None:
            for live in lives:
                self.v4.free(live.request.req_id)
            self.prune_v4()  # a call that failed freed its requests' blocks after its last step: their snapshots go
