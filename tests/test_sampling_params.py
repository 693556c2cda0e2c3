"""``SamplingParams``: vLLM/TensorRT-LLM field names, the ``max_new_tokens`` alias, one-line errors naming the field."""

from __future__ import annotations

import subprocess
import sys

import attrs
import pytest

from engine.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams
from pipeline.errors import GenerationError
from pipeline.limits import MAX_LOGPROBS, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS


def test_defaults_match_the_cli_and_the_alias_reads_and_writes_max_tokens():
    from kvload.cli.commands import build_parser

    ns = build_parser().parse_args(["generate", "tiny-llama", "--prompt-ids", "1"])
    # the flag left out is unset: the model's max_new_tokens (generation_config.json) applies, else the API's default
    assert ns.max_new_tokens is None and SamplingParams().max_tokens == DEFAULT_MAX_TOKENS
    p = SamplingParams(max_new_tokens=7)
    assert p.max_tokens == p.max_new_tokens == 7 and p == SamplingParams(max_tokens=7)
    assert SamplingParams.build(None, {"max_new_tokens": 3}).max_tokens == 3
    assert attrs.evolve(p, n=2).max_tokens == 7  # evolve goes through the same constructor


def test_stop_and_stop_token_ids_take_one_or_many():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=["a", "bc"], stop_token_ids=[2, 7]).to_dict()["stop_token_ids"] == [2, 7]
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_tokens": 0}, "max_tokens: expected an integer >= 1, got 0"),
    ({"max_new_tokens": 0}, "max_new_tokens: expected an integer >= 1, got 0"),
    ({"max_tokens": 3, "max_new_tokens": 4}, "max_tokens=3 and max_new_tokens=4: they are one setting"),
    ({"temperature": -1}, r"temperature: expected a finite number >= 0 \(0 = greedy\), got -1"),
    ({"top_p": 1.5}, r"top_p: expected a number in \(0, 1\], got 1.5"),
    ({"top_k": -2}, "top_k: expected an integer >= 1, or 0 / -1 for all tokens, got -2"),
    ({"top_k": 2.5}, "top_k: expected an integer"),
    ({"seed": -2}, r"seed: expected an integer in \[0, 2\*\*63 - 1\] or None, got -2"),
    ({"stop": ""}, "stop: expected a non-empty string or a list of them"),
    ({"stop": 5}, "stop: expected a non-empty string or a list of them, got 5"),
    # decoded text is valid Unicode, so a stop string with a lone surrogate could never match: a silent no-op
    ({"stop": ["ok", "x\ud800"]}, r"stop\[1\]: not valid Unicode text \(a lone surrogate at character 1"),
    ({"stop_token_ids": [1, -3]}, r"stop_token_ids: expected a list of token ids \(integers >= 0\)"),
    ({"n": 0}, r"n: expected an integer in \[1, 128\], got 0"),
    ({"n": 100_000}, r"n: expected an integer in \[1, 128\], got 100000"),  # refused before a request is built
    ({"logprobs": -1}, r"logprobs: expected an integer in \[0, 20\] \(top tokens to report per generated token\), "
                       "got -1"),
    ({"ignore_eos": "yes"}, "ignore_eos: expected true or false, got 'yes'"),
])
def test_bad_values_are_one_line_naming_the_field(kwargs, message):
    with pytest.raises(GenerationError, match=message) as info:
        SamplingParams(**kwargs)
    assert "\n" not in str(info.value)


def test_unknown_keyword_names_the_known_fields():
    with pytest.raises(GenerationError, match="unknown argument 'top_q'; sampling fields are .*max_tokens.*top_k"):
        SamplingParams.build(None, {"top_q": 2})


