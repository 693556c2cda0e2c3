"""``main``: parse, log, run the command; a signal, a refused stdout or a failure as one line and its exit status."""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from collections.abc import Sequence

from kvload.cli.commands import build_parser
from kvload.cli.files import check_distinct_files
from kvload.cli.flags import FLAGS, TRTLLM_SERVE_FLAGS, VLLM_KNOB_FLAGS, VLLM_KNOB_SHORT, _underscored
from kvload.cli.launch import launch, ranks_to_launch
from kvload.cli.output import ResultStream, _drop_stdout, error_text
from kvload.cli.parser import typed_spelling, typed_value
from kvload.cli.values import number
from pipeline.errors import ConfigError, KvloadError, first_line
from pipeline.limits import short_text

# at import: main's first line is in its try
from pipeline.signals import Terminated, dropped_stop, handle_sigterm, release_sigterm, stop_behind, stopping


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (``kvload.__main__.main`` imports this module, then calls it)."""
    said = [False]  # whether the one line for a signal was printed (by _main's handler, or here)
    ns = None
    try:
        handle_sigterm()  # SIGTERM, SIGHUP clean up like Ctrl-C: no temporary file, no half-built pools
        ns = build_parser().parse_args(argv)
        code = _main(ns, argv, said)
    except KeyboardInterrupt as exc:  # in start-up, before _main's handler is in, or while that handler ran
        code = _stopped(exc, said, ns)
    finally:  # past here is interpreter shutdown: a SIGTERM must not raise into its atexit callbacks
        # a stop dropped unseen in the command's last moments, too late for the watcher to send it again: the user's
        # kill is reported with its line and status as one taken a moment earlier, not lost behind an exit 0
        late = release_sigterm()
        # CPython marks a KeyboardInterrupt that leaves an exec() of a string (dataclasses and namedtuple build their
        # methods so, at import) as unhandled, even once it is caught, and `python -m kvload` then ended the process
        # by SIGINT at exit, whatever main returned: a Ctrl-C landing there gave its parent -2, not 130. Every exec of
        # a string clears that mark before it runs: one of nothing, once the command is over, says it was handled.
        exec("")
    return code if late is None else _stopped(late, said, ns)


def _stopped(exc: KeyboardInterrupt, said: list[bool], ns: argparse.Namespace | None) -> int:
    """The one line for a stop signal, printed once however many arrive, and its exit status (128 + its number)."""
    stopping()  # the stop reached the command: a stop signal from here on repeats it (pipeline.signals)
    term = isinstance(exc, Terminated)  # SIGTERM, or SIGHUP (HungUp)
    _say(f"{exc.describe if term else 'interrupted'}{_unwritten(ns)}", said)
    return 128 + exc.signal_number if term else 130


def _stopped_after(stop: KeyboardInterrupt, said: list[bool], ns: argparse.Namespace) -> int:
    """A failure that followed a stop dropped unseen (:func:`pipeline.signals.dropped_stop`), reported as that stop,
    whatever the failure: the stop came first and the command was ending on it within ~0.1 s (the watcher sends it
    again), and what failed in between is often the stop's own doing (numpy half-imported) with no sure way to tell
    which is; ``kill``'s sender is told it stopped (128 + its number). ``--debug`` prints the failure's traceback
    too."""
    if ns.debug:
        traceback.print_exc()
    return _stopped(stop, said, ns)


def _unwritten(ns: argparse.Namespace | None) -> str:
    """What a command that did not finish says it left out: its ``--audit-log`` (never published then), unless a stop
    came once it was published (the command had finished). Nothing else: what it printed on the way (generate's
    tokens) was printed, so "nothing was written" would not be true."""
    unwritten = getattr(ns, "audit_log", None) is not None and not getattr(ns, "audit_published", False)
    return "; the --audit-log file was not written" if unwritten else ""


def _end_line() -> None:
    """End a reply a stop or a failure cut short mid-line on a terminal, so the error line that follows starts its own
    line (it trailed the last token: ``129 263 error: terminated (SIGTERM)``)."""
    if isinstance(sys.stdout, ResultStream):
        sys.stdout.end_line()


def _say(line: str, said: list[bool]) -> None:
    """Print ``error: line`` on stderr, once per run; after a hangup the terminal may be gone: the status tells."""
    if not said[0]:
        said[0] = True
        _end_line()
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
        world = ranks_to_launch(ns)  # --tp_size N outside torchrun: this process starts the N ranks (vLLM's habit)
        code = launch(ns, sys.argv[1:] if argv is None else argv, world) if world else _run(ns)
        ok = code == 0
        return code
    except KvloadError as exc:
        stop = dropped_stop()  # a stop torch's start-up cleared, failing the command before it was sent again
        if stop is not None:
            return _stopped_after(stop, said, ns)
        stop_behind(exc)  # a stop this failure came of (a cleanup that failed) was seen: not reported again as dropped
        _end_line()
        if ns.debug:  # the traceback, then the same line and exit status as without --debug
            traceback.print_exc()
        print(f"error: {error_text(_cli_message(exc, sys.argv[1:] if argv is None else argv))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        return _stopped(exc, said, ns)
    except BrokenPipeError as exc:
        # the reader closed stdout (`| head`): what the command was asked for was not all delivered, so it is not a
        # success, and its --audit-log (published only on exit 0) is discarded. 141 is what a shell reports for a
        # writer a closed pipe ended (128 + SIGPIPE: `yes | head`), and a script with pipefail sees it. stdout goes
        # to /dev/null first, so the interpreter's last flush does not fail again
        _drop_stdout()
        stop_behind(exc)  # (as for KvloadError: a pipe that broke while a stop unwound is this line and 141, once)
        _say(f"the output was closed before it was all written (broken pipe){_unwritten(ns)}", said)
        return 141
    except Exception as exc:  # a bug or a runtime failure: one line unless --debug
        stop = dropped_stop()  # (as for KvloadError: numpy's ImportError where torch dropped the stop)
        if stop is not None:
            return _stopped_after(stop, said, ns)
        stop_behind(exc)  # (as for KvloadError)
        from pipeline.ranks import lost_rank_message

        _end_line()

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
    try:
        _close_audit(ns, ok=code == 0)
    except BaseException:  # a stop before the sink's own close began (it holds signals): discarded, nothing left
        _close_audit(ns, ok=False)
        raise
    return code


def _close_audit(ns: argparse.Namespace, ok: bool) -> None:
    """Publish (``ok``) or discard the command's ``--audit-log``; called again after a stop that cut a first call
    short, the sink is still there to discard until its own close ran (a second close of it does nothing)."""
    sink = getattr(ns, "audit_sink", None)
    if sink is not None:
        from pipeline.ranks import close_rank_audit, ranks_from_env

        stop = dropped_stop() if ok else None
        # dropped unseen, too late for the watcher to send it again: a stop, not published
        close_rank_audit(sink, ranks_from_env(), ok=ok and stop is None)
        ns.audit_sink = None
        ns.audit_published = ok and stop is None  # a stop from here (main's last look) does not say "not written"
        if stop is not None:
            raise stop


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
    cli = isinstance(exc, ConfigError) and exc.source == "cli" and bool(exc.path)
    knob = next((name for name, key, _, _ in VLLM_KNOB_FLAGS if exc.path == key), None) if cli else None
    # trtllm-serve's flag of the key (--pp_size 2, --server_role): named as typed too, and as TensorRT-LLM's
    trt = next((names for names, key, _, _ in TRTLLM_SERVE_FLAGS if exc.path == key), ()) if cli else ()
    if knob is not None or trt:  # vLLM's flag refused (--quantization awq, -dp 2): named as typed, not as its key
        vllm = (knob, _underscored(knob), *VLLM_KNOB_SHORT.get(knob, ())) if knob is not None else ()
        trt = tuple(n for name in trt for n in (name, "--" + name[2:].replace("_", "-")))
        spelled = typed_spelling((*vllm, *trt), argv) if vllm else typed_spelling(trt, argv)
        detail = str(exc).removeprefix(exc.path + ": ").replace("a vLLM engine argument", "a vLLM engine flag", 1)
        if spelled in trt:
            detail = detail.replace("vLLM's setting", "TensorRT-LLM's setting", 1)
        return f"{spelled}: {detail}"
    return str(exc)
