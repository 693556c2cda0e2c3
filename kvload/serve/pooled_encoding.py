"""How ``/v1/embeddings`` and ``/pooling`` encode their vectors, as vLLM's ``EncodingRequestMixin`` asks for them.

``encoding_format`` ``"float"`` (the default) answers lists of floats; ``"base64"`` each input's values cast to
``embed_dtype`` and laid out in ``endianness``, row after row, in base64 (OpenAI's client asks for it, with vLLM's
defaults ``float32`` and ``native``: the float32 values' bytes in the server's byte order, little-endian on every
machine kvload runs on); ``"bytes"`` answers those bytes raw, every input's one after another, as
``application/octet-stream`` with a ``metadata`` header holding vLLM's JSON of where each input's bytes are
(``{"id", "created", "model", "data": [{"index", "embed_dtype", "endianness", "start", "end", "shape"}], "usage":
{"prompt_tokens", "total_tokens"}}``, vLLM's ``encode_pooling_bytes``); ``"bytes_only"`` the same bytes with no
header. The names, defaults and byte layout are vLLM's (``vllm.utils.serial_utils``: ``EMBED_DTYPES``,
``tensor2binary``), so its client code (``binary2tensor``, ``decode_pooling_output``) reads kvload's answer as it
reads vLLM's. ``bfloat16`` travels as the bfloat16's two bytes, ``fp8_e4m3`` (``torch.float8_e4m3fn``) and ``fp8_e5m2``
as one byte each; ``embed_dtype`` and ``endianness`` are checked but do nothing to a ``"float"`` answer (vLLM's).
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any

import attrs
import torch
from fastapi.responses import Response

from kvload.serve.protocol import _need

#: vLLM's ``EMBED_DTYPES``: each ``embed_dtype``'s torch dtype, and the dtype of the same width its bytes are read
#: through (numpy has no bfloat16 or fp8: their bytes are taken as float16 and uint8, as vLLM takes them).
EMBED_DTYPES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "float32": (torch.float32, torch.float32),
    "float16": (torch.float16, torch.float16),
    "bfloat16": (torch.bfloat16, torch.float16),
    "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8),
    "fp8_e5m2": (torch.float8_e5m2, torch.uint8),
}
#: vLLM's ``Endianness``: ``native`` is the server's own byte order (``sys.byteorder``).
ENDIANNESS = ("native", "big", "little")
#: vLLM's ``EncodingFormat``.
ENCODING_FORMATS = ("float", "base64", "bytes", "bytes_only")
#: The binary formats: the answer is the bytes, not JSON.
BINARY_FORMATS = ("bytes", "bytes_only")


def _choices(values: tuple[str, ...] | dict[str, Any]) -> str:
    names = [f'"{v}"' for v in values]
    return f"one of {', '.join(names[:-1])} or {names[-1]}"


@attrs.frozen
class Encoding:
    """A body's ``encoding_format``, ``embed_dtype`` and ``endianness`` (vLLM's defaults: float, float32, native)."""

    format: str = "float"
    dtype: str = "float32"
    endianness: str = "native"

    @property
    def binary(self) -> bool:
        """Whether the answer is the raw bytes (``bytes``, ``bytes_only``), not JSON."""
        return self.format in BINARY_FORMATS


#: A body that names none of the three.
FLOAT = Encoding()


def encoding_of(body: dict[str, Any]) -> Encoding:
    """The body's encoding, each field checked: a 400 naming it and the values vLLM takes otherwise."""
    values = {}
    for field, accepted, default in (("encoding_format", ENCODING_FORMATS, "float"),
                                     ("embed_dtype", tuple(EMBED_DTYPES), "float32"),
                                     ("endianness", ENDIANNESS, "native")):
        value = body.get(field)
        _need(value is None or (isinstance(value, str) and value in accepted), field, _choices(accepted), value)
        values[field] = default if value is None else value
    return Encoding(values["encoding_format"], values["embed_dtype"], values["endianness"])


def pooled_bytes(data: torch.Tensor, dtype: str = "float32", endianness: str = "native") -> bytes:
    """vLLM's ``tensor2binary``: ``data``'s values cast to ``dtype``, flattened (row after row), in ``endianness``."""
    cast, view = EMBED_DTYPES[dtype]
    array = data.to(cast).flatten().contiguous().view(view).numpy()
    if endianness not in ("native", sys.byteorder):
        array = array.byteswap()
    return array.tobytes()


def base64_floats(data: torch.Tensor, dtype: str = "float32", endianness: str = "native") -> str:
    """:func:`pooled_bytes` in base64: OpenAI's and vLLM's base64 encoding (float32, the server's byte order, by
    default)."""
    return base64.b64encode(pooled_bytes(data, dtype, endianness)).decode("ascii")


def bytes_response(encoding: Encoding, outputs: list[torch.Tensor], head: dict[str, Any],
                   prompt_tokens: int) -> Response:
    """vLLM's answer to ``bytes`` / ``bytes_only``: every output's bytes one after another, and for ``bytes`` the
    ``metadata`` header, vLLM's JSON of the answer's ``id``, ``created``, ``model``, each output's place and shape in
    the body (``data``) and ``usage``."""
    parts: list[bytes] = []
    items = []
    at = 0
    for index, output in enumerate(outputs):
        part = pooled_bytes(output, encoding.dtype, encoding.endianness)
        items.append({"index": index, "embed_dtype": encoding.dtype, "endianness": encoding.endianness,
                      "start": at, "end": at + len(part), "shape": list(output.shape)})
        parts.append(part)
        at += len(part)
    headers = None
    if encoding.format == "bytes":  # json.dumps as vLLM writes it (ASCII: a header's text)
        headers = {"metadata": json.dumps({**head, "data": items,
                                           "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})}
    return Response(b"".join(parts), media_type="application/octet-stream", headers=headers)


__all__ = ["BINARY_FORMATS", "EMBED_DTYPES", "ENCODING_FORMATS", "ENDIANNESS", "FLOAT", "Encoding", "base64_floats",
           "bytes_response", "encoding_of", "pooled_bytes"]
