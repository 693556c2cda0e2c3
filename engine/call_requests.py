"""A generate call's inputs made the driver's requests: prompts (text, ids, conversations) checked, cut and
tokenized, SamplingParams checked against the model, each sample a live request with its generator, stop hook,
salt and priority (:class:`CallRequests`, a part of :class:`~engine.executor.GenerationExecutor`)."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from cache_backends.request import Request
from engine.driver import at_length
from engine.live_sample import LiveSample
from engine.messages import check_messages
from engine.prompts import (
    PromptOptions,
    array_ints,
    check_text,
    is_conversation,
    normalize,
    templated,
)
from engine.sampling_params import (
    SamplingParams,
    check_keywords,
    check_salt,
    is_int,
)
from engine.stopping import SampleText
from engine.structured import GrammarBackend
from models.classifier import head_of, not_generative
from pipeline.errors import GenerationError, KvBuildError
from pipeline.limits import MAX_INT, int_text, plain_scalar, short, short_py

#: A pooled request as a refusal names it, by the call that makes it (``LLM.classify``, ``LLM.reward``; an
#: embedding otherwise: ``LLM.embed``, ``LLM.score``'s embeddings)
POOLED = {"embed": "an embedding", "classify": "a classification", "reward": "a reward (every token's scores)",
          "encode": "a pooled request"}


class CallRequests:
    """A call's prompts and SamplingParams, checked and made live requests for the driver."""

    def check_generates(self, call: str) -> None:
        """``GenerationError`` when the model cannot generate: a sequence-classification model (``models.classifier``)
        has a classifier head where a generative one has its language-model head."""
        head = head_of(self.model)
        if head is not None:
            raise GenerationError(not_generative(call, head))

    def beam_refusal(self) -> str | None:
        """Why this model cannot beam search (one line, for ``LLM.beam_search`` and the server), or None."""
        if self.v4 is None:
            return None
        return (f"beam_search: {self.name} is a DeepSeek V4 model, whose compressor side state kvload does not fork "
                "or reorder between beams; use generate")

    def _params(self, sampling_params: Any, keywords: dict[str, Any], count: int,
                pooled: bool = False) -> list[SamplingParams]:
        """One SamplingParams per prompt (``count`` of them; 0: as many as a given list holds), checked; ``pooled``:
        they stand for ``LLM.embed``'s list of ``pooling_params``, which a wrong length is said of."""
        if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, bytes)):
            keywords = check_keywords(keywords)
            if keywords:
                raise GenerationError("generate: pass sampling settings either as sampling_params or as keywords "
                                      f"({', '.join(sorted(keywords))}), not both")
            for i, p in enumerate(sampling_params):  # a None here took kvload's built-in defaults, silently, where a
                if not isinstance(p, SamplingParams):  # call given no SamplingParams takes the model's
                    raise GenerationError(f"generate: sampling_params[{i}]: expected a SamplingParams, got "
                                          f"{type(p).__name__}" + (" (sampling_params=None, not a list, takes the "
                                                                   "model's defaults)" if p is None else ""))
            params = self._fitted(list(sampling_params), True, count, pooled=pooled)
        else:  # no SamplingParams: the keywords over the model's sampling defaults (vLLM's default params)
            params = [SamplingParams.build(sampling_params, keywords, self.sampling_defaults,
                                           self.sampling_sources)] * max(count, 1)
        for p in {id(p): p for p in params}.values():  # a list changed in place since it was built (vLLM's habit)
            p.recheck()
        params = self._with_reasoning_parser(params)
        for p in params:
            if p.stop and self.tokenizer is None:
                raise GenerationError(f"generate: stop: stop strings are matched on the text, but {self.name} has no "
                                      "tokenizer; use stop_token_ids")
            if p.logprobs is not None and p.logprobs > self.vocab_size:
                raise GenerationError(f"generate: logprobs: expected at most the vocabulary size "
                                      f"({self.vocab_size}), got {p.logprobs}")
            self._check_vocab("stop_token_ids", p.stop_token_ids)
            self._check_vocab("logit_bias", p.logit_bias)
            self._check_vocab("allowed_token_ids", p.allowed_token_ids or ())
        for p in {id(p): p for p in params}.values():
            if p.bad_words:
                object.__setattr__(p, "_bad_words_token_ids", self._bad_words_token_ids(p.bad_words))
            self._check_something_allowed(p)
            if p.structured_outputs is not None:  # compiled now: a bad schema is refused before anything runs
                self.grammars().compile(p.structured_outputs)
        return params

    def _with_reasoning_parser(self, params: list[SamplingParams]) -> list[SamplingParams]:
        """``params`` with the LLM's reasoning parser on each structured outputs that names none (vLLM's engine-wide
        ``structured_outputs_config.reasoning_parser``): copies, so the caller's SamplingParams stay as given."""
        if self.reasoning_parser is None:
            return params
        done: dict[int, SamplingParams] = {}
        for p in params:
            wanted = p.structured_outputs
            if id(p) in done or wanted is None or wanted.reasoning_parser is not None:
                continue
            gated = copy.copy(p)
            gate = attrs.evolve(wanted, reasoning_parser=self.reasoning_parser)
            object.__setattr__(gated, "structured_outputs", gate)
            done[id(p)] = gated
        return [done.get(id(p), p) for p in params]

    @staticmethod
    def _fitted(params: list[SamplingParams], per_prompt: bool, count: int,
                pooled: bool = False) -> list[SamplingParams]:
        """:meth:`_params`' list for ``count`` prompts (0: any): a list given is as long, one given is repeated."""
        if not per_prompt:
            return params[:1] * max(count, 1)
        if count and len(params) != count:
            name, kind = ("pooling_params", "PoolingParams") if pooled else ("sampling_params", "SamplingParams")
            raise GenerationError(f"generate: {name}: expected one {kind} or a list of {count} (one per prompt), "
                                  f"got a list of {len(params)}")
        return params

    def grammars(self) -> GrammarBackend:
        """xgrammar over this model's tokenizer (built once; the server's handler threads share it);
        ``GenerationError`` without xgrammar or a tokenizer."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids, self.name)
            return self._grammars

    def _check_vocab(self, what: str, ids: Iterable[int]) -> None:
        """``GenerationError`` naming ``what`` and the first of ``ids`` outside the vocabulary."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise GenerationError(f"generate: {what}: token id {int_text(bad)} is outside the vocabulary "
                                  f"(0..{self.vocab_size - 1})")

    def _check_something_allowed(self, p: SamplingParams) -> None:
        """``GenerationError`` when no token is left to draw: every allowed id (``allowed_token_ids``, else the whole
        vocabulary) is a one-token bad word, or a stop token held back by ``min_tokens``. Every logit would be -inf:
        greedy would return token 0, a banned token, and sampling fail inside torch (vLLM has the same hole)."""
        banned = {w[0] for w in p._bad_words_token_ids if len(w) == 1}
        held = (set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))) if p.min_tokens else set()
        if p.allowed_token_ids is None:
            if len(banned) + len(held) < self.vocab_size:  # the usual case, without a set of the whole vocabulary
                return
            pool: set[int] = set(range(self.vocab_size))
        else:
            pool = set(p.allowed_token_ids)
        if pool - banned:
            if pool - banned - held:
                return
            by = "min_tokens (it holds back the stop and end-of-sequence tokens until then)"
        else:
            by = "bad_words"
        if p.allowed_token_ids is not None:
            raise GenerationError(f"generate: allowed_token_ids: every allowed token is banned by {by}, so no token "
                                  "could be generated; allow another token")
        if by == "bad_words":
            raise GenerationError(f"generate: bad_words: they ban every token of the vocabulary ({self.vocab_size:,} "
                                  "ids), so no token could be generated; ban fewer words")
        also, fewer = (" or a one-token bad word", "ban fewer words") if banned else ("", "give fewer stop_token_ids")
        raise GenerationError(f"generate: min_tokens: every token of the vocabulary ({self.vocab_size:,} ids) is a "
                              f"stop or end-of-sequence token it holds back{also}, so no first token could be "
                              f"generated; lower min_tokens or {fewer}")

    def _bad_words_token_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """``bad_words`` as token id sequences, vLLM's way: each word as given (left-stripped), and after a space
        where that gives a different first token in as many tokens (a word inside the text, not at its start)."""
        if self.tokenizer is None:
            raise GenerationError(f"generate: bad_words: banned words are tokenized, but {self.name} has no tokenizer "
                                  "(presets take token ids); use allowed_token_ids or logit_bias instead")
        out: list[tuple[int, ...]] = []
        for i, word in enumerate(words):
            bare = tuple(int(t) for t in self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(int(t) for t in self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not bare:
                raise GenerationError(f"generate: bad_words[{i}]: {short(word)} gives no tokens")
            for ids in (bare, spaced) if spaced and spaced[0] != bare[0] and len(spaced) == len(bare) else (bare,):
                bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
                if bad is not None:
                    raise GenerationError(f"generate: bad_words[{i}]: {short(word)} tokenizes to id {int_text(bad)}, "
                                          f"outside the vocabulary (0..{self.vocab_size - 1})")
                out.append(ids)
        return tuple(out)

    def _salts(self, salt: str | None, options: list[PromptOptions]) -> list[str | None]:
        """Each prompt's prefix-reuse salt: its dict's ``cache_salt`` (vLLM's), else the call's ``salt``; the two given
        and different is refused, as the server refuses ``salt`` and ``cache_salt`` that differ."""
        out = []
        for i, said in enumerate(options):
            if said.cache_salt is None:
                out.append(salt)
                continue
            if salt is not None and said.cache_salt != salt:
                raise GenerationError(f"generate: prompt {i}: its cache_salt and the call's salt differ; give one (a "
                                      "prompt's cache_salt scopes that prompt, salt= every prompt of the call)")
            check_salt(said.cache_salt, f"prompt {i}: cache_salt")
            out.append(said.cache_salt)
        return out

    def _lives(self, call: int, items: list[tuple[str | None, list[int]]], params: list[SamplingParams],
               salts: list[str | None], arrivals: list[int], ranks: list[int] | None = None, *,
               pool: bool = False, every_token: bool = False) -> list[LiveSample]:
        """Every sample of every prompt as a request, with its generator (seeded as SamplingParams says); ``pool``:
        each an embedding's prefill (``Request.prefill_only``), its one token dropped; ``every_token``: its prompt
        computed whole (no cached prefix read), every token's row pooled."""
        lives = []
        # unseeded samples: a fresh base per call, or the next of the LLM's seeded sequence (vLLM's engine seed)
        random_base = (self.call_seeds or random.SystemRandom()).getrandbits(62)
        if self.lockstep is not None:
            random_base = self.lockstep.ranks.broadcast(random_base)  # one fresh seed, rank 0's, on every rank
        unseeded = 0  # unseeded samples drawn so far: each takes the next offset from random_base
        for i, ((text, ids), p) in enumerate(zip(items, params, strict=True)):
            room = self.max_seq_len - len(ids)  # a sequence never grows past max_seq_len
            base = p.seed if p.seed is not None else random_base
            parent = None
            for j in range(p.n):
                req_id = f"{call}.{i}" if p.n == 1 else f"{call}.{i}.{j}"
                # a scored prompt is prefilled whole by its first sample (a cached prefix computes no logits), whose
                # blocks are cached as any request's: the later samples, and later requests, reuse them
                cap = room if p.max_tokens is None else min(p.max_tokens, room)  # None: vLLM's "up to the context"
                request = Request(req_id, ids, 1 if pool else cap, salt=salts[i], prefill_only=pool,
                                  skip_prefix_read=(p.prompt_logprobs is not None and j == 0) or every_token,
                                  priority=ranks[i] if ranks is not None else 0)
                if j == 0:
                    self._check_fits(i, request, p.max_tokens)
                gen = None
                if not p.greedy:  # vLLM's rule: a seeded prompt's sample j is seed + j, whatever else the call holds
                    # (a prompt's samples do not change with its place in the batch); unseeded samples each draw on
                    # from the call's base, so no two share a stream
                    offset = j if p.seed is not None else unseeded
                    unseeded += p.seed is None
                    gen = torch.Generator(device=self.pools.device).manual_seed(base + offset)
                live = LiveSample(i, request, text, arrivals[i], gen, params=p, sample=j, parent=parent)
                if self.tokenizer is not None and p.detokenize:  # detokenize=False: token ids only, no decoding
                    live.text = SampleText(self.tokenizer, p.stop, include_stop=p.include_stop_str_in_output,
                                           skip_special=p.skip_special_tokens, spaced=p.spaces_between_special_tokens)
                if p.logprobs is not None:
                    live.logprobs = []
                if p.prompt_logprobs is not None and j == 0:
                    live.prompt_logprobs = [None] * len(ids)
                if p.structured_outputs is not None:  # each sample its own grammar state
                    live.constraint = self.grammars().constraint(p.structured_outputs,
                                                                 skip_special=p.skip_special_tokens)
                lives.append(live)
                parent = parent or live
        return lives

    def _stops(self, request: Request, token: int) -> bool:
        """The driver's stop hook: EOS (unless ignored), a stop token id, or a stop string in the text."""
        live = self._live[request.req_id]
        p = live.params
        if live.constraint is not None and live.constraint.advance(token):
            return True  # the grammar is complete (its end-of-sequence token taken, ignore_eos or not)
        if token in self.eos_token_ids and not p.ignore_eos:
            return True
        if token in p.stop_token_ids:
            live.stop_reason = token
            return True
        if p.stop:
            # the sample's last token (max_tokens or max_seq_len ends it next): decode it as final, so a stop string
            # completed by a token that also starts an unfinished character still ends it as "stop", not as a text
            # cut at the stop string under "length"
            hit = live.text.update(request.output_token_ids,
                                   final=at_length(request, self.manager.options.max_seq_len),
                                   search=len(request.output_token_ids) > p.min_tokens)
            if hit is not None:
                live.stop_reason = hit
                return True
        return False

    def _reuse_off(self) -> str | None:
        """Why the manager shares no prefix between requests, or None when prefix reuse is on."""
        off = getattr(self.manager, "reuse_off_reason", None)  # V2 says why (a layout that cannot be keyed, ...)
        return off or (None if self.manager.options.enable_block_reuse else "enable_block_reuse is false")

    def salt_ignored(self) -> str | None:
        """Why a reuse salt does nothing here (the manager shares no prefix between requests), or None when it
        scopes what is shared; ``generate`` and ``kvload serve`` report it as ``setting_ignored``."""
        off = self._reuse_off()
        return None if off is None else f"prefix reuse is off: nothing is shared to scope ({off})"

    def _prompts(self, prompts: Any, chat: bool | Mapping[str, Any], checked: bool = True,
                 options: list[PromptOptions] | None = None) -> list[tuple[str | None, list[int]]]:
        """Each prompt as (text or None, token ids), validated (``engine.prompts.normalize`` says what is taken).

        ``chat``: true, or the chat template's options (``engine.prompts.template_options``, from ``LLM.chat``);
        a chat prompt's text is the templated text. ``checked=False`` leaves the ids' checks (empty, vocabulary,
        length) to :meth:`_check_items`, for a caller that cuts the prompts first. ``options``: a list to fill with
        what each vLLM prompt dict says beside its prompt (its salt; a TokensPrompt's text is the item's text); None:
        a dict's ``cache_salt`` is refused (``engine.prompts.normalize``)."""
        template = dict(chat) if isinstance(chat, Mapping) else {}
        items: list[tuple[str | None, list[int]]] = []
        said: list[PromptOptions] = [] if options is None else options
        for i, prompt in enumerate(normalize(prompts, said, take_salt=options is not None)):
            if isinstance(prompt, str):
                if chat:
                    check_text(f"prompt {i}", prompt)
                    items.append(self._converse(i, [{"role": "user", "content": prompt}], template))
                else:
                    items.append((prompt, self._tokenize(i, prompt)))
                continue
            if is_conversation(prompt):
                if not chat:
                    raise GenerationError(f"generate: prompt {i}: a conversation (a list of messages) needs "
                                          "chat=True (or LLM.chat)")
                items.append(self._converse(i, prompt, template))
                continue
            if chat:
                raise GenerationError(f"generate: prompt {i}: chat=True needs text prompts, got token ids")
            items.append((said[i].text, prompt))  # a TokensPrompt's own text, if it gave one (vLLM's)
        return self._check_items(items) if checked else items

    def _check_items(self, items: list[tuple[str | None, list[int]]], *, pool: bool = False,
                     what: str | None = None) -> list[tuple[str | None, list[int]]]:
        """``items`` unchanged once every prompt's ids are non-empty, in the vocabulary and leave room to generate
        (``pool``, an embedding's: fit in ``max_seq_len``, vLLM's ``max_model_len``, nothing being generated).
        ``what``: the pooled request as the refusal names it; None: as the call running names it (:data:`POOLED`)."""
        what = what or POOLED.get(self._caller, POOLED["embed"])
        for i, (_, ids) in enumerate(items):
            if not ids:
                raise GenerationError(f"generate: prompt {i}: empty (no tokens)")
            self._check_vocab(f"prompt {i}", ids)
            if pool and len(ids) > self.max_seq_len:
                raise GenerationError(f"generate: prompt {i}: {len(ids)} tokens; {what} takes at most "
                                      f"max_seq_len={self.max_seq_len} (vLLM's max_model_len); shorten it, keep its "
                                      "last tokens (truncate_prompt_tokens) or raise max_seq_len")
            if not pool and len(ids) >= self.max_seq_len:
                raise GenerationError(f"generate: prompt {i}: {len(ids)} tokens leave no room to generate under "
                                      f"max_seq_len={self.max_seq_len}; shorten it or raise max_seq_len")
        return items

    def _truncated(self, items: list[tuple[str | None, list[int]]], params: list[SamplingParams],
                   notes: list[tuple[str, Any, str]] | None = None, *,
                   pool: bool = False) -> list[tuple[str | None, list[int]]]:
        """Each prompt's ids cut to the last ``truncate_prompt_tokens`` of its SamplingParams (vLLM's left truncation,
        a BOS included; the text stays as given, as vLLM's ``RequestOutput.prompt`` does); a k past ``max_seq_len``
        (vLLM's ``max_model_len``) is refused, as vLLM's is. A cut to ``max_seq_len`` tokens keeps one fewer, leaving
        room for the one token vLLM generates there (a sequence never grows past ``max_seq_len`` here), which is what
        -1 asks for; ``notes`` gets a (field, value, reason) for each prompt a k of ``max_seq_len`` cut so. ``pool``
        (an embedding's prefill, which generates nothing): -1 and k = ``max_seq_len`` keep ``max_seq_len`` tokens."""
        out, short = [], []
        for i, ((text, ids), p) in enumerate(zip(items, params, strict=True)):
            keep = p.truncate_prompt_tokens
            if keep is None:
                out.append((text, ids))
                continue
            if keep == -1:  # vLLM's -1, "cap at the model's max length": here one token short of it (below)
                keep = self.max_seq_len if pool else self.max_seq_len - 1
            elif keep > self.max_seq_len:  # vLLM's _validate_truncation_size refuses it too
                raise GenerationError(f"generate: truncate_prompt_tokens: {int_text(keep)} is greater than "
                                      f"max_seq_len (vLLM's max_model_len) {self.max_seq_len}; use at most "
                                      f"{self.max_seq_len} (or -1 for that many)")
            if not pool and len(ids) >= self.max_seq_len and keep >= self.max_seq_len:
                keep = self.max_seq_len - 1
                short.append(i)
            out.append((text, ids[-keep:] if len(ids) > keep else ids))
        if short and notes is not None:  # one line for the call, however many prompts
            which = f"prompt {short[0]}" if len(short) == 1 else f"{len(short)} prompts (the first: {short[0]})"
            notes.append(("truncate_prompt_tokens", self.max_seq_len,
                          f"{which} kept the last {self.max_seq_len - 1} tokens, not {self.max_seq_len}: a sequence "
                          f"never grows past max_seq_len={self.max_seq_len}, so one token is left to generate "
                          "(vLLM keeps max_model_len tokens and generates one past it)"))
        return out

    def _tokenize(self, i: int, text: str) -> list[int]:
        check_text(f"prompt {i}", text)  # a lone surrogate would reach the tokenizer as a TypeError
        return [int(t) for t in self._text_tokenizer(i)(text)["input_ids"]]

    def _text_tokenizer(self, i: int) -> Any:
        """The tokenizer for text prompt ``i``; ``GenerationError`` when the model has none."""
        if self.tokenizer is None:
            raise GenerationError(f"generate: prompt {i} is text, but {self.name} has no tokenizer (presets have "
                                  "random weights and none); pass token ids instead")
        return self.tokenizer

    def _converse(self, i: int, messages: Any, template: Mapping[str, Any]) -> tuple[str, list[int]]:
        """A conversation through the chat template (the tokenizer's, or ``template["chat_template"]``): (the
        templated text, its token ids)."""
        return templated(self.tokenizer, self.name, f"prompt {i}", check_messages(f"prompt {i}", messages), template)

    @staticmethod
    def _arrivals(arrival_steps: Sequence[int] | None, n: int) -> list[int]:
        if arrival_steps is None:
            return [0] * n
        steps = list(arrival_steps)
        if len(steps) != n or not all(is_int(s) and s >= 0 for s in steps):
            raise GenerationError(f"generate: arrival_steps: expected {n} integers >= 0 (one per prompt), "
                                  f"got {short_py(arrival_steps)}")
        return steps

    def priority_refusal(self, value: Any) -> str | None:
        """Why a user's (vLLM-signed) ``priority`` is refused, or None: an integer within int64, and under the "fcfs"
        policy only 0 (vLLM's rule: "priority scheduling is not enabled")."""
        if not is_int(value) or abs(value) > MAX_INT:
            return f"expected an integer (at most 2**63 - 1 in size), got {short(value)}"
        if value != 0 and not getattr(self.scheduler, "by_priority", False):
            return (f"got priority {value} but priority scheduling is not enabled (scheduling_policy is \"fcfs\"); "
                    "load with scheduling_policy=\"priority\" (--scheduling_policy priority) or send 0")
        return None

    def _priorities(self, priority: Sequence[int] | None, n: int) -> list[int] | None:
        """vLLM's ``priority`` list (lower first) as kvload's ranks (higher first: each value negated); None: all 0."""
        if priority is None:
            return None
        priority = array_ints(priority)  # a 1-D integer array, as a prompt's ids may be (it was refused whole)
        if isinstance(priority, (str, bytes)) or not isinstance(priority, Sequence) or len(priority) != n:
            raise GenerationError(f"generate: priority: expected a list of {n} integers (one per prompt), "
                                  f"got {short(priority)}")
        priority = [plain_scalar(v) for v in priority]  # a 0-d torch tensor item as an int, as numpy's int64 is
        for i, value in enumerate(priority):
            why = self.priority_refusal(value)
            if why is not None:
                raise GenerationError(f"generate: priority[{i}]: {why}")
        return [-int(v) for v in priority]

    def _check_fits(self, index: int, request: Request, asked: int | None = None) -> None:
        """``KvBuildError`` when a request could not complete even alone in empty pools (it would never run).

        ``asked``: the max_new_tokens the caller gave, when max_seq_len cut it to the request's (the
        message quotes what was sent, then the cut).
        """
        short = self.manager.layout.sequence_shortfall(request.max_total_tokens, self.pools.num_blocks)
        if short is not None:  # a shared arena: every group's blocks together
            where, need, have = short
            length = "nothing generated" if request.prefill_only else f"max_new_tokens {request.max_new_tokens}"
            if asked is not None and asked > request.max_new_tokens:
                length = (f"max_new_tokens {asked} (cut to {request.max_new_tokens} by "
                          f"max_seq_len={self.max_seq_len})")
            prompt = request.num_prompt_tokens
            fits = self.manager.layout.longest_sequence(self.pools.num_blocks, request.max_total_tokens - 1)
            if fits <= prompt:  # not one new token fits after this prompt: max_new_tokens cannot help
                advice = f"or shorten the prompt (the pools hold one sequence of {fits:,} tokens)"
            else:
                advice = f"or lower max_new_tokens to at most {fits - prompt:,}"
            shortfall = f"{prompt} prompt tokens + {length} need {need} blocks of {where} but the KV pools hold {have}"
            exc = KvBuildError(f"generate: prompt {index}: {shortfall}; raise kv_cache_config.max_tokens "
                               f"(--max_tokens) {advice}")
            # the parts, for a face that words its own advice (the server: a client cannot raise --max_tokens)
            exc.shortfall, exc.longest_sequence = shortfall, fits
            raise exc
