"""Hostile-input sweep of the kvload CLI, to find what still breaks rather than guess.

Every value flag of plan, run, generate, simulate and serve (serve: its own flags) is given hostile values (wrong
types, edge numbers, control characters, odd paths: missing, a folder, a FIFO, a device, empty, binary, a 20 MB
line, bytes that are not UTF-8), ``--config`` odd YAML files, ``audit``/``explain`` odd files, and the environment
variables kvload reads junk. Each run is one JSON line: exit status, a traceback on stderr, stderr's line count,
time, a hang (killed past ``--timeout``), processes of its group left, files left in its working folder, its
``$TMPDIR`` and the fixtures folder. A ``serve`` is sent a CORS preflight and two GETs once its ready line is out
(``PROBES``), then stopped with SIGINT (its exit is recorded too). The suspects: a traceback, a hang, processes or
files left, an exit other than 0 or 2, a refusal of more than one line, a probe not answered or answered 5xx.
Files a successful run leaves on purpose (``intended``: the ``--audit-log`` file asked for, a cache where a relative
``KVLOAD_CACHE`` put it) are listed apart, not as suspects.

    python scripts/cli_sweep.py --work /tmp/sweep --only plan --jobs 2   # the runs whose name starts "plan"
    python scripts/cli_sweep.py --work /tmp/sweep --summary              # the suspects of every results file

Slow: a second or more per run, a model load per generate and serve (thousands of runs in all); ``--only`` narrows
it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BAD = ["abc", "", "-1", "0", "1e308", "9" * 5000, "nan", "-inf", "\x1b[31m", "9223372036854775808", "[1]", "1"]
PATH_FLAGS = {"--config", "--audit-log", "--chart", "--generation_config", "--download-dir", "--tokenizer",
              "--chat-template", "--kv-events-file", "--ssl-certfile", "--ssl-keyfile", "--ssl-ca-certs", "--uds",
              "--json-schema", "--grammar", "--kv-events-config", "--model"}
SERVE_FLAGS = {"--port", "--host", "--uds", "--ssl-certfile", "--ssl-keyfile", "--ssl-ca-certs", "--ssl-cert-reqs",
               "--kv-events-file", "--kv-events-config", "--default-max-tokens", "--seed",
               "--h11-max-incomplete-event-size", "--h11-max-header-count", "--api-server-count", "--audit-keep",
               "--max-request-bytes", "--request-read-timeout", "--max-concurrent-requests", "--responses-store-max",
               "--chat-template", "--tool-call-parser", "--reasoning-parser", "--default-chat-template-kwargs",
               "--max-log-len", "--allowed-origins", "--served-model-name", "--root-path", "--api-key",
               "--response-role",
               # serve's flags the first list lacked (sweep49: serve's value flags against this set)
               "--allowed-headers", "--allowed-methods", "--chat-template-content-format",
               "--guided-decoding-backend", "--metrics-name-prefix", "--middleware", "--uvicorn-log-level"}
#: serve's flags that take a JSON value: also given JSON of the wrong shape (each run a load when taken)
SERVE_JSON_FLAGS = {"--allowed-origins", "--allowed-methods", "--allowed-headers", "--default-chat-template-kwargs"}
SERVE_JSON = ["[1]", '{"a": 1}', '["x\\ny"]', '["\\ud800"]', "[", "null", '["*", 5]']
#: Flags of every command swept on the others too (the rest are read by one shared parser: swept on plan).
SHARED = {"--max_tokens", "--max_seq_len", "--tokens_per_block", "--config", "--audit-log", "--device", "--dtype",
          "--kv_cache_dtype"}
BASE = {"plan": ["plan", "tiny-llama"], "run": ["run", "tiny-llama", "--max_tokens", "1024"],
        "generate": ["generate", "tiny-llama", "--prompt-ids", "1,2,3", "--max_new_tokens", "2",
                     "--max_tokens", "1024"],
        "simulate": ["simulate", "tiny-llama", "--workload", "no-reuse", "--requests", "2", "--max_tokens", "4096"],
        "serve": ["serve", "tiny-llama", "--port", "0", "--max_tokens", "1024"]}
ENV_VARS = ["KVLOAD_LOG_FORMAT", "KVLOAD_LOG_LEVEL", "KVLOAD_AUDIT_KEY", "KVLOAD_CACHE", "KVLOAD_DIST_TIMEOUT_S",
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "XDG_CACHE_HOME", "HF_HOME",
            "HF_HUB_CACHE", "CC", "TRITON_INTERPRET", "COLUMNS", "KVLOAD_API_KEY"]
YAMLS = {
    "list_top": "- 1\n- 2\n", "scalar_top": "42\n", "kv_list": "kv_cache_config: [1, 2]\n",
    "kv_str": "kv_cache_config: hello\n", "kv_null": "kv_cache_config: null\n",
    "max_tokens_list": "kv_cache_config: {max_tokens: [4096]}\n",
    "max_tokens_map": "kv_cache_config: {max_tokens: {a: 1}}\n",
    "max_tokens_float": "kv_cache_config: {max_tokens: 4096.5}\n",
    "max_tokens_inf": "kv_cache_config: {max_tokens: .inf}\n",
    "max_tokens_nan": "kv_cache_config: {max_tokens: .nan}\n",
    "max_tokens_bool": "kv_cache_config: {max_tokens: true}\n",
    "max_tokens_date": "kv_cache_config: {max_tokens: 2001-12-14}\n",
    "max_tokens_big": "kv_cache_config: {max_tokens: " + "9" * 5000 + "}\n",
    "max_tokens_neg": "kv_cache_config: {max_tokens: -5}\n",
    "fraction_str": "kv_cache_config: {free_gpu_memory_fraction: half}\n",
    "fraction_2": "kv_cache_config: {free_gpu_memory_fraction: 2}\n", "dtype_int": "dtype: 16\n",
    "dtype_list": "dtype: [float16]\n", "model_int": "model: 5\n",
    "bomb": "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcde", "bcdef", strict=True)),
    "recursive_alias": "a: &a [*a]\n", "dup": "max_seq_len: 1\nmax_seq_len: 2\n",
    "pyobj": "max_seq_len: !!python/object/apply:os.system ['touch PWNED']\n",
    "pyname": "dtype: !!python/name:os.system\n", "binary_tag": "dtype: !!binary aGVsbG8=\n",
    "set_tag": "dtype: !!set {a, b}\n", "custom_tag": "dtype: !foo bar\n", "complex_key": "? [a, b]\n: 1\n",
    "int_key": "1: 2\n", "null_key": "null: 2\n",
    "merge": "base: &b {max_tokens: 4096}\nkv_cache_config: {<<: *b}\n", "merge_top": "<<: {max_seq_len: 64}\n",
    "multidoc": "max_seq_len: 64\n---\nmax_seq_len: 65\n", "bom": "\ufeffmax_seq_len: 64\n",
    "deep": "a: " + "[" * 200 + "]" * 200 + "\n",
    "deep_map": "kv_cache_config: " + "{a: " * 100 + "1" + "}" * 100 + "\n",
    "json_nan": '{"max_seq_len": NaN}\n', "unterminated": "kv_cache_config: {max_tokens: 4096\n",
    "ctrl": 'dtype: "\\x1b[31mred"\n', "longkey": ("k" * 100000) + ": 1\n",
    "many_keys": "".join(f"k{i}: {i}\n" for i in range(20000)), "unknown_nested": "kv_cache_config: {nope: 1}\n",
    "speculative_list": "speculative_config: [1]\n", "override_gen_list": "override_generation_config: [1]\n",
    "date_dir": "generation_config: 2024-01-01\n",
}

#: ``--hf-overrides JSON`` values (run ``hfo plan``; the first few on generate too, which loads weights) and the same
#: as a YAML ``hf_overrides:`` (``hfo_yaml plan``).
HF_OVERRIDES = [
    '{"num_hidden_layers": 1000000000}', '{"num_hidden_layers": 0}', '{"num_hidden_layers": "x"}',
    '{"vocab_size": 8}', '{"vocab_size": -5}', '{"hidden_size": 63}', '{"sliding_window": "x"}',
    '{"rope_parameters": {"rope_type": "nosuch"}}', '{"rope_theta": NaN}', '{"rope_theta": -1}',
    '{"hidden_act": "nosuch"}', '{"architectures": ["NoSuchForCausalLM"]}', '{"architectures": 5}',
    '{"a.b": 1}', '{"\\ud800": 1}', '{"to_dict": 1}', '{"rms_norm_eps": -1}', '{"max_position_embeddings": 0}',
    '{"text_config": {"num_hidden_layers": -1}}', "[1]", "null", "{", '"x"', "{}", "1e999",
    '{"num_attention_heads": 3}', '{"layer_types": ["nosuch"]}', '{"eos_token_id": 99999}',
    '{"pad_token_id": 99999}', '{"quantization_config": "x"}', '{"dtype": 5}', '{"torch_dtype": "int3"}',
    '{"a": ' * 40 + "1" + "}" * 40,
]
HF_OVERRIDES_GENERATE = 8


def make_fixtures(fix: Path) -> list[Path]:
    """The odd files the paths point at; the YAML configs, in order."""
    fix.mkdir(parents=True, exist_ok=True)
    (fix / "dir").mkdir(exist_ok=True)
    (fix / "empty").write_bytes(b"")
    (fix / "binary").write_bytes(bytes(range(256)) * 64)
    (fix / "hugeline").write_bytes(b"a" * (20 << 20))
    (fix / "badutf8").write_bytes(b"max_tokens: 4096\n\xff\xfe: 1\n")
    (fix / "nul").write_bytes(b"max_tokens: 40\x0096\n")
    (fix / "noperm").write_text("max_tokens: 4096\n")
    os.chmod(fix / "noperm", 0)  # root reads it anyway
    if not (fix / "fifo").exists():
        os.mkfifo(fix / "fifo")
    for name, text in YAMLS.items():
        (fix / f"y_{name}.yaml").write_text(text, encoding="utf-8")
    (fix / "y_utf16.yaml").write_bytes("max_seq_len: 64\n".encode("utf-16"))
    (fix / "y_crlf.yaml").write_bytes(b"max_seq_len: 64\r\n")
    return sorted(fix.glob("y_*.yaml"))


def path_values(fix: Path) -> list[str]:
    names = ("missing", "dir", "empty", "binary", "hugeline", "badutf8", "nul", "noperm", "fifo")
    return [str(fix / n) for n in names] + ["/dev/zero", "/dev/full", "/dev/null", "/", "/proc/self/mem"]


def cases(fix: Path) -> Iterator[dict[str, Any]]:
    """Every run of the sweep: a name, the argv after ``kvload``, and the environment's changes."""
    sys.path.insert(0, str(REPO))
    from kvload.cli.commands import build_parser

    ymls, paths = make_fixtures(fix), path_values(fix)
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    common = {a.option_strings[0] for a in sub.choices["plan"]._actions if a.option_strings}
    for cmd, parser in sub.choices.items():
        if cmd not in BASE:
            continue
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0:
                continue
            flag = action.option_strings[0]
            if cmd != "plan" and flag in common and flag not in SHARED:
                continue
            values = BAD + (paths if flag in PATH_FLAGS else [])
            if cmd == "serve":
                if flag not in SERVE_FLAGS:
                    continue
                values = ["", "-1", "0", "9" * 5000, "abc", "\x1b[31m", "nan"] + (paths if flag in PATH_FLAGS else [])
                values += SERVE_JSON if flag in SERVE_JSON_FLAGS else []
            elif cmd != "plan" and flag in ("--audit-log", "--chart", "--config"):
                values = [*paths, ""]
            for value in values:
                argv = list(BASE[cmd])
                if flag in argv:
                    del argv[argv.index(flag):argv.index(flag) + 2]
                yield {"name": f"{cmd} {flag}={value[:20]!r}", "argv": [*argv, flag, value]}
    for i, value in enumerate(HF_OVERRIDES):
        yield {"name": f"hfo plan {value[:30]!r}", "argv": [*BASE["plan"], "--hf-overrides", value]}
        if i < HF_OVERRIDES_GENERATE:
            yield {"name": f"hfo generate {value[:30]!r}", "argv": [*BASE["generate"], "--hf-overrides", value]}
        yml = fix / f"hfo_{i}.yaml"
        yml.write_text(f"hf_overrides: {value}\n", encoding="utf-8")
        yield {"name": f"hfo_yaml plan {value[:30]!r}", "argv": [*BASE["plan"], "--config", str(yml)]}
    for y in ymls:
        for cmd in ("plan", "generate"):
            yield {"name": f"{cmd} --config {y.name}", "argv": [*BASE[cmd], "--config", str(y)]}
    for value in [*paths, *BAD[:3]]:
        yield {"name": f"plan MODEL={value[-20:]!r}", "argv": ["plan", value]}
        for argv in (["audit"], ["audit", "--verify"], ["explain"]):
            yield {"name": f"{' '.join(argv)} {value[-20:]!r}", "argv": [*argv, value]}
    for var in ENV_VARS:
        for value in ["", "junk", "-1", "0", "1e308", "nan", "\x1b[31m", "9" * 5000, str(fix / "fifo"), "/dev/zero"]:
            cmd = "generate" if var in ("KVLOAD_CACHE", "CC", "XDG_CACHE_HOME") else "plan"
            audit = ["--audit-log", "a.jsonl"] if var == "KVLOAD_AUDIT_KEY" else []
            yield {"name": f"env {var}={value[:20]!r} {cmd}", "argv": [*BASE[cmd], *audit], "env": {var: value}}
        yield {"name": f"env {var}=junk serve", "argv": BASE["serve"], "env": {var: "junk"}}


