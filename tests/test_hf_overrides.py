"""vLLM's ``hf_overrides`` (``LLM(hf_overrides={...})``, ``--hf-overrides JSON``): laid over the checkpoint's config
before the spec, the KV geometry, the model defaults and the weights read it; each key set is one
``hf_config_overridden`` event; what cannot be set is one line naming ``hf_overrides.<key>``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kvload
from pipeline.errors import ConfigError, ModelError
from tests.llm_support import llm_kwargs

PROMPT = [5, 17, 300, 42, 9, 88, 123, 7, 61, 250, 3, 77, 19, 140]


def overridden(result) -> list[dict]:
    keys = ("key", "old", "new", "added", "source")
    return [{k: e[k] for k in keys} for e in result.audit.of("hf_config_overridden")]


def test_a_preset_plans_with_the_overridden_geometry_and_max_seq_len_follows_the_positions():
    base = kvload.plan("tiny-mistral", log=False)
    result = kvload.plan("tiny-mistral", log=False, hf_overrides={
        "sliding_window": 64, "max_position_embeddings": 1024, "num_hidden_layers": 2})
    assert base.args.max_seq_len == 8192 and {layer.window for layer in base.kv.layout.layers} == {256}
    assert result.args.max_seq_len == 1024  # the default read from the overridden max_position_embeddings
    assert [layer.window for layer in result.kv.layout.layers] == [64, 64]  # two layers, the window given
    assert overridden(result) == [
        {"key": "sliding_window", "old": 256, "new": 64, "added": False, "source": "api"},
        {"key": "max_position_embeddings", "old": 8192, "new": 1024, "added": False, "source": "api"},
        {"key": "num_hidden_layers", "old": 4, "new": 2, "added": False, "source": "api"},
    ]
    # kvload explain says where the default came from: the config as the overrides left it
    from kvload.explain import explain

    chain = explain(result.audit, ["max_seq_len"])[0]["chain"]
    assert any("the checkpoint's config as hf_overrides left it: " in step["reason"] and
               "max_position_embeddings 8192 → 1024 (api)" in step["reason"] for step in chain)
    # the events come before the spec and defaults read the config
    names = [e["event"] for e in result.audit.events]
    assert names.index("hf_config_overridden") < names.index("model_resolved")


def test_a_user_max_seq_len_still_wins_over_the_overridden_positions():
    result = kvload.plan("tiny-llama", log=False, max_model_len=300, hf_overrides={"max_position_embeddings": 512})
    assert result.args.max_seq_len == 300
    assert overridden(result)[0]["new"] == 512


def test_rope_theta_reaches_the_rotary_embedding_where_transformers_reads_it():
    # transformers 5 reads rope_theta from rope_parameters: set as an attribute alone it changed nothing that runs
    with kvload.LLM("tiny-llama", hf_overrides={"rope_theta": 1000.0}, **llm_kwargs()) as llm:
        inv_freq = llm.result.hf_model.model.rotary_emb.inv_freq
        assert float(inv_freq[1]) == pytest.approx(1000.0 ** (-2 / 16), rel=1e-5)  # head_dim 16
        assert overridden(llm) == [{"key": "rope_theta", "old": 10000.0, "new": 1000.0, "added": False,
                                    "source": "api"}]
    with pytest.raises(ConfigError, match=r"^hf_overrides.rope_theta: transformers' \w+ keeps rope_theta per layer "
                                          r"type in rope_parameters \(.*\); override rope_parameters instead$"):
        kvload.plan("tiny-gemma3", log=False, hf_overrides={"rope_theta": 1000.0})


def test_a_preset_plan_with_plain_overrides_imports_neither_torch_nor_transformers():
    from tests.cli_support import imports_after

    loaded = imports_after("""
        from kvload.cli.entry import main
        assert main(["plan", "tiny-llama", "--hf-overrides", '{"max_position_embeddings": 96}', "--device", "cpu",
                     "--max_tokens", "4096"]) == 0
    """)
    assert loaded == {"torch": False, "transformers": False}


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral", "tiny-gemma3", "tiny-deepseek-v3"])
def test_the_light_view_plans_as_transformers_config_would(preset, monkeypatch):
    from models.config_view import ConfigView

    given = {"max_position_embeddings": 96, "tie_word_embeddings": True}
    if preset != "tiny-gemma3":  # its layer_types would then name more layers than it has
        given["num_hidden_layers"] = 2
    light = kvload.plan(preset, log=False, hf_overrides=given)
    import models.config_view

    monkeypatch.setattr(models.config_view, "takes_overrides", lambda cfg, overrides: False)
    real = kvload.plan(preset, log=False, hf_overrides=given)
    assert isinstance(light.context.hf_config, ConfigView) and not isinstance(real.context.hf_config, ConfigView)
    assert overridden(light) == overridden(real) and len(overridden(light)) == len(given)
    assert light.args == real.args and light.kv.layout == real.kv.layout


def test_what_the_light_view_takes_transformers_config_takes_as_it_is():
    from models.checkpoint import load_hf_config, presets, resolve_checkpoint
    from models.config_view import takes_overrides, transformers_config

    for preset in presets():
        view = load_hf_config(resolve_checkpoint(preset))
        real = transformers_config(view)
        for key, value in view.to_dict().items():
            if not takes_overrides(view, {key: value}):
                continue
            # no alias, property or extra validator (interval) on the class: setting it is setting the field
            assert key not in real.attribute_map and not hasattr(getattr(type(real), key, None), "__set__"), key
            assert len(getattr(real, "__validators__", {}).get(key, ())) <= 1, (preset, key)
            assert getattr(real, key) == value and type(getattr(real, key)) is type(value), (preset, key)


def test_a_preset_loads_its_weights_from_the_overridden_config():
    with kvload.LLM("tiny-llama", hf_overrides={"num_hidden_layers": 2}, **llm_kwargs()) as llm:
        assert len(llm.result.hf_model.model.layers) == 2
        assert llm.result.context.hf_config.__class__.__name__ == "ConfigView"  # the plan read the light view


def greedy(model, ids: list[int], steps: int) -> list[int]:
    import torch

    out = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def test_a_local_checkpoints_weights_are_built_from_the_overridden_config(tiny_checkpoints):
    import torch
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints("mistral")  # sliding_window 8
    reference = {window: greedy(AutoModelForCausalLM.from_pretrained(
        str(path), sliding_window=window, dtype=torch.float32, attn_implementation="eager").eval(), PROMPT, 4)
        for window in (3, 8)}
    assert reference[3] != reference[8]  # the prompt is longer than both windows: the window shows
    with kvload.LLM(str(path), hf_overrides={"sliding_window": 3, "num_hidden_layers": 4}, **llm_kwargs()) as llm:
        got = llm.generate([PROMPT], max_tokens=4, temperature=0.0, ignore_eos=True)[0].outputs[0].token_ids
        assert llm.result.hf_model.config.sliding_window == 3
        assert {layer.window for layer in llm.result.kv.layout.layers} == {3}
        assert overridden(llm)[0] == {"key": "sliding_window", "old": 8, "new": 3, "added": False, "source": "api"}
    assert list(got) == reference[3]


def test_an_override_the_checkpoints_tensors_do_not_fit_is_refused_before_loading(tiny_checkpoints):
    with pytest.raises(ModelError) as info:
        kvload.LLM(str(tiny_checkpoints("llama")), hf_overrides={"intermediate_size": 100}, **llm_kwargs())
    assert "mlp" in str(info.value) and "\n" not in str(info.value)


def test_a_new_key_and_a_nested_value_are_set_as_given():
    scaling = {"rope_type": "linear", "factor": 2.0}
    result = kvload.plan("tiny-llama", log=False, hf_overrides={"rope_scaling": scaling, "my_flag": [1, "x"]})
    events = {e["key"]: e for e in overridden(result)}
    assert events["my_flag"] == {"key": "my_flag", "old": None, "new": [1, "x"], "added": True, "source": "api"}
    assert events["rope_scaling"]["new"]["factor"] == 2.0 and events["rope_scaling"]["source"] == "api"


@pytest.mark.parametrize(("value", "message"), [
    (lambda config: config, "hf_overrides: a callable is not accepted (kvload records each key it changes in the "
                            "config as an event); give a dict of config.json keys such as "
                            "{\"max_position_embeddings\": 4096}, each value JSON data (null, true/false, a number, a "
                            "string, a list or an object of those)"),
    ([1], "hf_overrides: expected a dict of config.json keys"),
    ({"sliding_window": object()}, "hf_overrides.sliding_window: expected JSON data (null, true/false, a number, a "
                                   "string, a list or an object), got object "),
    ({"rope_scaling": {"factor": float("nan")}}, "hf_overrides.rope_scaling.factor: nan is not a JSON number"),
    ({"to_dict": 1}, "hf_overrides.to_dict: names a method of transformers' LlamaConfig, not a config key"),
    ({"_private": 1}, "hf_overrides: key '_private' is not a config key"),
])
def test_what_cannot_be_set_is_one_line_naming_the_key(value, message):
    with pytest.raises(ConfigError) as info:
        kvload.plan("tiny-llama", log=False, hf_overrides=value)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    assert info.value.source == "api"


@pytest.mark.parametrize(("value", "message"), [
    # a billion layers: transformers took it and kvload built a billion layer records (a hang, then memory)
    ({"num_hidden_layers": 10 ** 9}, "hf_overrides.num_hidden_layers: expected an integer in [1, 16,384], got "),
    ({"num_hidden_layers": 0}, "hf_overrides.num_hidden_layers: expected an integer in [1, 16,384], got 0"),
    # these failed at the weights, naming neither the setting nor the key
    ({"vocab_size": -5}, "hf_overrides.vocab_size: expected an integer in [1, 16,777,216] or null, got -5"),
    ({"num_attention_heads": 0}, "hf_overrides.num_attention_heads: expected an integer in [1, 65,536], got 0"),
    ({"sliding_window": "x"}, "hf_overrides.sliding_window: expected an integer in [1, 4,294,967,296] or null, "
                              "got 'x'"),
    ({"sliding_window": -1}, "hf_overrides.sliding_window: expected an integer in [1, 4,294,967,296] or null"),
    ({"rope_parameters": {"rope_type": "nosuch"}}, "hf_overrides.rope_parameters.rope_type: 'nosuch' is not a RoPE "
                                                   "type transformers has; accepted: default, "),
    ({"rope_theta": "x"}, "hf_overrides.rope_theta: expected a number > 0"),
    ({"rms_norm_eps": -1.0}, "hf_overrides.rms_norm_eps: expected a number in (0, 1]"),  # token 0 over and over
    ({"max_position_embeddings": 0}, "hf_overrides.max_position_embeddings: expected an integer in [1, "),
    ({"hidden_act": "nosuch"}, "hf_overrides.hidden_act: 'nosuch' is not an activation transformers has; accepted: "),
])
def test_an_override_no_config_json_could_hold_is_one_line_before_anything_is_built(value, message):
    with pytest.raises(ConfigError) as info:
        kvload.plan("tiny-llama", log=False, hf_overrides=value)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    assert info.value.source == "api" and info.value.path.startswith("hf_overrides.")


def test_an_override_that_resizes_the_weights_names_the_overrides(tiny_checkpoints):
    with pytest.raises(ModelError) as info:
        kvload.LLM(str(tiny_checkpoints("llama")), hf_overrides={"vocab_size": 8}, **llm_kwargs())
    assert "lm_head.weight" in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).endswith("(with hf_overrides vocab_size applied to the config; an override that resizes "
                                    "the model needs weights of that size)")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvload", *args], capture_output=True, text=True, timeout=300)


def test_the_cli_flag_acts_and_its_refusal_is_one_line_exit_2(tmp_path):
    audit = tmp_path / "audit.jsonl"
    done = run_cli("plan", "tiny-llama", "--hf-overrides", '{"max_position_embeddings": 640}', "--audit-log",
                   str(audit), "--json")
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    event = next(r for r in records if r["event"] == "hf_config_overridden")
    assert (event["key"], event["old"], event["new"], event["source"]) == ("max_position_embeddings", 8192, 640, "cli")
    assert json.loads(done.stdout)["args"]["max_seq_len"] == 640
    bad = run_cli("plan", "tiny-llama", "--hf-overrides", '{"num_hidden_layers": 1, "to_dict": 2}')
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "error: hf_overrides.to_dict: names a method of transformers' LlamaConfig, not a config key"]


# --- the Qwen3-Reranker recipe: a causal LM served as a classifier built from its own head ---------------------------

RECIPE = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["w3", "w7"],
          "is_original_qwen3_reranker": True}


@pytest.fixture(scope="module")
def qwen3_causal(tiny_checkpoints, tmp_path_factory):
    """The tiny Qwen3ForCausalLM checkpoint with a word-level tokenizer (token i is "w<i>")."""
    from tests.llm_support import with_tokenizer

    return with_tokenizer(tiny_checkpoints("qwen3"), tmp_path_factory.mktemp("reranker") / "ckpt", 512)


def test_the_qwen3_reranker_recipe_scores_as_the_softmax_of_the_two_tokens_logits(qwen3_causal):
    """vLLM's from_2_way_softmax: one label, lm_head["yes"] - lm_head["no"]; a pair's score is
    sigmoid(logit_yes - logit_no) of its last token, the texts joined as they are (use_pad_token false)."""
    import torch
    from transformers import AutoModelForCausalLM

    causal = AutoModelForCausalLM.from_pretrained(str(qwen3_causal), dtype=torch.float32,
                                                  attn_implementation="eager").eval()

    def expected(ids: list[int]) -> float:
        with torch.no_grad():
            last = causal(input_ids=torch.tensor([ids])).logits[0, -1].float()
        return float(torch.softmax(last[[3, 7]], -1)[1])  # = sigmoid(logit_w7 - logit_w3)

    query, docs = [5, 17, 300], [[88, 123, 7], [301, 64]]
    with kvload.LLM(str(qwen3_causal), dtype="float32", hf_overrides=RECIPE, **llm_kwargs()) as llm:
        outs = llm.score("w5 w17 w300 ", ["w88 w123 w7", "w301 w64"])
        assert [o.prompt_token_ids for o in outs] == [query + d for d in docs]
        for out, doc in zip(outs, docs, strict=True):
            assert out.outputs.score == pytest.approx(expected(query + doc), abs=1e-5)
        probs = llm.classify([[9, 42, 11]])[0].outputs.probs
        assert probs == pytest.approx([expected([9, 42, 11])], abs=1e-5)
        assert {e["key"] for e in llm.audit.of("hf_config_overridden")} == set(RECIPE)
        with pytest.raises(kvload.GenerationError, match=r"^generate: the model is a sequence-classification"):
            llm.generate([[1, 2]], max_tokens=2)


def test_score_and_rerank_served_for_the_recipe_are_the_two_tokens_softmax(qwen3_causal):
    import torch
    from transformers import AutoModelForCausalLM

    from tests.serve_support import serving

    causal = AutoModelForCausalLM.from_pretrained(str(qwen3_causal), dtype=torch.float32,
                                                  attn_implementation="eager").eval()

    def expected(ids: list[int]) -> float:
        with torch.no_grad():
            last = causal(input_ids=torch.tensor([ids])).logits[0, -1].float()
        return float(torch.sigmoid(last[7] - last[3]))

    docs = [[88, 123, 7], [301, 64], [9, 42]]
    scores = [expected([5, 17, *d]) for d in docs]
    with serving(str(qwen3_causal), dtype="float32", max_seq_len=64, hf_overrides=RECIPE,
                 kv_cache_config={"max_tokens": 512, "tokens_per_block": 4}) as s:
        r = s.http.post("/score", json={"text_1": "w5 w17 ", "text_2": ["w88 w123 w7", "w301 w64", "w9 w42"]})
        assert r.status_code == 200, r.text
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(scores, abs=1e-5)
        r = s.http.post("/rerank", json={"query": "w5 w17 ", "documents": ["w88 w123 w7", "w301 w64", "w9 w42"]})
        assert r.status_code == 200, r.text
        ranked = r.json()["results"]
        assert [x["index"] for x in ranked] == sorted(range(3), key=lambda k: -scores[k])
        assert [x["relevance_score"] for x in ranked] == pytest.approx(sorted(scores, reverse=True), abs=1e-5)


@pytest.mark.parametrize(("extra", "message"), [
    ({"classifier_from_token": ["w3", "nope"]}, "classifier_from_token: 'nope' is not a token of "),
    ({"classifier_from_token": ["w3"]}, "classifier_from_token: expected two tokens [false, true]"),
    ({"method": "no_post_processing"}, "method: 'no_post_processing': kvload builds a classifier from a causal LM's "
                                       "head by vLLM's 'from_2_way_softmax' only"),
])
def test_a_recipe_kvload_cannot_build_is_one_line(qwen3_causal, extra, message):
    with pytest.raises(ModelError) as info:
        kvload.LLM(str(qwen3_causal), hf_overrides={**RECIPE, **extra}, **llm_kwargs())
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_the_recipe_on_a_preset_is_refused_before_anything_loads():
    with pytest.raises(ModelError, match=r"^classifier_from_token: tiny-qwen3 is a preset, with random weights and "
                                         r"no tokenizer"):
        kvload.plan("tiny-qwen3", log=False, hf_overrides=RECIPE)


def test_kvload_audit_shows_the_overrides_with_the_users_inputs(capsys, tmp_path):
    from tests.cli_support import run_cli as run_in_process

    log = tmp_path / "audit.jsonl"
    assert run_in_process(capsys, "plan", "tiny-llama", "--hf-overrides", '{"max_position_embeddings": 96}',
                          "--audit-log", str(log)).code == 0
    text = run_in_process(capsys, "audit", str(log))
    assert text.code == 0, text.err
    lines = text.out.splitlines()
    user = next(i for i, line in enumerate(lines) if line.startswith("user "))
    assert lines[user + 1] == "config  hf_overrides: max_position_embeddings 8192 → 96 (cli)"
    summary = json.loads(run_in_process(capsys, "audit", str(log), "--json").out)
    assert [(o["key"], o["old"], o["new"], o["source"]) for o in summary["hf_overrides"]] == [
        ("max_position_embeddings", 8192, 96, "cli")]


def test_a_cli_override_of_a_config_file_key_is_a_source_conflict(capsys, tmp_path):
    from tests.cli_support import run_cli as run_in_process

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("hf_overrides:\n  max_position_embeddings: 512\n  num_hidden_layers: 2\n")
    log = tmp_path / "audit.jsonl"
    r = run_in_process(capsys, "plan", "tiny-llama", "--config", str(cfg), "--hf-overrides",
                       '{"max_position_embeddings": 96, "num_hidden_layers": 2}', "--json", "--audit-log", str(log))
    assert r.code == 0, r.err
    assert r.json()["args"]["max_seq_len"] == 96  # the command line won
    events = [json.loads(line) for line in log.read_text().splitlines()]
    conflicts = [e for e in events if e["event"] == "source_conflict"]
    assert [(c["field"], c["kept"], c["kept_source"], c["overridden"], c["overridden_source"]) for c in conflicts] == [
        ("hf_overrides.max_position_embeddings", 96, "cli", 512, "config_file")]  # the same value is no conflict
    assert "source_conflict" in r.err
    assert run_in_process(capsys, "audit", str(log), "--verify").code == 0


def test_a_text_config_the_model_does_not_nest_is_refused_in_one_line_naming_it():
    # vLLM would set it as a plain key; transformers' get_text_config (and kvload's geometry) would then read the
    # dict as the decoder's config: "config has no usable 'num_hidden_layers' (got None)" misled
    bad = run_cli("plan", "tiny-llama", "--hf-overrides", '{"text_config": {"a": 1}}')
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "error: hf_overrides.text_config: LlamaConfig has no nested text_config, and transformers would read this "
        "value as the model's text config; set its keys at the top level of hf_overrides"]
    with pytest.raises(ConfigError, match=r"^hf_overrides\.decoder: LlamaConfig has no nested decoder, "):
        kvload.plan("tiny-llama", log=False, hf_overrides={"decoder": 5})
