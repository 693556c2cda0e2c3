"""A KV-aware router's view of a manager (llm-d, Dynamo, vLLM's production stack): per layer group the set of block
hashes it believes cached, built only from the KV cache events, each event's invariants checked as it arrives; and the
set the manager actually holds, to compare with."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from cache_backends.kv_events import CLEARED, REMOVED, STORED


class Router:
    """Replays drained event batches (``{"events": [...], "dropped": n}``) into per-group hash sets.

    Every stream invariant a router relies on is checked (``problems``): ``seq`` strictly increasing (and contiguous
    while nothing was dropped), no store of a hash the group already holds, no removal of one it does not, every stored
    chain's parent stored in that group before (or None at a prefix's start), ``token_ids`` a whole number of blocks.
    Once a batch says events were dropped (``lost``), the set cannot be trusted and nothing more is checked."""

    def __init__(self) -> None:
        #: group -> hash -> (parent, token ids, cache salt)
        self.cached: dict[str, dict[str, tuple[str | None, tuple[int, ...], str | None]]] = defaultdict(dict)
        self.ever: dict[str, set[str]] = defaultdict(set)
        #: group -> hash -> (parent, token ids, cache salt) of every block ever stored (removed ones too)
        self.known: dict[str, dict[str, tuple[str | None, tuple[int, ...], str | None]]] = defaultdict(dict)
        self.seq = 0
        self.lost = False
        self.problems: list[str] = []
        self.kinds: dict[str, int] = defaultdict(int)

    def feed(self, batch: dict[str, Any]) -> None:
        """Apply one drained batch."""
        self.lost = self.lost or batch["dropped"] > 0
        for e in batch["events"]:
            self.kinds[e["type"]] += 1
            if e["seq"] <= self.seq or (not self.lost and self.seq and e["seq"] != self.seq + 1):
                self.problems.append(f"seq {e['seq']} after {self.seq} (dropped {batch['dropped']})")
            self.seq = e["seq"]
            if self.lost:
                continue
            if e["type"] == CLEARED:
                self.cached.clear()
                continue
            group, cached, where = e["layer_group"], self.cached[e["layer_group"]], f"seq {e['seq']} {e['type']}"
            if e["type"] == STORED:
                tpb, tokens, parent = e["tokens_per_block"], e["token_ids"], e["parent_block_hash"]
                if len(tokens) != tpb * len(e["block_hashes"]):
                    self.problems.append(f"{where}: {len(tokens)} token ids for {len(e['block_hashes'])} blocks")
                if parent is not None and parent not in self.ever[group]:
                    self.problems.append(f"{where}: {group} parent {parent[:12]} never stored")
                for i, h in enumerate(e["block_hashes"]):
                    if h in cached:
                        self.problems.append(f"{where}: {group} {h[:12]} stored again, never removed")
                    cached[h] = self.known[group][h] = (parent, tuple(tokens[i * tpb:(i + 1) * tpb]),
                                                        e.get("cache_salt"))
                    self.ever[group].add(h)
                    parent = h
            elif e["type"] == REMOVED:
                for h in e["block_hashes"]:
                    if cached.pop(h, None) is None:
                        self.problems.append(f"{where}: {group} {h[:12]} removed but not cached")

    def sets(self) -> dict[str, set[str]]:
        """Per group, the hashes believed cached (groups holding none left out)."""
        return {g: set(c) for g, c in self.cached.items() if c}

    def hit_tokens(self, group: str, tokens: list[int], tokens_per_block: int, salt: str | None = None) -> int:
        """The whole-block prefix of ``tokens`` under the cache salt ``salt`` a router predicts cached in ``group``,
        matching blocks by token ids, parent and salt (at most all but the last token, as an engine leaves one to
        compute)."""
        by = {(parent, toks, s): h for h, (parent, toks, s) in self.cached.get(group, {}).items()}
        parent, n = None, 0
        for i in range((len(tokens) - 1) // tokens_per_block):
            h = by.get((parent, tuple(tokens[i * tokens_per_block:(i + 1) * tokens_per_block]), salt))
            if h is None:
                break
            parent, n = h, n + 1
        return n * tokens_per_block


def manager_sets(m: Any) -> dict[str, set[str]]:
    """Per event group, the hashes of the blocks the manager would hit for a prefix lookup (V1: its pool's prefix
    cache; V2: every radix run's positions holding a block of the group, a tied family's under each cut's name)."""
    if not hasattr(m, "_tree"):  # V1
        return {m.group: {k.hex() for k in m.pool.cached}} if m.pool.cached else {}
    tree = m._tree
    out: dict[str, set[str]] = defaultdict(set)
    for run in tree.nodes():
        for g, blocks in run.blocks.items():
            for i, b in enumerate(blocks):
                if b >= 0:
                    for name in m._event_cuts.get(g, [g]):
                        out[name].add(tree.key(run, i).hex())
    assert not any(tree.pending.values()), "a lazily keyed prefix with KV events on"
    return {g: s for g, s in out.items() if s}


def mismatch(router: Router, m: Any) -> str | None:
    """What differs between the router's sets and the manager's (None: equal, or the router lost events)."""
    if router.lost:
        return None
    have, want = router.sets(), manager_sets(m)
    for g in sorted(set(have) | set(want)):
        a, b = have.get(g, set()), want.get(g, set())
        if a != b:
            return (f"group {g}: the router believes {sorted(h[:12] for h in a - b)} cached that are not, and misses "
                    f"{sorted(h[:12] for h in b - a)}")
    return None


def predict_hit(router: Router, groups: list[tuple[str, int, int | None]], tokens: list[int], T: int, unit: int,
                salt: str | None = None) -> int:
    """The hit a router predicts from the events for a model of several layer groups (vLLM's hybrid allocator,
    ``HybridKVCacheCoordinator.find_longest_cache_hit``): the longest multiple of ``unit`` tokens, at most all but the
    last token, for which every full group (``window`` None) holds its blocks from the start and every sliding group
    the blocks its window reads before that length (``groups``: name, tokens per block, window, as the plan says).

    A block is matched by its parent's hash, its token ids and the salt; the hashes of the prompt's ``T``-token
    positions are followed through every group's stored blocks of ``T`` tokens (a sliding group's parent may have
    left its window: a router keeps the chain it has seen)."""
    index: dict[tuple[str | None, tuple[int, ...], str | None], str] = {}
    for g in router.ever:  # every T-token block ever stored, in any group: the prompt's position hashes
        for h, (parent, toks, s) in router.known[g].items():
            if len(toks) == T:
                index[(parent, toks, s)] = h
    keys: list[str] = []
    parent: str | None = None
    for i in range((len(tokens) - 1) // T):
        h = index.get((parent, tuple(tokens[i * T:(i + 1) * T]), salt))
        if h is None:
            break
        keys.append(h)
        parent = h

    def holds(name: str, tpb: int, j: int) -> bool:  # group block j (tokens [j*tpb, (j+1)*tpb)) cached in ``name``
        step = tpb // T
        last = (j + 1) * step - 1
        return last < len(keys) and keys[last] in router.cached.get(name, {})

    m = len(keys) * T // unit * unit
    while m > 0:
        if all(all(holds(name, tpb, j) for j in range(0 if window is None else max(0, m - window + 1) // tpb, m // tpb))
               for name, tpb, window in groups):
            return m
        m -= unit
    return 0