#: The "missing" path fixture: each run gets its own, in a folder of its own (``m_*``, leftovers checked), not
#: ``fix/missing``. With ``--jobs 2`` the ``--audit-log fix/missing`` run (which writes that file on purpose, through
#: ``.missing.<hash>.tmp``) ran beside the ``--audit-log fix/dir`` one, whose fixtures-folder diff then showed the
#: other run's temporary file as its own leftover.
MISSING = "missing"


def _files(folder: Path) -> set[str]:
    return {str(p) for p in folder.rglob("*")} if folder.exists() else set()


def run_case(case: dict[str, Any], work: Path, fix: Path, timeout: float) -> dict[str, Any]:
    """One run in a fresh working folder and $TMPDIR; what it did and left."""
    cwd, tmp = Path(tempfile.mkdtemp(prefix="c_", dir=work)), Path(tempfile.mkdtemp(prefix="t_", dir=work))
    own = Path(tempfile.mkdtemp(prefix="m_", dir=work))  # this run's "missing" path's folder (MISSING)
    shared_missing, missing = str(fix / MISSING), str(own / MISSING)
    argv = [missing if a == shared_missing else a for a in case["argv"]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLOAD_")}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TMPDIR=str(tmp),
               **{k: missing if v == shared_missing else v for k, v in case.get("env", {}).items()})
    fix_before, start = _files(fix), time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "kvload", *argv], cwd=cwd, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    out: list[bytes] = []
    err: list[bytes] = []
    ready = threading.Event()

    def read(stream: Any, into: list[bytes], watch: bool) -> None:
        for line in iter(stream.readline, b""):
            into.append(line)
            if watch and b"Ctrl-C stops" in line:  # serve's ready line
                ready.set()

    readers = [threading.Thread(target=read, args=(proc.stdout, out, False)),
               threading.Thread(target=read, args=(proc.stderr, err, True))]
    for t in readers:
        t.start()
    hang = stopped = False
    probed: dict[str, Any] = {}
    while proc.poll() is None:
        if ready.is_set():
            time.sleep(0.5)
            probed = probe_served(err)
            os.kill(proc.pid, signal.SIGINT)
            stopped = True
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                hang = True
            break
        if time.monotonic() - start > timeout:
            hang = True
            break
        time.sleep(0.05)
    if hang:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for t in readers:
        t.join(5)
    try:
        os.killpg(proc.pid, 0)
        children = True
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        children = False
    stderr = b"".join(err).decode("utf-8", "replace")
    left = sorted(_files(cwd) | _files(tmp) | _files(own) | (_files(fix) - fix_before))
    subprocess.run(["rm", "-rf", str(cwd), str(tmp), str(own)], check=False)
    return {"name": case["name"], "argv": [a[:80] for a in argv], "env": case.get("env", {}),
            "rc": proc.returncode, "traceback": "Traceback" in stderr, "probed": probed,
            "err_lines": len(stderr.splitlines()),
            "seconds": round(time.monotonic() - start, 2), "hang": hang, "stopped": stopped, "children": children,
            "left": [x[:160] for x in left], "out_bytes": sum(map(len, out)),
            "cache_warned": "field=KVLOAD_CACHE" in stderr,  # kvload's cache cannot be made (``intended``)
            "err_tail": [line[:300] for line in stderr.splitlines()[-3:]]}


