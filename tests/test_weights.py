"""The load_weights stage: seeded random weights for presets, safetensors directories, dtype, release."""

from __future__ import annotations

import json
import os

import pytest
import torch

import pipeline
from models.checkpoint import load_hf_config, resolve_checkpoint
from models.weights import random_model, torch_dtype
from pipeline import ConfigError, LoadRequest, ModelError
from stages import LoadWeights


def load_through_stages(model: str, *, load_weights: bool = True, **overrides):
    """Stages 1–5 plus load_weights (weights come before build_kv_manager)."""
    request = LoadRequest(model=model, overrides=overrides, load_weights=load_weights)
    return pipeline.execute(request, [*pipeline.plan_stages(), LoadWeights()], log=False)


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_preset_weights_are_deterministic_per_seed_and_leave_the_global_rng_alone():
    cfg = load_hf_config(resolve_checkpoint("tiny-llama"))
    torch.manual_seed(7)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    a = state(random_model(cfg, device="cpu", dtype="float32", seed=0))
    assert torch.equal(torch.rand(3), expected_next)
    b = state(random_model(cfg, device="cpu", dtype="float32", seed=0))
    c = state(random_model(cfg, device="cpu", dtype="float32", seed=1))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_load_weights_runs_after_routing_and_reports_what_it_loaded():
    result = load_through_stages("tiny-llama", weights_seed=3)
    model = result.hf_model
    assert model is not None and result.tokenizer is None  # presets carry no tokenizer
    assert next(model.parameters()).device.type == "cpu"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    [event] = result.audit.of("weights_loaded")
    assert event["source"] == "random" and event["seed"] == 3 and event["stage"] == "load_weights"
    assert event["bytes"] == sum(t.numel() * 4 for t in [*model.parameters(), *model.buffers()])
    assert event["parameters"] == sum(p.numel() for p in model.parameters())
    names = [e["event"] for e in result.audit.events]
    assert names.index("executor_routed") < names.index("weights_loaded")
    expected = random_model(result.context.hf_config, device="cpu", dtype="float32", seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.state_dict().values(),
                                                    strict=True))
    result.close()
    assert result.hf_model is None


def test_load_weights_does_nothing_unless_asked():
    result = load_through_stages("tiny-llama", load_weights=False)
    assert result.hf_model is None
    assert not result.audit.of("weights_loaded")


def test_weights_follow_the_resolved_dtype():
    result = load_through_stages("tiny-gemma3", dtype="bfloat16")
    assert {p.dtype for p in result.hf_model.parameters()} == {torch.bfloat16}
    assert result.audit.of("weights_loaded")[0]["dtype"] == "bfloat16"


def test_a_float8_model_dtype_is_refused_before_anything_loads():
    # float8 is a KV cache dtype only: the args refuse it as the model dtype, from every source
    with pytest.raises(ConfigError, match=r"^dtype: expected .*float8 is a KV cache dtype only"):
        load_through_stages("tiny-llama", dtype="float8_e4m3fn")
    with pytest.raises(ModelError, match=r"^dtype 'float8_e4m3fn': weights load in float32, float16, bfloat16 only"):
        torch_dtype("float8_e4m3fn")  # the weights' own guard stays for callers that skip the args


def test_safetensors_directory_loads_its_own_weights(tmp_path):
    cfg = load_hf_config(resolve_checkpoint("tiny-qwen3"))
    saved = random_model(cfg, device="cpu", dtype="float32", seed=11)
    saved.save_pretrained(tmp_path / "ckpt")
    result = load_through_stages(str(tmp_path / "ckpt"))
    [event] = result.audit.of("weights_loaded")
    assert event["source"] == "safetensors" and event["seed"] is None
    loaded = result.hf_model.state_dict()
    assert all(torch.equal(v, loaded[k]) for k, v in saved.state_dict().items())


