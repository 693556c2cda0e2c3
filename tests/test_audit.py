"""The audit log: provenance, replay, JSON Lines, and the property that ties them together."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipeline
from models import ModelSpec, register_model, unregister_model
from pipeline import AuditError, AuditLog
from pipeline.converter import unstructure
from pipeline.paths import flatten
from tests.conftest import llama_config, write_config


def test_replay_reproduces_final_args_for_every_preset():
    for preset in ["tiny-llama", "tiny-gemma3", "tiny-deepseek-v3", "tiny-deepseek-v4"]:
        result = pipeline.plan(preset, log=False)
        assert result.audit.replay() == unstructure(result.args)
        assert result.audit.verify() == []


def test_provenance_chain_for_the_v4_decision():
    result = pipeline.plan("tiny-deepseek-v4", log=False)
    chain = result.audit.provenance("kv_cache_config.use_kv_cache_manager_v2")
    assert [(s["stage"], s["source"], s["old"], s["new"]) for s in chain] == [
        ("apply_model_defaults", "model_default", "auto", True),
        ("resolve_auto", "model_default", True, True),
    ]
    assert chain[-1]["original"] == "auto"


def test_events_are_numbered_and_named():
    result = pipeline.plan("tiny-llama", log=False)
    seqs = [e["seq"] for e in result.audit.events]
    assert seqs == list(range(len(seqs)))
    names = {e["event"] for e in result.audit.events}
    assert {"stage_started", "stage_finished", "args_parsed", "user_fields_snapshotted", "auto_captured",
            "model_resolved", "auto_resolved", "executor_routed", "pipeline_finished"} <= names


def test_jsonl_round_trip_and_header(tmp_path):
    path = tmp_path / "audit.jsonl"
    result = pipeline.plan("tiny-deepseek-v4", audit_log=path, log=False)
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["event"] == "audit_header" and header["schema_version"] == 1 and "kvload_version" in header
    back = AuditLog.from_jsonl(path)
    assert back.events == json.loads(json.dumps(result.audit.events))
    assert back.replay() == unstructure(result.args)
    assert back.verify() == []


def test_tampered_log_fails_verification(tmp_path):
    path = tmp_path / "audit.jsonl"
    pipeline.plan("tiny-llama", audit_log=path, log=False)
    lines = path.read_text().splitlines()
    tampered = [ln.replace('"new":false', '"new":true') if '"auto_resolved"' in ln and "manager_v2" in ln else ln
                for ln in lines]
    assert tampered != lines
    path.write_text("\n".join(tampered) + "\n")
    problems = AuditLog.from_jsonl(path).verify()
    assert problems and "use_kv_cache_manager_v2" in problems[0]


def _tamper(path, event: str, old: str, new: str) -> None:
    lines = path.read_text().splitlines()
    tampered = [ln.replace(old, new) if f'"event":"{event}"' in ln else ln for ln in lines]
    assert tampered != lines
    path.write_text("\n".join(tampered) + "\n")


@pytest.mark.parametrize(("event", "old", "new", "message"), [
    ("args_parsed", '"new":"tiny-llama"', '"new":"tiny-gemma3"',
     "model: user_fields_snapshotted records value 'tiny-llama', the args_parsed events give 'tiny-gemma3'"),
    ("user_fields_snapshotted", '"source":"api"', '"source":"config_file"',
     "user_fields_snapshotted records source 'config_file', the args_parsed events give 'api'"),
    ("user_fields_snapshotted", ',"max_batch_size":{"value":4,"source":"api"}', "",
     "max_batch_size: user_fields_snapshotted leaves it out, the args_parsed events give 4 from api"),
])
def test_a_snapshot_that_disagrees_with_args_parsed_says_what_differs(tmp_path, event, old, new, message):
    from kvload.explain import verify_log

    path = tmp_path / "audit.jsonl"
    pipeline.plan("tiny-llama", max_batch_size=4, audit_log=path, log=False)
    _tamper(path, event, old, new)
    problems = verify_log(AuditLog.from_jsonl(path))["problems"]  # what kvload audit --verify prints
    assert any(message in p for p in problems), problems


def test_failed_run_leaves_no_audit_file(tmp_path):
    path = tmp_path / "audit.jsonl"
    with pytest.raises(pipeline.RouteError):
        pipeline.plan("tiny-deepseek-v4", kv_cache_config={"use_kv_cache_manager_v2": False}, audit_log=path,
                      log=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["a" * 249 + ".jsonl", "é" * 124 + ".jsonl"], ids=["ascii", "two-byte"])
def test_an_audit_log_under_the_longest_file_name_is_written(tmp_path, name):
    # 255 bytes, the usual NAME_MAX: the temporary ".NAME.<12 hex>.tmp" beside it was 18 bytes too long
    assert len(name.encode()) in (254, 255)
    path = tmp_path / name
    pipeline.plan("tiny-llama", audit_log=path, log=False)
    assert [p.name for p in tmp_path.iterdir()] == [name]
    assert AuditLog.from_jsonl(path).events


@pytest.mark.parametrize("call", ["plan", "load", "LLM"])
def test_an_api_audit_log_that_is_a_directory_is_refused_before_anything_runs(tmp_path, call, track_pools):
    # the API raised a raw IsADirectoryError at publication, after the whole load (weights and pools)
    import kvload

    events: list[dict] = []
    fn = {"plan": kvload.plan, "load": kvload.load, "LLM": kvload.LLM}[call]
    (tmp_path / "adir").mkdir()
    with pytest.raises(pipeline.ConfigError, match=r"^audit_log .*adir: is a directory, expected a file path$"):
        fn("tiny-llama", audit_log=tmp_path / "adir", subscribers=[events.append], log=False)
    assert events == [] and not track_pools


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "empty file"),
        # blank lines are skipped, so a file of only blank lines (or spaces) is as empty as 0 bytes
        ("\n\n\n", r"a\.jsonl: empty file, expected a kvload audit log"),
        ("   \n  \n \t", r"a\.jsonl: empty file, expected a kvload audit log"),
        ("\n\n" + '{"event": "stage_started"}\n', "line 3: not a kvload audit log"),
        ('{"event": "audit_header", "schema_version": 1}\n{"event": "args_pa', "line 2: truncated"),
        ('{"event": "stage_started"}\n', "not a kvload audit log"),
        ('{"event": "audit_header", "schema_version": 99}\n', "schema_version 99 is not supported"),
        ('[1, 2]\n', "expected a JSON object"),
        # a complete line that is not JSON is not "truncated", last line or not
        ("notjson\n", r"line 1: not JSON \(Expecting value at column 1\); each line must be one JSON record$"),
        ("notjson", r"line 1: not JSON \(Expecting value"),
        ('{"event": "audit_header", "schema_version": 1}\n{"event": "args_parsed", "x": 1',
         "line 2: truncated"),
        ('{"event": "audit_header", "schema_version": 1}\n{"event": "x", "v": ' + "9" * 5000 + "}\n",
         r"line 2: a number is too long \(over \d+ digits\) to be an audit value$"),
    ],
)
def test_unusable_audit_files(tmp_path, content, message):
    path = tmp_path / "a.jsonl"
    path.write_text(content)
    with pytest.raises(AuditError, match=message):
        AuditLog.from_jsonl(path)


# --- the property: user-set leaves never change, replay reproduces the final args -------------

KV_VALUES = {
    "use_kv_cache_manager_v2": st.sampled_from([True, False, "auto"]),
    "tokens_per_block": st.integers(1, 256),
    "enable_block_reuse": st.booleans(),
    "enable_partial_reuse": st.booleans(),
    "free_gpu_memory_fraction": st.floats(0.01, 1.0),
    "max_tokens": st.none() | st.integers(1, 10**7),
    "max_gpu_total_bytes": st.integers(0, 2**40),
    "host_cache_size": st.none() | st.integers(0, 2**36),
    "dtype": st.sampled_from(["auto", "float16", "bfloat16", "float32"]),
    "max_util_for_resume": st.floats(0.01, 1.0),
    "enable_swa_scratch_reuse": st.booleans(),
    "event_buffer_max_size": st.integers(0, 10**6),
}
MODEL_SETTABLE_KV = ["use_kv_cache_manager_v2", "tokens_per_block", "enable_block_reuse", "enable_partial_reuse",
                     "dtype", "max_util_for_resume", "enable_swa_scratch_reuse", "event_buffer_max_size"]


def _subdict(names, strategy_for):
    return st.fixed_dictionaries({}, optional={n: strategy_for(n) for n in names})


user_kv = _subdict(list(KV_VALUES), lambda n: KV_VALUES[n])
model_kv = _subdict(MODEL_SETTABLE_KV, lambda n: KV_VALUES[n].filter(lambda v: v != "auto"))


@pytest.fixture(scope="module")
def property_checkpoint(tmp_path_factory):
    arch = "PropertyForCausalLM"

    @register_model(arch, replace=True)
    class PropertySpec(ModelSpec):
        proposals: ClassVar[dict] = {}

        def get_model_defaults(self, args):
            return {"kv_cache_config": dict(type(self).proposals)} if type(self).proposals else {}

    path = write_config(tmp_path_factory.mktemp("prop") / "ckpt", llama_config(arch))
    yield path, PropertySpec
    unregister_model(arch)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(user=user_kv, proposals=model_kv, batch=st.none() | st.integers(1, 64))
def test_user_leaves_never_change_and_replay_reproduces(property_checkpoint, user, proposals, batch):
    path, spec_cls = property_checkpoint
    spec_cls.proposals = proposals
    overrides = {"kv_cache_config": user}
    if batch is not None:
        overrides["max_batch_size"] = batch
    result = pipeline.plan(str(path), log=False, **overrides)
    final = flatten(unstructure(result.args))
    for key, value in user.items():
        if value != "auto":  # an explicit "auto" is the user asking kvload to decide
            assert final[f"kv_cache_config.{key}"] == value
    for key, value in proposals.items():
        if key not in user:
            want = value
            if key == "use_kv_cache_manager_v2" and result.route.fallback:
                want = False
            assert final[f"kv_cache_config.{key}"] == want
    assert result.audit.replay() == unstructure(result.args)
    assert "auto" not in final.values()


@settings(max_examples=60, deadline=None)
@given(pinned=st.integers(0, 5), keep=st.integers(0, 40), appended=st.integers(0, 200))
def test_a_bounded_log_keeps_its_pinned_records_and_exactly_the_newest_tail(pinned, keep, appended):
    log = AuditLog({"event": "load", "i": i} for i in range(pinned))
    log.keep_tail(keep)
    for i in range(appended):
        log({"event": "request_finished", "i": i})
    head, tail, dropped = log.tail()
    assert [r["i"] for r in head] == list(range(pinned))  # a server's load records are never let go
    assert [r["i"] for r in tail] == list(range(appended))[max(0, appended - keep):]
    assert dropped == appended - len(tail)
    assert len(log.events) <= pinned + keep + keep // 8 + 1  # memory stays bounded


def test_an_unbounded_log_drops_nothing():
    log = AuditLog()
    for i in range(50):
        log({"event": "e", "i": i})
    head, tail, dropped = log.tail()
    assert len(head) + len(tail) == 50 and dropped == 0
    with pytest.raises(ValueError, match="max_records"):
        log.keep_tail(-1)


def _served_audit(dropped: int) -> str:
    """The body of GET /v1/kvload/audit after --audit-keep let ``dropped`` request-time records go (as the app
    builds it): header, the load's records, the marker, then the newest record kept."""
    from pipeline.audit import dropped_record

    log = pipeline.plan("tiny-llama", log=False).audit
    last = log.events[-1]["seq"]
    kept = {"event": "request_finished", "stage": "generate", "seq": last + 1 + dropped, "req_id": "srv-9",
            "reason": "length", "prompt_tokens": 3, "output_tokens": 2, "reused_prompt_tokens": 0}
    records = [log.header, *log.events, dropped_record(dropped, kept=1, keep=1), kept]
    return "".join(json.dumps(r) + "\n" for r in records)