#: A served run's requests once it is ready (``probe_served``): a browser's CORS preflight and a plain one from
#: another origin, a GET. A flag whose value is taken at start but breaks every such answer (``--allowed-methods
#: '["x\\ny"]'``: h11 dropped each preflight) is found only by asking.
PROBES = (("OPTIONS", "/v1/completions", {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                                          "Access-Control-Request-Headers": "content-type, authorization"}),
          ("GET", "/health", {"Origin": "https://ui.example"}), ("GET", "/v1/models", {}))


def probe_served(err: list[bytes]) -> dict[str, Any]:
    """Each of ``PROBES`` sent to the server whose ready line is in ``err``: its status, or the exception (a
    connection dropped)."""
    import http.client

    line = next((x.decode("utf-8", "replace") for x in err if b"Ctrl-C stops" in x), "")
    if " at http://" not in line:  # --uds, TLS: not probed
        return {}
    host, _, port = line.split(" at http://", 1)[1].split(" ", 1)[0].split("/", 1)[0].rpartition(":")
    got: dict[str, Any] = {}
    for method, path, headers in PROBES:
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request(method, path, headers=headers)
            got[f"{method} {path}"] = conn.getresponse().status
        except Exception as e:
            got[f"{method} {path}"] = f"{type(e).__name__}: {e}"[:120]
        finally:
            conn.close()
    return got


