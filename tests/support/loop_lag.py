"""The longest pause of an event loop while a block runs, from a task that sleeps 1 ms at a time.

    async with LoopLag() as lag:
        await engine.achat(messages)
    lag.longest_s   # the longest a wake-up came late: what the loop waited on something else

`async_call_pauses` measures it around each of the Engine's async calls, in the order an app makes
them (tests/test_async_api.py, benchmarks/desktop.py).
"""

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from tierflow import Engine

TICK_S = 0.001
CHAT = [{"role": "user", "content": "Name three fruits."}]


class LoopLag:
    async def __aenter__(self) -> "LoopLag":
        self.longest_s = 0.0
        self._last = time.perf_counter()
        self._watcher = asyncio.create_task(self._watch())
        await asyncio.sleep(0)  # the watcher is asleep before the block starts
        return self

    async def __aexit__(self, *exc) -> None:
        self._woke()  # a pause the block ended with counts too
        self._watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watcher

    async def _watch(self) -> None:
        while True:
            self._last = time.perf_counter()
            await asyncio.sleep(TICK_S)
            self._woke()

    def _woke(self) -> None:
        self.longest_s = max(self.longest_s, time.perf_counter() - self._last - TICK_S)


async def async_call_pauses(**load_options) -> dict[str, float]:
    """The loop's longest pause during each async call on the bundled model, by the call's name:
    aload, then achat_stream (the engine's first chat), achat, astream, agenerate, aembed, aclose."""
    pauses = {}

    async def timed(name: str, call: Callable[[], Awaitable]):
        async with LoopLag() as lag:
            result = await call()
        pauses[name] = lag.longest_s
        return result

    engine = await timed("aload", lambda: Engine.aload(**load_options))
    await timed("achat_stream", lambda: _drain(engine.achat_stream(CHAT, max_tokens=8)))
    await timed("achat", lambda: engine.achat(CHAT, max_tokens=8))
    await timed("astream", lambda: _drain(engine.astream("Once upon a time", max_tokens=8)))
    await timed("agenerate", lambda: engine.agenerate("The sky is", max_tokens=8))
    await timed("aembed", lambda: engine.aembed(["a sentence", "another one"]))
    await timed("aclose", engine.aclose)
    return pauses


async def _drain(stream) -> None:
    async for _ in stream:
        pass
