"""vLLM's examples/offline_inference/basic/generate.py (commit 10b62e386059), as a vLLM user runs it with kvload.

The calls are the example's: FlexibleArgumentParser, an argument group given to EngineArgs.add_cli_args, the group's
set_defaults(model=...), the script's own sampling flags popped from vars(args), LLM(**args),
llm.get_default_sampling_params() changed attribute by attribute; only the import lines (vllm -> kvload) and the
default model (meta-llama/Llama-3.2-1B-Instruct -> smollm2-135m) differ.
"""

from kvload import LLM, EngineArgs
from kvload.utils import FlexibleArgumentParser


def main(args: dict):
    max_tokens, temperature = args.pop("max_tokens"), args.pop("temperature")
    top_p, top_k = args.pop("top_p"), args.pop("top_k")
    llm = LLM(**args)
    sampling_params = llm.get_default_sampling_params()
    if max_tokens is not None:
        sampling_params.max_tokens = max_tokens
    if temperature is not None:
        sampling_params.temperature = temperature
    if top_p is not None:
        sampling_params.top_p = top_p
    if top_k is not None:
        sampling_params.top_k = top_k
    prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
               "The future of AI is"]
    for output in llm.generate(prompts, sampling_params):
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")


if __name__ == "__main__":
    parser = FlexibleArgumentParser()
    engine_group = parser.add_argument_group("Engine arguments")
    EngineArgs.add_cli_args(engine_group)
    engine_group.set_defaults(model="smollm2-135m")
    sampling_group = parser.add_argument_group("Sampling parameters")
    sampling_group.add_argument("--max-tokens", type=int)
    sampling_group.add_argument("--temperature", type=float)
    sampling_group.add_argument("--top-p", type=float)
    sampling_group.add_argument("--top-k", type=int)
    main(vars(parser.parse_args()))
