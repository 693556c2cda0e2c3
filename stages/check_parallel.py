"""Stage ``check_parallel``: check ``tensor_parallel_size`` against the checkpoint and the launched ranks.

Query heads must divide by the ranks; KV heads shard when they divide, are replicated when the ranks are
a multiple of them, and any other combination is refused (``models.geometry.head_sharding``). Under
torchrun the ranks launched must be exactly ``tensor_parallel_size``. ``plan`` in one process may ask
for more ranks than it has: it plans rank 0's view; building pools needs every rank present.
"""

from __future__ import annotations

import os

from models.geometry import accepted_sizes, sharding_mode
from pipeline.bus import Emit
from pipeline.context import Context
from pipeline.errors import ModelError, RankError
from pipeline.events import RankJoined, RanksLaunched
from pipeline.ranks import LAUNCHER_ENV, ranks_from_env


class CheckParallel:
    """Writes ``ctx.heads`` (and ``ctx.ranks`` when nobody set it); emits ``rank_joined``."""

    name = "check_parallel"
    error = RankError

    def __init__(self, starts_ranks: bool = False) -> None:
        #: the launchers' (the CLI's, kvload.LLM's): this process is about to start the ranks on this machine's CUDA
        #: devices. Else only a launched rank checks the devices: ``plan`` in one process plans rank 0's view of a
        #: size this machine need not have (an 8-GPU target, planned on a one-GPU workstation)
        self.starts_ranks = starts_ranks

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
        runs = self.starts_ranks or ranks.distributed  # the ranks take this machine's devices (not a plan's view)
        devices = cuda_devices() if runs and tp > 1 and str(ctx.args.device).startswith("cuda") else 0
        here = _env_int("LOCAL_WORLD_SIZE", tp)  # the ranks on this machine (torchrun's; all of them otherwise)
        if 0 < devices < here:  # each rank takes cuda:LOCAL_RANK: rank 1 on a one-GPU machine met "invalid device
            # ordinal" in torch.cuda.set_device, after the other ranks had started (vLLM refuses this world size too)
            sizes = accepted_sizes(heads.attention_heads, None if heads.mode == "latent" else heads.kv_heads, devices)
            raise RankError(
                f"tensor_parallel_size={tp}: each rank runs on its own CUDA device (rank N on cuda:N), and this "
                f"machine has {devices}; accepted here: {sizes}")
        ctx.heads = heads
        if ctx.request.load_weights and heads.mode == "replicate":
            # transformers' plans shard k_proj by columns and never replicate a KV head: refused here, where the
            # launchers (the CLI's, kvload.LLM's) check the size before starting any rank, not after N ranks loaded
            # (a shard that divides, the usual case, is checked at load_weights: no transformers import here)
            check_plan_matches_pools(ctx)
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


def check_plan_matches_pools(ctx: Context) -> None:
    """``ModelError`` when transformers' TP plan would compute other KV heads per rank than the pools hold."""
    heads, tp = ctx.heads, ctx.args.tensor_parallel_size
    if heads is None or heads.mode == "latent":  # the latent is whole; MLA plans leave the attention whole
        return
    from models.weights import plan_kv_heads_per_rank  # transformers' config classes: torch, seconds

    computed = plan_kv_heads_per_rank(ctx.hf_config, tp)
    if computed == heads.kv_heads_per_rank:
        return
    arch = ctx.model.architecture if ctx.model is not None else "the model"
    why = (f"cannot split its {heads.kv_heads} KV heads over {tp} ranks (it shards k_proj/v_proj by columns and "
           "does not replicate heads)" if computed is None else
           f"computes {computed} KV heads per rank, the pools hold {heads.kv_heads_per_rank}")
    accepted = ", ".join(str(t) for t in range(1, heads.kv_heads + 1)
                         if sharding_mode(heads.attention_heads, heads.kv_heads, t) == "shard")
    raise ModelError(f"tensor_parallel_size={tp}: transformers' tensor-parallel plan for {arch} {why}; plan and run "
                     f"accept this size, loading weights needs one that divides the KV heads ({accepted})")


def cuda_devices() -> int:
    """The CUDA devices torch sees on this machine (0 without torch, a driver or a device)."""
    from stages.resolve_auto import cuda_available

    if not cuda_available():
        return 0
    import torch

    return int(torch.cuda.device_count())


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, ""))
    except ValueError:
        return default
