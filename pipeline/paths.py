"""Dotted paths (``kv_cache_config.tokens_per_block``) over nested dicts and config objects."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Map every leaf of a nested dict to its dotted path; an empty nested dict yields no leaves."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def unflatten(leaves: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`flatten`."""
    tree: dict[str, Any] = {}
    for path, value in leaves.items():
        set_in(tree, path, value)
    return tree


def get_in(tree: Any, path: str) -> Any:
    """Read a dotted path from nested dicts or attribute objects."""
    node = tree
    for part in path.split("."):
        node = node[part] if isinstance(node, Mapping) else getattr(node, part)
    return node


def set_in(tree: dict[str, Any], path: str, value: Any) -> None:
    """Write a dotted path into nested dicts, creating the intermediate dicts."""
    *parents, leaf = path.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def iter_paths(tree: Mapping[str, Any]) -> Iterator[str]:
    """The dotted paths of every leaf, in insertion order."""
    yield from flatten(tree)
