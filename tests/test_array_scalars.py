"""numpy scalars and 0-d torch tensors where the Python API takes numbers, as vLLM takes them: load arguments
(through the one converter), SamplingParams and ``LLM``'s seed; where a flag is wanted, numpy's bool and a 0-d bool
tensor as Python's bool; a bool where a count is wanted and non-integral floats are still refused, shown as Python's
own."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import kvload
from kvload import SamplingParams
from pipeline.errors import ConfigError, GenerationError


def _plan(**kw):
    return kvload.plan("tiny-llama", log=False, **kw)


def test_load_arguments_take_numpy_and_torch_integers_and_floats():
    """Before: ``max_model_len: expected an integer >= 1, "auto" or null, got np.int64(64)``."""
    r = _plan(max_model_len=np.int64(64), max_num_seqs=torch.tensor(3), max_num_tokens=np.uint16(256),
              kv_cache_config={"max_tokens": np.int32(4096), "free_gpu_memory_fraction": np.float32(0.5),
                               "max_gpu_total_bytes": torch.tensor(10**9), "tokens_per_block": np.int8(16)})
    kv = r.args.kv_cache_config
    got = (r.args.max_seq_len, r.args.max_batch_size, r.args.max_num_tokens, kv.max_tokens,
           kv.free_gpu_memory_fraction, kv.max_gpu_total_bytes, kv.tokens_per_block)
    assert got == (64, 3, 256, 4096, 0.5, 10**9, 16)
    assert [type(v) for v in got] == [int, int, int, int, float, int, int]  # held (and audited) as Python's
    parsed = {r["field"]: r["new"] for r in r.audit.events if r["event"] == "args_parsed"}
    json.dumps(parsed)  # the audit's values are plain JSON
    assert parsed["max_seq_len"] == 64 and parsed["kv_cache_config.max_tokens"] == 4096
    for flag in (np.bool_(True), torch.tensor(True)):  # a bool is no count, whoever's it is
        with pytest.raises(ConfigError, match="max_num_seqs: expected an integer >= 1, got "):
            _plan(max_num_seqs=flag)


@pytest.mark.parametrize("flag", [np.bool_(False), torch.tensor(False)], ids=["numpy", "torch"])
def test_config_flags_take_numpy_and_torch_bools(flag):
    """A flag computed from an array (``enable_block_reuse=mask.any()``) is taken as Python's bool, as numbers are
    (before: "kv_cache_config.enable_block_reuse: expected true or false, got np.False_"); the tri-state's too."""
    r = _plan(kv_cache_config={"enable_block_reuse": flag, "use_kv_cache_manager_v2": ~flag})
    kv = r.args.kv_cache_config
    assert kv.enable_block_reuse is False and kv.use_kv_cache_manager_v2 is True  # held (and audited) as Python's
    assert r.route.kv_manager == "KVCacheManagerV2"
    parsed = {e["field"]: e["new"] for e in r.audit.events if e["event"] == "args_parsed"}
    assert parsed["kv_cache_config.enable_block_reuse"] is False
    json.dumps(r.audit.events)  # plain JSON
    assert kvload.plan("tiny-llama", log=np.False_).args.kv_cache_config.enable_block_reuse  # the API's own flag too


@pytest.mark.parametrize("bad", [1, "yes", np.array([True]), torch.tensor([True, False]), np.int64(1)])
def test_config_flags_still_refuse_what_is_no_bool(bad):
    """Only a bool's own kinds are a flag: an int, a text or an array of several is refused naming the field."""
    with pytest.raises(ConfigError, match="kv_cache_config.enable_block_reuse: expected true or false"):
        _plan(kv_cache_config={"enable_block_reuse": bad})


def test_config_classes_built_directly_take_numpy_and_torch_scalars():
    """``KvCacheConfig(max_tokens=np.int64(4096))`` and an assignment of one take what the dict door takes (before:
    "max_tokens: expected an integer >= 1 or null, got np.int64(4096)" from the class alone), held as Python's and
    explicit as any value given; a bool is still no count and an int no flag."""
    from pipeline.config import LlmArgs, explicit_fields

    kv = kvload.KvCacheConfig(max_tokens=np.int64(4096), enable_block_reuse=np.False_,
                              use_kv_cache_manager_v2=torch.tensor(True), free_gpu_memory_fraction=np.float32(0.5))
    kv.tokens_per_block = torch.tensor(16)
    got = (kv.max_tokens, kv.enable_block_reuse, kv.use_kv_cache_manager_v2, kv.free_gpu_memory_fraction,
           kv.tokens_per_block)
    assert got == (4096, False, True, 0.5, 16) and [type(v) for v in got] == [int, bool, bool, float, int]
    assert {"max_tokens", "enable_block_reuse", "tokens_per_block"} <= explicit_fields(kv)
    r = _plan(kv_cache_config=kv, max_num_seqs=np.int64(3))
    assert r.route.kv_manager == "KVCacheManagerV2" and r.args.kv_cache_config.max_tokens == 4096
    json.dumps(r.audit.events)  # plain JSON
    assert LlmArgs(model="tiny-llama", max_batch_size=np.uint8(4)).max_batch_size == 4
    for field, bad, message in [("max_tokens", np.True_, "expected an integer >= 1 or null, got true"),
                                ("enable_block_reuse", np.int64(1), "expected true or false, got 1"),
                                ("tokens_per_block", np.float64(3.5), "expected an integer >= 1, got 3.5"),
                                ("max_tokens", np.array([1, 2]), "expected an integer >= 1 or null, got array")]:
        with pytest.raises(ConfigError, match=f"^{field}: {message}"):
            kvload.KvCacheConfig(**{field: bad})
        with pytest.raises(ConfigError, match=f"^{field}: {message}"):
            setattr(kvload.KvCacheConfig(), field, bad)


