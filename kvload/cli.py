"""The ``kvload`` command line. It only parses, calls the API, and prints.

Results go to stdout, logs to stderr (so ``--json | jq`` works). Errors are one line on stderr:
exit 2 for usage, config, model and route errors, 1 for runtime failures; a traceback only with
``--debug``. torch and transformers are imported only by subcommands that need them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import attrs

from pipeline.config import ATTENTION_BACKENDS, LINEAR_BACKENDS, SIZE_HELP, parse_size
from pipeline.errors import ConfigError, KvloadError, OutputError, first_line
from pipeline.limits import MAX_INT, MAX_INT_DIGITS, MAX_LOGPROBS, MAX_N, short_text
from pipeline.signals import Terminated, handle_sigterm, release_sigterm  # at import: main's first line is in its try
from pipeline.text import one_line

# --- text-layer value parsers (argparse `type=`) ---------------------------------------------


def tri_state(text: str) -> bool | str:
    """``auto`` | ``true`` | ``false`` → ``"auto"`` | True | False."""
    word = text.strip().lower()
    if word == "auto":
        return "auto"
    if word in ("true", "false"):
        return word == "true"
    raise argparse.ArgumentTypeError(f"expected auto, true or false, got {text!r}")


class _TooBig(argparse.ArgumentTypeError):
    """An integer past 2**63 - 1: a flag with a smaller range of its own says that range instead."""


def integer(text: str) -> int:
    """A whole number (``1_000`` allowed), at most 2**63 - 1 in size (what torch and the budget arithmetic take)."""
    digits = text.replace("_", "").strip()
    if not digits.isascii():  # int() reads any script's digits ('٣٣', '１６'), where a YAML config reads a string
        raise argparse.ArgumentTypeError(f"expected an integer in the digits 0-9, got {short_text(text)}")
    try:
        if len(digits.lstrip("+-")) > MAX_INT_DIGITS:  # never hand int() a 5,000-digit string
            raise ValueError(text)
        value = int(digits)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {short_text(text)}") from None
    if abs(value) > MAX_INT:
        raise _TooBig(f"expected an integer of at most 2**63 - 1, got {short_text(text)}")
    return value


def field_integer(text: str) -> int:
    """An integer for a flag that sets an LlmArgs field: the field's own check bounds it (at most 2**63 - 1, or its
    range), so --max_draft_len 99999999999999999999999 gets the verdict --max_draft_len 65 and a config file get
    ("from 0 to 64"), not "at most 2**63 - 1"."""
    try:
        return integer(text)
    except _TooBig:
        return int(text.replace("_", "").strip())  # integer() checked the digits: 0-9, at most MAX_INT_DIGITS


def number(text: str) -> float:
    """A finite decimal number (``inf``, ``nan`` and overflowing exponents such as ``1e400`` refused)."""
    if not text.strip().isascii():  # float() reads any script's digits ('０.５'), as int() does
        raise argparse.ArgumentTypeError(f"expected a number in the digits 0-9, got {short_text(text)}")
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {short_text(text)}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {short_text(text)}")
    return value


def size(text: str) -> int:
    """A byte count: ``8589934592``, ``8GiB`` (= ``8G``), ``512MB`` (at most 2**63 - 1)."""
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {SIZE_HELP} (at most 2**63 - 1), got {short_text(text)}") from None


def json_object(text: str) -> dict[str, Any]:
    """A JSON object (``'{"temperature": 0.5}'``): standard JSON only (no NaN), each key once."""
    from pipeline.limits import unique_keys

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not standard JSON")

    twice = unique_keys(lambda message: argparse.ArgumentTypeError(f"{message}; keep one"))
    try:
        value = json.loads(text, object_pairs_hook=twice, parse_constant=constant)
    except (ValueError, RecursionError):  # JSONDecodeError, NaN, an integer literal past Python's digit limit
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"temperature\": 0.5}}', got "
                                         f"{short_text(text)}")
    return value


@attrs.frozen
class Flag:
    """One plan/run flag: its TensorRT-LLM spelling, the dotted field it sets, and how to parse it."""

    name: str
    path: str
    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    const: Any = None  # for switches: the value the flag sets when present
    metavar: str | None = None
    # other spellings users bring (trtllm-serve, trtllm-bench, vLLM's where the meaning is the same: each also dashed)
    aliases: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        """argparse destination, distinct from every other option's."""
        return "field__" + self.path.replace(".", "__")


FLAGS: tuple[Flag, ...] = (
    Flag("--use_kv_cache_manager_v2", "kv_cache_config.use_kv_cache_manager_v2",
         "KV cache manager V2: auto (let the model decide), true or false; absent = unset", tri_state,
         metavar="{auto,true,false}"),
    Flag("--kv_cache_free_gpu_memory_fraction", "kv_cache_config.free_gpu_memory_fraction",
         "fraction of free device memory for the KV cache, in (0, 1]", number, metavar="F",
         aliases=("--kv_cache_fraction", "--kv_cache_free_gpu_mem_fraction")),
    Flag("--max_tokens", "kv_cache_config.max_tokens", "cap the KV cache at this many tokens", field_integer,
         metavar="N"),
    Flag("--max_gpu_total_bytes", "kv_cache_config.max_gpu_total_bytes",
         "cap the KV cache at this many bytes (0 = no cap; 8GiB = 8G = 8*2**30, 8GB = 8*10**9)", size,
         metavar="BYTES"),
    Flag("--tokens_per_block", "kv_cache_config.tokens_per_block", "tokens per KV block", field_integer, metavar="N",
         aliases=("--block_size",)),
    Flag("--disable_kv_cache_reuse", "kv_cache_config.enable_block_reuse",
         "turn prefix (block) reuse off", const=False, aliases=("--no_enable_prefix_caching",)),
    # vLLM's switch on: the default already, so it only overrides a --config file's enable_block_reuse: false
    Flag("--enable_prefix_caching", "kv_cache_config.enable_block_reuse",
         "turn prefix (block) reuse on (the default; vLLM's spelling)", const=True),
    Flag("--host_cache_size", "kv_cache_config.host_cache_size",
         "V2 host tier size in bytes (0 = none; absent = auto: sized, or none where the accelerator recomputes a token "
         "for less than its copy out and back)", size, metavar="BYTES"),
    Flag("--event_buffer_max_size", "kv_cache_config.event_buffer_max_size",
         "KV cache events (block stored/removed/cleared) kept for readers; 0 = off (default)", field_integer,
         metavar="N"),
    Flag("--kv_cache_dtype", "kv_cache_config.dtype", "KV cache dtype: auto or a dtype name", str, metavar="DTYPE"),
    Flag("--dtype", "dtype", "model dtype: auto, float32, float16, bfloat16", str, metavar="DTYPE"),
    Flag("--device", "device", "where to build: auto (cuda when available), cuda, cuda:N or cpu", str,
         metavar="{auto,cuda,cuda:N,cpu}"),
    Flag("--max_batch_size", "max_batch_size", "most requests scheduled at once", field_integer, metavar="N",
         aliases=("--max_num_seqs",)),
    Flag("--max_seq_len", "max_seq_len", "longest sequence (default: the checkpoint's)", field_integer, metavar="N",
         aliases=("--max_model_len",)),
    Flag("--max_num_tokens", "max_num_tokens", "most tokens in one forward (prefill chunk)", field_integer, metavar="N",
         aliases=("--max_num_batched_tokens",)),
    Flag("--max_beam_width", "max_beam_width", "beam width (V2 serves only 1)", field_integer, metavar="N"),
    Flag("--scheduling_policy", "scheduling_policy", "fcfs (default: arrival order) or priority (vLLM's: a request's "
         "priority, lower first, orders admission; V2 also moves out lower-ranked running requests for it)", str,
         metavar="{fcfs,priority}"),
    Flag("--attention_backend", "attention_backend", "paged attention of generate: auto, flex (compiled "
         "FlexAttention over the pools), sdpa (gather + SDPA), triton (decode steps on a paged decode kernel, "
         "CUDA) or cpu_kernel (decode steps on a paged decode kernel compiled for this CPU)", str,
         choices=ATTENTION_BACKENDS),
    Flag("--linear_backend", "linear_backend", "projections of generate: auto, torch (F.linear) or cpu_kernel "
         "(steps of few rows on a matmul kernel compiled for this CPU; float32)", str, choices=LINEAR_BACKENDS),
    Flag("--max_draft_len", "max_draft_len", "speculative decoding by n-gram lookup: draft tokens copied from "
         "earlier in the sequence, verified in the step that computes the last token (greedy or sampled); 0 = off "
         "(default)", field_integer, metavar="N"),
    Flag("--max_matching_ngram_size", "max_matching_ngram_size", "with --max_draft_len: the longest suffix "
         "looked up among earlier tokens (default 2)", field_integer, metavar="N"),
    Flag("--speculation_max_batch_size", "speculation_max_batch_size", "with --max_draft_len: draft only while at "
         "most this many requests run (default 1; more rows per step cost more than drafts save on a CPU)",
         field_integer, metavar="N"),
    Flag("--generation_config", "generation_config", "sampling defaults of what the command generates, for each "
         "setting a request leaves unset: auto (the checkpoint's generation_config.json; default), vllm (ignore it: "
         "kvload's built-in defaults) or a directory holding a generation_config.json (vLLM's flag)", str,
         metavar="{auto,vllm,DIR}"),
    Flag("--override_generation_config", "override_generation_config", "generation_config.json keys laid over the "
         "model's sampling defaults, as a JSON object: temperature, top_p, top_k, min_p, repetition_penalty, "
         "max_new_tokens, do_sample (vLLM's flag), e.g. '{\"temperature\": 0.5}'", json_object, metavar="JSON"),
    Flag("--tp_size", "tensor_parallel_size",
         "tensor-parallel ranks (launch that many with torchrun; plan alone shows rank 0's view)", field_integer,
         metavar="N", aliases=("--tensor_parallel_size", "-tp")),
)
#: vLLM's engine flags kvload has no counterpart for (a launch script copied from ``vllm serve``): each goes into the
#: command line's tree under vLLM's key, where ``pipeline.trtllm_compat.split_ignored`` reports it as
#: ``setting_ignored`` with the reason (``pipeline.vllm_compat``), or refuses a value kvload cannot honour
#: (``--quantization awq``, ``--trust-remote-code``). (flag, key, type, metavar; a None type is a switch.)
VLLM_KNOB_FLAGS: tuple[tuple[str, str, Callable[[str], Any] | None, str | None], ...] = (
    ("--enforce-eager", "enforce_eager", None, None),
    ("--max-seq-len-to-capture", "max_seq_len_to_capture", integer, "N"),
    ("--compilation-config", "compilation_config", json_object, "JSON"),
    ("--disable-log-stats", "disable_log_stats", None, None),
    ("--async-scheduling", "async_scheduling", None, None),
    ("--enable-sleep-mode", "enable_sleep_mode", None, None),
    ("--disable-custom-all-reduce", "disable_custom_all_reduce", None, None),
    ("--distributed-executor-backend", "distributed_executor_backend", str, "NAME"),
    ("--max-logprobs", "max_logprobs", integer, "N"),
    ("--download-dir", "download_dir", str, "DIR"),
    ("--enable-chunked-prefill", "enable_chunked_prefill", None, None),
    ("--quantization", "quantization", str, "METHOD"),
    ("--cpu-offload-gb", "cpu_offload_gb", number, "GIB"),
    ("--hf-overrides", "hf_overrides", json_object, "JSON"),
    ("--trust-remote-code", "trust_remote_code", None, None),
    ("--disable-async-output-proc", "disable_async_output_proc", None, None),
    ("--skip-tokenizer-init", "skip_tokenizer_init", None, None),
    ("--tokenizer", "tokenizer", str, "NAME"),
    ("--tokenizer-mode", "tokenizer_mode", str, "MODE"),
    ("--revision", "revision", str, "REV"),
)

