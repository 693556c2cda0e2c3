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

#: ``org/name`` or ``name``, with an optional ``@revision``: what the Hub accepts as a model id.
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}(?:@[\w./-]+)?$")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache this process would use, from the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


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
