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
_NO_PARENT = _DOMAIN + b"\x00"
_WITH_PARENT = _DOMAIN + b"\x01"


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
    # One hash of the concatenation: the same bytes as hashing each part in turn, fewer calls.
    salt_part = _SALT_PARTS.get(salt) or _salt_part(salt)
    if parent is None:
        return hashlib.sha256(b"".join((_NO_PARENT, salt_part, body))).digest()
    return hashlib.sha256(b"".join((_WITH_PARENT, parent, salt_part, body))).digest()


_PACKERS: dict[int, struct.Struct] = {}


def _packer(n: int) -> struct.Struct:
    """``<Q{n}q``: the token count, then the ids as int64 (cached per block length)."""
    if len(_PACKERS) >= 256:  # odd lengths from tests or partial blocks: keep the cache small
        _PACKERS.clear()
    packer = _PACKERS[n] = struct.Struct(f"<Q{n}q")
    return packer


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as a block key encodes them: int64, little-endian, 8 bytes each (no count)."""
    n = len(tokens)
    packer = _RUN_PACKERS.get(n) or _run_packer(n)
    try:
        return packer.pack(*tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be 64-bit integers: {exc}") from None


def chain_hashes(tokens: Sequence[int], tokens_per_block: int, salt: str | None,
                 parent: bytes | None = None) -> list[bytes]:
    """Keys of every full block of ``tokens`` in order, chained from ``parent`` (a partial tail gets none).

    Exactly ``block_hash`` applied block after block, computed in one pass: the token ids of the
    whole run are packed once and each block hashes its slice of that buffer (packing token by
    token costs more than the SHA-256 of a block, and this runs for every block a request fills).
    """
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    n = len(tokens) // tokens_per_block * tokens_per_block
    if parent is not None and len(parent) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    if n == 0:
        return []
    return chain_packed_hashes(pack_tokens(tokens if len(tokens) == n else tokens[:n]), tokens_per_block, salt,
                               parent)


def chain_packed_hashes(packed: bytes, tokens_per_block: int, salt: str | None,
                        parent: bytes | None = None) -> list[bytes]:
    """:func:`chain_hashes` of token ids already packed by :func:`pack_tokens` (full blocks only)."""
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    if parent is not None and len(parent) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    stride = 8 * tokens_per_block
    end = len(packed) // stride * stride
    # Bytes after the parent and before the token ids: the same for every block of the run.
    middle = _MIDDLES.get((salt, tokens_per_block)) or _middle(salt, tokens_per_block)
    sha256, join = hashlib.sha256, b"".join
    if end == len(packed) == stride:  # one block (a decode filled it): no slicing
        return [sha256(join((_NO_PARENT, middle, packed) if parent is None else
                            (_WITH_PARENT, parent, middle, packed))).digest()]
    body = memoryview(packed)
    keys: list[bytes] = []
    start = 0
    if parent is None and end:
        parent = sha256(join((_NO_PARENT, middle, body[:stride]))).digest()
        keys.append(parent)
        start = stride
    for off in range(start, end, stride):
        parent = sha256(join((_WITH_PARENT, parent, middle, body[off:off + stride]))).digest()
        keys.append(parent)
    return keys


_RUN_PACKERS: dict[int, struct.Struct] = {}


def _run_packer(n: int) -> struct.Struct:
    """``<{n}q``: a run of ``n`` token ids as int64, without the count (cached per run length)."""
    if len(_RUN_PACKERS) >= 256:
        _RUN_PACKERS.clear()
    packer = _RUN_PACKERS[n] = struct.Struct(f"<{n}q")
    return packer


_MIDDLES: dict[tuple[str | None, int], bytes] = {}


def _middle(salt: str | None, tokens_per_block: int) -> bytes:
    """The salt part then the token count (cached per salt and block length)."""
    if len(_MIDDLES) >= 1024:  # one entry per tenant salt: keep the cache bounded
        _MIDDLES.clear()
    middle = _MIDDLES[(salt, tokens_per_block)] = (_SALT_PARTS.get(salt) or _salt_part(salt)) + struct.pack(
        "<Q", tokens_per_block)
    return middle


_SALT_PARTS: dict[str | None, bytes] = {}


def _salt_part(salt: str | None) -> bytes:
    """The tagged, length-prefixed salt of the key encoding (cached per salt)."""
    if salt is None:
        part = b"\x00"
    else:
        raw = salt.encode("utf-8")
        part = b"\x01" + struct.pack("<Q", len(raw)) + raw
    if len(_SALT_PARTS) >= 1024:  # one entry per tenant salt: keep the cache bounded
        _SALT_PARTS.clear()
    _SALT_PARTS[salt] = part
    return part