#: the switches of ``VLLM_KNOB_FLAGS`` vLLM declares ``store_true`` (no ``--no-`` form there either)
VLLM_STORE_TRUE_FLAGS = frozenset({"--disable-log-stats"})


def _knob_dest(key: str) -> str:
    return "vllm_knob__" + key


FLAG_FOR_PATH: dict[str, str] = {}
for _f in FLAGS:  # the first flag of a field (--disable_kv_cache_reuse, not its --enable_prefix_caching)
    FLAG_FOR_PATH.setdefault(_f.path, _f.name)


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
        import difflib

        if not unknown.startswith("-"):
            return ""
        options = self._options()
        name = unknown.split("=", 1)[0]
        if name in options:  # an option of another subcommand
            return f"; {name} belongs to another command (see kvload --help)"
        prefixed = {_norm(o): o for o in sorted(options) if o.startswith(name)}  # "_" sorts after "-": kept
        if len(prefixed) == 1:  # what argparse's prefix matching used to expand it to
            return f"; did you mean {next(iter(prefixed.values()))}?"
        close = difflib.get_close_matches(name, sorted(options), n=1, cutoff=0.75)
        return f"; did you mean {close[0]}?" if close else ""


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
            after = "=" not in arg and secret_option(arg)
        elif after:
            hidden.add(i)
    out, at = [], 0
    for extra in extras:
        while at < len(argv) and argv[at] != extra:
            at += 1
        if at in hidden:
            out.append(HIDDEN)
        elif extra.startswith("-") and "=" in extra and secret_option(extra):
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


def _dashed(name: str) -> str:
    """``--max_tokens`` → ``--max-tokens``; a one-dash name (vLLM's ``-tp``) as it is."""
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def _underscored(name: str) -> str:
    """``--max-tokens`` → ``--max_tokens``: a dashed flag's other spelling (:func:`_dashed`'s inverse)."""
    return "--" + name[2:].replace("-", "_")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """MODEL, the config flags (with dashed aliases), and the output/logging options."""
    p.add_argument("model", metavar="MODEL",
                   help="a preset or packaged model (see `kvload models`), a checkpoint directory, a .gguf file, "
                        "or a Hugging Face id in the local cache")
    group = p.add_argument_group("configuration (TensorRT-LLM spelling; dashed and vLLM aliases accepted)")
    for f in FLAGS:
        names = list(dict.fromkeys(n for name in (f.name, *f.aliases) for n in (name, _dashed(name))))
        if f.const is not None:
            group.add_argument(*names, dest=f.dest, action="store_const", const=f.const, default=None, help=f.help)
        else:
            group.add_argument(*names, dest=f.dest, type=f.type, choices=f.choices, metavar=f.metavar,
                               default=None, help=f.help)
    knobs = p.add_argument_group("vLLM engine options kvload does not act on (each accepted with a setting_ignored "
                                 "warning saying why, or refused where its value would change the model)")
    for name, key, kind, metavar in VLLM_KNOB_FLAGS:
        names = (name, _underscored(name))
        if kind is None:
            knobs.add_argument(*names, dest=_knob_dest(key), action="store_const", const=True, default=None,
                               help=argparse.SUPPRESS)
            if name not in VLLM_STORE_TRUE_FLAGS:  # vLLM's config booleans are --X/--no-X (BooleanOptionalAction)
                knobs.add_argument("--no-" + name[2:], "--no_" + key, dest=_knob_dest(key), action="store_const",
                                   const=False, default=None, help=argparse.SUPPRESS)
        else:
            knobs.add_argument(*names, dest=_knob_dest(key), type=kind, metavar=metavar, default=None,
                               help=argparse.SUPPRESS)
    group.add_argument("--config", "--extra_llm_api_options", "--extra-llm-api-options", dest="config",
                       metavar="FILE.yaml", help="YAML file of LlmArgs fields (CLI flags win); TensorRT-LLM options "
                                                 "kvload does not act on are accepted with a warning each")
    out = p.add_argument_group("output")
    out.add_argument("--audit-log", "--audit_log", dest="audit_log", metavar="FILE.jsonl",
                     help="write every event as JSON Lines, hash-chained (HMAC with KVLOAD_AUDIT_KEY when set); "
                          "written only when the command succeeds")
    out.add_argument("--force", action="store_true",
                     help="replace an --audit-log (or plan --chart) file that already exists (without it, an "
                          "existing file is refused)")
    out.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    add_log_flags(out)