def test_sampling_and_chat_flags_take_numpy_and_torch_bools():
    """SamplingParams', BeamSearchParams', structured outputs' and chat's flags take numpy's bool and a 0-d bool
    tensor as Python's (before: "generate: ignore_eos: expected true or false, got np.True_")."""
    from engine.beam_search import BeamSearchParams
    from engine.prompts import template_options
    from engine.structured_params import StructuredOutputsParams

    p = SamplingParams(ignore_eos=np.True_, skip_special_tokens=torch.tensor(False), detokenize=np.True_,
                       include_stop_str_in_output=np.False_, spaces_between_special_tokens=torch.tensor(True))
    got = (p.ignore_eos, p.skip_special_tokens, p.detokenize, p.include_stop_str_in_output,
           p.spaces_between_special_tokens)
    assert got == (True, False, True, False, True) and all(type(v) is bool for v in got)
    assert BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=np.True_).ignore_eos is True
    s = StructuredOutputsParams(json_object=np.True_, disable_any_whitespace=torch.tensor(True))
    assert s.json_object is True and s.disable_any_whitespace is True
    options = template_options(add_generation_prompt=np.False_, continue_final_message=torch.tensor(True))
    assert options["add_generation_prompt"] is False and options["continue_final_message"] is True
    for bad in (1, np.array([True, False])):
        with pytest.raises(GenerationError, match="ignore_eos: expected true or false"):
            SamplingParams(ignore_eos=bad)


@pytest.mark.parametrize(("kw", "message"), [
    ({"max_model_len": np.float64(2.5)}, 'max_model_len: expected an integer >= 1, "auto" or null, got 2.5'),
    ({"max_num_seqs": torch.tensor(2.0)}, "max_num_seqs: expected an integer >= 1, got 2.0"),  # as Python's 2.0
])
def test_a_fraction_for_an_integer_is_refused_as_pythons_is(kw, message):
    """Refused, and shown as the Python number it is (before: ``np.float64(2.5)``, ``tensor(2.)``)."""
    with pytest.raises(ConfigError) as err:
        _plan(**kw)
    assert str(err.value).startswith(message), err.value


def test_sampling_params_take_0d_torch_tensors():
    """numpy's were taken already; torch's scalars (a length from a tensor) were refused."""
    p = SamplingParams(max_tokens=torch.tensor(7), temperature=torch.tensor(0.5), seed=torch.tensor(-1),
                       n=torch.tensor(2, dtype=torch.int32), top_k=np.int64(3))
    assert (p.max_tokens, p.temperature, p.seed, p.n, p.top_k) == (7, 0.5, None, 2, 3)
    assert type(p.max_tokens) is int and type(p.temperature) is float
    for bad, message in [({"max_tokens": torch.tensor(True)}, "max_tokens: expected an integer >= 1"),
                         ({"max_tokens": torch.tensor(2.5)}, "max_tokens: expected an integer >= 1"),
                         ({"temperature": torch.tensor(True)}, "temperature: expected a finite number")]:
        with pytest.raises(GenerationError, match=message):
            SamplingParams(**bad)


def test_llm_seed_takes_a_torch_integer(tiny_checkpoints):
    """numpy's was taken already; a 0-d torch tensor was refused."""
    with kvload.LLM(str(tiny_checkpoints("llama")), seed=torch.tensor(7), device="cpu", log=False,
                    kv_cache_config={"max_tokens": 256}) as llm:
        assert llm.result.executor.llm_seed == 7 and type(llm.result.executor.llm_seed) is int
    with pytest.raises(ConfigError, match="seed: expected an integer in"):
        kvload.LLM("tiny-llama", seed=np.bool_(True))


