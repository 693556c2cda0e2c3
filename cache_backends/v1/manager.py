"""``KVCacheManager`` (V1): one pool of uniform blocks, per-request block tables, full-block prefix reuse.

Every layer keeps every token at one entry size, so a request needs ``ceil(tokens / T)`` blocks and
one block table serves all layers. With ``enable_block_reuse`` each full block is keyed by the
chained hash of ``cache_backends.hashing`` (parent key, its tokens, the request's salt); a new
request takes back the longest run of cached blocks matching its prompt, in use by others or
evictable (freed, not yet overwritten). Reuse never covers the whole prompt: at least the last
prompt token is computed, so the forward has logits to sample from. V1 reuses full blocks only.
A request with ``skip_prefix_read`` (one that scores its prompt) finds no prefix but still caches its
full blocks as they are committed; where an equal block is cached already, the map keeps that one and
the request's copy stays unkeyed, freed as empty when the request lets go.

``fork(parent, child)`` admits a request holding the parent's committed KV: a sample of the same prompt the
moment the parent's prefill is committed (``n > 1``), or a beam that extends the parent's sequence by another
token (beam search) at any committed length. The parent's whole committed blocks are shared (one more owner
each) and its last, partial block is copied into one of the child's own (copy-on-write: the parent goes on
writing its own tokens there). It needs no prefix reuse: it is the parent's own KV.

Allocation API for a scheduler, in the order it is used::

    hit = manager.find_prefix(request)           # pure: what the prefix cache holds for the prompt
    manager.blocks_needed(request, hit)          # worst-case blocks admission would take from the free pool
    manager.admit(request, hit)                  # take the hit; num_computed/num_reused_tokens = hit tokens
    manager.allocate_slots(request, n) -> bool   # blocks for the next n tokens (False: not enough free)
    manager.blocks_to_completion(request)        # blocks still to allocate before the worst case
    manager.fork_blocks_needed(parent, child)    # worst-case blocks a fork of the parent's committed KV takes
    manager.fork(parent, child)                  # admit child holding parent's committed KV (samples, beams)
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from cache_backends.block_pool import BlockPool, KVBlock
from cache_backends.hashing import block_hash, chain_hashes
from cache_backends.interface import ManagerOptions, prefix_cache_in_use
from cache_backends.kv_events import KvEventBuffer
from cache_backends.pools import BlockPools
from cache_backends.request import Request
from cache_backends.stats import GroupStats, ManagerStats, ReuseStats


@attrs.frozen
class PrefixHit:
    """Cached blocks matching the start of a prompt, with their chained keys."""

    blocks: tuple[KVBlock, ...] = ()
    keys: tuple[bytes, ...] = ()
    tokens_per_block: int = 1

    @property
    def num_tokens(self) -> int:
        """Prompt tokens whose KV the hit holds."""
        return len(self.blocks) * self.tokens_per_block


@attrs.define
class _Sequence:
    blocks: list[KVBlock] = attrs.Factory(list)
    keys: list[bytes] = attrs.Factory(list)  # chained keys of the leading full, computed blocks


class KVCacheManager:
    """V1 manager over a one-group uniform layout; implements ``KVCacheManagerProtocol``."""

    #: :meth:`fork` takes a parent at any committed length past its prompt (beam search's beams), not only at its end
    forks_past_prompt = True

    def __init__(self, pools: BlockPools, options: ManagerOptions) -> None:
        layout = pools.layout
        groups = layout.groups
        if len(groups) != 1 or not groups[0].keeps_all_tokens or groups[0].compress_rate is not None:
            names = ", ".join(f"{g.name} ({g.kind})" for g in groups)
            raise ValueError(f"KVCacheManager (V1) needs one uniform layer group (a 'v1' layout), got {names}")
        self.layout = layout
        self.pools = pools
        self.options = options
        self.group = groups[0].name
        self.tokens_per_block = groups[0].tokens_per_block
        self.pool = BlockPool(pools.num_blocks[self.group])
        self._seqs: dict[Request, _Sequence] = {}
        self.reuse_hit_tokens = 0  # prompt tokens served from the prefix cache
        self.reuse_query_tokens = 0  # prompt tokens of admitted requests (the hit rate's denominator)
        self.closed = False
        self.kv_events: KvEventBuffer | None = None

    def enable_kv_events(self, buffer: KvEventBuffer) -> None:
        """Record stored / removed / cleared prefix-cache blocks into ``buffer`` from now on."""
        self.kv_events = buffer
        self.pool.on_evict = lambda keys: buffer.removed(keys, self.group)

    # --- sizes --------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocation can take now (empty + evictable)."""
        return self.pool.num_free

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens of one sequence."""
        return math.ceil(max(num_tokens, 0) / self.tokens_per_block)

    def worst_case_tokens(self, request: Request) -> int:
        """Tokens the request holds at its longest: prompt + max_new_tokens, capped at ``max_seq_len``."""
        return min(request.max_total_tokens, self.options.max_seq_len)

    def max_blocks(self, request: Request) -> int:
        """Blocks the request holds at its longest (:meth:`worst_case_tokens`): the no-evict worst case."""
        return self.blocks_for_tokens(self.worst_case_tokens(request))

    def never_fits(self, request: Request) -> str | None:
        """Why ``request`` could never be admitted, even into an empty pool, or None."""
        limit = self.options.max_seq_len
        if request.num_prompt_tokens > limit:
            return (f"request {request.req_id} has a {request.num_prompt_tokens}-token prompt, longer than "
                    f"max_seq_len={limit}; it can never be admitted")
        need = self.max_blocks(request)
        if need > self.num_blocks:
            tokens = self.worst_case_tokens(request)
            capped = f", capped at max_seq_len={limit}" if tokens < request.max_total_tokens else ""
            return (f"request {request.req_id} needs {need} blocks for {tokens} tokens (prompt + max_new_tokens"
                    f"{capped}) but the pool holds {self.num_blocks} blocks of {self.tokens_per_block} tokens; "
                    "it can never be admitted")
        return None

    def knows(self, request: Request) -> bool:
        """Whether the request was admitted and not freed."""
        return request in self._seqs

    # --- admission ----------------------------------------------------------------------------

    def find_prefix(self, request: Request) -> PrefixHit:
        """The longest run of cached full blocks matching the prompt, leaving at least its last token to compute
        (none for a request that reads no cached prefix: ``Request.skip_prefix_read``)."""
        T = self.tokens_per_block
        if not self.options.enable_block_reuse or request.skip_prefix_read:
            return PrefixHit(tokens_per_block=T)
        tokens = request.all_token_ids  # a sample forked without room waits with its first token: it may claim more
        blocks: list[KVBlock] = []
        keys: list[bytes] = []
        parent = None
        for i in range((len(tokens) - 1) // T):
            key = block_hash(parent, tokens[i * T:(i + 1) * T], request.salt)
            block = self.pool.lookup(key)
            if block is None:
                break
            blocks.append(block)
            keys.append(key)
            parent = key
        return PrefixHit(tuple(blocks), tuple(keys), T)

    def blocks_needed(self, request: Request, hit: PrefixHit | None = None) -> int:
        """Free blocks admitting ``request`` with ``hit`` costs at worst: new blocks plus evictable hits it revives."""
        hit = hit or PrefixHit(tokens_per_block=self.tokens_per_block)
        revived = sum(1 for b in hit.blocks if b.ref_cnt == 0)
        return max(0, self.max_blocks(request) - len(hit.blocks)) + revived

    def admit(self, request: Request, hit: PrefixHit | None = None) -> None:
        """Start tracking ``request`` and take its prefix hit: its KV counts as computed (and reused)."""
        if request in self._seqs:
            raise ValueError(f"request {request.req_id} is already admitted")
        if self.closed:
            raise RuntimeError("the KV cache manager is closed")
        hit = hit or PrefixHit(tokens_per_block=self.tokens_per_block)
        for block, key in zip(hit.blocks, hit.keys, strict=True):
            if block.block_hash != key:  # something was allocated between find_prefix and admit
                raise ValueError(f"request {request.req_id}: stale prefix hit (block {block.block_id} was evicted)")
        self.pool.touch(hit.blocks)
        self._seqs[request] = _Sequence(list(hit.blocks), list(hit.keys))
        request.num_computed_tokens = request.num_reused_tokens = hit.num_tokens
        self.reuse_hit_tokens += hit.num_tokens
        if not request.skip_prefix_read:  # one that reads no prefix asked the cache nothing
            self.reuse_query_tokens += request.num_prompt_tokens

    def fork_blocks_needed(self, parent: Request, child: Request) -> int:
        """Free blocks :meth:`fork` of ``parent``'s committed KV into ``child`` costs at worst: the child's worst case
        less the parent's whole committed blocks it shares (the copied partial block is one of its own)."""
        return max(0, self.max_blocks(child) - parent.num_computed_tokens // self.tokens_per_block)

    def fork(self, parent: Request, child: Request) -> bool:
        """Admit ``child`` holding the parent's committed KV — its first ``L = parent.num_computed_tokens`` tokens,
        which must be the child's first ``L`` too, prompt included: the whole blocks shared, the last partial one
        copied into a block of the child's own; ``num_computed_tokens`` is ``L``, ``num_reused_tokens`` the prompt's
        length. A sample of an ``n > 1`` prompt forks in the step its parent's prefill is committed (``L`` is the
        prompt), a beam at any length past it (``engine.beam_search``). False (nothing changed) when no block is free
        for the copy.

        Nothing the parent writes past ``L`` into the copied block is read by the child: the child's own tokens
        overwrite the copy's tail before anything attends to it."""
        if child in self._seqs:
            raise ValueError(f"request {child.req_id} is already admitted")
        if self.closed:
            raise RuntimeError("the KV cache manager is closed")
        seq = self._seq(parent)
        P, L = parent.num_prompt_tokens, parent.num_computed_tokens
        if (L < P or child.prompt_token_ids != parent.prompt_token_ids or child.salt != parent.salt
                or child.num_tokens < L or child.token_span(P, L) != parent.token_span(P, L)):
            raise ValueError(f"request {child.req_id}: can fork only a computed prompt, and the tokens after it, equal "
                             f"to its own under its salt ({parent.req_id} has {min(L, P)} of {P} prompt tokens "
                             "computed)")
        T = self.tokens_per_block
        full, partial = divmod(L, T)
        if partial and self.pool.num_free < 1:
            return False
        shared = seq.blocks[:full]
        self.pool.touch(shared)
        blocks = list(shared)
        if partial:
            src, (copy,) = seq.blocks[full], self.pool.allocate(1)
            tensor = self.pools.tensors[self.group]
            tensor[:, copy.block_id].copy_(tensor[:, src.block_id])
            blocks.append(copy)
        self._seqs[child] = _Sequence(blocks, list(seq.keys[:full]))
        child.num_computed_tokens = L
        child.num_reused_tokens = P
        return True

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Whether :meth:`allocate_slots` would succeed now."""
        return self._new_blocks(request, num_new_tokens) <= self.pool.num_free

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Blocks for the next ``num_new_tokens`` tokens after ``num_computed_tokens``; False (no change) if short."""
        need = self._new_blocks(request, num_new_tokens)
        if need > self.pool.num_free:
            return False
        if need > 0:
            self._seqs[request].blocks.extend(self.pool.allocate(need))
        return True

    def blocks_to_completion(self, request: Request) -> int:
        """Blocks the request may still allocate before reaching its worst case (:meth:`worst_case_tokens`)."""
        return max(0, self.max_blocks(request) - len(self._seq(request).blocks))

    def _new_blocks(self, request: Request, num_new_tokens: int) -> int:
        if num_new_tokens < 0:
            raise ValueError(f"request {request.req_id}: num_new_tokens must be >= 0, got {num_new_tokens}")
        held = len(self._seq(request).blocks)
        return max(0, self.blocks_for_tokens(request.num_computed_tokens + num_new_tokens) - held)

    def _seq(self, request: Request) -> _Sequence:
        try:
            return self._seqs[request]
        except KeyError:
            raise KeyError(f"request {request.req_id} is not admitted in this KV cache manager") from None

    # --- protocol -----------------------------------------------------------------------------

    def block_table(self, request: Request, group: str) -> list[int]:
        """Physical block per logical block of ``request`` (empty when it holds none)."""
        if group != self.group:
            raise KeyError(f"V1 has one layer group, {self.group!r}; no group {group!r}")
        seq = self._seqs.get(request)
        return [b.block_id for b in seq.blocks] if seq is not None else []

    def block_tables(self, request: Request) -> list[list[int]]:
        """``block_table`` of every group (V1 has one), in ``layout.groups`` order."""
        return [self.block_table(request, self.group)]

    def commit(self, request: Request, num_tokens: int) -> None:
        """The next ``num_tokens`` tokens' KV is written: advance the count and cache newly full blocks."""
        seq = self._seq(request)
        done = request.num_computed_tokens + num_tokens
        if num_tokens < 0 or done > request.num_tokens:
            raise ValueError(f"request {request.req_id}: cannot commit {num_tokens} tokens "
                             f"({request.num_computed_tokens} computed of {request.num_tokens})")
        if done > len(seq.blocks) * self.tokens_per_block:
            raise ValueError(f"request {request.req_id}: commit of {num_tokens} tokens beyond its allocated slots "
                             f"({len(seq.blocks)} blocks of {self.tokens_per_block})")
        request.num_computed_tokens = done
        if not self.options.enable_block_reuse:
            return
        T = self.tokens_per_block
        full = done // T
        if full <= len(seq.keys):
            return
        first = len(seq.keys)
        tokens = request.all_token_ids[first * T:full * T]
        keys = chain_hashes(tokens, T, request.salt, seq.keys[-1] if seq.keys else None)  # = block_hash chained
        events = self.kv_events
        fresh = [block.block_hash is None for block in seq.blocks[first:full]] if events is not None else None
        for block, key in zip(seq.blocks[first:full], keys, strict=True):
            self.pool.cache(block, key)  # False: an equal block is cached already; keep that one
        if events is not None:
            self._stored(events, seq, first, keys, fresh, tokens, request.salt)
        seq.keys.extend(keys)

    def _stored(self, events: KvEventBuffer, seq: _Sequence, first: int, keys: list[bytes], fresh: Any,
                tokens: list[int], salt: str | None) -> None:
        """One ``kv_block_stored`` per run of blocks this commit newly cached (an equal block cached before is not)."""
        T = self.tokens_per_block
        run: list[int] = []
        for i in [*range(len(keys)), None]:
            if i is not None and fresh[i] and seq.blocks[first + i].block_hash == keys[i]:
                run.append(i)
                continue
            if run:
                start = first + run[0]
                parent = keys[run[0] - 1] if run[0] > 0 else (seq.keys[start - 1] if start > 0 else None)
                events.stored([keys[r] for r in run], parent, tokens[run[0] * T:(run[-1] + 1) * T], T, self.group,
                              salt=salt)
            run = []

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (cached ones stay evictable, the tail evicted first)."""
        seq = self._seqs.pop(request, None)
        if seq is not None:
            self.pool.free(reversed(seq.blocks))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (no later hit; every block empty); ``PrefixCacheInUseError`` while any
        request holds blocks."""
        if self.closed:
            raise RuntimeError("the KV cache manager is closed")
        if self._seqs:
            raise prefix_cache_in_use([r.req_id for r in self._seqs])
        self.pool.reset()
        if self.kv_events is not None:
            self.kv_events.cleared()

    def usage(self) -> float:
        """``stats().usage`` alone: used / total blocks."""
        return round(self.pool.usage, 6)

    def stats(self) -> ManagerStats:
        """Usage, free/evictable/used blocks, reuse hits in tokens (V1 never suspends, has no host tier)."""
        p = self.pool
        reuse = self.options.enable_block_reuse
        group = GroupStats(total=p.num_blocks, free=p.num_empty, evictable=p.num_evictable, used=p.num_used,
                           usage=round(p.usage, 6), evictions=p.evictions, tokens_per_block=self.tokens_per_block)
        return ManagerStats(
            kind="v1",
            usage=round(p.usage, 6),
            groups={self.group: group},
            requests=len(self._seqs),
            active=len(self._seqs),
            suspended=0,
            reuse_hit_tokens=self.reuse_hit_tokens,
            reuse_query_tokens=self.reuse_query_tokens,
            reuse_partial_hits=0,
            evictions=p.evictions,
            suspends=0,
            resumes=0,
            preemptions=0,
            host=None,
            host_bytes=0,
            reuse=ReuseStats(
                enabled=reuse,
                disabled_reason=None if reuse else "enable_block_reuse is false",
                unit_tokens=self.tokens_per_block if reuse else None,
                partial=False,
                partial_disabled_reason="V1 reuses full blocks only" if reuse else "prefix reuse is off",
                radix_nodes=0,
            ),
        )

    def close(self) -> None:
        """Free every request's blocks and release the device pools (idempotent)."""
        for request in list(self._seqs):
            self.free(request)
        self.pools.release()
        self.closed = True
