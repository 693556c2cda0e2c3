"""The serving loop's forward: the executor's packing, then each request's own pick (argmax or its generator,
penalties and grammar), forked choices' rows, drafts proposed and verified, logprobs kept (:class:`ServingStep`, a
part of :class:`~engine.serving.ServingEngine`)."""

from __future__ import annotations

import itertools

import torch

from cache_backends.interface import SchedulerOutput
from cache_backends.request import Request
from engine.penalties import penalize
from engine.sampling import sample_rows, top_logprobs
from engine.served import LiveRequest, logprob_and_top
from engine.speculation import verify_drafted
from engine.structured import Constraint, constrain, overruled_settings
from pipeline.events import SettingIgnored


class ServingStep:
    """A step's forward and each request's pick of its next tokens."""

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
                    lives: list[LiveRequest], counts: list[int],
                    ) -> tuple[torch.Tensor, list[Request], list[LiveRequest], list[int]]:
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
                lives: list[LiveRequest], raw: torch.Tensor) -> dict[str, list[int]]:
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
    def _keep_logprobs(live: LiveRequest, token: int, top: dict[int, float]) -> None:
        """One generated token's log-probability and the request's top ``logprobs`` alternatives."""
        live.token_logprobs.append(logprob_and_top(token, top, live.logprobs or 0))

    def _propose(self, request: Request, running: int) -> list[int]:
        """The driver's propose hook: a live request's drafts, greedy or sampled (the proposer says while how many
        may run)."""
        live = self._live.get(request.req_id)
        proposer = self.executor.proposer
        if live is None or proposer is None:
            return []
        return proposer.propose(request, running)
