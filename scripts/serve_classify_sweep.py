"""Hostile-body sweep of the classifier and pooling routes: ``/classify`` (and its chat form, ``messages``) on a
3-label classifier, ``/score``, ``/rerank`` and ``/classify`` on a one-label cross-encoder, and ``/pooling`` (each
task, ``input`` and ``messages``) with ``/invocations`` naming a ``task``, on a 3-label classifier, a 5-label
``LlamaForTokenClassification`` (``/classify`` too) and a generative llama (tiny random checkpoints from
``tests/classify_support.py`` and ``tests/paged_support.py``).

Each field of each route's good body is given hostile JSON (wrong types, -1, 0, 2**63, 10**400, a lone surrogate,
empty and nested junk), plus a typo, an array body, a 3 MB input and 5,000 inputs. ``/pooling`` also gets every field
it reads (``task``, ``encoding_format``, ``truncate_prompt_tokens``, ``normalize``, ``use_activation``, the chat
template's) and odd inputs (negative, out-of-vocabulary and int64 ids, bools and floats as ids, nested junk, 10**6
ids, 100,000 words, malformed messages), and raw bodies (``NaN`` and ``Infinity`` literals, a duplicated key, 100,000
brackets, a body that is a list, a string, null or nothing, invalid UTF-8, UTF-16, a wrong or missing Content-Type).
Every route then takes 48 requests at once (``*.concurrency``): a third answered, each checked against the answer
alone, a third whose client resets the connection once the body is sent, a third mid-body; the record counts the
engine's steps meanwhile and the engine requests aborted (those of the clients that left, once the body was sent).

One JSON line a case: the status, the answer's start, whether the same route still answers the good body after, and
what the server still holds once it has (admission slots, engine requests, pooled rows; ``/load`` after the
concurrency case). A suspect: a status other than 200/400/404/413/415, a 4xx whose message is multi-line, a 400 that
names no ``param`` (but for ``body.*`` and ``array`` cases: the body itself is wrong), a hostile value that nothing
should take answered 200, a concurrent answer that is not a 200 or differs from the one alone, anything left behind,
or a server that no longer answers.

    python scripts/serve_classify_sweep.py --out /tmp/serve_classify.jsonl                     # 4 to 9 minutes
    python scripts/serve_classify_sweep.py --out /tmp/pool.jsonl --routes pooling --only concurrency
    python scripts/serve_classify_sweep.py --out /tmp/serve_classify.jsonl --summary          # the suspects of a run

Record (2-core VM shared with other helpers; the whole sweep, this script run on both trees, 2026-12-05):

    | tree | cases | suspects | of them /pooling, /invocations |
    |---|--:|--:|--:|
    | main at 0c452dc | 4,672 | 11 | 6 |
    | branch sweep38 | 4,672 | 0 | 0 |

    main's: every ``*.concurrency`` case of a classifier (/classify, its chat form, /score, /rerank, /pooling's
    classifier tasks, /invocations to /pooling): 500s, "the engine failed while embedding: ... the model's output
    projection ran 2 times in one forward" (the head over done requests' rows, run on another thread, counted by the
    engine's capture: fixed in ``engine.pooling``); and ``/invocations`` given ``{"task": ...}`` alone: "none of the
    fields that pick a route", no param (now ``/pooling``'s "input: required"). Nothing left behind, nothing hung.
    Judged fine and not flagged: a duplicated key's 400 names the key in its message but no param (the shared JSON
    reader's, as tests/test_serve.py asks), 100,000 brackets or 5,000 nested ones likewise (refused before parsing).
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import attrs

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

HOSTILE: dict[str, Any] = {
    "str": "abc", "float": 1.5, "bool": True, "none": None, "list": [1], "dict": {"a": 1}, "neg": -1, "zero": 0,
    "huge": 2 ** 63, "bignum": 10 ** 400, "surrogate": "\ud800", "empty_str": "", "empty_list": [],
    "nested": [{"a": [None]}], "nan_str": "NaN"}
FIELDS = ["model", "use_activation", "softmax", "truncate_prompt_tokens", "priority", "user", "encoding_format",
          "top_n", "dimensions", "additional_data", "normalize", "return_documents", "mm_processor_kwargs",
          "add_special_tokens", "request_id", "add_generation_prompt", "continue_final_message", "chat_template",
          "chat_template_kwargs"]


@attrs.frozen
class Raw:
    """A body sent as these bytes (not JSON-encoded), with this Content-Type (None: no header)."""

    data: bytes
    media: str | None = "application/json"

#: Pooling fields (``/pooling``'s and its chat form's) each given every hostile value.
POOL_FIELDS = ["input", "messages", "task", "model", "encoding_format", "truncate_prompt_tokens", "normalize",
               "use_activation", "softmax", "activation", "dimensions", "add_special_tokens", "priority", "user",
               "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
               "embed_dtype", "endianness", "request_id", "mm_processor_kwargs"]
#: ``input`` shapes: texts, token ids, lists of either, and what is neither.
POOL_INPUTS: dict[str, Any] = {
    "neg_ids": [-1, 5], "oov_ids": [5, 10 ** 6], "int64_ids": [2 ** 63 - 1], "bool_ids": [True, False],
    "float_ids": [1.0, 2.0], "str_ids": ["1", "2"], "mixed": ["w1", 5], "nested_ids": [[1, [2]]],
    "nested_none": [[None]], "nested_float": [[1.5]], "nested_str": [["w1"]], "empty_inner": [[]], "empty_text": [""],
    "list_of_dicts": [{"prompt": "w1"}], "prompt_dict": {"prompt": "w1"}, "ids_dict": {"prompt_token_ids": [1]},
    "deep": [[[1]]], "long_text": "w1 " * 100_000, "long_chars": "x" * 3_000_000, "many_ids": [[1]] * 5000,
    "million_ids": [1] * 10 ** 6, "oov_in_list": [[1, 2], [3, 10 ** 6]], "surrogate_in_list": ["w1", "w2 \ud800"],
    "nul": "w1\u0000w2", "whitespace": "   ", "over_len": " ".join(["w1"] * 65)}
#: ``messages`` shapes.
POOL_MESSAGES: dict[str, Any] = {
    "not_list": {"role": "user", "content": "w1"}, "str_items": ["w1"], "no_role": [{"content": "w1"}],
    "no_content": [{"role": "user"}], "int_content": [{"role": "user", "content": 5}],
    "bad_role": [{"role": "wizard", "content": "w1"}], "role_int": [{"role": 1, "content": "w1"}],
    "parts_bad": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    "parts_junk": [{"role": "user", "content": [{"type": 5}]}], "parts_text": [{"role": "user", "content": [
        {"type": "text", "text": "w1"}]}], "extra_key": [{"role": "user", "content": "w1", "zzz": 1}],
    "surrogate_content": [{"role": "user", "content": "w1 \ud800"}], "empty_items": [{}],
    "long_content": [{"role": "user", "content": "w1 " * 100_000}], "many": [{"role": "user", "content": "w1"}] * 5000,
    "tool_calls_junk": [{"role": "assistant", "content": "w1", "tool_calls": 5}]}
POOL_VALUES: dict[str, dict[str, Any]] = {
    "task": {"unknown": "zzz", "upper": "CLASSIFY", "spaced": " classify", "score": "score", "empty": "",
             "encode": "encode", "list_task": ["classify"], "generate": "generate", "reward": "reward"},
    "encoding_format": {"upper": "BASE64", "binary": "binary", "bytes_upper": "BYTES", "empty": ""},
    "embed_dtype": {"upper": "FLOAT16", "torch_name": "torch.float16", "fp8_bare": "fp8", "empty": ""},
    "endianness": {"upper": "BIG", "be": "be", "empty": ""},
    "truncate_prompt_tokens": {"neg2": -2, "minus1": -1, "one": 1, "float_int": 3.0, "huge_ok": 10 ** 6,
                               "int64": 2 ** 63 - 1, "past_int64": 2 ** 64, "true": True},
    "normalize": {"str_true": "true", "str_false": "false", "one": 1, "zero": 0},
    "use_activation": {"str_true": "true", "str_false": "false", "one": 1, "zero": 0},
    "priority": {"float_int": 1.0, "int64": 2 ** 63 - 1}}
#: Case names (their last part) whose value nothing should take: a 200 is a suspect.
NEVER_OK = {"neg_ids", "oov_ids", "int64_ids", "bool_ids", "nested_ids", "nested_none", "nested_float",
            "list_of_dicts", "deep", "oov_in_list", "surrogate_in_list", "nested", "not_list", "str_items",
            "no_role", "int_content", "role_int", "parts_junk", "empty_items", "surrogate_content", "unknown",
            "upper", "spaced", "list_task", "binary", "bytes_upper", "torch_name", "fp8_bare", "be", "neg2",
            "past_int64", "str_true", "str_false",
            "nan_lit", "inf_lit", "dup_keys", "dup_task", "surrogate_esc", "long_chars", "million_ids", "over_len",
            "long_text", "long_content", "tool_calls_junk", "int_ids_nan"}
def raw_bodies(good: dict[str, Any]) -> dict[str, Raw]:
    """The good body's bytes made hostile: NaN and infinities, a duplicated key, nesting past any limit, a body that
    is not an object, text that is not UTF-8, a wrong or missing Content-Type."""
    text = json.dumps(good)
    first = next(iter(good))
    inner = text[1:-1]
    return {
        f"{first}.nan_lit": Raw(f'{{"{first}": NaN}}'.encode()),
        "truncate_prompt_tokens.nan_lit": Raw(f'{{{inner}, "truncate_prompt_tokens": NaN}}'.encode()),
        "truncate_prompt_tokens.inf_lit": Raw(f'{{{inner}, "truncate_prompt_tokens": Infinity}}'.encode()),
        "priority.inf_lit": Raw(f'{{{inner}, "priority": -Infinity}}'.encode()),
        "input.int_ids_nan": Raw(b'{"input": [1, NaN, 2]}'),
        "normalize.nan_lit": Raw(f'{{{inner}, "normalize": NaN}}'.encode()),
        "body.dup_keys": Raw(f'{{{inner}, {inner}}}'.encode()),
        "body.dup_task": Raw(f'{{{inner}, "task": "classify", "task": "embed"}}'.encode()),
        "body.deep": Raw(("[" * 100_000 + "]" * 100_000).encode()),
        "body.deep_input": Raw(f'{{"{first}": {"[" * 5000}1{"]" * 5000}}}'.encode()),
        "body.list": Raw(f"[{text}]".encode()), "body.string": Raw(b'"w1 w2"'), "body.null": Raw(b"null"),
        "body.number": Raw(b"1"), "body.true": Raw(b"true"), "body.empty": Raw(b""), "body.spaces": Raw(b"   "),
        "body.truncated": Raw(text[:-3].encode()), "body.trailing": Raw(f"{text} {text}".encode()),
        "body.latin1": Raw(text.encode().replace(b"w1", b"w\xe91")),  # (bodies with text only)
        "body.utf16": Raw(text.encode("utf-16")), "body.bom": Raw(b"\xef\xbb\xbf" + text.encode()),
        "body.surrogate_esc": Raw(text.replace("w1", "w1\\udc00").encode()),  # (bodies with text only)
        "body.text_plain": Raw(text.encode(), "text/plain"), "body.no_type": Raw(text.encode(), None),
        "body.form": Raw(b"input=w1", "application/x-www-form-urlencoded"),
        "body.multipart": Raw(b"--x--", "multipart/form-data; boundary=x"),
        "body.json_charset": Raw(text.encode(), "application/json; charset=utf-8"),
        "body.vnd_json": Raw(text.encode(), "application/vnd.api+json"),
        "body.key_surrogate": Raw(f'{{{inner}, "\\ud800": 1}}'.encode()),
        "body.null_key": Raw(f'{{{inner}, "": 1}}'.encode()),
    }


def pooling_cases(good: dict[str, Any], first: str) -> dict[str, Any]:
    """Every hostile body of ``/pooling`` (or ``/invocations`` with a task) built from ``good``."""
    cases: dict[str, Any] = {f"{f}.{k}": {**good, f: v} for f in [*good, *POOL_FIELDS] for k, v in HOSTILE.items()
                             if not (f in ("input", "messages") and f != first)}
    if first == "input":
        cases.update({f"input.{k}": {**good, "input": v} for k, v in POOL_INPUTS.items()})
    else:
        cases.update({f"messages.{k}": {**good, "messages": v} for k, v in POOL_MESSAGES.items()})
    for field, values in POOL_VALUES.items():
        cases.update({f"{field}.{k}": {**good, field: v} for k, v in values.items()})
    cases.update({"typo": {**good, "normalise": True}, "extra": {**good, "zzz": 1}, "array": [good],
                  "both": {**good, "input": "w1", "messages": [{"role": "user", "content": "w1"}]},
                  "none_given": {k: v for k, v in good.items() if k not in ("input", "messages")}})
    cases.update({k: v for k, v in raw_bodies(good).items()
                  if "w1" in json.dumps(good) or k not in ("body.latin1", "body.surrogate_esc")})
    return cases


def _post(served: Any, path: str, body: Any) -> Any:
    """POST ``body`` as JSON text (a lone surrogate as its ``\\ud800`` escape, as a client's JSON carries it), or a
    :class:`Raw` body as its bytes."""
    if isinstance(body, Raw):
        return served.http.post(path, content=body.data, headers={} if body.media is None else
                                {"content-type": body.media})
    return served.http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def probe(served: Any, path: str, name: str, body: Any, good: dict[str, Any]) -> dict[str, Any]:
    """One hostile body, then the good one."""
    start = time.monotonic()
    try:
        r = _post(served, path, body)
        rec: dict[str, Any] = {"case": name, "status": r.status_code, "s": round(time.monotonic() - start, 3),
                               "body": r.text[:1200]}
    except Exception as e:  # a dropped connection: recorded
        rec = {"case": name, "status": None, "exc": f"{type(e).__name__}: {e}"[:300]}
    try:
        rec["still_ok"] = _post(served, path, good).status_code == 200
    except Exception as e:
        rec["still_ok"] = f"{type(e).__name__}: {e}"[:200]
    left = leftovers(served)
    if left:
        rec["left"] = left
    return rec


def leftovers(served: Any, wait: float = 5.0) -> str:
    """What the server still holds once every answer is in ('' when nothing): admission slots, engine requests,
    pooled rows (waited for up to ``wait`` seconds: a slot frees just after the answer's last byte)."""
    state = served.state
    engine = state.engine
    deadline = time.monotonic() + wait
    while True:
        snap = engine.snapshot()
        held = {"in_flight": state.in_flight, "running": snap["running"], "waiting": snap["waiting"],
                "live": len(engine._live), "pooled_rows": len(engine.executor.pooled._rows)}
        held = {k: v for k, v in held.items() if v}
        if not held or time.monotonic() > deadline:
            return ", ".join(f"{k}={v}" for k, v in held.items())
        time.sleep(0.02)


def suspect(r: dict[str, Any]) -> list[str]:
    """Why a result looks wrong ([] when it does not)."""
    why = []
    if r["status"] not in (200, 400, 404, 413, 415):
        why.append(f"status {r['status']}")
    if r["status"] is not None and 400 <= r["status"] < 500:
        try:
            error = json.loads(r["body"])["error"]
        except (ValueError, KeyError, TypeError):
            error = {"message": r["body"]}
        whole = r["case"].endswith(".array") or ".body." in r["case"]  # the body itself, not a field: no param
        if "\n" in str(error.get("message", "")) or (r["status"] == 400 and not error.get("param") and not whole):
            why.append(f"{r['status']} without one line naming a param")
    if r["status"] == 200 and r["case"].rsplit(".", 1)[-1] in NEVER_OK:
        why.append("a hostile value accepted")
    if r["still_ok"] is not True:
        why.append(f"server broken after: {r['still_ok']}")
    if r.get("left"):
        why.append(f"left behind: {r['left']}")
    return why


def concurrency(served: Any, path: str, good: dict[str, Any], name: str, n: int = 48) -> dict[str, Any]:
    """``n`` requests at once, a third answered, a third whose client hangs up once the body is sent (a reset), a
    third whose client hangs up mid-body; then nothing may be left: no admission slot (``/load``'s server_load 0),
    no engine request, no pooled row."""
    import socket
    import threading

    body = json.dumps({**good, **({"input": [[(7 * i + 5) % 500 + 1 for i in range(40)]] * 4}
                                  if "input" in good else {})}).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    statuses: list[Any] = []
    alone = _post(served, path, json.loads(body)).json()  # what each answer must give

    def one(i: int) -> None:
        try:
            if i % 3 == 0:
                r = _post(served, path, json.loads(body))
                statuses.append(r.status_code if r.status_code != 200 or _close(r.json(), alone)
                                else "wrong answer")
                return
            with socket.create_connection(("127.0.0.1", served.server.port), timeout=30) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                sock.sendall(head + (body if i % 3 == 1 else body[: len(body) // 2]))
                time.sleep(0.05 * (i % 5))
            statuses.append("gone")
        except Exception as e:
            statuses.append(f"{type(e).__name__}: {e}"[:100])

    engine = served.state.engine
    start, steps, aborted = time.monotonic(), engine.steps, _aborted(served)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    hung = sum(t.is_alive() for t in threads)
    left = leftovers(served, wait=30.0)
    load = served.http.get("/load").json()
    worst = next((st for st in statuses if st not in (200, "gone")), 200)  # a 5xx, a wrong answer, an exception
    rec: dict[str, Any] = {"case": name, "status": (worst if isinstance(worst, int) else str(worst)) if not hung
                           else None, "s": round(time.monotonic() - start, 3),
                           # the engine's work: its steps, and the engine requests aborted (those of clients that
                           # left; a pooling request's inputs ran to their end for no one before they were aborted)
                           "steps": engine.steps - steps, "aborted": int(_aborted(served) - aborted),
                           "body": json.dumps({"answers": dict(Counter(map(str, statuses))), "load": load})[:1200]}
    if hung:
        rec["exc"] = f"{hung} clients still waiting after 120 s"
    if load.get("server_load"):
        left = f"{left}, /load {load}".strip(", ")
    if left:
        rec["left"] = left
    try:
        rec["still_ok"] = _post(served, path, good).status_code == 200
    except Exception as e:
        rec["still_ok"] = f"{type(e).__name__}: {e}"[:200]
    return rec


def _aborted(served: Any) -> float:
    """The engine requests ended by an abort so far (``/metrics``' request_success, finished_reason abort)."""
    return sum(v for k, v in served.metrics().items()
               if "request_success" in k and "finished_reason=abort" in k and not k.endswith("_created"))


def _close(got: Any, want: Any, tol: float = 1e-4) -> bool:
    """Whether two answers' data (nested lists of floats, or base64 text) agree within ``tol``."""
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(_close(g, w, tol) for g, w in zip(got, want, strict=True))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(_close(got[k], want[k], tol) for k in got
                                               if k not in ("id", "created"))
    if isinstance(got, float) and isinstance(want, float):
        return abs(got - want) <= tol
    return bool(got == want)


def classify_routes(work: Path) -> list[tuple[Path, list[tuple[str, dict[str, Any]]]]]:
    """The classifier routes' checkpoints and good bodies."""
    from tests.classify_support import VOCAB, classifier_checkpoint
    from tests.llm_support import word_tokenizer

    cls = classifier_checkpoint(work / "cls", "llama", "LlamaForSequenceClassification", 3)
    tok = word_tokenizer(VOCAB)  # a chat template, for /classify's chat form
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(cls)
    ce = classifier_checkpoint(work / "ce", "qwen3", "Qwen3ForSequenceClassification", 1)
    chat = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]
    return [(cls, [("/classify", {"input": "w1 w2"}), ("/classify", {"messages": chat})]),
            (ce, [("/score", {"text_1": "w1", "text_2": "w2 w3"}),
                  ("/rerank", {"query": "w1", "documents": ["w2", "w3 w4"]}), ("/classify", {"input": "w1 w2"})])]


def pooling_routes(work: Path) -> list[tuple[Path, list[tuple[str, dict[str, Any]]]]]:
    """``/pooling`` (and ``/invocations`` naming a task) on a classifier and on a generative model."""
    from models.weights import random_model
    from tests.classify_support import VOCAB, classifier_checkpoint, token_classifier_checkpoint
    from tests.llm_support import word_tokenizer
    from tests.paged_support import tiny_config

    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
    cls = classifier_checkpoint(work / "pool_cls", "llama", "LlamaForSequenceClassification", 3)
    ner = token_classifier_checkpoint(work / "pool_ner", "llama", "LlamaForTokenClassification", 5)  # per-token labels
    gen = work / "pool_gen"
    random_model(tiny_config("llama"), device="cpu", dtype="float32", seed=0).save_pretrained(gen)
    for path in (cls, ner, gen):
        tok = word_tokenizer(VOCAB)
        tok.chat_template = template
        tok.save_pretrained(path)
    chat = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]
    return [(cls, [("/pooling", {"input": "w1 w2"}), ("/pooling", {"messages": chat, "task": "classify"}),
                   ("/pooling", {"input": [5, 6], "task": "classify"}),
                   ("/invocations", {"input": "w1 w2", "task": "token_classify"})]),
            (ner, [("/pooling", {"input": "w1 w2"}), ("/pooling", {"messages": chat, "task": "classify"}),
                   ("/classify", {"input": "w1 w2"}), ("/invocations", {"input": "w1 w2", "task": "token_classify"})]),
            (gen, [("/pooling", {"input": "w1 w2"}), ("/pooling", {"messages": chat, "task": "embed"}),
                   ("/pooling", {"input": [5, 6], "task": "embed"}),
                   ("/invocations", {"input": "w1 w2", "task": "token_embed"})])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="results, one JSON line a case")
    ap.add_argument("--routes", choices=("all", "classify", "pooling"), default="all",
                    help="classify: /classify, /score, /rerank; pooling: /pooling and /invocations naming a task")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    ap.add_argument("--summary", action="store_true", help="print the suspects of --out and stop")
    a = ap.parse_args()
    if a.summary:
        summary([json.loads(line) for line in a.out.read_text().splitlines() if line.strip()])
        return
    from tests.serve_support import serving

    work = Path(tempfile.mkdtemp(prefix="serve_classify_sweep-"))
    # the checkpoints go with the run (every earlier run left its folder in /tmp)
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    routes = []
    if a.routes in ("all", "classify"):
        routes += [(ckpt, bodies, False) for ckpt, bodies in classify_routes(work)]
    if a.routes in ("all", "pooling"):
        routes += [(ckpt, bodies, True) for ckpt, bodies in pooling_routes(work)]
    rows = []
    with a.out.open("w") as out:
        def record(rec: dict[str, Any]) -> None:
            rows.append(rec)
            out.write(json.dumps(rec) + "\n")
            out.flush()

        for ckpt, bodies, pooling in routes:
            chunked = {"max_num_tokens": 16} if pooling else {}  # a prompt's rows over several steps
            with serving(str(ckpt), dtype="float32", max_seq_len=64, **chunked,
                         kv_cache_config={"max_tokens": 512, "tokens_per_block": 4}) as served:
                for path, good in bodies:
                    first = next(iter(good))
                    if pooling:
                        cases = pooling_cases(good, first)
                    else:
                        cases = {f"{f}.{k}": {**good, f: v} for f in [*good, *FIELDS] for k, v in HOSTILE.items()}
                        cases.update({f"{first}.list_surrogate": {**good, first: ["w1", "w2 \ud800"]},
                                      "typo": {**good, "use_activaton": False}, "array": [good],
                                      "million": {**good, first: [1] * 10 ** 6},
                                      "many": {**good, first: ["w1"] * 5000}})
                    tag = f"{ckpt.name}{path}.{first}" + (f"({good['task']})" if "task" in good else "")
                    for name, body in cases.items():
                        if a.only in f"{tag}.{name}":
                            record(probe(served, path, f"{tag}.{name}", body, good))
                    if a.only in f"{tag}.concurrency":
                        record(concurrency(served, path, good, f"{tag}.concurrency"))
    summary(rows)


def summary(rows: list[dict[str, Any]]) -> None:
    bad = [(r, suspect(r)) for r in rows if suspect(r)]
    print(f"{len(rows)} cases, {len(bad)} suspects")
    for r, why in bad:
        print(f"{r['case']}: {'; '.join(why)} -- {r.get('body', r.get('exc', ''))[:160]!r}")


if __name__ == "__main__":
    main()
