"""vLLM's argparse habits for scripts: ``EngineArgs.add_cli_args(parser)`` and ``FlexibleArgumentParser``.

vLLM's example scripts build their command line as ``parser = FlexibleArgumentParser(); EngineArgs.add_cli_args(
parser); parser.set_defaults(model=...)`` and then call ``LLM(**vars(parser.parse_args()))``. Here the flags are
vLLM's spellings of what ``kvload.LLM`` takes as keywords (the same tables as ``kvload run`` / ``serve``:
:mod:`kvload.cli.flags`, :mod:`pipeline.vllm_compat`), each destined to the keyword ``LLM`` takes, and a flag not given
is left out of the namespace (argparse's SUPPRESS), so ``LLM(**vars(args))`` passes exactly what the user typed and
``LLM`` acts on it, reports it ``setting_ignored`` or refuses it in one line, as it does for the keywords. vLLM's
other two forms, ``EngineArgs(model=..., ...)`` and ``EngineArgs.from_cli_args(args)`` then ``LLM(**asdict(
engine_args))``, hold the same way only what was set. ``FlexibleArgumentParser`` reads vLLM's ``--config FILE.yaml``,
dotted JSON flags and ``-O3`` as vLLM's does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvload.cli.flags import FLAGS, VLLM_KNOB_FLAGS, VLLM_KNOB_SHORT, VLLM_LIST_FLAGS, VLLM_STORE_TRUE_FLAGS
from kvload.cli.values import integer, json_object, json_or_text, number, size
from pipeline.errors import did_you_mean
from pipeline.vllm_compat import (
    ANSWERED_NAMES,
    IGNORED,
    NO_OP_ONLY,
    REFUSED,
    SAME_MEANING,
    TAKEN_ELSEWHERE,
    VLLM_ONLY,
    different_meaning,
)

#: ``LlmArgs`` fields vLLM's ``EngineArgs`` has under the same name (``-tp`` too, as vLLM spells it)
SAME_NAME = ("dtype", "device", "generation_config", "override_generation_config", "scheduling_policy",
             "tensor_parallel_size")

#: vLLM's flags ``LLM`` takes but refuses (a meaning that differs from kvload's nearest setting), and ``LLM``'s own
#: vLLM keywords: taken by the parser so ``LLM`` answers for them in its one line, not argparse's "unrecognized"
OTHER_FLAGS: tuple[tuple[str, Callable[[str], Any], str], ...] = (
    ("gpu_memory_utilization", number, "F"),
    ("swap_space", number, "GIB"),
    ("num_gpu_blocks_override", integer, "N"),
    ("kv_cache_memory_bytes", size, "BYTES"),
    ("seed", integer, "N"),
    ("kv_events_config", json_object, "JSON"),
    ("reasoning_parser", str, "NAME"),
    ("guided_decoding_backend", str, "NAME"),
)

#: vLLM's one-dash spellings: ``kvload run``'s (``-O`` for ``--compilation-config`` too, vLLM's ``-O3``)
SHORT = VLLM_KNOB_SHORT

#: ``--help`` of the flags whose kvload flag reads otherwise (kvload's is the switch off) or that have none
OWN_HELP = {
    "enable_prefix_caching": "kvload's kv_cache_config.enable_block_reuse: prefix (block) reuse on (the default) or "
                             "off",
    "seed": "the engine seed (0 by default): samples without a seed of their own draw from one sequence it starts",
    "kv_events_config": "vLLM's KV cache event publisher, a JSON object of its KVEventsConfig keys",
    "trust_remote_code": "accepted, reported setting_ignored: kvload never runs a checkpoint's own code (the families "
                         "it serves run transformers' built-in classes)",
    "hf_overrides": "a JSON object of config.json keys set on the checkpoint's config before the model is built "
                    "(each reported as hf_config_overridden)",
    "reasoning_parser": "deepseek_r1 or qwen3: the reasoning parser of requests' structured outputs that name none "
                        "(their grammar holds only the answer after the thinking); kvload.LLM returns the whole reply "
                        "(kvload serve --reasoning-parser splits out the reasoning)",
    "guided_decoding_backend": "accepted, reported setting_ignored: kvload's structured outputs run on xgrammar",
    "speculative_config": "speculative decoding: {\"method\": \"ngram\", \"num_speculative_tokens\": N} is "
                          "kvload's n-gram drafts (max_draft_len); other methods are refused",
}

def _flag(name: str) -> str:
    """``max_model_len`` → ``--max-model-len``: vLLM's spelling (FlexibleArgumentParser takes underscores too)."""
    return "--" + name.replace("_", "-")


