"""KVCacheManagerV2 on a CUDA device: device pools, a pinned host tier, byte-exact round trips, a full run."""

from __future__ import annotations

import pytest
import torch

from cache_backends.request import Request
from cache_backends.v2 import KVCacheV2Scheduler
from tests.kv_v2_support import drive, full_sliding_layers, make_manager

_no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda is not available)")
CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, _no_cuda])


@pytest.mark.cuda
@_no_cuda
def test_pools_live_on_the_device_and_the_host_tier_is_pinned():
    m = make_manager(full_sliding_layers(), 16, dtype="bfloat16", device="cuda")
    try:
        assert all(t.is_cuda for t in m.pools.tensors.values())
        assert m.host is not None and m.host.pinned
        assert all(t.device.type == "cpu" and t.is_pinned() for t in m.host.tensors.values())
    finally:
        m.close()
    assert m.pools.released


@pytest.mark.cuda
@_no_cuda
def test_suspend_resume_on_cuda_is_byte_exact_after_the_device_blocks_were_reused():
    m = make_manager(full_sliding_layers(window=10), 12, dtype="bfloat16", device="cuda")
    try:
        r = Request("a", list(range(1, 23)), 0)
        m.create(r)
        assert m.resume(r) and m.allocate(r, 22)
        for g in m.groups:
            for b in m.block_table(r, g.name):
                page = m.pools.tensors[g.name][:, b]
                page.copy_(torch.randn(page.shape, device="cuda").to(page.dtype))
        m.commit(r, 22)
        saved = {g.name: [(b, m.pools.tensors[g.name][:, b].clone()) for b in m.block_table(r, g.name) if b >= 0]
                 for g in m.groups}
        assert m.suspend(r)
        hog = Request("hog", [500 + i for i in range(48)], 0)
        m.create(hog)
        assert m.resume(hog) and m.allocate(hog, 48)
        for t in m.pools.tensors.values():
            t.copy_(torch.randn(t.shape, device="cuda").to(t.dtype))
        m.free(hog)
        assert m.resume(r)
        for g in m.groups:
            table = [b for b in m.block_table(r, g.name) if b >= 0]
            assert len(table) == len(saved[g.name])
            for b, (_, page) in zip(table, saved[g.name], strict=True):
                got = m.pools.tensors[g.name][:, b]
                assert torch.equal(got.view(torch.int16), page.view(torch.int16)), g.name
        m.check_invariants()
    finally:
        m.close()


# The same scenario on the CPU as well, so CI (which has no GPU) notices when it stops putting pressure on
# the pools: before greedy admission was asked for here, the adaptive admission avoided the pressure and
# this test failed on the first GPU run.
@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("host", [None, 0])
def test_a_pressured_run_completes_with_every_page_checked(host, device):
    m = make_manager(full_sliding_layers(window=8), 12, device=device, host_cache_size=host)
    try:
        # greedy admission (init_ratio 0): more run than fit at full length, so pressure must come
        s = KVCacheV2Scheduler(m, max_batch_size=8, max_num_tokens=16, init_ratio=0.0)
        reqs = [Request(f"r{i}", [(i * 31 + j) % 97 for j in range(10)], 12, arrival=i) for i in range(6)]
        res = drive(m, s, reqs)
        assert res.stalled is None and len(res.finished) == 6
        assert res.count("suspended" if host is None else "preempted") > 0
    finally:
        m.close()
