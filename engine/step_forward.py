"""One step's forward and sampling: the scheduled chunks packed into one forward over the paged pools, forked
samples' rows, speculative drafts verified, next tokens drawn (:class:`StepForward`, a part of
:class:`~engine.executor.GenerationExecutor`)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Collection, Mapping
from typing import Any

import attrs
import torch

from cache_backends.interface import SchedulerOutput
from cache_backends.paged_attention import PagedBatch, SeqChunk
from cache_backends.request import Request
from engine.live_sample import LiveSample
from engine.penalties import penalize
from engine.sampling import sample_rows, top_logprobs
from engine.speculation import verify_drafted
from engine.structured import Constraint, constrain, overruled_settings
from models.deepseek_v4_paged import step_states
from models.paged_forward import run_forward
from pipeline.events import (
    SettingIgnored,
)


@attrs.frozen
class PromptScores:
    """Logprob entries of consecutive prompt tokens from one step (``prompt_logprobs``): ``entries[j]`` is the token at
    position ``first + j``'s, as ``engine.sampling.top_logprobs`` gives them (its top alternatives plus itself)."""

    first: int
    entries: list[dict[int, float]]


class StepForward:
    """The step's forward over the scheduled chunks, drafts verified, and next tokens sampled."""

    def _compute(self, out: SchedulerOutput) -> dict[str, int | list[int]]:
        """The step's forward: every scheduled chunk packed into one row; next tokens of requests that reach the end
        (with drafts: the drafts the model confirmed, then the token after them)."""
        logits, rows, counts = self.forward_scored(out, self._live)
        if not rows:
            return {}
        lives = [self._live[out.scheduled[i].request.req_id] for i in rows]
        if self._forks:
            logits, lives, counts = self._with_forks(out, rows, logits, lives, counts)
        # penalties and min_tokens pick from changed logits; logprobs stay the model's own (vLLM's raw_logprobs)
        picks = penalize(logits, counts, [(live.params, live.request) for live in lives], self.eos_token_ids)
        if any(live.constraint is not None for live in lives):
            overruled: list[Constraint] = []
            picks = constrain(picks, logits, counts, [(live.constraint, live.request.draft_token_ids)
                                                      for live in lives], self.grammars(), overruled)
            # one line per SamplingParams of the call, not per sample, prompt or step: a set per step said one
            # again for each step a sample sharing it (another prompt, another of its n) was first overruled in
            said, first = self._overruled_said, {id(c) for c in overruled}
            for live in (lv for lv in lives if id(lv.constraint) in first) if first else ():  # (most steps: none)
                for name, value, why in overruled_settings(live.params):
                    if (id(live.params), name) not in said:
                        said.add((id(live.params), name))
                        self._event(SettingIgnored(field=f"generate.{name}", value=value, reason=why))
        if len(logits) == len(lives):
            tokens: dict[str, int | list[int]] = dict(self._sample(picks, lives, logits))
        else:
            tokens = self._verify(picks, lives, counts, logits)
        if self.lockstep is not None and self.stream_stop is not None:
            tokens, self._stream_left = self.lockstep.ranks.broadcast((tokens, self.stream_stop()))
        elif self.lockstep is not None:
            tokens = self.lockstep.ranks.broadcast(tokens)  # rank 0's tokens: the next step's inputs everywhere
        return tokens

    def _with_forks(self, out: SchedulerOutput, rows: list[int], logits: Any, lives: list[LiveSample],
                    counts: list[int]) -> tuple[Any, list[LiveSample], list[int]]:
        """The step's rows plus one per sample forked from a first sample whose prompt this step completes: a copy of
        that sample's logits row, so every sample draws its first token from the one prefill (each with its own
        generator, penalties and grammar, as if it had prefilled itself)."""
        extra: list[int] = []  # logits row each forked sample draws from
        starts = list(itertools.accumulate(counts, initial=0))
        for k, i in enumerate(rows):
            chunk = out.scheduled[i]
            req = chunk.request
            if req.req_id in self._forks and req.num_computed_tokens + chunk.num_tokens >= req.num_prompt_tokens:
                kids = self._forks.pop(req.req_id)
                extra += [starts[k]] * len(kids)
                lives = [*lives, *kids]
        if not extra:
            return logits, lives, counts
        return torch.cat([logits, logits[extra]]), lives, [*counts, *[1] * len(extra)]

    def _verify(self, logits: Any, lives: list[LiveSample], counts: list[int], raw: Any) -> dict[str, int | list[int]]:
        """Speculative decoding: each request's drafts up to the first the model's argmax disagrees with, then the
        argmax after them (greedy), or kept and drawn as ``engine.speculation.verify_sampled`` says (sampled);
        requests without drafts sample as usual. ``logits`` pick (penalized), ``raw`` give the logprobs."""
        starts = list(itertools.accumulate(counts, initial=0))
        plain = [i for i, c in enumerate(counts) if c == 1]
        tokens: dict[str, int | list[int]] = {}
        if plain:
            rows = [starts[i] for i in plain]
            tokens.update(self._sample(logits[rows], [lives[i] for i in plain], raw[rows]))
        for i, _, kept in verify_drafted(logits, counts, [live.request.draft_token_ids for live in lives],
                                         [(live.params, live.generator) for live in lives]):
            live = lives[i]
            tokens[live.request.req_id] = kept
            if live.params.logprobs is not None:
                rows = raw[starts[i]:starts[i] + len(kept)]
                live.logprobs.extend(top_logprobs(rows, live.params.logprobs, kept))
        return tokens

    def forward_scored(self, out: SchedulerOutput, live: Mapping[str, Any]) -> tuple[Any, list[int], list[int]]:
        """:meth:`forward` where some requests score their prompt: each scheduled one whose live entry (its
        ``params``, ``request`` and ``prompt_logprobs`` list, None when not asked) is still in prefill has this step's
        prompt entries written into its list. ``generate`` and the serving loop share it."""
        scoring = {}
        for chunk in out.scheduled:  # only a scheduled chunk can score: the step's requests, not every live one
            lv = live.get(chunk.request.req_id)
            if lv is not None and lv.prompt_logprobs is not None and chunk.request.in_prefill:
                scoring[chunk.request.req_id] = lv.params.prompt_logprobs
        logits, rows, counts, scores = self.forward(out, live, scoring or None)
        for req_id, got in scores.items():
            live[req_id].prompt_logprobs[got.first:got.first + len(got.entries)] = got.entries
        return logits, rows, counts

    def forward(self, out: SchedulerOutput, live: Collection[str],
                scoring: Mapping[str, int] | None = None) -> tuple[Any, list[int], list[int], dict[str, PromptScores]]:
        """One packed forward of the scheduled chunks: ``(logits, rows, counts, scores)``. ``rows``: the indices in
        ``out.scheduled`` of the chunks that reach their request's last known token; ``counts``: how many logits rows
        each has, in order (1, or 1 + the drafts it computed: the row before each draft verifies it, the last gives
        the token after them); ``logits`` None when none reaches it. ``live``: the request ids whose block-table
        rows must be kept (the serving loop shares this with ``generate``). ``scoring``: request id → top
        alternatives, for requests whose prompt tokens are scored (``prompt_logprobs``): ``scores`` holds, per such
        request with prompt tokens in this step, (first position, its tokens' logprob entries) — the logits row after
        each prompt token gives the next one's entry."""
        chunks, rows, step_tables, keep, count = [], [], [], [], []
        need: list[int] = []  # of the kept rows, how many (the last ones) the step reads logits of
        scored: list[tuple[int, Request, int, int]] = []  # (chunk, request, first position, rows) of prompt scores
        store = self._block_tables
        for i, scheduled in enumerate(out.scheduled):
            req = scheduled.request
            start = req.num_computed_tokens
            end = start + scheduled.num_tokens
            known = req.num_tokens
            ids = req.token_span(start, min(end, known))
            if end > known:  # this chunk computes drafts after the last known token
                ids += req.draft_token_ids[:end - known]
            count.append(1 + max(0, end - known))
            # the rows after prompt tokens 0..P-2 give tokens 1..P-1's logprobs (token 0 has none)
            n_scored = min(end, req.num_prompt_tokens - 1) - start if scoring and req.req_id in scoring else 0
            if n_scored > 0:
                scored.append((i, req, start + 1, n_scored))
            # a row after every token: its logits for a scored prompt, its hidden state (the output projection's
            # input) for a per-token pooled one, whose logits no one reads (PooledRows.capture projects only `need`)
            need.append(max(count[-1], end - start) if n_scored > 0 else count[-1])
            if n_scored > 0 or (self.pooled and self.pooled.every_token(req.req_id)):
                keep.append(max(count[-1], end - start))
            else:
                keep.append(count[-1])
            chunks.append(SeqChunk(ids, start, {}))
            tables = self.manager.block_tables(req)  # every group's list, in self.groups order
            step_tables.append(tables)
            rows.append(store.update_all(req.req_id, tables))  # only what changed since the last step is written
        if len(store) > 2 * len(live) + 8:  # rows of requests finished in earlier steps go back
            store.keep_only(live)
        if self.lockstep is not None:  # before the forward's collectives: a divergence fails here, never hangs
            self.lockstep.check_schedule(out, [dict(zip(self.groups, t, strict=True)) for t in step_tables])
        batch = PagedBatch.build(chunks, self.pools, store.tables(rows), flex=self.flex,
                                 decode_kernel=self.decode_kernel)
        if any(k > 1 for k in keep):
            batch.keep_last(keep)
        if self.v4 is not None:
            self.v4.keep_only(live)  # a request that left (finished, aborted, preempted) takes its side state along
            self._v4_restore(out)
            step_states(batch, self.v4, [s.request.req_id for s in out.scheduled])
        offsets = list(itertools.accumulate(keep, initial=0))  # of the output projection's input rows
        # of the logits rows: the kept rows of each chunk but its unread per-token pooled ones
        select = [r for i in range(len(keep)) for r in range(offsets[i + 1] - need[i], offsets[i + 1])] \
            if need != keep else None
        at = list(itertools.accumulate(need, initial=0))
        # pooling requests: the output projection's input at the prompt's last token (embed, classify), or at each of
        # its tokens as the prompt's chunks are computed (reward)
        pooling = [(s.request.req_id, s.request.num_computed_tokens, offsets[i], offsets[i + 1], ends)
                   for i, s in enumerate(out.scheduled)
                   if self.pooled.wanted(s.request.req_id)
                   and ((ends := s.request.num_computed_tokens + s.num_tokens >= s.request.num_prompt_tokens)
                        or self.pooled.every_token(s.request.req_id))] \
            if self.pooled else []
        with self.linear.active() if self.linear is not None else contextlib.nullcontext(), \
                self.pooled.capture(self.model, pooling, select):
            logits = run_forward(self.model, batch)
        if self._v4_key is not None:
            self._v4_file(out)
        if self.v4 is not None and self._forks:  # the samples forked from a prompt just computed continue its state
            for s in out.scheduled:
                req = s.request
                if req.req_id in self._forks and req.num_computed_tokens + s.num_tokens >= req.num_prompt_tokens:
                    for kid in self._forks[req.req_id]:
                        self.v4.copy(req.req_id, kid.request.req_id)
        scores: dict[str, PromptScores] = {}
        for i, req, first, n in scored:
            block = logits[at[i]:at[i] + n]
            scores[req.req_id] = PromptScores(first, top_logprobs(block, scoring[req.req_id],
                                                                  req.prompt_token_ids[first:first + n]))
        reach = [i for i, s in enumerate(out.scheduled)
                 if s.request.num_computed_tokens + s.num_tokens >= s.request.num_tokens]
        if not reach:
            return None, [], [], scores
        counts = [count[i] for i in reach]
        if len(reach) < len(out.scheduled) or need != count:  # the (last count) logits rows of the chunks that reach
            # their end
            picked = [r for i in reach for r in range(at[i + 1] - count[i], at[i + 1])]
            logits = logits[picked]
        return logits, reach, counts, scores

    def _sample(self, logits: Any, lives: list[LiveSample], raw: Any) -> dict[str, int]:
        """Next token of each live request from its logits row, drawn as its SamplingParams say; logprobs kept (of
        ``raw``, the model's own logits, where ``logits`` are penalized)."""
        groups: dict[int, list[int]] = {}  # rows sharing one SamplingParams are warped together
        for row, live in enumerate(lives):
            groups.setdefault(id(live.params), []).append(row)
        tokens = [0] * len(lives)
        for rows in groups.values():
            params = lives[rows[0]].params
            whole = len(rows) == len(lives)
            block = logits if whole else logits[rows]
            picked = sample_rows(block, params, [lives[r].generator for r in rows])
            for r, token in zip(rows, picked, strict=True):
                tokens[r] = token
            if params.logprobs is not None:
                own = raw if whole else raw[rows]
                for r, entry in zip(rows, top_logprobs(own, params.logprobs, picked), strict=True):
                    lives[r].logprobs.append(entry)
        return {live.request.req_id: token for live, token in zip(lives, tokens, strict=True)}
