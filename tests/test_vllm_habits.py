"""Code written for vLLM's offline API (``vllm.LLM``, ``SamplingParams``, ``RequestOutput``) run on ``kvload.LLM``:
what maps acts, what kvload has no counterpart for is reported ``setting_ignored``, what it cannot honour is one line.
"""

from __future__ import annotations

import copy
import json
import pickle
import re
import time

import pytest

import kvload
from engine.sampling_params import SamplingParams
from kvload.metrics import Counter, Gauge, Histogram
from pipeline.errors import ConfigError, GenerationError
from tests.llm_support import llm_kwargs, with_tokenizer

VOCAB = 512  # the tiny llama's
IDS = [[5, 17, 300, 42, 9], [88, 123, 7]]


@pytest.fixture(scope="module")
def words(tiny_checkpoints, tmp_path_factory):
    """The tiny llama checkpoint with a word-level tokenizer (token i is the text "w<i>")."""
    return with_tokenizer(tiny_checkpoints("llama"), tmp_path_factory.mktemp("words") / "ckpt", VOCAB)


@pytest.fixture(scope="module")
def llm(words):
    with kvload.LLM(str(words), **llm_kwargs("v1")) as loaded:
        yield loaded


def sampled(llm, **kw) -> list[list[int]]:
    """Every sample's tokens of one sampled call without a per-request seed."""
    outs = llm.generate(IDS, SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, **kw))
    return [c.token_ids for o in outs for c in o.outputs]


def ignored(llm) -> dict[str, str]:
    return {e["field"]: e["reason"] for e in llm.audit.of("setting_ignored")}


# --- the constructor ------------------------------------------------------------------------------


def test_llm_seed_makes_unseeded_sampling_repeat_across_runs_and_differ_between_calls(words):
    runs = []
    for _ in range(2):
        with kvload.LLM(str(words), seed=7, **llm_kwargs("v1")) as llm:
            runs.append((sampled(llm), sampled(llm)))
            started = llm.audit.of("generation_started")[-1]
            assert started["llm_seed"] == 7 and started["seed"] is None
    assert runs[0] == runs[1]  # vLLM's LLM(seed=...): the same script gives the same samples
    assert runs[0][0] != runs[0][1]  # but one LLM's calls go on through its sequence, as vLLM's do
    with kvload.LLM(str(words), seed=8, **llm_kwargs("v1")) as other:
        assert sampled(other) != runs[0][0]


def test_unseeded_sampling_repeats_run_to_run_by_default_as_vllms_seed_0_does_and_seed_none_is_fresh(words):
    """vLLM's ``LLM(seed: int = 0)`` (its V1 engine): a script that passes no seed samples the same run to run."""
    runs, fresh = [], []
    for _ in range(2):
        with kvload.LLM(str(words), **llm_kwargs("v1")) as llm:
            runs.append((sampled(llm), sampled(llm)))
            assert llm.audit.of("generation_started")[-1]["llm_seed"] == 0
        with kvload.LLM(str(words), seed=None, **llm_kwargs("v1")) as llm:
            fresh.append(sampled(llm))
            assert llm.audit.of("generation_started")[-1]["llm_seed"] is None
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]
    with kvload.LLM(str(words), seed=0, **llm_kwargs("v1")) as llm:
        assert sampled(llm) == runs[0][0]
    assert fresh[0] != fresh[1]  # 12 tokens drawn from 512 each: equal by chance about never


def test_a_seeded_prompts_samples_do_not_depend_on_the_calls_other_prompts_as_in_vllm(llm):
    """vLLM seeds each request (its sample j with seed + j): a prompt's seeded samples are the same alone, beside
    others, or repeated, and one SamplingParams for all prompts equals a list of it. kvload's seed + i*n + j gave
    a prompt other samples at another place in the batch (a sharded eval did not match the whole run)."""
    sp = SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=2, ignore_eos=True)
    both = llm.generate(IDS, sp)
    alone = llm.generate(IDS[1:], sp)
    assert [c.token_ids for c in both[1].outputs] == [c.token_ids for c in alone[0].outputs]
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(IDS, [sp, sp])] == \
        [[c.token_ids for c in o.outputs] for o in both]
    twice = llm.generate([IDS[0], IDS[0]], sp)
    assert [c.token_ids for c in twice[0].outputs] == [c.token_ids for c in twice[1].outputs]
    # unseeded, each sample its own stream: a prompt given twice (one SamplingParams each) samples twice
    free = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    a, b = llm.generate([IDS[0], IDS[0]], [free, free])
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_a_per_request_seed_still_wins_over_the_llm_seed(words):
    outs = []
    for seed in (1, 2):
        with kvload.LLM(str(words), seed=seed, **llm_kwargs("v1")) as llm:
            outs.append(sampled(llm, seed=3))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, "0", True])
def test_a_bad_llm_seed_is_one_line_before_anything_loads(seed):
    with pytest.raises(ConfigError) as info:
        kvload.LLM("tiny-llama", seed=seed, log=False)
    assert str(info.value).startswith("seed: expected an integer in [0, 2**63 - 1] or None, got ")
    assert info.value.source == "api" and "\n" not in str(info.value)


def test_vllm_engine_knobs_kvload_has_no_counterpart_for_load_and_are_reported_ignored():
    knobs = {"enforce_eager": True, "disable_log_stats": True, "max_seq_len_to_capture": 8192,
             "distributed_executor_backend": "mp", "enable_sleep_mode": False, "quantization": None,
             "cpu_offload_gb": 0, "task": "generate"}
    with kvload.LLM("tiny-llama", log=False, **knobs) as llm:
        said = ignored(llm)
        assert set(knobs) <= set(said)
        assert said["enforce_eager"].startswith("a vLLM option kvload does not act on: CUDA graphs")
        assert "unquantized" in said["quantization"]
    # an empty hf_overrides asks for nothing: no key set, nothing reported
    with kvload.LLM("tiny-llama", log=False, hf_overrides={}) as llm:
        assert "hf_overrides" not in ignored(llm) and llm.audit.of("hf_config_overridden") == []
        assert llm.generate([[1, 2, 3]], max_tokens=2)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"quantization": "awq"}, "quantization: vLLM's setting; kvload runs the checkpoint's weights in dtype, "
                              "unquantized; accepted: None, got 'awq'"),
    ({"task": "reward"}, "task: vLLM's setting; kvload serves a checkpoint as its architectures[0] says, so there is "
                         "no runner to choose: a *ForCausalLM one generates and embeds (LLM.embed and kvload serve's "
                         "/v1/embeddings pool the last token's hidden state, as vLLM's runner pooling does for a "
                         "decoder model), a *ForSequenceClassification one classifies (LLM.classify, POST /classify), "
                         "scores pairs through its head and each token (LLM.reward) (convert or task 'classify' makes "
                         "a *ForCausalLM checkpoint carrying score.weight one); vLLM's reward conversion of a causal "
                         "LM (its per-token hidden states) is not served; accepted: 'auto' or 'generate' or 'embed' or "
                         "'classify' or 'score', got 'reward'"),
    ({"cpu_offload_gb": 4}, "cpu_offload_gb: vLLM's setting; kvload keeps every weight on the device; accepted: 0 "
                            "or 0.0, got 4"),
    ({"hf_overrides": {"to_dict": 1}}, "hf_overrides.to_dict: names a method of transformers' LlamaConfig, not a "
                                       "config key"),
])
def test_a_vllm_knob_kvload_cannot_honour_is_refused_naming_what_it_accepts(kwargs, message):
    # hf_overrides acts (tests/test_hf_overrides.py): only a key the config cannot take is refused
    with pytest.raises(ConfigError) as info:
        kvload.LLM("tiny-llama", log=False, **kwargs)
    assert str(info.value) == message and info.value.source == "api"


