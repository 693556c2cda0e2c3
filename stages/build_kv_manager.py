"""Stage 6: compute the KV plan, allocate the pools on the device, build the routed manager and scheduler.

Everything it allocates is registered with ``ctx.on_close`` as soon as it exists, so a failure
here or in a later stage (the runner closes the context) and ``LoadResult.close()`` free it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cache_backends.budget import host_available_bytes, is_cuda
from cache_backends.interface import ManagerOptions
from cache_backends.kinds import kind_named
from pipeline.bus import Emit
from pipeline.context import DEFAULT_MAX_TOKENS_FIELD, Context
from pipeline.errors import KvBuildError, KvRuntimeError, first_line
from pipeline.events import KvManagerBuilt, SettingIgnored
from stages.check_parallel import require_all_ranks
from stages.plan_kv import (
    EVENTS_FIELD,
    EVENTS_READERS,
    HOST_FIELD,
    RULE_FIELDS,
    KvPlan,
    compute_kv_plan,
    device_problem,
)

if TYPE_CHECKING:
    from cache_backends.pools import BlockPools


def check_device(device: str) -> None:
    """``KvBuildError`` when the resolved device cannot hold pools here (CUDA asked for, none present)."""
    problem = device_problem(device)
    if problem is not None:
        raise KvBuildError(problem)


def manager_classes(manager: str) -> tuple[type, type]:
    """The (manager, scheduler) classes of a plan's manager kind (``"v1"``/``"v2"``), imported when built."""
    kind = kind_named(manager)
    try:
        return kind.classes()
    except ImportError as exc:
        raise KvBuildError(f"{kind.manager} is not available in this installation ({exc}); "
                           "set kv_cache_config.use_kv_cache_manager_v2 to the other value if the model allows it"
                           ) from None


def manager_options(ctx: Context) -> ManagerOptions:
    """The manager settings from the resolved args, as the library's plain values."""
    kv = ctx.args.kv_cache_config
    return ManagerOptions(
        max_seq_len=ctx.args.max_seq_len,
        enable_block_reuse=kv.enable_block_reuse,
        enable_partial_reuse=kv.enable_partial_reuse,
        # the plan's: with several ranks it is the size every rank agreed on (pipeline.ranks)
        host_cache_size=ctx.kv.host_cache_size if isinstance(ctx.kv, KvPlan) else kv.host_cache_size,
        max_util_for_resume=kv.max_util_for_resume,
        enable_swa_scratch_reuse=kv.enable_swa_scratch_reuse,
    )


class BuildKvManager:
    """Writes ``ctx.kv``, ``ctx.kv_manager``, ``ctx.scheduler``; emits ``kv_budget_computed``, ``kv_manager_built``."""

    name = "build_kv_manager"
    error = KvBuildError

    def run(self, ctx: Context, emit: Emit) -> None:
        """Plan, check the device and the budget, allocate, construct; free everything on failure."""
        require_all_ranks(ctx, "building the KV pools")
        plan = compute_kv_plan(ctx, emit)
        ctx.kv = plan
        if plan.problem is not None or plan.pools is None:
            raise KvBuildError(plan.problem)
        check_device(plan.device)
        unbacked = ctx.request is not None and ctx.request.pools_unbacked
        if unbacked:  # no memory for the pools (the simulator's), but the manager's per-block lists take some
            check_bookkeeping(plan, ctx)
        else:
            self._check_host_memory(plan, ctx)
        manager_cls, scheduler_cls = manager_classes(plan.manager)

        try:
            from cache_backends.pools import BlockPools  # torch: only when something is allocated

            pools = BlockPools(plan.layout, plan.pools.num_blocks, "meta" if unbacked else plan.device,
                               slabs=plan.arena_slabs)
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            detail = first_line(exc)
            raise KvRuntimeError(f"allocating {plan.pools.total_bytes} B of KV pools on {plan.device} failed: "
                                 f"{detail}") from exc
        ctx.on_close(pools.release)
        manager = manager_cls(pools, manager_options(ctx))
        ctx.on_close(manager.close)
        events = ctx.args.kv_cache_config.event_buffer_max_size
        if events > 0 and ctx.request is not None and not ctx.request.kv_events_reader:
            if EVENTS_FIELD in ctx.user_fields:
                emit(SettingIgnored(field=EVENTS_FIELD, value=events,
                                    reason=f"no reader of KV cache events in this command; {EVENTS_READERS}"))
            events = 0  # a buffer nothing drains would only cost
        if events > 0:  # KV cache events: off (no buffer, no cost) unless asked for
            from cache_backends.kv_events import KvEventBuffer

            manager.enable_kv_events(KvEventBuffer(events))
        args = ctx.args
        scheduler = scheduler_cls(manager, args.max_batch_size, args.max_num_tokens,
                                  scheduling_policy=args.scheduling_policy)
        ctx.kv_manager, ctx.scheduler = manager, scheduler
        emit(KvManagerBuilt(
            kv_manager=type(manager).__name__, scheduler=type(scheduler).__name__, device=str(pools.device),
            dtype=plan.dtype, tokens_per_block=plan.tokens_per_block, groups=self._groups(plan, pools),
            total_bytes=pools.nbytes, capacity_tokens=plan.pools.capacity_tokens, max_seq_len=plan.max_seq_len,
            max_concurrency=plan.pools.max_concurrency, host_bytes=host_bytes(manager),
        ))

    @staticmethod
    def _groups(plan: KvPlan, pools: BlockPools) -> dict[str, dict[str, Any]]:
        described = pools.describe()
        return {
            g.name: {
                "kind": g.kind,
                "layers": list(g.layers),
                "window": g.window,
                "compress_rate": g.compress_rate,
                "tokens_per_block": g.tokens_per_block,
                "bytes_per_block": g.bytes_per_block,
                "blocks": described[g.name]["blocks"],
                "bytes": described[g.name]["bytes"],
                "shape": described[g.name]["shape"],
                "shared": pools.shared,  # True: one arena every group views (bytes: the arena's, counted once)
            }
            for g in plan.layout.groups
        }

    @staticmethod
    def _check_host_memory(plan: KvPlan, ctx: Context) -> None:
        check_host_memory(plan, ctx)


