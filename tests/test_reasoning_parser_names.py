"""``reasoning_parser`` where no request runs (``plan``, ``run``, ``simulate``, ``kvload.plan`` / ``load``): a name
kvload has is taken and reported unused (``setting_ignored``), any other is refused in the one line ``generate``,
``serve`` and ``kvload.LLM`` give it. Before, a plan took any value from a config file or a keyword and reported it
ignored, so a typo (``granite``, ``deepseek-r1``) passed the plan and failed only at ``generate``; the plan commands
refused the flag itself as another command's. TensorRT-LLM's names of kvload's parsers (``deepseek-r1``: ``trtllm-serve
--reasoning_parser deepseek-r1``, an options file's key) were refused from every source; now they are that parser,
recorded under kvload's name."""

from __future__ import annotations

import pytest

import kvload
from pipeline.errors import ConfigError
from pipeline.trtllm_compat import REASONING_PARSER_UNUSED
from tests.cli_support import run_cli

FLAG_LINE = "error: --reasoning-parser: no reasoning parser 'granite' in kvload; it has: deepseek_r1, qwen3"
KEYWORD_LINE = "reasoning_parser: expected one of deepseek_r1, qwen3 (or None), got 'granite'"

COMMANDS = {
    "plan": ["plan", "tiny-llama"],
    "run": ["run", "tiny-llama", "--max_tokens", "64"],
    "simulate": ["simulate", "tiny-llama", "--workload", "shared-prefix", "--requests", "2", "--max_tokens", "4096"],
    "generate": ["generate", "tiny-llama", "--prompt-ids", "1,2", "--max_tokens", "64"],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_reasoning_parser_flag_gets_generates_one_line_on_every_command(capsys, command):
    r = run_cli(capsys, *COMMANDS[command], "--reasoning-parser", "granite")
    assert r.code == 2 and r.err.strip() == FLAG_LINE, r.err


@pytest.mark.parametrize("command", ["plan", "run", "simulate"])
def test_a_known_reasoning_parser_flag_on_a_command_without_requests_is_said_unused(capsys, command):
    r = run_cli(capsys, *COMMANDS[command], "--reasoning-parser", "qwen3")
    assert r.code == 0, r.err
    said = [line for line in r.err.splitlines() if "setting_ignored" in line and "field=reasoning_parser " in line]
    assert len(said) == 1 and "value=qwen3" in said[0] and "a plan or load runs no requests" in said[0], r.err


def test_a_config_files_unknown_reasoning_parser_is_refused_by_plan_as_by_llm(capsys, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("reasoning_parser: granite\n")
    line = f"config file {config}: reasoning_parser: expected one of deepseek_r1, qwen3 (or null), got 'granite'"
    r = run_cli(capsys, "plan", "tiny-llama", "--config", str(config))
    assert r.code == 2 and r.err.strip() == f"error: {line}", r.err
    for call in (kvload.plan, kvload.load):
        with pytest.raises(ConfigError) as err:
            call("tiny-llama", config_file=str(config), log=False)
        assert str(err.value) == line


@pytest.mark.parametrize("value", ["granite", "deepseek-v3", 3, ["qwen3"]])
def test_plan_and_load_refuse_an_unknown_reasoning_parser_keyword_as_llm_does(value):
    from pipeline.limits import short

    line = f"reasoning_parser: expected one of deepseek_r1, qwen3 (or None), got {short(value)}"
    for call in (kvload.plan, kvload.load):
        with pytest.raises(ConfigError) as err:
            call("tiny-llama", reasoning_parser=value, log=False, kv_cache_config={"max_tokens": 64})
        assert str(err.value) == line



def test_the_keyword_line_is_kvload_llms():
    with pytest.raises(ConfigError) as err:
        kvload.LLM("tiny-llama", reasoning_parser="granite", log=False)
    assert str(err.value) == KEYWORD_LINE


def test_plan_and_load_take_a_known_reasoning_parser_and_say_it_is_unused():
    plan = kvload.plan("tiny-llama", reasoning_parser="deepseek_r1", log=False)
    said = [e for e in plan.audit.events if e["event"] == "setting_ignored" and e["field"] == "reasoning_parser"]
    assert [(e["value"], e["reason"]) for e in said] == [("deepseek_r1", f"{REASONING_PARSER_UNUSED} (from api)")]


def test_tensorrt_llms_names_are_kvloads_parsers_from_every_source(capsys, monkeypatch, tmp_path):
    """TensorRT-LLM spells DeepSeek-R1's parser ``deepseek-r1`` (its ReasoningParserFactory key, any case): the flag,
    a config file and the keyword take it as ``deepseek_r1`` and the audit names kvload's parser."""
    from kvload.serve.server import build_state
    from tests.cli_support import served_with
    from tests.llm_support import llm_kwargs

    r = run_cli(capsys, *COMMANDS["plan"], "--reasoning-parser", "deepseek-r1")
    said = [line for line in r.err.splitlines() if "setting_ignored" in line and "field=reasoning_parser " in line]
    assert r.code == 0 and len(said) == 1 and "value=deepseek_r1 " in said[0], r.err
    config = tmp_path / "trtllm.yaml"
    config.write_text("reasoning_parser: deepseek-r1\n")
    for result in (kvload.plan("tiny-llama", config_file=str(config), log=False),
                   kvload.plan("tiny-llama", reasoning_parser="DeepSeek-R1", log=False)):
        said = [e for e in result.audit.events if e["event"] == "setting_ignored" and e["field"] == "reasoning_parser"]
        assert [e["value"] for e in said] == ["deepseek_r1"]
    assert served_with(monkeypatch, "--reasoning_parser", "deepseek-r1")["reasoning_parser"] == "deepseek_r1"
    assert served_with(monkeypatch, "--config", str(config))["reasoning_parser"] == "deepseek_r1"
    # the file's TensorRT-LLM name and the keyword's kvload name are one parser: no source_conflict
    with kvload.LLM("tiny-llama", **llm_kwargs(), config_file=str(config), reasoning_parser="deepseek_r1") as llm:
        assert llm.result.executor.reasoning_parser == "deepseek_r1"
        assert not [e for e in llm.audit.events if e["event"] in ("source_conflict", "setting_ignored")]
        state = build_state(llm.result, reasoning_parser="deepseek-r1")
        assert state.reasoning_parser == "deepseek_r1"
        assert [e["parser"] for e in llm.audit.of("reasoning_parser_enabled")] == ["deepseek_r1"]
    with kvload.LLM("tiny-llama", **llm_kwargs(), reasoning_parser="qwen3", config_file=str(config)) as llm:
        assert llm.result.executor.reasoning_parser == "qwen3"
        (conflict,) = llm.audit.of("source_conflict")
        assert (conflict["kept"], conflict["overridden"]) == ("qwen3", "deepseek_r1")


@pytest.mark.parametrize("command", ["generate", "plan"])
def test_a_name_neither_kvload_nor_tensorrt_llm_has_is_still_one_line_naming_kvloads(capsys, command):
    r = run_cli(capsys, *COMMANDS[command], "--reasoning-parser", "deepseek-v3")
    assert r.code == 2 and r.err.strip() == FLAG_LINE.replace("'granite'", "'deepseek-v3'"), r.err
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0", "--reasoning-parser", "Deepseek_R1")
    assert r.code == 2 and r.err.strip() == FLAG_LINE.replace("'granite'", "'Deepseek_R1'"), r.err
