"""One "did you mean" for every refusal of a mistyped name: the same cutoff, the same wording, in each caller."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.sampling_params import SamplingParams
from kvload.explain import resolve_field
from models.checkpoint import resolve_checkpoint
from pipeline.config import LlmArgs
from pipeline.converter import structure
from pipeline.errors import close_names, did_you_mean
from pipeline.paths import unflatten
from stages.apply_model_defaults import validate_model_defaults
from tests.cli_support import run_cli


def _refusal(call: Callable[[], object]) -> str:
    with pytest.raises(Exception) as err:  # each caller's own error class; the line is what the user reads
        call()
    return str(err.value)


def _explain(name: str) -> str:
    return _refusal(lambda: resolve_field(name))


def _model_default(path: str) -> str:
    return _refusal(lambda: validate_model_defaults(unflatten({path: 1}), "TypoSpec"))


def _config_key(path: str) -> str:
    return _refusal(lambda: structure({"model": "m", **unflatten({path: 1})}, LlmArgs))


def _model(name: str) -> str:
    return _refusal(lambda: resolve_checkpoint(name))


def _sampling(name: str) -> str:
    return _refusal(lambda: SamplingParams(**{name: 1}))


@pytest.fixture
def cli_flag(capsys):
    def refusal(flag: str) -> str:
        r = run_cli(capsys, "plan", "tiny-llama", flag, "5")
        assert r.code == 2 and r.one_error_line, r.err
        return r.err

    return refusal


@pytest.fixture
def trtllm_key(capsys, tmp_path):
    def refusal(yaml_text: str) -> str:
        cfg = tmp_path / "extra.yaml"
        cfg.write_text(yaml_text + "\n")
        r = run_cli(capsys, "plan", "tiny-llama", "--config", cfg)
        assert r.code == 2 and r.one_error_line, r.err
        return r.err

    return refusal


#: (caller, typo, the suggestion the refusal ends its say with; None: no suggestion). "changed" marks a case whose
#: suggestion differs from main's (each caller had its own cutoff): the rest pin what each caller already said.
CASES = [
    # kvload explain FIELD
    ("explain", "kv_cache_config.max_tokns", "; did you mean 'kv_cache_config.max_tokens'?"),  # the dotted path
    ("explain", "max_token", "; did you mean 'max_tokens'?"),
    ("explain", "Max_Batch_Size", "; did you mean 'max_batch_size'?"),
    ("explain", "frob", None),
    # a model's get_model_defaults
    ("model_defaults", "kv_cache_config.tokens_per_blok", "; did you mean 'kv_cache_config.tokens_per_block'?"),
    ("model_defaults", "max_seq", "; did you mean 'max_seq_len'?"),
    ("model_defaults", "frob", None),
    # a config key (YAML, --config, LLM(**kwargs))
    ("config_key", "kv_cache_config.enable_blok_reuse", "; did you mean 'enable_block_reuse'?"),
    ("config_key", "max-batch-size", "; did you mean 'max_batch_size'?"),
    # changed: 'max_tokens' (difflib's nearest at 0.5); the only key it begins is tokens_per_block
    ("config_key", "kv_cache_config.tokens", "; did you mean 'tokens_per_block'?"),
    # changed: 'max_batch_size' at main's 0.5, a guess from three letters; the known keys are listed instead
    ("config_key", "maxbs", None),
    # a TensorRT-LLM option kvload ignores
    ("trtllm", "build_confg: {}", "; did you mean 'build_config'? (a TensorRT-LLM option kvload accepts and ignores)"),
    # changed: 'use_cuda_graph'; the keys it begins (cuda_graph_config is what its users mean)
    ("trtllm", "cuda_graph: {}", "; did you mean 'cuda_graph_batch_sizes' or 'cuda_graph_config' or "
                                 "'cuda_graph_padding_enabled'? (TensorRT-LLM options kvload accepts and ignores)"),
    # changed: no suggestion (the known keys listed); the one key it begins
    ("trtllm", "kv_cache_config:\n  copy_on: true",
     "; did you mean 'copy_on_partial_reuse'? (a TensorRT-LLM option kvload accepts and ignores)"),
    # a model name
    ("model", "tiny-lama", "; did you mean 'tiny-llama'?"),
    ("model", "Tiny_Llama", "; did you mean 'tiny-llama'?"),
    # changed: 'tiny-deepseek-v4' alone, as if v3 were not there
    ("model", "tiny-deepseek", "; did you mean 'tiny-deepseek-v3' or 'tiny-deepseek-v4'?"),
    ("model", "frob", None),
    # a command-line flag
    ("cli", "--max-tokns", "; did you mean --max-tokens?"),
    ("cli", "--api", "; did you mean --api_key or --api_server_count?"),
    ("cli", "--quiet", None),  # not --requests: both begin with "--", which is no likeness
    ("cli", "--MAX-TOKENS", "; did you mean --max-tokens?"),  # changed: none (case counted as a difference)
    # a SamplingParams field (the callers of pipeline.errors.did_you_mean)
    ("sampling", "temprature", "; did you mean 'temperature'?"),
    ("sampling", "n_", "; did you mean 'n'?"),
    ("sampling", "top", "; did you mean 'top_k' or 'top_p'?"),  # changed: 'stop'
]


@pytest.mark.parametrize(("caller", "typo", "suggestion"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_each_caller_suggests_the_same_way(request, caller, typo, suggestion):
    refuse = {"explain": _explain, "model_defaults": _model_default, "config_key": _config_key, "model": _model,
              "sampling": _sampling}.get(caller) or request.getfixturevalue({"cli": "cli_flag",
                                                                            "trtllm": "trtllm_key"}[caller])
    message = refuse(typo)
    assert "\n" not in message.rstrip("\n"), message
    if suggestion is None:
        assert "did you mean" not in message, message
    else:
        assert suggestion in message, message


def test_a_typo_of_a_dotted_path_suggests_the_dotted_path():
    known = ["kv_cache_config.max_tokens", "max_tokens", "max_num_tokens"]
    assert close_names("kv_cache_config.max_tokns", known) == ["kv_cache_config.max_tokens"]


def test_the_spelling_nearest_the_users_is_offered():
    """An option spelt both ways is offered as typed: ``--api_keyy``, ``--api_key``; ``--api-keyy``, ``--api-key``."""
    options = {"--api-key", "--api_key", "--seed"}
    assert did_you_mean("--api_keyy", options, quote=False) == "; did you mean --api_key?"
    assert did_you_mean("--api-keyy", options, quote=False) == "; did you mean --api-key?"


@pytest.mark.parametrize("name", ["", "x" * 101, "--"])
def test_no_suggestion_for_an_empty_or_overlong_name(name):
    assert did_you_mean(name, ["temperature", "top_k"]) == ""



def test_a_python_calls_own_keyword_mistyped_is_offered_as_the_fields_are():
    """``load(..., load_weight=True)`` was "unknown key; known keys: <every LlmArgs field>": the keywords of the call
    itself (``load_weights``, ``config_file``, ``audit_log``, ``log``) were no candidates, so the one meant was not
    named (the README: every public call names the argument a mistyped keyword is close to)."""
    import kvload

    cases = ((kvload.load, "load_weight", "load_weights"), (kvload.plan, "config_fille", "config_file"),
             (kvload.plan, "audit_logg", "audit_log"))
    for call, typo, meant in cases:
        said = _refusal(lambda call=call, typo=typo: call("tiny-llama", log=False, **{typo: 1}))
        assert said == f"{typo}: unknown key; did you mean {meant!r}?"
    from engine.simulator import simulate

    said = _refusal(lambda: simulate("tiny-llama", "mixed", requests=4, log=False, hardwar="h100"))
    assert said == "hardwar: unknown key; did you mean 'hardware'?"
    # a field's typo is offered the field, as before
    said = _refusal(lambda: kvload.plan("tiny-llama", log=False, max_batch_siz=8))
    assert said.endswith("did you mean 'max_batch_size'?")


def test_a_keyword_of_another_public_call_is_named_as_that_calls():
    """``plan(..., load_weights=True)`` answered with the list of LlmArgs fields, none of which was meant: the
    keyword is ``load()``'s, and the refusal now says so (as for any keyword of plan, load or LLM given to another)."""
    import kvload

    cases = ((kvload.plan, "load_weights", "'load_weights' is a keyword of kvload.load(), not of kvload.plan()"),
             (kvload.LLM, "load_weights", "'load_weights' is a keyword of kvload.load(), not of kvload.LLM()"),
             (kvload.LLM, "stages", "'stages' is a keyword of kvload.plan() and kvload.load(), not of kvload.LLM()"))
    for call, keyword, said in cases:
        refusal = _refusal(lambda call=call, keyword=keyword: call("tiny-llama", log=False, **{keyword: True}))
        assert refusal == f"{keyword}: unknown key; {said}"
        assert "known keys" not in refusal
    # a typo of one is offered it, saying whose it is
    refusal = _refusal(lambda: kvload.plan("tiny-llama", log=False, load_weight=True))
    assert refusal == ("load_weight: unknown key; did you mean 'load_weights'? ('load_weights' is a keyword of "
                       "kvload.load(), not of kvload.plan())")
    # the call's own keywords and the fields are taken as before
    assert kvload.plan("tiny-llama", log=False, config_file=None, max_batch_size=8).args.max_batch_size == 8


