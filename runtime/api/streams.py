"""One generation as an object: iterate its text pieces (sync or async), cancel it, read its result.

A Stream holds a sequence's slot of the engine (`Engine.exclusive`) while it generates, so as many
generations run together as the engine has slots (one by default); a stream cancelled while it
waits for a slot ends at once without computing anything.
Between two pieces a stream is suspended, still holding the engine, and its consumer may leave it
there: a stream that is dropped (`break` out of its loop, `return` from inside it) is freed at
once and lets go of the engine, since nothing refers to it but its consumer (the generator that
computes it keeps only the generation's state, and the engine refers to the stream it runs
weakly). `close()`, `engine.cancel()` and `engine.close()` end a suspended stream just as well,
and a generation asked for in the very thread a stream is suspended in ends that stream (it could
never resume while its own thread waits).

An AsyncStream makes its Stream on one of the engine's prompt threads, off the event loop (the chat
template's render, which may start its worker process, the prompt's tokens, a grammar's
compilation: up to hundreds of milliseconds), then runs it on one of its compute threads (one per
slot) and hands pieces to the event loop, which never blocks on the model. Long-lived threads, not
a thread per request: torch's OpenMP pool belongs to the thread that calls it, and a fresh thread
ran the decoder's small matmuls 10-20% slower (with several slots the passes themselves run on the
pass batcher's one thread).

This module imports no torch and no llama.cpp (the token loop is imported by the first generation):
`from tierflow import Engine` imports it.
"""

import asyncio
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tierflow.errors import TierflowError
from tierflow.runtime.generation.stats import GenerationStats, PrefillProgress
from tierflow.runtime.sampling.logprobs import TokenLogprob, token_logprob
from tierflow.runtime.sampling.sampler import Sampler
from tierflow.runtime.text.text_stream import TextStream
from tierflow.runtime.text.tool_calls import ToolCall, ToolCallStream

if TYPE_CHECKING:
    from tierflow.runtime.generation.token_loop import TokenGenerator
    from tierflow.runtime.text.tokenizer import Tokenizer
    from tierflow.speculative.choice import AutoSpeculator
    from tierflow.speculative.speculator import Speculator


class WeightTiers(Protocol):
    def peak_bytes_by_tier(self) -> dict[str, int]: ...


class GenerationHost(Protocol):
    """What a stream asks of the engine it runs on (the Engine is one): a slot held for the
    generation, the tokenizer, the speculator, and the weights' peak bytes for its stats."""

    tokenizer: "Tokenizer"
    speculator: "Speculator | AutoSpeculator | None"
    weights: WeightTiers

    def exclusive(self, stream: "weakref.ReferenceType[Stream] | None", cancelled: threading.Event | None,
                  prompt_ids: Sequence[int]) -> AbstractContextManager["TokenGenerator | None"]: ...


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]  # generated ids, without the end-of-generation token
    finish_reason: str  # "stop" (end token or stop string), "length", "cancelled", or "tool_calls"
    stats: GenerationStats = field(default_factory=GenerationStats)
    logprobs: list[TokenLogprob] | None = None  # one per token of tokens, when asked for
    # A chat with tools: the calls the answer made (text is then the content around them).
    tool_calls: list[ToolCall] | None = None
    stop_string: str | None = None  # the stop string that ended the answer, if one did


@dataclass
class _Generation:
    """What one generation computes with and has computed: all its generator keeps."""

    engine: GenerationHost
    prompt_ids: list[int]
    sampler: Sampler
    max_tokens: int
    text: TextStream
    tokens: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    cancelled: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult | None = None
    on_prefill: PrefillProgress | None = None
    context_shift: bool = False  # the prompt may reuse a shifted cache (TokenGenerator.prefill)
    logprobs: list[TokenLogprob] | None = None  # one per token, when the sampler records them
    piece_ends: list[int] = field(default_factory=list)  # len(tokens) as each piece was handed out
    # A chat with tools offered: the text that may be a call is held back from the pieces, and
    # the result gets the calls parsed out (Stream.offer_tools).
    tool_text: ToolCallStream | None = None
    with_tool_calls: Callable[[GenerationResult], GenerationResult] | None = None

    def finish(self, finish_reason: str) -> None:
        if self.result is None:
            result = GenerationResult(self.text.text, self.tokens, finish_reason, self.stats, self.logprobs,
                                      stop_string=self.text.matched_stop)
            self.result = result if self.with_tool_calls is None else self.with_tool_calls(result)

    def content(self, text: str, last: bool = False, cut: bool = False) -> str:
        """Of the text, what goes out as content now (all of it without tools offered); last: the
        text has ended, cut off by max_tokens if cut."""
        if self.tool_text is None:
            return text
        content = self.tool_text.push(text)
        return content + self.tool_text.finish(cut).content if last else content

    def record_logprobs(self, token: int) -> None:
        """The entry of the token just appended, if logprobs were asked for."""
        if self.logprobs is None:
            return
        row = self.sampler.take_logprobs(len(self.prompt_ids) + len(self.tokens) - 1)
        self.logprobs.append(token_logprob(row, token, self.sampler.params.top_logprobs,
                                           self.engine.tokenizer.token_bytes))

    def piece(self, text: str) -> str:
        """text, handed out as the next piece (its tokens are those appended since the last)."""
        self.piece_ends.append(len(self.tokens))
        return text


