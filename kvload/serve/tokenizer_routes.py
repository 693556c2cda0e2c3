"""The work of vLLM's /tokenize and /detokenize and Anthropic's count_tokens, done on a worker thread."""

from __future__ import annotations

from typing import Any

from kvload.serve.messages_input import renamed_error as messages_error
from kvload.serve.messages_input import to_chat as messages_to_chat
from kvload.serve.protocol import BadRequest, parse_detokenize, parse_tokenize
from kvload.serve.request_body import _load
from kvload.serve.request_input import (
    _check_model,
    _check_template,
    _encode,
    _field_error,
    _messages_error,
    _parse_body,
    messages_tokens,
    text_tokens,
    with_default_template_kwargs,
)
from kvload.serve.state import ServeState
from pipeline.errors import GenerationError


def _tokenize(state: ServeState, raw: bytes | bytearray) -> dict[str, Any]:
    """``POST /tokenize``'s answer (on a worker thread): a text's token ids, or a conversation's as the chat
    endpoint prompts with it; ``BadRequest`` naming the field."""
    body = _load(raw)
    if isinstance(body, dict) and "messages" in body:  # templated as the chat endpoint templates it
        body = with_default_template_kwargs(state, body)
    job = parse_tokenize(body)
    _check_model(state, body)
    _check_template(state, job.template)
    engine = state.engine
    try:
        if job.messages is not None:
            ids = messages_tokens(engine, job.messages, job.template, add_special_tokens=job.add_special_tokens,
                                  room=False)
        else:  # a long text off the parse gate, as a completion's prompt
            ids = text_tokens(engine, job.prompt or "", job.add_special_tokens, "prompt")
    except GenerationError as exc:
        raise (_messages_error(exc, job.template) if job.messages is not None
               else _field_error(exc, "prompt")) from None
    return {"count": len(ids), "max_model_len": engine.executor.max_seq_len, "tokens": ids,
            "token_strs": engine.token_strs(ids) if job.return_token_strs else None}


def _count_tokens(state: ServeState, raw: bytes | bytearray) -> dict[str, Any]:
    """Anthropic's ``POST /v1/messages/count_tokens`` (on a worker thread): the prompt's tokens, as
    ``/v1/messages`` templates the same body, also past the context (a client counts to learn what to trim; as
    ``/tokenize`` counts); ``BadRequest`` naming the Messages field."""
    chat, request = messages_to_chat(_load(raw), state.tool_call_parser, state.reasoning_parser, count=True)
    try:
        ids, _ = _encode(state.engine, _parse_body(state, chat, "chat"), room=False)
    except BadRequest as exc:
        raise messages_error(exc, request) from None
    return {"input_tokens": len(ids[0])}


def _detokenize(state: ServeState, raw: bytes | bytearray) -> dict[str, Any]:
    """``POST /detokenize``'s answer (on a worker thread): the text of token ids, special tokens shown."""
    body = _load(raw)
    tokens = parse_detokenize(body)
    _check_model(state, body)
    try:
        return {"prompt": state.engine.detokenize(tokens)}
    except GenerationError as exc:
        raise _field_error(exc, "tokens") from None
