"""``kvload serve --api-key``: vLLM's bearer-key check, against the openai client and raw HTTP, in-process and as a
real process reading the key from its environment; the key never shows in the audit, the log or an answer."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.cli_support import ENV, REPO, reap, run_cli
from tests.hostile_support import signals_as_a_terminal_gives_them
from tests.serve_support import TIMEOUT, answers_while_held, serving

KEY = "sk-kvload-test-3f9a2c"
OTHER = "second-key_ok"  # several keys may be accepted (vLLM's --api-key takes a list)


@pytest.fixture(scope="module")
def served():
    with serving(state={"api_keys": [KEY, OTHER]}) as s:
        yield s


def _client(served, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=key, timeout=TIMEOUT, max_retries=0)


def _complete(client: openai.OpenAI, served) -> list[int]:
    reply = client.completions.create(model=served.state.model_name, prompt=[5, 6, 7], max_tokens=3,
                                      extra_body={"ignore_eos": True})
    return reply.choices[0].token_ids


def test_the_openai_client_with_a_key_is_served_and_without_one_raises_authentication_error(served):
    for key in (KEY, OTHER):
        with _client(served, key) as client:
            assert len(_complete(client, served)) == 3
            assert [m.id for m in client.models.list()] == [served.state.model_name]
    for key in ("wrong", KEY + "x", KEY[:-1]):
        with _client(served, key) as client, pytest.raises(openai.AuthenticationError) as caught:
            _complete(client, served)
        error = caught.value
        assert error.status_code == 401 and error.code == "invalid_api_key"
        assert error.body["type"] == "invalid_request_error" and error.body["param"] is None
        assert error.response.headers["WWW-Authenticate"] == "Bearer"
        assert key not in error.message  # never quoted back (it may be someone's real key)
    # no Authorization header at all (the openai client always sends one): the same error, saying what to send
    r = served.http.post("/v1/completions", json={"prompt": [5], "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert "Authorization: Bearer KEY" in r.json()["error"]["message"]


def test_refusals_are_counted_as_unauthorized(served):
    name = "kvload_http_requests_refused_total{reason=unauthorized}"
    before = served.metrics()[name]
    assert served.http.get("/v1/models").status_code == 401
    assert served.http.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert served.metrics()[name] == before + 2


def test_probes_stay_open_and_every_other_path_needs_the_key(served):
    http = served.http
    # what vLLM leaves open: liveness probes, Prometheus, version checks send no key
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/ping").json() == http.post("/ping").json() == {"status": "ok"}  # SageMaker's probe, as vLLM's
    assert "kvload_generation_tokens_total" in http.get("/metrics").text
    assert "version" in http.get("/version").json()
    assert http.get("/load").json() == {"server_load": 0}  # vLLM's, a load-aware router's poll
    # OPTIONS passes as in vLLM (a CORS preflight carries no credentials): kvload's 405, not a 401
    assert http.options("/v1/completions").status_code == 405
    closed = [("GET", "/v1/models"), ("GET", f"/v1/models/{served.state.model_name}"),
              ("GET", "/v1/kvload/audit"), ("HEAD", "/v1/kvload/audit"),
              ("GET", "/v1/kvload/explain?field=max_batch_size"), ("GET", "/v1/kvload/kv_events"),
              ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
              # open in vLLM; here they share the admission slots and the parse gate with completions
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/responses"), ("POST", "/invocations"),
              ("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1"),
              ("GET", "/v1/responses/resp_1/input_items"),
              ("GET", "/nowhere")]  # not the 404 that lists every endpoint
    for method, path in closed:
        r = http.request(method, path, json={"tokens": [1]} if method == "POST" else None)
        assert r.status_code == 401, (method, path, r.status_code)
    auth = {"Authorization": f"Bearer {KEY}"}
    assert http.get("/v1/kvload/explain?field=max_batch_size", headers=auth).status_code == 200
    assert http.post("/detokenize", json={"tokens": [1]}, headers=auth).status_code == 400  # no tokenizer: not 401
    assert http.get("/nowhere", headers=auth).status_code == 404
    # the kept responses' routes answer with the key (none kept: 404 naming the response)
    for method in ("GET", "DELETE"):
        r = http.request(method, "/v1/responses/resp_1", headers=auth)
        assert (r.status_code, r.json()["error"]["code"]) == (404, "response_not_found")


@pytest.mark.parametrize(("value", "accepted"), [
    (f"Bearer {KEY}", True),
    (f"bearer {KEY}", True),  # the scheme is case-insensitive (RFC 7235, vLLM)
    (f"BEARER {OTHER}", True),
    (f"Bearer   {KEY}", True),  # 1*SP between scheme and key (RFC 7235); vLLM takes exactly one
    (f"  Bearer {KEY}  ", True),  # leading/trailing whitespace is not part of a header's value
    (KEY, False),  # no scheme
    (f"Basic {KEY}", False),
    (f"Token {KEY}", False),
    ("Bearer", False),
    ("Bearer ", False),
    (f"Bearer\t{KEY}", False),  # the separator is a space
    (f"Bearer {KEY} {KEY}", False),
    (f"Bearer {KEY.upper()}", False),  # the key is case-sensitive
    (f"Bearer{KEY}", False),
])
def test_bearer_header_parsing(served, value, accepted):
    # raw bytes on a socket: httpx refuses to send some of these (surrounding whitespace), a client may not
    head = f"GET /v1/models HTTP/1.1\r\nHost: test\r\nAuthorization: {value}\r\nConnection: close\r\n\r\n"
    with socket.create_connection((served.server.host, served.server.port), timeout=TIMEOUT) as sock:
        sock.sendall(head.encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 " if accepted else b"HTTP/1.1 401 "), answer[:300]


def test_two_authorization_headers_are_refused_even_if_one_is_right(served):
    # which of the two a proxy in front checked is unknown; the server takes neither
    r = served.http.get("/v1/models", headers=[("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer x")])
    assert r.status_code == 401
    r = served.http.get("/v1/models", headers=[("Authorization", f"Bearer {KEY}"), ("Authorization", f"Bearer {KEY}")])
    assert r.status_code == 401


def test_a_request_without_the_key_takes_no_slot_and_learns_nothing_of_the_load(served):
    """Checked before admission: with the one slot taken by a key holder, a client without the key still gets 401,
    never the 503 that says the server is busy, and a key holder gets the 503."""
    state = served.state
    limit, state.max_concurrent_requests = state.max_concurrent_requests, 1
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": [5, 6], "max_tokens": 1}

    def check(http: httpx.Client) -> None:
        assert http.post("/v1/completions", json=body).status_code == 401
        assert http.post("/v1/completions", json=body, headers={"Authorization": "Bearer no"}).status_code == 401
        assert http.post("/v1/completions", json=body, headers=auth).status_code == 503

    try:
        r = answers_while_held(served, state.engine, "check",
                               lambda http: http.post("/v1/completions", json=body, headers=auth), check)
    finally:
        state.max_concurrent_requests = limit
    assert r.status_code == 200, r.text


def test_the_audit_says_a_key_is_required_and_where_it_came_from_never_the_key(served):
    (record,) = served.result.audit.of("api_key_required")
    assert record["source"] == "api_keys" and record["keys"] == 2
    assert record["open_paths"] == ["/health", "/load", "/metrics", "/ping", "/version"]
    served_audit = served.http.get("/v1/kvload/audit", headers={"Authorization": f"Bearer {OTHER}"}).text
    assert '"api_key_required"' in served_audit
    for text in (served_audit, repr(served.state), json.dumps(served.result.audit.events, default=str)):
        assert KEY not in text and OTHER not in text


def test_build_state_refuses_a_key_that_cannot_be_sent_without_quoting_it():
    import pipeline
    from kvload.serve.server import build_state
    from pipeline.errors import ConfigError

    result = pipeline.load("tiny-llama", load_weights=True, log=False, kv_cache_config={"max_tokens": 256})
    try:
        for keys, says in [([""], "empty"), (["sec ret"], "a space"), (["séc"], "non-ASCII"),
                           (["ok", "x\ny"], "control character"), ("secret", "one string")]:
            with pytest.raises(ConfigError) as caught:
                build_state(result, api_keys=keys)
            message = str(caught.value)
            assert message.startswith("api_keys: ") and says in message, message
            assert "sec" not in message and "x\ny" not in message
        assert not result.audit.of("api_key_required")
    finally:
        result.close()


def test_resolve_api_keys_the_flag_then_kvload_then_vllm():
    from kvload.serve.auth import resolve_api_keys

    assert resolve_api_keys(None, {}) == ((), None, [])
    assert resolve_api_keys(None, {"VLLM_API_KEY": "v"}) == (("v",), "VLLM_API_KEY", [])
    assert resolve_api_keys(None, {"VLLM_API_KEY": "v", "KVLOAD_API_KEY": "k"}) == (
        ("k",), "KVLOAD_API_KEY", ["VLLM_API_KEY"])
    assert resolve_api_keys(["a", "b"], {"VLLM_API_KEY": "", "KVLOAD_API_KEY": "k"}) == (
        ("a", "b"), "--api-key", ["KVLOAD_API_KEY", "VLLM_API_KEY"])  # an empty one that does not act: no error


# --- the command line --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("flags", "env", "named"), [
    (["--api-key", ""], {}, "--api-key: the key is empty"),
    (["--api_key", "ok", "--api-key", "s3cr3t with space"], {}, "--api-key: the key's character 7 of 17 is a space"),
    ([], {"KVLOAD_API_KEY": ""}, "KVLOAD_API_KEY: the key is empty; give a key, or unset it"),
    ([], {"VLLM_API_KEY": ""}, "VLLM_API_KEY: the key is empty"),  # vLLM serves with no key then; kvload refuses
    ([], {"KVLOAD_API_KEY": "s3cr3t\x01"}, "KVLOAD_API_KEY: the key's character 7 of 7 is a control character"),
])
def test_an_empty_or_unsendable_key_exits_2_with_one_line_naming_its_source(capsys, monkeypatch, flags, env, named):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with socket.socket() as taken:  # refused before the port is tried: a server that ignored the key fails here
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        r = run_cli(capsys, "serve", "tiny-llama", "--max_tokens", "256", "--port", taken.getsockname()[1], *flags)
    assert r.code == 2 and r.one_error_line and named in r.err, r.err
    assert "s3cr3t" not in r.err


@pytest.mark.parametrize(("argv", "model", "keys"), [
    (["--api-key", KEY, "tiny-llama"], "tiny-llama", [KEY]),  # how users write it (vLLM: one key, then MODEL)
    (["--api-key", KEY, OTHER, "tiny-llama"], "tiny-llama", [KEY, OTHER]),
    (["--api-key", KEY, "--api-key", OTHER, "tiny-llama"], "tiny-llama", [KEY, OTHER]),
    (["tiny-llama", "--api-key", KEY, OTHER], "tiny-llama", [KEY, OTHER]),  # vLLM's several keys to one flag
    (["--api-key=" + KEY, "tiny-llama"], "tiny-llama", [KEY]),
    # MODEL ended the first use; a later one-key use must not hide it
    (["--api-key", KEY, "tiny-llama", "--api-key", OTHER], "tiny-llama", [KEY, OTHER]),
    (["--api-key", KEY, "tiny-llama", "--api-key=" + OTHER], "tiny-llama", [KEY, OTHER]),
])
def test_model_may_follow_api_key_and_several_keys_stay_possible(argv, model, keys):
    """``kvload serve --api-key K MODEL`` read MODEL as a second key (the flag takes a list, as vLLM's does) and
    exited 2 with "the following arguments are required: MODEL". With no MODEL before it, the flag's last value is
    MODEL; several keys, by repeating the flag or listing them after MODEL, still work."""
    from kvload.cli.commands import build_parser

    ns = build_parser().parse_args(["serve", *argv])
    assert (ns.model, ns.api_key) == (model, keys)


def test_api_key_then_model_serves_with_that_key(capsys):
    """The whole command: the key acts and MODEL loads (stopped at its taken port, refused after both)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = run_cli(capsys, "serve", "--api-key", KEY, "tiny-llama", "--max_tokens", "256", "--port", port)
    assert r.code == 2 and r.one_error_line and r.err.startswith(f"error: --port {port}: cannot listen"), r.err
    assert KEY not in r.err


@pytest.mark.parametrize("argv", [["--api-key", KEY], ["--api-key=" + KEY]])
def test_a_lone_key_is_never_taken_as_model(capsys, argv):
    """One value after --api-key is a key: MODEL missing is the usual error, not a server with no key."""
    r = run_cli(capsys, "serve", *argv)
    assert (r.code, r.err) == (2, "error: the following arguments are required: MODEL\n")


def test_a_forgotten_model_after_two_keys_is_refused_without_quoting_the_second(capsys):
    """``--api-key K1 K2`` with MODEL forgotten takes K2 for MODEL; the model error must not print K2."""
    r = run_cli(capsys, "serve", "--api-key", OTHER, KEY)
    assert r.code == 2 and r.one_error_line, r.err
    assert KEY not in r.err and "the last value after --api-key was taken as MODEL" in r.err, r.err


THIRD, FOURTH = "third-key-9d1e", "fourth-key-7b2a"


@pytest.mark.parametrize("argv", [
    ["--api-key", OTHER, KEY, "--api-key", THIRD, FOURTH],
    ["--api-key", OTHER, "tiny-llama", "--api-key", THIRD, FOURTH],  # MODEL given, but so is a key after it
    ["--api-key", OTHER, KEY, "--api-key=" + THIRD, "--api-key", FOURTH, "tiny-llama"],
])
def test_two_api_key_flags_with_several_values_and_no_model_first_are_refused(capsys, argv):
    """``--api-key A B --api-key C D`` with no MODEL before took D for MODEL (and served B as a key): with
    ``--api-key A tiny-llama --api-key C D`` that is the wrong model and MODEL a key. Either use may end with MODEL,
    so it is one usage error, before anything loads, that quotes no value (the port is taken: a server that took a
    guess stops there)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        r = run_cli(capsys, "serve", *argv, "--max_tokens", "256", "--port", taken.getsockname()[1])
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith("error: no MODEL before --api-key, and 2 --api-key flags took several values"), r.err
    assert "give MODEL first" in r.err
    assert not any(value in r.err for value in (KEY, OTHER, THIRD, FOURTH, "tiny-llama")), r.err


@pytest.mark.parametrize(("argv", "shown"), [
    (["serve", "tiny-llama", "--api-keyy", KEY], "--api-keyy (value hidden); did you mean --api-key?"),
    (["serve", "--api-keyy", KEY, "tiny-llama"], "--api-keyy (value hidden); did you mean --api-key?"),
    (["serve", "tiny-llama", "--api-keyy=" + KEY], "--api-keyy=(value hidden); did you mean --api-key?"),
    (["serve", "tiny-llama", "--api_keyy", "-" + KEY], "--api_keyy (value hidden); did you mean --api_key?"),
    (["serve", "tiny-llama", "--registry-token", KEY, OTHER], "--registry-token (value hidden) (value hidden)"),
    (["serve", "tiny-llama", "--hf-token", KEY, OTHER], "(value hidden)"),  # vLLM's flag, taken: what follows it
    (["generate", "tiny-llama", "--api-key", KEY],
     "--api-key (value hidden); --api-key belongs to another command (see kvload --help)"),
    (["serve", "tiny-llama", "--client-secret", KEY, "--port", "9"], "--client-secret (value hidden)"),
    (["serve", "tiny-llama", "--bearer", KEY], "--bearer (value hidden)"),
    (["serve", "tiny-llama", "--db-pass", KEY], "--db-pass (value hidden)"),
    (["serve", "tiny-llama", "--pwd=" + KEY], "--pwd=(value hidden)"),
    # a typo of a secret flag the words miss: the flag it is closest to (the hint's) takes a secret
    (["serve", "tiny-llama", "--hf-tokenn", KEY], "--hf-tokenn (value hidden); did you mean --hf-token?"),
    (["serve", "tiny-llama", "--hf-tokn=" + KEY], "--hf-tokn=(value hidden); did you mean --hf-token?"),
    # a prefix of a secret flag (and of --api-server-count): the hint names both, and the value is hidden (it was
    # shown, and shown again once --api-server-count made the prefix ambiguous)
    (["serve", "tiny-llama", "--api", KEY], "--api (value hidden); did you mean --api_key or --api_server_count?"),
    (["serve", "tiny-llama", "--api=" + KEY], "--api=(value hidden); did you mean --api_key or --api_server_count?"),
])
def test_a_mistyped_key_flag_never_echoes_its_value(capsys, argv, shown):
    """argparse answered ``--api-keyy SECRET`` with "unrecognized arguments: --api-keyy SECRET": the key, in the
    terminal, the CI log or the journal. An unrecognised option whose name holds key, secret, passw, auth, bearer or
    the word token, pass or pwd has what follows it hidden (up to the next option); still one line, exit 2, with the
    hint."""
    r = run_cli(capsys, *argv)
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err == f"error: unrecognized arguments: {shown}\n"
    assert KEY not in r.err and OTHER not in r.err


def test_other_unrecognised_values_are_still_shown(capsys):
    """Only what may be a secret is hidden: a mistyped --max-tokens keeps its value (the word is "tokens")."""
    r = run_cli(capsys, "serve", "tiny-llama", "--max-tokenz", "100")
    assert r.err == "error: unrecognized arguments: --max-tokenz 100; did you mean --max-tokens?\n"


def _start(*flags: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvload", "serve", "tiny-llama", "--port", "0", "--max_tokens",
                             "1024", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=signals_as_a_terminal_gives_them,
                            env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}, cwd=REPO)


def _ready(proc: subprocess.Popen) -> tuple[str, list[str]]:
    deadline, lines = time.monotonic() + 120, [""]
    while " at http://" not in lines[-1]:
        assert time.monotonic() < deadline and proc.poll() is None, f"server did not start: {lines}"
        lines.append(proc.stderr.readline())
    return lines[-1], lines[1:]


def test_a_real_server_takes_its_key_from_the_environment_and_never_shows_it(tmp_path):
    """KVLOAD_API_KEY wins over vLLM's VLLM_API_KEY (set too: a setting_ignored says so, without the value); the
    ready line names the source; the openai client with the key is served, with the other 401; /health is open;
    neither key appears in the audit file or in an info-level log with uvicorn's access lines."""
    audit_path = tmp_path / "audit.jsonl"
    proc = _start("--audit-log", str(audit_path), "--log-level", "info",
                  env={"KVLOAD_API_KEY": KEY, "VLLM_API_KEY": OTHER})
    try:
        line, before = _ready(proc)
        assert line.rstrip().endswith("; API key required (KVLOAD_API_KEY); Ctrl-C stops"), line
        url = line.split(" at ", 1)[1].split(" ", 1)[0].rstrip(";")
        with openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=60, max_retries=0) as client:
            reply = client.completions.create(model="tiny-llama", prompt=[5, 6, 7], max_tokens=2,
                                              extra_body={"ignore_eos": True})
            assert len(reply.choices[0].token_ids) == 2
        with openai.OpenAI(base_url=url + "/v1", api_key=OTHER, timeout=60, max_retries=0) as client, \
                pytest.raises(openai.AuthenticationError):
            client.models.list()
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.get("/health").json() == {"status": "ok"}
            assert http.get("/v1/kvload/audit").status_code == 401
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        log = "".join(before) + proc.stderr.read() + proc.stdout.read()  # uvicorn's access lines go to stdout
        assert "Traceback" not in log
        assert '"POST /v1/completions HTTP/1.1" 200' in log and '"GET /v1/models HTTP/1.1" 401' in log, log
        (ignored,) = [x for x in log.splitlines() if "setting_ignored" in x]
        assert "VLLM_API_KEY" in ignored and "KVLOAD_API_KEY" in ignored
        audit_text = audit_path.read_text()
        records = [json.loads(x) for x in audit_text.splitlines()]
        (required,) = [r for r in records if r["event"] == "api_key_required"]
        assert required["source"] == "KVLOAD_API_KEY" and required["keys"] == 1
        for text in (log, audit_text):
            assert KEY not in text and OTHER not in text
    finally:
        reap(proc)


