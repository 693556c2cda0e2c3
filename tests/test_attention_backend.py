"""The attention_backend setting: validated, resolved from "auto" with a reason, a CLI flag, and acted on."""

from __future__ import annotations

import pytest

import pipeline
from pipeline.config import ConfigError
from tests.cli_support import run_cli
from tests.generate_support import NEW_TOKENS, hf_greedy, load, prompts_for


def test_auto_on_cpu_resolves_to_the_cpu_kernel_with_a_reason_in_the_audit(monkeypatch):
    monkeypatch.setenv("CC", "/usr/bin/true")  # a compiler is there (resolving builds nothing)
    planned = pipeline.plan("tiny-llama", log=False, device="cpu")
    assert planned.args.attention_backend == "cpu_kernel"
    (event,) = [e for e in planned.audit.of("auto_resolved") if e["field"] == "attention_backend"]
    assert event["new"] == "cpu_kernel" and "reads each sequence's pages in place" in event["reason"]


def test_auto_on_cpu_without_a_compiler_stays_on_gather_and_says_why(monkeypatch):
    from cache_backends import cpu_kernel_build

    monkeypatch.setattr(cpu_kernel_build, "compiler", lambda: None)
    planned = pipeline.plan("tiny-llama", log=False, device="cpu")
    assert planned.args.attention_backend == "sdpa"
    (event,) = [e for e in planned.audit.of("auto_resolved") if e["field"] == "attention_backend"]
    assert event["reason"].startswith("no C compiler here to build the CPU paged decode kernel with")


def test_auto_on_cpu_for_an_mla_model_stays_on_gather_and_says_why(monkeypatch):
    monkeypatch.setenv("CC", "/usr/bin/true")
    planned = pipeline.plan("tiny-deepseek-v3", log=False, device="cpu")
    assert planned.args.attention_backend == "sdpa"
    (event,) = [e for e in planned.audit.of("auto_resolved") if e["field"] == "attention_backend"]
    assert event["reason"].startswith("the model's attention layers are mla;")


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_auto_on_cuda_takes_the_measured_faster_path_and_says_why(device):
    # measured on an H200: generate 0.77-0.85x of model.generate on gather + SDPA, 0.65-0.71x on flex
    from stages.resolve_auto import resolve_attention_backend

    value, old, reason = resolve_attention_backend(device)
    assert (value, old) == ("sdpa", "auto")
    assert "H200" in reason and '"flex" still selects it' in reason


def test_an_explicit_backend_is_kept():
    planned = pipeline.plan("tiny-llama", log=False, device="cpu", attention_backend="flex")
    assert planned.args.attention_backend == "flex"
    assert not [e for e in planned.audit.of("auto_resolved") if e["field"] == "attention_backend"]


def test_a_bad_backend_names_the_field_and_the_choices():
    with pytest.raises(ConfigError, match=r'attention_backend.*"auto", "flex", "sdpa", "triton" or "cpu_kernel"'):
        pipeline.plan("tiny-llama", log=False, device="cpu", attention_backend="paged")


def test_the_cli_flag_sets_it_and_refuses_other_values(capsys):
    ok = run_cli(capsys, "plan", "tiny-llama", "--device", "cpu", "--attention_backend", "flex", "--json")
    assert ok.code == 0, ok.err
    assert '"attention_backend": "flex"' in ok.out
    bad = run_cli(capsys, "plan", "tiny-llama", "--attention_backend", "paged")
    assert bad.code == 2 and bad.one_error_line
    assert "--attention_backend: invalid choice: 'paged'" in bad.err


@pytest.mark.parametrize("manager", ["v2", "v1"])
def test_generate_on_flex_equals_transformers_and_reuses_its_compiled_shapes(tiny_checkpoints, manager):
    from cache_backends.flex_paged import dynamo_graphs

    # max_num_tokens=8: every step fits one bucket, so the whole test compiles one shape per pool layout
    with load(tiny_checkpoints("mistral"), manager, max_num_tokens=8, attention_backend="flex") as result:
        ps = prompts_for(result.hf_model.config.vocab_size)
        ref = [hf_greedy(result.hf_model, p) for p in ps]
        graphs_before = dynamo_graphs()
        first = result.generate(ps, max_new_tokens=NEW_TOKENS)
        assert [o.token_ids for o in first] == ref
        flex = result.executor.flex
        assert flex is not None and flex.calls > 0
        # dozens of steps (prefill chunks and decodes of ragged lengths), one bucket, one pool: at most one graph
        assert result.executor.last_stats.steps > 8 and dynamo_graphs() - graphs_before <= 1
        compiles, graphs, calls = flex.compiles, dynamo_graphs(), flex.calls
        again = result.generate(ps, max_new_tokens=NEW_TOKENS, arrival_steps=[0, 1, 2, 5])
        assert [o.token_ids for o in again] == ref
        assert flex.calls > calls  # the second call ran on the compiled path...
        assert (flex.compiles, dynamo_graphs()) == (compiles, graphs)  # ...and compiled nothing new
        assert result.executor.last_stats.warmup_s == 0.0


