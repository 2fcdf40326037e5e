"""ollama's native API on the server, as ollama's own clients use it: `/api/chat`, `/api/generate`,
`/api/embed` (and the older `/api/embeddings`), `/api/tags`, `/api/ps`, `/api/show`, `/api/version`.

A chat or generate with no messages or prompt loads the model (ollama's warm-up), and with
`keep_alive: 0` unloads it; a model stays loaded for its last request's keep_alive (the server's
when the request gives none), as in ollama.
"""

import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tierflow.runtime.api.engine import Engine
from tierflow.runtime.api.model_info import ModelCard, model_card
from tierflow.server.answers import Calls, EventStream, Finished, Part, Reasoning, Text, ndjson
from tierflow.server.apis.ollama_schema import (
    OLLAMA_VERSION,
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    ShowRequest,
    chat_chunk,
    details,
    done_fields,
    generate_chunk,
    ollama_error,
    show_body,
    tag_entry,
)
from tierflow.server.generations import ReadBody, Server, Started, chat_prompt, on_worker_thread, text_prompt
from tierflow.server.model_pool import FOREVER, ServedModel, parse_keep_alive
from tierflow.server.openai_schema import ApiError, parse_request

NDJSON = "application/x-ndjson"


def add_ollama_routes(app: FastAPI, server: Server, max_tokens_limit: int | None, context_shift: bool,
                      max_embedding_inputs: int, read_body: ReadBody) -> None:
    pool, cards = server.pool, _Cards()

    @app.get("/api/version")
    async def version() -> dict:
        return {"version": OLLAMA_VERSION}

    @app.get("/api/tags")
    async def tags() -> dict:
        return {"models": [tag_entry(model.name, await cards.of(model)) for model in pool.models.values()]}

    @app.get("/api/ps")
    async def running() -> dict:
        return {"models": [await _running_entry(model, await cards.of(model)) for model in pool.loaded()]}

    @app.post("/api/show")
    async def show(request: Request) -> dict:
        body = await parse_request(ShowRequest, await read_body(request))
        model = pool.find(body.requested)
        return show_body(await cards.of(model))

    @app.post("/api/chat")
    async def chat(request: Request) -> Response:
        body = await parse_request(ChatRequest, await read_body(request))
        keep_alive = parse_keep_alive(body.keep_alive)
        if not body.messages:
            return await _load_or_unload(server, body.model, keep_alive, chat=True)
        tools, variables = body.tool_request(), body.template_variables()
        kwargs = body.generation_kwargs(max_tokens_limit)

        def prompt(engine: Engine):
            return partial(chat_prompt, engine, body.template_messages, context_shift, tools, variables)

        started = await server.begin(request, body.model, kwargs, "messages", prompt, body.prompt_chars(),
                                     keep_alive, tools)
        return await _answer(request, started, body.stream, tools, chat=True)

    @app.post("/api/generate")
    async def generate(request: Request) -> Response:
        body = await parse_request(GenerateRequest, await read_body(request))
        body.refuse_unhonoured()
        keep_alive = parse_keep_alive(body.keep_alive)
        if not body.prompt:
            return await _load_or_unload(server, body.model, keep_alive, chat=False)
        kwargs = body.generation_kwargs(max_tokens_limit)
        if body.raw:
            def prompt(engine: Engine):
                return partial(text_prompt, engine, body.prompt)
        else:  # the prompt as a user's message, in the model's template, as ollama does
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
                {"role": "user", "content": body.prompt}]
            variables = body.template_variables()

            def prompt(engine: Engine):
                return partial(chat_prompt, engine, lambda: messages, context_shift, None, variables)

        chars = len(body.prompt) + len(body.system or "")
        started = await server.begin(request, body.model, kwargs, "prompt", prompt, chars, keep_alive)
        return await _answer(request, started, body.stream, None, chat=False)

    @app.post("/api/embed")
    async def embed(request: Request) -> dict:
        body = await parse_request(EmbedRequest, await read_body(request))
        started = time.perf_counter()
        def inputs(engine: Engine) -> list[str]:
            return body.inputs(max_embedding_inputs, engine.config.hidden_size)

        vectors, num_tokens, name = await server.embed(body.model, inputs, parse_keep_alive(body.keep_alive))
        return {"model": name, "embeddings": vectors.tolist(), "prompt_eval_count": num_tokens,
                "total_duration": int((time.perf_counter() - started) * 1e9), "load_duration": 0}

    @app.post("/api/embeddings")
    async def embeddings(request: Request) -> dict:
        body = await parse_request(EmbeddingsRequest, await read_body(request))
        vectors, _, _ = await server.embed(body.model, lambda engine: [body.prompt],
                                           parse_keep_alive(body.keep_alive))
        return {"embedding": vectors[0].tolist()}


