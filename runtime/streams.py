"""One generation as an object: iterate its text pieces (sync or async), cancel it, read its result.

A Stream holds the engine's lock while it computes, so generations run one at a time; a stream
cancelled while it waits for the lock ends at once without computing anything. An AsyncStream runs
its Stream on the engine's compute thread and hands pieces to the event loop, which never blocks on
the model. One long-lived compute thread, not a thread per request: torch's OpenMP pool belongs to
the thread that calls it, and a fresh thread ran the decoder's small matmuls 10-20% slower.
"""

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierflow.runtime.generation import GenerationStats, generate_tokens
from tierflow.runtime.sampler import Sampler
from tierflow.runtime.text_stream import TextStream

if TYPE_CHECKING:
    from tierflow.runtime.engine import Engine

LOCK_POLL_S = 0.05  # how often a waiting stream checks whether it was cancelled


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]  # generated ids, without the end-of-generation token
    finish_reason: str  # "stop" (end token or stop string), "length", or "cancelled"
    stats: GenerationStats = field(default_factory=GenerationStats)


class Stream:
    """Text pieces of one generation; `.result` is set once the iteration ends."""

    def __init__(self, engine: "Engine", prompt_ids: list[int], sampler: Sampler, max_tokens: int,
                 text: TextStream):
        self.engine, self.prompt_ids, self.sampler = engine, prompt_ids, sampler
        self.max_tokens, self.text = max_tokens, text
        self.tokens: list[int] = []
        self.stats = GenerationStats(peak_weight_bytes=engine.weights.bytes_by_tier())
        self.result: GenerationResult | None = None
        self.cancelled = threading.Event()
        self._tail = ""  # text held back until the end, released after the lock
        self._iterator = self._pieces()

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        return next(self._iterator)

    def cancel(self) -> None:
        """Stops this generation, from any thread; it ends with finish_reason "cancelled"."""
        self.cancelled.set()

    def close(self) -> None:
        self._iterator.close()

    def _pieces(self) -> Iterator[str]:
        lock = self.engine._lock
        while not lock.acquire(timeout=LOCK_POLL_S):
            if self.cancelled.is_set():
                self._finish("cancelled")
                return
        try:
            self.engine._active = self
            self.engine._claim_threads()
            yield from self._generate()
        finally:
            self.engine._active = None
            lock.release()
        if self._tail:
            yield self._tail

    def _generate(self) -> Iterator[str]:
        engine = self.engine
        tokens = generate_tokens(engine._generator, self.prompt_ids, self.sampler, self.max_tokens,
                                 engine.tokenizer.eog_ids, self.cancelled, self.stats,
                                 engine.speculator and engine.speculator.for_generation(self.sampler))
        finish = "stop"
        try:
            for token in tokens:
                self.tokens.append(token)
                piece = self.text.push(engine.tokenizer.token_bytes(token))
                if piece:
                    yield piece
                if self.text.stopped:
                    break
            else:
                if self.cancelled.is_set():
                    finish = "cancelled"
                elif len(self.tokens) >= self.max_tokens:
                    finish = "length"
        finally:
            tokens.close()
        self._tail = self.text.flush()
        self._finish(finish)

    def _finish(self, finish_reason: str) -> None:
        self.result = GenerationResult(self.text.text, self.tokens, finish_reason, self.stats)


class AsyncStream:
    """`async for piece in stream`: the generation runs on the engine's compute thread.

    Cancelling the consuming task, `await aclose()` or `cancel()` stops the generation.
    """

    def __init__(self, stream: Stream, executor: Executor):
        self._stream = stream
        self._executor = executor
        self._queue: asyncio.Queue | None = None
        self._future: Future | None = None

    @property
    def result(self) -> GenerationResult | None:
        return self._stream.result

    def cancel(self) -> None:
        self._stream.cancel()

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> str:
        if self._future is None:
            self._start(asyncio.get_running_loop())
        try:
            kind, value = await self._queue.get()
        except asyncio.CancelledError:
            self._stream.cancel()
            raise
        if kind == "piece":
            return value
        if kind == "error":
            raise value
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Cancels the generation and waits until it has let go of the engine."""
        self._stream.cancel()
        if self._future is None:
            return
        if not self._future.cancel():  # a queued one is dropped; a started one is waited for
            await asyncio.wrap_future(self._future)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._queue = asyncio.Queue()

        def send(item) -> None:
            try:
                loop.call_soon_threadsafe(self._queue.put_nowait, item)
            except RuntimeError:  # the loop has closed: nobody is listening any more
                self._stream.cancel()

        def run() -> None:
            try:
                for piece in self._stream:
                    send(("piece", piece))
                send(("end", None))
            except BaseException as error:  # handed to the awaiting task, raised there
                send(("error", error))

        self._future = self._executor.submit(run)
        # Dropped before it ran (aclose, engine closed): the consumer still gets its end.
        self._future.add_done_callback(lambda done: done.cancelled() and send(("end", None)))
