"""vLLM's examples/offline_inference/basic/embed.py (commit 3e990f4ce675) and score.py (commit bcf9083ca17e), as a
vLLM user runs them with kvload.

The calls are the examples': FlexibleArgumentParser returned by EngineArgs.add_cli_args, set_defaults(model=...,
runner="pooling", enforce_eager=True), LLM(**vars(args)), llm.embed(prompts) read as output.outputs.embedding, and
llm.score(text_1, texts_2) read as output.outputs.score; only the import lines (vllm -> kvload) and the models
(intfloat/e5-small, BAAI/bge-reranker-v2-m3 -> smollm2-135m) differ. embed.py's ROCm branch (vLLM's
current_platform and AttentionConfig) is left out: vLLM's platform internals, which kvload does not have.
"""

from argparse import Namespace

from kvload import LLM, EngineArgs
from kvload.utils.argparse_utils import FlexibleArgumentParser


def parse_args():
    parser = FlexibleArgumentParser()
    parser = EngineArgs.add_cli_args(parser)
    parser.set_defaults(model="smollm2-135m", runner="pooling", enforce_eager=True)
    return parser.parse_args()


def main(args: Namespace):
    llm = LLM(**vars(args))
    prompts = ["Hello, my name is", "The capital of France is"]
    for prompt, output in zip(prompts, llm.embed(prompts), strict=True):
        embeds = output.outputs.embedding
        trimmed = (str(embeds[:16])[:-1] + ", ...]") if len(embeds) > 16 else embeds
        print(f"Prompt: {prompt!r} \nEmbeddings: {trimmed} (size={len(embeds)})")
    text_1 = "What is the capital of France?"
    texts_2 = ["The capital of Brazil is Brasilia.", "The capital of France is Paris."]
    for text_2, output in zip(texts_2, llm.score(text_1, texts_2), strict=True):
        print(f"Pair: {[text_1, text_2]!r} \nScore: {output.outputs.score}")


if __name__ == "__main__":
    main(parse_args())
