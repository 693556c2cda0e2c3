"""KV cache events: what a KV-aware router needs to know about a manager's prefix cache.

Modelled on vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` and TensorRT-LLM's
``KVCacheEvent`` (stored / removed / cleared): a manager with a :class:`KvEventBuffer` (built when
``kv_cache_config.event_buffer_max_size > 0``) records

* ``kv_block_stored`` — full blocks became reusable prefix cache: their chained hashes (hex), the
  parent block's hash, their token ids, tokens per block, the layer group, the medium and the request's
  ``cache_salt`` (None: unsalted; the salt is inside every hash, so a router that matches blocks by token ids
  needs it to tell tenants' equal prompts apart);
* ``kv_block_removed`` — cached blocks were evicted or dropped (their hashes, group, medium);
* ``kv_all_blocks_cleared`` — the prefix cache was reset.

The buffer keeps the newest ``max_size`` events; older ones are dropped and counted
(:attr:`KvEventBuffer.dropped`), so a slow reader learns it missed some. A manager without a
buffer pays one ``is None`` test per hook site. Thread-safe: the engine records, a server drains.

A :class:`KvEventMirror` (``kvload serve --kv-events-file``) appends each event to a file as one whole line; a
``publisher`` (``kvload serve --kv-events-config``, vLLM's ZeroMQ publisher) gets each event to send.
Publishing never fails the engine step that recorded the event (as in vLLM): a failed write (a full disk) cuts
the file back to its last complete line, stops the mirror and is reported once through ``on_failure``; the
in-memory buffer goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

STORED = "kv_block_stored"
REMOVED = "kv_block_removed"
CLEARED = "kv_all_blocks_cleared"


class KvEventMirror:
    """A JSON Lines file that KV cache events are appended to, a whole line per ``write`` (never a cut-off one)."""

    def __init__(self, path: str | os.PathLike[str], flag: str = "--kv-events-file",
                 on_failure: Callable[[KvEventMirror], None] | None = None) -> None:
        self.path = os.fspath(path)
        self.flag = flag  # what the failure report names: the setting the user gave the path with
        self.on_failure = on_failure
        self.error: OSError | None = None  # set once a write failed; the mirror writes nothing after it
        # unbuffered: a buffer would hold a half-written line that a later flush (or close) could still complete
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        self._end = os.lseek(self._fd, 0, os.SEEK_END)  # the end of the last complete line

    @property
    def failed(self) -> bool:
        """Whether a write failed (the mirror stopped)."""
        return self.error is not None

    def write(self, line: bytes) -> None:
        """Append ``line`` whole; OSError after cutting the file back to its last complete line."""
        if self._fd is None:
            return
        view, done = memoryview(line), 0
        try:
            while done < len(line):  # a full disk can take part of a line before it refuses the rest
                done += os.write(self._fd, view[done:])
        except OSError:
            with contextlib.suppress(OSError):  # best effort: the same full disk lets a file shrink
                os.ftruncate(self._fd, self._end)
            raise
        self._end += done

    def fail(self, exc: OSError) -> None:
        """Stop mirroring after ``exc`` (closes the file)."""
        self.error = exc
        self.close()

    def close(self) -> None:
        """Close the file (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    @property
    def error_text(self) -> str:
        """The failed write's OS error as ``[Errno 28] No space left on device``."""
        err = self.error
        return f"[Errno {err.errno}] {err.strerror}" if err is not None and err.strerror else str(err)

    def describe(self) -> str:
        """One line for the operator: which flag and file, what went wrong, and what still works."""
        return (f"{self.flag} {self.path}: cannot write KV cache events ({self.error_text}); the file stops at its "
                "last complete line and gets no more events (the in-memory buffer and GET /v1/kvload/kv_events go on)")


class KvEventBuffer:
    """A bounded buffer of KV cache events, optionally mirrored to a JSON Lines file as they happen."""

    def __init__(self, max_size: int, mirror: KvEventMirror | None = None, publisher: Any = None) -> None:
        if max_size < 1:
            raise ValueError(f"a KV event buffer needs max_size >= 1, got {max_size}")
        self.max_size = max_size
        self._events: deque[dict[str, Any]] = deque()
        self._lock = threading.Lock()
        self._seq = 0
        self.dropped = 0  # events pushed out before anyone drained them (since the last drain)
        self.mirror = mirror
        #: anything with ``put(event)`` that never blocks nor raises (``kvload serve --kv-events-config``'s ZeroMQ
        #: publisher); it gets each event's dict, which nothing changes after
        self.publisher = publisher

    def stored(self, hashes: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int], tokens_per_block: int,
               group: str, medium: str = "device", salt: str | None = None) -> None:
        """Blocks keyed by ``hashes`` (chained, in order) now hold a reusable prefix, under the reuse scope ``salt``."""
        if hashes:
            self._record({"type": STORED, "block_hashes": [h.hex() for h in hashes],
                          "parent_block_hash": parent.hex() if parent is not None else None,
                          "token_ids": list(token_ids), "tokens_per_block": tokens_per_block, "layer_group": group,
                          "medium": medium, "cache_salt": salt})

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
            if self.publisher is not None:
                self.publisher.put(event)
            mirror = self.mirror
            if mirror is None:
                return
            try:
                mirror.write((json.dumps(event, separators=(",", ":")) + "\n").encode())
                return
            except OSError as exc:
                # this runs inside a manager's commit or eviction: raising would fail the engine step (and every
                # request in it) after the event was already buffered, so the mirror stops instead
                self.mirror = None
                mirror.fail(exc)
        if mirror.on_failure is not None:  # outside the lock: the report may take locks of its own
            with contextlib.suppress(Exception):  # a report that fails must not fail the step either
                mirror.on_failure(mirror)


__all__ = ["CLEARED", "REMOVED", "STORED", "KvEventBuffer", "KvEventMirror"]
