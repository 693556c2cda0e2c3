"""vLLM's encoding fields on ``POST /v1/embeddings`` and ``POST /pooling``: ``embed_dtype`` (float32, float16,
bfloat16, fp8_e4m3, fp8_e5m2) and ``endianness`` (native, big, little) for base64, decoded here as vLLM's
``binary2tensor`` decodes them and checked against the float answer; ``encoding_format`` ``bytes`` (the raw bytes and
vLLM's ``metadata`` header locating each input) and ``bytes_only``; ``request_id`` and the ``X-Request-Id`` header in
the answer's id; a value kvload cannot honour a one-line 400 naming the field; ``/invocations`` forwarding them; the
openai client's base64 unchanged."""

from __future__ import annotations

import base64
import json
import re
import sys

import numpy as np
import pytest
import torch

from tests.llm_support import with_tokenizer
from tests.serve_support import serving, wait_for

VOCAB = 512
PROMPTS = [[5, 17, 300, 42, 9, 11, 23], [88, 123, 7]]
HIDDEN = 64  # the tiny llama's
#: each embed_dtype: its torch dtype, the numpy type of its bytes (numpy has no bfloat16 or fp8), its relative
#: precision (half the gap between 1 and the next value) plus the smallest normal's magnitude it rounds by
DTYPES = {"float32": (torch.float32, "f4", 2 ** -24, 0.0), "float16": (torch.float16, "f2", 2 ** -11, 2 ** -24),
          "bfloat16": (torch.bfloat16, "u2", 2 ** -8, 0.0), "fp8_e4m3": (torch.float8_e4m3fn, "u1", 2 ** -4, 2 ** -9),
          "fp8_e5m2": (torch.float8_e5m2, "u1", 2 ** -3, 2 ** -16)}
ENDIANNESS = ("native", "big", "little")


def decode(raw: bytes, embed_dtype: str, endianness: str, shape: tuple[int, ...]) -> torch.Tensor:
    """vLLM's ``binary2tensor``, written out: the bytes read in their byte order, viewed as ``embed_dtype``."""
    dtype, code, _, _ = DTYPES[embed_dtype]
    order = {"native": "=", "big": ">", "little": "<"}[endianness]
    array = np.frombuffer(raw, dtype=np.dtype(order + code)).astype("=" + code).reshape(shape)
    if code == "u2":  # bfloat16: its two bytes, as a 16-bit integer viewed as bfloat16
        return torch.from_numpy(array.view(np.int16).copy()).view(dtype).float()
    return torch.from_numpy(array.copy()).view(dtype).float()


def close_in(embed_dtype: str, got: torch.Tensor, floats: list) -> None:
    """``got`` is the float answer cast to ``embed_dtype`` (exactly), so within that dtype's rounding of it."""
    want = torch.tensor(floats, dtype=torch.float32)
    dtype, _, rel, tiny = DTYPES[embed_dtype]
    assert torch.equal(got, want.to(dtype).float())
    assert torch.all((got - want).abs() <= want.abs() * rel + tiny)
    if embed_dtype == "float32":
        assert torch.equal(got, want)


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory):
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path_factory.mktemp("enc") / "ckpt", VOCAB)
    with serving(str(words), dtype="float32", max_seq_len=64, kv_cache_config={"max_tokens": 512,
                                                                               "tokens_per_block": 4}) as s:
        yield s


def _ok(served, path: str, body: dict, **kwargs) -> dict:
    r = served.http.post(path, json=body, **kwargs)
    assert r.status_code == 200, r.text
    return r.json()


def test_base64_in_every_embed_dtype_and_endianness_is_the_float_answer_in_that_dtype(served):
    """Each (embed_dtype, endianness): /v1/embeddings' vectors and /pooling's per-token rows (token_embed, row after
    row) decode, as vLLM's client decodes them, to the float answer cast to that dtype, within its precision; big and
    little are each other's bytes reversed per value (one-byte fp8 alike), native the server's own order."""
    floats = _ok(served, "/v1/embeddings", {"input": PROMPTS})["data"]
    rows = _ok(served, "/pooling", {"input": PROMPTS[1]})["data"][0]["data"]
    assert np.array(rows).shape == (len(PROMPTS[1]), HIDDEN)
    for embed_dtype, (dtype, _, _, _) in DTYPES.items():
        raw = {}
        for endianness in ENDIANNESS:
            fields = {"encoding_format": "base64", "embed_dtype": embed_dtype, "endianness": endianness}
            doc = _ok(served, "/v1/embeddings", {"input": PROMPTS, **fields})
            for got, want in zip(doc["data"], floats, strict=True):
                assert got["index"] == want["index"] and got["object"] == "embedding"
                close_in(embed_dtype, decode(base64.b64decode(got["embedding"]), embed_dtype, endianness, (HIDDEN,)),
                         want["embedding"])
            raw[endianness] = base64.b64decode(doc["data"][0]["embedding"])
            assert len(raw[endianness]) == HIDDEN * dtype.itemsize
            pooled = _ok(served, "/pooling", {"input": PROMPTS[1], "task": "token_embed", **fields})["data"][0]
            close_in(embed_dtype, decode(base64.b64decode(pooled["data"]), embed_dtype, endianness,
                                         (len(PROMPTS[1]), HIDDEN)), rows)
        assert raw["native"] == raw[sys.byteorder]
        size = dtype.itemsize
        swapped = b"".join(raw["big"][i:i + size][::-1] for i in range(0, len(raw["big"]), size))
        assert swapped == raw["little"]


