"""How many requests the server takes at once, and how many wait: the 503 past them."""

from collections.abc import Callable

from tierflow.server.openai_schema import ApiError


class Admission:
    """The server's admission of requests: `running` answered at once (the engine's parallel
    sequences, its SlotPool's slots), up to `queued` more waiting for one (or tokenizing), a 503
    past them. Touched only from the event loop, so a plain counter suffices."""

    def __init__(self, running: int, queued: int):
        self.running, self.capacity, self.used = running, running + queued, 0

    @property
    def num_running(self) -> int:
        """Requests being answered: as many as the engine generates together."""
        return min(self.used, self.running)

    @property
    def num_queued(self) -> int:
        return self.used - self.num_running

    def acquire(self) -> Callable[[], None]:
        """Takes a slot or raises a 503; returns the (idempotent) release."""
        if self.used >= self.capacity:
            raise ApiError(503, "the server is busy: too many requests are waiting; retry later",
                           type="server_error", code="server_busy")
        self.used += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released, self.used = True, self.used - 1

        return release
