"""Hostile values given to ``kvload.LLM``'s calls (found by ``scripts/api_sweep.py``): one ValueError naming the
argument the user gave, before any work, and the same LLM generates the same tokens afterwards."""

from __future__ import annotations

import math
import os
import re

import hypothesis
import pytest
from hypothesis import strategies as st

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
    assert len(llm.embed([IDS, [1, 2]], pooling_params=[PoolingParams(), PoolingParams(use_activation=False)])) == 2
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


def test_every_public_calls_mistyped_keyword_is_one_line_with_the_name_it_is_close_to(llm):
    # each read Python's "got an unexpected keyword argument", naming no close name; a call's own argument (priority,
    # chat_template) mistyped was offered only the sampling fields
    before = tokens(llm)
    msgs = [{"role": "user", "content": "w1"}]
    cases = {
        "PoolingParams: unknown field 'use_activaton'; fields are dimensions, truncate_prompt_tokens, "
        "use_activation; did you mean 'use_activation'\\?": lambda: PoolingParams(use_activaton=False),
        "embed: unknown argument 'pooling_param'; arguments are prompts, pooling_params, .*; did you mean "
        "'pooling_params'\\?": lambda: llm.embed([IDS], pooling_param=PoolingParams()),
        "score: unknown argument 'truncate_prompt_token'; arguments are .*; did you mean 'truncate_prompt_tokens'\\?":
        lambda: llm.score("w1", "w2", truncate_prompt_token=2),
        "beam_search: unknown argument 'concurency_limit'; arguments are .*; did you mean 'concurrency_limit'\\?":
        lambda: llm.beam_search([IDS], kvload.BeamSearchParams(beam_width=2), concurency_limit=1),
        "get_metrics: unknown argument 'metric_name_prefix'; arguments are metrics_name_prefix; did you mean "
        "'metrics_name_prefix'\\?": lambda: llm.get_metrics(metric_name_prefix="vllm"),
        "generate: unknown argument 'prioriy'; sampling fields are .*; the call's own arguments are prompts, .*; did "
        "you mean 'priority'\\?": lambda: llm.generate(IDS, prioriy=[0], max_tokens=2),
        "chat: unknown argument 'chat_templte'; sampling fields are .*; the call's own arguments are messages, .*; "
        "did you mean 'chat_template'\\?":
        lambda: llm.chat(msgs, chat_templte="{{ 1 }}"),
        "generate_stream: unknown argument 'salts'; sampling fields are .*; the call's own arguments are .*; did you "
        "mean 'salt'\\?":
        lambda: llm.generate_stream(IDS, salts="a"),
        "score: data_1: given by position \\(score\\(data_1, data_2, ...\\)\\), not as a keyword":
        lambda: llm.score(data_1="w1", data_2="w2"),
    }
    for message, make in cases.items():
        with pytest.raises(ValueError) as caught:
            make()
        assert re.fullmatch(message, str(caught.value)), str(caught.value)
    with pytest.raises(ValueError, match=r"^embed: unknown argument 'zzz'; arguments are [a-z_, ]+$"):
        llm.embed([IDS], zzz=1)  # close to nothing: no guess
    assert tokens(llm) == before
    # what the calls do take still works, by keyword
    assert llm.embed(prompts=[IDS], pooling_params=PoolingParams(use_activation=False), truncate_prompt_tokens=3)
    assert llm.beam_search(prompts=[IDS], params=kvload.BeamSearchParams(beam_width=2, max_tokens=2),
                           concurrency_limit=1)
    assert llm.get_metrics(metrics_name_prefix="vllm")


BAD_IDS = [
    ("abc", "expected a list of token ids \\(ints\\) or a list of such lists, got 'abc'"),  # was taken as a text
    (b"1", "expected a list of token ids \\(ints\\) or a list of such lists, got b'1'"),
    (-1, "expected a list of token ids \\(ints\\) or a list of such lists, got -1"),
    ({"a": 1}, "expected a list of token ids \\(ints\\) or a list of such lists, got "),
    ([], "expected at least one prompt, got an empty list"),
    ([1, 1.5], "expected a list of token ids \\(ints\\), got a list whose item 1 is 1.5$"),
    ([1, VOCAB + 5], f"token id {VOCAB + 5} is outside the vocabulary"),
]


