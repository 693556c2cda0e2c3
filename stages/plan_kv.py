"""Stage ``plan_kv`` (what ``plan`` runs after routing): the KV layout, budget and pools, without allocating.

:func:`compute_kv_plan` is the one place the numbers come from; ``build_kv_manager`` calls it too
and allocates exactly what it returns, so ``plan`` reports what ``load`` would build.
"""

from __future__ import annotations

from typing import Any

import attrs

from cache_backends.budget import (
    AUTO_HOST_FRACTION,
    BudgetError,
    KvBudget,
    PoolPlan,
    arena_unfit_reason,
    compute_budget,
    host_available_bytes,
    host_tier_bytes,
    host_tier_slots,
    is_cuda,
    measure_free_bytes,
    plan_arena,
    plan_pools,
    slab_bytes,
    slabs_for_sequence,
)
from cache_backends.kinds import kind_for
from cache_backends.layout import KvLayout, build_layout, longest
from cache_backends.reuse import partial_reuse_off_reason
from pipeline.bus import Emit
from pipeline.config import ARENA_FIELD, refit_max_seq_len
from pipeline.context import DEFAULT_MAX_TOKENS_FIELD, Context
from pipeline.errors import KvBuildError
from pipeline.events import (
    FieldDerived,
    KvBlocksOversized,
    KvBudgetComputed,
    KvBudgetShort,
    KvHostTierChosen,
    KvHostTierSized,
    SettingIgnored,
)
from pipeline.text import cell, table
from stages.host_tier_choice import choose_host_tier
from stages.rank_budget import agree_rest, min_budget

#: What each budget rule is called in messages: the field a user changes to move it.
RULE_FIELDS = {
    "free_gpu_memory_fraction": "kv_cache_config.free_gpu_memory_fraction",
    "max_gpu_total_bytes": "kv_cache_config.max_gpu_total_bytes",
    "max_tokens": "kv_cache_config.max_tokens",
}

HOST_FIELD = "kv_cache_config.host_cache_size"


