"""What a command prints: the result in one stdout write, a stdout the OS refuses as one error, the error text."""

from __future__ import annotations

import contextlib
import re
import sys
from typing import Any

from pipeline.errors import OutputError
from pipeline.text import one_line


def prints(result: Any) -> bool:
    """Whether this process prints the result: always alone; under torchrun only rank 0 (the others log)."""
    ranks = result.context.ranks
    return ranks is None or ranks.is_first


def print_result(text: str) -> None:
    """Print a command's result on stdout in one write, newline included.

    ``print(text)`` writes the newline on its own (PYTHONUNBUFFERED=1, or a text past Python's 8 KiB buffer): a
    reader that left after the first write (``| head``) made the second fail, so a document that fitted the pipe
    whole still ended in exit 141 about half the time. One write lands whole before the reader can leave.
    """
    sys.stdout.write(text + "\n")


def _drop_stdout() -> None:
    import os

    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


#: A run of non-space characters longer than this in an error line is cut to its ends: a 100,000-character flag
#: value, model name or config value was quoted whole, a 100 KB error line.
_LONGEST_RUN = 300


def error_text(text: str) -> str:
    """``text`` as one printable line (:func:`one_line`), each overlong run of non-space characters cut to its ends."""
    def cut(match: re.Match[str]) -> str:
        run = match.group(0)
        return f"{run[:100]}...({len(run) - 120:,} characters cut)...{run[-20:]}"

    return re.sub(rf"\S{{{_LONGEST_RUN + 1},}}", cut, one_line(text))


class ResultStream:
    """``sys.stdout`` while a command runs: a write or flush the OS refuses (a full disk, a closed descriptor, an I/O
    error) becomes one ``OutputError`` naming stdout (exit 1), where it was ``OSError: [Errno 28] ...`` or, with
    stdout closed at start (``kvload plan ... >&-``: Python's ``sys.stdout`` is None), an ``AttributeError``. A
    closed pipe stays ``BrokenPipeError``, which ``_main`` reports as exit 141."""

    def __init__(self, stream: Any, unwritten: str, what: str = "the result") -> None:
        self._stream = stream
        self._unwritten = unwritten  # what the error line adds: the --audit-log not written
        self._what = what  # what was to be written: the result, the help, the version
        self._open_line = False  # whether what was written ends inside a line (a reply streaming token by token)

    def _failed(self, exc: OSError | None) -> OutputError:
        if exc is None:
            return OutputError(f"stdout is closed, so {self._what} cannot be written (redirect it to a file or "
                               f"/dev/null instead of closing it){self._unwritten}")
        _drop_stdout()  # what the buffer still holds would fail again in the interpreter's last flush (exit 120)
        reason = exc.strerror or type(exc).__name__
        return OutputError(f"stdout: cannot write {self._what} ({reason}){self._unwritten}")

    def write(self, text: str) -> int:
        """The stream's ``write``; an OS failure (not a closed pipe) as one ``OutputError``."""
        if self._stream is None:
            raise self._failed(None)
        try:
            written = self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise self._failed(exc) from exc
        if text:
            self._open_line = not text.endswith("\n")
        return written

    def end_line(self) -> None:
        """Before an error line: end a line left open on a terminal (a reply a signal or a failure cut short), so
        ``error: ...`` starts its own line instead of trailing the last token; a file or pipe is left as written."""
        if not self._open_line or self._stream is None:
            return
        self._open_line = False
        with contextlib.suppress(OSError, ValueError):  # the terminal may be gone (a hangup): the status tells
            if self._stream.isatty():
                self._stream.write("\n")
                self._stream.flush()

    def flush(self) -> None:
        """The stream's ``flush``; an OS failure (not a closed pipe) as one ``OutputError``."""
        if self._stream is None:
            return
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise self._failed(exc) from exc

    def __getattr__(self, name: str) -> Any:
        if self._stream is None:
            raise self._failed(None)
        return getattr(self._stream, name)
