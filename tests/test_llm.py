"""``kvload.LLM``: RequestOutputs, top-k, stop strings and ids, n samples on one prefill, logprobs, streaming."""

from __future__ import annotations

import json
import os
import re
import signal
from typing import Any

import pytest
import torch

import kvload
from engine.beam_search import BeamSearchParams
from engine.sampling_params import SamplingParams
from kvload.llm import DEFAULT_CPU_MAX_TOKENS
from pipeline.errors import ConfigError, GenerationError, OutputError
from tests.generate_support import hf_greedy, used_blocks
from tests.llm_support import llm_kwargs, with_tokenizer

VOCAB = 512  # the tiny llama's


@pytest.fixture(scope="module")
def words(tiny_checkpoints, tmp_path_factory):
    """The tiny llama checkpoint with a word-level tokenizer (token i is the text "w<i>")."""
    return with_tokenizer(tiny_checkpoints("llama"), tmp_path_factory.mktemp("words") / "ckpt", VOCAB)


@pytest.fixture(scope="module", params=["v1", "v2"])
def llm(request, words):
    with kvload.LLM(str(words), **llm_kwargs(request.param)) as loaded:
        yield loaded


PROMPT = "w5 w17 w300 w42 w9 w88 w123 w7 w64 w256 w11 w3 w400"  # 13 tokens: 3 full 4-token blocks + 1


def greedy(llm, n: int = 12, **kw) -> kvload.CompletionOutput:
    return llm.generate(PROMPT, SamplingParams(max_tokens=n, ignore_eos=True, **kw))[0].outputs[0]


# --- the request output ---------------------------------------------------------------------------


def test_generate_returns_request_outputs_shaped_like_vllm(llm):
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=5, ignore_eos=True))
    assert isinstance(out, kvload.RequestOutput) and out.finished
    assert out.prompt == PROMPT and out.prompt_token_ids == llm.tokenizer(PROMPT)["input_ids"]
    (c,) = out.outputs
    assert c.index == 0 and len(c.token_ids) == 5 and c.finish_reason == "length" and c.stop_reason is None
    assert c.text == " ".join(f"w{t}" for t in c.token_ids)
    assert c.logprobs is None and c.cumulative_logprob is None
    assert out.computed_prompt_tokens + out.reused_prompt_tokens == 13
    assert 0 <= out.timings.first_token_s <= out.timings.total_s
    assert c.token_ids == hf_greedy(llm.result.hf_model, out.prompt_token_ids, 5)  # greedy is transformers' greedy


def test_top_k_1_is_greedy_whatever_the_temperature(llm):
    ref = greedy(llm)
    assert greedy(llm, temperature=1.5, top_k=1, seed=4).token_ids == ref.token_ids
    sampled = greedy(llm, temperature=1.5, seed=4)
    assert sampled.token_ids != ref.token_ids  # the same temperature without top-k does sample


def test_top_k_draws_only_among_the_k_most_likely_tokens(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=3.0, top_k=3, seed=1, ignore_eos=True))[0]
    seq = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.inference_mode():
        logits = llm.result.hf_model(torch.tensor([seq])).logits[0, len(out.prompt_token_ids) - 1:-1]
    top3 = logits.topk(3, dim=-1).indices
    assert all(t in top3[i].tolist() for i, t in enumerate(out.outputs[0].token_ids))


def test_max_tokens_none_generates_up_to_the_context_length_as_in_vllm(llm):
    """vLLM's ``max_tokens=None``: no cap but the context (it gave kvload's default of 64 tokens, silently)."""
    assert SamplingParams().max_tokens == 64 and SamplingParams(max_tokens=None).max_tokens is None
    room = llm.result.executor.max_seq_len - 13  # PROMPT's 13 tokens
    out = llm.generate(PROMPT, SamplingParams(max_tokens=None, ignore_eos=True, min_tokens=3))[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (room, "length")
    assert llm.audit.of("generation_started")[-1]["max_new_tokens"] is None


# --- stopping -------------------------------------------------------------------------------------


def test_a_stop_token_id_ends_with_stop_and_stays_in_token_ids_not_in_text(llm):
    ref = greedy(llm)
    stop = next(t for t in ref.token_ids[2:] if t not in ref.token_ids[:2])
    out = greedy(llm, stop_token_ids=[stop])
    end = ref.token_ids.index(stop) + 1
    assert out.token_ids == ref.token_ids[:end]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == " ".join(f"w{t}" for t in ref.token_ids[:end - 1])


def test_a_stop_string_ends_with_stop_and_is_cut_from_the_text(llm):
    ref = greedy(llm)
    words = ref.text.split(" ")
    stop = f"{words[3]} {words[4][:2]}"  # spans two tokens, ends inside the second
    out = greedy(llm, stop=["never-there", stop])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == ref.text[:ref.text.index(stop)] and stop not in out.text
    assert out.token_ids == ref.token_ids[:5]  # generation ended on the token that completed the stop string


def test_min_tokens_holds_a_stop_string_back_until_the_output_is_long_enough(llm):
    """vLLM's rule: text decoded before min_tokens is never searched; a stop string ending after it still stops."""
    ref = greedy(llm)
    words = ref.text.split(" ")
    early = f"{words[1]} {words[2]}"  # complete at token 3
    assert greedy(llm, stop=[early]).token_ids == ref.token_ids[:3]
    held = greedy(llm, stop=[early], min_tokens=5)
    assert held.finish_reason == "length" and held.token_ids == ref.token_ids  # found only before min_tokens
    late = f"{words[5]} {words[6]}"  # complete at token 7, after min_tokens: it ends the sample
    out = greedy(llm, stop=[early, late], min_tokens=5)
    assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", late, ref.token_ids[:7])


def test_a_stop_string_inside_the_min_tokens_text_stays_unsearched_whatever_else_stop_lists(llm):
    """A stop string the output completed under min_tokens never stops it, a long unrelated one beside it or not
    (each stop string is looked for only where it would end in new text; the longest's reach found the short one)."""
    ref = greedy(llm)
    inside = ref.text.split(" ")[4]  # completed by token 5, inside min_tokens=5, and not generated again
    alone = greedy(llm, stop=[inside], min_tokens=5)
    beside = greedy(llm, stop=[inside, "not in this output at all"], min_tokens=5)
    assert (alone.finish_reason, alone.token_ids) == ("length", ref.token_ids)
    assert (beside.finish_reason, beside.stop_reason, beside.text, beside.token_ids) == \
        ("length", None, ref.text, ref.token_ids)


def test_include_stop_str_in_output_keeps_the_stop_string_and_skip_special_tokens_shows_them(llm):
    ref = greedy(llm)
    words = ref.text.split(" ")
    stop = f"{words[2]} {words[3]}"
    out = greedy(llm, stop=[stop], include_stop_str_in_output=True)
    assert out.stop_reason == stop and out.text == ref.text[:ref.text.index(stop) + len(stop)]
    # token 0 is the tokenizer's unknown token, a special token: nothing in the text unless asked
    forced = greedy(llm, n=3, logit_bias={0: 100})
    assert forced.token_ids == [0, 0, 0] and forced.text == ""
    assert greedy(llm, n=3, logit_bias={0: 100}, skip_special_tokens=False).text == "w0 w0 w0"


def test_include_stop_str_in_output_keeps_the_stop_token_or_eos_that_ended_the_sample_in_the_text(llm):
    """vLLM's rule: the token that ended a sample (a stop token id, or EOS) is decoded into ``.text`` under
    ``include_stop_str_in_output``, as any token is (a special one only with ``skip_special_tokens`` false)."""
    ref = greedy(llm)
    stop = next(t for t in ref.token_ids[2:] if t not in ref.token_ids[:2])
    end = ref.token_ids.index(stop) + 1
    out = greedy(llm, stop_token_ids=[stop], include_stop_str_in_output=True)
    assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", stop, ref.token_ids[:end])
    assert out.text == " ".join(f"w{t}" for t in ref.token_ids[:end])
    executor = llm.result.executor
    saved = executor.eos_token_ids
    executor.eos_token_ids = frozenset({ref.token_ids[3]})
    try:
        kept = llm.generate(PROMPT, SamplingParams(max_tokens=12, include_stop_str_in_output=True))[0].outputs[0]
    finally:
        executor.eos_token_ids = saved
    assert kept.token_ids == ref.token_ids[:4] and kept.text == " ".join(f"w{t}" for t in ref.token_ids[:4])
    assert not any(e["field"] == "generate.include_stop_str_in_output" for e in llm.audit.of("setting_ignored"))


def test_eos_ends_with_stop_and_ignore_eos_runs_to_length(llm):
    ref = greedy(llm)
    eos = ref.token_ids[3]
    executor = llm.result.executor
    saved = executor.eos_token_ids
    executor.eos_token_ids = frozenset({eos})
    try:
        out = llm.generate(PROMPT, SamplingParams(max_tokens=12))[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason is None and out.token_ids[-1] == eos
        assert greedy(llm).finish_reason == "length"  # ignore_eos
    finally:
        executor.eos_token_ids = saved


# --- n samples ------------------------------------------------------------------------------------


def test_n_samples_share_one_prefill_and_are_reproducible_per_seed(llm):
    params = SamplingParams(max_tokens=6, temperature=1.5, n=4, seed=11, ignore_eos=True)
    salt = f"n-{llm.route.kv_manager}"  # a fresh reuse scope: nothing cached before this call
    (out,) = llm.generate(PROMPT, params, salt=salt)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # independent draws
    # the first sample computes the 13 prompt tokens; the others fork its KV (3 full blocks shared, the last copied)
    assert (out.computed_prompt_tokens, out.reused_prompt_tokens) == (13, 3 * 13)
    started, finished = llm.audit.of("generation_started")[-1], llm.audit.of("generation_finished")[-1]
    assert (started["n"], started["requests"], finished["requests"]) == (4, 4, 4)
    assert finished["reused_prompt_tokens"] == out.reused_prompt_tokens
    again = llm.generate(PROMPT, params, salt=salt + "-again")[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    other = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=1.5, n=4, seed=12, ignore_eos=True))[0]
    assert [c.token_ids for c in other.outputs] != [c.token_ids for c in out.outputs]
    assert used_blocks(llm.result) == 0


def test_without_reuse_the_samples_still_share_their_prompt(words):
    # reuse off keeps prompts from sharing KV across requests; a prompt's own samples fork its one prefill
    with kvload.LLM(str(words), **llm_kwargs("v1", enable_block_reuse=False)) as llm:
        out = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=1.0, n=3, seed=0))[0]
        assert (out.computed_prompt_tokens, out.reused_prompt_tokens) == (13, 2 * 13)
        assert llm.result.kv_manager.stats().reuse_hit_tokens == 0  # a fork is no prefix-cache hit


