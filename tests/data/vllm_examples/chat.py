"""vLLM's examples/offline_inference/basic/chat.py (commit 45c9ce4fa1b6), as a vLLM user runs it with kvload.

The calls are the example's: FlexibleArgumentParser given to EngineArgs.add_cli_args, set_defaults(model=...),
LLM(**args), llm.get_default_sampling_params(), llm.chat(conversation, sampling_params, use_tqdm=False), a batch of
ten conversations with use_tqdm=True, and chat_template= read from --chat-template-path; only the import lines
(vllm -> kvload) and the default model (meta-llama/Llama-3.2-1B-Instruct -> smollm2-135m) differ.
"""

from kvload import LLM, EngineArgs
from kvload.utils.argparse_utils import FlexibleArgumentParser


def create_parser():
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model="smollm2-135m")
    sampling_group = parser.add_argument_group("Sampling parameters")
    sampling_group.add_argument("--max-tokens", type=int)
    sampling_group.add_argument("--temperature", type=float)
    parser.add_argument("--chat-template-path", type=str)
    return parser


def print_outputs(outputs):
    print("\nGenerated Outputs:\n" + "-" * 80)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}\n")
        print(f"Generated text: {output.outputs[0].text!r}")
        print("-" * 80)


def main(args: dict):
    max_tokens, temperature = args.pop("max_tokens"), args.pop("temperature")
    chat_template_path = args.pop("chat_template_path")
    llm = LLM(**args)
    sampling_params = llm.get_default_sampling_params()
    if max_tokens is not None:
        sampling_params.max_tokens = max_tokens
    if temperature is not None:
        sampling_params.temperature = temperature
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    print_outputs(llm.chat(conversation, sampling_params, use_tqdm=False))
    conversations = [conversation for _ in range(10)]
    print_outputs(llm.chat(conversations, sampling_params, use_tqdm=True))
    if chat_template_path is not None:
        with open(chat_template_path) as f:
            chat_template = f.read()
        print_outputs(llm.chat(conversations, sampling_params, use_tqdm=False, chat_template=chat_template))


if __name__ == "__main__":
    main(vars(create_parser().parse_args()))