@attrs.frozen
class KvPlan:
    """Geometry, budget and pools of the routed manager: ``kv`` in ``--json`` and the table's KV section."""

    manager: str  # "v1" | "v2"
    kv_manager: str
    scheduler: str
    device: str
    dtype: str
    tokens_per_block: int
    max_seq_len: int
    layout: KvLayout
    budget: KvBudget
    pools: PoolPlan | None  # None when the budget is unbounded or too small (``problem`` says which)
    problem: str | None = None  # why ``load`` cannot build these pools; None when it can
    host_cache_size: int | None = None  # the setting: bytes, 0 = no host tier, None = auto-size (V2)
    host_slots: dict[str, int] | None = None  # V2 host tier slots per group ({} = none); None when unknown
    host_bytes: int | None = None  # host memory of the V2 host tier (0 = none); None when unknown
    host_choice: str | None = None  # auto (host_cache_size null): why the tier was kept or left out, on what hardware
    tensor_parallel_size: int = 1
    heads: dict[str, Any] | None = None  # HeadSharding.to_dict(): the KV heads each rank holds
    limited_by_rank: int | None = None  # with several ranks: whose budget (the smallest) every rank took
    rank_budget_bytes: list[int | None] | None = None  # with several ranks: each rank's own budget
    arena_slabs: int | None = None  # a slab arena (pool_arena): its slabs; None: pools of fixed sizes
    host_sized_by: str | None = None  # V2: what sized the host tier (kv_host_tier_sized's sized_by); None when unknown
    host_reason: str | None = None  # V2: kv_host_tier_sized's reason, the same line in --json

    @property
    def arena(self) -> bool:
        """Whether the groups draw on one slab arena (``pools.num_blocks`` is then each group's id space)."""
        return self.arena_slabs is not None

    @property
    def bytes_per_token(self) -> float:
        """Asymptotic bytes per token of the routed layout on one rank (``kv-geometry.md``)."""
        return self.layout.bytes_per_token

    @property
    def bytes_per_token_total(self) -> float:
        """Bytes per token over every tensor-parallel rank (replicated KV heads and latents counted per copy)."""
        return self.layout.bytes_per_token * self.tensor_parallel_size

    @property
    def budget_bytes(self) -> int | None:
        """The KV budget in bytes, or None when unbounded."""
        return self.budget.budget_bytes

    @property
    def capacity_tokens(self) -> int | None:
        """Tokens the pools hold, or None when unbounded."""
        return self.pools.capacity_tokens if self.pools else None

    @property
    def max_concurrency(self) -> int | None:
        """Sequences of ``max_seq_len`` that fit at once, or None when unbounded."""
        return self.pools.max_concurrency if self.pools else None

    def to_dict(self) -> dict[str, Any]:
        """The ``kv`` object of ``plan --json`` / ``run --json``."""
        blocks = self.pools.num_blocks if self.pools else {}
        groups = []
        for g in self.layout.groups:
            n = blocks.get(g.name)
            # a shared arena's groups all view the same pages: their bytes are the arena's, counted once in
            # total_bytes, so a group has none of its own to add up
            own = n * g.bytes_per_block if n is not None and not self.layout.shared else None
            if self.arena:  # no group's share of a slab arena is fixed: nothing to count per group
                n = own = None
            groups.append({**g.to_dict(), "blocks": n, "bytes": own, "shared": self.layout.shared})
        return {
            "manager": self.manager,
            "kv_manager": self.kv_manager,
            "scheduler": self.scheduler,
            "device": self.device,
            "dtype": self.dtype,
            "tokens_per_block": self.tokens_per_block,
            "max_seq_len": self.max_seq_len,
            "layer_groups": groups,
            "memory": self.memory_dict(),
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_token_per_rank": self.bytes_per_token,
            "bytes_per_token_total": self.bytes_per_token_total,
            "tensor_parallel": {"size": self.tensor_parallel_size, "heads": self.heads,
                                "limited_by_rank": self.limited_by_rank, "rank_budget_bytes": self.rank_budget_bytes},
            "bytes_per_sequence": self.layout.bytes_for_sequence(self.max_seq_len),
            "budget_bytes": self.budget_bytes,
            "budget_limited_by": self.budget.limited_by,
            "budget": self.budget.to_dict(),
            "total_bytes": self.pools.total_bytes if self.pools else None,
            "host_bytes": self.host_bytes,
            "host_slots": self.host_slots,
            "host_choice": self.host_choice,
            "host_sized_by": self.host_sized_by,
            "host_reason": self.host_reason,
            "capacity_tokens": self.capacity_tokens,
            "max_concurrency": self.max_concurrency,
            "problem": self.problem,
        }

    def memory_dict(self) -> dict[str, Any]:
        """How the groups hold device memory: one arena shared by all (each group's ``blocks`` is the whole
        arena, what it could hold alone), or split between them, and why."""
        layout, blocks = self.layout, (self.pools.num_blocks if self.pools else None)
        return {
            "shared": layout.shared,
            "unshared_reason": layout.unshared_reason,
            "arena_blocks": layout.arena_blocks(blocks) if layout.shared and blocks else None,
            "page_bytes": layout.page_bytes,
            # a shared arena's pages that padded groups fill only in part (KvLayout.padding_dict); None: none
            "padding": layout.padding_dict(self.max_seq_len),
            # split pools: the sequence length the windows are sized for (KvLayout.split_length)
            "split_length": (layout.split_length(self.max_seq_len)
                             if not layout.shared and len(layout.groups) > 1 and not self.arena else None),
            "arena_slabs": self.arena_slabs,
            "slab_bytes": slab_bytes(layout) if self.arena else None,
            "text": self.arena_text() if self.arena else layout.memory_text(blocks, self.max_seq_len),
        }

    def arena_text(self) -> str:
        """The memory line of a slab arena: its slabs, and why no group's blocks are a fixed figure."""
        slab = slab_bytes(self.layout)
        each = ", ".join(f"{g.name} {slab // g.bytes_per_block}" for g in self.layout.groups)
        return (f"memory: one slab arena of {self.arena_slabs:,} slabs of {slab:,} B (pool_arena); a slab holds one "
                f"group's blocks at a time ({each} a slab), taken as the group grows and given back once free, so "
                "no group's share is fixed")

    def render(self) -> list[str]:
        """The table's KV section: one row per layer group, then budget and capacity."""
        lines = [f"kv cache  {self.kv_manager} ({self.manager}) on {self.device}, {self.dtype}, "
                 f"{self.tokens_per_block} tokens/block, max_seq_len {self.max_seq_len}"]
        blocks = self.pools.num_blocks if self.pools else {}
        rows = [["group", "kind", "layers", "window", "rate", "bytes/block", "blocks", "bytes"]]
        for g in self.layout.groups:
            n = blocks.get(g.name)
            nbytes = cell(None if n is None else n * g.bytes_per_block)
            if self.layout.shared and n is not None:
                nbytes = "shared"  # the arena's bytes are counted once, in the memory line
            if self.arena:
                n, nbytes = "arena", "arena"  # no group's share is fixed (the memory line says so)
            rows.append([g.name, g.kind, layer_ranges(g.layers), cell(g.window), cell(g.compress_rate),
                         f"{g.bytes_per_block:,}", cell(n), nbytes])
        lines += table(rows)
        memory = (self.arena_text() if self.arena else
                  self.layout.memory_text(blocks or None, self.max_seq_len if blocks else None))
        if memory is not None:
            lines.append(f"  {memory}")
        lines.append(f"  bytes/token {self.bytes_per_token:,.6g} (each token past every window); "
                     f"one max_seq_len sequence {self.layout.bytes_for_sequence(self.max_seq_len):,} B")
        if self.tensor_parallel_size > 1:
            lines.append(f"  tensor parallel  {self.tensor_parallel_size} ranks, {self._heads_text()}; every table "
                         f"above is one rank's; bytes/token {self.bytes_per_token:,.6g} per rank, "
                         f"{self.bytes_per_token_total:,.6g} in total")
        if self.pools is not None:
            b = self.budget
            per_rank = self.rank_budget_bytes or []
            by_rank = ""
            if len(set(per_rank)) > 1:
                by_rank = f" of rank {self.limited_by_rank}, the smallest of the ranks'"
            elif per_rank:
                by_rank = f", the same on all {len(per_rank)} ranks"
            lines.append(f"  budget  {b.budget_bytes:,} B (set by {RULE_FIELDS.get(b.limited_by or '', b.limited_by)}"
                         f"{by_rank}); pools {self.pools.total_bytes:,} B")
            if self.arena:
                lines.append(f"  capacity  {self.pools.max_concurrency} sequence(s) of max_seq_len at once; one "
                             f"sequence alone up to {self.pools.capacity_tokens:,} tokens")
            else:
                lines.append(f"  capacity  {self.pools.capacity_tokens:,} tokens; {self.pools.max_concurrency} "
                             f"sequence(s) of max_seq_len at once")
            if self.pools.max_concurrency == 0:
                lines.append(f"  note: the pools hold less than one sequence of max_seq_len {self.max_seq_len}; "
                             "longer requests will never be admitted")
            if self.manager == "v2" and self.host_bytes is not None:
                lines.append(f"  host tier  {self.host_tier_text()}")
        if self.problem is not None:
            lines.append(f"  load/run would stop here: {self.problem}")
        return lines

    def _heads_text(self) -> str:
        h = self.heads or {}
        mode = h.get("mode")
        if mode == "latent":
            return "the MLA latent whole on every rank"
        kv = f"{h.get('kv_heads_per_rank')} of {h.get('kv_heads')} KV heads per rank"
        if mode == "replicate":  # planned; transformers' plans never replicate a KV head, so a load refuses it
            kv += (f" (each replicated on {h.get('kv_replicas')} ranks: plan and run only, generate and serve refuse "
                   "it as transformers' plans never replicate a KV head)")
        return f"{h.get('attention_heads_per_rank')} of {h.get('attention_heads')} query heads and {kv}"

    def host_tier_text(self) -> str:
        """The V2 host tier in one phrase: its bytes of host memory and what sized it."""
        return f"{self.host_bytes or 0:,} B of host memory ({self._host_origin()})"

    def _host_origin(self) -> str:
        if self.host_choice is not None:  # auto, decided on the accelerator's costs
            return f"{'auto-sized' if self.host_slots else 'none'}: {self.host_choice}"
        if not self.host_slots:
            return f"none: {HOST_FIELD}=0"
        size = self.host_cache_size
        return "auto-sized" if size is None else f"{HOST_FIELD}={size:,} B"


