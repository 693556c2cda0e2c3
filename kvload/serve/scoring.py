"""``POST /score`` and ``POST /rerank`` (vLLM's score and Jina/Cohere-style rerank APIs).

vLLM serves both from an embedding model as the cosine similarity of the two texts' embeddings; kvload does the same
with the embeddings ``/v1/embeddings`` gives (``engine.pooling``): every text of a request is embedded in one batch,
then :func:`engine.pooling.score_pairs` pairs them (1:1, 1:N or N:N, as ``LLM.score``) and
:func:`engine.pooling.cosine` scores each pair. ``usage`` counts each pair's two texts' tokens, as vLLM's does.

From a one-label ``*ForSequenceClassification`` checkpoint (a cross-encoder, ``models.classifier``) vLLM scores each
pair as one sequence through the head instead: the pair tokenized as one (``pair_ids``), every pair pooled in one
batch, its score the head's logit through sigmoid (``use_activation: false``: the logit); ``usage`` counts each
pair's sequence.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import attrs
import torch
from fastapi import Request
from fastapi.responses import Response

from engine.pooling import ScorePairsError, cosine, pooled, score_pairs
from engine.prompts import not_unicode
from engine.sampling_params import SamplingParams
from kvload.serve.classify import ACTIVATION_FIELDS, use_activation
from kvload.serve.embeddings import (
    pool_priority,
    pooling_fields,
    pooling_route,
    prefill_params,
    prompt_list,
    refuse_normalize,
    tokenized,
)
from kvload.serve.parse_gate import ParseGate
from kvload.serve.protocol import MAX_PROMPTS, BadRequest, _is_int, _need
from kvload.serve.request_body import _load
from kvload.serve.state import ServeState
from models.classifier import head_logits, head_of, not_one_score, pair_ids, pair_length

#: The two sides a score body may name (vLLM's ``ScoreTextRequest``, ``ScoreDataRequest``,
#: ``ScoreQueriesDocumentsRequest`` and ``ScoreQueriesItemsRequest``): one pair per request.
SCORE_SIDES = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items"))
#: The fields ``/score`` takes.
SCORE_FIELDS = frozenset({"model", "truncate_prompt_tokens", "priority", *ACTIVATION_FIELDS,
                          *(name for pair in SCORE_SIDES for name in pair)})
#: The fields ``/rerank`` takes: vLLM's, and Cohere's and Jina's ``return_documents``.
RERANK_FIELDS = frozenset({"model", "query", "documents", "top_n", "truncate_prompt_tokens", "return_documents",
                           "priority", *ACTIVATION_FIELDS})

#: What ``use_activation`` false gives on ``/score`` and ``/rerank``, said where ``normalize`` is refused.
NORMALIZE_INSTEAD = ("false: a cross-encoder's logit as computed; an embedding model's score, the cosine, takes "
                     "none")


@attrs.frozen
class ScoreJob:
    """A parsed score or rerank body: every text's token ids (the first side's, then the second's), the pairs to
    score, and for a rerank its documents and how to answer."""

    prompts: list[list[int]]
    params: SamplingParams
    pairs: list[tuple[int, int]]
    priority: int = 0
    documents: list[str] = attrs.field(factory=list)
    top_n: int = 0
    return_documents: bool = True
    #: a cross-encoder's job: ``prompts`` holds each pair's one sequence, in order, and ``pairs`` is empty
    cross: bool = False
    use_activation: bool = True


def _documents(body: dict[str, Any]) -> list[str]:
    """``body["documents"]``: a non-empty list of non-empty strings (the answer returns each one's text)."""
    docs = body.get("documents")
    expected = "a non-empty list of non-empty strings"
    if docs is None:
        raise BadRequest(f"documents: required ({expected})", param="documents")
    _need(isinstance(docs, list) and bool(docs), "documents", expected, docs)
    if len(docs) > MAX_PROMPTS:
        raise BadRequest(f"documents: a list of {len(docs):,} documents; at most {MAX_PROMPTS} per request (send "
                         "several requests)", param="documents")
    for i, doc in enumerate(docs):
        _need(isinstance(doc, str) and bool(doc), f"documents[{i}]", "a non-empty string", doc)
    return docs


def _sides(body: dict[str, Any]) -> tuple[str, str]:
    """The pair of side names the body uses (``text_1``/``text_2`` and vLLM's other spellings), one pair only."""
    complete = [pair for pair in SCORE_SIDES if pair[0] in body and pair[1] in body]
    first, second = complete[0] if complete else next(
        (pair for pair in SCORE_SIDES if pair[0] in body or pair[1] in body), SCORE_SIDES[0])
    stray = sorted(name for pair in SCORE_SIDES for name in pair if name in body and name not in (first, second))
    if stray:
        raise BadRequest(f"{stray[0]}: not with {first} and {second}; give one pair of "
                         + ", ".join(f"{a}/{b}" for a, b in SCORE_SIDES), param=stray[0])
    return first, second


def _scored(state: ServeState, body: dict[str, Any], sides: list[tuple[str, list[Any], list[str]]],
            route: str = "/score") -> ScoreJob:
    """Both sides tokenized and paired: a ``ScoreJob`` with no rerank settings (a cross-encoder's: each pair one
    sequence)."""
    params = prefill_params(body)
    priority = pool_priority(state, body)
    (name_1, texts_1, wheres_1), (name_2, texts_2, wheres_2) = sides
    try:  # before tokenizing: lists that cannot pair are refused whatever their texts
        pairs = score_pairs(len(texts_1), len(texts_2), name_1, name_2, "texts")
    except ScorePairsError as exc:
        raise BadRequest(str(exc), param=exc.field) from None
    head = head_of(state.engine.executor.model)
    if head is None:
        given = next((name for name in ACTIVATION_FIELDS if body.get(name) is not None), None)
        if given is not None:
            raise BadRequest(f"{given}: the model {state.model_name} is an embedding model, scored by the cosine of "
                             "two embeddings; there is no classifier head for it to act on", param=given)
        prompts = [ids for name, texts, wheres in sides for ids in tokenized(state, texts, wheres, params, name)]
        return ScoreJob(prompts, params, pairs, priority)
    why = not_one_score(route, head)
    if why is not None:
        raise BadRequest(why, param="model")
    activate = use_activation(body)
    for name, texts, wheres in sides:
        for item, where in zip(texts, wheres, strict=True):
            if not isinstance(item, str):
                raise BadRequest(f"{where}: a cross-encoder scores texts (its tokenizer joins each pair as one "
                                 "sequence); give text, not token ids", param=name)
            problem = not_unicode(where, item)  # the pair's tokenizer raised on it: a 500 "TextInputSequence"
            if problem is not None:
                raise BadRequest(problem, param=name)
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise BadRequest(f"{name_1}: the model {state.model_name} has no tokenizer to join each pair as one sequence",
                         param=name_1)
    config = state.engine.executor.model.config
    texts = [*texts_1, *texts_2]
    wheres = [*wheres_1, *wheres_2]
    length = pair_length(params.truncate_prompt_tokens, state.engine.executor.max_seq_len)  # the query is kept
    joined = [pair_ids(tokenizer, config, texts[i], texts[j], length) for i, j in pairs]
    prompts = tokenized(state, joined, [f"{wheres[i]} with {wheres[j]}" for i, j in pairs], params, name_2)
    return ScoreJob(prompts, params, [], priority, cross=True, use_activation=activate)


def parse_score(state: ServeState, raw: bytes | bytearray) -> ScoreJob:
    """Check a ``/score`` body and tokenize its texts (on a worker thread); ``BadRequest`` naming the field."""
    return score_job(state, _load(raw))


def score_job(state: ServeState, body: Any) -> ScoreJob:
    """:func:`parse_score` of a body already loaded."""
    refuse_normalize(body, NORMALIZE_INSTEAD)  # vLLM's removed switch, refused on every pooling route
    body = pooling_fields(state, body, SCORE_FIELDS)
    first, second = _sides(body)
    return _scored(state, body, [(name, *prompt_list(body, name)) for name in (first, second)])


def parse_rerank(state: ServeState, raw: bytes | bytearray) -> ScoreJob:
    """Check a ``/rerank`` body and tokenize its query and documents; ``BadRequest`` naming the field."""
    return rerank_job(state, _load(raw))


def rerank_job(state: ServeState, body: Any) -> ScoreJob:
    """:func:`parse_rerank` of a body already loaded."""
    refuse_normalize(body, NORMALIZE_INSTEAD)
    body = pooling_fields(state, body, RERANK_FIELDS)
    query = body.get("query")
    _need(isinstance(query, str) and bool(query), "query", "a non-empty string", query)
    documents = _documents(body)
    top_n = body.get("top_n")
    _need(top_n is None or (_is_int(top_n) and top_n >= 0), "top_n",
          "an integer >= 0 (the best N documents; 0: all of them)", top_n)
    keep = body.get("return_documents")
    _need(keep is None or isinstance(keep, bool), "return_documents", "true or false", keep)
    if state.engine.tokenizer is None:  # its texts cannot be token ids: the answer gives each document's text
        raise BadRequest(f"query: the model {state.model_name} has no tokenizer (presets have random weights and "
                         "none); /rerank takes text (it answers each document's text); POST /score takes token ids",
                         param="query")
    wheres = [f"documents[{i}]" for i in range(len(documents))]
    job = _scored(state, body, [("query", [query], ["query"]), ("documents", documents, wheres)], "/rerank")
    return attrs.evolve(job, documents=documents, top_n=top_n or 0, return_documents=keep is not False)


def _scores(state: ServeState, job: ScoreJob, rows: list[torch.Tensor]) -> tuple[list[float], int]:
    """Each pair's score and the tokens ``usage`` counts, as vLLM counts them: the cosine and each pair's two texts'
    tokens; a cross-encoder's head score and each pair's sequence's tokens."""
    if job.cross:
        model = state.engine.executor.model
        head = head_of(model)
        return head.scores(head_logits(model, rows), job.use_activation), sum(map(len, job.prompts))
    vectors = [pooled(row, True) for row in rows]
    scores = [cosine(vectors[i], vectors[j]) for i, j in job.pairs]
    return scores, sum(len(job.prompts[i]) + len(job.prompts[j]) for i, j in job.pairs)


def score_answer(state: ServeState, job: ScoreJob, rows: list[torch.Tensor]) -> dict[str, Any]:
    """vLLM's ``ScoreResponse``: one score per pair, in order."""
    scores, tokens = _scores(state, job, rows)
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": state.model_name,
            "data": [{"index": k, "object": "score", "score": score} for k, score in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}


def rerank_answer(state: ServeState, job: ScoreJob, rows: list[torch.Tensor]) -> dict[str, Any]:
    """vLLM's ``RerankResponse``: the documents best first (ties in the order given), the best ``top_n`` if set."""
    scores, tokens = _scores(state, job, rows)
    order = sorted(range(len(scores)), key=lambda k: -scores[k])  # stable: equal scores keep the documents' order
    results = []
    for k in order[:job.top_n or None]:
        result: dict[str, Any] = {"index": k}
        if job.return_documents:
            result["document"] = {"text": job.documents[k]}
        result["relevance_score"] = scores[k]
        results.append(result)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": state.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results}


async def score_route(state: ServeState, request: Request, gate: ParseGate, stopping: asyncio.Event) -> Response:
    """``POST /score``, ``/v1/score``: the cosine of each pair's embeddings, every text embedded in one batch."""
    return await pooling_route(state, request, gate, stopping, parse_score,
                               lambda job, rows: score_answer(state, job, rows))


async def rerank_route(state: ServeState, request: Request, gate: ParseGate, stopping: asyncio.Event) -> Response:
    """``POST /rerank``, ``/v1/rerank``, ``/v2/rerank``: the documents ordered by their cosine with the query."""
    return await pooling_route(state, request, gate, stopping, parse_rerank,
                               lambda job, rows: rerank_answer(state, job, rows))


__all__ = ["RERANK_FIELDS", "SCORE_FIELDS", "SCORE_SIDES", "ScoreJob", "parse_rerank", "parse_score", "rerank_answer",
           "rerank_job", "rerank_route", "score_answer", "score_job", "score_route"]
