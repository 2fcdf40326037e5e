"""The API for apps: async generation that never blocks the event loop, per-generation
cancellation, and engines that give back everything when closed."""

import asyncio
import ctypes
import gc
import threading
import time

import psutil
import pytest

from tests.support.loop_lag import CHAT
from tests.support.make_model import ModelSpec, write_model
from tests.support.peak_memory import in_child
from tierflow import Engine, TierflowError
from tierflow.offload.gguf.reader import GGUFFile

GREEDY = dict(temperature=0)
LONG = dict(max_tokens=2000, temperature=1.0, seed=5)
ASYNC_CALLS = ["aload", "achat_stream", "achat", "astream", "agenerate", "aembed", "aclose"]  # in order


def test_agenerate_gives_the_same_result_as_generate(engine):
    expected = engine.generate("The sky is", max_tokens=12, **GREEDY)
    result = asyncio.run(engine.agenerate("The sky is", max_tokens=12, **GREEDY))
    assert result.tokens == expected.tokens and result.text == expected.text


def test_achat_stream_pieces_join_to_the_chat_answer(engine):
    messages = [{"role": "user", "content": "Name three fruits."}]

    async def collect():
        stream = engine.achat_stream(messages, max_tokens=24, **GREEDY)
        pieces = [piece async for piece in stream]
        return pieces, stream.result

    pieces, result = asyncio.run(collect())
    assert "".join(pieces) == result.text == engine.chat(messages, max_tokens=24, **GREEDY).text
    assert len(pieces) > 1


def test_the_event_loop_keeps_running_during_generation(engine):
    async def main():
        ticks = 0
        generation = asyncio.create_task(engine.agenerate("Once upon a time", max_tokens=40, **GREEDY))
        while not generation.done():
            await asyncio.sleep(0.01)
            ticks += 1
        return ticks, (await generation).stats

    ticks, stats = asyncio.run(main())
    seconds = stats.prefill_seconds + stats.decode_seconds
    assert ticks >= seconds / 0.01 * 0.5  # the loop ran at least half its ticks meanwhile


def test_aload_loads_while_the_event_loop_keeps_running(model_path):
    async def main():
        ticks = 0
        loading = asyncio.create_task(Engine.aload(model_path, threads=2, context_length=256))
        while not loading.done():
            await asyncio.sleep(0.01)
            ticks += 1
        return ticks, await loading

    ticks, engine = asyncio.run(main())
    with engine:
        assert engine.generate("Hi", max_tokens=2, **GREEDY).tokens
    assert ticks > 1  # a load that held the loop would let it tick once, after the load


def test_a_cancelled_aload_closes_the_engine_it_loads(model_path, monkeypatch):
    closed = threading.Event()
    close = Engine.close

    def recording_close(self):
        close(self)
        closed.set()

    monkeypatch.setattr(Engine, "close", recording_close)

    async def main():
        loading = asyncio.create_task(Engine.aload(model_path, threads=2, context_length=256))
        await asyncio.sleep(0)  # the load has started on its thread
        loading.cancel()
        await asyncio.gather(loading, return_exceptions=True)
        return loading.cancelled()

    assert asyncio.run(main())
    assert closed.wait(120)


def test_cancelling_the_task_cancels_the_generation(engine):
    async def main():
        stream = engine.astream("Tell me a long story.", **LONG)
        started = asyncio.Event()

        async def consume():
            async for _ in stream:
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()  # cancelled mid-generation, however fast the model writes
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()
        return stream.result

    result = asyncio.run(main())
    assert result.finish_reason == "cancelled" and len(result.tokens) < 2000
    assert engine.generate("Hi", max_tokens=2, **GREEDY).tokens  # the engine is free again


@pytest.mark.slow
def test_a_cancelled_waiting_stream_ends_at_once_and_spares_the_running_one(engine):
    story = [{"role": "user", "content": "Write a long story about a dragon."}]
    running = engine.chat_stream(story, max_tokens=200, **GREEDY)  # seconds: still running below
    worker = threading.Thread(target=lambda: [None for _ in running])
    worker.start()
    time.sleep(0.3)
    waiting = engine.stream("Hello", max_tokens=5)
    waiting.cancel()
    started = time.perf_counter()
    assert list(waiting) == []
    assert time.perf_counter() - started < 0.5 and running.result is None  # still running
    worker.join()
    assert waiting.result.finish_reason == "cancelled" and waiting.result.tokens == []
    assert running.result.finish_reason == "length"


def test_concurrent_async_requests_queue_and_each_gets_its_own_answer(engine):
    prompts = ["Red", "Green", "Blue"]
    expected = [engine.generate(p, max_tokens=6, **GREEDY).tokens for p in prompts]

    async def main():
        return await asyncio.gather(*(engine.agenerate(p, max_tokens=6, **GREEDY) for p in prompts))

    assert [r.tokens for r in asyncio.run(main())] == expected


