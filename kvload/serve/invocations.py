"""SageMaker's ``POST /invocations``, as vLLM serves it: the body's fields pick the route that answers it.

vLLM tries its request types in turn and serves the body with the first one it validates as: a chat completion,
a completion, an embedding, a rerank, then a score request, and last a pooling request. kvload picks by the same
fields in the same order, then the picked route checks the body, so a refusal names the field that route needs rather
than "no handler". A body naming a pooling ``task`` goes to ``/pooling`` first: vLLM's embedding and classification
requests take unknown fields and drop them, so there it was served as one of those whatever task it asked for; here
the route that reads ``task`` answers it, as asked (``/v1/embeddings`` and ``/classify`` refuse a field they do not
take).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import torch
from fastapi.responses import Response

from kvload.serve.classify import classify_answer, classify_job
from kvload.serve.embeddings import PoolJob, embed_job, embeddings_answer
from kvload.serve.pooling import pooling_answer, pooling_job
from kvload.serve.protocol import BadRequest
from kvload.serve.request_body import _load
from kvload.serve.scoring import SCORE_SIDES, rerank_answer, rerank_job, score_answer, score_job
from kvload.serve.state import ServeState
from models.classifier import head_of

if TYPE_CHECKING:
    from kvload.serve.request_run import _Run

#: The pooling routes a body may be for: its job from the loaded body, and its answer.
POOLED: dict[str, tuple[Callable[[ServeState, Any], PoolJob], Callable[..., dict[str, Any] | Response]]] = {
    "embeddings": (embed_job, embeddings_answer), "classify": (classify_job, classify_answer),
    "rerank": (rerank_job, rerank_answer), "score": (score_job, score_answer),
    "pooling": (pooling_job, pooling_answer)}


@attrs.frozen
class Pooled:
    """An ``/invocations`` body for a pooling route, parsed: its job, and how to answer it."""

    job: PoolJob
    answer: Callable[[Any, list[torch.Tensor]], dict[str, Any] | Response]


def invocation_kind(body: Any, classifies: bool = False) -> str:
    """The route a body goes to, by its fields in vLLM's order (but ``task`` with ``input`` or ``messages``, a
    pooling request's, first: ``/pooling`` is the route that reads ``task``): ``messages`` a chat completion (a
    classification's chat form when the served model ``classifies``: a classifier has no chat handler, and vLLM's
    ``ClassificationRequest`` takes the body), ``prompt`` a completion, ``input`` an embedding (a classification when
    the served model ``classifies``: vLLM picks the pooling request by the model's task), ``query`` with
    ``documents`` a rerank, a score's pair of sides (``text_1``/``text_2``, ``data_1``/``data_2``, ``queries`` with
    ``documents`` or ``items``) a score; a body with part of a rerank's or a score's fields goes to that route, which
    names what is missing; a body with ``task`` and none of those fields ``/pooling``, which names the input it
    lacks. Else a 400."""
    if isinstance(body, dict):
        if "task" in body and ("input" in body or "messages" in body):
            return "pooling"
        if "messages" in body:
            return "classify" if classifies else "chat"
        if "prompt" in body:
            return "completion"
        if "input" in body:
            return "classify" if classifies else "embeddings"
        if "query" in body and "documents" in body:  # vLLM tries a RerankRequest before a ScoreRequest
            return "rerank"
        if any(first in body and second in body for first, second in SCORE_SIDES):
            return "score"
        if "query" in body:
            return "rerank"
        if any(name in body for pair in SCORE_SIDES for name in pair):
            return "score"
        if "task" in body:  # only /pooling reads task: its refusal names the input the body lacks
            return "pooling"
    raise BadRequest("/invocations: the body has none of the fields that pick a route: messages (POST "
                     "/v1/chat/completions; POST /classify for a classifier), prompt (POST /v1/completions), input "
                     "(POST /v1/embeddings; POST /classify for a classifier), query and documents (POST /rerank), or "
                     "text_1 and text_2, data_1 and data_2, queries and documents or items (POST /score), or task "
                     "with input or messages (POST /pooling); send the body that route takes")


def prepare_invocation(state: ServeState, run: _Run, raw: bytes | bytearray) -> Pooled | None:
    """Load an ``/invocations`` body and check it as its route does (on the worker): ``Pooled`` for a pooling
    route's, nothing queued yet; else ``None``, ``run`` prepared as the chat or completion it is."""
    body = _load(raw)
    kind = invocation_kind(body, head_of(state.engine.executor.model) is not None)
    if kind in POOLED:
        parse, answer = POOLED[kind]
        return Pooled(parse(state, body), functools.partial(answer, state))
    run.prepare_body(body, kind)
    return None


__all__ = ["POOLED", "Pooled", "invocation_kind", "prepare_invocation"]