def test_a_served_audit_with_dropped_records_reads_and_verifies(capsys, tmp_path):
    """kvload serve's own /v1/kvload/audit was refused by kvload audit/explain once --audit-keep dropped records
    ('unknown event audit_records_dropped'); the marker says where the gap is, so seq is unbroken around it."""
    from tests.cli_support import run_cli

    path = tmp_path / "served.jsonl"
    path.write_text(_served_audit(dropped=3))
    log = AuditLog.from_jsonl(path)
    assert log.dropped == 3 and log.events[-1]["event"] == "request_finished"
    r = run_cli(capsys, "audit", path, "--verify")
    assert r.code == 0, r.err
    assert "3 request-time records the server dropped" in r.out
    assert run_cli(capsys, "explain", path, "max_tokens").code == 0


def test_a_dropped_marker_hides_no_more_than_it_says(tmp_path):
    text = _served_audit(dropped=3).replace('"dropped": 3', '"dropped": 2')  # the gap is one record wider
    path = tmp_path / "served.jsonl"
    path.write_text(text)
    from kvload.explain import verify_log

    assert not verify_log(AuditLog.from_jsonl(path))["ok"]


def test_a_failed_plan_hands_its_events_to_the_caller_on_the_error_and_leaves_no_file(tmp_path):
    import kvload
    from pipeline.errors import RouteError

    target = tmp_path / "f.jsonl"
    with pytest.raises(RouteError) as info:
        kvload.plan("tiny-deepseek-v4", kv_cache_config={"use_kv_cache_manager_v2": False}, audit_log=target, log=False)
    audit = info.value.audit
    names = [e["event"] for e in audit.events]
    assert names[-1] == "stage_failed" and audit.of("stage_failed")[0]["stage"] == "route_executor"
    assert "auto_captured" in names  # the decisions made before the failure are all there
    assert list(tmp_path.iterdir()) == []  # no audit file, no temporary: a failed run leaves nothing behind