def test_a_directory_without_weights_is_one_clear_line(checkpoint_dir):
    ckpt = checkpoint_dir()
    with pytest.raises(ModelError, match=r"no weights \(\*\.safetensors or pytorch_model\*\.bin\) in the checkpoint"):
        load_through_stages(str(ckpt))


def test_corrupt_weights_are_one_clear_line(tmp_path):
    cfg = load_hf_config(resolve_checkpoint("tiny-llama"))
    random_model(cfg, device="cpu", dtype="float32").save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelError, match="transformers cannot load the weights"):
        load_through_stages(str(tmp_path / "ckpt"))


def test_an_unreadable_weights_file_says_permission_denied(tmp_path, monkeypatch):
    """safetensors reports a file it may not open (mode 000) as "No such file or directory"; the suite runs as
    root, which reads anything, so the load's failure and the denied open are both simulated."""
    import builtins
    import errno

    from transformers import AutoModelForCausalLM

    cfg = load_hf_config(resolve_checkpoint("tiny-llama"))
    random_model(cfg, device="cpu", dtype="float32").save_pretrained(tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"

    def from_pretrained(*args, **kwargs):
        raise FileNotFoundError(f"No such file or directory: {weights}")  # safetensors' words under EACCES

    real_open = builtins.open

    def denying_open(file, *args, **kwargs):
        if str(file) == str(weights):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(builtins, "open", denying_open)
    with pytest.raises(ModelError, match=rf"^{weights}: cannot read the weights \(permission denied\)$"):
        load_through_stages(str(tmp_path / "ckpt"))


def test_an_activation_transformers_lacks_names_the_field_and_the_accepted_ones(tmp_path):
    import json

    cfg = load_hf_config(resolve_checkpoint("tiny-llama"))
    random_model(cfg, device="cpu", dtype="float32").save_pretrained(tmp_path / "ckpt")
    file = tmp_path / "ckpt" / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "hidden_act": "frob"}))
    # was "transformers cannot load the weights: 'frob'" (ACT2FN's KeyError)
    with pytest.raises(ModelError, match=rf"^{file}: hidden_act: 'frob' is not an activation transformers has; "
                                         r"accepted: gelu, .*silu"):
        load_through_stages(str(tmp_path / "ckpt"))


def test_a_non_integer_weights_seed_is_a_config_error():
    with pytest.raises(pipeline.ConfigError, match=r"^weights_seed: expected an integer >= 0, got '3'"):
        load_through_stages("tiny-llama", weights_seed="3")


def test_the_weights_seed_is_an_argument_the_audit_replays():
    result = load_through_stages("tiny-llama", weights_seed=5)
    assert result.args.weights_seed == 5
    assert [e["new"] for e in result.audit.provenance("weights_seed")] == [5]
    assert result.audit.replay() == pipeline.converter.unstructure(result.args)


def _llama_checkpoint(path, *, tied: bool = False):
    """A tiny Llama directory saved by transformers (config.json + model.safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, max_position_embeddings=128,
                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _keep_tensors(path, keep) -> None:
    """Rewrite the directory's model.safetensors with only the tensors ``keep`` accepts."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if keep(k, v)}, path / "model.safetensors", metadata={"format": "pt"})


def test_a_checkpoint_missing_tensors_is_refused_naming_the_file_and_tensors(tmp_path):
    # transformers fills missing tensors with random values and only logs a report; a serving engine
    # refuses to run uninitialised weights, so kvload does too
    ckpt = _llama_checkpoint(tmp_path / "ckpt")
    _keep_tensors(ckpt, lambda k, v: k == "model.embed_tokens.weight")
    with pytest.raises(ModelError, match=r"ckpt: model\.safetensors lacks 20 of the model's tensors \(lm_head\.weight, "
                                         r"model\.layers\.0\.input_layernorm\.weight, .* and 17 more\)") as info:
        load_through_stages(str(ckpt))
    assert "\n" not in str(info.value)


