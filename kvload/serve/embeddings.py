"""``POST /v1/embeddings`` (OpenAI's Embeddings API, as vLLM serves it for a decoder model run as an embedding model).

Each input is prefilled by the engine as a one-token request whose prompt's last hidden state is captured
(``engine.pooling``): the final norm's output at its last token, L2-normalized, vLLM's default for an embedding model
converted from a ``*ForCausalLM`` checkpoint. ``encoding_format`` ``"float"`` answers lists of floats, ``"base64"``
(what OpenAI's Python client asks for unless told otherwise) each vector's float32 bytes in base64, ``"bytes"`` and
``"bytes_only"`` the raw bytes, with vLLM's ``embed_dtype`` and ``endianness`` (``kvload.serve.pooled_encoding``).
The answer's id is ``embd-`` and the ``X-Request-Id`` header, else a fresh one, as vLLM names it: vLLM's
``/v1/embeddings`` takes a body's ``request_id`` (checked, a string) and never uses it (its
``PoolingServingBase._init_ctx`` passes only the header to ``_base_request_id``), so kvload takes it, leaves it unused,
and says so (:func:`say_body_request_id`: a ``setting_ignored`` naming the answer's id).
The route's body checks and its run (:func:`pooling_route`: every input in one batch) serve ``/score`` and ``/rerank``
too (``kvload.serve.scoring``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import torch
from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from engine.call_requests import POOLED
from engine.pooling import pooled
from engine.sampling_params import SamplingParams
from engine.serving import EngineStopped, ServeEvent
from kvload.serve.parse_gate import Departure, ParseGate, pass_turn
from kvload.serve.pooled_encoding import Encoding, base64_floats, bytes_response, encoding_of
from kvload.serve.protocol import (
    PROMPTS_EXPECTED,
    BadRequest,
    _accepted_as_done,
    _is_int,
    _known,
    _model,
    _need,
    _object,
    _prompts,
    _token_ids,
    shutting_down,
)
from kvload.serve.protocol import request_id as checked_request_id
from kvload.serve.request_body import CLIENT_CLOSED, _load, on_disconnect
from kvload.serve.request_input import _check_model, _header_request_id, text_tokens
from kvload.serve.state import ServeState
from kvload.serve.worker import _on_daemon_thread, _on_worker, _read
from pipeline.errors import GenerationError, KvBuildError, first_line
from pipeline.events import SettingIgnored
from pipeline.limits import MAX_INT

#: The fields ``/v1/embeddings`` takes: OpenAI's, and vLLM's extras for it.
FIELDS = frozenset({"input", "model", "encoding_format", "embed_dtype", "endianness", "dimensions", "user",
                    "truncate_prompt_tokens", "add_special_tokens", "use_activation", "normalize", "priority",
                    "request_id"})


def refuse_normalize(body: Any, instead: str) -> None:
    """vLLM's refusal of ``normalize`` on every pooling route (``reject_removed_pooling_parameters``: "Parameter
    `normalize` was removed; use `use_activation` instead."), whatever its value, null too; ``instead``: what
    use_activation false gives on this route."""
    if isinstance(body, dict) and "normalize" in body:
        raise BadRequest(f"normalize: the parameter was removed (vLLM's: use use_activation instead); send "
                         f"use_activation ({instead})", param="normalize")


@attrs.frozen
class EmbedJob:
    """One parsed ``/v1/embeddings`` body: each input's token ids, and how to answer (``request_id``: the
    ``X-Request-Id`` header's once :func:`pooling_run` read it; ``body_request_id``: the body's, unused as vLLM leaves
    it, and reported ``setting_ignored``)."""

    prompts: list[list[int]]
    encoding: Encoding
    normalize: bool
    params: SamplingParams
    priority: int = 0
    request_id: str | None = None
    body_request_id: str | None = None


def say_body_request_id(state: ServeState, route: str, given: str | None, answer_id: str) -> None:
    """A ``setting_ignored`` (``serve.request_id``) for a body's ``request_id`` that ``route`` took and left unused,
    as vLLM's pooling routes do (they name the answer by the ``X-Request-Id`` header alone); nothing when none was
    given."""
    if given is not None:
        state.engine.notify(SettingIgnored(
            field="serve.request_id", value=given, request=answer_id,
            reason=f"POST {route} names its answer by the X-Request-Id header alone, as vLLM's does (the body's "
                   f"request_id is taken and unused); send X-Request-Id to name it (request {answer_id})"))


def pooling_body(state: ServeState, raw: bytes | bytearray, fields: frozenset[str]) -> dict[str, Any]:
    """A pooling route's body as a JSON object of ``fields`` only, its ``model`` one this server serves."""
    return pooling_fields(state, _load(raw), fields)


