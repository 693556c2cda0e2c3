"""The packages' layers: every import points down, and the lower layers load nothing of the upper ones."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Bottom to top. A module may import its own layer and the layers below it, never one above.
LAYERS = ["cache_backends", "models", "pipeline", "stages", "engine", "kvload"]

#: Leaf modules every layer above the backends may use (they import nothing of kvload but each other): the typed
#: errors, the bounds every input is checked against, and the one reader of a file a user named.
SHARED = {"pipeline.errors", "pipeline.limits", "pipeline.textfile"}


def layer_of(module: str) -> int | None:
    top = module.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else None


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in a file, function-level ones included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def violations() -> list[str]:
    bad = []
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            own = LAYERS.index(package)
            for line, module in imports_of(path):
                layer = layer_of(module)
                if layer is None or layer <= own:
                    continue
                if module in SHARED and package != "cache_backends":
                    continue
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module} ({LAYERS[layer]} is above {package})")
    return bad


def test_every_import_points_down_the_layers():
    assert violations() == []


def test_the_checker_sees_an_upward_import(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text("def f():\n    from kvload.cli import main\n")
    assert imports_of(sample) == [(2, "kvload.cli")]
    assert layer_of("kvload.cli") > layer_of("pipeline.config") > layer_of("models.spec") > layer_of("cache_backends")


def loaded_after(statement: str) -> set[str]:
    code = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return {m.split(".")[0] for m in json.loads(out.stdout)} | set(json.loads(out.stdout))


@pytest.mark.parametrize("statement, absent", [
    ("import models", {"cattrs", "structlog", "kvload", "kvload.api", "stages", "engine", "pipeline.converter"}),
    ("import cache_backends", {"cattrs", "structlog", "kvload", "stages", "engine", "models", "pipeline"}),
    ("import pipeline", {"cattrs", "structlog", "torch", "transformers", "kvload", "stages", "engine"}),
    ("import kvload", {"torch", "transformers", "cattrs", "structlog", "stages", "engine"}),
])
def test_a_lower_layer_imports_nothing_above_it(statement, absent):
    assert loaded_after(statement) & absent == set()


def test_the_lazy_packages_still_export_the_public_api():
    import kvload
    import pipeline

    assert pipeline.plan is kvload.plan and pipeline.load is kvload.load
    assert pipeline.LoadResult is kvload.LoadResult
    assert callable(pipeline.converter.unstructure)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = pipeline.nope
