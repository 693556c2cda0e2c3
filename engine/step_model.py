"""What an engine step would cost on a GPU: a roofline over the step's batch (``kvload simulate``'s modeled time).

Why: the simulator counts engine steps, and a step is a step whether it decodes one token for 8 requests or
prefills 8,192 prompt tokens. On a GPU those differ by orders of magnitude: a decode step is bound by reading the
weights and the KV it attends, a prefill chunk by its FLOPs. So a manager that reuses more of a prompt, or batches
more decodes into one weight read, saves time that "steps" does not show, and one that runs larger batches pays
for them. The model prices each step as the slower of its bytes and its FLOPs on one device (the roofline):

* bytes: the weights read once per step (a mixture-of-experts layer reads the experts its tokens pick: of ``E``
  experts with ``k`` per token, ``t`` tokens touch ``E * (1 - (1 - k/E) ** t)`` on average; an untied input
  embedding is a gather, not a read) plus, per layer, the KV each scheduled chunk attends, read once per chunk:
  ``min(end, window)`` entries of the layer's ``entry_elems`` (MLA: the latent) at the KV dtype;
* FLOPs: ``2 x`` active non-embedding parameters per computed token, ``2 x vocab x hidden`` per sequence that
  samples (the last prompt token or a decode), and attention's ``4 x heads x head_dim`` per query-key pair;
* time: ``max(bytes / bandwidth, flops / peak)`` at the hardware's nominal figures (:data:`HARDWARE`), plus what
  the step's suspends and resumes copied over the host link (V2's host tier; :meth:`StepModel.transfer_seconds`),
  which the manager waits for before the pages change hands.

Nominal peaks make it a lower bound, one model for every manager: what it compares fairly is two managers'
schedules of one workload, not a prediction of wall time. Launch overheads, communication and the host's
scheduling time are not in it (the simulator reports the measured manager time beside it). The whole model runs on
one device whatever its size (``tensor_parallel_size`` divides nothing here), its weights at the load's ``dtype``
(a quantized checkpoint's smaller weights are not seen).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from cache_backends.layout import DTYPE_SIZES, LayerKV
from models.cost import DEFAULT_HARDWARE, HARDWARE, Hardware, ModelCost, count_weights, model_cost

__all__ = ["DEFAULT_HARDWARE", "HARDWARE", "Hardware", "ModelCost", "StepModel", "count_weights", "model_cost"]


@attrs.frozen
class StepModel:
    """Prices one engine step's batch on :attr:`hardware` (module docstring)."""

    cost: ModelCost
    layers: tuple[LayerKV, ...]
    kv_dtype_bytes: int
    hardware: Hardware
    #: layers that attend alike, summed: (window or None, KV bytes per token of all of them, how many)
    _by_window: list[tuple[int | None, int, int]] = attrs.field(init=False)
    #: compressed entries: (rate, bytes per entry of every layer with that rate)
    _compressed: list[tuple[int, int]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        by_window: dict[int | None, tuple[int, int]] = {}
        compressed: dict[int, int] = {}
        for layer in self.layers:
            size, count = by_window.get(layer.window, (0, 0))
            by_window[layer.window] = (size + layer.entry_elems * self.kv_dtype_bytes, count + 1)
            if layer.compress_rate:
                compressed[layer.compress_rate] = (compressed.get(layer.compress_rate, 0)
                                                   + layer.compressed_elems * self.kv_dtype_bytes)
        # a frozen class sets its derived fields once, here
        object.__setattr__(self, "_by_window", [(w, b, n) for w, (b, n) in by_window.items()])
        object.__setattr__(self, "_compressed", list(compressed.items()))

    @classmethod
    def build(cls, hf_config: Any, layers: Iterable[LayerKV], weight_dtype: str, kv_dtype: str,
              hardware: str = DEFAULT_HARDWARE) -> StepModel:
        """The model of ``hf_config`` with KV ``layers`` (``models.geometry.layers_from_config``), weights at
        ``weight_dtype`` and KV at ``kv_dtype``, on one of :data:`HARDWARE`."""
        if hardware not in HARDWARE:
            raise ValueError(f"hardware {hardware!r} is not one of {', '.join(HARDWARE)}")
        return cls(model_cost(hf_config, DTYPE_SIZES[weight_dtype]), tuple(layers), DTYPE_SIZES[kv_dtype],
                   HARDWARE[hardware])

    def step_seconds(self, chunks: Sequence[tuple[int, int, bool]]) -> float:
        """The roofline time of one step computing ``chunks``: (tokens already computed, tokens this step, whether
        the chunk ends where the sequence samples its next token)."""
        if not chunks:
            return 0.0
        c = self.cost
        tokens = sum(n for _, n, _ in chunks)
        sampled = sum(1 for _, _, s in chunks if s)
        weights = c.dense_bytes
        if c.expert_bytes:
            share = c.experts_per_token / c.num_experts if c.num_experts else 1.0
            weights += c.expert_bytes * (1.0 - (1.0 - share) ** tokens)
        flops = tokens * c.flops_per_token
        flops += c.lm_head_flops * sampled
        kv_bytes = 0.0
        pairs = 0.0
        for window, entry_bytes, n_layers in self._by_window:
            for start, n, _ in chunks:
                end = start + n
                kv_bytes += entry_bytes * (end if window is None else min(end, window))
                # each query i (at position start + i) sees min(position + 1, window) keys
                if window is None or end <= window:
                    pairs += n_layers * (n * start + n * (n + 1) / 2)
                elif start >= window:
                    pairs += n_layers * n * window
                else:  # the chunk crosses the window: a triangle up to it, then whole windows
                    below = window - start
                    pairs += n_layers * (below * start + below * (below + 1) / 2 + (n - below) * window)
        for rate, entry_bytes in self._compressed:  # DeepSeek V4: one compressed entry per rate tokens, all of them
            kv_bytes += entry_bytes * sum((start + n) // rate for start, n, _ in chunks)
        flops += 4.0 * c.attn_width * pairs
        hw = self.hardware
        return max((weights + kv_bytes) / hw.bytes_per_s, flops / hw.flops_per_s)

    def transfer_seconds(self, nbytes: int) -> float:
        """The time ``nbytes`` take over the host link one way (a suspend's pages out, a resume's back)."""
        return nbytes / self.hardware.host_bytes_per_s
