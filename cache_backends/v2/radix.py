"""The prefix-reuse radix tree: one node per full block of ``T`` tokens, found by its tokens, keyed lazily.

One root per reuse salt, so tenants never see each other's nodes (the salt is also inside every
key). A node at depth ``d`` stands for tokens ``[d*T, (d+1)*T)`` of every sequence whose first
``(d+1)*T`` tokens are the path's tokens, and holds, per layer group, at most one physical block that
ends exactly at ``(d+1)*T`` (compressed groups with blocks of ``k*T`` tokens hold one on every
k-th node). Invariants:

* ``node.blocks[g] == b`` if and only if the group pool's ``node[b] is node``.
* ``node.users`` counts the live caches whose path runs through the node; a node is pruned when
  it has no blocks, no children and no users, and pruning walks up towards the root.
* ``node.tokens`` is the block's token ids packed as the key encodes them
  (:func:`cache_backends.hashing.pack_tokens`: 8 bytes each): no per-token objects to hold or free.
  ``parent.children`` maps exactly those bytes to the node: a lookup compares a block's tokens (under
  its parent, under its salt's root), which is the prefix equality the chained key stands for, exactly.
* ``node.key`` is the chained SHA-256 key of the prefix up to the node
  (:func:`cache_backends.hashing.block_hash` of the parent's key, the tokens and the salt), computed on
  first use and kept: lookups never need it, only what names blocks to the outside (KV cache events),
  so a block that nobody reports is never hashed (the hashing was most of what reuse cost per block).
* ``node.by_first``, once built, maps each first token (its 8 packed bytes) to exactly the children
  whose block starts with it, in the order of ``node.children``: partial matching only looks at children that share
  the first token (any other child matches zero tokens), so it does not scan every child of a wide
  node. It is built the first time partial matching (or an admission's first-token check, at a root) asks a
  node with more than ``INDEX_CHILDREN_AFTER`` children, and kept from then on; other nodes (most: the blocks
  of one prompt have a single child each, and only nodes where a lookup ends are asked) never pay for it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType

from cache_backends.hashing import chain_packed_hashes, pack_tokens

#: What a node without children holds in ``children``: most nodes are leaves (a prompt's last
#: blocks), so they get a dict only when a first child arrives.
_NONE: Mapping = MappingProxyType({})

#: A node indexes its children by first token once partial matching asks it with more children than this.
INDEX_CHILDREN_AFTER = 8


class RadixNode:
    """One full token block of a cached prefix."""

    __slots__ = ("_key", "blocks", "by_first", "children", "depth", "parent", "salt", "tokens", "users")

    def __init__(self, parent: RadixNode | None, tokens: bytes, salt: str | None) -> None:
        self._key: bytes | None = None  # computed by ``key`` on first use
        self.parent = parent
        self.tokens = tokens
        self.salt = salt
        self.depth = -1 if parent is None else parent.depth + 1
        self.children: Mapping[bytes, RadixNode] = _NONE  # tokens -> child; a dict once it has a child
        self.by_first: dict[bytes, dict[bytes, RadixNode]] | None = None  # built on demand, see the module doc
        self.blocks: dict[str, int] = {}
        self.users = 0

    @property
    def key(self) -> bytes | None:
        """The chained SHA-256 key of the prefix ending with this block (None for a root); computed once, on demand.

        Iterative: the ancestors without a key yet are hashed from the nearest keyed one down (chains can be
        thousands of blocks deep).
        """
        if self._key is not None or self.parent is None:
            return self._key
        todo: list[RadixNode] = []
        node: RadixNode | None = self
        while node is not None and node.parent is not None and node._key is None:
            todo.append(node)
            node = node.parent
        parent_key = node._key if node is not None else None
        for n in reversed(todo):
            parent_key = n._key = chain_packed_hashes(n.tokens, len(n.tokens) // 8, n.salt, parent_key)[0]
        return self._key

    @property
    def is_root(self) -> bool:
        """Whether this is a salt's root (no tokens of its own)."""
        return self.parent is None

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The block's token ids (unpacked from :attr:`tokens`)."""
        return struct.unpack(f"<{len(self.tokens) // 8}q", self.tokens)

    def has_child_starting_with(self, first: bytes) -> bool:
        """Whether any child's block starts with the token packed as ``first`` (8 bytes): an admission that
        matches nothing, not even part of a block, is told so without packing or comparing a whole block."""
        if self.by_first is None:
            if len(self.children) <= INDEX_CHILDREN_AFTER:
                return any(tokens.startswith(first) for tokens in self.children)
            self._index_by_first()
        return first in self.by_first  # type: ignore[operator]

    def _index_by_first(self) -> None:
        """Build :attr:`by_first` (see the module doc); kept up to date by the tree from then on."""
        by_first: dict[bytes, dict[bytes, RadixNode]] = {}
        for tokens, child in self.children.items():
            by_first.setdefault(tokens[:8], {})[tokens] = child
        self.by_first = by_first

    def children_starting_with(self, token: int) -> list[RadixNode]:
        """The children whose block starts with ``token``, in insertion order."""
        first = pack_tokens((token,))
        if self.by_first is None:
            if len(self.children) <= INDEX_CHILDREN_AFTER:
                return [child for child in self.children.values() if child.tokens.startswith(first)]
            self._index_by_first()
        group = self.by_first.get(first)  # type: ignore[union-attr]
        return list(group.values()) if group else []


