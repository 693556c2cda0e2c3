"""Reading an audit log back: each field's chain of changes, a run summary, and verification.

``kvload explain`` and ``kvload audit`` are thin wrappers over :func:`field_chain`,
:func:`summarize` and :func:`verify_log`; each returns plain dicts (the ``--json`` form) and has a
``render_*`` twin for the readable table. Nothing here needs torch or transformers.
"""

from __future__ import annotations

import json
from typing import Any

from pipeline.audit import AuditLog
from pipeline.audit_schema import cross_check
from pipeline.config import V2_FIELD, framework_defaults
from pipeline.errors import ConfigError, did_you_mean
from pipeline.events import is_value_event
from pipeline.limits import short_text
from pipeline.paths import flatten
from pipeline.text import literal, one_line, table
from pipeline.vllm_compat import different_meaning

V2 = V2_FIELD
HOST = "kv_cache_config.host_cache_size"

_SOURCE_WORDS = {
    "cli": "set on the command line",
    "config_file": "set in the config file",
    "api": "passed to the Python API",
}


def resolve_field(name: str, aliases: dict[str, str] | None = None) -> str:
    """Map a field name to its dotted path: an exact path, an alias (a CLI flag's name), or a unique leaf name; a
    mapping field (``override_generation_config``) is its own path, which :func:`explain` expands to its leaves."""
    known = list(flatten(framework_defaults()))
    if name in known or any(p.startswith(name + ".") for p in known):
        return name
    if aliases and name in aliases:
        return aliases[name]
    by_leaf = [p for p in known if p.rsplit(".", 1)[-1] == name]
    if len(by_leaf) == 1:
        return by_leaf[0]
    vllm = different_meaning(name.replace("-", "_"), lambda path: path)  # the nearest fields, not all 38
    if vllm is not None:
        raise ConfigError(f"explain: {name} is not an LlmArgs field: {vllm}; explain kvload's field instead",
                          path=None)
    hint = did_you_mean(name, known + [p.rsplit(".", 1)[-1] for p in known]) or f"; fields: {', '.join(known)}"
    # quoted cut: the name is the user's, and over HTTP (/v1/kvload/explain?field=) any client's, whole it was 60 KB
    raise ConfigError(f"explain: {short_text(name, 80)} is not an LlmArgs field{hint}", path=None)


# --- one field's chain ---------------------------------------------------------------------


def _final_args(audit: AuditLog) -> dict[str, Any]:
    """The recorded final args when the run finished, else what the events replay to."""
    final = audit.final_args()
    return flatten(final if final is not None else audit.replay())


def _step(record: dict[str, Any], **changes: Any) -> dict[str, Any]:
    step = {
        "event": record["event"],
        "stage": record.get("stage"),
        "seq": record.get("seq"),
        "source": record.get("source"),
        "old": record.get("old"),
        "new": record.get("new"),
        "changed": True,
        "reason": record.get("reason", ""),
    }
    step.update(changes)
    return step


