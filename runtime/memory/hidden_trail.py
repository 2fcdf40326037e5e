"""HiddenTrail: a sequence's final-normed hidden states by cache slot, which a multi-token-prediction
block reads (speculative/mtp.py): the block's input at position q is the target's hidden state at
q - 1 beside the token at q.

The token generator records each pass's rows at the slots the pass wrote and moves them as it
moves its cache (a kept tree path, a truncation); the reader forgets what it has read. The rows
live in a ring of `max_rows`, allocated once (what the budget counts): slot s at row s % max_rows,
so a pass costs its own rows whatever the trail holds, and a longer prompt leaves only its last
max_rows positions.
"""

import numpy as np


class HiddenTrail:
    def __init__(self, width: int, max_rows: int):
        self.ring = np.zeros((max_rows, width), np.float32)
        self.first = self.end = 0  # the slots held: first .. end - 1

    def record(self, start: int, rows: np.ndarray) -> None:
        """rows [T, E] at slots start .. start + T - 1 (what was held from start on is replaced)."""
        if not self.first <= start <= self.end:  # nothing held next to them: start over
            self.first = start
        self.end = start + len(rows)
        self.first = max(self.first, self.end - len(self.ring))
        kept = rows[len(rows) - (self.end - max(start, self.first)):]
        self.ring[self._at(self.end - len(kept), self.end)] = kept

    def keep_path(self, start: int, offsets: list[int]) -> None:
        """Of a tree recorded from slot `start`, keeps the rows at offsets, moved to start, start + 1, ..."""
        kept = self.rows_for(start, start + max(offsets) + 1) if offsets and start >= self.first else None
        if kept is None:
            self.truncate(start)
            return
        self.end = start + len(offsets)
        self.ring[self._at(start, self.end)] = kept[offsets]

    def truncate(self, length: int) -> None:
        """Forgets the slots from `length` on."""
        self.end = max(self.first, min(self.end, length))

    def forget_before(self, slot: int) -> None:
        """Lets the rows before `slot` go (read already)."""
        self.first = min(max(self.first, slot), self.end)

    def clear(self) -> None:
        self.first = self.end = 0

    def rows_for(self, first: int, last: int) -> np.ndarray | None:
        """A copy of the rows of slots first .. last - 1, or None when any of them is not held."""
        if first < self.first or last > self.end:
            return None
        return self.ring[self._at(first, last)]

    def _at(self, first: int, last: int) -> np.ndarray:
        return np.arange(first, last) % len(self.ring)
