"""A full disk made for real at each door that writes a file: one cause, one exit status and one line.

A full disk or a quota (ENOSPC, EDQUOT) is outside the settings, so it is exit 1 (``OutputError``) wherever it shows:
creating a folder, a lock, a temporary, or writing into one. A path that cannot be written for what it is (read-only,
a file where a folder goes) stays exit 2 naming the path. The disk is a small tmpfs mounted in a private mount
namespace (``unshare -m``, or ``unshare -rm`` as a user where user namespaces are allowed), filled before the command
runs: every inode taken (a new file or folder is refused) or every block (a write is refused).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_support import ENV, REPO
from tests.conftest import needs_smollm2

#: run in the namespace, the tmpfs at $DISK mounted: $SETUP (Python, with ``fill``), then the command; the disk's
#: entries afterwards go to $LEFT (the mount goes with the namespace)
_SHELL = """mount -t tmpfs -o "$OPTIONS" tmpfs "$DISK" || exit 97
"$PYTHON" -c "$FILL$SETUP" || exit 98
if [ -n "$READ_ONLY" ]; then mount -o remount,ro "$DISK" || exit 99; fi
"$@"; rc=$?
(cd "$DISK" && find . | sort) > "$LEFT"
exit $rc
"""

_FILL = """import errno, os
def fill(what):
    '''Take every inode of the disk ("inodes": no file or folder can be created) or every block ("blocks").'''
    disk = os.environ["DISK"]
    if what == "blocks":
        with open(os.path.join(disk, "fill"), "wb", buffering=0) as f:
            try:
                while True:
                    f.write(bytes(4096))
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
        return
    for i in range(100000):
        try:
            open(os.path.join(disk, f"fill{i}"), "x").close()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
            return
"""


@functools.cache
def _namespace() -> list[str] | None:
    """How to start a process in a private mount namespace where it may mount a tmpfs; None where it cannot."""
    if shutil.which("unshare") is None:
        return None
    prefix = ["unshare", "-m", "--propagation", "private"] if os.geteuid() == 0 else ["unshare", "-rm"]
    # the probe's folder is on the real disk, not in the namespace: removed (it was left in $TMPDIR on every run)
    probe = subprocess.run([*prefix, "sh", "-c", 'd=$(mktemp -d) || exit 1; mount -t tmpfs -o size=64k tmpfs "$d"; '
                            'rc=$?; [ $rc -eq 0 ] && umount "$d"; rmdir "$d"; exit $rc'], capture_output=True)
    return prefix if probe.returncode == 0 else None


def test_the_probe_for_a_private_mount_namespace_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    if _namespace.__wrapped__() is None:
        pytest.skip("no private mount namespace here")
    assert list(tmp_path.iterdir()) == []


def _on_a_small_disk(tmp_path: Path, setup: str, argv: list[str], *, options: str = "size=256k,nr_inodes=64",
                     read_only: bool = False, env: dict[str, str] | None = None,
                     ) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """``python argv`` with a tmpfs of ``options`` at ``tmp_path / "disk"`` ($DISK; $KVLOAD_CACHE is ``$DISK/cache``),
    after ``setup`` ran there (both with ``env`` added); its result and what the disk held afterwards."""
    prefix = _namespace()
    if prefix is None:
        pytest.skip("no private mount namespace here (unshare -m needs root, unshare -rm user namespaces)")
    disk, left = tmp_path / "disk", tmp_path / "left.txt"
    disk.mkdir()
    r = subprocess.run([*prefix, "sh", "-c", _SHELL, "sh", sys.executable, *argv], capture_output=True, text=True,
                       timeout=600, cwd=tmp_path, stdin=subprocess.DEVNULL,
                       env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
                            "DISK": str(disk), "KVLOAD_CACHE": str(disk / "cache"), "OPTIONS": options,
                            "PYTHON": sys.executable, "FILL": _FILL, "SETUP": setup, "LEFT": str(left),
                            "READ_ONLY": "1" if read_only else "", **(env or {})})
    assert r.returncode not in (97, 98, 99), r.stderr[-3000:]  # the disk was mounted and filled
    return r, left.read_text().split()


#: the GGUF conversion cache taken up to the point where the disk is full: "folders" (.state/locks to make), "lock"
#: (its file to create), "temporary" (the conversion's temporary folder to create), "mid-write" (the weights)
_GGUF_SETUP = """
from models import gguf_cache
from models.checkpoint import resolve_checkpoint
target = gguf_cache.cache_dir(resolve_checkpoint("smollm2-135m"))  # (remembers the content key under .state/keys)
point = os.environ["POINT"]
if point in ("lock", "temporary"):
    (target.parent / ".state" / "locks").mkdir(parents=True)
if point == "temporary":
    (target.parent / ".state" / "locks" / f"{target.name}.lock").touch()
