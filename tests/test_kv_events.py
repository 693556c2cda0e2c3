"""KV cache events from both managers: stored blocks are the ones later requests hit; eviction and reset report."""

from __future__ import annotations

import errno
import itertools
import json
import os

import pytest

import pipeline
from cache_backends.hashing import block_hash
from pipeline.errors import ConfigError, OutputError

T = 16
PREFIX = list(range(100, 164))  # 64 tokens: four full blocks


def _load(v2: bool, max_tokens: int = 1024, events: int = 10_000, **kv):
    config = {"max_tokens": max_tokens, "tokens_per_block": T, "use_kv_cache_manager_v2": v2,
              "event_buffer_max_size": events, "host_cache_size": 0, **kv}
    return pipeline.load("tiny-llama", load_weights=True, kv_cache_config=config, max_seq_len=256, log=False)


def _keys(tokens, salt=None):
    keys, parent = [], None
    for i in range(len(tokens) // T):
        parent = block_hash(parent, tokens[i * T:(i + 1) * T], salt)
        keys.append(parent.hex())
    return keys


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_stored_blocks_are_the_ones_a_later_request_hits_and_reset_clears(v2):
    with _load(v2) as r:
        first = r.generate([[*PREFIX, 1, 2, 3]], max_new_tokens=4, ignore_eos=True)[0]
        batch = r.kv_cache_events()
        stored = [e for e in batch["events"] if e["type"] == "kv_block_stored"]
        assert batch["dropped"] == 0 and stored
        assert {e["medium"] for e in stored} == {"device"} and {e["tokens_per_block"] for e in stored} == {T}
        hashes = [h for e in stored if e["layer_group"] == stored[0]["layer_group"] for h in e["block_hashes"]]
        tokens = [t for e in stored if e["layer_group"] == stored[0]["layer_group"] for t in e["token_ids"]]
        full = (len(PREFIX) + 3 + 4 - 1) // T  # KV is written for every token but the last sampled one
        assert hashes == _keys((first.prompt_token_ids + first.token_ids)[:full * T])
        assert tokens == (first.prompt_token_ids + first.token_ids)[:full * T]
        assert stored[0]["parent_block_hash"] is None
        assert all(e["parent_block_hash"] == prev["block_hashes"][-1]
                   for prev, e in itertools.pairwise(stored) if e["layer_group"] == prev["layer_group"])
        # a later request with the same prefix hits exactly the stored blocks of its prompt
        again = r.generate([[*PREFIX, 9, 9]], max_new_tokens=2, ignore_eos=True)[0]
        assert again.reused_prompt_tokens == len(PREFIX)
        assert _keys(PREFIX) == hashes[:len(PREFIX) // T]
        assert {e["type"] for e in r.kv_cache_events()["events"]} <= {"kv_block_stored"}  # nothing evicted
        r.reset_prefix_cache()
        assert r.kv_cache_events()["events"][-1]["type"] == "kv_all_blocks_cleared"


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_a_scored_prompt_stores_its_blocks_under_the_callers_salt_and_a_scored_duplicate_stores_none(v2):
    with _load(v2) as r:
        prompt = [*PREFIX, 1, 2, 3]

        def scored_run_stores() -> list[dict]:
            (out,) = r.executor.run([prompt], max_tokens=1, ignore_eos=True, prompt_logprobs=0, salt="tenant")
            assert out.reused_prompt_tokens == 0
            return [e for e in r.kv_cache_events()["events"] if e["type"] == "kv_block_stored"]

        stored = scored_run_stores()
        group = stored[0]["layer_group"]
        assert [h for e in stored if e["layer_group"] == group for h in e["block_hashes"]] == _keys(PREFIX, "tenant")
        assert scored_run_stores() == []  # the blocks are cached: its own copies of them are not stored
        (plain,) = r.executor.run([[*PREFIX, 9, 9]], max_tokens=1, ignore_eos=True, salt="tenant")
        assert plain.reused_prompt_tokens == len(PREFIX)  # the stored blocks, hit


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_eviction_reports_removed_blocks_that_were_stored(v2, tmp_path):
    with _load(v2, max_tokens=128) as r:  # 8 blocks: the third prompt evicts the first ones
        for base in (100, 200, 300):
            r.generate([list(range(base, base + 60))], max_new_tokens=2, ignore_eos=True)
        log = tmp_path / "events.jsonl"
        events = r.kv_cache_events(jsonl=log)["events"]
        stored = {h for e in events if e["type"] == "kv_block_stored" for h in e["block_hashes"]}
        removed = [h for e in events if e["type"] == "kv_block_removed" for h in e["block_hashes"]]
        assert removed and set(removed) <= stored
        assert set(_keys(list(range(100, 160)))) & set(removed)  # the oldest prompt went first
        stats = r.kv_manager.stats()
        assert len(removed) == stats.evictions == sum(g.evictions for g in stats.groups.values())
        assert [json.loads(line) for line in log.read_text().splitlines()] == events


def test_a_jsonl_kvload_cannot_append_to_is_one_line_and_nothing_half_written(tmp_path):
    """kv_cache_events(jsonl=5) appended to file descriptor 5 (open() takes an int as one), a directory was a bare
    IsADirectoryError after the events were drained (lost), and a full disk could leave half an event line."""
    with _load(False) as r:
        r.generate([[*PREFIX, 1]], max_new_tokens=2, ignore_eos=True)
        with pytest.raises(ConfigError, match=r"^kv_cache_events: jsonl: expected a path \(a str or os.PathLike\), "
                                              r"got 5$"):
            r.kv_cache_events(jsonl=5)
        with pytest.raises(ConfigError, match=rf"^kv_cache_events: jsonl {tmp_path}: cannot append to it \(Is a "
                                              r"directory\); the events stay in the buffer$"):
            r.kv_cache_events(jsonl=tmp_path)
        assert r.kv_cache_events()["events"]  # still there: refused before the drain
        if os.path.exists("/dev/full"):  # a disk that is full
            r.generate([list(range(300, 340))], max_new_tokens=2, ignore_eos=True)  # new blocks: new events
            with pytest.raises(OutputError, match=r"^kv_cache_events: jsonl /dev/full: cannot write the \d+ events "
                                                  r"drained \(No space left on device\)"):
                r.kv_cache_events(jsonl="/dev/full")


def test_a_full_buffer_drops_the_oldest_and_says_how_many():
    with _load(False, events=2) as r:
        r.generate([[*PREFIX, 1]], max_new_tokens=2, ignore_eos=True)
        r.reset_prefix_cache()
        r.generate([list(range(400, 440))], max_new_tokens=2, ignore_eos=True)
        batch = r.kv_cache_events()
        assert len(batch["events"]) == 2 and batch["dropped"] >= 1
        assert batch["events"][0]["seq"] == batch["events"][1]["seq"] - 1
        assert r.kv_cache_events() == {"events": [], "dropped": 0}


def test_off_by_default_with_no_buffer_and_a_clear_error():
    with pipeline.load("tiny-llama", kv_cache_config={"max_tokens": 256}, log=False) as r:
        assert r.kv_manager.kv_events is None and r.kv_manager.pool.on_evict is None
        with pytest.raises(ConfigError, match="event_buffer_max_size > 0"):
            r.kv_cache_events()


def test_served_at_the_kv_events_endpoint():
    from tests.serve_support import serving

    kv = {"max_tokens": 1024, "tokens_per_block": T, "event_buffer_max_size": 100}
    with serving("tiny-llama", kv_cache_config=kv) as s:
        r = s.client.completions.create(model="tiny-llama", prompt=PREFIX, max_tokens=2)
        assert s.http.head("/v1/kvload/kv_events").headers["allow"] == "GET"  # a HEAD would drain them unseen
        events = s.http.get("/v1/kvload/kv_events").json()
        stored = [h for e in events["events"] if e["type"] == "kv_block_stored" for h in e["block_hashes"]]
        assert stored[:3] == _keys(PREFIX)[:3] and events["dropped"] == 0
        assert r.usage.completion_tokens == 2
        assert s.http.get("/v1/kvload/kv_events").json() == {"events": [], "dropped": 0}  # drained
    with serving("tiny-llama") as s:
        r = s.http.get("/v1/kvload/kv_events")
        assert r.status_code == 400 and r.json()["error"]["param"] == "event_buffer_max_size"
        assert "--event_buffer_max_size N" in r.json()["error"]["message"]  # the flag that turns them on


def test_a_full_disk_stops_the_events_file_with_one_warning_and_fails_no_request(tmp_path, monkeypatch):
    """vLLM never fails a request over event publishing: a write that fails (here after a partial one, as a disk
    that fills mid-line does) cuts the file back to its last whole line, stops it and is reported once."""
    from kvload.serve.server import mirror_kv_events
    from tests.serve_support import serving, wait_for

    path = tmp_path / "events.jsonl"
    kv = {"max_tokens": 1024, "tokens_per_block": T, "event_buffer_max_size": 1000}
    with serving("tiny-llama", kv_cache_config=kv) as s:
        mirror = mirror_kv_events(s.state, str(path))
        real_write, calls = os.write, []

        def filling(fd, data):  # one line fits, then half the next, then the disk is full
            if fd != mirror._fd:
                return real_write(fd, data)
            calls.append(len(data))
            if len(calls) == 1:
                return real_write(fd, data)
            if len(calls) == 2:
                return real_write(fd, bytes(data[:len(data) // 2]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "write", filling)
        for base in (100, 200, 300):
            r = s.http.post("/v1/completions", json={"prompt": list(range(base, base + 40)), "max_tokens": 2})
            assert r.status_code == 200, r.text
        assert len(calls) == 3  # nothing written once the write failed
        lines = path.read_text().split("\n")
        assert lines[-1] == "" and [json.loads(line)["type"] for line in lines[:-1]] == ["kv_block_stored"]
        # the in-memory buffer and its endpoint go on: every prompt's blocks
        events = s.http.get("/v1/kvload/kv_events").json()["events"]
        assert len([e for e in events if e["type"] == "kv_block_stored"]) >= 3
        wait_for(lambda: s.result.audit.of("kv_events_file_failed"), what="the warning")
        (warned,) = s.result.audit.of("kv_events_file_failed")
        assert warned["level"] == "warning" and warned["field"] == "--kv-events-file"
        assert warned["path"] == str(path) and warned["error"] == "[Errno 28] No space left on device"
        assert "--kv-events-file" in warned["reason"] and str(path) in warned["reason"]
        assert s.http.get("/health").json() == {"status": "ok"}


def test_a_group_with_longer_blocks_reports_them_whole_and_chains_its_own_parents():
    # DeepSeek V4 with 16-token blocks: its compressed group's blocks hold 128 tokens (8 positions); each event must
    # carry that block's 128 tokens and size, and name the group's previous block as parent (it never stored the
    # 16-token position before)
    from cache_backends.request import Request
    from engine.driver import Driver

    kv = {"max_tokens": 4096, "tokens_per_block": 16, "event_buffer_max_size": 1000}
    with pipeline.load("tiny-deepseek-v4", kv_cache_config=kv, max_seq_len=1024, log=False) as r:
        sizes = {g.name: g.tokens_per_block for g in r.kv_manager.layout.groups}
        assert 128 in sizes.values()
        driver = Driver(r.kv_manager, r.scheduler)
        driver.add(Request("a", list(range(1000, 1300)), 2))
        while driver.has_work:
            driver.step(lambda out: {c.request.req_id: 5 for c in out.scheduled
                                     if c.request.num_computed_tokens + c.num_tokens == c.request.num_tokens})
        stored = [e for e in r.kv_cache_events()["events"] if e["type"] == "kv_block_stored"]
    prompt = list(range(1000, 1300))
    for group, size in sizes.items():
        blocks = [(h, e) for e in stored if e["layer_group"] == group for h in e["block_hashes"]]
        assert blocks, group
        seen: list[str] = []
        for e in (e for e in stored if e["layer_group"] == group):
            n = len(e["block_hashes"])
            assert e["tokens_per_block"] == size and len(e["token_ids"]) == n * size
            start = len(seen) * size  # one request: the group's blocks are stored in prompt order
            assert e["token_ids"] == prompt[start:start + n * size]
            assert e["parent_block_hash"] == (seen[-1] if seen else None)  # the group's own previous block
            seen += e["block_hashes"]


@pytest.mark.parametrize("command", [
    ("plan", "tiny-llama", "--max_tokens", "256"),
    ("run", "tiny-llama", "--max_tokens", "256"),
    ("generate", "tiny-llama", "--prompt-ids", "1,2", "--max_new_tokens", "2", "--max_tokens", "256"),
    ("simulate", "tiny-llama", "--workload", "shared-prefix", "--requests", "4", "--workload-arg", "group_size=2",
     "--workload-arg", "prefix_len=32", "--workload-arg", "question_len=8", "--workload-arg", "answer_len=4"),
], ids=lambda c: c[0])
def test_cli_commands_without_an_events_reader_say_the_buffer_is_ignored(capsys, tmp_path, command):
    from tests.cli_support import read_events, run_cli

    audit = tmp_path / "audit.jsonl"
    r = run_cli(capsys, *command, "--device", "cpu", "--event_buffer_max_size", "10", "--audit-log", str(audit))
    assert r.code == 0, r.err
    (ignored,) = [e for e in read_events(audit) if e["event"] == "setting_ignored"
                  and e["field"] == "kv_cache_config.event_buffer_max_size"]
    assert ignored["value"] == 10 and "kvload serve --kv-events-file" in ignored["reason"]
    assert "kv_cache_events()" in ignored["reason"]


def test_a_python_load_reads_its_events_and_hears_nothing_about_ignoring_them():
    with _load(False, events=10) as r:
        assert not [e for e in r.audit.of("setting_ignored") if e["field"].endswith("event_buffer_max_size")]
        r.generate([[*PREFIX, 1]], max_new_tokens=1)
        assert r.kv_cache_events()["events"]