async def _load_or_unload(server: Server, name: str, keep_alive: float | None, chat: bool) -> JSONResponse:
    """ollama's warm-up (a request with nothing to answer loads the model) and, with keep_alive 0,
    its unload."""
    model = server.pool.find(name)
    if keep_alive == 0:
        if model.users == 0:
            await server.pool.unload(model)
        reason = "unload"
    else:
        lease = await server.pool.acquire(name, keep_alive)
        lease.release()
        reason = "load"
    body = chat_chunk(model.name) if chat else generate_chunk(model.name)
    return JSONResponse(body | {"done": True, "done_reason": reason})


async def _answer(request: Request, started: Started, stream: bool, tools, chat: bool) -> Response:
    trace, param = started.traced(request), "messages" if chat else "prompt"
    if stream and started.astream is not None:
        lines = _lines(started.parts(trace, param, tools), started, chat)
        return EventStream(lines, started.astream, started.release, started.headers, media_type=NDJSON)
    answered = await started.whole(request, trace, param, tools)
    if answered is None:
        return Response(status_code=499)
    result, thought = answered
    if chat:
        body = chat_chunk(started.model, result.text, thought, result.tool_calls)
    else:
        body = generate_chunk(started.model, result.text, thought)
    return JSONResponse(body | _done(started, result), headers=started.headers)


async def _lines(answer: AsyncIterator[Part], started: Started, chat: bool) -> AsyncIterator[str]:
    """ollama's stream: an object per piece, the last one `done` with the timings; a failure is an
    `error` line that ends it."""
    try:
        async for part in answer:
            if isinstance(part, Text) and part.text:
                yield ndjson(chat_chunk(started.model, part.text) if chat else
                             generate_chunk(started.model, part.text))
            elif isinstance(part, Reasoning):
                yield ndjson(chat_chunk(started.model, thinking=part.text) if chat else
                             generate_chunk(started.model, thinking=part.text))
            elif isinstance(part, Calls):
                yield ndjson(chat_chunk(started.model, tool_calls=part.calls))
            elif isinstance(part, Finished):
                last = chat_chunk(started.model) if chat else generate_chunk(started.model)
                yield ndjson(last | _done(started, part.result))
    except ApiError as error:
        yield ndjson(ollama_error(error))


def _done(started: Started, result) -> dict:
    total = time.perf_counter() - started.started_at + started.load_seconds
    return done_fields(result, started.load_seconds, total)


async def _running_entry(model: ServedModel, card: ModelCard) -> dict:
    if model.expires_at is not None:
        expires = datetime.fromtimestamp(model.expires_at, timezone.utc)
    elif model.keep_alive_s == FOREVER or model.users:
        expires = datetime(2318, 1, 1, tzinfo=timezone.utc)  # ollama's "forever" is far in the future
    else:
        expires = datetime.now(timezone.utc)
    size = model.held("cpu") + model.held("gpu")
    return {"name": model.name, "model": model.name, "size": size, "digest": "", "details": details(card),
            "expires_at": expires.isoformat().replace("+00:00", "Z"), "size_vram": model.held("gpu"),
            "context_length": model.engine.context_length}


class _Cards:
    """Each served file's card, read once (a header: a few ms) on a worker thread."""

    def __init__(self) -> None:
        self._cards: dict[str, ModelCard] = {}

    async def of(self, model: ServedModel) -> ModelCard:
        if model.source not in self._cards:
            try:
                self._cards[model.source] = await on_worker_thread(partial(model_card, model.source))
            except Exception as error:
                message = f"the model {model.name!r} cannot be read: {error}"
                raise ApiError(500, message, type="server_error") from None
        return self._cards[model.source]

