"""Prefix-reuse granularity of a V2 layout: the reuse unit, and whether partial-block reuse can ever gain a token.

Pure geometry and torch-free, so the plan stage asks exactly the question the manager asks, from the
layout alone, before anything is allocated.
"""

from __future__ import annotations

import math

from cache_backends.layout import KvLayout


def reuse_unit(layout: KvLayout) -> int | None:
    """Tokens a reused prefix is a multiple of: the lcm of every group's block span; None when some span is
    not a multiple of ``tokens_per_block`` (its blocks cannot be keyed by token blocks, so reuse is off)."""
    spans = [g.tokens_per_block for g in layout.groups]
    if any(s % layout.tokens_per_block for s in spans):
        return None
    return math.lcm(*spans)


def partial_reuse_unit(layout: KvLayout) -> int:
    """Tokens a partially matched block is rounded down to: the lcm of the compress rates (1 without any)."""
    rates = [g.compress_rate for g in layout.groups if g.compress_rate]
    return math.lcm(*rates) if rates else 1


def partial_reuse_off_reason(layout: KvLayout) -> str | None:
    """Why partial-block reuse can never gain a token with this geometry (whatever the settings), or None.

    Partial reuse copies one ``tokens_per_block`` block whose first ``k`` tokens match, with ``k`` below
    ``tokens_per_block`` and rounded down to :func:`partial_reuse_unit`; every group must span exactly
    one such block. DeepSeek V4 (``tokens_per_block=128``, a compress rate of 128) is the usual case
    where ``k`` always rounds to 0.
    """
    T = layout.tokens_per_block
    spans = sorted({g.tokens_per_block for g in layout.groups})
    if reuse_unit(layout) != T:
        return (f"layer group blocks span {spans} tokens; partial reuse needs every group to span exactly "
                f"tokens_per_block={T}")
    unit = partial_reuse_unit(layout)
    if unit >= T:
        return (f"compressed groups match in steps of {unit} tokens (the lcm of their compress rates), not below "
                f"tokens_per_block={T}, so a partial block could never gain a token")
    return None
