"""Hostile inputs for tests: generators (YAML bombs, config.json mutations, bad numbers), a ``kvload``
process under memory and CPU limits, and the one assertion every bad input must pass."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.cli_support import ENV, REPO, CliResult

#: Address space and CPU seconds a hostile run may use: a plan/simulate of a tiny preset needs
#: well under 1 GiB and 10 s; a run that builds what the input asks for (a billion layers, an
#: expanded alias bomb, a billion requests) runs into these instead of finishing with exit 2.
LIMIT_AS_BYTES = 1536 * 1024**2
LIMIT_CPU_SECONDS = 40


def _limits() -> None:  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS_BYTES, LIMIT_AS_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (LIMIT_CPU_SECONDS, LIMIT_CPU_SECONDS))


def limited_kvload(*argv: Any, cwd: Path | None = None, env: dict[str, str] | None = None) -> CliResult:
    """``python -m kvload`` in a subprocess under :data:`LIMIT_AS_BYTES` and :data:`LIMIT_CPU_SECONDS`.

    A run killed by a limit shows as a negative code (SIGXCPU/SIGKILL) or a MemoryError exit 1.
    """
    r = subprocess.run([sys.executable, "-m", "kvload", *map(str, argv)], capture_output=True, text=True,
                       env={**ENV, "PYTHONPATH": str(REPO), **(env or {})}, cwd=cwd or REPO, preexec_fn=_limits,
                       timeout=300)
    return CliResult(r.returncode, r.stdout, r.stderr)


def signals_as_a_terminal_gives_them() -> None:
    """``preexec_fn`` for a kvload child a test signals: SIGINT, SIGTERM and SIGHUP at their defaults, unblocked."""
    # a suite started in the background (`pytest ... &`) runs with SIGINT ignored, which the child would inherit, and
    # Python installs no KeyboardInterrupt handler for an ignored SIGINT: the SIGINT tests would then watch the run
    # finish instead of being interrupted; likewise a SIGHUP ignored (a suite run under nohup or a detached job, which
    # kvload then keeps ignoring, as nohup asks) or any of the three blocked by whatever started the suite
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))


def signal_again_script(patched: str) -> str:
    """``python -c`` code running ``python -m kvload``'s main on its arguments that sends itself the signal named by
    ``$AGAIN`` once more (0.2 s for its handler to run there): from inside ``patched`` (``"module:name"`` or
    ``"module:Class.name"``, a function the command calls once it is stopping), or, with ``$WHERE`` ``exit``, from an
    exit callback once the command returned. A repeated stop signal that lands there every time."""
    module, _, name = patched.partition(":")
    *owner, attr = name.split(".")
    return f"""
import atexit, importlib, os, signal, sys, time
again = getattr(signal, os.environ["AGAIN"])
def send_again():
    os.kill(os.getpid(), again)
    time.sleep(0.2)  # its handler runs here
if os.environ["WHERE"] == "exit":
    atexit.register(send_again)
else:
    owner = importlib.import_module({module!r})
    for part in {owner!r}:
        owner = getattr(owner, part)
    patched = getattr(owner, {attr!r})
    def inside(*args, **kw):
        send_again()
        return patched(*args, **kw)
    setattr(owner, {attr!r}, inside)
from kvload.__main__ import main
sys.exit(main())
"""


def _signals_as_a_terminal_gives_them() -> None:  # runs in the child before exec
    signals_as_a_terminal_gives_them()
    _limits()


def start_kvload(*argv: Any, cwd: Path) -> subprocess.Popen[str]:
    """A ``kvload`` process left running (for the signal tests), with SIGINT as a terminal delivers it."""
    return subprocess.Popen([sys.executable, "-m", "kvload", *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**ENV, "PYTHONPATH": str(REPO)}, cwd=cwd,
                            preexec_fn=_signals_as_a_terminal_gives_them)


def wait_for_temporary(proc: subprocess.Popen[str], folder: Path, timeout: float = 120.0) -> bool:
    """Poll until a ``.tmp`` file appears in ``folder`` (the run has started writing its audit); False if the
    process ended first or ``timeout`` passed (a bounded loop: never hangs the suite)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.name.endswith(".tmp") for p in folder.iterdir()):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.005)
    return False


def interrupt(proc: subprocess.Popen[str], signum: int) -> CliResult:
    """Send ``signum`` and collect the exit status and output (killing the process if it ignores it)."""
    proc.send_signal(signum)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return CliResult(proc.returncode, out, err)


def assert_refused(r: CliResult, *needles: str, folder: Path | None = None, code: int = 2) -> None:
    """Exit ``code``, exactly one ``error:`` line on stderr naming every needle, no traceback, empty stdout,
    nothing left in ``folder`` (no audit file, no temporary)."""
    assert r.code == code, (r.code, r.err[-2000:])
    assert r.err.startswith("error: ") and r.err.count("\n") == 1, r.err[-2000:]
    assert "Traceback" not in r.err
    assert len(r.err) < 600, r.err  # one readable line, not a dump of the hostile value
    for needle in needles:
        assert needle in r.err, (needle, r.err)
    assert r.out == "", r.out[:500]
    if folder is not None:
        assert sorted(p.name for p in folder.iterdir()) == []


# --- generators ------------------------------------------------------------------------------


