"""One generation as an object: iterate its text pieces (sync or async), cancel it, read its result.

A Stream holds the engine's lock while it computes, so generations run one at a time; a stream
cancelled while it waits for the lock ends at once without computing anything. An AsyncStream runs
its Stream on a worker thread and hands pieces to the event loop, which never blocks on the model.
"""

import asyncio
import threading
from collections.abc import Iterator
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
            yield from self._generate()
        finally:
            self.engine._active = None
            lock.release()
        if self._tail:
            yield self._tail

    def _generate(self) -> Iterator[str]:
        engine = self.engine
        tokens = generate_tokens(engine._generator, self.prompt_ids, self.sampler, self.max_tokens,
                                 engine.tokenizer.eog_ids, self.cancelled, self.stats)
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
    """`async for piece in stream`: the generation runs on a worker thread.

    Cancelling the consuming task, `await aclose()` or `cancel()` stops the generation.
    """

    def __init__(self, stream: Stream):
        self._stream = stream
        self._queue: asyncio.Queue | None = None
        self._thread: threading.Thread | None = None

    @property
    def result(self) -> GenerationResult | None:
        return self._stream.result

    def cancel(self) -> None:
        self._stream.cancel()

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> str:
        if self._thread is None:
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
        """Cancels the generation and waits for its thread to let go of the engine."""
        self._stream.cancel()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

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

        self._thread = threading.Thread(target=run, name="tierflow-generation", daemon=True)
        self._thread.start()
