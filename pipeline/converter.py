"""The one cattrs converter: plain dicts (Python, YAML, CLI) to config classes and back.

Leaf hooks hand raw values through untouched so the attrs validators judge them: cattrs'
default hooks would coerce (``bool("yes")`` is ``True``), which is exactly what must not happen.
Errors come back as one :class:`~pipeline.errors.ConfigError` that names the dotted path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.errors import ForbiddenExtraKeysError
from cattrs.gen import make_dict_unstructure_fn, override

from pipeline.config import (
    Bytes,
    DeviceName,
    DTypeName,
    FieldError,
    GenerationDefaults,
    KvCacheConfig,
    LlmArgs,
    SeqLen,
    TriState,
    describe,
    public_fields,
)
from pipeline.errors import ConfigError, did_you_mean

T = TypeVar("T")

converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)


def _passthrough(value: Any, _type: Any) -> Any:
    return value


# the fields' own converters take numpy / torch scalars (limits.plain_value) and size strings (config.byte_count),
# and their checks judge the rest: cattrs'
# defaults would coerce (int(3.5) is 3, bool("no") is True)
for _t in (str, DTypeName, DeviceName, bool, int, float, SeqLen, Bytes):
    converter.register_structure_hook(_t, _passthrough)
converter.register_structure_hook_func(lambda t: t == TriState, _passthrough)  # true | false | "auto"


#: What a config class's mapping holds, where its class name would tell a user nothing.
_MAPPING_OF = {GenerationDefaults: "generation_config.json keys (" + ", ".join(
    a.name for a in public_fields(GenerationDefaults)) + ")"}


def _config_hook_factory(cls: type) -> Any:
    generated = converter.gen_structure_attrs_fromdict(cls)
    what = _MAPPING_OF.get(cls, f"{cls.__name__} fields")

    def hook(value: Any, _type: Any) -> Any:
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"expected a mapping of {what}, got {describe(value)}")
        # a Python caller can pass {1: 2}: the unknown-key hint compared it with the field names and the line was
        # "parse_args: TypeError: 'int' object is not iterable" (YAML's keys are checked as the file is read)
        for key in value:
            if not isinstance(key, str):
                raise ValueError(f"expected a mapping of {what} with string keys, got the key {describe(key)}")
        return generated(value, _type)

    return hook


for _cls in (KvCacheConfig, GenerationDefaults, LlmArgs):
    converter.register_structure_hook(_cls, _config_hook_factory(_cls))
    converter.register_unstructure_hook(
        _cls,
        make_dict_unstructure_fn(
            _cls, converter, **{a.name: override(omit=True) for a in attrs.fields(_cls) if a.metadata.get("internal")}
        ),
    )


#: Separates the leaf field from the message inside one of cattrs' ``"{message} @ {path}"`` lines.
_SEP = "\x1f"


def _describe(exc: BaseException, _type: Any) -> str:
    """``format_exception`` for ``cattrs.transform_error``: ``leaf<SEP>message`` in kvload's words."""
    if isinstance(exc, ForbiddenExtraKeysError):
        known = [a.name for a in public_fields(exc.cl)]
        key = sorted(exc.extra_fields)[0]
        hint = did_you_mean(key, known) or f"; known keys: {', '.join(known)}"
        # an empty key named as one: the line read "kv_cache_config: unknown key", blaming the parent
        return f"{key or repr(key)}{_SEP}unknown key{hint}"
    if isinstance(exc, FieldError):
        return f"{exc.field}{_SEP}{exc.detail}"
    if isinstance(exc, KeyError):  # cattrs already noted the missing attribute in the path
        return f"{_SEP}required"
    return f"{_SEP}{exc}"


def _first_error(exc: BaseException) -> tuple[str, str]:
    """The first leaf of cattrs' exception tree (``cattrs.transform_error`` walks it): dotted path, message."""
    line = cattrs.transform_error(exc, path="", format_exception=_describe)[0]
    message, _, where = line.rpartition(" @ ")
    leaf, _, detail = message.partition(_SEP)
    return ".".join(p for p in (*where.split(".")[1:], leaf) if p), detail


def structure(raw: Mapping[str, Any], cls: type[T]) -> T:
    """Build a config object from a nested dict; raise ``ConfigError`` naming the dotted path."""
    try:
        return converter.structure(raw, cls)
    except ConfigError:
        raise
    except Exception as exc:  # cattrs wraps every leaf error; render the first one
        path, detail = _first_error(exc)
        raise ConfigError(f"{path or cls.__name__}: {detail}", path=path or None, detail=detail) from exc


def unstructure(obj: Any) -> Any:
    """Turn a config object into plain nested dicts (JSON/YAML ready)."""
    return converter.unstructure(obj)
