"""Running the ``kvload`` CLI from tests: in-process (fast, most cases) and as a real subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import attrs
import structlog

from kvload.cli.entry import main

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
REPO = Path(__file__).resolve().parents[1]


@attrs.frozen
class CliResult:
    """Exit status and the two output streams of one ``kvload`` invocation."""

    code: int
    out: str
    err: str

    def json(self) -> Any:
        """stdout parsed as one JSON document."""
        return json.loads(self.out)

    @property
    def one_error_line(self) -> bool:
        """stderr is exactly one ``error: ...`` line and no traceback."""
        return self.err.startswith("error: ") and self.err.count("\n") == 1 and "Traceback" not in self.err


def run_cli(capsys: Any, *argv: str) -> CliResult:
    """Call ``kvload.cli.entry.main`` in this process; restore structlog's global config afterwards."""
    saved, was_configured = structlog.get_config(), structlog.is_configured()
    capsys.readouterr()
    try:
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse: --help, usage errors
            code = exc.code if isinstance(exc.code, int) else 1
    finally:
        if was_configured:
            structlog.configure(**saved)
        else:
            structlog.reset_defaults()
    out, err = capsys.readouterr()
    return CliResult(code, out, err)


def kvload(*argv: str, cwd: Path | None = None, python_flags: tuple[str, ...] = ()) -> CliResult:
    """Run ``python -m kvload.cli`` in a subprocess, from the repository root unless ``cwd`` is given."""
    r = subprocess.run([sys.executable, *python_flags, "-m", "kvload.cli", *map(str, argv)], capture_output=True,
                       text=True, env={**ENV, "PYTHONPATH": str(REPO)}, cwd=cwd or REPO, timeout=180)
    return CliResult(r.returncode, r.stdout, r.stderr)


def kvload_process(*args: Any, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m kvload`` as a subprocess (return code, stdout, stderr), for tests that need a real process."""
    return subprocess.run([sys.executable, "-m", "kvload", *map(str, args)], capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=120)


def read_events(path: Path) -> list[dict[str, Any]]:
    """The records of an audit file, header first."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def write_events(path: Path, records: list[dict[str, Any]]) -> None:
    """Write records back as JSON Lines (for tampering tests)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def imports_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; report which heavy modules (torch, transformers) it left loaded."""
    script = textwrap.dedent(code) + textwrap.dedent("""
        import json, sys
        print(json.dumps({m: m in sys.modules for m in ("torch", "transformers")}), file=sys.stderr)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env={**ENV, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stderr.strip().splitlines()[-1])


def until_ready(proc: subprocess.Popen, timeout: float = 120) -> list[str]:
    """A ``kvload serve`` process's stderr lines up to its ready line (the last: ``... at http://HOST:PORT ...``, or
    ``https://`` under TLS, or ``unix:PATH`` / ``https+unix:PATH`` with ``--uds``)."""
    import re
    import time

    deadline, lines = time.monotonic() + timeout, []
    while not lines or not re.search(" at (https?://|(https\\+)?unix:)", lines[-1]):
        assert time.monotonic() < deadline and proc.poll() is None, f"server did not start: {lines}"
        lines.append(proc.stderr.readline())
    return lines


def ready_url(line: str) -> str:
    """The URL a ``kvload serve`` ready line names."""
    return line.split(" at ", 1)[1].split(" ", 1)[0]


def reap(proc: subprocess.Popen) -> None:
    """Kill a server process a failed assertion left running, and close its pipes."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    proc.stdout.close()
    proc.stderr.close()


def served_with(monkeypatch: Any, *flags: str) -> dict:
    """What ``kvload serve tiny-llama --port 0 FLAGS`` hands ``build_state`` (the command is stopped there)."""
    import pytest

    from kvload.cli.commands import build_parser
    from kvload.serve import command, server

    seen: dict = {}

    def build_state(result: Any, **kwargs: Any) -> None:  # stop the command once it has said how to serve
        seen.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(server, "build_state", build_state)
    with pytest.raises(SystemExit):
        command.cmd_serve(build_parser().parse_args(["serve", "tiny-llama", "--port", "0", *flags]))
    return seen