def _field_type(path: str) -> tuple[Callable[[str], Any] | None, str | None]:
    """How ``kvload run`` parses the flag of field ``path``: its type and metavar."""
    flag = next(f for f in FLAGS if f.path == path and f.const is None)
    return flag.type, flag.metavar


def _help(name: str) -> str:
    """What ``--help`` says of vLLM's ``name`` here: kvload's field it sets, or why it does nothing or is refused."""
    path = SAME_MEANING.get(name, name)
    flag = next((f for f in FLAGS if f.path == path), None)
    if name in OWN_HELP:
        text = OWN_HELP[name]
    elif flag is not None:
        text = flag.help if path == name else f"kvload's {path}: {flag.help}"
    elif name in IGNORED:
        text = f"accepted, reported setting_ignored: {IGNORED[name]}"
    elif name in NO_OP_ONLY:
        accepted, why = NO_OP_ONLY[name]
        text = f"only {' or '.join(map(repr, accepted))}: {why}"
    elif name in REFUSED:
        text = f"refused: {REFUSED[name]}"
    elif name in VLLM_ONLY:
        row = VLLM_ONLY[name]
        said = "accepted, reported setting_ignored" if row.policy == "ignore" else "refused (not implemented)"
        text = f"{said}: {row.why}"
    else:
        text = f"refused: {different_meaning(name, lambda p: p) or TAKEN_ELSEWHERE.get(name, '')}"
    return text.replace("%", "%%")  # argparse formats help with %


def _switch(group: Any, name: str, store_true: bool = False) -> None:
    """vLLM's on/off flag: ``--X`` / ``--no-X`` (``store_true``: ``--X`` alone, as vLLM declares it), with its one-dash
    spelling (``-ep``), which only turns it on."""
    action = "store_true" if store_true else argparse.BooleanOptionalAction
    group.add_argument(_flag(name), *SHORT.get(_flag(name), ()), dest=name, action=action,
                       default=argparse.SUPPRESS, help=_help(name))


def _closest(name: str, fields: Any) -> str:
    """What a keyword EngineArgs has no field for was likely meant as: vLLM's name of a kvload field given under
    kvload's (``max_seq_len`` is vLLM's ``max_model_len``, not the ``max_seq_len_to_capture`` it begins), else the
    nearest of vLLM's names (``max_model_lenn``), as every other refusal of a mistyped keyword suggests one."""
    vllm = [theirs for theirs, ours in SAME_MEANING.items() if name in (ours, ours.rpartition(".")[2])]
    if vllm:
        return f"; vLLM's name for it is {vllm[0]!r}"
    return did_you_mean(name, fields)