def field_chain(audit: AuditLog, path: str) -> dict[str, Any]:
    """Everything that happened to one field, from its framework default to the route.

    Steps: the framework default, ``auto_captured`` (an ``"auto"`` remembered before anything could
    change it), each value-changing event (config file, CLI/API, model default, auto, derived,
    route fallback), a skipped model default, an ignored setting, and for the V2 tri-state the
    route it led to. ``changed`` is False for steps that recorded a decision without a new value.
    """
    defaults = flatten(framework_defaults())
    conflicts = {(e["field"], e["kept_source"]): e for e in audit.of("source_conflict") if e.get("field") == path}
    overrides = overrides_text(audit)
    steps: list[dict[str, Any]] = [{
        "event": "framework_default", "stage": None, "seq": None, "source": "default", "old": None,
        "new": defaults.get(path), "changed": False, "reason": "the framework default",
    }]
    for e in audit.events:
        name = e["event"]
        if name == "executor_routed" and path == V2:
            value = e.get("use_kv_cache_manager_v2")
            steps.append(_step(e, source="route", old=value, new=f"{e.get('kv_manager')} + {e.get('scheduler')}",
                               changed=False))
            continue
        if name == "sampling_defaults_resolved" and path == "generation_config":
            steps.append(_step(e, source="model", old=e.get("generation_config"), new=e.get("generation_config"),
                               changed=False, reason=sampling_text(e)))
            continue
        if name == "sampling_defaults_resolved" and path.startswith("override_generation_config."):
            value = _final_args(audit).get(path)
            steps.append(_step(e, source="model", old=value, new=value, changed=False,
                               reason=sampling_text(e, reason=False)))
            continue
        if name == "kv_host_tier_chosen" and path == HOST:  # the auto (null) tier decided on the accelerator's costs
            steps.append(_step(e, source=f"plan ({e.get('hardware')})", old=None, new=None, changed=False,
                               reason=e.get("reason"), host_tier=e.get("host_tier")))
            continue
        if name == "kv_host_tier_sized" and path == HOST:  # what the value (auto, bytes, 0) came to in host memory
            if e.get("sized_by") != "kv_host_tier_chosen":  # that choice's own step says it
                steps.append(_step(e, source="plan", old=e.get("host_cache_size"), new=e.get("host_cache_size"),
                                   changed=False, reason=e.get("reason"), host_bytes=e.get("host_bytes")))
            continue
        if e.get("field") != path:
            continue
        if name == "args_parsed":
            reason = _SOURCE_WORDS.get(e.get("source"), f"given by {e.get('source')}")
            if isinstance(e.get("given_as"), str):  # kvload.LLM(max_model_len=...): vLLM's keyword of this field
                reason += f" as vLLM's {e['given_as']}"
            clash = conflicts.get((path, e.get("source")))
            if clash is not None:
                reason += (f"; overrides {literal(clash['overridden'])} from {clash['overridden_source']} "
                           f"(the command line and the Python API beat the config file)")
            steps.append(_step(e, reason=reason))
        elif name == "model_default_applied":
            steps.append(_step(e, reason=f"model default of {e.get('spec')}"))
        elif name == "auto_captured":
            who = f"explicitly, via {e.get('source')}" if e.get("explicit") else "by default, not set by the user"
            steps.append(_step(e, old=e.get("original"), new=e.get("original"), changed=False,
                               reason=f"\"auto\" ({who}) remembered before any stage could replace it"))
        elif name == "model_default_skipped":
            steps.append(_step(e, source=e.get("kept_source"), old=e.get("kept"), new=e.get("kept"), changed=False,
                               reason=f"{e.get('spec')} proposed {literal(e.get('proposed'))}, not applied: "
                                      f"{e.get('reason')}"))
        elif name == "setting_ignored":
            steps.append(_step(e, source="route", old=e.get("value"), new=e.get("value"), changed=False))
        elif name == "max_seq_len_beyond_positions":
            steps.append(_step(e, old=e.get("max_seq_len"), new=e.get("max_seq_len"), changed=False))
        elif is_value_event(e):
            steps.append(_step(e))
    if overrides:
        for step in steps:  # a value read from the checkpoint's config read it as hf_overrides left it
            if step["event"] in ("model_default_applied", "auto_resolved") or step["source"] == "checkpoint":
                step["reason"] = "; ".join(part for part in (step["reason"], overrides) if part)
    return {"field": path, "final": _final_args(audit).get(path, defaults.get(path)), "chain": steps}


def overrides_text(audit: AuditLog) -> str:
    """The ``hf_config_overridden`` records of a run in one line (empty without any): the config keys vLLM's
    ``hf_overrides`` set before the model's defaults and geometry were read."""
    changes = _override_changes(audit.of("hf_config_overridden"))
    return f"the checkpoint's config as hf_overrides left it: {changes}" if changes else ""


def _override_changes(records: list[dict[str, Any]]) -> str:
    """``hf_config_overridden`` records as ``key old → new (source)``, comma-separated."""
    return ", ".join(f"{e.get('key')} {literal(e.get('old')) if not e.get('added') else '(none)'} → "
                     f"{literal(e.get('new'))} ({e.get('source')})" for e in records)


