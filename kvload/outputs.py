"""vLLM's import path of the outputs (``from vllm.outputs import RequestOutput``), so a script's import line reads the
same with ``kvload`` in place of ``vllm``; they are ``engine``'s, as ``kvload`` exports them."""

from __future__ import annotations

from engine.outputs import CompletionOutput, RequestOutput
from engine.pooling import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)

__all__ = ["ClassificationOutput", "ClassificationRequestOutput", "CompletionOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "PoolingOutput", "PoolingRequestOutput", "RequestOutput", "ScoringOutput",
           "ScoringRequestOutput"]
