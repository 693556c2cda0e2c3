"""The V2 radix tree: runs of blocks (split on a branch or a match inside a run), trimming, the first-token index
that partial matching uses, lazy keys; lookups checked against a node-per-block reference."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from cache_backends import LayerKV
from cache_backends.hashing import chain_hashes, pack_tokens
from cache_backends.request import Request
from cache_backends.v2.radix import INDEX_CHILDREN_AFTER, RadixNode, RadixTree
from tests.kv_v2_support import (
    FULL,
    admit,
    compute,
    full_sliding_layers,
    make_manager,
    own_groups,
    prefill,
    split_sliding_layers,
)

T = 4


def _tree(num_blocks: int = 64) -> RadixTree:
    return RadixTree({"full": ([None] * num_blocks, [0] * num_blocks)})


def _chain(tree: RadixTree, tokens: list[int], salt: str | None = None, last: RadixNode | None = None):
    return tree.extend(last, salt, pack_tokens(tokens), T)


def _positions(tree: RadixTree, last: RadixNode) -> list[tuple[RadixNode, int]]:
    """The (run, offset) of every position on the path that ends at ``last``, root first."""
    out: list[tuple[RadixNode, int]] = []
    node: RadixNode | None = last
    while node is not None and node.parent is not None:
        out[:0] = [(node, i) for i in range(len(node))]
        node = node.parent
    return out


def test_extend_builds_one_run_and_a_branch_splits_it_keeping_users_and_child_order():
    tree = _tree()
    a, segs = _chain(tree, list(range(12)))
    assert segs == [(a, 0, 3)] and a.start == 0 and len(a) == 3 and a.users == 1 and tree.num_nodes == 3
    assert [a.token_ids(i) for i in range(3)] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert a.block(2) == pack_tokens([8, 9, 10, 11])  # packed as the key encodes them, 8 bytes per id
    b, segs = _chain(tree, [*range(8), 20, 21, 22, 23])  # shares two blocks, then branches inside a's run
    head = a.parent
    assert head is not None and head is not tree.root(None) and segs == [(head, 0, 2), (b, 0, 1)]
    assert (head.start, len(head), head.users) == (0, 2, 2) and (a.start, len(a), a.users) == (2, 1, 1)
    assert (b.start, len(b), b.users, b.parent) == (2, 1, 1, head) and tree.num_nodes == 4
    assert list(head.children.values()) == [a, b]  # the old continuation first, as a node per block would keep
    assert tree.root(None).children == {head.block(0): head}
    assert [tree.key(r, i) for r, i in _positions(tree, a)] == chain_hashes(list(range(12)), T, None)
    assert tree.parent_key(b, 0) == tree.key(head, 1)


def test_a_runs_only_user_extends_it_in_place_and_a_shared_run_gets_a_child():
    tree = _tree()
    a, _ = _chain(tree, list(range(8)))
    a2, segs = _chain(tree, list(range(8, 12)), last=a)
    assert a2 is a and segs == [(a, 2, 3)] and len(a) == 3 and tree.num_nodes == 3
    # a second user of the whole run: the first user's next block must not go into the shared run
    other, _ = _chain(tree, list(range(12)))
    assert other is a and a.users == 2
    a3, segs = _chain(tree, list(range(12, 16)), last=a)
    assert a3 is not a and a3.parent is a and segs == [(a3, 0, 1)] and len(a) == 3 and a3.users == 1


def test_claim_splits_a_run_where_the_path_ends_and_leave_trims_unused_empty_tails_up_to_the_root():
    tree = _tree()
    owners, pos = tree.owners["full"], tree.positions["full"]
    a, _ = _chain(tree, list(range(16)), "s")
    for i, b in enumerate([10, 11, 12, 13]):  # blocks 10..13 at positions 0..3
        a.blocks["full"][i], a.held[i] = b, 1
        owners[b], pos[b] = a, i
    tree.leave(a)  # unused, but every position holds a block: nothing goes
    assert a.users == 0 and tree.num_nodes == 4
    last = tree.claim(a, 1)  # a cache takes the first two positions: the run splits there
    assert last is a.parent and (len(last), last.users, owners[10], owners[12]) == (2, 1, last, a)
    tree.detach("full", [13, 12])  # evicted tail first: a is trimmed away
    assert a.parent is None and not last.children and tree.num_nodes == 2 and owners[12] is None
    tree.detach("full", [10])  # a hole at the head of a used run: kept
    assert len(last) == 2 and tree.num_nodes == 2
    tree.leave(last)  # position 1 still holds block 11: the run keeps it and its empty head
    assert len(last) == 2 and tree.root("s") is not None
    tree.detach("full", [11])
    assert tree.num_nodes == 0 and tree.root("s") is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.integers(0, 3)), min_size=1, max_size=120))
def test_children_starting_with_matches_a_scan_of_the_children_in_order(ops):
    # Wide runs build the first-token index on the first question and keep it through inserts and trims;
    # the answer must always be what scanning the children in insertion order gives.
    tree = _tree()
    live: dict[tuple[int, int], RadixNode] = {}
    for add, first, ask in ops:
        if add or not live:
            key = (first % 5, first)
            if key not in live:
                live[key], _ = _chain(tree, [first % 5, first, 99, 99])
        else:
            key = sorted(live)[first % len(live)]
            tree.leave(live.pop(key))
        root = tree.root(None)
        if root is None:
            continue
        want = [c for c in root.children.values() if c.token_ids(0)[0] == ask]
        if add and first % 2:  # the admission's yes/no question, asked before (it may build the index too)
            assert root.has_child_starting_with(pack_tokens((ask,))) == bool(want)
        assert root.children_starting_with(ask) == want
        assert root.has_child_starting_with(pack_tokens((ask,))) == bool(want)
        if root.by_first is not None:
            assert {t: list(g.values()) for t, g in root.by_first.items()} == {
                t: [c for c in root.children.values() if c.block(0)[:8] == t]
                for t in {c.block(0)[:8] for c in root.children.values()}}
        if len(root.children) > INDEX_CHILDREN_AFTER:
            assert root.by_first is not None  # asked just now with more children than the threshold


_OP = st.tuples(st.sampled_from(["add", "grow", "claim", "leave", "attach", "detach"]),
                st.lists(st.integers(0, 2), min_size=T, max_size=6 * T), st.integers(0, 2**16))


@settings(max_examples=150, deadline=None)
@given(st.lists(_OP, min_size=1, max_size=40))
def test_runs_answer_every_lookup_as_a_node_per_block_tree_would(ops):
    # A reference keeps a node per block: prefix (tuple of blocks) -> users and block. After every operation the
    # tree must hold exactly the positions the reference holds (a node stays while it has a user, a block or a
    # descendant), with the same users, blocks, tokens and chained keys, and a walk over any token list must stop
    # where the reference's does.
    tree = _tree(4096)
    owners, pos = tree.owners["full"], tree.positions["full"]
    ref: dict[tuple, list] = {}  # prefix -> [users, block]
    paths: list[tuple[RadixNode, tuple]] = []  # live caches: (last run, their prefix)
    next_block = iter(range(4096))
    for op, tokens, pick in ops:
        blocks = tuple(tuple(tokens[i:i + T]) for i in range(0, len(tokens) // T * T, T))
        if op in ("add", "grow") or not paths:
            base_last, base = (None, ()) if op == "add" or not paths else paths.pop(pick % len(paths))
            last, _ = _chain(tree, [t for blk in blocks for t in blk], last=base_last)
            for k in range(len(base) + 1, len(base) + len(blocks) + 1):
                ref.setdefault((base + blocks)[:k], [0, -1])[0] += 1
            paths.append((last, base + blocks))
        elif op == "claim":  # a new cache takes part of a live path (as an admission does)
            last, prefix = paths[pick % len(paths)]
            n = 1 + pick % len(prefix)
            run, i = tree.position(last, n - 1)
            paths.append((tree.claim(run, i), prefix[:n]))
            for k in range(1, n + 1):
                ref[prefix[:k]][0] += 1
        elif op == "leave":
            last, prefix = paths.pop(pick % len(paths))
            tree.leave(last)
            for k in range(1, len(prefix) + 1):
                ref[prefix[:k]][0] -= 1
        elif op == "attach":
            last, prefix = paths[pick % len(paths)]
            p = pick % len(prefix)
            run, i = tree.position(last, p)
            if run.blocks["full"][i] < 0:
                b = next(next_block)
                run.blocks["full"][i], run.held[i], owners[b], pos[b] = b, 1, run, p
                ref[prefix[:p + 1]][1] = b
        else:  # detach a random attached block, as an eviction does
            held = sorted(k for k, v in ref.items() if v[1] >= 0)
            if held:
                key = held[pick % len(held)]
                b = ref[key][1]
                ref[key][1] = -1
                tree.detach("full", [b])
                assert owners[b] is None
        # the reference prunes: a prefix stays while it or a longer one has a user or a block
        alive = {k for k, (u, b) in ref.items() if u or b >= 0}
        alive = {k[:n] for k in alive for n in range(1, len(k) + 1)}
        ref = {k: v for k, v in ref.items() if k in alive}
        got: dict[tuple, list] = {}
        for run in tree.nodes():
            prefix: tuple = ()
            node = run.parent
            chain: list[RadixNode] = []
            while node is not None and node.parent is not None:
                chain.append(node)
                node = node.parent
            prefix = tuple(run_tok for r in reversed(chain) for run_tok in (r.token_ids(i) for i in range(len(r))))
            for i in range(len(run)):
                prefix += (run.token_ids(i),)
                got[prefix] = [run.users, run.blocks["full"][i]]
                assert run.held[i] == (run.blocks["full"][i] >= 0)
                assert tree.key(run, i) == chain_hashes([t for blk in prefix for t in blk], T, None)[-1]
        assert got == ref and tree.num_nodes == len(ref)
        for last, prefix in paths:  # every live path ends at its run's end and reads back its tokens
            assert last.start + len(last) == len(prefix)
            assert tuple(r.token_ids(i) for r, i in _positions(tree, last)) == prefix


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
    m.key_pending()  # the prompts that shared no first token are pending (lazy keying): hang them all now
    assert len(m._tree.root(None).children) > INDEX_CHILDREN_AFTER
    hits = m.stats().reuse_partial_hits
    source = next(c for c in m._tree.root(None).children.values() if c.token_ids(0) == (7, 1, 2, 9))
    r = Request("r", [7, 1, 2, 8, 80, 81], 2)
    admit(m, r)
    assert r.num_computed_tokens == 3 and m.stats().reuse_partial_hits == hits + 1  # [7, 1, 2] of p1
    assert m.block_table(r, "full")[0] != source.blocks["full"][0]  # copied: the cached block is never written
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
       st.integers(0, 11), st.integers(1, 11))
def test_keys_are_the_chained_block_hashes_whichever_position_is_asked_first(tokens, salt, ask, cut):
    # Keys are computed on demand from the position asked back to the nearest keyed one (across runs, here split
    # at ``cut``); the result must be the chained SHA-256 of the prefix whatever the order of the questions.
    tree = _tree()
    last, _ = _chain(tree, tokens, salt)
    n = len(last)
    if cut < n:
        tree.claim(last, cut - 1)  # a path ending inside: the run splits
    want = chain_hashes(tokens, T, salt)
    at = _positions(tree, last)
    assert len(at) == n
    assert tree.key(*at[min(ask, n - 1)]) == want[min(ask, n - 1)]
    assert [tree.key(r, i) for r, i in at] == want


def test_kv_events_through_a_split_run_name_every_block_by_its_chained_key():
    # A second request shares one block of the first one's run and then branches: the run splits, the new blocks'
    # stored event chains from the shared block's key, and evictions name exactly keys that were stored.
    from cache_backends.kv_events import KvEventBuffer

    m = make_manager(FULL, 10, enable_partial_reuse=False)
    events = KvEventBuffer(1000)
    m.enable_kv_events(events)
    a_tokens = list(range(1, 14))  # 3 full blocks + 1 token
    a = Request("a", a_tokens, 0)
    prefill(m, a)
    b_tokens = [*a_tokens[:4], 50, 51, 52, 53, 54, 55, 56, 57, 58]
    b = Request("b", b_tokens, 0)
    prefill(m, b)
    assert b.num_reused_tokens == 4
    (head,) = m._tree.root(None).children.values()
    assert len(head) == 1 and [len(c) for c in head.children.values()] == [2, 2]  # a's run split after block 0
    m.check_invariants()
    got = events.drain()["events"]
    stored = [e for e in got if e["type"] == "kv_block_stored"]
    assert [e["block_hashes"] for e in stored] == [[k.hex() for k in chain_hashes(a_tokens[:12], T, None)],
                                                   [k.hex() for k in chain_hashes(b_tokens[:12], T, None)[1:]]]
    assert stored[1]["parent_block_hash"] == stored[0]["block_hashes"][0]
    assert stored[1]["token_ids"] == b_tokens[4:12]
    m.free(a)
    m.free(b)
    c = Request("c", list(range(100, 129)), 0)  # 8 blocks: 5 are free, 3 cached ones are evicted
    prefill(m, c)
    m.check_invariants()
    removed = [h for e in events.drain()["events"] if e["type"] == "kv_block_removed" for h in e["block_hashes"]]
    assert len(removed) == 3 and set(removed) <= {h for e in stored for h in e["block_hashes"]}


@settings(max_examples=100, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 2), min_size=4, max_size=4), min_size=1, max_size=30),
       query=st.lists(st.integers(0, 5), min_size=1, max_size=5), grow=st.integers(0, 3))
def test_partial_reuse_on_an_indexed_node_picks_what_comparing_every_child_would(prompts, query, grow):
    # Every cached prompt starts with the same token (a BOS), so the root's first-token index holds them all; the
    # two-token index must still find the earliest child with the longest match, or the earliest sharing only BOS.
    m = make_manager(FULL, 256, enable_partial_reuse=True)
    for i, p in enumerate(prompts):
        cached = Request(f"p{i}", [1, *p[:3], 9], 0)  # its first block [1, a, b, c] cached, 9 computed
        prefill(m, cached)
        m.free(cached)
    m.key_pending()
    root = m._tree.root(None)
    # at most one block, so no full block can match: what is reused is the partial block alone
    r = Request("r", [1, *query, 8, 8][: max(2, min(T, len(query) + 1 + grow))], 0)
    want_ids = r.prompt_token_ids[:T]
    limit = min(T - 1, r.num_tokens - 1)
    want = pack_tokens(want_ids)
    best, best_k = None, 0  # the reference: every child, in insertion order
    for child in root.children.values():
        if child.held[0] == 1 and child.tokens.startswith(want[:8]):
            k = min(next((i for i in range(T) if child.token_ids(0)[i:i + 1] != tuple(want_ids[i:i + 1])), T), limit)
            if k > best_k:
                best, best_k = child, k
    if len(root.children) > INDEX_CHILDREN_AFTER:
        assert root.children_sharing_two(want) is not None  # the indexed path runs
    source = best.blocks["full"][0] if best is not None else None
    admit(m, r)
    assert r.num_computed_tokens == best_k
    if source is not None:  # the copied block went back to the eviction queue as its most recent entry
        assert m._pool["full"].evictable.blocks()[-1] == source
    m.check_invariants()


def test_detaching_several_groups_in_one_call_leaves_the_tree_as_a_call_per_group():
    # a shared arena's take evicts blocks of many groups, position by position: detach_mixed unhooks them in one pass
    # and must leave the runs, trims and block owners exactly as one detach per group does
    def build() -> tuple[RadixTree, RadixNode]:
        owner: list = [None] * 64
        pos = [0] * 64
        tree = RadixTree({"a": (owner, pos), "b": (owner, pos)})  # the groups share one pool's lists, as an arena's
        run, _ = tree.extend(None, "s", pack_tokens(list(range(16))), 4)
        for g, base in (("a", 10), ("b", 20)):
            for i in range(4):
                run.blocks[g][i] = base + i
                run.held[i] += 1
                owner[base + i], pos[base + i] = run, i
        tree.leave(run)  # nobody's path: its empty tail positions are trimmed
        return tree, run

    def state(tree: RadixTree, run: RadixNode) -> tuple:
        return tree.num_nodes, len(run), dict(run.blocks), list(run.held), list(tree.owners["a"]), tree.root("s")

    one, run1 = build()
    one.detach_mixed(["a", "b"], [13, 23, 12, 22, 20], [0, 1, 0, 1, 1])
    per, run2 = build()
    per.detach("a", [13, 12])
    per.detach("b", [23, 22, 20])
    assert len(run1) == 2 and run1.blocks["b"][0] == -1
    assert state(one, run1)[:4] == state(per, run2)[:4]
    assert [o is not None for o in one.owners["a"]] == [o is not None for o in per.owners["a"]]


def _match_block_by_block(m, request: Request) -> tuple[int, RadixNode | None, int]:
    """The lookup as a node per block would walk it: one block packed and compared at a time (the reference)."""
    limit, root, w = request.num_tokens - 1, m._tree.root(request.salt), 8 * T
    run, i, n = None, 0, 0
    if root is None or limit < 1:
        return 0, None, 0
    tokens = request.prompt_token_ids + request.output_token_ids
    for j in range(limit // T):
        block = pack_tokens(tokens[j * T:(j + 1) * T])
        if run is not None and i + 1 < len(run.held):
            if bytes(run.tokens[(i + 1) * w:(i + 2) * w]) != block:
                break
            i += 1
        else:
            child = (run if run is not None else root).children.get(block)
            if child is None:
                break
            run, i = child, 0
        n += 1
    return (0, None, 0) if run is None else (m._usable_prefix(run, n, request), run, i)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14 * T), min_size=1, max_size=6),
       st.lists(st.tuples(st.integers(0, 5), st.integers(0, 14 * T), st.lists(st.integers(0, 2), max_size=3 * T)),
                min_size=1, max_size=8),
       st.lists(st.integers(0, 3), max_size=6))
def test_a_lookup_compares_runs_whole_and_stops_where_a_block_by_block_walk_does(cached, queries, outputs):
    # Queries are cached prompts cut anywhere and continued at random (few distinct ids), so they leave the tree at
    # any block, inside a run or at its end, or run out inside one; cached prompts stay running (held) or are
    # freed (evictable), some after growing outputs, and branch off each other (runs split).
    m = make_manager(FULL, 256)
    for k, prompt in enumerate(cached):
        r = Request(f"c{k}", prompt, 4)
        prefill(m, r)
        for _ in range(outputs[k] if k < len(outputs) else 0):
            r.output_token_ids.append(prompt[-1])
            compute(m, r, 1)
        if k % 2:
            m.free(r)
    m.key_pending()
    for k, (source, cut, tail) in enumerate(queries):
        query = cached[source % len(cached)][:cut] + tail or [0]
        q = Request(f"q{k}", query, 2)
        q.output_token_ids.extend(query[: k % 3])  # a preempted request's lookup reads its outputs too
        assert m._match(q) == _match_block_by_block(m, q)


def _usable_by_scan(m, last: RadixNode, n: int) -> int:
    """The longest multiple of the reuse unit whose blocks every group holds: each length checked group by group,
    from the longest down (the reference). The groups the radix tree keys (the manager's own: with the cuts tied, a
    logical group per family, whose block holds a page of every cut)."""
    T, unit = m.T, m.reuse_unit or m.T
    for length in range(n * T // unit * unit, 0, -unit):
        ok = True
        for g, _ in own_groups(m):
            tpb, step = g.tokens_per_block, g.tokens_per_block // T
            along = m._tree.path_blocks(last, n, g.name)
            present = [along[(j + 1) * step - 1] >= 0 for j in range(n // step)]
            lo = 0 if g.window is None else max(0, length - g.window + 1) // tpb
            ok = ok and all(present[lo:length // tpb])
        if ok:
            return length
    return 0


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["shared", "split", "compressed"]), st.sampled_from([4, 8, 12]),
       st.lists(st.tuples(st.integers(0, 4), st.integers(1, 16 * T), st.booleans()), min_size=2, max_size=12))
def test_the_usable_prefix_jumps_over_gaps_to_the_length_a_scan_of_every_length_finds(arena, window, requests):
    # Sliding windows let their early blocks go while a request runs, and a small pool evicts cached ones as later
    # requests need room: paths with gaps in some groups and not others, at any position. Every position of every
    # run is asked (a hit may end anywhere).
    layers = {"shared": full_sliding_layers(window), "split": split_sliding_layers(window),  # blocks of 3 positions:
              "compressed": [LayerKV(0, "full", 4), LayerKV(1, "csa", 4, window=window, compressed_elems=2,
                                                            compress_rate=3)]}[arena]
    m = make_manager(layers, 24)
    live = []
    for k, (source, length, keep) in enumerate(requests):
        # odd sources share a first half (runs split where the second halves differ), even ones repeat one id
        prompt = [7] * (length // 2) + [k % 3] * (length - length // 2) if source % 2 else [source] * length
        r = Request(f"r{k}", prompt, 2)
        m.create(r)
        rest = r.num_tokens - r.num_computed_tokens if m.resume(r) else -1  # a hit claims its cached prefix
        if rest < 0 or not m.allocate(r, rest):
            m.cancel_admission(r)
            continue
        m.commit(r, rest)
        if keep:
            live.insert(0, r)
        else:
            m.free(r)
        while len(live) > 2:
            m.free(live.pop())
    m.key_pending()
    for run in list(m._tree.nodes()):
        for p in range(len(run)):
            n = run.start + p + 1
            assert m._usable_prefix(run, n) == _usable_by_scan(m, run, n)


def test_every_change_a_lookup_can_see_raises_the_tree_s_version():
    """The cache-aware pass keeps a waiting request's lookup while ``RadixTree.version`` stays (``cached_prefixes``):
    new positions (a new run, a run grown in place), a split, a block gone from a run that stays (a sliding
    window's, with others still held there), a trimmed tail, an unhooked run and a pending prefix noted each move it;
    a path claimed or let go without a split or a trim (users only) does not."""
    from cache_backends.v2.radix import PendingPrefix

    tree = _tree()
    owner, pos = tree.owners["full"], tree.positions["full"]

    def moves(change) -> bool:
        before = tree.version
        change()
        return tree.version > before

    got: dict[str, RadixNode] = {}
    assert moves(lambda: got.update(a=_chain(tree, list(range(12)))[0]))  # a new run
    a = got["a"]
    for i in range(3):  # blocks 0-2 at its positions
        a.blocks["full"][i], a.held[i], owner[i], pos[i] = i, 1, a, i
    assert moves(lambda: tree.append(a, pack_tokens(list(range(12, 16))), T))  # grown in place (an empty position)
    assert not moves(lambda: tree.claim(a, 3))  # the path ends at the run's end: users only
    assert moves(lambda: got.update(top=tree.claim(a, 1)))  # a split
    assert moves(lambda: tree.detach("full", [1]))  # a block gone from a used run: no trim, a held count falls
    tree.leave(got["top"])
    tree.leave(a)
    assert not moves(lambda: tree.leave(got["top"]))  # a user less, nothing trimmed (the run goes on below it)
    assert moves(lambda: tree.leave(a))  # nobody's path: its empty last position is trimmed
    assert len(a) == 1 and a.parent is got["top"]
    assert moves(lambda: tree.detach("full", [2]))  # its last block: the run is unhooked
    assert a.parent is None
    assert moves(lambda: tree.add_pending(PendingPrefix(None, pack_tokens([90]), Request("p", [90, 91], 1), None,
                                                         8 * T)))
