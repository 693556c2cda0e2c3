"""Stage ``agree_ranks`` (after ``route_executor``): every rank must have resolved the same arguments and route.

If one rank saw another device, checkpoint or setting and resolved differently, the ranks would build
different KV managers and a collective would hang or mix garbage later. Each rank all-gathers its
digest (the resolved fields, the route, the checkpoint's config); any difference fails the run on
every rank, naming the fields and each rank's value. Byte caps are not compared: the KV budget is
min-reduced across ranks instead (``plan_kv`` / ``build_kv_manager``). Alone, there is nothing to compare.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pipeline.bus import Emit
from pipeline.context import Context
from pipeline.converter import unstructure
from pipeline.errors import RankError
from pipeline.events import RanksAgreed, RanksDisagreed
from pipeline.paths import flatten

#: Not compared: each rank's memory may differ; the budgets they give are min-reduced across ranks.
BYTE_CAPS: tuple[str, ...] = (
    "kv_cache_config.free_gpu_memory_fraction",
    "kv_cache_config.max_gpu_total_bytes",
    "kv_cache_config.host_cache_size",
)


def rank_digest(ctx: Context) -> dict[str, Any]:
    """The fields every rank must agree on: resolved args (byte caps aside), the route, the checkpoint config."""
    fields = {k: v for k, v in flatten(unstructure(ctx.args)).items() if k not in BYTE_CAPS}
    fields.update({f"route.{k}": v for k, v in ctx.route.to_dict().items()})
    config = getattr(ctx.hf_config, "to_dict", None)
    text = json.dumps(config() if config is not None else {}, sort_keys=True, default=str)
    fields["checkpoint.config_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    fields["checkpoint.architecture"] = ctx.model.architecture if ctx.model is not None else None
    return fields


def differences(digests: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Each field whose value is not the same on every rank → the values in rank order."""
    keys = dict.fromkeys(k for d in digests for k in d)
    missing = object()
    out = {}
    for key in keys:
        values = [d.get(key, missing) for d in digests]
        if any(v != values[0] for v in values[1:]):
            out[key] = [None if v is missing else v for v in values]
    return out


def _show(values: list[Any]) -> str:
    return ", ".join(f"rank {r}: {json.dumps(v, default=str)}" for r, v in enumerate(values))


class AgreeRanks:
    """Emits ``ranks_agreed`` or ``ranks_disagreed`` (then raises ``RankError`` on every rank)."""

    name = "agree_ranks"
    error = RankError

    def run(self, ctx: Context, emit: Emit) -> None:
        """All-gather the digests; every rank sees the same list, so every rank reaches the same verdict."""
        ranks = ctx.ranks
        if ranks is None or not ranks.distributed:
            return
        mine = rank_digest(ctx)
        digests = ranks.all_gather(mine)
        diff = differences(digests)
        if diff:
            emit(RanksDisagreed(rank=ranks.rank, world_size=ranks.world_size, differences=diff))
            first, values = next(iter(diff.items()))
            more = f" (and {len(diff) - 1} more field(s): {', '.join(list(diff)[1:4])})" if len(diff) > 1 else ""
            raise RankError(f"the {ranks.world_size} ranks resolved different values: {first} ({_show(values)})"
                            f"{more}; every rank must get the same arguments, checkpoint and device kind")
        text = json.dumps(mine, sort_keys=True, default=str)
        emit(RanksAgreed(rank=ranks.rank, world_size=ranks.world_size,
                         digest=hashlib.sha256(text.encode()).hexdigest(), fields=len(mine), excluded=list(BYTE_CAPS)))