def test_a_server_on_all_interfaces_without_a_key_warns_once(tmp_path):
    """vLLM says nothing; kvload warns, before the ready line, that anyone who reaches the port is served."""
    proc = _start("--host", "0.0.0.0", "--audit-log", str(tmp_path / "audit.jsonl"), env={})
    try:
        line, before = _ready(proc)
        proc.send_signal(signal.SIGTERM)  # at once: nothing is served from it
        assert proc.wait(timeout=30) == 0
        (warning,) = [x for x in before if "serve_without_api_key" in x]
        assert "--host 0.0.0.0" in warning and "KVLOAD_API_KEY" in warning, warning
        assert "API key required" not in line
        records = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
        assert [r["address"] for r in records if r["event"] == "serve_without_api_key"] == ["0.0.0.0"]
    finally:
        reap(proc)


def test_api_key_without_the_serve_extra_is_the_one_line_that_names_it(capsys, monkeypatch):
    """``--api-key`` is checked while parsing; that check must not need fastapi, or a missing serve extra is a
    traceback instead of serve's one line naming it."""
    for name in ("fastapi", "fastapi.responses"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails: as without the extra
    monkeypatch.delitem(sys.modules, "kvload.serve.auth", raising=False)  # imported afresh, as by a new process
    r = run_cli(capsys, "serve", "tiny-llama", "--api-key", KEY)
    assert r.code == 2 and r.one_error_line, r.err
    assert "serve: fastapi is not installed; pip install 'kvload[serve]'" in r.err and KEY not in r.err, r.err


def test_root_path_serves_the_proxys_prefix_with_the_same_key_check_open_paths_and_admission():
    """``kvload serve --root-path /proxy`` (vLLM's): behind a proxy that keeps the prefix, ``/proxy/v1/models`` is
    served (``/v1/models`` still is); the prefixed path is judged as its route: the key still needed, /health
    still open, a generation request still taking its admission slot."""
    auth = {"Authorization": f"Bearer {KEY}"}
    with serving(state={"api_keys": [KEY], "root_path": "/proxy"}) as s:
        name = s.state.model_name
        for path in ("/proxy/v1/models", "/v1/models"):
            r = s.http.get(path, headers=auth)
            assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [name], (path, r.text)
        assert s.http.get("/proxy/v1/models").status_code == 401
        assert s.http.get("/proxy/health").status_code == 200
        assert s.http.get("/proxy/nothing", headers=auth).status_code == 404
        s.state.max_concurrent_requests = 1
        body = {"prompt": [5, 6], "max_tokens": 1}

        def check(http: httpx.Client) -> None:
            assert http.post("/proxy/v1/completions", json=body, headers=auth).status_code == 503

        r = answers_while_held(s, s.state.engine, "check",
                               lambda http: http.post("/proxy/v1/completions", json=body, headers=auth), check)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"], r.text
