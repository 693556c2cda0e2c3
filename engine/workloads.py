"""Deterministic synthetic workloads for ``kvload simulate``: who arrives when, with which tokens.

A workload is a list of :class:`SimRequest` — prompt token ids, a scripted answer (the tokens the
"model" will produce), an arrival step, and optionally a dependency on an earlier request (a
conversation's next turn arrives once the previous one finished). The same seed gives the same
workload, token for token. Each workload also knows its *ideal* prefix-reuse: the prompt tokens an
unbounded cache with token-granular reuse could skip, given the arrival order.

Ideal reuse, per workload (what ``ideal_reuse`` counts for one request):

* ``shared-prefix``: the shared prefix (``prefix_len`` tokens) for every prompt but the first of its
  group; the first computes it. Assumes the first prompt's prefill is done when the next arrives
  (true unless ``max_num_tokens`` chops it into chunks longer than one step between arrivals).
* ``multi-turn``: turn ``k > 0`` extends turn ``k - 1``'s prompt and answer; everything of that
  history was computed except its last answer token (sampled, never fed back), so the ideal is
  ``len(history) - 1``. Block-granular caches get this rounded down to whole blocks.
* ``long-context`` and ``no-reuse``: 0 (unrelated random prompts).

An ideal never counts a prompt's last token: it is always computed, for the logits.

Unrelated token runs never share a prefix by chance: every fresh segment that starts where prompts
branch (a group's prefix, a question, a conversation's first turn, a unique prompt) begins with a
marker token unique within the workload (for up to ``vocab - 1`` segments), so a cache that reuses
partial blocks cannot "hit" a random first token and beat the ideal.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable

import attrs

from pipeline.limits import short_py


@attrs.frozen
class SimRequest:
    """One request of a workload."""

    req_id: str
    prompt: tuple[int, ...]
    answer: tuple[int, ...]
    arrival_step: int = 0
    after: str | None = None  # arrives only once this request finished (multi-turn)
    ideal_reuse: int = 0  # prompt tokens an ideal cache would reuse for this request
    salt: str | None = None
    priority: int = 0


@attrs.frozen
class Workload:
    """A named, seeded list of requests with the reuse an ideal cache would get."""

    name: str
    requests: tuple[SimRequest, ...]
    seed: int
    params: dict = attrs.field(factory=dict, hash=False)

    @property
    def prompt_tokens(self) -> int:
        """Sum of prompt lengths."""
        return sum(len(r.prompt) for r in self.requests)

    @property
    def ideal_reused_tokens(self) -> int:
        """Prompt tokens an ideal cache would not recompute."""
        return sum(r.ideal_reuse for r in self.requests)

    @property
    def ideal_hit_rate(self) -> float:
        """Ideal reused prompt tokens / prompt tokens."""
        return self.ideal_reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def max_sequence_tokens(self) -> int:
        """The longest prompt + answer in the workload."""
        return max(len(r.prompt) + len(r.answer) for r in self.requests)


def _tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    # Token 0 is never used so a sequence of fresh tokens cannot accidentally equal padding.
    return tuple(rng.randrange(1, vocab) for _ in range(n))


class _Segments:
    """Fresh token runs for branch points: a unique marker token, then random tokens."""

    def __init__(self, rng: random.Random, vocab: int) -> None:
        self.rng, self.vocab, self.count = rng, vocab, 0

    def __call__(self, n: int) -> tuple[int, ...]:
        marker = 1 + self.count % (self.vocab - 1)
        self.count += 1
        return (marker, *_tokens(self.rng, n - 1, self.vocab))


def shared_prefix(requests: int = 1024, seed: int = 0, *, group_size: int = 16, prefix_len: int = 2048,
                  question_len: int = 128, answer_len: int = 256, vocab: int = 32000) -> Workload:
    """Groups of prompts sharing a long system prompt; one arrival per step, group after group."""
    rng = random.Random(seed)
    fresh = _Segments(rng, vocab)
    out = []
    prefix: tuple[int, ...] = ()
    for i in range(requests):
        if i % group_size == 0:
            prefix = fresh(prefix_len)
        prompt = prefix + fresh(question_len)
        reuse = 0 if i % group_size == 0 else min(prefix_len, len(prompt) - 1)
        out.append(SimRequest(f"sp-{i}", prompt, _tokens(rng, answer_len, vocab), arrival_step=i, ideal_reuse=reuse))
    params = {"group_size": group_size, "prefix_len": prefix_len, "question_len": question_len,
              "answer_len": answer_len}
    return Workload("shared-prefix", tuple(out), seed, params)


def multi_turn(requests: int = 256, seed: int = 0, *, turns: int = 4, first_len: int = 512, user_len: int = 64,
               answer_len: int = 128, vocab: int = 32000) -> Workload:
    """Conversations whose each turn's prompt extends the previous prompt and answer; turn k waits for k-1.
    ``requests`` not a multiple of ``turns``: the last conversation has the turns left over."""
    rng = random.Random(seed)
    fresh = _Segments(rng, vocab)
    conversations = -(-requests // turns)  # rounded up: the count asked for, not the whole conversations below it
    out = []
    for c in range(conversations):
        history: tuple[int, ...] = ()
        prev: str | None = None
        for t in range(turns):
            if len(out) >= requests:
                break
            prompt = fresh(first_len) if t == 0 else history + _tokens(rng, user_len, vocab)
            answer = _tokens(rng, answer_len, vocab)
            # The previous prompt and answer were computed, except the last answer token (never fed back).
            reuse = 0 if t == 0 else min(len(history) - 1, len(prompt) - 1)
            req_id = f"mt-{c}-{t}"
            out.append(SimRequest(req_id, prompt, answer, arrival_step=c if t == 0 else 0, after=prev,
                                  ideal_reuse=reuse))
            history, prev = prompt + answer, req_id
    params = {"turns": turns, "first_len": first_len, "user_len": user_len, "answer_len": answer_len}
    return Workload("multi-turn", tuple(out), seed, params)


def long_context(requests: int = 16, seed: int = 0, *, prompt_len: int = 7936, answer_len: int = 256,
                 vocab: int = 32000) -> Workload:
    """A few long, unrelated sequences arriving together: what bounds concurrency is memory per sequence."""
    rng = random.Random(seed)
    fresh = _Segments(rng, vocab)
    out = [SimRequest(f"lc-{i}", fresh(prompt_len), _tokens(rng, answer_len, vocab)) for i in range(requests)]
    return Workload("long-context", tuple(out), seed, {"prompt_len": prompt_len, "answer_len": answer_len})


def no_reuse(requests: int = 512, seed: int = 0, *, prompt_len: int = 512, answer_len: int = 128,
             vocab: int = 32000) -> Workload:
    """Unique prompts, one arrival per step: nothing to reuse, so reuse bookkeeping is pure overhead."""
    rng = random.Random(seed)
    fresh = _Segments(rng, vocab)
    out = [SimRequest(f"nr-{i}", fresh(prompt_len), _tokens(rng, answer_len, vocab), arrival_step=i)
           for i in range(requests)]
    return Workload("no-reuse", tuple(out), seed, {"prompt_len": prompt_len, "answer_len": answer_len})


def mixed_priority(requests: int = 512, seed: int = 0, *, prompt_len: int = 1024, answer_len: int = 128,
                   urgent_every: int = 4, urgent_len: int = 64, urgent_answer_len: int = 32,
                   vocab: int = 32000) -> Workload:
    """Long batch prompts (priority 0) with a short urgent one (priority 1) every ``urgent_every``-th arrival, one
    arrival per step, unique tokens: what ``scheduling_policy`` decides is who waits when memory runs short."""
    rng = random.Random(seed)
    fresh = _Segments(rng, vocab)
    out = []
    for i in range(requests):
        urgent = i % urgent_every == urgent_every - 1
        n, m = (urgent_len, urgent_answer_len) if urgent else (prompt_len, answer_len)
        out.append(SimRequest(f"mp-{i}", fresh(n), _tokens(rng, m, vocab), arrival_step=i, priority=int(urgent)))
    return Workload("mixed-priority", tuple(out), seed,
                    {"prompt_len": prompt_len, "answer_len": answer_len, "urgent_every": urgent_every,
                     "urgent_len": urgent_len, "urgent_answer_len": urgent_answer_len})


def _mixed_shape(requests: int, seed: int, p: dict[str, int]) -> list[tuple[int, int, int, int, bool]]:
    """Per request of ``mixed``: (own prompt tokens, answer tokens, shared prefix index or -1, arrival gap, urgent).

    Drawn from a generator of its own, apart from the token ids, so :func:`planned_tokens` can replay the sizes
    without building the workload."""
    rng = random.Random(f"mixed-shape-{seed}")

    def log_uniform(lo: int, hi: int) -> int:
        return lo if hi <= lo else min(hi, int(lo * (hi / lo) ** rng.random()))

    out = []
    for _ in range(requests):
        own = log_uniform(p["prompt_min"], p["prompt_max"])
        answer = log_uniform(p["answer_min"], p["answer_max"])
        shared = rng.randrange(p["prefixes"]) if p["prefixes"] and rng.randrange(100) < p["shared_percent"] else -1
        out.append((own, answer, shared, rng.randint(0, p["max_gap"]), rng.randrange(100) < p["urgent_percent"]))
    return out


def mixed(requests: int = 256, seed: int = 0, *, prompt_min: int = 16, prompt_max: int = 2048, answer_min: int = 1,
          answer_max: int = 256, prefixes: int = 4, prefix_len: int = 512, shared_percent: int = 50,
          urgent_percent: int = 0, max_gap: int = 3, vocab: int = 32000) -> Workload:
    """Traffic as it comes: prompt and answer lengths log-uniform over their ranges, ``shared_percent`` of the
    prompts after one of ``prefixes`` system prompts, arrivals 0 to ``max_gap`` steps apart (bursts included), and
    ``urgent_percent`` of the requests at priority 1.

    The four workloads above each isolate one effect; this one mixes them, so a manager cannot win by being tuned
    to one shape. A prompt on a system prompt whose first use arrived at an earlier step ideally reuses it (as in
    ``shared-prefix``); one arriving in the same burst as that first use computes it alongside."""
    p = {"prompt_min": prompt_min, "prompt_max": prompt_max, "answer_min": answer_min, "answer_max": answer_max,
         "prefixes": prefixes, "prefix_len": prefix_len, "shared_percent": shared_percent,
         "urgent_percent": urgent_percent, "max_gap": max_gap}
    rng = random.Random(seed)
    fresh = _Segments(rng, vocab)
    system = [fresh(prefix_len) for _ in range(prefixes)]
    first_at: dict[int, int] = {}  # system prompt -> the step its first use arrived
    out, step = [], 0
    for i, (own, answer, shared, gap, urgent) in enumerate(_mixed_shape(requests, seed, p)):
        step += gap
        prefix = system[shared] if shared >= 0 else ()
        prompt = prefix + fresh(own)
        # arriving with the first use (a burst), it is computed alongside, not reused
        reuse = min(prefix_len, len(prompt) - 1) if first_at.get(shared, step) < step else 0
        if shared >= 0:
            first_at.setdefault(shared, step)
        out.append(SimRequest(f"mx-{i}", prompt, _tokens(rng, answer, vocab), arrival_step=step, ideal_reuse=reuse,
                              priority=int(urgent)))
    return Workload("mixed", tuple(out), seed, p)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "long-context": long_context,
    "no-reuse": no_reuse,
    "mixed-priority": mixed_priority,
    "mixed": mixed,
}


def workload_params(name: str) -> dict[str, int]:
    """The tunable size parameters of a workload (keyword-only arguments) with their defaults."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    sig = inspect.signature(WORKLOADS[name])
    return {p.name: p.default for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}