def test_verify_names_a_generate_call_that_never_ended():
    import kvload
    from kvload.explain import verify_log

    with kvload.LLM("tiny-llama", log=False, kv_cache_config={"max_tokens": 512}) as llm:
        llm.generate([[1, 2, 3]], max_tokens=2)
        events = [dict(e) for e in llm.result.audit.events]
    assert verify_log(AuditLog(events))["problems"] == []
    started = next(i for i, e in enumerate(events) if e["event"] == "generation_started")
    mid_call = verify_log(AuditLog(events[: started + 3]))  # as written while the call ran: seq unbroken
    assert not mid_call["ok"]
    seq = events[started]["seq"]
    assert mid_call["problems"] == [f"generate call 0 (seq {seq}) started and never ended: no generation_finished or "
                                    "generation_failed (the log was written while it ran, or its end was removed)"]


def _long_log(path, calls: int, edit=None) -> None:
    """A plan's load records, then ``calls`` generate calls of 4 requests each, as a long run's --audit-log holds
    them (chained as kvload writes it); ``edit(records)`` may damage the list first."""
    from pipeline.audit import JsonlSink

    records = [dict(e) for e in pipeline.plan("tiny-llama", log=False).audit.events]
    for call in range(calls):
        common = {"stage": "generate", "prompt_tokens": 3, "reused_prompt_tokens": 0}
        records.append({"event": "generation_started", "stage": "generate", "call": call, "requests": 4,
                        "prompt_tokens": 12, "max_new_tokens": 2, "temperature": 0.0, "top_p": 1.0, "seed": None,
                        "salted": False, "kv_manager": "KVCacheManager"})
        records += [{"event": "request_admitted", **common, "req_id": f"{call}-{i}"} for i in range(4)]
        records += [{"event": "request_finished", **common, "req_id": f"{call}-{i}", "reason": "length",
                     "output_tokens": 2} for i in range(4)]
        records.append({"event": "generation_finished", "stage": "generate", "call": call, "requests": 4,
                        "prompt_tokens": 12, "reused_prompt_tokens": 0, "generated_tokens": 8, "steps": 2,
                        "suspends": 0, "resumes": 0, "preemptions": 0, "duration_ms": 1.0, "tokens_per_s": 8.0})
    for seq, record in enumerate(records):
        record["seq"] = seq
    if edit is not None:
        edit(records)
    with JsonlSink(path) as sink:
        for record in records:
            sink(record)


