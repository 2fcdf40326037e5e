"""The engine's sequences: one token generator per sequence decoded together, each over its own
KV cache, and who holds which.

A generation holds one slot for its whole run. It gets the free slot whose cache already holds the
longest prefix of its prompt, among those that would lose at most a quarter of what they hold (a
conversation's next turn finds its own history), else the free slot used least recently (a new
conversation that shares only a system prompt with another does not evict that one's history),
waiting while every slot is taken. What needs the whole engine (closing it, recording
routing) waits for every slot, and no new generation starts meanwhile.
"""

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

from tierflow.runtime.generation.token_loop import TokenGenerator, common_prefix

if TYPE_CHECKING:
    from tierflow.runtime.api.streams import Stream

T = TypeVar("T")
POLL_S = 0.05  # how often a waiting caller checks whether it was cancelled


class SlotPool:
    def __init__(self, generators: list[TokenGenerator]):
        self.generators = generators
        self._changed = threading.Condition()
        self._free = set(range(len(generators)))
        self._holders: dict[int, weakref.ReferenceType["Stream"]] = {}
        self._draining = False  # something waits for every slot: no new holder meanwhile
        self._last_used = [0] * len(generators)  # a count of takes at each slot's last one
        self._takes = 0

    @property
    def size(self) -> int:
        return len(self.generators)

    @property
    def busy(self) -> int:
        """Slots held now."""
        return self.size - len(self._free)

    def holders(self) -> list["Stream"]:
        """The streams holding slots now (those still alive)."""
        streams = (ref() for ref in list(self._holders.values()))
        return [stream for stream in streams if stream is not None]

    @contextmanager
    def one(self, prompt_ids: Sequence[int] = (), cancelled: threading.Event | None = None,
            stream: "weakref.ReferenceType[Stream] | None" = None) -> Iterator[int | None]:
        """A slot for the block: its index, or None (having waited no more) once `cancelled` is
        set. `stream` (weakly held) is what holds it: engine.cancel() stops the holders."""
        slot = self._take(prompt_ids, cancelled, stream)
        try:
            yield slot
        finally:
            if slot is not None:
                with self._changed:
                    self._holders.pop(slot, None)
                    self._free.add(slot)
                    self._changed.notify_all()

    @contextmanager
    def every(self) -> Iterator[None]:
        """Waits for every slot to be free and keeps new generations out for the block."""
        with self._changed:
            while self._draining:
                self._changed.wait()
            self._draining = True
        try:
            self._wait_for(lambda: True if len(self._free) == self.size else None)
            yield
        finally:
            with self._changed:
                self._draining = False
                self._changed.notify_all()

    def _take(self, prompt_ids: Sequence[int], cancelled: threading.Event | None,
              stream: "weakref.ReferenceType[Stream] | None") -> int | None:
        """The free slot whose cache holds the longest prefix of prompt_ids, taken; None if
        cancelled first."""
        def take() -> int | None:
            if not self._free or self._draining:
                return None
            slot = self._best_free(prompt_ids)
            self._free.discard(slot)
            self._takes += 1
            self._last_used[slot] = self._takes
            if stream is not None:
                self._holders[slot] = stream
            return slot

        return self._wait_for(take, cancelled)

    def _best_free(self, prompt_ids: Sequence[int]) -> int:
        free = sorted(self._free)
        held = {i: self.generators[i].cached_tokens for i in free}
        shared = {i: common_prefix(held[i], prompt_ids) for i in free}
        # a slot that would lose at most a quarter of what it holds
        matching = [i for i in free if shared[i] and 4 * shared[i] >= 3 * len(held[i])]
        if matching:
            return max(matching, key=shared.__getitem__)
        return min(free, key=self._last_used.__getitem__)

    def _wait_for(self, attempt: Callable[[], T | None],
                  cancelled: threading.Event | None = None) -> T | None:
        """attempt()'s first result that is not None (it runs under the condition, so what it
        checks and takes is one step), or None if cancelled first. A stream suspended in this very
        thread can never resume and let go of its slot: it is ended."""
        me = threading.get_ident()
        while True:
            with self._changed:
                got = attempt()
                if got is not None:
                    return got
                if cancelled is not None and cancelled.is_set():
                    return None
                stuck = [stream for stream in self.holders() if stream.suspended_in(me)]
                if not stuck:
                    self._changed.wait(POLL_S)
                    continue
            for stream in stuck:
                stream.close()
