"""Block tables kept as tensors across steps: one row per live request and group, appended to as it grows.

Planning a step used to turn every request's Python block-table lists into a fresh padded tensor
(``torch.tensor`` over lists of lists), for every group, every step. A request's table changes little
from one step to the next — a decode step adds a block every ``tokens_per_block`` tokens — so the
executor keeps a :class:`BlockTableStore`: each group has one ``(rows, width)`` int64 tensor, each
live request owns a row, and :meth:`BlockTableStore.update` writes only the entries that changed
since the last step (new blocks at the end; a V2 window releasing early blocks as ``-1``, or a
resumed request that got other blocks, rewrite just the entries that differ). A step's tables
are then one ``index_select`` of the rows it schedules (:meth:`BlockTableStore.tables`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


class BlockTableStore:
    """Per-group ``(rows, width)`` tensors of block tables, a row per live request, padded with -1."""

    def __init__(self, groups: Iterable[str], width: int, rows: int = 8) -> None:
        if width < 1:
            raise ValueError(f"width must be >= 1 block, got {width}")
        self.groups = tuple(groups)
        self.width = width
        self._tables = {g: torch.full((rows, width), -1, dtype=torch.long) for g in self.groups}
        self._row: dict[str, int] = {}
        self._free: list[int] = list(range(rows - 1, -1, -1))
        self._seen: dict[tuple[str, str], list[int]] = {}  # the lists each row holds, to diff the next step's
        #: entries written since the store was built (a test reads it: a decode step writes few)
        self.writes = 0

    def _grow(self) -> None:
        rows = next(iter(self._tables.values())).shape[0] if self._tables else 0
        more = max(rows, 8)
        for g, t in self._tables.items():
            self._tables[g] = torch.cat((t, torch.full((more, self.width), -1, dtype=torch.long)))
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
        if len(blocks) > self.width:
            raise ValueError(f"request {req_id}: block table of group {group!r} has {len(blocks)} blocks; the store "
                             f"holds {self.width} per request (max_seq_len / tokens_per_block)")
        r = self.row(req_id)
        seen = self._seen.get((req_id, group))
        if seen is None:
            seen = self._seen[(req_id, group)] = []
        n, m = len(seen), len(blocks)
        table = self._tables[group]
        if not (m >= n and list(blocks[:n]) == seen):  # a window released blocks, or a resume moved them
            changed = [i for i in range(min(n, m)) if seen[i] != blocks[i]]
            if changed:
                index = torch.tensor(changed, dtype=torch.long)
                table[r].index_copy_(0, index, torch.tensor([blocks[i] for i in changed], dtype=torch.long))
                self.writes += len(changed)
            if m < n:
                table[r, m:n] = -1
        if m > n:  # the usual step: blocks appended (or nothing)
            table[r, n:m] = torch.tensor(list(blocks[n:]), dtype=torch.long)
            self.writes += m - n
        seen[:] = blocks
        return r

    def tables(self, rows: Sequence[int] | torch.Tensor) -> dict[str, torch.Tensor]:
        """``{group: (len(rows), width)}`` block tables of the given rows, in that order."""
        index = rows if isinstance(rows, torch.Tensor) else torch.tensor(list(rows), dtype=torch.long)
        return {g: t.index_select(0, index) for g, t in self._tables.items()}

    def drop(self, req_id: str) -> None:
        """Forget a finished request; its row goes back to the free list."""
        r = self._row.pop(req_id, None)
        if r is None:
            return
        for g in self.groups:
            self._seen.pop((req_id, g), None)
            self._tables[g][r].fill_(-1)
        self._free.append(r)

    def keep_only(self, live: Iterable[str]) -> None:
        """Drop every request not in ``live``."""
        keep = set(live)
        for req_id in [r for r in self._row if r not in keep]:
            self.drop(req_id)

    def __len__(self) -> int:
        return len(self._row)

