"""Beam search over kvload's executor (vLLM's ``LLM.beam_search``), its beams kept alive as running requests.

One call is one run of the engine's driver. Each prompt is prefilled once; from then on every live beam is a
running request holding its KV, and each step computes exactly one token per live beam, keeping its
``2 * beam_width`` most likely next tokens. Per prompt, once all its live beams have theirs, the candidates
(beam, token) are ranked by cumulative log-probability: the best ``beam_width`` that are not EOS go on; an EOS
candidate ranked among the first ``beam_width`` ends its hypothesis there (``ignore_eos``: EOS is an ordinary
token). A beam that goes on with one candidate keeps its request (the token appended); each further candidate of
the same beam is a fork of it at its committed length (``Driver.branch``: whole blocks shared by reference count,
the partial last block copied); a beam no candidate extends is freed at once. At the end every hypothesis —
finished or still running at ``max_tokens`` — is scored ``cumulative_logprob / generated_tokens **
length_penalty`` and the best ``beam_width`` are returned, best first. With ``ignore_eos`` this is transformers'
``generate(num_beams=...)`` run without an EOS token. Each hypothesis carries per token the log-probability entry of
the step that chose it (the chosen token and the ``logprobs`` most likely, default the ``2 * beam_width`` ranked, as
vLLM's ``BeamSearchSequence.logprobs``); their sum is its cumulative log-probability. A beam keeps its entries as a
chain shared with the beams it forked from, so a fork copies none of them.

Room: prompts start while their beams fit the batch (``max_batch_size``). A fork the scheduler cannot admit now
(no room in the batch or the pools) waits as a request of its own, admitted later with what the prefix cache
still holds. When every running beam waits for its prompt's other beams and nothing waiting can be admitted, the
running ones let go of their KV (they keep their next-token log-probabilities) so the waiting ones can run: a
search wider than the pools still ends, computing again what it let go of.

The width is bounded by the load's ``max_beam_width`` (TensorRT-LLM sizes its engine by it, and kvload's router
sends beam search to KV cache manager V1 by TensorRT-LLM's rule; V1 forks at any length, V2 at a prompt's end).
The audit log holds one generation segment per call; a beam's request ends ``"pruned"`` when no candidate
extends it.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from cache_backends.interface import SchedulerOutput
from cache_backends.request import Request
from engine.driver import MAX_IDLE_STEPS, Driver, StalledError, StepStats
from engine.outputs import GenerationStats
from engine.sampling import Logprob, TokenLogprobs, sample_rows, top_logprobs
from engine.sampling_params import (
    DEFAULT_MAX_TOKENS,
    SamplingParams,
    _plain_int,
    _plain_number,
    check,
    check_logprobs,
    check_salt,
    is_finite,
    is_int,
    is_number,
)
from pipeline.errors import GenerationError, KvRuntimeError, did_you_mean, first_line, retitled
from pipeline.events import (
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    RequestFinished,
    RequestPreempted,
    SettingIgnored,
)
from pipeline.limits import MAX_INT, MAX_N, int_text, plain_flag

if TYPE_CHECKING:
    from engine.executor import GenerationExecutor as Executor


#: vLLM's ``BeamSearchParams`` fields kvload does not have → what to do instead.
VLLM_BEAM_FIELDS_NOT_TAKEN: dict[str, str] = {
    "include_stop_str_in_output": "kvload's beam search takes no stop strings (a hypothesis ends at EOS or "
                                  "max_tokens), so there is none to include",
}


#: BeamSearchParams' keywords, as its unknown-field refusal lists them.
BEAM_FIELDS = ("beam_width", "ignore_eos", "length_penalty", "logprobs", "max_tokens", "temperature")
#: beam_width's default in the signature: none was given (a TypeError of Python's named it, after any misspelt one).
_REQUIRED: Any = object()


@attrs.frozen(init=False)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``beam_width`` beams, up to ``max_tokens`` new tokens each, greedy; kvload's
    ``logprobs``: the most likely tokens each token's logprob entry holds besides itself (None: the ``2 *
    beam_width`` a step ranks, vLLM's)."""

    beam_width: int
    max_tokens: int = DEFAULT_MAX_TOKENS
    ignore_eos: bool = False
    length_penalty: float = 1.0
    logprobs: int | None = None

    def __init__(self, *, beam_width: int = _REQUIRED, max_tokens: int = DEFAULT_MAX_TOKENS,
                 ignore_eos: bool = False, length_penalty: float = 1.0, temperature: float = 0.0,
                 logprobs: int | None = None, **unknown: Any) -> None:
        """Keywords only; ``temperature`` is taken for vLLM's signature and must be 0 (beam search is greedy)."""
        if unknown:  # one line naming it, as SamplingParams words an unknown field (Python's TypeError named none)
            name = next(iter(unknown))
            why = VLLM_BEAM_FIELDS_NOT_TAKEN.get(name)
            if why is not None:
                raise GenerationError(f"generate: {name}: vLLM's BeamSearchParams field, not kvload's: {why}")
            raise GenerationError(f"generate: unknown BeamSearchParams field {name[:80]!r}; fields are "
                                  f"{', '.join(BEAM_FIELDS)}{did_you_mean(name, BEAM_FIELDS)}")
        if beam_width is _REQUIRED:  # checked after the unknown names: a mistyped beam_width read "missing beam_width"
            raise GenerationError("generate: beam_width: required (the number of hypotheses kept), as in vLLM's "
                                  "BeamSearchParams(beam_width=N)")
        beam_width, max_tokens, logprobs = _plain_int(beam_width), _plain_int(max_tokens), _plain_int(logprobs)
        # a 0-d torch tensor as a number, as SamplingParams takes one (numpy's floats already pass as numbers.Real)
        length_penalty, temperature = _plain_number(length_penalty), _plain_number(temperature)
        check(is_int(beam_width) and 1 <= beam_width <= MAX_N, "beam_width", f"an integer in [1, {MAX_N}]",
              beam_width)
        check(is_int(max_tokens) and max_tokens >= 1, "max_tokens", "an integer >= 1", max_tokens)
        if max_tokens > MAX_INT:  # as SamplingParams bounds it: an integer setting is at most int64
            raise GenerationError(f"generate: max_tokens: expected at most 2**63 - 1, got {int_text(max_tokens)}")
        ignore_eos = plain_flag(ignore_eos)  # numpy's bool (a 0-d bool tensor) as Python's, as SamplingParams takes it
        check(isinstance(ignore_eos, bool), "ignore_eos", "true or false", ignore_eos)
        check(is_finite(length_penalty), "length_penalty", "a finite number",
              length_penalty)
        check(is_number(temperature) and temperature == 0, "temperature",
              "0 (beam search keeps the most likely beams; sample with generate instead)", temperature)
        check_logprobs(logprobs)
        self.__attrs_init__(beam_width, max_tokens, ignore_eos, float(length_penalty), logprobs)


