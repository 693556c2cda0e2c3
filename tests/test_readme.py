"""The README's Python blocks run as written (each in a fresh namespace, from an empty working directory)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import needs_smollm2

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks() -> list[tuple[int, str]]:
    """(line number of the block's first line, code) for every ```python block of the README."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


def cases() -> list[object]:
    out = []
    for line, code in python_blocks():
        marks = [needs_smollm2] if "smollm2" in code else []
        out.append(pytest.param(line, code, marks=marks, id=f"README.md:{line}"))
    return out


def test_the_readme_has_its_python_examples():
    codes = [code for _, code in python_blocks()]
    assert codes[0].lstrip().startswith("import kvload") and "kvload.LLM(" in codes[0]  # the front door first
    assert any("generate_stream" in c for c in codes) and any("PagedBatch.build" in c for c in codes)


@pytest.mark.parametrize(("line", "code"), cases())
def test_a_readme_python_block_runs(line, code, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # blocks may write files (serve.yaml)
    # padded so a traceback points at the README's own line numbers
    exec(compile("\n" * (line - 1) + code, str(README), "exec"), {"__name__": "__readme__"})


def test_a_user_package_named_like_a_kvload_layer_shadows_it_as_the_readme_says(tmp_path):
    import subprocess
    import sys
    import tomllib

    include = tomllib.loads((README.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    names = sorted(p.rstrip("*") for p in include["include"])
    limitation = next(p for p in README.read_text().split("\n- ") if "top-level packages" in p)
    assert all(f"`{name}`" in limitation for name in names)  # the README names every package kvload installs
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("")
    code = "import kvload; kvload.plan('tiny-llama', log=False)"
    env = {"PYTHONPATH": str(README.parent), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode != 0 and "from 'models'" in r.stderr  # what the README's limitation describes