@pytest.mark.parametrize("command", [["audit", "--verify"], ["explain"]])
def test_audit_and_explain_read_a_long_log_without_holding_it(capsys, tmp_path, command):
    """A 121 MB log of a long run took 2 GB to `kvload audit --verify`: the whole text, its lines and every record
    were held at once. Read as a stream, only the records the reports use are held: a log twice as long costs a
    small part of the added bytes (the command's fixed cost, its parser of every subcommand's flags, aside)."""
    import tracemalloc

    from tests.cli_support import run_cli

    peaks, sizes = [], []
    for calls in (600, 1200):
        path = tmp_path / f"long{calls}.jsonl"
        _long_log(path, calls=calls)
        sizes.append(path.stat().st_size)
        run_cli(capsys, command[0], path, *command[1:])  # imports and caches warmed outside the measurement
        tracemalloc.start()
        try:
            r = run_cli(capsys, command[0], path, *command[1:])
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert r.code == 0, r.err
    grown, added = peaks[1] - peaks[0], sizes[1] - sizes[0]
    assert grown < added / 4, f"peak {peaks[0]:,} -> {peaks[1]:,} bytes for logs of {sizes[0]:,} -> {sizes[1]:,} bytes"
    assert peaks[1] < sizes[1] / 2, f"peak {peaks[1]:,} bytes reading a {sizes[1]:,}-byte log"


