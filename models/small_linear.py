"""Decode-step projections on a C kernel for CPUs: ``y = x W^T + b`` for a few rows of ``x``.

A decode step multiplies every weight matrix of the model by one row per running sequence. BLAS libraries are tuned
for many rows; at 4-12 rows MKL reads a weight matrix far slower than it can be streamed: SmolLM2-135M's
projections and LM head take 1.6-2x the kernel's time there, one thread (BENCHMARKS.md, "Small-batch projections
on CPU"). ``csrc/small_linear.c`` reads each weight row once, into registers, and
multiplies it with every row of ``x`` there; weight rows are split over torch's intra-op threads.

:class:`LinearRoute` installs it on a loaded model: each plain float32 ``nn.Linear`` becomes a
:class:`RoutedLinear` (a subclass; parameters, hooks and ``state_dict`` unchanged) that takes the kernel only while
the route is active on the calling thread and the call has a row count the kernel is measured to win at
(:data:`ROWS`). kvload's executor activates it around its own forward; anything else that runs the same model —
``model.generate`` in a comparison, a user's own call — runs torch's ``F.linear`` as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cache_backends.cpu_kernel_build import KernelUnavailable, load_library

__all__ = ["ROWS", "KernelUnavailable", "LinearRoute", "RoutedLinear", "SmallLinearKernel", "load_small_linear",
           "small_linear_unsupported"]

SOURCE = Path(__file__).with_name("csrc") / "small_linear.c"
WHAT = "the CPU small-batch linear kernel"
#: the build's vector unit -> the row counts (inclusive) at which the kernel beat torch's F.linear on SmolLM2-135M's
#: shapes, one thread (BENCHMARKS.md, "Small-batch projections on CPU"); a build without AVX2 + FMA won at none
ROWS: dict[int, tuple[int, int]] = {512: (1, 32), 256: (4, 12)}
ISA_NAMES = {512: "AVX-512", 256: "AVX2 + FMA", 0: "no AVX2"}

F32 = torch.float32
_active = threading.local()  # .route: the LinearRoute active on this thread, if any


def small_linear_unsupported(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot serve a model on ``device`` in ``dtype`` (before building it), or None when it can."""
    dev = torch.device(device)
    if dev.type != "cpu":
        return f"the CPU small-batch linear kernel multiplies in host memory; the model is on {dev.type}"
    if dtype != torch.float32:
        return f"the CPU small-batch linear kernel multiplies float32 weights; the model is {str(dtype).split('.')[-1]}"
    return None


@functools.cache
def load_small_linear(cache_dir: Path) -> SmallLinearKernel:
    """The kernel built under ``cache_dir`` (compiled there on first use; once per process after that)."""
    lib, path = load_library(Path(cache_dir), SOURCE, WHAT)
    return SmallLinearKernel(lib, path)


class SmallLinearKernel:
    """The loaded kernel: ``kernel(x, weight, bias)`` is ``F.linear`` for 2-D float32 ``x`` of a few rows."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        fn = lib.kvload_small_linear
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
        fn.restype = ctypes.c_int
        self._fn = fn
        isa = lib.kvload_small_linear_isa
        isa.restype = ctypes.c_int
        #: the vector unit the build uses (512, 256 or 0) and the row counts it takes (None: none)
        self.isa: int = int(isa())
        self.rows: tuple[int, int] | None = ROWS.get(self.isa)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias`` for ``x`` of shape ``(M, K)``; all float32, contiguous, in host memory."""
        M, K = x.shape
        N = weight.shape[0]
        for name, t in (("x", x), ("weight", weight), ("bias", bias)):
            if t is not None and (t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous()):
                raise ValueError(f"{WHAT}: {name} must be a contiguous float32 CPU tensor, got {t.dtype} on "
                                 f"{t.device}")
        if weight.shape[1] != K or (bias is not None and bias.shape != (N,)):
            raise ValueError(f"{WHAT}: x {tuple(x.shape)}, weight {tuple(weight.shape)}, bias "
                             f"{None if bias is None else tuple(bias.shape)} do not fit")
        return self.run(x, weight, bias, M)

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
        """The call itself, unchecked: ``x`` contiguous float32 of ``rows`` rows (any leading shape), ``weight`` and
        ``bias`` as ``__call__`` requires; the output has ``x``'s leading shape."""
        K, N = x.shape[-1], weight.shape[0]
        y = torch.empty((*x.shape[:-1], N), dtype=F32)
        self._fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                 rows, N, K, torch.get_num_threads())
        return y