class RadixTree:
    """Nodes of all reuse scopes; lookups are dict hits, pruning is O(depth removed)."""

    def __init__(self) -> None:
        self.roots: dict[str | None, RadixNode] = {}
        self.num_nodes = 0

    def root(self, salt: str | None) -> RadixNode | None:
        """The root of a reuse scope, if it has any node."""
        return self.roots.get(salt)

    def extend(self, parent: RadixNode | None, salt: str | None, packed: bytes,
               tokens_per_block: int) -> list[RadixNode]:
        """The chain of nodes below ``parent`` (``None``: the salt's root) for the consecutive full blocks of
        ``packed`` (:func:`~cache_backends.hashing.pack_tokens`; block ``i`` is tokens ``[i*T, (i+1)*T)``), each
        with one more user, created when missing. One call per run of blocks."""
        if parent is None:
            parent = self.roots.get(salt)
            if parent is None:
                parent = self.roots[salt] = RadixNode(None, b"", salt)
        stride = 8 * tokens_per_block
        end = len(packed) // stride * stride
        out: list[RadixNode] = []
        start = 0
        while start < end:  # the nodes that exist already
            block_tokens = packed[start:start + stride]
            node = parent.children.get(block_tokens)
            if node is None:
                break
            node.users += 1
            out.append(node)
            parent = node
            start += stride
        if start == end:
            return out
        # The first missing block: a new child of ``parent`` (which may have others and a first-token index) ...
        node = RadixNode(parent, block_tokens, salt)
        children = parent.children
        if children is _NONE:
            parent.children = {block_tokens: node}
        else:
            children[block_tokens] = node  # type: ignore[index]
            if parent.by_first is not None:
                siblings = parent.by_first.get(block_tokens[:8])
                if siblings is None:
                    parent.by_first[block_tokens[:8]] = {block_tokens: node}
                else:
                    siblings[block_tokens] = node
        node.users = 1
        out.append(node)
        self.num_nodes += (end - start) // stride
        # ... then every later block is the only child of the node just created: no lookup, no index.
        for at in range(start + stride, end, stride):
            block_tokens = packed[at:at + stride]
            parent, node = node, RadixNode(node, block_tokens, salt)
            parent.children = {block_tokens: node}
            node.users = 1
            out.append(node)
        return out

    def detach(self, group: str, nodes: Iterable[RadixNode]) -> None:
        """Unhook ``group``'s block from each node (evicted or dropped blocks) and prune every node left
        with no block, child or user, as :meth:`prune` does; one call for a run of blocks."""
        for node in nodes:
            blocks = node.blocks
            del blocks[group]
            if not blocks and not node.children and not node.users:
                self.prune(node)

    def leave(self, nodes: Iterable[RadixNode]) -> None:
        """A cache lets go of its path (pass it deepest first): each node loses a user; nodes left with no
        block, child or user are pruned."""
        for node in nodes:
            node.users -= 1
            if not node.users and not node.blocks and not node.children:  # else prune() would keep it
                self.prune(node)

    def prune(self, node: RadixNode) -> None:
        """Remove ``node`` and then its ancestors while they hold nothing and nobody uses them."""
        while node.parent is not None and not node.blocks and not node.children and node.users == 0:
            node = self._unhook(node)
            self.num_nodes -= 1
        self._drop_empty_root(node)

    @staticmethod
    def _unhook(node: RadixNode) -> RadixNode:
        """Remove ``node`` from its parent's child indexes; return the parent."""
        parent = node.parent
        del parent.children[node.tokens]  # type: ignore[attr-defined]
        if parent.by_first is not None:
            siblings = parent.by_first[node.tokens[:8]]
            del siblings[node.tokens]
            if not siblings:
                del parent.by_first[node.tokens[:8]]
        node.parent = None
        return parent

    def _drop_empty_root(self, node: RadixNode) -> None:
        """Forget a salt's root once it has no child left."""
        if node.parent is None and not node.children and self.roots.get(node.salt) is node:
            del self.roots[node.salt]

    def nodes(self) -> Iterator[RadixNode]:
        """Every non-root node (for checks and tests)."""
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            for child in node.children.values():
                yield child
                stack.append(child)
