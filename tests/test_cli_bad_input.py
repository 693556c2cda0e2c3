"""The bad-input corpus: each case exits with its code, prints one stderr line naming the culprit,
prints nothing on stdout, and writes nothing (no audit file, no temporary, inputs untouched)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest

from tests.cli_support import kvload, run_cli
from tests.conftest import llama_config

AUDIT_HEADER = '{"event":"audit_header","kvload_version":"0.1.0","schema_version":1}\n'


def _inputs() -> dict[str, str | bytes | None]:
    """Relative path → file content (None: an empty directory)."""
    llama = llama_config()
    return {
        "empty-dir": None,
        "weights.bin": b"\x00\x01",
        "bad.yaml": "kv_cache_config: [1\n",
        "list.yaml": "- max_batch_size: 4\n",
        "typo.yaml": "kv_cache_config:\n  tokens_per_blok: 4\n",
        "top-typo.yaml": "max_batchsize: 4\n",
        "yes.yaml": "kv_cache_config:\n  enable_block_reuse: yes\n",
        "tri.yaml": "kv_cache_config:\n  use_kv_cache_manager_v2: on\n",
        "scalar-kv.yaml": "kv_cache_config: 5\n",
        "latin1.yaml": b"dtype: \xe9\n",
        "ckpt-malformed/config.json": '{"model_type": "llama",\n',
        "ckpt-array/config.json": "[1, 2]\n",
        "ckpt-no-type/config.json": json.dumps({"architectures": ["LlamaForCausalLM"]}),
        "ckpt-arch-str/config.json": json.dumps({"model_type": "llama", "architectures": "LlamaForCausalLM"}),
        "ckpt-unknown-type/config.json": json.dumps({"model_type": "frobnicator",
                                                     "architectures": ["FrobForCausalLM"]}),
        "ckpt-linear/config.json": json.dumps({**llama, "architectures": ["HybridForCausalLM"],
                                               "layer_types": ["linear_attention", "full_attention"]}),
        "ckpt-no-layers/config.json": json.dumps({**llama, "architectures": ["OddForCausalLM"],
                                                  "num_hidden_layers": 0}),
        "ckpt-heads/config.json": json.dumps({**llama, "num_key_value_heads": 3}),
        "audit/empty.jsonl": "",
        "audit/blank.jsonl": "\n \n\n",
        "audit/truncated.jsonl": AUDIT_HEADER + '{"event":"stage_started","stage":"parse_args","se',
        "audit/middle.jsonl": AUDIT_HEADER + "{not json}\n" + '{"event":"stage_started","seq":0}\n',
        "audit/no-header.jsonl": '{"event":"stage_started","stage":"parse_args","seq":0}\n',
        "audit/schema.jsonl": '{"event":"audit_header","kvload_version":"9.0","schema_version":99}\n',
        "audit/array.jsonl": AUDIT_HEADER + "[1, 2]\n",
        "audit/fieldless.jsonl": AUDIT_HEADER + '{"event":"auto_resolved","stage":"resolve_auto","seq":0,"new":1}\n',
        "audit/binary.jsonl": b"\xff\xfe\x00garbage",
        "audit/ok.jsonl": None,  # filled by a real plan in the fixture
    }


#: (id, argv, exit code, substrings the one stderr line must contain). {in} is the inputs folder.
CASES = [
    # flags
    ("tri-state-yes", "plan tiny-llama --use_kv_cache_manager_v2 yes", 2,
     ["error: --use_kv_cache_manager_v2: expected auto, true or false, got 'yes'"]),
    ("tri-state-1", "plan tiny-llama --use-kv-cache-manager-v2 1", 2, ["error: --use-kv-cache-manager-v2:", "'1'"]),
    ("dashed-as-typed", "plan tiny-llama --max-tokens -5", 2, ["error: --max-tokens: expected", "got -5"]),
    ("dtype-as-typed", "plan tiny-llama --dtype=fp8", 2, ["error: --dtype: expected", "got 'fp8'"]),
    ("dtype-float8", "plan tiny-llama --dtype float8", 2,  # names where float8 goes and a spelling it takes there
     ["--dtype", "KV cache dtype only", "--kv_cache_dtype", "fp8", "got 'float8'"]),
    ("fraction-zero", "plan tiny-llama --kv_cache_fraction 0", 2, ["--kv_cache_fraction", "(0, 1]"]),
    ("fraction-big", "plan tiny-llama --kv-cache-fraction 1.5", 2, ["--kv-cache-fraction", "(0, 1]", "1.5"]),
    ("fraction-word", "plan tiny-llama --kv_cache_fraction half", 2, ["--kv_cache_fraction", "'half'"]),
    # the value as typed, not as float() made it ("got 2.0"), as --top_p and --min_p word theirs
    ("fraction-as-typed", "run tiny-llama --kv_cache_fraction 2", 2,
     ["error: --kv_cache_fraction: expected a number in (0, 1], got '2'\n"]),
    ("fraction-as-typed-eq", "plan tiny-llama --kv-cache-free-gpu-mem-fraction=0e3", 2,
     ["error: --kv-cache-free-gpu-mem-fraction: expected a number in (0, 1], got '0e3'\n"]),
    ("max-tokens-negative", "plan tiny-llama --max_tokens -5", 2, ["--max_tokens", ">= 1"]),
    ("max-tokens-unit", "plan tiny-llama --max_tokens 4k", 2, ["--max_tokens", "an integer", "'4k'"]),
    ("bytes-unit", "plan tiny-llama --max_gpu_total_bytes 8XB", 2, ["--max_gpu_total_bytes", "8GiB", "'8XB'"]),
    ("host-negative", "plan tiny-llama --host_cache_size -1", 2, ["--host_cache_size", "byte count"]),
    ("bytes-fraction", "plan tiny-llama --max_gpu_total_bytes 1.00000001KiB", 2,
     ["--max_gpu_total_bytes", "in whole bytes", "1.5KiB (= 1536)", "'1.00000001KiB'"]),
    ("block-zero", "plan tiny-llama --tokens_per_block 0", 2, ["--tokens_per_block", ">= 1, got 0"]),
    ("dtype", "plan tiny-llama --dtype int3", 2, ["--dtype", "bfloat16", "'int3'"]),
    ("kv-dtype", "plan tiny-llama --kv_cache_dtype int8", 2, ["--kv_cache_dtype", "float8_e4m3fn", "'int8'"]),
    ("device", "plan tiny-llama --device tpu", 2, ["--device", "'tpu'", "\"cpu\"", "\"cuda:N\""]),
    ("batch-zero", "plan tiny-llama --max_batch_size 0", 2, ["--max_batch_size", ">= 1"]),
    ("seq-len-word", "plan tiny-llama --max_seq_len long", 2, ["--max_seq_len", "'long'"]),
    ("num-tokens-zero", "plan tiny-llama --max_num_tokens 0", 2, ["--max_num_tokens", ">= 1"]),
    ("beam-zero", "plan tiny-llama --max_beam_width 0", 2, ["--max_beam_width", ">= 1"]),
    ("flag-typo", "plan tiny-llama --use_kv_cache_manger_v2 true", 2,
     ["--use_kv_cache_manger_v2", "did you mean --use_kv_cache_manager_v2?"]),
    ("switch-with-value", "plan tiny-llama --disable_kv_cache_reuse true", 2, ["unrecognized arguments: true"]),
    ("no-model", "plan", 2, ["MODEL"]),
    ("no-command", "", 2, ["COMMAND"]),
    ("bad-command", "load tiny-llama", 2, ["COMMAND", "'load'", "plan"]),
    ("audit-log-is-dir", "plan tiny-llama --audit-log {in}/empty-dir", 2, ["--audit-log", "is a directory"]),
    ("audit-log-no-dir", "plan tiny-llama --audit-log {in}/missing/a.jsonl", 2, ["--audit-log", "does not exist"]),
    # routes
    ("v4-false", "plan tiny-deepseek-v4 --use_kv_cache_manager_v2 false", 2,
     ["use_kv_cache_manager_v2=false (set by the user via cli)", "compressed", "set it to true"]),
    ("v2-beams", "plan tiny-llama --use_kv_cache_manager_v2 true --max_beam_width 2", 2,
     ["use_kv_cache_manager_v2=true", "max_beam_width=2", "beam"]),
    ("v4-beams", "plan tiny-deepseek-v4 --max_beam_width 2", 2, ["max_beam_width=2", "set max_beam_width to 1"]),
    # YAML
    ("yaml-missing", "plan tiny-llama --config {in}/nope.yaml", 2, ["config file", "nope.yaml", "not found"]),
    ("yaml-dir", "plan tiny-llama --config {in}/empty-dir", 2, ["config file", "is a directory"]),
    ("yaml-malformed", "plan tiny-llama --config {in}/bad.yaml", 2, ["bad.yaml", "line 2", "malformed YAML"]),
    ("yaml-list", "plan tiny-llama --config {in}/list.yaml", 2, ["list.yaml", "expected a mapping", "got list"]),
    ("yaml-typo", "plan tiny-llama --config {in}/typo.yaml", 2,
     ["typo.yaml", "kv_cache_config.tokens_per_blok", "did you mean 'tokens_per_block'?"]),
    ("yaml-top-typo", "plan tiny-llama --config {in}/top-typo.yaml", 2,
     ["top-typo.yaml", "max_batchsize", "did you mean 'max_batch_size'?"]),
    ("yaml-bool-yes", "plan tiny-llama --config {in}/yes.yaml", 2,
     ["yes.yaml", "kv_cache_config.enable_block_reuse", "expected true or false, got 'yes'"]),
    ("yaml-tri-on", "plan tiny-llama --config {in}/tri.yaml", 2,
     ["tri.yaml", "kv_cache_config.use_kv_cache_manager_v2", "'on'"]),
    ("yaml-scalar-section", "plan tiny-llama --config {in}/scalar-kv.yaml", 2,
     ["scalar-kv.yaml", "kv_cache_config", "mapping"]),
    ("yaml-not-utf8", "plan tiny-llama --config {in}/latin1.yaml", 2,
     ["latin1.yaml", "not UTF-8", "a YAML config is UTF-8 text"]),
    # model / config.json
    ("unknown-preset", "plan tiny-llama3", 2,
     ["'tiny-llama3'", "not a preset", "tiny-deepseek-v4, tiny-gemma3, tiny-llama"]),
    # a preset nearly spelt: the list alone left it to the user to spot, and a name shaped like a Hugging Face id was
    # told to `hf download` the typo
    ("preset-typo", "plan tiny-lama", 2, ["'tiny-lama': not a preset or a directory; did you mean 'tiny-llama'?"]),
    ("preset-case-underscore", "run Tiny_Llama", 2, ["did you mean 'tiny-llama'?"]),
    ("packaged-short", "generate smollm2 --prompt hi", 2, ["'smollm2'", "did you mean 'smollm2-135m'?"]),
    ("missing-dir", "plan {in}/no-such-ckpt", 2, ["no-such-ckpt", "no such directory"]),
    # ~user with no such user: Path.expanduser raised RuntimeError ("apply_model_defaults: RuntimeError: Could not
    # determine home directory."); a shell leaves it as it is, and so does kvload
    ("tilde-no-user", "plan ~no_such_user_kvload/ckpt", 2, ["model '~no_such_user_kvload/ckpt': no such directory"]),
    ("dir-without-config", "plan {in}/empty-dir", 2, ["empty-dir", "no config.json"]),
    ("model-is-file", "plan {in}/weights.bin", 2, ["weights.bin", "is a file"]),
    ("config-malformed", "plan {in}/ckpt-malformed", 2, ["ckpt-malformed/config.json", "malformed JSON", "line 2"]),
    ("config-array", "plan {in}/ckpt-array", 2, ["ckpt-array/config.json", "expected a JSON object"]),
    ("config-no-type", "plan {in}/ckpt-no-type", 2, ["ckpt-no-type/config.json", "model_type"]),
    ("config-arch-str", "plan {in}/ckpt-arch-str", 2, ["ckpt-arch-str/config.json", "'architectures'"]),
    ("config-unknown-type", "plan {in}/ckpt-unknown-type", 2,
     ["ckpt-unknown-type/config.json", "model_type 'frobnicator'"]),
    ("config-linear-attention", "plan {in}/ckpt-linear", 2,
     ["ckpt-linear/config.json", "HybridForCausalLM", "linear_attention", "no registered spec"]),
    ("config-no-layers", "plan {in}/ckpt-no-layers", 2,
     ["ckpt-no-layers/config.json", "num_hidden_layers", "an integer in [1, 16,384], got 0"]),
    ("config-heads-not-grouped", "plan {in}/ckpt-heads", 2,
     ["ckpt-heads/config.json: num_attention_heads (4) is not a multiple of num_key_value_heads (3)"]),
    # audit files
    ("audit-missing", "audit {in}/audit/none.jsonl", 2, ["none.jsonl", "not found"]),
    ("audit-dir", "explain {in}/empty-dir", 2, ["empty-dir", "is a directory"]),
    ("audit-empty", "audit {in}/audit/empty.jsonl --verify", 2, ["empty.jsonl", "empty file"]),
    ("audit-blank-lines", "audit {in}/audit/blank.jsonl --verify", 2, ["blank.jsonl", "empty file"]),
    ("explain-blank-lines", "explain {in}/audit/blank.jsonl", 2, ["blank.jsonl", "empty file"]),
    ("audit-truncated", "explain {in}/audit/truncated.jsonl", 2, ["truncated.jsonl", "line 2", "truncated"]),
    ("audit-bad-line", "audit {in}/audit/middle.jsonl", 2, ["middle.jsonl", "line 2", "not JSON"]),
    ("audit-no-header", "audit {in}/audit/no-header.jsonl", 2, ["no-header.jsonl", "not a kvload audit log"]),
    ("audit-schema", "audit {in}/audit/schema.jsonl --verify", 2,
     ["schema.jsonl", "schema_version 99", "reads 1"]),
    ("audit-array", "explain {in}/audit/array.jsonl", 2, ["array.jsonl", "line 2", "JSON object"]),
    ("audit-fieldless", "audit {in}/audit/fieldless.jsonl", 2, ["fieldless.jsonl", "auto_resolved", "'field'"]),
    ("audit-binary", "audit {in}/audit/binary.jsonl", 2, ["binary.jsonl", "line 1: not UTF-8"]),
    ("audit-no-file-arg", "audit --verify", 2, ["AUDIT.jsonl"]),
    ("explain-unknown-field", "explain {in}/audit/ok.jsonl tokens_per_blok", 2,
     ["'tokens_per_blok'", "did you mean 'tokens_per_block'?"]),
    ("explain-leaf-typo", "explain {in}/audit/ok.jsonl max_token", 2, ["'max_token'", "did you mean"]),
]


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("inputs")
    for rel, content in _inputs().items():
        path = root / rel
        if content is None and not rel.endswith(".jsonl"):
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
    from pipeline import plan

    plan("tiny-llama", audit_log=root / "audit/ok.jsonl", log=False)
    return root


def test_corpus_is_big_enough():
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("argv", "code", "needles"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(capsys, inputs, tmp_path, argv, code, needles):
    words = argv.format(**{"in": inputs}).split()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    if words and words[0] == "plan" and "--audit-log" not in words:
        words += ["--audit-log", str(out_dir / "run.jsonl")]
    before = _digest(inputs)
    r = run_cli(capsys, *words)
    assert r.code == code, r.err
    assert r.one_error_line, r.err
    for needle in needles:
        assert needle in r.err, (needle, r.err)
    assert r.out == ""
    assert list(out_dir.iterdir()) == []  # no audit file, no temporary beside it
    assert _digest(inputs) == before  # nothing touched, nothing created among the inputs


# The same promise through a real process (real stderr, real exit status), one case per kind of input.
SUBPROCESS_CASES = ["tri-state-yes", "yaml-bool-yes", "config-linear-attention", "audit-truncated", "flag-typo"]


@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_bad_input_through_a_process(inputs, tmp_path, case):
    _, argv, code, needles = next(c for c in CASES if c[0] == case)
    words = argv.format(**{"in": inputs}).split()
    if words[0] == "plan":
        words += ["--audit-log", str(tmp_path / "run.jsonl")]
    r = kvload(*words)
    assert r.code == code and r.one_error_line and r.out == "", r.err
    assert all(n in r.err for n in needles), r.err
    assert list(tmp_path.iterdir()) == []


def test_debug_adds_the_traceback_and_keeps_the_exit_status(capsys, inputs):
    r = run_cli(capsys, "plan", f"{inputs}/ckpt-malformed", "--debug")
    assert r.code == 2 and r.out == ""
    assert "Traceback" in r.err and "ModelError" in r.err
    assert r.err.splitlines()[-1].startswith("error: ") and "malformed JSON" in r.err.splitlines()[-1]


# An empty path value (`--audit-log ''`) cannot live in CASES (split on spaces). It was quoted as ".":
# `--audit-log .: is a directory`, `.: is a directory` for explain/audit, `--chart : cannot draw ...`.
EMPTY_PATH_CASES = [
    ("config", ["plan", "tiny-llama", "--config", ""], ["config file: empty path"]),
    ("plan-audit-log", ["plan", "tiny-llama", "--audit-log", ""], ["--audit-log: empty path", "file path"]),
    ("run-audit-log", ["run", "tiny-llama", "--audit-log", ""], ["--audit-log: empty path"]),
    ("generate-audit-log", ["generate", "tiny-llama", "--prompt-ids", "1,2", "--audit-log", ""],
     ["--audit-log: empty path"]),
    ("serve-audit-log", ["serve", "tiny-llama", "--port", "0", "--audit-log", ""], ["--audit-log: empty path"]),
    ("serve-kv-events-file", ["serve", "tiny-llama", "--port", "0", "--event_buffer_max_size", "10",
                              "--kv-events-file", ""], ["--kv-events-file: empty path"]),
    ("chart", ["plan", "tiny-llama", "--compare", "--chart", ""], ["--chart: empty path", ".png"]),
    ("explain", ["explain", ""], ["audit file: empty path", ".jsonl"]),
    ("audit", ["audit", "", "--verify"], ["audit file: empty path", ".jsonl"]),
]


@pytest.mark.parametrize(("argv", "needles"), [c[1:] for c in EMPTY_PATH_CASES], ids=[c[0] for c in EMPTY_PATH_CASES])
def test_an_empty_path_is_named_as_empty(capsys, tmp_path, monkeypatch, argv, needles):
    monkeypatch.chdir(tmp_path)  # an empty path must not turn into the working directory, nor write into it
    r = run_cli(capsys, *argv)
    assert r.code == 2 and r.one_error_line and r.out == "", r.err
    for needle in needles:
        assert needle in r.err, (needle, r.err)
    assert "error: ." not in r.err and " .:" not in r.err, r.err
    assert list(tmp_path.iterdir()) == []


def test_the_kv_cache_dtype_spelling_the_dtype_error_names_is_accepted(capsys):
    r = run_cli(capsys, "plan", "tiny-llama", "--dtype", "float8")
    assert r.code == 2 and "--kv_cache_dtype, as fp8" in r.err
    ok = run_cli(capsys, "plan", "tiny-llama", "--kv_cache_dtype", "fp8", "--json")
    assert ok.code == 0, ok.err
    assert ok.json()["args"]["kv_cache_config"]["dtype"] == "float8_e4m3fn"


class _FullDisk:
    """A text file on a disk that fills after ``room`` characters: a write past it raises ENOSPC."""

    def __init__(self, real, room: int) -> None:
        self._real, self._room = real, room

    def write(self, text: str) -> int:
        if len(text) > self._room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= len(text)
        return self._real.write(text)

    def close(self) -> None:
        self._real.close()


@pytest.mark.parametrize("room", [0, 2000], ids=["at-once", "mid-run"])
def test_a_full_disk_under_the_audit_log_names_the_flag_and_leaves_nothing(capsys, tmp_path, monkeypatch, room):
    import pipeline.audit

    real_fdopen = os.fdopen

    def fdopen(fd, mode="r", *args, **kwargs):  # only the log's writes: the run also reads files through os.fdopen
        f = real_fdopen(fd, mode, *args, **kwargs)
        return _FullDisk(f, room) if mode.startswith(("w", "a")) else f

    monkeypatch.setattr(pipeline.audit.os, "fdopen", fdopen)
    target = tmp_path / "a.jsonl"
    r = run_cli(capsys, "generate", "tiny-llama", "--prompt-ids", "1,2", "--max_tokens", "1024",
                "--max_new_tokens", "2", "--audit-log", target)
    assert r.code == 1 and "Traceback" not in r.err, r.err
    (line,) = [x for x in r.err.splitlines() if x.startswith("error: ")]
    assert line == f"error: --audit-log {target}: cannot write it (No space left on device); nothing was written"
    assert list(tmp_path.iterdir()) == []  # neither the log nor its temporary


def test_an_audit_log_past_the_file_size_limit_names_the_flag_in_a_real_process(tmp_path):
    """The kernel refusing the write (RLIMIT_FSIZE, as a full disk or a quota does), in a real process."""
    import resource
    import subprocess
    import sys

    from tests.cli_support import ENV, REPO

    def small_files() -> None:  # Python ignores SIGXFSZ: a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    target = tmp_path / "a.jsonl"
    r = subprocess.run([sys.executable, "-m", "kvload", "generate", "tiny-llama", "--prompt-ids", "1,2",
                        "--max_tokens", "1024", "--max_new_tokens", "2", "--audit-log", str(target)],
                       capture_output=True, text=True, preexec_fn=small_files, timeout=180,
                       env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == f"error: --audit-log {target}: cannot write it (File too large); nothing was " \
                                        "written", r.stderr
    assert list(tmp_path.iterdir()) == []
