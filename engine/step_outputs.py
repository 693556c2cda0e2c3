"""What a step gives back to the caller: first-token times, new tokens to streams, finished samples and prompts
as RequestOutputs (:class:`StepOutputs`, a part of :class:`~engine.executor.GenerationExecutor`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cache_backends.request import Request
from engine.live_sample import LiveSample
from engine.outputs import (
    CompletionOutput,
    GenerationTimings,
    RequestMetrics,
    RequestOutput,
    TokenDelta,
)
from engine.sampling import Logprob
from engine.sampling_params import (
    SamplingParams,
)


class StepOutputs:
    """A step's new tokens reported, and the outputs of finished prompts."""

    def _report_tokens(self, finished: list[Request], touched: list[LiveSample],
                       samples: Mapping[int, list[LiveSample]], outputs: dict[int, RequestOutput],
                       on_delta: Callable[[TokenDelta], Any] | None) -> None:
        """After a step: first-token times, finished samples and prompts, ``on_delta`` for each new token, of the
        lives the step ``touched`` (``samples``: each prompt's, by its index)."""
        now = time.perf_counter()
        done = {r.req_id for r in finished}
        for live in touched:
            tokens = live.request.output_token_ids
            if live.logprobs is not None and len(live.logprobs) > len(tokens):  # confirmed drafts after a stop token
                del live.logprobs[len(tokens):]
            if len(tokens) == live.reported:  # no token this step (mid-prefill, waiting, or finished earlier)
                continue
            new = tokens[live.reported:]
            new_logprobs = live.logprobs[live.reported:] if live.logprobs is not None else None
            live.reported = len(tokens)
            if live.first_token_at is None:
                live.first_token_at = now
            ended = live.request.req_id in done
            if ended:
                live.finished_at = now
                live.finish_reason = live.request.finish_reason or "length"
            if live.text is not None:
                ids = tokens
                if (ended and live.finish_reason == "stop" and not isinstance(live.stop_reason, str)
                        and not live.params.include_stop_str_in_output):
                    ids = tokens[:-1]  # the EOS or stop token that ended it is not part of the text (vLLM: unless
                    # include_stop_str_in_output, which keeps it, decoded as any token: a special one shows only
                    # with skip_special_tokens false)
                if ended:
                    live.text.update(ids, final=True)
                elif on_delta is not None:
                    live.text.update(ids)
            output = None
            if ended and all(s.finish_reason is not None for s in samples[live.index]):
                output = outputs[live.index] = self._output(samples[live.index])
            if on_delta is not None:
                text = live.text.delta(final=ended) if live.text is not None else ""
                self._name_tokens(new_logprobs, live.params)
                on_delta(TokenDelta(live.index, live.sample, list(new), text, new_logprobs,
                                    live.finish_reason if ended else None,
                                    live.stop_reason if ended else None, output))

    def _name_tokens(self, entries: Sequence[Mapping[int, Any] | None] | None, params: SamplingParams) -> None:
        """vLLM's ``Logprob.decoded_token`` on each entry's values: the token's text with special tokens shown (the
        server's token text), decoded once per token id; left None without a tokenizer or with ``detokenize=False``."""
        if entries is None or self.tokenizer is None or not params.detokenize:
            return
        texts = self._token_texts
        for entry in entries:
            for token, logprob in (entry or {}).items():
                if isinstance(logprob, Logprob) and logprob.decoded_token is None:
                    text = texts.get(token)
                    if text is None:
                        text = texts[token] = self.tokenizer.decode([token], skip_special_tokens=False,
                                                                    clean_up_tokenization_spaces=False)
                    logprob.decoded_token = text

    def _output(self, samples: list[LiveSample]) -> RequestOutput:
        """The RequestOutput of one prompt whose samples all finished."""
        first = samples[0]
        completions = []
        for s in samples:
            req = s.request
            cumulative = sum(lp[t] for lp, t in zip(s.logprobs, req.output_token_ids, strict=True)) \
                if s.logprobs is not None else None
            # detokenize=False: "" as vLLM's text (a str); None only where the model has no tokenizer (a preset)
            text = s.text.text if s.text is not None else "" if self.tokenizer is not None else None
            completions.append(CompletionOutput(
                index=s.sample, text=text,
                token_ids=list(req.output_token_ids), cumulative_logprob=cumulative, logprobs=s.logprobs,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        for s in samples:
            self._name_tokens(s.logprobs, s.params)
        self._name_tokens(first.prompt_logprobs, first.params)
        started = [s.first_token_at for s in samples if s.first_token_at is not None]
        end = max(s.finished_at for s in samples)
        first_token = min(started) if started else end
        admitted = [s.admitted_at for s in samples if s.admitted_at is not None]
        metrics = RequestMetrics(
            arrival_time=first.arrived_wall, queued_ts=first.queued_at,
            scheduled_ts=min(admitted) if admitted else first.queued_at, first_token_ts=first_token,
            last_token_ts=end, first_token_latency=first_token - first.queued_at,
            num_generation_tokens=sum(len(s.request.output_token_ids) for s in samples))
        return RequestOutput(
            request_id=first.request.req_id.rsplit(".", 1)[0] if first.params.n > 1 else first.request.req_id,
            prompt=first.prompt, prompt_token_ids=list(first.request.prompt_token_ids), outputs=completions,
            prompt_logprobs=first.prompt_logprobs,
            computed_prompt_tokens=sum(s.request.num_prompt_tokens - s.request.num_cached_tokens for s in samples),
            reused_prompt_tokens=sum(s.request.num_cached_tokens for s in samples),
            timings=GenerationTimings(first_token_s=first_token - first.queued_at, total_s=end - first.queued_at),
            metrics=metrics, num_cached_tokens=first.request.num_cached_tokens)