def test_load_result_generate_keeps_one_flat_output_per_prompt_and_refuses_n(llm):
    out = llm.result.generate([[5, 6, 7]], max_new_tokens=3, ignore_eos=True)[0]
    assert out.token_ids and out.finish_reason == "length" and out.index == 0
    with pytest.raises(GenerationError, match=r"n=2: LoadResult\.generate returns one output per prompt"):
        llm.result.generate([[5, 6, 7]], n=2)


# --- logprobs -------------------------------------------------------------------------------------


def test_logprobs_give_the_top_k_and_the_sampled_token_per_generated_token(llm):
    k = 3
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=2.0, seed=5, logprobs=k,
                                              ignore_eos=True))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 8
    seq = out.prompt_token_ids + c.token_ids
    with torch.inference_mode():
        logits = llm.result.hf_model(torch.tensor([seq])).logits[0, len(out.prompt_token_ids) - 1:-1]
    ref = torch.log_softmax(logits.float(), dim=-1)
    for step, (entry, token) in enumerate(zip(c.logprobs, c.token_ids, strict=True)):
        top = set(ref[step].topk(k).indices.tolist())
        assert top <= set(entry) and token in entry and set(entry) <= top | {token}
        for tid, lp in entry.items():
            assert lp == pytest.approx(float(ref[step, tid]), abs=1e-4) and lp <= 0
        assert sum(torch.tensor(list(entry.values())).exp().tolist()) <= 1 + 1e-5
    assert c.cumulative_logprob == pytest.approx(sum(e[t] for e, t in zip(c.logprobs, c.token_ids, strict=True)))


# --- streaming ------------------------------------------------------------------------------------


def test_stream_deltas_concatenate_to_the_final_text_and_tokens(llm):
    ref = greedy(llm)
    stop = ref.text.split(" ")[6]
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop=stop, n=2, temperature=0.0)
    deltas = list(llm.generate_stream([PROMPT, "w1 w2 w3"], params))
    finals = {(d.index, d.sample): d for d in deltas if d.finish_reason is not None}
    outputs = {d.index: d.output for d in deltas if d.output is not None}
    assert set(finals) == {(0, 0), (0, 1), (1, 0), (1, 1)} and set(outputs) == {0, 1}
    for (i, j), last in finals.items():
        mine = [d for d in deltas if (d.index, d.sample) == (i, j)]
        assert mine[-1] is last  # nothing after a sample's last delta
        final = outputs[i].outputs[j]
        assert "".join(d.text for d in mine) == final.text
        assert [t for d in mine for t in d.token_ids] == final.token_ids
    assert outputs[0].outputs[0].text == ref.text[:ref.text.index(stop)]