def test_a_bad_prompt_token_ids_is_named_prompt_token_ids_and_good_ones_generate(llm):
    # vLLM's older keyword: its errors read "prompt 0: ..." or "prompts: ...", naming an argument not given
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    for given, said in BAD_IDS:
        with pytest.raises(ValueError, match=rf"^generate: prompt_token_ids: {said}"):
            llm.generate(prompt_token_ids=given, sampling_params=sp)
    with pytest.raises(ValueError, match=rf"^generate: prompt_token_ids\[1\]: token id {VOCAB} is outside"):
        llm.generate(prompt_token_ids=[[1, 2], [3, VOCAB]], sampling_params=sp)
    np = pytest.importorskip("numpy")
    want = [o.outputs[0].token_ids for o in llm.generate([IDS, [1, 2]], sp)]
    for ids, expected in (([IDS, [1, 2]], want), ((tuple(IDS), (1, 2)), want), (np.array([IDS, IDS]), [want[0]] * 2)):
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=sp)]
        assert got == expected, ids
    assert llm.generate(prompt_token_ids=np.array(IDS), sampling_params=sp)[0].outputs[0].token_ids == want[0]


def test_chat_checks_its_sampling_settings_before_the_chat_template(llm):
    # the word tokenizer has no chat template: a mistyped keyword, or a bad value, read "chat needs a chat template"
    msgs = [{"role": "user", "content": "w1"}]
    assert llm.tokenizer.chat_template is None
    with pytest.raises(ValueError, match=r"^chat: unknown argument 'max_tokns'; .*did you mean 'max_tokens'\?$"):
        llm.chat(msgs, max_tokns=3)
    with pytest.raises(ValueError, match=r"^chat: temperature: expected a finite number >= 0"):
        llm.chat(msgs, temperature=-1.0)
    with pytest.raises(ValueError, match=r"^chat: sampling_params\[1\]: expected a SamplingParams, got str$"):
        llm.chat([msgs, msgs], [SamplingParams(max_tokens=2), "x"])
    with pytest.raises(ValueError, match=r"^chat: prompt 0: chat needs a chat template"):
        llm.chat(msgs, max_tokens=3)  # what is right is then judged as before
    # a list of the wrong length is still said against the conversations' count
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    with pytest.raises(ValueError, match=r"^chat: sampling_params: expected one SamplingParams or a list of 2 \(one "
                                         r"per prompt\), got a list of 1$"):
        llm.chat([msgs, msgs], [SamplingParams(max_tokens=2)], chat_template=template)
    outs = llm.chat([msgs, msgs], [SamplingParams(max_tokens=2, ignore_eos=True)] * 2, chat_template=template)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]


@pytest.mark.parametrize("tools, where, got", [
    ([{"a": [None, b"x"]}], "tools[0].a[1]", "b'x'"),
    ([{"type": "function", "function": {"name": "f", "parameters": object}}], "tools[0].function.parameters",
     "<class 'object'>"),
    # json.dumps takes str, int, float, bool and None keys only: a tuple key's items are no excuse
    ([{"type": "function", "function": {"name": "f", "parameters": {(1, 2): "x"}}}], "tools[0].function.parameters",
     "(1, 2)"),
])
def test_chat_refuses_tools_json_cannot_hold_naming_where(llm, tools, where, got):
    """A tool definition holding bytes or an object was accepted by a template that does not read ``tools`` (and
    failed inside one that renders them with ``tojson``): refused before any work, naming where it lies."""
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # reads no tools
    msgs = [{"role": "user", "content": "w1"}]
    with pytest.raises(ValueError) as info:
        llm.chat(msgs, tools=tools, chat_template=template, max_tokens=2)
    assert str(info.value) == (f"chat: {where}: expected JSON values (a tool definition is an object such as "
                               "{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}), got " + got)
    fine = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": 1.5, "y": None}}}]
    assert len(llm.chat(msgs, tools=fine, chat_template=template, max_tokens=2)[0].outputs[0].token_ids) >= 1


