"""Convert a GGUF checkpoint to safetensors once, into a cache directory, so later loads take seconds.

Dequantizing a GGUF file through transformers takes far longer than reading safetensors (SmolLM2-135M
Q4_1: ~13 s against ~1 s), and reading its header alone costs seconds. The first load writes the
dequantized float32 weights, the config and the tokenizer to ``<cache>/<stem>-<key>/``; the cache
root is ``$KVLOAD_CACHE`` or ``~/.cache/kvload``.

The key hashes the GGUF file's resolved path, size and modification time and the transformers
version, so a changed file or a different converter gets a fresh directory. The directory appears
atomically: everything is written under a temporary name in the same root and renamed when complete,
so a crashed or concurrent conversion never leaves a half-written cache that looks finished.
The config is saved without a ``dtype``: a GGUF declares none, and float32 is only the storage choice,
so ``dtype: auto`` resolves the same with or without the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import ModelError, first_line

if TYPE_CHECKING:
    from models.checkpoint import Checkpoint

#: Written last, inside the directory before the rename; its presence marks a complete conversion.
MARKER = "kvload-conversion.json"


def cache_root() -> Path:
    """``$KVLOAD_CACHE`` when set, else ``~/.cache/kvload``."""
    env = os.environ.get("KVLOAD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvload"


def _transformers_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("transformers")


def cache_dir(checkpoint: Checkpoint) -> Path:
    """Where the converted copy of a GGUF checkpoint lives (whether or not it exists yet)."""
    gguf = checkpoint.gguf_path
    if gguf is None:
        raise ValueError(f"checkpoint {checkpoint.name!r} is not a GGUF file")
    st = gguf.stat()
    ident = f"{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{_transformers_version()}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", gguf.stem)
    return cache_root() / f"{stem}-{key}"


def cached_conversion(checkpoint: Checkpoint) -> Path | None:
    """The converted directory of a GGUF checkpoint when a complete one exists, else None."""
    try:
        target = cache_dir(checkpoint)
    except OSError:
        return None
    return target if (target / MARKER).is_file() else None


def convert_gguf(checkpoint: Checkpoint) -> Path:
    """Dequantize a GGUF checkpoint to float32 safetensors (plus config and tokenizer), once; return the directory."""
    done = cached_conversion(checkpoint)
    if done is not None:
        return done
    target = cache_dir(checkpoint)
    root = target.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        tmp.chmod(0o755)  # mkdtemp makes it private; the finished cache is an ordinary directory
    except OSError as exc:
        raise ModelError(f"cannot write the GGUF conversion cache under {root} ({exc.strerror or exc}); "
                         "set KVLOAD_CACHE to a writable directory") from None
    try:
        tokenizer_saved = _write_conversion(checkpoint, tmp)
        (tmp / MARKER).write_text(json.dumps({
            "source": str(checkpoint.gguf_path),
            "transformers": _transformers_version(),
            "dtype": "float32",
            "tokenizer": tokenizer_saved,
        }, indent=2))
        try:
            tmp.rename(target)
        except OSError as exc:
            if cached_conversion(checkpoint) is None:  # not a concurrent winner: a real failure
                raise ModelError(f"cannot finish the GGUF conversion cache at {target} ({exc.strerror or exc}); "
                                 "remove it or set KVLOAD_CACHE to another directory") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_conversion(checkpoint: Checkpoint, out: Path) -> bool:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf, local_files_only=True)
    except Exception:  # a GGUF without a usable tokenizer still serves token ids (the marker records it)
        return False
    tokenizer.save_pretrained(out)
    return True