def test_leaving_a_stream_early_frees_its_blocks_and_the_llm_generates_again(llm):
    stream = llm.generate_stream(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    first = next(stream)
    assert first.token_ids and first.finish_reason is None
    with pytest.raises(GenerationError, match="already generating"):
        llm.generate(PROMPT)
    stream.close()
    assert used_blocks(llm.result) == 0
    assert llm.audit.of("generation_failed")[-1]["error"] == "StreamClosed"
    assert greedy(llm, n=3).token_ids == greedy(llm).token_ids[:3]


def test_stream_errors_surface_in_the_loop(llm):
    with pytest.raises(GenerationError, match=r"prompt 0: token id 9999 is outside the vocabulary"):
        list(llm.generate_stream([[9999]]))
    with pytest.raises(GenerationError, match="top_k: expected"):
        llm.generate_stream(PROMPT, top_k=-5)  # sampling settings are checked at the call


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"top_k": -2}, "generate: top_k: expected"),
    ({"n": 0}, r"generate: n: expected an integer in \[1, 128\]"),
    ({"n": 100_000}, r"generate: n: expected an integer in \[1, 128\], got 100000"),
    ({"logprobs": 10_000}, r"generate: logprobs: expected an integer in \[0, 20\]"),
    ({"stop_token_ids": [600]}, r"generate: stop_token_ids: token id 600 is outside the vocabulary"),
    ({"max_tokens": 0}, "generate: max_tokens: expected an integer >= 1"),
    ({"best_of": 2}, "generate: best_of: vLLM's argument, not kvload's: vLLM's V1 engine dropped it too"),
    ({"salt": "s" * 1025}, r"^generate: salt: expected a string of at most 1,024 characters, got 1,025$"),
    ({"max_tokens": 10**5000}, r"^generate: max_tokens: expected at most 2\*\*63 - 1, got an integer of about 5001"),
    # an id past Python's 4,300-digit str() limit: was a bare ValueError ("Exceeds the limit ... integer string
    # conversion") naming no field, raised while the refusal was worded; past int64, SamplingParams refuses it
    ({"stop_token_ids": [10**5000]}, r"^generate: stop_token_ids: expected token ids of at most 2\*\*63 - 1, got an "
                                     r"integer of about 5001 digits$"),
    ({"logit_bias": {10**5000: 1}}, r"^generate: logit_bias: expected a mapping of token ids \(integers >= 0\) to "
                                    r"numbers in \[-100, 100\], got a mapping of 1 keys$"),
])
def test_bad_sampling_settings_name_the_field_and_nothing_runs(llm, kwargs, message):
    before = len(llm.audit.of("generation_started"))
    with pytest.raises(GenerationError, match=message):
        llm.generate(PROMPT, **kwargs)
    assert len(llm.audit.of("generation_started")) == before


def test_text_that_is_not_valid_unicode_is_refused_before_the_tokenizer(llm):
    with pytest.raises(GenerationError, match=r"^generate: prompt 1: not valid Unicode text \(a lone surrogate at "
                                              r"character 3; text must be UTF-8\)$"):
        llm.generate([PROMPT, "w5 \ud800"], max_tokens=2)
    with pytest.raises(GenerationError, match=r"^chat: prompt 0: messages\[0\]\.content: not valid Unicode text"):
        llm.chat([{"role": "user", "content": "\udfff"}])
    with pytest.raises(GenerationError, match="generate: salt: not valid Unicode text"):
        llm.generate(PROMPT, max_tokens=2, salt="\ud800")


# --- vLLM's front door ----------------------------------------------------------------------------


def test_vllm_prompt_forms_give_what_a_list_of_token_ids_gives(llm):
    import numpy as np

    ids = llm.tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    (ref,) = llm.generate([ids], params)
    forms = [{"prompt_token_ids": ids}, [{"prompt_token_ids": ids}], {"prompt": PROMPT}, [{"prompt": PROMPT}],
             [np.array(ids)], [torch.tensor(ids)], [[np.int64(t) for t in ids]], np.array([ids]),
             [{"prompt_token_ids": torch.tensor(ids)}]]
    for form in forms:
        (out,) = llm.generate(form, params)
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == ref.outputs[0].token_ids, form
    assert llm.generate({"prompt": PROMPT}, params)[0].prompt == PROMPT
    for bad, message in [([torch.tensor([1.0, 2.0])], "prompt 0: expected a string or a list of token ids"),
                         ([{"prompt_token_ids": ids, "multi_modal_data": {}}], "key 'multi_modal_data' is not "
                                                                                "supported"),
                         ([{"prompt": 5}], "'prompt' must be a string"),
                         ([[{"role": "user", "content": "w5"}]], "a conversation .* needs chat=True"),
                         # a huge key is quoted cut
                         ([{"prompt_token_ids": ids, "k" * 10**6: 1}],
                          r"^generate: prompt 0: a prompt dict key 'k{80}' is not supported; give \{'prompt': TEXT\} "
                          r"or \{'prompt_token_ids': \[IDS\]\}")]:
        with pytest.raises(GenerationError, match=message):
            llm.generate(bad, params)


def test_use_tqdm_is_accepted_and_a_progress_bar_is_said_to_be_ignored_once(llm):
    ignored = lambda: [e for e in llm.audit.of("setting_ignored") if e["field"] == "generate.use_tqdm"]  # noqa: E731
    before = len(ignored())
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    assert llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(ignored()) == before  # no bar asked, none drawn: nothing to say
    llm.generate([[1, 2, 3]], params, use_tqdm=True)
    llm.generate([[1, 2, 3]], params, use_tqdm=True)
    assert len(ignored()) == 1 and "no progress bar" in ignored()[0]["reason"]


def test_chat_applies_the_chat_template_to_one_conversation_or_several(llm):
    tok = llm.tokenizer
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}w1{% endif %}")
    try:
        conv = [{"role": "system", "content": "w5 w17"}, {"role": "user", "content": "w300 w42"}]
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        (one,) = llm.chat(conv, params)
        assert one.prompt == "w5 w17 w300 w42 w1" and one.prompt_token_ids == [5, 17, 300, 42, 1]
        assert one.outputs[0].token_ids == llm.generate([[5, 17, 300, 42, 1]], params)[0].outputs[0].token_ids
        both = llm.chat([conv, [{"role": "user", "content": "w9"}]], params, use_tqdm=False)
        assert [o.prompt_token_ids for o in both] == [[5, 17, 300, 42, 1], [9, 1]]
        for bad in ([], "w5", [{"role": "user", "content": "w5"}, "w6"]):
            with pytest.raises(GenerationError, match="chat: messages: expected a conversation"):
                llm.chat(bad)
        with pytest.raises(GenerationError, match=r"^chat: prompt 0: messages\[0\]\.role: expected system, user, "
                                                  r"assistant, developer or tool, got 'robot'$"):
            llm.chat([{"role": "robot", "content": "w5"}])
    finally:
        tok.chat_template = None


def test_chat_takes_vllms_template_options_and_a_chat_text_prompt_reports_the_templated_text(llm):
    tok = llm.tokenizer
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}w1{% endif %}{% if extra %}w2{% endif %}")
    try:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        conv = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w17"}]
        assert llm.chat(conv, params)[0].prompt == "w5 w17 w1"
        # a reply's prefill: the assistant's last message continued, no new turn opened
        (cont,) = llm.chat(conv, params, add_generation_prompt=False, continue_final_message=True)
        assert cont.prompt == "w5 w17" and cont.prompt_token_ids == [5, 17]
        assert llm.chat(conv, params, chat_template_kwargs={"extra": True})[0].prompt == "w5 w17 w1w2"
        own = "{% for m in messages %}{{ m['content'] }}-{% endfor %}"
        assert llm.chat(conv, params, chat_template=own)[0].prompt == "w5-w17-"
        for bad, match in (({"continue_final_message": True}, "continue_final_message: cannot be true"),
                           ({"add_generation_prompt": "no"}, "add_generation_prompt: expected true or false"),
                           ({"chat_template_kwargs": {"tokenize": True}}, "'tokenize' is not a template variable"),
                           ({"chat_template": 3}, "chat_template: expected a Jinja template string")):
            with pytest.raises(GenerationError, match=match):
                llm.chat(conv, params, **bad)
        # generate(text, chat=True): the prompt it reports is the templated text its token ids come from
        (text,) = llm.generate("w5", params, chat=True)
        assert text.prompt == "w5 w1" and text.prompt_token_ids == [5, 1]
    finally:
        tok.chat_template = None