def add_log_flags(p: Any) -> None:
    """``--log-format``, ``--log-level`` and ``--debug``."""
    p.add_argument("--log-format", "--log_format", dest="log_format", choices=("console", "json"), default=None,
                   help="how events are logged on stderr (default: $KVLOAD_LOG_FORMAT, else console)")
    p.add_argument("--log-level", "--log_level", dest="log_level", choices=("debug", "info", "warning", "error"),
                   default=None, help="least severe event logged on stderr (default: $KVLOAD_LOG_LEVEL, else warning)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def cli_overrides(ns: argparse.Namespace) -> dict[str, Any]:
    """The flags the user gave, as a nested dict of fields (absent flags are absent, not defaults)."""
    tree: dict[str, Any] = {}
    for f in FLAGS:
        value = getattr(ns, f.dest, None)
        if value is None:
            continue
        *parents, leaf = f.path.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    for _, key, _, _ in VLLM_KNOB_FLAGS:
        value = getattr(ns, _knob_dest(key), None)
        if value is not None:
            tree[key] = value
    return tree


# --- subcommands ---------------------------------------------------------------------------


def _request(ns: argparse.Namespace, load_weights: bool = False, kv_events_reader: bool = True,
             generates: bool = False) -> Any:
    """The command's LoadRequest; ``kv_events_reader=False`` where the command reads no KV cache events,
    ``generates=True`` where it generates through what it loads."""
    from pipeline.context import LoadRequest

    return LoadRequest(model=ns.model, overrides=cli_overrides(ns), source="cli", config_file=ns.config,
                       load_weights=load_weights, kv_events_reader=kv_events_reader, generates=generates)


def _audit_subscribers(ns: argparse.Namespace) -> list[Any]:
    """The ``--audit-log`` sink, checked before any work; ``main`` publishes it only when the command succeeds.

    An existing file is refused unless ``--force`` (an audit log is evidence: it is never replaced
    without being asked); a FIFO, device or directory is refused even with ``--force``.
    """
    if ns.audit_log is None:
        return []
    from pipeline.audit import JsonlSink, check_output_path
    from pipeline.ranks import rank_audit_path, ranks_from_env

    path = rank_audit_path(ns.audit_log, ranks_from_env())  # under torchrun rank N writes <stem>.rankN<suffix>
    check_output_path(path, "--audit-log", replace=ns.force)
    ns.audit_sink = JsonlSink(path, replace=ns.force, flag="--audit-log")
    return [ns.audit_sink]


#: The flags that name a file a command writes (argparse dest → spellings), and those naming one it reads.
OUTPUT_FILE_FLAGS: dict[str, tuple[str, ...]] = {
    "audit_log": ("--audit-log", "--audit_log"),
    "chart": ("--chart",),
    "kv_events_file": ("--kv-events-file", "--kv_events_file"),
}
INPUT_FILE_FLAGS: dict[str, tuple[str, ...]] = {
    "config": ("--config", "--extra_llm_api_options", "--extra-llm-api-options"),
    "chat_template": ("--chat-template", "--chat_template"),
}


def check_distinct_files(ns: argparse.Namespace, argv: Sequence[str]) -> None:
    """``ConfigError`` when one file is named by two flags of which one writes it: ``--chart X --audit-log X`` drew
    the chart, then refused the audit as "appeared while the run was going" (exit 2, with the result on stdout and
    the chart left behind); ``--audit-log`` on the ``--config`` file (with ``--force``) replaced the config with the
    log; ``serve``'s ``--kv-events-file`` and ``--audit-log`` on one file wrote both streams into it."""
    import os

    from pipeline.run import same_file

    outputs = [(dest, getattr(ns, dest, None)) for dest in OUTPUT_FILE_FLAGS]
    inputs = [(dest, getattr(ns, dest, None)) for dest in INPUT_FILE_FLAGS]
    outputs = [(d, v) for d, v in outputs if isinstance(v, str) and v]
    inputs = [(d, v) for d, v in inputs if isinstance(v, str) and v and os.path.isfile(v)]  # a template text is none

    def flag(dest: str) -> str:
        return typed_spelling({**OUTPUT_FILE_FLAGS, **INPUT_FILE_FLAGS}[dest], argv)

    for i, (dest, path) in enumerate(outputs):
        for other, other_path in outputs[i + 1:]:
            if same_file(path, other_path):
                raise ConfigError(f"{flag(other)} {other_path}: is also the {flag(dest)} file; give each "
                                  "output a file of its own")
        for other, other_path in inputs:
            if same_file(path, other_path):
                raise ConfigError(f"{flag(dest)} {path}: is the {flag(other)} file this command reads; "
                                  "give the output a file of its own")


def prints(result: Any) -> bool:
    """Whether this process prints the result: always alone; under torchrun only rank 0 (the others log)."""
    ranks = result.context.ranks
    return ranks is None or ranks.is_first


def print_result(text: str) -> None:
    """Print a command's result on stdout in one write, newline included.

    ``print(text)`` writes the newline on its own (PYTHONUNBUFFERED=1, or a text past Python's 8 KiB buffer): a
    reader that left after the first write (``| head``) made the second fail, so a document that fitted the pipe
    whole still ended in exit 141 about half the time. One write lands whole before the reader can leave.
    """
    sys.stdout.write(text + "\n")


def cmd_plan(ns: argparse.Namespace) -> int:
    """Resolve (stages 1–5) and print the result; allocate nothing."""
    from kvload.api import execute
    from kvload.render import render_result, run_document
    from stages import plan_stages

    audit = _audit_subscribers(ns)
    compare = ns.compare or ns.chart is not None
    if ns.chart is not None:  # before planning: a bad extension or an existing file (without --force) fails now
        from engine.capacity import check_chart_path

        check_chart_path(ns.chart, replace=ns.force)
    result = execute(_request(ns, kv_events_reader=False), plan_stages(), subscribers=audit)
    comparison = None
    if compare:  # on every rank: planning the variants runs the ranks' collectives (agree_ranks, the budget)
        from engine.capacity import compare_capacity, draw_chart

        comparison = compare_capacity(result)
        if ns.chart is not None and prints(result):
            draw_chart(comparison, ns.chart, replace=ns.force)
    if not prints(result):
        return 0
    if ns.json:
        doc = run_document(result)
        if comparison is not None:
            doc["compare"] = comparison.to_dict()
        print_result(json.dumps(doc, indent=2, default=str))
    else:
        text = render_result(result)
        if comparison is not None:
            text += "\n\n" + "\n".join(comparison.render())
        print_result(text)
    return 0


def cmd_simulate(ns: argparse.Namespace) -> int:
    """Replay a synthetic workload through the routed manager (or V1 and V2) and print the metrics."""
    from engine.simulator import simulate

    params: dict[str, int] = {}
    for key, value in ns.workload_args or ():
        if key in params and params[key] != value:  # the last one silently winning hid a typo'd sweep
            raise ConfigError(f"--workload-arg {key}: given twice ({params[key]} and {value}); give it once")
        params[key] = value
    audit = _audit_subscribers(ns)
    report = simulate(ns.model, ns.workload, requests=ns.requests, seed=ns.seed, params=params,
                      compare=ns.compare, config_file=ns.config, source="cli", subscribers=audit,
                      progress=ns.progress, hardware=ns.hardware, **cli_overrides(ns))
    report.check_finished()  # --compare where no manager finished: exit 2, as one manager's stall does
    from pipeline.ranks import ranks_from_env

    if ranks_from_env().is_first:  # under torchrun every rank simulates in lockstep; rank 0 prints
        print_result(json.dumps(report.to_dict(), indent=2, default=str) if ns.json else report.render())
    return 0


def _check_output_path(flag: str, path: str) -> None:
    from pipeline.audit import check_output_path

    check_output_path(path, flag, replace=True)


def cmd_run(ns: argparse.Namespace) -> int:
    """Run every stage: build the KV cache manager, print the plan and what was allocated, release it."""
    from kvload.api import execute
    from kvload.render import allocation_document, render_allocation, render_result, run_document
    from stages import load_stages

    audit = _audit_subscribers(ns)
    with execute(_request(ns, kv_events_reader=False), load_stages(), subscribers=audit) as result:
        if not prints(result):
            return 0
        if ns.json:
            print_result(json.dumps({**run_document(result), "allocated": allocation_document(result)}, indent=2,
                                    default=str))
        else:
            print_result("\n".join([render_result(result), "", *render_allocation(result)]))
    return 0


#: Prompt tokens per request that ``kvload generate`` budgets for on CPU when no KV bound is given.
GENERATE_PROMPT_ALLOWANCE = 1024


def cmd_generate(ns: argparse.Namespace) -> int:
    """Load the weights, build the routed KV manager, generate for every prompt, stream, end with throughput."""
    from engine.prompts import check_text
    from engine.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams
    from kvload.api import execute
    from pipeline.context import DEFAULT_MAX_TOKENS_FIELD, CallerDefault
    from stages import load_stages

    audit = _audit_subscribers(ns)
    prompts = ns.prompts or []
    if not prompts:
        raise ConfigError("--prompt: give at least one --prompt TEXT (or --prompt-ids IDS for a model without a "
                          "tokenizer)")
    if ns.chat and any(not isinstance(p, str) for p in prompts):  # refused here, not after seconds of loading
        raise ConfigError("--chat: wraps each --prompt TEXT in the chat template, and --prompt-ids gives token ids, "
                          "which it cannot wrap; give the conversation's text with --prompt, or leave out --chat")
    for i, prompt in enumerate(prompts):  # text no tokenizer could encode, named before anything loads
        if isinstance(prompt, str):
            check_text(f"prompt {i}", prompt)
    request = _request(ns, load_weights=True, kv_events_reader=False, generates=True)  # prints outputs, no KV events
    request.token_ids = {f"prompt {i} (--prompt-ids)": p for i, p in enumerate(prompts) if not isinstance(p, str)}
    request.token_ids |= {"--stop_token_ids": ns.stop_token_ids}  # both checked against the config's vocab_size
    if any(isinstance(p, str) for p in prompts):  # a model without a tokenizer is refused before its weights load
        request.text_prompts = "--prompt"
    if ns.config is not None:  # read once: its max_seq_len sizes the pools below, and parse_args takes the same tree
        from pipeline.sources import read_yaml

        request.config = read_yaml(ns.config)
    # a flag left out takes the model's sampling default (its generation_config.json, as the load will resolve it),
    # else kvload's; a flag given wins. The others are no generation_config keys: always the flags' values
    sampling = {name: value for name, value in (
        ("max_tokens", ns.max_new_tokens), ("temperature", ns.temperature), ("top_p", ns.top_p), ("top_k", ns.top_k),
        ("repetition_penalty", ns.repetition_penalty), ("min_p", ns.min_p)) if value is not None}
    sampling.update(seed=ns.seed, stop=ns.stop, stop_token_ids=ns.stop_token_ids, n=ns.n, logprobs=ns.logprobs,
                    ignore_eos=ns.ignore_eos, presence_penalty=ns.presence_penalty,
                    frequency_penalty=ns.frequency_penalty, min_tokens=ns.min_tokens)
    peeked = peek_sampling_defaults(request)
    model = peeked.values
    max_new_tokens = sampling.get("max_tokens", model.get("max_tokens", DEFAULT_MAX_TOKENS))
    length = "--max_new_tokens" if "max_tokens" in sampling or "max_tokens" not in model else \
        default_length_origin(peeked)
    if ns.min_tokens > max_new_tokens:
        raise ConfigError(f"--min_tokens: expected at most {length} ({max_new_tokens}), got {ns.min_tokens}")
    from kvload.structured_flags import flag_named, reasoning_ignored, structured_outputs

    structured = structured_outputs(ns)  # its spec parsed by xgrammar: a bad one is refused before the weights load
    if structured is not None:
        sampling["structured_outputs"] = structured
    SamplingParams.build(None, sampling, model)  # checked before anything loads
    # Applies only when nothing else bounds the KV budget (CPU without --max_tokens/--max_gpu_total_bytes) and the
    # user set no default_max_tokens. Capped at the integer bound: a product past it is refused by the budget naming
    # --max_new_tokens (the reason), not as a field the user never typed, and it must not fail a run whose
    # --max_tokens leaves the default unused.
    request.caller_defaults[DEFAULT_MAX_TOKENS_FIELD] = CallerDefault(
        *_generate_pool_tokens(len(prompts), ns.n, max_new_tokens, _user_max_seq_len(request), length),
        sequences=len(prompts) * ns.n)  # the checkpoint's max_seq_len caps it too, once resolved
    with execute(request, load_stages(), subscribers=audit) as result:  # generation events reach the audit too
        ignored = reasoning_ignored(ns, has_text=result.tokenizer is not None)
        split = ns.reasoning_parser if ignored is None else None  # each reply as (reasoning, content), as served
        if ignored is not None and result.bus is not None:
            from pipeline.events import SettingIgnored

            result.bus.emitter("generate")(SettingIgnored(field=ignored[0], value=ignored[1], reason=ignored[2]))
        first = prints(result)  # under torchrun every rank generates; rank 0 prints
        printer = None if ns.json or not first else _TokenPrinter(result.tokenizer,
                                                                  several=len(prompts) > 1 or ns.n > 1,
                                                                  labelled_samples=ns.n > 1,
                                                                  logprobs=ns.logprobs is not None,
                                                                  reasoning_parser=split)
        # what only the loaded model can refuse (no tokenizer to match the grammar on) names the flag too
        with flag_named(ns.structured[0][1]) if structured is not None else contextlib.nullcontext():
            outputs = result.executor.run(prompts, salt=ns.salt, chat=ns.chat, on_delta=printer, **sampling)
        stats = result.executor.last_stats
        if not first:
            pass
        elif ns.json:
            print_result(json.dumps({"model": result.model.to_dict(), "route": result.route.to_dict(),
                                     "outputs": [_output_document(o, split) for o in outputs],
                                     "stats": stats.to_dict()},
                                    indent=2, default=str))
        else:
            print_result(stats.line())
    return 0


def _output_document(output: Any, reasoning_parser: str | None) -> dict[str, Any]:
    """One prompt's ``--json`` form; under ``--reasoning-parser`` each sample also has its ``reasoning_content`` (and
    vLLM's newer ``reasoning``) and ``content``, as ``kvload serve`` names a chat reply's parts."""
    document = output.to_dict()
    if reasoning_parser is not None:
        from engine.reasoning import split_reasoning

        for sample in document["outputs"]:
            reasoning, content = split_reasoning(reasoning_parser, sample["text"] or "")
            sample.update(reasoning_content=reasoning, reasoning=reasoning, content=content)
    return document


def _generate_pool_tokens(prompts: int, n: int, max_new_tokens: int, max_seq_len: int | None,
                          length: str = "--max_new_tokens") -> tuple[int, str, str]:
    """generate's default pool size, its source and reason: each prompt's ``n`` samples of ``max_new_tokens`` plus
    the prompt allowance, but never more than ``n`` sequences of ``max_seq_len`` (no sample grows past it).
    ``length`` names where max_new_tokens came from (the flag, or the model's generation_config.json)."""
    per_prompt = n * max_new_tokens + GENERATE_PROMPT_ALLOWANCE
    flags, formula = length, f"(n x max_new_tokens + {GENERATE_PROMPT_ALLOWANCE})"
    if max_seq_len is not None and n * max_seq_len < per_prompt:
        per_prompt = n * max_seq_len
        flags = "--max_seq_len"
        formula = f"n x max_seq_len (less than n x max_new_tokens + {GENERATE_PROMPT_ALLOWANCE})"
    tokens = min(MAX_INT, prompts * per_prompt)
    return tokens, "generate", (f"{flags}, --n or the number of prompts (generate sizes the pools for prompts x "
                                f"{formula} = {tokens} tokens when no --max_tokens is given)")


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


def _user_max_seq_len(request: Any) -> int | None:
    """The max_seq_len the user set (the flag, else the --config file's), or None: the checkpoint's applies later."""
    if request.overrides.get("max_seq_len") is not None:
        return int(request.overrides["max_seq_len"])
    value = (request.config or {}).get("max_seq_len")  # a bad one is reported by parse_args, naming the file
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class _TokenPrinter:
    """``on_delta`` of ``kvload generate``: one sample streams token by token; several print as each ends.

    With ``--logprobs`` each sample's tokens follow it, one line each: the token, its logprob, then the top
    alternatives (the other most likely tokens, with theirs).
    """

    def __init__(self, tokenizer: Any, several: bool, labelled_samples: bool, logprobs: bool = False,
                 reasoning_parser: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.reasoning_parser = reasoning_parser  # print each reply's thinking and answer apart, each labelled
        self._split: Any = None  # one streamed reply under the parser: its ReasoningText
        self._section: str | None = None  # the label the streamed reply prints under now
        self.has_text = tokenizer is not None  # False: a model without a tokenizer prints token ids
        self.several = several
        self.labelled_samples = labelled_samples  # "[i.j]" rather than "[i]"
        self.logprobs = logprobs
        self.parts: dict[tuple[int, int], list[str]] = {}  # each sample's token ids (no tokenizer) or text pieces
        self.scores: dict[tuple[int, int], list[tuple[int, dict[int, float]]]] = {}  # (token, its entry) per token

    def __call__(self, delta: Any) -> None:
        key = (delta.index, delta.sample)
        if self.logprobs and delta.logprobs is not None:
            self.scores.setdefault(key, []).extend(zip(delta.token_ids, delta.logprobs, strict=True))
        label = f"{delta.index}.{delta.sample}" if self.labelled_samples else f"{delta.index}"
        if not self.several and self.reasoning_parser is not None and self.has_text:
            self._stream_split(delta.text, delta.finish_reason is not None)
        elif not self.several:
            piece = delta.text if self.has_text else " ".join(map(str, delta.token_ids)) + " "
            sys.stdout.write(piece + ("\n" if delta.finish_reason is not None else ""))
            sys.stdout.flush()
        else:
            parts = self.parts.setdefault(key, [])
            parts.extend([delta.text] if self.has_text else map(str, delta.token_ids))
            if delta.finish_reason is not None and self.reasoning_parser is not None and self.has_text:
                from engine.reasoning import split_reasoning

                reasoning, content = split_reasoning(self.reasoning_parser, "".join(parts))
                lines = [] if reasoning is None else [f"[{label}] reasoning: {reasoning}"]
                print("\n".join([*lines, f"[{label}] content:" + (f" {content}" if content else "")]), flush=True)
            elif delta.finish_reason is not None:
                print(f"[{label}] {('' if self.has_text else ' ').join(parts)}", flush=True)
        if delta.finish_reason is not None and self.logprobs:
            self._print_logprobs(label if self.several else None, self.scores.pop(key, []))

    def _stream_split(self, text: str, last: bool) -> None:
        """One streamed reply under ``--reasoning-parser``: each piece under its label (``reasoning:``,
        ``content:``), a new line and label where the reply passes from one to the other; a marker, or the end of a
        piece that may still become one, is never printed. A reply that ends with no answer ends on an empty
        ``content:`` line."""
        from engine.reasoning import ReasoningText

        if self._split is None:
            self._split = ReasoningText(self.reasoning_parser)
        pieces = [self._split.read(text)]
        if last:
            pieces.append(self._split.finish_read())
        out = []
        for before, reasoning, answer in pieces:
            for section, piece in (("content", before), ("reasoning", reasoning), ("content", answer)):
                if piece:
                    if section != self._section:
                        out.append(("\n" if self._section else "") + f"{section}: ")
                        self._section = section
                    out.append(piece)
        if last:
            if self._section != "content":
                out.append(("\n" if self._section else "") + "content:")
            out.append("\n")
            self._split = self._section = None
        sys.stdout.write("".join(out))
        sys.stdout.flush()

    def _print_logprobs(self, label: str | None, scores: list[tuple[int, dict[int, float]]]) -> None:
        """One line per token: ``token logprob | alternative logprob, ...`` (most likely first)."""
        lines = [f"logprobs{f' [{label}]' if label else ''}: token logprob | top alternatives"]
        for token, entry in scores:
            others = sorted(((t, lp) for t, lp in entry.items() if t != token), key=lambda x: -x[1])
            alternatives = ", ".join(f"{self._token(t)} {lp:.3f}" for t, lp in others)
            lines.append(f"  {self._token(token)} {entry[token]:.3f}" + (f" | {alternatives}" if alternatives else ""))
        print("\n".join(lines), flush=True)

    def _token(self, token: int) -> str:
        """A token as its text, quoted (spaces and newlines show), or its id without a tokenizer."""
        if self.tokenizer is None:
            return str(token)
        return json.dumps(self.tokenizer.decode([token]), ensure_ascii=False)


class _PromptAction(argparse.Action):
    """Appends ``--prompt`` and ``--prompt-ids`` values to one list, in command-line order."""

    def __call__(self, parser: Any, ns: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        setattr(ns, self.dest, [*(getattr(ns, self.dest) or []), values])


def token_ids(text: str) -> list[int]:
    """``1,2,3`` or ``"1 2 3"`` → ``[1, 2, 3]``."""
    parts = text.split(",") if "," in text else text.split()
    parts = [p.strip() for p in parts]
    # an empty item (1,,3) is a typo, not a skip; str.isdigit() is true of '²' and '①', which int() refuses (argparse
    # then said "invalid token_ids value"), and of other scripts' digits; a 5,000-digit id int() refuses too
    if not parts or not all(p.isascii() and p.isdigit() and len(p) <= MAX_INT_DIGITS for p in parts):
        raise argparse.ArgumentTypeError(f"expected token ids such as 1,2,3 (the digits 0-9), got {short_text(text)}")
    return [int(p) for p in parts]


def _bounded(kind: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except _TooBig:
            if ok(MAX_INT):  # the range reaches 2**63 - 1: that is the bound the value passed
                raise
            # --n 99999999999999999999999 was "expected an integer of at most 2**63 - 1", where --n 200 was
            # "expected an integer in [1, 128]": true, but not what the flag accepts
            raise argparse.ArgumentTypeError(f"expected {expected}, got {short_text(text)}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_GENERATE_EPILOG = """\
Output: with one prompt, the reply streams to stdout as it is generated (token ids, space separated,
for a model without a tokenizer); with several, each reply is printed as soon as it finishes, as
"[i] text" (i = the prompt's position; "[i.j]" for its sample j with --n). With --logprobs K each reply is
followed by its tokens, one a line: the token (quoted text, or its id), its logprob, then the other tokens
among the K most likely with theirs. With --reasoning-parser each reply's thinking and answer print apart, after
"reasoning:" and "content:" (in --json: each sample's reasoning_content and content). The last line gives prompt,
reused and generated tokens, wall time and tokens/s. --json prints one document instead (outputs, timings, stats).

KV budget: on CPU with neither --max_tokens nor --max_gpu_total_bytes, generate sizes the pools for
prompts x (n x max_new_tokens + 1024) tokens, at most prompts x n x max_seq_len (--max_seq_len, the --config
file's, else the checkpoint's: no sample grows past it; the kv_budget_computed event says so); requests that do
not fit at once wait (V1) or are suspended to the host tier (V2).

examples:
  kvload generate smollm2-135m --chat --prompt "What is the capital of France?"
  kvload generate smollm2-135m --prompt "Once upon a time" --prompt "The sky is" --max_new_tokens 32
  kvload generate tiny-llama --prompt-ids 1,2,3,4 --temperature 0.8 --top_p 0.9 --seed 7
  kvload generate smollm2-135m --prompt "The sky is" --n 3 --temperature 0.8 --top_k 50 --stop .
  kvload generate smollm2-135m --chat --prompt "Is Paris in France?" --choice yes --choice no
  kvload generate smollm2-135m --chat --prompt "The capital of France, in JSON" --json-schema @city.json
  kvload generate ./ckpt --use_kv_cache_manager_v2 true --max_tokens 4096 --audit-log gen.jsonl
"""


def add_generate_command(sub: Any) -> None:
    """``generate``: load weights, build the routed KV manager, generate with continuous batching."""
    p = sub.add_parser(
        "generate", help="load the weights and generate text through the routed KV cache manager",
        formatter_class=HelpFormatter, epilog=_GENERATE_EPILOG,
        description="Run all stages with weights, then generate for every prompt at once through the routed "
                    "KV cache manager and scheduler (continuous batching: prefill chunks and decodes share "
                    "each forward). Generation events join the audit log.")
    add_model_flags(p)
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", dest="prompts", action=_PromptAction, metavar="TEXT",
                   help="a prompt (repeat for several; needs a tokenizer)")
    g.add_argument("--prompt-ids", "--prompt_ids", dest="prompts", action=_PromptAction, type=token_ids,
                   metavar="IDS", help="a prompt as token ids, e.g. 1,2,3 (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap each --prompt in the tokenizer's chat template")
    from engine.sampling_params import (  # one default length for the CLI and Python
        DEFAULT_MAX_TOKENS,
        MAX_REPETITION_PENALTY,
        MIN_REPETITION_PENALTY,
    )

    g.add_argument("--max_new_tokens", "--max-new-tokens", dest="max_new_tokens", default=None,
                   metavar="N", type=_bounded(integer, lambda v: v >= 1, "an integer >= 1"),
                   help=f"most tokens generated per sample (SamplingParams.max_tokens; default: the model's, else "
                        f"{DEFAULT_MAX_TOKENS}); --max_tokens is the KV cache budget")
    g.add_argument("--temperature", default=None, metavar="T",
                   type=_bounded(number, lambda v: v >= 0, "a number >= 0"),
                   help="sampling temperature; 0 = greedy (default: the model's, else 0)")
    g.add_argument("--top_p", "--top-p", dest="top_p", default=None, metavar="P",
                   type=_bounded(number, lambda v: 0 < v <= 1, "a number in (0, 1]"),
                   help="nucleus sampling: keep the most likely tokens up to this probability (default: the "
                        "model's, else 1)")
    g.add_argument("--top_k", "--top-k", dest="top_k", default=None, metavar="K",
                   type=_bounded(integer, lambda v: v >= -1, "an integer >= 1, or 0 / -1 for all tokens"),
                   help="sample among the K most likely tokens only (default: the model's, else 0 = all)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a sample when its text contains TEXT (repeatable; TEXT is not printed)")
    g.add_argument("--stop_token_ids", "--stop-token-ids", dest="stop_token_ids", default=[], metavar="IDS",
                   type=token_ids, help="end a sample at any of these token ids, e.g. 2,7")
    g.add_argument("--n", default=1, metavar="N", type=_bounded(integer, lambda v: 1 <= v <= MAX_N,
                                                                f"an integer in [1, {MAX_N}]"),
                   help=f"samples per prompt (at most {MAX_N}), sharing the prompt's KV blocks (one prefill); "
                        "with --temperature > 0")
    g.add_argument("--logprobs", default=None, metavar="K",
                   type=_bounded(integer, lambda v: 0 <= v <= MAX_LOGPROBS, f"an integer in [0, {MAX_LOGPROBS}]"),
                   help="report the K most likely tokens' log-probabilities per generated token (printed after "
                        "each reply; in --json, each sample's logprobs)")
    g.add_argument("--seed", default=None, metavar="S", type=_bounded(integer, lambda v: v >= 0, "an integer >= 0"),
                   help="sampling seed (each prompt's sample j uses S + j, vLLM's rule); absent = a fresh random seed")
    g.add_argument("--salt", default=None, metavar="TEXT",
                   help="prefix-reuse scope: prompts under different salts never share cached blocks")
    g.add_argument("--ignore_eos", "--ignore-eos", dest="ignore_eos", action="store_true",
                   help="keep generating past end-of-sequence until --max_new_tokens (benchmarks)")
    g.add_argument("--repetition_penalty", "--repetition-penalty", dest="repetition_penalty", default=None,
                   metavar="R", type=_bounded(number, lambda v: MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY,
                                              f"a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]"),
                   help="divide a positive logit (multiply a negative one) of each token already in the prompt or "
                        "output by R, greedy or sampled (default: the model's, else 1 = off)")
    g.add_argument("--presence_penalty", "--presence-penalty", dest="presence_penalty", default=0.0, metavar="P",
                   type=_bounded(number, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
                   help="subtract P from the logit of each token the output already holds (default: 0 = off)")
    g.add_argument("--frequency_penalty", "--frequency-penalty", dest="frequency_penalty", default=0.0,
                   metavar="F", type=_bounded(number, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
                   help="subtract F per time the output holds a token from its logit (default: 0 = off)")
    g.add_argument("--min_tokens", "--min-tokens", dest="min_tokens", default=0, metavar="N",
                   type=_bounded(integer, lambda v: v >= 0, "an integer >= 0"),
                   help="no EOS, stop token or stop string ends a sample before it has N tokens (default: 0)")
    g.add_argument("--min_p", "--min-p", dest="min_p", default=None, metavar="P",
                   type=_bounded(number, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
                   help="sample only among tokens at least P times as likely as the most likely one (default: the "
                        "model's, else 0)")
    from kvload.structured_flags import add_structured_flags

    add_structured_flags(p)
    p.set_defaults(func=cmd_generate, prompts=None)


def _read_audit(path: str) -> Any:
    from kvload.explain import read_log  # streamed: a long run's log is too big to hold

    return read_log(path)


def flag_aliases() -> dict[str, str]:
    """Each flag's name, with and without dashes, in either spelling → the field it sets."""
    out: dict[str, str] = {}
    for f in FLAGS:
        for name in (f.name, _dashed(f.name), *f.aliases, *map(_dashed, f.aliases)):
            out[name] = out[name.lstrip("-")] = f.path
    return out


def cmd_explain(ns: argparse.Namespace) -> int:
    """Print each field's chain of changes recorded in an audit log."""
    from kvload.explain import explain, render_explain

    chains = explain(_read_audit(ns.audit), ns.fields or None, aliases=flag_aliases())
    print_result(json.dumps({c["field"]: c for c in chains}, indent=2, default=str) if ns.json
                 else render_explain(chains))
    return 0


def cmd_audit(ns: argparse.Namespace) -> int:
    """Summarize an audit log; with ``--verify`` exit 1 when its events do not reproduce the final args."""
    from kvload.explain import render_summary, summarize, verify_log

    log = _read_audit(ns.audit)
    summary = summarize(log, ns.audit)
    check = verify_log(log) if ns.verify else None
    if ns.json:
        print_result(json.dumps({**summary, "verify": check} if check is not None else summary, indent=2,
                                default=str))
    else:
        print_result(render_summary(summary, check))
    if check is not None and not check["ok"]:
        sys.stdout.flush()
        print(error_text(f"error: {ns.audit}: does not verify: {check['problems'][0]}"
                       + (f" (and {len(check['problems']) - 1} more)" if len(check["problems"]) > 1 else "")),
              file=sys.stderr)
        return 1
    return 0


def cmd_models(ns: argparse.Namespace) -> int:
    """List registered architectures, their spec classes and model defaults, and the presets."""
    from kvload.catalog import catalog, render_catalog

    doc = catalog()
    print_result(json.dumps(doc, indent=2, default=str) if ns.json else render_catalog(doc))
    return 0


_EXAMPLES = """\
examples:
  kvload plan tiny-deepseek-v4                         why "auto" became true, and the route
  kvload plan ./my-checkpoint --config serve.yaml --use_kv_cache_manager_v2 false --json | jq .route
  kvload plan tiny-llama --audit-log plan.jsonl        keep every event as JSON Lines
  kvload explain plan.jsonl use_kv_cache_manager_v2    the chain: default → file → CLI → model → auto → route
  kvload audit plan.jsonl --verify                     summary; exit 1 if the events do not replay
  kvload models                                        architectures, spec classes, model defaults, presets
  kvload run tiny-deepseek-v4 --max_tokens 65536       build the V2 pools, one per layer group, and show them
  kvload plan tiny-gemma3 --max_tokens 16384 --compare V1 vs V2 at one budget (--chart FILE.png draws it)
  kvload generate smollm2-135m --chat --prompt "What is the capital of France?"
  kvload simulate tiny-llama --workload shared-prefix --compare --requests 256 --max_tokens 65536
  kvload serve smollm2-135m --port 8000                OpenAI-compatible server (needs kvload[serve])

exit status: 0 ok, 2 bad input (usage, config, model, route, audit file), 1 runtime failure or a log
that does not verify. Results go to stdout, logs to stderr.
"""


def add_inspection_commands(sub: Any) -> None:
    """``explain``, ``audit`` and ``models``: read audit logs and the model registry; nothing is loaded."""
    fmt = HelpFormatter
    p = sub.add_parser(
        "explain", help="each field's chain of changes, from an audit log", formatter_class=fmt,
        description="For each FIELD, every step recorded in AUDIT.jsonl: the framework default, the config "
                    "file, the CLI or API, model defaults (applied or skipped), auto resolution, and the route, "
                    "each with its stage, source, old → new and reason. With no FIELD, every field an event "
                    "changed.",
        epilog="FIELD is a dotted path (kv_cache_config.free_gpu_memory_fraction), a unique leaf name\n"
               "(free_gpu_memory_fraction) or a plan flag's name (kv_cache_fraction).\n\n"
               "example:\n  kvload plan tiny-deepseek-v4 --audit-log v4.jsonl\n"
               "  kvload explain v4.jsonl use_kv_cache_manager_v2")
    p.add_argument("audit", metavar="AUDIT.jsonl", help="an audit log written with --audit-log")
    p.add_argument("fields", metavar="FIELD", nargs="*", default=[],  # a default: argparse lists it as required
                   help="fields to explain (default: every changed field)")
    p.add_argument("--json", action="store_true", help="print {field: {final, chain: [...]}} as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser(
        "audit", help="summarize an audit log; --verify replays it", formatter_class=fmt,
        description="Summarize AUDIT.jsonl: the model and spec, what the user set, the route and why, every "
                    "\"auto\" resolution, every model default applied or skipped, and the warnings.",
        epilog="--verify folds the value-changing events over the framework defaults and compares the\n"
               "result with the final args recorded by pipeline_finished; it also checks that no event\n"
               "was removed or reordered, that the recorded route matches executor_routed, that events\n"
               "restating each other agree, and the hash chain (the 'chain' line says what it proved:\n"
               "sha256, hmac-sha256 with KVLOAD_AUDIT_KEY, or no chain for logs written before chaining).\n"
               "Exit status: 0 verified, 1 does not verify, 2 unreadable or not a kvload audit log.")
    p.add_argument("audit", metavar="AUDIT.jsonl", help="an audit log written with --audit-log")
    p.add_argument("--verify", action="store_true", help="replay the events; exit 1 if they disagree with the log")
    p.add_argument("--json", action="store_true", help="print the summary (and verdict) as one JSON document")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser(
        "models", help="registered architectures, spec classes, model defaults, presets",
        description="List every registered architecture name with the ModelSpec class that serves it and "
                    "the model defaults it proposes, then every preset and packaged model with what it "
                    "supports (plan, build, generate). Reads no checkpoint.")
    p.add_argument("--json", action="store_true", help="print the listing as one JSON document")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=cmd_models)


def build_parser() -> argparse.ArgumentParser:
    """The ``kvload`` parser with every subcommand."""
    parser = OneLineParser(
        prog="kvload",
        description="Load a model the way a serving engine does, in explicit stages with an audit log: "
                    "parse args, snapshot user fields, apply model defaults, resolve auto, route the "
                    "executor, build the KV cache manager.",
        epilog=_EXAMPLES,
        formatter_class=HelpFormatter,
    )
    from pipeline.version import __version__

    parser.add_argument("--version", action="version", version=f"kvload {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True
    p = sub.add_parser("plan", help="resolve the configuration and route (no allocation)",
                       description="Resolve a model's arguments (stages 1-5) and show each field with its "
                                   "source, the route and why; nothing is allocated.")
    add_model_flags(p)
    cap = p.add_argument_group("capacity report")
    cap.add_argument("--compare", action="store_true",
                     help="also plan V1 and V2 at one budget: bytes per token, tokens that fit, and sequences that "
                          "fit at 1k/4k/16k/64k tokens (capped at max_seq_len). The budget is the routed plan's; "
                          "when nothing bounds it (CPU without --max_tokens/--max_gpu_total_bytes) it is what "
                          "holds 16 sequences of max_seq_len in the routed layout")
    cap.add_argument("--chart", metavar="FILE.png", default=None,
                     help="draw the comparison as a PNG (implies --compare; needs matplotlib: kvload[chart])")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("run", help="resolve, route and build the KV cache manager (allocates the pools)",
                       description="Run every stage: resolve the arguments, route, compute the KV budget and "
                                   "allocate the pools on the device; print the plan and what was allocated.")
    add_model_flags(p)
    p.set_defaults(func=cmd_run)
    add_generate_command(sub)
    from kvload.serve.command import add_serve_command

    add_serve_command(sub)
    add_simulate_command(sub)
    add_inspection_commands(sub)
    return parser


def workload_arg(text: str) -> tuple[str, int]:
    """``KEY=INT`` → (key, int)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=INTEGER, got {text!r}")
    return key.strip(), integer(value)


_SIMULATE_EPILOG = """\
workloads (sizes: --requests, and --workload-arg KEY=N for the rest):
  shared-prefix  groups of prompts sharing a system prompt; one arrival per step
                 (1024 requests; group_size=16 prefix_len=2048 question_len=128 answer_len=256)
  multi-turn     conversations whose each turn extends the last; a turn arrives when the previous ends
                 (256 requests; turns=4 first_len=512 user_len=64 answer_len=128)
  long-context   a few long unrelated sequences arriving together; memory bounds concurrency
                 (16 requests; prompt_len=7936 answer_len=256)
  no-reuse       unique prompts, one arrival per step: prefix-reuse bookkeeping is pure overhead
                 (512 requests; prompt_len=512 answer_len=128)
  mixed-priority long batch prompts (priority 0), a short urgent one (priority 1) every urgent_every-th
                 arrival, one per step: compare --scheduling_policy fcfs and priority (512 requests;
                 prompt_len=1024 answer_len=128 urgent_every=4 urgent_len=64 urgent_answer_len=32)
  mixed          traffic as it comes: log-uniform prompt and answer lengths, shared_percent of prompts on
                 one of `prefixes` system prompts, 0..max_gap steps between arrivals, urgent_percent at
                 priority 1 (256 requests; prompt_min=16 prompt_max=2048 answer_min=1 answer_max=256
                 prefixes=4 prefix_len=512 shared_percent=50 urgent_percent=0 max_gap=3)

budget: the same for every manager simulated. With --max_tokens or --max_gpu_total_bytes it is the
routed manager's budget from those; otherwise the default holds N of the workload's longest sequences
in the routed layout: N = answer_len + 1 for shared-prefix and no-reuse (the requests running at once),
one per conversation for multi-turn, 2 for long-context (memory-bound on purpose), answer_len // 4 for
mixed-priority (requests queue, so the policy decides who waits), answer_max // 32 for mixed (a
little less than it keeps running at once: requests queue a while). V2 layer groups whose
pages have one shape (Gemma 3's) share one arena; groups with other page sizes (DeepSeek V4's compressed
ones) split the budget for sequences of max_seq_len (the checkpoint's unless --max_seq_len): with much
shorter requests their sliding-window pools can fill first, so set --max_seq_len near the workload's
longest sequence to size them for it.

metrics: hit rate = reused prompt tokens / prompt tokens (first admission of each request); usage =
used / total blocks (bytes-weighted over layer groups for V2) after each step's scheduling; waits =
request-steps spent arrived but not running; admission delay = steps from arrival to first admission (its mean,
and with mixed priorities the mean of the top priority's requests); step time = scheduler.step + commits +
finishes; modeled time = every step's batch priced on one --hardware accelerator by a roofline (weights and
attended KV read, FLOPs computed), so a step that prefills thousands of tokens weighs more than one that
decodes a token per request (steps count both as one).

examples:
  kvload simulate tiny-llama --workload shared-prefix --compare
  kvload simulate tiny-gemma3 --workload long-context --compare --json | jq '.results[].max_concurrency'
  kvload simulate tiny-llama --workload no-reuse --use_kv_cache_manager_v2 true --disable_kv_cache_reuse
"""


def add_simulate_command(sub: Any) -> None:
    """``simulate``: replay a synthetic workload through the KV manager(s); no forward pass."""
    from engine.step_model import DEFAULT_HARDWARE, HARDWARE
    from engine.workloads import WORKLOADS

    p = sub.add_parser(
        "simulate", help="replay a synthetic workload through the KV manager (V1 and V2 with --compare)",
        formatter_class=HelpFormatter, epilog=_SIMULATE_EPILOG,
        description="Build the routed KV cache manager and scheduler and replay a deterministic synthetic "
                    "workload through them, with no forward pass: each step commits one token per running "
                    "decode and prefill chunks up to max_num_tokens. Reports prefix-reuse hit rate (and the "
                    "ideal), peak and mean usage, concurrency, suspends/resumes, waits, steps to finish, and "
                    "manager + scheduler time per step. --compare runs V1 and V2 at the same budget.")
    add_model_flags(p)
    g = p.add_argument_group("workload")
    g.add_argument("--workload", required=True, choices=tuple(WORKLOADS), help="which synthetic workload")
    g.add_argument("--requests", type=_bounded(integer, lambda v: v >= 1, "an integer >= 1"), default=None, metavar="N",
                   help="number of requests (default: the workload's, see below)")
    g.add_argument("--seed", type=_bounded(integer, lambda v: v >= 0, "an integer >= 0"), default=0, metavar="S",
                   help="random seed of the token ids (default 0)")
    g.add_argument("--workload-arg", "--workload_arg", dest="workload_args", type=workload_arg, action="append",
                   default=[], metavar="KEY=N", help="a workload size parameter, e.g. prefix_len=512 (repeatable)")
    g.add_argument("--compare", action="store_true",
                   help="simulate KVCacheManager (V1) and KVCacheManagerV2 at the same budget; a manager the model "
                        "cannot be routed to is reported with the reason")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: only when stderr is a terminal)")
    g.add_argument("--hardware", choices=tuple(HARDWARE), default=DEFAULT_HARDWARE,
                   help="the accelerator whose nominal bandwidth and FLOPs price each step's batch (modeled time; "
                        f"default {DEFAULT_HARDWARE}); V2's auto host tier is chosen for it too")
    p.set_defaults(func=cmd_simulate)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (``kvload.__main__.main`` imports this module, then calls it)."""
    said = [False]  # whether the one line for a signal was printed (by _main's handler, or here)
    ns = None
    try:
        handle_sigterm()  # SIGTERM, SIGHUP clean up like Ctrl-C: no temporary file, no half-built pools
        ns = build_parser().parse_args(argv)
        return _main(ns, argv, said)
    except KeyboardInterrupt as exc:  # in start-up, before _main's handler is in, or while that handler ran
        return _stopped(exc, said, ns)
    finally:  # past here is interpreter shutdown: a SIGTERM must not raise into its atexit callbacks
        release_sigterm()


def _stopped(exc: KeyboardInterrupt, said: list[bool], ns: argparse.Namespace | None) -> int:
    """The one line for a stop signal, printed once however many arrive, and its exit status (128 + its number)."""
    term = isinstance(exc, Terminated)  # SIGTERM, or SIGHUP (HungUp)
    _say(f"{exc.describe if term else 'interrupted'}{_unwritten(ns)}", said)
    return 128 + exc.signal_number if term else 130


def _drop_stdout() -> None:
    import os

    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _unwritten(ns: argparse.Namespace | None) -> str:
    """What a command that did not finish says it left out: its ``--audit-log`` (never published then). Nothing
    else: what it printed on the way (generate's tokens) was printed, so "nothing was written" would not be true."""
    return "; the --audit-log file was not written" if getattr(ns, "audit_log", None) is not None else ""


#: A run of non-space characters longer than this in an error line is cut to its ends: a 100,000-character flag
#: value, model name or config value was quoted whole, a 100 KB error line.
_LONGEST_RUN = 300


def error_text(text: str) -> str:
    """``text`` as one printable line (:func:`one_line`), each overlong run of non-space characters cut to its ends."""
    def cut(match: re.Match[str]) -> str:
        run = match.group(0)
        return f"{run[:100]}...({len(run) - 120:,} characters cut)...{run[-20:]}"

    return re.sub(rf"\S{{{_LONGEST_RUN + 1},}}", cut, one_line(text))


def _say(line: str, said: list[bool]) -> None:
    """Print ``error: line`` on stderr, once per run; after a hangup the terminal may be gone: the status tells."""
    if not said[0]:
        said[0] = True
        with contextlib.suppress(OSError):
            print(f"error: {error_text(line)}", file=sys.stderr)


def _main(ns: argparse.Namespace, argv: Sequence[str] | None, said: list[bool]) -> int:
    """``main`` once the flags are parsed; SIGTERM raises ``Terminated`` (``main``'s handler covers this set-up)."""
    from pipeline.logs import HeldStream, configure_logging, env_log_settings

    try:  # flags win over KVLOAD_LOG_LEVEL / KVLOAD_LOG_FORMAT, which win over the defaults
        env_level, env_format = env_log_settings()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    # At the default level, warnings are held until the outcome is known: a failed run prints only
    # its one-line error. Asking for info/debug streams everything as it happens.
    level = getattr(ns, "log_level", None) or env_level or "warning"  # explain/audit/models log nothing
    held = HeldStream() if level in ("warning", "error") and not ns.debug else None
    configure_logging(getattr(ns, "log_format", None) or env_format or "console", level, held)
    ns.held_log = held  # a command that runs on after its set-up (serve) lets the warnings through then
    ns.effective_log_level = level  # what serve's uvicorn logs at: kvload's level, not uvicorn's own default (info)
    ok = False
    stdout, sys.stdout = sys.stdout, ResultStream(sys.stdout, _unwritten(ns))
    try:
        check_distinct_files(ns, sys.argv[1:] if argv is None else argv)
        code = _run(ns)
        ok = code == 0
        return code
    except KvloadError as exc:
        if ns.debug:  # the traceback, then the same line and exit status as without --debug
            traceback.print_exc()
        print(f"error: {error_text(_cli_message(exc, sys.argv[1:] if argv is None else argv))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        return _stopped(exc, said, ns)
    except BrokenPipeError:
        # the reader closed stdout (`| head`): what the command was asked for was not all delivered, so it is not a
        # success, and its --audit-log (published only on exit 0) is discarded. 141 is what a shell reports for a
        # writer a closed pipe ended (128 + SIGPIPE: `yes | head`), and a script with pipefail sees it. stdout goes
        # to /dev/null first, so the interpreter's last flush does not fail again
        _drop_stdout()
        _say(f"the output was closed before it was all written (broken pipe){_unwritten(ns)}", said)
        return 141
    except Exception as exc:  # a bug or a runtime failure: one line unless --debug
        from pipeline.ranks import lost_rank_message

        lost = lost_rank_message(exc)  # a peer rank died inside a collective kvload does not wrap (the forward's)
        if lost is not None:
            if ns.debug:
                traceback.print_exc()
            print(f"error: {lost}", file=sys.stderr)
            return 1
        detail = first_line(exc, "")
        if ns.debug:
            traceback.print_exc()
            print(f"error: {type(exc).__name__}: {error_text(detail)}", file=sys.stderr)
        else:
            print(f"error: {type(exc).__name__}: {error_text(detail)} (run with --debug for the traceback)",
                  file=sys.stderr)
        return 1
    finally:
        sys.stdout = stdout
        if held is not None:
            held.release(ok)


class ResultStream:
    """``sys.stdout`` while a command runs: a write or flush the OS refuses (a full disk, a closed descriptor, an I/O
    error) becomes one ``OutputError`` naming stdout (exit 1), where it was ``OSError: [Errno 28] ...`` or, with
    stdout closed at start (``kvload plan ... >&-``: Python's ``sys.stdout`` is None), an ``AttributeError``. A
    closed pipe stays ``BrokenPipeError``, which ``_main`` reports as exit 141."""

    def __init__(self, stream: Any, unwritten: str, what: str = "the result") -> None:
        self._stream = stream
        self._unwritten = unwritten  # what the error line adds: the --audit-log not written
        self._what = what  # what was to be written: the result, the help, the version

    def _failed(self, exc: OSError | None) -> OutputError:
        if exc is None:
            return OutputError(f"stdout is closed, so {self._what} cannot be written (redirect it to a file or "
                               f"/dev/null instead of closing it){self._unwritten}")
        _drop_stdout()  # what the buffer still holds would fail again in the interpreter's last flush (exit 120)
        reason = exc.strerror or type(exc).__name__
        return OutputError(f"stdout: cannot write {self._what} ({reason}){self._unwritten}")

    def write(self, text: str) -> int:
        """The stream's ``write``; an OS failure (not a closed pipe) as one ``OutputError``."""
        if self._stream is None:
            raise self._failed(None)
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise self._failed(exc) from exc

    def flush(self) -> None:
        """The stream's ``flush``; an OS failure (not a closed pipe) as one ``OutputError``."""
        if self._stream is None:
            return
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise self._failed(exc) from exc

    def __getattr__(self, name: str) -> Any:
        if self._stream is None:
            raise self._failed(None)
        return getattr(self._stream, name)


def _run(ns: argparse.Namespace) -> int:
    """Run the subcommand, then publish its ``--audit-log`` only if it succeeded (discard it otherwise)."""
    try:
        code = ns.func(ns)
        # delivered before the audit says so: block-buffered (a pipe), the output waited in Python's buffer and a
        # reader already gone failed its flush at interpreter exit, after the audit was published (exit 120)
        sys.stdout.flush()
    except BaseException:
        _close_audit(ns, ok=False)
        raise
    _close_audit(ns, ok=code == 0)
    return code


def _close_audit(ns: argparse.Namespace, ok: bool) -> None:
    sink = getattr(ns, "audit_sink", None)
    if sink is not None:
        ns.audit_sink = None
        sink.close(ok=ok)


def _cli_message(exc: KvloadError, argv: Sequence[str] = ()) -> str:
    """Name the flag (as typed) instead of the dotted path when the bad value came from the command line."""
    flag = next((f for f in FLAGS if exc.path == f.path or exc.path.startswith(f.path + ".")), None) \
        if isinstance(exc, ConfigError) and exc.source == "cli" and exc.path else None
    if flag is not None:  # a key inside a flag's JSON object (--override-generation-config) is named after the flag
        spellings = (flag.name, *flag.aliases)
        key = exc.path[len(flag.path) + 1:]
        detail = f"{key}: {exc.detail}" if key else exc.detail
        typed = typed_value(spellings, argv) if flag.type in (str, number) else None
        head, got, _ = detail.rpartition(" got ")
        # a name the config normalised (fp8 → float8_e4m3fn), a number argparse made a float (2 → 2.0): quote what
        # was typed, as the flags argparse refuses itself (--top_p 2: got '2') do
        if typed is not None and got:
            detail = f"{head} got {short_text(typed)}"
        return f"{typed_spelling(spellings, argv)}: {detail}"
    knob = next((name for name, key, _, _ in VLLM_KNOB_FLAGS if exc.path == key), None) \
        if isinstance(exc, ConfigError) and exc.source == "cli" and exc.path else None
    if knob is not None:  # vLLM's flag refused (--quantization awq): named as typed, not as its key
        spellings = (knob, _underscored(knob))
        return f"{typed_spelling(spellings, argv)}: {str(exc).removeprefix(exc.path + ': ')}"
    return str(exc)


if __name__ == "__main__":
    sys.exit(main())
