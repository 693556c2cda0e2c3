"""One request's V2 cache: block tables per layer group, the three lengths, and its life-cycle state."""

from __future__ import annotations

import enum
import sys

import attrs

from cache_backends.request import Request
from cache_backends.v2.radix import PendingPrefix, RadixNode

#: ``SequenceCache.key_at`` when prefix reuse is off: no commit ever reaches it.
NEVER = sys.maxsize


class CacheState(enum.Enum):
    """Where a cache's pages are."""

    SUSPENDED = "suspended"  # no device blocks: new (not admitted yet) or moved to the host tier
    ACTIVE = "active"  # block tables point at device blocks


@attrs.define(eq=False)
class SequenceCache:
    """Per-request cache. Life cycle: create (suspended) → resume → allocate/commit/resize → suspend → resume → close.

    Invariants (checked by ``KVCacheManagerV2.check_invariants``):

    * ``committed <= history <= capacity``: committed tokens have their KV written and final;
      ``history`` also counts tokens scheduled this step (KV being written); ``capacity`` is the
      number of token slots reserved.
    * While active, ``tables[g]`` has ``ceil(capacity / tokens_per_block(g))`` entries: a physical block
      id, or -1 for a sliding group's block that fell wholly out of the window (logical blocks below
      ``released[g]``).
    * ``room <= min over groups of len(tables[g]) * tokens_per_block(g)``: growing ``capacity`` up to
      ``room`` needs no block (``schedule_tokens``, ``schedule_decode`` and ``resize`` set it exactly, releasing
      resets it to 0).
    * ``keyed == committed // T`` full committed ``T``-token blocks are on the cache's radix path, which ends at
      the end of run ``last`` (``None``: no block yet, or prefix reuse off): ``last.start + len(last) == keyed``.
      ``key_at == (keyed + 1) * T``: the commit that reaches it fills a block to hang in the tree (:data:`NEVER`
      with reuse off). A cache keyed lazily (``pending``, see :mod:`cache_backends.v2.radix`) has none: ``keyed``
      is 0, ``last`` None and ``key_at`` :data:`NEVER` until a later admission hangs its prefix in the tree.
    * ``slide_at``: no sliding group releases a block before ``committed`` reaches it (the smallest
      ``(released[g] + 1) * tokens_per_block(g) + window(g) - 1``), so commits below it skip the window check.
    * While suspended after admission, ``host[g]`` maps each logical block to its host slot (-1: none),
      and ``reclaim[g][j] = (block, gen)`` remembers cached device blocks that can be taken back as-is.
    """

    request: Request
    tables: dict[str, list[int]]
    released: dict[str, int]
    state: CacheState = CacheState.SUSPENDED
    admitted: bool = False
    committed: int = 0
    history: int = 0
    capacity: int = 0
    room: int = 0  # a lower bound of the token slots every group's table holds (so growing up to it allocates nothing)
    key_at: int = NEVER
    slide_at: int = 0  # the commit that may let a window release a block (0: check at the next commit)
    last: RadixNode | None = None  # the radix run where the cache's path ends
    keyed: int = 0  # blocks on that path
    pending: PendingPrefix | None = None  # keyed lazily: its note in the tree's pending prefixes
    latent: bytes | None = None  # with lazy keying, keyed eagerly but no block in the tree yet: its first token
    host: dict[str, list[int]] | None = None
    reclaim: dict[str, dict[int, tuple[int, int]]] = attrs.Factory(dict)
    reused_tokens: int = 0
    partial_hit: bool = False
    worst: int = -1  # the request's worst-case tokens, for admission's headroom estimate (-1: not computed yet)
    cut_tables: list | None = None  # with the cuts tied: a CutTables per logical group (block_tables)

    @property
    def is_active(self) -> bool:
        """Whether the cache holds device blocks."""
        return self.state is CacheState.ACTIVE
