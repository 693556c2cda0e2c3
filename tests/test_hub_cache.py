"""Hugging Face model ids resolve through the local Hugging Face cache, never the network."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from models.checkpoint import PRESETS_DIR, resolve_checkpoint
from pipeline.errors import ModelError
from tests.cli_support import run_cli

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_entry(hf_home: Path, repo_id: str, files: dict[str, Path | str], ref: str = "main") -> Path:
    """A model repository laid out as huggingface_hub caches it: refs/<ref> → snapshots/<commit>/files."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(COMMIT)
    for name, content in files.items():
        if isinstance(content, Path):
            shutil.copyfile(content, snapshot / name)
        else:
            (snapshot / name).write_text(content)
    return snapshot


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """A private HF_HOME, offline, where any network connection fails the test."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError("kvload tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    return home


def test_a_cached_model_id_resolves_to_its_snapshot(hf_home, capsys):
    snapshot = cache_entry(hf_home, "acme/tiny-llama", {"config.json": PRESETS_DIR / "tiny-llama" / "config.json"})
    cp = resolve_checkpoint("acme/tiny-llama")
    assert (cp.kind, cp.path) == ("hub", snapshot.resolve())
    r = run_cli(capsys, "plan", "acme/tiny-llama", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["model"]["kind"] == "hub" and doc["model"]["architecture"] == "LlamaForCausalLM"


def test_a_revision_resolves_through_its_ref(hf_home):
    snapshot = cache_entry(hf_home, "acme/tiny", {"config.json": PRESETS_DIR / "tiny-qwen3" / "config.json"}, ref="v1")
    assert resolve_checkpoint("acme/tiny@v1").path == snapshot.resolve()
    with pytest.raises(ModelError, match="but its default revision 'main' is not; cached revisions: v1;"):
        resolve_checkpoint("acme/tiny")  # no refs/main: that revision is not cached


def test_a_revision_that_is_not_cached_names_the_ones_that_are(hf_home, capsys):
    """The folder is there: the message said "nor a model in the local Hugging Face cache (looked for ...)"
    as if it were not."""
    cache_entry(hf_home, "acme/tiny", {"config.json": PRESETS_DIR / "tiny-qwen3" / "config.json"})
    repo = hf_home / "hub" / "models--acme--tiny"
    other = "f" * 40  # a snapshot no ref names: usable as acme/tiny@<hash>
    (repo / "snapshots" / other).mkdir()
    shutil.copyfile(PRESETS_DIR / "tiny-llama" / "config.json", repo / "snapshots" / other / "config.json")
    (repo / "refs" / "gone").write_text("e" * 40)  # a ref whose snapshot is not there: not usable, not named
    r = run_cli(capsys, "plan", "acme/tiny@v9")
    assert r.code == 2 and r.one_error_line and r.out == "", r.err
    assert f"acme/tiny is in the local Hugging Face cache ({repo}) but revision 'v9' is not" in r.err
    assert f"cached revisions: main, {other};" in r.err and "gone" not in r.err
    assert "nor a model" not in r.err and "looked for" not in r.err
    assert "hf download acme/tiny --revision v9" in r.err and "acme/tiny@main" in r.err
    assert resolve_checkpoint(f"acme/tiny@{other}").path == (repo / "snapshots" / other).resolve()


def test_many_cached_revisions_are_counted_not_all_listed(hf_home):
    cache_entry(hf_home, "acme/tiny", {"config.json": PRESETS_DIR / "tiny-qwen3" / "config.json"})
    refs = hf_home / "hub" / "models--acme--tiny" / "refs"
    for tag in ("v1", "v2", "v3", "v4", "v5"):
        (refs / tag).write_text(COMMIT)
    with pytest.raises(ModelError, match=r"cached revisions: main, v1, v2, v3 and 2 more;"):
        resolve_checkpoint("acme/tiny@v9")


def test_a_cached_folder_without_snapshots_says_so(hf_home):
    (hf_home / "hub" / "models--acme--empty" / "blobs").mkdir(parents=True)
    with pytest.raises(ModelError, match=r"but revision 'v9' is not; no snapshot of it is \(an interrupted"):
        resolve_checkpoint("acme/empty@v9")


def test_a_cached_revision_huggingface_hub_refuses_is_called_incomplete(tmp_path):
    """huggingface_hub refuses a snapshot its cached file listing shows partial; "not cached" would be wrong."""
    from models.hub_cache import missing_revision

    (tmp_path / "snapshots" / COMMIT).mkdir(parents=True)
    (tmp_path / "refs").mkdir()
    (tmp_path / "refs" / "main").write_text(COMMIT)
    message = missing_revision("acme/tiny", tmp_path)
    assert f"its default revision 'main' is incomplete (snapshots/{COMMIT} lacks files" in message
    assert "hf download acme/tiny)" in message


def test_a_missing_id_says_where_it_looked_and_never_downloads(hf_home, capsys):
    r = run_cli(capsys, "plan", "acme/not-cached")
    assert r.code == 2 and r.one_error_line, r.err
    assert str(hf_home / "hub" / "models--acme--not-cached") in r.err
    assert "kvload never downloads" in r.err and "hf download acme/not-cached" in r.err


@pytest.mark.parametrize("var", ["HF_HOME", "HF_HUB_CACHE"])
def test_a_cache_setting_that_names_a_file_is_named(hf_home, tmp_path, monkeypatch, capsys, var):
    """The line said only where it looked (``<file>/hub/models--...``), as if the cache were empty."""
    file = tmp_path / "a-file"
    file.write_text("not a cache\n")
    monkeypatch.setenv(var, str(file))
    r = run_cli(capsys, "plan", "acme/not-cached")
    assert r.code == 2 and r.one_error_line, r.err
    assert f"; {var}='{file}' is not a directory); kvload never downloads" in r.err, r.err


def test_hf_hub_cache_wins_over_hf_home(hf_home, tmp_path, monkeypatch):
    other = tmp_path / "elsewhere"
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    cache_entry(hf_home, "acme/tiny-llama", {"config.json": PRESETS_DIR / "tiny-llama" / "config.json"})
    with pytest.raises(ModelError, match=str(other / "models--acme--tiny-llama")):
        resolve_checkpoint("acme/tiny-llama")


def test_a_cached_checkpoint_generates(hf_home, tiny_checkpoints, capsys):
    src = tiny_checkpoints("llama")
    cache_entry(hf_home, "acme/llama-weights", {p.name: p for p in src.iterdir() if p.is_file()})
    r = run_cli(capsys, "generate", "acme/llama-weights", "--prompt-ids", "1,2,3", "--max_new_tokens", "2",
                "--device", "cpu", "--json")
    assert r.code == 0, r.err
    assert len(r.json()["outputs"][0]["outputs"][0]["token_ids"]) == 2


def test_code_shipped_with_a_checkpoint_is_never_run(hf_home, capsys):
    config = {"model_type": "acme_custom", "architectures": ["AcmeForCausalLM"],
              "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig"}}
    cache_entry(hf_home, "acme/custom", {"config.json": json.dumps(config),
                                         "configuration_acme.py": "raise SystemExit('remote code ran')\n"})
    r = run_cli(capsys, "plan", "acme/custom")
    assert r.code == 2 and r.one_error_line, r.err
    assert "kvload never runs it (trust_remote_code stays off)" in r.err
