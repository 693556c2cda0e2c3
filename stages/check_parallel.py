"""Stage ``check_parallel``: check ``tensor_parallel_size`` against the checkpoint and the launched ranks.

Query heads must divide by the ranks; KV heads shard when they divide, are replicated when the ranks are
a multiple of them, and any other combination is refused (``models.geometry.head_sharding``). Under
torchrun the ranks launched must be exactly ``tensor_parallel_size``. ``plan`` in one process may ask
for more ranks than it has: it plans rank 0's view; building pools needs every rank present.
"""

from __future__ import annotations

import os

from pipeline.bus import Emit
from pipeline.context import Context
from pipeline.errors import RankError
from pipeline.events import RankJoined, RanksLaunched
from pipeline.ranks import LAUNCHER_ENV, ranks_from_env


class CheckParallel:
    """Writes ``ctx.heads`` (and ``ctx.ranks`` when nobody set it); emits ``rank_joined``."""

    name = "check_parallel"
    error = RankError

    def run(self, ctx: Context, emit: Emit) -> None:
        """Validate the tensor-parallel size; record this rank and the heads it holds."""
        if ctx.ranks is None:
            ctx.ranks = ranks_from_env()
        ranks, tp = ctx.ranks, ctx.args.tensor_parallel_size
        heads = ctx.spec.head_sharding(tp)  # ModelError naming the heads and the sizes accepted
        if ranks.distributed and ranks.world_size != tp:
            raise RankError(
                f"tensor_parallel_size={tp} but {ranks.world_size} ranks were launched (WORLD_SIZE); launch "
                f"exactly tensor_parallel_size ranks (torchrun --nproc-per-node {tp}) or set --tp_size "
                f"{ranks.world_size}")
        ctx.heads = heads
        emit(RankJoined(rank=ranks.rank, world_size=ranks.world_size, local_rank=ranks.local_rank,
                        tensor_parallel_size=tp, heads=heads.to_dict()))
        if ranks.distributed and os.environ.get(LAUNCHER_ENV) == "kvload":  # the CLI started the ranks, not torchrun
            emit(RanksLaunched(rank=ranks.rank, world_size=ranks.world_size, launcher="kvload",
                               master_addr=os.environ.get("MASTER_ADDR", ""),
                               master_port=int(os.environ.get("MASTER_PORT", "0") or 0)))


def require_all_ranks(ctx: Context, what: str) -> None:
    """``RankError`` when ``tensor_parallel_size`` asks for ranks this run does not have (``what`` needs them)."""
    tp = ctx.args.tensor_parallel_size
    if tp > 1 and ctx.ranks.world_size != tp:
        raise RankError(f"tensor_parallel_size={tp}: {what} needs all {tp} ranks, and this process runs alone; "
                        f"launch it with torchrun --nproc-per-node {tp}, or from the command line, where kvload run, "
                        f"generate and serve start the {tp} ranks themselves (plan shows one rank's view without them)")
