"""V1 against V2 at one KV budget (``kvload plan --compare``), and the rule that picks that budget.

One budget for both managers, so the comparison is about geometry alone:

* The routed manager's budget rules decide it (``kv_cache_config.max_tokens`` in the routed layout,
  ``max_gpu_total_bytes``, and on CUDA the free memory × ``free_gpu_memory_fraction``).
* When those leave it unbounded (CPU without ``--max_tokens`` / ``--max_gpu_total_bytes``), a
  default is priced in the routed layout instead: the exact bytes of ``N`` sequences of ``L`` tokens
  (block rounding and windows included; ``plan --compare``: :data:`DEFAULT_PLAN_SEQUENCES` sequences
  of ``max_seq_len``; ``simulate``: the workload's default).
* Each manager is then planned (or built) with ``max_gpu_total_bytes`` = that budget and no
  ``max_tokens``, through the same stages as ``plan``/``load``: a manager the model cannot be routed
  to (DeepSeek V4 on V1, beam search on V2) is reported with the router's reason.

Capacity at a sequence length ``L`` splits the budget for sequences of ``L`` tokens, as the pools
would be split with ``max_seq_len = L`` (:meth:`KvLayout.split_budget`), and counts how many fit. A V2
layout whose groups share one arena is not split: the sequences of ``L`` that fit jointly are the arena's
pages over the pages one sequence takes in all groups, and "tokens that fit" is the tokens of those
``max_seq_len`` sequences plus the longest shorter one the pages left over hold
(:meth:`KvLayout.capacity_tokens`), as V1 counts the tokens it serves at once.
"""

from __future__ import annotations

import copy
from typing import Any

import attrs

from cache_backends.budget import BudgetError, arena_sequences, plan_pools
from cache_backends.kinds import KINDS, V1, V2
from pipeline.config import V2_FIELD
from pipeline.context import LoadRequest
from pipeline.errors import ConfigError, KvBuildError, RouteError
from pipeline.limits import MAX_INT
from pipeline.paths import flatten, unflatten
from pipeline.run import RunResult, execute
from pipeline.sources import overrides_to_tree
from pipeline.text import table
from stages import plan_stages
from stages.plan_kv import KvPlan, budget_reason

#: ``plan --compare`` without a bounded budget prices this many sequences of max_seq_len in the routed layout.
DEFAULT_PLAN_SEQUENCES = 16
#: Sequence lengths of the capacity table (those below max_seq_len, then max_seq_len itself).
LENGTHS = (1024, 4096, 16384, 65536)
#: The managers compared, by class name, and the tri-state value that routes to each.
#: manager class name -> the use_kv_cache_manager_v2 value that routes to it, V1 first
MANAGERS = {kind.manager: kind.use_v2 for kind in KINDS}
USER_BUDGET_FIELDS = ("kv_cache_config.max_tokens", "kv_cache_config.max_gpu_total_bytes")


@attrs.frozen
class Budget:
    """The one KV budget both managers get, and where it came from."""

    bytes: int
    source: str  # one line: the rule and the numbers
    default: bool  # True when no user setting bounded it and a documented default was used

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return attrs.asdict(self)


def user_gave_budget(result: RunResult) -> bool:
    """Whether the user set ``max_tokens`` or a nonzero ``max_gpu_total_bytes`` (any source)."""
    fields = result.context.user_fields
    return any(fields[p].value for p in USER_BUDGET_FIELDS if p in fields)


def variant_request(request: LoadRequest, **kv_fields: Any) -> LoadRequest:
    """A copy of ``request`` whose overrides also set these ``kv_cache_config`` fields (they win over the file)."""
    leaves = flatten(overrides_to_tree(request.overrides))
    for name, value in kv_fields.items():
        leaves[f"kv_cache_config.{name}"] = value
    out = copy.copy(request)
    out.overrides = unflatten(leaves)
    return out