def test_a_lone_surrogate_the_template_would_render_is_named_where_it_was_given(llm):
    """A template variable, a tool or the template itself put it in the prompt text, which tokenizers refused with
    "TypeError: TextEncodeInput must be Union[TextInputSequence, ...]" (the server checks its requests already)."""
    tok = llm.tokenizer
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}{{ extra }}"
                         "{% for t in tools or [] %}{{ t['function']['name'] }}{% endfor %}")
    conv = [{"role": "user", "content": "w5"}]
    try:
        for bad, where, at in (({"chat_template_kwargs": {"extra": "w\ud800"}}, "chat_template_kwargs.extra", 1),
                               ({"tools": [{"type": "function", "function": {"name": "\udfff"}}]},
                                "tools[0].function.name", 0),
                               ({"chat_template": "{{ '\ud800' }}"}, "chat_template", 4)):
            with pytest.raises(GenerationError) as info:
                llm.chat(conv, SamplingParams(max_tokens=1), **bad)
            assert str(info.value) == (f"chat: {where}: not valid Unicode text (a lone surrogate at character {at}; "
                                       "text must be UTF-8)")
        assert llm.chat(conv, SamplingParams(max_tokens=1), chat_template_kwargs={"extra": "w2"})[0].prompt == "w5 w2"
    finally:
        tok.chat_template = None


def test_chat_takes_the_message_forms_the_server_takes_and_a_refusing_template_is_one_error(llm):
    tok = llm.tokenizer
    # Mistral's and Llama 2's templates raise when roles do not alternate
    tok.chat_template = ("{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]"
                         "['role'] %}{{ raise_exception('Conversation roles must alternate user/assistant') }}"
                         "{% endif %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w1{% endif %}")
    try:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        parts = [{"role": "developer", "content": "w5"},  # read as system, as the server does
                 {"role": "user", "content": [{"type": "text", "text": "w17 "}, {"type": "text", "text": "w3"}]},
                 {"role": "assistant", "content": None},  # a turn that only called tools
                 {"role": "user", "content": "w9"}]
        (out,) = llm.chat(parts, params)
        assert out.prompt == "w5 w17 \nw3  w9 w1"  # text parts joined by a newline, as vLLM joins them
        with pytest.raises(GenerationError, match="chat template refused the conversation: Conversation roles must"):
            llm.chat([{"role": "user", "content": "w2"}, {"role": "user", "content": "w3"}], params)
        (again,) = llm.chat([{"role": "user", "content": "w2"}], params)  # the LLM is still usable
        assert again.prompt_token_ids == [2, 1]
    finally:
        tok.chat_template = None


#: A tool-use template's reading of an agent's turns: the calls (arguments as an object: ``| tojson``, and a key of
#: it) and the id a tool's answer carries.
RENDER_CALLS = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
                "{% for c in m.get('tool_calls') or [] %}[{{ c['id'] }} {{ c['function']['name'] }} "
                "{{ c['function']['arguments'] | tojson }} {{ c['function']['arguments']['zone'] }}]{% endfor %}"
                "{% if m.get('tool_call_id') %}<{{ m['tool_call_id'] }}>{% endif %}|{% endfor %}")


def test_chat_takes_an_agents_next_turn_as_the_server_does(llm):
    """The assistant's tool calls sent back (a model_dump()ed openai message: refusal, audio, ... null) and each
    tool's answer reach the template as on the server: arguments parsed from their JSON text (empty: {}). They were
    passed on as JSON strings, so `arguments | tojson` wrote a quoted string and `arguments['zone']` nothing."""
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]
    dumped = {"role": "assistant", "content": None, "refusal": None, "audio": None, "annotations": None,
              "function_call": None, "tool_calls": calls}
    turns = [{"role": "user", "content": "w5"}, dumped, {"role": "tool", "tool_call_id": "call_1", "content": "w7"}]
    (out,) = llm.chat(turns, params, chat_template=RENDER_CALLS, add_generation_prompt=False)
    assert out.prompt == ('user:w5|assistant:[call_1 get_time {"zone": "UTC"} UTC][call_2 get_weather {} ]|'
                          'tool:w7<call_1>|')
    # refused as the server refuses them, naming the same field
    for message, says in [
        ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{zone"}}]},
         "messages[1].tool_calls[0].function.arguments: expected JSON text"),
        ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[NaN]"}}]},
         "messages[1].tool_calls[0].function.arguments: expected JSON text (NaN is not standard JSON"),
        # was "expected JSON text (Exceeds the limit (4300 digits) for integer string conversion: value has 5000
        # digits; use sys.set_int_max_str_digits() t)", cut mid-word
        ({"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": '{"n": [1, ' + "9" * 5000 + "]}"}}]},
         "messages[1].tool_calls[0].function.arguments: n[1]: an integer of 5,000 digits; at most 4,300 digits are "
         "accepted"),
        ({"role": "user", "content": "w5", "tool_call_id": "c"}, "messages[1].tool_call_id: not supported (a tool "
                                                                 "message's)"),
        ({"role": "assistant", "content": "w5", "audio": {"id": "a"}}, "messages[1].audio: not supported"),
        # no list of calls: refused, not read as "no calls" (only [] and null are)
        ({"role": "assistant", "content": "w5", "tool_calls": False}, "messages[1].tool_calls: expected [{"),
        ({"role": "assistant", "content": "w5", "tool_calls": {}}, "messages[1].tool_calls: expected [{"),
    ]:
        with pytest.raises(GenerationError, match=f"^chat: prompt 0: {re.escape(says)}"):
            llm.chat([turns[0], message], params, chat_template=RENDER_CALLS)


#: a loop inside a loop: Jinja's sandbox bounds each range (100,000 items), not their product
RUNAWAY = "{% for a in range(2000) %}{% for b in range(1000) %}{% endfor %}{% endfor %}"


