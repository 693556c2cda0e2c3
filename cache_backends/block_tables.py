"""Block tables kept as arrays across steps: one row per live request, every group in one stacked array.

Planning a step used to turn every request's Python block-table lists into a fresh padded tensor
(``torch.tensor`` over lists of lists), for every group, every step. A request's table changes little
from one step to the next — a decode step adds a block every ``tokens_per_block`` tokens — so the
executor keeps a :class:`BlockTableStore`: one ``(groups, rows, width)`` int64 array, each live
request owning a row in every group, and :meth:`BlockTableStore.update` writes only the entries that
changed since the last step (new blocks at the end; a V2 window releasing early blocks as ``-1``, or
a resumed request that got other blocks, rewrite just the entries that differ).

A step's tables are one ``take`` of the rows it schedules, for every group at once
(:meth:`BlockTableStore.tables` → :class:`StepTables`). Why stacked: a V2 shared arena cuts a life
cycle into many groups (tiny-gemma3's ``sliding_w512.0`` ... ``.4``; Gemma 3 27B has 31), whose
tables differ in block ids but not in shape, so the attention plan computes every such group's slots
in one array operation over a ``(groups, B, width)`` stack (``paged_attention.PagedBatch``) instead
of one per group.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch


class StepTables(Mapping[str, torch.Tensor]):
    """One step's block tables of every group: a ``(groups, B, width)`` int64 array padded with -1.

    As a mapping it gives each group's ``(B, width)`` tensor (a view, no copy); :meth:`stack` gives
    several groups' tables as one array for the plan's vectorized slot arithmetic.
    """

    def __init__(self, groups: Sequence[str], array: np.ndarray, index: Mapping[str, int] | None = None) -> None:
        if array.ndim != 3 or array.shape[0] != len(groups):
            raise ValueError(f"expected a (groups={len(groups)}, rows, width) array, got shape {array.shape}")
        self.groups = tuple(groups)
        #: group -> its position in ``array`` (the store passes its own, built once)
        self.index = index if index is not None else {g: i for i, g in enumerate(self.groups)}
        self.array = array
        self._tensor: torch.Tensor | None = None

    @property
    def tensor(self) -> torch.Tensor:
        """``array`` as a tensor (the same memory)."""
        if self._tensor is None:
            self._tensor = torch.from_numpy(self.array)
        return self._tensor

    def __getitem__(self, group: str) -> torch.Tensor:
        return self.tensor[self.index[group]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    def stack(self, groups: Sequence[str]) -> np.ndarray:
        """``(len(groups), B, width)`` tables of these groups (a view when they are consecutive here)."""
        idx = [self.index[g] for g in groups]
        first = idx[0]
        if idx == list(range(first, first + len(idx))):
            return self.array[first:first + len(idx)]
        return self.array[idx]


class BlockTableStore:
    """A ``(groups, rows, width)`` int64 array of block tables, a row per live request, padded with -1."""

    def __init__(self, groups: Iterable[str], width: int, rows: int = 8) -> None:
        if width < 1:
            raise ValueError(f"width must be >= 1 block, got {width}")
        self.groups = tuple(groups)
        self.width = width
        self._index = {g: i for i, g in enumerate(self.groups)}
        self._data = np.full((len(self.groups), rows, width), -1, dtype=np.int64)
        self._row: dict[str, int] = {}
        self._free: list[int] = list(range(rows - 1, -1, -1))
        self._used: list[int] = [0] * rows  # per row, the longest list any group has had (a step copies no wider)
        self._seen: dict[str, list[list[int]]] = {}  # per request, the list each group's row holds (to diff)
        #: entries written since the store was built (a test reads it: a decode step writes few)
        self.writes = 0

    def _grow(self) -> None:
        rows = self._data.shape[1]
        more = max(rows, 8)
        pad = np.full((len(self.groups), more, self.width), -1, dtype=np.int64)
        self._data = np.concatenate((self._data, pad), axis=1)
        self._used.extend([0] * more)
        self._free.extend(range(rows + more - 1, rows - 1, -1))

    def row(self, req_id: str) -> int:
        """The row of a request (a new request gets a free one)."""
        r = self._row.get(req_id)
        if r is None:
            if not self._free:
                self._grow()
            r = self._row[req_id] = self._free.pop()
        return r

    def update(self, req_id: str, group: str, blocks: Sequence[int]) -> int:
        """Bring a request's row of ``group`` up to ``blocks``; returns its row. Writes only what changed."""
        r = self.row(req_id)
        seen = self._seen_of(req_id)[self._index[group]]
        n, m = len(seen), len(blocks)
        if m == n and blocks == seen:  # most decode steps: nothing changed (one C-level list compare)
            return r
        if m > self.width:
            raise ValueError(f"request {req_id}: block table of group {group!r} has {m} blocks; the store "
                             f"holds {self.width} per request (max_seq_len / tokens_per_block)")
        table = self._data[self._index[group], r]
        if not (m >= n and list(blocks[:n]) == seen):  # a window released blocks, or a resume moved them
            k = min(n, m)
            old, new = table[:k], np.asarray(blocks[:k], dtype=np.int64)
            changed = old != new
            count = int(changed.sum())
            if count:
                old[changed] = new[changed]
                self.writes += count
            if m < n:
                table[m:n] = -1
        if m > n:  # the usual step: blocks appended (or nothing)
            table[n:m] = blocks[n:]
            self.writes += m - n
            if m > self._used[r]:
                self._used[r] = m
        seen[:] = blocks
        return r

    def _seen_of(self, req_id: str) -> list[list[int]]:
        seen = self._seen.get(req_id)
        if seen is None:
            seen = self._seen[req_id] = [[] for _ in self.groups]
        return seen

    def update_all(self, req_id: str, tables: Sequence[Sequence[int]]) -> int:
        """Bring every group's row of a request up to ``tables`` (one list per group, in ``groups`` order).

        A decode step usually changes no group's table (a block lasts ``tokens_per_block`` steps), and
        then this is one comparison of the lists, however many groups a shared arena cut.
        """
        r = self.row(req_id)
        if self._seen_of(req_id) == tables:
            return r
        if len(tables) != len(self.groups):
            raise ValueError(f"request {req_id}: {len(tables)} block tables for {len(self.groups)} groups")
        for group, blocks in zip(self.groups, tables, strict=True):
            self.update(req_id, group, blocks)
        return r

    def tables(self, rows: Sequence[int] | np.ndarray | torch.Tensor) -> StepTables:
        """Every group's block tables of the given rows, in that order, in one ``(groups, len(rows), w)`` array.

        ``w`` is the longest list those rows have held, not the store's width: a step copies the blocks
        its requests have, not ``max_seq_len``'s worth (4x less at 2,048 of 8,192 tokens).
        """
        index = rows.numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows, dtype=np.int64)
        used = self._used
        width = max(1, max((used[r] for r in (rows if isinstance(rows, list) else index.tolist())), default=0))
        return StepTables(self.groups, self._data[:, index, :width], self._index)

    def drop(self, req_id: str) -> None:
        """Forget a finished request; its row goes back to the free list."""
        r = self._row.pop(req_id, None)
        if r is None:
            return
        self._seen.pop(req_id, None)
        self._data[:, r].fill(-1)
        self._used[r] = 0
        self._free.append(r)

    def keep_only(self, live: Iterable[str]) -> None:
        """Drop every request not in ``live``."""
        keep = set(live)
        for req_id in [r for r in self._row if r not in keep]:
            self.drop(req_id)

    def __len__(self) -> int:
        return len(self._row)
