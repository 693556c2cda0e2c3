"""Paths a user typed (a model argument, ``--generation_config``, ``HF_HOME``): ``~`` expanded as a shell does."""

from __future__ import annotations

from pathlib import Path


def expand_user(text: str) -> Path:
    """``text`` as a path with a leading ``~`` or ``~user`` expanded; left as it is, as a shell leaves it, when that
    user has no home (``Path.expanduser`` raises RuntimeError there: a model ``~nosuchuser/ckpt`` failed as
    "apply_model_defaults: RuntimeError: Could not determine home directory.", naming no argument)."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        return Path(text)


__all__ = ["expand_user"]
