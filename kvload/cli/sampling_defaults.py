"""The model's sampling defaults as the load will resolve them, read before it: generate and serve size pools by it."""

from __future__ import annotations

from typing import Any

import attrs

from pipeline.errors import KvloadError


def peek_sampling_defaults(request: Any) -> Any:
    """The model's sampling defaults (a ``SamplingDefaults``) as the load will resolve them: its
    generation_config.json under generation_config / override_generation_config (the flags, else the --config
    file's). Read before minutes of loading, because generate and serve size the KV pools by max_tokens; a value the
    load would refuse gives none here, and the load names it in its own words."""
    from models.checkpoint import resolve_checkpoint
    from pipeline.config import GENERATION_CONFIG_AUTO, GenerationDefaults
    from pipeline.converter import structure
    from pipeline.generation_config import SamplingDefaults, resolve_sampling_defaults

    try:
        tree = request.config
        if tree is None and request.config_file is not None:
            from pipeline.sources import read_yaml

            # parse_args takes this tree: one read, so a file changed in between cannot answer twice
            tree = request.config = read_yaml(request.config_file)
        tree = tree if isinstance(tree, dict) else {}
        setting = request.overrides.get("generation_config", tree.get("generation_config", GENERATION_CONFIG_AUTO))
        override = {}
        for source in (tree, request.overrides):  # flags beat the file, key by key
            given = source.get("override_generation_config")
            if attrs.has(type(given)):  # kvload.LLM's GenerationDefaults(...): the keys it was given
                given = {k: v for k, v in attrs.asdict(given).items() if v is not None and not k.startswith("_")}
            override.update(given if isinstance(given, dict) else {})
        checkpoint = resolve_checkpoint(request.model)
        return resolve_sampling_defaults(setting, structure(override, GenerationDefaults), checkpoint.path,
                                         model=checkpoint.name)
    except (KvloadError, TypeError, ValueError):
        return SamplingDefaults()


def default_length_origin(defaults: Any) -> str:
    """Where the default ``max_tokens`` of ``defaults`` (a ``SamplingDefaults`` that has one) came from, for messages
    and audit reasons: ``override_generation_config.max_new_tokens`` (the user's, a flag or a --config key), else
    ``max_new_tokens (FILE)``."""
    from pipeline.generation_config import FROM_OVERRIDE

    if defaults.sources.get("max_tokens") == FROM_OVERRIDE:
        return "override_generation_config.max_new_tokens"
    return f"max_new_tokens ({defaults.path or 'generation_config.json'})"


def length_source(flag: str, given: bool, defaults: Any, length: int, command: str, what: str) -> tuple[str, bool]:
    """What set the default length ``length`` a command (``command``, e.g. "generate") sized its KV pools by, as what
    the user can change, and whether it is theirs to lower: ``flag`` when ``given``; the user's
    ``override_generation_config.max_new_tokens``; else ``"{what}: give {flag} below {length}, "`` and the default
    that applied (the model's ``max_new_tokens`` and its file, or the command's own), never "lower ``flag``" of a flag
    the user did not give. ``defaults`` is :func:`peek_sampling_defaults`'s answer."""
    if given:
        return flag, True
    applied = _default_applied(flag, defaults, length, command)
    if applied is None:  # the user's own override_generation_config.max_new_tokens
        return default_length_origin(defaults), True
    return f"{what}: give {flag} below {applied}", False


def length_bound(flag: str, given: bool, defaults: Any, length: int, command: str, needed: int) -> tuple[str, str]:
    """What bounds a setting by the default length ``length`` (``--min_tokens`` by max_new_tokens), as what the user
    can change: ``(bound, advice)``, for "expected at most {bound}, got N{advice}". ``flag`` ``(length)`` when
    ``given``; the user's ``override_generation_config.max_new_tokens (length)``; else the default that applied (the
    model's ``max_new_tokens`` and its file, or the command's own) and "; give ``flag`` of at least ``needed`` to raise
    it", never "``flag`` (length)" of a flag the user did not give. ``defaults`` is :func:`peek_sampling_defaults`'s
    answer."""
    if given:
        return f"{flag} ({length:,})", ""
    applied = _default_applied(flag, defaults, length, command)
    if applied is None:
        return f"{default_length_origin(defaults)} ({length:,})", ""
    return applied, f"; give {flag} of at least {needed:,} to raise it"


def _default_applied(flag: str, defaults: Any, length: int, command: str) -> str | None:
    """The default length ``length`` and where it came from when the user did not set it: the model's
    ``max_new_tokens`` and its file, or ``command``'s own default; None for the user's
    ``override_generation_config.max_new_tokens``."""
    if "max_tokens" in defaults.values:
        origin = default_length_origin(defaults)
        if origin.startswith("override_generation_config"):  # the user's own setting
            return None
        return f"{length:,}, the model's {origin}"
    return f"{length:,}, {command}'s own default (neither {flag} nor the model's max_new_tokens gives one)"
