"""``kvload explain``, ``audit`` and ``models``: read an audit log or the model registry; nothing is loaded."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvload.cli.flags import flag_aliases
from kvload.cli.output import error_text, print_result
from kvload.cli.parser import HelpFormatter


def _read_audit(path: str) -> Any:
    from kvload.explain import read_log  # streamed: a long run's log is too big to hold

    return read_log(path)


def _warn_broken_chain(path: str, log: Any) -> None:
    """One stderr line when the log's hash chain was checked and is broken: explain and audit print what an edited
    file says (a final value over a chain that ends at another) and, without it, said nothing of the edit. Only
    ``--verify`` fails on it; a signed log read without its key is no warning (nothing was checked)."""
    chain = getattr(log, "chain", None)
    if not chain or not chain.get("checked") or chain.get("ok"):
        return
    sys.stdout.flush()  # the warning after what came before it on a shared terminal
    print(error_text(f"warning: {path}: its hash chain is broken ({chain['problem']}): what follows is what the "
                     f"file says, not necessarily what kvload recorded; kvload audit {path} --verify lists every "
                     "problem"), file=sys.stderr)


def cmd_explain(ns: argparse.Namespace) -> int:
    """Print each field's chain of changes recorded in an audit log."""
    from kvload.explain import explain, render_explain

    log = _read_audit(ns.audit)
    _warn_broken_chain(ns.audit, log)
    chains = explain(log, ns.fields or None, aliases=flag_aliases())
    print_result(json.dumps({c["field"]: c for c in chains}, indent=2, default=str) if ns.json
                 else render_explain(chains))
    return 0


def cmd_audit(ns: argparse.Namespace) -> int:
    """Summarize an audit log; with ``--verify`` exit 1 when its events do not reproduce the final args."""
    from kvload.explain import render_summary, summarize, verify_log

    log = _read_audit(ns.audit)
    if not ns.verify:  # --verify's error line names the break
        _warn_broken_chain(ns.audit, log)
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
