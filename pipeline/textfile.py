"""Reading a file a user named (a YAML config, a JSON schema, a model's JSON, a chat template, an audit log): opened
first, then checked and read through that one descriptor; every problem one line.

Checked by path and opened by path again, a file swapped in between was read unchecked (a FIFO: the open or the read
waited for a writer for ever; a link to /dev/zero: read without end). ``O_NONBLOCK``: opening a FIFO does not wait for
a writer (it is refused after the ``fstat``); the flag is cleared before a regular file is read.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from pipeline.errors import cannot_read

#: Turns a one-line problem ("not found", "is a directory; give a YAML file") into the caller's error.
Fail = Callable[[str], Exception]


def read_opened(path: str | os.PathLike[str], fd: int, limit: int) -> bytes:
    """At most ``limit`` bytes of the file ``path`` opened as ``fd``, from where it stands to its end (the one read of a
    user's file: a test that changes the file right after it is read hooks this)."""
    chunks = []
    while limit > 0 and (chunk := os.read(fd, min(limit, 1 << 20))):
        chunks.append(chunk)
        limit -= len(chunk)
    return b"".join(chunks)


def open_regular(path: str | os.PathLike[str], fail: Fail, *, tail: str, max_bytes: int | None = None,
                 too_big: str = "", missing: str | None = "not found", what: str = "") -> int:
    """A blocking descriptor of the regular file ``path`` (the caller closes it), or ``fail(problem)`` raised: not
    found (``missing``; ``None`` lets ``FileNotFoundError`` through), a symbolic link to nothing, a directory, a FIFO
    or device (``tail``, such as ``"; give a YAML file"``, says what to give), unreadable (``cannot_read`` of
    ``what``), or over ``max_bytes`` by its size (``too_big`` says the limit)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        if os.path.lexists(path):
            raise fail(f"is a symbolic link to nothing{tail}") from None
        if missing is None:
            raise
        raise fail(missing) from None
    except IsADirectoryError:  # where a directory cannot be opened for reading at all
        raise fail(f"is a directory{tail}") from None
    except OSError as exc:  # no permission, a symbolic link loop, a name too long, a socket ...
        raise fail(cannot_read(exc, what)) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise fail(f"is a directory{tail}")
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the read for ever, a device never ends
            raise fail(f"not a regular file (a FIFO or device?){tail}")
        if max_bytes is not None and st.st_size > max_bytes:  # before reading: a huge (or sparse) file
            raise fail(f"{st.st_size:,} bytes; {too_big}")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike[str], fail: Fail, *, tail: str, max_bytes: int, too_big: str,
                 missing: str | None = "not found", what: str = "") -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them, or ``fail(problem)`` raised as
    :func:`open_regular` says (and for a read that fails, or a file grown past ``max_bytes`` since it was checked)."""
    fd = open_regular(path, fail, tail=tail, max_bytes=max_bytes, too_big=too_big, missing=missing, what=what)
    try:
        try:  # a file grown since the fstat is read no further than the bound
            raw = read_opened(path, fd, max_bytes + 1)
        except OSError as exc:
            raise fail(cannot_read(exc, what)) from None
    finally:
        os.close(fd)
    if len(raw) > max_bytes:
        raise fail(f"more than {max_bytes:,} bytes; {too_big}")
    return raw


def read_text_file(path: Path, fail: Fail, *, expected: str, max_chars: int, too_big: str,
                   utf8_hint: str = "") -> str:
    """The UTF-8 text of the regular file ``path``, at most ``max_chars`` characters; otherwise ``fail(problem)``
    is raised, ``problem`` one line: not found, a dangling link, a directory or FIFO (``expected`` says what to give),
    unreadable, too big (``too_big`` says the limit; a file over four bytes a character is refused before it is read
    into memory), or not UTF-8 (``utf8_hint`` appended)."""
    try:  # Path.exists/is_file raise PermissionError on Python 3.11 (a directory the user cannot search)
        path.stat()
    except FileNotFoundError:
        raise fail(f"is a symbolic link to nothing; give {expected}" if os.path.lexists(path) else "not found") \
            from None
    except OSError as exc:
        raise fail(cannot_read(exc)) from None
    raw = read_regular(path, fail, tail=f"; give {expected}", max_bytes=4 * max_chars, too_big=too_big,
                       missing="not found (it was removed while being read)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail(f"not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}){utf8_hint}") from None
    if len(text) > max_chars:
        raise fail(f"{len(text):,} characters; {too_big}")
    return text


__all__ = ["Fail", "open_regular", "read_opened", "read_regular", "read_text_file"]
