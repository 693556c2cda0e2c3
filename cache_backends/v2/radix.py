"""The prefix-reuse radix tree: one node per unbranched run of full ``T``-token blocks, found by their tokens.

Path compression, as SGLang's radix cache: a node (a *run*) holds every block *position* of a stretch of prefix
that nothing branches from, so keying a request's blocks appends to its own run instead of creating an object
per block. One root per reuse salt, so tenants never see each other's nodes (the salt is also inside every key).
Position ``i`` of a run stands for tokens ``[(start+i)*T, (start+i+1)*T)`` of every sequence whose first
``(start+i+1)*T`` tokens are the path's tokens; it holds, per layer group, at most one physical block that ends
exactly there (compressed groups with blocks of ``k*T`` tokens hold one at every k-th position). Invariants
(``KVCacheManagerV2.check_invariants`` checks them):

* A non-root run has at least one position; ``run.start`` is its first position's block index in the prefix
  (``parent.start + len(parent)``, 0 below a root). A run's children hang off its last position, keyed by
  their first block's packed tokens; a position that is not a run's last has exactly one child: the next one.
* ``run.blocks[g][i] == b >= 0`` if and only if the group pool's ``node[b] is run`` and ``pos[b] == start + i``
  (``-1``: no block of ``g`` there). ``run.held[i]`` counts the groups holding a block at position ``i``.
* ``run.users`` counts the live caches whose path runs through the run. A cache's path always ends at a run's
  end (:meth:`RadixTree.claim` and :meth:`RadixTree.extend` split a run where a path would end inside it), so
  every position of a run has the run's users, exactly as a node per block would. A run nobody uses and with
  no children loses its tail positions that hold no block; emptied, it is unhooked, and the same goes on up
  towards the root (the per-block tree's pruning, run by run). Runs are never merged back.
* ``run.tokens`` is every position's token ids packed as the key encodes them
  (:func:`cache_backends.hashing.pack_tokens`: 8 bytes each), ``width`` bytes a position, in one ``bytearray``
  (so growing a run appends bytes, not an object per block); :meth:`RadixNode.block` is position ``i``'s.
  ``parent.children`` maps a child's first block to it: a lookup compares a block's tokens (under its parent,
  under its salt's root), which is the prefix equality the chained key stands for, exactly.
* ``run.keys[i]``, when present, is the chained SHA-256 key of the prefix up to position ``i``
  (:func:`cache_backends.hashing.block_hash` of the previous position's key, the tokens and the salt), computed on
  first use (:meth:`RadixTree.key`) and kept: lookups never need it, only what names blocks to the outside (KV
  cache events).
* ``run.by_first``, once built, maps each first token (its 8 packed bytes) to exactly the children whose first
  block starts with it, in the order of ``run.children``: partial matching only looks at children that share the
  first token. It is built the first time partial matching (or an admission's first-token check, at a root)
  asks a run with more than ``INDEX_CHILDREN_AFTER`` children, and kept from then on; ``run.by_two`` is the same
  by the first two tokens, built and kept with it (partial matching finds the children that share more than the
  first token without comparing every child that shares it: with a BOS token, every cached prompt does).
* ``RadixTree.num_nodes`` counts block positions (what a node per block would count), not runs.

**Lazy keying** (:class:`PendingPrefix`). Most prompts share nothing (a no-reuse workload shares nothing at all), and
hanging every block of every request in the tree, then pruning it again when the block is evicted, was most of what
prefix reuse cost a step. So a request whose first token starts no cached prefix is not keyed at all while it runs:
the tree only notes it under its first token (``RadixTree.pending``); when it lets go of its blocks, its full
committed blocks stay cached (evictable, in the same eviction order as keyed ones) owned by that note instead of by
runs. The first admission whose first token is a pending prefix's hangs that prefix in the tree, exactly as keying
it all along would have (:meth:`KVCacheManagerV2._materialize`), before it looks anything up. Invariants:

* A salt's pending prefixes have distinct first tokens, no child of the salt's root starts with one of them, and
  no running cache keyed eagerly whose path is still empty (``RadixTree.latent``: it may hang such a child later)
  starts with one. An admission with that first token hangs the pending prefix first, and only a cheap miss with
  no such cache notes a new one; so a pending prefix is the only thing with its first token, and hanging it late
  leaves the tree as keying it all along would have.
* A pending prefix owns the cached blocks keying would have left in the tree: a running request's (``cache`` is
  its cache) the blocks its windows let go, one of a request that let go also its full committed blocks.
  ``blocks[g][i] == b >= 0`` if and only if the pool's ``node[b]`` is the pending prefix and ``pos[b] == i``;
  ``held[i]`` counts them. A released request's leaves ``pending`` when its last block is evicted.
* Lazy keying is used where every group's block spans one token block (DeepSeek V4's compressed groups key
  eagerly) and no KV cache events are recorded (they report blocks as they are stored).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, MutableSequence, Sequence
from itertools import chain
from types import MappingProxyType

from cache_backends.hashing import chain_packed_hashes, pack_tokens

#: What a run without children holds in ``children``: most runs are leaves (a prompt's last blocks), so they
#: get a dict only when a first child arrives.
_NONE: Mapping = MappingProxyType({})

#: A run indexes its children by first token once partial matching asks it with more children than this.
INDEX_CHILDREN_AFTER = 8


class RadixNode:
    """A run of full token blocks of a cached prefix (a root: a salt's empty run)."""

    __slots__ = ("blocks", "by_first", "by_two", "children", "held", "keys", "parent", "salt", "start", "tail",
                 "tokens", "users", "width")

    def __init__(self, parent: RadixNode | None, salt: str | None, start: int, groups: Sequence[str],
                 width: int) -> None:
        self.parent = parent
        self.salt = salt
        self.start = start
        self.width = width  # bytes of packed tokens per position
        self.tokens = bytearray()
        self.keys: dict[int, bytes] = {}  # offset -> key, computed by RadixTree.key on first use
        self.held: list[int] = []
        self.blocks: dict[str, list[int]] = {g: [] for g in groups} if parent is not None else {}
        self.children: Mapping[bytes, RadixNode] = _NONE  # first block's tokens -> child; a dict once it has one
        self.by_first: dict[bytes, dict[bytes, RadixNode]] | None = None  # built on demand, see the module doc
        self.by_two: dict[bytes, dict[bytes, RadixNode]] = {}  # the same by first two tokens, built with by_first
        self.users = 0
        #: a finished request's partial last block, kept past this run's end for partial matches only (TailRun)
        self.tail: TailRun | None = None

    def __len__(self) -> int:
        return len(self.held)

    def block(self, i: int) -> bytes:
        """Position ``i``'s packed token ids."""
        w = self.width
        return bytes(self.tokens[i * w:(i + 1) * w])

    @property
    def is_root(self) -> bool:
        """Whether this is a salt's root (no positions of its own)."""
        return self.parent is None

    def token_ids(self, i: int) -> tuple[int, ...]:
        """Position ``i``'s token ids (unpacked from :attr:`tokens`)."""
        return struct.unpack_from(f"<{self.width // 8}q", self.tokens, i * self.width)

    def has_child_starting_with(self, first: bytes) -> bool:
        """Whether any child's first block starts with the token packed as ``first`` (8 bytes): an admission that
        matches nothing, not even part of a block, is told so without packing or comparing a whole block."""
        if self.by_first is None:
            if len(self.children) <= INDEX_CHILDREN_AFTER:
                return any(tokens.startswith(first) for tokens in self.children)
            self._index_by_first()
        return first in self.by_first  # type: ignore[operator]

    def _index_by_first(self) -> None:
        """Build :attr:`by_first` (see the module doc); kept up to date by the tree from then on."""
        by_first: dict[bytes, dict[bytes, RadixNode]] = {}
        by_two: dict[bytes, dict[bytes, RadixNode]] = {}
        for tokens, child in self.children.items():
            by_first.setdefault(tokens[:8], {})[tokens] = child
            by_two.setdefault(tokens[:16], {})[tokens] = child
        self.by_first, self.by_two = by_first, by_two

    def index(self, first: bytes, child: RadixNode) -> None:
        """Enter a new or replaced child (first block ``first``) in the first-token indexes, once built."""
        if self.by_first is not None:
            self.by_first.setdefault(first[:8], {})[first] = child
            self.by_two.setdefault(first[:16], {})[first] = child

    def children_sharing_two(self, want: bytes) -> list[RadixNode] | None:
        """The children whose first block starts with ``want``'s first two packed tokens, in insertion order; None
        while the node has too few children to index (scan them instead)."""
        if self.by_first is None:
            if len(self.children) <= INDEX_CHILDREN_AFTER:
                return None
            self._index_by_first()
        group = self.by_two.get(want[:16])
        return list(group.values()) if group else []

    def children_starting_with(self, token: int) -> list[RadixNode]:
        """The children whose first block starts with ``token``, in insertion order."""
        first = pack_tokens((token,))
        if self.by_first is None:
            if len(self.children) <= INDEX_CHILDREN_AFTER:
                return [child for child in self.children.values() if child.tokens.startswith(first)]
            self._index_by_first()
        group = self.by_first.get(first)  # type: ignore[union-attr]
        return list(group.values()) if group else []


class TailRun(RadixNode):
    """A finished request's partial last block: one position past the end of the run it hangs from (``parent.tail``),
    holding ``valid`` tokens. It is no child of that run: no whole-block lookup, keying or shared-prefix count sees it;
    only a partial match copies it (``KVCacheManagerV2._partial_source``), and only while it is adjacent (its
    ``start`` at its parent's end)."""

    __slots__ = ("valid",)

    def __init__(self, parent: RadixNode, salt: str | None, start: int, groups: Sequence[str], width: int,
                 valid: int) -> None:
        super().__init__(parent, salt, start, groups, width)
        self.valid = valid

    def adjacent(self) -> bool:
        """Whether it still continues its parent's run (a trim or an append there leaves it behind)."""
        parent = self.parent
        return parent is not None and parent.tail is self and self.start == parent.start + len(parent.held)

    def block(self, i: int) -> bytes:
        """Its ``valid`` packed token ids (``tokens`` is padded to a whole block)."""
        return bytes(self.tokens[:8 * self.valid])


class PendingPrefix:
    """A prefix not hung in the tree yet: a running request's, or the blocks a request left cached (module doc)."""

    __slots__ = ("blocks", "cache", "children", "first", "held", "parent", "request", "salt", "start", "tail",
                 "users", "width")

    def __init__(self, salt: str | None, first: bytes, request: object, cache: object, width: int) -> None:
        self.salt = salt
        self.first = first  # the first token, packed
        self.request = request  # its tokens are the prefix's (a Request owns them: they never change in place)
        self.cache = cache  # the running request's SequenceCache; None once it let go
        self.width = width
        self.blocks: dict[str, list[int]] = {}
        self.held: list[int] = []
        # what RadixTree.detach reads of a run: a pending prefix is never trimmed, never a child, never used
        self.start = 0
        self.parent = None
        self.users = 0
        self.children: Mapping = _NONE
        #: tokens of a finished request's partial last block parked at the last position (0: none; a TailRun once hung)
        self.tail = 0

    def __len__(self) -> int:
        return len(self.held)

    def block(self, i: int) -> bytes:
        """Position ``i``'s packed token ids."""
        n = self.width // 8
        end = i * n + self.tail if self.tail and i == len(self.held) - 1 else (i + 1) * n
        return pack_tokens(self.request.all_token_ids[i * n:end])  # type: ignore[attr-defined]


#: A stretch of new positions: (run, first offset, end offset).
Segment = tuple[RadixNode, int, int]


class RadixTree:
    """Runs of all reuse scopes; lookups are dict hits and token compares, pruning is O(positions removed).

    ``owners`` maps each layer group to its pool's block -> run list and block -> position list (a shared arena's
    groups share them): a split rewrites the runs of the positions that move to the new head run, a detach clears
    a block's run.
    """

    def __init__(self, owners: Mapping[str, tuple[MutableSequence[RadixNode | None], Sequence[int]]]) -> None:
        self.roots: dict[str | None, RadixNode] = {}
        self.pending: dict[str | None, dict[bytes, PendingPrefix]] = {}  # salt -> first token -> pending prefix
        # (salt, first token) -> caches keyed eagerly with no block in the tree yet (lazy keying: they may hang a
        # run starting with that token later, so no pending prefix may be noted under it meanwhile)
        self.latent: dict[tuple[str | None, bytes], int] = {}
        self.num_nodes = 0  # block positions
        #: tails whose run was trimmed or removed under them: no hit copies them, their blocks wait to be evicted
        self.loose: set[TailRun] = set()
        self.owners = {g: node for g, (node, _) in owners.items()}
        self.positions = {g: pos for g, (_, pos) in owners.items()}
        self.groups = list(owners)
        #: Raised by every change a whole-block lookup can see (``PrefixLookup.cached_prefixes``): a run's tokens,
        #: positions, held counts or blocks (which of them are -1), children or place (a split, an unhook, a trim,
        #: a root gone), a pending prefix noted. Not by what no lookup reads: users, keys, block ids (a slab
        #: compaction's renumbering), tails (``TailRun``), the ``latent`` counts, a pending prefix's own blocks or its
        #: drop (a lookup hangs a pending prefix of its first token, so once one is looked up none is left there
        #: until ``add_pending`` notes another: that raises it).
        self.version = 0
        #: per waiting request, what a lookup answered while ``version`` was ``looked_at`` (the cache-aware pass's
        #: answers, kept across steps; cleared when the version moves; a request's own dropped when it is admitted,
        #: its tokens grow from then on, or freed: one aborted while waiting is not kept)
        self.looked: dict[object, tuple[int, bool]] = {}
        self.looked_at = 0

    def root(self, salt: str | None) -> RadixNode | None:
        """The root of a reuse scope, if it has any run."""
        return self.roots.get(salt)

    def _root(self, salt: str | None) -> RadixNode:
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = RadixNode(None, salt, 0, (), 0)
        return root

    # --- a cache's path --------------------------------------------------------------------------

    def extend(self, last: RadixNode | None, salt: str | None, packed: bytes,
               tokens_per_block: int) -> tuple[RadixNode, list[Segment]]:
        """Continue the path that ends at ``last``'s end (``None``: the salt's root) with the consecutive full blocks
        of ``packed`` (:func:`~cache_backends.hashing.pack_tokens`): existing positions are followed, missing ones
        appended (to ``last`` itself when the path is its only user and nothing branches from it, else as a new
        child run). Every run the path newly enters gains a user; a run the path would end inside is split.
        Returns the run the path now ends at and the new positions' segments, in order."""
        node = last if last is not None else self._root(salt)
        stride = 8 * tokens_per_block
        end = len(packed) // stride * stride
        segs: list[Segment] = []
        at = 0
        while at < end:  # the positions that exist already
            child = node.children.get(packed[at:at + stride])
            if child is None:
                break
            child.users += 1
            toks, i, n = child.tokens, 1, len(child.held)
            at += stride
            while i < n and at < end and toks[i * stride:(i + 1) * stride] == packed[at:at + stride]:
                i += 1
                at += stride
            if i < n:  # the path ends inside ``child``: its head becomes a run of its own
                top = self._split(child, i)
                child.users -= 1
                segs.append((top, 0, i))
                node = top
                break
            segs.append((child, 0, i))
            node = child
        if at == end:
            return node, segs
        if node.parent is None or node.users != 1 or node.children:  # a new child run
            run = RadixNode(node, salt, node.start + len(node.held), self.groups, stride)
            first = packed[at:at + stride]
            children = node.children
            if children is _NONE:
                node.children = {first: run}
            else:
                children[first] = run  # type: ignore[index]
                node.index(first, run)
            run.users = 1
            node = run
        lo = self.append(node, packed[at:end], tokens_per_block)
        segs.append((node, lo, len(node.held)))
        return node, segs

    def append(self, run: RadixNode, packed: bytes, tokens_per_block: int) -> int:
        """Add the full blocks of ``packed`` as new, empty positions at ``run``'s end (its one user's path grows and
        nothing branches from it: :meth:`extend`'s in-place case); the offset of the first one."""
        k = len(packed) // (8 * tokens_per_block)
        lo = len(run.held)
        self.version += 1  # (extend's new positions too: they come here)
        run.tokens += packed[:k * 8 * tokens_per_block]
        run.held += [0] * k
        empty = [-1] * k
        for blocks in run.blocks.values():
            blocks += empty
        self.num_nodes += k
        return lo

    def claim(self, run: RadixNode, i: int) -> RadixNode:
        """A cache takes the path ending at position ``i`` of ``run`` (split there if it is not the run's last):
        every run on it gains a user. Returns the run the path ends at."""
        if i + 1 < len(run.held):
            run = self._split(run, i + 1)
        node: RadixNode | None = run
        while node is not None and node.parent is not None:
            node.users += 1
            node = node.parent
        return run

    def leave(self, last: RadixNode) -> None:
        """A cache lets go of the path ending at ``last``: each run loses a user, and the ones left unused and
        childless are trimmed as :meth:`trim` does."""
        node: RadixNode | None = last
        while node is not None and node.parent is not None:
            node.users -= 1
            parent = node.parent
            if not node.users and not node.children:
                self.trim(node)
            node = parent

    def position(self, last: RadixNode, p: int) -> tuple[RadixNode, int]:
        """The (run, offset) of block position ``p`` on the path that ends at ``last``."""
        node = last
        while node.start > p:
            node = node.parent  # type: ignore[assignment]
        return node, p - node.start

    def path_blocks(self, last: RadixNode, n: int, group: str) -> list[int]:
        """``group``'s block (-1: none) at each of the first ``n`` positions of the path that ends at ``last``
        (which holds position ``n - 1``)."""
        parts = [last.blocks[group][: n - last.start]]
        node = last.parent
        while node is not None and node.parent is not None:
            parts.append(node.blocks[group])
            node = node.parent
        if len(parts) == 1:
            return parts[0]
        return list(chain.from_iterable(reversed(parts)))  # at C speed: a hit's path, in every group, every step

    # --- blocks -----------------------------------------------------------------------------------

    def detach(self, group: str, blocks: Sequence[int]) -> None:
        """Unhook ``group``'s evicted or dropped ``blocks`` from their runs (the pool's ``node[b]`` at ``pos[b]``,
        cleared here) and trim every run left with an empty, unused, childless tail, as :meth:`trim` does."""
        owner, pos = self.owners[group], self.positions[group]
        runs: list[RadixNode] = []  # each run once per stretch of its blocks, trimmed after the loop
        prev = None
        for b in blocks:
            run = owner[b]
            owner[b] = None
            i = pos[b] - run.start  # type: ignore[union-attr]
            run.blocks[group][i] = -1  # type: ignore[union-attr]
            run.held[i] -= 1  # type: ignore[union-attr]
            if run is not prev:
                runs.append(run)  # type: ignore[arg-type]
                prev = run
        self._trim_detached(runs)

    def detach_mixed(self, names: Sequence[str], blocks: Sequence[int], groups: Sequence[int]) -> None:
        """:meth:`detach` of blocks of several groups in one pass, ``blocks[k]`` of group ``names[groups[k]]``: what a
        detach per group leaves (trimming is confluent). The groups must share one pool's block -> run and block ->
        position lists (a shared arena's groups do).

        Why: a decode's block boundary on a shared arena evicts a block or two of each of many groups (Gemma 3 27B:
        31), in eviction order, so a call per group cost more than the blocks' own work."""
        owner, pos = self.owners[names[0]], self.positions[names[0]]
        runs: list[RadixNode] = []
        prev = None
        start, by_group, held = 0, {}, []  # the current run's (read once per stretch of its blocks, not per block)
        for b, g in zip(blocks, groups, strict=True):  # this loop runs for every evicted block: kept lean
            run = owner[b]
            owner[b] = None
            if run is not prev:  # the groups' blocks of one position, evicted together, are in one run
                runs.append(run)  # type: ignore[arg-type]
                prev = run
                start, by_group, held = run.start, run.blocks, run.held  # type: ignore[union-attr]
            i = pos[b] - start
            by_group[names[g]][i] = -1
            held[i] = held[i] - 1
        self._trim_detached(runs)

    def _trim_detached(self, runs: list[RadixNode]) -> None:
        """Trim each of ``runs`` (runs that just lost blocks) as :meth:`trim` does when it is left with an empty,
        unused, childless tail, or drop a released request's pending prefix left with nothing."""
        for run in runs:  # trimming is confluent: once after the batch leaves what once per block would
            if run.parent is not None:
                self.version += 1  # a run in the tree lost blocks (a pending prefix's lose none a lookup reads)
                if not run.users and not run.children and not run.held[-1]:
                    self.trim(run)
            elif type(run) is PendingPrefix and run.cache is None and not run.held[0] and not any(run.held) \
                    and self.pending_prefix(run.salt, run.first) is run:  # (listed again if its blocks interleave)
                self.drop_pending(run)  # a released request's pending prefix with nothing left
            # (else a run a trim above unhooked, or a running request's pending prefix: nothing to do)

    def trim(self, run: RadixNode) -> None:
        """Drop ``run``'s tail positions that hold no block (it has no user and no child); emptied, unhook it and
        go on with its parent while that is left unused and childless; forget a root left without children. A
        :class:`TailRun` the trim leaves behind goes :attr:`loose`."""
        node = run
        while node.parent is not None:
            held = node.held
            k = len(held)
            while k and not held[k - 1]:
                k -= 1
            self.num_nodes -= len(held) - k
            if k < len(held):
                self.version += 1
                if node.tail is not None:
                    self.loose.add(node.tail)
                    node.tail = None
            if k:
                if k < len(held):
                    del node.tokens[k * node.width:], held[k:]
                    for blocks in node.blocks.values():
                        del blocks[k:]
                    if node.keys:
                        node.keys = {j: key for j, key in node.keys.items() if j < k}
                return
            parent = node.parent
            self._unhook(node)  # (the version was raised above: an unhooked run had positions to drop)
            if type(node) is TailRun or parent.users or parent.children:  # (a tail's parent trims on its own)
                return
            node = parent
        if not node.children and self.roots.get(node.salt) is node:
            del self.roots[node.salt]

    def _split(self, run: RadixNode, i: int) -> RadixNode:
        """Cut ``run`` before its position ``i`` (0 < i < len): the head becomes a new run in its place (the same
        users, the same place among its parent's children), ``run`` keeps the tail as its only child."""
        self.version += 1  # the same prefixes, but the run and offset a walk ends at move
        w = run.width
        top = RadixNode(run.parent, run.salt, run.start, (), w)
        top.tokens = run.tokens[:i * w]
        del run.tokens[:i * w]
        if run.keys:
            keys = run.keys
            top.keys = {j: key for j, key in keys.items() if j < i}
            run.keys = {j - i: key for j, key in keys.items() if j >= i}
        top.held, run.held = run.held[:i], run.held[i:]
        owners = self.owners
        for g, blocks in run.blocks.items():
            head = top.blocks[g] = blocks[:i]
            del blocks[:i]
            owner = owners[g]
            for b in head:
                if b >= 0:
                    owner[b] = top
        top.users = run.users
        run.start += i
        parent = run.parent
        assert parent is not None
        first = top.block(0)
        parent.children[first] = top  # type: ignore[index]  # an existing key: its place is kept
        parent.index(first, top)
        top.children = {run.block(0): run}
        run.parent = top
        return top

    def _unhook(self, node: RadixNode) -> None:
        """Remove ``node`` from its parent's child indexes."""
        parent = node.parent
        assert parent is not None
        if type(node) is TailRun:  # not among the children (and, replaced or left behind, maybe not the tail)
            if parent.tail is node:
                parent.tail = None
            else:
                self.loose.discard(node)
            node.parent = None
            return
        first = node.block(0)
        del parent.children[first]  # type: ignore[attr-defined]
        if parent.by_first is not None:
            for index, key in ((parent.by_first, first[:8]), (parent.by_two, first[:16])):
                siblings = index[key]
                del siblings[first]
                if not siblings:
                    del index[key]
        node.parent = None

    # --- pending prefixes (lazy keying) ---------------------------------------------------------------

    def pending_prefix(self, salt: str | None, first: bytes) -> PendingPrefix | None:
        """The pending prefix of ``salt`` whose first token is ``first`` (packed), if any."""
        by_first = self.pending.get(salt)
        return by_first.get(first) if by_first else None

    def add_pending(self, prefix: PendingPrefix) -> None:
        """Note a new pending prefix (its first token is nobody else's: the caller checked)."""
        self.version += 1  # a lookup with its first token now hangs it first
        by_first = self.pending.get(prefix.salt)
        if by_first is None:
            self.pending[prefix.salt] = {prefix.first: prefix}
        else:
            by_first[prefix.first] = prefix

    def drop_pending(self, prefix: PendingPrefix) -> None:
        """Forget a pending prefix (hung in the tree, or nothing of it left)."""
        by_first = self.pending[prefix.salt]
        del by_first[prefix.first]
        if not by_first:
            del self.pending[prefix.salt]

    # --- keys ------------------------------------------------------------------------------------

    def key(self, run: RadixNode, i: int) -> bytes:
        """The chained SHA-256 key of the prefix ending with position ``i`` of ``run``; computed once, on demand.

        Iterative: the positions before it without a key yet are hashed from the nearest keyed one on, a run's
        stretch in one :func:`~cache_backends.hashing.chain_packed_hashes` call (chains can be thousands of blocks
        deep)."""
        got = run.keys.get(i)
        if got is not None:
            return got
        todo: list[tuple[RadixNode, int, int]] = []  # (run, first offset to hash, last offset), deepest first
        node, j = run, i
        parent_key: bytes | None = None
        while True:
            lo = j
            keys = node.keys
            while lo > 0 and (lo - 1) not in keys:
                lo -= 1
            todo.append((node, lo, j))
            if lo > 0:
                parent_key = keys[lo - 1]
                break
            node = node.parent  # type: ignore[assignment]
            if node.parent is None:
                break
            j = len(node.held) - 1
            if j in node.keys:
                parent_key = node.keys[j]
                break
        for node, lo, hi in reversed(todo):
            w = node.width
            got_keys = chain_packed_hashes(node.tokens[lo * w:(hi + 1) * w], w // 8, node.salt, parent_key)
            node.keys.update(zip(range(lo, hi + 1), got_keys, strict=True))
            parent_key = got_keys[-1]
        return parent_key  # type: ignore[return-value]

    def parent_key(self, run: RadixNode, i: int) -> bytes | None:
        """The key of the position before position ``i`` of ``run`` (None at a prefix's first block)."""
        if i:
            return self.key(run, i - 1)
        parent = run.parent
        if parent is None or parent.parent is None:
            return None
        return self.key(parent, len(parent.held) - 1)

    def tails(self) -> Iterator[TailRun]:
        """Every :class:`TailRun`: the runs' tails, then the loose ones (for checks and tests)."""
        for node in self.nodes():
            if node.tail is not None:
                yield node.tail
        yield from self.loose

    def nodes(self) -> Iterator[RadixNode]:
        """Every non-root run (for checks and tests)."""
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            for child in node.children.values():
                yield child
                stack.append(child)
