"""The models a server answers for, by name: each loaded on its first request, kept while requests
use it and for its keep_alive after the last, and unloaded sooner when another model needs its
memory (the least recently used idle one first), as ollama does.

A load runs on a worker thread, so the event loop keeps answering meanwhile (/health, other
models); the requests for a model that is loading wait for that one load. What is loaded is
accounted against the server's budgets (RAM, GPU memory) by each engine's plan (`used_bytes`:
weights, ring, KV cache); a model loads within what the others leave, and one that does not fit
beside the busy ones is a 503 naming what it needs.
"""

import asyncio
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from tierflow.errors import TierflowError
from tierflow.runtime.api.engine import Engine
from tierflow.server.openai_schema import ApiError
from tierflow.units import format_size

DEFAULT_KEEP_ALIVE_S = 300.0  # ollama's five minutes
FOREVER = math.inf
State = TypeVar("State")


class ModelLoader(Protocol):
    def needs(self, source: str) -> dict[str, int]:
        """The bytes per tier a load of source would hold under the server's whole budgets
        (blocking)."""

    def load(self, source: str, budgets: dict[str, int]) -> Engine:
        """The engine of source, within budgets per tier (a tier not named: the load's default;
        blocking)."""


@dataclass
class ServedModel(Generic[State]):
    """One name the server answers for, and its engine while loaded."""

    name: str
    source: str  # the path or store name serve was given
    engine: Engine | None = None
    state: State | None = None  # what the server keeps beside the engine (its admission)
    loading: "asyncio.Future[None] | None" = None
    users: int = 0  # requests holding it now
    last_used: float = 0.0  # time.monotonic() of the last request's end
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S  # after the last request; FOREVER: until evicted
    expires_at: float | None = None  # time.time() it unloads at, when idle and not FOREVER
    _timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    def held(self, tier: str) -> int:
        """The bytes its engine holds on a tier ("cpu": RAM, "gpu")."""
        return 0 if self.engine is None else self.engine.plan.used_bytes[tier]


@dataclass
class Lease(Generic[State]):
    """A request's hold on a loaded model: it is not unloaded until every lease is released."""

    model: ServedModel[State]
    _pool: "ModelPool[State]"
    load_seconds: float = 0.0  # how long the request waited for the model to load
    _released: bool = False

    @property
    def engine(self) -> Engine:
        return self.model.engine

    @property
    def state(self) -> State:
        return self.model.state

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._pool._release(self.model)


