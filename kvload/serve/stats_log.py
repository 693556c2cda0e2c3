"""``kvload serve``'s periodic throughput line, as vLLM logs it: "Avg prompt throughput: X tokens/s, Avg generation
throughput: Y tokens/s, Running: N reqs, Waiting: M reqs, GPU KV cache usage: Z%, Prefix cache hit rate: W%".

Every ``VLLM_LOG_STATS_INTERVAL`` seconds (vLLM's variable, 10 by default) a thread reads the engine's token totals
and one consistent snapshot (queues, the manager's usage and prefix-cache counters) and, while requests run or ran
in the interval (and once more as the server goes idle, with its zeros: vLLM's rule), has the engine loop emit an
``engine_stats`` event: the server's log (at info) and its audit. ``--disable-log-stats`` (vLLM's flag) turns it off.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from pipeline.errors import ConfigError
from pipeline.events import EngineStats
from pipeline.limits import short_text
from pipeline.thread_end import EndingThread

#: vLLM's variable for the seconds between two lines, and its default
INTERVAL_ENV = "VLLM_LOG_STATS_INTERVAL"
DEFAULT_INTERVAL_S = 10.0
#: the longest interval taken (a day): a longer one never logs in a server's life, which is no interval anyone means
MAX_INTERVAL_S = 86400.0


def interval_from_env(environ: Mapping[str, str]) -> float:
    """The seconds between two lines: ``VLLM_LOG_STATS_INTERVAL`` as vLLM reads it (a number), else 10;
    ``ConfigError`` naming the variable for anything but a number of seconds > 0 (at most a day)."""
    raw = environ.get(INTERVAL_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0 < value <= MAX_INTERVAL_S):  # nan fails too
        raise ConfigError(f"{INTERVAL_ENV}: expected a number of seconds > 0 (at most {MAX_INTERVAL_S:,.0f}; vLLM's "
                          f"default 10), got {short_text(raw, 40)}; --disable-log-stats turns the line off")
    return value


class StatsLogger:
    """Reads ``engine`` every ``interval_s`` seconds and has it emit an ``engine_stats`` line while it works."""

    def __init__(self, engine: Any, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self._clock = clock
        self._stop = threading.Event()
        self._thread: EndingThread | None = None
        self._since = clock()
        snap = engine.snapshot()
        self._prompt, self._generated = snap["prompt_tokens"], snap["generation_tokens"]
        self._queries, self._hits = self._reuse(snap.get("manager"))
        self._hit_rate = 0.0  # the last interval's that looked anything up (an idle one keeps it, as vLLM's window)
        self._was_active = False

    @staticmethod
    def _reuse(stats: Any) -> tuple[int, int]:
        if stats is None:
            return 0, 0
        return int(stats.reuse_query_tokens), int(stats.reuse_hit_tokens)

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._thread = EndingThread(target=self._run, name="kvload-log-stats", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the thread (idempotent); a line due meanwhile is not written."""
        self._stop.set()
        if self._thread is not None:
            self._thread.wait_end(5.0)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()

    def tick(self) -> EngineStats | None:
        """Read the interval since the last tick; the event handed to the engine to emit, or None when the server was
        idle all through it (and the line before said so already)."""
        engine = self.engine
        now = self._clock()
        elapsed = max(now - self._since, 1e-9)
        # the totals from the snapshot, at one step boundary with the queues: read before it, a step ending between
        # the two reads made an idle line (its request gone, its tokens not yet counted), then a line of those tokens
        # after it and a second idle line
        snap = engine.snapshot()
        prompt, generated = snap["prompt_tokens"], snap["generation_tokens"]
        stats = snap.get("manager")
        queries, hits = self._reuse(stats)
        if queries > self._queries:
            self._hit_rate = 100.0 * (hits - self._hits) / (queries - self._queries)
        new_prompt, new_generated = prompt - self._prompt, generated - self._generated
        self._since, self._prompt, self._generated = now, prompt, generated
        self._queries, self._hits = queries, hits
        active = bool(new_prompt or new_generated or snap["running"] or snap["waiting"])
        if not (active or self._was_active):
            return None
        self._was_active = active
        waiting = snap["waiting"] + snap.get("suspended", 0)
        event = EngineStats(prompt_throughput=round(new_prompt / elapsed, 1),
                            generation_throughput=round(new_generated / elapsed, 1), running=snap["running"],
                            waiting=waiting,
                            kv_cache_usage=round(100.0 * float(stats.usage), 1) if stats is not None else 0.0,
                            prefix_cache_hit_rate=round(self._hit_rate, 1), interval_s=round(elapsed, 3))
        engine.notify(event)
        return event
