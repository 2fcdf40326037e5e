"""The local server: OpenAI's API (`/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`,
`/v1/models`) here; OpenAI's Responses, Anthropic's Messages, ollama's API and llama-server's extras
in server/apis/; `/health`, `/metrics` and the chat page at `/`; for every model it serves, each by
name (server/model_pool.py).

Safe by default, for a server on a desktop: it binds loopback, refuses a foreign Host header there
(DNS rebinding), refuses a foreign Origin (a web page's request) unless it is listed for CORS,
takes only JSON bodies, checks an optional API key, and bounds body size, prompt characters,
max_tokens and the queue.

The event loop never waits on request work, so it keeps answering (health checks, 503s) whatever
is asked of it: a prompt is rendered and tokenized on a worker thread (llama.cpp splits special
tokens in quadratic time), and only once the character limit and the queue have admitted it;
generations run on the engine's compute thread, and a client that goes away cancels its own.

A conversation longer than the context is not refused: its oldest turns are dropped as
`tierflow chat` drops them (runtime/generation/context_shift.py), which the response's `X-Context-Shift`
header and the log say; only one whose kept messages do not fit gets the 400.
"""

import asyncio
import gc
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from tierflow.errors import InvalidArgumentError
from tierflow.runtime.api.engine import Engine
from tierflow.runtime.text.chat_template import start_render_workers
from tierflow.server.answers import EventStream, events
from tierflow.server.apis.anthropic_routes import add_anthropic_routes
from tierflow.server.apis.llama_server_routes import add_llama_server_routes
from tierflow.server.apis.ollama_routes import add_ollama_routes
from tierflow.server.apis.responses_routes import add_responses_routes
from tierflow.server.error_shapes import error_body
from tierflow.server.generations import (
    Generations,
    Prompt,
    Server,
    Started,
    chat_prompt,
    on_worker_thread,
    text_prompt,
)
from tierflow.server.guards import ApiKeyGuard, HostGuard, JsonBodyGuard, OriginGuard
from tierflow.server.header_timeout import header_timeout_protocol
from tierflow.server.metrics import (
    LOG_LEVELS,
    PROMETHEUS_TEXT,
    RequestRecorder,
    ServerMetrics,
    log_config,
    pool_gauges,
)
from tierflow.server.model_pool import ModelPool
from tierflow.server.openai_embeddings import EmbeddingRequest, embedding_response
from tierflow.server.openai_schema import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Reply,
    model_card,
    parse_request,
)

