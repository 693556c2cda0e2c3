"""Reading user inputs: the YAML config file (strict booleans) and Python overrides."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import yaml

from pipeline.config import explicit_fields
from pipeline.errors import ConfigError


class StrictLoader(yaml.SafeLoader):
    """YAML 1.2-style booleans: only true/false (any case) are bools; ``yes``/``on`` stay strings."""


StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def read_yaml(path: str) -> dict[str, Any]:
    """Load a YAML config file as nested dicts; ``ConfigError`` names the file (and line) otherwise."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found", source="config_file") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path}: is a directory, expected a YAML file", source="config_file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path}: cannot read ({exc.__class__.__name__})", source="config_file") from None
    try:
        data = yaml.load(text, Loader=StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}:" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {path}:{where} malformed YAML: {problem}", source="config_file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path}: expected a mapping of LlmArgs fields at the top level, got {type(data).__name__}",
            source="config_file",
        )
    bad = [k for k in _all_keys(data) if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"config file {path}: keys must be strings, got {bad[0]!r}", source="config_file")
    return data


def _all_keys(tree: Mapping[Any, Any]) -> list[Any]:
    keys = []
    for k, v in tree.items():
        keys.append(k)
        if isinstance(v, Mapping):
            keys.extend(_all_keys(v))
    return keys


def overrides_to_tree(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Python overrides as a nested dict of exactly what was given.

    A config object (``KvCacheConfig(...)``) contributes only the fields passed or assigned
    explicitly, so ``KvCacheConfig(enable_block_reuse=True)`` counts as user-set.
    """
    return {key: _plain(value) for key, value in overrides.items()}


def _plain(value: Any) -> Any:
    if attrs.has(type(value)) and hasattr(value, "_explicit"):
        return {name: _plain(getattr(value, name)) for name in sorted(explicit_fields(value))}
    if isinstance(value, Mapping):
        return {key: _plain(v) for key, v in value.items()}
    return value
