"""Hostile-body sweep of the classifier routes: ``/classify`` (and its chat form, ``messages``) on a 3-label
classifier, ``/score``, ``/rerank`` and ``/classify`` on a one-label cross-encoder (tiny random checkpoints from
``tests/classify_support.py``).

Each field of each route's good body is given hostile JSON (wrong types, -1, 0, 2**63, 10**400, a lone surrogate,
empty and nested junk), plus a typo, an array body, a 3 MB input and 5,000 inputs. One JSON line a case: the status,
the answer's start, and whether the same route still answers the good body after. A suspect: a status other than
200/400/404/413, a 400 whose message is multi-line or names no ``param``, or a server that no longer answers.

    python scripts/serve_classify_sweep.py --out /tmp/serve_classify.jsonl   # about a minute
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


def _post(served: Any, path: str, body: Any) -> Any:
    """POST ``body`` as JSON text (a lone surrogate as its ``\\ud800`` escape, as a client's JSON carries it)."""
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
    return rec


def suspect(r: dict[str, Any]) -> list[str]:
    """Why a result looks wrong ([] when it does not)."""
    why = []
    if r["status"] not in (200, 400, 404, 413):
        why.append(f"status {r['status']}")
    if r["status"] == 400:
        error = json.loads(r["body"])["error"] if r["body"].endswith("}") else {}
        if "\n" in error.get("message", "") or (not error.get("param") and not r["case"].endswith(".array")):
            why.append("400 without one line naming a param")
    if r["still_ok"] is not True:
        why.append(f"server broken after: {r['still_ok']}")
    return why


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="results, one JSON line a case")
    a = ap.parse_args()
    from tests.classify_support import VOCAB, classifier_checkpoint
    from tests.llm_support import word_tokenizer
    from tests.serve_support import serving

    work = Path(tempfile.mkdtemp(prefix="serve_classify_sweep-"))
    cls = classifier_checkpoint(work / "cls", "llama", "LlamaForSequenceClassification", 3)
    tok = word_tokenizer(VOCAB)  # a chat template, for /classify's chat form
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(cls)
    ce = classifier_checkpoint(work / "ce", "qwen3", "Qwen3ForSequenceClassification", 1)
    chat = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]
    routes = ((cls, [("/classify", {"input": "w1 w2"}), ("/classify", {"messages": chat})]),
              (ce, [("/score", {"text_1": "w1", "text_2": "w2 w3"}),
                    ("/rerank", {"query": "w1", "documents": ["w2", "w3 w4"]}), ("/classify", {"input": "w1 w2"})]))
    rows = []
    with a.out.open("w") as out:
        for ckpt, bodies in routes:
            with serving(str(ckpt), dtype="float32", max_seq_len=64,
                         kv_cache_config={"max_tokens": 512, "tokens_per_block": 4}) as served:
                for path, good in bodies:
                    first = next(iter(good))
                    cases = {f"{f}.{k}": {**good, f: v} for f in [*good, *FIELDS] for k, v in HOSTILE.items()}
                    cases.update({f"{first}.list_surrogate": {**good, first: ["w1", "w2 \ud800"]},
                                  "typo": {**good, "use_activaton": False}, "array": [good],
                                  "million": {**good, first: [1] * 10 ** 6}, "many": {**good, first: ["w1"] * 5000}})
                    for name, body in cases.items():
                        rec = probe(served, path, f"{ckpt.name}{path}.{first}.{name}", body, good)
                        rows.append(rec)
                        out.write(json.dumps(rec) + "\n")
                        out.flush()
    bad = [(r, suspect(r)) for r in rows if suspect(r)]
    print(f"{len(rows)} cases, {len(bad)} suspects")
    for r, why in bad:
        print(f"{r['case']}: {'; '.join(why)} -- {r.get('body', r.get('exc', ''))[:160]!r}")


if __name__ == "__main__":
    main()
