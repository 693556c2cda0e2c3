"""DeepSeek V4 weights in float16: transformers keeps its compressor projections in float32 under float16 and its
forward then fails, so such a load is refused in one line before the weights load (a preset's random weights, cast
whole, still run)."""

from __future__ import annotations

import pytest

from pipeline.errors import ModelError
from tests.generate_support import load, prompts_for


def test_a_float16_deepseek_v4_checkpoint_is_refused_in_one_line_before_its_weights_load(tiny_checkpoints,
                                                                                      monkeypatch):
    """It failed inside the first forward (``expected m1 and m2 to have the same dtype``, exit 1) after the load."""
    import transformers

    def never(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    with pytest.raises(ModelError) as info:
        load(tiny_checkpoints("deepseek-v4"), "v2", llm={"dtype": "float16"})
    message = str(info.value)
    assert "\n" not in message and "dtype 'float16'" in message and "bfloat16 or float32" in message
    assert ModelError.exit_code == 2


def test_the_float16_preset_still_generates():
    """The preset's random weights are built in float16 whole (no float32 projections): they run as before."""
    result = load("tiny-deepseek-v4", "v2", llm={"dtype": "float16"})
    try:
        (out,) = result.generate(prompts_for(512, (21,)), max_new_tokens=4)
        assert len(out.token_ids) == 4
    finally:
        result.close()
