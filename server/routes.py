"""The local OpenAI-compatible server: `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`,
`/v1/models`, `/health`, and the chat page at `/`.

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
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from tierflow.errors import ContextLengthError, InvalidArgumentError, TierflowError, UnsupportedModelError
from tierflow.runtime.api.engine import Engine
from tierflow.runtime.api.streams import AsyncStream
from tierflow.runtime.generation.context_shift import fit_chat
from tierflow.runtime.sampling.structured import Grammar
from tierflow.runtime.text.chat_template import start_render_workers
from tierflow.runtime.text.tool_calls import ToolCallStream
from tierflow.runtime.text.tool_prompt import ToolRequest
from tierflow.server.admission import Admission
from tierflow.server.answers import EventStream, events, unless_disconnected, whole_answer
from tierflow.server.guards import ApiKeyGuard, HostGuard, JsonBodyGuard, OriginGuard
from tierflow.server.header_timeout import header_timeout_protocol
from tierflow.server.metrics import (
    LOG_LEVELS,
    PROMETHEUS_TEXT,
    TRACE_KEY,
    RequestRecorder,
    RequestTrace,
    ServerMetrics,
    engine_gauges,
    log_config,
)
from tierflow.server.openai_embeddings import EmbeddingInput, EmbeddingRequest, embedding_response, text_chars
from tierflow.server.openai_schema import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Reply,
    engine_error,
    parse_request,
    response_grammar,
)

CHAT_PAGE = Path(__file__).with_name("chat.html")
PUBLIC_PATHS = frozenset({"/health", "/"})  # no API key: the page holds no data and asks for the key
CHARS_PER_POSITION = 16  # the default prompt character limit per context position: 4x typical text
T = TypeVar("T")
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
    max_tokens_limit: int = 4096  # a request asking for more gets 400; also the default
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
            (self.max_tokens_limit > 0, "max_tokens_limit must be > 0"),
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


def serve(engine: Engine, settings: ServerSettings, sockets: list[socket.socket]) -> None:
    """Serves on sockets (`listening`'s) until interrupted (blocking). Each request is one line of
    the log (server/metrics.py), so uvicorn's access log is off."""
    config = uvicorn_config(create_app(engine, settings), settings, log_config=log_config(settings.log_level),
                            log_level=settings.log_level, access_log=False)
    uvicorn.Server(config).run(sockets=sockets)


def uvicorn_config(app: FastAPI, settings: ServerSettings, **options) -> uvicorn.Config:
    """uvicorn's configuration of the app: the settings' address, and their time limit on a request's
    headers (server/header_timeout.py); options are uvicorn's others."""
    return uvicorn.Config(app, host=settings.host, port=settings.port,
                          http=header_timeout_protocol(settings.header_timeout_s), **options)


def create_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="tierflow", docs_url=None, redoc_url=None, openapi_url=None, lifespan=_lifespan)
    model = engine.path.stem
    generations, metrics = _Generations(engine, settings), ServerMetrics()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        admission = generations.admission
        gauges = engine_gauges(engine, admission.num_running, admission.num_queued)
        return Response(metrics.exposition(gauges), media_type=PROMETHEUS_TEXT)

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
        body = await parse_request(ChatRequest, await _read_body(request, settings.max_body_bytes))
        generations.check_chars(body.prompt_chars(), "messages")
        messages, tools = body.template_messages(), body.tool_request()
        variables = body.template_variables()
        prompt = partial(_chat_prompt, engine, messages, settings.context_shift, tools, variables)
        return await generations.answer(request, body, Reply.new(True, model), "messages", prompt, tools)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse_request(CompletionRequest, await _read_body(request, settings.max_body_bytes))
        prompt, reply = body.engine_prompt(), Reply.new(False, model)
        if isinstance(prompt, str):
            generations.check_chars(len(prompt), "prompt")
            prompt = partial(_text_prompt, engine, prompt)
        else:
            prompt = _Prompt(prompt)
        return await generations.answer(request, body, reply, "prompt", prompt)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body = await parse_request(EmbeddingRequest, await _read_body(request, settings.max_body_bytes))
        inputs = body.inputs(settings.max_embedding_inputs, engine.config.hidden_size)
        generations.check_chars(text_chars(inputs), "input")
        return await generations.embed(inputs, body.encoding_format, model)

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


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    # The chat template's worker processes start now: a burst of first chat requests would
    # otherwise start a burst of processes, competing with the event loop for the CPU.
    await asyncio.to_thread(start_render_workers)
    # What is alive when serving starts (the engine, torch, the app) lives until it ends: frozen,
    # the garbage collector's full passes skip it, which shortens each pass, a pause of the event
    # loop, from about 90 ms to a few.
    gc.freeze()
    yield


