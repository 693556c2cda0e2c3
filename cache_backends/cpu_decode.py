"""A paged decode kernel for CPUs (C, compiled once per machine): each sequence's new query attends over its pages
in place.

Gather + SDPA copies every visible key of a layer before attending, so on a CPU a paged decode step read its keys
three times where SDPA over a contiguous cache reads them once (BENCHMARKS.md: 0.17-0.70x contiguous). This is
the kernel vLLM's CPU backend and llama.cpp use instead: per (sequence, KV head) it walks the block table, reads
each page's K and V rows where they lie, scores the whole GQA group of query heads against each K row while it is
in cache, and keeps an online softmax (``csrc/paged_decode.c``). Work items run in parallel on torch's intra-op
threads (OpenMP; torch's own runtime when torch loaded it first).

What it serves: decode-only steps (one new token per sequence) of full and sliding-window layers on CPU pools of
every kvload dtype (half and float8 pools widened row by row), logit softcapping. Prefill chunks, MLA and
compressed layers stay on gather + SDPA, as with the Triton kernel (``cache_backends.paged_decode``), whose call
signature this one shares.

Built with the machine's C compiler (``$CC``, else ``cc`` or ``gcc``; ``-O3 -march=native -ffast-math
-fopenmp``, falling back to fewer flags where those are refused) into a cache directory the caller names, under a
key of the source, the compiler, the flags and the CPU, so a rebuild happens only when one of them changes. Where
no compiler works, :func:`load_cpu_kernel` raises :class:`KernelUnavailable` with the reason.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
#: what the C side takes (``MAX_GROUP``, ``MAX_DIM`` in the source)
MAX_GROUP, MAX_DIM = 64, 512
#: compiler flags, best first: a flag set the compiler refuses is dropped for the next one
FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-ffast-math", "-fopenmp"),
    ("-O3", "-ffast-math", "-fopenmp"),
    ("-O3", "-ffast-math", "-Wno-unknown-pragmas"),
)
#: pool dtype -> the kernel's ``kind`` (0 float32, 1 bfloat16, 2 float16, 3 one byte through a table of values)
KINDS: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2,
                                 torch.float8_e4m3fn: 3, torch.float8_e5m2: 3}
COMPILE_TIMEOUT_S = 300


class KernelUnavailable(RuntimeError):
    """The CPU kernel cannot be built or loaded here; the message says why."""


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


def compiler() -> str | None:
    """The C compiler to build with: ``$CC``, else ``cc`` or ``gcc`` on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags (Linux), else the platform's name."""
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = [line for line in info.splitlines() if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return f"{platform.machine()} " + "\n".join(dict.fromkeys(wanted))


def _build(cache_dir: Path) -> Path:
    """The compiled library under ``cache_dir``, compiling it when this source/compiler/CPU has none yet."""
    cc = compiler()
    if cc is None:
        raise KernelUnavailable("no C compiler to build the CPU paged decode kernel with (set $CC, or install gcc)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"the C compiler {cc} did not run: {exc}") from None
    source = SOURCE.read_bytes()
    errors = []
    for flags in FLAG_SETS:
        key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(flags).encode(),
                                         _cpu_identity().encode()])).hexdigest()[:16]
        target = cache_dir / f"paged_decode-{key}.so"
        if target.exists():
            return target
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise KernelUnavailable(f"the kernel cache {cache_dir} cannot be created: {exc.strerror}") from None
        tmp = cache_dir / f".paged_decode-{key}.{os.getpid()}.so"  # renamed when complete: never half a library
        try:
            proc = subprocess.run([cc, *flags, "-fPIC", "-shared", "-o", str(tmp), str(SOURCE), "-lm"],
                                  capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
            if proc.returncode == 0:
                os.replace(tmp, target)
                return target
            errors.append((proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[0])
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(str(exc))
        finally:
            tmp.unlink(missing_ok=True)
    raise KernelUnavailable(f"compiling the CPU paged decode kernel with {cc} failed: {errors[-1]}")


@functools.cache
def load_cpu_kernel(cache_dir: Path) -> CpuDecodeKernel:
    """The kernel built under ``cache_dir`` (compiled there on first use; once per process after that)."""
    path = _build(Path(cache_dir))
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelUnavailable(f"the CPU paged decode kernel {path} did not load: {exc}") from None
    return CpuDecodeKernel(lib, path)


class CpuDecodeKernel:
    """The loaded kernel; called like ``cache_backends.paged_decode.paged_decode``."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        fn = lib.kvload_paged_decode
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        fn.argtypes = [p, i64, i64, p, p, i64, i64, p, i32, i32, i32, i32, i32, i64, i64, i64, i64, f32, f32, i32, p,
                       p, i32]
        fn.restype = i32
        self._fn = fn
        self._luts: dict[torch.dtype, torch.Tensor] = {}

    def _lut(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Every value of a one-byte dtype as float32, indexed by its bits (how the kernel widens float8)."""
        if dtype.itemsize != 1:
            return None
        if dtype not in self._luts:
            self._luts[dtype] = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32)
        return self._luts[dtype]

    def __call__(self, query: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 kv_heads: int, tokens_per_block: int, scale: float, window: int | None = None,
                 softcap: float | None = None, max_pages: int | None = None, scratch: Any = None) -> torch.Tensor:
        """Attention of one new query per sequence over its pages: ``(B, heads, d)`` out, like ``query``.

        ``slots``: the layer's ``(num_blocks * T, entry_elems)`` pool view (rows ``(2, kv_heads, d)``);
        ``tables``: ``(B, width)`` physical block per logical block (-1 past the end); ``lens``: ``(B,)`` keys per
        sequence including the new token's (already written); ``window``: keys ``[len - window, len)``.
        ``max_pages`` and ``scratch`` are the Triton kernel's (split sizing, partials) and unused here.
        """
        B, H, D = query.shape
        if H % kv_heads:
            raise ValueError(f"{H} query heads are not a multiple of {kv_heads} KV heads")
        if slots.device.type != "cpu" or slots.dim() != 2 or slots.stride(1) != 1:
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
        lut = self._lut(slots.dtype)
        out = torch.empty(B, H, D, dtype=torch.float32)
        T = tokens_per_block
        rc = self._fn(q.data_ptr(), q.stride(0), q.stride(1), slots.data_ptr(), tables.data_ptr(), tables.stride(0),
                      tables.shape[1], lens.data_ptr(), B, H, kv_heads, D, T, slots.stride(0), kv_heads * D,
                      slots.shape[0] // T, window or 0, scale, softcap or 0.0, kind,
                      lut.data_ptr() if lut is not None else None, out.data_ptr(), torch.get_num_threads())
        if rc == -1:
            raise ValueError(f"the CPU kernel does not take {H} heads over {kv_heads} KV heads of {D}")
        if rc == -2:
            raise IndexError("a sequence's visible position maps to no block of the pool (a block table shorter than "
                             "its length, or a released page inside its window)")
        return out if query.dtype == torch.float32 else out.to(query.dtype)