def test_a_chat_template_that_would_run_for_ever_is_stopped_with_one_error(llm, monkeypatch):
    """Two nested ranges ran 10**10 template steps (``generate --chat`` "looped for ever"); a template is now stopped
    past TEMPLATE_MAX_STEPS (deterministic) or TEMPLATE_MAX_SECONDS (a costly step), with one error naming it, the
    LLM still usable and the caller's own tracer (a debugger's, coverage's) put back. 2 million steps here: a
    bounded run that finished (and generated) before."""
    import sys

    import engine.prompts

    tok = llm.tokenizer
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    conv = [{"role": "user", "content": "w5"}]
    tok.chat_template = RUNAWAY + "{% for m in messages %}{{ m['content'] }} {% endfor %}"

    def tracer(frame, event, arg):  # someone else's, left in place; like coverage's, it re-installs itself when called
        if event == "call":
            sys.settrace(tracer)
        return None

    sys.settrace(tracer)
    try:
        with pytest.raises(GenerationError, match=r"^chat: prompt 0: the model's chat template ran more than "
                                                  r"1,000,000 steps without finishing \(a loop inside a loop\?\)"):
            llm.chat(conv, params)
        assert sys.gettrace() is tracer
        with pytest.raises(GenerationError, match="the chat_template given ran more than 1,000,000 steps"):
            llm.chat(conv, params, chat_template=RUNAWAY)
        monkeypatch.setattr(engine.prompts, "TEMPLATE_MAX_SECONDS", 0.0)  # reached at the first clock reading
        with pytest.raises(GenerationError, match=r"^generate: prompt 0: the chat_template given ran longer than "
                                                  r"0 s without finishing"):
            llm.generate("w5", params, chat={"chat_template": "{% for a in range(1000) %}{% endfor %}w5"})
        monkeypatch.undo()
        # a rendering past TEMPLATE_MAX_CHARS (18 million characters here) is refused before it is tokenized: a 1 GB
        # one took a server past 20 GB in the tokenizer
        with pytest.raises(GenerationError, match=r"^chat: prompt 0: the chat_template given wrote 18,000,000 "
                                                  r"characters, more than a prompt holds \(at most 16,777,216\)"):
            llm.chat(conv, params, chat_template="{{ 'w1 ' * 6000000 }}")
        tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}w1"
        (out,) = llm.chat(conv, params)  # the same LLM, a template that ends
        assert out.prompt_token_ids == [5, 1]
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)
        tok.chat_template = None


def test_the_server_answers_a_runaway_chat_template_with_400_naming_whose_it_was(llm):
    httpx = pytest.importorskip("httpx")
    from kvload.serve.server import ServerThread, build_state

    tok = llm.tokenizer
    tok.chat_template = RUNAWAY + "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    conv = [{"role": "user", "content": "w2"}]
    try:
        state = build_state(llm.result, trust_request_chat_template=True)
        with ServerThread(state) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            for extra, param, whose in (({}, "messages", "the model's chat template"),
                                        ({"chat_template": RUNAWAY}, "chat_template", "the chat_template given")):
                r = http.post("/v1/chat/completions", json={"messages": conv, "max_tokens": 2, **extra})
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["param"] == param and err["message"].startswith(f"messages: {whose} ran more than"), err
            r = http.post("/tokenize", json={"messages": conv})  # the same template runs for /tokenize
            assert r.status_code == 400 and "ran more than 1,000,000 steps" in r.json()["error"]["message"], r.text
            ok = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True})
            assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2
    finally:
        tok.chat_template = None


def test_errors_name_the_call_the_user_made(words):
    """chat and beam_search share generate's executor; their errors still name chat and beam_search."""
    llm = kvload.LLM(str(words), **llm_kwargs("v1"))
    try:
        # one check of the template's presence, one wording, for a text prompt (chat=True) and a conversation (it
        # said "chat=True: the tokenizer of ... has no chat template" for the one, "a conversation needs ..." for the
        # other)
        missing = "prompt 0: chat needs a chat template, and the tokenizer of .* has none$"
        with pytest.raises(GenerationError, match=rf"^chat: {missing}"):
            llm.chat([{"role": "user", "content": "w2"}])
        for prompt in ("w2", [[{"role": "user", "content": "w2"}]]):
            with pytest.raises(GenerationError, match=rf"^generate: {missing}"):
                llm.generate(prompt, chat=True)
        with pytest.raises(GenerationError, match=r"^generate: temperature: expected"):
            llm.generate("w2", temperature=-1)
    finally:
        llm.close()
    for call, args in (("chat", ([{"role": "user", "content": "w2"}],)),
                       ("beam_search", (["w2"], BeamSearchParams(beam_width=2, max_tokens=2))),
                       ("generate", ("w2",)), ("generate_stream", ("w2",)), ("get_metrics", ()),
                       ("reset_prefix_cache", ())):  # generate_stream's said "generate: this LLM was closed"
        with pytest.raises(GenerationError, match=rf"^{call}: this LLM was closed"):
            getattr(llm, call)(*args)


@pytest.mark.parametrize("call", ["chat", "generate_stream"])
def test_the_audits_generation_failed_names_the_call_as_the_error_does(words, call):
    """chat and generate_stream raised ``chat: ...`` / ``generate_stream: ...`` (``errors_titled``), but the audit's
    generation_failed kept the shared executor's ``generate: ...``: the record and the error disagreed."""
    armed = [True]

    def close_once_running(record: dict[str, Any]) -> None:  # after generation_started: the call fails mid-way
        if armed[0] and record["event"] == "request_admitted":
            armed[0] = False
            llm.close()

    llm = kvload.LLM(str(words), **llm_kwargs("v1"), subscribers=[close_once_running])
    llm.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}w1"
    run = {"chat": lambda: llm.chat([{"role": "user", "content": "w2"}], max_tokens=4, ignore_eos=True),
           "generate_stream": lambda: list(llm.generate_stream([[1, 2, 3]], max_tokens=4, ignore_eos=True))}[call]
    with pytest.raises(GenerationError) as raised:
        run()
    assert str(raised.value).startswith(f"{call}: the LLM was closed during generation")
    (failed,) = llm.audit.of("generation_failed")
    assert failed["message"] == str(raised.value)


def test_the_server_answers_a_refusing_chat_template_with_400_and_keeps_the_connection(llm):
    httpx = pytest.importorskip("httpx")
    from kvload.serve.server import ServerThread, build_state

    tok = llm.tokenizer
    tok.chat_template = ("{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]"
                         "['role'] %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
                         "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w1{% endif %}")
    try:
        with ServerThread(build_state(llm.result)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            twice = [{"role": "user", "content": "w2"}, {"role": "user", "content": "w3"}]
            for stream in (False, True):
                r = http.post("/v1/chat/completions", json={"messages": twice, "max_tokens": 2, "stream": stream})
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["param"] == "messages" and "Conversation roles must alternate" in err["message"]
            # the same keep-alive connection serves the next request
            ok = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True})
            assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2
    finally:
        tok.chat_template = None


def test_numpy_integers_are_integers_for_sampling_settings(llm):
    np = pytest.importorskip("numpy")
    params = SamplingParams(max_tokens=np.int32(2), n=np.int64(2), temperature=1.0, seed=np.int64(3))
    assert type(params.n) is int and params.n == 2 and type(params.seed) is int
    assert len(llm.generate([PROMPT], params)[0].outputs) == 2


def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=2, ignore_eos=True),
                                           SamplingParams(max_tokens=4, ignore_eos=True, n=2)])
    assert [len(o.outputs) for o in outs] == [1, 2] and len(outs[1].outputs[1].token_ids) == 4
    with pytest.raises(GenerationError, match="expected one SamplingParams or a list of 2"):
        llm.generate([PROMPT, PROMPT], [SamplingParams()])
    # an item that is no SamplingParams is named by its index: a None took kvload's built-in defaults, silently,
    # where sampling_params=None takes the model's (its generation_config.json), and a dict said only "dict"
    before = len(llm.audit.of("generation_started"))
    with pytest.raises(GenerationError, match=r"^generate: sampling_params\[1\]: expected a SamplingParams, got "
                                              r"NoneType \(sampling_params=None, not a list, takes the model's "
                                              r"defaults\)$"):
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=2), None])
    with pytest.raises(GenerationError, match=r"^generate: sampling_params\[0\]: expected a SamplingParams, got "
                                              r"dict$"):
        llm.generate([PROMPT], [{"max_tokens": 2}])
    assert len(llm.audit.of("generation_started")) == before


