"""``kvload serve --kv-events-config``: the KV cache events as vLLM publishes them, read by what a KV-aware router
runs — a ZeroMQ SUB socket decoding msgpack into vLLM's own ``KVEventBatch`` classes, and a replay request on the
ROUTER endpoint — against a real server process; bad configs are one line naming the flag, exit 2."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.cli_support import ENV, REPO, ready_url, reap, run_cli, until_ready
from tests.hostile_support import signals_as_a_terminal_gives_them

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")


# vLLM's wire classes, as vllm/distributed/kv_events.py declares them (the consumer's side of the contract)
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
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


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(config: dict) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "kvload", "serve", "tiny-llama", "--port", "0", "--max_tokens",
                             "1024", "--enable-reset-prefix-cache", "--kv-events-config", json.dumps(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=signals_as_a_terminal_gives_them,
                            env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, cwd=REPO)
    return proc, ready_url(until_ready(proc)[-1])


def _batches(sock, until) -> list[tuple[bytes, int, KVEventBatch]]:
    """(topic, sequence number, batch) of every message until ``until(batches)`` holds (10 s at most)."""
    got: list[tuple[bytes, int, KVEventBatch]] = []
    deadline = time.monotonic() + 10
    while not until(got):
        assert time.monotonic() < deadline, got
        if sock.poll(200):
            topic, seq, payload = sock.recv_multipart()
            got.append((topic, int.from_bytes(seq, "big"), DECODER.decode(payload)))
    return got


def _replayed(address: str) -> list[tuple[int, KVEventBatch]]:
    """(sequence number, batch) of every batch kept, asked of the ROUTER ``address`` as a router that joined late asks:
    from sequence number 0, until the end mark ``(-1, b"")``."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)  # the publisher's context: inproc:// reaches it too
    try:
        dealer.connect(address)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(10_000), got
            _, seq_bytes, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                assert payload == b""
                return got
            got.append((seq, DECODER.decode(payload)))
    finally:
        dealer.close(linger=0)


def test_a_router_follows_the_prefix_cache_over_zeromq_and_replays_what_it_missed():
    pub, replay = _free_port(), _free_port()
    proc, url = _start({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                        "replay_endpoint": f"tcp://*:{replay}", "topic": "kv@tiny"})
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(f"tcp://127.0.0.1:{pub}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@tiny")
        time.sleep(0.5)  # a SUB socket hears only what is sent after it joined
        with httpx.Client(base_url=url, timeout=60) as http:
            r = http.post("/v1/completions", json={"prompt": list(range(1, 41)), "max_tokens": 4,
                                                   "ignore_eos": True})
            assert r.status_code == 200
            got = _batches(sub, lambda b: any(isinstance(e, BlockStored) for _, _, batch in b for e in batch.events))
            # vLLM's switch alone turned the recording on: kvload's own endpoint sees the same events
            served = http.get("/v1/kvload/kv_events").json()
            assert http.post("/reset_prefix_cache").status_code == 200
            got += _batches(sub, lambda b: any(isinstance(e, AllBlocksCleared) for _, _, x in b for e in x.events))
        topic, seq, batch = got[0]
        assert topic == b"kv@tiny" and seq == 0 and batch.data_parallel_rank == 0
        stored = next(e for _, _, b in got for e in b.events if isinstance(e, BlockStored))
        assert stored.token_ids == list(range(1, 33)) and stored.block_size == 32  # the prompt's one full block
        assert stored.parent_block_hash is None and len(stored.block_hashes) == 1
        assert stored.group_idx == 0 and stored.kv_cache_spec_kind == "full_attention"
        assert stored.medium == "GPU" and stored.lora_id is None  # vLLM's name for the device tier
        first = served["events"][0]  # the hash as vLLM sends it by default: the digest's low 64 bits
        assert first["type"] == "kv_block_stored"
        assert stored.block_hashes == [int.from_bytes(bytes.fromhex(first["block_hashes"][0])[-8:], "big")]
        # a router that joined late asks the ROUTER endpoint for everything from sequence number 0
        replayed = _replayed(f"tcp://127.0.0.1:{replay}")
        assert [s for s, _ in replayed] == list(range(len(replayed))) and replayed[0][1] == batch
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
        for port in (pub, replay):  # the publisher's ports are let go with the process (TIME_WAIT aside)
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("0.0.0.0", port))
                s.listen()
    finally:
        sub.close(linger=0)
        ctx.term()
        reap(proc)


