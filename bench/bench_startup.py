"""CLI start-up cost: CPU seconds of ``kvload plan/models/explain`` as a fresh process, per model source.

CPU time (user + system, from ``getrusage`` of the children) is the figure: wall time on a shared
machine measures the neighbours. ``--baseline DIR`` runs the same commands against another checkout
(``PYTHONPATH=DIR``), side by side, so a change is measured against what it replaced in one run.

    python -m bench.bench_startup [--repeats 5] [--baseline /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Table, machine, median, ratio

REPO = Path(__file__).resolve().parents[1]


def cpu_seconds(argv: list[str], pythonpath: Path) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one ``python -m kvload ARGV`` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "kvload", *argv], capture_output=True, text=True, env=env,
                       timeout=300, cwd=tempfile.gettempdir())
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise RuntimeError(f"kvload {' '.join(argv)} failed: {r.stderr.strip()[-300:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def config_only_checkpoint(root: Path) -> Path:
    """A directory holding only tiny-llama's config.json: a checkpoint read through AutoConfig."""
    src = REPO / "models" / "presets" / "tiny-llama" / "config.json"
    out = root / "config-only"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(src.read_text())
    return out


def main() -> None:
    """Run every case ``--repeats`` times in this checkout (and the baseline); print a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to compare with")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        log = root / "plan.jsonl"
        ckpt = config_only_checkpoint(root)
        cases = [
            ("plan tiny-llama", ["plan", "tiny-llama"]),
            ("plan tiny-deepseek-v4", ["plan", "tiny-deepseek-v4", "--max_tokens", "65536"]),
            ("plan tiny-llama --hf-overrides '{\"max_position_embeddings\": 96}'",
             ["plan", "tiny-llama", "--hf-overrides", '{"max_position_embeddings": 96}']),
            ("plan tiny-llama --hf-overrides '{\"rope_theta\": 1000000.0}'",
             ["plan", "tiny-llama", "--hf-overrides", '{"rope_theta": 1000000.0}']),
            ("plan tiny-llama --hf-overrides '{\"rms_norm_eps\": 1e-05, \"hidden_act\": \"gelu\"}'",
             ["plan", "tiny-llama", "--hf-overrides", '{"rms_norm_eps": 1e-05, "hidden_act": "gelu"}']),
            ("plan <config-only directory> (AutoConfig)", ["plan", str(ckpt)]),
            ("models", ["models"]),
            ("explain AUDIT.jsonl", ["explain", str(log)]),
        ]
        trees = [("this checkout", REPO)] + ([("baseline", a.baseline)] if a.baseline else [])
        results: dict[str, dict[str, list[tuple[float, float]]]] = {}
        cpu_seconds(["plan", "tiny-llama", "--audit-log", str(log)], REPO)  # the log explain reads
        for _ in range(a.repeats):  # interleaved: each repeat runs every case once in each checkout
            for name, argv in cases:
                for label, tree in trees:
                    results.setdefault(name, {}).setdefault(label, []).append(cpu_seconds(argv, tree))
        headers = ["command", *(f"{label}: CPU s (wall s), median" for label, _ in trees)]
        if a.baseline:
            headers.append("baseline / this (CPU)")
        table = Table("CLI start-up", f"python -m bench.bench_startup --repeats {a.repeats}"
                      + (" --baseline DIR" if a.baseline else ""), headers)
        for name, _ in cases:
            cells, cpus = [], []
            for label, _ in trees:
                runs = results[name][label]
                cpu, wall = median([c for c, _ in runs]), median([w for _, w in runs])
                cpus.append(cpu)
                cells.append(f"{cpu:.2f} ({wall:.2f})")
            row = [f"`kvload {name}`", *cells]
            if a.baseline:
                row.append(ratio(cpus[1] / cpus[0]) if cpus[0] else "-")
            table.rows.append(row)
        table.notes.append("machine: " + json.dumps(machine()))
        print(table.markdown())


if __name__ == "__main__":
    main()
