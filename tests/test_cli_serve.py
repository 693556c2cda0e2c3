"""``kvload serve`` as a real process: listens, answers, stops on SIGINT; bad flags exit 2 with one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.cli_support import ENV, REPO, imports_after, kvload, ready_url, reap, run_cli, served_with, until_ready
from tests.hostile_support import signal_again_script, signals_as_a_terminal_gives_them


def test_serve_process_answers_then_stops_cleanly_on_sigterm(tmp_path):
    events = tmp_path / "kv_events.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "kvload", "serve", "tiny-llama", "--port", "0", "--max_tokens",
                             "1024", "--event_buffer_max_size", "100", "--kv-events-file", str(events),
                             "--audit-log", str(tmp_path / "audit.jsonl"), "--audit-keep", "1",
                             "--max-request-bytes", "4KiB", "--request-read-timeout", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=signals_as_a_terminal_gives_them,
                            env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, cwd=REPO)
    try:
        before = until_ready(proc)
        # the load's warnings reach the operator while the server runs, not when it stops (--max_tokens 1024 is
        # shorter than tiny-llama's 8,192-token max_seq_len)
        assert any("kv_budget_short" in b for b in before), before
        url = ready_url(before[-1])
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get("/health").json() == {"status": "ok"}
            # a body past --max-request-bytes: 413 naming the flag, before the server reads it (small enough that
            # the server has taken it all off the socket when it closes: no reset racing the answer)
            r = http.post("/v1/completions", content=b" " * (4 * 1024 + 1),
                          headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and "at most 4,096 bytes" in r.json()["error"]["message"]
            assert "--max-request-bytes" in r.json()["error"]["message"]
            # a client that stops mid-head: 408 naming --request-read-timeout, and the connection closed
            port = int(url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: te")
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 408 ") and b"within 2 s (--request-read-timeout sets it)" in answer
            r = http.post("/v1/completions", json={"prompt": list(range(1, 41)), "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4
            written = [json.loads(line) for line in events.read_text().splitlines()]
            assert written[0]["type"] == "kv_block_stored" and written[0]["token_ids"] == list(range(1, 33))
            assert "kvload_generation_tokens_total" in http.get("/metrics").text
            r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True})
            assert r.status_code == 200
            # --audit-keep 1: the load's records and the newest request-time record, and a line saying what is not
            served = http.get("/v1/kvload/audit")
            records = [json.loads(line) for line in served.text.splitlines()]
            names = [r["event"] for r in records]
            at = names.index("audit_records_dropped")
            assert names[at - 1] == "pipeline_finished" and names[at + 1:] == ["request_finished"]
            assert records[at]["dropped"] == 3 == int(served.headers["X-Kvload-Audit-Dropped"])
            # a seed under greedy decoding does nothing: served, and said so in the operator's log (below)
            r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "seed": 5})
            assert r.status_code == 200
            # a long stream in flight when the service manager stops the server: it ends properly, not cut off
            lines, first = [], threading.Event()

            def stream():
                body = {"prompt": [9, 8, 7], "max_tokens": 900, "ignore_eos": True, "stream": True}
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                    for chunk in r.iter_lines():
                        if chunk:
                            lines.append(chunk)
                            first.set()

            reader = threading.Thread(target=stream)
            reader.start()
            assert first.wait(60)
        proc.send_signal(signal.SIGTERM)  # what service managers send
        assert proc.wait(timeout=30) == 0
        reader.join(30)
        data = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert lines[-1] == "data: [DONE]" and data[-1]["choices"][0]["finish_reason"] == "abort"
        assert len(data) < 900  # ended by the stop, not run to its end
        log = proc.stderr.read()
        assert "Traceback" not in log
        assert any("setting_ignored" in x and "serve.seed" in x for x in log.splitlines()), log
        audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
        # the served requests joined the audit log, every one of them (--audit-keep bounds only the memory)
        assert [r["event"] for r in audit].count("request_finished") == 4  # the aborted stream too
    finally:
        reap(proc)


def _start_server(*flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvload", "serve", "tiny-llama", "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, cwd=REPO,
                            preexec_fn=signals_as_a_terminal_gives_them)  # as a terminal gives it


def _ready_line(proc: subprocess.Popen) -> str:
    return until_ready(proc)[-1]


def test_json_says_it_is_ignored_by_serve():
    """``--json`` is an output flag every command takes; serve prints no result document, so it says, once, before
    the ready line, that the flag changes nothing (it was accepted silently)."""
    proc = _start_server("--json")
    try:
        lines = until_ready(proc)
        ignored = [line for line in lines if "setting_ignored" in line]
        assert len(ignored) == 1 and "--json" in ignored[0] and "prints no result document" in ignored[0], lines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        reap(proc)


def test_a_vllm_serve_command_line_runs_and_says_what_it_ignores():
    """vLLM's engine and server flags with no kvload counterpart were "unrecognized arguments" (exit 2): each is taken
    and reported setting_ignored once, before the ready line (--uvicorn-log-level acts: it is uvicorn's level, and so
    does --disable-log-stats: it turns the periodic throughput line off)."""
    flags = ("--enforce-eager", "--disable-log-requests", "--uvicorn-log-level", "warning", "--max-logprobs", "20",
             "--enable-chunked-prefill", "--disable-log-stats", "--seed", "7")
    proc = _start_server(*flags)
    try:
        lines = until_ready(proc)
        ignored = " ".join(line for line in lines if "setting_ignored" in line)
        for field in ("enforce_eager", "--disable-log-requests", "max_logprobs", "enable_chunked_prefill"):
            assert f"field={field} " in ignored, (field, lines)
        assert "field=--uvicorn-log-level" not in ignored and "field=disable_log_stats" not in ignored
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        reap(proc)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_sent_as_the_ready_line_appears_stops_the_server(signum, tmp_path):
    """The ready line tells a service manager the server runs, so a stop may come at once: it came before uvicorn
    had installed its handlers (inside server.run), and a SIGTERM then went to a do-nothing handler (the server
    ran on, 5 times in 8) while a SIGINT broke asyncio.run's start-up ("coroutine 'Server.serve' was never
    awaited"). Sent the moment the line is read, it stops the server as a later one does: exit 0, quietly, its
    audit published. SIGHUP (the terminal closed), which killed the server and left its audit's temporary, too."""
    out = tmp_path / "out"
    out.mkdir()
    proc = _start_server("--audit-log", str(out / "audit.jsonl"))
    try:
        _ready_line(proc)
        proc.send_signal(signum)
        assert proc.wait(timeout=30) == 0
        log = proc.stderr.read()
        assert "Traceback" not in log and "never awaited" not in log, log
        # and nothing else: uvicorn logs at kvload's level (warning), where it printed its INFO lines (the server
        # process started, shutting down, finished) at its own default
        assert log == "", log
        assert [p.name for p in out.iterdir()] == ["audit.jsonl"]
    finally:
        reap(proc)


