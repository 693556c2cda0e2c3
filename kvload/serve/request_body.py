"""A request's body: read under the size, time and media-type limits (413, 408, 415, 503), then loaded as JSON."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from kvload.serve.protocol import BadRequest, shutting_down
from pipeline.json_ints import Abandoned, LongInts, SharedInts, too_long_int, too_long_message
from pipeline.limits import MAX_DEPTH, json_depth, unique_keys

#: The status nginx logs for a client that closed the connection before the answer; nobody receives it.
CLIENT_CLOSED = 499


@contextlib.asynccontextmanager
async def on_disconnect(request: Request, gone: Callable[[], Any]) -> AsyncIterator[None]:
    """Within the block, ``gone()`` is called (on the event loop) as soon as the client goes away: ASGI's
    ``http.disconnect``, which the server sends once the connection closes or is half-closed. For a handler that
    answers once its engine requests end (a completion's plain answer, every pooling route): ``gone`` wakes it to
    abort them, so a client that left does not keep them computing to their end, holding its slot. The body must
    have been read already. A streamed answer needs none: Starlette cancels the stream itself."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()


async def _read_body(request: Request, limit: int, timeout: float, stopping: asyncio.Event) -> bytearray:
    """The request body, refused with 413 once it is known to pass ``limit`` bytes: by its Content-Length
    before a byte is read, else (chunked) as soon as what arrived passes it, so no oversized body is held.
    Refused with 408 when it has not all arrived ``timeout`` seconds after the handler began reading: a client
    that stops sending, or trickles, would otherwise hold the connection and the handler forever. Refused with
    503 as soon as ``stopping`` is set: uvicorn's shutdown would wait for the upload, then cancel the handler
    (a traceback and a plain-text 500). Refused with 415, unread, when it comes compressed (a Content-Encoding but
    identity), or in a Content-Type other than JSON's (none given is read as JSON)."""
    # each header as all its fields joined (HTTP's list rule): the first alone let "Content-Encoding: identity" then
    # "Content-Encoding: gzip" through, and the gzip bytes were read as JSON text
    encoding = ", ".join(request.headers.getlist("content-encoding")).strip().lower() or "identity"
    if encoding not in ("", "identity"):  # its bytes were read as JSON text: "not valid JSON: can't decode 0x8b"
        raise BadRequest(f"Content-Encoding {encoding[:40]!r}: not accepted; send the request body uncompressed "
                         "(identity)", status=415, code="unsupported_content_encoding",
                         headers={"Connection": "close"})  # refused unread, as a 413: the body is not waited for
    media = ", ".join(request.headers.getlist("content-type")) or None
    if media is not None and not _is_json(media):
        # vLLM refuses these too (FastAPI reads only a JSON body as JSON); a browser sends text/plain, a form or
        # multipart from any web page without asking the server first (no CORS preflight), so taking them as JSON
        # let every site a user visits run requests on a server with no --api-key on their machine
        raise BadRequest(f"Content-Type {media[:80]!r}: not accepted; send the request body as JSON "
                         "(Content-Type: application/json)", status=415, code="unsupported_media_type",
                         headers={"Connection": "close"})
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:  # the HTTP layer refuses a malformed Content-Length itself
        raise _too_large(limit, f"Content-Length {int(length):,}")
    body = bytearray()
    # its chunks kept, then joined once: freed together, glibc can hand them back (kvload.serve.worker._trim), and a
    # 20 MB body queued in the lane holds ~1x of the process's memory; a bytearray grown chunk by chunk moves as it
    # grows, among the connection's buffers, and left holes: ~2x even trimmed, ~3x untrimmed (BENCHMARKS.md)
    chunks: list[bytes] = []
    got = 0

    async def read() -> None:
        nonlocal body, got
        async for chunk in request.stream():
            chunks.append(chunk)
            got += len(chunk)
            if got > limit:
                raise _too_large(limit, f"more than {limit:,} bytes sent")
        body = bytearray().join(chunks)
        chunks.clear()

    reader = asyncio.ensure_future(read())
    stop = asyncio.ensure_future(stopping.wait())
    try:
        async with asyncio.timeout(timeout):  # the whole body, not each read: a trickle gets no more time
            await asyncio.wait((reader, stop), return_when=asyncio.FIRST_COMPLETED)
    except TimeoutError:
        expected = f"of {int(length):,}" if length.isdigit() else "of a chunked body"
        raise BadRequest(f"the request body did not arrive in time: {got:,} bytes {expected} came within "
                         f"{timeout:g} s (--request-read-timeout sets it)", status=408, code="request_timeout",
                         headers={"Connection": "close"}) from None
    finally:  # whichever did not finish (a cancelled handler leaves neither behind)
        stop.cancel()
        reader.cancel()
    if not reader.done() or reader.cancelled():
        raise shutting_down()
    reader.result()  # a 413, or ClientDisconnect (the client hung up mid-upload)
    return body


def _is_json(media: str) -> bool:
    """Whether a Content-Type names JSON (``application/json``, ``application/*+json``, any parameters), or is blank."""
    kind = media.split(";", 1)[0].strip().lower()
    return kind in ("", "application/json") or (kind.startswith("application/") and kind.endswith("+json"))


def _too_large(limit: int, got: str) -> BadRequest:
    # Connection: close, so the server never reads (or waits for) the rest of the body it refused
    return BadRequest(f"the request body is too large: at most {limit:,} bytes are accepted (--max-request-bytes "
                      f"sets it), got {got}", status=413, code="request_too_large", headers={"Connection": "close"})


class LoadedBody:
    """A request body already read as JSON (:func:`_load` of it, done ahead, off the parse gate): its size, and its
    value or the refusal ``_load`` raised, raised again when the parse under the gate asks for it (so a big body's
    refusal comes where a small one's does, in the same words). The raw bytes are not kept: a bytearray's are
    dropped (cleared) once decoded, before the JSON's value is built. ``gone``: as :func:`_load`'s."""

    __slots__ = ("error", "size", "value")

    def __init__(self, raw: bytes | bytearray, gone: Any = None) -> None:
        self.size = len(raw)
        self.value: Any = None
        self.error: Exception | None = None
        try:
            self.value = _load(raw, gone, big=True)
        except Exception as exc:  # a refusal (or a failure): the parse raises it in its turn
            self.error = exc

    def __len__(self) -> int:
        return self.size


#: A request body as a route's parse takes it: the bytes read, or those bytes already loaded as JSON.
Body = bytes | bytearray | LoadedBody


def _load(raw: Body, gone: Any = None, *, big: bool = False) -> Any:
    """A request body's JSON, in UTF-8, UTF-16 or UTF-32 (a BOM or none: RFC 4627's detection by the first bytes'
    zeros, what ``json.loads`` of bytes, so vLLM's FastAPI, reads); ``BadRequest`` for one that is not text in its
    encoding, nested too deeply, not JSON, or with a key given twice. A :class:`LoadedBody`: what loading it gave.

    ``gone`` (a :class:`kvload.serve.parse_gate.Departure`): once its ``left`` is set, the parse ends at its next step
    or integer with :class:`~pipeline.json_ints.Abandoned` (its client left: seconds of ``json.loads`` for no one).
    ``big``: a big body loaded ahead of its turn (:class:`LoadedBody`, whose owner wants the bytes no more): ``raw``, a
    bytearray, is cleared once decoded, so its bytes are not held beside the value being built, and each token id's
    int is shared (:class:`~pipeline.json_ints.SharedInts`: a parsed list of ids is ~1.3x its JSON, not ~5x)."""
    if isinstance(raw, LoadedBody):
        if raw.error is not None:
            raise raw.error
        return raw.value
    gone = gone if gone is not None else _Staying
    given = raw
    encoding = json.detect_encoding(raw)
    try:
        # decoded here, strictly (json.loads of bytes lets UTF-8-encoded surrogates through), then depth-checked as
        # UTF-8: the check reads bytes, and UTF-16's hide brackets in other characters ("\u2200" holds a quote byte:
        # 100,000 brackets passed as a string, then json's decoder raised RecursionError, a 500 with a traceback)
        text = raw.decode(encoding)  # straight from the bytearray: no bytes copy of up to 129 MiB first
    except UnicodeDecodeError as exc:
        name = encoding.upper().removesuffix("-SIG")
        raise BadRequest(f"the request body is not {name} text: byte 0x{raw[exc.start]:02x} at offset {exc.start:,} "
                         f"({exc.reason}); JSON request bodies must be UTF-8 (or UTF-16 or UTF-32)") from None
    if encoding not in ("utf-8", "utf-8-sig"):
        raw = text.encode("utf-8")  # strict decoding left no lone surrogate, so this cannot fail
    if gone.left:
        raise Abandoned("the request body's client left")
    if json_depth(raw) > MAX_DEPTH:  # before parsing: json's decoder recurses once per level
        raise BadRequest(f"the request body nests too deeply: at most {MAX_DEPTH} levels of arrays and objects "
                         "are accepted (an OpenAI request needs about 5)")
    if big and isinstance(given, bytearray):
        given.clear()  # its text is decoded: 1x the body less at the parse's peak
    del raw, given
    if gone.left:
        raise Abandoned("the request body's client left")
    # int() refuses a literal past sys.get_int_max_str_digits(): it was a 500 with Python's advice, then a line naming
    # no field; such a literal is kept as a marker and the first one's field named
    ints = SharedInts(gone) if big else LongInts()  # a small body's: no 2 MiB table for a few ints
    try:
        # json keeps the last of a key given twice: refused, as in config.json and audit files
        body = json.loads(text, object_pairs_hook=unique_keys(lambda m: BadRequest(f"the request body is ambiguous: "
                                                                                    f"{m}; keep one")), parse_int=ints)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    found = too_long_int(body) if ints.found else None
    if found is not None:
        where, digits = found
        raise BadRequest(f"{where or 'the request body'}: {too_long_message(digits)}; no field takes an integer past "
                         "2**63 - 1", param=where.split('.')[0].split('[')[0] or None)
    return body


class _Staying:
    """A client not watched (:func:`_load` with no ``gone``): never left."""

    left = False