def test_a_streamed_read_reports_what_a_whole_read_does(tmp_path):
    """``kvload audit``/``explain`` keep only the events their reports read and make the seq and generate-call checks
    on the way: on a damaged log (a call that never ended, a record removed) they say what the full log says."""
    from kvload.explain import explain, read_log, summarize, verify_log

    def damage(records):
        def at(name, call):
            return next(i for i, r in enumerate(records) if r["event"] == name and r.get("call") == call)
        records[at("generation_finished", 3)]["call"] = 9  # call 3 never ended; an end of no call
        records[at("generation_started", 4)]["call"] = 0  # a start of a call that ended before
        del records[at("generation_finished", 1)]  # call 1 never ended, and seq skips one from there
    path = tmp_path / "long.jsonl"
    _long_log(path, calls=5, edit=damage)
    whole, streamed = AuditLog.from_jsonl(path), read_log(path)
    assert len(streamed.events) < len(whole.events) and len(streamed) == len(whole)
    check = verify_log(whole)
    gap = next(i for i, e in enumerate(whole.events) if e["seq"] != i)
    starts = {e["call"]: e["seq"] for e in whole.of("generation_started")}
    assert [p for p in check["problems"] if "seq" in p] == [
        f"event {gap + 1} has seq {gap + 1}, expected {gap}: events were removed, added or reordered",
        *(f"generate call {call} (seq {starts[call]}) started and never ended: no generation_finished or "
          "generation_failed (the log was written while it ran, or its end was removed)" for call in (1, 3))]
    assert verify_log(streamed) == check
    assert summarize(streamed, "x") == summarize(whole, "x")
    assert explain(streamed) == explain(whole)
    fields = ["max_seq_len", "kv_cache_config.use_kv_cache_manager_v2", "kv_cache_config.host_cache_size", "device",
              "generation_config", "override_generation_config"]
    assert explain(streamed, fields) == explain(whole, fields)


def _served_log(path, requests: int) -> None:
    """A plan's load records, then one ``setting_ignored`` per served request (``top_k`` under greedy decoding), each
    naming its request as ``kvload serve`` writes them."""
    from pipeline.audit import JsonlSink

    records = [dict(e) for e in pipeline.plan("tiny-llama", log=False).audit.events]
    records += [{"event": "setting_ignored", "stage": "serve", "level": "warning", "field": "serve.top_k",
                 "value": 5, "reason": f"temperature is 0 (greedy): nothing is sampled (request cmpl-{i:08x})",
                 "request": f"cmpl-{i:08x}"} for i in range(requests)]
    for seq, record in enumerate(records):
        record["seq"] = seq
    with JsonlSink(path) as sink:
        for record in records:
            sink(record)


def test_audit_holds_one_entry_per_distinct_warning_not_one_per_record(capsys, tmp_path):
    """A served run warns per request (a setting that acts on nothing under greedy decoding): `kvload audit` held
    every such record while reading the log, and each named its request, so none grouped with another and a day's log
    printed one line per request. Read now, each distinct warning is one entry with its count, and the memory of the
    read does not grow with the number of requests."""
    import tracemalloc

    from tests.cli_support import run_cli

    peaks = {}
    for requests in (250, 10_000):
        path = tmp_path / f"served-{requests}.jsonl"
        _served_log(path, requests)
        run_cli(capsys, "audit", path, "--json")  # imports and caches warmed outside the measurement
        tracemalloc.start()
        try:
            r = run_cli(capsys, "audit", path, "--json")
            peaks[requests] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert r.code == 0, r.err
        served = [w for w in r.json()["warnings"] if w["event"] == "setting_ignored"]
        assert [(w["message"], w["count"]) for w in served] == [
            ("serve.top_k: temperature is 0 (greedy): nothing is sampled", requests)]
    # 40 times the records: a read holding each one peaked at about 36 times the memory (0.4 MB, 15.7 MB), a bounded
    # one at the same
    assert peaks[10_000] < 3 * peaks[250], peaks
    text = run_cli(capsys, "audit", tmp_path / "served-10000.jsonl").out
    assert text.count("serve.top_k") == 1 and "nothing is sampled  (x10,000)" in text


