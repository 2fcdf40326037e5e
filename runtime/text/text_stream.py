"""Turns generated token bytes into text pieces: UTF-8 safe across tokens, cut at stop strings."""

import codecs
from collections.abc import Sequence


class TextStream:
    """Accumulates token bytes and releases text that can no longer change.

    A multi-byte character split across tokens is held until complete, and text that might be the
    start of a stop string is held until it is known not to be one, so a streamed piece is never
    taken back.
    """

    def __init__(self, stop: Sequence[str] = ()):
        self.stop = [s for s in stop if s]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded, not yet released
        self.text = ""  # released so far
        self.stopped = False
        self.matched_stop: str | None = None  # the stop string that ended the text

    def push(self, token_bytes: bytes) -> str:
        """Adds one token's bytes; returns the text that is now safe to release (maybe "")."""
        self._pending += self._decoder.decode(token_bytes)
        for stop in self.stop:
            index = self._pending.find(stop)
            if index != -1:
                self._pending = self._pending[:index]
                self.stopped, self.matched_stop = True, stop
        if self.stopped:
            return self._release(len(self._pending))
        return self._release(len(self._pending) - self._held_back())

    def flush(self) -> str:
        """Releases everything still held (at the end of generation)."""
        if not self.stopped:
            self._pending += self._decoder.decode(b"", final=True)
        return self._release(len(self._pending))

    def _held_back(self) -> int:
        """Length of the longest tail of the pending text that begins some stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if stop.startswith(self._pending[-size:]):
                    longest = size
                    break
        return longest

    def _release(self, size: int) -> str:
        piece, self._pending = self._pending[:size], self._pending[size:]
        self.text += piece
        return piece