@attrs.frozen
class BeamSequence:
    """One finished hypothesis: its generated ids, their summed log-probability and its length-penalised score.

    ``text`` is vLLM's: the whole sequence (:attr:`tokens`, the prompt's ids first) decoded, special tokens shown.
    ``logprobs[t]`` is generated token ``t``'s entry, shaped as ``CompletionOutput.logprobs``': the ``logprobs`` most
    likely ids at that step and the chosen one -> log-probability (``engine.sampling.TokenLogprobs``, its ``rank``
    the chosen token's); the chosen ones sum to ``cumulative_logprob``.
    """

    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop": it ended with EOS; "length": it reached max_tokens
    text: str | None = None
    logprobs: list[dict[int, float]] | None = None
    #: the prompt's ids (vLLM's ``tokens`` begin with them); the output's ``prompt_token_ids`` too
    prompt_token_ids: tuple[int, ...] = attrs.field(default=(), repr=False)

    @property
    def tokens(self) -> list[int]:
        """vLLM's ``BeamSearchSequence.tokens``: the whole sequence, the prompt's ids then the generated ones."""
        return [*self.prompt_token_ids, *self.token_ids]

    @property
    def cum_logprob(self) -> float:
        """vLLM's name for :attr:`cumulative_logprob`."""
        return self.cumulative_logprob

    @property
    def stop_reason(self) -> None:
        """vLLM's: None (a hypothesis ends at EOS or max_tokens; beam search takes no stop strings or ids)."""
        return None


@attrs.frozen
class BeamSearchOutput:
    """A prompt's best hypotheses, best first (``beam_width`` of them, fewer only if the vocabulary is smaller)."""

    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    sequences: tuple[BeamSequence, ...]