@pytest.mark.parametrize("manager", ["v2", "v1"])
def test_generate_on_flex_runs_mla_absorbed_and_equals_transformers(tiny_checkpoints, manager):
    # DeepSeek V3's latent pools on the compiled path: no setting_ignored, the kernel ran, tokens unchanged
    from cache_backends.flex_paged import dynamo_graphs

    with load(tiny_checkpoints("deepseek-v3"), manager, max_num_tokens=8, attention_backend="flex") as result:
        ps = prompts_for(result.hf_model.config.vocab_size)
        ref = [hf_greedy(result.hf_model, p) for p in ps]
        graphs_before = dynamo_graphs()
        outs = result.generate(ps, max_new_tokens=NEW_TOKENS, arrival_steps=[0, 1, 2, 5])
        assert [o.token_ids for o in outs] == ref
        flex = result.executor.flex
        assert flex is not None and flex.calls > 0 and flex.failed is None
        # every MLA layer of every step went through the absorbed kernel (3 layers), and one shape served them
        assert flex.calls == 3 * result.executor.last_stats.steps
        assert dynamo_graphs() - graphs_before <= 1
        assert not [e for e in result.audit.of("setting_ignored") if e["field"] == "attention_backend"]
        # a prompt extending an earlier one reads its cached blocks (shared by two tables) on the kernel too
        longer = ps[2] + [7, 8, 9]
        (again,) = result.generate([longer], max_new_tokens=NEW_TOKENS)
        assert again.reused_prompt_tokens >= 16 and again.token_ids == hf_greedy(result.hf_model, longer)


def v2_lite_mla_step(chunks: list[tuple[int, int]], blocks: int) -> tuple:
    """A step of ``(new tokens, start)`` chunks over one MLA layer of DeepSeek-V2-Lite's dims, and those dims."""
    from types import SimpleNamespace

    from cache_backends.layout import LayerKV, build_layout
    from cache_backends.paged_attention import PagedBatch, SeqChunk
    from cache_backends.pools import BlockPools

    config = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    layout = build_layout([LayerKV(0, "mla", 576)], "v2", 16, "float32")
    pools = BlockPools(layout, {layout.groups[0].name: blocks}, "cpu")
    table = {layout.groups[0].name: list(range(blocks))}
    return PagedBatch.build([SeqChunk([1] * n, start, table) for n, start in chunks], pools), config


@pytest.mark.parametrize(("chunks", "absorbed"), [
    ([(1, 600)] * 8, True),  # decode: one query per sequence, every key expanded for it otherwise
    ([(8, 512)], True), ([(64, 512)], True),  # short chunks after a cached prefix
    ([(128, 512)], False), ([(512, 0)], False),  # long prefill chunks: each key expanded once for many queries
    ([(512, 0)] + [(1, 600)] * 32, True),  # a prompt beside 32 decodes: the decodes' keys outweigh it
])
def test_a_step_attends_absorbed_where_that_costs_fewer_multiply_adds(chunks, absorbed):
    # DeepSeek-V2-Lite's MLA dims; the switch sits near 70 queries per sequence (BENCHMARKS.md, "MLA prefill")
    from models.paged_forward import absorbed_pays

    batch, config = v2_lite_mla_step(chunks, 40)
    assert absorbed_pays(batch, config) is absorbed


@pytest.mark.parametrize(("chunks", "absorbed"), [
    ([(1, 600)] * 8, True), ([(1, 600), (1, 100)], True),  # decode rows, equal and ragged
    ([(64, 512)], True), ([(128, 512)], True),  # short chunks after a cached prefix (measured: 0.53x, 0.88x)
    ([(256, 512)], False), ([(512, 0)], False),  # long chunks (measured: 1.28x, 1.71x at 256 from 0)
    ([(8, 0)], False), ([(8, 0), (1, 600)], True),  # from 0 expanding wins (1.13x at 8); decodes beside tip it
    ([(512, 0)] + [(1, 600)] * 32, True),  # a prompt beside 32 decodes: attended apart, their keys outweigh it
    ([(200, 512), (150, 512)], False),  # padded together (< 2x the work): the padded square is counted
])
def test_gather_attends_mla_absorbed_where_its_matmuls_cost_less(chunks, absorbed):
    # gather + SDPA's rule at DeepSeek-V2-Lite's dims: its plain matmuls at a GEMM's rate, the absorbed side padded
    # as attend_latent_gathered pads (BENCHMARKS.md, "MLA on gather + SDPA in the absorbed form")
    from models.paged_forward import PagedLatentCache

    batch, config = v2_lite_mla_step(chunks, 60)
    assert PagedLatentCache(batch, config).absorbed is absorbed