fill("blocks" if point == "mid-write" else "inodes")
"""

_GGUF = ["-m", "kvload", "generate", "smollm2-135m", "--prompt-ids", "1,2", "--max_new_tokens", "1"]


@needs_smollm2
@pytest.mark.parametrize("point", ["folders", "lock", "temporary",
                                   pytest.param("mid-write", marks=pytest.mark.slow)])  # (~45 s: it dequantizes)
def test_a_full_disk_under_the_gguf_cache_is_exit_1_and_one_line_wherever_it_shows(tmp_path, point):
    """The cache's folders, its lock file and its temporary folder refused on a full disk were exit 2 ("cannot write
    the GGUF conversion cache under ROOT ...; set KVLOAD_CACHE to a writable directory", as a read-only cache), the
    weights refused mid-write exit 1: one cause, two codes. Now each is the mid-write's line and exit 1."""
    r, left = _on_a_small_disk(tmp_path, _GGUF_SETUP, _GGUF, env={"POINT": point})
    cache = tmp_path / "disk" / "cache"
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = r.stderr.splitlines()[-1]
    assert line.startswith(f"error: cannot write the GGUF conversion cache at {cache}/SmolLM2-135M-Instruct."), line
    assert line.endswith(" (No space left on device); nothing was kept: free space there or set KVLOAD_CACHE to "
                         "another directory"), line
    # no conversion and no temporary folder of one: kvload's bookkeeping (keys, locks) alone
    assert not [p for p in left if "SmolLM2" in p and not p.startswith("./cache/.state/")], left
    assert r.stdout == ""


@needs_smollm2
@pytest.mark.parametrize("refused", ["read-only", "a file where the folder goes"])
def test_a_gguf_cache_path_that_cannot_be_written_stays_exit_2_naming_the_setting(tmp_path, refused):
    """Not the disk's room but the path itself: refused before converting, exit 2, naming the setting to change."""
    setup = "" if refused == "read-only" else "open(os.path.join(os.environ['DISK'], 'cache'), 'w').close()"
    r, _ = _on_a_small_disk(tmp_path, setup, _GGUF, read_only=refused == "read-only")
    cache = tmp_path / "disk" / "cache"
    reason = "Read-only file system" if refused == "read-only" else "Not a directory"
    assert (r.returncode, r.stderr.splitlines()[-1:]) == \
        (2, [f"error: cannot write the GGUF conversion cache under {cache} ({reason}); set KVLOAD_CACHE to a "
             "writable directory"]), r.stderr[-3000:]


@pytest.mark.parametrize("full", ["inodes", "blocks"])
def test_an_audit_log_on_a_full_disk_is_exit_1_whether_its_file_or_its_lines_are_refused(tmp_path, full):
    """A disk with no inode left refused the audit's temporary file: exit 2, "cannot create a file in DIR", as a
    folder the user cannot write; with no block left its lines were refused: exit 1. One cause, one code now."""
    audit = tmp_path / "disk" / "a.jsonl"
    r, left = _on_a_small_disk(tmp_path, f"fill({full!r})",
                               ["-m", "kvload", "plan", "tiny-llama", "--audit-log", str(audit)])
    assert (r.returncode, r.stderr) == \
        (1, f"error: --audit-log {audit}: cannot write it (No space left on device); nothing was written\n")
    assert not [p for p in left if "a.jsonl" in p], left


def test_an_audit_log_on_a_read_only_disk_stays_exit_2(tmp_path):
    audit = tmp_path / "disk" / "a.jsonl"
    r, _ = _on_a_small_disk(tmp_path, "", ["-m", "kvload", "plan", "tiny-llama", "--audit-log", str(audit)],
                            read_only=True)
    assert r.returncode == 2 and r.stderr.startswith(f"error: --audit-log {audit}: "), r.stderr


def test_kv_cache_events_to_a_file_on_a_full_disk_is_an_output_error_and_keeps_the_events(tmp_path):
    """``LoadResult.kv_cache_events(jsonl=...)``: a file no inode is left for was a ``ConfigError`` (exit 2, as a
    path refused), the same file refused mid-write an ``OutputError``; now both are ``OutputError``."""
    events = tmp_path / "disk" / "e.jsonl"
    driver = f"""
import pipeline
from pipeline.errors import KvloadError
config = {{"max_tokens": 1024, "tokens_per_block": 16, "event_buffer_max_size": 1000, "host_cache_size": 0}}
with pipeline.load("tiny-llama", load_weights=True, kv_cache_config=config, max_seq_len=256, log=False) as r:
    r.generate([list(range(1, 40))], max_new_tokens=2, ignore_eos=True)
    try:
        r.kv_cache_events(jsonl={str(events)!r})
    except KvloadError as exc:
        print(type(exc).__name__, exc.exit_code, exc)
    print("kept", len(r.kv_cache_events()["events"]) > 0)
"""
    r, _ = _on_a_small_disk(tmp_path, "fill('inodes')", ["-c", driver])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == [f"OutputError 1 kv_cache_events: jsonl {events}: cannot append to it (No space "
                                     "left on device); the events stay in the buffer", "kept True"], r.stdout


def test_serve_kv_events_file_on_a_full_disk_is_exit_1(tmp_path):
    """``serve --kv-events-file`` on a disk with no inode left: exit 2 ("cannot open it for writing"), as a path
    refused; a full disk is outside the settings: exit 1, before the server listens."""
    from tests.tp_support import free_port

    events = tmp_path / "disk" / "e.jsonl"
    r, left = _on_a_small_disk(tmp_path, "fill('inodes')",
                               ["-m", "kvload", "serve", "tiny-llama", "--port", str(free_port()), "--kv-events-file",
                                str(events), "--event_buffer_max_size", "1000"])
    assert (r.returncode, r.stderr.splitlines()[-1:]) == \
        (1, [f"error: --kv-events-file '{events}': cannot open it for writing (No space left on device)"]), \
        r.stderr[-3000:]
    assert not [p for p in left if "e.jsonl" in p], left