# --- numbers from numpy and torch: one verdict whichever call takes them (hunt65a) -------------------------------


def test_a_numpy_or_torch_truncate_prompt_tokens_is_taken_by_the_pooling_calls_as_generate_takes_it(llm):
    # SamplingParams(truncate_prompt_tokens=np.int64(3)) was taken while PoolingParams, LLM.embed / encode / score and
    # a pooling call's tokenization_kwargs refused the same value ("expected a positive integer ..., got np.int64(3)")
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    before = tokens(llm)
    cut = llm.embed([IDS], truncate_prompt_tokens=3)[0].outputs.embedding
    assert cut != llm.embed([IDS])[0].outputs.embedding  # the cut acts: the comparison below means something
    for value in (np.int64(3), np.int32(3), torch.tensor(3)):
        params = PoolingParams(truncate_prompt_tokens=value)
        assert type(params.truncate_prompt_tokens) is int and params.truncate_prompt_tokens == 3
        assert llm.embed([IDS], pooling_params=params)[0].outputs.embedding == cut
        assert llm.embed([IDS], truncate_prompt_tokens=value)[0].outputs.embedding == cut
        assert llm.embed([IDS], tokenization_kwargs={"truncate_prompt_tokens": value})[0].outputs.embedding == cut
        assert llm.encode([IDS], pooling_task="embed", truncate_prompt_tokens=value)
        assert llm.score("w1 w2 w3 w4", "w5", truncate_prompt_tokens=value)
        assert SamplingParams(truncate_prompt_tokens=value).truncate_prompt_tokens == 3  # the other door, as before
    for refused in (np.True_, np.float64(3.0), torch.tensor(3.0), torch.tensor([3])):  # still no int: both say so
        with pytest.raises(ValueError, match=r"^PoolingParams: truncate_prompt_tokens: expected a positive integer"):
            PoolingParams(truncate_prompt_tokens=refused)
        with pytest.raises(ValueError, match=r"^generate: truncate_prompt_tokens: expected an integer >= 1"):
            SamplingParams(truncate_prompt_tokens=refused)
    assert tokens(llm) == before


def test_stop_token_ids_and_allowed_token_ids_take_a_1d_integer_array_as_a_prompts_ids_do(llm):
    # vLLM's SamplingParams takes list(stop_token_ids); kvload took a prompt's ids as an np.array or a tensor but
    # refused the same array as stop_token_ids or allowed_token_ids ("expected a list of token ids, got array([3, 4])")
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    before = tokens(llm)
    stop = before[2]
    want = llm.generate(IDS, SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=[stop]))[0].outputs[0]
    only = llm.generate(IDS, SamplingParams(max_tokens=3, allowed_token_ids=[7, 8]))[0].outputs[0].token_ids
    for array in (np.array([stop]), np.array([stop], dtype=np.int32), torch.tensor([stop])):
        params = SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=array)
        assert params.stop_token_ids == [stop] and all(type(t) is int for t in params.stop_token_ids)
        got = llm.generate(IDS, params)[0].outputs[0]
        assert (got.token_ids, got.finish_reason, got.stop_reason) == (want.token_ids, "stop", stop)
    for array in (np.array([7, 8]), torch.tensor([7, 8])):
        params = SamplingParams(max_tokens=3, allowed_token_ids=array)
        assert params.allowed_token_ids == [7, 8] and all(type(t) is int for t in params.allowed_token_ids)
        assert llm.generate(IDS, params)[0].outputs[0].token_ids == only
    # what is no list of ids is refused as before, naming the field
    for name in ("stop_token_ids", "allowed_token_ids"):
        for bad in (np.array([3.0]), np.array([[3]]), torch.tensor([True]), np.array([-1])):
            with pytest.raises(ValueError, match=rf"^generate: {name}: expected a (non-empty )?list of token ids"):
                SamplingParams(**{name: bad})
    with pytest.raises(ValueError, match=r"^generate: stop_token_ids: token id 512 is outside the vocabulary"):
        llm.generate(IDS, SamplingParams(max_tokens=2, stop_token_ids=np.array([VOCAB])))
    assert tokens(llm) == before