# --- the LLM itself -------------------------------------------------------------------------------


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_a_salt_with_prefix_reuse_off_is_reported_ignored(manager):
    with kvload.LLM("tiny-llama", **llm_kwargs(manager, enable_block_reuse=False)) as llm:
        llm.generate([[1, 2, 3]], max_tokens=2, salt="x")
        (ignored,) = [e for e in llm.audit.of("setting_ignored") if e["field"] == "generate.salt"]
        assert ignored["value"] == "x" and ignored["reason"].startswith("prefix reuse is off: nothing is shared")
    with kvload.LLM("tiny-llama", **llm_kwargs(manager)) as llm:  # with reuse on the salt scopes it: no word
        llm.generate([[1, 2, 3]], max_tokens=2, salt="x")
        assert not [e for e in llm.audit.of("setting_ignored") if e["field"] == "generate.salt"]


def test_cli_salt_with_reuse_disabled_says_it_is_ignored(capsys, tmp_path):
    from tests.cli_support import read_events, run_cli

    audit = tmp_path / "salt.jsonl"
    r = run_cli(capsys, "generate", "tiny-llama", "--device", "cpu", "--prompt-ids", "1,2", "--max_new_tokens", "2",
                "--max_tokens", "256", "--salt", "x", "--disable_kv_cache_reuse", "--audit-log", str(audit))
    assert r.code == 0, r.err
    assert [e["field"] for e in read_events(audit) if e["event"] == "setting_ignored"] == ["generate.salt"]


def _watch_release(llm: kvload.LLM) -> dict[str, Any]:
    """What holds when close() releases the pools: blocks still owned, and whether a generate thread still runs."""
    import threading

    seen: dict[str, Any] = {}

    def record() -> None:  # registered last, so it runs first: before the pools go
        seen["used_blocks"] = used_blocks(llm.result)
        seen["workers"] = [t.name for t in threading.enumerate() if t.name == "kvload-generate-stream"]

    llm.result.context.on_close(record)
    return seen


def _generation_events(audit) -> list[str]:
    return [e for e in (json.loads(line)["event"] for line in audit.read_text().splitlines())
            if e.startswith("generation_")]


def test_leaving_with_while_a_stream_runs_stops_it_cleanly_before_releasing(tmp_path):
    audit = tmp_path / "llm.jsonl"
    with kvload.LLM("tiny-llama", **llm_kwargs(), audit_log=audit) as llm:
        seen = _watch_release(llm)
        stream = llm.generate_stream([[1, 2, 3]] * 4, max_tokens=50, ignore_eos=True)
        first = next(stream)
        assert first.finish_reason is None
    assert seen == {"used_blocks": 0, "workers": []}  # the worker had stopped and freed its blocks
    with pytest.raises(GenerationError, match=r"^generate_stream: the LLM was closed during generation"):
        list(stream)
    assert _generation_events(audit) == ["generation_started", "generation_failed"]
    assert llm.audit.of("generation_failed")[-1]["error"] == "GenerationError"
    llm.close()  # twice: nothing more to do
    with pytest.raises(GenerationError, match="this LLM was closed"):
        llm.generate([[1, 2, 3]])


def _in_thread(call: Any, errors: list[BaseException]) -> Any:
    """``call()`` on a started thread (returned); whatever it raises is appended to ``errors`` for the test."""
    import threading

    def work() -> None:
        try:
            call()
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    return worker


def test_close_from_another_thread_stops_a_running_generate(tmp_path):
    import threading

    audit = tmp_path / "llm.jsonl"
    started, errors = threading.Event(), []
    llm = kvload.LLM("tiny-llama", **llm_kwargs(), audit_log=audit,
                     subscribers=[lambda e: started.set() if e["event"] == "request_admitted" else None])
    seen = _watch_release(llm)

    worker = _in_thread(lambda: llm.generate([[1, 2, 3]] * 4, max_tokens=50, ignore_eos=True), errors)
    assert started.wait(60)
    llm.close()
    worker.join(60)
    assert not worker.is_alive() and seen["used_blocks"] == 0
    assert [type(e) for e in errors] == [GenerationError] and "closed during generation" in str(errors[0])
    assert _generation_events(audit) == ["generation_started", "generation_failed"]


def test_close_from_the_thread_reading_a_stream(tmp_path):
    llm = kvload.LLM("tiny-llama", **llm_kwargs())
    seen = _watch_release(llm)
    stream = llm.generate_stream([[1, 2, 3]] * 2, max_tokens=50, ignore_eos=True)
    next(stream)
    llm.close()
    llm.close()
    assert seen == {"used_blocks": 0, "workers": []}
    with pytest.raises(GenerationError, match="closed during generation"):
        list(stream)  # the deltas produced before the stop, then the error
    assert [e["event"] for e in llm.audit.events if e["event"].startswith("generation_")] == \
        ["generation_started", "generation_failed"]


def test_shutdown_releases_as_close_does_under_tensorrt_llms_name():
    """TensorRT-LLM scripts end with ``llm.shutdown()``: it stops what runs and releases the pools, as close() does."""
    llm = kvload.LLM("tiny-llama", **llm_kwargs())
    seen = _watch_release(llm)
    stream = llm.generate_stream([[1, 2, 3]], max_tokens=50, ignore_eos=True)
    next(stream)
    llm.shutdown()
    assert seen == {"used_blocks": 0, "workers": []}
    with pytest.raises(GenerationError, match="closed during generation"):
        list(stream)
    with pytest.raises(GenerationError, match="this LLM was closed"):
        llm.generate([[1, 2, 3]], max_tokens=2)
    llm.shutdown()  # twice, as close(): nothing left to release


def test_a_forked_child_is_told_it_cannot_use_the_llm_and_leaves_the_parents_alone(tmp_path):
    # a forward in a child forked after torch ran multi-threaded waited for ever (the parent's OpenMP pool), and the
    # child's close() rewrote the parent's audit log: every call there is now one error, its close touches nothing
    audit = tmp_path / "llm.jsonl"
    with kvload.LLM("tiny-llama", audit_log=audit, **llm_kwargs()) as llm:
        first = llm.generate([[1, 2, 3]], max_tokens=4)[0].outputs[0].token_ids
        written = audit.read_text()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what each call did, never return into pytest
            code = 1
            try:
                signal.alarm(60)  # a hang ends the child, and the parent sees no report
                said = []
                for call in (lambda: llm.generate([[1, 2, 3]], max_tokens=4), lambda: llm.generate_stream([[1]]),
                             llm.get_metrics):
                    try:
                        call()
                        said.append("ran")
                    except GenerationError as exc:
                        said.append(str(exc))
                llm.close()
                os.write(write, json.dumps(said).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read) as pipe:
            said = json.loads(pipe.read() or "null")
        os.waitpid(pid, 0)
        assert said is not None and len(said) == 3, said
        for call, line in zip(("generate", "generate_stream", "get_metrics"), said, strict=True):
            assert line.startswith(f"{call}: this LLM was built in process {os.getpid()} and this is a child forked "
                                   "from it"), line
        assert audit.read_text() == written  # the child's close() left the parent's file alone
        assert llm.generate([[1, 2, 3]], max_tokens=4)[0].outputs[0].token_ids == first  # the parent's still works