CHAT_PAGE = Path(__file__).with_name("chat.html")
PUBLIC_PATHS = frozenset({"/health", "/"})  # no API key: the page holds no data and asks for the key
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, every route but PUBLIC_PATHS needs `Bearer KEY`
    # Origins whose pages may call the API from a browser (CORS); any other Origin gets 403, but
    # the server's own page and clients that send no Origin (curl, SDKs) are always let in.
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 1_000_000
    # Characters of prompt text (a completion's prompt, or all chat messages with their framing) a
    # request may send, checked before tokenizing; None: CHARS_PER_POSITION per context position.
    max_prompt_chars: int | None = None
    # A request asking for more tokens gets 400; None: no limit, and a request that sets none (or
    # asks past the context) generates to the context's end.
    max_tokens_limit: int | None = None
    max_queued: int = 8  # requests waiting behind the running ones (engine.parallel); beyond: 503
    max_embedding_inputs: int = 256  # inputs one /v1/embeddings request may send
    # A chat longer than the context drops its oldest turns (runtime/generation/context_shift.py); off: 400,
    # as OpenAI's API answers, for clients that trim their conversations themselves.
    context_shift: bool = True
    log_level: str = "info"  # the request lines are info; debug adds /health's and /metrics'
    # Seconds a connection may take to send a request's headers, from its first byte (or from the
    # connection, for its first request); then it is closed (server/header_timeout.py).
    header_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.port <= 65535, f"port must be in 0..65535, got {self.port}"),
            (self.api_key is None or self.api_key != "", "api_key must not be empty"),
            (self.max_body_bytes > 0, "max_body_bytes must be > 0"),
            (self.max_prompt_chars is None or self.max_prompt_chars > 0, "max_prompt_chars must be > 0"),
            (self.max_tokens_limit is None or self.max_tokens_limit > 0, "max_tokens_limit must be > 0"),
            (self.max_queued >= 0, "max_queued must be >= 0"),
            (self.max_embedding_inputs > 0, "max_embedding_inputs must be > 0"),
            (self.header_timeout_s > 0, "header_timeout_s must be > 0"),
            (self.log_level in LOG_LEVELS, f"log_level must be one of {', '.join(LOG_LEVELS)}, "
                                           f"got {self.log_level!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidArgumentError(message)

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"


def serve(models: Engine | ModelPool[Generations], settings: ServerSettings,
          sockets: list[socket.socket]) -> None:
    """Serves on sockets (`listening`'s) until interrupted (blocking). Each request is one line of
    the log (server/metrics.py), so uvicorn's access log is off."""
    config = uvicorn_config(create_app(models, settings), settings, log_config=log_config(settings.log_level),
                            log_level=settings.log_level, access_log=False)
    uvicorn.Server(config).run(sockets=sockets)


def uvicorn_config(app: FastAPI, settings: ServerSettings, **options) -> uvicorn.Config:
    """uvicorn's configuration of the app: the settings' address, and their time limit on a request's
    headers (server/header_timeout.py); options are uvicorn's others."""
    return uvicorn.Config(app, host=settings.host, port=settings.port,
                          http=header_timeout_protocol(settings.header_timeout_s), **options)


def generations_of(settings: ServerSettings):
    """What the server keeps beside each engine it loads: its queue."""
    return lambda engine: Generations(engine, settings.max_queued, settings.max_prompt_chars)


def create_app(models: Engine | ModelPool[Generations], settings: ServerSettings) -> FastAPI:
    """The app serving one loaded engine, or a pool of models by name."""
    pool = models if isinstance(models, ModelPool) else ModelPool.of(models, generations_of(settings))
    server, metrics = Server(pool), ServerMetrics()
    read_body = partial(_read_body, limit=settings.max_body_bytes)
    app = FastAPI(title="tierflow", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=partial(_lifespan, pool=pool))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(pool_gauges(pool)), media_type=PROMETHEUS_TEXT)

    @app.get("/")
    async def chat_page() -> Response:
        if not CHAT_PAGE.is_file():
            raise ApiError(404, "the chat page is not installed", type="not_found_error")
        return FileResponse(CHAT_PAGE, media_type="text/html", headers={"Cache-Control": "no-cache"})

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list",
                "data": [_model_card(model.name, model.source) for model in pool.models.values()]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> dict:
        if model_id not in pool.models:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server has "
                           f"{', '.join(pool.names)}", param="model", code="model_not_found")
        return _model_card(model_id, pool.models[model_id].source)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse_request(ChatRequest, await read_body(request))
        tools, variables = body.tool_request(), body.template_variables()
        kwargs = body.generation_kwargs(settings.max_tokens_limit)

        def prompt(engine: Engine):
            return partial(chat_prompt, engine, body.template_messages, settings.context_shift, tools,
                           variables)

        started = await server.begin(request, body.model, kwargs, "messages", prompt, body.prompt_chars(),
                                     tools=tools)
        return await _openai_answer(request, body, Reply.new(True, started.model), "messages", started, tools)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse_request(CompletionRequest, await read_body(request))
        text = body.engine_prompt()
        kwargs = body.generation_kwargs(settings.max_tokens_limit)

        def prompt(engine: Engine):
            return partial(text_prompt, engine, text) if isinstance(text, str) else Prompt(text)

        chars = len(text) if isinstance(text, str) else 0
        started = await server.begin(request, body.model, kwargs, "prompt", prompt, chars)
        return await _openai_answer(request, body, Reply.new(False, started.model), "prompt", started)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body = await parse_request(EmbeddingRequest, await read_body(request))
        inputs = partial(_embedding_inputs, body, settings.max_embedding_inputs)
        vectors, num_tokens, name = await server.embed(body.model, inputs)
        rendered = await on_worker_thread(partial(embedding_response, vectors, num_tokens,
                                                  body.encoding_format, name))
        return Response(rendered, media_type="application/json")

    add_ollama_routes(app, server, settings.max_tokens_limit, settings.context_shift,
                      settings.max_embedding_inputs, read_body)
    add_anthropic_routes(app, server, settings.max_tokens_limit, settings.context_shift, read_body)
    add_responses_routes(app, server, settings.max_tokens_limit, settings.context_shift, read_body)
    add_llama_server_routes(app, server, read_body)
    _add_error_handlers(app)
    # The last added is the outermost: Host, Origin, CORS (preflights carry no key), key, JSON.
    app.add_middleware(JsonBodyGuard)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyGuard, api_key=settings.api_key, public_paths=PUBLIC_PATHS)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(OriginGuard, allowed=settings.cors_origins)
    if settings.is_loopback:
        app.add_middleware(HostGuard)
    app.add_middleware(RequestRecorder, metrics=metrics, routes=app.router.routes)  # sees every request
    return app


