"""Probe: FlexAttention shaped for decode (one query per sequence, batch = sequences) over a paged pool.

The question it answers: would a decode-only layout beat kvload's packed compiled path
(``cache_backends/flex_paged.py``, timed by ``bench_attention``)? Here q is ``(B, H, 1, d)`` with
``enable_gqa`` (so torch can pick its split-KV decoding kernel), K/V the whole pool ``(1, Hkv, slots, d)``
broadcast over the batch, and the block mask lists each sequence's physical pages (full pages skip the
mask function). Per (batch, length): SDPA over a contiguous copy of the same keys, this path, their ratio
(``flex_x`` >= 1: as fast as contiguous) and the largest output difference. On an H200 (BENCHMARKS.md,
"GPU check") it measured 0.41x at 32 x 4,096, about what the packed path's kernel does, so it was not built.

    python -m bench.probe_flex_decode --device cuda --batch 1,8,32,64 --lengths 512,4096,8192 \\
        --heads 32 --kv-heads 8 --head-dim 128 --dtype bfloat16 --block 32 --reps 30 --variants bcast
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import traceback

import torch
import torch.nn.functional as F


def median_us(fn, reps: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def point(B: int, L: int, variant: str, args: argparse.Namespace, pool: torch.Tensor, compiled) -> str:
    """One (batch, length) point: contiguous SDPA and decode-shaped flex times, their ratio and max difference."""
    from torch.nn.attention.flex_attention import BlockMask

    dev, dtype = pool.device, pool.dtype
    H, Hkv, d, T = args.heads, args.kv_heads, args.head_dim, args.block
    nblk = pool.shape[0] // T
    k_all = pool[:, 0].permute(1, 0, 2).unsqueeze(0)  # (1, Hkv, slots, d), as kvload's pools view a layer
    v_all = pool[:, 1].permute(1, 0, 2).unsqueeze(0)
    on_cpu = dev.type == "cpu"
    per = -(-L // T)
    ids = list(range(nblk))
    random.Random(B * 7 + L).shuffle(ids)
    tables = torch.tensor([ids[b * per:(b + 1) * per] for b in range(B)], dtype=torch.int32)
    bpos = torch.zeros(nblk, dtype=torch.int64)
    for b in range(B):
        bpos[tables[b].long()] = torch.arange(per)
    bpos = bpos.to(dev)
    seqlen = torch.full((B,), L, dtype=torch.int64, device=dev)
    kv_num = torch.ones(B, 1, 1, dtype=torch.int32)
    kv_idx = torch.zeros(B, 1, 1, nblk, dtype=torch.int32)
    kv_idx[:, 0, 0, 0] = tables[:, per - 1]
    full_num = torch.full((B, 1, 1), per - 1, dtype=torch.int32)
    full_idx = torch.zeros(B, 1, 1, nblk, dtype=torch.int32)
    full_idx[:, 0, 0, :per - 1] = tables[:, :per - 1]
    kv_num, kv_idx, full_num, full_idx = (x.to(dev) for x in (kv_num, kv_idx, full_num, full_idx))

    def mask_mod(b, h, q_idx, kv_idx):
        pos = bpos[kv_idx // T] * T + kv_idx % T
        return pos < seqlen[b]

    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(128, T),
                                    mask_mod=mask_mod, seq_lengths=(1, nblk * T),
                                    compute_q_blocks=False)
    q = torch.randn(B, H, 1, d, device=dev, dtype=dtype)
    if variant == "bcast":
        k, v = k_all, v_all
    else:
        k, v = k_all.expand(B, -1, -1, -1), v_all.expand(B, -1, -1, -1)
    opts = None
    t0 = time.perf_counter()

    def flex():
        return compiled(q, k, v, block_mask=mask, scale=d**-0.5, enable_gqa=Hkv != H,
                        kernel_options=opts)

    out = flex()
    if not on_cpu:
        torch.cuda.synchronize()
    comp = time.perf_counter() - t0
    # reference: the same sequences gathered contiguous
    slots = (tables.long()[:, :, None] * T + torch.arange(T)[None, None, :]).reshape(B, -1)[:, :L]
    slots = slots.to(dev)
    kd = k_all[0][:, slots].permute(1, 0, 2, 3).contiguous()  # (B, Hkv, L, d)
    vd = v_all[0][:, slots].permute(1, 0, 2, 3).contiguous()

    def contig():
        return F.scaled_dot_product_attention(q, kd, vd, scale=d**-0.5, enable_gqa=Hkv != H)

    diff = (out.float() - contig().float()).abs().max().item()
    tc = median_us(contig, args.reps, dev)
    tf = median_us(flex, args.reps, dev)
    return f"{variant:7s} {B:6d} {L:6d} {tc:8.1f} {tf:8.1f} {tc / tf:6.2f} {diff:8.4f} {comp:8.1f}"

def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--lengths", default="256")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--variants", default="bcast,expand")
    args = p.parse_args()
    from torch.nn.attention.flex_attention import flex_attention

    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    H, Hkv, d, T = args.heads, args.kv_heads, args.head_dim, args.block
    batches = [int(x) for x in args.batch.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    nblk = max(batches) * -(-max(lengths) // T)
    pool = torch.randn(nblk * T, 2, Hkv, d, device=dev, dtype=dtype)  # slots x (K, V) x heads x head dim
    compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    print(f"device={dev} dtype={dtype} H={H} Hkv={Hkv} d={d} T={T} pool_blocks={nblk} torch={torch.__version__}")
    print("variant  batch    len   contig    flex  flex_x  maxdiff  compile_s")
    for variant in args.variants.split(","):
        for B in batches:
            for L in lengths:
                try:
                    print(point(B, L, variant, args, pool, compiled), flush=True)
                except Exception as exc:
                    print(f"{variant:7s} {B:6d} {L:6d} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    traceback.print_exc(limit=3)


if __name__ == "__main__":
    main()
