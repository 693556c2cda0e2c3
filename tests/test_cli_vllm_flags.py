"""A launch line copied from ``vllm serve``: vLLM's engine and server flags kvload has no counterpart for are taken,
each with one ``setting_ignored`` saying why (never a silent no-op, never "unrecognized arguments"); a value that
would change the model is refused naming the flag as typed; the uvicorn flags act."""

from __future__ import annotations

import types

import pytest

from tests.cli_support import run_cli, served_with


def test_vllm_engine_flags_are_taken_with_a_warning_each(capsys):
    r = run_cli(capsys, "plan", "tiny-llama", "--enforce-eager", "--disable-log-stats", "--max-logprobs", "5",
                "--enable-chunked-prefill", "--cpu-offload-gb", "0", "--distributed_executor_backend", "mp")
    assert r.code == 0, r.err
    warned = [line for line in r.err.splitlines() if "setting_ignored" in line]
    for key in ("enforce_eager", "disable_log_stats", "max_logprobs", "enable_chunked_prefill", "cpu_offload_gb",
                "distributed_executor_backend"):
        assert any(f"field={key} " in line for line in warned), (key, warned)
    assert any("CUDA graphs" in line for line in warned)  # the reason, not only the name


def test_vllms_negated_switches_are_taken_too(capsys):
    """vLLM's boolean engine flags are ``--X/--no-X`` (argparse's BooleanOptionalAction): a launch line that turns
    chunked prefill or eager mode off is taken as the positive one is, not refused as unrecognized."""
    r = run_cli(capsys, "plan", "tiny-llama", "--no-enable-chunked-prefill", "--no-enforce-eager",
                "--no-trust-remote-code", "--no_async_scheduling")
    assert r.code == 0, r.err
    warned = [line for line in r.err.splitlines() if "setting_ignored" in line]
    for key in ("enable_chunked_prefill", "enforce_eager", "async_scheduling"):
        assert any(f"field={key} " in line for line in warned), (key, warned)


@pytest.mark.parametrize(("flags", "expected"), [
    (["--quantization", "awq"], "--quantization: vLLM's setting; kvload runs the checkpoint's weights in dtype, "
                                "unquantized; accepted: None, got 'awq'"),
    (["--data_parallel_size", "4"], "--data_parallel_size: vLLM's setting; kvload runs one engine per process"),
    (["--cpu-offload-gb", "4"], "--cpu-offload-gb: vLLM's setting; kvload keeps every weight on the device"),
    (["--max-logprobs", "x"], "--max-logprobs: expected an integer, got 'x'"),
])
def test_a_vllm_flag_whose_value_kvload_cannot_honour_is_one_line_naming_it(capsys, flags, expected):
    r = run_cli(capsys, "plan", "tiny-llama", *flags)
    assert r.code == 2 and expected in r.err, r.err
    assert len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err, r.err


#: vLLM's one-dash spellings (``vllm/engine/arg_utils.py``: ``-pcp``, ``-dph``, ``-dpe``, ``-dpm``, ``-ep``, ``-n``,
#: ``-r``, ``-cc``, ``-ac``, ``-sc`` were "unrecognized arguments") with their long flag and a value
SHORT_AND_LONG = [
    ("-ep", "--enable-expert-parallel", []), ("-dph", "--data-parallel-hybrid-lb", []),
    ("-dpe", "--data-parallel-external-lb", []), ("-dpm", "--data-parallel-multi-port-external-lb", []),
    ("-pcp", "--prefill-context-parallel-size", ["2"]), ("-pcp", "--prefill-context-parallel-size", ["1"]),
    ("-n", "--nnodes", ["2"]), ("-r", "--node-rank", ["1"]), ("-n", "--nnodes", ["1"]),
    ("-cc", "--compilation-config", ['{"level": 3}']), ("-O", "--compilation-config", ["3"]),
    ("-ac", "--attention-config", ['{"backend": "FLASH_ATTN"}']),
    ("-sc", "--speculative-config", ['{"method": "ngram", "num_speculative_tokens": 3}']),
    ("-dp", "--data-parallel-size", ["2"]), ("-dpl", "--data-parallel-size-local", ["2"]),
    ("-dpa", "--data-parallel-address", ["10.0.0.1"]), ("-dcp", "--decode-context-parallel-size", ["2"]),
    ("-pp", "--pipeline-parallel-size", ["1"]), ("-q", "--quantization", ["awq"]),
    ("-tp", "--tensor-parallel-size", ["1"]),
]