@pytest.mark.parametrize("value", [float("nan"), {"a": 1}, "yes", 2, 1.0, [True]])
def test_an_on_off_vllm_knob_given_junk_is_refused_not_reported_ignored(value):
    # enforce_eager=NaN (or a dict) loaded with only a setting_ignored; vLLM's own check takes a bool
    for knob in ("enforce_eager", "enable_chunked_prefill", "disable_log_stats"):
        with pytest.raises(ConfigError) as info:
            kvload.LLM("tiny-llama", log=False, **{knob: value})
        assert str(info.value).startswith(f"{knob}: vLLM's setting; expected true or false, got ")
        assert "\n" not in str(info.value) and info.value.source == "api"


def test_every_vllm_switch_kvload_ignores_is_checked_as_on_off_and_takes_bools():
    np = pytest.importorskip("numpy")
    from kvload.cli.flags import VLLM_KNOB_FLAGS
    from pipeline.vllm_compat import BOOL_KNOBS, IGNORED, vllm_knob

    switches = {key for _, key, kind, _ in VLLM_KNOB_FLAGS if kind is None and key in IGNORED}
    assert switches <= BOOL_KNOBS <= set(IGNORED)
    for knob in sorted(BOOL_KNOBS):
        for taken in (True, False, 0, 1, None, np.bool_(True)):
            assert vllm_knob(knob, taken) == IGNORED[knob]
    tokenizer = object()  # TensorRT-LLM's scripts pass a tokenizer object: still taken (and ignored)
    assert vllm_knob("tokenizer", tokenizer) == IGNORED["tokenizer"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tokenizer": float("nan")}, "tokenizer: vLLM's setting; expected a path or a tokenizer object, got nan"),
    ({"tokenizer": {"a": 1}}, "tokenizer: vLLM's setting; expected a path or a tokenizer object, got a mapping of 1 "
                              "keys"),
    ({"revision": float("nan")}, "revision: vLLM's setting; expected a string (a branch, tag or commit), got nan"),
    ({"revision": {"a": 1}}, "revision: vLLM's setting; expected a string (a branch, tag or commit), got a mapping "
                             "of 1 keys"),
])
def test_a_tokenizer_or_revision_that_is_plain_junk_is_refused_naming_it(kwargs, message):
    # taken and reported setting_ignored before; a path, a revision string or a tokenizer object still are
    with pytest.raises(ConfigError) as info:
        kvload.LLM("tiny-llama", log=False, **kwargs)
    assert str(info.value) == message and info.value.source == "api"
    from pipeline.vllm_compat import IGNORED, vllm_knob

    for name, taken in (("tokenizer", "gpt2"), ("tokenizer", object()), ("revision", "main"), ("revision", 1234567)):
        assert vllm_knob(name, taken) == IGNORED[name]


def test_a_torch_dtype_is_taken_as_its_name_as_vllm_takes_it():
    import torch

    assert kvload.plan("tiny-llama", dtype=torch.bfloat16).args.dtype == "bfloat16"
    assert kvload.plan("tiny-llama", kv_cache_config={"dtype": torch.float16}).args.kv_cache_config.dtype == "float16"
    with pytest.raises(ConfigError, match=r"^dtype: expected .*, got 'int8'$"):
        kvload.plan("tiny-llama", dtype=torch.int8)


# --- generate and chat arguments ------------------------------------------------------------------


def test_lora_request_none_is_the_base_model_and_an_adapter_is_refused(llm):
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    plain = llm.generate(IDS, params)
    assert [o.outputs[0].token_ids for o in llm.generate(IDS, params, lora_request=None)] == \
        [o.outputs[0].token_ids for o in plain]
    for call in (llm.generate, llm.chat):
        name = call.__name__
        with pytest.raises(GenerationError, match=f"^{name}: lora_request: kvload serves the checkpoint's own weights "
                                                  "and has no LoRA adapters; accepted: None, got object$"):
            call(IDS if name == "generate" else [{"role": "user", "content": "w5"}], params, lora_request=object())
    # generate_stream takes generate's arguments: None is the base model there too, not "vLLM's argument"
    streamed = list(llm.generate_stream(IDS[:1], params, lora_request=None))
    assert [t for d in streamed for t in d.token_ids] == plain[0].outputs[0].token_ids
    with pytest.raises(GenerationError, match="^generate_stream: lora_request: kvload serves the checkpoint's own "
                                              "weights and has no LoRA adapters; accepted: None, got object$"):
        llm.generate_stream(IDS[:1], params, lora_request=object())


def test_vllms_list_of_lora_requests_all_none_is_the_base_model_too(llm):
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(IDS, params)]
    assert [o.outputs[0].token_ids for o in llm.generate(IDS, params, lora_request=[None, None])] == plain
    with pytest.raises(GenerationError, match="^generate: lora_request: .*; accepted: None, got list$"):
        llm.generate(IDS, params, lora_request=[None, object()])


def test_chat_takes_vllms_arguments_by_position_in_vllms_order(llm):
    """vLLM's ``LLM.chat(messages, sampling_params, use_tqdm, lora_request, chat_template,
    chat_template_content_format, add_generation_prompt, continue_final_message, tools, chat_template_kwargs)``."""
    conv = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w17"}]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    template = ("{% if tools %}w{{ tools | length }} {% endif %}{% if extra %}w{{ extra }} {% endif %}"
                "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w2{% endif %}")
    (out,) = llm.chat(conv, params, False, None, template, "string", False, True, [{"type": "function"}], {"extra": 9})
    by_name = llm.chat(conv, params, use_tqdm=False, chat_template=template, add_generation_prompt=False,
                       continue_final_message=True, tools=[{"type": "function"}], chat_template_kwargs={"extra": 9})
    assert out.prompt == by_name[0].prompt == "w1 w9 w5 w17"  # the last message continued, not closed


def test_a_vllm_call_argument_kvload_lacks_is_named_not_mistaken_for_a_sampling_setting(llm):
    with pytest.raises(GenerationError, match="^generate: tokenization_kwargs.truncation=true: vLLM's, not kvload's"):
        llm.generate(IDS, SamplingParams(max_tokens=2), tokenization_kwargs={"truncation": True})
    with pytest.raises(GenerationError, match="^generate: unknown argument 'top_q'; sampling fields are"):
        llm.generate(IDS, SamplingParams(max_tokens=2), top_q=0.5)


