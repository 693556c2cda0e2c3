"""``POST /pooling`` (vLLM's pooling API): the pooled outputs of the served model, whole or per token, by ``task``.

vLLM serves one route for every pooling task a model has: ``embed`` (the prompt's last hidden state, as
``/v1/embeddings``), ``classify`` (the classifier head's probabilities, as ``/classify``), and their per-token forms
``token_embed`` (every prompt token's hidden state) and ``token_classify`` (the head over every prompt token, a
reward model's per-token scores: ``LLM.reward``). Which tasks a model has follows vLLM's adapters: a generative
model (served as an embedding model whatever the runner) ``embed`` and ``token_embed``; a classifier (a
``*ForSequenceClassification`` or ``*ForTokenClassification`` checkpoint, or a causal LM under ``--convert
classify``) ``classify`` and ``token_classify``. A body without ``task`` gets vLLM's default, the first per-token
task the model has (``token_embed``, else ``token_classify``); vLLM 0.10's ``encode`` is taken as that default too.

The body is vLLM's ``PoolingCompletionRequest`` (``input``) or ``PoolingChatRequest`` (``messages``, templated as
``/classify``'s chat form), checked as ``/v1/embeddings`` and ``/classify`` check theirs: ``use_activation`` is every
task's switch (false: an embedding's hidden states not L2-normalized, a classifier's logits not softmaxed), vLLM's
older ``softmax`` / ``activation`` the classifier's only, and ``normalize`` refused as vLLM refuses it since removing
it ("use use_activation instead"). The answer is vLLM's ``PoolingResponse``: per input
``{"index", "object": "pooling", "data"}``, ``data`` a list of floats (a per-token task: one list per prompt token) or,
with ``encoding_format: "base64"``, the values' bytes (vLLM's ``embed_dtype``, float32 by default, in its
``endianness``, the server's by default), row after row, in base64; ``"bytes"`` and ``"bytes_only"`` answer the raw
bytes as vLLM does (``kvload.serve.pooled_encoding``). The answer's id is ``pooling-`` and the ``X-Request-Id``
header, else a fresh one, as vLLM names it (its ``ServingPooling.request_id_prefix``; ``pool-`` before vLLM moved its
pooling routes onto one base): vLLM's ``/pooling`` takes a body's ``request_id`` (checked, a string) and never
uses it (its serving passes only the header to ``_base_request_id``), so kvload takes it, leaves it unused, and says
so (a ``setting_ignored``, naming the answer's id).
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

from engine.call_requests import POOLED
from engine.pooling import pooled
from engine.prompts import TEMPLATE_OPTIONS
from engine.sampling_params import SamplingParams
from kvload.serve.classify import ACTIVATION_FIELDS, chat_ids, input_or_messages, use_activation
from kvload.serve.embeddings import FIELDS as EMBEDDING_FIELDS
from kvload.serve.embeddings import (
    float_rows,
    pool_priority,
    pooling_route,
    prefill_params,
    prompt_list,
    refuse_normalize,
    say_body_request_id,
    tokenized,
)
from kvload.serve.parse_gate import ParseGate
from kvload.serve.pooled_encoding import FLOAT, Encoding, base64_floats, bytes_response, encoding_of
from kvload.serve.protocol import BadRequest, _is_int, _need
from kvload.serve.protocol import request_id as checked_request_id
from kvload.serve.request_body import _load
from kvload.serve.state import ServeState
from models.classifier import head_logits, head_of

#: The tasks a generative model serves (vLLM's embedding adapter), the default first.
EMBED_TASKS = ("token_embed", "embed")
#: ... and a classifier's (vLLM's sequence-classification adapter), the default first.
CLASSIFY_TASKS = ("token_classify", "classify")
#: vLLM 0.10's name of the default task (its per-token output), taken as that.
DEFAULT_TASK_ALIAS = "encode"
#: Each task's pooled request as a too-long input's refusal names it.
WHAT = {"embed": POOLED["embed"], "token_embed": "a token embedding (every token's hidden state)",
        "classify": POOLED["classify"], "token_classify": POOLED["reward"]}
#: The fields ``/pooling`` takes: vLLM's ``PoolingCompletionRequest``'s (``/v1/embeddings``' and ``task``, with the
#: classifier's activation switches).
FIELDS = EMBEDDING_FIELDS | {"task", *ACTIVATION_FIELDS}
#: ... and its chat form's, vLLM's ``PoolingChatRequest``: ``messages`` in place of ``input``, with the chat
#: template's options (``add_generation_prompt`` off by default there)
CHAT_FIELDS = (FIELDS - {"input"}) | {"messages"} | TEMPLATE_OPTIONS


@attrs.frozen
class PoolingJob:
    """One parsed ``/pooling`` body: each input's token ids, the task, and how to answer (``request_id``: the
    ``X-Request-Id`` header's once ``pooling_run`` read it; ``body_request_id``: the body's, unused as vLLM leaves it,
    and reported ``setting_ignored``)."""

    prompts: list[list[int]]
    params: SamplingParams
    task: str
    encoding: Encoding = FLOAT
    normalize: bool = True
    use_activation: bool = True
    priority: int = 0
    request_id: str | None = None
    body_request_id: str | None = None

    @property
    def every_token(self) -> bool:
        """Whether each prompt token's row is pooled (``token_embed``, ``token_classify``), not the last one's."""
        return self.task.startswith("token_")


def served_tasks(state: ServeState) -> tuple[str, ...]:
    """The pooling tasks the served model has, its default first."""
    return CLASSIFY_TASKS if head_of(state.engine.executor.model) is not None else EMBED_TASKS


def pooling_task(state: ServeState, value: Any) -> str:
    """The body's ``task``, one the served model has (None, or vLLM 0.10's ``encode``: the default); a 400 naming
    ``task`` and the values this model takes otherwise."""
    tasks = served_tasks(state)
    if value is None or value == DEFAULT_TASK_ALIAS:
        return tasks[0]
    if isinstance(value, str) and value in tasks:
        return value
    model = state.engine.executor.model
    head = head_of(model)
    if head is not None:
        kind = f"{head.architecture}, a classifier"
    else:
        architecture = (getattr(model.config, "architectures", None) or ["a causal LM"])[0]
        kind = f"{architecture}, a generative model: no classifier head"
    others = ", ".join(f'"{t}"' for t in tasks[1:])
    accepted = f'"{tasks[0]}" (the default; "{DEFAULT_TASK_ALIAS}" names it too), {others}'
    _need(isinstance(value, str), "task", f"one of {accepted}", value)
    pairs = "; a pair's score is POST /score's" if value == "score" else ""  # vLLM's task of a cross-encoder
    raise BadRequest(f'task: "{value[:40]}" is not served by this model ({kind}); accepted: {accepted}{pairs}',
                     param="task")


def parse_pooling(state: ServeState, raw: bytes | bytearray) -> PoolingJob:
    """Check a ``/pooling`` body and tokenize its inputs (on a worker thread); ``BadRequest`` naming the field."""
    return pooling_job(state, _load(raw))


def pooling_job(state: ServeState, body: Any) -> PoolingJob:
    """:func:`parse_pooling` of a body already loaded (``/invocations`` reads it to pick the route)."""
    body, chat = input_or_messages(state, body, FIELDS, CHAT_FIELDS)
    task = pooling_task(state, body.get("task"))
    encoding = encoding_of(body)
    given_id = checked_request_id(body.get("request_id"))
    if body.get("dimensions") is not None:  # vLLM: "dimensions is currently not supported" on this route
        dims = body["dimensions"]
        _need(_is_int(dims) and dims >= 1, "dimensions", "an integer >= 1", dims)
        raise BadRequest(f"dimensions: {dims}: this model gives its full hidden size only (no Matryoshka "
                         "embeddings); leave dimensions out", param="dimensions")
    _need(body.get("user") is None or isinstance(body["user"], str), "user", "a string", body.get("user"))
    special = body.get("add_special_tokens")
    _need(special is None or isinstance(special, bool), "add_special_tokens", "true or false", special)
    embeds = task in EMBED_TASKS
    refuse_normalize(body, "false: the hidden states as computed, not L2-normalized" if embeds
                     else "false: the logits as computed")
    activate = use_activation(body)  # every task's switch (vLLM's): an embedding's L2 norm, a classifier's softmax
    older = next((name for name in ACTIVATION_FIELDS[1:] if body.get(name) is not None), None)
    if embeds and older is not None:  # softmax / activation: the classifier's older names, never an embedding's
        raise BadRequest(f"{older}: the older name of a classifier's use_activation (task classify or "
                         f"token_classify); task {task} takes use_activation (false: the hidden states as computed)",
                         param=older)
    params = prefill_params(body)
    if chat:
        ids = chat_ids(state, body, special is True)
        prompts = tokenized(state, [ids], ["messages"], params, "messages", what=WHAT[task])  # cut as asked; fits
    else:
        inputs, wheres = prompt_list(body, "input")
        prompts = tokenized(state, inputs, wheres, params, "input", add_special_tokens=special is not False,
                            what=WHAT[task])
    return PoolingJob(prompts, params, task, encoding, activate if embeds else True, activate,
                      pool_priority(state, body), body_request_id=given_id)


def pooled_data(state: ServeState, job: PoolingJob, rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each input's pooled output as ``job.task`` gives it: a vector (``embed``, ``classify``) or one row per prompt
    token (``token_embed``, ``token_classify``), float32."""
    if job.task in EMBED_TASKS:  # a row, or each token's row, L2-normalized unless asked not to
        return [pooled(row, job.normalize) for row in rows]
    model = state.engine.executor.model
    head = head_of(model)
    if head is None:  # the task was checked against the model that serves: a missing head is a bug, said so
        raise BadRequest(f"task {job.task}: the served model has no classifier head", status=500, kind="server_error")
    if job.task == "classify":  # every input's last row through the head at once
        return list(head.probs(head_logits(model, rows), job.use_activation))
    return [head.probs(head_logits(model, tokens), job.use_activation) for tokens in rows]


