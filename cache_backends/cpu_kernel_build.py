"""Building kvload's C kernels for CPUs with the machine's C compiler, once per machine: the paged decode kernel
(``csrc/paged_decode.c``) and the small-batch linear kernel (``models/csrc/small_linear.c``).

Kept apart from the kernels' callers (``cache_backends.cpu_decode``, ``models.small_linear``) so that
``resolve_auto`` can ask whether a compiler is there without importing torch. Each library goes into a cache
directory the caller names, under a key of its source, the compiler's version, the flags and the CPU
(``-march=native`` builds for this CPU), so a rebuild happens only when one of them changes; it is written under a
temporary name of its process and thread and renamed when complete, so a crashed or concurrent build never leaves
half a library under the final name; a killed build's temporary files (SIGKILL, a power cut) are swept by the next
build once they are past any build's time and their process is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from cache_backends.signal_hold import handlers_held

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
#: (compile, link) flags, best first: a set the compiler refuses is dropped for the next one. -ffast-math only
#: compiles (it lets reductions vectorize and expf use the vector math library); linking with it would add
#: crtfastmath, which on loading the library sets flush-to-zero for the whole process (every torch op after it).
FLAG_SETS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("-O3", "-march=native", "-ffast-math", "-fopenmp"), ("-fopenmp",)),
    (("-O3", "-ffast-math", "-fopenmp"), ("-fopenmp",)),
    (("-O3", "-ffast-math", "-Wno-unknown-pragmas"), ()),
)
#: seconds one compile or link may take: these sources build in 1-7 s, so a compiler past this is hung, not slow
COMPILE_TIMEOUT_S = 120


class KernelUnavailable(RuntimeError):
    """The CPU kernel cannot be built or loaded here; the message says why."""


def compiler() -> str | None:
    """The C compiler to build with: ``$CC`` (a command line, such as ``ccache gcc``), else ``cc`` or ``gcc`` on
    PATH."""
    return os.environ.get("CC", "").strip() or shutil.which("cc") or shutil.which("gcc")


#: the stop signals kvload turns into exceptions (``pipeline.signals``), held back while a compiler is being started
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` in a session of its own, whose whole process group is killed on timeout (or on an
    interrupt): ``cc`` runs ``cc1``, ``as`` and ``ld`` under it, and killing ``cc`` alone would leave a hung ``cc1``
    behind.

    A stop signal is held while ``Popen`` starts it: one landing there raised inside ``Popen.__init__``, before this
    function had the process to kill, and ``cc`` ran on after kvload had exited, writing into the kernel cache."""
    proc = None
    try:
        with handlers_held(_STOP_SIGNALS):
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
        out, err = proc.communicate(timeout=timeout)
    except BaseException:  # the timeout, KeyboardInterrupt, a signal's exception: nothing is left running
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags (Linux), else the platform's name."""
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = [line for line in info.splitlines() if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return f"{platform.machine()} " + "\n".join(dict.fromkeys(wanted))


def build_kernel(cache_dir: Path, source: Path | None = None, what: str = "the CPU paged decode kernel") -> Path:
    """The library compiled from ``source`` (default: the paged decode kernel's) under ``cache_dir``, compiling it
    when this source/compiler/CPU has none yet; ``what`` names the kernel in errors."""
    source = SOURCE if source is None else source
    # absolute: a relative cache (KVLOAD_CACHE=-1) would put "-1/kernels/....o" on cc's command line, which cc reads
    # as an option (the link of every flag set failed, each after a whole compile)
    cache_dir = Path(os.path.abspath(cache_dir))
    cc = compiler()
    if cc is None:
        raise KernelUnavailable(f"no C compiler to build {what} with (set $CC, or install gcc)")
    stem = source.stem
    try:
        argv = shlex.split(cc)
    except ValueError as exc:
        raise KernelUnavailable(f"$CC={cc!r} is not a command line: {exc}") from None
    try:
        version = _run([*argv, "--version"], timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"the C compiler {cc} did not run: {exc}") from None
    text, cpu = source.read_bytes(), _cpu_identity().encode()
    targets = []
    for cflags, lflags in FLAG_SETS:
        flags = " ".join(cflags) + " | " + " ".join(lflags)
        key = hashlib.sha256(b"\0".join([text, version.encode(), flags.encode(), cpu])).hexdigest()[:16]
        targets.append((cache_dir / f"{stem}-{key}.so", key, cflags, lflags))
    # any build already made wins, also a fallback's: a flag set this compiler refuses is not retried every process
    for target, *_ in targets:
        try:
            if target.exists():
                return target
        except OSError as exc:  # a name past the file system's limit, a folder the user cannot search: exists() raises
            raise KernelUnavailable(f"the kernel cache {cache_dir} cannot be read: {exc.strerror}") from None
    _sweep_dead_builds(cache_dir, stem)
    errors = []
    for target, key, cflags, lflags in targets:
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise KernelUnavailable(f"the kernel cache {cache_dir} cannot be created: {exc.strerror}") from None
        # renamed when complete: never half a library; per process and thread, so a second build of the same key at
        # once (two loads in one process) neither overwrites these files nor has them deleted under it
        tmp = cache_dir / f".{stem}-{key}.{os.getpid()}.{threading.get_ident()}.so"
        obj = tmp.with_suffix(".o")
        try:
            for cmd in ([*argv, *cflags, "-fPIC", "-c", "-o", str(obj), str(source)],
                        [*argv, "-shared", *lflags, "-o", str(tmp), str(obj), "-lm"]):
                proc = _run(cmd, timeout=COMPILE_TIMEOUT_S)
                if proc.returncode != 0:
                    errors.append((proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[0])
                    break
            else:
                os.replace(tmp, target)
                return target
        except subprocess.TimeoutExpired:  # hung: the next flag set would hang as long again
            raise KernelUnavailable(f"the C compiler {cc} did not finish building {what} in {COMPILE_TIMEOUT_S} s "
                                    "(hung?); its processes were stopped") from None
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(str(exc))
        finally:
            tmp.unlink(missing_ok=True)
            obj.unlink(missing_ok=True)
    raise KernelUnavailable(f"compiling {what} with {cc} failed: {errors[-1]}")


#: A build's temporary files: ``.<stem>-<key>.<pid>.<thread>.o`` / ``.so`` (:func:`build_kernel`).
_TEMP = re.compile(r"\.(?P<stem>.+)-[0-9a-f]{16}\.(?P<pid>\d+)\.\d+\.(?:o|so)")


def _sweep_dead_builds(cache_dir: Path, stem: str) -> None:
    """Remove the temporary files of ``stem``'s builds that were killed where nothing could clean up (SIGKILL, a
    power cut): older than any build may take (its two commands at most :data:`COMPILE_TIMEOUT_S` each, for every
    flag set) and of a process that is gone. Both, since a cache may be shared with another machine or container
    whose processes this one cannot see; a file that cannot be read or removed is left."""
    oldest = time.time() - 2 * COMPILE_TIMEOUT_S * len(FLAG_SETS) - 60
    try:
        entries = list(os.scandir(cache_dir))
    except OSError:
        return
    for entry in entries:
        m = _TEMP.fullmatch(entry.name)
        if m is None or m["stem"] != stem:
            continue
        with contextlib.suppress(OSError):
            if entry.stat(follow_symlinks=False).st_mtime < oldest and not _alive(int(m["pid"])):
                os.unlink(entry.path)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists here (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def load_library(cache_dir: Path, source: Path | None = None,
                 what: str = "the CPU paged decode kernel") -> tuple[ctypes.CDLL, Path]:
    """The library built from ``source`` under ``cache_dir`` (:func:`build_kernel`), loaded, and its path; a cached
    copy that does not load (truncated by a full disk, say) is built again, once, rather than given up on for good."""
    path = build_kernel(cache_dir, source, what)
    try:
        return ctypes.CDLL(str(path)), path
    except OSError:
        path.unlink(missing_ok=True)
        path = build_kernel(cache_dir, source, what)
        try:
            return ctypes.CDLL(str(path)), path
        except OSError as exc:
            raise KernelUnavailable(f"{what} {path} did not load: {exc}") from None
