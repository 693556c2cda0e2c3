"""The shared chained block hash: what prefix reuse (V1 and V2) relies on."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache_backends.hashing import HASH_BYTES, block_hash, chain_hashes, chain_packed_hashes, pack_tokens

tokens = st.lists(st.integers(min_value=0, max_value=2**31), min_size=1, max_size=16)


def test_key_is_a_full_sha256_digest_and_deterministic():
    key = block_hash(None, [1, 2, 3], None)
    assert len(key) == HASH_BYTES == hashlib.sha256().digest_size
    assert key == block_hash(None, [1, 2, 3], None)


@given(tokens, tokens)
def test_different_tokens_give_different_keys(a, b):
    assert (block_hash(None, a, None) == block_hash(None, b, None)) == (a == b)


def test_salt_separates_tenants_and_none_differs_from_empty():
    keys = {block_hash(None, [7, 8], s) for s in (None, "", "tenant-a", "tenant-b")}
    assert len(keys) == 4


def test_parent_is_part_of_the_key_so_equal_blocks_after_different_prefixes_differ():
    p1, p2 = block_hash(None, [1], None), block_hash(None, [2], None)
    assert block_hash(p1, [5, 6], None) != block_hash(p2, [5, 6], None)
    assert block_hash(None, [5, 6], None) != block_hash(p1, [5, 6], None)


def test_encoding_cannot_shift_tokens_into_the_salt():
    # Without length prefixes, (tokens=[1], salt="\x02...") could collide with (tokens=[1, 2], salt=...).
    extra = struct.pack("<q", 2).decode("latin-1")
    assert block_hash(None, [1, 2], "s") != block_hash(None, [1], extra + "s")


def test_bad_parent_and_out_of_range_tokens_are_rejected():
    with pytest.raises(ValueError, match="parent hash must be 32 bytes"):
        block_hash(b"short", [1], None)
    with pytest.raises(ValueError, match="64-bit"):
        block_hash(None, [2**64], None)


@given(st.lists(st.integers(0, 1000), max_size=40), st.integers(1, 8), st.one_of(st.none(), st.text(max_size=4)))
def test_chain_covers_full_blocks_only_and_each_key_is_the_parent_of_the_next(toks, size, salt):
    keys = chain_hashes(toks, size, salt)
    assert len(keys) == len(toks) // size
    parent = None
    for i, key in enumerate(keys):
        assert key == block_hash(parent, toks[i * size:(i + 1) * size], salt)
        parent = key


def test_shared_prefix_shares_keys_until_the_first_differing_block():
    a = chain_hashes([1, 2, 3, 4, 5, 6], 2, None)
    b = chain_hashes([1, 2, 3, 4, 9, 6], 2, None)
    assert a[:2] == b[:2] and a[2] != b[2]


def _spec_key(parent: bytes | None, toks: list[int], salt: str | None) -> bytes:
    """The documented encoding, spelled out part by part (what V1 and V2 keys have always been)."""
    h = hashlib.sha256(b"kvload/block/v1\x00")
    h.update(b"\x00" if parent is None else b"\x01" + parent)
    if salt is None:
        h.update(b"\x00")
    else:
        raw = salt.encode("utf-8")
        h.update(b"\x01" + struct.pack("<Q", len(raw)) + raw)
    h.update(struct.pack("<Q", len(toks)) + b"".join(struct.pack("<q", t) for t in toks))
    return h.digest()


int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
salts = st.one_of(st.none(), st.text(max_size=6))


@given(st.lists(int64, min_size=1, max_size=12), salts, st.booleans())
def test_block_hash_is_the_documented_encoding(toks, salt, with_parent):
    parent = hashlib.sha256(b"p").digest() if with_parent else None
    assert block_hash(parent, toks, salt) == _spec_key(parent, toks, salt)


@given(st.lists(int64, max_size=70), st.integers(1, 9), salts, st.booleans(), st.booleans())
def test_chain_hashes_in_one_pass_equal_block_hash_block_by_block(toks, size, salt, with_parent, as_tuple):
    # chain_hashes packs a run once and hashes slices of it; the keys must be block_hash's, bit for bit.
    parent = block_hash(None, [42], "x") if with_parent else None
    expected, p = [], parent
    for start in range(0, len(toks) - size + 1, size):
        p = block_hash(p, toks[start:start + size], salt)
        expected.append(p)
    assert chain_hashes(tuple(toks) if as_tuple else toks, size, salt, parent) == expected


def test_chain_hashes_of_one_block_and_a_long_run_match_block_hash():
    toks = list(range(1000, 1000 + 32 * 20))
    parent = block_hash(None, toks[:32], "s")
    assert chain_hashes(toks[32:64], 32, "s", parent) == [block_hash(parent, toks[32:64], "s")]
    assert chain_hashes(toks, 32, "s")[:2] == [parent, block_hash(parent, toks[32:64], "s")]
    assert len(chain_hashes([*toks, 1, 2, 3], 32, None)) == 20


def test_chain_hashes_rejects_what_block_hash_rejects():
    with pytest.raises(ValueError, match="parent hash must be 32 bytes"):
        chain_hashes([1, 2], 2, None, b"short")
    with pytest.raises(ValueError, match="64-bit"):
        chain_hashes([1, 2**63], 2, None)
    with pytest.raises(ValueError, match="64-bit"):
        chain_hashes([1, 2, 3, -(2**63) - 1], 2, None)
    with pytest.raises(ValueError, match="tokens_per_block"):
        chain_hashes([1], 0, None)


def test_pack_tokens_is_the_int64_little_endian_encoding_and_chain_packed_hashes_match():
    toks = [0, 1, -1, 2**63 - 1, -(2**63), 12345]
    assert pack_tokens(toks) == b"".join(struct.pack("<q", t) for t in toks)
    with pytest.raises(ValueError, match="64-bit"):
        pack_tokens([2**63])
    run = list(range(7, 7 + 3 * 4 + 2))  # three blocks of 4 and a partial tail
    parent = block_hash(None, [1], "t")
    for p in (None, parent):
        assert chain_packed_hashes(pack_tokens(run), 4, "t", p) == chain_hashes(run, 4, "t", p)
        assert chain_packed_hashes(pack_tokens(run[:4]), 4, "t", p) == chain_hashes(run[:4], 4, "t", p)
    assert chain_packed_hashes(b"", 4, None) == []
    with pytest.raises(ValueError, match="parent hash must be 32 bytes"):
        chain_packed_hashes(pack_tokens(run), 4, None, b"x")
