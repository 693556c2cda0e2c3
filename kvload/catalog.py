"""What ``kvload models`` lists: registered architectures, their spec class and model defaults, and presets.

Defaults are read by calling each spec's ``get_model_defaults`` with a frozen default ``LlmArgs``
and no checkpoint config, then checked by the same rules ``apply_model_defaults`` applies. A spec
that fails (or whose defaults depend on the checkpoint) is reported on its row, never fatal.
Neither torch nor transformers is imported.
"""

from __future__ import annotations

import json
from typing import Any

from pipeline.config import LlmArgs, freeze
from pipeline.errors import KvloadError, first_line
from pipeline.text import literal, table


def _defaults_of(spec_cls: type) -> tuple[dict[str, Any] | None, str | None]:
    """A spec's model defaults as dotted leaves, or the one-line reason they cannot be shown."""
    from stages.apply_model_defaults import validate_model_defaults

    view = freeze(LlmArgs(model="<model>"))
    try:
        proposed = spec_cls(None).get_model_defaults(view)
        return validate_model_defaults(proposed, spec_cls.__name__), None
    except KvloadError as exc:
        return None, str(exc)
    except Exception as exc:  # a user spec may read its checkpoint config, which a listing does not have
        detail = first_line(exc, "")
        raised = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
        return None, (f"{spec_cls.__name__}.get_model_defaults raised {raised} "
                      "(they may depend on the checkpoint; `kvload plan MODEL` shows them)")


def architectures() -> list[dict[str, Any]]:
    """One row per registered architecture name: spec class, module, defaults (or error)."""
    from models import registered

    rows = []
    cache: dict[type, tuple[dict[str, Any] | None, str | None]] = {}
    for arch, spec_cls in registered().items():
        if spec_cls not in cache:
            cache[spec_cls] = _defaults_of(spec_cls)
        defaults, error = cache[spec_cls]
        rows.append({
            "architecture": arch,
            "spec": spec_cls.__name__,
            "module": spec_cls.__module__,
            "model_defaults": defaults,
            "error": error,
            "supports_generation": bool(getattr(spec_cls, "supports_generation", False)),
        })
    return rows


def preset_rows() -> list[dict[str, Any]]:
    """The embedded presets with the architecture and model_type their config.json declares."""
    from models.checkpoint import PRESETS_DIR, presets

    rows = []
    for name in presets():
        try:
            data = json.loads((PRESETS_DIR / name / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            rows.append({"name": name, "architecture": None, "model_type": None, "error": type(exc).__name__})
            continue
        archs = data.get("architectures") or [None]
        rows.append({"name": name, "architecture": archs[0], "model_type": data.get("model_type"), "error": None})
    return rows


def catalog() -> dict[str, Any]:
    """The ``kvload models --json`` document."""
    from models import GenericDecoderSpec

    return {
        "architectures": architectures(),
        "fallback_spec": GenericDecoderSpec.__name__,
        "presets": preset_rows(),
    }




def render_catalog(doc: dict[str, Any]) -> str:
    """The readable ``kvload models`` listing."""

    rows = [["architecture", "spec", "model defaults"]]
    for row in doc["architectures"]:
        if row["error"]:
            rows.append([row["architecture"], row["spec"], f"error: {row['error']}"])
            continue
        leaves = list((row["model_defaults"] or {}).items())
        if not leaves:
            rows.append([row["architecture"], row["spec"], "(none)"])
            continue
        for i, (path, value) in enumerate(leaves):
            head = [row["architecture"], row["spec"]] if i == 0 else ["", ""]
            rows.append([*head, f"{path} = {literal(value)}"])
    rows.append(["(any other)", doc["fallback_spec"], "(none; geometry from config.json, with a warning)"])
    lines = ["registered architectures (architectures[0] of config.json picks the spec):", *table(rows)]
    prows = [["preset", "architecture", "model_type"]]
    prows += [[p["name"], p["architecture"] or f"(unreadable: {p['error']})", p["model_type"] or ""]
              for p in doc["presets"]]
    lines += ["", "presets (use the name as MODEL; or give a checkpoint directory):", *table(prows)]
    return "\n".join(lines)
