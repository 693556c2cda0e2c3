"""An audit file is input too: each record checked against its event's schema, and the events that
restate each other checked for agreement.

:func:`record_problem` runs while a file is read (a malformed record is an ``AuditError`` naming
the file and line); :func:`cross_check` runs in ``audit --verify`` (a disagreement means the log
was edited, so it does not verify).
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Any

import attrs

from pipeline.events import EVENT_TYPES, is_value_event
from pipeline.limits import short
from pipeline.paths import flatten

_JSON_TYPES = {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "an object",
               list: "a list"}


@functools.cache
def _hints(name: str) -> dict[str, tuple[Any, bool]]:
    """Field -> (type hint, required) of an event class (``stage``/``seq`` included)."""
    cls = EVENT_TYPES[name]
    hints = typing.get_type_hints(cls)
    return {a.name: (hints.get(a.name, Any), a.default is attrs.NOTHING) for a in attrs.fields(cls)}


def _matches(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a type hint of an event field (shallow: containers by kind)."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    base = origin or hint
    if base is bool:
        return isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base in (str, dict, list):
        return isinstance(value, base)
    return True


def _expected(hint: Any) -> str:
    args = typing.get_args(hint) if typing.get_origin(hint) is not None else ()
    if args and type(None) in args:
        return " or ".join(_expected(a) for a in args if a is not type(None)) + " or null"
    return _JSON_TYPES.get(typing.get_origin(hint) or hint, str(hint))


def record_problem(record: dict[str, Any], known_fields: frozenset[str]) -> str | None:
    """What is wrong with one event record (None when it fits its event's schema).

    Unknown event names are refused: the header's schema version fixes the set of events.
    A value event's ``field`` must be an LlmArgs field (``known_fields``), so a replay never
    writes a path through a value that is not a mapping.
    """
    name = record.get("event")
    if not isinstance(name, str):
        return f"'event' must be a string, got {short(name)}"
    if name not in EVENT_TYPES:
        return f"unknown event {short(name)} (not in this kvload's audit schema)"
    for field, (hint, required) in _hints(name).items():
        if field not in record:
            if required or field in ("stage", "seq"):
                return f"{name} without '{field}'"
            continue
        if not _matches(record[field], hint):
            return f"{name}: '{field}' must be {_expected(hint)}, got {short(record[field])}"
    if is_value_event(record) and record["field"] not in known_fields:
        return f"{name}: 'field' {short(record['field'])} is not an LlmArgs field"
    nested = _NESTED.get(name)
    return nested(record, known_fields) if nested is not None else None


def _snapshot_fields(record: dict[str, Any], known: frozenset[str]) -> str | None:
    for path, entry in record["fields"].items():
        if path not in known:
            return f"user_fields_snapshotted: {short(path)} is not an LlmArgs field"
        if not isinstance(entry, dict) or "value" not in entry or not isinstance(entry.get("source"), str):
            return f"user_fields_snapshotted: {path} must be an object with 'value' and 'source', got {short(entry)}"
    return None


_ROUTE = {"kv_manager": str, "scheduler": str, "use_kv_cache_manager_v2": bool, "reason": str}


def _finished(record: dict[str, Any], known: frozenset[str]) -> str | None:
    args = record["args"]
    stack = [("", args)]
    while stack:
        prefix, node = stack.pop()
        for key, value in node.items():
            path = prefix + key
            if isinstance(value, dict):
                stack.append((path + ".", value))
            elif path not in known:
                return f"pipeline_finished: args.{short(path)} is not an LlmArgs field"
    route = record.get("route")
    if route is not None:
        for key, kind in _ROUTE.items():
            if not isinstance(route.get(key), kind):
                return f"pipeline_finished: route.{key} must be {_JSON_TYPES[kind]}, got {short(route.get(key))}"
    stages = record.get("stages", [])
    if not all(isinstance(x, str) for x in stages):
        return "pipeline_finished: 'stages' must be a list of stage names"
    return None


#: Checks inside the object-valued fields that the reports read (``audit``, ``explain``, ``--verify``).
_NESTED = {"user_fields_snapshotted": _snapshot_fields, "pipeline_finished": _finished}


def _snapshot_mismatch(got: Any, want: dict[str, Any] | None) -> str | None:
    """How a field's ``user_fields_snapshotted`` entry differs from its last ``args_parsed``, naming the value or
    source that differs (with both sides); None when they agree."""
    def entry(e: dict[str, Any]) -> str:
        return f"{short(e.get('value'))} from {e.get('source')}"

    if want is None:
        return f"user_fields_snapshotted records {entry(got) if isinstance(got, dict) else short(got)}, but no " \
               "args_parsed event sets it"
    if got is None:
        return f"user_fields_snapshotted leaves it out, the args_parsed events give {entry(want)}"
    if not isinstance(got, dict):
        return f"user_fields_snapshotted records {short(got)}, not a {{value, source}} entry; the args_parsed " \
               f"events give {entry(want)}"
    differ = [key for key in ("value", "source") if got.get(key) != want[key]]
    if not differ:
        return None
    return "; ".join(f"user_fields_snapshotted records {key} {short(got.get(key))}, the args_parsed events give "
                     f"{short(want[key])}" for key in differ)


def cross_check(events: list[dict[str, Any]], final: dict[str, Any] | None,
                defaults: dict[str, Any]) -> list[str]:
    """Disagreements between events that restate each other (empty when the log is consistent).

    * each value event's ``old`` is the value the events before it left (a chain per field);
    * ``user_fields_snapshotted`` lists exactly the last ``args_parsed`` value and source per field;
    * each ``auto_resolved`` follows an ``auto_captured`` of the same field and original;
    * ``pipeline_finished.stages`` are the stages that finished, in order;
    * ``kv_budget_computed``/``kv_manager_built`` sizes agree with the final args.
    """
    problems: list[str] = []
    current = dict(defaults)
    parsed: dict[str, dict[str, Any]] = {}
    captured: dict[str, Any] = {}
    finished_stages: list[str] = []
    for e in events:
        name = e["event"]
        if is_value_event(e):
            path = e["field"]
            if path in current and e.get("old") != current[path]:
                problems.append(f"seq {e.get('seq')}: {name} of {path} says old={short(e.get('old'))}, but the "
                                f"events before it left {short(current[path])}")
            current[path] = e.get("new")
            if name == "args_parsed":
                parsed[path] = {"value": e.get("new"), "source": e.get("source")}
        if name == "auto_captured":
            captured[e["field"]] = e.get("original")
        elif name == "auto_resolved" and captured.get(e["field"]) != e.get("original"):
            problems.append(f"seq {e.get('seq')}: auto_resolved of {e['field']} has no matching auto_captured")
        elif name == "user_fields_snapshotted":
            snap = e.get("fields") or {}
            for path in sorted(set(snap) | set(parsed)):
                mismatch = _snapshot_mismatch(snap.get(path), parsed.get(path))
                if mismatch is not None:
                    problems.append(f"{path}: {mismatch}")
                    break
        elif name == "stage_finished":
            finished_stages.append(e.get("stage"))
        elif name == "pipeline_finished":
            stages = e.get("stages") or []
            if stages != finished_stages:
                problems.append(f"pipeline_finished lists stages {short(stages, 200)}, the stage_finished events "
                                f"{short(finished_stages, 200)}")
    if final is not None:
        flat = flatten(final)
        for name, key, path in (("kv_budget_computed", "max_seq_len", "max_seq_len"),
                                ("kv_manager_built", "max_seq_len", "max_seq_len"),
                                ("kv_manager_built", "tokens_per_block", "kv_cache_config.tokens_per_block")):
            for e in events:
                if e["event"] == name and e.get(key) != flat.get(path):
                    problems.append(f"{name}.{key} is {short(e.get(key))}, the final args say {short(flat.get(path))}")
    return problems
