"""The audit log: every event of a run, kept in memory, written as JSON Lines, replayable.

A file starts with an ``audit_header`` line (kvload and schema version); the run's last record is
``pipeline_finished`` with the final resolved args, so a replay can be checked after the fact.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import secrets
import stat
import sys
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

from pipeline.audit_chain import HEAD, PREV, Chain, ChainCheck, audit_key
from pipeline.audit_schema import record_problem
from pipeline.config import framework_defaults
from pipeline.errors import AuditError, ConfigError, OutputError, cannot_read, out_of_space
from pipeline.events import is_value_event
from pipeline.limits import MAX_DEPTH, nesting_depth, short, unique_keys
from pipeline.paths import flatten, set_in
from pipeline.signals import deferred
from pipeline.textfile import open_regular
from pipeline.version import AUDIT_SCHEMA_VERSION, __version__

HEADER_EVENT = "audit_header"
#: The line ``GET /v1/kvload/audit`` puts where ``--audit-keep`` let request-time records go: not an event (no
#: stage, no seq), so a reader takes it out of the events and lets seq skip the records it says are missing.
DROPPED_EVENT = "audit_records_dropped"


def dropped_record(dropped: int, *, kept: int, keep: int) -> dict[str, Any]:
    """The marker of ``dropped`` records let go, ``kept`` request-time records after it (``--audit-keep keep``)."""
    return {"event": DROPPED_EVENT, "dropped": dropped, "kept": kept,
            "reason": f"the server keeps the newest {keep} request-time records in memory (--audit-keep); "
                      "--audit-log FILE has them all"}


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
        #: The verdict on a file's hash chain (:func:`pipeline.audit_chain.check_chain`); None in memory.
        self.chain: dict[str, Any] | None = None
        #: A file read with a DROPPED_EVENT line: records missing there (a served log), and the index of the event
        #: after the gap.
        self.dropped = 0
        self.dropped_at: int | None = None
        #: Set by :meth:`keep_tail`: records before ``pinned`` are always kept, at most ``max_tail`` after them.
        self.pinned = 0
        self.max_tail: int | None = None
        #: Records :meth:`keep_tail` let go of (oldest first); the sinks of the bus still got them.
        self.dropped = 0
        #: Set by a streamed read that kept only some events (``from_jsonl(keep=...)``).
        self._digest: _Digest | None = None

    def __call__(self, record: dict[str, Any]) -> None:
        events = self.events
        events.append(record)
        if self.max_tail is not None:
            over = len(events) - self.pinned - self.max_tail
            # Trimmed in slices of an eighth of the tail: an append stays amortised O(1).
            if over > self.max_tail // 8:
                del events[self.pinned:self.pinned + over]
                self.dropped += over

    def keep_tail(self, max_records: int) -> None:
        """Bound the memory of a long-lived log (``kvload serve``): keep every record so far (the load's) and
        at most about ``max_records`` later ones, the newest; :meth:`tail` reads exactly the last ``max_records``."""
        if max_records < 0:
            raise ValueError(f"max_records: must be >= 0, got {max_records}")
        self.pinned = len(self.events)
        self.max_tail = max_records

    def tail(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
        """(the pinned records, the newest kept records after them, how many were let go) — one consistent copy."""
        while True:  # the engine's thread may append (and trim) meanwhile: copy until no trim came between
            dropped = self.dropped
            events = list(self.events)
            if dropped == self.dropped:
                break
        head, rest = events[:self.pinned], events[self.pinned:]
        extra = 0 if self.max_tail is None else max(0, len(rest) - self.max_tail)
        return head, rest[extra:], dropped + extra

    def __len__(self) -> int:
        return len(self.events) if self._digest is None else self._digest.count

    def of(self, name: str) -> list[dict[str, Any]]:
        """All events with this name, in order."""
        return [e for e in self.events if e["event"] == name]

    def provenance(self, path: str) -> list[dict[str, Any]]:
        """The ordered chain of changes to one field: each step's event, stage, source, old, new, reason (and
        ``given_as``, the vLLM keyword, where one gave the value)."""
        chain = []
        for e in self.events:
            if is_value_event(e) and e.get("field") == path:
                step = {k: e.get(k) for k in ("event", "stage", "seq", "source", "old", "new")}
                if "reason" in e:
                    step["reason"] = e["reason"]
                if "original" in e:
                    step["original"] = e["original"]
                if "given_as" in e:  # a vLLM keyword gave it (LLM(max_model_len=...))
                    step["given_as"] = e["given_as"]
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
    def from_jsonl(cls, path: str | os.PathLike[str],
                   keep: Callable[[dict[str, Any]], bool] | None = None) -> AuditLog:
        """Read an audit file; raise ``AuditError`` naming the file and line when it is unusable.

        Every record is checked against its event's schema (:mod:`pipeline.audit_schema`); the hash
        chain is checked too, its verdict kept in :attr:`chain` for ``audit --verify``. The file is read
        as a stream: with ``keep``, only the events it accepts are held (a long served log's request records
        are most of it), the count, ``seq`` and generate-call checks being made on the way (:meth:`seq_problem`,
        :meth:`unended_calls`, ``len``).
        """
        if os.fspath(path) == "":  # Path("") is ".", which would be refused as a directory
            raise AuditError("audit file: empty path, expected an audit .jsonl file (written with --audit-log)")
        p = Path(path)
        reader = _Reader(p, keep)
        for n, line, last in _lines(p):
            reader.line(n, line, last)
        return reader.finish(cls)

    def seq_problem(self) -> str | None:
        """The first event whose ``seq`` is not its place (a served log's gap of dropped records allowed for)."""
        if self._digest is not None:
            return self._digest.seq_problem
        for i, e in enumerate(self.events):
            problem = _seq_problem(i, e.get("seq"), self.dropped if self.dropped_at is not None else 0,
                                   self.dropped_at)
            if problem is not None:
                return problem
        return None

    def unended_calls(self) -> list[tuple[Any, Any]]:
        """(call, seq) of each ``generation_started`` with no ``generation_finished``/``generation_failed``."""
        if self._digest is not None:
            return list(self._digest.calls.unended())
        calls = _Calls()
        for e in self.events:
            calls.add(e)
        return list(calls.unended())


def _seq_problem(i: int, seq: Any, dropped: int, dropped_at: int | None) -> str | None:
    expected = i + (dropped if dropped_at is not None and i >= dropped_at else 0)
    if seq != expected:
        return f"event {i + 1} has seq {seq!r}, expected {expected}: events were removed, added or reordered"
    return None


class _Calls:
    """The generate calls started and not (yet) ended, in the order they started; memory for the open ones and the
    ids of the ended ones, not for every record."""

    def __init__(self) -> None:
        self.ended: set[Any] = set()
        self.open: dict[int, tuple[Any, Any]] = {}  # by order of start: (call, seq)
        self.by_call: dict[Any, list[int]] = {}
        self.started = 0

    def add(self, record: dict[str, Any]) -> None:
        """Take note of one event."""
        name = record["event"]
        if name == "generation_started":
            call = record.get("call")
            if call not in self.ended:
                self.open[self.started] = (call, record.get("seq"))
                self.by_call.setdefault(call, []).append(self.started)
            self.started += 1
        elif name in ("generation_finished", "generation_failed"):
            call = record.get("call")
            self.ended.add(call)
            for i in self.by_call.pop(call, ()):
                del self.open[i]

    def unended(self) -> Iterator[tuple[Any, Any]]:
        """(call, seq) of each call started and never ended."""
        return iter(self.open.values())


@attrs.define
class _Digest:
    """What a streamed read found about the events it did not keep."""

    count: int
    seq_problem: str | None
    calls: _Calls


class _Reader:
    """:meth:`AuditLog.from_jsonl`, one line at a time. The errors come out as a whole-file read gave them: one not
    UTF-8 first, then a line that is not a record, then the first record that does not fit (header, schema)."""

    def __init__(self, p: Path, keep: Callable[[dict[str, Any]], bool] | None) -> None:
        self.p, self.keep = p, keep
        self.parse_error: AuditError | None = None
        self.problem: AuditError | None = None  # the first unusable record; later lines are only parsed
        self.header: dict[str, Any] | None = None
        self.header_line = 0  # the header's line number, once read
        self.chain: ChainCheck | None = None
        self.known = frozenset(flatten(framework_defaults()))
        self.events: list[dict[str, Any]] = []
        self.count = 0
        self.dropped: tuple[int, int] | None = None  # (index of the first event after the gap, records missing)
        self.seq_problem: str | None = None
        self.calls = _Calls()

    def line(self, n: int, line: str, last: bool) -> None:
        """One line of the file (blank ones included)."""
        if self.parse_error is not None or not line.strip():
            return
        try:
            record = _parse_line(self.p, n, line, last)
        except AuditError as exc:
            self.parse_error = exc
            return
        if self.problem is not None:
            return
        try:
            self._record(n, record)
        except AuditError as exc:
            self.problem = exc

    def _record(self, n: int, record: dict[str, Any]) -> None:
        p = self.p
        if self.header is None:
            self._check_header(n, record)
            self.header, self.header_line = record, n
            self.chain = ChainCheck(record, audit_key())
            return
        assert self.chain is not None
        self.chain.add(n, record)
        if record.get("event") == DROPPED_EVENT:
            count = record.get("dropped")
            if self.dropped is not None or not (isinstance(count, int) and not isinstance(count, bool) and count > 0):
                raise AuditError(f"{p}: line {n}: {DROPPED_EVENT}: expected one such line with 'dropped' an "
                                 f"integer >= 1, got {short(count)}")
            self.dropped = (self.count, count)
            return
        if record.get("event") == HEADER_EVENT:  # was "unknown event 'audit_header' (not in this kvload's schema)"
            raise AuditError(f"{p}: line {n}: a second {HEADER_EVENT} (the first is line {self.header_line}): an "
                             "audit file holds one run's log; were two logs joined into one file?")
        problem = record_problem(record, self.known)
        if problem is not None:
            raise AuditError(f"{p}: line {n}: {problem}")
        event = {k: v for k, v in record.items() if k not in (PREV, HEAD)}
        if self.keep is not None:  # the checks a kept event list would allow, made now
            if self.seq_problem is None:
                gap, at = self.dropped[::-1] if self.dropped is not None else (0, None)
                self.seq_problem = _seq_problem(self.count, event.get("seq"), gap, at)
            self.calls.add(event)
        if self.keep is None or self.keep(event):
            self.events.append(event)
        self.count += 1

    def _check_header(self, n: int, header: dict[str, Any]) -> None:
        p = self.p
        if header.get("event") != HEADER_EVENT:
            raise AuditError(f"{p}: line {n}: not a kvload audit log (no {HEADER_EVENT} line)")
        version = header.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool) or version != AUDIT_SCHEMA_VERSION:
            raise AuditError(
                f"{p}: line {n}: schema_version {short(version)} is not supported "
                f"(this kvload reads {AUDIT_SCHEMA_VERSION}, an integer)"
            )
        written_by = header.get("kvload_version", "")  # printed by `kvload audit`: a list came out as Python's repr,
        # a 100,000-character string as one line of it
        if not isinstance(written_by, str) or len(written_by) > MAX_VERSION_CHARS:
            raise AuditError(f"{p}: line {n}: kvload_version {short(written_by)}: expected the version string of "
                             f"the kvload that wrote the log (at most {MAX_VERSION_CHARS} characters)")

    def finish(self, cls: type[AuditLog]) -> AuditLog:
        """The log read, or the error that makes the file unusable."""
        if self.parse_error is not None:
            raise self.parse_error
        if self.header is None and self.problem is None:  # 0 bytes, or only blank lines: nothing to read either way
            raise AuditError(f"{self.p}: empty file, expected a kvload audit log (JSON Lines)")
        if self.problem is not None:
            raise self.problem
        assert self.header is not None and self.chain is not None
        log = cls(self.events, header={k: v for k, v in self.header.items() if k != HEAD})
        log.chain = self.chain.verdict()
        log.dropped_at, log.dropped = self.dropped if self.dropped is not None else (None, 0)
        if self.keep is not None:
            log._digest = _Digest(self.count, self.seq_problem, self.calls)
        return log


