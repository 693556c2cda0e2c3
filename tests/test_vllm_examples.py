"""vLLM's own example scripts run against kvload: the argparse helpers they build on, then the scripts themselves.

The scripts (``tests/data/vllm_examples``) restate vLLM's ``examples/offline_inference`` files call for call, each
naming the file and commit it follows; a vLLM user changes the import line and the model name, nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvload
from kvload import EngineArgs, FlexibleArgumentParser
from pipeline.errors import ConfigError
from tests.cli_support import ENV, REPO
from tests.conftest import needs_smollm2
from tests.llm_support import with_tokenizer

EXAMPLES = Path(__file__).parent / "data" / "vllm_examples"


def engine_parser() -> argparse.ArgumentParser:
    """vLLM's examples' parser: FlexibleArgumentParser with EngineArgs' flags and the script's sampling flags."""
    parser = FlexibleArgumentParser()
    assert EngineArgs.add_cli_args(parser) is parser  # embed.py and score.py keep what it returns
    sampling = parser.add_argument_group("Sampling parameters")
    sampling.add_argument("--max-tokens", type=int)  # the script's own: not kvload's --max_tokens (KV tokens)
    sampling.add_argument("--top_k_words", type=int)  # a script's underscored flag stays its own
    return parser


def test_engine_args_puts_only_the_given_flags_under_llms_keywords():
    args = vars(engine_parser().parse_args(
        ["--model", "m", "--max_model_len", "512", "--block-size=16", "-tp", "1", "--no-enable-prefix-caching",
         "--enforce-eager", "--seed", "3", "--max-tokens", "8", "--top_k_words", "2", "--gpu_memory_utilization=0.5",
         "--max-num-batched-tokens", "8k"]))
    assert args == {"model": "m", "max_model_len": 512, "block_size": 16, "tensor_parallel_size": 1,
                    "enable_prefix_caching": False, "enforce_eager": True, "seed": 3, "max_tokens": 8,
                    "top_k_words": 2, "gpu_memory_utilization": 0.5, "max_num_batched_tokens": 8000}
    # nothing given: only the script's own flags (their None defaults), so LLM(**args) gets no engine setting
    assert vars(engine_parser().parse_args([])) == {"max_tokens": None, "top_k_words": None}


def test_engine_args_help_says_what_each_flag_does_here():
    parser = engine_parser()
    engine = [a for a in parser._actions if a.dest not in ("help", "max_tokens", "top_k_words")]
    said = {a.option_strings[0]: a.help for a in engine}
    assert len(said) > 60 and all(h and not h.rstrip().endswith(":") for h in said.values()), said
    assert said["--max-model-len"].startswith("kvload's max_seq_len: longest sequence")
    assert said["--enforce-eager"].startswith("accepted, reported setting_ignored: CUDA graphs")
    assert said["--gpu-memory-utilization"].startswith("refused: vLLM's share of the whole GPU's memory")
    assert said["--quantization"].startswith("only None: ")
    assert "--gpu-memory-utilization F" in parser.format_help()  # argparse formats every line (a % would break it)


def test_engine_args_into_an_argument_group_with_the_groups_default_model():
    parser = FlexibleArgumentParser()
    group = parser.add_argument_group("Engine arguments")
    EngineArgs.add_cli_args(group)
    group.set_defaults(model="smollm2-135m", runner="pooling")
    assert vars(parser.parse_args([])) == {"model": "smollm2-135m", "runner": "pooling"}
    assert vars(parser.parse_args(["--model", "tiny-llama"]))["model"] == "tiny-llama"


def test_engine_args_object_holds_only_what_the_script_set():
    engine_args = EngineArgs("tiny-llama", max_model_len=512, enforce_eager=True)
    engine_args.disable_log_stats = False  # vLLM's benchmarks set fields after building it
    assert dataclasses.is_dataclass(engine_args) and engine_args.seed is None  # unset: None, not vLLM's default
    assert dataclasses.asdict(engine_args) == {"model": "tiny-llama", "max_model_len": 512, "enforce_eager": True,
                                               "disable_log_stats": False}
    assert dataclasses.asdict(engine_args) | {"seed": 42} == {**vars(engine_args), "seed": 42}  # vLLM's examples' form
    assert repr(engine_args) == ("EngineArgs(model='tiny-llama', max_model_len=512, enforce_eager=True, "
                                 "disable_log_stats=False)")
    assert dataclasses.asdict(dataclasses.replace(engine_args, seed=1))["seed"] == 1
    with pytest.raises(TypeError, match=r"^EngineArgs: unexpected keyword argument 'max_seq_len' \(vLLM's engine"):
        EngineArgs(model="m", max_seq_len=5)  # kvload's own name: LLM's keyword, not vLLM's EngineArgs field
    # named with what it was likely meant as, as every refusal of a mistyped keyword is (it named neither)
    with pytest.raises(TypeError, match=r"as keywords\); vLLM's name for it is 'max_model_len'$"):
        EngineArgs(model="m", max_seq_len=5)  # not the max_seq_len_to_capture it begins
    with pytest.raises(TypeError, match=r"as keywords\); did you mean 'max_model_len'\?$"):
        EngineArgs(model="m", max_model_lenn=5)
    with pytest.raises(TypeError, match=r"^EngineArgs: takes the model as its one positional argument, got 2"):
        EngineArgs("m", 512)


def test_engine_args_from_cli_args_takes_every_engine_flag_and_no_script_flag():
    parser = engine_parser()
    engine_dests = {a.dest for a in parser._actions} - {"help", "max_tokens", "top_k_words"}
    assert engine_dests <= {f.name for f in dataclasses.fields(EngineArgs)}
    args = parser.parse_args(["--model", "m", "--max_num_seqs", "3", "--max-tokens", "8", "--no-enable-prefix-caching"])
    engine_args = EngineArgs.from_cli_args(args)
    assert dataclasses.asdict(engine_args) == {"model": "m", "max_num_seqs": 3, "enable_prefix_caching": False}


def test_engine_args_asdict_acts_on_the_llm(tiny_checkpoints, tmp_path):
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "ckpt", 512)
    parser = engine_parser()
    parser.set_defaults(model=str(words))
    engine_args = EngineArgs.from_cli_args(parser.parse_args(["--max-model-len", "48", "--block_size", "4",
                                                              "--device", "cpu", "--max-tokens", "5"]))
    engine_args.max_num_seqs = 3
    with kvload.LLM(**dataclasses.asdict(engine_args), log=False, kv_cache_config={"max_tokens": 256}) as llm:
        assert (llm.args.max_seq_len, llm.args.kv_cache_config.tokens_per_block, llm.args.max_batch_size) == (48, 4, 3)
    with pytest.raises(ConfigError, match="^gpu_memory_utilization: vLLM's share"):
        kvload.LLM(**dataclasses.asdict(EngineArgs(str(words), gpu_memory_utilization=0.9)), log=False)


def test_vllms_import_paths_of_the_parser():
    from kvload.utils import FlexibleArgumentParser as old_path
    from kvload.utils.argparse_utils import FlexibleArgumentParser as new_path

    assert old_path is new_path is kvload.FlexibleArgumentParser


def test_the_parsed_flags_act_on_the_llm(tiny_checkpoints, tmp_path):
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "ckpt", 512)
    parser = engine_parser()
    parser.set_defaults(model=str(words))
    args = vars(parser.parse_args(["--max-model-len", "48", "--block_size", "4", "--device", "cpu",
                                   "--max-num-seqs", "3", "--enforce-eager", "--max-tokens", "5"]))
    max_tokens = args.pop("max_tokens")
    args.pop("top_k_words")
    with kvload.LLM(**args, log=False, kv_cache_config={"max_tokens": 256}) as llm:
        assert (llm.args.max_seq_len, llm.args.kv_cache_config.tokens_per_block, llm.args.max_batch_size) == (48, 4, 3)
        sp = llm.get_default_sampling_params()
        sp.max_tokens = max_tokens
        (out,) = llm.generate([[5, 6, 7]], sp)
    assert len(out.outputs[0].token_ids) <= 5
    refused = vars(parser.parse_args(["--gpu-memory-utilization", "0.9"]))
    del refused["max_tokens"], refused["top_k_words"]
    with pytest.raises(ConfigError, match="^gpu_memory_utilization: vLLM's share"):  # LLM's one line, as a keyword's
        kvload.LLM(**refused, log=False)


# --- the scripts, run as a user runs them (SmolLM2-135M: a real tokenizer and chat template) ---------------------


def run_example(name: str, *argv: str) -> str:
    """Run ``tests/data/vllm_examples/<name>`` with this checkout's kvload; its stdout (it must exit 0)."""
    r = subprocess.run([sys.executable, str(EXAMPLES / name), *argv], capture_output=True, text=True, timeout=300,
                       env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": ENV.get("OMP_NUM_THREADS", "1")},
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.mark.slow
@needs_smollm2
def test_basic_py_as_written():
    out = run_example("basic.py")
    assert re.findall(r"^Prompt: +'(.*)'$", out, re.M) == ["Hello, my name is", "The president of the United States "
                                                           "is", "The capital of France is", "The future of AI is"]
    assert len(re.findall(r"^Output: +['\"].+['\"]$", out, re.M)) == 4


@pytest.mark.slow
@needs_smollm2
def test_generate_py_with_vllms_flags():
    out = run_example("generate.py", "--max-tokens", "6", "--temperature", "0", "--max_model_len", "256",
                      "--enforce-eager")
    lines = out.splitlines()
    assert len(lines) == 4 and all(line.startswith("Prompt: ") for line in lines)
    assert "Paris" in next(line for line in lines if "capital of France" in line)


@pytest.mark.slow
@needs_smollm2
def test_chat_py_one_conversation_then_a_batch_then_a_template(tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    out = run_example("chat.py", "--max-tokens", "6", "--temperature", "0", "--chat-template-path", str(template))
    prompts = re.findall(r"^Prompt: '(.*)'$", out, re.M)
    assert len(prompts) == 1 + 10 + 10
    assert all(p.startswith("<|im_start|>system") for p in prompts[:11])  # the model's own template
    assert all(p.startswith("system: You are a helpful assistant") for p in prompts[11:])  # the file's
    assert "Paris" in re.findall(r"^Generated text: '(.*)'$", out, re.M)[0]


@pytest.mark.slow
@needs_smollm2
def test_embed_and_score_py():
    out = run_example("embed_score.py")
    assert re.findall(r"\(size=(\d+)\)", out) == ["576", "576"]  # SmolLM2-135M's hidden size
    brazil, france = map(float, re.findall(r"^Score: (\S+)$", out, re.M))
    assert 0 < brazil < france <= 1  # the question is nearer the answer about France


@pytest.mark.slow
@needs_smollm2
def test_metrics_py_tells_the_records_apart_vector_included():
    spec = '{"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}'
    out = run_example("metrics.py", spec)
    assert re.search(r"^kvload_generation_tokens \(counter\) = \d+$", out, re.M)
    assert re.search(r"^kvload_time_to_first_token_seconds \(histogram\)$", out, re.M)
    (values,) = re.findall(r"^kvload_spec_decode_num_accepted_tokens_per_pos \(vector\) = (\[.*\])$", out, re.M)
    accepted = int(re.search(r"^kvload_spec_decode_num_accepted_tokens \(counter\) = (\d+)$", out, re.M)[1])
    assert len(eval(values)) == 3 and sum(eval(values)) == accepted


def test_get_metrics_has_vllms_accepted_per_position_vector(tiny_checkpoints, tmp_path):
    from kvload.metrics import Counter, Vector

    # the tiny qwen3 falls into runs of one token, which the n-gram drafts then guess
    words = with_tokenizer(tiny_checkpoints("qwen3"), tmp_path / "ckpt", 512)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with kvload.LLM(str(words), speculative_config=spec, device="cpu", max_model_len=64, log=False,
                    kv_cache_config={"max_tokens": 256, "tokens_per_block": 4}) as llm:
        llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], kvload.SamplingParams(max_tokens=30, ignore_eos=True))
        stats = llm.last_stats
        ours = {m.name: m for m in llm.get_metrics()}
        theirs = {m.name: m for m in llm.get_metrics(metrics_name_prefix="vllm")}
    vector = ours["kvload_spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(vector, Vector) and len(vector.values) == 3
    assert sum(vector.values) == stats.accepted_draft_tokens == ours["kvload_spec_decode_num_accepted_tokens"].value > 0
    assert vector.values == list(stats.accepted_per_position) + [0] * (3 - len(stats.accepted_per_position))
    assert vector.values == sorted(vector.values, reverse=True)  # position i is confirmed only after 0 ... i-1
    assert theirs["vllm:spec_decode_num_accepted_tokens_per_pos"].values == vector.values
    assert isinstance(ours["kvload_spec_decode_num_draft_tokens"], Counter)


def test_get_metrics_has_no_vector_without_drafts(tiny_checkpoints, tmp_path):
    from kvload.metrics import Vector

    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "ckpt", 512)
    with kvload.LLM(str(words), device="cpu", max_model_len=64, log=False, kv_cache_config={"max_tokens": 256}) as llm:
        llm.generate([[5, 6, 7]], kvload.SamplingParams(max_tokens=4))
        assert not [m for m in llm.get_metrics() if isinstance(m, Vector)]  # as vLLM, which has the series with drafts