#: Environment variables naming kvload's cache (``models.gguf_cache.cache_root``).
CACHE_VARS = ("KVLOAD_CACHE", "XDG_CACHE_HOME")


def _in_run_folder(path: str, folder: str, rel: str, prefix: bool = False) -> bool:
    """Whether ``path`` is ``<work>/runs/<folder>*/<rel>`` or below it (``prefix``: its first part starts with
    ``rel``)."""
    parts, want = Path(path).parts, Path(rel).parts
    for i in range(1, len(parts) - len(want)):
        if parts[i - 1] == "runs" and parts[i].startswith(folder):
            got = parts[i + 1:i + 1 + len(want)]
            return got == want or (prefix and len(want) == 1 and got[0].startswith(rel))
    return False


def intended(r: dict[str, Any]) -> tuple[list[str], str]:
    """The files a successful run left on purpose, and why; what else it left is a suspect's.

    - the file ``--audit-log`` or ``--chart`` named (``a.jsonl`` of the ``KVLOAD_AUDIT_KEY`` runs): asked for;
    - a relative ``KVLOAD_CACHE`` / ``XDG_CACHE_HOME`` (``junk``): kvload's cache where the user put it, under the
      working folder (huggingface_hub reads a relative ``XDG_CACHE_HOME`` the same way);
    - ``$TMPDIR/torchinductor_<user>`` of a run warned that kvload's cache cannot be made (a FIFO, ``/dev/zero``, a
      name too long): torch's own default, one folder reused by every later run, which the warning names
      (``models.compile_cache``; a folder of kvload's own removed at exit would be left at every kill instead).
    """
    if r["rc"] != 0 or not r["left"]:
        return [], ""
    argv, env, ok, why = r["argv"], r.get("env", {}), [], []
    for flag in ("--audit-log", "--chart"):
        if flag in argv[:-1]:
            named = argv[argv.index(flag) + 1]
            ok += [p for p in r["left"] if p == named or (not named.startswith("/") and p.endswith("/" + named))]
    if ok:
        why.append("the file asked for")
    for var in CACHE_VARS:
        value = env.get(var, "")
        if value and not value.startswith("/"):
            cache = [p for p in r["left"] if _in_run_folder(p, "c_", value)]
            ok += cache
            why += ["the cache where the variable put it"] if cache else []
        if value and (r.get("cache_warned") or any("cannot be" in line for line in r["err_tail"])):
            torch_default = [p for p in r["left"] if _in_run_folder(p, "t_", "torchinductor_", prefix=True)]
            ok += torch_default
            why += ["torch's default compile cache, warned"] if torch_default else []
    return sorted(set(ok)), "; ".join(why)


