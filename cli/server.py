"""The local OpenAI-compatible server: `/v1/chat/completions`, `/v1/completions`, `/v1/models`,
`/health`, and the chat page at `/`.

Safe by default, for a server on a desktop: it binds loopback, refuses a foreign Host header there
(DNS rebinding), checks an optional API key, sends no CORS headers unless origins are listed, and
bounds body size, max_tokens and the queue. Generations run through the engine's async API, so
the event loop keeps answering (health checks, 503s) while the model computes, and a client that
goes away cancels its generation.
"""

import asyncio
import ipaddress
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from tierflow.cli.guards import ApiKeyGuard, HostGuard
from tierflow.cli.openai_schema import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Reply,
    engine_error,
    parse_request,
)
from tierflow.errors import InvalidArgumentError, TierflowError
from tierflow.runtime.engine import Engine
from tierflow.runtime.streams import AsyncStream, GenerationResult

CHAT_PAGE = Path(__file__).with_name("chat.html")
PUBLIC_PATHS = frozenset({"/health", "/"})  # no API key: the page holds no data and asks for the key


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, every route but PUBLIC_PATHS needs `Bearer KEY`
    cors_origins: tuple[str, ...] = ()  # origins allowed to call from a browser; none: no CORS
    max_body_bytes: int = 1_000_000
    max_tokens_limit: int = 4096  # a request asking for more gets 400; also the default
    max_queued: int = 8  # requests waiting behind the running one; beyond: 503

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.port <= 65535, f"port must be in 0..65535, got {self.port}"),
            (self.api_key is None or self.api_key != "", "api_key must not be empty"),
            (self.max_body_bytes > 0, "max_body_bytes must be > 0"),
            (self.max_tokens_limit > 0, "max_tokens_limit must be > 0"),
            (self.max_queued >= 0, "max_queued must be >= 0"),
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


def serve(engine: Engine, settings: ServerSettings) -> None:
    """Serves until interrupted (blocking)."""
    uvicorn.run(create_app(engine, settings), host=settings.host, port=settings.port,
                log_level="info")


def create_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="tierflow", docs_url=None, redoc_url=None, openapi_url=None)
    model = engine.path.stem
    slots = _Slots(1 + settings.max_queued)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/")
    async def chat_page() -> Response:
        if not CHAT_PAGE.is_file():
            raise ApiError(404, "the chat page is not installed", type="not_found_error")
        return FileResponse(CHAT_PAGE, media_type="text/html", headers={"Cache-Control": "no-cache"})

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(engine)]}

    @app.get("/v1/models/{model_id}")
    async def model_card(model_id: str) -> dict:
        if model_id != model:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server has {model!r}",
                           param="model", code="model_not_found")
        return _model_card(engine)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_request(ChatRequest, await _read_body(request, settings.max_body_bytes))
        kwargs = body.generation_kwargs(settings.max_tokens_limit)
        try:
            astream = engine.achat_stream(body.template_messages(), **kwargs)
        except TierflowError as error:
            raise engine_error(error, "messages") from None
        return await _answer(request, astream, Reply.new(True, model), body, slots.acquire())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_request(CompletionRequest, await _read_body(request, settings.max_body_bytes))
        kwargs = body.generation_kwargs(settings.max_tokens_limit)
        try:
            astream = engine.astream(body.engine_prompt(), **kwargs)
        except TierflowError as error:
            raise engine_error(error, "prompt") from None
        return await _answer(request, astream, Reply.new(False, model), body, slots.acquire())

    _add_error_handlers(app)
    # The last added is the outermost: Host first, then CORS (preflights carry no key), then the key.
    if settings.api_key is not None:
        app.add_middleware(ApiKeyGuard, api_key=settings.api_key, public_paths=PUBLIC_PATHS)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])
    if settings.is_loopback:
        app.add_middleware(HostGuard)
    return app


def _model_card(engine: Engine) -> dict:
    return {"id": engine.path.stem, "object": "model", "created": int(engine.path.stat().st_mtime),
            "owned_by": "tierflow"}


class _Slots:
    """Generation requests in flight: one runs, the rest wait on the engine's lock. Touched only
    from the event loop, so a plain counter suffices."""

    def __init__(self, capacity: int):
        self.capacity, self.used = capacity, 0

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


async def _answer(request: Request, astream: AsyncStream, reply: Reply,
                  body: ChatRequest | CompletionRequest, release: Callable[[], None]) -> Response:
    if body.stream:
        return _EventStream(_events(astream, reply, body.include_usage), astream, release)
    try:
        result = await _unless_disconnected(request, _collect(astream))
    finally:
        release()
    if result is None:
        return Response(status_code=499)  # nobody is listening; nginx's code for it, for the log
    if result.finish_reason == "cancelled":
        raise ApiError(503, "the generation was cancelled (the server is stopping)", type="server_error")
    return JSONResponse(reply.response(result))


async def _collect(astream: AsyncStream) -> GenerationResult:
    async for _ in astream:
        pass
    return astream.result


async def _unless_disconnected(request: Request, work: Awaitable) -> object | None:
    """work's result, or None if the client disconnects first (work is then cancelled, which
    cancels its generation)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return None if task.cancelled() else task.result()


async def _disconnect(request: Request) -> None:
    # The body has been read, so the next message the server sends is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(astream: AsyncStream, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: the role (chat), the text pieces, the finish, the usage, [DONE]."""
    if reply.chat:
        yield _sse(reply.role_chunk())
    try:
        async for piece in astream:
            yield _sse(reply.text_chunk(piece))
    except TierflowError as error:
        yield _sse(ApiError(500, str(error), type="server_error").body())
        return
    result = astream.result
    if result.finish_reason == "cancelled":
        yield _sse(ApiError(503, "the generation was cancelled", type="server_error").body())
        return
    yield _sse(reply.final_chunk(result))
    if include_usage:
        yield _sse(reply.usage_chunk(result))
    yield "data: [DONE]\n\n"


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
    """An SSE response that, however it ends (finished, client gone, never started), cancels its
    generation and frees its queue slot. Starlette cancels the body's task on disconnect."""

    def __init__(self, events: AsyncIterator[str], astream: AsyncStream, release: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._astream, self._release = astream, release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._astream.cancel()
            self._release()


def _add_error_handlers(app: FastAPI) -> None:
    """Every error is OpenAI's body; nothing leaks a traceback."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        kinds = {404: "not_found_error", 405: "invalid_request_error"}
        message = f"{error.detail}: {request.method} {request.url.path}"
        return JSONResponse(ApiError(error.status_code, message, type=kinds.get(error.status_code,
                            "invalid_request_error")).body(), status_code=error.status_code,
                            headers=error.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse(ApiError(500, "internal server error", type="server_error").body(),
                            status_code=500)