#: The longest ``kvload_version`` a header may hold (kvload's own are a few characters: ``0.1.0``).
MAX_VERSION_CHARS = 64

#: The largest audit file read (a long generation logs a few hundred bytes per request).
MAX_AUDIT_BYTES = 512 * 1024 * 1024
#: The longest line of an audit file read (bytes, its newline included): kvload's records are a few hundred bytes
#: to a few KB (``pipeline_finished`` with its arguments ~1.5 KB; 4,096 stop token ids ~30 KB). Each line is read
#: with this bound, so a 400 MB line is refused after 8 MiB is read: whole, it took 1.6 GB of memory to refuse.
MAX_AUDIT_LINE_BYTES = 8 * 1024 * 1024


def _lines(p: Path) -> Iterator[tuple[int, str, bool]]:
    """(line number, line, whether it is an unterminated last line) for each line of the file, as ``splitlines`` of
    the whole text numbers them; read a line at a time. A line that is not UTF-8 is an ``AuditError`` there."""
    fd = open_regular(p, lambda problem: AuditError(f"{p}: {problem}"), tail=", expected an audit .jsonl file",
                      max_bytes=MAX_AUDIT_BYTES, too_big=f"larger than any kvload audit log ({MAX_AUDIT_BYTES:,})",
                      missing="audit file not found", what="audit file")
    try:
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    n = 0
    with f:
        for newlines, raw in enumerate(_raw_lines(p, f)):
            if len(raw) > MAX_AUDIT_LINE_BYTES:
                raise AuditError(f"{p}: line {n + 1}: longer than {MAX_AUDIT_LINE_BYTES:,} bytes, the longest line "
                                 "an audit log is read with (kvload's records are a few KB)")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:  # where: a log kvload wrote is UTF-8, so the bytes there were changed
                raise AuditError(f"{p}: line {newlines + 1}: not UTF-8 (byte 0x{raw[exc.start]:02x}); an audit log "
                                 "is JSON Lines in UTF-8") from None
            # splitlines also breaks at \r, \x0c, U+2028 ...: the numbering a whole-text read gave
            parts = text.splitlines()
            ends = text.endswith(("\n", "\r"))
            for i, part in enumerate(parts):
                n += 1
                yield n, part, i == len(parts) - 1 and not ends