def test_a_keyword_of_a_public_call_given_to_simulate_is_named_as_that_calls():
    """``engine.simulator.simulate(..., load_weights=True)`` answered with the list of LlmArgs fields: the engine
    layer cannot import kvload, so the calls' keywords live in pipeline (PUBLIC_CALL_KEYWORDS), held to their
    signatures here."""
    import kvload
    from engine.simulator import simulate
    from kvload.llm import LLM
    from pipeline.context import PUBLIC_CALL_KEYWORDS, keywords_of

    calls = {"kvload.plan()": kvload.plan, "kvload.load()": kvload.load, "kvload.LLM()": LLM.__init__}
    assert {name: keywords_of(call) for name, call in calls.items()} == dict(PUBLIC_CALL_KEYWORDS)
    refusal = _refusal(lambda: simulate("tiny-llama", "no-reuse", log=False, load_weights=True))
    assert refusal == ("load_weights: unknown key; 'load_weights' is a keyword of kvload.load(), not of "
                       "engine.simulator.simulate()")
    refusal = _refusal(lambda: simulate("tiny-llama", "no-reuse", log=False, stages=()))
    assert refusal == ("stages: unknown key; 'stages' is a keyword of kvload.plan() and kvload.load(), not of "
                       "engine.simulator.simulate()")
