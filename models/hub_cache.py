"""Hugging Face model ids resolved through the local Hugging Face cache only: kvload never downloads.

``resolve_checkpoint`` asks here for a name that is neither a path, a preset nor a packaged model.
``huggingface_hub.snapshot_download(..., local_files_only=True)`` finds the cached snapshot of the
repository's default revision (or of ``id@revision``) without touching the network. The cache
directory follows huggingface_hub's own precedence, read when the lookup happens (not when the
library was imported): ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``XDG_CACHE_HOME/huggingface/hub``,
else ``~/.cache/huggingface/hub``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from models.user_paths import expand_user

#: ``org/name`` or ``name``, with an optional ``@revision``: what the Hub accepts as a model id.
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}(?:@[\w./-]+)?$")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache this process would use, from the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return expand_user(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return expand_user(os.environ["HF_HOME"]) / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = expand_user(xdg) if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def cache_setting_problem() -> str | None:
    """The environment variable that places the hub cache (the first of ``HF_HUB_CACHE``, ``HF_HOME``,
    ``XDG_CACHE_HOME`` set) when it names something that is not a directory, as "VAR='value' is not a
    directory"; None otherwise (a cache that does not exist yet is no problem: it is only empty)."""
    from pipeline.limits import short_text

    for var in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        value = os.environ.get(var)
        if value:
            path = expand_user(value)
            if os.path.lexists(path) and not path.is_dir():
                return f"{var}={short_text(value, 300)} is not a directory"
            return None
    return None


def looks_like_model_id(name: str) -> bool:
    """Whether ``name`` could be a Hugging Face model id (``org/name``, ``name``, optional ``@rev``)."""
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith((".json", ".gguf"))


def repo_folder(cache: Path, repo_id: str) -> Path:
    """Where huggingface_hub keeps a model repository inside ``cache`` (``models--org--name``)."""
    return cache / ("models--" + repo_id.replace("/", "--"))


def cached_snapshot(name: str) -> tuple[Path | None, Path]:
    """(snapshot directory or None, the repository folder looked in) for a model id; never downloads."""
    repo_id, _, revision = name.partition("@")
    cache = hub_cache_dir()
    folder = repo_folder(cache, repo_id)
    if not folder.is_dir():  # nothing cached: skip importing huggingface_hub at all
        return None, folder
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        path = snapshot_download(repo_id, revision=revision or None, cache_dir=str(cache), local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError, ValueError):
        return None, folder
    return Path(path), folder


#: How many cached revisions an error message names (the rest are counted).
_REVISIONS_SHOWN = 4
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def _ref_commit(ref: Path) -> str | None:
    """The commit a ``refs/<name>`` file names (a regular file holding 40 hex digits), else None."""
    try:
        if not ref.is_file():  # never open a FIFO or device planted there
            return None
        with ref.open("rb") as f:
            text = f.read(64).decode("ascii", "replace").strip()
    except OSError:
        return None
    return text if _COMMIT.match(text) else None


def cached_revisions(folder: Path) -> list[str]:
    """The revisions ``id@revision`` would find in a cached repository folder: its refs (branches, tags) whose
    snapshot is there, ``main`` first, then the snapshots no such ref names, by commit hash."""
    snapshots, refs_dir = folder / "snapshots", folder / "refs"
    refs: dict[str, str] = {}
    try:
        commits = sorted(p.name for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
        for ref in sorted(refs_dir.rglob("*")) if refs_dir.is_dir() else ():
            commit = _ref_commit(ref)
            if commit is not None and commit in commits:
                refs[ref.relative_to(refs_dir).as_posix()] = commit
    except OSError:  # an unreadable folder: name nothing rather than fail the error message
        return []
    named = sorted(refs, key=lambda name: (name != "main", name))
    return named + [c for c in commits if c not in refs.values()]


def missing_revision(name: str, folder: Path) -> str:
    """Why ``name`` (``id`` or ``id@revision``) found no snapshot in its cached repository ``folder``, which
    exists: the revision asked for, the revisions that are cached, and how to get it (one line)."""
    repo_id, _, revision = name.partition("@")
    asked = f"revision {revision!r}" if revision else "its default revision 'main'"
    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    revisions = cached_revisions(folder)
    commit = revision if _COMMIT.match(revision) else _ref_commit(folder / "refs" / (revision or "main"))
    if commit is not None and (folder / "snapshots" / commit).is_dir():  # there, but huggingface_hub refused it
        return (f"model {name!r}: {repo_id} is in the local Hugging Face cache ({folder}) but {asked} is "
                f"incomplete (snapshots/{commit} lacks files: an interrupted download?); kvload never downloads: "
                f"complete it first ({fetch})")
    if revisions:
        shown = ", ".join(revisions[:_REVISIONS_SHOWN])
        if len(revisions) > _REVISIONS_SHOWN:
            shown += f" and {len(revisions) - _REVISIONS_SHOWN} more"
        held = f"cached revisions: {shown}"
        pick = f" or name a cached one ({repo_id}@{revisions[0]})"
    else:
        held = "no snapshot of it is (an interrupted download?)"
        pick = ""
    return (f"model {name!r}: {repo_id} is in the local Hugging Face cache ({folder}) but {asked} is not; "
            f"{held}; kvload never downloads: fetch it first ({fetch}){pick}")