def _said(r) -> tuple[int, str, list[str]]:
    """A run's exit status, stdout and stderr lines without their timestamps."""
    return r.code, r.out, [line.split(" ", 1)[-1] if line[:4].isdigit() else line for line in r.err.splitlines()]


@pytest.mark.parametrize(("short", "long", "values"), SHORT_AND_LONG)
def test_a_vllm_one_dash_flag_acts_as_its_long_flag(capsys, short, long, values):
    """Each is taken as its long flag is (reported ignored, refused in one line naming it as typed, or acting: ``-sc``
    sets max_draft_len), never argparse's "unrecognized arguments"."""
    by_short = run_cli(capsys, "plan", "tiny-llama", short, *values)
    by_long = run_cli(capsys, "plan", "tiny-llama", long, *values)
    assert "unrecognized" not in by_short.err, by_short.err
    code, out, err = _said(by_short)
    assert (code, out, [line.replace(f"error: {short}:", f"error: {long}:") for line in err]) == _said(by_long)
    if code == 2:
        assert by_short.err.startswith(f"error: {short}: ") and len(err) == 1, by_short.err
    elif short == "-sc":
        assert "max_draft_len" in out
    elif short != "-tp":  # kvload's own field: it acts, nothing to say
        assert any("setting_ignored" in line for line in err), err


def test_a_vllm_scripts_parser_takes_the_one_dash_flags_too():
    """``EngineArgs.add_cli_args``: the same spellings, each destined to the long flag's keyword."""
    from kvload import EngineArgs, FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model", "tiny-llama", "-ep", "-dph", "-pcp", "1", "-n", "1", "-r", "0", "-cc", "{}",
                            "-ac", "{}", "-sc", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert vars(ns) == {"model": "tiny-llama", "enable_expert_parallel": True, "data_parallel_hybrid_lb": True,
                        "prefill_context_parallel_size": 1, "nnodes": 1, "node_rank": 0, "compilation_config": {},
                        "attention_config": {}, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}


def test_vllm_serve_request_logging_flags_say_they_are_ignored(monkeypatch, log):
    served_with(monkeypatch, "--disable-log-requests", "--max-log-len", "100", "--enable-prompt-tokens-details",
                "--disable-fastapi-docs")
    assert log.has("setting_ignored", field="--disable-log-requests", value=True, level="warning")
    assert log.has("setting_ignored", field="--max-log-len", value=100)
    assert log.has("setting_ignored", field="--enable-prompt-tokens-details", value=True)
    assert log.has("setting_ignored", field="--disable-fastapi-docs", value=True)
    assert not log.has("setting_ignored", field="--enable-log-requests")  # only what was given


def test_served_model_name_takes_several_names_as_vllms_does(monkeypatch, capsys):
    """``vllm serve MODEL --served-model-name A B`` (a launch line's aliases) was "unrecognized arguments: B"."""
    assert served_with(monkeypatch, "--served-model-name", "gpt-4o", "llama3")["model_name"] == ["gpt-4o", "llama3"]
    assert served_with(monkeypatch, "--served-model-name", "one")["model_name"] == ["one"]
    r = run_cli(capsys, "serve", "--served-model-name", "a", "b", "tiny-llama", "--port", "0")
    assert r.code == 2 and r.one_error_line, r.err  # MODEL was taken for a name: said, with what to do
    assert "give MODEL first: kvload serve MODEL --served-model-name NAME" in r.err, r.err


def _serve_kwargs(monkeypatch, *flags: str) -> dict:
    """What ``kvload serve tiny-llama --port 0 FLAGS`` hands uvicorn's ``serve`` (the command stops there)."""
    from kvload.cli.commands import build_parser
    from kvload.serve import command, server

    seen: dict = {}

    def serve(state, host, port, **kwargs):
        seen.update(kwargs)

    monkeypatch.setattr(server, "build_state", lambda result, **kw: types.SimpleNamespace(model_name="m"))
    monkeypatch.setattr(command, "_warn_when_the_audit_log_fails", lambda *a: None)
    monkeypatch.setattr(server, "serve", serve)
    command.cmd_serve(build_parser().parse_args(["serve", "tiny-llama", "--port", "0", *flags]))
    return seen