@pytest.mark.parametrize(("config", "expected"), [
    ('{"enable_kv_cache_events": true, "topics": "kv"}', "--kv-events-config: topics: unknown key; did you mean "
                                                         "'topic'?"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', '--kv-events-config: publisher: expected "null" or '
                                                               '"zmq", got \'kafka\''),
    ('{"enable_kv_cache_events": "yes"}', "--kv-events-config: enable_kv_cache_events: expected true or false"),
    ('{"publisher": "zmq", "endpoint": "localhost:5557"}', "--kv-events-config: endpoint: expected a ZeroMQ address"),
    ('{"buffer_steps": 0}', "--kv-events-config: buffer_steps: expected an integer from 1 to"),
    # ZeroMQ would bind port 99999 modulo 65536 (34463): a router listening where the operator said hears nothing
    ('{"publisher": "zmq", "endpoint": "tcp://*:99999"}', "--kv-events-config: endpoint: expected a ZeroMQ address"),
    ('{"replay_endpoint": "tcp://*:70000"}', "--kv-events-config: replay_endpoint: expected a ZeroMQ address"),
    ("enable", "--kv-events-config: expected a JSON object"),
])
def test_a_bad_kv_events_config_is_one_line_naming_the_key(capsys, config, expected):
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", "--kv-events-config", config)
    assert r.code == 2 and expected in r.err and "Traceback" not in r.err, r.err
    assert len(r.err.strip().splitlines()) == 1, r.err


def test_events_switched_on_with_the_buffer_set_to_zero_is_refused(capsys):
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", "--event_buffer_max_size", "0",
                "--kv-events-config", '{"enable_kv_cache_events": true}')
    assert r.code == 2 and "--kv-events-config: enable_kv_cache_events is true but kv_cache_config." \
                           "event_buffer_max_size is 0" in r.err, r.err


def test_a_taken_endpoint_fails_before_the_model_loads(capsys):
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", "--kv-events-config",
                    json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}))
    finally:
        taken.close(linger=0)
        ctx.term()
    assert r.code == 2 and f"--kv-events-config: endpoint tcp://*:{port}: cannot bind it" in r.err, r.err
    assert "pipeline_started" not in r.err  # refused before anything loaded


def test_a_publisher_named_with_events_off_says_it_is_ignored(monkeypatch, log):
    from tests.cli_support import served_with

    served_with(monkeypatch, "--kv-events-config", '{"publisher": "zmq"}')  # vLLM's enable_kv_cache_events: false
    assert log.has("setting_ignored", field="--kv-events-config publisher", value="zmq", level="warning")


def test_vllms_switch_turns_the_recording_on_and_the_audit_says_who(monkeypatch, log):
    from tests.cli_support import served_with

    served_with(monkeypatch, "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "null"}')  # no socket
    # old: the framework default (0, events off) the switch fills over
    assert log.has("field_derived", field="kv_cache_config.event_buffer_max_size", old=0, new=10_000, source="serve")


def test_vllms_switch_alone_publishes_over_zeromq_as_vllm_does():
    """vLLM's ``KVEventsConfig``: an unset ``publisher`` is ``"zmq"`` when events are on (else ``"null"``), so a
    launch line giving only ``enable_kv_cache_events: true`` publishes on tcp://*:5557 there, and here."""
    from kvload.serve.kv_publisher import parse_kv_events_config

    assert parse_kv_events_config({"enable_kv_cache_events": True}).publisher == "zmq"
    assert parse_kv_events_config({"enable_kv_cache_events": True}).publishes
    assert parse_kv_events_config({}).publisher == "null"
    assert not parse_kv_events_config({"enable_kv_cache_events": True, "publisher": "null"}).publishes


@pytest.mark.parametrize("env", [None, "1", "0"])
def test_block_hashes_go_out_in_vllms_default_form(monkeypatch, env):
    """vLLM sends each block hash as the digest's low 64 bits, an unsigned integer (``VLLM_KV_EVENTS_USE_INT_BLOCK_
    HASHES``, default 1; 0: the digest's bytes): a router decoding vLLM's default gets the integers it expects."""
    from cache_backends.kv_events import KvEventBuffer
    from kvload.serve.kv_publisher import KvEventsConfig, ZmqKvEventPublisher

    if env is None:
        monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    else:
        monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", env)
    name = f"kv-hashes-{env}"
    publisher = ZmqKvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint=f"inproc://{name}-pub",
                                                   replay_endpoint=f"inproc://{name}"))
    parent, child = bytes(range(32)), bytes(range(100, 132))
    try:
        events = KvEventBuffer(16, publisher=publisher)
        events.stored([child], parent, list(range(16)), 16, "uniform")
        events.removed([child], "uniform")
        deadline = time.monotonic() + 10
        while publisher.published < 1 or publisher._queue.qsize():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        batches = [batch for _, batch in _replayed(f"inproc://{name}")]
    finally:
        publisher.close()
    stored, removed = (e for b in batches for e in b.events)
    if env == "0":
        assert stored.block_hashes == [child] and stored.parent_block_hash == parent and removed.block_hashes == [child]
    else:  # vLLM's maybe_convert_block_hash: int.from_bytes(digest, "big") & (2**64 - 1)
        low = int.from_bytes(child[-8:], "big")
        assert stored.block_hashes == [low] and removed.block_hashes == [low]
        assert stored.parent_block_hash == int.from_bytes(parent[-8:], "big")


