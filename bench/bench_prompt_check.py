"""Checking a long prompt of token ids: how long ``engine.prompts.normalize`` (every id checked to be an integer,
on every ``generate`` / ``embed`` / ``beam_search`` call) takes for 10**5 and 10**6 ids, and a too-long prompt's
refusal by ``LLM.generate`` end to end (tiny-llama, max_seq_len 64). ``--baseline DIR`` runs another checkout
(``PYTHONPATH=DIR``) interleaved with this one, each measurement in a fresh process.

    python -m bench.bench_prompt_check [--repeats 5] [--baseline /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import Table, machine, median, ratio

REPO = Path(__file__).resolve().parents[1]
#: Run in the measured checkout: prints the seconds of each measurement as JSON.
PROBE = """
import json, time
from engine.prompts import normalize
out = {}
for n in (10**5, 10**6):
    ids = list(range(n))
    start = time.perf_counter()
    normalize([ids])
    out[f"normalize {n:,} ids"] = time.perf_counter() - start
import kvload
llm = kvload.LLM("tiny-llama", log=False, max_seq_len=64, kv_cache_config={"max_tokens": 512})
ids = [1] * 10**6
start = time.perf_counter()
try:
    llm.generate(ids, max_tokens=2)
except ValueError:
    out["LLM.generate refuses 10**6 ids"] = time.perf_counter() - start
llm.close()
print(json.dumps(out))
"""


def one_run(pythonpath: Path) -> dict[str, float]:
    """Each measurement's seconds, from a fresh process on ``pythonpath``'s checkout."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env,
                          cwd=tempfile.gettempdir(), check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    """Run ``--repeats`` times per checkout, interleaved; print a markdown table of medians."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to compare with")
    a = ap.parse_args()
    trees = [("this checkout", REPO)] + ([("baseline", a.baseline)] if a.baseline else [])
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _ in trees}
    for _ in range(a.repeats):  # interleaved: each repeat runs every checkout once
        for label, tree in trees:
            runs[label].append(one_run(tree))
    names = list(runs["this checkout"][0])
    table = Table("Checking a long prompt", f"python -m bench.bench_prompt_check --repeats {a.repeats}"
                  + (" --baseline DIR" if a.baseline else ""), ["checkout", *(f"{n}, s" for n in names)])
    meds = {label: [median([r[n] for r in rs]) for n in names] for label, rs in runs.items()}
    for label, values in meds.items():
        table.rows.append([label, *(f"{v:.3f}" for v in values)])
    if a.baseline:
        table.notes.append("baseline / this: " + ", ".join(
            f"{n} {ratio(b / t)}" for n, b, t in zip(names, meds["baseline"], meds["this checkout"], strict=True)))
    table.notes.append("machine: " + json.dumps(machine()))
    print(table.markdown())


if __name__ == "__main__":
    main()
