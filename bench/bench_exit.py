"""Exit after the last line: how long a ``kvload generate`` process lives after its output, and its CPU.

Each run is a fresh ``python -m kvload`` process reading its stdout as it comes; "after the last line" is the wall
time from the last byte of stdout to the process's end (the command flushes its output before it returns, so this
is the process's exit). CPU is user + system from ``wait4``. ``--baseline DIR`` runs another checkout
(``PYTHONPATH=DIR``) interleaved with this one, so both see the same neighbours.

    python -m bench.bench_exit [--repeats 7] [--baseline /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Table, machine, median, ratio

REPO = Path(__file__).resolve().parents[1]
ARGV = ["generate", "tiny-llama", "--prompt-ids", "1,2,3,4", "--max_new_tokens", "8"]


def one_run(pythonpath: Path) -> tuple[float, float, float]:
    """(wall s, seconds after the last stdout byte, CPU s) of one ``python -m kvload generate`` process."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "kvload", *ARGV], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, env=env, cwd=tempfile.gettempdir())
    assert p.stdout is not None
    last = start
    while os.read(p.stdout.fileno(), 65536):
        last = time.perf_counter()
    _, status, usage = os.wait4(p.pid, 0)
    end = time.perf_counter()
    p.returncode = os.waitstatus_to_exitcode(status)
    p.stdout.close()
    if p.returncode != 0 or last == start:
        raise RuntimeError(f"kvload {' '.join(ARGV)} failed (exit {p.returncode})")
    return end - start, end - last, usage.ru_utime + usage.ru_stime


def main() -> None:
    """Run ``--repeats`` times per checkout, interleaved; print a markdown table of medians."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to compare with")
    a = ap.parse_args()
    trees = [("this checkout", REPO)] + ([("baseline", a.baseline)] if a.baseline else [])
    runs: dict[str, list[tuple[float, float, float]]] = {label: [] for label, _ in trees}
    for _ in range(a.repeats):  # interleaved: each repeat runs every checkout once
        for label, tree in trees:
            runs[label].append(one_run(tree))
    table = Table("Exit after the last line", f"python -m bench.bench_exit --repeats {a.repeats}"
                  + (" --baseline DIR" if a.baseline else ""),
                  ["checkout", "after the last line, s", "wall, s", "CPU, s"])
    for label, _ in trees:
        walls, afters, cpus = zip(*runs[label], strict=True)
        table.rows.append([label, f"{median(afters):.2f}", f"{median(walls):.2f}", f"{median(cpus):.2f}"])
    if a.baseline:
        (_, this), (_, base) = ((k, [median(col) for col in zip(*v, strict=True)]) for k, v in runs.items())
        table.notes.append(f"baseline / this: after the last line {ratio(base[1] / this[1])}, wall "
                           f"{ratio(base[0] / this[0])}, CPU {ratio(base[2] / this[2])}")
    table.notes.append(f"command: `kvload {' '.join(ARGV)}`, each run a fresh process")
    table.notes.append("machine: " + json.dumps(machine()))
    print(table.markdown())


if __name__ == "__main__":
    main()
