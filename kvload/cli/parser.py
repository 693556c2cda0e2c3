"""The one-line argparse parser: a usage error as one line naming the flag as typed, secrets hidden; the help layout."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kvload.cli.flags import FLAG_FOR_PATH
from kvload.cli.output import ResultStream, _drop_stdout, error_text
from pipeline.errors import OutputError, close_names, did_you_mean, prefixed


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (``error: ...``) and exits 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No prefix matching: YAML and Python refuse a key that is only a prefix of a field, and argparse expanded
        # `--host_ 0` to --host_cache_size silently (a later flag could change what a prefix means, too).
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    #: ``finish(parser, namespace)`` once a (sub)command's flags are parsed: what argparse cannot say per flag (serve
    #: takes MODEL from the end of ``--api-key K MODEL``); it may call ``parser.error``
    finish: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        """Remember the arguments so an error can name the spelling the user typed."""
        self._argv = list(sys.argv[1:] if args is None else args)
        self._refuse_repeats(self._argv)
        ns, extras = super().parse_known_args(args, namespace)
        if self.finish is not None:
            self.finish(self, ns)
        return ns, extras

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        """argparse's, but an unrecognised argument that may be a secret (the value of a mistyped ``--api-keyy``) is
        not echoed: the error line lands in terminals, CI logs and journals."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(hide_secrets(self._argv, extras, self._options()))}")
        return ns

    def _refuse_repeats(self, argv: Sequence[str]) -> None:
        """One line for a one-value flag given twice (any spelling): argparse keeps the last and drops the first
        silently. Repeatable flags (--prompt, --stop, --workload-arg) and plain switches (--json) may repeat."""
        seen: dict[str, list[str]] = {}
        switched: dict[str, tuple[str, Any]] = {}
        for arg in argv:
            if arg == "--":
                break
            action = self._option_string_actions.get(arg.split("=", 1)[0]) if arg.startswith("-") else None
            if isinstance(action, argparse._StoreConstAction) and action.dest.startswith("field__"):
                # --enable-prefix-caching and --disable_kv_cache_reuse set one field: both given, the last won
                first, const = switched.setdefault(action.dest, (arg, action.const))
                if const != action.const:
                    self.error(f"{arg}: contradicts {first}; give one")
            if action is None or not _single_valued(action):
                continue
            seen.setdefault(action.dest, []).append(arg.split("=", 1)[0])
            if len(seen[action.dest]) == 2:
                first, again = seen[action.dest]
                also = "" if again == first else f" (also as {again})"
                self.error(f"{first}: given more than once{also}; give it once")

    def error(self, message: str) -> NoReturn:
        """Print ``error: <flag>: <what>`` on one line; no usage dump."""
        required = ""
        if message.startswith("the following arguments are required: "):
            # argparse checks the required arguments before it reports the unknown ones: `plan -tiny-llama` said
            # MODEL is missing, never naming the option it did not know (where MODEL went)
            unknown = self._unknown_options()
            if unknown:
                required, message = message, f"unrecognized arguments: {' '.join(unknown)}"
        if message.startswith("argument "):
            head, _, rest = message[len("argument "):].partition(": ")
            name = typed_spelling(head.split('/'), getattr(self, '_argv', []))
            if rest.startswith("ignored explicit argument "):  # argparse's words for `--json=true`: say what it takes
                rest = f"a switch, it takes no value (got {rest.removeprefix('ignored explicit argument ')}); give " \
                       f"{name} alone"
            message = f"{name}: {rest}"
        elif message.startswith("unrecognized arguments: "):
            unknown = message.split(": ", 1)[1].split()[0]
            vllm = _vllm_difference(unknown)
            model = _dashed_model(unknown) if "MODEL" in required else None
            if model is not None:
                message += f"; did you mean the model {model}? (MODEL takes no leading dash)"
            else:
                message = vllm if vllm is not None else message + self._suggestion(unknown)
                message += f" (and {required})" if required else ""
        self.exit(2, f"error: {error_text(message)}\n")

    def _unknown_options(self) -> list[str]:
        """The arguments argparse took for options this parser does not have (secrets hidden), as it classes them."""
        argv = getattr(self, "_argv", [])
        end = argv.index("--") if "--" in argv else len(argv)
        unknown = []
        for arg in argv[:end]:
            found = self._parse_optional(arg)
            if isinstance(found, list):  # Python 3.12+: a list of interpretations
                found = found[0] if len(found) == 1 else None
            if found is not None and found[0] is None:
                unknown.append(arg)
        return hide_secrets(argv, unknown, self._options())

    def _print_message(self, message: str, file: Any = None) -> None:
        """argparse's, but help or a version stdout cannot take (``--help > /dev/full``, ``>&-``) is one line naming
        stdout and exit 1, as a result is; argparse dropped the error and exited 0."""
        if not message or file is not sys.stdout or file is sys.stderr:  # stderr (usage errors); both closed: None
            super()._print_message(message, file)
            return
        what = "the help" if message.startswith("usage:") else "the version"
        stream = ResultStream(file, "", what)
        try:
            stream.write(message)
            stream.flush()  # block-buffered (a file, /dev/full): the write failed only here
        except OutputError as exc:
            self.exit(1, f"error: {exc}\n")
        except BrokenPipeError:  # a reader already gone: as a result's (exit 141), not a failure at interpreter exit
            _drop_stdout()
            self.exit(141, "error: the output was closed before it was all written (broken pipe)\n")

    def _suggestion(self, unknown: str) -> str:
        """``; did you mean --x?`` for a mistyped option, from this parser's and its subcommands' options."""
        if not unknown.startswith("-"):
            return ""
        options = self._options()
        name = unknown.split("=", 1)[0]
        if name in options:  # an option of another subcommand
            return f"; {name} belongs to another command (see kvload --help)"
        return did_you_mean(name, options, quote=False)

    def _options(self) -> set[str]:
        """Every option string of this parser and its subcommands'."""
        options: set[str] = set()
        for action in self._actions:
            options.update(action.option_strings)
            choices = getattr(action, "choices", None)
            for sub in choices.values() if isinstance(choices, dict) else ():  # a flag's choices may be a tuple
                if isinstance(sub, argparse.ArgumentParser):
                    options.update(o for a in sub._actions for o in a.option_strings)
        return options


