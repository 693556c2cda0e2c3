"""The V2 radix tree: node chains, pruning, the first-token index that partial matching uses."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from cache_backends.hashing import chain_hashes, pack_tokens
from cache_backends.request import Request
from cache_backends.v2.radix import INDEX_CHILDREN_AFTER, RadixTree
from tests.kv_v2_support import FULL, admit, compute, make_manager, prefill

T = 4


def _chain(tree: RadixTree, tokens: list[int], salt: str | None = None):
    return tree.extend(None, salt, pack_tokens(tokens), T)


def test_extend_builds_a_chain_with_one_more_user_each_and_finds_existing_nodes():
    tree = RadixTree()
    a = _chain(tree, list(range(12)))
    assert [n.depth for n in a] == [0, 1, 2]
    assert [n.token_ids for n in a] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert [n.users for n in a] == [1, 1, 1] and tree.num_nodes == 3
    b = _chain(tree, [*range(8), 20, 21, 22, 23])
    assert b[:2] == a[:2] and b[2] is not a[2] and [n.users for n in b] == [2, 2, 1] and tree.num_nodes == 4
    assert a[1].children == {a[2].tokens: a[2], b[2].tokens: b[2]} and not a[2].children
    assert [n.key for n in a] == chain_hashes(list(range(12)), T, None)  # chained SHA-256, computed on demand
    assert a[2].tokens == pack_tokens([8, 9, 10, 11])  # packed as the key encodes them, 8 bytes per id


def test_prune_removes_empty_unused_nodes_up_to_the_root_and_then_the_root():
    tree = RadixTree()
    nodes = _chain(tree, list(range(8)), "s")
    nodes[0].blocks["full"] = 7  # the head holds a block: pruning stops below it
    for n in nodes:
        n.users = 0
    tree.prune(nodes[1])
    assert tree.num_nodes == 1 and not nodes[0].children and tree.root("s") is not None
    del nodes[0].blocks["full"]
    tree.prune(nodes[0])
    assert tree.num_nodes == 0 and tree.root("s") is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.integers(0, 3)), min_size=1, max_size=120))
def test_children_starting_with_matches_a_scan_of_the_children_in_order(ops):
    # Wide nodes build the first-token index on the first question and keep it through inserts and prunes;
    # the answer must always be what scanning the children in insertion order gives.
    tree = RadixTree()
    live: dict[tuple[int, int], object] = {}
    for add, first, ask in ops:
        if add or not live:
            (node,) = _chain(tree, [first % 5, first, 99, 99])
            live[(first % 5, first)] = node
        else:
            key = sorted(live)[first % len(live)]
            node = live.pop(key)
            node.users = 0
            tree.prune(node)
        root = tree.root(None)
        if root is None:
            continue
        want = [c for c in root.children.values() if c.token_ids[0] == ask]
        if add and first % 2:  # the admission's yes/no question, asked before (it may build the index too)
            assert root.has_child_starting_with(pack_tokens((ask,))) == bool(want)
        assert root.children_starting_with(ask) == want
        assert root.has_child_starting_with(pack_tokens((ask,))) == bool(want)
        if root.by_first is not None:
            assert {t: list(g.values()) for t, g in root.by_first.items()} == {
                t: [c for c in root.children.values() if c.tokens[:8] == t] for t in {c.tokens[:8] for c in
                                                                                      root.children.values()}}
        if len(root.children) > INDEX_CHILDREN_AFTER:
            assert root.by_first is not None  # asked just now with more children than the threshold


def test_partial_reuse_on_a_wide_node_picks_the_longest_match_among_children_sharing_the_first_token():
    m = make_manager(FULL, 64, enable_partial_reuse=True)
    rng = random.Random(3)
    # 12 cached prompts of one block + a tail each, all below the root; three start with token 7
    prompts = [[7, 1, 5, 5, 60], [7, 1, 2, 9, 50], [7, 3, 3, 3, 61]]
    prompts += [[100 + i, rng.randrange(99), 4, 4, 70 + i] for i in range(9)]
    for i, p in enumerate(prompts):
        cached = Request(f"p{i}", p, 0)
        prefill(m, cached)
        m.free(cached)  # its full block stays cached (evictable) below the root
    assert len(m._tree.root(None).children) > INDEX_CHILDREN_AFTER
    hits = m.stats().reuse_partial_hits
    source = next(c for c in m._tree.root(None).children.values() if c.token_ids == (7, 1, 2, 9))
    r = Request("r", [7, 1, 2, 8, 80, 81], 2)
    admit(m, r)
    assert r.num_computed_tokens == 3 and m.stats().reuse_partial_hits == hits + 1  # [7, 1, 2] of p1
    assert m.block_table(r, "full")[0] != source.blocks["full"]  # copied: the cached block is never written
    compute(m, r, r.num_tokens - r.num_computed_tokens)
    m.check_invariants()
    assert m._tree.root(None).by_first is not None  # the wide root got its index and keeps it consistent
    # A request whose first token starts no cached block claims nothing (the cheap admission miss), even if
    # every later token matches; the same tokens behind a cached first token still find the partial block.
    miss = Request("miss", [8, 1, 2, 9, 80, 81], 2)
    admit(m, miss)
    assert miss.num_computed_tokens == 0 and m.stats().reuse_partial_hits == hits + 1
    other_salt = Request("salted", [7, 1, 2, 9, 80, 81], 2, salt="other")  # another scope: nothing cached there
    admit(m, other_salt)
    assert other_salt.num_computed_tokens == 0
    full = Request("full", [7, 1, 2, 9, 80, 81], 2)
    admit(m, full)
    assert full.num_computed_tokens == 4 and m.stats().reuse_partial_hits == hits + 1  # p1's whole block
    m.check_invariants()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2**40), min_size=T, max_size=12 * T), st.sampled_from([None, "", "tenant"]),
       st.integers(0, 11))
def test_keys_are_the_chained_block_hashes_whichever_node_is_asked_first(tokens, salt, ask):
    # Keys are computed on demand from the deepest node asked up to the nearest keyed ancestor; the result must
    # be the chained SHA-256 of the prefix whatever the order of the questions.
    tree = RadixTree()
    nodes = _chain(tree, tokens, salt)
    want = chain_hashes(tokens, T, salt)
    assert nodes[min(ask, len(nodes) - 1)].key == want[min(ask, len(nodes) - 1)]
    assert [n.key for n in nodes] == want
    assert tree.root(salt).key is None