def yaml_bomb(fanout: int, depth: int, kind: str, at: str = "kv_cache_config") -> str:
    """A billion-laughs YAML: ``depth`` anchors, each ``fanout`` aliases of the one before, as lists or mappings,
    the last one placed under the key ``at`` (a real LlmArgs key, so nothing rejects it by name first)."""
    lines = ["a0: &a0 " + ("[" + ", ".join(["lol"] * fanout) + "]" if kind == "list"
                           else "{" + ", ".join(f"k{j}: lol" for j in range(fanout)) + "}")]
    for i in range(1, depth):
        refs = [f"*a{i - 1}"] * fanout
        body = "[" + ", ".join(refs) + "]" if kind == "list" else "{" + ", ".join(
            f"k{j}: {r}" for j, r in enumerate(refs)) + "}"
        lines.append(f"a{i}: &a{i} {body}")
    lines.append(f"{at}: *a{depth - 1}")
    return "\n".join(lines) + "\n"


def deep_yaml(depth: int, kind: str) -> str:
    """Flow-style nesting ``depth`` levels deep under ``kv_cache_config``."""
    if kind == "list":
        return "kv_cache_config: " + "[" * depth + "]" * depth + "\n"
    return "kv_cache_config: " + "{a: " * depth + "1" + "}" * depth + "\n"


#: Values no geometry field of config.json accepts (the field's own range is added per field).
BAD_GEOMETRY_VALUES: list[Any] = [0, -1, -(2**63), 10**9, 2**64, 10**40, 1e9, 4.0, "4", True, [], {}, [4]]


def config_mutations(base: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(case id, mutated config.json, the field its error must name), for every geometry field and bad value,
    plus layer_types of the wrong length and shape, and text_config that is not an object."""
    from models.config_check import INT_FIELDS

    for field, (least, most, nullable) in INT_FIELDS.items():
        for value in [*BAD_GEOMETRY_VALUES, least - 1, most + 1, *([] if nullable else [None])]:
            if isinstance(value, int) and not isinstance(value, bool) and least <= value <= most:
                continue
            yield f"{field}={json.dumps(value)}", {**base, field: value}, field
    layers = base["num_hidden_layers"]
    for n in (0, 1, layers - 1, layers + 1, 1000):
        yield f"layer_types[{n}]", {**base, "layer_types": ["full_attention"] * n}, "layer_types"
    for value in (5, "full_attention", [1, 2], {"a": 1}):
        yield f"layer_types={json.dumps(value)}", {**base, "layer_types": value}, "layer_types"
    for value in (5, "x", [1], True):
        yield f"text_config={json.dumps(value)}", {**base, "text_config": value}, "text_config"
    yield "text_config.heads=0", {**base, "text_config": {**base, "num_attention_heads": 0}}, \
        "text_config.num_attention_heads"
    for value in ("yes", 1):
        yield f"use_sliding_window={json.dumps(value)}", {**base, "use_sliding_window": value}, "use_sliding_window"
    # transformers only logs an EOS outside the vocabulary: generation never stopped at it, and under min_tokens a
    # negative id (indexing from the end) kept a real token from being drawn
    for value in (-1, base["vocab_size"], 2**40, [2, -5], "2", 2.0, [True]):
        yield f"eos_token_id={json.dumps(value)}", {**base, "eos_token_id": value}, "eos_token_id"
    yield "text_config.eos_token_id", {**base, "text_config": {**base, "eos_token_id": -1}}, "text_config.eos_token_id"
    # transformers only logs that a RoPE factor must be >= 1, then builds the model: positions scaled by -2, text out
    for value in (-2, 0, 0.5, "4", True, [2]):
        rope = {"rope_type": "linear", "factor": value}
        yield f"rope_scaling.factor={json.dumps(value)}", {**base, "rope_scaling": rope}, "rope_scaling.factor"
    yield ("rope_parameters per layer type", {**base, "rope_parameters": {
        "full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "linear", "factor": -1}}},
        "rope_parameters.sliding_attention.factor")
    for value in ("linear", 4, [1]):
        yield f"rope_scaling={json.dumps(value)}", {**base, "rope_scaling": value}, "rope_scaling"
    # a negative epsilon made RMSNorm's root NaN, 1e308 zeroed every hidden state: token 0 over and over, exit 0
    for field in ("rms_norm_eps", "layer_norm_eps"):
        for value in (-1e-6, 0, 1e308, 2, "1e-6", True, [1e-6]):
            yield f"{field}={json.dumps(value)}", {**base, field: value}, field
    # a number as the dtype was dropped: the model took kvload's default dtype
    for field, value in (("dtype", 5), ("torch_dtype", [16])):
        yield f"{field}={json.dumps(value)}", {**base, field: value}, field
    # a number as the RoPE type failed the load as "transformers cannot load the weights: 5"
    for field, key in (("rope_parameters", "rope_type"), ("rope_scaling", "type")):
        for name in (5, "banana", "x" * 10_000):  # a name transformers lacks: plan went through, generate refused it
            rope = {key: name, "factor": 2.0, "rope_theta": 10000.0}
            yield f"{field}.{key}={json.dumps(name)[:20]}", {**base, field: rope}, f"{field}.{key}"
    # RoPE's base: a string failed the load naming no field; 0 or a negative one gave NaN angles, text out, exit 0
    for value in (0, -1, -10000.0, "10000", True, [10000]):
        yield f"rope_theta={json.dumps(value)}", {**base, "rope_theta": value}, "rope_theta"
        rope = {"rope_type": "default", "rope_theta": value}
        yield f"rope_parameters.rope_theta={json.dumps(value)}", {**base, "rope_parameters": rope}, \
            "rope_parameters.rope_theta"


def exit_signal_name(code: int) -> str:
    """``SIGXCPU`` for a negative return code (a process killed by a signal), else the code."""
    return signal.Signals(-code).name if code < 0 else str(code)
