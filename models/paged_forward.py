"""Run a transformers model over kvload's block pools: the ``kvload_paged`` attention and one packed forward.

How the pieces meet in transformers 5.x:

* ``AttentionInterface.register("kvload_paged", fn)`` makes ``fn`` the attention of every layer of a
  model whose ``config._attn_implementation`` is ``"kvload_paged"``: for every caller after
  :func:`use_paged_attention`, or (what the executor does, :func:`route_paged_attention`) only inside
  :func:`run_forward` on the calling thread, the model's own implementation for any other call meanwhile.
  The layer calls it as ``fn(module, query, key, value, attention_mask, scaling=..., dropout=...,
  [sliding_window=..., softcap=...,] **kwargs)``, where ``kwargs`` are the forward's extra keyword
  arguments passed down unchanged; :func:`run_forward` passes the step's ``PagedBatch`` that way
  (``kvload_batch=``), and ``module.layer_idx`` names the layer.
* transformers' own mask creation returns ``None`` for an attention implementation that has no
  registered mask function (``masking_utils._preprocess_mask_arguments``); kvload registers none
  and builds its masks itself (causal per sequence, sliding windows from the KV geometry).
* ``use_cache=False`` and no ``cache`` keep transformers' ``DynamicCache`` out of the way — except
  for multi-head latent attention (DeepSeek V3): there :class:`PagedLatentCache` is passed as
  ``cache`` because ``cache.update`` is the one place that sees the latent before ``kv_b_proj``
  expands it, so kvload stores the latent (the MLA pool entry) and hands back the gathered latents.
  On the compiled path it gathers nothing: the attention reads the latents in place in the absorbed
  form (:func:`latent_attention`), folding ``kv_b_proj`` into the queries and the output. On gather +
  SDPA, decode steps and short chunks take the same absorbed form over the latents gathered once per
  layer (plain matmuls); long prefill chunks expand the gathered latents as the model does.
"""

from __future__ import annotations

import contextlib
import copyreg
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from cache_backends.paged_attention import (
    GATHERED_ABSORBED_RATE,
    MLA_CALLS,
    PagedBatch,
    absorbed_costs_less,
    attend,
    attend_in_place,
    attend_latent,
    attend_latent_gathered,
    attend_packed,
)
from models.deepseek_v4_paged import advance, route_v4_attention, step_states, uses_v4

ATTN_IMPLEMENTATION = "kvload_paged"