class Stream:
    """Text pieces of one generation; `.result` is set once the iteration ends."""

    def __init__(self, engine: GenerationHost, prompt_ids: list[int], sampler: Sampler, max_tokens: int,
                 text: TextStream, context_shift: bool = False):
        self._run = _Generation(engine, prompt_ids, sampler, max_tokens, text, context_shift=context_shift,
                                logprobs=[] if sampler.params.logprobs else None)
        self._pieces = _pieces(self._run, weakref.ref(self))
        self._computing = threading.Lock()  # held while a piece is computed, or the stream closed
        self._advanced_by: int | None = None  # the thread that last asked for a piece

    @property
    def result(self) -> GenerationResult | None:
        return self._run.result

    def offer_tools(self, tool_text: ToolCallStream,
                    with_tool_calls: Callable[[GenerationResult], GenerationResult]) -> None:
        """Makes this a chat with tools (before its first piece): text that may be a call is held
        back from the pieces until it is known, and the result has the calls parsed out."""
        self._run.tool_text, self._run.with_tool_calls = tool_text, with_tool_calls

    @property
    def tokens(self) -> list[int]:
        return self._run.tokens

    @property
    def stats(self) -> GenerationStats:
        return self._run.stats

    @property
    def prompt_ids(self) -> list[int]:
        return self._run.prompt_ids

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """One entry per token of .tokens so far, when logprobs=True was asked for; else None."""
        return self._run.logprobs

    def piece_logprobs(self, index: int) -> list[TokenLogprob] | None:
        """The entries of the tokens whose text the index-th piece (from 0) completes (a piece
        may hold several tokens; a token split across characters counts in the piece that
        completes it); None without logprobs. Safe from any thread once that piece is out."""
        run = self._run
        if run.logprobs is None:
            return None
        return run.logprobs[run.piece_ends[index - 1] if index else 0:run.piece_ends[index]]

    @property
    def on_prefill(self) -> PrefillProgress | None:
        """Called, in the thread that iterates, with (prompt tokens in the cache, prompt tokens) as
        the prompt's prefill starts and after each chunk of it; set it before the first piece."""
        return self._run.on_prefill

    @on_prefill.setter
    def on_prefill(self, progress: PrefillProgress | None) -> None:
        self._run.on_prefill = progress

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        with self._computing:
            self._advanced_by = threading.get_ident()
            return next(self._pieces)

    def cancel(self) -> None:
        """Stops this generation, from any thread; it ends with finish_reason "cancelled"."""
        self._run.cancelled.set()

    def close(self) -> None:
        """Ends this generation now, from any thread (finish_reason "cancelled" unless it had
        ended), and lets go of the engine."""
        self._run.cancelled.set()
        with self._computing:
            self._pieces.close()
        self._run.finish("cancelled")

    @property
    def suspended(self) -> bool:
        """Whether it waits between two pieces (not computing one, not closed by another thread)."""
        return self._advanced_by is not None and not self._computing.locked()

    def suspended_in(self, thread_ident: int) -> bool:
        """Whether it waits between two pieces for the thread `thread_ident` to ask for the next."""
        return self.suspended and self._advanced_by == thread_ident


def _pieces(run: _Generation, stream: weakref.ReferenceType) -> Iterator[str]:
    engine = run.engine
    with engine.exclusive(stream, run.cancelled, run.prompt_ids) as generator:
        if generator is None:  # cancelled while it waited
            run.finish("cancelled")
            return
        try:
            finish = yield from _generate(run, generator)
        finally:
            run.stats.peak_weight_bytes = engine.weights.peak_bytes_by_tier()
    tail = run.content(run.text.flush(), last=True, cut=finish == "length")
    run.finish(finish)
    if tail:
        yield run.piece(tail)  # text held back until the end, released after the engine