def _raw_lines(p: Path, f: Any) -> Iterator[bytes]:
    """Each line of ``f`` with its newline, read at most ``MAX_AUDIT_LINE_BYTES + 1`` bytes at a time: a longer line
    comes back cut at that length, so the caller refuses it without reading the rest."""
    try:
        while raw := f.readline(MAX_AUDIT_LINE_BYTES + 1):
            yield raw
    except OSError as exc:
        raise AuditError(f"{p}: {cannot_read(exc, 'audit file')}") from None


def _parse_line(p: Path, n: int, line: str, last: bool) -> dict[str, Any]:
    """One line as a JSON object with an ``event`` key, or ``AuditError`` naming the file and line."""
    try:
        record = json.loads(line, object_pairs_hook=unique_keys(ValueError))
    except json.JSONDecodeError as exc:
        # the JSON ran out where the file did (or inside a string the cut left open)
        cut = last and (exc.pos >= len(line.rstrip()) or exc.msg.startswith("Unterminated string"))
        why = ("truncated (the last line is incomplete)" if cut
               else f"not JSON ({exc.msg} at column {exc.colno}); each line must be one JSON record")
        raise AuditError(f"{p}: line {n}: {why}") from None
    except RecursionError:
        raise AuditError(f"{p}: line {n}: nested too deeply to be an audit record") from None
    except ValueError as exc:  # a repeated key, an integer past Python's digit limit
        if "integer string conversion" in str(exc):
            raise AuditError(f"{p}: line {n}: a number is too long (over {sys.get_int_max_str_digits()} digits) "
                             "to be an audit value") from None
        raise AuditError(f"{p}: line {n}: {str(exc).splitlines()[0][:120]}") from None
    if not isinstance(record, dict) or "event" not in record:
        raise AuditError(f"{p}: line {n}: expected a JSON object with an 'event' key")
    if nesting_depth(record) > MAX_DEPTH:
        raise AuditError(f"{p}: line {n}: nested deeper than {MAX_DEPTH} levels; audit records nest a few")
    return record


