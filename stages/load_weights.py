"""Weights stage (between route_executor and build_kv_manager): the model and tokenizer on the resolved device.

It runs before the KV budget is computed so the budget sees the memory the weights took. ``plan``
never runs it; ``load`` runs it and it does work only when ``load_weights=True`` was asked for.
"""

from __future__ import annotations

import gc

from models.weights import load_weights
from pipeline.bus import Emit
from pipeline.context import Context
from pipeline.errors import ModelError
from pipeline.events import WeightsLoaded


class LoadWeights:
    """Writes ``ctx.hf_model`` and ``ctx.tokenizer``; registers their release with ``ctx.on_close``."""

    name = "load_weights"
    error = ModelError

    def run(self, ctx: Context, emit: Emit) -> None:
        """Load weights (random for presets, seeded by ``weights_seed``) and the tokenizer."""
        if not ctx.request.load_weights:
            return
        seed = ctx.args.weights_seed
        device, dtype = str(ctx.args.device), str(ctx.args.dtype)
        loaded = load_weights(ctx.checkpoint, ctx.hf_config, device=device, dtype=dtype, seed=seed)
        ctx.hf_model, ctx.tokenizer = loaded.model, loaded.tokenizer
        ctx.on_close(lambda: _release(ctx))
        emit(WeightsLoaded(
            model=ctx.checkpoint.name, source=loaded.source, path=loaded.path, device=device, dtype=dtype,
            parameters=loaded.num_parameters, bytes=loaded.nbytes, tokenizer=loaded.tokenizer is not None,
            converted=loaded.converted, seed=seed if loaded.source == "random" else None,
            duration_ms=loaded.duration_ms,
        ))


def _release(ctx: Context) -> None:
    """Drop the context's references; device memory returns once no one else holds the model."""
    on_cuda = str(ctx.args.device).startswith("cuda") if ctx.args is not None else False
    ctx.hf_model = None
    ctx.tokenizer = None
    if on_cuda:
        import torch

        gc.collect()
        torch.cuda.empty_cache()
