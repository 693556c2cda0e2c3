"""vLLM's examples/offline_inference/basic/basic.py (commit d5c95556302c), as a vLLM user runs it with kvload.

The calls are the example's: module-level SamplingParams(temperature=0.8, top_p=0.95), LLM(model=...),
llm.generate(prompts, sampling_params), output.prompt / output.outputs[0].text; only the import line (vllm -> kvload)
and the model name (facebook/opt-125m -> smollm2-135m) differ.
"""

from kvload import LLM, SamplingParams

prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
           "The future of AI is"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def main():
    llm = LLM(model="smollm2-135m")
    outputs = llm.generate(prompts, sampling_params)
    print("\nGenerated Outputs:\n" + "-" * 60)
    for output in outputs:
        print(f"Prompt:    {output.prompt!r}")
        print(f"Output:    {output.outputs[0].text!r}")
        print("-" * 60)


if __name__ == "__main__":
    main()