def test_vllms_import_paths_of_the_parameters_prompts_and_outputs():
    from kvload.inputs import TextPrompt, TokensPrompt
    from kvload.outputs import (
        ClassificationOutput,
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        RequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from kvload.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

    assert (SamplingParams, StructuredOutputsParams, BeamSearchParams) == (
        kvload.SamplingParams, kvload.StructuredOutputsParams, kvload.BeamSearchParams)
    assert (TextPrompt, TokensPrompt) == (kvload.TextPrompt, kvload.TokensPrompt)
    assert (RequestOutput, CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, ScoringOutput,
            ScoringRequestOutput) == (kvload.RequestOutput, kvload.CompletionOutput, kvload.EmbeddingOutput,
                                      kvload.EmbeddingRequestOutput, kvload.ScoringOutput, kvload.ScoringRequestOutput)
    assert (ClassificationOutput, ClassificationRequestOutput) == (kvload.ClassificationOutput,
                                                                   kvload.ClassificationRequestOutput)


@pytest.mark.slow
@needs_smollm2
def test_structured_outputs_py_choice_regex_json_grammar():
    out = run_example("structured_outputs.py")
    got = dict(re.findall(r"^Structured outputs by (\w+): (.*?)\n-{50}$", out, re.M | re.S))
    assert got["Choice"] in ("Positive", "Negative")
    assert re.fullmatch(r"\w+(@\w*(\.(c(om?)?)?)?)?", got["Regex"])  # the regex's prefix (max_tokens may cut it)
    car = json.loads(got["JSON"])
    assert set(car) == {"brand", "model", "car_type"} and car["car_type"] in ("sedan", "SUV", "Truck", "Coupe")
    assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", got["Grammar"])


def test_served_model_name_is_taken_and_llm_answers_for_it():
    args = vars(engine_parser().parse_args(["--model", "tiny-llama", "--served_model_name", "a", "b"]))
    assert args["served_model_name"] == ["a", "b"]
    assert "refused: the model name vLLM's server answers to" in engine_parser().format_help()
    del args["max_tokens"], args["top_k_words"]
    with pytest.raises(ConfigError, match=r"^served_model_name: .*kvload serve --served-model-name takes it"):
        kvload.LLM(**args, log=False)


def test_flexible_parser_reads_a_config_file_the_command_line_winning(tmp_path):
    config = tmp_path / "engine.yaml"
    config.write_text("max_model_len: 512\nenforce-eager: true\nenable_prefix_caching: false\nseed: null\n"
                      "served-model-name: [a, b]\nhf_overrides: {rope_theta: 10000}\nmax-tokens: 7\n")
    args = vars(engine_parser().parse_args(["--config", str(config), "--max-model-len", "256"]))
    assert args == {"max_model_len": 256, "enforce_eager": True, "enable_prefix_caching": False,
                    "served_model_name": ["a", "b"], "hf_overrides": {"rope_theta": 10000}, "max_tokens": 7,
                    "top_k_words": None}
    own = FlexibleArgumentParser()
    own.add_argument("--config")  # a script's own --config is its own
    assert own.parse_args(["--config", "run.json"]).config == "run.json"


@pytest.mark.parametrize(("text", "name", "said"), [
    (None, "engine.json", r"'.*engine.json' is not a \.yaml or \.yml file"),
    (None, "missing.yaml", r"cannot read '.*missing.yaml': No such file"),
    ("max_model_len: [1\n", "bad.yaml", r"'.*bad.yaml' is not valid YAML \(line 2\)"),
    ("- 1\n", "list.yaml", r"'.*list.yaml' must hold a mapping of flag names to values, got list"),
    ("1: 2\n", "key.yaml", r"'.*key.yaml': key 1 is not a flag name"),
])
def test_flexible_parser_refuses_a_bad_config_file_in_one_line(tmp_path, capsys, text, name, said):
    if text is not None:
        (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as exit_:
        engine_parser().parse_args(["--config", str(tmp_path / name)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and re.search(r"error: argument --config: " + said, err), err


def test_flexible_parser_dotted_json_flags_and_dash_o():
    args = vars(engine_parser().parse_args(
        ["--speculative_config.method", "ngram", "--speculative-config.num_speculative_tokens=3", "-O3",
         "--hf-overrides.rope_scaling.factor", "2.0", "--hf-overrides.layers+", "a,b", "--hf-overrides.layers+=c",
         "--max-tokens", "-1"]))
    assert args == {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
                    "compilation_config": {"level": 3},
                    "hf_overrides": {"rope_scaling": {"factor": 2.0}, "layers": ["a", "b", "c"]},
                    "max_tokens": -1, "top_k_words": None}
    assert vars(engine_parser().parse_args(["-O", "2"]))["compilation_config"] == {"level": 2}
    assert vars(engine_parser().parse_args(["-O.level", "1"]))["compilation_config"] == {"level": 1}


def test_flexible_parser_config_file_acts_on_the_llm(tiny_checkpoints, tmp_path):
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "ckpt", 512)
    config = tmp_path / "engine.yaml"
    config.write_text(f"model: {words}\nmax-model-len: 48\nblock_size: 4\ndevice: cpu\n")
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    engine_args = EngineArgs.from_cli_args(parser.parse_args(["--config", str(config), "--max_num_seqs", "3", "-O3"]))
    with kvload.LLM(**dataclasses.asdict(engine_args), log=False, kv_cache_config={"max_tokens": 256}) as llm:
        assert (llm.args.max_seq_len, llm.args.kv_cache_config.tokens_per_block, llm.args.max_batch_size) == (48, 4, 3)
        assert [e["field"] for e in llm.audit.of("setting_ignored")] == ["compilation_config"]


@pytest.mark.parametrize(("argv", "said"), [
    (["--hf-overrides.rope_theta"], "argument --hf-overrides.rope_theta: expected one argument"),
    (["--hf-overrides..rope_theta", "1"], "argument --hf-overrides..rope_theta: a dotted flag names keys, "
                                          "--hf-overrides.KEY[.KEY...] VALUE"),
    (["--max-model-len.x", "1"], "argument --max-model-len: expected an integer, got '{\"x\": 1}'"),
])
def test_flexible_parser_refuses_a_bad_dotted_flag_in_one_line(capsys, argv, said):
    with pytest.raises(SystemExit) as exit_:
        engine_parser().parse_args(argv)
    assert exit_.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].endswith("error: " + said)


def test_flexible_parser_help_search(capsys):
    parser = engine_parser()
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--help=max_model"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("Arguments matching 'max-model':\n  --max-model-len N  kvload's")
    assert "--seed" not in out
    with pytest.raises(SystemExit):
        parser.parse_args(["--help=sampling parameters"])  # a group by its title
    assert capsys.readouterr().out.splitlines()[:2] == ["Sampling parameters:", "  --max-tokens MAX_TOKENS"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--help=nothing"])
    assert capsys.readouterr().out.strip() == "No group or arguments matching 'nothing'. Use --help to see them all."
    assert "--seed N" in parser.format_help()  # the next help is the whole one
