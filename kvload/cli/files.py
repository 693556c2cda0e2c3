"""Files a command writes or reads: the --audit-log sink, output paths checked first, one file named by two flags."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from kvload.cli.parser import typed_spelling
from pipeline.errors import ConfigError


def _audit_subscribers(ns: argparse.Namespace) -> list[Any]:
    """The ``--audit-log`` sink, checked before any work; ``main`` publishes it only when the command succeeds.

    An existing file is refused unless ``--force`` (an audit log is evidence: it is never replaced
    without being asked); a FIFO, device or directory is refused even with ``--force``.
    """
    if ns.audit_log is None:
        return []
    from pipeline.ranks import rank_audit_sink, ranks_from_env

    # under torchrun rank N writes <stem>.rankN<suffix>; the API's audit_log is set up by the same helper
    ns.audit_sink = rank_audit_sink(ns.audit_log, ranks_from_env(), flag="--audit-log", replace=ns.force)
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


def _check_output_path(flag: str, path: str) -> None:
    from pipeline.audit import check_output_path

    check_output_path(path, flag, replace=True)
