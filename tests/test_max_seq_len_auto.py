"""vLLM's ``--max-model-len auto`` / ``-1`` (``max_model_len=-1``): the longest one sequence the KV cache holds, at
most the checkpoint's length; the audit says what it resolved to and why."""

from __future__ import annotations

import pytest

from tests.cli_support import run_cli


def _fit_events(result):
    return ([e for e in result.audit.of("auto_resolved") if e["field"] == "max_seq_len"],
            [e for e in result.audit.of("field_derived") if e["field"] == "max_seq_len"])


def test_max_model_len_minus_one_fits_the_kv_budget_and_says_why():
    """A KV cache of 1,000 tokens (pools of 1,024: whole 32-token blocks) under tiny-llama's 8,192 positions:
    auto is 1,024, the longest sequence the pools hold, not 8,192 (a kv_budget_short warning and requests never
    admitted); the events give the checkpoint's value first, then the budget's, with the bytes and the rule."""
    import kvload

    with kvload.plan("tiny-llama", max_model_len=-1, kv_cache_config={"max_tokens": 1000}, log=False) as r:
        assert r.args.max_seq_len == 1024
        (auto,), (fit,) = _fit_events(r)
        assert (auto["original"], auto["new"], auto["source"]) == ("auto", 8192, "checkpoint")
        assert (fit["old"], fit["new"], fit["source"]) == (8192, 1024, "kv_budget")
        assert "set by kv_cache_config.max_tokens" in fit["reason"] and "1,048,576 B" in fit["reason"]
        assert not r.audit.of("kv_budget_short")
        assert r.audit.of("kv_budget_computed")[-1]["max_seq_len"] == 1024
    with kvload.plan("tiny-llama", max_seq_len="auto", kv_cache_config={"max_tokens": 100_000}, log=False) as r:
        assert r.args.max_seq_len == 8192  # the budget holds the checkpoint's whole length: that is the most
        (auto,), derived = _fit_events(r)
        assert auto["new"] == 8192 and not derived


@pytest.mark.parametrize("value", ["auto", "-1", "AUTO"])
def test_the_flag_takes_vllms_auto_spellings_and_the_audit_verifies(capsys, tmp_path, value):
    path = tmp_path / "audit.jsonl"
    r = run_cli(capsys, "plan", "tiny-llama", "--max-model-len", value, "--max_tokens", "1000", "--audit-log", path)
    assert r.code == 0, r.err
    assert "max_seq_len 1024" in r.out and "kv_budget_short" not in r.err, r.out
    verified = run_cli(capsys, "audit", path, "--verify")
    assert verified.code == 0, verified.out + verified.err
    said = run_cli(capsys, "explain", path, "max_seq_len")
    assert said.code == 0 and "holds one sequence of 1024 tokens" in said.out, said.out


def test_a_bad_value_names_auto_among_what_is_accepted(capsys):
    r = run_cli(capsys, "plan", "tiny-llama", "--max-model-len", "-2")
    assert (r.code, r.err) == (2, 'error: --max-model-len: expected an integer >= 1, "auto" or null, got -2\n')


def test_generate_and_the_python_llm_run_under_auto(capsys):
    """generate sizes its CPU pools before the run (prompts x (n x max_new_tokens + 1024)): auto is no length of the
    user's there ("invalid literal for int(): 'auto'" before), the fit follows those pools; kvload.LLM alike."""
    import kvload

    r = run_cli(capsys, "generate", "tiny-llama", "--prompt-ids", "1,2,3", "--max_new_tokens", "4", "--max-model-len",
                "auto", "--json")
    assert r.code == 0, r.err
    with kvload.LLM("tiny-llama", max_model_len=-1, kv_cache_config={"max_tokens": 512}, log=False) as llm:
        assert llm.args.max_seq_len == 512
        assert len(llm.generate([[1, 2, 3]], kvload.SamplingParams(max_tokens=3))[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize(("model", "kv"), [
    ("tiny-llama", {"max_tokens": 777}),
    ("tiny-llama", {"max_gpu_total_bytes": 3_000_000}),
    ("tiny-gemma3", {"max_tokens": 1000, "use_kv_cache_manager_v2": True}),
    ("tiny-gemma3", {"max_gpu_total_bytes": 2_500_000, "use_kv_cache_manager_v2": True}),
    ("tiny-deepseek-v4", {"max_gpu_total_bytes": 4_000_000}),
])
def test_auto_is_the_longest_length_whose_pools_hold_one_sequence_and_one_token_more_is_not(model, kv):
    """The fit is a boundary: the budget's pools for the length chosen hold one sequence of it, those for one token
    more do not (whatever the layout: one group, sliding windows in V2 pools, DeepSeek V4's groups)."""
    import kvload
    from cache_backends.budget import BudgetError, plan_pools

    with kvload.plan(model, max_model_len=-1, kv_cache_config=kv, device="cpu", log=False) as r:
        chosen, layout, budget = r.args.max_seq_len, r.kv.layout, r.kv.budget
        (_, (fit,)) = _fit_events(r)
    capped = budget.max_tokens if budget.limited_by == "max_tokens" else None

    def holds_one(length: int) -> bool:
        try:
            return plan_pools(layout, budget.budget_bytes, length, max_tokens=capped).max_concurrency > 0
        except BudgetError:
            return False

    assert fit["new"] == chosen < fit["old"]
    assert holds_one(chosen) and not holds_one(chosen + 1)


@pytest.mark.parametrize(("max_tokens", "want"), [(100_000, 512), (200, 224)])
def test_an_explicit_auto_starts_from_a_model_default_as_unset_does(spec_with_defaults, max_tokens, want):
    """A model proposing max_seq_len 512: left unset the run has 512; "auto" skipped the proposal (the user set the
    field, "resolve_auto lets the model decide", its model_default_skipped said) and then fitted from the checkpoint's
    1,024 positions, the model's word dropped. Now it fits from the model's 512, at most."""
    import kvload

    ckpt = spec_with_defaults({"max_seq_len": 512})
    with kvload.plan(str(ckpt), log=False, kv_cache_config={"max_tokens": max_tokens}) as unset:
        assert unset.args.max_seq_len == 512
    with kvload.plan(str(ckpt), max_seq_len="auto", log=False, kv_cache_config={"max_tokens": max_tokens}) as r:
        assert r.args.max_seq_len == want
        (auto,), derived = _fit_events(r)
        assert (auto["old"], auto["new"], auto["source"]) == ("auto", 512, "model_default")
        assert [(e["old"], e["new"]) for e in derived] == ([] if want == 512 else [(512, want)])
        assert not r.audit.of("max_seq_len_beyond_positions")
        assert r.audit.verify() == []
