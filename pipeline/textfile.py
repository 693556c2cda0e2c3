"""Reading a small text file a user named (a YAML config, a JSON schema, a grammar): every problem one line."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from pipeline.errors import cannot_read


def read_opened(path: Path, fd: int, limit: int) -> bytes:
    """At most ``limit`` bytes of the file ``path`` opened as ``fd``, from where it stands to its end (the one read of a
    user's text file: a test that changes the file right after it is read hooks this)."""
    chunks = []
    while limit > 0 and (chunk := os.read(fd, min(limit, 1 << 20))):
        chunks.append(chunk)
        limit -= len(chunk)
    return b"".join(chunks)


def read_text_file(path: Path, fail: Callable[[str], Exception], *, expected: str, max_chars: int, too_big: str,
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
    # Then opened once, and checked and read through that one descriptor: checked by path and read by path again, a
    # file swapped in between (a FIFO: read_bytes waited for a writer forever; a link to /dev/zero: read without end)
    # was read unchecked. O_NONBLOCK: opening a FIFO does not wait for a writer (it is refused below).
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise fail("not found (it was removed while being read)") from None
    except IsADirectoryError:  # where a directory cannot be opened for reading at all
        raise fail(f"is a directory, expected {expected}") from None
    except OSError as exc:
        raise fail(cannot_read(exc)) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise fail(f"is a directory, expected {expected}")
        if not stat.S_ISREG(st.st_mode):
            raise fail(f"not a regular file (a FIFO or device?); give {expected}")
        if st.st_size > 4 * max_chars:  # before reading: a huge (or sparse) file would be read into memory whole
            raise fail(f"{st.st_size:,} bytes; {too_big}")
        try:  # a file grown since fstat is read no further than the bound
            raw = read_opened(path, fd, 4 * max_chars + 1)
        except OSError as exc:
            raise fail(cannot_read(exc)) from None
    finally:
        os.close(fd)
    if len(raw) > 4 * max_chars:
        raise fail(f"more than {4 * max_chars:,} bytes; {too_big}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail(f"not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}){utf8_hint}") from None
    if len(text) > max_chars:
        raise fail(f"{len(text):,} characters; {too_big}")
    return text


__all__ = ["read_opened", "read_text_file"]
