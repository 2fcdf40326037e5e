"""HiddenTrail: a sequence's final-normed hidden states by cache slot, which a multi-token-prediction
block reads (speculative/mtp.py): the block's input at position q is the target's hidden state at
q - 1 beside the token at q.

The token generator records each pass's rows at the slots the pass wrote and moves them as it
moves its cache (a kept tree path, a truncation); the reader forgets what it has read. At most
`max_rows` rows are kept, the latest: a longer prompt leaves its oldest positions unread.
"""

import numpy as np


class HiddenTrail:
    def __init__(self, width: int, max_rows: int):
        self.width, self.max_rows = width, max_rows
        self.first = 0  # the slot of rows[0]
        self.rows = np.zeros((0, width), np.float32)

    @property
    def end(self) -> int:
        """One past the last slot held."""
        return self.first + len(self.rows)

    def record(self, start: int, rows: np.ndarray) -> None:
        """rows [T, E] at slots start .. start + T - 1 (what was held from start on is replaced)."""
        if start < self.first or start > self.end:  # nothing held next to them: start over
            self.first, self.rows = start, rows[-self.max_rows:].copy()
            return
        kept = self.rows[:start - self.first]
        self.rows = np.concatenate([kept, rows])[-self.max_rows:]
        self.first = start + len(rows) - len(self.rows)

    def keep_path(self, start: int, offsets: list[int]) -> None:
        """Of a tree recorded from slot `start`, keeps the rows at offsets, moved to start, start + 1, ..."""
        at = [start + i - self.first for i in offsets]
        if not at or at[0] < 0 or at[-1] >= len(self.rows):
            self.truncate(start)
            return
        self.rows = np.concatenate([self.rows[:start - self.first], self.rows[at]])

    def truncate(self, length: int) -> None:
        """Forgets the slots from `length` on."""
        self.rows = self.rows[:max(0, length - self.first)]

    def forget_before(self, slot: int) -> None:
        """Lets the rows before `slot` go (read already)."""
        drop = min(max(0, slot - self.first), len(self.rows))
        self.rows, self.first = self.rows[drop:], self.first + drop

    def clear(self) -> None:
        self.first, self.rows = 0, self.rows[:0]

    def rows_for(self, first: int, last: int) -> np.ndarray | None:
        """The rows of slots first .. last - 1, or None when any of them is not held."""
        if first < self.first or last > self.end:
            return None
        return self.rows[first - self.first:last - self.first]