def routed_budget(result: RunResult, default_sequences: int, default_len: int, *,
                  prefer_default: bool = False) -> Budget:
    """The budget of the routed plan in ``result``; when unbounded, ``default_sequences`` × ``default_len`` tokens.

    The default is the exact bytes those sequences hold in the routed layout. ``prefer_default``
    also uses it when the budget is bounded only by the device's free memory (the user set no
    budget field). ``KvBuildError`` when the routed plan cannot be built at the budget.
    """
    kv: KvPlan = result.kv
    if kv.budget_bytes is not None and not (prefer_default and not user_gave_budget(result)):
        if kv.pools is None:
            raise KvBuildError(kv.problem)
        return Budget(kv.budget_bytes, f"{budget_reason(kv.budget)}; routed {kv.kv_manager}", False)
    nbytes = default_sequences * kv.layout.bytes_for_sequence(default_len)
    return Budget(nbytes, f"default: {default_sequences:,} sequence(s) of {default_len:,} tokens in the "
                          f"routed {kv.kv_manager} layout", True)


def manager_lengths(max_seq_len: int) -> tuple[int, ...]:
    """The table's sequence lengths: :data:`LENGTHS` below ``max_seq_len``, then ``max_seq_len``."""
    return (*(n for n in LENGTHS if n < max_seq_len), max_seq_len)


@attrs.frozen
class ManagerCapacity:
    """One manager at the shared budget: its plan, or why it has none."""

    kv_manager: str
    status: str  # "ok" | "not_routable" | "not_buildable"
    reason: str | None
    plan: KvPlan | None = None

    @property
    def ok(self) -> bool:
        """Whether the manager has a plan at this budget."""
        return self.plan is not None

    def max_concurrency(self, seq_len: int) -> int | None:
        """Sequences of ``seq_len`` tokens the budget holds when split for that length (a slab arena: its slabs
        packed with them, no group's share fixed)."""
        if self.plan is None:
            return None
        if self.plan.arena_slabs is not None:
            return arena_sequences(self.plan.layout, self.plan.arena_slabs, seq_len)
        try:
            return plan_pools(self.plan.layout, self.plan.budget_bytes, seq_len).max_concurrency
        except BudgetError:
            return 0

    def bytes_per_sequence(self, seq_len: int) -> int | None:
        """Exact bytes one sequence of ``seq_len`` tokens holds (block rounding, windows)."""
        return None if self.plan is None else self.plan.layout.bytes_for_sequence(seq_len)

    def padding_note(self) -> str | None:
        """What ``max_page_padding`` did to this manager's pages: padded (the page and the share unused), or why it
        padded none; None when it is 0 or the manager has no plan. Why here: ``--compare``'s log holds the routed
        plan's events only (on a CPU, V1's ``setting_ignored``), so the V2 column needs its own word on it."""
        return None if self.plan is None else self.plan.layout.padding_note(self.plan.max_seq_len)

    def to_dict(self, lengths: tuple[int, ...]) -> dict[str, Any]:
        """JSON form, with one row per sequence length."""
        p = self.plan
        return {
            "status": self.status,
            "reason": self.reason,
            "padding": self.padding_note(),
            "bytes_per_token": p.bytes_per_token if p else None,
            "capacity_tokens": p.capacity_tokens if p else None,
            "pool_bytes": p.pools.total_bytes if p and p.pools else None,
            "layer_groups": {g["name"]: g["blocks"] for g in p.to_dict()["layer_groups"]} if p else None,
            "lengths": [{"seq_len": n, "max_concurrency": self.max_concurrency(n),
                         "bytes_per_sequence": self.bytes_per_sequence(n)} for n in lengths],
        }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