def test_vllms_call_arguments_and_sampling_fields_at_their_defaults_ask_for_nothing_and_are_taken(llm):
    """``llm.chat(messages, sp, mm_processor_kwargs=None)`` (vLLM's signature, its default spelled out) and
    ``SamplingParams(flat_logprobs=False, ...)`` (a dict of every vLLM field) were refused though they ask for
    nothing; a value that asks for something is still refused naming it."""
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    want = llm.generate(IDS, sp)[0].outputs[0].token_ids
    for kw in ({"mm_processor_kwargs": None}, {"tokenization_kwargs": {}}, {"prompt_adapter_request": None}):
        assert llm.generate(IDS, sp, **kw)[0].outputs[0].token_ids == want, kw
    conv = [{"role": "user", "content": "w5 w17"}]
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w2{% endif %}"
    assert llm.chat(conv, sp, chat_template=template, mm_processor_kwargs=None)[0].prompt == "w5 w17 w2"
    with pytest.raises(GenerationError, match="^chat: mm_processor_kwargs: vLLM's argument, not kvload's"):
        llm.chat(conv, sp, chat_template=template, mm_processor_kwargs={"num_crops": 4})
    spelled = SamplingParams(max_tokens=3, ignore_eos=True, flat_logprobs=False, skip_clone=False, stream_interval=None,
                             thinking_token_budget=None, repetition_detection=None, logprob_token_ids=None,
                             skip_reading_prefix_cache=None, routed_experts_prompt_start=0)
    assert spelled == sp
    with pytest.raises(GenerationError, match="^generate: flat_logprobs: vLLM's SamplingParams field, not kvload's"):
        SamplingParams(flat_logprobs=True)


def test_chat_tools_reach_the_template_as_vllm_passes_them(llm):
    tok = llm.tokenizer
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                         "{% if tools %}{% for t in tools %}w{{ t['function']['parameters']['n'] }} {% endfor %}"
                         "{% endif %}w1")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"n": 400}}}]
    try:
        conv = [{"role": "user", "content": "w5"}]
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        assert llm.chat(conv, params)[0].prompt == "w5 w1"
        assert llm.chat(conv, params, tools=tools)[0].prompt == "w5 w400 w1"
        with pytest.raises(GenerationError, match="^chat: tools: given both as chat's argument and in "
                                                  "chat_template_kwargs"):
            llm.chat(conv, params, tools=tools, chat_template_kwargs={"tools": tools})
        with pytest.raises(GenerationError, match="^chat: tools: expected a list of tool definitions"):
            llm.chat(conv, params, tools="f")
        for bad in ("x", [("n", 1)]):  # refused as without tools, not a TypeError from merging tools into it
            with pytest.raises(GenerationError, match="^chat: chat_template_kwargs: expected a dict of template "
                                                      "variables"):
                llm.chat(conv, params, tools=tools, chat_template_kwargs=bad)
    finally:
        tok.chat_template = None


#: prints each assistant message's reasoning by both of vLLM's names for it
REASONING_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% if m.get('reasoning') %}{{ m['reasoning'] }} "
                      "{{ m['reasoning_content'] }} {% endif %}{% endfor %}")


def test_an_assistant_messages_reasoning_reaches_the_template_as_vllm_passes_it(llm):
    """Interleaved thinking: the reasoning of an earlier turn sent back was refused ("messages[1].reasoning: not
    supported"); vLLM passes it to the template as both `reasoning` and `reasoning_content`."""
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for key in ("reasoning", "reasoning_content"):
        conv = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6", key: "w7"},
                {"role": "user", "content": "w8"}]
        (out,) = llm.chat(conv, params, chat_template=REASONING_TEMPLATE)
        assert out.prompt == "w5 w6 w7 w7 w8 "
    for message, says in [
        ({"role": "assistant", "content": "w6", "reasoning": 7}, "messages[1].reasoning: expected a string"),
        ({"role": "assistant", "content": "w6", "reasoning": "w7", "reasoning_content": "w9"},
         "messages[1].reasoning_content: differs from reasoning"),
        ({"role": "user", "content": "w6", "reasoning": "w7"},
         "messages[1].reasoning: not supported (an assistant message's)"),
    ]:
        with pytest.raises(GenerationError, match=f"^chat: prompt 0: {re.escape(says)}"):
            llm.chat([{"role": "user", "content": "w5"}, message], params, chat_template=REASONING_TEMPLATE)


# --- the outputs ----------------------------------------------------------------------------------


def test_request_output_metrics_time_the_request_as_vllms_do(llm):
    before = time.time()
    outs = llm.generate(IDS, SamplingParams(max_tokens=4, temperature=1.0, n=2, seed=0, ignore_eos=True))
    for out in outs:
        m = out.metrics
        assert before <= m.arrival_time <= time.time()
        assert m.queued_ts <= m.scheduled_ts <= m.first_token_ts <= m.last_token_ts
        assert m.first_token_latency == pytest.approx(out.timings.first_token_s)
        assert m.last_token_ts - m.queued_ts == pytest.approx(out.timings.total_s)
        assert m.num_generation_tokens == sum(len(c.token_ids) for c in out.outputs) == 8
        assert out.num_cached_tokens <= len(out.prompt_token_ids)


def test_num_cached_tokens_is_the_prompts_prefix_cache_hit_at_most_its_length_whatever_n(llm):
    """vLLM's ``num_cached_tokens`` counts one request's prompt tokens found cached; it summed every sample's reuse
    (the forks included), so with n samples it passed the prompt's length."""
    ids = [[401, 402, 403, 404, 405, 406]]  # one full 4-token block, then 2 tokens
    params = SamplingParams(max_tokens=2, temperature=1.0, n=3, seed=0, ignore_eos=True)
    first, again = llm.generate(ids, params)[0], llm.generate(ids, params)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 4  # the full block, from the prefix cache
    assert again.reused_prompt_tokens > len(ids[0])  # the forks' share is kvload's own count


def test_outputs_are_mutable_as_vllms_dataclasses_are(llm):
    """vLLM's ``CompletionOutput`` is a dataclass and ``RequestOutput`` a plain class: scripts tidy their results in
    place (``c.text = c.text.strip()``); kvload's frozen ones raised FrozenInstanceError."""
    (out,) = llm.generate(IDS[:1], SamplingParams(max_tokens=3, ignore_eos=True))
    c = out.outputs[0]
    words = c.text.split()
    c.text, c.finish_reason = f"  {c.text}  ".strip().upper(), "stop"
    out.prompt, out.metrics.num_generation_tokens = "w5 w17", 0
    assert (c.text, c.finish_reason, out.prompt) == (" ".join(words).upper(), "stop", "w5 w17")
    assert out.outputs[0] is c and out.metrics.num_generation_tokens == 0
    assert pickle.loads(pickle.dumps(out)) == out


def test_vllms_other_output_attributes_read_as_none(llm):
    """``out.lora_request``, ``out.encoder_prompt``, ``c.kv_transfer_params``: what vLLM sets for a decoder-only
    model run without adapters or KV transfer (a script that logs them raised AttributeError)."""
    (out,) = llm.generate(IDS[:1], SamplingParams(max_tokens=2, ignore_eos=True))
    c = out.outputs[0]
    assert (out.lora_request, out.encoder_prompt, out.encoder_prompt_token_ids, out.kv_transfer_params) == (None,) * 4
    assert (c.lora_request, c.kv_transfer_params) == (None, None)
    assert "lora_request" not in out.to_dict()  # kvload's --json documents are as they were


