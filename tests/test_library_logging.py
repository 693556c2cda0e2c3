"""kvload as a library: events go through ``logging`` when the application set it up, env vars set the
rest, and every audit record carries a ``ts`` that replay and ``--verify`` leave alone."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import textwrap

from pipeline.audit import AuditLog
from tests.cli_support import ENV, REPO, read_events, run_cli

#: A plan whose KV budget holds no whole sequence: one warning (kv_budget_short) among info events.
PLAN = 'import kvload.api as k\nk.plan("tiny-llama", kv_cache_config={"max_tokens": 1024})\n'


def app(*parts: str, **env: str) -> subprocess.CompletedProcess:
    """Run an application script (its parts, each dedented) in a fresh interpreter."""
    code = "".join(textwrap.dedent(p) for p in parts)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**ENV, "PYTHONPATH": str(REPO), **env})


def test_an_application_that_configured_logging_gets_kvloads_events_as_records():
    r = app("""
        import logging, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout,
                            format="APP %(levelname)s %(name)s %(kvload_event)s: %(message)s")
    """, PLAN)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(line.startswith("APP WARNING kvload kv_budget_short: kv_budget_short ") for line in lines), lines
    assert not any(" INFO " in line for line in lines)  # the application's level decides
    assert "kv_budget_short" not in r.stderr  # kvload printed nothing by itself


def test_records_carry_the_payload_for_handlers():
    r = app("""
        import logging, json
        seen = []
        class Keep(logging.Handler):
            def emit(self, record):
                seen.append((record.levelname, record.kvload_event, record.kvload))
        logging.getLogger("kvload").addHandler(Keep())
        logging.getLogger("kvload").setLevel(logging.INFO)
    """, PLAN, """
        short = [p for lvl, e, p in seen if e == "kv_budget_short"]
        print(json.dumps({"n": len(seen), "short": short, "levels": sorted({lvl for lvl, _, _ in seen})}))
    """)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.splitlines()[-1])
    assert doc["n"] > 10 and doc["levels"] == ["INFO", "WARNING"]
    assert doc["short"][0]["capacity_tokens"] == 1024


def test_without_logging_warnings_go_to_stderr_and_env_vars_choose_level_and_format():
    quiet = app(PLAN)
    assert quiet.returncode == 0 and quiet.stdout == ""
    assert [line for line in quiet.stderr.splitlines() if line.strip()] == [
        line for line in quiet.stderr.splitlines() if "kv_budget_short" in line]
    chatty = app(PLAN, KVLOAD_LOG_LEVEL="info", KVLOAD_LOG_FORMAT="json")
    events = [json.loads(line)["event"] for line in chatty.stderr.splitlines()]
    assert "stage_started" in events and "kv_budget_short" in events


def test_cli_reads_the_env_vars_and_its_flags_win(capsys, monkeypatch):
    monkeypatch.setenv("KVLOAD_LOG_LEVEL", "info")
    r = run_cli(capsys, "plan", "tiny-llama")
    assert r.code == 0 and "stage_started" in r.err
    r = run_cli(capsys, "plan", "tiny-llama", "--log-level", "warning")
    assert r.code == 0 and "stage_started" not in r.err
    monkeypatch.setenv("KVLOAD_LOG_LEVEL", "loud")
    r = run_cli(capsys, "plan", "tiny-llama")
    assert r.code == 2 and r.one_error_line and "KVLOAD_LOG_LEVEL='loud'" in r.err


def test_audit_records_carry_an_iso_utc_timestamp_that_verify_ignores(capsys, tmp_path):
    log = tmp_path / "a.jsonl"
    before = datetime.datetime.now(datetime.UTC)
    assert run_cli(capsys, "plan", "tiny-llama", "--audit-log", log).code == 0
    after = datetime.datetime.now(datetime.UTC)
    records = read_events(log)[1:]
    stamps = [datetime.datetime.fromisoformat(r["ts"]) for r in records]
    assert all(s.utcoffset() == datetime.timedelta(0) for s in stamps)
    assert stamps == sorted(stamps) and before <= stamps[0] and stamps[-1] <= after
    assert run_cli(capsys, "audit", log, "--verify").code == 0
    # the replay never reads ts: the same events without it verify alike
    with_ts = AuditLog.from_jsonl(log)
    without = AuditLog([{k: v for k, v in e.items() if k != "ts"} for e in with_ts.events])
    assert with_ts.verify() == without.verify() == [] and with_ts.replay() == without.replay()