#: Most token ids a workload may hold (prompts + answers, counted per request): about 40 bytes each in
#: Python tuples, so ~700 MB at the limit; the default shared-prefix workload holds 2.5M.
MAX_WORKLOAD_TOKENS = 2**24
#: Most requests a workload may have, and the largest vocabulary its token ids are drawn from.
MAX_REQUESTS = 1_000_000
MAX_VOCAB = 2**31 - 1


#: Workload parameters that may be 0 (none shared, none urgent, all arriving at once); every other is at least 1.
_MAY_BE_ZERO = frozenset({"prefixes", "shared_percent", "urgent_percent", "max_gap"})


def planned_tokens(name: str, requests: int, params: dict[str, int], seed: int = 0) -> int:
    """Token ids the workload will hold (sum over requests of prompt + answer; with ``mixed``'s system prompts,
    drawn up front to build it), computed without building it."""
    p = {**workload_params(name), **params}
    if name == "shared-prefix":
        return requests * (p["prefix_len"] + p["question_len"] + p["answer_len"])
    if name == "multi-turn":
        turns, step = p["turns"], p["answer_len"] + p["user_len"]

        def conversation(t: int) -> int:  # t turns: each prompt is the last one, its answer and a user message
            return t * (p["first_len"] + p["answer_len"]) + step * t * (t - 1) // 2

        return requests // turns * conversation(turns) + conversation(requests % turns)
    if name == "mixed-priority":
        urgent = requests // p["urgent_every"]
        return (requests - urgent) * (p["prompt_len"] + p["answer_len"]) + urgent * (p["urgent_len"]
                                                                                   + p["urgent_answer_len"])
    if name == "mixed":
        shapes = _mixed_shape(requests, seed, p)  # the sizes alone: no token id is drawn
        # every system prompt is drawn up front, used or not (prefixes=10**6 on 2 requests drew 512M ids)
        return p["prefixes"] * p["prefix_len"] + sum(own + answer + (p["prefix_len"] if shared >= 0 else 0)
                                                     for own, answer, shared, _, _ in shapes)
    return requests * (p["prompt_len"] + p["answer_len"])


