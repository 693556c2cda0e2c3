"""``kvload serve --kv-events-config``: vLLM's KV event publisher, so a KV-aware router (llm-d, Dynamo, vLLM's own
examples) can follow kvload's prefix cache the way it follows vLLM's.

The flag takes vLLM's ``KVEventsConfig`` as JSON (``enable_kv_cache_events``, ``publisher`` ``"null"`` or ``"zmq"``
(vLLM's default: ``"zmq"`` when events are on), ``endpoint``, ``replay_endpoint``, ``buffer_steps``, ``hwm``,
``max_queue_size``, ``topic``). With ``"zmq"`` the manager's events (:mod:`cache_backends.kv_events`) go out as vLLM
sends them: a ZeroMQ PUB socket, each message three frames ``(topic, sequence number as 8 bytes big-endian, msgpack
payload)``, the payload a ``KVEventBatch`` of ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (msgspec
structs, tagged by class name under ``"type"``); the last ``buffer_steps`` batches are kept for a ROUTER
``replay_endpoint`` (a client sends the first sequence number it wants, 8 bytes big-endian, and gets ``(seq,
payload)`` frames then ``(-1, b"")``).

kvload's names map onto vLLM's: a hex block hash becomes, as vLLM sends it by default, its low 64 bits as an unsigned
integer (its bytes under vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), ``tokens_per_block`` is ``block_size``,
the layer group is ``group_idx`` (its index in the plan's layout) with its kind (``full_attention``,
``sliding_window`` and the window, ``mla_attention``), and the medium ``device`` is vLLM's ``"GPU"`` (``host``:
``"CPU"``). The hashes stay kvload's own (:mod:`cache_backends.hashing`, not vLLM's hash of the tokens): a router
that keys blocks by the events' token ids follows kvload, one that hashes a prompt with vLLM's algorithm finds none.

Publishing never blocks nor fails the engine step that recorded an event (as in vLLM): the step only puts the event
on a bounded queue that a thread drains into batches; a full queue drops the event and counts it
(:attr:`ZmqKvEventPublisher.dropped`), and skips a sequence number where it did: a router that finds a number missing
both live and from the replay endpoint knows it lost events (vLLM's step waits for room instead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
from collections import deque
from collections.abc import Mapping
from typing import Any

import attrs

from pipeline.config import field_check, plain_fields
from pipeline.converter import structure
from pipeline.errors import ConfigError
from pipeline.limits import short
from pipeline.thread_end import EndingThread

FLAG = "--kv-events-config"
PUBLISHERS = ("null", "zmq")
#: kvload's group kinds as vLLM's ``KVCacheSpecKind`` names them (a compressed group has no vLLM kind)
SPEC_KINDS = {"full": "full_attention", "sliding": "sliding_window", "mla": "mla_attention"}
MEDIUMS = {"device": "GPU", "host": "CPU"}
MASK64 = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)
INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
MAX_QUEUE = 10_000_000  # bounds a typo's memory: vLLM's defaults are 100,000
#: queued where a full queue dropped events: the sequence number it stands for is never sent, so a router sees the gap
#: live and in a replay and knows it lost events (vLLM's publisher blocks the step instead of dropping: no gap there)
GAP: dict[str, Any] = {}


def _int_in(lo: int, hi: int) -> Any:
    return field_check(lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi,
                       f"an integer from {lo:,} to {hi:,}")


def _address(v: Any) -> bool:
    if not (isinstance(v, str) and "://" in v and v.strip() == v and len(v) <= 1024):
        return False
    if not v.startswith("tcp://"):
        return True
    # ZeroMQ takes a port past 65535 modulo 65536 (tcp://*:99999 binds 34463): a typo must not publish elsewhere
    port = v.rpartition(":")[2]
    return port.isdecimal() and 1 <= int(port) <= 65535


def _endpoint(optional: bool) -> Any:
    ok = ("a ZeroMQ address such as tcp://*:5557 (bind), tcp://host:5557 (connect; a port from 1 to 65535), "
          "ipc://PATH or inproc://NAME")
    return field_check(lambda v: (optional and v is None) or _address(v), ok + (" or null" if optional else ""))


# numpy's / torch's scalars as Python's, as the load arguments take them (the converter's hooks pass them through)
@attrs.frozen(field_transformer=plain_fields)
class KvEventsConfig:
    """vLLM's ``--kv-events-config`` fields, with its defaults."""

    enable_kv_cache_events: bool = attrs.field(default=False, validator=field_check(
        lambda v: isinstance(v, bool), "true or false"))
    #: None: vLLM's default, ``"zmq"`` when events are on, else ``"null"`` (see ``__attrs_post_init__``)
    publisher: str | None = attrs.field(default=None, validator=field_check(
        lambda v: v is None or v in PUBLISHERS, " or ".join(f'"{p}"' for p in PUBLISHERS)))
    endpoint: str = attrs.field(default="tcp://*:5557", validator=_endpoint(False))
    replay_endpoint: str | None = attrs.field(default=None, validator=_endpoint(True))
    buffer_steps: int = attrs.field(default=10_000, validator=_int_in(1, MAX_QUEUE))
    hwm: int = attrs.field(default=100_000, validator=_int_in(0, 2**31 - 1))
    max_queue_size: int = attrs.field(default=100_000, validator=_int_in(1, MAX_QUEUE))
    topic: str = attrs.field(default="", validator=field_check(lambda v: isinstance(v, str) and len(v) <= 1024,
                                                               "a string of at most 1,024 characters"))

    def __attrs_post_init__(self) -> None:
        if self.publisher is None:  # vLLM's KVEventsConfig.__post_init__: the switch alone publishes over ZeroMQ
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")

    @property
    def publishes(self) -> bool:
        """Whether events go out over ZeroMQ."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(raw: dict[str, Any], name: str = FLAG) -> KvEventsConfig:
    """The flag's JSON object as a :class:`KvEventsConfig`; ``ConfigError`` naming the flag (or ``name``: the
    keyword ``kv_events_config`` of ``kvload.LLM``) and the key."""
    try:
        config = structure(raw, KvEventsConfig)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}", path=name, detail=exc.detail) from None
    if config.publishes:
        _zmq_modules(name)  # missing libraries are named before minutes of loading
        int_block_hashes(name)
    return config


def kv_events_argument(value: Any, name: str = "kv_events_config") -> KvEventsConfig:
    """``LLM(kv_events_config=...)`` as vLLM takes it: a mapping of its fields, a :class:`KvEventsConfig`, or
    vLLM's own ``KVEventsConfig`` (a dataclass, read field by field); ``ConfigError`` naming ``name`` otherwise."""
    if isinstance(value, KvEventsConfig):
        value = attrs.asdict(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name}: expected a mapping of vLLM's KVEventsConfig fields (enable_kv_cache_events, "
                          f"publisher, endpoint, ...) or a KVEventsConfig, got {short(value)}", path=name,
                          detail="not a mapping")
    return parse_kv_events_config(dict(value), name)


