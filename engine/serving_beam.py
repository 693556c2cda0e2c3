"""A beam search as a unit of work of the serving loop: queued, started once the requests before it ended, a step
of it each turn of the loop, its choices answered best first when it ends (:class:`ServingBeam`, a part of
:class:`~engine.serving.ServingEngine`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from engine.sampling_params import SamplingParams, check_salt
from engine.served import BeamJob, EngineStopped, FinishedRequest, ServeEvent, logprob_and_top
from pipeline.errors import GenerationError, first_line
from pipeline.events import EngineStepFailed


class ServingBeam:
    """Beam searches submitted to the serving loop, stepped and ended."""

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
        job = BeamJob(list(first.prompt_token_ids), params, sampling, list(sinks), ids, salt, time.perf_counter())
        with self._cond:  # as submit's: checked again under the lock the loop's last drain takes
            if self._stopping or self.loop_error is not None:
                raise EngineStopped(self._why_stopped())
            for req_id in ids:
                self._beam_ids[req_id] = job
            self._inbox.append(job)
            self._cond.notify_all()
        return ids

    def _start_beam(self, job: BeamJob) -> None:
        """Start a beam search (the driver has no work): its audit segment opens, its first step runs next."""
        try:
            job.search = BeamSearch(self.executor, [(None, job.ids)], job.params, job.salt)
            job.search.start()
        except Exception as exc:  # checked at submission: the pools changed since (say so, free nothing twice)
            self._end_beam(job, None, "error", f"{type(exc).__name__}: {exc}")
            return
        self._beam = job

    def _beam_step(self, job: BeamJob) -> None:
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

    def _end_beam(self, job: BeamJob, output: BeamSearchOutput | None, reason: str, error: str | None = None,
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
            lps = tuple(logprob_and_top(t, entry, k) for t, entry in zip(tokens, seq.logprobs or (), strict=True)) \
                if seq is not None and k is not None else ()
            event = ServeEvent(req_id, tokens, tokens, finish_reason=why, error=error if seq is None else None,
                               prompt_tokens=len(job.ids), reused_prompt_tokens=reused, logprobs=lps)
            with contextlib.suppress(Exception):  # a broken sink is its client's problem, not the loop's
                sink(event)
