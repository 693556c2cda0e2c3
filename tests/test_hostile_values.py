"""The hostile values sweep69 added to ``scripts/api_sweep.py`` at the doors it found unguarded: a list nesting itself
40 deep (an alias bomb: a few hundred bytes, 2**40 items written out), a numpy array where a scalar is wanted, a
``str`` / ``int`` subclass whose own methods raise, an int past Python's 4,300 digits and junk of every type given to
``engine.simulator.simulate``'s own keywords. Each is refused in one line naming the argument, before any work."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import kvload
from engine.simulator import simulate
from kvload import PoolingParams, SamplingParams
from pipeline.config import LlmArgs
from pipeline.errors import ConfigError, GenerationError
from pipeline.limits import short
from tests.cli_support import ENV, REPO


class _Raises(Exception):
    pass


def _raise(self, *args):
    raise _Raises("the user's own method")


#: What a check may call on a value: each raises.
_METHODS = {name: _raise for name in ("__repr__", "__str__", "__eq__", "__ne__", "__hash__", "__bool__", "__len__",
                                      "__format__", "__lt__", "__le__", "__gt__", "__ge__")}
EvilStr = type("EvilStr", (str,), dict(_METHODS))
EvilInt = type("EvilInt", (int,), dict(_METHODS))


def test_sampling_params_refuses_an_alias_bomb_in_one_line_instead_of_writing_it_out():
    # in a subprocess: on the old code the refusal's repr of 2**40 items never returned (C code, holding the GIL)
    script = """
import kvload
from kvload import PoolingParams, SamplingParams
bomb = []
for _ in range(40):
    bomb = [bomb, bomb]
for field in ("max_tokens", "temperature", "stop", "stop_token_ids", "seed", "output_kind"):
    try:
        SamplingParams(**{field: bomb})
    except ValueError as e:
        print(e)
try:
    SamplingParams(logit_bias={1: bomb})
except ValueError as e:
    print(e)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env={**ENV, "PYTHONPATH": str(REPO)})
    lines = r.stdout.splitlines()
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(lines) == 7, r.stdout
    for field, line in zip(("max_tokens", "temperature", "stop", "stop_token_ids", "seed", "output_kind",
                            "logit_bias"), lines, strict=True):
        assert line.startswith(f"generate: {field}: ") and len(line) < 400, line


def test_output_kind_given_a_numpy_array_is_refused_naming_output_kind():
    # the array's elementwise == reached `and`: "The truth value of an array ... is ambiguous", naming no field
    with pytest.raises(GenerationError, match=r"^generate: output_kind: "):
        SamplingParams(output_kind=np.zeros(10))


@pytest.mark.parametrize("field", ["max_seq_len", "attention_backend", "linear_backend", "scheduling_policy"])
@pytest.mark.parametrize("value", [np.zeros(10), EvilStr("auto")], ids=["numpy_array", "raising_str"])
def test_an_llm_args_field_given_a_value_whose_comparison_raises_is_refused_naming_the_field(field, value):
    # was "LlmArgs: The truth value of an array with more than one element is ambiguous" (no field) or the user's
    # own exception out of the validator
    with pytest.raises(ConfigError, match=rf"^{field}: expected "):
        LlmArgs(model="tiny-llama", **{field: value})


def test_short_describes_values_whose_own_repr_or_str_raises():
    assert short(EvilStr("x")) == "a EvilStr whose repr raised _Raises"
    assert short(EvilInt(7)) == "7"  # int's own digits, not the subclass's __str__


SIMULATE_CASES = [
    ("workload", 10 ** 5000), ("workload", [1]), ("requests", "2"), ("requests", 2.5),
    ("seed", None), ("params", [1, 2]), ("params", {1: 2}), ("compare", np.zeros(3)), ("compare", "yes"),
    ("config_file", 5), ("audit_log", [1]), ("audit_log", ""), ("source", 5), ("progress", "no"),
    ("subscribers", 5), ("hardware", [1]), ("hardware", 10 ** 5000),
]


@pytest.mark.parametrize(("keyword", "value"), SIMULATE_CASES,
                         ids=[f"{k}-{i}" for i, (k, _) in enumerate(SIMULATE_CASES)])  # str() of 10**5000 raises
