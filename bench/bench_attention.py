"""Decode attention: kvload's paged gather + SDPA against SDPA over a contiguous cache.

Run from the repository root::

    python -m bench.bench_attention                       # small CPU sizes, a few seconds
    python -m bench.bench_attention --device cuda --batch 1,8,32,64 --lengths 512,2048,8192 \\
        --heads 32 --kv-heads 8 --head-dim 128 --dtype bfloat16

One decode step of one layer per point: every sequence brings one new token at position ``L - 1``
(``--ragged``: sequences of unequal lengths up to ``L``, so both sides need a padding mask).
``gather`` writes the new K/V into the block pool and gathers each sequence's blocks (physical blocks
shuffled, as a real pool hands them out) before SDPA; ``flex`` writes the same way and runs the
compiled FlexAttention straight over the pool (``cache_backends.flex_paged``); ``triton`` the paged decode
kernel (``cache_backends.paged_decode``; on CUDA, or in Triton's interpreter with ``--triton on``), ``tri_step``
the same with its whole per-step cost (tables, uploads); ``cpu`` / ``cpu_step`` the same for the CPU paged decode
kernel (``cache_backends.cpu_decode``; on CPU where a C compiler builds it); ``contiguous`` writes
into a dense ``(B, kv_heads, L, head_dim)`` cache and runs SDPA over it. ``plan_old`` is the per-step
``PagedBatch`` build from block-table lists; ``plan`` the same from the executor's tensor rows
(``BlockTableStore``); ``plan_flex`` the compiled path's plan (tables + block mask). A plan is paid
once per step and shared by every layer; the ``_x`` ratios add it to one layer's attention (the
worst case: a one-layer model). Medians over ``--reps`` runs after warm-up.

``--mla`` times one multi-head latent attention layer (DeepSeek V2/V3; ``--heads``, ``--nope-dim``,
``--rope-dim``, ``--kv-rank``, ``--v-dim``: DeepSeek-V2-Lite's 16, 128, 64, 512, 128 by default there)
instead: the pool holds one ``[latent | rope]`` row per token. ``contig`` is the model's own attention
over a contiguous latent cache (transformers' DeepSeek: every cached latent expanded through
``kv_b_proj`` into per-head K/V each step, then SDPA); ``gather`` kvload's ``sdpa`` path as built (for
a decode step: the latents gathered once and attended in the absorbed form, ``attend_latent_gathered``;
before that form was built there, expanded the model's way); ``gather_abs`` the gathered latents in the
absorbed form written out in the bench (queries folded into latent space, one shared KV head; no
expansion), the reference ``gather`` is checked against; ``flex`` the compiled
path (absorbed, the kernel reading the pool in place). Each includes the new token's write and, on
the absorbed paths, the query fold and the output's up-projection. ``--mla --mla-prefill 64@0,64@512``
times one sequence's chunk of 64 tokens from position 0 and 512 instead, absorbed (flex; with ``--no-flex``
absorbed over the gathered latents) against expanded (gather + SDPA), and prints which the executor's rule
(``absorbed_pays``) picks for that step.

``--plan-groups 5+1,52+10`` times only the per-step plan of a whole model instead: ``S`` sliding-window
(``--window``) and ``F`` full layers on a V2 layout, once with every layer's page the same shape (one
shared arena, the layers cut into ``gcd(S, F)``-layer groups: tiny-gemma3 is 5+1 → 6 groups, Gemma 3 27B
52+10 → 31) and once with the full layers' entries twice as wide (pages differ: the same layers stay two
groups). A plan is what the executor does per step before the forward: every request's block tables
into the store (``update_all``), the step's tables, ``PagedBatch.build`` and every layer's gather slots
and mask (``--clock`` does not apply: always the thread's CPU time). ``cut/2`` is what the cut costs the
plan. ``--against TREE`` (e.g. a checkout of main) times that tree's plan too, in interleaved pairs.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from cache_backends.block_tables import BlockTableStore
from cache_backends.flex_paged import FlexPagedAttention
from cache_backends.layout import LayerKV, build_layout
from cache_backends.paged_attention import PagedBatch, SeqChunk, mla_paged_attention, paged_attention
from cache_backends.pools import TORCH_DTYPES, BlockPools

#: what ``median_us`` reads: "cpu" = the calling thread's CPU time (``--threads 1`` on a CPU: torch computes on
#: this thread, so other processes on a shared machine barely move it), "wall" = elapsed time
CLOCK = {"name": "wall"}


def median_us(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median time of ``fn`` in microseconds (synchronising CUDA around each run), on ``CLOCK``'s clock."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.thread_time if CLOCK["name"] == "cpu" else time.perf_counter
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        sync()
        start = clock()
        fn()
        sync()
        times.append((clock() - start) * 1e6)
    return statistics.median(times)


def paged_decode_kernels(args: argparse.Namespace, device: torch.device) -> dict[str, Callable[..., torch.Tensor]]:
    """The paged decode kernels ``--triton`` / ``--cpu-kernel`` ask for that run here (``on``: one that cannot
    is an error)."""
    from cache_backends.cpu_decode import KernelUnavailable, cpu_decode_unsupported, load_cpu_kernel
    from cache_backends.paged_decode import paged_decode, paged_decode_unsupported
    from models.gguf_cache import cache_root

    kernels: dict[str, Callable[..., torch.Tensor]] = {}
    if args.triton != "off":
        why = paged_decode_unsupported(device, args.block, args.head_dim)
        if why is None:
            kernels["triton"] = paged_decode
        elif args.triton == "on":
            raise SystemExit(f"--triton on: {why}")
    if args.cpu_kernel != "off":
        why = cpu_decode_unsupported(device, args.head_dim, args.heads // args.kv_heads, TORCH_DTYPES[args.dtype])
        if why is None:
            try:
                kernels["cpu"] = load_cpu_kernel(cache_root() / "kernels")
            except KernelUnavailable as exc:
                why = str(exc)
        if why is not None and args.cpu_kernel == "on":
            raise SystemExit(f"--cpu-kernel on: {why}")
    return kernels


def bench_point(batch: int, length: int, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Time one (batch, context length) point."""
    dtype = TORCH_DTYPES[args.dtype]
    hkv, hd, h, T = args.kv_heads, args.head_dim, args.heads, args.block
    layout = build_layout([LayerKV(0, "full", 2 * hkv * hd)], "v2", T, args.dtype)
    blocks_per_seq = -(-length // T)
    pools = BlockPools(layout, {"full": batch * blocks_per_seq}, device)
    pools.tensors["full"].normal_()
    ids = list(range(batch * blocks_per_seq))
    random.Random(0).shuffle(ids)
    tables = [ids[b * blocks_per_seq:(b + 1) * blocks_per_seq] for b in range(batch)]
    # --ragged: sequence b holds length - b * length // (2 * batch) tokens, so padding needs masks
    lens = [length - (b * length // (2 * batch) if args.ragged else 0) for b in range(batch)]
    chunks = [SeqChunk([1], n - 1, {"full": t}) for n, t in zip(lens, tables, strict=True)]
    pad_mask = None
    if args.ragged:
        pad_mask = (torch.arange(length, device=device)[None, :] < torch.tensor(lens, device=device)[:, None])
        pad_mask = pad_mask[:, None, None, :]
    last = torch.tensor(lens, device=device) - 1
    rows = torch.arange(batch, device=device)

    q = torch.randn(batch, h, hd, device=device, dtype=dtype)
    k_new = torch.randn(batch, hkv, hd, device=device, dtype=dtype)
    v_new = torch.randn(batch, hkv, hd, device=device, dtype=dtype)
    step = PagedBatch.build(chunks, pools)
    scale = hd**-0.5
    # the executor's way: tables kept as tensor rows across steps; a decode step only diffs the lists
    store = BlockTableStore(["full"], blocks_per_seq)
    rows = [store.update(f"r{b}", "full", t) for b, t in enumerate(tables)]
    bare = [SeqChunk([1], n - 1, {}) for n in lens]
    flex = FlexPagedAttention(pools, batch) if args.flex else None
    if flex is not None:
        pools.tensors["full"].normal_()  # FlexPagedAttention zero-filled the pool

    k_dense = torch.randn(batch, hkv, length, hd, device=device, dtype=dtype)
    v_dense = torch.randn(batch, hkv, length, hd, device=device, dtype=dtype)

    def contiguous() -> torch.Tensor:
        k_dense[rows, :, last] = k_new
        v_dense[rows, :, last] = v_new
        return F.scaled_dot_product_attention(q.unsqueeze(2), k_dense, v_dense, attn_mask=pad_mask, scale=scale,
                                              enable_gqa=h != hkv)

    def paged() -> torch.Tensor:
        return paged_attention(step, 0, q, k_new, v_new, scale)

    def plan_lists() -> None:  # before: lists -> padded tensors every step, then gathers and masks
        fresh = PagedBatch.build(chunks, pools)
        fresh.mask(0)  # gathers and masks are planned on first use

    def plan() -> None:  # after: the tables from the store (the lists diffed), then gathers and masks
        for b, t in enumerate(tables):
            store.update(f"r{b}", "full", t)
        fresh = PagedBatch.build(bare, pools, store.tables(rows))
        fresh.mask(0)

    flex_step = [PagedBatch.build(bare, pools, store.tables(rows), flex=flex)]

    def plan_flex() -> None:  # the compiled path's plan: tables from the store, then the block mask
        for b, t in enumerate(tables):
            store.update(f"r{b}", "full", t)
        fresh = PagedBatch.build(bare, pools, store.tables(rows), flex=flex)
        flex.block_mask(fresh, "full", None, flex.rows_per_token(h // hkv))
        flex_step[0] = fresh

    def compiled() -> torch.Tensor:
        return paged_attention(flex_step[0], 0, q, k_new, v_new, scale)

    def kernel_step(kernel: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:  # a paged decode kernel, its whole step: tables, uploads, write, attend
            for b, t in enumerate(tables):
                store.update(f"r{b}", "full", t)
            fresh = PagedBatch.build(bare, pools, store.tables(rows), decode_kernel=kernel)
            return paged_attention(fresh, 0, q, k_new, v_new, scale)
        return step

    def kernel_only(kernel: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
        kept = PagedBatch.build(bare, pools, store.tables(rows), decode_kernel=kernel)

        def attend() -> torch.Tensor:  # the same batch again: its uploads are kept, so write + kernel only
            return paged_attention(kept, 0, q, k_new, v_new, scale)
        return attend

    with torch.inference_mode():
        torch.testing.assert_close(paged()[0].float(), paged()[0].float())  # a smoke check: deterministic
        result = {"contiguous": median_us(contiguous, args.reps, device), "paged": median_us(paged, args.reps, device),
                  "plan_lists": median_us(plan_lists, args.reps, device), "plan": median_us(plan, args.reps, device)}
        if flex is not None:
            plan_flex()
            # float32 agrees to 1e-4; half types only to their rounding (bf16 keeps 8 bits of mantissa)
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(compiled().float(), paged().float(), rtol=tol, atol=tol)
            result["flex"] = median_us(compiled, args.reps, device)
            result["plan_flex"] = median_us(plan_flex, args.reps, device)
        for name, kernel in args.kernels.items():  # "triton", "cpu": the paged decode kernels that run here
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(kernel_step(kernel)().float(), paged().float(), rtol=tol, atol=tol)
            result[name] = median_us(kernel_only(kernel), args.reps, device)
            result[f"{name}_step"] = median_us(kernel_step(kernel), args.reps, device)
    pools.release()
    return result


def mixed_point(batch: int, length: int, chunk: int, args: argparse.Namespace, device: torch.device,
                kernel: Callable[..., torch.Tensor]) -> dict[str, float]:
    """One layer of a mixed step: ``batch`` decode rows at ``length`` keys and one new prompt's chunk of ``chunk``
    tokens from position 0, on gather + SDPA and on the decode kernel split (``PagedBatch.attend_mixed``), each with
    its step's plan built afresh (tables from the store, ``PagedBatch.build``)."""
    dtype = TORCH_DTYPES[args.dtype]
    hkv, hd, h, T = args.kv_heads, args.head_dim, args.heads, args.block
    layout = build_layout([LayerKV(0, "full", 2 * hkv * hd)], "v2", T, args.dtype)
    lens = [length] * batch + [chunk]
    need = [-(-n // T) for n in lens]
    pools = BlockPools(layout, {"full": sum(need)}, device)
    pools.tensors["full"].normal_()
    ids = list(range(sum(need)))
    random.Random(0).shuffle(ids)
    tables, at = [], 0
    for k in need:
        tables.append(ids[at:at + k])
        at += k
    store = BlockTableStore(["full"], max(need))
    rows = [store.update(f"r{b}", "full", t) for b, t in enumerate(tables)]
    chunks = [SeqChunk([1], length - 1, {}) for _ in range(batch)] + [SeqChunk([1] * chunk, 0, {})]
    tokens = batch + chunk
    q = torch.randn(tokens, h, hd, device=device, dtype=dtype)
    k_new = torch.randn(tokens, hkv, hd, device=device, dtype=dtype)
    v_new = torch.randn(tokens, hkv, hd, device=device, dtype=dtype)
    scale = hd**-0.5

    def step(use: Callable[..., torch.Tensor] | None) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            fresh = PagedBatch.build(chunks, pools, store.tables(rows), decode_kernel=use)
            return paged_attention(fresh, 0, q, k_new, v_new, scale)
        return run

    with torch.inference_mode():
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(step(kernel)().float(), step(None)().float(), rtol=tol, atol=tol)
        result = {"gather": median_us(step(None), args.reps, device),
                  "split": median_us(step(kernel), args.reps, device)}
    pools.release()
    return result


def mixed_table(args: argparse.Namespace, device: torch.device) -> None:
    """``--mixed-chunk``: the mixed-step table, gather + SDPA against the decode rows on the kernel."""
    kernel = args.kernels.get("cpu") or args.kernels.get("triton")
    if kernel is None:
        raise SystemExit("--mixed-chunk times the paged decode kernel's split, and no kernel runs here")
    print(f"clock={CLOCK['name']} device={device} dtype={args.dtype} heads={args.heads} kv_heads={args.kv_heads} "
          f"head_dim={args.head_dim} block={args.block} reps={args.reps} threads={torch.get_num_threads()} "
          f"chunk={args.mixed_chunk} kernel={'cpu' if 'cpu' in args.kernels else 'triton'}")
    print("one layer of a step: `batch` decode rows at `len` keys + one new prompt's chunk; times in us (medians), "
          "plan included; x = gather / split")
    print(f"{'batch':>5} {'len':>6} {'gather':>9} {'split':>9} {'x':>6}")
    for b in (int(x) for x in args.batch.split(",")):
        for n in (int(x) for x in args.lengths.split(",")):
            r = mixed_point(b, n, args.mixed_chunk, args, device, kernel)
            print(f"{b:>5} {n:>6} {r['gather']:>9.1f} {r['split']:>9.1f} {r['gather'] / r['split']:>6.2f}", flush=True)


def bench_mla_point(batch: int, length: int, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Time one (batch, context length) point of an MLA layer's decode (see ``--mla``)."""
    dtype = TORCH_DTYPES[args.dtype]
    h, nope, rope, rank, dv, T = args.heads, args.nope_dim, args.rope_dim, args.kv_rank, args.v_dim, args.block
    width = rank + rope
    layout = build_layout([LayerKV(0, "mla", width)], "v2", T, args.dtype)
    group = layout.groups[0].name
    blocks_per_seq = -(-length // T)
    pools = BlockPools(layout, {group: batch * blocks_per_seq}, device)
    ids = list(range(batch * blocks_per_seq))
    random.Random(0).shuffle(ids)
    tables = [ids[b * blocks_per_seq:(b + 1) * blocks_per_seq] for b in range(batch)]
    lens = [length - (b * length // (2 * batch) if args.ragged else 0) for b in range(batch)]
    store = BlockTableStore([group], blocks_per_seq)
    rows = [store.update(f"r{b}", group, t) for b, t in enumerate(tables)]
    bare = [SeqChunk([1], n - 1, {}) for n in lens]
    flex = FlexPagedAttention(pools, batch) if args.flex else None  # zero-fills the pool: fill it after
    pools.tensors[group].normal_()
    pad_mask = None
    if args.ragged:
        pad_mask = (torch.arange(length, device=device)[None, :] < torch.tensor(lens, device=device)[:, None])
        pad_mask = pad_mask[:, None, None, :]
    last = torch.tensor(lens, device=device) - 1
    seq = torch.arange(batch, device=device)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    w = randn(h * (nope + dv), rank) / rank**0.5  # kv_b_proj.weight
    w_kv = w.view(h, nope + dv, rank)
    w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
    q_nope, q_pe, lat_new, pe_new = randn(batch, h, nope), randn(batch, h, rope), randn(batch, rank), randn(batch, rope)
    scale = (nope + rope) ** -0.5
    dense = randn(batch, length, width)
    step = PagedBatch.build(bare, pools, store.tables(rows))
    flex_step = PagedBatch.build(bare, pools, store.tables(rows), flex=flex)

    def contiguous() -> torch.Tensor:  # transformers' DeepseekV3Attention over a contiguous latent cache
        dense[seq, last] = torch.cat((lat_new, pe_new), dim=-1)
        kv = F.linear(dense[..., :rank], w).view(batch, length, h, nope + dv).transpose(1, 2)
        k_nope, v = kv.split([nope, dv], dim=-1)
        k = torch.cat((k_nope, dense[:, None, :, rank:].expand(-1, h, -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1).unsqueeze(2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=pad_mask, scale=scale).squeeze(2)

    def gather() -> torch.Tensor:
        return mla_paged_attention(step, 0, q_nope, q_pe, lat_new, pe_new, w_kv, scale)

    def gather_absorbed() -> torch.Tensor:
        # plain matmuls: one KV head, so a sequence's H queries are the rows of one (H, D) x (D, max_k) product
        # (SDPA with enable_gqa and a V head dim unlike K's takes its slow math path: ~30x this at 1024 keys)
        step.write(0, torch.cat((lat_new, pe_new), dim=-1))
        e = step.gather(0)  # (B, max_k, rank + rope)
        q = torch.cat((torch.matmul(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_pe), dim=-1)  # (B, H, D)
        scores = torch.matmul(q, e.transpose(1, 2)) * scale  # (B, H, max_k)
        bias = step.bias(0, dtype)
        if bias is not None:
            scores = scores + bias[:, 0]
        o = torch.matmul(torch.softmax(scores, dim=-1), e[..., :rank])  # (B, H, rank)
        return torch.matmul(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def compiled() -> torch.Tensor:
        return mla_paged_attention(flex_step, 0, q_nope, q_pe, lat_new, pe_new, w_kv, scale)

    def plan() -> None:
        for b, t in enumerate(tables):
            store.update(f"r{b}", group, t)
        PagedBatch.build(bare, pools, store.tables(rows)).mask(0)

    def plan_flex() -> None:
        for b, t in enumerate(tables):
            store.update(f"r{b}", group, t)
        fresh = PagedBatch.build(bare, pools, store.tables(rows), flex=flex)
        flex.block_mask(fresh, group, None, flex.rows_per_token(h))

    with torch.inference_mode():
        # the paths agree (the dense cache holds other numbers than the pool: compare the paged ones only)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        ref = gather()
        torch.testing.assert_close(gather_absorbed().float(), ref.float(), rtol=tol, atol=tol)
        result = {"contiguous": median_us(contiguous, args.reps, device), "paged": median_us(gather, args.reps, device),
                  "absorbed": median_us(gather_absorbed, args.reps, device), "plan": median_us(plan, args.reps, device)}
        if flex is not None:
            torch.testing.assert_close(compiled().float(), ref.float(), rtol=tol, atol=tol)
            result["flex"] = median_us(compiled, args.reps, device)
            result["plan_flex"] = median_us(plan_flex, args.reps, device)
            result["compile_s"] = flex.warmup_s
    pools.release()
    return result


def mla_table(args: argparse.Namespace, device: torch.device) -> None:
    """``--mla``: one MLA layer's decode per (batch, length) point, every path side by side."""
    print(f"MLA decode, one layer: clock={CLOCK['name']} device={device} dtype={args.dtype} heads={args.heads} "
          f"nope={args.nope_dim} rope={args.rope_dim} kv_rank={args.kv_rank} v={args.v_dim} block={args.block} "
          f"reps={args.reps} ragged={args.ragged} threads={torch.get_num_threads()} torch={torch.__version__}")
    print("times in us (medians), plan excluded (shown apart: once per step, shared by the layers); "
          "x = contig / path (> 1: faster than the model's own attention)")
    print(f"{'batch':>5} {'len':>6} {'contig':>9} {'gather':>9} {'gather_abs':>10} {'flex':>8} {'plan':>6} "
          f"{'plan_flex':>9} {'gather_x':>8} {'abs_x':>6} {'flex_x':>6} {'flex/abs':>8} {'compile_s':>9}")
    for b in (int(x) for x in args.batch.split(",")):
        for n in (int(x) for x in args.lengths.split(",")):
            r = bench_mla_point(b, n, args, device)
            c = r["contiguous"]
            line = (f"{b:>5} {n:>6} {c:>9.1f} {r['paged']:>9.1f} {r['absorbed']:>10.1f} {r.get('flex', 0):>8.1f} "
                    f"{r['plan']:>6.1f} {r.get('plan_flex', 0):>9.1f} {c / r['paged']:>8.2f} {c / r['absorbed']:>6.2f}")
            if "flex" in r:
                line += f" {c / r['flex']:>6.2f} {r['flex'] / r['absorbed']:>8.2f} {r['compile_s']:>9.1f}"
            print(line, flush=True)


def mla_prefill(args: argparse.Namespace, device: torch.device) -> None:
    """``--mla-prefill N@S,...``: one sequence's chunk of N tokens from position S, absorbed (flex) vs expanded.

    Times ``mla_paged_attention`` on the compiled path (absorbed) and on gather + SDPA (the gathered latents
    expanded through ``kv_b_proj``), and prints which one ``models.paged_forward.absorbed_pays`` picks for
    that step. Plans excluded.
    """
    from types import SimpleNamespace

    from cache_backends.paged_attention import GATHERED_ABSORBED_RATE
    from models.paged_forward import absorbed_pays

    dtype = TORCH_DTYPES[args.dtype]
    h, nope, rope, rank, dv, T = args.heads, args.nope_dim, args.rope_dim, args.kv_rank, args.v_dim, args.block
    config = SimpleNamespace(kv_lora_rank=rank, qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=dv)
    print(f"MLA chunk (one sequence), one layer: clock={CLOCK['name']} device={device} dtype={args.dtype} heads={h} "
          f"nope={nope} rope={rope} kv_rank={rank} v={dv} block={T} reps={args.reps} threads={torch.get_num_threads()}")
    print(f"{'tokens':>6} {'from':>6} {'expanded_us':>12} {'absorbed_us':>12} {'abs/exp':>8} {'picked':>9}")
    for spec in args.mla_prefill.split(","):
        n, start = (int(x) for x in spec.split("@"))
        layout = build_layout([LayerKV(0, "mla", rank + rope)], "v2", T, args.dtype)
        group = layout.groups[0].name
        blocks = -(-(start + n) // T)
        pools = BlockPools(layout, {group: blocks + 2}, device)  # the compiled path wants 2 blocks or more
        flex = FlexPagedAttention(pools, max(n, 8)) if args.flex else None
        pools.tensors[group].normal_()
        ids = list(range(blocks))
        random.Random(0).shuffle(ids)
        chunk = [SeqChunk([1] * n, start, {group: ids})]
        w = torch.randn(h, nope + dv, rank, device=device, dtype=dtype) / rank**0.5
        qn, qp = (torch.randn(n, h, d, device=device, dtype=dtype) for d in (nope, rope))
        lat, pe = (torch.randn(n, d, device=device, dtype=dtype) for d in (rank, rope))
        expanded, absorbed = PagedBatch.build(chunk, pools), PagedBatch.build(chunk, pools, flex=flex)
        scale = (nope + rope) ** -0.5

        def run(step: PagedBatch, form: bool, inputs: tuple = (qn, qp, lat, pe, w, scale)) -> Callable[[], Any]:
            # form: absorbed or expanded on gather + SDPA (a flex step is absorbed on the kernel whatever it says)
            return lambda: mla_paged_attention(step, 0, *inputs, absorbed=form)

        with torch.inference_mode():
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            got, want = run(absorbed, True)(), run(expanded, False)()
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
            e, a = median_us(run(expanded, False), args.reps, device), median_us(run(absorbed, True), args.reps, device)
        rule = {} if args.flex else {"rate": GATHERED_ABSORBED_RATE, "padded": True, "fold": True}
        picked = "absorbed" if absorbed_pays(absorbed, config, **rule) else "expanded"
        print(f"{n:>6} {start:>6} {e:>12.1f} {a:>12.1f} {a / e:>8.2f} {picked:>9}", flush=True)
        pools.release()


def other_tree(root: str) -> tuple[Any, Any]:
    """Another source tree's ``paged_attention`` and ``block_tables`` modules (e.g. main's), imported beside ours."""
    import importlib.util

    mods = []
    for name in ("paged_attention", "block_tables"):
        path = os.path.join(root, "cache_backends", f"{name}.py")
        spec = importlib.util.spec_from_file_location(f"against_{name}", path)
        if spec is None or spec.loader is None:
            raise SystemExit(f"--against: no {path}")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mods.append(mod)
    return mods[0], mods[1]


def plan_point(sliding: int, full: int, cut: bool, batch: int, length: int, args: argparse.Namespace,
               against: tuple[Any, Any] | None) -> tuple[int, float, float | None]:
    """(groups, median µs here, median µs of ``against`` or None) of one step's plan, decode of batch x length.

    With ``against``, the two trees' plans run as interleaved pairs (A, B, A, B, ...) on the same tables,
    and their slots and masks are checked equal first.
    """
    T, E = args.block, 1  # the plan never reads entries: one-element entries keep the arena small
    layers = [LayerKV(i, "sliding", E, window=args.window) for i in range(sliding)]
    layers += [LayerKV(sliding + i, "full", E if cut else 2 * E) for i in range(full)]
    layout = build_layout(layers, "v2", T, "float32")
    names = [g.name for g in layout.groups]
    nblk = -(-length // T)
    total = batch * nblk * len(names) + 1
    pools = BlockPools(layout, dict.fromkeys(names, total), "cpu")
    ids = list(range(total))
    random.Random(0).shuffle(ids)
    lens = [length - (b * length // (2 * batch) if args.ragged else 0) for b in range(batch)]
    lists: list[list[list[int]]] = []  # per request, every group's list (what manager.block_tables returns)
    for n in lens:
        own = []
        for g in layout.groups:
            t = [ids.pop() for _ in range(-(-n // T))]
            if g.window:  # V2 releases the blocks wholly before the window
                first = max(0, n - g.window) // T
                t[:first] = [-1] * first
            own.append(t)
        lists.append(own)
    width = max(-(-8192 // T), nblk)  # the executor's store: max_seq_len's worth of blocks per row

    def planner(pa: Any, bt: Any) -> Callable[[], Any]:
        store = bt.BlockTableStore(names, width)
        chunks = [pa.SeqChunk([1], n - 1, {}) for n in lens]
        per_group = not hasattr(store, "update_all")  # an older tree: its executor updated group by group

        def plan() -> Any:
            if per_group:
                for b, own in enumerate(lists):
                    for g, t in zip(names, own, strict=True):
                        store.update(f"r{b}", g, list(t))  # (its manager's block_table copied each list)
                rows = [store.row(f"r{b}") for b in range(len(lists))]
            else:
                rows = [store.update_all(f"r{b}", own) for b, own in enumerate(lists)]  # V2 hands its own lists
            step = pa.PagedBatch.build(chunks, pools, store.tables(rows))
            for layer in range(sliding + full):
                step.mask(layer)
            return step

        return plan

    here = planner(sys.modules[PagedBatch.__module__], sys.modules[BlockTableStore.__module__])
    if against is None:
        us = median_us(here, args.reps, torch.device("cpu"))
        pools.release()
        return len(names), us, None
    there = planner(*against)
    a, b = there(), here()
    for layer in range(sliding + full):
        if not torch.equal(a._gather(layer).slots, b._gather(layer).slots):
            raise SystemExit(f"--against: layer {layer}'s gather slots differ between the trees")
    for _ in range(3):
        there(), here()
    times: dict[str, list[float]] = {"there": [], "here": []}
    for _ in range(args.reps):
        for side, fn in (("there", there), ("here", here)):
            start = time.thread_time()
            fn()
            times[side].append((time.thread_time() - start) * 1e6)
    pools.release()
    return len(names), statistics.median(times["here"]), statistics.median(times["there"])


def plan_groups(args: argparse.Namespace) -> None:
    """``--plan-groups``: the per-step plan, cut into groups and not, for each layer mix and point."""
    CLOCK["name"] = "cpu"
    against = other_tree(args.against) if args.against else None
    print(f"plan only: clock=cpu (thread) block={args.block} window={args.window} ragged={args.ragged} "
          f"reps={args.reps}; µs per step (medians){'; against ' + args.against if against else ''}; "
          f"load {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    head = f"{'layers':>8} {'batch':>5} {'len':>6} {'groups':>6} {'2 groups':>9} {'cut':>9} {'cut/2':>6}"
    if against:
        head += f" {'2 groups (against)':>18} {'cut (against)':>13} {'cut/2 (against)':>15} {'cut: here/against':>17}"
    print(head)
    for spec in args.plan_groups.split(","):
        sliding, full = (int(x) for x in spec.split("+"))
        for b in (int(x) for x in args.batch.split(",")):
            for n in (int(x) for x in args.lengths.split(",")):
                _, whole, whole_a = plan_point(sliding, full, False, b, n, args, against)
                groups, cut, cut_a = plan_point(sliding, full, True, b, n, args, against)
                line = f"{spec:>8} {b:>5} {n:>6} {groups:>6} {whole:>9.1f} {cut:>9.1f} {cut / whole:>6.2f}"
                if whole_a is not None and cut_a is not None:
                    line += f" {whole_a:>18.1f} {cut_a:>13.1f} {cut_a / whole_a:>15.2f} {cut / cut_a:>17.2f}"
                print(line, flush=True)


def main(argv: list[str] | None = None) -> None:
    """Parse flags, run every point, print a table of medians and ratios."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--lengths", default="128,512,1024", help="comma-separated context lengths")
    p.add_argument("--heads", type=int, default=None, help="query heads (8; with --mla 16)")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block", type=int, default=16, help="tokens per block")
    p.add_argument("--dtype", default="float32", choices=sorted(TORCH_DTYPES))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--clock", choices=("auto", "cpu", "wall"), default="auto",
                   help="cpu: CPU time of the calling thread (right with --threads 1 on a shared machine); "
                        "auto: cpu with --threads 1 on a CPU device, else wall")
    p.add_argument("--ragged", action="store_true", help="unequal sequence lengths (both sides then use a mask)")
    p.add_argument("--no-flex", dest="flex", action="store_false",
                   help="skip the compiled path (each new shape compiles for 10-50 s on a CPU)")
    p.add_argument("--mla", action="store_true", help="time one MLA (latent) layer's decode instead")
    p.add_argument("--nope-dim", type=int, default=128, help="--mla: qk_nope_head_dim")
    p.add_argument("--rope-dim", type=int, default=64, help="--mla: qk_rope_head_dim")
    p.add_argument("--kv-rank", type=int, default=512, help="--mla: kv_lora_rank")
    p.add_argument("--v-dim", type=int, default=128, help="--mla: v_head_dim")
    p.add_argument("--mla-prefill", default="", metavar="N@S,...",
                   help="with --mla: one sequence's chunk of N tokens from position S, absorbed vs expanded")
    p.add_argument("--plan-groups", default="", metavar="S+F,...",
                   help="time only the per-step plan of S sliding + F full layers, cut into groups and not")
    p.add_argument("--window", type=int, default=512, help="--plan-groups: the sliding layers' window")
    p.add_argument("--against", default="", metavar="TREE",
                   help="--plan-groups: also time another source tree's plan (e.g. a checkout of main), in "
                        "interleaved pairs in this process")
    p.add_argument("--triton", choices=("auto", "on", "off"), default="auto",
                   help="time the Triton paged decode kernel (auto: where it runs, i.e. on CUDA with triton)")
    p.add_argument("--cpu-kernel", choices=("auto", "on", "off"), default="auto",
                   help="time the CPU paged decode kernel (auto: where it runs, i.e. on CPU with a C compiler)")
    p.add_argument("--mixed-chunk", type=int, default=0, metavar="C",
                   help="time mixed steps instead: the decode rows plus one new prompt's chunk of C tokens, on gather "
                        "+ SDPA and with the decode rows on the paged decode kernel")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    CLOCK["name"] = args.clock if args.clock != "auto" else (
        "cpu" if device.type == "cpu" and torch.get_num_threads() == 1 else "wall")
    if args.plan_groups:
        plan_groups(args)
        return
    if args.heads is None:
        args.heads = 16 if args.mla else 8  # with --mla: DeepSeek-V2-Lite's, as the other --mla defaults
    if args.mla and args.mla_prefill:
        mla_prefill(args, device)
        return
    if args.mla:
        mla_table(args, device)
        return
    args.kernels = paged_decode_kernels(args, device)  # only the GQA table times them
    if args.mixed_chunk:
        mixed_table(args, device)
        return
    print(f"clock={CLOCK['name']} device={device} dtype={args.dtype} heads={args.heads} kv_heads={args.kv_heads} "
          f"head_dim={args.head_dim} "
          f"block={args.block} reps={args.reps} ragged={args.ragged} threads={torch.get_num_threads()} "
          f"torch={torch.__version__}")
    print("times in us (medians); x = contiguous / path (>= 1: the path is as fast as SDPA over a contiguous "
          "cache), plan included on the paged paths")
    print(f"{'batch':>5} {'len':>6} {'contig':>8} {'gather':>8} {'plan_old':>8} {'plan':>6} {'gather_x':>8} "
          f"{'flex':>8} {'plan_flex':>9} {'flex_x':>6} {'triton':>8} {'tri_step':>8} {'triton_x':>8} "
          f"{'cpu':>8} {'cpu_step':>8} {'cpu_x':>6}")
    for b in (int(x) for x in args.batch.split(",")):
        for n in (int(x) for x in args.lengths.split(",")):
            r = bench_point(b, n, args, device)
            line = (f"{b:>5} {n:>6} {r['contiguous']:>8.1f} {r['paged']:>8.1f} {r['plan_lists']:>8.1f} "
                    f"{r['plan']:>6.1f} "
                    f"{r['contiguous'] / (r['paged'] + r['plan']):>8.2f}")
            if "flex" in r:
                line += (f" {r['flex']:>8.1f} {r['plan_flex']:>9.1f} "
                         f"{r['contiguous'] / (r['flex'] + r['plan_flex']):>6.2f}")
            elif args.kernels:
                line += f" {'-':>8} {'-':>9} {'-':>6}"
            # triton_x / cpu_x: the kernel's whole step (tables, uploads, write, kernel) against contiguous
            if "triton" in r:
                line += f" {r['triton']:>8.1f} {r['triton_step']:>8.1f} {r['contiguous'] / r['triton_step']:>8.2f}"
            elif "cpu" in r:
                line += f" {'-':>8} {'-':>8} {'-':>8}"
            if "cpu" in r:
                line += f" {r['cpu']:>8.1f} {r['cpu_step']:>8.1f} {r['contiguous'] / r['cpu_step']:>6.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
