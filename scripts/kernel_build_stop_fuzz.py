"""SIGTERM sent from outside at random moments of a CPU kernel build: how often the compiler is left writing.

Each trial starts a process (in a session of its own, with kvload's SIGTERM handling armed and three idle threads,
as torch has) that builds the paged decode kernel again and again, each time into a new folder, with a fake compiler
that takes 0.1 s and then writes its output; after a random 0.05-0.6 s it gets SIGTERM. A compiler that outlived
the process shows as a file written into the kernel cache after the process ended (a ``.o`` or a temporary ``.so``);
the exit status must be 143. Compare two checkouts side by side:

    python scripts/kernel_build_stop_fuzz.py /work/main 400 & python scripts/kernel_build_stop_fuzz.py . 400; wait

``repeat`` as a third argument sends SIGINT 0-0.15 s after the SIGTERM (a second Ctrl-C, torchrun passing one on
again): one stop at a time (``pipeline.signals``), so the repeat lands inside the first one's cleanup (the compiler's
group killed, its files removed) and must change nothing: status 143, no file left. The driver ends as ``python -m
kvload`` does (``ends_process``, ``release_sigterm``, ``kvload.process_end.leave``): a repeat reaching CPython's
own teardown, which kvload skips, found the handlers reset to SIG_DFL there (exit -2 in 10 of 100).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAKE_CC = ("#!/bin/sh\n[ \"$1\" = --version ] && { echo 'fake cc 1.0'; exit 0; }\n"
           "out=; prev=; for a; do [ \"$prev\" = -o ] && out=$a; prev=$a; done\n"
           "sleep 0.1\necho half > \"$out\"\n")

DRIVER = """
import sys, threading, time
from pathlib import Path
from cache_backends import cpu_kernel_build
from kvload.process_end import leave
from pipeline.signals import Terminated, ends_process, handle_sigterm, release_sigterm
ends_process()  # and ended as `python -m kvload` ends: with leave(), not CPython's teardown
handle_sigterm()
for _ in range(3):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
try:
    i = 0
    while True:
        i += 1
        cpu_kernel_build.build_kernel(Path(sys.argv[1]) / str(i))
except Terminated:
    status = 143
finally:
    release_sigterm()
leave(status)
"""


def main() -> None:
    repo, trials = os.path.abspath(sys.argv[1]), int(sys.argv[2])
    repeat = sys.argv[3:] == ["repeat"]
    root = Path(tempfile.mkdtemp(prefix="kernel_build_stop_fuzz-"))
    cc = root / "cc"
    cc.write_text(FAKE_CC)
    cc.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": repo, "CC": str(cc)}
    rng = random.Random(1)
    left = bad_status = 0
    for trial in range(trials):
        cache = root / f"t{trial}"
        # cwd=root: `python -c` puts the working directory first on sys.path, before PYTHONPATH's checkout
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(cache)], env=env, cwd=root, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        proc.stdout.readline()
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGTERM)
        if repeat:
            time.sleep(rng.uniform(0.0, 0.15))
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        ended = time.time()
        if proc.returncode != 143:
            bad_status += 1
            print("status", proc.returncode, err[-300:])
        time.sleep(0.15)  # past the fake compiler's 0.1 s
        files = [f for f in cache.rglob("*") if f.is_file() and (f.name.startswith(".") or f.suffix != ".so")]
        if files:
            left += 1
            print("left", [(str(f.relative_to(cache)), f"{f.stat().st_mtime - ended:+.3f} s") for f in files])
    shutil.rmtree(root, ignore_errors=True)
    print(f"{repo}: {trials} trials{' (SIGINT repeated)' if repeat else ''}, {left} left a file in the kernel cache, "
          f"{bad_status} exit status not 143")


if __name__ == "__main__":
    main()
