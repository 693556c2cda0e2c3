"""A paged decode kernel for CPUs (C, compiled once per machine): each sequence's new query attends over its pages
in place.

Gather + SDPA copies every visible key of a layer before attending, so on a CPU a paged decode step read its keys
three times where SDPA over a contiguous cache reads them once (BENCHMARKS.md: 0.17-0.70x contiguous). This is
the kind of kernel vLLM's CPU backend uses instead: per (sequence, KV head) it walks the block table, reads
each page's K and V rows where they lie, scores the whole GQA group of query heads against each K row while it is
in cache, and keeps an online softmax (``csrc/paged_decode.c``). Work items run in parallel on torch's intra-op
threads (OpenMP; torch's own runtime when torch loaded it first).

What it serves: decode-only steps (one new token per sequence) of full and sliding-window layers on CPU pools of
every kvload dtype (half and float8 pools widened row by row), logit softcapping. Prefill chunks, MLA and
compressed layers stay on gather + SDPA, as with the Triton kernel (``cache_backends.paged_decode``), whose call
signature this one shares.

Built with the machine's C compiler (``$CC``, else ``cc`` or ``gcc``; ``-O3 -march=native -ffast-math
-fopenmp``, falling back to fewer flags where those are refused) into a cache directory the caller names, once per
source, compiler and CPU (``cache_backends.cpu_kernel_build``). Where no compiler works, :func:`load_cpu_kernel`
raises :class:`KernelUnavailable` with the reason.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path
from typing import Any

import torch

from cache_backends.cpu_kernel_build import KernelUnavailable, load_library

__all__ = ["CpuDecodeKernel", "KernelUnavailable", "cpu_decode_unsupported", "load_cpu_kernel"]

#: what the C side takes (``MAX_GROUP``, ``MAX_DIM`` in the source)
MAX_GROUP, MAX_DIM = 64, 512
#: pool dtype -> the kernel's ``kind`` (0 float32, 1 bfloat16, 2 float16, 3 one byte through a table of values)
KINDS: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2,
                                 torch.float8_e4m3fn: 3, torch.float8_e5m2: 3}


def cpu_decode_unsupported(device: torch.device | str, head_dim: int, heads_per_kv_head: int,
                           dtype: torch.dtype) -> str | None:
    """Why the kernel cannot serve these pools (before building it), or None when it can."""
    dev = torch.device(device)
    if dev.type != "cpu":
        return (f"the CPU paged decode kernel reads host memory; the pools are on {dev.type} "
                "(attention_backend: triton is the kernel for CUDA)")
    if not 1 <= head_dim <= MAX_DIM:
        return f"the CPU paged decode kernel takes head_dim up to {MAX_DIM}, got {head_dim}"
    if heads_per_kv_head > MAX_GROUP:
        return f"the CPU paged decode kernel takes up to {MAX_GROUP} query heads per KV head, got {heads_per_kv_head}"
    if dtype not in KINDS:
        return f"the CPU paged decode kernel does not read {dtype} pools"
    return None


class _DecodeArgs(ctypes.Structure):
    """The kernel's arguments in one record: ``decode_args`` in ``csrc/paged_decode.c``, field for field."""

    _fields_ = [("q", ctypes.c_void_p), ("q_sb", ctypes.c_int64), ("q_sh", ctypes.c_int64), ("kv", ctypes.c_void_p),
                ("tables", ctypes.c_void_p), ("table_stride", ctypes.c_int64), ("table_width", ctypes.c_int64),
                ("lens", ctypes.c_void_p),
                *[(name, ctypes.c_int64) for name in ("B", "H", "Hkv", "D", "T", "row_stride", "v_offset",
                                                      "num_blocks", "window")],
                ("scale", ctypes.c_double), ("softcap", ctypes.c_double), ("kind", ctypes.c_int64),
                ("lut", ctypes.c_void_p), ("out", ctypes.c_void_p), ("nthreads", ctypes.c_int64),
                ("k_new", ctypes.c_void_p), ("v_new", ctypes.c_void_p),
                *[(name, ctypes.c_int64) for name in ("kn_sb", "kn_sh", "vn_sb", "vn_sh")]]


@functools.cache
def load_cpu_kernel(cache_dir: Path) -> CpuDecodeKernel:
    """The kernel built under ``cache_dir`` (compiled there on first use; once per process after that)."""
    lib, path = load_library(Path(cache_dir))
    return CpuDecodeKernel(lib, path)


