"""Find a checkpoint (embedded preset or local directory) and read its config through transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from pipeline.errors import ModelError

PRESETS_DIR = Path(__file__).parent / "presets"


@attrs.frozen
class Checkpoint:
    """Where a model's config (and later its weights) live."""

    name: str
    kind: str  # "preset" | "directory"
    path: Path

    def to_dict(self) -> dict[str, str]:
        """JSON form for events and ``--json`` output."""
        return {"name": self.name, "kind": self.kind, "path": str(self.path)}


def presets() -> list[str]:
    """Names of the embedded presets."""
    return sorted(p.name for p in PRESETS_DIR.iterdir() if (p / "config.json").is_file())


def _looks_like_path(name: str) -> bool:
    return "/" in name or name.startswith((".", "~")) or Path(name).suffix in (".json", ".gguf")


def resolve_checkpoint(name: str) -> Checkpoint:
    """Map a model argument to a preset or a local checkpoint directory; ``ModelError`` otherwise."""
    path = Path(name).expanduser()
    if path.exists():
        if path.is_file():
            raise ModelError(f"model {name!r}: is a file; give the checkpoint directory that holds config.json")
        if not (path / "config.json").is_file():
            raise ModelError(f"model {name!r}: directory has no config.json")
        return Checkpoint(name, "directory", path.resolve())
    if name in presets():
        return Checkpoint(name, "preset", PRESETS_DIR / name)
    if _looks_like_path(name):
        raise ModelError(f"model {name!r}: no such directory")
    raise ModelError(
        f"model {name!r}: not a preset or a directory; presets: {', '.join(presets())} (or give a checkpoint directory)"
    )


def read_config_json(path: Path) -> dict[str, Any]:
    """Parse ``config.json`` ourselves first so a malformed file gets a message with line and column."""
    file = path / "config.json"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelError(f"{file}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelError(f"{file}: cannot read ({exc.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{file}: expected a JSON object, got {type(data).__name__}")
    if not isinstance(data.get("model_type"), str):
        raise ModelError(f"{file}: no 'model_type' key; transformers needs it to pick the config class")
    archs = data.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ModelError(f"{file}: 'architectures' must be a list of class names, got {archs!r}")
    return data


def load_hf_config(checkpoint: Checkpoint) -> Any:
    """Read the config through ``transformers.AutoConfig`` (never ``trust_remote_code``)."""
    raw = read_config_json(checkpoint.path)
    from transformers import AutoConfig  # deferred: importing transformers costs seconds

    try:
        return AutoConfig.from_pretrained(str(checkpoint.path), trust_remote_code=False, local_files_only=True)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise ModelError(
            f"{checkpoint.path / 'config.json'}: transformers cannot load model_type {raw['model_type']!r}: {first}"
        ) from exc