def _generate(run: _Generation, generator: "TokenGenerator") -> Iterator[str]:
    """The pieces; returns the finish reason."""
    from tierflow.runtime.generation.token_loop import generate_tokens

    engine = run.engine
    tokens = generate_tokens(generator, run.prompt_ids, run.sampler, run.max_tokens, engine.tokenizer.eog_ids,
                             run.cancelled, run.stats,
                             engine.speculator and engine.speculator.for_generation(run.sampler),
                             run.on_prefill, run.context_shift)
    try:
        for token in tokens:
            run.tokens.append(token)
            run.record_logprobs(token)
            piece = run.content(run.text.push(engine.tokenizer.token_bytes(token)))
            if piece:
                yield run.piece(piece)
            if run.text.stopped:
                return "stop"
    finally:
        tokens.close()
    if run.cancelled.is_set():
        return "cancelled"
    return "length" if len(run.tokens) >= run.max_tokens else "stop"


class AsyncStream:
    """`async for piece in stream`: the generation is made on one of the engine's prompt threads (a
    chat's template rendered, the prompt tokenized and checked, a grammar compiled), then runs on
    one of its compute threads; the event loop only hands pieces on.

    A bad argument raises from the first step, or from `await start()`, which makes the generation
    without waiting for a piece. Cancelling the consuming task, `await aclose()` or `cancel()` stops
    the generation.
    """

    def __init__(self, make: Callable[[], Stream], prompts: Executor, compute: Executor):
        self._make, self._prompts, self._compute = make, prompts, compute
        self._making: Future | None = None  # making the Stream, on a prompt thread
        self._stream: Stream | None = None  # once made
        self._cancelled = False  # cancel() may come before the Stream is made
        self._queue: asyncio.Queue | None = None
        self._future: Future | None = None  # the generation's run on a compute thread

    @property
    def result(self) -> GenerationResult | None:
        return None if self._stream is None else self._stream.result

    def piece_logprobs(self, index: int) -> list[TokenLogprob] | None:
        """Stream.piece_logprobs: the pieces are computed ahead on the compute thread, so a
        piece's tokens are found by its index, not by what has been computed by now."""
        return self._stream.piece_logprobs(index)

    @property
    def stats(self) -> GenerationStats:
        """The figures so far: those of a generation cancelled midway too, which has no result."""
        return GenerationStats() if self._stream is None else self._stream.stats

    def cancel(self) -> None:
        self._cancelled = True
        if self._stream is not None:
            self._stream.cancel()

    async def start(self) -> None:
        """Makes the generation now, off the event loop, raising a bad argument's error here (the
        first step does it otherwise); nothing is computed until the first step."""
        if self._making is None:
            self._making = _submit(self._prompts, self._make)
        self._stream = await asyncio.wrap_future(self._making)
        if self._cancelled:
            self._stream.cancel()

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> str:
        try:
            if self._future is None:
                await self.start()
                self._run(asyncio.get_running_loop())
            kind, value = await self._queue.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if kind == "piece":
            return value
        if kind == "error":
            raise value
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Cancels the generation and waits until it has let go of the engine."""
        self.cancel()
        if self._future is None:
            return
        if not self._future.cancel():  # a queued one is dropped; a started one is waited for
            await asyncio.wrap_future(self._future)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        stream = self._stream
        self._queue = asyncio.Queue()

        def send(item) -> None:
            try:
                loop.call_soon_threadsafe(self._queue.put_nowait, item)
            except RuntimeError:  # the loop has closed: nobody is listening any more
                stream.cancel()

        def run() -> None:
            try:
                for piece in stream:
                    send(("piece", piece))
                send(("end", None))
            except BaseException as error:  # handed to the awaiting task, raised there
                send(("error", error))

        self._future = _submit(self._compute, run)
        # Dropped before it ran (aclose, engine closed): the consumer still gets its end.
        self._future.add_done_callback(lambda done: done.cancelled() and send(("end", None)))


def _submit(executor: Executor, work: Callable[[], object]) -> Future:
    try:
        return executor.submit(work)
    except RuntimeError as error:  # shut down: the engine has closed
        raise TierflowError("the engine is closed") from error