#: What an option's name holds when its value is a secret: --api-key, --hf-token, --db-password, --client_secret,
#: --bearer (typos too: --api-keyy); the words in _SECRET_WORDS only as whole words, so --max_tokens' values and
#: --bypass's still show.
_SECRET_PARTS = ("key", "secret", "passw", "credential", "auth", "bearer")
_SECRET_WORDS = frozenset({"token", "pass", "pwd"})
HIDDEN = "(value hidden)"


def secret_option(arg: str) -> bool:
    """Whether ``arg`` (``--name`` or ``--name=value``) names an option whose value may be a secret."""
    import re

    name = arg.split("=", 1)[0].lstrip("-").lower()
    return any(part in name for part in _SECRET_PARTS) or not _SECRET_WORDS.isdisjoint(re.split(r"[-_.]", name))


def _secret_like(arg: str, options: set[str]) -> bool:
    """Whether ``arg`` names a secret option, or is a typo of one: the known option it is closest to (as the "did you
    mean" hint finds it) takes a secret (``--hf-tokenn``, which the whole word "token" misses, is ``--hf-token``;
    ``--max-tokenz`` is ``--max-tokens``, whose value shows)."""
    if secret_option(arg):
        return True
    name = arg.split("=", 1)[0]
    if name in options:
        return False
    if any(secret_option(o) for o in prefixed(name, options)):  # --api: it may be --api-key's, hidden
        return True
    # the hint's own choice: --hf-tokn, hinted --hf-token, hides its value too
    return any(secret_option(close) for close in close_names(name, options))


def hide_secrets(argv: Sequence[str], extras: Sequence[str], options: set[str]) -> list[str]:
    """``extras`` (arguments argparse did not take, in ``argv``'s order) with what may be a secret replaced by
    :data:`HIDDEN`: the value of ``--secret-ish=VALUE``, and the arguments after a ``--secret-ish`` option up to the
    next option (the first of them even when it starts with "-": a key may)."""
    hidden: set[int] = set()
    after = False
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if i > 0 and after and argv[i - 1].startswith("-") and arg.split("=", 1)[0] not in options:
            hidden.add(i)  # the value right after a secret-named option, whatever it looks like
        elif arg.startswith("-") and len(arg) > 1:
            after = "=" not in arg and _secret_like(arg, options)
        elif after:
            hidden.add(i)
    out, at = [], 0
    for extra in extras:
        while at < len(argv) and argv[at] != extra:
            at += 1
        if at in hidden:
            out.append(HIDDEN)
        elif extra.startswith("-") and "=" in extra and _secret_like(extra, options):
            out.append(f"{extra.split('=', 1)[0]}={HIDDEN}")
        else:
            out.append(extra)
        at += 1
    return out


def _single_valued(action: argparse.Action) -> bool:
    """A flag whose second occurrence would replace the first: one value, or an on/off pair (--[no-]progress)."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return True
    return type(action).__name__ == "_StoreAction"


def _norm(option: str) -> str:
    return option.replace("-", "_")


def _vllm_difference(unknown: str) -> str | None:
    """``--gpu-memory-utilization: <how vLLM's setting differs from kvload's nearest flag>``, or None."""
    from pipeline.vllm_compat import different_meaning

    name = unknown.split("=", 1)[0]
    why = different_meaning(_norm(name).lstrip("_"), FLAG_FOR_PATH.__getitem__) if name.startswith("--") else None
    return f"{name}: {why}" if why is not None else None


def _dashed_model(unknown: str) -> str | None:
    """``tiny-llama`` for ``-tiny-llama`` (``--tiny-llama``): an unknown option that is a model name with a stray
    dash (a preset, a packaged model, a path that exists); None otherwise."""
    import os

    from models.checkpoint import packaged_models, presets

    name = unknown.lstrip("-")
    if not name or "=" in unknown:
        return None
    return name if name in presets() or name in packaged_models() or os.path.exists(name) else None


def typed_spelling(spellings: Sequence[str], argv: Sequence[str]) -> str:
    """The name of an option as the user wrote it (an alias stays an alias, ``--max-tokens`` stays dashed).

    With nothing typed, the first spelling.
    """
    typed = {_norm(a.split("=", 1)[0]): a.split("=", 1)[0] for a in argv if a.startswith("-")}  # -tp too
    for name in spellings:
        if _norm(name) in typed:
            return typed[_norm(name)]
    return spellings[0]


def typed_value(spellings: Sequence[str], argv: Sequence[str]) -> str | None:
    """The value last given to an option on the command line (``--x V`` or ``--x=V``), as typed; None if absent."""
    names = {_norm(s) for s in spellings}
    value = None
    for i, arg in enumerate(argv):
        name, eq, rest = arg.partition("=")
        if arg.startswith("-") and _norm(name) in names:
            value = rest if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return value


class HelpFormatter(argparse.HelpFormatter):
    """Wraps one-paragraph descriptions; keeps text that has its own line breaks (examples) as written."""

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        if getattr(action, "shown_required", False):  # optional to argparse, required all the same (serve's MODEL)
            return self._metavar_formatter(action, default_metavar)(1)[0]
        return super()._format_args(action, default_metavar)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)
