"""What structured outputs' grammar mask costs a decode step (``engine.structured.constrain``, xgrammar).

Run from the repository root::

    python -m bench.bench_structured             # SmolLM2's tokenizer (49,152 tokens), batch 1 / 8 / 32

"thinking" is the JSON schema behind a reasoning parser (``reasoning_parser="deepseek_r1"``) while the sample still
thinks: its row is the thinking gate's (free but for marker tokens whose tail the grammar refuses), and a row whose
thinking ends starts again, so every timed row is a thinking row. The gate's token table (each token's text, built
once per model when the first gated request arrives) is timed apart.

Each row times one step's pick for ``batch`` decoding rows, as the executor does it: ``penalize`` (no penalties
set: it hands the logits back), then ``constrain`` with every row held to the grammar (none for "none"), then greedy
argmax; this thread's CPU time, median of ``--repeats`` interleaved rounds. Feeding the picked token to each row's
matcher (``Constraint.advance``, the driver's stop hook) is timed apart; a row whose grammar completes starts again.
The first step of a fresh request (compiling the spec with an empty cache, the matchers, the first mask) is timed
apart too. ``--parts`` also times the pieces of ``constrain`` at the same states.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench.common import machine
from cache_backends.request import Request
from engine.penalties import penalize
from engine.sampling_params import SamplingParams
from engine.structured import Constraint, GrammarBackend, constrain
from engine.structured_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"], "additionalProperties": False}
REGEX = r"[a-z]{3,12}\.[a-z]{2,8}@[a-z]{3,10}\.(com|org|net)"

#: A schema whose text says "Length" only in a description: no bounded string, so nothing for kvload to rewrite.
DESCRIBED = {"type": "object", "properties": {
    "wavelength": {"type": "number", "description": "Length of the wave, in nm"},
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
    "required": ["wavelength", "name"], "additionalProperties": False}

SETTINGS: dict[str, StructuredOutputsParams | None] = {
    "none": None,
    "json schema": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "thinking": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True, reasoning_parser="deepseek_r1"),
}


def smollm2_tokenizer() -> Any:
    """SmolLM2-135M's tokenizer, from kvload's one-time conversion of the packaged GGUF (as ``generate`` loads it)."""
    from models.checkpoint import resolve_checkpoint
    from models.gguf_cache import convert_gguf
    from models.weights import load_tokenizer

    return load_tokenizer(convert_gguf(resolve_checkpoint("smollm2-135m")))


class Rows:
    """One setting's ``batch`` decoding rows: requests, params and (constrained) their grammar states."""

    def __init__(self, backend: GrammarBackend, so: StructuredOutputsParams | None, batch: int) -> None:
        self.backend = backend
        self.so = so
        self.params = SamplingParams(structured_outputs=so)
        self.requests = [Request(f"r{b}", [1, 2, 3], 4096) for b in range(batch)]
        self.constraints: list[Constraint | None] = [
            backend.constraint(so) if so is not None else None for _ in range(batch)]

    def pick(self, logits: torch.Tensor) -> tuple[list[int], float]:
        """One step's tokens, and the µs of this thread's CPU the pick took (penalize, constrain, argmax)."""
        counts = [1] * len(self.requests)
        t0 = time.thread_time()
        picks = penalize(logits, counts, [(self.params, r) for r in self.requests], self.backend.stop_token_ids)
        if any(c is not None for c in self.constraints):
            picks = constrain(picks, logits, counts, [(c, ()) for c in self.constraints], self.backend)
        tokens = picks.argmax(dim=-1).tolist()
        return tokens, (time.thread_time() - t0) * 1e6

    def advance(self, tokens: list[int]) -> float:
        """Feed each row's token to its matcher (µs of CPU); a row whose grammar ended, or whose thinking did (a gated
        row stays a thinking row), starts over."""
        t0 = time.thread_time()
        ended = [c is not None and c.advance(t) for c, t in zip(self.constraints, tokens, strict=True)]
        spent = (time.thread_time() - t0) * 1e6
        for i, (c, done) in enumerate(zip(self.constraints, ended, strict=True)):
            if c is None or self.so is None:
                continue
            if self.so.reasoning_parser is not None and c.gate is None:
                self.constraints[i] = self.backend.constraint(self.so)
            elif done:
                c.matcher.reset()
        return spent


def parts_us(rows: Rows, logits: torch.Tensor) -> dict[str, float]:
    """The pieces of ``constrain`` for these rows at their current states, µs each (nothing is advanced)."""
    backend, xgr = rows.backend, rows.backend.xgr
    n = len(rows.constraints)
    out: dict[str, float] = {}
    t0 = time.thread_time()
    out_logits = logits.clone()
    out["clone logits"] = (time.thread_time() - t0) * 1e6
    t0 = time.thread_time()
    bitmask = xgr.allocate_token_bitmask(n, backend.vocab_size)
    out["allocate bitmask"] = (time.thread_time() - t0) * 1e6
    t0 = time.thread_time()
    for i, c in enumerate(rows.constraints):
        assert c is not None
        c.matcher.fill_next_token_bitmask(bitmask, i)
    out["fill bitmask (matchers)"] = (time.thread_time() - t0) * 1e6
    masked = list(range(n))
    t0 = time.thread_time()
    xgr.apply_token_bitmask_inplace(out_logits, bitmask, vocab_size=backend.vocab_size, indices=masked)
    out["apply bitmask"] = (time.thread_time() - t0) * 1e6
    t0 = time.thread_time()
    where = torch.tensor(masked, dtype=torch.long)
    bool(torch.isneginf(out_logits[where]).all(dim=-1).any())
    out["empty-row scan: gather + isneginf (before)"] = (time.thread_time() - t0) * 1e6
    t0 = time.thread_time()
    where = torch.tensor(masked, dtype=torch.long)
    bool(torch.isneginf(out_logits.amax(dim=-1)[where]).any())
    out["empty-row scan: amax (now)"] = (time.thread_time() - t0) * 1e6
    return out