class EngineArgs:
    """vLLM's ``EngineArgs`` as its scripts use it: a dataclass of vLLM's engine arguments that ``dataclasses.asdict``
    turns into the keywords the script set (``LLM(**asdict(engine_args))``), nothing else, so ``LLM`` acts on each,
    reports it ``setting_ignored`` or refuses it in one line; :meth:`add_cli_args` and :meth:`from_cli_args`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if len(args) > 1:
            raise TypeError(f"EngineArgs: takes the model as its one positional argument, got {len(args)}; give the "
                            "others as keywords")
        if args:
            if "model" in kwargs:
                raise TypeError("EngineArgs: got the model both as its positional argument and as model=")
            kwargs = {"model": args[0], **kwargs}
        every = type(self).__dataclass_fields__
        for name, value in kwargs.items():
            if name not in every:
                raise TypeError(f"EngineArgs: unexpected keyword argument {name!r} (vLLM's engine arguments only; "
                                f"kvload's own settings go to kvload.LLM(...) as keywords){_closest(name, every)}")
            setattr(self, name, value)

    def __repr__(self) -> str:
        given = ", ".join(f"{name}={value!r}" for name, value in vars(self).items())
        return f"EngineArgs({given})"

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """vLLM's: the engine arguments of a parsed namespace (those :meth:`add_cli_args` put there; a script's own
        flags are left out), given only where the user gave the flag (or a default was set)."""
        every = cls.__dataclass_fields__
        return cls(**{name: value for name, value in vars(args).items() if name in every})

    @staticmethod
    def add_cli_args(parser: Any) -> Any:
        """Add ``--model`` and vLLM's engine flags ``kvload.LLM`` takes to ``parser`` (or an argument group), each
        destined to ``LLM``'s keyword and absent from the namespace when not given; returns ``parser``."""
        parser.add_argument("--model", dest="model", default=argparse.SUPPRESS, metavar="MODEL",
                            help="a preset or packaged model (see `kvload models`), a checkpoint directory, a .gguf "
                                 "file, or a Hugging Face id in the local cache")
        for name, path in SAME_MEANING.items():
            if name == "enable_prefix_caching":
                _switch(parser, name)
                continue
            kind, metavar = _field_type(path)
            parser.add_argument(_flag(name), dest=name, type=kind, metavar=metavar, default=argparse.SUPPRESS,
                                help=_help(name))
        for name in SAME_NAME:
            kind, metavar = _field_type(name)
            short = ("-tp",) if name == "tensor_parallel_size" else ()
            parser.add_argument(_flag(name), *short, dest=name, type=kind, metavar=metavar,
                                default=argparse.SUPPRESS, help=_help(name))
        for name, kind, metavar in OTHER_FLAGS:
            parser.add_argument(_flag(name), dest=name, type=kind, metavar=metavar, default=argparse.SUPPRESS,
                                help=_help(name))
        # one or more names, as vLLM takes them: LLM answers for the keyword (kvload serve's flag, not LLM's)
        parser.add_argument("--served-model-name", dest="served_model_name", nargs="+", metavar="NAME",
                            default=argparse.SUPPRESS, help=_help("served_model_name"))
        for flag, key, kind, metavar in VLLM_KNOB_FLAGS:
            if kind is None:
                _switch(parser, key, store_true=flag in VLLM_STORE_TRUE_FLAGS)
            else:
                parser.add_argument(flag, *SHORT.get(flag, ()), dest=key, type=kind, metavar=metavar,
                                    nargs="+" if flag in VLLM_LIST_FLAGS else None, default=argparse.SUPPRESS,
                                    help=_help(key))
        return parser



class _GivenFields:
    """``EngineArgs.__dataclass_fields__``: every field on the class, only those set on an instance, so
    ``dataclasses.asdict(engine_args)`` (and ``vars``) hold what the script gave, not vLLM's defaults, which are not
    kvload's (an unset field reads None)."""

    def __init__(self, every: dict[str, dataclasses.Field[Any]]) -> None:
        self.every = every

    def __get__(self, obj: Any, owner: Any = None) -> dict[str, dataclasses.Field[Any]]:
        if obj is None:
            return self.every
        given = vars(obj)
        return {name: f for name, f in self.every.items() if name in given}


def _engine_args_class(cls: type) -> type:
    """``cls`` made the dataclass of ``model`` and every vLLM engine argument kvload knows (each None unless set)."""
    names = dict.fromkeys(("model", *SAME_MEANING, *SAME_NAME, *(n for n, _, _ in OTHER_FLAGS), "served_model_name",
                           *(key for _, key, _, _ in VLLM_KNOB_FLAGS), *ANSWERED_NAMES, *VLLM_ONLY))
    cls.__annotations__ = dict.fromkeys(names, Any)
    for name in names:
        setattr(cls, name, None)
    made = dataclasses.dataclass(init=False, repr=False)(cls)
    made.__dataclass_fields__ = _GivenFields(made.__dataclass_fields__)  # type: ignore[misc]
    return made