class RoutedLinear(nn.Linear):
    """An ``nn.Linear`` whose calls take the small-batch kernel while a :class:`LinearRoute` is active here."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``F.linear``, on the kernel for the row counts it serves while a route is active on this thread."""
        route = getattr(_active, "route", None)
        if route is not None:
            y = route.linear(input, self.weight, self.bias)
            if y is not None:
                return y
        return F.linear(input, self.weight, self.bias)


def _plain(t: torch.Tensor | None) -> bool:
    """A float32 host tensor whose storage is its own (not a DTensor shard or another subclass), contiguous."""
    if t is None:
        return True
    data = t.data if isinstance(t, nn.Parameter) else t
    return type(data) is torch.Tensor and data.dtype == torch.float32 and data.is_cpu and data.is_contiguous()


class LinearRoute:
    """The small-batch kernel installed on a model's plain float32 ``nn.Linear`` layers; :meth:`active` turns it
    on for the calling thread."""

    def __init__(self, kernel: SmallLinearKernel, model: nn.Module) -> None:
        if kernel.rows is None:
            raise KernelUnavailable(f"{WHAT} was built for {ISA_NAMES.get(kernel.isa, kernel.isa)}, where it is "
                                    "slower than torch's matmul at every row count measured")
        self.kernel = kernel
        self.rows: tuple[int, int] = kernel.rows
        #: kernel calls so far (a test's witness that the route ran, and where)
        self.calls = 0
        self.layers: list[nn.Linear] = []
        for module in model.modules():
            # RoutedLinear too: another executor over the same model installed it already
            if type(module) in (nn.Linear, RoutedLinear) and _plain(module.weight) and _plain(module.bias):
                module.__class__ = RoutedLinear
                self.layers.append(module)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``F.linear(x, weight, bias)`` on the kernel, or None where it does not serve the call (the caller then
        runs ``F.linear``): rows outside :attr:`rows`, or anything not float32 in host memory. The weight is checked
        on every call, not only at install: a model moved or cast later must not be read as float32 here."""
        K = x.shape[-1]
        rows = x.numel() // K if K else 0
        lo, hi = self.rows
        if not lo <= rows <= hi or x.dtype != F32 or weight.dtype != F32 or x.requires_grad:
            return None
        if torch.is_autocast_enabled("cpu"):  # F.linear would multiply in the autocast dtype there
            return None
        if not (x.is_cpu and weight.is_cpu and weight.is_contiguous()) or weight.shape[1] != K:
            return None  # (a mismatched width: F.linear raises torch's error; the kernel would read past W)
        N = weight.shape[0]
        if bias is not None and (bias.dtype != F32 or not bias.is_cpu or not bias.is_contiguous()
                                 or bias.shape != (N,)):
            return None
        if not x.is_contiguous():  # (a reshape of a contiguous x would cost ~2 us a call for nothing)
            x = x.contiguous()
        self.calls += 1
        return self.kernel.run(x, weight, bias, rows)

    @contextlib.contextmanager
    def active(self) -> Iterator[LinearRoute]:
        """Within the block, this thread's calls of the routed layers take the kernel where it serves them."""
        previous = getattr(_active, "route", None)
        _active.route = self
        try:
            yield self
        finally:
            _active.route = previous

