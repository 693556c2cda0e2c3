"""Typed errors: each one is a single line that says what was wrong, where, and what is accepted."""

from __future__ import annotations

import difflib
import errno
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


#: How near a mistyped name must come to a known one (difflib's ratio, case, ``-``/``_`` and leading dashes aside)
#: to be offered. One cutoff for every "did you mean" (the callers had 0.5, 0.6, 0.7 and 0.75): at 0.6 ``--quiet``
#: was offered ``--requests`` and ``--verbos`` ``--version``; 0.7 keeps the one-letter slips and the swapped or
#: doubled letters, and an abbreviation is met by the names it begins (:func:`close_names`).
SUGGEST_CUTOFF = 0.7

#: The most names a prefix is answered with (``--api``: ``--api-key or --api-server-count``); more is no suggestion.
MAX_PREFIXED = 3


def _spelling(name: str) -> str:
    """A name as it is compared: case, ``-`` for ``_`` and dashes at either end aside (``Tiny_Llama`` is ``tiny-llama``;
    ``--quiet`` is not near ``--requests`` for the ``--`` both begin with)."""
    return name.lower().replace("-", "_").strip("_")


def _spellings(known: Iterable[str]) -> dict[str, list[str]]:
    """The known names by :func:`_spelling`, each with its spellings sorted (``--max-tokens``, ``--max_tokens``)."""
    grouped: dict[str, list[str]] = {}
    for name in sorted(set(known)):
        grouped.setdefault(_spelling(name), []).append(name)
    return grouped


def _as_typed(name: str, spellings: list[str]) -> str:
    """Of one name's spellings, the one nearest the user's (``--api_keyy``: ``--api_key``); on a tie the last sorted,
    the underscored."""
    return max(reversed(spellings), key=lambda s: difflib.SequenceMatcher(None, name, s).ratio())


def prefixed(name: str, known: Iterable[str]) -> list[str]:
    """The known names ``name`` begins (case and ``-``/``_`` aside), one spelling each, sorted."""
    return _prefixed(name, _spellings(known))


def _prefixed(name: str, grouped: dict[str, list[str]]) -> list[str]:
    key = _spelling(name)
    return [_as_typed(name, group) for spelling, group in grouped.items() if spelling.startswith(key)]


def close_names(name: str, known: Iterable[str]) -> list[str]:
    """The known names a mistyped ``name`` most likely meant, best first (empty: none near): the one, or the few, it
    begins (argparse's prefix matching expanded a unique one), else the nearest within :data:`SUGGEST_CUTOFF`, case
    and ``-``/``_`` aside."""
    if not _spelling(name) or len(name) > 100:  # no name is that long, and difflib's time grows with it
        return []
    grouped = _spellings(known)
    begun = _prefixed(name, grouped)
    if 0 < len(begun) <= MAX_PREFIXED and _spelling(name) not in grouped:
        return begun
    close = difflib.get_close_matches(_spelling(name), list(grouped), n=1, cutoff=SUGGEST_CUTOFF)
    return [_as_typed(name, grouped[c]) for c in close]


def did_you_mean(name: str, known: Iterable[str], quote: bool = True) -> str:
    """``"; did you mean 'temperature'?"`` (or ``'top_k' or 'top_p'``) for a mistyped name near one of ``known``
    (else ""), to end its refusal with: the list of every field alone left the user to spot the one they meant.
    ``quote=False`` writes the names bare, as the command line's options stand in its error line."""
    close = close_names(name, known)
    if not close:
        return ""
    return f"; did you mean {' or '.join(repr(c) if quote else c for c in close)}?"


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


#: The OS's "no room": a full disk (or no inode left) and a quota. Outside the settings wherever it shows, so a write
#: that meets it is :class:`OutputError` (exit 1), whether the file was being created or written; a path the user
#: gave that cannot be written (permissions, a file where a folder should be) stays exit 2 naming the path.
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` is the OS refusing a write for want of space or quota (:data:`NO_SPACE_ERRNOS`)."""
    return isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS


def opening_error(exc: BaseException) -> type[KvloadError]:
    """What a file the user named that cannot be opened for writing raises: :class:`OutputError` (exit 1) for a full
    disk or quota (:func:`out_of_space`), else :class:`ConfigError` (exit 2), the path refused."""
    return OutputError if out_of_space(exc) else ConfigError


class GenerationError(KvloadError, ValueError):
    """A generate call cannot run as asked: a bad prompt or sampling value, a result without weights, closed pools."""


class AuditError(KvloadError):
    """An audit log file is unreadable, truncated or from an unknown schema."""


class RankError(KvloadError):
    """The ranks of a tensor-parallel run do not match: the launch and the settings, or what each rank resolved."""


class RankLostError(RankError):
    """Another rank's process went away mid-run (it exited or was killed): not the settings, so exit 1."""

    exit_code = 1