def test_the_front_door_names_load_lazily_without_torch():
    code = ("import sys, kvload; kvload.SamplingParams; kvload.RequestOutput; kvload.TokenDelta; "
            "kvload.CompletionOutput; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert callable(kvload.LLM)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- sizes: one bound per field, shared with kvload serve ------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"stop": ["s"] * (MAX_STOP + 1)}, rf"stop: expected at most {MAX_STOP} strings, got a list of {MAX_STOP + 1}"),
    ({"stop": ["ok", "x" * (MAX_STOP_CHARS + 1)]},
     rf"stop\[1\]: expected a string of at most {MAX_STOP_CHARS:,} characters, got {MAX_STOP_CHARS + 1:,}"),
    ({"stop_token_ids": [2] * (MAX_STOP_TOKEN_IDS + 1)},
     rf"stop_token_ids: expected at most {MAX_STOP_TOKEN_IDS:,} token ids, got a list of {MAX_STOP_TOKEN_IDS + 1:,}"),
    # counted before it is copied: a ten-million-id range is never turned into a tuple
    ({"stop_token_ids": range(10**7)}, "stop_token_ids: expected at most .* token ids, got a list of 10,000,000"),
    ({"logprobs": MAX_LOGPROBS + 1},
     rf"logprobs: expected an integer in \[0, {MAX_LOGPROBS}\] \(top tokens to report per generated token\), "
     rf"got {MAX_LOGPROBS + 1}"),
    # a value too big to print (int() refuses past 4,300 digits) or too long to quote still names its field
    ({"seed": 10**5000}, r"seed: expected an integer in \[0, 2\*\*63 - 1\] or None, got an integer of about "
                         r"5001 digits"),
    ({"max_tokens": -10**5000}, r"max_tokens: expected an integer >= 1, got an integer of about 5001 digits"),
    ({"n": 10**5000}, r"n: expected an integer in \[1, 128\], got an integer of about 5001 digits"),
    # past int64 (what torch and the KV budget take): refused by the field, as seed is
    ({"max_tokens": 2**63}, r"max_tokens: expected at most 2\*\*63 - 1, got 9223372036854775808"),
    ({"top_k": 10**5000}, r"top_k: expected at most 2\*\*63 - 1, got an integer of about 5001 digits"),
    # an id past int64 is no token id: refused here, as logit_bias and allowed_token_ids refuse one
    ({"stop_token_ids": [1, 2**63]}, r"stop_token_ids: expected token ids of at most 2\*\*63 - 1, got "
                                     r"9223372036854775808"),
    ({"stop_token_ids": [-1] * 1000}, r"stop_token_ids: expected a list of token ids \(integers >= 0\), got a list "
                                      r"of 1,000 items"),
])
def test_sizes_past_the_bound_are_one_short_line_naming_the_field(kwargs, message):
    with pytest.raises(GenerationError, match="^generate: " + message + "$") as info:
        SamplingParams(**kwargs)
    assert "\n" not in str(info.value) and len(str(info.value)) < 200


def test_every_bound_itself_is_accepted():
    p = SamplingParams(stop=["s" * MAX_STOP_CHARS] * MAX_STOP, stop_token_ids=range(MAX_STOP_TOKEN_IDS),
                       logprobs=MAX_LOGPROBS)
    assert len(p.stop) == MAX_STOP and len(p.stop_token_ids) == MAX_STOP_TOKEN_IDS and p.logprobs == MAX_LOGPROBS


def test_numpy_scalars_are_taken_as_the_python_numbers_they_hold():
    import json

    import numpy as np

    p = SamplingParams(stop_token_ids=[np.int64(2), np.uint16(7)], temperature=np.float32(0.5), top_p=np.float16(0.5),
                       n=np.int32(2), top_k=np.int8(3), seed=np.uint64(4), logprobs=np.int64(1))
    assert p.stop_token_ids == [2, 7] and p.temperature == 0.5 and p.top_p == 0.5
    assert {type(v) for v in (*p.stop_token_ids, p.n, p.top_k, p.seed, p.logprobs)} == {int}
    assert type(p.temperature) is float and type(p.top_p) is float
    json.dumps(p.to_dict())  # plain Python values: it serializes
    assert SamplingParams(temperature=np.int64(1)).temperature == 1.0
    for bad, message in [({"stop_token_ids": [np.bool_(True)]}, "stop_token_ids: expected a list of token ids"),
                         ({"temperature": np.bool_(True)}, "temperature: expected a finite number"),
                         ({"top_p": np.float32("nan")}, r"top_p: expected a number in \(0, 1\]"),
                         ({"temperature": np.float64("inf")}, "temperature: expected a finite number")]:
        with pytest.raises(GenerationError, match=message):
            SamplingParams(**bad)