def test_a_tied_lm_head_absent_from_the_file_is_not_missing(tmp_path):
    ckpt = _llama_checkpoint(tmp_path / "ckpt", tied=True)
    _keep_tensors(ckpt, lambda k, v: k != "lm_head.weight")  # save_pretrained already leaves it out
    result = load_through_stages(str(ckpt))
    model = result.hf_model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    result.close()


def test_a_tensor_of_the_wrong_shape_is_one_line_naming_it_and_both_shapes(tmp_path):
    ckpt = _llama_checkpoint(tmp_path / "ckpt")
    from safetensors.torch import load_file, save_file

    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.embed_tokens.weight"] = torch.zeros(7, 3)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"tensor model\.embed_tokens\.weight in model\.safetensors has shape "
                                         r"\[7, 3\], "
                                         r"the model expects \[100, 64\]"):
        load_through_stages(str(ckpt))


@pytest.mark.parametrize("kind", [torch.int32, torch.int8, torch.bool])
def test_a_float_weight_stored_as_integers_is_refused_naming_it_and_its_type(capsys, tmp_path, kind):
    """from_pretrained casts an integer tensor to the model's dtype: a weight whose safetensors header said I32 (its
    float bits read as integers, values near 1e9) loaded and generate printed garbage with exit 0."""
    from safetensors.torch import load_file, save_file

    from tests.cli_support import run_cli

    ckpt = _llama_checkpoint(tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    weight = tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.1.mlp.up_proj.weight"] = (weight * 1000).to(kind)  # same shape, integer storage
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    r = run_cli(capsys, "generate", ckpt, "--prompt-ids", "1,2,3", "--max_new_tokens", "1", "--max_tokens", "256",
                "--max_seq_len", "256")
    stored = {torch.int32: "I32", torch.int8: "I8", torch.bool: "BOOL"}[kind]
    assert (r.code, r.out) == (2, ""), r.err
    assert r.one_error_line, r.err
    assert f"{ckpt}: tensor model.layers.1.mlp.up_proj.weight in model.safetensors is stored as {stored}, the " \
           "model expects floating-point weights (BF16, F16, F32" in r.err


@pytest.mark.parametrize("size", [4_000_000, 10**9])
def test_a_config_json_that_inflates_a_tensor_is_refused_before_it_is_allocated(tmp_path, size):
    """transformers builds the model at config.json's sizes before it compares them with the checkpoint's: an
    intermediate_size of 10**9 over this 128-wide checkpoint asked for 256 GB, 4,000,000 for 6 GB, and the run
    ended on the allocator's refusal (under the memory limit every hostile run gets), never naming the mismatch."""
    import json

    from tests.hostile_support import assert_refused, limited_kvload

    ckpt = _llama_checkpoint(tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "intermediate_size": size}))
    r = limited_kvload("generate", ckpt, "--prompt-ids", "1,2,3", "--max_new_tokens", "2", "--max_tokens", "1024")
    assert_refused(r, f"{ckpt}: tensor model.layers.0.mlp.down_proj.weight in model.safetensors has shape [64, 128], "
                      f"the model expects [64, {size}] (and 5 more); the checkpoint does not match its config.json")


@pytest.mark.parametrize(("text", "words"), [
    ("[1, 2]", "expected a JSON object, got list"),  # transformers called .get on it: "load_weights: AttributeError"
    ('"BananaTokenizer"', "expected a JSON object, got str"),
    ('{"model_max_length": 5, "model_max_length": 6}', "key 'model_max_length' appears twice in one object"),
])
def test_a_tokenizer_config_json_that_is_no_object_is_one_line_naming_it(tmp_path, text, words):
    from tests.hostile_support import assert_refused, limited_kvload

    ckpt = _llama_checkpoint(tmp_path / "ckpt")
    (ckpt / "tokenizer_config.json").write_text(text)
    r = limited_kvload("generate", ckpt, "--prompt-ids", "1,2,3", "--max_new_tokens", "2", "--max_tokens", "1024")
    assert_refused(r, f"{ckpt / 'tokenizer_config.json'}: {words}")