def fresh_segments(name: str, requests: int, params: dict[str, int]) -> int:
    """The fresh token runs (each opened by its own marker token) the workload draws, computed without building it:
    every prompt's own part, plus shared-prefix's group prefixes and mixed's system prompts; a conversation draws one
    (its first turn), the later turns extending it."""
    if name == "shared-prefix":
        return -(-requests // params["group_size"]) + requests
    if name == "multi-turn":
        return -(-requests // params["turns"])
    if name == "mixed":
        return params["prefixes"] + requests
    return requests


def _unused_sharing(name: str, merged: dict[str, int], given: dict[str, int]) -> str | None:
    """Why ``mixed``'s sharing parameters the caller gave would do nothing (none shared: ``prefixes=0`` or
    ``shared_percent=0``, against a size for what is shared), or None. Not a silent no-op: one line naming both."""
    if name != "mixed":
        return None
    for off in ("prefixes", "shared_percent"):
        if merged[off] != 0:
            continue
        for key in ("shared_percent", "prefixes", "prefix_len"):
            if key != off and key in given and (merged[key] != 0 or key == "prefix_len"):
                return (f"{key}={merged[key]} does nothing with {off}=0 (no prompt then shares a system prompt); "
                        f"give {off} >= 1, or leave {key} out")
    return None


def make_workload(name: str, requests: int | None = None, seed: int = 0, /, **params: int) -> Workload:
    """Build a workload by name; ``requests`` None keeps the workload's default size.

    ``ValueError`` names an unknown workload or parameter, a size below 1 (0 where none is a choice: no shared
    prefix, nothing urgent, no gap), a range whose ``_min`` is above its ``_max``, or sizes that would hold
    more than :data:`MAX_WORKLOAD_TOKENS` token ids (checked before anything is built).
    """
    known = workload_params(name)
    for key, value in params.items():
        if key in ("requests", "seed"):  # positional only above, so a parameter of that name reaches this line (it
            # was Python's "TypeError: make_workload() got multiple values for argument 'requests'")
            raise ValueError(f"workload {name}: {key} is no workload parameter (--workload-arg) but the simulation's "
                             f"own: give --{key} N (make_workload's {key} argument)")
        if key not in known:
            raise ValueError(f"workload {name} has no parameter {key!r}; known: {', '.join(known)}")
        least = 2 if key == "vocab" else 0 if key in _MAY_BE_ZERO else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"workload {name}: {key} must be an integer >= {least}, got {short_py(value)}")
        if key.endswith("_percent") and value > 100:
            raise ValueError(f"workload {name}: {key} is a percentage, 0 to 100, got {short_py(value)}")
    merged = {**known, **params}
    for key in params:
        low, high = key[:-4] + "_min", key[:-4] + "_max"  # a range's ends, for a key that is one
        if key.endswith(("_min", "_max")) and low in merged and high in merged and merged[low] > merged[high]:
            raise ValueError(f"workload {name}: {low}={merged[low]} is more than {high}={merged[high]}; "
                             f"need {low} <= {high}")
    unused = _unused_sharing(name, merged, params)
    if unused is not None:
        raise ValueError(f"workload {name}: {unused}")
    if "vocab" in params and params["vocab"] > MAX_VOCAB:
        raise ValueError(f"workload {name}: vocab must be at most {MAX_VOCAB:,}, got {params['vocab']:,}")
    if requests is not None and (not isinstance(requests, int) or isinstance(requests, bool) or requests < 1):
        raise ValueError(f"workload {name}: requests must be an integer >= 1, got {short_py(requests)}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"workload {name}: seed must be an integer >= 0, got {short_py(seed)}")
    factory = WORKLOADS[name]
    count = requests if requests is not None else inspect.signature(factory).parameters["requests"].default
    if count > MAX_REQUESTS:
        shown = f"{count:,}" if count < 10**24 else short_py(count)  # (10**5000's digits cannot be written)
        raise ValueError(f"workload {name}: requests={shown} is more than {MAX_REQUESTS:,}; lower --requests")
    segments = fresh_segments(name, count, merged)
    # the default grows (the ids are synthetic; their uniqueness is what the ideal hit rate rests on)
    if "vocab" not in params and segments > merged["vocab"] - 1:
        params = {**params, "vocab": segments + 1}
    elif segments > merged["vocab"] - 1:  # a marker drawn twice lets unrelated prompts share a prefix by chance
        raise ValueError(f"workload {name}: vocab={merged['vocab']:,} gives {merged['vocab'] - 1:,} distinct marker "
                         f"tokens (id 0 is never drawn), fewer than its {segments:,} unrelated prompt segments, each "
                         f"of which begins with its own: unrelated prompts would share a prefix by chance and the hit "
                         f"rate could pass the ideal; give --workload-arg vocab={segments + 1} or more, or fewer "
                         f"--requests")
    tokens = planned_tokens(name, count, params, seed)
    if tokens > MAX_WORKLOAD_TOKENS:
        sizes = ", ".join(f"{k}={v:,}" for k, v in {**workload_params(name), **params}.items() if k != "vocab")
        raise ValueError(f"workload {name}: requests={count:,} with {sizes} holds {tokens:,} token ids, more than "
                         f"the {MAX_WORKLOAD_TOKENS:,} a simulation keeps in memory; lower --requests or the "
                         "--workload-arg sizes")
    return factory(seed=seed, **params) if requests is None else factory(requests, seed, **params)


def default_budget_sequences(workload: Workload) -> int:
    """How many of the workload's longest sequences the default ``simulate`` budget holds.

    * ``shared-prefix``, ``no-reuse``: ``answer_len + 1`` — one request arrives per step and lives
      about ``answer_len + 1`` steps, so that many run at once; the budget holds every running
      request's worst case even without sharing (the working set, with room to spare).
    * ``multi-turn``: one per conversation (all conversations are open at once).
    * ``long-context``: 2 — memory-bound on purpose: concurrency is then decided by what one
      sequence costs each manager (sliding windows, compression).
    * ``mixed-priority``: ``answer_len // 4``, at least 2 — a quarter of the ``answer_len + 1`` requests that
      one arrival per step keeps running at once, so requests queue and ``scheduling_policy`` decides which wait.
    * ``mixed``: ``answer_max // 32``, at least 2 — a little less than its arrivals keep running at once, so
      requests queue a while (the defaults on tiny-llama: V1 runs 19.4 at once on average, against 21.3 with memory
      to spare, and admits a request 37 steps after it arrives): admission, headroom and eviction all decide
      something.

    Never more than the number of requests.
    """
    p = workload.params
    if workload.name in ("shared-prefix", "no-reuse"):
        n = p["answer_len"] + 1
    elif workload.name == "multi-turn":
        n = len({r.req_id.rsplit("-", 1)[0] for r in workload.requests})
    elif workload.name == "mixed-priority":
        n = max(2, p["answer_len"] // 4)
    elif workload.name == "mixed":
        n = max(2, p["answer_max"] // 32)
    else:
        n = 2
    return max(1, min(n, len(workload.requests)))