def check_output_path(path: str | os.PathLike[str], flag: str = "audit log", replace: bool = True) -> Path:
    """Refuse an output path before any work: empty, a directory, a FIFO or device, an unwritable
    directory, or (unless ``replace``) a file that exists. ``ConfigError`` names ``flag``."""
    text = os.fspath(path)
    if text == "":
        raise ConfigError(f"{flag}: empty path, expected a file path")
    p = Path(text)
    try:
        st = p.stat()
    except FileNotFoundError:
        if os.path.lexists(p):
            raise ConfigError(f"{flag} {text}: is a symbolic link to nothing; give a file path") from None
        st = None
    except OSError as exc:
        raise ConfigError(f"{flag} {text}: cannot be used ({exc.strerror or exc.__class__.__name__})") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{flag} {text}: is a directory, expected a file path")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{flag} {text}: exists and is not a regular file (a FIFO, device or socket); "
                              "give a file path")
        if not replace:
            raise ConfigError(f"{flag} {text}: exists; pass --force to replace it, or choose another path")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {text}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {text}: directory {parent} is not writable")
    return p


def _temp_name(path: Path) -> str:
    """A hidden name beside ``path`` for the file that becomes ``path``: ``.NAME.<12 hex>.tmp``.

    NAME is cut short (in bytes, as the file system counts) when the whole would pass the directory's
    name limit, so every name the file system accepts for ``path`` can be written through a temporary.
    """
    parent, prefix = _temp_prefix(path)
    return str(parent / (prefix + f".{secrets.token_hex(6)}.tmp"))