def test_flex_expands_mla_for_a_long_prefill_chunk_and_stays_token_equal(tiny_checkpoints):
    # tiny-deepseek-v3's dims switch to expanding above ~10 queries per sequence: the 16-token prefill chunk
    # gathers and expands (as on sdpa), the decode steps attend absorbed on the kernel
    with load(tiny_checkpoints("deepseek-v3"), "v2", max_num_tokens=16, attention_backend="flex") as result:
        prompt = prompts_for(result.hf_model.config.vocab_size)[1]  # 13 tokens: one chunk
        (out,) = result.generate([prompt], max_new_tokens=NEW_TOKENS)
        assert out.token_ids == hf_greedy(result.hf_model, prompt)
        steps, calls = result.executor.last_stats.steps, result.executor.flex.calls
        assert calls == 3 * (steps - 1)  # every step but the prefill, on all 3 layers


def test_flex_on_mla_whose_projection_cannot_be_folded_says_it_is_ignored(tiny_checkpoints):
    # a quantized checkpoint's kv_b_proj (here: an int8 weight) cannot be folded into queries and outputs
    import torch

    with load(tiny_checkpoints("deepseek-v3"), "v2", max_num_tokens=8, attention_backend="sdpa") as result:
        proj = result.hf_model.model.layers[1].self_attn.kv_b_proj
        proj.weight = torch.nn.Parameter(proj.weight.detach().to(torch.int8), requires_grad=False)
        result.executor.use_attention("flex", 8)
        assert result.executor.flex is None
        (ignored,) = [e for e in result.audit.of("setting_ignored") if e["field"] == "attention_backend"]
        assert ignored["reason"] == ("the MLA layer model.layers.1.self_attn's kv_b_proj is a Linear of torch.int8, "
                                     "not a plain floating-point matrix the compiled path can fold into its queries "
                                     "and outputs; generate attends through gather + SDPA")


@pytest.mark.parametrize("family", ["llama", "deepseek-v3"])  # deepseek-v3: an MLA layer falls back mid-step
def test_a_shape_that_fails_to_compile_falls_back_to_gather_and_says_so(tiny_checkpoints, monkeypatch, family):
    import cache_backends.flex_paged as fp

    def broken():
        def call(*args, **kwargs):
            raise RuntimeError("InductorError: no C++ compiler\nmore detail")
        return call

    monkeypatch.setattr(fp, "compiled_flex", broken)
    monkeypatch.setattr(fp, "_COMPILED", set())  # every shape is new, so its first call is a compile
    monkeypatch.setattr(fp, "_FAILED", {})
    with load(tiny_checkpoints(family), "v2", max_num_tokens=8, attention_backend="flex") as result:
        ps = prompts_for(result.hf_model.config.vocab_size)
        outs = result.generate(ps, max_new_tokens=NEW_TOKENS)
        assert [o.token_ids for o in outs] == [hf_greedy(result.hf_model, p) for p in ps]
        assert result.executor.flex is None
        (ignored,) = [e for e in result.audit.of("setting_ignored") if e["field"] == "attention_backend"]
        assert ignored["reason"] == ("torch.compile failed (RuntimeError: InductorError: no C++ compiler); generate "
                                     "attends through gather + SDPA")


def test_flex_whose_mask_indices_would_outgrow_the_bound_falls_back_and_says_why(tiny_checkpoints, monkeypatch):
    import cache_backends.flex_paged as fp

    with load(tiny_checkpoints("llama"), "v2", max_num_tokens=8, attention_backend="flex") as result:
        need = fp.FlexPagedAttention.index_bytes(result.kv_manager.pools, 8)
        monkeypatch.setattr(fp, "MAX_INDEX_BYTES", need - 1)  # one byte short of what this budget asks for
        outs = result.generate([[5, 6, 7]], max_new_tokens=2)
        assert len(outs[0].token_ids) == 2 and result.executor.flex is None
        (ignored,) = [e for e in result.audit.of("setting_ignored") if e["field"] == "attention_backend"]
        assert f"{need:,} B" in ignored["reason"] and "max_num_tokens=8" in ignored["reason"]
