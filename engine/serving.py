"""The serving engine: one loop thread doing continuous batching for requests that arrive at any time.

``kvload serve`` (the face) submits requests from its HTTP handlers; the loop thread adds them to the
one :class:`~engine.driver.Driver` between steps, so a request that arrives while others decode joins
the next step's forward. Each request carries its own :class:`SamplingParams` (greedy or seeded
sampling per request) and a ``sink`` the loop calls with a :class:`ServeEvent` after every step that
gave it tokens, and once more when it ends. :meth:`ServingEngine.abort` (a client that went away)
finishes a request between steps, which frees its blocks.

A request's ``n`` choices (:meth:`ServingEngine.submit_group`) share one prefill, as ``generate``'s samples do
(``engine.driver``'s forks): choice 0 prefills, the step that completes its prompt draws every choice's first token
from that row of logits (each with its own seed, seed + j, penalties and grammar), and the other choices join holding
the prompt's KV (whole blocks shared, the partial last block copied); a choice that ends on that first token never
holds any. A scored prompt (``prompt_logprobs``, completions' echo with logprobs) is scored once too: choice 0 prefills
it whole and the others get a copy of its scores. Each choice streams, finishes and aborts on its own; an aborted
choice 0 hands its place (the prefill) to the next choice still waiting.

A beam search (:meth:`ServingEngine.submit_beam`, the server's ``use_beam_search``) is a unit of work of its own in
this loop, not rows of its steps: it starts once every request before it has ended, and the requests after it wait
until it ends (first come, first served), because its beams are requests of a driver of their own
(``engine.beam_search``) over the same scheduler and pools, and two drivers would each fill the batch. Meanwhile
each turn of the loop runs one step of the search, so aborts, notices and a stop are taken between its steps as
between any others. Its ``beam_width`` choices get their one event each when the search ends, best first.

With ``max_draft_len`` a request (greedy or sampled) drafts as in ``generate`` (``engine.speculation``) while at most
``speculation_max_batch_size`` requests run.

The loop never dies on one request's failure: an error inside a step fails the requests of that step
(their sinks get the error, their blocks are freed) and the loop goes on with the next arrivals.

Tensor parallel (the executor's ``lockstep``): rank 0 runs this loop for the HTTP server; every other rank runs
:meth:`ServingEngine.follow`, which takes rank 0's :class:`StepOrders` before each step and steps with it (see there
for the invariant).

The class holds the loop, its requests' life cycle and tensor parallel's orders; the rest comes from parts, one
module per concern: ``engine.serving_text`` (prompts to token ids, checked for length; ids to text and bytes),
``engine.serving_step`` (a step's forward and each request's pick), ``engine.serving_beam`` (beam searches in the
loop) and ``engine.served`` (the records: a request's loop-side state, its events and its end).
"""

from __future__ import annotations

import contextlib
import itertools
import random
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

import attrs
import torch

from cache_backends.request import Request
from engine.driver import Driver, StalledError, StepStats, at_length
from engine.executor import GenerationExecutor
from engine.sampling_params import SamplingParams, check_salt, greedy_ignored, inert_settings
from engine.served import BeamJob, EngineStopped, FinishedRequest, LiveRequest, ServeEvent
from engine.serving_beam import ServingBeam
from engine.serving_step import ServingStep
from engine.serving_text import ServingText
from engine.stopping import SampleText
from engine.token_bound import Bound
from pipeline.errors import GenerationError, KvBuildError, KvloadError, KvRuntimeError, RankLostError, first_line
from pipeline.events import EngineLoopFailed, EngineStepFailed, Event, RequestFinished, SettingIgnored
from pipeline.ranks import lost_rank_message
from pipeline.signals import stopping
from pipeline.thread_end import EndingThread


class EngineObserver(Protocol):
    """Receives what metrics need, on the loop thread (keep it cheap)."""

    def on_step(self, stats: StepStats, new_tokens: int) -> None:
        """After every step: what it did (``stats.output`` is the scheduler's decision), tokens it generated."""

    def on_finished(self, done: FinishedRequest) -> None:
        """When a request ends (finished, aborted or failed)."""


