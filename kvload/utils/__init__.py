"""vLLM's import path of ``FlexibleArgumentParser`` (``from vllm.utils import ...``), so a script's import line reads
the same with ``kvload`` in place of ``vllm``; the parser is :mod:`kvload.engine_args`'s."""

from __future__ import annotations

from kvload.engine_args import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
