"""KV geometry: what each layer keeps per token, and how layers group into block pools.

The formulas follow ``docs/kv-geometry.md`` and are a public contract (``kvload plan --json``
reports them). V1 knows one geometry: every layer keeps every token at the widest layer's entry
size, in one pool. V2 groups layers by life cycle (full, sliding window W, MLA latent,
compressed at rate c) with one block table per group.

V2 memory shared between groups (vLLM's hybrid allocator; see :func:`share_pages`): when every group's
page — one block of one layer, ``entries_per_block * entry_elems`` — has the same shape, each group
is cut into sub-groups of at most ``G`` layers (``gcd(layer counts)``, or, opted into with
``kv_cache_config.max_page_padding``, a larger ``G`` whose padded last cuts waste at most that share of the pages'
bytes: fewer tables a request), so every group's block is the same
``G``-layer page, and all groups take pages from one arena with one free list. Otherwise (DeepSeek
V4's compressed groups) each group keeps a pool of its own, split once by :meth:`KvLayout.split_budget`.

Invariants of a :class:`LayerGroup`: ``tokens_per_block == entries_per_block * (compress_rate or 1)``
and ``bytes_per_block == page_layers * entry_elems * dtype_bytes * entries_per_block``, where ``page_layers ==
len(layers) + padding`` (``padding`` > 0 only for the last cut of a kind on a shared arena whose ``G``-layer page it
does not fill: its unused layer slots are bytes it takes from the arena and never reads or writes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import attrs

#: Bytes per element of each KV dtype this library stores.
#: Layer kinds whose entries the paged attention reads and writes (``paged_attention`` imports this
#: torch-free copy, so ``kvload models`` can say what generates without importing torch). DeepSeek V4's layers
#: (:data:`V4_KINDS`) are served on V2 by their own forward (``models.deepseek_v4_paged``), not by the paged attention.
SERVED_KINDS: tuple[str, ...] = ("full", "sliding", "mla")
#: DeepSeek V4's layer kinds: generate runs them on V2 only (their compressed entries need per-group pools).
V4_KINDS: tuple[str, ...] = ("v4_sliding", "csa", "hca")
#: Layer kinds a paged decode kernel (Triton on CUDA, the C kernel on CPU) attends: rows of K and V per KV head
#: (MLA's latent rows and DeepSeek V4's compressed ones stay on gather + SDPA or the compiled path).
DECODE_KERNEL_KINDS: frozenset[str] = frozenset({"full", "sliding"})


def unserved_kinds(layers: Iterable[LayerKV]) -> list[str]:
    """Kinds among ``layers`` that generate cannot serve (DeepSeek V4's are served, on V2), sorted."""
    return sorted({layer.kind for layer in layers if layer.kind not in V4_KINDS
                   and (layer.kind not in SERVED_KINDS or layer.compress_rate is not None)})


def cannot_generate(name: str, layers: Iterable[LayerKV], manager: LayoutName | None = None) -> str | None:
    """Why kvload cannot generate for model ``name`` with these layers on ``manager``'s layout (one line), or None
    when it can (``manager`` None: on some layout)."""
    layers = list(layers)
    unserved = unserved_kinds(layers)
    if unserved:
        return (f"generate: {name} has {', '.join(unserved)} attention layers; kvload's paged attention serves "
                f"{', '.join((*SERVED_KINDS, *V4_KINDS))} layers only, so this model is plan/build only")
    v4 = sorted({layer.kind for layer in layers if layer.kind in V4_KINDS})
    if v4 and manager == "v1":
        return (f"generate: {name} has DeepSeek V4 attention layers ({', '.join(v4)}); generate runs them on KV cache "
                "manager V2 only (kv_cache_config.use_kv_cache_manager_v2: true), whose groups hold the window and "
                "the compressed entries apart")
    return None


DTYPE_SIZES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}

LayerKindName = Literal["full", "sliding", "mla", "v4_sliding", "csa", "hca"]
GroupKind = Literal["full", "sliding", "mla", "compressed"]
#: A layout's shape: "v1" (one uniform pool) or "v2" (a pool per life cycle); the kinds
#: themselves (classes, route values) are :mod:`cache_backends.kinds`.
LayoutName = Literal["v1", "v2"]


@attrs.frozen
class LayerKV:
    """What one attention layer keeps per token.

    ``entry_elems`` is the raw entry (K and V together where they are separate tensors) kept for
    the last ``window`` tokens (``None``: all tokens). Compressed layers (DeepSeek V4 csa/hca)
    additionally keep one ``compressed_elems`` entry per ``compress_rate`` tokens, for all tokens.
    """

    index: int
    kind: LayerKindName
    entry_elems: int
    window: int | None = None
    compressed_elems: int = 0
    compress_rate: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.entry_elems <= 0:
            raise ValueError(f"layer {self.index}: entry_elems must be positive, got {self.entry_elems}")
        if self.window is not None and self.window <= 0:
            raise ValueError(f"layer {self.index}: window must be positive, got {self.window}")
        if (self.compress_rate is None) != (self.compressed_elems == 0):
            raise ValueError(f"layer {self.index}: compressed_elems and compress_rate go together")