#: A script that ends with a stream still open; its steps made long (a bigger model's), so that at exit kvload's thread
#: is inside torch, where Python's end of daemon threads aborted the process
OPEN_STREAM_AT_EXIT = """
import torch
import kvload
llm = kvload.LLM("tiny-llama", log=False, kv_cache_config={"max_tokens": 4096})
executor, big = llm.result.executor, torch.randn(1500, 1500)
forward = executor.forward
def slow_forward(*args, **kwargs):
    torch.mm(big, big)
    return forward(*args, **kwargs)
executor.forward = slow_forward
stream = llm.generate_stream([[1, 2, 3]], max_tokens=1000, ignore_eos=True)
next(stream)
"""


def test_a_script_that_ends_with_a_stream_open_exits_with_its_own_status(tmp_path):
    # it ended in C++'s "terminate called without an active exception", SIGABRT (134), most runs: the stream's call
    # is now stopped at exit, at its next step, before Python ends the thread
    import subprocess
    import sys

    from tests.tp_support import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", OPEN_STREAM_AT_EXIT], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert (r.returncode, r.stderr) == (0, ""), r.stderr[-2000:]


def test_cpu_without_a_bound_gets_the_default_budget_and_the_audit_says_so(tiny_checkpoints, tmp_path):
    audit = tmp_path / "llm.jsonl"
    with kvload.LLM(str(tiny_checkpoints("llama")), device="cpu", log=False, audit_log=audit) as llm:
        (budget,) = llm.audit.of("kv_budget_computed")
        assert budget["max_tokens"] == DEFAULT_CPU_MAX_TOKENS and budget["limited_by"] == "max_tokens"
        assert f"kv_cache_config.default_max_tokens={DEFAULT_CPU_MAX_TOKENS} applies" in budget["reason"]
        assert llm.args.kv_cache_config.max_tokens is None  # the user's bound stays unset
        assert llm.route.kv_manager == "KVCacheManager" and repr(llm).startswith("LLM(")
        assert llm.generate([[4, 5, 6]], max_tokens=2)[0].outputs[0].token_ids
    events = [json.loads(line)["event"] for line in audit.read_text().splitlines()]
    assert "generation_finished" in events  # close() wrote the generation segment too
    with pytest.raises(GenerationError, match="this LLM was closed"):
        llm.generate([[4, 5, 6]])


def test_the_default_budget_is_derived_by_llm_not_set_by_the_user(tiny_checkpoints, tmp_path):
    with kvload.LLM(str(tiny_checkpoints("llama")), device="cpu", log=False) as llm:
        (snapshot,) = llm.audit.of("user_fields_snapshotted")
        assert "kv_cache_config.default_max_tokens" not in snapshot["fields"]
        (derived,) = [e for e in llm.audit.of("field_derived") if e["field"].endswith("default_max_tokens")]
        assert derived["source"] == "LLM" and derived["new"] == DEFAULT_CPU_MAX_TOKENS
    config = tmp_path / "kv.yaml"
    config.write_text("kv_cache_config:\n  default_max_tokens: 300\n")  # a config file's value is the user's
    with kvload.LLM(str(tiny_checkpoints("llama")), device="cpu", log=False, config_file=config) as llm:
        (budget,) = llm.audit.of("kv_budget_computed")
        assert budget["max_tokens"] == 300 and not [e for e in llm.audit.of("field_derived")
                                                    if e["field"].endswith("default_max_tokens")]


def test_an_explicit_bound_wins_over_the_default(tiny_checkpoints):
    kv = kvload.KvCacheConfig(max_tokens=256, tokens_per_block=4)
    with kvload.LLM(str(tiny_checkpoints("llama")), device="cpu", log=False, kv_cache_config=kv) as llm:
        (budget,) = llm.audit.of("kv_budget_computed")
        assert budget["max_tokens"] == 256 and "default_max_tokens" not in budget["reason"]
        assert llm.args.kv_cache_config.tokens_per_block == 4


def test_prompts_of_token_ids_work_on_a_preset_and_text_needs_a_tokenizer():
    with kvload.LLM("tiny-llama", device="cpu", log=False, kv_cache_config={"max_tokens": 256}) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert out.outputs[0].text is None and len(out.outputs[0].token_ids) == 3
        with pytest.raises(GenerationError, match="stop: stop strings are matched on the text, but tiny-llama has "
                                                  "no tokenizer; use stop_token_ids"):
            llm.generate([[1, 2, 3]], stop="x")



def test_other_callers_of_the_model_keep_its_own_attention_while_kvload_generates(llm):
    # a user's own call of the model (a scoring pass, model.generate), from another thread or from a stream callback
    # on kvload's thread, runs transformers' own attention and masks while kvload generates: kvload's attention is
    # routed to its own forward, on its own thread, and never switched on the model for the others
    import threading

    model = llm.result.hf_model
    ids = torch.tensor([[0, 0, 5, 17, 300], [42, 9, 88, 123, 7]])  # the first row left-padded
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])

    def score() -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids=ids, attention_mask=mask).logits

    own, before = model.config._attn_implementation, score()
    during: dict[str, Any] = {}

    def elsewhere() -> None:
        try:
            during["thread"] = score()
        except Exception as exc:  # the assertion below names it
            during["thread"] = exc

    def on_token(event: Any) -> None:
        if "callback" not in during:  # mid-generation: the first token is out, the rest are to come
            during["callback"] = score()
            worker = threading.Thread(target=elsewhere)
            worker.start()
            worker.join()

    (out,) = llm.result.generate([llm.tokenizer(PROMPT)["input_ids"]], max_new_tokens=12, ignore_eos=True,
                                 stream=on_token)
    assert isinstance(during["thread"], torch.Tensor), during["thread"]
    assert torch.equal(during["thread"], before) and torch.equal(during["callback"], before)
    assert out.token_ids == greedy(llm).token_ids  # and kvload's own tokens are unchanged
    assert model.config._attn_implementation == own != "kvload_paged"


@pytest.mark.parametrize("event", ["generation_started", "setting_ignored"])
def test_a_subscriber_failing_as_a_call_starts_still_ends_it_in_the_audit(tmp_path, event):
    """A subscriber raising on generation_started (which the audit, ahead of it, had received) or on the
    setting_ignored right after it left an audit whose call started and never ended: ``--verify`` refused it.
    Now the call ends with generation_failed naming the error, the audit verifies, and the LLM generates again."""
    from kvload.explain import verify_log
    from pipeline.audit import AuditLog

    audit = tmp_path / "llm.jsonl"
    armed = [True]

    def explode(record: dict[str, Any]) -> None:
        if armed[0] and record["event"] == event:
            armed[0] = False
            raise RuntimeError(f"subscriber failed on {event}")

    with kvload.LLM("tiny-llama", **llm_kwargs(), audit_log=audit, subscribers=[explode]) as llm:
        with pytest.raises(RuntimeError, match=f"subscriber failed on {event}"):
            llm.generate([[1, 2, 3]], max_tokens=2, seed=1)  # greedy with a seed: a setting_ignored
        assert used_blocks(llm.result) == 0
        assert llm.generate([[1, 2, 3]], max_tokens=2)[0].outputs[0].token_ids
    assert _generation_events(audit) == ["generation_started", "generation_failed", "generation_started",
                                         "generation_finished"]
    failed = [json.loads(line) for line in audit.read_text().splitlines()
              if json.loads(line)["event"] == "generation_failed"]
    assert failed[0]["call"] == 0 and failed[0]["error"] == "RuntimeError"
    report = verify_log(AuditLog.from_jsonl(audit))
    assert report["ok"], report


