"""``kvload simulate``: its flags, and the command that replays a synthetic workload through the KV manager(s)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvload.cli.files import _audit_subscribers
from kvload.cli.flags import add_model_flags, add_unused_reasoning_parser, cli_overrides
from kvload.cli.output import print_result
from kvload.cli.parser import HelpFormatter
from kvload.cli.values import at_least, workload_arg
from pipeline.errors import ConfigError


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
    add_unused_reasoning_parser(p)
    g = p.add_argument_group("workload")
    g.add_argument("--workload", required=True, choices=tuple(WORKLOADS), help="which synthetic workload")
    g.add_argument("--requests", type=at_least(1), default=None, metavar="N",
                   help="number of requests (default: the workload's, see below)")
    g.add_argument("--seed", type=at_least(0), default=0, metavar="S",
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