def test_llm_call_flags_take_numpy_and_torch_bools(tiny_checkpoints):
    """``get_world_size(include_dp=)`` and ``reset_prefix_cache``'s flags as SamplingParams' take them (before:
    "reset_prefix_cache: reset_running_requests: expected true or false, got np.True_")."""
    with kvload.LLM(str(tiny_checkpoints("llama")), device="cpu", log=False,
                    kv_cache_config={"max_tokens": 256}) as llm:
        assert llm.get_world_size(include_dp=np.False_) == 1
        assert llm.reset_prefix_cache(np.True_, torch.tensor(False)) is True
        with pytest.raises(GenerationError, match="reset_prefix_cache: reset_connector: expected true or false"):
            llm.reset_prefix_cache(False, np.array([True, True]))



def test_ignored_flags_and_counts_are_audited_as_json(tmp_path):
    """A vLLM knob kvload ignores, ``trust_remote_code`` and TensorRT-LLM's kv_cache_config switches take numpy's
    bool and a 0-d bool tensor; their ``setting_ignored`` records hold Python's values (before: the record held
    ``np.True_``, so ``json.dumps`` of the audit's events raised, and the file's line read ``"tensor(True)"``)."""
    audit = tmp_path / "audit.jsonl"
    r = kvload.plan("tiny-llama", log=False, audit_log=str(audit), enforce_eager=np.True_,
                    trust_remote_code=torch.tensor(True), max_seq_len_to_capture=np.int64(64),
                    disable_log_stats=torch.tensor(False), kv_cache_config={"copy_on_partial_reuse": np.False_},
                    speculative_config={"decoding_type": "Eagle", "max_draft_len": np.int64(3)})
    ignored = {e["field"]: e["value"] for e in r.audit.events if e["event"] == "setting_ignored"}
    wanted = {"enforce_eager": True, "trust_remote_code": True, "max_seq_len_to_capture": 64,
              "disable_log_stats": False, "kv_cache_config.copy_on_partial_reuse": False,
              "speculative_config": {"decoding_type": "Eagle", "max_draft_len": 3}}
    assert {k: ignored[k] for k in wanted} == wanted
    assert [type(ignored[k]) for k in list(wanted)[:5]] == [bool, bool, int, bool, bool]
    assert type(ignored["speculative_config"]["max_draft_len"]) is int  # inside a mapping too
    json.dumps(r.audit.events)
    written = {e["field"]: e["value"] for e in map(json.loads, audit.read_text().splitlines())
               if e["event"] == "setting_ignored"}
    assert {k: written[k] for k in wanted} == wanted


def test_pooling_params_use_activation_takes_numpy_and_torch_bools():
    """``PoolingParams(use_activation=)`` is a flag as SamplingParams' are (before: "PoolingParams: use_activation:
    expected true, false or None, got np.False_"); 1 and arrays stay refused."""
    from engine.pooling import PoolingParams

    assert PoolingParams(use_activation=np.False_).use_activation is False
    assert PoolingParams(use_activation=torch.tensor(True)).use_activation is True
    for bad in (1, np.array([True, False])):
        with pytest.raises(GenerationError, match="use_activation: expected true, false or None"):
            PoolingParams(use_activation=bad)


def test_generate_chat_and_use_tqdm_take_numpy_and_torch_bools(tiny_checkpoints, tmp_path_factory):
    """``generate(chat=)`` / ``generate_stream(chat=)`` take numpy's bool as ``chat``'s template options' flags do
    (before: "generate: chat: expected true or false, ... got np.True_"); ``use_tqdm=torch.tensor(True)`` is taken
    (before: refused) and said ignored with ``true``, not the text ``"np.True_"``."""
    from tests.llm_support import with_tokenizer

    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path_factory.mktemp("words") / "ckpt", 512)
    with kvload.LLM(str(words), device="cpu", log=False, kv_cache_config={"max_tokens": 256}) as llm:
        llm.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}w1"
        params = SamplingParams(max_tokens=2, temperature=0)
        (out,) = llm.generate("w5", params, chat=np.True_)
        assert out.prompt == "w5 w1" and out.prompt_token_ids == [5, 1]
        (plain,) = llm.generate("w5", params, chat=torch.tensor(False))
        assert plain.prompt_token_ids == [5]
        deltas = list(llm.generate_stream("w5", params, chat=np.True_))
        assert deltas[-1].output.prompt_token_ids == [5, 1]
        for bad in (1, np.array([True, True])):
            with pytest.raises(GenerationError, match="chat: expected true or false"):
                llm.generate("w5", params, chat=bad)
        llm.generate("w5", params, use_tqdm=torch.tensor(True))
        said = [e["value"] for e in llm.audit.of("setting_ignored") if e["field"] == "generate.use_tqdm"]
        assert said == [True]
        with pytest.raises(GenerationError, match="use_tqdm: expected true, false or a tqdm factory"):
            llm.generate("w5", params, use_tqdm=torch.tensor([True, False]))


