"""Shared pieces of the benchmarks: result tables (markdown), statistics, and what machine ran them."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import attrs

T = TypeVar("T")


@contextlib.contextmanager
def thread_cpu_step_clock() -> Iterator[None]:
    """Within the block, the driver times ``kv_seconds`` (manager + scheduler time per engine step) as this
    thread's CPU time (``time.thread_time``), not wall time: on a machine shared with other jobs, wall time
    counts their time slices too (ratios of wall times swung 1.7x-7x between pairs under load)."""
    import types

    from engine.driver import Driver

    clock = Driver.step.__globals__
    saved = clock["time"]
    clock["time"] = types.SimpleNamespace(perf_counter=time.thread_time)
    try:
        yield
    finally:
        clock["time"] = saved


@contextlib.contextmanager
def kv_opcode_counter() -> Iterator[list[int]]:
    """Within the block, count the Python opcodes executed in the KV work the driver times as ``kv_seconds``
    (``scheduler.step``, the managers' ``commit`` and the schedulers' ``finish``, everything they call) into the
    yielded one-element list. A deterministic measure of the Python work, for a machine whose timings drift
    10-50% between runs: the same code and workload give the same count (once module-level memos are warm: a
    first run differs by under 0.01%). It weighs every opcode alike (a C
    builtin's loop counts as one call), so quote it beside CPU times, not instead of them. Tracing slows the
    run down ~10x."""
    from cache_backends.scheduler_base import SchedulerBase
    from cache_backends.v1.manager import KVCacheManager
    from cache_backends.v1.scheduler import GuaranteedNoEvictScheduler
    from cache_backends.v2.manager import KVCacheManagerV2
    from cache_backends.v2.scheduler import KVCacheV2Scheduler

    count, depth = [0], [0]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            count[0] += 1
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if depth[0]:
            frame.f_trace_opcodes = True
            return local
        return None

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            # no collection inside the counted calls: one would count the opcodes of Python gc callbacks (hypothesis
            # installs one once a @given test ran in the process), and where it lands depends on allocations made
            # outside the KV work (a first run's count off by more than its tolerance)
            collecting = not depth[0] and gc.isenabled()
            if collecting:
                gc.disable()
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if collecting:
                    gc.enable()
        return call

    targets = [(GuaranteedNoEvictScheduler, "step"), (KVCacheV2Scheduler, "step"), (SchedulerBase, "finish"),
               (KVCacheManager, "commit"), (KVCacheManagerV2, "commit")]
    saved = [(cls, name, cls.__dict__[name]) for cls, name in targets]
    for cls, name, fn in saved:
        setattr(cls, name, counted(fn))
    previous = sys.gettrace()  # a debugger's or coverage's: it is off inside the block and put back after
    sys.settrace(tracer)
    try:
        yield count
    finally:
        sys.settrace(previous)
        for cls, name, fn in saved:
            setattr(cls, name, fn)


@attrs.define
class Table:
    """One benchmark's result: a markdown table with the command that produced it and notes."""

    title: str
    command: str
    headers: list[str]
    rows: list[list[str]] = attrs.Factory(list)
    notes: list[str] = attrs.Factory(list)

    def markdown(self) -> str:
        """``### title``, the command, the table, then the notes as a list."""
        lines = [f"### {self.title}", "", f"`{self.command}`", ""]
        lines.append("| " + " | ".join(self.headers) + " |")
        lines.append("|" + "|".join("---" if i == 0 else "--:" for i in range(len(self.headers))) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        if self.notes:
            lines.append("")
            lines += [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def median(values: Sequence[float]) -> float:
    """The median."""
    return statistics.median(values)


def p99(values: Sequence[float]) -> float:
    """Nearest-rank 99th percentile."""
    ordered = sorted(values)
    return ordered[max(0, -(-99 * len(ordered) // 100) - 1)]


def timed_us(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall time of one call in microseconds, and its result."""
    start = time.perf_counter_ns()
    out = fn()
    return (time.perf_counter_ns() - start) / 1e3, out


def timed(call: Callable[[], T]) -> tuple[T, float, float]:
    """``call()``'s result, its wall seconds and the calling thread's CPU seconds (``time.thread_time``: with one torch
    thread the model computes on it, so other processes on a shared machine barely move it)."""
    start, cpu = time.perf_counter(), time.thread_time()
    out = call()
    return out, time.perf_counter() - start, time.thread_time() - cpu


@attrs.define
class Timings:
    """Wall and calling-thread CPU seconds of the timed runs of one thing, in run order."""

    walls: list[float] = attrs.Factory(list)
    cpus: list[float] = attrs.Factory(list)

    def add(self, call: Callable[[], T]) -> T:
        """Run ``call`` timed, keep its times, and return its result."""
        out, wall, cpu = timed(call)
        self.walls.append(wall)
        self.cpus.append(cpu)
        return out

    @property
    def wall(self) -> float:
        """The median wall seconds."""
        return statistics.median(self.walls)

    @property
    def cpu(self) -> float:
        """The median thread CPU seconds."""
        return statistics.median(self.cpus)


def repeat_timed(call: Callable[[], T], repeats: int, *, warmups: int = 0,
                 before: Callable[[], object] | None = None) -> tuple[Timings, T]:
    """``repeats`` timed calls after ``warmups`` untimed ones, ``before()`` (untimed) ahead of each: their
    :class:`Timings` and the last call's result."""
    if repeats < 1:
        raise ValueError(f"repeats: expected an integer >= 1, got {repeats}")
    for _ in range(warmups):
        if before is not None:
            before()
        call()
    timings = Timings()
    out: T
    for _ in range(repeats):
        if before is not None:
            before()
        out = timings.add(call)
    return timings, out


def us(value: float) -> str:
    """A duration in µs for a table cell."""
    return f"{value:,.2f}" if value < 10 else f"{value:,.1f}" if value < 1000 else f"{value:,.0f}"


def ratio(value: float) -> str:
    """A ratio for a table cell."""
    return f"{value:.2f}x"


def verdict(ok: bool) -> str:
    """Met / missed, for a target row."""
    return "met" if ok else "**missed**"


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (or platform's guess)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, str]:
    """What ran the benchmarks: CPU, cores, memory, Python, torch, date."""
    info = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": f"{cpu_model()}, {os.cpu_count()} logical cores",
        "python": f"{platform.python_implementation()} {sys.version.split()[0]}",
        "os": f"{platform.system()} {platform.release()}",
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        info["torch"] = "not installed"
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory"] = f"{pages * size / 2**30:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        pass
    return info