def test_uvicorns_log_level_and_access_log_flags_act(monkeypatch):
    assert _serve_kwargs(monkeypatch, "--uvicorn-log-level", "info")["log_level"] == "info"
    assert _serve_kwargs(monkeypatch, "--disable-uvicorn-access-log")["access_log"] is False
    plain = _serve_kwargs(monkeypatch)
    assert plain["log_level"] == "warning" and plain["access_log"] is None  # on at info and below, as before


def test_the_access_log_follows_the_level_unless_switched_off():
    from kvload.serve.server import _server

    state = types.SimpleNamespace(read_timeout_s=5.0, metrics=None, h11_max_header_count=None,
                                  h11_max_incomplete_event_size=None)
    with pytest.MonkeyPatch.context() as mp:
        import kvload.serve.server as server

        app = types.SimpleNamespace(state=types.SimpleNamespace(stopping=None))
        mp.setattr(server, "create_app", lambda s: app)
        assert _server(state, "info").config.access_log is True
        assert _server(state, "warning").config.access_log is False
        assert _server(state, "info", access_log=False).config.access_log is False


@pytest.mark.parametrize("flags, seed", [(["--seed", "7"], 7), ([], 0)])
def test_serve_seed_sets_where_unseeded_requests_draw_their_seeds(monkeypatch, flags, seed):
    """Without --seed the server is seeded 0, as `vllm serve`'s V1 engine (and kvload.LLM) are: it drew fresh
    randomness, so the same requests sampled differently after a restart."""
    from kvload.cli.commands import build_parser
    from kvload.serve import command, server

    seen = {}

    def build_state(result, **kw):
        seen["executor"] = result.executor
        raise SystemExit(0)

    monkeypatch.setattr(server, "build_state", build_state)
    with pytest.raises(SystemExit):
        command.cmd_serve(build_parser().parse_args(["serve", "tiny-llama", "--port", "0", *flags]))
    import random

    assert seen["executor"].llm_seed == seed  # the audit's generation_started says it
    assert seen["executor"].call_seeds.getrandbits(62) == random.Random(seed).getrandbits(62)


def test_a_seeded_server_samples_unseeded_requests_the_same_after_a_restart():
    import random

    from tests.serve_support import serving

    def run() -> list[list[int]]:
        with serving("tiny-llama", before=lambda r: setattr(r.executor, "call_seeds", random.Random(11))) as s:
            return [s.client.completions.create(model="tiny-llama", prompt=[5, 6, 7], max_tokens=8, temperature=1.0,
                                                extra_body={"ignore_eos": True}).choices[0].model_extra["token_ids"]
                    for _ in range(2)]

    first, again = run(), run()
    assert first == again  # the same arrivals, the same samples
    assert first[0] != first[1]  # yet each request draws its own seed: not one fixed seed for all


def test_cors_takes_vllms_defaults_and_flags(monkeypatch, capsys):
    from kvload.serve.state import CorsPolicy

    assert served_with(monkeypatch)["cors"] == CorsPolicy(("*",), ("*",), ("*",), False)  # vLLM's: any origin
    got = served_with(monkeypatch, "--allowed-origins", '["https://ui.example"]', "--allowed-methods",
                      '["GET", "POST"]', "--allow-credentials")["cors"]
    assert got == CorsPolicy(("https://ui.example",), ("GET", "POST"), ("*",), True)
    # an empty list allows none (Starlette's, and so vLLM's, reading of it), never any
    nobody = served_with(monkeypatch, "--allowed-origins", "[]", "--allowed-methods", "[]", "--allowed-headers", "[]")
    assert nobody["cors"] == CorsPolicy((), (), (), False)
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", "--allowed-origins", "https://ui.example")
    assert r.code == 2 and "--allowed-origins: expected a JSON list of strings" in r.err, r.err



