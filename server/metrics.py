"""What `tierflow serve` tells its operator: Prometheus metrics at /metrics and one log line per request.

The server feeds one point, a request's end: `RequestRecorder`, the outermost middleware, times
every request, and a generation's handler adds what it generated to the request's `RequestTrace`;
the finished `RequestRecord` goes to `ServerMetrics.record` and to the request log. What holds at
the moment (requests running and queued, KV cache and weight bytes, the expert cache's hit rate)
is read when /metrics is asked, from attributes: never a wait on the engine, which may be busy
generating.
"""

import json
import logging
import time
from collections import Counter, deque
from collections.abc import Iterator
from copy import deepcopy
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.config import LOGGING_CONFIG

from tierflow.runtime.api.streams import AsyncStream
from tierflow.runtime.generation.stats import GenerationStats

if TYPE_CHECKING:
    from tierflow.runtime.api.engine import Engine
    from tierflow.server.generations import Generations
    from tierflow.server.model_pool import ModelPool

LOG_LEVELS = ("debug", "info", "warning", "error")
QUIET_PATHS = frozenset({"/health", "/metrics", "/"})  # polled by machines: their lines only at debug
RATE_WINDOW = 16  # the tok/s gauges are over the last this many generations
TRACE_KEY = "tierflow_trace"  # the request's RequestTrace, in its scope's state (request.state)
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
request_log = logging.getLogger("tierflow.requests")


class RequestTrace:
    """What a generation request's handler adds to its record as it runs."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.stream: AsyncStream | None = None  # the generation, once started
        self.context_shift: str | None = None  # what was left out of the conversation to fit
        self.first_piece_s: float | None = None  # seconds from arrival to the first text

    def first_piece(self) -> None:
        if self.first_piece_s is None:
            self.first_piece_s = time.perf_counter() - self.started


@dataclass(frozen=True)
class RequestRecord:
    """One answered request. `route` is its route's path template (a bounded label), `path` the
    path asked for."""

    method: str
    route: str
    path: str
    status: int
    total_s: float
    stats: GenerationStats | None = None  # a generation's; None for other routes
    finish_reason: str | None = None  # None: the generation had not ended (its client left)
    first_piece_s: float | None = None
    context_shift: str | None = None

    def log_line(self) -> str:
        """key=value fields after the request line; the path escaped, so it cannot forge lines."""
        fields = [f"{self.method} {json.dumps(self.path, ensure_ascii=False)[1:-1]} {self.status}",
                  f"total_ms={_ms(self.total_s)}"]
        if self.stats is not None:
            fields += self._generation_fields(self.stats)
        if self.context_shift is not None:
            fields.append(f"context_shift={json.dumps(self.context_shift)}")
        return " ".join(fields)

    def _generation_fields(self, stats: GenerationStats) -> list[str]:
        return [f"prompt_tokens={stats.prompt_tokens}", f"cached_tokens={stats.cached_prompt_tokens}",
                f"generated_tokens={stats.generated_tokens}", f"ttft_ms={_ms(self.first_piece_s)}",
                f"prefill_tok_s={stats.prefill_tokens_per_s:.1f}",
                f"decode_tok_s={stats.decode_tokens_per_s:.1f}", f"finish={self.finish_reason or '-'}"]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


@dataclass(frozen=True)
class ServerGauges:
    """What holds now, read when /metrics is asked."""

    requests_running: int
    requests_queued: int
    kv_cache_bytes: int
    weight_bytes: dict[str, int]  # per tier: gpu, cpu, disk (read every pass)
    expert_hits: int | None = None  # a model whose experts stream: its expert cache's demand uses
    expert_misses: int | None = None
    batched_passes: tuple[int, int] = (0, 0)  # (passes, sequences they served): Engine.batched_passes


def engine_gauges(engine: "Engine", requests_running: int, requests_queued: int) -> ServerGauges:
    """The gauges of an Engine, from what it holds; its GPU tier's bytes less the KV caches there."""
    held = engine.weights.bytes_by_tier()
    weights = held | {"gpu": max(0, held["gpu"] - engine.plan.kv_gpu_bytes)}
    hits = misses = None
    if engine.expert_stats is not None:
        layers = list(engine.expert_stats.layers.values())  # one copy: the compute thread adds layers
        hits, misses = sum(layer.hits for layer in layers), sum(layer.misses for layer in layers)
    return ServerGauges(requests_running, requests_queued, engine.kv_cache_bytes, weights, hits, misses,
                        engine.batched_passes)


def pool_gauges(pool: "ModelPool[Generations]") -> ServerGauges:
    """The gauges of every loaded model, added up."""
    total = ServerGauges(0, 0, 0, {"gpu": 0, "cpu": 0, "disk": 0})
    for model in pool.loaded():
        admission = model.state.admission
        gauges = engine_gauges(model.engine, admission.num_running, admission.num_queued)
        total = ServerGauges(
            total.requests_running + gauges.requests_running, total.requests_queued + gauges.requests_queued,
            total.kv_cache_bytes + gauges.kv_cache_bytes,
            {tier: total.weight_bytes.get(tier, 0) + n for tier, n in gauges.weight_bytes.items()},
            _add(total.expert_hits, gauges.expert_hits), _add(total.expert_misses, gauges.expert_misses),
            tuple(a + b for a, b in zip(total.batched_passes, gauges.batched_passes)))
    return total


def _add(a: int | None, b: int | None) -> int | None:
    return a if b is None else b if a is None else a + b