@pytest.mark.parametrize(("subscribers", "message"), [
    (print, r"^subscribers: expected a list of callables \(each called with every event record\), got "
            r"builtin_function_or_method$"),
    (5, r"^subscribers: expected a list of callables .*, got int$"),
    ([print, "audit.jsonl"], r"^subscribers\[1\]: expected a callable \(called with every event record\), got str$"),
])
def test_subscribers_that_are_not_callables_are_one_config_error_before_anything_loads(tmp_path, subscribers,
                                                                                         message):
    """A lone callable or a number was Python's bare TypeError ("'int' object is not iterable"), naming no argument,
    and a list holding a non-callable raised "'str' object is not callable" at the load's first event."""
    with pytest.raises(ConfigError, match=message) as info:
        kvload.LLM("tiny-llama", **llm_kwargs(), audit_log=tmp_path / "a.jsonl", subscribers=subscribers)
    assert getattr(info.value, "audit", None) is None  # refused before any stage ran (a stage's error carries them)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["same", "hard link"])
def test_an_audit_log_on_the_config_file_the_call_reads_is_refused_and_the_config_kept(tmp_path, name):
    """audit_log= replaces a file, as Python's file APIs do, but LLM(config_file=C, audit_log=C) replaced the YAML
    config it had just read with the audit log (kvload --audit-log refuses the --config file the same way)."""
    import os

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max_batch_size: 4\n")
    target = cfg
    if name == "hard link":
        target = tmp_path / "log.jsonl"
        os.link(cfg, target)
    with pytest.raises(ConfigError, match=rf"^audit_log {re.escape(str(target))}: is the config_file this call reads; "
                                          r"give the audit log a file of its own$"):
        kvload.LLM("tiny-llama", **llm_kwargs(), config_file=cfg, audit_log=target)
    assert cfg.read_text() == "max_batch_size: 4\n"


def test_a_full_disk_when_close_rewrites_the_audit_log_says_the_file_keeps_the_loads_events(tmp_path, monkeypatch):
    """close() rewrites audit_log with the generation segments; on a full disk it said "audit log PATH: cannot write
    it ...; nothing was written" while PATH held the load's events, published when the LLM was created."""
    import errno
    import os

    import pipeline.audit

    target = tmp_path / "llm.jsonl"
    llm = kvload.LLM("tiny-llama", **llm_kwargs(), audit_log=target)
    llm.generate([[1, 2, 3]], max_tokens=2)
    loaded = target.read_text()

    class FullDisk:
        def __init__(self, real: Any) -> None:
            self.real = real

        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def close(self) -> None:
            self.real.close()

    real_fdopen = os.fdopen
    monkeypatch.setattr(pipeline.audit.os, "fdopen", lambda fd, *a, **k: FullDisk(real_fdopen(fd, *a, **k)))
    with pytest.raises(OutputError, match=rf"^audit_log {re.escape(str(target))}: cannot write the generation events "
                                          r"\(No space left on device\); the file keeps the load's events only, as "
                                          r"written when the LLM was created$"):
        llm.close()
    assert target.read_text() == loaded and list(tmp_path.iterdir()) == [target]  # no temporary left
    assert llm.result.kv_manager.closed  # the pools were released all the same


@pytest.mark.parametrize("refused", ["os.open", "os.replace"])
def test_a_full_disk_at_close_s_temporary_or_publish_says_the_file_keeps_the_loads_events(tmp_path, monkeypatch,
                                                                                          refused):
    """The same full disk met creating close()'s temporary (no inode left) or moving it onto the file (a directory
    that needs a block): the line said "nothing was written" as if ``audit_log`` held nothing, not that it keeps the
    load's events."""
    import errno
    import os

    import pipeline.audit

    target = tmp_path / "llm.jsonl"
    llm = kvload.LLM("tiny-llama", **llm_kwargs(), audit_log=target)
    loaded = target.read_text()

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pipeline.audit.os, refused.split(".")[1], full)
    with pytest.raises(OutputError, match=rf"^audit_log {re.escape(str(target))}: cannot write the generation events "
                                          r"\(No space left on device\); the file keeps the load's events only"):
        llm.close()
    monkeypatch.undo()
    assert target.read_text() == loaded and list(tmp_path.iterdir()) == [target]


def test_load_result_close_from_another_thread_stops_its_generate():
    """LoadResult.close() during its generate (another thread) released the pools under the running call, which
    failed with internal KeyErrors ('uniform', 'request 0.0 is not admitted'). Now, as LLM.close: the call is
    stopped through its executor, waited for, then the pools go; the call raises GenerationError, and so does a
    later one."""
    import threading

    result = kvload.load("tiny-llama", load_weights=True, log=False, device="cpu",
                         kv_cache_config={"max_tokens": 512, "tokens_per_block": 4})
    started, errors = threading.Event(), []
    result.bus.subscribe(lambda e: started.set() if e["event"] == "request_admitted" else None)
    seen = {}
    result.context.on_close(lambda: seen.setdefault("used_blocks", used_blocks(result)))

    worker = _in_thread(lambda: result.generate([[1, 2, 3]] * 4, max_tokens=200, ignore_eos=True), errors)
    assert started.wait(60)
    result.close()
    worker.join(60)
    assert not worker.is_alive() and seen == {"used_blocks": 0}
    assert [type(e) for e in errors] == [GenerationError], errors
    assert "the result was closed during generation" in str(errors[0])
    assert [e["event"] for e in result.audit.events if e["event"].startswith("generation_")] == \
        ["generation_started", "generation_failed"]
    result.close()  # twice: nothing more to do
    with pytest.raises(GenerationError, match="this result was closed"):
        result.generate([[1, 2, 3]], max_tokens=2)


def test_load_result_close_from_its_stream_callback():
    with kvload.load("tiny-llama", load_weights=True, log=False, device="cpu",
                     kv_cache_config={"max_tokens": 512, "tokens_per_block": 4}) as result:
        seen = {}
        result.context.on_close(lambda: seen.setdefault("used_blocks", used_blocks(result)))
        deltas = []

        def on_delta(delta: Any) -> None:
            deltas.append(delta)
            if len(deltas) == 3:
                result.close()  # the call is this thread: it stops at its next step and releases as it ends
                assert seen == {}

        with pytest.raises(GenerationError, match="the result was closed during generation"):
            result.generate([[1, 2, 3]], max_tokens=50, ignore_eos=True, stream=on_delta)
        assert seen == {"used_blocks": 0} and len(deltas) < 50