EngineArgs = _engine_args_class(EngineArgs)  # type: ignore[misc]


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's ``FlexibleArgumentParser``: an ``ArgumentParser`` that also takes ``--max_model_len`` for
    ``--max-model-len``, ``--config FILE.yaml`` (a YAML mapping of flags, read before the command line, which wins),
    dotted JSON flags (``--hf-overrides.rope_theta 1e6`` for ``--hf-overrides '{"rope_theta": 1e6}'``, ``key+`` for a
    list), ``-O3`` for ``-O '{"level": 3}'`` and ``--help=WORD``, as vLLM's does."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        """argparse's, on the arguments as vLLM's parser rewrites them: the config file's first, underscored options
        dashed, dotted ones gathered into one JSON object per option."""
        given = [str(a) for a in (sys.argv[1:] if args is None else args)]
        for i, arg in enumerate(given):
            if arg.startswith("--help=") and "--help" in self._option_string_actions:
                self._help_search = arg.removeprefix("--help=").lower().replace("_", "-")
                given[i] = "--help"
        if "--config" not in self._option_string_actions:  # a script's own --config stays its own
            given = self._with_config_file(given)
        return super().parse_known_args(self._dotted([self._dashed(a) for a in self._level(given)]), namespace)

    _help_search: str | None = None

    def format_help(self) -> str:
        """argparse's help, or with vLLM's ``--help=WORD`` the group titled WORD or the flags whose names hold it
        (``--help=all``: all of them)."""
        word, self._help_search = self._help_search, None  # this one help only
        if word is None or word == "all":
            return super().format_help()
        formatter = self._get_formatter()
        group = next((g for g in self._action_groups if (g.title or "").lower() == word), None)
        found = group._group_actions if group is not None else [
            a for a in self._actions if any(word in o.lower() for o in a.option_strings)]
        if not found:
            formatter.add_text(f"No group or arguments matching {word!r}. Use --help to see them all.")
            return formatter.format_help()
        formatter.start_section(group.title if group is not None else f"Arguments matching {word!r}")
        formatter.add_arguments(found)
        formatter.end_section()
        return formatter.format_help()

    def _dashed(self, arg: str) -> str:
        """``--a_b[=v]`` → ``--a-b[=v]`` (``--a_b.c`` → ``--a-b.c``) where only the dashed spelling is an option (a
        script's own ``--a_b`` stays); anything else as it is."""
        if not arg.startswith("--") or "_" not in arg:
            return arg
        key, eq, value = arg.partition("=")
        head, dot, tail = key.partition(".")
        dashed = head.replace("_", "-")
        options = self._option_string_actions
        if head in options or dashed not in options:
            return arg
        return dashed + dot + tail + eq + value

    def _level(self, given: list[str]) -> list[str]:
        """vLLM's ``-O3`` / ``-O=3`` / ``-O 3``: the compilation level, ``-O '{"level": 3}'`` (where ``-O`` is an
        option, as ``add_cli_args`` makes it)."""
        if "-O" not in self._option_string_actions:
            return given
        out: list[str] = []
        for i, arg in enumerate(given):
            if arg.startswith("-O") and arg != "-O" and not arg.startswith("-O."):
                level = arg[3:] if arg[2:3] == "=" else arg[2:]
                out += ["-O", json.dumps({"level": json_or_text(level)})]
            elif arg == "-O" and given[i + 1:i + 2] and given[i + 1] in ("0", "1", "2", "3"):
                out.append("-O")
                given[i + 1] = json.dumps({"level": int(given[i + 1])})
            else:
                out.append(arg)
        return out

    def _dotted(self, given: list[str]) -> list[str]:
        """``--opt.a.b V`` (or ``=V``) gathered into ``--opt '{"a": {"b": V}}'`` after the other arguments, V read as
        JSON (else as text), ``--opt.k+ x,y`` appending to a list; only for this parser's options."""
        out: list[str] = []
        objects: dict[str, dict[str, Any]] = {}
        rest = iter(given)
        for arg in rest:
            key, eq, value = arg.partition("=")
            head, dot, path = key.partition(".")
            if not (arg.startswith("-") and dot and head in self._option_string_actions):
                out.append(arg)
                continue
            if not eq:
                value = next(rest, None)  # type: ignore[assignment]
                if value is None:
                    self.error(f"argument {key}: expected one argument")
            item: Any = json.dumps(value.split(",")) if path.endswith("+") else value
            keys = path.removesuffix("+").split(".")
            if not all(keys):
                self.error(f"argument {key}: a dotted flag names keys, {head}.KEY[.KEY...] VALUE")
            _merge(objects.setdefault(head, {}), keys, json_or_text(item))
        for head, obj in objects.items():
            out += [head, json.dumps(obj)]
        return out

    def _with_config_file(self, given: list[str]) -> list[str]:
        """vLLM's ``--config FILE.yaml``: the file's keys as flags, put before the command line's (which win)."""
        at = next((i for i, a in enumerate(given) if a == "--config" or a.startswith("--config=")), None)
        if at is None:
            return given
        if given[at] == "--config":
            if at + 1 >= len(given):
                self.error("argument --config: expected one argument (a .yaml or .yml file of engine flags)")
            path, end = given[at + 1], at + 2
        else:
            path, end = given[at].removeprefix("--config="), at + 1
        others = given[:at] + given[end:]
        if any(a == "--config" or a.startswith("--config=") for a in others):
            self.error("argument --config: given more than once (one YAML file of engine flags)")
        return self._config_flags(path) + others

    def _config_flags(self, path: str) -> list[str]:
        """The flags a ``--config`` YAML mapping stands for (``key: true`` → ``--key``, ``false`` → ``--no-key``
        where there is one, a list → ``--key a b``, a mapping → its JSON, null → not given)."""
        import yaml  # only when a --config is given

        if not path.endswith((".yaml", ".yml")):
            self.error(f"argument --config: {path!r} is not a .yaml or .yml file (vLLM's rule)")
        try:
            with open(path, encoding="utf-8") as f:
                config = yaml.safe_load(f)
        except OSError as exc:
            self.error(f"argument --config: cannot read {path!r}: {exc.strerror or exc}")
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            line = f" (line {where.line + 1})" if where is not None else ""
            self.error(f"argument --config: {path!r} is not valid YAML{line}")
        if config is None:
            return []
        if not isinstance(config, dict):
            self.error(f"argument --config: {path!r} must hold a mapping of flag names to values, got "
                       f"{type(config).__name__}")
        flags: list[str] = []
        for key, value in config.items():
            if not isinstance(key, str) or not key or key.startswith("-"):
                self.error(f"argument --config: {path!r}: key {key!r} is not a flag name (max-model-len: 4096)")
            flag = "--" + key
            if value is None:
                continue
            if isinstance(value, bool):
                no = "--no-" + key.replace("_", "-")
                flags += [flag] if value else ([no] if no in self._option_string_actions else [])
            elif isinstance(value, list):
                flags += [flag, *map(str, value)] if value else []
            elif isinstance(value, dict):
                flags += [flag, json.dumps(value)]
            else:
                flags += [flag, str(value)]
        return flags


def _merge(obj: dict[str, Any], keys: list[str], value: Any) -> None:
    """``value`` put at ``obj[k1][k2]...``; a list there already extended (``key+``), nested objects made on the way."""
    *parents, leaf = keys
    for k in parents:
        if not isinstance(obj.get(k), dict):
            obj[k] = {}
        obj = obj[k]
    if isinstance(value, list) and isinstance(obj.get(leaf), list):
        obj[leaf] += value
    else:
        obj[leaf] = value


__all__ = ["EngineArgs", "FlexibleArgumentParser"]