def test_a_0d_tensor_priority_or_beam_length_penalty_is_a_number_as_a_numpy_scalar_is(llm):
    # numpy's int64 priority and float32 length_penalty were taken, a 0-d torch tensor of the same value refused
    # ("expected an integer ..., got tensor(1)", "expected a finite number, got tensor(0.5000)")
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    before = tokens(llm)
    assert llm.generate(IDS, SamplingParams(max_tokens=2), priority=[torch.tensor(0)])
    said = {}
    for value in (np.int64(1), torch.tensor(1)):  # this llm is fcfs: priority 1 is refused, by one message
        with pytest.raises(ValueError, match=r"^generate: priority\[0\]: got priority 1 but priority scheduling") as e:
            llm.generate(IDS, SamplingParams(max_tokens=2), priority=[value])
        said[type(value).__module__] = str(e.value)
    assert said["numpy"] == said["torch"]
    plain = llm.beam_search([IDS], kvload.BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=0.5))
    for value in (np.float32(0.5), torch.tensor(0.5)):
        params = kvload.BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=value,
                                         temperature=torch.tensor(0.0))
        assert type(params.length_penalty) is float and params.length_penalty == 0.5
        assert llm.beam_search([IDS], params)[0].sequences == plain[0].sequences
    with pytest.raises(ValueError, match=r"^generate: length_penalty: expected a finite number, got"):
        kvload.BeamSearchParams(beam_width=2, length_penalty=torch.tensor(float("nan")))
    assert tokens(llm) == before


def _as(kind: str, value: int):
    """``value`` as a script may hold it: a Python int, a numpy integer or a 0-d torch tensor."""
    if kind == "numpy":
        return pytest.importorskip("numpy").int64(value)
    return pytest.importorskip("torch").tensor(value) if kind == "torch" else value


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(value=st.integers(-(2**63), 2**63 - 1) | st.sampled_from([-2, -1, 0, 1, 2, 64]),
       kind=st.sampled_from(["int", "numpy", "torch"]))
def test_truncate_prompt_tokens_has_one_verdict_in_sampling_and_pooling_params(value, kind):
    # the same integer, however held, is taken by both or refused by both (numpy's and torch's were refused by
    # PoolingParams only); a length past int64 is PoolingParams' call-time refusal, so the integers stop there
    verdicts = []
    for make in (SamplingParams, PoolingParams):
        try:
            verdicts.append(make(truncate_prompt_tokens=_as(kind, value)).truncate_prompt_tokens)
        except ValueError as exc:
            assert "truncate_prompt_tokens: expected " in str(exc)
            verdicts.append("refused")
    assert verdicts[0] == verdicts[1] and verdicts[0] in (value, "refused")
    assert (verdicts[0] == "refused") == (value == 0 or value < -1)


def _alias_bomb(depth: int = 40) -> list:
    """A list holding itself twice at each of ``depth`` levels: 2**depth items when written out (a few hundred bytes
    in memory)."""
    bomb: list = []
    for _ in range(depth):
        bomb = [bomb, bomb]
    return bomb


HUGE = 10**5000  # past Python's 4,300-digit limit for writing an int as text: repr() raises ValueError


def _doors(llm) -> dict:
    """Python-API arguments whose refusal quoted the value whole (``{value!r}``), each a call with that value."""
    from engine.prompts import template_options
    from engine.structured_params import StructuredOutputsParams

    return {
        "log": lambda v: kvload.plan("tiny-llama", log=v),
        "audit_log": lambda v: kvload.plan("tiny-llama", audit_log=v),
        "config_file": lambda v: kvload.plan("tiny-llama", config_file=v),
        "add_generation_prompt": lambda v: template_options(add_generation_prompt=v),
        "chat_template": lambda v: template_options(chat_template=v),
        "chat_template_kwargs": lambda v: template_options(chat_template_kwargs=v),
        "chat_template_content_format": lambda v: template_options(chat_template_content_format=v),
        "json_object": lambda v: StructuredOutputsParams(json_object=v),
        "choice": lambda v: StructuredOutputsParams(choice=v),
        "messages": lambda v: llm.chat(v),
        "content": lambda v: llm.chat([{"role": "user", "content": v}]),
        "prompt 0": lambda v: llm.generate([[1, 2, v]]),
    }


