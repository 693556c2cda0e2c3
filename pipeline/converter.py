"""The one cattrs converter: plain dicts (Python, YAML, CLI) to config classes and back.

Leaf hooks hand raw values through untouched so the attrs validators judge them: cattrs'
default hooks would coerce (``bool("yes")`` is ``True``), which is exactly what must not happen.
Errors come back as one :class:`~pipeline.errors.ConfigError` that names the dotted path.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError
from cattrs.gen import make_dict_unstructure_fn, override

from pipeline.config import (
    Bytes,
    DeviceName,
    DTypeName,
    FieldError,
    KvCacheConfig,
    LlmArgs,
    TriState,
    describe,
    parse_size,
    public_fields,
)
from pipeline.errors import ConfigError

T = TypeVar("T")

converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)


def _passthrough(value: Any, _type: Any) -> Any:
    return value


def _bytes(value: Any, _type: Any) -> Any:
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError:
            raise ValueError(f"expected a byte count such as 8589934592 or '8GiB', got {describe(value)}") from None
    return value


for _t in (bool, int, float, str, DTypeName, DeviceName):
    converter.register_structure_hook(_t, _passthrough)
converter.register_structure_hook(Bytes, _bytes)
converter.register_structure_hook_func(lambda t: t == TriState, _passthrough)


def _config_hook_factory(cls: type) -> Any:
    generated = converter.gen_structure_attrs_fromdict(cls)

    def hook(value: Any, _type: Any) -> Any:
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"expected a mapping of {cls.__name__} fields, got {describe(value)}")
        return generated(value, _type)

    return hook


for _cls in (KvCacheConfig, LlmArgs):
    converter.register_structure_hook(_cls, _config_hook_factory(_cls))
    converter.register_unstructure_hook(
        _cls,
        make_dict_unstructure_fn(
            _cls, converter, **{a.name: override(omit=True) for a in attrs.fields(_cls) if a.metadata.get("internal")}
        ),
    )


def _nested_class(cls: type, name: str) -> type | None:
    for a in public_fields(cls):
        if a.name == name and isinstance(a.type, type) and attrs.has(a.type):
            return a.type
    return None


def _first_error(exc: BaseException, cls: type | None, path: tuple[str, ...]) -> tuple[str, str]:
    """Walk cattrs' exception tree to the first leaf; return its dotted path and message."""
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        for sub in exc.exceptions:
            child_path, child_cls = path, cls
            for note in getattr(sub, "__notes__", []):
                # cattrs notes look like "Structuring class LlmArgs @ attribute kv_cache_config".
                if "@ attribute " in note:
                    attr = note.rsplit("@ attribute ", 1)[1].strip()
                    child_path = (*path, attr)
                    child_cls = _nested_class(cls, attr) if cls else None
            return _first_error(sub, child_cls, child_path)
        return ".".join(path), "invalid"
    if isinstance(exc, ForbiddenExtraKeysError):
        known = [a.name for a in public_fields(exc.cl)]
        key = sorted(exc.extra_fields)[0]
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"
        return ".".join((*path, key)), f"unknown key; {hint}"
    if isinstance(exc, FieldError):
        return ".".join((*path, exc.field)), exc.detail
    if isinstance(exc, KeyError):  # cattrs already noted the missing attribute in the path
        return ".".join(path) or str(exc.args[0]), "required"
    return ".".join(path), str(exc)


def structure(raw: Mapping[str, Any], cls: type[T]) -> T:
    """Build a config object from a nested dict; raise ``ConfigError`` naming the dotted path."""
    try:
        return converter.structure(raw, cls)
    except ConfigError:
        raise
    except Exception as exc:  # cattrs wraps every leaf error; render the first one
        path, detail = _first_error(exc, cls, ())
        raise ConfigError(f"{path or cls.__name__}: {detail}", path=path or None, detail=detail) from exc


def unstructure(obj: Any) -> Any:
    """Turn a config object into plain nested dicts (JSON/YAML ready)."""
    return converter.unstructure(obj)