#: The length of a temporary's tail after its prefix: ``.<12 hex>.tmp``.
_TEMP_TAIL = 1 + 12 + 4


def _temp_prefix(path: Path) -> tuple[Path, str]:
    """The folder of ``path``'s temporaries and their name up to the random tail: ``.NAME``, cut to the limit."""
    parent = path.parent if str(path.parent) else Path(".")
    try:
        limit = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    if limit is None or limit < 0:  # no limit: take the common one all the same
        limit = 255
    base = os.fsencode(path.name)[: max(1, limit - 1 - _TEMP_TAIL)]
    return parent, os.fsdecode(b"." + base)


def temporaries(path: str | Path) -> set[str]:
    """The temporaries (:func:`_temp_name`'s) beside ``path`` now: what a writer killed before publishing left."""
    parent, prefix = _temp_prefix(Path(path))
    pattern = re.compile(re.escape(prefix) + r"\.[0-9a-f]{12}\.tmp")
    with contextlib.suppress(OSError):
        return {str(parent / n) for n in os.listdir(parent) if pattern.fullmatch(n)}
    return set()


def remove_new_temporaries(path: str | Path, before: Collection[str]) -> None:
    """Remove the temporaries beside ``path`` that are not in ``before`` (:func:`temporaries` of the same ``path``
    before its writer started): what a writer that died with no cleanup (SIGKILL) left. One rule for the two who
    outlive such a writer: kvload's launcher for its ranks, and a rank for the ranks on its machine under torchrun
    (:func:`pipeline.ranks.remove_lost_peers_temporaries`). A temporary there before is not the writer's: it stays."""
    for name in temporaries(path) - set(before):
        with contextlib.suppress(OSError):  # gone already: the other rank left on this machine removed it first
            os.unlink(name)


