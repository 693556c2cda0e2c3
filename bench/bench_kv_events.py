"""What KV cache events cost: simulator step time with ``event_buffer_max_size`` 0 (off) and > 0 (on).

Run from the repository root::

    python -m bench.bench_kv_events            # shared-prefix 512 requests, 5 interleaved pairs per manager
    python -m bench.bench_kv_events --quick    # 128 requests, 3 pairs

For V1 and V2 on tiny-llama, the same workload replays with events off and on (a 100,000-event
buffer, never drained, so it also pays for dropping the oldest), pairs interleaved with alternating
order; step time is the simulator's manager + scheduler time per step. Off must cost nothing: the
managers hold no buffer then, and each hook is one ``is None`` test.
"""

from __future__ import annotations

import argparse
import os

from bench.common import Table, median, us
from engine.simulator import simulate
from engine.workloads import make_workload

CPU = {"device": "cpu", "log": False, "progress": False}


def events_overhead(quick: bool) -> Table:
    """Step time with events off vs on, V1 and V2, on shared-prefix at a budget that evicts."""
    pairs = 3 if quick else 5
    n = 128 if quick else 512
    wl = make_workload("shared-prefix", n, 0)
    cmd = (f"python -m kvload.cli simulate tiny-llama --workload shared-prefix --requests {n} --max_tokens 65536 "
           "--use_kv_cache_manager_v2 {false,true} [--event_buffer_max_size 100000] --json")
    table = Table(f"KV cache events off vs on (shared-prefix, {n} requests, 65,536-token budget, {pairs} "
                  "interleaved pairs)", cmd,
                  ["manager", "events", "step µs (median)", "step µs (mean)", "on/off (median of pair ratios)"])
    for v2 in (False, True):
        runs: dict[bool, list] = {False: [], True: []}
        for i in range(pairs):
            for on in ((False, True) if i % 2 == 0 else (True, False)):
                kv = {"use_kv_cache_manager_v2": v2, "max_tokens": 65536,
                      "event_buffer_max_size": 100_000 if on else 0}
                report = simulate("tiny-llama", wl, kv_cache_config=kv, **CPU)
                (result,) = report.results.values()
                runs[on].append(result.metrics)
        name = "KVCacheManagerV2" if v2 else "KVCacheManager"
        ratio = median([a.step_time_us_median / b.step_time_us_median
                        for a, b in zip(runs[True], runs[False], strict=True)])
        for on in (False, True):
            ms = runs[on]
            table.rows.append([name, "on" if on else "off", us(median([m.step_time_us_median for m in ms])),
                               us(median([m.step_time_us_mean for m in ms])), f"{ratio:.3f}x" if on else ""])
    return table


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workload, fewer pairs")
    ns = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(events_overhead(ns.quick).markdown())


if __name__ == "__main__":
    main()
