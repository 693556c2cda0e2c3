"""What ``kvload models`` lists: registered architectures, their spec class and model defaults, and every
preset and packaged model with what kvload can do with it (plan, build, generate).

What a model supports is derived, never tabulated: its spec reads the layer geometry from its config,
the manager registry says which kinds can hold it (``v2_required_reason``), and the paged attention's
served kinds say whether it generates: the same rules ``route_executor`` and the executor apply.

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
        })
    return rows


def _support_row(name: str, kind: str, data: dict[str, Any], note: str | None = None) -> dict[str, Any]:
    """What kvload can do with one model, by the rules the stages and the executor apply to its config."""
    from cache_backends.kinds import KINDS
    from cache_backends.layout import SERVED_KINDS, unserved_kinds
    from models import GenericDecoderSpec, spec_class_for
    from models.config_view import ConfigView

    archs = data.get("architectures") or [None]
    row: dict[str, Any] = {"name": name, "kind": kind, "architecture": archs[0], "model_type": data.get("model_type"),
                           "spec": None, "layer_kinds": [], "managers": [], "plan": False, "build": False,
                           "generate": False, "why_not": None, "note": note, "error": None}
    try:
        spec_cls = spec_class_for(archs[0]) if archs[0] else None
        spec = (spec_cls or GenericDecoderSpec)(ConfigView(data))
        layers = spec.kv_layers()
        v2_only = spec.v2_required_reason()
    except Exception as exc:  # a config kvload cannot read geometry from: reported on the row, never fatal
        row["error"] = first_line(exc, type(exc).__name__)
        return row
    unserved = unserved_kinds(layers)
    row.update(spec=spec.name, layer_kinds=sorted({layer.kind for layer in layers}),
               managers=[k.manager for k in KINDS if k.use_v2 or v2_only is None], plan=True, build=True,
               generate=not unserved,
               why_not=(f"{', '.join(unserved)} layers: the paged attention serves "
                        f"{', '.join(SERVED_KINDS)} only") if unserved else None)
    return row


def preset_rows() -> list[dict[str, Any]]:
    """The embedded presets: architecture, spec, layer kinds, and whether plan/build/generate work."""
    from models.checkpoint import PRESETS_DIR, presets

    rows = []
    for name in presets():
        try:
            data = json.loads((PRESETS_DIR / name / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            rows.append({"name": name, "kind": "preset", "architecture": None, "model_type": None,
                         "error": type(exc).__name__, "plan": False, "build": False, "generate": False})
            continue
        rows.append(_support_row(name, "preset", data, "random weights"))
    return rows


def packaged_rows() -> list[dict[str, Any]]:
    """The packaged real models, from the config kvload keeps beside each (checked against the file in tests)."""
    import importlib.metadata

    from models.checkpoint import PACKAGED, packaged_config

    rows = []
    for name, entry in sorted(PACKAGED.items()):
        try:
            importlib.metadata.distribution(entry.distribution)
            note = f"weights from the installed {entry.distribution}"
        except importlib.metadata.PackageNotFoundError:
            note = f"not installed: {entry.install_hint}"
        rows.append(_support_row(name, "package", packaged_config(name), note))
    return rows


def catalog() -> dict[str, Any]:
    """The ``kvload models --json`` document."""
    from models import GenericDecoderSpec

    presets = preset_rows()
    return {
        "architectures": architectures(),
        "fallback_spec": GenericDecoderSpec.__name__,
        "presets": presets,
        "models": [*presets, *packaged_rows()],
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
    yes = {True: "yes", False: "no"}
    mrows = [["model", "architecture", "layers", "managers", "plan", "build", "generate", "note"]]
    for m in doc["models"]:
        if m.get("error"):
            mrows.append([m["name"], m["architecture"] or "", "", "", "no", "no", "no", f"error: {m['error']}"])
            continue
        note = "; ".join(x for x in (m.get("note"), m.get("why_not")) if x)
        mrows.append([m["name"], m["architecture"] or "", ",".join(m["layer_kinds"]),
                      ",".join(m["managers"]), yes[m["plan"]], yes[m["build"]], yes[m["generate"]], note])
    lines += ["", "models (use the name as MODEL; or give a checkpoint directory, a .gguf file or a Hugging Face "
              "id in the local cache):", *table(mrows),
              "plan: resolve and size the KV cache; build: allocate the pools (kvload run); generate: run the "
              "model through them"]
    return "\n".join(lines)