class ServerMetrics:
    """Counters since the server started, and the recent generations' speeds."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str, int]] = Counter()  # (method, route, status)
        self.tokens: Counter[str] = Counter()  # prompt, cached_prompt, generated
        # (tokens, seconds) of the last generations, for the speed gauges
        self.prefills: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW)
        self.decodes: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW)

    def record(self, record: RequestRecord) -> None:
        self.requests[record.method, record.route, record.status] += 1
        stats = record.stats
        if stats is None:
            return
        self.tokens.update(prompt=stats.prompt_tokens, cached_prompt=stats.cached_prompt_tokens,
                           generated=stats.generated_tokens)
        if stats.prefill_seconds:
            self.prefills.append((stats.prompt_tokens - stats.cached_prompt_tokens, stats.prefill_seconds))
        if stats.decode_seconds:
            self.decodes.append((stats.decode_steps + stats.accepted_tokens, stats.decode_seconds))

    def exposition(self, gauges: ServerGauges) -> str:
        """Prometheus's text format (version 0.0.4)."""
        return "".join(_families(self, gauges))


def _families(metrics: ServerMetrics, gauges: ServerGauges) -> Iterator[str]:
    yield _family("requests", "counter", "HTTP requests answered, by method, route and status",
                  [({"method": method, "route": route, "status": str(status)}, count)
                   for (method, route, status), count in sorted(metrics.requests.items())])
    for kind, what in (("prompt", "prompt tokens of generations"),
                       ("cached_prompt", "prompt tokens reused from the KV cache, not computed"),
                       ("generated", "tokens generated")):
        yield _family(f"{kind}_tokens", "counter", what, [({}, metrics.tokens[kind])])
    yield _family("prefill_tokens_per_second", "gauge", f"prompt tokens computed per second over the last "
                  f"{RATE_WINDOW} generations", [({}, _rate(metrics.prefills))])
    yield _family("decode_tokens_per_second", "gauge", f"tokens decoded per second over the last "
                  f"{RATE_WINDOW} generations", [({}, _rate(metrics.decodes))])
    yield _family("requests_running", "gauge", "generation requests being answered",
                  [({}, gauges.requests_running)])
    yield _family("requests_queued", "gauge", "generation requests admitted, waiting for the engine",
                  [({}, gauges.requests_queued)])
    yield _family("kv_cache_bytes", "gauge", "bytes the KV cache holds", [({}, gauges.kv_cache_bytes)])
    yield _family("weight_bytes", "gauge", "weight bytes per tier (disk: read every pass)",
                  [({"tier": tier}, held) for tier, held in sorted(gauges.weight_bytes.items())])
    passes, sequences = gauges.batched_passes
    yield _family("batched_passes", "counter", "passes over the weights run for the parallel sequences",
                  [({}, passes)])
    yield _family("batched_sequences", "counter", "sequences those passes served (per pass: how many "
                  "requests shared a sweep of the weights)", [({}, sequences)])
    if gauges.expert_hits is not None:
        yield from _expert_families(gauges.expert_hits, gauges.expert_misses)


def _expert_families(hits: int, misses: int) -> Iterator[str]:
    yield _family("expert_cache_hits", "counter", "expert uses found in the expert cache", [({}, hits)])
    yield _family("expert_cache_misses", "counter", "expert uses fetched on demand", [({}, misses)])
    yield _family("expert_cache_hit_rate", "gauge", "expert cache hits per use since the model loaded",
                  [({}, hits / (hits + misses) if hits + misses else 0.0)])


def _rate(window: deque[tuple[int, float]]) -> float:
    tokens, seconds = sum(tokens for tokens, _ in window), sum(seconds for _, seconds in window)
    return tokens / seconds if seconds else 0.0


def _family(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> str:
    name = f"tierflow_{name}" + ("_total" if kind == "counter" else "")
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        inside = ",".join(f'{key}="{_escaped(label)}"' for key, label in labels.items())
        lines.append(f"{name}{{{inside}}} {value!r}" if inside else f"{name} {value!r}")  # ints exact
    return "\n".join(lines) + "\n"


def _escaped(label: str) -> str:
    return label.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class RequestRecorder:
    """ASGI middleware, outermost: records every HTTP request once its response has ended (a
    stream's too), refused by a guard or not, and logs its line.

    Plain ASGI, as the guards are (server/guards.py), so that a streaming response passes untouched.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: list[BaseRoute]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        trace = RequestTrace()
        scope.setdefault("state", {})[TRACE_KEY] = trace
        status = 500  # what the client gets if the app fails before it answers

        async def sent(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            self._finish(scope, trace, status)

    def _finish(self, scope: Scope, trace: RequestTrace, status: int) -> None:
        result = None if trace.stream is None else trace.stream.result
        record = RequestRecord(
            scope["method"], self._route(scope), scope["path"], status, time.perf_counter() - trace.started,
            None if trace.stream is None else trace.stream.stats,
            None if result is None else result.finish_reason, trace.first_piece_s, trace.context_shift)
        self.metrics.record(record)
        level = logging.DEBUG if scope["path"] in QUIET_PATHS else logging.INFO
        request_log.log(level, "%s", record.log_line())

    def _route(self, scope: Scope) -> str:
        """The path template of the route the request asks for (its method aside), or "unmatched"."""
        for route in self.routes:
            if route.matches(scope)[0] != Match.NONE:
                return route.path
        return "unmatched"


def log_config(level: str) -> dict:
    """uvicorn's logging configuration, with tierflow's loggers on its console handler at `level`."""
    config = deepcopy(LOGGING_CONFIG)
    config["loggers"]["tierflow"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return config