class CpuDecodeKernel:
    """The loaded kernel; called like ``cache_backends.paged_decode.paged_decode``."""

    #: it can store the step's new K/V itself (``new_kv``), in the same call (``PagedBatch.attend_decode``)
    writes_new_kv = True

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        fn = lib.kvload_paged_decode
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._luts: dict[torch.dtype, torch.Tensor | None] = {}
        self._local = threading.local()  # one argument record per calling thread (filled, then passed by address)

    def _lut(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Every value of a one-byte dtype as float32, indexed by its bits (how the kernel widens float8)."""
        if dtype in self._luts:
            return self._luts[dtype]
        lut = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32) if dtype.itemsize == 1 else None
        self._luts[dtype] = lut
        return lut

    def __call__(self, query: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 kv_heads: int, tokens_per_block: int, scale: float, window: int | None = None,
                 softcap: float | None = None, max_pages: int | None = None, scratch: Any = None,
                 new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Attention of one new query per sequence over its pages: ``(B, heads, d)`` out, like ``query``.

        ``slots``: the layer's ``(num_blocks * T, entry_elems)`` pool view (rows ``(2, kv_heads, d)``);
        ``tables``: ``(B, width)`` physical block per logical block (-1 past the end); ``lens``: ``(B,)`` keys per
        sequence including the new token's (already written, or stored from ``new_kv``); ``window``: keys
        ``[len - window, len)``.
        ``max_pages`` and ``scratch`` are the Triton kernel's (split sizing, partials) and unused here.
        ``new_kv``: the step's new K and V, ``(B, kv_heads, d)`` each in the pool's dtype, stored at each sequence's
        last position (``lens - 1``) before attending — the layer's K/V write folded into this call.
        """
        B, H, D = query.shape
        if H % kv_heads:
            raise ValueError(f"{H} query heads are not a multiple of {kv_heads} KV heads")
        if not slots.is_cpu or slots.dim() != 2 or slots.stride(1) != 1:
            raise ValueError("the CPU kernel reads a (slots, entry) pool view in host memory, rows contiguous")
        if slots.shape[1] < 2 * kv_heads * D:
            raise ValueError(f"pool rows of {slots.shape[1]} elements cannot hold K and V of {kv_heads} heads x {D}")
        kind = KINDS.get(slots.dtype)
        if kind is None:
            raise ValueError(f"the CPU kernel does not read {slots.dtype} pools")
        q = query if query.dtype == torch.float32 and query.stride(2) == 1 else query.to(torch.float32).contiguous()
        if tables.dtype != torch.int64 or tables.stride(1) != 1:
            tables = tables.to(torch.int64).contiguous()
        lens = lens if lens.dtype == torch.int64 and lens.is_contiguous() else lens.to(torch.int64).contiguous()
        if tables.shape[0] != B or lens.shape[0] != B:
            raise ValueError(f"{B} queries, {tables.shape[0]} table rows, {lens.shape[0]} lengths")
        if new_kv is not None:
            k_new, v_new = new_kv
            for t in new_kv:
                if t.dtype != slots.dtype or t.shape != (B, kv_heads, D) or t.stride(2) != 1:
                    raise ValueError(f"new K/V of {t.dtype} {tuple(t.shape)}: the kernel stores ({B}, {kv_heads}, {D}) "
                                     f"rows of the pool's {slots.dtype}, elements contiguous")
        lut = self._lut(slots.dtype)
        out = torch.empty(B, H, D, dtype=torch.float32)
        args = getattr(self._local, "args", None)
        if args is None:
            args = self._local.args = _DecodeArgs()
        args.q, (args.q_sb, args.q_sh) = q.data_ptr(), q.stride()[:2]
        args.kv, args.tables, args.table_stride, args.table_width = (slots.data_ptr(), tables.data_ptr(),
                                                                     tables.stride(0), tables.shape[1])
        T = tokens_per_block
        args.lens, args.B, args.H, args.Hkv, args.D, args.T = lens.data_ptr(), B, H, kv_heads, D, T
        args.row_stride, args.v_offset, args.num_blocks = slots.stride(0), kv_heads * D, slots.shape[0] // T
        args.window, args.scale, args.softcap, args.kind = window or 0, scale, softcap or 0.0, kind
        args.lut = lut.data_ptr() if lut is not None else None
        args.out, args.nthreads = out.data_ptr(), torch.get_num_threads()
        if new_kv is None:
            args.k_new = args.v_new = None
        else:
            args.k_new, args.v_new = k_new.data_ptr(), v_new.data_ptr()
            (args.kn_sb, args.kn_sh), (args.vn_sb, args.vn_sh) = k_new.stride()[:2], v_new.stride()[:2]
        rc = self._fn(ctypes.addressof(args))
        if rc == -1:
            raise ValueError(f"the CPU kernel does not take {H} heads over {kv_heads} KV heads of {D}")
        if rc == -2:
            raise IndexError("a sequence's visible position maps to no block of the pool (a block table shorter than "
                             "its length, or a released page inside its window)")
        return out if query.dtype == torch.float32 else out.to(query.dtype)