@pytest.mark.parametrize("where", ["teardown", "exit"])
@pytest.mark.parametrize("first, again", [(signal.SIGINT, "SIGINT"), (signal.SIGTERM, "SIGINT"),
                                          (signal.SIGINT, "SIGTERM")])
def test_a_stop_signal_repeated_while_the_server_stops_still_stops_it_cleanly(first, again, where, tmp_path):
    """Ctrl-C pressed twice, or torchrun passing the terminal's Ctrl-C on to a rank it already reached: the second
    landed after the server stopped, while the engine stopped or the audit was published, and was raised there
    (exit 130, "error: interrupted; the --audit-log file was not written"), or once the command returned, where
    SIGTERM's default action killed the process (-15, which torchrun reports as a failed rank). The stop under way
    is repeated instead: exit 0, the audit published."""
    out = tmp_path / "out"
    out.mkdir()
    # the repeat sent from inside the engine's stop (the teardown) or from an exit callback
    script = signal_again_script("engine.serving:ServingEngine.stop")
    proc = subprocess.Popen([sys.executable, "-c", script, "serve", "tiny-llama", "--port", "0",
                             "--audit-log", str(out / "audit.jsonl")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "AGAIN": again,
                                            "WHERE": where},
                            cwd=REPO, preexec_fn=signals_as_a_terminal_gives_them)
    try:
        _ready_line(proc)
        proc.send_signal(first)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()[-2000:]
        assert proc.stderr.read() == ""
        assert [p.name for p in out.iterdir()] == ["audit.jsonl"]
    finally:
        reap(proc)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_the_ready_line_names_an_ipv6_address_in_brackets_as_a_url_has_it():
    """``--host ::1`` printed "at http://::1:PORT", which no HTTP client reads as a URL (httpx: "Invalid port")."""
    proc = _start_server("--host", "::1", "--max_tokens", "256")
    try:
        url = ready_url(_ready_line(proc))
        assert url.startswith("http://[::1]:"), url
        assert httpx.get(f"{url}/health", timeout=30).json() == {"status": "ok"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        reap(proc)


def test_a_server_whose_log_reader_went_away_serves_on(tmp_path):
    """``kvload serve ... --log-level info 2>&1 | tee serve.log`` whose tee died, or a log shipper that restarted:
    every request's info lines meet a broken pipe. The write's BrokenPipeError failed the engine step that logged it
    (and kept the record from the subscribers after the console's), so every request was a 500 "BrokenPipeError"
    while /health said ok. A log line that cannot be written is lost; the request is served and audited."""
    proc = _start_server("--log-level", "info", "--audit-log", str(tmp_path / "audit.jsonl"))
    try:
        url = ready_url(_ready_line(proc))
        proc.stderr.close()  # the reader of the server's log is gone
        with httpx.Client(base_url=url, timeout=60) as http:
            for _ in range(2):
                r = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert len(r.json()["choices"][0]["token_ids"]) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
        assert [(r["reason"], r["output_tokens"]) for r in audit if r["event"] == "request_finished"] == [
            ("length", 3), ("length", 3)]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        proc.stdout.close()


def test_a_kv_events_file_that_hits_its_size_limit_warns_once_and_fails_no_request(tmp_path):
    """A real server whose events file cannot grow (RLIMIT_FSIZE: the kernel refuses the write, part of a line
    first, as a full disk does): requests go on, one warning names the flag, the path and the error, and the file
    holds only whole lines."""
    import resource

    events = tmp_path / "kv_events.jsonl"
    limit = 700  # a line or two of events, then a write cut short, then refused

    def small_files() -> None:  # in the child only; Python ignores SIGXFSZ, so the write fails with EFBIG
        signals_as_a_terminal_gives_them()
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.Popen([sys.executable, "-m", "kvload", "serve", "tiny-llama", "--port", "0", "--max_tokens",
                             "1024", "--event_buffer_max_size", "1000", "--kv-events-file", str(events)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=small_files,
                            env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, cwd=REPO)
    try:
        url = ready_url(until_ready(proc)[-1])
        with httpx.Client(base_url=url, timeout=30) as http:
            for base in range(10, 440, 70):
                r = http.post("/v1/completions", json={"prompt": list(range(base, base + 70)), "max_tokens": 2})
                assert r.status_code == 200, r.text
            served = http.get("/v1/kvload/kv_events").json()["events"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        log = proc.stderr.read()
        assert "Traceback" not in log and "Exception in ASGI" not in log, log
        (warning,) = [x for x in log.splitlines() if "kv_events_file_failed" in x]
        assert "--kv-events-file" in warning and str(events) in warning and "File too large" in warning
        text = events.read_text()
        assert len(text.encode()) <= limit and (text == "" or text.endswith("\n"))
        written = [json.loads(x) for x in text.splitlines()]
        assert written == served[:len(written)] and len(served) > len(written)
    finally:
        reap(proc)


def test_an_audit_log_that_cannot_be_written_is_said_while_the_server_runs_and_fails_no_request(tmp_path):
    """A real server whose --audit-log cannot grow (RLIMIT_FSIZE, as a full disk): one audit_log_failed warning names
    the flag, the path and the error as soon as a write fails, while requests go on (it was said only at the stop,
    days later for a server); the stop then exits 1 in one line and leaves no file, temporary or published."""
    import resource

    import openai

    out = tmp_path / "audit"
    out.mkdir()
    log = out / "serve.jsonl"
    limit = 48_000  # the load's records fit; some requests' later do not

    def small_files() -> None:  # in the child only; Python ignores SIGXFSZ, so the write fails with EFBIG
        signals_as_a_terminal_gives_them()
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.Popen([sys.executable, "-m", "kvload", "serve", "tiny-llama", "--port", "0", "--max_tokens",
                             "1024", "--audit-log", str(log)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=small_files,
                            env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, cwd=REPO)
    lines: list[str] = []
    try:
        lines += until_ready(proc)
        url = ready_url(lines[-1])
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
        reader.start()
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        warned = []
        for _ in range(200):
            r = client.completions.create(model="tiny-llama", prompt=[5, 17, 30, 8], max_tokens=4)
            assert r.choices[0].finish_reason == "length"
            warned = [x for x in lines if "audit_log_failed" in x]
            if warned:
                break
        assert proc.poll() is None and len(warned) == 1, lines
        assert "--audit-log" in warned[0] and str(log) in warned[0] and "File too large" in warned[0]
        r = client.completions.create(model="tiny-llama", prompt=[5, 17, 30, 8], max_tokens=4)  # still served
        assert r.choices[0].finish_reason == "length"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 1
        reader.join(timeout=10)
        text = "".join(lines)
        assert "Traceback" not in text and text.count("audit_log_failed") == 1, text
        assert lines[-1] == f"error: --audit-log {log}: cannot write it (File too large); nothing was written\n"
        assert list(out.iterdir()) == []
    finally:
        reap(proc)


def test_a_taken_port_or_a_bad_one_exits_2_with_one_line(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = run_cli(capsys, "serve", "tiny-llama", "--port", port, "--max_tokens", "1024")
    assert r.code == 2 and r.one_error_line, r.err
    assert f"--port {port}: cannot listen" in r.err
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "70000")
    assert r.code == 2 and "--port" in r.err and "65535" in r.err


def test_kv_events_file_needs_events_on(capsys, tmp_path):
    r = run_cli(capsys, "serve", "tiny-llama", "--kv-events-file", tmp_path / "ev.jsonl")
    assert r.code == 2 and r.one_error_line and "--event_buffer_max_size" in r.err, r.err
    r = run_cli(capsys, "serve", "tiny-llama", "--kv-events-file", tmp_path / "no" / "ev.jsonl",
                "--event_buffer_max_size", "10")
    assert r.code == 2 and r.one_error_line and "does not exist" in r.err, r.err


def test_kv_events_file_takes_the_buffer_size_from_the_config_file(capsys, tmp_path):
    # a TensorRT-LLM options file that turns events on is enough: the check reads it, not only the flags
    cfg = tmp_path / "ev.yaml"
    cfg.write_text("kv_cache_config:\n  event_buffer_max_size: 100\n")
    with socket.socket() as taken:  # the check passed when the next one (the port) is what fails
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = run_cli(capsys, "serve", "tiny-llama", "--config", cfg, "--kv-events-file", tmp_path / "ev.jsonl",
                    "--port", port)
    assert r.code == 2 and r.one_error_line and "cannot listen" in r.err, r.err
    cfg.write_text("kv_cache_config:\n  event_buffer_max_size: 0\n")
    r = run_cli(capsys, "serve", "tiny-llama", "--config", cfg, "--kv-events-file", tmp_path / "ev.jsonl")
    assert r.code == 2 and r.one_error_line and "KV cache events are off" in r.err, r.err


@pytest.mark.parametrize("name", ["", "   "])
def test_an_empty_served_model_name_is_refused_not_replaced_by_the_model(capsys, name):
    """It fell back to MODEL's name without a word: a setting accepted that did nothing."""
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", "--served-model-name", name)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith("error: --served-model-name: expected a non-empty name"), r.err


@pytest.mark.parametrize("value", ["0", "-5", "lots", "1.5", "99999999999999999999999"])
def test_a_bad_max_request_bytes_exits_2_with_one_line_naming_it(capsys, value):
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", "--max-request-bytes", value)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith("error: --max-request-bytes: expected a byte count"), r.err


def test_max_request_bytes_takes_a_byte_count_or_a_size():
    from kvload.cli.commands import build_parser

    parse = build_parser().parse_args
    assert parse(["serve", "tiny-llama", "--max-request-bytes", "4096"]).max_request_bytes == 4096
    assert parse(["serve", "tiny-llama", "--max_request_bytes", "64MiB"]).max_request_bytes == 64 * 2**20
    assert parse(["serve", "tiny-llama"]).max_request_bytes is None  # derived from max_seq_len by build_state


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e400", "86401", "soon"])
def test_a_bad_request_read_timeout_exits_2_with_one_line_naming_it(capsys, value):
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", "--request-read-timeout", value)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith("error: --request-read-timeout: expected "), r.err


def test_request_read_timeout_takes_seconds():
    from kvload.cli.commands import build_parser

    parse = build_parser().parse_args
    assert parse(["serve", "tiny-llama"]).request_read_timeout == 30.0
    assert parse(["serve", "tiny-llama", "--request_read_timeout", "2.5"]).request_read_timeout == 2.5


@pytest.mark.parametrize("value", ["0", "-3", "1.5", "many"])
def test_a_bad_max_concurrent_requests_exits_2_with_one_line_naming_it(capsys, value):
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", "--max-concurrent-requests", value)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith("error: --max-concurrent-requests: expected an integer"), r.err


def test_max_concurrent_requests_defaults_to_256():
    from kvload.cli.commands import build_parser

    parse = build_parser().parse_args
    assert parse(["serve", "tiny-llama"]).max_concurrent_requests == 256
    assert parse(["serve", "tiny-llama", "--max_concurrent_requests", "1"]).max_concurrent_requests == 1


def test_a_requests_chat_template_is_trusted_only_with_the_flag(monkeypatch):
    """--trust-request-chat-template reaches the served state; without it, requests' templates are refused."""
    from kvload.cli.commands import build_parser

    assert build_parser().parse_args(["serve", "tiny-llama"]).trust_request_chat_template is False
    assert served_with(monkeypatch, "--trust-request-chat-template")["trust_request_chat_template"] is True


@pytest.mark.parametrize(("value", "message"), [
    ("{% for m in messages %}", "error: --chat-template: not a Jinja template: line 1: Unexpected end of template"),
    ("/no/such/template.jinja", "error: --chat-template: '/no/such/template.jinja' is neither a file nor a Jinja "
                                "template"),
    ("{{ messages[0]['content'] }}", "error: --chat-template: tiny-llama has no tokenizer"),
])
def test_a_bad_chat_template_exits_2_with_one_line_naming_the_flag(capsys, value, message):
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", "--chat-template", value)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith(message), r.err


def test_a_chat_template_link_to_nothing_is_named_as_one(tmp_path):
    """``--chat-template t.jinja`` where t.jinja is a link whose target is gone read "is neither a file nor a Jinja
    template": the file is right there; the line names what is wrong with it."""
    from kvload.serve.server import chat_template_text
    from pipeline.errors import ConfigError

    link = tmp_path / "t.jinja"
    link.symlink_to(tmp_path / "gone.jinja")
    with pytest.raises(ConfigError, match=rf"^--chat-template '{link}': is a symbolic link to nothing; give a "
                                          r"template file$"):
        chat_template_text(str(link))


def test_a_fifo_or_device_as_chat_template_is_refused_before_it_is_opened(tmp_path):
    """``--chat-template FIFO`` blocked the start for ever (opening a FIFO waits for a writer: the helper's 180 s
    timeout), and a device was read as a file (``/dev/zero``, size 0, without end). Both are refused, one line."""
    fifo = tmp_path / "t.fifo"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/null"):
        r = kvload("serve", "tiny-llama", "--port", "0", "--chat-template", path)
        assert r.code == 2 and r.one_error_line, r.err[-2000:]
        assert r.err == f"error: --chat-template '{path}': not a regular file (a FIFO or device?); give a template " \
                        "file\n"


_SWAP_TEMPLATE_FOR_A_FIFO = """
import os, sys
from kvload.serve.server import chat_template_text
target, real_stat = sys.argv[1], os.stat
def stat_then_swap(path, *args, **kwargs):  # once the path was looked at, a FIFO takes the file's place
    st = real_stat(path, *args, **kwargs)
    if os.fspath(path) == target and not os.path.exists(target + ".swapped"):
        os.unlink(target)
        os.mkfifo(target)
        open(target + ".swapped", "w").close()
    return st
os.stat = stat_then_swap
try:
    print(repr(chat_template_text(target)))
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
"""


def test_a_chat_template_file_swapped_for_a_fifo_after_its_check_does_not_hang_the_start(tmp_path):
    """``--chat-template FILE`` was checked by path (a regular file?) and opened by path again: a FIFO swapped in
    between blocked the open for ever. Now it is opened first, without waiting, and that descriptor is checked and
    read: the start reads the template it opened, or refuses the FIFO in one line."""
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    try:
        r = subprocess.run([sys.executable, "-c", _SWAP_TEMPLATE_FOR_A_FIFO, str(template)], capture_output=True,
                           text=True, env={**ENV, "PYTHONPATH": str(REPO)}, timeout=60)
    except subprocess.TimeoutExpired:  # subprocess.run killed it
        pytest.fail("--chat-template hung opening a FIFO swapped in for the template file")
    assert r.stdout in ("\"{{ messages[0]['content'] }}\"\n",
                        f"ConfigError: --chat-template '{template}': not a regular file (a FIFO or device?); give a "
                        "template file\n"), (r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}",
    "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}",
])
def test_a_chat_template_transformers_renders_is_accepted(template):
    """Jinja's loop controls and transformers' {% generation %} tag (templates that mark the assistant's tokens use
    it) are part of what apply_chat_template compiles; --chat-template refused them as "not a Jinja template"."""
    from kvload.serve.server import check_chat_template

    assert check_chat_template("--chat-template", template) == template


def test_a_chat_template_file_is_read_and_checked(tmp_path):
    from kvload.serve.server import chat_template_text
    from pipeline.errors import ConfigError

    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    assert chat_template_text(str(good)) == good.read_text(encoding="utf-8")
    bad = tmp_path / "b.jinja"
    bad.write_bytes(b"{{ \xff }}")
    with pytest.raises(ConfigError, match=r"^--chat-template '.*b\.jinja': not UTF-8 text$"):
        chat_template_text(str(bad))


#: Fault injection for a real server: once the file $KVLOAD_TEST_FAULT names exists, the engine loop's own code (its
#: step collection, outside the step that is guarded) raises, which ends the loop thread, as a bug there would. Each
#: step takes 10 ms more meanwhile, so a long request is still running when the test makes the file.
FAULT_HOOK = """import importlib.abc, importlib.machinery, os, sys, time
class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "engine.serving":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module
        def exec_module(module):
            load(module)
            real = module.ServingEngine._collect
            def _collect(self, st):
                if os.path.exists(os.environ["KVLOAD_TEST_FAULT"]):
                    raise RuntimeError("injected: the loop's own code failed")
                time.sleep(0.01)
                return real(self, st)
            module.ServingEngine._collect = _collect
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, Hook())
"""


def test_a_dead_engine_loop_ends_the_server_with_exit_1_after_answering_its_requests(tmp_path):
    """The engine loop dying (a bug in its own code) left the process up for ever, /health 503, every request a 500:
    a supervisor (systemd, Kubernetes) that restarts a process that exits never restarted it, and the thread's
    traceback was the only word of it. vLLM shuts its server down when its engine dies. Now the requests in flight
    get their answers (a 500 naming the failure; a stream its error chunk, then [DONE]), one engine_loop_failed
    record names it, and the process exits 1 with one error line (no traceback)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FAULT_HOOK)
    fault = tmp_path / "fault"
    proc = subprocess.Popen([sys.executable, "-m", "kvload", "serve", "tiny-llama", "--port", "0", "--max_tokens",
                             "8192", "--audit-log", str(tmp_path / "audit.jsonl")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=signals_as_a_terminal_gives_them, cwd=REPO,
                            env={**ENV, "PYTHONPATH": f"{hook}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1",
                                 "KVLOAD_TEST_FAULT": str(fault)})
    try:
        url = ready_url(_ready_line(proc))
        lines, answers, first = [], [], threading.Event()
        long = {"prompt": [9, 8, 7], "max_tokens": 3000, "ignore_eos": True}

        def stream():
            with httpx.stream("POST", f"{url}/v1/completions", json={**long, "stream": True}, timeout=60) as r:
                for chunk in r.iter_lines():
                    if chunk:
                        lines.append(chunk)
                        first.set()

        def plain():
            answers.append(httpx.post(f"{url}/v1/completions", json=long, timeout=60))

        readers = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for reader in readers:
            reader.start()
        assert first.wait(60)
        with httpx.Client(base_url=url, timeout=60) as http:  # both requests in the running batch
            deadline = time.monotonic() + 60
            while "kvload_num_requests_running{model_name=\"tiny-llama\"} 2.0" not in http.get("/metrics").text:
                assert time.monotonic() < deadline and not answers, answers
                time.sleep(0.05)
        fault.touch()
        assert proc.wait(timeout=60) == 1
        for reader in readers:
            reader.join(30)
        err = proc.stderr.read()
    finally:
        reap(proc)
    (answer,) = answers
    assert answer.status_code == 500 and answer.json()["error"]["message"] == (
        "RuntimeError: injected: the loop's own code failed"), answer.text
    assert lines[-1] == "data: [DONE]" and "injected: the loop's own code failed" in lines[-2], lines[-3:]
    assert "Traceback" not in err and "Exception in thread" not in err, err[-3000:]
    (record,) = [x for x in err.splitlines() if "engine_loop_failed" in x]
    assert "RuntimeError" in record and "injected: the loop's own code failed" in record, record
    assert err.splitlines()[-1] == (
        "error: serve: the engine loop failed (RuntimeError: injected: the loop's own code failed); the server "
        "stopped, its requests in flight answered HTTP 500; restart it"), err[-3000:]
    assert not (tmp_path / "audit.jsonl").exists()  # a failed run publishes no audit, as every command's


#: A sitecustomize for the server's process: its first answer's collection raises, as a bug in a handler would.
HANDLER_FAULT_HOOK = """import importlib.abc, importlib.machinery, sys
class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "kvload.serve.request_run":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module
        def exec_module(module):
            load(module)
            real, calls = module._Run.collect, []
            async def collect(self):
                calls.append(None)
                if len(calls) == 1:
                    raise RuntimeError("injected: a bug in the handler")
                return await real(self)
            module._Run.collect = collect
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, Hook())
"""


def test_a_handler_bug_is_one_request_failed_record_with_its_traceback_and_the_connection_serves_on(tmp_path):
    """A bug in a handler was logged by uvicorn ("Exception in ASGI application", a traceback outside kvload's log
    format) and the client's connection closed. Now the operator's log has one ``request_failed`` line (error) with
    the traceback under it, the client a 500, and its next request on the same connection is answered."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HANDLER_FAULT_HOOK)
    proc = subprocess.Popen([sys.executable, "-m", "kvload", "serve", "tiny-llama", "--port", "0", "--max_tokens",
                             "1024"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=signals_as_a_terminal_gives_them, cwd=REPO,
                            env={**ENV, "PYTHONPATH": f"{hook}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"})
    try:
        url = ready_url(_ready_line(proc))
        ports = set()
        with httpx.Client(base_url=url, timeout=60) as http:
            body = {"prompt": [1, 2, 3], "max_tokens": 2}
            for expected in (500, 200):
                r = http.post("/v1/completions", json=body, extensions={"trace": lambda name, info: ports.add(
                    info["return_value"].get_extra_info("socket").getsockname()[1])
                    if name == "connection.connect_tcp.complete" else None})
                assert r.status_code == expected, r.text
        assert len(ports) == 1  # one connection: the 500 left it open
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()
    finally:
        reap(proc)
    assert r.json()["usage"]["completion_tokens"] == 2
    (record,) = [line for line in err.splitlines() if "request_failed" in line]
    assert "[error" in record and "path=/v1/completions" in record and "error=RuntimeError" in record, record
    assert err.count("Traceback (most recent call last):") == 1 and "Exception in ASGI application" not in err, err
    after = err.splitlines()[err.splitlines().index(record) + 1:]
    assert after[0] == "Traceback (most recent call last):" and "RuntimeError: injected: a bug in the handler" in after


@pytest.mark.parametrize(("flags", "message"), [
    (["--enable-auto-tool-choice", "--tool-call-parser", "mistral"],
     "error: --tool-call-parser: no tool-call parser 'mistral' in kvload; it has: hermes, llama3_json, pythonic, "
     "llama4_pythonic"),
    (["--tool-call-parser", "hermes"], "error: --tool-call-parser hermes requires --enable-auto-tool-choice"),
    (["--enable-auto-tool-choice"],
     "error: --enable-auto-tool-choice requires --tool-call-parser (kvload has: hermes, llama3_json, pythonic, "
     "llama4_pythonic)"),
])
def test_a_tool_call_parser_flag_alone_or_unknown_exits_2_with_one_line(capsys, flags, message):
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", *flags)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith(message), r.err


@pytest.mark.parametrize(("flags", "parser"), [
    (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], "hermes"),
    (["--tool_call_parser", "hermes", "--enable_auto_tool_choice"], "hermes"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"], "llama3_json"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"], "pythonic"),
])
def test_the_tool_call_parser_reaches_the_served_state(monkeypatch, flags, parser):
    """vLLM's flags (and kvload's underscore spellings) give build_state the parser; without them, none."""
    assert served_with(monkeypatch, *flags)["tool_call_parser"] == parser
    assert served_with(monkeypatch)["tool_call_parser"] is None