def test_completion_output_finished_is_a_method_as_in_vllm(llm):
    (out,) = llm.generate(IDS[:1], max_tokens=2)
    assert out.finished is True and out.outputs[0].finished() is True


def test_logprob_entries_read_as_vllms_logprob_objects_and_stay_floats(llm):
    (out,) = llm.generate(IDS[:1], SamplingParams(max_tokens=4, temperature=1.0, seed=3, logprobs=3,
                                                  prompt_logprobs=2, ignore_eos=True))
    sample = out.outputs[0]
    for token, entry in zip(sample.token_ids, sample.logprobs, strict=True):
        top = sorted(entry, key=lambda t: -entry[t])[:3]
        assert [entry[t].rank for t in top] == [1, 2, 3]  # the top alternatives' ranks are their places
        assert entry[token].rank == entry.rank and entry[token].logprob == float(entry[token])
        assert type(entry[token].logprob) is float
    pairs = zip(sample.logprobs, sample.token_ids, strict=True)
    assert sample.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in pairs))
    first = out.prompt_logprobs[1]
    assert first[IDS[0][1]].logprob == float(first[IDS[0][1]])
    assert json.loads(json.dumps({str(t): v for t, v in first.items()})) == {str(t): float(v) for t, v in
                                                                            first.items()}
    copied = pickle.loads(pickle.dumps(sample.logprobs))
    assert copied == sample.logprobs and copied[-1][token].rank == sample.logprobs[-1][token].rank


def test_logprob_entries_carry_vllms_decoded_token(llm):
    """vLLM's ``Logprob.decoded_token``: each listed token's text, on generated and prompt tokens and in a stream's
    deltas; None where there is no text (``detokenize=False``)."""
    sp = SamplingParams(max_tokens=3, temperature=1.0, seed=3, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    (out,) = llm.generate(IDS[:1], sp)
    entries = [e for e in out.outputs[0].logprobs + out.prompt_logprobs if e is not None]
    assert all(v.decoded_token == f"w{t}" for e in entries for t, v in e.items())
    streamed = [e for d in llm.generate_stream(IDS[:1], sp) for e in d.logprobs]
    assert [{t: v.decoded_token for t, v in e.items()} for e in streamed] == \
        [{t: f"w{t}" for t in e} for e in out.outputs[0].logprobs]
    (bare,) = llm.generate(IDS[:1], SamplingParams(max_tokens=2, logprobs=1, detokenize=False))
    assert all(v.decoded_token is None for e in bare.outputs[0].logprobs for v in e.values())


def test_vllms_prompt_types_are_there_and_generate_takes_them(llm):
    """``from vllm.inputs import TokensPrompt, TextPrompt`` reads ``from kvload import TokensPrompt, TextPrompt``."""
    from kvload import TextPrompt, TokensPrompt

    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=IDS[0]), TextPrompt(prompt="w88 w123 w7")]
    assert prompts == [{"prompt_token_ids": IDS[0]}, {"prompt": "w88 w123 w7"}]
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in llm.generate(IDS, sp)]
    assert outs[1].prompt == "w88 w123 w7" and outs[0].prompt is None


def test_a_prompt_dicts_cache_salt_scopes_that_prompts_prefix_reuse_as_vllms_does(llm):
    """vLLM's ``TokensPrompt(..., cache_salt=...)`` / ``TextPrompt``: each prompt its own salt (it was refused: kvload
    salted only a whole call); prompts under one salt share cached blocks, under another none."""
    from kvload import TextPrompt, TokensPrompt

    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    ids = list(range(200, 216))  # four full blocks of 4, used by no other test
    text = " ".join(f"w{i}" for i in ids)
    (warm,) = llm.generate([TokensPrompt(prompt_token_ids=ids, cache_salt="tenant-a")], sp)
    assert warm.num_cached_tokens == 0
    same, other, unsalted, as_text = llm.generate(
        [TokensPrompt(prompt_token_ids=ids, cache_salt="tenant-a"), TokensPrompt(prompt_token_ids=ids,
                                                                                 cache_salt="tenant-b"),
         ids, TextPrompt(prompt=text, cache_salt="tenant-a")], sp)
    assert same.num_cached_tokens > 0 and as_text.num_cached_tokens > 0  # one salt: one scope, text or ids
    assert other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    (call_salted,) = llm.generate([ids], sp, salt="tenant-a")  # a prompt's cache_salt is the call's salt, per prompt
    assert call_salted.num_cached_tokens > 0
    assert llm.audit.of("generation_started")[-2]["salted"] is True
    with pytest.raises(GenerationError, match="^generate: prompt 0: its cache_salt and the call's salt differ"):
        llm.generate([TokensPrompt(prompt_token_ids=ids, cache_salt="tenant-b")], sp, salt="tenant-a")
    with pytest.raises(GenerationError, match="^generate: prompt 0: 'cache_salt' must be a non-empty string"):
        llm.generate([{"prompt_token_ids": ids, "cache_salt": 7}], sp)


def test_a_tokens_prompts_own_text_is_the_outputs_prompt_as_in_vllm(llm):
    """vLLM's ``TokensPrompt`` may carry the text of its ids (``prompt``): ``RequestOutput.prompt`` is then that text;
    the ids are what runs (a script feeding an output's prompt and ids back was refused: "has keys")."""
    from kvload import TokensPrompt

    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=IDS[0], prompt="five ids")], sp)
    assert out.prompt == "five ids" and out.prompt_token_ids == IDS[0]
    assert out.outputs[0].token_ids == llm.generate([IDS[0]], sp)[0].outputs[0].token_ids


def test_a_flat_list_of_token_ids_is_one_prompt_as_in_vllm(llm):
    """vLLM's ``prompt_to_seq``: ``llm.generate(tokenizer.encode(text), sp)`` is one prompt (it was refused)."""
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    (one,) = llm.generate(IDS[0], sp)
    assert one.prompt_token_ids == IDS[0]
    assert one.outputs[0].token_ids == llm.generate([IDS[0]], sp)[0].outputs[0].token_ids


def test_truncate_prompt_tokens_keeps_each_prompts_last_k_tokens_as_vllm_does(llm):
    """vLLM's ``SamplingParams(truncate_prompt_tokens=k)``: the prompt's last k tokens run (it was refused); the text
    given stays ``out.prompt``, as vLLM's does."""
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    text = " ".join(f"w{i}" for i in range(10, 30))
    cut, ids = llm.generate([text, list(range(40, 60))], SamplingParams(max_tokens=3, ignore_eos=True,
                                                                          truncate_prompt_tokens=5))
    assert cut.prompt == text and cut.prompt_token_ids == [25, 26, 27, 28, 29]
    assert ids.prompt_token_ids == [55, 56, 57, 58, 59]
    direct = llm.generate([[25, 26, 27, 28, 29], [55, 56, 57, 58, 59]], sp)
    assert [o.outputs[0].token_ids for o in (cut, ids)] == [o.outputs[0].token_ids for o in direct]
    short_one, whole = llm.generate([[1, 2, 3], [4, 5, 6]], [SamplingParams(max_tokens=3, truncate_prompt_tokens=5),
                                                             sp])  # shorter than k: uncut; each prompt its own
    assert short_one.prompt_token_ids == [1, 2, 3] and whole.prompt_token_ids == [4, 5, 6]
    deltas = list(llm.generate_stream([list(range(40, 60))], SamplingParams(max_tokens=3, ignore_eos=True,
                                                                            truncate_prompt_tokens=5)))
    assert deltas[-1].output.prompt_token_ids == [55, 56, 57, 58, 59]