def test_a_record_holding_a_lone_surrogate_is_written_once_and_the_log_verifies(capsys, tmp_path):
    """``kvload serve`` records what a request sent (a ``setting_ignored`` naming its ``metadata``); a lone surrogate
    there (JSON's "\\ud800") failed the chain's strict UTF-8: the record was never linked, the one before it was written
    twice, and the server's own audit failed ``--verify`` ("event 57 has seq 55, expected 56")."""
    from pipeline.audit import JsonlSink
    from tests.cli_support import run_cli

    records = [dict(e) for e in pipeline.plan("tiny-llama", log=False).audit.events]
    records += [{"event": "setting_ignored", "stage": "serve", "level": "warning", "field": "serve.metadata",
                 "value": {"k": "a\ud800"}, "reason": "kvload keeps no per-user records of requests (request r1)",
                 "request": "r1"}]
    for seq, record in enumerate(records):
        record["seq"] = seq
    path = tmp_path / "served.jsonl"
    with JsonlSink(path) as sink:
        for record in records:
            sink(record)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(records) + 1 and len(set(lines)) == len(lines)  # the header, then each record once
    r = run_cli(capsys, "audit", path, "--verify")
    assert r.code == 0, r.err
    assert "chain   sha256 chain intact" in r.out


def test_a_sink_told_to_wait_creates_no_temporary_until_then_and_writes_the_same_file(tmp_path):
    """A rank under torchrun holds its records in memory until the ranks met (``wait``): SIGKILLed before, it leaves
    no temporary that no other rank knows of. Once it may write, the file is the one a sink that never waited writes;
    a failed run that never got there leaves nothing, and one that ends still waiting publishes all it held."""
    from pipeline.audit import JsonlSink

    records = [dict(e) for e in pipeline.plan("tiny-llama", log=False).audit.events]
    plain, held, failed, never = (tmp_path / d for d in ("plain", "held", "failed", "never"))
    for folder in (plain, held, failed, never):
        folder.mkdir()
    with JsonlSink(plain / "a.jsonl") as sink:
        for record in records:
            sink(record)
    waiting = [True]
    with JsonlSink(held / "a.jsonl", wait=lambda: waiting[0]) as sink:
        for record in records[:5]:
            sink(record)
        assert list(held.iterdir()) == []  # no temporary while it waits
        waiting[0] = False
        for record in records[5:]:
            sink(record)
        assert [p.name.endswith(".tmp") for p in held.iterdir()] == [True]
    assert (held / "a.jsonl").read_bytes() == (plain / "a.jsonl").read_bytes()
    with pytest.raises(RuntimeError), JsonlSink(failed / "a.jsonl", wait=lambda: True) as sink:
        sink(records[0])
        raise RuntimeError("the run failed before the ranks met")
    assert list(failed.iterdir()) == []
    with JsonlSink(never / "a.jsonl", wait=lambda: True) as sink:  # ended before the ranks met (no collective ran)
        for record in records:
            sink(record)
    assert (never / "a.jsonl").read_bytes() == (plain / "a.jsonl").read_bytes()


@pytest.mark.parametrize("replace", [True, False])
@pytest.mark.parametrize("refusal", ["ENOSPC", "EROFS"])
def test_a_publish_the_os_refuses_names_the_file_and_leaves_nothing(tmp_path, monkeypatch, replace, refusal):
    """The last step of writing an audit log, moving the temporary onto its name, can meet a full disk (a directory
    that needs a new block) or a folder made read-only meanwhile: one line naming the flag and the file (exit 1), the
    file as it was and no temporary left. It was a raw ``OSError`` naming neither."""
    import errno
    import os
    import re

    from pipeline.audit import JsonlSink, atomic_output
    from pipeline.errors import OutputError

    code = getattr(errno, refusal)

    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "replace", refuse)
    monkeypatch.setattr(os, "link", refuse)
    path = tmp_path / "a.jsonl"
    with pytest.raises(OutputError) as caught, JsonlSink(path, replace=replace, flag="--audit-log") as sink:
        sink({"event": "x", "seq": 0})
    assert str(caught.value) == f"--audit-log {path}: cannot write it ({os.strerror(code)}); nothing was written"
    other = tmp_path / "b.txt"
    with (pytest.raises(OutputError, match=f"^{re.escape(f'--out {other}')}: cannot write it"),
          atomic_output(other, "--out", replace=replace) as tmp, open(tmp, "w") as f):
        f.write("x")
    assert list(tmp_path.iterdir()) == []
