"""``LLM.generate_stream``: tokens yielded as a background thread produces them, stopped and freed when the
consumer leaves, followed step by step on ranks the LLM started (:class:`StreamCalls`, a part of
:class:`~kvload.llm.LLM`)."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from engine.executor import StreamLeft
from engine.outputs import TokenDelta
from engine.sampling_params import SamplingParams
from kvload.llm_calls import checked_keywords, errors_titled, no_lora
from pipeline.thread_end import EndingThread


class StreamClosed(Exception):
    """Raised inside the generation thread when the consumer of ``generate_stream`` went away."""


class StreamCalls:
    """``LLM``'s streaming generation."""

    @checked_keywords
    def generate_stream(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                        *, salt: str | None = None, chat: bool = False, lora_request: Any = None,
                        **sampling: Any) -> Iterator[TokenDelta]:
        """Yield a :class:`TokenDelta` per generated token of every sample, as the tokens are produced.

        A sample's ``delta.text`` pieces concatenate to its final text; its last delta has
        ``finish_reason`` set, and a prompt's last delta carries the prompt's ``RequestOutput``.
        Generation runs in a background thread; leaving the loop early (``break``, an exception)
        stops it and frees its KV blocks. Sampling settings are checked here, the prompts on the
        first ``next()``. ``lora_request``: as :meth:`generate`'s, only None. With ranks this LLM
        started, they run the stream too and stop after the same step as rank 0 (:mod:`kvload.llm_ranks`).
        """
        with errors_titled("generate_stream"):  # checked now, as the call will build them (over the model's defaults)
            self._check_open()
            no_lora("generate_stream", lora_request)
            self.result.executor._params(sampling_params, sampling, 0)
        return self._stream(prompts, sampling_params, sampling, salt, chat)

    def _followed_stream(self, prompts: Any, sampling_params: Any = None, *, salt: str | None = None,
                         chat: bool = False, **sampling: Any) -> None:
        """On a rank ``kvload.LLM`` started: rank 0's ``generate_stream`` made here, its tokens dropped, ending after
        the step where rank 0's consumer stopped reading (:mod:`kvload.llm_ranks`)."""
        with contextlib.suppress(StreamLeft):
            for _ in self._stream(prompts, sampling_params, sampling, salt, chat, follow=True):
                pass

    def _stream(self, prompts: Any, params: Any, sampling: dict[str, Any], salt: str | None,
                chat: bool, follow: bool = False) -> Iterator[TokenDelta]:
        with self._exclusive("generate_stream"):
            items: queue.SimpleQueue[Any] = queue.SimpleQueue()
            closed = threading.Event()
            done = object()
            ranks = self._ranks
            # with ranks this LLM started, rank 0 says at each step whether its consumer left, and every rank stops
            # after that same step (engine.executor's stream_stop); a rank's own stop would leave the others mid-step
            in_step = ranks is not None or follow
            ended: list[BaseException | None] = [None]

            def on_delta(delta: TokenDelta) -> None:
                if closed.is_set():
                    if in_step:
                        return  # the step's answer stops every rank after this step
                    raise StreamClosed("the generate_stream consumer stopped reading")
                items.put(delta)

            def work() -> None:
                try:
                    with self._running("generate_stream") as executor, \
                            executor.stream_stopped_by(closed.is_set) if in_step else contextlib.nullcontext():
                        outputs = executor.run(prompts, params, salt=salt, chat=chat, on_delta=on_delta, **sampling)
                        self._metrics.record(outputs, executor.last_stats)
                except BaseException as exc:  # handed to the consumer, which raises it
                    ended[0] = exc
                    items.put(exc)
                else:
                    items.put(done)

            if ranks is not None:  # every other rank makes the call too (its _followed_stream)
                ranks.begin("generate_stream", StreamCalls.generate_stream, self, (prompts, params),
                            {"salt": salt, "chat": chat, **sampling})

            worker = EndingThread(target=work, name="kvload-generate-stream", daemon=True)
            worker.start()
            try:
                while True:
                    item = items.get()
                    if item is done:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                closed.set()
                # it stops at its next token; a Ctrl-C meanwhile is raised once it has, so a caller that handles it
                # (a REPL) finds the LLM free, not "already generating" (see pipeline.thread_end)
                try:
                    worker.wait_end()
                finally:
                    if ranks is not None:  # the consumer leaving is no failure: every rank stopped after one step
                        ranks.end("generate_stream", None if isinstance(ended[0], StreamLeft) else ended[0])
