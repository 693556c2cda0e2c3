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
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import random
import re
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch

from cache_backends.interface import SchedulerOutput
from cache_backends.request import Request
from engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from engine.call_requests import POOLED
from engine.driver import Driver, StalledError, StepStats, at_length
from engine.executor import GenerationExecutor
from engine.penalties import penalize
from engine.prompts import apply_template, check_text, missing_template
from engine.sampling import sample_rows, top_logprobs
from engine.sampling_params import SamplingParams, check_salt, greedy_ignored, inert_settings
from engine.speculation import verify_drafted
from engine.stopping import SampleText
from engine.structured import Constraint, constrain, overruled_settings
from engine.token_bound import Bound, fewest_tokens, token_bound
from pipeline.errors import GenerationError, KvBuildError, KvloadError, KvRuntimeError, RankLostError, first_line
from pipeline.events import EngineLoopFailed, EngineStepFailed, Event, RequestFinished, SettingIgnored
from pipeline.ranks import lost_rank_message
from pipeline.signals import stopping
from pipeline.thread_end import EndingThread


@attrs.frozen
class ServeEvent:
    """What a request's sink receives: its new tokens, and on the last event why it ended (or the error)."""

    req_id: str
    new_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # every generated token so far
    finish_reason: str | None = None  # "stop" (EOS or a stop token), "length", "abort" or "error"
    error: str | None = None
    #: with ``finish_reason == "stop"``: the stop token id or the stop string that ended it; None for EOS (vLLM's)
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    #: per new token, when asked: (its log-probability, {token id: log-probability} of the top alternatives)
    logprobs: tuple[tuple[float, dict[int, float]], ...] = ()
    #: with ``prompt_logprobs``, on the first event: per prompt token, its entry (top alternatives and itself), None
    #: for the first token
    prompt_logprobs: tuple[dict[int, float] | None, ...] | None = None

    @property
    def finished(self) -> bool:
        """Whether this is the request's last event."""
        return self.finish_reason is not None

    @property
    def stopped_by_token(self) -> bool:
        """Whether the last token ended it (EOS or a stop token id): that token is in ``token_ids``, not in the text
        (as in ``generate``); a stop string is cut from the text by the face instead."""
        return self.finish_reason == "stop" and not isinstance(self.stop_reason, str)


@attrs.frozen
class FinishedRequest:
    """What an observer learns of a request that ended: its sizes, its reason, and its moments on the loop's clock
    (``time.perf_counter``): queued, first scheduled (None: it never ran), and when each token was sent (the end of
    the step that made it; tokens of one step share it)."""

    prompt_tokens: int
    output_tokens: int
    #: prompt tokens whose KV came from the prefix cache (or a sibling's prefill) when it was first scheduled; a
    #: preempted request's later re-admissions do not change it (vLLM's ``num_cached_tokens``)
    reused_prompt_tokens: int
    reason: str  # "stop", "length", "abort" or "error"
    params: SamplingParams
    sample: int  # which of its prompt's samples (0 ... samples - 1)
    samples: int  # the request's n: samples submitted for its prompt
    queued_at: float
    scheduled_at: float | None
    token_times: tuple[float, ...]
    group: str | None = None  # the first request id of its prompt's n samples (None: a group of one)

    @property
    def ttft_s(self) -> float | None:
        """Queued to first token; None when it never got one (aborted or failed before its prefill ended)."""
        return self.token_times[0] - self.queued_at if self.token_times else None

    @property
    def inter_token_s(self) -> list[float]:
        """Time between consecutive steps that gave it tokens (tokens of one step, drafts confirmed together, are
        one interval: they reached the client together)."""
        return [b - a for a, b in itertools.pairwise(self.token_times) if b > a]

    @property
    def phases(self) -> tuple[float, float, float, float] | None:
        """(queue, prefill, decode, inference) seconds, vLLM's intervals: queued to first scheduled, first scheduled
        to first token, first to last token, first scheduled to last token (prefill + decode; queue + inference is
        the end-to-end latency). None without a first token. A preempted request's recompute counts in the phase
        it interrupted (vLLM measures from the most recent scheduling instead)."""
        if not self.token_times or self.scheduled_at is None:
            return None
        first, last = self.token_times[0], self.token_times[-1]
        return (self.scheduled_at - self.queued_at, first - self.scheduled_at, last - first, last - self.scheduled_at)