def beam_search(executor: Executor, prompts: Any, params: BeamSearchParams, *, max_beam_width: int,
                salt: str | None = None, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """Run beam search for every prompt (see the module doc); one :class:`BeamSearchOutput` per prompt, in order.
    ``concurrency_limit``: at most that many prompts searched at once, the next ones after them (vLLM's); every
    prompt is checked first, and a refusal names its place in ``prompts``, not in its group."""
    if not isinstance(params, BeamSearchParams):
        raise GenerationError(f"beam_search: params: expected a BeamSearchParams, got {type(params).__name__}")
    k = params.beam_width
    if k > max_beam_width:
        raise GenerationError(f"beam_search: beam_width={k} exceeds max_beam_width={max_beam_width}, the width the "
                              f"model was loaded for; load it with max_beam_width >= {k}")
    check_salt(salt)
    items = executor._prompts(prompts, chat=False)
    if concurrency_limit is None:
        return BeamSearch(executor, items, params, salt).run()
    return [out for start in range(0, len(items), concurrency_limit)
            for out in BeamSearch(executor, items[start:start + concurrency_limit], params, salt, first=start).run()]


@attrs.define(eq=False)
class _Beam:
    """One live beam: its request (the prompt, then the beam's tokens), which holds its KV while it runs."""

    request: Request
    cum: float = 0.0  # the beam's summed log-probability
    top: Any = None  # its next token's 2 x beam_width most likely ids -> log-probability, once computed
    row: Any = None  # with top: the step's most likely ids (as many as its entries keep, at least top's) -> (lp, rank)
    trail: _Trail | None = None  # its tokens' logprob entries, last first, shared with the beams it forked from
    parked: bool = False  # it let go of its KV (its request ended): a beam extending it is a request of its own

    @property
    def tokens(self) -> tuple[int, ...]:
        """The beam's generated tokens."""
        return tuple(self.request.output_token_ids)


#: a beam's logprob entries as a chain: (the entries before, the last token's entry); None for no token
_Trail = tuple[Any, TokenLogprobs]


def _entries(trail: _Trail | None) -> list[dict[int, float]]:
    """A chain's entries, first token first."""
    out: list[dict[int, float]] = []
    while trail is not None:
        trail, entry = trail
        out.append(entry)
    out.reverse()
    return out


@attrs.define(eq=False)
class _Prompt:
    """One prompt's search: its live beams, the hypotheses ended by EOS, and at the end those cut at max_tokens."""

    index: int
    text: str | None
    ids: list[int]
    room: int  # tokens a beam may generate (max_tokens, cut by max_seq_len)
    live: list[_Beam]
    done: list[tuple[tuple[int, ...], float, str, _Trail]] = attrs.Factory(list)
    chosen: int = 0  # tokens each live beam has
    final: list[tuple[tuple[int, ...], float, _Trail]] | None = None  # None while it runs


class BeamSearch:
    """One ``beam_search`` call: the driver loop over the executor's forward, ranking each prompt's beams; ``run``
    does it all, the serving loop steps it (``start``, ``advance``, ``finish`` or ``fail``)."""

    def __init__(self, executor: Executor, items: list[tuple[str | None, list[int]]], params: BeamSearchParams,
                 salt: str | None, first: int = 0) -> None:
        """``first``: the place of ``items[0]`` among the call's prompts (a ``concurrency_limit`` group's), by which
        its prompts are named."""
        self.executor = executor
        self.params = params
        self.k = params.beam_width
        self.eos = frozenset() if params.ignore_eos else frozenset(executor.eos_token_ids)
        self.step = SamplingParams._beam_step(2 * self.k)  # the top 2k extend the beams even when an end takes k
        #: the most likely tokens each logprob entry keeps, and how many a step computes (the 2k ranked at least)
        self.alts = 2 * self.k if params.logprobs is None else params.logprobs
        self.width = max(2 * self.k, self.alts)
        self.salt = salt
        self.call = executor._calls
        executor._calls += 1
        self.driver = Driver(executor.manager, executor.scheduler, emit=executor._driver_event)
        #: request id -> its beam, for every request that holds (or waits for) a beam's KV
        self.beams: dict[str, _Beam] = {}
        self._ids = itertools.count()
        self.prompts: list[_Prompt] = []
        for i, (text, ids) in enumerate(items, start=first):
            room = min(params.max_tokens, executor.max_seq_len - len(ids))
            beam = self._new_beam(i, ids, room)
            executor._check_fits(i, beam.request, params.max_tokens)
            self.prompts.append(_Prompt(i, text, list(ids), room, [beam]))
        self.firsts = [p.live[0].request for p in self.prompts]  # each prompt's prefill (its prefix-cache hit)
        self.engine_steps = self.generated = 0
        self.last_step: StepStats | None = None  # what the last step did (the serving loop reports it)
        self.forward_s = self.kv_s = 0.0

    def _new_beam(self, index: int, ids: list[int], room: int, tokens: Sequence[int] = ()) -> _Beam:
        """A beam of prompt ``index`` with these generated ``tokens``, its request not yet added to the driver."""
        request = Request(f"{self.call}.{index}.{next(self._ids)}", ids, room, salt=self.salt,
                          output_token_ids=list(tokens))
        beam = self.beams[request.req_id] = _Beam(request)
        return beam

    def run(self) -> list[BeamSearchOutput]:
        """Search every prompt; the call's audit segment (generation_started ... generation_finished) around it."""
        self.start()
        try:
            with self.executor.paged_attention():
                while not self.advance():
                    pass
        except BaseException as exc:
            self.fail(exc)
            raise
        return self.finish()

    def start(self) -> None:
        """Open the call's audit segment; then :meth:`advance` until it says the search ended, and :meth:`finish`
        (or :meth:`fail`). ``run`` does all of it; the serving loop calls them one step at a time."""
        x = self.executor
        x._event(GenerationStarted(
            call=self.call, requests=self.k * len(self.prompts), prompt_tokens=sum(len(p.ids) for p in self.prompts),
            max_new_tokens=self.params.max_tokens, temperature=0.0, top_p=1.0, seed=None,
            salted=self.salt is not None, kv_manager=type(x.manager).__name__, n=self.k, logprobs=2 * self.k,
            llm_seed=x.llm_seed))
        self._warm_before = x.flex.warmup_s if x.flex is not None else 0.0
        self._start = time.perf_counter()
        self._queue = deque(self.prompts)
        self._active: list[_Prompt] = []
        self._idle = 0
        unscoped = x.salt_ignored() if self.salt is not None else None
        if unscoped is not None:
            x._event(SettingIgnored(field="generate.salt", value=self.salt, reason=unscoped))

    def fail(self, exc: BaseException) -> None:
        """The search ended on ``exc``: every beam's blocks freed, ``generation_failed`` recorded."""
        x = self.executor
        x._abort(self.driver)
        self.beams.clear()
        x._block_tables.keep_only(())
        x._check_flex()
        x._event(GenerationFailed(call=self.call, error=type(exc).__name__,
                                  message=retitled(first_line(exc, ""), x._caller),
                                  finished=sum(p.final is not None for p in self.prompts)))

    def finish(self) -> list[BeamSearchOutput]:
        """The ended search's outputs, its stats kept (``executor.last_stats``) and its audit segment closed."""
        x = self.executor
        x._block_tables.keep_only(())
        warmup = (x.flex.warmup_s if x.flex is not None else 0.0) - self._warm_before
        x._check_flex()
        wall = time.perf_counter() - self._start - warmup
        reused = sum(r.num_cached_tokens for r in self.firsts)
        stats = GenerationStats(
            requests=len(self.prompts), prompt_tokens=sum(len(p.ids) for p in self.prompts),
            reused_prompt_tokens=reused, generated_tokens=self.generated, steps=self.engine_steps, wall_s=wall,
            forward_s=max(0.0, self.forward_s - warmup), kv_s=self.kv_s, warmup_s=warmup, suspends=0, resumes=0,
            preemptions=0, samples=self.k * len(self.prompts))
        x.last_stats = stats
        x._event(GenerationFinished(
            call=self.call, requests=stats.samples, prompt_tokens=stats.prompt_tokens, reused_prompt_tokens=reused,
            generated_tokens=stats.generated_tokens, steps=stats.steps, suspends=0, resumes=0, preemptions=0,
            duration_ms=round(wall * 1000, 3), tokens_per_s=round(stats.tokens_per_s, 3)))
        return [self._output(p) for p in self.prompts]

    def advance(self) -> bool:
        """One engine step: start prompts while their beams fit the batch, compute, rank; whether every prompt's
        search has ended (then nothing more is computed)."""
        x, driver = self.executor, self.driver
        queue = self._queue
        if not (queue or self._active):
            return True
        while queue and (not self._active or (len(self._active) + 1) * self.k <= x.scheduler.max_batch_size):
            p = queue.popleft()
            driver.add(p.live[0].request)
            self._active.append(p)
        if x._stopped is not None:
            raise GenerationError(x._stopped)
        try:
            st = driver.step(self._compute)
        except StalledError as exc:
            if self._park():
                return False
            raise KvRuntimeError(f"beam_search: the {type(x.scheduler).__name__} cannot make progress: "
                                 f"{exc}") from None
        self.last_step = st
        self.engine_steps += 1
        self.forward_s += st.compute_seconds
        self.kv_s += st.kv_seconds
        self._idle = self._idle + 1 if st.scheduled_tokens == 0 else 0
        if self._idle > MAX_IDLE_STEPS:
            raise KvRuntimeError(f"beam_search: {self._idle} steps in a row scheduled nothing while "
                                 f"{len(driver.running)} running and {len(driver.waiting)} waiting beams remain")
        for p in self._active:
            if all(b.top is not None for b in p.live):
                self._rank(p)
        self._active = [p for p in self._active if p.final is None]
        return not (queue or self._active)

    def _compute(self, out: SchedulerOutput) -> dict[str, int | list[int]]:
        """The step's forward; each beam whose tokens are all computed keeps its next token's top 2k. No token is
        handed to the driver: :meth:`_rank` appends them once the prompt's beams are all in."""
        x = self.executor
        logits, rows, _, _ = x.forward(out, self.beams)
        if rows:
            entries = top_logprobs(logits, self.width, sample_rows(logits, self.step, [None] * len(rows)))
            tops = {out.scheduled[i].request.req_id: [(int(t), float(lp), lp.rank) for t, lp in e.items()]
                    for i, e in zip(rows, entries, strict=True)}
            if x.lockstep is not None:  # rank 0's: every rank ranks, forks and frees the same beams
                tops = x.lockstep.ranks.broadcast(tops)
            for req_id, row in tops.items():
                beam = self.beams[req_id]
                # the ranked ones are the 2k most likely alone, whatever more the entries keep
                ranked = row if self.width == 2 * self.k else row[:2 * self.k]
                beam.top = {t: lp for t, lp, _ in ranked}
                beam.row = {t: (lp, rank) for t, lp, rank in row}
        return {}

    def _entry(self, beam: _Beam, token: int) -> TokenLogprobs:
        """The logprob entry of ``token`` chosen after ``beam``: the step's ``alts`` most likely and the token."""
        entry = {t: Logprob(lp, rank) for t, (lp, rank) in itertools.islice(beam.row.items(), self.alts)}
        lp, rank = beam.row[token]
        entry.setdefault(token, Logprob(lp, rank))
        return TokenLogprobs(entry, rank)

    def _rank(self, p: _Prompt) -> None:
        """Every live beam of ``p`` has its next token's top 2k: keep the best ``beam_width`` (module doc)."""
        k = self.k
        cands = [(b.cum + lp, j, tok) for j, b in enumerate(p.live) for tok, lp in b.top.items()]
        cands.sort(key=lambda c: -c[0])  # stable: equal scores keep the beams' order, then the tokens'
        nxt: list[tuple[int, int, float, _Trail]] = []  # (beam, token, cumulative log-probability, entries)
        for rank, (cum, j, tok) in enumerate(cands):
            if tok in self.eos:
                if rank < k:  # an ending as likely as the kept beams is a hypothesis of its own
                    beam = p.live[j]
                    p.done.append(((*beam.tokens, tok), cum, "stop", (beam.trail, self._entry(beam, tok))))
                continue
            nxt.append((j, tok, cum, (p.live[j].trail, self._entry(p.live[j], tok))))
            if len(nxt) == k:
                break
        p.chosen += 1
        self.generated += len(nxt)
        ended = bool(self.eos) and len(p.done) >= k
        if ended or not nxt or p.chosen >= p.room:
            p.final = [] if ended else [((*p.live[j].tokens, tok), cum, trail) for j, tok, cum, trail in nxt]
            for beam in p.live:
                self._release(beam, "length" if p.chosen >= p.room and not ended else "stop")
            p.live = []
            return
        p.live = self._extend(p, nxt)

    def _extend(self, p: _Prompt, nxt: list[tuple[int, int, float, _Trail]]) -> list[_Beam]:
        """The next live beams: a beam's first candidate takes its request on, each further one forks it at its
        committed length, and a beam no candidate extends is freed first (its blocks and batch place go to the
        forks)."""
        first: dict[int, int] = {}
        for n, (j, *_) in enumerate(nxt):
            first.setdefault(j, n)
        for j, beam in enumerate(p.live):
            if j not in first:
                self._release(beam, "pruned")
        beams: list[_Beam | None] = [None] * len(nxt)
        for n, (j, tok, cum, trail) in enumerate(nxt):  # forks before any parent's own token is appended
            parent = p.live[j]
            if first[j] == n and not parent.parked:
                continue
            beam = beams[n] = self._new_beam(p.index, p.ids, p.room, (*parent.tokens, tok))
            beam.cum, beam.trail = cum, trail
            self.driver.branch(parent.request, beam.request)
        for n, (j, tok, cum, trail) in enumerate(nxt):
            if beams[n] is None:
                beam = beams[n] = p.live[j]
                beam.request.output_token_ids.append(tok)
                beam.cum, beam.trail, beam.top, beam.row = cum, trail, None, None
        return [b for b in beams if b is not None]

    def _release(self, beam: _Beam, reason: str) -> None:
        """Free a beam's request (its blocks back to the pool, whole ones cached) and take it off the driver."""
        request = beam.request
        self.beams.pop(request.req_id, None)
        if beam.parked or request.is_finished:
            return
        driver = self.driver
        if request in driver.running:
            driver.running.remove(request)
        elif request in driver.waiting:
            driver.waiting.remove(request)
        self.executor.scheduler.finish(request, reason)
        self.executor._event(RequestFinished(req_id=request.req_id, reason=reason,
                                             prompt_tokens=request.num_prompt_tokens,
                                             output_tokens=len(request.output_token_ids),
                                             reused_prompt_tokens=request.num_cached_tokens))

    def _park(self) -> bool:
        """Nothing can run: running beams that wait for their prompt's other beams let go of their KV (they keep
        their top 2k), so waiting ones can be admitted. Whether any did."""
        driver = self.driver
        parked = False
        for request in list(driver.running):
            beam = self.beams.get(request.req_id)
            if beam is None or beam.top is None or request.num_computed_tokens < request.num_tokens:
                continue
            driver.running.remove(request)
            self.executor.scheduler.finish(request, "parked")
            self.executor._event(RequestPreempted(req_id=request.req_id, tokens=request.num_tokens))
            self.beams.pop(request.req_id)
            beam.parked = parked = True
        return parked

    def _output(self, p: _Prompt) -> BeamSearchOutput:
        """The prompt's best ``beam_width`` hypotheses by length-penalised score, best first."""
        hyps = p.done + [(tokens, cum, "length", trail) for tokens, cum, trail in p.final or []]
        scored = sorted(((penalised(cum, len(tokens), self.params.length_penalty), tokens, cum, why, trail)
                         for tokens, cum, why, trail in hyps), key=lambda h: -h[0])[:self.k]
        sequences = tuple(BeamSequence(tokens, cum, score, why, _decode(self.executor, [*p.ids, *tokens]),
                                       _entries(trail), tuple(p.ids))
                          for score, tokens, cum, why, trail in scored)
        return BeamSearchOutput(p.text, tuple(p.ids), sequences)


def penalised(cum: float, length: int, length_penalty: float) -> float:
    """A hypothesis' score, vLLM's ``cum / length ** length_penalty``; where the power leaves a float's range (a
    ``length_penalty`` of 1e300 or -2**63) the score is its limit (0 or -inf), where it raised once the search was
    done (OverflowError, ZeroDivisionError) and threw the whole search away."""
    try:
        return cum / max(1, length) ** length_penalty
    except OverflowError:  # the power is past the largest float: the score tends to 0 (from below)
        return -0.0 if cum < 0 else 0.0
    except ZeroDivisionError:  # the power underflowed to 0: a negative cum tends to -inf
        return -math.inf if cum < 0 else 0.0


def _decode(executor: Executor, tokens: Sequence[int]) -> str | None:
    """A hypothesis' whole sequence as text (None without a tokenizer): vLLM's ``tokenizer.decode(beam.tokens)``, its
    special tokens shown (vLLM's decode default). The server's choices decode the generated tokens themselves."""
    tokenizer = executor.tokenizer
    return tokenizer.decode(list(tokens), skip_special_tokens=False) if tokenizer is not None else None


__all__ = ["VLLM_BEAM_FIELDS_NOT_TAKEN", "BeamSearch", "BeamSearchOutput", "BeamSearchParams", "BeamSequence",
           "beam_search"]