def pooling_fields(state: ServeState, body: Any, fields: frozenset[str]) -> dict[str, Any]:
    """:func:`pooling_body` of a body already loaded (``/invocations`` reads it to pick the route)."""
    body = _object(body)
    _known(body, fields)
    _model(body)
    _check_model(state, body)
    return body


def pool_priority(state: ServeState, body: dict[str, Any]) -> int:
    """vLLM's ``priority`` of a pooling request, checked as the completions' is: any integer when the server
    schedules by priority (lower first), else only 0."""
    return _accepted_as_done(body, "pooling", 1, getattr(state.engine.scheduler, "by_priority", False))


def prefill_params(body: dict[str, Any]) -> SamplingParams:
    """The one-token greedy prefill that pools an input, with the body's ``truncate_prompt_tokens`` (checked)."""
    cut = body.get("truncate_prompt_tokens")
    # past int64 the engine's own check raised, a 500 naming "generate" (the completions' check bounds it too)
    _need(cut is None or (_is_int(cut) and (cut >= 1 or cut == -1) and cut <= MAX_INT), "truncate_prompt_tokens",
          "an integer >= 1 (keep the input's last N tokens) or -1 (the model's length)", cut)
    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, truncate_prompt_tokens=cut)


def prompt_list(body: dict[str, Any], field: str) -> tuple[list[Any], list[str]]:
    """``body[field]`` as the completions' prompt list reads it (texts, token ids, lists of either) and where each
    item is: ``field`` for one, ``field[i]`` for a list of them; ``BadRequest`` naming the field or item."""
    inputs = _prompts(body, field, "inputs", PROMPTS_EXPECTED)
    single = isinstance(body[field], str) or _token_ids(body[field])  # one input, not a list of them
    return inputs, [field] if single else [f"{field}[{i}]" for i in range(len(inputs))]


def tokenized(state: ServeState, items: list[Any], wheres: list[str], params: SamplingParams, param: str,
              add_special_tokens: bool = True, what: str = POOLED["embed"]) -> list[list[int]]:
    """Each text tokenized (token ids as given), cut as ``params`` asks and checked to fit ``what`` (an embedding,
    ``engine.call_requests.POOLED``); a ``BadRequest`` with ``param`` whose message names the item (``wheres[i]``)
    otherwise."""
    engine = state.engine
    prompts = []
    for i, (item, where) in enumerate(zip(items, wheres, strict=True)):
        if i and not pass_turn():  # the requests waiting to be parsed go first, as in _encode; gone: the server stops
            raise shutting_down()
        try:
            if isinstance(item, str) and params.truncate_prompt_tokens is None:  # past max_seq_len by its characters
                engine.check_embedding_chars(where, item, what)  # alone: refused untokenized
            ids = text_tokens(engine, item, add_special_tokens, where) if isinstance(item, str) else item  # as _encode
            # cut as asked; in the vocabulary; it fits
            ids = engine.check(ids, params, pool=True, what=what).prompt_token_ids
        except (GenerationError, KvBuildError) as exc:
            message = first_line(exc, "").removeprefix("generate: ").removeprefix("prompt 0: ")  # the one checked
            raise BadRequest(message if message.startswith(where) else f"{where}: {message}", param=param) from None
        prompts.append(list(ids))
    return prompts


def parse_embeddings(state: ServeState, raw: bytes | bytearray) -> EmbedJob:
    """Check an embeddings body and tokenize its inputs (on a worker thread); ``BadRequest`` naming the field, nothing
    queued, when any input could never be embedded."""
    return embed_job(state, _load(raw))


def embed_job(state: ServeState, body: Any) -> EmbedJob:
    """:func:`parse_embeddings` of a body already loaded."""
    body = pooling_fields(state, body, FIELDS)
    refuse_normalize(body, "false: the hidden state as computed, not L2-normalized")
    encoding = encoding_of(body)
    given_id = checked_request_id(body.get("request_id"))
    if body.get("dimensions") is not None:  # vLLM refuses it too for a model not trained for truncated embeddings
        dims = body["dimensions"]
        _need(_is_int(dims) and dims >= 1, "dimensions", "an integer >= 1", dims)
        raise BadRequest(f"dimensions: {dims}: this model gives its full hidden size only (no Matryoshka "
                         "embeddings); leave dimensions out", param="dimensions")
    _need(body.get("user") is None or isinstance(body["user"], str), "user", "a string", body.get("user"))
    flags = {}
    for name, default in (("add_special_tokens", True), ("use_activation", True)):
        value = body.get(name)
        _need(value is None or isinstance(value, bool), name, "true or false", value)
        flags[name] = default if value is None else value
    params = prefill_params(body)
    inputs, wheres = prompt_list(body, "input")
    prompts = tokenized(state, inputs, wheres, params, "input", add_special_tokens=flags["add_special_tokens"])
    return EmbedJob(prompts, encoding, flags["use_activation"], params, pool_priority(state, body),
                    body_request_id=given_id)