def int_block_hashes(name: str = FLAG) -> bool:
    """Whether block hashes go out as vLLM's default, the digest's low 64 bits as an unsigned integer, or (under
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, as vLLM reads it) as the digest's bytes; ``ConfigError`` naming it."""
    raw = os.environ.get(INT_HASHES_ENV, "1").strip()
    if raw not in ("0", "1"):
        raise ConfigError(f"{name}: {INT_HASHES_ENV} must be 1 (block hashes as 64-bit integers, vLLM's default) or "
                          f"0 (as bytes), got {raw[:40]!r}")
    return raw == "1"


def _zmq_modules(name: str = FLAG) -> tuple[Any, Any]:
    try:
        import msgspec
        import zmq
    except ImportError as exc:
        raise ConfigError(f'{name}: publisher "zmq" needs pyzmq and msgspec ({exc.name} is missing); install them '
                          "with pip install 'kvload[kv-events]'") from None
    return zmq, msgspec


def _structs(msgspec: Any) -> tuple[Any, Any, Any, Any]:
    """vLLM's wire classes (``vllm.distributed.kv_events``): the same names, fields and msgspec options."""

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        """Base of the tagged events."""

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes | int]  # vLLM's ExternalBlockHash
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[Any] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    return BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch


def spec_kind(layout: Any, group: Any) -> str | None:
    """vLLM's ``kv_cache_spec_kind`` of a layout's ``group``: V1's one group of every layer is ``"full"`` in the
    layout, but a model whose layers are all MLA (DeepSeek V3) is vLLM's ``mla_attention`` whichever manager holds it
    (``get_kv_cache_spec_kind`` of an ``MLAAttentionSpec``), as V2's group of them says."""
    if group.kind == "full" and group.layers:
        kinds = {layer.index: layer.kind for layer in layout.layers}
        if all(kinds.get(i) == "mla" for i in group.layers):
            return SPEC_KINDS["mla"]
    return SPEC_KINDS.get(group.kind)