@pytest.mark.parametrize("flag", ["--allowed-origins", "--allowed-methods", "--allowed-headers"])
@pytest.mark.parametrize("value", ['["x\\ny"]', '["\\ud800"]', '["GET", "\\u00e9"]', '["a\\tb"]', '["a b"]'])
def test_a_cors_value_no_http_header_can_carry_is_refused_at_start_naming_the_flag(monkeypatch, capsys, flag,
                                                                                   value):
    """A method or header name that is no HTTP token (a newline, a lone surrogate, a space), or an origin that is not
    printable ASCII, was taken at start-up; every browser preflight then failed: Starlette writes the methods and
    headers into its answer (h11 dropped the connection on a newline, a lone surrogate was a 500 with a traceback),
    and such an origin matches no request's. Now refused in one line naming the flag."""
    from kvload.serve import server

    def served(*args: object, **kwargs: object) -> None:  # a value taken: the command ends there, not serving
        raise SystemExit(0)

    monkeypatch.setattr(server, "build_state", served)
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", flag, value)
    lines = r.err.strip().splitlines()
    assert r.code == 2 and len(lines) == 1, r.err
    assert lines[0].startswith(f"error: {flag}: expected a JSON list of ") and "Traceback" not in r.err, r.err
    assert "HTTP" in lines[0] or "ASCII" in lines[0], lines[0]  # what is accepted

