"""vLLM's import path of the sampling parameters (``from vllm.sampling_params import ...``), so a script's import
line reads the same with ``kvload`` in place of ``vllm``; the classes are ``engine``'s, as ``kvload`` exports them."""

from __future__ import annotations

from engine.beam_search import BeamSearchParams
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.structured_params import StructuredOutputsParams

__all__ = ["BeamSearchParams", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
