"""``POST /classify`` (vLLM's classification API) for a ``*ForSequenceClassification`` checkpoint (or a
``*ForTokenClassification`` one: its last token's row, as vLLM serves it).

Each input is pooled as ``/v1/embeddings`` pools it (its prompt's last hidden state, every input in one batch:
:func:`kvload.serve.embeddings.pooling_route`), then the classifier head is applied to it and activated as vLLM does
(``models.classifier``: softmax, sigmoid for one label). The answer is vLLM's ``ClassificationResponse``: per input its
``probs``, ``num_classes`` and ``label`` (``id2label`` of the most probable class), and ``usage`` counting the inputs'
prompt tokens. A generative model has no head: a 400 saying so, as vLLM's "does not support Classification API".
vLLM's chat form (``ClassificationChatRequest``) takes ``messages`` in place of ``input``: one conversation through the
chat template, checked and templated as the chat endpoint does it (:func:`chat_ids`).
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
from engine.prompts import TEMPLATE_OPTIONS
from engine.sampling_params import SamplingParams
from kvload.serve.embeddings import (
    pool_priority,
    pooling_fields,
    pooling_route,
    prefill_params,
    prompt_list,
    refuse_normalize,
    tokenized,
)
from kvload.serve.protocol import BadRequest, _messages, _need, _template
from kvload.serve.request_body import _load
from kvload.serve.request_input import (
    _check_template,
    _messages_error,
    messages_tokens,
    with_default_template_kwargs,
)
from kvload.serve.state import ServeState
from models.classifier import ClassifierHead, head_logits, head_of, no_head
from pipeline.errors import GenerationError

#: vLLM's switches of the classifier's activation, the first one given deciding (``get_use_activation``: the older
#: ``softmax`` and ``activation`` are its deprecated spellings)
ACTIVATION_FIELDS = ("use_activation", "softmax", "activation")
#: The fields ``/classify`` takes: vLLM's ``ClassificationCompletionRequest``'s.
FIELDS = frozenset({"input", "model", "user", "truncate_prompt_tokens", "add_special_tokens", "priority",
                    *ACTIVATION_FIELDS})
#: ... and its chat form's, vLLM's ``ClassificationChatRequest``: ``messages`` in place of ``input``, with the chat
#: template's options (``add_generation_prompt`` off by default there, vLLM's ``ChatRequestMixin``)
CHAT_FIELDS = (FIELDS - {"input"}) | {"messages"} | TEMPLATE_OPTIONS


@attrs.frozen
class ClassifyJob:
    """One parsed ``/classify`` body: each input's token ids, and whether to activate the logits."""

    prompts: list[list[int]]
    params: SamplingParams
    use_activation: bool = True
    priority: int = 0


def served_head(state: ServeState, route: str) -> ClassifierHead:
    """The served classifier's head; a 400 for a generative model, which has none."""
    head = head_of(state.engine.executor.model)
    if head is None:
        architecture = getattr(state.engine.executor.model.config, "architectures", None) or ["a causal LM"]
        raise BadRequest(no_head(route, state.model_name, architecture[0]), param="model")
    return head


def use_activation(body: dict[str, Any]) -> bool:
    """vLLM's ``use_activation`` of a body (or its older ``softmax`` / ``activation``): true unless one says false."""
    for name in ACTIVATION_FIELDS:
        value = body.get(name)
        _need(value is None or isinstance(value, bool), name, "true or false", value)
    return next((body[name] for name in ACTIVATION_FIELDS if body.get(name) is not None), True)


def parse_classify(state: ServeState, raw: bytes | bytearray) -> ClassifyJob:
    """Check a ``/classify`` body and tokenize its inputs (on a worker thread); ``BadRequest`` naming the field."""
    return classify_job(state, _load(raw))


def input_or_messages(state: ServeState, body: Any, fields: frozenset[str],
                      chat_fields: frozenset[str]) -> tuple[dict[str, Any], bool]:
    """A pooling body's fields checked as its input form (``fields``) or, holding ``messages``, as vLLM's chat form
    (``chat_fields``, the server's --default-chat-template-kwargs filled in as the chat endpoint templates a
    conversation); with whether it is the chat form. Both ``input`` and ``messages``: a ``BadRequest``."""
    chat = isinstance(body, dict) and "messages" in body
    if chat and "input" in body:
        raise BadRequest("messages: give input (texts or token ids) or messages (a conversation), not both",
                         param="messages")
    if chat:
        body = with_default_template_kwargs(state, body)
    return pooling_fields(state, body, chat_fields if chat else fields), chat


def classify_job(state: ServeState, body: Any) -> ClassifyJob:
    """:func:`parse_classify` of a body already loaded."""
    refuse_normalize(body, "false: the logits as computed")  # vLLM's removed switch, refused on every route
    body, chat = input_or_messages(state, body, FIELDS, CHAT_FIELDS)
    served_head(state, "/classify")
    _need(body.get("user") is None or isinstance(body["user"], str), "user", "a string", body.get("user"))
    special = body.get("add_special_tokens")
    _need(special is None or isinstance(special, bool), "add_special_tokens", "true or false", special)
    activate = use_activation(body)
    params = prefill_params(body)
    if chat:
        ids = chat_ids(state, body, special is True)
        prompts = tokenized(state, [ids], ["messages"], params, "messages",  # cut as asked; it fits
                            what=POOLED["classify"])
    else:
        inputs, wheres = prompt_list(body, "input")
        prompts = tokenized(state, inputs, wheres, params, "input", add_special_tokens=special is not False,
                            what=POOLED["classify"])
    return ClassifyJob(prompts, params, activate, pool_priority(state, body))


def chat_ids(state: ServeState, body: dict[str, Any], add_special_tokens: bool) -> list[int]:
    """The token ids of a body's ``messages`` through the chat template, as the chat endpoint templates them (its
    checks of the messages and the template options, its 400s), the assistant's turn not opened unless
    ``add_generation_prompt`` says (vLLM's pooling chat default) and no special tokens on top of the template's."""
    messages = _messages(body)
    opened = body.get("add_generation_prompt")
    template = _template({**body, "add_generation_prompt": False if opened is None else opened})
    _check_template(state, template)
    try:
        return messages_tokens(state.engine, messages, template, add_special_tokens=add_special_tokens, room=False,
                               instead="give input (texts or token ids) instead")
    except GenerationError as exc:
        raise _messages_error(exc, template) from None


def classify_answer(state: ServeState, job: ClassifyJob, rows: list[torch.Tensor]) -> dict[str, Any]:
    """vLLM's ``ClassificationResponse``: each input's probabilities, their count and the best one's label."""
    model = state.engine.executor.model
    head = served_head(state, "/classify")
    data = []
    for i, probs in enumerate(head.probs(head_logits(model, rows), job.use_activation).tolist()):  # all at once
        data.append({"index": i, "label": head.label(probs), "probs": probs, "num_classes": len(probs)})
    tokens = sum(len(ids) for ids in job.prompts)
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": state.model_name, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}


async def classify_route(state: ServeState, request: Request, gate: asyncio.Lock,
                         stopping: asyncio.Event) -> Response:
    """``POST /classify``: every input classified in one batch, the answer once all are."""
    return await pooling_route(state, request, gate, stopping, parse_classify,
                               lambda job, rows: classify_answer(state, job, rows))


__all__ = ["ACTIVATION_FIELDS", "CHAT_FIELDS", "FIELDS", "ClassifyJob", "chat_ids", "classify_answer", "classify_job",
           "classify_route", "input_or_messages", "parse_classify", "served_head", "use_activation"]