def _not_written(flag: str, path: str | os.PathLike[str], exc: OSError) -> OutputError:
    """The one line for a file the OS refused at any step (creating, writing, publishing): ``path`` as it was."""
    return OutputError(f"{flag} {os.fspath(path)}: cannot write it ({exc.strerror or exc}); nothing was written")


def _create_temp(path: Path, flag: str) -> tuple[str, int]:
    """Create the temporary beside ``path`` (mode 0666 less the umask); its name and an open descriptor.
    ``ConfigError`` naming ``flag`` when the directory takes no new file, ``OutputError`` when the disk is full (no
    inode left) or past a quota. Call under :func:`deferred`."""
    name = _temp_name(path)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as exc:
        if out_of_space(exc):  # no inode left, a quota: the full disk's line, as when it shows mid-write (exit 1)
            # (from exc: a caller that had published this path before says what the file still holds)
            raise _not_written(flag, path, exc) from exc
        parent = path.parent if str(path.parent) else Path(".")
        raise ConfigError(f"{flag} {path}: cannot create a file in {parent} "
                          f"({exc.strerror or exc.__class__.__name__})") from None
    return name, fd


def _publish(tmp: str, path: Path, flag: str, *, replace: bool) -> None:
    """Move the written temporary onto ``path``; without ``replace``, never over a file that exists. ``OutputError``
    naming ``flag`` when the OS refuses the move (a directory that needs a new block on a full disk, a quota, a folder
    made read-only meanwhile): ``path`` keeps what it held, and the caller removes the temporary."""
    try:
        if replace:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)  # atomic, and never over a file that exists
        except FileExistsError:
            raise ConfigError(f"{flag} {path}: appeared while the run was going; not replaced "
                              "(pass --force to replace it)") from None
        except OSError as exc:
            if out_of_space(exc):  # no room for the new entry: the rename below needs one as well
                raise
            if os.path.lexists(path):  # a filesystem without hard links
                raise ConfigError(f"{flag} {path}: exists; pass --force to replace it") from None
            os.replace(tmp, path)
    except OSError as exc:  # a raw OSError named neither the file nor the flag (from exc: as _create_temp's)
        raise _not_written(flag, path, exc) from exc


@contextmanager
def atomic_output(path: str | os.PathLike[str], flag: str, *, replace: bool = True) -> Iterator[str]:
    """Yield the path of an empty temporary beside ``path`` to write; publish it on a clean exit, remove it
    otherwise. A failed write (a full disk) becomes ``OutputError`` naming ``flag`` (exit 1); ``path``
    keeps what it held before, and no temporary is left. ``replace=False`` as :class:`JsonlSink`'s."""
    target = Path(path)
    with deferred():  # no signal between creating the file and remembering to remove it
        tmp, fd = _create_temp(target, flag)
        os.close(fd)
    try:
        try:
            yield tmp
        except OSError as exc:
            raise _not_written(flag, target, exc) from None
        with deferred():
            _publish(tmp, target, flag, replace=replace)
    finally:
        with deferred():
            if os.path.lexists(tmp):
                os.unlink(tmp)


