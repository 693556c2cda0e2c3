"""What the CLI prints: the JSON document of a run and its readable table."""

from __future__ import annotations

from typing import Any

from kvload.api import LoadResult
from pipeline.config import framework_defaults
from pipeline.converter import unstructure
from pipeline.paths import flatten
from pipeline.text import one_line, show, table


def provenance_map(result: LoadResult) -> dict[str, list[dict[str, Any]]]:
    """Every changed field → its chain of changes."""
    return {path: result.audit.provenance(path) for path in result.audit.changed_fields()}


def run_document(result: LoadResult) -> dict[str, Any]:
    """The ``--json`` document: model, args, provenance, route, kv."""
    kv = result.kv
    return {
        "model": result.model.to_dict(),
        "args": unstructure(result.args),
        "provenance": provenance_map(result),
        "route": result.route.to_dict(),
        "sampling_defaults": result.sampling_defaults.to_dict(),
        "kv": kv.to_dict() if hasattr(kv, "to_dict") else kv,
    }


def render_sampling_defaults(defaults: Any) -> list[str]:
    """The sampling defaults block of ``plan``/``run``: what a request leaving a setting unset takes, from where,
    and what the file gave that does not apply; nothing when there is nothing to say (kvload's built-ins)."""
    if not defaults.values and not defaults.not_applied:
        return []
    pad = " " * len("sampling defaults  ")
    lines = [f"sampling defaults  {defaults.describe() or '(kvload built-in)'}", f"{pad}{defaults.reason}"]
    why_keys: dict[str, list[str]] = {}
    for key, why in defaults.not_applied.items():
        why_keys.setdefault(why, []).append(key)
    lines += [f"{pad}not applied: {', '.join(keys)}: {why}" for why, keys in why_keys.items()]
    return lines


def render_args(result: LoadResult) -> list[str]:
    """Rows for every resolved field that is not a plain framework default: value, source, why."""
    final = flatten(unstructure(result.args))
    defaults = flatten(framework_defaults())
    rows = [["field", "value", "source", "why"]]
    for path in result.audit.changed_fields():
        chain = result.audit.provenance(path)
        if not chain or path not in final:
            continue
        last = chain[-1]
        why = last.get("reason", "")
        if "original" in last:
            why = f'"auto" → {show(last["new"])}: {why}'
        elif last["event"] == "args_parsed":
            said = ["explicit, equal to the default"] if final[path] == defaults.get(path) else []
            if last.get("given_as"):  # LLM(max_model_len=...): the vLLM keyword the user wrote
                said.append(f"given as vLLM's {last['given_as']}")
            why = "; ".join(said)
        rows.append([path, show(final[path]), last["source"], why])
    return ["resolved arguments (fields not at a plain framework default):", *table(rows)]


def render_result(result: LoadResult) -> str:
    """The readable report: model, resolved fields with sources, route, then KV geometry when known."""
    m = result.model
    lines = [
        f"model  {m.name}  ({m.kind}: {m.architecture} → {m.spec})",
        "",
        *render_args(result),
        "",
        f"route  {result.route.kv_manager} + {result.route.scheduler}",
        f"       {result.route.reason}",
    ]
    sampling = render_sampling_defaults(result.sampling_defaults)
    if sampling:
        lines += ["", *sampling]
    kv = result.kv
    if kv is not None and hasattr(kv, "render"):
        lines += ["", *kv.render()]
    # the model's name is a path the user gave (a folder named with an escape sequence): one line each, as printed
    return "\n".join(one_line(line) for line in lines)


def allocation_document(result: LoadResult) -> dict[str, Any]:
    """What ``run`` allocated: the manager, its pools as built on the device, and its stats."""
    m = result.kv_manager
    return {
        "kv_manager": type(m).__name__,
        "scheduler": type(result.scheduler).__name__,
        "device": str(m.pools.device),
        "pools": m.pools.describe(),
        "total_bytes": m.pools.nbytes,
        "host_bytes": host.nbytes if (host := getattr(m, "host", None)) is not None else 0,
        "stats": m.stats().to_dict(),
    }


def render_allocation(result: LoadResult) -> list[str]:
    """The ``run`` table's last section: one row per pool tensor actually allocated."""
    doc = allocation_document(result)
    dtype = str(result.kv_manager.pools.dtype).removeprefix("torch.")
    rows = [["pool", "shape (layers, blocks, entries, elems)", "dtype", "bytes"]]
    pools = doc["pools"]
    slabs = result.kv_manager.pools.slabs
    if result.kv_manager.pools.shared:  # one tensor every group views: one row
        first = next(iter(pools.values()))
        pools = {f"arena ({len(pools)} groups)": first}
    if slabs is not None:  # a slab arena: the one tensor, then each group's view of all of it
        rows.append([f"slab arena ({len(pools)} groups)", f"{slabs:,} slabs × {result.kv_manager.pools.slab_bytes:,} B",
                     dtype, f"{doc['total_bytes']:,}"])
    rows += [[name, "×".join(str(d) for d in pool["shape"]), dtype,
              "view" if pool["bytes"] is None else f"{pool['bytes']:,}"] for name, pool in pools.items()]
    kv = result.kv
    lines = [
        f"allocated  {doc['kv_manager']} + {doc['scheduler']} on {doc['device']}",
        *table(rows),
        f"  total {doc['total_bytes']:,} B; capacity {kv.capacity_tokens:,} tokens; "
        f"{kv.max_concurrency} sequence(s) of max_seq_len {kv.max_seq_len} at once",
    ]
    if doc["stats"].get("memory"):
        lines.append(f"  {doc['stats']['memory']}")
    if doc["host_bytes"]:
        lines.append(f"  host tier {doc['host_bytes']:,} B of host memory (suspended requests' pages)")
    return lines
