"""TensorRT-LLM's LLM API as its quickstart writes it (``from tensorrt_llm import LLM, SamplingParams`` read as
``kvload``'s): ``LLM(model=..., kv_cache_config=KvCacheConfig(...))``, ``SamplingParams`` with TensorRT-LLM's own
fields, ``llm.generate``, ``llm.shutdown()``. Each of its names acts, or is one line saying what kvload does instead
(its fields at TensorRT-LLM's defaults are taken: they ask for nothing)."""

from __future__ import annotations

import pytest

import kvload
from engine.sampling_params import SamplingParams
from pipeline.config import KvCacheConfig
from pipeline.errors import GenerationError
from tests.llm_support import with_tokenizer

VOCAB = 512  # the tiny llama's
PROMPTS = ["w5 w17 w300", "w42 w9"]  # word tokens of the test tokenizer


@pytest.fixture(scope="module")
def words(tiny_checkpoints, tmp_path_factory):
    return with_tokenizer(tiny_checkpoints("llama"), tmp_path_factory.mktemp("words") / "ckpt", VOCAB)


def test_the_quickstart_runs_and_shutdown_closes(words):
    llm = kvload.LLM(model=str(words), kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.8, max_tokens=512,
                                                                      tokens_per_block=4),
                     device="cpu", max_seq_len=64, log=False)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=3, seed=0))
    assert [o.prompt for o in outputs] == PROMPTS
    assert all(isinstance(o.outputs[0].text, str) and len(o.outputs[0].token_ids) == 3 for o in outputs)
    llm.shutdown()
    with pytest.raises(GenerationError, match="this LLM was closed"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=1))


#: TensorRT-LLM's SamplingParams fields kvload lacks, each at TensorRT-LLM's default (tensorrt_llm/sampling_params.py)
TRTLLM_DEFAULTS = dict(end_id=None, pad_id=None, bad=None, bad_token_ids=None, embedding_bias=None,
                       logits_processor=None, apply_batched_logits_processor=False, use_beam_search=False,
                       top_p_min=None, top_p_reset_ids=None, top_p_decay=None, beam_search_diversity_rate=None,
                       length_penalty=None, early_stopping=None, no_repeat_ngram_size=None, beam_width_array=None,
                       return_context_logits=False, return_generation_logits=False, exclude_input_from_output=True,
                       return_encoder_output=False, return_perf_metrics=False, additional_model_outputs=None,
                       lookahead_config=None, add_special_tokens=True)


def test_trtllm_fields_at_their_defaults_ask_for_nothing():
    params = SamplingParams(max_tokens=8, **TRTLLM_DEFAULTS)
    assert params == SamplingParams(max_tokens=8)
    assert params.use_beam_search is False and params.end_id is None  # read back as TensorRT-LLM's params hold them


@pytest.mark.parametrize(("field", "value", "instead"), [
    ("end_id", 2, "give stop_token_ids=[id]"),
    ("pad_id", 0, "unpadded"),
    ("use_beam_search", True, "LLM.beam_search(prompts, BeamSearchParams(beam_width=k"),
    ("length_penalty", 1.0, "LLM.beam_search"),
    ("bad_token_ids", [5], "logit_bias={id: -100}"),
    ("return_context_logits", True, "prompt_logprobs=k"),
    ("return_log_probs", True, "give logprobs=k"),
    ("exclude_input_from_output", False, "RequestOutput.prompt_token_ids"),
    ("no_repeat_ngram_size", 3, "repetition_penalty"),
])
def test_a_trtllm_field_kvload_lacks_says_what_to_do_instead(field, value, instead):
    with pytest.raises(GenerationError) as err:
        SamplingParams(**{field: value})
    text = str(err.value)
    assert text.startswith(f"generate: {field}: TensorRT-LLM's SamplingParams field, not kvload's: ")
    assert instead in text and "accepted: " in text


def test_bad_is_trtllms_name_of_bad_words():
    assert SamplingParams(bad="w5").bad_words == ["w5"]  # TensorRT-LLM takes one string too
    assert SamplingParams(bad=["w5", "w6"]) == SamplingParams(bad_words=["w5", "w6"])
    with pytest.raises(GenerationError, match="bad and bad_words are one setting"):
        SamplingParams(bad="w5", bad_words=["w6"])
    # read and set as TensorRT-LLM's mutable params are (sp.bad = [...]): it said "unknown SamplingParams field 'bad'"
    params = SamplingParams()
    assert params.bad is None
    params.bad = "w5"
    assert params.bad_words == ["w5"] and params.bad == ["w5"]


def test_trtllm_fields_as_generate_keywords_and_its_methods_say_what_to_do(words):
    with kvload.LLM(str(words), kv_cache_config={"max_tokens": 512, "tokens_per_block": 4}, device="cpu",
                    max_seq_len=64, log=False) as llm:
        with pytest.raises(GenerationError, match="^generate: end_id: TensorRT-LLM's SamplingParams field"):
            llm.generate(PROMPTS, max_tokens=1, end_id=7)
        assert len(llm.generate(PROMPTS, max_tokens=1, use_beam_search=False)) == 2
        with pytest.raises(AttributeError, match=r"^LLM\.generate_async: TensorRT-LLM's, not kvload's: .*"
                                                 r"generate_stream"):
            llm.generate_async(PROMPTS[0])
        with pytest.raises(AttributeError, match=r"^LLM\.get_kv_cache_events: TensorRT-LLM's, not kvload's"):
            llm.get_kv_cache_events()