class PoolJob(Protocol):
    """A parsed pooling body: the token ids of each input to prefill, the prefill's parameters, its priority (a job
    with a ``request_id`` field, ``/v1/embeddings``' and ``/pooling``'s, has the ``X-Request-Id`` header put there)."""

    prompts: list[list[int]]
    params: SamplingParams
    priority: int


async def pooling_route(state: ServeState, request: Request, gate: ParseGate, stopping: asyncio.Event,
                        parse: Callable[[ServeState, bytes | bytearray], PoolJob],
                        answer: Callable[[Any, list[torch.Tensor]], dict[str, Any] | Response]) -> Response:
    """A pooling route (``/v1/embeddings``, ``/score``, ``/rerank``): the body read and parsed as the completions'
    are, every input queued as one request (all in one batch, sharing steps), then ``answer(job, rows)`` with each
    input's captured last hidden row, in order."""
    departure = Departure()  # as the completions' (kvload.serve.handlers._serve): a client gone is not parsed further
    try:
        raw = await _read(request, state, gate, stopping, departure)
        async with gate.turn(departure) as turn:
            if state.engine.stopping:
                raise shutting_down()
            job = await _on_worker(stopping, lambda: None, parse, state, raw, gone=departure, held=turn)
        if departure.left:
            raise ClientDisconnect()
    except ClientDisconnect:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        departure.close()
    return await pooling_run(state, request, job, answer)


async def pooling_run(state: ServeState, request: Request, job: PoolJob,
                      answer: Callable[[Any, list[torch.Tensor]], dict[str, Any] | Response]) -> Response:
    """:func:`pooling_route` once the body is parsed: ``job``'s inputs queued in one batch, then its answer (each
    input's row; a job whose ``every_token`` is true: a ``(tokens, hidden)`` tensor of every prompt token's): a JSON
    document, or a ``Response`` as it is (``encoding_format`` ``bytes``)."""
    if hasattr(job, "request_id"):  # vLLM's: an X-Request-Id header names the answer (a body's request_id never)
        header = _header_request_id(request)  # checked before anything is queued: a bad one is a 400
        if header is not None:
            job = attrs.evolve(job, request_id=header)  # type: ignore[misc]
    loop = asyncio.get_running_loop()
    ended: asyncio.Queue[tuple[int, ServeEvent] | None] = asyncio.Queue()  # None: the client went away
    engine = state.engine
    req_ids: list[str] = []
    events: dict[int, ServeEvent] = {}
    every_token = getattr(job, "every_token", False)  # /pooling's per-token tasks: each prompt token's row
    try:
        for i, ids in enumerate(job.prompts):
            def sink(ev: ServeEvent, i: int = i) -> None:
                if ev.finished:
                    loop.call_soon_threadsafe(ended.put_nowait, (i, ev))
            try:
                req_ids.append(engine.submit(ids, job.params, sink, pool=True, priority=job.priority,
                                             every_token=every_token))
            except EngineStopped:
                raise shutting_down() from None
        # a client that leaves has its requests aborted at once (the finally below), as a completion's are: the
        # inputs not yet prefilled were computed for no one, holding its slot and delaying everyone else's steps
        async with on_disconnect(request, lambda: ended.put_nowait(None)):
            while len(events) < len(req_ids):
                item = await ended.get()
                if item is None:
                    return Response(status_code=CLIENT_CLOSED)
                events[item[0]] = item[1]
        failed = next((ev for ev in events.values() if ev.finish_reason in ("abort", "error")), None)
        if failed is not None:
            if failed.finish_reason == "abort" or engine.stopping:
                raise shutting_down()
            raise BadRequest(f"the engine failed while embedding: {failed.error}", status=500, kind="server_error",
                             code="engine_error")
        taken = [engine.executor.pooled.take(r) for r in req_ids]
    finally:  # a failure or a client gone: whatever still runs is aborted, and no row is left behind
        for i, req_id in enumerate(req_ids):
            if i not in events:
                engine.abort(req_id)
            engine.executor.pooled.take(req_id)
    rows = []
    for i, row in enumerate(taken):
        if row is None:  # every finished request's prefill ran its last token: a missing row is a bug, said so
            raise BadRequest(f"input {i}: its last hidden state was not captured", status=500, kind="server_error")
        rows.append(row)
    # the answer's model work (a classifier's head over the rows) and its encoding run off the event loop, which
    # serves every other request meanwhile; a daemon thread, as a body's parse (kvload.serve.worker)
    return await _on_daemon_thread(lambda: rendered(answer(job, rows)))


