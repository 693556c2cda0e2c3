"""The audit log: every event of a run, kept in memory, written as JSON Lines, replayable.

A file starts with an ``audit_header`` line (kvload and schema version); the run's last record is
``pipeline_finished`` with the final resolved args, so a replay can be checked after the fact.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipeline.config import framework_defaults
from pipeline.errors import AuditError
from pipeline.events import is_value_event
from pipeline.paths import flatten, set_in
from pipeline.version import AUDIT_SCHEMA_VERSION, __version__

HEADER_EVENT = "audit_header"


def header_record() -> dict[str, Any]:
    """The first line of every audit file."""
    return {"event": HEADER_EVENT, "kvload_version": __version__, "schema_version": AUDIT_SCHEMA_VERSION}


def _dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, default=str, separators=(",", ":"))


class AuditLog:
    """In-memory list of event records; a bus subscriber (call it with a record)."""

    def __init__(self, events: Iterable[dict[str, Any]] = (), header: dict[str, Any] | None = None) -> None:
        self.events: list[dict[str, Any]] = list(events)
        self.header = header or header_record()

    def __call__(self, record: dict[str, Any]) -> None:
        self.events.append(record)

    def __len__(self) -> int:
        return len(self.events)

    def of(self, name: str) -> list[dict[str, Any]]:
        """All events with this name, in order."""
        return [e for e in self.events if e["event"] == name]

    def provenance(self, path: str) -> list[dict[str, Any]]:
        """The ordered chain of changes to one field: each step's event, stage, source, old, new, reason."""
        chain = []
        for e in self.events:
            if is_value_event(e) and e.get("field") == path:
                step = {k: e.get(k) for k in ("event", "stage", "seq", "source", "old", "new")}
                if "reason" in e:
                    step["reason"] = e["reason"]
                if "original" in e:
                    step["original"] = e["original"]
                chain.append(step)
        return chain

    def changed_fields(self) -> list[str]:
        """Every field some value-changing event touched, in first-touched order."""
        seen: dict[str, None] = {}
        for e in self.events:
            if is_value_event(e):
                seen.setdefault(e["field"], None)
        return list(seen)

    def replay(self) -> dict[str, Any]:
        """Fold the value-changing events over the framework defaults; equals the final args."""
        tree = copy.deepcopy(framework_defaults())
        for e in self.events:
            if is_value_event(e):
                set_in(tree, e["field"], copy.deepcopy(e["new"]))
        return tree

    def final_args(self) -> dict[str, Any] | None:
        """The final args recorded by ``pipeline_finished`` (None when the run did not finish)."""
        done = self.of("pipeline_finished")
        return done[-1]["args"] if done else None

    def verify(self) -> list[str]:
        """Differences between the replay and the recorded final args; empty when they agree."""
        final = self.final_args()
        if final is None:
            return ["no pipeline_finished record: the run did not finish, nothing to verify against"]
        got, want = flatten(self.replay()), flatten(final)
        return [
            f"{k}: replay gives {got.get(k, '<missing>')!r}, recorded {want.get(k, '<missing>')!r}"
            for k in sorted(set(got) | set(want))
            if got.get(k, object()) != want.get(k, object())
        ]

    # --- files ---------------------------------------------------------------------------------

    def to_jsonl(self, path: str | os.PathLike[str]) -> None:
        """Write the header and every event, one JSON object per line (atomically)."""
        with JsonlSink(path) as sink:
            for record in self.events:
                sink(record)

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike[str]) -> AuditLog:
        """Read an audit file; raise ``AuditError`` naming the file and line when it is unusable."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise AuditError(f"{p}: audit file not found") from None
        except IsADirectoryError:
            raise AuditError(f"{p}: is a directory, expected an audit .jsonl file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise AuditError(f"{p}: cannot read audit file ({exc.__class__.__name__})") from None
        lines = text.splitlines()
        if not lines:
            raise AuditError(f"{p}: empty file, expected a kvload audit log (JSON Lines)")
        records = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                last = n == len(lines)
                why = "truncated (the last line is incomplete)" if last else f"not valid JSON ({exc.msg})"
                raise AuditError(f"{p}: line {n}: {why}") from None
            if not isinstance(record, dict) or "event" not in record:
                raise AuditError(f"{p}: line {n}: expected a JSON object with an 'event' key")
            records.append(record)
        header = records[0]
        if header.get("event") != HEADER_EVENT:
            raise AuditError(f"{p}: line 1: not a kvload audit log (no {HEADER_EVENT} line)")
        if header.get("schema_version") != AUDIT_SCHEMA_VERSION:
            raise AuditError(
                f"{p}: schema_version {header.get('schema_version')!r} is not supported "
                f"(this kvload reads {AUDIT_SCHEMA_VERSION})"
            )
        for n, record in enumerate(records[1:], 2):
            if is_value_event(record) and not isinstance(record.get("field"), str):
                raise AuditError(f"{p}: record {n}: {record['event']} without a 'field'")
        return cls(records[1:], header=header)


class JsonlSink:
    """Streams records to a JSON Lines file; the file appears only when the run closes cleanly.

    Lines go to a temporary file beside the target, renamed into place by ``close(ok=True)`` and
    removed by ``close(ok=False)``, so a failed run never leaves a half-written audit behind.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file = None
        self._tmp: str | None = None

    def _open(self) -> None:
        parent = self.path.parent if str(self.path.parent) else Path(".")
        fd, self._tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=parent)
        self._file = os.fdopen(fd, "w", encoding="utf-8")
        self._file.write(_dumps(header_record()) + "\n")

    def __call__(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self._open()
        self._file.write(_dumps(record) + "\n")

    def close(self, ok: bool = True) -> None:
        """Publish the file (``ok``) or discard it."""
        if self._file is None:
            if ok:
                self._open()
            else:
                return
        self._file.close()
        self._file = None
        if ok:
            os.replace(self._tmp, self.path)
        else:
            os.unlink(self._tmp)
        self._tmp = None

    def __enter__(self) -> JsonlSink:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)