@pytest.mark.parametrize("kind", ["huge int", "alias bomb"])
def test_a_huge_int_or_a_self_nesting_list_is_refused_in_one_short_line_naming_the_argument(llm, kind):
    """Refusals wrote the value with repr: a 5,001-digit int raised Python's own ValueError about
    ``sys.set_int_max_str_digits`` instead of the line naming the argument, and a list nesting itself 40 deep was
    written out item by item (2**40 of them: it never returned). Each is now described (``limits.short``)."""
    import signal

    value = HUGE if kind == "huge int" else _alias_bomb()
    before = tokens(llm)

    def hung(*_):
        raise AssertionError("the refusal did not return in 60 s")

    old = signal.signal(signal.SIGALRM, hung)
    try:
        for name, call in _doors(llm).items():
            signal.alarm(60)
            with pytest.raises(ValueError) as caught:
                call(value)
            signal.alarm(0)
            message = str(caught.value)
            assert name in message and len(message) < 400, message
            assert "set_int_max_str_digits" not in message
            if kind == "huge int" and name != "prompt 0":
                assert "an integer of about 5001 digits" in message, message
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert tokens(llm) == before


def test_a_prompt_of_token_ids_names_its_first_item_that_is_no_token_id(llm):
    with pytest.raises(ValueError, match=r"^generate: prompt 0: expected a string or a list of token ids \(ints\), got "
                                         r"a list whose item 2 is 'w3'$"):
        llm.generate([[1, 2, "w3", 4]])
    with pytest.raises(ValueError, match=r"^generate: prompt 0: 'prompt_token_ids' must be a list of token ids "
                                         r"\(ints\), got a list whose item 1 is 1.5$"):
        llm.generate([{"prompt_token_ids": [1, 1.5]}])


def test_an_ignored_setting_too_large_to_write_is_recorded_as_its_description(tmp_path):
    """vLLM's ignored knobs take any value and the audit records it: a 5,001-digit ``revision`` raised Python's own
    ValueError in the logger (the load failed on a setting it ignores), and a ``compilation_config`` list nesting
    itself 40 deep was written out item by item (2**40: the load never returned, in C code no signal interrupts, so
    the load runs in a process of its own). Both load, the records saying what was given in a few words."""
    import json
    import subprocess
    import sys

    audit = tmp_path / "a.jsonl"
    code = ("import kvload\nbomb = []\nfor _ in range(40):\n    bomb = [bomb, bomb]\n"
            "kvload.plan('tiny-llama', log=False, compilation_config=bomb, revision=10**5000, "
            f"audit_log={str(audit)!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    ignored = {r["field"]: r["value"] for r in records if r["event"] == "setting_ignored"}
    assert ignored["compilation_config"] == "a list of 2 items"
    assert ignored["revision"] == "an integer of about 5001 digits"


def test_max_tokens_and_max_new_tokens_that_differ_are_refused_in_one_short_line():
    """Their refusal wrote both with repr: a 5,001-digit max_tokens raised Python's own ValueError about
    ``sys.set_int_max_str_digits``, and a list nesting itself 40 deep never returned."""
    import signal

    def hung(*_):
        raise AssertionError("the refusal did not return in 60 s")

    old = signal.signal(signal.SIGALRM, hung)
    try:
        for value, shown in ((HUGE, "an integer of about 5001 digits"), (_alias_bomb(), "a list of 2 items")):
            signal.alarm(60)
            with pytest.raises(ValueError) as caught:
                SamplingParams(max_tokens=value, max_new_tokens=5)
            signal.alarm(0)
            assert str(caught.value).startswith(f"generate: max_tokens={shown} and max_new_tokens=5: they are one "
                                                "setting"), caught.value
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    with pytest.raises(ValueError, match=r"^generate: max_tokens=4 and max_new_tokens=5: they are one setting"):
        SamplingParams(max_tokens=4, max_new_tokens=5)
