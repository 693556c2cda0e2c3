"""Lazy package exports: a package's public names imported from their modules on first use (PEP 562)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, Any], *,
                 submodules: bool = False) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps a name to the module defining it.

    A name is imported once and cached in the package's ``namespace``; ``submodules`` also resolves
    ``package.<submodule>`` attribute access (``pipeline.converter``) without an explicit import.
    """

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            if submodules:
                try:
                    return importlib.import_module(f"{package}.{name}")
                except ModuleNotFoundError:
                    pass
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *exports})

    return getattr_, dir_


__all__ = ["lazy_exports"]
