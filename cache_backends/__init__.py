"""A standalone KV cache library: geometry, budgets, block pools, the V1 and V2 managers, schedulers."""

from cache_backends.layout import DTYPE_SIZES, KvLayout, LayerGroup, LayerKV, build_layout

__all__ = ["DTYPE_SIZES", "KvLayout", "LayerGroup", "LayerKV", "build_layout"]
