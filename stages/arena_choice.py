"""What ``kv_cache_config.pool_arena: "auto"`` resolves to, and why (``resolve_auto`` asks, after ``max_seq_len``).

The measurements behind the rule: on ``kvload simulate``'s V4 grid the slab arena took 0.28-1.00x the split pools'
steps on every cell it could run (BENCHMARKS.md, "The slab arena through pool_arena"), but with requests near
``max_seq_len`` (the split then sized for them) it took more, up to 1.97x at budgets of a few sequences, and nothing
known when "auto" resolves tells those cells apart ("Where the slab arena loses"; ``pool_arena: false`` there). It
cannot run a request whose groups need more slabs than the arena has (a slab per group in use is its floor, where the
split's floor is a block per group). So "auto" is the arena when the budget holds every group's blocks of one
``max_seq_len`` sequence in slabs of their own (no request the manager accepts can then be refused for the floor), and
its reason says where it can lose; the split otherwise; the same for real pools (``run``, ``generate``, ``serve``) as
for simulations, but on CUDA, whose budget comes from free memory measured after this choice (the split there;
``true`` builds the arena), and with an asked-for host tier (the arena runs without one).
"""

from __future__ import annotations

from typing import Any

from cache_backends.budget import (
    arena_unfit_reason,
    compute_budget,
    is_cuda,
    slab_bytes,
    slabs_for_sequence,
)
from cache_backends.kinds import kind_for
from cache_backends.layout import KvLayout, build_layout
from pipeline.context import Context

#: The fields a user bounds the budget with (a caller's default budget applies when neither is set).
BUDGET_FIELDS = ("kv_cache_config.max_tokens", "kv_cache_config.max_gpu_total_bytes")

def layout_of(ctx: Context) -> KvLayout | None:
    """The KV layout the resolved args route to (None when it cannot be laid out: ``plan_kv`` says why)."""
    kv = ctx.args.kv_cache_config
    try:
        manager = kind_for(kv.use_kv_cache_manager_v2).name
        return build_layout(ctx.spec.kv_layers(ctx.args.tensor_parallel_size), manager, kv.tokens_per_block,
                            str(kv.dtype), kv.max_page_padding)
    except ValueError:
        return None


def resolve_pool_arena(ctx: Context) -> tuple[bool, str, str]:
    """``"auto"``: (arena or not, source, why), as the module docstring says."""
    layout = layout_of(ctx)
    if layout is None:
        return False, "auto", "the model's KV cache cannot be laid out (plan_kv says why)"
    unfit = arena_unfit_reason(layout)
    if unfit is not None:
        return False, "auto", f"{unfit}; the arena is for V2 groups of unequal pages (DeepSeek V4)"
    kv = ctx.args.kv_cache_config
    if kv.host_cache_size:
        return False, "auto", (f"kv_cache_config.host_cache_size={kv.host_cache_size} asks for a host tier; the slab "
                               "arena runs without one")
    device = str(ctx.args.device)
    if is_cuda(device):
        return False, "auto", ("on CUDA the budget comes from free memory, measured when the pools are planned, after "
                               "this choice; set pool_arena to true to have the arena")
    budget, default = _budget(layout, ctx), ""
    hint = ctx.request.default_budget if ctx.request is not None else None
    if hint is not None and not any(ctx.user_fields[p].value for p in BUDGET_FIELDS if p in ctx.user_fields):
        budget = hint[0] * layout.bytes_for_sequence(hint[1])  # what the caller will set: its default
        default = f" (the default of {hint[0]:,} sequence(s) of {hint[1]:,} tokens)"
    length = ctx.args.max_seq_len
    slab = slab_bytes(layout)
    need = slabs_for_sequence(layout, length)
    if budget is None:
        return False, "auto", "no rule bounds the budget yet (plan_kv says what sizes the pools)"
    slabs = budget // slab
    held = f"the budget of {budget:,} B{default} holds {slabs:,} slabs of {slab:,} B"
    one = f"one max_seq_len={length} sequence takes {need:,} (a slab per group in use is the arena's floor)"
    if slabs >= need:
        return True, "auto", (f"{held}; {one}, so any request fits, and memory flows between the groups as they "
                              "need it (0.28-1.00x the split's steps on kvload simulate's V4 grid), but with requests "
                              "near max_seq_len it can take more (up to 1.97x at budgets of a few sequences; "
                              "BENCHMARKS.md, \"Where the slab arena loses\"): set pool_arena to false there; it runs "
                              "without a host tier (set host_cache_size for the split with one)")
    return False, "auto", (f"{held}; {one}: fewer, so a request the split pools hold could find no slab; lower "
                           "max_seq_len or raise the budget for the arena")


def _budget(layout: KvLayout, ctx: Context) -> int | None:
    """The budget ``plan_kv`` will compute on a CPU: the smallest cap, else default_max_tokens' (None: unbounded)."""
    kv, args = ctx.args.kv_cache_config, ctx.args

    def budget_for(max_tokens: Any) -> int | None:
        return compute_budget(layout, device="cpu", max_seq_len=args.max_seq_len,
                              free_gpu_memory_fraction=kv.free_gpu_memory_fraction,
                              max_gpu_total_bytes=kv.max_gpu_total_bytes, max_tokens=max_tokens).budget_bytes

    budget = budget_for(kv.max_tokens)
    if budget is None and kv.default_max_tokens is not None:
        budget = budget_for(kv.default_max_tokens)
    return budget
