"""The server's models by name (server/model_pool.py): loaded once on demand however many requests
wait, kept while used, unloaded by keep_alive or for another's room, least recently used first,
and a 503 naming the memory when the busy ones leave none. The engines here are stand-ins that
hold a number of bytes: what is tested is the pool's bookkeeping, which the live server tests
(test_server_models.py) show on real engines."""

import asyncio
import math
import time
from dataclasses import dataclass, field

import pytest

from tierflow.server.model_pool import FOREVER, ModelPool, parse_keep_alive
from tierflow.server.openai_schema import ApiError

MIB = 1 << 20


@dataclass
class _Plan:
    used_bytes: dict


@dataclass
class _Engine:
    name: str
    ram: int
    closed: bool = False

    @property
    def plan(self) -> _Plan:
        return _Plan({"cpu": self.ram, "gpu": 0})

    def close(self) -> None:
        self.closed = True


@dataclass
class _Loader:
    sizes: dict[str, int]
    delay_s: float = 0.0
    loads: list[str] = field(default_factory=list)
    budgets: list[dict] = field(default_factory=list)

    def needs(self, source: str) -> dict[str, int]:
        return {"cpu": self.sizes[source], "gpu": 0}

    def load(self, source: str, budgets: dict[str, int]) -> _Engine:
        time.sleep(self.delay_s)
        self.loads.append(source)
        self.budgets.append(budgets)
        return _Engine(source, self.sizes[source])


def pool_of(loader: _Loader, **options) -> ModelPool:
    return ModelPool({name: name for name in loader.sizes}, loader, lambda engine: engine.name, **options)


def run(coroutine):
    return asyncio.run(coroutine)


def test_requests_for_a_loading_model_wait_for_its_one_load():
    loader = _Loader({"a": MIB, "b": MIB}, delay_s=0.2)

    async def three_at_once():
        pool = pool_of(loader)
        leases = await asyncio.gather(*(pool.acquire("a") for _ in range(3)))
        assert {lease.engine.name for lease in leases} == {"a"} and pool.models["a"].users == 3
        return pool

    run(three_at_once())
    assert loader.loads == ["a"]


def test_an_unknown_name_is_a_404_naming_the_served_ones():
    pool = pool_of(_Loader({"a": MIB, "b": MIB}))
    with pytest.raises(ApiError) as refused:
        pool.find("c")
    assert refused.value.status == 404 and "a, b" in refused.value.message


def test_one_served_model_answers_any_name_and_ollama_tags_resolve():
    assert pool_of(_Loader({"a": MIB})).find("gpt-4o").name == "a"
    assert pool_of(_Loader({"a": MIB, "b": MIB})).find("b:latest").name == "b"


def test_a_model_that_does_not_fit_unloads_the_least_recently_used_idle_one():
    loader = _Loader({"a": 40 * MIB, "b": 40 * MIB, "c": 40 * MIB})

    async def scenario():
        pool = pool_of(loader, budgets={"cpu": 100 * MIB})
        for name in ("a", "b", "a", "c"):  # b is then the least recently used
            (await pool.acquire(name)).release()
        return pool

    pool = run(scenario())
    assert sorted(model.name for model in pool.loaded()) == ["a", "c"]
    assert loader.budgets[-1] == {"cpu": 60 * MIB}  # the RAM a's 40 MiB leaves: the load's own budget


def test_max_loaded_unloads_the_least_recently_used_beyond_it():
    loader = _Loader({"a": MIB, "b": MIB})

    async def scenario():
        pool = pool_of(loader, max_loaded=1)
        (await pool.acquire("a")).release()
        first = pool.models["a"].engine
        (await pool.acquire("b")).release()
        return pool, first

    pool, first = run(scenario())
    assert [model.name for model in pool.loaded()] == ["b"] and first.closed


def test_a_model_with_no_room_beside_busy_ones_is_a_503_naming_its_memory():
    loader = _Loader({"a": 80 * MIB, "b": 40 * MIB})

    async def scenario():
        pool = pool_of(loader, budgets={"cpu": 100 * MIB})
        held = await pool.acquire("a")  # a request is using it
        try:
            await pool.acquire("b")
        finally:
            held.release()

    with pytest.raises(ApiError) as refused:
        run(scenario())
    message = refused.value.message
    assert refused.value.status == 503 and "needs 40.0 MiB" in message and "a (80.0 MiB)" in message


def test_keep_alive_zero_unloads_after_the_answer_and_forever_keeps():
    loader = _Loader({"a": MIB, "b": MIB})

    async def scenario():
        pool = pool_of(loader)
        (await pool.acquire("a", keep_alive_s=0)).release()
        (await pool.acquire("b", keep_alive_s=FOREVER)).release()
        await asyncio.sleep(0.05)
        return pool

    pool = run(scenario())
    assert [model.name for model in pool.loaded()] == ["b"] and pool.models["b"].expires_at is None


def test_a_model_in_use_is_not_unloaded_when_its_keep_alive_passes():
    loader = _Loader({"a": MIB})

    async def scenario():
        pool = pool_of(loader, keep_alive_s=0.05)
        first = await pool.acquire("a")
        (await pool.acquire("a")).release()  # the second request ends, the first still runs
        await asyncio.sleep(0.15)
        loaded = bool(pool.loaded())
        first.release()
        await asyncio.sleep(0.15)
        return loaded, bool(pool.loaded())

    assert run(scenario()) == (True, False)


@pytest.mark.parametrize("given, seconds", [("5m", 300), ("1h30m", 5400), ("90s", 90), ("250ms", 0.25),
                                             (30, 30), ("30", 30), (0, 0), ("0", 0), (-1, math.inf),
                                             ("-1m", math.inf), (None, None)])
def test_keep_alive_reads_ollama_durations(given, seconds):
    assert parse_keep_alive(given) == seconds


@pytest.mark.parametrize("given", ["soon", "5 minutes", "", True, [5], "5x"])
def test_a_keep_alive_that_is_no_duration_is_a_400_naming_it(given):
    with pytest.raises(ApiError) as refused:
        parse_keep_alive(given)
    assert refused.value.status == 400 and refused.value.param == "keep_alive"


def test_requests_past_the_waiting_bound_of_a_loading_model_are_a_503():
    loader = _Loader({"a": MIB}, delay_s=0.2)

    async def four_at_once():
        pool = pool_of(loader, max_waiting=3)
        return await asyncio.gather(*(pool.acquire("a") for _ in range(4)), return_exceptions=True)

    results = run(four_at_once())
    refused = [result for result in results if isinstance(result, ApiError)]
    assert len(refused) == 1 and refused[0].status == 503 and loader.loads == ["a"]