def suspect(r: dict[str, Any]) -> bool:
    """A run the sweep flags: traceback, hang, leftovers (but the ``intended`` ones), an odd exit, a refusal of
    more than one line."""
    left = set(r["left"]) - set(intended(r)[0])
    # a served run's probes: answered (a refused preflight's 400 included), never a 5xx or a dropped connection
    broken = [v for v in r.get("probed", {}).values() if not isinstance(v, int) or v >= 500]
    return bool(r["traceback"] or r["hang"] or r["children"] or left or r["rc"] not in (0, 2)
                or (r["rc"] == 2 and r["err_lines"] > 1) or broken)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="folder for fixtures, runs and results")
    ap.add_argument("--only", default="", help="run the cases whose name starts with this")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=90.0, help="seconds before a run counts as hung")
    ap.add_argument("--summary", action="store_true", help="print the suspects of every results file and stop")
    ap.add_argument("--list", action="store_true", help="print the number of cases and stop")
    a = ap.parse_args()
    work = a.work.resolve()
    fix, runs = work / "fix", work / "runs"
    if a.summary:
        for results in sorted(work.glob("results-*.jsonl")):
            rows = [json.loads(line) for line in results.read_text().splitlines()]
            flagged = [r for r in rows if suspect(r)]
            meant = [r for r in rows if not suspect(r) and intended(r)[0]]
            print(f"{results.name}: {len(rows)} runs, {len(flagged)} suspects, {len(meant)} leaving files on purpose")
            for r in meant:
                print(f"  (intended) {r['name']}: {intended(r)[1]}: {intended(r)[0][:1]}")
            for r in flagged:
                print(f"  {r['name']}: exit {r['rc']}, {r['seconds']} s, traceback {r['traceback']}, hang {r['hang']},"
                      f" children {r['children']}, left {r['left'][:2]}, probed {r.get('probed')}, {r['err_lines']} "
                      f"lines: {r['err_tail'][-1:]}")
        return
    runs.mkdir(parents=True, exist_ok=True)
    chosen = [c for c in cases(fix) if c["name"].startswith(a.only)]
    if a.list:
        print(len(chosen))
        return
    name = a.only.split()[0] if a.only else "all"
    with (work / f"results-{name}.jsonl").open("w") as fh, ThreadPoolExecutor(a.jobs) as pool:
        for rec in pool.map(lambda c: run_case(c, runs, fix, a.timeout), chosen):
            fh.write(json.dumps(rec) + "\n")
            fh.flush()


if __name__ == "__main__":
    main()
