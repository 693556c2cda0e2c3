"""The GGUF conversion cache: keyed by content, XDG_CACHE_HOME honoured, a progress line, two processes safe."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from models import gguf_cache
from models.checkpoint import resolve_checkpoint
from tests.cli_support import ENV, REPO


def gguf_dir(root, name="m.gguf", content=b"weights"):
    root.mkdir(parents=True, exist_ok=True)
    (root / name).write_bytes(content)
    return resolve_checkpoint(str(root / name))


@pytest.fixture
def recorder(monkeypatch):
    calls = []

    def write(ckpt, out, tokenizer=None):
        calls.append(str(ckpt.gguf_path))
        (out / "config.json").write_text("{}")
        return False

    monkeypatch.setattr(gguf_cache, "_write_conversion", write)
    return calls


def test_the_cache_root_follows_kvload_cache_then_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("KVLOAD_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_cache.cache_root() == tmp_path / "xdg" / "kvload"
    monkeypatch.setenv("KVLOAD_CACHE", str(tmp_path / "mine"))
    assert gguf_cache.cache_root() == tmp_path / "mine"
    monkeypatch.delenv("KVLOAD_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert gguf_cache.cache_root() == gguf_cache.Path.home() / ".cache" / "kvload"


def test_two_copies_of_one_file_share_a_conversion(monkeypatch, tmp_path, recorder, capsys):
    monkeypatch.setenv("KVLOAD_CACHE", str(tmp_path / "cache"))
    a = gguf_dir(tmp_path / "venv-a")
    b = gguf_dir(tmp_path / "venv-b")
    first = gguf_cache.convert_gguf(a)
    err = capsys.readouterr().err
    assert "kvload: converting m.gguf" in err and f"in {first}" in err and "kvload: converted m.gguf in" in err
    assert gguf_cache.convert_gguf(b) == first and recorder == [str(a.gguf_path)]
    marker = json.loads((first / gguf_cache.MARKER).read_text())
    assert marker["sha256"] == gguf_cache._sha256(a.gguf_path)


def test_a_conversion_made_before_content_keys_is_adopted(monkeypatch, tmp_path, recorder):
    monkeypatch.setenv("KVLOAD_CACHE", str(tmp_path / "cache"))
    ckpt = gguf_dir(tmp_path / "src")
    legacy = gguf_cache._legacy_dir(ckpt)
    legacy.mkdir(parents=True)
    (legacy / gguf_cache.MARKER).write_text("{}")
    got = gguf_cache.convert_gguf(ckpt)
    assert got == gguf_cache.cache_dir(ckpt) and (got / gguf_cache.MARKER).is_file()
    assert (legacy / gguf_cache.MARKER).is_file() and recorder == []  # shared, not moved: older kvloads keep it


CONVERT = """
import sys, time, pathlib
from models import gguf_cache
from models.checkpoint import resolve_checkpoint

def write(ckpt, out, tokenizer=None):  # stands in for the minute-long dequantization; counts conversions
    with open(sys.argv[2], "a") as f:
        f.write("converted\\n")
    time.sleep(1.5)
    (out / "config.json").write_text("{}")
    return False

gguf_cache._write_conversion = write
print(gguf_cache.convert_gguf(resolve_checkpoint(sys.argv[1])))
"""


def test_two_processes_converting_at_once_convert_once(tmp_path):
    ckpt = gguf_dir(tmp_path / "src")
    count = tmp_path / "count.txt"
    env = {**ENV, "PYTHONPATH": str(REPO), "KVLOAD_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(CONVERT), str(ckpt.gguf_path), str(count)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert count.read_text() == "converted\n"  # one conversion, not two
    dirs = {out.strip() for out, _ in outs}
    assert len(dirs) == 1
    errs = "".join(err for _, err in outs)
    assert "waiting for another process converting m.gguf" in errs or errs.count("kvload: converting") == 1
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert entries == [gguf_cache.STATE, gguf_cache.Path(dirs.pop()).name]  # no temporary left behind
    shutil.rmtree(tmp_path / "cache")
