"""The CPU small-batch linear kernel (``linear_backend: cpu_kernel``): equal to ``F.linear``, taken only by kvload's
own forward at the row counts it serves, and refused with its reason where it cannot run."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import pipeline
from cache_backends import cpu_kernel_build
from models.small_linear import (
    ROWS,
    SOURCE,
    KernelUnavailable,
    LinearRoute,
    RoutedLinear,
    load_small_linear,
    small_linear_unsupported,
)
from stages.resolve_auto import resolve_linear_backend
from tests.generate_support import hf_greedy, load, prompts_for

BUDGET = {"max_tokens": 512}
needs_cc = pytest.mark.skipif(cpu_kernel_build.compiler() is None, reason="no C compiler to build the CPU kernel with")


@pytest.fixture
def kernel(kernel_cache):
    return load_small_linear(kernel_cache / "kernels")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


@needs_cc
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 20), out=st.integers(1, 70), inner=st.integers(1, 300), bias=st.booleans(),
       threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_the_kernel_equals_f_linear(kernel, rows, out, inner, bias, threads, seed):
    # every block shape (1, 2 and 4 rows; 1-3 rows left over), weight rows past a whole block, K past whole vectors
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, inner, generator=gen), torch.randn(out, inner, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel(x, w, b)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5 * inner ** 0.5)


@needs_cc
def test_no_rows_give_an_empty_result(kernel):
    assert kernel(torch.empty(0, 8), torch.randn(4, 8)).shape == (0, 4)  # (the C side returns before dividing by M)


@needs_cc
def test_the_build_uses_the_vector_unit_this_cpu_has(kernel):
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo to read the CPU's features from")
    want = 512 if "avx512f" in flags else 256 if {"avx2", "fma"} <= flags else 0
    assert kernel.isa == want  # -march=native reached the source: the row table below is the one measured for it
    assert kernel.rows == ROWS.get(want)


@needs_cc
def test_bad_operands_are_refused_before_the_kernel_reads_them(kernel):
    with pytest.raises(ValueError, match="weight must be a contiguous float32 CPU tensor"):
        kernel(torch.randn(2, 8), torch.randn(8, 4).t())
    with pytest.raises(ValueError, match=r"x \(2, 8\), weight \(4, 6\), bias None do not fit"):
        kernel(torch.randn(2, 8), torch.randn(4, 6))


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(24, 40)
        self.down = nn.Linear(40, 24, bias=False)
        self.bf16 = nn.Linear(24, 24).to(torch.bfloat16)  # not float32: left alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@pytest.fixture
def routed(kernel):
    """A fresh TwoLayers with the kernel installed: (model, route); skipped where this build serves no row count."""
    if kernel.rows is None:
        pytest.skip("this CPU's build serves no row count")
    model = TwoLayers()
    return model, LinearRoute(kernel, model)


@needs_cc
def test_the_route_runs_only_while_active_on_this_thread_and_only_at_its_row_counts(routed):
    model, route = routed
    assert type(model.up) is RoutedLinear and type(model.down) is RoutedLinear and type(model.bf16) is nn.Linear
    assert set(model.state_dict()) == {"up.weight", "up.bias", "down.weight", "bf16.weight", "bf16.bias"}
    lo, hi = route.rows
    x = torch.randn(1, lo, 24)
    ref = model(x)
    assert route.calls == 0  # not active: torch's F.linear
    with torch.inference_mode(), route.active():
        got = model(x)
        assert route.calls == 2
        model(torch.randn(hi + 1, 24))  # more rows than the kernel serves: torch
        assert route.calls == 2
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert got.shape == (1, lo, 24)
    model(x)
    assert route.calls == 2  # off again after the block


@needs_cc
def test_a_model_cast_or_a_strided_input_after_install_is_never_read_as_float32(routed):
    model, route = routed
    lo, _ = route.rows  # the fewest rows this CPU's build serves (AVX-512: 1, AVX2: 4)
    x = torch.randn(24, lo).t().unsqueeze(0)  # (1, lo, 24), not contiguous
    with torch.inference_mode():
        ref = model(x)  # route not active: F.linear
        with route.active():
            torch.testing.assert_close(model(x), ref)
            assert route.calls == 2  # strided rows are copied, then taken
            model.to(torch.bfloat16)  # the weights are no longer float32: torch again, never the kernel
            xb = x.to(torch.bfloat16)
            got = model(xb)
            assert route.calls == 2 and got.dtype == torch.bfloat16
            torch.testing.assert_close(got, F.linear(torch.relu(F.linear(xb, model.up.weight, model.up.bias)),
                                                     model.down.weight))


@needs_cc
def test_an_input_of_the_wrong_width_gets_torchs_error_not_a_read_past_the_weight(routed):
    model, route = routed
    with torch.inference_mode(), route.active(), pytest.raises(RuntimeError, match="cannot be multiplied"):
        model.up(torch.randn(1, 4096))  # 4096 wide where the layer takes 24
    assert route.calls == 0


@needs_cc
def test_under_cpu_autocast_the_layers_multiply_as_torch_would(routed):
    model, route = routed
    with torch.inference_mode(), route.active(), torch.autocast("cpu", dtype=torch.bfloat16):
        # rows the kernel serves outside autocast; autocast's dtype, as F.linear gives
        assert model.up(torch.randn(route.rows[0], 24)).dtype == torch.bfloat16
    assert route.calls == 0


@needs_cc
@pytest.mark.parametrize(("family", "manager"), [("llama", "v1"), ("qwen3", "v2"), ("gemma3", "v2")])
def test_generate_on_the_kernel_equals_transformers_which_never_takes_it(tiny_checkpoints, kernel_cache, family,
                                                                         manager):
    with load(tiny_checkpoints(family), manager, tokens_per_block=16, max_tokens=1024) as result:
        assert result.args.linear_backend == "cpu_kernel"  # "auto" on CPU in float32
        route = result.executor.linear
        if route is None:
            pytest.skip("this CPU's build serves no row count")
        ps = prompts_for(result.hf_model.config.vocab_size, lengths=(5, 19, 40))
        outs = result.generate(ps, max_new_tokens=6)
        used = route.calls
        assert used > 0  # decode steps (3 rows) multiplied on the kernel
        assert [o.token_ids for o in outs] == [hf_greedy(result.hf_model, p, 6) for p in ps]
        assert route.calls == used  # model.generate on the same model: torch's F.linear throughout
        assert not [e for e in result.audit.of("setting_ignored") if e["field"] == "linear_backend"]


def test_linear_backend_torch_leaves_the_model_alone(tiny_checkpoints):
    with pipeline.load(str(tiny_checkpoints("llama")), load_weights=True, kv_cache_config=BUDGET,
                       linear_backend="torch", log=False) as result:
        assert result.executor.linear is None
        assert not any(type(m) is RoutedLinear for m in result.hf_model.modules())
        assert len(result.generate([[5, 6, 7]], max_new_tokens=2)[0].token_ids) == 2


def test_a_bfloat16_model_says_the_kernel_is_ignored(tiny_checkpoints):
    with pipeline.load(str(tiny_checkpoints("llama")), load_weights=True, kv_cache_config=BUDGET, dtype="bfloat16",
                       linear_backend="cpu_kernel", log=False) as result:
        assert result.executor.linear is None
        (ignored,) = [e for e in result.audit.of("setting_ignored") if e["field"] == "linear_backend"]
        assert ignored["value"] == "cpu_kernel"
        assert ignored["reason"] == ("the CPU small-batch linear kernel multiplies float32 weights; the model is "
                                     "bfloat16; generate multiplies through torch's F.linear")


def test_without_a_compiler_generate_says_so_and_multiplies_through_torch(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLOAD_CACHE", str(tmp_path))  # nothing built here yet
    monkeypatch.setattr(cpu_kernel_build, "compiler", lambda: None)
    with pipeline.load(str(tiny_checkpoints("llama")), load_weights=True, kv_cache_config=BUDGET,
                       linear_backend="cpu_kernel", attention_backend="sdpa", log=False) as result:
        assert result.executor.linear is None
        (ignored,) = [e for e in result.audit.of("setting_ignored") if e["field"] == "linear_backend"]
        assert ignored["reason"] == ("no C compiler to build the CPU small-batch linear kernel with (set $CC, or "
                                     "install gcc); generate multiplies through torch's F.linear")


def test_a_build_without_wide_vectors_is_refused_with_its_reason(kernel):
    class Plain:
        isa, rows = 0, None

    with pytest.raises(KernelUnavailable, match="built for no AVX2, where it is slower than torch's matmul"):
        LinearRoute(Plain(), TwoLayers())  # type: ignore[arg-type]


@pytest.mark.parametrize(("device", "dtype", "want", "says"), [
    ("cuda", "bfloat16", "torch", "on CUDA the projections run on cuBLAS"),
    ("cpu", "bfloat16", "torch", "multiplies float32 weights; the model is bfloat16"),
    ("cpu", "float32", "cpu_kernel", "reads each weight once for all rows"),
    ("cpu", "float32@2", "torch", "tensor_parallel_size=2: the weights are sharded as DTensors"),
])
def test_auto_resolves_by_device_dtype_and_tensor_parallel(device, dtype, want, says, monkeypatch):
    monkeypatch.setattr(cpu_kernel_build, "compiler", lambda: "/usr/bin/cc")
    dtype, _, tp = dtype.partition("@")
    value, source, reason = resolve_linear_backend(device, dtype, int(tp or 1))
    assert (value, source) == (want, "auto") and says in reason


@pytest.mark.parametrize(("args", "says"), [
    (("cuda", torch.float32), "the model is on cuda"),
    (("cpu", torch.float16), "multiplies float32 weights; the model is float16"),
])
def test_what_the_kernel_cannot_serve_is_named(args, says):
    assert says in small_linear_unsupported(*args)
    assert small_linear_unsupported("cpu", torch.float32) is None


@needs_cc
def test_two_threads_building_at_once_both_get_the_native_build(tmp_path, monkeypatch):
    # two loads in one process (two LoadResults, a server with two models) build into the same empty cache at once:
    # each must get this CPU's build, never a fallback left when the other thread's temporary files vanished
    real = cpu_kernel_build.compiler()
    cc = tmp_path / "cc"  # slow enough that the two builds overlap
    cc.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] || sleep 0.5\nexec {real} \"$@\"\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    cache = tmp_path / "kernels"
    got: list[object] = []

    def build() -> None:
        try:
            got.append(cpu_kernel_build.build_kernel(cache, SOURCE, "the kernel"))
        except KernelUnavailable as exc:
            got.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 2 and got[0] == got[1], got
    assert [p.name for p in cache.iterdir()] == [got[0].name]  # one library, nothing half-built beside it