class EngineObserver(Protocol):
    """Receives what metrics need, on the loop thread (keep it cheap)."""

    def on_step(self, stats: StepStats, new_tokens: int) -> None:
        """After every step: what it did (``stats.output`` is the scheduler's decision), tokens it generated."""

    def on_finished(self, done: FinishedRequest) -> None:
        """When a request ends (finished, aborted or failed)."""


@attrs.define(eq=False)
class _Live:
    request: Request
    params: SamplingParams
    sink: Callable[[ServeEvent], Any]
    generator: torch.Generator | None
    stop_token_ids: frozenset[int]
    text: SampleText | None  # with stop strings: the text they are looked for in
    logprobs: int | None
    queued_at: float
    token_times: list[float] = attrs.Factory(list)
    token_logprobs: list[tuple[float, dict[int, float]]] = attrs.Factory(list)
    reported: int = 0
    stop_reason: int | str | None = None  # what ended it with "stop": a stop token id or a stop string
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with params.prompt_logprobs, filled by prefill
    constraint: Constraint | None = None  # with params.structured_outputs: its grammar state
    seed: int | None = None  # the seed its generator started from (with seed_offset): what followers rebuild it from
    sample: int = 0  # its seed_offset: which of its prompt's n samples
    samples: int = 1  # its prompt's n
    scheduled_at: float | None = None  # when a step first scheduled it (the queue time ends there)
    forked_from: _Live | None = None  # a choice given its first token from this first choice's prefill, until sent
    group: str | None = None  # its prompt's first choice's request id (what metrics group the n choices by)


@attrs.define(eq=False)
class _BeamJob:
    """One beam search the loop runs as a unit of work: its prompt, its choices' sinks and ids, and once started its
    search (``engine.beam_search.BeamSearch``)."""

    ids: list[int]
    params: BeamSearchParams
    sampling: SamplingParams  # what metrics see (max_tokens, greedy)
    sinks: list[Callable[[ServeEvent], Any]]
    req_ids: list[str]  # choice j's id: aborting any of them aborts the search
    salt: str | None
    queued_at: float
    search: BeamSearch | None = None
    scheduled_at: float | None = None


class _ServeDriver(Driver):
    """The driver with per-request end-of-sequence rules (``ignore_eos``, stop token ids)."""

    def __init__(self, *args: Any, live: dict[str, _Live], **kwargs: Any) -> None:
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


class EngineStopped(GenerationError):
    """:meth:`ServingEngine.submit` after a stop was asked for: nothing was queued (the request would never end)."""


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