def check_host_memory(plan: KvPlan, ctx: Context) -> None:
    """``KvBuildError`` when host memory cannot take what lives there: the pools on CPU, the V2 host tier."""
    available = host_available_bytes()
    assert plan.pools is not None
    pools = 0 if is_cuda(plan.device) else plan.pools.total_bytes
    host = plan.host_bytes or 0
    if available is None or pools + host <= available:
        return
    parts, fields = [], []
    if pools:
        parts.append(f"KV pools of {pools} B")
        fields.extend(_pool_culprits(plan, ctx))
    if host:
        parts.append(f"a host tier of {host} B")
        fields.append(HOST_FIELD)
    raise KvBuildError(f"{' plus '.join(parts)} exceed the {available} B of memory this host has available; "
                       f"lower {' or '.join(fields)}")


#: What a manager keeps per block in Python lists (reference counts, generations, radix owners, ...), at its peak:
#: measured at 118-121 B on V1 and 86 B on V2 (tiny-llama, 2.1M and 4.2M blocks: peak RSS of ``kvload
#: simulate`` over a 32-block run's); rounded up, so the bound errs on the side of refusing.
BOOKKEEPING_BYTES_PER_BLOCK = 128
#: What V2's host tier keeps per slot (its free list; the tier's tensor is unbacked too): measured at 39 B (the same
#: run with the auto-sized tier, one slot per block, against ``host_cache_size`` 0), rounded up.
BOOKKEEPING_BYTES_PER_HOST_SLOT = 48


def check_bookkeeping(plan: KvPlan, ctx: Context) -> None:
    """``KvBuildError`` when unbacked pools (a simulation) have more blocks (and V2 host-tier slots) than half this
    host's available memory can keep the bookkeeping of: the pools take no memory, but a budget of petabytes would
    still fill it with lists."""
    assert plan.pools is not None
    counts, slots = plan.pools.num_blocks, plan.host_slots or {}
    shared = plan.layout.shared  # one arena: its pages (and the host tier's page slots) counted once
    blocks = max(counts.values()) if shared else sum(counts.values())
    host = max(slots.values(), default=0) if shared else sum(slots.values())
    available = host_available_bytes()
    need = blocks * BOOKKEEPING_BYTES_PER_BLOCK + host * BOOKKEEPING_BYTES_PER_HOST_SLOT
    if available is None or need <= available // 2:
        return
    fields = _pool_culprits(plan, ctx)
    what = f"{blocks} KV blocks" + (f" and {host} host-tier slots" if host else "")
    each = f"~{BOOKKEEPING_BYTES_PER_BLOCK} B a block" + (f", ~{BOOKKEEPING_BYTES_PER_HOST_SLOT} B a slot" if host
                                                          else "")
    if host:
        fields.append(f"{HOST_FIELD} (0: no host tier)")
    raise KvBuildError(f"{what} need about {need} B of bookkeeping ({each}; a simulation allocates no pools, but keeps "
                       f"that), more than half the {available} B of memory this host has available; lower "
                       f"{' or '.join(fields)} or raise kv_cache_config.tokens_per_block")


def _pool_culprits(plan: KvPlan, ctx: Context) -> list[str]:
    """The settings that made the pools this big, as the user can change them (never one they did not set)."""
    kv = ctx.args.kv_cache_config
    out: list[str] = []
    if plan.tokens_per_block > plan.max_seq_len:  # every sequence holds at least one whole block
        return [f"kv_cache_config.tokens_per_block ({plan.tokens_per_block}, above max_seq_len {plan.max_seq_len})"]
    rule = plan.budget.limited_by or ""
    if rule == "max_tokens" and kv.max_tokens is None and kv.default_max_tokens is not None:
        # name what sized the pools as the caller knows it: generate's and serve's flags, else the field
        derived = ctx.request.caller_defaults.get(DEFAULT_MAX_TOKENS_FIELD) if ctx.request is not None else None
        if derived is not None and DEFAULT_MAX_TOKENS_FIELD not in ctx.user_fields:
            held = plan.budget.max_tokens
            if derived.sequences and held is not None and held < kv.default_max_tokens:
                # plan_kv capped them at sequences x max_seq_len: a shorter default length would not shrink them
                where = "max_seq_len" if derived.source == "LLM" else "--max_seq_len"
                out.append(f"{where} ({plan.max_seq_len:,}: the pools hold {derived.sequences} sequence(s) of it, "
                           f"{held:,} tokens, when nothing bounds them; a shorter default length would not shrink "
                           "them)")
            else:
                out.append(derived.reason)
        else:
            out.append(f"{DEFAULT_MAX_TOKENS_FIELD} (the pools hold {plan.budget.max_tokens} tokens when neither "
                       "max_tokens nor max_gpu_total_bytes bounds them)")
    elif rule in RULE_FIELDS:
        out.append(RULE_FIELDS[rule])
    return out or ["the budget"]


def host_bytes(manager: Any) -> int:
    """Host memory of a manager's host tier (0 for V1 or without a tier)."""
    host = getattr(manager, "host", None)
    return int(host.nbytes) if host is not None else 0
