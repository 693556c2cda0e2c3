"""vLLM's newer import path of ``FlexibleArgumentParser`` (``from vllm.utils.argparse_utils import ...``)."""

from __future__ import annotations

from kvload.engine_args import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
