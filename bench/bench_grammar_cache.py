"""What a server fed distinct structured-output schemas keeps in memory: kvload's compiled-grammar cache against
xgrammar's own byte-bounded one.

Run from the repository root (needs xgrammar: ``pip install 'kvload[structured]'``)::

    python -m bench.bench_grammar_cache                   # 3,600 distinct six-property schemas
    python -m bench.bench_grammar_cache --schemas 1200 --every 300

Each schema is compiled against a byte-level tokenizer (the tests' 512-token one) and one matcher fills one bitmask,
as a request's first step does; the process's resident memory is read from ``/proc/self/statm`` every ``--every``
schemas. Modes run in separate processes (a fresh allocator each): ``kvload`` is :class:`engine.structured.
GrammarBackend` (the latest ``COMPILED_GRAMMARS`` kept, xgrammar's cache off); ``xgrammar-64MiB`` is xgrammar's
``GrammarCompiler(cache_limit_bytes=64 MiB)``, the cache this replaced.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from bench.common import machine


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _run(mode: str, schemas: int, every: int) -> list[tuple[int, float]]:
    """In this process: compile ``schemas`` distinct schemas in ``mode``; (schemas so far, resident MiB) samples."""
    import gc

    import xgrammar as xgr

    from engine.structured import GrammarBackend
    from engine.structured_params import StructuredOutputsParams
    from tests.text_support import trained_tokenizer

    tokenizer = trained_tokenizer("bytelevel", 300)
    backend = GrammarBackend(tokenizer, 512, {2}) if mode == "kvload" else None
    if backend is None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=512, stop_token_ids=[2])
        compiler = xgr.GrammarCompiler(info, cache_limit_bytes=64 << 20)
    samples = [(0, _rss_mib())]
    for i in range(schemas):
        schema = {"type": "object", "properties": {f"k{i}_{j}": {"type": "string", "maxLength": 20} for j in range(6)},
                  "required": [f"k{i}_0"]}
        if backend is not None:
            matcher = backend.constraint(StructuredOutputsParams(json=schema)).matcher
        else:
            matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
        matcher.fill_next_token_bitmask(xgr.allocate_token_bitmask(1, 512))
        del matcher
        if (i + 1) % every == 0:
            gc.collect()
            samples.append((i + 1, _rss_mib()))
    return samples


def main(argv: list[str] | None = None) -> None:
    """Print one markdown row per mode: resident MiB after each ``--every`` schemas."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemas", type=int, default=3600)
    p.add_argument("--every", type=int, default=600)
    p.add_argument("--mode", choices=("kvload", "xgrammar-64MiB"), help=argparse.SUPPRESS)  # one mode, in-process
    args = p.parse_args(argv)
    if args.mode:
        print(json.dumps(_run(args.mode, args.schemas, args.every)))
        return
    rows = {}
    for mode in ("kvload", "xgrammar-64MiB"):
        cmd = [sys.executable, "-m", "bench.bench_grammar_cache", "--mode", mode, "--schemas", str(args.schemas),
               "--every", str(args.every)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    counts = [n for n, _ in rows["kvload"]]
    print(f"machine: {machine()}\n")
    print("| cache | " + " | ".join(f"{n:,} schemas" for n in counts) + " |")
    print("|---|" + "--:|" * len(counts))
    for mode, samples in rows.items():
        print(f"| {mode} | " + " | ".join(f"{mib:.0f} MiB" for _, mib in samples) + " |")


if __name__ == "__main__":
    main()