@pytest.mark.parametrize(("files", "needle"), [
    # transformers called .removesuffix on the class name: "load_weights: AttributeError: 'int' object has no ..."
    ({"tokenizer_config.json": '{"tokenizer_class": 5}'},
     "tokenizer_config.json: tokenizer_class: expected a tokenizer class name such as 'PreTrainedTokenizerFast', or "
     "null; got 5"),
    # and .items() on the map: "load_weights: AttributeError: 'list' object has no attribute 'items'"
    ({"tokenizer_config.json": "{}", "special_tokens_map.json": "[1]"},
     "special_tokens_map.json: expected a JSON object, got list"),
], ids=["tokenizer_class", "special_tokens_map"])
def test_a_tokenizer_file_of_the_wrong_shape_is_one_line_naming_it(tmp_path, files, needle):
    from tests.hostile_support import assert_refused, limited_kvload

    ckpt = _llama_checkpoint(tmp_path / "ckpt")
    for name, text in files.items():
        (ckpt / name).write_text(text)
    r = limited_kvload("generate", ckpt, "--prompt-ids", "1,2,3", "--max_new_tokens", "2", "--max_tokens", "1024")
    assert_refused(r, f"{ckpt}/{needle}")


@pytest.mark.parametrize("field", ["rope_scaling", "rope_parameters"])
def test_a_rope_type_transformers_lacks_names_the_field_and_the_accepted_ones(tmp_path, field):
    """transformers logs that it cannot validate the type, then fails on its table of RoPE types: the line was
    "transformers cannot load the weights: 'banana'"."""
    import json

    ckpt = _llama_checkpoint(tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config.pop("rope_parameters", None)
    (ckpt / "config.json").write_text(json.dumps({**config, field: {"rope_type": "banana", "factor": 2.0}}))
    with pytest.raises(ModelError) as info:
        load_through_stages(str(ckpt))
    assert str(info.value) == (f"{ckpt}/config.json: {field}.rope_type: 'banana' is not a RoPE type transformers has; "
                               "accepted: default, dynamic, linear, llama3, longrope, proportional, yarn")


def test_the_cli_refuses_a_bad_checkpoint_in_one_line_without_transformers_report(tmp_path):
    # transformers logs an 18-line ANSI LOAD REPORT at warning level; the user sees kvload's one line only
    import os
    import subprocess
    import sys
    from pathlib import Path

    ckpt = _llama_checkpoint(tmp_path / "ckpt")
    _keep_tensors(ckpt, lambda k, v: k == "model.embed_tokens.weight")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "warning",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-m", "kvload", "generate", str(ckpt), "--prompt-ids", "1,2,3",
                        "--max_new_tokens", "2", "--max_tokens", "1024"], capture_output=True, text=True, env=env,
                       timeout=180)
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "lacks 20 of the model's tensors" in r.stderr and "LOAD REPORT" not in r.stderr


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_a_weights_file_that_is_a_fifo_is_one_line_not_a_hang(tmp_path, name):
    # safetensors and torch open it and wait for a writer that never comes: kvload generate hung until killed
    import subprocess
    import sys
    from pathlib import Path

    ckpt = _llama_checkpoint(tmp_path / "ckpt")
    (ckpt / "model.safetensors").unlink()
    os.mkfifo(ckpt / name)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-m", "kvload", "generate", str(ckpt), "--prompt-ids", "1,2,3",
                        "--max_new_tokens", "2", "--max_tokens", "1024"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr == (f"error: {ckpt / name}: not a regular file (a FIFO or device?), expected a weights file "
                        "(safetensors or a torch .bin)\n")


