"""vLLM's pooling calls on a decoder: ``embed``, ``score`` (cosine or a cross-encoder head), ``classify``,
``reward`` and ``encode``, each a prefill whose last hidden state is pooled (:class:`PoolingCalls`, a part of
:class:`~kvload.llm.LLM`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from engine.outputs import RequestOutput
from engine.pooling import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
    ScorePairsError,
    ScoringOutput,
    ScoringRequestOutput,
    cosine,
    pooled,
    pooled_vector,
    score_pairs,
)
from engine.sampling_params import SamplingParams
from kvload.llm_calls import call_cut, checked_keywords, errors_titled, followed_by_ranks, no_lora, one_or_many
from models.classifier import ClassifierHead, head_logits, head_of, no_head, not_one_score, pair_ids, pair_length
from pipeline.errors import GenerationError
from pipeline.limits import short


class PoolingCalls:
    """``LLM``'s pooling calls: prompts prefilled, their hidden states pooled, no token generated."""

    @checked_keywords
    @followed_by_ranks
    def embed(self, prompts: Any, *, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: Any = None, lora_request: Any = None,
              tokenization_kwargs: Mapping[str, Any] | None = None,
              salt: str | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed`` for a decoder model: one :class:`EmbeddingRequestOutput` per prompt, in order, its
        ``outputs.embedding`` the final norm's output at the prompt's last token, L2-normalized (vLLM's LAST pooling
        and its embed task's default; ``PoolingParams(use_activation=False)``: as computed).

        ``prompts`` as :meth:`generate` takes them (text, token ids, vLLM's prompt dicts). ``pooling_params``: one
        :class:`PoolingParams` for every prompt or a list of one per prompt. ``truncate_prompt_tokens``: keep each
        prompt's last N tokens (-1: the model's length), as ``PoolingParams.truncate_prompt_tokens`` (vLLM's
        ``tokenization_kwargs={"truncate_prompt_tokens": N}`` too, where vLLM now takes it). The prompt is
        prefilled as a generate call's is (its prefix cached and reused); the one token its logits give is dropped as
        it is drawn, its KV never written, so a prompt may have up to ``max_seq_len`` tokens (vLLM's
        ``max_model_len``; -1 keeps that many).
        """
        truncate_prompt_tokens = call_cut("embed", truncate_prompt_tokens, tokenization_kwargs)
        return self._embed("embed", prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request, salt)

    @checked_keywords
    @followed_by_ranks
    def score(self, data_1: Any, data_2: Any, /, *, truncate_prompt_tokens: int | None = None, use_tqdm: Any = None,
              pooling_params: PoolingParams | None = None, lora_request: Any = None,
              tokenization_kwargs: Mapping[str, Any] | None = None,
              salt: str | None = None) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: one :class:`ScoringRequestOutput` per pair, in order (``outputs.score``). ``data_1``
        one prompt scored against each of ``data_2`` (one or a list), or a list as long as ``data_2``, scored pairwise.
        An embedding model scores a pair by the cosine similarity of its two :meth:`embed` vectors (prompts as
        :meth:`generate` takes them, every prompt embedded in one batch); a one-label classifier (a cross-encoder) by
        its head's logit through sigmoid over the pair as one sequence (texts, joined by the tokenizer as vLLM joins
        them; ``PoolingParams(use_activation=False)``: the logit), every pair in one batch."""
        truncate_prompt_tokens = call_cut("score", truncate_prompt_tokens, tokenization_kwargs)
        firsts, seconds = one_or_many(data_1), one_or_many(data_2)
        try:
            pairs = score_pairs(len(firsts), len(seconds))
        except ScorePairsError as e:
            raise GenerationError(f"score: {e}") from None
        head = head_of(self.result.hf_model)
        if head is not None:
            return self._cross_score(head, firsts, seconds, pairs, pooling_params, truncate_prompt_tokens, use_tqdm,
                                     lora_request, salt)
        outs = self._embed("score", [*firsts, *seconds], pooling_params, truncate_prompt_tokens, use_tqdm,
                           lora_request, salt)
        vectors = [torch.tensor(o.outputs.embedding) for o in outs]
        scores = []
        for i, j in pairs:
            a, b = outs[i], outs[j]
            scores.append(ScoringRequestOutput(request_id=f"{a.request_id}_{b.request_id}",
                                               outputs=ScoringOutput(cosine(vectors[i], vectors[j])),
                                               prompt_token_ids=[*a.prompt_token_ids, *b.prompt_token_ids]))
        return scores

    def _cross_score(self, head: ClassifierHead, firsts: list[Any], seconds: list[Any], pairs: list[tuple[int, int]],
                     pooling_params: Any, truncate_prompt_tokens: int | None, use_tqdm: Any, lora_request: Any,
                     salt: str | None) -> list[ScoringRequestOutput]:
        """:meth:`score` of a cross-encoder: each pair tokenized as one sequence, scored by the head."""
        why = not_one_score("score", head)
        if why is not None:
            raise GenerationError(why)
        if isinstance(pooling_params, Sequence):
            raise GenerationError("score: pooling_params: expected one kvload.PoolingParams for every pair, got a "
                                  "list")
        texts = []
        for k, prompt in enumerate([*firsts, *seconds]):
            side, i = ("data_1", k) if k < len(firsts) else ("data_2", k - len(firsts))
            text = prompt.get("prompt") if isinstance(prompt, Mapping) and set(prompt) == {"prompt"} else prompt
            if not isinstance(text, str):
                raise GenerationError(f"score: {side}[{i}]: a cross-encoder scores texts (its tokenizer joins each "
                                      f"pair as one sequence), got {short(prompt)}")
            texts.append(text)
        if self.tokenizer is None:
            raise GenerationError(f"score: {self.args.model} has no tokenizer to join each pair as one sequence")
        config = self.result.hf_model.config
        keep = truncate_prompt_tokens
        if keep is None and isinstance(pooling_params, PoolingParams):
            keep = pooling_params.truncate_prompt_tokens
        PoolingParams(truncate_prompt_tokens=keep)  # its check, its message, before the tokenizer takes it
        # the pair tokenized to that length cuts the longer text (vLLM's truncation=True): the query is kept; _pool's
        # cut to the last N tokens then has nothing left to cut
        length = pair_length(keep, self.args.max_seq_len)
        ids = [pair_ids(self.tokenizer, config, texts[i], texts[j], length) for i, j in pairs]
        outputs, rows, pooling = self._pool("score", ids, pooling_params, truncate_prompt_tokens, use_tqdm,
                                            lora_request, salt)
        logits = head_logits(self.result.hf_model, rows)
        return [ScoringRequestOutput(request_id=out.request_id, prompt_token_ids=list(out.prompt_token_ids),
                                     outputs=ScoringOutput(head.scores(row[None], p.use_activation is not False)[0]))
                for out, row, p in zip(outputs, logits, pooling, strict=True)]

    def _embed(self, call: str, prompts: Any, pooling_params: Any, truncate_prompt_tokens: int | None, use_tqdm: Any,
               lora_request: Any, salt: str | None) -> list[EmbeddingRequestOutput]:
        """:meth:`embed` as ``call`` (``embed`` or ``score``), which titles its errors."""
        outputs, rows, pooling = self._pool(call, prompts, pooling_params, truncate_prompt_tokens, use_tqdm,
                                            lora_request, salt)
        return [EmbeddingRequestOutput(
            request_id=out.request_id, prompt=out.prompt, prompt_token_ids=list(out.prompt_token_ids),
            num_cached_tokens=out.num_cached_tokens, outputs=EmbeddingOutput(pooled_vector(row, p.use_activation)))
            for out, row, p in zip(outputs, rows, pooling, strict=True)]

    def _pool(self, call: str, prompts: Any, pooling_params: Any, truncate_prompt_tokens: int | None, use_tqdm: Any,
              lora_request: Any, salt: str | None, every_token: bool = False) -> tuple[
                  list[RequestOutput], list[torch.Tensor], list[PoolingParams]]:
        """Every prompt prefilled in one batch, as ``call`` (which titles its errors): each prompt's output, its last
        hidden row (the final norm's output at its last token; ``every_token``: a ``(tokens, hidden)`` tensor of
        every prompt token's, the prompt computed whole) and its PoolingParams, in order."""
        no_lora(call, lora_request)
        with errors_titled(call):
            # a text is not a list of PoolingParams (its letters were taken as one each)
            per_prompt = isinstance(pooling_params, Sequence) and not isinstance(pooling_params, (str, bytes))
            given = list(pooling_params) if per_prompt else [pooling_params]  # type: ignore[arg-type]
            for i, p in enumerate(given):
                if p is not None and not isinstance(p, PoolingParams):
                    where = f"pooling_params[{i}]" if per_prompt else "pooling_params"
                    raise GenerationError(f"{call}: {where}: expected a kvload.PoolingParams, got "
                                          f"{type(p).__name__}")
            pooling = [p if p is not None else PoolingParams() for p in given]
            if truncate_prompt_tokens is not None:
                PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)  # its check, its message
                clash = next((p for p in pooling if p.truncate_prompt_tokens not in (None, truncate_prompt_tokens)),
                             None)
                if clash is not None:
                    raise GenerationError(f"{call}: truncate_prompt_tokens {truncate_prompt_tokens} and "
                                          f"pooling_params' truncate_prompt_tokens {clash.truncate_prompt_tokens} "
                                          "differ; give one")
                pooling = [attrs.evolve(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in pooling]
            # the prefill's forward gives the hidden state; its one greedy token is computed and dropped
            sampling = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                       truncate_prompt_tokens=p.truncate_prompt_tokens) for p in pooling]
        with self._exclusive(call):
            self._no_progress_bar(use_tqdm, call)
            with self._running(call) as executor:
                outputs = executor.run(prompts, sampling if per_prompt else sampling[0], salt=salt, pool=True,
                                       every_token=every_token)
                rows = [executor.pooled.take(o.request_id) for o in outputs]
        for i, row in enumerate(rows):
            if row is None:  # every prompt's last token is computed by some step: a missing row is a bug, said so
                raise GenerationError(f"{call}: prompt {i}: its last hidden state was not captured")
        return outputs, rows, [pooling[i if per_prompt else 0] for i in range(len(outputs))]  # type: ignore[misc]

    def _head(self, call: str) -> ClassifierHead:
        """The loaded classifier's head; ``GenerationError`` for a generative model, which has none."""
        head = head_of(self.result.hf_model)
        if head is None:
            raise GenerationError(no_head(call, str(self.args.model), self.result.model.architecture))
        return head

    @checked_keywords
    @followed_by_ranks
    def classify(self, prompts: Any, *, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 truncate_prompt_tokens: int | None = None, use_tqdm: Any = None, lora_request: Any = None,
                 tokenization_kwargs: Mapping[str, Any] | None = None,
                 salt: str | None = None) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify`` for a ``*ForSequenceClassification`` checkpoint: one
        :class:`ClassificationRequestOutput` per prompt, in order, its ``outputs.probs`` the classifier head's logits at
        the prompt's last token through softmax (sigmoid for one label; ``PoolingParams(use_activation=False)``: the
        logits as computed). Arguments as :meth:`embed`'s; a generative model has no head (``GenerationError``)."""
        truncate_prompt_tokens = call_cut("classify", truncate_prompt_tokens, tokenization_kwargs)
        head = self._head("classify")
        outputs, rows, pooling = self._pool("classify", prompts, pooling_params, truncate_prompt_tokens, use_tqdm,
                                            lora_request, salt)
        return [ClassificationRequestOutput(
            request_id=out.request_id, prompt=out.prompt, prompt_token_ids=list(out.prompt_token_ids),
            num_cached_tokens=out.num_cached_tokens,
            outputs=ClassificationOutput(head.probs(logits, p.use_activation is not False).tolist()))
            for out, logits, p in zip(outputs, head_logits(self.result.hf_model, rows), pooling, strict=True)]

    @checked_keywords
    @followed_by_ranks
    def reward(self, prompts: Any, *, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               truncate_prompt_tokens: int | None = None, use_tqdm: Any = None, lora_request: Any = None,
               tokenization_kwargs: Mapping[str, Any] | None = None,
               salt: str | None = None) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.reward`` (its ``token_classify`` pooling) for a classifier checkpoint: one
        :class:`PoolingRequestOutput` per prompt, in order, its ``outputs.data`` a ``(prompt tokens, labels)`` float32
        tensor: the classifier head applied to every prompt token's final norm output, each row activated as
        :meth:`classify` activates its one (its last row is that call's ``probs``). Each prompt is computed whole (a
        cached prefix gives no rows), so ``num_cached_tokens`` is 0. Arguments as :meth:`classify`'s; a generative
        model has no head to score tokens with (``GenerationError``)."""
        truncate_prompt_tokens = call_cut("reward", truncate_prompt_tokens, tokenization_kwargs)
        head = self._head("reward")
        outputs, rows, pooling = self._pool("reward", prompts, pooling_params, truncate_prompt_tokens, use_tqdm,
                                            lora_request, salt, every_token=True)
        model = self.result.hf_model
        return [PoolingRequestOutput(
            request_id=out.request_id, prompt=out.prompt, prompt_token_ids=list(out.prompt_token_ids),
            num_cached_tokens=out.num_cached_tokens,
            outputs=PoolingOutput(head.probs(head_logits(model, tokens), p.use_activation is not False)))
            for out, tokens, p in zip(outputs, rows, pooling, strict=True)]

    @checked_keywords
    @followed_by_ranks
    def encode(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: Any = None, lora_request: Any = None,
               pooling_task: str | None = None, tokenization_kwargs: Mapping[str, Any] | None = None,
               salt: str | None = None) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.encode``: one :class:`PoolingRequestOutput` per prompt, in order, its ``outputs.data`` a
        float32 tensor pooled by ``pooling_task``, one of the tasks the model serves (vLLM's adapters give them):

        - a classifier (``*ForSequenceClassification``, ``*ForTokenClassification``, a causal LM under
          ``convert="classify"``): ``token_classify``, a ``(prompt tokens, labels)`` tensor of every token's class
          probabilities (:meth:`reward`'s rows; a token classifier's per-token labels), and ``classify``, the last
          token's (:meth:`classify`'s ``probs``); ``PoolingParams(use_activation=False)``: the logits;
        - a generative model: ``token_embed``, a ``(prompt tokens, hidden)`` tensor of every token's final norm
          output, and ``embed``, the last token's (:meth:`embed`'s vector), each row L2-normalized unless
          ``PoolingParams(use_activation=False)``.

        ``pooling_task`` is required, as vLLM requires it; a task the model does not serve is a ``GenerationError``
        naming those it does. A per-token task's prompt is computed whole (``num_cached_tokens`` 0). Other arguments
        as :meth:`embed`'s."""
        truncate_prompt_tokens = call_cut("encode", truncate_prompt_tokens, tokenization_kwargs)
        model = self.result.hf_model
        head = head_of(model)
        tasks = ("token_classify", "classify") if head is not None else ("token_embed", "embed")
        if pooling_task not in tasks:
            kind = (f"{head.architecture}, a classifier" if head is not None else
                    f"{self.result.model.architecture}, a generative model: no classifier head")
            accepted = ", ".join(f'"{t}"' for t in tasks)
            if pooling_task is None:
                raise GenerationError(f"encode: pooling_task: required, as vLLM's LLM.encode requires it; this model "
                                      f"({kind}) serves {accepted}")
            raise GenerationError(f"encode: pooling_task: {short(pooling_task)} is not served by this model "
                                  f"({kind}); accepted: {accepted}")
        every = pooling_task.startswith("token_")
        outputs, rows, pooling = self._pool("encode", prompts, pooling_params, truncate_prompt_tokens, use_tqdm,
                                            lora_request, salt, every_token=every)
        if head is None:
            data = [pooled(row, p.use_activation is not False) for row, p in zip(rows, pooling, strict=True)]
        elif every:
            data = [head.probs(head_logits(model, tokens), p.use_activation is not False)
                    for tokens, p in zip(rows, pooling, strict=True)]
        else:
            data = [head.probs(logits, p.use_activation is not False)
                    for logits, p in zip(head_logits(model, rows), pooling, strict=True)]
        return [PoolingRequestOutput(request_id=out.request_id, prompt=out.prompt,
                                     prompt_token_ids=list(out.prompt_token_ids),
                                     num_cached_tokens=out.num_cached_tokens, outputs=PoolingOutput(d))
                for out, d in zip(outputs, data, strict=True)]