@attrs.frozen
class LayerGroup:
    """Layers that share a life cycle and therefore one pool of blocks."""

    name: str
    kind: GroupKind
    layers: tuple[int, ...]
    entry_elems: int
    window: int | None
    compress_rate: int | None
    entries_per_block: int
    tokens_per_block: int
    bytes_per_block: int
    #: layer slots of each block no layer of the group uses (a padded cut of a shared arena's page; see share_pages)
    padding: int = 0

    @property
    def page_layers(self) -> int:
        """Layer slots of one of the group's blocks: its layers plus its padding."""
        return len(self.layers) + self.padding

    @property
    def keeps_all_tokens(self) -> bool:
        """Whether the group grows with the sequence (full, mla, compressed) rather than a window."""
        return self.window is None

    @property
    def max_blocks_per_sequence(self) -> int | None:
        """Blocks a sliding group ever needs for one sequence; ``None`` for groups that keep all tokens."""
        if self.window is None:
            return None
        return math.ceil((self.window - 1) / self.tokens_per_block) + 1

    def blocks_for(self, length: int) -> int:
        """Blocks one sequence of ``length`` tokens holds in this group."""
        if length <= 0:
            return 0
        blocks = math.ceil(length / self.tokens_per_block)
        cap = self.max_blocks_per_sequence
        return blocks if cap is None else min(blocks, cap)

    @property
    def bytes_per_token(self) -> float:
        """Asymptotic growth per token: 0 for a window, an entry (or entry/c) per layer otherwise (a padded group's
        unused slots left out, as block rounding is: ``kv-geometry.md``'s per-layer sum; the plan's memory line
        says what the padding takes)."""
        if self.window is not None:
            return 0.0
        return self.bytes_per_block * len(self.layers) / self.page_layers / self.tokens_per_block

    def to_dict(self) -> dict:
        """JSON form used by ``plan --json`` (without the block count, which depends on the budget)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "layers": list(self.layers),
            "window": self.window,
            "compress_rate": self.compress_rate,
            "entry_elems": self.entry_elems,
            "tokens_per_block": self.tokens_per_block,
            "bytes_per_block": self.bytes_per_block,
            "padding_layers": self.padding,
        }


@attrs.frozen
class KvLayout:
    """The layer groups one manager kind would build for a model, at a dtype and block size."""

    manager: LayoutName
    dtype: str
    dtype_bytes: int
    tokens_per_block: int
    layers: tuple[LayerKV, ...]
    groups: tuple[LayerGroup, ...]
    #: V2: every group takes its blocks from one arena of equal pages (see :func:`share_pages`)
    shared: bool = False
    #: V2 with several groups that cannot share: why (one line); None otherwise
    unshared_reason: str | None = None
    #: a ``max_page_padding`` above 0 that padded no page: why (one line, for ``setting_ignored``); None otherwise
    padding_unused: str | None = None

    @property
    def page_bytes(self) -> int | None:
        """Bytes of one page of a shared arena (every group's block); None when the memory is not shared."""
        return self.groups[0].bytes_per_block if self.shared else None

    def arena_blocks(self, blocks: dict[str, int]) -> int:
        """Pages of a shared arena given the per-group block counts (every group counts the whole arena)."""
        return max(blocks[g.name] for g in self.groups)

    def pool_bytes(self, blocks: dict[str, int]) -> int:
        """Device bytes of pools with these block counts (a shared arena counted once)."""
        if self.shared:
            return self.arena_blocks(blocks) * self.groups[0].bytes_per_block
        return sum(blocks[g.name] * g.bytes_per_block for g in self.groups)

    def memory_text(self, blocks: dict[str, int] | None = None, seq_len: int | None = None) -> str | None:
        """One line saying how the groups hold their memory (None for a single group)."""
        if len(self.groups) < 2:
            return None
        if not self.shared:
            text = f"memory: split between groups ({self.unshared_reason})"
            if seq_len and (split := self.split_length(seq_len)) < seq_len:
                text += (f"; windows sized for sequences of {split:,} tokens, where they cost what growth does, "
                         f"not {seq_len:,}")
            return text
        text = f"memory: one arena shared by {len(self.groups)} groups"
        if blocks:
            text += (f", {self.arena_blocks(blocks):,} pages of {self.groups[0].bytes_per_block:,} B "
                     "(each group's block count is the whole arena: what it could hold alone)")
            if seq_len:
                text += f"; {self.max_sequences(blocks, seq_len):,} sequence(s) of {seq_len:,} tokens fit jointly"
        if padded := self.padding_dict(seq_len):
            unused = ", ".join(f"{name} {n}" for name, n in padded["unused_slots"].items())
            text += (f"; pages of {padded['page_layers']} layers, unused layer slots a page: {unused} (at most "
                     f"{padded['worst_share']:.1%} of the bytes a sequence holds")
            text += (f", {padded['share_at_max_seq_len']:.1%} at {seq_len:,} tokens)" if seq_len else ")")
        return text

    @property
    def page_layers(self) -> int | None:
        """Layer slots of one page of a shared arena; None when the memory is not shared."""
        return self.groups[0].page_layers if self.shared else None

    def padding_share(self, length: int | None = None) -> float:
        """Share of the page bytes a sequence of ``length`` tokens holds that padded groups leave unused (block
        rounding included); ``length`` None: the largest over every length (:func:`padding_share`)."""
        if not self.shared or not any(g.padding for g in self.groups):
            return 0.0
        if length is None:
            return padding_share(self.groups, self.groups[0].page_layers)
        held = self.blocks_for_sequence(max(length, 1))
        return (sum(g.padding * held[g.name] for g in self.groups)
                / sum(g.page_layers * held[g.name] for g in self.groups))

    def padding_dict(self, seq_len: int | None = None) -> dict | None:
        """A shared arena's padded groups (``plan --json``'s ``memory.padding``): the page's layers, each padded
        group's unused slots a page, and the share of a sequence's page bytes they leave unused (the largest
        over every length, and at ``seq_len``); None when no group is padded."""
        if not self.shared or not any(g.padding for g in self.groups):
            return None
        return {"page_layers": self.groups[0].page_layers,
                "unused_slots": {g.name: g.padding for g in self.groups if g.padding},
                "worst_share": self.padding_share(),
                "share_at_max_seq_len": self.padding_share(seq_len) if seq_len else None}

    def padding_note(self, seq_len: int | None = None) -> str | None:
        """One line on what ``max_page_padding`` did to these pages (the padded page and its worst unused share, or
        why none is padded), for reports that show a manager beside another (``--compare``); None when it is 0."""
        if padded := self.padding_dict(seq_len):
            return (f"pages of {padded['page_layers']} layers for {len(self.groups)} groups, at most "
                    f"{padded['worst_share']:.1%} of a sequence's page bytes unused (max_page_padding)")
        return f"max_page_padding padded no page: {self.padding_unused}" if self.padding_unused else None

    def unpadded(self) -> KvLayout | None:
        """These layers laid out at ``max_page_padding`` 0 (pages of ``gcd(layer counts)`` layers), for saying what
        the padding costs; None when no page is padded."""
        if not any(g.padding for g in self.groups):
            return None
        return build_layout(self.layers, self.manager, self.tokens_per_block, self.dtype)

    @property
    def bytes_per_token(self) -> float:
        """What one more token costs once the sequence is longer than every window (no rounding)."""
        return sum(g.bytes_per_token for g in self.groups)

    def blocks_for_sequence(self, length: int) -> dict[str, int]:
        """Blocks per group that one sequence of ``length`` tokens holds."""
        return {g.name: g.blocks_for(length) for g in self.groups}

    def bytes_for_sequence(self, length: int) -> int:
        """Exact bytes one sequence of ``length`` tokens holds, with block rounding and windows."""
        return sum(g.blocks_for(length) * g.bytes_per_block for g in self.groups)

    def min_bytes(self) -> int:
        """The smallest pool set: one block per group."""
        return sum(g.bytes_per_block for g in self.groups)

    def blocks_for_tokens(self, tokens: int, seq_len: int) -> dict[str, int]:
        """Blocks per group that hold ``tokens`` tokens: ``ceil(tokens / tokens_per_block)`` in every group.

        TensorRT-LLM's rule (``max_tokens`` caps the tokens *per window size*): a window group gets as
        many token slots as a growing one, so on one group or a shared arena ``max_tokens`` buys V2 the bytes
        it buys V1 — a window only makes each sequence take fewer of them, so more sequences run, never fewer.
        (Pricing a window group as one window per ``max_seq_len`` sequence gave a sliding-window model 9 blocks
        where V1 got 128.)
        A shared arena gets the sum of those blocks, and every group counts all of them.

        Pools split between groups (:attr:`shared` false with several groups: DeepSeek V4) cannot lend each
        other pages, so there a window group gets the windows of the ``ceil(tokens / L)`` sequences of ``L =``
        :meth:`split_length` tokens those tokens make, as :meth:`split_budget` prices a byte budget:
        ``max_tokens`` window slots would sit idle while long sequences fill the growing pools (7.5x the bytes for
        tiny-deepseek-v4 at 65,536 tokens), and the windows of ``max_seq_len`` sequences left short ones waiting
        for a window while the growing pools had room (2 blocks for tiny-deepseek-v4; now 66). Such a
        split layout can then get fewer bytes than V1 would at one ``max_tokens`` (no supported model that V1
        can serve is split: their layers share an arena).
        """
        own = self._own_blocks_for_tokens(tokens, seq_len)
        if self.shared:
            arena = max(1, sum(own.values()))
            return {g.name: arena for g in self.groups}
        return own

    def _own_blocks_for_tokens(self, tokens: int, seq_len: int) -> dict[str, int]:
        tokens = max(tokens, 0)
        if self.shared or len(self.groups) == 1:
            return {g.name: max(1, math.ceil(tokens / g.tokens_per_block)) for g in self.groups}
        length = self.split_length(max(seq_len, 1))
        sequences, longest = math.ceil(tokens / length), min(tokens, length)
        return {g.name: math.ceil(tokens / g.tokens_per_block) if g.keeps_all_tokens
                else sequences * g.blocks_for(longest) for g in self.groups}

    def split_length(self, seq_len: int) -> int:
        """The sequence length split pools are sized for: ``seq_len``, or ``ceil(S / u)`` when shorter.

        ``S`` is the bytes of every window group's whole window, ``u`` the growing groups' bytes per token. Why:
        a split is exact for one length only, and the workload's lengths are not known when the pools are built.
        Sized for ``max_seq_len`` (the rule before), DeepSeek V4's window pool got 2.9% of the budget, so
        1,216-token sequences ran 4 at a time in a budget priced for 64 (``kvload simulate tiny-deepseek-v4
        --workload multi-turn``: 14,055 steps and 8.5% of prompt tokens reused). Sized for ``S / u`` tokens, half
        the budget goes to windows and half to growth, and sequences of any one length ``L`` run at least half as
        many at once as the best split for ``L`` would run: shorter than ``S / u`` the windows bind, at ``(S + uL)
        / 2S >= 1/2`` of the best; longer, the growing pools, at ``(S + uL) / 2uL >= 1/2``. (Sized for
        ``max_seq_len`` it was ``(S + uL) / (S + u max_seq_len)``: 3% there.) Layouts with no window group or no
        growing one have nothing to weigh and keep ``seq_len``.
        """
        windows = sum(g.blocks_for(seq_len) * g.bytes_per_block for g in self.groups if not g.keeps_all_tokens)
        growth = sum(g.bytes_per_token for g in self.groups)
        if self.shared or not windows or not growth:
            return seq_len
        return max(1, min(seq_len, math.ceil(windows / growth)))

    def bytes_for_tokens(self, tokens: int, seq_len: int) -> int:
        """Bytes of the pools :meth:`blocks_for_tokens` gives (V1: ``ceil(tokens / T)`` blocks)."""
        own = self._own_blocks_for_tokens(tokens, seq_len)
        return sum(own[g.name] * g.bytes_per_block for g in self.groups)

    def split_budget(self, budget_bytes: int, seq_len: int) -> dict[str, int]:
        """Blocks per group for a byte budget, in proportion to sequences of ``seq_len`` (split pools: see below).

        The budget holds as many whole ``seq_len`` sequences as fit plus the longest partial one
        the rest allows, so a budget below one sequence still gets whole windows, and a one-group
        (V1) layout gets ``budget // bytes_per_block`` blocks. Each group gets at least one block
        (a budget below :meth:`min_bytes` then exceeds itself: callers check).

        A shared arena (:attr:`shared`) is not split: it gets ``budget // page_bytes`` pages, and every
        group counts all of them, since any group can take any page; ``seq_len`` does not matter.

        Only layouts that cannot share (DeepSeek V4: its compressed groups have other page sizes) are
        split, for sequences of :meth:`split_length` tokens, where windows and growth weigh the same: many
        short sequences are then not held back by a window pool sized for a few long ones
        (:meth:`blocks_for_tokens` is alike). Where that leaves the growing pools short of one ``seq_len``
        sequence and the budget holds one, they get its blocks and the windows what is left (the longest
        request must still fit). A budget below one sequence then holds a longest sequence about half as
        long as a split for ``seq_len`` would, and shorter ones run many at once.
        """
        if self.shared:
            arena = max(1, max(budget_bytes, 0) // self.groups[0].bytes_per_block)
            return {g.name: arena for g in self.groups}
        length = max(seq_len, 1)
        blocks = {name: max(1, n) for name, n in self._split_for(budget_bytes, self.split_length(length)).items()}
        if budget_bytes < self.bytes_for_sequence(length) or self.sequence_shortfall(length, blocks) is None:
            return blocks
        # The growing pools cannot hold one max_seq_len sequence: they get its blocks, and the windows what is left,
        # in whole windows (at least one: the budget holds that sequence's too).
        need = self.blocks_for_sequence(length)
        growing = {g.name: max(blocks[g.name], need[g.name]) for g in self.groups if g.keeps_all_tokens}
        left = budget_bytes - sum(growing[g.name] * g.bytes_per_block for g in self.groups if g.keeps_all_tokens)
        windows = sum(need[g.name] * g.bytes_per_block for g in self.groups if not g.keeps_all_tokens)
        sequences = left // windows
        return {g.name: growing[g.name] if g.keeps_all_tokens else sequences * need[g.name] for g in self.groups}

    def _split_for(self, budget_bytes: int, length: int) -> dict[str, int]:
        """Blocks per group for the whole sequences of ``length`` tokens a budget holds, plus the longest partial one
        (a group may get 0)."""
        need = self.blocks_for_sequence(length)
        per_seq = self.bytes_for_sequence(length)
        full = max(budget_bytes, 0) // per_seq
        rest = max(budget_bytes, 0) - full * per_seq
        # bytes_for_sequence is non-decreasing in the length: bisect the longest partial sequence.
        lo = longest(lambda n: self.bytes_for_sequence(n) <= rest, length - 1)
        # What is left is less than one more token costs: extra blocks in some groups only would
        # overstate the capacity (a window group could not follow), so it stays unspent.
        return {g.name: full * need[g.name] + g.blocks_for(lo) for g in self.groups}

    def max_sequences(self, blocks: dict[str, int], seq_len: int) -> int:
        """How many sequences of ``seq_len`` tokens fit in pools of these block counts."""
        need = self.blocks_for_sequence(max(seq_len, 1))
        if self.shared:  # every group takes its blocks from the one arena: the sum must fit
            return self.arena_blocks(blocks) // max(1, sum(need.values()))
        return min((blocks[name] // n for name, n in need.items() if n), default=0)

    def sequence_shortfall(self, length: int, blocks: dict[str, int]) -> tuple[str, int, int] | None:
        """(which pool, blocks needed, blocks it has) when one sequence of ``length`` tokens cannot fit pools of
        these block counts even alone; None when it fits. A shared arena counts every group's blocks together."""
        if self.shared:
            need = sum(g.blocks_for(length) for g in self.groups)
            have = self.arena_blocks(blocks)
            return None if need <= have else (f"the arena shared by {len(self.groups)} layer groups", need, have)
        for g in self.groups:
            if g.blocks_for(length) > blocks[g.name]:
                return (f"layer group {g.name!r} ({g.tokens_per_block} tokens each)", g.blocks_for(length),
                        blocks[g.name])
        return None

    def longest_sequence(self, blocks: dict[str, int], most: int) -> int:
        """The longest sequence, up to ``most`` tokens, that pools of these block counts hold alone
        (:meth:`sequence_shortfall` says None); 0 when none does."""
        return longest(lambda n: self.sequence_shortfall(n, blocks) is None, most)

    def capacity_tokens(self, blocks: dict[str, int], seq_len: int | None = None) -> int:
        """Tokens the pools hold: the tightest group that keeps all tokens, in tokens.

        A shared arena: the tokens of the ``seq_len`` sequences that fit jointly plus the longest shorter
        sequence the pages left over hold (windows included) — the tokens served at once, as V1 counts
        them; without ``seq_len``, the longest single sequence the pages hold.
        """
        if self.shared:
            pages = self.arena_blocks(blocks)
            if seq_len is None:
                return self._arena_capacity_tokens(pages)
            length = max(seq_len, 1)
            fits = self.max_sequences(blocks, length)
            rest = pages - fits * sum(self.blocks_for_sequence(length).values())
            return fits * length + min(self._arena_capacity_tokens(rest), length - 1)
        growing = [blocks[g.name] * g.tokens_per_block for g in self.groups if g.keeps_all_tokens]
        if growing:
            return min(growing)
        # Only windows: every sequence costs a bounded number of blocks. With ``seq_len``, the tokens of the
        # sequences of that length that fit at once (as for an arena, and as V1 counts what it serves);
        # without, the token slots of the tightest group.
        slots = min(blocks[g.name] * g.tokens_per_block for g in self.groups)
        if seq_len is None:
            return slots
        length = max(seq_len, 1)
        fits = self.max_sequences(blocks, length)
        need = self.blocks_for_sequence(length)
        left = {g.name: blocks[g.name] - fits * need[g.name] for g in self.groups}
        # the longest shorter sequence the blocks left over hold
        return fits * length + longest(lambda n: all(g.blocks_for(n) <= left[g.name] for g in self.groups),
                                       length - 1)

    def _arena_capacity_tokens(self, pages: int) -> int:
        if not any(g.keeps_all_tokens for g in self.groups):  # windows only: tokens all groups hold at once
            return pages // len(self.groups) * min(g.tokens_per_block for g in self.groups)
        return longest(lambda n: sum(g.blocks_for(n) for g in self.groups) <= pages,
                       pages * max(g.tokens_per_block for g in self.groups))


def longest(fits: Callable[[int], bool], most: int, least: int = 0) -> int:
    """The largest ``n`` in ``[least, most]`` with ``fits(n)``, by bisection; ``least`` when none above it fits.

    Contract: ``fits`` is monotone over ``(least, most]``: true up to some ``n``, false past it (what a sequence
    needs never shrinks as it grows). ``fits(least)`` is never asked (``least`` is taken to fit: with the default
    0, "nothing fits" reads as 0), nor anything outside ``(least, most]``; ``most < least`` gives ``least``.
    """
    lo, hi = least, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


#: ``kv_cache_config.max_page_padding``'s accepted range is ``[0, MAX_PAGE_PADDING)``: at half a sequence's page bytes
#: unused the padding would cost more memory than any table count saves CPU.
MAX_PAGE_PADDING = 0.5


def cut_sizes(counts: list[int], size: int) -> list[list[int]]:
    """Each group's cuts' layer counts for pages of ``size`` layers: full cuts, then the rest (padded) last."""
    return [[size] * (n // size) + ([n % size] if n % size else []) for n in counts]


def padding_share(groups: Iterable[LayerGroup], size: int) -> float:
    """The largest share of the page bytes a sequence holds that ``size``-layer pages leave unused, over every length.

    A group of ``n`` layers cut into ``ceil(n / size)`` pages a block has ``ceil(n / size) * size - n`` unused slots;
    a sequence of ``L`` tokens holds ``min(L, W)`` tokens' blocks in a group of window ``W`` (``L`` where it keeps all
    tokens), so the share is ``sum(pad_g * h_g) / sum(slots_g * h_g)`` with ``h_g = min(L, W_g)``: a ratio of
    piecewise linear functions of ``L``, monotone between the windows, so its largest value is at a short sequence
    (every group alike), at one of the windows, or past every window (growing groups alone). Block rounding is left
    out (it is the same with or without the padding).
    """
    groups = list(groups)
    pads = [(-len(g.layers)) % size for g in groups]
    slots = [len(g.layers) + p for g, p in zip(groups, pads, strict=True)]
    ends = sorted({g.window for g in groups if g.window is not None})
    worst = 0.0
    for length in (1, *ends, math.inf):
        held = [min(length, g.window or math.inf) for g in groups]
        if length == math.inf:  # past every window: only the growing groups grow
            if not any(g.window is None for g in groups):
                continue
            held = [1.0 if g.window is None else 0.0 for g in groups]
        total = sum(s * h for s, h in zip(slots, held, strict=True))
        if total:
            worst = max(worst, sum(p * h for p, h in zip(pads, held, strict=True)) / total)
    return worst


def page_size(groups: list[LayerGroup], bound: float = 0.0) -> int:
    """The layers of a shared arena's page: the size that cuts ``groups`` into the fewest groups with at most
    ``bound`` of the page bytes unused (:func:`padding_share`); ties go to less padding, then to smaller pages.
    ``gcd(layer counts)`` (no padding) whenever no padded size gives fewer groups, and always at ``bound`` 0."""
    counts = [len(g.layers) for g in groups]
    best = math.gcd(*counts)
    if bound <= 0:  # the default: today's cut, no size searched
        return best
    key = (sum(n // best for n in counts), 0.0, best)
    for size in range(1, max(counts) + 1):
        share = padding_share(groups, size)
        if share <= bound:
            key = min(key, (sum(-(-n // size) for n in counts), share, size))
    return key[2]


def least_padding_for_fewer_groups(groups: list[LayerGroup]) -> float | None:
    """The smallest :func:`padding_share` of a page size that cuts ``groups`` into fewer groups than
    ``gcd(layer counts)`` does (what ``max_page_padding`` must reach to change anything); None when no size does."""
    counts = [len(g.layers) for g in groups]
    gcd_groups = sum(n // math.gcd(*counts) for n in counts)
    shares = [padding_share(groups, size) for size in range(1, max(counts) + 1)
              if sum(-(-n // size) for n in counts) < gcd_groups]
    return min(shares) if shares else None


def share_pages(groups: list[LayerGroup], dtype_bytes: int,
                bound: float = 0.0) -> tuple[list[LayerGroup], str | None]:
    """Cut V2 groups into groups of equal pages so one arena can serve them all; (groups, why not or None).

    Why equal pages: one free list can hand any block to any group only if every group's block is the
    same bytes in the same shape; then a block id is an index into one ``(G, P, entries, elems)``
    tensor that every group views whole (``pools.BlockPools``), and many short requests can take the
    pages a long one would have used in the full-attention group (and the other way round), instead of
    a split fixed once for ``max_seq_len`` sequences.

    Why ``G`` (:func:`page_size`): every group costs V2 a block table a request that each admission, claim,
    keying, release and window slide walks, so fewer groups cost less CPU. ``G = gcd(layer counts)`` cuts every
    group exactly (no padding): tiny-gemma3 5 sliding + 1 full gives ``G = 1`` (six 1-layer groups), GPT-OSS 12 +
    12 gives ``G = 12`` (no cut), Gemma 3 27B 52 + 10 ``G = 2`` (31 groups). A larger ``G`` (vLLM's hybrid
    allocator's choice) lets a kind's last cut hold fewer layers than the page: its ``padding`` slots are bytes it
    takes from the arena unused, taken only while at most ``bound`` of the bytes a sequence holds, at any length
    (:func:`padding_share`; ``bound`` is ``kv_cache_config.max_page_padding``, default 0: gcd, as a tight budget
    holds fewer sequences in padded pages, BENCHMARKS.md "v2groups49"): at 0.10 Gemma 3 27B gets ``G = 11``, 5
    sliding groups (the last of 8 layers) + 1 full (10 layers), 6 groups, at most 9.1% unused (past every window:
    the full group's one slot in 11). A cut group keeps its name with ``.0``, ``.1``, ... appended.

    What falls back: groups whose per-layer pages differ in shape (DeepSeek V4's compressed groups,
    MLA beside other widths) keep one pool each, split by :meth:`KvLayout.split_budget`.
    """
    if len(groups) < 2:
        return groups, None
    pages = {(g.entries_per_block, g.entry_elems) for g in groups}
    if len(pages) > 1:
        sizes = [f"{n:,} B" for n in sorted({g.entries_per_block * g.entry_elems * dtype_bytes for g in groups})]
        what = ("compressed groups have other page sizes" if any(g.kind == "compressed" for g in groups)
                else "the groups' pages differ in shape")
        return groups, f"{what}: {', '.join(sizes)} per layer"
    size = page_size(groups, bound)
    out: list[LayerGroup] = []
    for g, cuts in zip(groups, cut_sizes([len(g.layers) for g in groups], size), strict=True):
        page = g.bytes_per_block // len(g.layers) * size
        if len(cuts) == 1:
            out.append(attrs.evolve(g, bytes_per_block=page, padding=size - cuts[0]))
            continue
        for i, n in enumerate(cuts):
            out.append(attrs.evolve(g, name=f"{g.name}.{i}", layers=g.layers[i * size:i * size + n],
                                    bytes_per_block=page, padding=size - n))
    return out, None


def cut_families(groups: Sequence[LayerGroup]) -> list[int]:
    """Per group, the index of its *family*: the cuts :func:`share_pages` made of one group (``name.0``, ``name.1``,
    ... of one kind, window and block span) share one; every other group is a family of its own.

    Why: the cuts of one group hold a prefix position together (they take, slide and release blocks at the same
    moments), and a hit needs every one of them, so the shared arena evicts a position's blocks of a family together
    (``SharedPool._row_rest``)."""
    first: dict[tuple[str, str, int | None, int], int] = {}
    out: list[int] = []
    for i, g in enumerate(groups):
        base, dot, tail = g.name.rpartition(".")
        if not dot or not tail.isdigit():
            out.append(i)
            continue
        out.append(first.setdefault((base, g.kind, g.window, g.tokens_per_block), i))
    return out


def tied_groups(groups: Sequence[LayerGroup]) -> tuple[list[LayerGroup], list[tuple[int, ...]]]:
    """The groups a tie of the cuts shows the V2 manager (``cache_backends.v2.manager.TIE_CUTS``; BENCHMARKS.md
    "tie57c"): one logical group per family (:func:`cut_families`), and per logical group the indexes in ``groups``
    of its cuts, in order (its block owns one page of each: ``cache_backends.v2.tied_pool.TiedArena``'s
    ``k = len(cuts)``).

    A family of several cuts becomes a group named as before the cut (``sliding_w1024``), holding every cut's layers
    and padding, its block the bytes of all its pages; a family of one is its group unchanged. What the user sees
    (``plan``, audit events, ``--json``) stays ``groups``, the cuts: the tie is the manager's bookkeeping only.

    Why: the cuts of a family take, slide, release and leave the cache a row at a time, so the manager's per-group walks
    over them (31 block tables a request on Gemma 3 27B) can be one walk per family (2)."""
    families = cut_families(groups)
    members: dict[int, list[int]] = {}
    for i, f in enumerate(families):
        members.setdefault(f, []).append(i)
    logical: list[LayerGroup] = []
    cuts: list[tuple[int, ...]] = []
    for f, idx in members.items():
        first = groups[f]
        if len(idx) > 1:
            if idx != list(range(idx[0], idx[0] + len(idx))):
                raise ValueError(f"the cuts of {first.name} are not next to each other: {idx}")
            first = attrs.evolve(first, name=first.name.rpartition(".")[0],
                                 layers=tuple(layer for i in idx for layer in groups[i].layers),
                                 bytes_per_block=sum(groups[i].bytes_per_block for i in idx),
                                 padding=sum(groups[i].padding for i in idx))
        logical.append(first)
        cuts.append(tuple(idx))
    return logical, cuts


def _group_name(kind: str, layer_kind: str, window: int | None, rate: int | None) -> str:
    if kind == "compressed":
        return f"{layer_kind}_c{rate}"
    if kind == "sliding":
        return f"sliding_w{window}"
    return kind


def _why_no_padding(groups: list[LayerGroup], unshared: str | None, shared: bool, bound: float) -> str:
    """Why ``max_page_padding`` = ``bound`` padded no page of a V2 layout (``groups`` as grouped, before the cut)."""
    if unshared is not None:
        return (f"{unshared}: each group keeps its own pool (split, or DeepSeek V4's slab arena), so no page is "
                "shared and none is padded")
    if not shared:
        return "the model's layers form one V2 group: there is no arena of several groups to cut into pages"
    counts = [len(g.layers) for g in groups]
    size = math.gcd(*counts)
    least = least_padding_for_fewer_groups(groups)
    if least is None:
        return (f"pages of gcd(layer counts) = {size} layers already give the fewest groups "
                f"({sum(n // size for n in counts)}); a padded page saves none")
    return (f"no page larger than gcd(layer counts) = {size} layers leaves at most {bound:g} of a sequence's page "
            f"bytes unused (fewer groups need {least:.3f}); the {sum(n // size for n in counts)} groups stay")


def build_layout(layers: list[LayerKV] | tuple[LayerKV, ...], manager: LayoutName, tokens_per_block: int,
                 dtype: str, max_page_padding: float = 0.0) -> KvLayout:
    """Group layers into pools for ``manager`` ("v1": one uniform pool; "v2": one pool per life cycle; a shared
    arena's pages padded within ``max_page_padding``, :func:`share_pages`)."""
    if not 0 <= max_page_padding < MAX_PAGE_PADDING:
        raise ValueError(f"max_page_padding must be in [0, {MAX_PAGE_PADDING}), got {max_page_padding}")
    if not layers:
        raise ValueError("a model with no attention layers has no KV cache to lay out")
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"KV dtype {dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    b = DTYPE_SIZES[dtype]
    T = tokens_per_block
    layers = tuple(layers)
    groups: list[LayerGroup] = []
    if manager == "v1":
        e = max(layer.entry_elems for layer in layers)
        groups.append(LayerGroup("uniform", "full", tuple(layer.index for layer in layers), e, None, None,
                                 T, T, len(layers) * e * b * T))
    else:
        # key: (group kind, layer kind for compressed parts, window, rate, entry elems) -> layer indices
        buckets: dict[tuple, list[int]] = {}
        for layer in layers:
            if layer.kind == "mla":
                key = ("mla", "mla", None, None, layer.entry_elems)
            elif layer.window is None:
                key = ("full", "full", None, None, layer.entry_elems)
            else:  # one life cycle per (window, width): DeepSeek V4's raw windows share a pool
                key = ("sliding", "sliding", layer.window, None, layer.entry_elems)
            buckets.setdefault(key, []).append(layer.index)
            if layer.compress_rate is not None:
                ckey = ("compressed", layer.kind, None, layer.compress_rate, layer.compressed_elems)
                buckets.setdefault(ckey, []).append(layer.index)
        names: dict[str, int] = {}
        for (kind, layer_kind, window, rate, elems), idx in buckets.items():
            epb = max(1, T // rate) if rate else T
            tpb = epb * (rate or 1)
            name = _group_name(kind, layer_kind, window, rate)
            if name in names:  # same life cycle, different entry width: keep pools apart, names unique
                names[name] += 1
                name = f"{name}_{names[name]}"
            else:
                names[name] = 0
            groups.append(LayerGroup(name, kind, tuple(idx), elems, window, rate, epb, tpb, len(idx) * elems * b * epb))
        cut, unshared = share_pages(groups, b, max_page_padding)
        shared = len(cut) > 1 and unshared is None
        unused = None
        if max_page_padding > 0 and not any(g.padding for g in cut):
            unused = _why_no_padding(groups, unshared, shared, max_page_padding)
        return KvLayout(manager, dtype, b, T, layers, tuple(cut), shared=shared, unshared_reason=unshared,
                        padding_unused=unused)
    return KvLayout(manager, dtype, b, T, layers, tuple(groups))
