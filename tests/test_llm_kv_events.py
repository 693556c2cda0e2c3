"""``kvload.LLM(kv_events_config=...)``: vLLM's engine argument publishes offline generation's KV cache events as
``kvload serve --kv-events-config`` does; plan/load refuse it naming where it is taken."""

from __future__ import annotations

import dataclasses
import socket
import time

import pytest

import kvload
from pipeline.errors import ConfigError
from tests.llm_support import llm_kwargs

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from tests.test_serve_kv_publisher import BlockStored, _replayed  # noqa: E402  (needs zmq and msgspec)

PROMPT = [5, 17, 300, 42, 9, 88, 123, 7, 64]  # two full 4-token blocks and one token


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_offline_generation_publishes_its_blocks_over_zeromq(manager):
    """A router following an offline LLM gets the prompt's blocks as vLLM's BlockStored, tokens in order; close
    releases the endpoint (bindable again)."""
    port = _free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
              "replay_endpoint": f"inproc://llm-kv-events-{manager}", "topic": "offline"}
    with kvload.LLM("tiny-llama", kv_events_config=config, **llm_kwargs(manager)) as llm:
        llm.generate([PROMPT], max_tokens=2, temperature=0)
        replay = f"inproc://llm-kv-events-{manager}"
        stored = []
        for _ in range(50):  # the publishing thread sends what the step queued within a few ms
            stored = [e for _, batch in _replayed(replay) for e in batch.events if isinstance(e, BlockStored)]
            if sum(len(e.token_ids) for e in stored) >= 8:
                break
        tokens = [t for e in stored for t in e.token_ids]
        assert tokens[:8] == PROMPT[:8], stored
        assert all(e.block_size == 4 for e in stored)
    assert _bindable(f"tcp://*:{port}")  # the LLM's publisher closed with it


def _bindable(address: str) -> bool:
    """Whether ``address`` can be bound within 2 s (ZeroMQ's I/O thread unbinds a closed socket asynchronously)."""
    for _ in range(40):
        sock = zmq.Context.instance().socket(zmq.PUB)
        try:
            sock.bind(address)
            return True
        except zmq.ZMQError:
            time.sleep(0.05)
        finally:
            sock.close(linger=0)
    return False


def test_vllms_switch_alone_keeps_the_events_and_the_audit_says_who(monkeypatch):
    """``publisher: "null"`` records without publishing: the buffer vLLM's switch turned on is drained by
    ``llm.result.kv_cache_events()``, and the audit derives its size from the keyword."""
    with kvload.LLM("tiny-llama", kv_events_config={"enable_kv_cache_events": True, "publisher": "null"},
                    **llm_kwargs()) as llm:
        llm.generate([PROMPT], max_tokens=2, temperature=0)
        events = llm.result.kv_cache_events()["events"]
        assert any(e["type"] == "kv_block_stored" for e in events), events
        derived = [r for r in llm.audit.events if r["event"] == "field_derived"
                   and r["field"] == "kv_cache_config.event_buffer_max_size"]
        assert derived and derived[0]["source"] == "LLM" and "kv_events_config" in derived[0]["reason"]


def test_vllms_dataclass_is_taken_field_by_field():
    """vLLM's own ``KVEventsConfig`` is a dataclass: an object of that shape is read as its fields."""

    @dataclasses.dataclass
    class KVEventsConfig:
        enable_kv_cache_events: bool = True
        publisher: str = "null"

    with kvload.LLM("tiny-llama", kv_events_config=KVEventsConfig(), **llm_kwargs()) as llm:
        assert llm.result.kv_manager.kv_events is not None


def test_a_zmq_publisher_with_events_off_says_it_is_ignored():
    with kvload.LLM("tiny-llama", kv_events_config={"publisher": "zmq"}, **llm_kwargs()) as llm:
        ignored = [r for r in llm.audit.events if r["event"] == "setting_ignored"
                   and r["field"] == "kv_events_config.publisher"]
        assert ignored and "enable_kv_cache_events is false" in ignored[0]["reason"]


@pytest.mark.parametrize(("value", "expected"), [
    ({"publisher": "kafka"}, 'kv_events_config: publisher: expected "null" or "zmq"'),
    ({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:99999"},
     "kv_events_config: endpoint: expected a ZeroMQ address"),
    ("zmq", "kv_events_config: expected a mapping of vLLM's KVEventsConfig fields"),
])
def test_a_bad_kv_events_config_is_one_line_naming_the_keyword(value, expected):
    with pytest.raises(ConfigError) as err:
        kvload.LLM("tiny-llama", kv_events_config=value, **llm_kwargs())
    assert str(err.value).startswith(expected), err.value


def test_events_on_with_the_buffer_set_to_zero_is_refused_before_the_load():
    with pytest.raises(ConfigError, match="kv_events_config: enable_kv_cache_events is true but kv_cache_config."
                                          "event_buffer_max_size is 0"):
        kvload.LLM("tiny-llama", kv_events_config={"enable_kv_cache_events": True, "publisher": "null"},
                   **llm_kwargs(event_buffer_max_size=0))


def test_a_taken_endpoint_fails_before_the_model_loads():
    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ConfigError, match=f"kv_events_config: endpoint tcp://\\*:{port}: cannot bind it"):
            kvload.LLM("tiny-llama", kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"},
                       **llm_kwargs())
    finally:
        taken.close(linger=0)


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("kv_events_config", {"enable_kv_cache_events": True},
     "kv_events_config: vLLM's KV cache event publisher; kvload.LLM(kv_events_config={...}) and kvload serve "
     "--kv-events-config take it"),
    ("seed", 3, "seed: vLLM's sampling seed; kvload.LLM(seed=N) and kvload serve --seed take it"),
    ("kv_offloading_size", 4, "kv_offloading_size: a vLLM engine argument kvload does not implement: vLLM's KV "
                              "offloading connector; instead, kvload's host tier: kv_cache_config.host_cache_size"),
])
def test_plan_names_where_a_vllm_engine_argument_is_taken_not_a_lookalike_field(key, value, expected):
    """Before: ``kv_events_config: unknown key; did you mean 'kv_cache_config'?`` and ``seed: ... 'weights_seed'``:
    other settings."""
    with pytest.raises(ConfigError) as err:
        kvload.plan("tiny-llama", log=False, **{key: value})
    assert str(err.value).startswith(expected), err.value
    assert "did you mean" not in str(err.value)