class _ServeDriver(Driver):
    """The driver with per-request end-of-sequence rules (``ignore_eos``, stop token ids)."""

    def __init__(self, *args: Any, live: dict[str, LiveRequest], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._live_map = live

    def _finish_reason(self, req: Request, token: int) -> str | None:
        live = self._live_map.get(req.req_id)
        if live is None:
            return super()._finish_reason(req, token)
        if live.constraint is not None and live.constraint.advance(token):
            return "stop"  # the grammar is complete (its end-of-sequence token taken, ignore_eos or not)
        if token in self.eos_token_ids and not live.params.ignore_eos:
            return "stop"
        if token in live.stop_token_ids:
            live.stop_reason = token
            return "stop"
        last = at_length(req, self.max_seq_len)
        # the last token decodes as final: a stop string it completes counts even before an unfinished character
        search = len(req.output_token_ids) > live.params.min_tokens  # min_tokens holds stop strings back too
        if live.text is not None and live.text.update(req.output_token_ids, final=last, search=search) is not None:
            live.stop_reason = live.text.stop_hit
            return "stop"  # a stop string appeared in the text (the face cuts the text there)
        if last:
            return "length"
        return None


#: Seconds a rank > 0 that got a stop signal waits for rank 0's stop order (sent as soon as rank 0 stops).
FOLLOW_GRACE_S = 10.0
#: Seconds a follower that gave up waiting lets its steps leave their collective (rank 0's heartbeat is 0.5 s)
FOLLOW_QUIT_S = 2.0


@attrs.frozen
class StepOrders:
    """What rank 0 tells the other ranks before each step under tensor parallel (sent with ``broadcast_object_list``).

    Invariant: every rank applies the same orders in the same order (``reset`` first, then ``adds`` in order, grouped
    by ``groups``, then ``aborts`` in order, then one step when there is work), so their drivers, schedulers and pools
    stay identical;
    the tokens a step picks are rank 0's (broadcast after sampling, as ``generate`` does), so a sampled request goes
    on alike everywhere whatever each rank's generator drew. ``adds``: (request as rank 0 built it, its params, the
    seed of its generator or None). An order with nothing in it is a heartbeat: an idle rank 0 sends one every
    ``idle_wait_s`` so the others, waiting in the collective, never reach its timeout.
    """

    adds: tuple[tuple[Request, SamplingParams, int | None], ...] = ()
    aborts: tuple[str, ...] = ()
    #: how many of ``adds``, in order, are each request's choices (the first prefills, the others fork it); empty:
    #: each alone
    groups: tuple[int, ...] = ()
    reset: bool = False  # rank 0 forgot its cached prefixes since the last step (POST /reset_prefix_cache)
    stop: bool = False  # the server is stopping: the other ranks end their loop


class ServingEngine(ServingText, ServingStep, ServingBeam):
    """Continuous batching over a loaded model for requests submitted from any thread.

    Build it over a ``GenerationExecutor`` (``ServingEngine.from_result(load_result)``), call
    :meth:`start`, then :meth:`submit` / :meth:`abort` from anywhere; :meth:`stop` ends the loop and
    aborts what is left.
    """

    def __init__(self, executor: GenerationExecutor, *, observer: EngineObserver | None = None,
                 idle_wait_s: float = 0.5) -> None:
        lockstep = getattr(executor, "lockstep", None)
        #: tensor parallel: the ranks this loop steps with (rank 0 serves, the others :meth:`follow`); None alone
        self.ranks = lockstep.ranks if lockstep is not None else None
        self.executor = executor
        self.manager = executor.manager
        self.scheduler = executor.scheduler
        self.tokenizer = executor.tokenizer
        #: ``engine.token_bound.token_bound`` of the tokenizer (None: unbounded), read at the first text prompt
        self._bound: Bound | bool | None = False
        #: vLLM's ``--chat-template-content-format``: how messages' content reaches the chat template
        #: (``engine.content_format``; "auto": as the template in effect reads it)
        self.content_format = "auto"
        self.observer = observer
        self.idle_wait_s = idle_wait_s
        self._live: dict[str, LiveRequest] = {}
        self.driver = _ServeDriver(self.manager, self.scheduler, eos_token_ids=executor.eos_token_ids,
                                   emit=executor._emit, live=self._live,
                                   propose=self._propose if executor.proposer is not None else None)
        self._cond = threading.Condition()
        self._inbox: list[list[LiveRequest] | BeamJob] = []  # each entry: one request's choices, or a beam search
        #: entries that came after a beam search still waiting or running: applied, in order, once it has ended
        self._held: list[list[LiveRequest] | BeamJob] = []
        self._beam: BeamJob | None = None  # the beam search the loop runs now
        self._beam_ids: dict[str, BeamJob] = {}  # each queued or running beam search, by each choice's id
        self._aborts: set[str] = set()
        self._notices: list[Event] = []  # events for the loop thread to emit (the event bus is not thread-safe)
        self._stopping = False
        self._thread: EndingThread | None = None
        self._follow_quit = threading.Event()  # set by follow() when a signal's grace ran out: the steps end
        #: set once every rank steps with this loop (at once alone; under tensor parallel after the loop's first
        #: orders reached them): the server says it is ready only then (:meth:`wait_joined`)
        self.joined = threading.Event()
        self._ids = itertools.count()
        #: held by the loop during a step; readers (metrics) take it to see a consistent manager
        self.state_lock = threading.Lock()
        self.steps = 0
        #: totals since the start, read by the server's periodic throughput line (kvload.serve.stats_log): prompt
        #: tokens of the samples that got their first token (vLLM's count: cached ones included), tokens generated
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.loop_error: str | None = None
        #: what ended the loop thread when its own code failed (``loop_error`` says it in words); None otherwise
        self.loop_exception: BaseException | None = None
        self._pieces: dict[int, tuple[str, bytes]] = {}  # token_piece's, filled as tokens are asked for
        self._byte_level: bool | None = None
        self._reset_pending = False  # tensor parallel: a prefix cache reset the next StepOrders carry (state_lock)
        #: tensor parallel: called on the loop thread once the loop ended on a failure (the ranks can no longer be
        #: known to agree, so the server must stop); ``fatal`` then holds the error to end with (one line, exit 1)
        self.on_fatal: Callable[[], Any] | None = None
        self.fatal: KvloadError | None = None

    @classmethod
    def from_result(cls, result: Any, **kwargs: Any) -> ServingEngine:
        """An engine over a ``load(..., load_weights=True)`` result (its executor, manager and scheduler)."""
        executor = result.executor if hasattr(result, "executor") else GenerationExecutor.from_result(result)
        return cls(executor, **kwargs)

    # --- the thread --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread (idempotent)."""
        if self._thread is None:
            if self.ranks is None:
                self.joined.set()
            self._thread = EndingThread(target=self._run, name="kvload-engine", daemon=True)
            self._thread.start()

    def wait_joined(self, gave_up: Callable[[], bool] = lambda: False) -> bool:
        """Wait until every rank steps with the loop (:attr:`joined`): under tensor parallel a rank > 0 may still be
        setting up when rank 0's loop starts, and a stop signal sent on rank 0's ready line then met it there (its
        set-up interrupted: exit 130, its audit unwritten). False when the loop ended first (its collective timed
        out: ``loop_error`` says why) or ``gave_up()`` (a stop asked for meanwhile)."""
        while not self.joined.wait(0.05):
            if not self.alive or gave_up():
                return False
        return True

    def stop(self, timeout: float = 30.0) -> None:
        """End the loop; requests still queued or running end with reason ``"abort"``. A stop signal's exception
        while it waits is raised once the loop ended (or ``timeout`` s passed): the process never exits mid-step."""
        self.request_stop()
        if self._thread is not None:
            try:
                self._thread.wait_end(timeout)
            finally:
                self._thread = None

    def request_stop(self) -> None:
        """Tell the loop to end after its step (every request left then ends with ``"abort"``); returns at once,
        so a server's shutdown can call it before waiting for its open streams, which then end promptly."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def _fresh_seed(self) -> int:
        """A seed for a sampled request that sent none: from the server's ``--seed`` sequence (the executor's
        ``call_seeds``: the same arrivals draw the same seeds after a restart, vLLM's ``--seed``), else fresh."""
        return (self.executor.call_seeds or random.SystemRandom()).getrandbits(62)

    @property
    def stopping(self) -> bool:
        """Whether a stop was asked for: :meth:`submit` refuses from then on (``EngineStopped``)."""
        return self._stopping

    @property
    def alive(self) -> bool:
        """Whether the loop thread runs."""
        return self._thread is not None and self._thread.is_alive()

    # --- requests ----------------------------------------------------------------------------


    def report_ignored(self, params: SamplingParams, n: int, request: str = "", salt: str | None = None,
                       model_defaults: Collection[str] = ()) -> None:
        """``setting_ignored`` (the server's log and audit) for each setting of one request that does nothing: what
        greedy decoding ignores (``engine.sampling_params.greedy_ignored``, as ``generate`` reports them; ``n``:
        choices per prompt; ``model_defaults``: fields the request did not send, which hold the model's default),
        settings that can change nothing (``inert_settings``), and a reuse ``salt`` while prefix reuse is off."""
        where = f" (request {request})" if request else ""
        ignored = greedy_ignored(params, n, model_defaults) + inert_settings(params, self.tokenizer is not None,
                                                                         self.executor.eos_is_special)
        asked = request or None
        events = [SettingIgnored(field=f"serve.{name}", value=value, reason=why + where, request=asked)
                  for name, value, why in ignored]
        unscoped = self.executor.salt_ignored() if salt is not None else None
        if unscoped is not None:
            events.append(SettingIgnored(field="serve.salt", value=salt, reason=unscoped + where, request=asked))
        if events:
            self.notify(*events)

    def notify(self, *events: Event) -> None:
        """Have the loop thread emit ``events`` (the server's log and audit) before its next step; safe from any
        thread, the loop's own included (a KV events mirror failing inside a step)."""
        with self._cond:  # emitted by the loop thread, the one that emits every other serving event
            self._notices.extend(events)
            self._cond.notify_all()

    def room(self, prompt_token_ids: Sequence[int]) -> int:
        """Tokens a request with this prompt may generate before ``max_seq_len``."""
        return self.executor.max_seq_len - len(prompt_token_ids)

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams, *, pool: bool = False,
              what: str | None = None) -> Request:
        """The request these would make, its prompt cut to ``params.truncate_prompt_tokens`` as ``generate`` cuts it;
        ``GenerationError``/``KvBuildError`` when it could never run. It reports nothing: a cut that keeps one token
        fewer than asked is said once, by the submit that queues the request (a server checks, then submits).
        ``pool``: an embedding's prefill (``Request.prefill_only``), whose prompt may fill ``max_seq_len``; ``what``:
        the pooled request as a refusal names it (``engine.call_requests.POOLED``)."""
        return self._check(prompt_token_ids, params, [], pool=pool, what=what)

    def _check(self, prompt_token_ids: Sequence[int], params: SamplingParams,
               notes: list[tuple[str, Any, str]], *, pool: bool = False, what: str | None = None) -> Request:
        """:meth:`check`, ``notes`` getting the ``setting_ignored`` (field, value, reason) of its cut, if any."""
        executor = self.executor
        if not pool:
            executor.check_generates("generate")
        items = executor._prompts([[int(t) for t in prompt_token_ids]], False, checked=False)
        # cut to params.truncate_prompt_tokens first, as generate does (kvload serve cuts before: no field set), then
        # the vocabulary and the length are checked
        ((_, ids),) = executor._check_items(executor._truncated(items, [params], notes, pool=pool), pool=pool,
                                            what=what)
        executor._params(params, {}, 1)  # the same checks as generate: stop ids in the vocabulary, logprobs
        request = Request(f"srv-{next(self._ids)}", ids, 1 if pool else min(params.max_new_tokens, self.room(ids)),
                          prefill_only=pool)  # an embedding's one token is dropped (its KV never written)
        self.executor._check_fits(0, request, None if pool else params.max_new_tokens)  # KvBuildError, the numbers
        return request

    def _say_cut(self, notes: list[tuple[str, Any, str]], req_id: str) -> None:
        """A request's cut that kept one token fewer than asked (generate says it the same way), once: noted as it is
        queued (under ``_cond``), so the loop emits it with the inbox that brings the request, before its first step."""
        self._notices.extend(SettingIgnored(field=f"serve.{name}", value=value, reason=f"{why} (request {req_id})",
                                            request=req_id) for name, value, why in notes)

    def _check_submit(self, salt: str | None, priority: int) -> None:
        """What :meth:`submit` and :meth:`submit_group` refuse before looking at the prompt: a stopped engine (early,
        to skip the checks; decided again under the lock), the salt (as generate's: hashed into every block key, its
        length bounded) and a priority the scheduler does not take."""
        if self._stopping or self.loop_error is not None:
            raise EngineStopped(self._why_stopped())
        check_salt(salt)
        refused = self.executor.priority_refusal(priority)
        if refused is not None:
            raise GenerationError(f"generate: priority: {refused}")

    def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams, sink: Callable[[ServeEvent], Any], *,
               salt: str | None = None, seed_offset: int = 0, priority: int = 0, samples: int = 1,
               pool: bool = False, every_token: bool = False) -> str:
        """Queue one request; its id. ``GenerationError``/``KvBuildError`` (nothing queued) when it could never run.

        ``max_new_tokens`` is cut to what ``max_seq_len`` leaves. ``sink`` is called on the loop thread.
        One sample per request (``params.n`` is the caller's): :meth:`submit_group` queues a request's n choices as
        forks of one prefill; ``seed_offset`` j here gives the sample it gives choice j, prefilled on its own.
        It ends with ``"stop"`` on EOS (unless ``params.ignore_eos``), on a token of
        ``params.stop_token_ids``, or once its text holds one of ``params.stop`` (the caller cuts the
        text there). ``params.logprobs=k`` reports, per generated token, its log-probability and the
        top ``k`` tokens' (``engine.sampling.top_logprobs``). ``priority``: vLLM's (lower is served first), taken
        only when the scheduler schedules by priority (``scheduling_policy="priority"``; else only 0). ``samples``:
        how many requests the caller submits for this prompt (the request's ``n``, what metrics report). ``pool``: its
        prompt's last hidden state is captured as it is computed (``/v1/embeddings``), for the caller to take from
        ``executor.pooled`` by the request's id once it ended; with ``every_token`` every prompt token's (``/pooling``'s
        per-token tasks, as ``LLM.reward``), the prompt computed whole (its cached prefix not read: no forward would
        give those tokens' rows).
        """
        self._check_submit(salt, priority)
        notes: list[tuple[str, Any, str]] = []
        request = self._check(prompt_token_ids, params, notes, pool=pool)
        request.salt = salt
        request.priority = -int(priority)  # kvload ranks higher first; vLLM's value is lower first
        # a scored prompt is prefilled whole (a cached prefix computes no logits); its blocks are cached for others
        request.skip_prefix_read = params.prompt_logprobs is not None or (pool and every_token)
        req_id = request.req_id
        seed = None
        if not params.greedy:
            seed = (params.seed if params.seed is not None else self._fresh_seed()) + seed_offset
        live = self._new_live(request, params, sink, seed)
        live.sample, live.samples, live.group = seed_offset, samples, req_id
        with self._cond:
            # checked again under the lock request_stop takes: a stop asked for during the checks above may have
            # ended the loop, whose last act (_fail_all) drained the inbox; a request queued after that never ended.
            # So may a failure of the loop itself, which sets loop_error under this lock before its last drain.
            if self._stopping or self.loop_error is not None:
                raise EngineStopped(self._why_stopped())
            self._say_cut(notes, req_id)
            if pool:  # before the loop can see it: its prefill's forward captures the row
                self.executor.pooled.want(req_id, every_token=every_token)
            self._inbox.append([live])
            self._cond.notify_all()
        return req_id

    def submit_group(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                     sinks: Sequence[Callable[[ServeEvent], Any]], *, salt: str | None = None,
                     priority: int = 0, echo_only: bool = False) -> list[str]:
        """Queue one request's ``len(sinks)`` choices of one prompt, computed from one prefill (module docstring):
        choice ``j`` is what :meth:`submit` with ``seed_offset=j`` gives (seed + j; greedy choices alike) and reports
        to ``sinks[j]``. Their ids, in order; nothing queued when they could never run (as :meth:`submit`).
        ``echo_only``: an echo without generation (``params.max_tokens`` 1): each choice's token is dropped, reported
        and counted as none (``LiveRequest.echo_only``)."""
        if not sinks:
            return []
        self._check_submit(salt, priority)
        notes: list[tuple[str, Any, str]] = []
        first = self._check(prompt_token_ids, params, notes)
        base = None
        if not params.greedy:
            base = params.seed if params.seed is not None else self._fresh_seed()
        group = []
        for j, sink in enumerate(sinks):
            request = first if j == 0 else Request(f"srv-{next(self._ids)}", first.prompt_token_ids,
                                                   first.max_new_tokens)
            request.salt = salt
            request.priority = -int(priority)
            # only the first prefills: a scored prompt whole (a cached prefix computes no logits), once for all
            request.skip_prefix_read = params.prompt_logprobs is not None and j == 0
            live = self._new_live(request, params, sink, None if base is None else base + j)
            live.sample, live.samples, live.group = j, len(sinks), first.req_id
            live.echo_only = echo_only
            group.append(live)
        with self._cond:  # as submit's: checked again under the lock the loop's last drain takes
            if self._stopping or self.loop_error is not None:
                raise EngineStopped(self._why_stopped())
            self._say_cut(notes, first.req_id)
            self._inbox.append(group)
            self._cond.notify_all()
        return [live.request.req_id for live in group]


    def _new_live(self, request: Request, params: SamplingParams, sink: Callable[[ServeEvent], Any],
                  seed: int | None) -> LiveRequest:
        """A request's loop-side state: its generator from ``seed`` (None: greedy), its stop-string text."""
        gen = None if seed is None else torch.Generator(device=self.executor.pools.device).manual_seed(seed)
        text = SampleText(self.tokenizer, params.stop, skip_special=params.skip_special_tokens,
                          spaced=params.spaces_between_special_tokens) \
            if params.stop and self.tokenizer is not None else None  # finds the stop strings (the face cuts)
        live = LiveRequest(request, params, sink, gen, frozenset(params.stop_token_ids), text, params.logprobs,
                     time.perf_counter(), seed=seed)
        if params.prompt_logprobs is not None:
            live.prompt_logprobs = [None] * request.num_prompt_tokens
        if params.structured_outputs is not None:  # compiled by check(): xgrammar's cache answers (every rank's)
            live.constraint = self.executor.grammars().constraint(params.structured_outputs,
                                                                 skip_special=params.skip_special_tokens)
        return live

    def _why_stopped(self) -> str:
        if self.loop_error is not None:
            return (f"the engine loop stopped after a failure ({self.loop_error}) and serves no more requests; "
                    "/health reports it; restart the server")
        return "the engine is shutting down"

    def abort(self, req_id: str) -> None:
        """Finish a request between steps (its blocks are freed); unknown or finished ids are ignored."""
        with self._cond:
            self._aborts.add(req_id)
            self._cond.notify_all()

    def reset_prefix_cache(self) -> tuple[bool, Event]:
        """Forget every cached prefix between two steps (the executor's :meth:`~GenerationExecutor.reset_prefix_cache`,
        the server's ``POST /reset_prefix_cache``): (whether it did, the event the loop thread records)."""
        with self.state_lock:  # no step reads or caches blocks meanwhile
            done, event = self.executor.reset_prefix_cache("serve.reset_prefix_cache")
            # the other ranks forget theirs before the next step, where this rank forgot its own (StepOrders.reset)
            self._reset_pending = self._reset_pending or (done and self.ranks is not None)
        self.notify(event)
        return done, event

    # --- metrics' view -----------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Queue lengths and the manager's stats, consistent with one step boundary."""
        with self.state_lock:
            running = len(self.driver.running)
            waiting = sum(1 for r in self.driver.waiting if r.state.value == "waiting")
            suspended = len(self.driver.waiting) - waiting
            beam = self._beam.search if self._beam is not None else None
            if beam is not None:  # the beams of the search the loop runs now
                running += len(beam.driver.running)
                waiting += len(beam.driver.waiting)
            # requests waiting behind a beam search, and the searches waiting for their turn (one per choice)
            waiting += sum(len(entry.sinks) if isinstance(entry, BeamJob) else len(entry) for entry in self._held)
            waiting += self.driver.forks_waiting  # choices waiting for their prompt's prefill
            stats = None if getattr(self.manager, "closed", False) else self.manager.stats()
            # the token totals a step adds to, at the same boundary: read apart from the queues, a step that ended
            # between the two reads showed its request gone and its tokens not yet counted
            prompt_tokens, generation_tokens = self.prompt_tokens_total, self.generation_tokens_total
        return {"running": running, "waiting": waiting, "suspended": suspended, "manager": stats,
                "steps": self.steps, "prompt_tokens": prompt_tokens, "generation_tokens": generation_tokens}

    # --- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with self.executor.paged_attention():
                while self._loop_once():
                    pass
        except BaseException as exc:  # a bug in the loop itself: say so on every request, never hang them
            if self.ranks is not None and self._stopping:  # the others already went with the stop (Ctrl-C reaches all)
                return
            # gloo's words, in kvload's one line (rank 0's broadcast says so itself when a follower's process ended)
            lost = (str(exc) if isinstance(exc, RankLostError) else lost_rank_message(exc)) if self.ranks is not None \
                else None
            with self._cond:  # under submit's lock: nothing is queued after the drain below, for a loop that is gone
                self.loop_error = lost or f"{type(exc).__name__}: {exc}"
                self.loop_exception = exc
            ended = self._fail_all(self.loop_error)
            # one error record for the operator (with the traceback's exception kept for whoever stops the server),
            # not the thread's own traceback on stderr: kvload serve exits on it with one line (--debug: the traceback)
            if self.executor._emit is not None:
                with contextlib.suppress(Exception):
                    self.executor._emit(EngineLoopFailed(error=type(exc).__name__, message=first_line(exc, ""),
                                                         requests=ended))
            if self.ranks is not None:
                # tensor parallel: the ranks can no longer be known to step alike, so the server stops (on_fatal),
                # and says why in one line; a rank that died takes the others down through their next collective
                self.fatal = RankLostError(lost) if lost is not None else KvRuntimeError(
                    f"serve: the serving loop failed: {type(exc).__name__}: {first_line(exc, '')}")
                if self.on_fatal is not None:
                    with contextlib.suppress(Exception):
                        self.on_fatal()
        finally:
            self._fail_all("the engine stopped", reason="abort")
            self.executor._block_tables.keep_only(())  # generate() may use the executor after the server

    def _loop_once(self) -> bool:
        with self._cond:
            # under tensor parallel the first orders go at once, a heartbeat: the other ranks have joined once it
            # is through (joined)
            while not (self._stopping or self._inbox or self._aborts or self._notices or self.driver.has_work
                       or self._beam is not None or self._held or not self.joined.is_set()):
                if not self._cond.wait(self.idle_wait_s) and self.ranks is not None:
                    break  # a heartbeat: the other ranks wait for the next orders in a collective with a timeout
            notices, self._notices = self._notices, []
            stopping = self._stopping
            inbox: list[list[LiveRequest] | BeamJob] = []
            aborts: list[str] = []
            if not stopping:
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = sorted(self._aborts), set()  # sorted: applied in one order on every rank
        for notice in notices:  # before the requests they are about start
            with contextlib.suppress(Exception):
                self.executor._event(notice)
        if stopping:
            if self.ranks is not None:
                with contextlib.suppress(Exception):  # best effort: the others may be gone already (Ctrl-C)
                    self.ranks.broadcast(StepOrders(stop=True))
            return False
        with self.state_lock:
            if self.ranks is not None:  # under the lock a prefix cache reset takes: it lands between the same steps
                orders = StepOrders(adds=tuple((lv.request, lv.params, lv.seed) for group in inbox for lv in group),
                                    groups=tuple(len(group) for group in inbox),
                                    aborts=tuple(aborts), reset=self._reset_pending)
                self._reset_pending = False
                try:
                    self.ranks.broadcast(orders)
                except BaseException:
                    with self._cond:  # back where the loop's last drain (_fail_all) ends them: none left unanswered
                        self._inbox[:0] = inbox
                    raise
                self.joined.set()
            self._apply(inbox, aborts)
            self._step()
        return True

    def follow(self, grace_s: float = FOLLOW_GRACE_S) -> None:
        """Tensor parallel, ranks > 0: step with rank 0 as its :class:`StepOrders` say until it stops the server (or
        the ranks part: a collective's error or timeout is raised here). Call it on the main thread: the steps run on
        a thread of their own, so that a stop signal here (Ctrl-C and torchrun reach every rank) waits up to
        ``grace_s`` for rank 0's stop, which then ends this call as cleanly as rank 0's own; without it the signal is
        raised (``KeyboardInterrupt``). Under ``kvload``'s command line another stop signal meanwhile (torchrun passes
        the terminal's Ctrl-C on) repeats the stop under way (:func:`pipeline.signals.stopping`)."""
        if self.ranks is None or self.ranks.is_first:
            raise GenerationError("serve: follow() is for ranks > 0 of a tensor-parallel run; rank 0 serves")
        failed: list[BaseException] = []
        # waited on through an Event, not Thread.join: CPython 3.11's join, interrupted by the signal's exception,
        # marks a thread that still runs as stopped, so the grace wait returned at once and the process exited with
        # the steps mid-collective (C++ "terminate called", SIGABRT)
        ended = threading.Event()

        def run() -> None:
            try:
                self._follow_steps()
            except BaseException as exc:  # handed to the caller's thread
                failed.append(exc)
            finally:
                ended.set()

        thread = threading.Thread(target=run, name="kvload-engine", daemon=True)
        try:
            thread.start()  # in the try: a signal during the start waits for rank 0's stop as one after it
            while not ended.wait(0.1):  # in slices: a signal's handler runs in between
                pass
        except KeyboardInterrupt:
            # the stop reached this wait (its exception is let go if rank 0 stops in time, so pipeline.signals must not
            # take it for one dropped unseen): another signal (torchrun passes the terminal's Ctrl-C on to this rank
            # too) repeats it, rather than ending this wait at once, with the steps mid-collective
            stopping()
            if not ended.wait(grace_s) or failed:  # rank 0 did not stop in time (or the ranks parted): the signal wins
                # ... once the steps left their collective (at rank 0's next order, within its heartbeat): exiting
                # with a thread inside gloo ended the process in C++'s "terminate called" (SIGABRT), not the signal
                self._follow_quit.set()
                ended.wait(FOLLOW_QUIT_S)
                raise
        if failed:
            lost = lost_rank_message(failed[0])
            if lost is not None:
                raise RankLostError(lost) from failed[0]
            raise failed[0]

    def _follow_steps(self) -> None:
        """:meth:`follow`'s thread: rank 0's orders, applied in its order, then the step, until a stop order."""
        if self.executor.pools.device.type == "cuda":  # the current device is per thread (the rank's, for NCCL)
            torch.cuda.set_device(self.executor.pools.device)
        try:
            with self.executor.paged_attention():
                while True:
                    orders: StepOrders = self.ranks.broadcast(None)
                    if orders.stop or self._follow_quit.is_set():
                        return
                    with self.state_lock:
                        if orders.reset:
                            _, event = self.executor.reset_prefix_cache("serve.reset_prefix_cache")
                            self.executor._event(event)
                        lives = [self._new_live(req, params, _no_sink, seed) for req, params, seed in orders.adds]
                        sizes = orders.groups or (1,) * len(lives)
                        starts = list(itertools.accumulate(sizes, initial=0))
                        self._apply([lives[a:b] for a, b in itertools.pairwise(starts)], list(orders.aborts))
                        self._step()
        finally:
            self._fail_all("the engine stopped", reason="abort")
            self.executor._block_tables.keep_only(())

    def _apply(self, inbox: Sequence[list[LiveRequest] | BeamJob], aborts: list[str]) -> None:
        """New requests join the driver (a request's other choices as forks of its first), in order until a beam
        search: it starts once the driver has no work, and what comes after it waits until it ended (module
        docstring); then the aborted end (under ``state_lock``)."""
        entries, self._held = [*self._held, *inbox], []
        for k, entry in enumerate(entries):
            if self._beam is not None or (isinstance(entry, BeamJob) and self.driver.has_work):
                self._held = entries[k:]
                break
            if isinstance(entry, BeamJob):
                self._start_beam(entry)
                continue
            first, *others = entry
            for live in (first, *others):
                self._live[live.request.req_id] = live
            self.driver.add(first.request)
            self.driver.fork(first.request, [live.request for live in others])
        for req_id in aborts:
            job = self._beam_ids.get(req_id)
            if job is not None:
                self._end_beam(job, None, "abort")
            else:
                self._finish_early(req_id, "abort")
        if aborts:  # no step may follow: the snapshots of blocks the aborted held (and left uncached) go now
            self.executor.prune_v4()


    def _step(self) -> None:
        """One step of the driver when there is work, its tokens sent (under ``state_lock``). A failed step fails its
        requests; under tensor parallel any failure but a stalled scheduler (which every rank meets alike) is raised:
        the ranks may have parted mid-step."""
        if self._beam is not None:  # it runs alone: it started once the driver had no work, nothing joined since
            self._beam_step(self._beam)
            return
        if not self.driver.has_work:
            return
        started = time.perf_counter()  # the scheduler decides at the start of the step
        try:
            st = self.driver.step(self._compute)
        except StalledError as exc:
            self._step_failed(exc, f"the {type(self.scheduler).__name__} cannot make progress: {exc}")
            return
        except Exception as exc:
            if self.ranks is not None:
                raise
            self._step_failed(exc, f"{type(exc).__name__}: {exc}")
            return
        self.steps += 1
        self.executor.prune_v4()  # after the step's commit: snapshots of blocks that left the prefix cache go
        for chunk in st.output.scheduled if st.output is not None else ():
            live = self._live.get(chunk.request.req_id)
            if live is not None and live.scheduled_at is None:
                live.scheduled_at = started
        for live in self._live.values():  # a forked choice was scheduled when its prompt's first choice was
            if live.forked_from is not None:
                live.scheduled_at, live.forked_from = live.forked_from.scheduled_at, None
        outbox = self._collect(st)
        self.driver.finished.clear()  # the server's driver lives for ever: its finished requests are ours to drop
        for live, event in outbox:
            # its first tokens, or its prefill done with the token dropped (an embedding's, an echo without
            # generation's: its one event ends it)
            if (event.new_token_ids and len(event.new_token_ids) == len(event.token_ids)) or live.drops_token:
                self.prompt_tokens_total += event.prompt_tokens
            self.generation_tokens_total += len(event.new_token_ids)
        if self.observer is not None:  # counted before any client can see the tokens (and scrape)
            with contextlib.suppress(Exception):
                self.observer.on_step(st, sum(len(ev.new_token_ids) for _, ev in outbox))
        for live, event in outbox:
            self._send(live, event)


    def _collect(self, st: StepStats) -> list[tuple[LiveRequest, ServeEvent]]:
        """Each request's new tokens (and its end) after a step, to send; finished ones are retired."""
        now = time.perf_counter()
        outbox = []
        done = {r.req_id for r in st.finished}
        for req_id, live in list(self._live.items()):
            # an embedding's prefill reports no token (the one it drew is dropped; vLLM counts no generation tokens
            # for pooling): its end, timed as a first token's would be, is what the metrics see
            tokens = () if live.drops_token else live.request.output_token_ids
            new = len(live.request.output_token_ids) - live.reported
            if new <= 0 and req_id not in done:
                continue
            live.token_times.extend([now] * max(new, 0))
            # an embedding ends "stop" once pooled, as vLLM's pooling requests do
            reason = ("stop" if live.request.prefill_only else live.request.finish_reason or "length") \
                if req_id in done else None
            event = ServeEvent(req_id, tuple(tokens[live.reported:]), tuple(tokens), finish_reason=reason,
                               stop_reason=live.stop_reason if req_id in done else None,
                               prompt_tokens=live.request.num_prompt_tokens,
                               reused_prompt_tokens=live.request.num_cached_tokens,
                               logprobs=tuple(live.token_logprobs[live.reported:len(tokens)]),
                               prompt_logprobs=tuple(live.prompt_logprobs)
                               if live.prompt_logprobs is not None and live.reported == 0 else None)
            live.reported = len(live.request.output_token_ids)
            if reason is not None:
                self._retire(live, reason)
            outbox.append((live, event))
        return outbox

    def _finish_early(self, req_id: str, reason: str, error: str | None = None) -> None:
        """Finish a queued or running request now (abort, stop string, failure): blocks freed, sink told."""
        live = self._live.get(req_id)
        if live is None:
            return
        req = live.request
        if not req.is_finished:
            with contextlib.suppress(Exception):  # freeing must not take the loop down
                self.scheduler.finish(req, reason)
        req.finish_reason = reason
        if req in self.driver.running:
            self.driver.running.remove(req)
        with contextlib.suppress(ValueError):
            self.driver.waiting.remove(req)
        self.driver.unfork(req)  # a choice still waiting for its prompt's prefill
        kids = self.driver.forks_of(req)  # the choices waiting for its prefill: the next one prefills for them
        if kids:
            heir = self._live[kids[0].req_id]
            heir.request.skip_prefix_read = live.params.prompt_logprobs is not None  # it scores the prompt now
            self.driver.add(heir.request)
            self.driver.fork(heir.request, kids[1:])
        self._retire(live, reason)
        if self.executor._emit is not None:  # the audit log sees every end, not only the driver's
            with contextlib.suppress(Exception):
                self.executor._emit(RequestFinished(req_id=req_id, reason=reason, prompt_tokens=req.num_prompt_tokens,
                                                    output_tokens=len(req.output_token_ids),
                                                    reused_prompt_tokens=req.num_cached_tokens))
        tokens = req.output_token_ids
        self._send(live, ServeEvent(req_id, tuple(tokens[live.reported:]), tuple(tokens), finish_reason=reason,
                                    error=error, prompt_tokens=req.num_prompt_tokens,
                                    reused_prompt_tokens=req.num_cached_tokens,
                                    logprobs=tuple(live.token_logprobs[live.reported:len(tokens)])))
        live.reported = len(tokens)

    def _retire(self, live: LiveRequest, reason: str) -> None:
        self._live.pop(live.request.req_id, None)
        if self.executor.proposer is not None:
            self.executor.proposer.forget(live.request.req_id)
        if self.executor.v4 is not None:  # DeepSeek V4: its compressor side state goes with it
            self.executor.v4.free(live.request.req_id)
        if self.observer is None:
            return
        req = live.request
        # an embedding's drawn token is dropped, as is an echo without generation's
        generated = 0 if live.drops_token else len(req.output_token_ids)
        done = FinishedRequest(req.num_prompt_tokens, generated, req.num_cached_tokens, reason,
                               live.params, live.sample, live.samples, live.queued_at, live.scheduled_at,
                               tuple(live.token_times), live.group)
        with contextlib.suppress(Exception):
            self.observer.on_finished(done)

    def _step_failed(self, exc: Exception, message: str) -> None:
        """A step raised: every request ends with ``"error"`` and ``message`` (blocks freed), and the operator gets
        one error record (the client's 500 or error chunk reaches only the client)."""
        ended = self._fail_all(message)
        if self.executor._emit is not None:
            with contextlib.suppress(Exception):  # reporting must not take the loop down
                self.executor._emit(EngineStepFailed(error=type(exc).__name__, message=first_line(exc, ""),
                                                     requests=ended))

    def _fail_all(self, message: str, reason: str = "error") -> int:
        """End every queued and live request with ``reason``; how many there were."""
        with self._cond:
            pending, self._inbox = self._inbox, []
        pending, self._held = [*self._held, *pending], []
        beams = [entry for entry in pending if isinstance(entry, BeamJob)]
        if self._beam is not None:
            beams.append(self._beam)
        for live in (lv for group in pending if not isinstance(group, BeamJob) for lv in group):
            self._live[live.request.req_id] = live
        ended = list(self._live)
        for req_id in ended:
            self._finish_early(req_id, reason, error=message if reason == "error" else None)
        for job in beams:
            self._end_beam(job, None, reason, message if reason == "error" else None)
        if ended:  # as after aborts: no step follows to drop the snapshots of blocks they left uncached
            self.executor.prune_v4()
        return len(ended) + sum(len(job.sinks) for job in beams)

    @staticmethod
    def _send(live: LiveRequest, event: ServeEvent) -> None:
        with contextlib.suppress(Exception):  # a broken sink is its client's problem, not the loop's
            live.sink(event)


def _no_sink(event: ServeEvent) -> None:
    """A follower rank's requests have no client: rank 0 answers them."""


__all__ = ["EngineObserver", "EngineStopped", "FinishedRequest", "KvBuildError", "ServeEvent", "ServingEngine",
           "StepOrders"]
