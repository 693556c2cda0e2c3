"""KV cache events: what a KV-aware router needs to know about a manager's prefix cache.

Modelled on vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` and TensorRT-LLM's
``KVCacheEvent`` (stored / removed / cleared): a manager with a :class:`KvEventBuffer` (built when
``kv_cache_config.event_buffer_max_size > 0``) records

* ``kv_block_stored`` — full blocks became reusable prefix cache: their chained hashes (hex), the
  parent block's hash, their token ids, tokens per block, the layer group and the medium;
* ``kv_block_removed`` — cached blocks were evicted or dropped (their hashes, group, medium);
* ``kv_all_blocks_cleared`` — the prefix cache was reset.

The buffer keeps the newest ``max_size`` events; older ones are dropped and counted
(:attr:`KvEventBuffer.dropped`), so a slow reader learns it missed some. A manager without a
buffer pays one ``is None`` test per hook site. Thread-safe: the engine records, a server drains.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import IO, Any

STORED = "kv_block_stored"
REMOVED = "kv_block_removed"
CLEARED = "kv_all_blocks_cleared"


class KvEventBuffer:
    """A bounded buffer of KV cache events, optionally mirrored to a JSON Lines file as they happen."""

    def __init__(self, max_size: int, jsonl: IO[str] | None = None) -> None:
        if max_size < 1:
            raise ValueError(f"a KV event buffer needs max_size >= 1, got {max_size}")
        self.max_size = max_size
        self._events: deque[dict[str, Any]] = deque()
        self._lock = threading.Lock()
        self._seq = 0
        self.dropped = 0  # events pushed out before anyone drained them (since the last drain)
        self.jsonl = jsonl

    def stored(self, hashes: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int], tokens_per_block: int,
               group: str, medium: str = "device") -> None:
        """Blocks keyed by ``hashes`` (chained, in order) now hold a reusable prefix."""
        if hashes:
            self._record({"type": STORED, "block_hashes": [h.hex() for h in hashes],
                          "parent_block_hash": parent.hex() if parent is not None else None,
                          "token_ids": list(token_ids), "tokens_per_block": tokens_per_block, "layer_group": group,
                          "medium": medium})

    def removed(self, hashes: Iterable[bytes | None], group: str, medium: str = "device") -> None:
        """Cached blocks keyed by ``hashes`` no longer hold their prefix (evicted or dropped)."""
        keys = [h.hex() for h in hashes if h is not None]
        if keys:
            self._record({"type": REMOVED, "block_hashes": keys, "layer_group": group, "medium": medium})

    def cleared(self) -> None:
        """Every cached prefix was forgotten."""
        self._record({"type": CLEARED})

    def drain(self) -> dict[str, Any]:
        """Every buffered event, oldest first, and how many were dropped since the last drain; empties the buffer."""
        with self._lock:
            events, self._events = list(self._events), deque()
            dropped, self.dropped = self.dropped, 0
        return {"events": events, "dropped": dropped}

    def __len__(self) -> int:
        return len(self._events)

    def _record(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._seq += 1
            event = {"seq": self._seq, "ts": time.time(), **event}
            if len(self._events) >= self.max_size:
                self._events.popleft()
                self.dropped += 1
            self._events.append(event)
            if self.jsonl is not None:
                self.jsonl.write(json.dumps(event, separators=(",", ":")) + "\n")
                self.jsonl.flush()


__all__ = ["CLEARED", "REMOVED", "STORED", "KvEventBuffer"]
