"""Weights stage (between route_executor and build_kv_manager): the model and tokenizer on the resolved device.

It runs before the KV budget is computed so the budget sees the memory the weights took. ``plan``
never runs it; ``load`` runs it and it does work only when ``load_weights=True`` was asked for.
"""

from __future__ import annotations

import contextlib
import gc
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cache_backends.layout import cannot_generate
from models.compile_cache import use_kvload_compile_cache
from models.gguf_cache import cache_root
from models.weights import has_tokenizer, load_tokenizer, load_weights, save_random_model
from pipeline.bus import Emit
from pipeline.context import Context
from pipeline.errors import ConfigError, GenerationError, KvBuildError, ModelError
from pipeline.events import SettingIgnored, WeightsLoaded
from pipeline.limits import int_text
from stages.check_parallel import check_plan_matches_pools, require_all_ranks
from stages.plan_kv import device_problem


class LoadWeights:
    """Writes ``ctx.hf_model`` and ``ctx.tokenizer``; registers their release with ``ctx.on_close``."""

    name = "load_weights"
    error = ModelError

    def run(self, ctx: Context, emit: Emit) -> None:
        """Load weights (random for presets, seeded by ``weights_seed``) and the tokenizer."""
        if not ctx.request.load_weights:
            return
        if ctx.request.generates and ctx.spec is not None and ctx.model is not None:
            why = cannot_generate(ctx.model.name, ctx.spec.kv_layers())
            if why is not None:  # the executor would refuse it after the weights and pools were built
                raise GenerationError(why)
        check_token_ids(ctx)
        tokenizer = count_text_prompts(ctx)
        check_prompt_room(ctx)
        flag = ctx.request.text_prompts
        if flag is not None and ctx.checkpoint is not None and not has_tokenizer(ctx.checkpoint):
            why = "presets have random weights and none" if ctx.checkpoint.kind == "preset" else \
                f"{ctx.checkpoint.path} holds no tokenizer file"
            raise GenerationError(f"{flag}: {ctx.checkpoint.name} has no tokenizer ({why}), so a text prompt cannot "
                                  "be tokenized; give token ids with --prompt-ids")
        seed = ctx.args.weights_seed
        device, dtype = str(ctx.args.device), str(ctx.args.dtype)
        # before transformers' model code imports torch._dynamo, which makes the folder
        why = use_kvload_compile_cache()
        if why is not None:
            emit(SettingIgnored(field="KVLOAD_CACHE", value=str(cache_root()), reason=why))
        problem = device_problem(device)  # build_kv_manager's check, before torch fails inside the weights' .to()
        if problem is not None:
            raise KvBuildError(problem)
        tp = ctx.args.tensor_parallel_size
        if tp > 1:
            require_all_ranks(ctx, "loading sharded weights")
            check_plan_matches_pools(ctx)
        try:
            with _shared_weights(ctx, dtype, seed) as random_dir:
                loaded = load_weights(ctx.checkpoint, ctx.hf_config, device=device, dtype=dtype, seed=seed,
                                      tp_size=tp, random_dir=random_dir, tokenizer=tokenizer,
                                      overridden=bool(ctx.hf_overrides or ctx.convert))
        except ModelError as exc:  # a vocab_size or hidden_size override reshapes what the weights must fit
            if not ctx.hf_overrides:
                raise
            raise ModelError(f"{exc} (with hf_overrides {', '.join(ctx.hf_overrides)} applied to the config; "
                             "an override that resizes the model needs weights of that size)") from None
        ctx.hf_model, ctx.tokenizer = loaded.model, loaded.tokenizer
        ctx.on_close(lambda: _release(ctx))
        user_seed = ctx.user_fields.get("weights_seed")
        if user_seed is not None and loaded.source != "random":  # only a preset's random weights take a seed
            emit(SettingIgnored(field="weights_seed", value=seed,
                                reason=f"the weights come from the checkpoint ({loaded.source} at {loaded.path}); "
                                       "weights_seed seeds a preset's random weights only"))
        emit(WeightsLoaded(
            model=ctx.checkpoint.name, source=loaded.source, path=loaded.path, device=device, dtype=dtype,
            parameters=loaded.num_parameters, bytes=loaded.nbytes, tokenizer=loaded.tokenizer is not None,
            converted=loaded.converted, seed=seed if loaded.source == "random" else None,
            duration_ms=loaded.duration_ms,
        ))


def config_vocab_size(hf_config: Any) -> int | None:
    """The vocabulary size a transformers config states (its text config's for a multimodal one), None if none."""
    vocab = getattr(hf_config, "vocab_size", None)
    if vocab is None and hasattr(hf_config, "get_text_config"):
        vocab = getattr(hf_config.get_text_config(), "vocab_size", None)
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None