class JsonlSink:
    """Streams records to a JSON Lines file; the file appears only when the run closes cleanly.

    Lines go to a temporary file beside the target, published by ``close(ok=True)`` and removed by
    ``close(ok=False)``, so a failed or interrupted run never leaves a half-written audit behind.
    Records are hash-chained (:mod:`pipeline.audit_chain`; keyed by ``KVLOAD_AUDIT_KEY`` when set).
    ``replace=False`` refuses to publish over a file that exists (checked again at publication, so
    a file created meanwhile is not clobbered either). Files are created with mode 0666 less the
    umask, as any file the user creates.
    """

    def __init__(self, path: str | os.PathLike[str], *, replace: bool = True, flag: str = "audit log",
                 key: object = ..., wait: Callable[[], bool] | None = None) -> None:
        self.path = Path(path)
        # while wait() is true the records stay in memory and no temporary exists: a rank under torchrun before the
        # ranks met (pipeline.ranks.peers_met), when a SIGKILL would leave a temporary no other rank knows to remove
        self._wait = wait
        self._early: list[dict[str, Any]] = []
        self.replace = replace
        self.flag = flag
        self._chain = Chain(audit_key() if key is ... else key)  # type: ignore[arg-type]
        self._file: Any = None
        self._tmp: str | None = None
        self._pending: dict[str, Any] | None = None
        self._closed = False
        self._failed: OSError | None = None  # a write that failed (a full disk): reported, file discarded, at close
        self._on_failure: Callable[[OSError], None] | None = None

    @property
    def failed(self) -> OSError | None:
        """The write the OS refused (a full disk), if one did: the file was then discarded at close."""
        return self._failed

    def _open(self) -> None:
        with deferred():  # no signal between creating the file and remembering to remove it
            self._tmp, fd = _create_temp(self.path, self.flag)
            self._file = os.fdopen(fd, "w", encoding="utf-8")
        self._hold({**header_record(), "chain": self._chain.kind})
        early, self._early, self._wait = self._early, [], None
        for record in early:
            self._hold(record)

    def _hold(self, record: dict[str, Any]) -> None:
        """Write the record held back, then hold this one (the last record is sealed at close)."""
        head = self._chain.head
        if head is not None:
            record = {**record, PREV: head}
        self._chain.link(record)  # first: should it raise, the record held back is still held, not written twice
        if self._pending is not None and self._failed is None:
            try:
                self._file.write(_dumps(self._pending) + "\n")
            except OSError as exc:
                # raising here would fail whichever stage emitted the record, with the OS's words and no flag;
                # the run goes on and close() refuses to publish, naming the flag and the path
                self._failed = exc
                if self._on_failure is not None:
                    self._on_failure(exc)
        self._pending = record

    def watch(self, on_failure: Callable[[OSError], None]) -> None:
        """Call ``on_failure(error)`` at the first write that fails (at once when one already has): a server runs for
        days, and learning only at its stop that the audit was lost since the disk filled is too late."""
        self._on_failure = on_failure
        if self._failed is not None:
            on_failure(self._failed)

    def __call__(self, record: dict[str, Any]) -> None:
        if self._file is None:
            if self._wait is not None and self._wait():
                self._early.append(record)
                return
            self._open()
        self._hold(record)

    def close(self, ok: bool = True) -> None:
        """Publish the file (``ok``) or discard it; ``ConfigError`` when the target appeared meanwhile."""
        if self._closed:
            return
        if self._file is None:
            if not ok:
                self._early.clear()
                return
            self._open()
        with deferred():
            try:
                try:
                    if ok and self._failed is None:
                        self._file.write(_dumps({**self._pending, HEAD: self._chain.head}) + "\n")
                    self._file.close()  # flushes: where a full disk usually shows
                except OSError as exc:
                    self._failed = self._failed or exc
                if ok and self._failed is not None:
                    raise _not_written(self.flag, self.path, self._failed) from None
                if ok:
                    _publish(self._tmp, self.path, self.flag, replace=self.replace)
            finally:
                self._file, self._closed = None, True
                if self._tmp is not None and os.path.lexists(self._tmp):
                    os.unlink(self._tmp)
                self._tmp = None

    def __enter__(self) -> JsonlSink:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)