def test_bytes_answers_the_raw_bytes_with_vllms_metadata_header_and_bytes_only_without_it(served):
    """encoding_format bytes: application/octet-stream, every input's bytes one after another, and a metadata header
    of vLLM's JSON (id, created, model, each input's index, embed_dtype, endianness, start, end and shape, usage) by
    which vLLM's decode_pooling_output finds each; bytes_only the same bytes without the header; /pooling's per-token
    rows as one (tokens, hidden) item each."""
    floats = _ok(served, "/v1/embeddings", {"input": PROMPTS})["data"]
    fields = {"input": PROMPTS, "encoding_format": "bytes", "embed_dtype": "float16", "endianness": "big"}
    r = served.http.post("/v1/embeddings", json=fields)
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream", r.text
    meta = json.loads(r.headers["metadata"])
    assert set(meta) == {"id", "created", "model", "data", "usage"}
    assert meta["id"].startswith("embd-") and meta["model"] == served.state.model_name
    tokens = sum(map(len, PROMPTS))
    assert meta["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert meta["data"] == [{"index": i, "embed_dtype": "float16", "endianness": "big", "start": i * HIDDEN * 2,
                             "end": (i + 1) * HIDDEN * 2, "shape": [HIDDEN]} for i in range(2)]
    assert len(r.content) == meta["data"][-1]["end"]
    for item, want in zip(meta["data"], floats, strict=True):
        got = decode(r.content[item["start"]:item["end"]], item["embed_dtype"], item["endianness"],
                     tuple(item["shape"]))
        close_in("float16", got, want["embedding"])
    only = served.http.post("/v1/embeddings", json={**fields, "encoding_format": "bytes_only"})
    assert only.status_code == 200 and "metadata" not in only.headers
    assert only.headers["content-type"] == "application/octet-stream" and only.content == r.content

    rows = [_ok(served, "/pooling", {"input": ids})["data"][0]["data"] for ids in PROMPTS]
    r = served.http.post("/pooling", json={"input": PROMPTS, "encoding_format": "bytes"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream", r.text
    meta = json.loads(r.headers["metadata"])
    assert meta["id"].startswith("pooling-") and meta["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert [m["shape"] for m in meta["data"]] == [[len(ids), HIDDEN] for ids in PROMPTS]
    assert [(m["embed_dtype"], m["endianness"]) for m in meta["data"]] == [("float32", "native")] * 2
    for item, want in zip(meta["data"], rows, strict=True):
        close_in("float32", decode(r.content[item["start"]:item["end"]], "float32", "native", tuple(item["shape"])),
                 want)
    last = served.http.post("/pooling", json={"input": PROMPTS[0], "task": "embed", "encoding_format": "bytes_only",
                                              "embed_dtype": "bfloat16", "endianness": "little"})
    assert last.status_code == 200 and "metadata" not in last.headers
    close_in("bfloat16", decode(last.content, "bfloat16", "little", (HIDDEN,)), floats[0]["embedding"])


def test_an_x_request_id_header_names_the_answer(served):
    """vLLM's: the answer's id is embd- / pooling- (vLLM's ServingPooling.request_id_prefix; kvload said pool-, as
    vLLM's older serving did) and the X-Request-Id header, in the JSON and in bytes' metadata alike; none: a fresh id
    each time."""
    header = {"X-Request-Id": "from-header"}
    assert _ok(served, "/v1/embeddings", {"input": "w5"}, headers=header)["id"] == "embd-from-header"
    assert _ok(served, "/pooling", {"input": "w5"}, headers=header)["id"] == "pooling-from-header"
    r = served.http.post("/v1/embeddings", json={"input": "w5", "encoding_format": "bytes"}, headers=header)
    assert json.loads(r.headers["metadata"])["id"] == "embd-from-header"
    r = served.http.post("/pooling", json={"input": "w5", "encoding_format": "bytes"}, headers=header)
    assert json.loads(r.headers["metadata"])["id"] == "pooling-from-header"
    fresh = {_ok(served, "/v1/embeddings", {"input": "w5"})["id"] for _ in range(2)}
    assert len(fresh) == 2 and all(i.startswith("embd-") for i in fresh)
    fresh = {_ok(served, "/pooling", {"input": "w5"})["id"] for _ in range(2)}
    assert len(fresh) == 2 and all(re.fullmatch("pooling-[0-9a-f]{32}", i) for i in fresh), fresh


@pytest.mark.parametrize(("path", "prefix"), [("/v1/embeddings", "embd-"), ("/pooling", "pooling-")])
def test_a_body_request_id_is_taken_unused_as_vllm_does_and_said(served, path, prefix):
    """vLLM's /v1/embeddings and /pooling accept request_id in the body and name their answer by the X-Request-Id
    header alone, else a fresh id (PoolingServingBase._init_ctx); kvload named an embeddings answer
    embd-<request_id>, as no vLLM server now does. The body's id is taken, unused, and a setting_ignored naming the
    answer says to send the header."""
    mine, raw, body = (f"{path}-{n}" for n in ("mine", "raw", "body"))
    answers = [_ok(served, path, {"input": "w5", "request_id": mine}) for _ in range(2)]
    ids = [a["id"] for a in answers]
    assert all(i.startswith(prefix) and i != prefix + mine for i in ids) and ids[0] != ids[1]
    r = served.http.post(path, json={"input": "w5", "request_id": raw, "encoding_format": "bytes"})
    assert r.status_code == 200 and json.loads(r.headers["metadata"])["id"] not in (prefix + raw, *ids)
    named = _ok(served, path, {"input": "w5", "request_id": body}, headers={"X-Request-Id": f"hdr{path}"})
    assert named["id"] == f"{prefix}hdr{path}"
    r = served.http.post(path, json={"input": "w5", "request_id": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"  # still checked

    def said() -> dict[str, dict]:
        return {e["request"]: e for e in served.result.audit.of("setting_ignored")
                if e["field"] == "serve.request_id" and e["value"].startswith(path)}

    wait_for(lambda: len(said()) == 4, what="one setting_ignored per request with a request_id")
    note = said()[ids[0]]
    assert note["value"] == mine and f"POST {path} names its answer by the X-Request-Id header alone" in note["reason"]
    assert note["reason"].endswith(f"send X-Request-Id to name it (request {ids[0]})")
    assert said()[f"{prefix}hdr{path}"]["value"] == body


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
@pytest.mark.parametrize(("field", "value", "says"), [
    pytest.param("embed_dtype", "int8", 'embed_dtype: expected one of "float32", "float16", "bfloat16", "fp8_e4m3" '
                 'or "fp8_e5m2", got \'int8\'', id="dtype"),
    pytest.param("embed_dtype", 16, 'embed_dtype: expected one of "float32"', id="dtype-int"),
    pytest.param("endianness", "middle", 'endianness: expected one of "native", "big" or "little", got \'middle\'',
                 id="endianness"),
    pytest.param("encoding_format", "hex", 'encoding_format: expected one of "float", "base64", "bytes" or '
                 "\"bytes_only\", got 'hex'", id="format"),
    pytest.param("request_id", 7, "request_id: expected a printable string", id="request_id"),
])
def test_an_encoding_kvload_cannot_honour_is_a_one_line_400_naming_the_field(served, path, field, value, says):
    r = served.http.post(path, json={"input": "w5", field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and says in error["message"] and "\n" not in error["message"], error


def test_invocations_forwards_the_encoding_fields_and_request_id(served):
    """/invocations answers an input body as /v1/embeddings and a task body as /pooling, with their encoding; the
    X-Request-Id header names the answer there too (the body's request_id taken unused, as vLLM's)."""
    body = {"input": PROMPTS[1], "encoding_format": "bytes", "embed_dtype": "fp8_e4m3", "request_id": "unused"}
    header = {"X-Request-Id": "inv"}
    via = served.http.post("/invocations", json=body, headers=header)
    own = served.http.post("/v1/embeddings", json=body, headers=header)
    assert via.status_code == own.status_code == 200, via.text
    assert via.content == own.content and json.loads(via.headers["metadata"])["id"] == "embd-inv"
    task = {"input": PROMPTS[1], "task": "embed", "encoding_format": "base64", "embed_dtype": "float16",
            "endianness": "big"}
    assert _ok(served, "/invocations", task)["data"] == _ok(served, "/pooling", task)["data"]
    r = served.http.post("/invocations", json={"input": "w5", "embed_dtype": "fp4"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "embed_dtype", r.text


def test_openais_client_still_reads_base64_and_its_extra_body_takes_vllms_fields(served):
    """The openai client's default (it asks for base64 and decodes it as little-endian float32) and its explicit
    base64 (the string, decoded here as OpenAI documents it) are the float answer exactly; vLLM's request_id and
    embed_dtype through extra_body are taken (request_id unused, as vLLM's: extra_headers' X-Request-Id names the
    answer)."""
    model = served.state.model_name
    floats = served.client.embeddings.create(model=model, input=PROMPTS, encoding_format="float")
    default = served.client.embeddings.create(model=model, input=PROMPTS, extra_body={"request_id": "oai"})
    named = served.client.embeddings.create(model=model, input=PROMPTS, extra_headers={"X-Request-Id": "oai"})
    explicit = served.client.embeddings.create(model=model, input=PROMPTS, encoding_format="base64",
                                               extra_body={"embed_dtype": "float32", "endianness": "little"})
    assert default.id != "embd-oai" and default.id.startswith("embd-") and explicit.id.startswith("embd-")
    assert named.id == "embd-oai" and named.data == default.data
    for mine, theirs, want in zip(default.data, explicit.data, floats.data, strict=True):
        assert mine.embedding == want.embedding
        assert np.frombuffer(base64.b64decode(theirs.embedding), dtype="<f4").tolist() == want.embedding