def test_trtllm_ngram_switches_take_numpy_and_torch_bools():
    """TensorRT-LLM's NGram switches are flags: true is said ignored (with ``true``), false is what kvload does;
    1 stays refused (before the flags change: "speculative_config: is_keep_all: expected true or false, got
    tensor(True)")."""
    ngram = {"decoding_type": "NGram", "max_draft_len": 2, "max_matching_ngram_size": 2}
    r = _plan(speculative_config={**ngram, "is_keep_all": torch.tensor(True), "is_use_oldest": np.False_})
    ignored = {e["field"]: e["value"] for e in r.audit.events if e["event"] == "setting_ignored"}
    assert ignored.get("speculative_config.is_keep_all") is True and "speculative_config.is_use_oldest" not in ignored
    assert r.args.max_draft_len == 2
    with pytest.raises(ConfigError, match="speculative_config: is_public_pool: expected true or false, got 1"):
        _plan(speculative_config={**ngram, "is_public_pool": 1})


def test_a_numpy_count_beside_speculative_configs_own_agrees_with_it():
    """``max_draft_len=np.int64(2)`` beside a speculative_config of 2 is one value given twice, as 2 and 2 are (before:
    "its max_draft_len 2 and the top-level max_draft_len np.int64(2) set one field to different values"), and
    speculative_config's own counts take numpy's and torch's integers as the top-level fields do (before: "expected
    an integer from 1 to 64, got tensor(2)"); a different value, or a bool for the count, is still refused."""
    ngram = {"decoding_type": "NGram", "max_draft_len": 2, "max_matching_ngram_size": 2}
    assert _plan(speculative_config=ngram, max_draft_len=np.int64(2)).args.max_draft_len == 2
    r = _plan(speculative_config={**ngram, "max_draft_len": torch.tensor(2)}, max_draft_len=2)
    assert r.args.max_draft_len == 2 and type(r.args.max_draft_len) is int
    vllm = _plan(speculative_config={"method": "ngram", "num_speculative_tokens": np.int64(3),
                                     "prompt_lookup_max": torch.tensor(2)})
    assert (vllm.args.max_draft_len, vllm.args.max_matching_ngram_size) == (3, 2)
    for bad in (np.int64(3), np.True_):
        with pytest.raises(ConfigError, match="set one field to different values"):
            _plan(speculative_config=ngram, max_draft_len=bad)
    with pytest.raises(ConfigError, match="speculative_config: max_draft_len: expected an integer from 1 to 64, got "):
        _plan(speculative_config={**ngram, "max_draft_len": np.True_})


def test_load_weights_is_a_flag():
    """``kvload.load(load_weights=)`` takes numpy's bool as ``log`` does, and refuses what is no bool (before: any
    value was read for its truth, so ``load_weights="no"`` loaded the weights)."""
    def weights_loaded(flag):
        r = kvload.load("tiny-llama", log=False, load_weights=flag, device="cpu", kv_cache_config={"max_tokens": 256})
        return any(e["event"] == "weights_loaded" for e in r.audit.events)

    assert weights_loaded(np.True_) and not weights_loaded(torch.tensor(False))
    for bad in ("no", 0, np.array([True, True])):
        with pytest.raises(ConfigError, match="^load_weights: expected true or false, got "):
            kvload.load("tiny-llama", log=False, load_weights=bad)


def test_kv_events_config_takes_numpy_and_torch_scalars_as_the_load_arguments_do():
    """``LLM(kv_events_config={...})`` with numpy / torch values: the converter's number and flag hooks took them
    until they became passthrough (then: "kv_events_config: enable_kv_cache_events: expected true or false, got
    np.False_"); a bool is still no count and an int no flag."""
    from kvload.serve.kv_publisher import kv_events_argument

    c = kv_events_argument({"enable_kv_cache_events": np.False_, "buffer_steps": np.int64(5),
                            "hwm": torch.tensor(7), "max_queue_size": np.uint16(9)})
    got = (c.enable_kv_cache_events, c.buffer_steps, c.hwm, c.max_queue_size)
    assert got == (False, 5, 7, 9) and [type(v) for v in got] == [bool, int, int, int]
    for key, bad, message in [("buffer_steps", np.True_, "expected an integer from 1 to .*, got true"),
                              ("enable_kv_cache_events", np.int64(1), "expected true or false, got 1"),
                              ("hwm", np.float64(3.0), "expected an integer from 0 to .*, got 3.0")]:
        with pytest.raises(ConfigError, match=f"^kv_events_config: {key}: {message}"):
            kv_events_argument({key: bad})
