"""``kvload plan`` (resolve and route, nothing allocated) and ``kvload run`` (build the KV cache manager too)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvload.cli.files import _audit_subscribers
from kvload.cli.flags import _request, add_model_flags, add_unused_reasoning_parser
from kvload.cli.output import print_result, prints
from kvload.cli.parser import HelpFormatter


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


def add_plan_command(sub: Any) -> None:
    """``plan``: resolve and route, with the capacity report flags."""
    p = sub.add_parser("plan", help="resolve the configuration and route (no allocation)",
                       description="Resolve a model's arguments (stages 1-5) and show each field with its "
                                   "source, the route and why; nothing is allocated.",
                       formatter_class=HelpFormatter)  # MODEL is required, though --model may give it
    add_model_flags(p)
    add_unused_reasoning_parser(p)
    cap = p.add_argument_group("capacity report")
    cap.add_argument("--compare", action="store_true",
                     help="also plan V1 and V2 at one budget: bytes per token, tokens that fit, and sequences that "
                          "fit at 1k/4k/16k/64k tokens (capped at max_seq_len). The budget is the routed plan's; "
                          "when nothing bounds it (CPU without --max_tokens/--max_gpu_total_bytes) it is what "
                          "holds 16 sequences of max_seq_len in the routed layout")
    cap.add_argument("--chart", metavar="FILE.png", default=None,
                     help="draw the comparison as a PNG (implies --compare; needs matplotlib: kvload[chart])")
    p.set_defaults(func=cmd_plan)


def add_run_command(sub: Any) -> None:
    """``run``: every stage, the pools allocated."""
    p = sub.add_parser("run", help="resolve, route and build the KV cache manager (allocates the pools)",
                       description="Run every stage: resolve the arguments, route, compute the KV budget and "
                                   "allocate the pools on the device; print the plan and what was allocated.",
                       formatter_class=HelpFormatter)
    add_model_flags(p)
    add_unused_reasoning_parser(p)
    p.set_defaults(func=cmd_run)
