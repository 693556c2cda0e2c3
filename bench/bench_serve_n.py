"""``kvload serve``: one request with ``n`` choices (one prefill, forked) against ``n`` requests of the same prompt.

Run from the repository root::

    python -m bench.bench_serve_n                  # SmolLM2-135M, n=4, a 403-token prompt, 16 tokens, 5 repeats
    python -m bench.bench_serve_n --n 4 --prompt-words 64 --tokens 4 --repeats 1

One real ``kvload serve`` process (``bench.bench_serve.start_server``, one torch thread); the client is the
``openai`` package's ``AsyncOpenAI`` in this process, streaming completions of one raw-text prompt (the first
``--prompt-words`` words of ``bench/text_prompts.txt``, Python source: the default 280 are 403 SmolLM2 tokens),
sampled (temperature 0.8, seed S) with ``ignore_eos`` so every choice generates exactly ``--tokens`` tokens. Three
sides, each under a ``cache_salt`` nothing was cached under:

- ``n=N``: one request with ``n=N``: choice 0 prefills, the others fork its prompt KV (``engine.serving``);
- ``N requests, one salt``: N requests (n=1, seed S + j) sent at once, sharing a salt: what a client fanning out gets,
  with the prefix cache sharing whatever blocks one request has committed before the next is scheduled;
- ``N requests, own salts``: the same with a salt each: no sharing at all, as with forking and prefix reuse off.

Per side and repeat: wall time (sent → the last choice's end), TTFT per choice, the server process's CPU seconds
(``/proc/PID/stat``: on a machine shared with other jobs it moves less than wall time), and from /metrics, before and
after (the sides run one at a time), the prompt tokens the server computed
(``kvload_request_prefill_kv_computed_tokens_sum``), its engine steps and the tokens they computed
(``kvload_iteration_tokens_total``'s count and sum). Choice j of ``n=N`` is the request with seed S + j, so every
side generates the same tokens (checked). Sides rotate order each repeat; medians over repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import time
from pathlib import Path
from typing import Any

from bench.bench_serve import start_server, stop_server
from bench.common import Table, median

COMPUTED = "kvload_request_prefill_kv_computed_tokens_sum"
STEPS = "kvload_iteration_tokens_total"  # a histogram: one observation per engine step, its computed tokens
TEXT = Path(__file__).with_name("text_prompts.txt")
_salts = itertools.count()


def prompt_text(words: int) -> str:
    """The first ``words`` whitespace-separated words of ``text_prompts.txt``."""
    return " ".join(TEXT.read_text().split()[:words])


def counters(http: Any, pid: int) -> dict[str, float]:
    """The server's counters so far: prompt tokens computed (every request), engine steps and the tokens they
    computed (/metrics), and its process's CPU seconds (/proc: less moved by other jobs than wall time)."""
    from prometheus_client.parser import text_string_to_metric_families

    want = {COMPUTED: "computed", STEPS + "_count": "steps", STEPS + "_sum": "step_tokens"}
    got = {want[s.name]: s.value for family in text_string_to_metric_families(http.get("/metrics").text)
           for s in family.samples if s.name in want}
    if len(got) != len(want):
        raise RuntimeError(f"/metrics lacks {sorted(set(want.values()) - set(got))}")
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    got["cpu"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return got


async def stream(client: Any, model: str, prompt: str, n: int, seed: int, tokens: int, salt: str,
                 sent: float) -> dict[int, dict[str, Any]]:
    """One streamed completion; per choice index its first-token and end times and its token ids."""
    got: dict[int, dict[str, Any]] = {}
    response = await client.completions.create(model=model, prompt=prompt, n=n, seed=seed, temperature=0.8,
                                               max_tokens=tokens, stream=True,
                                               extra_body={"ignore_eos": True, "cache_salt": salt})
    async for chunk in response:
        now = time.perf_counter()
        for c in chunk.choices:
            ids = c.model_extra.get("token_ids") or []
            entry = got.setdefault(c.index, {"first": None, "end": now, "ids": []})
            if ids and entry["first"] is None:
                entry["first"] = now
            entry["ids"] += ids
            entry["end"] = now
    return {j: {**e, "ttft": e["first"] - sent} for j, e in got.items()}


async def side_run(url: str, side: str, model: str, prompt: str, n: int, seed: int, tokens: int) -> dict[str, Any]:
    """One repeat of ``side``: wall time, TTFTs, every choice's tokens (in choice order)."""
    import openai

    tag = f"bench-n-{os.getpid()}-{next(_salts)}"
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0) as client:
        sent = time.perf_counter()
        if side == "forked":
            one = await stream(client, model, prompt, n, seed, tokens, tag, sent)
            choices = [one[j] for j in range(n)]
        else:
            salts = [tag] * n if side == "one salt" else [f"{tag}-{j}" for j in range(n)]
            outs = await asyncio.gather(*(stream(client, model, prompt, 1, seed + j, tokens, salts[j], sent)
                                          for j in range(n)))
            choices = [o[0] for o in outs]
    return {"wall": max(c["end"] for c in choices) - sent, "ttft": [c["ttft"] for c in choices],
            "ids": [c["ids"] for c in choices]}