class ServingEngine:
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
        self._live: dict[str, _Live] = {}
        self.driver = _ServeDriver(self.manager, self.scheduler, eos_token_ids=executor.eos_token_ids,
                                   emit=executor._emit, live=self._live,
                                   propose=self._propose if executor.proposer is not None else None)
        self._cond = threading.Condition()
        self._inbox: list[list[_Live] | _BeamJob] = []  # each entry: one request's choices, or a beam search
        #: entries that came after a beam search still waiting or running: applied, in order, once it has ended
        self._held: list[list[_Live] | _BeamJob] = []
        self._beam: _BeamJob | None = None  # the beam search the loop runs now
        self._beam_ids: dict[str, _BeamJob] = {}  # each queued or running beam search, by each choice's id
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

    def encode(self, prompt: str | Sequence[int], *, chat: bool = False, add_special_tokens: bool = True) -> list[int]:
        """Token ids of one prompt (text through the tokenizer, ``chat`` wraps it as one user message), checked as
        ``generate`` checks a prompt. ``add_special_tokens=False``: text without the tokenizer's BOS (vLLM's)."""
        limit = self.executor.max_seq_len
        if isinstance(prompt, str) and not chat:
            self._check_chars("generate: prompt 0", prompt)
        if isinstance(prompt, str) and not add_special_tokens and not chat:
            prompt = self.prompt_ids(prompt, add_special_tokens=False)
        if not chat and not isinstance(prompt, str) and len(prompt) >= limit:  # ids: refused by their count first, as
            # generate words it, not after each of them is checked (a server's body of tens of millions of ids held
            # its one parsing worker, which every request waits on, for a minute)
            raise GenerationError(f"generate: prompt 0: {len(prompt)} tokens leave no room to generate under "
                                  f"max_seq_len={limit}; shorten it or raise max_seq_len")
        ((_, ids),) = self.executor._prompts([prompt], chat)
        return ids

    def prompt_ids(self, prompt: str | Sequence[int], *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of one prompt, unchecked but for being empty: text through the tokenizer
        (``add_special_tokens``: its BOS), ids as given; ``GenerationError`` worded as ``generate`` words a prompt
        of no tokens (what serving cuts to ``truncate_prompt_tokens`` before :meth:`encode` checks the rest)."""
        ids = (self.tokenize(prompt, add_special_tokens=add_special_tokens, where="prompt 0")
               if isinstance(prompt, str) else list(prompt))
        if not ids:
            raise GenerationError("generate: prompt 0: empty (no tokens)")
        return ids

    def encode_messages(self, messages: list[dict[str, str]], template: Mapping[str, Any] | None = None, *,
                        add_special_tokens: bool = False, room: bool = True,
                        instead: str = "use /v1/completions with token ids",
                        tokenize: Callable[[str, bool], list[int]] | None = None, tokenizer: Any = None) -> list[int]:
        """Token ids of a chat conversation through the chat template (the tokenizer's, or
        ``template["chat_template"]``), ready for the reply. ``template``: ``engine.prompts.template_options``'
        keywords (vLLM's add_generation_prompt, continue_final_message, chat_template, chat_template_kwargs);
        ``add_special_tokens``: the tokenizer's BOS on top of what the template writes (vLLM's, off by default);
        ``room``: refuse a conversation that leaves no room to generate (off for /tokenize); ``instead``: what the
        refusal of a tokenizer without a chat template offers (the endpoint's own field for a prompt); ``tokenize``:
        ``tokenize(text, add_special_tokens)``, the templated text's ids as the tokenizer gives them (the server's
        tokenizes a long one off its parse gate, on a copy of the tokenizer: the same ids); ``tokenizer``: a copy of
        the engine's to render and tokenize with (the server's for a long conversation, off its parse gate)."""
        template = dict(template or {})
        for j, m in enumerate(messages):  # a lone surrogate would reach the tokenizer as a TypeError
            check_text(f"messages[{j}].content", m["content"])
        tok = self.tokenizer if tokenizer is None or self.tokenizer is None else tokenizer
        missing = missing_template(tok, template, self.executor.name)
        if missing is not None:
            raise GenerationError(f"messages: {missing}; {instead}")
        # what apply_chat_template(tokenize=True) does (and LLM.chat): the text, then its ids with no special
        # tokens of the tokenizer's own unless asked (the template already holds them)
        text = apply_template(tok, "messages", messages, tokenize=False, content_format=self.content_format, **template)
        # what else the template renders (its variables, its own text) may hold a lone surrogate the checks above miss
        check_text("messages: the chat template's text", text)
        if room:
            self._check_chars("messages", text, tok)
        ids = ([int(t) for t in tok(text, add_special_tokens=add_special_tokens)["input_ids"]] if tokenize is None
               else tokenize(text, add_special_tokens))
        if room and len(ids) >= self.executor.max_seq_len:
            raise GenerationError(f"messages: {len(ids)} tokens leave no room to generate under "
                                  f"max_seq_len={self.executor.max_seq_len}")
        return ids

    def _check_chars(self, where: str, text: str, tokenizer: Any = None) -> None:
        """``GenerationError`` worded as a prompt too long for ``max_seq_len`` when ``text`` has more characters than
        that many of the tokenizer's longest tokens cover (``engine.token_bound``): refused before tokenizing it,
        which for tens of megabytes took a minute of the server's one parsing worker. ``tokenizer``: the engine's
        copy to read the bound from, the first time (off the server's parse gate)."""
        limit = self.executor.max_seq_len
        fewest, per_token = self._fewest_tokens(text, limit, tokenizer)
        if fewest >= limit:
            raise GenerationError(f"{where}: at least {fewest:,} tokens ({self._chars_said(text)}, a token of "
                                  f"this tokenizer covering at most {per_token}) leave no room to generate "
                                  f"under max_seq_len={limit}; shorten it or raise max_seq_len")

    def check_embedding_chars(self, where: str, text: str, what: str = POOLED["embed"]) -> None:
        """As :meth:`_check_chars` for an embedding's input (``what``: the pooled request, as
        ``engine.call_requests.POOLED`` names it), which may fill ``max_seq_len`` (nothing is generated): worded as the
        executor words one past it."""
        limit = self.executor.max_seq_len
        fewest, per_token = self._fewest_tokens(text, limit + 1)
        if fewest > limit:
            raise GenerationError(f"{where}: at least {fewest:,} tokens ({self._chars_said(text)}, a token of this "
                                  f"tokenizer covering at most {per_token}); {what} takes at most "
                                  f"max_seq_len={limit} (vLLM's max_model_len); shorten it, keep its last tokens "
                                  "(truncate_prompt_tokens) or raise max_seq_len")

    def _chars_said(self, text: str) -> str:
        """``text``'s characters as a refusal by :meth:`_fewest_tokens` counts them: "its M characters", and where
        the tokenizer drops some (``Bound.dropped``, not counted) how many, so the count follows from the kept ones."""
        said = f"its {len(text):,} characters"
        dropped = "" if isinstance(self._bound, bool) or self._bound is None else self._bound.dropped
        left_out = sum(text.count(c) for c in dropped)  # on a refusal only: a pass over the text per dropped character
        return said + (f", {left_out:,} of them ones this tokenizer drops" if left_out else "")

    def _fewest_tokens(self, text: str, at_least: int, tokenizer: Any = None) -> tuple[int, int | None]:
        """(the fewest tokens ``text`` can have, exact from ``at_least`` up, the most characters a token covers);
        (0, None) when unbounded. ``tokenizer``: a copy of the engine's to read the vocabulary of (the same
        bound)."""
        if self.tokenizer is None:
            return 0, None
        if self._bound is False:  # found once: reading the tokenizer's vocabulary takes a tenth of a second
            self._bound = token_bound(self.tokenizer if tokenizer is None else tokenizer)
        bound = None if isinstance(self._bound, bool) else self._bound
        return fewest_tokens(text, bound, at_least), None if bound is None else bound.per_token

    def tokenize(self, text: str, *, add_special_tokens: bool = True, where: str = "prompt",
                 tokenizer: Any = None) -> list[int]:
        """Token ids of ``text`` as the tokenizer gives them (``add_special_tokens``: its BOS and the like), no
        other check (vLLM's /tokenize); ``GenerationError`` naming ``where`` without a tokenizer. ``tokenizer``: a
        copy of the engine's to encode with (the server's for a big prompt tokenized off its parse gate)."""
        check_text(where, text)
        if self.tokenizer is None:
            raise GenerationError(f"{where}: the model {self.executor.name} has no tokenizer (presets have random "
                                  "weights and none); only token ids are served")
        tok = self.tokenizer if tokenizer is None else tokenizer
        return [int(t) for t in tok(text, add_special_tokens=add_special_tokens)["input_ids"]]

    def check_prompt_chars(self, text: str) -> None:
        """What :meth:`encode` checks of a text prompt before tokenizing it: refused when it has more characters
        than ``max_seq_len`` of the tokenizer's longest tokens cover."""
        self._check_chars("generate: prompt 0", text)

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """The tokenizer's own string of each token (``convert_ids_to_tokens``: ``Ġthe``, ``<|im_end|>``)."""
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(list(token_ids))]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of token ids with special tokens shown (vLLM's /detokenize); ``GenerationError`` naming ``tokens``
        without a tokenizer or for an id outside its vocabulary."""
        tok = self.tokenizer
        if tok is None:
            raise GenerationError(f"tokens: the model {self.executor.name} has no tokenizer (presets have random "
                                  "weights and none); there is no text to give")
        size = len(tok)
        bad = next((i for i, t in enumerate(token_ids) if not 0 <= t < size), None)
        if bad is not None:
            raise GenerationError(f"tokens[{bad}]: token id {token_ids[bad]} is outside the tokenizer's vocabulary "
                                  f"(0..{size - 1})")
        return tok.decode(list(token_ids))

    def decode(self, token_ids: Sequence[int]) -> str | None:
        """Text of token ids without special tokens; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def token_piece(self, token_id: int) -> tuple[str, bytes]:
        """One token as logprobs show it: its text with special tokens shown (``<|im_end|>``, not ""), and its raw
        bytes (a byte-level piece of a multi-byte character is its own byte, not the UTF-8 of "\ufffd"); without a
        tokenizer, the id as text."""
        piece = self._pieces.get(token_id)
        if piece is None:
            if self._byte_level is None:
                self._byte_level = _byte_level(self.tokenizer)
            piece = self._pieces[token_id] = _token_piece(self.tokenizer, token_id, self._byte_level)
        return piece

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
                     priority: int = 0) -> list[str]:
        """Queue one request's ``len(sinks)`` choices of one prompt, computed from one prefill (module docstring):
        choice ``j`` is what :meth:`submit` with ``seed_offset=j`` gives (seed + j; greedy choices alike) and reports
        to ``sinks[j]``. Their ids, in order; nothing queued when they could never run (as :meth:`submit`)."""
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
            group.append(live)
        with self._cond:  # as submit's: checked again under the lock the loop's last drain takes
            if self._stopping or self.loop_error is not None:
                raise EngineStopped(self._why_stopped())
            self._say_cut(notes, first.req_id)
            self._inbox.append(group)
            self._cond.notify_all()
        return [live.request.req_id for live in group]

    def submit_beam(self, prompt_token_ids: Sequence[int], params: BeamSearchParams,
                    sinks: Sequence[Callable[[ServeEvent], Any]], *, salt: str | None = None) -> list[str]:
        """Queue one beam search of one prompt (``engine.beam_search``, what ``LLM.beam_search`` does): choice ``j``
        is its ``j``-th best hypothesis, reported to ``sinks[j]`` in one event once the search ends (module
        docstring); ``len(sinks)`` is ``params.beam_width``. Their ids, in order; nothing queued (``GenerationError``
        / ``KvBuildError``) when it could never run."""
        if len(sinks) != params.beam_width:
            raise GenerationError(f"beam_search: {len(sinks)} sinks for beam_width={params.beam_width}")
        if self._stopping or self.loop_error is not None:
            raise EngineStopped(self._why_stopped())
        if self.ranks is not None:  # its ranking is not in StepOrders: the ranks could not be kept alike
            raise GenerationError("beam_search: not served under tensor parallel; serve the model on one device")
        refused = self.executor.beam_refusal()
        if refused is not None:
            raise GenerationError(refused)
        width = self.executor.max_beam_width
        if params.beam_width > width:
            raise GenerationError(f"beam_search: beam_width={params.beam_width} exceeds max_beam_width={width}, the "
                                  f"width the model was loaded for")
        check_salt(salt)
        sampling = SamplingParams(max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)
        first = self.check(prompt_token_ids, sampling)  # the vocabulary, the length, one sequence fits the pools
        ids = [first.req_id, *(f"srv-{next(self._ids)}" for _ in sinks[1:])]
        job = _BeamJob(list(first.prompt_token_ids), params, sampling, list(sinks), ids, salt, time.perf_counter())
        with self._cond:  # as submit's: checked again under the lock the loop's last drain takes
            if self._stopping or self.loop_error is not None:
                raise EngineStopped(self._why_stopped())
            for req_id in ids:
                self._beam_ids[req_id] = job
            self._inbox.append(job)
            self._cond.notify_all()
        return ids

    def _new_live(self, request: Request, params: SamplingParams, sink: Callable[[ServeEvent], Any],
                  seed: int | None) -> _Live:
        """A request's loop-side state: its generator from ``seed`` (None: greedy), its stop-string text."""
        gen = None if seed is None else torch.Generator(device=self.executor.pools.device).manual_seed(seed)
        text = SampleText(self.tokenizer, params.stop, skip_special=params.skip_special_tokens,
                          spaced=params.spaces_between_special_tokens) \
            if params.stop and self.tokenizer is not None else None  # finds the stop strings (the face cuts)
        live = _Live(request, params, sink, gen, frozenset(params.stop_token_ids), text, params.logprobs,
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
            waiting += sum(len(entry.sinks) if isinstance(entry, _BeamJob) else len(entry) for entry in self._held)
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
            inbox: list[list[_Live] | _BeamJob] = []
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

    def _apply(self, inbox: Sequence[list[_Live] | _BeamJob], aborts: list[str]) -> None:
        """New requests join the driver (a request's other choices as forks of its first), in order until a beam
        search: it starts once the driver has no work, and what comes after it waits until it ended (module
        docstring); then the aborted end (under ``state_lock``)."""
        entries, self._held = [*self._held, *inbox], []
        for k, entry in enumerate(entries):
            if self._beam is not None or (isinstance(entry, _BeamJob) and self.driver.has_work):
                self._held = entries[k:]
                break
            if isinstance(entry, _BeamJob):
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

    def _start_beam(self, job: _BeamJob) -> None:
        """Start a beam search (the driver has no work): its audit segment opens, its first step runs next."""
        try:
            job.search = BeamSearch(self.executor, [(None, job.ids)], job.params, job.salt)
            job.search.start()
        except Exception as exc:  # checked at submission: the pools changed since (say so, free nothing twice)
            self._end_beam(job, None, "error", f"{type(exc).__name__}: {exc}")
            return
        self._beam = job

    def _beam_step(self, job: _BeamJob) -> None:
        """One step of the running beam search; when it ends, each choice gets its hypothesis (best first)."""
        search = job.search
        assert search is not None
        started = time.perf_counter()
        before = search.generated
        try:
            done = search.advance()
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            self._end_beam(job, None, "error", message, failed=exc)
            if self.executor._emit is not None:  # the operator's one error record, as a failed step gives
                with contextlib.suppress(Exception):
                    self.executor._emit(EngineStepFailed(error=type(exc).__name__, message=first_line(exc, ""),
                                                         requests=len(job.sinks)))
            return
        self.steps += 1
        st = search.last_step
        if st is not None and st.scheduled_tokens and job.scheduled_at is None:
            job.scheduled_at = started
            self.prompt_tokens_total += len(job.ids)
        self.generation_tokens_total += search.generated - before
        if self.observer is not None and st is not None:
            with contextlib.suppress(Exception):
                self.observer.on_step(st, search.generated - before)
        if done:
            try:
                outputs = search.finish()
            except Exception as exc:
                self._end_beam(job, None, "error", f"{type(exc).__name__}: {exc}", failed=exc)
                return
            self._end_beam(job, outputs[0], "length")

    def _end_beam(self, job: _BeamJob, output: BeamSearchOutput | None, reason: str, error: str | None = None,
                  failed: BaseException | None = None) -> None:
        """A beam search ended: with ``output`` each choice gets its hypothesis; without (aborted, failed, stopped)
        each ends with ``reason``, its beams freed and its audit segment closed as failed."""
        if self._beam is job:
            self._beam = None
            if output is None and job.search is not None:
                with contextlib.suppress(Exception):  # freeing must not take the loop down
                    why = "its client went away, or the server stopped" if reason == "abort" else error or reason
                    job.search.fail(failed or GenerationError(f"beam_search: aborted: {why}"))
        elif job in self._held:
            self._held.remove(job)
        for req_id in job.req_ids:
            self._beam_ids.pop(req_id, None)
        now = time.perf_counter()
        search = job.search
        reused = search.firsts[0].num_cached_tokens if search is not None and output is not None else 0
        sequences = output.sequences if output is not None else ()
        for j, (req_id, sink) in enumerate(zip(job.req_ids, job.sinks, strict=True)):
            # a vocabulary smaller than the width has fewer hypotheses: the choices past them end with no tokens
            seq = sequences[j] if j < len(sequences) else None
            tokens = seq.token_ids if seq is not None else ()
            why = seq.finish_reason if seq is not None else reason
            if self.observer is not None:
                done = FinishedRequest(len(job.ids), len(tokens), reused, why, job.sampling, j, len(job.sinks),
                                       job.queued_at, job.scheduled_at, (now,) * len(tokens), job.req_ids[0])
                with contextlib.suppress(Exception):
                    self.observer.on_finished(done)
            # with logprobs asked, each token's as a plain request's: its entry from the step that chose it
            k = job.params.logprobs
            lps = tuple(_token_logprobs(t, entry, k) for t, entry in zip(tokens, seq.logprobs or (), strict=True)) \
                if seq is not None and k is not None else ()
            event = ServeEvent(req_id, tokens, tokens, finish_reason=why, error=error if seq is None else None,
                               prompt_tokens=len(job.ids), reused_prompt_tokens=reused, logprobs=lps)
            with contextlib.suppress(Exception):  # a broken sink is its client's problem, not the loop's
                sink(event)

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
            if (event.new_token_ids and len(event.new_token_ids) == len(event.token_ids)) \
                    or live.request.prefill_only:  # its first tokens, or an embedding's prefill done
                self.prompt_tokens_total += event.prompt_tokens
            self.generation_tokens_total += len(event.new_token_ids)
        if self.observer is not None:  # counted before any client can see the tokens (and scrape)
            with contextlib.suppress(Exception):
                self.observer.on_step(st, sum(len(ev.new_token_ids) for _, ev in outbox))
        for live, event in outbox:
            self._send(live, event)

    def _compute(self, out: SchedulerOutput) -> dict[str, int | list[int]]:
        """The step's forward (the executor's packing), then each request's own pick: argmax or its generator (with
        drafts: the drafts the argmax confirms, then its token after them)."""
        logits, rows, counts = self.executor.forward_scored(out, self._live)
        if not rows:
            return {}
        reqs = [out.scheduled[i].request for i in rows]
        lives = [self._live[r.req_id] for r in reqs]
        if self.driver.forks_pending:
            logits, reqs, lives, counts = self._with_forks(out, rows, logits, reqs, lives, counts)
        starts = list(itertools.accumulate(counts, initial=0))
        # penalties and min_tokens pick from changed logits; logprobs stay the model's own (vLLM's raw_logprobs)
        raw = logits
        logits = penalize(logits, counts, [(lv.params, r) for lv, r in zip(lives, reqs, strict=True)],
                          self.executor.eos_token_ids)
        if any(lv.constraint is not None for lv in lives):
            overruled: list[Constraint] = []
            logits = constrain(logits, raw, counts, [(lv.constraint, r.draft_token_ids)
                                                     for lv, r in zip(lives, reqs, strict=True)],
                               self.executor.grammars(), overruled)
            first = {id(c) for c in overruled}  # said once per request, as the grammar overrules them
            for lv, r in zip(lives, reqs, strict=True) if first else ():  # (most steps: none)
                if id(lv.constraint) in first:
                    for name, value, why in overruled_settings(lv.params):
                        self.executor._event(SettingIgnored(field=f"serve.{name}", value=value,
                                                            reason=f"{why} (request {r.req_id})", request=r.req_id))
        picked: dict[str, int | list[int]] = {}
        plain = [i for i, c in enumerate(counts) if c == 1]
        if len(plain) < len(rows):
            picked.update(self._verify(logits, counts, starts, reqs, lives, raw))
            keep = [starts[i] for i in plain]
            logits, raw = logits[keep], raw[keep]
            reqs, lives = [reqs[i] for i in plain], [lives[i] for i in plain]
        greedy = [i for i, lv in enumerate(lives) if lv.params.greedy]
        if greedy:
            ids = logits[greedy].argmax(dim=-1).tolist()
            picked.update((reqs[i].req_id, t) for i, t in zip(greedy, ids, strict=True))
        for i, lv in enumerate(lives):
            if not lv.params.greedy:
                picked[reqs[i].req_id] = sample_rows(logits[i:i + 1], lv.params, [lv.generator])[0]
        if self.ranks is not None:  # rank 0's picks: the next step's inputs on every rank (StepOrders' invariant)
            picked = self.ranks.broadcast(picked)
        asked = [i for i, lv in enumerate(lives) if lv.logprobs is not None]
        if asked:
            k = max(lives[i].logprobs or 0 for i in asked)
            tokens = [picked[reqs[i].req_id] for i in asked]
            for i, token, top in zip(asked, tokens, top_logprobs(raw[asked], k, tokens), strict=True):
                self._keep_logprobs(lives[i], token, top)
        return picked

    def _with_forks(self, out: SchedulerOutput, rows: list[int], logits: torch.Tensor, reqs: list[Request],
                    lives: list[_Live], counts: list[int],
                    ) -> tuple[torch.Tensor, list[Request], list[_Live], list[int]]:
        """The step's rows plus one per choice forked from a first choice whose prompt this step completes: a copy of
        its logits row, so each choice draws its first token from the one prefill with its own generator, penalties
        and grammar (as it would have from a prefill of its own); a scored prompt's entries are copied to it too."""
        extra: list[int] = []
        starts = list(itertools.accumulate(counts, initial=0))
        for k, i in enumerate(rows):
            chunk = out.scheduled[i]
            req = chunk.request
            if req.num_computed_tokens + chunk.num_tokens < req.num_prompt_tokens:
                continue
            parent = lives[k]
            for kid in self.driver.forks_for(req.req_id):
                if self.executor.v4 is not None:  # DeepSeek V4: the choice continues the prompt's side state
                    self.executor.v4.copy(req.req_id, kid.req_id)
                live = self._live[kid.req_id]
                if parent.prompt_logprobs is not None and live.prompt_logprobs is not None:
                    live.prompt_logprobs = list(parent.prompt_logprobs)
                live.forked_from = parent
                extra.append(starts[k])
                reqs, lives = [*reqs, kid], [*lives, live]
        if not extra:
            return logits, reqs, lives, counts
        return torch.cat([logits, logits[extra]]), reqs, lives, [*counts, *[1] * len(extra)]

    def _verify(self, logits: torch.Tensor, counts: list[int], starts: list[int], reqs: list[Request],
                lives: list[_Live], raw: torch.Tensor) -> dict[str, list[int]]:
        """Verification of each drafting request, greedy or sampled (``engine.speculation.verify_drafted``), with
        the kept tokens' logprobs when asked (of ``raw``, the model's own logits, where ``logits`` are penalized)."""
        picked: dict[str, list[int]] = {}
        for i, _, kept in verify_drafted(logits, counts, [r.draft_token_ids for r in reqs],
                                         [(lv.params, lv.generator) for lv in lives]):
            picked[reqs[i].req_id] = kept
            if lives[i].logprobs is not None:
                rows = raw[starts[i]:starts[i] + len(kept)]
                for token, top in zip(kept, top_logprobs(rows, lives[i].logprobs, kept), strict=True):
                    self._keep_logprobs(lives[i], token, top)
        return picked

    @staticmethod
    def _keep_logprobs(live: _Live, token: int, top: dict[int, float]) -> None:
        """One generated token's log-probability and the request's top ``logprobs`` alternatives."""
        live.token_logprobs.append(_token_logprobs(token, top, live.logprobs or 0))

    def _propose(self, request: Request, running: int) -> list[int]:
        """The driver's propose hook: a live request's drafts, greedy or sampled (the proposer says while how many
        may run)."""
        live = self._live.get(request.req_id)
        proposer = self.executor.proposer
        if live is None or proposer is None:
            return []
        return proposer.propose(request, running)

    def _collect(self, st: StepStats) -> list[tuple[_Live, ServeEvent]]:
        """Each request's new tokens (and its end) after a step, to send; finished ones are retired."""
        now = time.perf_counter()
        outbox = []
        done = {r.req_id for r in st.finished}
        for req_id, live in list(self._live.items()):
            # an embedding's prefill reports no token (the one it drew is dropped; vLLM counts no generation tokens
            # for pooling): its end, timed as a first token's would be, is what the metrics see
            tokens = () if live.request.prefill_only else live.request.output_token_ids
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

    def _retire(self, live: _Live, reason: str) -> None:
        self._live.pop(live.request.req_id, None)
        if self.executor.proposer is not None:
            self.executor.proposer.forget(live.request.req_id)
        if self.executor.v4 is not None:  # DeepSeek V4: its compressor side state goes with it
            self.executor.v4.free(live.request.req_id)
        if self.observer is None:
            return
        req = live.request
        generated = 0 if req.prefill_only else len(req.output_token_ids)  # an embedding's drawn token is dropped
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
        beams = [entry for entry in pending if isinstance(entry, _BeamJob)]
        if self._beam is not None:
            beams.append(self._beam)
        for live in (lv for group in pending if not isinstance(group, _BeamJob) for lv in group):
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
    def _send(live: _Live, event: ServeEvent) -> None:
        with contextlib.suppress(Exception):  # a broken sink is its client's problem, not the loop's
            live.sink(event)


def _token_logprobs(token: int, entry: dict[int, float], k: int) -> tuple[float, dict[int, float]]:
    """A generated token's log-probability and its entry's ``k`` most likely tokens (``ServeEvent.logprobs``)."""
    return entry[token], dict(sorted(entry.items(), key=lambda kv: -kv[1])[:k])


def _no_sink(event: ServeEvent) -> None:
    """A follower rank's requests have no client: rank 0 answers them."""


#: a SentencePiece byte-fallback token: the byte it stands for
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character → byte: byte-level BPE vocabularies spell every byte as one printable
    character (bytes that are printable Latin-1 as themselves, the rest shifted past 255). Written out rather than
    imported: transformers moved ``bytes_to_unicode`` between releases."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    shifted = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's vocabulary is byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen): its pieces spell bytes."""
    if tokenizer is None:
        return False
    if getattr(tokenizer, "byte_decoder", None) is not None:  # transformers' Python GPT-2-style tokenizers
        return True
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    # a Sequence decoder does not list its parts but names them in its repr
    return decoder is not None and (type(decoder).__name__ == "ByteLevel" or "ByteLevel(" in repr(decoder))


def _token_piece(tokenizer: Any, token_id: int, byte_level: bool) -> tuple[str, bytes]:
    """(text with special tokens shown, raw bytes) of one token; see :meth:`ServingEngine.token_piece`."""
    if tokenizer is None:
        return str(token_id), str(token_id).encode()
    text = tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    spelled = tokenizer.convert_ids_to_tokens(token_id)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    if isinstance(spelled, str) and token_id not in added:  # an added token is stored as its text, not as bytes
        fallback = _BYTE_FALLBACK.fullmatch(spelled)
        if fallback is not None:
            return text, bytes([int(fallback[1], 16)])
        decoder = _byte_decoder()
        if byte_level and spelled and all(c in decoder for c in spelled):
            return text, bytes(decoder[c] for c in spelled)
    return text, text.encode()


__all__ = ["EngineObserver", "EngineStopped", "FinishedRequest", "KvBuildError", "ServeEvent", "ServingEngine",
           "StepOrders"]
