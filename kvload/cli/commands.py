"""The ``kvload`` parser: the top-level help and every subcommand, in the order ``--help`` lists them."""

from __future__ import annotations

import argparse

from kvload.cli.generate import add_generate_command
from kvload.cli.inspection import add_inspection_commands
from kvload.cli.parser import HelpFormatter, OneLineParser
from kvload.cli.plan import add_plan_command, add_run_command
from kvload.cli.simulate import add_simulate_command

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
    add_plan_command(sub)
    add_run_command(sub)
    add_generate_command(sub)
    from kvload.serve.command import add_serve_command

    add_serve_command(sub)
    add_simulate_command(sub)
    add_inspection_commands(sub)
    return parser