def check_token_ids(ctx: Context) -> None:
    """``GenerationError`` for the first id of ``request.token_ids`` outside the vocabulary of the model's config:
    ``--prompt-ids 1,99999`` was refused by the executor after the weights (seconds to minutes) had loaded."""
    vocab = config_vocab_size(ctx.hf_config) if ctx.request.token_ids else None
    if vocab is None:
        return
    for what, ids in ctx.request.token_ids.items():
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            name = ctx.checkpoint.name if ctx.checkpoint is not None else "the model"
            raise GenerationError(f"generate: {what}: token id {int_text(bad)} is outside the vocabulary "
                                  f"(0..{vocab - 1}: vocab_size {vocab} in {name}'s config)")


def count_text_prompts(ctx: Context) -> Any:
    """The checkpoint's tokenizer, loaded ahead of its weights when the caller counts text prompts
    (``request.prompt_counter``), their token counts put in ``request.prompt_lengths`` for :func:`check_prompt_room`:
    ``--prompt TEXT --max_seq_len 8`` was refused by the executor after the weights (seconds) had loaded, and so were
    a ``--chat`` prompt and any prompt of a GGUF not converted yet (its tokenizer is then read from the file). None
    when there are none, or the checkpoint has no tokenizer."""
    request, checkpoint = ctx.request, ctx.checkpoint
    if request.prompt_counter is None or checkpoint is None or checkpoint.kind == "preset" or not isinstance(
            ctx.args.max_seq_len, int):
        return None
    path: Path | None = checkpoint.path
    if checkpoint.gguf_file:
        from models.gguf_cache import gguf_tokenizer, ready_conversion

        path = ready_conversion(checkpoint)
    # a GGUF not converted yet: its tokenizer read from the file (seconds; its conversion, a minute, saves this one)
    tokenizer = load_tokenizer(path) if path is not None else gguf_tokenizer(checkpoint)
    if tokenizer is None:
        return None
    request.prompt_lengths |= request.prompt_counter(tokenizer, checkpoint.name)
    return tokenizer


def check_prompt_room(ctx: Context) -> None:
    """``ConfigError`` naming max_seq_len when it leaves a prompt the caller gives no room to generate (a text prompt
    holds a token at least): ``--max_seq_len 1`` was refused by the executor after the weights had loaded."""
    request, limit = ctx.request, ctx.args.max_seq_len
    lengths = dict(request.prompt_lengths)
    if request.text_prompts is not None:
        lengths.setdefault(request.text_prompts, 1)
    if not isinstance(limit, int) or not lengths:
        return
    what, n = max(lengths.items(), key=lambda item: item[1])
    if n < limit:
        return
    tokens = "at least one token" if what == request.text_prompts and n == 1 else f"{int_text(n)} tokens"
    detail = (f"{int_text(limit)} leaves no room to generate after {what} ({tokens}; a sequence never grows past "
              f"max_seq_len); expected at least {int_text(n + 1)}, or a shorter prompt")
    user = ctx.user_fields.get("max_seq_len")
    raise ConfigError(f"max_seq_len: {detail}", path="max_seq_len", detail=detail,
                      source=user.source if user is not None else None)


@contextlib.contextmanager
def _shared_weights(ctx: Context, dtype: str, seed: int) -> Iterator[Path | None]:
    """With several ranks: what one rank must write before the others read (their order is set here).

    A preset's random weights are saved by rank 0 to a temporary directory every rank loads its shard from
    (``from_config`` takes no tensor-parallel plan), removed once all have loaded; a GGUF is converted by
    rank 0 into the cache the others then find. One process: nothing to share.
    """
    ranks = ctx.ranks
    if ranks is None or not ranks.distributed or ctx.args.tensor_parallel_size == 1:
        yield None
        return
    tmp = None
    if ctx.checkpoint.kind == "preset":
        try:  # from the folder's creation: a save or a send cut short (a rank lost, a signal) removes it too
            if ranks.is_first:
                tmp = Path(tempfile.mkdtemp(prefix="kvload-tp-"))
                save_random_model(ctx.hf_config, tmp, dtype=dtype, seed=seed)
            shared = ranks.broadcast(str(tmp) if tmp is not None else None)
            yield Path(shared)
            ranks.barrier()  # every rank has read its shard
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        return
    if ctx.checkpoint.gguf_file:
        from models.gguf_cache import convert_gguf

        if ranks.is_first:
            convert_gguf(ctx.checkpoint)
        ranks.barrier()  # the conversion is in the cache: the other ranks find it
    yield None


def _release(ctx: Context) -> None:
    """Drop the context's references; device memory returns once no one else holds the model."""
    on_cuda = str(ctx.args.device).startswith("cuda") if ctx.args is not None else False
    ctx.hf_model = None
    ctx.tokenizer = None
    if on_cuda:
        import torch

        gc.collect()
        torch.cuda.empty_cache()