def main() -> None:
    """Print the side-by-side table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-words", dest="prompt_words", type=int, default=280,
                        help="words of text_prompts.txt in the prompt (280: 403 SmolLM2 tokens)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens each choice generates")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", dest="max_tokens", type=int, default=8192, help="the server's KV budget")
    ns = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import httpx

    prompt = prompt_text(ns.prompt_words)
    names = {"forked": f"n={ns.n} (one prefill, forked)", "one salt": f"{ns.n} requests, one salt",
             "own salts": f"{ns.n} requests, own salts"}
    proc, url = start_server(ns.model, ns.max_tokens)
    try:
        with httpx.Client(base_url=url, timeout=600) as http:
            asyncio.run(side_run(url, "forked", ns.model, prompt[:200], 2, 1, 2))  # warm-up: first-call costs
            runs: dict[str, list[dict[str, Any]]] = {side: [] for side in names}
            order = list(runs)
            for i in range(ns.repeats):
                for side in order[i % len(order):] + order[:i % len(order)]:
                    before = counters(http, proc.pid)
                    r = asyncio.run(side_run(url, side, ns.model, prompt, ns.n, 100 + i, ns.tokens))
                    r.update({k: v - before[k] for k, v in counters(http, proc.pid).items()})
                    runs[side].append(r)
                same = {tuple(map(tuple, runs[side][i]["ids"])) for side in order}
                if len(same) != 1:
                    raise RuntimeError(f"repeat {i}: the sides generated different tokens")
    finally:
        stop_server(proc)
    prompt_len = int(runs["forked"][0]["computed"])  # the forked side computes the prompt exactly once
    wall = {side: median([r["wall"] for r in rs]) for side, rs in runs.items()}
    table = Table(f"kvload serve: n={ns.n} choices vs {ns.n} requests of one prompt ({ns.model}, ~{prompt_len} "
                  f"prompt tokens, {ns.tokens} tokens per choice, sampled, median of {ns.repeats})",
                  f"python -m bench.bench_serve_n --model {ns.model} --n {ns.n} --prompt-words {ns.prompt_words} "
                  f"--tokens {ns.tokens} --repeats {ns.repeats}",
                  ["side", "wall p50 (s)", "vs n", "server CPU p50 (s)", "vs n", "TTFT p50 (s)", "TTFT max p50 (s)",
                   "prompt tokens computed p50", "engine steps p50", "tokens computed by steps p50"])
    cpu = {side: median([r["cpu"] for r in rs]) for side, rs in runs.items()}
    for side, rs in runs.items():
        table.rows.append([names[side], f"{wall[side]:.3f}",
                           f"{wall[side] / wall['forked']:.2f}x" if side != "forked" else "", f"{cpu[side]:.2f}",
                           f"{cpu[side] / cpu['forked']:.2f}x" if side != "forked" else "",
                           f"{median([t for r in rs for t in r['ttft']]):.3f}",
                           f"{median([max(r['ttft']) for r in rs]):.3f}",
                           f"{median([r['computed'] for r in rs]):.0f}", f"{median([r['steps'] for r in rs]):.0f}",
                           f"{median([r['step_tokens'] for r in rs]):.0f}"])
    table.notes.append(f"every side generated the same {ns.n} x {ns.tokens} tokens in each repeat "
                       "(choice j = seed + j)")
    print(table.markdown())


if __name__ == "__main__":
    main()
