"""``kvload generate``'s structured-output flags (``--json-schema``, ``--regex``, ``--choice``, ``--grammar``,
``--json-object``, ``--disable-any-whitespace``, ``--reasoning-parser``) → one ``StructuredOutputsParams``.

Parsing imports neither torch nor xgrammar (``kvload --help`` and ``plan`` build this parser too); only a generate
that was given one of the flags imports xgrammar, to check the spec before the model loads.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from engine.reasoning import PARSERS
from pipeline.errors import ConfigError, GenerationError
from pipeline.limits import MAX_STRUCTURED_CHARS
from pipeline.textfile import read_text_file
from pipeline.vllm_compat import reasoning_parser_named

#: The flags of each kind, in the order help lists them: (kind, spellings, metavar, help).
_KINDS: tuple[tuple[str, tuple[str, ...], str | None, str], ...] = (
    ("json", ("--json-schema", "--json_schema"), "SCHEMA",
     "the output is JSON matching this JSON schema: its text, or @FILE to read it from FILE"),
    ("regex", ("--regex",), "PATTERN", "the output fully matches this regular expression (one starting with - as "
                                      "--regex=PATTERN)"),
    ("choice", ("--choice",), "TEXT", "the output is exactly one of these strings (repeat for each choice)"),
    ("grammar", ("--grammar",), "EBNF", "the output follows this EBNF grammar (xgrammar's dialect, rule root): its "
                                        "text, or @FILE to read it from FILE"),
    ("json_object", ("--json-object", "--json_object"), None, "the output is a JSON object (any keys)"),
)
_ONE_OF = "--json-schema, --regex, --choice, --grammar or --json-object"
_FIELD = re.compile(r"^generate: structured_outputs(?:\.(\w+)(?:\[(\d+)\])?)?: (.*)$", re.DOTALL)


def add_structured_flags(p: argparse.ArgumentParser) -> None:
    """The structured-output flags, in their own group of ``generate``'s help."""
    g = p.add_argument_group("structured outputs (one kind; needs kvload[structured], i.e. xgrammar)")
    for kind, names, metavar, text in _KINDS:
        if kind == "json_object":
            g.add_argument(*names, dest="structured", action=_Structured, nargs=0, const=kind, help=text)
        else:
            g.add_argument(*names, dest="structured", action=_Structured, const=kind, metavar=metavar, help=text,
                           type=_spec_text("a JSON schema" if kind == "json" else "a grammar")
                           if kind in ("json", "grammar") else None)
    g.add_argument("--disable-any-whitespace", "--disable_any_whitespace", dest="disable_any_whitespace",
                   action=_Spelling, nargs=0, default=None,
                   help="with --json-schema or --json-object: compact JSON, no whitespace between tokens beyond one "
                        "space after : and , (small models need it; default: any whitespace, as vLLM)")
    g.add_argument("--reasoning-parser", "--reasoning_parser", dest="reasoning_parser", default=None, metavar="NAME",
                   type=reasoning_parser_name,
                   help=f"split each reply into its thinking and its answer as this reasoning parser reads them "
                        f"({', '.join(PARSERS)}; vLLM's flag; TensorRT-LLM's deepseek-r1 too; the --config file's "
                        f"reasoning_parser acts as this flag, which beats it), printed apart ('reasoning:', "
                        f"'content:'; in --json each sample's reasoning_content and content); with a "
                        f"structured-output flag the model thinks freely and the grammar holds only the answer, the "
                        f"text after </think>")
    p.set_defaults(structured=None)


