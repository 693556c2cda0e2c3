"""vLLM's import path of the prompt dicts (``from vllm.inputs import TokensPrompt``), so a script's import line reads
the same with ``kvload`` in place of ``vllm``; they are ``engine.prompts``', as ``kvload`` exports them."""

from __future__ import annotations

from engine.prompts import TextPrompt, TokensPrompt

__all__ = ["TextPrompt", "TokensPrompt"]