def test_a_bad_int_hashes_switch_is_refused_naming_it(monkeypatch):
    from kvload.serve.kv_publisher import parse_kv_events_config
    from pipeline.errors import ConfigError

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "yes")
    with pytest.raises(ConfigError, match="--kv-events-config: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES must be 1"):
        parse_kv_events_config({"enable_kv_cache_events": True, "publisher": "zmq"})


def test_closing_the_publisher_leaves_no_ipc_socket_file(tmp_path):
    """ZeroMQ leaves a bound ipc:// file behind; the publisher removes its own, also when the replay endpoint fails."""
    from kvload.serve.kv_publisher import KvEventsConfig, ZmqKvEventPublisher
    from pipeline.errors import ConfigError

    pub, replay = tmp_path / "kv.sock", tmp_path / "replay.sock"
    publisher = ZmqKvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{pub}",
                                                   replay_endpoint=f"ipc://{replay}"))
    assert pub.exists() and replay.exists()
    publisher.close()
    publisher.close()  # idempotent
    assert not pub.exists() and not replay.exists()
    with pytest.raises(ConfigError, match="replay_endpoint"):
        ZmqKvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{pub}",
                                           replay_endpoint=f"ipc://{tmp_path}/missing/replay.sock"))
    assert list(tmp_path.iterdir()) == []