def paged_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, softcap: float | None = None,
                            kvload_batch: PagedBatch | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``kvload_paged`` attention: write the new K/V into the pools, attend over the cached K/V.

    ``query`` is ``(1, H, N, d)`` (one packed row); ``key``/``value`` are the new tokens' ``(1, Hkv, N, d)``,
    or for MLA the already gathered ``(B, H, max_k, d)`` that :class:`PagedLatentCache` returned (on the
    compiled path one token's, which are ignored: the layer attends over the latents in place).
    Returns ``(1, N, H, d_v)`` and no attention weights.
    """
    batch = kvload_batch
    if batch is None:
        raise RuntimeError("kvload_paged attention needs the step's PagedBatch: run the model through "
                           "models.paged_forward.run_forward (or pass kvload_batch=)")
    if attention_mask is not None:
        raise RuntimeError("kvload_paged attention builds its own masks; transformers passed one (a mask function "
                           "registered for kvload_paged?)")
    if not getattr(module, "is_causal", True):
        raise RuntimeError(f"{type(module).__name__} is bidirectional; kvload_paged serves causal attention only")
    layer = module.layer_idx
    route = batch.route(layer)
    if sliding_window is not None and sliding_window != route.window:
        raise RuntimeError(f"layer {layer}: the model slides over {sliding_window} tokens but the KV geometry says "
                           f"window={route.window}; the layout does not match this model")
    if query.shape[0] != 1 or query.shape[2] != batch.num_tokens:
        raise RuntimeError(f"layer {layer}: expected one packed row of {batch.num_tokens} queries, got "
                           f"{tuple(query.shape)}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if route.kind == "mla" and layer in batch.latent_in_place:  # the cache route stored the latent, gathered none
        return latent_attention(module, batch, layer, query[0].transpose(0, 1), scale).unsqueeze(0), None
    if route.kind == "mla":  # the cache route stored the latent and expanded the gathered keys already
        MLA_CALLS["expanded"] += 1
        k, v = key, value
    else:
        # K/V stored; the compiled path or a paged decode kernel reads the pools in place where the step allows
        out = attend_in_place(batch, layer, query[0].transpose(0, 1), key[0].transpose(0, 1),
                              value[0].transpose(0, 1), scale, softcap)
        if out is not None:
            return out.unsqueeze(0), None
        k, v = batch.gather_kv(layer, key.shape[1], key.shape[3], query.dtype)
        if batch.max_q == 1:
            # decode: sequence b's one query is packed token b, so (1, H, B, d) -> (B, H, 1, d) is one transpose,
            # and the output (B, H, 1, d) -> (1, B, H, d) one permute (no pad/unpad, no squeeze/unsqueeze)
            q = query if batch.num_seqs == 1 else query.transpose(0, 2)  # one sequence: (1, H, 1, d) already
            out = attend(q, k, v, batch.bias(layer, query.dtype), scale, softcap)
            return out.permute(2, 0, 1, 3), None
    return attend_packed(batch, layer, query[0].transpose(0, 1), k, v, scale, softcap).unsqueeze(0), None


#: How fast the compiled kernel does an absorbed query-key pair's multiply-adds against a GEMM's (``kv_b_proj``
#: expanding latents, SDPA), fitted on the 2-core CPU of BENCHMARKS.md ("MLA prefill: absorbed or expanded"):
#: one sequence's chunk of DeepSeek-V2-Lite's shape after 512 cached tokens ran faster absorbed up to 64
#: tokens and slower from 128; this rate puts the switch at ~70. (Chunks from position 0 ran 1.1-1.5x faster
#: expanded at every length: the rule picks absorbed up to ~70 there, costing up to 1.22x in that band.)
ABSORBED_RATE = 0.5


def absorbed_pays(batch: PagedBatch, config: Any, rate: float = ABSORBED_RATE, padded: bool = False,
                  fold: bool = False) -> bool:
    """Whether a step's MLA layers cost less absorbed (per query-key pair) than expanded (per key), by multiply-adds.

    Absorbed, each (query, visible key) pair costs ``2 * kv_lora_rank + qk_rope_head_dim`` per head (the
    latent row's dot product and its latent's share of the output), at :data:`ABSORBED_RATE` of a GEMM's
    speed; expanded, each visible key costs ``kv_lora_rank * (qk_nope_head_dim + v_head_dim)`` per head to
    expand, once per step, plus ``qk_head_dim + v_head_dim`` per pair. Decode steps and short chunks pay
    absorbed; a long prefill chunk pays expanded (its keys are expanded once for all its queries).
    ``rate``, ``padded`` and ``fold`` as in ``paged_attention.absorbed_costs_less`` (gather + SDPA passes its own).
    """
    from models.geometry import text_config

    cfg = text_config(config)
    dims = [getattr(cfg, name, None) for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")]
    if any(not isinstance(d, int) for d in dims):
        return True
    rank, rope, nope, dv = dims
    return absorbed_costs_less(batch, rank, rope, nope, dv, rate, padded, fold)


class PagedLatentCache:
    """The ``cache`` a DeepSeek V3 (MLA) forward gets: stores latents in the pools, returns them gathered.

    transformers calls ``cache.update(kv_latent, k_rope, layer_idx, kwargs=...)`` with the normalised
    latent ``(1, 1, N, kv_lora_rank)`` and the roped key part ``(1, 1, N, qk_rope_head_dim)`` of the new
    tokens, before expanding them into per-head K/V. The pool entry is ``[latent, rope]`` (kv-geometry's
    MLA entry); the return is every visible token's latent and rope part, ``(B, 1, max_k, ·)`` each.
    Only ``update`` is used: mask creation exits before touching a cache for a custom attention.
    """

    def __init__(self, batch: PagedBatch, config: Any = None) -> None:
        self.batch = batch
        #: whether this step's MLA layers attend absorbed (:func:`absorbed_pays`): on the compiled path over the
        #: pools in place, on gather + SDPA over the latents gathered in the attention (at its own rate, padded)
        if batch.flex is not None:
            self.absorbed = config is None or absorbed_pays(batch, config)
        else:
            self.absorbed = config is None or absorbed_pays(batch, config, GATHERED_ABSORBED_RATE, padded=True,
                                                            fold=True)

    def update(self, latent: torch.Tensor, rope: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' ``[latent, rope]`` entries; return the gathered latents and rope parts.

        A step that attends absorbed (:func:`latent_attention`) gathers nothing here (the compiled path
        reads the latents in place; gather + SDPA gathers them in the attention, unexpanded), so this
        returns the first new token's parts only — the model expands them into K/V of one token, which
        the attention ignores (the model's code has no way to skip its ``expand_kv``; one token keeps
        that waste to one row of ``kv_b_proj``). A step whose long prefill chunks make expanding cheaper
        (:func:`absorbed_pays`) gathers here, and the model expands every gathered latent.
        """
        rank = latent.shape[-1]
        self.batch.write(layer_idx, torch.cat((latent[0, 0], rope[0, 0]), dim=-1))
        if self.absorbed:
            self.batch.latent_in_place.add(layer_idx)
            return latent[:, :, :1], rope[:, :, :1]
        entries = self.batch.gather(layer_idx, latent.dtype)
        return entries[..., :rank].unsqueeze(1), entries[..., rank:].unsqueeze(1)


def absorbed_weights(module: Any) -> torch.Tensor | None:
    """``kv_b_proj.weight`` per head, ``(H, nope + d_v, rank)`` (a view), or None when it cannot be folded.

    None when the projection is not a plain floating-point matrix of the expected shape (a quantized
    checkpoint's, for one): the absorbed form folds the weight into queries and outputs as it is.
    """
    proj = getattr(module, "kv_b_proj", None)
    weight = getattr(proj, "weight", None)
    heads, nope = getattr(module, "num_heads", None), getattr(module, "qk_nope_head_dim", None)
    dv, rank = getattr(module, "v_head_dim", None), getattr(module, "kv_lora_rank", None)
    if not isinstance(proj, torch.nn.Linear) or getattr(proj, "bias", None) is not None or None in (heads, nope, dv,
                                                                                                 rank):
        return None
    to_local = getattr(weight, "to_local", None)
    if callable(to_local):  # tensor parallel: a DTensor (torch refuses its view under inference mode), sharded by
        weight = to_local()  # heads when the plan splits it: this rank's rows are its query heads' (q_b_proj's split)
        local = weight.shape[0] // (nope + dv) if weight.ndim == 2 else 0
        if local < 1 or heads % local:
            return None
        heads = local
    if (not isinstance(weight, torch.Tensor) or not weight.is_floating_point()
            or tuple(weight.shape) != (heads * (nope + dv), rank)):
        return None
    return weight.view(heads, nope + dv, rank)


def unfoldable_mla(model: Any) -> str | None:
    """Why the model's MLA layers cannot run in the absorbed form (:func:`absorbed_weights`), or None when they can."""
    for name, module in model.named_modules():
        if hasattr(module, "kv_b_proj") and absorbed_weights(module) is None:
            weight = getattr(module.kv_b_proj, "weight", None)
            what = f"a {type(module.kv_b_proj).__name__}" + (f" of {weight.dtype}" if isinstance(weight, torch.Tensor)
                                                             else "")
            return (f"the MLA layer {name}'s kv_b_proj is {what}, not a plain floating-point matrix the compiled "
                    "path can fold into its queries and outputs")
    return None


def latent_attention(module: Any, batch: PagedBatch, layer: int, query: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """MLA attention over latents the cache route stored in place: packed ``(N, H, d)`` in, ``(N, H, d_v)`` out.

    The absorbed form: on the compiled path over the pools in place (``paged_attention.attend_latent``);
    otherwise over the gathered latents in plain matmuls (``paged_attention.attend_latent_gathered``, also
    when the kernel could not compile). When the projection cannot be folded (:func:`absorbed_weights`:
    a quantized checkpoint's), the latents are gathered and expanded by the model's own ``expand_kv``
    for SDPA, as on the reference path.
    """
    w_kv = absorbed_weights(module)
    if w_kv is not None:
        nope = module.qk_nope_head_dim
        q_nope, q_pe = query[..., :nope], query[..., nope:]
        if batch.flex is not None:
            out = attend_latent(batch, layer, q_nope, q_pe, w_kv, scale)
            if out is not None:
                return out
        return attend_latent_gathered(batch, layer, q_nope, q_pe, w_kv, scale)
    MLA_CALLS["expanded"] += 1
    rank = module.kv_lora_rank
    entries = batch.gather(layer, query.dtype)
    k, v = module.expand_kv(entries[..., :rank].unsqueeze(1), entries[..., rank:].unsqueeze(1))
    return attend_packed(batch, layer, query, k, v, scale)


_on_thread = threading.local()  # .configs: ids of the configs whose forward runs kvload's attention on this thread
_ROUTED: dict[type, type] = {}  # a config class -> its routed subclass
_ROUTED_IDS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()  # model -> its configs' ids


def _routed_class(cls: type) -> type:
    """``cls`` with a thread-aware ``_attn_implementation``: ``kvload_paged`` inside :func:`run_forward` on the
    calling thread, the model's own everywhere else (cached per class)."""
    routed = _ROUTED.get(cls)
    if routed is not None:
        return routed

    def get(self: Any) -> Any:
        if id(self) in getattr(_on_thread, "configs", ()):
            return ATTN_IMPLEMENTATION
        if "_attn_implementation" in self.__dict__:  # a config class that keeps it as a plain attribute
            return self.__dict__["_attn_implementation"]
        return super(routed, self)._attn_implementation

    def reduce_ex(self: Any, protocol: int) -> Any:
        # pickles and deep-copies as the model's own class, through copyreg alone: unpickling needs no kvload
        return copyreg._reconstructor, (cls, object, None), dict(self.__dict__)

    def eq(self: Any, other: Any) -> bool:
        # the dataclass __eq__ transformers generates for every config class asks for the same class
        return isinstance(other, cls) and self.__dict__ == other.__dict__

    routed = type(cls.__name__, (cls,), {"_attn_implementation": property(get, _set_own),
                                         "__reduce_ex__": reduce_ex, "__eq__": eq, "__hash__": cls.__hash__,
                                         "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                         "_kvload_routed": True})
    _ROUTED[cls] = routed
    return routed


def _set_own(self: Any, value: Any) -> None:
    """A routed config's ``_attn_implementation = value``: what the model's own class does with it."""
    for klass in type(self).__mro__[1:]:
        attr = klass.__dict__.get("_attn_implementation")
        if isinstance(attr, property) and attr.fset is not None:
            attr.fset(self, value)
            return
    self.__dict__["_attn_implementation"] = value


def route_paged_attention(model: Any) -> tuple[Any, ...]:
    """Give kvload's attention to the model's layers inside :func:`run_forward` only, on the calling thread.

    Every config a module of ``model`` reads (the model's and its sub-configs) gets a subclass of its own class
    whose ``_attn_implementation`` says ``kvload_paged`` while that thread's forward runs and the model's own
    implementation otherwise, so another thread's ``model(...)`` or ``model.generate`` (or a user's callback on
    this one) runs the model's own attention and masks meanwhile. Idempotent; returns the configs.
    """
    register_paged_attention()
    route_v4_attention(model)  # DeepSeek V4's layers run their own forward over the pools (with a step's batch only)
    configs = {id(c): c for c in [model.config, *(getattr(m, "config", None) for m in model.modules())]
               if hasattr(type(c), "_attn_implementation")}
    for config in configs.values():
        if not getattr(type(config), "_kvload_routed", False):
            config.__class__ = _routed_class(type(config))
    _ROUTED_IDS[model] = frozenset(configs)
    return tuple(configs.values())


@contextlib.contextmanager
def _paged_here(model: Any) -> Iterator[None]:
    """Within the block, ``model``'s routed configs say ``kvload_paged`` on this thread."""
    ids = _ROUTED_IDS.get(model)
    if ids is None:  # routed through another model object sharing the configs
        route_paged_attention(model)
        ids = _ROUTED_IDS[model]
    previous = getattr(_on_thread, "configs", frozenset())
    _on_thread.configs = previous | ids
    try:
        yield
    finally:
        _on_thread.configs = previous


def register_paged_attention() -> str:
    """Register ``kvload_paged`` with transformers' ``AttentionInterface`` (idempotent); return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


def use_paged_attention(model: Any) -> Any:
    """Switch a loaded model's attention to ``kvload_paged`` (its ``generate`` then needs kvload's driver)."""
    register_paged_attention()
    route_v4_attention(model)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def uses_latent_cache(batch: PagedBatch) -> bool:
    """Whether the layout has MLA layers (their entries go through :class:`PagedLatentCache`)."""
    return any(layer.kind == "mla" for layer in batch.pools.layout.layers)


def run_forward(model: Any, batch: PagedBatch) -> torch.Tensor:
    """One packed forward of a step; returns ``(num_chunks, vocab)`` logits at each chunk's last token."""
    routed = getattr(type(model.config), "_kvload_routed", False)
    impl = getattr(model.config, "_attn_implementation", None)
    if not routed and impl != ATTN_IMPLEMENTATION:
        raise RuntimeError(f"the model's attention is {impl!r}; call models.paged_forward.route_paged_attention(model) "
                           "(or use_paged_attention) first")
    cache = PagedLatentCache(batch, model.config) if uses_latent_cache(batch) else None
    v4 = uses_v4(batch.pools.layout.layers)
    if v4 and batch.side is None:  # a one-off forward (no executor): every chunk must start at position 0
        step_states(batch)
    with torch.inference_mode(), (_paged_here(model) if routed else contextlib.nullcontext()):
        out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, cache=cache, use_cache=False,
                    logits_to_keep=batch.logits_to_keep, kvload_batch=batch)
    if v4:
        advance(batch)
    return out.logits[0]
