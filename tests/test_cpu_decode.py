"""The CPU paged decode kernel (``attention_backend: cpu_kernel``): equal to gather + SDPA, built once, refused
with its reason where it cannot run, and never reading outside the pool."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_backends import cpu_decode, cpu_kernel_build
from cache_backends.cpu_decode import KernelUnavailable, cpu_decode_unsupported, load_cpu_kernel
from tests.decode_kernel_support import decode_step
from tests.generate_support import hf_greedy, load, prompts_for

needs_cc = pytest.mark.skipif(cpu_kernel_build.compiler() is None, reason="no C compiler to build the CPU kernel with")


@pytest.fixture
def kernel(kernel_cache):
    return load_cpu_kernel(kernel_cache / "kernels")


@needs_cc
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 150), min_size=1, max_size=4),
    group=st.sampled_from([1, 2, 4, 8]),
    tokens_per_block=st.sampled_from([1, 7, 16, 32, 128]),
    window=st.one_of(st.none(), st.integers(1, 70)),
    dtype=st.sampled_from(["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"]),
    softcap=st.one_of(st.none(), st.just(20.0)),
    head_dim=st.sampled_from([16, 24, 64, 128, 256]),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_equals_gather_and_sdpa(kernel, lengths, group, tokens_per_block, window, dtype, softcap,
                                           head_dim, seed):
    # 64/128/256 run the kernel's compiled-in head sizes, 16 and 24 its general loop; 128-token pages are read in
    # spans of 64 tokens (two softmax updates a page), 1- and 7-token pages one short span at a time
    got, ref = decode_step(kernel, lengths, 2 * group, tokens_per_block, window, dtype, softcap, seed,
                           head_dim=head_dim)
    assert got.dtype == ref.dtype
    # the kernel accumulates in float32 whatever the pool; the reference attends in the activations' dtype
    tol = {"float16": 4e-3, "bfloat16": 3e-2}.get(dtype, 2e-5)
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@needs_cc
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(st.tuples(st.integers(1, 150), st.integers(1, 40)), min_size=2, max_size=5),
    tokens_per_block=st.sampled_from([1, 7, 16]),
    window=st.one_of(st.none(), st.integers(1, 70)),
    dtype=st.sampled_from(["float32", "bfloat16", "float8_e4m3fn"]),
    seed=st.integers(0, 2**16),
)
def test_a_mixed_step_attends_its_decode_rows_on_the_kernel_and_equals_gather(kernel, rows, tokens_per_block,
                                                                              window, dtype, seed):
    # a step where new prompts' chunks join running requests: the decode rows (one new token) read their pages in
    # place, the chunks attend over their own keys on gather + SDPA; together equal to gather + SDPA for all
    lengths = [max(length, new) for length, new in rows]
    new = [1 if i % 2 == 0 else n for i, (_, n) in enumerate(rows)]  # every other sequence decodes
    got, ref = decode_step(kernel, lengths, 4, tokens_per_block, window, dtype, None, seed, head_dim=64, new=new)
    tol = {"bfloat16": 3e-2}.get(dtype, 2e-5)
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@pytest.fixture
def splits(monkeypatch):
    """Every split ``PagedBatch._mixed_split`` returns (None included), in order: what the kernel was handed."""
    from cache_backends.paged_attention import PagedBatch

    seen = []
    real = PagedBatch._mixed_split

    def spy(self):
        split = real(self)
        seen.append(split)
        return split

    monkeypatch.setattr(PagedBatch, "_mixed_split", spy)
    return seen


@needs_cc
def test_a_mixed_step_reads_its_decode_rows_in_place(kernel, splits):
    # the split is taken (not a silent fall back to gathering every row): the kernel sees the decode rows only
    decode_step(kernel, [300, 40, 90], 4, 16, None, "float32", None, seed=1, head_dim=64, new=[1, 25, 1])
    assert [None if s is None else (s.decode_seqs.tolist(), s.prefill.num_seqs) for s in splits] == [([0, 2], 1)]


@needs_cc
def test_short_chunks_attend_on_the_kernel_one_row_per_token(kernel, splits):
    # a decode with its draft tokens (speculative decoding) is a short chunk: each token is a kernel row reading the
    # keys up to its own position in place; a step of short chunks only gathers nothing
    from cache_backends.paged_attention import KERNEL_CHUNK_MAX

    got, ref = decode_step(kernel, [300, 40, 90], 4, 16, 64, "float32", None, seed=2, head_dim=64, new=[3, 1, 5])
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
    assert [(s.decode_seqs.tolist(), s.lens.tolist(), s.prefill) for s in splits] == [
        ([0, 0, 0, 1, 2, 2, 2, 2, 2], [298, 299, 300, 40, 86, 87, 88, 89, 90], None)]
    splits.clear()
    decode_step(kernel, [300, 40], 4, 16, None, "float32", None, seed=3, head_dim=64, new=[KERNEL_CHUNK_MAX + 1, 2])
    assert splits[0].decode_seqs.tolist() == [1, 1] and splits[0].prefill.num_seqs == 1  # a longer chunk: gathered


@needs_cc
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(520, 1500), min_size=1, max_size=2),  # >= 2 splits of >= 256 keys each
    threads=st.sampled_from([3, 4]),
    tokens_per_block=st.sampled_from([7, 16, 64]),
    window=st.one_of(st.none(), st.integers(520, 900)),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    head_dim=st.sampled_from([24, 64]),
    seed=st.integers(0, 2**16),
)
def test_split_kv_over_threads_equals_gather_and_sdpa(kernel, lengths, threads, tokens_per_block, window, dtype,
                                                      head_dim, seed):
    # fewer (sequence, KV head) items than threads: each sequence's keys are cut into ranges of >= 256 keys attended
    # apart on the threads and merged (one KV head, one or two sequences: the case that left threads idle)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got, ref = decode_step(kernel, lengths, 4, tokens_per_block, window, dtype, None, seed, kv_heads=1,
                               head_dim=head_dim)
    finally:
        torch.set_num_threads(before)
    tol = {"bfloat16": 3e-2}.get(dtype, 2e-5)
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@needs_cc
def test_two_threads_give_what_one_gives(kernel):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = decode_step(kernel, [300, 5, 77], 8, 16, None, "float32", None, seed=3, head_dim=64)
        torch.set_num_threads(2)
        two, _ = decode_step(kernel, [300, 5, 77], 8, 16, None, "float32", None, seed=3, head_dim=64)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # enough items for the threads (no split-KV): one order of sums per head


@needs_cc
def test_threads_calling_the_kernel_at_once_each_get_their_own_answer(kernel):
    # the kernel's arguments travel in a record per calling thread (ctypes lets go of the GIL for the call): two
    # engines in one process, or a server's threads, never attend with each other's pointers
    import threading

    failures: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(i: int) -> None:
        try:
            start.wait()
            for rep in range(30):
                got, ref = decode_step(kernel, [600 + 50 * i, 300 + i], 4, 16, None, "float32", None, seed=10 * i + rep,
                                       head_dim=64)
                torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: between filling and calling
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert not failures, failures[0]


@needs_cc
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_kernel_stores_the_new_kv_exactly_where_write_kv_does(kernel, dtype):
    # the kernel folds the layer's K/V write into its call; K/V arrive as the model makes them, (1, kv_heads, B, d)
    # views of the projections' rows, so strided: the pool must end up byte-equal to write_kv's
    from cache_backends.layout import LayerKV, build_layout
    from cache_backends.paged_attention import PagedBatch, SeqChunk
    from cache_backends.pools import BlockPools

    T, Hkv, D, lengths = 16, 2, 64, [40, 1, 17]
    act = getattr(torch, dtype)
    layout = build_layout([LayerKV(0, "full", 2 * Hkv * D)], "v2", T, dtype)
    pools = [BlockPools(layout, {"full": 12}, "cpu") for _ in range(2)]
    pools[0].tensors["full"].normal_()
    pools[1].tensors["full"].copy_(pools[0].tensors["full"])
    tables = [[7, 2, 9], [4], [11, 0]]
    chunks = [SeqChunk([1], n - 1, {"full": t}) for n, t in zip(lengths, tables, strict=True)]
    q = torch.randn(3, 4, D).to(act)
    kv = torch.randn(1, 3, 2 * Hkv * D).to(act)  # one projection row per token; K and V are views of it
    key, value = (kv.view(1, 3, 2, Hkv, D)[:, :, i].transpose(1, 2)[0].transpose(0, 1) for i in (0, 1))
    assert not key.is_contiguous()
    fused = PagedBatch.build(chunks, pools[0], decode_kernel=kernel)
    out = fused.attend_decode(0, q, key, value, D ** -0.5, None)
    plain = PagedBatch.build(chunks, pools[1], decode_kernel=kernel)
    plain.write_kv(0, key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0))
    ref = plain.attend_decode(0, q, key, value, D ** -0.5, None, written=True)
    assert torch.equal(pools[0].tensors["full"].view(torch.uint8), pools[1].tensors["full"].view(torch.uint8))
    assert torch.equal(out, ref)


@needs_cc
def test_a_new_token_without_a_page_is_refused_before_the_kernel_writes(kernel):
    T, D = 16, 16
    slots = torch.zeros(4 * T, 2 * D)
    new = torch.randn(1, 1, D)
    with pytest.raises(IndexError, match="maps to no block of the pool"):  # position 16 needs a second page
        kernel(torch.randn(1, 2, D), slots, torch.tensor([[2, -1]]), torch.tensor([17]), 1, T, D ** -0.5,
               new_kv=(new, new))
    assert not slots.any()


@needs_cc
@pytest.mark.parametrize("what", ["short table", "released page in the window", "page past the pool"])
def test_a_position_without_a_page_is_an_error_not_a_wild_read(kernel, what):
    T, D = 16, 16
    slots = torch.randn(4 * T, 2 * D)
    tables = torch.tensor([[2, 0]])
    lens = torch.tensor([20])
    if what == "short table":
        lens = torch.tensor([40])  # 3 pages visible, the table has 2
    elif what == "released page in the window":
        tables = torch.tensor([[-1, 0]])
    else:
        tables = torch.tensor([[2, 4]])  # the pool has blocks 0-3
    with pytest.raises(IndexError, match="maps to no block of the pool"):
        kernel(torch.randn(1, 2, D), slots, tables, lens, 1, T, D ** -0.5)


@pytest.fixture
def compiler_runs(monkeypatch):
    """Every command the kernel build runs from now on (they still run)."""
    calls = []
    run = cpu_kernel_build._run

    def counting(cmd, *args, **kwargs):
        calls.append(cmd)
        return run(cmd, *args, **kwargs)

    monkeypatch.setattr(cpu_kernel_build, "_run", counting)
    return calls


#: a source that compiles in milliseconds: the cache and fallback tests check the build's bookkeeping, not the kernel
#: (the real one takes 5-15 s a compile on this CI's two cores)
TINY_SOURCE = b"int kvload_probe(void) { return 1; }\n"


@pytest.fixture
def tiny_source(tmp_path, monkeypatch):
    """``cpu_kernel_build.SOURCE`` pointed at :data:`TINY_SOURCE`."""
    source = tmp_path / "probe.c"
    source.write_bytes(TINY_SOURCE)
    monkeypatch.setattr(cpu_kernel_build, "SOURCE", source)
    return source


@needs_cc
def test_the_build_is_cached_per_machine_and_reused(tmp_path, monkeypatch, compiler_runs, tiny_source):
    calls = compiler_runs
    tmp_path = tmp_path / "kernels"
    first = cpu_kernel_build.build_kernel(tmp_path)
    compiles = [c for c in calls if "-c" in c or "-shared" in c]
    assert len(compiles) == 2 and first.exists()  # compile, then link
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # nothing half-built left beside it
    calls.clear()
    assert cpu_kernel_build.build_kernel(tmp_path) == first
    assert not [c for c in calls if "-c" in c or "-shared" in c]  # found, not compiled again
    tiny_source.write_bytes(TINY_SOURCE + b"/* changed */\n")
    assert cpu_kernel_build.build_kernel(tmp_path) != first  # a changed source is a new build


@needs_cc
def test_a_cached_library_that_does_not_load_is_built_again(tmp_path, tiny_source):
    # (a disk that filled up while a copy of the cache was written, say): not a fallback to gather + SDPA forever
    path = cpu_kernel_build.build_kernel(tmp_path / "kernels")
    path.write_bytes(b"\x7fELF truncated")
    lib, loaded = cpu_kernel_build.load_library(tmp_path / "kernels")  # what load_cpu_kernel loads the kernel with
    assert loaded == path and path.stat().st_size > 1000 and lib.kvload_probe() == 1


@needs_cc
def test_loading_the_kernel_leaves_the_process_floating_point_mode_alone(kernel_cache):
    # -ffast-math at link time adds crtfastmath: loading the library would flush subnormals to zero process-wide
    # (Hypothesis refuses to run then, and every torch op after it changes); a fresh process, whatever ran before
    code = ("import sys; from pathlib import Path; from cache_backends.cpu_decode import load_cpu_kernel; "
            "x = sys.float_info.min; assert x / 2 > 0; "
            f"load_cpu_kernel(Path({str(kernel_cache / 'kernels')!r})); print(x / 2 > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "True", out.stderr


@needs_cc
def test_a_flag_the_compiler_refuses_falls_back_once_not_every_process(tmp_path, monkeypatch, request, tiny_source):
    real = cpu_kernel_build.compiler()
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\nfor a in \"$@\"; do\n"
                  "  [ \"$a\" = -march=native ] && { echo 'unknown arch' >&2; exit 1; }\n"
                  f"done\nexec {real} \"$@\"\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    built = cpu_kernel_build.build_kernel(tmp_path / "kernels")  # the first flag set fails, the second builds
    calls = request.getfixturevalue("compiler_runs")  # counted from here on
    assert cpu_kernel_build.build_kernel(tmp_path / "kernels") == built
    assert not [c for c in calls if "-c" in c]  # the refused flag set is not compiled again


def test_a_compiler_that_fails_is_reported_with_its_first_line(tmp_path, monkeypatch):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo 'fake cc 1.0'; exit 0; }\n"
                  "echo 'fatal: no such target' >&2; exit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    with pytest.raises(KernelUnavailable, match=f"compiling the CPU paged decode kernel with {cc} failed: "
                                                "fatal: no such target"):
        cpu_kernel_build.build_kernel(tmp_path / "kernels")
    assert not list((tmp_path / "kernels").iterdir())


@needs_cc
def test_a_kernel_cache_whose_name_is_too_long_is_named_not_a_crash(tmp_path):
    """``KVLOAD_CACHE`` (or ``XDG_CACHE_HOME``) of a 5,000-character name: the cached build's lookup raised
    ``OSError: File name too long``, and ``kvload generate`` ended with exit 1 on it instead of attending through
    gather + SDPA, as it does for a cache it cannot create."""
    cache = tmp_path / ("9" * 5000) / "kernels"
    with pytest.raises(KernelUnavailable, match=r"the kernel cache .* cannot be read: File name too long$"):
        cpu_kernel_build.build_kernel(cache)


@pytest.mark.parametrize(("args", "says"), [
    (("cuda", 64, 4, torch.float32), "the pools are on cuda (attention_backend: triton is the kernel for CUDA)"),
    (("cpu", 1024, 4, torch.float32), "head_dim up to 512, got 1024"),
    (("cpu", 64, 128, torch.float32), "up to 64 query heads per KV head, got 128"),
    (("cpu", 64, 4, torch.int8), "does not read torch.int8 pools"),
])
def test_what_the_kernel_cannot_serve_is_named(args, says):
    assert says in cpu_decode_unsupported(*args)


@needs_cc
@pytest.mark.parametrize(("family", "manager"), [("llama", "v2"), ("llama", "v1"), ("mistral", "v1"),
                                                 ("gemma3", "v2"), ("qwen3", "v1")])
def test_generate_on_the_kernel_equals_transformers(tiny_checkpoints, kernel_cache, family, manager, monkeypatch):
    from cache_backends.paged_attention import PagedBatch

    mixed = []  # layers of mixed steps (16-token steps: the short prompt decodes while the long one prefills)
    real = PagedBatch.attend_mixed

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        mixed.append(out is not None)
        return out

    monkeypatch.setattr(PagedBatch, "attend_mixed", spy)
    with load(tiny_checkpoints(family), manager, attention_backend="cpu_kernel", tokens_per_block=16,
              max_tokens=1024) as result:
        assert isinstance(result.executor.decode_kernel, cpu_decode.CpuDecodeKernel)
        ps = prompts_for(result.hf_model.config.vocab_size, lengths=(5, 19, 40))
        outs = result.generate(ps, max_new_tokens=6)
        assert [o.token_ids for o in outs] == [hf_greedy(result.hf_model, p, 6) for p in ps]
        assert any(mixed)  # mixed steps ran their decode rows on the kernel
        assert not [e for e in result.audit.of("setting_ignored") if e["field"] == "attention_backend"]


def test_without_a_compiler_generate_says_so_and_attends_through_gather(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLOAD_CACHE", str(tmp_path))  # nothing built here yet
    monkeypatch.setattr(cpu_kernel_build, "compiler", lambda: None)
    with load(tiny_checkpoints("llama"), "v2", attention_backend="cpu_kernel", tokens_per_block=16) as result:
        outs = result.generate([[5, 6, 7]], max_new_tokens=2)
        assert len(outs[0].token_ids) == 2 and result.executor.decode_kernel is None
        (ignored,) = [e for e in result.audit.of("setting_ignored") if e["field"] == "attention_backend"]
        assert ignored["value"] == "cpu_kernel"
        assert ignored["reason"] == ("no C compiler to build the CPU paged decode kernel with (set $CC, or install "
                                     "gcc); generate attends through gather + SDPA")


def test_a_hung_compiler_is_stopped_with_its_children_and_not_retried(tmp_path, monkeypatch, compiler_runs):
    # cc runs cc1 under it: a hung cc1 must not outlive the build, nor the next flag set wait as long again
    pidfile = tmp_path / "child.pid"
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo 'fake cc 1.0'; exit 0; }\n"
                  f"sleep 300 &\necho $! > {pidfile}\nwait\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(cpu_kernel_build, "COMPILE_TIMEOUT_S", 1)
    with pytest.raises(KernelUnavailable, match=rf"the C compiler {cc} did not finish building the CPU paged decode "
                                                r"kernel in 1 s \(hung\?\); its processes were stopped"):
        cpu_kernel_build.build_kernel(tmp_path / "kernels")
    assert len([c for c in compiler_runs if "-c" in c]) == 1  # one flag set tried, not all three
    child = int(pidfile.read_text())
    for _ in range(50):  # SIGKILLed with its group; gone once reaped by init
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the compiler's child {child} is still running")
    assert not list((tmp_path / "kernels").iterdir())  # nothing half-built left


@needs_cc
def test_cc_may_be_a_command_line(tmp_path, monkeypatch, tiny_source):
    monkeypatch.setenv("CC", f"{cpu_kernel_build.compiler()} -DKVLOAD_UNUSED=1")  # as `ccache gcc` would be
    assert cpu_kernel_build.build_kernel(tmp_path / "kernels").exists()


@needs_cc
def test_a_relative_kernel_cache_named_like_an_option_builds(tmp_path, monkeypatch, compiler_runs, tiny_source):
    """``KVLOAD_CACHE=-1``: the object file ``-1/kernels/....o`` went on the link's command line as it was, cc took it
    for an option ("unrecognized command-line option"), and every flag set was compiled and failed to link (a
    ``kvload generate`` ran ~90 s on a busy machine and then said the kernel could not be built)."""
    monkeypatch.chdir(tmp_path)
    built = cpu_kernel_build.build_kernel(Path("-1") / "kernels")
    assert built.exists() and built.is_relative_to(tmp_path / "-1" / "kernels")
    assert len([c for c in compiler_runs if "-c" in c or "-shared" in c]) == 2  # one compile, one link


@needs_cc
def test_a_killed_builds_temporary_files_are_swept_by_the_next_build(tmp_path, tiny_source):
    """A build killed where nothing could clean up (SIGKILL) left ``.<stem>-<key>.<pid>.<thread>.o/.so`` in the cache
    for good; the next build removes those past any build's time whose process is gone, and nothing else: a live
    process's (another build now), a recent one's (maybe another machine's sharing the cache), another kernel's."""
    cache = tmp_path / "kernels"
    cache.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = time.time() - 2 * cpu_kernel_build.COMPILE_TIMEOUT_S * len(cpu_kernel_build.FLAG_SETS) - 120
    key = "0123456789abcdef"
    stale = [cache / f".probe-{key}.{dead.pid}.140305877490560.{ext}" for ext in ("o", "so")]
    kept = [cache / f".probe-{key}.{dead.pid}.1.so",  # recent: a build of a machine sharing the cache may own it
            cache / f".probe-{key}.{os.getpid()}.2.o",  # old, but its process is alive
            cache / f".paged_decode-{key}.{dead.pid}.3.so",  # another kernel's: its own build sweeps it
            cache / "notes.txt"]
    for path in stale + kept:
        path.write_bytes(b"half")
    for path in stale + kept[1:]:
        os.utime(path, (old, old))
    built = cpu_kernel_build.build_kernel(cache)
    assert built.exists()
    assert not any(path.exists() for path in stale)
    assert all(path.exists() for path in kept)
