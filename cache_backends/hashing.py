"""Chained block hashes for prefix reuse, shared by the V1 block pool and the V2 radix tree.

A block's key is SHA-256 over (parent block's key, the block's token ids, the reuse-scope salt).
Chaining makes a key stand for the whole prefix up to and including the block, so equal keys
mean equal prefixes; the salt keeps tenants apart (different salts never produce the same key).
Full 256-bit digests are compared, never a truncated 64-bit hash.

The byte encoding is unambiguous: every part is tagged and length-prefixed, so ``None`` and
``""`` salts differ, a missing parent differs from any parent, and token ids cannot run into the
salt.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

#: Length in bytes of a block key.
HASH_BYTES = 32

_DOMAIN = b"kvload/block/v1\x00"


def block_hash(parent: bytes | None, tokens: Sequence[int], salt: str | None) -> bytes:
    """SHA-256 key of one block: the parent's key, the block's token ids (int64), the reuse salt."""
    if parent is not None and len(parent) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    n = len(tokens)
    packer = _PACKERS.get(n) or _packer(n)
    try:
        body = packer.pack(n, *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be 64-bit integers: {exc}") from None
    if salt is None:
        salt_part = b"\x00"
    else:
        raw = salt.encode("utf-8")
        salt_part = b"\x01" + struct.pack("<Q", len(raw)) + raw
    # One update of the concatenation: the same bytes as hashing each part in turn, fewer calls
    # (this runs for every full block a request fills).
    return hashlib.sha256(b"".join((_DOMAIN, b"\x00" if parent is None else b"\x01" + parent, salt_part,
                                    body))).digest()


_PACKERS: dict[int, struct.Struct] = {}


def _packer(n: int) -> struct.Struct:
    """``<Q{n}q``: the token count, then the ids as int64 (cached per block length)."""
    if len(_PACKERS) >= 256:  # odd lengths from tests or partial blocks: keep the cache small
        _PACKERS.clear()
    packer = _PACKERS[n] = struct.Struct(f"<Q{n}q")
    return packer


def chain_hashes(tokens: Sequence[int], tokens_per_block: int, salt: str | None,
                 parent: bytes | None = None) -> list[bytes]:
    """Keys of every full block of ``tokens`` in order, chained from ``parent`` (a partial tail gets none)."""
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    keys: list[bytes] = []
    for start in range(0, len(tokens) - tokens_per_block + 1, tokens_per_block):
        parent = block_hash(parent, tokens[start:start + tokens_per_block], salt)
        keys.append(parent)
    return keys
