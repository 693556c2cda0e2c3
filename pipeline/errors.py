"""Typed errors: each one is a single line that says what was wrong, where, and what is accepted."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence


def first_line(exc: BaseException, default: str | None = None) -> str:
    """The first line of an exception's message; ``default`` (else the class name) when it has none.

    A first line that ends in ``:`` only introduces the reason (transformers' "Class validation error for
    validator 'validate_architecture':"), so the next non-empty line is joined to it: one line, with the why.
    """
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return default if default is not None else type(exc).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean 'temperature'?"`` for a mistyped keyword close to one of ``known`` (else ""), to end its
    refusal with: the list of every field alone left the user to spot the one they meant."""
    if len(name) > 100:  # no field is that long, and difflib's time grows with it
        return ""
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def unknown_argument(call: str, name: str, known: Sequence[str], what: str = "arguments") -> str:
    """``"embed: unknown argument 'pooling_param'; arguments are ...; did you mean 'pooling_params'?"``: a keyword the
    call does not take, in one line (Python's TypeError named no close name)."""
    return f"{call}: unknown argument {name[:80]!r}; {what} are {', '.join(known)}{did_you_mean(name, known)}"


def retitled(message: str, call: str) -> str:
    """``message`` titled by the call the user made (``chat:``, ``beam_search:``) where the shared executor titled
    it ``generate:``; any other message, and ``generate``'s own, unchanged."""
    if call != "generate" and message.startswith("generate: "):
        return f"{call}: {message.removeprefix('generate: ')}"
    return message


def cannot_read(exc: OSError, what: str = "") -> str:
    """'cannot read (permission denied)', 'cannot read WHAT (Too many levels of symbolic links)', ...: the OS's
    words, one line, for a message that names the file before it."""
    reason = "permission denied" if isinstance(exc, PermissionError) else exc.strerror or exc.__class__.__name__
    return f"cannot read {what} ({reason})" if what else f"cannot read ({reason})"


class KvloadError(Exception):
    """Base of every error kvload raises on purpose; its message is one line for the user."""

    exit_code = 2


class ConfigError(KvloadError, ValueError):
    """A configuration value, key, flag or file is not acceptable.

    ``path`` is the dotted field path when one field is to blame, ``detail`` the message without
    it, so the CLI can name its own flag instead of the path.
    """

    def __init__(self, message: str, *, path: str | None = None, detail: str | None = None,
                 source: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.detail = detail if detail is not None else message
        self.source = source


class ModelError(KvloadError):
    """A checkpoint, preset or model spec cannot be used."""


class RouteError(KvloadError):
    """The resolved arguments ask for an executor the model or the settings cannot have."""


class KvBuildError(KvloadError):
    """The KV cache manager cannot be built from these settings (budget, geometry, device)."""


class KvRuntimeError(KvBuildError):
    """Building or running failed for a reason outside the settings (out of memory, a device fault)."""

    exit_code = 1


class OutputError(KvloadError):
    """A file the run writes could not be written (a full disk, a quota): outside the settings, so exit 1."""

    exit_code = 1


class GenerationError(KvloadError, ValueError):
    """A generate call cannot run as asked: a bad prompt or sampling value, a result without weights, closed pools."""


class AuditError(KvloadError):
    """An audit log file is unreadable, truncated or from an unknown schema."""


class RankError(KvloadError):
    """The ranks of a tensor-parallel run do not match: the launch and the settings, or what each rank resolved."""


class RankLostError(RankError):
    """Another rank's process went away mid-run (it exited or was killed): not the settings, so exit 1."""

    exit_code = 1
