"""Read a model's KV geometry from its Hugging Face config (after ``AutoConfig`` filled it in).

Only the config's own fields are used (``layer_types``, ``sliding_window``, ``use_sliding_window``,
``kv_lora_rank``, ``head_dim``, ``text_config``, DeepSeek V4's ``compress_rates``), so an
architecture with no spec of its own still gets the right geometry.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from cache_backends.layout import LayerKV
from models.config_check import head_groups_problem
from pipeline.errors import ModelError

V4_LAYER_KINDS = {
    "sliding_attention": "v4_sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
_PLAIN_LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}


def text_config(cfg: Any) -> Any:
    """The decoder's config: ``text_config`` for multimodal wrappers, else the config itself."""
    inner = getattr(cfg, "text_config", None)
    if inner is not None and not hasattr(inner, "num_hidden_layers") and not isinstance(inner, dict):
        raise ModelError(f"text_config: expected the decoder's config, got {type(inner).__name__}")
    return inner if inner is not None else cfg


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    value = getattr(cfg, name, default)
    return default if value is None else value


def _required(cfg: Any, name: str, arch: str) -> int:
    value = getattr(cfg, name, None)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelError(
            f"{arch}: config has no usable '{name}' (got {value!r}); kvload cannot derive the KV geometry"
        )
    return value


def head_dim(cfg: Any, arch: str = "model") -> int:
    """``head_dim`` when the config gives one, else ``hidden_size / num_attention_heads``.

    A ``head_dim`` that is there but unusable (0, negative, not an integer) is an error, never
    silently replaced by the division.
    """
    if getattr(cfg, "head_dim", None) is not None:
        return _required(cfg, "head_dim", arch)
    return _required(cfg, "hidden_size", arch) // _required(cfg, "num_attention_heads", arch)


def kv_heads(cfg: Any, arch: str = "model") -> int:
    """``num_key_value_heads``, or ``num_attention_heads`` when absent (GPT-2 style); an unusable value is an error."""
    if getattr(cfg, "num_key_value_heads", None) is not None:
        return _required(cfg, "num_key_value_heads", arch)
    return _required(cfg, "num_attention_heads", arch)