class _Structured(argparse.Action):
    """Records ``(kind, spelling as typed, value)``; a second kind, or a one-value flag given twice, is one line."""

    def __call__(self, parser: Any, ns: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        given = list(getattr(ns, self.dest, None) or [])
        spelling = option_string or self.option_strings[0]
        first = next((s for k, s, _ in given if k != self.const), None)
        if first is not None:
            parser.error(f"{spelling}: given with {first}; give one kind of structured output ({_ONE_OF})")
        again = next((s for k, s, _ in given if k == self.const), None)
        if again is not None and self.const not in ("choice", "json_object"):
            also = "" if again == spelling else f" (also as {spelling})"
            parser.error(f"{again}: given more than once{also}; give it once")
        given.append((self.const, spelling, True if self.const == "json_object" else values))
        setattr(ns, self.dest, given)


class _Spelling(argparse.Action):
    """A switch that keeps the spelling it was given as (so a message can name it as typed)."""

    def __call__(self, parser: Any, ns: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        setattr(ns, self.dest, option_string or self.option_strings[0])


def reasoning_parser_name(text: str) -> str:
    """``--reasoning-parser``: kvload's name of one of :data:`engine.reasoning.PARSERS` (``kvload serve``'s names;
    TensorRT-LLM's spelling of one, ``deepseek-r1``, taken as it)."""
    name = reasoning_parser_named(text)
    if name is None:
        raise argparse.ArgumentTypeError(f"no reasoning parser {text!r} in kvload; it has: {', '.join(PARSERS)}")
    return name


def reasoning_ignored(ns: argparse.Namespace, taken: Any, has_text: bool = True) -> tuple[str, str, str] | None:
    """``(field, value, why)`` for a ``setting_ignored`` when the reasoning parser ``taken``
    (``Context.reasoning_parser``: ``--reasoning-parser``'s, else the ``--config`` file's ``reasoning_parser``) can act
    on nothing: no structured output to gate and no text to split (a model without a tokenizer prints token ids)."""
    if taken is None or ns.structured or has_text:
        return None
    return ("--reasoning-parser" if taken.source == "cli" else "reasoning_parser", taken.value,
            "the model has no tokenizer, so its replies are token ids, with no text to split into thinking and answer")


def _spec_text(what: str) -> Callable[[str], str]:
    """argparse ``type=``: the text as given, or with ``@FILE`` the UTF-8 text of FILE."""
    def parse(text: str) -> str:
        return _read(text[1:], what) if text.startswith("@") else text

    return parse


def _read(name: str, what: str) -> str:
    """The text of the file ``name`` holding ``what``; ``ArgumentTypeError`` naming it otherwise."""
    if not name:
        raise argparse.ArgumentTypeError(f"@ names no file; give @FILE, or {what} itself")

    def fail(problem: str) -> argparse.ArgumentTypeError:
        return argparse.ArgumentTypeError(f"@{name}: {problem}")

    return read_text_file(Path(name), fail, expected=f"a file holding {what}", max_chars=MAX_STRUCTURED_CHARS,
                          too_big=f"expected at most {MAX_STRUCTURED_CHARS:,} characters of {what}")


def structured_outputs(ns: argparse.Namespace) -> Any:
    """The ``StructuredOutputsParams`` the flags ask for (None: none given; with ``--reasoning-parser`` the grammar
    holds only the answer after the thinking), its spec parsed by xgrammar already:
    ``ConfigError`` naming the flag for a bad spec, a missing xgrammar or a stray ``--disable-any-whitespace``."""
    given = ns.structured or []
    compact = ns.disable_any_whitespace
    if not given:
        if compact:
            raise ConfigError(f"{compact}: applies to --json-schema and --json-object (JSON's whitespace); give one "
                              "of them")
        return None
    kind, flag, value = given[0]
    if compact and kind not in ("json", "json_object"):
        raise ConfigError(f"{compact}: applies to --json-schema and --json-object (JSON's whitespace), not {flag}")
    from engine.structured_params import StructuredOutputsParams

    try:
        with flag_named(flag):
            params = StructuredOutputsParams(**{kind: [v for _, _, v in given] if kind == "choice" else value},
                                             disable_any_whitespace=compact is not None,
                                             reasoning_parser=ns.reasoning_parser)
            from engine.structured import check_spec

            check_spec(params)  # before the weights: xgrammar parses it without the tokenizer
    except ConfigError as exc:
        if kind in ("json", "grammar") and len(value) < 4096 and os.path.isfile(value):  # a path without its @
            raise ConfigError(f"{exc}; to read the file {value}, give @{value}") from None
        raise
    return params


@contextlib.contextmanager
def flag_named(flag: str) -> Iterator[None]:
    """A ``generate: structured_outputs...: why`` error raised inside, as ``ConfigError("FLAG: why")``; the first
    ``--choice`` given is ``--choice #1``."""
    try:
        yield
    except GenerationError as exc:
        match = _FIELD.match(str(exc))
        if match is None:
            raise
        field, index, why = match.groups()
        name = "--disable-any-whitespace" if field == "disable_any_whitespace" else flag
        raise ConfigError(f"{name}{f' #{int(index) + 1}' if index is not None else ''}: {why}") from None


__all__ = ["add_structured_flags", "flag_named", "reasoning_ignored", "reasoning_parser_name", "structured_outputs"]