@attrs.frozen
class CapacityComparison:
    """V1 and V2 plans at one budget: bytes per token, tokens that fit, concurrency per sequence length."""

    model: str
    max_seq_len: int
    budget: Budget
    lengths: tuple[int, ...]
    managers: dict[str, ManagerCapacity]

    @property
    def v1(self) -> ManagerCapacity:
        """The V1 column."""
        return self.managers[V1.manager]

    @property
    def v2(self) -> ManagerCapacity:
        """The V2 column."""
        return self.managers[V2.manager]

    def ratios(self) -> dict[str, Any]:
        """V2 / V1 for tokens that fit and for concurrency at each length (None when either is missing)."""
        v1, v2 = self.v1, self.v2
        return {
            "capacity_tokens": _ratio(v2.plan.capacity_tokens if v2.ok else None,
                                      v1.plan.capacity_tokens if v1.ok else None),
            "max_concurrency": [{"seq_len": n, "ratio": _ratio(v2.max_concurrency(n), v1.max_concurrency(n))}
                                for n in self.lengths],
        }

    def to_dict(self) -> dict[str, Any]:
        """The ``compare`` object of ``plan --compare --json``."""
        return {
            "budget_bytes": self.budget.bytes,
            "budget": self.budget.to_dict(),
            "max_seq_len": self.max_seq_len,
            "lengths": list(self.lengths),
            "managers": {name: m.to_dict(self.lengths) for name, m in self.managers.items()},
            "v2_over_v1": self.ratios(),
        }

    def render(self) -> list[str]:
        """The capacity table: one column per manager plus V2/V1."""
        names = list(self.managers)
        lines = [f"capacity at one budget: {self.budget.bytes:,} B ({self.budget.source})"]
        rows = [["", *names, "V2/V1"]]

        def row(label: str, values: list[float | int | None], fmt: str = "{:,}") -> None:
            cells = ["-" if v is None else fmt.format(v) for v in values]
            ratio = _ratio(values[1], values[0]) if len(values) == 2 else None
            rows.append([label, *cells, "-" if ratio is None else f"{ratio:.2f}x"])

        ms = [self.managers[n] for n in names]
        row("bytes/token", [m.plan.bytes_per_token if m.ok else None for m in ms], "{:,.6g}")
        row("tokens that fit", [m.plan.capacity_tokens if m.ok else None for m in ms])
        for n in self.lengths:
            row(f"sequences of {n:,}", [m.max_concurrency(n) for m in ms])
        lines += table(rows)
        for m in ms:
            if not m.ok:
                lines.append(f"  {m.kv_manager}: {m.status.replace('_', ' ')}: {m.reason}")
            elif note := m.padding_note():
                lines.append(f"  {m.kv_manager}: {note}")
        lines.append("  (sequences of L: the budget split for sequences of L tokens, as with max_seq_len = L"
                     + ("; a slab arena: its slabs filled with them" if any(m.ok and m.plan.arena for m in ms) else "")
                     + ")")
        return lines


def refusal_reason(routed: RunResult, name: str, exc: RouteError) -> str:
    """Why the router refuses manager ``name`` for this model, without advice about a setting nobody typed."""
    if name == V1.manager and routed.model.v2_required:
        return f"V1 cannot serve this model: {routed.model.v2_required}"
    if name == V2.manager and routed.args.max_beam_width > 1:
        return f"V2 has no beam support and max_beam_width={routed.args.max_beam_width}"
    return str(exc)


def plan_manager(routed: RunResult, name: str, budget_bytes: int, *, log: bool = False) -> ManagerCapacity:
    """Plan one manager at ``budget_bytes`` through the stages; the router's refusal becomes ``not_routable``."""
    variant = variant_request(routed.context.request, use_kv_cache_manager_v2=MANAGERS[name],
                              max_gpu_total_bytes=budget_bytes, max_tokens=None)
    try:
        result = execute(variant, plan_stages(), log=log)
    except RouteError as exc:
        return ManagerCapacity(name, "not_routable", refusal_reason(routed, name, exc))
    kv: KvPlan = result.kv
    if kv.pools is None:
        return ManagerCapacity(name, "not_buildable", kv.problem)
    return ManagerCapacity(name, "ok", None, kv)


def compare_capacity(result: RunResult, *, log: bool = False) -> CapacityComparison:
    """Plan V1 and V2 at the routed plan's budget (see the module docstring); allocates nothing."""
    request = result.context.request
    if V2_FIELD in flatten(overrides_to_tree(request.overrides)):
        raise ConfigError("--compare plans both managers; drop --use_kv_cache_manager_v2",
                          path=V2_FIELD)
    max_seq_len = result.args.max_seq_len
    budget = routed_budget(result, DEFAULT_PLAN_SEQUENCES, max_seq_len)
    if budget.bytes > MAX_INT:  # each manager gets it as max_gpu_total_bytes, whose bound named a flag nobody gave
        limited_by = result.kv.budget.limited_by if result.kv.budget is not None else None
        field = "max_seq_len" if budget.default or limited_by is None else f"kv_cache_config.{limited_by}"
        raise ConfigError(f"--compare plans both managers at one budget in bytes, here {budget.bytes:,} B "
                          f"({budget.source}), past the 2**63 - 1 a byte count may be; lower {field}", path=field)
    managers = {name: plan_manager(result, name, budget.bytes, log=log) for name in MANAGERS}
    return CapacityComparison(result.model.name, max_seq_len, budget, manager_lengths(max_seq_len), managers)


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend; ``ConfigError`` naming ``--chart`` when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--chart needs matplotlib: pip install 'kvload[chart]' (or matplotlib>=3.8)",
                          path="chart") from None
    return plt


