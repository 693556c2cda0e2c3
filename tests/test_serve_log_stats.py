"""``kvload serve``'s periodic throughput line (vLLM's "Avg prompt throughput: ... tokens/s, Avg generation
throughput: ..., Running: N reqs, Waiting: M reqs, GPU KV cache usage: Z%, Prefix cache hit rate: W%"):
an ``engine_stats`` event every ``VLLM_LOG_STATS_INTERVAL`` seconds while requests run, off with
``--disable-log-stats``."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time

import openai

from tests.cli_support import ENV, REPO, reap, run_cli, served_with, until_ready
from tests.hostile_support import signals_as_a_terminal_gives_them
from tests.serve_support import serving, wait_for

PROMPT = list(range(5, 45))  # 40 token ids: tiny-llama is a preset (no tokenizer)
INTERVAL = 0.2


def _lines(result) -> list[dict]:
    return result.audit.of("engine_stats")


def _idle_after(result, requests: int) -> bool:
    """Whether a line saying idle came after the last of ``requests`` requests finished: every token was counted then.
    An idle line comes between two requests as well once the client takes an interval to send the next (a loaded
    machine): taken for the last one, the second request's tokens were not counted yet."""
    events = list(result.audit.events)
    finished = [i for i, e in enumerate(events) if e["event"] == "request_finished"]
    return len(finished) == requests and any(
        e["event"] == "engine_stats" and e["generation_throughput"] == 0 and e["running"] == 0
        for e in events[finished[-1] + 1:])


def test_the_line_counts_what_was_served_then_says_idle_once():
    """The lines' throughputs times their intervals add up to the tokens the client was told of; the server going idle
    gets one line of zeros, then none while nothing runs (vLLM logs while there is activity)."""
    with serving(state={"log_stats_interval_s": INTERVAL}) as s:
        first = s.client.completions.create(model=s.state.model_name, prompt=PROMPT, max_tokens=24, temperature=0)
        second = s.client.completions.create(model=s.state.model_name, prompt=PROMPT, max_tokens=8, temperature=0)
        wait_for(lambda: _idle_after(s.result, 2), what="the idle line after the second request")
        lines = _lines(s.result)
        generated = sum(r["generation_throughput"] * r["interval_s"] for r in lines)
        prompted = sum(r["prompt_throughput"] * r["interval_s"] for r in lines)
        told = first.usage.completion_tokens + second.usage.completion_tokens
        assert abs(generated - told) <= 0.1 * len(lines), (generated, told, lines)  # each rate rounded to 0.1
        assert abs(prompted - 2 * len(PROMPT)) <= 0.1 * len(lines), (prompted, lines)
        # the second prompt is the first one again: its whole blocks come from the prefix cache
        assert any(r["prefix_cache_hit_rate"] > 0 for r in lines), lines
        assert all(0 <= r["kv_cache_usage"] <= 100 and r["waiting"] == 0 for r in lines), lines
        assert lines[-1]["generation_throughput"] == 0 and lines[-1]["prompt_throughput"] == 0
        time.sleep(5 * INTERVAL)  # idle: no line
        assert len(_lines(s.result)) == len(lines)


class _EngineWhoseStepEndsAsItIsRead:
    """An engine for :class:`StatsLogger`: ``finishing`` tokens of a step under way are counted, and its one request
    done, at the step's end, which comes as the stats thread reads the engine (the thread waits for the loop's state
    lock there while the loop steps)."""

    def __init__(self) -> None:
        self.prompt_tokens_total = self.generation_tokens_total = self.running = self.finishing = 0
        self.lines: list = []

    def snapshot(self) -> dict:
        if self.finishing:  # the step ends: its tokens counted, its request gone
            self.generation_tokens_total += self.finishing
            self.finishing, self.running = 0, 0
        return {"running": self.running, "waiting": 0, "suspended": 0, "manager": None, "steps": 0,
                "prompt_tokens": self.prompt_tokens_total, "generation_tokens": self.generation_tokens_total}

    def notify(self, event) -> None:
        self.lines.append(event)


def test_a_step_ending_as_the_line_is_read_is_counted_in_that_line_and_idle_is_said_once():
    """The totals were read apart from the queues: a request's last step ending between the two reads made an idle
    line (the request gone, its tokens not yet counted), then a line of those tokens and a second idle line; a
    client's sum at the first idle line came out short."""
    from kvload.serve.stats_log import StatsLogger

    engine = _EngineWhoseStepEndsAsItIsRead()
    seconds = iter(range(10))
    logger = StatsLogger(engine, 1.0, clock=lambda: float(next(seconds)))
    engine.prompt_tokens_total, engine.generation_tokens_total, engine.running = 40, 24, 1
    logger.tick()
    engine.finishing = 8
    while logger.tick() is not None:
        pass
    assert [(e.prompt_throughput, e.generation_throughput, e.running) for e in engine.lines] == [
        (40.0, 24.0, 1), (0.0, 8.0, 0), (0.0, 0.0, 0)]


def test_serve_takes_vllms_interval_and_its_switch_turns_the_line_off(monkeypatch, log):
    """The interval is vLLM's ``VLLM_LOG_STATS_INTERVAL`` (10 by default); ``--disable-log-stats`` was taken and
    reported ``setting_ignored``: it now turns the line off, and nothing says it is ignored."""
    assert served_with(monkeypatch)["log_stats_interval_s"] == 10.0
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "2.5")
    assert served_with(monkeypatch)["log_stats_interval_s"] == 2.5
    log.events.clear()
    assert served_with(monkeypatch, "--disable-log-stats")["log_stats_interval_s"] is None
    assert not [e for e in log.events if e.get("event") == "setting_ignored"
                and e.get("field") == "disable_log_stats"], log.events


def test_a_bad_interval_is_one_line_naming_the_variable(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "ten")
    r = run_cli(capsys, "serve", "tiny-llama", "--port", "0")
    assert r.code == 2 and r.err.strip().splitlines() == [
        "error: VLLM_LOG_STATS_INTERVAL: expected a number of seconds > 0 (at most 86,400; vLLM's default 10), got "
        "'ten'; --disable-log-stats turns the line off"], r.err


def test_a_serving_process_logs_the_line_at_info():
    """A real ``kvload serve --log-level info`` process: the line comes out on stderr through structlog while an
    OpenAI client's request runs."""
    proc = subprocess.Popen([sys.executable, "-m", "kvload", "serve", "tiny-llama", "--port", "0", "--log-level",
                             "info", "--max_tokens", "1024"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                                            "VLLM_LOG_STATS_INTERVAL": str(INTERVAL)},
                            cwd=REPO, preexec_fn=signals_as_a_terminal_gives_them)
    try:
        url = until_ready(proc)[-1].split(" at ", 1)[1].split(" ", 1)[0]
        lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            done = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=32, temperature=0)
        assert done.usage.completion_tokens > 0
        deadline, seen = time.monotonic() + 30, []
        while not any("engine_stats" in line and "generation_throughput=0.0 " not in line for line in seen):
            assert time.monotonic() < deadline, seen
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                continue
        (line,) = [x for x in seen if "engine_stats" in x and "generation_throughput=0.0 " not in x][:1]
        for field in ("prompt_throughput=", "generation_throughput=", "running=", "waiting=", "kv_cache_usage=",
                      "prefix_cache_hit_rate="):
            assert field in line, line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        reap(proc)