def sampling_text(record: dict[str, Any], reason: bool = True) -> str:
    """A ``sampling_defaults_resolved`` record in one line: each default with where it came from, the keys that did
    not apply grouped by why, then (``reason``) the record's reason."""
    sources = record.get("sources") or {}
    values = ", ".join(f"{k} {literal(v)} ({sources.get(k, '?')})" for k, v in (record.get("defaults") or {}).items())
    why_keys: dict[str, list[str]] = {}
    for key, why in (record.get("not_applied") or {}).items():
        why_keys.setdefault(str(why), []).append(key)
    skipped = "; ".join(f"not applied: {', '.join(keys)}: {why}" for why, keys in why_keys.items())
    parts = (f"sampling defaults: {values}" if values else "no sampling defaults", skipped,
             record.get("reason", "") if reason else "")
    return "; ".join(part for part in parts if part)


def explain(audit: AuditLog, fields: list[str] | None = None,
            aliases: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Chains for the named fields (see :func:`resolve_field`), or for every field some event changed."""
    paths = [resolve_field(f, aliases) for f in fields] if fields else audit.changed_fields()
    known = list(flatten(framework_defaults()))
    leaves: list[str] = []
    for path in paths:
        if path in known:
            leaves.append(path)
            continue
        under = [p for p in known if p.startswith(path + ".")]  # a mapping field: the leaves an event changed, else all
        changed = [p for p in audit.changed_fields() if p in under]
        leaves += changed or under
    return [field_chain(audit, p) for p in dict.fromkeys(leaves)]


def _change(step: dict[str, Any]) -> str:
    if step["event"] == "framework_default":
        return literal(step["new"])
    if step["event"] == "executor_routed":
        return f"{literal(step['old'])} → {step['new']}"
    if step["event"] == "kv_host_tier_chosen":  # the value stays null; what it meant on this accelerator
        return "null: a host tier" if step.get("host_tier") else "null: no host tier"
    if step["event"] == "kv_host_tier_sized":  # the value stays; the bytes it sized
        return f"{literal(step['new'])}: {step.get('host_bytes') or 0:,} B of host memory"
    if not step["changed"]:
        return f"{literal(step['new'])} (kept)" if step["event"] != "auto_captured" else '"auto" captured'
    old = step["old"]
    if step["event"] == "auto_resolved":
        old = "auto"  # the captured original; a model default may already have replaced the value
    return f"{literal(old)} → {literal(step['new'])}"


def render_chain(chain: dict[str, Any]) -> list[str]:
    """One field's chain as a small table under a ``field = value`` heading."""
    rows = [["stage", "source", "change", "why"]]
    for step in chain["chain"]:
        rows.append([step["stage"] or "(framework)", step["source"] or "", _change(step), step["reason"]])
    return [one_line(f"{chain['field']} = {literal(chain['final'])}"), *table(rows)]


def render_explain(chains: list[dict[str, Any]]) -> str:
    """Every chain, separated by blank lines."""
    blocks = ["\n".join(render_chain(c)) for c in chains]
    return "\n\n".join(blocks) if blocks else "no field changed in this audit log"


# --- the whole run -------------------------------------------------------------------------


def _payload(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in ("event", "level", "stage", "seq", "ts")}


def warning_text(record: dict[str, Any], grouped: bool = False) -> str:
    """One line for a warning or error event; ``grouped``: without the request it came with (a served request's
    ``setting_ignored`` names its request), so the same warning of many requests is one line."""
    name = record["event"]
    if name == "source_conflict":
        under = f"{record['overridden_field']} " if record.get("overridden_field") else ""
        return (f"{record['field']}: {record['kept_source']} {literal(record['kept'])} beats "
                f"{record['overridden_source']} {under}{literal(record['overridden'])}")
    if name == "stage_failed":
        return f"stage {record.get('stage')} failed: {record.get('error')}: {record.get('message')}"
    subject = record.get("field") or record.get("architecture") or record.get("stage") or ""
    detail = record.get("reason") or record.get("message") or json.dumps(_payload(record), default=str)
    request = record.get("request")
    if grouped and isinstance(request, str) and isinstance(detail, str):
        detail = detail.removesuffix(f" (request {request})")
    return f"{subject}: {detail}" if subject else detail


class WarningGroups:
    """Every warning or error once, in the order each first came, with how many times it came (``count``); it holds
    one entry per distinct warning, however many records it is given.

    Why: a served run warns per request (a setting a request gave that acts on nothing), so a day's log held the
    same line tens of thousands of times, and the report printed every one of them (and held every record to)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[Any, ...], dict[str, Any]] = {}

    def add(self, record: dict[str, Any]) -> None:
        """Count one record (anything not a warning or error is passed over)."""
        if record.get("level") not in ("warning", "error"):
            return
        entry = {"event": record["event"], "level": record["level"], "stage": record.get("stage"),
                 "message": warning_text(record, grouped=True)}
        key = tuple(entry.values())
        if key in self._seen:
            self._seen[key]["count"] += 1
        else:
            self._seen[key] = {**entry, "count": 1}

    def entries(self) -> list[dict[str, Any]]:
        """The grouped warnings, in the order each first came."""
        return [dict(entry) for entry in self._seen.values()]


def _grouped_warnings(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:class:`WarningGroups` of a list of events."""
    groups = WarningGroups()
    for e in events:
        groups.add(e)
    return groups.entries()


def summarize(audit: AuditLog, source: str = "") -> dict[str, Any]:
    """Model, user-set fields, hf_overrides set, route, auto resolutions, model defaults, derived fields, sampling
    defaults, warnings, outcome."""
    models = audit.of("model_resolved")
    routes = audit.of("executor_routed")
    joined = audit.of("rank_joined")
    snapshot = audit.of("user_fields_snapshotted")
    finished = audit.of("pipeline_finished")
    failed = audit.of("stage_failed")
    sampling = audit.of("sampling_defaults_resolved")
    captured = {e["field"]: e for e in audit.of("auto_captured")}
    autos = []
    for e in audit.of("auto_resolved"):
        cap = captured.get(e["field"], {})
        autos.append({**_payload(e), "explicit": bool(cap.get("explicit")),
                      "captured_from": cap.get("source", "default")})
    return {
        "file": source,
        "kvload_version": audit.header.get("kvload_version"),
        "schema_version": audit.header.get("schema_version"),
        "events": len(audit),
        "model": _payload(models[-1]) if models else None,
        "user_fields": snapshot[-1]["fields"] if snapshot else {},
        "hf_overrides": [_payload(e) for e in audit.of("hf_config_overridden")],
        "route": _payload(routes[-1]) if routes else None,
        "rank": _payload(joined[-1]) if joined else None,
        "route_fallbacks": [_payload(e) for e in audit.of("route_fallback")],
        "auto_resolutions": autos,
        "model_defaults": {
            "applied": [_payload(e) for e in audit.of("model_default_applied")],
            "skipped": [_payload(e) for e in audit.of("model_default_skipped")],
        },
        "derived": [_payload(e) for e in audit.of("field_derived")],
        "sampling_defaults": _payload(sampling[-1]) if sampling else None,
        "warnings": audit.warnings if isinstance(audit, ReadLog) else _grouped_warnings(audit.events),
        "outcome": {
            "finished": bool(finished),
            "stages": finished[-1].get("stages", []) if finished else [],
            "failed": {"stage": failed[-1].get("stage"), "error": failed[-1].get("error"),
                       "message": failed[-1].get("message")} if failed else None,
        },
    }


def verify_log(audit: AuditLog) -> dict[str, Any]:
    """Check a log is what kvload wrote: replay equals the recorded args, seq is unbroken, the route agrees."""
    problems = list(audit.verify())
    # a served log says how many records it let go where (--audit-keep): seq skips exactly that many there
    seq_problem = audit.seq_problem()
    if seq_problem is not None:
        problems.append(seq_problem)
    finished = audit.of("pipeline_finished")
    routes = audit.of("executor_routed")
    recorded = finished[-1].get("route") if finished else None
    if recorded and routes:
        for key in ("kv_manager", "scheduler", "use_kv_cache_manager_v2"):
            if recorded.get(key) != routes[-1].get(key):
                problems.append(f"route.{key}: executor_routed says {routes[-1].get(key)!r}, "
                                f"pipeline_finished records {recorded.get(key)!r}")
        final = audit.final_args() or {}
        v2 = final.get("kv_cache_config", {}).get("use_kv_cache_manager_v2")
        if "use_kv_cache_manager_v2" in recorded and v2 is not recorded["use_kv_cache_manager_v2"]:
            problems.append(f"{V2}: final args say {v2!r}, the route was chosen for "
                            f"{recorded['use_kv_cache_manager_v2']!r}")
    problems += cross_check(audit.events, audit.final_args(), flatten(framework_defaults()))
    for call, seq in audit.unended_calls():  # a call with no end: written while it ran, or its end was cut out
        problems.append(f"generate call {call!r} (seq {seq!r}) started and never ended: no generation_finished or "
                        "generation_failed (the log was written while it ran, or its end was removed)")
    chain = audit.chain
    if chain is not None and not chain["ok"]:
        problems.append(f"chain: {chain['problem']}")
    value_events = sum(1 for e in audit.events if is_value_event(e))
    return {
        "ok": not problems,
        "dropped": audit.dropped,
        "value_events": value_events,
        "fields": len(flatten(audit.final_args() or {})),
        "problems": problems,
        "chain": chain,
    }


#: The events :func:`summarize`, :func:`verify_log` and :func:`explain` read besides value events and warnings;
#: :func:`needed` keeps only these when a file is read (a long run's request records are not kept).
READ_EVENTS = frozenset({
    "model_resolved", "executor_routed", "user_fields_snapshotted", "pipeline_finished", "stage_failed",
    "stage_finished", "sampling_defaults_resolved", "auto_captured", "auto_resolved", "route_fallback",
    "model_default_applied", "model_default_skipped", "field_derived", "source_conflict", "setting_ignored",
    "max_seq_len_beyond_positions", "hf_config_overridden", "kv_host_tier_chosen", "kv_host_tier_sized",
    "kv_budget_computed",
    "kv_manager_built", "args_parsed", "rank_joined",
})


_KNOWN_FIELDS = frozenset(flatten(framework_defaults()))


def needed(record: dict[str, Any]) -> bool:
    """Whether the reports of this module read this event (``AuditLog.from_jsonl(path, keep=needed)``). A warning is
    read through :class:`WarningGroups` (its count), so it is not kept for that; a ``setting_ignored`` is kept only
    when it names an LlmArgs field (a chain of :func:`explain` shows it), not a served request's setting."""
    name = record["event"]
    if name == "setting_ignored":
        return record.get("field") in _KNOWN_FIELDS
    return name in READ_EVENTS or is_value_event(record)


class ReadLog(AuditLog):
    """An audit file as ``kvload audit``/``explain`` read it: the events they use, and the warnings grouped as the
    file streamed past (:attr:`warnings`), so memory grows with the distinct warnings, not with the records."""

    warnings: list[dict[str, Any]]


def read_log(path: str) -> ReadLog:
    """An audit file read for ``kvload audit``/``explain``: streamed, holding only the events they read and one entry
    per distinct warning."""
    groups = WarningGroups()

    def keep(record: dict[str, Any]) -> bool:
        groups.add(record)
        return needed(record)

    log = ReadLog.from_jsonl(path, keep=keep)
    assert isinstance(log, ReadLog)
    log.warnings = groups.entries()
    return log


def _route_line(route: dict[str, Any] | None) -> list[str]:
    if route is None:
        return ["route   (not reached)"]
    return [f"route   {route['kv_manager']} + {route['scheduler']}", f"        {route['reason']}"]


def _rank_line(joined: dict[str, Any] | None) -> list[str]:
    """Tensor parallel's line: which rank wrote the log and the heads each rank holds (none with one rank)."""
    if joined is None or joined.get("tensor_parallel_size", 1) <= 1:
        return []
    tp, world, heads = joined["tensor_parallel_size"], joined.get("world_size", 1), joined.get("heads") or {}
    if heads.get("mode") == "latent":
        held = f"{heads.get('attention_heads_per_rank')} of {heads.get('attention_heads')} query heads and the MLA " \
               "latent whole per rank"
    else:
        shared = f" (each replicated on {heads.get('kv_replicas')} ranks)" if heads.get("mode") == "replicate" else ""
        held = (f"{heads.get('attention_heads_per_rank')} of {heads.get('attention_heads')} query heads and "
                f"{heads.get('kv_heads_per_rank')} of {heads.get('kv_heads')} KV heads per rank{shared}")
    who = (f"this log is rank {joined.get('rank')}'s of {world} (every rank writes its own: <stem>.rankN<suffix>)"
           if world > 1 else "planned in one process: rank 0's view")
    return [f"ranks   tensor parallel {tp}, {held}; {who}"]


def render_summary(summary: dict[str, Any], check: dict[str, Any] | None = None) -> str:
    """The readable ``kvload audit`` report."""
    outcome = summary["outcome"]
    if outcome["finished"]:
        state = f"finished ({len(outcome['stages'])} stages)"
    elif outcome["failed"]:
        state = f"failed in {outcome['failed']['stage']}"
    else:
        state = "did not finish"
    lines = [f"audit   {summary['file']}: kvload {summary['kvload_version']}, schema {summary['schema_version']}, "
             f"{summary['events']} events, {state}"]
    m = summary["model"]
    lines.append(f"model   {m['model']}  ({m['kind']}: {m['architecture']} → {m['spec']})" if m else
                 "model   (not resolved)")
    users = summary["user_fields"]
    lines.append("user    " + (", ".join(f"{p}={literal(v['value'])} ({v['source']})" for p, v in users.items())
                               or "(nothing set)"))
    if summary.get("hf_overrides"):  # the user's too: config keys set before the model was read
        lines.append(f"config  hf_overrides: {_override_changes(summary['hf_overrides'])}")
    lines += _route_line(summary["route"])
    lines += _rank_line(summary.get("rank"))

    lines += ["", "auto resolutions:"]
    if summary["auto_resolutions"]:
        rows = [["field", "change", "source", "why"]]
        for a in summary["auto_resolutions"]:
            origin = f"explicit via {a['captured_from']}" if a["explicit"] else "default"
            rows.append([a["field"], f'"auto" ({origin}) → {literal(a["new"])}', a["source"], a["reason"]])
        lines += table(rows)
    else:
        lines.append("  (none)")

    lines += ["", "model defaults:"]
    applied, skipped = summary["model_defaults"]["applied"], summary["model_defaults"]["skipped"]
    rows = [["", "field", "value", "why"]]
    rows += [["applied", d["field"], f"{literal(d['old'])} → {literal(d['new'])}", f"model default of {d['spec']}"]
             for d in applied]
    rows += [["skipped", d["field"], f"{literal(d['proposed'])} proposed, {literal(d['kept'])} kept",
              f"{d['spec']}: {d['reason']}"] for d in skipped]
    lines += table(rows) if len(rows) > 1 else ["  (none proposed)"]

    lines += ["", "derived (null fields filled in, not by the user):"]
    rows = [["field", "value", "source", "why"]]
    rows += [[d["field"], literal(d["new"]), d["source"], d["reason"]] for d in summary["derived"]]
    lines += table(rows) if len(rows) > 1 else ["  (none)"]

    lines += ["", "sampling defaults (of requests that leave a setting unset):"]
    sampling = summary.get("sampling_defaults")
    lines.append(f"  {sampling_text(sampling)}" if sampling else "  (not resolved)")

    lines += ["", "warnings:"]
    lines += [f"  {w['event']}  {w['message']}" + (f"  (x{w['count']:,})" if w.get("count", 1) > 1 else "")
              for w in summary["warnings"]] or ["  (none)"]
    if check is not None:
        lines.append("")
        lines += render_verify(check)
    # every text here came from the audit file, which anyone may have written: one line each, no terminal escapes
    return "\n".join(one_line(line) for line in lines)


def render_verify(check: dict[str, Any]) -> list[str]:
    """The verdict of :func:`verify_log`, one line when it passes."""
    chain = check.get("chain")
    guarantee = [f"chain   {chain['guarantee']}"] if chain is not None and chain["ok"] else []
    if check.get("dropped"):
        guarantee.append(f"gap     {check['dropped']:,} request-time records the server dropped (--audit-keep) are "
                         "not in this file, so not checked")
    if check["ok"]:
        return [f"verify  ok: replaying {check['value_events']} value-changing events over the framework defaults "
                f"reproduces the recorded final args ({check['fields']} fields); the events that restate each "
                "other agree", *guarantee]
    return [f"verify  FAILED ({len(check['problems'])} problem(s)):", *(f"  {p}" for p in check["problems"]),
            *guarantee]
