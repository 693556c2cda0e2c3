"""A preset's ``config.json`` read without transformers: what ``plan`` needs, at no import cost.

Importing transformers (and through it torch) costs seconds; a plan reads a dozen config fields.
The embedded presets store transformers' complete ``to_dict()`` output, so their JSON already holds
every field ``AutoConfig`` would fill in, and a read-only attribute view of it answers the same.
``tests/test_config_view.py`` checks that each preset plans identically through this view and
through ``AutoConfig``. Anything that builds a model (weights, generation) asks for the real
transformers config with :func:`transformers_config`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ConfigView:
    """Attribute access to a config dict; nested ``*_config`` dicts become views too.

    Assigning a field (as code that tweaks a transformers config does) changes the view and is
    carried over to the transformers config :func:`transformers_config` builds.
    """

    def __init__(self, data: dict[str, Any], path: Path | None = None) -> None:
        self.__dict__.update(_data=dict(data), _path=path, _changed={})

    def __setattr__(self, name: str, value: Any) -> None:
        self._data[name] = value
        self._changed[name] = value

    @property
    def source_dir(self) -> Path | None:
        """The directory whose ``config.json`` this view reads (None for a nested config)."""
        return self._path

    def __getattr__(self, name: str) -> Any:
        data = self.__dict__.get("_data")
        if data is None or name.startswith("__"):
            raise AttributeError(name)
        if name == "dtype" and "dtype" not in data and "torch_dtype" in data:
            return data["torch_dtype"]  # transformers 5 reads an older file's torch_dtype into dtype
        if name not in data:
            raise AttributeError(f"config has no {name!r}")
        value = data[name]
        if name.endswith("_config") and isinstance(value, dict) and "model_type" in value:
            return ConfigView(value)
        return value

    def get_text_config(self) -> Any:
        """The decoder's config, as transformers' ``PretrainedConfig.get_text_config`` gives it."""
        inner = self._data.get("text_config")
        return ConfigView(inner) if isinstance(inner, dict) else self

    @property
    def transformers_class_name(self) -> str:
        """The name of transformers' config class this view stands for (``LlamaConfig``; a ``*_text`` model type's is
        ``*TextConfig``), from ``architectures[0]``, as errors about the config name it."""
        arch = (self._data.get("architectures") or ["Pretrained"])[0]
        stem = arch.split("For", 1)[0] if "For" in arch else arch
        text = "Text" if str(self._data.get("model_type", "")).endswith("_text") else ""
        return f"{stem}{text}Config"

    def to_dict(self) -> dict[str, Any]:
        """A copy of the config's fields."""
        return dict(self._data)

    def __repr__(self) -> str:
        return f"ConfigView({self._data.get('model_type')!r}, {self._path})"


def takes_overrides(cfg: Any, overrides: dict[str, Any]) -> bool:
    """Whether the light view ``cfg`` can take ``hf_overrides`` as transformers' config would, so a plan needs no
    transformers import: each replaces a top-level int, bool, float or string with one of the same type, or a list with
    one whose items are of the types the list held (the strict config's type check passes: the class's type hint took
    the old value, and no alias, property or nested config is involved), or sets ``rope_theta`` /
    ``partial_rotary_factor`` where the config keeps no such field and carries it into a ``rope_parameters`` object
    (``models.hf_overrides``; kvload's own checks then read it on either path).

    What code sets on the view is set again on the config :func:`transformers_config` builds where weights load;
    ``tests/test_hf_overrides.py`` checks each preset's fields this admits against transformers' config class."""
    if not isinstance(cfg, ConfigView):
        return False
    data = cfg.to_dict()
    return all(_takes(data, key, value) for key, value in overrides.items())


def _takes(data: dict[str, Any], key: str, value: Any) -> bool:
    """Whether the light view of ``data`` takes ``key``: ``value`` as transformers' config would."""
    if key in _TRANSFORMERS_OWN:
        return False
    if key not in data:  # a new key: only the rope keys carried into rope_parameters (no field of the class)
        return key in _ROPE_CARRIED and isinstance(data.get("rope_parameters"), dict)
    old = data[key]
    if type(value) in (int, bool, float, str):
        return type(old) is type(value)
    if type(value) is list and type(old) is list and old:
        kinds = {type(item) for item in old}
        return kinds <= {int, bool, float, str} and all(type(item) in kinds for item in value)
    return False


#: Keys ``models.hf_overrides`` carries into ``rope_parameters`` (transformers 5 reads them there), which the
#: presets' config classes keep no field for: setting one sets a plain attribute on either path
_ROPE_CARRIED = frozenset({"rope_theta", "partial_rotary_factor"})


#: Keys transformers' config keeps in its own way, whatever the JSON says: its bookkeeping and the properties of
#: ``PreTrainedConfig`` (transformers 5), whose setters check or translate what they are given
_TRANSFORMERS_OWN = frozenset({"dtype", "torch_dtype", "transformers_version", "output_attentions", "num_labels",
                               "use_return_dict", "name_or_path", "_attn_implementation", "_experts_implementation",
                               "rope_scaling", "sub_configs", "model_type", "architectures",
                               # a value check beyond the type's (LlamaConfig's interval on it): transformers checks it
                               "initializer_range"})


def transformers_config(cfg: Any) -> Any:
    """The transformers config object for ``cfg``: a :class:`ConfigView` is read through ``AutoConfig``."""
    if not isinstance(cfg, ConfigView):
        return cfg
    from transformers import AutoConfig  # deferred: only what builds a model pays for it

    if cfg.source_dir is None:
        raise ValueError("a nested ConfigView has no directory to read through AutoConfig")
    real = AutoConfig.from_pretrained(str(cfg.source_dir), trust_remote_code=False, local_files_only=True)
    for name, value in cfg._changed.items():  # what code assigned on the view
        setattr(real, name, value)
    return real