@pytest.mark.slow
def test_loading_and_closing_twenty_times_keeps_memory_flat(tmp_path):
    path = write_model(tmp_path / "m.gguf", ModelSpec(hidden_size=256, ffn_size=512,
                                                      weight_type="F32", embedding_type="F32"))
    process = psutil.Process()

    def load_generate_close():
        with Engine.load(path, threads=1, context_length=256) as engine:
            engine.generate("Hi", max_tokens=2)

    def resident_bytes() -> int:
        """RSS once freed memory is handed back: the C allocator keeps freed blocks, and how many
        it keeps depends on what ran before (tens of MB after some test files), not on a leak."""
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return process.memory_info().rss

    for _ in range(3):  # allocator and caches settle
        load_generate_close()
    settled = resident_bytes()
    threads = threading.active_count()
    for _ in range(17):
        load_generate_close()
    assert resident_bytes() - settled < 60_000_000  # one load holds ~70 MB of weights
    assert threading.active_count() <= threads


def test_aclose_closes_the_engine_and_closing_again_does_nothing(model_path):
    async def main():
        engine = await Engine.aload(model_path, threads=2, context_length=256)
        await engine.aclose()
        await engine.aclose()
        return engine

    engine = asyncio.run(main())
    with pytest.raises(TierflowError, match="closed"):
        engine.generate("Hi", max_tokens=1)


def test_aclose_closes_on_another_thread_than_the_event_loops(model_path, monkeypatch):
    closed_on = []
    close = Engine.close

    def recording_close(self):
        closed_on.append(threading.current_thread())
        close(self)

    monkeypatch.setattr(Engine, "close", recording_close)

    async def main():
        engine = await Engine.aload(model_path, threads=2, context_length=256)
        await engine.aclose()
        return threading.current_thread()

    loop_thread = asyncio.run(main())
    assert closed_on and loop_thread not in closed_on


def test_a_bad_argument_to_astream_raises_from_its_start(engine):
    async def main():
        stream = engine.astream("Hi", max_tokens=-1)
        with pytest.raises(TierflowError, match="max_tokens"):
            await stream.start()

    asyncio.run(main())


@pytest.fixture(scope="module")
def loop_pauses() -> dict[str, float]:
    """The event loop's longest pause during each async call, in a process of its own: its first
    achat_stream is the process's first chat, whose template starts a worker process."""
    return in_child('''
        import asyncio
        # What the first load imports, imported first: Python holds its lock while a C extension
        # initialises, which pauses the loop once (Engine.aload's docstring says so).
        import llama_cpp, torch
        from tests.support.loop_lag import async_call_pauses

        report(**asyncio.run(async_call_pauses(threads=2, context_length=512)))
    ''')


@pytest.mark.slow
@pytest.mark.parametrize("call", ASYNC_CALLS)
def test_no_async_call_pauses_the_event_loop(loop_pauses, call):
    assert loop_pauses[call] < 0.1  # the goal is 20 ms (benchmarks/desktop.py); shared machines pause too


def test_no_thread_the_engine_started_outlives_its_close(model_path):
    before = set(threading.enumerate())

    async def main():
        engine = await Engine.aload(model_path, threads=2, context_length=256)
        async for _ in engine.achat_stream(CHAT, max_tokens=4):  # the prompt and compute threads
            pass
        await engine.aembed("a sentence")
        await engine.aclose()

    asyncio.run(main())
    deadline = time.monotonic() + 5  # a thread that has finished its work may take a moment to end
    while (left := [t.name for t in threading.enumerate() if t not in before]) and (
            time.monotonic() < deadline):
        time.sleep(0.01)
    assert left == []


@pytest.mark.slow
def test_closing_the_last_engine_stops_the_chat_templates_worker_processes():
    measured = in_child('''
        import psutil
        from tierflow import Engine

        with Engine.load(threads=2, context_length=256) as engine:
            engine.chat([{"role": "user", "content": "Hi"}], max_tokens=2)
            rendering = len(psutil.Process().children())
        report(rendering=rendering, closed=len(psutil.Process().children()))
    ''')
    assert measured["rendering"] >= 1 and measured["closed"] == 0


def test_a_load_leaves_its_model_file_to_no_garbage_collection(model_path):
    """The model file's map and metadata (the vocabulary's strings: about 10 MB for the bundled
    model) go as the load ends, not at some later collection."""
    gc.collect()
    before = {id(o) for o in gc.get_objects() if type(o) is GGUFFile}
    gc.disable()
    try:
        Engine.load(model_path, threads=2, context_length=256).close()
        left = [o for o in gc.get_objects() if type(o) is GGUFFile and id(o) not in before]
    finally:
        gc.enable()
    assert left == []


@pytest.mark.slow
def test_loading_and_closing_the_bundled_model_again_takes_no_more_memory():
    """A closed engine's KV cache (about 190 MB at the trained context) goes back to the system,
    not to the C allocator's free lists, where the first close left it."""
    measured = in_child('''
        from tierflow import Engine

        closed = []
        for _ in range(4):
            with Engine.load(threads=2) as engine:
                engine.chat([{"role": "user", "content": "Hi"}], max_tokens=4)
            closed.append(rss())
        report(closed=closed)
    ''')
    first, *later = measured["closed"]
    assert max(later) - first < 16 << 20
