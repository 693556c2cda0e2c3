"""The Triton paged decode kernel (``attention_backend: triton``): equal to gather + SDPA, and acted on or refused.

Without a GPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set here when torch sees no CUDA
device), which executes it on CPU tensors; where triton is not installed these tests skip, saying so.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_backends.paged_decode import paged_decode, paged_decode_unsupported
from tests.decode_kernel_support import decode_step
from tests.generate_support import hf_greedy, load, prompts_for

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is first built
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(paged_decode_unsupported(DEVICE, 16, 16) is not None,
                                  reason=f"{paged_decode_unsupported(DEVICE, 16, 16)}")

@needs_triton
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 90), min_size=1, max_size=3),
    heads=st.sampled_from([2, 4, 8]),
    tokens_per_block=st.sampled_from([16, 32]),
    window=st.one_of(st.none(), st.integers(1, 40)),
    # bfloat16 on a GPU only: Triton's interpreter (numpy underneath) computes it wrong
    dtype=st.sampled_from(["float32", "float16", "float8_e4m3fn"] + (["bfloat16"] if DEVICE == "cuda" else [])),
    softcap=st.one_of(st.none(), st.just(20.0)),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_equals_gather_and_sdpa(lengths, heads, tokens_per_block, window, dtype, softcap, seed):
    got, ref = decode_step(paged_decode, lengths, heads, tokens_per_block, window, dtype, softcap, seed,
                           device=DEVICE)
    tol = {"float16": 2e-3, "bfloat16": 2e-2}.get(dtype, 1e-5)
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@needs_triton
def test_a_long_sequence_split_over_many_programs_still_merges_exactly():
    # 700 keys in 16-token pages: 44 pages, split 5 ways; a short one beside it gets the same split count
    got, ref = decode_step(paged_decode, [700, 3], 8, 16, None, "float32", None, seed=5, device=DEVICE)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize(("family", "manager"), [("llama", "v2"), ("mistral", "v1"), ("gemma3", "v2")])
def test_generate_on_the_kernel_equals_transformers(tiny_checkpoints, family, manager):
    with load(tiny_checkpoints(family), manager, attention_backend="triton", tokens_per_block=16, max_tokens=1024,
              device=DEVICE) as result:
        assert result.executor.decode_kernel is paged_decode
        ps = prompts_for(result.hf_model.config.vocab_size, lengths=(5, 19))
        outs = result.generate(ps, max_new_tokens=4)
        assert [o.token_ids for o in outs] == [hf_greedy(result.hf_model, p, 4) for p in ps]
        assert not [e for e in result.audit.of("setting_ignored") if e["field"] == "attention_backend"]


def test_on_the_cpu_the_kernel_is_refused_with_the_reason(tiny_checkpoints, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with load(tiny_checkpoints("llama"), "v2", attention_backend="triton", tokens_per_block=16) as result:
        outs = result.generate([[5, 6, 7]], max_new_tokens=2)
        assert len(outs[0].token_ids) == 2 and result.executor.decode_kernel is None
        (ignored,) = [e for e in result.audit.of("setting_ignored") if e["field"] == "attention_backend"]
        assert ignored["value"] == "triton"
        assert ignored["reason"].endswith("; generate attends through gather + SDPA")
        assert "CUDA" in ignored["reason"] or "triton is not installed" in ignored["reason"]


@pytest.mark.parametrize(("tokens_per_block", "head_dim", "says"), [
    (4, 16, "tokens_per_block must be a power of two >= 16, got 4"),
    (48, 16, "got 48"),
    (16, 24, "head_dim must be a power of two >= 16, got 24"),
])
def test_page_and_head_sizes_the_kernel_cannot_tile_are_refused(tokens_per_block, head_dim, says, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    why = paged_decode_unsupported("cpu", tokens_per_block, head_dim)
    assert why is not None
    assert says in why or "triton is not installed" in why