@attrs.frozen
class HeadSharding:
    """How tensor parallelism splits a model's attention over ``tp_size`` ranks (TensorRT-LLM's and vLLM's rule).

    Query heads always shard (they must divide by the ranks). KV heads shard when their count divides by
    the ranks, and are replicated when the ranks are a multiple of their count (each rank keeps one head,
    ``tp_size / kv_heads`` ranks share it); an MLA latent (or DeepSeek V4's single KV head) is whole on
    every rank. Any other combination is refused.
    """

    tp_size: int
    attention_heads: int
    kv_heads: int  # heads of K/V in the checkpoint (1 for an MLA latent)
    mode: Literal["none", "shard", "replicate", "latent"]
    kv_heads_per_rank: int

    @property
    def attention_heads_per_rank(self) -> int:
        """Query heads each rank computes."""
        return self.attention_heads // self.tp_size

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold a copy of each KV head (1 when they shard)."""
        if self.mode in ("replicate",):
            return self.tp_size // self.kv_heads
        return self.tp_size if self.mode == "latent" else 1

    def to_dict(self) -> dict[str, Any]:
        """Plain form for events and ``--json``."""
        return {**attrs.asdict(self), "attention_heads_per_rank": self.attention_heads_per_rank,
                "kv_replicas": self.kv_replicas}


def is_latent(cfg: Any) -> bool:
    """Whether the KV cache holds one latent per token shared by every head (MLA, DeepSeek V4)."""
    cfg = text_config(cfg)
    layer_types = getattr(cfg, "layer_types", None) or []
    return bool(getattr(cfg, "kv_lora_rank", None)) or any(t in V4_LAYER_KINDS and t != "sliding_attention"
                                                            for t in layer_types)


def head_sharding(cfg: Any, tp_size: int, arch: str = "model") -> HeadSharding:
    """The heads each of ``tp_size`` ranks holds; ``ModelError`` (one line, the sizes accepted) if they cannot."""
    cfg = text_config(cfg)
    latent = is_latent(cfg)
    if tp_size == 1:  # nothing to split: report what the config says, require nothing
        given = getattr(cfg, "num_attention_heads", None)
        heads = given if isinstance(given, int) and given > 0 else 0
        n = getattr(cfg, "num_key_value_heads", None)
        n_kv = 1 if latent else (n if isinstance(n, int) and n > 0 else heads)
        return HeadSharding(1, heads, n_kv, "none", n_kv)
    heads = _required(cfg, "num_attention_heads", arch)
    n_kv = 1 if latent else kv_heads(cfg, arch)
    what = f"tensor_parallel_size={tp_size}: {arch}"
    mode = sharding_mode(heads, None if latent else n_kv, tp_size)
    if mode is None and heads % tp_size:
        raise ModelError(f"{what} has {heads} attention heads, which do not divide by {tp_size} ranks; "
                         f"accepted: {accepted_sizes(heads, None if latent else n_kv)}")
    if mode is None:
        raise ModelError(f"{what} has {n_kv} KV heads: {tp_size} ranks neither divide them nor are a multiple of "
                         f"them; accepted: {accepted_sizes(heads, n_kv)}")
    return HeadSharding(tp_size, heads, n_kv, mode, n_kv // tp_size if mode == "shard" else 1)


def sharding_mode(heads: int, n_kv: int | None, tp_size: int) -> str | None:
    """How ``tp_size`` ranks split ``heads`` query heads and ``n_kv`` KV heads (None: an MLA latent, held whole):
    ``"latent"``, ``"shard"`` (the KV heads divide by the ranks), ``"replicate"`` (the ranks are a multiple of the KV
    heads, each rank holding one); None when they cannot (the query heads must divide by the ranks). The one rule
    :func:`head_sharding`, :func:`accepted_sizes` and ``stages.check_parallel`` apply."""
    if heads % tp_size:
        return None
    if n_kv is None:
        return "latent"
    if n_kv % tp_size == 0:
        return "shard"
    return "replicate" if tp_size % n_kv == 0 else None


def accepted_sizes(heads: int, n_kv: int | None, most: int | None = None) -> str:
    """The tensor-parallel sizes (up to ``most``) that ``heads`` query heads and ``n_kv`` KV heads (None: an MLA
    latent) accept (:func:`sharding_mode`), for error messages; those that replicate KV heads said apart:
    transformers' plans never replicate one, so loading weights (generate, serve, ``kvload.LLM``) refuses them
    (``stages.check_parallel.check_plan_matches_pools``), and a message listing them bare sent users to one."""
    top = heads if most is None else min(heads, most)
    modes = {t: sharding_mode(heads, n_kv, t) for t in range(1, top + 1)}
    ok = [t for t, mode in modes.items() if mode is not None]
    text = ", ".join(map(str, ok))
    only = [t for t, mode in modes.items() if mode == "replicate"]
    if only:
        text += (f" ({', '.join(map(str, only))} only to plan and run: loading weights needs a size that divides the "
                 f"{n_kv} KV heads)")
    return text


def layers_from_config(cfg: Any, arch: str = "model", tp_size: int = 1) -> list[LayerKV]:
    """One :class:`LayerKV` per decoder layer (``kv-geometry.md``), as one of ``tp_size`` ranks holds it.

    With tensor parallelism a rank keeps only its KV heads (:func:`head_sharding`); an MLA latent is whole.
    """
    cfg = text_config(cfg)
    n_layers = _required(cfg, "num_hidden_layers", arch)
    layer_types = getattr(cfg, "layer_types", None)
    # one rank: every KV head (and no check that needs num_attention_heads, which kv_heads may do without)
    sharding = head_sharding(cfg, tp_size, arch) if tp_size > 1 else None

    if layer_types and any(t in ("compressed_sparse_attention", "heavily_compressed_attention") for t in layer_types):
        return _deepseek_v4_layers(cfg, layer_types, arch)

    if getattr(cfg, "kv_lora_rank", None):
        latent = _required(cfg, "kv_lora_rank", arch) + _required(cfg, "qk_rope_head_dim", arch)
        return [LayerKV(i, "mla", latent) for i in range(n_layers)]

    # config.json was checked before transformers read it; this catches what only the loaded config shows
    # (a GGUF header's heads, a num_key_value_heads transformers filled in with its class default)
    problem = head_groups_problem({name: getattr(cfg, name, None)
                                   for name in ("num_attention_heads", "num_key_value_heads")})
    if problem:
        raise ModelError(f"{arch}: {problem} (as transformers read the config: it fills in what the file leaves out)")
    heads = sharding.kv_heads_per_rank if sharding is not None else kv_heads(cfg, arch)
    entry = 2 * heads * head_dim(cfg, arch)
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) is False:
        window = None
    if layer_types:
        if len(layer_types) != n_layers:
            raise ModelError(f"{arch}: layer_types has {len(layer_types)} entries for {n_layers} layers")
        unknown = sorted({t for t in layer_types if t not in _PLAIN_LAYER_KINDS})
        if unknown:
            raise ModelError(
                f"{arch}: layer type(s) {', '.join(unknown)} have no KV geometry kvload knows "
                f"(known: {', '.join(dict.fromkeys([*_PLAIN_LAYER_KINDS, *V4_LAYER_KINDS]))})"
            )
        if "sliding_attention" in layer_types and not window:
            raise ModelError(f"{arch}: sliding_attention layers but no sliding_window in the config")
        return [
            LayerKV(i, "sliding", entry, window=window) if t == "sliding_attention" else LayerKV(i, "full", entry)
            for i, t in enumerate(layer_types)
        ]
    if window:  # Mistral style: a window and no layer_types means every layer slides
        return [LayerKV(i, "sliding", entry, window=window) for i in range(n_layers)]
    return [LayerKV(i, "full", entry) for i in range(n_layers)]


def _deepseek_v4_layers(cfg: Any, layer_types: list[str], arch: str) -> list[LayerKV]:
    window = _required(cfg, "sliding_window", arch)
    hd = head_dim(cfg, arch)
    raw = kv_heads(cfg, arch) * hd  # K and V are one tensor in V4
    rates = dict(getattr(cfg, "compress_rates", None) or {})
    index_hd = _get(cfg, "index_head_dim", 0)
    layers = []
    for i, t in enumerate(layer_types):
        kind = V4_LAYER_KINDS.get(t)
        if kind is None:
            raise ModelError(f"{arch}: layer {i} has type {t!r}; DeepSeek V4 layers are {', '.join(V4_LAYER_KINDS)}")
        if kind == "v4_sliding":
            layers.append(LayerKV(i, kind, raw, window=window))
            continue
        rate = rates.get(t)
        if not isinstance(rate, int) or rate <= 0:
            raise ModelError(f"{arch}: compress_rates has no positive rate for {t}")
        compressed = hd + index_hd if kind == "csa" else hd
        layers.append(LayerKV(i, kind, raw, window=window, compressed_elems=compressed, compress_rate=rate))
    return layers
