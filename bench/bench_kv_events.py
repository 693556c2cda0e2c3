"""What KV cache events cost: simulator step time with ``event_buffer_max_size`` 0 (off) and > 0 (on).

Run from the repository root::

    python -m bench.bench_kv_events            # shared-prefix 512 requests, 5 interleaved pairs per manager
    python -m bench.bench_kv_events --quick    # 128 requests, 3 pairs
    python -m bench.bench_kv_events --publisher  # what serve --kv-events-config's ZeroMQ publisher adds per event

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


def publisher_overhead(events: int = 20_000, rounds: int = 5) -> Table:
    """The recording thread's CPU per stored event (a 32-token block) with and without the ZeroMQ publisher, and what
    a SUB socket received: the step pays the queue's put; msgpack and the socket are the publisher thread's."""
    import threading
    import time

    import zmq

    from cache_backends.kv_events import KvEventBuffer
    from kvload.serve.kv_publisher import KvEventsConfig, ZmqKvEventPublisher

    hashes, tokens = [bytes(range(32))], list(range(32))
    table = Table(f"KV events: the recording thread's cost with the ZeroMQ publisher ({events:,} stored events of one "
                  f"32-token block, {rounds} interleaved rounds, thread CPU time)", "python -m bench.bench_kv_events "
                  "--publisher", ["publisher", "µs per event (median)", "wall µs per event (median)", "batches sent",
                   "events a SUB received"])
    per: dict[bool, list[float]] = {False: [], True: []}
    wall: dict[bool, list[float]] = {False: [], True: []}
    sent = received = 0
    for i in range(rounds):
        for on in ((False, True) if i % 2 == 0 else (True, False)):
            buffer = KvEventBuffer(100_000)
            pub = sub = None
            got = [0]
            if on:
                endpoint = f"inproc://bench-{i}"
                pub = ZmqKvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                         endpoint=endpoint, max_queue_size=events))
                pub.attach(type("L", (), {"groups": ()})())
                sub = zmq.Context.instance().socket(zmq.SUB)
                sub.connect(endpoint)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                time.sleep(0.2)

                def drain(sock=sub, count=got) -> None:
                    import msgspec

                    while sock.poll(1000):
                        count[0] += len(msgspec.msgpack.decode(sock.recv_multipart()[2])["events"])

                reader = threading.Thread(target=drain)
                reader.start()
                buffer.publisher = pub
            start, t0 = time.thread_time(), time.perf_counter()
            for _ in range(events):
                buffer.stored(hashes, None, tokens, 32, "uniform")
            per[on].append((time.thread_time() - start) / events * 1e6)
            wall[on].append((time.perf_counter() - t0) / events * 1e6)  # the publisher thread's GIL share too
            if on:
                pub.close()
                reader.join()
                sub.close(linger=0)
                sent, received = pub.published, got[0]
    table.rows.append(["none (the buffer alone)", f"{median(per[False]):.2f}", f"{median(wall[False]):.2f}", "-", "-"])
    table.rows.append(["zmq (inproc)", f"{median(per[True]):.2f}", f"{median(wall[True]):.2f}", f"{sent:,}",
                       f"{received:,} of {events:,}"])
    return table


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workload, fewer pairs")
    parser.add_argument("--publisher", action="store_true", help="only the ZeroMQ publisher's cost per event")
    ns = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if ns.publisher:
        print(publisher_overhead().markdown())
        return
    print(events_overhead(ns.quick).markdown())


if __name__ == "__main__":
    main()