def test_a_browser_preflight_passes_the_api_key_gate_and_only_allowed_origins_get_the_header():
    from kvload.serve.state import CorsPolicy
    from tests.serve_support import serving

    policy = CorsPolicy(origins=("https://ui.example",))
    with serving("tiny-llama", state={"cors": policy, "api_keys": ["k1"]}) as s:
        pre = s.http.options("/v1/completions", headers={
            "Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://ui.example"
        r = s.http.post("/v1/completions", json={"model": "tiny-llama", "prompt": [1, 2], "max_tokens": 1},
                        headers={"Origin": "https://ui.example", "Authorization": "Bearer k1"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
        other = s.http.get("/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        assert s.http.post("/v1/completions", json={"model": "tiny-llama", "prompt": [1], "max_tokens": 1},
                           headers={"Origin": "https://ui.example"}).status_code == 401  # the key is still needed


def test_response_role_reaches_the_server_and_a_bad_one_is_named(monkeypatch, capsys):
    assert served_with(monkeypatch)["response_role"] == "assistant"
    assert served_with(monkeypatch, "--response-role", "bot")["response_role"] == "bot"
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", "--response-role", "a b")
    assert r.code == 2 and "--response-role: expected a role name" in r.err, r.err


def test_token_ids_force_usage_and_root_path_reach_the_server_and_a_bad_prefix_is_named(monkeypatch, capsys):
    off = served_with(monkeypatch)
    assert (off["return_tokens_as_token_ids"], off["force_include_usage"], off["root_path"]) == (False, False, "")
    on = served_with(monkeypatch, "--return-tokens-as-token-ids", "--enable_force_include_usage",
                     "--root-path", "/llm/v1/")
    assert (on["return_tokens_as_token_ids"], on["force_include_usage"], on["root_path"]) == (True, True, "/llm/v1")
    again = served_with(monkeypatch, "--return_tokens_as_token_ids", "--enable-force-include-usage",
                        "--root_path", "/p")
    assert (again["return_tokens_as_token_ids"], again["force_include_usage"], again["root_path"]) == (True, True, "/p")
    no = served_with(monkeypatch, "--return-tokens-as-token-ids", "--no-return-tokens-as-token-ids",
                     "--enable-force-include-usage", "--no_enable_force_include_usage")  # vLLM's --no-X forms
    assert (no["return_tokens_as_token_ids"], no["force_include_usage"]) == (False, False)
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", "--root-path", "llm")
    assert r.code == 2 and "--root-path: expected a path prefix such as /api" in r.err, r.err


def test_vllms_model_flag_names_the_model_on_every_command(capsys):
    """``vllm serve --model X`` and ``python -m vllm.entrypoints.openai.api_server --model X`` launch lines: kvload
    refused ``--model`` as an unrecognized argument. It names MODEL; MODEL given both ways must agree."""
    from kvload.cli.commands import build_parser

    ns = build_parser().parse_args(["serve", "--model", "tiny-llama", "--port", "0"])
    assert ns.model == "tiny-llama"
    assert build_parser().parse_args(["serve", "--model=tiny-llama", "--api-key", "k1", "k2"]).api_key == ["k1", "k2"]
    r = run_cli(capsys, "generate", "--model", "tiny-llama", "--prompt-ids", "1,2", "--max_new_tokens", "2", "--json")
    assert r.code == 0 and len(r.json()["outputs"][0]["outputs"][0]["token_ids"]) == 2, r.err
    r = run_cli(capsys, "plan", "tiny-llama", "--model", "tiny-mistral")
    assert r.code == 2 and r.err.strip() == ("error: --model tiny-mistral: MODEL is tiny-llama already; give the model "
                                             "once (MODEL or --model)"), r.err
    assert run_cli(capsys, "plan", "tiny-llama", "--model", "tiny-llama").code == 0
    r = run_cli(capsys, "plan", "--max_tokens", "5")
    assert r.code == 2 and r.err.strip() == "error: the following arguments are required: MODEL", r.err


def test_more_vllm_serve_launch_line_flags_say_they_are_ignored(monkeypatch, log):
    """``--disable-frontend-multiprocessing``, ``--guided-decoding-backend xgrammar`` and the older engines'
    ``--use-v2-block-manager`` / ``--num-scheduler-steps`` are in many copied launch lines; each was "unrecognized
    arguments". A backend or content format kvload does not run stays refused, naming what it takes;
    ``--chat-template-content-format`` acts (the server's engine takes it)."""
    seen = served_with(monkeypatch, "--disable-frontend-multiprocessing", "--enable-server-load-tracking",
                       "--guided-decoding-backend", "xgrammar", "--chat-template-content-format", "openai",
                       "--use-v2-block-manager", "--num-scheduler-steps", "8", "--preemption-mode", "swap")
    for field in ("--disable-frontend-multiprocessing", "--enable-server-load-tracking", "--guided-decoding-backend",
                  "use_v2_block_manager", "num_scheduler_steps", "preemption_mode"):
        assert log.has("setting_ignored", field=field), field
    assert not log.has("setting_ignored", field="--chat-template-content-format")
    assert seen["chat_template_content_format"] == "openai"


@pytest.mark.parametrize(("flags", "expected"), [
    (["--guided-decoding-backend", "outlines"], "error: --guided-decoding-backend: invalid choice: 'outlines' "
                                                "(choose from 'auto', 'xgrammar')"),
    (["--chat-template-content-format", "html"], "error: --chat-template-content-format: invalid choice: 'html' "
                                                 "(choose from 'auto', 'string', 'openai')"),
])
def test_a_serve_flag_value_kvload_does_not_run_is_one_line(capsys, flags, expected):
    r = run_cli(capsys, "serve", "tiny-llama", *flags)
    assert r.code == 2 and r.err.strip() == expected, r.err


def test_default_chat_template_kwargs_flag_reaches_the_server(monkeypatch, capsys):
    """vLLM's ``--default-chat-template-kwargs JSON`` was an unrecognized argument; a value that is no JSON object is
    one line naming the flag."""
    seen = served_with(monkeypatch, "--default-chat-template-kwargs", '{"enable_thinking": false}')
    assert seen["default_chat_template_kwargs"] == {"enable_thinking": False}
    r = run_cli(capsys, "serve", "tiny-llama", "--default-chat-template-kwargs", "[1]")
    assert r.code == 2 and r.err.startswith("error: --default-chat-template-kwargs: "), r.err


@pytest.mark.parametrize("command", ["plan", "run", "generate", "serve", "simulate"])
def test_the_usage_line_still_says_model_is_required(capsys, command):
    """MODEL became optional to argparse so that --model may give it; the usage line must not turn it into
    [MODEL]."""
    r = run_cli(capsys, command, "--help")
    assert r.code == 0 and " MODEL" in r.out and "[MODEL]" not in r.out, r.out[:600]


@pytest.mark.parametrize(("flags", "expected"), [
    (["--num-scheduler-steps", "0"], "error: --num-scheduler-steps: vLLM's setting; expected an integer >= 1, got 0"),
    (["--num_scheduler_steps=-1"], "error: --num_scheduler_steps: vLLM's setting; expected an integer >= 1, got -1"),
    (["--max-parallel-loading-workers", "-3"], "error: --max-parallel-loading-workers: vLLM's setting; expected an "
                                               "integer >= 1 (a number of workers), got -3"),
    (["--max-loras", "0"], "error: --max-loras: vLLM's setting; expected an integer >= 1, got 0"),
    (["--max-lora-rank", "7"], "error: --max-lora-rank: vLLM's setting; expected one of 1, 8, 16, 32, 64, 128, 256, "
                               "320, 512, got 7"),
    (["--preemption-mode", "evict"], "error: --preemption-mode: vLLM's setting; expected recompute or swap, got "
                                     "'evict'"),
    (["--distributed-executor-backend", "slurm"], "error: --distributed-executor-backend: vLLM's setting; expected "
                                                  "ray, mp, uni or external_launcher, got 'slurm'"),
])
def test_a_value_vllm_itself_refuses_is_refused_though_kvload_ignores_the_flag(capsys, flags, expected):
    """A launch line that vLLM would refuse (``--num-scheduler-steps 0``) was taken with a setting_ignored as if it
    were fine: the same one line naming the flag as typed, and exit 2, as a bad value of kvload's own flags gets."""
    r = run_cli(capsys, "plan", "tiny-llama", *flags)
    assert (r.code, r.out, r.err) == (2, "", expected + "\n")


def test_valid_values_of_those_flags_are_still_taken_and_reported_ignored(capsys):
    r = run_cli(capsys, "plan", "tiny-llama", "--num-scheduler-steps", "8", "--max-parallel-loading-workers", "2",
                "--max-loras", "1", "--max-lora-rank", "16", "--preemption-mode", "recompute")
    assert r.code == 0, r.err
    warned = [line for line in r.err.splitlines() if "setting_ignored" in line]
    for key in ("num_scheduler_steps", "max_parallel_loading_workers", "max_loras", "max_lora_rank", "preemption_mode"):
        assert any(f"field={key} " in line for line in warned), (key, warned)


@pytest.mark.parametrize("flags", [["--load-format", "safetensors"], ["--tokenizer", "x"], ["--revision", "main"],
                                   ["--tokenizer-mode", "slow"], ["--skip-tokenizer-init"],
                                   ["--enable-chunked-prefill"]])
def test_a_vllm_flag_that_tensorrt_llm_also_has_is_reported_as_vllms(capsys, flags):
    """``--load-format`` is vLLM's flag: its warning called it "a TensorRT-LLM option kvload does not act on"."""
    r = run_cli(capsys, "plan", "tiny-llama", *flags)
    assert r.code == 0, r.err
    (line,) = [line for line in r.err.splitlines() if "setting_ignored" in line]
    assert "a vLLM option kvload does not act on: " in line and "TensorRT-LLM" not in line, line


def test_load_format_dummy_says_kvload_loads_the_real_weights(capsys, tmp_path):
    """vLLM's ``--load-format dummy`` builds random weights without reading the checkpoint; kvload has no such mode,
    and the warning must say the real weights are what runs (a benchmark script would otherwise assume random ones),
    from the command line and from a TensorRT-LLM options file alike (TensorRT-LLM's DUMMY is the same)."""
    r = run_cli(capsys, "plan", "tiny-llama", "--load-format", "dummy")
    assert r.code == 0, r.err
    (line,) = [line for line in r.err.splitlines() if "setting_ignored" in line]
    assert "a vLLM option kvload does not act on: dummy asks for random weights" in line, line
    assert "kvload loads the checkpoint's real weights" in line, line
    config = tmp_path / "extra.yaml"
    config.write_text("load_format: dummy\n")
    r = run_cli(capsys, "plan", "tiny-llama", "--config", config)
    assert r.code == 0, r.err
    (line,) = [line for line in r.err.splitlines() if "setting_ignored" in line]
    assert "a TensorRT-LLM option kvload does not act on: dummy asks for random weights" in line, line
    assert "kvload loads the checkpoint's real weights" in line, line


def test_lora_modules_is_one_line_saying_adapters_are_not_served_and_the_lora_switches_are_reported(capsys):
    """``vllm serve BASE --enable-lora --lora-modules sql=/adapters/sql`` was "unrecognized arguments": the flag
    that loads adapters is one line naming it (exit 2, every value of it read: no "unrecognized b=/y"); the switches
    and sizes that load nothing are taken, each with a setting_ignored saying kvload runs the base weights; the
    Python API refuses the keyword alike."""
    import kvload
    from pipeline.errors import ConfigError

    for spelling in ("--lora-modules", "--lora_modules"):
        r = run_cli(capsys, "serve", "tiny-llama", "--enable-lora", spelling, "sql=/adapters/sql", "chat=/adapters/c")
        assert (r.code, r.out) == (2, ""), r.err
        assert r.err == (f"error: {spelling}: LoRA adapters are not served by kvload (it runs the base weights); serve "
                         "a checkpoint with the adapter merged into its weights (peft's merge_and_unload) instead\n")
    r = run_cli(capsys, "plan", "tiny-llama", "--enable-lora", "--max-cpu-loras", "4", "--fully-sharded-loras",
                "--lora-dtype", "auto", "--max-loras", "2")
    assert r.code == 0, r.err
    warned = [line for line in r.err.splitlines() if "setting_ignored" in line]
    for key in ("enable_lora", "max_cpu_loras", "fully_sharded_loras", "lora_dtype", "max_loras"):
        assert any(f"field={key} " in line and "kvload runs the base weights" in line for line in warned), key
    with pytest.raises(ConfigError, match="^lora_modules: LoRA adapters are not served by kvload"):
        kvload.plan("tiny-llama", lora_modules=[{"name": "sql", "path": "/adapters/sql"}], log=False)


def test_more_vllm_engine_flags_from_launch_lines_are_reported_or_refused_saying_why(capsys):
    """These were "unrecognized arguments": CUDA-graph, tracing, metrics and partial-prefill tuning flags are taken
    with a setting_ignored each saying why; those that would change the model or the KV cache are refused in one line
    with what kvload does instead (their no-op values taken)."""
    r = run_cli(capsys, "plan", "tiny-llama", "--cuda-graph-sizes", "1", "2", "4", "--max-cudagraph-capture-size", "8",
                "--disable-cascade-attn", "--otlp-traces-endpoint", "http://collector:4317",
                "--collect-detailed-traces", "all", "--show-hidden-metrics-for-version", "0.10",
                "--enable-mfu-metrics", "--long-prefill-token-threshold", "512", "--max-num-partial-prefills", "2",
                "--max-long-partial-prefills", "1", "--tokenizer-pool-size", "0", "--model-impl", "transformers",
                "--rope-scaling", "{}", "--kv-transfer-config", "{}")
    assert r.code == 0, r.err
    warned = [line for line in r.err.splitlines() if "setting_ignored" in line]
    for key, why in (("cuda_graph_sizes", "CUDA graphs"), ("max_cudagraph_capture_size", "CUDA graphs"),
                     ("disable_cascade_attn", "--attention_backend"), ("otlp_traces_endpoint", "audit log"),
                     ("collect_detailed_traces", "audit log"), ("show_hidden_metrics_for_version", "/metrics"),
                     ("enable_mfu_metrics", "/metrics"), ("long_prefill_token_threshold", "max_num_tokens"),
                     ("max_num_partial_prefills", "max_num_tokens"), ("max_long_partial_prefills", "max_num_tokens"),
                     ("tokenizer_pool_size", "tokenizer"), ("model_impl", "transformers"),
                     ("rope_scaling", "config.json"), ("kv_transfer_config", "--kv-events-config")):
        assert any(f"field={key} " in line and why in line for line in warned), (key, warned)
    for flags, said in ((["--rope-theta", "500000"], "error: --rope-theta: vLLM's setting; kvload reads the "
                                                      "checkpoint's config.json as it is (its rope_theta)"),
                        (["--model-impl", "vllm"], "error: --model-impl: vLLM's setting; kvload runs transformers' "
                                                   "built-in model classes"),
                        (["--kv-transfer-config", '{"kv_connector": "NixlConnector"}'],
                         "error: --kv-transfer-config: vLLM's setting; disaggregated prefill"),
                        (["--num-gpu-blocks-override", "512"], "error: --num-gpu-blocks-override: vLLM's count of KV "
                                                               "cache blocks"),
                        (["--kv-cache-memory-bytes", "8G"], "error: --kv-cache-memory-bytes: vLLM's KV cache size in "
                                                            "bytes per GPU")):
        r = run_cli(capsys, "plan", "tiny-llama", *flags)
        assert r.code == 2 and r.err.startswith(said) and len(r.err.splitlines()) == 1, r.err
        assert "unrecognized" not in r.err