@dataclass(frozen=True)
class _Prompt:
    """A request's prompt ids, and what was left out of its messages to fit the context."""

    ids: list[int]
    shift: str | None = None  # what was left out, if anything: the X-Context-Shift header

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.shift is None else {"X-Context-Shift": self.shift}


# A prompt, or (for one whose making is slow) what makes it from the request's max_tokens.
PromptSource = _Prompt | Callable[[int], _Prompt]


def _chat_prompt(engine: Engine, messages: list[dict], context_shift: bool, tools: ToolRequest | None,
                 chat_template_kwargs: dict | None, max_tokens: int) -> _Prompt:
    """The messages' prompt (with the tools offered and the extra template variables), with
    context_shift their oldest turns dropped if they and the answer would not fit."""
    tokenize_chat = partial(engine.tokenize_chat, tools=tools, chat_template_kwargs=chat_template_kwargs)
    if not context_shift:
        return _Prompt(tokenize_chat(messages))
    fitted = fit_chat(messages, tokenize_chat, engine.context_length, max_tokens)
    if not fitted.shifted:
        return _Prompt(fitted.prompt_ids)
    shift = f"dropped {len(fitted.dropped)} messages"
    if fitted.cut_chars:
        shift += f"; cut the first {fitted.cut_chars} characters of the last answer"
    log.warning("context shift: %s of a conversation of %d, to fit the context of %d tokens", shift,
                len(messages), engine.context_length)
    return _Prompt(fitted.prompt_ids, shift)


def _text_prompt(engine: Engine, text: str, max_tokens: int) -> _Prompt:
    return _Prompt(engine.tokenize(text))


def _model_card(engine: Engine) -> dict:
    return {"id": engine.path.stem, "object": "model", "created": int(engine.path.stat().st_mtime),
            "owned_by": "tierflow"}