def rendered(doc: dict[str, Any] | Response) -> Response:
    """An answer's ``Response``: a JSON document through :func:`json_response`, a ``Response`` as it is."""
    return doc if isinstance(doc, Response) else json_response(doc)


class RenderedJSON:
    """A value of an answer already rendered as JSON text, in pieces (a per-token output's rows, one piece each), put
    in the answer's body as it is by :func:`json_response`."""

    __slots__ = ("pieces",)

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces


def float_rows(data: torch.Tensor) -> RenderedJSON:
    """``data.tolist()`` as JSON (Starlette's JSONResponse's text of it), rendered one row at a time: ``json.dumps``
    holds the GIL for all it renders, and a per-token output of a long prompt in one call (8,192 x 1,024 floats: 5 s)
    stalled every thread of the server, the engine loop and every other request, for all of it; between two rows the
    interpreter lets the others run. A row of the whole list at a time takes no more memory than its text."""
    if data.dim() < 2:
        return RenderedJSON([_dumps(data.tolist())])
    pieces = ["["]
    for i, row in enumerate(data):
        if i:
            pieces.append(",")
        pieces.append(_dumps(row.tolist()) if row.dim() == 1 else "".join(float_rows(row).pieces))
    pieces.append("]")
    return RenderedJSON(pieces)


def _dumps(value: Any) -> str:
    """Starlette's JSONResponse's rendering of one value (no NaN or infinity: a ValueError, its 500)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def json_response(doc: Any) -> Response:
    """``JSONResponse(doc)``'s body, but each :class:`RenderedJSON` value in ``doc`` put in as its text."""
    fragments: list[RenderedJSON] = []
    mark = f"\u0000rendered-{uuid.uuid4().hex}-"

    def placed(value: Any) -> Any:
        if isinstance(value, RenderedJSON):
            fragments.append(value)
            return f"{mark}{len(fragments) - 1}"
        if isinstance(value, dict):
            return {k: placed(v) for k, v in value.items()}
        if isinstance(value, list):
            return [placed(v) for v in value]
        return value

    text = _dumps(placed(doc))
    if not fragments:
        return Response(text.encode("utf-8"), media_type="application/json")
    parts: list[bytes] = []
    at = 0
    for i, fragment in enumerate(fragments):  # in the order json.dumps wrote their marks (each a string of its own)
        key = _dumps(f"{mark}{i}")
        found = text.index(key, at)
        parts.append(text[at:found].encode("utf-8"))
        parts.extend(piece.encode("utf-8") for piece in fragment.pieces)
        at = found + len(key)
    parts.append(text[at:].encode("utf-8"))
    return Response(b"".join(parts), media_type="application/json")


def embeddings_answer(state: ServeState, job: EmbedJob, rows: list[torch.Tensor]) -> dict[str, Any] | Response:
    """OpenAI's embeddings list: each input's vector, as floats or base64; vLLM's bytes answer for ``bytes`` and
    ``bytes_only``."""
    vectors = [pooled(row, job.normalize) for row in rows]
    tokens = sum(len(ids) for ids in job.prompts)
    head = {"id": f"embd-{job.request_id or uuid.uuid4().hex}", "created": int(time.time()),
            "model": state.model_name}
    say_body_request_id(state, "/v1/embeddings", job.body_request_id, head["id"])
    if job.encoding.binary:
        return bytes_response(job.encoding, vectors, head, tokens)
    enc = job.encoding
    data = [{"index": i, "object": "embedding",
             "embedding": base64_floats(v, enc.dtype, enc.endianness) if enc.format == "base64" else v.tolist()}
            for i, v in enumerate(vectors)]
    return {"id": head["id"], "object": "list", "created": head["created"], "model": head["model"], "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def embeddings_route(state: ServeState, request: Request, gate: ParseGate,
                           stopping: asyncio.Event) -> Response:
    """``POST /v1/embeddings``: every input embedded in one batch, the answer once all are."""
    return await pooling_route(state, request, gate, stopping, parse_embeddings,
                               lambda job, rows: embeddings_answer(state, job, rows))


__all__ = ["FIELDS", "EmbedJob", "PoolJob", "RenderedJSON", "base64_floats", "embed_job", "embeddings_answer",
           "embeddings_route", "float_rows", "json_response", "parse_embeddings", "pool_priority", "pooling_body",
           "pooling_fields", "pooling_route", "pooling_run", "prefill_params", "prompt_list", "rendered",
           "say_body_request_id", "tokenized"]
