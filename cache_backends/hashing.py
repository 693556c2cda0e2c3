"""Block keys for prefix reuse: a chained SHA-256 over token blocks and the reuse-scope salt."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def block_hash(parent: bytes | None, tokens: Sequence[int], salt: str | None) -> bytes:
    """SHA-256 of the parent block's hash, the salt (utf-8, length-prefixed) and the token ids (int64 LE).

    Chaining makes a block's key depend on the whole prefix before it; the salt keeps reuse scopes
    (tenants) apart, so two requests with different salts never get the same key.
    """
    h = hashlib.sha256()
    h.update(parent or b"")
    salt_bytes = (salt or "").encode("utf-8")
    h.update(len(salt_bytes).to_bytes(8, "little"))
    h.update(salt_bytes)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()