class _Generations:
    """Admits and runs the generation requests: the character limit and the queue first, then the
    prompt's tokenizing on a worker thread, then the generation on the engine's compute thread."""

    def __init__(self, engine: Engine, settings: ServerSettings):
        self.engine, self.max_tokens_limit = engine, settings.max_tokens_limit
        self.max_chars = settings.max_prompt_chars or CHARS_PER_POSITION * engine.context_length
        self.admission = Admission(engine.parallel, settings.max_queued)

    def check_chars(self, num_chars: int, param: str) -> None:
        """Refuses prompt text past the limit; for messages, num_chars counts their framing too."""
        if num_chars > self.max_chars:
            counted = " (each message's role and template framing count too)" if param == "messages" else ""
            raise ApiError(400, f"{param}: {num_chars} characters of prompt text{counted}; this server "
                           f"accepts at most {self.max_chars} (--max-prompt-chars)", param=param,
                           code="prompt_too_long")

    async def answer(self, request: Request, body: ChatRequest | CompletionRequest, reply: Reply,
                     param: str, source: PromptSource, tools: ToolRequest | None = None) -> Response:
        """The response to one request: param names the prompt's field in errors; the answer's
        tool calls, if tools are offered, are parsed out of its text."""
        kwargs = body.generation_kwargs(self.max_tokens_limit) | self._tool_grammar(tools)
        release = self.admission.acquire()
        try:
            prompt = await self._prompt(request, param, source, kwargs["max_tokens"])
            start = partial(self._start, param, prompt, kwargs)
            constrained = "response_format" in kwargs  # its grammar is compiled off the event loop
            astream = None if prompt is None else await _on_worker_thread(start) if constrained else start()
        except BaseException:
            release()
            raise
        headers = {} if prompt is None else prompt.headers
        trace: RequestTrace = getattr(request.state, TRACE_KEY)
        trace.stream, trace.context_shift = astream, None if prompt is None else prompt.shift
        if body.stream and astream is not None:  # the stream frees the slot when it ends
            sent = events(astream, reply, body.include_usage, param, trace, self._tool_stream(tools))
            return EventStream(sent, astream, release, headers)
        try:
            return await whole_answer(request, astream, reply, param, headers, trace,
                                       partial(self.engine.with_tool_calls, tools=tools))
        finally:
            release()

    def _tool_grammar(self, tools: ToolRequest | None) -> dict:
        """The grammar keyword that makes a required or named call well-formed; a tool whose
        parameters llguidance cannot compile is a 400."""
        try:
            grammar = self.engine.tool_grammar(tools)
        except TierflowError as error:
            raise ApiError(400, f"tools: {error}", param="tools") from None
        return {} if grammar is None else {"grammar": grammar}

    def _tool_stream(self, tools: ToolRequest | None) -> ToolCallStream | None:
        if tools is None or not tools.offered:
            return None
        return ToolCallStream(self.engine.tool_format, tools.names)

    async def embed(self, inputs: list[EmbeddingInput], encoding_format: str, model: str) -> Response:
        """The embeddings of inputs, in a queue slot like a generation: tokenized on a worker thread,
        computed on the engine's compute thread, rendered on a worker thread."""
        release = self.admission.acquire()
        try:
            ids = await _on_worker_thread(partial(self.engine.embedding_tokens, inputs))
            vectors = await self.engine.aembed(ids)
        except UnsupportedModelError as error:  # the model cannot embed: no request would do
            raise ApiError(400, str(error), param="model", code="model_not_supported") from None
        except InvalidArgumentError as error:  # an input is empty or holds a bad id
            raise ApiError(400, str(error), param="input") from None
        except TierflowError as error:
            raise engine_error(error, "input") from None
        finally:
            release()
        num_tokens = sum(len(item) for item in ids)
        rendered = await _on_worker_thread(partial(embedding_response, vectors, num_tokens, encoding_format,
                                                   model))
        return Response(rendered, media_type="application/json")

    async def _prompt(self, request: Request, param: str, source: PromptSource,
                      max_tokens: int) -> _Prompt | None:
        """The prompt, made on a worker thread; None if the client left meanwhile."""
        if isinstance(source, _Prompt):
            return source
        try:
            return await unless_disconnected(request, _on_worker_thread(partial(source, max_tokens)))
        except TierflowError as error:
            raise engine_error(error, param) from None

    def _start(self, param: str, prompt: _Prompt, kwargs: dict) -> AsyncStream:
        if "response_format" in kwargs:
            kwargs = {**kwargs, "response_format": None, "grammar": _answer_grammar(kwargs)}
        try:
            if len(prompt.ids) > self.engine.context_length:  # refused before the engine checks each id
                raise ContextLengthError(f"the prompt has {len(prompt.ids)} tokens but the context holds "
                                         f"{self.engine.context_length}")
            return self.engine.astream(prompt.ids, context_shift=prompt.shift is not None, **kwargs)
        except TierflowError as error:
            raise engine_error(error, param) from None


def _answer_grammar(kwargs: dict) -> Grammar | None:
    """The response_format's grammar, or a required or named tool call's: not both."""
    grammar, tool_grammar = response_grammar(kwargs["response_format"]), kwargs.get("grammar")
    if grammar is not None and tool_grammar is not None:
        raise ApiError(400, "a required or named tool_choice constrains the answer to a call: give no "
                       "response_format with it", param="response_format")
    return grammar or tool_grammar


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


async def _on_worker_thread(work: Callable[[], T]) -> T:
    """work() on a worker thread. A thread cannot be stopped, so a cancelled caller waits for it to
    end before it lets the cancellation through: the caller's queue slot stays held meanwhile, and
    the slots bound the threads a client can set working and then leave."""
    future = asyncio.get_running_loop().run_in_executor(None, work)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        raise


def _add_error_handlers(app: FastAPI) -> None:
    """Every error is OpenAI's body; nothing leaks a traceback."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, error: ClientDisconnect) -> Response:
        # It hung up before its request was read whole: a disconnect, not a failure. Nobody reads
        # this answer; its status is nginx's for a client that left, for the log and /metrics.
        return Response(status_code=499)

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