def test_simulate_refuses_each_of_its_own_keywords_by_name_before_any_work(keyword, value):
    # each was a bare TypeError or ValueError naming nothing ("unhashable type: 'list'", "argument after ** must be a
    # mapping", "Exceeds the limit (4300 digits)", pathlib's "expected str, bytes or os.PathLike object")
    args = {"model": "tiny-llama", "workload": "no-reuse", "requests": 2, "log": False, keyword: value}
    with pytest.raises(ConfigError, match=rf"^{keyword}: ") as info:
        simulate(args.pop("model"), args.pop("workload"), **args)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_a_pooling_cut_past_int64_is_refused_by_name_before_the_tokenizer_takes_it():
    # a cross-encoder's score passed 10**5000 to the tokenizer: a bare "OverflowError: int too big to convert"
    with pytest.raises(GenerationError, match=r"truncate_prompt_tokens: expected at most 2\*\*63 - 1, got an integer "
                                              r"of about 5001 digits$"):
        PoolingParams(truncate_prompt_tokens=10 ** 5000)


@pytest.mark.parametrize("stages", [5, (s for s in ()), "parse_args", {"a": 1}],
                         ids=["int", "generator", "str", "dict"])
def test_plan_refuses_stages_that_are_no_list_naming_stages(stages):
    # an int was "'int' object is not iterable", a generator "zip() argument 2 is longer than argument 1"
    with pytest.raises(TypeError, match=r"^stages: expected a list of stage objects"):
        kvload.plan("tiny-llama", stages=stages, log=False, kv_cache_config={"max_tokens": 256})


def test_plan_given_a_numpy_array_for_stages_names_stages():
    # its truth was asked first: "The truth value of an array with more than one element is ambiguous"
    with pytest.raises(TypeError, match=r"^stages: expected a list of stage objects"):
        kvload.plan("tiny-llama", stages=np.zeros(3), log=False, kv_cache_config={"max_tokens": 256})


@pytest.mark.parametrize("keyword", ["max_model_len", "quantization"])
def test_a_vllm_keyword_given_a_numpy_array_is_refused_naming_it(keyword):
    # its elementwise == with vLLM's sentinel reached `and`: "parse_args: ValueError: The truth value of an array..."
    with pytest.raises(ConfigError, match=rf"^{keyword}: "):
        kvload.plan("tiny-llama", log=False, kv_cache_config={"max_tokens": 256}, **{keyword: np.zeros(10)})


def test_a_format_or_parser_name_given_as_an_array_and_a_huge_request_count_are_refused_naming_them():
    """Left by sweep69: ``chat_template_content_format`` and a grammar's ``reasoning_parser`` given a numpy array
    said "The truth value of an array ... is ambiguous" (``x not in NAMES`` compared it element by element), and
    ``make_workload(requests=10**5000)`` raised Python's 4,300-digit error writing the count."""
    import numpy as np

    from engine.prompts import template_options
    from engine.structured_params import StructuredOutputsParams
    from engine.workloads import make_workload
    from pipeline.errors import GenerationError

    with pytest.raises(GenerationError, match=r"^chat: chat_template_content_format: expected one of .*, got array"):
        template_options(chat_template_content_format=np.zeros(3))
    with pytest.raises(GenerationError, match=r"structured_outputs\.reasoning_parser: expected one of .* got ndarray"):
        StructuredOutputsParams(json={}, reasoning_parser=np.zeros(3))
    with pytest.raises(ValueError, match=r"^workload mixed: requests=an integer of about 5001 digits is more than "):
        make_workload("mixed", 10**5000, 0)


def test_chat_template_kwargs_holding_one_list_many_times_are_walked_once():
    """``LLM.chat(chat_template_kwargs=...)`` and ``kvload serve``'s ``default_chat_template_kwargs`` look for a lone
    surrogate in every string of the variables: a list holding itself twice at each of 40 levels (a few hundred bytes)
    was 2**40 leaves walked, so the call never returned (sweep69 found it through build_state). Each container is
    walked once now; what it finds is unchanged."""
    import signal

    from engine.prompts import non_json_in, surrogate_in, template_options

    bomb: list = []
    for _ in range(40):
        bomb = [bomb, bomb]

    def hung(*_):
        raise AssertionError("the walk did not return in 60 s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        assert template_options(chat_template_kwargs={"x": bomb})["x"] is bomb
        assert surrogate_in([bomb, ["ok", "\ud800"]], "w") == ("w[1][1]", "\ud800")
        assert non_json_in({"a": [bomb, b"x"]}, "tools") == ("tools.a[1]", b"x")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    shared = (1, 2)  # a tuple met as a value first, then as a key: a key is judged whole (JSON has no tuple key)
    assert non_json_in({"a": shared, shared: 1}, "k") == ("k", shared)