class ZmqKvEventPublisher:
    """Sends a KV event buffer's events as vLLM's ``KVEventBatch`` messages on a ZeroMQ PUB socket (see the module).

    Built before the model loads (a taken port fails at once); :meth:`attach` names the layout's groups once it is
    known. ``put`` is what the buffer calls, on the engine's thread: it never blocks nor raises.
    """

    def __init__(self, config: KvEventsConfig, data_parallel_rank: int = 0, name: str = FLAG) -> None:
        zmq, msgspec = _zmq_modules(name)
        self.name = name  # the flag or keyword errors name
        self.config = config
        self.rank = data_parallel_rank
        self.dropped = 0  # events a full queue refused
        self.published = 0  # batches sent
        self.groups: dict[str, tuple[int, str | None, int | None]] = {}  # name -> (index, vLLM kind, window)
        self._zmq = zmq
        self._int_hashes = int_block_hashes(name)
        self._encoder = msgspec.msgpack.Encoder()
        self._stored, self._removed, self._cleared, self._batch = _structs(msgspec)
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._replayable: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._lost = False  # an event was dropped since the last one queued: a GAP goes first
        self._topic = config.topic.encode()
        self._ctx = zmq.Context.instance()
        self._ipc_files: list[str] = []  # the ipc:// paths bound, removed at close
        self._pub = self._socket(zmq.PUB, config.endpoint, "endpoint")
        self._replay = None
        try:
            if config.replay_endpoint is not None:
                self._replay = self._socket(zmq.ROUTER, config.replay_endpoint, "replay_endpoint", bind=True)
        except ConfigError:
            self._pub.close(linger=0)
            self._remove_ipc_files()
            raise
        self._thread = EndingThread(target=self._run, name="kvload-kv-events", daemon=True)
        self._thread.start()

    def _socket(self, kind: int, address: str, field: str, bind: bool | None = None) -> Any:
        sock = self._ctx.socket(kind)
        if kind == self._zmq.PUB:
            sock.set_hwm(self.config.hwm)
        # vLLM's rule: a wildcard host, ipc or inproc binds (the stable side); a named host connects
        if bind is None:
            bind = "*" in address or "::" in address or address.startswith(("ipc://", "inproc://"))
        try:
            sock.bind(address) if bind else sock.connect(address)
        except self._zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ConfigError(f"{self.name}: {field} {address}: cannot {'bind' if bind else 'connect'} it "
                              f"({exc.strerror})") from None
        if bind and address.startswith("ipc://") and not address.startswith("ipc://@"):  # @: no file to remove
            self._ipc_files.append(address.removeprefix("ipc://"))
        return sock

    def _remove_ipc_files(self) -> None:
        # ZeroMQ leaves a bound ipc:// socket file behind when the socket closes
        for path in self._ipc_files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._ipc_files.clear()

    def attach(self, layout: Any) -> None:
        """Name the layout's groups as vLLM does: index, spec kind, sliding window."""
        self.groups = {g.name: (i, spec_kind(layout, g), g.window if g.kind == "sliding" else None)
                       for i, g in enumerate(layout.groups)}

    def put(self, event: dict[str, Any]) -> None:
        """Queue one event of the buffer (its dict, never changed after); a full queue drops it, counted, and the next
        event queued is preceded by a gap in the sequence numbers (:data:`GAP`)."""
        try:
            if self._lost:
                self._queue.put_nowait(GAP)
                self._lost = False
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1
            self._lost = True

    def close(self) -> None:
        """Send what is queued (up to a second), stop the thread, close the sockets and remove their ipc:// files
        (idempotent)."""
        try:
            if self._thread.is_alive():
                with contextlib.suppress(queue.Full):  # a queue still full after a second: the thread is stuck anyway
                    self._queue.put(None, timeout=1.0)
                # a stop signal meanwhile (kvload serve closes this last) is raised after the sockets are closed: it
                # left the ipc:// files behind (see pipeline.thread_end)
                self._thread.wait_end(2.0)
        finally:
            for sock in (self._pub, self._replay):
                if sock is not None and not sock.closed:
                    sock.close(linger=0)
            self._remove_ipc_files()

    # --- the publishing thread -------------------------------------------------------------------

    def _run(self) -> None:
        stop = False
        while not stop:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                first = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            events = [first]
            while len(events) < 4096:  # what the engine recorded meanwhile goes out as one batch
                try:
                    events.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = False
            batch: list[dict[str, Any]] = []
            for e in events:
                if e is None:
                    stop = True
                elif e is GAP:  # events were dropped here: the batch before goes out, then a number is skipped
                    if batch:
                        self._send([self._wire(b) for b in batch], batch[0]["ts"])
                        batch = []
                    self._seq += 1
                else:
                    batch.append(e)
            if batch:
                self._send([self._wire(b) for b in batch], batch[0]["ts"])

    def _send(self, wire: list[Any], ts: float) -> None:
        payload = self._encoder.encode(self._batch(ts=ts, events=wire, data_parallel_rank=self.rank))
        seq = self._seq
        with contextlib.suppress(self._zmq.ZMQError):  # a closed context at exit: the batch stays replayable
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._seq += 1
        self.published += 1
        self._replayable.append((seq, payload))

    def _wire(self, event: dict[str, Any]) -> Any:
        kind = event["type"]
        if kind == "kv_all_blocks_cleared":
            return self._cleared()
        index, spec, window = self.groups.get(event["layer_group"], (None, None, None))
        hashes = [self._hash(h) for h in event["block_hashes"]]
        medium = MEDIUMS.get(event["medium"], event["medium"])
        if kind == "kv_block_removed":
            return self._removed(block_hashes=hashes, medium=medium, group_idx=index)
        parent, salt = event["parent_block_hash"], event.get("cache_salt")
        # vLLM's extra keys of a block: the cache salt on a prefix's first block (generate_block_hash_extra_keys),
        # per block in BlockStored.extra_keys; None where no block has any (the wire as before)
        extra = [(salt,)] + [None] * (len(hashes) - 1) if salt and not parent else None
        return self._stored(block_hashes=hashes, parent_block_hash=self._hash(parent) if parent else None,
                            token_ids=event["token_ids"], block_size=event["tokens_per_block"], lora_id=None,
                            medium=medium, lora_name=None, extra_keys=extra, group_idx=index, kv_cache_spec_kind=spec,
                            kv_cache_spec_sliding_window=window)

    def _hash(self, hex_digest: str) -> bytes | int:
        """vLLM's ``maybe_convert_block_hash``: the digest's low 64 bits big-endian, or its bytes."""
        digest = bytes.fromhex(hex_digest)
        return int.from_bytes(digest, "big") & MASK64 if self._int_hashes else digest

    def _serve_replay(self) -> None:
        """Answer one replay request: every kept batch from the asked sequence number on, then the end mark."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request (vLLM logs and ignores it too)
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._replayable):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

