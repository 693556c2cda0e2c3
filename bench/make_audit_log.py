"""Write a large, valid audit log (for measuring ``kvload audit``/``explain`` memory on a long run's file).

Run from the repository root::

    python -m bench.make_audit_log SOURCE.jsonl OUT.jsonl --mb 120

SOURCE is a ``kvload generate --audit-log`` file; OUT keeps its load records up to ``pipeline_finished`` and then
repeats its first generate call (``generation_started`` ... ``generation_finished``), with fresh call and request
ids and an unbroken ``seq``, until it holds about ``--mb`` megabytes. The hash chain is rewritten as kvload writes
it, so ``kvload audit OUT --verify`` passes.
"""

from __future__ import annotations

import argparse
import os

from pipeline.audit import AuditLog, JsonlSink


def main() -> None:
    """Build OUT from SOURCE (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("out")
    ap.add_argument("--mb", type=float, default=120.0)
    ns = ap.parse_args()
    events = AuditLog.from_jsonl(ns.source).events
    end = next(i for i, e in enumerate(events) if e["event"] == "pipeline_finished") + 1
    start = next(i for i, e in enumerate(events) if e["event"] == "generation_started")
    stop = next(i for i, e in enumerate(events) if e["event"] == "generation_finished") + 1
    load, call = events[:end], events[start:stop]
    seq = 0
    with JsonlSink(ns.out) as sink:
        for record in load:
            sink({**record, "seq": seq})
            seq += 1
        n = 0
        while True:
            for record in call:
                record = {**record, "seq": seq}
                if "call" in record:
                    record["call"] = n
                if "req_id" in record:
                    record["req_id"] = f"{n}-{record['req_id']}"
                sink(record)
                seq += 1
            n += 1
            if n % 256 == 0 and sink._file.tell() > ns.mb * 1e6:  # the size written so far
                break
    print(f"{ns.out}: {os.path.getsize(ns.out):,} bytes, {seq:,} records, {n:,} generate calls")


if __name__ == "__main__":
    main()