def _embedding_inputs(body: EmbeddingRequest, max_inputs: int, engine: Engine) -> list:
    return body.inputs(max_inputs, engine.config.hidden_size)


async def _openai_answer(request: Request, body: ChatRequest | CompletionRequest, reply: Reply, param: str,
                         started: Started, tools=None) -> Response:
    """OpenAI's answer of a started generation: server-sent events, or one body."""
    trace = started.traced(request)
    if body.stream and started.astream is not None:  # the stream frees the slot when it ends
        answer = started.parts(trace, param, tools, reasoning=reply.chat)
        return EventStream(events(answer, reply, body.include_usage), started.astream, started.release,
                           started.headers)
    answered = await started.whole(request, trace, param, tools, reasoning=reply.chat)
    if answered is None:
        return Response(status_code=499)  # nobody is listening; nginx's code for it, for the log
    result, thought = answered
    return JSONResponse(reply.response(result, thought), headers=started.headers)


@asynccontextmanager
async def _lifespan(app: FastAPI, pool: ModelPool[Generations]) -> AsyncIterator[None]:
    # The chat template's worker processes start now: a burst of first chat requests would
    # otherwise start a burst of processes, competing with the event loop for the CPU.
    await asyncio.to_thread(start_render_workers)
    # What is alive when serving starts (the engine, torch, the app) lives until it ends: frozen,
    # the garbage collector's full passes skip it, which shortens each pass, a pause of the event
    # loop, from about 90 ms to a few.
    gc.freeze()
    pool.start()
    try:
        yield
    finally:
        await pool.close_loaded()


def _model_card(name: str, source: str) -> dict:
    path = Path(source)
    return model_card(name, int(path.stat().st_mtime) if path.is_file() else 0)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to pass limit: by its declared length, or
    by the bytes read (a chunked body declares none)."""
    too_large = ApiError(413, f"the request body is larger than {limit} bytes", code="body_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def error_response(request: Request, error: ApiError, headers: dict | None = None) -> JSONResponse:
    """The error in the shape of the API the request came by (server/error_shapes.py)."""
    return JSONResponse(error_body(request.url.path, error), status_code=error.status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error is the API's own error body; nothing leaks a traceback."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return error_response(request, error)

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, error: ClientDisconnect) -> Response:
        # It hung up before its request was read whole: a disconnect, not a failure. Nobody reads
        # this answer; its status is nginx's for a client that left, for the log and /metrics.
        return Response(status_code=499)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        kinds = {404: "not_found_error", 405: "invalid_request_error"}
        message = f"{error.detail}: {request.method} {request.url.path}"
        kind = kinds.get(error.status_code, "invalid_request_error")
        return error_response(request, ApiError(error.status_code, message, type=kind), error.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        return error_response(request, ApiError(500, "internal server error", type="server_error"))
