"""A user project next to kvload: what its own ``models/`` (or ``pipeline/``...) package does to ``import kvload``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cli_support import ENV, REPO

APP = "import kvload\nr = kvload.plan('tiny-llama', log=False)\nprint(r.route.kv_manager)\n"


def run_app(project) -> subprocess.CompletedProcess:
    """``python app.py`` inside ``project`` (its directory first on sys.path), kvload on PYTHONPATH."""
    (project / "app.py").write_text(APP)
    return subprocess.run([sys.executable, "app.py"], capture_output=True, text=True, timeout=120, cwd=project,
                          env={**ENV, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("name", ["models", "pipeline"])
def test_a_project_package_named_like_a_kvload_layer_is_reported_plainly(tmp_path, name):
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("USER = True\n")
    r = run_app(tmp_path)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: kvload cannot import its own top-level package '{name}'")
    assert str(tmp_path / name) in last and f"rename your project's '{name}' package" in last


def test_a_plain_models_folder_without_init_does_not_hide_kvload(tmp_path):
    (tmp_path / "models").mkdir()  # e.g. a folder of downloaded weights: a namespace, not a package
    (tmp_path / "models" / "notes.txt").write_text("weights live here\n")
    r = run_app(tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "KVCacheManager"


@pytest.mark.parametrize("module", ["kvload", "kvload.cli"])
@pytest.mark.parametrize("name", ["models", "pipeline"])
def test_python_m_kvload_from_such_a_project_says_it_in_the_command_s_one_line(tmp_path, name, module):
    # `python -m kvload` puts the working directory first on sys.path, and the refusal, raised by the package's
    # import that runpy makes before the command starts, came with runpy's ten-line traceback
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("USER = True\n")
    r = subprocess.run([sys.executable, "-m", module, "plan", "tiny-llama"], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env={**ENV, "PYTHONPATH": str(REPO)})
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith(f"error: kvload cannot import its own top-level package '{name}': ")
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
