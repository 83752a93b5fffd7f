"""A request's block table: a growable int32 array, cheap to copy into a batch."""

from __future__ import annotations

import numpy as np


class BlockTable:
    """Physical block ids of one request, in logical order."""

    __slots__ = ("_ids", "_len")

    def __init__(self, block_ids=()):
        self._ids = np.empty(max(8, len(block_ids)), dtype=np.int32)
        self._len = 0
        for block_id in block_ids:
            self.append(block_id)

    def append(self, block_id: int) -> None:
        if self._len == len(self._ids):
            self._ids = np.concatenate([self._ids, np.empty_like(self._ids)])
        self._ids[self._len] = block_id
        self._len += 1

    def replace(self, block_ids) -> None:
        self._len = 0
        for block_id in block_ids:
            self.append(block_id)

    def clear(self) -> None:
        self._len = 0

    def array(self) -> np.ndarray:
        """A view of the ids (valid until the table changes)."""
        return self._ids[:self._len]

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> int:
        if not -self._len <= index < self._len:
            raise IndexError(index)
        return int(self._ids[index % self._len])

    def __iter__(self):
        return iter(self.array().tolist())

    def __repr__(self) -> str:
        return f"BlockTable({self.array().tolist()})"
