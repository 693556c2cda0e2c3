"""Fail ``import kvload`` with a clear message when a project's own package hides one of kvload's.

kvload ships its layers as top-level packages beside ``kvload`` (``models``, ``pipeline``, ``stages``,
``engine``, ``cache_backends``). A project that has its own regular package of one of those names
on ``sys.path`` before kvload's (a ``models/__init__.py`` next to the script being run, or in the
working directory under ``python -m``) would otherwise make kvload import the project's code and fail
somewhere deep with an unrelated error. Checked with ``importlib.util.find_spec``, which imports nothing.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

#: kvload's top-level packages besides ``kvload`` itself (tests/test_layers.py lists the same layers).
SIBLINGS = ("engine", "stages", "pipeline", "models", "cache_backends")


def check_top_level_packages() -> None:
    """Raise ``ImportError`` naming the package and the directory that hides kvload's own."""
    home = Path(__file__).resolve().parent.parent
    for name in SIBLINGS:
        spec = importlib.util.find_spec(name)
        where = Path(spec.origin).resolve().parent if spec is not None and spec.origin else None
        if where is None or where.parent != home:
            found = f"{where}" if where is not None else "nothing importable"
            raise ImportError(
                f"kvload cannot import its own top-level package {name!r}: {found} comes first on sys.path "
                f"(kvload's is {home / name}). kvload installs {', '.join(SIBLINGS)} as top-level packages; "
                f"rename your project's {name!r} package, or run from a directory that does not hold it")


def run_as_the_command() -> bool:
    """Whether this process is ``python -m kvload`` (or ``kvload.cli``), whose start is this package's import: a
    refusal there is the command's one line, not the traceback runpy prints for an import that failed."""
    argv = getattr(sys, "orig_argv", [])
    return sys.argv[:1] == ["-m"] and "-m" in argv and argv[argv.index("-m") + 1:][:1] in (["kvload"], ["kvload.cli"])