class ModelPool(Generic[State]):
    """Names to models; acquire() loads on demand. Used from the event loop only."""

    def __init__(self, sources: dict[str, str], loader: ModelLoader | None, attach: Callable[[Engine], State],
                 *, keep_alive_s: float = DEFAULT_KEEP_ALIVE_S, max_loaded: int = 3,
                 budgets: dict[str, int] | None = None, max_waiting: int | None = None):
        if not sources:
            raise ValueError("a pool serves at least one model")
        self.models = {name: ServedModel(name, source, keep_alive_s=keep_alive_s)
                       for name, source in sources.items()}
        self.loader, self.attach = loader, attach
        self.keep_alive_s, self.max_loaded = keep_alive_s, max_loaded
        self.max_waiting = max_waiting  # requests a model that is loading holds; beyond: 503
        self.budgets = dict(budgets or {})  # per tier, for all the models together; absent: none
        self._room = asyncio.Lock()  # one load decides at a time what to unload

    @classmethod
    def of(cls, engine: Engine, attach: Callable[[Engine], State],
           name: str | None = None) -> "ModelPool[State]":
        """A pool of one loaded engine, kept for the server's life."""
        name = name or engine.path.stem
        pool = cls({name: str(engine.path)}, None, attach, keep_alive_s=FOREVER)
        pool.models[name].engine, pool.models[name].state = engine, attach(engine)
        return pool

    def start(self) -> None:
        """Starts the keep_alive clocks of the models loaded before serving began."""
        for model in self.loaded():
            if model.users == 0 and model.keep_alive_s != FOREVER and model._timer is None:
                model.users += 1
                self._release(model)

    def preload(self, name: str) -> ServedModel[State]:
        """Loads the model now, before serving starts (blocking), under the whole budget."""
        model = self.models[name]
        model.engine = self.loader.load(model.source, self.budgets)
        model.state, model.last_used = self.attach(model.engine), time.monotonic()
        return model

    @property
    def names(self) -> list[str]:
        return list(self.models)

    def loaded(self) -> list[ServedModel[State]]:
        return [model for model in self.models.values() if model.engine is not None]

    def find(self, requested: str | None) -> ServedModel[State]:
        """The model a request names: with one model served, any name (clients send their own
        defaults, as llama-server takes them); with several, an unknown name is a 404, and no name
        the first model (the server's default)."""
        if len(self.models) == 1 or not requested:
            return next(iter(self.models.values()))
        if requested in self.models:
            return self.models[requested]
        if requested.endswith(":latest") and requested[:-7] in self.models:
            return self.models[requested[:-7]]  # ollama's clients add the tag
        served = ", ".join(self.models)
        raise ApiError(404, f"the model {requested!r} is not served here; this server has {served}",
                       param="model", code="model_not_found")

    async def acquire(self, requested: str | None, keep_alive_s: float | None = None) -> Lease[State]:
        """The model, loaded if it was not (waiting for a load in progress), held until the lease
        is released; it then stays loaded for keep_alive_s (None: the server's keep_alive), as
        ollama keeps a model for its last request's keep_alive."""
        model = self.find(requested)
        if model.engine is None and self.max_waiting is not None and model.users >= self.max_waiting:
            raise ApiError(503, f"the server is busy: {model.users} requests wait for {model.name!r} to "
                           "load; retry later", type="server_error", code="server_busy")
        model.users += 1
        try:
            model.keep_alive_s = self.keep_alive_s if keep_alive_s is None else keep_alive_s
            self._stop_timer(model)
            waited, waited_for_load = time.perf_counter(), model.engine is None
            while model.engine is None:
                if model.loading is None:
                    model.loading = asyncio.ensure_future(self._load(model))
                    model.loading.add_done_callback(lambda _, model=model: setattr(model, "loading", None))
                await asyncio.shield(model.loading)
        except BaseException:
            self._release(model)
            raise
        return Lease(model, self, time.perf_counter() - waited if waited_for_load else 0.0)

    async def unload(self, model: ServedModel[State]) -> None:
        """Closes the model's engine now (its requests must have ended); an engine the pool was
        given (`of`) is its owner's, and stays."""
        self._stop_timer(model)
        if self.loader is None:
            return
        engine, model.engine, model.state, model.expires_at = model.engine, None, None, None
        if engine is not None:
            await asyncio.to_thread(engine.close)

    async def close_loaded(self) -> None:
        """Unloads what this pool loaded (an engine it was given is its owner's to close)."""
        for model in self.models.values():
            if model.loading is not None:
                await asyncio.wait([model.loading])
            await self.unload(model)

    async def _load(self, model: ServedModel[State]) -> None:
        async with self._room:
            needs = await self._needs(model)
            room = await self._make_room(model, needs)
            try:
                engine = await asyncio.to_thread(self.loader.load, model.source, room)
            except TierflowError as error:
                raise ApiError(500, f"the model {model.name!r} failed to load: {error}", type="server_error",
                               code="model_load_failed") from None
            model.engine, model.state, model.last_used = engine, self.attach(engine), time.monotonic()

    async def _needs(self, model: ServedModel[State]) -> dict[str, int]:
        if not self.budgets:
            return {}
        try:
            return await asyncio.to_thread(self.loader.needs, model.source)
        except TierflowError as error:
            raise ApiError(500, f"the model {model.name!r} cannot be planned: {error}", type="server_error",
                           code="model_load_failed") from None

    async def _make_room(self, model: ServedModel[State], needs: dict[str, int]) -> dict[str, int]:
        """Unloads idle models, least recently used first, until the model fits beside the rest;
        returns the budgets left for it, per tier the server has one for."""
        while True:
            others = [other for other in self.loaded() if other is not model]
            held = {tier: sum(other.held(tier) for other in others) for tier in self.budgets}
            short = [tier for tier, budget in self.budgets.items()
                     if held[tier] + needs.get(tier, 0) > budget]
            if not short and len(others) < self.max_loaded:
                return {tier: budget - held[tier] for tier, budget in self.budgets.items()}
            idle = [other for other in others if other.users == 0]
            if not idle:
                raise ApiError(503, f"the model {model.name!r} cannot be loaded now: "
                               f"{self._why(others, needs, held, short)}; retry when they are idle",
                               type="server_error", code="model_unavailable")
            await self.unload(min(idle, key=lambda other: other.last_used))

    def _why(self, others: list[ServedModel[State]], needs: dict[str, int], held: dict[str, int],
             short: list[str]) -> str:
        if not short:
            names = ", ".join(other.name for other in others)
            return f"{len(others)} models are loaded and busy (--max-models): {names}"
        tier = short[0]
        name = {"cpu": "RAM", "gpu": "GPU memory"}[tier]
        busy = ", ".join(f"{other.name} ({format_size(other.held(tier))})" for other in others)
        return (f"it needs {format_size(needs[tier])} of {name} and the budget of "
                f"{format_size(self.budgets[tier])} holds {format_size(held[tier])} of busy models: {busy}")

    def _release(self, model: ServedModel[State]) -> None:
        model.users -= 1
        model.last_used = time.monotonic()
        if model.users or model.engine is None or model.keep_alive_s == FOREVER:
            return
        model.expires_at = time.time() + model.keep_alive_s
        self._timer_after(model, model.keep_alive_s)

    def _timer_after(self, model: ServedModel[State], seconds: float) -> None:
        loop = asyncio.get_running_loop()
        model._timer = loop.call_later(seconds, lambda: asyncio.ensure_future(self._expire(model)))

    async def _expire(self, model: ServedModel[State]) -> None:
        model._timer = None
        if model.users == 0 and model.engine is not None:
            await self.unload(model)

    def _stop_timer(self, model: ServedModel[State]) -> None:
        if model._timer is not None:
            model._timer.cancel()
            model._timer = None
        model.expires_at = None


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|m|s|us|µs|ns)")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_keep_alive(value: object, param: str = "keep_alive") -> float | None:
    """ollama's keep_alive in seconds: a number of seconds or a Go duration ("5m", "1h30m", "-1");
    negative keeps the model loaded (FOREVER), 0 unloads it after the answer; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ApiError(400, f"{param}: a duration (\"5m\") or seconds, got {value!r}", param=param)
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _duration_seconds(value.strip(), param)
    else:
        raise ApiError(400, f"{param}: a duration (\"5m\") or seconds, got {value!r}", param=param)
    if math.isnan(seconds):
        raise ApiError(400, f"{param}: not a duration: {value!r}", param=param)
    return FOREVER if seconds < 0 else seconds


def _duration_seconds(text: str, param: str) -> float:
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    try:
        return sign * float(body)  # bare seconds, as ollama also takes
    except ValueError:
        pass
    parts = _DURATION_PART.findall(body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        raise ApiError(400, f"{param}: not a duration: {text!r} (e.g. \"30s\", \"5m\", \"1h\", \"-1\")",
                       param=param)
    return sign * sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
