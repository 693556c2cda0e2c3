"""vLLM's ``--convert classify`` (``LLM(model, convert="classify")``; the older ``task="classify"``) of a causal LM:
its ``as_seq_cls_model`` adapter reads the checkpoint as its ``*ForSequenceClassification`` and loads the ``score``
head its weights carry (a fine-tune's), checked against transformers' ``AutoModelForSequenceClassification`` reading
the same files; a checkpoint with no such head is refused in one line before any load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvload
from pipeline.errors import ConfigError, GenerationError, ModelError
from tests.classify_support import causal_lm_with_score, reference_logits
from tests.cli_support import run_cli
from tests.llm_support import llm_kwargs

PROMPTS = [[5, 17, 300, 42, 9, 11, 23, 2, 77, 301, 64, 8, 19], [88, 123, 7]]


@pytest.fixture(scope="module")
def llama_with_score(tmp_path_factory):
    """A tiny LlamaForCausalLM whose weights carry a three-row score.weight (num_labels 3 in its config)."""
    return causal_lm_with_score(tmp_path_factory.mktemp("conv") / "llama", "llama", 3, 3)


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_convert_classify_loads_the_score_head_a_causal_lm_carries(llama_with_score, manager):
    """The head is the checkpoint's score.weight (not the language-model head): the class probabilities are
    transformers' AutoModelForSequenceClassification logits through softmax; one model_converted says what changed;
    the model then classifies only (vLLM's pooling runner does not generate)."""
    logits = reference_logits(llama_with_score)
    with kvload.LLM(str(llama_with_score), convert="classify", runner="pooling", dtype="float32",
                    **llm_kwargs(manager)) as llm:
        converted = llm.audit.of("model_converted")
        assert [{k: e[k] for k in ("given_as", "value", "old", "new", "source")} for e in converted] == [
            {"given_as": "convert", "value": "classify", "old": "LlamaForCausalLM",
             "new": "LlamaForSequenceClassification", "source": "api"}]
        ignored = {e["field"] for e in llm.audit.events if e["event"] == "setting_ignored"}
        assert "convert" not in ignored and "runner" in ignored
        outs = llm.classify([PROMPTS[0], "w88 w123 w7"])
        for out, ids in zip(outs, PROMPTS, strict=True):
            assert out.outputs.num_classes == 3
            np.testing.assert_allclose(out.outputs.probs, torch.softmax(logits(ids), -1).numpy(), atol=1e-5)
        with pytest.raises(GenerationError, match=r"sequence-classification model \(LlamaForSequenceClassification"):
            llm.generate([PROMPTS[1]])


def test_task_classify_converts_too_and_a_one_label_head_is_a_cross_encoder(tmp_path):
    """vLLM maps task="classify" on a generative model to convert="classify"; a one-label score head (its config
    leaving num_labels to a key set by hf_overrides) is a reward model's sigmoid and a cross-encoder's score."""
    path = causal_lm_with_score(tmp_path / "qwen3", "qwen3", None, 1)
    logits = reference_logits_with(path, num_labels=1)
    with kvload.LLM(str(path), task="classify", hf_overrides={"num_labels": 1}, dtype="float32",
                    **llm_kwargs()) as llm:
        assert llm.audit.of("model_converted")[0]["given_as"] == "task"
        out = llm.classify(PROMPTS[0])[0]
        np.testing.assert_allclose(out.outputs.probs, torch.sigmoid(logits(PROMPTS[0])).numpy(), atol=1e-5)
        score = llm.score("w5 w17 w300", "w88 w123 w7")[0].outputs.score
        assert score == pytest.approx(float(torch.sigmoid(logits([5, 17, 300, 88, 123, 7]))[0]), abs=1e-5)


def reference_logits_with(path, **config):
    """transformers' classifier of the checkpoint with config keys set (what hf_overrides sets in kvload)."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(str(path), **config)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(path), config=cfg, dtype=torch.float32, attn_implementation="eager").eval()

    def logits(ids):
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0].float()

    return logits


def test_a_causal_lm_without_a_score_head_is_refused_naming_what_would_work(tmp_path, capsys):
    """vLLM's adapter would leave the head uninitialised (its loader raises on it): one line, before any load,
    naming score.weight and the two ways that work; a head of another number of rows than num_labels names
    num_labels; the CLI's --convert classify the same, exit 2 and no traceback."""
    bare = causal_lm_with_score(tmp_path / "bare", "llama", None, None)
    line = (r"^convert: 'classify': .*bare has no classifier head to load \(no score\.weight in its weights\); give a "
            r"checkpoint whose weights carry score\.weight .*hf_overrides \{\"method\": \"from_2_way_softmax\", "
            r"\"classifier_from_token\": \[false token, true token\]\}$")
    with pytest.raises(ModelError, match=line):
        kvload.LLM(str(bare), convert="classify", **llm_kwargs())
    r = run_cli(capsys, "plan", str(bare), "--convert", "classify")
    assert r.code == 2 and "no score.weight in its weights" in r.err and "Traceback" not in r.err
    assert len(r.err.strip().splitlines()) == 1, r.err
    rows = causal_lm_with_score(tmp_path / "rows", "llama", None, 3)  # num_labels left at transformers' 2
    with pytest.raises(ModelError, match=r"^convert: 'classify': .*rows's score\.weight has 3 rows \(labels\) and its "
                                         r"config's num_labels is 2; set hf_overrides \{\"num_labels\": 3\}"):
        kvload.LLM(str(rows), convert="classify", **llm_kwargs())
    with pytest.raises(ModelError, match=r"^convert: 'classify': tiny-llama is a preset, with random weights and no "
                                         r"classifier head \(score\.weight\) to load"):
        kvload.LLM("tiny-llama", convert="classify", **llm_kwargs())
    with pytest.raises(ModelError, match=r"^task: 'classify' makes a classifier of a causal LM of the families kvload "
                                         r"classifies \(LlamaForCausalLM, .*Gemma3ForCausalLM\); the checkpoint is "
                                         r"DeepseekV3ForCausalLM"):
        kvload.plan("tiny-deepseek-v3", task="classify", log=False)


@pytest.mark.parametrize("value", ["none", "embed"])
def test_the_command_line_overrides_a_config_files_convert_classify(llama_with_score, tmp_path, capsys, value):
    """CLI beats config file for convert as for any field: a YAML ``convert: classify`` under ``--convert none``
    leaves the causal LM unconverted, the override one source_conflict (not ``setting_ignored "(from cli)"``); the
    same source's classify stays what converts."""
    config = tmp_path / "c.yaml"
    config.write_text("convert: classify\n")
    plan = kvload.plan(str(llama_with_score), config_file=str(config), convert=value, log=False)
    assert plan.audit.of("model_converted") == []
    assert [(e["field"], e["kept"], e["kept_source"], e["overridden"], e["overridden_source"])
            for e in plan.audit.of("source_conflict")] == [("convert", value, "api", "classify", "config_file")]
    r = run_cli(capsys, "plan", str(llama_with_score), "--config", str(config), "--convert", value)
    assert r.code == 0 and "LlamaForSequenceClassification" not in r.out + r.err
    kept = kvload.plan(str(llama_with_score), config_file=str(config), log=False)
    assert [e["new"] for e in kept.audit.of("model_converted")] == ["LlamaForSequenceClassification"]


#: (the config file's key, the command line's flag, whether the model is converted): vLLM's ``task`` and ``convert``
#: both choose the conversion, so a file saying one under the other key yields to the command line
ACROSS_KEYS = [
    ("task: classify", ("convert", "none"), False), ("task: classify", ("convert", "embed"), False),
    ("convert: classify", ("task", "embed"), False), ("convert: classify", ("task", "generate"), False),
    ("convert: none", ("task", "classify"), True), ("task: generate", ("convert", "classify"), True),
]


@pytest.mark.parametrize(("line", "given", "converted"), ACROSS_KEYS)
def test_the_command_line_beats_a_config_file_that_says_the_other_key(llama_with_score, tmp_path, capsys, line,
                                                                      given, converted):
    """Before: a file's ``task: classify`` converted the model under ``--convert none`` (the command line's value
    reported ignored instead), and ``convert: classify`` under ``--task generate`` was refused. Now the stronger
    source wins, with one ``source_conflict`` naming both keys (``overridden_field``)."""
    config = tmp_path / "c.yaml"
    config.write_text(line + "\n")
    key, value = given
    theirs, _, their_value = line.partition(": ")
    plan = kvload.plan(str(llama_with_score), config_file=str(config), log=False, **{key: value})
    assert [(e["field"], e["kept"], e["kept_source"], e["overridden"], e["overridden_source"], e["overridden_field"])
            for e in plan.audit.of("source_conflict")] == [(key, value, "api", their_value, "config_file", theirs)]
    assert bool(plan.audit.of("model_converted")) is converted
    from kvload.explain import warning_text  # kvload audit's line names both keys

    assert warning_text(plan.audit.of("source_conflict")[0]) == \
        f'{key}: api "{value}" beats config_file {theirs} "{their_value}"'
    r = run_cli(capsys, "plan", str(llama_with_score), "--config", str(config), f"--{key}", value)
    assert r.code == 0, r.err
    assert ("LlamaForSequenceClassification" in r.out) is converted
    said = [x for x in r.err.splitlines() if "source_conflict" in x]
    assert len(said) == 1 and f"overridden_field={theirs}" in said[0] and f"field={key} " in said[0], r.err


@pytest.mark.parametrize(("task", "convert"), [("classify", "none"), ("classify", "embed"), ("embed", "classify")])
def test_one_source_giving_task_and_convert_two_conversions_is_refused_in_one_line(llama_with_score, tmp_path,
                                                                                   capsys, task, convert):
    """Before: ``--task classify --convert none`` converted the model and reported ``--convert none`` ignored."""
    ck, ok = ("task", "convert") if task == "classify" else ("convert", "task")
    other = convert if ok == "convert" else task
    detail = (f"{ck}: 'classify' makes a classifier and {ok} {other!r} (from {{}}) does not; both choose what the "
              "model is converted to (task is vLLM's older spelling of convert): give one")
    r = run_cli(capsys, "plan", str(llama_with_score), "--task", task, "--convert", convert)
    assert r.code == 2 and r.err.strip() == f"error: --{detail.format('cli')}", r.err
    with pytest.raises(ConfigError) as err:
        kvload.plan(str(llama_with_score), task=task, convert=convert, log=False)
    assert str(err.value) == detail.format("api")
    config = tmp_path / "c.yaml"
    config.write_text(f"task: {task}\nconvert: {convert}\n")
    r = run_cli(capsys, "plan", str(llama_with_score), "--config", str(config))
    assert r.code == 2 and r.err.strip() == f"error: config file {config}: {detail.format('config_file')}", r.err


@pytest.mark.parametrize("flag", ["--task", "--runner"])
def test_convert_classify_with_a_runner_that_does_not_pool_is_refused_in_one_line(llama_with_score, capsys, flag):
    """vLLM refuses a conversion for a runner that does not pool: ``--convert classify --task generate`` (or
    ``--runner generate``) is one line naming both, exit 2, nothing loaded."""
    r = run_cli(capsys, "plan", str(llama_with_score), "--convert", "classify", flag, "generate")
    assert r.code == 2 and "Traceback" not in r.err
    assert len(r.err.strip().splitlines()) == 1, r.err
    assert "convert: 'classify'" in r.err and f"{flag[2:]} 'generate'" in r.err


def test_a_presets_task_classify_is_refused_before_torch_or_transformers_is_imported():
    """A plan stays quick: ``kvload plan tiny-llama --task classify`` is refused (a preset has no score head to
    load) before anything imports torch or transformers, exit 2."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvload", "plan", "tiny-llama", "--task",
                           "classify"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "kvload.cli" in imported and not imported & {"torch", "transformers"}
    assert "a preset, with random weights" in done.stderr