def layer_ranges(layers: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` → ``"0-2,5"``."""
    parts: list[str] = []
    run: list[int] = []
    for i in layers:
        if run and i != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(i)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


def weights_bytes(ctx: Context) -> int:
    """Bytes of the weights already loaded into ``ctx.hf_model`` (0 when none are)."""
    model = ctx.hf_model
    if model is None or not hasattr(model, "parameters"):
        return 0
    tensors = [*model.parameters(), *(model.buffers() if hasattr(model, "buffers") else ())]
    return sum(t.numel() * t.element_size() for t in tensors)


def device_problem(device: str) -> str | None:
    """Why the resolved device cannot hold pools on this machine (CUDA asked for, none or not that one), or None."""
    if not is_cuda(device):
        return None
    import torch

    if not torch.cuda.is_available():
        return f"device={device}: no CUDA device is available on this machine; set device to cpu (or auto)"
    index = torch.device(device).index
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        return f"device={device}: only {count} CUDA device(s) present (cuda:0..cuda:{count - 1})"
    return None


def compute_kv_plan(ctx: Context, emit: Emit) -> KvPlan:
    """Layout of the routed manager, budget (``kv_budget_computed``) and pools; allocates nothing.

    Raises ``KvBuildError`` when the geometry cannot be laid out. A device that is not there, a budget
    that is unbounded or too small for one block per layer group, or a host tier that cannot be built
    is not an error here: the plan says so in ``problem`` (the device's message first; ``plan``
    reports the geometry; ``build_kv_manager`` raises it before allocating anything).
    """
    args, route = ctx.args, ctx.route
    kv = args.kv_cache_config
    manager = kind_for(route.use_kv_cache_manager_v2).name
    tp = args.tensor_parallel_size
    try:
        layout = build_layout(ctx.spec.kv_layers(tp), manager, kv.tokens_per_block, kv.dtype, kv.max_page_padding)
    except ValueError as exc:
        raise KvBuildError(f"{ctx.model.name}: cannot lay out the KV cache: {exc}") from None
    device = str(args.device)
    device_issue = device_problem(device)  # before measuring: a device that is not there has no free memory

    def budget_for(max_tokens: int | None) -> KvBudget:
        return compute_budget(
            layout, device=device, max_seq_len=args.max_seq_len,
            free_gpu_memory_fraction=kv.free_gpu_memory_fraction, max_gpu_total_bytes=kv.max_gpu_total_bytes,
            max_tokens=max_tokens, free_bytes=None if device_issue else measure_free_bytes(device),
            weights_bytes=weights_bytes(ctx),
        )

    budget = budget_for(kv.max_tokens)
    reason = budget_reason(budget)
    fraction = RULE_FIELDS["free_gpu_memory_fraction"]
    if fraction in ctx.user_fields and not is_cuda(device):
        emit(SettingIgnored(field=fraction, value=kv.free_gpu_memory_fraction,
                            reason=f"a fraction of free CUDA memory; on {device} the budget comes from "
                                   "kv_cache_config.max_tokens or max_gpu_total_bytes"))
    fallback = kv.default_max_tokens
    defaulted = budget.budget_bytes is None and fallback is not None
    if defaulted:
        # the default when no rule bounds the budget (CPU without max_tokens or max_gpu_total_bytes);
        # max_tokens stays null, this event says what sized the pools
        unbounded = budget.unbounded_reason
        capped = ""
        derived = ctx.request.caller_defaults.get(DEFAULT_MAX_TOKENS_FIELD) if ctx.request is not None else None
        if (derived is not None and derived.sequences and DEFAULT_MAX_TOKENS_FIELD not in ctx.user_fields
                and fallback == derived.value and derived.sequences * args.max_seq_len < fallback):
            # no sequence grows past max_seq_len: pools for more would be memory nothing can use
            fallback = derived.sequences * args.max_seq_len
            capped = f" capped at {derived.sequences} sequence(s) of max_seq_len={args.max_seq_len}"
        budget = budget_for(fallback)
        reason = (f"{unbounded}, so {DEFAULT_MAX_TOKENS_FIELD}={kv.default_max_tokens}{capped} applies "
                  f"({budget_reason(budget)}); set kv_cache_config.max_tokens to choose")
    elif fallback is not None and DEFAULT_MAX_TOKENS_FIELD in ctx.user_fields:
        rule = RULE_FIELDS.get(budget.limited_by or "", "a rule")
        emit(SettingIgnored(field=DEFAULT_MAX_TOKENS_FIELD, value=fallback,
                            reason=f"it sizes the pools only when no rule bounds the budget, and {rule} bounds it "
                                   f"({budget_reason(budget)})"))
    ranks = ctx.ranks
    agreed = min_budget(ranks, budget, reason) if ranks is not None and ranks.distributed else None
    if agreed is not None:
        budget, reason = agreed.budget, agreed.reason
    if ctx.fit_max_seq_len and budget.budget_bytes is not None:
        budget = fit_max_seq_len(ctx, layout, budget, emit)
    emit(KvBudgetComputed(
        manager=manager, device=device, free_bytes=budget.free_bytes, weights_bytes=budget.weights_bytes,
        free_gpu_memory_fraction=budget.free_gpu_memory_fraction, max_gpu_total_bytes=budget.max_gpu_total_bytes,
        max_tokens=budget.max_tokens, max_seq_len=budget.max_seq_len, tokens_cap_bytes=budget.tokens_cap_bytes,
        bytes_per_token=budget.bytes_per_token, min_bytes=budget.min_bytes, budget_bytes=budget.budget_bytes,
        limited_by=budget.limited_by, reason=reason, rank=ranks.rank if ranks is not None else 0,
        limited_by_rank=agreed.limited_by_rank if agreed is not None else None,
        rank_budget_bytes=agreed.rank_budget_bytes if agreed is not None else None,
    ))
    pools, problem = None, device_issue
    unbacked = ctx.request is not None and ctx.request.pools_unbacked
    arena, arena_problem = arena_setting(ctx, layout, emit)
    if budget.budget_bytes is None:
        # a caller's default budget (kvload.LLM's, generate's, serve's) that the user's own null turned off: say so,
        # or the refusal reads as if nothing had been asked
        nulled = (f", and {DEFAULT_MAX_TOKENS_FIELD}=None (given) turns off the default budget"
                  if DEFAULT_MAX_TOKENS_FIELD in ctx.user_fields and fallback is None else "")
        problem = problem or (f"no KV cache budget: {budget.unbounded_reason}{nulled}; set kv_cache_config.max_tokens "
                              "or kv_cache_config.max_gpu_total_bytes (--max_tokens / --max_gpu_total_bytes)")
    elif arena:
        try:
            pools = plan_arena(layout, budget.budget_bytes, args.max_seq_len)
        except BudgetError as exc:
            field = RULE_FIELDS.get(budget.limited_by or "", "the budget")
            problem = problem or f"{ARENA_FIELD}=true: {exc}; raise {field} or set {ARENA_FIELD} to false"
    else:
        try:
            pools = plan_pools(layout, budget.budget_bytes, args.max_seq_len,
                               max_tokens=budget.max_tokens if budget.limited_by == "max_tokens" else None)
        except BudgetError:
            problem = problem or too_small_message(layout, budget)
    problem = problem or arena_problem
    if manager == "v2":
        warn_inert_partial_reuse(ctx, layout, emit)
        warn_inert_page_padding(ctx, layout, emit)
    host_slots, host_bytes = ({}, 0) if manager == "v1" else (None, None)
    host_size, host_choice = kv.host_cache_size, None
    sized_by = "auto" if host_size is None else "host_cache_size"
    if arena and not host_size:  # the arena runs without a host tier (an asked-for one is arena_problem)
        host_size, host_choice = 0, "the slab arena (pool_arena) runs without a host tier"
        sized_by = "pool_arena"
    if manager == "v2" and host_size is None and device_issue is None:  # the budget plays no part in it
        choice = choose_host_tier(ctx, layout, device)
        if choice is not None:
            host_choice, sized_by = choice.reason, "kv_host_tier_chosen"
            host_size = None if choice.keep else 0
            emit(KvHostTierChosen(hardware=choice.hardware, copy_us_per_token=choice.copy_s * 1e6,
                                  recompute_us_per_token=choice.recompute_s * 1e6, host_tier=choice.keep,
                                  reason=choice.reason))
    if manager == "v2" and pools is not None:
        host_slots, host_bytes, host_problem = plan_host_tier(layout, pools, host_size, device, unbacked)
        problem = problem or host_problem
    if ranks is not None and ranks.distributed:
        problem, host_size, host_slots, host_bytes = agree_rest(ranks, layout, pools, problem, host_size, host_slots,
                                                                host_bytes)
    host_sized = None
    if manager == "v2" and pools is not None and host_slots is not None and host_bytes is not None:
        host_sized = KvHostTierSized(host_cache_size=host_size, host_bytes=host_bytes, host_slots=host_slots,
                                     sized_by=sized_by, reason=host_tier_reason(sized_by, host_size, host_choice,
                                                                                host_slots, host_bytes,
                                                                                pools.num_blocks))
        emit(host_sized)
    if manager == "v2":  # no tier is known before the pools are when the setting or the choice says 0
        warn_inert_v2_settings(ctx, layout, 0 if host_size == 0 else host_bytes, emit)
    plan = KvPlan(manager, route.kv_manager, route.scheduler, device, kv.dtype, kv.tokens_per_block,
                  args.max_seq_len, layout, budget, pools, problem, host_size, host_slots, host_bytes, host_choice,
                  tensor_parallel_size=tp, heads=ctx.heads.to_dict() if ctx.heads is not None else None,
                  limited_by_rank=agreed.limited_by_rank if agreed is not None else None,
                  rank_budget_bytes=agreed.rank_budget_bytes if agreed is not None else None,
                  arena_slabs=pools.slabs if pools is not None else None,
                  host_sized_by=host_sized.sized_by if host_sized is not None else None,
                  host_reason=host_sized.reason if host_sized is not None else None)
    # plan and run both say it as a warning, not only as a note in the table; a budget sized by
    # default_max_tokens (generate, for its own prompts) was chosen for shorter requests on purpose
    short = None if defaulted else budget_short(plan)
    if short is not None:
        emit(short)
    oversized = blocks_oversized(plan, DEFAULT_MAX_TOKENS_FIELD if defaulted else RULE_FIELDS["max_tokens"])
    if oversized is not None:
        emit(oversized)
    return plan


def fit_max_seq_len(ctx: Context, layout: KvLayout, budget: KvBudget, emit: Emit) -> KvBudget:
    """``max_seq_len: auto`` (vLLM's ``max_model_len`` -1): the longest sequence whose blocks the budget's pools hold
    at least once, at most the checkpoint's length (resolve_auto's); ``field_derived`` saying so when it is less."""
    limit = ctx.args.max_seq_len

    def fits(length: int) -> bool:
        capped = budget.max_tokens if budget.limited_by == "max_tokens" else None
        try:
            return plan_pools(layout, budget.budget_bytes, length, max_tokens=capped).max_concurrency > 0
        except BudgetError:
            return False

    if fits(limit):
        return budget
    low = longest(fits, limit - 1)
    if low == 0:  # not one block per group: the plan's problem says so, as for any length
        return budget
    rule = budget.limited_by or "the KV budget"
    refit_max_seq_len(ctx.args, low)
    emit(FieldDerived(field="max_seq_len", old=limit, new=low, source="kv_budget",
                      reason=f"auto (vLLM's max_model_len -1): the KV budget ({budget.budget_bytes:,} B, set by "
                             f"{RULE_FIELDS.get(rule, rule)}) holds one sequence of {low} tokens, not the "
                             f"{'model default' if 'max_seq_len' in ctx.model_defaults else 'checkpoint'}'s {limit}"))
    return attrs.evolve(budget, max_seq_len=low)


def arena_setting(ctx: Context, layout: KvLayout, emit: Emit) -> tuple[bool, str | None]:
    """Whether the pools are a slab arena (``pool_arena`` resolved true, on a layout of unequal pages), and why
    ``load`` cannot build it (None when it can); ``setting_ignored`` for a value the user set that has nothing to
    act on."""
    kv = ctx.args.kv_cache_config
    unfit = arena_unfit_reason(layout)
    if unfit is not None:
        user = ctx.user_fields.get(ARENA_FIELD)
        if user is not None and user.value in (True, False):  # an explicit "auto" asked for nothing: as unset
            emit(SettingIgnored(field=ARENA_FIELD, value=kv.pool_arena,
                                reason=f"{unfit}; pool_arena chooses between one slab arena and split pools for V2 "
                                       "layer groups of unequal pages (DeepSeek V4)"))
        return False, None
    if kv.pool_arena is not True:
        return False, None
    if kv.host_cache_size:
        return True, (f"{ARENA_FIELD}=true runs without a host tier, and {HOST_FIELD}={kv.host_cache_size} asks "
                      f"for one; set {HOST_FIELD} to 0 or {ARENA_FIELD} to false")
    return True, None


def warn_inert_v2_settings(ctx: Context, layout: KvLayout, host_bytes: int | None, emit: Emit) -> None:
    """``setting_ignored`` for V2 settings the user set that this geometry or host tier leaves with nothing to do."""
    kv = ctx.args.kv_cache_config
    resume = "kv_cache_config.max_util_for_resume"
    if resume in ctx.user_fields and host_bytes == 0:
        emit(SettingIgnored(field=resume, value=kv.max_util_for_resume,
                            reason="there is no host tier (host_cache_size 0, or auto where recomputing costs less), "
                                   "so nothing is suspended or resumed"))
    scratch = "kv_cache_config.enable_swa_scratch_reuse"
    if scratch in ctx.user_fields and kv.enable_swa_scratch_reuse is True:
        if all(g.window is None for g in layout.groups):
            emit(SettingIgnored(field=scratch, value=True,
                                reason="the model has no sliding-window layers, so there is no window scratch to "
                                       "reuse"))
        elif kv.enable_block_reuse is not True:
            emit(SettingIgnored(field=scratch, value=True,
                                reason="blocks leaving a window are kept for prefix reuse, and prefix reuse is off "
                                       "(enable_block_reuse=false)"))


#: The opt-in bound on a shared arena's padded pages (``cache_backends.layout.share_pages``).
PADDING_FIELD = "kv_cache_config.max_page_padding"


def warn_inert_page_padding(ctx: Context, layout: KvLayout, emit: Emit) -> None:
    """``setting_ignored`` when the user's ``max_page_padding`` above 0 padded no page of this V2 layout (split pools,
    a slab arena, one group, or no larger page within the bound): never a silent no-op."""
    if PADDING_FIELD in ctx.user_fields and layout.padding_unused is not None:
        emit(SettingIgnored(field=PADDING_FIELD, value=ctx.args.kv_cache_config.max_page_padding,
                            reason=layout.padding_unused))


def warn_inert_partial_reuse(ctx: Context, layout: KvLayout, emit: Emit) -> None:
    """``setting_ignored`` when the user asked for partial reuse and the V2 geometry makes it gain nothing."""
    kv = ctx.args.kv_cache_config
    field = "kv_cache_config.enable_partial_reuse"
    if field not in ctx.user_fields or kv.enable_partial_reuse is not True or kv.enable_block_reuse is not True:
        return  # not asked for by the user, or route_executor already said why it is off
    reason = partial_reuse_off_reason(layout)
    if reason is not None:
        emit(SettingIgnored(field=field, value=True, reason=f"partial-block reuse is off: {reason}"))


def host_tier_reason(sized_by: str, host_size: int | None, host_choice: str | None, slots: dict[str, int],
                     nbytes: int, device_blocks: dict[str, int]) -> str:
    """One line saying what sized the V2 host tier (``kv_host_tier_sized``'s reason)."""
    if host_choice is not None:  # the slab arena, or the accelerator's costs
        return host_choice
    if sized_by == "auto":
        scaled = any(slots.get(name, 0) < n for name, n in device_blocks.items())
        fit = (f"scaled down to {AUTO_HOST_FRACTION:.0%} of the host memory available" if scaled
               else "one host slot per device block")
        return (f"{HOST_FIELD} null (auto): {nbytes:,} B of host memory, {fit} ({_per_group(slots)}); set "
                f"{HOST_FIELD} to a size in bytes, or 0 for no host tier")
    if not slots:
        return f"{HOST_FIELD}=0: no host tier; requests moved out are preempted for recompute"
    return f"{HOST_FIELD}={host_size:,} B: {nbytes:,} B of host memory in whole blocks ({_per_group(slots)})"


def _per_group(slots: dict[str, int]) -> str:
    return ", ".join(f"{name}: {n:,} slot(s)" for name, n in slots.items())


def plan_host_tier(layout: KvLayout, pools: PoolPlan, host_cache_size: int | None,
                   device: str, unbacked: bool = False) -> tuple[dict[str, int] | None, int | None, str | None]:
    """The V2 host tier ``load`` would allocate: (slots per group, bytes, problem naming the setting, or None).

    Sized by the same function as the manager's, against the host memory available now
    (``MemAvailable``), less the pools when they live on the host (``unbacked`` pools live nowhere). An ``unbacked``
    tier (a simulation's) takes no memory either: a size past this host's memory (a GPU server's tier) is simulated
    as given, its slots' bookkeeping bounded by ``check_bookkeeping``.
    """
    available = host_available_bytes()
    on_host = not is_cuda(device) and not unbacked
    if available is not None and on_host:
        available -= pools.total_bytes
    beside = " beside the KV pools" if on_host else ""
    accepted = "0 (no host tier), null (auto-size)"
    try:
        slots = host_tier_slots(layout, pools.num_blocks, host_cache_size, available)
    except ValueError:
        minimum = layout.min_bytes()
        return None, None, (f"{HOST_FIELD}={host_cache_size} B cannot hold one block of every layer group "
                            f"(at least {minimum} B); accepted: {accepted} or a size of at least {minimum} B")
    nbytes = host_tier_bytes(layout, slots)
    if host_cache_size and available is not None and nbytes > available and not unbacked:
        return slots, nbytes, (f"{HOST_FIELD}={host_cache_size} B: a host tier of {nbytes} B exceeds the "
                               f"{max(available, 0)} B of host memory available{beside}; accepted: {accepted} "
                               f"or at most {max(available, 0)} B")
    return slots, nbytes, None


def budget_reason(budget: KvBudget) -> str:
    """One line saying which rule set the budget and from what."""
    if budget.budget_bytes is None:
        return f"unbounded: {budget.unbounded_reason}"
    if budget.limited_by == "free_gpu_memory_fraction":
        return (f"free device memory {budget.free_bytes} B × free_gpu_memory_fraction "
                f"{budget.free_gpu_memory_fraction}")
    if budget.limited_by == "max_tokens":
        return f"max_tokens {budget.max_tokens} need {budget.tokens_cap_bytes} B"
    return f"max_gpu_total_bytes caps it at {budget.max_gpu_total_bytes} B"


def too_small_message(layout: KvLayout, budget: KvBudget) -> str:
    """The error for a budget below one block per group: the rule, the numbers, what to change (and, where padded
    pages raised the floor, the floor at ``max_page_padding`` 0)."""
    field = RULE_FIELDS.get(budget.limited_by or "", "the budget")
    per_group = ", ".join(f"{g.name} {g.bytes_per_block}" for g in layout.groups)
    floor = layout.min_bytes()
    needed = f"at least {floor} B needed (bytes per block: {per_group})"
    advice = f"raise {field} or lower kv_cache_config.tokens_per_block"
    # padded pages the user opted into raise the floor: a budget between the two fits gcd pages (max_page_padding 0)
    plain = layout.unpadded()
    unpadded = plain.min_bytes() if plain is not None else None
    if unpadded is not None and unpadded < floor:
        needed += f", {unpadded} B with {PADDING_FIELD} 0"
        if budget.budget_bytes is not None and budget.budget_bytes >= unpadded:
            advice = f"raise {field}, set {PADDING_FIELD} to 0 or lower kv_cache_config.tokens_per_block"
    return (f"KV budget {budget.budget_bytes} B ({budget_reason(budget)}) cannot hold one block per layer group: "
            f"{needed}; {advice}")


#: The field that turns KV cache events on, and who reads them (what a setting_ignored about it advises).
EVENTS_FIELD = "kv_cache_config.event_buffer_max_size"
EVENTS_READERS = ("kvload serve --kv-events-file (or its /v1/kvload/kv_events endpoint) or the Python API "
                  "(kvload.load(...).kv_cache_events()) reads them")


class PlanKv:
    """Writes ``ctx.kv`` (a :class:`KvPlan`) and emits ``kv_budget_computed``; allocates nothing."""

    name = "plan_kv"
    error = KvBuildError

    def run(self, ctx: Context, emit: Emit) -> None:
        """Compute the KV plan of the routed manager."""
        ctx.kv = compute_kv_plan(ctx, emit)
        events = ctx.args.kv_cache_config.event_buffer_max_size
        if EVENTS_FIELD in ctx.user_fields and events > 0:  # a plan builds no manager: nothing records events
            emit(SettingIgnored(field=EVENTS_FIELD, value=events,
                                reason=f"a plan (kvload plan, simulate) builds no KV cache manager, so no KV cache "
                                       f"event is recorded; {EVENTS_READERS}"))



#: The flag that sets each budget rule's field, for advice a CLI user can act on.
_RULE_FLAGS = {"max_tokens": "--max_tokens", "max_gpu_total_bytes": "--max_gpu_total_bytes",
               "free_gpu_memory_fraction": "--kv_cache_free_gpu_memory_fraction"}


def blocks_oversized(plan: KvPlan, cap_field: str) -> KvBlocksOversized | None:
    """``kv_blocks_oversized`` when whole blocks make the pools far bigger than asked, else None; ``cap_field``
    names the token cap that set the budget (``max_tokens``, or the ``default_max_tokens`` a caller derived).

    The pools are whole blocks, so ``max_tokens`` rounds up to a multiple of ``tokens_per_block`` per group; that
    is at most one block more than asked, and more than twice the cap only when a block outgrows twice the cap.
    """
    T, budget = plan.tokens_per_block, plan.budget
    capped = budget.max_tokens if budget.limited_by == "max_tokens" else None
    reasons = []
    if plan.max_seq_len < T:
        reasons.append(f"kv_cache_config.tokens_per_block ({T}) is above max_seq_len ({plan.max_seq_len}): every "
                       f"sequence takes at least one whole block of {T} tokens")
    if capped is not None and 2 * capped < T:
        reasons.append(f"{cap_field} ({capped}) rounds up to whole blocks of {T} tokens "
                       f"(kv_cache_config.tokens_per_block): the pools hold {T} tokens a layer group, "
                       f"{T / capped:.0f}x the cap")
    if not reasons:
        return None
    reason = "; ".join(reasons)
    advice = ("lower kv_cache_config.tokens_per_block (--tokens_per_block; serving engines use 16 to 128) to at most "
              f"{min(plan.max_seq_len, capped or plan.max_seq_len)}")
    return KvBlocksOversized(tokens_per_block=T, max_seq_len=plan.max_seq_len, max_tokens=capped, reason=reason,
                             advice=advice)


def least_max_tokens(layout: KvLayout, seq_len: int) -> int:
    """The least ``max_tokens``, in whole blocks of ``tokens_per_block``, whose pools
    (:meth:`KvLayout.blocks_for_tokens`) hold one sequence of ``seq_len`` tokens; ``seq_len`` if none up to it does."""
    T = layout.tokens_per_block
    most = -(-seq_len // T)

    def holds(n: int) -> bool:
        return layout.max_sequences(layout.blocks_for_tokens(n * T, seq_len), seq_len) >= 1

    if not holds(most):
        return seq_len
    return (longest(lambda n: not holds(n), most - 1) + 1) * T


def _token_cap_advice(plan: KvPlan, raise_to: str, plain: KvLayout | None) -> str:
    """``raise_to`` the least ``max_tokens`` that holds one ``max_seq_len`` sequence; with padded pages, that cap at
    ``max_page_padding`` 0 too, and padding 0 offered where the cap set already holds a sequence there.

    Not ``max_seq_len``: a shared arena's window groups take a window of each sequence, not a block per token, so it
    overstated the cap 5.8x (Gemma 3 27B at 131,072 tokens: 22,752 hold one). A token cap binds at padding 0 too:
    gcd pages hold the same tokens in fewer bytes than padded ones, below every byte rule the padded pages were."""
    if plan.arena:  # slabs of each group's own: priced by bytes, not by blocks_for_tokens
        return f"{raise_to} {plan.max_seq_len}"
    least = least_max_tokens(plan.layout, plan.max_seq_len)
    text = f"{raise_to} {least}"
    plain_least = least_max_tokens(plain, plan.max_seq_len) if plain is not None else None
    if plain_least is not None and plain_least < least:
        text += f" ({plain_least} with {PADDING_FIELD} 0)"
        if plan.budget.max_tokens and plain_least <= plan.budget.max_tokens:
            text += f", set {PADDING_FIELD} to 0 (--max_page_padding 0)"
    return text


def budget_short(plan: KvPlan) -> KvBudgetShort | None:
    """``kv_budget_short`` when the planned pools hold less than one sequence of ``max_seq_len``, else None."""
    pools = plan.pools
    if pools is None or pools.max_concurrency > 0:
        return None
    need = plan.layout.bytes_for_sequence(plan.max_seq_len)
    if plan.arena:  # each group's blocks in whole slabs of its own
        need = slabs_for_sequence(plan.layout, plan.max_seq_len) * slab_bytes(plan.layout)
    rule = plan.budget.limited_by or ""
    field = RULE_FIELDS.get(rule, rule or "the KV budget")
    flag = _RULE_FLAGS.get(rule)
    # the figure is in the padded pages the user opted into: say what a sequence needs in gcd pages (max_page_padding
    # 0) too, and offer them where the budget holds it
    plain = None if plan.arena else plan.layout.unpadded()
    if rule == "max_tokens":
        raise_to = _token_cap_advice(plan, f"raise {field} ({flag}) to at least", plain)
        plain = None
    unpadded = plain.bytes_for_sequence(plan.max_seq_len) if plain is not None else None
    if unpadded is not None and unpadded >= need:
        plain = unpadded = None
    padding = f" ({unpadded} B with {PADDING_FIELD} 0)" if unpadded is not None else ""
    if rule == "max_gpu_total_bytes":
        raise_to = f"raise {field} ({flag}) to at least {need} B{padding}"
    elif rule != "max_tokens":
        raise_to = f"raise {field}" + (f" ({flag})" if flag else "") + f" so the pools get at least {need} B{padding}"
    if plain is not None and unpadded is not None:
        room = plan.budget.budget_bytes or 0  # a byte rule's cap: the same at any padding
        if plan.budget.max_tokens:  # a token cap is priced in gcd pages there, and may bind instead
            room = min(room, plain.bytes_for_tokens(plan.budget.max_tokens, plan.max_seq_len))
        if room >= unpadded:
            raise_to += f", set {PADDING_FIELD} to 0 (--max_page_padding 0)"
    advice = (f"{raise_to}, or lower max_seq_len (--max_seq_len) to the longest request you serve; "
              f"requests longer than {pools.capacity_tokens} tokens will never be admitted")
    return KvBudgetShort(capacity_tokens=pools.capacity_tokens, max_seq_len=plan.max_seq_len, sequence_bytes=need,
                         budget_bytes=pools.total_bytes, limited_by=RULE_FIELDS.get(rule), advice=advice)