def test_an_unknown_reasoning_parser_exits_2_with_one_line_naming_the_accepted(capsys):
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", "--reasoning-parser", "deepseek_v3")
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith("error: --reasoning-parser: no reasoning parser 'deepseek_v3' in kvload; it has: "
                            "deepseek_r1, qwen3"), r.err


def test_the_reasoning_parser_reaches_the_served_state_and_the_ready_line_names_the_parsers(monkeypatch, capsys):
    """vLLM's flag (and kvload's underscore spelling) gives build_state the parser; the ready line says how chat
    replies are read (none: as before)."""
    from kvload.cli.commands import build_parser
    from kvload.serve import command, server

    parse = build_parser().parse_args
    seen = {}
    real = server.build_state

    def build_state(result, **kwargs):
        seen.update(kwargs)
        return real(result, **kwargs)

    def ready_line(*flags: str) -> str:
        base = ["serve", "tiny-llama", "--port", "0", "--max_tokens", "1024"]
        assert command.cmd_serve(parse([*base, *flags])) == 0
        (line,) = [x for x in capsys.readouterr().err.splitlines() if " at http://127.0.0.1:9 " in x]
        return line

    monkeypatch.setattr(server, "build_state", build_state)
    monkeypatch.setattr(server, "serve", lambda state, host, port, log_level, ready, **_: ready("http://127.0.0.1:9"))
    line = ready_line("--reasoning_parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert seen["reasoning_parser"] == "qwen3"
    assert line.endswith(" KV tokens); tool-call parser hermes; reasoning parser qwen3; Ctrl-C stops"), line
    line = ready_line("--reasoning-parser", "deepseek_r1")
    assert seen["reasoning_parser"] == "deepseek_r1"
    assert line.endswith(" KV tokens); reasoning parser deepseek_r1; Ctrl-C stops"), line
    line = ready_line()
    assert seen["reasoning_parser"] is None and line.endswith(" KV tokens); Ctrl-C stops"), line
    # a served name holding an escape sequence was printed raw: the terminal turned red (or worse)
    line = ready_line("--served-model-name", "\x1b[31mred\n")
    assert line.startswith("kvload serve: \\x1b[31mred\\n at http://127.0.0.1:9 ("), line


def test_a_config_files_reasoning_parser_serves_as_the_flag_does_and_the_flag_beats_it(monkeypatch, capsys, tmp_path):
    """``kvload serve --config f.yaml`` with ``reasoning_parser:`` in it reported it ignored ("a plan or load runs no
    requests") and served every chat reply whole; now it reaches build_state as the flag does (the ready line and the
    audit name it), the flag beating it with one source_conflict."""
    from kvload.cli.commands import build_parser
    from kvload.serve import command, server

    config = tmp_path / "serve.yaml"
    config.write_text("reasoning_parser: qwen3\n")
    seen, states = {}, []
    real = server.build_state

    def build_state(result, **kwargs):
        seen.update(kwargs)
        states.append(real(result, **kwargs))
        return states[-1]

    def serve(*flags: str) -> tuple[str, str]:
        base = ["serve", "tiny-llama", "--port", "0", "--max_tokens", "1024", "--config", str(config)]
        assert command.cmd_serve(build_parser().parse_args([*base, *flags])) == 0
        err = capsys.readouterr().err
        (line,) = [x for x in err.splitlines() if " at http://127.0.0.1:9 " in x]
        return line, err

    monkeypatch.setattr(server, "build_state", build_state)
    monkeypatch.setattr(server, "serve", lambda state, host, port, log_level, ready, **_: ready("http://127.0.0.1:9"))
    line, err = serve()
    assert seen["reasoning_parser"] == "qwen3" and line.endswith(" KV tokens); reasoning parser qwen3; Ctrl-C stops")
    assert "setting_ignored" not in err and "source_conflict" not in err, err
    assert [r["parser"] for r in states[-1].result.audit.of("reasoning_parser_enabled")] == ["qwen3"]
    line, err = serve("--reasoning-parser", "deepseek_r1")
    assert seen["reasoning_parser"] == "deepseek_r1" and line.endswith(" reasoning parser deepseek_r1; Ctrl-C stops")
    (conflict,) = states[-1].result.audit.of("source_conflict")
    assert (conflict["field"], conflict["kept"], conflict["kept_source"], conflict["overridden"],
            conflict["overridden_source"]) == ("reasoning_parser", "deepseek_r1", "cli", "qwen3", "config_file")
    assert not states[-1].result.audit.of("setting_ignored")


def _self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, made by the openssl CLI (the test is skipped without it)."""
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate with")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return str(cert), str(key)


def test_ssl_flags_serve_https_that_a_client_verifying_the_certificate_talks_to(tmp_path):
    """vLLM's --ssl-certfile / --ssl-keyfile were unrecognized arguments (exit 2): the server now answers HTTPS, the
    ready line says https://, and a client checking the certificate generates through it."""
    import ssl

    cert, key = _self_signed(tmp_path)
    proc = _start_server("--ssl-certfile", cert, "--ssl-keyfile", key, "--max_tokens", "256")
    try:
        url = ready_url(_ready_line(proc))
        assert url.startswith("https://127.0.0.1:"), url
        trust = ssl.create_default_context(cafile=cert)
        with httpx.Client(verify=trust, timeout=30) as client:
            assert client.get(f"{url}/health").json() == {"status": "ok"}
            done = client.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}).json()
            assert len(done["choices"][0]["token_ids"]) == 2, done
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on that port
            httpx.get(url.replace("https://", "http://") + "/health", timeout=30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        reap(proc)


@pytest.mark.parametrize("case", ["key_alone", "missing_cert", "cert_not_pem", "key_not_pem", "ca_without_cert",
                                  "required_without_ca", "bad_reqs"])
def test_a_bad_ssl_flag_exits_2_with_one_line_naming_it_before_the_model_loads(capsys, tmp_path, case):
    cert, key = _self_signed(tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("not a certificate\n")
    flags, _ = {
        "key_alone": (["--ssl-keyfile", key], "--ssl-keyfile"),
        "missing_cert": (["--ssl-certfile", str(tmp_path / "none.pem"), "--ssl-keyfile", key], "--ssl-certfile"),
        "cert_not_pem": (["--ssl-certfile", str(text), "--ssl-keyfile", key], "--ssl-certfile"),
        "key_not_pem": (["--ssl-certfile", cert, "--ssl-keyfile", str(text)], "--ssl-keyfile"),
        "ca_without_cert": (["--ssl-ca-certs", cert], "--ssl-ca-certs"),
        "required_without_ca": (["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-cert-reqs", "2"],
                                "--ssl-cert-reqs"),
        "bad_reqs": (["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-cert-reqs", "3"], "--ssl-cert-reqs"),
    }[case]
    said = {"key_alone": "needs --ssl-certfile", "missing_cert": "no such file", "cert_not_pem": "no PEM certificate",
            "key_not_pem": "not an unencrypted PEM private key", "ca_without_cert": "needs --ssl-certfile",
            "required_without_ca": "needs --ssl-ca-certs", "bad_reqs": "expected 0"}[case]
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", *flags)
    assert r.code == 2 and r.one_error_line and said in r.err and "unrecognized" not in r.err, r.err
    assert "Traceback" not in r.err


def test_ssl_cert_reqs_2_with_a_ca_serves_only_clients_presenting_a_certificate_it_signed(tmp_path):
    """--ssl-ca-certs and --ssl-cert-reqs reach uvicorn: with 2 (required) a client without a certificate is refused
    in the handshake, one with a certificate the CA signed (here the self-signed one, its own CA) is served."""
    import ssl

    cert, key = _self_signed(tmp_path)
    proc = _start_server("--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca-certs", cert, "--ssl-cert-reqs", "2",
                         "--max_tokens", "256")
    try:
        url = ready_url(_ready_line(proc))
        anonymous = ssl.create_default_context(cafile=cert)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", verify=anonymous, timeout=30)
        known = ssl.create_default_context(cafile=cert)
        known.load_cert_chain(cert, key)
        assert httpx.get(f"{url}/health", verify=known, timeout=30).json() == {"status": "ok"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        reap(proc)


def test_server_thread_serves_https_with_the_ssl_flags_of_kvload_serve(tmp_path):
    """The in-process server (Python API, tests) takes kvload serve's --ssl-* as keywords, checked by the same code:
    its url is https://, a client verifying the certificate generates through it; a bad file is the same one-line
    ConfigError before any port is bound."""
    import ssl

    import pipeline
    from kvload.serve.server import ServerThread, build_state
    from pipeline.errors import ConfigError

    cert, key = _self_signed(tmp_path)
    result = pipeline.load("tiny-llama", load_weights=True, log=False, kv_cache_config={"max_tokens": 256})
    try:
        state = build_state(result)
        with pytest.raises(ConfigError, match=r"^--ssl-keyfile .*: not an unencrypted PEM private key"):
            ServerThread(state, ssl_certfile=cert, ssl_keyfile=cert)
        with ServerThread(state, ssl_certfile=cert, ssl_keyfile=key) as server:
            assert server.url.startswith("https://127.0.0.1:"), server.url
            trust = ssl.create_default_context(cafile=cert)
            with httpx.Client(base_url=server.url, verify=trust, timeout=60) as client:
                done = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}).json()
                assert len(done["choices"][0]["token_ids"]) == 2, done
            with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on that port
                httpx.get(server.url.replace("https://", "http://") + "/health", timeout=30)
    finally:
        result.close()


@pytest.mark.parametrize("var", ["RANK", "WORLD_SIZE", "LOCAL_RANK"])
def test_a_torchrun_variable_that_is_not_a_number_is_refused_before_the_server_is_imported(var):
    """``RANK=junk kvload serve MODEL`` was refused only after the server's modules (FastAPI, uvicorn, torch through
    the engine: ~6 s) were imported; the variables are read first now, as ``generate`` reads them (under a second)."""
    loaded = imports_after(f"""
        import contextlib, io, os
        os.environ["{var}"] = "junk"
        from kvload.cli.entry import main
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["serve", "tiny-llama", "--port", "0", "--max_tokens", "1024"])
        assert code == 2, code
        said = err.getvalue()
        assert said == "error: environment {var}='junk': expected an integer (torchrun sets it)\\n", said
    """)
    assert loaded == {"torch": False, "transformers": False}
