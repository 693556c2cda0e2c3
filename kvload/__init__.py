"""kvload: load an LLM the way a serving engine does, with explicit stages and an audit log.

The front door: ``kvload.LLM`` (load a model, ``.generate`` / ``.generate_stream`` / ``.beam_search`` / ``.embed`` /
``.classify`` with ``kvload.PoolingParams``),
``kvload.SamplingParams`` (with ``kvload.StructuredOutputsParams``), ``kvload.BeamSearchParams`` and the outputs
(``RequestOutput``, ``CompletionOutput``,
``TokenDelta``, ``BeamSearchOutput``), vLLM's prompt dicts ``TextPrompt`` / ``TokensPrompt``;
``kvload.plan`` / ``kvload.load`` (the pipeline API); vLLM's script helpers ``EngineArgs`` (``add_cli_args``,
``from_cli_args``, the dataclass) and ``FlexibleArgumentParser`` (also as ``kvload.utils`` /
``kvload.utils.argparse_utils``, vLLM's import paths).
Names are imported on first use, so ``import kvload`` (and the CLI) stays quick: torch and
transformers load only when something needs them.
"""

from __future__ import annotations

import sys

from kvload.shadowing import check_top_level_packages, run_as_the_command

try:
    check_top_level_packages()  # a project's own models/ (or pipeline/, ...) package would hide kvload's
except ImportError as exc:
    if not run_as_the_command():
        raise
    sys.stderr.write(f"error: {exc}\n")  # `python -m kvload` from such a folder: the command's one line, exit 1
    raise SystemExit(1) from None

from pipeline.lazy import lazy_exports  # after the check: a project's pipeline/ would hide this one

_EXPORTS = {
    "LoadResult": "kvload.api",
    "execute": "kvload.api",
    "load": "kvload.api",
    "plan": "kvload.api",
    "LLM": "kvload.llm",
    "EngineArgs": "kvload.engine_args",
    "FlexibleArgumentParser": "kvload.engine_args",
    "SamplingParams": "engine.sampling_params",
    "RequestOutputKind": "engine.sampling_params",
    "StructuredOutputsParams": "engine.structured_params",
    "BeamSearchParams": "engine.beam_search",
    "BeamSearchOutput": "engine.beam_search",
    "BeamSequence": "engine.beam_search",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "TokenDelta": "engine.outputs",
    "PoolingParams": "engine.pooling",
    "EmbeddingOutput": "engine.pooling",
    "EmbeddingRequestOutput": "engine.pooling",
    "ClassificationOutput": "engine.pooling",
    "ClassificationRequestOutput": "engine.pooling",
    "PoolingOutput": "engine.pooling",
    "PoolingRequestOutput": "engine.pooling",
    "ScoringOutput": "engine.pooling",
    "ScoringRequestOutput": "engine.pooling",
    "TextPrompt": "engine.prompts",
    "TokensPrompt": "engine.prompts",
    "KvCacheConfig": "pipeline.config",
    "LlmArgs": "pipeline.config",
    "AUTO": "pipeline.config",
    "KvloadError": "pipeline.errors",
    "ConfigError": "pipeline.errors",
    "ModelError": "pipeline.errors",
    "RouteError": "pipeline.errors",
    "KvBuildError": "pipeline.errors",
    "GenerationError": "pipeline.errors",
    "AuditError": "pipeline.errors",
    "__version__": "pipeline.version",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