def encoded(data: torch.Tensor, encoding: Encoding) -> Any:
    """One input's data as vLLM's ``PoolingResponseData.data``: nested lists of floats, or its values' bytes (row
    after row, as ``encoding`` asks) in base64."""
    if encoding.format == "base64":
        return base64_floats(data, encoding.dtype, encoding.endianness)
    return float_rows(data)  # a row at a time: a long prompt's rows in one json.dumps held the GIL for seconds


def pooling_answer(state: ServeState, job: PoolingJob, rows: list[torch.Tensor]) -> dict[str, Any] | Response:
    """vLLM's ``PoolingResponse``: each input's pooled data, and ``usage`` counting the prompt tokens; vLLM's bytes
    answer for ``bytes`` and ``bytes_only``."""
    outputs = [d.float() for d in pooled_data(state, job, rows)]
    tokens = sum(len(ids) for ids in job.prompts)
    head = {"id": f"pooling-{job.request_id or uuid.uuid4().hex}", "created": int(time.time()),
            "model": state.model_name}
    say_body_request_id(state, "/pooling", job.body_request_id, head["id"])  # vLLM's takes it, names by the header
    if job.encoding.binary:
        return bytes_response(job.encoding, outputs, head, tokens)
    data = [{"index": i, "object": "pooling", "data": encoded(d, job.encoding)} for i, d in enumerate(outputs)]
    return {"id": head["id"], "object": "list", "created": head["created"], "model": head["model"], "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}


async def pooling_route_post(state: ServeState, request: Request, gate: ParseGate,
                             stopping: asyncio.Event) -> Response:
    """``POST /pooling``: every input pooled in one batch, the answer once all are."""
    return await pooling_route(state, request, gate, stopping, parse_pooling,
                               lambda job, rows: pooling_answer(state, job, rows))


__all__ = ["CHAT_FIELDS", "CLASSIFY_TASKS", "DEFAULT_TASK_ALIAS", "EMBED_TASKS", "FIELDS", "PoolingJob", "encoded",
           "parse_pooling", "pooled_data", "pooling_answer", "pooling_job", "pooling_route_post", "pooling_task",
           "served_tasks"]
