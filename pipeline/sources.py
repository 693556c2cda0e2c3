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
from pipeline.limits import MAX_DEPTH, MAX_INT_DIGITS, MAX_YAML_NODES, nesting_depth, node_count
from pipeline.textfile import read_text_file


class StrictLoader(yaml.SafeLoader):
    """YAML 1.2-style booleans: only true/false (any case) are bools; ``yes``/``on`` stay strings.

    Numbers are YAML 1.2 core schema's too (PyYAML reads YAML 1.1): ``064`` is 64, not octal 52; ``0o``
    and ``0x`` are the octal and hex forms; ``1:30`` and ``2:00:00`` (1.1's base-60) and ``0b101`` stay
    strings, which the field's type check then refuses; ``1e-3`` is a float. Underscores between digits
    (``1_000``) are kept, as the command line's flags read them (Python's ``int``/``float``).

    Also strict where PyYAML is lenient: a key given twice in one mapping (a repeated
    ``kv_cache_config:`` section included) is an error instead of the last one silently winning,
    and an integer literal longer than any setting can hold is refused before it is converted.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """Refuse a key repeated in one mapping (merge keys ``<<`` may still be overridden, as YAML intends)."""
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = key_node.value
                if key in seen:
                    first = seen[key].start_mark.line + 1
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} appears twice in one mapping (first on line {first}); "
                        "keep one", key_node.start_mark)
                seen[key] = key_node
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        """An integer (YAML 1.2 core forms), refused with its line when it has more digits than any setting holds."""
        text = self.construct_scalar(node)
        if len(text) > MAX_INT_DIGITS:
            raise yaml.constructor.ConstructorError(
                None, None, f"integer of {len(text)} digits is out of range (settings are at most 2**63 - 1)",
                node.start_mark)
        match = _INT.match(text)
        if match is None:  # an explicit !!int tag on something else
            raise yaml.constructor.ConstructorError(
                None, None, f"{text!r} is not an integer (accepted: decimal digits, 0o octal or 0x hex)",
                node.start_mark)
        sign, octal, hexa, decimal = match.groups()
        value = int(octal, 8) if octal else int(hexa, 16) if hexa else int(decimal, 10)  # "064" is 64
        return -value if sign == "-" else value

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        """A float (YAML 1.2 core forms: no 1.1 base-60 ``1:30.5``)."""
        text = self.construct_scalar(node)
        special = {".inf": float("inf"), "+.inf": float("inf"), "-.inf": float("-inf"), ".nan": float("nan")}
        if text.lower() in special:
            return special[text.lower()]
        if _FLOAT.match(text) is None and _INT.match(text) is None:  # an explicit !!float tag on something else
            raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not a number", node.start_mark)
        try:
            return float(text)
        except ValueError:  # an explicit !!float on 0o/0x
            return float(self.construct_yaml_int(node))


_DIGITS = r"[0-9](?:_?[0-9])*"  # Python's rule for underscores, as the flags' int()/float() apply it
#: YAML 1.2 core schema integers (https://yaml.org/spec/1.2.2/#1032-tag-resolution), decimal with underscores.
_INT = re.compile(rf"^([-+]?)(?:0o([0-7]+)|0x([0-9a-fA-F]+)|({_DIGITS}))$")
#: YAML 1.2 core schema floats with a point or an exponent (a bare integer resolves as an int first).
_FLOAT = re.compile(rf"^[-+]?(?:\.{_DIGITS}|{_DIGITS}\.(?:{_DIGITS})?|{_DIGITS}(?=[eE]))(?:[eE][-+]?[0-9]+)?$")
_FLOAT_SPECIAL = re.compile(r"^(?:[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")

StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)

# YAML 1.1's bool, int and float resolvers go (yes/on, 064 as octal, 1:30 as 90, ...); 1.2 core ones replace them.
# So do 1.1's timestamps and "=", which 1.2's core schema reads as strings: `generation_config: 2024-01-01` (a folder
# of that name, as the flag takes it) was a datetime.date, refused as one
_YAML_11 = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float",
            "tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:value")
StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _YAML_11]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
StrictLoader.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))
StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_SPECIAL, list("-+."))


#: The longest YAML config read, in characters (UTF-8: at most four bytes each).
MAX_CONFIG_CHARS = 1_000_000


def read_yaml(path: str) -> dict[str, Any]:
    """Load a YAML config file as nested dicts; ``ConfigError`` names the file (and line) otherwise."""
    if str(path) == "":
        raise ConfigError("config file: empty path; give a YAML file (or leave --config out)", source="config_file")
    p = Path(path)

    def fail(problem: str) -> ConfigError:
        return ConfigError(f"config file {path}: {problem}", source="config_file")

    text = read_text_file(p, fail, expected="a YAML file", max_chars=MAX_CONFIG_CHARS,
                          too_big="a config of LlmArgs fields is a few hundred",
                          utf8_hint="; a YAML config is UTF-8 text")
    try:
        data = yaml.load(text, Loader=StrictLoader)
    except RecursionError:
        raise ConfigError(f"config file {path}: nested too deeply (LlmArgs nests 2 levels)",
                          source="config_file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}:" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if "'\\t'" in problem:  # PyYAML takes no tab where a token starts, also after "key:" (YAML 1.2 would)
            problem += "; use spaces there, not a tab"
        raise ConfigError(f"config file {path}:{where} malformed YAML: {problem}", source="config_file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path}: expected a mapping of LlmArgs fields at the top level, got {type(data).__name__}",
            source="config_file",
        )
    # Before anything walks or prints the tree: aliases can make a small file expand exponentially.
    if node_count(data, MAX_YAML_NODES) > MAX_YAML_NODES:
        raise ConfigError(f"config file {path}: expands to more than {MAX_YAML_NODES:,} values (anchors and "
                          "aliases counted at each use); a config of LlmArgs fields has a few dozen",
                          source="config_file")
    if nesting_depth(data) > MAX_DEPTH:
        raise ConfigError(f"config file {path}: nested deeper than {MAX_DEPTH} levels (LlmArgs nests 2)",
                          source="config_file")
    bad = [k for k in _all_keys(data) if not isinstance(k, str)]
    if bad:
        key = bad[0]  # in YAML's words: a key of null or true said Python's None, True
        shown = "null" if key is None else str(key).lower() if isinstance(key, bool) else repr(key)
        raise ConfigError(f"config file {path}: keys must be strings, got {shown}", source="config_file")
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
