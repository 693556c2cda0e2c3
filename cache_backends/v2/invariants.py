"""V2's invariants checked whole: pools, tables, rows of a tied arena, the radix tree (:class:`Invariants`, a part
of :class:`~cache_backends.v2.manager.KVCacheManagerV2`; tests call :meth:`Invariants.check_invariants`)."""

from __future__ import annotations

import math

from cache_backends.hashing import pack_tokens
from cache_backends.v2.radix import RadixNode
from cache_backends.v2.sequence import NEVER, CacheState
from cache_backends.v2.shared_pool import GroupShare, SharedPool
from cache_backends.v2.slab_pool import SlabPool
from cache_backends.v2.tied_pool import TiedArena, TiedShare
from cache_backends.v2.token_runs import token_slice


class Invariants:
    """``check_invariants``: every invariant of the pools, tables and tree, checked whole (tests, debugging)."""

    def check_invariants(self) -> None:
        """Verify the bookkeeping (O(blocks + tokens)); raise ``AssertionError`` listing what is broken."""
        problems: list[str] = []
        on_host = sum(1 for c in self._caches.values() if c.host is not None)
        if on_host != self.num_on_host:
            problems.append(f"num_on_host {self.num_on_host}, but {on_host} caches hold host slots")
        active = {r for r, c in self._caches.items() if c.state is CacheState.ACTIVE}
        if active != self._active_requests:
            problems.append(f"{len(self._active_requests)} requests noted active, {len(active)} caches are "
                            f"(differ: {sorted(r.req_id for r in active ^ self._active_requests)})")
        owners: dict[str, dict[int, int]] = {g.name: {} for g in self._groups}
        on_path: dict[str, RadixNode] = {}  # each cache's last radix run
        for cache in self._caches.values():
            rid = cache.request.req_id
            if not cache.committed <= cache.history <= cache.capacity:
                problems.append(f"{rid}: lengths {cache.committed}/{cache.history}/{cache.capacity}")
            lazy = cache.pending is not None
            if lazy and (not self._lazy or cache.pending.cache is not cache or cache.keyed or cache.key_at != NEVER
                         or self._tree.pending_prefix(cache.request.salt, cache.pending.first) is not cache.pending):
                problems.append(f"{rid}: keyed lazily but not noted as a pending prefix, or keyed too")
            if self._reuse and not lazy and cache.keyed != cache.committed // self.T:
                problems.append(f"{rid}: {cache.keyed} radix positions for {cache.committed} committed tokens")
            if not lazy and cache.key_at != ((cache.keyed + 1) * self.T if self._reuse else NEVER):
                problems.append(f"{rid}: next block keyed at {cache.key_at} tokens with {cache.keyed} keyed")
            last = cache.last
            if (last.start + len(last) if last is not None else 0) != cache.keyed or (
                    last is not None and last.parent is None):
                problems.append(f"{rid}: its radix path does not end at its {cache.keyed} keyed blocks")
            if last is not None:
                on_path[rid] = last
            if not cache.is_active:
                continue
            for window, tpb, members in self._window_sets:  # commits below slide_at skip the window check: safely
                start = max(0, cache.committed - window + 1)
                if cache.committed < cache.slide_at and any(
                        min(start // tpb, len(cache.tables[name])) > cache.released[name] for name, _ in members):
                    problems.append(f"{rid}: a window releases a block at {cache.committed} tokens, before slide_at "
                                    f"{cache.slide_at}")
            for g in self._groups:
                table = cache.tables[g.name]
                held = [b for b in table if b >= 0]
                if len(set(held)) != len(held):
                    problems.append(f"{rid}: group {g.name} holds a block twice")
                if len(table) != math.ceil(cache.capacity / g.tokens_per_block):
                    problems.append(f"{rid}: group {g.name} has {len(table)} blocks for capacity {cache.capacity}")
                if cache.room > len(table) * g.tokens_per_block:
                    problems.append(f"{rid}: room {cache.room} beyond the {len(table)} blocks of group {g.name}")
                for j, b in enumerate(table):
                    if b < 0 and j >= cache.released[g.name]:
                        problems.append(f"{rid}: group {g.name} block {j} missing above the window")
                    if b >= 0 and j < cache.released[g.name]:  # a finish does not look there (release_tables)
                        problems.append(f"{rid}: group {g.name} holds block {j} below its window's release mark")
                    if b >= 0:
                        owners[g.name][b] = owners[g.name].get(b, 0) + 1
        worst = [sum(g.blocks_for(c.worst) for c in self._caches.values() if c.is_active) for g in self._groups]
        if worst != self._worst_blocks:
            problems.append(f"worst-case blocks of active caches {self._worst_blocks}, recomputed {worst}")
        if self._slabs is not None:
            problems += self._slabs.check()
        for pool, names in self._pool_sets:  # per distinct pool: free + every group's used + evictable == blocks
            if isinstance(pool, TiedArena):  # its pages (each logical block's k distinct, owned once), then its ids
                problems += pool.check()
                free, evictable = set(pool._free_ids), set(pool.evictable.blocks())
                used = {b for b in range(len(pool.ref)) if pool.ref[b] > 0}
                if free & evictable or len(free) + len(evictable) + len(used) != len(pool.pages) \
                        or len(free) != len(pool._free_ids):
                    problems.append(f"tied arena: free {len(free)} + evictable {len(evictable)} + used {len(used)} "
                                    f"logical ids != {len(pool.pages)} ({len(free & evictable)} free and queued)")
                continue
            listed = pool.free_ids() if isinstance(pool, SlabPool) else pool._free
            free, evictable = set(listed), set(pool.evictable.blocks())
            if free & evictable:
                problems.append(f"{self._where(names)}: blocks both free and evictable: {sorted(free & evictable)}")
            used = {b for b in range(len(pool.ref)) if pool.ref[b] > 0}  # (a slab pool's ids span the whole arena)
            if len(free) + len(evictable) + len(used) != pool.num_blocks or len(free) != len(listed) \
                    or len(used) != pool.num_used:
                problems.append(f"{self._where(names)}: free {len(free)} + evictable {len(evictable)} + used "
                                f"{len(used)} != {pool.num_blocks} (num_used {pool.num_used})")
        if self._arena is not None:
            problems += self._check_rows(self._arena)
        for g in self._groups:
            pool = self._pool[g.name]
            holds = pool.holds if isinstance(pool, (GroupShare, TiedShare)) else None
            free, evictable = set(pool.free_ids()), set(pool.evictable.blocks())
            ids = range(len(pool.ref))  # a slab pool's ids span the arena; elsewhere len(ref) == num_blocks
            mine = ids if holds is None else [b for b in ids if holds(b)]
            used = {b for b in mine if pool.ref[b] > 0}
            if len(used) != pool.num_used or len(evictable.intersection(mine)) != pool.num_evictable:
                problems.append(f"group {g.name}: used {len(used)} (num_used {pool.num_used}), evictable "
                                f"{len(evictable.intersection(mine))} (num_evictable {pool.num_evictable})")
            if holds is not None:
                stray = [b for b in range(len(pool.ref)) if b not in free and pool.arena.group_of[b] < 0]
                if stray:
                    problems.append(f"shared arena: blocks neither free nor in a group: {stray}")
            for b in mine:
                n_owners = owners[g.name].get(b, 0)
                if pool.ref[b] != n_owners:
                    problems.append(f"group {g.name}: block {b} ref {pool.ref[b]} but {n_owners} owners")
                # (a block held by several caches need not be a cached prefix block: forked samples share their
                # prompt's blocks with prefix reuse off too)
                if b in evictable and pool.node[b] is None:
                    problems.append(f"group {g.name}: evictable block {b} is not in the radix tree")
                if b in free and pool.node[b] is not None:
                    problems.append(f"group {g.name}: free block {b} still in the radix tree")
                run = pool.node[b]
                if run is not None and not (0 <= pool.pos[b] - run.start < len(run)
                                            and run.blocks[g.name][pool.pos[b] - run.start] == b):
                    problems.append(f"group {g.name}: block {b} and its radix run disagree")
            for b in owners[g.name]:
                if holds is not None and not holds(b):
                    problems.append(f"group {g.name}: block {b} in its tables belongs to another group")
        problems += self._check_tree(on_path)
        if self.host is not None:
            held: dict[str, list[int]] = {name: [] for name in self.host.num_slots}
            for cache in self._caches.values():
                for name, slots in (cache.host or {}).items():
                    held[name].extend(s for s in slots if s >= 0)
            for names in self.host.slot_sets():  # a shared host tier: every group's slots together
                n = self.host.num_slots[names[0]]
                free = self.host.free_slots(names[0])
                taken = [s for name in names for s in held[name]]
                if sorted(free + taken) != list(range(n)):
                    problems.append(f"host {self._where(names)}: {len(free)} free + {len(taken)} held slots != {n}")
        # write-back: exactly the suspended caches' pages still cached on the device wait to be copied at eviction
        live = {id(c) for c in self._caches.values()}
        waiting = {(name, b, id(c), j) for name, later in self._write_back.items() for b, entries in later.items()
                   for c, j in entries}
        for name, b, c, _j in waiting:
            if c not in live:
                problems.append(f"group {name}: block {b} waits to be written back for a cache that is gone")
        marked = {(name, b, id(c), j) for c in self._caches.values() if c.host is not None
                  for name, marks in c.reclaim.items() for j, (b, _) in marks.items()}
        for name, b, _c, j in marked - waiting:
            problems.append(f"group {name}: suspended page {j} on block {b} is not in the write-back map")
        for name, b, _c, j in waiting - marked:
            problems.append(f"group {name}: block {b} waits to be written back for page {j} no cache marks")
        for c in self._caches.values():
            for name, marks in (c.reclaim.items() if c.host is not None else ()):
                for j, (b, gen) in marks.items():
                    pool = self._pool[name]
                    if pool.node[b] is None or pool.gen[b] != gen:
                        problems.append(f"group {name}: suspended page {j}'s block {b} changed hands unwritten")
        if problems:
            raise AssertionError("; ".join(problems))

    def _check_rows(self, arena: SharedPool) -> list[str]:
        """A shared arena's cut families leave no partial row cached: where a cut of a family holds a page at a cached
        position (in the tree or a pending prefix), every cut of the family does (``SharedPool._row_rest``); and
        each queued row's pages lie next to each other in the eviction queue."""
        members = arena._members
        if members is None:
            return []
        rows: dict[tuple[int, int, int], list[int]] = {}
        for b in range(arena.num_blocks):
            g, run = arena.group_of[b], arena.node[b]
            if run is not None and g >= 0 and members[g]:
                rows.setdefault((id(run), arena.pos[b], members[g][0]), []).append(g)
        problems = [f"shared arena: position {p} holds cuts {sorted(arena.names[g] for g in gs)} of "
                    f"{len(members[first])}: a partial row is cached"
                    for (_, p, first), gs in rows.items() if len(gs) != len(members[first])]
        # a queued row lies whole and in one piece in the eviction order (one bucket, its pages next to each other):
        # the queue then evicts rows as a queue of whole rows would, the order a tie of the cuts into one logical
        # block (its pages evicted together) can keep exactly
        seen: set[tuple[int, int, int]] = set()
        for _, got in arena.evictable.buckets():
            row: tuple[int, int, int] | None = None
            n = 0
            for b, _ in got:
                g, run = arena.group_of[b], arena.node[b]
                key = (id(run), arena.pos[b], members[g][0]) if run is not None and members[g] else None
                if key is not None and key == row:
                    n += 1
                    continue
                if row is not None and n != len(members[row[2]]):
                    problems.append(f"shared arena: a queued row of {arena.names[row[2]]}'s family at position "
                                    f"{row[1]} has {n} of its {len(members[row[2]])} pages together in the queue")
                if key is not None and key in seen:
                    problems.append(f"shared arena: the queued row of {arena.names[key[2]]}'s family at position "
                                    f"{key[1]} lies in pieces in the queue")
                row, n = key, 1
                if key is not None:
                    seen.add(key)
            if row is not None and n != len(members[row[2]]):
                problems.append(f"shared arena: a queued row of {arena.names[row[2]]}'s family at position {row[1]} "
                                f"has {n} of its {len(members[row[2]])} pages together in the queue")
        return problems

    def _check_tree(self, on_path: dict[str, RadixNode]) -> list[str]:
        """The radix tree's invariants (:mod:`cache_backends.v2.radix`); ``on_path``: each cache's last run."""
        problems: list[str] = []
        users: dict[int, int] = {}
        for last in on_path.values():
            node: RadixNode | None = last
            while node is not None and node.parent is not None:
                users[id(node)] = users.get(id(node), 0) + 1
                node = node.parent
        positions = 0
        for node in [*self._tree.roots.values(), *self._tree.nodes(), *self._tree.tails()]:
            where = f"radix run at block {node.start}"
            if node.by_first is not None:
                for index, width, what in ((node.by_first, 8, "first-token"), (node.by_two, 16, "first-two-tokens")):
                    expected: dict[bytes, list[RadixNode]] = {}
                    for child in node.children.values():
                        expected.setdefault(child.block(0)[:width], []).append(child)
                    if {t: list(group.values()) for t, group in index.items()} != expected:
                        problems.append(f"{where}: {what} index disagrees with its children")
            for first, child in node.children.items():
                if child.parent is not node or not child.held or child.block(0) != first \
                        or child.start != (node.start + len(node) if node.parent is not None else 0):
                    problems.append(f"{where}: child at block {child.start} is not hooked where it belongs")
            if node.parent is None:
                continue
            n = len(node)
            positions += n
            if not n or len(node.tokens) != n * node.width or node.width != 8 * self.T \
                    or any(not 0 <= j < n for j in node.keys) or set(node.blocks) != set(self._pool):
                problems.append(f"{where}: {n} positions but per-position lists of other lengths or groups")
                continue
            if node.users != users.get(id(node), 0):
                problems.append(f"{where}: {node.users} users, {users.get(id(node), 0)} cache paths through it")
            if not node.users and not node.children and not node.held[-1]:
                problems.append(f"{where}: unused, childless, with an empty tail position (not trimmed)")
            held = [0] * n
            for name, blocks in node.blocks.items():
                pool = self._pool[name]
                if len(blocks) != n:
                    problems.append(f"{where}: group {name} has {len(blocks)} entries for {n} positions")
                    continue
                for i, b in enumerate(blocks):
                    if b < 0:
                        continue
                    held[i] += 1
                    if pool.node[b] is not node or pool.pos[b] != node.start + i:
                        problems.append(f"{where} holds block {b} of {name} at position {node.start + i} "
                                        "it does not own")
            if held != node.held:
                problems.append(f"{where}: held counts {node.held}, recomputed {held}")
        if positions != self._tree.num_nodes:
            problems.append(f"radix tree: {self._tree.num_nodes} positions counted, {positions} found")
        latent: dict[tuple[str | None, bytes], int] = {}
        for cache in self._caches.values():
            if cache.latent is not None:
                key = (cache.request.salt, cache.latent)
                latent[key] = latent.get(key, 0) + 1
                if not self._lazy or cache.keyed or cache.pending is not None \
                        or cache.latent != pack_tokens(token_slice(cache.request, 0, 1)):
                    problems.append(f"{cache.request.req_id}: counted as latent but keyed, pending or mis-keyed")
            elif self._lazy and cache.admitted and cache.pending is None and not cache.keyed:
                problems.append(f"{cache.request.req_id}: no block in the tree, neither pending nor latent")
        if latent != self._tree.latent:
            problems.append(f"latent first tokens {self._tree.latent}, recomputed {latent}")
        for salt, by_first in self._tree.pending.items():
            root = self._tree.root(salt)
            for first, prefix in by_first.items():
                where = f"pending prefix {first.hex()}"
                if not by_first or prefix.first != first or prefix.salt != salt or len(first) != 8 \
                        or (root is not None and root.has_child_starting_with(first)) \
                        or (salt, first) in self._tree.latent:
                    problems.append(f"{where}: not noted under its own first token, or a run or a cache without "
                                    "blocks in the tree starts with it too")
                running = prefix.cache
                if running is not None and (
                        running.pending is not prefix or self._caches.get(prefix.request) is not running
                        or len(prefix.held) > running.committed // self.T
                        or any(running.tables[name][j] >= 0 for name, blocks in prefix.blocks.items()
                               for j, b in enumerate(blocks) if b >= 0)):
                    problems.append(f"{where}: a running request's note lost its cache, or holds a block the "
                                    "request still has or beyond its full committed blocks")
                held = [0] * len(prefix.held)
                for name, blocks in prefix.blocks.items():
                    pool = self._pool[name]
                    if len(blocks) != len(held):
                        problems.append(f"{where}: group {name} has {len(blocks)} entries for {len(held)} positions")
                        continue
                    for i, b in enumerate(blocks):
                        if b >= 0:
                            held[i] += 1
                            if pool.node[b] is not prefix or pool.pos[b] != i or pool.ref[b]:
                                problems.append(f"{where} holds block {b} of {name} at {i} that is not its cached one")
                if held != prefix.held or (running is None and not any(held)):
                    problems.append(f"{where}: held counts {prefix.held}, recomputed {held}")
        return problems