def test_truncate_prompt_tokens_minus_one_fits_a_prompt_past_max_seq_len_and_a_bad_size_is_one_line(llm):
    long = list(range(1, 101))  # 100 tokens; the fixture's max_seq_len is 64
    with pytest.raises(GenerationError, match="^generate: prompt 0: 100 tokens leave no room"):
        llm.generate([long], SamplingParams(max_tokens=4))
    # vLLM's -1 is max_model_len: a prompt that long keeps one token fewer here, and generates that one (as vLLM)
    (out,) = llm.generate([long], SamplingParams(max_tokens=4, ignore_eos=True, truncate_prompt_tokens=-1))
    assert out.prompt_token_ids == long[-63:] and len(out.outputs[0].token_ids) == 1
    assert out.outputs[0].finish_reason == "length"
    shorter = list(range(1, 62))  # under max_seq_len: kept whole and max_tokens cut to what is left, as vLLM does
    (out,) = llm.generate([shorter], SamplingParams(max_tokens=4, ignore_eos=True, truncate_prompt_tokens=-1))
    assert out.prompt_token_ids == shorter and len(out.outputs[0].token_ids) == 3
    with pytest.raises(GenerationError, match=r"^generate: truncate_prompt_tokens: 65 is greater than max_seq_len "
                                              r"\(vLLM's max_model_len\) 64; use at most 64"):
        llm.generate([long], SamplingParams(max_tokens=4, truncate_prompt_tokens=65))
    for bad in (0, -2, True, 1.5):
        with pytest.raises(GenerationError, match="^generate: truncate_prompt_tokens: expected an integer >= 1"):
            SamplingParams(truncate_prompt_tokens=bad)
    assert SamplingParams(truncate_prompt_tokens=None) == SamplingParams()


def test_truncate_prompt_tokens_of_max_model_len_is_taken_as_vllm_takes_it(llm):
    """vLLM takes ``1 <= truncate_prompt_tokens <= max_model_len``: a script capping prompts at the model's length
    (TRL's ``max_prompt_length`` equal to ``max_model_len``) was refused whatever its prompts. A shorter prompt runs
    whole; one that long keeps one token fewer than asked, generates that one, and a ``setting_ignored`` says so."""
    sp = SamplingParams(max_tokens=4, ignore_eos=True, truncate_prompt_tokens=64)
    (short,) = llm.generate([[5, 6, 7]], sp)
    assert short.prompt_token_ids == [5, 6, 7] and len(short.outputs[0].token_ids) == 4
    long = list(range(1, 101))
    (out,) = llm.generate([long, long], sp)[:1]
    assert out.prompt_token_ids == long[-63:] and len(out.outputs[0].token_ids) == 1
    said = [r for r in llm.audit.of("setting_ignored") if r["field"] == "generate.truncate_prompt_tokens"]
    assert [(r["value"], r["reason"][:48]) for r in said] == [(64, "2 prompts (the first: 0) kept the last 63 tokens")]


def test_the_serving_engine_cuts_a_submitted_prompt_to_its_params_truncate_prompt_tokens():
    """``ServingEngine.submit``/``check`` took ``SamplingParams(truncate_prompt_tokens=k)`` and ran the whole prompt
    (too long for ``max_seq_len``: refused as such), saying nothing: the field acts there as in ``generate``."""
    import pipeline
    from engine.serving import ServingEngine

    result = pipeline.load("tiny-llama", load_weights=True, log=False, max_seq_len=64,
                           kv_cache_config={"max_tokens": 256})
    try:
        engine = ServingEngine.from_result(result)
        limit = engine.executor.max_seq_len
        long = [1 + i % 300 for i in range(limit + 10)]
        request = engine.check(long, SamplingParams(max_tokens=4, truncate_prompt_tokens=5))
        assert request.prompt_token_ids == long[-5:]
        request = engine.check(long, SamplingParams(max_tokens=4, truncate_prompt_tokens=-1))
        assert request.prompt_token_ids == long[-(limit - 1):]  # generate's -1: one token left to generate
        assert engine.check([1, 2, 3], SamplingParams(max_tokens=4, truncate_prompt_tokens=5)).prompt_token_ids == [
            1, 2, 3]
        with pytest.raises(GenerationError, match="^generate: prompt 0: .* tokens leave no room"):
            engine.check(long, SamplingParams(max_tokens=4))  # no cut asked for: still refused
    finally:
        result.close()


def test_the_serving_engine_says_a_cut_to_one_token_fewer_once_for_a_request_checked_then_submitted():
    """A server checks a request (``check``), then queues it (``submit``): each reported the cut that kept one token
    fewer than ``truncate_prompt_tokens`` asked, so one request's ``setting_ignored`` came twice. Now the submit that
    queues it says it, once, naming the request; a check alone says nothing (nothing ran)."""
    import threading

    import pipeline
    from engine.serving import ServingEngine

    said = []
    result = pipeline.load("tiny-llama", load_weights=True, log=False, max_seq_len=64,
                           kv_cache_config={"max_tokens": 256},
                           subscribers=[lambda e: said.append(e) if e["event"] == "setting_ignored" else None])
    engine = ServingEngine.from_result(result)
    try:
        engine.start()
        long, sp = list(range(1, 101)), SamplingParams(max_tokens=2, ignore_eos=True, truncate_prompt_tokens=64)
        assert len(engine.check(long, sp).prompt_token_ids) == 63
        for group in (False, True):
            done = threading.Event()
            sink = lambda ev, done=done: done.set() if ev.finished else None  # noqa: E731
            (rid,) = engine.submit_group(long, sp, [sink]) if group else [engine.submit(long, sp, sink)]
            assert done.wait(60)  # the note is emitted before the request's first step
            cuts = [e for e in said if e["field"] == "serve.truncate_prompt_tokens"]
            assert len(cuts) == 1, cuts  # was 2: check's and submit's
            assert (cuts[0]["value"], cuts[0].get("request")) == (64, rid)
            assert cuts[0]["reason"].startswith("prompt 0 kept the last 63 tokens, not 64")
            said.clear()
    finally:
        engine.stop(60)
        result.close()


def test_vllms_legacy_prompt_token_ids_keyword_gives_the_prompts(llm):
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(IDS, sp)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=IDS, sampling_params=sp)] == want
    (one,) = llm.generate(sampling_params=sp, prompt_token_ids=IDS[0])  # one list of ids: one prompt
    assert one.prompt_token_ids == IDS[0] and one.outputs[0].token_ids == want[0]
    with pytest.raises(GenerationError, match="^generate: give the prompts as prompts or as prompt_token_ids"):
        llm.generate(["w5"], sp, prompt_token_ids=IDS)