def test_a_stop_signal_while_the_publisher_closes_leaves_no_ipc_socket_file(tmp_path):
    """``kvload serve`` closes the publisher last, waiting for its thread to send what is queued: a SIGINT there
    (Ctrl-C twice) was raised out of that wait before the sockets were closed, leaving the ipc:// files behind (and,
    CPython 3.11, the thread marked stopped while it ran). It is raised once the thread ended and the files are gone."""
    pub = tmp_path / "kv.sock"
    code = f"""
import json, os, signal, sys, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's Ctrl-C (a suite run with `&` has it ignored)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT}})
from kvload.serve.kv_publisher import KvEventsConfig, ZmqKvEventPublisher
publisher = ZmqKvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint="ipc://{pub}"))
sending = threading.Event()
send = publisher._send
def slow(*a):
    sending.set()
    time.sleep(1.5)  # a batch going out as the close begins
    send(*a)
publisher._send = slow
publisher.put({{"type": "kv_all_blocks_cleared", "ts": 1.0}})
assert sending.wait(30)
print("closing", flush=True)
try:
    publisher.close()
except KeyboardInterrupt:
    print(json.dumps({{"file": os.path.exists({str(pub)!r}),
                      "running": [t.name for t in threading.enumerate() if t.name.startswith("kvload")]}}), flush=True)
    raise
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, "PYTHONPATH": str(REPO)}, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "closing"
        time.sleep(0.5)  # inside the close's wait for the batch
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        reap(proc)
    assert json.loads(out) == {"file": False, "running": []}, (out, err)
    assert proc.returncode == -signal.SIGINT and err.rstrip().endswith("KeyboardInterrupt"), err[-2000:]


def test_events_a_full_queue_dropped_leave_a_gap_in_the_sequence_numbers_a_router_can_see():
    """vLLM's step waits for room in the publisher's queue; kvload's drops the event so that a step never blocks. A
    router keeps its view of the cache from the events alone: the numbers went on 0, 1, ... as if nothing was lost, so
    its view stayed silently wrong. Now a number is skipped where events were dropped, live and in the replay."""
    from cache_backends.kv_events import KvEventBuffer
    from kvload.serve.kv_publisher import KvEventsConfig, ZmqKvEventPublisher

    config = KvEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="inproc://gap-pub",
                            replay_endpoint="inproc://gap-replay", max_queue_size=2)
    publisher = ZmqKvEventPublisher(config)
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.connect("inproc://gap-pub")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.2)
        buffer = KvEventBuffer(100, publisher=publisher)
        for i in range(10):  # faster than the thread drains a queue of 2: most are dropped
            buffer.stored([bytes([i]) * 32], None, [1, 2, 3, 4], 4, "uniform")
        dropped = publisher.dropped
        assert dropped > 0
        time.sleep(0.2)
        buffer.stored([b"\xff" * 32], None, [5, 6, 7, 8], 4, "uniform")  # the first event after the drop
        live = _batches(sub, lambda got: any(e.token_ids == [5, 6, 7, 8] for _, _, b in got for e in b.events))
        replayed = _replayed("inproc://gap-replay")
    finally:
        sub.close(linger=0)
        publisher.close()
    numbers = [seq for _, seq, _ in live]
    assert numbers == [seq for seq, _ in replayed]
    assert numbers[-1] == numbers[-2] + 2, numbers  # one number never sent: the router knows it lost events
    assert sum(len(b.events) for _, b in replayed) == 11 - dropped  # (the batch numbers stay a step's, vLLM's)


def test_a_salted_prefix_goes_out_with_vllms_extra_keys():
    """vLLM puts a request's cache_salt in BlockStored.extra_keys on the prefix's first block (vllm-project/vllm#33304),
    which Dynamo and llm-d read to tell tenants' equal prompts apart; kvload sent none, so a salted prompt looked like
    the unsalted one."""
    from cache_backends.kv_events import KvEventBuffer
    from kvload.serve.kv_publisher import KvEventsConfig, ZmqKvEventPublisher

    config = KvEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="inproc://salt-pub",
                            replay_endpoint="inproc://salt-replay")
    publisher = ZmqKvEventPublisher(config)
    try:
        buffer = KvEventBuffer(100, publisher=publisher)
        first, second, third = (bytes([i]) * 32 for i in (1, 2, 3))
        buffer.stored([first, second], None, list(range(8)), 4, "uniform", salt="tenant")
        buffer.stored([third], second, list(range(8, 12)), 4, "uniform", salt="tenant")  # not a prefix's start
        buffer.stored([third], None, list(range(4)), 4, "uniform")  # unsalted
        events = []
        for _ in range(50):
            events = [e for _, batch in _replayed("inproc://salt-replay") for e in batch.events]
            if len(events) == 3:
                break
            time.sleep(0.02)
    finally:
        publisher.close()
    assert [e.extra_keys for e in events] == [[("tenant",), None], None, None]
    assert [e["cache_salt"] for e in buffer.drain()["events"]] == ["tenant", "tenant", None]


@pytest.mark.parametrize("v2", [False, True])
def test_an_mla_models_blocks_go_out_as_vllms_mla_attention_under_either_manager(v2):
    """DeepSeek V3's layers are all MLA: vLLM names its group ``mla_attention``. V1 keeps one group of every layer,
    ``full`` in its layout, and its blocks went out as ``full_attention`` where V2's went out as ``mla_attention``."""
    import pipeline
    from cache_backends.request import Request
    from engine.driver import Driver
    from kvload.serve.kv_publisher import KvEventsConfig, ZmqKvEventPublisher

    address = f"inproc://mla-kind-{v2}"
    publisher = ZmqKvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint=f"inproc://mla-pub-{v2}",
                                                   replay_endpoint=address))
    kv = {"max_tokens": 512, "tokens_per_block": 16, "use_kv_cache_manager_v2": v2, "event_buffer_max_size": 100}
    try:
        with pipeline.load("tiny-deepseek-v3", kv_cache_config=kv, max_seq_len=256, log=False) as r:
            publisher.attach(r.kv_manager.layout)
            r.kv_manager.kv_events.publisher = publisher
            driver = Driver(r.kv_manager, r.scheduler)
            driver.add(Request("a", list(range(1, 40)), 2))
            while driver.has_work:
                driver.step(lambda out: {c.request.req_id: 7 for c in out.scheduled
                                         if c.request.num_computed_tokens + c.num_tokens >= c.request.num_tokens})
            stored: list[BlockStored] = []
            for _ in range(100):  # the publishing thread sends what the step queued within a few ms
                stored = [e for _, b in _replayed(address) for e in b.events if isinstance(e, BlockStored)]
                if stored:
                    break
                time.sleep(0.01)
        assert stored and {(e.group_idx, e.kv_cache_spec_kind) for e in stored} == {(0, "mla_attention")}
    finally:
        publisher.close()
