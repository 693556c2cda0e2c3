"""Test support for JSON-schema checks against xgrammar itself: what its C++ log writes, and what it compiles."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def stderr_fd() -> Iterator[list[str]]:
    """What is written to file descriptor 2 inside the block (xgrammar's C++ log writes there, not to sys.stderr)."""
    seen: list[str] = []
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield seen
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            seen.append(sink.read().decode("utf-8", "replace"))


def compiled(spec: str, warning: str) -> tuple[str, int]:
    """xgrammar's grammar of the schema text ``spec`` (or its refusal) and how many times its log said ``warning``."""
    import xgrammar as xgr

    with stderr_fd() as err:
        try:
            grammar = str(xgr.Grammar.from_json_schema(spec))
        except Exception as exc:  # a refusal is compared as text
            grammar = "refused: " + str(exc).splitlines()[0].split(": ", 1)[-1]
    return grammar, err[0].count(warning)
