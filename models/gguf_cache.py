"""Convert a GGUF checkpoint to safetensors once, into a cache directory, so later loads take seconds.

Dequantizing a GGUF file through transformers takes far longer than reading safetensors (SmolLM2-135M
Q4_1: ~13 s against ~1 s), and reading its header alone costs seconds. The first load writes the
dequantized float32 weights, the config and the tokenizer to ``<cache>/<stem>-<key>/`` and says so on
stderr (a line when it starts, one when it is done). The cache root is ``$KVLOAD_CACHE``, else
``$XDG_CACHE_HOME/kvload``, else ``~/.cache/kvload``.

The key hashes the GGUF file's *content* (SHA-256) and the transformers version: the same file
installed in two virtual environments shares one conversion, and a changed file or a different
converter gets a fresh directory. Hashing a file costs a fraction of a second per 100 MB, so the
content key of a (path, size, mtime) is remembered under ``<cache>/.state/keys/``.

Two processes that convert the same file at once take turns on a lock (``filelock``, under
``<cache>/.state/locks/``): the second waits, saying so, and finds the first one's result. The
directory itself appears atomically: everything is written under a temporary name in the same root
and renamed when complete, so a crashed conversion never leaves a half-written cache that looks
finished. The config is saved without a ``dtype``: a GGUF declares none, and float32 is only the
storage choice, so ``dtype: auto`` resolves the same with or without the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.user_paths import expand_user
from pipeline.errors import KvloadError, ModelError, OutputError, first_line, out_of_space

if TYPE_CHECKING:
    from models.checkpoint import Checkpoint

#: Written last, inside the directory before the rename; its presence marks a complete conversion.
MARKER = "kvload-conversion.json"
#: Bookkeeping beside the conversions (remembered content keys, locks); never a conversion itself.
STATE = ".state"
#: How long a second process waits for another one's conversion before giving up.
LOCK_TIMEOUT_S = 3600.0


def cache_root() -> Path:
    """``$KVLOAD_CACHE``, else ``$XDG_CACHE_HOME/kvload``, else ``~/.cache/kvload``."""
    env = os.environ.get("KVLOAD_CACHE")
    if env:
        return expand_user(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (expand_user(xdg) if xdg else Path.home() / ".cache") / "kvload"


def _transformers_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("transformers")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def content_key(gguf: Path) -> str:
    """SHA-256 of the file's bytes, remembered per (resolved path, size, mtime) so it is computed once."""
    st = gguf.stat()
    ident = hashlib.sha256(f"{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = cache_root() / STATE / "keys" / ident
    try:
        known = memo.read_text(encoding="ascii").strip()
        if re.fullmatch(r"[0-9a-f]{64}", known):
            return known
    except OSError:
        pass
    key = _sha256(gguf)
    tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
    try:  # best effort: an unwritable cache only costs the hash next time
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(key, encoding="ascii")
        tmp.replace(memo)
    except OSError:
        with contextlib.suppress(OSError):  # created, then not written (a full disk): not left behind
            tmp.unlink()
    return key


def cache_dir(checkpoint: Checkpoint) -> Path:
    """Where the converted copy of a GGUF checkpoint lives (whether or not it exists yet)."""
    gguf = checkpoint.gguf_path
    if gguf is None:
        raise ValueError(f"checkpoint {checkpoint.name!r} is not a GGUF file")
    key = hashlib.sha256(f"{content_key(gguf)}\0{_transformers_version()}".encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", gguf.stem)
    return cache_root() / f"{stem}-{key}"


def _legacy_dir(checkpoint: Checkpoint) -> Path | None:
    """Where kvload before content keys put this file's conversion (keyed by path, size and mtime)."""
    gguf = checkpoint.gguf_path
    try:
        st = gguf.stat()
    except (OSError, AttributeError):
        return None
    ident = f"{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{_transformers_version()}"
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", gguf.stem)
    return cache_root() / f"{stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def cached_conversion(checkpoint: Checkpoint) -> Path | None:
    """The converted directory of a GGUF checkpoint when a complete one exists, else None."""
    try:
        target = cache_dir(checkpoint)
    except OSError:
        return None
    return target if (target / MARKER).is_file() else None


def ready_conversion(checkpoint: Checkpoint) -> Path | None:
    """A complete conversion of a GGUF checkpoint, kvload's or an older kvload's that :func:`convert_gguf` would
    share, else None (it must be converted)."""
    done = cached_conversion(checkpoint)
    if done is None:
        with contextlib.suppress(OSError):
            legacy = _legacy_dir(checkpoint)
            if legacy is not None and (legacy / MARKER).is_file():
                return legacy
    return done


def _say(line: str) -> None:
    """A progress line on stderr: the conversion takes long enough that silence looks like a hang."""
    print(f"kvload: {line}", file=sys.stderr, flush=True)


def convert_gguf(checkpoint: Checkpoint, progress: Callable[[str], None] | None = _say,
                 tokenizer: Any = None) -> Path:
    """Dequantize a GGUF checkpoint to float32 safetensors (plus config and tokenizer), once; return the directory.

    ``progress`` receives a line when a conversion starts, when this process waits for another
    one's, and when it is done (None: silent). ``tokenizer``: the file's, read already (:func:`gguf_tokenizer`),
    saved rather than read again.
    """
    say = progress or (lambda _line: None)
    done = cached_conversion(checkpoint)
    if done is not None:
        return done
    target = cache_dir(checkpoint)
    root = target.parent
    try:
        (root / STATE / "locks").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _refused(exc, target) from None
    from filelock import FileLock, Timeout

    lock = FileLock(str(root / STATE / "locks" / f"{target.name}.lock"))
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            say(f"waiting for another process converting {checkpoint.gguf_path.name} into {target}")
            lock.acquire(timeout=LOCK_TIMEOUT_S)
    except Timeout:
        raise ModelError(f"gave up after {LOCK_TIMEOUT_S:.0f} s waiting for another process converting "
                         f"{checkpoint.gguf_path} (lock {lock.lock_file})") from None
    except OSError as exc:  # the lock file cannot be created (no inode left): said as the directories above are
        raise _refused(exc, target) from None
    try:
        if (target / MARKER).is_file():  # the process we waited for finished it
            return target
        legacy = _legacy_dir(checkpoint)
        if legacy is not None and (legacy / MARKER).is_file() and _adopt(legacy, target):
            return target
        return _convert_locked(checkpoint, target, say, tokenizer)
    finally:
        lock.release()


def _refused(exc: OSError, target: Path) -> KvloadError:
    """The cache's refusal of a folder, file or rename it needs: a full disk or quota (no room, no inode) is the
    mid-write failure's line and exit 1, wherever it shows; anything else (read-only, permissions, a file where a
    folder goes) is the path's, exit 2, before anything was converted."""
    if out_of_space(exc):
        return _no_room(target, exc.strerror or first_line(exc))
    return ModelError(f"cannot write the GGUF conversion cache under {target.parent} ({exc.strerror or exc}); "
                      "set KVLOAD_CACHE to a writable directory")


def _no_room(target: Path, reason: str) -> OutputError:
    """A write the OS refused for the conversion at ``target`` (a full disk, a quota, a file size limit)."""
    # a full disk said "load_weights: SafetensorError: Error while serializing: I/O error: ..." (exit 2, as bad input),
    # naming neither the cache nor what to change
    return OutputError(f"cannot write the GGUF conversion cache at {target} ({reason}); nothing was kept: free "
                       "space there or set KVLOAD_CACHE to another directory")


def _adopt(legacy: Path, target: Path) -> bool:
    """Share an older kvload's conversion of this very file under the content key (hard links: no copy,
    and the older kvload keeps finding its own); False when the links cannot be made."""
    tmp = target.with_name(f".{target.name}.adopt.{os.getpid()}")
    try:
        tmp.mkdir()
        for f in legacy.iterdir():
            if f.is_file():
                os.link(f, tmp / f.name)
        tmp.rename(target)
        return True
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return False


def _convert_locked(checkpoint: Checkpoint, target: Path, say: Callable[[str], None], tokenizer: Any) -> Path:
    root = target.parent
    gguf = checkpoint.gguf_path
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        tmp.chmod(0o755)  # mkdtemp makes it private; the finished cache is an ordinary directory
    except OSError as exc:
        raise _refused(exc, target) from None
    start = time.perf_counter()
    say(f"converting {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB) to float32 safetensors in {target} "
        "(once per file; later loads read the converted copy)")
    try:
        try:
            tokenizer_saved = _write_conversion(checkpoint, tmp, tokenizer)
            (tmp / MARKER).write_text(json.dumps({
                "source": str(gguf),
                "sha256": content_key(gguf),
                "transformers": _transformers_version(),
                "dtype": "float32",
                "tokenizer": tokenizer_saved,
            }, indent=2))
        except Exception as exc:
            reason = _write_failure(exc)
            if reason is None:
                raise
            raise _no_room(target, reason) from None
        try:
            tmp.rename(target)
        except OSError as exc:
            if out_of_space(exc):  # (a folder's new entry may need a block)
                raise _no_room(target, exc.strerror or first_line(exc)) from None
            raise ModelError(f"cannot finish the GGUF conversion cache at {target} ({exc.strerror or exc}); "
                             "remove it or set KVLOAD_CACHE to another directory") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    size = sum(p.stat().st_size for p in target.iterdir() if p.is_file())
    say(f"converted {gguf.name} in {time.perf_counter() - start:.1f} s ({size / 1e6:.0f} MB)")
    return target


def _write_failure(exc: Exception) -> str | None:
    """The OS's reason when ``exc`` is a write the OS refused (a full disk, a file size limit), else None: an
    ``OSError``, or safetensors' ``SafetensorError`` wrapping one ("I/O error: No space left on device (os error
    28)")."""
    if isinstance(exc, OSError):
        return exc.strerror or first_line(exc)
    if type(exc).__name__ == "SafetensorError":
        line = first_line(exc)  # "... I/O error: REASON (os error N)", with ' at path "..."' after it in some versions
        found = re.search(r"I/O error: (.+?) \(os error \d+\)", line) or re.search(r"I/O error: (.+)$", line)
        return found.group(1) if found else None
    return None


def gguf_tokenizer(checkpoint: Checkpoint) -> Any:
    """The tokenizer a GGUF file holds (transformers reads its metadata, not its tensors), or None when it has no
    usable one (such a file still serves token ids)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(checkpoint.path), gguf_file=checkpoint.gguf_file,
                                             local_files_only=True)
    except Exception:  # the GGUF reader raises whatever its parser hits
        return None


def _write_conversion(checkpoint: Checkpoint, out: Path, tokenizer: Any = None) -> bool:
    import torch
    from transformers import AutoModelForCausalLM

    from models.checkpoint import name_architecture

    src, gguf = str(checkpoint.path), checkpoint.gguf_file
    try:
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, dtype=torch.float32,
                                                     local_files_only=True)
    except ImportError as exc:
        raise ModelError(f"{checkpoint.gguf_path}: reading GGUF needs the 'gguf' package; "
                         f"install it with: pip install gguf ({exc})") from exc
    except Exception as exc:  # the GGUF reader raises whatever its parser hits
        raise ModelError(f"{checkpoint.gguf_path}: transformers cannot load these GGUF weights: "
                         f"{first_line(exc)}") from exc
    name_architecture(model.config)
    # transformers refuses save_pretrained on a GGUF-loaded model (it counts as quantized); the
    # dequantized tensors are plain, so write them with safetensors (tied tensors stored once).
    from safetensors.torch import save_model

    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    model.generation_config.save_pretrained(out)
    del model
    for key in ("dtype", "torch_dtype", "quantization_config", "transformers_version"):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer = gguf_tokenizer(checkpoint) if tokenizer is None else tokenizer
    if tokenizer is None:  # a GGUF without a usable tokenizer still serves token ids (the marker records it)
        return False
    tokenizer.save_pretrained(out)
    return True
