"""Per-token pooling (``LLM.encode(pooling_task="token_embed")``) of a causal LM with a wide vocabulary: CPU time and
peak memory of the call, main's checkout against this one.

Each checkout runs in its own process (``PYTHONPATH`` its folder), alternately, ``--rounds`` times: one tiny Llama
checkpoint (vocab ``--vocab``, hidden 256, 2 layers, float32, one thread) built once, a one-prompt warm-up, then
``--calls`` calls of ``--prompts`` prompts of ``--tokens`` tokens each (``max_num_tokens`` 2048: four prompts a
step). Peak memory: the growth of the process's peak RSS over the first call (the warm-up is too small to reach it).
The outputs' SHA-256 is compared across checkouts (the rows must be byte-identical).

    python -m bench.bench_pooling_rows --baseline /work/main [--vocab 65536] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(ckpt: str, prompts: int, tokens: int, calls: int) -> None:
    """One checkout's measurement (this file run by path, the checkout on ``PYTHONPATH``): a JSON line."""
    import hashlib
    import resource
    import time

    import torch

    import kvload

    torch.set_num_threads(1)
    vocab = json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"]
    ids = [[(97 * p + 13 * i + 1) % (vocab - 1) + 1 for i in range(tokens)] for p in range(prompts)]
    kv = {"max_tokens": prompts * tokens + 1024, "tokens_per_block": 16}
    with kvload.LLM(ckpt, dtype="float32", device="cpu", max_seq_len=tokens + 16, max_num_tokens=2048, log=False,
                    kv_cache_config=kv) as llm:
        llm.encode([ids[0][:16]], pooling_task="token_embed")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        cpu, peak, digest = [], 0, ""
        for call in range(calls):
            t0 = time.process_time()
            outs = llm.encode(ids, pooling_task="token_embed")
            cpu.append(time.process_time() - t0)
            if call == 0:
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
                digest = hashlib.sha256(b"".join(o.outputs.data.numpy().tobytes() for o in outs)).hexdigest()
    print(json.dumps({"cpu": cpu, "peak_kib": peak, "sha": digest}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="the other checkout (main's)")
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.prompts, args.tokens, args.calls)
        return
    from transformers import LlamaConfig

    from bench.common import median, ratio
    from models.weights import random_model
    from tests.llm_support import word_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                          tie_word_embeddings=False)
        random_model(cfg, device="cpu", dtype="float32", seed=0).save_pretrained(tmp)
        word_tokenizer(args.vocab).save_pretrained(tmp)
        trees = {"main": Path(args.baseline).resolve(), "this": REPO}
        got: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
                out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--baseline", "-", "--child", tmp,
                                      "--prompts", str(args.prompts), "--tokens", str(args.tokens),
                                      "--calls", str(args.calls)], env=env, cwd=tmp, capture_output=True, text=True,
                                     check=True)
                got[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    cpu = {n: median([c for r in runs for c in r["cpu"]]) for n, runs in got.items()}
    peak = {n: median([r["peak_kib"] for r in runs]) / 1024 for n, runs in got.items()}
    shas = {r["sha"] for runs in got.values() for r in runs}
    print(f"token_embed, {args.prompts} prompts x {args.tokens} tokens, vocab {args.vocab}, hidden 256, 2 layers, "
          f"float32, 1 thread; {args.rounds} rounds x {args.calls} calls")
    print("| checkout | CPU s per call (median) | peak RSS growth MiB (median) |")
    print("|---|---|---|")
    for n in trees:
        print(f"| {n} | {cpu[n]:.3f} | {peak[n]:.0f} |")
    print(f"main/this: CPU {ratio(cpu['main'] / cpu['this'])}, peak memory "
          f"{ratio(peak['main'] / max(peak['this'], 1e-9))}; outputs byte-identical across checkouts: {len(shas) == 1}")


if __name__ == "__main__":
    main()
