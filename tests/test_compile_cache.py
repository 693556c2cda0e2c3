"""torch.compile's on-disk cache lives under kvload's cache (``$KVLOAD_CACHE/torchinductor``), or the user's
``TORCHINDUCTOR_CACHE_DIR``: a ``generate`` leaves nothing in ``$TMPDIR`` (it left ``torchinductor_<user>``, which
``scripts/cli_sweep.py`` flagged), and a later process finds the graphs an earlier one compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.cli_support import ENV, REPO


def _run(tmp_path, code_or_argv, **env):
    tmp = tmp_path / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    full = {**ENV, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp), "KVLOAD_CACHE": str(tmp_path / "cache"), **env}
    full.pop("TORCHINDUCTOR_CACHE_DIR", None) if "TORCHINDUCTOR_CACHE_DIR" not in env else None
    argv = ["-m", "kvload", *code_or_argv] if isinstance(code_or_argv, list) else ["-c", code_or_argv]
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=full)
    return r, tmp


GENERATE = ["generate", "tiny-llama", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--device", "cpu"]


def test_generate_leaves_nothing_in_tmpdir_and_keeps_inductors_cache_in_kvloads_or_the_users(tmp_path):
    r, tmp = _run(tmp_path / "default", GENERATE)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp)) == []  # was ['torchinductor_root']
    assert (tmp_path / "default" / "cache" / "torchinductor").is_dir()
    mine = tmp_path / "mine"
    r, tmp = _run(tmp_path / "set", GENERATE, TORCHINDUCTOR_CACHE_DIR=str(mine))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp)) == [] and mine.is_dir()  # the user's own stands
    assert not (tmp_path / "set" / "cache" / "torchinductor").exists()


def test_the_compiled_paths_headers_go_under_the_cache_too(tmp_path):
    """Inductor puts its precompiled C++ headers in ``$TMPDIR/torchinductor_<user>`` whatever
    ``TORCHINDUCTOR_CACHE_DIR`` says; the compiled paged attention moves them under the cache in use."""
    r, tmp = _run(tmp_path, """
import json, os
from models.compile_cache import use_kvload_compile_cache
use_kvload_compile_cache()  # what weight loading does first
from cache_backends.flex_paged import compiled_flex
compiled_flex()
import torch._inductor.codecache as codecache
print(json.dumps([os.environ["TORCHINDUCTOR_CACHE_DIR"], codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR]))
""")
    assert r.returncode == 0, r.stderr
    cache, headers, locks = json.loads(r.stdout.strip().splitlines()[-1])
    assert cache == str(tmp_path / "cache" / "torchinductor")
    assert headers == os.path.join(cache, "precompiled_headers") and locks == os.path.join(headers, "locks")
    assert sorted(os.listdir(tmp)) == []


def test_an_uncreatable_kvload_cache_leaves_torchs_default_and_says_so(tmp_path):
    """A ``$HOME`` that cannot hold ``~/.cache/kvload`` (``/proc/self``) made generate fail inside transformers'
    import ("cannot build a causal LM ... No such file or directory"); torch's default serves, with a warning."""
    env = {k: v for k, v in ENV.items() if k not in ("KVLOAD_CACHE", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR")}
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    full = {**env, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp), "HOME": "/proc/self"}
    r = subprocess.run([sys.executable, "-m", "kvload", *GENERATE], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env=full)
    assert r.returncode == 0, r.stderr
    warned = [line for line in r.stderr.splitlines() if "field=KVLOAD_CACHE" in line]
    assert len(warned) == 1 and "cannot be created" in warned[0] and "torch's default" in warned[0], r.stderr


def test_simulate_leaves_nothing_in_tmpdir(tmp_path):
    """``kvload simulate`` counts the weights with transformers' model code (``models.cost``), which imports
    ``torch._dynamo``: it left ``$TMPDIR/torchinductor_<user>``."""
    r, tmp = _run(tmp_path, ["simulate", "tiny-llama", "--workload", "no-reuse", "--requests", "2"])
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp)) == []  # was ['torchinductor_root']
    assert (tmp_path / "cache" / "torchinductor").is_dir()


def test_plan_checking_an_out_of_range_pad_token_id_leaves_nothing_in_tmpdir(tmp_path):
    """A ``pad_token_id`` past the vocabulary is refused only where the model pads an embedding with it, found by a
    meta-device build (``models.config_check.pads_an_embedding``) whose transformers import makes inductor's folder:
    ``kvload plan`` left ``$TMPDIR/torchinductor_<user>`` (``scripts/cli_sweep.py``'s ``hfo plan`` case)."""
    r, tmp = _run(tmp_path, ["plan", "tiny-llama", "--hf-overrides", '{"pad_token_id": 99999}'])
    assert r.returncode == 2 and "hf_overrides.pad_token_id" in r.stderr, r.stderr
    assert sorted(os.listdir(tmp)) == []  # was ['torchinductor_root']
