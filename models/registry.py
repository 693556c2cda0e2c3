"""The model registry: architecture name (``architectures[0]``) → ``ModelSpec`` class."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from models.spec import ModelSpec

S = TypeVar("S", bound="type[ModelSpec]")

_REGISTRY: dict[str, type[ModelSpec]] = {}


def register_model(*architectures: str, replace: bool = False) -> Callable[[S], S]:
    """Class decorator: serve these architecture names with the decorated ``ModelSpec`` subclass.

    Registering a name twice is an error unless ``replace=True`` (a user overriding a built-in).
    """
    if not architectures:
        raise TypeError("register_model needs at least one architecture name")

    def wrap(cls: S) -> S:
        from models.spec import ModelSpec

        if not (isinstance(cls, type) and issubclass(cls, ModelSpec)):
            raise TypeError(f"register_model: {cls!r} is not a ModelSpec subclass")
        for arch in architectures:
            current = _REGISTRY.get(arch)
            if current is not None and current is not cls and not replace:
                raise ValueError(
                    f"architecture {arch!r} is already served by {current.__name__}; pass replace=True to override"
                )
        for arch in architectures:
            _REGISTRY[arch] = cls
        cls.architectures = tuple(dict.fromkeys((*getattr(cls, "architectures", ()), *architectures)))
        return cls

    return wrap


def unregister_model(*architectures: str) -> None:
    """Forget these architecture names (tests and plugins that register temporarily)."""
    for arch in architectures:
        _REGISTRY.pop(arch, None)


def spec_class_for(architecture: str) -> type[ModelSpec] | None:
    """The spec class registered for an architecture name, or None."""
    return _REGISTRY.get(architecture)


def registered() -> dict[str, type[ModelSpec]]:
    """A copy of the registry, sorted by architecture name."""
    return dict(sorted(_REGISTRY.items()))