def compile_times(backend: GrammarBackend, repeats: int) -> None:
    """Print each schema's ``GrammarBackend.compile`` time (ms of this thread's CPU, median of ``repeats``, schemas
    interleaved): the compiled grammar and the spec checks on it, from the schema's text."""
    schemas = {"json schema (bounded strings)": SETTINGS["json schema"],
               '"Length" only in a description': StructuredOutputsParams(json=DESCRIBED, disable_any_whitespace=True),
               "regex": SETTINGS["regex"]}
    times: dict[str, list[float]] = {name: [] for name in schemas}
    for _ in range(repeats):
        for name, so in schemas.items():
            assert so is not None
            backend._grammars.clear()  # kvload's own cache, which a request hits first (xgrammar's is off)
            t0 = time.thread_time()
            backend.compile(so)
            times[name].append((time.thread_time() - t0) * 1e3)
    print("| schema | compile ms (median) |")
    print("|---|--:|")
    for name, spent in times.items():
        print(f"| {name} | {statistics.median(spent):.2f} |")


def main(argv: list[str] | None = None) -> None:
    """Print the markdown tables: the pick per setting and batch, then (``--parts``) constrain's pieces."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--parts", action="store_true", help="also time constrain's pieces")
    p.add_argument("--compile", type=int, default=0, metavar="N",
                   help="only time GrammarBackend.compile, N times per schema (kvload's cache of compiled grammars "
                        "cleared each time; medians), then exit")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    tokenizer = smollm2_tokenizer()
    vocab = 49_152  # SmolLM2's config vocab_size (its tokenizer holds as many)
    backend = GrammarBackend(tokenizer, vocab, {tokenizer.eos_token_id}, "smollm2-135m")
    print(f"machine: {machine()}")
    t0 = time.thread_time()
    backend.token_text(0)  # the thinking gate's token table, once per model (else in thinking's first batch-1 step)
    print(f"thinking gate's token table (once per model): {(time.thread_time() - t0) * 1e3:.0f} ms")
    if args.compile:
        compile_times(backend, args.compile)
        return
    print("| batch | setting | compile ms (cold cache) | first step µs | pick µs (median) | over none | "
          "advance µs (median) |")
    print("|--:|---|--:|--:|--:|--:|--:|")
    parts: dict[int, dict[str, list[float]]] = {}
    for batch in map(int, args.batches.split(",")):
        rounds = [torch.randn(batch, vocab, generator=gen) for _ in range(8)]
        compile_ms: dict[str, float] = {}
        first: dict[str, float] = {}
        rows: dict[str, Rows] = {}
        for name, so in SETTINGS.items():
            if so is not None:
                backend.compiler.clear_cache()
                backend._grammars.clear()  # kvload's own cache of compiled grammars, which a request hits first
                t0 = time.thread_time()
                backend.compile(so)
                compile_ms[name] = (time.thread_time() - t0) * 1e3
            t0 = time.thread_time()
            rows[name] = Rows(backend, so, batch)
            tokens, _ = rows[name].pick(rounds[0])
            first[name] = (time.thread_time() - t0) * 1e6  # the rows' matchers built, then the first pick
            rows[name].advance(tokens)
        picks: dict[str, list[float]] = {name: [] for name in SETTINGS}
        advances: dict[str, list[float]] = {name: [] for name in SETTINGS}
        parts[batch] = {}
        for r in range(args.repeats):  # interleaved: every setting sees the same machine
            logits = rounds[r % len(rounds)]
            for name in SETTINGS:
                if args.parts and name not in ("none", "thinking"):
                    for k, v in parts_us(rows[name], logits).items():
                        parts[batch].setdefault(f"{name}: {k}", []).append(v)
                tokens, spent = rows[name].pick(logits)
                picks[name].append(spent)
                advances[name].append(rows[name].advance(tokens))
        base = statistics.median(picks["none"])
        for name in SETTINGS:
            med = statistics.median(picks[name])
            cold = f"{compile_ms[name]:.1f}" if name in compile_ms else "-"
            adv = f"{statistics.median(advances[name]):.0f}" if name != "none" else "-"
            print(f"| {batch} | {name} | {cold} | {first[name]:.0f} | {med:.0f} | {med / base:.1f}x | {adv} |")
    if args.parts:
        print()
        print("| batch | piece of constrain | µs (median) |")
        print("|--:|---|--:|")
        for batch, pieces in parts.items():
            for k, v in pieces.items():
                print(f"| {batch} | {k} | {statistics.median(v):.0f} |")


if __name__ == "__main__":
    main()
