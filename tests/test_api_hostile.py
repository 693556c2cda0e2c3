"""Hostile values given to ``kvload.LLM``'s calls (found by ``scripts/api_sweep.py``): one ValueError naming the
argument the user gave, before any work, and the same LLM generates the same tokens afterwards."""

from __future__ import annotations

import math
import os
import re

import pytest

import kvload
from kvload import PoolingParams, SamplingParams
from tests.llm_support import llm_kwargs, with_tokenizer

VOCAB = 512
IDS = [5, 17, 300, 42, 9]


@pytest.fixture(scope="module")
def llm(tiny_checkpoints, tmp_path_factory):
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path_factory.mktemp("words") / "ckpt", VOCAB)
    with kvload.LLM(str(words), max_beam_width=2, **llm_kwargs()) as loaded:
        yield loaded


def tokens(llm) -> list[int]:
    return list(llm.generate(IDS, SamplingParams(max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids)


def test_a_list_of_pooling_params_of_the_wrong_length_is_named_pooling_params(llm):
    before = tokens(llm)
    for given in ([PoolingParams()], [PoolingParams()] * 3, []):
        with pytest.raises(ValueError, match=r"^embed: pooling_params: expected one PoolingParams or a list of 2 "
                                             rf"\(one per prompt\), got a list of {len(given)}$"):
            llm.embed([IDS, [1, 2]], pooling_params=given)
    with pytest.raises(ValueError, match=r"^score: pooling_params: expected one PoolingParams or a list of 2"):
        llm.score("w1", "w2", pooling_params=[PoolingParams()])
    assert len(llm.embed([IDS, [1, 2]], pooling_params=[PoolingParams(), PoolingParams(normalize=False)])) == 2
    assert tokens(llm) == before


@pytest.mark.parametrize("text", ["", "abc", b"x"])
def test_a_text_as_pooling_params_is_refused_as_not_a_pooling_params(llm, text):
    # a str is a Sequence: it was taken as a list of one PoolingParams per letter ("" as an empty list)
    with pytest.raises(ValueError, match=rf"^embed: pooling_params: expected a kvload.PoolingParams, got "
                                         rf"{type(text).__name__}$"):
        llm.embed([IDS], pooling_params=text)


JUNK = {"text": "yes", "float": 0.5, "nan": math.nan, "dict": {"a": 1}, "list": [1], "bytes": b"1", "two": 2}


@pytest.mark.parametrize("kind", sorted(JUNK))
def test_use_tqdm_that_is_neither_a_bool_nor_a_factory_is_refused_by_every_call(llm, kind):
    value = JUNK[kind]
    before = tokens(llm)
    calls = {"generate": lambda: llm.generate(IDS, SamplingParams(max_tokens=2), use_tqdm=value),
             "chat": lambda: llm.chat([{"role": "user", "content": "w1"}], SamplingParams(max_tokens=2),
                                      use_tqdm=value, chat_template="{{ messages[0]['content'] }}"),
             "embed": lambda: llm.embed([IDS], use_tqdm=value),
             "score": lambda: llm.score("w1", "w2", use_tqdm=value),
             "beam_search": lambda: llm.beam_search([IDS], kvload.BeamSearchParams(beam_width=2, max_tokens=2),
                                                    use_tqdm=value)}
    for call, run in calls.items():
        with pytest.raises(ValueError, match=rf"^{call}: use_tqdm: expected true, false or a tqdm factory"):
            run()
    assert tokens(llm) == before
    np = pytest.importorskip("numpy")
    for taken in (None, False, True, 0, 1, np.bool_(True), lambda *a, **k: None):  # vLLM's: a bool or a factory
        assert llm.generate(IDS, SamplingParams(max_tokens=2), use_tqdm=taken)



@pytest.mark.parametrize("penalty", [2 ** 63, 1e300, -2 ** 63, -1e300])
def test_a_finite_length_penalty_past_a_floats_range_ranks_instead_of_raising_after_the_search(llm, penalty):
    # BeamSearchParams takes any finite number; length ** penalty overflowed (OverflowError) or underflowed to 0
    # (ZeroDivisionError) once every beam was computed, and the search was thrown away
    before = tokens(llm)
    out = llm.beam_search([IDS], kvload.BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True,
                                                         length_penalty=penalty))
    sequences = out[0].sequences
    assert len(sequences) == 2 and all(len(s.token_ids) == 3 for s in sequences)
    limit = -0.0 if penalty > 0 else -math.inf  # cum / length ** penalty's limit for a negative cum
    assert all(s.cumulative_logprob < 0 and s.score == limit for s in sequences)
    assert tokens(llm) == before


def test_a_mistyped_keyword_is_named_with_the_field_it_is_close_to(llm):
    cases = {"generate: unknown SamplingParams field 'temprature'; fields are .*; did you mean 'temperature'\\?":
             lambda: SamplingParams(temprature=0.5),
             "generate: unknown argument 'max_tokns'; sampling fields are .*; did you mean 'max_tokens'\\?":
             lambda: llm.generate(IDS, max_tokns=3),
             "chat: unknown argument 'stop_token_id'; sampling fields are .*; did you mean 'stop_token_ids'\\?":
             lambda: llm.chat([{"role": "user", "content": "w1"}], stop_token_id=[2],
                              chat_template="{{ messages[0]['content'] }}"),
             "generate_stream: unknown argument 'top_pp'; sampling fields are .*; did you mean 'top_p'\\?":
             lambda: llm.generate_stream(IDS, top_pp=0.5),
             "generate: structured_outputs: unknown field 'jsn'; fields are .*; did you mean 'json'\\?":
             lambda: kvload.StructuredOutputsParams(jsn={}),
             # it read "missing 1 required keyword-only argument: 'beam_width'", not naming the misspelt word
             "generate: unknown BeamSearchParams field 'beam_widht'; fields are .*; did you mean 'beam_width'\\?":
             lambda: kvload.BeamSearchParams(beam_widht=2)}
    for message, make in cases.items():
        with pytest.raises(ValueError) as caught:
            make()
        assert re.fullmatch(message, str(caught.value)), str(caught.value)
    with pytest.raises(ValueError, match=r"^generate: beam_width: required"):
        kvload.BeamSearchParams(max_tokens=2)
    # a name close to none says no guess
    with pytest.raises(ValueError, match=r"^generate: unknown SamplingParams field 'zzz'; fields are [a-z_, ]+$"):
        SamplingParams(zzz=1)


PATHS = [("audit_log", "\ud800.jsonl", "not a path the file system can hold (a lone surrogate at character 0)"),
         ("config_file", "a\ud800b.yaml", "not a path the file system can hold (a lone surrogate at character 1)"),
         ("audit_log", "a\x00b.jsonl", "a path cannot hold a NUL character (at character 1)"),
         ("config_file", "a\x00b.yaml", "a path cannot hold a NUL character (at character 1)")]


def test_a_path_argument_no_file_system_can_hold_is_one_config_error_naming_it(tiny_checkpoints, tmp_path):
    # they escaped as a bare UnicodeEncodeError / "embedded null byte" ValueError, or "parse_args: UnicodeEncodeError"
    for name, path, said in PATHS:
        with pytest.raises(ValueError, match=rf"^{name}: {re.escape(said)}, got "):
            kvload.LLM("tiny-llama", log=False, kv_cache_config={"max_tokens": 256}, **{name: path})
    # os.listdir's name for a Latin-1 file (surrogateescape) encodes back to its bytes: a path, written there
    log = tmp_path / os.fsdecode(b"audit-\xe9.jsonl")
    with kvload.LLM(str(tiny_checkpoints("llama")), audit_log=log, **llm_kwargs()) as loaded:
        loaded.generate(IDS, SamplingParams(max_tokens=2))
    assert os.listdir(os.fsencode(tmp_path)) == [b"audit-\xe9.jsonl"]