def check_chart_path(path: str, *, replace: bool) -> None:
    """``ConfigError`` naming ``--chart`` before any planning: no matplotlib, an extension it cannot write,
    or an output path ``check_output_path`` refuses (an existing file unless ``replace``, as ``--audit-log``)."""
    from pathlib import Path

    from pipeline.audit import check_output_path

    if path == "":  # its extension check would quote nothing: "--chart : cannot draw to a file name ..."
        raise ConfigError("--chart: empty path, expected an image file path (e.g. chart.png)", path="chart")
    _pyplot()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    accepted = sorted(FigureCanvasAgg.get_supported_filetypes())
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in accepted:
        what = f"extension .{suffix}" if suffix else "a file name without an extension"
        raise ConfigError(f"--chart {path}: cannot draw to {what}; accepted extensions: .{', .'.join(accepted)}",
                          path="chart")
    check_output_path(path, "--chart", replace=replace)


def draw_chart(comparison: CapacityComparison, path: str, *, replace: bool = True) -> None:
    """Write a PNG: concurrent sequences per length and bytes per sequence, V1 beside V2 (needs matplotlib).

    The image is drawn into a temporary beside ``path`` and renamed onto it, so a failed write (a full
    disk: ``OutputError``, exit 1) leaves ``path`` as it was and no partial file. ``replace=False`` refuses
    a file that appeared since :func:`check_chart_path`."""
    from pathlib import Path

    from pipeline.audit import atomic_output

    plt = _pyplot()
    lengths = comparison.lengths
    xs = range(len(lengths))
    width = 0.38
    colors = {V1.manager: "#4C72B0", V2.manager: "#DD8452"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
    v1 = comparison.v1
    for i, (name, m) in enumerate(comparison.managers.items()):
        offset = (i - 0.5) * width
        label = name if m.ok else f"{name} ({m.status.replace('_', ' ')})"
        conc = [m.max_concurrency(n) or 0 for n in lengths]
        bars = ax1.bar([x + offset for x in xs], conc, width, label=label, color=colors.get(name))
        texts = []
        for n, c in zip(lengths, conc, strict=True):
            ratio = _ratio(c, v1.max_concurrency(n)) if name != V1.manager else None
            texts.append("" if not m.ok else f"{c:,} ({ratio:.2f}x)" if ratio else f"{c:,}")
        ax1.bar_label(bars, labels=texts, fontsize=8, padding=2)
        per_seq = [(m.bytes_per_sequence(n) or 0) / 2**20 for n in lengths]
        bars = ax2.bar([x + offset for x in xs], per_seq, width, label=label, color=colors.get(name))
        ax2.bar_label(bars, labels=[f"{b:,.1f}" if m.ok else "" for b in per_seq], fontsize=8, padding=2)
    ticks = [f"{n:,}" for n in lengths]
    ax1.set(title="sequences that fit the budget", xlabel="sequence length (tokens)", ylabel="sequences")
    ax2.set(title="KV bytes per sequence", xlabel="sequence length (tokens)", ylabel="MiB")
    for ax in (ax1, ax2):
        ax.set_xticks(list(xs), ticks)
        ax.legend(fontsize=8)
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{comparison.model}: V1 vs V2 at a budget of {comparison.budget.bytes / 2**20:,.1f} MiB")
    fig.tight_layout()
    try:
        with atomic_output(path, "--chart", replace=replace) as tmp:
            # the temporary's name ends in .tmp: the format comes from the chosen path's extension
            fig.savefig(tmp, dpi=110, format=Path(path).suffix.lower().lstrip(".") or None)
    finally:
        plt.close(fig)
