"""The ``kvload`` process ends right after its command (``kvload.process_end.leave``): atexit callbacks and the last
flush run, CPython's module teardown (1.3-2.9 s over torch's and transformers' objects) does not."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from tests.cli_support import ENV, REPO

#: The child: a module global whose finalizer only module teardown runs, an atexit callback, then the console
#: script's own entry (``kvload.__main__.main``) with the arguments given.
_CHILD = textwrap.dedent("""
    import atexit, sys

    class Teardown:
        def __del__(self):
            sys.__stderr__.write("module teardown ran\\n")

    kept = Teardown()  # nothing but the interpreter's module teardown deletes it
    atexit.register(lambda: sys.__stderr__.write("atexit callback ran\\n"))
    from kvload.__main__ import main
    sys.argv = ["kvload", *sys.argv[1:]]
    sys.exit(main())
""")


def _kvload(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, timeout=180,
                          cwd=REPO, env={**ENV, "PYTHONPATH": str(REPO)})


def test_generate_ends_after_its_output_and_audit_without_module_teardown(tmp_path: Path):
    """Everything the run owes is there (tokens, summary line, the published audit log ending in its final event,
    the atexit callbacks), and the process ended before the teardown that kept it 1.3-2.9 s after its last line."""
    audit = tmp_path / "gen.jsonl"
    r = _kvload("generate", "tiny-llama", "--prompt-ids", "1,2,3,4", "--max_new_tokens", "4", "--audit-log",
                str(audit))
    assert r.returncode == 0, r.stderr
    assert "1 prompt: 4 prompt tokens" in r.stdout and "4 generated" in r.stdout
    records = [json.loads(line) for line in audit.read_text(encoding="utf-8").splitlines()]
    assert records[-1]["event"] == "generation_finished", records[-1]
    assert "atexit callback ran" in r.stderr
    assert "module teardown ran" not in r.stderr
    assert "Traceback" not in r.stderr


def test_an_error_status_is_kept_and_its_line_printed():
    r = _kvload("generate", "no-such-model-anywhere", "--prompt-ids", "1")
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and "no-such-model-anywhere" in r.stderr
    assert "atexit callback ran" in r.stderr and "module teardown ran" not in r.stderr


def test_a_running_non_daemon_thread_gets_python_s_ordinary_exit():
    """Python's exit waits for such a thread; ending the process under it would cut its work: ``leave`` returns the
    status for the ordinary exit instead."""
    from kvload.process_end import leave

    release = threading.Event()
    worker = threading.Thread(target=release.wait, args=(30,), daemon=False)
    worker.start()
    try:
        assert leave(3) == 3  # returned: this process (pytest's) is still here
    finally:
        release.set()
        worker.join()