def test_chat_template_content_format_openai_gives_the_parts_and_auto_reads_the_template(llm):
    """vLLM's "openai" format hands the template each message's content as its list of parts (a string as one part,
    an assistant's null as none); "auto" picks it for a template that loops over the content, as vLLM detects it.
    Such a template given a string looped over its characters and wrote nothing of the message."""
    conv = [{"role": "user", "content": [{"type": "text", "text": "w5"}, {"type": "text", "text": "w17"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                   "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "user", "content": "w9"}]
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    joined = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    for fmt in ("auto", "string"):  # a template that prints the content: the parts joined by newlines
        (out,) = llm.chat(conv, sp, chat_template=joined, chat_template_content_format=fmt)
        assert out.prompt == "w5\nw17  w9 "
    parts = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}|{% endfor %}"
    for fmt in ("openai", "auto"):
        (out,) = llm.chat(conv, sp, chat_template=parts, chat_template_content_format=fmt)
        assert out.prompt == "[w5][w17]||[w9]|", fmt
    (chars,) = llm.chat(conv, sp, chat_template=parts, chat_template_content_format="string")  # vLLM's too
    assert chars.prompt == "[]" * 6 + "||" + "[]" * 2 + "|"
    # detected through a name the content was set to, and through a filter over it
    aliased = ("{% for m in messages %}{% set c = m.content %}{% for p in c | selectattr('type', 'eq', 'text') %}"
               "{{ p.text }};{% endfor %}{% endfor %}")
    (out,) = llm.chat(conv, sp, chat_template=aliased)
    assert out.prompt == "w5;w17;w9;"
    with pytest.raises(GenerationError, match="^chat: chat_template_content_format: expected one of auto, string, "
                                              "openai, got 'html'$"):
        llm.chat(conv, sp, chat_template=parts, chat_template_content_format="html")


def test_a_vllm_llm_attribute_kvload_lacks_says_what_to_use_instead(llm):
    with pytest.raises(AttributeError, match=r"^LLM\.llm_engine: vLLM's, not kvload's: .*llm\.get_tokenizer\(\)$"):
        llm.llm_engine.get_tokenizer()
    with pytest.raises(AttributeError, match=r"^LLM\.model_config: vLLM's, not kvload's: .*llm\.args\.max_seq_len is "
                                             r"vLLM's model_config\.max_model_len"):
        _ = llm.model_config.max_model_len
    assert not hasattr(llm, "llm_engine") and not hasattr(llm, "no_such_thing")
    assert llm.result.kv_manager is not None and llm.args.max_seq_len == 64  # where the message points


# --- SamplingParams -------------------------------------------------------------------------------


def test_clone_is_an_equal_independent_copy():
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, stop=["."], logit_bias={3: 1.0})
    twin = sp.clone()
    assert twin == sp and twin is not sp and twin.logit_bias is not sp.logit_bias
    assert copy.deepcopy(sp) == twin


def test_fields_set_on_the_default_params_act_as_in_vllms_example(llm):
    """vLLM's examples/offline_inference/basic/generate.py sets fields on ``llm.get_default_sampling_params()``."""
    sp = llm.get_default_sampling_params()
    sp.max_tokens, sp.temperature, sp.seed, sp.stop_token_ids = 3, 1.0, 5, [7]
    assert (sp.max_tokens, sp.temperature, sp.stop_token_ids) == (3, 1.0, [7])
    (out,) = llm.generate(IDS[:1], sp)
    assert len(out.outputs[0].token_ids) <= 3
    assert out.outputs[0].token_ids == llm.generate(IDS[:1], SamplingParams(max_tokens=3, temperature=1.0, seed=5,
                                                                            stop_token_ids=[7]))[0].outputs[0].token_ids
    with pytest.raises(GenerationError, match=r"^generate: min_tokens: expected an integer in \[0, max_tokens=3\]"):
        sp.min_tokens = 4
    with pytest.raises(GenerationError, match="^generate: logits_processors: vLLM's SamplingParams field"):
        sp.logits_processors = [lambda ids, logits: logits]  # a processor to run ([] asks for nothing: taken)
    assert sp.min_tokens == 0 and sp == SamplingParams(max_tokens=3, temperature=1.0, seed=5, stop_token_ids=[7])


def test_from_optional_takes_none_as_kvloads_default():
    sp = SamplingParams.from_optional(temperature=None, top_p=None, max_tokens=8, n=None, seed=None, stop=None)
    assert sp == SamplingParams(max_tokens=8)
    with pytest.raises(GenerationError, match="^generate: top_p: expected a number in"):
        SamplingParams.from_optional(top_p=0)


def test_list_fields_are_lists_a_script_appends_to_and_the_next_call_acts_on(llm):
    """vLLM keeps ``stop``, ``stop_token_ids``, ``bad_words`` and ``allowed_token_ids`` as lists, and scripts append
    to them (``sp.stop.append("###")``); kvload's tuples raised AttributeError there."""
    sp = SamplingParams(max_tokens=6, ignore_eos=True, stop="w9999", allowed_token_ids=[5, 6])
    assert all(type(v) is list for v in (sp.stop, sp.stop_token_ids, sp.bad_words, sp.allowed_token_ids))
    assert sp.stop == ["w9999"] and SamplingParams().stop == [] and SamplingParams().bad_words == []
    free = llm.generate(IDS[:1], SamplingParams(max_tokens=6, ignore_eos=True))[0].outputs[0]
    word = free.text.split()[2]  # the third generated word
    plain = SamplingParams(max_tokens=6, ignore_eos=True)
    plain.stop.append(word)
    (out,) = llm.generate(IDS[:1], plain)
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", word)
    assert out.outputs[0].token_ids == free.token_ids[:3]
    ids = SamplingParams(max_tokens=6, ignore_eos=True)
    ids.stop_token_ids.append(free.token_ids[1])
    assert llm.generate(IDS[:1], ids)[0].outputs[0].token_ids == free.token_ids[:2]
    # allowed_token_ids changed between two calls of one SamplingParams: the second draws from the new list
    assert set(llm.generate(IDS[:1], sp)[0].outputs[0].token_ids) <= {5, 6}
    sp.allowed_token_ids[:] = [7]
    assert llm.generate(IDS[:1], sp)[0].outputs[0].token_ids == [7] * 6


def test_a_list_changed_in_place_is_checked_by_the_next_call_as_the_constructor_checks_it(llm):
    import numpy as np

    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    sp.stop.append("")
    with pytest.raises(GenerationError, match="^generate: stop: expected a non-empty string or a list of them, "
                                              "got \\[''\\]$"):
        llm.generate(IDS[:1], sp)
    sp.stop.clear()
    sp.stop_token_ids.append(-3)
    with pytest.raises(GenerationError, match="^generate: stop_token_ids: expected a list of token ids"):
        llm.generate(IDS[:1], sp)
    sp.stop_token_ids.clear()
    sp.logit_bias[5] = 1000.0  # the dict was mutable before the lists were: a bias past 100 reached the logits
    with pytest.raises(GenerationError, match=r"^generate: logit_bias: expected a mapping of token ids .* got \{5: "
                                              r"1000\.0\}$"):
        llm.generate(IDS[:1], sp)
    sp.logit_bias.clear()
    sp.stop_token_ids[:] = [np.int64(7)]  # a numpy id: taken as the int it holds, in the list the caller holds
    held = sp.stop_token_ids
    llm.generate(IDS[:1], sp)
    assert held is sp.stop_token_ids and type(held[0]) is int
    assert llm.audit.of("generation_started")[-1]["stop_token_ids"] == [7]


def test_from_optional_takes_logit_bias_as_vllms_does_text_keys_and_clamped_biases():
    sp = SamplingParams.from_optional(logit_bias={"50": 200, 7: -300.5, "8": 1.5}, temperature=None)
    assert sp.logit_bias == {50: 100, 7: -100, 8: 1.5} and all(type(t) is int for t in sp.logit_bias)
    with pytest.raises(GenerationError, match="^generate: logit_bias: expected a mapping of token ids"):
        SamplingParams.from_optional(logit_bias={"w5": 1.0})


def test_seed_minus_one_is_no_seed_as_in_vllm(words):
    """vLLM's ``SamplingParams(seed=-1)`` is ``seed=None`` (scripts pass an argparse default of -1 for "random")."""
    assert SamplingParams(seed=-1).seed is None and SamplingParams.from_optional(seed=-1).seed is None
    with kvload.LLM(str(words), seed=3, **llm_kwargs("v1")) as llm:
        minus_one = sampled(llm, seed=-1)
    with kvload.LLM(str(words), seed=3, **llm_kwargs("v1")) as llm:
        assert sampled(llm) == minus_one  # the LLM's seeded sequence, as an unseeded request's
    with pytest.raises(GenerationError, match=r"^generate: seed: expected an integer in \[0, 2\*\*63 - 1\] or None, "
                                              "got -2$"):
        SamplingParams(seed=-2)



def test_seed_minus_one_is_no_seed_through_kvload_generate_and_the_server_too(capsys):
    """SamplingParams(seed=-1) was taken while `kvload generate --seed -1` ("expected an integer >= 0") and a request's
    "seed": -1 (a 400; vLLM's server takes any int64 and its SamplingParams reads -1 as None) were refused: one value,
    three verdicts (hunt65a). -1 is "no seed" at every door; -2 is refused at every door."""
    from tests.cli_support import run_cli
    from tests.serve_support import serving

    base = ("generate", "tiny-llama", "--max_tokens", "4096", "--prompt-ids", "5,6", "--max_new_tokens", "2",
            "--temperature", "1.0")
    assert run_cli(capsys, *base, "--seed", "-1").code == 0
    refused = run_cli(capsys, *base, "--seed", "-2")
    assert refused.code == 2 and "--seed: expected an integer >= 0, or -1 for none (vLLM's), got '-2'" in refused.err
    with serving("tiny-llama") as served:
        body = {"prompt": [5, 6], "max_tokens": 2, "temperature": 1.0}
        assert served.http.post("/v1/completions", json={**body, "seed": -1}).status_code == 200
        r = served.http.post("/v1/completions", json={**body, "seed": -2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
        assert "an integer in [0, 2**63 - 1], or -1 for none" in r.json()["error"]["message"]


def test_logprobs_true_is_one_as_in_vllm(llm):
    sp = SamplingParams(max_tokens=2, logprobs=True, prompt_logprobs=True, ignore_eos=True)
    assert (sp.logprobs, sp.prompt_logprobs) == (1, 1)
    (out,) = llm.generate(IDS[:1], sp)
    assert out.outputs[0].logprobs == llm.generate(IDS[:1], SamplingParams(
        max_tokens=2, logprobs=1, prompt_logprobs=1, ignore_eos=True))[0].outputs[0].logprobs
    with pytest.raises(GenerationError, match="^generate: logprobs: expected an integer in \\[0, 20\\]"):
        SamplingParams(logprobs=False)  # vLLM's False reads as 0 there; None is "no logprobs" here


def test_detokenize_false_keeps_the_tokens_and_skips_the_text(llm):
    params = {"max_tokens": 5, "temperature": 1.0, "seed": 4, "ignore_eos": True}
    (text,) = llm.generate(IDS[:1], SamplingParams(**params))
    (bare,) = llm.generate(IDS[:1], SamplingParams(detokenize=False, skip_special_tokens=False, **params))
    assert text.outputs[0].text and bare.outputs[0].text == ""  # vLLM's: a str, empty (it was None)
    assert bare.outputs[0].token_ids == text.outputs[0].token_ids
    assert ignored(llm)["generate.skip_special_tokens"] == "detokenize is false: there is no text"
    deltas = list(llm.generate_stream(IDS[:1], SamplingParams(detokenize=False, **params)))
    assert [t for d in deltas for t in d.token_ids] == text.outputs[0].token_ids and not any(d.text for d in deltas)
    with pytest.raises(GenerationError, match="^generate: stop: stop strings are matched on the text, and detokenize "
                                              "is false"):
        SamplingParams(stop=["."], detokenize=False)
    with pytest.raises(GenerationError, match="^generate: detokenize: expected true or false"):
        SamplingParams(detokenize="no")


@pytest.mark.parametrize(("field", "words"), [
    ("best_of", "vLLM's V1 engine dropped it too; ask for n samples"),
    ("guided_decoding", "vLLM's older name; pass structured_outputs=kvload.StructuredOutputsParams(...)"),
    ("logits_processors", "kvload runs no user code in its sampler"),
    # vLLM's newer fields: each said with what kvload does instead (they read "unknown SamplingParams field")
    ("logprob_token_ids", "kvload returns the top logprobs=k tokens"),
    ("thinking_token_budget", "kvload does not bound a model's thinking; max_tokens bounds the whole reply"),
    ("skip_reading_prefix_cache", "give the call its own salt="),
    ("stream_interval", "LLM.generate_stream yields every token as it comes"),
])
def test_a_vllm_sampling_field_kvload_lacks_is_one_line_with_what_to_do(field, words):
    with pytest.raises(GenerationError) as info:
        SamplingParams(**{field: 2})
    assert str(info.value).startswith(f"generate: {field}: vLLM's SamplingParams field, not kvload's: {words}")
    with pytest.raises(GenerationError, match="^generate: unknown SamplingParams field 'top_q'; fields are .*top_p"):
        SamplingParams(top_q=2)


def test_vllms_fields_at_the_values_that_ask_for_nothing_are_taken(llm):
    """A script or config spelling vLLM's defaults out (``SamplingParams(n=n, best_of=best_of)`` with best_of None,
    ``logits_processors=[]``) ran there and was refused here; another value is still one line saying what is taken."""
    plain = SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=5)
    spelled = SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=5, best_of=None, logits_processors=[],
                             guided_decoding=None, extra_args={})
    assert spelled == plain and SamplingParams(n=2, best_of=2) == SamplingParams(n=2)
    assert llm.generate(IDS, spelled)[0].outputs[1].token_ids == llm.generate(IDS, plain)[0].outputs[1].token_ids
    (out,) = llm.generate(IDS[:1], max_tokens=2, best_of=None, logits_processors=None)  # as keywords too
    assert len(out.outputs[0].token_ids) == 2
    with pytest.raises(GenerationError, match=r"^generate: best_of: .*; accepted: None, or n itself, which ask for "
                                              "nothing$"):
        SamplingParams(n=2, best_of=3)
    with pytest.raises(GenerationError, match=r"^generate: logits_processors: .*; accepted: None or \[\], which"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])


def test_vllms_fields_set_on_params_at_the_values_that_ask_for_nothing_are_taken_as_the_constructor_takes_them():
    """vLLM's SamplingParams is mutable (``params.best_of = None`` on the default params): the refusal of another value
    says None is accepted, so None set as an attribute must be, as the constructor takes it; the params stay as they
    were."""
    params = SamplingParams(n=2, max_tokens=3)
    params.best_of = None
    params.best_of = 2  # n itself
    params.logits_processors = []
    params.guided_decoding = None
    params.extra_args = {}
    assert params == SamplingParams(n=2, max_tokens=3)
    with pytest.raises(GenerationError, match=r"^generate: best_of: .*; accepted: None, or n itself"):
        params.best_of = 3


# --- get_metrics ----------------------------------------------------------------------------------


def test_get_metrics_counts_what_the_calls_returned_and_reads_the_managers_cache(words):
    with kvload.LLM(str(words), **llm_kwargs("v2")) as llm:
        first = {(m.name, tuple(sorted(m.labels.items()))): m for m in llm.get_metrics()}
        assert first[("kvload_generation_tokens", (("model_name", str(words)),))].value == 0
        outs = llm.generate(IDS, SamplingParams(max_tokens=4, ignore_eos=True))
        outs += llm.generate(IDS[:1], SamplingParams(max_tokens=2))
        got = {(m.name, tuple(sorted((k, v) for k, v in m.labels.items() if k != "model_name"))): m
               for m in llm.get_metrics()}
        stats = llm.result.executor.manager.stats()
    samples = [c for o in outs for c in o.outputs]
    assert got[("kvload_generation_tokens", ())].value == sum(len(c.token_ids) for c in samples)
    assert got[("kvload_prompt_tokens", ())].value == sum(len(o.prompt_token_ids) for o in outs)
    assert got[("kvload_request_success", (("finished_reason", "length"),))].value == \
        sum(c.finish_reason == "length" for c in samples)
    assert got[("kvload_request_success", (("finished_reason", "stop"),))].value == \
        sum(c.finish_reason == "stop" for c in samples)
    ttft = got[("kvload_time_to_first_token_seconds", ())]
    assert isinstance(ttft, Histogram) and ttft.count == len(outs) == ttft.buckets["+Inf"]
    assert ttft.sum == pytest.approx(sum(o.timings.first_token_s for o in outs))
    counts = list(ttft.buckets.values())
    assert counts == sorted(counts)  # cumulative, as Prometheus' le buckets are
    hits = got[("kvload_prefix_cache_hits", ())]
    assert isinstance(hits, Counter) and hits.value == stats.reuse_hit_tokens
    assert hits.value == sum(o.num_cached_tokens for o in outs) > 0  # the third prompt repeats the first
    usage = [m for m in got.values() if m.name == "kvload_kv_cache_usage_perc"]
    assert usage and all(isinstance(m, Gauge) for m in usage)
    assert {m.labels["layer_group"] for m in usage} == set(stats.groups)


def test_get_metrics_takes_vllms_own_names_as_the_server_does(words):
    with kvload.LLM(str(words), **llm_kwargs("v2")) as llm:
        outs = llm.generate(IDS, SamplingParams(max_tokens=3, ignore_eos=True))
        ours = {m.name: m for m in llm.get_metrics()}
        theirs = llm.get_metrics(metrics_name_prefix="vllm")
        usage = llm.result.executor.manager.stats().usage
        with pytest.raises(GenerationError, match="^get_metrics: metrics_name_prefix: expected one of kvload, vllm, "
                                                  "got 'prom'"):
            llm.get_metrics(metrics_name_prefix="prom")
    named = {m.name: m for m in theirs}
    assert named["vllm:generation_tokens"].value == ours["kvload_generation_tokens"].value == 3 * len(outs)
    assert named["vllm:time_to_first_token_seconds"].count == len(outs)
    for m in theirs:
        if m.name.startswith("vllm:"):  # vLLM's labels: model_name and engine (and the family's own)
            assert m.labels["engine"] == "0" and m.labels["model_name"] == str(words)
        else:  # what vLLM has no series for keeps kvload's name
            assert m.name in {"kvload_num_suspensions", "kvload_engine_steps", "kvload_kv_cache_usage_perc"}, m.name
    (one,) = [m for m in theirs if m.name == "vllm:kv_cache_usage_perc"]  # one gauge, not one per layer group
    assert isinstance(one, Gauge) and one.value == pytest.approx(usage)


def test_min_tokens_past_a_default_max_tokens_names_that_default_and_the_keyword_that_raises_it(llm, words):
    """min_tokens past a max_tokens the caller never gave read "expected an integer in [0, max_tokens=64]", as if
    max_tokens had been given: the default is named as one (kvload's, or the model's generation config's) with
    max_tokens as the keyword that raises it."""
    default = (r"^generate: min_tokens: expected an integer in \[0, max_tokens=64\], kvload's default max_tokens "
               r"\(none was given\), got 100; give max_tokens of at least 100 \(None: no cap but the context\)$")
    with pytest.raises(GenerationError, match=default):
        SamplingParams(min_tokens=100)
    with pytest.raises(GenerationError, match=default):
        llm.generate(IDS[:1], min_tokens=100)
    with pytest.raises(GenerationError, match=r"^generate: min_tokens: expected an integer in \[0, max_tokens=8\], "
                                              r"got 100$"):  # given: named as given
        SamplingParams(min_tokens=100, max_tokens=8)
    assert SamplingParams(min_tokens=100, max_tokens=100).min_tokens == 100  # the advice taken
    with kvload.LLM(str(words), override_generation_config={"max_new_tokens": 2}, **llm_kwargs("v1")) as short:
        with pytest.raises(GenerationError, match=r"^generate: min_tokens: expected an integer in \[0, max_tokens=2\]"
                                                  r", the default of this LLM's override_generation_config \(its "
                                                  r"max_new_tokens; no max_tokens was given\), got 3; give max_tokens"
                                                  r" of at least 3"):
            short.generate(IDS[:1], min_tokens=3)
        assert len(short.generate(IDS[:1], min_tokens=3, max_tokens=3)[0].outputs[0].token_ids) == 3


def test_min_tokens_past_the_default_length_names_the_users_override_apart_from_the_models_file(words, tmp_path):
    """The length a call without max_tokens takes comes from the user's own LLM(override_generation_config=...) or
    from the model's generation_config.json; min_tokens past it named the user's setting "the model's default", so
    the user went looking for a file the model does not have. Each is now named as what it is."""
    import shutil

    model = tmp_path / "with-config"
    shutil.copytree(words, model)
    (model / "generation_config.json").write_text('{"max_new_tokens": 3}')
    file_default = r"max_tokens=3\], the model's default \(its generation_config.json's max_new_tokens; no max_tokens"
    with kvload.LLM(str(model), **llm_kwargs("v1")) as llm, pytest.raises(GenerationError, match=file_default):
        llm.generate(IDS[:1], min_tokens=4)
    with kvload.LLM(str(model), override_generation_config={"max_new_tokens": 2}, **llm_kwargs("v1")) as llm:
        with pytest.raises(GenerationError, match=r"max_tokens=2\], the default of this LLM's "
                                                  r"override_generation_config \(its max_new_tokens; no max_tokens was"
                                                  r" given\), got 4") as refused:
            llm.generate(IDS[:1], min_tokens=4)
        assert "the model's" not in str(refused.value)
