"""Tamper evidence for audit files: a hash chain over the records, optionally keyed (HMAC).

Writing: the header names the chain (``"chain": "sha256"``, or ``"hmac-sha256"`` when
``KVLOAD_AUDIT_KEY`` is set); every later record carries ``prev``, the link of the record before
it; the last record also carries ``chain_head``, its own link, which seals the file. A link is
``H(canonical JSON of the record without chain_head)``, ``H`` being SHA-256 or HMAC-SHA-256 with
the key. Canonical JSON (sorted keys, no spaces) makes the chain about values, not formatting.

What each kind proves, and what ``audit --verify`` reports:

* ``sha256``: no record was edited, removed, inserted or reordered, and the file was not cut
  short, *unless whoever changed it recomputed the chain* (anyone can: there is no secret).
* ``hmac-sha256``: the same, and the file was written by a holder of the key; nobody without
  the key can recompute the chain.
* ``none``: a log from before chaining (or one whose chain was stripped); only the replay checks
  of ``--verify`` apply. With ``KVLOAD_AUDIT_KEY`` set, such a log does not verify.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

KEY_ENV = "KVLOAD_AUDIT_KEY"
PREV, HEAD = "prev", "chain_head"


def audit_key() -> bytes | None:
    """The HMAC key from ``KVLOAD_AUDIT_KEY``, its bytes as the environment holds them (None when unset or empty)."""
    key = os.environ.get(KEY_ENV, "")
    # fsencode gives back the bytes Python decoded the variable from: a key that is not UTF-8 (random bytes) stood for
    # itself no less, but encode("utf-8") failed on its escapes, every command that writes or verifies an audit exiting
    # 1 with "UnicodeEncodeError: ... surrogates not allowed", naming no variable. A UTF-8 key's bytes are unchanged.
    return os.fsencode(key) if key else None


def canonical(record: dict[str, Any]) -> bytes:
    """The bytes a link is computed over: sorted keys, no whitespace, ``chain_head`` left out.

    A lone surrogate (a request's JSON ``"\\ud800"`` the server records) is encoded as its three bytes
    (``surrogatepass``): strict UTF-8 raised on it, so the record was never linked, the record before it was written
    twice and the served audit did not verify."""
    body = {k: v for k, v in record.items() if k != HEAD}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return text.encode("utf-8", "surrogatepass")


class Chain:
    """The running link of a chain of records; ``kind`` is ``sha256`` or ``hmac-sha256``."""

    def __init__(self, key: bytes | None) -> None:
        self.key = key
        self.kind = "hmac-sha256" if key else "sha256"
        self.head: str | None = None

    def link(self, record: dict[str, Any]) -> str:
        """The link of one record (as it is written, ``prev`` included); it becomes the head."""
        data = canonical(record)
        digest = hmac.new(self.key, data, hashlib.sha256).hexdigest() if self.key else hashlib.sha256(data).hexdigest()
        self.head = digest
        return digest


def check_chain(header: dict[str, Any], records: list[tuple[int, dict[str, Any]]],
                key: bytes | None) -> dict[str, Any]:
    """Check the chain of a file's records (line number, record; header not included).

    Returns ``{"kind", "checked", "ok", "problem", "guarantee"}``: ``kind`` from the header
    (``none`` without one), ``checked`` whether the links could be recomputed (an HMAC chain needs
    the key), ``problem`` the first break, and ``guarantee`` one sentence on what was proved.
    """
    check = ChainCheck(header, key)
    for line, record in records:
        check.add(line, record)
    return check.verdict()


class ChainCheck:
    """:func:`check_chain` one record at a time, holding only the last record (a file is read as a stream)."""

    def __init__(self, header: dict[str, Any], key: bytes | None) -> None:
        self.header = header
        kind = header.get("chain")
        self._early: dict[str, Any] | None = None  # the verdict when the header alone decides it
        if kind is None:
            problem = (f"{KEY_ENV} is set but this log has no hash chain (written before chaining, or stripped): "
                       "its origin cannot be proved") if key else None
            self._early = {"kind": "none", "checked": False, "ok": problem is None, "problem": problem,
                           "guarantee": "no chain: this log predates hash chaining (or its chain was stripped); "
                                        "only the replay was checked"}
        elif kind not in ("sha256", "hmac-sha256"):
            self._early = {"kind": str(kind), "checked": False, "ok": False,
                           "problem": f"unknown chain kind {kind!r}", "guarantee": "none"}
        elif kind == "hmac-sha256" and key is None:
            self._early = {"kind": kind, "checked": False, "ok": False,
                           "problem": f"the log is signed (hmac-sha256); set {KEY_ENV} to the key it was written "
                                      "with", "guarantee": "not checked: no key"}
        elif kind == "sha256" and key is not None:
            self._early = {"kind": kind, "checked": False, "ok": False,
                           "problem": f"{KEY_ENV} is set but this log was written without a key (sha256 chain): "
                                      "its origin cannot be proved", "guarantee": "not checked: unsigned log"}
        self.kind = kind
        self.chain = Chain(key if kind == "hmac-sha256" else None)
        if self._early is None:
            self.chain.link(header)
        self.problem: str | None = None
        self._held: tuple[int, dict[str, Any]] | None = None  # a record is checked once it is known not to be last
        self._any = False

    def add(self, line: int, record: dict[str, Any]) -> None:
        """The next record after the header, with its line number."""
        if self._early is not None:
            return
        self._any = True
        if self._held is not None and self.problem is None:
            self._check(*self._held, last=False)
        self._held = (line, record)

    def _check(self, line: int, record: dict[str, Any], last: bool) -> None:
        chain = self.chain
        if record.get(PREV) != chain.head:
            self.problem = (f"line {line}: chain broken ('{PREV}' does not match the record before): a record was "
                            "edited, removed, inserted or reordered" + (" or the key is wrong" if chain.key else ""))
            return
        if HEAD in record and not last:
            self.problem = f"line {line}: chain sealed before the end: records were appended after it"
            return
        link = chain.link(record)
        if last and record.get(HEAD) != link:
            self.problem = (f"line {line}: " + (f"the last record's {HEAD} does not match: it was edited"
                                                + (" or the key is wrong" if chain.key else "") if HEAD in record
                                                else "the chain is not sealed: the file was cut short"))

    def verdict(self) -> dict[str, Any]:
        """The verdict once every record was added."""
        if self._early is not None:
            return self._early
        if self._held is not None and self.problem is None:
            self._check(*self._held, last=True)
            self._held = None
        if not self._any and self.header.get(HEAD) != self.chain.head:
            self.problem = "line 1: the chain is not sealed: the file was cut short"
        if self.kind == "hmac-sha256":
            guarantee = (f"hmac-sha256 chain verified with {KEY_ENV}: written by a holder of the key, no record "
                         "edited, removed, reordered or cut off")
        else:
            guarantee = ("sha256 chain intact: no record edited, removed, reordered or cut off without the chain "
                         f"being recomputed (anyone can recompute it; set {KEY_ENV} when writing to prove origin)")
        return {"kind": self.kind, "checked": True, "ok": self.problem is None, "problem": self.problem,
                "guarantee": guarantee}