@pytest.mark.parametrize(("make", "words"), [
    (lambda p: p.mkdir(), "is a directory, expected a weights file (safetensors or a torch .bin)"),
    (lambda p: p.symlink_to(p), "cannot read (Too many levels of symbolic links)"),
    (lambda p: p.symlink_to(p.parent / "gone.safetensors"), "is a symbolic link to nothing; expected a weights file "
                                                                  "(safetensors or a torch .bin)"),
])
def test_a_weights_file_that_is_no_file_names_it(tmp_path, make, words):
    ckpt = _llama_checkpoint(tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    weights.unlink()
    make(weights)
    with pytest.raises(ModelError) as info:
        load_through_stages(str(ckpt))
    assert str(info.value) == f"{weights}: {words}"


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3", "tiny-deepseek-v3"])
def test_a_float8_kv_cache_generates_on_the_cpu_in_a_quarter_of_the_float32_pools(preset):
    # full, sliding and MLA latent layers: the pools hold float8 and a step writes and reads them
    from kvload.api import load

    sizes = {}
    for dtype in ("fp8", "float32"):
        with load(preset, load_weights=True, device="cpu", kv_cache_config={"dtype": dtype, "max_tokens": 512},
                  log=False) as result:
            assert {t.dtype for t in result.kv_manager.pools.tensors.values()} == (
                {torch.float8_e4m3fn} if dtype == "fp8" else {torch.float32})
            [out] = result.generate([[1, 2, 3, 4, 5, 6, 7]], max_new_tokens=5, ignore_eos=True)
            assert len(out.token_ids) == 5
            sizes[dtype] = result.kv_manager.pools.nbytes
    assert sizes["fp8"] * 4 == sizes["float32"]


def test_a_float8_kv_cache_still_plans_on_the_cpu():
    result = load_through_stages("tiny-llama", load_weights=False, device="cpu", kv_cache_config={"dtype": "fp8"})
    assert result.args.kv_cache_config.dtype == "float8_e4m3fn"


def test_generate_with_a_float8_kv_cache_on_the_cpu_runs(capsys):
    from tests.cli_support import run_cli

    r = run_cli(capsys, "generate", "tiny-llama", "--prompt-ids", "1,2,3", "--max_new_tokens", "4", "--device", "cpu",
                "--kv_cache_dtype", "fp8", "--ignore_eos")
    assert r.code == 0, r.err
    assert len(r.out.splitlines()[0].split()) == 4  # the generated token ids


def test_a_weights_seed_for_a_checkpoint_with_weights_says_it_is_ignored(tmp_path):
    ckpt = _llama_checkpoint(tmp_path / "ckpt")
    result = load_through_stages(str(ckpt), weights_seed=5)
    [ignored] = [e for e in result.audit.of("setting_ignored") if e["field"] == "weights_seed"]
    assert ignored["value"] == 5 and "the weights come from the checkpoint (safetensors at" in ignored["reason"]
    assert result.audit.of("weights_loaded")[0]["seed"] is None
    result.close()
    preset = load_through_stages("tiny-llama", weights_seed=5)  # a preset uses it: nothing to report
    assert not [e for e in preset.audit.of("setting_ignored") if e["field"] == "weights_seed"]
    preset.close()


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_cuda_device_that_is_not_there_is_refused_before_weights_load(capsys, command):
    """As `run` refuses it (the pools' check), not as torch's AssertionError from inside load_weights."""
    from tests.cli_support import run_cli

    extra = ("--prompt-ids", "1,2,3") if command == "generate" else ("--port", "0")
    r = run_cli(capsys, command, "tiny-llama", *extra, "--device", "cuda:99", "--max_tokens", "1024")
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith("error: device=cuda:99: "), r.err  # none at all, or not that many
    assert "load_weights" not in r.err and "Error" not in r.err


@pytest.mark.parametrize(("value", "dtype", "words"), [
    (float("nan"), "float32", "holds NaN or infinite values in float32; a damaged file: every logit would be NaN"),
    (float("-inf"), "float32", "holds NaN or infinite values in float32; a damaged file"),
    # finite in the file, past float16's 65,504 once cast: the same NaN logits
    (1e6, "float16", "holds NaN or infinite values in float16; values past float16's range (try --dtype float32 or "
                     "bfloat16) or a damaged file"),
], ids=["nan", "minus-infinity", "past-float16"])
def test_a_weight_that_is_not_finite_is_refused_naming_the_tensor(capsys, tmp_path, value, dtype, words):
    """A NaN weight made every logit NaN: generate wrote token 0 over and over, exit 0."""
    from tests.cli_support import run_cli
    from tests.hostile_support import assert_refused

    ckpt = _llama_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()

    def poison(key, tensor) -> bool:
        if key == "model.norm.weight":
            tensor.view(-1)[5] = value
        return True  # every tensor stays

    _keep_tensors(ckpt, poison)
    r = run_cli(capsys, "generate", ckpt, "--prompt-ids", "1,2,3", "--max_new_tokens", "2", "--max_tokens", "1024",
                "--dtype", dtype, "--audit-log", out / "a.jsonl")
    assert_refused(r, f"{ckpt}: tensor model.norm.weight in model.safetensors {words}", folder=out)


@pytest.mark.parametrize(("name", "make", "words"), [
    # a FIFO or a directory in its place read as no tokenizer at all: "prompt 1 is text, but ... has no tokenizer"
    ("tokenizer.json", lambda f: os.mkfifo(f), "not a regular file (a FIFO or device?), expected a tokenizer file"),
    ("tokenizer.json", lambda f: f.mkdir(), "is a directory, expected a tokenizer file"),
    # transformers' words named the folder: "cannot load the tokenizer: Expecting ',' delimiter: line 1 column 43"
    ("tokenizer.json", lambda f: f.write_text('{"version": "1.0", "model": {"type": "BPE"'),
     "malformed JSON at line 1 column 43: Expecting ',' delimiter"),
    ("tokenizer.json", lambda f: f.write_bytes(b'{"version": "\xff"}'), "not UTF-8 (byte 0xff at offset 13)"),
    # JSON, but no tokenizer the tokenizers library knows: its bare Exception was "load_weights: Exception: data did
    # not match any variant of untagged enum ModelUntagged at line 1 column 66", naming no file
    ("tokenizer.json", lambda f: f.write_text('{"version": "1.0", "added_tokens": [], "model": {"type": "Bogus"}}'),
     "the tokenizers library cannot read it as a tokenizer: data did not match any variant"),
    # an object without a model: "<folder>: transformers cannot load the tokenizer: 'added_tokens'", no file named
    ("tokenizer.json", lambda f: f.write_text("{}"), "no 'model' key: a tokenizer.json of the tokenizers library"),
    # transformers read a FIFO there as an empty template: "Can't compile non template nodes"
    ("chat_template.jinja", lambda f: os.mkfifo(f), "not a regular file (a FIFO or device?)"),
], ids=["fifo", "directory", "truncated", "not-utf8", "not-a-tokenizer", "empty-object", "chat-template-fifo"])
def test_a_tokenizer_json_that_cannot_be_read_is_named(capsys, tmp_path, name, make, words):
    from tests.cli_support import run_cli
    from tests.hostile_support import assert_refused

    ckpt = _llama_checkpoint(tmp_path / "ckpt")
    if name != "tokenizer.json":  # a tokenizer for the template to belong to
        _tokenizer_json(ckpt / "tokenizer.json")
    make(ckpt / name)
    out = tmp_path / "out"
    out.mkdir()
    r = run_cli(capsys, "generate", ckpt, "--prompt", "hi", "--max_new_tokens", "2", "--max_tokens", "1024",
                "--audit-log", out / "a.jsonl")
    assert_refused(r, f"{ckpt}/{name}: {words}", folder=out)


def test_a_pad_token_id_past_the_vocabulary_is_one_line_naming_it(capsys, tmp_path):
    """transformers makes ``pad_token_id`` the embedding's padding index: one past the vocabulary failed generate as
    "transformers cannot load the weights: Padding_idx must be within num_embeddings" behind transformers' own
    warning line, naming neither config.json nor the field; plan went through."""
    from tests.cli_support import run_cli
    from tests.hostile_support import assert_refused

    ckpt = _llama_checkpoint(tmp_path / "ckpt")  # vocab_size 100
    config = json.loads((ckpt / "config.json").read_text())
    out = tmp_path / "out"
    out.mkdir()
    for pad in (100, -101):
        (ckpt / "config.json").write_text(json.dumps({**config, "pad_token_id": pad}))
        for command in (("generate", "--prompt-ids", "1,2,3", "--max_new_tokens", "2"), ("plan",)):
            r = run_cli(capsys, command[0], ckpt, *command[1:], "--max_tokens", "1024", "--audit-log", out / "a.jsonl")
            assert_refused(r, f"{ckpt}/config.json: pad_token_id: token id {pad} is not in the vocabulary; accepted: "
                              "an integer in [0, 99] (vocab_size 100; a negative one counts from the end) or null",
                           folder=out)
    (ckpt / "config.json").write_text(json.dumps({**config, "pad_token_id": -1}))  # old LLaMA conversions: it loads
    r = run_cli(capsys, "generate", ckpt, "--prompt-ids", "1,2,3", "--max_new_tokens", "2", "--max_tokens", "1024")
    assert r.code == 0, r.err


def test_a_pad_token_id_past_the_vocabulary_is_taken_where_the_model_pads_no_embedding(tmp_path):
    """GPT-NeoX (like GPT-2, Falcon, Bloom, MPT) reads ``pad_token_id`` only in heads kvload never builds: transformers
    loads it with an id past the vocabulary. Registered through ``register_model``, such a family was refused for it
    by plan and load alike; a Llama, whose embedding pads with it, still is."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from models import ModelSpec, register_model, unregister_model

    @register_model("GPTNeoXForCausalLM")
    class NeoxSpec(ModelSpec):
        """A user's family over transformers' GPT-NeoX."""

    cfg = GPTNeoXConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=128, pad_token_id=100)
    torch.manual_seed(0)
    GPTNeoXForCausalLM(cfg).save_pretrained(tmp_path / "neox")
    try:
        assert json.loads((tmp_path / "neox" / "config.json").read_text())["pad_token_id"] == 100
        pipeline.plan(str(tmp_path / "neox"), log=False, kv_cache_config={"max_tokens": 256})
        with pipeline.load(str(tmp_path / "neox"), load_weights=True, log=False,
                           kv_cache_config={"max_tokens": 256}) as result:
            assert result.hf_model.config.pad_token_id == 100
    finally:
        unregister_model("GPTNeoXForCausalLM")


def test_a_checkpoint_chat_template_with_a_syntax_error_is_named_as_one(capsys, tmp_path):
    """A chat_template.jinja that does not parse read "the model's chat template refused the conversation: unexpected
    '}'": the conversation was blamed for a broken template. Prompts without --chat still generate."""
    from tests.cli_support import run_cli
    from tests.hostile_support import assert_refused

    ckpt = _llama_checkpoint(tmp_path / "ckpt")
    _tokenizer_json(ckpt / "tokenizer.json")
    (ckpt / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    argv = ("generate", ckpt, "--prompt", "hi", "--max_new_tokens", "2", "--max_tokens", "1024")
    assert_refused(run_cli(capsys, *argv, "--chat"), "error: generate: prompt 0 (--prompt): the model's chat template "
                                                     "is not a Jinja template: line 1: unexpected '}'")
    r = run_cli(capsys, *argv)
    assert r.code == 0, r.err


def _tokenizer_json(file) -> None:
    """A minimal word-level tokenizer.json (the tokenizers library's own format)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(file))


@pytest.mark.parametrize(("text", "words"), [
    # transformers' words, naming the folder: "cannot load the weights: 'list' object has no attribute 'values'"
    ('{"weight_map": [1]}', "weight_map: expected an object of tensor name to shard file name, got [1]"),
    ('{"weight_map": {"lm_head.weight": 5}}', "weight_map.lm_head.weight: expected a shard file name, got 5"),
    ("{not json", "malformed JSON at line 1 column 2"),
    ('{"metadata": {}}', "weight_map: expected an object of tensor name to shard file name, got null"),
], ids=["list", "number", "malformed", "absent"])
def test_a_shard_index_of_the_wrong_shape_is_named(capsys, tmp_path, text, words):
    from tests.cli_support import run_cli
    from tests.hostile_support import assert_refused

    ckpt = tmp_path / "ckpt"
    cfg = load_hf_config(resolve_checkpoint("tiny-llama"))
    random_model(cfg, device="cpu", dtype="float32").save_pretrained(ckpt, max_shard_size="100KB")
    (ckpt / "model.safetensors.index.json").write_text(text)
    out = tmp_path / "out"
    out.mkdir()
    r = run_cli(capsys, "generate", ckpt, "--prompt-ids", "1,2", "--max_new_tokens", "1", "--audit-log",
                out / "a.jsonl")
    assert_refused(r, f"{ckpt / 'model.safetensors.index.json'}: {words}", folder=out)


@pytest.mark.parametrize(("quant", "words"), [
    # transformers warns "Unknown quantization type ... we will skip the quantization", a warning the quiet load hides
    ({"quant_method": "banana"}, "quantization_config.quant_method: 'banana' is not a quantization transformers has; "
                                 "accepted: "),
    ({"bits": 4}, "quantization_config.quant_method: null is not a quantization transformers has"),
    ("fp8", "quantization_config: expected an object with a quant_method, got 'fp8'"),
], ids=["unknown-method", "no-method", "not-an-object"])
def test_a_quantization_config_transformers_would_skip_is_refused(capsys, tmp_path, quant, words):
    import json

    from tests.cli_support import run_cli
    from tests.hostile_support import assert_refused

    ckpt = _llama_checkpoint(tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    out = tmp_path / "out"
    out.mkdir()
    r = run_cli(capsys, "generate", ckpt, "--prompt-ids", "1,2", "--max_new_tokens", "1", "--max_tokens", "1024",
                "--audit-log", out / "a.jsonl")
    assert_refused(r, f"{ckpt}/config.json: {words}", folder=out)


def test_rank_0_leaves_no_shared_weights_folder_when_the_ranks_part_before_it_is_shared(tmp_path, monkeypatch):
    """Tensor parallel over a preset: rank 0 saves random weights to a temporary folder, then sends its path to the
    other ranks. A rank lost then (``tp_fault_sweep.py``'s ``llm.kill1_loading``: rank 1 killed 2 s in) raised out of
    that send, before the ``try`` that removes the folder: the model's files stayed in ``TMPDIR``."""
    import tempfile
    from types import SimpleNamespace

    import stages.load_weights as lw
    from pipeline.errors import RankLostError

    def broadcast(value):
        raise RankLostError("rank 1 (pid 1) was killed by SIGKILL")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(lw, "save_random_model", lambda config, folder, **_: (folder / "config.json").write_text("{}"))
    ranks = SimpleNamespace(distributed=True, is_first=True, broadcast=broadcast, barrier=lambda: None)
    ctx = SimpleNamespace(ranks=ranks, args=SimpleNamespace(tensor_parallel_size=2),
                          checkpoint=SimpleNamespace(kind="preset"), hf_config=None)
    with pytest.raises(RankLostError), lw._shared_weights(ctx, "float32", 0):
        pass
    assert list(tmp_path.iterdir()) == []
